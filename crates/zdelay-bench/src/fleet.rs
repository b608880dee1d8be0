//! `--daemons N`: drain and steady measured from outside N `zdelay run` processes
//! (`daemons`), on one Redis or a cluster.
//!
//! Nothing here sees a move reply: what counts is what reaches the list.
//! - drain: `--jobs` jobs are loaded parked (due 2^42 ms, year 2109) while the daemons
//!   idle, then the route's lane (and every spread shard) is rescored to one instant T (Redis
//!   clock + 1 s, more for large keys) with `ZUNIONSTORE due 1 due WEIGHTS T/2^42`,
//!   exact because 2^42 is a power of two, and every mover is woken as an enqueue of a new
//!   head would (an idle one sleeps up to `idle_poll_max`, longer than the lead). From T the
//!   list's length is read every millisecond with the list server's TIME: first seen, all
//!   delivered, then all settled (nothing stored any more: on a cluster the two-phase settles
//!   trail the pushes). A read waits its turn behind the move scripts Redis is running, so
//!   "first seen" can trail the first move by one script; "all delivered" trails the last
//!   move by at most one script.
//! - steady: the in-process producer (`steady::produce`) and consumer (`steady::Consumer`),
//!   with the daemons moving; lateness is the consumer's (Redis TIME after the pop − due).
//!
//! CPU: `INFO cpu` of every Redis node (replicas too), `/proc/<pid>/stat` of every daemon and
//! of this process, over the timed part; their sum over the wall time is how many cores were
//! busy. On a 2-core machine that sum says when the machine, not zdelay, set the pace.

use super::daemons::Daemons;
use super::drain::drain_timeout;
use super::load::{load_jobs, status};
use super::measure::{Nodes, llen, local_now_us, process_cpu, read_first_line};
use super::report::{CpuUse, Fleet, FleetDrain, FleetSteady};
use super::steady::{Consumer, Produced, produce, timer_probe};
use super::tally::fine_bounds;
use super::{Env, Mode, ROUTE, STEADY_DELAY_MS};
use anyhow::{Context, bail, ensure};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay_core::config::RedisConfig;
use zdelay_core::store;

/// Where jobs wait while they load: 2^42 ms after the epoch (year 2109).
pub(super) const PARKED_DUE_MS: i64 = 1 << 42;
/// T, the instant every parked job becomes due, is at least this long after the rescoring
/// started, plus [`RESCORE_US_PER_JOB`] per job in the largest due ZSET (the route's lane
/// holds them all: 200k take about a second to rescore).
const RESCORE_LEAD_MS: i64 = 1_000;
const RESCORE_US_PER_JOB: i64 = 10;

/// How long before T the rescoring of `jobs` parked jobs in one ZSET should start.
pub(super) fn rescore_lead_ms(jobs: u64) -> i64 {
    RESCORE_LEAD_MS + jobs as i64 * RESCORE_US_PER_JOB / 1000
}

/// The ZUNIONSTORE weight that turns the parked score into `t_ms` exactly: the parked score
/// is a power of two, so `t_ms / 2^42` is exact and so is `2^42 × weight`.
pub(super) fn rescore_weight(t_ms: i64) -> f64 {
    t_ms as f64 / PARKED_DUE_MS as f64
}

/// How jobs of the bench route reach the list, on one Redis and on a cluster alike.
const DELIVERY: &str = "exactly once: pushed by move_lane in the list's slot (route lane)";

/// What the bench cannot measure in this set-up.
fn not_measured(cluster: bool) -> Vec<&'static str> {
    let mut out = vec![
        "raw sources (jobs only)",
        "the scripts' own lateness buckets (the daemons' move replies stay in their processes): \
         lateness is the consumer's, Redis TIME after the pop minus the due time",
        "a bare-Lua baseline (it runs in this process): compare with the in-process drain",
    ];
    if cluster {
        out.push("per-node memory and commandstats; network between nodes (all on loopback here)");
    }
    out
}

/// Runs the modes asked for against `n` daemons and returns the report's daemons section.
pub(super) async fn run(env: &mut Env, n: u16) -> anyhow::Result<Fleet> {
    let redis_cfg = env.config.redis.clone();
    let cluster = env.con.is_cluster();
    let mut nodes = Nodes::connect(&mut env.con, &redis_cfg).await?;
    let out_client = list_client(env, &redis_cfg).await?;
    let mut daemons = Daemons::spawn(
        &env.daemon_binary(),
        n,
        &env.config,
        env.batch,
        ROUTE,
        &env.scratch.out,
    )?;
    let mut fleet = Fleet {
        daemons: n as usize,
        pids: daemons.pids(),
        cluster,
        nodes: nodes.list(),
        per_shard: env.config.poller.per_shard,
        delivery: DELIVERY,
        ready_after_s: 0.0,
        drain: Vec::new(),
        steady: Vec::new(),
        exit_codes: Vec::new(),
        not_measured: not_measured(cluster),
    };
    let measured = async {
        fleet.ready_after_s = daemons
            .wait_ready(&mut env.con, Duration::from_secs(60))
            .await?
            .as_secs_f64();
        let all = env.args.mode == Mode::All;
        if all || env.args.mode == Mode::Drain {
            for round in 1..=env.args.rounds {
                let d = drain(env, &mut daemons, &mut nodes, round).await?;
                fleet.drain.push(d);
            }
        }
        if all || env.args.mode == Mode::Steady {
            for rate in env.args.rate.clone() {
                let s = steady(env, &mut daemons, &mut nodes, &out_client, rate).await?;
                fleet.steady.push(s);
            }
        }
        anyhow::Ok(())
    }
    .await;
    if measured.is_err() {
        daemons.keep_logs();
    }
    fleet.exit_codes = daemons.stop().await;
    measured?;
    Ok(fleet)
}

/// A client for the server holding the output list: the one Redis, or on a cluster the
/// master of the list's slot.
async fn list_client(env: &mut Env, cfg: &RedisConfig) -> anyhow::Result<redis::Client> {
    if !env.con.is_cluster() {
        return Ok(env.redis.clone());
    }
    let slot = zdelay_core::keys::slot_of(&env.scratch.out);
    let master = store::slot_masters(&mut env.con)
        .await?
        .master_of(slot)
        .with_context(|| format!("no master serves slot {slot} of {}", env.scratch.out))?;
    Ok(store::client(&RedisConfig {
        url: format!("redis://{master}"),
        cluster_nodes: Vec::new(),
        ..cfg.clone()
    })?)
}

/// CPU counters at the start of a timed part.
pub(super) struct CpuStart {
    redis: Vec<f64>,
    daemons: f64,
    bench: f64,
    at: Instant,
}

impl CpuStart {
    pub(super) async fn now(nodes: &mut Nodes, daemons: &Daemons) -> anyhow::Result<CpuStart> {
        Ok(CpuStart {
            redis: nodes.cpu().await?,
            daemons: daemons.cpu(),
            bench: process_cpu(std::process::id()).unwrap_or(0.0),
            at: Instant::now(),
        })
    }

    pub(super) async fn finish(
        self,
        nodes: &mut Nodes,
        daemons: &Daemons,
    ) -> anyhow::Result<CpuUse> {
        let wall = self.at.elapsed().as_secs_f64();
        let redis: Vec<f64> = nodes
            .cpu()
            .await?
            .iter()
            .zip(&self.redis)
            .map(|(b, a)| b - a)
            .collect();
        let daemons = daemons.cpu() - self.daemons;
        let bench = process_cpu(std::process::id()).unwrap_or(0.0) - self.bench;
        Ok(CpuUse::new(&nodes.list(), redis, daemons, bench, wall))
    }
}

impl Env {
    /// Redis's clock now in ms with µs resolution, estimated from the local clock.
    fn redis_now_ms_f64(&self) -> f64 {
        local_now_us() as f64 / 1000.0 + self.clock_offset_ms as f64
    }

    /// Waits (up to `timeout`) until no job is stored any more; the Redis-clock ms it saw it.
    async fn wait_settled(&mut self, timeout: Duration) -> anyhow::Result<Option<f64>> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stored().await? == 0 {
                return Ok(Some(self.redis_now_ms_f64()));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Rescores the bench route's lane's due ZSET, and every spread shard's, from the parked
/// time to `t_ms` (one command per key, all at once: on a cluster they live on several
/// masters; a key that does not exist stays so).
pub(super) async fn rescore(env: &mut Env, t_ms: i64) -> redis::RedisResult<()> {
    let weight = rescore_weight(t_ms).to_string();
    let keys: Vec<String> = (0..env.scratch.keys.shards())
        .map(|s| env.scratch.keys.due(s))
        .chain([env.scratch.lane.keys.due.clone()])
        .collect();
    futures::future::try_join_all(keys.iter().map(|due| {
        let mut con = env.con.clone();
        let weight = weight.clone();
        async move {
            redis::cmd("ZUNIONSTORE")
                .arg(due)
                .arg(1)
                .arg(due)
                .arg("WEIGHTS")
                .arg(weight)
                .query_async::<u64>(&mut con)
                .await
        }
    }))
    .await?;
    Ok(())
}

/// Tells every mover its head is now due at `t_ms`, as an enqueue of a new head would: idle
/// movers sleep up to `poller.idle_poll_max` while wake-ups are known to arrive, longer than
/// the lead before T.
async fn wake_movers(env: &mut Env, t_ms: i64) -> anyhow::Result<()> {
    let keys = &env.scratch.keys;
    let mut names: Vec<String> = (0..keys.shards()).map(|s| s.to_string()).collect();
    let registry = store::lanes::read_registry(&mut env.con, keys).await?;
    names.extend(registry.by_route.values().map(|lane| lane.wake_name()));
    for name in names {
        let _: () = redis::cmd("PUBLISH")
            .arg(keys.wake_channel())
            .arg(format!("{name} {t_ms}"))
            .query_async(&mut env.con)
            .await?;
    }
    Ok(())
}

/// Makes the `n` parked jobs due at one instant T a little ahead (every shard's and lane's due
/// set rescored, every mover woken) and returns just before T: T and the margin the rescoring
/// left before it, ms. The daemons sleep until T (they re-read the head within idle_poll):
/// counters started now start with the drain.
pub(super) async fn due_at_once(env: &mut Env, n: u64) -> anyhow::Result<(i64, i64)> {
    let t_ms = store::server_time_ms(&mut env.con).await? + rescore_lead_ms(n);
    rescore(env, t_ms).await?;
    wake_movers(env, t_ms).await?;
    let margin_ms = t_ms - store::server_time_ms(&mut env.con).await?;
    ensure!(
        margin_ms > 200,
        "drain: rescoring took too long (margin {margin_ms} ms); the machine is overloaded"
    );
    let wait_ms = (t_ms as f64 - 20.0 - env.redis_now_ms_f64()).max(0.0);
    tokio::time::sleep(Duration::from_micros((wait_ms * 1000.0) as u64)).await;
    Ok((t_ms, margin_ms))
}

async fn drain(
    env: &mut Env,
    daemons: &mut Daemons,
    nodes: &mut Nodes,
    round: usize,
) -> anyhow::Result<FleetDrain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    status(&format!(
        "drain round {round}: {n} jobs due at one instant, {} daemons",
        daemons.count()
    ));
    env.scratch.clean(&mut env.con, false).await?;
    load_jobs(
        &env.producer,
        n,
        size,
        |_| PARKED_DUE_MS,
        "enqueue (parked)",
    )
    .await?;
    daemons.check_running()?;
    let loadavg_start = read_first_line("/proc/loadavg");
    // The route's lane holds them all.
    let (t_ms, margin_ms) = due_at_once(env, n).await?;
    let cpu = CpuStart::now(nodes, daemons).await?;
    let deadline = Instant::now() + drain_timeout(n);
    let (mut first, mut polls) = (None, 0u64);
    let all = loop {
        // TIME in the same pipeline runs on the list's server right after the LLEN: when the
        // length was seen, whenever this process gets to read the answer.
        let (len, (secs, micros)): (u64, (i64, i64)) = redis::pipe()
            .cmd("LLEN")
            .arg(&out)
            .cmd("TIME")
            .query_async(&mut env.con)
            .await?;
        let now = (secs * 1_000_000 + micros) as f64 / 1000.0;
        if first.is_none() && len > 0 {
            first = Some(now);
        }
        if len >= n {
            break now;
        }
        polls += 1;
        if polls % 200 == 0 {
            daemons.check_running()?;
        }
        if Instant::now() > deadline {
            bail!(
                "drain stalled: {len} of {n} jobs delivered after {:?}",
                drain_timeout(n)
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let settled = env
        .wait_settled(Duration::from_secs(30))
        .await?
        .context("drain: jobs still stored 30 s after all were delivered")?;
    let cpu = cpu.finish(nodes, daemons).await?;
    let delivered = llen(&mut env.con, &out).await?;
    let dead = env.dead_total().await?;
    let left = env.stored().await? + env.due_left().await?;
    env.scratch.clean(&mut env.con, false).await?;
    let t = t_ms as f64;
    let all_after = all - t;
    Ok(FleetDrain {
        round,
        jobs: n,
        margin_ms,
        first_seen_after_t_ms: first.map_or(all_after, |f| f - t),
        all_delivered_after_t_ms: all_after,
        all_settled_after_t_ms: settled - t,
        jobs_per_sec: n as f64 / (all_after / 1000.0).max(1e-6),
        delivered,
        duplicates: delivered.saturating_sub(n),
        dead,
        left,
        per_million: cpu.per_million(n),
        cpu,
        loadavg_start,
        loadavg_end: read_first_line("/proc/loadavg"),
    })
}

async fn steady(
    env: &mut Env,
    daemons: &mut Daemons,
    nodes: &mut Nodes,
    out_client: &redis::Client,
    rate: u64,
) -> anyhow::Result<FleetSteady> {
    ensure!(rate > 0, "--rate must be > 0");
    status(&format!(
        "steady: {rate} jobs/s for {:?} through {} daemons, each due 100–500 ms after enqueue",
        env.args.steady_duration(),
        daemons.count()
    ));
    env.scratch.clean(&mut env.con, false).await?;
    let loadavg_start = read_first_line("/proc/loadavg");
    let bounds = fine_bounds();
    let consumer = Consumer::start(out_client, &env.scratch.out, bounds.clone()).await?;
    let probe_stop = CancellationToken::new();
    let probe = tokio::spawn(timer_probe(probe_stop.clone(), bounds));
    let cpu = CpuStart::now(nodes, daemons).await?;
    let Produced {
        sent, produced_for, ..
    } = produce(env, rate, None, None).await?;
    probe_stop.cancel();
    let wait = Duration::from_millis(STEADY_DELAY_MS.1) + Duration::from_secs(30);
    let consumer = consumer.finish(sent, wait).await;
    let settled = env.wait_settled(Duration::from_secs(10)).await?;
    let cpu = cpu.finish(nodes, daemons).await?;
    daemons.check_running()?;
    let dead = env.dead_total().await?;
    let left_due = env.due_left().await?;
    let stored = env.stored().await?;
    let timer_overshoot = probe.await.ok().map(|h| h.summary());
    env.scratch.clean(&mut env.con, false).await?;
    let lateness = consumer.end_to_end.clone().unwrap_or_default();
    let all_once = consumer.early == 0
        && consumer.received == sent
        && consumer.duplicates == 0
        && consumer.missing == 0
        && consumer.unparsable == 0
        && left_due == 0
        && stored == 0
        && dead == 0
        && settled.is_some();
    Ok(FleetSteady {
        rate_target: rate,
        rate_achieved: sent as f64 / produced_for.as_secs_f64(),
        seconds: produced_for.as_secs_f64(),
        enqueued: sent,
        lateness,
        early_jobs: consumer.early,
        consumer,
        timer_overshoot,
        dead,
        left_due,
        stored_at_end: stored,
        all_delivered_once: all_once,
        cpu,
        loadavg_start,
        loadavg_end: read_first_line("/proc/loadavg"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rescoring_the_parked_time_gives_t_exactly() {
        for t in [
            1_700_000_000_000i64,
            1_767_225_599_999,
            1_799_999_999_999,
            4_398_046_511_103,
        ] {
            let w = rescore_weight(t);
            // What Redis does: parse the weight as text, multiply the stored score by it.
            let parsed: f64 = w.to_string().parse().unwrap();
            assert_eq!(parsed, w, "{w} round-trips as text");
            assert_eq!(PARKED_DUE_MS as f64 * parsed, t as f64, "t = {t}");
        }
        const { assert!(PARKED_DUE_MS > 4_000_000_000_000, "parked after 2096") };
    }
}
