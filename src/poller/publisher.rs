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
use super::wake::Waker;
use crate::metrics;
use crate::sinks::SinkHandle;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay_client::routes::FlowPart;
use zdelay_client::store::scripts;

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
/// claims only what its route's bucket grants (`take_flow`): while the bucket is empty it
/// sleeps until the bucket has tokens again, and its jobs wait in the part, holding nothing
/// else up.
pub async fn run(
    ctx: Arc<PollerContext>,
    shard: u16,
    part: Arc<ReadyPart>,
    wake: Waker,
    stop: CancellationToken,
) {
    let keys = ctx.keys.shard(shard);
    let policy = &ctx.delivery;
    let sink = &part.sink;
    let mut backoff = Backoff::new();
    let label = format!("sink {} shard {shard}", part.name);
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
        let taken = match &part.flow {
            None => None,
            Some(flow) => match take(&ctx, shard, flow, policy.batch, 0, false).await {
                Ok(taken) => Some(taken),
                Err(e) if ctx.is_refusal(&e) => break,
                Err(e) => {
                    metrics::error_event("redis", &label, &e);
                    drop(permit);
                    sleep_or_stop(backoff.step(), &stop).await;
                    continue;
                }
            },
        };
        let batch = taken.as_ref().map_or(policy.batch, |t| t.granted);
        if batch == 0 {
            // The route's bucket is empty: its jobs wait here until it has tokens again. A
            // wake-up from the mover (more jobs queued) changes nothing before then.
            drop(permit);
            let idle = wake.idle(IDLE_CLAIM, ctx.mover.idle_poll_max.max(IDLE_CLAIM));
            let wait = taken.as_ref().map_or(idle, |t| {
                wait_until(t.wake_ms, t.now_ms * 1000, Duration::ZERO, idle)
            });
            sleep_or_stop(wait.max(Duration::from_millis(1)), &stop).await;
            continue;
        }
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
        if let (Some(flow), Some(t)) = (&part.flow, &taken) {
            // Tokens the claim did not use go back at once: other shards may use them.
            let (used, more) = claim
                .as_ref()
                .map_or((0, false), |c| (c.jobs.len(), c.more));
            if used < t.granted {
                let caught_up = claim.is_ok() && !more;
                if let Err(e) = take(&ctx, shard, flow, 0, t.granted - used, caught_up).await {
                    metrics::error_event("redis", &label, &e);
                }
            }
        }
        let held_since_ms = taken.as_ref().and_then(|t| t.held_since_ms);
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
                };
                match delivery::deliver(&ctx, shard, sink, &claimed).await {
                    Ok(_) => metrics::recovered("redis", &label),
                    // The batch stays in flight; its lease lapses wherever it lands.
                    Err(e) if ctx.is_refusal(&e) => break,
                    Err(e) => metrics::error_event("redis", &label, &e),
                }
                let cut = taken.as_ref().and_then(|t| t.wake_ms);
                if claim.more || claim.jobs.len() >= policy.batch {
                    // More may wait: go again at once.
                    Duration::ZERO
                } else if let (Some(wake_ms), Some(t)) = (cut, &taken)
                    && claim.jobs.len() >= t.granted
                {
                    // The bucket cut the claim and more may wait: again once it has tokens.
                    wait_until(Some(wake_ms), t.now_ms * 1000, Duration::ZERO, idle)
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

/// One `take_flow` call for `flow`'s bucket from `shard`'s publisher.
async fn take(
    ctx: &PollerContext,
    shard: u16,
    flow: &FlowPart,
    want: usize,
    give_back: usize,
    caught_up: bool,
) -> redis::RedisResult<scripts::FlowTaken> {
    let take = scripts::TakeFlow {
        shard,
        want,
        give_back,
        caught_up,
        now_ms: None,
        rate_per_s: flow.rate_per_s,
        burst: flow.burst,
    };
    scripts::take_flow(
        &mut ctx.con.clone(),
        &ctx.keys.route_flow(&flow.route),
        &take,
    )
    .await
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
