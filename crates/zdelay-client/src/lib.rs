//! The producer library of zdelay: schedule jobs into Redis for `zdelay run` to deliver at
//! their millisecond, to a Redis list, Kafka, RabbitMQ or NATS.
//!
//! This crate is the producer's face of [`zdelay_core`], which the daemon shares: [`Client`]
//! and the words of its calls, nothing else. A job is a [`NewJob`] (destination, payload,
//! and optionally when, an id of your own, headers, max attempts, max lateness, a spread, a
//! unique window); [`Client::enqueue`] and [`Client::enqueue_batch`] store it under an
//! [`OnConflict`] policy, answering [`Enqueued`]; [`Client::get`] shows a [`JobView`],
//! [`Client::reschedule`] takes a [`Due`], [`Client::cancel`] answers [`Cancelled`]. Recurring
//! jobs are [`NewSchedule`]s ([`Repeat`]: cron in an IANA zone, or an interval) set with
//! [`Client::schedule_set`]. Errors are [`ClientError`]s; [`ClientError::is_retryable`] says
//! whether the same call may succeed later.
//!
//! To connect: [`Client::open`] (a URL), or [`Client::attach`] with the `[redis]` section of
//! a [`Config`] ([`load_config`]); [`Client::with_routes`] with [`Routes::from_config`] lets
//! it register a route no daemon has registered yet. The operator's calls (dead letters, the
//! schedules' internals, `reshard`, `upgrade`) and the rest of the core are under [`core`].

pub use zdelay_core as core;
pub use zdelay_core::client::{Client, ClientError, DueMoment, JobView, NewJob};
pub use zdelay_core::config::{Config, RedisConfig, load as load_config};
pub use zdelay_core::job::{Cancelled, Due, Enqueued, JobState, OnConflict};
pub use zdelay_core::routes::Routes;
pub use zdelay_core::schedules::{NewSchedule, Repeat, ScheduleSet, ScheduleView};

/// The README's examples, compiled as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
