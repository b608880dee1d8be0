//! zdelay: precise, reliable delayed delivery from Redis sorted sets to the queues a team
//! already runs: Redis lists, Kafka, RabbitMQ (AMQP) and NATS.
//!
//! This crate is the daemon (`zdelay run`, [`app::run`]) and the CLI's commands; the
//! benchmark (`zdelay-bench`, `crates/zdelay-bench`) drives it from outside. The core —
//! [`Client`], the config, key layout, envelope, route table and the store's scripts — is
//! the `zdelay-core` crate, re-exported here; producers use `zdelay-client`, its small
//! producer face, and compile no broker client. See `docs/internals/architecture.md` for the
//! parts and which may call which.

pub mod activity;
pub mod admin;
pub mod app;
pub mod gone;
pub mod metrics;
pub mod poller;
pub mod preflight;
pub mod reference;
pub mod sinks;
pub mod startup;
pub mod stats;
pub mod trace;

pub use zdelay_core::{
    Cancelled, Client, ClientError, Config, DeadJob, DeadMember, Due, Enqueued, Envelope, JobState,
    JobView, NewJob, OnConflict, Replayed, Routes,
};
pub use zdelay_core::{
    calendar, calendars, client, config, dead, envelope, job, keys, lane, lane_id, operator,
    reshard, reshard_spread, routes, schedule, schedule_requests, schedules, store, trace_context,
    upgrade,
};

#[cfg(test)]
mod tests {
    /// A namespace's `min_version` is compared with the core's version, and users run
    /// the daemon's: the two must be one.
    #[test]
    fn the_daemon_and_the_client_share_one_version() {
        assert_eq!(zdelay_core::store::VERSION, env!("CARGO_PKG_VERSION"));
    }
}
