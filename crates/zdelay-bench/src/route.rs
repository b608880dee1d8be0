//! `--route`: confirmed messages/s through one two-phase route, end to end.

use super::Env;
use super::direct::{self, Direct, Plan};
use super::load::{MIN_PAYLOAD, load_jobs_to};
use super::measure::{CallCost, CallLog, process_cpu, redis_cpu, total_size};
use anyhow::Context;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay::poller::{self, Options, Ownership, PollerContext};
use zdelay_core::routes::Resolved;

/// `--route`: throughput of one two-phase route, end to end.
#[derive(Debug, serde::Serialize)]
pub(super) struct SinkDrainReport {
    pub(super) route: String,
    pub(super) sink: String,
    pub(super) kind: String,
    pub(super) jobs: u64,
    pub(super) payload_size: usize,
    pub(super) batch: usize,
    pub(super) shards: u16,
    pub(super) seconds: f64,
    pub(super) per_second: f64,
    pub(super) dead: u64,
    /// Redis CPU per job confirmed (claim, ack and everything else Redis did), µs.
    pub(super) redis_us_per_job: f64,
    /// This process's CPU per job (pollers and the sink's client), µs.
    pub(super) zdelay_us_per_job: f64,
    /// Redis's execution time per job by script and by plain command (the bench's own polls
    /// left out), from `SLOWLOG` recording every call: what the Redis CPU
    /// above goes to. Empty on a cluster, or where `CONFIG` is refused.
    pub(super) by_script: Vec<CallCost>,
    /// The log filled during the window: the sums miss its first calls.
    pub(super) by_script_partial: bool,
    /// The broker's own client publishing the same messages directly, before and after.
    pub(super) direct: Vec<Direct>,
    /// zdelay's rate over the direct runs' mean.
    pub(super) ratio: Option<f64>,
}

pub(super) async fn sink_drain(env: &mut Env, route: &str) -> anyhow::Result<SinkDrainReport> {
    let sinks = zdelay::sinks::build_all(&env.config)?;
    let mut ctx = PollerContext::new(env.con.clone(), &env.config, sinks);
    ctx.mover.batch = env.batch.min(1000);
    let dest = match ctx.routes.resolve(route) {
        Ok(Resolved::TwoPhase(dest)) => dest,
        Ok(Resolved::Local(_)) => {
            anyhow::bail!("--route {route}: a local list route, not two-phase")
        }
        Err(e) => anyhow::bail!("--route {route}: not a two-phase route of the config ({e})"),
    };
    let sink = ctx
        .sinks
        .get(&dest.sink)
        .cloned()
        .with_context(|| format!("sink {} not built", dest.sink))?;
    sink.sink
        .check()
        .await
        .into_result()
        .map_err(|e| anyhow::anyhow!("sink {} is not reachable: {e}", dest.sink))?;
    let n = env.args.jobs;
    let size = env.payload_size().max(MIN_PAYLOAD);
    let sink_config = env
        .config
        .sinks
        .get(&dest.sink)
        .with_context(|| format!("sink {} not configured", dest.sink))?
        .clone();
    // As many unconfirmed as zdelay may hold: a batch per shard.
    let plan = Plan {
        sink: &dest.sink,
        target: &dest.target,
        n,
        size,
        window: env.batch.min(1000) * usize::from(env.scratch.keys.shards()),
    };
    let mut direct = Vec::new();
    direct.extend(direct::publish(&sink_config, &plan).await?);
    let past = env.redis_now_ms() - 1_000;
    // Given the config's routes, the producer registers the route (the lane registry
    // refuses a destination it does not know); its jobs then wait in the spread shards.
    let producer = env
        .producer
        .clone()
        .with_routes(zdelay_core::routes::Routes::from_config(&env.config));
    let keys = env.scratch.keys.clone();
    ctx.with_lanes(keys.clone(), Vec::new());
    load_jobs_to(
        &producer,
        route,
        n,
        size,
        |_| past,
        "loading jobs for the route",
    )
    .await?;
    let jobs_keys: Vec<String> = (0..keys.shards()).map(|s| keys.jobs(s)).collect();
    let dead_keys: Vec<String> = (0..keys.shards()).map(|s| keys.dead(s)).collect();
    let ctx = Arc::new(ctx);
    let ownership = Ownership::new(ctx.all_targets());
    // Recording every call costs Redis a little: the CPU per job above includes it.
    let call_log = CallLog::start(&mut env.con).await;
    let redis_before = redis_cpu(&mut env.con).await?;
    let own_before = process_cpu(std::process::id()).unwrap_or(0.0);
    let started = Instant::now();
    let pollers = poller::start(
        ctx,
        ownership.subscribe(),
        Options::default(),
        &CancellationToken::new(),
    );
    // Done when no job is stored any more: every one was confirmed and acked (or died).
    // Each look costs Redis two commands per shard, which count in its CPU per job: it looks
    // about four times per the time the jobs left need at the rate so far, every 5 ms at
    // the end.
    let elapsed = loop {
        let left = total_size(&mut env.con, "HLEN", &jobs_keys).await?;
        let dead = total_size(&mut env.con, "ZCARD", &dead_keys).await?;
        if left == dead {
            break started.elapsed();
        }
        let done = n.saturating_sub(left) as f64;
        let rate = done / started.elapsed().as_secs_f64().max(1e-3);
        let need = (left - dead) as f64 / rate.max(1.0);
        let wait = Duration::from_secs_f64(need / 4.0)
            .clamp(Duration::from_millis(5), Duration::from_millis(100));
        tokio::time::sleep(wait).await;
    };
    let redis_used = redis_cpu(&mut env.con).await? - redis_before;
    let own_used = process_cpu(std::process::id()).unwrap_or(0.0) - own_before;
    pollers.stop().await;
    let dead = total_size(&mut env.con, "ZCARD", &dead_keys).await?;
    let (by_script, by_script_partial) = match call_log {
        // The completion check above polls with HLEN and ZCARD.
        Some(log) => {
            log.finish(&mut env.con, n - dead, &["hlen", "zcard"])
                .await?
        }
        None => (Vec::new(), false),
    };
    sink.sink.flush(Duration::from_secs(5)).await;
    direct.extend(direct::publish(&sink_config, &plan).await?);
    let per_second = (n - dead) as f64 / elapsed.as_secs_f64();
    let ratio = (!direct.is_empty()).then(|| {
        per_second / (direct.iter().map(|d| d.per_second).sum::<f64>() / direct.len() as f64)
    });
    Ok(SinkDrainReport {
        route: route.to_owned(),
        sink: dest.sink.clone(),
        kind: sink.kind.to_owned(),
        jobs: n,
        payload_size: size,
        batch: env.batch.min(1000),
        shards: keys.shards(),
        seconds: elapsed.as_secs_f64(),
        per_second,
        dead,
        redis_us_per_job: redis_used * 1e6 / (n - dead).max(1) as f64,
        zdelay_us_per_job: own_used * 1e6 / (n - dead).max(1) as f64,
        by_script,
        by_script_partial,
        direct,
        ratio,
    })
}
