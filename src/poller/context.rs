//! What every poller of one daemon shares: the connection, the key layout, the route table,
//! the raw sources, the two-phase sinks, and the settings, split into what the mover needs
//! and what the delivery policy needs.

use crate::sinks::SinkHandle;
use crate::trace::HopTracer;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zdelay_core::config::{Config, Push, ScoreUnit, SourceConfig};
use zdelay_core::keys::{Keys, RawKeys};
use zdelay_core::lane::Lane;
use zdelay_core::routes::{Destination, Resolved, Routes};
use zdelay_core::store::scripts::MoveReply;
use zdelay_core::store::{self, Conn, Layout};

/// How the mover takes due jobs.
#[derive(Debug, Clone)]
pub struct MoverSettings {
    /// Jobs per script call.
    pub batch: usize,
    /// Longest sleep without a wake-up while wake-ups are not known to arrive.
    pub idle_poll: Duration,
    /// Longest sleep without a wake-up while they are (the idle poll is then a fallback).
    pub idle_poll_max: Duration,
    /// Largest payload delivered; larger ones go to dead.
    pub max_payload: usize,
    /// Envelope (or raw member) bytes one move call reads at most.
    pub batch_bytes: usize,
    /// Lateness bucket bounds passed to the scripts, ms.
    pub bounds_ms: Vec<u64>,
    /// Flow control of the routes that have any, by route name.
    pub flows: HashMap<String, zdelay_core::config::RouteFlow>,
    /// Trimming of the stream routes that have any, by route name.
    pub trims: HashMap<String, zdelay_core::config::StreamTrim>,
    /// How long before their time schedules' occurrences are written as jobs, ms.
    pub fire_ahead_ms: u64,
}

/// How two-phase jobs are claimed, and what happens to them after their sink answered.
#[derive(Debug, Clone)]
pub struct DeliveryPolicy {
    /// Jobs per claim.
    pub batch: usize,
    /// Claim deadline of two-phase jobs.
    pub lease: Duration,
    pub max_payload: usize,
    /// Envelope (or raw member) bytes one claim takes at most.
    pub batch_bytes: usize,
    /// Attempts before a job that keeps failing goes to dead (unless it sets its own).
    pub max_attempts: u32,
    pub retry_base: Duration,
    pub retry_cap: Duration,
}

impl MoverSettings {
    pub fn from_config(config: &Config) -> Self {
        let p = &config.poller;
        MoverSettings {
            batch: p.batch,
            idle_poll: p.idle_poll,
            idle_poll_max: p.idle_poll_max,
            max_payload: p.max_payload,
            batch_bytes: p.batch_bytes,
            bounds_ms: crate::metrics::LATENESS_BOUNDS_MS.to_vec(),
            flows: config
                .routes
                .iter()
                .filter_map(|r| Some((r.name.clone(), r.flow()?)))
                .collect(),
            trims: config
                .routes
                .iter()
                .filter_map(|r| Some((r.name.clone(), r.trim()?)))
                .collect(),
            fire_ahead_ms: p.fire_ahead.as_millis() as u64,
        }
    }
}

impl DeliveryPolicy {
    pub fn from_config(config: &Config) -> Self {
        let p = &config.poller;
        DeliveryPolicy {
            batch: p.batch,
            lease: p.lease,
            max_payload: p.max_payload,
            batch_bytes: p.batch_bytes,
            max_attempts: p.max_attempts,
            retry_base: p.retry_base,
            retry_cap: p.retry_cap,
        }
    }
}

/// A raw source resolved against its route.
#[derive(Debug, Clone)]
pub struct RawSource {
    pub keys: RawKeys,
    pub unit: ScoreUnit,
    pub route: String,
    pub delivery: RawDelivery,
}

/// How a raw source's members are delivered.
#[derive(Debug, Clone)]
pub enum RawDelivery {
    /// Pushed onto a list on the scheduling Redis by `move_raw`, exactly once.
    List { list: String, push: Push },
    /// Claimed by lease (`claim_raw`) and published to a two-phase sink.
    Sink(Destination),
}

impl RawSource {
    /// `None` when the source's route is not in the table (config validation prevents it).
    pub fn resolve(source: &SourceConfig, routes: &Routes) -> Option<Self> {
        let delivery = match routes.resolve_raw(&source.route, &source.key).ok()? {
            Resolved::Local(route) => RawDelivery::List {
                list: route.list.clone(),
                push: route.push,
            },
            Resolved::TwoPhase(destination) => RawDelivery::Sink(destination),
        };
        Some(RawSource {
            keys: source.keys(),
            unit: source.score_unit,
            route: source.route.clone(),
            delivery,
        })
    }
}

/// What one poller moves from.
#[derive(Debug, Clone)]
pub enum Target {
    Shard(u16),
    Source(Arc<RawSource>),
    /// A local route's lane (storage layout 2).
    Lane(Arc<Lane>),
}

/// A target's identity, as ownership hands targets out.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TargetId {
    Shard(u16),
    /// A raw source, by key.
    Source(String),
    /// A route lane, by number.
    Lane(u32),
}

/// Label of envelope shards in per-source metrics.
pub const ENVELOPE_SOURCE: &str = "jobs";

impl Target {
    pub fn id(&self) -> TargetId {
        match self {
            Target::Shard(s) => TargetId::Shard(*s),
            Target::Source(s) => TargetId::Source(s.keys.source.clone()),
            Target::Lane(lane) => TargetId::Lane(lane.number),
        }
    }

    pub fn unit(&self) -> ScoreUnit {
        match self {
            Target::Shard(_) | Target::Lane(_) => ScoreUnit::Millis,
            Target::Source(s) => s.unit,
        }
    }

    /// The `source` label of its metrics.
    pub fn label(&self) -> String {
        match self {
            Target::Shard(_) | Target::Lane(_) => ENVELOPE_SOURCE.to_owned(),
            Target::Source(s) => s.keys.source.clone(),
        }
    }
}

/// A part of the spread shards' ready set, and the sink that publishes its jobs: the sink's
/// own part, or a route's flow part (`Routes::flow_part`), claimed within its rate.
pub struct ReadyPart {
    pub name: String,
    pub sink: Arc<SinkHandle>,
    pub flow: Option<zdelay_core::routes::FlowPart>,
}

impl ReadyPart {
    /// Every part of `routes`, in `MoveReply::queued` order (`None` where its sink has no
    /// handle).
    fn all(routes: &Routes, sinks: &Sinks) -> Vec<Option<Arc<ReadyPart>>> {
        routes
            .ready_parts()
            .map(|name| {
                let sink = sinks.get(Routes::sink_of_part(name))?.clone();
                Some(Arc::new(ReadyPart {
                    name: name.to_owned(),
                    sink,
                    flow: routes.flow_part(name).cloned(),
                }))
            })
            .collect()
    }
}

/// Sees every successful move reply (the benchmark counts and times batches with it).
pub type BatchObserver = Arc<dyn Fn(&Target, &MoveReply) + Send + Sync>;

pub use crate::sinks::Sinks;

/// What every poller of one daemon shares.
pub struct PollerContext {
    /// For whatever has no lane of its own.
    pub con: Conn,
    /// A connection per target, shared by the targets of one cluster master (see
    /// [`PollerContext::connect_lanes`]); empty on one Redis.
    lanes: HashMap<TargetId, Conn>,
    pub keys: Keys,
    pub routes: Routes,
    /// Every configured raw source, resolved.
    pub sources: Vec<Arc<RawSource>>,
    /// The local routes' lanes as registered at start.
    pub route_lanes: Vec<Arc<Lane>>,
    pub sinks: Sinks,
    /// The parts of the ready set (two-phase sinks, then routes' flow parts) in the route
    /// table's order, which is the order of `MoveReply::queued` (`None` for a part whose
    /// sink has no handle here).
    pub sink_order: Vec<Option<Arc<ReadyPart>>>,
    pub mover: MoverSettings,
    pub delivery: DeliveryPolicy,
    /// Delay-hop spans of two-phase deliveries; `None` when tracing is off.
    pub tracer: Option<HopTracer>,
    /// Cancelled when a shard's layout fence refused this daemon's shard count: the
    /// namespace was resharded, or is being resharded. Its pollers stop, and so does the
    /// daemon ([`PollerContext::refusal`] says why): polling on would misroute.
    pub refused: CancellationToken,
    refused_with: std::sync::OnceLock<Layout>,
    /// Set when a lane this daemon registered lost its marker ([`PollerContext::lost_lane`]).
    lane_lost: std::sync::atomic::AtomicBool,
}

impl PollerContext {
    /// `sinks`: the two-phase sinks by name (empty when every route is local).
    pub fn new(con: Conn, config: &Config, sinks: Sinks) -> Self {
        let routes = Routes::from_config(config);
        let sources = config
            .sources
            .iter()
            .map(|s| {
                // INVARIANT: config validation admits only configured routes for sources.
                Arc::new(RawSource::resolve(s, &routes).expect("a validated source route"))
            })
            .collect();
        let sink_order = ReadyPart::all(&routes, &sinks);
        PollerContext {
            con,
            lanes: HashMap::new(),
            keys: Keys::new(&config.redis.namespace, config.redis.shards),
            routes,
            sources,
            route_lanes: Vec::new(),
            sinks,
            sink_order,
            mover: MoverSettings::from_config(config),
            delivery: DeliveryPolicy::from_config(config),
            tracer: None,
            refused: CancellationToken::new(),
            refused_with: std::sync::OnceLock::new(),
            lane_lost: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The connection `target`'s pollers and publishers use.
    pub fn con_for(&self, target: &TargetId) -> Conn {
        self.lanes.get(target).unwrap_or(&self.con).clone()
    }

    /// On a cluster, gives the targets served by one master a connection of their own:
    /// redis-rs holds every request of a cluster connection while it recovers from a failed
    /// or hung node, so with one shared connection a hung master would stall every shard.
    /// The grouping is the topology at start-up; after a failover a lane still reaches every
    /// node, only less isolated. A lane that cannot connect falls back to the shared one.
    pub async fn connect_lanes(&mut self, redis: &zdelay_core::config::RedisConfig) {
        if !self.con.is_cluster() {
            return;
        }
        let targets: Vec<(TargetId, u16)> = (0..self.keys.shards())
            .map(|s| (TargetId::Shard(s), self.keys.shard_slot(s)))
            .chain(self.sources.iter().map(|s| {
                (
                    TargetId::Source(s.keys.source.clone()),
                    zdelay_core::keys::slot_of(&s.keys.source),
                )
            }))
            .chain(self.route_lanes.iter().map(|l| {
                (
                    TargetId::Lane(l.number),
                    zdelay_core::keys::slot_of(&l.list),
                )
            }))
            .collect();
        let masters = match store::slot_masters(&mut self.con).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "no cluster topology: every shard shares one connection");
                return;
            }
        };
        let mut groups: BTreeMap<String, Vec<TargetId>> = BTreeMap::new();
        for (target, slot) in targets {
            let master = masters.master_of(slot).unwrap_or_default();
            groups.entry(master).or_default().push(target);
        }
        let connects = groups.keys().map(|_| self.con.independent(redis));
        let cons = futures::future::join_all(connects).await;
        for ((master, targets), con) in groups.into_iter().zip(cons) {
            match con {
                Ok(con) => {
                    for target in targets {
                        self.lanes.insert(target, con.clone());
                    }
                }
                Err(e) => {
                    tracing::warn!(%master, error = %e, "its shards share the common connection")
                }
            }
        }
    }

    /// Whether `e` is a layout fence's refusal; if so, records it and cancels `refused`
    /// (the caller stops its loop).
    pub fn is_refusal(&self, e: &redis::RedisError) -> bool {
        let Some(layout) = Layout::of_error(e) else {
            return false;
        };
        if self.refused_with.set(layout.clone()).is_ok() {
            if self.follows(&layout) {
                tracing::info!(
                    "{}: restarting the pollers on it",
                    refusal_message(self.keys.namespace(), self.keys.shards(), layout)
                );
            } else {
                tracing::error!(
                    "{}",
                    refusal_message(self.keys.namespace(), self.keys.shards(), layout)
                );
            }
        }
        self.refused.cancel();
        true
    }

    /// Whether a layout fence refused the pollers because `zdelay reshard` gave the spread
    /// shards another count, or a lane lost its marker: the daemon restarts its pollers.
    pub fn restarts_pollers(&self) -> bool {
        self.lane_lost.load(std::sync::atomic::Ordering::SeqCst)
            || self.refused_with.get().is_some_and(|l| self.follows(l))
    }

    /// A lane this daemon registered has no marker any more (`ZDELAY_NO_LANE`): zdelay never
    /// deletes one, so Redis lost the namespace's data (restarted empty, or flushed). Stops
    /// the pollers so that the daemon starts again as at start-up, creating the schema and
    /// registering its lanes anew; polling on would leave every lane unmoved.
    pub fn lost_lane(&self, route: &str) {
        if !self
            .lane_lost
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            tracing::warn!(
                route,
                "route lane gone without being retired (redis lost the namespace's data): \
                 registering the lanes again"
            );
        }
        self.refused.cancel();
    }

    fn follows(&self, layout: &Layout) -> bool {
        matches!(layout, Layout::Shards(_))
    }

    /// Why the pollers stopped, when a layout fence refused them.
    pub fn refusal(&self) -> Option<String> {
        let layout = self.refused_with.get()?.clone();
        Some(refusal_message(
            self.keys.namespace(),
            self.keys.shards(),
            layout,
        ))
    }

    /// The target with this identity, if it exists here.
    pub fn target(&self, id: &TargetId) -> Option<Target> {
        match id {
            TargetId::Shard(s) => (*s < self.keys.shards()).then_some(Target::Shard(*s)),
            TargetId::Source(key) => self
                .sources
                .iter()
                .find(|s| s.keys.source == *key)
                .map(|s| Target::Source(s.clone())),
            TargetId::Lane(number) => self
                .route_lanes
                .iter()
                .find(|l| l.number == *number)
                .map(|l| Target::Lane(l.clone())),
        }
    }

    /// The spread shards this daemon polls (two-phase routes' jobs).
    pub fn polled_shards(&self) -> u16 {
        self.keys.shards()
    }

    /// The spread shards (`keys`: the namespace's count, which a reshard changes under a
    /// config), which hold the two-phase jobs only, and `lanes` the local routes' lanes.
    pub fn with_lanes(&mut self, keys: Keys, lanes: Vec<Arc<Lane>>) {
        self.keys = keys;
        self.route_lanes = lanes;
        self.routes = self.routes.two_phase_only();
        self.sink_order = ReadyPart::all(&self.routes, &self.sinks);
    }

    /// Every shard, raw source and route lane: what a single instance polls.
    pub fn all_targets(&self) -> std::collections::BTreeSet<TargetId> {
        (0..self.polled_shards())
            .map(TargetId::Shard)
            .chain(
                self.sources
                    .iter()
                    .map(|s| TargetId::Source(s.keys.source.clone())),
            )
            .chain(self.route_lanes.iter().map(|l| TargetId::Lane(l.number)))
            .collect()
    }
}

/// What a daemon set up with `shards` shards says when `layout` is what the namespace has.
pub fn refusal_message(namespace: &str, shards: u16, layout: Layout) -> String {
    match layout {
        Layout::Migrating { from, to } => format!(
            "namespace {namespace} is being resharded from {from} to {to} shards (zdelay \
             reshard), so its shards refuse this daemon: start daemons again with \
             redis.shards = {to} once the reshard has finished"
        ),
        Layout::Shards(n) => format!(
            "namespace {namespace} has been resharded to {n} shards and redis.shards says \
             {shards}: set redis.shards = {n} and start the daemon again"
        ),
        // The client's words: the version to run.
        newer @ Layout::Newer { .. } => newer.error(&Keys::new(namespace, shards)).to_string(),
    }
}
