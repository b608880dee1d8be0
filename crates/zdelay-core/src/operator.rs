//! The operator's calls, apart from the producer's. A producer needs only [`Client`]: enqueue,
//! cancel, reschedule and read jobs; set, pause, resume, delete and read schedules. An
//! operator (the CLI, the console, a runbook script) takes [`Client::operator`] for dead
//! letters (list, show, replay, purge; raw sources' too) and the schedules' internals
//! (listing in firing order, idle and quarantined ones, counts, run now); `zdelay reshard`
//! and `zdelay upgrade` are [`crate::reshard`] and [`crate::upgrade`].

use crate::client::Client;

/// A [`Client`] for operators' calls (cheap to clone, sharing the client's connection and
/// layout); every producer call is there too.
#[derive(Clone)]
pub struct Operator {
    client: Client,
}

impl Client {
    /// The operator's calls on this client's connection.
    pub fn operator(&self) -> Operator {
        Operator {
            client: self.clone(),
        }
    }
}

impl std::ops::Deref for Operator {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}
