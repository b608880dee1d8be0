//! Recurring schedules, the pure part: the stored definition ([`ScheduleDef`]), its
//! validation, the next occurrence ([`Schedule::next_after`]) and what to deliver when
//! occurrences were missed ([`Schedule::plan`]). No Redis here: the daemon's scripts store
//! the definition as JSON and the next occurrence as a score; this module computes both.
//!
//! Times are epoch milliseconds (UTC) throughout, like [`crate::job::Due::At`].
//!
//! # Crates, chosen by testing their edge cases
//!
//! The same 21 cases (the DST cases of the tests below, leap years, the 31st, weekday 0/7,
//! day-of-month OR day-of-week, 5/6 fields, a pattern that never fires) were run against
//! each candidate, 2026-11:
//! - `cron` 0.17 (+ chrono-tz): 5/21. Skips the spring-forward day (no 02:30 on 2026-03-29
//!   in Paris, nor 00:00 on 2018-11-04 in Sao Paulo), fires twice on fall-back (02:30 +02
//!   and +01), weekdays 1-7 from Sunday = 1 (`0` rejected, `7` = Saturday, `1-5` = Sun-Thu),
//!   day-of-month AND day-of-week, seconds field mandatory.
//! - `jiff-cron` 0.3 (a port of `cron`): 9/21. Gap moved by its length (02:30 -> 03:30, not
//!   03:00), New York fall-back fires at the second 01:30 (-05), same weekday numbering.
//! - `saffron` 0.1: 3/21. UTC only, no seconds field, `0` rejected, `7` = Saturday.
//! - `croner` 4.0.3 (with chrono-tz or jiff): 19/21, all single-time DST cases right,
//!   weekday 0 = 7 = Sunday, Vixie OR, 5 or 6 fields. Fails the two cases where its DST rule
//!   is not this project's: a multi-valued time in the gap (`0,30 2 * * *`) does not fire
//!   at all that day (it carries only single-valued "fixed-time" patterns over a gap), and
//!   an hourly pattern fires twice in a repeated hour (01:00 -04 and 01:00 -05).
//!
//! So: `croner` parses and matches the fields, walking *civil* time (jiff's
//! `civil::DateTime`, no zone: pure calendar), and this module resolves each matching civil
//! time to an instant with `jiff`'s IANA data: in a gap → the first instant after the gap
//! (once, however many skipped times matched); in a fold → the earlier instant only. That
//! is the one piece written here; all 21 cases pass with it (the tests below). `jiff` reads
//! the system tzdb (`/usr/share/zoneinfo`, or `TZDIR`) and falls back to its bundled copy
//! (feature `tzdb-bundle-always`), so a container without tzdata still knows the zones.

use std::collections::VecDeque;

use crate::calendar::{Calendar, DayOff, Shift, valid_calendar_name};
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::Timestamp;
use jiff::civil::{Date, DateTime};
use jiff::tz::{AmbiguousOffset, Offset, TimeZone};
use serde::{Deserialize, Serialize};

/// `catch_up` without a `max`: at most this many missed occurrences delivered.
pub const DEFAULT_MAX_CATCH_UP: u32 = 100;
/// The largest `max_catch_up` accepted: one plan writes at most this many jobs.
pub const MAX_CATCH_UP_LIMIT: u32 = 10_000;

/// How a schedule repeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recurrence {
    /// A cron expression: 5 fields (minute resolution) or 6 (seconds first); weekday 0 and 7
    /// are Sunday; day-of-month and day-of-week together match either (Vixie). Local times
    /// in `tz`, an IANA zone name (default `UTC`).
    Cron {
        expr: String,
        #[serde(default = "utc")]
        tz: String,
    },
    /// Every `interval_ms`, on the grid `anchor_ms + k * interval_ms`. The anchor is fixed when
    /// the schedule is created (its start) and kept on update, so deliveries never drift.
    Every { interval_ms: u64, anchor_ms: i64 },
}

fn utc() -> String {
    "UTC".to_owned()
}

/// What to do when occurrences were missed (daemon down, sink paused): when, at delivery
/// time, a later occurrence than the due one is also due.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Misfire {
    /// One delivery now (the latest missed occurrence), then on along the grid.
    #[default]
    Coalesce,
    /// No delivery; on along the grid.
    Skip,
    /// Each missed occurrence, the latest `max` of them, oldest first.
    CatchUp {
        #[serde(default = "default_max_catch_up")]
        max: u32,
    },
}

fn default_max_catch_up() -> u32 {
    DEFAULT_MAX_CATCH_UP
}

/// A schedule as stored and as given by a user: plain data, checked by [`validate`]
/// and turned into a [`Schedule`] by [`compile`].
///
/// [`validate`]: ScheduleDef::validate
/// [`compile`]: ScheduleDef::compile
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleDef {
    pub recurrence: Recurrence,
    #[serde(default)]
    pub misfire: Misfire,
    /// No occurrence before this (epoch ms, inclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_at: Option<i64>,
    /// No occurrence at or after this (epoch ms, exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_at: Option<i64>,
    /// An occurrence delivered later than this after its time goes to dead (`expired`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lateness_ms: Option<u64>,
    /// Each occurrence's job is due at a point of this window after the occurrence, derived
    /// from its job id (`client::spread_offset_ms`): occurrences of many schedules on one
    /// moment are spread over it. The occurrences themselves (their ids, the grid, misfire,
    /// expiry) stay on the grid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jitter_ms: Option<u64>,
    /// Days the schedule does not fire on (its local date, in its zone; UTC for `every`),
    /// and what it does instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<ScheduleCalendar>,
}

/// A schedule's calendar: the stored calendar's name and a copy of its days, taken when the
/// schedule is set (a firing reads nothing else; `schedule set` again takes a new copy).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleCalendar {
    pub name: String,
    #[serde(default)]
    pub shift: Shift,
    pub days: Calendar,
}

/// An invalid schedule: the field (as the CLI names it) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid schedule: {field}: {why}")]
pub struct ScheduleError {
    pub field: &'static str,
    pub why: String,
}

fn invalid(field: &'static str, why: impl Into<String>) -> ScheduleError {
    ScheduleError {
        field,
        why: why.into(),
    }
}

impl ScheduleDef {
    /// A cron schedule in `tz`, other fields at their defaults.
    pub fn cron(expr: impl Into<String>, tz: impl Into<String>) -> Self {
        Self::with(Recurrence::Cron {
            expr: expr.into(),
            tz: tz.into(),
        })
    }

    /// An interval schedule on the grid `anchor_ms + k * interval_ms`.
    pub fn every(interval_ms: u64, anchor_ms: i64) -> Self {
        Self::with(Recurrence::Every {
            interval_ms,
            anchor_ms,
        })
    }

    fn with(recurrence: Recurrence) -> Self {
        ScheduleDef {
            recurrence,
            misfire: Misfire::default(),
            start_at: None,
            end_at: None,
            max_lateness_ms: None,
            jitter_ms: None,
            calendar: None,
        }
    }

    /// Whether `other` has the same occurrences: the same recurrence and window. The
    /// misfire policy and max lateness only decide what a firing delivers, so an update that
    /// changes only them (or the payload, headers, destination) keeps the pending occurrence.
    pub fn same_occurrences(&self, other: &ScheduleDef) -> bool {
        self.recurrence == other.recurrence
            && self.start_at == other.start_at
            && self.end_at == other.end_at
            && self.calendar == other.calendar
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        self.compile().map(drop)
    }

    /// Validates and parses: the result computes occurrences without failing.
    pub fn compile(&self) -> Result<Schedule, ScheduleError> {
        for (field, at) in [("start_at", self.start_at), ("end_at", self.end_at)] {
            if let Some(ms) = at {
                in_range(field, ms)?;
            }
        }
        if let (Some(start), Some(end)) = (self.start_at, self.end_at)
            && end <= start
        {
            return Err(invalid("end_at", "must be after start_at"));
        }
        if let Misfire::CatchUp { max } = self.misfire
            && !(1..=MAX_CATCH_UP_LIMIT).contains(&max)
        {
            return Err(invalid(
                "max_catch_up",
                format!("must be between 1 and {MAX_CATCH_UP_LIMIT}, got {max}"),
            ));
        }
        if self.max_lateness_ms == Some(0) {
            return Err(invalid("max_lateness", "must be more than 0"));
        }
        if self.jitter_ms == Some(0) {
            return Err(invalid("jitter", "must be more than 0"));
        }
        let rule = match &self.recurrence {
            Recurrence::Cron { expr, tz } => {
                let cron = parse_cron(expr)?;
                let zone = TimeZone::get(tz)
                    .map_err(|e| invalid("tz", format!("unknown time zone {tz:?}: {e}")))?;
                // A pattern that names only impossible dates (30 February) never fires.
                let y2000 = DateTime::constant(2000, 1, 1, 0, 0, 0, 0);
                if cron.find_next_occurrence(&y2000, true).is_err() {
                    return Err(invalid("cron", format!("{expr:?} never fires")));
                }
                Rule::Cron {
                    cron: Box::new(cron),
                    tz: zone,
                }
            }
            Recurrence::Every {
                interval_ms,
                anchor_ms,
            } => {
                let interval = i64::try_from(*interval_ms)
                    .ok()
                    .filter(|&i| i > 0)
                    .ok_or_else(|| invalid("every", "must be at least 1 ms"))?;
                in_range("anchor", *anchor_ms)?;
                Rule::Every {
                    interval,
                    anchor: *anchor_ms,
                }
            }
        };
        if let Some(calendar) = &self.calendar {
            valid_calendar_name(&calendar.name).map_err(|e| invalid("calendar", e.0))?;
            if calendar.shift != Shift::Skip && matches!(rule, Rule::Every { .. }) {
                return Err(invalid(
                    "shift",
                    "next and previous move an occurrence to another day at the same local time: they need --cron",
                ));
            }
        }
        let schedule = Schedule {
            def: self.clone(),
            rule,
        };
        if let Some(calendar) = &self.calendar {
            let y2000 = 946_684_800_000;
            if schedule.next_after(y2000).is_none() {
                return Err(invalid(
                    "calendar",
                    format!(
                        "every occurrence falls on a day calendar {:?} skips",
                        calendar.name
                    ),
                ));
            }
        }
        if let (Some(start), Some(_)) = (self.start_at, self.end_at)
            && schedule.next_after(start - 1).is_none()
        {
            return Err(invalid(
                "end_at",
                "no occurrence between start_at and end_at",
            ));
        }
        Ok(schedule)
    }
}

fn in_range(field: &'static str, ms: i64) -> Result<(), ScheduleError> {
    Timestamp::from_millisecond(ms)
        .map(drop)
        .map_err(|_| invalid(field, format!("{ms} ms is out of range")))
}

fn parse_cron(expr: &str) -> Result<Cron, ScheduleError> {
    let fields = expr.split_whitespace().count();
    let nickname = fields == 1 && expr.trim_start().starts_with('@');
    if !(nickname || fields == 5 || fields == 6) {
        return Err(invalid(
            "cron",
            format!(
                "{expr:?}: expected 5 fields (minute resolution) or 6 (seconds first), got {fields}"
            ),
        ));
    }
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
        .parse(expr)
        .map_err(|e| invalid("cron", format!("{expr:?}: {e}")))
}

/// A validated schedule: computes occurrences. Serializes as its [`ScheduleDef`], and
/// deserializing validates (a stored schedule that no longer validates is an error).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "ScheduleDef", into = "ScheduleDef")]
pub struct Schedule {
    def: ScheduleDef,
    rule: Rule,
}

#[derive(Debug, Clone)]
enum Rule {
    // Boxed: a parsed pattern is 300 bytes.
    Cron { cron: Box<Cron>, tz: TimeZone },
    Every { interval: i64, anchor: i64 },
}

impl PartialEq for Schedule {
    fn eq(&self, other: &Self) -> bool {
        self.def == other.def
    }
}

impl TryFrom<ScheduleDef> for Schedule {
    type Error = ScheduleError;
    fn try_from(def: ScheduleDef) -> Result<Self, ScheduleError> {
        def.compile()
    }
}

impl From<Schedule> for ScheduleDef {
    fn from(s: Schedule) -> Self {
        s.def
    }
}

/// What to do with a due occurrence at `now`: see [`Schedule::plan`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Occurrences (their scheduled epoch ms) to deliver now, oldest first. Each is its own
    /// job, idempotency key `<schedule-id>:<ms>`.
    pub deliver: Vec<i64>,
    /// Occurrences past `max_lateness`: to dead with reason `expired`, oldest first.
    pub expired: Vec<i64>,
    /// More than one occurrence was due: the misfire policy decided.
    pub misfired: bool,
    /// The next occurrence, strictly after `now`, on the schedule's grid; `None` when the
    /// schedule has ended.
    pub next: Option<i64>,
}

/// The most calendar skips one firing counts ([`Schedule::skipped_between`]: a per-second
/// schedule over a holiday would otherwise walk 86,400 of them).
pub const MAX_COUNTED_SKIPS: u32 = 1_000;

/// What a calendar did to one grid occurrence ([`Schedule::calendar_skip`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalendarSkip {
    /// Its local date, which the calendar skips.
    pub date: Date,
    pub why: DayOff,
    /// The calendar's name.
    pub calendar: String,
    pub shift: Shift,
    /// Where a shift moved it (`None`: skipped).
    pub moved_to: Option<i64>,
}

impl CalendarSkip {
    /// Why, for users: `2026-12-25 is listed in calendar fr` or `Saturday is a weekend day
    /// of calendar fr`.
    pub fn reason(&self) -> String {
        match self.why {
            DayOff::Listed => format!("{} is listed in calendar {}", self.date, self.calendar),
            DayOff::Weekend(day) => format!(
                "{} {} is a weekend day of calendar {}",
                day.long_name(),
                self.date,
                self.calendar
            ),
        }
    }
}

impl Plan {
    /// Keeps the oldest `budget` occurrences of the plan (those past `max_lateness` are the
    /// oldest), what one bounded write takes, and returns the first one left out: it stays
    /// pending, due, and the next firing plans from it. `None` when all fit.
    pub fn truncate(&mut self, budget: usize) -> Option<i64> {
        if self.expired.len() + self.deliver.len() <= budget {
            return None;
        }
        if self.expired.len() > budget {
            let first_left = self.expired[budget];
            self.expired.truncate(budget);
            self.deliver.clear();
            Some(first_left)
        } else {
            let keep = budget - self.expired.len();
            let first_left = self.deliver[keep];
            self.deliver.truncate(keep);
            Some(first_left)
        }
    }

    /// The latest occurrence the plan writes, delivered or expired.
    pub fn last_written(&self) -> Option<i64> {
        self.deliver.last().or(self.expired.last()).copied()
    }
}

/// Occurrences of a cron schedule [`Schedule::occurrences_decided`] walks before it
/// extrapolates.
pub const MAX_COUNTED: u64 = 10_000;

/// Bound on the civil matches one `next_after` looks at (it needs at most three).
const MAX_CIVIL_STEPS: usize = 64;

impl Schedule {
    pub fn def(&self) -> &ScheduleDef {
        &self.def
    }

    /// The next occurrence strictly after `after_ms`, within `[start_at, end_at)`, on the
    /// days its calendar leaves (or moved by it).
    ///
    /// Cost: `every` is arithmetic; `cron` is one croner search over civil time (it jumps
    /// field by field, microseconds) plus one or two zone lookups. A calendar adds one search
    /// per run of skipped days crossed (each run jumped at once), or for a shift one per day
    /// that moves onto the business day found.
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let after = match self.def.start_at {
            Some(start) if after_ms < start => start - 1,
            _ => after_ms,
        };
        let next = match (&self.def.calendar, &self.rule) {
            (None, _) => self.grid_next(after),
            (Some(calendar), Rule::Cron { cron, tz }) if calendar.shift != Shift::Skip => {
                shifted_next(cron, tz, &calendar.days, calendar.shift, after)
            }
            (Some(calendar), _) => self.skipping_next(&calendar.days, after),
        }?;
        match self.def.end_at {
            Some(end) if next >= end => None,
            _ => Some(next),
        }
    }

    /// The next occurrence of the recurrence alone: no window, no calendar.
    fn grid_next(&self, after: i64) -> Option<i64> {
        match &self.rule {
            Rule::Every { interval, anchor } => every_next(*interval, *anchor, after),
            Rule::Cron { cron, tz } => cron_next(cron, tz, after),
        }
    }

    /// The zone whose local dates the calendar is read in.
    fn zone(&self) -> TimeZone {
        match &self.rule {
            Rule::Cron { tz, .. } => tz.clone(),
            Rule::Every { .. } => TimeZone::UTC,
        }
    }

    /// The next grid occurrence on a business day: a grid occurrence on a skipped day jumps
    /// the whole run of skipped days at once.
    fn skipping_next(&self, days: &Calendar, after: i64) -> Option<i64> {
        let tz = self.zone();
        let mut at = after;
        for _ in 0..MAX_SKIPPED_RUNS {
            let next = self.grid_next(at)?;
            let date = local_date(&tz, next)?;
            if days.is_business_day(date) {
                return Some(next);
            }
            at = day_start(&tz, days.next_business_day(date)?)? - 1;
        }
        None
    }

    /// Whether the calendar takes the grid occurrence `grid_ms` off its day, and where to:
    /// the one point where a calendar skip is decided for an occurrence (previews show it,
    /// [`Schedule::skipped_between`] counts it for a firing's health record). `None`: no calendar, or a business day.
    pub fn calendar_skip(&self, grid_ms: i64) -> Option<CalendarSkip> {
        let calendar = self.def.calendar.as_ref()?;
        let tz = self.zone();
        let local = tz.to_datetime(Timestamp::from_millisecond(grid_ms).ok()?);
        let why = calendar.days.why_skipped(local.date())?;
        // A shift keeps the cron's own time (02:30), not the instant's (03:00 after a gap):
        // the pattern's first match after the instant before this one.
        let time = match &self.rule {
            Rule::Cron { cron, .. } => tz
                .to_datetime(Timestamp::from_millisecond(grid_ms - 1).ok()?)
                .with()
                .subsec_nanosecond(0)
                .build()
                .ok()
                .and_then(|before| cron.find_next_occurrence(&before, false).ok())
                .map_or(local.time(), |civil| civil.time()),
            Rule::Every { .. } => local.time(),
        };
        let moved_to = match calendar.shift {
            Shift::Skip => None,
            shift => calendar
                .days
                .shifted(local.date(), shift)
                .and_then(|day| resolve(&tz, day.to_datetime(time)))
                .map(|t| t.as_millisecond()),
        };
        Some(CalendarSkip {
            date: local.date(),
            why,
            calendar: calendar.name.clone(),
            shift: calendar.shift,
            moved_to,
        })
    }

    /// Up to `n` grid occurrences at or after `from_ms`, each with what the calendar does to
    /// it: for `schedule preview` and the console, so a skipped day shows with its reason.
    pub fn preview(&self, from_ms: i64, n: usize) -> Vec<(i64, Option<CalendarSkip>)> {
        let mut out = Vec::with_capacity(n.min(1024));
        let mut at = from_ms.saturating_sub(1);
        if let Some(start) = self.def.start_at {
            at = at.max(start - 1);
        }
        while out.len() < n {
            match self.grid_next(at) {
                Some(next) if self.def.end_at.is_none_or(|end| next < end) => {
                    out.push((next, self.calendar_skip(next)));
                    at = next;
                }
                _ => break,
            }
        }
        out
    }

    /// The first grid occurrence of each day the calendar skips, after `after_ms` and before
    /// `before_ms`, at most `max`: what the console lists as coming skips. One search per day
    /// that has an occurrence, whatever the schedule's frequency.
    pub fn upcoming_skips(
        &self,
        after_ms: i64,
        before_ms: i64,
        max: usize,
    ) -> Vec<(i64, CalendarSkip)> {
        let mut out = Vec::new();
        if self.def.calendar.is_none() {
            return out;
        }
        let tz = self.zone();
        let mut at = after_ms;
        if let Some(start) = self.def.start_at {
            at = at.max(start - 1);
        }
        for _ in 0..MAX_SKIPPED_RUNS * 2 {
            let Some(next) = self
                .grid_next(at)
                .filter(|&t| t < before_ms && self.in_window(t))
            else {
                break;
            };
            if let Some(skip) = self.calendar_skip(next) {
                out.push((next, skip));
                if out.len() >= max {
                    break;
                }
            }
            // On to the next day.
            let Some(day) = local_date(&tz, next).and_then(|d| d.tomorrow().ok()) else {
                break;
            };
            match day_start(&tz, day) {
                Some(start) => at = start - 1,
                None => break,
            }
        }
        out
    }

    /// Grid occurrences in `(after_ms, before_ms)` that a skipping calendar took away, counted
    /// up to `cap` (a shift moves occurrences rather than dropping them: not counted).
    pub fn skipped_between(&self, after_ms: i64, before_ms: i64, cap: u32) -> u32 {
        let Some(calendar) = &self.def.calendar else {
            return 0;
        };
        if calendar.shift != Shift::Skip {
            return 0;
        }
        let mut count = 0;
        let mut at = after_ms;
        while count < cap {
            match self.grid_next(at) {
                Some(next) if next < before_ms && self.in_window(next) => {
                    if self.calendar_skip(next).is_some() {
                        count += 1;
                    }
                    at = next;
                }
                _ => break,
            }
        }
        count
    }

    /// The latest occurrence strictly before `before_ms` (the grid's, not necessarily one
    /// delivered: a pause or a misfire policy may have skipped it), looked for within a year.
    ///
    /// Cost: a window doubling back from a minute finds an earlier occurrence in a few
    /// `next_after` calls, then occurrences are walked forward to `before_ms`; the window is
    /// at most twice the gap, so the walk is short unless the schedule is dense in bursts
    /// (bounded at 10 000 steps).
    pub fn previous_before(&self, before_ms: i64) -> Option<i64> {
        const YEAR_MS: i64 = 366 * 86_400_000;
        let mut window = 60_000;
        while window <= 2 * YEAR_MS {
            let from = before_ms.saturating_sub(window);
            if let Some(first) = self.next_after(from.saturating_sub(1))
                && first < before_ms
            {
                let mut last = first;
                for _ in 0..10_000 {
                    match self.next_after(last) {
                        Some(next) if next < before_ms => last = next,
                        _ => break,
                    }
                }
                return Some(last);
            }
            window *= 2;
        }
        None
    }

    /// Up to `n` occurrences at or after `from_ms`, for previews.
    pub fn occurrences(&self, from_ms: i64, n: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(n.min(1024));
        let mut at = from_ms.saturating_sub(1);
        while out.len() < n {
            match self.next_after(at) {
                Some(next) => {
                    out.push(next);
                    at = next;
                }
                None => break,
            }
        }
        out
    }

    /// An occurrence as RFC 3339 with its offset in the schedule's zone (UTC for `every`).
    pub fn rfc3339(&self, ms: i64) -> String {
        let Ok(ts) = Timestamp::from_millisecond(ms) else {
            return ms.to_string();
        };
        let offset = match &self.rule {
            Rule::Cron { tz, .. } => tz.to_offset(ts),
            Rule::Every { .. } => Offset::UTC,
        };
        ts.display_with_offset(offset).to_string()
    }

    /// The occurrence `due_ms` is due and it is `now_ms`: which occurrences to deliver now,
    /// which expired, and the next one.
    ///
    /// The due occurrences are `due_ms` (if within `[start_at, end_at)`; it need not be on
    /// the grid: an update applies from the next occurrence) and every occurrence in
    /// `(due_ms, now_ms]`. One due occurrence is delivered whatever the policy (a normal,
    /// slightly late delivery); more than one is a misfire: `coalesce` delivers the latest,
    /// `skip` none, `catch_up` the latest `max`. Then any delivered occurrence more than
    /// `max_lateness` before `now_ms` moves to `expired`. `next` is the first occurrence
    /// after `now_ms`: the grid never moves with delivery times.
    ///
    /// Cost: a few `next_after` calls, plus one per missed occurrence kept (`catch_up`),
    /// whatever the length of the outage.
    pub fn plan(&self, due_ms: i64, now_ms: i64) -> Plan {
        if now_ms < due_ms {
            let next = if self.in_window(due_ms) {
                Some(due_ms)
            } else {
                self.next_after(now_ms)
            };
            return Plan {
                next,
                ..Plan::default()
            };
        }
        let keep = match self.def.misfire {
            Misfire::CatchUp { max } => max as usize,
            Misfire::Coalesce | Misfire::Skip => 1,
        };
        // Two at least, to tell one due occurrence from a misfire.
        let mut due = self.latest_due(due_ms, now_ms, keep.max(2));
        let misfired = due.len() > 1;
        if misfired {
            match self.def.misfire {
                Misfire::Skip => due.clear(),
                Misfire::Coalesce | Misfire::CatchUp { .. } => {
                    while due.len() > keep {
                        due.pop_front();
                    }
                }
            }
        }
        let (expired, deliver) = due.into_iter().partition(|&at| {
            self.def
                .max_lateness_ms
                .is_some_and(|max| now_ms.saturating_sub(at) as u64 > max)
        });
        Plan {
            deliver,
            expired,
            misfired,
            next: self.next_after(now_ms),
        }
    }

    /// Adds to `plan` its next occurrences up to `horizon_ms`, at most `max` of them, and
    /// moves `plan.next` past them: a firing writes them ahead of their time, as jobs due at
    /// it, so a crowded moment costs only their move when it comes.
    pub fn plan_ahead(&self, plan: &mut Plan, horizon_ms: i64, max: usize) {
        let mut added = 0;
        while let Some(next) = plan.next.filter(|&n| n <= horizon_ms && added < max) {
            plan.deliver.push(next);
            plan.next = self.next_after(next);
            added += 1;
        }
    }

    /// How many occurrences a plan of `due_ms` decided up to `to_ms` (inclusive): `due_ms`
    /// itself when it is in the window (as [`plan`](Self::plan) counts it, on the grid or
    /// not), then every occurrence after it up to `to_ms`. Occurrences a plan decided and
    /// neither delivered nor expired are the ones its misfire policy passed over.
    ///
    /// Cost: `every` is arithmetic, exact. `cron` walks occurrence by occurrence, at most
    /// [`MAX_COUNTED`] of them; past that the rest is extrapolated at the rate of those
    /// walked (an outage of more than 10 000 occurrences of a cron schedule is counted
    /// approximately).
    pub fn occurrences_decided(&self, due_ms: i64, to_ms: i64) -> u64 {
        if to_ms < due_ms {
            return 0;
        }
        let first = u64::from(self.in_window(due_ms));
        // The window's end bounds the count; `next_after` already stops there.
        let to = match self.def.end_at {
            Some(end) => to_ms.min(end - 1),
            None => to_ms,
        };
        match &self.rule {
            // A calendar takes days out of the grid: walked below, like cron.
            Rule::Every { .. } if self.def.calendar.is_none() => {
                let Some(next) = self.next_after(due_ms).filter(|&n| n <= to) else {
                    return first;
                };
                let Recurrence::Every { interval_ms, .. } = self.def.recurrence else {
                    unreachable!("an every rule comes from an every recurrence")
                };
                first + 1 + (to - next) as u64 / interval_ms
            }
            _ => {
                let (mut count, mut at) = (0u64, due_ms);
                while let Some(next) = self.next_after(at).filter(|&n| n <= to) {
                    count += 1;
                    at = next;
                    if count == MAX_COUNTED {
                        let walked = (at - due_ms).max(1) as u128;
                        let rest = (to - at) as u128 * u128::from(count) / walked;
                        return first + count + rest as u64;
                    }
                }
                first + count
            }
        }
    }

    /// The gap between the next two occurrences after `after_ms`: the schedule's period
    /// there (a cron schedule's varies). `None` when fewer than two are left.
    pub fn period_after(&self, after_ms: i64) -> Option<i64> {
        let first = self.next_after(after_ms)?;
        Some(self.next_after(first)? - first)
    }

    fn in_window(&self, ms: i64) -> bool {
        self.def.start_at.is_none_or(|start| ms >= start)
            && self.def.end_at.is_none_or(|end| ms < end)
    }

    /// The latest `k` due occurrences (see `plan`), oldest first. Looks back from `now` over
    /// a window that doubles until it holds `k` occurrences or reaches `due`, so a long
    /// outage costs a few searches, not one per missed occurrence.
    fn latest_due(&self, due: i64, now: i64, k: usize) -> VecDeque<i64> {
        let mut width: i64 = 1_000;
        loop {
            let lo = now.saturating_sub(width).max(due);
            let mut found = VecDeque::with_capacity(k + 1);
            let mut at = lo;
            while let Some(next) = self.next_after(at).filter(|&n| n <= now) {
                found.push_back(next);
                if found.len() > k {
                    found.pop_front();
                }
                at = next;
            }
            if lo == due {
                if found.len() < k && self.in_window(due) {
                    found.push_front(due);
                }
                return found;
            }
            if found.len() >= k {
                return found;
            }
            width = width.saturating_mul(2);
        }
    }
}

fn every_next(interval: i64, anchor: i64, after: i64) -> Option<i64> {
    let steps = after
        .checked_sub(anchor)?
        .div_euclid(interval)
        .checked_add(1)?;
    anchor.checked_add(steps.checked_mul(interval)?)
}

/// The first instant strictly after `after_ms` whose local time in `tz` matches `cron`,
/// with this project's DST rule: a matching local time in a gap fires once, at the first
/// instant after the gap; a matching local time that happens twice fires once, the first
/// time.
///
/// Mapping each civil time to that instant (gap → end of gap, fold → earlier instant) never
/// decreases along civil time, so the answer is the first civil match whose instant is past
/// `after`, and no civil time at or before `after`'s local time can be it.
fn cron_next(cron: &Cron, tz: &TimeZone, after_ms: i64) -> Option<i64> {
    let after = Timestamp::from_millisecond(after_ms).ok()?;
    let local = tz.to_datetime(after);
    let mut cursor = local.with().subsec_nanosecond(0).build().ok()?;
    let mut inclusive = false;
    for _ in 0..MAX_CIVIL_STEPS {
        let civil: DateTime = cron.find_next_occurrence(&cursor, inclusive).ok()?;
        let instant = match tz.to_ambiguous_timestamp(civil).offset() {
            AmbiguousOffset::Unambiguous { offset } => offset.to_timestamp(civil).ok()?,
            AmbiguousOffset::Fold {
                before,
                after: later,
            } => {
                let first = before.to_timestamp(civil).ok()?;
                if first <= after {
                    // Its first time is past, its second never fires: go to the fold's end.
                    let end = transition(tz, first, later)?;
                    cursor = before.to_datetime(end);
                    inclusive = true;
                    continue;
                }
                first
            }
            AmbiguousOffset::Gap { after: later, .. } => {
                transition(tz, later.to_timestamp(civil).ok()?, later)?
            }
        };
        if instant > after {
            return Some(instant.as_millisecond());
        }
        cursor = civil;
        inclusive = false;
    }
    None
}

/// Bound on the runs of skipped days (or empty business days) one search crosses: a schedule
/// whose every occurrence falls on skipped days ends there instead of searching forever.
const MAX_SKIPPED_RUNS: usize = 1_000;
/// Bound on the grid times of one day looked at for a shifted occurrence (a per-second
/// pattern in a repeated hour needs 3,600).
const MAX_DAY_STEPS: usize = 100_000;

fn local_date(tz: &TimeZone, ms: i64) -> Option<Date> {
    Some(tz.to_datetime(Timestamp::from_millisecond(ms).ok()?).date())
}

/// The first instant of `date` in `tz`.
fn day_start(tz: &TimeZone, date: Date) -> Option<i64> {
    resolve(tz, date.to_datetime(jiff::civil::Time::midnight())).map(|t| t.as_millisecond())
}

/// A local time as an instant, with this project's DST rule: in a gap, the first instant
/// after it; in a fold, the earlier instant.
fn resolve(tz: &TimeZone, civil: DateTime) -> Option<Timestamp> {
    match tz.to_ambiguous_timestamp(civil).offset() {
        AmbiguousOffset::Unambiguous { offset } => offset.to_timestamp(civil).ok(),
        AmbiguousOffset::Fold { before, .. } => before.to_timestamp(civil).ok(),
        AmbiguousOffset::Gap { after, .. } => {
            transition(tz, after.to_timestamp(civil).ok()?, after)
        }
    }
}

/// The next occurrence of a cron schedule whose occurrences on skipped days move to the next
/// (or previous) business day at the same local time.
///
/// Shifting never moves a day past a business day, so the business days the occurrences land
/// on come in the order of the days they come from. So: for each business day from `after`'s
/// local date on, the earliest instant past `after` among the occurrences of the days that
/// move onto it (itself and the skipped run before it, or after it for `Previous`); the first
/// business day with one has the answer. A business day with none is jumped over to the one
/// the next grid occurrence lands on.
fn shifted_next(
    cron: &Cron,
    tz: &TimeZone,
    days: &Calendar,
    shift: Shift,
    after_ms: i64,
) -> Option<i64> {
    let after = Timestamp::from_millisecond(after_ms).ok()?;
    let local_after = tz
        .to_datetime(after)
        .with()
        .subsec_nanosecond(0)
        .build()
        .ok()?;
    let today = local_after.date();
    let mut target = days.shifted(today, Shift::Next)?;
    for _ in 0..MAX_SKIPPED_RUNS {
        let (first, last) = match shift {
            Shift::Previous => (target, days.next_business_day(target)?.yesterday().ok()?),
            _ => (days.previous_business_day(target)?.tomorrow().ok()?, target),
        };
        let mut best: Option<Timestamp> = None;
        let mut day = first;
        while day <= last {
            let from = if target == today {
                day.to_datetime(local_after.time())
            } else {
                day.to_datetime(jiff::civil::Time::midnight())
            };
            let mut cursor = from;
            let mut inclusive = true;
            for _ in 0..MAX_DAY_STEPS {
                let Ok(civil) = cron.find_next_occurrence(&cursor, inclusive) else {
                    break;
                };
                if civil.date() != day {
                    break;
                }
                if let Some(t) = resolve(tz, target.to_datetime(civil.time()))
                    && t > after
                {
                    best = Some(best.map_or(t, |b| b.min(t)));
                    break;
                }
                cursor = civil;
                inclusive = false;
            }
            day = day.tomorrow().ok()?;
        }
        if let Some(t) = best {
            return Some(t.as_millisecond());
        }
        // Nothing lands on `target`: on to where the next grid occurrence lands.
        let next = cron_next(cron, tz, day_start(tz, last.tomorrow().ok()?)? - 1)?;
        target = days.shifted(local_date(tz, next)?, shift)?;
        if target <= last {
            // `Previous` cannot land at or before a day already searched; guard anyway.
            target = days.next_business_day(last)?;
        }
    }
    None
}

/// The first transition of `tz` after `from` into `offset`.
fn transition(tz: &TimeZone, from: Timestamp, offset: Offset) -> Option<Timestamp> {
    tz.following(from)
        .take(4)
        .find(|t| t.offset() == offset)
        .map(|t| t.timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(rfc3339: &str) -> i64 {
        rfc3339.parse::<Timestamp>().unwrap().as_millisecond()
    }

    fn cron(expr: &str, tz: &str) -> Schedule {
        ScheduleDef::cron(expr, tz).compile().unwrap()
    }

    /// The `n` occurrences strictly after `from`, as local RFC 3339.
    fn after(s: &Schedule, from: &str, n: usize) -> Vec<String> {
        let mut out = vec![];
        let mut at = ms(from);
        while out.len() < n {
            let Some(next) = s.next_after(at) else { break };
            assert!(next > at, "next_after({at}) = {next} is not after it");
            out.push(s.rfc3339(next));
            at = next;
        }
        out
    }

    fn err(def: &ScheduleDef) -> ScheduleError {
        def.validate().expect_err("invalid")
    }

    // --- DST: a skipped local time fires once, at the end of the gap; a repeated one fires
    // --- once, the first time.

    #[test]
    fn paris_spring_forward_fires_at_the_end_of_the_gap() {
        let s = cron("30 2 * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-03-28T00:00:00+01:00", 3),
            [
                "2026-03-28T02:30:00+01:00",
                "2026-03-29T03:00:00+02:00",
                "2026-03-30T02:30:00+02:00"
            ]
        );
    }

    #[test]
    fn paris_fall_back_fires_once_at_the_first_occurrence() {
        let s = cron("30 2 * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-10-24T00:00:00+02:00", 3),
            [
                "2026-10-24T02:30:00+02:00",
                "2026-10-25T02:30:00+02:00",
                "2026-10-26T02:30:00+01:00"
            ]
        );
    }

    #[test]
    fn paris_several_times_in_the_gap_fire_once() {
        // croner alone drops both: no fire at all that day.
        let s = cron("0,30 2 * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-03-29T00:00:00+01:00", 3),
            [
                "2026-03-29T03:00:00+02:00",
                "2026-03-30T02:00:00+02:00",
                "2026-03-30T02:30:00+02:00"
            ]
        );
        // Every 15 minutes: 02:00-02:45 never happen, 03:00 fires once.
        let s = cron("*/15 * * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-03-29T01:40:00+01:00", 3),
            [
                "2026-03-29T01:45:00+01:00",
                "2026-03-29T03:00:00+02:00",
                "2026-03-29T03:15:00+02:00"
            ]
        );
    }

    #[test]
    fn paris_repeated_hour_fires_once_for_frequent_patterns_too() {
        let s = cron("*/15 * * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-10-25T01:50:00+02:00", 6),
            [
                "2026-10-25T02:00:00+02:00",
                "2026-10-25T02:15:00+02:00",
                "2026-10-25T02:30:00+02:00",
                "2026-10-25T02:45:00+02:00",
                "2026-10-25T03:00:00+01:00",
                "2026-10-25T03:15:00+01:00",
            ]
        );
        // From inside the second 02:xx: nothing until the hour is over.
        assert_eq!(
            after(&s, "2026-10-25T02:20:00+01:00", 1),
            ["2026-10-25T03:00:00+01:00"]
        );
        // Per second, from the last second of the first 02:59.
        let s = cron("* * * * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-10-25T02:59:58+02:00", 3),
            [
                "2026-10-25T02:59:59+02:00",
                "2026-10-25T03:00:00+01:00",
                "2026-10-25T03:00:01+01:00"
            ]
        );
    }

    #[test]
    fn paris_next_after_the_gap_instant_is_the_next_day() {
        let s = cron("30 2 * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-03-29T03:00:00+02:00", 1),
            ["2026-03-30T02:30:00+02:00"]
        );
        assert_eq!(
            after(&s, "2026-03-29T02:59:59.999+02:00", 1),
            ["2026-03-29T03:00:00+02:00"]
        );
    }

    #[test]
    fn new_york_spring_forward_and_fall_back() {
        let s = cron("30 2 * * *", "America/New_York");
        assert_eq!(
            after(&s, "2026-03-07T00:00:00-05:00", 3),
            [
                "2026-03-07T02:30:00-05:00",
                "2026-03-08T03:00:00-04:00",
                "2026-03-09T02:30:00-04:00"
            ]
        );
        let s = cron("30 1 * * *", "America/New_York");
        assert_eq!(
            after(&s, "2026-10-31T00:00:00-04:00", 3),
            [
                "2026-10-31T01:30:00-04:00",
                "2026-11-01T01:30:00-04:00",
                "2026-11-02T01:30:00-05:00"
            ]
        );
    }

    #[test]
    fn new_york_hourly_fires_once_in_the_repeated_hour() {
        // croner alone fires at 01:00 -04 and again at 01:00 -05.
        let s = cron("0 * * * *", "America/New_York");
        assert_eq!(
            after(&s, "2026-11-01T00:30:00-04:00", 3),
            [
                "2026-11-01T01:00:00-04:00",
                "2026-11-01T02:00:00-05:00",
                "2026-11-01T03:00:00-05:00"
            ]
        );
    }

    #[test]
    fn lord_howe_half_hour_shift() {
        // Spring forward 2026-10-04: 02:00 +10:30 -> 02:30 +11.
        let s = cron("15 2 * * *", "Australia/Lord_Howe");
        assert_eq!(
            after(&s, "2026-10-03T00:00:00+10:30", 3),
            [
                "2026-10-03T02:15:00+10:30",
                "2026-10-04T02:30:00+11:00",
                "2026-10-05T02:15:00+11:00"
            ]
        );
        // Fall back 2026-04-05: 02:00 +11 -> 01:30 +10:30, 01:30-01:59 twice.
        let s = cron("45 1 * * *", "Australia/Lord_Howe");
        assert_eq!(
            after(&s, "2026-04-04T00:00:00+11:00", 3),
            [
                "2026-04-04T01:45:00+11:00",
                "2026-04-05T01:45:00+11:00",
                "2026-04-06T01:45:00+10:30"
            ]
        );
        // Every 10 minutes across the fall-back: the repeated half hour fires once.
        let s = cron("*/10 * * * *", "Australia/Lord_Howe");
        assert_eq!(
            after(&s, "2026-04-05T01:45:00+11:00", 3),
            [
                "2026-04-05T01:50:00+11:00",
                "2026-04-05T02:00:00+10:30",
                "2026-04-05T02:10:00+10:30"
            ]
        );
    }

    #[test]
    fn sao_paulo_2018_11_04_had_no_midnight() {
        let s = cron("0 0 * * *", "America/Sao_Paulo");
        assert_eq!(
            after(&s, "2018-11-02T12:00:00-03:00", 3),
            [
                "2018-11-03T00:00:00-03:00",
                "2018-11-04T01:00:00-02:00",
                "2018-11-05T00:00:00-02:00"
            ]
        );
        // And its fall-back, 2018-02-18 00:00 -02 -> 2018-02-17 23:00 -03.
        let s = cron("30 23 * * *", "America/Sao_Paulo");
        assert_eq!(
            after(&s, "2018-02-16T12:00:00-02:00", 3),
            [
                "2018-02-16T23:30:00-02:00",
                "2018-02-17T23:30:00-02:00",
                "2018-02-18T23:30:00-03:00"
            ]
        );
    }

    // --- Calendar edge cases.

    #[test]
    fn february_29_only_in_leap_years() {
        let s = cron("0 0 29 2 *", "UTC");
        assert_eq!(
            after(&s, "2025-01-01T00:00:00Z", 2),
            ["2028-02-29T00:00:00+00:00", "2032-02-29T00:00:00+00:00"]
        );
        // 2100 is not a leap year.
        assert_eq!(
            after(&s, "2096-03-01T00:00:00Z", 1),
            ["2104-02-29T00:00:00+00:00"]
        );
    }

    #[test]
    fn the_31st_skips_short_months() {
        let s = cron("0 12 31 * *", "UTC");
        assert_eq!(
            after(&s, "2026-01-31T12:00:00Z", 4),
            [
                "2026-03-31T12:00:00+00:00",
                "2026-05-31T12:00:00+00:00",
                "2026-07-31T12:00:00+00:00",
                "2026-08-31T12:00:00+00:00",
            ]
        );
    }

    #[test]
    fn weekday_0_and_7_are_both_sunday() {
        // 2026-11-23 is a Monday.
        let want = ["2026-11-29T09:00:00+00:00", "2026-12-06T09:00:00+00:00"];
        for expr in ["0 9 * * 0", "0 9 * * 7", "0 9 * * SUN", "0 9 * * sun"] {
            assert_eq!(
                after(&cron(expr, "UTC"), "2026-11-23T00:00:00Z", 2),
                want,
                "{expr}"
            );
        }
        assert_eq!(
            after(&cron("0 9 * * 1-5", "UTC"), "2026-11-27T12:00:00Z", 2),
            ["2026-11-30T09:00:00+00:00", "2026-12-01T09:00:00+00:00"]
        );
    }

    #[test]
    fn day_of_month_or_day_of_week() {
        // Vixie cron: both restricted → either matches.
        let s = cron("0 0 13 * 1", "UTC");
        assert_eq!(
            after(&s, "2026-11-01T00:00:00Z", 4),
            [
                "2026-11-02T00:00:00+00:00",
                "2026-11-09T00:00:00+00:00",
                "2026-11-13T00:00:00+00:00",
                "2026-11-16T00:00:00+00:00",
            ]
        );
    }

    #[test]
    fn five_and_six_fields() {
        let five = cron("30 2 * * *", "Europe/Paris");
        let six = cron("0 30 2 * * *", "Europe/Paris");
        let from = "2026-03-27T00:00:00+01:00";
        assert_eq!(after(&five, from, 4), after(&six, from, 4));
        let s = cron("*/15 * * * * *", "UTC");
        assert_eq!(
            after(&s, "2026-01-01T00:00:00Z", 3),
            [
                "2026-01-01T00:00:15+00:00",
                "2026-01-01T00:00:30+00:00",
                "2026-01-01T00:00:45+00:00"
            ]
        );
        // Seconds in the gap too.
        let s = cron("15 30 2 * * *", "Europe/Paris");
        assert_eq!(
            after(&s, "2026-03-28T12:00:00+01:00", 2),
            ["2026-03-29T03:00:00+02:00", "2026-03-30T02:30:15+02:00"]
        );
        // Nicknames.
        assert_eq!(
            after(&cron("@daily", "UTC"), "2026-01-01T00:00:00Z", 1),
            ["2026-01-02T00:00:00+00:00"]
        );
    }

    #[test]
    fn previous_before_finds_the_latest_earlier_occurrence() {
        let daily = cron("30 9 * * *", "Europe/Paris");
        let at = ms("2026-03-10T12:00:00Z");
        assert_eq!(
            daily.previous_before(at),
            Some(ms("2026-03-10T08:30:00Z")),
            "09:30 Paris is 08:30 UTC in winter"
        );
        assert_eq!(
            daily.previous_before(ms("2026-03-10T08:30:00Z")),
            Some(ms("2026-03-09T08:30:00Z"))
        );
        let every = ScheduleDef::every(1000, 500).compile().unwrap();
        assert_eq!(every.previous_before(10_500), Some(9_500));
        let mut bounded = ScheduleDef::every(1000, 0);
        bounded.start_at = Some(5_000);
        assert_eq!(bounded.compile().unwrap().previous_before(5_000), None);
    }

    #[test]
    fn next_after_is_strict_to_the_millisecond() {
        let s = cron("* * * * * *", "UTC");
        assert_eq!(
            s.next_after(ms("2026-01-01T12:00:00Z")),
            Some(ms("2026-01-01T12:00:01Z"))
        );
        assert_eq!(
            s.next_after(ms("2026-01-01T12:00:00.999Z")),
            Some(ms("2026-01-01T12:00:01Z"))
        );
        assert_eq!(
            s.next_after(ms("2026-01-01T11:59:59.999Z")),
            Some(ms("2026-01-01T12:00:00Z"))
        );
    }

    #[test]
    fn start_is_inclusive_and_end_exclusive() {
        let mut def = ScheduleDef::cron("0 * * * *", "UTC");
        def.start_at = Some(ms("2026-01-01T10:00:00Z"));
        def.end_at = Some(ms("2026-01-01T13:00:00Z"));
        let s = def.compile().unwrap();
        assert_eq!(
            after(&s, "2020-01-01T00:00:00Z", 5),
            [
                "2026-01-01T10:00:00+00:00",
                "2026-01-01T11:00:00+00:00",
                "2026-01-01T12:00:00+00:00"
            ]
        );
        assert_eq!(s.next_after(ms("2026-01-01T12:00:00Z")), None);
        // occurrences() counts from `from` inclusive.
        assert_eq!(
            s.occurrences(ms("2026-01-01T11:00:00Z"), 5),
            [ms("2026-01-01T11:00:00Z"), ms("2026-01-01T12:00:00Z")]
        );
    }

    #[test]
    fn occurrences_previews_n() {
        let s = cron("0 9 * * 1-5", "Europe/Paris");
        let got: Vec<String> = s
            .occurrences(ms("2026-11-27T09:00:00+01:00"), 3)
            .into_iter()
            .map(|at| s.rfc3339(at))
            .collect();
        assert_eq!(
            got,
            [
                "2026-11-27T09:00:00+01:00",
                "2026-11-30T09:00:00+01:00",
                "2026-12-01T09:00:00+01:00"
            ]
        );
        assert_eq!(s.occurrences(0, 0), Vec::<i64>::new());
    }

    // --- every: anchored, no drift.

    #[test]
    fn every_is_on_the_anchor_grid() {
        let anchor = 1_000_007;
        let s = ScheduleDef::every(250, anchor).compile().unwrap();
        assert_eq!(s.next_after(anchor), Some(anchor + 250));
        assert_eq!(s.next_after(anchor - 1), Some(anchor));
        assert_eq!(s.next_after(anchor + 249), Some(anchor + 250));
        assert_eq!(s.next_after(anchor + 250), Some(anchor + 500));
        // Before the anchor: the grid extends backwards (no start_at).
        assert_eq!(s.next_after(anchor - 300), Some(anchor - 250));
        // start_at at the anchor: nothing before it.
        let mut def = ScheduleDef::every(250, anchor);
        def.start_at = Some(anchor);
        assert_eq!(def.compile().unwrap().next_after(0), Some(anchor));
    }

    #[test]
    fn every_does_not_drift_over_a_day_of_late_deliveries() {
        let anchor = ms("2026-11-23T00:00:00.123Z");
        let interval = 250;
        let s = ScheduleDef::every(interval, anchor).compile().unwrap();
        let mut due = s.next_after(anchor).unwrap();
        let mut seed: u64 = 42;
        let mut delivered = 0u64;
        let day_end = anchor + 86_400_000;
        while due <= day_end {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let now = due + 1 + (seed >> 33) as i64 % 9; // 1-9 ms late
            let plan = s.plan(due, now);
            assert_eq!(plan.deliver, [due]);
            assert!(!plan.misfired);
            assert_eq!(
                (plan.next.unwrap() - anchor) % interval as i64,
                0,
                "off the grid"
            );
            delivered += 1;
            due = plan.next.unwrap();
        }
        assert_eq!(delivered, 86_400_000 / interval);
        assert_eq!(due, day_end + interval as i64);
    }

    #[test]
    fn cron_does_not_drift_either() {
        let s = cron("*/5 * * * * *", "UTC");
        let start = ms("2026-11-23T00:00:00Z");
        let mut due = s.next_after(start).unwrap();
        for _ in 0..17_280 {
            let plan = s.plan(due, due + 7);
            assert_eq!(plan.deliver, [due]);
            due = plan.next.unwrap();
        }
        assert_eq!(due, ms("2026-11-24T00:00:05Z"));
    }

    // --- Misfire policies.

    fn every_second(misfire: Misfire, max_lateness_ms: Option<u64>) -> (Schedule, i64) {
        let t0 = ms("2026-11-23T10:00:00Z");
        let mut def = ScheduleDef::every(1_000, t0);
        def.misfire = misfire;
        def.max_lateness_ms = max_lateness_ms;
        (def.compile().unwrap(), t0)
    }

    /// A small deterministic generator (xorshift): the same inputs every run.
    struct Gen(u64);
    impl Gen {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// The reference: `due` when in the window, then every occurrence after it up to `to`,
    /// one `next_after` at a time.
    fn decided_by_walking(s: &Schedule, due: i64, to: i64) -> u64 {
        if to < due {
            return 0;
        }
        let mut n = u64::from(s.in_window(due));
        let mut at = due;
        while let Some(next) = s.next_after(at).filter(|&n| n <= to) {
            n += 1;
            at = next;
        }
        n
    }

    #[test]
    fn occurrences_decided_equals_a_walk_of_the_grid() {
        let t0 = ms("2026-11-23T10:00:00Z");
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        for case in 0..400 {
            let mut def = if case % 2 == 0 {
                ScheduleDef::every(1 + g.below(5_000), t0 + g.below(3_000) as i64)
            } else {
                let exprs = [
                    "*/7 * * * * *",
                    "0 */2 * * * *",
                    "15,45 * * * * *",
                    "0 0 3 * * *",
                ];
                ScheduleDef::cron(exprs[g.below(4) as usize], "Europe/Paris")
            };
            if g.below(3) == 0 {
                def.start_at = Some(t0 + g.below(20_000) as i64);
            }
            if g.below(3) == 0 {
                def.end_at = Some(t0 + 30_000 + g.below(100_000) as i64);
            }
            // A window the pattern never fires in is refused at validation.
            let Ok(s) = def.compile() else {
                continue;
            };
            // On the grid or off it (an update moved the grid), before, in and after the window.
            let due = match s.next_after(t0 + g.below(10_000) as i64) {
                Some(on) if g.below(2) == 0 => on,
                _ => t0 + g.below(40_000) as i64,
            };
            let to = due - 1_000 + g.below(200_000) as i64;
            assert_eq!(
                s.occurrences_decided(due, to),
                decided_by_walking(&s, due, to),
                "{def:?} due {due} to {to}"
            );
        }
    }

    #[test]
    fn a_long_outage_of_a_cron_schedule_is_counted_at_its_rate() {
        let s = cron("* * * * * *", "UTC");
        let due = ms("2026-11-23T10:00:00Z");
        // A day of per-second occurrences: 86 401 with both ends, walked 10 000 then extrapolated.
        let to = due + 86_400_000;
        assert_eq!(s.occurrences_decided(due, to), 86_401);
    }

    #[test]
    fn what_a_plan_passes_over_is_what_each_policy_misses() {
        let mut g = Gen(42);
        for _ in 0..300 {
            let n = 1 + g.below(400) as i64; // occurrences due at once
            let max = 1 + g.below(150) as u32;
            let into = g.below(1_000) as i64; // how far into the period after the last one
            for misfire in [Misfire::Coalesce, Misfire::Skip, Misfire::CatchUp { max }] {
                let (s, t0) = every_second(misfire, None);
                let now = t0 + (n - 1) * 1_000 + into;
                let plan = s.plan(t0, now);
                let written = (plan.deliver.len() + plan.expired.len()) as u64;
                let missed = s.occurrences_decided(t0, now) - written;
                let n = n as u64;
                let expected = match misfire {
                    _ if n == 1 => 0,
                    Misfire::Coalesce => n - 1,
                    Misfire::Skip => n,
                    Misfire::CatchUp { max } => n.saturating_sub(u64::from(max)),
                };
                assert_eq!(missed, expected, "{misfire:?}: {n} due");
            }
        }
    }

    #[test]
    fn period_after_is_the_gap_to_the_next_occurrence() {
        let (s, t0) = every_second(Misfire::Coalesce, None);
        assert_eq!(s.period_after(t0 + 10), Some(1_000));
        let weekdays = cron("0 9 * * 1-5", "UTC");
        // Friday 2026-11-27 at noon: the next two are Monday and Tuesday, a day apart.
        assert_eq!(
            weekdays.period_after(ms("2026-11-27T12:00:00Z")),
            Some(86_400_000)
        );
        // Thursday noon: Friday then Monday, three days apart.
        assert_eq!(
            weekdays.period_after(ms("2026-11-26T12:00:00Z")),
            Some(3 * 86_400_000)
        );
        let mut ending = ScheduleDef::every(1_000, t0);
        ending.end_at = Some(t0 + 1_000);
        assert_eq!(ending.compile().unwrap().period_after(t0 - 1), None);
    }

    #[test]
    fn one_due_occurrence_is_delivered_whatever_the_policy() {
        for misfire in [
            Misfire::Coalesce,
            Misfire::Skip,
            Misfire::CatchUp { max: 100 },
        ] {
            let (s, t0) = every_second(misfire, None);
            let plan = s.plan(t0, t0 + 900);
            assert_eq!(
                plan,
                Plan {
                    deliver: vec![t0],
                    expired: vec![],
                    misfired: false,
                    next: Some(t0 + 1_000),
                },
                "{misfire:?}"
            );
        }
    }

    #[test]
    fn coalesce_delivers_the_latest_once() {
        let (s, t0) = every_second(Misfire::Coalesce, None);
        let plan = s.plan(t0, t0 + 5_200);
        assert_eq!(plan.deliver, [t0 + 5_000]);
        assert!(plan.misfired && plan.expired.is_empty());
        assert_eq!(plan.next, Some(t0 + 6_000));
    }

    #[test]
    fn skip_delivers_nothing_and_keeps_the_grid() {
        let (s, t0) = every_second(Misfire::Skip, None);
        let plan = s.plan(t0, t0 + 5_200);
        assert!(plan.deliver.is_empty() && plan.expired.is_empty() && plan.misfired);
        assert_eq!(plan.next, Some(t0 + 6_000));
    }

    #[test]
    fn catch_up_delivers_each_missed_up_to_max() {
        let (s, t0) = every_second(Misfire::CatchUp { max: 100 }, None);
        let plan = s.plan(t0, t0 + 5_200);
        assert_eq!(
            plan.deliver,
            (0..=5).map(|i| t0 + i * 1_000).collect::<Vec<_>>()
        );
        assert_eq!(plan.next, Some(t0 + 6_000));
        // The latest `max`, after an outage of a day.
        let (s, t0) = every_second(Misfire::CatchUp { max: 3 }, None);
        let now = t0 + 86_400_000 + 500;
        let plan = s.plan(t0, now);
        assert_eq!(plan.deliver, [now - 2_500, now - 1_500, now - 500]);
        assert_eq!(plan.next, Some(now + 500));
        // The default max is 100.
        let def: ScheduleDef = serde_json::from_str(
            r#"{"recurrence":{"every":{"interval_ms":1000,"anchor_ms":0}},"misfire":{"catch_up":{}}}"#,
        )
        .unwrap();
        let plan = def.compile().unwrap().plan(0, 3_600_000);
        assert_eq!(plan.deliver.len(), 100);
        assert_eq!(plan.deliver.first(), Some(&3_501_000));
    }

    #[test]
    fn max_lateness_expires_stale_occurrences() {
        let (s, t0) = every_second(Misfire::CatchUp { max: 100 }, Some(2_500));
        let plan = s.plan(t0, t0 + 5_200);
        assert_eq!(plan.expired, [t0, t0 + 1_000, t0 + 2_000]);
        assert_eq!(plan.deliver, [t0 + 3_000, t0 + 4_000, t0 + 5_000]);
        // One due occurrence, too late: expired.
        let (s, t0) = every_second(Misfire::Coalesce, Some(100));
        let plan = s.plan(t0, t0 + 101);
        assert_eq!((plan.deliver, plan.expired), (vec![], vec![t0]));
        assert_eq!(s.plan(t0, t0 + 100).deliver, [t0]);
    }

    #[test]
    fn misfire_on_a_cron_schedule_across_days() {
        let mut def = ScheduleDef::cron("0 9 * * *", "Europe/Paris");
        let due = ms("2026-11-20T09:00:00+01:00");
        let now = ms("2026-11-23T10:00:00+01:00");
        let s = def.clone().compile().unwrap();
        let plan = s.plan(due, now);
        assert_eq!(plan.deliver, [ms("2026-11-23T09:00:00+01:00")]);
        assert_eq!(plan.next, Some(ms("2026-11-24T09:00:00+01:00")));
        def.misfire = Misfire::CatchUp { max: 10 };
        let plan = def.compile().unwrap().plan(due, now);
        assert_eq!(plan.deliver.len(), 4);
        assert_eq!(plan.deliver[0], due);
        // Per second, an hour down, catch up 100: the last 100 seconds.
        let mut def = ScheduleDef::cron("* * * * * *", "UTC");
        def.misfire = Misfire::CatchUp { max: 100 };
        let t0 = ms("2026-11-23T10:00:00Z");
        let plan = def.compile().unwrap().plan(t0, t0 + 3_600_000);
        assert_eq!(plan.deliver.len(), 100);
        assert_eq!(plan.deliver[0], t0 + 3_501_000);
        assert_eq!(plan.deliver[99], t0 + 3_600_000);
    }

    #[test]
    fn plan_honours_the_window_and_an_early_call() {
        let (s, t0) = every_second(Misfire::Coalesce, None);
        let plan = s.plan(t0, t0 - 5);
        assert_eq!((plan.deliver.len(), plan.next), (0, Some(t0)));
        let mut def = ScheduleDef::every(1_000, 0);
        def.end_at = Some(10_000);
        let s = def.compile().unwrap();
        let plan = s.plan(9_000, 9_010);
        assert_eq!((plan.deliver, plan.next), (vec![9_000], None));
        // The end passed while down: the last one before it, then nothing.
        let plan = s.plan(5_000, 60_000);
        assert_eq!((plan.deliver, plan.next), (vec![9_000], None));
        // A due time outside the (updated) window is not delivered.
        assert_eq!(s.plan(10_000, 10_001).deliver, Vec::<i64>::new());
    }

    #[test]
    fn a_due_time_off_the_new_grid_is_delivered_then_the_new_grid_applies() {
        let s = ScheduleDef::every(1_000, 0).compile().unwrap();
        let plan = s.plan(1_500, 1_510);
        assert_eq!((plan.deliver, plan.next), (vec![1_500], Some(2_000)));
    }

    #[test]
    fn a_plan_truncated_keeps_its_oldest_occurrences_and_says_where_to_go_on() {
        let (s, t0) = every_second(Misfire::CatchUp { max: 100 }, Some(2_500));
        let full = s.plan(t0, t0 + 5_200);
        assert_eq!(full.expired, [t0, t0 + 1_000, t0 + 2_000]);
        let mut plan = full.clone();
        assert_eq!(plan.truncate(6), None, "all fit");
        assert_eq!(plan, full);
        let mut plan = full.clone();
        assert_eq!(plan.truncate(4), Some(t0 + 4_000));
        assert_eq!(plan.expired, [t0, t0 + 1_000, t0 + 2_000]);
        assert_eq!(plan.deliver, [t0 + 3_000]);
        assert_eq!(plan.last_written(), Some(t0 + 3_000));
        let mut plan = full.clone();
        assert_eq!(plan.truncate(2), Some(t0 + 2_000), "expired ones first");
        assert_eq!((plan.expired.len(), plan.deliver.len()), (2, 0));
        assert_eq!(plan.last_written(), Some(t0 + 1_000));
        let mut plan = full.clone();
        assert_eq!(plan.truncate(3), Some(t0 + 3_000));
        assert_eq!(plan.deliver, Vec::<i64>::new());
        // Planning again from where a truncated plan stopped gives the rest: the whole
        // plan, over several bounded writes, each occurrence once.
        let (s, t0) = every_second(Misfire::CatchUp { max: 10_000 }, None);
        let now = t0 + 20_000_000;
        let whole = s.plan(t0, now);
        assert_eq!(whole.deliver.len(), 10_000);
        let (mut written, mut due) = (Vec::<i64>::new(), t0);
        loop {
            let mut plan = s.plan(due, now);
            let left = plan.truncate(1_000);
            assert!(plan.deliver.len() <= 1_000);
            written.extend(&plan.deliver);
            match left {
                Some(at) => due = at,
                None => {
                    assert_eq!(plan.next, whole.next);
                    break;
                }
            }
        }
        assert_eq!(written, whole.deliver);
    }

    #[test]
    fn same_occurrences_compares_recurrence_and_window_only() {
        let base = ScheduleDef::cron("0 9 * * *", "Europe/Paris");
        let mut other = base.clone();
        other.misfire = Misfire::Skip;
        other.max_lateness_ms = Some(1_000);
        assert!(base.same_occurrences(&other));
        for change in [
            |d: &mut ScheduleDef| d.start_at = Some(1),
            |d: &mut ScheduleDef| d.end_at = Some(i64::MAX / 2),
            |d: &mut ScheduleDef| d.recurrence = ScheduleDef::cron("0 9 * * *", "UTC").recurrence,
            |d: &mut ScheduleDef| d.recurrence = ScheduleDef::every(1_000, 0).recurrence,
        ] {
            let mut other = base.clone();
            change(&mut other);
            assert!(!base.same_occurrences(&other), "{other:?}");
        }
    }

    // --- Validation names the field.

    #[test]
    fn validation_names_the_field_and_the_reason() {
        let cases: Vec<(ScheduleDef, &str, &str)> = vec![
            (
                ScheduleDef::cron("* * * *", "UTC"),
                "cron",
                "expected 5 fields",
            ),
            (
                ScheduleDef::cron("0 0 0 1 1 * 2030", "UTC"),
                "cron",
                "got 7",
            ),
            (ScheduleDef::cron("61 * * * *", "UTC"), "cron", "61"),
            (
                ScheduleDef::cron("0 0 * * 8", "UTC"),
                "cron",
                "\"0 0 * * 8\"",
            ),
            (
                ScheduleDef::cron("0 0 32 * *", "UTC"),
                "cron",
                "\"0 0 32 * *\"",
            ),
            (
                ScheduleDef::cron("0 0 30 2 *", "UTC"),
                "cron",
                "never fires",
            ),
            (ScheduleDef::cron("", "UTC"), "cron", "got 0"),
            (
                ScheduleDef::cron("0 9 * * *", "Europe/Pariss"),
                "tz",
                "Europe/Pariss",
            ),
            (
                ScheduleDef::cron("0 9 * * *", ""),
                "tz",
                "unknown time zone",
            ),
            (ScheduleDef::every(0, 0), "every", "at least 1 ms"),
            (ScheduleDef::every(u64::MAX, 0), "every", "at least 1 ms"),
            (
                ScheduleDef::every(1_000, i64::MAX),
                "anchor",
                "out of range",
            ),
        ];
        for (def, field, why) in cases {
            let e = err(&def);
            assert_eq!(e.field, field, "{def:?}: {e}");
            assert!(e.why.contains(why), "{def:?}: {e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("invalid schedule: {field}: "))
            );
        }
        let ok = ScheduleDef::cron("0 9 * * *", "Europe/Paris");
        let with = |f: fn(&mut ScheduleDef)| {
            let mut d = ok.clone();
            f(&mut d);
            err(&d)
        };
        let e = with(|d| {
            d.start_at = Some(2_000);
            d.end_at = Some(1_000);
        });
        assert_eq!(
            (e.field, e.why.as_str()),
            ("end_at", "must be after start_at")
        );
        let e = with(|d| {
            d.start_at = Some(ms("2026-11-23T10:00:00Z"));
            d.end_at = Some(ms("2026-11-23T11:00:00Z"));
        });
        assert_eq!(
            (e.field, e.why.as_str()),
            ("end_at", "no occurrence between start_at and end_at")
        );
        let e = with(|d| d.start_at = Some(i64::MIN));
        assert_eq!(e.field, "start_at");
        let e = with(|d| d.misfire = Misfire::CatchUp { max: 0 });
        assert_eq!(e.field, "max_catch_up");
        let e = with(|d| {
            d.misfire = Misfire::CatchUp {
                max: MAX_CATCH_UP_LIMIT + 1,
            }
        });
        assert_eq!(e.field, "max_catch_up");
        let e = with(|d| d.max_lateness_ms = Some(0));
        assert_eq!(e.field, "max_lateness");
        ok.validate().unwrap();
    }

    // --- Stored as JSON.

    #[test]
    fn json_round_trip_and_shape() {
        let mut def = ScheduleDef::cron("0 9 * * 1-5", "Europe/Paris");
        def.misfire = Misfire::CatchUp { max: 5 };
        def.start_at = Some(1_700_000_000_000);
        def.max_lateness_ms = Some(30_000);
        let json = serde_json::to_string(&def).unwrap();
        assert_eq!(
            json,
            r#"{"recurrence":{"cron":{"expr":"0 9 * * 1-5","tz":"Europe/Paris"}},"misfire":{"catch_up":{"max":5}},"start_at":1700000000000,"max_lateness_ms":30000}"#
        );
        let s: Schedule = serde_json::from_str(&json).unwrap();
        assert_eq!(s.def(), &def);
        assert_eq!(serde_json::to_string(&s).unwrap(), json);
        // Defaults: tz UTC, misfire coalesce.
        let s: Schedule =
            serde_json::from_str(r#"{"recurrence":{"cron":{"expr":"0 9 * * *"}}}"#).unwrap();
        assert_eq!(s.def(), &ScheduleDef::cron("0 9 * * *", "UTC"));
        assert_eq!(s.def().misfire, Misfire::Coalesce);
        let every: Schedule = serde_json::from_str(
            r#"{"recurrence":{"every":{"interval_ms":250,"anchor_ms":7}},"misfire":"skip"}"#,
        )
        .unwrap();
        assert_eq!(every.next_after(7), Some(257));
        // An invalid stored schedule does not deserialize, and says why.
        let e = serde_json::from_str::<Schedule>(r#"{"recurrence":{"cron":{"expr":"0 9 * *"}}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("invalid schedule: cron: "), "{e}");
    }

    // --- Calendars: skip or shift, against a reference model.

    fn with_calendar(mut def: ScheduleDef, days: Calendar, shift: Shift) -> Schedule {
        def.calendar = Some(ScheduleCalendar {
            name: "test".into(),
            shift,
            days,
        });
        def.compile().unwrap()
    }

    /// The model: every civil time the cron pattern matches (croner over civil time, no
    /// zone), its date shifted (or dropped) by the calendar, resolved to an instant with the
    /// DST rule, deduplicated and sorted. Walks from 40 days before `from` so occurrences
    /// moved in from earlier days are seen.
    fn model(
        expr: &str,
        tz: &TimeZone,
        days: &Calendar,
        shift: Shift,
        from: i64,
        until: i64,
    ) -> Vec<i64> {
        let cron = parse_cron(expr).unwrap();
        let ts = |ms: i64| tz.to_datetime(Timestamp::from_millisecond(ms).unwrap());
        let (start, end) = (ts(from - 40 * 86_400_000), ts(until + 40 * 86_400_000));
        let mut out = std::collections::BTreeSet::new();
        let mut cursor = start;
        while let Ok(civil) = cron.find_next_occurrence(&cursor, false) {
            if civil > end {
                break;
            }
            cursor = civil;
            let Some(day) = days.shifted(civil.date(), shift) else {
                continue;
            };
            let at = resolve(tz, day.to_datetime(civil.time()))
                .unwrap()
                .as_millisecond();
            if at > from && at <= until {
                out.insert(at);
            }
        }
        out.into_iter().collect()
    }

    fn walk(s: &Schedule, from: i64, until: i64) -> Vec<i64> {
        let mut out = vec![];
        let mut at = from;
        while let Some(t) = s.next_after(at) {
            if t > until {
                break;
            }
            assert!(t > at);
            out.push(t);
            at = t;
        }
        out
    }

    #[test]
    fn calendar_skips_and_shifts_agree_with_a_model_on_generated_calendars() {
        use crate::calendar::WeekdayName;
        let mut seed: u64 = 3;
        let mut rand = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let exprs = [
            "0 9 * * *",
            "30 2 * * *",
            "0 0 * * *",
            "0 9,17 * * 1-5",
            "0 18 L * *",
            "15 10 1,15 * *",
            "0 */6 * * *",
            "0 12 * * 6",
        ];
        let zones = [
            "UTC",
            "Europe/Paris",
            "America/New_York",
            "America/Sao_Paulo",
            "Asia/Tokyo",
        ];
        let from = ms("2026-01-01T00:00:00Z");
        let until = ms("2027-01-01T00:00:00Z");
        let base = jiff::civil::date(2025, 12, 1);
        for round in 0..60 {
            let expr = exprs[rand(exprs.len() as u64) as usize];
            let zone = zones[rand(zones.len() as u64) as usize];
            let weekend: Vec<_> = match rand(3) {
                0 => vec![],
                1 => vec![WeekdayName::Sat, WeekdayName::Sun],
                _ => vec![WeekdayName::Fri, WeekdayName::Sat],
            };
            let dates: Vec<Date> = (0..rand(80))
                .map(|_| {
                    base.checked_add(jiff::Span::new().days(rand(420) as i64))
                        .unwrap()
                })
                .collect();
            let days = Calendar::new(weekend, dates).unwrap();
            let shift = [Shift::Skip, Shift::Next, Shift::Previous][rand(3) as usize];
            let tz = TimeZone::get(zone).unwrap();
            let def = ScheduleDef {
                calendar: Some(ScheduleCalendar {
                    name: "t".into(),
                    shift,
                    days: days.clone(),
                }),
                ..ScheduleDef::cron(expr, zone)
            };
            let s = match def.compile() {
                Ok(s) => s,
                Err(e) => {
                    // Only a pattern whose every day is skipped may be refused.
                    assert_eq!(e.field, "calendar", "{expr} {zone}: {e}");
                    continue;
                }
            };
            let want = model(expr, &tz, &days, shift, from, until);
            assert_eq!(
                walk(&s, from, until),
                want,
                "round {round}: {expr} {zone} {shift:?}"
            );
            // What a preview says of each grid occurrence is where it really goes.
            for (t, skip) in s.preview(from + 1, 400) {
                let went = match &skip {
                    None => Some(t),
                    Some(skip) => skip.moved_to,
                };
                assert_eq!(went.is_none(), shift == Shift::Skip && skip.is_some());
                if let Some(at) = went.filter(|&at| at > from && at <= until) {
                    assert!(
                        want.binary_search(&at).is_ok(),
                        "round {round}: {expr} {zone} {shift:?}: preview {t} -> {at}"
                    );
                }
            }
            // From random points too (mid-day, mid-run of skipped days).
            for _ in 0..5 {
                let at = from + rand(300 * 86_400) as i64 * 1_000;
                let expected = want.iter().copied().find(|&t| t > at);
                if expected.is_some() {
                    assert_eq!(
                        s.next_after(at),
                        expected,
                        "round {round}: {expr} {zone} {shift:?} after {at}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_schedules_skip_whole_days_in_utc() {
        let days = Calendar::new([], [jiff::civil::date(2026, 12, 25)]).unwrap();
        let s = with_calendar(ScheduleDef::every(3_600_000, 0), days, Shift::Skip);
        assert_eq!(
            s.next_after(ms("2026-12-24T23:00:00Z")),
            Some(ms("2026-12-26T00:00:00Z"))
        );
        let mut def = ScheduleDef::every(1_000, 0);
        def.calendar = Some(ScheduleCalendar {
            name: "x".into(),
            shift: Shift::Next,
            days: Calendar::new([], []).unwrap(),
        });
        assert_eq!(def.validate().unwrap_err().field, "shift");
    }

    #[test]
    fn last_business_day_of_the_month_is_the_last_day_shifted_back() {
        use crate::calendar::WeekdayName;
        // 2026-05-31 is a Sunday; 2026-05-29 (Friday) listed as a holiday.
        let days = Calendar::new(
            [WeekdayName::Sat, WeekdayName::Sun],
            [jiff::civil::date(2026, 5, 29)],
        )
        .unwrap();
        let s = with_calendar(
            ScheduleDef::cron("0 18 L * *", "Europe/Paris"),
            days,
            Shift::Previous,
        );
        assert_eq!(
            after(&s, "2026-04-01T00:00:00Z", 3),
            [
                "2026-04-30T18:00:00+02:00",
                "2026-05-28T18:00:00+02:00",
                "2026-06-30T18:00:00+02:00"
            ]
        );
    }

    #[test]
    fn a_shift_keeps_the_local_time_across_dst_and_merges_collisions() {
        use crate::calendar::WeekdayName;
        // Paris springs forward on Sunday 2026-03-29: Sunday's 02:30 moves to Monday 02:30
        // (+02), Saturday's to Monday too, where it is one occurrence with Monday's own.
        let days = Calendar::new([WeekdayName::Sat, WeekdayName::Sun], []).unwrap();
        let s = with_calendar(
            ScheduleDef::cron("30 2 * * *", "Europe/Paris"),
            days.clone(),
            Shift::Next,
        );
        assert_eq!(
            after(&s, "2026-03-26T12:00:00Z", 3),
            [
                "2026-03-27T02:30:00+01:00",
                "2026-03-30T02:30:00+02:00",
                "2026-03-31T02:30:00+02:00"
            ]
        );
        let sunday = ms("2026-03-29T03:00:00+02:00");
        let moved = s
            .calendar_skip(sunday)
            .unwrap()
            .moved_to
            .map(|t| s.rfc3339(t));
        assert_eq!(moved.as_deref(), Some("2026-03-30T02:30:00+02:00"));
        // Skip: the weekend's occurrences are gone, and the plan counts them.
        let s = with_calendar(
            ScheduleDef::cron("30 2 * * *", "Europe/Paris"),
            days,
            Shift::Skip,
        );
        let fri = ms("2026-03-27T02:30:00+01:00");
        let plan = s.plan(fri, fri + 10);
        assert_eq!(plan.next, Some(ms("2026-03-30T02:30:00+02:00")));
        assert_eq!(
            s.skipped_between(fri, plan.next.unwrap(), MAX_COUNTED_SKIPS),
            2
        );
        assert_eq!(s.skipped_between(fri, plan.next.unwrap(), 1), 1, "capped");
        let coming = s.upcoming_skips(fri, fri + 9 * 86_400_000, 10);
        let days: Vec<_> = coming
            .iter()
            .map(|(_, skip)| skip.date.to_string())
            .collect();
        assert_eq!(
            days,
            ["2026-03-28", "2026-03-29", "2026-04-04", "2026-04-05"]
        );
        let preview = s.preview(fri, 4);
        let reasons: Vec<_> = preview
            .iter()
            .map(|(t, skip)| (s.rfc3339(*t), skip.as_ref().map(CalendarSkip::reason)))
            .collect();
        assert_eq!(
            reasons,
            [
                ("2026-03-27T02:30:00+01:00".to_owned(), None),
                (
                    "2026-03-28T02:30:00+01:00".to_owned(),
                    Some("Saturday 2026-03-28 is a weekend day of calendar test".to_owned())
                ),
                (
                    "2026-03-29T03:00:00+02:00".to_owned(),
                    Some("Sunday 2026-03-29 is a weekend day of calendar test".to_owned())
                ),
                ("2026-03-30T02:30:00+02:00".to_owned(), None),
            ]
        );
    }

    #[test]
    fn a_calendar_that_skips_every_occurrence_is_refused() {
        use crate::calendar::WeekdayName;
        let mut def = ScheduleDef::cron("0 12 * * 6", "UTC");
        def.calendar = Some(ScheduleCalendar {
            name: "weekends".into(),
            shift: Shift::Skip,
            days: Calendar::new([WeekdayName::Sat], []).unwrap(),
        });
        let e = def.validate().unwrap_err();
        assert_eq!(e.field, "calendar");
        assert!(e.why.contains("every occurrence falls on a day"), "{e}");
    }
}
