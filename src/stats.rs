//! Backlog statistics per shard and raw source: due now, scheduled later, in flight, dead,
//! oldest overdue age. One pipeline per call, "now" from Redis TIME. Used by `zdelay stats`
//! and by the daemon's low-rate sampler (never by the hot loop).

use crate::metrics::{
    DEAD, DUE_BACKLOG, INFLIGHT, OLDEST_DUE_AGE, SCHEDULED, SINK_OLDEST_WAITING, SINK_WAITING,
};
use crate::poller::{self, TargetId};
use serde::Serialize;
use std::collections::BTreeMap;
use zdelay_client::config::{Config, ScoreUnit};
use zdelay_client::keys::Keys;
use zdelay_client::routes::Routes;
use zdelay_client::store::{self, Conn};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Backlog {
    /// `shard N` or the raw source key.
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
    /// Two-phase sinks as the daemons last saw them (`<ns>:sinks`); empty when none.
    pub sinks: Vec<SinkState>,
    /// Jobs due and waiting for each two-phase sink (its part of the shards' ready sets).
    pub waiting: Vec<SinkWaiting>,
    /// The daemons registered on the namespace and the targets each one polls.
    pub instances: Vec<Instance>,
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
}

/// The jobs waiting for one two-phase sink, over every shard.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SinkWaiting {
    pub sink: String,
    pub jobs: u64,
    /// How long the oldest of them has been due, ms; 0 when none waits.
    pub oldest_age_ms: u64,
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
        for b in self.shards.iter().chain(&self.sources) {
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
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    let now_ms = store::server_time_ms(con).await?;
    let sink_names: Vec<String> = Routes::from_config(config)
        .two_phase_sinks()
        .map(str::to_owned)
        .collect();
    // One pipeline per slot (a shard's keys, a source, a source's dead set), so it runs on a
    // Redis Cluster too; all of them at once.
    let mut pipes = Vec::new();
    for shard in 0..keys.shards() {
        let mut pipe = redis::pipe();
        add_zset_queries(&mut pipe, &keys.due(shard), now_ms as f64);
        pipe.zcard(keys.inflight(shard)).zcard(keys.dead(shard));
        for sink in &sink_names {
            let (min, max) = ready_range(sink);
            pipe.cmd("ZLEXCOUNT")
                .arg(keys.ready(shard))
                .arg(&min)
                .arg(&max);
            pipe.cmd("ZRANGEBYLEX")
                .arg(keys.ready(shard))
                .arg(&min)
                .arg(&max)
                .arg("LIMIT")
                .arg(0)
                .arg(1);
        }
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
    let replies = futures::future::join_all(pipes.iter().map(|pipe| {
        let mut con = con.clone();
        async move { pipe.query_async::<Vec<redis::Value>>(&mut con).await }
    }))
    .await;
    let mut it = replies
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten();
    let mut shards = Vec::new();
    let mut waiting: BTreeMap<&str, SinkWaiting> = BTreeMap::new();
    for shard in 0..keys.shards() {
        let (due_now, total, head) = read_zset_queries(&mut it)?;
        let inflight = redis::from_redis_value(it.next().unwrap_or_default())?;
        let dead = redis::from_redis_value(it.next().unwrap_or_default())?;
        let mut oldest_due_age_ms = age(now_ms, head, ScoreUnit::Millis);
        let mut waiting_here = 0;
        for sink in &sink_names {
            let jobs: u64 = redis::from_redis_value(it.next().unwrap_or_default())?;
            let first: Vec<String> = redis::from_redis_value(it.next().unwrap_or_default())?;
            let oldest = first
                .first()
                .and_then(|m| m.split('\n').nth(1))
                .and_then(|due| due.parse::<f64>().ok());
            let oldest_age_ms = age(now_ms, oldest, ScoreUnit::Millis);
            let entry = waiting.entry(sink).or_insert_with(|| SinkWaiting {
                sink: sink.clone(),
                jobs: 0,
                oldest_age_ms: 0,
            });
            entry.jobs += jobs;
            entry.oldest_age_ms = entry.oldest_age_ms.max(oldest_age_ms);
            waiting_here += jobs;
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
    Ok(Stats {
        now_ms,
        shards,
        sources,
        sinks,
        waiting: waiting.into_values().collect(),
        instances,
    })
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
        .filter_map(|(id, times)| {
            let (expires, seen) = times.split_once(' ')?;
            let live = expires.parse::<i64>().ok()? > now_ms;
            live.then(|| Instance {
                id,
                shards: Vec::new(),
                sources: Vec::new(),
                last_seen_ms: seen.parse().unwrap_or(0),
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

/// The ZRANGEBYLEX bounds of one sink's members in a ready set: `<sink>\n…`.
fn ready_range(sink: &str) -> (String, String) {
    (format!("[{sink}\n"), format!("({sink}\u{b}"))
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
    for (label, value, b) in shards.chain(sources) {
        metrics::gauge!(DUE_BACKLOG, label => value.clone()).set(b.due_now as f64);
        metrics::gauge!(SCHEDULED, label => value.clone()).set(b.scheduled as f64);
        metrics::gauge!(INFLIGHT, label => value.clone()).set(b.inflight as f64);
        metrics::gauge!(DEAD, label => value.clone()).set(b.dead as f64);
        metrics::gauge!(OLDEST_DUE_AGE, label => value).set(b.oldest_due_age_ms as f64 / 1000.0);
    }
    for w in &stats.waiting {
        metrics::gauge!(SINK_WAITING, "sink" => w.sink.clone()).set(w.jobs as f64);
        metrics::gauge!(SINK_OLDEST_WAITING, "sink" => w.sink.clone())
            .set(w.oldest_age_ms as f64 / 1000.0);
    }
}
