//! Sinks: where due jobs go.
//!
//! The local Redis list sink delivers inside the move script itself (atomic, exactly once,
//! no lease); its routes are part of the route table (`zdelay_core::routes`) and need
//! nothing here. Every other sink is two-phase: the move script claims the job (due →
//! inflight with a lease deadline), the poller publishes a batch through a [`Sink`] and
//! waits for the broker's own confirmation, then settles each job with a fenced script.
//! This file is the contract those sinks implement.
//!
//! # Adding a sink
//! 1. Its file here, with a type that implements [`Sink`]: `publish` resolves one
//!    [`Outcome`] per message only after the broker confirmed (or clearly refused) it,
//!    `check` asks only what publishing needs, `flush` drains client-side queues.
//! 2. One arm in [`build`] turning its config into that type.
//! 3. Its config variant in `zdelay_core::config::SinkConfig` (with `kind`, `allow`).
//! 4. Its integration test under `tests/it/`, against the real broker.

pub mod amqp;
mod handle;
pub mod kafka;
pub mod nats;
pub mod peer;
pub mod redis_remote;

pub use handle::{InFlight, SinkHandle};

use futures::future::BoxFuture;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use zdelay_core::config::{Config, SinkConfig};
use zdelay_core::routes::Routes;

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
    /// The destination object does not exist (Kafka topic, AMQP exchange or binding,
    /// JetStream stream): an operator's problem, not the job's. The job waits, no attempt
    /// counted, and is tried again after `HELD_RECHECK`, while its target shows as held;
    /// a route with `on_missing = "dead"` dead-letters it instead. Other targets of the sink
    /// flow on.
    Missing(String),
    /// The destination is full or asks to slow down (a JetStream stream at its message,
    /// byte or storage limit): like `Missing`, the job waits with no attempt counted and is
    /// tried again after `HELD_RECHECK` while its target shows as held, but it never goes to
    /// dead for it, whatever `on_missing` says.
    Full(String),
}

/// How long a job whose destination object is missing waits before it is tried again.
pub const HELD_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

impl Outcome {
    /// The bounded word for metrics and spans.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Delivered => "delivered",
            Outcome::Retry(_) => "retried",
            Outcome::Reject(_) => "rejected",
            Outcome::Unavailable(_) => "unavailable",
            Outcome::Missing(_) | Outcome::Full(_) => "held",
        }
    }
}

/// What a sink's health check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Up,
    /// It cannot deliver now; why, in words an operator can act on.
    Down(String),
    /// The broker is older than this sink supports: refused at start-up, down afterwards.
    Unsupported(String),
}

impl Health {
    pub fn into_result(self) -> Result<(), String> {
        match self {
            Health::Up => Ok(()),
            Health::Down(why) | Health::Unsupported(why) => Err(why),
        }
    }
}

impl From<Result<(), String>> for Health {
    fn from(result: Result<(), String>) -> Self {
        match result {
            Ok(()) => Health::Up,
            Err(why) => Health::Down(why),
        }
    }
}

/// How every sink's refused credentials begin, in outcomes, logs, `/readyz` and `zdelay stats`:
/// distinct from an unreachable broker, so an operator fixes the password, not the network.
pub const AUTH_FAILED: &str = "authentication failed for";

/// "authentication failed for `who`: `detail`", e.g. `who` = "user alice".
pub fn auth_failed(who: &str, detail: &str) -> String {
    format!("{AUTH_FAILED} {who}: {detail}")
}

/// A sink that cannot be built from its config.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("sink {sink}: invalid config: {why}")]
    Config { sink: String, why: String },
}

/// A two-phase sink.
pub trait Sink: Send + Sync {
    /// Publishes and waits for the broker's confirmation of each message: one outcome per
    /// message, in order.
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Outcome>>;

    /// A real, bounded health check asking only what publishing needs: can this sink
    /// deliver now?
    fn check(&self) -> BoxFuture<'_, Health>;

    /// Flushes anything queued client-side (before exit).
    fn flush(&self, _timeout: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// How many messages wait at `target`, for a route's `max_length`: a Redis list's
    /// length, an AMQP queue's message count, the messages of the JetStream stream that
    /// stores a subject. `Err` says why it cannot be known now (config validation refuses
    /// `max_length` where it never can be, e.g. on Kafka).
    fn depth<'a>(&'a self, _target: &'a str) -> BoxFuture<'a, Result<u64, String>> {
        Box::pin(async { Err("this sink has no queue depth".to_owned()) })
    }
}

/// Builds the sink named `name`; `None` for the local Redis sink (no two-phase path).
/// Never needs the broker to be up.
pub fn build(name: &str, config: &Config) -> Result<Option<Box<dyn Sink>>, SinkError> {
    Ok(match &config.sinks[name] {
        SinkConfig::Redis(r) => match &r.url {
            // On a cluster, lists in another slot than the shards' are pushed two-phase.
            None if Routes::from_config(config)
                .two_phase_sinks()
                .any(|s| s == name) =>
            {
                Some(Box::new(redis_remote::RedisRemoteSink::on(
                    name,
                    config.redis.clone(),
                    config,
                )))
            }
            None => None,
            Some(url) => Some(Box::new(redis_remote::RedisRemoteSink::new(
                name,
                url.expose(),
                config,
            )?)),
        },
        SinkConfig::Amqp(c) => Some(Box::new(amqp::AmqpSink::new(name, c)?)),
        SinkConfig::Nats(c) => Some(Box::new(nats::NatsSink::new(name, c)?)),
        SinkConfig::Kafka(c) => Some(Box::new(kafka::KafkaSink::with_deadline(
            name,
            c,
            config.poller.publish_deadline(),
        )?)),
    })
}

/// The two-phase sinks by name.
pub type Sinks = HashMap<String, Arc<SinkHandle>>;

/// Builds every two-phase sink of `config`, by name; none needs its broker to be up.
pub fn build_all(config: &Config) -> Result<Sinks, SinkError> {
    let mut sinks = HashMap::new();
    for (name, sink_config) in &config.sinks {
        if let Some(sink) = build(name, config)? {
            let mut handle = SinkHandle::new(
                name,
                sink_config.kind(),
                sink,
                config.poller.sink_pause,
                config.poller.sink_concurrency,
            )
            .with_inflight_bytes(config.poller.sink_inflight_bytes);
            handle.endpoints = peer::endpoints(sink_config);
            sinks.insert(name.clone(), Arc::new(handle));
        }
    }
    Ok(sinks)
}

/// Flushes every sink at once (at shutdown), each bounded by `timeout`.
pub async fn flush_all(sinks: &Sinks, timeout: Duration) {
    futures::future::join_all(sinks.values().map(|s| s.sink.flush(timeout))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

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
