//! A Redis user limited by ACL to zdelay's keys and the commands it needs (README, "Redis
//! ACL") runs the daemon, the CLI and the library, on one Redis and on a cluster; without
//! `cluster|slots` a cluster connection fails with an error that says so.

use crate::common::{Daemon, RedisCluster, RedisServer, TestConfig, llen, redis_now_ms, wait_for};
use std::time::Duration;

/// The ACL rules of README's example user, as `redis-server --user` arguments.
fn acl_user(extra_rules: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--user",
        "zd",
        "on",
        ">zd-secret",
        // The namespace: schema, shards, registry; then the routes' lists and raw sources.
        "~zdelay:*",
        "~{zdelay:*",
        "~{zdelay}:*",
        "~q:*",
        "~{raw}:*",
        // Wake-ups, and keyspace notifications of raw sources.
        "&zdelay:*",
        "&__keyspace@0__:{raw}:*",
        "+@read",
        "+@write",
        "+@scripting",
        "+@pubsub",
        "+@connection",
        "-@dangerous",
        "+info",
        "+time",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra_rules.iter().map(|s| s.to_string()));
    args
}

fn with_user(url: &str) -> String {
    url.replacen("redis://", "redis://zd:zd-secret@", 1)
}

const ROUTES: &str = r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "l"
sink = "local"
target = "q:l"
push = "rpush"

[[routes]]
name = "raw"
sink = "local"
target = "{raw}:out"
push = "rpush"

[[sources]]
key = "{raw}:src"
route = "raw"
"#;

/// Enqueue, get, reschedule, cancel, raw ZADDs, dead letters, stats, all as user `zd`.
fn run_everything(
    config: &TestConfig,
    con: &mut dyn redis::ConnectionLike,
    redis: zdelay::config::RedisConfig,
) {
    let daemon = Daemon::start(config);
    let ok = |args: &[&str]| {
        let out = config.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    for i in 0..20 {
        ok(&["enqueue", "--dest", "l", "--payload", &format!("p-{i}")]);
    }
    let later = ok(&["enqueue", "--dest", "l", "--in", "1h", "--payload", "later"]);
    ok(&["get", &later]);
    ok(&["reschedule", &later, "--in", "2h"]);
    ok(&["cancel", &later]);
    let now: i64 = {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(con).expect("TIME");
        s * 1000 + us / 1000
    };
    for i in 0..10 {
        let _: () = redis::cmd("ZADD")
            .arg("{raw}:src")
            .arg(now)
            .arg(format!("r-{i}"))
            .query(con)
            .expect("ZADD");
    }
    let rt = crate::common::runtime();
    let lib = rt
        .block_on(zdelay::Client::connect(&redis))
        .expect("library as zd");
    rt.block_on(lib.enqueue(
        zdelay::NewJob::new("nowhere", "x"),
        zdelay::OnConflict::Error,
    ))
    .expect("enqueued");
    let len = |con: &mut dyn redis::ConnectionLike, key: &str| -> usize {
        redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
    };
    wait_for("everything delivered", Duration::from_secs(30), || {
        len(con, "q:l") == 20 && len(con, "{raw}:out") == 10
    });
    wait_for(
        "the unknown destination dead",
        Duration::from_secs(10),
        || ok(&["dead", "list"]).contains("nowhere"),
    );
    ok(&["dead", "replay", "--all"]);
    wait_for("dead again", Duration::from_secs(10), || {
        ok(&["dead", "list"]).contains("nowhere")
    });
    ok(&["dead", "purge", "--all"]);
    let stats = ok(&["stats", "--json"]);
    assert!(stats.contains("\"instances\""), "{stats}");
    let log = daemon.log_text();
    assert!(
        !log.contains("NOPERM"),
        "the daemon needed more rights:\n{log}"
    );
}

#[test]
fn a_user_limited_to_the_namespace_runs_everything_on_one_redis() {
    let args = acl_user(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = RedisServer::start_with(&args);
    let config = TestConfig::new(&with_user(&redis.url()), 4, ROUTES);
    let mut con = redis.conn();
    run_everything(
        &config,
        &mut con,
        zdelay::config::RedisConfig {
            url: with_user(&redis.url()),
            shards: 4,
            ..Default::default()
        },
    );
    assert_eq!(llen(&mut con, "q:l"), 20);
    let _ = redis_now_ms(&mut con);
}

fn cluster_config(cluster: &RedisCluster) -> TestConfig {
    let config = TestConfig::new("redis://127.0.0.1:1", 4, ROUTES);
    let seeds: Vec<String> = cluster
        .seeds()
        .iter()
        .map(|s| format!("\"{}\"", with_user(s)))
        .collect();
    let body = std::fs::read_to_string(&config.path).expect("config");
    let body = body.replacen(
        "[redis]\n",
        &format!("[redis]\ncluster_nodes = [{}]\n", seeds.join(", ")),
        1,
    );
    std::fs::write(&config.path, body).expect("config");
    config
}

#[test]
fn a_user_limited_to_the_namespace_runs_everything_on_a_cluster() {
    let args = acl_user(&["+cluster|slots"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster = RedisCluster::start_with(&args);
    let config = cluster_config(&cluster);
    let mut con = cluster.conn();
    run_everything(
        &config,
        &mut con,
        zdelay::config::RedisConfig {
            cluster_nodes: cluster.seeds().iter().map(|s| with_user(s)).collect(),
            shards: 4,
            ..Default::default()
        },
    );
}

#[test]
fn without_cluster_slots_the_error_says_what_is_missing() {
    let args = acl_user(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let cluster = RedisCluster::start_with(&args);
    let config = cluster_config(&cluster);
    let out = config.cli(&["stats"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("cluster|slots"), "{err}");
    assert!(!err.contains("zd-secret"), "no password in errors: {err}");
}
