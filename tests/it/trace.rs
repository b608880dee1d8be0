//! Trace context through the delay hop, end to end through the daemon: `traceparent` and
//! `tracestate` given at enqueue reach Kafka, RabbitMQ and NATS (2.15 and 2.9) byte for byte
//! (read back with the independent Python clients); the delay-hop spans the daemon exports
//! over OTLP/HTTP reach an in-process receiver here (protobuf decoded with
//! opentelemetry-proto) as children of, and linked to, that context; a retry is a second
//! span linked to the same origin; a dead collector does not slow delivery; the CLI stores
//! the names lowercase.

use crate::common::{
    Daemon, RedisServer, Services, TestConfig, client, wait_all_settled_in, wait_for,
};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zdelay::client::{NewJob, OnConflict};

const SHARDS: u16 = 2;
/// Spaces and commas included: the value must arrive exactly as given.
const TRACESTATE: &str = "zd=t61rcWkgMzE, rojo=00f067aa0ba902b7";
/// Export every 100 ms instead of 5 s, so the tests wait less.
const FAST_EXPORT: &[(&str, &str)] = &[("OTEL_BSP_SCHEDULE_DELAY", "100")];

/// An OTLP/HTTP collector in the test process: decodes every export request and keeps the
/// spans. HTTP/1.1 with keep-alive, `Content-Length` bodies (what the exporter sends).
struct OtlpReceiver {
    port: u16,
    spans: Arc<Mutex<Vec<Span>>>,
}

impl OtlpReceiver {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the receiver");
        let port = listener.local_addr().expect("receiver address").port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let kept = kept.clone();
                std::thread::spawn(move || serve(stream, &kept));
            }
        });
        OtlpReceiver { port, spans }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The spans of job `id` once there are `n` (fails after 20 s).
    fn wait_job_spans(&self, id: &str, n: usize) -> Vec<Span> {
        let mut found = Vec::new();
        wait_for(
            &format!("{n} spans of job {id}"),
            Duration::from_secs(20),
            || {
                found = self.job_spans(id);
                found.len() >= n
            },
        );
        found.sort_by_key(|s| attr_int(s, "zdelay.attempt"));
        found
    }

    fn job_spans(&self, id: &str) -> Vec<Span> {
        let spans = self.spans.lock().expect("spans lock");
        spans
            .iter()
            .filter(|s| attr_str(s, "zdelay.job_id").as_deref() == Some(id))
            .cloned()
            .collect()
    }
}

fn serve(stream: TcpStream, spans: &Mutex<Vec<Span>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
    let mut writer = stream;
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let request = ExportTraceServiceRequest::decode(body.as_slice()).expect("OTLP protobuf");
        let mut kept = spans.lock().expect("spans lock");
        for resource in request.resource_spans {
            for scope in resource.scope_spans {
                kept.extend(scope.spans);
            }
        }
        drop(kept);
        let answer =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

fn attr(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn attr_int(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::IntValue(n)) => n,
        other => panic!("{key} is not an int: {other:?}"),
    }
}

fn attr_str(span: &Span, key: &str) -> Option<String> {
    match attr(span, key) {
        Some(Value::StringValue(s)) => Some(s),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh creation context: (trace id hex, span id hex, traceparent).
fn new_origin(flags: &str) -> (String, String, String) {
    let trace = hex(&ulid::Ulid::generate().to_bytes());
    let span = hex(&ulid::Ulid::generate().to_bytes()[8..]);
    let traceparent = format!("00-{trace}-{span}-{flags}");
    (trace, span, traceparent)
}

/// Waits until every two-phase job (kept in the spread shards) was settled.
fn wait_spread_settled(con: &mut redis::Connection) {
    let spread = zdelay::keys::Keys::new("zdelay", SHARDS);
    wait_all_settled_in(con, &spread, Duration::from_secs(30));
}

/// The span is a child of the origin and links to it.
fn assert_continues(span: &Span, trace: &str, parent: &str) {
    assert_eq!(hex(&span.trace_id), trace, "same trace as the producer");
    assert_eq!(
        hex(&span.parent_span_id),
        parent,
        "child of the producer's span"
    );
    assert_eq!(span.links.len(), 1, "one link to the creation context");
    assert_eq!(hex(&span.links[0].trace_id), trace);
    assert_eq!(hex(&span.links[0].span_id), parent);
    assert_ne!(hex(&span.span_id), parent, "a span of its own");
}

/// What a broker test checks, whatever the broker: three jobs through `route` — one with a
/// valid context under mixed-case names, one with a malformed `traceparent`, one without —
/// then `read` returns each delivered message's headers by payload.
fn through_broker(
    sink_toml: &str,
    route: &str,
    sink: &str,
    read: impl FnOnce() -> BTreeMap<Vec<u8>, BTreeMap<String, Vec<u8>>>,
) {
    let receiver = OtlpReceiver::start();
    let redis = RedisServer::start();
    let extra = format!(
        "[tracing]\notlp_endpoint = \"{}\"\n\n{sink_toml}",
        receiver.endpoint()
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let daemon = Daemon::spawn_with_env(&config, FAST_EXPORT);
    daemon.wait_ready();
    let rt = crate::common::runtime();
    let client = client(&rt, &redis.url(), SHARDS);
    let (trace, parent, traceparent) = new_origin("01");
    let jobs = vec![
        NewJob::new(route, b"with".to_vec())
            .after(Duration::from_millis(50))
            .header("TraceParent", &traceparent)
            .header("TRACESTATE", TRACESTATE)
            .header("X-Other", "Case Kept"),
        NewJob::new(route, b"malformed".to_vec()).header("traceparent", "00-not-w3c-01"),
        NewJob::new(route, b"without".to_vec()),
    ];
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    let mut con = redis.conn();
    wait_spread_settled(&mut con);
    let got = read();
    let with = &got[b"with".as_slice()];
    assert_eq!(
        with.get("traceparent").map(Vec::as_slice),
        Some(traceparent.as_bytes()),
        "traceparent byte for byte, name lowercase: {:?}",
        with.iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(v)))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        with.get("tracestate").map(Vec::as_slice),
        Some(TRACESTATE.as_bytes())
    );
    assert!(!with.contains_key("TraceParent") && !with.contains_key("TRACESTATE"));
    assert_eq!(
        with.get("X-Other").map(Vec::as_slice),
        Some(b"Case Kept".as_slice())
    );
    assert_eq!(
        got[b"malformed".as_slice()]
            .get("traceparent")
            .map(Vec::as_slice),
        Some(b"00-not-w3c-01".as_slice()),
        "a malformed traceparent is delivered as given"
    );
    assert!(
        !got[b"without".as_slice()].contains_key("traceparent"),
        "zdelay adds no trace header"
    );

    let span = &receiver.wait_job_spans(&ids[0], 1)[0];
    assert_continues(span, &trace, &parent);
    assert_eq!(attr_int(span, "zdelay.attempt"), 1);
    assert_eq!(attr_str(span, "zdelay.route").as_deref(), Some(route));
    assert_eq!(attr_str(span, "zdelay.sink").as_deref(), Some(sink));
    assert_eq!(
        attr_str(span, "zdelay.outcome").as_deref(),
        Some("delivered")
    );
    let lateness = attr_int(span, "zdelay.lateness_ms");
    assert!((0..10_000).contains(&lateness), "lateness {lateness} ms");
    // Scheduled → delivered: the span starts at the due time and lasts the lateness.
    let lasted_ms = (span.end_time_unix_nano - span.start_time_unix_nano) as i64 / 1_000_000;
    assert!(
        (lasted_ms - lateness).abs() <= 1,
        "{lasted_ms} vs {lateness}"
    );
    for id in &ids[1..] {
        let span = &receiver.wait_job_spans(id, 1)[0];
        assert!(span.parent_span_id.is_empty(), "a trace of its own");
        assert!(span.links.is_empty());
        assert_ne!(hex(&span.trace_id), trace);
    }
    assert_eq!(
        daemon.metric("zdelay_trace_context_invalid_total", &[("sink", sink)]),
        1.0
    );
}

#[test]
fn trace_context_survives_kafka() {
    let svc = Services::get();
    let brokers = svc.kafka_brokers();
    let topic = format!(
        "zd-trace-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    crate::kafka::create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let sink_toml = format!(
        "[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\n\n\
         [[routes]]\nname = \"traced\"\nsink = \"kafka\"\ntarget = \"{topic}\"\n"
    );
    through_broker(&sink_toml, "traced", "kafka", || {
        crate::kafka::consume(&svc.python(), &brokers, &topic, 3)
            .into_iter()
            .map(|r| (r.value, r.headers.into_iter().collect()))
            .collect()
    });
}

#[test]
fn trace_context_survives_rabbitmq() {
    let svc = Services::get();
    let url = svc.amqp_url();
    let python = svc.python();
    let queue = format!(
        "zd-trace-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    crate::amqp::py(&python, &url, &["declare", &queue]);
    let sink_toml = format!(
        "[sinks.rabbit]\nkind = \"amqp\"\nurl = \"{url}\"\n\n\
         [[routes]]\nname = \"traced\"\nsink = \"rabbit\"\ntarget = \"/{queue}\"\n"
    );
    through_broker(&sink_toml, "traced", "rabbit", || {
        let got = crate::amqp::consume(&python, &url, &queue, 3);
        crate::amqp::py(&python, &url, &["delete", &queue]);
        got.into_iter()
            .map(|m| {
                let headers = m
                    .headers
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                (m.body, headers)
            })
            .collect()
    });
}

#[test]
fn trace_context_survives_nats_2_15_and_2_9() {
    let svc = Services::get();
    for (kind, url) in svc.nats_servers() {
        let rt = crate::common::runtime();
        rt.block_on(crate::common::nats_version(kind, &url));
        let (_js, stream, prefix) = rt.block_on(crate::nats::make_stream(&url));
        let sink_toml = format!(
            "[sinks.bus]\nkind = \"nats\"\nurl = \"{url}\"\n\n\
             [[routes]]\nname = \"traced\"\nsink = \"bus\"\ntarget = \"{prefix}.due\"\n"
        );
        through_broker(&sink_toml, "traced", "bus", || {
            let out = crate::nats::py_reader(&svc)
                .args(["stream", &url, &stream, &format!("{prefix}.>"), "3"])
                .output()
                .expect("nats_read.py runs");
            assert!(
                out.status.success(),
                "{kind}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            crate::nats::parse_read(&String::from_utf8_lossy(&out.stdout))
                .messages
                .into_iter()
                .map(|(_, data, headers)| {
                    let headers = headers
                        .into_iter()
                        .map(|(k, v)| (k, v.into_bytes()))
                        .collect();
                    (data, headers)
                })
                .collect()
        });
    }
}

/// A remote Redis out of memory fails every push: each attempt is its own span, child of
/// and linked to the same origin; the dead letter keeps the trace headers; a context whose
/// sampled flag is off yields no span.
#[test]
fn each_retry_is_a_span_linked_to_the_same_origin() {
    let receiver = OtlpReceiver::start();
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let mut tcon = target.conn();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut tcon)
        .expect("maxmemory");
    let extra = format!(
        r#"
[poller]
max_attempts = 2
retry_base = "10ms"
retry_cap = "20ms"

[tracing]
otlp_endpoint = "{}/v1/traces"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "mirror"
sink = "other"
target = "q:remote"
"#,
        receiver.endpoint(),
        target.url()
    );
    let config = TestConfig::new(&scheduler.url(), SHARDS, &extra);
    let daemon = Daemon::spawn_with_env(&config, FAST_EXPORT);
    daemon.wait_ready();
    let rt = crate::common::runtime();
    let client = client(&rt, &scheduler.url(), SHARDS);
    let (trace, parent, traceparent) = new_origin("01");
    let (_, _, unsampled) = new_origin("00");
    let jobs = vec![
        NewJob::new("mirror", b"sampled".to_vec())
            .header("traceparent", &traceparent)
            .header("tracestate", TRACESTATE),
        NewJob::new("mirror", b"unsampled".to_vec()).header("traceparent", &unsampled),
    ];
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    wait_for("both jobs dead", Duration::from_secs(20), || {
        rt.block_on(client.operator().dead_list(10))
            .expect("dead list")
            .len()
            == 2
    });
    let spans = receiver.wait_job_spans(&ids[0], 2);
    assert_eq!(spans.len(), 2, "one span per attempt");
    for (attempt, span) in (1..).zip(&spans) {
        assert_continues(span, &trace, &parent);
        assert_eq!(attr_int(span, "zdelay.attempt"), attempt);
        assert_eq!(attr_str(span, "zdelay.outcome").as_deref(), Some("retried"));
    }
    assert_ne!(spans[0].span_id, spans[1].span_id);
    assert!(
        receiver.job_spans(&ids[1]).is_empty(),
        "the producer's sampled flag is honoured"
    );
    let dead = rt
        .block_on(client.get(&ids[0]))
        .expect("get")
        .expect("dead job kept")
        .envelope
        .expect("envelope");
    assert_eq!(dead.meta.headers.get("traceparent"), Some(&traceparent));
    assert_eq!(
        dead.meta.headers.get("tracestate").map(String::as_str),
        Some(TRACESTATE)
    );
}

/// A collector that accepts connections and never answers: delivery goes on at full speed
/// (spans queue in the background, the overflow is dropped), and shutdown does not wait
/// for the export timeout.
#[test]
fn a_dead_collector_never_slows_delivery() {
    let blackhole = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = blackhole.local_addr().expect("address").port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    {
        let (accepted, held) = (accepted.clone(), held.clone());
        std::thread::spawn(move || {
            for stream in blackhole.incoming().flatten() {
                accepted.fetch_add(1, Ordering::SeqCst);
                held.lock().expect("held").push(stream);
            }
        });
    }
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let extra = format!(
        r#"
[tracing]
otlp_endpoint = "http://127.0.0.1:{port}"
export_timeout = "60s"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "mirror"
sink = "other"
target = "q:remote"
"#,
        target.url()
    );
    let config = TestConfig::new(&scheduler.url(), SHARDS, &extra);
    let mut daemon = Daemon::spawn_with_env(
        &config,
        &[
            ("OTEL_BSP_SCHEDULE_DELAY", "10"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "64"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64"),
        ],
    );
    daemon.wait_ready();
    let rt = crate::common::runtime();
    let client = client(&rt, &scheduler.url(), SHARDS);
    const JOBS: usize = 3_000;
    let (_, _, traceparent) = new_origin("01");
    let jobs = (0..JOBS)
        .map(|i| {
            NewJob::new("mirror", format!("j{i}").into_bytes())
                .after(Duration::from_millis(300))
                .header("traceparent", &traceparent)
        })
        .collect();
    rt.block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    let mut scon = scheduler.conn();
    wait_spread_settled(&mut scon);
    let mut tcon = target.conn();
    assert_eq!(crate::common::llen(&mut tcon, "q:remote"), JOBS);
    assert!(
        accepted.load(Ordering::SeqCst) >= 1,
        "the exporter did connect (and hangs)"
    );
    let lateness = |le: &str| {
        daemon.metric(
            "zdelay_lateness_seconds_bucket",
            &[("source", "other"), ("le", le)],
        )
    };
    let total = daemon.metric("zdelay_lateness_seconds_count", &[("source", "other")]);
    assert_eq!(total, JOBS as f64);
    eprintln!(
        "lateness with a hung collector: ≤100 ms {}, ≤250 ms {}, ≤1 s {} of {JOBS}",
        lateness("0.1"),
        lateness("0.25"),
        lateness("1")
    );
    assert_eq!(lateness("1"), total, "every job within 1 s of its due time");
    assert!(
        daemon.log_text().contains("SpanDroppingStarted"),
        "the full span queue dropped spans (and said so) instead of holding up delivery"
    );
    let stopping = Instant::now();
    daemon.signal(libc::SIGTERM);
    let status = daemon.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}: it waited for the export",
        stopping.elapsed()
    );
}

/// The CLI's `--header` and a batch line's `headers` take the names in any case and store
/// them lowercase; other headers keep theirs; a malformed value is stored as given.
#[test]
fn cli_trace_header_names_are_stored_lowercase() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), SHARDS, "");
    let (_, _, traceparent) = new_origin("01");
    let get = |id: &str| -> serde_json::Value {
        let out = config.cli(&["get", id, "-o", "json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("get prints JSON")
    };
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "default",
        "--in",
        "1h",
        "--id",
        "one",
        "--header",
        &format!("TRACEPARENT={traceparent}"),
        "--header",
        "X-Tenant=Acme",
        "--payload",
        "p",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let headers = &get("one")["headers"];
    assert_eq!(headers["traceparent"], traceparent.as_str(), "{headers}");
    assert_eq!(headers["X-Tenant"], "Acme");
    assert!(headers.get("TRACEPARENT").is_none());

    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("jobs.jsonl");
    let line = serde_json::json!({
        "dest": "default", "in": "1h", "id": "two", "payload": "p",
        "headers": {"TraceParent": "00-malformed", "TraceState": TRACESTATE},
    });
    std::fs::write(&file, format!("{line}\n")).expect("write batch");
    let out = config.cli(&["enqueue", "--batch", crate::common::path_str(&file)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let headers = &get("two")["headers"];
    assert_eq!(headers["traceparent"], "00-malformed", "{headers}");
    assert_eq!(headers["tracestate"], TRACESTATE);
}
