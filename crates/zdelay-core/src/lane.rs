//! Route lanes (storage layout 2, being built): one local route's jobs kept in the hash slot
//! of the route's list, so the move that pushes them and removes them is one script on one
//! Redis and on a cluster alike, and knows the route from its keys instead of parsing each
//! job. See docs/internals/layout-2.md.

use crate::config::Push;
use crate::keys::{self, Keys, LaneKeys};
use crate::lane_id::base36;
use std::collections::BTreeMap;

/// One route lane as registered: its number, the route it holds, and where it delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    /// Given out once per lane by the registry, never reused.
    pub number: u32,
    pub route: String,
    /// The list the lane's jobs are pushed onto (the stream, for `XADD`).
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

    /// A lane of `route` onto `list`, its keys in the list's hash slot (tagged with the
    /// slot's `slot_tag`): what the registry places.
    pub fn for_list(namespace: &str, number: u32, route: &str, list: &str, push: Push) -> Lane {
        let tag = keys::slot_tag(keys::slot_of(list));
        Lane::new(namespace, tag, number, route, list, push)
    }

    /// The marker a live lane holds: `2 <lane> <LPUSH|RPUSH|XADD> <list key>`. Every lane script
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

/// Where jobs, their dead letters and schedules are kept: a shard (layout 1's, or one of
/// layout 2's spread shards), or a route lane (layout 2). The dead-letter and schedule code
/// walk homes, so both layouts share it; each adds its own methods.
#[derive(Debug, Clone)]
pub enum Home {
    Shard(crate::keys::ShardKeys),
    Lane(Lane),
}

/// The lane registry as read (`<ns>:lanes`): every local route's live lane, and the two-phase
/// routes and sinks whose jobs go to the spread shards.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registry {
    pub by_route: BTreeMap<String, Lane>,
    /// Two-phase routes (`t:<route>` → its sink).
    pub two_phase: BTreeMap<String, String>,
    /// Two-phase sinks (`s:<sink>`): `<sink>/<target>` destinations go to the spread shards.
    pub sinks: std::collections::BTreeSet<String>,
    /// Retired lanes (`#<lane>` → `<route> <slot> retired`): their route's list moved to
    /// another slot. Their jobs are relocated into the route's live lane under the same
    /// stored ids, so a generated id naming one is looked for there.
    pub retired: BTreeMap<u32, RetiredLane>,
}

/// A lane whose route's list moved to another slot: where its keys are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetiredLane {
    pub route: String,
    pub slot: u16,
}

impl RetiredLane {
    /// The retired lane's keys (a lane's keys follow from its route and slot).
    pub fn keys(&self, namespace: &str) -> LaneKeys {
        LaneKeys::new(namespace, keys::slot_tag(self.slot), &self.route)
    }
}

impl Registry {
    /// Whether `dest` is delivered two-phase: a registered two-phase route, or
    /// `<sink>/<target>` with a registered two-phase sink.
    pub fn is_two_phase(&self, dest: &str) -> bool {
        self.two_phase.contains_key(dest)
            || dest
                .split_once('/')
                .is_some_and(|(sink, target)| !target.is_empty() && self.sinks.contains(sink))
    }

    /// The live lane numbered `number`.
    pub fn lane(&self, number: u32) -> Option<&Lane> {
        self.by_route.values().find(|l| l.number == number)
    }

    /// Where the jobs of lane `number` are: the lane itself while live, its route's live lane
    /// once retired (the relocation keeps stored ids).
    pub fn successor(&self, number: u32) -> Option<&Lane> {
        self.lane(number).or_else(|| {
            let retired = self.retired.get(&number)?;
            self.by_route.get(&retired.route)
        })
    }

    /// The retired lanes of `route` whose keys are not its live lane's (a route whose list
    /// moved back to a slot it had is live there again): where jobs not yet relocated wait.
    pub fn retired_of<'a>(&'a self, route: &'a str) -> impl Iterator<Item = &'a RetiredLane> {
        let live_slot = self.by_route.get(route).map(|l| keys::slot_of(&l.list));
        self.retired
            .values()
            .filter(move |r| r.route == route && Some(r.slot) != live_slot)
    }
}

/// One `#<lane>` entry of a retired lane: `<route> <slot> retired` (the route may hold
/// spaces); `None` for a live one or an entry zdelay would not write.
pub fn parse_retired(entry: &str) -> Option<RetiredLane> {
    let mut words = entry.rsplitn(3, ' ');
    (words.next()? == "retired").then_some(())?;
    let slot = words
        .next()?
        .parse::<u16>()
        .ok()
        .filter(|s| *s < keys::SLOTS)?;
    let route = words.next()?;
    Some(RetiredLane {
        route: route.to_owned(),
        slot,
    })
}

/// One `r:<route>` entry: `<lane> local <slot> <LPUSH|RPUSH|XADD> <list key>` (the list key may
/// hold spaces: it is the rest of the line).
pub fn parse_entry(keys: &Keys, route: &str, entry: &str) -> Option<Lane> {
    let mut parts = entry.splitn(5, ' ');
    let number = crate::lane_id::parse_base36(parts.next()?)?;
    (parts.next()? == "local").then_some(())?;
    let slot: u16 = parts.next()?.parse().ok().filter(|s| *s < 16384)?;
    let push = Push::from_command(parts.next()?)?;
    let list = parts.next()?;
    (keys::slot_of(list) == slot).then_some(())?;
    Some(Lane::for_list(keys.namespace(), number, route, list, push))
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

    #[test]
    fn a_stream_lane_reads_back_from_its_registry_entry() {
        let keys = Keys::new("zdelay", 16);
        let slot = keys::slot_of("events");
        let lane = parse_entry(&keys, "s", &format!("1k local {slot} XADD events"))
            .expect("an XADD entry");
        assert_eq!(lane.push, Push::Xadd);
        assert_eq!(lane.marker(), "2 1k XADD events");
        assert_eq!(
            parse_entry(&keys, "s", &format!("1k local {slot} SADD events")),
            None
        );
    }
}
