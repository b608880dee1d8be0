//! zdelay on a real Redis Cluster (3 masters + 3 replicas, started by the test on loopback):
//! the library, the CLI, raw sources and routes in and out of the shards' slots. Every
//! script must touch one slot: a CROSSSLOT anywhere fails these tests (jobs would not move,
//! and the daemon log is checked for it).

use crate::common::{Daemon, RedisCluster, TestConfig, wait_for};
use redis::cluster::ClusterConnection;
use std::collections::BTreeMap;
use std::time::Duration;
use zdelay::{Client, NewJob, OnConflict};

const SHARDS: u16 = 4;

fn llen(con: &mut ClusterConnection, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
}

fn lrange(con: &mut ClusterConnection, key: &str) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(con)
        .expect("LRANGE")
}

fn shard_total(con: &mut ClusterConnection, suffix: &str) -> usize {
    crate::common::stored::stored_total(con, suffix)
}

fn client(rt: &tokio::runtime::Runtime, cluster: &RedisCluster) -> Client {
    rt.block_on(Client::connect(&cluster.redis_config(SHARDS)))
        .expect("library client on the cluster")
}

/// A config on the cluster: route `a` to list `q:a` (its route lane is in `q:a`'s slot:
/// exactly once, whatever slot the list is in), route `r` to `{raw}:out`, raw source `{raw}:src` → `r` (one
/// slot: exactly once in move_raw) and `{raw2}:src` → `a` (two-phase, leased in place).
fn config(cluster: &RedisCluster, extra: &str) -> TestConfig {
    let text = format!(
        r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "r"
sink = "local"
target = "{{raw}}:out"
push = "rpush"

[[sources]]
key = "{{raw}}:src"
route = "r"

[[sources]]
key = "{{raw2}}:src"
route = "a"
{extra}
"#
    );
    cluster.config(SHARDS, &text)
}

fn assert_no_crossslot(daemon: &Daemon) {
    let log = daemon.log_text();
    assert!(
        !log.contains("CROSSSLOT") && !log.contains("crossed slots"),
        "a command touched two slots:\n{log}"
    );
}

#[test]
fn library_cli_raw_sources_and_routes_work_on_a_cluster() {
    let cluster = RedisCluster::start();
    let config = config(&cluster, "");
    let out = config.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("route a: list q:a, moved exactly once from its route lane"),
        "check-config says a local route is delivered from its lane on the cluster: {said}"
    );
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let lib = client(&rt, &cluster);
    let mut con = cluster.conn();

    // Library: ids with braces choose their shard by tag; some due now, some later.
    let jobs: Vec<NewJob> = (0..400)
        .map(|i| {
            let job = NewJob::new("a", format!("lib-{i}"));
            let job = if i % 3 == 0 {
                job.id(format!("{{user-{}}}:job{{{i}}}", i % 7))
            } else {
                job
            };
            if i % 2 == 0 {
                job
            } else {
                job.after(Duration::from_millis(300))
            }
        })
        .collect();
    for r in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }

    // CLI: one job, a batch, get, reschedule, cancel.
    let ok = |args: &[&str]| {
        let out = config.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&[
        "enqueue",
        "--dest",
        "a",
        "--in",
        "100ms",
        "--payload",
        "cli-1",
    ]);
    let batch = config.path.with_file_name("batch.jsonl");
    std::fs::write(
        &batch,
        "{\"dest\":\"a\",\"payload\":\"cli-b1\"}\n{\"dest\":\"a\",\"payload\":\"cli-b2\",\"in\":\"50ms\"}\n",
    )
    .unwrap();
    let ids = ok(&["enqueue", "--batch", batch.to_str().unwrap()]);
    assert_eq!(ids.lines().count(), 2);
    let later = ok(&[
        "enqueue",
        "--dest",
        "a",
        "--in",
        "1h",
        "--payload",
        "cli-later",
    ]);
    let later = later.trim();
    let got: serde_json::Value = serde_json::from_str(&ok(&["get", later, "--json"])).unwrap();
    assert_eq!(got["state"], "scheduled");
    ok(&["reschedule", later, "--in", "2h"]);
    assert!(ok(&["cancel", later]).contains("cancelled"));

    // Raw producers: ZADD due now.
    let now: i64 = {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut con).unwrap();
        s * 1000 + us / 1000
    };
    for i in 0..50 {
        let _: () = redis::cmd("ZADD")
            .arg("{raw}:src")
            .arg(now)
            .arg(format!("raw-{i}"))
            .query(&mut con)
            .unwrap();
        let _: () = redis::cmd("ZADD")
            .arg("{raw2}:src")
            .arg(now)
            .arg(format!("raw2-{i}"))
            .query(&mut con)
            .unwrap();
    }

    let want_a = 400 + 1 + 2 + 50;
    wait_for("everything delivered", Duration::from_secs(30), || {
        llen(&mut con, "q:a") >= want_a && llen(&mut con, "{raw}:out") >= 50
    });
    wait_for("nothing left in flight", Duration::from_secs(30), || {
        shard_total(&mut con, "jobs") == 0 && shard_total(&mut con, "inflight") == 0
    });
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for item in lrange(&mut con, "q:a") {
        *seen.entry(item).or_default() += 1;
    }
    assert_eq!(seen.len(), want_a, "every job of route a arrived");
    assert!(
        seen.values().all(|&n| n == 1),
        "no repeat without a crash: {:?}",
        seen.iter()
            .filter(|(_, n)| **n > 1)
            .take(3)
            .collect::<Vec<_>>()
    );
    assert!(
        !seen.contains_key("cli-later"),
        "the cancelled job never arrives"
    );
    assert_eq!(
        llen(&mut con, "{raw}:out"),
        50,
        "raw to its own slot: exactly once"
    );
    let raw_left: usize = redis::cmd("ZCARD")
        .arg("{raw2}:src")
        .query(&mut con)
        .unwrap();
    assert_eq!(raw_left, 0);

    // Dead letters and stats on the cluster.
    let expired = NewJob::new("a", "x")
        .id("{d}:dead-1")
        .at(now - 60_000)
        .max_lateness(Duration::from_secs(1));
    rt.block_on(lib.enqueue(expired, OnConflict::Error))
        .unwrap();
    wait_for("the expired job died", Duration::from_secs(10), || {
        shard_total(&mut con, "dead") == 1
    });
    assert!(ok(&["dead", "list"]).contains("{d}:dead-1"));
    let stats: serde_json::Value = serde_json::from_str(&ok(&["stats", "--json"])).unwrap();
    assert_eq!(stats["total"]["dead"], 1, "{stats:#}");
    assert_eq!(ok(&["dead", "purge", "--all"]).trim(), "purged 1");
    assert_no_crossslot(&daemon);
}

/// Envelope jobs from a cluster to every kind of sink: each broker gets each job once,
/// under its message id `<id>:<due ms>`.
#[test]
fn every_sink_delivers_from_a_cluster() {
    use crate::broker_faults::{amqp_message_ids, amqp_tool, check_message_ids, make_stream};
    use crate::common::Services;
    const N: usize = 100;
    let services = Services::get();
    let python = services.python();
    let rt = crate::common::runtime();
    let tag = ulid::Ulid::generate().to_string().to_lowercase();
    let nats = services.nats_url();
    let (_js, stream, prefix) = rt.block_on(make_stream(&nats));
    let brokers = services.kafka_brokers();
    let topic = format!("cl-{tag}");
    crate::kafka::create_topic(&services.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let amqp = services.amqp_url();
    let queue = format!("cl-{tag}");
    amqp_tool(&python, &amqp, &["declare", &queue]);
    let remote = crate::common::RedisServer::start();
    let cluster = RedisCluster::start();
    let config = cluster.config(
        SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"

[sinks.kafka]
kind = "kafka"
brokers = "{brokers}"

[sinks.rabbit]
kind = "amqp"
url = "{amqp}"

[sinks.bus]
kind = "nats"
url = "{nats}"

[sinks.other]
kind = "redis"
url = "{remote}"

[[routes]]
name = "k"
sink = "kafka"
target = "{topic}"

[[routes]]
name = "a"
sink = "rabbit"
target = "/{queue}"

[[routes]]
name = "n"
sink = "bus"
target = "{prefix}.cl"

[[routes]]
name = "r"
sink = "other"
target = "q:cl"
"#,
            remote = remote.url()
        ),
    );
    let daemon = Daemon::start(&config);
    let lib = client(&rt, &cluster);
    let mut ids: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for route in ["k", "a", "n", "r"] {
        let jobs: Vec<NewJob> = (0..N)
            .map(|i| NewJob::new(route, format!("{route}-{i}")).id(format!("{route}-{i}")))
            .collect();
        for r in rt
            .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
            .unwrap()
        {
            r.expect("enqueued");
        }
        ids.insert(route, (0..N).map(|i| format!("{route}-{i}")).collect());
    }
    let mut con = cluster.conn();
    wait_for(
        "every job delivered and acked",
        Duration::from_secs(60),
        || shard_total(&mut con, "jobs") == 0 && shard_total(&mut con, "inflight") == 0,
    );
    let records = crate::kafka::consume(&python, &brokers, &topic, N as i64);
    let kafka_ids: Vec<String> = records
        .iter()
        .map(|r| {
            let (_, id) = r
                .headers
                .iter()
                .find(|(k, _)| k == "zdelay-id")
                .expect("zdelay-id header");
            String::from_utf8(id.clone()).expect("utf-8")
        })
        .collect();
    assert_eq!(check_message_ids("Kafka", &ids["k"], &kafka_ids), 0);
    let amqp_ids = amqp_message_ids(&python, &amqp, &queue, N);
    assert_eq!(check_message_ids("RabbitMQ", &ids["a"], &amqp_ids), 0);
    let nats_ids = crate::broker_faults::nats_message_ids(&python, &nats, &stream, &prefix, N);
    assert_eq!(check_message_ids("NATS", &ids["n"], &nats_ids), 0);
    let mut rcon = remote.conn();
    let listed: std::collections::BTreeSet<String> = crate::common::lrange(&mut rcon, "q:cl")
        .into_iter()
        .map(|b| String::from_utf8(b).expect("utf-8"))
        .collect();
    assert_eq!(listed.len(), N, "remote Redis: each job once");
    assert_eq!(crate::common::llen(&mut rcon, "q:cl"), N);
    assert_no_crossslot(&daemon);
}

/// Braces in job ids, route names and list names follow the Redis hash-tag rule (the first
/// `{…}` with something inside): ids choose their shard by it, lists are pushed on the node
/// of their own slot; a namespace with braces is refused (it forms every key's tag).
#[test]
fn braces_in_ids_routes_and_lists_keep_slots_right() {
    let cluster = RedisCluster::start();
    let lists = ["q:{x}", "{}q", "q}{", "{{y}}", "q:{"];
    let mut routes = String::from("[poller]\nidle_poll = \"50ms\"\n");
    for (i, list) in lists.iter().enumerate() {
        routes.push_str(&format!(
            "\n[[routes]]\nname = \"r{{{i}}}\"\nsink = \"local\"\ntarget = \"{list}\"\npush = \"rpush\"\n"
        ));
    }
    let config = cluster.config(SHARDS, &routes);
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let lib = client(&rt, &cluster);
    let ids = ["a{b}c", "{x}", "}{", "{}", "{{y}}", "z{", "{a}{b}", "plain"];
    let mut jobs = Vec::new();
    for (i, _) in lists.iter().enumerate() {
        for id in ids {
            jobs.push(
                NewJob::new(format!("r{{{i}}}"), format!("{i}:{id}")).id(format!("{id}-{i}")),
            );
        }
    }
    for r in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }
    // A later one per id, to get and cancel by id.
    for id in ids {
        let job = NewJob::new("r{0}", "later")
            .id(format!("{id}-later"))
            .after(Duration::from_secs(3600));
        rt.block_on(lib.enqueue(job, OnConflict::Error)).unwrap();
        let out = config.cli(&["get", &format!("{id}-later")]);
        assert!(out.status.success(), "get {id}-later");
        let out = config.cli(&["cancel", &format!("{id}-later")]);
        assert!(out.status.success(), "cancel {id}-later");
    }
    let mut con = cluster.conn();
    wait_for("every list filled", Duration::from_secs(20), || {
        lists.iter().all(|l| llen(&mut con, l) == ids.len())
    });
    for (i, list) in lists.iter().enumerate() {
        let mut got = lrange(&mut con, list);
        got.sort();
        let mut want: Vec<String> = ids.iter().map(|id| format!("{i}:{id}")).collect();
        want.sort();
        assert_eq!(got, want, "{list}");
    }
    assert_eq!(shard_total(&mut con, "jobs"), 0);
    assert_no_crossslot(&daemon);

    let bad = cluster.config(SHARDS, "");
    let body = std::fs::read_to_string(&bad.path).unwrap();
    std::fs::write(
        &bad.path,
        body.replacen("[redis]\n", "[redis]\nnamespace = \"a{b\"\n", 1),
    )
    .unwrap();
    let out = bad.cli(&["check-config"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("redis.namespace"));
}
