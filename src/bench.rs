//! `zdelay bench`: measures the mover against a given Redis, in a scratch namespace.
//!
//! Every mode runs the product's own code in process: `poller::run` tasks (the daemon's
//! loop, with a `BatchObserver` that counts moved jobs and adds up the scripts' lateness
//! buckets), the `wake::listen` pub/sub listener where wake-ups matter, and
//! `Client::enqueue_batch` for envelope jobs. Jobs are loaded (with a progress bar) before
//! any clock starts: filling a ZSET runs at ~200k/s and must not count.
//!
//! Modes:
//! - `drain`: an all-due backlog. Raw source: N members in one ZSET moved by the real
//!   `move_raw` poller, then the same N members moved by `bench_bare_move_raw` at the same
//!   batch size. Envelope jobs: N jobs over the shards moved by the real `move_due` pollers
//!   (one per shard, concurrent), then the same ids and payloads in a bare id ZSET + payload
//!   HASH layout moved by `bench_bare_move_hash` (one concurrent loop per shard). Reported:
//!   jobs/s, Redis CPU seconds per million jobs (`INFO cpu` deltas), and real/bare ratios.
//! - `steady`: a producer enqueues at a fixed rate, each job due 100–500 ms after its
//!   enqueue, while pollers and the wake listener run. Lateness comes from the scripts'
//!   buckets (1 ms wide up to 50 ms). A consumer pops the list and checks every job arrived
//!   once and none arrived before its due time (see `Consumer`).
//! - `same-ms`: jobs all due at one millisecond T; time from T until the last one moved.
//! - `memory`: `INFO memory` used_memory per envelope job, and per job in the bare layout.
//!
//! Scratch keys: the envelope keys of `--namespace` (default `zdelay-bench`), the bare
//! layout under `<ns>:bare`, the raw source `<ns>:raw` (and its dead keys) and the list
//! `<ns>:out`. They are deleted before and after; a namespace that holds any of them is
//! refused unless `--force`. The bench is for a single Redis node (the list key does not
//! share the shards' hash tags).

use crate::client::{self, Client, NewJob, OnConflict};
use crate::config::{Config, RedisConfig, ScoreUnit};
use crate::keys::{self, Keys};
use crate::metrics::LATENESS_BOUNDS_MS;
use crate::poller::{self, BatchObserver, PollerContext, RawSource, Target};
use crate::scripts::{self, MoveReply};
use crate::sinks::LocalRoutes;
use crate::sinks::redis_list::LocalRoute;
use crate::wake::{self, Wakers};
use anyhow::{Context, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use redis::aio::ConnectionManager;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Which measurements to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// All-due backlog: moved/s of the real mover vs a bare Lua move.
    Drain,
    /// Steady enqueue rate: lateness p50/p99/max, never early, all delivered.
    Steady,
    /// Many jobs due at the same millisecond: time until the last one is moved.
    SameMs,
    /// Redis memory per job.
    Memory,
    /// Every mode above.
    All,
}

/// Options of `zdelay bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Mode::All)]
    pub mode: Mode,
    /// Jobs loaded for drain and memory.
    #[arg(long, default_value_t = 500_000)]
    pub jobs: u64,
    /// Payload size in bytes (payloads are unique, so at least 13 bytes are used).
    #[arg(long, default_value_t = 100)]
    pub payload_size: usize,
    /// Jobs per script call (default: poller.batch from the config). Above 1000 is for
    /// experiments only: the daemon caps it at 1000.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Steady-mode enqueue rates, jobs/s (comma-separated; each runs in turn).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1_000u64, 50_000])]
    pub rate: Vec<u64>,
    /// How long each steady rate runs.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Jobs due at the same millisecond in same-ms mode.
    #[arg(long, default_value_t = 300_000)]
    pub same_ms_jobs: u64,
    /// Drain runs per source kind (real then bare, alternating); the median ratio is kept.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Scratch namespace: its keys are deleted before and after.
    #[arg(long, default_value = "zdelay-bench")]
    pub namespace: String,
    /// Envelope shards (default: redis.shards from the config).
    #[arg(long)]
    pub shards: Option<u16>,
    /// Delete and use the scratch keys even if they hold data.
    #[arg(long)]
    pub force: bool,
    /// Print the report as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Instead of the modes: confirmed messages/s through this configured two-phase route
    /// (Kafka, AMQP, NATS or remote Redis), `--jobs` jobs all due, with the daemon's
    /// pollers and the route's real sink (claim → publish → broker confirmation → ack).
    #[arg(long)]
    pub route: Option<String>,
}

/// Targets from the foundation issue (ratios to a bare move measured in the same run).
const RAW_RATIO_TARGET: f64 = 0.8;
const ENVELOPE_RATIO_TARGET: f64 = 0.7;
const STEADY_P99_TARGET_MS: i64 = 5;
const STEADY_P99_TARGET_RATE: u64 = 1_000;
const SAME_MS_TARGET_MS: f64 = 1_000.0;
/// The same-ms target is for this many jobs; fewer are reported but not judged.
const SAME_MS_TARGET_JOBS: u64 = 300_000;
/// The memory aim is for this payload size; other sizes are reported but not judged.
const MEMORY_AIM_PAYLOAD: usize = 100;
const MEMORY_AIM_BYTES: f64 = 300.0;
/// Destination (route name) of every bench job.
const ROUTE: &str = "bench";
/// Steady-mode jobs are due this many ms after their enqueue, uniformly.
const STEADY_DELAY_MS: (u64, u64) = (100, 500);

pub async fn run(config: Config, args: BenchArgs) -> anyhow::Result<()> {
    let batch = args.batch.unwrap_or(config.poller.batch);
    ensure!(
        (1..=5_000).contains(&batch),
        "--batch must be 1..=5000 (the daemon allows 1..=1000)"
    );
    ensure!(
        !args.namespace.is_empty() && !args.namespace.contains(['{', '}']),
        "--namespace must be non-empty, without {{ or }}"
    );
    ensure!(
        args.jobs > 0 && args.same_ms_jobs > 0,
        "job counts must be > 0"
    );
    ensure!(args.rounds > 0, "--rounds must be > 0");
    let shards = args.shards.unwrap_or(config.redis.shards);
    ensure!(shards > 0, "--shards must be > 0");
    let redis_cfg = RedisConfig {
        namespace: args.namespace.clone(),
        shards,
        ..config.redis.clone()
    };
    let redis = client::redis_client(&redis_cfg).context("invalid redis.url")?;
    let mut con = client::connect(redis.clone())
        .await
        .with_context(|| format!("cannot connect to redis at {}", redis_cfg.url))?;
    let scratch = Scratch::new(&args.namespace, shards);

    let occupied: u64 = redis::cmd("EXISTS")
        .arg(scratch.data_keys())
        .query_async(&mut con)
        .await?;
    if occupied > 0 && !args.force {
        bail!(
            "namespace {:?} holds {occupied} keys with data on {} (jobs, lists or raw members); \
             refusing to delete them: use another --namespace, or --force",
            args.namespace,
            redis_cfg.url
        );
    }
    scratch.clean(&mut con, true).await?;
    scripts::load_all(&mut con).await?;
    let producer = Client::connect(&redis_cfg).await?;

    let mut report = Report {
        machine: Machine::gather(&mut con).await?,
        settings: Settings {
            redis_url: redact(&redis_cfg.url),
            namespace: args.namespace.clone(),
            shards,
            batch,
            jobs: args.jobs,
            payload_size: args.payload_size.max(MIN_PAYLOAD),
            idle_poll_ms: config.poller.idle_poll.as_millis() as u64,
            mode: clap::ValueEnum::to_possible_value(&args.mode)
                .map(|v| v.get_name().to_owned())
                .unwrap_or_default(),
        },
        drain: Vec::new(),
        steady: Vec::new(),
        same_ms: None,
        memory: None,
    };
    let mut env = Env {
        con,
        redis,
        producer,
        config,
        args: args.clone(),
        scratch,
        batch,
        clock_offset_ms: 0,
    };
    env.clock_offset_ms = clock_offset_ms(&mut env.con).await?;

    if let Some(route) = env.args.route.clone() {
        let result = sink_drain(&mut env, &route).await;
        let cleaned = env.scratch.clean(&mut env.con, true).await;
        let report = result?;
        cleaned?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!(
                "route {} (sink {}, {}): {} jobs of {} bytes, batch {}, {} shards\n\
                 confirmed and acked in {:.2} s = {:.0} msgs/s; dead {}",
                report.route,
                report.sink,
                report.kind,
                report.jobs,
                report.payload_size,
                report.batch,
                report.shards,
                report.seconds,
                report.per_second,
                report.dead
            );
        }
        return Ok(());
    }
    let result = run_modes(&mut env, &mut report).await;
    // Clean up whatever happened.
    let cleaned = env.scratch.clean(&mut env.con, true).await;
    result?;
    cleaned?;
    report.machine.loadavg_end = read_first_line("/proc/loadavg");

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

async fn run_modes(env: &mut Env, report: &mut Report) -> anyhow::Result<()> {
    let all = env.args.mode == Mode::All;
    if all || env.args.mode == Mode::Drain {
        report.drain.push(drain_raw(env).await?);
        report.drain.push(drain_envelope(env).await?);
    }
    if all || env.args.mode == Mode::SameMs {
        report.same_ms = Some(same_ms(env).await?);
    }
    if all || env.args.mode == Mode::Steady {
        for rate in env.args.rate.clone() {
            report.steady.push(steady(env, rate).await?);
        }
    }
    if all || env.args.mode == Mode::Memory {
        report.memory = Some(memory(env).await?);
    }
    Ok(())
}

/// What every mode needs.
struct Env {
    con: ConnectionManager,
    redis: redis::Client,
    producer: Client,
    config: Config,
    args: BenchArgs,
    scratch: Scratch,
    batch: usize,
    /// Redis clock minus the local clock, ms (0 on the same host).
    clock_offset_ms: i64,
}

impl Env {
    fn routes(&self) -> LocalRoutes {
        let mut routes = LocalRoutes::default();
        routes.add(LocalRoute {
            name: ROUTE.into(),
            list: self.scratch.out.clone(),
            command: "LPUSH",
        });
        routes
    }

    fn raw_source(&self) -> RawSource {
        RawSource {
            key: self.scratch.raw.clone(),
            dead_key: self.scratch.raw_dead.clone(),
            reasons_key: self.scratch.raw_reasons.clone(),
            unit: ScoreUnit::Millis,
            list: self.scratch.out.clone(),
            command: "LPUSH",
            route: ROUTE.into(),
        }
    }

    fn payload_size(&self) -> usize {
        self.args.payload_size
    }

    /// Redis's clock now, estimated from the local clock.
    fn redis_now_ms(&self) -> i64 {
        local_now_ms() + self.clock_offset_ms
    }

    /// Starts pollers (and the wake listener if asked) feeding `tally`.
    fn spawn_movers(
        &self,
        targets: Vec<Target>,
        bounds: Vec<u64>,
        tally: &Arc<Tally>,
        listen: bool,
    ) -> Movers {
        let observer: BatchObserver = {
            let tally = tally.clone();
            Arc::new(move |_target: &Target, reply: &MoveReply| tally.observe(reply))
        };
        let ctx = Arc::new(PollerContext {
            con: self.con.clone(),
            keys: self.scratch.keys.clone(),
            routes: self.routes(),
            batch: self.batch,
            idle_poll: self.config.poller.idle_poll,
            max_payload: self.config.poller.max_payload,
            bounds_ms: bounds,
            observer: Some(observer),
            remote: Default::default(),
            sinks: Default::default(),
            lease: self.config.poller.lease,
            sink_pause: self.config.poller.sink_pause,
            max_attempts: self.config.poller.max_attempts,
            retry_base: self.config.poller.retry_base,
            retry_cap: self.config.poller.retry_cap,
        });
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let mut wakers = Wakers::default();
        for target in targets {
            let notify = Arc::new(Notify::new());
            match &target {
                Target::Shard(s) => {
                    wakers.shards.insert(*s, notify.clone());
                }
                Target::Source(s) => {
                    wakers.sources.insert(s.key.clone(), notify.clone());
                }
            }
            tracker.spawn(poller::run(ctx.clone(), target, notify, shutdown.clone()));
        }
        if listen {
            tracker.spawn(wake::listen(
                self.redis.clone(),
                self.scratch.keys.clone(),
                Arc::new(wakers),
                shutdown.clone(),
            ));
        }
        tracker.close();
        Movers { shutdown, tracker }
    }

    fn shard_targets(&self) -> Vec<Target> {
        (0..self.scratch.keys.shards()).map(Target::Shard).collect()
    }
}

struct Movers {
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl Movers {
    async fn stop(self) {
        self.shutdown.cancel();
        self.tracker.wait().await;
    }
}

// ---------------------------------------------------------------------------------------
// Scratch keys

struct Scratch {
    keys: Keys,
    bare: Keys,
    raw: String,
    raw_dead: String,
    raw_reasons: String,
    out: String,
}

impl Scratch {
    fn new(namespace: &str, shards: u16) -> Self {
        let raw = format!("{namespace}:raw");
        let raw_dead = keys::raw_dead(&raw);
        Scratch {
            keys: Keys::new(namespace, shards),
            bare: Keys::new(&format!("{namespace}:bare"), shards),
            raw_reasons: keys::raw_dead_reasons(&raw_dead),
            raw_dead,
            raw,
            out: format!("{namespace}:out"),
        }
    }

    /// Every scratch key that holds data (not the schema hash).
    fn data_keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in 0..self.keys.shards() {
            let k = &self.keys;
            out.extend([k.due(s), k.jobs(s), k.inflight(s), k.dead(s), k.reasons(s)]);
            out.extend([self.bare.due(s), self.bare.jobs(s)]);
        }
        out.extend([
            self.raw.clone(),
            self.raw_dead.clone(),
            self.raw_reasons.clone(),
            self.out.clone(),
        ]);
        out
    }

    /// Deletes the scratch keys (DEL, not UNLINK, so used_memory drops at once).
    async fn clean(&self, con: &mut ConnectionManager, schema: bool) -> redis::RedisResult<()> {
        let mut keys = self.data_keys();
        if schema {
            keys.push(self.keys.schema());
        }
        for chunk in keys.chunks(64) {
            let _: () = redis::cmd("DEL").arg(chunk).query_async(con).await?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Loading (never timed)

const MIN_PAYLOAD: usize = 13;

/// A unique payload of at least `size` bytes: the index, then padding.
fn payload(i: u64, size: usize) -> Vec<u8> {
    let mut p = format!("{i:012}-").into_bytes();
    p.resize(size.max(p.len()), b'x');
    p
}

/// A steady-mode payload: "<due ms> <seq> " then padding, so the consumer can check it.
fn steady_payload(due_ms: i64, seq: u64, size: usize) -> Vec<u8> {
    let mut p = format!("{due_ms} {seq} ").into_bytes();
    p.resize(size.max(p.len()), b'x');
    p
}

/// Parses `steady_payload`.
fn parse_steady_payload(p: &[u8]) -> Option<(i64, u64)> {
    let text = std::str::from_utf8(p.get(..p.len().min(48))?).ok()?;
    let mut parts = text.split(' ');
    let due = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    Some((due, seq))
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>28} [{bar:30}] {human_pos}/{human_len} ({per_sec}, eta {eta})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

fn status(line: &str) {
    eprintln!("bench: {line}");
}

/// Backlog due times: spread over the two minutes before `now_ms`, oldest first.
fn backlog_due(i: u64, n: u64, now_ms: i64) -> i64 {
    now_ms - 120_000 + (i as i64 * 60_000) / n.max(1) as i64
}

/// ZADDs `n` unique members (payloads) into `key`, scored by `due(i)`.
async fn load_raw(
    con: &mut ConnectionManager,
    key: &str,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> redis::RedisResult<()> {
    let progress = bar(n, what);
    let mut i = 0;
    while i < n {
        let mut pipe = redis::pipe();
        let end = (i + 20_000).min(n);
        while i < end {
            let stop = (i + 1_000).min(end);
            let cmd = pipe.cmd("ZADD").arg(key);
            for j in i..stop {
                cmd.arg(due(j)).arg(payload(j, size));
            }
            cmd.ignore();
            progress.inc(stop - i);
            i = stop;
        }
        let _: () = pipe.query_async(con).await?;
    }
    progress.finish_and_clear();
    Ok(())
}

/// Enqueues `n` envelope jobs through the client; returns their ids in order.
async fn load_envelopes(
    producer: &Client,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> anyhow::Result<Vec<String>> {
    load_envelopes_to(producer, ROUTE, n, size, due, what).await
}

/// Enqueues `n` envelope jobs for `dest` through the client; returns their ids in order.
async fn load_envelopes_to(
    producer: &Client,
    dest: &str,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> anyhow::Result<Vec<String>> {
    let progress = bar(n, what);
    let mut ids = Vec::with_capacity(n as usize);
    let mut i = 0;
    while i < n {
        let end = (i + 20_000).min(n);
        let jobs: Vec<NewJob> = (i..end)
            .map(|j| NewJob::new(dest, payload(j, size)).at(due(j)))
            .collect();
        for r in producer.enqueue_batch(jobs, OnConflict::Replace).await? {
            ids.push(r?.0);
        }
        progress.inc(end - i);
        i = end;
    }
    progress.finish_and_clear();
    Ok(ids)
}

/// Writes the same jobs in the bare layout: per shard, id ZSET + payload HASH.
async fn load_bare_hash(
    con: &mut ConnectionManager,
    bare: &Keys,
    shard_of: impl Fn(&str) -> u16,
    ids: &[String],
    size: usize,
    due: impl Fn(u64) -> i64,
    what: &str,
) -> redis::RedisResult<()> {
    let progress = bar(ids.len() as u64, what);
    for (c, chunk) in ids.chunks(10_000).enumerate() {
        let base = (c * 10_000) as u64;
        let mut by_shard: HashMap<u16, Vec<(u64, &String)>> = HashMap::new();
        for (k, id) in chunk.iter().enumerate() {
            by_shard
                .entry(shard_of(id))
                .or_default()
                .push((base + k as u64, id));
        }
        let mut pipe = redis::pipe();
        for (shard, jobs) in &by_shard {
            let zadd = pipe.cmd("ZADD").arg(bare.due(*shard));
            for (i, id) in jobs {
                zadd.arg(due(*i)).arg(id.as_str());
            }
            zadd.ignore();
            let hset = pipe.cmd("HSET").arg(bare.jobs(*shard));
            for (i, id) in jobs {
                hset.arg(id.as_str()).arg(payload(*i, size));
            }
            hset.ignore();
        }
        let _: () = pipe.query_async(con).await?;
        progress.inc(chunk.len() as u64);
    }
    progress.finish_and_clear();
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Counting what the pollers move

/// Adds up every reply the pollers see; signals when `target` jobs have moved.
struct Tally {
    moved: AtomicU64,
    target: AtomicU64,
    calls: AtomicU64,
    dead: AtomicU64,
    kept: AtomicU64,
    /// Redis TIME (µs) at the start of the first and the last call that moved jobs.
    first_move_us: AtomicI64,
    last_move_us: AtomicI64,
    lateness: Mutex<Hist>,
    done_at: Mutex<Option<(Instant, SystemTime)>>,
    done: Notify,
}

impl Tally {
    fn new(bounds: &[u64]) -> Arc<Self> {
        Arc::new(Tally {
            moved: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            calls: AtomicU64::new(0),
            dead: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            first_move_us: AtomicI64::new(i64::MAX),
            last_move_us: AtomicI64::new(i64::MIN),
            lateness: Mutex::new(Hist::new(bounds)),
            done_at: Mutex::new(None),
            done: Notify::new(),
        })
    }

    fn observe(&self, reply: &MoveReply) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.dead
            .fetch_add(reply.dead.iter().sum::<u64>(), Ordering::Relaxed);
        self.kept.fetch_add(reply.kept as u64, Ordering::Relaxed);
        let n = reply.moved_total();
        if n == 0 {
            return;
        }
        self.first_move_us
            .fetch_min(reply.now_us, Ordering::Relaxed);
        self.last_move_us.fetch_max(reply.now_us, Ordering::Relaxed);
        self.lateness
            .lock()
            .expect("tally lock is never poisoned")
            .add_buckets(&reply.buckets, reply.max_lateness_ms);
        let total = self.moved.fetch_add(n, Ordering::AcqRel) + n;
        if total >= self.target.load(Ordering::Acquire) {
            self.mark_done();
        }
    }

    fn mark_done(&self) {
        let mut done = self.done_at.lock().expect("tally lock is never poisoned");
        if done.is_none() {
            *done = Some((Instant::now(), SystemTime::now()));
            self.done.notify_one();
        }
    }

    fn set_target(&self, n: u64) {
        self.target.store(n, Ordering::Release);
        if self.moved.load(Ordering::Acquire) >= n {
            self.mark_done();
        }
    }

    fn done_at(&self) -> Option<(Instant, SystemTime)> {
        *self.done_at.lock().expect("tally lock is never poisoned")
    }

    /// Waits until the target is reached; `None` after `timeout`.
    async fn wait(&self, timeout: Duration) -> Option<(Instant, SystemTime)> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(t) = self.done_at() {
                return Some(t);
            }
            if tokio::time::timeout_at(deadline, self.done.notified())
                .await
                .is_err()
            {
                return self.done_at();
            }
        }
    }

    fn moved(&self) -> u64 {
        self.moved.load(Ordering::Acquire)
    }

    fn hist(&self) -> Hist {
        self.lateness
            .lock()
            .expect("tally lock is never poisoned")
            .clone()
    }
}

/// Counts per lateness bucket, as the move scripts count them: bucket `i` holds
/// lateness `<= bounds[i]` (and `> bounds[i-1]`); the last one holds the rest.
#[derive(Debug, Clone, PartialEq)]
struct Hist {
    bounds: Vec<u64>,
    counts: Vec<u64>,
    max: i64,
}

impl Hist {
    fn new(bounds: &[u64]) -> Self {
        Hist {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len() + 1],
            max: i64::MIN,
        }
    }

    fn add_buckets(&mut self, buckets: &[u64], max: i64) {
        for (c, b) in self.counts.iter_mut().zip(buckets) {
            *c += b;
        }
        self.max = self.max.max(max);
    }

    fn add(&mut self, late: i64) {
        self.counts[bucket_index(&self.bounds, late)] += 1;
        self.max = self.max.max(late);
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn summary(&self) -> Lateness {
        let total = self.total();
        let q = |q| percentile(&self.bounds, &self.counts, self.max, q);
        Lateness {
            jobs: total,
            p50_ms: q(0.50),
            p90_ms: q(0.90),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: (total > 0).then_some(self.max),
        }
    }
}

/// The bucket the scripts put `late` in: the first bound `>= late`, or the overflow bucket.
fn bucket_index(bounds: &[u64], late: i64) -> usize {
    bounds.partition_point(|&b| (b as i64) < late)
}

/// Nearest-rank percentile `q` (0..=1) from bucket counts: the upper bound of the bucket
/// holding the rank, capped by the largest value seen; the overflow bucket answers `max`.
/// Exact wherever buckets are 1 ms wide, since lateness is a whole number of ms.
fn percentile(bounds: &[u64], counts: &[u64], max: i64, q: f64) -> Option<i64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (i, &c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(match bounds.get(i) {
                Some(&b) => (b as i64).min(max),
                None => max,
            });
        }
    }
    Some(max)
}

/// Lateness bounds for steady and same-ms: every ms up to 50, then coarser.
fn fine_bounds() -> Vec<u64> {
    let mut b: Vec<u64> = (0..=50).collect();
    b.extend((60..=100).step_by(10));
    b.extend([
        150, 200, 250, 300, 400, 500, 750, 1_000, 1_500, 2_000, 3_000, 5_000, 10_000, 30_000,
        60_000,
    ]);
    b
}

// ---------------------------------------------------------------------------------------
// Redis facts

fn parse_info(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

async fn info(
    con: &mut ConnectionManager,
    section: &str,
) -> redis::RedisResult<HashMap<String, String>> {
    let text: String = redis::cmd("INFO").arg(section).query_async(con).await?;
    Ok(parse_info(&text))
}

/// used_cpu_sys + used_cpu_user of the Redis process, seconds.
async fn redis_cpu(con: &mut ConnectionManager) -> anyhow::Result<f64> {
    let info = info(con, "cpu").await?;
    let get = |k: &str| -> anyhow::Result<f64> {
        info.get(k)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("INFO cpu has no {k}"))
    };
    Ok(get("used_cpu_sys")? + get("used_cpu_user")?)
}

async fn used_memory(con: &mut ConnectionManager) -> anyhow::Result<i64> {
    info(con, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .context("INFO memory has no used_memory")
}

async fn redis_time_us(con: &mut ConnectionManager) -> redis::RedisResult<i64> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(con).await?;
    Ok(s * 1_000_000 + us)
}

fn local_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

fn local_now_ms() -> i64 {
    local_now_us() / 1000
}

fn system_time_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Redis clock minus local clock (ms), from the sample with the shortest round trip.
async fn clock_offset_ms(con: &mut ConnectionManager) -> redis::RedisResult<i64> {
    let mut best = (i64::MAX, 0);
    for _ in 0..7 {
        let before = local_now_us();
        let redis_us = redis_time_us(con).await?;
        let after = local_now_us();
        let rtt = after - before;
        if rtt < best.0 {
            best = (rtt, redis_us - (before + after) / 2);
        }
    }
    Ok((best.1 as f64 / 1000.0).round() as i64)
}

async fn llen(con: &mut ConnectionManager, key: &str) -> redis::RedisResult<u64> {
    redis::cmd("LLEN").arg(key).query_async(con).await
}

async fn del(con: &mut ConnectionManager, key: &str) -> redis::RedisResult<()> {
    redis::cmd("DEL").arg(key).query_async(con).await
}

/// Jobs still in the envelope due ZSETs.
async fn due_left(env: &mut Env) -> redis::RedisResult<u64> {
    let mut pipe = redis::pipe();
    for s in 0..env.scratch.keys.shards() {
        pipe.zcard(env.scratch.keys.due(s));
    }
    let counts: Vec<u64> = pipe.query_async(&mut env.con).await?;
    Ok(counts.iter().sum())
}

fn read_first_line(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.trim().to_owned()))
}

fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// Report

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    settings: Settings,
    drain: Vec<Drain>,
    steady: Vec<Steady>,
    same_ms: Option<SameMs>,
    memory: Option<Memory>,
}

#[derive(Debug, Serialize)]
struct Machine {
    nproc: usize,
    cpu_model: Option<String>,
    mem_total: Option<String>,
    loadavg_start: Option<String>,
    loadavg_end: Option<String>,
    redis_version: Option<String>,
    redis_os: Option<String>,
    redis_hz: Option<String>,
    redis_io_threads: Option<String>,
    zdelay_version: &'static str,
    build: &'static str,
}

impl Machine {
    async fn gather(con: &mut ConnectionManager) -> anyhow::Result<Self> {
        let server = info(con, "server").await?;
        let threads = info(con, "threads").await.unwrap_or_default();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Ok(Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: parse_info(&cpuinfo).get("model name").cloned(),
            mem_total: parse_info(&meminfo).get("MemTotal").cloned(),
            loadavg_start: read_first_line("/proc/loadavg"),
            loadavg_end: None,
            redis_version: server.get("redis_version").cloned(),
            redis_os: server.get("os").cloned(),
            redis_hz: server.get("hz").cloned(),
            redis_io_threads: threads.get("io_threads_active").cloned(),
            zdelay_version: env!("CARGO_PKG_VERSION"),
            build: if cfg!(debug_assertions) {
                "debug (numbers are not representative: use --release)"
            } else {
                "release"
            },
        })
    }
}

#[derive(Debug, Serialize)]
struct Settings {
    redis_url: String,
    namespace: String,
    shards: u16,
    batch: usize,
    jobs: u64,
    payload_size: usize,
    idle_poll_ms: u64,
    mode: String,
}

/// One timed move of a whole backlog.
#[derive(Debug, Clone, Serialize)]
struct Throughput {
    jobs: u64,
    seconds: f64,
    jobs_per_sec: f64,
    redis_cpu_seconds: f64,
    redis_cpu_s_per_million: f64,
    script_calls: u64,
}

impl Throughput {
    fn new(jobs: u64, elapsed: Duration, cpu: f64, calls: u64) -> Self {
        let seconds = elapsed.as_secs_f64();
        Throughput {
            jobs,
            seconds,
            jobs_per_sec: jobs as f64 / seconds.max(1e-9),
            redis_cpu_seconds: cpu,
            redis_cpu_s_per_million: cpu * 1e6 / jobs.max(1) as f64,
            script_calls: calls,
        }
    }
}

#[derive(Debug, Serialize)]
struct Drain {
    /// "raw" or "envelope".
    source: &'static str,
    mover: &'static str,
    baseline: &'static str,
    /// Pollers (real) and loops (bare) running concurrently.
    concurrency: usize,
    /// Round with the median ratio.
    real: Throughput,
    bare: Throughput,
    ratio: f64,
    ratio_all_rounds: Vec<f64>,
    target_ratio: f64,
    meets_target: bool,
    dead: u64,
}

#[derive(Debug, Clone, Serialize)]
struct Lateness {
    jobs: u64,
    p50_ms: Option<i64>,
    p90_ms: Option<i64>,
    p99_ms: Option<i64>,
    p999_ms: Option<i64>,
    max_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
struct Steady {
    rate_target: u64,
    rate_achieved: f64,
    seconds: f64,
    enqueued: u64,
    moved: u64,
    /// Lateness by the move scripts' buckets (Redis clock at the script's start).
    lateness: Lateness,
    /// Jobs delivered before their due time (negative lateness), counted by the consumer:
    /// Redis TIME read after the pop is later than the move, so TIME < due proves one. The
    /// scripts cannot move a job early by construction: they take scores <= their own TIME.
    early_jobs: u64,
    /// Consumer view: Redis TIME read right after the pop, minus the job's due time.
    consumer: ConsumerReport,
    /// How late this process's own 1–5 ms timers fired meanwhile (whole ms, rounded down):
    /// the scheduling noise under any lateness the pollers can reach on this machine.
    timer_overshoot: Option<Lateness>,
    script_calls_per_sec: f64,
    redis_cpu_percent: f64,
    dead: u64,
    left_due: u64,
    all_delivered_once: bool,
    /// Only for the 1k/s rate: lateness p99 target.
    target_p99_ms: Option<i64>,
    meets_target: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Default)]
struct ConsumerReport {
    received: u64,
    duplicates: u64,
    missing: u64,
    unparsable: u64,
    /// Jobs whose pop finished before their due time: proof of an early delivery.
    early: u64,
    end_to_end: Option<Lateness>,
}

#[derive(Debug, Serialize)]
struct SameMs {
    jobs: u64,
    /// T minus Redis TIME when the pollers started.
    margin_ms: i64,
    /// Redis TIME at the start of the first call that moved jobs, minus T.
    first_move_after_t_ms: f64,
    /// Start of the last call that moved jobs, minus T (exact, Redis clock).
    last_call_started_after_t_ms: f64,
    /// When the poller saw the last reply, minus T (local clock + measured offset).
    all_moved_after_t_ms: f64,
    jobs_per_sec: f64,
    redis_cpu_s_per_million: f64,
    script_calls: u64,
    lateness: Lateness,
    target_ms: f64,
    /// `None` below 300k jobs: the target is for 300k.
    meets_target: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Memory {
    jobs: u64,
    payload_size: usize,
    envelope_bytes_per_job: f64,
    bare_bytes_per_job: f64,
    ratio: f64,
    aim_bytes: f64,
    /// `None` unless the payload is 100 bytes: the aim is for that size.
    meets_aim: Option<bool>,
    /// Bytes of one stored envelope (frame header + payload).
    envelope_value_bytes: usize,
}

// ---------------------------------------------------------------------------------------
// drain

async fn drain_raw(env: &mut Env) -> anyhow::Result<Drain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let key = env.scratch.raw.clone();
    let out = env.scratch.out.clone();
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        status(&format!("drain raw, round {round}: real move_raw"));
        let now = env.redis_now_ms();
        load_raw(
            &mut env.con,
            &key,
            n,
            size,
            |i| backlog_due(i, n, now),
            "load raw (real)",
        )
        .await?;
        let tally = Tally::new(LATENESS_BOUNDS_MS);
        tally.set_target(n);
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(
            vec![Target::Source(Arc::new(env.raw_source()))],
            LATENESS_BOUNDS_MS.to_vec(),
            &tally,
            false,
        );
        let done = tally.wait(drain_timeout(n)).await;
        let cpu1 = redis_cpu(&mut env.con).await?;
        movers.stop().await;
        let (done, _) = done
            .with_context(|| format!("real raw drain stalled: {} of {n} moved", tally.moved()))?;
        let real = Throughput::new(
            n,
            done - started,
            cpu1 - cpu0,
            tally.calls.load(Ordering::Relaxed),
        );
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "raw: list length != jobs"
        );
        del(&mut env.con, &out).await?;

        status(&format!("drain raw, round {round}: bare_move_raw"));
        let now = env.redis_now_ms();
        load_raw(
            &mut env.con,
            &key,
            n,
            size,
            |i| backlog_due(i, n, now),
            "load raw (bare)",
        )
        .await?;
        let max_score = env.redis_now_ms().to_string();
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let mut moved = 0u64;
        let mut calls = 0u64;
        loop {
            let got: u64 = scripts::bench_bare_move_raw
                .key(&key)
                .key(&out)
                .arg(env.batch)
                .arg(&max_score)
                .invoke_async(&mut env.con)
                .await?;
            calls += 1;
            moved += got;
            if got < env.batch as u64 {
                break;
            }
        }
        let elapsed = started.elapsed();
        let cpu1 = redis_cpu(&mut env.con).await?;
        ensure!(moved == n, "bare raw moved {moved} of {n}");
        let bare = Throughput::new(n, elapsed, cpu1 - cpu0, calls);
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "bare raw: list length != jobs"
        );
        del(&mut env.con, &out).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead));
    }
    Ok(pick_median("raw", rounds, 1, RAW_RATIO_TARGET))
}

async fn drain_envelope(env: &mut Env) -> anyhow::Result<Drain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    let shards = env.scratch.keys.shards();
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        status(&format!("drain envelope, round {round}: real move_due"));
        let now = env.redis_now_ms();
        let due = |i| backlog_due(i, n, now);
        let ids = load_envelopes(&env.producer, n, size, due, "enqueue envelopes").await?;
        let tally = Tally::new(LATENESS_BOUNDS_MS);
        tally.set_target(n);
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(
            env.shard_targets(),
            LATENESS_BOUNDS_MS.to_vec(),
            &tally,
            false,
        );
        let done = tally.wait(drain_timeout(n)).await;
        let cpu1 = redis_cpu(&mut env.con).await?;
        movers.stop().await;
        let (done, _) = done.with_context(|| {
            format!(
                "real envelope drain stalled: {} of {n} moved",
                tally.moved()
            )
        })?;
        let real = Throughput::new(
            n,
            done - started,
            cpu1 - cpu0,
            tally.calls.load(Ordering::Relaxed),
        );
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "envelope: list length != jobs"
        );
        del(&mut env.con, &out).await?;

        status(&format!("drain envelope, round {round}: bare_move_hash"));
        let keys = env.scratch.keys.clone();
        load_bare_hash(
            &mut env.con,
            &env.scratch.bare,
            |id| keys.shard_of(id),
            &ids,
            size,
            due,
            "load bare id+hash",
        )
        .await?;
        drop(ids);
        let max_score = env.redis_now_ms().to_string();
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let loops = (0..shards).map(|s| {
            let mut con = env.con.clone();
            let (due_key, jobs_key) = (env.scratch.bare.due(s), env.scratch.bare.jobs(s));
            let (out, max_score, batch) = (out.clone(), max_score.clone(), env.batch);
            async move {
                let (mut moved, mut calls) = (0u64, 0u64);
                loop {
                    let got: u64 = scripts::bench_bare_move_hash
                        .key(&due_key)
                        .key(&jobs_key)
                        .key(&out)
                        .arg(batch)
                        .arg(&max_score)
                        .invoke_async(&mut con)
                        .await?;
                    calls += 1;
                    moved += got;
                    if got < batch as u64 {
                        return Ok::<_, redis::RedisError>((moved, calls));
                    }
                }
            }
        });
        let results = futures::future::join_all(loops).await;
        let elapsed = started.elapsed();
        let cpu1 = redis_cpu(&mut env.con).await?;
        let (mut moved, mut calls) = (0, 0);
        for r in results {
            let (m, c) = r?;
            moved += m;
            calls += c;
        }
        ensure!(moved == n, "bare hash moved {moved} of {n}");
        let bare = Throughput::new(n, elapsed, cpu1 - cpu0, calls);
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "bare hash: list length != jobs"
        );
        env.scratch.clean(&mut env.con, false).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead));
    }
    Ok(pick_median(
        "envelope",
        rounds,
        shards as usize,
        ENVELOPE_RATIO_TARGET,
    ))
}

fn drain_timeout(n: u64) -> Duration {
    Duration::from_secs(60 + n / 10_000)
}

/// Keeps the round with the median real/bare ratio; lists every round's ratio.
fn pick_median(
    source: &'static str,
    mut rounds: Vec<(Throughput, Throughput, u64)>,
    concurrency: usize,
    target: f64,
) -> Drain {
    let ratio = |r: &(Throughput, Throughput, u64)| r.0.jobs_per_sec / r.1.jobs_per_sec;
    let all: Vec<f64> = rounds.iter().map(ratio).collect();
    rounds.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
    let (real, bare, dead) = rounds.swap_remove(rounds.len() / 2);
    let r = real.jobs_per_sec / bare.jobs_per_sec;
    let (mover, baseline) = match source {
        "raw" => ("move_raw (poller::run)", "bench_bare_move_raw"),
        _ => ("move_due (poller::run)", "bench_bare_move_hash"),
    };
    Drain {
        source,
        mover,
        baseline,
        concurrency,
        real,
        bare,
        ratio: r,
        ratio_all_rounds: all,
        target_ratio: target,
        meets_target: r >= target,
        dead,
    }
}

// ---------------------------------------------------------------------------------------
// same-ms

async fn same_ms(env: &mut Env) -> anyhow::Result<SameMs> {
    let n = env.args.same_ms_jobs;
    let size = env.payload_size();
    status(&format!("same-ms: {n} jobs due at one millisecond"));
    env.scratch.clean(&mut env.con, false).await?;
    // Loaded with score 1 while no poller runs; then every shard's ZSET is rescored to T
    // in one command (ZUNIONSTORE with WEIGHTS T: 1 × T = T exactly), so T can be chosen
    // after the load, whatever the load took.
    load_envelopes(&env.producer, n, size, |_| 1, "enqueue same-ms jobs").await?;
    let t_ms = redis_time_us(&mut env.con).await? / 1000 + 1_500;
    let mut pipe = redis::pipe();
    for s in 0..env.scratch.keys.shards() {
        let due = env.scratch.keys.due(s);
        pipe.cmd("ZUNIONSTORE")
            .arg(&due)
            .arg(1)
            .arg(&due)
            .arg("WEIGHTS")
            .arg(t_ms)
            .ignore();
    }
    let _: () = pipe.query_async(&mut env.con).await?;
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    tally.set_target(n);
    let margin_ms = t_ms - redis_time_us(&mut env.con).await? / 1000;
    ensure!(
        margin_ms > 100,
        "same-ms: rescoring took too long (margin {margin_ms} ms); Redis is overloaded"
    );
    let movers = env.spawn_movers(env.shard_targets(), bounds, &tally, true);
    // CPU is read around the whole wait; before T the pollers only sleep.
    let cpu0 = redis_cpu(&mut env.con).await?;
    let done = tally
        .wait(Duration::from_secs(60) + Duration::from_millis(margin_ms as u64))
        .await;
    let cpu1 = redis_cpu(&mut env.con).await?;
    movers.stop().await;
    let (_, done_wall) =
        done.with_context(|| format!("same-ms stalled: {} of {n} moved", tally.moved()))?;
    ensure!(
        llen(&mut env.con, &env.scratch.out.clone()).await? == n,
        "same-ms: list length != jobs"
    );
    env.scratch.clean(&mut env.con, false).await?;
    let all_moved = system_time_ms(done_wall) + env.clock_offset_ms as f64 - t_ms as f64;
    let first = tally.first_move_us.load(Ordering::Relaxed) as f64 / 1000.0 - t_ms as f64;
    let last = tally.last_move_us.load(Ordering::Relaxed) as f64 / 1000.0 - t_ms as f64;
    let moving_s = ((all_moved - first) / 1000.0).max(1e-6);
    Ok(SameMs {
        jobs: n,
        margin_ms,
        first_move_after_t_ms: first,
        last_call_started_after_t_ms: last,
        all_moved_after_t_ms: all_moved,
        jobs_per_sec: n as f64 / moving_s,
        redis_cpu_s_per_million: (cpu1 - cpu0) * 1e6 / n as f64,
        script_calls: tally.calls.load(Ordering::Relaxed),
        lateness: tally.hist().summary(),
        target_ms: SAME_MS_TARGET_MS,
        meets_target: (n >= SAME_MS_TARGET_JOBS).then_some(all_moved < SAME_MS_TARGET_MS),
    })
}

// ---------------------------------------------------------------------------------------
// steady

/// Small deterministic RNG (SplitMix64) for due-time jitter: reproducible runs.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough in `lo..=hi` (modulo bias is irrelevant at this range).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Jobs the producer should have sent after `elapsed` at `rate` per second.
fn due_by(rate: u64, elapsed: Duration) -> u64 {
    (rate as u128 * elapsed.as_micros() / 1_000_000) as u64
}

async fn steady(env: &mut Env, rate: u64) -> anyhow::Result<Steady> {
    ensure!(rate > 0, "--rate must be > 0");
    let duration = env.args.duration;
    status(&format!(
        "steady: {rate} jobs/s for {duration:?}, each due 100–500 ms after enqueue"
    ));
    env.scratch.clean(&mut env.con, false).await?;
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    let movers = env.spawn_movers(env.shard_targets(), bounds.clone(), &tally, true);
    wait_for_subscriber(env).await?;
    let consumer = Consumer::start(env, bounds.clone()).await?;
    let probe_stop = CancellationToken::new();
    let probe = tokio::spawn(timer_probe(probe_stop.clone(), bounds));

    let progress = bar(due_by(rate, duration), "enqueue (steady)");
    let mut rng = SplitMix64(rate ^ 0x5EED);
    let cpu0 = redis_cpu(&mut env.con).await?;
    let started = Instant::now();
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        let should = due_by(rate, elapsed);
        if should <= sent {
            continue;
        }
        let now = env.redis_now_ms();
        let jobs: Vec<NewJob> = (sent..should)
            .map(|seq| {
                let due = now + rng.between(STEADY_DELAY_MS.0, STEADY_DELAY_MS.1) as i64;
                NewJob::new(ROUTE, steady_payload(due, seq, env.args.payload_size)).at(due)
            })
            .collect();
        for r in env
            .producer
            .enqueue_batch(jobs, OnConflict::Replace)
            .await?
        {
            r?;
        }
        progress.inc(should - sent);
        sent = should;
    }
    let produced_for = started.elapsed();
    probe_stop.cancel();
    progress.finish_and_clear();
    tally.set_target(sent);
    let wait = Duration::from_millis(STEADY_DELAY_MS.1) + Duration::from_secs(30);
    let done = tally.wait(wait).await;
    let cpu1 = redis_cpu(&mut env.con).await?;
    let elapsed = started.elapsed();
    movers.stop().await;
    let consumer = consumer.finish(sent, Duration::from_secs(10)).await;
    let left_due = due_left(env).await?;
    let timer_overshoot = probe.await.ok().map(|h| h.summary());
    env.scratch.clean(&mut env.con, false).await?;
    if done.is_none() {
        tracing::warn!(
            moved = tally.moved(),
            sent,
            "steady: not everything moved in time"
        );
    }
    let hist = tally.hist();
    let lateness = hist.summary();
    let at_target_rate = rate == STEADY_P99_TARGET_RATE;
    let moved = tally.moved();
    let dead = tally.dead.load(Ordering::Relaxed);
    let all_once = consumer.early == 0
        && moved == sent
        && consumer.received == sent
        && consumer.duplicates == 0
        && consumer.missing == 0
        && left_due == 0
        && dead == 0;
    Ok(Steady {
        rate_target: rate,
        rate_achieved: sent as f64 / produced_for.as_secs_f64(),
        seconds: produced_for.as_secs_f64(),
        enqueued: sent,
        moved,
        early_jobs: consumer.early,
        consumer,
        timer_overshoot,
        script_calls_per_sec: tally.calls.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        redis_cpu_percent: (cpu1 - cpu0) * 100.0 / elapsed.as_secs_f64(),
        dead,
        left_due,
        all_delivered_once: all_once,
        target_p99_ms: at_target_rate.then_some(STEADY_P99_TARGET_MS),
        meets_target: at_target_rate
            .then(|| lateness.p99_ms.is_some_and(|p| p <= STEADY_P99_TARGET_MS) && all_once),
        lateness,
    })
}

/// Sleeps 1–5 ms again and again, recording how late each timer fired.
async fn timer_probe(stop: CancellationToken, bounds: Vec<u64>) -> Hist {
    let mut hist = Hist::new(&bounds);
    let mut rng = SplitMix64(7);
    while !stop.is_cancelled() {
        let target = Instant::now() + Duration::from_micros(rng.between(1_000, 5_000));
        tokio::time::sleep_until(target.into()).await;
        let late = Instant::now().saturating_duration_since(target);
        hist.add((late.as_micros() / 1000) as i64);
    }
    hist
}

/// Waits until the wake listener has subscribed (so the first wake-ups are not lost).
async fn wait_for_subscriber(env: &mut Env) -> anyhow::Result<()> {
    let channel = env.scratch.keys.wake_channel();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, subscribers): (String, u64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut env.con)
            .await?;
        if subscribers > 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the wake listener did not subscribe in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Pops the output list as a worker would (BLMPOP), reading Redis TIME right after each
/// pop in the same pipeline: that time is after the move, so `time < due` proves an early
/// delivery. It also checks each job arrives exactly once (by its sequence number).
struct Consumer {
    expected: Arc<AtomicU64>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<ConsumerReport>>,
}

impl Consumer {
    async fn start(env: &Env, bounds: Vec<u64>) -> anyhow::Result<Self> {
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5)));
        let mut con = env
            .redis
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let list = env.scratch.out.clone();
        let expected = Arc::new(AtomicU64::new(u64::MAX));
        let stop = CancellationToken::new();
        let (exp, stop2) = (expected.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut seen: Vec<u8> = Vec::new();
            let mut report = ConsumerReport::default();
            let mut hist = Hist::new(&bounds);
            while report.received < exp.load(Ordering::Acquire) && !stop2.is_cancelled() {
                type Popped = Option<(String, Vec<Vec<u8>>)>;
                let (popped, (secs, micros)): (Popped, (i64, i64)) = redis::pipe()
                    .cmd("BLMPOP")
                    .arg(0.1)
                    .arg(1)
                    .arg(&list)
                    .arg("RIGHT")
                    .arg("COUNT")
                    .arg(1000)
                    .cmd("TIME")
                    .query_async(&mut con)
                    .await?;
                let now_ms = secs * 1000 + micros / 1000;
                for p in popped.map(|(_, items)| items).unwrap_or_default() {
                    report.received += 1;
                    let Some((due, seq)) = parse_steady_payload(&p) else {
                        report.unparsable += 1;
                        continue;
                    };
                    let late = now_ms - due;
                    if late < 0 {
                        report.early += 1;
                    }
                    hist.add(late);
                    let seq = seq as usize;
                    if seq >= seen.len() {
                        seen.resize(seq + 1, 0);
                    }
                    seen[seq] = seen[seq].saturating_add(1);
                }
            }
            report.duplicates = seen.iter().map(|&c| c.saturating_sub(1) as u64).sum();
            let distinct = seen.iter().filter(|&&c| c > 0).count() as u64;
            let expected = exp.load(Ordering::Acquire);
            report.missing = expected.saturating_sub(distinct);
            report.end_to_end = Some(hist.summary());
            Ok(report)
        });
        Ok(Consumer {
            expected,
            stop,
            task,
        })
    }

    /// Tells the consumer how many jobs to expect and waits for them (or `timeout`).
    async fn finish(self, expected: u64, timeout: Duration) -> ConsumerReport {
        self.expected.store(expected, Ordering::Release);
        let stop = self.stop.clone();
        let guard = tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            stop.cancel();
        });
        let report = match self.task.await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "steady consumer failed");
                ConsumerReport::default()
            }
            Err(e) => {
                tracing::warn!(error = %e, "steady consumer panicked");
                ConsumerReport::default()
            }
        };
        guard.abort();
        report
    }
}

// ---------------------------------------------------------------------------------------
// memory

async fn memory(env: &mut Env) -> anyhow::Result<Memory> {
    let n = env.args.jobs;
    let size = env.payload_size();
    status(&format!("memory: {n} envelope jobs, then the bare layout"));
    env.scratch.clean(&mut env.con, false).await?;
    let later = env.redis_now_ms() + 86_400_000;
    let due = |i: u64| later + i as i64;
    let before = used_memory(&mut env.con).await?;
    let ids = load_envelopes(&env.producer, n, size, due, "enqueue envelopes").await?;
    let after = used_memory(&mut env.con).await?;
    let envelope = (after - before) as f64 / n as f64;
    let sample: Vec<u8> = redis::cmd("HGET")
        .arg(env.scratch.keys.jobs(env.scratch.keys.shard_of(&ids[0])))
        .arg(&ids[0])
        .query_async(&mut env.con)
        .await?;
    env.scratch.clean(&mut env.con, false).await?;

    let before = used_memory(&mut env.con).await?;
    let keys = env.scratch.keys.clone();
    load_bare_hash(
        &mut env.con,
        &env.scratch.bare,
        |id| keys.shard_of(id),
        &ids,
        size,
        due,
        "load bare id+hash",
    )
    .await?;
    let after = used_memory(&mut env.con).await?;
    let bare = (after - before) as f64 / n as f64;
    env.scratch.clean(&mut env.con, false).await?;
    Ok(Memory {
        jobs: n,
        payload_size: size,
        envelope_bytes_per_job: envelope,
        bare_bytes_per_job: bare,
        ratio: envelope / bare,
        aim_bytes: MEMORY_AIM_BYTES,
        meets_aim: (size == MEMORY_AIM_PAYLOAD).then_some(envelope <= MEMORY_AIM_BYTES),
        envelope_value_bytes: sample.len(),
    })
}

// ---------------------------------------------------------------------------------------
// Rendering

fn opt(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn verdict(ok: bool) -> &'static str {
    if ok { "meets target" } else { "MISSES target" }
}

fn render(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let st = &r.settings;
    let _ = writeln!(s, "zdelay bench {} ({})", m.zdelay_version, m.build);
    let _ = writeln!(
        s,
        "machine: {} cpus ({}), {} RAM, load avg {} at start, {} at end",
        m.nproc,
        m.cpu_model.as_deref().unwrap_or("?"),
        m.mem_total.as_deref().unwrap_or("?"),
        m.loadavg_start.as_deref().unwrap_or("?"),
        m.loadavg_end.as_deref().unwrap_or("?"),
    );
    let _ = writeln!(
        s,
        "redis: {} {} at {}, hz {}",
        m.redis_version.as_deref().unwrap_or("?"),
        m.redis_os.as_deref().unwrap_or("?"),
        st.redis_url,
        m.redis_hz.as_deref().unwrap_or("?"),
    );
    let _ = writeln!(
        s,
        "settings: namespace {}, {} shards, batch {}, {} jobs, payload {} B, idle poll {} ms",
        st.namespace, st.shards, st.batch, st.jobs, st.payload_size, st.idle_poll_ms
    );
    if !r.drain.is_empty() {
        let _ = writeln!(
            s,
            "\ndrain (all-due backlog; Redis CPU = used_cpu_sys+user delta)"
        );
        let _ = writeln!(
            s,
            "  {:<9} {:<24} {:>9} {:>8} {:>11} {:>10} {:>7}",
            "source", "mover", "jobs", "seconds", "jobs/s", "cpu s/M", "calls"
        );
        for d in &r.drain {
            for (name, t) in [(d.mover, &d.real), (d.baseline, &d.bare)] {
                let _ = writeln!(
                    s,
                    "  {:<9} {:<24} {:>9} {:>8.3} {:>11.0} {:>10.2} {:>7}",
                    d.source,
                    name,
                    t.jobs,
                    t.seconds,
                    t.jobs_per_sec,
                    t.redis_cpu_s_per_million,
                    t.script_calls
                );
            }
            let rounds: Vec<String> = d
                .ratio_all_rounds
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect();
            let _ = writeln!(
                s,
                "  {:<9} ratio {:.2} (rounds: {}), target >= {:.1}: {}; cpu ratio bare/real {:.2}; dead {}",
                d.source,
                d.ratio,
                rounds.join(" "),
                d.target_ratio,
                verdict(d.meets_target),
                d.bare.redis_cpu_s_per_million / d.real.redis_cpu_s_per_million.max(1e-9),
                d.dead
            );
        }
    }
    if let Some(x) = &r.same_ms {
        let _ = writeln!(s, "\nsame-ms ({} envelope jobs due at one ms T)", x.jobs);
        let _ = writeln!(
            s,
            "  first move at T+{:.1} ms, last call started T+{:.1} ms, all moved by T+{:.1} ms \
             (target < {:.0} ms for {} jobs: {})",
            x.first_move_after_t_ms,
            x.last_call_started_after_t_ms,
            x.all_moved_after_t_ms,
            x.target_ms,
            SAME_MS_TARGET_JOBS,
            x.meets_target.map_or("not judged", verdict)
        );
        let _ = writeln!(
            s,
            "  {:.0} jobs/s while moving, {:.2} Redis cpu s/M, {} script calls, margin {} ms",
            x.jobs_per_sec, x.redis_cpu_s_per_million, x.script_calls, x.margin_ms
        );
    }
    if !r.steady.is_empty() {
        let _ = writeln!(
            s,
            "\nsteady (each job due 100-500 ms after enqueue; lateness ms from the scripts' buckets)"
        );
        let _ = writeln!(
            s,
            "  {:>7} {:>9} {:>8} {:>8} {:>4} {:>4} {:>4} {:>5} {:>5} {:>5} {:>9} {:>9} {:>8} {:>7}",
            "rate",
            "achieved",
            "jobs",
            "moved",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "early",
            "e2e p99",
            "timer p99",
            "calls/s",
            "cpu %"
        );
        for x in &r.steady {
            let l = &x.lateness;
            let e2e = x.consumer.end_to_end.as_ref().and_then(|e| e.p99_ms);
            let _ = writeln!(
                s,
                "  {:>7} {:>9.0} {:>8} {:>8} {:>4} {:>4} {:>4} {:>5} {:>5} {:>5} {:>9} {:>9} {:>8.0} {:>7.1}",
                x.rate_target,
                x.rate_achieved,
                x.enqueued,
                x.moved,
                opt(l.p50_ms),
                opt(l.p90_ms),
                opt(l.p99_ms),
                opt(l.p999_ms),
                opt(l.max_ms),
                x.early_jobs,
                opt(e2e),
                opt(x.timer_overshoot.as_ref().and_then(|t| t.p99_ms)),
                x.script_calls_per_sec,
                x.redis_cpu_percent
            );
        }
        for x in &r.steady {
            let _ = writeln!(
                s,
                "  {}/s: delivered once and never early: {} (consumer got {}, duplicates {}, missing {}, dead {}, left due {}){}",
                x.rate_target,
                if x.all_delivered_once { "yes" } else { "NO" },
                x.consumer.received,
                x.consumer.duplicates,
                x.consumer.missing,
                x.dead,
                x.left_due,
                match (x.target_p99_ms, x.meets_target) {
                    (Some(t), Some(ok)) => format!("; p99 target <= {t} ms: {}", verdict(ok)),
                    _ => String::new(),
                }
            );
        }
    }
    if let Some(x) = &r.memory {
        let _ = writeln!(s, "\nmemory (INFO memory used_memory delta / jobs)");
        let _ = writeln!(
            s,
            "  envelope job: {:.0} B (stored value {} B), bare id+hash: {:.0} B, ratio {:.2}; \
             aim <= {:.0} B with {} B payloads: {}",
            x.envelope_bytes_per_job,
            x.envelope_value_bytes,
            x.bare_bytes_per_job,
            x.ratio,
            x.aim_bytes,
            MEMORY_AIM_PAYLOAD,
            match x.meets_aim {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "not judged",
            }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_match_the_scripts_rule() {
        let bounds = [0, 1, 2, 5];
        assert_eq!(bucket_index(&bounds, -3), 0);
        assert_eq!(bucket_index(&bounds, 0), 0);
        assert_eq!(bucket_index(&bounds, 1), 1);
        assert_eq!(bucket_index(&bounds, 3), 3);
        assert_eq!(bucket_index(&bounds, 5), 3);
        assert_eq!(bucket_index(&bounds, 6), 4);
    }

    #[test]
    fn percentile_uses_nearest_rank_and_caps_by_max() {
        let bounds = [0, 1, 2, 10];
        // 50 jobs at 0 ms, 40 at 1 ms, 9 at 2 ms, 1 in (2, 10] with max 7.
        let counts = [50, 40, 9, 1, 0];
        assert_eq!(percentile(&bounds, &counts, 7, 0.50), Some(0));
        assert_eq!(percentile(&bounds, &counts, 7, 0.51), Some(1));
        assert_eq!(percentile(&bounds, &counts, 7, 0.90), Some(1));
        assert_eq!(percentile(&bounds, &counts, 7, 0.99), Some(2));
        assert_eq!(percentile(&bounds, &counts, 7, 1.0), Some(7));
        assert_eq!(percentile(&bounds, &[0; 5], 0, 0.5), None);
        // The overflow bucket answers the largest value seen.
        assert_eq!(percentile(&bounds, &[0, 0, 0, 0, 3], 250, 0.5), Some(250));
    }

    #[test]
    fn hist_adds_script_buckets_and_single_values() {
        let mut h = Hist::new(&[0, 1, 2]);
        h.add_buckets(&[1, 2, 0, 0], 1);
        h.add(2);
        h.add(9);
        assert_eq!(h.counts, vec![1, 2, 1, 1]);
        assert_eq!(h.max, 9);
        let s = h.summary();
        assert_eq!(s.jobs, 5);
        assert_eq!(s.p50_ms, Some(1));
        assert_eq!(s.max_ms, Some(9));
        assert_eq!(Hist::new(&[1]).summary().max_ms, None);
    }

    #[test]
    fn fine_bounds_are_ascending_and_1ms_wide_to_50() {
        let b = fine_bounds();
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(&b[..51], &(0..=50).collect::<Vec<_>>()[..]);
        assert!(b.len() < 100, "stay far below Lua's unpack limit");
    }

    #[test]
    fn payloads_are_unique_and_sized() {
        assert_eq!(payload(7, 100).len(), 100);
        assert_ne!(payload(7, 100), payload(8, 100));
        assert_eq!(payload(7, 1).len(), MIN_PAYLOAD);
        let p = steady_payload(1_700_000_000_123, 42, 100);
        assert_eq!(p.len(), 100);
        assert_eq!(parse_steady_payload(&p), Some((1_700_000_000_123, 42)));
        assert_eq!(parse_steady_payload(b"nonsense"), None);
    }

    #[test]
    fn producer_schedule_and_rng() {
        assert_eq!(due_by(1_000, Duration::from_millis(1500)), 1_500);
        assert_eq!(due_by(50_000, Duration::from_micros(10)), 0);
        let mut r = SplitMix64(1);
        for _ in 0..1000 {
            assert!((100..=500).contains(&r.between(100, 500)));
        }
        assert_eq!(SplitMix64(9).next(), SplitMix64(9).next());
    }

    #[test]
    fn info_and_urls() {
        let info = parse_info("# CPU\r\nused_cpu_sys:1.50\r\nused_cpu_user:2.25\r\n");
        assert_eq!(info["used_cpu_sys"], "1.50");
        assert_eq!(info["used_cpu_user"], "2.25");
        assert_eq!(redact("redis://:pw@host:1/0"), "redis://***@host:1/0");
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }

    #[test]
    fn backlog_is_due_and_ascending() {
        let now = 1_000_000_000_000;
        let d: Vec<i64> = (0..5).map(|i| backlog_due(i, 5, now)).collect();
        assert!(d.windows(2).all(|w| w[0] < w[1]));
        assert!(d.iter().all(|&x| x < now - 60_000));
    }

    #[test]
    fn scratch_keys_stay_in_the_namespace() {
        let s = Scratch::new("zdelay-bench", 2);
        for k in s.data_keys() {
            assert!(
                k.starts_with("zdelay-bench:") || k.starts_with("{zdelay-bench:"),
                "{k}"
            );
        }
        assert_eq!(s.data_keys().len(), 2 * 7 + 4);
    }
}

/// `--route`: throughput of one two-phase route, end to end.
#[derive(Debug, serde::Serialize)]
struct SinkDrainReport {
    route: String,
    sink: String,
    kind: String,
    jobs: u64,
    payload_size: usize,
    batch: usize,
    shards: u16,
    seconds: f64,
    per_second: f64,
    dead: u64,
}

async fn sink_drain(env: &mut Env, route: &str) -> anyhow::Result<SinkDrainReport> {
    let remote = crate::sinks::RemoteRoutes::from_config(&env.config);
    let dest = remote.resolve(route).map_err(|e| {
        anyhow::anyhow!("--route {route}: not a two-phase route of the config ({e})")
    })?;
    let sinks = crate::sinks::build_all(&env.config)?;
    let sink = sinks
        .get(&dest.sink)
        .cloned()
        .with_context(|| format!("sink {} not built", dest.sink))?;
    sink.sink
        .check()
        .await
        .map_err(|e| anyhow::anyhow!("sink {} is not reachable: {e}", dest.sink))?;
    let n = env.args.jobs;
    let size = env.payload_size().max(MIN_PAYLOAD);
    let past = env.redis_now_ms() - 1_000;
    load_envelopes_to(
        &env.producer,
        route,
        n,
        size,
        |_| past,
        "loading jobs for the route",
    )
    .await?;
    let keys = env.scratch.keys.clone();
    let ctx = Arc::new(PollerContext {
        con: env.con.clone(),
        keys: keys.clone(),
        routes: LocalRoutes::default(),
        batch: env.batch.min(1000),
        idle_poll: env.config.poller.idle_poll,
        max_payload: env.config.poller.max_payload,
        bounds_ms: crate::metrics::LATENESS_BOUNDS_MS.to_vec(),
        observer: None,
        remote,
        sinks,
        lease: env.config.poller.lease,
        sink_pause: env.config.poller.sink_pause,
        max_attempts: env.config.poller.max_attempts,
        retry_base: env.config.poller.retry_base,
        retry_cap: env.config.poller.retry_cap,
    });
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let started = Instant::now();
    for shard in 0..keys.shards() {
        tracker.spawn(poller::run(
            ctx.clone(),
            Target::Shard(shard),
            Arc::new(Notify::new()),
            shutdown.clone(),
        ));
    }
    tracker.close();
    // Done when no job is stored any more: every one was confirmed and acked (or died).
    let elapsed = loop {
        let mut pipe = redis::pipe();
        for shard in 0..keys.shards() {
            pipe.hlen(keys.jobs(shard));
        }
        let left: Vec<u64> = pipe.query_async(&mut env.con).await?;
        let mut pipe = redis::pipe();
        for shard in 0..keys.shards() {
            pipe.zcard(keys.dead(shard));
        }
        let dead: Vec<u64> = pipe.query_async(&mut env.con).await?;
        if left.iter().sum::<u64>() == dead.iter().sum::<u64>() {
            break started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    shutdown.cancel();
    tracker.wait().await;
    let mut dead = 0;
    for shard in 0..keys.shards() {
        let d: u64 = redis::cmd("ZCARD")
            .arg(keys.dead(shard))
            .query_async(&mut env.con)
            .await?;
        dead += d;
    }
    sink.sink.flush(Duration::from_secs(5)).await;
    Ok(SinkDrainReport {
        route: route.to_owned(),
        sink: dest.sink.clone(),
        kind: sink.kind.to_owned(),
        jobs: n,
        payload_size: size,
        batch: env.batch.min(1000),
        shards: keys.shards(),
        seconds: elapsed.as_secs_f64(),
        per_second: (n - dead) as f64 / elapsed.as_secs_f64(),
        dead,
    })
}
