//! Recurring schedules in Redis: create or update (upsert by id), read, pause, resume,
//! delete, run now, and fire.
//!
//! A schedule lives in its shard (`keys::Keys::shard_of(id)`): its definition
//! (`{ns:s}:schedules`, `"<version>\n<JSON>"`), the envelope each occurrence carries
//! (`{ns:s}:sched_env`), its pending occurrence (`{ns:s}:sched_due`, one member per
//! schedule, so there is never more than one), its high-water mark (`{ns:s}:sched_fired`)
//! and, when a firing could not read it, why it is quarantined (`{ns:s}:sched_quarantine`).
//!
//! INVARIANT (no occurrence is ever written twice): every occurrence at or before a
//! schedule's mark was decided once (written as a job, expired, or passed over by the misfire
//! policy), and its pending occurrence is after the mark. Firing writes only occurrences
//! after the mark and raises it; a write ([`Client::schedule_set`], pause, resume) is
//! compare-and-set on the version and the mark it read, and plans the pending occurrence
//! after the later of Redis's now and the mark. So a write that read the schedule before a
//! firing (or a delete and a creation) is refused and reads again, instead of making an
//! occurrence that fired pending again. The next occurrence is computed here (cron needs
//! IANA zones, which Lua does not have).
//!
//! A write that does not change when the schedule fires (same recurrence, window, pause)
//! keeps its pending occurrence as it is: the grid, and an occurrence already due that no
//! daemon fired yet. A write that does change it plans again, but an occurrence already due
//! stays pending: the mover's plan applies the new definition's misfire policy to it.
//!
//! Firing ([`fire_due`], called by each shard's mover): the due schedules are read, each is
//! planned ([`crate::schedule::Schedule::plan`]: misfire policy, max lateness, the next
//! occurrence), and one script (`fire_schedules`) turns at most [`FIRE_MAX_OCCURRENCES`]
//! occurrences into ordinary jobs, raises the marks and writes the pending occurrences,
//! fenced on the occurrence and version read. A bigger catch-up is cut: the first occurrence
//! left out stays pending (due), and the next call plans from it. Two daemons firing the same
//! schedule: the second is fenced. A crash between reading and firing, or between two calls
//! of a catch-up: nothing was written, or all of one call; the next call goes on. A schedule
//! that cannot be read (definition, pending occurrence, envelope) is quarantined with a
//! reason, once, instead of being retried.

use crate::client::{Client, ClientError, read_fence};
use crate::envelope::Envelope;
use crate::job::{Due, OnConflict};
use crate::keys::{ShardKeys, occurrence_id, run_now_id, valid_schedule_id};
use crate::schedule::{Schedule, ScheduleDef};
pub use crate::store::scripts::FIRE_MAX_OCCURRENCES;
use crate::store::scripts::{
    self, DueSchedule, EnqueueCall, EnqueueItem, Fired, Firing, PendingWrite, ScheduleWrite,
    Upserted, score_ms,
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
/// How long a schedule's high-water mark is kept after it was last raised, also after the
/// schedule is deleted. A fresh write plans after Redis's now anyway; the mark protects
/// writes that read the schedule before a firing or a delete, and holds against Redis's
/// clock going back, for this long.
pub const MARK_RETENTION: Duration = Duration::from_secs(3600);

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

/// The version of a stored record as the scripts read it: the digits before its first
/// newline (none when there are none).
fn record_version(record: &str) -> Option<&str> {
    let (version, _) = record.split_once('\n')?;
    (!version.is_empty() && version.bytes().all(|b| b.is_ascii_digit())).then_some(version)
}

/// A stored record: its version and definition, or why it cannot be read.
fn parse_record(record: &str) -> Result<(u64, Stored), String> {
    let unreadable = |why: &str| format!("unreadable definition: {why}");
    let version = record_version(record)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| unreadable("its first line is not a version"))?;
    let (_, json) = record.split_once('\n').unwrap_or_default();
    let stored = serde_json::from_str(json).map_err(|e| unreadable(&e.to_string()))?;
    Ok((version, stored))
}

/// Why a schedule was taken off its timeline by a firing, and since when (Redis clock, ms).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantine {
    pub since_ms: i64,
    pub reason: String,
}

impl Quarantine {
    /// From its stored form, `"<ms> <reason>"`.
    fn parse(text: &str) -> Self {
        let (since, reason) = text.split_once(' ').unwrap_or(("", text));
        Quarantine {
            since_ms: since.parse().unwrap_or_default(),
            reason: reason.to_owned(),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "since_ms": self.since_ms, "reason": self.reason })
    }
}

/// A quarantined schedule, as [`Client::schedules_quarantined`] lists it (its definition may
/// be unreadable, so it has no [`ScheduleView`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedSchedule {
    pub id: String,
    pub shard: u16,
    pub quarantine: Quarantine,
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
    /// Set when a firing could not read it: no occurrence until `schedule set` writes it.
    pub quarantine: Option<Quarantine>,
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
        obj.insert(
            "quarantine".into(),
            self.quarantine
                .as_ref()
                .map_or(serde_json::Value::Null, Quarantine::to_json),
        );
        serde_json::Value::Object(obj)
    }
}

/// What an upsert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleSet {
    pub created: bool,
    pub version: u64,
    /// The pending occurrence now (none: paused or ended); one already due when the timing
    /// changed stays, for the daemons to fire.
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

/// A schedule as a write reads it.
struct Current {
    /// A definition is stored (readable or not).
    exists: bool,
    /// Its version as `upsert_schedule` reads it (0: none).
    version: u64,
    /// Its definition, or why it cannot be read.
    stored: Option<Result<Stored, String>>,
    /// Its high-water mark as Redis printed it.
    mark: Option<String>,
    quarantined: bool,
}

impl Current {
    async fn read(con: &mut Conn, keys: &ShardKeys, id: &str) -> Result<Self, ClientError> {
        let (record, mark, quarantined): (Option<String>, Option<String>, bool) = redis::pipe()
            .hget(&keys.schedules, id)
            .zscore(&keys.sched_fired, id)
            .hexists(&keys.sched_quarantine, id)
            .query_async(con)
            .await?;
        Ok(Current {
            exists: record.is_some(),
            version: record
                .as_deref()
                .and_then(record_version)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            stored: record
                .as_deref()
                .map(|r| parse_record(r).map(|(_, stored)| stored)),
            mark,
            quarantined,
        })
    }

    /// What a write of `new` does to the pending occurrence, planned at `now_ms`.
    fn pending(&self, new: &Stored, now_ms: i64) -> Result<PendingWrite, ClientError> {
        if new.paused {
            return Ok(PendingWrite::Pause);
        }
        if let Some(Ok(stored)) = &self.stored
            && !stored.paused
            && !self.quarantined
            && stored.def.same_occurrences(&new.def)
        {
            return Ok(PendingWrite::Keep);
        }
        // After the mark: an occurrence at or before it was decided by a firing already.
        let mark = self
            .mark
            .as_deref()
            .and_then(|m| m.parse::<f64>().ok())
            .map_or(i64::MIN, |m| m.floor() as i64);
        Ok(PendingWrite::Next(
            new.def.compile()?.next_after(now_ms.max(mark)),
        ))
    }
}

impl Client {
    /// Compare-and-set loop: `change` gets the stored definition (`Err` with why when it
    /// cannot be read) and Redis's now, and returns the new one, or `None` to write nothing;
    /// the pending occurrence follows from it. Returns (version, created, pending occurrence)
    /// of what was written.
    async fn write_schedule(
        &self,
        keys: &ShardKeys,
        id: &str,
        envelope: &[u8],
        change: impl Fn(Option<Result<&Stored, &str>>, i64) -> Result<Option<Stored>, ClientError>,
    ) -> Result<Option<(u64, bool, Option<i64>)>, ClientError> {
        let mut con = self.con.clone();
        for _ in 0..CAS_ATTEMPTS {
            let current = Current::read(&mut con, keys, id).await?;
            let now_ms = store::server_time_ms(&mut con).await?;
            // Tests open the read → compare-and-set window here.
            crate::failpoint::hold("schedule_hold_after_read").await;
            let stored = current
                .stored
                .as_ref()
                .map(|r| r.as_ref().map_err(String::as_str));
            let Some(new) = change(stored, now_ms)? else {
                return Ok(None);
            };
            let mut pending = current.pending(&new, now_ms)?;
            if pending == PendingWrite::Keep
                && let Some(Ok(stored)) = &current.stored
                && (&stored.dest, &stored.def, stored.paused) == (&new.dest, &new.def, new.paused)
            {
                pending = PendingWrite::Unchanged;
            }
            let definition = serde_json::to_string(&new).expect("a schedule serializes");
            let write = ScheduleWrite {
                id,
                expected_version: current.version,
                read_mark: current.mark.as_deref(),
                definition: &definition,
                envelope,
                pending,
                now_ms,
            };
            match scripts::upsert_schedule(&mut con, keys, &write).await? {
                Upserted::Written {
                    version,
                    pending_ms,
                } => return Ok(Some((version, !current.exists, pending_ms))),
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
                        // An unreadable definition is replaced.
                        let stored = stored.and_then(Result::ok);
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
            self.write_schedule(&keys, id, b"", |stored, now_ms| match stored {
                None => Ok(None),
                Some(Err(why)) => Err(ClientError::UnreadableSchedule {
                    id: id.to_owned(),
                    why: why.to_owned(),
                }),
                Some(Ok(s)) => Ok(Some(Stored {
                    paused,
                    updated_ms: now_ms,
                    ..s.clone()
                })),
            })
            .await
        })
        .await
    }

    /// Deletes a schedule: no further occurrence. `false` if there was none. Its mark stays
    /// for [`MARK_RETENTION`]: a schedule created again with this id never fires an
    /// occurrence this one fired.
    pub async fn schedule_delete(&self, id: &str) -> Result<bool, ClientError> {
        self.fenced(|layout| async move {
            let keys = layout.shard(layout.shard_of(id));
            let mut con = self.con.clone();
            let retention = MARK_RETENTION.as_millis() as u64;
            Ok(scripts::delete_schedule(&mut con, &keys, id, retention).await?)
        })
        .await
    }

    /// Runs a schedule once now, off its grid: enqueues one occurrence due now, id
    /// `<schedule>:<now ms>:run` ([`run_now_id`]: never the id of an occurrence on the grid,
    /// which is written once), carrying what the schedule's occurrences carry (its
    /// destination, payload, headers, max lateness). The pending occurrence and the grid do
    /// not move; a paused schedule runs too. Returns the job id, or `None` when there is no
    /// such schedule (or its definition cannot be read).
    pub async fn schedule_run_now(&self, id: &str) -> Result<Option<String>, ClientError> {
        self.fenced(|layout| async move {
            let keys = layout.shard(layout.shard_of(id));
            let mut con = self.con.clone();
            let (record, envelope): (Option<String>, Option<Vec<u8>>) = redis::pipe()
                .hget(&keys.schedules, id)
                .hget(&keys.sched_env, id)
                .query_async(&mut con)
                .await?;
            let (Some(Ok((_, stored))), Some(envelope)) =
                (record.as_deref().map(parse_record), envelope)
            else {
                return Ok(None);
            };
            let now_ms = store::server_time_ms(&mut con).await?;
            let item = EnqueueItem {
                id: run_now_id(id, now_ms),
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
        type Reply = (
            Option<String>,
            Option<Vec<u8>>,
            Option<f64>,
            Option<String>,
            Option<String>,
        );
        let (record, envelope, next, quarantine, marker): Reply = redis::pipe()
            .hget(&keys.schedules, id)
            .hget(&keys.sched_env, id)
            .zscore(&keys.sched_due, id)
            .hget(&keys.sched_quarantine, id)
            .get(&keys.layout)
            .query_async(&mut self.con.clone())
            .await?;
        read_fence(marker, &layout, &keys.layout)?;
        let Some(Ok((version, stored))) = record.as_deref().map(parse_record) else {
            return Ok(None);
        };
        Ok(Some(view(
            id.to_owned(),
            shard,
            version,
            stored,
            envelope.as_deref(),
            next,
            quarantine.as_deref(),
        )))
    }

    /// Why a schedule is quarantined, when it is: also for a schedule whose definition
    /// cannot be read (which [`Client::schedule_get`] does not return).
    pub async fn schedule_quarantine(&self, id: &str) -> Result<Option<Quarantine>, ClientError> {
        let layout = self.keys();
        let keys = layout.shard(layout.shard_of(id));
        let (quarantine, marker): (Option<String>, Option<String>) = redis::pipe()
            .hget(&keys.sched_quarantine, id)
            .get(&keys.layout)
            .query_async(&mut self.con.clone())
            .await?;
        read_fence(marker, &layout, &keys.layout)?;
        Ok(quarantine.as_deref().map(Quarantine::parse))
    }

    /// Every quarantined schedule, by shard and id (`HSCAN` of each shard's quarantine,
    /// which holds only those).
    pub async fn schedules_quarantined(&self) -> Result<Vec<QuarantinedSchedule>, ClientError> {
        let layout = self.keys();
        let mut con = self.con.clone();
        let mut out = Vec::new();
        for shard in 0..layout.shards() {
            let keys = layout.shard(shard);
            let mut cursor = 0;
            loop {
                let ((next, page), marker): (ScanPage, Option<String>) = redis::pipe()
                    .cmd("HSCAN")
                    .arg(&keys.sched_quarantine)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(SCAN_PAGE)
                    .get(&keys.layout)
                    .query_async(&mut con)
                    .await?;
                read_fence(marker, &layout, &keys.layout)?;
                out.extend(page.into_iter().map(|(id, text)| QuarantinedSchedule {
                    id,
                    shard,
                    quarantine: Quarantine::parse(&text),
                }));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        out.sort_by(|a, b| (a.shard, &a.id).cmp(&(b.shard, &b.id)));
        Ok(out)
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
                    let names: Vec<&String> = idle.iter().map(|(id, _)| id).collect();
                    let (envelopes, quarantines): (Vec<Option<Vec<u8>>>, Vec<Option<String>>) =
                        redis::pipe()
                            .cmd("HMGET")
                            .arg(&keys.sched_env)
                            .arg(&names)
                            .cmd("HMGET")
                            .arg(&keys.sched_quarantine)
                            .arg(&names)
                            .query_async(&mut con)
                            .await?;
                    for (((id, record), envelope), quarantine) in
                        idle.into_iter().zip(envelopes).zip(quarantines)
                    {
                        if let Ok((version, s)) = parse_record(&record) {
                            out.schedules.push(view(
                                id,
                                shard,
                                version,
                                s,
                                envelope.as_deref(),
                                None,
                                quarantine.as_deref(),
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
        type Reply = (
            Vec<Option<String>>,
            Vec<Option<Vec<u8>>>,
            Vec<Option<String>>,
        );
        let (records, envelopes, quarantines): Reply = redis::pipe()
            .cmd("HMGET")
            .arg(&keys.schedules)
            .arg(&names)
            .cmd("HMGET")
            .arg(&keys.sched_env)
            .arg(&names)
            .cmd("HMGET")
            .arg(&keys.sched_quarantine)
            .arg(&names)
            .query_async(&mut con)
            .await?;
        let read = chunk.iter().zip(records).zip(envelopes).zip(quarantines);
        for ((((id, next), record), envelope), quarantine) in read {
            if let Some(Ok((version, s))) = record.as_deref().map(parse_record) {
                out.push(view(
                    id.clone(),
                    shard,
                    version,
                    s,
                    envelope.as_deref(),
                    Some(*next),
                    quarantine.as_deref(),
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
    quarantine: Option<&str>,
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
        quarantine: quarantine.map(Quarantine::parse),
    }
}

/// Compiled schedules by id, with the version they were compiled from (a mover keeps one per
/// shard: compiling a cron takes tens of microseconds, firing one a few).
#[derive(Default)]
pub struct ScheduleCache {
    compiled: HashMap<String, (u64, Arc<Schedule>)>,
}

impl ScheduleCache {
    /// The schedule a stored record defines, or why it cannot be fired.
    fn get(&mut self, id: &str, record: &str) -> Result<Arc<Schedule>, String> {
        let version = record_version(record).and_then(|v| v.parse::<u64>().ok());
        if let (Some(version), Some((v, schedule))) = (version, self.compiled.get(id))
            && *v == version
        {
            return Ok(schedule.clone());
        }
        let (version, stored) = parse_record(record)?;
        let schedule = Arc::new(
            stored
                .def
                .compile()
                .map_err(|e| format!("unreadable definition: {e}"))?,
        );
        // Bounded by the shard's schedules; a deleted one's entry is replaced or lingers.
        self.compiled
            .insert(id.to_owned(), (version, schedule.clone()));
        Ok(schedule)
    }
}

/// What one [`fire_due`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FireReport {
    pub fired: Fired,
    /// Schedules read as due.
    pub due: usize,
    /// Schedules sent to `fire_schedules` (the others are left due for the next call).
    pub sent: usize,
    /// Due work was left for another call (the occurrence bound or the batch was reached):
    /// call again at once.
    pub more: bool,
}

impl FireReport {
    /// Schedules were due and every one of them was fenced (changed under the call): calling
    /// again at once would likely meet the same.
    pub fn stalled(&self) -> bool {
        self.sent > 0 && self.fired.fenced as usize >= self.sent
    }
}

/// Fires the due schedules of one shard (at most [`FIRE_BATCH`] read, at most
/// [`FIRE_MAX_OCCURRENCES`] occurrences written): plans each, then turns the planned
/// occurrences into jobs, raises the marks and writes each pending occurrence in one fenced
/// script. `now_ms` overrides Redis TIME (tests drive time with it).
pub async fn fire_due(
    con: &mut Conn,
    keys: &ShardKeys,
    now_ms: Option<i64>,
    cache: &mut ScheduleCache,
) -> redis::RedisResult<FireReport> {
    let (now, due) = scripts::due_schedules(con, keys, now_ms, FIRE_BATCH).await?;
    let mut report = FireReport {
        due: due.len(),
        more: due.len() >= FIRE_BATCH,
        ..FireReport::default()
    };
    let mut budget = FIRE_MAX_OCCURRENCES;
    let mut firings = Vec::with_capacity(due.len());
    for DueSchedule { id, score, record } in due {
        if budget == 0 {
            report.more = true;
            break;
        }
        let mut firing = Firing {
            id,
            read_version: record_version(&record).unwrap_or_default().to_owned(),
            read_score: score,
            ..Firing::default()
        };
        if record.is_empty() {
            // No definition: its pending occurrence goes (fire_schedules removes it).
            firings.push(firing);
            continue;
        }
        let planned = cache.get(&firing.id, &record).and_then(|schedule| {
            let at = score_ms(&firing.read_score).ok_or_else(|| {
                format!(
                    "its pending occurrence {} is not a time in ms",
                    firing.read_score
                )
            })?;
            Ok((schedule, at))
        });
        let (schedule, at) = match planned {
            Ok(planned) => planned,
            Err(reason) => {
                firing.quarantine = Some(reason);
                firings.push(firing);
                continue;
            }
        };
        let mut plan = schedule.plan(at, now);
        match plan.truncate(budget) {
            // Cut: the first occurrence left out stays pending (it is due: the next call
            // plans from it), and the mark is the last one written.
            Some(first_left) => {
                report.more = true;
                firing.next_ms = Some(first_left);
                firing.mark_ms = plan.last_written();
            }
            // Every occurrence up to now is decided.
            None => {
                firing.next_ms = plan.next;
                firing.mark_ms = Some(now);
            }
        }
        budget -= plan.deliver.len() + plan.expired.len();
        let jobs = |times: &[i64]| {
            times
                .iter()
                .map(|&t| (occurrence_id(&firing.id, t), t))
                .collect::<Vec<_>>()
        };
        (firing.deliver, firing.expired) = (jobs(&plan.deliver), jobs(&plan.expired));
        firing.max_lateness_ms = schedule.def().max_lateness_ms;
        firings.push(firing);
    }
    report.sent = firings.len();
    if !firings.is_empty() {
        let retention = MARK_RETENTION.as_millis() as u64;
        report.fired = scripts::fire_schedules(con, keys, now, retention, &firings).await?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Misfire;

    #[test]
    fn records_are_read_as_the_scripts_read_them() {
        assert_eq!(record_version("12\n{}"), Some("12"));
        for bad in ["v2\n{}", "\n{}", "+5\n{}", "-1\n{}", "12", ""] {
            assert_eq!(record_version(bad), None, "{bad:?}");
        }
        let why = parse_record("v2\n{}").unwrap_err();
        assert_eq!(
            why,
            "unreadable definition: its first line is not a version"
        );
        let why = parse_record("3\n{\"dest\":").unwrap_err();
        assert!(why.starts_with("unreadable definition: EOF"), "{why}");
        assert_eq!(
            Quarantine::parse("17 no envelope stored"),
            Quarantine {
                since_ms: 17,
                reason: "no envelope stored".into()
            }
        );
        assert_eq!(Quarantine::parse("junk").reason, "junk");
    }

    #[test]
    fn a_write_keeps_the_pending_occurrence_unless_the_timing_changes() {
        let stored = Stored {
            dest: "q".into(),
            def: ScheduleDef::every(1_000, 0),
            paused: false,
            created_ms: 0,
            updated_ms: 0,
        };
        let current = |stored: Result<Stored, String>, quarantined| Current {
            exists: true,
            version: 3,
            stored: Some(stored),
            mark: Some("5000".into()),
            quarantined,
        };
        let with = |f: fn(&mut Stored)| {
            let mut s = stored.clone();
            f(&mut s);
            s
        };
        let live = current(Ok(stored.clone()), false);
        // Only what a firing delivers changes: the pending occurrence stays as it is.
        let other = with(|s| {
            s.dest = "r".into();
            s.def.misfire = Misfire::Skip;
            s.def.max_lateness_ms = Some(10);
        });
        assert_eq!(live.pending(&other, 2_500).unwrap(), PendingWrite::Keep);
        assert_eq!(
            live.pending(&with(|s| s.paused = true), 2_500).unwrap(),
            PendingWrite::Pause
        );
        // New timing: after the later of now and the mark.
        let moved = with(|s| s.def.end_at = Some(1_000_000));
        assert_eq!(
            live.pending(&moved, 2_500).unwrap(),
            PendingWrite::Next(Some(6_000))
        );
        assert_eq!(
            live.pending(&moved, 7_500).unwrap(),
            PendingWrite::Next(Some(8_000))
        );
        // Resumed, quarantined or unreadable: planned again, even with the same timing.
        let paused = current(Ok(with(|s| s.paused = true)), false);
        let quarantined = current(Ok(stored.clone()), true);
        let unreadable = current(Err("unreadable definition: x".into()), true);
        for was in [paused, quarantined, unreadable] {
            assert_eq!(
                was.pending(&stored, 2_500).unwrap(),
                PendingWrite::Next(Some(6_000))
            );
        }
    }

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
