//! Dead envelope jobs where they are kept ([`Home`]): a shard's `dead`, `reasons` and
//! `history`, or a route lane's (layout 2; the payload and meta in the lane's hashes). The
//! listing, selection and bulk operations in the parent module walk homes, so both layouts
//! share them; only the scripts differ.

use super::DeadJob;
use crate::client::lanes::public_id;
use crate::envelope::{Envelope, EnvelopeError};
use crate::job::Due;
use crate::lane::Home;
use crate::store::Conn;
use crate::store::scripts::{self, DeadPeek, Replayed};

impl Home {
    /// Its key in a selection: (0, shard) or (1, lane number).
    pub(super) fn key(&self) -> (u8, u32) {
        match self {
            Home::Shard(keys) => (0, u32::from(keys.shard)),
            Home::Lane(lane) => (1, lane.number),
        }
    }

    pub(super) fn dead_key(&self) -> &str {
        match self {
            Home::Shard(keys) => &keys.dead,
            Home::Lane(lane) => &lane.keys.dead,
        }
    }

    pub(super) fn history_key(&self) -> &str {
        match self {
            Home::Shard(keys) => &keys.history,
            Home::Lane(lane) => &lane.keys.history,
        }
    }

    /// Whether every job here is for `route`'s lane, or could be for it (a shard).
    pub(super) fn may_hold_route(&self, route: &str) -> bool {
        match self {
            Home::Shard(_) => true,
            Home::Lane(lane) => lane.route == route,
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
            Home::Shard(keys) => scripts::peek_dead(con, keys, ids, preview).await,
            Home::Lane(lane) => scripts::peek_dead_lane(con, lane, ids, preview).await,
        }
    }

    /// A dead job and its envelope as far as the peek read it; `None` when it is not dead.
    pub(super) fn detail(
        &self,
        peek: DeadPeek,
    ) -> Option<(DeadJob, Option<Result<Envelope, EnvelopeError>>)> {
        let (mut job, envelope) = super::dead_detail(peek)?;
        match self {
            Home::Shard(keys) => job.shard = keys.shard,
            Home::Lane(lane) => {
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
            Home::Shard(keys) => {
                scripts::replay_dead(con, keys, due, reset_attempts, history_cap, ids).await
            }
            Home::Lane(lane) => {
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
            Home::Shard(keys) => scripts::purge_dead(con, keys, ids).await,
            Home::Lane(lane) => scripts::purge_dead_lane(con, lane, ids).await,
        }
    }

    pub(super) async fn prune_history(
        &self,
        con: &mut Conn,
        ids: &[String],
    ) -> redis::RedisResult<u64> {
        match self {
            Home::Shard(keys) => scripts::prune_history(con, keys, ids).await,
            Home::Lane(lane) => scripts::prune_history_lane(con, lane, ids).await,
        }
    }
}
