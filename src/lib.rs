//! zdelay: precise, reliable delayed delivery from Redis sorted sets to the queues a team
//! already runs. Producers enqueue with [`Client`] (or a plain `ZADD` into a configured raw
//! source); the daemon (`zdelay run`, [`app::run`]) moves due jobs onto Redis lists, one
//! atomic script per batch.

pub mod admin;
pub mod app;
pub mod bench;
pub mod client;
pub mod config;
pub mod delivery;
pub mod envelope;
pub mod keys;
pub mod metrics;
pub mod poller;
pub mod scripts;
pub mod shards;
pub mod sinks;
pub mod stats;
pub mod wake;

pub use client::{Cancelled, Client, ClientError, Due, Enqueued, JobState, NewJob, OnConflict};
pub use config::Config;
pub use envelope::Envelope;
