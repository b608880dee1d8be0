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

[[sources]]
key = "raw:s"
score_unit = "s"
route = "default"
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
/// (expired on arrival), two schedules.
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
    let dead: Vec<String> = (0..3).map(|i| format!("late-{i}")).collect();
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
    for (id, how) in [
        ("tick", ["--every", "1h"]),
        ("nightly", ["--cron", "0 3 * * *"]),
    ] {
        let mut args = vec!["schedule", "set", id, "--dest", "default", "--payload", id];
        args.extend(how);
        let out = config.cli(&args);
        assert!(out.status.success(), "{out:?}");
    }
    (jobs.into_iter().map(|(id, _, _)| id).collect(), dead)
}

fn dead_ids(con: &mut redis::Connection) -> BTreeSet<String> {
    shard_members(con, "dead")
        .into_iter()
        .flat_map(|m| m.into_keys())
        .collect()
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
        dead.len()
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
    let listed: BTreeSet<String> = d["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, dead_ids(&mut con));
    assert_eq!(d["total"].as_u64().unwrap() as usize, dead.len());
    for j in d["jobs"].as_array().unwrap() {
        assert_eq!(j["dest"], "default");
        assert!(j["reason"].as_str().unwrap().contains("expired"), "{j}");
    }
    let filtered = get_json(port, "/api/dead?reason=no-such-reason");
    assert!(filtered["jobs"].as_array().unwrap().is_empty());
    let filtered = get_json(port, "/api/dead?route=default&min_age=0s");
    assert_eq!(filtered["jobs"].as_array().unwrap().len(), dead.len());
    let filtered = get_json(port, "/api/dead?min_age=1h");
    assert!(filtered["jobs"].as_array().unwrap().is_empty());

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
    assert_eq!(s["total"], 2);
    for x in s["schedules"].as_array().unwrap() {
        let id = x["id"].as_str().unwrap();
        assert_eq!(x["next_ms"].as_i64().unwrap(), sched_due[id] as i64, "{id}");
        assert!(x["previous_ms"].as_i64().unwrap() < x["next_ms"].as_i64().unwrap());
    }

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
            .find(|x| x["id"] == "tick")
            .cloned()
            .unwrap()
    };
    assert_eq!(tick(&paused)["paused"], true);
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
    .args([&base, TOKEN, "job-5", &dead[0], &dead[1], "nightly"]);
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
    assert_eq!(o["dead"].as_u64().unwrap() as usize, dead.len());
    assert_eq!(o["due"], 0);
    assert_eq!(o["instances"].as_array().unwrap().len(), 1);
    // Four shards, the raw source, the total.
    assert_eq!(
        o["backlog_rows"].as_array().unwrap().len(),
        SHARDS as usize + 2
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
    assert_eq!(ids, BTreeSet::from(["nightly", "tick"]));
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
