//! `zdelay-bench`: the in-process modes drive the daemon's pollers on the bench route's lane;
//! `--daemons N` starts N `zdelay run` processes of the `zdelay` binary beside it on the
//! scratch namespace, waits until they poll the lane, measures drain and steady from
//! outside, stops them with SIGTERM and leaves nothing behind — on one Redis and on a
//! cluster. `--mode idle` starts one daemon per config and measures it idle. Small numbers:
//! this checks the machinery, not the machine.

use crate::common::{RedisCluster, RedisServer, TestConfig};
use serde_json::Value;
use std::time::Instant;

/// Runs the bench with `config` and returns its JSON report.
fn bench(config: &TestConfig, args: &[&str]) -> Value {
    let started = Instant::now();
    let out = config.bench(&[&["--json"][..], args].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    eprintln!("bench took {:?}", started.elapsed());
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("JSON report: {e}: {stderr}"))
}

fn check(report: &Value, jobs: u64, masters: usize, delivery_starts: &str) {
    let d = &report["daemons"];
    assert_eq!(d["daemons"], 2, "{d:#}");
    assert_eq!(d["exit_codes"], serde_json::json!([0, 0]), "{d:#}");
    assert!(
        d["delivery"].as_str().unwrap().starts_with(delivery_starts),
        "{d:#}"
    );
    let nodes = d["nodes"].as_array().unwrap();
    assert_eq!(
        nodes.iter().filter(|n| n["master"] == true).count(),
        masters,
        "{d:#}"
    );
    let drain = &d["drain"][0];
    assert_eq!(drain["jobs"], jobs);
    assert_eq!(drain["delivered"], jobs, "{drain:#}");
    assert_eq!(drain["dead"], 0);
    assert_eq!(drain["left"], 0);
    // Nothing moves before T (rescoring is exact): the first job is seen at or after it.
    assert!(
        drain["first_seen_after_t_ms"].as_f64().unwrap() >= 0.0,
        "{drain:#}"
    );
    assert!(drain["jobs_per_sec"].as_f64().unwrap() > 0.0);
    let steady = &d["steady"][0];
    assert_eq!(steady["all_delivered_once"], true, "{steady:#}");
    assert_eq!(steady["early_jobs"], 0);
    assert!(steady["enqueued"].as_u64().unwrap() > 0);
    assert_eq!(steady["consumer"]["received"], steady["enqueued"]);
    // Every daemon was stopped and reaped.
    for pid in d["pids"].as_array().unwrap() {
        let pid = pid.as_u64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "daemon {pid} still runs"
        );
    }
}

/// What the bench leaves in the server: nothing of its scratch namespace.
fn assert_nothing_left(redis: &RedisServer) {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*zdelay-bench*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(keys.is_empty(), "left behind: {keys:?}");
}

/// The in-process modes on a Redis no namespace exists on: the producer writes the bench
/// route's jobs into its lane, the pollers the daemon would start move them, and each move is
/// compared with a bare one on the same ids.
#[test]
fn bench_in_process_modes_follow_the_route_lane() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, "");
    let report = bench(
        &config,
        &[
            "--mode",
            "all",
            "--jobs",
            "3000",
            "--same-ms-jobs",
            "3000",
            "--rate",
            "300",
            "--duration",
            "2s",
        ],
    );
    let drain = report["drain"].as_array().unwrap();
    assert_eq!(drain.len(), 2, "{drain:#?}");
    assert_eq!(drain[0]["mover"], "move_raw (poller::run)", "{drain:#?}");
    let lane = &drain[1];
    assert_eq!(lane["source"], "lane", "{lane:#}");
    assert_eq!(lane["mover"], "move_lane (poller::run)", "{lane:#}");
    assert_eq!(lane["concurrency"], 1, "one lane, one mover: {lane:#}");
    for run in ["real", "bare"] {
        assert_eq!(lane[run]["jobs"], 3000, "{lane:#}");
    }
    assert!(lane["cpu_ratio"].as_f64().unwrap() > 0.0, "{lane:#}");
    assert_eq!(lane["dead"], 0, "{lane:#}");

    let same_ms = &report["same_ms"];
    assert_eq!(same_ms["jobs"], 3000, "{same_ms:#}");
    assert!(
        same_ms["first_move_after_t_ms"].as_f64().unwrap() >= 0.0,
        "nothing moves before T: {same_ms:#}"
    );
    let steady = &report["steady"][0];
    assert_eq!(steady["all_delivered_once"], true, "{steady:#}");
    assert_eq!(steady["early_jobs"], 0, "{steady:#}");
    assert!(steady["enqueued"].as_u64().unwrap() > 0, "{steady:#}");

    let memory = &report["memory"];
    // A lane stores the payload as it is (a layout-1 shard stored it in a 12-byte frame).
    assert_eq!(memory["envelope_value_bytes"], 100, "{memory:#}");
    // 3,000 jobs carry the keys' fixed costs too: a plausible figure, not the measurement.
    let bytes = memory["envelope_bytes_per_job"].as_f64().unwrap();
    assert!((100.0..2000.0).contains(&bytes), "{memory:#}");
    assert_nothing_left(&redis);
}

/// Schedules of the bench route live in its lane and its mover fires them; the console's
/// dead jobs are the lane's.
#[test]
fn bench_schedules_and_console_follow_the_route_lane() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, "");
    let report = bench(&config, &["--mode", "schedules", "--schedules", "300"]);
    let fired = &report["schedules"][0];
    assert_eq!(fired["schedules"], 300, "{fired:#}");
    assert!(
        fired["first_delivery_after_t_ms"].as_f64().unwrap() >= 0.0,
        "{fired:#}"
    );
    let report = bench(&config, &["--mode", "console", "--jobs", "2000"]);
    let console = &report["console"];
    assert_eq!(console["dead_jobs"], 1000, "{console:#}");
    assert_eq!(
        console["timings"].as_array().unwrap().len(),
        12,
        "{console:#}"
    );
    assert_nothing_left(&redis);
}

/// `--mode upgrade` writes a layout-1 namespace as an older release did and upgrades it:
/// every waiting job ends in the route's lane.
#[test]
fn bench_upgrade_moves_a_layout_1_namespace_into_the_lane() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, "");
    let report = bench(&config, &["--mode", "upgrade", "--jobs", "3000"]);
    let upgrade = &report["upgrade"];
    assert_eq!(upgrade["jobs"], 3000, "{upgrade:#}");
    assert_eq!(upgrade["moved_to_lanes"], 3000, "{upgrade:#}");
    assert!(upgrade["seconds"].as_f64().unwrap() > 0.0, "{upgrade:#}");
    assert_nothing_left(&redis);
}

#[test]
fn bench_daemons_on_one_redis() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, "[poller]\nslot_lease = \"1s\"\n");
    let report = bench(
        &config,
        &[
            "--daemons",
            "2",
            "--mode",
            "all",
            "--jobs",
            "3000",
            "--rate",
            "300",
            "--duration",
            "2s",
        ],
    );
    check(&report, 3000, 1, "exactly once");
    assert_nothing_left(&redis);
}

/// Two daemons, every mode, on a cluster (small numbers, the machinery only): the bench
/// route's lane sits in its list's slot, so the daemons move it exactly once, and the run
/// leaves neither lane nor registry behind.
#[test]
fn bench_daemons_on_a_cluster() {
    let cluster = RedisCluster::start();
    let config = cluster.config(4, "[poller]\nslot_lease = \"1s\"\n");
    let report = bench(
        &config,
        &[
            "--daemons",
            "2",
            "--mode",
            "all",
            "--jobs",
            "2000",
            "--rate",
            "200",
            "--duration",
            "2s",
        ],
    );
    check(&report, 2000, 3, "exactly once: pushed by move_lane");
    let mut con = cluster.conn();
    let tag = zdelay::keys::slot_tag(zdelay::keys::slot_of("zdelay-bench:out"));
    let spread = zdelay::keys::Keys::new("zdelay-bench", 4);
    for key in [
        "zdelay-bench:out".to_owned(),
        "zdelay-bench:schema".to_owned(),
        "zdelay-bench:lanes".to_owned(),
        "{zdelay-bench}:instances".to_owned(),
        "{zdelay-bench}:slots".to_owned(),
        format!("zdelay-bench:{{{tag}}}:due:bench"),
        format!("zdelay-bench:{{{tag}}}:lane:bench"),
        spread.layout_1().layout(0),
        spread.layout(3),
    ] {
        let n: u64 = redis::cmd("EXISTS").arg(&key).query(&mut con).unwrap();
        assert_eq!(n, 0, "{key} left behind");
    }
}

/// The in-process modes need one Redis: on a cluster the bench says what to run instead.
#[test]
fn bench_in_process_on_a_cluster_points_at_daemons() {
    let config = TestConfig::new("redis://127.0.0.1:1", 4, "");
    let body = std::fs::read_to_string(&config.path).unwrap().replacen(
        "[redis]\n",
        "[redis]\ncluster_nodes = [\"redis://127.0.0.1:1\"]\n",
        1,
    );
    std::fs::write(&config.path, body).unwrap();
    let out = config.bench(&["--mode", "drain"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--daemons"), "{err}");
}

/// The route-lane preview on a cluster: the lane lives in its list's slot, so enqueue and
/// move run there without CROSSSLOT, every job reaches the list, and the comparison with the
/// bare moves and the memory are measured on the list's master.
#[test]
fn bench_lane_on_a_cluster() {
    let cluster = RedisCluster::start();
    let config = cluster.config(4, "");
    let report = bench(&config, &["--mode", "lane", "--jobs", "3000"]);
    let lane = &report["lane"];
    for run in ["lane", "bare_26", "bare_same_ids"] {
        assert_eq!(lane[run]["jobs"], 3000, "{lane:#}");
        assert!(
            lane[run]["redis_cpu_seconds"].as_f64().unwrap() > 0.0,
            "{lane:#}"
        );
    }
    let memory = lane["memory"]["generated_id_bytes_per_job"]
        .as_f64()
        .unwrap();
    // 3,000 jobs carry the keys' fixed costs too: a plausible figure, not the measurement.
    assert!((100.0..2000.0).contains(&memory), "{lane:#}");
}

/// `--mode flow`: one lane drained three ways; the held drain keeps to its rate and every
/// job reaches the list each time.
#[test]
fn bench_flow_measures_the_cost_of_a_limited_route() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, "");
    let report = bench(
        &config,
        &["--mode", "flow", "--jobs", "3000", "--rate", "5000"],
    );
    let flow = &report["flow"];
    let cases = flow["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 5, "{flow:#}");
    for case in cases {
        assert_eq!(case["run"]["jobs"], 3000, "{flow:#}");
    }
    assert_eq!(cases[0]["held_calls"], 0, "{flow:#}");
    assert!(cases[2]["held_calls"].as_u64().unwrap() > 0, "{flow:#}");
    // 3,000 jobs at 5,000/s after a burst of 500: about half a second, never much faster.
    let reached = flow["reached_rate"].as_f64().unwrap();
    assert!(reached <= 5000.0 * 1.05, "{flow:#}");
    // Another key's jobs were reached behind one key's burst, and unique windows take room.
    assert_eq!(flow["key_burst"]["burst_jobs"], 3000, "{flow:#}");
    assert!(
        flow["key_burst"]["calls"].as_u64().unwrap() >= 3,
        "{flow:#}"
    );
    for field in [
        "unique_bytes_per_waiting_job",
        "unique_bytes_per_remembered_id",
    ] {
        let bytes = flow[field].as_f64().unwrap();
        assert!((20.0..400.0).contains(&bytes), "{field}: {flow:#}");
    }
}

/// `--mode idle`: one daemon per config, measured once its wake-ups are confirmed, stopped,
/// nothing left behind.
#[test]
fn bench_idle_measures_each_config_once_its_wake_ups_are_confirmed() {
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Kz"]);
    let config = TestConfig::new(&redis.url(), 4, "[poller]\nidle_poll_max = \"1s\"\n");
    let report = bench(
        &config,
        &[
            "--mode",
            "idle",
            "--duration",
            "2s",
            "--routes",
            "1,5",
            "--sources",
            "3",
            "--with-sink",
        ],
    );
    let idle = &report["idle"];
    assert_eq!(idle["shards"], 4, "{idle:#}");
    assert_eq!(idle["idle_poll_max_ms"], 1000, "{idle:#}");
    assert!(idle["baseline_redis_cpu_pct"].as_f64().unwrap() >= 0.0);
    let cases = idle["cases"].as_array().unwrap();
    let configs: Vec<(u64, u64)> = cases
        .iter()
        .map(|c| {
            (
                c["routes"].as_u64().unwrap(),
                c["sources"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(configs, [(1, 0), (5, 0), (1, 3)], "{idle:#}");
    for c in cases {
        assert_eq!(c["wakeups_confirmed"], true, "{c:#}");
        assert_eq!(c["with_sink"], true, "{c:#}");
        assert_eq!(c["exit_code"], 0, "{c:#}");
        let seconds = c["seconds"].as_f64().unwrap();
        assert!((2.0..4.0).contains(&seconds), "{c:#}");
        // The heartbeat alone makes a script call a second.
        assert!(c["script_calls_per_s"].as_f64().unwrap() >= 0.5, "{c:#}");
        assert!(c["redis_commands_per_s"].as_f64().unwrap() > 0.0, "{c:#}");
        let pid = c["pid"].as_u64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "daemon {pid} still runs"
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*zdelay-bench*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(keys.is_empty(), "left behind: {keys:?}");
}

/// `--route` through a two-phase route (here a `redis` sink to another server): every job
/// confirmed, and the Redis time per job broken down by script (the move, which claims; the
/// publishers' claims of queued jobs, called at least at their first look; the settle) from
/// `SLOWLOG`, whose settings are put back afterwards.
#[test]
fn bench_route_breaks_the_redis_time_down_by_script() {
    let redis = RedisServer::start();
    let far = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            "[sinks.far]\nkind = \"redis\"\nurl = \"{}\"\n\n[[routes]]\nname = \"far\"\nsink = \"far\"\ntarget = \"q:far\"\n",
            far.url()
        ),
    );
    let report = bench(&config, &["--route", "far", "--jobs", "2000"]);
    assert_eq!(report["jobs"], 2000, "{report:#}");
    assert_eq!(report["dead"], 0, "{report:#}");
    assert_eq!(report["by_script_partial"], false, "{report:#}");
    let by_script = report["by_script"].as_array().expect("a breakdown");
    let calls = |name: &str| {
        by_script
            .iter()
            .find(|c| c["name"] == name)
            .and_then(|c| c["calls"].as_u64())
            .unwrap_or(0)
    };
    for script in ["move_due", "claim_jobs", "settle_jobs"] {
        assert!(calls(script) > 0, "{script}: {report:#}");
    }
    let total: f64 = by_script
        .iter()
        .map(|c| c["us_per_job"].as_f64().unwrap())
        .sum();
    assert!(total > 0.0, "{report:#}");
    let mut con = redis.conn();
    let threshold: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-log-slower-than")
        .query(&mut con)
        .unwrap();
    assert_ne!(threshold[1], "0", "the slowlog setting was put back");
    assert_eq!(crate::common::llen(&mut far.conn(), "q:far"), 2000);
}
