//! Sinks: where due jobs go.
//!
//! This version has the local Redis list sink, whose delivery happens inside the move
//! script itself (atomic, exactly once, no lease). Two-phase sinks (Kafka, AMQP, NATS, a
//! Redis on another server) will add a file here, a variant of `config::SinkConfig`, and a
//! claim → publish → fenced-ack path in the poller.

pub mod redis_list;

pub use redis_list::LocalRoutes;
