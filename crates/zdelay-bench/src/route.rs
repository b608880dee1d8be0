//! `--route`: confirmed messages/s through one two-phase route, end to end: with the
//! daemon's pollers in this process, or (`--daemons N`) through N `zdelay run` processes on
//! one Redis or a cluster.
//!
//! With daemons, the jobs are loaded parked while the daemons idle and then made due at one
//! instant T, as the fleet drain does (`fleet::rescore`); the drain is timed from T on
//! Redis's clock until no job is stored any more (every one confirmed and settled, or dead).

use super::daemons::Daemons;
use super::direct::{self, Direct, Plan};
use super::fleet::{CpuStart, PARKED_DUE_MS, due_at_once};
use super::load::{MIN_PAYLOAD, load_jobs_to, status};
use super::measure::{CallCost, CallLog, Nodes, local_now_ms, process_cpu, redis_cpu, total_size};
use super::{Env, ROUTE};
use anyhow::{Context, bail};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay::poller::{self, Options, Ownership, PollerContext};
use zdelay_core::config::{RouteConfig, SinkConfig};
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
    /// `zdelay run` processes that delivered (none: the pollers ran in this process).
    pub(super) daemons: Option<u16>,
    /// The scheduling Redis is a cluster.
    pub(super) cluster: bool,
    pub(super) seconds: f64,
    pub(super) per_second: f64,
    pub(super) dead: u64,
    /// Redis CPU per job confirmed (claim, ack and everything else Redis did; every node's,
    /// replicas too, on a cluster), µs.
    pub(super) redis_us_per_job: f64,
    /// Of which the masters', on a cluster (the rest is the replicas' replication), µs.
    pub(super) redis_masters_us_per_job: Option<f64>,
    /// zdelay's CPU per job (pollers and the sink's client: this process's, or the daemons'
    /// together), µs.
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
            bail!("--route {route}: a local list route, not two-phase")
        }
        Err(e) => bail!("--route {route}: not a two-phase route of the config ({e})"),
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
    let drained = match env.args.daemons {
        None => in_process(env, ctx, route).await?,
        Some(daemons) => {
            drop(ctx);
            let (extra, secrets) = daemon_route(env, route, &dest.sink, &sink_config)?;
            through_daemons(env, route, daemons, &extra, &secrets).await?
        }
    };
    sink.sink.flush(Duration::from_secs(5)).await;
    direct.extend(direct::publish(&sink_config, &plan).await?);
    let Drained {
        seconds,
        dead,
        redis_cpu,
        masters_cpu,
        zdelay_cpu,
        by_script,
        by_script_partial,
    } = drained;
    let per_second = (n - dead) as f64 / seconds;
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
        shards: env.scratch.keys.shards(),
        daemons: env.args.daemons,
        cluster: env.con.is_cluster(),
        seconds,
        per_second,
        dead,
        redis_us_per_job: redis_cpu * 1e6 / (n - dead).max(1) as f64,
        redis_masters_us_per_job: masters_cpu.map(|cpu| cpu * 1e6 / (n - dead).max(1) as f64),
        zdelay_us_per_job: zdelay_cpu * 1e6 / (n - dead).max(1) as f64,
        by_script,
        by_script_partial,
        direct,
        ratio,
    })
}

/// One drain's measures.
struct Drained {
    seconds: f64,
    dead: u64,
    /// CPU seconds of Redis (every node), of a cluster's masters, and of zdelay during the
    /// drain.
    redis_cpu: f64,
    masters_cpu: Option<f64>,
    zdelay_cpu: f64,
    by_script: Vec<CallCost>,
    by_script_partial: bool,
}

/// The route's jobs, all due, drained by the daemon's pollers in this process.
async fn in_process(env: &mut Env, mut ctx: PollerContext, route: &str) -> anyhow::Result<Drained> {
    let n = env.args.jobs;
    let size = env.payload_size().max(MIN_PAYLOAD);
    let past = env.redis_now_ms() - 1_000;
    let producer = route_producer(env);
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
    let ctx = Arc::new(ctx);
    let ownership = Ownership::new(ctx.all_targets());
    // Recording every call costs Redis a little: the CPU per job includes it.
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
    let dead = wait_drained(env, || started.elapsed()).await?;
    let seconds = started.elapsed().as_secs_f64();
    let redis_used = redis_cpu(&mut env.con).await? - redis_before;
    let own_used = process_cpu(std::process::id()).unwrap_or(0.0) - own_before;
    pollers.stop().await;
    let (by_script, by_script_partial) = finish_log(env, call_log, n - dead).await?;
    Ok(Drained {
        seconds,
        dead,
        redis_cpu: redis_used,
        masters_cpu: None,
        zdelay_cpu: own_used,
        by_script,
        by_script_partial,
    })
}

/// The route's jobs drained by `n` daemons: loaded parked while they idle, then all made due
/// at one instant T.
async fn through_daemons(
    env: &mut Env,
    route: &str,
    n: u16,
    extra: &str,
    secrets: &[(String, String)],
) -> anyhow::Result<Drained> {
    let jobs = env.args.jobs;
    let size = env.payload_size().max(MIN_PAYLOAD);
    let redis_cfg = env.config.redis.clone();
    let mut nodes = Nodes::connect(&mut env.con, &redis_cfg).await?;
    let mut daemons = Daemons::spawn_with(
        &env.daemon_binary(),
        n,
        &env.config,
        env.batch.min(1000),
        ROUTE,
        &env.scratch.out,
        extra,
        secrets,
    )?;
    let measured = async {
        daemons
            .wait_ready(&mut env.con, Duration::from_secs(60))
            .await?;
        let producer = route_producer(env);
        load_jobs_to(
            &producer,
            route,
            jobs,
            size,
            |_| PARKED_DUE_MS,
            "loading jobs for the route (parked)",
        )
        .await?;
        daemons.check_running()?;
        let (t_ms, _) = due_at_once(env, jobs).await?;
        let call_log = CallLog::start(&mut env.con).await;
        let cpu = CpuStart::now(&mut nodes, &daemons).await?;
        status(&format!("{jobs} jobs due at T, {n} daemons delivering"));
        let offset = env.clock_offset_ms;
        let dead = wait_drained(env, || {
            Duration::from_millis((local_now_ms() + offset - t_ms).max(0) as u64)
        })
        .await?;
        let seconds = (env.redis_now_ms() - t_ms).max(1) as f64 / 1000.0;
        let cpu = cpu.finish(&mut nodes, &daemons).await?;
        daemons.check_running()?;
        let (by_script, by_script_partial) = finish_log(env, call_log, jobs - dead).await?;
        anyhow::Ok(Drained {
            seconds,
            dead,
            redis_cpu: cpu.redis_masters_s + cpu.redis_replicas_s,
            masters_cpu: env.con.is_cluster().then_some(cpu.redis_masters_s),
            zdelay_cpu: cpu.daemons_s,
            by_script,
            by_script_partial,
        })
    }
    .await;
    if measured.is_err() {
        daemons.keep_logs();
    }
    let codes = daemons.stop().await;
    let drained = measured?;
    if codes.iter().any(|c| *c != Some(0)) {
        status(&format!("the daemons' exit codes: {codes:?}"));
    }
    Ok(drained)
}

/// Given the config's routes, the producer registers the route (the lane registry refuses a
/// destination it does not know); its jobs then wait in the spread shards.
fn route_producer(env: &Env) -> zdelay_core::client::Client {
    env.producer
        .clone()
        .with_routes(zdelay_core::routes::Routes::from_config(&env.config))
}

/// Waits until no job is stored any more (every one confirmed and acked, or dead); returns
/// the dead. Each look costs Redis two commands per shard, which count in its CPU per job:
/// it looks about four times per the time the jobs left need at the rate so far
/// (`elapsed` of the drain), every 5 ms at the end.
async fn wait_drained(env: &mut Env, elapsed: impl Fn() -> Duration) -> anyhow::Result<u64> {
    let n = env.args.jobs;
    let keys = &env.scratch.keys;
    let jobs_keys: Vec<String> = (0..keys.shards()).map(|s| keys.jobs(s)).collect();
    let dead_keys: Vec<String> = (0..keys.shards()).map(|s| keys.dead(s)).collect();
    loop {
        let left = total_size(&mut env.con, "HLEN", &jobs_keys).await?;
        let dead = total_size(&mut env.con, "ZCARD", &dead_keys).await?;
        if left == dead {
            return Ok(dead);
        }
        let done = n.saturating_sub(left) as f64;
        let rate = done / elapsed().as_secs_f64().max(1e-3);
        let need = (left - dead) as f64 / rate.max(1.0);
        let wait = Duration::from_secs_f64(need / 4.0)
            .clamp(Duration::from_millis(5), Duration::from_millis(100));
        tokio::time::sleep(wait).await;
    }
}

/// The per-script costs of the calls logged during the drain (the drain's own looks, HLEN
/// and ZCARD, left out).
async fn finish_log(
    env: &mut Env,
    log: Option<CallLog>,
    confirmed: u64,
) -> anyhow::Result<(Vec<CallCost>, bool)> {
    Ok(match log {
        Some(log) => {
            log.finish(&mut env.con, confirmed, &["hlen", "zcard"])
                .await?
        }
        None => (Vec::new(), false),
    })
}

/// The daemons' config for the route: its sink and the route itself, as TOML appended to
/// theirs, and the sink's secrets as `ZDELAY_SINKS__…` variables for their environment (a
/// secret is never written to a file).
fn daemon_route(
    env: &Env,
    route: &str,
    sink: &str,
    sink_config: &SinkConfig,
) -> anyhow::Result<(String, Vec<(String, String)>)> {
    let route_config: &RouteConfig = env
        .config
        .routes
        .iter()
        .find(|r| r.name == route)
        .with_context(|| format!("route {route} not configured"))?;
    // Whole tables from the root, so a sink's nested tables keep their place.
    #[derive(serde::Serialize)]
    struct Part<'a> {
        sinks: std::collections::BTreeMap<&'a str, &'a SinkConfig>,
        routes: [&'a RouteConfig; 1],
    }
    let part = Part {
        sinks: [(sink, sink_config)].into(),
        routes: [route_config],
    };
    let mut shown = toml::Value::try_from(&part)?;
    let exposed = zdelay_core::config::with_secrets_exposed(|| toml::Value::try_from(&part))?;
    // Where the two differ is a secret: out of the file, into the environment.
    let mut secrets = Vec::new();
    move_secrets(&mut shown, &exposed, "", &mut secrets);
    Ok((format!("\n{}", toml::to_string(&shown)?), secrets))
}

/// Removes from `shown` each string `exposed` holds otherwise, adding it to `secrets` under
/// its environment name (`ZDELAY_SECTION__KEY__…`; `prefix` is the name of the table above).
fn move_secrets(
    shown: &mut toml::Value,
    exposed: &toml::Value,
    prefix: &str,
    secrets: &mut Vec<(String, String)>,
) {
    let (toml::Value::Table(shown), toml::Value::Table(exposed)) = (shown, exposed) else {
        return;
    };
    let keys: Vec<String> = shown.keys().cloned().collect();
    for key in keys {
        let name = match prefix {
            "" => format!("ZDELAY_{}", key.to_uppercase()),
            _ => format!("{prefix}__{}", key.to_uppercase()),
        };
        match (shown.get_mut(&key), exposed.get(&key)) {
            (Some(toml::Value::String(a)), Some(toml::Value::String(b))) if a != b => {
                secrets.push((name, b.clone()));
                shown.remove(&key);
            }
            (Some(a @ toml::Value::Table(_)), Some(b)) => move_secrets(a, b, &name, secrets),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::move_secrets;

    #[test]
    fn a_sinks_secrets_leave_the_file_for_the_environment_under_their_config_names() {
        let shown: toml::Value = toml::from_str(
            "[sinks.rabbit]\nkind = \"amqp\"\nurl = \"amqp://u:***@h/%2f\"\n\
             [sinks.k]\nkind = \"kafka\"\nbrokers = \"h:9092\"\n[sinks.k.sasl]\npassword = \"***\"\n\
             user = \"u\"\n[[routes]]\nname = \"r\"\n",
        )
        .unwrap();
        let exposed: toml::Value = toml::from_str(
            "[sinks.rabbit]\nkind = \"amqp\"\nurl = \"amqp://u:pw@h/%2f\"\n\
             [sinks.k]\nkind = \"kafka\"\nbrokers = \"h:9092\"\n[sinks.k.sasl]\npassword = \"pw2\"\n\
             user = \"u\"\n[[routes]]\nname = \"r\"\n",
        )
        .unwrap();
        let mut file = shown.clone();
        let mut secrets = Vec::new();
        move_secrets(&mut file, &exposed, "", &mut secrets);
        secrets.sort();
        assert_eq!(
            secrets,
            vec![
                (
                    "ZDELAY_SINKS__K__SASL__PASSWORD".to_owned(),
                    "pw2".to_owned()
                ),
                (
                    "ZDELAY_SINKS__RABBIT__URL".to_owned(),
                    "amqp://u:pw@h/%2f".to_owned()
                ),
            ]
        );
        let text = toml::to_string(&file).unwrap();
        assert!(!text.contains("***") && !text.contains("pw"), "{text}");
        assert!(
            text.contains("user = \"u\"") && text.contains("[[routes]]"),
            "{text}"
        );
    }
}
