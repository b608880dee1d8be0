//! The two-phase path for jobs a sink's publisher claimed (`claim_jobs`): publish them, wait
//! for the broker's confirmations, then settle every job in one fenced `settle_jobs` call.
//!
//! Per job exactly one outcome: Delivered → ack; Retry → back to due after exponential
//! backoff with full jitter, attempt + 1, dead at max attempts; Reject → dead with the
//! broker's reason; Unavailable → back to its sink's place in the ready set without burning
//! an attempt, and the sink pauses (its publishers claim nothing until it is back; other
//! sinks and local routes keep flowing); Missing (the topic, exchange, binding or stream does
//! not exist) → back to due [`HELD_RECHECK`] later without burning an attempt, its target
//! shown as held until a message to it is delivered (or dead, when its route says
//! `on_missing = "dead"`); the sink's other targets flow on.
//!
//! A publisher publishes through its own sink only, within that sink's in-flight bounds. A
//! claimed job whose route now leads elsewhere (the config changed since it was queued) is
//! handed over in the settle, unpublished and without an attempt counted: to the ready part
//! of the sink it resolves to now, back to due when it resolves to a local list (`move_due`
//! pushes it), to dead ("route gone: …") when nothing resolves it.
//!
//! A settle that fails on a passing fault (connection dropped, timeout, a busy server) is
//! sent again with backoff while the claim's lease runs: the script is fenced, so a settle
//! that did run and lost its reply changes nothing the second time.
//!
//! INVARIANT: nothing is removed before its sink confirmed it. A crash anywhere here leaves
//! the job in inflight, and its lease returns it to due: at least once, never lost.

use super::context::{
    DeliveryPolicy, ENVELOPE_SOURCE, PollerContext, RawDelivery, RawSource, TargetId,
};
use crate::metrics::{
    self, FENCED, JOBS_DEAD, JOBS_REROUTED, LATENESS, SINK_OUTCOMES, SINK_PUBLISH_DURATION,
};
use crate::sinks::{HELD_RECHECK, Message, Outcome, SinkHandle};
use crate::trace::Hop;
use rand::{RngExt, SeedableRng};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use zdelay_core::config::OnMissing;
use zdelay_core::envelope::Envelope;
use zdelay_core::routes::{Refused, Resolved};
use zdelay_core::store::scripts::{self, Claim, Claimed, KeyTurn, RawClaim, SettleOp, Settled};
use zdelay_core::trace_context::{self, Origin};

/// Retry delay for a job that has failed `attempt` times before: a random time in
/// [0, min(cap, base × 2^attempt)] (exponential backoff with full jitter).
pub fn retry_delay(
    attempt: u32,
    base: Duration,
    cap: Duration,
    rng: &mut impl rand::Rng,
) -> Duration {
    let ceiling = base
        .checked_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
        .unwrap_or(cap)
        .min(cap);
    Duration::from_millis(rng.random_range(0..=ceiling.as_millis() as u64))
}

/// Why a two-phase job died: the `reason` label of `zdelay_jobs_dead_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum DeadKind {
    /// It could not be published at all (malformed, not admitted, oversize).
    Undeliverable,
    /// The broker refused it for good.
    Rejected,
    /// It failed `max_attempts` times.
    GaveUp,
    /// It could not go out within its `max_lateness`.
    Expired,
    /// Its dest resolves to no configured route or sink any more.
    RouteGone,
}

impl DeadKind {
    fn label(self) -> &'static str {
        match self {
            DeadKind::Undeliverable => "undeliverable",
            DeadKind::Rejected => "rejected",
            DeadKind::GaveUp => "gave_up",
            DeadKind::Expired => "expired",
            DeadKind::RouteGone => "route_gone",
        }
    }
}

/// One settle decision, owning what `settle_jobs` writes.
#[derive(Debug, Clone, PartialEq)]
enum Settle {
    Ack,
    Retry {
        due_ms: i64,
        envelope: Vec<u8>,
    },
    /// Back to the ready set, in `sink`'s part.
    Release {
        due_ms: i64,
        sink: String,
    },
    /// Back to due, no attempt counted: the route is a local list now, or the destination
    /// object is missing.
    Due {
        due_ms: i64,
    },
    /// Back to due at its key's turn, no attempt counted: its route's per-key rate.
    Deferred {
        due_ms: i64,
    },
    Dead {
        kind: DeadKind,
        reason: String,
        envelope: Vec<u8>,
    },
}

impl Settle {
    fn op(&self) -> SettleOp<'_> {
        match self {
            Settle::Ack => SettleOp::Ack,
            Settle::Retry { due_ms, envelope } => SettleOp::Retry {
                due_ms: *due_ms,
                envelope,
            },
            Settle::Release { due_ms, sink } => SettleOp::Release {
                due_ms: *due_ms,
                sink,
            },
            Settle::Due { due_ms } | Settle::Deferred { due_ms } => {
                SettleOp::Due { due_ms: *due_ms }
            }
            Settle::Dead {
                reason, envelope, ..
            } => SettleOp::Dead { reason, envelope },
        }
    }
}

/// A claimed job on its way through its sink: its decoded envelope.
/// The envelope's payload and headers are moved into the job's `Message`, not copied;
/// `rewrite` puts them back for the rare retry or death.
struct Pending<'a> {
    job: &'a Claimed,
    /// Where its lateness counts from: its due, or the turn its key's rate gave it.
    late_from: i64,
    envelope: Envelope,
    /// Its route's choice when the destination object is missing.
    on_missing: OnMissing,
}

/// A batch a publisher claimed from one part of a shard's ready set.
pub struct ClaimedBatch<'a> {
    /// The part it was claimed from: the sink's own, or a route's flow part.
    pub part: &'a str,
    pub claim: &'a Claim,
    pub claimed_at: Instant,
    /// Since when (ms) the part's route was held by its rate: the jobs' wait from then on
    /// is deferral, not lateness.
    pub held_since_ms: Option<i64>,
    /// Each job's admission by its key's rate, in `claim.jobs` order (empty: none asked).
    pub turns: &'a [KeyTurn],
}

/// Publishes the jobs `sink` claimed in `shard` and settles them, handing over those whose
/// route now leads elsewhere.
pub async fn deliver(
    ctx: &PollerContext,
    shard: u16,
    sink: &SinkHandle,
    claimed: &ClaimedBatch<'_>,
) -> redis::RedisResult<()> {
    let ClaimedBatch {
        part,
        claim,
        claimed_at,
        held_since_ms,
        turns,
    } = *claimed;
    let policy = &ctx.delivery;
    let mut deferral = Deferral::default();
    // Redis time now, from the claim's Redis time: no local clock involved.
    let redis_now_ms = || claim.now_us / 1000 + claimed_at.elapsed().as_millis() as i64;
    let mut settles: Vec<(&str, Settle)> = Vec::with_capacity(claim.jobs.len());
    let mut pending: Vec<Pending> = Vec::with_capacity(claim.jobs.len());
    let mut messages: Vec<Message> = Vec::with_capacity(claim.jobs.len());
    for (i, job) in claim.jobs.iter().enumerate() {
        let late_from = match turns.get(i) {
            // Its key's turn is later: back to due then, unpublished, no attempt counted.
            Some(KeyTurn::Later(turn)) => {
                settles.push((&job.id, Settle::Deferred { due_ms: *turn }));
                continue;
            }
            // At its turn: its lateness counts from the turn, the wait before as deferral.
            Some(KeyTurn::Granted(turn)) => job.due_ms.max(*turn),
            Some(KeyTurn::Now) | None => job.due_ms,
        };
        match prepare(
            ctx,
            sink,
            part,
            job,
            late_from,
            held_since_ms,
            redis_now_ms(),
        ) {
            Ok((p, message)) => {
                pending.push(p);
                messages.push(message);
            }
            Err(settle) => settles.push((&job.id, settle)),
        }
    }
    count_rerouted(&sink.name, settles.iter().map(|(_, s)| s));
    let outcomes = if messages.is_empty() {
        Some(Vec::new())
    } else if sink.is_paused() {
        // Paused since the claim: hand the jobs back untouched, without publishing.
        None
    } else {
        let started = Instant::now();
        let outcomes = sink.sink.publish(&messages).await;
        ::metrics::histogram!(SINK_PUBLISH_DURATION, "sink" => sink.name.clone())
            .record(started.elapsed().as_secs_f64());
        Some(one_per_message(sink, messages.len(), outcomes))
    };
    failpoint_after_publish().await;

    // The thread-local RNG is not Send: keep it out of any await.
    let mut rng = rand::rngs::StdRng::from_rng(&mut rand::rng());
    match &outcomes {
        None => settles.extend(pending.iter().map(|p| {
            let release = Settle::Release {
                due_ms: p.job.due_ms,
                sink: part.to_owned(),
            };
            (p.job.id.as_str(), release)
        })),
        Some(outcomes) => {
            count_invalid_trace_context(sink, &messages);
            for ((p, m), outcome) in pending.iter().zip(&messages).zip(outcomes) {
                if let Some(tracer) = &ctx.tracer {
                    tracer.record(&Hop {
                        message: m,
                        route: &p.envelope.dest,
                        sink: &sink.name,
                        attempt: p.envelope.meta.attempt + 1,
                        answered_ms: redis_now_ms(),
                        outcome,
                    });
                }
                let settle = match outcome {
                    Outcome::Delivered => {
                        let now_ms = redis_now_ms();
                        let late_now = held_since_ms.map_or(now_ms, |h| h.min(now_ms));
                        record_lateness(sink, late_now - p.late_from);
                        let held = held_since_ms
                            .filter(|h| *h < now_ms)
                            .map_or(0, |held| now_ms - p.late_from.max(held));
                        if held > 0 || p.late_from > p.job.due_ms {
                            deferral.add(&p.envelope.dest, held + p.late_from - p.job.due_ms);
                        }
                        Settle::Ack
                    }
                    Outcome::Retry(why) => retry(policy, p, m, why, redis_now_ms(), &mut rng),
                    Outcome::Reject(why) => dead(p, m, why.clone()),
                    Outcome::Unavailable(_) => Settle::Release {
                        due_ms: p.job.due_ms,
                        sink: part.to_owned(),
                    },
                    Outcome::Missing(why) if p.on_missing == OnMissing::Dead => {
                        dead(p, m, why.clone())
                    }
                    Outcome::Missing(_) | Outcome::Full(_) => Settle::Due {
                        due_ms: redis_now_ms() + HELD_RECHECK.as_millis() as i64,
                    },
                };
                settles.push((&p.job.id, settle));
            }
            if !outcomes.is_empty() {
                sink_answered(sink, outcomes);
                track_held(sink, &messages, outcomes, |i| {
                    pending[i].on_missing == OnMissing::Wait
                });
            }
        }
    }
    count_dead(ENVELOPE_SOURCE, settles.iter().map(|(_, s)| s));
    deferral.record();
    if settles.is_empty() {
        return Ok(());
    }
    let ops: Vec<(&str, SettleOp)> = settles.iter().map(|(id, s)| (*id, s.op())).collect();
    let keys = ctx.keys.shard(shard);
    let target = TargetId::Shard(shard);
    let label = format!("shard {shard}");
    let settled = settle_retried(&label, claimed_at + policy.lease, || {
        let (keys, ops) = (&keys, &ops);
        let mut con = ctx.con_for(&target);
        async move { scripts::settle_jobs(&mut con, keys, &claim.token, ops).await }
    })
    .await?;
    report_fenced(&label, settled.fenced);
    Ok(())
}

/// A sink's outcomes for a batch of `messages`: one per message, or, when the sink answered
/// with another count, "unavailable" for every one (an error event; the batch goes back
/// without an attempt counted and the sink pauses), never outcomes zipped onto the wrong
/// messages.
fn one_per_message(sink: &SinkHandle, messages: usize, outcomes: Vec<Outcome>) -> Vec<Outcome> {
    if outcomes.len() == messages {
        return outcomes;
    }
    let why = format!(
        "sink answered {} outcomes for {messages} messages; the batch is released",
        outcomes.len()
    );
    metrics::error_event("sink_outcomes", &sink.name, &why);
    vec![Outcome::Unavailable(why); messages]
}

/// Hand-overs of claimed jobs whose route leads elsewhere now, by where they went.
fn count_rerouted<'a>(from: &str, settles: impl Iterator<Item = &'a Settle>) {
    let (mut to_sink, mut to_due, mut gone) = (0u64, 0u64, 0u64);
    for settle in settles {
        match settle {
            Settle::Release { .. } => to_sink += 1,
            Settle::Due { .. } => to_due += 1,
            Settle::Dead {
                kind: DeadKind::RouteGone,
                ..
            } => gone += 1,
            _ => {}
        }
    }
    for (to, n) in [("sink", to_sink), ("local", to_due), ("dead", gone)] {
        if n > 0 {
            ::metrics::counter!(JOBS_REROUTED, "from" => from.to_owned(), "to" => to).increment(n);
            tracing::info!(
                sink = from,
                to,
                jobs = n,
                "claimed jobs whose route leads elsewhere now were handed over unpublished"
            );
        }
    }
}

/// Sends a settle until it answers, again after each passing fault (see
/// [`zdelay_core::store::is_transient`]) with a growing pause, until `lease_end`: later the
/// claim's lease has run out and its jobs are queued again anyway.
async fn settle_retried<F, Fut>(
    label: &str,
    lease_end: Instant,
    mut send: F,
) -> redis::RedisResult<Settled>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<Settled>>,
{
    let mut pause = SETTLE_FIRST_PAUSE;
    loop {
        match send().await {
            Err(e)
                if zdelay_core::store::is_transient(&e) && Instant::now() + pause < lease_end =>
            {
                tracing::warn!(source = label, error = %e, retry_in = ?pause, "settle failed; sending it again");
                ::metrics::counter!(crate::metrics::SETTLE_RETRIES).increment(1);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(SETTLE_MAX_PAUSE);
            }
            other => return other,
        }
    }
}

/// First and longest pause between two tries of a settle.
const SETTLE_FIRST_PAUSE: Duration = Duration::from_millis(50);
const SETTLE_MAX_PAUSE: Duration = Duration::from_secs(2);

/// Publishes the raw members `sink` claimed from `source` and settles them in the source.
/// A member's message id is `<source>:<sha1 of the member, 16 hex digits>`, and its
/// idempotency key adds the due time it was scheduled for.
pub async fn deliver_raw(
    ctx: &PollerContext,
    source: &RawSource,
    sink: &SinkHandle,
    claim: &RawClaim,
    claimed_at: Instant,
) -> redis::RedisResult<()> {
    let label = source.keys.source.as_str();
    for (reason, n) in [
        ("implausible_score", claim.dead_implausible),
        ("oversize", claim.dead_oversize),
    ] {
        if n > 0 {
            ::metrics::counter!(JOBS_DEAD, "source" => label.to_owned(), "reason" => reason)
                .increment(n);
            tracing::warn!(source = label, reason, jobs = n, "jobs sent to dead");
        }
    }
    if claim.members.is_empty() {
        return Ok(());
    }
    let RawDelivery::Sink(dest) = &source.delivery else {
        return Ok(());
    };
    let policy = &ctx.delivery;
    let redis_now_ms = || claim.now_us / 1000 + claimed_at.elapsed().as_millis() as i64;
    let messages: Vec<Message> = claim
        .members
        .iter()
        .map(|m| Message {
            id: format!("{label}:{}", &m.sha1[..16.min(m.sha1.len())]),
            due_ms: m.due_ms,
            target: dest.target.clone(),
            payload: m.member.clone(),
            headers: Default::default(),
            priority: dest.priority,
        })
        .collect();
    let outcomes = if sink.is_paused() {
        // Paused since the claim: hand the members back untouched, without publishing.
        None
    } else {
        let started = Instant::now();
        let outcomes = sink.sink.publish(&messages).await;
        ::metrics::histogram!(SINK_PUBLISH_DURATION, "sink" => sink.name.clone())
            .record(started.elapsed().as_secs_f64());
        Some(one_per_message(sink, messages.len(), outcomes))
    };
    failpoint_after_publish().await;
    let mut rng = rand::rngs::StdRng::from_rng(&mut rand::rng());
    let mut settles: Vec<Settle> = Vec::with_capacity(messages.len());
    match &outcomes {
        None => settles.extend(claim.members.iter().map(|m| Settle::Release {
            due_ms: m.due_ms,
            sink: sink.name.clone(),
        })),
        Some(outcomes) => {
            if let Some(tracer) = &ctx.tracer {
                for ((m, message), outcome) in claim.members.iter().zip(&messages).zip(outcomes) {
                    tracer.record(&Hop {
                        message,
                        route: label,
                        sink: &sink.name,
                        attempt: m.attempts + 1,
                        answered_ms: redis_now_ms(),
                        outcome,
                    });
                }
            }
            for (m, outcome) in claim.members.iter().zip(outcomes) {
                settles.push(match outcome {
                    Outcome::Delivered => {
                        record_lateness(sink, redis_now_ms() - m.due_ms);
                        Settle::Ack
                    }
                    Outcome::Retry(why) if m.attempts + 1 >= policy.max_attempts => Settle::Dead {
                        kind: DeadKind::GaveUp,
                        reason: format!("gave up after {} attempts: {why}", m.attempts + 1),
                        envelope: Vec::new(),
                    },
                    Outcome::Retry(_) => {
                        let delay =
                            retry_delay(m.attempts, policy.retry_base, policy.retry_cap, &mut rng);
                        Settle::Retry {
                            due_ms: redis_now_ms() + delay.as_millis() as i64,
                            envelope: Vec::new(),
                        }
                    }
                    Outcome::Reject(why) => Settle::Dead {
                        kind: DeadKind::Rejected,
                        reason: why.clone(),
                        envelope: Vec::new(),
                    },
                    Outcome::Unavailable(_) => Settle::Release {
                        due_ms: m.due_ms,
                        sink: sink.name.clone(),
                    },
                    Outcome::Missing(why) if dest.on_missing == OnMissing::Dead => Settle::Dead {
                        kind: DeadKind::Rejected,
                        reason: why.clone(),
                        envelope: Vec::new(),
                    },
                    // A raw release sets the member's score to this time, keeping its
                    // scheduled due (and idempotency key) in `<source>:claims`.
                    Outcome::Missing(_) | Outcome::Full(_) => Settle::Release {
                        due_ms: redis_now_ms() + HELD_RECHECK.as_millis() as i64,
                        sink: sink.name.clone(),
                    },
                });
            }
            sink_answered(sink, outcomes);
            track_held(sink, &messages, outcomes, |_| {
                dest.on_missing == OnMissing::Wait
            });
        }
    }
    count_dead(label, settles.iter());
    let ops: Vec<(&[u8], SettleOp)> = claim
        .members
        .iter()
        .zip(&settles)
        .map(|(m, s)| (m.member.as_slice(), s.op()))
        .collect();
    let target = TargetId::Source(source.keys.source.clone());
    let settled = settle_retried(label, claimed_at + policy.lease, || {
        let ops = &ops;
        let mut con = ctx.con_for(&target);
        async move {
            scripts::settle_raw(&mut con, &source.keys, source.unit, &claim.deadline, ops).await
        }
    })
    .await?;
    report_fenced(label, settled.fenced);
    Ok(())
}

/// Counts the batch's malformed `traceparent` headers (they are delivered as given).
fn count_invalid_trace_context(sink: &SinkHandle, messages: &[Message]) {
    let malformed = messages
        .iter()
        .filter(|m| trace_context::origin(&m.headers) == Origin::Malformed)
        .count();
    if malformed > 0 {
        metrics::trace_context_invalid(&sink.name, malformed as u64);
    }
}

/// The deliveries of one batch that waited while their route was held by its rate, per
/// route: counted as deferral (`zdelay_deferred_total`), as a local route's are.
#[derive(Default)]
struct Deferral(BTreeMap<String, (u64, u64)>);

impl Deferral {
    fn add(&mut self, route: &str, waited_ms: i64) {
        let entry = self.0.entry(route.to_owned()).or_default();
        entry.0 += 1;
        entry.1 += waited_ms.max(0) as u64;
    }

    fn record(&self) {
        for (route, (jobs, ms)) in &self.0 {
            metrics::deferred(route, *jobs, *ms);
        }
    }
}

/// One job delivered (confirmed by its broker), this late.
fn record_lateness(sink: &SinkHandle, late_ms: i64) {
    ::metrics::histogram!(LATENESS, "source" => sink.name.clone())
        .record(late_ms.max(0) as f64 / 1000.0);
    crate::activity::lateness_ms(late_ms);
    crate::activity::delivered(1);
}

/// What a sink's answers to one batch say about the sink: counted per outcome, retries
/// logged, an unavailable answer pauses it, a confirmed one resumes it.
fn sink_answered(sink: &SinkHandle, outcomes: &[Outcome]) {
    let mut counts: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut unavailable: Option<&str> = None;
    let mut retried: Option<&str> = None;
    for outcome in outcomes {
        match outcome {
            Outcome::Retry(why) => {
                retried.get_or_insert(why);
            }
            Outcome::Unavailable(why) => {
                unavailable.get_or_insert(why);
            }
            _ => {}
        }
        *counts.entry(outcome.label()).or_default() += 1;
    }
    if let Some(why) = retried {
        crate::sink_warning!(
            &sink.name,
            sink = %sink.name,
            jobs = counts.get("retried").copied().unwrap_or_default(),
            error = why,
            "publish failed for some jobs; they are retried after a backoff"
        );
    }
    for (label, n) in counts {
        ::metrics::counter!(SINK_OUTCOMES, "sink" => sink.name.clone(), "outcome" => label)
            .increment(n);
    }
    match unavailable {
        // The sink's outage episode (its log lines) is the handle's.
        Some(why) => {
            sink.pause(why);
        }
        None if outcomes.iter().any(|o| matches!(o, Outcome::Delivered)) => sink.resume(),
        None => {}
    }
}

/// Marks the targets whose destination object is missing as held (when their jobs wait:
/// `waits(i)` for message i), and those delivered to as no longer held (both in one batch:
/// delivered wins, the object exists now).
fn track_held(
    sink: &SinkHandle,
    messages: &[Message],
    outcomes: &[Outcome],
    waits: impl Fn(usize) -> bool,
) {
    // Distinct targets: a batch of a thousand messages to one topic takes the lock once.
    let mut delivered = std::collections::BTreeSet::new();
    for (i, (m, outcome)) in messages.iter().zip(outcomes).enumerate() {
        match outcome {
            Outcome::Missing(why) if waits(i) => sink.hold(&m.target, why),
            Outcome::Full(why) => sink.hold(&m.target, why),
            Outcome::Delivered => {
                delivered.insert(m.target.as_str());
            }
            _ => {}
        }
    }
    for target in delivered {
        sink.unhold(target);
    }
}

/// Two-phase deaths in `zdelay_jobs_dead_total`, like the mover's, by kind.
fn count_dead<'a>(source: &str, settles: impl Iterator<Item = &'a Settle>) {
    let mut kinds: BTreeMap<DeadKind, u64> = BTreeMap::new();
    for s in settles {
        if let Settle::Dead { kind, .. } = s {
            *kinds.entry(*kind).or_default() += 1;
        }
    }
    for (kind, n) in kinds {
        ::metrics::counter!(JOBS_DEAD, "source" => source.to_owned(), "reason" => kind.label())
            .increment(n);
    }
}

/// Decodes and resolves a job `claimer` claimed: a message to publish through `claimer`, or
/// (`Err`) the settle of a job that is not its to publish: its route leads elsewhere now
/// (handed over, unpublished), or it can only go to dead. `now_ms`: Redis time, for the
/// job's `max_lateness`.
fn prepare<'a>(
    ctx: &PollerContext,
    claimer: &SinkHandle,
    part: &str,
    job: &'a Claimed,
    late_from: i64,
    held_since_ms: Option<i64>,
    now_ms: i64,
) -> Result<(Pending<'a>, Message), Settle> {
    let dead = |kind, reason: String| {
        Err(Settle::Dead {
            kind,
            reason,
            envelope: Vec::new(),
        })
    };
    let undeliverable = |why: String| dead(DeadKind::Undeliverable, why);
    if job.envelope.is_empty() {
        return undeliverable("no envelope stored for this id".to_owned());
    }
    let mut envelope = match Envelope::decode(&job.envelope) {
        Ok(envelope) => envelope,
        Err(e) => return undeliverable(e.to_string()),
    };
    // Lateness ends where the route's hold began: a held job waits as deferral.
    let late_now = held_since_ms.map_or(now_ms, |h| h.min(now_ms));
    if let Some(limit) = envelope.meta.max_lateness_ms
        && late_now - late_from > limit as i64
    {
        return dead(
            DeadKind::Expired,
            format!(
                "expired: {} ms after its due time, max_lateness {limit} ms",
                late_now - late_from
            ),
        );
    }
    let dest = match ctx.routes.resolve(&envelope.dest) {
        Ok(Resolved::TwoPhase(dest)) => dest,
        // The route table changed since the job was queued (a config change): its route is a
        // local list now, which move_due pushes.
        Ok(Resolved::Local(_)) => {
            return Err(Settle::Due { due_ms: job.due_ms });
        }
        Err(Refused::Unknown { dest }) => {
            return dead(
                DeadKind::RouteGone,
                format!(
                    "route gone: {dest} resolves to no configured route or sink (it was \
                     claimed for sink {})",
                    claimer.name
                ),
            );
        }
        Err(refused) => return undeliverable(refused.to_string()),
    };
    let belongs = ctx.routes.part_of(&envelope.dest, &dest.sink);
    if belongs != part {
        // Another sink's job now (it waits for that sink, within that sink's bounds), or its
        // route's rate changed: it waits in the part that applies it.
        return Err(Settle::Release {
            due_ms: job.due_ms,
            sink: belongs.to_owned(),
        });
    }
    if envelope.payload.len() > ctx.delivery.max_payload {
        return undeliverable(format!(
            "payload of {} bytes exceeds max_payload {}",
            envelope.payload.len(),
            ctx.delivery.max_payload
        ));
    }
    let message = Message {
        // An occurrence of a schedule is known to consumers by the schedule's id: its
        // idempotency key is `<schedule>:<occurrence due>`.
        id: envelope
            .meta
            .schedule
            .clone()
            .unwrap_or_else(|| job.id.clone()),
        due_ms: job.due_ms,
        target: dest.target,
        payload: std::mem::take(&mut envelope.payload),
        headers: std::mem::take(&mut envelope.meta.headers),
        priority: dest.priority,
    };
    Ok((
        Pending {
            job,
            late_from,
            envelope,
            on_missing: dest.on_missing,
        },
        message,
    ))
}

/// The job's envelope whole again (payload and headers back from its message), changed by
/// `edit`.
fn rewrite(p: &Pending, m: &Message, edit: impl FnOnce(&mut Envelope)) -> Envelope {
    let mut envelope = p.envelope.clone();
    envelope.payload = m.payload.clone();
    envelope.meta.headers = m.headers.clone();
    edit(&mut envelope);
    envelope
}

fn retry(
    policy: &DeliveryPolicy,
    p: &Pending,
    m: &Message,
    why: &str,
    now_ms: i64,
    rng: &mut impl rand::Rng,
) -> Settle {
    let failed_before = p.envelope.meta.attempt;
    let envelope = rewrite(p, m, |e| {
        e.meta.attempt += 1;
        e.meta.last_error = Some(why.to_owned());
    });
    let max = envelope.meta.max_attempts.unwrap_or(policy.max_attempts);
    let bytes = envelope.encode().unwrap_or_else(|_| p.job.envelope.clone());
    if envelope.meta.attempt >= max {
        return Settle::Dead {
            kind: DeadKind::GaveUp,
            reason: format!("gave up after {} attempts: {why}", envelope.meta.attempt),
            envelope: bytes,
        };
    }
    let delay = retry_delay(failed_before, policy.retry_base, policy.retry_cap, rng);
    Settle::Retry {
        due_ms: now_ms + delay.as_millis() as i64,
        envelope: bytes,
    }
}

fn dead(p: &Pending, m: &Message, reason: String) -> Settle {
    let envelope = rewrite(p, m, |e| e.meta.last_error = Some(reason.clone()));
    Settle::Dead {
        kind: DeadKind::Rejected,
        reason,
        envelope: envelope.encode().unwrap_or_default(),
    }
}

fn report_fenced(source: &str, fenced: u64) {
    if fenced > 0 {
        ::metrics::counter!(FENCED).increment(fenced);
        tracing::warn!(
            source,
            jobs = fenced,
            "late settle refused by the lease fence: those jobs were reclaimed and will be \
             delivered again (same zdelay-id)"
        );
    }
}

/// Test-only fault injection between the brokers' confirmation and the settle
/// (`ZDELAY_FAILPOINT`): `abort_after_publish` dies there; `hold_after_publish=PATH` stalls
/// there until PATH exists (so a test can let the lease run out and another poller reclaim
/// the jobs first).
async fn failpoint_after_publish() {
    #[cfg(feature = "test-failpoints")]
    if std::env::var("ZDELAY_FAILPOINT").as_deref() == Ok("abort_after_publish") {
        eprintln!("failpoint abort_after_publish");
        std::process::abort();
    }
    zdelay_core::failpoint::hold("hold_after_publish").await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delay_has_full_jitter_under_an_exponential_ceiling() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let base = Duration::from_secs(1);
        let cap = Duration::from_secs(300);
        for attempt in 0..12u32 {
            let ceiling = (base * 2u32.pow(attempt)).min(cap);
            let samples: Vec<_> = (0..500)
                .map(|_| retry_delay(attempt, base, cap, &mut rng))
                .collect();
            assert!(samples.iter().all(|d| *d <= ceiling), "attempt {attempt}");
            // Full jitter: values spread over the whole range, not clustered at the top.
            assert!(
                samples.iter().any(|d| *d < ceiling / 4),
                "attempt {attempt}"
            );
            assert!(
                samples.iter().any(|d| *d > ceiling * 3 / 4),
                "attempt {attempt}"
            );
        }
        assert!(retry_delay(1000, base, cap, &mut rng) <= cap, "no overflow");
    }

    #[test]
    fn outcomes_of_another_count_release_the_whole_batch() {
        use crate::sinks::redis_remote::RedisRemoteSink;
        let sink = SinkHandle::new(
            "other",
            "redis",
            Box::new(
                RedisRemoteSink::new(
                    "other",
                    "redis://127.0.0.1:1",
                    &zdelay_core::config::from_toml("").unwrap(),
                )
                .unwrap(),
            ),
            Duration::from_secs(1),
            1,
        );
        let answered = vec![Outcome::Delivered, Outcome::Reject("no".into())];
        assert_eq!(one_per_message(&sink, 2, answered.clone()), answered);
        for wrong in [vec![Outcome::Delivered], answered.clone(), Vec::new()] {
            let n = if wrong.len() == 2 { 3 } else { 2 };
            let got = one_per_message(&sink, n, wrong);
            assert_eq!(got.len(), n, "one outcome per message");
            assert!(
                got.iter().all(
                    |o| matches!(o, Outcome::Unavailable(why) if why.contains("outcomes for"))
                ),
                "{got:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_settle_is_sent_again_after_passing_faults_within_the_lease() {
        let dropped = || redis::RedisError::from((redis::ErrorKind::Io, "connection dropped"));
        let refused = || redis::RedisError::from((redis::ErrorKind::Client, "refused"));
        let tries = std::cell::Cell::new(0);
        let lease_end = Instant::now() + Duration::from_secs(30);
        let settled = settle_retried("shard 0", lease_end, || {
            tries.set(tries.get() + 1);
            let n = tries.get();
            async move {
                if n < 3 {
                    Err(dropped())
                } else {
                    Ok(Settled {
                        settled: 5,
                        fenced: 0,
                    })
                }
            }
        })
        .await
        .expect("settled on the third try");
        assert_eq!((tries.get(), settled.settled), (3, 5));
        // Not a passing fault: no second try.
        tries.set(0);
        let err = settle_retried("shard 0", lease_end, || {
            tries.set(tries.get() + 1);
            async { Err(refused()) }
        })
        .await;
        assert!(err.is_err() && tries.get() == 1);
        // Past the lease nothing is sent again: the jobs are queued again anyway.
        tries.set(0);
        let soon = Instant::now() + Duration::from_millis(120);
        let err = settle_retried("shard 0", soon, || {
            tries.set(tries.get() + 1);
            async { Err(dropped()) }
        })
        .await;
        assert!(err.is_err());
        assert!(tries.get() <= 3, "{} tries in 120 ms", tries.get());
    }

    #[test]
    fn same_seed_same_delays() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(10);
        let a: Vec<_> = {
            let mut rng = rand::rngs::StdRng::seed_from_u64(1);
            (0..5)
                .map(|n| retry_delay(n, base, cap, &mut rng))
                .collect()
        };
        let b: Vec<_> = {
            let mut rng = rand::rngs::StdRng::seed_from_u64(1);
            (0..5)
                .map(|n| retry_delay(n, base, cap, &mut rng))
                .collect()
        };
        assert_eq!(a, b);
    }
}
