//! The route table: what a job may name in `dest`, and where that leads. Shared by the
//! producer (which refuses an unknown destination at enqueue) and the daemon (whose move
//! script pushes local routes and claims two-phase ones), so both admit exactly the same
//! destinations.
//!
//! A destination is a configured route name, or `<sink>/<target>` for a Kafka, AMQP or NATS
//! sink whose `allow` globs admit the target. Local routes (a `redis` sink without `url`) are
//! pushed inside the move script; every other route is two-phase. On a Redis Cluster a
//! script touches one slot, so a local route stays exactly-once only when its list shares
//! the slot of every shard; otherwise it is delivered two-phase through the `local` sink
//! (at least once, like a remote Redis), and [`Routes::explain`] says so.

use crate::config::{Config, LOCAL_SINK, OnMissing, Push, SinkConfig};
use crate::keys::slot_of;
use std::collections::BTreeMap;
use std::fmt;

/// A route delivered inside the move script: a list on the scheduling Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalRoute {
    pub name: String,
    /// The list key due jobs are pushed to (the priority lane when configured).
    pub list: String,
    pub push: Push,
}

/// Where a two-phase job goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    pub sink: String,
    /// Kafka topic, AMQP `exchange/routing-key`, NATS subject, or remote Redis list key.
    pub target: String,
    /// AMQP message priority (the route's lane), if any.
    pub priority: Option<u8>,
    /// What a job does when the destination object is missing (`wait` for `<sink>/<target>`).
    pub on_missing: OnMissing,
}

/// What a destination resolves to.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolved<'a> {
    Local(&'a LocalRoute),
    TwoPhase(Destination),
}

/// Why a destination is refused. Its text is also the dead-letter reason of a job that
/// names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    Unknown {
        dest: String,
    },
    NotAdmitted {
        dest: String,
        sink: String,
        allow: Vec<String>,
    },
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Unknown { dest } => write!(f, "unknown destination: {dest}"),
            Refused::NotAdmitted { dest, sink, allow } => {
                write!(
                    f,
                    "destination {dest} not admitted by sinks.{sink}.allow {allow:?}"
                )
            }
        }
    }
}

impl std::error::Error for Refused {}

/// What a configuration registers in a layout-2 namespace's lane registry: every local
/// route's lane (a route lane in its list's slot, on one Redis and on a cluster alike), the
/// two-phase routes with their sinks, and the two-phase sinks. Daemons register all of it at
/// start; a producer given the config registers a destination of it the registry lacks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaneRoutes {
    pub local: Vec<LocalRoute>,
    /// Two-phase routes: (route, sink).
    pub two_phase: Vec<(String, String)>,
    /// Two-phase sinks (`<sink>/<target>` destinations file into them).
    pub sinks: Vec<String>,
}

/// What a configuration says of one destination, for its registration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LaneRoute<'a> {
    Local(&'a LocalRoute),
    /// A two-phase route: its sink.
    TwoPhase {
        route: &'a str,
        sink: &'a str,
    },
    /// `<sink>/<target>` of a two-phase sink.
    Sink(&'a str),
}

impl LaneRoutes {
    pub fn from_config(config: &Config) -> Self {
        let mut lanes = LaneRoutes::default();
        for route in &config.routes {
            match config.sinks.get(&route.sink) {
                Some(sink) if sink.is_local() => lanes.local.push(LocalRoute {
                    name: route.name.clone(),
                    list: route.list_key(),
                    push: route.push,
                }),
                Some(_) => lanes
                    .two_phase
                    .push((route.name.clone(), route.sink.clone())),
                None => {}
            }
        }
        lanes.sinks = config
            .sinks
            .iter()
            .filter(|(_, s)| !s.is_local())
            .map(|(name, _)| name.clone())
            .collect();
        lanes
    }

    /// What `dest` is in this configuration; `None` when it names none of it.
    pub fn find(&self, dest: &str) -> Option<LaneRoute<'_>> {
        if let Some(route) = self.local.iter().find(|r| r.name == dest) {
            return Some(LaneRoute::Local(route));
        }
        if let Some((route, sink)) = self.two_phase.iter().find(|(r, _)| r == dest) {
            return Some(LaneRoute::TwoPhase { route, sink });
        }
        let (sink, target) = dest.split_once('/')?;
        let sink = self.sinks.iter().find(|s| *s == sink)?;
        (!target.is_empty()).then_some(LaneRoute::Sink(sink))
    }
}

/// How [`Routes::explain`] says a route to a broker (or remote Redis) is delivered.
fn two_phase_line(name: &str, dest: &Destination) -> String {
    format!(
        "route {name}: sink {} target {}, delivered two-phase (claim, publish, broker \
         confirmation, fenced ack: at least once, idempotency key <id>:<due>)",
        dest.sink, dest.target
    )
}

/// A two-phase route with a rate or a bound: its jobs wait for their sink in a part of each
/// spread shard's ready set named `<sink>:<route>` (no sink name holds a `:`), beside the
/// sink's own part, and its publishers claim from there only what its flow hash grants
/// (`take_flow`: its rate's tokens; for a bound, the room its destination has). A held
/// route's jobs wait there, so the sink's other routes flow on.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowPart {
    pub route: String,
    pub sink: String,
    /// The destination whose depth a bound limits.
    pub target: String,
    /// The part's name in the ready set.
    pub part: String,
    /// Jobs per second and the bucket's burst, if it has a rate.
    pub rate: Option<(f64, u32)>,
    /// The most messages its destination may hold.
    pub max_length: Option<u64>,
    /// Its per-key rate: the header naming a job's key, jobs per second and burst per key.
    pub per_key: Option<(String, f64, u32)>,
}

impl FlowPart {
    /// Whether a claim asks the route's bucket or bound first (`take_flow`): a part with
    /// only a per-key rate is admitted per job, after its claim (`take_keys`).
    pub fn gated(&self) -> bool {
        self.rate.is_some() || self.max_length.is_some()
    }
}

/// The routes of one configuration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routes {
    local: Vec<LocalRoute>,
    /// Distinct list keys of the local routes, in first-use order.
    lists: Vec<String>,
    two_phase: BTreeMap<String, Destination>,
    /// Two-phase sinks and their `allow` globs.
    sinks: BTreeMap<String, Vec<String>>,
    /// Two-phase routes with a rate or a bound, by route name: their jobs wait in a part of the ready
    /// set of their own, claimed within the route's bucket.
    flow_parts: BTreeMap<String, FlowPart>,
    /// On a Redis Cluster: every local route by name (exactly-once or not), with the slots of
    /// the shards, for raw sources and `explain`. `None` on a single Redis.
    cluster: Option<ClusterLayout>,
    /// What the configuration registers on layout 2 (`None`: built without a configuration,
    /// [`Routes::names`]).
    lanes: Option<LaneRoutes>,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct ClusterLayout {
    lists: BTreeMap<String, LocalRoute>,
}

impl Routes {
    pub fn from_config(config: &Config) -> Self {
        let mut routes = Routes {
            lanes: Some(LaneRoutes::from_config(config)),
            ..Routes::default()
        };
        for (name, sink) in &config.sinks {
            if !sink.is_local() {
                routes.sinks.insert(name.clone(), sink.allow().to_vec());
            }
        }
        if !config.redis.cluster_nodes.is_empty() {
            routes.cluster = Some(ClusterLayout {
                lists: BTreeMap::new(),
            });
        }
        for route in &config.routes {
            match config.sinks.get(&route.sink) {
                Some(sink) if sink.is_local() => {
                    let local = LocalRoute {
                        name: route.name.clone(),
                        list: route.list_key(),
                        push: route.push,
                    };
                    // Its jobs are moved from its lane, in its list's slot, on a cluster too.
                    if let Some(cluster) = &mut routes.cluster {
                        cluster.lists.insert(local.name.clone(), local.clone());
                    }
                    routes.add_local(local);
                }
                Some(_) => {
                    if let Some(flow) = route.flow() {
                        routes.flow_parts.insert(
                            route.name.clone(),
                            FlowPart {
                                route: route.name.clone(),
                                sink: route.sink.clone(),
                                target: route.list_key(),
                                part: format!("{}:{}", route.sink, route.name),
                                rate: flow.rate_per_s.map(|r| (r, flow.burst)),
                                max_length: flow.max_length,
                                per_key: flow.per_key,
                            },
                        );
                    }
                    routes.two_phase.insert(
                        route.name.clone(),
                        Destination {
                            sink: route.sink.clone(),
                            target: route.list_key(),
                            priority: route.priority,
                            on_missing: route.on_missing,
                        },
                    );
                }
                None => {}
            }
        }
        // A raw source whose route's list is in another slot than the source is pushed
        // two-phase by the local sink ([`Routes::resolve_raw`]), which then needs a handle.
        if let Some(cluster) = &routes.cluster {
            let cross_slot = config.sources.iter().any(|source| {
                cluster
                    .lists
                    .get(&source.route)
                    .is_some_and(|local| slot_of(&local.list) != slot_of(&source.key))
            });
            if cross_slot {
                routes.sinks.entry(LOCAL_SINK.to_owned()).or_default();
            }
        }
        routes
    }

    /// Routes with these names only, all local lists named after themselves: for producers
    /// that know their route names but not the daemon's config.
    pub fn names(names: impl IntoIterator<Item = String>) -> Self {
        let mut routes = Routes::default();
        for name in names {
            routes.add_local(LocalRoute {
                list: name.clone(),
                name,
                push: Push::default(),
            });
        }
        routes
    }

    /// Adds a local route (the benchmark builds its table this way).
    pub fn add_local(&mut self, route: LocalRoute) {
        if !self.lists.contains(&route.list) {
            self.lists.push(route.list.clone());
        }
        self.local.push(route);
    }

    pub fn resolve(&self, dest: &str) -> Result<Resolved<'_>, Refused> {
        if let Some(route) = self.local.iter().find(|r| r.name == dest) {
            return Ok(Resolved::Local(route));
        }
        if let Some(d) = self.two_phase.get(dest) {
            return Ok(Resolved::TwoPhase(d.clone()));
        }
        let unknown = || Refused::Unknown {
            dest: dest.to_owned(),
        };
        let (sink, target) = dest.split_once('/').ok_or_else(unknown)?;
        let allow = self.sinks.get(sink).ok_or_else(unknown)?;
        if target.is_empty() || !allow.iter().any(|p| glob_match::glob_match(p, target)) {
            return Err(Refused::NotAdmitted {
                dest: dest.to_owned(),
                sink: sink.to_owned(),
                allow: allow.clone(),
            });
        }
        Ok(Resolved::TwoPhase(Destination {
            sink: sink.to_owned(),
            target: target.to_owned(),
            priority: None,
            on_missing: OnMissing::Wait,
        }))
    }

    /// How a raw source whose ZSET is `source_key` delivers to `route`: a local list is
    /// exactly-once (inside `move_raw`) when it shares the source's slot, or on a single Redis;
    /// otherwise two-phase.
    pub fn resolve_raw(&self, route: &str, source_key: &str) -> Result<Resolved<'_>, Refused> {
        let Some(cluster) = &self.cluster else {
            return self.resolve(route);
        };
        match cluster.lists.get(route) {
            Some(local) if slot_of(&local.list) == slot_of(source_key) => {
                Ok(Resolved::Local(local))
            }
            Some(local) => Ok(Resolved::TwoPhase(Destination {
                sink: LOCAL_SINK.to_owned(),
                target: local.list.clone(),
                priority: None,
                on_missing: OnMissing::Wait,
            })),
            None => self.resolve(route),
        }
    }

    /// What the configuration this table was built from registers on layout 2; `None` for a
    /// table of names only.
    pub fn lane_routes(&self) -> Option<&LaneRoutes> {
        self.lanes.as_ref()
    }

    /// Whether this table is for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// One line per route: how it is delivered, and why (for `zdelay check-config`).
    pub fn explain(&self) -> Vec<String> {
        let mut out = Vec::new();
        for route in &self.local {
            out.push(format!(
                "route {}: list {} on the scheduling Redis, moved exactly once inside the move \
                 script",
                route.name, route.list
            ));
        }
        out.extend(
            self.two_phase
                .iter()
                .map(|(name, dest)| two_phase_line(name, dest)),
        );
        out
    }

    /// What each route does: every local route, on a cluster too, is moved exactly once from
    /// its route lane in its list's slot.
    pub fn explain_lanes(&self) -> Vec<String> {
        let Some(lanes) = self.lanes.as_ref() else {
            return self.explain();
        };
        let mut out: Vec<String> = lanes
            .local
            .iter()
            .map(|route| {
                if route.push.is_stream() {
                    format!(
                        "route {}: stream {}, appended (XADD) exactly once from its route lane \
                         (in the stream's hash slot) inside the move script",
                        route.name, route.list
                    )
                } else {
                    format!(
                        "route {}: list {}, moved exactly once from its route lane (in the \
                         list's hash slot) inside the move script",
                        route.name, route.list
                    )
                }
            })
            .collect();
        out.extend(
            self.two_phase
                .iter()
                .map(|(name, dest)| two_phase_line(name, dest)),
        );
        out
    }

    /// Every route name, local and two-phase, sorted (for error messages).
    pub fn names_list(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .local
            .iter()
            .map(|r| r.name.as_str())
            .chain(self.two_phase.keys().map(String::as_str))
            .collect();
        names.sort_unstable();
        names
    }

    pub fn local(&self) -> &[LocalRoute] {
        &self.local
    }

    /// The distinct list keys of the local routes: the move script's extra KEYS.
    pub fn lists(&self) -> &[String] {
        &self.lists
    }

    /// Position of a local route's list in `lists`.
    pub fn list_index(&self, route: &LocalRoute) -> usize {
        self.lists
            .iter()
            .position(|l| *l == route.list)
            .expect("every local route's list was added with it")
    }

    /// Two-phase routes: (route name, sink name).
    pub fn two_phase_routes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.two_phase
            .iter()
            .map(|(name, d)| (name.as_str(), d.sink.as_str()))
    }

    /// Names of the two-phase sinks a job may name as `<sink>/<target>`.
    pub fn two_phase_sinks(&self) -> impl Iterator<Item = &str> {
        self.sinks.keys().map(String::as_str)
    }

    /// Two-phase routes as `move_due` queues them: (route name, part of the ready set): the
    /// sink's own part, or the route's [`FlowPart`].
    pub fn two_phase_parts(&self) -> impl Iterator<Item = (&str, &str)> {
        self.two_phase.iter().map(|(name, d)| {
            let part = self.flow_parts.get(name).map_or(&d.sink, |f| &f.part);
            (name.as_str(), part.as_str())
        })
    }

    /// Every part of the ready set jobs are queued in: the two-phase sinks, then the flow
    /// parts of routes with a rate.
    pub fn ready_parts(&self) -> impl Iterator<Item = &str> {
        self.two_phase_sinks()
            .chain(self.flow_parts.values().map(|f| f.part.as_str()))
    }

    /// The flow part named `part`, if it is one.
    pub fn flow_part(&self, part: &str) -> Option<&FlowPart> {
        self.flow_parts.values().find(|f| f.part == part)
    }

    /// The part of the ready set a job for `dest` waits in when its sink is `sink`.
    pub fn part_of<'a>(&'a self, dest: &str, sink: &'a str) -> &'a str {
        match self.flow_parts.get(dest) {
            Some(f) if f.sink == sink => &f.part,
            _ => sink,
        }
    }

    /// The sink a part of the ready set waits for (a flow part's sink, or the part itself).
    pub fn sink_of_part(part: &str) -> &str {
        part.split_once(':').map_or(part, |(sink, _)| sink)
    }

    pub fn has_two_phase(&self) -> bool {
        !self.sinks.is_empty()
    }

    /// The routes the spread shards deliver: the two-phase routes to configured sinks only
    /// (local routes have lanes; the local sink, there for raw sources, takes no spread
    /// shard's jobs).
    pub fn two_phase_only(&self) -> Routes {
        let mut routes = Routes {
            two_phase: self.two_phase.clone(),
            sinks: self.sinks.clone(),
            flow_parts: self.flow_parts.clone(),
            ..Routes::default()
        };
        routes.sinks.remove(LOCAL_SINK);
        routes
    }
}

/// A config's sink kinds, for callers that only hold a `SinkConfig`.
pub fn is_two_phase(sink: &SinkConfig) -> bool {
    !sink.is_local()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_toml;

    fn routes() -> Routes {
        Routes::from_config(
            &from_toml(
                r#"
                [sinks.other]
                kind = "redis"
                url = "redis://127.0.0.1:1"
                [sinks.bus]
                kind = "nats"
                url = "nats://127.0.0.1:4222"
                allow = ["events.*", "audit.>"]
                [[routes]]
                name = "mirror"
                sink = "other"
                target = "q"
                delayed_suffix = "-delayed"
                [[routes]]
                name = "local"
                sink = "local"
                target = "q"
                [[routes]]
                name = "b"
                sink = "local"
                target = "q"
                push = "rpush"
                [[routes]]
                name = "c"
                sink = "local"
                target = "q"
                delayed_suffix = "-delayed"
                "#,
            )
            .unwrap(),
        )
    }

    #[test]
    fn resolves_routes_and_allowed_targets() {
        let r = routes();
        assert_eq!(
            r.resolve("mirror").unwrap(),
            Resolved::TwoPhase(Destination {
                sink: "other".into(),
                target: "q-delayed".into(),
                priority: None,
                on_missing: OnMissing::Wait,
            })
        );
        let Resolved::TwoPhase(d) = r.resolve("bus/events.due").unwrap() else {
            panic!("bus/events.due is two-phase");
        };
        assert_eq!(d.target, "events.due");
        assert!(matches!(r.resolve("local"), Ok(Resolved::Local(_))));
        let refused = |dest: &str| r.resolve(dest).unwrap_err().to_string();
        assert!(refused("bus/orders.due").contains("not admitted"));
        assert!(r.resolve("bus/").is_err());
        assert_eq!(refused("nope/x"), "unknown destination: nope/x");
        assert_eq!(refused("plain"), "unknown destination: plain");
        assert_eq!(r.names_list(), ["b", "c", "local", "mirror"]);
    }

    #[test]
    fn local_routes_share_deduplicated_list_keys() {
        let r = routes();
        assert_eq!(r.lists(), ["q", "q-delayed"]);
        let Ok(Resolved::Local(b)) = r.resolve("b") else {
            panic!("b is local");
        };
        assert_eq!(b.push, Push::Rpush);
        assert_eq!(r.list_index(b), 0);
        let Ok(Resolved::Local(c)) = r.resolve("c") else {
            panic!("c is local");
        };
        assert_eq!(c.list, "q-delayed");
        assert_eq!(r.list_index(c), 1);
        assert!(r.has_two_phase());
        assert!(!Routes::names(["a".to_owned()]).has_two_phase());
    }
}
