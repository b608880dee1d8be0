//! One shard's publisher for one two-phase sink: claims the jobs waiting for the sink in the
//! shard's ready set (`claim_jobs`), publishes them and settles them (`delivery`), and goes
//! again while jobs wait.
//!
//! Each (shard, sink) pair has its own publisher, so a broker that is slow or hung holds up
//! only its own jobs: the shard's mover keeps moving local routes, and other sinks keep
//! publishing. A sink's publishers share its in-flight bounds (`poller.sink_concurrency`
//! batches and `poller.sink_inflight_bytes` bytes), taken before claiming, so no lease runs
//! while a batch waits for room: each claim reserves up to `poller.batch_bytes`, claims at
//! most that, and gives back at once what it did not take. While the sink is paused they
//! claim nothing: its jobs wait in the ready set, untouched, until it is back.
//!
//! Wake-ups come from the shard's mover when it queued jobs for this sink (leases that ran
//! out included: the mover wakes at the earliest lease deadline and requeues their jobs).
//! Otherwise the publisher looks again shortly after the earliest lease deadline (a mover of
//! another daemon may requeue those jobs), and at the latest after [`IDLE_CLAIM`], or
//! `poller.idle_poll_max` while wake-ups are known to reach the shard (jobs another daemon
//! queued or released for this sink wait at most that long).

use super::context::{PollerContext, RawSource, ReadyPart, TargetId};
use super::delivery;
use super::mover::Backoff;
use super::takes::Link;
use super::wake::Waker;
use crate::metrics;
use crate::sinks::SinkHandle;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay_core::envelope::Envelope;
use zdelay_core::routes::FlowPart;
use zdelay_core::store::scripts::{self, KeyTurn};

/// Longest wait between two claims without a wake-up while wake-ups are not known to reach
/// the shard.
const IDLE_CLAIM: Duration = Duration::from_secs(1);

/// How long to wait after a claim that took less than a batch: until `at_ms` (Redis time; its
/// `now_us` from the same reply) plus `margin`, at most `idle`; `margin` alone when `at_ms`
/// has passed.
fn wait_until(at_ms: Option<i64>, now_us: i64, margin: Duration, idle: Duration) -> Duration {
    let Some(at_ms) = at_ms else {
        return idle;
    };
    let wait_us = at_ms.saturating_mul(1000).saturating_sub(now_us).max(0) as u64;
    (Duration::from_micros(wait_us) + margin).min(idle)
}

/// Publishes the jobs of `part` (a sink's own part of `shard`'s ready set, or a route's flow
/// part) until `stop`. The batch in hand is always published and settled first. A flow part
/// claims only what its route's flow hash admits (`take_flow`: its rate's tokens, and for a
/// bound the room its destination has, one publisher at a time): while none is admitted it
/// sleeps until the bucket has tokens again or looks at the destination again shortly, and
/// its jobs wait in the part, holding nothing else up.
pub async fn run(
    ctx: Arc<PollerContext>,
    shard: u16,
    part: Arc<ReadyPart>,
    wake: Waker,
    link: Arc<Link>,
    stop: CancellationToken,
) {
    let keys = ctx.keys.shard(shard);
    let policy = &ctx.delivery;
    let sink = &part.sink;
    let mut backoff = Backoff::new();
    let label = format!("sink {} shard {shard}", part.name);
    let gate = part
        .flow
        .as_ref()
        .filter(|flow| flow.gated())
        .map(|flow| Gate::new(&ctx, shard, flow));
    // A flow part's last claim found it empty, and no wake-up came since: while its bound
    // holds, it waits for a wake-up instead of asking the destination every recheck.
    let mut found_empty = false;
    zdelay_core::failpoint::hold("publisher_start").await;
    // From now on the shard's mover may claim this part's jobs for it.
    link.mark_started();
    while !stop.is_cancelled() {
        if sink.is_paused() {
            tokio::select! {
                _ = sink.wait_resumed(sink.pause_remaining().max(Duration::from_millis(10))) => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        // The part's turn (the mover may hold it for a batch it claimed), then the sink's room.
        let mut permit = tokio::select! {
            room = link.room(sink, policy.batch_bytes) => room,
            _ = stop.cancelled() => break,
        };
        let admitted = match &gate {
            None => None,
            Some(gate) => match gate.admit(sink, policy.batch).await {
                Ok(Ok(admitted)) => Some(admitted),
                Ok(Err(wait)) => {
                    // Nothing admitted: the jobs wait in the part. A wake-up from the mover
                    // (more jobs queued) changes nothing before then, unless the part was
                    // empty: then only a wake-up (or the idle poll) is worth a look.
                    drop(permit);
                    backoff.reset();
                    if found_empty && gate.bounded {
                        let idle = wake.idle(IDLE_CLAIM, ctx.mover.idle_poll_max.max(IDLE_CLAIM));
                        tokio::select! {
                            _ = tokio::time::sleep(idle) => {}
                            _ = wake.notified() => found_empty = false,
                            _ = stop.cancelled() => {}
                        }
                    } else {
                        sleep_or_stop(wait, &stop).await;
                    }
                    continue;
                }
                Err(e) if ctx.is_refusal(&e) => break,
                Err(e) => {
                    metrics::error_event("redis", &label, &e);
                    drop(permit);
                    sleep_or_stop(backoff.step(), &stop).await;
                    continue;
                }
            },
        };
        let batch = admitted.as_ref().map_or(policy.batch, |a| a.limit);
        let claimed_at = Instant::now();
        let lease_ms = policy.lease.as_millis() as u64;
        let claim = scripts::claim_jobs(
            &mut ctx.con_for(&TargetId::Shard(shard)),
            &keys,
            &part.name,
            batch,
            lease_ms,
            policy.batch_bytes.min(sink.bytes_bound()),
        )
        .await;
        // A per-key rate admits each claimed job by its key: the others go back due at their
        // turn, unpublished, and give the route's tokens back.
        let turns = match (&claim, &part.flow) {
            (Ok(c), Some(flow)) if !c.jobs.is_empty() => key_turns(&ctx, shard, flow, c).await,
            _ => Ok(Vec::new()),
        };
        let (claim, turns) = match turns {
            Ok(turns) => (claim, turns),
            // The claimed jobs stay leased: they come back when their lease runs out.
            Err(e) => (Err(e), Vec::new()),
        };
        let later = turns
            .iter()
            .filter(|t| matches!(t, KeyTurn::Later(_)))
            .count();
        let done = match (&gate, &admitted) {
            (Some(gate), Some(a)) => {
                let (used, more) = claim
                    .as_ref()
                    .map_or((0, false), |c| (c.jobs.len() - later, c.more));
                let done = a.done(used, more, claim.is_ok());
                found_empty = claim.is_ok() && used == 0;
                // A rate's unused tokens go back at once (other shards may use them); a
                // bound's lock once the claim's jobs are published, so the next admission
                // counts them at the destination.
                if !gate.bounded {
                    gate.finish(&done, &label).await;
                }
                Some(done)
            }
            _ => None,
        };
        let held_since_ms = admitted.as_ref().and_then(|a| a.taken.held_since_ms);
        // A lease that runs out is found by a mover; this one's wakes us, another daemon's
        // does not: look again a fallback poll after the deadline.
        let idle = wake.idle(IDLE_CLAIM, ctx.mover.idle_poll_max.max(IDLE_CLAIM));
        let after_leases =
            |c: &scripts::Claim| wait_until(c.next_lease_ms, c.now_us, ctx.mover.idle_poll, idle);
        let wait = match claim {
            Ok(claim) if claim.jobs.is_empty() => {
                backoff.reset();
                metrics::recovered("redis", &label);
                after_leases(&claim)
            }
            Ok(claim) => {
                permit.keep(claim.bytes());
                backoff.reset();
                let claimed = delivery::ClaimedBatch {
                    part: &part.name,
                    claim: &claim,
                    claimed_at,
                    held_since_ms,
                    turns: &turns,
                };
                match delivery::deliver(&ctx, shard, sink, &claimed).await {
                    Ok(_) => metrics::recovered("redis", &label),
                    // The batch stays in flight; its lease lapses wherever it lands.
                    Err(e) if ctx.is_refusal(&e) => break,
                    Err(e) => metrics::error_event("redis", &label, &e),
                }
                let again = admitted.as_ref().and_then(|a| a.again(claim.jobs.len()));
                if claim.more || claim.jobs.len() >= policy.batch {
                    // More may wait: go again at once.
                    Duration::ZERO
                } else if let Some(at_ms) = again {
                    // A limit cut the claim and more may wait: again once it may move.
                    let now_us = admitted.as_ref().map_or(0, |a| a.taken.now_ms * 1000);
                    wait_until(Some(at_ms), now_us, Duration::ZERO, idle)
                        .max(Duration::from_millis(1))
                } else {
                    after_leases(&claim)
                }
            }
            Err(e) if ctx.is_refusal(&e) => break,
            Err(e) => {
                metrics::error_event("redis", &label, &e);
                backoff.step()
            }
        };
        if let (Some(gate), Some(done)) = (&gate, &done)
            && gate.bounded
        {
            gate.finish(done, &label).await;
        }
        // The part's turn too: the mover claims for it while this publisher waits.
        drop(permit);
        if wait.is_zero() {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = wake.notified() => found_empty = false,
            _ = stop.cancelled() => {}
        }
    }
}

/// Each claimed job's admission by its key (`take_keys`), for a route with a per-key rate
/// (none for another route). A job whose envelope cannot be read is asked for with the key
/// `""`; its publish sends it to dead.
async fn key_turns(
    ctx: &PollerContext,
    shard: u16,
    flow: &FlowPart,
    claim: &scripts::Claim,
) -> redis::RedisResult<Vec<KeyTurn>> {
    let Some((header, rate, burst)) = &flow.per_key else {
        return Ok(Vec::new());
    };
    let keys: Vec<String> = claim
        .jobs
        .iter()
        .map(|job| {
            Envelope::decode(&job.envelope)
                .ok()
                .and_then(|e| e.meta.headers.get(header).cloned())
                .unwrap_or_default()
        })
        .collect();
    let jobs: Vec<(&str, &str)> = claim
        .jobs
        .iter()
        .zip(&keys)
        .map(|(job, key)| (job.id.as_str(), key.as_str()))
        .collect();
    // The route's keys are in the registry's slot, as `take_flow`'s.
    scripts::take_keys(
        &mut ctx.con.clone(),
        &ctx.keys,
        &flow.route,
        shard,
        (*rate, *burst),
        None,
        &jobs,
    )
    .await
}

/// A flow part's admission: one publisher's side of its route's flow hash (`take_flow`).
struct Gate<'a> {
    ctx: &'a PollerContext,
    shard: u16,
    flow: &'a FlowPart,
    key: String,
    /// The route has a bound: admissions take its lock, and read its destination's depth.
    bounded: bool,
    /// This publisher's lock token.
    token: String,
}

/// What one admission granted.
struct Admitted {
    taken: scripts::FlowTaken,
    /// Jobs the claim may take: the grant, at most the destination's room.
    limit: usize,
    /// The bound cut the grant: the destination is full up to `limit`.
    cut_by_bound: bool,
}

/// What one admitted claim leaves to report.
struct Done {
    give_back: usize,
    found: scripts::Found,
}

impl Admitted {
    fn done(&self, used: usize, more: bool, claimed: bool) -> Done {
        let found = if claimed && used < self.limit && !more {
            scripts::Found::CaughtUp
        } else if self.cut_by_bound && used >= self.limit {
            scripts::Found::Held
        } else {
            scripts::Found::Nothing
        };
        Done {
            give_back: self.taken.granted - used.min(self.taken.granted),
            found,
        }
    }

    /// When to claim again after a claim of `used` jobs that a limit cut (ms), if one did.
    fn again(&self, used: usize) -> Option<i64> {
        if used < self.limit {
            return None;
        }
        if self.cut_by_bound {
            return Some(self.taken.now_ms + scripts::HOLD_RECHECK_MS as i64);
        }
        self.taken.wake_ms
    }
}

impl<'a> Gate<'a> {
    fn new(ctx: &'a PollerContext, shard: u16, flow: &'a FlowPart) -> Self {
        Gate {
            ctx,
            shard,
            flow,
            key: ctx.keys.route_flow(&flow.route),
            bounded: flow.max_length.is_some(),
            token: ulid::Ulid::generate().to_string(),
        }
    }

    fn args(&self, want: usize) -> scripts::TakeFlow<'_> {
        scripts::TakeFlow {
            shard: self.shard,
            want,
            give_back: 0,
            found: scripts::Found::Nothing,
            now_ms: None,
            rate: self.flow.rate,
            lock: self.bounded.then_some((
                self.token.as_str(),
                self.ctx.delivery.lease.as_millis() as u64,
            )),
            release: false,
        }
    }

    async fn call(&self, take: &scripts::TakeFlow<'_>) -> redis::RedisResult<scripts::FlowTaken> {
        scripts::take_flow(&mut self.ctx.con.clone(), &self.key, take).await
    }

    /// Asks for up to `batch` jobs: `Ok(Ok(_))` what may be claimed, `Ok(Err(wait))` none
    /// (look again after `wait`).
    async fn admit(
        &self,
        sink: &SinkHandle,
        batch: usize,
    ) -> redis::RedisResult<Result<Admitted, Duration>> {
        let taken = self.call(&self.args(batch)).await?;
        let recheck = Duration::from_millis(scripts::HOLD_RECHECK_MS);
        if taken.granted == 0 {
            let wait = wait_until(
                taken.wake_ms,
                taken.now_ms * 1000,
                Duration::ZERO,
                recheck * 20,
            );
            // Another publisher holds the bound's lock: it releases it within a publish.
            let wait = if self.bounded {
                wait.min(recheck)
            } else {
                wait
            };
            return Ok(Err(wait.max(Duration::from_millis(1))));
        }
        let Some(bound) = self.flow.max_length else {
            let limit = taken.granted;
            return Ok(Ok(Admitted {
                taken,
                limit,
                cut_by_bound: false,
            }));
        };
        let context = format!("route {} max_length", self.flow.route);
        let room = match sink.sink.depth(&self.flow.target).await {
            Ok(depth) => {
                metrics::recovered("sink_depth", &context);
                bound.saturating_sub(depth) as usize
            }
            Err(why) => {
                // Unknown room is no room: the jobs wait, and the depth is asked again.
                metrics::error_event("sink_depth", &context, &why);
                let done = Done {
                    give_back: taken.granted,
                    found: scripts::Found::Nothing,
                };
                self.finish(&done, &context).await;
                return Ok(Err(recheck * 4));
            }
        };
        let cut_by_bound = room < taken.granted;
        if room == 0 {
            let done = Done {
                give_back: taken.granted,
                found: scripts::Found::Held,
            };
            self.finish(&done, "").await;
            return Ok(Err(recheck));
        }
        Ok(Ok(Admitted {
            limit: room.min(taken.granted),
            taken,
            cut_by_bound,
        }))
    }

    /// Gives back what the claim did not use, says what it found, and releases the lock.
    async fn finish(&self, done: &Done, label: &str) {
        let take = scripts::TakeFlow {
            give_back: done.give_back,
            found: done.found,
            release: true,
            ..self.args(0)
        };
        // Nothing to give back, say or release: no call.
        if done.give_back == 0 && done.found == scripts::Found::Nothing && !self.bounded {
            return;
        }
        if let Err(e) = self.call(&take).await {
            metrics::error_event("redis", label, &e);
        }
    }
}

async fn sleep_or_stop(wait: Duration, stop: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(wait) => {}
        _ = stop.cancelled() => {}
    }
}

/// Publishes the due members of a raw source whose route is two-phase, until `stop`: claims
/// them by lease inside the source (`claim_raw`), publishes them through `sink`, settles them
/// (`settle_raw`). A paused sink claims nothing: the members wait in the source, untouched.
/// Woken by keyspace notifications (when the server sends them); otherwise it sleeps until
/// the source's lowest score (the next member due, or the next lease to run out), at most
/// the idle poll (`idle_poll_max` while the source's events are known to arrive).
pub async fn run_raw(
    ctx: Arc<PollerContext>,
    source: Arc<RawSource>,
    sink: Arc<SinkHandle>,
    wake: Waker,
    stop: CancellationToken,
) {
    let policy = &ctx.delivery;
    let mut backoff = Backoff::new();
    let label = source.keys.source.clone();
    while !stop.is_cancelled() {
        if sink.is_paused() {
            tokio::select! {
                _ = sink.wait_resumed(sink.pause_remaining().max(Duration::from_millis(10))) => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        let mut permit = tokio::select! {
            permit = sink.permit(policy.batch_bytes) => permit,
            _ = stop.cancelled() => break,
        };
        let claimed_at = Instant::now();
        let claim = scripts::claim_raw(
            &mut ctx.con_for(&TargetId::Source(source.keys.source.clone())),
            &source.keys,
            source.unit,
            policy.batch,
            policy.lease.as_millis() as u64,
            policy.max_payload,
            policy.batch_bytes.min(sink.bytes_bound()),
        )
        .await;
        let wait = match claim {
            Ok(claim) => {
                permit.keep(claim.bytes());
                backoff.reset();
                let full = claim.more || claim.members.len() >= policy.batch;
                match delivery::deliver_raw(&ctx, &source, &sink, &claim, claimed_at).await {
                    Ok(_) => metrics::recovered("redis", &label),
                    Err(e) => metrics::error_event("redis", &label, &e),
                }
                if full {
                    Duration::ZERO
                } else {
                    let idle = wake.idle(ctx.mover.idle_poll, ctx.mover.idle_poll_max);
                    // A millisecond past the head: its score may fall inside the current one.
                    wait_until(
                        claim.next_due_ms,
                        claim.now_us,
                        Duration::from_millis(1),
                        idle,
                    )
                }
            }
            Err(e) => {
                metrics::error_event("redis", &label, &e);
                backoff.step()
            }
        };
        drop(permit);
        if wait.is_zero() {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = wake.notified() => {}
            _ = stop.cancelled() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_publisher_waits_until_the_next_lease_deadline_plus_a_margin_at_most_idle() {
        let (margin, idle) = (Duration::from_millis(100), Duration::from_secs(5));
        let now_us = 1_000_000_000;
        assert_eq!(
            wait_until(None, now_us, margin, idle),
            idle,
            "nothing in flight"
        );
        assert_eq!(
            wait_until(Some(1_000_250), now_us, margin, idle),
            Duration::from_millis(350)
        );
        assert_eq!(
            wait_until(Some(999_000), now_us, margin, idle),
            margin,
            "a deadline passed: a mover requeues it, look after the margin"
        );
        assert_eq!(wait_until(Some(1_060_000), now_us, margin, idle), idle);
        assert_eq!(
            wait_until(Some(1_000_000), now_us + 400, Duration::ZERO, idle),
            Duration::ZERO
        );
    }
}
