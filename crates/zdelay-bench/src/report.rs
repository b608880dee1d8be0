//! The report: what each mode measured, and its text rendering.

use super::measure::{Node, read_first_line};
use super::{MEMORY_AIM_PAYLOAD, SAME_MS_TARGET_JOBS};
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Duration;
use zdelay_core::store::{self, Conn};

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) machine: Machine,
    pub(super) settings: Settings,
    pub(super) drain: Vec<Drain>,
    pub(super) steady: Vec<Steady>,
    pub(super) same_ms: Option<SameMs>,
    pub(super) memory: Option<Memory>,
    /// `--daemons N`: drain and steady through N `zdelay run` processes.
    pub(super) daemons: Option<Fleet>,
    pub(super) schedules: Vec<ScheduleFiring>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) console: Option<ConsoleBench>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lane: Option<LaneBench>,
    pub(super) flow: Option<FlowBench>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stream: Option<StreamBench>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) idle: Option<Idle>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) upgrade: Option<UpgradeBench>,
}

/// `upgrade`: `zdelay upgrade` of a layout-1 namespace.
#[derive(Debug, Serialize)]
pub(super) struct UpgradeBench {
    pub(super) jobs: u64,
    pub(super) payload_size: usize,
    pub(super) seconds: f64,
    pub(super) jobs_per_second: f64,
    pub(super) seconds_per_million: f64,
    /// Redis CPU (user + sys) over the upgrade, per job moved into a lane.
    pub(super) redis_cpu_us_per_job: f64,
    pub(super) moved_to_lanes: u64,
}

/// `idle`: an idle daemon's cost per config (see `idle.rs`).
#[derive(Debug, Serialize)]
pub(super) struct Idle {
    pub(super) shards: u16,
    pub(super) idle_poll_ms: u64,
    pub(super) idle_poll_max_ms: u64,
    pub(super) stats_interval_ms: u64,
    pub(super) duration_s: f64,
    /// The server's `notify-keyspace-events` (`None`: CONFIG GET refused).
    pub(super) notify_keyspace_events: Option<String>,
    /// Redis with no daemon running: its own upkeep, included in every case.
    pub(super) baseline_redis_cpu_pct: f64,
    pub(super) baseline_commands_per_s: f64,
    /// Idle Redis CPU aimed at, % of a core.
    pub(super) aim_pct: f64,
    pub(super) cases: Vec<IdleCase>,
}

#[derive(Debug, Serialize)]
pub(super) struct IdleCase {
    pub(super) routes: usize,
    pub(super) sources: usize,
    pub(super) shards: u16,
    /// A two-phase route too (`--with-sink`): a publisher per shard.
    pub(super) with_sink: bool,
    pub(super) pid: u32,
    /// The daemon's `zdelay_wakeups_confirmed` gauges were 1 before the measurement.
    pub(super) wakeups_confirmed: bool,
    /// From the daemon's start.
    pub(super) confirmed_after_s: Option<f64>,
    pub(super) seconds: f64,
    /// used_cpu_sys + used_cpu_user delta over the wall time, % of a core.
    pub(super) redis_cpu_pct: f64,
    /// The daemon's utime + stime delta over the wall time, % of a core.
    pub(super) daemon_cpu_pct: f64,
    pub(super) redis_commands_per_s: f64,
    /// EVALSHA calls a second (every script call of the daemon).
    pub(super) script_calls_per_s: f64,
    /// The costliest commands by Redis µs a second (`INFO commandstats`).
    pub(super) top_commands: Vec<CommandCost>,
    pub(super) meets_aim: bool,
    pub(super) loadavg_start: Option<String>,
    pub(super) loadavg_end: Option<String>,
    /// The daemon's exit code after SIGTERM (`None`: killed).
    pub(super) exit_code: Option<i32>,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct CommandCost {
    pub(super) command: String,
    pub(super) calls_per_s: f64,
    pub(super) usec_per_s: f64,
}

/// `console`: answer times of the console's pages and API.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ConsoleBench {
    pub(super) scheduled_jobs: u64,
    pub(super) dead_jobs: u64,
    pub(super) schedules: u64,
    pub(super) requests: usize,
    pub(super) timings: Vec<ConsoleTiming>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct ConsoleTiming {
    pub(super) what: String,
    pub(super) median_ms: f64,
    pub(super) max_ms: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct ScheduleFiring {
    pub(super) schedules: u64,
    /// Creating them through `Client::schedule_set` (not timed below).
    pub(super) load_s: f64,
    /// T minus Redis TIME when the pollers started.
    pub(super) margin_ms: i64,
    /// `poller.fire_ahead`: how long before T the pollers write the occurrences as jobs.
    pub(super) fire_ahead_ms: u64,
    /// Redis TIME at the start of the first move of an occurrence, minus T.
    pub(super) first_delivery_after_t_ms: f64,
    /// When the pollers saw the last occurrence delivered, minus T.
    pub(super) all_delivered_after_t_ms: f64,
    /// Occurrences delivered per second while firing.
    pub(super) per_sec: f64,
    pub(super) redis_cpu_s_per_million: f64,
    /// Delivery minus occurrence time, from the move scripts' buckets.
    pub(super) lateness: Lateness,
    /// Redis `used_memory` growth per schedule: loaded (definition, envelope, pending
    /// occurrence), and once each fired (plus its mark and health record; the delivered
    /// occurrences' list left out).
    pub(super) bytes_per_schedule_loaded: f64,
    pub(super) bytes_per_schedule_fired: f64,
    /// One console page once they fired: the next 200 to fire after the first 200 (all
    /// pending at one moment: the page is found by rank among equals), and a 2000-definition
    /// scan for paused and ended ones.
    pub(super) page_ms: f64,
}

#[derive(Debug, Serialize)]
pub(super) struct Machine {
    pub(super) nproc: usize,
    pub(super) cpu_model: Option<String>,
    pub(super) mem_total: Option<String>,
    pub(super) loadavg_start: Option<String>,
    pub(super) loadavg_end: Option<String>,
    /// `redis 7.0.15`, `valkey 9.1.2` (`store::server_name`).
    pub(super) server: String,
    /// What the server reports as `redis_version` (Valkey: always 7.2.4).
    pub(super) redis_version: Option<String>,
    /// `INFO memory` `mem_allocator`: per-job memory depends on it (jemalloc's size classes).
    pub(super) mem_allocator: Option<String>,
    pub(super) redis_os: Option<String>,
    pub(super) redis_hz: Option<String>,
    pub(super) redis_io_threads: Option<String>,
    pub(super) zdelay_version: &'static str,
    pub(super) build: &'static str,
}

impl Machine {
    pub(super) async fn gather(con: &mut Conn) -> anyhow::Result<Self> {
        let server = store::info(con, "server").await?;
        let threads = store::info(con, "threads").await.unwrap_or_default();
        let memory = store::info(con, "memory").await.unwrap_or_default();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Ok(Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: store::parse_info(&cpuinfo).get("model name").cloned(),
            mem_total: store::parse_info(&meminfo).get("MemTotal").cloned(),
            loadavg_start: read_first_line("/proc/loadavg"),
            loadavg_end: None,
            server: store::server_name(&server),
            redis_version: server.get("redis_version").cloned(),
            mem_allocator: memory.get("mem_allocator").cloned(),
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
pub(super) struct Settings {
    pub(super) redis_url: String,
    pub(super) namespace: String,
    pub(super) shards: u16,
    pub(super) batch: usize,
    pub(super) jobs: u64,
    pub(super) payload_size: usize,
    pub(super) idle_poll_ms: u64,
    pub(super) mode: String,
}

/// One timed move of a whole backlog.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Throughput {
    pub(super) jobs: u64,
    pub(super) seconds: f64,
    pub(super) jobs_per_sec: f64,
    pub(super) redis_cpu_seconds: f64,
    pub(super) redis_cpu_s_per_million: f64,
    pub(super) script_calls: u64,
}

impl Throughput {
    pub(super) fn new(jobs: u64, elapsed: Duration, cpu: f64, calls: u64) -> Self {
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
pub(super) struct Drain {
    /// "raw" (a raw source's members) or "lane" (jobs in their route's lane).
    pub(super) source: &'static str,
    /// Local routes configured: the jobs' route and `routes - 1` idle ones, each a lane
    /// with a poller of its own.
    pub(super) routes: usize,
    pub(super) mover: &'static str,
    pub(super) baseline: &'static str,
    /// Pollers (real) and loops (bare) running concurrently.
    pub(super) concurrency: usize,
    /// Round with the median ratio.
    pub(super) real: Throughput,
    pub(super) bare: Throughput,
    pub(super) ratio: f64,
    /// Real against bare by Redis CPU per job (bare / real: above 1 when the real move costs
    /// less), the median round's.
    pub(super) cpu_ratio: f64,
    pub(super) ratio_all_rounds: Vec<f64>,
    pub(super) target_ratio: f64,
    pub(super) meets_target: bool,
    pub(super) dead: u64,
    /// Raw: against the bare move that makes the size checks a raw source cannot skip.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) checked: Option<CheckedBaseline>,
}

#[derive(Debug, Serialize)]
pub(super) struct CheckedBaseline {
    pub(super) baseline: &'static str,
    /// `move_raw` called directly, one call in turn with the two bare moves.
    pub(super) script: Throughput,
    pub(super) bare: Throughput,
    /// `move_raw` / this baseline, by wall time and by Redis CPU per job (the median round's).
    pub(super) ratio: f64,
    pub(super) cpu_ratio: f64,
    /// `move_raw` / the bare move without the checks, by Redis CPU, in the same calls' turns.
    pub(super) cpu_ratio_to_bare: f64,
    pub(super) ratio_all_rounds: Vec<f64>,
    pub(super) cpu_ratio_all_rounds: Vec<f64>,
    pub(super) target_ratio: f64,
    /// Every round's CPU ratio at least the target (wall time swings on a shared machine).
    pub(super) meets_target: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Lateness {
    pub(super) jobs: u64,
    pub(super) p50_ms: Option<i64>,
    pub(super) p90_ms: Option<i64>,
    pub(super) p99_ms: Option<i64>,
    pub(super) p999_ms: Option<i64>,
    pub(super) max_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
pub(super) struct Steady {
    pub(super) rate_target: u64,
    pub(super) rate_achieved: f64,
    pub(super) seconds: f64,
    pub(super) enqueued: u64,
    pub(super) moved: u64,
    /// Lateness by the move scripts' buckets (Redis clock at the script's start).
    pub(super) lateness: Lateness,
    /// Jobs delivered before their due time (negative lateness), counted by the consumer:
    /// Redis TIME read after the pop is later than the move, so TIME < due proves one. The
    /// scripts cannot move a job early by construction: they take scores <= their own TIME.
    pub(super) early_jobs: u64,
    /// Consumer view: Redis TIME read right after the pop, minus the job's due time.
    pub(super) consumer: ConsumerReport,
    /// How late this process's own 1–5 ms timers fired meanwhile (whole ms, rounded down):
    /// the scheduling noise under any lateness the pollers can reach on this machine.
    pub(super) timer_overshoot: Option<Lateness>,
    pub(super) script_calls_per_sec: f64,
    pub(super) redis_cpu_percent: f64,
    pub(super) dead: u64,
    pub(super) left_due: u64,
    pub(super) all_delivered_once: bool,
    /// Only for the 1k/s rate: lateness p99 target.
    pub(super) target_p99_ms: Option<i64>,
    pub(super) meets_target: Option<bool>,
    /// The two-phase route loaded beside it (`--beside`), if any.
    pub(super) beside: Option<Beside>,
}

/// A two-phase route loaded at the same rate beside the local one.
#[derive(Debug, Serialize)]
pub(super) struct Beside {
    pub(super) route: String,
    pub(super) enqueued: u64,
    /// When its broker was hung (SIGSTOP), seconds after the start, and for how long.
    pub(super) hung_at_s: Option<f64>,
    pub(super) hung_for_s: Option<f64>,
    /// Jobs still stored when the measurement ended (the local ones are delivered by then).
    pub(super) waiting_at_end: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub(super) struct ConsumerReport {
    pub(super) received: u64,
    pub(super) duplicates: u64,
    pub(super) missing: u64,
    pub(super) unparsable: u64,
    /// Jobs whose pop finished before their due time: proof of an early delivery.
    pub(super) early: u64,
    pub(super) end_to_end: Option<Lateness>,
}

#[derive(Debug, Serialize)]
pub(super) struct SameMs {
    pub(super) jobs: u64,
    /// T minus Redis TIME when the pollers started.
    pub(super) margin_ms: i64,
    /// Redis TIME at the start of the first call that moved jobs, minus T.
    pub(super) first_move_after_t_ms: f64,
    /// Start of the last call that moved jobs, minus T (exact, Redis clock).
    pub(super) last_call_started_after_t_ms: f64,
    /// When the poller saw the last reply, minus T (local clock + measured offset).
    pub(super) all_moved_after_t_ms: f64,
    pub(super) jobs_per_sec: f64,
    pub(super) redis_cpu_s_per_million: f64,
    pub(super) script_calls: u64,
    pub(super) lateness: Lateness,
    pub(super) target_ms: f64,
    /// `None` below 300k jobs: the target is for 300k.
    pub(super) meets_target: Option<bool>,
}

#[derive(Debug, Serialize)]
pub(super) struct Memory {
    pub(super) jobs: u64,
    pub(super) payload_size: usize,
    /// Per job in its route lane (the field keeps its name for scripts).
    pub(super) envelope_bytes_per_job: f64,
    /// Per job in one bare id ZSET + payload HASH holding the same ids and payloads.
    pub(super) bare_bytes_per_job: f64,
    pub(super) ratio: f64,
    pub(super) aim_bytes: f64,
    /// `None` unless the payload is 100 bytes: the aim is for that size.
    pub(super) meets_aim: Option<bool>,
    /// Bytes of one job's stored value (a lane stores the payload as it is).
    pub(super) envelope_value_bytes: usize,
}

/// The aim: the lane move at least as fast as the bare move of today's ids, by wall
/// time and by Redis CPU.
pub(super) const LANE_RATIO_TARGET: f64 = 1.0;

#[derive(Debug, Serialize)]
pub(super) struct LaneBench {
    /// Round with the median lane / bare (26-character ids) ratio.
    pub(super) lane: Throughput,
    pub(super) bare_26: Throughput,
    pub(super) bare_same_ids: Throughput,
    /// By wall time: lane jobs/s over bare jobs/s.
    pub(super) ratio_26: f64,
    pub(super) ratio_same_ids: f64,
    /// By Redis CPU: bare CPU per job over lane CPU per job.
    pub(super) cpu_ratio_26: f64,
    pub(super) cpu_ratio_same_ids: f64,
    pub(super) ratio_26_all_rounds: Vec<f64>,
    pub(super) target_ratio: f64,
    pub(super) meets_target: bool,
    pub(super) memory: LaneMemory,
}

/// `--mode stream`: a stream route's lane drained by `move_lane` (XADD) against a bare Lua
/// XADD move of the same jobs, one call of each in turn.
#[derive(Debug, Serialize)]
pub(super) struct StreamBench {
    /// Round with the median ratio.
    pub(super) lane: Throughput,
    pub(super) bare: Throughput,
    /// By wall time: lane jobs/s over bare jobs/s.
    pub(super) ratio: f64,
    /// By Redis CPU: bare CPU per job over lane CPU per job.
    pub(super) cpu_ratio: f64,
    pub(super) ratio_all_rounds: Vec<f64>,
}

/// `--mode flow`: one lane drained without flow control, with a rate that never holds and
/// with one that holds.
#[derive(Debug, Serialize)]
pub(super) struct FlowBench {
    pub(super) rate_per_s: f64,
    pub(super) burst: u32,
    pub(super) cases: Vec<FlowCase>,
    /// Redis CPU per job over that of no flow control.
    pub(super) cpu_ratio_never_holds: f64,
    pub(super) cpu_ratio_holds: f64,
    /// Redis CPU per job with a per-key rate over 10,000 keys that never holds, over that of
    /// the same jobs (headers and all) without flow control.
    pub(super) cpu_ratio_per_key: f64,
    /// Jobs/s of the held drain after its first burst.
    pub(super) reached_rate: f64,
    /// One key's burst ahead of another key's few jobs, all due at one moment.
    pub(super) key_burst: KeyBurst,
    /// What unique windows hold in Redis: `MEMORY USAGE` per id of the lane's `unique` HASH
    /// (jobs waiting with a window) and of its `windows` ZSET (ids delivered within theirs),
    /// for `--jobs` ids of 26 characters.
    pub(super) unique_bytes_per_waiting_job: f64,
    pub(super) unique_bytes_per_remembered_id: f64,
}

/// `--mode flow`'s per-key burst: key "a" has `--jobs` jobs and key "b" 100, all due at one
/// moment, "b"'s last in due order, at 1,000/s per key (burst 100). "b" waits only while the
/// movers set "a"'s burst aside, one job at a time.
#[derive(Debug, Serialize)]
pub(super) struct KeyBurst {
    pub(super) burst_jobs: u64,
    /// From the first move call until every one of "b"'s jobs was on the list, ms.
    pub(super) other_key_waited_ms: f64,
    /// Redis CPU per job of "a" set aside, µs.
    pub(super) redis_cpu_us_per_job_set_aside: f64,
    pub(super) calls: u64,
}

#[derive(Debug, Serialize)]
pub(super) struct FlowCase {
    pub(super) case: &'static str,
    pub(super) run: Throughput,
    /// Calls that found the route held.
    pub(super) held_calls: u64,
    /// Jobs moved after waiting while the route was held.
    pub(super) deferred: u64,
}

#[derive(Debug, Serialize)]
pub(super) struct LaneMemory {
    pub(super) jobs: u64,
    pub(super) payload_size: usize,
    pub(super) generated_id_bytes_per_job: f64,
    pub(super) id_26_bytes_per_job: f64,
    pub(super) aim_bytes: f64,
    /// `None` unless the payload is 100 bytes: the aim is for that size.
    pub(super) meets_aim: Option<bool>,
}

/// `--daemons N`: what ran and what it measured.
#[derive(Debug, Serialize)]
pub(super) struct Fleet {
    pub(super) daemons: usize,
    pub(super) pids: Vec<u32>,
    pub(super) cluster: bool,
    /// The Redis servers whose CPU is counted, masters first.
    pub(super) nodes: Vec<Node>,
    pub(super) per_shard: u8,
    /// How the bench route's jobs reach the list in this set-up.
    pub(super) delivery: &'static str,
    /// From start to N live instances with the bench route's lane polled.
    pub(super) ready_after_s: f64,
    pub(super) drain: Vec<FleetDrain>,
    pub(super) steady: Vec<FleetSteady>,
    /// Each daemon's exit code after SIGTERM (`None`: killed after the grace period).
    pub(super) exit_codes: Vec<Option<i32>>,
    pub(super) not_measured: Vec<&'static str>,
}

impl Fleet {
    /// The drain round with the median jobs/s.
    pub(super) fn median_drain(&self) -> Option<&FleetDrain> {
        let mut rounds: Vec<&FleetDrain> = self.drain.iter().collect();
        rounds.sort_by(|a, b| a.jobs_per_sec.total_cmp(&b.jobs_per_sec));
        rounds.get(rounds.len() / 2).copied()
    }
}

/// CPU used during a timed part, seconds, and how many cores that kept busy.
#[derive(Debug, Clone, Serialize)]
pub(super) struct CpuUse {
    pub(super) wall_s: f64,
    /// `used_cpu_sys + used_cpu_user` delta of each node, in `Fleet::nodes` order.
    pub(super) redis_nodes_s: Vec<f64>,
    pub(super) redis_masters_s: f64,
    pub(super) redis_replicas_s: f64,
    /// utime + stime of all daemons.
    pub(super) daemons_s: f64,
    /// This process: producer, consumer, polling.
    pub(super) bench_s: f64,
    /// Everything above over the wall time.
    pub(super) cores_busy: f64,
}

impl CpuUse {
    pub(super) fn new(
        nodes: &[Node],
        redis: Vec<f64>,
        daemons: f64,
        bench: f64,
        wall: f64,
    ) -> Self {
        let sum = |master: bool| -> f64 {
            nodes
                .iter()
                .zip(&redis)
                .filter(|(n, _)| n.master == master)
                .map(|(_, c)| c)
                .fold(0.0, |a, b| a + b)
        };
        let (masters, replicas) = (sum(true), sum(false));
        CpuUse {
            wall_s: wall,
            redis_nodes_s: redis,
            redis_masters_s: masters,
            redis_replicas_s: replicas,
            daemons_s: daemons,
            bench_s: bench,
            cores_busy: (masters + replicas + daemons + bench) / wall.max(1e-9),
        }
    }

    /// CPU seconds per million jobs.
    pub(super) fn per_million(&self, jobs: u64) -> PerMillion {
        let m = 1e6 / jobs.max(1) as f64;
        PerMillion {
            redis_masters_s: self.redis_masters_s * m,
            redis_replicas_s: self.redis_replicas_s * m,
            daemons_s: self.daemons_s * m,
        }
    }
}

/// CPU seconds per million jobs.
#[derive(Debug, Clone, Serialize)]
pub(super) struct PerMillion {
    pub(super) redis_masters_s: f64,
    pub(super) redis_replicas_s: f64,
    pub(super) daemons_s: f64,
}

/// One drain round through the daemons: every job due at T.
#[derive(Debug, Serialize)]
pub(super) struct FleetDrain {
    pub(super) round: usize,
    pub(super) jobs: u64,
    /// T minus Redis TIME when the rescoring was done.
    pub(super) margin_ms: i64,
    /// When a read of the list's length (and the list server's TIME) first found a job, minus
    /// T. Reads wait behind the move scripts running at T, so this trails the first move.
    pub(super) first_seen_after_t_ms: f64,
    /// When a read of the list's length first found every job, minus T.
    pub(super) all_delivered_after_t_ms: f64,
    /// When no job was stored any more (two-phase settles done), minus T.
    pub(super) all_settled_after_t_ms: f64,
    /// jobs / (all delivered − T).
    pub(super) jobs_per_sec: f64,
    /// List length at the end (jobs + duplicates).
    pub(super) delivered: u64,
    pub(super) duplicates: u64,
    pub(super) dead: u64,
    /// Jobs still stored or due at the end (0 expected).
    pub(super) left: u64,
    pub(super) cpu: CpuUse,
    pub(super) per_million: PerMillion,
    pub(super) loadavg_start: Option<String>,
    pub(super) loadavg_end: Option<String>,
}

/// One steady rate through the daemons.
#[derive(Debug, Serialize)]
pub(super) struct FleetSteady {
    pub(super) rate_target: u64,
    pub(super) rate_achieved: f64,
    pub(super) seconds: f64,
    pub(super) enqueued: u64,
    /// The consumer's: Redis TIME right after the pop minus the job's due time.
    pub(super) lateness: Lateness,
    pub(super) early_jobs: u64,
    pub(super) consumer: ConsumerReport,
    pub(super) timer_overshoot: Option<Lateness>,
    pub(super) dead: u64,
    pub(super) left_due: u64,
    pub(super) stored_at_end: u64,
    pub(super) all_delivered_once: bool,
    pub(super) cpu: CpuUse,
    pub(super) loadavg_start: Option<String>,
    pub(super) loadavg_end: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Rendering

pub(super) fn opt(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

pub(super) fn verdict(ok: bool) -> &'static str {
    if ok { "meets target" } else { "MISSES target" }
}

pub(super) fn render(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let st = &r.settings;
    let _ = writeln!(s, "zdelay-bench {} ({})", m.zdelay_version, m.build);
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
        "server: {}, allocator {}, {} at {}, hz {}",
        m.server,
        m.mem_allocator.as_deref().unwrap_or("?"),
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
            if d.routes > 1 {
                let _ = writeln!(
                    s,
                    "  {:<9} with {} local routes configured (the jobs' route and {} idle ones)",
                    d.source,
                    d.routes,
                    d.routes - 1
                );
            }
            let _ = writeln!(
                s,
                "  {:<9} ratio {:.2} (rounds: {}), target >= {:.1}: {}; cpu ratio bare/real {:.2}; dead {}",
                d.source,
                d.ratio,
                rounds.join(" "),
                d.target_ratio,
                verdict(d.meets_target),
                d.cpu_ratio,
                d.dead
            );
            if let Some(c) = &d.checked {
                for (name, t) in [("move_raw, in turn", &c.script), (c.baseline, &c.bare)] {
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
                let list = |v: &[f64]| {
                    v.iter()
                        .map(|r| format!("{r:.2}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                let _ = writeln!(
                    s,
                    "  {:<9} in turn, against the same size checks: ratio {:.2} (rounds: {}); cpu ratio {:.2} (rounds: {}), target >= {:.2}: {}; cpu ratio to the bare move {:.2}",
                    d.source,
                    c.ratio,
                    list(&c.ratio_all_rounds),
                    c.cpu_ratio,
                    list(&c.cpu_ratio_all_rounds),
                    c.target_ratio,
                    verdict(c.meets_target),
                    c.cpu_ratio_to_bare
                );
            }
        }
    }
    if let Some(l) = &r.lane {
        render_lane(&mut s, l);
    }
    if let Some(f) = &r.flow {
        render_flow(&mut s, f);
    }
    if let Some(st) = &r.stream {
        render_stream(&mut s, st);
    }
    if let Some(idle) = &r.idle {
        render_idle(&mut s, idle);
    }
    if let Some(c) = &r.console {
        let _ = writeln!(
            s,
            "\nconsole ({} scheduled jobs, {} dead, {} schedules; {} requests each)",
            c.scheduled_jobs, c.dead_jobs, c.schedules, c.requests
        );
        for t in &c.timings {
            let _ = writeln!(
                s,
                "  {:<34} median {:>7.1} ms, max {:>7.1} ms",
                t.what, t.median_ms, t.max_ms
            );
        }
    }
    for x in &r.schedules {
        let _ = writeln!(
            s,
            "\nschedules ({} hourly schedules whose occurrence falls on one moment T; loaded in \
             {:.1} s)",
            x.schedules, x.load_s
        );
        let _ = writeln!(
            s,
            "  first delivered at T+{:.1} ms, all {} by T+{:.1} ms: {:.0} occurrences/s, {:.2} \
             Redis cpu s/M, margin {} ms, fired {} ms ahead",
            x.first_delivery_after_t_ms,
            x.schedules,
            x.all_delivered_after_t_ms,
            x.per_sec,
            x.redis_cpu_s_per_million,
            x.margin_ms,
            x.fire_ahead_ms
        );
        let l = &x.lateness;
        let ms = |v: Option<i64>| v.map_or("-".to_owned(), |v| v.to_string());
        let _ = writeln!(
            s,
            "  lateness p50 {} / p90 {} / p99 {} / p99.9 {} / max {} ms",
            ms(l.p50_ms),
            ms(l.p90_ms),
            ms(l.p99_ms),
            ms(l.p999_ms),
            ms(l.max_ms)
        );
        let _ = writeln!(
            s,
            "  memory {:.0} B a schedule loaded, {:.0} B once fired; a console page {:.1} ms",
            x.bytes_per_schedule_loaded, x.bytes_per_schedule_fired, x.page_ms
        );
    }
    if let Some(x) = &r.same_ms {
        let _ = writeln!(s, "\nsame-ms ({} jobs due at one ms T)", x.jobs);
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
            if let Some(b) = &x.beside {
                let _ = writeln!(
                    s,
                    "  {}/s beside: {} jobs to two-phase route {}{}; {} of them still waiting \
                     at the end",
                    x.rate_target,
                    b.enqueued,
                    b.route,
                    match (b.hung_at_s, b.hung_for_s) {
                        (Some(at), Some(d)) => {
                            format!(", its broker hung (SIGSTOP) from {at:.1} s for {d:.1} s")
                        }
                        _ => String::new(),
                    },
                    b.waiting_at_end
                );
            }
        }
    }
    if let Some(f) = &r.daemons {
        render_fleet(&mut s, f);
    }
    if let Some(u) = &r.upgrade {
        let _ = writeln!(
            s,
            "\nupgrade (layout 1 -> 2, waiting jobs of one local route into its lane)"
        );
        let _ = writeln!(
            s,
            "  {} jobs of {} B moved in {:.2} s = {:.0} jobs/s ({:.1} s per million), Redis \
             CPU {:.2} us/job; every one in the lane after",
            u.jobs,
            u.payload_size,
            u.seconds,
            u.jobs_per_second,
            u.seconds_per_million,
            u.redis_cpu_us_per_job
        );
    }
    if let Some(x) = &r.memory {
        let _ = writeln!(s, "\nmemory (INFO memory used_memory delta / jobs)");
        let _ = writeln!(
            s,
            "  job in its route lane: {:.0} B (stored value {} B), bare id+hash with the same \
             ids: {:.0} B, ratio {:.2}; aim <= {:.0} B with {} B payloads: {}",
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

fn render_flow(s: &mut String, f: &FlowBench) {
    let _ = writeln!(
        s,
        "\nflow (one route lane, all-due backlog; the held rate {:.0}/s, burst {})",
        f.rate_per_s, f.burst
    );
    let _ = writeln!(
        s,
        "  {:<26} {:>9} {:>8} {:>11} {:>10} {:>7} {:>7}",
        "case", "jobs", "seconds", "jobs/s", "cpu s/M", "calls", "held"
    );
    for c in &f.cases {
        let t = &c.run;
        let _ = writeln!(
            s,
            "  {:<26} {:>9} {:>8.3} {:>11.0} {:>10.2} {:>7} {:>7}",
            c.case,
            t.jobs,
            t.seconds,
            t.jobs_per_sec,
            t.redis_cpu_s_per_million,
            t.script_calls,
            c.held_calls
        );
    }
    let _ = writeln!(
        s,
        "  Redis CPU per job vs no flow control: {:.2} (never holds), {:.2} (holds); reached {:.0}/s of {:.0}/s",
        f.cpu_ratio_never_holds, f.cpu_ratio_holds, f.reached_rate, f.rate_per_s
    );
    let _ = writeln!(
        s,
        "  a key rate over 10,000 keys vs the same jobs without flow control: {:.2} Redis CPU per job",
        f.cpu_ratio_per_key
    );
    let k = &f.key_burst;
    let _ = writeln!(
        s,
        "  one key's burst of {} ahead of another key's 100 (1,000/s per key): the other key waited {:.0} ms; {:.2} µs Redis CPU per job set aside, {} calls",
        k.burst_jobs, k.other_key_waited_ms, k.redis_cpu_us_per_job_set_aside, k.calls
    );
    let _ = writeln!(
        s,
        "  unique windows: {:.0} B per job waiting with one, {:.0} B per id remembered after delivery",
        f.unique_bytes_per_waiting_job, f.unique_bytes_per_remembered_id
    );
}

fn render_stream(s: &mut String, st: &StreamBench) {
    let _ = writeln!(
        s,
        "\nstream (one stream route's lane, one mover, all-due backlog; bare = id ZSET + payload HASH, one XADD per job)"
    );
    let _ = writeln!(
        s,
        "  {:<28} {:>9} {:>8} {:>11} {:>10} {:>7}",
        "move", "jobs", "seconds", "jobs/s", "cpu s/M", "calls"
    );
    for (name, t) in [("move_lane, XADD", &st.lane), ("bare XADD move", &st.bare)] {
        let _ = writeln!(
            s,
            "  {:<28} {:>9} {:>8.3} {:>11.0} {:>10.2} {:>7}",
            name, t.jobs, t.seconds, t.jobs_per_sec, t.redis_cpu_s_per_million, t.script_calls
        );
    }
    let rounds: Vec<String> = st
        .ratio_all_rounds
        .iter()
        .map(|r| format!("{r:.2}"))
        .collect();
    let _ = writeln!(
        s,
        "  vs the bare XADD move: wall {:.2} (rounds: {}), cpu {:.2}",
        st.ratio,
        rounds.join(" "),
        st.cpu_ratio
    );
}

fn render_lane(s: &mut String, l: &LaneBench) {
    let _ = writeln!(
        s,
        "\nlane (storage layout 2: one route lane, one mover, all-due backlog; bare = id ZSET + payload HASH)"
    );
    let _ = writeln!(
        s,
        "  {:<28} {:>9} {:>8} {:>11} {:>10} {:>7}",
        "move", "jobs", "seconds", "jobs/s", "cpu s/M", "calls"
    );
    for (name, t) in [
        ("move_lane, 12-char ids", &l.lane),
        ("bare, 26-char ids", &l.bare_26),
        ("bare, 12-char ids", &l.bare_same_ids),
    ] {
        let _ = writeln!(
            s,
            "  {:<28} {:>9} {:>8.3} {:>11.0} {:>10.2} {:>7}",
            name, t.jobs, t.seconds, t.jobs_per_sec, t.redis_cpu_s_per_million, t.script_calls
        );
    }
    let rounds: Vec<String> = l
        .ratio_26_all_rounds
        .iter()
        .map(|r| format!("{r:.2}"))
        .collect();
    let _ = writeln!(
        s,
        "  vs bare with 26-char ids: wall {:.2} (rounds: {}), cpu {:.2}; target >= {:.1}: {}",
        l.ratio_26,
        rounds.join(" "),
        l.cpu_ratio_26,
        l.target_ratio,
        if l.meets_target { "met" } else { "NOT met" }
    );
    let _ = writeln!(
        s,
        "  vs bare with the same ids: wall {:.2}, cpu {:.2} (the script's own overhead)",
        l.ratio_same_ids, l.cpu_ratio_same_ids
    );
    let m = &l.memory;
    let _ = writeln!(
        s,
        "  memory ({} jobs, {} B payloads): {:.0} B/job with generated ids{}, {:.0} B/job with 26-char ids",
        m.jobs,
        m.payload_size,
        m.generated_id_bytes_per_job,
        match m.meets_aim {
            Some(true) => format!(" (aim <= {:.0}: met)", m.aim_bytes),
            Some(false) => format!(" (aim <= {:.0}: NOT met)", m.aim_bytes),
            None => String::new(),
        },
        m.id_26_bytes_per_job
    );
}

fn render_idle(s: &mut String, i: &Idle) {
    let _ = writeln!(
        s,
        "\nidle (one `zdelay run`, nothing due; idle_poll {} ms, idle_poll_max {} ms, \
         stats_interval {} ms; {:.0} s per case; notify-keyspace-events {:?})",
        i.idle_poll_ms,
        i.idle_poll_max_ms,
        i.stats_interval_ms,
        i.duration_s,
        i.notify_keyspace_events.as_deref().unwrap_or("unknown")
    );
    let _ = writeln!(
        s,
        "  Redis alone (no daemon): {:.2} % of a core, {:.1} commands/s (included below)",
        i.baseline_redis_cpu_pct, i.baseline_commands_per_s
    );
    let _ = writeln!(
        s,
        "  {:>6} {:>7} {:>6} {:>9} {:>10} {:>10} {:>10} {:>11}  load avg (start / end)",
        "routes", "sources", "shards", "confirmed", "redis %", "daemon %", "cmds/s", "scripts/s"
    );
    if i.cases.iter().any(|c| c.with_sink) {
        let _ = writeln!(
            s,
            "  (routes: local ones, plus one two-phase route through a `redis` sink: a publisher \
             per shard)"
        );
    }
    for c in &i.cases {
        let _ = writeln!(
            s,
            "  {:>6} {:>7} {:>6} {:>9} {:>10.2} {:>10.2} {:>10.1} {:>11.1}  {} / {}",
            c.routes,
            c.sources,
            c.shards,
            match c.confirmed_after_s {
                Some(t) => format!("{t:.1} s"),
                None => "NO".to_owned(),
            },
            c.redis_cpu_pct,
            c.daemon_cpu_pct,
            c.redis_commands_per_s,
            c.script_calls_per_s,
            c.loadavg_start.as_deref().unwrap_or("?"),
            c.loadavg_end.as_deref().unwrap_or("?"),
        );
        let top: Vec<String> = c
            .top_commands
            .iter()
            .map(|t| {
                format!(
                    "{} {:.1}/s {:.0} µs/s",
                    t.command, t.calls_per_s, t.usec_per_s
                )
            })
            .collect();
        let _ = writeln!(s, "         costliest commands: {}", top.join(", "));
        let _ = writeln!(
            s,
            "         idle Redis < {:.0} % of a core: {}{}",
            i.aim_pct,
            verdict(c.meets_aim),
            if c.wakeups_confirmed {
                ""
            } else {
                " (wake-ups never confirmed: every idle target polled each idle_poll)"
            }
        );
    }
    let one = i.cases.iter().find(|c| c.routes == 1 && c.sources == 0);
    for c in i.cases.iter().filter(|c| c.routes > 1 && c.sources == 0) {
        if let Some(one) = one {
            let _ = writeln!(
                s,
                "  {} routes / 1 route: Redis CPU {:.2}x, commands {:.2}x",
                c.routes,
                c.redis_cpu_pct / one.redis_cpu_pct.max(1e-9),
                c.redis_commands_per_s / one.redis_commands_per_s.max(1e-9)
            );
        }
    }
}

fn render_fleet(s: &mut String, f: &Fleet) {
    let masters = f.nodes.iter().filter(|n| n.master).count();
    let _ = writeln!(
        s,
        "\ndaemons: {} x `zdelay run` (pids {:?}), {} poller(s) per lane and shard, on {}; ready after {:.1} s",
        f.daemons,
        f.pids,
        f.per_shard,
        if f.cluster {
            format!(
                "a cluster of {masters} masters + {} replicas",
                f.nodes.len() - masters
            )
        } else {
            "one Redis".to_owned()
        },
        f.ready_after_s
    );
    let _ = writeln!(s, "  delivery: {}", f.delivery);
    if !f.drain.is_empty() {
        let _ = writeln!(
            s,
            "  drain (all jobs due at T; times after T, ms; CPU s per million jobs; cores busy = all CPU / wall)"
        );
        let _ = writeln!(
            s,
            "  {:>5} {:>8} {:>8} {:>9} {:>9} {:>10} {:>8} {:>8} {:>8} {:>6} {:>5} {:>5}",
            "round",
            "jobs",
            "first",
            "all",
            "settled",
            "jobs/s",
            "redis M",
            "redis R",
            "daemons",
            "cores",
            "dup",
            "dead"
        );
        for d in &f.drain {
            let _ = writeln!(
                s,
                "  {:>5} {:>8} {:>8.1} {:>9.1} {:>9.1} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>6.2} {:>5} {:>5}",
                d.round,
                d.jobs,
                d.first_seen_after_t_ms,
                d.all_delivered_after_t_ms,
                d.all_settled_after_t_ms,
                d.jobs_per_sec,
                d.per_million.redis_masters_s,
                d.per_million.redis_replicas_s,
                d.per_million.daemons_s,
                d.cpu.cores_busy,
                d.duplicates,
                d.dead
            );
        }
        if let Some(m) = f.median_drain() {
            let _ = writeln!(
                s,
                "  median round {}: {:.0} jobs/s; left stored {}; load avg {} -> {}",
                m.round,
                m.jobs_per_sec,
                m.left,
                m.loadavg_start.as_deref().unwrap_or("?"),
                m.loadavg_end.as_deref().unwrap_or("?")
            );
        }
    }
    if !f.steady.is_empty() {
        let _ = writeln!(
            s,
            "  steady (consumer lateness, ms: Redis TIME after the pop - due)"
        );
        let _ = writeln!(
            s,
            "  {:>7} {:>9} {:>8} {:>8} {:>4} {:>4} {:>4} {:>5} {:>5} {:>5} {:>9} {:>7} {:>7} {:>7} {:>6}",
            "rate",
            "achieved",
            "jobs",
            "received",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "early",
            "timer p99",
            "redis%",
            "repl%",
            "zd%",
            "cores"
        );
        for x in &f.steady {
            let l = &x.lateness;
            let pct = |c: f64| c * 100.0 / x.cpu.wall_s.max(1e-9);
            let _ = writeln!(
                s,
                "  {:>7} {:>9.0} {:>8} {:>8} {:>4} {:>4} {:>4} {:>5} {:>5} {:>5} {:>9} {:>7.1} {:>7.1} {:>7.1} {:>6.2}",
                x.rate_target,
                x.rate_achieved,
                x.enqueued,
                x.consumer.received,
                opt(l.p50_ms),
                opt(l.p90_ms),
                opt(l.p99_ms),
                opt(l.p999_ms),
                opt(l.max_ms),
                x.early_jobs,
                opt(x.timer_overshoot.as_ref().and_then(|t| t.p99_ms)),
                pct(x.cpu.redis_masters_s),
                pct(x.cpu.redis_replicas_s),
                pct(x.cpu.daemons_s),
                x.cpu.cores_busy
            );
        }
        for x in &f.steady {
            let _ = writeln!(
                s,
                "  {}/s: delivered once and never early: {} (duplicates {}, missing {}, dead {}, left due {}, stored at end {}); load avg {} -> {}",
                x.rate_target,
                if x.all_delivered_once { "yes" } else { "NO" },
                x.consumer.duplicates,
                x.consumer.missing,
                x.dead,
                x.left_due,
                x.stored_at_end,
                x.loadavg_start.as_deref().unwrap_or("?"),
                x.loadavg_end.as_deref().unwrap_or("?")
            );
        }
    }
    let _ = writeln!(s, "  exit codes after SIGTERM: {:?}", f.exit_codes);
    let _ = writeln!(s, "  not measured here: {}", f.not_measured.join("; "));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_use_splits_masters_and_replicas() {
        let node = |addr: &str, master| Node {
            addr: addr.into(),
            master,
        };
        let nodes = [node("a", true), node("b", true), node("c", false)];
        let cpu = CpuUse::new(&nodes, vec![1.0, 0.5, 0.25], 0.75, 0.5, 2.0);
        assert_eq!(cpu.redis_masters_s, 1.5);
        assert_eq!(cpu.redis_replicas_s, 0.25);
        assert_eq!(cpu.cores_busy, 1.5);
        let m = cpu.per_million(500_000);
        assert_eq!(m.redis_masters_s, 3.0);
        assert_eq!(m.daemons_s, 1.5);
    }
}
