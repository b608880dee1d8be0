//! The actors of a history run: job producers and schedule drivers (library calls on tokio,
//! each stamped with Redis `TIME` before and after on the caller's own connection), list
//! consumers (threads that read the delivery lists without popping, so a Redis restart cannot
//! eat an item between a pop and its reply), and the fault injector (`kill -9`, `SIGSTOP`,
//! Redis restarts).
//!
//! Every random choice comes from a [`SeededRng`] derived from the run's seed, one per actor,
//! so a seed replays the same intentions; what the servers answer, and so the exact
//! interleaving, still varies from run to run.

use super::model::{
    Answer, Delivery, DueSpec, JobCall, JobOp, Ms, Payload, Policy, Route, ScheduleCall, ScheduleOp,
};
use crate::common::{Daemon, RedisServer, SeededRng, TestConfig};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use zdelay::schedule::Misfire;
use zdelay::schedules::{NewSchedule, Repeat};
use zdelay::store::{self, Conn};
use zdelay::{Cancelled, Client, ClientError, Due, Enqueued, NewJob, OnConflict};

/// The route names of the daemons' config and the lists they push to.
pub const LOCAL_ROUTE: &str = "hl";
pub const REMOTE_ROUTE: &str = "hr";
pub const NATS_ROUTE: &str = "hn";
pub const LOCAL_LIST: &str = "hq:local";
pub const REMOTE_LIST: &str = "hq:remote";

fn route_name(route: Route) -> &'static str {
    match route {
        Route::Local => LOCAL_ROUTE,
        Route::Remote => REMOTE_ROUTE,
        Route::Nats => NATS_ROUTE,
    }
}

/// Local wall clock in ms: the Redis servers run on this host, so it is their `TIME` too;
/// used only where Redis cannot be asked (fault log, while it restarts).
pub fn wall_ms() -> Ms {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as Ms
}

/// Redis `TIME` in ms on `con`; while Redis is down (a restart) it asks again until it
/// answers. Sent after a call's answer arrived (or before the call), so it bounds the call's
/// effect from above (or below).
async fn stamp(con: &mut Conn) -> Ms {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match store::server_time_ms(con).await {
            Ok(t) => return t,
            Err(e) => {
                assert!(Instant::now() < deadline, "redis TIME failed for 60 s: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

fn failed(e: ClientError) -> Answer {
    match e {
        ClientError::Exists(_) => Answer::Exists,
        e => Answer::Failed(e.to_string()),
    }
}

// ---- Job producers -------------------------------------------------------------------------

/// Calls on one id before the producer leaves it alone (keeps each id's history short).
const MAX_CALLS_PER_ID: u32 = 10;
/// Ids a producer keeps working on at once.
const LIVE_IDS: usize = 150;

struct Tracked {
    id: String,
    /// The route every incarnation of the id takes: on storage layout 2 a user's id is
    /// unique per route (the same id on another route is another job), so an id the model
    /// follows as one job keeps one route.
    route: Route,
    /// The due time its last answered write or reschedule gave it (for racing the mover).
    due: Ms,
    calls: u32,
}

pub struct Producer {
    index: usize,
    /// The two-phase routes jobs may take besides the local one.
    two_phase: Vec<Route>,
    rng: SeededRng,
    client: Client,
    con: Conn,
    live: Vec<Tracked>,
    next_id: u64,
    next_nonce: u64,
    now: Ms,
    calls: Vec<JobCall>,
}

impl Producer {
    pub fn new(index: usize, seed: u64, client: Client, two_phase: Vec<Route>) -> Self {
        let con = client.connection();
        Producer {
            index,
            two_phase,
            rng: SeededRng::new(seed),
            client,
            con,
            live: Vec::new(),
            next_id: 0,
            next_nonce: 0,
            now: wall_ms(),
            calls: Vec::new(),
        }
    }

    fn percent(&mut self) -> i64 {
        self.rng.range(0, 100)
    }

    /// A due time around now: mostly soon (racing the mover), sometimes already past.
    fn due(&mut self) -> DueSpec {
        if self.percent() < 70 {
            let at = self.now + self.rng.range(-300, 2_500);
            DueSpec::At(at)
        } else {
            DueSpec::In(self.rng.range(0, 2_500))
        }
    }

    fn route(&mut self) -> Route {
        if self.percent() < 60 {
            Route::Local
        } else {
            let pick = self.rng.range(0, self.two_phase.len() as i64) as usize;
            self.two_phase[pick]
        }
    }

    /// An id to work on: half the time the one due nearest to now (a race with the daemons).
    fn pick(&mut self) -> Option<usize> {
        if self.live.is_empty() {
            return None;
        }
        if self.percent() < 50 {
            let now = self.now;
            (0..self.live.len()).min_by_key(|&i| (self.live[i].due - now).abs())
        } else {
            Some(self.rng.range(0, self.live.len() as i64) as usize)
        }
    }

    /// Runs random calls until `deadline`; returns every call made.
    pub async fn run(mut self, deadline: Instant) -> Vec<JobCall> {
        while Instant::now() < deadline {
            let roll = self.percent();
            let picked = if roll < 30 { None } else { self.pick() };
            match (roll, picked) {
                (_, None) => {
                    let id = format!("p{}-{}", self.index, self.next_id);
                    self.next_id += 1;
                    let policy = match self.percent() {
                        0..60 => Policy::Replace,
                        60..80 => Policy::Keep,
                        _ => Policy::Error,
                    };
                    let (route, due) = (self.route(), self.due());
                    self.live.push(Tracked {
                        id: id.clone(),
                        route,
                        due: self.now,
                        calls: 0,
                    });
                    if self.live.len() > LIVE_IDS {
                        self.live.remove(0);
                    }
                    let at = self.live.len() - 1;
                    self.enqueue(at, route, due, policy).await;
                }
                (30..55, Some(i)) => {
                    // A new incarnation, which may replace one due now or (two-phase) in
                    // flight.
                    let (route, due) = (self.live[i].route, self.due());
                    self.enqueue(i, route, due, Policy::Replace).await;
                }
                (55..65, Some(i)) => {
                    let policy = if self.percent() < 50 {
                        Policy::Keep
                    } else {
                        Policy::Error
                    };
                    let (route, due) = (self.live[i].route, self.due());
                    self.enqueue(i, route, due, policy).await;
                }
                (65..82, Some(i)) => self.call(i, JobOp::Cancel).await,
                (_, Some(i)) => {
                    let due = self.due();
                    self.call(i, JobOp::Reschedule { due }).await;
                }
            }
            let pause = self.rng.range(0, 15) as u64;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        self.calls
    }

    async fn enqueue(&mut self, at: usize, route: Route, due: DueSpec, policy: Policy) {
        self.next_nonce += 1;
        let op = JobOp::Enqueue {
            nonce: self.next_nonce,
            route,
            due,
            policy,
        };
        self.call(at, op).await;
    }

    /// One call on the id at `live[at]`, stamped and recorded.
    async fn call(&mut self, at: usize, op: JobOp) {
        let id = self.live[at].id.clone();
        let inv = stamp(&mut self.con).await;
        let answer = match &op {
            JobOp::Enqueue {
                nonce,
                route,
                due,
                policy,
            } => {
                let job = NewJob::new(route_name(*route), Payload::job(&id, *nonce)).id(&id);
                let job = match *due {
                    DueSpec::At(ms) => job.at(ms),
                    DueSpec::In(ms) => job.after(Duration::from_millis(ms as u64)),
                };
                let policy = match policy {
                    Policy::Replace => OnConflict::Replace,
                    Policy::Keep => OnConflict::Keep,
                    Policy::Error => OnConflict::Error,
                };
                match self.client.enqueue(job, policy).await {
                    Ok((_, Enqueued::Added)) => Answer::Added,
                    Ok((_, Enqueued::Replaced)) => Answer::Replaced,
                    Ok((_, Enqueued::Kept)) => Answer::Kept,
                    Ok((_, Enqueued::Duplicate)) => {
                        unreachable!("these histories enqueue without a unique window")
                    }
                    Err(e) => failed(e),
                }
            }
            JobOp::Cancel => match self.client.cancel(&id).await {
                Ok(Cancelled::Cancelled) => Answer::Cancelled,
                Ok(Cancelled::NotPending) => Answer::NotPending,
                Ok(Cancelled::InFlight) => Answer::InFlight,
                Err(e) => failed(e),
            },
            JobOp::Reschedule { due } => {
                let due = match *due {
                    DueSpec::At(ms) => Due::At(ms),
                    DueSpec::In(ms) => Due::In(Duration::from_millis(ms as u64)),
                };
                match self.client.reschedule(&id, due).await {
                    Ok(Some(to)) => Answer::Rescheduled(to),
                    Ok(None) => Answer::NotPending,
                    Err(e) => failed(e),
                }
            }
        };
        let ans = stamp(&mut self.con).await;
        self.now = ans;
        let tracked = &mut self.live[at];
        tracked.calls += 1;
        match (&op, &answer) {
            (JobOp::Enqueue { due, .. }, Answer::Added | Answer::Replaced) => {
                tracked.due = match *due {
                    DueSpec::At(ms) => ms,
                    DueSpec::In(ms) => ans + ms,
                }
            }
            (_, Answer::Rescheduled(to)) => tracked.due = *to,
            _ => {}
        }
        // After an indeterminate call the id's state is unknown until the end: leave it.
        if matches!(answer, Answer::Failed(_)) || tracked.calls >= MAX_CALLS_PER_ID {
            self.live.remove(at);
        }
        self.calls.push(JobCall {
            id,
            op,
            inv,
            ans,
            answer,
        });
    }
}

// ---- Schedule drivers ----------------------------------------------------------------------

/// One schedule's grid: every `interval` ms from `anchor`.
#[derive(Clone, Copy)]
pub struct Grid {
    pub anchor: Ms,
    pub interval: Ms,
}

/// A generation: its window on the grid and misfire policy (the same definition each time
/// it is set again).
#[derive(Clone, Copy)]
struct Window {
    generation: u32,
    first: Ms,
    count: u32,
    misfire: Misfire,
}

pub struct ScheduleDriver {
    id: String,
    route: Route,
    grid: Grid,
    rng: SeededRng,
    client: Client,
    con: Conn,
    current: Option<Window>,
    next_generation: u32,
    now: Ms,
    /// Only sets catch-up windows and leaves each alone for a while (its occurrences are
    /// owed), instead of the random calls.
    quiet: bool,
}

impl ScheduleDriver {
    pub fn new(id: &str, route: Route, grid: Grid, seed: u64, client: Client, quiet: bool) -> Self {
        let con = client.connection();
        ScheduleDriver {
            id: id.to_owned(),
            route,
            grid,
            rng: SeededRng::new(seed),
            client,
            con,
            current: None,
            next_generation: 1,
            now: wall_ms(),
            quiet,
        }
    }

    /// Random set / re-set (one, or a tight loop through the window) / pause / resume /
    /// delete until `deadline`, then a delete that must be answered.
    pub async fn run(mut self, deadline: Instant) -> Vec<ScheduleCall> {
        let mut calls = Vec::new();
        while Instant::now() < deadline {
            self.now = stamp(&mut self.con).await;
            if self.quiet {
                let mut window = self.new_window();
                window.misfire = Misfire::CatchUp { max: 10 };
                calls.push(self.set(window).await);
                let last = window.first + (window.count as Ms - 1) * self.grid.interval;
                if self.rng.range(0, 2) == 0 {
                    // The same definition re-applied through its occurrences: nothing changes,
                    // so they are owed all the same.
                    calls.extend(self.reapply_until(window, last + 300).await);
                }
                let now = stamp(&mut self.con).await;
                // Long enough, often, for its occurrences to be owed (model::OWED_AFTER).
                let idle = (last - now).max(0) + self.rng.range(1_000, 16_000);
                tokio::time::sleep(Duration::from_millis(idle as u64)).await;
                continue;
            }
            let roll = self.rng.range(0, 100);
            match (roll, self.current) {
                (0..50, _) | (_, None) => {
                    let window = self.new_window();
                    self.current = Some(window);
                    calls.push(self.set(window).await);
                    let end = window.first + window.count as Ms * self.grid.interval + 300;
                    match self.rng.range(0, 100) {
                        // Re-applying the unchanged definition in a tight loop through its
                        // occurrences, once or from two tasks at once.
                        0..40 => calls.extend(self.reapply_until(window, end).await),
                        40..60 => {
                            let (a, b) = futures::join!(
                                self.reapply_until(window, end),
                                self.reapply_until(window, end)
                            );
                            calls.extend(a);
                            calls.extend(b);
                        }
                        _ => {}
                    }
                }
                (50..65, Some(window)) => calls.push(self.set(window).await),
                (65..75, _) => calls.push(self.simple(ScheduleOp::Pause).await),
                (75..85, _) => calls.push(self.simple(ScheduleOp::Resume).await),
                (85..92, _) => calls.push(self.simple(ScheduleOp::Delete).await),
                _ => {}
            }
            let pause = self.rng.range(50, 400) as u64;
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        // Nothing of it may be left stored at the end.
        loop {
            let call = self.simple(ScheduleOp::Delete).await;
            let done = call.ok;
            calls.push(call);
            if done {
                break;
            }
        }
        calls
    }

    fn new_window(&mut self) -> Window {
        let Grid { anchor, interval } = self.grid;
        let from = self.now + self.rng.range(200, 1_200);
        let first = anchor + (from - anchor + interval - 1).div_euclid(interval) * interval;
        let generation = self.next_generation;
        self.next_generation += 1;
        let misfire = match self.rng.range(0, 3) {
            0 => Misfire::Coalesce,
            1 => Misfire::Skip,
            _ => Misfire::CatchUp { max: 10 },
        };
        Window {
            generation,
            first,
            count: self.rng.range(1, 4) as u32,
            misfire,
        }
    }

    async fn reapply_until(&self, window: Window, end: Ms) -> Vec<ScheduleCall> {
        let mut calls = Vec::new();
        loop {
            let call = self.set(window).await;
            let ans = call.ans;
            calls.push(call);
            if ans >= end {
                return calls;
            }
        }
    }

    async fn set(&self, w: Window) -> ScheduleCall {
        let interval = self.grid.interval;
        let mut spec = NewSchedule::new(
            &self.id,
            route_name(self.route),
            Payload::occurrence(&self.id, w.generation),
            Repeat::Every(Duration::from_millis(interval as u64)),
        );
        spec.start_at = Some(w.first);
        spec.end_at = Some(w.first + w.count as Ms * interval);
        spec.misfire = w.misfire;
        let op = ScheduleOp::Set {
            generation: w.generation,
            first: w.first,
            count: w.count,
            interval,
            route: self.route,
            catch_up: matches!(w.misfire, Misfire::CatchUp { .. }),
        };
        let mut con = self.con.clone();
        let inv = stamp(&mut con).await;
        let result = self.client.schedule_set(spec).await;
        let ans = stamp(&mut con).await;
        ScheduleCall {
            id: self.id.clone(),
            op,
            inv,
            ans,
            ok: result.is_ok(),
            answer: match result {
                Ok(set) => format!("{set:?}"),
                Err(e) => e.to_string(),
            },
        }
    }

    async fn simple(&mut self, op: ScheduleOp) -> ScheduleCall {
        let inv = stamp(&mut self.con).await;
        let id = self.id.as_str();
        let result: Result<String, ClientError> = match op {
            ScheduleOp::Pause => self.client.schedule_pause(id).await.map(|r| format!("{r}")),
            ScheduleOp::Resume => self
                .client
                .schedule_resume(id)
                .await
                .map(|r| format!("{r:?}")),
            ScheduleOp::Delete => self
                .client
                .schedule_delete(id)
                .await
                .map(|r| format!("{r}")),
            ScheduleOp::Set { .. } => unreachable!("sets go through ScheduleDriver::set"),
        };
        let ans = stamp(&mut self.con).await;
        self.now = ans;
        ScheduleCall {
            id: self.id.clone(),
            op,
            inv,
            ans,
            ok: result.is_ok(),
            answer: result.unwrap_or_else(|e| e.to_string()),
        }
    }
}

// ---- Consumers -----------------------------------------------------------------------------

/// Items read per call.
const READ_BATCH: usize = 500;
/// Read items kept in a list before the consumer trims them (long runs).
const TRIM_AFTER: u64 = 20_000;

/// Reads `count` items from absolute position `from` (the list's head was trimmed by
/// `KEYS[2]` items so far) and the server's time, in one step.
const READ_LUA: &str = r#"
local trimmed = tonumber(redis.call('GET', KEYS[2]) or '0')
local from = tonumber(ARGV[1]) - trimmed
local items = redis.call('LRANGE', KEYS[1], from, from + tonumber(ARGV[2]) - 1)
local t = redis.call('TIME')
return { tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), items }
"#;

/// Drops the items before absolute position `ARGV[1]`; safe to re-run (a lost reply).
const TRIM_LUA: &str = r#"
local trimmed = tonumber(redis.call('GET', KEYS[2]) or '0')
local n = tonumber(ARGV[1]) - trimmed
if n > 0 then
  redis.call('LTRIM', KEYS[1], n, -1)
  redis.call('SET', KEYS[2], ARGV[1])
end
return n
"#;

/// A thread reading one delivery list from its start, recording each item with the window
/// in which it was pushed.
pub struct Consumer {
    thread: std::thread::JoinHandle<Vec<Delivery>>,
    /// The server time of the last read that reached the list's end.
    caught_up: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
}

impl Consumer {
    pub fn start(port: u16, list: &'static str, route: Route) -> Self {
        let caught_up = Arc::new(AtomicI64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen, stopping) = (caught_up.clone(), stop.clone());
        let thread = std::thread::spawn(move || read_list(port, list, route, &seen, &stopping));
        Consumer {
            thread,
            caught_up,
            stop,
        }
    }

    /// The server time of its last read that reached the list's end.
    pub fn caught_up(&self) -> Ms {
        self.caught_up.load(Ordering::SeqCst)
    }

    pub fn finish(self) -> Vec<Delivery> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("consumer thread")
    }
}

fn read_list(
    port: u16,
    list: &str,
    route: Route,
    caught_up: &AtomicI64,
    stop: &AtomicBool,
) -> Vec<Delivery> {
    let trim_key = format!("{list}:trimmed");
    let read = redis::Script::new(READ_LUA);
    let trim = redis::Script::new(TRIM_LUA);
    let url = format!("redis://127.0.0.1:{port}");
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    let mut trimmed: u64 = 0;
    // Every item not yet read was pushed after the last read that reached the end.
    let mut pushed_after: Ms = 0;
    let mut con: Option<redis::Connection> = None;
    while !stop.load(Ordering::SeqCst) {
        let Some(c) = con.as_mut() else {
            con = redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
                .ok();
            if con.is_none() {
                // The server restarts: ask again shortly.
                std::thread::sleep(Duration::from_millis(20));
            }
            continue;
        };
        let answer: redis::RedisResult<(Ms, Vec<Vec<u8>>)> = read
            .key(list)
            .key(&trim_key)
            .arg(cursor)
            .arg(READ_BATCH)
            .invoke(c);
        let (now, items) = match answer {
            Ok(answer) => answer,
            Err(_) => {
                con = None;
                continue;
            }
        };
        let reached_end = items.len() < READ_BATCH;
        for payload in items {
            out.push(Delivery {
                route,
                payload: Payload::parse(&payload),
                pushed_after,
                read_at: now,
                index: cursor,
                key: None,
            });
            cursor += 1;
        }
        if cursor - trimmed >= TRIM_AFTER
            && trim
                .key(list)
                .key(&trim_key)
                .arg(cursor)
                .invoke::<i64>(c)
                .is_ok()
        {
            trimmed = cursor;
        }
        if reached_end {
            pushed_after = now;
            caught_up.store(now, Ordering::SeqCst);
            // Polling at a few ms keeps each push's window short.
            std::thread::sleep(Duration::from_millis(3));
        }
    }
    out
}

/// Every message of a JetStream stream, in order, each with the time the server stored it
/// (this host's clock, like Redis `TIME`) and its `zdelay-id`.
pub async fn read_stream(js: &async_nats::jetstream::Context, name: &str) -> Vec<Delivery> {
    let mut stream = js.get_stream(name).await.expect("the stream");
    let state = stream.info().await.expect("stream info").state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        let m = stream.get_raw_message(seq).await.expect("a stored message");
        let stored = (m.time.unix_timestamp_nanos() / 1_000_000) as Ms;
        out.push(Delivery {
            route: Route::Nats,
            payload: Payload::parse(&m.payload),
            // The stored time is whole ms on the server's clock.
            pushed_after: stored - 1,
            read_at: stored + 1,
            index: seq,
            key: m.headers.get("zdelay-id").map(|v| v.as_str().to_owned()),
        });
    }
    out
}

// ---- Faults --------------------------------------------------------------------------------

/// The processes a run owns: the daemons (running, stopped or killed and due back), the
/// scheduling Redis and the remote one. Killed daemons are kept (their logs) until the end.
pub struct Fleet {
    pub config: TestConfig,
    pub redis: RedisServer,
    pub remote: RedisServer,
    slots: Vec<Slot>,
    pub retired: Vec<Daemon>,
    /// Daemons that exited by themselves: when, and what (with their log's end).
    pub deaths: Vec<(Ms, String)>,
}

struct Slot {
    daemon: Option<Daemon>,
    stopped: bool,
    /// When it is started again (killed) or continued (stopped).
    back_at: Option<Instant>,
}

impl Fleet {
    pub fn new(
        config: TestConfig,
        redis: RedisServer,
        remote: RedisServer,
        daemons: usize,
    ) -> Self {
        let slots = (0..daemons)
            .map(|_| Slot {
                daemon: Some(Daemon::start_instance(&config)),
                stopped: false,
                back_at: None,
            })
            .collect();
        Fleet {
            config,
            redis,
            remote,
            slots,
            retired: Vec::new(),
            deaths: Vec::new(),
        }
    }

    /// Every daemon's log, killed ones included, for a failure report.
    pub fn logs(&self) -> Vec<(String, String)> {
        let live = self.slots.iter().filter_map(|s| s.daemon.as_ref());
        self.retired
            .iter()
            .chain(live)
            .enumerate()
            .map(|(i, d)| (format!("daemon-{i}.log"), d.log_text()))
            .collect()
    }

    fn bring_back(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        slot.back_at = None;
        if slot.stopped {
            if let Some(d) = &slot.daemon {
                d.signal(libc::SIGCONT);
            }
            slot.stopped = false;
        }
        if slot.daemon.is_none() {
            slot.daemon = Some(Daemon::spawn_instance(&self.config));
        }
    }

    /// Injects random faults until `deadline`, logging each with the time; then brings
    /// every daemon back (continued, or started again).
    pub fn run_faults(&mut self, seed: u64, deadline: Instant, log: &Mutex<Vec<(Ms, String)>>) {
        let mut rng = SeededRng::new(seed);
        let mut next_fault = Instant::now() + Duration::from_millis(rng.range(500, 2_000) as u64);
        let note = |what: String| {
            eprintln!("history: fault at {}: {what}", wall_ms());
            log.lock().expect("fault log").push((wall_ms(), what));
        };
        while Instant::now() < deadline {
            let now = Instant::now();
            self.reap_deaths(&note);
            for i in 0..self.slots.len() {
                if self.slots[i].back_at.is_some_and(|at| at <= now) {
                    let what = if self.slots[i].stopped {
                        "SIGCONT"
                    } else {
                        "restarted"
                    };
                    self.bring_back(i);
                    note(format!("daemon {i} {what}"));
                }
            }
            if now >= next_fault {
                let pick = rng.range(0, self.slots.len() as i64) as usize;
                let free = self.slots[pick].back_at.is_none();
                match rng.range(0, 100) {
                    0..35 if free => {
                        let back = rng.range(200, 3_000);
                        let slot = &mut self.slots[pick];
                        if let Some(mut d) = slot.daemon.take() {
                            d.kill9();
                            self.retired.push(d);
                        }
                        slot.back_at = Some(now + Duration::from_millis(back as u64));
                        note(format!("daemon {pick} kill -9, back in {back} ms"));
                    }
                    35..65 if free => {
                        // Up to past the 3 s claim lease: its claims are taken over and its
                        // late settles fenced.
                        let back = rng.range(200, 4_500);
                        let slot = &mut self.slots[pick];
                        if let Some(d) = &slot.daemon {
                            d.signal(libc::SIGSTOP);
                            slot.stopped = true;
                        }
                        slot.back_at = Some(now + Duration::from_millis(back as u64));
                        note(format!("daemon {pick} SIGSTOP for {back} ms"));
                    }
                    65..85 => {
                        note("scheduling redis kill -9 and restart".to_owned());
                        self.redis.restart();
                        note("scheduling redis back".to_owned());
                    }
                    85..100 => {
                        note("remote redis kill -9 and restart".to_owned());
                        self.remote.restart();
                        note("remote redis back".to_owned());
                    }
                    _ => {}
                }
                next_fault = Instant::now() + Duration::from_millis(rng.range(800, 3_500) as u64);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for i in 0..self.slots.len() {
            if self.slots[i].back_at.is_some() {
                self.bring_back(i);
                note(format!("daemon {i} back for the drain"));
            }
        }
    }

    /// A daemon that exited although nobody killed it is a finding: recorded with its exit
    /// status and log, and started again so the run goes on with its fleet.
    fn reap_deaths(&mut self, note: &impl Fn(String)) {
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let Some(status) = slot.daemon.as_mut().and_then(Daemon::try_exit) else {
                continue;
            };
            let dead = slot.daemon.take().expect("it was running");
            let log = dead.log_text();
            let tail: Vec<&str> = log.lines().rev().take(12).collect();
            let what = format!("daemon {i} exited by itself ({status})");
            note(what.clone());
            self.deaths.push((
                wall_ms(),
                format!(
                    "{what}; its log's last lines:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ),
            ));
            self.retired.push(dead);
            slot.stopped = false;
            slot.back_at = None;
            slot.daemon = Some(Daemon::spawn_instance(&self.config));
        }
    }

    /// Daemons not ready `within` the end of the faults (exited ones included): their
    /// `/readyz` answer and log tail.
    pub fn unready(&mut self, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        self.reap_deaths(&|_| {});
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(d) = &slot.daemon else { continue };
            let ready = || matches!(d.admin_get("/readyz"), Some((200, _)));
            while !ready() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !ready() {
                let log = d.log_text();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                out.push(format!(
                    "daemon {i} (pid {}) /readyz {:?}; its log's last lines:\n{}",
                    d.pid(),
                    d.admin_get("/readyz"),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
        }
        out
    }
}
