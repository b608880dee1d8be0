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

pub use redis_list::LocalRoutes;

use std::collections::BTreeMap;

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
