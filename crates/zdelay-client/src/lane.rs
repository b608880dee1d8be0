//! Route lanes (storage layout 2, being built): one local route's jobs kept in the hash slot
//! of the route's list, so the move that pushes them and removes them is one script on one
//! Redis and on a cluster alike, and knows the route from its keys instead of parsing each
//! job. See docs/internals/layout-2.md.

use crate::config::Push;
use crate::keys::{self, Keys, LaneKeys};
use crate::lane_id::base36;
use crate::store::scripts::{self, LaneChange};
use crate::store::{Conn, StoreError};
use std::collections::BTreeMap;

/// One route lane as registered: its number, the route it holds, and where it delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    /// Given out once per lane by the registry, never reused.
    pub number: u32,
    pub route: String,
    /// The list the lane's jobs are pushed onto.
    pub list: String,
    pub push: Push,
    pub keys: LaneKeys,
}

impl Lane {
    /// A lane of `route` in namespace `namespace`, its keys tagged with `tag` (the tag of the
    /// list's slot).
    pub fn new(
        namespace: &str,
        tag: &str,
        number: u32,
        route: &str,
        list: &str,
        push: Push,
    ) -> Lane {
        Lane {
            number,
            route: route.to_owned(),
            list: list.to_owned(),
            push,
            keys: LaneKeys::new(namespace, tag, route),
        }
    }

    /// The marker a live lane holds: `2 <lane> <LPUSH|RPUSH> <list key>`. Every lane script
    /// refuses a call whose expected marker differs, so a lane is delivered only as registered.
    pub fn marker(&self) -> String {
        format!(
            "2 {} {} {}",
            base36(self.number),
            self.push.command(),
            self.list
        )
    }

    /// The lane's name in wake messages: `l<lane>`.
    pub fn wake_name(&self) -> String {
        format!("l{}", base36(self.number))
    }
}

/// The lane registry as read (`<ns>:lanes`): every local route's live lane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    pub by_route: BTreeMap<String, Lane>,
}

impl Registry {
    /// The live lane numbered `number`.
    pub fn lane(&self, number: u32) -> Option<&Lane> {
        self.by_route.values().find(|l| l.number == number)
    }
}

/// One `r:<route>` entry: `<lane> local <slot> <LPUSH|RPUSH> <list key>` (the list key may
/// hold spaces: it is the rest of the line).
fn parse_entry(keys: &Keys, route: &str, entry: &str) -> Option<Lane> {
    let mut parts = entry.splitn(5, ' ');
    let number = u32::from_str_radix(parts.next()?, 36).ok()?;
    (parts.next()? == "local").then_some(())?;
    let slot: u16 = parts.next()?.parse().ok().filter(|s| *s < 16384)?;
    let push = match parts.next()? {
        "LPUSH" => Push::Lpush,
        "RPUSH" => Push::Rpush,
        _ => return None,
    };
    let list = parts.next()?;
    (keys::slot_of(list) == slot).then_some(())?;
    Some(Lane::new(
        keys.namespace(),
        keys::slot_tag(slot),
        number,
        route,
        list,
        push,
    ))
}

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
    let lane = Lane::new(
        keys.namespace(),
        keys::slot_tag(slot),
        number,
        route,
        list,
        push,
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_names_the_lane_push_and_list() {
        let lane = Lane::new("zdelay", "emj", 56, "emails", "emails-delayed", Push::Rpush);
        assert_eq!(lane.marker(), "2 1k RPUSH emails-delayed");
        assert_eq!(lane.wake_name(), "l1k");
        assert_eq!(lane.keys.due, "zdelay:{emj}:due:emails");
        assert_eq!(lane.keys.marker, "zdelay:{emj}:lane:emails");
    }
}
