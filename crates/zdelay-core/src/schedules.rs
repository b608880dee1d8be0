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

use crate::client::lanes::{Found, Held};
use crate::client::{Client, ClientError, read_fence};
use crate::envelope::{Envelope, Meta};
use crate::job::{Due, OnConflict};
use crate::keys::{Keys, occurrence_id, run_now_id, valid_schedule_id};
use crate::lane::{Home, Registry};
use crate::operator::Operator;
use crate::schedule::{Schedule, ScheduleDef};
use crate::store::Conn;
pub use crate::store::scripts::FIRE_MAX_OCCURRENCES;
use crate::store::scripts::{
    self, DueSchedule, EnqueueCall, EnqueueItem, Fired, Firing, LaneItem, PendingWrite,
    ScheduleWrite, Upserted, Withdraw, score_ms,
};
pub use crate::store::scripts::{DirectPush, SchedAt};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// Compare-and-set attempts before an upsert gives up.
const CAS_ATTEMPTS: usize = 64;
/// Most occurrences written ahead that one write of a schedule takes back (the latest ones):
/// a schedule every millisecond fired 10 s ahead has this many.
pub const MAX_WITHDRAWN: usize = 10_000;
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
    /// Each occurrence's job is due at a point of this window after the occurrence, derived
    /// from its id.
    pub jitter: Option<Duration>,
    /// Days it does not fire on: a calendar stored under this name (`calendar_set`), and
    /// what it does with an occurrence on one of them.
    pub calendar: Option<crate::calendars::CalendarChoice>,
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
            jitter: None,
            calendar: None,
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
    /// The route lane that holds it (storage layout 2; `shard` is then 0).
    pub lane: Option<u32>,
    pub quarantine: Quarantine,
}

/// A schedule as `schedule get` and `list` show it.
#[derive(Debug, Clone)]
pub struct ScheduleView {
    pub id: String,
    pub shard: u16,
    /// The route lane that holds it (storage layout 2; `shard` is then 0, and the JSON form
    /// has `lane` instead of `shard`).
    pub lane: Option<u32>,
    pub dest: String,
    pub def: ScheduleDef,
    pub paused: bool,
    /// The next occurrence to go out: the first one written ahead of its time that waits as
    /// a job, else the pending occurrence (none: paused or ended).
    pub next_ms: Option<i64>,
    pub version: u64,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// What each occurrence carries.
    pub envelope: Option<Envelope>,
    /// Set when a firing could not read it: no occurrence until `schedule set` writes it.
    pub quarantine: Option<Quarantine>,
    /// What its firings did so far.
    pub health: ScheduleHealth,
}

/// A schedule's health, as the firings recorded it (in the same script that decides the
/// occurrences, so the counts are exact whichever daemon fires, and a crash loses none). Kept
/// while the schedule exists: updates keep it, `schedule delete` removes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ScheduleHealth {
    /// Occurrences turned into jobs by firings (`schedule run` is not counted).
    pub fired: u64,
    /// Occurrences that were due and that the misfire policy passed over, neither delivered
    /// nor expired: `coalesce`, all but the latest of those due at once; `skip`, every one of
    /// them; `catch_up`, those older than its `max` latest.
    pub missed: u64,
    /// Occurrences delivered later than `max_lateness` after their time: to dead, `expired`.
    pub expired: u64,
    /// Occurrences passed over because the schedule's calendar excludes their date.
    pub skipped_by_calendar: u64,
    /// When a firing last turned an occurrence into a job (Redis clock, ms), and that
    /// occurrence's time (its lateness is the difference). `None` until it first fires.
    pub last_fired_ms: Option<i64>,
    pub last_occurrence_ms: Option<i64>,
}

impl ScheduleHealth {
    /// From its stored form, `"<fired> <missed> <expired> <skipped> <last fired ms>
    /// <occurrence ms>"` (`-` for a time not set). A field that does not read is 0 or unset:
    /// only the firing script writes it.
    pub fn parse(text: &str) -> Self {
        let mut words = text.split_whitespace();
        let mut count = || words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
        let (fired, missed, expired, skipped_by_calendar) = (count(), count(), count(), count());
        let mut time = || words.next().and_then(|w| w.parse().ok());
        let (last_fired_ms, last_occurrence_ms) = (time(), time());
        ScheduleHealth {
            fired,
            missed,
            expired,
            skipped_by_calendar,
            last_fired_ms,
            last_occurrence_ms,
        }
    }

    /// How late its last firing was: when it fired minus the occurrence's time; 0 when it
    /// was written ahead of its time.
    pub fn last_lateness_ms(&self) -> Option<i64> {
        Some((self.last_fired_ms? - self.last_occurrence_ms?).max(0))
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "fired": self.fired,
            "missed": self.missed,
            "expired": self.expired,
            "skipped_by_calendar": self.skipped_by_calendar,
            "last_fired_ms": self.last_fired_ms,
            "last_occurrence_ms": self.last_occurrence_ms,
            "last_lateness_ms": self.last_lateness_ms(),
        })
    }
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
        match self.lane {
            Some(lane) => obj.insert("lane".into(), crate::lane_id::base36(lane).into()),
            None => obj.insert("shard".into(), self.shard.into()),
        };
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
        obj.insert("health".into(), self.health.to_json());
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
    calendar: Option<&crate::schedule::ScheduleCalendar>,
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
    def.jitter_ms = spec.jitter.map(|d| d.as_millis() as u64);
    def.calendar = calendar.cloned();
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
    /// The envelope its occurrences carry.
    envelope: Option<Vec<u8>>,
    /// The occurrences a firing wrote ahead of their time that still wait as jobs (the
    /// latest ones, oldest first): a write takes them back, so they fire again under what it
    /// writes (or not at all), and its plan starts just before the earliest.
    written_ahead: Vec<(i64, String)>,
}

/// The keys of a home's schedules.
struct SchedKeys<'a> {
    schedules: &'a str,
    sched_env: &'a str,
    sched_due: &'a str,
    sched_fired: &'a str,
    sched_quarantine: &'a str,
    sched_health: &'a str,
    /// Where its occurrences wait as jobs.
    due: &'a str,
}

impl Home {
    /// The schedule scripts' view of it (`wake_channel`: the namespace's).
    pub fn at<'a>(&'a self, wake_channel: &'a str) -> SchedAt<'a> {
        match self {
            Home::Shard(keys) => SchedAt::Shard(keys),
            Home::Lane(lane) => SchedAt::Lane { lane, wake_channel },
        }
    }

    /// (shard, lane) as views show it: a lane's shard is 0.
    fn place(&self) -> (u16, Option<u32>) {
        match self {
            Home::Shard(keys) => (keys.shard, None),
            Home::Lane(lane) => (0, Some(lane.number)),
        }
    }

    fn keys(&self) -> SchedKeys<'_> {
        match self {
            Home::Shard(k) => SchedKeys {
                schedules: &k.schedules,
                sched_env: &k.sched_env,
                sched_due: &k.sched_due,
                sched_fired: &k.sched_fired,
                sched_quarantine: &k.sched_quarantine,
                sched_health: &k.sched_health,
                due: &k.due,
            },
            Home::Lane(lane) => SchedKeys {
                schedules: &lane.keys.schedules,
                sched_env: &lane.keys.sched_env,
                sched_due: &lane.keys.sched_due,
                sched_fired: &lane.keys.sched_fired,
                sched_quarantine: &lane.keys.sched_quarantine,
                sched_health: &lane.keys.sched_health,
                due: &lane.keys.due,
            },
        }
    }

    /// The marker a read of this home gets with its data: a shard's layout marker (a
    /// namespace resharded away holds its schedules elsewhere), or the lane's marker.
    fn fence_key(&self) -> &str {
        match self {
            Home::Shard(keys) => &keys.layout,
            Home::Lane(lane) => &lane.keys.marker,
        }
    }

    /// Fails when the marker read with the data says the namespace left `layout` (layout 1).
    /// A lane's keys hold its schedules for as long as the registry names it (relocation is
    /// not built), so its marker is not checked.
    fn check_read(&self, marker: Option<String>, layout: &Keys) -> Result<(), ClientError> {
        match self {
            Home::Shard(keys) => read_fence(marker, layout, &keys.layout),
            Home::Lane(_) => Ok(()),
        }
    }

    /// One `HSCAN` page of `hash`, one of this home's, read with the home's marker and
    /// checked as [`Home::check_read`] does.
    async fn hscan_page(
        &self,
        con: &mut Conn,
        layout: &Keys,
        hash: &str,
        cursor: u64,
        count: usize,
    ) -> Result<ScanPage, ClientError> {
        let (page, marker): (ScanPage, Option<String>) = redis::pipe()
            .cmd("HSCAN")
            .arg(hash)
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .get(self.fence_key())
            .query_async(con)
            .await?;
        self.check_read(marker, layout)?;
        Ok(page)
    }
}

impl Current {
    async fn read(con: &mut Conn, home: &Home, id: &str) -> Result<Self, ClientError> {
        let keys = home.keys();
        type Read = (Option<String>, Option<String>, bool, Option<Vec<u8>>);
        let (record, mark, quarantined, envelope): Read = redis::pipe()
            .hget(keys.schedules, id)
            .zscore(keys.sched_fired, id)
            .hexists(keys.sched_quarantine, id)
            .hget(keys.sched_env, id)
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
            envelope,
            written_ahead: Vec::new(),
        })
    }

    /// Whether writing `new` with `envelope` (empty: the stored one) changes nothing but
    /// the update time: then nothing is written, and no occurrence written ahead is taken
    /// back (re-applying unchanged schedules in a loop never fences or refires anything).
    fn unchanged(&self, new: &Stored, envelope: &[u8]) -> bool {
        matches!(&self.stored, Some(Ok(stored))
            if (&stored.dest, &stored.def, stored.paused) == (&new.dest, &new.def, new.paused))
            && !self.quarantined
            && (envelope.is_empty() || self.envelope.as_deref() == Some(envelope))
    }

    /// The mark as a time (ms; `None`: none).
    fn mark_ms(&self) -> Option<i64> {
        self.mark
            .as_deref()
            .and_then(|m| m.parse::<f64>().ok())
            .map(|m| m.floor() as i64)
    }

    /// Reads which occurrences a firing wrote ahead of `now_ms` still wait as jobs: the
    /// stored grid's occurrences after now up to the mark (every one a firing decided that is
    /// not due yet was written ahead), of which the latest run that still waits is kept.
    async fn read_written_ahead(
        &mut self,
        con: &mut Conn,
        home: &Home,
        id: &str,
        now_ms: i64,
    ) -> Result<(), ClientError> {
        self.written_ahead.clear();
        let (Some(mark), Some(Ok(stored))) = (self.mark_ms(), &self.stored) else {
            return Ok(());
        };
        if mark <= now_ms {
            return Ok(());
        }
        let Ok(schedule) = stored.def.compile() else {
            return Ok(());
        };
        let mut ahead = std::collections::VecDeque::new();
        let mut at = now_ms;
        while let Some(next) = schedule.next_after(at).filter(|&n| n <= mark) {
            if ahead.len() == MAX_WITHDRAWN {
                ahead.pop_front();
            }
            ahead.push_back(next);
            at = next;
        }
        if ahead.is_empty() {
            return Ok(());
        }
        let jobs: Vec<String> = ahead.iter().map(|&t| occurrence_id(id, t)).collect();
        // One round trip, a command per 1,000 ids.
        let mut pipe = redis::pipe();
        for chunk in jobs.chunks(1000) {
            pipe.cmd("ZMSCORE").arg(home.keys().due).arg(chunk);
        }
        let scores: Vec<Vec<Option<f64>>> = pipe.query_async(con).await?;
        let waiting: Vec<bool> = scores.into_iter().flatten().map(|s| s.is_some()).collect();
        // The latest run that waits: one before it that no longer waits (cancelled by hand)
        // stays decided, so the mark never goes back below it.
        let first = waiting.iter().rposition(|w| !w).map_or(0, |k| k + 1);
        self.written_ahead = ahead.into_iter().zip(jobs).skip(first).collect();
        Ok(())
    }

    /// The mark a write plans after: just before the earliest occurrence it takes back.
    fn planning_mark(&self) -> i64 {
        match self.written_ahead.first() {
            Some((at, _)) => at - 1,
            None => self.mark_ms().unwrap_or(i64::MIN),
        }
    }

    /// What a write takes back.
    fn withdraw(&self) -> (Vec<String>, i64) {
        let jobs = self
            .written_ahead
            .iter()
            .map(|(_, job)| job.clone())
            .collect();
        (jobs, self.planning_mark())
    }

    /// What a write of `new` does to the pending occurrence, planned at `now_ms`.
    fn pending(&self, new: &Stored, now_ms: i64) -> Result<PendingWrite, ClientError> {
        if new.paused {
            return Ok(PendingWrite::Pause);
        }
        // Occurrences taken back are planned again, whatever the timing.
        if let Some(Ok(stored)) = &self.stored
            && !stored.paused
            && !self.quarantined
            && self.written_ahead.is_empty()
            && stored.def.same_occurrences(&new.def)
        {
            return Ok(PendingWrite::Keep);
        }
        // After the mark: an occurrence at or before it was decided by a firing already.
        Ok(PendingWrite::Next(
            new.def
                .compile()?
                .next_after(now_ms.max(self.planning_mark())),
        ))
    }
}

impl Client {
    /// Where schedule `id` is kept: its shard on layout 1; on layout 2 the one route lane or
    /// spread shard that holds it (`None`: none does; `AmbiguousId` when two do, which only
    /// a hand-made write can cause: `schedule_set` refuses a second place).
    async fn schedule_home_of(&self, layout: &Keys, id: &str) -> Result<Option<Home>, ClientError> {
        let in_shard = || Home::Shard(layout.shard(layout.shard_of(id)));
        Ok(
            match self.locate(self.lane_book(), id, Held::Schedule).await? {
                Found::Shard => Some(in_shard()),
                Found::Lane(lane, _) => Some(Home::Lane(lane)),
                Found::Nowhere => None,
            },
        )
    }

    /// Where `spec` is written: its id's shard; on layout 2 its destination's lane, or for a
    /// two-phase destination its id's spread shard. A schedule with this id kept elsewhere
    /// (another route's lane, or the other kind of place) is refused: moving it cannot be
    /// one atomic write on a cluster, so it is deleted and set again instead.
    async fn schedule_home_for(
        &self,
        layout: &Keys,
        spec: &NewSchedule,
    ) -> Result<Home, ClientError> {
        let in_shard = || Home::Shard(layout.shard(layout.shard_of(&spec.id)));
        let book = self.lane_book();
        // A producer given the config registers a route that has no lane yet, or confirms it
        // and writes a marker its registrant may not have written yet (rare enough to ask
        // every time).
        let (refusals, _) = self
            .register_destinations(&Registry::default(), [spec.dest.as_str()])
            .await?;
        let registry = self.refresh_lanes(book).await?;
        if let Some(refusal) = refusals.get(&spec.dest) {
            return Err(refusal.error(&spec.dest, &registry));
        }
        let home = match self
            .place_of(book, Some(&spec.dest), &spec.id, Held::Schedule)
            .await?
        {
            Found::Lane(lane, _) => Home::Lane(lane),
            Found::Shard | Found::Nowhere => in_shard(),
        };
        let elsewhere = |route: String| ClientError::ScheduleElsewhere {
            id: spec.id.clone(),
            route,
            dest: spec.dest.clone(),
        };
        match (self.locate(book, &spec.id, Held::Schedule).await?, &home) {
            (Found::Shard, Home::Lane(_)) => {
                return Err(elsewhere("a two-phase destination".to_owned()));
            }
            (Found::Lane(held, _), _) if !matches!(&home, Home::Lane(lane) if lane.number == held.number) =>
            {
                return Err(elsewhere(held.route));
            }
            _ => {}
        }
        Ok(home)
    }

    /// Compare-and-set loop: `change` gets the stored definition (`Err` with why when it
    /// cannot be read) and Redis's now, and returns the new one, or `None` to write nothing;
    /// the pending occurrence follows from it. Returns (version, created, next occurrence)
    /// of what was written: the pending one, or the first written ahead that waits.
    async fn write_schedule(
        &self,
        home: &Home,
        id: &str,
        envelope: &[u8],
        change: impl Fn(Option<Result<&Stored, &str>>, i64) -> Result<Option<Stored>, ClientError>,
    ) -> Result<Option<(u64, bool, Option<i64>)>, ClientError> {
        let mut con = self.con.clone();
        let wake_channel = self.keys().wake_channel();
        for _ in 0..CAS_ATTEMPTS {
            let mut current = Current::read(&mut con, home, id).await?;
            let now_ms = con.now_ms().await?;
            current
                .read_written_ahead(&mut con, home, id, now_ms)
                .await?;
            // Tests open the read → compare-and-set window here.
            crate::failpoint::hold("schedule_hold_after_read").await;
            let stored = current
                .stored
                .as_ref()
                .map(|r| r.as_ref().map_err(String::as_str));
            let Some(new) = change(stored, now_ms)? else {
                return Ok(None);
            };
            let unchanged = current.unchanged(&new, envelope);
            // Left waiting when nothing changes: the first of them is the next to go out.
            let mut first_waiting = None;
            if unchanged {
                first_waiting = current.written_ahead.first().map(|&(at, _)| at);
                current.written_ahead.clear();
            }
            let mut pending = current.pending(&new, now_ms)?;
            if unchanged && pending == PendingWrite::Keep {
                pending = PendingWrite::Unchanged;
            }
            let definition = serde_json::to_string(&new).expect("a schedule serializes");
            let (withdrawn, mark_ms) = current.withdraw();
            let write = ScheduleWrite {
                id,
                expected_version: current.version,
                read_mark: current.mark.as_deref(),
                definition: &definition,
                envelope,
                pending,
                now_ms,
                withdraw: Withdraw {
                    jobs: &withdrawn,
                    mark_ms,
                },
            };
            match scripts::upsert_schedule(&mut con, home.at(&wake_channel), &write).await? {
                Upserted::Written {
                    version,
                    pending_ms,
                } => {
                    let next = first_waiting.or(pending_ms);
                    return Ok(Some((version, !current.exists, next)));
                }
                Upserted::Stale(_) => continue,
            }
        }
        Err(ClientError::Contended(id.to_owned()))
    }

    /// Creates or updates a schedule (by id) and returns its pending occurrence. An update
    /// keeps an interval's grid and a pause, and applies from the next occurrence (one
    /// already turned into a job completes as it was). On storage layout 2 a schedule lives
    /// in its destination's route lane; changing its destination to another route is
    /// refused (`ScheduleElsewhere`: delete it and set it again).
    pub async fn schedule_set(&self, spec: NewSchedule) -> Result<ScheduleSet, ClientError> {
        valid_schedule_id(&spec.id).map_err(|why| ClientError::BadScheduleId {
            id: spec.id.clone(),
            why,
        })?;
        self.check_dest_and_payload(&spec.dest, &spec.payload)?;
        // Invalid definitions fail before anything is written; a calendar is read first.
        let calendar = self.schedule_calendar(spec.calendar.as_ref()).await?;
        definition(&spec, calendar.as_ref(), None, 0)?;
        let mut envelope = Envelope::new(spec.dest.clone(), spec.payload.clone());
        envelope.meta.headers = spec.headers.clone();
        crate::trace_context::normalize_header_names(&mut envelope.meta.headers);
        envelope.meta.max_attempts = spec.max_attempts;
        envelope.meta.schedule = Some(spec.id.clone());
        envelope.meta.max_lateness_ms = spec.max_lateness.map(|d| d.as_millis() as u64);
        let envelope = envelope.encode()?;
        let written = self
            .fenced_by_layout("the schedule", |layout| {
                let (spec, envelope, calendar) = (&spec, &envelope, calendar.as_ref());
                async move {
                    let home = self.schedule_home_for(&layout, spec).await?;
                    self.write_schedule(&home, &spec.id, envelope, |stored, now_ms| {
                        // An unreadable definition is replaced.
                        let stored = stored.and_then(Result::ok);
                        Ok(Some(Stored {
                            dest: spec.dest.clone(),
                            def: definition(spec, calendar, stored, now_ms)?,
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
        self.fenced_by_layout("the schedule", |layout| async move {
            let Some(home) = self.schedule_home_of(&layout, id).await? else {
                return Ok(None);
            };
            self.write_schedule(&home, id, b"", |stored, now_ms| match stored {
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

    /// Deletes a schedule: no further occurrence (those a firing wrote ahead of their time
    /// and that still wait are withdrawn). `false` if there was none. Its mark stays for
    /// [`MARK_RETENTION`]: a schedule created again with this id never fires an occurrence
    /// this one fired.
    pub async fn schedule_delete(&self, id: &str) -> Result<bool, ClientError> {
        self.fenced_by_layout("the schedule", |layout| async move {
            let Some(home) = self.schedule_home_of(&layout, id).await? else {
                return Ok(false);
            };
            let mut con = self.con.clone();
            let retention = MARK_RETENTION.as_millis() as u64;
            let wake_channel = layout.wake_channel();
            for _ in 0..CAS_ATTEMPTS {
                let mut current = Current::read(&mut con, &home, id).await?;
                let now_ms = con.now_ms().await?;
                current
                    .read_written_ahead(&mut con, &home, id, now_ms)
                    .await?;
                let (withdrawn, _) = current.withdraw();
                let at = home.at(&wake_channel);
                let mark = current.mark.as_deref();
                if let Some(deleted) =
                    scripts::delete_schedule(&mut con, at, id, retention, mark, &withdrawn).await?
                {
                    return Ok(deleted);
                }
            }
            Err(ClientError::Contended(id.to_owned()))
        })
        .await
    }

    /// One schedule, or `None`.
    pub async fn schedule_get(&self, id: &str) -> Result<Option<ScheduleView>, ClientError> {
        let layout = self.keys();
        let Some(home) = self.schedule_home_of(&layout, id).await? else {
            return Ok(None);
        };
        let keys = home.keys();
        type Reply = (
            Option<String>,
            Option<Vec<u8>>,
            Option<f64>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let (record, envelope, next, quarantine, health, marker): Reply = redis::pipe()
            .hget(keys.schedules, id)
            .hget(keys.sched_env, id)
            .zscore(keys.sched_due, id)
            .hget(keys.sched_quarantine, id)
            .hget(keys.sched_health, id)
            .get(home.fence_key())
            .query_async(&mut self.con.clone())
            .await?;
        home.check_read(marker, &layout)?;
        let Some(Ok((version, stored))) = record.as_deref().map(parse_record) else {
            return Ok(None);
        };
        let mut con = self.con.clone();
        let now_ms = con.now_ms().await?;
        let mut views = [view(
            id.to_owned(),
            &home,
            version,
            stored,
            Beside {
                envelope: envelope.as_deref(),
                next,
                quarantine: quarantine.as_deref(),
                health: health.as_deref(),
            },
        )];
        show_written_ahead(&mut con, &home, &mut views, now_ms).await?;
        let [view] = views;
        Ok(Some(view))
    }
}

impl Operator {
    /// Runs a schedule once now, off its grid: enqueues one occurrence due now, id
    /// `<schedule>:<now ms>:run` ([`run_now_id`]: never the id of an occurrence on the grid,
    /// which is written once), carrying what the schedule's occurrences carry (its
    /// destination, payload, headers, max lateness). The pending occurrence and the grid do
    /// not move; a paused schedule runs too. Returns the job id, or `None` when there is no
    /// such schedule (or its definition cannot be read).
    pub async fn schedule_run_now(&self, id: &str) -> Result<Option<String>, ClientError> {
        self.fenced_by_layout("the schedule", |layout| async move {
            let Some(home) = self.schedule_home_of(&layout, id).await? else {
                return Ok(None);
            };
            let keys = home.keys();
            let mut con = self.con.clone();
            let (record, envelope): (Option<String>, Option<Vec<u8>>) = redis::pipe()
                .hget(keys.schedules, id)
                .hget(keys.sched_env, id)
                .query_async(&mut con)
                .await?;
            let (Some(Ok((_, stored))), Some(envelope)) =
                (record.as_deref().map(parse_record), envelope)
            else {
                return Ok(None);
            };
            let now_ms = con.now_ms().await?;
            let job_id = run_now_id(id, now_ms);
            // Keep: a second click in the same millisecond is the same run.
            match &home {
                Home::Shard(keys) => {
                    let items = [EnqueueItem {
                        id: job_id.clone(),
                        due: Due::At(now_ms),
                        envelope,
                        max_lateness_ms: stored.def.max_lateness_ms,
                        unique_for_ms: None,
                    }];
                    let call = EnqueueCall {
                        keys: keys.clone(),
                        items: &items,
                    };
                    let mut answers =
                        scripts::enqueue_jobs(&mut con, OnConflict::Keep, &[call]).await?;
                    answers.pop().expect("one answer per call")?;
                }
                Home::Lane(lane) => {
                    let mut env = Envelope::decode(&envelope)?;
                    env.meta.max_lateness_ms = None;
                    let meta = (env.meta != Meta::default())
                        .then(|| serde_json::to_string(&env.meta).expect("a Meta serializes"));
                    let item = LaneItem {
                        id: &job_id,
                        due: Due::At(now_ms),
                        payload: &env.payload,
                        meta: meta.as_deref(),
                        max_lateness_ms: stored.def.max_lateness_ms,
                        unique_for_ms: None,
                    };
                    scripts::enqueue_lane(
                        &mut con,
                        lane,
                        OnConflict::Keep,
                        &layout.wake_channel(),
                        &[item],
                    )
                    .await?;
                }
            }
            Ok(Some(job_id))
        })
        .await
    }

    /// Why a schedule is quarantined, when it is: also for a schedule whose definition
    /// cannot be read (which [`Client::schedule_get`] does not return).
    pub async fn schedule_quarantine(&self, id: &str) -> Result<Option<Quarantine>, ClientError> {
        let layout = self.keys();
        let Some(home) = self.schedule_home_of(&layout, id).await? else {
            return Ok(None);
        };
        let keys = home.keys();
        let (quarantine, marker): (Option<String>, Option<String>) = redis::pipe()
            .hget(keys.sched_quarantine, id)
            .get(home.fence_key())
            .query_async(&mut self.con.clone())
            .await?;
        home.check_read(marker, &layout)?;
        Ok(quarantine.as_deref().map(Quarantine::parse))
    }

    /// Every quarantined schedule, by shard (or lane) and id (`HSCAN` of each home's
    /// quarantine, which holds only those).
    pub async fn schedules_quarantined(&self) -> Result<Vec<QuarantinedSchedule>, ClientError> {
        let layout = self.keys();
        let mut con = self.con.clone();
        let mut out = Vec::new();
        for home in self.homes(&layout).await? {
            let keys = home.keys();
            let (shard, lane) = home.place();
            let mut cursor = 0;
            loop {
                let (next, page) = home
                    .hscan_page(&mut con, &layout, keys.sched_quarantine, cursor, SCAN_PAGE)
                    .await?;
                out.extend(page.into_iter().map(|(id, text)| QuarantinedSchedule {
                    id,
                    shard,
                    lane,
                    quarantine: Quarantine::parse(&text),
                }));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        out.sort_by(|a, b| (a.shard, a.lane, &a.id).cmp(&(b.shard, b.lane, &b.id)));
        Ok(out)
    }

    /// The `n` schedules that missed the most occurrences (at least one), most first (ties by
    /// id): an `HSCAN` of every home's health records, which hold only schedules that fired,
    /// missed, expired or skipped at least once. Cost: one pass over those records.
    pub async fn schedules_most_missed(
        &self,
        n: usize,
    ) -> Result<Vec<(String, ScheduleHealth)>, ClientError> {
        let layout = self.keys();
        let mut con = self.con.clone();
        let mut top: Vec<(String, ScheduleHealth)> = Vec::new();
        if n == 0 {
            return Ok(top);
        }
        let rank = |a: &(String, ScheduleHealth), b: &(String, ScheduleHealth)| {
            b.1.missed.cmp(&a.1.missed).then_with(|| a.0.cmp(&b.0))
        };
        for home in self.homes(&layout).await? {
            let keys = home.keys();
            let mut cursor = 0;
            loop {
                let (next, page) = home
                    .hscan_page(&mut con, &layout, keys.sched_health, cursor, SCAN_PAGE)
                    .await?;
                top.extend(
                    page.into_iter()
                        .map(|(id, text)| (id, ScheduleHealth::parse(&text)))
                        .filter(|(_, h)| h.missed > 0),
                );
                // Bounded: at most n kept between pages.
                if top.len() > n {
                    top.sort_by(rank);
                    top.truncate(n);
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        top.sort_by(rank);
        top.truncate(n);
        Ok(top)
    }

    /// Every schedule: those with a pending occurrence soonest first
    /// ([`Client::schedules_upcoming_page`], page by page), then those without one
    /// ([`Client::schedules_idle`]). Each call reads a bounded page; the list is held whole,
    /// so a caller of a large set pages itself (`zdelay schedule list` does).
    pub async fn schedule_list(&self) -> Result<Vec<ScheduleView>, ClientError> {
        let mut out = Vec::new();
        let mut after = None;
        loop {
            let page = self
                .schedules_upcoming_page(after.as_ref(), SCAN_PAGE)
                .await?;
            out.extend(page.schedules);
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let mut from = Some(IdleCursor::default());
        while let Some(cursor) = from {
            let idle = self.schedules_idle(cursor, SCAN_PAGE).await?;
            out.extend(idle.schedules);
            from = idle.next;
        }
        Ok(out)
    }

    /// The next `limit` schedules to fire, soonest first (ties by shard or lane, then id):
    /// [`Client::schedules_upcoming_page`]'s first page.
    pub async fn schedules_upcoming(&self, limit: usize) -> Result<Vec<ScheduleView>, ClientError> {
        Ok(self.schedules_upcoming_page(None, limit).await?.schedules)
    }

    /// The next `limit` schedules to fire after `after` (from the soonest when `None`), in
    /// the order (pending occurrence, home, id), with where the next page starts (`None`:
    /// none left). Bounded whatever the number of schedules: per home, where the page starts
    /// is found by rank (`ZCOUNT`, or `ZRANK` of the cursor's schedule; a binary search by
    /// rank among the schedules pending at the cursor's moment when that one moved), then
    /// at most `limit` pending occurrences are read by rank (`ZRANGE`), merged, and only the
    /// page's definitions and envelopes read (`HMGET`). Paused and ended schedules have no
    /// pending occurrence: [`Client::schedules_idle`] lists them. Not a snapshot: a schedule
    /// that fires between two pages moves on its timeline, and may be listed again or not.
    pub async fn schedules_upcoming_page(
        &self,
        after: Option<&UpcomingCursor>,
        limit: usize,
    ) -> Result<UpcomingPage, ClientError> {
        let mut page = UpcomingPage {
            schedules: Vec::new(),
            next: None,
        };
        if limit == 0 {
            return Ok(page);
        }
        let layout = self.keys();
        let homes = self.homes(&layout).await?;
        // One more than a page from each home: more than `limit` merged means more are left.
        let count = i64::try_from(limit).unwrap_or(i64::MAX).saturating_add(1);
        let heads = futures::future::try_join_all(homes.iter().enumerate().map(|(at, home)| {
            let con = self.con.clone();
            let layout = &layout;
            async move {
                let start = match after {
                    None => 0,
                    Some(cursor) => upcoming_start(con.clone(), home, at, cursor).await?,
                };
                let (next, marker): (Vec<(String, f64)>, Option<String>) = redis::pipe()
                    .cmd("ZRANGE")
                    .arg(home.keys().sched_due)
                    .arg(start)
                    .arg(start.saturating_add(count - 1))
                    .arg("WITHSCORES")
                    .get(home.fence_key())
                    .query_async(&mut con.clone())
                    .await?;
                home.check_read(marker, layout)?;
                Ok::<_, ClientError>(next.into_iter().map(move |(id, next)| (next, at, id)))
            }
        }))
        .await?;
        let mut next: Vec<(f64, usize, String)> = heads.into_iter().flatten().collect();
        next.sort_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then_with(|| (a.1, &a.2).cmp(&(b.1, &b.2)))
        });
        if next.len() > limit {
            next.truncate(limit);
            let (ms, home, id) = &next[limit - 1];
            page.next = Some(UpcomingCursor {
                next_ms: *ms as i64,
                home: *home as u32,
                id: id.clone(),
            });
        }
        let mut by_home: BTreeMap<usize, Vec<(String, f64)>> = BTreeMap::new();
        for (next, at, id) in next {
            by_home.entry(at).or_default().push((id, next));
        }
        let read = futures::future::try_join_all(by_home.into_iter().map(|(at, ids)| {
            let views = read_views(self.con.clone(), &homes[at], ids);
            async move { Ok::<_, ClientError>(views.await?.into_iter().map(move |v| (at, v))) }
        }))
        .await?;
        // The heads' order: a page ends where its cursor says.
        let mut views: Vec<(usize, ScheduleView)> = read.into_iter().flatten().collect();
        views.sort_by(|(a_at, a), (b_at, b)| {
            (a.next_ms, a_at, &a.id).cmp(&(b.next_ms, b_at, &b.id))
        });
        page.schedules = views.into_iter().map(|(_, view)| view).collect();
        Ok(page)
    }

    /// Schedules without a pending occurrence — paused, or past their end — found by a
    /// bounded scan of the definitions (`HSCAN`, home by home in number order, from `from`):
    /// about `scan` definitions are read, those without a pending occurrence (`ZMSCORE`)
    /// returned, with where to continue (`None`: every home was scanned). Unreadable
    /// definitions are left out, as everywhere.
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
        let homes = self.homes(&layout).await?;
        let now_ms = con.now_ms().await?;
        let mut read = 0;
        for (at, home) in homes.iter().enumerate().skip(from.home as usize) {
            let keys = home.keys();
            let mut cursor = if at == from.home as usize {
                from.cursor
            } else {
                0
            };
            loop {
                if read >= scan.max(1) {
                    out.next = Some(IdleCursor {
                        home: at as u32,
                        cursor,
                    });
                    return Ok(out);
                }
                let (next, page) = home
                    .hscan_page(
                        &mut con,
                        &layout,
                        keys.schedules,
                        cursor,
                        (scan - read).clamp(1, SCAN_PAGE),
                    )
                    .await?;
                read += page.len().max(1);
                if !page.is_empty() {
                    let pending: Vec<Option<f64>> = redis::cmd("ZMSCORE")
                        .arg(keys.sched_due)
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
                        type Reply = (
                            Vec<Option<Vec<u8>>>,
                            Vec<Option<String>>,
                            Vec<Option<String>>,
                        );
                        let (envelopes, quarantines, healths): Reply = redis::pipe()
                            .cmd("HMGET")
                            .arg(keys.sched_env)
                            .arg(&names)
                            .cmd("HMGET")
                            .arg(keys.sched_quarantine)
                            .arg(&names)
                            .cmd("HMGET")
                            .arg(keys.sched_health)
                            .arg(&names)
                            .query_async(&mut con)
                            .await?;
                        let read = idle.into_iter().zip(envelopes).zip(quarantines);
                        let first = out.schedules.len();
                        for ((((id, record), envelope), quarantine), health) in read.zip(healths) {
                            if let Ok((version, s)) = parse_record(&record) {
                                out.schedules.push(view(
                                    id,
                                    home,
                                    version,
                                    s,
                                    Beside {
                                        envelope: envelope.as_deref(),
                                        next: None,
                                        quarantine: quarantine.as_deref(),
                                        health: health.as_deref(),
                                    },
                                ));
                            }
                        }
                        let page = &mut out.schedules[first..];
                        show_written_ahead(&mut con, home, page, now_ms).await?;
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(out)
    }

    /// How many schedules there are, and how many have a pending occurrence (`HLEN` and
    /// `ZCARD` per shard or lane, summed).
    pub async fn schedule_counts(&self) -> Result<ScheduleCounts, ClientError> {
        let layout = self.keys();
        let mut counts = ScheduleCounts::default();
        for home in self.homes(&layout).await? {
            let keys = home.keys();
            let (schedules, pending, marker): (u64, u64, Option<String>) = redis::pipe()
                .hlen(keys.schedules)
                .zcard(keys.sched_due)
                .get(home.fence_key())
                .query_async(&mut self.con.clone())
                .await?;
            home.check_read(marker, &layout)?;
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

/// The views of `ids` (each with its pending occurrence) in one home: definitions and
/// envelopes by `HMGET`, in chunks. A schedule deleted meanwhile is left out.
async fn read_views(
    mut con: Conn,
    home: &Home,
    ids: Vec<(String, f64)>,
) -> Result<Vec<ScheduleView>, ClientError> {
    let keys = home.keys();
    let now_ms = con.now_ms().await?;
    let mut out: Vec<ScheduleView> = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(SCAN_PAGE) {
        let first = out.len();
        let names: Vec<&String> = chunk.iter().map(|(id, _)| id).collect();
        type Reply = (
            Vec<Option<String>>,
            Vec<Option<Vec<u8>>>,
            Vec<Option<String>>,
            Vec<Option<String>>,
        );
        let (records, envelopes, quarantines, healths): Reply = redis::pipe()
            .cmd("HMGET")
            .arg(keys.schedules)
            .arg(&names)
            .cmd("HMGET")
            .arg(keys.sched_env)
            .arg(&names)
            .cmd("HMGET")
            .arg(keys.sched_quarantine)
            .arg(&names)
            .cmd("HMGET")
            .arg(keys.sched_health)
            .arg(&names)
            .query_async(&mut con)
            .await?;
        let read = chunk.iter().zip(records).zip(envelopes).zip(quarantines);
        for (((((id, next), record), envelope), quarantine), health) in read.zip(healths) {
            if let Some(Ok((version, s))) = record.as_deref().map(parse_record) {
                out.push(view(
                    id.clone(),
                    home,
                    version,
                    s,
                    Beside {
                        envelope: envelope.as_deref(),
                        next: Some(*next),
                        quarantine: quarantine.as_deref(),
                        health: health.as_deref(),
                    },
                ));
            }
        }
        show_written_ahead(&mut con, home, &mut out[first..], now_ms).await?;
    }
    Ok(out)
}

/// Where a page after `cursor` starts in `home` (its position `at` among the homes): the rank
/// in its `sched_due` of its first entry after the cursor in the order (pending occurrence,
/// home, id). Entries of an earlier home at the cursor's moment come before it, of a later
/// home after it; in the cursor's home, the cursor's schedule's rank when it is still pending
/// there, or else a binary search by rank among the entries at that moment (Redis orders
/// equal scores by id bytes): a few calls, never a walk over them.
async fn upcoming_start(
    mut con: Conn,
    home: &Home,
    at: usize,
    cursor: &UpcomingCursor,
) -> Result<i64, ClientError> {
    let key = home.keys().sched_due;
    let ms = cursor.next_ms;
    let (before, through, score, rank): (i64, i64, Option<f64>, Option<i64>) = redis::pipe()
        .zcount(key, "-inf", format!("({ms}"))
        .zcount(key, "-inf", ms)
        .zscore(key, &cursor.id)
        .zrank(key, &cursor.id)
        .query_async(&mut con)
        .await?;
    let home_at = cursor.home as usize;
    if at < home_at {
        return Ok(through);
    }
    if at > home_at {
        return Ok(before);
    }
    if let (Some(score), Some(rank)) = (score, rank)
        && score == ms as f64
    {
        return Ok(rank + 1);
    }
    // The first entry at the cursor's moment whose id sorts after the cursor's.
    let (mut lo, mut hi) = (before, through);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let probe: Vec<String> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(mid)
            .arg(mid)
            .query_async(&mut con)
            .await?;
        match probe.first() {
            Some(id) if id.as_bytes() > cursor.id.as_bytes() => hi = mid,
            Some(_) => lo = mid + 1,
            // The set shrank under the search: start at what is left.
            None => hi = mid,
        }
    }
    Ok(lo)
}

/// Where [`Client::schedules_upcoming_page`] continues: after the schedule `id` of the home
/// at position `home` (as [`IdleCursor::home`]), pending at `next_ms`. Its text form is
/// `<next_ms>-<home>-<id>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpcomingCursor {
    pub next_ms: i64,
    pub home: u32,
    pub id: String,
}

impl std::fmt::Display for UpcomingCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}-{}", self.next_ms, self.home, self.id)
    }
}

impl std::str::FromStr for UpcomingCursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not a page position: expected <next_ms>-<home>-<id>");
        // The moment may be negative (before 1970): its sign is not a separator.
        let (sign, unsigned) = match text.strip_prefix('-') {
            Some(rest) => (-1, rest),
            None => (1, text),
        };
        let mut parts = unsigned.splitn(3, '-');
        let (Some(ms), Some(home), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let next_ms: i64 = ms.parse().map_err(|_| bad())?;
        if id.is_empty() || ms.starts_with('+') || home.starts_with('+') {
            return Err(bad());
        }
        Ok(UpcomingCursor {
            next_ms: sign * next_ms,
            home: home.parse().map_err(|_| bad())?,
            id: id.to_owned(),
        })
    }
}

/// One page of [`Client::schedules_upcoming_page`].
#[derive(Debug, Clone)]
pub struct UpcomingPage {
    pub schedules: Vec<ScheduleView>,
    /// Where the next page starts; `None` when this one holds the last pending schedules.
    pub next: Option<UpcomingCursor>,
}

/// Where a scan for schedules without a pending occurrence continues: a home (its position
/// among the shards, then on layout 2 the route lanes in number order) and its `HSCAN`
/// cursor. Its text form is `<home>-<cursor>`; the default starts at the beginning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdleCursor {
    pub home: u32,
    pub cursor: u64,
}

impl std::fmt::Display for IdleCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.home, self.cursor)
    }
}

impl std::str::FromStr for IdleCursor {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || format!("{text:?} is not a scan position: expected <home>-<cursor>");
        let (home, cursor) = text.split_once('-').ok_or_else(bad)?;
        Ok(IdleCursor {
            home: home.parse().map_err(|_| bad())?,
            cursor: cursor.parse().map_err(|_| bad())?,
        })
    }
}

/// What one [`Client::schedules_idle`] call found.
#[derive(Debug, Clone)]
pub struct IdleSchedules {
    pub schedules: Vec<ScheduleView>,
    /// Where to continue; `None` when every home was scanned.
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

/// What is kept beside a schedule's definition, as read with it (each may be missing).
struct Beside<'a> {
    envelope: Option<&'a [u8]>,
    /// Its pending occurrence.
    next: Option<f64>,
    quarantine: Option<&'a str>,
    health: Option<&'a str>,
}

fn view(id: String, home: &Home, version: u64, s: Stored, beside: Beside<'_>) -> ScheduleView {
    let Beside {
        envelope,
        next,
        quarantine,
        health,
    } = beside;
    let (shard, lane) = home.place();
    ScheduleView {
        id,
        shard,
        lane,
        dest: s.dest,
        def: s.def,
        paused: s.paused,
        next_ms: next.map(|n| n as i64),
        version,
        created_ms: s.created_ms,
        updated_ms: s.updated_ms,
        envelope: envelope.and_then(|e| Envelope::decode(e).ok()),
        quarantine: quarantine.map(Quarantine::parse),
        health: health.map(ScheduleHealth::parse).unwrap_or_default(),
    }
}

/// Shows as each view's next occurrence the first one a firing wrote ahead of its time, when
/// it still waits as a job in `home` (the latest occurrence written is after `now_ms`, and
/// the first of the definition after now is waiting in due).
async fn show_written_ahead(
    con: &mut Conn,
    home: &Home,
    views: &mut [ScheduleView],
    now_ms: i64,
) -> Result<(), ClientError> {
    let first_ahead = |v: &ScheduleView| {
        let last = v.health.last_occurrence_ms.filter(|&last| last > now_ms)?;
        if v.paused {
            return None;
        }
        let first = v.def.compile().ok()?.next_after(now_ms)?;
        (first <= last).then_some(first)
    };
    let candidates: Vec<(usize, i64)> = views
        .iter()
        .enumerate()
        .filter_map(|(k, v)| Some((k, first_ahead(v)?)))
        .collect();
    if candidates.is_empty() {
        return Ok(());
    }
    let jobs: Vec<String> = candidates
        .iter()
        .map(|&(k, at)| occurrence_id(&views[k].id, at))
        .collect();
    let waiting: Vec<Option<f64>> = redis::cmd("ZMSCORE")
        .arg(home.keys().due)
        .arg(&jobs)
        .query_async(con)
        .await?;
    for ((k, at), score) in candidates.into_iter().zip(waiting) {
        if score.is_some() {
            views[k].next_ms = Some(at);
        }
    }
    Ok(())
}

/// Compiled schedules by id, with a hash of the record they were compiled from (a mover keeps
/// one per shard: compiling a cron takes tens of microseconds, firing one a few).
#[derive(Default)]
pub struct ScheduleCache {
    compiled: HashMap<String, (u64, Arc<Schedule>)>,
}

impl ScheduleCache {
    /// The schedule a stored record defines, or why it cannot be fired. Reused only for the
    /// same record text, not the same version: releases before 0.2 numbered a schedule
    /// deleted and written again from 1 again, so one version could name two definitions.
    /// A hash of the text, not the text: the cache holds every schedule of a shard.
    fn get(&mut self, id: &str, record: &str) -> Result<Arc<Schedule>, String> {
        let record_hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            record.hash(&mut h);
            h.finish()
        };
        if let Some((compiled_from, schedule)) = self.compiled.get(id)
            && *compiled_from == record_hash
        {
            return Ok(schedule.clone());
        }
        let (_, stored) = parse_record(record)?;
        let schedule = Arc::new(
            stored
                .def
                .compile()
                .map_err(|e| format!("unreadable definition: {e}"))?,
        );
        // Bounded by the shard's schedules; a deleted one's entry is replaced or lingers.
        self.compiled
            .insert(id.to_owned(), (record_hash, schedule.clone()));
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
/// script. Occurrences up to `ahead_ms` after now are written too, as jobs due at their time
/// (a crowded second is then only moved when it comes). `now_ms` overrides Redis TIME (tests
/// drive time with it).
pub async fn fire_due(
    con: &mut Conn,
    at: SchedAt<'_>,
    now_ms: Option<i64>,
    ahead_ms: u64,
    cache: &mut ScheduleCache,
    direct: Option<DirectPush<'_>>,
) -> redis::RedisResult<FireReport> {
    let (now, due) = scripts::due_schedules(con, at, now_ms, ahead_ms, FIRE_BATCH).await?;
    let horizon = now.saturating_add(ahead_ms as i64);
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
        schedule.plan_ahead(&mut plan, horizon, budget + 1);
        let decided_to = match plan.truncate(budget) {
            // Cut: the first occurrence left out stays pending (it is due: the next call
            // plans from it), and the mark is the last one written.
            Some(first_left) => {
                report.more = true;
                firing.next_ms = Some(first_left);
                firing.mark_ms = plan.last_written();
                plan.last_written().unwrap_or(at - 1)
            }
            // Every occurrence up to now, and those written ahead, are decided.
            None => {
                let decided_to = plan.last_written().map_or(now, |last| last.max(now));
                firing.next_ms = plan.next;
                firing.mark_ms = Some(decided_to);
                decided_to
            }
        };
        // What the calendar skipped between this occurrence and the pending one it leaves
        // (grid occurrences on days it skips; a shift moves them instead: not counted). The
        // next firing counts from that pending one on, so each is counted once. And what the
        // misfire policy passed over: the occurrences decided (the calendar applied, so none
        // it skipped), neither delivered nor expired.
        firing.skipped_by_calendar = u64::from(schedule.skipped_between(
            at,
            firing.next_ms.unwrap_or(decided_to.saturating_add(1)),
            crate::schedule::MAX_COUNTED_SKIPS,
        ));
        let written = (plan.deliver.len() + plan.expired.len()) as u64;
        firing.missed = schedule
            .occurrences_decided(at, decided_to)
            .saturating_sub(written);
        budget -= plan.deliver.len() + plan.expired.len();
        let jobs = |times: &[i64]| {
            times
                .iter()
                .map(|&t| (occurrence_id(&firing.id, t), t))
                .collect::<Vec<_>>()
        };
        let jitter_ms = schedule.def().jitter_ms.unwrap_or(0);
        firing.deliver = jobs(&plan.deliver)
            .into_iter()
            .map(|(job, t)| {
                let due = t + crate::client::spread_offset_ms(&job, jitter_ms) as i64;
                (job, t, due)
            })
            .collect();
        firing.expired = jobs(&plan.expired);
        firing.max_lateness_ms = schedule.def().max_lateness_ms;
        firings.push(firing);
    }
    report.sent = firings.len();
    if !firings.is_empty() {
        let retention = MARK_RETENTION.as_millis() as u64;
        let direct = match direct {
            Some(d) => Some(DirectPush {
                now_ms: con.script_now_ms(now_ms).await?,
                ..d
            }),
            None => None,
        };
        report.fired = scripts::fire_schedules(con, at, now, retention, &firings, direct).await?;
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
    fn the_cache_compiles_again_for_another_definition_under_the_same_version() {
        let record = |interval_ms: u64| {
            let stored = Stored {
                dest: "q".into(),
                def: ScheduleDef::every(interval_ms, 0),
                paused: false,
                created_ms: 0,
                updated_ms: 0,
            };
            format!("1\n{}", serde_json::to_string(&stored).unwrap())
        };
        let mut cache = ScheduleCache::default();
        let first = cache.get("s", &record(1_000)).unwrap();
        assert_eq!(first.next_after(0), Some(1_000));
        assert!(Arc::ptr_eq(
            &first,
            &cache.get("s", &record(1_000)).unwrap()
        ));
        let second = cache.get("s", &record(500)).unwrap();
        assert_eq!(second.next_after(0), Some(500), "not the first definition");
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
            envelope: None,
            written_ahead: Vec::new(),
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
            home: 3,
            cursor: 917,
        };
        assert_eq!(c.to_string(), "3-917");
        assert_eq!("3-917".parse::<IdleCursor>(), Ok(c));
        assert_eq!("0-0".parse::<IdleCursor>(), Ok(IdleCursor::default()));
        for bad in ["", "3", "x-1", "1-", "-1-2", "5000000000-1"] {
            let e = bad.parse::<IdleCursor>().unwrap_err();
            assert!(e.contains("-<cursor>"), "{bad}: {e}");
        }
    }

    #[test]
    fn upcoming_cursors_round_trip_their_text() {
        for (ms, home, id) in [
            (1_700_000_000_000, 3, "a-b-c"),
            (-5, 0, "x"),
            (0, 17, "é:1"),
        ] {
            let c = UpcomingCursor {
                next_ms: ms,
                home,
                id: id.into(),
            };
            assert_eq!(
                c.to_string().parse::<UpcomingCursor>(),
                Ok(c.clone()),
                "{c}"
            );
        }
        assert_eq!("12-3-id".parse::<UpcomingCursor>().unwrap().id, "id");
        for bad in [
            "", "12", "12-3", "12-3-", "x-3-id", "12-y-id", "+1-3-id", "1-+3-id", "--1-2-a",
        ] {
            let e = bad.parse::<UpcomingCursor>().unwrap_err();
            assert!(e.contains("<next_ms>-<home>-<id>"), "{bad}: {e}");
        }
    }
}
