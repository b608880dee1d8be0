//! The move loop of one target (a spread shard, a route lane or a raw source).
//!
//! Each turn runs one move script (`move_due` for a shard, `move_lane` for a lane,
//! `move_raw` for a raw source), which reads "now" from Redis `TIME` on every call, takes up
//! to `batch` due jobs (onto their lists; a shard's claimed at once for this daemon's
//! publishers that have room, see `takes`, the rest queued for their sinks' publishers, which
//! it then wakes), and returns the new head's score. After a full batch the loop goes again
//! at once; otherwise it sleeps until the head is due (measured against Redis's clock, so the
//! poller's own clock does not matter), a wake-up arrives (an enqueue that made a new head),
//! the idle-poll fallback elapses, or it is stopped. A script call in progress always
//! finishes: it is atomic, and stopping is only checked between calls. A shard's mover waits
//! for a broker only while a sink without room holds up its batch, for at most
//! `takes::PARK_AFTER`.
//!
//! A shard's mover also keeps its ready set routed by the config in force: at start and
//! every [`LOOK_EVERY`] it lists the sinks jobs wait for there (`ready_sinks`), and walks the
//! part of each sink that is not configured (removed, renamed) or is paused (it claims
//! nothing, so none of its jobs is handed over at publish), a batch per `move_due` call:
//! each job goes where its route leads now (see `move_due.lua`).
//!
//! Errors never end the loop: they are logged, counted, and retried with capped backoff.

use super::context::{BatchObserver, PollerContext, RawDelivery, Target, TargetId};
use super::takes::{self, Takes};
use super::wake::Waker;
use crate::metrics::{
    self, BATCH_SIZE, JOBS_DEAD, JOBS_MOVED, JOBS_REROUTED, LEASES_EXPIRED, OCCURRENCES,
    SCRIPT_DURATION,
};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zdelay_core::config::ScoreUnit;
use zdelay_core::lane::Lane;
use zdelay_core::routes::Routes;
use zdelay_core::schedules::{self, DirectPush, SchedAt, ScheduleCache};
use zdelay_core::store::scripts::{
    self, DUE_DEAD_KINDS, Held, MoveDue, MoveLane, MoveRaw, MoveReply, RAW_DEAD_KINDS, Take,
};
use zdelay_core::store::{StoreError, lanes};

/// How often a shard's mover looks for sinks in its ready set to walk.
pub const LOOK_EVERY: Duration = Duration::from_secs(10);

/// Runs one move script call. `now_ms` overrides Redis TIME (tests drive time with it).
pub async fn move_once(
    ctx: &PollerContext,
    target: &Target,
    now_ms: Option<i64>,
) -> redis::RedisResult<MoveReply> {
    move_walking(ctx, target, now_ms, None).await
}

/// [`move_once`], walking a batch of `walk`'s sink's part of a shard's ready set first (from
/// the member given, exclusive; "" = its start).
pub async fn move_walking(
    ctx: &PollerContext,
    target: &Target,
    now_ms: Option<i64>,
    walk: Option<(&str, &str)>,
) -> redis::RedisResult<MoveReply> {
    move_taking(ctx, target, now_ms, walk, &[]).await
}

/// [`move_walking`], a shard's jobs claimed at once for the parts of its ready set as `takes`
/// says (the others queued there).
async fn move_taking(
    ctx: &PollerContext,
    target: &Target,
    now_ms: Option<i64>,
    walk: Option<(&str, &str)>,
    takes: &[Take],
) -> redis::RedisResult<MoveReply> {
    let mut con = ctx.con_for(&target.id());
    let m = &ctx.mover;
    match target {
        Target::Shard(shard) => {
            let args = MoveDue {
                batch: m.batch,
                now_ms,
                max_payload: m.max_payload,
                batch_bytes: m.batch_bytes,
                routes: &ctx.routes,
                walk,
                takes,
                lease_ms: ctx.delivery.lease.as_millis() as u64,
            };
            scripts::move_due(&mut con, &ctx.keys.shard(*shard), &args).await
        }
        Target::Source(source) => {
            let RawDelivery::List { list, push } = &source.delivery else {
                // The supervisor runs a publisher, not a mover, for a two-phase source.
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "a raw source of a two-phase route has no mover",
                )));
            };
            let args = MoveRaw {
                batch: m.batch,
                now_ms,
                unit: source.unit,
                max_payload: m.max_payload,
                batch_bytes: m.batch_bytes,
                list,
                push: *push,
                bounds_ms: &m.bounds_ms,
            };
            scripts::move_raw(&mut con, &source.keys, &args).await
        }
        Target::Lane(lane) => {
            let args = MoveLane {
                batch: m.batch,
                now_ms,
                max_payload: m.max_payload,
                batch_bytes: m.batch_bytes,
                bounds_ms: &m.bounds_ms,
                flow: m.flows.get(&lane.route),
                trim: m.trims.get(&lane.route),
            };
            scripts::move_lane(&mut con, lane, &args).await
        }
    }
}

/// When the shard's or lane's schedules fire next: `fire_ahead_ms` before their next
/// occurrence.
fn schedule_fire_ms(reply: &MoveReply, fire_ahead_ms: u64) -> Option<i64> {
    reply
        .next_schedule_ms
        .map(|at| at.saturating_sub(fire_ahead_ms as i64))
}

/// How long to sleep after a batch that was not full: until the head, the shard's next
/// schedule firing (`fire_ahead_ms` before its occurrence) or its earliest lease deadline is
/// due, at most `idle`. The times come from Redis, so local clock skew does not matter.
pub fn sleep_after(
    reply: &MoveReply,
    unit: ScoreUnit,
    idle: Duration,
    fire_ahead_ms: u64,
) -> Duration {
    let until = |ms: f64| {
        let wait_us = ms * 1000.0 - reply.now_us as f64;
        if wait_us <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_micros(wait_us.ceil() as u64)
        }
    };
    let head = reply.next_due.map(|score| until(unit.to_ms(score)));
    let schedule = schedule_fire_ms(reply, fire_ahead_ms).map(|ms| until(ms as f64));
    let lease = reply.next_lease_ms.map(|ms| until(ms as f64));
    [head, schedule, lease]
        .into_iter()
        .flatten()
        .fold(idle, Duration::min)
}

/// `lane` as the registry has it now, after the lane refused a move: the same lane with the
/// list or push command another daemon registered (same slot, so the same keys), or `None`
/// when the registry gives the route another lane or none (this one is retired).
async fn reread_lane(ctx: &PollerContext, lane: &Lane) -> Result<Option<Arc<Lane>>, StoreError> {
    let mut con = ctx.con.clone();
    let registry = lanes::read_registry(&mut con, &ctx.keys).await?;
    Ok(registry
        .by_route
        .get(&lane.route)
        .filter(|now| now.number == lane.number && now.keys == lane.keys)
        .map(|now| Arc::new(now.clone())))
}

/// What firing a shard's due schedules leaves to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FireOutcome {
    /// New jobs to move, or more due than one call fires: go again at once.
    More,
    /// Nothing else is due now.
    Done,
    /// Every due schedule was fenced (changed under the call): back off instead of trying
    /// again at once, so a schedule that keeps being fenced cannot make the loop hot.
    Stalled,
}

impl FireOutcome {
    fn of(report: &schedules::FireReport) -> Self {
        if report.fired.created > 0 || report.more {
            FireOutcome::More
        } else if report.stalled() {
            FireOutcome::Stalled
        } else {
            FireOutcome::Done
        }
    }
}

/// Fires the due schedules of a shard or a route lane (one bounded script call); a raw
/// source has none. A lane without flow control pushes the occurrences due now straight onto
/// its list: those are recorded as a move (returned as its reply, for the batch observer).
async fn fire_schedules(
    ctx: &PollerContext,
    target: &Target,
    cache: &mut ScheduleCache,
    label: &str,
) -> redis::RedisResult<(FireOutcome, Option<MoveReply>)> {
    let mut con = ctx.con_for(&target.id());
    let m = &ctx.mover;
    let report = match target {
        Target::Shard(shard) => {
            let keys = ctx.keys.shard(*shard);
            let at = SchedAt::Shard(&keys);
            schedules::fire_due(&mut con, at, None, m.fire_ahead_ms, cache, None).await?
        }
        Target::Lane(lane) => {
            let wake_channel = ctx.keys.wake_channel();
            let at = SchedAt::Lane {
                lane,
                wake_channel: &wake_channel,
            };
            // A held route's move decides when its jobs go: they wait as jobs.
            let direct = (!m.flows.contains_key(&lane.route)).then_some(DirectPush {
                push: lane.push,
                now_ms: None,
                max_payload: m.max_payload,
                bounds_ms: &m.bounds_ms,
            });
            schedules::fire_due(&mut con, at, None, m.fire_ahead_ms, cache, direct).await?
        }
        Target::Source(_) => return Ok((FireOutcome::Done, None)),
    };
    let fired = &report.fired;
    for (outcome, n) in [
        ("fired", fired.created + fired.pushed),
        ("expired", fired.expired),
        ("missed", fired.missed),
        ("skipped_by_calendar", fired.skipped_by_calendar),
    ] {
        if n > 0 {
            ::metrics::counter!(OCCURRENCES, "outcome" => outcome).increment(n);
        }
    }
    // Taken off their timeline (the definition stays for an operator): reported once.
    for (id, reason) in &fired.quarantined {
        metrics::schedule_quarantined(label, id, reason);
    }
    let pushed = (fired.pushed > 0).then(|| MoveReply {
        taken: fired.pushed as usize,
        now_us: fired.pushed_now_ms.saturating_mul(1000),
        moved: vec![fired.pushed],
        buckets: fired.pushed_buckets.clone(),
        max_lateness_ms: fired.pushed_max_lateness_ms,
        ..MoveReply::default()
    });
    Ok((FireOutcome::of(&report), pushed))
}

/// The walks of one shard's ready set: which sinks' parts to walk, and where each stands.
#[derive(Default)]
struct Walks {
    /// (sink, the member the walk resumes after; "" = the part's start), first one walking.
    pending: VecDeque<(String, String)>,
    /// Configured sinks walked during their current pause: walked again only once they have
    /// resumed and paused again, so a long outage costs one walk, not one per look.
    walked_paused: HashSet<String>,
    next_look: Option<Instant>,
}

impl Walks {
    /// Lists the sinks jobs wait for in `shard`'s ready set when a look is due, and queues a
    /// walk of each one not configured and of each paused one not walked in this pause.
    async fn look(&mut self, ctx: &PollerContext, shard: u16) -> redis::RedisResult<()> {
        if self.next_look.is_some_and(|at| Instant::now() < at) {
            return Ok(());
        }
        self.next_look = Some(Instant::now() + LOOK_EVERY);
        let mut con = ctx.con_for(&TargetId::Shard(shard));
        let found = scripts::ready_sinks(&mut con, &ctx.keys.shard(shard)).await?;
        for waiting in found {
            let sink = waiting.sink;
            let configured = ctx.routes.ready_parts().any(|s| s == sink);
            let walk = match ctx.sinks.get(Routes::sink_of_part(&sink)) {
                _ if !configured => true,
                Some(handle) if handle.is_paused() => self.walked_paused.insert(sink.clone()),
                Some(_) => {
                    self.walked_paused.remove(&sink);
                    false
                }
                // Configured, but another daemon's to publish (no handle here).
                None => false,
            };
            if walk && !self.pending.iter().any(|(s, _)| *s == sink) {
                // A paused sink's walk is routine during its outage, which the sink's
                // episode already logs; a sink gone from the config is news.
                if configured {
                    tracing::debug!(shard, sink = %sink, jobs = waiting.jobs,
                        "refiling the jobs waiting for a paused sink by their route now");
                } else {
                    tracing::info!(
                        shard,
                        sink = %sink,
                        jobs = waiting.jobs,
                        "refiling the jobs waiting for a sink by their route now"
                    );
                }
                self.pending.push_back((sink, String::new()));
            }
        }
        Ok(())
    }

    /// The walk the next `move_due` call takes a batch of.
    fn next(&self) -> Option<(&str, &str)> {
        self.pending
            .front()
            .map(|(sink, from)| (sink.as_str(), from.as_str()))
    }

    /// A batch of the current walk was done: it resumes at `next`, or ends.
    fn advance(&mut self, next: Option<String>) {
        match (next, self.pending.front_mut()) {
            (Some(next), Some(walk)) => walk.1 = next,
            _ => {
                self.pending.pop_front();
            }
        }
    }
}

/// Capped exponential backoff for errors. The cap is low so that work resumes within about
/// half a second of Redis answering normally again (after BUSY, LOADING, OOM or a lost
/// connection), at the cost of a few cheap failing calls per second while it does not.
pub(super) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_millis(500);

    pub(super) fn new() -> Self {
        Backoff { next: Self::FIRST }
    }
    pub(super) fn step(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        now
    }
    pub(super) fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// Tells the other daemons' publishers of a shard that its mover queued jobs for them
/// (`queued`, in `ctx.sink_order`): while two daemons poll the shard, either's publisher may be
/// the one to claim them. Sent on the side; a lost message costs an idle poll.
fn announce_queued(ctx: &Arc<PollerContext>, wake: &Waker, queued: &[u64]) {
    let messages: Vec<String> = queued
        .iter()
        .zip(&ctx.sink_order)
        .filter_map(|(n, part)| (*n > 0).then_some(part.as_ref()?))
        .filter_map(|part| wake.queued_message(&part.name))
        .collect();
    if messages.is_empty() {
        return;
    }
    let channel = ctx.keys.wake_channel();
    let mut con = ctx.con.clone();
    tokio::spawn(async move {
        let mut pipe = redis::pipe();
        for message in &messages {
            pipe.publish(&channel, message).ignore();
        }
        if let Err(e) = pipe.query_async::<()>(&mut con).await {
            tracing::debug!(error = %e, "announcing queued jobs failed; other publishers poll");
        }
    });
}

/// Moves from `target` until `stop`. `takes`: for a shard, its links to its publishers
/// for each part of the ready set, in `ctx.sink_order` (`None` where none runs), and what
/// the moves claim for them; `tracker` runs the deliveries of what they claim.
pub async fn run(
    ctx: Arc<PollerContext>,
    mut target: Target,
    wake: Waker,
    mut takes: Takes,
    tracker: TaskTracker,
    stop: CancellationToken,
    on_batch: Option<BatchObserver>,
) {
    let label = target.label();
    let script = match target {
        Target::Shard(_) => "move_due",
        Target::Source(_) => "move_raw",
        Target::Lane(_) => "move_lane",
    };
    let mut backoff = Backoff::new();
    let mut schedule_cache = ScheduleCache::default();
    // Its own context: a move that works must not end an episode of failing schedules.
    let schedules_label = format!("{label} schedules");
    let mut walks = Walks::default();
    // A route lane whose sleep ran out (no wake-up came) first reads its heads: most such
    // fallback polls find nothing, and with many lanes their script calls were most of an
    // idle daemon's cost to Redis.
    let mut look_first = false;
    // The part whose lack of room cut the last move, or whose claim filled its batch.
    let mut blocking: Option<usize> = None;
    tracing::debug!(source = %label, ?target, "poller started");
    while !stop.is_cancelled() {
        if let (Target::Lane(lane), true) = (&target, std::mem::take(&mut look_first)) {
            match lane_wait(&ctx, lane).await {
                Ok(wait) if wait.is_none_or(|w| !w.is_zero()) => {
                    let idle = wake.idle(ctx.mover.idle_poll, ctx.mover.idle_poll_max);
                    tokio::select! {
                        _ = tokio::time::sleep(wait.unwrap_or(idle).min(idle)) => look_first = true,
                        _ = wake.notified() => {}
                        _ = stop.cancelled() => {}
                    }
                    continue;
                }
                // Something is due, or the read failed: the move says what and how.
                _ => {}
            }
        }
        if let Target::Shard(shard) = &target {
            match walks.look(&ctx, *shard).await {
                Ok(()) => {}
                Err(e) if ctx.is_refusal(&e) => break,
                Err(e) => metrics::error_event("redis", &label, &e),
            }
        }
        let started = Instant::now();
        let walk = walks.next();
        let walking = walk.map(|(sink, _)| sink.to_owned());
        // A held route sleeps until its tokens are in or its list is looked at again, with
        // due work known to wait: no look at its heads first when that sleep runs out.
        let mut held = false;
        let (take, mut room) = match &target {
            Target::Shard(_) => takes.next(&ctx),
            Target::Source(_) | Target::Lane(_) => (Vec::new(), Vec::new()),
        };
        if let Some(part) = Takes::wait_first(&take, blocking.take()) {
            // Nothing but the jobs of a part without room is due: wait for it first.
            takes.wait_for_room(&ctx, part, &stop).await;
            continue;
        }
        let mut moved = move_taking(&ctx, &target, None, walk, &take).await;
        if let (Ok(reply), Target::Shard(shard)) = (&mut moved, &target) {
            takes.learn(&take, reply);
            let claimed = std::mem::take(&mut reply.claimed);
            blocking = claimed
                .iter()
                .find(|c| c.claim.jobs.len() >= ctx.mover.batch)
                .map(|c| c.part);
            takes::deliver(&ctx, *shard, claimed, &mut room, started, &tracker);
        }
        // The room the move did not use goes back now, before any wait (a failed call's too).
        drop(room);
        let delay = match moved {
            Ok(reply) => {
                held = reply.held != Held::Flowing;
                ::metrics::histogram!(SCRIPT_DURATION, "script" => script)
                    .record(started.elapsed().as_secs_f64());
                metrics::recovered("redis", &label);
                record(&ctx, &target, &label, &reply);
                if let Some(sink) = &walking {
                    record_refiled(sink, &reply);
                    walks.advance(reply.walk_next.clone());
                }
                if let Some(observe) = &on_batch {
                    observe(&target, &reply);
                }
                for (queued, link) in reply.queued.iter().zip(takes.links()) {
                    if let (true, Some(link)) = (*queued > 0, link) {
                        link.wake.notify_one();
                    }
                }
                announce_queued(&ctx, &wake, &reply.queued);
                if let Some(at) = schedule_fire_ms(&reply, ctx.mover.fire_ahead_ms)
                    && at.saturating_mul(1000) <= reply.now_us
                {
                    let fired = fire_schedules(&ctx, &target, &mut schedule_cache, &label).await;
                    let fired = fired.map(|(outcome, pushed)| {
                        metrics::recovered("redis", &schedules_label);
                        if let Some(pushed) = pushed {
                            record(&ctx, &target, &label, &pushed);
                            if let Some(observe) = &on_batch {
                                observe(&target, &pushed);
                            }
                        }
                        outcome
                    });
                    match fired {
                        // New jobs are due now: move them without waiting.
                        Ok(FireOutcome::More) => {
                            tokio::task::yield_now().await;
                            continue;
                        }
                        Ok(FireOutcome::Done) => {}
                        Err(e) if ctx.is_refusal(&e) => break,
                        // Stalled, or failed: back off.
                        other => {
                            if let Err(e) = other {
                                metrics::error_event("redis", &schedules_label, &e);
                            }
                            let delay = backoff.step();
                            tokio::select! {
                                _ = tokio::time::sleep(delay) => {}
                                _ = stop.cancelled() => {}
                            }
                            continue;
                        }
                    }
                }
                if reply.kept > 0 {
                    metrics::error_event(
                        "push_failed",
                        &label,
                        &format!("{} jobs left due: {}", reply.kept, reply.kept_error),
                    );
                    backoff.step()
                } else {
                    metrics::recovered("push_failed", &label);
                    backoff.reset();
                    if let Some(part) = reply.waits_for {
                        // Due jobs wait for a publisher's room here: for it, or to queue them.
                        takes.wait_for_room(&ctx, part, &stop).await;
                        continue;
                    }
                    if reply.taken >= ctx.mover.batch || walks.next().is_some() {
                        // More are due, or a walk goes on: go again at once, but let other
                        // tasks run.
                        tokio::task::yield_now().await;
                        continue;
                    }
                    let idle = wake.idle(ctx.mover.idle_poll, ctx.mover.idle_poll_max);
                    sleep_after(&reply, target.unit(), idle, ctx.mover.fire_ahead_ms)
                }
            }
            Err(e) if ctx.is_refusal(&e) => break,
            Err(e) if lanes::is_lane_refusal(&e) => {
                let Target::Lane(lane) = &target else {
                    unreachable!("only lane scripts refuse with a lane's marker")
                };
                if e.code() == Some("ZDELAY_NO_LANE") {
                    ctx.lost_lane(&lane.route);
                    break;
                }
                match reread_lane(&ctx, lane).await {
                    Ok(Some(now)) => {
                        tracing::warn!(
                            route = %now.route,
                            list = %now.list,
                            push = now.push.command(),
                            "route lane registered again with another list or push command (a \
                             daemon with another config started); moving it as registered now"
                        );
                        target = Target::Lane(now);
                        Duration::ZERO
                    }
                    Ok(None) => {
                        tracing::warn!(
                            route = %lane.route,
                            lane = lane.number,
                            "route lane retired (its route's list moved to another slot or the \
                             route is gone); the daemon that registered its successor moves it"
                        );
                        break;
                    }
                    Err(e) => {
                        metrics::error_event("redis", &label, &e);
                        backoff.step()
                    }
                }
            }
            Err(e) => {
                metrics::error_event("redis", &label, &e);
                backoff.step()
            }
        };
        if delay.is_zero() {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => look_first = !held,
            _ = wake.notified() => {}
            _ = stop.cancelled() => {}
        }
    }
    tracing::debug!(source = %label, "poller stopped");
}

/// How long until a route lane has something to do: its earliest job or schedule occurrence,
/// by the Redis clock (`Some(ZERO)` when due now, `None` when it holds neither), read with
/// plain commands in the lane's slot. A marker that is not the lane's also means "move now":
/// the move's fence then says what happened (a lost marker, after a failover to a replica
/// that had not received it, or a flush, makes the daemon register the lane again; without
/// that, producers refused by the missing marker keep the lane empty, and an empty lane would
/// never be moved).
async fn lane_wait(ctx: &PollerContext, lane: &Lane) -> redis::RedisResult<Option<Duration>> {
    let mut con = ctx.con_for(&TargetId::Lane(lane.number));
    type Head = Vec<(String, f64)>;
    let (time, due, schedule, marker): ((i64, i64), Head, Head, Option<String>) = redis::pipe()
        .cmd("TIME")
        .zrange_withscores(&lane.keys.due, 0, 0)
        .zrange_withscores(&lane.keys.sched_due, 0, 0)
        .get(&lane.keys.marker)
        .query_async(&mut con)
        .await?;
    if marker.as_deref() != Some(lane.marker().as_str()) {
        return Ok(Some(Duration::ZERO));
    }
    // A test clock's offset (no I/O without one): the heads are in its time.
    let offset_ms = con.clock_offset_ms().await? as f64;
    let now_ms = time.0 as f64 * 1000.0 + time.1 as f64 / 1000.0 + offset_ms;
    // A schedule's occurrence is written `fire_ahead` before its time.
    let ahead_ms = ctx.mover.fire_ahead_ms as f64;
    let due = due.iter().map(|(_, at)| *at);
    let fire = schedule.iter().map(|(_, at)| at - ahead_ms);
    Ok(due
        .chain(fire)
        .map(|at| Duration::from_secs_f64(((at - now_ms) / 1000.0).max(0.0)))
        .min())
}

/// What a batch of a walk of `sink`'s waiting jobs refiled.
fn record_refiled(sink: &str, reply: &MoveReply) {
    let r = reply.refiled;
    for (to, n) in [("sink", r.to_sink), ("local", r.to_due), ("dead", r.dead)] {
        if n > 0 {
            ::metrics::counter!(JOBS_REROUTED, "from" => sink.to_owned(), "to" => to).increment(n);
        }
    }
    if r.total() > 0 {
        tracing::warn!(
            sink,
            to_another_sink = r.to_sink,
            to_local_route = r.to_due,
            to_dead = r.dead,
            "jobs waiting for a sink were refiled by their route now"
        );
    }
}

fn record(ctx: &PollerContext, target: &Target, label: &str, reply: &MoveReply) {
    if reply.reaped > 0 {
        ::metrics::counter!(LEASES_EXPIRED).increment(reply.reaped);
        tracing::warn!(
            source = label,
            jobs = reply.reaped,
            "leases ran out; jobs due again"
        );
    }
    if reply.taken == 0 {
        return;
    }
    ::metrics::histogram!(BATCH_SIZE).record(reply.taken as f64);
    match target {
        // A spread shard pushes onto no list: its jobs are counted by their sink's outcomes.
        Target::Shard(_) => {}
        Target::Source(s) => {
            ::metrics::counter!(JOBS_MOVED, "route" => s.route.clone())
                .increment(reply.moved_total());
        }
        Target::Lane(lane) => {
            ::metrics::counter!(JOBS_MOVED, "route" => lane.route.clone())
                .increment(reply.moved_total());
            if ctx.mover.flows.contains_key(&lane.route) {
                metrics::record_flow(&lane.route, reply);
            }
        }
    }
    let kinds = match target {
        Target::Shard(_) | Target::Lane(_) => &DUE_DEAD_KINDS,
        Target::Source(_) => &RAW_DEAD_KINDS,
    };
    for (kind, &n) in kinds.iter().zip(&reply.dead) {
        if n > 0 {
            ::metrics::counter!(JOBS_DEAD, "source" => label.to_owned(), "reason" => *kind)
                .increment(n);
            tracing::warn!(source = label, reason = kind, jobs = n, "jobs sent to dead");
        }
    }
    metrics::record_lateness(label, &reply.buckets, reply.max_lateness_ms);
    crate::activity::lateness_buckets(&reply.buckets);
    crate::activity::delivered(reply.moved_total());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(now_us: i64, next_due: Option<f64>) -> MoveReply {
        MoveReply {
            now_us,
            next_due,
            ..MoveReply::default()
        }
    }

    #[test]
    fn sleeps_no_longer_than_until_the_earliest_lease_deadline() {
        let idle = Duration::from_secs(5);
        let r = MoveReply {
            next_lease_ms: Some(1_000_250),
            ..reply(1_000_000_000, None)
        };
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle, 0),
            Duration::from_millis(250)
        );
    }

    #[test]
    fn schedules_wake_the_mover_fire_ahead_before_their_occurrence() {
        let idle = Duration::from_secs(60);
        let r = MoveReply {
            next_schedule_ms: Some(1_012_000),
            ..reply(1_000_000_000, None)
        };
        assert_eq!(schedule_fire_ms(&r, 10_000), Some(1_002_000));
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle, 10_000),
            Duration::from_secs(2)
        );
        // Within the lead already: fire at once.
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle, 15_000),
            Duration::ZERO
        );
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle, 0),
            Duration::from_secs(12)
        );
    }

    #[test]
    fn sleeps_until_the_head_is_due_by_redis_time() {
        let idle = Duration::from_millis(100);
        let r = reply(1_000_000_000, Some(1_000_007.0));
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle, 0),
            Duration::from_millis(7)
        );
        let r = reply(1_000_000_000, Some(1_000.5));
        assert_eq!(
            sleep_after(&r, ScoreUnit::Seconds, Duration::from_secs(1), 0),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn sleep_is_capped_by_idle_and_never_negative() {
        let idle = Duration::from_millis(100);
        assert_eq!(
            sleep_after(&reply(0, None), ScoreUnit::Millis, idle, 0),
            idle
        );
        assert_eq!(
            sleep_after(&reply(5_000_000, Some(1.0)), ScoreUnit::Millis, idle, 0),
            Duration::ZERO
        );
        assert_eq!(
            sleep_after(&reply(0, Some(1e12)), ScoreUnit::Millis, idle, 0),
            idle
        );
    }

    #[test]
    fn firing_goes_on_at_once_only_after_progress() {
        use zdelay_core::schedules::FireReport;
        let report = |created, more, sent, fenced| {
            let mut r = FireReport {
                due: sent,
                sent,
                more,
                ..FireReport::default()
            };
            r.fired.created = created;
            r.fired.fenced = fenced;
            r
        };
        assert_eq!(FireOutcome::of(&report(3, false, 3, 0)), FireOutcome::More);
        assert_eq!(FireOutcome::of(&report(0, true, 1, 0)), FireOutcome::More);
        assert_eq!(FireOutcome::of(&report(0, false, 0, 0)), FireOutcome::Done);
        // Skipped or quarantined: progress, nothing to move.
        assert_eq!(FireOutcome::of(&report(0, false, 2, 1)), FireOutcome::Done);
        // Every one fenced: back off.
        assert_eq!(
            FireOutcome::of(&report(0, false, 2, 2)),
            FireOutcome::Stalled
        );
    }

    #[test]
    fn backoff_doubles_to_a_cap_and_resets() {
        let mut b = Backoff::new();
        let steps: Vec<_> = (0..10).map(|_| b.step()).collect();
        assert_eq!(steps[0], Duration::from_millis(50));
        assert_eq!(steps[1], Duration::from_millis(100));
        assert_eq!(*steps.last().unwrap(), Duration::from_millis(500));
        b.reset();
        assert_eq!(b.step(), Duration::from_millis(50));
    }
}
