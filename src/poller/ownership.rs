//! Shard ownership: which targets (envelope shards and raw sources) this instance polls.
//!
//! Ownership is published as a `watch` of target sets; the supervisor starts a poller for
//! every target that enters the set and stops the poller of every target that leaves it.
//! With one instance, it owns every target. Instance registration and per-shard poller-slot
//! leases (DESIGN §5) publish into the same watch, so the poller does not change when they
//! arrive.

use super::context::TargetId;
use crate::metrics::OWNED_SHARDS;
use std::collections::BTreeSet;
use tokio::sync::watch;

/// The set of targets this instance polls.
pub type Owned = BTreeSet<TargetId>;

/// The sending side: whoever decides ownership updates it.
pub struct Ownership {
    tx: watch::Sender<Owned>,
}

impl Ownership {
    /// Owns `targets` from the start (a single instance owns every target).
    pub fn new(targets: Owned) -> Self {
        let ownership = Ownership {
            tx: watch::Sender::new(Owned::new()),
        };
        ownership.set(targets);
        ownership
    }

    /// Replaces the owned set; pollers follow.
    pub fn set(&self, targets: Owned) {
        let shards = targets
            .iter()
            .filter(|t| matches!(t, TargetId::Shard(_)))
            .count();
        ::metrics::gauge!(OWNED_SHARDS).set(shards as f64);
        self.tx.send_replace(targets);
    }

    pub fn subscribe(&self) -> watch::Receiver<Owned> {
        self.tx.subscribe()
    }
}
