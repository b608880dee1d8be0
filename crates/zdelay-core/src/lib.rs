//! The core of zdelay, shared by the daemon (`zdelay run`, the CLI) and the producer library
//! (`zdelay-client`, a small API on top of this crate): both sides run the same code, so they
//! agree on the contract.
//!
//! [`Client`] enqueues (at a time or after a delay measured on Redis's clock, one job or
//! thousands per round trip), gets, reschedules and cancels jobs by id, and sets, pauses,
//! resumes and deletes recurring schedules. It needs no broker client: the daemon publishes.
//! The operator's calls are apart ([`operator`]): dead letters, the schedules' internals, and
//! the [`reshard`] and [`upgrade`] modules.
//!
//! The modules:
//! - [`config`]: the `zdelay.toml` shape, loading and validation;
//! - [`keys`]: the Redis key layout, the one place key names are built;
//! - [`lane`]: route lanes of storage layout 2 (their registry is in `store::lanes`);
//! - [`lane_id`]: the ids storage layout 2 generates (`~<lane>.<12 characters>`);
//! - [`envelope`]: the stored job format;
//! - [`routes`]: which destinations a job may name, and where they lead;
//! - [`store`]: the connection, the schema check, Redis's clock, and one typed function
//!   per Lua script;
//! - [`job`]: the words of the job life cycle (due, conflict policy, states);
//! - [`schedule`]: recurring schedules: the stored definition, validation, next occurrences
//!   (cron in IANA zones, intervals) and misfire handling.
//! - [`reshard`]: moving a namespace to another shard count (`zdelay reshard`; on layout 2
//!   online, [`reshard_spread`]).
//! - [`operator`]: [`operator::Operator`], the operator's calls (dead letters, schedule
//!   internals), apart from the producer's.
//! - [`schedule_requests`]: the JSON form of a schedule, and the schedule requests of
//!   producers in other languages that daemons apply.
//! - [`trace_context`]: W3C `traceparent`/`tracestate` in headers: name case, validation.

pub mod calendar;
pub mod calendars;
pub mod client;
pub mod config;
pub mod dead;
pub mod envelope;
pub mod failpoint;
pub mod job;
pub mod keys;
pub mod lane;
pub mod lane_id;
pub mod operator;
pub mod reshard;
pub mod reshard_spread;
pub mod routes;
pub mod schedule;
pub mod schedule_requests;
pub mod schedules;
pub mod store;
pub mod trace_context;
pub mod upgrade;

pub use client::{Client, ClientError, DueMoment, JobView, NewJob};

pub use config::Config;
pub use dead::{
    DeadFilter, DeadJob, DeadJobDetail, DeadMember, DeadProgress, DeadSelection, Purged,
    ReplayOptions,
};
pub use envelope::Envelope;
pub use job::{Cancelled, Due, Enqueued, JobState, OnConflict};
pub use routes::Routes;
pub use schedule::{Misfire, Plan, Recurrence, Schedule, ScheduleDef, ScheduleError};
pub use store::scripts::Replayed;
