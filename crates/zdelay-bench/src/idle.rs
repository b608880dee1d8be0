//! `idle`: what a daemon with nothing due costs Redis and itself, for a config of N local
//! routes, M raw sources or S shards.
//!
//! Each case starts one `zdelay run` (`daemons`) on a config of its own: the
//! bench route plus `routes - 1` more local routes onto lists of their own, and `sources` raw
//! sources of the bench route (`<ns>:idle:<i>`, never written), at `--shards`. It waits
//! until every shard is polled and the daemon's `zdelay_wakeups_confirmed` gauges say the
//! wake-ups are known to arrive (the idle polls are then stretched to `idle_poll_max`), lets
//! one `idle_poll_max` pass so every poller is in its long sleep, and then measures over
//! `--duration`: Redis `used_cpu_sys + used_cpu_user` and `total_commands_processed` (`INFO`),
//! the daemon's utime + stime (`/proc/<pid>/stat`), and the `INFO commandstats` deltas (which
//! commands the idle load is made of). A case whose wake-ups are never confirmed (raw sources
//! on a server without keyspace events for sorted sets) is measured anyway and says so.
//!
//! Redis's own upkeep (its `serverCron`, `hz` times a second) is measured first with no
//! daemon running, over the same duration, as the baseline the cases include.

use super::daemons::Daemons;
use super::load::status;
use super::measure::{read_first_line, redis_cpu};
use super::report::{CommandCost, Idle, IdleCase};
use super::{Env, ROUTE};
use anyhow::Context;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zdelay_core::store::{self, Conn};

/// The idle-cost aim per case, % of a core.
pub(super) const IDLE_AIM_PCT: f64 = 3.0;
/// How long the daemon may take to confirm its wake-ups.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// The extra local routes of a config of `routes` routes: `bench-extra-<i>` onto `<out>:<i>`.
pub(super) fn extra_routes(routes: usize, out: &str) -> Vec<(String, String)> {
    (2..=routes)
        .map(|i| (format!("{ROUTE}-extra-{i}"), format!("{out}:{i}")))
        .collect()
}

/// The raw source keys of an idle case.
fn source_keys(namespace: &str, sources: usize) -> Vec<String> {
    (1..=sources)
        .map(|i| format!("{namespace}:idle:{i}"))
        .collect()
}

/// The two-phase sink and route of `--with-sink`.
const SINK: &str = "idle_remote";
const SINK_ROUTE: &str = "bench-remote";

/// TOML appended to the daemon's config: the extra routes, the raw sources, and with
/// `sink_url` a `redis` sink at that URL with a route through it.
fn extra_toml(routes: &[(String, String)], sources: &[String], sink_url: Option<&str>) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let mut t = String::new();
    if let Some(url) = sink_url {
        let _ = writeln!(
            t,
            "\n[[routes]]\nname = {}\nsink = {}\ntarget = {}\n\n[sinks.{SINK}]\nkind = \"redis\"\nurl = {}",
            q(SINK_ROUTE),
            q(SINK),
            q(&format!("{ROUTE}:remote-out")),
            q(url)
        );
    }
    for (name, list) in routes {
        let _ = writeln!(
            t,
            "\n[[routes]]\nname = {}\nsink = \"local\"\ntarget = {}",
            q(name),
            q(list)
        );
    }
    for key in sources {
        let _ = writeln!(t, "\n[[sources]]\nkey = {}\nroute = {}", q(key), q(ROUTE));
    }
    t
}

/// Redis counters read at the start and the end of a measurement.
struct Sample {
    at: Instant,
    redis_cpu_s: f64,
    commands: u64,
    /// `INFO commandstats`: command → (calls, µs).
    stats: HashMap<String, (u64, u64)>,
}

async fn sample(con: &mut Conn) -> anyhow::Result<Sample> {
    let redis_cpu_s = redis_cpu(con).await?;
    let commands = store::info(con, "stats")
        .await?
        .get("total_commands_processed")
        .and_then(|v| v.parse().ok())
        .context("INFO stats has no total_commands_processed")?;
    let stats = store::info(con, "commandstats")
        .await?
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("cmdstat_")?.to_owned(), parse_cmdstat(&v)?)))
        .collect();
    Ok(Sample {
        at: Instant::now(),
        redis_cpu_s,
        commands,
        stats,
    })
}

/// `calls=12,usec=345,usec_per_call=28.75,…` → (calls, usec).
fn parse_cmdstat(v: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        v.split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|n| n.parse().ok())
    };
    Some((field("calls")?, field("usec")?))
}

/// What Redis did between two samples: % of a core, commands/s, and the commands that cost
/// the most (µs/s, the `INFO` commands of the measurement itself left out).
fn between(a: &Sample, b: &Sample) -> (f64, f64, f64, Vec<CommandCost>) {
    let secs = (b.at - a.at).as_secs_f64().max(1e-9);
    let mut costs: Vec<CommandCost> = b
        .stats
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .filter_map(|(name, &(calls, usec))| {
            let (c0, u0) = a.stats.get(name).copied().unwrap_or((0, 0));
            let calls = calls.saturating_sub(c0);
            (calls > 0).then(|| CommandCost {
                command: name.clone(),
                calls_per_s: calls as f64 / secs,
                usec_per_s: usec.saturating_sub(u0) as f64 / secs,
            })
        })
        .collect();
    costs.sort_by(|x, y| y.usec_per_s.total_cmp(&x.usec_per_s));
    costs.truncate(8);
    (
        secs,
        100.0 * (b.redis_cpu_s - a.redis_cpu_s) / secs,
        b.commands.saturating_sub(a.commands) as f64 / secs,
        costs,
    )
}

/// Runs every case of `--routes` (each without sources) and `--sources` (each with one route).
pub(super) async fn idle(env: &mut Env) -> anyhow::Result<Idle> {
    let duration = env.args.idle_duration();
    let mut cases: Vec<(usize, usize)> = env.args.routes.iter().map(|&r| (r, 0)).collect();
    cases.extend(env.args.sources.iter().map(|&s| (1, s)));
    let notify_keyspace_events = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query_async::<Vec<String>>(&mut env.con)
        .await
        .ok()
        .and_then(|v| v.get(1).cloned());

    status(&format!(
        "idle: Redis alone (no daemon) for {duration:?}, the baseline"
    ));
    let a = sample(&mut env.con).await?;
    tokio::time::sleep(duration).await;
    let b = sample(&mut env.con).await?;
    let (_, baseline_pct, baseline_commands, _) = between(&a, &b);

    let mut out = Idle {
        shards: env.scratch.keys.shards(),
        idle_poll_ms: env.config.poller.idle_poll.as_millis() as u64,
        idle_poll_max_ms: env.config.poller.idle_poll_max.as_millis() as u64,
        stats_interval_ms: env.config.poller.stats_interval.as_millis() as u64,
        duration_s: duration.as_secs_f64(),
        notify_keyspace_events,
        baseline_redis_cpu_pct: baseline_pct,
        baseline_commands_per_s: baseline_commands,
        aim_pct: IDLE_AIM_PCT,
        cases: Vec::new(),
    };
    for (routes, sources) in cases {
        let case = idle_case(env, routes, sources).await?;
        out.cases.push(case);
    }
    Ok(out)
}

async fn idle_case(env: &mut Env, routes: usize, sources: usize) -> anyhow::Result<IdleCase> {
    let shards = env.scratch.keys.shards();
    status(&format!(
        "idle: {routes} route(s), {sources} raw source(s), {shards} shards"
    ));
    let with_sink = env.args.with_sink;
    anyhow::ensure!(
        !with_sink || env.config.redis.password.is_none(),
        "--with-sink writes the Redis URL into the sink's config: use a URL without password"
    );
    let extra = extra_toml(
        &extra_routes(routes, &env.scratch.out),
        &source_keys(&env.args.namespace, sources),
        with_sink.then_some(env.config.redis.url.as_str()),
    );
    let mut daemon = Daemons::spawn_with(
        &env.daemon_binary(),
        1,
        &env.config,
        env.batch,
        ROUTE,
        &env.scratch.out,
        &extra,
        &[],
    )?;
    let measured = measure_case(env, &mut daemon, routes, sources).await;
    if measured.is_err() {
        daemon.keep_logs();
    }
    let codes = daemon.stop().await;
    forget_lanes(env, routes).await?;
    let mut case = measured?;
    case.exit_code = codes.first().copied().flatten();
    Ok(case)
}

/// On storage layout 2 the daemon registered a lane for each extra route: deletes their
/// markers (the bench route's lane and the registry go with the scratch namespace).
async fn forget_lanes(env: &mut Env, routes: usize) -> redis::RedisResult<()> {
    let markers: Vec<String> = extra_routes(routes, &env.scratch.out)
        .iter()
        .map(|(name, list)| {
            zdelay_core::lane::Lane::for_list(
                &env.args.namespace,
                0,
                name,
                list,
                Default::default(),
            )
            .keys
            .marker
        })
        .collect();
    for chunk in markers.chunks(64) {
        let _: () = redis::cmd("DEL")
            .arg(chunk)
            .query_async(&mut env.con)
            .await?;
    }
    Ok(())
}

async fn measure_case(
    env: &mut Env,
    daemon: &mut Daemons,
    routes: usize,
    sources: usize,
) -> anyhow::Result<IdleCase> {
    let started = Instant::now();
    daemon
        .wait_ready(&mut env.con, Duration::from_secs(120))
        .await?;
    let admin = daemon.admins()[0];
    let confirmed = loop {
        daemon.check_running()?;
        let text = http_body(admin, "/metrics").await.unwrap_or_default();
        let shards_ok = gauge(&text, "shards") == Some(1.0);
        let sources_ok = sources == 0 || gauge(&text, "sources") == Some(1.0);
        if shards_ok && sources_ok {
            break true;
        }
        if started.elapsed() > CONFIRM_TIMEOUT {
            status(&format!(
                "wake-ups not confirmed after {CONFIRM_TIMEOUT:?} (shards {shards_ok}, \
                 sources {sources_ok}): measuring the fallback polls"
            ));
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let confirmed_after_s = confirmed.then(|| started.elapsed().as_secs_f64());
    // Every poller finishes the short sleep it was in and starts a long one.
    tokio::time::sleep(env.config.poller.idle_poll_max + Duration::from_millis(500)).await;
    daemon.check_running()?;

    let pid = daemon.pids()[0];
    let load_start = read_first_line("/proc/loadavg");
    let cpu0 = daemon.cpu();
    let a = sample(&mut env.con).await?;
    tokio::time::sleep(env.args.idle_duration()).await;
    let b = sample(&mut env.con).await?;
    let cpu1 = daemon.cpu();
    daemon.check_running()?;
    let (secs, redis_cpu_pct, commands_per_s, top_commands) = between(&a, &b);
    let evalsha = |s: &Sample| s.stats.get("evalsha").map_or(0, |c| c.0);
    Ok(IdleCase {
        routes,
        sources,
        shards: env.scratch.keys.shards(),
        with_sink: env.args.with_sink,
        pid,
        wakeups_confirmed: confirmed,
        confirmed_after_s,
        seconds: secs,
        redis_cpu_pct,
        daemon_cpu_pct: 100.0 * (cpu1 - cpu0) / secs,
        redis_commands_per_s: commands_per_s,
        script_calls_per_s: evalsha(&b).saturating_sub(evalsha(&a)) as f64 / secs,
        top_commands,
        meets_aim: redis_cpu_pct < IDLE_AIM_PCT,
        loadavg_start: load_start,
        loadavg_end: read_first_line("/proc/loadavg"),
        exit_code: None,
    })
}

/// The value of `zdelay_wakeups_confirmed{targets="<targets>"}` in a Prometheus text page.
fn gauge(text: &str, targets: &str) -> Option<f64> {
    let series = format!("zdelay_wakeups_confirmed{{targets=\"{targets}\"}}");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

/// One HTTP/1.0 GET on loopback: the body.
async fn http_body(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await?;
    let text = String::from_utf8_lossy(&reply);
    Ok(text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extra_config_is_valid_and_names_every_route_and_source() {
        let routes = extra_routes(3, "ns:out");
        assert_eq!(
            routes,
            vec![
                ("bench-extra-2".to_owned(), "ns:out:2".to_owned()),
                ("bench-extra-3".to_owned(), "ns:out:3".to_owned())
            ]
        );
        assert!(extra_routes(1, "ns:out").is_empty());
        let base = "[redis]\nnamespace = \"ns\"\n\n[[routes]]\nname = \"bench\"\nsink = \"local\"\ntarget = \"ns:out\"\n";
        let text = format!("{base}{}", extra_toml(&routes, &source_keys("ns", 2), None));
        let parsed = zdelay_core::config::from_toml(&text).expect(&text);
        assert_eq!(parsed.routes.len(), 3);
        assert!(!text.contains("sinks"));
        assert_eq!(parsed.routes[2].target, "ns:out:3");
        assert_eq!(parsed.sources.len(), 2);
        assert_eq!(parsed.sources[1].key, "ns:idle:2");
        assert_eq!(parsed.sources[1].route, "bench");
        let sink = extra_toml(&[], &[], Some("redis://127.0.0.1:6390"));
        let parsed = zdelay_core::config::from_toml(&format!("{base}{sink}")).expect(&sink);
        assert_eq!(parsed.routes[1].sink, SINK);
        assert!(parsed.sinks.contains_key(SINK), "{sink}");
    }

    #[test]
    fn commandstats_and_the_confirmed_gauge_are_read() {
        assert_eq!(
            parse_cmdstat("calls=12,usec=345,usec_per_call=28.75,rejected_calls=0,failed_calls=0"),
            Some((12, 345))
        );
        assert_eq!(parse_cmdstat("usec=3"), None);
        let page = "# TYPE zdelay_wakeups_confirmed gauge\n\
                    zdelay_wakeups_confirmed{targets=\"shards\"} 1\n\
                    zdelay_wakeups_confirmed{targets=\"sources\"} 0\n";
        assert_eq!(gauge(page, "shards"), Some(1.0));
        assert_eq!(gauge(page, "sources"), Some(0.0));
        assert_eq!(gauge("", "shards"), None);
    }
}
