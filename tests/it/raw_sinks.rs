//! Raw sources (producers that just `ZADD` a payload) delivering to two-phase sinks: leased
//! by score inside the source, published, confirmed, acked — to Kafka, RabbitMQ, NATS and a
//! remote Redis, each read back by an independent client. Message ids are
//! `<source>:<sha1 of the member, 16 hex>:<due ms>`, stable through a crash and a lease
//! expiry; a broker reject sends the member to the source's dead ZSET with the reason; a
//! sink that is down leaves the members in the source untouched.

use crate::broker_faults::{
    amqp_message_ids, amqp_tool, check_message_ids, js_count, make_stream, nats_message_ids,
};
use crate::common::{Daemon, RedisServer, Services, TestConfig, llen, lrange, runtime, wait_for};
use std::collections::BTreeSet;
use std::time::Duration;

fn tag() -> String {
    ulid::Ulid::generate().to_string().to_lowercase()
}

/// SHA-1 of `member` as Redis computes it (the reference the daemon's ids use).
fn sha1(con: &mut redis::Connection, member: &str) -> String {
    redis::cmd("EVAL")
        .arg("return redis.sha1hex(ARGV[1])")
        .arg(0)
        .arg(member)
        .query(con)
        .expect("sha1hex")
}

/// ZADDs `n` members `<prefix>-<i>` into `key`: half due now, half 300 ms later (in the
/// source's unit); returns (member, due ms).
fn zadd_members(
    con: &mut redis::Connection,
    key: &str,
    prefix: &str,
    n: usize,
    seconds: bool,
) -> Vec<(String, i64)> {
    let now = crate::common::redis_now_ms(con);
    let members: Vec<(String, i64)> = (0..n)
        .map(|i| {
            (
                format!("{prefix}-{i}"),
                if i % 2 == 0 { now } else { now + 300 },
            )
        })
        .collect();
    let mut cmd = redis::cmd("ZADD");
    cmd.arg(key);
    for (member, due) in &members {
        if seconds {
            cmd.arg(format!("{:.3}", *due as f64 / 1000.0));
        } else {
            cmd.arg(*due);
        }
        cmd.arg(member);
    }
    let _: () = cmd.query(con).expect("ZADD");
    members
}

/// The message ids the daemon must use for these members of `source`.
fn expected_ids(
    con: &mut redis::Connection,
    source: &str,
    members: &[(String, i64)],
) -> Vec<String> {
    members
        .iter()
        .map(|(m, _)| format!("{source}:{}", &sha1(con, m)[..16]))
        .collect()
}

fn zcard(con: &mut redis::Connection, key: &str) -> usize {
    redis::cmd("ZCARD").arg(key).query(con).expect("ZCARD")
}

fn hlen(con: &mut redis::Connection, key: &str) -> usize {
    redis::cmd("HLEN").arg(key).query(con).expect("HLEN")
}

#[test]
fn raw_sources_deliver_to_kafka_amqp_nats_and_remote_redis() {
    const N: usize = 200;
    let services = Services::get();
    let python = services.python();
    let rt = runtime();
    let nats = services.nats_url();
    let (_js, stream, prefix) = rt.block_on(make_stream(&nats));
    let brokers = services.kafka_brokers();
    let topic = format!("raw-{}", tag());
    crate::kafka::create_topic(&services.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let amqp = services.amqp_url();
    let queue = format!("raw-{}", tag());
    amqp_tool(&python, &amqp, &["declare", &queue]);
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let extra = format!(
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
target = "{prefix}.raw"

[[routes]]
name = "nowhere"
sink = "bus"
target = "zd-no-stream-{tag}.raw"
on_missing = "dead"

[[routes]]
name = "nowhere_yet"
sink = "bus"
target = "zd-no-stream-yet-{tag}.raw"

[[routes]]
name = "r"
sink = "other"
target = "q:raw"

[[sources]]
key = "raw:k"
route = "k"

[[sources]]
key = "raw:a"
score_unit = "s"
route = "a"

[[sources]]
key = "raw:n"
route = "n"

[[sources]]
key = "raw:bad"
route = "nowhere"

[[sources]]
key = "raw:wait"
route = "nowhere_yet"

[[sources]]
key = "raw:r"
route = "r"
"#,
        remote = remote.url(),
        tag = tag(),
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let kafka_members = zadd_members(&mut con, "raw:k", "k", N, false);
    let amqp_members = zadd_members(&mut con, "raw:a", "a", N, true);
    let nats_members = zadd_members(&mut con, "raw:n", "n", N, false);
    let remote_members = zadd_members(&mut con, "raw:r", "r", N, false);
    zadd_members(&mut con, "raw:bad", "bad", 1, false);
    zadd_members(&mut con, "raw:wait", "wait", 1, false);

    wait_for("every raw source drained", Duration::from_secs(30), || {
        ["raw:k", "raw:a", "raw:n", "raw:r", "raw:bad"]
            .iter()
            .all(|k| zcard(&mut con, k) == 0)
    });
    for key in ["raw:k", "raw:a", "raw:n", "raw:r"] {
        assert_eq!(
            hlen(&mut con, &format!("{key}:claims")),
            0,
            "{key}: nothing in flight"
        );
        assert_eq!(
            zcard(&mut con, &format!("{key}:dead")),
            0,
            "{key}: nothing dead"
        );
    }
    // A broker reject (no stream for the subject) sends the member to the source's dead set.
    let dead: Vec<String> = redis::cmd("ZRANGE")
        .arg("raw:bad:dead")
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .expect("ZRANGE");
    assert_eq!(dead, ["bad-0"]);
    let reason: String = redis::cmd("HGET")
        .arg("raw:bad:dead:reasons")
        .arg("bad-0")
        .query(&mut con)
        .expect("reason");
    assert!(reason.contains("no JetStream stream"), "{reason}");
    // Without `on_missing = "dead"` a member waits for its stream: tried, moved a few seconds
    // ahead, its scheduled due kept in `<source>:claims` (no attempt counted), never dead.
    let waiting = sha1(&mut con, "wait-0");
    wait_for("the waiting member tried", Duration::from_secs(30), || {
        let claims: Option<String> = redis::cmd("HGET")
            .arg("raw:wait:claims")
            .arg(&waiting)
            .query(&mut con)
            .expect("HGET");
        claims.is_some_and(|c| c.split(' ').nth(1) == Some("0"))
    });
    assert_eq!(zcard(&mut con, "raw:wait"), 1, "still in its source");
    assert_eq!(zcard(&mut con, "raw:wait:dead"), 0, "not dead");

    // Each broker got each member once, under `<source>:<sha16>:<due ms>`.
    let check = |what: &str, source: &str, members: &[(String, i64)], ids: &[String]| {
        let mut con = redis.conn();
        let want = expected_ids(&mut con, source, members);
        assert_eq!(check_message_ids(what, &want, ids), 0, "{what}: no repeats");
        let dues: BTreeSet<String> = members
            .iter()
            .zip(&want)
            .map(|((_, due), id)| format!("{id}:{due}"))
            .collect();
        let got: BTreeSet<String> = ids.iter().cloned().collect();
        assert_eq!(got, dues, "{what}: message ids carry the scheduled due");
    };
    let records = crate::kafka::consume(&python, &brokers, &topic, N as i64);
    let kafka_ids: Vec<String> = records
        .iter()
        .map(|r| {
            let (_, id) = r
                .headers
                .iter()
                .find(|(k, _)| k == "zdelay-id")
                .expect("zdelay-id");
            String::from_utf8(id.clone()).expect("utf-8")
        })
        .collect();
    let payloads: BTreeSet<Vec<u8>> = records.iter().map(|r| r.value.clone()).collect();
    let sent: BTreeSet<Vec<u8>> = kafka_members
        .iter()
        .map(|(m, _)| m.clone().into_bytes())
        .collect();
    assert_eq!(payloads, sent, "Kafka: the payloads as ZADDed");
    check("Kafka", "raw:k", &kafka_members, &kafka_ids);
    check(
        "RabbitMQ",
        "raw:a",
        &amqp_members,
        &amqp_message_ids(&python, &amqp, &queue, N),
    );
    assert_eq!(js_count(&rt, &nats, &stream), N as u64);
    check(
        "NATS",
        "raw:n",
        &nats_members,
        &nats_message_ids(&python, &nats, &stream, &prefix, N),
    );
    let mut rcon = remote.conn();
    let listed: BTreeSet<String> = lrange(&mut rcon, "q:raw")
        .into_iter()
        .map(|b| String::from_utf8(b).expect("utf-8"))
        .collect();
    let want: BTreeSet<String> = remote_members.iter().map(|(m, _)| m.clone()).collect();
    assert_eq!(listed, want, "remote Redis: each member once");
    assert_eq!(llen(&mut rcon, "q:raw"), N);
    amqp_tool(&python, &amqp, &["delete", &queue]);
    drop(daemon);
}

/// The sink of a raw source down: its members stay in the source with their scores as the
/// producer wrote them (no lease taken, no rewrite, no attempt), then all arrive.
#[test]
fn a_raw_source_waits_untouched_while_its_sink_is_down() {
    const N: usize = 500;
    let redis = RedisServer::start();
    let mut remote = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
sink_pause = "100ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "r"
sink = "other"
target = "q:raw"

[[sources]]
key = "raw:r"
route = "r"
"#,
        remote.url()
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let daemon = Daemon::start(&config);
    remote.stop();
    let mut con = redis.conn();
    // A first member finds the sink down and pauses it.
    let first = zadd_members(&mut con, "raw:r", "first", 1, false);
    wait_for(
        "/readyz reports the sink down",
        Duration::from_secs(10),
        || matches!(daemon.admin_get("/readyz"), Some((503, body)) if body.contains("sink other")),
    );
    let members = zadd_members(&mut con, "raw:r", "r", N, false);
    let scores = |con: &mut redis::Connection| -> Vec<(String, f64)> {
        redis::cmd("ZRANGE")
            .arg("raw:r")
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(con)
            .expect("ZRANGE")
    };
    let before = scores(&mut con);
    std::thread::sleep(Duration::from_secs(3)); // the outage: a measurement window
    let after = scores(&mut con);
    let untouched: Vec<&(String, f64)> = after
        .iter()
        .filter(|(m, _)| !m.starts_with("first"))
        .collect();
    assert_eq!(untouched.len(), N, "every member still in the source");
    for entry in &untouched {
        assert!(
            before.contains(entry),
            "{entry:?}: not rewritten while the sink was down"
        );
    }
    remote.start_again();
    let mut rcon = remote.conn();
    wait_for("every member delivered", Duration::from_secs(30), || {
        llen(&mut rcon, "q:raw") > N && zcard(&mut con, "raw:r") == 0
    });
    let got: BTreeSet<String> = lrange(&mut rcon, "q:raw")
        .into_iter()
        .map(|b| String::from_utf8(b).expect("utf-8"))
        .collect();
    assert_eq!(got.len(), N + 1);
    assert!(members.iter().chain(&first).all(|(m, _)| got.contains(m)));
    assert_eq!(hlen(&mut con, "raw:r:claims"), 0);
}

/// The daemon dies between JetStream's PubAck and the ack in the source: after the lease
/// runs out, the restarted daemon claims the members again and publishes them under the same
/// `Nats-Msg-Id` (the original due survives the lease), so the stream holds each once.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_raw_crash_between_publish_and_ack_keeps_the_message_id() {
    const N: usize = 300;
    let services = Services::get();
    let nats = services.var("NATS29_URL");
    let rt = runtime();
    let (_js, stream, prefix) = rt.block_on(make_stream(&nats));
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
lease = "1s"

[sinks.bus]
kind = "nats"
url = "{nats}"

[[routes]]
name = "n"
sink = "bus"
target = "{prefix}.raw"

[[sources]]
key = "raw:n"
route = "n"
"#
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let mut con = redis.conn();
    let members = zadd_members(&mut con, "raw:n", "n", N, false);
    let mut crashing =
        Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", "abort_after_publish")]);
    let status = crashing.wait_exit(Duration::from_secs(30));
    assert!(
        !status.success(),
        "the failpoint aborted the daemon: {status}"
    );
    let published = js_count(&rt, &nats, &stream);
    assert!(published > 0, "it published before dying");
    let in_flight = hlen(&mut con, "raw:n:claims");
    assert!(in_flight > 0, "claimed members were left in flight");
    let _daemon = Daemon::start(&config);
    wait_for("every member acked", Duration::from_secs(30), || {
        zcard(&mut con, "raw:n") == 0 && hlen(&mut con, "raw:n:claims") == 0
    });
    let ids = nats_message_ids(&services.python(), &nats, &stream, &prefix, N);
    let want = expected_ids(&mut con, "raw:n", &members);
    assert_eq!(
        check_message_ids("raw source after a crash", &want, &ids),
        0,
        "JetStream absorbed the republish"
    );
    assert_eq!(js_count(&rt, &nats, &stream), N as u64);
    eprintln!("raw crash test: {published} published before the crash, {in_flight} in flight");
}
