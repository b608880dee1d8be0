//! Where dead envelope jobs are kept: a shard on storage layout 1, a route lane on layout 2
//! (its `dead`, `reasons` and `history` keys, the payload and meta in the lane's hashes). The
//! listing, selection and bulk operations in the parent module walk homes, so both layouts
//! share them; only the scripts differ.

use super::DeadJob;
use crate::client::lanes::public_id;
use crate::envelope::{Envelope, EnvelopeError};
use crate::job::Due;
use crate::keys::ShardKeys;
use crate::lane::Lane;
use crate::store::Conn;
use crate::store::scripts::{self, DeadPeek, Replayed};

pub(super) enum DeadHome {
    Shard(ShardKeys),
    Lane(Lane),
}

impl DeadHome {
    /// Its key in a selection: (0, shard) or (1, lane number).
    pub(super) fn key(&self) -> (u8, u32) {
        match self {
            DeadHome::Shard(keys) => (0, u32::from(keys.shard)),
            DeadHome::Lane(lane) => (1, lane.number),
        }
    }

    pub(super) fn dead_key(&self) -> &str {
        match self {
            DeadHome::Shard(keys) => &keys.dead,
            DeadHome::Lane(lane) => &lane.keys.dead,
        }
    }

    pub(super) fn history_key(&self) -> &str {
        match self {
            DeadHome::Shard(keys) => &keys.history,
            DeadHome::Lane(lane) => &lane.keys.history,
        }
    }

    /// Whether every job here is for `route`'s lane, or could be for it (a shard).
    pub(super) fn may_hold_route(&self, route: &str) -> bool {
        match self {
            DeadHome::Shard(_) => true,
            DeadHome::Lane(lane) => lane.route == route,
        }
    }

    /// Reads what listing and showing need about stored ids here (`peek_dead`).
    pub(super) async fn peek(
        &self,
        con: &mut Conn,
        ids: &[String],
        preview: usize,
    ) -> redis::RedisResult<Vec<DeadPeek>> {
        match self {
            DeadHome::Shard(keys) => scripts::peek_dead(con, keys, ids, preview).await,
            DeadHome::Lane(lane) => scripts::peek_dead_lane(con, lane, ids, preview).await,
        }
    }

    /// A dead job and its envelope as far as the peek read it; `None` when it is not dead.
    pub(super) fn detail(
        &self,
        peek: DeadPeek,
    ) -> Option<(DeadJob, Option<Result<Envelope, EnvelopeError>>)> {
        let (mut job, envelope) = super::dead_detail(peek)?;
        match self {
            DeadHome::Shard(keys) => job.shard = keys.shard,
            DeadHome::Lane(lane) => {
                job.lane = Some(lane.number);
                job.id = public_id(lane.number, &job.stored);
            }
        }
        Some((job, envelope))
    }

    pub(super) fn job(&self, peek: DeadPeek) -> Option<DeadJob> {
        self.detail(peek).map(|(job, _)| job)
    }

    pub(super) async fn replay(
        &self,
        con: &mut Conn,
        wake_channel: &str,
        due: Due,
        reset_attempts: bool,
        history_cap: usize,
        ids: &[(String, Option<f64>)],
    ) -> redis::RedisResult<Replayed> {
        match self {
            DeadHome::Shard(keys) => {
                scripts::replay_dead(con, keys, due, reset_attempts, history_cap, ids).await
            }
            DeadHome::Lane(lane) => {
                scripts::replay_dead_lane(con, lane, wake_channel, due, history_cap, ids).await
            }
        }
    }

    pub(super) async fn purge(
        &self,
        con: &mut Conn,
        ids: &[(String, Option<f64>)],
    ) -> redis::RedisResult<(u64, u64)> {
        match self {
            DeadHome::Shard(keys) => scripts::purge_dead(con, keys, ids).await,
            DeadHome::Lane(lane) => scripts::purge_dead_lane(con, lane, ids).await,
        }
    }

    pub(super) async fn prune_history(
        &self,
        con: &mut Conn,
        ids: &[String],
    ) -> redis::RedisResult<u64> {
        match self {
            DeadHome::Shard(keys) => scripts::prune_history(con, keys, ids).await,
            DeadHome::Lane(lane) => scripts::prune_history_lane(con, lane, ids).await,
        }
    }
}
