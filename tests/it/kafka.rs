//! Kafka sink against a real tansu broker (scripts/services.sh), records read back with an
//! independent client (confluent-kafka, tests/it/py/kafka_consume.py).

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use zdelay::config::{KafkaKey, KafkaSinkConfig};
use zdelay::sinks::kafka::KafkaSink;
use zdelay::sinks::{Message, Outcome};

use crate::common::{self, Services};

fn unique_topic(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("zd-{tag}-{}-{nanos}", std::process::id())
}

pub(crate) fn create_topic(topic_cmd: &str, topic: &str, partitions: u32) {
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("{topic_cmd} {topic} {partitions}"))
        .status()
        .expect("sh runs");
    assert!(status.success(), "creating topic {topic} failed: {status}");
}

fn sink_config(brokers: &str, extra: &[(&str, &str)]) -> KafkaSinkConfig {
    KafkaSinkConfig {
        brokers: brokers.to_owned(),
        allow: vec![],
        key: KafkaKey::Id,
        librdkafka: extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn message(id: &str, due_ms: i64, topic: &str, payload: Vec<u8>) -> Message {
    Message {
        id: id.to_owned(),
        due_ms,
        target: topic.to_owned(),
        payload,
        headers: BTreeMap::new(),
        priority: None,
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// One record as the independent consumer saw it.
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) value: Vec<u8>,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
}

/// Reads `count` records of `topic` with confluent-kafka (`-n`: at least n, then all that
/// arrive until 2 s pass without a new one).
pub(crate) fn consume(python: &str, brokers: &str, topic: &str, count: i64) -> Vec<Record> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/py/kafka_consume.py");
    let out = Command::new(python)
        .args([script, brokers, topic, &count.to_string(), "60"])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "consumer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8 json")
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a json line");
            Record {
                key: v["key"].as_str().map(hex),
                value: hex(v["value"].as_str().expect("value")),
                headers: v["headers"]
                    .as_array()
                    .expect("headers")
                    .iter()
                    .map(|h| {
                        (
                            h[0].as_str().expect("name").to_owned(),
                            hex(h[1].as_str().unwrap_or("")),
                        )
                    })
                    .collect(),
            }
        })
        .collect()
}

fn assert_all_delivered(out: &[Outcome], n: usize) {
    assert_eq!(out.len(), n);
    let bad: Vec<_> = out
        .iter()
        .enumerate()
        .filter(|(_, o)| **o != Outcome::Delivered)
        .take(5)
        .collect();
    assert!(bad.is_empty(), "not delivered: {bad:?}");
}

#[test]
fn kafka_publish_1000_read_back_by_independent_consumer() {
    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let topic = unique_topic("thousand");
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 3);
    let sink = KafkaSink::new("kafka", &sink_config(&brokers, &[])).expect("sink builds");

    let n = 1000;
    let batch: Vec<Message> = (0..n)
        .map(|i| {
            // Binary payload: every byte value, NUL and invalid UTF-8 included.
            let mut payload = format!("job {i}:").into_bytes();
            payload.extend([0u8, 0xff, 0xfe, 0x80, (i % 256) as u8]);
            payload.extend((0..=255u8).rev());
            let mut m = message(
                &format!("id-{i:04}"),
                1_700_000_000_000 + i,
                &topic,
                payload,
            );
            m.headers.insert("trace".into(), format!("t-{i}"));
            m.headers
                .insert("content-type".into(), "application/x-test".into());
            m
        })
        .collect();
    let rt = common::runtime();
    let t = Instant::now();
    let out = rt.block_on(sink.publish(&batch));
    eprintln!("published {n} in {:?}", t.elapsed());
    assert_all_delivered(&out, n as usize);
    rt.block_on(sink.flush(Duration::from_secs(5)));

    let t = Instant::now();
    let records = consume(&svc.python(), &brokers, &topic, n);
    eprintln!("consumed {n} in {:?}", t.elapsed());
    assert_eq!(records.len(), n as usize, "each record exactly once");
    let by_key: HashMap<Vec<u8>, &Record> = records
        .iter()
        .map(|r| (r.key.clone().expect("record key = job id"), r))
        .collect();
    assert_eq!(by_key.len(), n as usize, "distinct keys");
    for m in &batch {
        let r = by_key
            .get(m.id.as_bytes())
            .unwrap_or_else(|| panic!("{} missing", m.id));
        assert_eq!(r.value, m.payload, "{} payload bytes", m.id);
        let mut want: Vec<(String, Vec<u8>)> = m
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect();
        want.push((
            "zdelay-id".into(),
            format!("{}:{}", m.id, m.due_ms).into_bytes(),
        ));
        let mut got = r.headers.clone();
        got.sort();
        want.sort();
        assert_eq!(got, want, "{} headers", m.id);
    }
}

#[test]
fn kafka_key_none_sends_no_key() {
    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let topic = unique_topic("nokey");
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let mut config = sink_config(&brokers, &[]);
    config.key = KafkaKey::None;
    let sink = KafkaSink::new("kafka", &config).expect("sink builds");
    let rt = common::runtime();
    let out = rt.block_on(sink.publish(&[message("a", 5, &topic, b"p".to_vec())]));
    assert_all_delivered(&out, 1);
    let records = consume(&svc.python(), &brokers, &topic, 1);
    assert_eq!(records[0].key, None);
    assert!(
        records[0]
            .headers
            .contains(&("zdelay-id".into(), b"a:5".to_vec()))
    );
}

#[test]
fn kafka_unknown_topic_is_missing_quickly_naming_it() {
    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let good = unique_topic("good");
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &good, 1);
    let missing = unique_topic("missing");
    let sink = KafkaSink::new("kafka", &sink_config(&brokers, &[])).expect("sink builds");
    let rt = common::runtime();
    // Connected and holding a producer id first, then the missing topic alone: the time is
    // librdkafka's topic.metadata.propagation.max.ms (1 s), not message.timeout.ms (15 s).
    let out = rt.block_on(sink.publish(&[message("w", 1, &good, b"w".to_vec())]));
    assert_all_delivered(&out, 1);
    let t = Instant::now();
    let out = rt.block_on(sink.publish(&[message("x", 1, &missing, b"0".to_vec())]));
    let took = t.elapsed();
    eprintln!("unknown topic alone resolved in {took:?}: {out:?}");
    match &out[0] {
        Outcome::Missing(reason) => assert!(reason.contains(&missing), "{reason}"),
        other => panic!("expected Missing, got {other:?}"),
    }
    // ~1 s on an idle broker; room for a busy shared one.
    assert!(took < Duration::from_secs(8), "took {took:?}");

    // In a batch with deliverable messages: only that one is missing.
    let other_missing = unique_topic("missing2");
    let batch = [
        message("a", 1, &good, b"1".to_vec()),
        message("b", 1, &other_missing, b"2".to_vec()),
        message("c", 1, &good, b"3".to_vec()),
    ];
    let t = Instant::now();
    let out = rt.block_on(sink.publish(&batch));
    eprintln!("mixed batch resolved in {:?}: {out:?}", t.elapsed());
    assert_eq!(out[0], Outcome::Delivered);
    assert_eq!(out[2], Outcome::Delivered);
    match &out[1] {
        Outcome::Missing(reason) => assert!(reason.contains(&other_missing), "{reason}"),
        other => panic!("expected Missing, got {other:?}"),
    }
}

#[test]
fn kafka_oversize_is_rejected() {
    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let topic = unique_topic("big");
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let sink = KafkaSink::new(
        "kafka",
        &sink_config(&brokers, &[("message.max.bytes", "10000")]),
    )
    .expect("sink builds");
    let rt = common::runtime();
    let batch = [
        message("small", 1, &topic, vec![7; 100]),
        message("big", 1, &topic, vec![7; 20_000]),
        message("small2", 1, &topic, vec![7; 100]),
    ];
    let t = Instant::now();
    let out = rt.block_on(sink.publish(&batch));
    eprintln!("oversize batch resolved in {:?}: {out:?}", t.elapsed());
    assert_eq!(out[0], Outcome::Delivered);
    assert_eq!(out[2], Outcome::Delivered);
    match &out[1] {
        Outcome::Reject(reason) => assert!(
            reason.contains(&topic) && reason.to_lowercase().contains("too large"),
            "{reason}"
        ),
        other => panic!("expected Reject, got {other:?}"),
    }
}

#[test]
fn kafka_broker_down_is_unavailable_then_recovers() {
    let own =
        crate::common::PrivateBrokers::start_with("kafka", &[("ZDELAY_TANSU_STORAGE", "sqlite")]);
    let brokers = own.var("KAFKA_BROKERS");
    let topic = unique_topic("down");
    create_topic(&own.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let sink = KafkaSink::new("kafka", &sink_config(&brokers, &[])).expect("sink builds");
    let rt = common::runtime();
    let batch: Vec<Message> = (0..50)
        .map(|i| message(&format!("d{i}"), i, &topic, vec![b'x'; 100]))
        .collect();
    assert_all_delivered(&rt.block_on(sink.publish(&batch)), batch.len());
    assert_eq!(rt.block_on(sink.check()), Ok(()));

    own.run("STOP_KAFKA");
    let t = Instant::now();
    let out = rt.block_on(sink.publish(&batch));
    let took = t.elapsed();
    eprintln!("broker down: resolved in {took:?}: {:?}", out[0]);
    for o in &out {
        assert!(matches!(o, Outcome::Unavailable(_)), "{o:?}");
    }
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let t = Instant::now();
    let check = rt.block_on(sink.check());
    eprintln!("check while down ({:?}): {check:?}", t.elapsed());
    assert!(check.is_err());
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());

    own.run("START_KAFKA");
    let t = Instant::now();
    while rt.block_on(sink.check()).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "check() still failing 30 s after restart"
        );
    }
    eprintln!("check ok {:?} after restart", t.elapsed());
    let out = rt.block_on(sink.publish(&batch));
    assert_all_delivered(&out, batch.len());
    rt.block_on(sink.flush(Duration::from_secs(5)));

    // Storage survived the restart: both rounds are there, each id twice (same zdelay-id).
    let records = consume(&own.var("PYTHON"), &brokers, &topic, -100);
    assert_eq!(records.len(), 100);
    let mut per_id: HashMap<Vec<u8>, usize> = HashMap::new();
    for r in &records {
        *per_id.entry(r.key.clone().expect("key")).or_default() += 1;
    }
    assert_eq!(per_id.len(), 50);
    assert!(per_id.values().all(|&n| n == 2), "{per_id:?}");
}

/// The broker is killed while a large batch is in flight: every message comes back
/// Delivered or Unavailable (no attempt burned), and after a restart the rest go through;
/// nothing is lost.
#[test]
fn kafka_broker_killed_mid_batch_loses_nothing() {
    let own =
        crate::common::PrivateBrokers::start_with("kafka", &[("ZDELAY_TANSU_STORAGE", "sqlite")]);
    let brokers = own.var("KAFKA_BROKERS");
    let topic = unique_topic("kill");
    create_topic(&own.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let sink = KafkaSink::new("kafka", &sink_config(&brokers, &[])).expect("sink builds");
    let rt = common::runtime();
    let n = 10_000;
    let batch: Vec<Message> = (0..n)
        .map(|i| message(&format!("k{i:05}"), i, &topic, vec![b'k'; 100]))
        .collect();
    // Warm up (producer id, metadata) so that part of the batch is delivered before the kill.
    assert_all_delivered(&rt.block_on(sink.publish(&batch[..1])), 1);

    let t = Instant::now();
    let out = rt.block_on(async {
        let publish = sink.publish(&batch);
        let kill = async {
            // Early enough that the kill lands mid-batch on a fast machine too: all 10,000 once
            // went through in 630 ms, before a kill at 600 ms.
            tokio::time::sleep(Duration::from_millis(150)).await;
            let cmd = own.var("KILL_KAFKA");
            tokio::task::spawn_blocking(move || {
                Command::new("sh")
                    .arg("-c")
                    .arg(cmd)
                    .status()
                    .expect("sh runs")
            })
            .await
            .expect("kill task")
        };
        let (out, status) = tokio::join!(publish, kill);
        assert!(status.success(), "KILL_KAFKA failed");
        out
    });
    let took = t.elapsed();
    let delivered = out.iter().filter(|o| **o == Outcome::Delivered).count();
    let unavailable = out
        .iter()
        .filter(|o| matches!(o, Outcome::Unavailable(_)))
        .count();
    eprintln!("killed mid-batch: {delivered} delivered, {unavailable} unavailable in {took:?}");
    assert_eq!(
        delivered + unavailable,
        n as usize,
        "only Delivered or Unavailable: {:?}",
        out.iter()
            .find(|o| !matches!(o, Outcome::Delivered | Outcome::Unavailable(_)))
    );
    assert!(unavailable > 0, "the kill came too late to test anything");
    assert!(took < Duration::from_secs(15), "took {took:?}");

    own.run("START_KAFKA");
    let t = Instant::now();
    while rt.block_on(sink.check()).is_err() {
        assert!(t.elapsed() < Duration::from_secs(30), "broker not back");
    }
    eprintln!("broker back, check ok after {:?}", t.elapsed());
    let t = Instant::now();
    let rest: Vec<Message> = batch
        .iter()
        .zip(&out)
        .filter(|(_, o)| **o != Outcome::Delivered)
        .map(|(m, _)| m.clone())
        .collect();
    assert_all_delivered(&rt.block_on(sink.publish(&rest)), rest.len());
    eprintln!("{} republished in {:?}", rest.len(), t.elapsed());

    // Every id at least once; a repeat (a purged in-flight message the broker had in fact
    // stored) carries the same zdelay-id.
    let t = Instant::now();
    let records = consume(&own.var("PYTHON"), &brokers, &topic, -n);
    eprintln!("consumed in {:?}", t.elapsed());
    let ids: std::collections::HashSet<Vec<u8>> = records
        .iter()
        .map(|r| r.key.clone().expect("key"))
        .collect();
    eprintln!(
        "consumed {} records, {} distinct ids",
        records.len(),
        ids.len()
    );
    assert_eq!(ids.len(), n as usize, "every job delivered");
}

/// Measures the sink, not tansu's sqlite storage (which caps at ~5-7k records/s here): a
/// private tansu with memory storage.
#[test]
fn kafka_throughput_100k() {
    let own =
        crate::common::PrivateBrokers::start_with("kafka", &[("ZDELAY_TANSU_STORAGE", "memory")]);
    let brokers = own.var("KAFKA_BROKERS");
    let topic = unique_topic("perf");
    create_topic(&own.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let sink = KafkaSink::new("kafka", &sink_config(&brokers, &[])).expect("sink builds");
    let rt = common::runtime();
    let batches: Vec<Vec<Message>> = (0..100)
        .map(|b| {
            (0..1000)
                .map(|i| {
                    let n = b * 1000 + i;
                    message(&format!("{n:026}"), n, &topic, vec![b'p'; 100])
                })
                .collect()
        })
        .collect();
    // Warm up the connection and the topic's metadata.
    assert_all_delivered(&rt.block_on(sink.publish(&batches[0][..1])), 1);
    let t = Instant::now();
    let mut delivered = 0;
    for batch in &batches {
        let out = rt.block_on(sink.publish(batch));
        delivered += out.iter().filter(|o| **o == Outcome::Delivered).count();
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(delivered, 100_000);
    eprintln!(
        "kafka sink: 100000 x 100 B in batches of 1000, one batch at a time: {secs:.2} s = \
         {:.0} msgs/s",
        100_000.0 / secs
    );

    // Four publishers at once (as several pollers would), each a quarter of the batches.
    let sink = std::sync::Arc::new(sink);
    let t = Instant::now();
    let delivered: usize = rt.block_on(async {
        let mut tasks = Vec::new();
        for part in batches.chunks(25) {
            let sink = sink.clone();
            let part = part.to_vec();
            tasks.push(tokio::spawn(async move {
                let mut n = 0;
                for batch in &part {
                    let out = sink.publish(batch).await;
                    n += out.iter().filter(|o| **o == Outcome::Delivered).count();
                }
                n
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await.expect("publisher task");
        }
        n
    });
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(delivered, 100_000);
    eprintln!(
        "kafka sink: 100000 x 100 B in batches of 1000, 4 batches in flight: {secs:.2} s = \
         {:.0} msgs/s",
        100_000.0 / secs
    );
}

/// End to end through the daemon: jobs enqueued with the library reach a real Kafka-protocol
/// broker with key = id and the `zdelay-id` header, confirmed (acks=all) before the ack.
#[test]
fn daemon_delivers_scheduled_jobs_to_kafka() {
    daemon_delivers_to_kafka();
}

fn daemon_delivers_to_kafka() {
    use crate::common::{Daemon, RedisServer, TestConfig, client, wait_all_settled_in};
    use zdelay::client::{NewJob, OnConflict};

    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let topic = unique_topic("e2e");
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[sinks.kafka]
kind = "kafka"
brokers = "{brokers}"
allow = ["zd-e2e-*"]

[[routes]]
name = "orders"
sink = "kafka"
target = "{topic}"
"#
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let _daemon = Daemon::start(&config);
    let rt = common::runtime();
    let client = client(&rt, &redis.url(), 2);
    let mut jobs: Vec<NewJob> = (0..200)
        .map(|i| {
            NewJob::new("orders", vec![i as u8, 0, 0xff])
                .after(Duration::from_millis(100))
                .header("tenant", "acme")
        })
        .collect();
    jobs.push(NewJob::new(format!("kafka/{topic}"), b"direct".to_vec()));
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    let mut con = redis.conn();
    let keys = zdelay::keys::Keys::new("zdelay", 2);
    wait_all_settled_in(&mut con, &keys, Duration::from_secs(60));
    let records = consume(&svc.python(), &brokers, &topic, 201);
    let mut seen = HashMap::new();
    for r in &records {
        let key = String::from_utf8(r.key.clone().expect("record key")).expect("utf-8 key");
        assert!(ids.contains(&key), "key = job id: {key}");
        let headers: BTreeMap<&str, &[u8]> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let zid = String::from_utf8(headers["zdelay-id"].to_vec()).expect("utf-8");
        assert!(zid.starts_with(&format!("{key}:")), "{zid}");
        if r.value != b"direct" {
            assert_eq!(headers.get("tenant").copied(), Some(&b"acme"[..]));
        }
        *seen.entry(key).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 201, "every job reached the topic");
    assert!(seen.values().all(|&n| n == 1), "no crash, so no duplicate");
}

/// A route to a topic nobody created yet: its jobs wait (no attempt counted, nothing dead)
/// and `zdelay stats` and the console show the topic held, while another route on the same sink flows;
/// once the topic exists every job arrives once. A route with `on_missing = "dead"` sends
/// its jobs to dead naming the topic instead.
#[test]
fn a_missing_topic_holds_its_jobs_until_it_exists() {
    use crate::common::stored_total;
    use crate::common::{Daemon, RedisServer, TestConfig, client, wait_for};
    use zdelay::client::{NewJob, OnConflict};

    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let (later, live, strict) = (
        unique_topic("later"),
        unique_topic("live"),
        unique_topic("strict"),
    );
    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &live, 1);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[sinks.kafka]
kind = "kafka"
brokers = "{brokers}"

[[routes]]
name = "later"
sink = "kafka"
target = "{later}"

[[routes]]
name = "live"
sink = "kafka"
target = "{live}"

[[routes]]
name = "strict"
sink = "kafka"
target = "{strict}"
on_missing = "dead"
"#
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let client = client(&rt, &redis.url(), 2);
    let jobs = |route: &str, n: usize| -> Vec<NewJob> {
        (0..n)
            .map(|i| NewJob::new(route, format!("{route}-{i}").into_bytes()))
            .collect()
    };
    let mut later_ids = Vec::new();
    for (route, n) in [("later", 31), ("live", 10), ("strict", 5)] {
        for r in rt
            .block_on(client.enqueue_batch(jobs(route, n), OnConflict::Error))
            .expect("enqueue")
        {
            let (id, _) = r.expect("enqueued");
            if route == "later" {
                later_ids.push(id);
            }
        }
    }
    let mut con = redis.conn();
    wait_for(
        "the strict route's jobs dead",
        Duration::from_secs(30),
        || stored_total(&mut con, "dead") == 5,
    );
    let dead = config.cli(&["dead", "list", "--json"]);
    let dead = String::from_utf8_lossy(&dead.stdout).into_owned();
    assert!(dead.contains(&strict), "the reason names the topic: {dead}");
    let stats = || String::from_utf8_lossy(&config.cli(&["stats"]).stdout).into_owned();
    wait_for(
        "stats to show the topic held",
        Duration::from_secs(30),
        || stats().contains(&format!("held {later}")),
    );
    // The console shows it too, in a real browser: the sink up, the topic held.
    let base = format!("http://127.0.0.1:{}/", config.admin_port);
    let sinks = crate::common::browser_script("console_sinks.py", &[&base]);
    assert_eq!(sinks["kafka"]["health"], "up", "{sinks}");
    assert_eq!(
        sinks["kafka"]["held"],
        serde_json::json!([later]),
        "{sinks}"
    );
    assert_eq!(consume(&svc.python(), &brokers, &live, 10).len(), 10);
    // Held, not retried: nothing else dead, no attempt burned.
    assert_eq!(stored_total(&mut con, "dead"), 5);
    assert!(daemon.log_text().contains("destination missing"));
    for id in &later_ids {
        let view = rt
            .block_on(client.get(id))
            .expect("get")
            .expect("still stored");
        assert_eq!(view.envelope.expect("envelope").meta.attempt, 0, "{id}");
    }

    create_topic(&svc.var("KAFKA_TOPIC_CMD"), &later, 1);
    let records = consume(&svc.python(), &brokers, &later, 31);
    let mut values: Vec<Vec<u8>> = records.into_iter().map(|r| r.value).collect();
    values.sort();
    values.dedup();
    assert_eq!(values.len(), 31, "every held job arrived, once");
    wait_for(
        "stats to show the topic flowing",
        Duration::from_secs(30),
        || !stats().contains("held "),
    );
    assert_eq!(stored_total(&mut con, "dead"), 5);
}

/// A hung broker (SIGSTOP: its port stays open, nothing answers) under a short lease: each
/// batch ends by its publish deadline (the lease less the settle margin) though neither the
/// full local queue nor the delivery reports ever make room, so its jobs go back to due
/// before their lease runs out: none is reaped by lease expiry, no settle is fenced, no
/// attempt is burned. Once the broker resumes, every job reaches the topic.
#[test]
fn kafka_batches_end_by_the_publish_deadline_while_the_broker_hangs() {
    use crate::common::{Daemon, RedisServer, TestConfig, client, wait_all_settled_in, wait_for};
    use zdelay::client::{NewJob, OnConflict};

    const JOBS: usize = 60;
    let own =
        crate::common::PrivateBrokers::start_with("kafka", &[("ZDELAY_TANSU_STORAGE", "memory")]);
    let brokers = own.var("KAFKA_BROKERS");
    let topic = unique_topic("deadline");
    create_topic(&own.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let redis = RedisServer::start();
    // A local queue of 5 messages: a batch of 60 waits for room as well as for reports.
    let extra = format!(
        r#"
[poller]
lease = "3s"
idle_poll = "50ms"

[sinks.kafka]
kind = "kafka"
brokers = "{brokers}"
librdkafka."queue.buffering.max.messages" = "5"

[[routes]]
name = "orders"
sink = "kafka"
target = "{topic}"
"#
    );
    let config = TestConfig::new(&redis.url(), 1, &extra);
    let daemon = Daemon::start(&config);
    let metric = |name: &str, labels: &[(&str, &str)]| daemon.metric(name, labels);
    let rt = common::runtime();
    let client = client(&rt, &redis.url(), 1);

    own.run("PAUSE_KAFKA");
    let hung = Instant::now();
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| NewJob::new("orders", format!("job-{i}").into_bytes()))
        .collect();
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    let unavailable = [("sink", "kafka"), ("outcome", "unavailable")];
    // The 3 s lease leaves 2.25 s to publish; 10 s is margin for a loaded machine, and far
    // below what a batch waited before (message.timeout.ms, 15 s, per message of the queue).
    wait_for(
        "the first batch handed back by its publish deadline",
        Duration::from_secs(10),
        || metric("zdelay_sink_messages_total", &unavailable) > 0.0,
    );
    eprintln!(
        "first batch handed back {:?} after the hang",
        hung.elapsed()
    );
    // Past several leases while hung: still nothing reaped or fenced.
    while hung.elapsed() < Duration::from_secs(8) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(metric("zdelay_leases_expired_total", &[]), 0.0);
    assert_eq!(metric("zdelay_fenced_settles_total", &[]), 0.0);

    own.run("RESUME_KAFKA");
    let mut con = redis.conn();
    wait_all_settled_in(
        &mut con,
        &zdelay::keys::Keys::new("zdelay", 1),
        Duration::from_secs(60),
    );
    let records = consume(&own.var("PYTHON"), &brokers, &topic, -(JOBS as i64));
    let keys: std::collections::BTreeSet<String> = records
        .iter()
        .map(|r| String::from_utf8(r.key.clone().expect("record key")).expect("utf-8 key"))
        .collect();
    let expected: std::collections::BTreeSet<String> = ids.into_iter().collect();
    assert_eq!(keys, expected, "every job reached the topic");
    eprintln!(
        "{} records for {JOBS} jobs (repeats carry the same zdelay-id)",
        records.len()
    );
    assert_eq!(metric("zdelay_leases_expired_total", &[]), 0.0);
    assert_eq!(metric("zdelay_fenced_settles_total", &[]), 0.0);
    assert_eq!(
        metric(
            "zdelay_sink_messages_total",
            &[("sink", "kafka"), ("outcome", "retried")]
        ),
        0.0,
        "a hung broker burns no attempt"
    );
}
