//! NATS sink against the real `nats-server` with JetStream that `scripts/services.sh` runs (and,
//! for the outage test, a private one started and stopped here). Messages are read back with
//! nats-py (`tests/it/py/nats_read.py`), a client zdelay did not write.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use base64::Engine;
use zdelay::config::NatsSinkConfig;
use zdelay::sinks::nats::NatsSink;
use zdelay::sinks::{Message, Outcome};

use crate::common::Services;

fn tag() -> String {
    ulid::Ulid::generate().to_string().to_lowercase()
}

fn sink(url: &str, jetstream: bool) -> NatsSink {
    NatsSink::new(
        "bus",
        &NatsSinkConfig {
            url: url.into(),
            jetstream,
            ..Default::default()
        },
    )
    .expect("nats sink from config")
}

fn message(subject: &str, i: usize, payload: Vec<u8>) -> Message {
    let headers = BTreeMap::from([
        ("x-seq".to_owned(), i.to_string()),
        (
            "content-type".to_owned(),
            "application/octet-stream".to_owned(),
        ),
    ]);
    Message {
        id: ulid::Ulid::generate().to_string(),
        due_ms: 1_700_000_000_000 + i as i64,
        target: subject.to_owned(),
        payload,
        headers,
        priority: None,
    }
}

/// Binary payload that differs per message and covers every byte value.
fn binary_payload(i: usize) -> Vec<u8> {
    let mut p: Vec<u8> = (0..=255u8).collect();
    p.extend_from_slice(&(i as u64).to_be_bytes());
    p.rotate_left(i % 256);
    p
}

/// A fresh stream `ZDNATS_<tag>` on subjects `zdnats.<tag>.>`; returns (stream, subject prefix).
pub(crate) async fn make_stream(url: &str) -> (jetstream::Context, String, String) {
    let client = async_nats::connect(url).await.expect("connect to nats");
    let js = jetstream::new(client);
    let tag = tag();
    let name = format!("ZDNATS_{}", tag.to_uppercase());
    let prefix = format!("zdnats.{tag}");
    js.create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("create stream");
    (js, name, prefix)
}

async fn stream_count(js: &jetstream::Context, name: &str) -> u64 {
    let mut stream = js.get_stream(name).await.expect("get stream");
    stream.info().await.expect("stream info").state.messages
}

pub(crate) fn py_reader(services: &Services) -> Command {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/nats_read.py");
    let mut cmd = Command::new(services.python());
    cmd.arg(script);
    cmd
}

#[derive(Debug)]
pub(crate) struct Read {
    stream_messages: Option<u64>,
    pub(crate) messages: Vec<(String, Vec<u8>, BTreeMap<String, String>)>,
}

pub(crate) fn parse_read(json: &str) -> Read {
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("reader prints JSON");
    let messages = v["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let data = base64::engine::general_purpose::STANDARD
                .decode(m["data_b64"].as_str().expect("data"))
                .expect("base64");
            let headers = m["headers"]
                .as_object()
                .expect("headers")
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            (
                m["subject"].as_str().expect("subject").to_owned(),
                data,
                headers,
            )
        })
        .collect();
    Read {
        stream_messages: v["stream_messages"].as_u64(),
        messages,
    }
}

fn assert_same(sent: &[Message], read: &Read) {
    assert_eq!(read.messages.len(), sent.len(), "message count");
    for (want, (subject, data, headers)) in sent.iter().zip(&read.messages) {
        let key = want.idempotency_key();
        assert_eq!(subject, &want.target);
        assert_eq!(data, &want.payload, "payload bytes of {key}");
        assert_eq!(headers.get("zdelay-id"), Some(&key));
        assert_eq!(headers.get("Nats-Msg-Id"), Some(&key));
        for (k, v) in &want.headers {
            assert_eq!(headers.get(k), Some(v), "envelope header {k} of {key}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_publish_1000_read_back_by_nats_py() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        crate::common::nats_version(kind, &url).await;
        publish_1000_read_back(&services, &url).await;
    }
}

async fn publish_1000_read_back(services: &Services, url: &str) {
    let url = url.to_owned();
    let (js, stream, prefix) = make_stream(&url).await;
    let subject = format!("{prefix}.jobs");
    let batch: Vec<Message> = (0..1000)
        .map(|i| message(&subject, i, binary_payload(i)))
        .collect();

    let sink = sink(&url, true);
    sink.check().await.expect("healthy");
    let out = sink.publish(&batch).await;
    assert_eq!(out.len(), batch.len());
    assert!(out.iter().all(|o| *o == Outcome::Delivered), "{out:?}");
    assert_eq!(stream_count(&js, &stream).await, 1000);

    let output = py_reader(services)
        .args(["stream", &url, &stream, &format!("{prefix}.>"), "1000"])
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let read = parse_read(&String::from_utf8_lossy(&output.stdout));
    assert_eq!(read.stream_messages, Some(1000));
    assert_same(&batch, &read);
    js.delete_stream(&stream).await.expect("delete stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_duplicate_publish_is_stored_once() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        crate::common::nats_version(kind, &url).await;
        duplicate_publish_is_stored_once(&services, &url).await;
    }
}

async fn duplicate_publish_is_stored_once(services: &Services, url: &str) {
    let url = url.to_owned();
    let (js, stream, prefix) = make_stream(&url).await;
    let msg = message(&format!("{prefix}.dup"), 7, b"same job".to_vec());
    let sink = sink(&url, true);

    // The crash window: published, not acked in Redis, published again after the lease.
    assert_eq!(
        sink.publish(std::slice::from_ref(&msg)).await,
        [Outcome::Delivered]
    );
    assert_eq!(
        sink.publish(std::slice::from_ref(&msg)).await,
        [Outcome::Delivered]
    );
    // ... and twice inside one batch.
    let twice = [msg.clone(), msg.clone()];
    assert_eq!(
        sink.publish(&twice).await,
        [Outcome::Delivered, Outcome::Delivered]
    );
    assert_eq!(stream_count(&js, &stream).await, 1, "JetStream dedupe");

    let output = py_reader(services)
        .args(["stream", &url, &stream, &format!("{prefix}.>"), "1"])
        .output()
        .expect("python runs");
    assert!(output.status.success());
    let read = parse_read(&String::from_utf8_lossy(&output.stdout));
    assert_same(std::slice::from_ref(&msg), &read);
    js.delete_stream(&stream).await.expect("delete stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_rejects_unknown_subject_and_oversize() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        crate::common::nats_version(kind, &url).await;
        rejects_unknown_subject_and_oversize(&services, &url).await;
    }
}

async fn rejects_unknown_subject_and_oversize(services: &Services, url: &str) {
    let url = url.to_owned();
    let max_payload: usize = services
        .var("NATS_MAX_PAYLOAD")
        .parse()
        .expect("max payload");
    let (js, stream, prefix) = make_stream(&url).await;
    let sink = sink(&url, true);

    let nowhere = format!("zdnats-nostream.{}", tag());
    let batch = [
        message(&format!("{prefix}.ok"), 0, b"fine".to_vec()),
        message(&nowhere, 1, b"lost?".to_vec()),
        message(&format!("{prefix}.big"), 2, vec![7u8; max_payload + 1]),
        message(&format!("{prefix}.ok"), 3, b"fine too".to_vec()),
    ];
    let started = Instant::now();
    let out = sink.publish(&batch).await;
    assert_eq!(out[0], Outcome::Delivered);
    match &out[1] {
        Outcome::Missing(why) => assert!(
            why.contains("no JetStream stream for subject") && why.contains(&nowhere),
            "{why}"
        ),
        other => panic!("no stream: {other:?}"),
    }
    match &out[2] {
        Outcome::Reject(why) => assert!(why.contains("too large"), "{why}"),
        other => panic!("oversize: {other:?}"),
    }
    assert_eq!(out[3], Outcome::Delivered);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "no timeouts involved"
    );
    assert_eq!(stream_count(&js, &stream).await, 2);

    // Core NATS has no streams; oversize is still refused by the client.
    let core = self::sink(&url, false);
    let out = core
        .publish(&[message(&nowhere, 4, vec![1u8; max_payload + 1])])
        .await;
    assert!(
        matches!(&out[0], Outcome::Reject(why) if why.contains("too large")),
        "{out:?}"
    );
    js.delete_stream(&stream).await.expect("delete stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_full_stream_holds_its_messages_without_burning_attempts() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        crate::common::nats_version(kind, &url).await;
        a_full_stream_holds(&url).await;
    }
}

/// A stream at its message limit (discard new) answers "maximum messages exceeded": the sink
/// says `Full` (the job waits, no attempt counted), not `Retry`; once the limit is raised the
/// same messages go.
async fn a_full_stream_holds(url: &str) {
    let client = async_nats::connect(url).await.expect("connect to nats");
    let js = jetstream::new(client);
    let tag = tag();
    let (name, prefix) = (
        format!("ZDFULL_{}", tag.to_uppercase()),
        format!("zdfull.{tag}"),
    );
    let mut config = jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.>")],
        max_messages: 3,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(config.clone())
        .await
        .expect("create stream");
    let sink = sink(url, true);
    let batch: Vec<Message> = (0..5)
        .map(|i| message(&format!("{prefix}.x"), i, vec![i as u8]))
        .collect();
    let out = sink.publish(&batch).await;
    let delivered = out.iter().filter(|o| **o == Outcome::Delivered).count();
    let full: Vec<&Outcome> = out
        .iter()
        .filter(|o| matches!(o, Outcome::Full(_)))
        .collect();
    assert_eq!((delivered, full.len()), (3, 2), "{out:?}");
    assert!(
        matches!(full[0], Outcome::Full(why) if why.contains("full") && why.contains("maximum")),
        "{out:?}"
    );
    config.max_messages = -1;
    js.update_stream(config).await.expect("raise the limit");
    let rest: Vec<Message> = batch
        .iter()
        .zip(&out)
        .filter(|(_, o)| matches!(o, Outcome::Full(_)))
        .map(|(m, _)| m.clone())
        .collect();
    let again = sink.publish(&rest).await;
    assert!(again.iter().all(|o| *o == Outcome::Delivered), "{again:?}");
    assert_eq!(stream_count(&js, &name).await, 5);
    js.delete_stream(&name).await.expect("delete stream");
}

/// "No responders" to a JetStream publish also comes from a server whose JetStream is not
/// answering (stopping, or a stream electing its leader), over a live connection: only a
/// JetStream API that answers "no stream covers it" makes a missing destination, whose jobs a
/// route may send to dead. A server without JetStream stands in for one whose JetStream went
/// away; the same server with JetStream and no stream for the subject is still `Missing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_responders_is_a_missing_stream_only_when_jetstream_says_so() {
    let services = Services::get();
    for kind in crate::common::NATS_KINDS {
        let bin = services.var(&format!("{}_BIN", kind.to_uppercase()));
        let dir = tempfile::tempdir().expect("a temp dir");
        for jetstream_on in [false, true] {
            let conf = if jetstream_on {
                format!("jetstream {{ store_dir: {:?} }}", dir.path())
            } else {
                String::new()
            };
            let server = crate::broker_security::NatsServer::start(&bin, &conf);
            let version = crate::common::nats_version(kind, &server.url()).await;
            let subject = format!("zdnats-nostream.{}", tag());
            let out = sink(&server.url(), true)
                .publish(&[message(&subject, 0, b"due".to_vec())])
                .await;
            match (&out[0], jetstream_on) {
                (Outcome::Missing(why), true) => assert!(why.contains(&subject), "{why}"),
                (Outcome::Unavailable(why), false) => {
                    assert!(
                        why.contains("JetStream") && why.contains("not answering"),
                        "{why}"
                    )
                }
                (other, _) => panic!(
                    "nats-server {version}, jetstream {jetstream_on}: no stream for the subject \
                     gave {other:?}"
                ),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_down_is_unavailable_then_recovers_on_the_same_sink() {
    for kind in crate::common::NATS_KINDS {
        server_down_is_unavailable_then_recovers(kind).await;
    }
}

async fn server_down_is_unavailable_then_recovers(kind: &str) {
    let own = crate::common::PrivateBrokers::start(kind);
    let upper = kind.to_uppercase();
    let url = own.var(&format!("{upper}_URL")).to_owned();
    crate::common::nats_version(kind, &url).await;
    let (js, stream, prefix) = make_stream(&url).await;
    let subject = format!("{prefix}.jobs");
    let sink = sink(&url, true);
    let batch = |n: usize| -> Vec<Message> {
        (0..n)
            .map(|i| message(&subject, i, binary_payload(i)))
            .collect()
    };
    assert!(
        sink.publish(&batch(10))
            .await
            .iter()
            .all(|o| *o == Outcome::Delivered)
    );

    own.run(&format!("STOP_{upper}"));
    let started = Instant::now();
    let out = sink.publish(&batch(100)).await;
    let took = started.elapsed();
    assert!(
        out.iter().all(|o| matches!(o, Outcome::Unavailable(_))),
        "{:?}",
        &out[..3]
    );
    assert!(took < Duration::from_secs(3), "unavailable after {took:?}");
    let started = Instant::now();
    let health = sink.check().await;
    assert!(health.is_err(), "check while down: {health:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    eprintln!(
        "nats down: publish Unavailable in {took:?}, check: {}",
        health.unwrap_err()
    );

    own.run(&format!("START_{upper}"));
    let recovered = batch(100);
    let deadline = Instant::now() + Duration::from_secs(20);
    let started = Instant::now();
    loop {
        let out = sink.publish(&recovered).await;
        if out.iter().all(|o| *o == Outcome::Delivered) {
            break;
        }
        assert!(
            out.iter().all(|o| matches!(o, Outcome::Unavailable(_))),
            "while reconnecting: {:?}",
            &out[..3]
        );
        assert!(Instant::now() < deadline, "no recovery: {:?}", &out[..1]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("nats back: delivered after {:?}", started.elapsed());
    sink.check().await.expect("healthy again");
    // The stream survived the restart (file storage): the 10 from before plus the 100.
    assert_eq!(stream_count(&js, &stream).await, 110);

    // Killed in the middle of a big batch: every message is Delivered or Unavailable (no
    // attempt burned), answered within a bound; republishing the whole batch after the restart
    // stores each message exactly once (acks lost with the connection are absorbed by
    // Nats-Msg-Id dedupe).
    let big: Vec<Message> = (0..30_000)
        .map(|i| message(&format!("{prefix}.big"), i, vec![b'y'; 100]))
        .collect();
    let sink = std::sync::Arc::new(sink);
    let publishing = tokio::spawn({
        let (sink, big) = (sink.clone(), big.clone());
        async move {
            let started = Instant::now();
            (sink.publish(&big).await, started.elapsed())
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while stream_count(&js, &stream).await < 110 + 2000 {
        assert!(Instant::now() < deadline, "big batch does not flow");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    own.run(&format!("KILL_{upper}"));
    let (out, took) = publishing.await.expect("publish task");
    let delivered = out.iter().filter(|o| **o == Outcome::Delivered).count();
    let unavailable = out
        .iter()
        .filter(|o| matches!(o, Outcome::Unavailable(_)))
        .count();
    eprintln!("killed mid-batch after {took:?}: {delivered} delivered, {unavailable} unavailable");
    assert_eq!(delivered + unavailable, big.len(), "no Retry/Reject");
    assert!(unavailable > 0, "the kill landed after the batch");
    assert!(took < Duration::from_secs(15), "{took:?}");

    own.run(&format!("START_{upper}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = sink.publish(&big).await;
        if out.iter().all(|o| *o == Outcome::Delivered) {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery: {:?}", &out[..1]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let js = make_js(&url).await;
    assert_eq!(stream_count(&js, &stream).await, 110 + big.len() as u64);

    // Hung (SIGSTOP): the TCP connection stays up, nothing answers. Every ack of the batch
    // times out, which is Unavailable (not Retry), within the ack timeout.
    let pid: i32 = std::fs::read_to_string(own.dir().join(kind).join("pid"))
        .expect("nats pid file")
        .trim()
        .parse()
        .expect("pid");
    let hung: Vec<Message> = (0..50)
        .map(|i| message(&format!("{prefix}.hung"), i, vec![b'z'; 10]))
        .collect();
    // SAFETY: kill(2) on the nats-server this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // The group stop of a multi-threaded process completes asynchronously: wait for it.
    crate::common::wait_for("nats-server stopped", Duration::from_secs(5), || {
        all_threads_stopped(pid)
    });
    let started = Instant::now();
    let out = sink.publish(&hung).await;
    let took = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    eprintln!("hung server (pid {pid}): {:?} after {took:?}", &out[0]);
    assert!(
        out.iter().all(|o| matches!(o, Outcome::Unavailable(_))),
        "{:?}",
        &out[..2]
    );
    assert!(
        took < zdelay::sinks::nats::ACK_TIMEOUT + Duration::from_secs(2),
        "{took:?}"
    );
    // Resumed, the server stores what it had buffered; the republish is absorbed.
    assert!(
        sink.publish(&hung)
            .await
            .iter()
            .all(|o| *o == Outcome::Delivered)
    );
    assert_eq!(
        stream_count(&js, &stream).await,
        110 + (big.len() + hung.len()) as u64
    );
}

/// Every thread of `pid` is in state T (stopped), from /proc.
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // "tid (comm) S ...": the state follows the last ')'.
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
        })
    })
}

async fn make_js(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.expect("connect to nats"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_core_mode_subscriber_receives_best_effort() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        crate::common::nats_version(kind, &url).await;
        core_mode_subscriber_receives(&services, &url).await;
    }
}

async fn core_mode_subscriber_receives(services: &Services, url: &str) {
    let url = url.to_owned();
    let subject = format!("zdnats-core.{}", tag());
    let mut reader = py_reader(services)
        .args(["sub", &url, &subject, "200"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    let mut stdout = BufReader::new(reader.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("reader says ready");
    assert_eq!(line.trim(), "ready");

    let batch: Vec<Message> = (0..200)
        .map(|i| message(&subject, i, binary_payload(i)))
        .collect();
    let sink = sink(&url, false);
    sink.check().await.expect("healthy");
    let out = sink.publish(&batch).await;
    assert!(out.iter().all(|o| *o == Outcome::Delivered), "{out:?}");
    sink.flush(Duration::from_secs(2)).await;

    let mut json = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut json).expect("reader output");
    assert!(reader.wait().expect("reader exits").success());
    assert_same(&batch, &parse_read(&json));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_throughput_100k() {
    let services = Services::get();
    let url = services.nats_url();
    let (js, stream, prefix) = make_stream(&url).await;
    let subject = format!("{prefix}.bench");
    let sink = sink(&url, true);
    sink.check().await.expect("healthy");
    let batches: Vec<Vec<Message>> = (0..100)
        .map(|b| {
            (0..1000)
                .map(|i| message(&subject, b * 1000 + i, vec![b'x'; 100]))
                .collect()
        })
        .collect();
    let started = Instant::now();
    for batch in &batches {
        let out = sink.publish(batch).await;
        assert!(out.iter().all(|o| *o == Outcome::Delivered));
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "nats jetstream: 100000 msgs x 100 B, batches of 1000 with PubAck: {secs:.2} s, {:.0} msgs/s",
        100_000.0 / secs
    );
    assert_eq!(stream_count(&js, &stream).await, 100_000);
    js.delete_stream(&stream).await.expect("delete stream");
}

/// End to end through the daemon, against each NATS version: jobs enqueued with the library
/// reach a JetStream stream with their headers and `Nats-Msg-Id`, confirmed by PubAck before
/// the daemon acks them, and the sink reports up in `/readyz`.
#[test]
fn daemon_delivers_scheduled_jobs_to_jetstream() {
    let services = Services::get();
    for (kind, url) in services.nats_servers() {
        daemon_delivers_to_jetstream(&services, kind, &url);
    }
}

/// A sink `bus` on the NATS server at `url` and a route `events` to `<prefix>.due`; jobs may
/// also name `bus/<prefix>.*`.
fn events_route(url: &str, prefix: &str) -> String {
    format!(
        r#"
[sinks.bus]
kind = "nats"
url = "{url}"
allow = ["{prefix}.*"]

[[routes]]
name = "events"
sink = "bus"
target = "{prefix}.due"
"#
    )
}

fn daemon_delivers_to_jetstream(services: &Services, kind: &str, url: &str) {
    use crate::common::{Daemon, RedisServer, TestConfig};
    use zdelay::client::{NewJob, OnConflict};

    let url = url.to_owned();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(crate::common::nats_version(kind, &url));
    let (js, stream, prefix) = rt.block_on(make_stream(&url));
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 2, &events_route(&url, &prefix));
    let daemon = Daemon::start(&config);
    let client = crate::common::client(&rt, &redis.url(), 2);
    let mut jobs: Vec<NewJob> = (0..300)
        .map(|i| {
            NewJob::new("events", binary_payload(i))
                .after(Duration::from_millis(100))
                .header("trace", format!("t{i}"))
        })
        .collect();
    jobs.push(NewJob::new(
        format!("bus/{prefix}.direct"),
        b"direct".to_vec(),
    ));
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while rt.block_on(stream_count(&js, &stream)) != 301 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} messages in the stream after 20 s; daemon log:\n{}\ndead: {:?}",
            rt.block_on(stream_count(&js, &stream)),
            daemon.log_text(),
            rt.block_on(client.operator().dead_list(5))
                .map(|d| d.into_iter().map(|j| j.reason).collect::<Vec<_>>())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = py_reader(services)
        .args(["stream", &url, &stream, &format!("{prefix}.>"), "301"])
        .output()
        .expect("nats_read.py runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = parse_read(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(read.messages.len(), 301);
    for (subject, data, headers) in &read.messages {
        let msg_id = headers.get("Nats-Msg-Id").expect("Nats-Msg-Id");
        assert_eq!(headers.get("zdelay-id"), Some(msg_id));
        let (id, _due) = msg_id.rsplit_once(':').expect("id:due");
        assert!(ids.iter().any(|i| i == id));
        if data.as_slice() != b"direct" {
            assert_eq!(subject, &format!("{prefix}.due"));
            assert!(headers.get("trace").is_some_and(|t| t.starts_with('t')));
        }
    }
    let mut con = redis.conn();
    let keys = zdelay::keys::Keys::new("zdelay", 2);
    crate::common::wait_all_settled_in(&mut con, &keys, Duration::from_secs(10));
    // The health check passes on this version too (2.9's account info once kept it down).
    crate::common::wait_for(
        "the sink checked up",
        Duration::from_secs(10),
        || matches!(daemon.admin_get("/readyz"), Some((200, body)) if body.contains("sink bus (nats): up")),
    );
}

/// `zdelay-bench --route` through JetStream: every job confirmed and settled, and the same
/// number of messages published directly through async-nats before and after, all of them
/// in the stream (none dropped as a duplicate of another run), with the ratio reported.
#[test]
fn bench_route_compares_the_drain_with_the_brokers_own_client() {
    use crate::common::{RedisServer, TestConfig};
    const JOBS: u64 = 2_000;
    let services = Services::get();
    let (kind, url) = services.nats_servers().pop().expect("a NATS server");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(crate::common::nats_version(kind, &url));
    let (js, stream, prefix) = rt.block_on(make_stream(&url));
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, &events_route(&url, &prefix));
    let out = config.bench(&["--json", "--route", "events", "--jobs", "2000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["jobs"], JOBS, "{report:#}");
    assert_eq!(report["dead"], 0, "{report:#}");
    let direct = report["direct"].as_array().expect("direct runs");
    assert_eq!(direct.len(), 2, "{report:#}");
    for run in direct {
        assert!(
            run["per_second"].as_f64().expect("rate") > 0.0,
            "{report:#}"
        );
    }
    let ratio = report["ratio"].as_f64().expect("ratio");
    let zdelay = report["per_second"].as_f64().expect("rate");
    let mean = direct
        .iter()
        .map(|d| d["per_second"].as_f64().expect("rate"))
        .sum::<f64>()
        / 2.0;
    assert!((ratio - zdelay / mean).abs() < 1e-6, "{report:#}");
    assert!(report["redis_us_per_job"].as_f64().expect("Redis CPU") > 0.0);
    // The bench's jobs, its two direct runs and their warm-up messages.
    assert_eq!(
        rt.block_on(stream_count(&js, &stream)),
        3 * JOBS + 2,
        "{report:#}"
    );
}
