//! What a storage-layout-2 namespace `zdelay` stores, counted over its route lanes (from the
//! lane registry) and its spread shards: what the tests that counted layout 1's shard keys
//! count now.

use zdelay::keys::{Keys, LaneKeys};

/// The keys of every live lane the registry `zdelay:lanes` names.
pub fn every_lane(con: &mut dyn redis::ConnectionLike) -> Vec<LaneKeys> {
    let keys = Keys::new("zdelay", 1);
    let fields: std::collections::BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.lanes())
        .query(con)
        .expect("HGETALL the lane registry");
    fields
        .iter()
        .filter_map(|(field, entry)| {
            let route = field.strip_prefix("r:")?;
            Some(
                zdelay::lane::parse_entry(&keys, route, entry)
                    .unwrap_or_else(|| panic!("registry entry {field} = {entry:?}"))
                    .keys,
            )
        })
        .collect()
}

/// The total size of one kind of key (`due`, `jobs`, `dead`, `reasons`, `history`, and
/// `inflight`, which only spread shards have) over every lane the registry names, live or
/// retired, and every spread shard the schema counts. Cluster-safe: no `KEYS`.
pub fn stored_total(con: &mut dyn redis::ConnectionLike, kind: &str) -> usize {
    let shards: Option<u16> = redis::cmd("HGET")
        .arg("zdelay:schema")
        .arg("shards")
        .query(con)
        .expect("HGET the schema");
    let mut keys = shard_keys(&Keys::new("zdelay", shards.unwrap_or(1)), kind);
    for lane in every_lane(con).into_iter().chain(retired_lanes(con)) {
        match kind {
            "due" => keys.push(lane.due),
            "jobs" => keys.push(lane.jobs),
            "dead" => keys.push(lane.dead),
            "reasons" => keys.push(lane.reasons),
            "history" => keys.push(lane.history),
            _ => {}
        }
    }
    size_of(con, &keys, kind)
}

/// The key of one kind (`due`, `jobs`, `inflight`, `ready`, `dead`, `reasons`, `history`) of
/// every shard of `keys` (layout 1's shards, or layout 2's spread shards).
pub fn shard_keys(keys: &Keys, kind: &str) -> Vec<String> {
    (0..keys.shards())
        .map(|s| match kind {
            "due" => keys.due(s),
            "jobs" => keys.jobs(s),
            "inflight" => keys.inflight(s),
            "ready" => keys.ready(s),
            "dead" => keys.dead(s),
            "reasons" => keys.reasons(s),
            "history" => keys.history(s),
            other => panic!("no such kind of stored key: {other}"),
        })
        .collect()
}

/// The summed size of `keys`, each a HASH (`jobs`, `reasons`, `history`) or a ZSET.
pub fn size_of(con: &mut dyn redis::ConnectionLike, keys: &[String], kind: &str) -> usize {
    let cmd = if matches!(kind, "jobs" | "reasons" | "history") {
        "HLEN"
    } else {
        "ZCARD"
    };
    keys.iter()
        .map(|key| {
            redis::cmd(cmd)
                .arg(key)
                .query::<usize>(con)
                .expect("stored key size")
        })
        .sum()
}

/// The keys of every retired lane the registry `zdelay:lanes` names (`#<lane>` →
/// `<route> <slot> retired`).
fn retired_lanes(con: &mut dyn redis::ConnectionLike) -> Vec<LaneKeys> {
    let fields: std::collections::BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("zdelay:lanes")
        .query(con)
        .expect("HGETALL the lane registry");
    fields
        .iter()
        .filter(|(field, _)| field.starts_with('#'))
        .filter_map(|(_, entry)| zdelay::lane::parse_retired(entry))
        .map(|retired| retired.keys("zdelay"))
        .collect()
}
