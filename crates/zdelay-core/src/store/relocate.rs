//! Relocation of a route lane (storage layout 2): when a route's list moves to another hash
//! slot, its old lane is retired (`retire_lane`: every lane script refuses it from then on, so
//! nothing enters or leaves it but through here) and what it still holds — waiting jobs, dead
//! letters, schedules, `unique_for` windows and debounce deadlines — moves into the route's
//! live lane with the transit protocol `zdelay upgrade` uses:
//!
//! 1. the windows are copied first (`ZADD GT`: a re-run or an older copy never shortens one),
//!    so an enqueue into the new lane meets a window before the job it guards arrives;
//! 2. a batch is read from the retired lane (earliest due first, then dead letters, schedules,
//!    payloads of neither), written into the live lane by `upgrade_put_lane`, which records
//!    each id in the live lane's `transit_in` and skips ids already there (put by an earlier
//!    run, maybe delivered since) or held there (a newer job under the same id);
//! 3. the batch is forgotten in the retired lane (`relocate_drop_lane`);
//! 4. once the retired lane holds nothing, it is ended and `transit_in` is deleted.
//!
//! A crash anywhere leaves every job in the retired lane, in the live one, or in both with its
//! id in `transit_in`; the next run finishes. One run at a time holds the live lane's
//! `relocating` lock, which every put checks and extends, so a run that stalled past it
//! cannot write after another finished and deleted `transit_in`. A job keeps its due score, so
//! none is delivered early; between put and forget it is in both lanes, but only the live one
//! is delivered.

use super::scripts::{self, LaneRecord};
use super::{Conn, StoreError};
use crate::keys::{Keys, LaneKeys};
use crate::lane::{Lane, RetiredLane};
use std::time::Duration;

/// Ids read from the retired lane per round.
const BATCH: usize = 500;
/// Bytes of records per put call.
const PUT_BYTES: usize = 256 << 10;
/// How long the relocation lock lasts without a put extending it (`upgrade_put_lane` extends
/// it by the same): short, so a run killed mid-way is taken over soon.
const LOCK_MS: u64 = 10_000;
/// How often a run that finds the lock taken looks again.
const LOCK_WAIT: Duration = Duration::from_millis(200);

/// What a relocation moved.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Relocated {
    /// Jobs, dead jobs and schedules written into the live lane.
    pub moved: u64,
    /// Ids an earlier run had put already (a run after a crash).
    pub put_before: u64,
    /// Ids the live lane held already as a newer job or schedule (it stays).
    pub superseded: u64,
    /// `unique_for` windows and debounce deadlines copied.
    pub windows: u64,
}

impl Relocated {
    fn add(&mut self, other: Relocated) {
        self.moved += other.moved;
        self.put_before += other.put_before;
        self.superseded += other.superseded;
        self.windows += other.windows;
    }
}

/// Whether any of `retired` still holds something (jobs, dead letters, schedules, windows):
/// a relocation is unfinished.
pub async fn unfinished(
    con: &mut Conn,
    keys: &Keys,
    retired: &[&RetiredLane],
) -> Result<bool, StoreError> {
    for lane in retired {
        if holds_anything(con, &lane.keys(keys.namespace())).await? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Moves whatever the retired lanes `retired` (of `lane`'s route) still hold into `lane`, the
/// route's live lane, and ends them. Waits while another run holds the lock (it finishes or
/// its lock runs out). Safe to run at any time, by any number of processes at once.
pub async fn relocate(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    retired: &[&RetiredLane],
) -> Result<Relocated, StoreError> {
    let mut total = Relocated::default();
    for source in retired {
        let source = source.keys(keys.namespace());
        if source.marker == lane.keys.marker {
            // The same keys: the route's list moved back to this slot, and they are live.
            continue;
        }
        total.add(relocate_one(con, keys, lane, &source).await?);
    }
    Ok(total)
}

async fn relocate_one(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    source: &LaneKeys,
) -> Result<Relocated, StoreError> {
    let token = format!("{}-{:016x}", std::process::id(), rand::random::<u64>());
    loop {
        let marker: Option<String> = redis::cmd("GET")
            .arg(&source.marker)
            .query_async(con)
            .await?;
        let Some(marker) = marker.filter(|m| m.starts_with("retired ")) else {
            // Never registered, or live again: nothing to relocate from.
            return Ok(Relocated::default());
        };
        if !holds_anything(con, source).await? {
            return Ok(Relocated::default());
        }
        let locked: Option<String> = redis::cmd("SET")
            .arg(&lane.keys.relocating)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(LOCK_MS)
            .query_async(con)
            .await?;
        if locked.is_none() {
            tokio::time::sleep(LOCK_WAIT).await;
            continue;
        }
        let run = run(con, keys, lane, source, &marker, &token).await;
        let _ = scripts::unlock(con, &lane.keys.relocating, &token).await;
        match run {
            Ok(done) => return Ok(done),
            // Another run took over (this one stalled past the lock), or the retired lane's
            // marker was rewritten (a later retirement naming another successor): look again.
            Err(StoreError::Redis(e))
                if matches!(e.code(), Some("ZDELAY_RELOCATING" | "ZDELAY_LANE_MOVED")) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Whether a lane's keys hold a waiting or dead job, a schedule, a payload or a window.
async fn holds_anything(con: &mut Conn, k: &LaneKeys) -> Result<bool, StoreError> {
    let n: u64 = redis::cmd("EXISTS")
        .arg(&k.due)
        .arg(&k.dead)
        .arg(&k.schedules)
        .arg(&k.jobs)
        .arg(&k.windows)
        .arg(&k.unique)
        .query_async(con)
        .await?;
    Ok(n > 0)
}

async fn run(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    source: &LaneKeys,
    marker: &str,
    token: &str,
) -> Result<Relocated, StoreError> {
    let mut done = Relocated {
        windows: copy_windows(con, source, &lane.keys).await?,
        ..Relocated::default()
    };
    loop {
        let ids = next_ids(con, source).await?;
        if ids.is_empty() {
            break;
        }
        let records = read_records(con, source, &ids).await?;
        for call in sized(&records) {
            let put = scripts::upgrade_put_lane(con, lane, Some(token), call).await?;
            done.moved += put.written;
            done.put_before += put.put_before;
            done.superseded += put.held;
        }
        wake(con, keys, lane, &records).await?;
        crate::failpoint::hold("relocate_after_put").await;
        scripts::relocate_drop_lane(con, source, marker, &ids).await?;
    }
    let mut ended = scripts::relocate_drop_lane(con, source, marker, &[]).await?;
    while ended == 2 {
        ended = scripts::relocate_drop_lane(con, source, marker, &[]).await?;
    }
    if ended == 1 {
        // Nothing is left to put: no id can arrive twice any more.
        let _: u64 = redis::cmd("UNLINK")
            .arg(&lane.keys.transit_in)
            .query_async(con)
            .await?;
    }
    Ok(done)
}

/// Copies every window of the retired lane (`u:<id>` after a delivery, `d:<id>` for a
/// debounced job) into the live lane, keeping the later of two.
async fn copy_windows(con: &mut Conn, from: &LaneKeys, to: &LaneKeys) -> Result<u64, StoreError> {
    let mut copied = 0;
    let mut start = 0;
    loop {
        let page: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("ZRANGE")
            .arg(&from.windows)
            .arg(start)
            .arg(start + BATCH - 1)
            .arg("WITHSCORES")
            .query_async(con)
            .await?;
        if page.is_empty() {
            return Ok(copied);
        }
        let mut add = redis::cmd("ZADD");
        add.arg(&to.windows).arg("GT");
        for (member, score) in &page {
            add.arg(score).arg(member);
        }
        let _: u64 = add.query_async(con).await?;
        copied += page.len() as u64;
        start += BATCH;
    }
}

/// The next ids to move: the earliest waiting jobs, then dead jobs, then schedules, then
/// payloads stored for neither (kept as they are: an operator may want to look at them).
async fn next_ids(con: &mut Conn, k: &LaneKeys) -> Result<Vec<Vec<u8>>, StoreError> {
    for zset in [&k.due, &k.dead] {
        let ids: Vec<Vec<u8>> = redis::cmd("ZRANGE")
            .arg(zset)
            .arg(0)
            .arg(BATCH - 1)
            .query_async(con)
            .await?;
        if !ids.is_empty() {
            return Ok(ids);
        }
    }
    for hash in [&k.schedules, &k.jobs] {
        // Forgotten ids leave the hash, so a scan from the start finds the rest.
        let (_, fields): (String, Vec<Vec<u8>>) = redis::cmd("HSCAN")
            .arg(hash)
            .arg(0)
            .arg("COUNT")
            .arg(BATCH)
            .query_async(con)
            .await?;
        if !fields.is_empty() {
            // HSCAN answers field, value pairs.
            return Ok(fields.into_iter().step_by(2).collect());
        }
    }
    Ok(Vec::new())
}

/// Everything the retired lane keeps of `ids`, one command per key for the batch.
async fn read_records(
    con: &mut Conn,
    k: &LaneKeys,
    ids: &[Vec<u8>],
) -> Result<Vec<LaneRecord>, StoreError> {
    type Column = Vec<Option<Vec<u8>>>;
    let mut pipe = redis::pipe();
    for (command, key) in [
        ("ZMSCORE", &k.due),
        ("HMGET", &k.jobs),
        ("HMGET", &k.meta),
        ("HMGET", &k.maxlate),
        ("ZMSCORE", &k.dead),
        ("HMGET", &k.reasons),
        ("HMGET", &k.history),
        ("HMGET", &k.schedules),
        ("HMGET", &k.sched_env),
        ("ZMSCORE", &k.sched_due),
        ("ZMSCORE", &k.sched_fired),
        ("HMGET", &k.sched_quarantine),
        ("HMGET", &k.unique),
    ] {
        pipe.cmd(command).arg(key).arg(ids);
    }
    let columns: Vec<Column> = pipe.query_async(con).await?;
    let mut columns = columns.into_iter().map(Vec::into_iter).collect::<Vec<_>>();
    let mut next = |c: usize| columns[c].next().flatten();
    Ok(ids
        .iter()
        .map(|id| LaneRecord {
            id: id.clone(),
            due: next(0),
            payload: next(1),
            meta: next(2),
            max_lateness: next(3),
            dead: next(4),
            reason: next(5),
            history: next(6),
            schedule: next(7),
            schedule_envelope: next(8),
            next_occurrence: next(9),
            sched_fired: next(10),
            sched_quarantine: next(11),
            unique_for: next(12),
        })
        .collect())
}

/// `records` in calls of at most [`PUT_BYTES`] (one record alone may be larger).
fn sized(records: &[LaneRecord]) -> Vec<&[LaneRecord]> {
    let mut calls = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, record) in records.iter().enumerate() {
        if i > start && bytes + record.size() > PUT_BYTES {
            calls.push(&records[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += record.size();
    }
    if start < records.len() {
        calls.push(&records[start..]);
    }
    calls
}

/// Wakes the live lane's mover for the earliest due put, so it need not wait for its poll.
async fn wake(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    records: &[LaneRecord],
) -> Result<(), StoreError> {
    let earliest = records
        .iter()
        .filter_map(|r| {
            std::str::from_utf8(r.due.as_deref()?)
                .ok()?
                .parse::<f64>()
                .ok()
        })
        .min_by(f64::total_cmp);
    if let Some(due) = earliest {
        let _: u64 = redis::cmd("PUBLISH")
            .arg(keys.wake_channel())
            .arg(format!("{} {}", lane.wake_name(), due as i64))
            .query_async(con)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(bytes: usize) -> LaneRecord {
        LaneRecord {
            id: b"i".to_vec(),
            payload: Some(vec![0; bytes - 1]),
            ..LaneRecord::default()
        }
    }

    #[test]
    fn calls_hold_at_most_the_byte_budget_and_every_record_once() {
        // A reference: greedy packing, one record alone may exceed the budget.
        for round in 0..200u64 {
            let mut seed = 7 + round;
            let records: Vec<LaneRecord> = (0..(seed % 40) as usize)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    record(1 + (seed >> 33) as usize % (PUT_BYTES / 3))
                })
                .collect();
            let calls = sized(&records);
            assert_eq!(calls.iter().map(|c| c.len()).sum::<usize>(), records.len());
            for call in &calls {
                let bytes: usize = call.iter().map(LaneRecord::size).sum();
                assert!(call.len() == 1 || bytes <= PUT_BYTES, "{bytes}");
                assert!(!call.is_empty());
            }
        }
        assert!(sized(&[]).is_empty());
    }
}
