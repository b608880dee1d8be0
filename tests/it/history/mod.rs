//! Issue 14's history checker, the way Jepsen checks databases: 2–3 real daemons on a
//! scheduling Redis (AOF, fsync always) and a second Redis behind a two-phase `redis` sink;
//! producers making random enqueue / replace / keep / error / cancel / reschedule calls and
//! schedule drivers making random set / re-set (also in a tight loop) / pause / resume /
//! delete calls, while the daemons are killed (`kill -9`), stopped (`SIGSTOP`, past the claim
//! lease) and both Redis servers are killed and restarted. Every call is recorded with its
//! invocation and answer time (Redis `TIME`) and result, every delivery with the window in
//! which it was pushed. After the faults stop and everything drains, `model::check` looks for
//! an explanation of the whole history, and nothing of the namespace may be left stored.
//!
//! `ZDELAY_HISTORY_SECS` sets how long calls and faults run (default 40: the test takes
//! about a minute); `ZDELAY_HISTORY_SEED` replays a seed's choices (the seed is printed at the
//! start and in a failure). A failure prints each violation with the calls and deliveries of
//! the job or schedule involved, and writes the whole history and every daemon's log under
//! `target/tmp/history-<seed>/` (with `ZDELAY_HISTORY_DUMP` set, also when it passes).

mod model;
mod ops;

use crate::common::{self, RedisServer, SeededRng, Services, TestConfig};
use model::{Answer, History, JobOp, Ms, Payload, Route, Violation};
use ops::{Consumer, Fleet, Grid, Producer, ScheduleDriver};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEFAULT_SECS: u64 = 40;
/// The NATS variant runs shorter in the suite: what it adds is the idempotency key.
const NATS_DEFAULT_SECS: u64 = 20;
const PRODUCERS: usize = 4;
/// How long the drain may take once the faults stop: the longest backoff a sink may be in
/// (`sink_pause` doubles up to 30 s) plus a claim lease, with margin for a loaded machine.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);
const READY_TIMEOUT: Duration = Duration::from_secs(45);

struct Settings {
    seed: u64,
    secs: u64,
}

impl Settings {
    fn from_env(default_secs: u64) -> Self {
        let seed = match std::env::var("ZDELAY_HISTORY_SEED") {
            Ok(text) => text
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("ZDELAY_HISTORY_SEED={text:?} is not a u64")),
            Err(_) => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("after 1970")
                    .as_nanos() as u64;
                SeededRng::new(nanos).next_u64()
            }
        };
        let secs = match std::env::var("ZDELAY_HISTORY_SECS") {
            Ok(text) => text
                .trim()
                .parse()
                .unwrap_or_else(|_| panic!("ZDELAY_HISTORY_SECS={text:?} is not a number")),
            Err(_) => default_secs,
        };
        Settings { seed, secs }
    }
}

/// Durable servers: an acknowledged write survives a `kill -9` of Redis.
const DURABLE: [&str; 4] = ["--appendonly", "yes", "--appendfsync", "always"];

/// The daemons' config; `nats`: (URL, subject) of a third route through JetStream.
fn daemon_config(
    redis: &RedisServer,
    remote: &RedisServer,
    shards: u16,
    per_shard: i64,
    batch: i64,
    nats: Option<(&str, &str)>,
) -> TestConfig {
    let nats_route = nats.map_or(String::new(), |(url, subject)| {
        format!(
            "[sinks.bus]\nkind = \"nats\"\nurl = \"{url}\"\njetstream = true\n\n\
             [[routes]]\nname = \"{}\"\nsink = \"bus\"\ntarget = \"{subject}\"\n",
            ops::NATS_ROUTE
        )
    });
    TestConfig::new(
        &redis.url(),
        shards,
        &format!(
            r#"
# Short leases, so a stopped daemon's claims and slots are taken over within the run; short
# backoffs, so the drain after the faults is quick.
[poller]
idle_poll = "50ms"
lease = "3s"
slot_lease = "2s"
per_shard = {per_shard}
batch = {batch}
retry_base = "100ms"
retry_cap = "1s"
sink_pause = "200ms"
# A remote Redis still loading its AOF answers errors that count as attempts: none may die.
max_attempts = 1000
stats_interval = "1s"

[sinks.remote]
kind = "redis"
url = "{remote}"

[[routes]]
name = "{local_route}"
sink = "local"
target = "{local_list}"
push = "rpush"

[[routes]]
name = "{remote_route}"
sink = "remote"
target = "{remote_list}"
push = "rpush"

{nats_route}
"#,
            remote = remote.url(),
            local_route = ops::LOCAL_ROUTE,
            local_list = ops::LOCAL_LIST,
            remote_route = ops::REMOTE_ROUTE,
            remote_list = ops::REMOTE_LIST,
        ),
    )
}

#[test]
fn a_random_history_with_faults_satisfies_the_model() {
    run(false, DEFAULT_SECS);
}

/// The same with a third route, through NATS JetStream (the suite's broker, not faulted): its
/// messages carry `<id>:<due>`, which must name a due the job had, never later than the
/// publish, and stay the same on every repeat unless the job was rescheduled.
#[test]
fn a_random_history_through_nats_satisfies_the_model() {
    run(true, NATS_DEFAULT_SECS);
}

fn run(with_nats: bool, default_secs: u64) {
    let Settings { seed, secs } = Settings::from_env(default_secs);
    let rt = common::runtime();
    // (JetStream context, stream name, subject) of the NATS route.
    let nats = with_nats.then(|| {
        let url = Services::get().nats_url();
        let (js, name, prefix) = rt.block_on(crate::nats::make_stream(&url));
        (url, js, name, format!("{prefix}.due"))
    });
    let started = Instant::now();
    let mut rng = SeededRng::new(seed);
    let shards = rng.range(2, 9) as u16;
    let daemons = rng.range(2, 4) as usize;
    let per_shard = rng.range(1, 3);
    let batch = [1, 10, 100, 1000][rng.range(0, 4) as usize];
    eprintln!(
        "history: seed {seed} (ZDELAY_HISTORY_SEED={seed} replays its choices), {secs} s of \
         calls and faults, {daemons} daemons, {shards} shards, per_shard {per_shard}, batch {batch}"
    );
    let redis = RedisServer::start_with(&DURABLE);
    let remote = RedisServer::start_with(&DURABLE);
    let config = daemon_config(
        &redis,
        &remote,
        shards,
        per_shard,
        batch,
        nats.as_ref()
            .map(|(url, _, _, subject)| (url.as_str(), subject.as_str())),
    );
    let (port, remote_port, url) = (redis.port, remote.port, redis.url());
    let mut fleet = Fleet::new(config, redis, remote, daemons);
    let local = Consumer::start(port, ops::LOCAL_LIST, Route::Local);
    let remote = Consumer::start(remote_port, ops::REMOTE_LIST, Route::Remote);

    let origin = ops::wall_ms();
    let two_phase = if nats.is_some() {
        vec![Route::Remote, Route::Nats]
    } else {
        vec![Route::Remote]
    };
    let deadline = Instant::now() + Duration::from_secs(secs);
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|i| {
            let client = common::client(&rt, &url, shards);
            let producer = Producer::new(i, rng.next_u64(), client, two_phase.clone());
            rt.spawn(producer.run(deadline))
        })
        .collect();
    let interval: Ms = 500;
    let grid = Grid {
        anchor: origin - origin.rem_euclid(interval),
        interval,
    };
    // Three schedules under random calls, one left alone between its windows.
    let drivers: Vec<_> = [
        ("s0", Route::Local, false),
        ("s1", Route::Local, false),
        ("s2", Route::Remote, false),
        ("q0", Route::Local, true),
    ]
    .into_iter()
    .map(|(id, route, quiet)| {
        let client = common::client(&rt, &url, shards);
        let driver = ScheduleDriver::new(id, route, grid, rng.next_u64(), client, quiet);
        rt.spawn(driver.run(deadline))
    })
    .collect();
    let fault_log = Arc::new(Mutex::new(Vec::new()));
    let faults = {
        let (log, fault_seed) = (fault_log.clone(), rng.next_u64());
        std::thread::spawn(move || {
            fleet.run_faults(fault_seed, deadline, &log);
            fleet
        })
    };

    let mut history = History {
        origin,
        ..History::default()
    };
    for p in producers {
        history.calls.extend(rt.block_on(p).expect("a producer"));
    }
    for d in drivers {
        history
            .schedule_calls
            .extend(rt.block_on(d).expect("a schedule driver"));
    }
    let mut fleet = faults.join().expect("the fault injector");
    eprintln!(
        "history: calls done and daemons back at {:?}; draining",
        started.elapsed()
    );

    let mut violations = Vec::new();
    // Once the faults stop every daemon must recover by itself: Redis answers, the sinks'
    // pauses (at most 30 s) run out.
    for unready in fleet.unready(READY_TIMEOUT) {
        violations.push(Violation {
            what: format!("a daemon not ready {READY_TIMEOUT:?} after the faults stopped"),
            detail: unready,
        });
    }
    // Start-up retries Redis and a running daemon recovers from its errors: none may exit.
    let faults = fault_log.lock().expect("fault log").clone();
    for (at, death) in &fleet.deaths {
        let mut detail = format!("{death}\nthe faults of the 5 s before it was seen gone:\n");
        for (t, what) in faults.iter().filter(|(t, _)| *t <= *at && at - t <= 5_000) {
            let _ = writeln!(detail, "  {} ms before: {what}", at - t);
        }
        violations.push(Violation {
            what: "a daemon exited by itself".to_owned(),
            detail,
        });
    }
    let mut con = fleet.redis.conn();
    let drain_started = Instant::now();
    while !leftovers(&mut con).is_empty() && drain_started.elapsed() < DRAIN_TIMEOUT {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = leftovers(&mut con);
    if !left.is_empty() {
        violations.push(Violation {
            what: format!(
                "not drained {DRAIN_TIMEOUT:?} after the faults stopped: keys left stored"
            ),
            detail: describe_keys(&mut con, &left),
        });
    }
    let drained_at = common::redis_now_ms(&mut con);
    common::wait_for(
        "both consumers to read past the drain",
        Duration::from_secs(30),
        || local.caught_up() > drained_at && remote.caught_up() > drained_at,
    );
    history.deliveries = local.finish();
    history.deliveries.extend(remote.finish());
    if let Some((_, js, name, _)) = &nats {
        history
            .deliveries
            .extend(rt.block_on(ops::read_stream(js, name)));
        rt.block_on(js.delete_stream(name))
            .expect("delete the stream");
    }
    history.faults = faults;
    eprintln!("history: drained in {:?}", drain_started.elapsed());

    let checked = Instant::now();
    violations.extend(model::check(&history));
    eprintln!(
        "history: {} (checked in {:?}, whole run {:?})",
        summary(&history),
        checked.elapsed(),
        started.elapsed()
    );
    let dumped = (std::env::var_os("ZDELAY_HISTORY_DUMP").is_some() || !violations.is_empty())
        .then(|| dump(seed, &history, &fleet, &violations));
    if let Some(dir) = &dumped {
        eprintln!("history: written to {}", dir.display());
    }
    if let Some(dump) = dumped.filter(|_| !violations.is_empty()) {
        let mut report = String::new();
        for v in violations.iter().take(20) {
            let _ = writeln!(report, "- {}\n{}", v.what, v.detail);
        }
        panic!(
            "history check failed: {} violation(s), seed {seed} (ZDELAY_HISTORY_SEED={seed}, \
             ZDELAY_HISTORY_SECS={secs}); the whole history and the daemons' logs are in {}\n{report}",
            violations.len(),
            dump.display()
        );
    }
}

/// Every key the namespace should not hold once everything is delivered: all but the schema,
/// the lane registry and the lanes' markers, the layout-1 shards' markers (saying layout 2),
/// the sinks' health, the consumers' lists, each shard's claim-token counter (it only grows),
/// and the fired marks deleted schedules keep for an hour (a re-created schedule must not
/// fire an occurrence again; a schedule still defined would leave its `:sched` key).
fn leftovers(con: &mut redis::Connection) -> BTreeSet<String> {
    common::all_keys(con)
        .into_iter()
        .filter(|k| {
            k != "zdelay:schema"
                && k != "zdelay:lanes"
                && k != "{zdelay}:sinks"
                && !k.starts_with("hq:")
                && !k.ends_with(":lease_seq")
                && !k.contains(":sched_fired")
                && !(k.starts_with("zdelay:{") && k.contains("}:lane:"))
                && !(k.starts_with("{zdelay:") && k.ends_with("}:shards"))
        })
        .collect()
}

/// Each key's type and its first entries, for the report.
fn describe_keys(con: &mut redis::Connection, keys: &BTreeSet<String>) -> String {
    let mut out = String::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE").arg(key).query(con).unwrap_or_default();
        let sample: Vec<String> = match kind.as_str() {
            "zset" => redis::cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(9)
                .arg("WITHSCORES")
                .query(con)
                .unwrap_or_default(),
            "hash" => redis::cmd("HSCAN")
                .arg(key)
                .arg(0)
                .arg("COUNT")
                .arg(10)
                .query::<(String, Vec<String>)>(con)
                .map(|(_, v)| v)
                .unwrap_or_default(),
            "string" => redis::cmd("GET")
                .arg(key)
                .query::<Option<String>>(con)
                .ok()
                .flatten()
                .into_iter()
                .collect(),
            _ => Vec::new(),
        };
        let _ = writeln!(out, "  {key} ({kind}): {sample:?}");
    }
    out
}

fn summary(history: &History) -> String {
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    for c in &history.calls {
        let op = match c.op {
            JobOp::Enqueue { .. } => "enqueue",
            JobOp::Cancel => "cancel",
            JobOp::Reschedule { .. } => "reschedule",
        };
        let answer = match &c.answer {
            Answer::Failed(_) => "failed".to_owned(),
            Answer::Rescheduled(_) => "rescheduled".to_owned(),
            a => format!("{a:?}").to_lowercase(),
        };
        *answers.entry(format!("{op} {answer}")).or_default() += 1;
    }
    let ids: BTreeSet<&str> = history.calls.iter().map(|c| c.id.as_str()).collect();
    let per_route = |route: Route| {
        history
            .deliveries
            .iter()
            .filter(|d| d.route == route)
            .count()
    };
    let mut copies: BTreeMap<(&str, u64, Route), usize> = BTreeMap::new();
    for d in history.deliveries.iter().filter(|d| d.route.two_phase()) {
        if let Payload::Job { id, nonce } = &d.payload {
            *copies.entry((id.as_str(), *nonce, d.route)).or_default() += 1;
        }
    }
    let repeats: usize = copies.values().map(|n| n - 1).sum();
    let occurrences = history
        .deliveries
        .iter()
        .filter(|d| matches!(d.payload, Payload::Occurrence { .. }))
        .count();
    let schedule_failed = history.schedule_calls.iter().filter(|c| !c.ok).count();
    format!(
        "{} job calls on {} ids {answers:?}; {} schedule calls ({schedule_failed} failed); \
         deliveries: {} local, {} remote, {} nats ({repeats} repeats of a two-phase job), \
         {occurrences} schedule occurrences; {} faults",
        history.calls.len(),
        ids.len(),
        history.schedule_calls.len(),
        per_route(Route::Local),
        per_route(Route::Remote),
        per_route(Route::Nats),
        history.faults.len()
    )
}

/// Writes the history (time-ordered) and every daemon's log under `target/tmp`.
fn dump(
    seed: u64,
    history: &History,
    fleet: &Fleet,
    violations: &[Violation],
) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("history-{seed}"));
    std::fs::create_dir_all(&dir).expect("dump dir");
    let mut lines: Vec<(Ms, String)> = Vec::new();
    for c in &history.calls {
        lines.push((c.inv, format!("{} call {:?}", c.inv, c)));
    }
    for c in &history.schedule_calls {
        lines.push((c.inv, format!("{} schedule {:?}", c.inv, c)));
    }
    for d in &history.deliveries {
        lines.push((d.read_at, format!("{} delivery {:?}", d.read_at, d)));
    }
    for (t, what) in &history.faults {
        lines.push((*t, format!("{t} fault {what}")));
    }
    lines.sort_by_key(|(t, _)| *t);
    let text: Vec<String> = lines.into_iter().map(|(_, l)| l).collect();
    std::fs::write(dir.join("history.txt"), text.join("\n")).expect("write history");
    // The whole report, which the panic message cuts to its first violations.
    let report: Vec<String> = violations
        .iter()
        .map(|v| format!("- {}\n{}", v.what, v.detail))
        .collect();
    std::fs::write(dir.join("violations.txt"), report.join("\n")).expect("write violations");
    for (name, log) in fleet.logs() {
        std::fs::write(dir.join(name), log).expect("write a daemon log");
    }
    dir
}
