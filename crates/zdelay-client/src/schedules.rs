//! Recurring schedules in Redis: create or update (upsert by id), read, pause, resume,
//! delete, and fire.
//!
//! A schedule lives in its shard (`keys::Keys::shard_of(id)`): its definition
//! (`{ns:s}:schedules`, `"<version>\n<JSON>"`), the envelope each occurrence carries
//! (`{ns:s}:sched_env`) and its next occurrence (`{ns:s}:sched_due`, one member per
//! schedule, so there is never more than one pending occurrence). Writes are
//! compare-and-set on the version: the next occurrence is computed here (cron needs IANA
//! zones, which Lua does not have) from the definition read, and written only if nobody
//! changed it since.
//!
//! Firing ([`fire_due`], called by each shard's mover): the due schedules are read, each is
//! planned ([`crate::schedule::Schedule::plan`]: misfire policy, max lateness, the next
//! occurrence), and one script turns the planned occurrences into ordinary jobs and writes
//! the next occurrence, fenced on the occurrence and version read. Two daemons firing the
//! same schedule: the second is fenced. A crash between reading and firing: nothing was
//! written, the next call fires it.

use crate::client::{Client, ClientError, read_fence};
use crate::envelope::Envelope;
use crate::job::{Due, OnConflict};
use crate::keys::{ShardKeys, occurrence_id, valid_schedule_id};
use crate::schedule::{Schedule, ScheduleDef};
use crate::store::scripts::{
    self, DueSchedule, EnqueueCall, EnqueueItem, Fired, Firing, ScheduleWrite, Upserted,
};
use crate::store::{self, Conn};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// Compare-and-set attempts before an upsert gives up.
const CAS_ATTEMPTS: usize = 64;
/// Schedules read per fire call.
pub const FIRE_BATCH: usize = 500;

/// How a schedule repeats, as a user gives it (the anchor of `Every` is decided here).
#[derive(Debug, Clone, PartialEq)]
pub enum Repeat {
    Cron { expr: String, tz: String },
    Every(Duration),
}

/// A schedule to create or update.
#[derive(Debug, Clone)]
pub struct NewSchedule {
    pub id: String,
    pub dest: String,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    pub max_attempts: Option<u32>,
    pub repeat: Repeat,
    pub misfire: crate::schedule::Misfire,
    /// No occurrence before this (epoch ms).
    pub start_at: Option<i64>,
    /// No occurrence at or after this (epoch ms).
    pub end_at: Option<i64>,
    /// An occurrence not delivered within this of its time goes to dead (`expired`).
    pub max_lateness: Option<Duration>,
}

impl NewSchedule {
    pub fn new(
        id: impl Into<String>,
        dest: impl Into<String>,
        payload: impl Into<Vec<u8>>,
        repeat: Repeat,
    ) -> Self {
        NewSchedule {
            id: id.into(),
            dest: dest.into(),
            payload: payload.into(),
            headers: BTreeMap::new(),
            max_attempts: None,
            repeat,
            misfire: Default::default(),
            start_at: None,
            end_at: None,
            max_lateness: None,
        }
    }
}

/// The stored definition (the JSON after the version).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Stored {
    dest: String,
    def: ScheduleDef,
    #[serde(default)]
    paused: bool,
    created_ms: i64,
    updated_ms: i64,
}

fn parse_record(record: &str) -> Option<(u64, Stored)> {
    let (version, json) = record.split_once('\n')?;
    Some((version.parse().ok()?, serde_json::from_str(json).ok()?))
}

/// A schedule as `schedule get` and `list` show it.
#[derive(Debug, Clone)]
pub struct ScheduleView {
    pub id: String,
    pub shard: u16,
    pub dest: String,
    pub def: ScheduleDef,
    pub paused: bool,
    /// The pending occurrence (none: paused or ended).
    pub next_ms: Option<i64>,
    pub version: u64,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// What each occurrence carries.
    pub envelope: Option<Envelope>,
}

impl ScheduleView {
    /// The readable JSON form (`--json`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut obj = self
            .envelope
            .as_ref()
            .map(Envelope::to_json)
            .unwrap_or_default();
        obj.remove("v");
        obj.remove("schedule");
        obj.insert("id".into(), self.id.clone().into());
        obj.insert("shard".into(), self.shard.into());
        obj.insert("dest".into(), self.dest.clone().into());
        if let Ok(serde_json::Value::Object(def)) = serde_json::to_value(&self.def) {
            obj.extend(def);
        }
        obj.insert("paused".into(), self.paused.into());
        obj.insert("next_ms".into(), self.next_ms.into());
        obj.insert("version".into(), self.version.into());
        obj.insert("created_ms".into(), self.created_ms.into());
        obj.insert("updated_ms".into(), self.updated_ms.into());
        serde_json::Value::Object(obj)
    }
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleSet {
    pub created: bool,
    pub version: u64,
    /// The pending occurrence now (none: paused or ended).
    pub next_ms: Option<i64>,
}

/// The definition a [`NewSchedule`] stands for, with the anchor of an interval kept from
/// the stored one (so an update never moves the grid) or set at creation.
fn definition(
    spec: &NewSchedule,
    stored: Option<&Stored>,
    now_ms: i64,
) -> Result<ScheduleDef, ClientError> {
    let mut def = match &spec.repeat {
        Repeat::Cron { expr, tz } => ScheduleDef::cron(expr.clone(), tz.clone()),
        Repeat::Every(interval) => {
            let kept = stored.and_then(|s| match s.def.recurrence {
                crate::schedule::Recurrence::Every { anchor_ms, .. } => Some(anchor_ms),
                _ => None,
            });
            let anchor = kept.or(spec.start_at).unwrap_or(now_ms);
            ScheduleDef::every(interval.as_millis() as u64, anchor)
        }
    };
    def.misfire = spec.misfire;
    def.start_at = spec.start_at;
    def.end_at = spec.end_at;
    def.max_lateness_ms = spec.max_lateness.map(|d| d.as_millis() as u64);
    def.validate()?;
    Ok(def)
}

/// Reads a schedule: (version, definition) or none.
async fn read(
    con: &mut Conn,
    keys: &ShardKeys,
    id: &str,
) -> Result<Option<(u64, Stored)>, ClientError> {
    let record: Option<String> = redis::cmd("HGET")
        .arg(&keys.schedules)
        .arg(id)
        .query_async(con)
        .await?;
    Ok(record.as_deref().and_then(parse_record))
}

impl Client {
    /// Compare-and-set loop: `change` gets the stored definition (if any) and Redis's now and
    /// returns the new one, or `None` to write nothing; the next occurrence is computed from
    /// it. Returns (version, created, next occurrence) of what was written.
    async fn write_schedule(
        &self,
        keys: &ShardKeys,
        id: &str,
        envelope: &[u8],
        change: impl Fn(Option<&Stored>, i64) -> Result<Option<Stored>, ClientError>,
    ) -> Result<Option<(u64, bool, Option<i64>)>, ClientError> {
        let mut con = self.con.clone();
        for _ in 0..CAS_ATTEMPTS {
            let current = read(&mut con, keys, id).await?;
            let now_ms = store::server_time_ms(&mut con).await?;
            failpoint_after_read().await;
            let Some(new) = change(current.as_ref().map(|(_, s)| s), now_ms)? else {
                return Ok(None);
            };
            let next_ms = if new.paused {
                None
            } else {
                new.def.compile()?.next_after(now_ms)
            };
            let definition = serde_json::to_string(&new).expect("a schedule serializes");
            let expected_version = current.as_ref().map_or(0, |(v, _)| *v);
            let write = ScheduleWrite {
                id,
                expected_version,
                definition: &definition,
                envelope,
                next_ms,
            };
            match scripts::upsert_schedule(&mut con, keys, &write).await? {
                Upserted::Version(version) => {
                    return Ok(Some((version, current.is_none(), next_ms)));
                }
                Upserted::Stale(_) => continue,
            }
        }
        Err(ClientError::Contended(id.to_owned()))
    }

    /// Creates or updates a schedule (by id) and returns its pending occurrence. An update
    /// keeps an interval's grid and a pause, and applies from the next occurrence (one
    /// already turned into a job completes as it was).
    pub async fn schedule_set(&self, spec: NewSchedule) -> Result<ScheduleSet, ClientError> {
        valid_schedule_id(&spec.id).map_err(|why| ClientError::BadScheduleId {
            id: spec.id.clone(),
            why,
        })?;
        self.check_dest_and_payload(&spec.dest, &spec.payload)?;
        // Invalid definitions fail before anything is read or written.
        definition(&spec, None, 0)?;
        let mut envelope = Envelope::new(spec.dest.clone(), spec.payload.clone());
        envelope.meta.headers = spec.headers.clone();
        crate::trace_context::normalize_header_names(&mut envelope.meta.headers);
        envelope.meta.max_attempts = spec.max_attempts;
        envelope.meta.schedule = Some(spec.id.clone());
        envelope.meta.max_lateness_ms = spec.max_lateness.map(|d| d.as_millis() as u64);
        let envelope = envelope.encode()?;
        let written = self
            .fenced(|layout| {
                let keys = layout.shard(layout.shard_of(&spec.id));
                let (spec, envelope) = (&spec, &envelope);
                async move {
                    self.write_schedule(&keys, &spec.id, envelope, |stored, now_ms| {
                        Ok(Some(Stored {
                            dest: spec.dest.clone(),
                            def: definition(spec, stored, now_ms)?,
                            paused: stored.is_some_and(|s| s.paused),
                            created_ms: stored.map_or(now_ms, |s| s.created_ms),
                            updated_ms: now_ms,
                        }))
                    })
                    .await
                }
            })
            .await?;
        let (version, created, next_ms) = written.expect("schedule_set always writes a definition");
        Ok(ScheduleSet {
            created,
            version,
            next_ms,
        })
    }

    /// Pauses a schedule: no occurrence until it is resumed. `false` if there is none.
    pub async fn schedule_pause(&self, id: &str) -> Result<bool, ClientError> {
        self.set_paused(id, true).await.map(|w| w.is_some())
    }

    /// Resumes a paused schedule from now (missed occurrences are not delivered); returns
    /// its next occurrence, or `None` when there is no such schedule.
    pub async fn schedule_resume(&self, id: &str) -> Result<Option<Option<i64>>, ClientError> {
        Ok(self.set_paused(id, false).await?.map(|(_, _, next)| next))
    }

    async fn set_paused(
        &self,
        id: &str,
        paused: bool,
    ) -> Result<Option<(u64, bool, Option<i64>)>, ClientError> {
        self.fenced(|layout| async move {
            let keys = layout.shard(layout.shard_of(id));
            self.write_schedule(&keys, id, b"", |stored, now_ms| {
                Ok(stored.map(|s| Stored {
                    paused,
                    updated_ms: now_ms,
                    ..s.clone()
                }))
            })
            .await
        })
        .await
    }

    /// Deletes a schedule: no further occurrence. `false` if there was none.
    pub async fn schedule_delete(&self, id: &str) -> Result<bool, ClientError> {
        self.fenced(|layout| async move {
            let keys = layout.shard(layout.shard_of(id));
            Ok(scripts::delete_schedule(&mut self.con.clone(), &keys, id).await?)
        })
        .await
    }

    /// Runs a schedule once now, off its grid: enqueues one occurrence due now, id
    /// `<schedule>:<now ms>`, carrying what the schedule's occurrences carry (its destination,
    /// payload, headers, max lateness). The pending occurrence and the grid do not move; a
    /// paused schedule runs too. Returns the job id, or `None` when there is no such schedule.
    pub async fn schedule_run_now(&self, id: &str) -> Result<Option<String>, ClientError> {
        self.fenced(|layout| async move {
            let keys = layout.shard(layout.shard_of(id));
            let mut con = self.con.clone();
            let (record, envelope): (Option<String>, Option<Vec<u8>>) = redis::pipe()
                .hget(&keys.schedules, id)
                .hget(&keys.sched_env, id)
                .query_async(&mut con)
                .await?;
            let (Some((_, stored)), Some(envelope)) =
                (record.as_deref().and_then(parse_record), envelope)
            else {
                return Ok(None);
            };
            let now_ms = store::server_time_ms(&mut con).await?;
            let item = EnqueueItem {
                id: occurrence_id(id, now_ms),
                due: Due::At(now_ms),
                envelope,
                max_lateness_ms: stored.def.max_lateness_ms,
            };
            let items = [item];
            let call = EnqueueCall {
                keys,
                items: &items,
            };
            // Keep: a second click in the same millisecond is the same run.
            let mut answers = scripts::enqueue_jobs(&mut con, OnConflict::Keep, &[call]).await?;
            answers.pop().expect("one answer per call")?;
            let [item] = items;
            Ok(Some(item.id))
        })
        .await
    }

    /// One schedule, or `None`.
    pub async fn schedule_get(&self, id: &str) -> Result<Option<ScheduleView>, ClientError> {
        let layout = self.keys();
        let shard = layout.shard_of(id);
        let keys = layout.shard(shard);
        type Reply = (Option<String>, Option<Vec<u8>>, Option<f64>, Option<String>);
        let (record, envelope, next, marker): Reply = redis::pipe()
            .hget(&keys.schedules, id)
            .hget(&keys.sched_env, id)
            .zscore(&keys.sched_due, id)
            .get(&keys.layout)
            .query_async(&mut self.con.clone())
            .await?;
        read_fence(marker, &layout, &keys.layout)?;
        Ok(record
            .as_deref()
            .and_then(parse_record)
            .map(|(version, s)| view(id.to_owned(), shard, version, s, envelope.as_deref(), next)))
    }

    /// Every schedule: those with a pending occurrence soonest first
    /// ([`Client::schedules_upcoming`]), then those without one ([`Client::schedules_idle`]).
    pub async fn schedule_list(&self) -> Result<Vec<ScheduleView>, ClientError> {
        let mut out = self.schedules_upcoming(usize::MAX).await?;
        let mut from = Some(IdleCursor::default());
        while let Some(cursor) = from {
            let idle = self.schedules_idle(cursor, SCAN_PAGE).await?;
            out.extend(idle.schedules);
            from = idle.next;
        }
        Ok(out)
    }

    /// The next `limit` schedules to fire, soonest first (ties by shard, then id): each
    /// shard's first `limit` pending occurrences (`sched_due` by score, `LIMIT`), merged;
    /// then only those schedules' definitions and envelopes are read (`HMGET`). Paused and
    /// ended schedules have no pending occurrence: [`Client::schedules_idle`] lists them.
    pub async fn schedules_upcoming(&self, limit: usize) -> Result<Vec<ScheduleView>, ClientError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let layout = self.keys();
        let count = i64::try_from(limit).unwrap_or(i64::MAX);
        let heads = futures::future::try_join_all((0..layout.shards()).map(|shard| {
            let keys = layout.shard(shard);
            let mut con = self.con.clone();
            let layout = &layout;
            async move {
                let (next, marker): (Vec<(String, f64)>, Option<String>) = redis::pipe()
                    .cmd("ZRANGEBYSCORE")
                    .arg(&keys.sched_due)
                    .arg("-inf")
                    .arg("+inf")
                    .arg("WITHSCORES")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(count)
                    .get(&keys.layout)
                    .query_async(&mut con)
                    .await?;
                read_fence(marker, layout, &keys.layout)?;
                Ok::<_, ClientError>(next.into_iter().map(move |(id, at)| (at, shard, id)))
            }
        }))
        .await?;
        let mut next: Vec<(f64, u16, String)> = heads.into_iter().flatten().collect();
        next.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then_with(|| (a.1, &a.2).cmp(&(b.1, &b.2)))
        });
        next.truncate(limit);
        let mut by_shard: BTreeMap<u16, Vec<(String, f64)>> = BTreeMap::new();
        for (at, shard, id) in next {
            by_shard.entry(shard).or_default().push((id, at));
        }
        let read = futures::future::try_join_all(by_shard.into_iter().map(|(shard, ids)| {
            let keys = layout.shard(shard);
            let con = self.con.clone();
            async move { read_views(con, &keys, shard, ids).await }
        }))
        .await?;
        let mut out: Vec<ScheduleView> = read.into_iter().flatten().collect();
        out.sort_by(|a, b| (a.next_ms, a.shard, &a.id).cmp(&(b.next_ms, b.shard, &b.id)));
        Ok(out)
    }

    /// Schedules without a pending occurrence — paused, or past their end — found by a
    /// bounded scan of the definitions (`HSCAN`, shard by shard, from `from`): about `scan`
    /// definitions are read, those without a pending occurrence (`ZMSCORE`) returned, with
    /// where to continue (`None`: every shard was scanned). Unreadable definitions are left
    /// out, as everywhere.
    pub async fn schedules_idle(
        &self,
        from: IdleCursor,
        scan: usize,
    ) -> Result<IdleSchedules, ClientError> {
        let layout = self.keys();
        let mut con = self.con.clone();
        let mut out = IdleSchedules {
            schedules: Vec::new(),
            next: None,
        };
        let (mut shard, mut cursor, mut read) = (from.shard, from.cursor, 0);
        while shard < layout.shards() {
            if read >= scan.max(1) {
                out.next = Some(IdleCursor { shard, cursor });
                break;
            }
            let keys = layout.shard(shard);
            let ((next, page), marker): (ScanPage, Option<String>) = redis::pipe()
                .cmd("HSCAN")
                .arg(&keys.schedules)
                .arg(cursor)
                .arg("COUNT")
                .arg((scan - read).clamp(1, SCAN_PAGE))
                .get(&keys.layout)
                .query_async(&mut con)
                .await?;
            read_fence(marker, &layout, &keys.layout)?;
            read += page.len().max(1);
            if !page.is_empty() {
                let pending: Vec<Option<f64>> = redis::cmd("ZMSCORE")
                    .arg(&keys.sched_due)
                    .arg(page.iter().map(|(id, _)| id).collect::<Vec<_>>())
                    .query_async(&mut con)
                    .await?;
                let idle: Vec<(String, String)> = page
                    .into_iter()
                    .zip(pending)
                    .filter(|(_, next)| next.is_none())
                    .map(|(entry, _)| entry)
                    .collect();
                if !idle.is_empty() {
                    let envelopes: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
                        .arg(&keys.sched_env)
                        .arg(idle.iter().map(|(id, _)| id).collect::<Vec<_>>())
                        .query_async(&mut con)
                        .await?;
                    for ((id, record), envelope) in idle.into_iter().zip(envelopes) {
                        if let Some((version, s)) = parse_record(&record) {
                            out.schedules.push(view(
                                id,
                                shard,
                                version,
                                s,
                                envelope.as_deref(),
                                None,
                            ));
                        }
                    }
                }
            }
            if next == 0 {
                (shard, cursor) = (shard + 1, 0);
            } else {
                cursor = next;
            }
        }
        Ok(out)
    }

    /// How many schedules there are, and how many have a pending occurrence (`HLEN` and
    /// `ZCARD` per shard, summed).
    pub async fn schedule_counts(&self) -> Result<ScheduleCounts, ClientError> {
        let layout = self.keys();
        let mut counts = ScheduleCounts::default();
        for shard in 0..layout.shards() {
            let keys = layout.shard(shard);
            let (schedules, pending, marker): (u64, u64, Option<String>) = redis::pipe()
                .hlen(&keys.schedules)
                .zcard(&keys.sched_due)
                .get(&keys.layout)
                .query_async(&mut self.con.clone())
                .await?;
            read_fence(marker, &layout, &keys.layout)?;
            counts.schedules += schedules;
            counts.pending += pending;
        }
        Ok(counts)
    }
}

/// One `HSCAN` answer of the definitions: the next cursor, (id, record) pairs.
type ScanPage = (u64, Vec<(String, String)>);

/// Definitions read per `HSCAN` call, and per call of [`Client::schedules_idle`] when
/// [`Client::schedule_list`] reads them all.
const SCAN_PAGE: usize = 1000;

/// The views of `ids` (each with its pending occurrence) in one shard: definitions and
/// envelopes by `HMGET`, in chunks. A schedule deleted meanwhile is left out.
async fn read_views(
    mut con: Conn,
    keys: &ShardKeys,
    shard: u16,
    ids: Vec<(String, f64)>,
) -> Result<Vec<ScheduleView>, ClientError> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(SCAN_PAGE) {
        let names: Vec<&String> = chunk.iter().map(|(id, _)| id).collect();
        let (records, envelopes): (Vec<Option<String>>, Vec<Option<Vec<u8>>>) = redis::pipe()
            .cmd("HMGET")
            .arg(&keys.schedules)
            .arg(&names)
            .cmd("HMGET")
            .arg(&keys.sched_env)
            .arg(&names)
            .query_async(&mut con)
            .await?;
        for (((id, next), record), envelope) in chunk.iter().zip(records).zip(envelopes) {
            if let Some((version, s)) = record.as_deref().and_then(parse_record) {
                out.push(view(
                    id.clone(),
                    shard,
                    version,
                    s,
                    envelope.as_deref(),
                    Some(*next),
                ));
            }
        }
    }
    Ok(out)
}

/// Where a scan for schedules without a pending occurrence continues: a shard and its
/// `HSCAN` cursor. Its text form is `<shard>-<cursor>`; the default starts at the beginning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdleCursor {
    pub shard: u16,
    pub cursor: u64,
}

impl std::fmt::Display for IdleCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.shard, self.cursor)
    }
}

impl std::str::FromStr for IdleCursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not a scan position: expected <shard>-<cursor>");
        let (shard, cursor) = text.split_once('-').ok_or_else(bad)?;
        Ok(IdleCursor {
            shard: shard.parse().map_err(|_| bad())?,
            cursor: cursor.parse().map_err(|_| bad())?,
        })
    }
}

/// What one [`Client::schedules_idle`] call found.
#[derive(Debug, Clone)]
pub struct IdleSchedules {
    pub schedules: Vec<ScheduleView>,
    /// Where to continue; `None` when every shard was scanned.
    pub next: Option<IdleCursor>,
}

/// What [`Client::schedule_counts`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ScheduleCounts {
    /// Schedules stored.
    pub schedules: u64,
    /// Of them, those with a pending occurrence (the others are paused or ended).
    pub pending: u64,
}

fn view(
    id: String,
    shard: u16,
    version: u64,
    s: Stored,
    envelope: Option<&[u8]>,
    next: Option<f64>,
) -> ScheduleView {
    ScheduleView {
        id,
        shard,
        dest: s.dest,
        def: s.def,
        paused: s.paused,
        next_ms: next.map(|n| n as i64),
        version,
        created_ms: s.created_ms,
        updated_ms: s.updated_ms,
        envelope: envelope.and_then(|e| Envelope::decode(e).ok()),
    }
}

/// Test-only fault injection (feature `test-failpoints`), from `ZDELAY_FAILPOINT`:
/// `schedule_hold_after_read=PATH` stalls every compare-and-set attempt of a schedule write
/// after it read the schedule and Redis's clock: it creates `PATH.reached`, then waits until
/// PATH exists, so a test can fire and deliver an occurrence in between.
#[cfg(feature = "test-failpoints")]
async fn failpoint_after_read() {
    if let Ok(spec) = std::env::var("ZDELAY_FAILPOINT")
        && let Some(path) = spec.strip_prefix("schedule_hold_after_read=")
    {
        eprintln!("failpoint schedule_hold_after_read: waiting for {path}");
        let _ = std::fs::write(format!("{path}.reached"), b"");
        while !std::path::Path::new(path).exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[cfg(not(feature = "test-failpoints"))]
async fn failpoint_after_read() {}

/// Compiled schedules by id, with the version they were compiled from (a mover keeps one per
/// shard: compiling a cron takes tens of microseconds, firing one a few).
#[derive(Default)]
pub struct ScheduleCache {
    compiled: HashMap<String, (String, Arc<Schedule>)>,
}

impl ScheduleCache {
    fn get(&mut self, id: &str, record: &str) -> Option<Arc<Schedule>> {
        let (version, json) = record.split_once('\n')?;
        if let Some((v, schedule)) = self.compiled.get(id)
            && v == version
        {
            return Some(schedule.clone());
        }
        let stored: Stored = serde_json::from_str(json).ok()?;
        let schedule = Arc::new(stored.def.compile().ok()?);
        // Bounded by the shard's schedules; a deleted one's entry is replaced or lingers.
        self.compiled
            .insert(id.to_owned(), (version.to_owned(), schedule.clone()));
        Some(schedule)
    }
}

/// What one [`fire_due`] call did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FireReport {
    pub fired: Fired,
    /// Schedules read as due.
    pub due: usize,
    /// Schedules whose definition could not be read or compiled: taken off the timeline
    /// (their definition stays for an operator; `schedule set` rewrites it).
    pub unreadable: usize,
}

/// Fires the due schedules of one shard (at most [`FIRE_BATCH`]): plans each, then turns the
/// planned occurrences into jobs and writes each next occurrence in one fenced script.
pub async fn fire_due(
    con: &mut Conn,
    keys: &ShardKeys,
    now_ms: Option<i64>,
    cache: &mut ScheduleCache,
) -> redis::RedisResult<FireReport> {
    let (now, due) = scripts::due_schedules(con, keys, now_ms, FIRE_BATCH).await?;
    let mut report = FireReport {
        due: due.len(),
        ..FireReport::default()
    };
    let mut firings = Vec::with_capacity(due.len());
    for DueSchedule {
        id,
        occurrence_ms,
        record,
    } in due
    {
        let version = record.split_once('\n').map_or("", |(v, _)| v).to_owned();
        let Some(schedule) = cache.get(&id, &record) else {
            // Unreadable (or missing) definition: off the timeline, not in a loop.
            report.unreadable += 1;
            firings.push(Firing {
                id,
                read_occurrence_ms: occurrence_ms,
                read_version: if record.is_empty() {
                    String::new()
                } else {
                    version
                },
                next_ms: None,
                max_lateness_ms: None,
                deliver: Vec::new(),
                expired: Vec::new(),
            });
            continue;
        };
        let plan = schedule.plan(occurrence_ms, now);
        let jobs = |times: &[i64]| {
            times
                .iter()
                .map(|&t| (occurrence_id(&id, t), t))
                .collect::<Vec<_>>()
        };
        firings.push(Firing {
            deliver: jobs(&plan.deliver),
            expired: jobs(&plan.expired),
            next_ms: plan.next,
            max_lateness_ms: schedule.def().max_lateness_ms,
            read_occurrence_ms: occurrence_ms,
            read_version: version,
            id,
        });
    }
    if !firings.is_empty() {
        report.fired = scripts::fire_schedules(con, keys, now, &firings).await?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_cursors_round_trip_their_text() {
        let c = IdleCursor {
            shard: 3,
            cursor: 917,
        };
        assert_eq!(c.to_string(), "3-917");
        assert_eq!("3-917".parse::<IdleCursor>(), Ok(c));
        assert_eq!("0-0".parse::<IdleCursor>(), Ok(IdleCursor::default()));
        for bad in ["", "3", "x-1", "1-", "-1-2", "70000-1"] {
            let e = bad.parse::<IdleCursor>().unwrap_err();
            assert!(e.contains("<shard>-<cursor>"), "{bad}: {e}");
        }
    }
}
