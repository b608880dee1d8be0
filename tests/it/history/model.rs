//! What a run records and the model it is checked against (pure: no I/O).
//!
//! Times are epoch ms on the clock of the Redis servers (all on this host). An operation's
//! effect lies in `[inv, ans]`: `inv` is a `TIME` read on the producer's connection before the
//! call, `ans` one read after its answer. An operation that failed (error, timeout, lost
//! connection) is indeterminate: it may have taken effect at any time from `inv` on, or
//! never. A delivery was pushed in `[pushed_after, read_at]`: consumers read the lists
//! without popping, and every item past the list's end at a read was pushed after it.
//!
//! Jobs: each job id is driven by one producer, one call at a time, so its calls are ordered.
//! The checker looks, per id, for a linearization of the calls' effects and the daemons'
//! deliveries (plus, on two-phase routes, the daemons' unobserved claims and acks) that
//! agrees with every answer, every delivery window and every due time. Local routes are
//! exactly once (a move is atomic: the job leaves as it is pushed); two-phase routes are at
//! least once (a claim may publish again after its lease ran out, even after a cancel or a
//! replace). Each due time is a lower bound: nothing may be pushed before it.
//!
//! Schedules: each generation of a schedule has its own payload and a window of a few grid
//! points; its deliveries must match distinct points of that window the schedule could have
//! fired (not before its set, not after its next generation or its delete, not while paused),
//! each no later than the delivery was read: at most once per occurrence on local routes. An
//! occurrence is owed (must be delivered) when its schedule catches up misfires and was left
//! alone from the set that planned it until [`OWED_AFTER`] past its time.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;

pub type Ms = i64;
/// No upper bound: an indeterminate call may take effect at any time after its invocation.
pub const OPEN: Ms = i64::MAX;

/// Where a job goes: a list on the scheduling Redis (exactly once), or two-phase (at least
/// once): a list on another Redis through the `redis` sink, a NATS JetStream subject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Route {
    Local,
    Remote,
    Nats,
}

impl Route {
    pub fn two_phase(self) -> bool {
        self != Route::Local
    }
}

/// A delivered payload: a job's incarnation (id and the nonce of the write that stored it)
/// or an occurrence of a schedule's generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    Job { id: String, nonce: u64 },
    Occurrence { schedule: String, generation: u32 },
    Unknown(String),
}

impl Payload {
    pub fn job(id: &str, nonce: u64) -> String {
        format!("j|{id}|{nonce}")
    }

    pub fn occurrence(schedule: &str, generation: u32) -> String {
        format!("s|{schedule}|{generation}")
    }

    pub fn parse(bytes: &[u8]) -> Payload {
        let text = String::from_utf8_lossy(bytes).into_owned();
        let parts: Vec<&str> = text.split('|').collect();
        match parts[..] {
            ["j", id, nonce] => match nonce.parse() {
                Ok(nonce) => Payload::Job {
                    id: id.to_owned(),
                    nonce,
                },
                Err(_) => Payload::Unknown(text),
            },
            ["s", schedule, generation] => match generation.parse() {
                Ok(generation) => Payload::Occurrence {
                    schedule: schedule.to_owned(),
                    generation,
                },
                Err(_) => Payload::Unknown(text),
            },
            _ => Payload::Unknown(text),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Replace,
    Keep,
    Error,
}

/// A due time as given: absolute, or relative to the Redis clock when the script runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DueSpec {
    At(Ms),
    In(Ms),
}

impl DueSpec {
    /// The due time of a script that ran at `t`.
    fn at(self, t: Ms) -> Ms {
        match self {
            DueSpec::At(ms) => ms,
            DueSpec::In(delay) => t.saturating_add(delay),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum JobOp {
    Enqueue {
        nonce: u64,
        route: Route,
        due: DueSpec,
        policy: Policy,
    },
    Cancel,
    Reschedule {
        due: DueSpec,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Added,
    Replaced,
    Kept,
    Exists,
    Cancelled,
    /// cancel: delivered, dead or unknown; reschedule: `None`.
    NotPending,
    InFlight,
    Rescheduled(Ms),
    /// Error or timeout: indeterminate.
    Failed(String),
}

#[derive(Clone, Debug)]
pub struct JobCall {
    pub id: String,
    pub op: JobOp,
    pub inv: Ms,
    pub ans: Ms,
    pub answer: Answer,
}

#[derive(Clone, Debug)]
pub struct Delivery {
    pub route: Route,
    pub payload: Payload,
    /// Pushed after this (the last read that found the list's end before it).
    pub pushed_after: Ms,
    /// Read at this (so pushed no later).
    pub read_at: Ms,
    /// Its position in its list (or stream) since the run began.
    pub index: u64,
    /// The idempotency key it carried (`zdelay-id`), where the route carries one.
    pub key: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ScheduleOp {
    /// Sets generation `generation`: every `interval` ms, the `count` grid points from
    /// `first` (start_at = first, end_at = first + count × interval); misfire policy
    /// `catch_up` (every missed occurrence delivered) or another.
    Set {
        generation: u32,
        first: Ms,
        count: u32,
        interval: Ms,
        route: Route,
        catch_up: bool,
    },
    Pause,
    Resume,
    Delete,
}

#[derive(Clone, Debug)]
pub struct ScheduleCall {
    pub id: String,
    pub op: ScheduleOp,
    pub inv: Ms,
    pub ans: Ms,
    /// The call answered (whatever it said); false: error, indeterminate.
    pub ok: bool,
    pub answer: String,
}

/// Everything a run recorded.
#[derive(Default)]
pub struct History {
    pub calls: Vec<JobCall>,
    pub schedule_calls: Vec<ScheduleCall>,
    pub deliveries: Vec<Delivery>,
    /// Faults injected: (approximate time, what).
    pub faults: Vec<(Ms, String)>,
    /// Times in reports are printed relative to this.
    pub origin: Ms,
}

#[derive(Debug)]
pub struct Violation {
    pub what: String,
    pub detail: String,
}

/// Checks every invariant; an empty answer means the history is consistent with the model.
pub fn check(history: &History) -> Vec<Violation> {
    let mut out = check_jobs(history);
    out.extend(check_schedules(history));
    out
}

// ---- Jobs ---------------------------------------------------------------------------------

/// Search nodes per job id before the answer is "inconclusive" (a few thousand suffice for
/// the histories producers write: at most a dozen calls per id).
const SEARCH_BUDGET: u64 = 500_000;

fn check_jobs(history: &History) -> Vec<Violation> {
    let mut out = check_keys(history);
    let mut calls: BTreeMap<&str, Vec<&JobCall>> = BTreeMap::new();
    for call in &history.calls {
        calls.entry(call.id.as_str()).or_default().push(call);
    }
    let mut deliveries: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
    for d in &history.deliveries {
        match &d.payload {
            Payload::Job { id, .. } => deliveries.entry(id.as_str()).or_default().push(d),
            Payload::Occurrence { .. } => {}
            Payload::Unknown(text) => out.push(Violation {
                what: format!("unknown payload {text:?} delivered"),
                detail: describe_delivery(history.origin, d),
            }),
        }
    }
    for (id, ds) in &deliveries {
        if !calls.contains_key(id) {
            out.push(Violation {
                what: format!("job {id} delivered but never enqueued"),
                detail: ds
                    .iter()
                    .map(|d| describe_delivery(history.origin, d))
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
        }
    }
    for (id, cs) in &calls {
        let ds = deliveries.get(id).cloned().unwrap_or_default();
        if let Some(v) = check_job(history.origin, id, cs, &ds) {
            out.push(v);
        }
    }
    out
}

/// The due times an incarnation may have had: (from, to) inclusive ranges — its write's due,
/// and every due a later reschedule of its id gave (or may have given).
fn possible_dues(calls: &[&JobCall], nonce: u64) -> Vec<(Ms, Ms)> {
    let Some(at) = calls
        .iter()
        .position(|c| matches!(c.op, JobOp::Enqueue { nonce: n, .. } if n == nonce))
    else {
        return Vec::new();
    };
    let range = |due: DueSpec, c: &JobCall| match due {
        DueSpec::At(ms) => (ms, ms),
        DueSpec::In(delay) => {
            let to = if matches!(c.answer, Answer::Failed(_)) {
                OPEN
            } else {
                c.ans.saturating_add(delay)
            };
            (c.inv.saturating_add(delay), to)
        }
    };
    let mut out = Vec::new();
    if let JobOp::Enqueue { due, .. } = calls[at].op {
        out.push(range(due, calls[at]));
    }
    for c in &calls[at + 1..] {
        match (&c.op, &c.answer) {
            (JobOp::Reschedule { .. }, Answer::Rescheduled(to)) => out.push((*to, *to)),
            (JobOp::Reschedule { due }, Answer::Failed(_)) => out.push(range(*due, c)),
            _ => {}
        }
    }
    out
}

/// Two-phase deliveries that carry an idempotency key: `<id>:<due>`, the due one the job had
/// and not after the publish, and the same on every repeat unless a reschedule gave the job
/// a new due in between.
fn check_keys(history: &History) -> Vec<Violation> {
    let mut calls: BTreeMap<&str, Vec<&JobCall>> = BTreeMap::new();
    for call in &history.calls {
        calls.entry(call.id.as_str()).or_default().push(call);
    }
    let mut keyed: BTreeMap<(&str, u64), Vec<&Delivery>> = BTreeMap::new();
    for d in &history.deliveries {
        if let (Payload::Job { id, nonce }, Some(_)) = (&d.payload, &d.key) {
            keyed.entry((id.as_str(), *nonce)).or_default().push(d);
        }
    }
    let origin = history.origin;
    let mut out = Vec::new();
    for ((id, nonce), ds) in keyed {
        let cs = calls.get(id).cloned().unwrap_or_default();
        let dues = possible_dues(&cs, nonce);
        let mut keys: BTreeSet<&str> = BTreeSet::new();
        let mut problems = Vec::new();
        for d in &ds {
            let key = d.key.as_deref().expect("keyed deliveries only");
            keys.insert(key);
            let due = key
                .rsplit_once(':')
                .filter(|(key_id, _)| key_id == &id)
                .and_then(|(_, due)| due.parse::<Ms>().ok());
            match due {
                None => problems.push(format!("key {key:?} is not `{id}:<due>`")),
                Some(due) if !dues.iter().any(|&(from, to)| due >= from && due <= to) => problems
                    .push(format!(
                        "key {key:?} names a due time the job never had (its dues: {dues:?})"
                    )),
                Some(due) if due > d.read_at => problems.push(format!(
                    "key {key:?} names a due after the message was stored ({})",
                    rel(origin, d.read_at)
                )),
                Some(_) => {}
            }
        }
        let reschedules = cs
            .iter()
            .filter(|c| {
                matches!(c.op, JobOp::Reschedule { .. })
                    && matches!(c.answer, Answer::Rescheduled(_) | Answer::Failed(_))
            })
            .count();
        if keys.len() > 1 + reschedules {
            problems.push(format!(
                "{} different keys {keys:?} with only {reschedules} reschedule(s) of the job",
                keys.len()
            ));
        }
        if !problems.is_empty() {
            let mut detail = String::new();
            for p in &problems {
                let _ = writeln!(detail, "  => {p}");
            }
            for c in &cs {
                let _ = writeln!(detail, "    {}", describe_call(origin, c));
            }
            for d in &ds {
                let _ = writeln!(detail, "    {}", describe_delivery(origin, d));
            }
            out.push(Violation {
                what: format!("job {id} nonce {nonce}: idempotency key"),
                detail,
            });
        }
    }
    out
}

#[derive(Clone, Copy)]
enum Kind<'a> {
    Call(&'a JobCall),
    Deliver(&'a Delivery, u64),
}

#[derive(Clone, Copy)]
struct Ev<'a> {
    lo: Ms,
    hi: Ms,
    optional: bool,
    kind: Kind<'a>,
}

/// The stored incarnation of a job.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Inc {
    nonce: u64,
    route: Route,
    due: Ms,
    /// Two-phase: claimed by a publisher now (cancel answers InFlight).
    claimed: bool,
    /// Two-phase: the current claim was published, so it may have been acked.
    published: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct St {
    cur: Option<Inc>,
    /// Two-phase incarnations ever claimed (nonce, route): each may be published (again) at
    /// any time.
    claimed: BTreeSet<(u64, Route)>,
    t: Ms,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Consistent,
    Inconsistent,
    Inconclusive,
}

struct Search<'a> {
    evs: Vec<Ev<'a>>,
    budget: u64,
    seen: HashSet<(Vec<bool>, St)>,
    /// Accept any end state (used to tell "never delivered" from other violations).
    any_end: bool,
}

impl<'a> Search<'a> {
    fn new(evs: Vec<Ev<'a>>, any_end: bool) -> Self {
        Search {
            evs,
            budget: SEARCH_BUDGET,
            seen: HashSet::new(),
            any_end,
        }
    }

    fn run(mut self) -> Outcome {
        let mut placed = vec![false; self.evs.len()];
        let start = St {
            cur: None,
            claimed: BTreeSet::new(),
            t: Ms::MIN,
        };
        if self.step(&mut placed, &start) {
            Outcome::Consistent
        } else if self.budget == 0 {
            Outcome::Inconclusive
        } else {
            Outcome::Inconsistent
        }
    }

    fn step(&mut self, placed: &mut Vec<bool>, st: &St) -> bool {
        if self.budget == 0 {
            return false;
        }
        self.budget -= 1;
        if !self.seen.insert((placed.clone(), st.clone())) {
            return false;
        }
        // Every event still to come must fit before its own deadline.
        let limit = self
            .evs
            .iter()
            .zip(placed.iter())
            .filter(|(e, p)| !**p && !e.optional)
            .map(|(e, _)| e.hi)
            .min();
        if limit.is_some_and(|hi| hi < st.t) {
            return false;
        }
        if limit.is_none() && (self.any_end || end_ok(st)) {
            return true;
        }
        let limit = limit.unwrap_or(OPEN);
        // The daemons' unobserved steps on a two-phase job: a claim (once due), an ack (once
        // the claim was published).
        if let Some(inc) = &st.cur
            && inc.route.two_phase()
        {
            if !inc.claimed {
                let t = st.t.max(inc.due);
                if t <= limit {
                    let mut next = st.clone();
                    next.t = t;
                    next.claimed.insert((inc.nonce, inc.route));
                    if let Some(cur) = next.cur.as_mut() {
                        cur.claimed = true;
                    }
                    if self.step(placed, &next) {
                        return true;
                    }
                }
            }
            if inc.published {
                let mut next = st.clone();
                next.cur = None;
                if self.step(placed, &next) {
                    return true;
                }
            }
        }
        for i in 0..self.evs.len() {
            if placed[i] {
                continue;
            }
            let ev = self.evs[i];
            let t = st.t.max(ev.lo);
            if t > ev.hi || t > limit {
                continue;
            }
            for next in apply(&ev, st, t) {
                if next.t > ev.hi || next.t > limit {
                    continue;
                }
                placed[i] = true;
                let found = self.step(placed, &next);
                placed[i] = false;
                if found {
                    return true;
                }
            }
        }
        false
    }
}

/// At the end every job is gone: delivered or cancelled (a two-phase job once published may
/// still be acked).
fn end_ok(st: &St) -> bool {
    match &st.cur {
        None => true,
        Some(inc) => inc.route.two_phase() && inc.published,
    }
}

/// The states in which the job is not stored: none, or a published two-phase job acked.
fn gone(st: &St) -> Vec<St> {
    match &st.cur {
        None => vec![st.clone()],
        Some(inc) if inc.route.two_phase() && inc.published => {
            let mut next = st.clone();
            next.cur = None;
            vec![next]
        }
        Some(_) => Vec::new(),
    }
}

fn with_cur(st: &St, t: Ms, cur: Option<Inc>) -> St {
    St {
        cur,
        claimed: st.claimed.clone(),
        t,
    }
}

/// The states an event can lead to from `st`, placed at time `t` (a local delivery waits
/// for its due time, so its state's `t` may be later).
fn apply(ev: &Ev, st: &St, t: Ms) -> Vec<St> {
    let stored = st.cur.is_some();
    match ev.kind {
        Kind::Deliver(d, nonce) => match (&st.cur, d.route) {
            (Some(inc), Route::Local) if inc.route == Route::Local && inc.nonce == nonce => {
                vec![with_cur(st, t.max(inc.due), None)]
            }
            (_, Route::Local) => Vec::new(),
            (cur, route) if route.two_phase() && st.claimed.contains(&(nonce, route)) => {
                let mut cur = cur.clone();
                if let Some(inc) = cur.as_mut()
                    && inc.nonce == nonce
                    && inc.claimed
                {
                    inc.published = true;
                }
                vec![with_cur(st, t, cur)]
            }
            _ => Vec::new(),
        },
        Kind::Call(call) => match (&call.op, &call.answer) {
            (
                JobOp::Enqueue {
                    nonce,
                    route,
                    due,
                    policy,
                },
                answer,
            ) => {
                let new = Some(Inc {
                    nonce: *nonce,
                    route: *route,
                    due: due.at(t),
                    claimed: false,
                    published: false,
                });
                let added = || -> Vec<St> {
                    gone(st)
                        .into_iter()
                        .map(|s| with_cur(&s, t, new.clone()))
                        .collect()
                };
                match answer {
                    Answer::Added => added(),
                    Answer::Replaced if stored => vec![with_cur(st, t, new.clone())],
                    Answer::Kept | Answer::Exists if stored => {
                        vec![with_cur(st, t, st.cur.clone())]
                    }
                    Answer::Failed(_) if *policy == Policy::Replace => {
                        vec![with_cur(st, t, new.clone())]
                    }
                    Answer::Failed(_) => added(),
                    _ => Vec::new(),
                }
            }
            (JobOp::Cancel, answer) => match answer {
                Answer::Cancelled | Answer::Failed(_) if stored => vec![with_cur(st, t, None)],
                Answer::NotPending => gone(st)
                    .into_iter()
                    .map(|s| with_cur(&s, t, None))
                    .collect(),
                Answer::InFlight if in_flight(st) => vec![with_cur(st, t, st.cur.clone())],
                _ => Vec::new(),
            },
            (JobOp::Reschedule { due }, answer) => {
                let moved = |to: Ms| -> Vec<St> {
                    let mut cur = st.cur.clone();
                    match cur.as_mut() {
                        Some(inc) => {
                            inc.due = to;
                            // Back among the pending jobs (a claim's settle is now fenced).
                            inc.claimed = false;
                            inc.published = false;
                            vec![with_cur(st, t, cur)]
                        }
                        None => Vec::new(),
                    }
                };
                match answer {
                    Answer::Rescheduled(to) => moved(*to),
                    Answer::Failed(_) => moved(due.at(t)),
                    Answer::NotPending => {
                        let mut out: Vec<St> = gone(st)
                            .into_iter()
                            .map(|s| with_cur(&s, t, s.cur.clone()))
                            .collect();
                        if in_flight(st) {
                            out.push(with_cur(st, t, st.cur.clone()));
                        }
                        out
                    }
                    _ => Vec::new(),
                }
            }
        },
    }
}

fn in_flight(st: &St) -> bool {
    matches!(&st.cur, Some(inc) if inc.route.two_phase() && inc.claimed)
}

fn events<'a>(calls: &[&'a JobCall], deliveries: &[&'a Delivery]) -> Vec<Ev<'a>> {
    let mut evs: Vec<Ev<'a>> = calls
        .iter()
        .map(|c| {
            let failed = matches!(c.answer, Answer::Failed(_));
            Ev {
                lo: c.inv,
                hi: if failed { OPEN } else { c.ans },
                optional: failed,
                kind: Kind::Call(c),
            }
        })
        .collect();
    for d in deliveries {
        if let Payload::Job { nonce, .. } = d.payload {
            evs.push(Ev {
                lo: d.pushed_after,
                hi: d.read_at,
                optional: false,
                kind: Kind::Deliver(d, nonce),
            });
        }
    }
    evs.sort_by_key(|e| (e.lo, e.hi));
    evs
}

fn check_job(
    origin: Ms,
    id: &str,
    calls: &[&JobCall],
    deliveries: &[&Delivery],
) -> Option<Violation> {
    let outcome = Search::new(events(calls, deliveries), false).run();
    if outcome == Outcome::Consistent {
        return None;
    }
    let mut findings = Vec::new();
    if outcome == Outcome::Inconclusive {
        findings.push("the search ran out of budget (inconclusive)".to_owned());
    } else if Search::new(events(calls, deliveries), true).run() == Outcome::Consistent {
        findings.push(
            "never delivered: every delivery is explained, but an acknowledged incarnation \
             that was neither cancelled nor replaced was not delivered (lost, or stuck stored)"
                .to_owned(),
        );
    } else {
        for (i, d) in deliveries.iter().enumerate() {
            let rest: Vec<&Delivery> = deliveries
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, d)| *d)
                .collect();
            // Without it (and whatever that leaves undelivered) the rest is explained.
            if Search::new(events(calls, &rest), true).run() == Outcome::Consistent {
                findings.push(format!(
                    "this delivery cannot be explained: {}{}",
                    describe_delivery(origin, d),
                    delivery_hints(calls, deliveries, d)
                ));
            }
        }
        if findings.is_empty() {
            // An answer the rest contradicts: taken as unknown, everything else is explained.
            for (i, c) in calls.iter().enumerate() {
                let unknown = JobCall {
                    answer: Answer::Failed("taken as unknown".to_owned()),
                    ..(*c).clone()
                };
                let mut others: Vec<&JobCall> = calls.to_vec();
                others[i] = &unknown;
                if Search::new(events(&others, deliveries), false).run() == Outcome::Consistent {
                    findings.push(format!(
                        "this answer contradicts the rest of the history: {}",
                        describe_call(origin, c)
                    ));
                }
            }
        }
        if findings.is_empty() {
            findings.push(
                "no single delivery or answer explains it: the answers and deliveries \
                 contradict each other"
                    .to_owned(),
            );
        }
    }
    let mut detail = String::new();
    for f in &findings {
        let _ = writeln!(detail, "  => {f}");
    }
    let _ = writeln!(detail, "  calls and deliveries of {id}, in time order:");
    let mut lines: Vec<(Ms, String)> = calls
        .iter()
        .map(|c| (c.inv, describe_call(origin, c)))
        .chain(deliveries.iter().map(|d| {
            (
                d.pushed_after.max(d.read_at - 1),
                describe_delivery(origin, d),
            )
        }))
        .collect();
    lines.sort_by_key(|(t, _)| *t);
    for (_, line) in lines {
        let _ = writeln!(detail, "    {line}");
    }
    Some(Violation {
        what: format!("job {id}: history not explained by the model"),
        detail,
    })
}

/// What makes a delivery suspicious on its face, for the report.
fn delivery_hints(calls: &[&JobCall], deliveries: &[&Delivery], d: &Delivery) -> String {
    let Payload::Job { nonce, .. } = d.payload else {
        return String::new();
    };
    let mut hints = Vec::new();
    let copies = deliveries
        .iter()
        .filter(|o| matches!(o.payload, Payload::Job { nonce: n, .. } if n == nonce))
        .count();
    if copies > 1 && d.route == Route::Local {
        hints.push(format!(
            "nonce {nonce} delivered {copies} times on a local route"
        ));
    }
    let written = calls
        .iter()
        .find(|c| matches!(c.op, JobOp::Enqueue { nonce: n, .. } if n == nonce));
    match written {
        None => hints.push(format!("no call wrote nonce {nonce}")),
        Some(c) => {
            if matches!(c.answer, Answer::Kept | Answer::Exists) {
                hints.push(format!(
                    "the write of nonce {nonce} answered {:?}",
                    c.answer
                ));
            }
            if let JobOp::Enqueue { due, .. } = c.op {
                let earliest = due.at(c.inv);
                if d.read_at < earliest {
                    hints.push(format!(
                        "read {} ms before its due time",
                        earliest - d.read_at
                    ));
                }
            }
        }
    }
    for c in calls {
        let ends = matches!(
            (&c.op, &c.answer),
            (JobOp::Cancel, Answer::Cancelled) | (JobOp::Enqueue { .. }, Answer::Replaced)
        );
        if ends && c.inv > written.map_or(Ms::MIN, |w| w.ans) && d.pushed_after > c.ans {
            hints.push(format!(
                "pushed after the {} acknowledged at {}",
                describe_op(&c.op),
                c.ans
            ));
        }
    }
    if hints.is_empty() {
        String::new()
    } else {
        format!(" [{}]", hints.join("; "))
    }
}

fn rel(origin: Ms, t: Ms) -> String {
    if t == OPEN {
        "open".to_owned()
    } else {
        format!("{:+}", t - origin)
    }
}

fn describe_op(op: &JobOp) -> String {
    match op {
        JobOp::Enqueue {
            nonce,
            route,
            due,
            policy,
        } => format!("enqueue({policy:?}) nonce {nonce} to {route:?} due {due:?}"),
        JobOp::Cancel => "cancel".to_owned(),
        JobOp::Reschedule { due } => format!("reschedule to {due:?}"),
    }
}

fn describe_call(origin: Ms, c: &JobCall) -> String {
    format!(
        "call [{} .. {}] {} -> {:?}",
        rel(origin, c.inv),
        rel(origin, c.ans),
        describe_op(&c.op),
        c.answer
    )
}

fn describe_delivery(origin: Ms, d: &Delivery) -> String {
    format!(
        "delivery on {:?} #{} pushed in [{} .. {}]: {:?}{}",
        d.route,
        d.index,
        rel(origin, d.pushed_after),
        rel(origin, d.read_at),
        d.payload,
        d.key
            .as_deref()
            .map(|k| format!(" key {k}"))
            .unwrap_or_default()
    )
}

// ---- Schedules ----------------------------------------------------------------------------

/// How long after its time an occurrence of an untouched schedule must have fired, whatever
/// the faults (a daemon killed or stopped for up to 4.5 s, its poller slots taken over after
/// the 2 s slot lease, Redis restarting), with margin for a loaded machine.
pub const OWED_AFTER: Ms = 10_000;

/// One generation of a schedule: its window and when it could fire.
struct Generation<'a> {
    set: &'a ScheduleCall,
    points: Vec<Ms>,
    route: Route,
    /// Spans in which its envelope could be stored: from a set of it being invoked until a
    /// later generation or a delete was acknowledged.
    spans: Vec<(Ms, Ms)>,
}

fn check_schedules(history: &History) -> Vec<Violation> {
    let mut calls: BTreeMap<&str, Vec<&ScheduleCall>> = BTreeMap::new();
    for c in &history.schedule_calls {
        calls.entry(c.id.as_str()).or_default().push(c);
    }
    // Only the sets of a tight re-apply loop overlap; every other call follows the last.
    for cs in calls.values_mut() {
        cs.sort_by_key(|c| c.inv);
    }
    let mut deliveries: BTreeMap<(&str, u32), Vec<&Delivery>> = BTreeMap::new();
    for d in &history.deliveries {
        if let Payload::Occurrence {
            schedule,
            generation,
        } = &d.payload
        {
            deliveries
                .entry((schedule.as_str(), *generation))
                .or_default()
                .push(d);
        }
    }
    let mut out = Vec::new();
    for ((schedule, generation), ds) in &deliveries {
        let gens = calls
            .get(schedule)
            .map(|cs| generations(cs))
            .unwrap_or_default();
        let Some(g) = gens.get(generation) else {
            out.push(Violation {
                what: format!(
                    "schedule {schedule} generation {generation} delivered but never set"
                ),
                detail: ds
                    .iter()
                    .map(|d| describe_delivery(history.origin, d))
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
            continue;
        };
        let cs = &calls[schedule];
        let allowed: Vec<Ms> = g
            .points
            .iter()
            .copied()
            .filter(|&p| g.spans.iter().any(|&(from, until)| p >= from && p <= until))
            .filter(|&p| !suppressed(cs, p))
            .collect();
        let mut reads: Vec<&Delivery> = ds.clone();
        reads.sort_by_key(|d| d.read_at);
        // Each delivery needs an occurrence at or before its read; on a local route each
        // occurrence serves one delivery (Hall's condition on these nested sets).
        let problem = reads.iter().enumerate().find_map(|(k, d)| {
            let possible = allowed.iter().filter(|&&p| p <= d.read_at).count();
            let needed = if g.route == Route::Local { k + 1 } else { 1 };
            (possible < needed).then_some((k, d, possible))
        });
        if let Some((k, d, possible)) = problem {
            let origin = history.origin;
            let what = if g.route == Route::Local && possible > 0 {
                format!(
                    "schedule {schedule} generation {generation}: {} deliveries by the time \
                     delivery {} was read, but only {possible} occurrence(s) could have fired by \
                     then (an occurrence delivered twice on a local route, or one fired that \
                     must not)",
                    k + 1,
                    k + 1
                )
            } else {
                format!(
                    "schedule {schedule} generation {generation}: delivered with no occurrence \
                     that could have fired by then (early, paused, deleted or superseded)"
                )
            };
            let mut detail = String::new();
            let _ = writeln!(
                detail,
                "  window {:?} on {:?}, stored in {:?}: points that could fire {:?}",
                g.points.iter().map(|&p| rel(origin, p)).collect::<Vec<_>>(),
                g.route,
                merged(&g.spans)
                    .iter()
                    .map(|&(from, until)| format!(
                        "[{} .. {}]",
                        rel(origin, from),
                        rel(origin, until)
                    ))
                    .collect::<Vec<_>>(),
                allowed.iter().map(|&p| rel(origin, p)).collect::<Vec<_>>()
            );
            // A set that read the clock before an occurrence and wrote after it had been
            // delivered leaves it pending again: the stale re-set that fires it twice.
            for &p in &g.points {
                let Some(first) = reads.iter().find(|d| d.read_at >= p) else {
                    continue;
                };
                let pending = format!("next_ms: Some({p})");
                for c in cs.iter().filter(|c| {
                    c.answer.contains(&pending) && c.ans > first.pushed_after && c.inv < p
                }) {
                    let _ = writeln!(
                        detail,
                        "  set invoked at {} (before the occurrence at {}) answered at {} (after \
                         its delivery pushed in [{} .. {}]) leaving it pending: {}",
                        rel(origin, c.inv),
                        rel(origin, p),
                        rel(origin, c.ans),
                        rel(origin, first.pushed_after),
                        rel(origin, first.read_at),
                        c.answer
                    );
                }
            }
            let _ = writeln!(detail, "  offending: {}", describe_delivery(origin, d));
            let _ = writeln!(detail, "  deliveries of this generation:");
            for d in &reads {
                let _ = writeln!(detail, "    {}", describe_delivery(origin, d));
            }
            let _ = writeln!(
                detail,
                "  calls on {schedule} from this generation's first set (invoked at {}) to the \
                 offending read:",
                rel(origin, g.set.inv)
            );
            let around: Vec<&ScheduleCall> = cs
                .iter()
                .filter(|c| c.ans >= g.set.inv && c.inv <= d.read_at)
                .copied()
                .collect();
            detail.push_str(&describe_schedule_calls(origin, &around));
            out.push(Violation { what, detail });
        }
    }
    out.extend(owed_occurrences(history, &calls));
    out
}

/// The occurrences that must have been delivered: those of a catch-up generation set (and
/// answered) before the occurrence, after which nothing but sets of that same, unchanged
/// generation touched the schedule until [`OWED_AFTER`] past the occurrence. (A failed call is
/// taken to have run by its answer, if at all: its connection was cut by a Redis restart.)
fn owed_occurrences(
    history: &History,
    calls: &BTreeMap<&str, Vec<&ScheduleCall>>,
) -> Vec<Violation> {
    let mut delivered: BTreeMap<(&str, u32), Vec<&Delivery>> = BTreeMap::new();
    for d in &history.deliveries {
        if let Payload::Occurrence {
            schedule,
            generation,
        } = &d.payload
        {
            delivered
                .entry((schedule.as_str(), *generation))
                .or_default()
                .push(d);
        }
    }
    let origin = history.origin;
    let mut out = Vec::new();
    for (schedule, cs) in calls {
        // Generation → (its owed points, the number of re-sets they waited through).
        let mut owed: BTreeMap<u32, (BTreeSet<Ms>, usize)> = BTreeMap::new();
        for c in cs {
            let ScheduleOp::Set {
                generation,
                first,
                count,
                interval,
                catch_up: true,
                ..
            } = c.op
            else {
                continue;
            };
            if !c.ok {
                continue;
            }
            let same = |o: &ScheduleCall| matches!(o.op, ScheduleOp::Set { generation: g, .. } if g == generation);
            for p in (0..count as Ms).map(|k| first + k * interval) {
                let horizon = p.saturating_add(OWED_AFTER);
                let touched = cs
                    .iter()
                    .any(|o| !same(o) && o.ans > c.inv && o.inv < horizon);
                if p > c.ans && !touched {
                    let resets = cs
                        .iter()
                        .filter(|o| same(o) && o.inv > c.ans && o.inv < horizon)
                        .count();
                    let entry = owed.entry(generation).or_default();
                    entry.0.insert(p);
                    entry.1 = entry.1.max(resets);
                }
            }
        }
        for (generation, (points, resets)) in owed {
            let got = delivered
                .get(&(*schedule, generation))
                .map_or(&[][..], |v| v.as_slice());
            // Each owed occurrence needs its own delivery read after it: matched in time order
            // to the earliest read at or after it, the unmatched ones are missing.
            let points: Vec<Ms> = points.into_iter().collect();
            let mut reads: Vec<Ms> = got.iter().map(|d| d.read_at).collect();
            reads.sort_unstable();
            let mut next_read = reads.iter().peekable();
            let missing: Vec<Ms> = points
                .iter()
                .copied()
                .filter(|&p| {
                    while next_read.next_if(|&&r| r < p).is_some() {}
                    next_read.next().is_none()
                })
                .collect();
            let Some(&p) = missing.first() else { continue };
            let why = if resets == 0 {
                "though nothing touched the schedule".to_owned()
            } else {
                format!("though only {resets} re-sets of the same, unchanged definition touched it")
            };
            let mut detail = String::new();
            let _ = writeln!(
                detail,
                "  owed occurrences {:?}; deliveries of this generation:",
                points.iter().map(|&p| rel(origin, p)).collect::<Vec<_>>()
            );
            for d in got {
                let _ = writeln!(detail, "    {}", describe_delivery(origin, d));
            }
            let _ = writeln!(detail, "  calls on {schedule} around it:");
            let around: Vec<&ScheduleCall> = cs
                .iter()
                .filter(|c| c.ans > points[0] - 5_000 && c.inv < p.saturating_add(OWED_AFTER))
                .copied()
                .collect();
            detail.push_str(&describe_schedule_calls(origin, &around));
            out.push(Violation {
                what: format!(
                    "schedule {schedule} generation {generation}: occurrence(s) at {:?} never \
                     delivered in {OWED_AFTER} ms, {why}",
                    missing.iter().map(|&m| rel(origin, m)).collect::<Vec<_>>()
                ),
                detail,
            });
        }
    }
    out
}

/// Overlapping spans as one.
fn merged(spans: &[(Ms, Ms)]) -> Vec<(Ms, Ms)> {
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    let mut out: Vec<(Ms, Ms)> = Vec::new();
    for (from, until) in sorted {
        match out.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(until),
            _ => out.push((from, until)),
        }
    }
    out
}

/// One line per call, a run of identical sets (a tight re-set loop) as one line with the
/// pending occurrences its answers named.
fn describe_schedule_calls(origin: Ms, calls: &[&ScheduleCall]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < calls.len() {
        let c = calls[i];
        let run = calls[i..]
            .iter()
            .take_while(|o| o.op == c.op && matches!(o.op, ScheduleOp::Set { .. }))
            .count()
            .max(1);
        let last = calls[i + run - 1];
        let answer = if run == 1 {
            format!("{}{}", if c.ok { "" } else { "FAILED " }, c.answer)
        } else {
            let failed = calls[i..i + run].iter().filter(|o| !o.ok).count();
            // "…next_ms: Some(<ms>) }": the pending occurrence each set left.
            let mut pending: Vec<String> = Vec::new();
            for o in &calls[i..i + run] {
                let next = o
                    .answer
                    .split("next_ms: ")
                    .nth(1)
                    .map(|t| t.trim_end_matches(" }").to_owned())
                    .map(
                        |t| match t.trim_start_matches("Some(").trim_end_matches(')').parse() {
                            Ok(ms) => rel(origin, ms),
                            Err(_) => t,
                        },
                    );
                if let Some(next) = next
                    && pending.last() != Some(&next)
                {
                    pending.push(next);
                }
            }
            format!("{run} identical sets ({failed} failed), pending occurrence {pending:?}")
        };
        let _ = writeln!(
            out,
            "    [{} .. {}] {:?} -> {answer}",
            rel(origin, c.inv),
            rel(origin, last.ans),
            c.op
        );
        i += run;
    }
    out
}

/// Each generation's first set and the spans in which it could fire.
fn generations<'a>(calls: &[&'a ScheduleCall]) -> BTreeMap<u32, Generation<'a>> {
    let mut out: BTreeMap<u32, Generation<'a>> = BTreeMap::new();
    for (i, c) in calls.iter().enumerate() {
        let ScheduleOp::Set {
            generation,
            first,
            count,
            interval,
            route,
            ..
        } = c.op
        else {
            continue;
        };
        // The envelope this set writes is replaced by the first later set of another
        // generation, or removed by a delete, that certainly ran (answered): occurrences
        // fired after that carry another payload or none.
        let until = calls[i + 1..]
            .iter()
            .find(|l| {
                l.ok && match l.op {
                    ScheduleOp::Set { generation: g, .. } => g != generation,
                    ScheduleOp::Delete => true,
                    _ => false,
                }
            })
            .map_or(OPEN, |l| l.ans);
        out.entry(generation)
            .or_insert_with(|| Generation {
                set: c,
                points: (0..count as i64).map(|k| first + k * interval).collect(),
                route,
                spans: Vec::new(),
            })
            .spans
            .push((c.inv, until));
    }
    out
}

/// Whether occurrence `point` falls in a span where the schedule had no pending occurrence:
/// after an answered pause or delete, until the next call that could plan one again (a
/// resume or a set: the lax end, as a set keeps a pause).
fn suppressed(calls: &[&ScheduleCall], point: Ms) -> bool {
    calls.iter().enumerate().any(|(i, c)| {
        if !c.ok || !matches!(c.op, ScheduleOp::Pause | ScheduleOp::Delete) {
            return false;
        }
        let end = calls[i + 1..]
            .iter()
            .find(|l| matches!(l.op, ScheduleOp::Resume | ScheduleOp::Set { .. }))
            .map_or(OPEN, |l| l.inv);
        point > c.ans && point < end
    })
}

// ---- The checker's own tests: it must see what it is meant to see ---------------------------

#[cfg(test)]
mod tests {
    use super::*;

    fn enqueue(
        id: &str,
        nonce: u64,
        route: Route,
        due: Ms,
        inv: Ms,
        ans: Ms,
        answer: Answer,
    ) -> JobCall {
        JobCall {
            id: id.to_owned(),
            op: JobOp::Enqueue {
                nonce,
                route,
                due: DueSpec::At(due),
                policy: Policy::Replace,
            },
            inv,
            ans,
            answer,
        }
    }

    fn call(id: &str, op: JobOp, inv: Ms, ans: Ms, answer: Answer) -> JobCall {
        JobCall {
            id: id.to_owned(),
            op,
            inv,
            ans,
            answer,
        }
    }

    fn delivery(id: &str, nonce: u64, route: Route, pushed_after: Ms, read_at: Ms) -> Delivery {
        Delivery {
            route,
            payload: Payload::Job {
                id: id.to_owned(),
                nonce,
            },
            pushed_after,
            read_at,
            index: 0,
            key: None,
        }
    }

    fn jobs(calls: Vec<JobCall>, deliveries: Vec<Delivery>) -> Vec<Violation> {
        check(&History {
            calls,
            deliveries,
            ..History::default()
        })
    }

    #[test]
    fn payloads_round_trip() {
        assert_eq!(
            Payload::parse(Payload::job("p1-7", 42).as_bytes()),
            Payload::Job {
                id: "p1-7".into(),
                nonce: 42
            }
        );
        assert_eq!(
            Payload::parse(Payload::occurrence("s0", 3).as_bytes()),
            Payload::Occurrence {
                schedule: "s0".into(),
                generation: 3
            }
        );
        assert!(matches!(Payload::parse(b"j|x"), Payload::Unknown(_)));
    }

    #[test]
    fn a_local_job_delivered_once_after_its_due_is_consistent() {
        let v = jobs(
            vec![enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added)],
            vec![delivery("a", 1, Route::Local, 90, 120)],
        );
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn local_duplicates_early_and_lost_jobs_are_violations() {
        let twice = jobs(
            vec![enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added)],
            vec![
                delivery("a", 1, Route::Local, 90, 120),
                delivery("a", 1, Route::Local, 120, 130),
            ],
        );
        assert_eq!(twice.len(), 1);
        assert!(
            twice[0].detail.contains("delivered 2 times"),
            "{}",
            twice[0].detail
        );

        let early = jobs(
            vec![enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added)],
            vec![delivery("a", 1, Route::Local, 20, 60)],
        );
        assert_eq!(early.len(), 1, "read at 60, due at 100");
        assert!(
            early[0].detail.contains("before its due"),
            "{}",
            early[0].detail
        );

        let lost = jobs(
            vec![enqueue("a", 1, Route::Remote, 100, 0, 10, Answer::Added)],
            vec![],
        );
        assert_eq!(lost.len(), 1);
        assert!(
            lost[0].detail.contains("never delivered"),
            "{}",
            lost[0].detail
        );
    }

    #[test]
    fn a_cancelled_or_replaced_local_incarnation_is_never_delivered() {
        let cancelled = jobs(
            vec![
                enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
                call("a", JobOp::Cancel, 50, 60, Answer::Cancelled),
            ],
            // Read after the cancel, but it could have been pushed before: still wrong, the
            // cancel found it pending.
            vec![delivery("a", 1, Route::Local, 40, 200)],
        );
        assert_eq!(cancelled.len(), 1);

        let replaced = jobs(
            vec![
                enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
                enqueue("a", 2, Route::Local, 150, 120, 130, Answer::Replaced),
            ],
            vec![
                delivery("a", 1, Route::Local, 100, 200),
                delivery("a", 2, Route::Local, 100, 200),
            ],
        );
        assert_eq!(replaced.len(), 1, "nonce 1 was still stored at the replace");

        // The replace found nothing stored (Added): nonce 1 went out before it.
        let added_again = jobs(
            vec![
                enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
                enqueue("a", 2, Route::Local, 150, 120, 130, Answer::Added),
            ],
            vec![
                delivery("a", 1, Route::Local, 100, 200),
                delivery("a", 2, Route::Local, 100, 200),
            ],
        );
        assert!(added_again.is_empty(), "{added_again:?}");
    }

    #[test]
    fn a_cancel_that_found_nothing_pending_needs_the_delivery_before_it() {
        let calls = || {
            vec![
                enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
                call("a", JobOp::Cancel, 150, 160, Answer::NotPending),
            ]
        };
        assert!(jobs(calls(), vec![delivery("a", 1, Route::Local, 90, 170)]).is_empty());
        // Pushed after the cancel answered "not pending": the job was stored then.
        assert_eq!(
            jobs(calls(), vec![delivery("a", 1, Route::Local, 165, 170)]).len(),
            1
        );
    }

    #[test]
    fn reschedules_move_the_due_time() {
        let calls = vec![
            enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
            call(
                "a",
                JobOp::Reschedule {
                    due: DueSpec::At(500),
                },
                20,
                30,
                Answer::Rescheduled(500),
            ),
        ];
        assert_eq!(
            jobs(
                calls.clone(),
                vec![delivery("a", 1, Route::Local, 100, 200)]
            )
            .len(),
            1,
            "moved to 500 before it was due"
        );
        assert!(jobs(calls, vec![delivery("a", 1, Route::Local, 100, 520)]).is_empty());
    }

    #[test]
    fn an_indeterminate_call_may_or_may_not_have_run() {
        let calls = || {
            vec![
                enqueue("a", 1, Route::Local, 100, 0, 10, Answer::Added),
                call("a", JobOp::Cancel, 50, 60, Answer::Failed("io".into())),
            ]
        };
        assert!(jobs(calls(), vec![]).is_empty(), "cancelled");
        assert!(jobs(calls(), vec![delivery("a", 1, Route::Local, 90, 120)]).is_empty());
        let lost_write = vec![enqueue(
            "a",
            1,
            Route::Local,
            100,
            0,
            10,
            Answer::Failed("io".into()),
        )];
        assert!(jobs(lost_write, vec![]).is_empty());
    }

    #[test]
    fn two_phase_allows_repeats_but_not_early_or_unclaimable_ones() {
        let calls = || vec![enqueue("a", 1, Route::Remote, 100, 0, 10, Answer::Added)];
        assert!(
            jobs(
                calls(),
                vec![
                    delivery("a", 1, Route::Remote, 90, 120),
                    delivery("a", 1, Route::Remote, 3000, 3100),
                ]
            )
            .is_empty()
        );
        assert_eq!(
            jobs(calls(), vec![delivery("a", 1, Route::Remote, 10, 50)]).len(),
            1,
            "read at 50, due at 100"
        );
        // Cancelled before its due: no claim could have taken it.
        let cancelled = vec![
            enqueue("a", 1, Route::Remote, 100, 0, 10, Answer::Added),
            call("a", JobOp::Cancel, 20, 30, Answer::Cancelled),
        ];
        assert_eq!(
            jobs(cancelled, vec![delivery("a", 1, Route::Remote, 200, 300)]).len(),
            1
        );
        // Cancelled after its due: a claim that outlived its lease may still publish it.
        let late_cancel = vec![
            enqueue("a", 1, Route::Remote, 100, 0, 10, Answer::Added),
            call("a", JobOp::Cancel, 200, 210, Answer::Cancelled),
        ];
        assert!(jobs(late_cancel, vec![delivery("a", 1, Route::Remote, 300, 400)]).is_empty());
        // Cancel answered "in flight": it must go out.
        let in_flight = vec![
            enqueue("a", 1, Route::Remote, 100, 0, 10, Answer::Added),
            call("a", JobOp::Cancel, 200, 210, Answer::InFlight),
        ];
        assert_eq!(jobs(in_flight.clone(), vec![]).len(), 1);
        assert!(jobs(in_flight, vec![delivery("a", 1, Route::Remote, 150, 400)]).is_empty());
    }

    fn sched(op: ScheduleOp, inv: Ms, ans: Ms) -> ScheduleCall {
        ScheduleCall {
            id: "s".into(),
            op,
            inv,
            ans,
            ok: true,
            answer: String::new(),
        }
    }

    fn set(generation: u32, first: Ms, count: u32) -> ScheduleOp {
        ScheduleOp::Set {
            generation,
            first,
            count,
            interval: 100,
            route: Route::Local,
            catch_up: false,
        }
    }

    fn occurrence(generation: u32, read_at: Ms) -> Delivery {
        Delivery {
            route: Route::Local,
            payload: Payload::Occurrence {
                schedule: "s".into(),
                generation,
            },
            pushed_after: read_at - 5,
            read_at,
            index: 0,
            key: None,
        }
    }

    fn schedules(calls: Vec<ScheduleCall>, deliveries: Vec<Delivery>) -> Vec<Violation> {
        check(&History {
            schedule_calls: calls,
            deliveries,
            ..History::default()
        })
    }

    #[test]
    fn an_occurrence_fires_at_most_once_and_never_early() {
        let calls = || vec![sched(set(1, 1000, 2), 0, 10)];
        assert!(schedules(calls(), vec![occurrence(1, 1005), occurrence(1, 1102)]).is_empty());
        let twice = schedules(calls(), vec![occurrence(1, 1005), occurrence(1, 1010)]);
        assert_eq!(
            twice.len(),
            1,
            "two deliveries by 1010, one occurrence due by then"
        );
        assert!(
            twice[0].what.contains("only 1 occurrence"),
            "{}",
            twice[0].what
        );
        assert_eq!(
            schedules(calls(), vec![occurrence(1, 990)]).len(),
            1,
            "early"
        );
        // A re-set that read the clock before the occurrence and wrote after its delivery.
        let mut stale = calls();
        let mut reset = sched(set(1, 1000, 2), 990, 1020);
        reset.answer = "ScheduleSet { created: false, version: 2, next_ms: Some(1000) }".into();
        stale.push(reset);
        let twice = schedules(stale, vec![occurrence(1, 1005), occurrence(1, 1030)]);
        assert_eq!(twice.len(), 1);
        assert!(
            twice[0].detail.contains("leaving it pending"),
            "{}",
            twice[0].detail
        );
        assert_eq!(
            schedules(
                calls(),
                vec![
                    occurrence(1, 1005),
                    occurrence(1, 1105),
                    occurrence(1, 1205)
                ]
            )
            .len(),
            1,
            "three deliveries of a two-point window"
        );
    }

    #[test]
    fn nothing_fires_while_paused_or_after_a_delete() {
        let paused = vec![
            sched(set(1, 1000, 3), 0, 10),
            sched(ScheduleOp::Pause, 1050, 1060),
            sched(ScheduleOp::Resume, 1250, 1260),
        ];
        assert_eq!(
            schedules(
                paused.clone(),
                vec![occurrence(1, 1005), occurrence(1, 1110)]
            )
            .len(),
            1,
            "1100 fell in the pause"
        );
        assert!(schedules(paused, vec![occurrence(1, 1005)]).is_empty());
        let deleted = vec![
            sched(set(1, 1000, 3), 0, 10),
            sched(ScheduleOp::Delete, 1050, 1060),
        ];
        assert_eq!(
            schedules(deleted, vec![occurrence(1, 1005), occurrence(1, 1205)]).len(),
            1
        );
        let superseded = vec![
            sched(set(1, 1000, 3), 0, 10),
            sched(set(2, 2000, 1), 1050, 1060),
        ];
        assert_eq!(
            schedules(superseded, vec![occurrence(1, 1005), occurrence(1, 1205)]).len(),
            1,
            "generation 1's envelope was gone by 1060"
        );
    }

    #[test]
    fn an_untouched_catch_up_schedule_owes_its_occurrences() {
        let catch_up = ScheduleOp::Set {
            generation: 1,
            first: 1000,
            count: 2,
            interval: 100,
            route: Route::Local,
            catch_up: true,
        };
        let left_alone = || {
            vec![
                sched(catch_up.clone(), 0, 10),
                sched(ScheduleOp::Delete, 1100 + OWED_AFTER, 1100 + OWED_AFTER + 5),
            ]
        };
        assert!(schedules(left_alone(), vec![occurrence(1, 1005), occurrence(1, 1105)]).is_empty());
        let missing = schedules(left_alone(), vec![occurrence(1, 1005)]);
        assert_eq!(missing.len(), 1);
        assert!(
            missing[0].what.contains("[\"+1100\"]"),
            "{}",
            missing[0].what
        );
        assert!(
            missing[0].what.contains("never delivered"),
            "{}",
            missing[0].what
        );
        // Touched too soon after its second occurrence: only the first is owed.
        let touched = vec![
            sched(catch_up.clone(), 0, 10),
            sched(ScheduleOp::Pause, 1100 + OWED_AFTER - 1, 1100 + OWED_AFTER),
        ];
        assert!(schedules(touched.clone(), vec![occurrence(1, 1005)]).is_empty());
        assert_eq!(schedules(touched, vec![]).len(), 1);
        // Re-setting the same definition through its occurrences owes them all the same.
        let mut resets = left_alone();
        resets.insert(1, sched(resets[0].op.clone(), 995, 1010));
        let starved = schedules(resets, vec![]);
        assert_eq!(starved.len(), 1);
        assert!(starved[0].what.contains("1 re-sets"), "{}", starved[0].what);
    }

    #[test]
    fn two_phase_keys_name_a_due_the_job_had_and_repeat_unchanged() {
        let keyed = |key: &str, read_at: Ms| Delivery {
            key: Some(key.to_owned()),
            ..delivery("a", 1, Route::Nats, read_at - 2, read_at)
        };
        let calls = || vec![enqueue("a", 1, Route::Nats, 100, 0, 10, Answer::Added)];
        assert!(jobs(calls(), vec![keyed("a:100", 120), keyed("a:100", 3000)]).is_empty());
        let wrong_due = jobs(calls(), vec![keyed("a:90", 120)]);
        assert_eq!(wrong_due.len(), 1);
        assert!(
            wrong_due[0].detail.contains("never had"),
            "{}",
            wrong_due[0].detail
        );
        let changed = jobs(calls(), vec![keyed("a:100", 120), keyed("a:101", 3000)]);
        assert!(
            !changed.is_empty(),
            "a repeat under another key, no reschedule"
        );
        // A reschedule gives it a new due, and so a new key.
        let mut rescheduled = calls();
        rescheduled.push(call(
            "a",
            JobOp::Reschedule {
                due: DueSpec::At(500),
            },
            200,
            210,
            Answer::Rescheduled(500),
        ));
        assert!(jobs(rescheduled, vec![keyed("a:100", 120), keyed("a:500", 520)]).is_empty());
    }
}
