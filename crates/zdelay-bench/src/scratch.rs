//! Scratch keys: everything the bench writes, under its own namespace, deleted before and
//! after. The spread shards of `--namespace`, the route lanes registered in it (the bench
//! route's and any other of the config's), the bare comparisons in the bench lane's slot,
//! the raw source `<ns>:raw` (and its dead keys), the output list `<ns>:out`, the layout-1
//! shards that `--mode upgrade` loads, and the registry the daemons write
//! (`{<ns>}:instances`, `:slots`, `:instance_sources`, `:sinks`). DEL and EXISTS span slots
//! on a cluster (the client splits them per node and adds the answers up).

use zdelay_core::config::Push;
use zdelay_core::keys::{self, Keys, LaneKeys, RawKeys, ShardKey};
use zdelay_core::lane::Lane;
use zdelay_core::store::{self, Conn};

pub(super) struct Scratch {
    /// The namespace's spread shards (its two-phase routes' jobs).
    pub(super) keys: Keys,
    pub(super) raw: RawKeys,
    pub(super) out: String,
    /// The bench route's lane, delivering to `out`.
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

    /// The bare id ZSET and payload HASH for the lane's own (12-character) ids.
    pub(super) fn bare_same_ids(&self) -> (String, String) {
        self.lane_bare[1].clone()
    }

    /// The namespace's layout-1 shards (what `--mode upgrade` loads and upgrades).
    pub(super) fn layout_1(&self) -> Keys {
        self.keys.layout_1()
    }

    /// Every fixed scratch key that holds data (not the schema hash, not the lanes of routes
    /// other than the bench route's: see [`Scratch::all_data_keys`]).
    pub(super) fn data_keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        // The spread shards, and the layout-1 shards `--mode upgrade` moves from.
        for shards in [&self.keys, &self.layout_1()] {
            for s in 0..shards.shards() {
                let k = shards.shard(s);
                let data = ShardKey::ALL
                    .iter()
                    .filter(|kind| **kind != ShardKey::Layout);
                out.extend(data.map(|kind| k.get(*kind).to_owned()));
                out.extend([k.transit_in, k.unique, k.windows, k.sched_health]);
            }
        }
        out.extend(lane_data(&self.lane.keys));
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

    /// The lanes registered in the namespace other than the bench route's: the config's other
    /// local routes, `--routes`' extra ones.
    async fn other_lanes(&self, con: &mut Conn) -> Result<Vec<LaneKeys>, store::StoreError> {
        let registry = store::lanes::read_registry(con, &self.keys).await?;
        Ok(registry
            .by_route
            .into_values()
            .map(|lane| lane.keys)
            .filter(|keys| *keys != self.lane.keys)
            .collect())
    }

    /// [`Scratch::data_keys`] and the data keys of every other registered lane.
    pub(super) async fn all_data_keys(
        &self,
        con: &mut Conn,
    ) -> Result<Vec<String>, store::StoreError> {
        let mut keys = self.data_keys();
        for lane in self.other_lanes(con).await? {
            keys.extend(lane_data(&lane));
        }
        Ok(keys)
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
    pub(super) async fn clean(&self, con: &mut Conn, schema: bool) -> anyhow::Result<()> {
        let mut keys = self.data_keys();
        for lane in self.other_lanes(con).await? {
            keys.extend(lane_data(&lane));
            if schema {
                keys.push(lane.marker);
            }
        }
        if schema {
            keys.push(self.keys.schema());
            keys.extend(self.registry_keys());
            // A reshard leaves the spread shards' layout markers; a daemon's start, and an
            // upgrade, the layout-1 shards'.
            for shards in [&self.keys, &self.layout_1()] {
                keys.extend((0..shards.shards()).map(|s| shards.layout(s)));
            }
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

/// A lane's keys that hold data (not its marker, not the relocation lock).
fn lane_data(k: &LaneKeys) -> Vec<String> {
    let mut out: Vec<String> = k.held().into_iter().cloned().collect();
    out.extend([
        k.transit_in.clone(),
        k.flow.clone(),
        k.unique.clone(),
        k.windows.clone(),
        k.sched_health.clone(),
    ]);
    out
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
        // Per shard, spread and layout 1 alike: seventeen shard keys (all but the layout
        // marker), the ids in transit, the unique windows' two and the schedules' health; then
        // the raw source's three keys, the list, the lane's thirteen held keys, its ids in
        // transit, its flow control state, its unique windows' two, its schedules' health, and
        // its two bare comparisons.
        assert_eq!(keys.len(), 2 * (21 + 21) + 4 + 18 + 4);
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
