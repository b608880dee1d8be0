//! Loading jobs before any clock starts (filling a ZSET runs at ~200k/s and must not count).

use super::ROUTE;
use indicatif::{ProgressBar, ProgressStyle};
use zdelay_core::lane_id::LaneId;
use zdelay_core::store::Conn;
use zdelay_core::{Client, NewJob, OnConflict};

pub(super) const MIN_PAYLOAD: usize = 13;

/// A unique payload of at least `size` bytes: the index, then padding.
pub(super) fn payload(i: u64, size: usize) -> Vec<u8> {
    let mut p = format!("{i:012}-").into_bytes();
    p.resize(size.max(p.len()), b'x');
    p
}

/// A steady-mode payload: "<due ms> <seq> " then padding, so the consumer can check it.
pub(super) fn steady_payload(due_ms: i64, seq: u64, size: usize) -> Vec<u8> {
    let mut p = format!("{due_ms} {seq} ").into_bytes();
    p.resize(size.max(p.len()), b'x');
    p
}

/// Parses `steady_payload`.
pub(super) fn parse_steady_payload(p: &[u8]) -> Option<(i64, u64)> {
    let text = std::str::from_utf8(p.get(..p.len().min(48))?).ok()?;
    let mut parts = text.split(' ');
    let due = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    Some((due, seq))
}

pub(super) fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>28} [{bar:30}] {human_pos}/{human_len} ({per_sec}, eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

pub(super) fn status(line: &str) {
    eprintln!("bench: {line}");
}

/// Backlog due times: spread over the two minutes before `now_ms`, oldest first.
pub(super) fn backlog_due(i: u64, n: u64, now_ms: i64) -> i64 {
    now_ms - 120_000 + (i as i64 * 60_000) / n.max(1) as i64
}

/// ZADDs `n` unique members (payloads) into `key`, scored by `due(i)`.
pub(super) async fn load_raw(
    con: &mut Conn,
    key: &str,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> redis::RedisResult<()> {
    let progress = bar(n, what);
    let mut i = 0;
    while i < n {
        let mut pipe = redis::pipe();
        let end = (i + 20_000).min(n);
        while i < end {
            let stop = (i + 1_000).min(end);
            let cmd = pipe.cmd("ZADD").arg(key);
            for j in i..stop {
                cmd.arg(due(j)).arg(payload(j, size));
            }
            cmd.ignore();
            progress.inc(stop - i);
            i = stop;
        }
        let _: () = pipe.query_async(con).await?;
    }
    progress.finish_and_clear();
    Ok(())
}

/// Enqueues `n` jobs for the bench route through the client; returns their ids in order.
pub(super) async fn load_jobs(
    producer: &Client,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> anyhow::Result<Vec<String>> {
    load_jobs_to(producer, ROUTE, n, size, due, what).await
}

/// Enqueues `n` jobs for `dest` through the client; returns their ids in order.
pub(super) async fn load_jobs_to(
    producer: &Client,
    dest: &str,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> anyhow::Result<Vec<String>> {
    let progress = bar(n, what);
    let mut ids = Vec::with_capacity(n as usize);
    let mut i = 0;
    while i < n {
        let end = (i + 20_000).min(n);
        let jobs: Vec<NewJob> = (i..end)
            .map(|j| NewJob::new(dest, payload(j, size)).at(due(j)))
            .collect();
        for r in producer.enqueue_batch(jobs, OnConflict::Replace).await? {
            ids.push(r?.0);
        }
        progress.inc(end - i);
        i = end;
    }
    progress.finish_and_clear();
    Ok(ids)
}

/// The stored ids of jobs the client enqueued into a lane (`~<lane>.<stored id>`): what
/// the lane's ZSET and HASH hold.
pub(super) fn stored_ids(ids: &[String]) -> anyhow::Result<Vec<String>> {
    ids.iter()
        .map(|id| {
            let parsed = LaneId::parse(id)
                .map_err(|e| anyhow::anyhow!("job id {id} is not a generated lane id: {e}"))?;
            Ok(parsed.stored.as_str().to_owned())
        })
        .collect()
}

/// Writes the same jobs in the bare layout: `ids` in one id ZSET + payload HASH.
pub(super) async fn load_bare_hash(
    con: &mut Conn,
    (due_key, jobs_key): (&str, &str),
    ids: &[String],
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> redis::RedisResult<()> {
    let progress = bar(ids.len() as u64, what);
    for (c, chunk) in ids.chunks(10_000).enumerate() {
        let base = (c * 10_000) as u64;
        let mut pipe = redis::pipe();
        for part in (0..chunk.len()).step_by(1_000) {
            let part = part..(part + 1_000).min(chunk.len());
            let zadd = pipe.cmd("ZADD").arg(due_key);
            for k in part.clone() {
                zadd.arg(due(base + k as u64)).arg(chunk[k].as_str());
            }
            zadd.ignore();
            let hset = pipe.cmd("HSET").arg(jobs_key);
            for k in part {
                hset.arg(chunk[k].as_str())
                    .arg(payload(base + k as u64, size));
            }
            hset.ignore();
        }
        let _: () = pipe.query_async(con).await?;
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_unique_and_sized() {
        assert_eq!(payload(7, 100).len(), 100);
        assert_ne!(payload(7, 100), payload(8, 100));
        assert_eq!(payload(7, 1).len(), MIN_PAYLOAD);
        let p = steady_payload(1_700_000_000_123, 42, 100);
        assert_eq!(p.len(), 100);
        assert_eq!(parse_steady_payload(&p), Some((1_700_000_000_123, 42)));
        assert_eq!(parse_steady_payload(b"nonsense"), None);
    }

    #[test]
    fn stored_ids_are_what_the_lane_holds() {
        let stored: Vec<String> = (0..3)
            .map(|i| {
                let id = zdelay_core::lane_id::StoredId::from_parts(600_000_000_000, 0x155, i);
                id.expect("fields in range").as_str().to_owned()
            })
            .collect();
        let public: Vec<String> = stored.iter().map(|s| format!("~1k.{s}")).collect();
        assert_eq!(stored_ids(&public).unwrap(), stored);
        let err = stored_ids(&[public[0].clone(), "user-chosen".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("user-chosen"), "{err}");
    }

    #[test]
    fn backlog_is_due_and_ascending() {
        let now = 1_000_000_000_000;
        let d: Vec<i64> = (0..5).map(|i| backlog_due(i, 5, now)).collect();
        assert!(d.windows(2).all(|w| w[0] < w[1]));
        assert!(d.iter().all(|&x| x < now - 60_000));
    }
}
