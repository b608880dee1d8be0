//! `zdelay-bench`: measures the mover against a given Redis, in a scratch namespace. A
//! crate and binary of its own, so that the shipped `zdelay` binary does not carry it; it
//! drives the daemon's library (`zdelay`) in process and its binary as processes.
//!
//! Every mode but `idle` and `--daemons` runs the product's own code in process: the pollers
//! started by `zdelay::poller::start` on the context the daemon builds (the config's local
//! routes registered as route lanes, the spread shards for its two-phase routes), with a
//! `BatchObserver` that counts moved jobs and adds up the scripts' lateness buckets, and the
//! wake listener where wake-ups matter; and `Client::enqueue_batch`, given the config's
//! routes, for jobs, which it writes into the bench route's lane. Jobs are loaded (with a
//! progress bar) before any clock starts: filling a ZSET runs at ~200k/s and must not count.
//!
//! One file per mode (`drain`, `steady`, `same_ms`, `memory`, `route`, ...), with the
//! arguments (`args`), scratch keys (`scratch`), loading (`load`), counting (`tally`), Redis
//! and machine facts (`measure`) and the report (`report`) beside them.
//!
//! Modes:
//! - `drain`: an all-due backlog. Raw source: N members in one ZSET moved by the real
//!   `move_raw` poller, then the same N members moved by `bench_bare_move_raw` at the same
//!   batch size. Jobs: N jobs in the bench route's lane moved by its real `move_lane` poller
//!   (one lane, one mover), then the same stored ids and payloads in one bare id ZSET +
//!   payload HASH moved by one `bench_bare_move_hash` loop. Reported: jobs/s, Redis CPU
//!   seconds per million jobs (`INFO cpu` deltas), and real/bare ratios by both.
//! - `steady`: a producer enqueues at a fixed rate, each job due 100–500 ms after its
//!   enqueue, while pollers and the wake listener run. Lateness comes from the scripts'
//!   buckets (1 ms wide up to 50 ms). A consumer pops the list and checks every job arrived
//!   once and none arrived before its due time (see `Consumer`).
//! - `same-ms`: jobs all due at one millisecond T; time from T until the last one moved.
//! - `memory`: `INFO memory` used_memory per job in the route lane, and per job in the bare
//!   layout with the same ids.
//! - `lane`: the lane scripts called directly, side by side with the bare moves.
//! - `idle` (not in `all`): one `zdelay run` per config of `--routes` local routes or
//!   `--sources` raw sources at `--shards`, nothing due: Redis and daemon CPU, commands/s,
//!   once the daemon's wake-ups are confirmed (`idle`).
//! - `console` (not in `all`): the console's pages and API over HTTP, and the forecast, on
//!   `--jobs` scheduled jobs.
//! - `upgrade` (not in `all`): `zdelay upgrade` of a layout-1 namespace loaded as an older
//!   release wrote it.
//!
//! - `--daemons N` (drain, steady): the same measurements from outside N `zdelay run`
//!   processes of the `zdelay` binary (`--zdelay-bin`, else the one beside this binary;
//!   `daemons` starts and stops them, `fleet` measures), on one Redis or a Redis Cluster.
//!
//! Scratch keys: see `scratch`. They are deleted before and after; a namespace that holds
//! any of them is refused unless `--force`, and one with live daemons always. The in-process
//! modes need a single Redis (the raw source and the bare baselines do not share the list's
//! hash slot); on a cluster, `--daemons` measures what users get there.

mod args;
mod console;
mod daemons;
mod direct;
mod drain;
mod fleet;
mod flow;
mod idle;
mod lane;
mod load;
mod measure;
mod memory;
mod report;
mod route;
mod same_ms;
mod schedules;
mod scratch;
mod steady;
mod stream;
mod tally;
mod upgrade;

pub use args::{BenchArgs, Mode};

/// The benchmark's command-line reference page, written by `zdelay-bench --gen-docs`.
pub const REFERENCE_PAGE: &str = "docs/reference/bench.md";
/// How to regenerate [`REFERENCE_PAGE`], for its header and the freshness test's message.
pub const REGENERATE: &str = "cargo run -p zdelay-bench -- --gen-docs .";

/// The `zdelay-bench` command line.
#[derive(clap::Parser, Debug)]
#[command(
    name = "zdelay-bench",
    version,
    about = "Measure zdelay's throughput, lateness, memory and idle cost against a Redis (use a \
             scratch Redis or namespace)."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: zdelay::startup::GlobalArgs,
    #[command(flatten)]
    pub bench: BenchArgs,
    /// Write the benchmark's command-line reference page under this repository root instead
    /// of measuring; with --check, only say whether it differs (exit 1).
    #[arg(long, value_name = "ROOT", hide = true)]
    pub gen_docs: Option<std::path::PathBuf>,
    /// With --gen-docs: check only.
    #[arg(long, requires = "gen_docs", hide = true)]
    pub check: bool,
}

/// The benchmark's command-line reference page as it should be.
pub fn reference_page() -> String {
    zdelay::reference::command_page(
        <Cli as clap::CommandFactory>::command(),
        "# Benchmark command line\n\n\
         `zdelay-bench` is the project's benchmark, a binary of its own (not in the `zdelay` \
         image): build it from the repository with `cargo build --release -p zdelay-bench`. \
         `zdelay-bench --help` prints the same. It takes the same config file, `ZDELAY_…` \
         variables and global options as `zdelay`; `--daemons` and `--mode idle` start \
         `zdelay run` processes of the `zdelay` binary beside it (or `--zdelay-bin`). What \
         each mode measures and the figures: [Benchmarks](../operations/benchmarks.md).\n",
        REGENERATE,
    )
}

/// `--gen-docs ROOT [--check]`: whether the page under `root` was stale (and, unless
/// `check_only`, has been written).
pub fn gen_docs(root: &std::path::Path, check_only: bool) -> anyhow::Result<bool> {
    zdelay::reference::update_file(root, REFERENCE_PAGE, &reference_page(), check_only)
        .map_err(anyhow::Error::msg)
}

use anyhow::{bail, ensure};
use load::MIN_PAYLOAD;
use measure::{clock_offset_ms, local_now_ms, read_first_line};
use report::{Machine, Report, Settings};
use scratch::Scratch;
use std::sync::Arc;
use tally::Tally;
use tokio_util::sync::CancellationToken;
use zdelay::poller::{
    self, BatchObserver, Options, Owned, Ownership, PollerContext, Pollers, Target, TargetId,
};
use zdelay_core::config::{Config, RouteConfig, SourceConfig, redact_url};
use zdelay_core::keys::{Keys, LaneKeys};
use zdelay_core::store::scripts::{self, MoveReply};
use zdelay_core::store::{self, Conn};
use zdelay_core::{Client, Routes};

/// Targets from the foundation issue (ratios to a bare move measured in the same run).
const RAW_RATIO_TARGET: f64 = 0.8;
/// The raw move against the bare move that makes the same size checks, by Redis CPU per job.
const RAW_CHECKED_RATIO_TARGET: f64 = 0.95;
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
    ensure!(
        args.routes.iter().all(|r| (1..=10_000).contains(r)),
        "--routes takes counts of 1 to 10000 local routes"
    );
    ensure!(
        args.sources.iter().all(|s| (1..=10_000).contains(s)),
        "--sources takes counts of 1 to 10000 raw sources"
    );
    ensure!(
        args.sources.is_empty() || args.mode == Mode::Idle,
        "--sources is for --mode idle"
    );
    ensure!(
        !args.with_sink || args.mode == Mode::Idle,
        "--with-sink is for --mode idle"
    );
    ensure!(
        args.duration.is_none_or(|d| !d.is_zero()),
        "--duration must be > 0"
    );
    let shards = args.shards.unwrap_or(config.redis.shards);
    ensure!(shards > 0, "--shards must be > 0");
    let cluster = !config.redis.cluster_nodes.is_empty();
    if args.daemons.is_some() {
        ensure!(
            args.route.is_some() || matches!(args.mode, Mode::Drain | Mode::Steady | Mode::All),
            "--daemons measures --mode drain, steady or all (drain, then steady), or --route"
        );
        ensure!(
            args.beside.is_none(),
            "--daemons does not combine with --beside"
        );
        ensure!(
            batch <= 1000,
            "--daemons: the daemon allows --batch up to 1000"
        );
    } else if cluster
        && args.route.is_none()
        && !matches!(args.mode, Mode::Lane | Mode::Flow | Mode::Stream)
    {
        bail!(
            "redis.cluster_nodes is set: the in-process modes need one Redis (their bare \
             baselines and raw source push across slots); on a cluster run \
             `zdelay-bench --daemons N --mode drain|steady`"
        );
    }
    let scratch = Scratch::new(&args.namespace, shards);
    let config = bench_config(config, &scratch, &args.namespace, shards);
    let redis_cfg = config.redis.clone();
    let redis = store::client(&redis_cfg)?;
    let mut con = Conn::connect(&redis_cfg).await?;

    let occupied: u64 = redis::cmd("EXISTS")
        .arg(scratch.all_data_keys(&mut con).await?)
        .query_async(&mut con)
        .await?;
    if occupied > 0 && !args.force {
        bail!(
            "namespace {:?} holds {occupied} keys with data on {} (jobs, lists or raw members); \
             refusing to delete them: use another --namespace, or --force",
            args.namespace,
            redact_url(&redis_cfg.url)
        );
    }
    let now_ms = store::server_time_ms(&mut con).await?;
    let live = zdelay::stats::instances(&mut con, &scratch.keys, now_ms).await?;
    if !live.is_empty() {
        bail!(
            "{} daemon(s) run on namespace {:?} ({}): they would move the bench's jobs; stop \
             them or use another --namespace",
            live.len(),
            args.namespace,
            live.iter()
                .map(|i| i.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    scratch.clean(&mut con, true).await?;
    scripts::load_all(&mut con).await?;
    // Given the config's routes, as a producer that knows them: it registers the bench
    // route's lane if no daemon has, and writes its jobs there.
    let producer = Client::connect(&redis_cfg)
        .await?
        .with_routes(Routes::from_config(&config));

    let mut report = Report {
        machine: Machine::gather(&mut con).await?,
        settings: Settings {
            redis_url: redact_url(&redis_cfg.url),
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
        daemons: None,
        schedules: Vec::new(),
        console: None,
        lane: None,
        flow: None,
        stream: None,
        idle: None,
        upgrade: None,
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
        sinks: Default::default(),
    };
    if env.args.beside.is_some() {
        env.sinks = zdelay::sinks::build_all(&env.config)?;
    }
    env.clock_offset_ms = clock_offset_ms(&mut env.con).await?;

    if let Some(route) = env.args.route.clone() {
        let result = route::sink_drain(&mut env, &route).await;
        let cleaned = env.scratch.clean(&mut env.con, true).await;
        let report = result?;
        cleaned?;
        if args.is_json() {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            let through = match report.daemons {
                Some(n) => format!("{n} zdelay run processes"),
                None => "pollers in this process".to_owned(),
            };
            println!(
                "route {} (sink {}, {}): {} jobs of {} bytes, batch {}, {} shards, {}, {}\n\
                 confirmed and acked in {:.2} s = {:.0} msgs/s; dead {}; \
                 CPU per job: Redis {:.1} µs, zdelay {:.1} µs",
                report.route,
                report.sink,
                report.kind,
                report.jobs,
                report.payload_size,
                report.batch,
                report.shards,
                through,
                if report.cluster {
                    "a cluster"
                } else {
                    "one Redis"
                },
                report.seconds,
                report.per_second,
                report.dead,
                report.redis_us_per_job,
                report.zdelay_us_per_job
            );
            if let Some(masters) = report.redis_masters_us_per_job {
                println!(
                    "  of Redis's: the masters {masters:.1} µs, the replicas {:.1} µs",
                    report.redis_us_per_job - masters
                );
            }
            if !report.by_script.is_empty() {
                let parts: Vec<String> = report
                    .by_script
                    .iter()
                    .map(|c| format!("{} {:.1} µs ({} calls)", c.name, c.us_per_job, c.calls))
                    .collect();
                println!(
                    "  Redis execution time per job (SLOWLOG, every call{}): {}",
                    if report.by_script_partial {
                        "; the log filled, the first calls are missing"
                    } else {
                        ""
                    },
                    parts.join(", ")
                );
            }
            for d in &report.direct {
                println!(
                    "  direct, {}: {:.2} s = {:.0} msgs/s",
                    d.client, d.seconds, d.per_second
                );
            }
            if let Some(ratio) = report.ratio {
                println!("  zdelay / direct: {ratio:.2}");
            }
        }
        return Ok(());
    }
    let result = match args.daemons {
        Some(n) => fleet::run(&mut env, n).await.map(|f| {
            report.daemons = Some(f);
        }),
        None => run_modes(&mut env, &mut report).await,
    };
    // Clean up whatever happened.
    let cleaned = env.scratch.clean(&mut env.con, true).await;
    result?;
    cleaned?;
    report.machine.loadavg_end = read_first_line("/proc/loadavg");

    if args.is_json() {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render(&report));
    }
    Ok(())
}

async fn run_modes(env: &mut Env, report: &mut Report) -> anyhow::Result<()> {
    let all = env.args.mode == Mode::All;
    if all || env.args.mode == Mode::Drain {
        report.drain.push(drain::drain_raw(env).await?);
        for routes in env.args.routes.clone() {
            env.set_routes(routes);
            let drained = drain::drain_lane(env).await;
            env.set_routes(1);
            let mut drained = drained?;
            drained.routes = routes;
            report.drain.push(drained);
        }
    }
    if all || env.args.mode == Mode::SameMs {
        report.same_ms = Some(same_ms::same_ms(env).await?);
    }
    if all || env.args.mode == Mode::Steady {
        for rate in env.args.rate.clone() {
            report.steady.push(steady::steady(env, rate).await?);
        }
    }
    if all || env.args.mode == Mode::Memory {
        report.memory = Some(memory::memory(env).await?);
    }
    if env.args.mode == Mode::Idle {
        report.idle = Some(idle::idle(env).await?);
    }
    if env.args.mode == Mode::Console {
        report.console = Some(console::console(env).await?);
    }
    if env.args.mode == Mode::Lane {
        report.lane = Some(lane::lane(env).await?);
    }
    if env.args.mode == Mode::Flow {
        report.flow = Some(flow::flow(env).await?);
    }
    if env.args.mode == Mode::Stream {
        report.stream = Some(stream::stream(env).await?);
    }
    if env.args.mode == Mode::Upgrade {
        report.upgrade = Some(upgrade::upgrade(env).await?);
    }
    if env.args.mode == Mode::Schedules {
        for n in env.args.schedules.clone() {
            report.schedules.push(schedules::schedules(env, n).await?);
        }
    }
    Ok(())
}

/// The config the bench's pollers run with: the scratch namespace, one local route
/// `bench` onto the scratch list, and the scratch raw source delivering to it; sinks and
/// poller settings as configured (for `--route`).
fn bench_config(mut config: Config, scratch: &Scratch, namespace: &str, shards: u16) -> Config {
    config.redis.namespace = namespace.to_owned();
    config.redis.shards = shards;
    config.routes.push(RouteConfig::new(
        ROUTE,
        zdelay_core::config::LOCAL_SINK,
        scratch.out.clone(),
    ));
    config.sources = vec![SourceConfig {
        key: scratch.raw.source.clone(),
        score_unit: Default::default(),
        route: ROUTE.into(),
        dead_key: None,
    }];
    config
}

/// What every mode needs.
struct Env {
    con: Conn,
    /// For pub/sub (the wake listener) and the steady consumer's own connection.
    redis: redis::Client,
    producer: Client,
    config: Config,
    args: BenchArgs,
    scratch: Scratch,
    batch: usize,
    /// Redis clock minus the local clock, ms (0 on the same host).
    clock_offset_ms: i64,
    /// The config's two-phase sinks, when a mode publishes through one (`--beside`).
    sinks: zdelay::sinks::Sinks,
}

impl Env {
    /// The `zdelay` binary that `--daemons` and `--mode idle` run.
    fn daemon_binary(&self) -> std::path::PathBuf {
        daemons::zdelay_binary(self.args.zdelay_bin.as_deref())
    }

    /// Configures `routes` local routes: the bench route and `routes - 1` idle ones onto
    /// lists of their own (see `idle::extra_routes`).
    fn set_routes(&mut self, routes: usize) {
        let prefix = format!("{ROUTE}-extra-");
        self.config.routes.retain(|r| !r.name.starts_with(&prefix));
        for (name, target) in idle::extra_routes(routes, &self.scratch.out) {
            self.config.routes.push(RouteConfig::new(
                name,
                zdelay_core::config::LOCAL_SINK,
                target,
            ));
        }
    }

    fn payload_size(&self) -> usize {
        self.args.payload_size
    }

    /// Redis's clock now, estimated from the local clock.
    fn redis_now_ms(&self) -> i64 {
        local_now_ms() + self.clock_offset_ms
    }

    /// The pollers' shared context, as the daemon builds it (`app::serve`): the config's
    /// local routes registered as route lanes, the spread shards for its two-phase routes;
    /// with the bench's batch and lateness buckets. Built before a clock starts.
    async fn context(&mut self, bounds: Vec<u64>) -> anyhow::Result<PollerContext> {
        let mut ctx = PollerContext::new(self.con.clone(), &self.config, self.sinks.clone());
        let spread = self.scratch.keys.clone();
        let lanes = zdelay::app::register_lanes(&mut self.con, &self.config, &spread).await?;
        ctx.with_lanes(spread, lanes);
        ctx.mover.batch = self.batch;
        ctx.mover.bounds_ms = bounds;
        Ok(ctx)
    }

    /// Starts pollers of `ctx` for what `polled` names through `poller::start` (with the
    /// wake listener if asked), feeding `tally`.
    fn spawn_movers(
        &self,
        ctx: PollerContext,
        polled: Polled,
        tally: &Arc<Tally>,
        listen: bool,
    ) -> Movers {
        let on_batch: BatchObserver = {
            let tally = tally.clone();
            Arc::new(move |_target: &Target, reply: &MoveReply| tally.observe(reply))
        };
        let targets = match polled {
            Polled::Jobs => job_targets(&ctx),
            Polled::Raw => Owned::from([TargetId::Source(self.scratch.raw.source.clone())]),
        };
        let ownership = Ownership::new(targets);
        let pollers = poller::start(
            Arc::new(ctx),
            ownership.subscribe(),
            Options {
                wake_clients: if listen {
                    vec![self.redis.clone()]
                } else {
                    Vec::new()
                },
                on_batch: Some(on_batch),
            },
            &CancellationToken::new(),
        );
        Movers {
            _ownership: ownership,
            pollers,
        }
    }

    /// Adds up `cmd` (`HLEN`, `ZCARD`) over one key of every spread shard and of every
    /// registered route lane.
    async fn total(
        &mut self,
        cmd: &str,
        shard_key: fn(&Keys, u16) -> String,
        lane_key: fn(LaneKeys) -> String,
    ) -> anyhow::Result<u64> {
        let shards = &self.scratch.keys;
        let registry = store::lanes::read_registry(&mut self.con, shards).await?;
        let keys: Vec<String> = (0..shards.shards())
            .map(|s| shard_key(shards, s))
            .chain(registry.by_route.into_values().map(|l| lane_key(l.keys)))
            .collect();
        Ok(measure::total_size(&mut self.con, cmd, &keys).await?)
    }

    /// Jobs still stored in the scratch namespace, in any state.
    async fn stored(&mut self) -> anyhow::Result<u64> {
        self.total("HLEN", Keys::jobs, |k| k.jobs).await
    }

    /// Jobs still due.
    async fn due_left(&mut self) -> anyhow::Result<u64> {
        self.total("ZCARD", Keys::due, |k| k.due).await
    }

    /// Dead jobs.
    async fn dead_total(&mut self) -> anyhow::Result<u64> {
        self.total("ZCARD", Keys::dead, |k| k.dead).await
    }
}

/// What a mode's pollers move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Polled {
    /// What the client enqueues and schedules: the route lanes, and the spread shards when
    /// a two-phase route is configured (`--beside`).
    Jobs,
    /// The scratch raw source.
    Raw,
}

/// The route lanes of `ctx`, and its spread shards if it delivers a two-phase route.
fn job_targets(ctx: &PollerContext) -> Owned {
    let shards = if ctx.routes.has_two_phase() {
        ctx.polled_shards()
    } else {
        0
    };
    ctx.route_lanes
        .iter()
        .map(|lane| TargetId::Lane(lane.number))
        .chain((0..shards).map(TargetId::Shard))
        .collect()
}

struct Movers {
    _ownership: Ownership,
    pollers: Pollers,
}

impl Movers {
    async fn stop(self) {
        self.pollers.stop().await;
    }
}
