//! What a storage-layout-2 namespace `zdelay` stores, counted over its route lanes (from the
//! lane registry) and its spread shards: what the tests that counted layout 1's shard keys
//! count now.

use zdelay::keys::{Keys, LaneKeys};

/// The keys of route `route`'s lane in namespace `zdelay`, its list being `list` (the lane
/// lives in the list's hash slot).
pub fn lane_keys(route: &str, list: &str) -> LaneKeys {
    LaneKeys::new(
        "zdelay",
        zdelay::keys::slot_tag(zdelay::keys::slot_of(list)),
        route,
    )
}

/// The keys of every live lane the registry `zdelay:lanes` names.
pub fn every_lane(con: &mut dyn redis::ConnectionLike) -> Vec<LaneKeys> {
    let keys = Keys::for_layout("zdelay", 1, 2);
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
/// `inflight`, which only spread shards have) over every lane and the `shards` spread shards.
pub fn stored_total(con: &mut dyn redis::ConnectionLike, shards: u16, kind: &str) -> usize {
    let spread = Keys::for_layout("zdelay", shards, 2);
    let mut keys: Vec<String> = (0..shards)
        .map(|s| match kind {
            "due" => spread.due(s),
            "jobs" => spread.jobs(s),
            "inflight" => spread.inflight(s),
            "dead" => spread.dead(s),
            "reasons" => spread.reasons(s),
            "history" => spread.history(s),
            other => panic!("no such kind of stored key: {other}"),
        })
        .collect();
    for lane in every_lane(con) {
        match kind {
            "due" => keys.push(lane.due),
            "jobs" => keys.push(lane.jobs),
            "dead" => keys.push(lane.dead),
            "reasons" => keys.push(lane.reasons),
            "history" => keys.push(lane.history),
            _ => {}
        }
    }
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
