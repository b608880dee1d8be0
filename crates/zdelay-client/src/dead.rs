//! Dead letters: listing, replaying and purging dead envelope jobs and dead raw members.
//!
//! Bulk operations act on what was dead when they started (read in pages first), so a job
//! that dies again meanwhile is not replayed twice.

use crate::client::{Client, ClientError};
use crate::config::{ScoreUnit, SourceConfig};
use crate::keys::Keys;
use crate::store::scripts::{self, Replayed};
use crate::store::{self, Conn};
use std::collections::BTreeMap;

/// Ids (or members) per dead-letter script call.
const DEAD_CHUNK: usize = 1000;

/// A dead envelope job.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadJob {
    pub id: String,
    pub shard: u16,
    pub died_ms: i64,
    pub reason: String,
}

/// A dead member of a raw source.
#[derive(Debug, Clone)]
pub struct DeadMember {
    pub member: Vec<u8>,
    pub died_ms: i64,
    pub reason: String,
}

impl Client {
    /// The oldest dead jobs, at most `limit` per shard.
    pub async fn dead_list(&self, limit: usize) -> Result<Vec<DeadJob>, ClientError> {
        self.fenced(|keys| self.dead_list_in(keys, limit)).await
    }

    async fn dead_list_in(&self, layout: Keys, limit: usize) -> Result<Vec<DeadJob>, ClientError> {
        self.check_layout(&layout).await?;
        let mut con = self.con.clone();
        let mut out = Vec::new();
        for shard in 0..layout.shards() {
            let keys = layout.shard(shard);
            let entries = oldest_dead(&mut con, &keys.dead, &keys.reasons, limit).await?;
            out.extend(entries.into_iter().map(|d| DeadJob {
                id: String::from_utf8_lossy(&d.member).into_owned(),
                shard,
                died_ms: d.died_ms,
                reason: d.reason,
            }));
        }
        Ok(out)
    }

    /// Makes dead jobs due now: the given ids, or, when `ids` is empty, every job that was
    /// dead when the call started.
    pub async fn dead_replay(&self, ids: &[String]) -> Result<Replayed, ClientError> {
        self.fenced(|keys| self.dead_replay_in(keys, ids)).await
    }

    async fn dead_replay_in(&self, layout: Keys, ids: &[String]) -> Result<Replayed, ClientError> {
        let mut con = self.con.clone();
        let mut total = Replayed::default();
        for (shard, ids) in self.dead_ids_by_shard(&layout, ids).await? {
            let keys = layout.shard(shard);
            for chunk in ids.chunks(DEAD_CHUNK) {
                let r = scripts::replay_dead(&mut con, &keys, chunk).await?;
                total.replayed += r.replayed;
                total.orphans += r.orphans;
            }
        }
        Ok(total)
    }

    /// Deletes dead jobs: the given ids, or every job that was dead when the call started.
    pub async fn dead_purge(&self, ids: &[String]) -> Result<u64, ClientError> {
        self.fenced(|keys| self.dead_purge_in(keys, ids)).await
    }

    async fn dead_purge_in(&self, layout: Keys, ids: &[String]) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let mut total = 0;
        for (shard, ids) in self.dead_ids_by_shard(&layout, ids).await? {
            let keys = layout.shard(shard);
            for chunk in ids.chunks(DEAD_CHUNK) {
                total += scripts::purge_dead(&mut con, &keys, chunk).await?;
            }
        }
        Ok(total)
    }

    /// The given ids grouped by shard, or every id dead before now when `ids` is empty.
    async fn dead_ids_by_shard(
        &self,
        layout: &Keys,
        ids: &[String],
    ) -> Result<BTreeMap<u16, Vec<String>>, ClientError> {
        let mut by_shard: BTreeMap<u16, Vec<String>> = BTreeMap::new();
        if ids.is_empty() {
            self.check_layout(layout).await?;
            let mut con = self.con.clone();
            let cutoff = store::server_time_ms(&mut con).await?;
            for shard in 0..layout.shards() {
                let dead = dead_before(&mut con, &layout.dead(shard), cutoff).await?;
                if !dead.is_empty() {
                    by_shard.insert(
                        shard,
                        dead.into_iter()
                            .map(|m| String::from_utf8_lossy(&m).into_owned())
                            .collect(),
                    );
                }
            }
        } else {
            for id in ids {
                by_shard
                    .entry(layout.shard_of(id))
                    .or_default()
                    .push(id.clone());
            }
        }
        Ok(by_shard)
    }

    /// The oldest dead members of a raw source.
    pub async fn raw_dead_list(
        &self,
        source: &SourceConfig,
        limit: usize,
    ) -> Result<Vec<DeadMember>, ClientError> {
        let keys = source.keys();
        Ok(oldest_dead(&mut self.con.clone(), &keys.dead, &keys.reasons, limit).await?)
    }

    /// Puts every member that was dead when the call started back into its source, due now.
    pub async fn raw_dead_replay(&self, source: &SourceConfig) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let keys = source.keys();
        let now_ms = store::server_time_ms(&mut con).await?;
        let score = match source.score_unit {
            ScoreUnit::Millis => now_ms.to_string(),
            ScoreUnit::Seconds => format!("{:.3}", now_ms as f64 / 1000.0),
        };
        let mut total = 0;
        for chunk in dead_before(&mut con, &keys.dead, now_ms)
            .await?
            .chunks(DEAD_CHUNK)
        {
            total += scripts::replay_raw_dead(&mut con, &keys, &score, chunk).await?;
        }
        Ok(total)
    }

    /// Deletes every member of a raw source that was dead when the call started.
    pub async fn raw_dead_purge(&self, source: &SourceConfig) -> Result<u64, ClientError> {
        let mut con = self.con.clone();
        let keys = source.keys();
        let now_ms = store::server_time_ms(&mut con).await?;
        let mut total = 0;
        for chunk in dead_before(&mut con, &keys.dead, now_ms)
            .await?
            .chunks(DEAD_CHUNK)
        {
            total += scripts::purge_raw_dead(&mut con, &keys, chunk).await?;
        }
        Ok(total)
    }
}

/// The oldest `limit` members of a dead ZSET with their death time and reason, in death
/// order.
async fn oldest_dead(
    con: &mut Conn,
    dead_key: &str,
    reasons_key: &str,
    limit: usize,
) -> redis::RedisResult<Vec<DeadMember>> {
    let entries: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
        .arg(dead_key)
        .arg(0)
        .arg(limit as isize - 1)
        .arg("WITHSCORES")
        .query_async(con)
        .await?;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let members: Vec<&Vec<u8>> = entries.iter().map(|(m, _)| m).collect();
    let reasons: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(reasons_key)
        .arg(&members)
        .query_async(con)
        .await?;
    Ok(entries
        .into_iter()
        .zip(reasons)
        .map(|((member, died), reason)| DeadMember {
            member,
            died_ms: died as i64,
            reason: reason.unwrap_or_default(),
        })
        .collect())
}

/// Members of a dead ZSET that died strictly before `cutoff_ms`, read in pages before
/// anything is changed, so the set can be acted on without meeting its own re-deaths.
async fn dead_before(
    con: &mut Conn,
    key: &str,
    cutoff_ms: i64,
) -> redis::RedisResult<Vec<Vec<u8>>> {
    const PAGE: usize = 10_000;
    let mut out: Vec<Vec<u8>> = Vec::new();
    loop {
        let page: Vec<Vec<u8>> = redis::cmd("ZRANGEBYSCORE")
            .arg(key)
            .arg("-inf")
            .arg(format!("({cutoff_ms}"))
            .arg("LIMIT")
            .arg(out.len())
            .arg(PAGE)
            .query_async(con)
            .await?;
        let full = page.len() == PAGE;
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}
