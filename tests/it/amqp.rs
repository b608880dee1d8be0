//! The AMQP sink against the real RabbitMQ of `scripts/services.sh`, checked with an
//! independent client (pika, `tests/it/py/amqp_tool.py`).

use crate::common::Services;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use zdelay::config::AmqpSinkConfig;
use zdelay::sinks::amqp::AmqpSink;
use zdelay::sinks::{IDEMPOTENCY_HEADER, Message, Outcome};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn sink(url: &str) -> AmqpSink {
    let config: AmqpSinkConfig =
        serde_json::from_value(serde_json::json!({ "url": url })).expect("amqp sink config");
    AmqpSink::new("rabbit", &config).expect("amqp sink")
}

/// A name no other test (or run) uses.
fn unique(prefix: &str) -> String {
    format!(
        "zd-{prefix}-{}-{}",
        std::process::id(),
        ulid::Ulid::generate().to_string().to_lowercase()
    )
}

fn tool() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/amqp_tool.py")
}

/// Runs `amqp_tool.py URL args...` and returns its stdout; panics on failure.
pub(crate) fn py(python: &str, url: &str, args: &[&str]) -> String {
    let out = Command::new(python)
        .arg(tool())
        .arg(url)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "amqp_tool.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// One message as the independent consumer saw it.
#[derive(Debug)]
pub(crate) struct Consumed {
    pub(crate) body: Vec<u8>,
    message_id: String,
    pub(crate) headers: BTreeMap<String, String>,
    delivery_mode: Option<u64>,
    priority: Option<u64>,
}

pub(crate) fn consume(python: &str, url: &str, queue: &str, count: usize) -> Vec<Consumed> {
    py(python, url, &["consume", queue, &count.to_string(), "30"])
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let hex = v["body"].as_str().expect("body");
            Consumed {
                body: (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect(),
                message_id: v["message_id"].as_str().unwrap_or_default().to_owned(),
                headers: v["headers"]
                    .as_object()
                    .map(|h| {
                        h.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                            .collect()
                    })
                    .unwrap_or_default(),
                delivery_mode: v["delivery_mode"].as_u64(),
                priority: v["priority"].as_u64(),
            }
        })
        .collect()
}

fn message(id: &str, target: &str, payload: Vec<u8>) -> Message {
    Message {
        id: id.to_owned(),
        due_ms: 1_700_000_000_000,
        target: target.to_owned(),
        payload,
        headers: BTreeMap::new(),
        priority: None,
    }
}

/// 500 messages to the default exchange and to a named exchange: all confirmed, and the
/// independent consumer sees the exact bytes, headers, message id, persistence, priority.
#[test]
fn amqp_delivers_to_queue_and_exchange_with_properties() {
    let services = Services::get();
    let (url, python) = (services.amqp_url(), services.python());
    let (q1, q2, ex) = (unique("q"), unique("q"), unique("ex"));
    py(&python, &url, &["declare", &q1, "--max-priority", "10"]);
    py(
        &python,
        &url,
        &["declare", &q2, "--exchange", &ex, "--key", "due.k"],
    );

    let mut batch = Vec::new();
    for n in 0..500u32 {
        let target = if n % 2 == 0 {
            format!("/{q1}")
        } else {
            format!("{ex}/due.k")
        };
        // Binary payloads: every byte value, NULs, invalid UTF-8, and an empty one.
        let payload: Vec<u8> = if n == 0 {
            Vec::new()
        } else {
            (0..(n % 300 + 1))
                .map(|i| (i * 7 + n) as u8)
                .chain([0u8, 0xff, 0xc3])
                .collect()
        };
        let mut m = message(&format!("job-{n:04}"), &target, payload);
        m.due_ms += i64::from(n);
        m.headers.insert("trace-id".into(), format!("t{n}"));
        m.headers.insert("tenant".into(), "ünï".into());
        if n % 4 == 0 {
            m.priority = Some((n % 10) as u8);
        }
        batch.push(m);
    }
    let rt = rt();
    let sink = sink(&url);
    let started = Instant::now();
    let outcomes = rt.block_on(sink.publish(&batch[..250]));
    let mut rest = rt.block_on(sink.publish(&batch[250..]));
    let elapsed = started.elapsed();
    let mut all = outcomes;
    all.append(&mut rest);
    assert_eq!(all.len(), 500);
    for (m, o) in batch.iter().zip(&all) {
        assert_eq!(*o, Outcome::Delivered, "{}", m.id);
    }
    eprintln!("amqp: 500 messages confirmed in {elapsed:?}");

    let mut seen = consume(&python, &url, &q1, 250);
    seen.extend(consume(&python, &url, &q2, 250));
    assert_eq!(seen.len(), 500, "each message exactly once");
    let by_id: HashMap<String, &Message> = batch.iter().map(|m| (m.idempotency_key(), m)).collect();
    let mut ids = HashSet::new();
    for c in &seen {
        let m = by_id
            .get(&c.message_id)
            .unwrap_or_else(|| panic!("unexpected message id {}", c.message_id));
        assert!(
            ids.insert(c.message_id.clone()),
            "duplicate {}",
            c.message_id
        );
        assert_eq!(c.message_id, format!("{}:{}", m.id, m.due_ms));
        assert_eq!(c.body, m.payload, "{}", m.id);
        let mut want = m.headers.clone();
        want.insert(IDEMPOTENCY_HEADER.into(), m.idempotency_key());
        assert_eq!(c.headers, want, "{}", m.id);
        assert_eq!(c.delivery_mode, Some(2), "persistent");
        assert_eq!(c.priority, m.priority.map(u64::from), "{}", m.id);
    }
    py(&python, &url, &["delete", &q1]);
    py(&python, &url, &["delete", &q2, &ex]);
}

/// Unroutable and a missing exchange are held (their destination is missing), oversize is
/// rejected, each with the broker's reason; the good messages of the same batch are
/// delivered, and the same sink keeps delivering.
#[test]
fn amqp_holds_unroutable_and_missing_exchange_and_rejects_oversize() {
    let services = Services::get();
    let (url, python) = (services.amqp_url(), services.python());
    let max: usize = services
        .var("AMQP_MAX_MESSAGE_SIZE")
        .parse()
        .expect("max message size");
    let (q, ex_unbound, ex_missing) = (unique("q"), unique("ex"), unique("missing"));
    py(&python, &url, &["declare", &q]);
    py(&python, &url, &["exchange", &ex_unbound]);
    let good = format!("/{q}");
    let batch = vec![
        message("good-1", &good, b"1".to_vec()),
        message("unbound", &format!("{ex_unbound}/nowhere"), b"u".to_vec()),
        message("good-2", &good, b"2".to_vec()),
        message("no-queue", &format!("/{q}-missing"), b"n".to_vec()),
        message("no-exchange", &format!("{ex_missing}/k"), b"x".to_vec()),
        message("good-3", &good, b"3".to_vec()),
        message("oversize", &good, vec![b'o'; max + 1]),
        message("good-4", &good, b"4".to_vec()),
        message("good-5", &good, b"5".to_vec()),
    ];
    let rt = rt();
    let sink = sink(&url);
    let started = Instant::now();
    let outcomes = rt.block_on(sink.publish(&batch));
    eprintln!("amqp: mixed batch in {:?}: {outcomes:?}", started.elapsed());
    let by_id: HashMap<&str, &Outcome> =
        batch.iter().map(|m| m.id.as_str()).zip(&outcomes).collect();
    for id in ["good-1", "good-2", "good-3", "good-4", "good-5"] {
        assert_eq!(*by_id[id], Outcome::Delivered, "{id}");
    }
    let held = |id: &str, needle: &str| match by_id[id] {
        Outcome::Missing(r) => assert!(r.contains(needle), "{id}: {r}"),
        other => panic!("{id}: expected Missing({needle}…), got {other:?}"),
    };
    held("unbound", "unroutable: 312 NO_ROUTE");
    held("no-queue", "unroutable: 312 NO_ROUTE");
    held("no-exchange", &format!("no exchange '{ex_missing}'"));
    match by_id["oversize"] {
        Outcome::Reject(r) => assert!(r.contains("message too large"), "{r}"),
        other => panic!("oversize: expected Reject, got {other:?}"),
    }

    // The same sink goes on: another batch, a second oversize (now rejected client-side).
    let next = vec![
        message("good-6", &good, b"6".to_vec()),
        message("oversize-2", &good, vec![b'o'; max + 10]),
        message("good-7", &good, b"7".to_vec()),
    ];
    let outcomes = rt.block_on(sink.publish(&next));
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert!(
        matches!(&outcomes[1], Outcome::Reject(r) if r.contains("too large")),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], Outcome::Delivered);
    // A missing exchange alone, on a healthy channel: held, channel recovered.
    let outcomes = rt.block_on(sink.publish(&[
        message("no-exchange-2", &format!("{ex_missing}/k"), b"x".to_vec()),
        message("good-8", &good, b"8".to_vec()),
    ]));
    assert!(matches!(&outcomes[0], Outcome::Missing(r) if r.contains("no exchange")));
    assert_eq!(outcomes[1], Outcome::Delivered);
    assert!(rt.block_on(sink.check()).is_ok());

    // At least once: every good message arrived, the ones republished after the oversize
    // closed the channel possibly twice, always with the same message id.
    let seen = consume(&python, &url, &q, 8);
    let ids: HashSet<&str> = seen.iter().map(|c| c.message_id.as_str()).collect();
    for n in 1..=8 {
        let id = format!("good-{n}:1700000000000");
        assert!(ids.contains(id.as_str()), "{id} missing from {ids:?}");
    }
    assert!(
        seen.iter().all(|c| c.body.len() == 1),
        "no oversize body arrived"
    );
    eprintln!("amqp: {} copies of 8 good messages consumed", seen.len());
    py(&python, &url, &["delete", &q, &ex_unbound]);
    rt.block_on(sink.flush(Duration::from_secs(2)));
}

/// Broker down: publish is Unavailable quickly, check fails; broker back: the same sink
/// reconnects and delivers. On a private RabbitMQ so the shared one stays up for others.
#[test]
fn amqp_unavailable_while_broker_down_then_reconnects() {
    let services = Services::get();
    let python = services.python();
    let broker = crate::common::PrivateBrokers::start("amqp");
    let url = broker.var("AMQP_URL").to_owned();
    let q = unique("q");
    py(&python, &url, &["declare", &q]);
    let rt = rt();
    let sink = sink(&url);
    let target = format!("/{q}");
    let before = rt.block_on(sink.publish(&[message("before", &target, b"b".to_vec())]));
    assert_eq!(before, vec![Outcome::Delivered]);
    assert_eq!(rt.block_on(sink.check()), Ok(()));

    // Stopped under load: every outcome of the in-flight batches is Delivered or
    // Unavailable (never a hang, never an attempt burned), and the publishing loop sees
    // the outage within a bounded time.
    let sink = std::sync::Arc::new(sink);
    let load = {
        let (sink, target) = (sink.clone(), target.clone());
        rt.spawn(async move {
            let mut seen: Vec<Outcome> = Vec::new();
            for b in 0..10_000 {
                let batch: Vec<Message> = (0..200)
                    .map(|n| message(&format!("load-{b}-{n}"), &target, vec![b'l'; 64]))
                    .collect();
                let outcomes = sink.publish(&batch).await;
                let down = outcomes
                    .iter()
                    .any(|o| matches!(o, Outcome::Unavailable(_)));
                seen.extend(outcomes);
                if down {
                    break;
                }
            }
            seen
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    broker.run("STOP_AMQP");
    let stopped = Instant::now();
    let seen = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(15), load).await })
        .expect("the publishing loop sees the outage within 15 s")
        .expect("no panic");
    let delivered = seen.iter().filter(|o| **o == Outcome::Delivered).count();
    eprintln!(
        "amqp: under load: {delivered} delivered, {} unavailable, outage seen {:?} after stop returned",
        seen.len() - delivered,
        stopped.elapsed()
    );
    assert!(
        seen.iter()
            .all(|o| matches!(o, Outcome::Delivered | Outcome::Unavailable(_))),
        "{:?}",
        seen.iter()
            .find(|o| !matches!(o, Outcome::Delivered | Outcome::Unavailable(_)))
    );
    assert!(delivered > 0);

    let started = Instant::now();
    let batch: Vec<Message> = (0..20)
        .map(|n| message(&format!("down-{n}"), &target, b"d".to_vec()))
        .collect();
    let outcomes = rt.block_on(sink.publish(&batch));
    let took = started.elapsed();
    eprintln!(
        "amqp: publish with the broker down answered in {took:?}: {:?}",
        outcomes[0]
    );
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Unavailable(_))),
        "{outcomes:?}"
    );
    assert!(took < Duration::from_secs(6), "took {took:?}");
    let started = Instant::now();
    let check = rt.block_on(sink.check());
    assert!(check.is_err(), "{check:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    eprintln!("amqp: check while down: {check:?}");

    broker.run("START_AMQP");
    let outcomes = rt.block_on(sink.publish(&batch));
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Delivered),
        "{outcomes:?}"
    );
    assert_eq!(rt.block_on(sink.check()), Ok(()));
    let consumed = consume(&python, &url, &q, 21 + delivered);
    let ids: HashSet<&str> = consumed.iter().map(|c| c.message_id.as_str()).collect();
    assert!(ids.contains("before:1700000000000"));
    for n in 0..20 {
        assert!(ids.contains(format!("down-{n}:1700000000000").as_str()));
    }
    // Every confirmed message survived the restart (durable queue, persistent messages).
    let load_ids = ids.iter().filter(|id| id.starts_with("load-")).count();
    assert!(load_ids >= delivered, "{load_ids} < {delivered}");
    rt.block_on(sink.flush(Duration::from_secs(2)));
}

/// Throughput with confirms: 50k messages of 100 bytes in batches of 1000 (no threshold).
#[test]
fn amqp_throughput_with_confirms() {
    let services = Services::get();
    let (url, python) = (services.amqp_url(), services.python());
    let q = unique("bench");
    py(&python, &url, &["declare", &q]);
    let rt = rt();
    let sink = sink(&url);
    let target = format!("/{q}");
    let batches: Vec<Vec<Message>> = (0..50)
        .map(|b| {
            (0..1000)
                .map(|n| message(&format!("b{b}-{n}"), &target, vec![b'x'; 100]))
                .collect()
        })
        .collect();
    // Connect outside the measurement.
    assert_eq!(rt.block_on(sink.check()), Ok(()));
    let started = Instant::now();
    for batch in &batches {
        let outcomes = rt.block_on(sink.publish(batch));
        assert!(outcomes.iter().all(|o| *o == Outcome::Delivered));
    }
    let elapsed = started.elapsed();
    eprintln!(
        "amqp throughput: 50000 confirmed persistent messages (100 B, batches of 1000) in \
         {elapsed:?} = {:.0} msgs/s",
        50_000.0 / elapsed.as_secs_f64()
    );
    py(&python, &url, &["delete", &q]);
}

/// End to end through the daemon: jobs enqueued with the library, claimed, published with
/// confirms, acked; read back by pika with their headers and idempotency key.
#[test]
fn daemon_delivers_scheduled_jobs_to_rabbitmq() {
    daemon_delivers_to_rabbitmq();
}

fn daemon_delivers_to_rabbitmq() {
    use crate::common::{Daemon, RedisServer, TestConfig};
    use zdelay::client::{NewJob, OnConflict};

    let services = Services::get();
    let url = services.amqp_url();
    let python = services.python();
    let queue = unique("zd-e2e");
    py(&python, &url, &["declare", &queue, "--max-priority", "9"]);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[sinks.rabbit]
kind = "amqp"
url = "{url}"
allow = ["/zd-*"]

[[routes]]
name = "billing"
sink = "rabbit"
target = "/{queue}"
priority = 7
"#
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let daemon = Daemon::start(&config);
    let rt = rt();
    let client = crate::common::client(&rt, &redis.url(), 2);
    let mut jobs: Vec<NewJob> = (0..200)
        .map(|i| {
            NewJob::new("billing", vec![i as u8, 0, 255])
                .after(std::time::Duration::from_millis(100))
                .header("tenant", "acme")
        })
        .collect();
    // A job naming `<sink>/<target>` admitted by the sink's allow pattern.
    jobs.push(NewJob::new(format!("rabbit//{queue}"), b"direct".to_vec()));
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    let got = consume(&python, &url, &queue, 201);
    assert_eq!(got.len(), 201, "every job delivered once");
    for m in got.iter().filter(|m| m.body != b"direct") {
        let (id, due) = m.message_id.rsplit_once(':').expect("id:due");
        assert!(
            ids.iter().any(|i| i == id),
            "message_id names a job: {}",
            m.message_id
        );
        assert!(due.parse::<i64>().is_ok());
        assert_eq!(m.headers.get("zdelay-id"), Some(&m.message_id));
        assert_eq!(m.headers.get("tenant").map(String::as_str), Some("acme"));
        assert_eq!(m.delivery_mode, Some(2), "persistent");
        assert_eq!(m.priority, Some(7), "the route's priority lane");
    }
    let mut con = redis.conn();
    let keys = zdelay::keys::Keys::new("zdelay", 2);
    crate::common::wait_all_settled_in(&mut con, &keys, std::time::Duration::from_secs(10));
    let (_, metrics) = daemon.admin_get("/metrics").expect("metrics");
    assert!(
        metrics.contains("zdelay_sink_messages_total{sink=\"rabbit\",outcome=\"delivered\"} 201"),
        "{metrics}"
    );
    let (status, body) = daemon.admin_get("/readyz").expect("readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("sink rabbit (amqp): up"), "{body}");
}
