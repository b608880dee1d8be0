//! The move loop: one poller per owned shard and one per raw source.
//!
//! Each turn runs one move script (`move_due` for a shard, `move_raw` for a raw source),
//! which reads "now" from Redis `TIME` on every call, moves up to `batch` due jobs onto
//! their lists, and returns the new head's score. After a full batch the poller goes again
//! at once; otherwise it sleeps until the head is due (measured against Redis's clock, so
//! the poller's own clock does not matter), a wake-up arrives (an enqueue that made a new
//! head), the idle-poll fallback elapses, or shutdown is asked. A script call in progress
//! always finishes: it is atomic, and shutdown is only checked between calls.
//!
//! Errors never end the loop: they are logged, counted, and retried with capped backoff.

use crate::config::{Config, PollerConfig, ScoreUnit, SourceConfig};
use crate::delivery;
use crate::keys::{self, Keys};
use crate::metrics::{
    self, BATCH_SIZE, JOBS_DEAD, JOBS_MOVED, LATENESS_BOUNDS_MS, LEASES_EXPIRED, POSTPONED,
    SCRIPT_DURATION,
};
use crate::scripts::{self, DUE_DEAD_KINDS, MoveReply, RAW_DEAD_KINDS};
use crate::sinks::{LocalRoutes, RemoteRoutes, SinkHandle};
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Longest time a paused sink's jobs are pushed back at once; bounds the extra latency
/// after the sink recovers.
const MAX_POSTPONE: Duration = Duration::from_secs(5);

/// Label of envelope shards in per-source metrics.
pub const ENVELOPE_SOURCE: &str = "jobs";

/// Sees every successful move reply; the benchmark uses it to count and time batches.
pub type BatchObserver = Arc<dyn Fn(&Target, &MoveReply) + Send + Sync>;

/// What every poller of one daemon shares.
pub struct PollerContext {
    pub con: ConnectionManager,
    pub keys: Keys,
    pub routes: LocalRoutes,
    pub batch: usize,
    pub idle_poll: Duration,
    pub max_payload: usize,
    /// Lateness bucket bounds passed to the scripts; the metrics' by default.
    pub bounds_ms: Vec<u64>,
    pub observer: Option<BatchObserver>,
    /// Two-phase destinations, and their sinks by name.
    pub remote: RemoteRoutes,
    pub sinks: HashMap<String, Arc<SinkHandle>>,
    pub lease: Duration,
    pub sink_pause: Duration,
    pub max_attempts: u32,
    pub retry_base: Duration,
    pub retry_cap: Duration,
}

impl PollerContext {
    /// `sinks`: the two-phase sinks by name (empty when every route is local).
    pub fn new(
        con: ConnectionManager,
        config: &Config,
        sinks: HashMap<String, Arc<SinkHandle>>,
    ) -> Self {
        let PollerConfig {
            batch,
            idle_poll,
            max_payload,
            lease,
            sink_pause,
            max_attempts,
            retry_base,
            retry_cap,
            ..
        } = config.poller;
        PollerContext {
            con,
            keys: Keys::new(&config.redis.namespace, config.redis.shards),
            routes: LocalRoutes::from_config(config),
            batch,
            idle_poll,
            max_payload,
            bounds_ms: LATENESS_BOUNDS_MS.to_vec(),
            observer: None,
            remote: RemoteRoutes::from_config(config),
            sinks,
            lease,
            sink_pause,
            max_attempts,
            retry_base,
            retry_cap,
        }
    }
}

/// A raw source resolved against its route.
#[derive(Debug, Clone)]
pub struct RawSource {
    pub key: String,
    pub dead_key: String,
    pub reasons_key: String,
    pub unit: ScoreUnit,
    pub list: String,
    pub command: &'static str,
    pub route: String,
}

impl RawSource {
    /// `None` when the source's route is not a local list route.
    pub fn resolve(source: &SourceConfig, routes: &LocalRoutes) -> Option<Self> {
        let route = routes.find(&source.route)?;
        let dead_key = source.dead_key();
        Some(RawSource {
            key: source.key.clone(),
            reasons_key: keys::raw_dead_reasons(&dead_key),
            dead_key,
            unit: source.score_unit,
            list: route.list.clone(),
            command: route.command,
            route: route.name.clone(),
        })
    }
}

/// What one poller moves from.
#[derive(Debug, Clone)]
pub enum Target {
    Shard(u16),
    Source(Arc<RawSource>),
}

impl Target {
    fn unit(&self) -> ScoreUnit {
        match self {
            Target::Shard(_) => ScoreUnit::Millis,
            Target::Source(s) => s.unit,
        }
    }

    fn label(&self) -> String {
        match self {
            Target::Shard(_) => ENVELOPE_SOURCE.to_owned(),
            Target::Source(s) => s.key.clone(),
        }
    }
}

/// Runs one move script call. `now_ms` overrides Redis TIME (tests drive time with it).
pub async fn move_once(
    ctx: &PollerContext,
    target: &Target,
    now_ms: Option<i64>,
) -> redis::RedisResult<MoveReply> {
    let now = now_ms.map(|n| n.to_string()).unwrap_or_default();
    let mut con = ctx.con.clone();
    match target {
        Target::Shard(shard) => {
            let paused: Vec<&Arc<SinkHandle>> =
                ctx.sinks.values().filter(|s| s.is_paused()).collect();
            // Postpone a paused sink's jobs for the rest of its pause: with a long outage,
            // a backlog is rewritten every few seconds, not every `sink_pause`.
            let postpone = paused
                .iter()
                .map(|s| s.pause_remaining())
                .max()
                .unwrap_or_default()
                .clamp(ctx.sink_pause, MAX_POSTPONE.max(ctx.sink_pause));
            let paused: Vec<&str> = paused.iter().map(|s| s.name.as_str()).collect();
            let mut inv = scripts::move_due.prepare_invoke();
            inv.key(ctx.keys.due(*shard))
                .key(ctx.keys.jobs(*shard))
                .key(ctx.keys.dead(*shard))
                .key(ctx.keys.reasons(*shard))
                .key(ctx.keys.inflight(*shard))
                .key(ctx.keys.scheduled(*shard))
                .arg(ctx.batch)
                .arg(&now)
                .arg(ctx.max_payload)
                .arg(ctx.lease.as_millis() as u64)
                .arg(postpone.as_millis() as u64);
            ctx.routes.apply(&mut inv);
            ctx.remote.apply(&mut inv, &paused);
            inv.arg(ctx.bounds_ms.len()).arg(&ctx.bounds_ms);
            let value = inv.invoke_async(&mut con).await?;
            MoveReply::parse(value, ctx.routes.routes.len(), ctx.bounds_ms.len())
        }
        Target::Source(source) => {
            let value = scripts::move_raw
                .key(&source.key)
                .key(&source.list)
                .key(&source.dead_key)
                .key(&source.reasons_key)
                .arg(ctx.batch)
                .arg(&now)
                .arg(source.unit.as_arg())
                .arg(ctx.max_payload)
                .arg(source.command)
                .arg(ctx.bounds_ms.len())
                .arg(&ctx.bounds_ms)
                .invoke_async(&mut con)
                .await?;
            MoveReply::parse(value, 1, ctx.bounds_ms.len())
        }
    }
}

/// How long to sleep after a batch that was not full: until the head is due, at most
/// `idle`. Both times come from Redis, so local clock skew does not matter.
pub fn sleep_after(reply: &MoveReply, unit: ScoreUnit, idle: Duration) -> Duration {
    match reply.next_due {
        None => idle,
        Some(score) => {
            let wait_us = unit.to_ms(score) * 1000.0 - reply.now_us as f64;
            if wait_us <= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_micros(wait_us.ceil() as u64).min(idle)
            }
        }
    }
}

/// Capped exponential backoff for errors.
struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_secs(5);

    fn new() -> Self {
        Backoff { next: Self::FIRST }
    }
    fn step(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        now
    }
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// One poller: moves from `target` until `shutdown`.
pub async fn run(
    ctx: Arc<PollerContext>,
    target: Target,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let label = target.label();
    let script = match target {
        Target::Shard(_) => "move_due",
        Target::Source(_) => "move_raw",
    };
    let mut backoff = Backoff::new();
    tracing::debug!(source = %label, ?target, "poller started");
    while !shutdown.is_cancelled() {
        let started = Instant::now();
        let delay = match move_once(&ctx, &target, None).await {
            Ok(reply) => {
                ::metrics::histogram!(SCRIPT_DURATION, "script" => script)
                    .record(started.elapsed().as_secs_f64());
                record(&ctx, &target, &label, &reply);
                if let Some(observe) = &ctx.observer {
                    observe(&target, &reply);
                }
                if let (Target::Shard(shard), false) = (&target, reply.claimed.is_empty()) {
                    // The batch in hand: publish and settle before anything else, even
                    // when shutdown was asked meanwhile.
                    if let Err(e) = delivery::deliver(&ctx, *shard, &reply, started).await {
                        metrics::error_event("redis", &label, &e);
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
                    backoff.reset();
                    if reply.taken >= ctx.batch {
                        // More are due: go again at once, but let other tasks run.
                        tokio::task::yield_now().await;
                        continue;
                    }
                    sleep_after(&reply, target.unit(), ctx.idle_poll)
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
            _ = tokio::time::sleep(delay) => {}
            _ = wake.notified() => {}
            _ = shutdown.cancelled() => {}
        }
    }
    tracing::debug!(source = %label, "poller stopped");
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
    if reply.postponed > 0 {
        ::metrics::counter!(POSTPONED).increment(reply.postponed);
    }
    if reply.taken == 0 {
        return;
    }
    ::metrics::histogram!(BATCH_SIZE).record(reply.taken as f64);
    match target {
        Target::Shard(_) => {
            for (route, &n) in ctx.routes.routes.iter().zip(&reply.moved) {
                if n > 0 {
                    ::metrics::counter!(JOBS_MOVED, "route" => route.name.clone()).increment(n);
                }
            }
        }
        Target::Source(s) => {
            ::metrics::counter!(JOBS_MOVED, "route" => s.route.clone())
                .increment(reply.moved_total());
        }
    }
    let kinds = match target {
        Target::Shard(_) => &DUE_DEAD_KINDS,
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
    fn sleeps_until_the_head_is_due_by_redis_time() {
        let idle = Duration::from_millis(100);
        let r = reply(1_000_000_000, Some(1_000_007.0));
        assert_eq!(
            sleep_after(&r, ScoreUnit::Millis, idle),
            Duration::from_millis(7)
        );
        let r = reply(1_000_000_000, Some(1_000.5));
        assert_eq!(
            sleep_after(&r, ScoreUnit::Seconds, Duration::from_secs(1)),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn sleep_is_capped_by_idle_and_never_negative() {
        let idle = Duration::from_millis(100);
        assert_eq!(sleep_after(&reply(0, None), ScoreUnit::Millis, idle), idle);
        assert_eq!(
            sleep_after(&reply(5_000_000, Some(1.0)), ScoreUnit::Millis, idle),
            Duration::ZERO
        );
        assert_eq!(
            sleep_after(&reply(0, Some(1e12)), ScoreUnit::Millis, idle),
            idle
        );
    }

    #[test]
    fn backoff_doubles_to_a_cap_and_resets() {
        let mut b = Backoff::new();
        let steps: Vec<_> = (0..10).map(|_| b.step()).collect();
        assert_eq!(steps[0], Duration::from_millis(50));
        assert_eq!(steps[1], Duration::from_millis(100));
        assert_eq!(*steps.last().unwrap(), Duration::from_secs(5));
        b.reset();
        assert_eq!(b.step(), Duration::from_millis(50));
    }
}
