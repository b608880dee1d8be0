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
//! Wake-ups come from the shard's mover when it queued jobs for this sink; otherwise the
//! publisher looks every [`IDLE_CLAIM`] (jobs another daemon released, leases that ran out).

use super::context::{PollerContext, RawSource, TargetId};
use super::delivery;
use super::mover::Backoff;
use crate::metrics;
use crate::sinks::SinkHandle;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use zdelay_client::store::scripts;

/// Longest wait between two claims without a wake-up.
const IDLE_CLAIM: Duration = Duration::from_secs(1);

/// Publishes `sink`'s jobs of `shard` until `stop`. The batch in hand is always published
/// and settled first.
pub async fn run(
    ctx: Arc<PollerContext>,
    shard: u16,
    sink: Arc<SinkHandle>,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    let keys = ctx.keys.shard(shard);
    let policy = &ctx.delivery;
    let mut backoff = Backoff::new();
    let label = format!("sink {} shard {shard}", sink.name);
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
        let lease_ms = policy.lease.as_millis() as u64;
        let claim = scripts::claim_jobs(
            &mut ctx.con_for(&TargetId::Shard(shard)),
            &keys,
            &sink.name,
            policy.batch,
            lease_ms,
            policy.batch_bytes.min(sink.bytes_bound()),
        )
        .await;
        let wait = match claim {
            Ok(claim) if claim.jobs.is_empty() => {
                backoff.reset();
                metrics::recovered("redis", &label);
                IDLE_CLAIM
            }
            Ok(claim) => {
                permit.keep(claim.bytes());
                backoff.reset();
                match delivery::deliver(&ctx, shard, &sink, &claim, claimed_at).await {
                    Ok(_) => metrics::recovered("redis", &label),
                    // The batch stays in flight; its lease lapses wherever it lands.
                    Err(e) if ctx.is_refusal(&e) => break,
                    Err(e) => metrics::error_event("redis", &label, &e),
                }
                if claim.more || claim.jobs.len() >= policy.batch {
                    // More may wait: go again at once.
                    Duration::ZERO
                } else {
                    IDLE_CLAIM
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

/// Publishes the due members of a raw source whose route is two-phase, until `stop`: claims
/// them by lease inside the source (`claim_raw`), publishes them through `sink`, settles them
/// (`settle_raw`). A paused sink claims nothing: the members wait in the source, untouched.
/// Woken by keyspace notifications (when the server sends them) or every idle poll.
pub async fn run_raw(
    ctx: Arc<PollerContext>,
    source: Arc<RawSource>,
    sink: Arc<SinkHandle>,
    wake: Arc<Notify>,
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
                    ctx.mover.idle_poll
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
