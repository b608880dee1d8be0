//! Forecast and operator console: the numbers `zdelay forecast` and `/api/…` give equal what
//! Redis holds on a seeded dataset; actions need the token (and refuse cross-site and form
//! requests); a real headless chromium loads every page, checks it against Redis, replays a
//! dead job with the token and is refused without it.

use crate::common::{
    Daemon, RedisServer, SeededRng, TestConfig, http_request, lrange, redis_now_ms, wait_for,
};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use zdelay::{Client, NewJob, OnConflict};

const TOKEN: &str = "console-test-token-0123456789";
const SHARDS: u16 = 4;

const ROUTES: &str = r#"
[poller]
stats_interval = "500ms"

[[routes]]
name = "default"
sink = "local"
target = "queue:default"

[[routes]]
name = "broken"
sink = "local"
target = "queue:broken"

[[sources]]
key = "raw:s"
score_unit = "s"
route = "default"

[[sources]]
key = "raw:b"
route = "broken"
"#;

fn config(redis: &RedisServer, admin_extra: &str) -> TestConfig {
    // TestConfig writes `[admin]`; a second such table is invalid TOML, so the extra fields
    // go into that one.
    let config = TestConfig::new(&redis.url(), SHARDS, ROUTES);
    if !admin_extra.is_empty() {
        let text = std::fs::read_to_string(&config.path).unwrap();
        let text = text.replacen("[admin]\n", &format!("[admin]\n{admin_extra}\n"), 1);
        std::fs::write(&config.path, text).unwrap();
    }
    config
}

/// Enqueues `(id, due ms, payload)` jobs to route `default`, as a producer given the config
/// (it registers the route's lane if no daemon has yet).
fn enqueue(config: &TestConfig, jobs: &[(String, i64, String)]) {
    let batch = jobs
        .iter()
        .map(|(id, due, payload)| NewJob::new("default", payload.clone()).id(id).at(*due))
        .collect();
    let rt = crate::common::runtime();
    let results = rt
        .block_on(config.client(&rt).enqueue_batch(batch, OnConflict::Replace))
        .unwrap();
    for r in results {
        r.unwrap();
    }
}

/// The keys of one kind (`due`, `dead`, `sched_due`, `ready`) of spread shard `s`.
fn spread_key(s: u16, suffix: &str) -> String {
    let keys = zdelay::keys::Keys::new("zdelay", SHARDS);
    match suffix {
        "due" => keys.due(s),
        "dead" => keys.dead(s),
        "ready" => keys.ready(s),
        "sched_due" => keys.shard(s).sched_due,
        other => panic!("no spread shard key {other}"),
    }
}

/// The key of one kind (`due`, `dead`, `sched_due`) of a route lane.
fn lane_key(lane: &zdelay::keys::LaneKeys, suffix: &str) -> String {
    match suffix {
        "due" => lane.due.clone(),
        "dead" => lane.dead.clone(),
        "sched_due" => lane.sched_due.clone(),
        other => panic!("no lane key {other}"),
    }
}

fn zset_whole(con: &mut redis::Connection, key: &str) -> BTreeMap<String, f64> {
    let v: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(con)
        .unwrap();
    v.into_iter().collect()
}

/// Every member with its score (ms) of one kind of ZSET in each spread shard, and in each
/// route lane (by route): the truth, read whole.
type Members = (
    Vec<BTreeMap<String, f64>>,
    BTreeMap<String, BTreeMap<String, f64>>,
);

fn members(con: &mut redis::Connection, suffix: &str) -> Members {
    let shards = (0..SHARDS)
        .map(|s| zset_whole(con, &spread_key(s, suffix)))
        .collect();
    let lanes = lanes(con)
        .into_iter()
        .map(|(route, lane)| (route, zset_whole(con, &lane_key(&lane, suffix))))
        .collect();
    (shards, lanes)
}

/// [`members`] of the spread shards and the lanes alike.
fn shard_members(con: &mut redis::Connection, suffix: &str) -> Vec<BTreeMap<String, f64>> {
    let (shards, lanes) = members(con, suffix);
    shards.into_iter().chain(lanes.into_values()).collect()
}

/// The live route lanes, by route.
fn lanes(con: &mut redis::Connection) -> BTreeMap<String, zdelay::keys::LaneKeys> {
    crate::common::stored::every_lane(con)
        .into_iter()
        .map(|lane| {
            let route = lane.due.rsplit_once(":due:").unwrap().1.to_owned();
            (route, lane)
        })
        .collect()
}

/// The keys of route `route`'s lane.
fn lane_of(con: &mut redis::Connection, route: &str) -> zdelay::keys::LaneKeys {
    lanes(con)
        .remove(route)
        .unwrap_or_else(|| panic!("no lane for route {route}"))
}

/// What falls in each step `(now + i·step, now + (i+1)·step]`, from scores (ms).
fn bucket(scores: impl IntoIterator<Item = f64>, now: i64, step: i64, steps: usize) -> Vec<u64> {
    let mut out = vec![0; steps];
    for s in scores {
        let offset = s - now as f64;
        if offset <= 0.0 {
            continue;
        }
        let i = ((offset / step as f64).ceil() as usize).saturating_sub(1);
        if i < steps {
            out[i] += 1;
        }
    }
    out
}

/// Checks a forecast JSON (CLI or API) against every member of every key, read whole.
fn check_forecast(con: &mut redis::Connection, f: &Value) {
    let now = f["now_ms"].as_i64().unwrap();
    let step = f["step_ms"].as_i64().unwrap();
    let steps = f["steps"].as_array().unwrap();
    let (due, due_in_lanes) = members(con, "due");
    let ready: u64 = (0..SHARDS)
        .map(|s| {
            redis::cmd("ZCARD")
                .arg(spread_key(s, "ready"))
                .query::<u64>(con)
                .unwrap()
        })
        .sum();
    let raw: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg("raw:s")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(con)
        .unwrap();
    let raw_ms: Vec<f64> = raw.iter().map(|(_, s)| (s * 1000.0).round()).collect();
    let overdue = due
        .iter()
        .chain(due_in_lanes.values())
        .flat_map(|m| m.values())
        .chain(&raw_ms)
        .filter(|&&s| s <= now as f64)
        .count() as u64
        + ready;
    assert_eq!(f["overdue"].as_u64().unwrap(), overdue, "overdue");
    let mut total = vec![0u64; steps.len()];
    for (shard, members) in due.iter().enumerate() {
        let counts = bucket(members.values().copied(), now, step, steps.len());
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                steps[i]["by_shard"][shard.to_string()].as_u64().unwrap(),
                *c,
                "shard {shard} step {i}"
            );
            total[i] += c;
        }
    }
    for (route, members) in &due_in_lanes {
        let counts = bucket(members.values().copied(), now, step, steps.len());
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                steps[i]["by_route"][route].as_u64().unwrap(),
                *c,
                "route {route} step {i}"
            );
            total[i] += c;
        }
    }
    let raw_counts = bucket(raw_ms.iter().copied(), now, step, steps.len());
    let sched: Vec<f64> = shard_members(con, "sched_due")
        .iter()
        .flat_map(|m| m.values().copied().collect::<Vec<_>>())
        .collect();
    let sched_counts = bucket(sched, now, step, steps.len());
    let drain = f["drain_per_step"].as_u64();
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["by_source"]["raw:s"].as_u64().unwrap(), raw_counts[i]);
        assert_eq!(
            s["count"].as_u64().unwrap(),
            total[i] + raw_counts[i],
            "step {i}"
        );
        assert_eq!(s["schedules"].as_u64().unwrap(), sched_counts[i]);
        assert_eq!(s["start_ms"].as_i64().unwrap(), now + i as i64 * step);
        let spike = drain.is_some_and(|d| s["count"].as_u64().unwrap() > d);
        assert_eq!(s["spike"].as_bool().unwrap(), spike, "step {i}");
    }
}

/// Seeds `{zdelay}:activity` with `delivered` deliveries in the current minute (Redis clock),
/// and 1000 lateness observations: 900 within 10 ms, 100 within 1 s (p50 10 ms, p99 1 s,
/// whatever a few more observations of the daemon's own).
fn seed_activity(con: &mut redis::Connection, delivered: u64) -> i64 {
    let minute = redis_now_ms(con) / 60_000;
    redis::cmd("HSET")
        .arg("{zdelay}:activity")
        .arg(format!("{minute}:delivered"))
        .arg(delivered)
        .arg(format!("{minute}:late3"))
        .arg(900)
        .arg(format!("{minute}:late9"))
        .arg(100)
        .query::<()>(con)
        .unwrap();
    minute
}

#[test]
fn forecast_counts_equal_redis_truth_and_flag_spikes() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let mut rng = SeededRng::new(11);
    // Overdue jobs (no daemon runs: they stay), a spread over ten minutes, a burst at +5m30s.
    let mut jobs: Vec<(String, i64, String)> = (0..300)
        .map(|i| {
            (
                format!("job-{i}"),
                now + rng.range(-60_000, 600_000),
                "p".into(),
            )
        })
        .collect();
    jobs.extend((0..200).map(|i| (format!("burst-{i}"), now + 330_000, "b".into())));
    enqueue(&config, &jobs);
    for i in 0..50 {
        let score = (now + rng.range(-30_000, 600_000)) as f64 / 1000.0;
        redis::cmd("ZADD")
            .arg("raw:s")
            .arg(format!("{score:.3}"))
            .arg(format!("m{i}"))
            .query::<()>(&mut con)
            .unwrap();
    }
    for (id, every) in [("tick", "1m"), ("slow", "7m")] {
        let out = config.cli(&[
            "schedule",
            "set",
            id,
            "--dest",
            "default",
            "--every",
            every,
            "--payload",
            id,
        ]);
        assert!(out.status.success(), "{out:?}");
    }
    let seeded_minute = seed_activity(&mut con, 120);

    let out = config.cli(&["forecast", "--next", "10m", "--step", "1m", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let f: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f["steps"].as_array().unwrap().len(), 10);
    check_forecast(&mut con, &f);
    // 120 delivered in the minutes since the seeded one: the rate and what a step drains.
    let minutes = f["now_ms"].as_i64().unwrap() / 60_000 - seeded_minute + 1;
    let rate = 120.0 / (minutes * 60) as f64;
    assert!((f["delivery_rate_per_s"].as_f64().unwrap() - rate).abs() < 1e-9);
    assert_eq!(
        f["drain_per_step"].as_u64().unwrap(),
        (rate * 60.0).floor() as u64
    );
    assert!(
        f["steps"][5]["spike"].as_bool().unwrap(),
        "the burst is a spike: {}",
        f["steps"][5]
    );
    // The table says so too.
    let out = config.cli(&["forecast", "--next", "10m", "--step", "1m"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("SPIKE"), "{text}");
    assert!(text.contains("overdue now:"), "{text}");
    // Bad input: a usage error, nothing printed on stdout.
    let out = config.cli(&["forecast", "--next", "1d", "--step", "1s"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 1440"));
}

/// Future jobs (+2 to +9 minutes: nothing the daemon moves while the test looks), dead ones
/// (expired on arrival; `wrong-0` killed twice by route `broken`, whose list key holds a
/// string, so it has one earlier death; an occurrence of schedule `broken-tick` killed the
/// same way), a dead member of raw source `raw:b` (route `broken`), three schedules. Needs
/// the daemon running. Returns the scheduled ids and the dead ids (`late-0..2`, `wrong-0`,
/// the occurrence).
fn seed_for_console(redis: &RedisServer, config: &TestConfig) -> (Vec<String>, Vec<String>) {
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let mut rng = SeededRng::new(7);
    let mut jobs: Vec<(String, i64, String)> = (0..120)
        .map(|i| {
            (
                format!("job-{i}"),
                now + rng.range(120_000, 540_000),
                format!("payload {i}"),
            )
        })
        .collect();
    jobs.push(("big".into(), now + 300_000, "x".repeat(10_000)));
    enqueue(config, &jobs);
    let mut dead: Vec<String> = (0..3).map(|i| format!("late-{i}")).collect();
    for id in &dead {
        let out = config.cli(&[
            "enqueue",
            "--dest",
            "default",
            "--id",
            id,
            "--at",
            &(now - 10_000).to_string(),
            "--max-lateness",
            "1ms",
            "--payload",
            &format!("dead {id}"),
        ]);
        assert!(out.status.success(), "{out:?}");
    }
    redis::cmd("SET")
        .arg("queue:broken")
        .arg("not a list")
        .query::<()>(&mut con)
        .unwrap();
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "broken",
        "--id",
        "wrong-0",
        "--payload",
        "wrong 0",
    ]);
    assert!(out.status.success(), "{out:?}");
    redis::cmd("ZADD")
        .arg("raw:b")
        .arg(now - 10_000)
        .arg("m-broken")
        .query::<()>(&mut con)
        .unwrap();
    for (id, dest, how) in [
        ("tick", "default", ["--every", "1h"]),
        ("nightly", "default", ["--cron", "0 3 * * *"]),
        ("broken-tick", "broken", ["--every", "1h"]),
    ] {
        let mut args = vec!["schedule", "set", id, "--dest", dest, "--payload", id];
        args.extend(how);
        let out = config.cli(&args);
        assert!(out.status.success(), "{out:?}");
    }
    let rt = crate::common::runtime();
    let occurrence = rt
        .block_on(
            config
                .client(&rt)
                .operator()
                .schedule_run_now("broken-tick"),
        )
        .unwrap()
        .unwrap();
    dead.push("wrong-0".into());
    dead.push(occurrence);
    wait_for("every seeded job is dead", Duration::from_secs(10), || {
        dead_ids(&mut con).len() == dead.len()
    });
    let out = config.cli(&["dead", "replay", "--id", "wrong-0"]);
    assert!(out.status.success(), "{out:?}");
    let history = lane_of(&mut con, "broken").history;
    wait_for("wrong-0 died again", Duration::from_secs(10), || {
        dead_ids(&mut con).contains("wrong-0")
            && redis::cmd("HEXISTS")
                .arg(&history)
                .arg("wrong-0")
                .query::<bool>(&mut con)
                .unwrap()
    });
    wait_for("the raw member is dead", Duration::from_secs(10), || {
        redis::cmd("ZCARD")
            .arg("raw:b:dead")
            .query::<u64>(&mut con)
            .unwrap()
            == 1
    });
    (jobs.into_iter().map(|(id, _, _)| id).collect(), dead)
}

/// What Redis holds for one dead job, read whole: the truth the API's filters are checked on.
struct DeadTruth {
    id: String,
    died_ms: i64,
    reason: String,
    dest: Option<String>,
    schedule: Option<String>,
}

fn dead_truth(con: &mut redis::Connection) -> Vec<DeadTruth> {
    let hget = |con: &mut redis::Connection, key: &str, id: &str| -> Option<Vec<u8>> {
        redis::cmd("HGET").arg(key).arg(id).query(con).unwrap()
    };
    let text = |bytes: Option<Vec<u8>>| String::from_utf8(bytes.unwrap_or_default()).unwrap();
    let mut out = Vec::new();
    // Spread shards hold envelopes (two-phase routes).
    let keys = zdelay::keys::Keys::new("zdelay", SHARDS);
    for shard in 0..SHARDS {
        for (id, died) in zset_whole(con, &keys.dead(shard)) {
            let reason = text(hget(con, &keys.reasons(shard), &id));
            let env =
                hget(con, &keys.jobs(shard), &id).and_then(|r| zdelay::Envelope::decode(&r).ok());
            out.push(DeadTruth {
                id,
                died_ms: died as i64,
                reason,
                dest: env.as_ref().map(|e| e.dest.clone()),
                schedule: env.and_then(|e| e.meta.schedule),
            });
        }
    }
    // A lane holds its route's payloads raw, the meta (schedule, headers) apart.
    for (route, lane) in lanes(con) {
        for (id, died) in zset_whole(con, &lane.dead) {
            let reason = text(hget(con, &lane.reasons, &id));
            let meta: Option<Value> =
                hget(con, &lane.meta, &id).map(|m| serde_json::from_slice(&m).unwrap());
            out.push(DeadTruth {
                id,
                died_ms: died as i64,
                reason,
                dest: Some(route.clone()),
                schedule: meta.and_then(|m| m["schedule"].as_str().map(str::to_owned)),
            });
        }
    }
    out
}

fn listed_ids(v: &Value, key: &str) -> BTreeSet<String> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect()
}

fn dead_ids(con: &mut redis::Connection) -> BTreeSet<String> {
    shard_members(con, "dead")
        .into_iter()
        .flat_map(|m| m.into_keys())
        .collect()
}

/// A job's score in its shard's `due` set, if it is there.
fn due_score(con: &mut redis::Connection, id: &str) -> Option<f64> {
    shard_members(con, "due")
        .iter()
        .find_map(|m| m.get(id).copied())
}

fn bearer() -> String {
    format!("Authorization: Bearer {TOKEN}")
}

/// A GET answered 200, as JSON; it sends the token (payload reads need it where one is
/// configured; without one configured it is ignored).
fn get_json(port: u16, path: &str) -> Value {
    let (status, body) = http_request(port, "GET", path, &[&bearer()]).expect("admin answers");
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn console_api_equals_redis_and_actions_need_the_token() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let daemon = Daemon::start(&config);
    let port = config.admin_port;
    let (jobs, dead) = seed_for_console(&redis, &config);
    let mut con = redis.conn();
    wait_for("the expired jobs are dead", Duration::from_secs(10), || {
        dead_ids(&mut con).len() == dead.len()
    });

    let stats = get_json(port, "/api/stats");
    let due = shard_members(&mut con, "due");
    assert_eq!(
        stats["total"]["scheduled"].as_u64().unwrap() as usize,
        due.iter().map(|m| m.len()).sum::<usize>()
    );
    assert_eq!(
        stats["total"]["scheduled"].as_u64().unwrap() as usize,
        jobs.len()
    );
    assert_eq!(
        stats["total"]["dead"].as_u64().unwrap() as usize,
        dead.len() + 1,
        "with raw:b's member"
    );
    assert_eq!(stats["instances"].as_array().unwrap().len(), 1);
    assert_eq!(stats["actions_enabled"], true);
    // The CLI's stats --json is the same document (but for the moment it was taken).
    let cli: Value = serde_json::from_slice(&config.cli(&["stats", "--json"]).stdout).unwrap();
    assert_eq!(cli["total"], stats["total"]);

    let f = get_json(port, "/api/forecast?next=10m&step=1m");
    check_forecast(&mut con, &f);
    let bad = http_request(port, "GET", "/api/forecast?next=1d&step=1s", &[]).unwrap();
    assert_eq!(bad.0, 400, "{}", bad.1);

    let d = get_json(port, "/api/dead");
    assert_eq!(listed_ids(&d, "jobs"), dead_ids(&mut con));
    assert_eq!(d["total"].as_u64().unwrap() as usize, dead.len());
    assert_eq!(d["complete"], true);
    let truth = dead_truth(&mut con);
    for j in d["jobs"].as_array().unwrap() {
        let t = truth.iter().find(|t| t.id == j["id"]).unwrap();
        assert_eq!(j["route"].as_str(), t.dest.as_deref(), "{j}");
        assert_eq!(j["reason"].as_str().unwrap(), t.reason, "{j}");
        assert_eq!(j["died_ms"].as_i64().unwrap(), t.died_ms, "{j}");
    }
    // Raw members of every source are listed too, with their ids.
    let raw: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg("raw:b:dead")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut con)
        .unwrap();
    assert_eq!(raw.len(), 1);
    // Its id carries its death time (what finds it) and its hash (SHA-1's start).
    let member_hash = zdelay::dead::member_id(raw[0].0.as_bytes());
    let member_id = format!("{}-{member_hash}", raw[0].1 as i64);
    assert_eq!(d["raw"].as_array().unwrap().len(), 1, "{}", d["raw"]);
    assert_eq!(d["raw"][0]["id"], member_id.as_str());
    assert_eq!(d["raw"][0]["payload_preview"], raw[0].0.as_str());
    assert_eq!(d["raw"][0]["source"], "raw:b");
    assert_eq!(d["raw"][0]["died_ms"].as_i64().unwrap(), raw[0].1 as i64);
    assert_eq!(d["sources"], serde_json::json!(["raw:s", "raw:b"]));

    // Each filter, alone and combined, lists exactly what the truth admits.
    let now = d["now_ms"].as_i64().unwrap();
    let hour = 3_600_000;
    type Admits = Box<dyn Fn(&DeadTruth) -> bool>;
    let cases: Vec<(&str, Admits)> = vec![
        (
            "route=broken",
            Box::new(|t| t.dest.as_deref() == Some("broken")),
        ),
        (
            "route=default",
            Box::new(|t| t.dest.as_deref() == Some("default")),
        ),
        (
            "reason=wrongtype",
            Box::new(|t| t.reason.to_lowercase().contains("wrongtype")),
        ),
        (
            "reason=expired&route=default",
            Box::new(|t| t.reason.contains("expired") && t.dest.as_deref() == Some("default")),
        ),
        (
            "schedule=broken-tick",
            Box::new(|t| t.schedule.as_deref() == Some("broken-tick")),
        ),
        ("schedule=tick", Box::new(|_| false)),
        ("older_than=1h", Box::new(move |t| now - t.died_ms >= hour)),
        (
            "newer_than=1h&older_than=",
            Box::new(move |t| now - t.died_ms < hour),
        ),
        ("reason=no-such-reason", Box::new(|_| false)),
    ];
    for (query, admits) in cases {
        let v = get_json(port, &format!("/api/dead?{query}"));
        let want: BTreeSet<String> = truth
            .iter()
            .filter(|t| admits(t))
            .map(|t| t.id.clone())
            .collect();
        assert_eq!(listed_ids(&v, "jobs"), want, "{query}");
    }
    assert!(!listed_ids(&get_json(port, "/api/dead?route=broken"), "jobs").is_empty());
    let r = get_json(port, "/api/dead?reason=wrongtype");
    assert_eq!(
        r["raw"].as_array().unwrap().len(),
        1,
        "reason applies to raw members"
    );
    let r = get_json(port, "/api/dead?route=broken");
    assert!(
        r["raw"].as_array().unwrap().is_empty(),
        "route: envelope jobs only"
    );
    assert!(r["raw_not_listed"].as_str().unwrap().contains("--route"));
    let r = get_json(port, "/api/dead?source=raw:b");
    assert!(r["jobs"].as_array().unwrap().is_empty());
    assert_eq!(r["raw"][0]["id"], member_id.as_str());
    assert!(
        get_json(port, "/api/dead?limit=1")["jobs"]
            .as_array()
            .unwrap()
            .len()
            == 1
    );
    // Bad filters: 400, naming what is wrong.
    for (query, says) in [
        ("older_than=soon", "older_than"),
        ("older_than=1h&newer_than=1m", "no time window"),
        ("source=raw:b&route=broken", "raw members"),
        ("source=nope", "nope"),
    ] {
        let (status, body) =
            http_request(port, "GET", &format!("/api/dead?{query}"), &[&bearer()]).unwrap();
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }

    // One dead job: its history (the earlier death), attempts, last error, payload.
    let w = get_json(port, "/api/dead/wrong-0");
    let history: String = redis::cmd("HGET")
        .arg(lane_of(&mut con, "broken").history)
        .arg("wrong-0")
        .query(&mut con)
        .unwrap();
    let deaths = zdelay::dead::parse_history(&history);
    assert_eq!(deaths.len(), 1);
    assert_eq!(w["history"], serde_json::to_value(&deaths).unwrap());
    assert_eq!(w["earlier_deaths"], 1);
    assert!(
        w["history"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("WRONGTYPE"),
        "{w}"
    );
    assert_eq!(w["route"], "broken");
    assert_eq!(w["payload_preview"], "wrong 0");
    assert_eq!(w["payload_truncated"], false);
    assert!(
        w.get("attempt").is_some() && w.get("last_error").is_some(),
        "{w}"
    );
    let m = get_json(port, &format!("/api/dead/{member_id}?source=raw:b"));
    assert_eq!(m["payload_preview"], "m-broken");
    assert_eq!(m["message_id"], format!("raw:b:{member_hash}"));
    // The hash alone (ids before they carried the death time) is still found, by a scan
    // bounded to the oldest 10000 members.
    let m = get_json(port, &format!("/api/dead/{member_hash}?source=raw:b"));
    assert_eq!(m["id"], member_id.as_str());
    assert_eq!(
        http_request(port, "GET", "/api/dead/job-3", &[&bearer()])
            .unwrap()
            .0,
        404
    );

    let j = get_json(port, "/api/jobs/job-3");
    assert_eq!(j["state"], "scheduled");
    assert_eq!(j["payload"], "payload 3");
    let score = due.iter().find_map(|m| m.get("job-3")).unwrap();
    assert_eq!(j["due"].as_i64().unwrap(), *score as i64);
    let big = get_json(port, "/api/jobs/big");
    assert_eq!(big["payload_truncated"], true);
    assert_eq!(big["payload_bytes"], 10_000);
    assert_eq!(big["payload"].as_str().unwrap().len(), 2048);
    assert_eq!(
        http_request(port, "GET", "/api/jobs/nope", &[&bearer()])
            .unwrap()
            .0,
        404
    );

    let s = get_json(port, "/api/schedules");
    let sched_due: BTreeMap<String, f64> = shard_members(&mut con, "sched_due")
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(
        (s["total"].as_u64(), s["pending"].as_u64()),
        (Some(3), Some(3))
    );
    // The next to fire, soonest first: sched_due's order.
    let mut by_next: Vec<(f64, &String)> = sched_due.iter().map(|(id, at)| (*at, id)).collect();
    by_next.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(b.1)));
    let listed: Vec<&str> = s["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        by_next
            .iter()
            .map(|(_, id)| id.as_str())
            .collect::<Vec<_>>()
    );
    for x in s["schedules"].as_array().unwrap() {
        let id = x["id"].as_str().unwrap();
        assert_eq!(x["next_ms"].as_i64().unwrap(), sched_due[id] as i64, "{id}");
        assert!(x["previous_ms"].as_i64().unwrap() < x["next_ms"].as_i64().unwrap());
    }
    assert!(s["idle"].as_array().unwrap().is_empty());
    assert!(s["idle_next"].is_null(), "three definitions: scanned whole");
    let first = get_json(port, "/api/schedules?limit=1");
    assert_eq!(first["schedules"].as_array().unwrap().len(), 1);
    assert_eq!(first["schedules"][0]["id"], listed[0]);
    // Paged one at a time with `after`: the same order, and no `next` after the last.
    let mut paged = vec![first["schedules"][0]["id"].as_str().unwrap().to_owned()];
    let mut next = first["next"].as_str().expect("a next page").to_owned();
    loop {
        let page = get_json(port, &format!("/api/schedules?limit=1&after={next}"));
        paged.push(page["schedules"][0]["id"].as_str().unwrap().to_owned());
        match page["next"].as_str() {
            Some(n) => next = n.to_owned(),
            None => break,
        }
    }
    assert_eq!(paged, listed);
    assert!(s["next"].is_null(), "three schedules: one page");
    assert_eq!(
        http_request(port, "GET", "/api/schedules?after=x", &[])
            .unwrap()
            .0,
        400
    );
    assert_eq!(
        http_request(port, "GET", "/api/schedules?idle_from=x", &[])
            .unwrap()
            .0,
        400
    );

    // Refused: no token, a wrong one, cross-site, a form body. Redis is unchanged.
    let replay = format!("/api/dead/{}/replay", dead[0]);
    let bearer = format!("Authorization: Bearer {TOKEN}");
    for headers in [
        vec![],
        vec!["Authorization: Bearer console-test-token-0123456780"],
        vec![bearer.as_str(), "Origin: http://evil.example"],
        vec![bearer.as_str(), "Sec-Fetch-Site: cross-site"],
        vec![
            bearer.as_str(),
            "Content-Type: application/x-www-form-urlencoded",
        ],
    ] {
        let (status, body) = http_request(port, "POST", &replay, &headers).unwrap();
        assert_eq!(status, 403, "{headers:?}: {body}");
        assert!(!body.contains(TOKEN));
    }
    assert_eq!(dead_ids(&mut con).len(), dead.len(), "nothing replayed");

    // With the token: replay (delivered to the list), purge, cancel, pause, resume, run.
    let ok = |path: &str| {
        let (status, body) = http_request(port, "POST", path, &[bearer.as_str()]).unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str::<Value>(&body).unwrap()
    };
    ok(&replay);
    let payload = format!("dead {}", dead[0]).into_bytes();
    wait_for(
        "the replayed job is delivered",
        Duration::from_secs(10),
        || lrange(&mut con, "queue:default").contains(&payload),
    );
    assert!(!dead_ids(&mut con).contains(&dead[0]));
    ok(&format!("/api/dead/{}/purge", dead[1]));
    assert!(!dead_ids(&mut con).contains(&dead[1]));
    let stored: bool = redis::cmd("HEXISTS")
        .arg(lane_of(&mut con, "default").jobs)
        .arg(&dead[1])
        .query(&mut con)
        .unwrap();
    assert!(!stored, "purged for good");
    // Replay later, attempts kept: due in an hour.
    let later = ok(&format!(
        "/api/dead/{}/replay?in=1h&keep_attempts=true",
        dead[2]
    ));
    assert_eq!(later["attempts"], "kept", "{later}");
    let due_at = due_score(&mut con, &dead[2]).expect("pending again");
    assert!(due_at >= (now + hour - 60_000) as f64, "{due_at} vs {now}");
    // Bulk: refused without a filter, then by filter (the raw member, by source).
    let (status, body) =
        http_request(port, "POST", "/api/dead?action=purge", &[bearer.as_str()]).unwrap();
    assert_eq!(status, 400, "{body}");
    let purged = ok("/api/dead?action=purge&source=raw:b&reason=wrongtype");
    assert_eq!(purged["purged"], 1, "{purged}");
    let left: u64 = redis::cmd("ZCARD")
        .arg("raw:b:dead")
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 0);
    let replayed = ok("/api/dead?action=replay&schedule=broken-tick&in=1h");
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    assert_eq!(replayed["attempts"], "reset");
    assert!(
        due_score(&mut con, &dead[4]).is_some(),
        "the occurrence is pending"
    );
    ok("/api/jobs/job-3/cancel");
    assert!(
        shard_members(&mut con, "due")
            .iter()
            .all(|m| !m.contains_key("job-3"))
    );
    ok("/api/schedules/tick/pause");
    let paused = get_json(port, "/api/schedules");
    let tick = |v: &Value| {
        v["schedules"]
            .as_array()
            .unwrap()
            .iter()
            .chain(v["idle"].as_array().unwrap())
            .find(|x| x["id"] == "tick")
            .cloned()
            .unwrap()
    };
    assert_eq!(tick(&paused)["paused"], true);
    assert_eq!(paused["pending"], 2);
    assert_eq!(
        paused["idle"].as_array().unwrap().len(),
        1,
        "listed as paused"
    );
    assert!(
        paused["schedules"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["id"] != "tick")
    );
    // The CLI lists the same, pending soonest first then the paused one.
    let cli: Value =
        serde_json::from_slice(&config.cli(&["schedule", "list", "--json"]).stdout).unwrap();
    let cli_ids: Vec<&str> = cli
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    let api_ids: Vec<&str> = paused["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .chain(paused["idle"].as_array().unwrap())
        .map(|x| x["id"].as_str().unwrap())
        .collect();
    assert_eq!(cli_ids, api_ids);
    ok("/api/schedules/tick/resume");
    let resumed = get_json(port, "/api/schedules");
    assert_eq!(tick(&resumed)["paused"], false);
    let next_before = tick(&resumed)["next_ms"].clone();
    let run = ok("/api/schedules/tick/run");
    assert!(run["job"].as_str().unwrap().starts_with("{tick}:"), "{run}");
    wait_for(
        "the run-now occurrence is delivered",
        Duration::from_secs(10),
        || lrange(&mut con, "queue:default").contains(&b"tick".to_vec()),
    );
    assert_eq!(
        tick(&get_json(port, "/api/schedules"))["next_ms"],
        next_before,
        "grid kept"
    );
    assert_eq!(
        http_request(port, "POST", "/api/schedules/none/run", &[bearer.as_str()])
            .unwrap()
            .0,
        404
    );

    let log = daemon.log_text();
    assert!(!log.contains(TOKEN), "the token is never logged");
    assert!(log.contains("console action refused"), "{log}");
    assert!(log.contains("action=\"dead replay\""), "{log}");
}

#[test]
fn console_without_a_token_is_read_only() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    enqueue(
        &config,
        &[(
            "a".into(),
            redis_now_ms(&mut redis.conn()) + 600_000,
            "a".into(),
        )],
    );
    let (status, body) = http_request(
        port,
        "POST",
        "/api/jobs/a/cancel",
        &["Authorization: Bearer anything-at-all-long-enough"],
    )
    .unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("read-only"), "{body}");
    assert_eq!(get_json(port, "/api/jobs/a")["state"], "scheduled");
    let stats = get_json(port, "/api/stats");
    assert_eq!(stats["actions_enabled"], false);
    assert_eq!(
        stats["payload_reads"], "open",
        "loopback without a token: payloads readable"
    );
    let (status, page) = http_request(port, "GET", "/", &[]).unwrap();
    assert_eq!(status, 200);
    assert!(
        page.contains("app.js") && !page.contains("http"),
        "no CDN: {page}"
    );
}

#[test]
fn console_in_a_real_browser() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        &format!("token = \"{TOKEN}\"\nui_prefix = \"/ops/zdelay\""),
    );
    let _daemon = Daemon::start(&config);
    let (jobs, dead) = seed_for_console(&redis, &config);
    let mut con = redis.conn();
    wait_for("the expired jobs are dead", Duration::from_secs(10), || {
        dead_ids(&mut con).len() == dead.len()
    });
    // 15 delivered this minute: a step holding more is a spike.
    let seeded_minute = seed_activity(&mut con, 15);
    let dead_before = dead_ids(&mut con);
    let base = format!("http://127.0.0.1:{}/ops/zdelay/", config.admin_port);
    let mut args = vec![
        base.as_str(),
        TOKEN,
        "job-5",
        &dead[0],
        &dead[1],
        "nightly",
        "broken",
        "wrong-0",
    ];
    let shots = std::env::var("ZDELAY_CONSOLE_SHOTS").ok();
    args.extend(shots.as_deref());
    // A health record as a firing writes it (4 fired, 3 missed, 1 expired; the last firing
    // 500 ms late): the nightly schedule's row shows it.
    let fired_at = crate::common::redis_now_ms(&mut con) - 60_000;
    redis::cmd("HSET")
        .arg(lane_of(&mut con, "default").sched_health)
        .arg("nightly")
        .arg(format!("4 3 1 0 {fired_at} {}", fired_at - 500))
        .query::<()>(&mut con)
        .unwrap();
    let r = crate::common::browser_script("console_browser.py", &args);

    let o = &r["overview"];
    assert_eq!(o["scheduled"].as_u64().unwrap() as usize, jobs.len());
    assert_eq!(
        o["dead"].as_u64().unwrap() as usize,
        dead.len() + 1,
        "with raw:b's member"
    );
    assert_eq!(o["due"], 0);
    assert_eq!(o["instances"].as_array().unwrap().len(), 1);
    // The four spread shards, the two route lanes (where the jobs are), the two raw
    // sources, the total.
    let rows: BTreeSet<&str> = o["backlog_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(rows.len(), SHARDS as usize + 5, "{rows:?}");
    assert!(
        rows.contains("route lane default") && rows.contains("route lane broken"),
        "{rows:?}"
    );
    assert_eq!(o["lateness"], "≤10 / ≤1000 ms", "seeded buckets 3 and 9");

    // Every seeded job is due within the page's ten minutes; nothing is overdue.
    let f = &r["forecast"];
    assert_eq!(f["overdue"], 0);
    let counts: u64 = f["counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .sum();
    assert_eq!(counts as usize, jobs.len());
    assert_eq!(f["bars"].as_u64().unwrap(), 10);
    let minutes = redis_now_ms(&mut con) / 60_000 - seeded_minute + 1;
    let drain = f["drain"].as_u64().unwrap();
    assert!(drain == 15 / minutes as u64 || minutes > 1, "drain {drain}");
    let spikes = f["counts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.as_u64().unwrap() > drain)
        .count();
    assert!(spikes > 0, "120 jobs over 7 minutes against 15 a step");
    assert_eq!(f["spikes"].as_u64().unwrap() as usize, spikes);
    assert_eq!(f["spike_bars"].as_u64().unwrap() as usize, spikes);

    let ids: BTreeSet<&str> = r["schedules"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ids, BTreeSet::from(["broken-tick", "nightly", "tick"]));
    let row = r["schedules"]["row"].as_str().unwrap();
    assert!(row.contains("cron 0 3 * * *"), "{row}");
    assert_eq!(r["schedules"]["health"], "4 3 1 0");
    assert!(
        row.contains("4 / 3 / 1 / 0") && row.contains("500 ms late"),
        "{row}"
    );

    let shown: BTreeSet<String> = r["dead"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(shown, dead_before);
    assert_eq!(r["dead"]["total"].as_u64().unwrap() as usize, dead.len());
    assert_eq!(r["buttons_disabled_without_token"], true);
    // Before the token: the dead letters (payloads) are refused, and the page says why.
    let locked = r["dead_locked"].as_str().unwrap();
    assert!(locked.contains("admin token"), "{locked}");
    assert_eq!(
        r["dead"]["raw_rows"].as_array().unwrap().len(),
        1,
        "raw:b's member"
    );
    // Filtered by route in the page: exactly the dead jobs whose dest is `broken`.
    let broken: BTreeSet<String> = dead_truth(&mut con)
        .into_iter()
        .filter(|t| t.dest.as_deref() == Some("broken"))
        .map(|t| t.id)
        .collect();
    assert_eq!(broken.len(), 2, "wrong-0 and the broken-tick occurrence");
    let filtered: BTreeSet<String> = r["dead_filtered"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(filtered, broken);
    // Its detail page shows the earlier death from history.
    let lines = r["dead_detail"]["history"].as_array().unwrap();
    assert_eq!(lines.len(), 1, "{}", r["dead_detail"]);
    assert!(
        lines[0].as_str().unwrap().contains("WRONGTYPE"),
        "{lines:?}"
    );
    assert_eq!(r["dead_detail"]["fields"]["route"], "broken");
    assert_eq!(
        r["refused_status"], 403,
        "refused on the server without the token"
    );

    let fields = &r["job"]["fields"];
    assert_eq!(fields["id"], "job-5", "{}", r["job"]);
    assert_eq!(fields["state"], "scheduled");
    assert_eq!(r["job"]["payload"], "payload 5");

    assert_eq!(r["token_in_page_html"], false);
    assert_eq!(r["replay_status_class"], "ok", "{}", r["replay_status"]);
    let now_dead = dead_ids(&mut con);
    assert!(!now_dead.contains(&dead[0]), "replayed: left the dead set");
    assert!(
        now_dead.contains(&dead[1]),
        "the refused replay changed nothing"
    );
    let payload = format!("dead {}", dead[0]).into_bytes();
    wait_for(
        "the replayed job is delivered",
        Duration::from_secs(10),
        || lrange(&mut con, "queue:default").contains(&payload),
    );
}

/// Stores a dead job `id` (payload, one header) in route `default`'s lane, as the move
/// script leaves one that died: its payload and meta kept, its reason beside.
fn seed_dead_job(con: &mut redis::Connection, id: &str, payload: &[u8], died_ms: i64) {
    let lane = crate::common::lane_keys("default", "queue:default");
    let mut meta = zdelay::envelope::Meta::default();
    meta.headers
        .insert("authorization".into(), "Basic c2VjcmV0".into());
    let _: () = redis::pipe()
        .hset(&lane.jobs, id, payload)
        .hset(&lane.meta, id, serde_json::to_string(&meta).unwrap())
        .zadd(&lane.dead, id, died_ms)
        .hset(&lane.reasons, id, "rejected: no")
        .query(con)
        .unwrap();
}

/// Stores a dead member of raw source `raw:b`.
fn seed_dead_member(con: &mut redis::Connection, member: &[u8], died_ms: i64) {
    let _: () = redis::pipe()
        .zadd("raw:b:dead", member, died_ms)
        .hset("raw:b:dead:reasons", member, "rejected: no")
        .query(con)
        .unwrap();
}

/// Who may read what: with `admin.token` set, a job, the dead letters and a dead job (their
/// payloads and headers) need it — refused without it, wrong or right; counts, forecast and
/// schedule timing stay public. Every console request naming a foreign `Host` (DNS
/// rebinding) is refused, and API GETs marked cross-site too, as POSTs are.
#[test]
fn payload_reads_need_the_token_and_gets_check_the_site() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    enqueue(
        &config,
        &[("pending".into(), now + 600_000, "secret-payload".into())],
    );
    seed_dead_job(&mut con, "dead-1", b"secret-payload", now - 1000);
    seed_dead_member(&mut con, b"secret-payload raw", now - 1000);
    let member = format!(
        "{}-{}",
        now - 1000,
        zdelay::dead::member_id(b"secret-payload raw")
    );
    let payload_reads = [
        "/api/jobs/pending".to_owned(),
        "/api/dead".to_owned(),
        "/api/dead/dead-1".to_owned(),
        format!("/api/dead/{member}?source=raw:b"),
        "/api/dead?source=raw:b".to_owned(),
    ];
    for path in &payload_reads {
        for headers in [
            vec![],
            vec!["Authorization: Bearer console-test-token-0123456780"],
        ] {
            let (status, body) = http_request(port, "GET", path, &headers).unwrap();
            assert_eq!(status, 403, "{path} {headers:?}: {body}");
            assert!(
                !body.contains("secret-payload") && !body.contains("c2VjcmV0"),
                "{body}"
            );
            assert!(!body.contains(TOKEN), "{body}");
        }
        let v = get_json(port, path);
        assert!(v.to_string().contains("secret-payload"), "{path}: {v}");
    }
    assert_eq!(
        get_json(port, "/api/dead/dead-1")["headers"]["authorization"],
        "Basic c2VjcmV0"
    );
    // Public: counts, forecast, schedules' timing (never a payload or header).
    let out = config.cli(&[
        "schedule",
        "set",
        "tick",
        "--dest",
        "default",
        "--every",
        "1h",
        "--payload",
        "secret-payload",
        "--header",
        "authorization=Basic c2VjcmV0",
    ]);
    assert!(out.status.success(), "{out:?}");
    for path in ["/api/stats", "/api/forecast", "/api/schedules"] {
        let (status, body) = http_request(port, "GET", path, &[]).unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        assert!(
            !body.contains("secret-payload") && !body.contains("c2VjcmV0"),
            "{body}"
        );
    }
    let stats = get_json(port, "/api/stats");
    assert_eq!(stats["payload_reads"], "token");
    // The site: a foreign Host is refused everywhere on the console (pages too), even with
    // the token; IP addresses, localhost and configured names are fine.
    let b = bearer();
    for (path, headers, allowed) in [
        ("/api/stats", vec!["Host: evil.example:9464"], false),
        ("/", vec!["Host: evil.example"], false),
        ("/app.js", vec!["Host: rebind.evil.example"], false),
        (
            "/api/jobs/pending",
            vec![b.as_str(), "Host: evil.example"],
            false,
        ),
        ("/api/stats", vec!["Host: localhost:9464"], true),
        ("/api/stats", vec!["Host: [::1]:9464"], true),
        ("/", vec!["Host: LOCALHOST"], true),
        // API GETs from another site: refused; a link from elsewhere may open the page.
        ("/api/stats", vec!["Sec-Fetch-Site: cross-site"], false),
        ("/api/stats", vec!["Origin: http://evil.example"], false),
        (
            "/api/jobs/pending",
            vec![b.as_str(), "Sec-Fetch-Site: same-site"],
            false,
        ),
        ("/", vec!["Sec-Fetch-Site: cross-site"], true),
        ("/api/stats", vec!["Sec-Fetch-Site: same-origin"], true),
    ] {
        let (status, body) = http_request(port, "GET", path, &headers).unwrap();
        assert_eq!(
            status == 200,
            allowed,
            "{path} {headers:?}: {status} {body}"
        );
        if !allowed {
            assert_eq!(status, 403, "{path} {headers:?}: {body}");
            assert!(!body.contains("secret-payload"), "{body}");
        }
    }
    // /metrics and the probes are not the console's: any Host.
    let (status, _) =
        http_request(port, "GET", "/metrics", &["Host: prometheus.monitoring"]).unwrap();
    assert_eq!(status, 200);
}

/// Public reads can be turned off (they need the token then); the console can be turned
/// off entirely; `admin.metrics_listen` serves `/metrics`, `/healthz` and `/readyz` and
/// nothing of the console.
#[test]
fn public_reads_and_the_console_can_be_turned_off() {
    let redis = RedisServer::start();
    let closed = config(
        &redis,
        &format!("token = \"{TOKEN}\"\npublic_reads = false"),
    );
    let daemon = Daemon::start(&closed);
    let port = closed.admin_port;
    for path in ["/api/stats", "/api/forecast", "/api/schedules"] {
        let (status, body) = http_request(port, "GET", path, &[]).unwrap();
        assert_eq!(status, 403, "{path}: {body}");
        get_json(port, path);
    }
    drop(daemon);

    let metrics_port = crate::common::free_port();
    let off = config(
        &redis,
        &format!("console = false\nmetrics_listen = \"127.0.0.1:{metrics_port}\""),
    );
    let _daemon = Daemon::start(&off);
    let port = off.admin_port;
    for path in ["/", "/app.js", "/api/stats", "/api/dead", "/api/jobs/x"] {
        let (status, body) = http_request(port, "GET", path, &[&bearer()]).unwrap();
        assert_eq!(status, 404, "console off: {path}: {body}");
        let (status, _) = http_request(port, "POST", "/api/auth", &[&bearer()]).unwrap();
        assert_eq!(status, 404);
    }
    assert_eq!(http_request(port, "GET", "/metrics", &[]).unwrap().0, 200);
    let (status, text) = http_request(metrics_port, "GET", "/metrics", &[]).unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("zdelay_redis_up"), "{text}");
    assert_eq!(
        http_request(metrics_port, "GET", "/healthz", &[])
            .unwrap()
            .0,
        200
    );
    wait_for(
        "the metrics port says ready",
        Duration::from_secs(10),
        || http_request(metrics_port, "GET", "/readyz", &[]).is_some_and(|(s, _)| s == 200),
    );
    for path in ["/", "/api/stats", "/api/jobs/x", "/app.js"] {
        let (status, _) = http_request(metrics_port, "GET", path, &[&bearer()]).unwrap();
        assert_eq!(status, 404, "metrics port: {path}");
    }
}

/// Redis logs every command from now on (SLOWLOG with threshold 0), from an empty log.
fn log_every_command(con: &mut redis::Connection) {
    let _: () = redis::pipe()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .ignore()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(1_000_000)
        .ignore()
        .cmd("SLOWLOG")
        .arg("RESET")
        .ignore()
        .query(con)
        .unwrap();
}

/// A command Redis ran, as SLOWLOG keeps it: its duration and its first arguments (each cut
/// to 128 bytes).
struct Logged {
    micros: u64,
    args: Vec<String>,
}

/// SLOWLOG's client address of a command a script ran.
const FROM_A_SCRIPT: &[u8] = b"?:0";

impl Logged {
    /// Whether it is the script `name` (EVALSHA of its source's SHA-1).
    fn is_script(&self, name: &str) -> bool {
        self.args
            .first()
            .is_some_and(|c| c.eq_ignore_ascii_case("evalsha"))
            && self
                .args
                .get(1)
                .is_some_and(|sha| Some(sha) == script_sha(name).as_ref())
    }

    fn names(&self, text: &str) -> bool {
        self.args.iter().any(|a| a.contains(text))
    }
}

/// Every command clients sent since [`log_every_command`] (not those their scripts ran),
/// oldest first.
fn logged(con: &mut redis::Connection) -> Vec<Logged> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(-1).query(con).unwrap();
    let mut out: Vec<Logged> = entries
        .into_iter()
        .filter_map(|entry| {
            let redis::Value::Array(fields) = entry else {
                panic!("a SLOWLOG entry is an array: {entry:?}")
            };
            let client: Vec<u8> = redis::from_redis_value(fields[4].clone()).unwrap();
            if client == FROM_A_SCRIPT {
                return None;
            }
            let micros: u64 = redis::from_redis_value(fields[2].clone()).unwrap();
            let args: Vec<Vec<u8>> = redis::from_redis_value(fields[3].clone()).unwrap();
            Some(Logged {
                micros,
                args: args
                    .iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect(),
            })
        })
        .collect();
    out.reverse();
    out
}

/// The calls take under 50 ms. SLOWLOG measures wall time, and on a loaded machine (two cores
/// shared by several test runs) the OS pauses Redis in the middle of any command, however
/// small, for tens of milliseconds: one call in ten may take longer, none 500 ms. (What a
/// call reads is checked exactly by the bytes Redis sent.)
fn assert_calls_short(what: &str, calls: &[&Logged]) {
    let mut took: Vec<u64> = calls.iter().map(|l| l.micros / 1000).collect();
    took.sort_unstable();
    let slow = took.iter().filter(|&&ms| ms >= 50).count();
    assert!(
        slow <= calls.len() / 10 && took.last().is_none_or(|&ms| ms < 500),
        "{what}: calls took (ms) {took:?}"
    );
}

/// The SHA-1 EVALSHA names script `name` by (none for a script this build lacks).
fn script_sha(name: &str) -> Option<String> {
    let (_, source) = zdelay::store::scripts::ALL
        .iter()
        .find(|(n, _)| *n == name)?;
    Some(redis::Script::new(source).get_hash().to_owned())
}

/// Bytes Redis has sent to its clients (`INFO stats`).
fn sent_bytes(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_net_output_bytes")
}

/// Listing dead raw members of 1 MB (and a few of 2 MB) reads each in Redis and answers a
/// preview: the answer stays small, no Redis call takes long (each reads at most 1 MiB, or
/// one larger member: a member of S bytes costs Redis a copy of S whatever reads it, the
/// move script that killed it too), and what Redis sends the daemon is the previews, not
/// the members.
#[test]
fn raw_dead_listing_reads_members_inside_redis_within_a_budget() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let mut sizes = Vec::new();
    for i in 0..40u8 {
        let size = if i % 13 == 5 { 2 << 20 } else { 1 << 20 };
        let mut member = vec![b'a' + i % 26; size];
        member[0] = i;
        seed_dead_member(&mut con, &member, now - 10_000 + i64::from(i));
        sizes.push(size);
    }
    log_every_command(&mut con);
    let sent = sent_bytes(&mut con);
    let (status, body) = http_request(
        port,
        "GET",
        "/api/dead?source=raw:b&limit=500",
        &[&bearer()],
    )
    .expect("an answer within 10 s (not 40 MB of members)");
    let sent = sent_bytes(&mut con) - sent;
    assert_eq!(status, 200, "{}", &body[..body.len().min(500)]);
    assert!(body.len() < 100_000, "an answer of {} bytes", body.len());
    let v: Value = serde_json::from_str(&body).unwrap();
    let raw = v["raw"].as_array().unwrap();
    assert_eq!(raw.len(), 40);
    for (entry, size) in raw.iter().zip(&sizes) {
        assert_eq!(entry["payload_size"].as_u64().unwrap() as usize, *size);
        assert_eq!(entry["payload_truncated"], true);
    }
    assert!(sent < 1 << 20, "Redis sent {sent} bytes for the listing");
    let log = logged(&mut con);
    let reads: Vec<&Logged> = log.iter().filter(|l| l.names("raw:b:dead")).collect();
    assert!(
        reads.iter().any(|l| l.is_script("walk_raw_dead")),
        "read through walk_raw_dead"
    );
    assert_calls_short("reads of raw:b:dead", &reads);
}

/// A raw member is found by its id without a scan: the id carries its death time. An id
/// without it (the older form) is looked for among the oldest 10000 members only, and the
/// answer says how to find it. On 100k dead members, each lookup is a few Redis calls.
#[test]
fn raw_dead_lookup_by_id_does_not_scan_the_set() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    for chunk in 0..10 {
        let mut pipe = redis::pipe();
        for i in chunk * 10_000..(chunk + 1) * 10_000 {
            pipe.zadd("raw:b:dead", format!("m{i}"), now - 200_000 + i as i64)
                .ignore();
        }
        let _: () = pipe.query(&mut con).unwrap();
    }
    let last = b"m99999";
    let last_id = format!(
        "{}-{}",
        now - 200_000 + 99_999,
        zdelay::dead::member_id(last)
    );
    // What a lookup may send: the walk script, or reads of the dead set's members (the
    // stats sampler's ZCARD and the pollers' move_raw do not count).
    let calls = |con: &mut redis::Connection| {
        logged(con)
            .into_iter()
            .filter(|l| {
                l.is_script("walk_raw_dead")
                    || (l.names("raw:b:dead")
                        && ["ZRANGEBYSCORE", "ZRANGE", "ZSCAN", "HMGET", "HGET"]
                            .iter()
                            .any(|c| l.args[0].eq_ignore_ascii_case(c)))
            })
            .count()
    };
    let show = |id: &str| {
        http_request(
            port,
            "GET",
            &format!("/api/dead/{id}?source=raw:b"),
            &[&bearer()],
        )
        .unwrap()
    };
    for (id, want, says) in [
        // The older form: not among the oldest 10000, and the answer says what to give.
        ("0123456789abcdef".to_owned(), 400, "oldest 10000"),
        (zdelay::dead::member_id(last), 400, "<died ms>-<id>"),
        (last_id.clone(), 200, "m99999"),
        (
            format!("{}-0123456789abcdef", now - 100),
            404,
            "no dead member",
        ),
    ] {
        log_every_command(&mut con);
        let (status, body) = show(&id);
        let n = calls(&mut con);
        let most = if id.contains('-') { 1 } else { 12 };
        assert!(n <= most, "{id}: {n} Redis calls read raw:b:dead");
        assert_eq!(status, want, "{id}: {body}");
        assert!(body.contains(says), "{id}: {body}");
    }
}

/// Replaying or purging one dead job touches its own lane only: no scan of every lane's
/// history (that is left to the bulk operations). Finding it by id alone asks each route's
/// lane, one call each.
#[test]
fn single_id_replay_and_purge_touch_one_shard() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let lane = crate::common::lane_keys("default", "queue:default");
    for i in 0..20 {
        seed_dead_job(&mut con, &format!("d-{i}"), b"x", now - 1000);
        let _: () = redis::cmd("HSET")
            .arg(&lane.history)
            .arg(format!("gone-{i}"))
            .arg("1 old")
            .query(&mut con)
            .unwrap();
    }
    let writes = ["replay_dead_lane", "purge_dead_lane", "prune_history_lane"];
    let tag = |key: &str| {
        key.strip_prefix("zdelay:{")
            .and_then(|rest| rest.split_once('}'))
            .map(|(tag, _)| tag.to_owned())
    };
    let own = tag(&lane.due).unwrap();
    for (i, action) in ["replay?in=1h", "purge"].iter().enumerate() {
        let id = format!("d-{i}");
        log_every_command(&mut con);
        let (status, body) = http_request(
            port,
            "POST",
            &format!("/api/dead/{id}/{action}"),
            &[&bearer()],
        )
        .unwrap();
        assert_eq!(status, 200, "{action}: {body}");
        let log = logged(&mut con);
        // The daemon's own look for the schedules that missed the most (a scan of the
        // schedules' health records, at its first stats sample and every minute after) may
        // fall in the window; it is not the request's.
        assert!(
            log.iter()
                .all(|l| !l.args[0].eq_ignore_ascii_case("hscan") || l.names(":sched_health")),
            "{action}: a scan"
        );
        let ours: Vec<&Logged> = log
            .iter()
            .filter(|l| writes.iter().any(|s| l.is_script(s)) || l.names(":history:"))
            .collect();
        assert!(!ours.is_empty(), "{action}: its script is logged");
        for l in &ours {
            let tags: BTreeSet<String> = l.args.iter().filter_map(|a| tag(a)).collect();
            assert_eq!(
                tags.into_iter().collect::<Vec<_>>(),
                vec![own.clone()],
                "{action}: {:?}",
                l.args
            );
        }
    }
}

/// A job's and a dead job's payload are cut inside Redis: an 8 MB payload is never sent to
/// the daemon to show 2048 bytes of it.
#[test]
fn payload_previews_are_cut_inside_redis() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let big = "é".repeat(1 << 20);
    seed_dead_job(&mut con, "dead-big", big.as_bytes(), now - 1000);
    for path in ["/api/dead/dead-big", "/api/jobs/dead-big"] {
        let sent = sent_bytes(&mut con);
        let v = get_json(port, path);
        let sent = sent_bytes(&mut con) - sent;
        assert!(sent < 100_000, "{path}: Redis sent {sent} bytes");
        let preview = v
            .get("payload_preview")
            .or(v.get("payload"))
            .and_then(Value::as_str)
            .unwrap();
        assert_eq!(preview.len(), 2048, "{path}: whole characters");
        assert_eq!(v["payload_truncated"], true, "{path}");
        assert_eq!(
            v.get("payload_size").or(v.get("payload_bytes")).unwrap(),
            2 << 20,
            "{path}"
        );
        assert_eq!(v["headers"]["authorization"], "Basic c2VjcmV0", "{path}");
    }
    // Over 4 MiB an envelope is not read at all (Redis cannot read part of a value): the
    // job is shown with its size and why, and Redis sends next to nothing.
    seed_dead_job(&mut con, "dead-huge", &vec![b'h'; 5 << 20], now - 1000);
    let sent = sent_bytes(&mut con);
    let v = get_json(port, "/api/dead/dead-huge");
    assert!(sent_bytes(&mut con) - sent < 10_000);
    let why = v["envelope_error"].as_str().expect("envelope_error");
    assert!(why.contains("not read") && why.contains("4 MiB"), "{why}");
}

/// Listing dead jobs reads their envelopes' heads within a byte budget per Redis call: JSON
/// envelopes of 60 KB, 600 of them in one shard, take many calls of about 1 MiB each, not
/// one of 36 MB.
#[test]
fn dead_listing_peeks_within_a_budget_per_call() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let lane = crate::common::lane_keys("default", "queue:default");
    let payload = "p".repeat(60_000);
    let mut pipe = redis::pipe();
    for i in 0..600 {
        let id = format!("{{one}}:{i}");
        pipe.hset(&lane.jobs, &id, &payload)
            .ignore()
            .zadd(&lane.dead, &id, now - 10_000 + i)
            .ignore();
    }
    let _: () = pipe.query(&mut con).unwrap();
    log_every_command(&mut con);
    let sent = sent_bytes(&mut con);
    let v = get_json(port, "/api/dead?limit=500");
    let sent = sent_bytes(&mut con) - sent;
    assert_eq!(v["jobs"].as_array().unwrap().len(), 500);
    assert_eq!(v["jobs"][0]["route"], "default", "{}", v["jobs"][0]);
    let peeks: Vec<Logged> = logged(&mut con)
        .into_iter()
        .filter(|l| l.is_script("peek_dead_lane"))
        .collect();
    let per_call = sent / peeks.len().max(1) as u64;
    assert!(
        per_call < 2 << 20,
        "{} peek_dead_lane calls sent {sent} bytes",
        peeks.len()
    );
    assert_calls_short("peek_dead_lane", &peeks.iter().collect::<Vec<_>>());
}

/// A bulk replay or purge through the API does a bounded amount of work per request
/// (`limit`, at most 10000): `complete: false` says to send it again.
#[test]
fn bulk_requests_are_bounded() {
    let redis = RedisServer::start();
    let config = config(&redis, &format!("token = \"{TOKEN}\""));
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    for i in 0..25 {
        seed_dead_job(&mut con, &format!("b-{i}"), b"x", now - 1000);
        seed_dead_member(&mut con, format!("raw-{i}").as_bytes(), now - 1000);
    }
    let post = |path: &str| {
        let (status, body) = http_request(port, "POST", path, &[&bearer()]).unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str::<Value>(&body).unwrap()
    };
    let first = post("/api/dead?action=purge&all=true&limit=10");
    assert_eq!(
        (first["purged"].as_u64(), first["complete"].as_bool()),
        (Some(10), Some(false)),
        "{first}"
    );
    assert_eq!(dead_ids(&mut con).len(), 15);
    let raw = post("/api/dead?action=replay&source=raw:b&limit=20");
    assert_eq!(
        (raw["replayed"].as_u64(), raw["complete"].as_bool()),
        (Some(20), Some(false)),
        "{raw}"
    );
    let rest = post("/api/dead?action=purge&all=true&limit=100");
    assert_eq!(
        (rest["purged"].as_u64(), rest["complete"].as_bool()),
        (Some(15), Some(true)),
        "{rest}"
    );
    let left: u64 = redis::cmd("ZCARD")
        .arg("raw:b:dead")
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 5);
}

/// Each listed schedule's previous occurrence is a walk back along its recurrence — for a
/// rare cron (the 29th of February on a Monday) a long one. `/api/schedules` walks on a
/// blocking thread, one answer at a time: concurrent requests never hold the threads that
/// answer `/healthz` and run the pollers.
#[test]
fn schedule_walks_do_not_hold_the_runtime() {
    use zdelay::schedules::{NewSchedule, Repeat};
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let _daemon = Daemon::start(&config);
    let port = config.admin_port;
    crate::common::runtime().block_on(async {
        let client = Client::connect(&crate::common::redis_config(&redis.url(), SHARDS))
            .await
            .unwrap();
        for i in 0..1000 {
            let rare = Repeat::Cron {
                expr: "0 0 29 2 1".into(),
                tz: "UTC".into(),
            };
            client
                .schedule_set(NewSchedule::new(format!("rare-{i}"), "default", "x", rare))
                .await
                .unwrap();
        }
    });
    let requests: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                let answer = http_request(port, "GET", "/api/schedules?limit=1000", &[]);
                (answer, started.elapsed())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    while !requests.iter().all(|r| r.is_finished()) {
        let started = std::time::Instant::now();
        let (status, _) = http_request(port, "GET", "/healthz", &[]).expect("/healthz answers");
        assert_eq!(status, 200);
        slowest = slowest.max(started.elapsed());
    }
    let answers: Vec<_> = requests.into_iter().map(|r| r.join().unwrap()).collect();
    eprintln!("slowest /healthz meanwhile: {slowest:?}");
    assert!(
        slowest < Duration::from_millis(500),
        "/healthz waited {slowest:?} behind the walks"
    );
    for (answer, took) in answers {
        let (status, body) = answer.expect("/api/schedules answers within 10 s");
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["schedules"].as_array().unwrap().len(), 1000);
        eprintln!("/api/schedules took {took:?}");
    }
}
