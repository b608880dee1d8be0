//! `zdelay-bench` arguments.

use std::time::Duration;

/// Which measurements to run. Without `--daemons`, every mode but `idle` runs the daemon's
/// pollers or scripts in process on a scratch namespace, where the bench route's jobs wait in
/// its route lane; `idle` and `--daemons N` run `zdelay run` processes.
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
    /// Recurring schedules whose occurrence falls on one moment: fired/s and lateness (not
    /// part of `all`; see --schedules).
    Schedules,
    /// The operator console's pages and API, and the forecast, on `--jobs` scheduled jobs
    /// (not part of `all`).
    Console,
    /// The route-lane scripts called directly, in turn with the bare moves on the same server
    /// state (drain by wall time and Redis CPU, memory per job; not part of `all`).
    Lane,
    /// What a route's flow control costs Redis: one lane drained without it, with a rate that
    /// never holds and with one that holds (`--rate`'s first value, jobs/s; not part of
    /// `all`).
    Flow,
    /// A stream route (`push = "xadd"`) drained by its move script, in turn with a bare Lua
    /// XADD move of the same jobs on the same server state (not part of `all`).
    Stream,
    /// What an idle daemon costs Redis and itself, per config of `--routes` local routes and
    /// `--sources` raw sources at `--shards` shards, over `--duration` (60 s unless given),
    /// once its wake-ups are confirmed (not part of `all`).
    Idle,
    /// `zdelay upgrade` of a layout-1 namespace holding `--jobs` waiting jobs, written as an
    /// older release wrote it: seconds per million jobs, Redis CPU per job (not part of
    /// `all`).
    Upgrade,
}

/// Options of `zdelay-bench`.
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
    /// How long each steady rate runs (default 10 s), or each idle case is measured
    /// (default 60 s).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Local routes configured (comma-separated, each run in turn): idle cases, and the lane
    /// drain (jobs for one of them, each route a lane with a poller of its own).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize],
          value_parser = clap::value_parser!(usize))]
    pub routes: Vec<usize>,
    /// Idle mode: raw sources configured (comma-separated, each a case of its own with one
    /// route; none unless given), never written to.
    #[arg(long, value_delimiter = ',')]
    pub sources: Vec<usize>,
    /// Idle mode: also a two-phase route, through a `redis` sink pointed at the same server
    /// as if it were another one, so that every shard runs a publisher too.
    #[arg(long)]
    pub with_sink: bool,
    /// Schedules mode: schedule counts, each run in turn.
    #[arg(long, value_delimiter = ',', default_values_t = vec![10_000u64, 100_000])]
    pub schedules: Vec<u64>,
    /// Jobs due at the same millisecond in same-ms mode.
    #[arg(long, default_value_t = 300_000)]
    pub same_ms_jobs: u64,
    /// Drain runs per source kind (real then bare, alternating); the median ratio is kept.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Scratch namespace: its keys are deleted before and after.
    #[arg(long, default_value = "zdelay-bench")]
    pub namespace: String,
    /// Spread shards, which hold two-phase routes' jobs (default: redis.shards from the
    /// config).
    #[arg(long)]
    pub shards: Option<u16>,
    /// Delete and use the scratch keys even if they hold data.
    #[arg(long)]
    pub force: bool,
    /// Report format: text for people, json (stable, for scripts) on stdout; progress goes
    /// to stderr either way.
    #[arg(short = 'o', long = "output", value_name = "FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    pub output: String,
    /// The same as -o json.
    #[arg(long, conflicts_with = "output")]
    pub json: bool,
    /// Steady mode: also enqueue, at the same rate, jobs for this configured two-phase route
    /// (its sink as configured), to show that the local route's lateness does not depend on
    /// it.
    #[arg(long)]
    pub beside: Option<String>,
    /// Steady mode with --beside: SIGSTOP this pid (the broker's) 2 s into each rate, for
    /// --hang, then SIGCONT: a hung broker, its port still open.
    /// Fault injection for the benchmark's own runs: hidden from --help.
    #[arg(long, requires = "beside", hide = true)]
    pub hang_pid: Option<u32>,
    /// How long --hang-pid stays stopped.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration, hide = true)]
    pub hang: Duration,
    /// Drain and steady through N `zdelay run` processes (see --zdelay-bin) instead of pollers
    /// in this process: the bench writes them a config for the scratch namespace (same
    /// Redis or cluster, free admin ports on 127.0.0.1), waits until the registry shows N
    /// live instances with the bench route's lane polled, measures from outside (the list's
    /// length, a consumer's pops) and stops them with SIGTERM. Works on one Redis and on a
    /// cluster (`redis.cluster_nodes`); jobs only, no raw source. With --route, the daemons
    /// deliver the route through its sink (its secrets passed in their environment, never
    /// written to their config files).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub daemons: Option<u16>,
    /// The `zdelay` binary that --daemons and --mode idle run (default: the `zdelay` in this
    /// binary's directory, else the one on the PATH).
    #[arg(long, value_name = "PATH")]
    pub zdelay_bin: Option<std::path::PathBuf>,
    /// Instead of the modes: confirmed messages/s through this configured two-phase route
    /// (Kafka, AMQP, NATS or remote Redis), `--jobs` jobs all due, with the daemon's
    /// pollers (or --daemons N processes: the jobs made due at one instant once they run)
    /// and the route's real sink (claim → publish → broker confirmation → ack).
    /// Before and after, the broker's own client publishes as many messages of the same size
    /// with the same confirms directly (Kafka, NATS JetStream, AMQP without TLS): the report
    /// gives zdelay's rate over theirs, Redis (on a cluster: every node's, and the masters')
    /// and zdelay CPU per job, and (on one Redis)
    /// Redis's execution time per job by script, from `SLOWLOG` recording every call during
    /// the drain (its settings are put back afterwards).
    #[arg(long)]
    pub route: Option<String>,
}

impl BenchArgs {
    /// `--duration` for a steady rate.
    pub fn steady_duration(&self) -> Duration {
        self.duration.unwrap_or(Duration::from_secs(10))
    }

    /// `--duration` for an idle case.
    pub fn idle_duration(&self) -> Duration {
        self.duration.unwrap_or(Duration::from_secs(60))
    }

    /// Whether the report is printed as JSON (`-o json` or `--json`).
    pub fn is_json(&self) -> bool {
        self.json || self.output == "json"
    }
}
