//! The lane registry of storage layout 2 (`<ns>:lanes`): reading it, and registering a local
//! route's lane with its marker.

use super::scripts::{self, LaneChange};
use super::{Conn, StoreError};
use crate::config::Push;
use crate::keys::{self, Keys};
use crate::lane::{Lane, Registry, parse_entry};
use crate::lane_id::base36;
use std::collections::BTreeMap;

/// Reads the lane registry. An entry zdelay would not write is an error naming it.
pub async fn read_registry(con: &mut Conn, keys: &Keys) -> Result<Registry, StoreError> {
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.lanes())
        .query_async(con)
        .await?;
    let mut registry = Registry::default();
    for (field, entry) in &fields {
        let Some(route) = field.strip_prefix("r:") else {
            continue;
        };
        let lane = parse_entry(keys, route, entry).ok_or_else(|| {
            StoreError::Schema(format!(
                "{} field {field} holds {entry:?}, not what zdelay writes",
                keys.lanes()
            ))
        })?;
        registry.by_route.insert(route.to_owned(), lane);
    }
    Ok(registry)
}

/// Gives the local route `route` (delivering to `list` with `push`) its lane, or confirms the
/// one it has, and writes the lane's marker. A route whose list moved to another hash slot
/// gets a new lane; while its old lane still holds jobs that is refused, since moving them
/// across slots is not built yet (nothing is changed then).
pub async fn register(
    con: &mut Conn,
    keys: &Keys,
    route: &str,
    list: &str,
    push: Push,
) -> Result<(Lane, LaneChange), StoreError> {
    let slot = keys::slot_of(list);
    let old: Option<String> = redis::cmd("HGET")
        .arg(keys.lanes())
        .arg(format!("r:{route}"))
        .query_async(con)
        .await?;
    let old = match old {
        Some(entry) => Some(parse_entry(keys, route, &entry).ok_or_else(|| {
            StoreError::Schema(format!(
                "{} field r:{route} holds {entry:?}, not what zdelay writes",
                keys.lanes()
            ))
        })?),
        None => None,
    };
    if let Some(old) = &old {
        let old_slot = keys::slot_of(&old.list);
        if old_slot != slot {
            let k = &old.keys;
            let mut pipe = redis::pipe();
            pipe.zcard(&k.due).zcard(&k.dead).zcard(&k.sched_due);
            let (due, dead, schedules): (u64, u64, u64) = pipe.query_async(con).await?;
            if due + dead + schedules > 0 {
                return Err(StoreError::Schema(format!(
                    "route {route}'s list moved from {} (slot {old_slot}) to {list} (slot {slot})                      while its lane still holds {due} waiting jobs, {dead} dead letters and                      {schedules} schedules; moving them to another slot is not built yet: point                      the route at {} again until they are gone",
                    old.list, old.list
                )));
            }
        }
    }
    let (number, change) =
        scripts::register_lane(con, &keys.lanes(), route, slot, push, list).await?;
    let number = u32::from_str_radix(&number, 36)
        .map_err(|_| StoreError::Schema(format!("{} gave lane number {number:?}", keys.lanes())))?;
    let lane = Lane::for_list(keys.namespace(), number, route, list, push);
    // Written on every registration, so a start that died after registering still ends
    // with the marker in place.
    let _: () = redis::cmd("SET")
        .arg(&lane.keys.marker)
        .arg(lane.marker())
        .query_async(con)
        .await?;
    if let (LaneChange::Moved { .. }, Some(old)) = (&change, &old) {
        let _: () = redis::cmd("SET")
            .arg(&old.keys.marker)
            .arg(format!("retired {}", base36(number)))
            .query_async(con)
            .await?;
    }
    Ok((lane, change))
}
