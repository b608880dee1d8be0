//! Forecast and operator console: the numbers `zdelay forecast` and `/api/…` give equal what
//! Redis holds on a seeded dataset; actions need the token (and refuse cross-site and form
//! requests); a real headless chromium loads every page, checks it against Redis, replays a
//! dead job with the token and is refused without it.

use crate::common::{
    Daemon, RedisServer, SeededRng, TestConfig, http_request, lrange, redis_now_ms, venv_python,
    wait_for,
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

/// Enqueues `(id, due ms, payload)` jobs to route `default`.
fn enqueue(redis: &RedisServer, jobs: &[(String, i64, String)]) {
    let batch = jobs
        .iter()
        .map(|(id, due, payload)| NewJob::new("default", payload.clone()).id(id).at(*due))
        .collect();
    let results = crate::common::runtime().block_on(async {
        let client = Client::connect(&crate::common::redis_config(&redis.url(), SHARDS))
            .await
            .unwrap();
        client
            .enqueue_batch(batch, OnConflict::Replace)
            .await
            .unwrap()
    });
    for r in results {
        r.unwrap();
    }
}

/// Every member with its score (ms) of each shard's `suffix` ZSET: the truth, read whole.
fn shard_members(con: &mut redis::Connection, suffix: &str) -> Vec<BTreeMap<String, f64>> {
    (0..SHARDS)
        .map(|s| {
            let v: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(format!("{{zdelay:{s}}}:{suffix}"))
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query(con)
                .unwrap();
            v.into_iter().collect()
        })
        .collect()
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
    let due = shard_members(con, "due");
    let ready: u64 = (0..SHARDS)
        .map(|s| {
            redis::cmd("ZCARD")
                .arg(format!("{{zdelay:{s}}}:ready"))
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
    enqueue(&redis, &jobs);
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
    enqueue(redis, &jobs);
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
    let occurrence = crate::common::runtime().block_on(async {
        let client = Client::connect(&crate::common::redis_config(&redis.url(), SHARDS))
            .await
            .unwrap();
        client
            .schedule_run_now("broken-tick")
            .await
            .unwrap()
            .unwrap()
    });
    dead.push("wrong-0".into());
    dead.push(occurrence);
    wait_for("every seeded job is dead", Duration::from_secs(10), || {
        dead_ids(&mut con).len() == dead.len()
    });
    let out = config.cli(&["dead", "replay", "--id", "wrong-0"]);
    assert!(out.status.success(), "{out:?}");
    let history = format!(
        "{{zdelay:{}}}:history",
        zdelay::keys::Keys::new("zdelay", SHARDS).shard_of("wrong-0")
    );
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
    let mut out = Vec::new();
    for (shard, members) in shard_members(con, "dead").into_iter().enumerate() {
        for (id, died) in members {
            let reason: Option<String> = redis::cmd("HGET")
                .arg(format!("{{zdelay:{shard}}}:reasons"))
                .arg(&id)
                .query(con)
                .unwrap();
            let raw: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(format!("{{zdelay:{shard}}}:jobs"))
                .arg(&id)
                .query(con)
                .unwrap();
            let env = raw.and_then(|r| zdelay::Envelope::decode(&r).ok());
            out.push(DeadTruth {
                id,
                died_ms: died as i64,
                reason: reason.unwrap_or_default(),
                dest: env.as_ref().map(|e| e.dest.clone()),
                schedule: env.and_then(|e| e.meta.schedule),
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

fn get_json(port: u16, path: &str) -> Value {
    let (status, body) = http_request(port, "GET", path, &[]).expect("admin answers");
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
    let member_id = zdelay::dead::member_id(raw[0].0.as_bytes());
    assert_eq!(d["raw"].as_array().unwrap().len(), 1, "{}", d["raw"]);
    assert_eq!(d["raw"][0]["id"], member_id.as_str());
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
        let (status, body) = http_request(port, "GET", &format!("/api/dead?{query}"), &[]).unwrap();
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }

    // One dead job: its history (the earlier death), attempts, last error, payload.
    let w = get_json(port, "/api/dead/wrong-0");
    let history: String = redis::cmd("HGET")
        .arg(format!(
            "{{zdelay:{}}}:history",
            zdelay::keys::Keys::new("zdelay", SHARDS).shard_of("wrong-0")
        ))
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
    assert_eq!(m["message_id"], format!("raw:b:{member_id}"));
    assert_eq!(
        http_request(port, "GET", "/api/dead/job-3", &[]).unwrap().0,
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
        http_request(port, "GET", "/api/jobs/nope", &[]).unwrap().0,
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
        .arg(format!(
            "{{zdelay:{}}}:jobs",
            zdelay::keys::Keys::new("zdelay", SHARDS).shard_of(&dead[1])
        ))
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
        &redis,
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
    assert_eq!(get_json(port, "/api/stats")["actions_enabled"], false);
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
    let mut cmd = std::process::Command::new(venv_python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/it/py/console_browser.py"
    ))
    .args([
        &base, TOKEN, "job-5", &dead[0], &dead[1], "nightly", "broken", "wrong-0",
    ]);
    if let Ok(dir) = std::env::var("ZDELAY_CONSOLE_SHOTS") {
        cmd.arg(dir);
    }
    let out = cmd.output().expect("python runs");
    assert!(
        out.status.success(),
        "browser script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    let o = &r["overview"];
    assert_eq!(o["scheduled"].as_u64().unwrap() as usize, jobs.len());
    assert_eq!(
        o["dead"].as_u64().unwrap() as usize,
        dead.len() + 1,
        "with raw:b's member"
    );
    assert_eq!(o["due"], 0);
    assert_eq!(o["instances"].as_array().unwrap().len(), 1);
    // Four shards, the two raw sources, the total.
    assert_eq!(
        o["backlog_rows"].as_array().unwrap().len(),
        SHARDS as usize + 3
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
    assert!(
        r["schedules"]["row"]
            .as_str()
            .unwrap()
            .contains("cron 0 3 * * *")
    );

    let shown: BTreeSet<String> = r["dead"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(shown, dead_before);
    assert_eq!(r["dead"]["total"].as_u64().unwrap() as usize, dead.len());
    assert_eq!(r["dead"]["buttons_disabled_without_token"], true);
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
