//! Sinks: where due jobs go.
//!
//! The local Redis list sink delivers inside the move script itself (atomic, exactly once,
//! no lease): see `redis_list`. Every other sink is two-phase: the move script claims the
//! job (due → inflight with a lease deadline), the poller publishes a batch here and waits
//! for the broker's own confirmation, then settles each job with a fenced script. This file
//! is the contract those sinks implement.
//!
//! Adding a sink: its file, one `Sink` variant, one `config::SinkConfig` variant, its
//! integration test.

pub mod redis_list;
pub mod redis_remote;

pub use redis_list::LocalRoutes;

use crate::config::{Config, SinkConfig};
use redis::ScriptInvocation;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// One message for a two-phase sink, resolved from a claimed job.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub id: String,
    /// The job's due time, ms; with the id it forms the idempotency key.
    pub due_ms: i64,
    /// Kafka topic, AMQP `exchange/routing-key` ("/q" = default exchange, queue q), NATS
    /// subject, or Redis list key.
    pub target: String,
    pub payload: Vec<u8>,
    /// The envelope's headers; they travel as message headers.
    pub headers: BTreeMap<String, String>,
    /// AMQP message priority (the route's lane), if any.
    pub priority: Option<u8>,
}

/// Header (or property) carrying the idempotency key on every message.
pub const IDEMPOTENCY_HEADER: &str = "zdelay-id";

impl Message {
    /// `<id>:<due>`: stable across redeliveries of the same scheduled job, so consumers
    /// (and JetStream's duplicate window) can drop a repeat.
    pub fn idempotency_key(&self) -> String {
        format!("{}:{}", self.id, self.due_ms)
    }
}

/// What became of one message. Exactly one per message, in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed it.
    Delivered,
    /// Transient failure: back to due after backoff, one attempt counted.
    Retry(String),
    /// Permanent failure (unknown topic, unroutable, too large, not authorized): dead.
    Reject(String),
    /// The sink is down (connection refused, broker unavailable): back to due, no attempt
    /// counted, and the sink pauses.
    Unavailable(String),
}

/// A sink that cannot be built from its config.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("sink {sink}: invalid config: {why}")]
    Config { sink: String, why: String },
}

pub mod amqp;
pub mod kafka;
pub mod nats;

/// A two-phase sink. A closed set: enum dispatch, exhaustive matches.
pub enum Sink {
    RedisRemote(redis_remote::RedisRemoteSink),
    Amqp(amqp::AmqpSink),
    Nats(nats::NatsSink),
    Kafka(kafka::KafkaSink),
}

impl Sink {
    /// Builds the sink named `name`; `None` for the local Redis sink (no two-phase path).
    /// Never needs the broker to be up.
    pub fn new(name: &str, config: &Config) -> Result<Option<Sink>, SinkError> {
        let sink_config = &config.sinks[name];
        Ok(match sink_config {
            SinkConfig::Redis(r) => match &r.url {
                None => None,
                Some(url) => Some(Sink::RedisRemote(redis_remote::RedisRemoteSink::new(
                    name,
                    url.expose(),
                    config,
                )?)),
            },
            SinkConfig::Amqp(c) => Some(Sink::Amqp(amqp::AmqpSink::new(name, c)?)),
            SinkConfig::Nats(c) => Some(Sink::Nats(nats::NatsSink::new(name, c)?)),
            SinkConfig::Kafka(c) => Some(Sink::Kafka(kafka::KafkaSink::new(name, c)?)),
        })
    }

    /// Publishes and waits for the broker's confirmation of each message.
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        match self {
            Sink::RedisRemote(s) => s.publish(batch).await,
            Sink::Amqp(s) => s.publish(batch).await,
            Sink::Nats(s) => s.publish(batch).await,
            Sink::Kafka(s) => s.publish(batch).await,
        }
    }

    /// A real, bounded health check.
    pub async fn check(&self) -> Result<(), String> {
        match self {
            Sink::RedisRemote(s) => s.check().await,
            Sink::Amqp(s) => s.check().await,
            Sink::Nats(s) => s.check().await,
            Sink::Kafka(s) => s.check().await,
        }
    }

    /// Flushes anything queued client-side (before exit).
    pub async fn flush(&self, timeout: Duration) {
        match self {
            Sink::RedisRemote(_) => {}
            Sink::Amqp(s) => s.flush(timeout).await,
            Sink::Nats(s) => s.flush(timeout).await,
            Sink::Kafka(s) => s.flush(timeout).await,
        }
    }
}

/// Builds every two-phase sink of `config`, by name; none needs its broker to be up.
pub fn build_all(
    config: &Config,
) -> Result<std::collections::HashMap<String, std::sync::Arc<SinkHandle>>, SinkError> {
    let mut sinks = std::collections::HashMap::new();
    for (name, sink_config) in &config.sinks {
        if let Some(sink) = Sink::new(name, config)? {
            let handle = SinkHandle::new(name, sink_config.kind(), sink, config.poller.sink_pause);
            sinks.insert(name.clone(), std::sync::Arc::new(handle));
        }
    }
    Ok(sinks)
}

/// Longest pause of an unavailable sink.
const MAX_PAUSE: Duration = Duration::from_secs(30);

/// A sink with its run-time state: paused while unavailable, health for `/readyz`.
pub struct SinkHandle {
    pub name: String,
    pub kind: &'static str,
    pub sink: Sink,
    first_pause: Duration,
    /// (paused until, next pause length)
    pause: Mutex<(Option<Instant>, Duration)>,
    /// Set by `pause`, cleared by a passing health check: a paused sink resumes only once
    /// its broker answers again, so no poller blocks on a publish to a broker known down.
    awaiting_check: AtomicBool,
    healthy: AtomicBool,
    last_error: Mutex<String>,
}

impl SinkHandle {
    pub fn new(name: &str, kind: &'static str, sink: Sink, first_pause: Duration) -> Self {
        SinkHandle {
            name: name.to_owned(),
            kind,
            sink,
            first_pause,
            pause: Mutex::new((None, first_pause)),
            awaiting_check: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            last_error: Mutex::new(String::new()),
        }
    }

    /// Paused: for the pause's length, and after it until a health check passes.
    pub fn is_paused(&self) -> bool {
        let pause = self.pause.lock().expect("pause lock");
        pause.0.is_some_and(|until| Instant::now() < until)
            || self.awaiting_check.load(Ordering::Relaxed)
    }

    /// How long this sink's jobs should be pushed back now: the rest of the pause, or, once
    /// only the health check is awaited, the next pause's length (it grows while the sink
    /// stays down, so a long outage rewrites its backlog rarely).
    pub fn pause_remaining(&self) -> Duration {
        let pause = self.pause.lock().expect("pause lock");
        let left = pause
            .0
            .map(|until| until.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        if left.is_zero() && self.awaiting_check.load(Ordering::Relaxed) {
            pause.1
        } else {
            left
        }
    }

    /// The sink was found unavailable: pause it, doubling the pause while it stays down.
    pub fn pause(&self, why: &str) -> Duration {
        let mut pause = self.pause.lock().expect("pause lock");
        let length = pause.1;
        *pause = (Some(Instant::now() + length), (length * 2).min(MAX_PAUSE));
        self.awaiting_check.store(true, Ordering::Relaxed);
        self.set_health(Err(why.to_owned()));
        length
    }

    /// A background health check's answer: a pass lets a paused sink resume after its pause.
    pub fn checked(&self, result: Result<(), String>) {
        if result.is_ok() {
            self.awaiting_check.store(false, Ordering::Relaxed);
        }
        self.set_health(result);
    }

    /// A publish went through: the sink works again.
    pub fn resume(&self) {
        let mut pause = self.pause.lock().expect("pause lock");
        *pause = (None, self.first_pause);
        self.awaiting_check.store(false, Ordering::Relaxed);
        self.set_health(Ok(()));
    }

    pub fn set_health(&self, result: Result<(), String>) {
        let ok = result.is_ok();
        *self.last_error.lock().expect("error lock") = result.err().unwrap_or_default();
        if self.healthy.swap(ok, Ordering::Relaxed) != ok {
            if ok {
                tracing::info!(sink = %self.name, "sink available again");
            } else {
                tracing::error!(sink = %self.name, error = %self.last_error(), "sink unavailable");
            }
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn last_error(&self) -> String {
        self.last_error.lock().expect("error lock").clone()
    }
}

/// Where a two-phase job goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    pub sink: String,
    pub target: String,
    pub priority: Option<u8>,
}

/// The two-phase destinations: configured routes, and `<sink>/<target>` admitted by the
/// sink's `allow` globs. Also feeds `move_due` the names it needs to claim such jobs.
#[derive(Debug, Clone, Default)]
pub struct RemoteRoutes {
    routes: BTreeMap<String, Destination>,
    /// Two-phase sinks and their allow patterns.
    sinks: BTreeMap<String, Vec<String>>,
}

impl RemoteRoutes {
    pub fn from_config(config: &Config) -> Self {
        let mut table = RemoteRoutes::default();
        for (name, sink) in &config.sinks {
            if !sink.is_local() {
                table.sinks.insert(name.clone(), sink.allow().to_vec());
            }
        }
        for route in &config.routes {
            if table.sinks.contains_key(&route.sink) {
                table.routes.insert(
                    route.name.clone(),
                    Destination {
                        sink: route.sink.clone(),
                        target: route.list_key(),
                        priority: route.priority,
                    },
                );
            }
        }
        table
    }

    pub fn is_empty(&self) -> bool {
        self.sinks.is_empty()
    }

    /// Resolves a job's `dest`, or says why it cannot go anywhere.
    pub fn resolve(&self, dest: &str) -> Result<Destination, String> {
        if let Some(d) = self.routes.get(dest) {
            return Ok(d.clone());
        }
        let Some((sink, target)) = dest.split_once('/') else {
            return Err(format!("unknown destination: {dest}"));
        };
        let Some(allow) = self.sinks.get(sink) else {
            return Err(format!("unknown destination: {dest}"));
        };
        if target.is_empty() || !allow.iter().any(|p| glob_match::glob_match(p, target)) {
            return Err(format!(
                "destination {dest} not admitted by sinks.{sink}.allow {allow:?}"
            ));
        }
        Ok(Destination {
            sink: sink.to_owned(),
            target: target.to_owned(),
            priority: None,
        })
    }

    /// `move_due`'s two-phase ARGV: routes, sinks, paused sinks.
    pub fn apply(&self, inv: &mut ScriptInvocation<'_>, paused: &[&str]) {
        inv.arg(self.routes.len());
        for (name, d) in &self.routes {
            inv.arg(name).arg(&d.sink);
        }
        inv.arg(self.sinks.len());
        for name in self.sinks.keys() {
            inv.arg(name);
        }
        inv.arg(paused.len());
        for name in paused {
            inv.arg(*name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_toml;

    fn routes() -> RemoteRoutes {
        RemoteRoutes::from_config(
            &from_toml(
                r#"
                [sinks.other]
                kind = "redis"
                url = "redis://127.0.0.1:1"
                [sinks.bus]
                kind = "nats"
                url = "nats://127.0.0.1:4222"
                allow = ["events.*", "audit.>"]
                [[routes]]
                name = "mirror"
                sink = "other"
                target = "q"
                delayed_suffix = "-delayed"
                [[routes]]
                name = "local"
                sink = "local"
                target = "q"
                "#,
            )
            .unwrap(),
        )
    }

    #[test]
    fn resolves_routes_and_allowed_targets() {
        let r = routes();
        assert_eq!(
            r.resolve("mirror").unwrap(),
            Destination {
                sink: "other".into(),
                target: "q-delayed".into(),
                priority: None
            }
        );
        assert_eq!(r.resolve("bus/events.due").unwrap().target, "events.due");
        assert!(
            r.resolve("bus/orders.due")
                .unwrap_err()
                .contains("not admitted")
        );
        assert!(r.resolve("bus/").is_err());
        assert!(
            r.resolve("local")
                .unwrap_err()
                .contains("unknown destination")
        );
        assert!(
            r.resolve("nope/x")
                .unwrap_err()
                .contains("unknown destination")
        );
        assert!(
            r.resolve("plain")
                .unwrap_err()
                .contains("unknown destination")
        );
    }

    #[test]
    fn a_paused_sink_resumes_only_after_its_pause_and_a_passing_check() {
        let sink = redis_remote::RedisRemoteSink::new(
            "other",
            "redis://127.0.0.1:1",
            &from_toml("").unwrap(),
        )
        .unwrap();
        let h = SinkHandle::new("other", "redis", Sink::RedisRemote(sink), Duration::ZERO);
        assert!(!h.is_paused());
        h.pause("connection refused");
        assert!(!h.is_healthy());
        assert!(
            h.is_paused(),
            "paused although the pause itself is zero: no check yet"
        );
        h.checked(Err("still refused".into()));
        assert!(h.is_paused());
        h.checked(Ok(()));
        assert!(!h.is_paused());
        assert!(h.is_healthy());
        // The pause doubles while the sink stays down, and resets once it works.
        let h = SinkHandle::new(
            "other",
            "redis",
            Sink::RedisRemote(
                redis_remote::RedisRemoteSink::new(
                    "o",
                    "redis://127.0.0.1:1",
                    &from_toml("").unwrap(),
                )
                .unwrap(),
            ),
            Duration::from_millis(100),
        );
        assert_eq!(h.pause("x"), Duration::from_millis(100));
        assert_eq!(h.pause("x"), Duration::from_millis(200));
        h.resume();
        assert_eq!(h.pause("x"), Duration::from_millis(100));
    }

    #[test]
    fn idempotency_key_is_id_and_due() {
        let m = Message {
            id: "01J".into(),
            due_ms: 1700,
            target: "t".into(),
            payload: vec![],
            headers: BTreeMap::new(),
            priority: None,
        };
        assert_eq!(m.idempotency_key(), "01J:1700");
    }
}
