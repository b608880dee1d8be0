//! Scratch keys: everything the bench writes, under its own namespace, deleted before and
//! after. The envelope keys of `--namespace` (with the two-phase ones a cluster uses), the
//! bare layout under `<ns>:bare`, the raw source `<ns>:raw` (and its dead keys), the output
//! list `<ns>:out`, and the registry the `--daemons` write (`{<ns>}:instances`, `:slots`,
//! `:instance_sources`, `:sinks`). DEL and EXISTS span slots on a cluster (the client splits
//! them per node and adds the answers up).

use zdelay_core::config::Push;
use zdelay_core::keys::{self, Keys, RawKeys, ShardKey};
use zdelay_core::lane::Lane;
use zdelay_core::store::{self, Conn};

pub(super) struct Scratch {
    pub(super) keys: Keys,
    pub(super) bare: Keys,
    pub(super) raw: RawKeys,
    pub(super) out: String,
    /// The bench route's lane (storage layout 2), delivering to `out`.
    pub(super) lane: Lane,
    /// The bare id ZSETs and payload HASHes the lane is compared with, in its slot: for
    /// 26-character ids and for the lane's own.
    pub(super) lane_bare: [(String, String); 2],
}

impl Scratch {
    pub(super) fn new(namespace: &str, shards: u16) -> Self {
        let out = format!("{namespace}:out");
        // The lane and its bare comparisons in the list's slot, as the registry places a lane.
        let tag = keys::slot_tag(keys::slot_of(&out));
        Scratch {
            keys: Keys::new(namespace, shards),
            bare: Keys::new(&format!("{namespace}:bare"), shards),
            raw: RawKeys::new(&format!("{namespace}:raw"), None),
            lane: Lane::new(namespace, tag, 0, super::ROUTE, &out, Push::default()),
            lane_bare: ["bare26", "bare12"].map(|kind| {
                (
                    format!("{namespace}:{{{tag}}}:{kind}_due"),
                    format!("{namespace}:{{{tag}}}:{kind}_jobs"),
                )
            }),
            out,
        }
    }

    /// The namespace's spread shards (storage layout 2).
    pub(super) fn spread(&self) -> Keys {
        Keys::new(self.keys.namespace(), self.keys.shards())
    }

    /// Every scratch key that holds data (not the schema hash).
    pub(super) fn data_keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in 0..self.keys.shards() {
            let k = &self.keys;
            out.extend([k.due(s), k.jobs(s), k.inflight(s), k.dead(s), k.reasons(s)]);
            out.extend([k.scheduled(s), k.ready(s), k.ready_ids(s)]);
            let shard = k.shard(s);
            out.extend([
                shard.schedules,
                shard.sched_env,
                shard.sched_due,
                shard.sched_fired,
                shard.sched_quarantine,
                shard.max_lateness,
                shard.history,
                shard.unique,
                shard.windows,
            ]);
            out.extend([self.bare.due(s), self.bare.jobs(s)]);
        }
        // Where `--mode upgrade` moves them: the spread shards and the lane.
        let spread = self.spread();
        for s in 0..spread.shards() {
            let k = spread.shard(s);
            let data = ShardKey::ALL
                .iter()
                .filter(|kind| **kind != ShardKey::Layout);
            out.extend(data.map(|kind| k.get(*kind).to_owned()));
            out.extend([k.transit_in, k.unique, k.windows]);
        }
        let lane = self.lane.keys.clone();
        out.extend([lane.due, lane.jobs, lane.meta, lane.maxlate, lane.large]);
        out.extend([
            lane.dead,
            lane.reasons,
            lane.history,
            lane.schedules,
            lane.sched_env,
        ]);
        out.extend([lane.sched_due, lane.sched_fired, lane.sched_quarantine]);
        out.extend([lane.transit_in, lane.flow, lane.unique, lane.windows]);
        for (due, jobs) in &self.lane_bare {
            out.extend([due.clone(), jobs.clone()]);
        }
        out.extend([
            self.raw.source.clone(),
            self.raw.dead.clone(),
            self.raw.reasons.clone(),
            self.out.clone(),
        ]);
        out
    }

    /// The daemons' bookkeeping in the namespace: registry, poller slots, sink states, the
    /// per-minute activity, the routes seen, the lane registry and the bench lane's marker (a daemon writes
    /// them at start, so they outlive the data between rounds). Not data (a stopped daemon's
    /// registration lapses by itself); deleted with the schema.
    pub(super) fn registry_keys(&self) -> Vec<String> {
        let k = &self.keys;
        vec![
            k.instances(),
            k.poller_slots(),
            k.instance_sources(),
            k.slot_plan(),
            k.sink_states(),
            k.activity(),
            k.routes_seen(),
            k.lanes(),
            self.lane.keys.marker.clone(),
        ]
    }

    /// Deletes the scratch keys (DEL, not UNLINK), then waits until the server has freed them,
    /// so `used_memory` is down again when this returns. `schema`: the schema hash and the
    /// daemons' registry too (at the start and the end of a run).
    pub(super) async fn clean(&self, con: &mut Conn, schema: bool) -> redis::RedisResult<()> {
        let mut keys = self.data_keys();
        if schema {
            keys.push(self.keys.schema());
            keys.extend(self.registry_keys());
            // A reshard or an upgrade of the scratch namespace leaves layout markers.
            keys.extend((0..self.keys.shards()).map(|s| self.keys.layout(s)));
            let spread = self.spread();
            keys.extend((0..spread.shards()).map(|s| spread.layout(s)));
        }
        for chunk in keys.chunks(64) {
            let _: () = redis::cmd("DEL").arg(chunk).query_async(con).await?;
        }
        // Valkey (8.0 and later) defaults `lazyfree-lazy-user-del` to yes: its DEL frees large
        // values in a background thread, like UNLINK, and `used_memory` drops only then. The
        // memory mode would count that freeing against the next load (Valkey 9.1: -1 B per
        // bare job). Redis' default (no) frees at once, and this returns after one INFO.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let pending = store::info(con, "memory")
                .await?
                .get("lazyfree_pending_objects")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            if pending == 0 || std::time::Instant::now() > deadline {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_keys_stay_in_the_namespace() {
        let s = Scratch::new("zdelay-bench", 2);
        for k in s.data_keys() {
            assert!(
                k.starts_with("zdelay-bench:") || k.starts_with("{zdelay-bench:"),
                "{k}"
            );
        }
        let keys = s.data_keys();
        let unique: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(unique.len(), keys.len(), "a key listed twice");
        // Per shard: five job keys, three two-phase keys, six schedule and lateness keys,
        // the death history, the unique windows' two, two bare keys, and its spread shard's
        // nineteen; then the raw source's three keys, the list, the lane's fourteen data keys,
        // its flow control state, its unique windows' two and its two bare comparisons.
        assert_eq!(keys.len(), 2 * (19 + 19) + 4 + 17 + 4);
        for k in s.registry_keys() {
            assert!(
                k.starts_with("{zdelay-bench}:")
                    || k == "zdelay-bench:lanes"
                    || k == s.lane.keys.marker,
                "{k}"
            );
        }
    }
}
