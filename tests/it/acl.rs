//! A Redis user limited by ACL to zdelay's keys and the commands it needs
//! (docs/guides/security.md, "The daemon's user") runs the daemon, the CLI and the library, on
//! one Redis and on a cluster; without `cluster|slots` a cluster connection fails with an error
//! that says so. A narrower producer user (same page, "The producer's user") enqueues every
//! way there is and is refused the rest.

use crate::common::{Daemon, RedisCluster, RedisServer, TestConfig, llen, redis_now_ms, wait_for};
use std::time::Duration;

/// The ACL rules of the book's example daemon user (docs/guides/security.md), as
/// `redis-server --user` arguments.
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

# Its list is made a string: its jobs die (WRONGTYPE), again when replayed.
[[routes]]
name = "w"
sink = "local"
target = "q:w"

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
    let _: () = redis::cmd("SET")
        .arg("q:w")
        .arg("not a list")
        .query(con)
        .expect("SET");
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
    let (doomed, _) = rt
        .block_on(lib.enqueue(zdelay::NewJob::new("w", "x"), zdelay::OnConflict::Error))
        .expect("enqueued");
    let len = |con: &mut dyn redis::ConnectionLike, key: &str| -> usize {
        redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
    };
    wait_for("everything delivered", Duration::from_secs(30), || {
        len(con, "q:l") == 20 && len(con, "{raw}:out") == 10
    });
    wait_for("the job to w dead", Duration::from_secs(10), || {
        ok(&["dead", "list"]).contains(&doomed)
    });
    ok(&["dead", "replay", "--all"]);
    wait_for("dead again", Duration::from_secs(10), || {
        ok(&["dead", "list"]).contains(&doomed)
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

/// The book's producer user (docs/guides/security.md, "The producer's user"): the rules after
/// `ACL SETUSER producer on >secret`. Enqueue (one, batch, replace), get, reschedule and
/// cancel in the route lanes a daemon registered; the schema, the lane registry and the lane
/// markers read only; and `ZADD` on one raw source.
const PRODUCER_RULES: &str = "%R~zdelay:schema %R~zdelay:lanes ~zdelay:{*}:lane:* \
    ~zdelay:{*}:due:* ~zdelay:{*}:jobs:* ~zdelay:{*}:meta:* ~zdelay:{*}:maxlate:* \
    ~zdelay:{*}:large:* ~zdelay:{*}:dead:* ~zdelay:{*}:reasons:* ~zdelay:{*}:unique:* \
    ~zdelay:{*}:s*:due ~zdelay:{*}:s*:jobs ~zdelay:{*}:s*:inflight ~zdelay:{*}:s*:dead \
    ~zdelay:{*}:s*:reasons ~zdelay:{*}:s*:scheduled ~zdelay:{*}:s*:ready \
    ~zdelay:{*}:s*:ready_ids ~zdelay:{*}:s*:max_lateness ~zdelay:{*}:s*:shards \
    ~zdelay:{*}:s*:unique ~{raw}:src &zdelay:wake +ping +info +time +script|load +evalsha \
    +get +hget +hgetall +hexists +hset +hdel +zadd +zrange +zscore +zrem +sadd +srem +hstrlen \
    +publish";

fn words(text: &str) -> Vec<&str> {
    text.split_whitespace().filter(|w| *w != "\\").collect()
}

#[test]
fn the_security_guide_shows_the_tested_producer_acl() {
    let guide = include_str!("../../docs/guides/security.md");
    let shown = guide
        .split("ACL SETUSER producer on >secret")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/guides/security.md shows ACL SETUSER producer");
    assert_eq!(words(shown), words(PRODUCER_RULES));
}

/// With the daemon's user (`zd`) running the daemon, a producer user limited to
/// `PRODUCER_RULES` enqueues through the CLI (one job, `--batch`, to a local and a two-phase
/// route), the library (`enqueue`, `enqueue_batch`) and a raw `ZADD`, and everything is
/// delivered; what a producer has no business doing is refused with NOPERM. With the book's
/// addition for producers that register routes, it registers a route no daemon has.
#[test]
fn a_producer_user_enqueues_and_is_refused_the_rest() {
    let mut args = acl_user(&[]);
    args.extend(
        ["--user", "producer", "on", ">producer-secret"]
            .into_iter()
            .chain(PRODUCER_RULES.split_whitespace())
            .map(str::to_owned),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = RedisServer::start_with(&args);
    let producer_url = redis
        .url()
        .replacen("redis://", "redis://producer:producer-secret@", 1);
    // And a two-phase route (to another Redis), whose jobs wait in the spread shards.
    let target = RedisServer::start();
    let routes = format!(
        "{ROUTES}\n[sinks.other]\nkind = \"redis\"\nurl = \"{}\"\n\n\
         [[routes]]\nname = \"m\"\nsink = \"other\"\ntarget = \"q:m\"\n",
        target.url()
    );
    // The producer's config has one more route, n, which no daemon registers.
    let producer = TestConfig::new(
        &producer_url,
        4,
        &format!("{routes}\n[[routes]]\nname = \"n\"\nsink = \"local\"\ntarget = \"q:n\"\n"),
    );
    let run = |args: &[&str]| {
        let out = producer.cli(args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };

    // Before any daemon: the producer may not create the namespace's schema, and says so.
    let (ok, text) = run(&["enqueue", "--dest", "l", "--payload", "early"]);
    assert!(!ok, "{text}");
    assert!(text.contains("start a daemon"), "{text}");
    assert!(!text.contains("producer-secret"), "{text}");

    let daemon_config = TestConfig::new(&with_user(&redis.url()), 4, &routes);
    let daemon = Daemon::start(&daemon_config);

    let ok_out = |args: &[&str]| {
        let (ok, text) = run(args);
        assert!(ok, "{args:?} as producer: {text}");
        text.trim().to_owned()
    };
    ok_out(&["enqueue", "--dest", "l", "--payload", "cli"]);
    ok_out(&["enqueue", "--dest", "m", "--payload", "two-phase"]);
    let batch = tempfile::NamedTempFile::new().expect("batch file");
    std::fs::write(
        batch.path(),
        "{\"dest\":\"l\",\"payload\":\"batch-1\"}\n{\"dest\":\"l\",\"payload\":\"batch-2\"}\n",
    )
    .expect("batch file");
    ok_out(&["enqueue", "--batch", crate::common::path_str(batch.path())]);
    // Its own jobs: replace, get, reschedule, cancel.
    ok_out(&[
        "enqueue",
        "--dest",
        "l",
        "--in",
        "1h",
        "--id",
        "p-1",
        "--payload",
        "a",
    ]);
    ok_out(&[
        "enqueue",
        "--dest",
        "l",
        "--in",
        "1h",
        "--id",
        "p-1",
        "--payload",
        "b",
        "--on-conflict",
        "replace",
    ]);
    assert!(ok_out(&["get", "p-1", "-o", "json"]).contains("\"b\""));
    ok_out(&["reschedule", "p-1", "--in", "2h"]);
    ok_out(&["cancel", "p-1"]);

    let rt = crate::common::runtime();
    // A producer's connect: the shard count (4) comes from the namespace, not the config.
    let lib = rt
        .block_on(zdelay::Client::attach(&zdelay::config::RedisConfig {
            url: producer_url.clone(),
            ..Default::default()
        }))
        .expect("library as producer");
    assert_eq!(lib.keys().shards(), 4);
    rt.block_on(lib.enqueue(zdelay::NewJob::new("l", "lib"), zdelay::OnConflict::Error))
        .expect("enqueue as producer");
    let results = rt
        .block_on(lib.enqueue_batch(
            vec![
                zdelay::NewJob::new("l", "lib-batch-1"),
                zdelay::NewJob::new("l", "lib-batch-2"),
            ],
            zdelay::OnConflict::Error,
        ))
        .expect("enqueue_batch as producer");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // What a producer does after a reshard refused it: read the layout again.
    let keys = rt
        .block_on(lib.refresh_layout())
        .expect("a producer reads the layout again");
    assert_eq!(keys.shards(), 4);

    let mut as_producer = redis::Client::open(producer_url.as_str())
        .and_then(|c| c.get_connection())
        .expect("producer connection");
    let mut admin = redis.conn();
    let now = redis_now_ms(&mut admin);
    let _: () = redis::cmd("ZADD")
        .arg("{raw}:src")
        .arg(now)
        .arg("raw-1")
        .query(&mut as_producer)
        .expect("raw ZADD as producer");

    wait_for(
        "the producer's jobs delivered",
        Duration::from_secs(30),
        || {
            llen(&mut admin, "q:l") == 6
                && llen(&mut admin, "{raw}:out") == 1
                && llen(&mut target.conn(), "q:m") == 1
        },
    );
    let mut delivered: Vec<String> = crate::common::lrange(&mut admin, "q:l")
        .into_iter()
        .map(|p| String::from_utf8_lossy(&p).into_owned())
        .collect();
    delivered.sort();
    assert_eq!(
        delivered,
        [
            "batch-1",
            "batch-2",
            "cli",
            "lib",
            "lib-batch-1",
            "lib-batch-2"
        ]
    );

    // Refused: deleting, reading queues or another namespace, rewriting the schema, server
    // commands, and the operators' dead-letter and stats commands.
    let mut refused = |cmd: &mut redis::Cmd| {
        let err = cmd
            .query::<redis::Value>(&mut as_producer)
            .expect_err("refused");
        assert_eq!(err.code(), Some("NOPERM"), "{err}");
    };
    let lane = crate::common::lane_keys("l", "q:l");
    refused(redis::cmd("DEL").arg(&lane.jobs));
    refused(
        redis::cmd("SET")
            .arg(&lane.marker)
            .arg("2 0 LPUSH elsewhere"),
    );
    refused(redis::cmd("HSET").arg("zdelay:lanes").arg("r:x").arg("1"));
    refused(
        redis::cmd("ZRANGE")
            .arg(lane.due.replacen("zdelay:", "other:", 1))
            .arg(0)
            .arg(-1),
    );
    refused(redis::cmd("LRANGE").arg("q:l").arg(0).arg(-1));
    refused(redis::cmd("HSET").arg("zdelay:schema").arg("shards").arg(8));
    refused(redis::cmd("HGETALL").arg("{zdelay}:instances"));
    refused(&mut redis::cmd("FLUSHALL"));
    refused(redis::cmd("CONFIG").arg("GET").arg("requirepass"));
    for args in [
        &["dead", "list"][..],
        &["dead", "purge", "--all"],
        &["dead", "replay", "--all"],
        &["stats"],
    ] {
        let (ok, text) = run(args);
        assert!(!ok, "{args:?} as producer: {text}");
        assert!(text.contains("no permissions"), "{args:?}: {text}");
    }
    // Route n has no lane: this user may not register it, and is told what to grant; granted
    // that (the book's addition), the producer registers it and enqueues.
    let (ok, text) = run(&["enqueue", "--dest", "n", "--payload", "first"]);
    assert!(!ok && text.contains("may not register it"), "{text}");
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("producer")
        .arg("~zdelay:lanes")
        .arg("~zdelay:{*}:lane:*")
        .arg("+hincrby")
        .arg("+set")
        .query(&mut admin)
        .expect("ACL SETUSER");
    ok_out(&["enqueue", "--dest", "n", "--in", "1h", "--payload", "first"]);
    let registered: Option<String> = redis::cmd("HGET")
        .arg("zdelay:lanes")
        .arg("r:n")
        .query(&mut admin)
        .expect("HGET");
    assert!(
        registered.is_some_and(|e| e.ends_with(" q:n")),
        "route n's lane"
    );
    let log = daemon.log_text();
    assert!(
        !log.contains("NOPERM"),
        "the daemon needed more rights:\n{log}"
    );
}
