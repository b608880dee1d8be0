//! `zdelay upgrade` moves a live layout-1 namespace to storage layout 2 while producers
//! enqueue and daemons deliver, against real Redis: every job delivered once and none early,
//! dead jobs and schedules kept, a crash of the upgrade between writing a batch into layout 2
//! and deleting it from layout 1 resumed by running it again, the daemons and producers
//! following on their own, and the layout-1 keys empty at the end.
//!
//! This build no longer serves layout 1: everything on layout 1 (creating the namespace, the
//! producers, the daemons that run through the upgrade) is the last release that does
//! ([`common::pinned_bin`]), as in a real upgrade; this build runs `zdelay upgrade` and what
//! comes after it.

use crate::common::{
    self, Daemon, RedisServer, TestConfig, lrange, pinned_bin, redis_now_ms, wait_for, zdelay_bin,
};
use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use zdelay::keys::Keys;

const SHARDS: u16 = 4;

/// The routes of the upgrade's tests: `a` local, `m` to another Redis (two-phase).
fn routes(target: &RedisServer) -> String {
    format!(
        r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
push = "rpush"
"#,
        target.url()
    )
}

/// A layout-1 namespace (created by the older release) with [`routes`].
fn config(redis: &RedisServer, target: &RedisServer) -> TestConfig {
    TestConfig::new(&redis.url(), SHARDS, &routes(target)).legacy_namespace()
}

/// A field of `zdelay:schema`.
fn schema_field(con: &mut dyn redis::ConnectionLike, field: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg("zdelay:schema")
        .arg(field)
        .query(con)
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Pops `q:a` as a consumer would, noting Redis's clock after each pop: (payload, popped ms).
fn consume(url: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<(String, i64)>> {
    std::thread::spawn(move || {
        let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
        let mut seen = Vec::new();
        loop {
            let popped: Option<(String, String)> = redis::cmd("BLPOP")
                .arg("q:a")
                .arg(0.2)
                .query(&mut con)
                .unwrap();
            match popped {
                Some((_, item)) => seen.push((item, redis_now_ms(&mut con))),
                None if stop.load(Ordering::Relaxed) => return seen,
                None => {}
            }
        }
    })
}

/// `"<name>:<due ms>"` payloads: each delivered at most (and for local routes exactly) once,
/// and none before its due.
fn check_deliveries(
    popped: &[(String, i64)],
    remote: &[Vec<u8>],
    expected: &BTreeMap<String, &'static str>,
) -> usize {
    let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
    for (item, at) in popped {
        if item.starts_with("tick") {
            continue;
        }
        let due: i64 = item.rsplit(':').next().unwrap().parse().unwrap();
        assert!(*at >= due, "{item} popped at {at}, before its due");
        *seen.entry(item.as_str()).or_default() += 1;
    }
    let remote: Vec<String> = remote
        .iter()
        .map(|r| String::from_utf8_lossy(r).into_owned())
        .collect();
    for item in &remote {
        if !item.starts_with("tick") {
            *seen.entry(item.as_str()).or_default() += 1;
        }
    }
    let missing: Vec<&String> = expected
        .keys()
        .filter(|k| !seen.contains_key(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} missing, first {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let twice_local: Vec<&&str> = seen
        .iter()
        .filter(|(k, n)| **n > 1 && expected.get(**k) == Some(&"a"))
        .map(|(k, _)| k)
        .collect();
    assert!(
        twice_local.is_empty(),
        "local jobs delivered twice: {twice_local:?}"
    );
    seen.values().filter(|n| **n > 1).count()
}

/// The older release's daemons deliver and its producer enqueues (one `zdelay enqueue` a
/// call) all through the upgrade: the producer follows it in that every call made while the
/// namespace is upgrading and after it succeeds (possibly after refusals that wrote nothing and
/// said to try again, for a call that raced the fence) and every job it enqueued arrives,
/// once.
#[test]
fn a_live_namespace_moves_to_layout_2_with_nothing_lost_early_or_twice() {
    const WAITING: usize = 20_000;
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = Arc::new(config(&redis, &target));
    let pinned = pinned_bin();
    let daemons = [
        Daemon::start_with_bin(&pinned, &config),
        Daemon::start_instance_with_bin(&pinned, &config),
    ];
    let rt = common::runtime();
    let (mut con, mut far) = (redis.conn(), target.conn());
    assert_eq!(schema_field(&mut con, "layout").as_deref(), Some("1"));
    let stop = Arc::new(AtomicBool::new(false));
    let consumer = consume(redis.url(), stop.clone());

    // Waiting jobs for both routes, due over the next 12 s, some under chosen ids.
    let now = redis_now_ms(&mut con);
    let mut expected: BTreeMap<String, &'static str> = BTreeMap::new();
    let jobs: Vec<serde_json::Value> = (0..WAITING)
        .map(|i| {
            let dest = if i % 2 == 0 { "a" } else { "m" };
            let due = now + 1_500 + (i as i64 * 7919) % 10_500;
            let payload = format!("p{i}:{due}");
            expected.insert(payload.clone(), dest);
            let mut job = serde_json::json!({ "dest": dest, "payload": payload, "at": due });
            if i % 10 == 3 {
                job["id"] = format!("user-{i}").into();
            }
            job
        })
        .collect();
    config.pinned_batch(&jobs);
    // Dead jobs: one of the local route (expired) and two for a destination no route names,
    // from a producer whose config still has that route.
    let at = (now - 60_000).to_string();
    config.pinned_ok(&[
        "enqueue",
        "--dest",
        "a",
        "--payload",
        "late",
        "--id",
        "expired-1",
        "--at",
        &at,
        "--max-lateness",
        "1ms",
        "--on-conflict",
        "error",
    ]);
    let outdated = TestConfig::new(
        &redis.url(),
        SHARDS,
        &format!(
            "{}\n[[routes]]\nname = \"nowhere\"\nsink = \"local\"\ntarget = \"q:nowhere\"\n",
            routes(&target)
        ),
    );
    for id in ["lost-1", "lost-2"] {
        outdated.pinned_ok(&[
            "enqueue",
            "--dest",
            "nowhere",
            "--payload",
            "x",
            "--id",
            id,
            "--on-conflict",
            "error",
        ]);
    }
    // A schedule for each route.
    for (id, dest) in [("tick-a", "a"), ("tick-m", "m")] {
        config.pinned_ok(&[
            "schedule",
            "set",
            id,
            "--dest",
            dest,
            "--every",
            "250ms",
            "--payload",
            "tick",
        ]);
    }
    wait_for("the dead jobs died", Duration::from_secs(10), || {
        common::layout_1_total(&mut con, SHARDS, "dead") == 3
    });
    // Windows of ids no job is stored under (a remembered one, a stray one): they name no
    // route, so they do not move, and they do not stay behind in the retired shards either.
    // Written raw: no command makes a window without its job.
    let legacy_shard = Keys::new("zdelay", SHARDS).layout_1().shard(1);
    let _: () = redis::pipe()
        .zadd(&legacy_shard.windows, "u:remembered", i64::MAX / 4)
        .hset(&legacy_shard.unique, "waiting", 3_600_000)
        .query(&mut con)
        .unwrap();
    // Waiting jobs' unique windows go where their jobs go: a local route's lane, a spread
    // shard for a two-phase route.
    const WINDOW: Duration = Duration::from_secs(7_200);
    let later = (now + 3_600_000).to_string();
    for (id, dest) in [("uniq-a", "a"), ("uniq-m", "m")] {
        config.pinned_ok(&[
            "enqueue",
            "--dest",
            dest,
            "--payload",
            "once",
            "--id",
            id,
            "--at",
            &later,
            "--unique-for",
            "7200s",
            "--on-conflict",
            "error",
        ]);
    }

    // A producer of the older release keeps enqueueing through the upgrade, one call at a
    // time, each job due within 1.5 s.
    let producing = Arc::new(AtomicBool::new(true));
    let (retried, produced) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let producer = {
        let (producing, retried, produced) = (producing.clone(), retried.clone(), produced.clone());
        let (config, url) = (config.clone(), redis.url());
        std::thread::spawn(move || {
            let mut con = redis::Client::open(url).unwrap().get_connection().unwrap();
            let mut sent = Vec::new();
            let mut k = 0u64;
            while producing.load(Ordering::Relaxed) {
                let dest = if k.is_multiple_of(2) { "a" } else { "m" };
                let due = redis_now_ms(&mut con) + (k as i64 * 37) % 1_500;
                let payload = format!("s{k}:{due}");
                let due = due.to_string();
                let args = [
                    "enqueue",
                    "--dest",
                    dest,
                    "--payload",
                    &payload,
                    "--at",
                    &due,
                    "--on-conflict",
                    "error",
                ];
                loop {
                    let out = config.pinned_cli(&args);
                    if out.status.success() {
                        break;
                    }
                    // A call that met the fence (or a lane being registered) wrote nothing
                    // and says to try again.
                    let err = String::from_utf8_lossy(&out.stderr);
                    assert!(
                        err.contains("retry") || err.contains("try again"),
                        "enqueue {payload}: {}",
                        text(&out)
                    );
                    retried.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
                sent.push((payload, dest));
                k += 1;
                produced.store(k, Ordering::Relaxed);
            }
            sent
        })
    };
    wait_for("the producer runs", Duration::from_secs(20), || {
        produced.load(Ordering::Relaxed) > 20
    });

    // The first run dies (kill -9) after writing a batch into layout 2, before deleting it
    // from layout 1; the second finishes.
    let dir = tempfile::tempdir().unwrap();
    let hold = dir.path().join("hold");
    let mut crashed = Command::new(zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["upgrade", "--yes", "--ids-per-call", "200"])
        .env(
            "ZDELAY_FAILPOINT",
            format!("upgrade_after_put={}", hold.display()),
        )
        .env("ZDELAY_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let reached = hold.with_extension("reached");
    wait_for("the upgrade wrote a batch", Duration::from_secs(30), || {
        reached.exists()
    });
    crashed.kill().unwrap();
    crashed.wait().unwrap();
    let schema: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        schema.get("upgrading").map(String::as_str),
        Some("2"),
        "{schema:?}"
    );
    // The producer goes on while the namespace is half upgraded.
    let at_crash = produced.load(Ordering::Relaxed);
    wait_for(
        "the producer goes on while the namespace is upgrading",
        Duration::from_secs(20),
        || produced.load(Ordering::Relaxed) > at_crash + 10,
    );

    let started = Instant::now();
    let out = config.cli(&["upgrade", "--yes", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["outcome"], "done", "{report}");
    assert_eq!(report["resumed"], true, "{report}");
    assert!(
        report["put_before"].as_u64().unwrap() >= 1,
        "the crashed run's batch: {report}"
    );
    assert!(report["to_lanes"].as_u64().unwrap() > 0, "{report}");
    assert!(report["to_spread_shards"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(
        report["redelivered"], 0,
        "one Redis moves local routes atomically"
    );
    eprintln!("upgrade finished in {:?}: {report}", started.elapsed());

    // The producer keeps going a little on layout 2, then stops; everything arrives.
    let at_upgrade = produced.load(Ordering::Relaxed);
    wait_for("the producer goes on", Duration::from_secs(20), || {
        produced.load(Ordering::Relaxed) > at_upgrade + 20
    });
    producing.store(false, Ordering::Relaxed);
    let sent = producer.join().unwrap();
    for (payload, dest) in &sent {
        expected.insert(payload.clone(), dest);
    }
    let local = expected.values().filter(|d| **d == "a").count();
    let remote_count = expected.len() - local;
    wait_for("every job delivered", Duration::from_secs(60), || {
        common::llen(&mut con, "q:a") == 0
            && lrange(&mut far, "q:m")
                .iter()
                .filter(|r| !r.starts_with(b"tick"))
                .count()
                >= remote_count
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let popped = consumer.join().unwrap();
    let remote = lrange(&mut far, "q:m");
    let twice = check_deliveries(&popped, &remote, &expected);
    assert_eq!(
        twice, 0,
        "two-phase jobs delivered twice with no daemon fault"
    );
    eprintln!(
        "{} jobs ({local} local), {} produced through the upgrade ({} before the crash, {} \
         before the upgrade finished; {} retried calls), {twice} two-phase redeliveries",
        expected.len(),
        sent.len(),
        at_crash,
        at_upgrade,
        retried.load(Ordering::Relaxed)
    );

    // The waiting jobs' windows came along.
    let spread_shards: u16 = redis::cmd("HGET")
        .arg("zdelay:schema")
        .arg("shards")
        .query(&mut con)
        .unwrap();
    let spread = Keys::new("zdelay", spread_shards);
    let uniq_m = spread.shard(spread.shard_of("uniq-m"));
    for (key, id) in [
        (common::lane_keys("a", "q:a").unique, "uniq-a"),
        (uniq_m.unique, "uniq-m"),
    ] {
        let window: Option<u64> = redis::cmd("HGET")
            .arg(&key)
            .arg(id)
            .query(&mut con)
            .unwrap();
        assert_eq!(window, Some(WINDOW.as_millis() as u64), "{id} in {key}");
    }

    // Layout 2 now; the layout-1 shards are empty and retired, the transit sets gone.
    let schema: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        schema.get("layout").map(String::as_str),
        Some("2"),
        "{schema:?}"
    );
    assert!(!schema.contains_key("upgrading"), "{schema:?}");
    let legacy = Keys::new("zdelay", SHARDS).layout_1();
    for key in common::all_keys(&mut con) {
        let layout_1 = key.starts_with("{zdelay:") && !key.ends_with(":shards");
        assert!(
            !layout_1 && !key.contains("transit_in"),
            "left behind: {key}"
        );
    }
    for shard in 0..SHARDS {
        let marker: String = redis::cmd("GET")
            .arg(legacy.layout(shard))
            .query(&mut con)
            .unwrap();
        assert!(marker.starts_with("layout 2 "), "shard {shard}: {marker}");
    }

    // Dead jobs and schedules came along; the schedules keep firing.
    let lib = common::client(&rt, &redis.url(), SHARDS);
    let dead = rt.block_on(lib.operator().dead_list(100)).unwrap();
    let mut ids: Vec<&str> = dead.iter().map(|d| d.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["expired-1", "lost-1", "lost-2"], "{dead:?}");
    let view = rt
        .block_on(lib.schedule_get("tick-a"))
        .unwrap()
        .expect("kept");
    assert!(
        view.lane.is_some(),
        "the local route's schedule is in its lane"
    );
    let before = popped_ticks(&mut far);
    wait_for("tick-m fires on layout 2", Duration::from_secs(10), || {
        popped_ticks(&mut far) > before
    });
    assert!(rt.block_on(lib.schedule_get("tick-m")).unwrap().is_some());

    // The daemons followed without stopping.
    for daemon in &daemons {
        let log = daemon.log_text();
        assert!(log.contains("restarting the pollers"), "{log}");
        assert!(!log.contains("panicked"), "{log}");
        assert!(
            matches!(daemon.admin_get("/readyz"), Some((200, _))),
            "{log}"
        );
    }
    // A lookup by a layout-1 id finds its job (or its absence) in layout 2.
    let err = rt.block_on(lib.get("user-3"));
    assert!(matches!(err, Ok(None)), "delivered: {err:?}");
}

fn popped_ticks(con: &mut redis::Connection) -> usize {
    lrange(con, "q:m")
        .iter()
        .filter(|r| r.starts_with(b"tick"))
        .count()
}

/// A daemon registered without a version (a build older than the upgrade) makes it refuse,
/// naming the daemon, before it changes anything.
#[test]
fn the_upgrade_refuses_while_an_older_daemon_runs() {
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = config(&redis, &target);
    config.pinned_ok(&["enqueue", "--dest", "a", "--payload", "x", "--in", "60s"]);
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let _: () = redis::cmd("HSET")
        .arg("{zdelay}:instances")
        .arg("old-host-1")
        .arg(format!("{} {now} 1 n0", now + 60_000))
        .query(&mut con)
        .unwrap();
    let out = config.cli(&["upgrade", "--yes"]);
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("old-host-1") && err.contains("cannot follow the upgrade"),
        "{err}"
    );
    let schema: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .unwrap();
    assert_eq!(schema.get("layout").map(String::as_str), Some("1"));
    assert!(!schema.contains_key("upgrading"), "{schema:?}");
    let dry = config.cli(&["upgrade", "--dry-run"]);
    assert!(dry.status.success(), "{}", text(&dry));
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains("old-host-1"),
        "{}",
        text(&dry)
    );
}

/// On a Redis Cluster every layout-1 shard and every lane is in its own slot: the upgrade
/// moves across slots, local routes' jobs land in their lists' slots, and every job arrives
/// once. Layout 1 delivers local routes in two phases there: the jobs a publisher held when
/// the fence went up are settled through it before anything moves them.
#[test]
fn a_cluster_namespace_moves_to_layout_2_across_slots() {
    use crate::common::RedisCluster;
    const WAITING: usize = 9_000;
    let cluster = RedisCluster::start();
    let remote = RedisServer::start();
    let config = cluster
        .config(
            SHARDS,
            &format!(
                r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "rpush"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
push = "rpush"
"#,
                remote.url()
            ),
        )
        .legacy_namespace();
    let daemon = Daemon::start_with_bin(&pinned_bin(), &config);
    let mut con = cluster.conn();
    let mut far = remote.conn();
    assert_eq!(schema_field(&mut con, "layout").as_deref(), Some("1"));
    let now = common::redis_now_ms_any(&mut con);
    let jobs: Vec<serde_json::Value> = (0..WAITING)
        .map(|i| {
            serde_json::json!({
                "dest": (["a", "b", "m"][i % 3]),
                "payload": format!("p{i}"),
                "at": now + 500 + (i as i64 * 3) % 5_000,
            })
        })
        .collect();
    config.pinned_batch(&jobs);
    wait_for("deliveries started", Duration::from_secs(20), || {
        common::llen(&mut con, "q:a") > 100
    });
    let out = config.cli(&["upgrade", "--yes", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["outcome"], "done", "{report}");
    let redelivered = report["redelivered"].as_u64().unwrap() as usize;
    // Jobs enqueued after the upgrade by the older release's producer, which follows it.
    let after: Vec<serde_json::Value> = (WAITING..WAITING + 900)
        .map(|i| {
            serde_json::json!({
                "dest": (["a", "b", "m"][i % 3]),
                "payload": format!("p{i}"),
                "in": "300ms",
            })
        })
        .collect();
    config.pinned_batch(&after);
    assert_eq!(schema_field(&mut con, "layout").as_deref(), Some("2"));
    let total = WAITING + 900;
    let distinct = |con: &mut redis::cluster::ClusterConnection, far: &mut redis::Connection| {
        let mut seen = std::collections::BTreeSet::new();
        for list in ["q:a", "q:b"] {
            seen.extend(common::lrange(con, list));
        }
        seen.extend(lrange(far, "q:m"));
        seen.len()
    };
    wait_for("every job delivered", Duration::from_secs(60), || {
        distinct(&mut con, &mut far) == total
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut counts: BTreeMap<Vec<u8>, u32> = BTreeMap::new();
    for list in ["q:a", "q:b"] {
        for item in common::lrange(&mut con, list) {
            *counts.entry(item).or_default() += 1;
        }
    }
    let twice: Vec<String> = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .collect();
    // The publishers settled what they held through the fence: nothing was moved after
    // it had been delivered.
    assert_eq!(redelivered, 0, "{report}");
    assert!(
        twice.is_empty(),
        "{} local jobs twice: {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    let remote = lrange(&mut far, "q:m");
    let remote_distinct: std::collections::BTreeSet<&Vec<u8>> = remote.iter().collect();
    assert_eq!(
        remote.len(),
        remote_distinct.len(),
        "two-phase jobs delivered twice"
    );
    let legacy = Keys::new("zdelay", SHARDS).layout_1();
    for shard in 0..SHARDS {
        let marker: String = redis::cmd("GET")
            .arg(legacy.layout(shard))
            .query(&mut con)
            .unwrap();
        assert!(marker.starts_with("layout 2 "), "shard {shard}: {marker}");
        let left: usize = redis::cmd("ZCARD")
            .arg(legacy.due(shard))
            .query(&mut con)
            .unwrap();
        assert_eq!(left, 0);
    }
    let log = daemon.log_text();
    assert!(
        log.contains("restarting the pollers") && !log.contains("CROSSSLOT"),
        "{log}"
    );
    eprintln!("cluster upgrade: {report}; {} local twice", twice.len());
}

/// A publisher that holds jobs when the fence goes up settles them through it before the
/// upgrade moves them, even when another job's lease in the same shard ran out already (its
/// daemon died): the move waits for the last live lease, not the first to end. Moved while
/// its publisher still held it, the held job would be delivered again from layout 2.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_live_publishers_jobs_are_settled_before_they_move_though_another_lease_ran_out() {
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
lease = "30s"
shutdown_grace = "60s"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
push = "rpush"
"#,
            target.url()
        ),
    )
    .legacy_namespace();
    let dir = tempfile::tempdir().unwrap();
    let release_publisher = dir.path().join("publisher");
    let hold = format!("hold_after_publish={}", release_publisher.display());
    let daemon = Daemon::spawn_bin(
        &pinned_bin(),
        &config,
        &[("ZDELAY_FAILPOINT", hold.as_str())],
    );
    daemon.wait_ready();
    let (mut con, mut far) = (redis.conn(), target.conn());
    let now = redis_now_ms(&mut con);
    config.pinned_ok(&[
        "enqueue",
        "--dest",
        "m",
        "--payload",
        "held",
        "--id",
        "held",
    ]);
    // Due much later: no publisher claims it before the fence.
    let later = (now + 3_600_000).to_string();
    config.pinned_ok(&[
        "enqueue",
        "--dest",
        "m",
        "--payload",
        "stale",
        "--id",
        "stale",
        "--at",
        &later,
    ]);
    wait_for(
        "the publisher holds its job",
        Duration::from_secs(20),
        || {
            release_publisher.with_extension("reached").exists()
                && common::llen(&mut far, "q:m") == 1
        },
    );

    let release_upgrade = dir.path().join("upgrade");
    let progress = dir.path().join("upgrade.log");
    let mut upgrade = Command::new(zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["upgrade", "--yes"])
        .env(
            "ZDELAY_FAILPOINT",
            format!("upgrade_after_fence={}", release_upgrade.display()),
        )
        .env("ZDELAY_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&progress).unwrap())
        .spawn()
        .unwrap();
    wait_for(
        "the upgrade fenced the shard",
        Duration::from_secs(20),
        || release_upgrade.with_extension("reached").exists(),
    );
    // "stale" as a daemon that died holding it leaves it: in flight, its lease over, its
    // scheduled due kept with the claim's token. Nothing claims from a fenced shard, so it
    // stays so until the upgrade moves it.
    let shard = Keys::new("zdelay", 1).layout_1().shard(0);
    let _: () = redis::pipe()
        .zrem(&shard.due, "stale")
        .zadd(&shard.inflight, "stale", now - 1_000)
        .hset(&shard.scheduled, "stale", format!("{} 999999", now - 2_000))
        .query(&mut con)
        .unwrap();
    std::fs::write(&release_upgrade, b"go").unwrap();
    let said = || std::fs::read_to_string(&progress).unwrap_or_default();
    let mut finished = None;
    wait_for(
        "the upgrade waits for the live lease (or finished)",
        Duration::from_secs(20),
        || {
            finished = upgrade.try_wait().unwrap();
            finished.is_some() || said().contains("waiting for 1 jobs in flight")
        },
    );
    // The publisher goes on: it settles "held" (delivered once) through the fence.
    std::fs::write(&release_publisher, b"go").unwrap();
    let status = match finished {
        Some(status) => status,
        None => {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if let Some(status) = upgrade.try_wait().unwrap() {
                    break status;
                }
                assert!(Instant::now() < deadline, "upgrade: {}", said());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert!(status.success(), "{}", said());
    // The daemon follows onto layout 2 and delivers what moved there: "stale" only.
    let spread = Keys::new("zdelay", 1).shard(0);
    wait_for(
        "the moved job is delivered",
        Duration::from_secs(30),
        || {
            lrange(&mut far, "q:m").iter().any(|p| p == b"stale")
                && common::layout_1_total(&mut con, 1, "inflight") == 0
                && redis::cmd("HLEN")
                    .arg(&spread.jobs)
                    .query::<u64>(&mut con)
                    .unwrap()
                    == 0
        },
    );
    let delivered: Vec<String> = lrange(&mut far, "q:m")
        .iter()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert_eq!(
        delivered.iter().filter(|p| *p == "held").count(),
        1,
        "the held job was moved while its publisher held it: {delivered:?}\n{}",
        said()
    );
    assert!(
        said().contains("waiting for 1 jobs in flight"),
        "{}",
        said()
    );
}

/// A route's list moves to another hash slot: its lane is retired, which it may be only when
/// empty. A producer that read the lane before keeps sending to it until the retirement, so
/// the emptiness is checked in the script that retires: a job that slipped in first keeps the
/// lane live (the daemon refuses the new list, naming what the lane holds) and is delivered
/// once the route points at its list again; after the retirement the producer is refused
/// (retryable until the registry names the new lane), reads the registry again and enqueues
/// into the new lane. No job is left where no mover reads.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_job_enqueued_while_a_lane_is_retired_is_never_stranded() {
    let redis = RedisServer::start();
    let route = |list: &str| {
        TestConfig::new(
            &redis.url(),
            SHARDS,
            &format!(
                "[poller]\nidle_poll = \"50ms\"\n\n[[routes]]\nname = \"a\"\nsink = \"local\"\n\
                 target = \"{list}\"\npush = \"rpush\"\n"
            ),
        )
    };
    // q:a and q:a2 are in different hash slots: a new lane for the route.
    let (here, there) = (route("q:a"), route("q:a2"));
    let mut first = Daemon::start(&here);
    first.signal(libc::SIGTERM);
    first.wait_exit(Duration::from_secs(10));
    let rt = common::runtime();
    // A producer that read the lane registry while the route pointed at q:a.
    let lib = common::client(&rt, &redis.url(), SHARDS);
    let mut con = redis.conn();

    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("retire");
    let hold = format!("lane_hold_before_retire={}", release.display());
    let mut moving = Daemon::spawn_with_env(&there, &[("ZDELAY_FAILPOINT", hold.as_str())]);
    wait_for(
        "the daemon is about to retire the lane",
        Duration::from_secs(20),
        || release.with_extension("reached").exists(),
    );
    let (id, _) = rt
        .block_on(lib.enqueue(
            zdelay::NewJob::new("a", "slipped-in").after(Duration::from_millis(100)),
            zdelay::OnConflict::Error,
        ))
        .unwrap();
    std::fs::write(&release, b"go").unwrap();
    // The lane is retired holding the job, which the daemon relocates into the new lane
    // before it starts delivering: found by its id (naming the retired lane), delivered to
    // the new list once.
    moving.wait_ready();
    // Due at once, the job may be delivered (and gone from every lane) before this read: it
    // was stranded only when it is found neither by its id nor on the new list.
    let found = rt.block_on(lib.get(&id)).unwrap();
    assert!(
        found.is_some() || lrange(&mut con, "q:a2") == [b"slipped-in".to_vec()],
        "stranded: {id} is in no registered lane"
    );
    wait_for("the job is delivered", Duration::from_secs(20), || {
        lrange(&mut con, "q:a2") == [b"slipped-in".to_vec()]
    });
    assert_eq!(
        common::llen(&mut con, "q:a"),
        0,
        "nothing reached the old list"
    );
    moving.signal(libc::SIGTERM);
    moving.wait_exit(Duration::from_secs(10));

    // Moving back: the lane is retired before the registry names its successor: meanwhile
    // the producer that still has it cached is refused (retryable, nothing written); then it
    // reads the registry again and enqueues into the successor.
    let registered = dir.path().join("registered");
    let hold = format!("lane_hold_after_retire={}", registered.display());
    let moved = Daemon::spawn_with_env(&here, &[("ZDELAY_FAILPOINT", hold.as_str())]);
    wait_for(
        "the daemon retired the lane",
        Duration::from_secs(20),
        || registered.with_extension("reached").exists(),
    );
    let refused = rt
        .block_on(lib.enqueue(zdelay::NewJob::new("a", "after"), zdelay::OnConflict::Error))
        .unwrap_err();
    assert!(refused.is_retryable(), "{refused}");
    std::fs::write(&registered, b"go").unwrap();
    moved.wait_ready();
    let (id, _) = rt
        .block_on(lib.enqueue(zdelay::NewJob::new("a", "after"), zdelay::OnConflict::Error))
        .unwrap();
    wait_for(
        "the later job is delivered",
        Duration::from_secs(20),
        || lrange(&mut con, "q:a") == [b"after".to_vec()],
    );
    assert!(!id.starts_with("~2."), "sent to the retired lane: {id}");
    assert_eq!(
        common::llen(&mut con, "q:a2"),
        1,
        "nothing more reached the old list"
    );
}
