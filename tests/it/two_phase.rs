//! The two-phase path (claim → publish → fenced settle) through the real daemon, with a
//! second real redis-server as the remote sink: delivery, sink down and back, rejects,
//! retries to dead, a crash between publish and ack, and a late settle refused by the fence.

use crate::common::{
    Daemon, RedisServer, TestConfig, client, llen, lrange, spread_total, wait_for,
    wait_spread_settled,
};
use std::collections::HashMap;
use std::time::Duration;
use zdelay::client::{NewJob, OnConflict};

const SHARDS: u16 = 2;

fn config(scheduler: &RedisServer, target: &RedisServer, poller: &str) -> TestConfig {
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
{poller}

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "mirror"
sink = "other"
target = "q:remote"

[[routes]]
name = "here"
sink = "local"
target = "q:local"
"#,
        target.url()
    );
    TestConfig::new(&scheduler.url(), SHARDS, &extra)
}

/// Enqueues `n` jobs through a producer given `config` (it registers the route's place if no
/// daemon has yet).
fn enqueue(config: &TestConfig, dest: &str, prefix: &str, n: usize) -> Vec<String> {
    let rt = crate::common::runtime();
    let client = config.client(&rt);
    let jobs = (0..n)
        .map(|i| NewJob::new(dest, format!("{prefix}-{i}").into_bytes()))
        .collect();
    rt.block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("job enqueued").0)
        .collect()
}

fn counts(items: Vec<Vec<u8>>) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for item in items {
        *out.entry(String::from_utf8(item).expect("utf-8"))
            .or_default() += 1;
    }
    out
}

fn metric_value(daemon: &Daemon, name_and_labels: &str) -> f64 {
    let (_, text) = daemon.admin_get("/metrics").expect("/metrics");
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn remote_redis_sink_delivers_each_job_and_acks() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let config = config(&scheduler, &target, "");
    enqueue(&config, "mirror", "m", 5_000);
    let _daemon = Daemon::start(&config);
    let mut tcon = target.conn();
    wait_for(
        "5000 jobs on the remote list",
        Duration::from_secs(30),
        || llen(&mut tcon, "q:remote") >= 5_000,
    );
    let mut scon = scheduler.conn();
    wait_spread_settled(&mut scon, SHARDS, Duration::from_secs(10));
    let got = counts(lrange(&mut tcon, "q:remote"));
    assert_eq!(got.len(), 5_000);
    assert!(got.values().all(|&n| n == 1), "no crash, so no duplicate");
    assert_eq!(spread_total(&mut scon, SHARDS, "due"), 0);
    assert_eq!(spread_total(&mut scon, SHARDS, "dead"), 0);
}

#[test]
fn a_sink_down_pauses_without_burning_attempts_while_others_flow() {
    let scheduler = RedisServer::start();
    let mut target = RedisServer::start();
    let config = config(&scheduler, &target, "sink_pause = \"200ms\"");
    let daemon = Daemon::start(&config);
    target.stop();
    wait_for(
        "/readyz reports the sink down",
        Duration::from_secs(15),
        || matches!(daemon.admin_get("/readyz"), Some((503, body)) if body.contains("sink other")),
    );
    let stats: serde_json::Value =
        serde_json::from_slice(&config.cli(&["stats", "--json"]).stdout).expect("stats json");
    assert_eq!(stats["sinks"][0]["name"], "other", "{stats}");
    assert_eq!(stats["sinks"][0]["up"], false, "{stats}");
    let table = String::from_utf8_lossy(&config.cli(&["stats"]).stdout).into_owned();
    assert!(table.contains("sink other (redis): down"), "{table}");
    let remote_ids = enqueue(&config, "mirror", "m", 300);
    enqueue(&config, "here", "h", 300);
    let mut scon = scheduler.conn();
    wait_for(
        "local jobs flow while the sink is down",
        Duration::from_secs(10),
        || llen(&mut scon, "q:local") == 300,
    );
    // Let the paused sink be tried a few times over ~1.5 s.
    wait_for(
        "the sink was found unavailable",
        Duration::from_secs(10),
        || {
            metric_value(
                &daemon,
                "zdelay_sink_messages_total{sink=\"other\",outcome=\"unavailable\"}",
            ) > 0.0
        },
    );
    let rt = crate::common::runtime();
    let client = client(&rt, &scheduler.url(), SHARDS);
    for id in &remote_ids[..20] {
        let job = rt
            .block_on(client.get(id))
            .expect("get")
            .expect("still pending");
        let env = job.envelope.expect("envelope");
        assert_eq!(env.meta.attempt, 0, "an unavailable sink burns no attempt");
    }
    assert_eq!(spread_total(&mut scon, SHARDS, "dead"), 0);

    target.start_again();
    let mut tcon = target.conn();
    wait_for(
        "every remote job delivered after the sink is back",
        Duration::from_secs(40),
        || llen(&mut tcon, "q:remote") >= 300,
    );
    wait_spread_settled(&mut scon, SHARDS, Duration::from_secs(10));
    let got = counts(lrange(&mut tcon, "q:remote"));
    assert_eq!(got.len(), 300);
    assert!(got.values().all(|&n| n == 1));
    wait_for("/readyz back to 200", Duration::from_secs(15), || {
        matches!(daemon.admin_get("/readyz"), Some((200, _)))
    });
}

#[test]
fn rejects_and_exhausted_retries_go_to_dead_with_reasons() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let config = config(
        &scheduler,
        &target,
        "max_attempts = 3\nretry_base = \"10ms\"\nretry_cap = \"50ms\"",
    );
    let mut tcon = target.conn();
    let _: () = redis::cmd("SET")
        .arg("q:remote")
        .arg("not a list")
        .query(&mut tcon)
        .expect("SET");
    let rejected = enqueue(&config, "mirror", "w", 5);
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = client(&rt, &scheduler.url(), SHARDS);
    wait_for("WRONGTYPE rejects dead", Duration::from_secs(10), || {
        rt.block_on(client.operator().dead_list(100))
            .expect("dead list")
            .len()
            == 5
    });
    for d in rt
        .block_on(client.operator().dead_list(100))
        .expect("dead list")
    {
        assert!(rejected.contains(&d.id));
        assert!(d.reason.contains("WRONGTYPE"), "{}", d.reason);
    }
    // Retries: a target out of memory fails every push; attempts count up to dead.
    let _: () = redis::cmd("DEL")
        .arg("q:remote")
        .query(&mut tcon)
        .expect("DEL");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut tcon)
        .expect("maxmemory");
    let retried = enqueue(&config, "mirror", "r", 3);
    wait_for("retries exhausted", Duration::from_secs(20), || {
        rt.block_on(client.operator().dead_list(100))
            .expect("dead list")
            .len()
            == 8
    });
    for id in &retried {
        let job = rt
            .block_on(client.get(id))
            .expect("get")
            .expect("dead job kept");
        let reason = job.reason.clone().unwrap_or_default();
        assert!(reason.contains("gave up after 3 attempts"), "{reason}");
        let env = job.envelope.expect("envelope");
        assert_eq!(env.meta.attempt, 3);
        assert!(env.meta.last_error.unwrap_or_default().contains("OOM"));
    }
    assert!(
        metric_value(
            &daemon,
            "zdelay_sink_messages_total{sink=\"other\",outcome=\"retried\"}"
        ) >= 6.0
    );
    assert_eq!(llen(&mut tcon, "q:remote"), 0);
}

#[cfg(feature = "test-failpoints")]
#[test]
fn crash_between_publish_and_ack_redelivers_after_the_lease() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let config = config(&scheduler, &target, "lease = \"1s\"");
    enqueue(&config, "mirror", "c", 2_000);
    let mut crashing =
        Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", "abort_after_publish")]);
    let status = crashing.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "the failpoint aborts the daemon");
    let mut tcon = target.conn();
    let published_before_crash = llen(&mut tcon, "q:remote");
    assert!(published_before_crash > 0, "it crashed after publishing");
    let mut scon = scheduler.conn();
    assert!(
        spread_total(&mut scon, SHARDS, "inflight") > 0,
        "claimed, published, not acked"
    );

    let _daemon = Daemon::start(&config);
    wait_spread_settled(&mut scon, SHARDS, Duration::from_secs(30));
    let got = counts(lrange(&mut tcon, "q:remote"));
    assert_eq!(got.len(), 2_000, "none lost");
    let duplicates: usize = got.values().map(|n| n - 1).sum();
    assert!(duplicates > 0, "the crash window shows as duplicates");
    assert!(
        duplicates <= published_before_crash,
        "only what was published before the crash repeats: {duplicates} > {published_before_crash}"
    );
}

#[cfg(feature = "test-failpoints")]
#[test]
fn a_late_settle_is_refused_by_the_fence() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    // Two pollers per shard, so the second daemon polls the shards the slow one holds.
    let config = config(&scheduler, &target, "lease = \"1s\"\nper_shard = 2");
    // The slow daemon holds between publish and settle until the test releases it: its
    // job lease (1 s) runs out, the other daemon reclaims, delivers and acks; the slow
    // settle must then be refused by the fence.
    let marker_dir = tempfile::tempdir().expect("temp dir");
    let release = marker_dir.path().join("release");
    let hold = format!("hold_after_publish={}", release.display());
    let slow = Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", hold.as_str())]);
    slow.wait_ready();
    enqueue(&config, "mirror", "f", 200);
    let mut tcon = target.conn();
    wait_for("the slow daemon published", Duration::from_secs(10), || {
        llen(&mut tcon, "q:remote") > 0
    });
    let config2 = TestConfig::new(
        &scheduler.url(),
        SHARDS,
        &std::fs::read_to_string(&config.path)
            .expect("config")
            .split_once("[poller]")
            .map(|(_, rest)| format!("[poller]{rest}"))
            .expect("poller section"),
    );
    let _fast = Daemon::start(&config2);
    let mut scon = scheduler.conn();
    wait_for(
        "the fast daemon reclaimed and acked everything",
        Duration::from_secs(30),
        || {
            spread_total(&mut scon, SHARDS, "jobs") == 0
                && spread_total(&mut scon, SHARDS, "inflight") == 0
        },
    );
    std::fs::write(&release, b"go").expect("release the slow daemon");
    wait_for(
        "the fence refused the slow settle",
        Duration::from_secs(20),
        || metric_value(&slow, "zdelay_fenced_settles_total") > 0.0,
    );
    let got = counts(lrange(&mut tcon, "q:remote"));
    assert_eq!(got.len(), 200, "none lost");
    assert!(
        got.values().all(|&n| n <= 2),
        "at most one redelivery per job"
    );
    assert!(
        got.values().any(|&n| n == 2),
        "the slow daemon's publish repeats"
    );
    assert_eq!(
        spread_total(&mut scon, SHARDS, "jobs"),
        0,
        "the refused settle changed nothing"
    );
    assert_eq!(spread_total(&mut scon, SHARDS, "dead"), 0);
}

#[test]
fn cli_enqueue_accepts_sink_targets_its_allow_admits() {
    let scheduler = RedisServer::start();
    let extra = r#"
[sinks.bus]
kind = "nats"
url = "nats://127.0.0.1:1"
allow = ["events.*"]
"#;
    let config = TestConfig::new(&scheduler.url(), SHARDS, extra);
    let ok = config.cli(&[
        "enqueue",
        "--dest",
        "bus/events.due",
        "--in",
        "1h",
        "--payload",
        "x",
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = config.cli(&["enqueue", "--dest", "bus/orders.due", "--payload", "x"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("unknown destination \"bus/orders.due\""),
        "{err}"
    );
    let mut con = scheduler.conn();
    assert_eq!(
        spread_total(&mut con, SHARDS, "due"),
        1,
        "only the admitted job is stored"
    );
}

/// `used_cpu_sys + used_cpu_user` of a Redis, and how many ZADDs it ran (scripts' included).
fn cpu_and_zadds(con: &mut redis::Connection) -> (f64, u64) {
    let cpu: String = redis::cmd("INFO").arg("cpu").query(con).expect("INFO cpu");
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO commandstats");
    let field = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let zadds = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_zadd:calls="))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (
        field(&cpu, "used_cpu_sys") + field(&cpu, "used_cpu_user"),
        zadds,
    )
}

/// 200k jobs behind a 60 s outage of their sink (the remote Redis stopped): the backlog waits
/// in the ready set untouched — no job is rewritten (no ZADD at all) and the scheduling
/// Redis stays near idle while the sink is down — and all 200k arrive once it is back.
#[test]
fn a_long_outage_parks_the_backlog_without_churn_and_delivers_it_all() {
    const JOBS: usize = 200_000;
    const OUTAGE: Duration = Duration::from_secs(60);
    let scheduler = RedisServer::start();
    let mut target = RedisServer::start();
    let config = config(&scheduler, &target, "sink_pause = \"200ms\"");
    let daemon = Daemon::start(&config);
    target.stop();
    let stopped = std::time::Instant::now();
    enqueue(&config, "mirror", "long", JOBS);
    eprintln!(
        "{JOBS} jobs enqueued in one batch in {:?}",
        stopped.elapsed()
    );
    let mut con = scheduler.conn();
    let ready = |con: &mut redis::Connection| -> usize {
        (0..SHARDS)
            .map(|s| {
                redis::cmd("ZCARD")
                    .arg(zdelay::keys::Keys::new("zdelay", SHARDS).ready(s))
                    .query::<usize>(con)
                    .expect("ZCARD ready")
            })
            .sum()
    };
    wait_for(
        "the backlog parked in the ready set",
        Duration::from_secs(30),
        || ready(&mut con) == JOBS,
    );
    wait_for(
        "/readyz reports the sink down",
        Duration::from_secs(10),
        || matches!(daemon.admin_get("/readyz"), Some((503, body)) if body.contains("sink other")),
    );
    // Measure the rest of the outage (at least 30 s of it).
    let (cpu0, zadds0) = cpu_and_zadds(&mut con);
    let window_start = std::time::Instant::now();
    let window_end = (stopped + OUTAGE).max(window_start + Duration::from_secs(30));
    while std::time::Instant::now() < window_end {
        std::thread::sleep(Duration::from_millis(500));
    }
    let (cpu1, zadds1) = cpu_and_zadds(&mut con);
    let window = window_start.elapsed().as_secs_f64();
    let cpu_percent = (cpu1 - cpu0) * 100.0 / window;
    eprintln!(
        "{JOBS} jobs parked for {window:.0} s: Redis CPU {cpu_percent:.2} %, {} ZADDs, {} in ready",
        zadds1 - zadds0,
        ready(&mut con)
    );
    assert_eq!(
        zadds1 - zadds0,
        0,
        "no job was rewritten while the sink was down"
    );
    assert_eq!(ready(&mut con), JOBS, "the backlog waited where it was");
    assert!(
        cpu_percent < 5.0,
        "the scheduling Redis stays near idle while the sink is down: {cpu_percent:.2} %"
    );

    target.start_again();
    let started = std::time::Instant::now();
    let mut tcon = target.conn();
    wait_for("every job delivered", Duration::from_secs(120), || {
        llen(&mut tcon, "q:remote") >= JOBS
    });
    wait_spread_settled(&mut con, SHARDS, Duration::from_secs(30));
    eprintln!(
        "{JOBS} jobs delivered {:?} after the sink came back",
        started.elapsed()
    );
    let got = counts(lrange(&mut tcon, "q:remote"));
    assert_eq!(got.len(), JOBS, "every job arrived");
    assert!(
        got.values().all(|&n| n == 1),
        "none twice after a clean outage"
    );
    assert_eq!(spread_total(&mut con, SHARDS, "dead"), 0);
}

/// A hung sink (its Redis stopped with SIGSTOP: the port open, nothing answers) shares the
/// spread shards with a working one, whose jobs come due among the hung sink's: the moves
/// that claim for the working sink keep going, its jobs arrive within a couple of seconds of
/// their due time throughout, and after SIGCONT the hung sink's jobs all arrive too.
#[test]
fn a_hung_sink_holds_up_no_other_sinks_jobs_in_the_shared_shards() {
    let scheduler = RedisServer::start();
    let (hung, working) = (RedisServer::start(), RedisServer::start());
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
lease = "10s"

[sinks.hung]
kind = "redis"
url = "{}"

[sinks.working]
kind = "redis"
url = "{}"

[[routes]]
name = "to-hung"
sink = "hung"
target = "q:h"

[[routes]]
name = "to-working"
sink = "working"
target = "q:w"
"#,
        hung.url(),
        working.url()
    );
    let config = TestConfig::new(&scheduler.url(), SHARDS, &extra);
    let _daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = config.client(&rt);
    let mut wcon = working.conn();
    let mut sent = 0;
    // Waves of both routes' jobs, due at once, for 1 s before the hang and 6 s during it.
    let wave = |i: usize| {
        let jobs = (0..20)
            .map(|j| {
                let dest = if j % 2 == 0 { "to-hung" } else { "to-working" };
                NewJob::new(dest, format!("{dest}-{i}-{j}").into_bytes())
            })
            .collect();
        rt.block_on(client.enqueue_batch(jobs, OnConflict::Error))
            .expect("enqueue");
    };
    let started = std::time::Instant::now();
    let hung_pid = hung.pid().expect("the hung sink's redis runs") as i32;
    let mut stopped = false;
    let mut worst = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(7) {
        if !stopped && started.elapsed() >= Duration::from_secs(1) {
            // SAFETY: kill(2) on the redis-server this test started.
            unsafe { libc::kill(hung_pid, libc::SIGSTOP) };
            stopped = true;
        }
        let at = std::time::Instant::now();
        wave(sent);
        sent += 1;
        // Each wave's working jobs arrive before the next wave is sent.
        wait_for(
            "the working sink's jobs arrive while the other hangs",
            Duration::from_secs(10),
            || llen(&mut wcon, "q:w") >= sent * 10,
        );
        worst = worst.max(at.elapsed());
    }
    eprintln!("{sent} waves; the slowest wave reached the working sink in {worst:?}");
    assert!(
        worst < Duration::from_secs(3),
        "a wave of the working sink's jobs took {worst:?} while the other sink hung"
    );
    // SAFETY: as above.
    unsafe { libc::kill(hung_pid, libc::SIGCONT) };
    let mut hcon = hung.conn();
    wait_for(
        "the hung sink's jobs arrive after SIGCONT",
        Duration::from_secs(60),
        || counts(lrange(&mut hcon, "q:h")).len() >= sent * 10,
    );
    let mut scon = scheduler.conn();
    wait_for("every job settled", Duration::from_secs(30), || {
        spread_total(&mut scon, SHARDS, "jobs") == 0
    });
    assert_eq!(counts(lrange(&mut wcon, "q:w")).len(), sent * 10);
    assert_eq!(spread_total(&mut scon, SHARDS, "dead"), 0);
}
