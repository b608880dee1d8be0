//! Shard ownership: which shards this instance polls.
//!
//! One instance polls every shard. Instance registration, per-shard poller-slot leases and
//! rebalancing (DESIGN §5) will live here, behind the same `owned` answer, so the poller
//! does not change when they arrive.

use crate::metrics::OWNED_SHARDS;

/// The shards this instance polls.
#[derive(Debug, Clone)]
pub struct ShardOwnership {
    owned: Vec<u16>,
}

impl ShardOwnership {
    /// Every shard: the single-instance assignment.
    pub fn all(shards: u16) -> Self {
        metrics::gauge!(OWNED_SHARDS).set(shards as f64);
        ShardOwnership {
            owned: (0..shards).collect(),
        }
    }

    pub fn owned(&self) -> &[u16] {
        &self.owned
    }
}
