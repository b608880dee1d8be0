//! Broker faults through the real daemon against real brokers, counting every job: none is
//! lost; a job may repeat only in the publish → ack window, and then always with the same
//! message id (`<id>:<due>`), so JetStream's duplicate window or the consumer absorbs it.
//!
//! - the daemon dies between the broker's confirmation and the ack (failpoint);
//! - NATS, then RabbitMQ, stopped for 10+ s under a steady load while a local list route
//!   keeps flowing;
//! - a missing destination (no JetStream stream, unroutable) on routes with
//!   `on_missing = "dead"` goes to dead with the broker's reason and the daemon keeps
//!   delivering.
//!
//! Fault tests use private brokers (`scripts/services.sh` in a temp state dir, stopped on
//! drop); the reject test uses the shared ones.

use crate::common::{
    Daemon, PrivateBrokers, RedisServer, Services, TestConfig, llen, lrange, runtime, stored_total,
    wait_for, wait_for_or_show,
};
use async_nats::jetstream;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zdelay::client::{Client, JobState, NewJob, OnConflict};

const SHARDS: u16 = 2;
/// How long the broker stays down in the outage tests.
const OUTAGE: Duration = Duration::from_secs(10);

fn tag() -> String {
    ulid::Ulid::generate().to_string().to_lowercase()
}

fn connect(rt: &tokio::runtime::Runtime, redis_url: &str) -> Client {
    rt.block_on(Client::connect(&crate::common::redis_config(
        redis_url, SHARDS,
    )))
    .expect("library client")
}

fn enqueue(rt: &tokio::runtime::Runtime, client: &Client, jobs: Vec<NewJob>) -> Vec<String> {
    rt.block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("job enqueued").0)
        .collect()
}

/// Jobs still held by zdelay, in every lane and spread shard: stored (due, in flight or dead)
/// plus in-flight leases.
fn pending(con: &mut redis::Connection) -> (usize, usize) {
    (stored_total(con, "jobs"), stored_total(con, "inflight"))
}

/// Sum of every sample of `name` carrying at least `labels` (0 when there is none).
fn metric(daemon: &Daemon, name: &str, labels: &[(&str, &str)]) -> f64 {
    let (_, text) = daemon.admin_get("/metrics").expect("/metrics answers");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            let matches = metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .fold(0.0, |sum, v| sum + v)
}

/// `<id>:<due>` → id.
pub(crate) fn job_of(message_id: &str) -> &str {
    message_id
        .rsplit_once(':')
        .map(|(id, _)| id)
        .unwrap_or(message_id)
}

/// Checks delivered message ids against the enqueued job ids: every job present, nothing
/// foreign, and every copy of a job carrying one and the same message id. Returns the number
/// of repeated deliveries.
pub(crate) fn check_message_ids(what: &str, enqueued: &[String], message_ids: &[String]) -> usize {
    let mut per_job: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for m in message_ids {
        per_job.entry(job_of(m)).or_default().insert(m.as_str());
    }
    let want: BTreeSet<&str> = enqueued.iter().map(String::as_str).collect();
    let got: BTreeSet<&str> = per_job.keys().copied().collect();
    let missing: Vec<_> = want.difference(&got).take(5).collect();
    let foreign: Vec<_> = got.difference(&want).take(5).collect();
    assert!(
        missing.is_empty() && foreign.is_empty(),
        "{what}: {} of {} jobs missing (e.g. {missing:?}), foreign ids {foreign:?}",
        want.difference(&got).count(),
        want.len()
    );
    let unstable: Vec<_> = per_job.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(
        unstable.is_empty(),
        "{what}: {} jobs were delivered under more than one message id, so no consumer or \
         duplicate window can dedupe them; e.g. {:?}",
        unstable.len(),
        unstable.iter().take(3).collect::<Vec<_>>()
    );
    message_ids.len() - want.len()
}

// ---- NATS -------------------------------------------------------------------------------

/// A stream `BF_<TAG>` on `bf.<tag>.>` with a 2 min duplicate window; (js, stream, prefix).
pub(crate) async fn make_stream(url: &str) -> (jetstream::Context, String, String) {
    let client = async_nats::connect(url).await.expect("connect to nats");
    let js = jetstream::new(client);
    let tag = tag();
    let name = format!("BF_{}", tag.to_uppercase());
    let prefix = format!("bf.{tag}");
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

/// A JetStream context on a fresh connection (the old one may have died with the server).
pub(crate) fn js_count(rt: &tokio::runtime::Runtime, url: &str, stream: &str) -> u64 {
    rt.block_on(async {
        let js = jetstream::new(async_nats::connect(url).await.expect("connect to nats"));
        stream_count(&js, stream).await
    })
}

/// Every message of the stream read by nats-py (a client zdelay did not write): its
/// `Nats-Msg-Id`, checked equal to the `zdelay-id` header.
pub(crate) fn nats_message_ids(
    python: &str,
    url: &str,
    stream: &str,
    prefix: &str,
    n: usize,
) -> Vec<String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/nats_read.py");
    let out = Command::new(python)
        .arg(script)
        .args([
            "stream",
            url,
            stream,
            &format!("{prefix}.>"),
            &n.to_string(),
        ])
        .output()
        .expect("nats_read.py runs");
    assert!(
        out.status.success(),
        "nats_read.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("nats_read.py prints JSON");
    v["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let id = m["headers"]["Nats-Msg-Id"]
                .as_str()
                .expect("Nats-Msg-Id header")
                .to_owned();
            assert_eq!(m["headers"]["zdelay-id"].as_str(), Some(id.as_str()));
            id
        })
        .collect()
}

// ---- AMQP -------------------------------------------------------------------------------

pub(crate) fn amqp_tool(python: &str, url: &str, args: &[&str]) -> String {
    let out = Command::new(python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/amqp_tool.py"))
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

/// Consumes (pika) until `n` messages arrived and the queue is empty; their `message_id`s,
/// checked equal to the `zdelay-id` header.
pub(crate) fn amqp_message_ids(python: &str, url: &str, queue: &str, n: usize) -> Vec<String> {
    amqp_tool(python, url, &["consume", queue, &n.to_string(), "30"])
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("json line");
            let id = v["message_id"].as_str().expect("message_id").to_owned();
            assert_eq!(v["headers"]["zdelay-id"].as_str(), Some(id.as_str()));
            id
        })
        .collect()
}

// ---- load -------------------------------------------------------------------------------

/// One enqueued job: its route, id, and when the producer got the reply.
#[derive(Clone)]
struct Sent {
    route: &'static str,
    id: String,
    at: Instant,
}

/// A background producer: every `tick`, the given number of jobs to each route (one batch),
/// through the library, until stopped.
struct Producer {
    stop: Arc<AtomicBool>,
    sent: Arc<Mutex<Vec<Sent>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    started: Instant,
}

impl Producer {
    fn start(redis_url: String, routes: &[(&'static str, usize)], tick: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(Vec::new()));
        let routes = routes.to_vec();
        let thread = std::thread::spawn({
            let (stop, sent) = (stop.clone(), sent.clone());
            move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let client = connect(&rt, &redis_url);
                let mut next = Instant::now();
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let mut jobs = Vec::new();
                    let mut names = Vec::new();
                    for (route, count) in &routes {
                        for _ in 0..*count {
                            jobs.push(NewJob::new(*route, format!("{route}-{n}").into_bytes()));
                            names.push(*route);
                            n += 1;
                        }
                    }
                    let ids = enqueue(&rt, &client, jobs);
                    let at = Instant::now();
                    sent.lock().expect("sent lock").extend(
                        names
                            .into_iter()
                            .zip(ids)
                            .map(|(route, id)| Sent { route, id, at }),
                    );
                    next += tick;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
            }
        });
        Producer {
            stop,
            sent,
            thread: Some(thread),
            started: Instant::now(),
        }
    }

    fn sent(&self) -> Vec<Sent> {
        self.sent.lock().expect("sent lock").clone()
    }

    /// Stops and returns everything it enqueued.
    fn finish(mut self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the producer did not panic");
        }
        self.sent()
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What an outage run leaves for the broker-specific checks.
struct OutageRun {
    remote_ids: Vec<String>,
    daemon: Daemon,
    _redis: RedisServer,
}

/// A daemon with a two-phase route `remote` (to `target` on sink `sink`, configured by
/// `sink_section`) and a local list route `here`, under a steady load to both; the broker is
/// stopped after ~2 s, kept down for [`OUTAGE`], started again; returns when every job is
/// acked. Checks on the way: the local route keeps flowing during the outage, `/readyz` says
/// the sink is down then up, remote jobs waiting through the outage keep attempt 0, no retry,
/// reject or dead, and each local job is on its list exactly once.
fn run_outage(
    broker: &PrivateBrokers,
    kind: &str,
    sink: &str,
    sink_section: &str,
    target: &str,
) -> OutageRun {
    let t0 = Instant::now();
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
sink_pause = "100ms"

{sink_section}

[[routes]]
name = "remote"
sink = "{sink}"
target = "{target}"

[[routes]]
name = "here"
sink = "local"
target = "q:local"
"#
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let daemon = Daemon::start(&config);
    let rt = runtime();
    let client = config.client(&rt);
    let mut con = redis.conn();
    let delivered = |d: &Daemon| {
        metric(
            d,
            "zdelay_sink_messages_total",
            &[("sink", sink), ("outcome", "delivered")],
        )
    };

    // 25 jobs per route every 100 ms.
    let producer = Producer::start(
        redis.url(),
        &[("remote", 25), ("here", 25)],
        Duration::from_millis(100),
    );
    wait_for(
        "both routes flowing for 2 s",
        Duration::from_secs(15),
        || {
            producer.started.elapsed() >= Duration::from_secs(2)
                && llen(&mut con, "q:local") > 0
                && delivered(&daemon) > 0.0
        },
    );
    broker.run(&format!("STOP_{kind}"));
    let stopped = Instant::now();
    let local_at_stop = llen(&mut con, "q:local");
    wait_for(
        "/readyz reports the sink down",
        Duration::from_secs(10),
        || {
            matches!(daemon.admin_get("/readyz"),
                Some((503, body)) if body.contains(&format!("sink {sink} (")) && body.contains("down"))
        },
    );
    eprintln!("{kind}: readyz 503 {:?} after the stop", stopped.elapsed());
    // The chart's probe ignores the sinks: still ready, the sink named down in the text.
    assert!(
        matches!(daemon.admin_get("/readyz?sinks=ignore"),
            Some((200, body)) if body.contains(&format!("sink {sink} (")) && body.contains("down")),
        "{:?}",
        daemon.admin_get("/readyz?sinks=ignore")
    );

    // Hold the broker down; meanwhile the local route must keep up and readiness stay 503.
    let mut samples = Vec::new();
    let mut delivered_mid_outage = None;
    while stopped.elapsed() < OUTAGE {
        // Batches in flight at the stop have settled by now.
        if stopped.elapsed() >= OUTAGE / 2 && delivered_mid_outage.is_none() {
            delivered_mid_outage = Some(delivered(&daemon));
        }
        let status = daemon.admin_get("/readyz").map(|(s, _)| s);
        assert_eq!(status, Some(503), "readiness while {kind} is down");
        samples.push((stopped.elapsed(), llen(&mut con, "q:local")));
        std::thread::sleep(Duration::from_millis(250));
    }
    let sent = producer.sent();
    let local_now = llen(&mut con, "q:local");
    let cutoff = Instant::now() - Duration::from_secs(2);
    let local_due_by_cutoff = sent
        .iter()
        .filter(|s| s.route == "here" && s.at <= cutoff)
        .count();
    eprintln!(
        "{kind} down {:?}: local list {local_at_stop} → {local_now} (samples {:?})",
        stopped.elapsed(),
        samples
            .iter()
            .step_by(8)
            .map(|(t, n)| (t.as_secs(), *n))
            .collect::<Vec<_>>()
    );
    assert!(
        local_now >= local_at_stop + 1_000,
        "local jobs kept arriving while {kind} was down: {local_at_stop} → {local_now}"
    );
    assert!(
        local_now >= local_due_by_cutoff,
        "every local job enqueued 2 s ago or earlier is on its list: {local_now} < \
         {local_due_by_cutoff}"
    );
    // Remote jobs enqueued in the outage's first second have waited 9+ s: still pending,
    // no attempt burned.
    let waited: Vec<&Sent> = sent
        .iter()
        .filter(|s| {
            s.route == "remote" && s.at > stopped && s.at < stopped + Duration::from_secs(1)
        })
        .collect();
    assert!(
        waited.len() >= 100,
        "{} remote jobs in the first second",
        waited.len()
    );
    for s in &waited {
        let job = rt
            .block_on(client.get(&s.id))
            .expect("get")
            .unwrap_or_else(|| panic!("{} waited through the outage and is not pending", s.id));
        assert!(
            matches!(
                job.state,
                JobState::Scheduled | JobState::Due | JobState::InFlight
            ),
            "{}: {:?} {:?}",
            s.id,
            job.state,
            job.reason
        );
        let env = job.envelope.expect("envelope");
        assert_eq!(
            env.meta.attempt, 0,
            "{}: an unavailable broker burns no attempt",
            s.id
        );
        assert_eq!(env.meta.last_error, None, "{}", s.id);
    }
    assert_eq!(
        Some(delivered(&daemon)),
        delivered_mid_outage,
        "nothing confirmed by a stopped broker"
    );

    broker.run(&format!("START_{kind}"));
    let restarted = Instant::now();
    let sent = producer.finish();
    let remote_ids: Vec<String> = sent
        .iter()
        .filter(|s| s.route == "remote")
        .map(|s| s.id.clone())
        .collect();
    let local_ids = sent.len() - remote_ids.len();
    wait_for(
        "every job acked after the broker is back",
        Duration::from_secs(40),
        || pending(&mut con) == (0, 0),
    );
    let recovered = restarted.elapsed();
    wait_for("/readyz back to 200", Duration::from_secs(15), || {
        matches!(daemon.admin_get("/readyz"), Some((200, _)))
    });
    let outcome = |o: &str| {
        metric(
            &daemon,
            "zdelay_sink_messages_total",
            &[("sink", sink), ("outcome", o)],
        )
    };
    eprintln!(
        "{kind}: {} remote + {local_ids} local jobs; all acked {recovered:?} after the broker \
         was back; outcomes delivered {} unavailable {} retried {} rejected {}; waiting {}; \
         test so far {:?}",
        remote_ids.len(),
        outcome("delivered"),
        outcome("unavailable"),
        outcome("retried"),
        outcome("rejected"),
        metric(&daemon, "zdelay_sink_waiting", &[]),
        t0.elapsed()
    );
    assert!(
        outcome("unavailable") > 0.0,
        "the daemon did find {kind} down"
    );
    assert_eq!(
        outcome("retried"),
        0.0,
        "an outage is no transient per-message failure: {}",
        daemon
            .log_text()
            .lines()
            .filter(|l| l.contains("retried after a backoff"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(outcome("rejected"), 0.0);
    assert_eq!(stored_total(&mut con, "dead"), 0, "nothing dead");
    assert!(
        outcome("delivered") >= remote_ids.len() as f64,
        "every remote job confirmed"
    );
    // The local route: each job exactly once (atomic push in the move script).
    let local: Vec<Vec<u8>> = lrange(&mut con, "q:local");
    let unique: BTreeSet<&Vec<u8>> = local.iter().collect();
    assert_eq!(local.len(), local_ids, "every local job delivered");
    assert_eq!(unique.len(), local_ids, "no local job twice");
    OutageRun {
        remote_ids,
        daemon,
        _redis: redis,
    }
}

// ---- tests ------------------------------------------------------------------------------

/// kill between JetStream's PubAck and the ack in Redis: after the lease the next daemon
/// publishes those jobs again under the same `Nats-Msg-Id`, and the stream's duplicate window
/// absorbs them: exactly 2000 messages, one per job.
#[cfg(feature = "test-failpoints")]
#[test]
fn nats_crash_between_publish_and_ack_is_absorbed_by_jetstream_dedupe() {
    for kind in crate::common::NATS_KINDS {
        nats_crash_between_publish_and_ack(kind);
    }
}

#[cfg(feature = "test-failpoints")]
fn nats_crash_between_publish_and_ack(kind: &str) {
    let nats = PrivateBrokers::start(kind);
    let url = nats.var(&format!("{}_URL", kind.to_uppercase()));
    let rt = runtime();
    rt.block_on(crate::common::nats_version(kind, &url));
    let (_js, stream, prefix) = rt.block_on(make_stream(&url));
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
lease = "1s"

[sinks.bus]
kind = "nats"
url = "{url}"

[[routes]]
name = "events"
sink = "bus"
target = "{prefix}.due"
"#
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let client = config.client(&rt);
    let ids = enqueue(
        &rt,
        &client,
        (0..2000)
            .map(|i| NewJob::new("events", format!("c-{i}").into_bytes()))
            .collect(),
    );

    let mut crashing =
        Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", "abort_after_publish")]);
    let status = crashing.wait_exit(Duration::from_secs(30));
    assert!(
        !status.success(),
        "the failpoint aborts the daemon: {status}"
    );
    let published = js_count(&rt, &url, &stream);
    let mut con = redis.conn();
    let (jobs, inflight) = pending(&mut con);
    eprintln!("crash: {published} in the stream, {jobs} jobs stored, {inflight} in flight");
    assert!(
        published > 0,
        "it crashed after JetStream confirmed a batch"
    );
    assert_eq!(jobs, 2000, "nothing was acked before the crash");
    assert!(
        inflight as u64 >= published,
        "the published jobs are left in flight"
    );

    let started = Instant::now();
    let daemon = Daemon::start(&config);
    wait_for("every job acked", Duration::from_secs(30), || {
        pending(&mut con) == (0, 0)
    });
    eprintln!("second daemon acked all in {:?}", started.elapsed());
    let delivered = metric(
        &daemon,
        "zdelay_sink_messages_total",
        &[("sink", "bus"), ("outcome", "delivered")],
    );
    let expired = metric(&daemon, "zdelay_leases_expired_total", &[]);
    eprintln!("second daemon: delivered {delivered}, leases expired {expired}");
    assert!(
        expired >= inflight as f64,
        "the crashed daemon's {inflight} leases ran out and were reaped ({expired})"
    );
    assert!(
        delivered >= 2000.0,
        "the second daemon published every job again, the {published} already stored too \
         ({delivered})"
    );
    assert_eq!(stored_total(&mut con, "dead"), 0);

    // Read by nats-py first: on failure it shows which jobs repeat and under which ids.
    let in_stream = js_count(&rt, &url, &stream);
    let msg_ids = nats_message_ids(
        &nats.var("PYTHON"),
        &url,
        &stream,
        &prefix,
        in_stream as usize,
    );
    let repeats = check_message_ids("JetStream after a crash", &ids, &msg_ids);
    assert_eq!(repeats, 0, "the duplicate window absorbed the republish");
    assert_eq!(in_stream, 2000, "exactly one message per job in the stream");
}

/// The same crash with RabbitMQ, which has no dedupe: what was confirmed before the crash is
/// delivered twice, and both copies carry the job's one `message_id`, so a consumer can drop
/// the second. Shared broker (it is not stopped).
#[cfg(feature = "test-failpoints")]
#[test]
fn rabbitmq_crash_between_publish_and_ack_repeats_with_the_same_message_id() {
    let services = Services::get();
    let (url, python) = (services.amqp_url(), services.python());
    let queue = format!("bf-crash-{}", tag());
    amqp_tool(&python, &url, &["declare", &queue]);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
lease = "1s"

[sinks.rabbit]
kind = "amqp"
url = "{url}"

[[routes]]
name = "billing"
sink = "rabbit"
target = "/{queue}"
"#
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let rt = runtime();
    let client = config.client(&rt);
    let ids = enqueue(
        &rt,
        &client,
        (0..2000)
            .map(|i| NewJob::new("billing", format!("c-{i}").into_bytes()))
            .collect(),
    );
    let mut crashing =
        Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", "abort_after_publish")]);
    let status = crashing.wait_exit(Duration::from_secs(30));
    assert!(
        !status.success(),
        "the failpoint aborts the daemon: {status}"
    );
    let mut con = redis.conn();
    let (jobs, inflight) = pending(&mut con);
    // Everything confirmed before the crash (the queue is drained: nothing else publishes).
    let before = amqp_message_ids(&python, &url, &queue, 1);
    eprintln!(
        "crash: {} confirmed by RabbitMQ, {jobs} jobs stored, {inflight} in flight",
        before.len()
    );
    assert!(
        !before.is_empty(),
        "it crashed after RabbitMQ confirmed a batch"
    );
    assert_eq!(jobs, 2000, "nothing was acked before the crash");
    assert!(
        inflight >= before.len(),
        "the confirmed jobs are left in flight"
    );

    let daemon = Daemon::start(&config);
    wait_for("every job acked", Duration::from_secs(30), || {
        pending(&mut con) == (0, 0)
    });
    let after = amqp_message_ids(&python, &url, &queue, 2000);
    assert_eq!(
        check_message_ids("RabbitMQ after the crash", &ids, &after),
        0
    );
    let all: Vec<String> = before.iter().chain(&after).cloned().collect();
    let repeats = check_message_ids("RabbitMQ, both deliveries", &ids, &all);
    assert_eq!(
        repeats,
        before.len(),
        "exactly the jobs confirmed before the crash repeat, under the same message_id"
    );
    assert!(metric(&daemon, "zdelay_leases_expired_total", &[]) >= inflight as f64);
    assert_eq!(stored_total(&mut con, "dead"), 0);
    amqp_tool(&python, &url, &["delete", &queue]);
}

/// NATS stopped for 10 s under load, on each supported version (Debian's 2.9 once never
/// came back: its health check could not parse 2.9's reply): the local route keeps flowing,
/// no attempt is burned, and afterwards each NATS job is in the stream exactly once.
#[test]
fn nats_down_10s_under_load_loses_nothing_and_other_sinks_flow() {
    for kind in crate::common::NATS_KINDS {
        nats_down_under_load(kind);
    }
}

fn nats_down_under_load(kind: &str) {
    let started = Instant::now();
    let nats = PrivateBrokers::start(kind);
    let upper = kind.to_uppercase();
    let url = nats.var(&format!("{upper}_URL"));
    let rt = runtime();
    rt.block_on(crate::common::nats_version(kind, &url));
    let (_js, stream, prefix) = rt.block_on(make_stream(&url));
    let sink_section = format!("[sinks.bus]\nkind = \"nats\"\nurl = \"{url}\"");
    let run = run_outage(
        &nats,
        &upper,
        "bus",
        &sink_section,
        &format!("{prefix}.due"),
    );
    let n = run.remote_ids.len();
    let in_stream = js_count(&rt, &url, &stream);
    let msg_ids = nats_message_ids(
        &nats.var("PYTHON"),
        &url,
        &stream,
        &prefix,
        in_stream as usize,
    );
    let repeats = check_message_ids("JetStream after the outage", &run.remote_ids, &msg_ids);
    assert_eq!(repeats, 0, "dedupe absorbed any republish");
    assert_eq!(in_stream, n as u64, "the stream holds one message per job");
    let (status, body) = run.daemon.admin_get("/readyz").expect("readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("sink bus (nats): up"), "{body}");
    eprintln!("{kind} outage test: {n} NATS jobs, {:?}", started.elapsed());
}

/// RabbitMQ stopped for 10+ s under load (its restart takes seconds more): the local route
/// keeps flowing, no attempt is burned, and every AMQP job is consumed; a job consumed twice
/// carries the same `message_id` both times.
#[test]
fn rabbitmq_down_10s_under_load_loses_nothing_and_other_sinks_flow() {
    let started = Instant::now();
    let amqp = PrivateBrokers::start("amqp");
    let url = amqp.var("AMQP_URL");
    let python = amqp.var("PYTHON");
    let queue = format!("bf-{}", tag());
    amqp_tool(&python, &url, &["declare", &queue]);
    let sink_section = format!("[sinks.rabbit]\nkind = \"amqp\"\nurl = \"{url}\"");
    let run = run_outage(&amqp, "AMQP", "rabbit", &sink_section, &format!("/{queue}"));
    let n = run.remote_ids.len();
    let msg_ids = amqp_message_ids(&python, &url, &queue, n);
    let repeats = check_message_ids("RabbitMQ after the outage", &run.remote_ids, &msg_ids);
    eprintln!(
        "amqp outage test: {n} AMQP jobs, {} consumed ({repeats} repeats, each with its job's \
         one message_id), {:?}",
        msg_ids.len(),
        started.elapsed()
    );
    let (status, body) = run.daemon.admin_get("/readyz").expect("readyz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("sink rabbit (amqp): up"), "{body}");
}

/// Kafka (tansu with SQLite storage, which keeps topics and records across a restart, like a
/// real Kafka) stopped for 10 s under load through the daemon: the local route keeps
/// flowing, no attempt is burned, and afterwards every job is on the topic, repeats only
/// under its one `zdelay-id`.
#[test]
fn kafka_down_10s_under_load_loses_nothing_and_other_sinks_flow() {
    let started = Instant::now();
    let kafka = PrivateBrokers::start("kafka");
    let brokers = kafka.var("KAFKA_BROKERS");
    let topic = format!("bf-{}", tag());
    crate::kafka::create_topic(&kafka.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let sink_section = format!("[sinks.kafka]\nkind = \"kafka\"\nbrokers = \"{brokers}\"");
    let run = run_outage(&kafka, "KAFKA", "kafka", &sink_section, &topic);
    let n = run.remote_ids.len();
    let records = crate::kafka::consume(&kafka.var("PYTHON"), &brokers, &topic, -(n as i64));
    let msg_ids: Vec<String> = records
        .iter()
        .map(|r| {
            let (_, id) = r
                .headers
                .iter()
                .find(|(name, _)| name == "zdelay-id")
                .expect("zdelay-id header");
            String::from_utf8(id.clone()).expect("utf-8 zdelay-id")
        })
        .collect();
    let repeats = check_message_ids("Kafka after the outage", &run.remote_ids, &msg_ids);
    eprintln!(
        "kafka outage test: {n} Kafka jobs, {} records ({repeats} repeats, each under its job's \
         one zdelay-id), {:?}",
        records.len(),
        started.elapsed()
    );
    let (status, body) = run.daemon.admin_get("/readyz").expect("readyz");
    assert_eq!(status, 200, "{body}");
}

/// Cumulative `zdelay_lateness_seconds` for `source`: (jobs at most `le_seconds` late, all jobs).
fn lateness_counts(daemon: &Daemon, source: &str, le: &str) -> (f64, f64) {
    let (_, text) = daemon.admin_get("/metrics").expect("/metrics answers");
    let mut within = 0.0;
    let mut all = 0.0;
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        let of_source = series.contains(&format!("source=\"{source}\""));
        if !of_source {
            continue;
        }
        if series.starts_with("zdelay_lateness_seconds_bucket")
            && series.contains(&format!("le=\"{le}\""))
        {
            within = value;
        } else if series.starts_with("zdelay_lateness_seconds_count") {
            all = value;
        }
    }
    (within, all)
}

/// RabbitMQ hung (SIGSTOP, so its port stays open and nothing answers) for 15 s under a mixed
/// load of 500 local-list and 200 AMQP jobs a second: the local route's lateness p99 stays
/// under 10 ms throughout (each shard's mover never waits for the broker: the AMQP jobs wait
/// for their sink's publishers, which wait for the broker), the AMQP jobs burn no attempt and
/// none dies, and after SIGCONT every job arrives, a repeat only under its one message id.
#[test]
fn rabbitmq_hung_15s_holds_up_nothing_else() {
    const HANG: Duration = Duration::from_secs(15);
    let started = Instant::now();
    let amqp = PrivateBrokers::start("amqp");
    let url = amqp.var("AMQP_URL");
    let python = amqp.var("PYTHON");
    let queue = format!("bf-{}", tag());
    amqp_tool(&python, &url, &["declare", &queue]);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"

[sinks.rabbit]
kind = "amqp"
url = "{url}"

[[routes]]
name = "remote"
sink = "rabbit"
target = "/{queue}"

[[routes]]
name = "here"
sink = "local"
target = "q:local"
"#
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let daemon = Daemon::start(&config);
    let rt = runtime();
    let client = config.client(&rt);
    let mut con = redis.conn();
    let producer = Producer::start(
        redis.url(),
        &[("here", 50), ("remote", 20)],
        Duration::from_millis(100),
    );
    wait_for(
        "both routes flowing for 2 s",
        Duration::from_secs(15),
        || {
            producer.started.elapsed() >= Duration::from_secs(2)
                && llen(&mut con, "q:local") > 0
                && metric(
                    &daemon,
                    "zdelay_sink_messages_total",
                    &[("sink", "rabbit"), ("outcome", "delivered")],
                ) > 0.0
        },
    );
    // 250 ms: far below the broker's hang (before the ready set, local jobs waited out the
    // 10 s confirm limit), far above what a loaded 2-core machine adds to a move. The 10 ms
    // figure is printed; the benchmark (docs/operations/benchmarks.md) is where it is held to a number.
    let (within_before, all_before) = lateness_counts(&daemon, "jobs", "0.25");
    let (fine_before, _) = lateness_counts(&daemon, "jobs", "0.01");
    amqp.run("PAUSE_AMQP");
    let hung = Instant::now();
    let local_at_hang = llen(&mut con, "q:local");
    while hung.elapsed() < HANG {
        std::thread::sleep(Duration::from_millis(250));
    }
    let (within, all) = lateness_counts(&daemon, "jobs", "0.25");
    let (fine, _) = lateness_counts(&daemon, "jobs", "0.01");
    let local_now = llen(&mut con, "q:local");
    let sent = producer.sent();
    amqp.run("RESUME_AMQP");
    let resumed = Instant::now();
    let moved = all - all_before;
    let on_time = (within - within_before) / moved.max(1.0);
    eprintln!(
        "rabbitmq hung {HANG:?}: {moved} local jobs moved meanwhile, {:.3}% within 10 ms, \
         {:.3}% within 250 ms; local list {local_at_hang} → {local_now}",
        (fine - fine_before) / moved.max(1.0) * 100.0,
        on_time * 100.0
    );
    assert!(
        moved >= 5_000.0,
        "local jobs kept moving while RabbitMQ hung: {moved}"
    );
    assert!(
        on_time >= 0.99,
        "local-list lateness p99 under 250 ms while RabbitMQ hung: only {:.2}% of {moved} \
         within 250 ms",
        on_time * 100.0
    );
    // AMQP jobs enqueued during the hang wait: pending, no attempt burned, nothing dead.
    let waited: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.route == "remote" && s.at > hung + Duration::from_secs(1))
        .take(200)
        .collect();
    assert!(
        waited.len() >= 100,
        "{} AMQP jobs during the hang",
        waited.len()
    );
    for s in &waited {
        let job = rt
            .block_on(client.get(&s.id))
            .expect("get")
            .unwrap_or_else(|| panic!("{} was enqueued during the hang and is gone", s.id));
        assert!(
            matches!(job.state, JobState::Due | JobState::InFlight),
            "{}: {:?} {:?}",
            s.id,
            job.state,
            job.reason
        );
        assert_eq!(job.envelope.expect("envelope").meta.attempt, 0, "{}", s.id);
    }
    let sent = producer.finish();
    wait_for(
        "every job acked after SIGCONT",
        Duration::from_secs(60),
        || pending(&mut con) == (0, 0),
    );
    eprintln!("all acked {:?} after SIGCONT", resumed.elapsed());
    assert_eq!(stored_total(&mut con, "dead"), 0, "nothing died");
    let remote_ids: Vec<String> = sent
        .iter()
        .filter(|s| s.route == "remote")
        .map(|s| s.id.clone())
        .collect();
    let local = sent.len() - remote_ids.len();
    assert_eq!(llen(&mut con, "q:local"), local, "each local job once");
    let msg_ids = amqp_message_ids(&python, &url, &queue, remote_ids.len());
    let repeats = check_message_ids("RabbitMQ after the hang", &remote_ids, &msg_ids);
    assert_eq!(
        metric(
            &daemon,
            "zdelay_sink_messages_total",
            &[("sink", "rabbit"), ("outcome", "retried")],
        ),
        0.0,
        "a hung broker burns no attempt"
    );
    eprintln!(
        "rabbitmq hang test: {} AMQP + {local} local jobs, {repeats} AMQP repeats, {:?}",
        remote_ids.len(),
        started.elapsed()
    );
}

/// Missing destinations on routes with `on_missing = "dead"`, through the daemon: a NATS
/// subject no stream listens on and an AMQP exchange with no binding send their jobs to dead
/// with the broker's reason; the daemon stays up and ready, and good jobs on other routes are
/// delivered afterwards.
#[test]
fn missing_destinations_go_to_dead_when_their_route_says_so() {
    let services = Services::get();
    let (nats_url, amqp_url, python) =
        (services.nats_url(), services.amqp_url(), services.python());
    let rt = runtime();
    let (js, stream, prefix) = rt.block_on(make_stream(&nats_url));
    let t = tag();
    let nowhere = format!("bfnostream.{t}.x");
    let (queue, exchange) = (format!("bf-q-{t}"), format!("bf-ex-{t}"));
    amqp_tool(&python, &amqp_url, &["declare", &queue]);
    amqp_tool(&python, &amqp_url, &["exchange", &exchange]);
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"

[sinks.bus]
kind = "nats"
url = "{nats_url}"

[sinks.rabbit]
kind = "amqp"
url = "{amqp_url}"

[[routes]]
name = "nostream"
sink = "bus"
target = "{nowhere}"
on_missing = "dead"

[[routes]]
name = "natsgood"
sink = "bus"
target = "{prefix}.good"

[[routes]]
name = "unroutable"
sink = "rabbit"
target = "{exchange}/nowhere"
on_missing = "dead"

[[routes]]
name = "amqpgood"
sink = "rabbit"
target = "/{queue}"
"#
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let mut daemon = Daemon::start(&config);
    let client = config.client(&rt);
    let mut bad = Vec::new();
    for i in 0..20 {
        bad.push(NewJob::new("nostream", format!("ns-{i}").into_bytes()));
        bad.push(NewJob::new("unroutable", format!("ur-{i}").into_bytes()));
    }
    let bad_ids = enqueue(&rt, &client, bad);
    let dead_list = || -> Vec<serde_json::Value> {
        let out = config.cli(&["dead", "list", "--json"]);
        assert!(
            out.status.success(),
            "dead list: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("dead list JSON");
        v["jobs"].as_array().expect("jobs").clone()
    };
    let mut con = redis.conn();
    wait_for("40 rejected jobs dead", Duration::from_secs(20), || {
        pending(&mut con).1 == 0 && stored_total(&mut con, "dead") == 40
    });
    let dead = dead_list();
    assert_eq!(dead.len(), 40, "{dead:?}");
    for (i, id) in bad_ids.iter().enumerate() {
        let job = dead
            .iter()
            .find(|d| d["id"].as_str() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("{id} not in dead list"));
        let reason = job["reason"].as_str().expect("reason");
        if i % 2 == 0 {
            assert!(
                reason.contains("no JetStream stream") && reason.contains(&nowhere),
                "{id}: {reason}"
            );
        } else {
            assert!(
                reason.contains("unroutable") && reason.contains("NO_ROUTE"),
                "{id}: {reason}"
            );
        }
    }
    let held = |sink: &str| {
        metric(
            &daemon,
            "zdelay_sink_messages_total",
            &[("sink", sink), ("outcome", "held")],
        )
    };
    assert_eq!(held("bus"), 20.0);
    assert_eq!(held("rabbit"), 20.0);

    // The daemon goes on: good jobs on the other routes, and readiness untouched by rejects.
    let mut good = Vec::new();
    for i in 0..10 {
        good.push(NewJob::new("natsgood", format!("ng-{i}").into_bytes()));
        good.push(NewJob::new("amqpgood", format!("ag-{i}").into_bytes()));
    }
    let good_ids = enqueue(&rt, &client, good);
    wait_for("good jobs acked", Duration::from_secs(20), || {
        pending(&mut con) == (40, 0)
    });
    assert!(daemon.try_exit().is_none(), "the daemon is still running");
    assert_eq!(rt.block_on(stream_count(&js, &stream)), 10);
    let nats_ids = nats_message_ids(&python, &nats_url, &stream, &prefix, 10);
    let amqp_ids = amqp_message_ids(&python, &amqp_url, &queue, 10);
    // Enqueued in pairs: NATS, AMQP.
    let nats_good: Vec<String> = good_ids.iter().step_by(2).cloned().collect();
    let amqp_good: Vec<String> = good_ids.iter().skip(1).step_by(2).cloned().collect();
    assert_eq!(
        check_message_ids("good NATS jobs", &nats_good, &nats_ids),
        0
    );
    assert_eq!(
        check_message_ids("good AMQP jobs", &amqp_good, &amqp_ids),
        0
    );
    let (status, body) = daemon.admin_get("/readyz").expect("readyz");
    assert_eq!(status, 200, "rejects do not make a sink unready: {body}");
    assert_eq!(stored_total(&mut con, "dead"), 40);

    rt.block_on(js.delete_stream(&stream))
        .expect("delete stream");
    amqp_tool(&python, &amqp_url, &["delete", &queue, &exchange]);
}

/// How long every broker stays down in the episode test.
const EPISODE_OUTAGE: Duration = Duration::from_secs(30);

/// The lines of `log` about sink `name`: tagged with it, or (for the broker client libraries,
/// which do not know the sink's name) from the library `library`.
fn lines_about<'a>(log: &'a str, name: &str, library: &str) -> Vec<&'a str> {
    let tags = [format!("sink={name} "), format!("sink=\"{name}\"")];
    log.lines()
        .filter(|l| {
            tags.iter()
                .any(|t| l.contains(t.as_str()) || l.ends_with(t.trim_end()))
                || l.contains(&format!(" {library}"))
        })
        .collect()
}

/// Every kind of sink down for 30 s at once — Kafka, RabbitMQ, NATS 2.15 and 2.9, a remote
/// Redis — while a daemon has due jobs for each: its log has, per sink, one line when the
/// outage starts (WARN, naming the sink and the cause) and one when it ends (INFO, with the
/// errors it did not log), nothing else about it however often the clients retried, and
/// every job arrives once the brokers are back.
#[test]
fn every_sink_logs_one_line_when_an_outage_starts_and_one_when_it_ends() {
    let started = Instant::now();
    let brokers = PrivateBrokers::start("kafka amqp nats nats29");
    let mut far = RedisServer::start();
    let redis = RedisServer::start();
    let rt = runtime();
    let python = brokers.var("PYTHON");
    let kafka_brokers = brokers.var("KAFKA_BROKERS");
    let topic = format!("ep-{}", tag());
    crate::kafka::create_topic(&brokers.var("KAFKA_TOPIC_CMD"), &topic, 2);
    let amqp_url = brokers.var("AMQP_URL");
    let queue = format!("ep-{}", tag());
    amqp_tool(&python, &amqp_url, &["declare", &queue]);
    let nats_url = brokers.var("NATS_URL");
    let nats29_url = brokers.var("NATS29_URL");
    let (_, stream, prefix) = rt.block_on(make_stream(&nats_url));
    let (_, stream29, prefix29) = rt.block_on(make_stream(&nats29_url));
    // (sink, the client library that may log about it, route)
    let sinks = [
        ("kafka", "rdkafka", "to-kafka"),
        ("rabbit", "lapin", "to-rabbit"),
        ("jetnew", "async_nats", "to-jetnew"),
        ("jetold", "async_nats", "to-jetold"),
        ("far", "redis::", "to-far"),
    ];
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
sink_pause = "100ms"

[sinks.kafka]
kind = "kafka"
brokers = "{kafka_brokers}"

[sinks.rabbit]
kind = "amqp"
url = "{amqp_url}"

[sinks.jetnew]
kind = "nats"
url = "{nats_url}"

[sinks.jetold]
kind = "nats"
url = "{nats29_url}"

[sinks.far]
kind = "redis"
url = "{far_url}"

[[routes]]
name = "to-kafka"
sink = "kafka"
target = "{topic}"

[[routes]]
name = "to-rabbit"
sink = "rabbit"
target = "/{queue}"

[[routes]]
name = "to-jetnew"
sink = "jetnew"
target = "{prefix}.due"

[[routes]]
name = "to-jetold"
sink = "jetold"
target = "{prefix29}.due"

[[routes]]
name = "to-far"
sink = "far"
target = "q:far"
"#,
        far_url = far.url(),
    );
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let routes: Vec<(&'static str, usize)> = sinks.iter().map(|(_, _, r)| (*r, 2)).collect();
    // Jobs due all the time, before, through and after the outage.
    let producer = Producer::start(redis.url(), &routes, Duration::from_millis(200));
    let delivered = |sink: &str| {
        metric(
            &daemon,
            "zdelay_sink_messages_total",
            &[("sink", sink), ("outcome", "delivered")],
        )
    };
    wait_for("every sink delivering", Duration::from_secs(20), || {
        sinks.iter().all(|(sink, _, _)| delivered(sink) > 0.0)
    });
    let from = daemon.log_text().len();

    // Down together: the test costs one outage, not five. The remote Redis saves what it
    // acknowledged, as the brokers keep theirs.
    let _ = redis::cmd("SHUTDOWN")
        .arg("SAVE")
        .query::<()>(&mut far.conn());
    let stop_all = |what: &str| {
        std::thread::scope(|s| {
            for broker in ["KAFKA", "AMQP", "NATS", "NATS29"] {
                let brokers = &brokers;
                s.spawn(move || brokers.run(&format!("{what}_{broker}")));
            }
        })
    };
    stop_all("STOP");
    let stopped = Instant::now();
    wait_for(
        "/readyz names every sink down",
        Duration::from_secs(15),
        || {
            matches!(daemon.admin_get("/readyz"), Some((503, body))
                if sinks.iter().all(|(sink, _, _)| body.contains(&format!("sink {sink} (")))
                    && body.matches(": down").count() >= sinks.len())
        },
    );
    std::thread::sleep(EPISODE_OUTAGE.saturating_sub(stopped.elapsed()));
    far.restart();
    stop_all("START");
    let sent = producer.finish();
    wait_for(
        "every job acked after the brokers are back",
        Duration::from_secs(60),
        || pending(&mut con) == (0, 0),
    );
    let log = || daemon.log_text().get(from..).unwrap_or_default().to_owned();
    wait_for_or_show(
        "every sink's outage ended in the log",
        Duration::from_secs(30),
        || {
            let log = log();
            sinks.iter().all(|(sink, library, _)| {
                lines_about(&log, sink, library)
                    .iter()
                    .any(|l| l.contains("sink available again"))
            })
        },
        log,
    );

    let log = log();
    let mut report = Vec::new();
    for (sink, library, _) in sinks {
        let lines = lines_about(&log, sink, library);
        let starts: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains(" WARN ") && l.contains("sink unavailable"))
            .collect();
        let ends: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains(" INFO ") && l.contains("sink available again"))
            .collect();
        let warnings = lines
            .iter()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .count();
        // The sink's own lines: the whole log would be cut off in a CI report.
        let own = lines.join("\n");
        assert_eq!(
            starts.len(),
            1,
            "{sink}: one line starts the outage:\n{own}"
        );
        assert_eq!(ends.len(), 1, "{sink}: one line ends it:\n{own}");
        assert_eq!(warnings, 1, "{sink}: no other warning:\n{own}");
        let suppressed: u64 = ends[0]
            .split("suppressed=")
            .nth(1)
            .and_then(|v| v.split(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "{sink}: the end line counts what it did not log: {}",
                    ends[0]
                )
            });
        assert!(suppressed > 0, "{sink}: 30 s of checks failed: {}", ends[0]);
        report.push(format!(
            "{sink}: {} lines, {suppressed} errors suppressed",
            lines.len()
        ));
        assert!(
            lines.len() <= 4,
            "{sink}: a few lines about an outage, not a flood ({}):\n{}",
            lines.len(),
            lines.join("\n")
        );
    }
    assert!(!log.contains("guest:guest"), "no credentials in the log");

    // Every job arrived.
    let ids = |route: &str| -> Vec<String> {
        sent.iter()
            .filter(|s| s.route == route)
            .map(|s| s.id.clone())
            .collect()
    };
    let kafka_ids = ids("to-kafka");
    let records = crate::kafka::consume(&python, &kafka_brokers, &topic, -(kafka_ids.len() as i64));
    let record_ids: Vec<String> = records
        .iter()
        .filter_map(|r| r.headers.iter().find(|(name, _)| name == "zdelay-id"))
        .map(|(_, id)| String::from_utf8_lossy(id).into_owned())
        .collect();
    check_message_ids("Kafka after the outage", &kafka_ids, &record_ids);
    let rabbit_ids = ids("to-rabbit");
    let consumed = amqp_message_ids(&python, &amqp_url, &queue, rabbit_ids.len());
    check_message_ids("RabbitMQ after the outage", &rabbit_ids, &consumed);
    for (url, stream, route) in [
        (&nats_url, &stream, "to-jetnew"),
        (&nats29_url, &stream29, "to-jetold"),
    ] {
        assert_eq!(
            js_count(&rt, url, stream),
            ids(route).len() as u64,
            "{route}: one message per job"
        );
    }
    let far_jobs: BTreeSet<Vec<u8>> = lrange(&mut far.conn(), "q:far").into_iter().collect();
    assert_eq!(
        far_jobs.len(),
        ids("to-far").len(),
        "every remote Redis job"
    );
    eprintln!(
        "{} jobs; {}; test {:?}",
        sent.len(),
        report.join(", "),
        started.elapsed()
    );
}
