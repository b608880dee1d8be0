//! Backlog statistics per shard and raw source: due now, scheduled later, in flight, dead,
//! oldest overdue age. One pipeline per call, "now" from Redis TIME. Used by `zdelay stats`
//! and by the daemon's low-rate sampler (never by the hot loop).

use crate::metrics::{
    DEAD, DUE_BACKLOG, INFLIGHT, OLDEST_DUE_AGE, ROUTE_HELD, SCHEDULED, SINK_OLDEST_WAITING,
    SINK_WAITING,
};
use crate::poller::{self, TargetId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};
use zdelay_core::config::{Config, LOCAL_SINK, RouteConfig, ScoreUnit};
use zdelay_core::keys::Keys;
use zdelay_core::lane::Lane;
use zdelay_core::routes::Routes;
use zdelay_core::store::{Conn, scripts};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Backlog {
    /// `shard N`, the raw source key, or the route of a route lane.
    pub name: String,
    pub due_now: u64,
    pub scheduled: u64,
    pub inflight: u64,
    pub dead: u64,
    /// How long the oldest due job has waited, ms; 0 when none is due.
    pub oldest_due_age_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub now_ms: i64,
    pub shards: Vec<Backlog>,
    pub sources: Vec<Backlog>,
    /// On storage layout 2, one per route lane (named by its route); its layout-1 shards
    /// hold nothing and are not listed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lanes: Vec<Backlog>,
    /// Two-phase sinks as the daemons last saw them (`<ns>:sinks`); empty when none.
    pub sinks: Vec<SinkState>,
    /// Jobs due and waiting for each two-phase sink (its part of the shards' ready sets), as
    /// found in Redis: sinks that are not configured (any more) included.
    pub waiting: Vec<SinkWaiting>,
    /// The daemons registered on the namespace and the targets each one polls.
    pub instances: Vec<Instance>,
    /// Routes with flow control (a `rate` or a `max_length`, storage layout 2), local and
    /// two-phase: whether each holds back due work now, and since when.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flow: Vec<RouteFlowState>,
}

/// A flow-controlled route as its flow state says (its lane's, or a two-phase route's
/// `take_flow` hash).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RouteFlowState {
    pub route: String,
    pub rate: Option<String>,
    pub max_length: Option<u64>,
    /// The per-key rate: the header naming a job's key, and the rate each key gets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_header: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_rate: Option<String>,
    /// Since when the route holds back due work (Redis ms); `None`: flowing.
    pub held_since_ms: Option<i64>,
    /// What holds it: `"rate"` or `"max_length"`; `None`: flowing.
    pub held_by: Option<String>,
}

/// A daemon registered on the namespace (poller-slot heartbeat).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Instance {
    pub id: String,
    /// Shards it polls now (holds an unexpired poller slot of).
    pub shards: Vec<u16>,
    /// Raw sources it polls now.
    pub sources: Vec<String>,
    /// Its last heartbeat, epoch ms (Redis clock).
    pub last_seen_ms: i64,
    /// The zdelay version it runs (`None`: a build from before daemons registered it).
    pub version: Option<String>,
}

/// The jobs waiting for one two-phase sink, over every shard.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SinkWaiting {
    pub sink: String,
    pub jobs: u64,
    /// How long the oldest of them has been due, ms; 0 when none waits.
    pub oldest_age_ms: u64,
    /// Whether the config names this sink as a two-phase sink. Jobs of a sink that is not
    /// configured wait until a daemon's mover refiles them by their route now.
    pub configured: bool,
}

/// A two-phase sink's last health check by a daemon.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct SinkState {
    #[serde(default)]
    pub name: String,
    pub kind: String,
    pub up: bool,
    pub error: Option<String>,
    /// When it was checked, epoch ms (the daemon's clock).
    pub at: u64,
    /// Targets whose destination object is missing (their jobs wait), with the reason.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub held: std::collections::BTreeMap<String, String>,
}

impl Stats {
    pub fn total(&self) -> Backlog {
        let mut t = Backlog {
            name: "total".into(),
            due_now: 0,
            scheduled: 0,
            inflight: 0,
            dead: 0,
            oldest_due_age_ms: 0,
        };
        for b in self.shards.iter().chain(&self.sources).chain(&self.lanes) {
            t.due_now += b.due_now;
            t.scheduled += b.scheduled;
            t.inflight += b.inflight;
            t.dead += b.dead;
            t.oldest_due_age_ms = t.oldest_due_age_ms.max(b.oldest_due_age_ms);
        }
        t
    }
}

/// Gathers the backlog of every shard and configured raw source.
pub async fn gather(con: &mut Conn, config: &Config) -> redis::RedisResult<Stats> {
    gather_sampled(con, config, None).await
}

/// [`gather`] for the daemon's sampler, which only probes a route lane that was empty when
/// last read ([`LaneSampler`]).
pub async fn gather_sampled(
    con: &mut Conn,
    config: &Config,
    mut sampler: Option<&mut LaneSampler>,
) -> redis::RedisResult<Stats> {
    let (keys, route_lanes) = read_layout(con, config, sampler.as_deref_mut()).await?;
    let now_ms = con.now_ms().await?;
    let lanes = match sampler {
        None => lane_backlogs(con, &route_lanes, now_ms).await?,
        Some(sampler) => {
            let (mut read, probed, quiet) = sampler.split(&route_lanes);
            let holding = lanes_holding(con, &probed).await?;
            // Lanes no wake-up named since stay empty without a look.
            let mut empty = Vec::new();
            for (lane, holds) in probed
                .into_iter()
                .zip(holding)
                .chain(quiet.into_iter().map(|l| (l, false)))
            {
                if holds {
                    read.push(lane);
                } else {
                    empty.push(Backlog {
                        name: lane.route,
                        due_now: 0,
                        scheduled: 0,
                        inflight: 0,
                        dead: 0,
                        oldest_due_age_ms: 0,
                    });
                }
            }
            let fresh = lane_backlogs(con, &read, now_ms).await?;
            sampler.remember(&fresh);
            let mut all: Vec<Backlog> = fresh.into_iter().chain(empty).collect();
            all.sort_by(|a, b| a.name.cmp(&b.name));
            all
        }
    };
    let routes = Routes::from_config(config);
    let sink_names: Vec<String> = routes.two_phase_sinks().map(str::to_owned).collect();
    // One pipeline per slot (a shard's keys, a source, a source's dead set), so it runs on a
    // Redis Cluster too; all of them at once. The sinks waiting in each shard's ready set, as
    // found there, come from one script call per shard.
    let mut pipes = Vec::new();
    for shard in 0..keys.shards() {
        let mut pipe = redis::pipe();
        add_zset_queries(&mut pipe, &keys.due(shard), now_ms as f64);
        pipe.zcard(keys.inflight(shard)).zcard(keys.dead(shard));
        pipes.push(pipe);
    }
    for source in &config.sources {
        let max = match source.score_unit {
            ScoreUnit::Millis => now_ms as f64,
            ScoreUnit::Seconds => now_ms as f64 / 1000.0,
        };
        let mut pipe = redis::pipe();
        add_zset_queries(&mut pipe, &source.key, max);
        pipes.push(pipe);
        let mut pipe = redis::pipe();
        pipe.zcard(source.keys().dead);
        pipes.push(pipe);
    }
    let queries = futures::future::join_all(pipes.iter().map(|pipe| {
        let mut con = con.clone();
        async move { pipe.query_async::<Vec<redis::Value>>(&mut con).await }
    }));
    let ready = futures::future::join_all((0..keys.shards()).map(|shard| {
        let (mut con, keys) = (con.clone(), keys.shard(shard));
        async move { scripts::ready_sinks(&mut con, &keys).await }
    }));
    let (replies, ready) = futures::future::join(queries, ready).await;
    // The plain commands' errors first: they name what is refused (an ACL says "no
    // permissions to run the 'zcard' command"; a script only that it may not).
    let replies = replies.into_iter().collect::<Result<Vec<_>, _>>()?;
    let ready = ready.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut it = replies.into_iter().flatten();
    let mut shards = Vec::new();
    let mut waiting: BTreeMap<String, SinkWaiting> = sink_names
        .iter()
        .map(|sink| {
            let w = SinkWaiting {
                sink: sink.clone(),
                jobs: 0,
                oldest_age_ms: 0,
                configured: true,
            };
            (sink.clone(), w)
        })
        .collect();
    for (shard, found) in (0..keys.shards()).zip(ready) {
        let (due_now, total, head) = read_zset_queries(&mut it)?;
        let inflight = redis::from_redis_value(it.next().unwrap_or_default())?;
        let dead = redis::from_redis_value(it.next().unwrap_or_default())?;
        let mut oldest_due_age_ms = age(now_ms, head, ScoreUnit::Millis);
        let mut waiting_here = 0;
        for r in found {
            let oldest_age_ms = age(now_ms, r.oldest_due_ms.map(|d| d as f64), ScoreUnit::Millis);
            // A route's flow part counts with its sink.
            let sink = match routes.flow_part(&r.sink) {
                Some(part) => part.sink.clone(),
                None => r.sink.clone(),
            };
            let entry = waiting.entry(sink.clone()).or_insert_with(|| SinkWaiting {
                sink,
                jobs: 0,
                oldest_age_ms: 0,
                configured: false,
            });
            entry.jobs += r.jobs;
            entry.oldest_age_ms = entry.oldest_age_ms.max(oldest_age_ms);
            waiting_here += r.jobs;
            oldest_due_age_ms = oldest_due_age_ms.max(oldest_age_ms);
        }
        shards.push(Backlog {
            name: format!("shard {shard}"),
            // Jobs waiting for their sink are due and not delivered either.
            due_now: due_now + waiting_here,
            scheduled: total - due_now,
            inflight,
            dead,
            oldest_due_age_ms,
        });
    }
    let mut sources = Vec::new();
    for source in &config.sources {
        let (due_now, total, head) = read_zset_queries(&mut it)?;
        let dead = redis::from_redis_value(it.next().unwrap_or_default())?;
        sources.push(Backlog {
            name: source.key.clone(),
            due_now,
            scheduled: total - due_now,
            inflight: 0,
            dead,
            oldest_due_age_ms: age(now_ms, head, source.score_unit),
        });
    }
    let raw_states: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(keys.sink_states())
        .query_async(con)
        .await?;
    let sinks = raw_states
        .into_iter()
        .filter(|(name, _)| config.sinks.contains_key(name))
        .filter_map(|(name, json)| {
            let mut state: SinkState = serde_json::from_str(&json).ok()?;
            state.name = name;
            Some(state)
        })
        .collect();
    let instances = instances(con, &keys, now_ms).await?;
    let mut flow = flow_states(con, config, &route_lanes).await?;
    flow.extend(two_phase_flow_states(con, config, &keys).await?);
    Ok(Stats {
        now_ms,
        shards,
        sources,
        lanes,
        sinks,
        waiting: waiting.into_values().collect(),
        instances,
        flow,
    })
}

/// The flow state of each route lane whose route has flow control: one `HMGET` each.
async fn flow_states(
    con: &mut Conn,
    config: &Config,
    lanes: &[Lane],
) -> redis::RedisResult<Vec<RouteFlowState>> {
    let mut out = Vec::new();
    for lane in lanes {
        let Some(route) = config
            .routes
            .iter()
            .find(|r| r.name == lane.route && r.flow().is_some())
        else {
            continue;
        };
        let (held, by): (Option<i64>, Option<String>) = redis::cmd("HMGET")
            .arg(&lane.keys.flow)
            .arg("held_since")
            .arg("held_by")
            .query_async(con)
            .await?;
        let by = held.map(|_| by.unwrap_or_else(|| held_by_default(route)));
        out.push(RouteFlowState {
            route: route.name.clone(),
            rate: route.rate.clone(),
            max_length: route.max_length,
            key_header: route.key_header.clone(),
            key_rate: route.key_rate.clone(),
            held_since_ms: held,
            held_by: by,
        });
    }
    Ok(out)
}

/// The flow state of each two-phase route with flow control (storage layout 2): held since
/// the earliest hold of its part in any spread shard (`take_flow`), one `HGETALL` each.
async fn two_phase_flow_states(
    con: &mut Conn,
    config: &Config,
    keys: &Keys,
) -> redis::RedisResult<Vec<RouteFlowState>> {
    let mut out = Vec::new();
    for route in &config.routes {
        if route.sink == LOCAL_SINK || route.flow().is_none() {
            continue;
        }
        let fields: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(keys.route_flow(&route.name))
            .query_async(con)
            .await?;
        let earliest = fields
            .iter()
            .filter_map(|(field, value)| {
                let shard = field.strip_prefix('h')?;
                Some((value.parse::<i64>().ok()?, shard))
            })
            .min();
        out.push(RouteFlowState {
            route: route.name.clone(),
            rate: route.rate.clone(),
            max_length: route.max_length,
            key_header: route.key_header.clone(),
            key_rate: route.key_rate.clone(),
            held_since_ms: earliest.map(|(since, _)| since),
            held_by: earliest.map(|(_, shard)| {
                fields
                    .get(&format!("b{shard}"))
                    .cloned()
                    .unwrap_or_else(|| held_by_default(route))
            }),
        });
    }
    Ok(out)
}

/// What holds a route whose hold an older build began, naming no cause: its only limit,
/// else its rate.
fn held_by_default(route: &RouteConfig) -> String {
    match (&route.rate, route.max_length) {
        (None, Some(_)) => "max_length".to_owned(),
        _ => "rate".to_owned(),
    }
}

/// The keys whose shards hold jobs, and the route lanes: on storage layout 2 the spread
/// shards (two-phase jobs) and every registered lane; on layout 1 the configured shards and
/// no lane.
async fn read_layout(
    con: &mut Conn,
    config: &Config,
    mut sampler: Option<&mut LaneSampler>,
) -> redis::RedisResult<(Keys, Vec<Lane>)> {
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    // While `zdelay upgrade` runs (`upgrading`), new work goes to layout 2: show that.
    let (layout, upgrading, shards): (Option<String>, Option<String>, Option<u16>) = redis::pipe()
        .hget(keys.schema(), "layout")
        .hget(keys.schema(), "upgrading")
        .hget(keys.schema(), "shards")
        .query_async(con)
        .await?;
    if upgrading.or(layout).as_deref() != Some("2") {
        return Ok((keys, Vec::new()));
    }
    // Layout 2's spread shards have the namespace's count (`zdelay reshard` changes it online).
    let keys = keys.with_shards(shards.unwrap_or(keys.shards()));
    // Another slot than the schema's: a command of its own on a cluster.
    let fields: usize = redis::cmd("HLEN")
        .arg(keys.lanes())
        .query_async(con)
        .await?;
    let spread = Keys::new(keys.namespace(), keys.shards());
    // The registry only grows when a route registers or a lane moves (a field is added): the
    // sampler reads it whole again only then.
    if let Some((known, lanes)) = sampler.as_ref().and_then(|s| s.registry.as_ref())
        && *known == fields
    {
        return Ok((spread, lanes.clone()));
    }
    let registry = match zdelay_core::store::lanes::read_registry(con, &keys).await {
        Ok(registry) => registry,
        Err(zdelay_core::store::StoreError::Redis(e)) => return Err(e),
        Err(other) => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "lane registry",
                other.to_string(),
            )));
        }
    };
    let lanes: Vec<Lane> = registry.by_route.into_values().collect();
    if let Some(sampler) = sampler.as_mut() {
        sampler.registry = Some((fields, lanes.clone()));
    }
    Ok((spread, lanes))
}

/// What the daemon's sampler last read of each route lane: an empty one is only asked
/// whether it still is (one `EXISTS` of its due and dead sets, which Redis deletes when they
/// empty) instead of read whole (four commands): with 1,000 idle routes the full reads were
/// most of an idle daemon's cost to Redis.
#[derive(Debug, Default)]
pub struct LaneSampler {
    /// Route → whether its lane was empty when last read.
    empty: HashMap<String, bool>,
    /// The registry's field count and lanes when last read.
    registry: Option<(usize, Vec<Lane>)>,
    /// The lanes wake-ups named since the last sample (`None`: unknown, probe them all).
    written: Option<HashSet<u32>>,
    /// When the empty lanes were last all probed, whatever the wake-ups said.
    probed_all: Option<Instant>,
}

/// How long an empty lane with no wake-up goes unprobed at most: what a write whose wake-up
/// was lost can stay unseen in the gauges (the lane's mover has a fallback poll of its own).
const PROBE_ALL_EVERY: Duration = Duration::from_secs(60);

impl LaneSampler {
    /// What the wake-ups say was written since the last sample.
    pub fn written(&mut self, lanes: Option<HashSet<u32>>) {
        self.written = lanes;
    }

    /// The lanes to read whole (unknown, or not empty when last read), those to probe (empty
    /// when last read, and written since as far as wake-ups tell), and those left as they
    /// were (empty, no wake-up: every lane write publishes one).
    fn split(&mut self, lanes: &[Lane]) -> (Vec<Lane>, Vec<Lane>, Vec<Lane>) {
        let probe_all = self.written.is_none()
            || self
                .probed_all
                .is_none_or(|at| at.elapsed() >= PROBE_ALL_EVERY);
        if probe_all {
            self.probed_all = Some(Instant::now());
        }
        let (mut read, mut probe, mut quiet) = (Vec::new(), Vec::new(), Vec::new());
        for lane in lanes {
            if self.empty.get(&lane.route) != Some(&true) {
                read.push(lane.clone());
            } else if probe_all
                || self
                    .written
                    .as_ref()
                    .is_some_and(|w| w.contains(&lane.number))
            {
                probe.push(lane.clone());
            } else {
                quiet.push(lane.clone());
            }
        }
        (read, probe, quiet)
    }

    fn remember(&mut self, read: &[Backlog]) {
        for b in read {
            let empty = b.due_now == 0 && b.scheduled == 0 && b.dead == 0;
            self.empty.insert(b.name.clone(), empty);
        }
    }
}

/// Whether each lane holds anything (its due or dead set exists). On one Redis one `EXISTS`
/// of every lane's keys answers first for all (idle lanes are the common case); on a cluster,
/// whose keys span slots, or when some lane holds something, one per lane.
async fn lanes_holding(con: &mut Conn, lanes: &[Lane]) -> redis::RedisResult<Vec<bool>> {
    if !con.is_cluster() && !lanes.is_empty() {
        let mut all = redis::cmd("EXISTS");
        for lane in lanes {
            all.arg(&lane.keys.due).arg(&lane.keys.dead);
        }
        if all.query_async::<u64>(con).await? == 0 {
            return Ok(vec![false; lanes.len()]);
        }
    }
    let probes = lanes.iter().map(|lane| {
        let mut con = con.clone();
        async move {
            let n: u64 = redis::cmd("EXISTS")
                .arg(&lane.keys.due)
                .arg(&lane.keys.dead)
                .query_async(&mut con)
                .await?;
            Ok::<_, redis::RedisError>(n > 0)
        }
    });
    futures::future::try_join_all(probes).await
}

/// The backlog of each route lane: one pipeline per lane (its keys share a slot).
async fn lane_backlogs(
    con: &mut Conn,
    lanes: &[Lane],
    now_ms: i64,
) -> redis::RedisResult<Vec<Backlog>> {
    let reads = lanes.iter().map(|lane| {
        let mut con = con.clone();
        async move {
            let mut pipe = redis::pipe();
            add_zset_queries(&mut pipe, &lane.keys.due, now_ms as f64);
            pipe.zcard(&lane.keys.dead);
            let values: Vec<redis::Value> = pipe.query_async(&mut con).await?;
            let mut it = values.into_iter();
            let (due_now, total, head) = read_zset_queries(&mut it)?;
            let dead = redis::from_redis_value(it.next().unwrap_or_default())?;
            Ok::<_, redis::RedisError>(Backlog {
                name: lane.route.clone(),
                due_now,
                scheduled: total - due_now,
                inflight: 0,
                dead,
                oldest_due_age_ms: age(now_ms, head, ScoreUnit::Millis),
            })
        }
    });
    futures::future::try_join_all(reads).await
}

/// A HASH read whole, as field-value pairs.
type Pairs = Vec<(String, String)>;

/// The live daemons and what each polls, from the registry and the poller slots.
pub async fn instances(
    con: &mut Conn,
    keys: &Keys,
    now_ms: i64,
) -> redis::RedisResult<Vec<Instance>> {
    let (registered, slots): (Pairs, Pairs) = redis::pipe()
        .hgetall(keys.instances())
        .hgetall(keys.poller_slots())
        .query_async(con)
        .await?;
    let mut instances: Vec<Instance> = registered
        .into_iter()
        .filter_map(|(id, registration)| {
            let (expires, seen) = scripts::registration_times(&registration)?;
            (expires > now_ms).then(|| Instance {
                version: scripts::registration_version(&registration).map(str::to_owned),
                id,
                shards: Vec::new(),
                sources: Vec::new(),
                last_seen_ms: seen,
            })
        })
        .collect();
    for (slot, holder) in slots {
        let Some(instance) = instances.iter_mut().find(|i| i.id == holder) else {
            continue;
        };
        match poller::target_of(&slot) {
            Some(TargetId::Shard(shard)) => instance.shards.push(shard),
            Some(TargetId::Source(source)) => instance.sources.push(source),
            Some(lane @ TargetId::Lane(_)) => instance.sources.push(poller::slot_name(&lane)),
            // A group of route lanes (`lanes:<group>:<members>`).
            None if slot.starts_with("lanes:") => {
                let group = slot.rsplit_once('#').map_or(slot.as_str(), |(g, _)| g);
                instance.sources.push(group.to_owned());
            }
            None => {}
        }
    }
    for instance in &mut instances {
        instance.shards.sort_unstable();
        instance.shards.dedup();
        instance.sources.sort();
        instance.sources.dedup();
    }
    Ok(instances)
}

fn add_zset_queries(pipe: &mut redis::Pipeline, key: &str, max_score: f64) {
    pipe.zcount(key, "-inf", max_score)
        .zcard(key)
        .zrange_withscores(key, 0, 0);
}

fn read_zset_queries(
    it: &mut impl Iterator<Item = redis::Value>,
) -> redis::RedisResult<(u64, u64, Option<f64>)> {
    let due_now: u64 = redis::from_redis_value(it.next().unwrap_or_default())?;
    let total: u64 = redis::from_redis_value(it.next().unwrap_or_default())?;
    let head: Vec<(String, f64)> = redis::from_redis_value(it.next().unwrap_or_default())?;
    Ok((due_now, total, head.first().map(|(_, s)| *s)))
}

fn age(now_ms: i64, head: Option<f64>, unit: ScoreUnit) -> u64 {
    head.map(|s| (now_ms as f64 - unit.to_ms(s)).max(0.0) as u64)
        .unwrap_or(0)
}

/// Sets the backlog gauges from a sample.
pub fn publish_gauges(stats: &Stats) {
    let shards = stats
        .shards
        .iter()
        .enumerate()
        .map(|(i, b)| ("shard", i.to_string(), b));
    let sources = stats.sources.iter().map(|b| ("source", b.name.clone(), b));
    let lanes = stats.lanes.iter().map(|b| ("route", b.name.clone(), b));
    for (label, value, b) in shards.chain(sources).chain(lanes) {
        metrics::gauge!(DUE_BACKLOG, label => value.clone()).set(b.due_now as f64);
        metrics::gauge!(SCHEDULED, label => value.clone()).set(b.scheduled as f64);
        metrics::gauge!(INFLIGHT, label => value.clone()).set(b.inflight as f64);
        metrics::gauge!(DEAD, label => value.clone()).set(b.dead as f64);
        metrics::gauge!(OLDEST_DUE_AGE, label => value).set(b.oldest_due_age_ms as f64 / 1000.0);
    }
    // From Redis's flow state, so every instance reports the same, whichever moved the route.
    for f in &stats.flow {
        for by in ["rate", "max_length"] {
            let held = f.held_by.as_deref() == Some(by);
            metrics::gauge!(ROUTE_HELD, "route" => f.route.clone(), "by" => by).set(if held {
                1.0
            } else {
                0.0
            });
        }
    }
    for w in &stats.waiting {
        metrics::gauge!(SINK_WAITING, "sink" => w.sink.clone()).set(w.jobs as f64);
        metrics::gauge!(SINK_OLDEST_WAITING, "sink" => w.sink.clone())
            .set(w.oldest_age_ms as f64 / 1000.0);
    }
}

/// How often the schedules that missed the most are looked for: it reads every schedule's
/// health record, so less often than the stats are sampled.
const TOP_MISSED_EVERY: Duration = Duration::from_secs(60);

/// The schedules that missed the most, as last looked for.
#[derive(Default)]
pub struct TopMissed {
    ids: Vec<String>,
    found_at: Option<Instant>,
}

/// The schedules exported with series of their own (`admin.schedule_metrics`, then the
/// `admin.schedule_metrics_top_missed` that missed the most, looked for every
/// [`TOP_MISSED_EVERY`]), as their health records and definitions read now; a named schedule
/// that does not exist is left out.
pub async fn schedule_series(
    client: &zdelay_core::Client,
    admin: &zdelay_core::config::AdminConfig,
    top: &mut TopMissed,
) -> anyhow::Result<Vec<crate::metrics::ScheduleSeries>> {
    if top
        .found_at
        .is_none_or(|at| at.elapsed() >= TOP_MISSED_EVERY)
    {
        let found = client
            .operator()
            .schedules_most_missed(admin.schedule_metrics_top_missed)
            .await?;
        top.ids = found.into_iter().map(|(id, _)| id).collect();
        top.found_at = Some(Instant::now());
    }
    let mut ids: Vec<&str> = admin.schedule_metrics.iter().map(String::as_str).collect();
    ids.extend(top.ids.iter().map(String::as_str));
    let mut seen = HashSet::new();
    ids.retain(|id| seen.insert(*id));
    let mut rows = Vec::with_capacity(ids.len());
    for id in ids {
        let Some(view) = client.schedule_get(id).await? else {
            continue;
        };
        let began = view.created_ms.max(view.def.start_at.unwrap_or(i64::MIN));
        // Nothing is expected of a paused or ended schedule: period 0.
        let period_ms = match (view.next_ms, view.paused, view.def.compile()) {
            (Some(next), false, Ok(schedule)) => schedule.period_after(next - 1).unwrap_or(0),
            _ => 0,
        };
        rows.push(crate::metrics::ScheduleSeries {
            id: view.id,
            health: view.health,
            last_fired_ms: view.health.last_fired_ms.unwrap_or(began),
            next_ms: view.next_ms,
            period_ms,
        });
    }
    Ok(rows)
}

/// `zdelay stats --json` and `GET /api/stats`: the sample, its total, and the recent
/// activity (throughput per minute, lateness percentiles, delivery rate).
pub async fn report(con: &mut Conn, config: &Config) -> anyhow::Result<serde_json::Value> {
    let stats = gather(con, config).await?;
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    let recent = crate::activity::read(con, &keys, stats.now_ms).await?;
    let mut v = serde_json::to_value(&stats)?;
    v["total"] = serde_json::to_value(stats.total())?;
    v["recent"] = serde_json::to_value(&recent)?;
    Ok(v)
}

/// The most steps a forecast has.
pub const MAX_STEPS: u64 = 1440;

/// What a forecast covers: `steps` steps of `step_ms` from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Horizon {
    pub step_ms: u64,
    pub steps: u64,
}

impl Horizon {
    /// `next` ahead in steps of `step` (the last step may end past `next`): step at least
    /// 1 s, at most [`MAX_STEPS`] steps.
    pub fn new(next: std::time::Duration, step: std::time::Duration) -> Result<Self, String> {
        let (next_ms, step_ms) = (next.as_millis() as u64, step.as_millis() as u64);
        if step_ms < 1000 {
            return Err(format!("step must be at least 1s (got {step_ms} ms)"));
        }
        if next_ms < step_ms {
            return Err("next must be at least one step".into());
        }
        let steps = next_ms.div_ceil(step_ms);
        if steps > MAX_STEPS {
            return Err(format!(
                "{steps} steps: at most {MAX_STEPS} (a longer step, or a shorter next)"
            ));
        }
        Ok(Horizon { step_ms, steps })
    }
}

/// What falls due in each step ahead: counted with ZCOUNT per step and key, never by reading
/// members.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Forecast {
    pub now_ms: i64,
    pub step_ms: u64,
    /// Due now or before and not delivered: jobs due in the shards (and those waiting for
    /// their two-phase sink), members due in raw sources.
    pub overdue: u64,
    pub overdue_by_shard: BTreeMap<String, u64>,
    pub overdue_by_source: BTreeMap<String, u64>,
    /// By route lane (storage layout 2).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub overdue_by_route: BTreeMap<String, u64>,
    /// Step `i` counts what falls due in `(now + i·step, now + (i+1)·step]`.
    pub steps: Vec<Step>,
    /// The last hour's measured delivery rate (every daemon of the namespace, from
    /// `{ns}:activity`); `None` without any record.
    pub delivery_rate_per_s: Option<f64>,
    /// What that rate drains in one step; a step holding more is a spike.
    pub drain_per_step: Option<u64>,
    /// Routes with a configured `rate`: what the limit will do to what falls due.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub route_limits: BTreeMap<String, RouteLimit>,
}

/// A rate-limited route in the forecast: its own drain line is its configured rate.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RouteLimit {
    pub rate_per_s: f64,
    /// What the rate lets through in one step.
    pub drain_per_step: u64,
    /// Steps (by index) holding more of the route's jobs than that: the limit spreads them.
    pub over_rate_steps: Vec<usize>,
    /// How long the route's overdue jobs take to go at its rate, ms.
    pub overdue_clears_in_ms: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Step {
    pub start_ms: i64,
    /// Jobs and raw members falling due in the step (the schedules' pending occurrences
    /// are counted apart, in `schedules`).
    pub count: u64,
    /// By shard number (jobs enqueued through zdelay and schedule occurrences already made
    /// jobs).
    pub by_shard: BTreeMap<String, u64>,
    /// By raw source key; each source has one route, so these are per route too.
    pub by_source: BTreeMap<String, u64>,
    /// By route lane (storage layout 2).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub by_route: BTreeMap<String, u64>,
    /// Recurring schedules whose next occurrence falls in the step (each becomes a job then).
    pub schedules: u64,
    /// More than the last hour's delivery rate drains in one step.
    pub spike: bool,
}

/// Counts what falls due in each step of `horizon`, per shard and raw source, plus the
/// overdue backlog: one pipeline of ZCOUNTs per shard and per source, all at once.
pub async fn forecast(
    con: &mut Conn,
    config: &Config,
    horizon: Horizon,
) -> anyhow::Result<Forecast> {
    let (keys, lanes) = read_layout(con, config, None).await?;
    let now_ms = con.now_ms().await?;
    let bounds: Vec<(i64, i64)> = (0..horizon.steps as i64)
        .map(|i| {
            let start = now_ms + i * horizon.step_ms as i64;
            (start, start + horizon.step_ms as i64)
        })
        .collect();
    let mut pipes = Vec::new();
    for shard in 0..keys.shards() {
        let mut pipe = redis::pipe();
        let due = keys.due(shard);
        pipe.zcount(&due, "-inf", now_ms).zcard(keys.ready(shard));
        for (start, end) in &bounds {
            pipe.zcount(&due, format!("({start}"), end);
        }
        let sched_due = keys.shard(shard).sched_due;
        for (start, end) in &bounds {
            pipe.zcount(&sched_due, format!("({start}"), end);
        }
        pipes.push(pipe);
    }
    for source in &config.sources {
        let score = |ms: i64| match source.score_unit {
            ScoreUnit::Millis => ms.to_string(),
            ScoreUnit::Seconds => format!("{:.3}", ms as f64 / 1000.0),
        };
        let mut pipe = redis::pipe();
        pipe.zcount(&source.key, "-inf", score(now_ms));
        for (start, end) in &bounds {
            pipe.zcount(&source.key, format!("({}", score(*start)), score(*end));
        }
        pipes.push(pipe);
    }
    for lane in &lanes {
        let mut pipe = redis::pipe();
        pipe.zcount(&lane.keys.due, "-inf", now_ms);
        for (start, end) in &bounds {
            pipe.zcount(&lane.keys.due, format!("({start}"), end);
        }
        for (start, end) in &bounds {
            pipe.zcount(&lane.keys.sched_due, format!("({start}"), end);
        }
        pipes.push(pipe);
    }
    let replies = futures::future::join_all(pipes.iter().map(|pipe| {
        let mut con = con.clone();
        async move { pipe.query_async::<Vec<u64>>(&mut con).await }
    }))
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    let recent = crate::activity::read(con, &keys, now_ms).await?;
    let drain_per_step = recent
        .delivery_rate_per_s
        .map(|rate| (rate * horizon.step_ms as f64 / 1000.0).floor() as u64);
    let mut steps: Vec<Step> = bounds
        .iter()
        .map(|(start, _)| Step {
            start_ms: *start,
            count: 0,
            by_shard: BTreeMap::new(),
            by_source: BTreeMap::new(),
            by_route: BTreeMap::new(),
            schedules: 0,
            spike: false,
        })
        .collect();
    let n = bounds.len();
    let mut forecast = Forecast {
        now_ms,
        step_ms: horizon.step_ms,
        overdue: 0,
        overdue_by_shard: BTreeMap::new(),
        overdue_by_source: BTreeMap::new(),
        overdue_by_route: BTreeMap::new(),
        steps: Vec::new(),
        delivery_rate_per_s: recent.delivery_rate_per_s,
        drain_per_step,
        route_limits: BTreeMap::new(),
    };
    let (shard_replies, rest) = replies.split_at(keys.shards() as usize);
    let (source_replies, lane_replies) = rest.split_at(config.sources.len());
    for (shard, counts) in shard_replies.iter().enumerate() {
        let overdue = counts[0] + counts[1];
        forecast.overdue += overdue;
        forecast.overdue_by_shard.insert(shard.to_string(), overdue);
        for (i, step) in steps.iter_mut().enumerate() {
            let jobs = counts[2 + i];
            step.count += jobs;
            step.by_shard.insert(shard.to_string(), jobs);
            step.schedules += counts[2 + n + i];
        }
    }
    for (source, counts) in config.sources.iter().zip(source_replies) {
        forecast.overdue += counts[0];
        forecast
            .overdue_by_source
            .insert(source.key.clone(), counts[0]);
        for (i, step) in steps.iter_mut().enumerate() {
            step.count += counts[1 + i];
            step.by_source.insert(source.key.clone(), counts[1 + i]);
        }
    }
    for (lane, counts) in lanes.iter().zip(lane_replies) {
        forecast.overdue += counts[0];
        forecast
            .overdue_by_route
            .insert(lane.route.clone(), counts[0]);
        for (i, step) in steps.iter_mut().enumerate() {
            step.count += counts[1 + i];
            step.by_route.insert(lane.route.clone(), counts[1 + i]);
            step.schedules += counts[1 + n + i];
        }
    }
    for step in &mut steps {
        step.spike = drain_per_step.is_some_and(|drain| step.count > drain);
    }
    for lane in &lanes {
        let Some(rate) = config
            .routes
            .iter()
            .find(|r| r.name == lane.route)
            .and_then(|r| r.flow()?.rate_per_s)
        else {
            continue;
        };
        let drain = (rate * horizon.step_ms as f64 / 1000.0).floor() as u64;
        let overdue = forecast
            .overdue_by_route
            .get(&lane.route)
            .copied()
            .unwrap_or(0);
        forecast.route_limits.insert(
            lane.route.clone(),
            RouteLimit {
                rate_per_s: rate,
                drain_per_step: drain,
                over_rate_steps: (0..steps.len())
                    .filter(|&i| {
                        steps[i]
                            .by_route
                            .get(&lane.route)
                            .is_some_and(|&c| c > drain)
                    })
                    .collect(),
                overdue_clears_in_ms: (overdue as f64 * 1000.0 / rate).ceil() as u64,
            },
        );
    }
    forecast.steps = steps;
    Ok(forecast)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn horizon_bounds_its_steps() {
        let h = Horizon::new(Duration::from_secs(600), Duration::from_secs(60)).unwrap();
        assert_eq!((h.step_ms, h.steps), (60_000, 10));
        // A last partial step is counted whole.
        let h = Horizon::new(Duration::from_secs(90), Duration::from_secs(60)).unwrap();
        assert_eq!(h.steps, 2);
        assert!(Horizon::new(Duration::from_secs(60), Duration::from_millis(500)).is_err());
        assert!(Horizon::new(Duration::from_secs(1), Duration::from_secs(60)).is_err());
        assert!(Horizon::new(Duration::from_secs(86_400), Duration::from_secs(1)).is_err());
        assert!(Horizon::new(Duration::from_secs(86_400), Duration::from_secs(60)).is_ok());
    }

    #[test]
    fn the_sampler_reads_unknown_and_busy_lanes_whole_and_probes_empty_ones() {
        use zdelay_core::config::Push;
        let lanes: Vec<Lane> = (0..3)
            .map(|i| Lane::new("ns", "t", i, &format!("r{i}"), "q", Push::default()))
            .collect();
        let backlog = |name: &str, scheduled: u64| Backlog {
            name: name.to_owned(),
            due_now: 0,
            scheduled,
            inflight: 0,
            dead: 0,
            oldest_due_age_ms: 0,
        };
        let mut sampler = LaneSampler::default();
        let (read, probed, quiet) = sampler.split(&lanes);
        assert_eq!(
            (read.len(), probed.len(), quiet.len()),
            (3, 0, 0),
            "never read: read whole"
        );
        sampler.remember(&[backlog("r0", 0), backlog("r1", 4), backlog("r2", 0)]);
        let (read, probed, _) = sampler.split(&lanes);
        let names = |l: &[Lane]| l.iter().map(|l| l.route.clone()).collect::<Vec<_>>();
        assert_eq!(names(&read), ["r1"]);
        assert_eq!(
            names(&probed),
            ["r0", "r2"],
            "wake-ups unknown: every empty lane"
        );
        sampler.remember(&[backlog("r0", 1), backlog("r1", 0)]);
        let (read, probed, _) = sampler.split(&lanes);
        assert_eq!(
            (names(&read), names(&probed)),
            (
                vec!["r0".to_owned()],
                vec!["r1".to_owned(), "r2".to_owned()]
            )
        );
        // Wake-ups confirmed, every empty lane probed a moment ago: only a lane a wake-up
        // named is probed; the others stay as they were.
        sampler.written(Some(HashSet::from([lanes[2].number])));
        let (read, probed, quiet) = sampler.split(&lanes);
        assert_eq!(
            (names(&read), names(&probed), names(&quiet)),
            (
                vec!["r0".to_owned()],
                vec!["r2".to_owned()],
                vec!["r1".to_owned()]
            )
        );
        sampler.written(Some(HashSet::new()));
        let (_, probed, quiet) = sampler.split(&lanes);
        assert_eq!((probed.len(), quiet.len()), (0, 2));
        // A subscription lost since: every empty lane again.
        sampler.written(None);
        let (_, probed, quiet) = sampler.split(&lanes);
        assert_eq!((probed.len(), quiet.len()), (2, 0));
    }
}
