//! Recent activity per minute, shared by every daemon of a namespace through one small HASH
//! (`Keys::activity`): jobs delivered, and deliveries per lateness bucket (the observations
//! of `zdelay_lateness_seconds`, bucketed by `LATENESS_BOUNDS_MS`). Pollers count into this
//! process's tally (no Redis call on the hot path); the stats sampler adds the tally to the
//! hash with HINCRBY, so instances add up, and prunes minutes older than [`KEEP_MINUTES`].
//! `zdelay forecast` reads the delivery rate from it, the console the throughput and the
//! lateness percentiles. Minutes are the daemons' clocks' (epoch ms / 60 000).

use crate::metrics::LATENESS_BOUNDS_MS;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Mutex;
use zdelay_core::keys::Keys;
use zdelay_core::store::Conn;

/// Minutes kept in the hash: the last hour's rate needs 60, the rest is slack.
pub const KEEP_MINUTES: i64 = 120;
/// The window the spike warning's drain rate is measured over.
pub const RATE_WINDOW_MINUTES: i64 = 60;
/// The window of the lateness percentiles shown as "recent".
pub const LATENESS_WINDOW_MINUTES: i64 = 5;

const BUCKETS: usize = LATENESS_BOUNDS_MS.len() + 1;

#[derive(Default, Clone, Copy, PartialEq, Debug)]
struct MinuteTally {
    delivered: u64,
    late: [u64; BUCKETS],
}

/// What this process counted and has not written yet, by minute.
static PENDING: Mutex<BTreeMap<i64, MinuteTally>> = Mutex::new(BTreeMap::new());

fn minute_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64 / 60_000)
        .unwrap_or_default()
}

fn with_minute(f: impl FnOnce(&mut MinuteTally)) {
    let mut pending = PENDING.lock().expect("activity lock");
    let now = minute_now();
    f(pending.entry(now).or_default());
    // Nobody flushes in `zdelay-bench`: keep the tally bounded anyway.
    while pending.len() > KEEP_MINUTES as usize {
        pending.pop_first();
    }
}

/// Counts jobs delivered (a local move, a confirmed publish).
pub fn delivered(jobs: u64) {
    if jobs > 0 {
        with_minute(|t| t.delivered += jobs);
    }
}

/// Counts lateness observations per bucket (`buckets[k]` jobs in bucket `k`, the last one
/// over the largest bound), as the move scripts report them.
pub fn lateness_buckets(buckets: &[u64]) {
    if buckets.iter().all(|&n| n == 0) {
        return;
    }
    with_minute(|t| {
        for (slot, n) in t.late.iter_mut().zip(buckets) {
            *slot += n;
        }
    });
}

/// Counts one lateness observation.
pub fn lateness_ms(late_ms: i64) {
    let k = bucket_of(late_ms);
    with_minute(|t| t.late[k] += 1);
}

fn bucket_of(late_ms: i64) -> usize {
    let late = late_ms.max(0) as u64;
    LATENESS_BOUNDS_MS
        .iter()
        .position(|&b| late <= b)
        .unwrap_or(LATENESS_BOUNDS_MS.len())
}

/// Adds this process's tally to the namespace's hash and prunes old minutes. On an error
/// the tally is put back, to be added by the next flush.
pub async fn flush(con: &mut Conn, keys: &Keys) -> redis::RedisResult<()> {
    let taken = std::mem::take(&mut *PENDING.lock().expect("activity lock"));
    let key = keys.activity();
    let oldest_kept = minute_now() - KEEP_MINUTES;
    let mut pipe = redis::pipe();
    for (minute, tally) in &taken {
        if tally.delivered > 0 {
            pipe.hincr(&key, format!("{minute}:delivered"), tally.delivered)
                .ignore();
        }
        for (k, &n) in tally.late.iter().enumerate() {
            if n > 0 {
                pipe.hincr(&key, format!("{minute}:late{k}"), n).ignore();
            }
        }
    }
    pipe.cmd("HKEYS").arg(&key);
    let fields: Vec<Vec<String>> = match pipe.query_async(con).await {
        Ok(v) => v,
        Err(e) => {
            let mut pending = PENDING.lock().expect("activity lock");
            for (minute, tally) in taken {
                let slot = pending.entry(minute).or_default();
                slot.delivered += tally.delivered;
                for (a, b) in slot.late.iter_mut().zip(tally.late) {
                    *a += b;
                }
            }
            return Err(e);
        }
    };
    let stale: Vec<&String> = fields
        .iter()
        .flatten()
        .filter(|f| parse_field(f).is_none_or(|(minute, _)| minute < oldest_kept))
        .collect();
    if !stale.is_empty() {
        redis::cmd("HDEL")
            .arg(&key)
            .arg(stale)
            .query_async::<()>(con)
            .await?;
    }
    Ok(())
}

/// A field `<minute>:delivered` or `<minute>:late<k>`: (minute, None for delivered or
/// Some(k)).
fn parse_field(field: &str) -> Option<(i64, Option<usize>)> {
    let (minute, what) = field.split_once(':')?;
    let minute = minute.parse().ok()?;
    if what == "delivered" {
        return Some((minute, None));
    }
    let k: usize = what.strip_prefix("late")?.parse().ok()?;
    (k < BUCKETS).then_some((minute, Some(k)))
}

/// One minute as the console shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Minute {
    /// The minute's start, epoch ms.
    pub start_ms: i64,
    pub delivered: u64,
}

/// The recent activity of a namespace.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Recent {
    /// The last [`RATE_WINDOW_MINUTES`] minutes, oldest first (minutes without deliveries
    /// included, as 0).
    pub minutes: Vec<Minute>,
    /// Deliveries per second over the last hour's minutes, measured from the first minute
    /// with any record (so a daemon up for 5 minutes is not diluted over 60); `None`
    /// without any record.
    pub delivery_rate_per_s: Option<f64>,
    /// Lateness over the last [`LATENESS_WINDOW_MINUTES`] minutes, as the upper bound of
    /// the bucket holding the percentile (ms); `None` without observations, and the largest
    /// bound with `over: true` when it lies beyond it.
    pub lateness: Lateness,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Lateness {
    pub window_minutes: i64,
    pub observations: u64,
    pub p50_ms: Option<u64>,
    pub p99_ms: Option<u64>,
    /// A percentile lies beyond the largest bucket bound (then it is reported as that bound).
    pub over: bool,
}

/// Reads the namespace's recent activity (one HGETALL of at most a few thousand fields).
pub async fn read(con: &mut Conn, keys: &Keys, now_ms: i64) -> redis::RedisResult<Recent> {
    let fields: Vec<(String, u64)> = redis::cmd("HGETALL")
        .arg(keys.activity())
        .query_async(con)
        .await?;
    Ok(summarize(&fields, now_ms / 60_000))
}

fn summarize(fields: &[(String, u64)], now_minute: i64) -> Recent {
    let mut by_minute: BTreeMap<i64, MinuteTally> = BTreeMap::new();
    for (field, n) in fields {
        let Some((minute, what)) = parse_field(field) else {
            continue;
        };
        let t = by_minute.entry(minute).or_default();
        match what {
            None => t.delivered += n,
            Some(k) => t.late[k] += n,
        }
    }
    let first = now_minute - RATE_WINDOW_MINUTES + 1;
    let minutes: Vec<Minute> = (first..=now_minute)
        .map(|m| Minute {
            start_ms: m * 60_000,
            delivered: by_minute.get(&m).map_or(0, |t| t.delivered),
        })
        .collect();
    // The rate covers whole minutes up to the current one, from the first one recorded.
    let recorded_from = by_minute.range(first..=now_minute).next().map(|(m, _)| *m);
    let delivery_rate_per_s = recorded_from.map(|from| {
        let total: u64 = by_minute
            .range(from..=now_minute)
            .map(|(_, t)| t.delivered)
            .sum();
        total as f64 / ((now_minute - from + 1) * 60) as f64
    });
    let mut late = [0u64; BUCKETS];
    for (_, t) in by_minute.range(now_minute - LATENESS_WINDOW_MINUTES + 1..=now_minute) {
        for (a, b) in late.iter_mut().zip(t.late) {
            *a += b;
        }
    }
    let observations: u64 = late.iter().sum();
    let (p50, over50) = percentile(&late, 0.50);
    let (p99, over99) = percentile(&late, 0.99);
    Recent {
        minutes,
        delivery_rate_per_s,
        lateness: Lateness {
            window_minutes: LATENESS_WINDOW_MINUTES,
            observations,
            p50_ms: p50,
            p99_ms: p99,
            over: over50 || over99,
        },
    }
}

/// The upper bound of the bucket holding quantile `q`, and whether it lies past the largest
/// bound.
fn percentile(late: &[u64; BUCKETS], q: f64) -> (Option<u64>, bool) {
    let total: u64 = late.iter().sum();
    if total == 0 {
        return (None, false);
    }
    let rank = ((total as f64 * q).ceil() as u64).max(1);
    let mut seen = 0;
    for (k, &n) in late.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return match LATENESS_BOUNDS_MS.get(k) {
                Some(&bound) => (Some(bound), false),
                None => (LATENESS_BOUNDS_MS.last().copied(), true),
            };
        }
    }
    (None, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(items: &[(&str, u64)]) -> Vec<(String, u64)> {
        items.iter().map(|(f, n)| (f.to_string(), *n)).collect()
    }

    #[test]
    fn buckets_follow_the_lateness_bounds() {
        assert_eq!(bucket_of(-5), 0);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(2), 1);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(300_000), LATENESS_BOUNDS_MS.len() - 1);
        assert_eq!(bucket_of(300_001), LATENESS_BOUNDS_MS.len());
    }

    #[test]
    fn fields_parse_and_refuse_strangers() {
        assert_eq!(parse_field("100:delivered"), Some((100, None)));
        assert_eq!(parse_field("100:late3"), Some((100, Some(3))));
        assert_eq!(parse_field("100:late99"), None);
        assert_eq!(parse_field("x:delivered"), None);
        assert_eq!(parse_field("100:other"), None);
    }

    #[test]
    fn rate_is_measured_from_the_first_recorded_minute() {
        // 600 deliveries over minutes 98..=100 (3 minutes): 600 / 180 s.
        let f = fields(&[
            ("98:delivered", 300),
            ("100:delivered", 300),
            ("10:delivered", 1_000_000), // outside the hour
        ]);
        let r = summarize(&f, 100);
        assert_eq!(r.minutes.len(), RATE_WINDOW_MINUTES as usize);
        assert_eq!(r.minutes.last().unwrap().delivered, 300);
        assert_eq!(r.minutes[r.minutes.len() - 2].delivered, 0);
        let rate = r.delivery_rate_per_s.unwrap();
        assert!((rate - 600.0 / 180.0).abs() < 1e-9, "{rate}");
        assert_eq!(summarize(&[], 100).delivery_rate_per_s, None);
    }

    #[test]
    fn percentiles_are_bucket_upper_bounds() {
        // 98 jobs within 5 ms (bucket 2), 2 within 1 s (bucket 9): p50 5 ms, p99 1000 ms.
        let f = fields(&[("100:late2", 98), ("99:late9", 2), ("90:late15", 500)]);
        let r = summarize(&f, 100);
        assert_eq!(r.lateness.observations, 100);
        assert_eq!(r.lateness.p50_ms, Some(5));
        assert_eq!(r.lateness.p99_ms, Some(1_000));
        assert!(!r.lateness.over);
        let over = summarize(&fields(&[("100:late16", 1)]), 100);
        assert_eq!(over.lateness.p99_ms, Some(300_000));
        assert!(over.lateness.over);
        assert_eq!(summarize(&[], 100).lateness.p50_ms, None);
    }
}
