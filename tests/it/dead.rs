//! Dead letters, finished: `zdelay dead list|show|replay|purge` with filters (route, reason,
//! age, schedule), `--json`, replay to a later time, attempt counts reset or kept, the
//! history of deaths (capped, dropped by purge and once a job is delivered), raw members,
//! the progress bar (on a terminal only), and the combinations the CLI refuses.

use crate::common::{Daemon, RedisServer, TestConfig, llen, redis_now_ms, wait_for, zdelay_bin};
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use zdelay::dead::{HISTORY_CAP, member_id};
use zdelay::envelope::Envelope;
use zdelay::keys::{Keys, LaneKeys};

const SHARDS: u16 = 4;

/// Routes `a` and `b` (local lists), route `w` whose list key tests make hold a string
/// (WRONGTYPE: every move kills the job), and a raw ms source `raw:a` → `a`.
const ROUTES: &str = r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "a"
sink = "local"
target = "q:a"

[[routes]]
name = "b"
sink = "local"
target = "q:b"

[[routes]]
name = "w"
sink = "local"
target = "q:w"

[[sources]]
key = "raw:a"
score_unit = "ms"
route = "a"
"#;

/// The local routes of [`ROUTES`]: each keeps its jobs and dead letters in its lane.
const LOCAL: [&str; 3] = ["a", "b", "w"];

/// A Redis and a config with [`ROUTES`], the routes registered as a daemon registers them at
/// start (so dead jobs can be seeded into the lanes before any daemon runs).
fn setup() -> (RedisServer, TestConfig) {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), SHARDS, ROUTES);
    config.register_routes(&crate::common::runtime());
    (redis, config)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs a command that must succeed; returns its stdout.
fn ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(
        out.status.success(),
        "zdelay {args:?} failed ({:?}): {}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

fn json(config: &TestConfig, args: &[&str]) -> Value {
    let out = ok(config, args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {out}"))
}

/// The ids `dead list --json <args>` lists, sorted.
fn listed(config: &TestConfig, args: &[&str]) -> Vec<String> {
    let mut all = vec!["dead", "list", "--json"];
    all.extend_from_slice(args);
    let v = json(config, &all);
    let mut ids: Vec<String> = v["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["id"].as_str().expect("id").to_owned())
        .collect();
    ids.sort();
    ids
}

/// `zdelay get ID` as JSON, `None` when no such job is stored.
fn get(config: &TestConfig, id: &str) -> Option<Value> {
    let out = config.cli(&["get", id, "--json"]);
    if out.status.code() == Some(3) {
        return None;
    }
    assert!(out.status.success(), "get {id}: {}", text(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).expect("get prints JSON"))
}

/// The spread shards: two-phase jobs (route `mirror`), and those of a destination no route
/// names any more.
fn spread() -> Keys {
    Keys::new("zdelay", SHARDS)
}

fn lane_keys(route: &str) -> LaneKeys {
    crate::common::lane_keys(route, &format!("q:{route}"))
}

/// The keys a job lives in: its route's lane (`meta` holding the meta apart from the raw
/// payload), or a spread shard (`zd1` frames in `jobs`).
struct Home {
    jobs: String,
    meta: Option<String>,
    due: String,
    dead: String,
    reasons: String,
    history: String,
}

impl Home {
    /// Where a job of `dest` with `id` is kept.
    fn of(id: &str, dest: &str) -> Home {
        if LOCAL.contains(&dest) {
            let k = lane_keys(dest);
            Home {
                jobs: k.jobs,
                meta: Some(k.meta),
                due: k.due,
                dead: k.dead,
                reasons: k.reasons,
                history: k.history,
            }
        } else {
            let k = spread().shard(spread().shard_of(id));
            Home {
                jobs: k.jobs,
                meta: None,
                due: k.due,
                dead: k.dead,
                reasons: k.reasons,
                history: k.history,
            }
        }
    }

    /// Every place a job with `id` may be kept: the lanes, and its spread shard.
    fn all(id: &str) -> Vec<Home> {
        LOCAL
            .iter()
            .chain(&["mirror"])
            .map(|dest| Home::of(id, dest))
            .collect()
    }
}

/// Stores `env` under `id` as a job that died at `died_ms` with `reason` (what the move and
/// settle scripts leave), without a daemon: in its route's lane (the payload raw, the frame's
/// meta apart), or in its spread shard as a frame.
fn seed_dead(con: &mut redis::Connection, id: &str, env: &Envelope, died_ms: i64, reason: &str) {
    let home = Home::of(id, &env.dest);
    let frame = env.encode().expect("envelope encodes");
    let mut pipe = redis::pipe();
    match &home.meta {
        Some(meta_key) => {
            let meta = frame_meta(&frame, &env.dest);
            pipe.hset(&home.jobs, id, &env.payload);
            if !meta.is_empty() {
                pipe.hset(meta_key, id, meta);
            }
        }
        None => {
            pipe.hset(&home.jobs, id, frame);
        }
    }
    pipe.zadd(&home.dead, id, died_ms)
        .hset(&home.reasons, id, reason)
        .query::<()>(con)
        .expect("seed a dead job");
}

/// The meta JSON of a `zd1` frame to `dest` (empty when every field has its default).
fn frame_meta(frame: &[u8], dest: &str) -> Vec<u8> {
    let rest = &frame[format!("zd1:{dest}\n").len()..];
    let newline = rest
        .iter()
        .position(|&b| b == b'\n')
        .expect("a meta length");
    let len: usize = std::str::from_utf8(&rest[..newline])
        .expect("digits")
        .parse()
        .expect("a meta length");
    rest[newline + 1..newline + 1 + len].to_vec()
}

fn envelope(dest: &str, payload: &str, schedule: Option<&str>) -> Envelope {
    let mut env = Envelope::new(dest, payload.as_bytes().to_vec());
    env.meta.schedule = schedule.map(str::to_owned);
    env
}

fn dead_score(con: &mut redis::Connection, id: &str) -> Option<i64> {
    Home::all(id).iter().find_map(|home| {
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(&home.dead)
            .arg(id)
            .query(con)
            .expect("ZSCORE");
        score.map(|s| s as i64)
    })
}

fn history_text(con: &mut redis::Connection, id: &str) -> Option<String> {
    Home::all(id).iter().find_map(|home| {
        redis::cmd("HGET")
            .arg(&home.history)
            .arg(id)
            .query(con)
            .expect("HGET history")
    })
}

/// How many jobs are due, dead or have a history (`kind`), over every lane and spread shard.
fn total(con: &mut redis::Connection, kind: &str) -> usize {
    let spread = spread();
    let mut homes: Vec<Home> = LOCAL.iter().map(|route| Home::of("", route)).collect();
    homes.extend((0..SHARDS).map(|s| {
        let k = spread.shard(s);
        Home {
            jobs: k.jobs,
            meta: None,
            due: k.due,
            dead: k.dead,
            reasons: k.reasons,
            history: k.history,
        }
    }));
    homes
        .iter()
        .map(|home| {
            let (cmd, key) = match kind {
                "due" => ("ZCARD", &home.due),
                "dead" => ("ZCARD", &home.dead),
                "history" => ("HLEN", &home.history),
                other => panic!("no such kind {other}"),
            };
            redis::cmd(cmd)
                .arg(key)
                .query::<usize>(con)
                .expect("a home's size")
        })
        .sum()
}

const MIN: i64 = 60_000;

/// Every filter selects exactly its jobs, for list, replay and purge; combined filters must
/// all match; `--json` shapes of list and of the replay/purge summaries.
#[test]
fn filters_select_for_list_replay_and_purge() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let wrongtype = "WRONGTYPE: q:a holds a string, not a list";
    seed_dead(
        &mut con,
        "a-old",
        &envelope("a", "1", None),
        now - 120 * MIN,
        wrongtype,
    );
    seed_dead(
        &mut con,
        "a-new",
        &envelope("a", "2", None),
        now - MIN / 2,
        wrongtype,
    );
    seed_dead(
        &mut con,
        "b-oom",
        &envelope("b", "3", None),
        now - 10 * MIN,
        "gave up after 3 attempts: OOM command not allowed",
    );
    seed_dead(
        &mut con,
        "b-nightly",
        &envelope("b", "4", Some("nightly")),
        now - 10 * MIN,
        "rejected: no route",
    );
    seed_dead(
        &mut con,
        "c-hourly",
        &envelope("c", "5", Some("hourly")),
        now - 65 * MIN,
        "unknown destination: c",
    );
    // An orphan (no envelope stored) in a spread shard.
    let orphan = Home::of("orphan", "mirror");
    let _: () = redis::pipe()
        .zadd(&orphan.dead, "orphan", now - 180 * MIN)
        .hset(&orphan.reasons, "orphan", "no envelope stored for this id")
        .query(&mut con)
        .expect("seed an orphan");

    let all = ["a-new", "a-old", "b-nightly", "b-oom", "c-hourly", "orphan"];
    assert_eq!(listed(&config, &[]), all);
    assert_eq!(listed(&config, &["--route", "a"]), ["a-new", "a-old"]);
    assert_eq!(listed(&config, &["--route", "nope"]), Vec::<String>::new());
    assert_eq!(
        listed(&config, &["--reason", "wrongtype"]),
        ["a-new", "a-old"]
    );
    assert_eq!(
        listed(&config, &["--older-than", "1h"]),
        ["a-old", "c-hourly", "orphan"]
    );
    assert_eq!(
        listed(&config, &["--newer-than", "15m"]),
        ["a-new", "b-nightly", "b-oom"]
    );
    assert_eq!(
        listed(&config, &["--older-than", "5m", "--newer-than", "90m"]),
        ["b-nightly", "b-oom", "c-hourly"]
    );
    assert_eq!(listed(&config, &["--schedule", "nightly"]), ["b-nightly"]);
    assert_eq!(
        listed(&config, &["--route", "b", "--reason", "OOM"]),
        ["b-oom"]
    );
    // --limit counts rows in all, whatever the shards: the oldest, merged across shards.
    assert_eq!(listed(&config, &["--limit", "1"]), ["orphan"]);
    assert_eq!(
        listed(&config, &["--limit", "3"]),
        ["a-old", "c-hourly", "orphan"]
    );

    // The JSON shape of a listed job.
    let v = json(&config, &["dead", "list", "--json", "--route", "b"]);
    let job = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["id"] == "b-nightly")
        .expect("b-nightly")
        .clone();
    let fields: Vec<&str> = job
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        fields,
        [
            "attempt",
            "died_ms",
            "earlier_deaths",
            "envelope_error",
            "id",
            "lane",
            "last_error",
            "max_attempts",
            "payload_size",
            "reason",
            "route",
            "schedule"
        ],
        "{job:#}"
    );
    assert_eq!(job["route"], "b");
    assert_eq!(job["schedule"], "nightly");
    assert_eq!(job["died_ms"], now - 10 * MIN);
    assert_eq!(job["payload_size"], 1);
    assert_eq!(job["reason"], "rejected: no route");
    assert_eq!(v["raw"], serde_json::json!([]));
    let out = config.cli(&["dead", "list", "--route", "b"]);
    assert!(
        text(&out.stderr).contains("raw members not listed: --route applies to envelope jobs only"),
        "{}",
        text(&out.stderr)
    );
    // Lines, oldest first; the orphan says it has no route.
    let lines = ok(&config, &["dead", "list"]);
    let first: Vec<&str> = lines
        .lines()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(first[..3], ["orphan", "a-old", "c-hourly"], "{lines}");
    let mut same_ms = first[3..5].to_vec();
    same_ms.sort();
    assert_eq!(same_ms, ["b-nightly", "b-oom"], "{lines}");
    assert_eq!(first[5..], ["a-new"], "{lines}");
    assert!(lines.contains("route -  attempts 0"), "{lines}");

    // Replay by route: only b's, due now, attempts reset; the summary as JSON.
    let r = json(&config, &["dead", "replay", "--route", "b", "--json"]);
    assert_eq!(r["replayed"], 2, "{r:#}");
    assert_eq!(
        (&r["orphans"], &r["skipped"]),
        (&Value::from(0), &Value::from(0))
    );
    assert_eq!(r["attempts"], "reset");
    let due = r["due_ms"].as_i64().expect("due_ms");
    assert!((now..now + 10_000).contains(&due), "{r:#}");
    for id in ["b-oom", "b-nightly"] {
        let job = get(&config, id).expect("stored");
        assert_eq!(job["state"], "due", "{job:#}");
        assert_eq!(job["due"], due);
    }
    assert_eq!(get(&config, "a-old").unwrap()["state"], "dead");

    // Replay by age: the orphan is counted and stays dead.
    let out = config.cli(&["dead", "replay", "--older-than", "1h"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "replayed 2");
    assert!(
        text(&out.stderr).contains("1 dead ids have no envelope"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(get(&config, "c-hourly").unwrap()["state"], "due");
    assert_eq!(listed(&config, &[]), ["a-new", "orphan"]);

    // Purge by reason; by a schedule no dead job has; then everything.
    let p = json(
        &config,
        &["dead", "purge", "--reason", "WRONGTYPE", "--json"],
    );
    assert_eq!(p["purged"], 1, "{p:#}");
    assert_eq!(p["skipped"], 0);
    assert!(p["history_pruned"].is_u64(), "{p:#}");
    assert!(get(&config, "a-new").is_none(), "purged");
    assert_eq!(
        ok(&config, &["dead", "purge", "--schedule", "hourly"]).trim(),
        "purged 0"
    );
    assert_eq!(get(&config, "c-hourly").unwrap()["state"], "due");
    assert_eq!(
        ok(&config, &["dead", "replay", "--schedule", "nightly"]).trim(),
        "replayed 0"
    );
    assert_eq!(ok(&config, &["dead", "purge", "--all"]).trim(), "purged 1");
    assert_eq!(total(&mut con, "dead"), 0);
    assert_eq!(total(&mut con, "due"), 4);
}

/// `dead replay --in` / `--at`: the job waits for that time (scheduled, never delivered
/// before it), then arrives; raw members too.
#[test]
fn replay_to_a_later_time_waits_for_it() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    seed_dead(
        &mut con,
        "later-1",
        &envelope("a", "p1", None),
        now - 1000,
        "x",
    );
    seed_dead(
        &mut con,
        "later-2",
        &envelope("b", "p2", None),
        now - 1000,
        "x",
    );
    let _: () = redis::pipe()
        .zadd("raw:a:dead", "raw-later", now - 1000)
        .hset("raw:a:dead:reasons", "raw-later", "oversize")
        .query(&mut con)
        .expect("seed a dead raw member");
    let _daemon = Daemon::start(&config);

    let r = json(
        &config,
        &[
            "dead", "replay", "--id", "later-1", "--in", "1500ms", "--json",
        ],
    );
    assert_eq!(r["replayed"], 1, "{r:#}");
    let due = r["due_ms"].as_i64().expect("due_ms");
    assert!(due >= now + 1500, "{due} vs {now}");
    let job = get(&config, "later-1").expect("stored");
    assert_eq!(job["state"], "scheduled", "{job:#}");
    assert_eq!(job["due"], due);

    let at = redis_now_ms(&mut con) + 1200;
    let rfc3339 =
        humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(at as u64))
            .to_string();
    let out = config.cli(&["dead", "replay", "--id", "later-2", "--at", &rfc3339]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "replayed 1");
    assert!(
        text(&out.stderr).contains("due at"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(get(&config, "later-2").unwrap()["due"], at);

    let r = json(
        &config,
        &[
            "dead", "replay", "--source", "raw:a", "--in", "1s", "--json",
        ],
    );
    assert_eq!(
        (&r["replayed"], &r["source"]),
        (&Value::from(1), &Value::from("raw:a"))
    );
    let raw_due = r["due_ms"].as_i64().expect("due_ms");
    let score: f64 = redis::cmd("ZSCORE")
        .arg("raw:a")
        .arg("raw-later")
        .query(&mut con)
        .expect("ZSCORE");
    assert_eq!(score as i64, raw_due);

    // Each arrives, never before its time: q:a gets later-1 and raw-later, q:b later-2.
    let mut seen: BTreeMap<&str, i64> = BTreeMap::new();
    wait_for("the replayed jobs", Duration::from_secs(10), || {
        // The lengths first, then the time: a job found is stamped no earlier than it arrived
        // (stamping first lets a poll that began before a due find the job moved at it).
        let lengths = [llen(&mut con, "q:a"), llen(&mut con, "q:b")];
        let t = redis_now_ms(&mut con);
        for ((list, n, name), len) in [("q:a", 2, "q:a full"), ("q:b", 1, "q:b full")]
            .into_iter()
            .zip(lengths)
        {
            if len >= n {
                seen.entry(name).or_insert(t);
            }
            if len >= 1 {
                seen.entry(list).or_insert(t);
            }
        }
        seen.len() == 4
    });
    assert!(
        seen["q:a"] >= due.min(raw_due),
        "{seen:?} vs {due}/{raw_due}"
    );
    assert!(seen["q:a full"] >= due.max(raw_due), "{seen:?}");
    assert!(seen["q:b"] >= at, "{seen:?} vs {at}");
}

/// Makes jobs to a remote Redis die after `max_attempts` (the target is out of memory), then
/// replays them with the attempt count reset (default) or kept, and lets them die again.
#[test]
fn replay_resets_attempts_unless_kept_and_history_keeps_the_earlier_death() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let config = TestConfig::new(
        &scheduler.url(),
        SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
max_attempts = 2
retry_base = "10ms"
retry_cap = "20ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "mirror"
sink = "other"
target = "q:remote"
"#,
            target.url()
        ),
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut target.conn())
        .expect("maxmemory");
    for id in ["r-reset", "r-keep"] {
        ok(
            &config,
            &["enqueue", "--dest", "mirror", "--id", id, "--payload", id],
        );
    }
    let mut con = scheduler.conn();
    let _daemon = Daemon::start(&config);
    wait_for("both gave up", Duration::from_secs(20), || {
        total(&mut con, "dead") == 2
    });
    let first_deaths: BTreeMap<&str, i64> = ["r-reset", "r-keep"]
        .into_iter()
        .map(|id| (id, dead_score(&mut con, id).unwrap()))
        .collect();
    let show = json(&config, &["dead", "show", "r-reset", "--json"]);
    assert_eq!(show["attempt"], 2, "{show:#}");
    assert!(
        show["reason"]
            .as_str()
            .unwrap()
            .starts_with("gave up after 2 attempts"),
        "{show:#}"
    );
    assert!(
        show["last_error"].as_str().unwrap().contains("OOM"),
        "{show:#}"
    );
    assert_eq!(show["history"], serde_json::json!([]));

    // Replayed far into the future, so they wait where `get` shows their envelopes.
    let later = (redis_now_ms(&mut con) + 3_600_000).to_string();
    ok(
        &config,
        &["dead", "replay", "--id", "r-reset", "--at", &later],
    );
    let r = json(
        &config,
        &[
            "dead",
            "replay",
            "--id",
            "r-keep",
            "--at",
            &later,
            "--keep-attempts",
            "--json",
        ],
    );
    assert_eq!(
        (&r["replayed"], &r["attempts"]),
        (&Value::from(1), &Value::from("kept"))
    );
    let reset = get(&config, "r-reset").unwrap();
    assert_eq!(reset["state"], "scheduled");
    assert!(reset.get("attempt").is_none(), "attempt reset: {reset:#}");
    assert!(
        reset["last_error"].as_str().unwrap().contains("OOM"),
        "last_error kept: {reset:#}"
    );
    assert_eq!(get(&config, "r-keep").unwrap()["attempt"], 2);

    // Due now again: the reset one gets max_attempts tries, the kept one one try.
    for id in ["r-reset", "r-keep"] {
        ok(&config, &["reschedule", id, "--in", "0ms"]);
    }
    wait_for("both dead again", Duration::from_secs(20), || {
        total(&mut con, "dead") == 2
    });
    for (id, attempts) in [("r-reset", 2), ("r-keep", 3)] {
        let show = json(&config, &["dead", "show", id, "--json"]);
        assert_eq!(show["attempt"], attempts, "{show:#}");
        let reason = show["reason"].as_str().unwrap();
        assert!(
            reason.starts_with(&format!("gave up after {attempts} attempts")),
            "{reason}"
        );
        let history = show["history"].as_array().expect("history");
        assert_eq!(history.len(), 1, "{show:#}");
        assert_eq!(history[0]["died_ms"], first_deaths[id]);
        assert!(
            history[0]["reason"]
                .as_str()
                .unwrap()
                .starts_with("gave up after 2 attempts"),
            "{show:#}"
        );
        assert!(show["died_ms"].as_i64().unwrap() > first_deaths[id]);
        assert_eq!(show["earlier_deaths"], 1);
        let text = ok(&config, &["dead", "show", id]);
        for want in [
            "1 earlier deaths, oldest first:",
            "route       mirror",
            &format!("attempts    {attempts} (at most poller.max_attempts)"),
            "payload     ",
            "last error  ",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
    }
}

/// History across many cycles keeps the last `HISTORY_CAP` deaths, oldest first, in the
/// documented text form; purge deletes it; a job delivered after a replay loses its history
/// at the next purge (or replay).
#[test]
fn history_is_capped_purged_and_dropped_after_delivery() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let _: () = redis::cmd("SET")
        .arg("q:w")
        .arg("not a list")
        .query(&mut con)
        .expect("SET");
    let _daemon = Daemon::start(&config);
    ok(
        &config,
        &["enqueue", "--dest", "w", "--id", "cyc", "--payload", "x"],
    );
    let mut deaths = Vec::new();
    wait_for("cyc dead", Duration::from_secs(10), || {
        dead_score(&mut con, "cyc").is_some()
    });
    for _ in 0..7 {
        let died = dead_score(&mut con, "cyc").unwrap();
        deaths.push(died);
        assert_eq!(
            ok(&config, &["dead", "replay", "--id", "cyc"]).trim(),
            "replayed 1"
        );
        wait_for("cyc dead again", Duration::from_secs(10), || {
            dead_score(&mut con, "cyc").is_some_and(|d| d != died)
        });
    }
    let stored = history_text(&mut con, "cyc").expect("history");
    let lines: Vec<&str> = stored.lines().collect();
    assert_eq!(lines.len(), HISTORY_CAP, "{stored}");
    for (line, died) in lines.iter().zip(&deaths[deaths.len() - HISTORY_CAP..]) {
        assert_eq!(
            *line,
            format!("{died} WRONGTYPE: q:w holds a string, not a list")
        );
    }
    let show = json(&config, &["dead", "show", "cyc", "--json"]);
    let history: Vec<i64> = show["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["died_ms"].as_i64().unwrap())
        .collect();
    assert_eq!(history, deaths[deaths.len() - HISTORY_CAP..]);
    assert_eq!(show["died_ms"], dead_score(&mut con, "cyc").unwrap());
    assert_eq!(show["earlier_deaths"], HISTORY_CAP);
    assert!(
        ok(&config, &["dead", "list"]).contains(&format!("(+{HISTORY_CAP} earlier)")),
        "list counts earlier deaths"
    );

    // Purge deletes the history with the job.
    assert_eq!(
        ok(&config, &["dead", "purge", "--id", "cyc"]).trim(),
        "purged 1"
    );
    assert_eq!(history_text(&mut con, "cyc"), None);

    // Delivered after a replay: the history stays until the next purge prunes it.
    ok(
        &config,
        &["enqueue", "--dest", "w", "--id", "fixed", "--payload", "y"],
    );
    wait_for("fixed dead", Duration::from_secs(10), || {
        dead_score(&mut con, "fixed").is_some()
    });
    let _: () = redis::cmd("DEL").arg("q:w").query(&mut con).expect("DEL");
    // Due a little later, so the replay's own pruning pass finds it still stored.
    ok(
        &config,
        &["dead", "replay", "--id", "fixed", "--in", "500ms"],
    );
    wait_for("fixed delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:w") == 1
    });
    assert!(history_text(&mut con, "fixed").is_some(), "dropped lazily");
    let p = json(&config, &["dead", "purge", "--all", "--json"]);
    assert_eq!(
        (&p["purged"], &p["history_pruned"]),
        (&Value::from(0), &Value::from(1))
    );
    assert_eq!(history_text(&mut con, "fixed"), None);
    assert_eq!(total(&mut con, "history"), 0);
}

/// Raw members: list with the filters that apply (reason, age), show by member id, replay
/// and purge by id and by filter.
#[test]
fn raw_members_by_id_reason_and_age() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let _: () = redis::pipe()
        .zadd("raw:a:dead", "old-seconds", now - 120 * MIN)
        .hset(
            "raw:a:dead:reasons",
            "old-seconds",
            "score looks like seconds in a millisecond source",
        )
        .zadd("raw:a:dead", "new-oversize", now - MIN)
        .hset("raw:a:dead:reasons", "new-oversize", "payload too large")
        .zadd("raw:a:dead", "new-seconds", now - MIN)
        .hset(
            "raw:a:dead:reasons",
            "new-seconds",
            "score looks like seconds in a millisecond source",
        )
        .query(&mut con)
        .expect("seed dead raw members");
    let raw_payloads = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["dead", "list", "--json", "--source", "raw:a"];
        all.extend_from_slice(args);
        let v = json(&config, &all);
        assert_eq!(v["jobs"], serde_json::json!([]));
        let mut out: Vec<String> = v["raw"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["payload_preview"].as_str().unwrap().to_owned())
            .collect();
        out.sort();
        out
    };
    assert_eq!(
        raw_payloads(&["--reason", "SECONDS"]),
        ["new-seconds", "old-seconds"]
    );
    assert_eq!(raw_payloads(&["--older-than", "1h"]), ["old-seconds"]);
    assert_eq!(
        raw_payloads(&["--newer-than", "1h"]),
        ["new-oversize", "new-seconds"]
    );
    let v = json(&config, &["dead", "list", "--json", "--source", "raw:a"]);
    let entry = &v["raw"][0];
    assert_eq!(entry["source"], "raw:a");
    // An id is the death time and the start of the member's SHA-1.
    assert_eq!(
        entry["id"],
        format!("{}-{}", now - 120 * MIN, member_id(b"old-seconds"))
    );
    assert_eq!(entry["payload_size"], 11);

    // Show by id, plain or as <source>:<id>; the hash alone (the older form) is looked for
    // among the oldest members.
    let hash = member_id(b"new-oversize");
    let id = format!("{}-{hash}", now - MIN);
    let by_hash = json(
        &config,
        &["dead", "show", "--source", "raw:a", &hash, "--json"],
    );
    assert_eq!(by_hash["id"], id.as_str());
    let show = json(
        &config,
        &[
            "dead",
            "show",
            "--source",
            "raw:a",
            &format!("raw:a:{id}"),
            "--json",
        ],
    );
    assert_eq!(show["payload_preview"], "new-oversize", "{show:#}");
    assert_eq!(show["message_id"], format!("raw:a:{hash}"));
    assert_eq!(show["reason"], "payload too large");
    assert_eq!(show["died_ms"], now - MIN);
    let shown = ok(&config, &["dead", "show", "--source", "raw:a", &id]);
    assert!(shown.contains("payload too large"), "{shown}");
    let out = config.cli(&["dead", "show", "--source", "raw:a", "0123456789abcdef"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let out = config.cli(&["dead", "show", "--source", "raw:a", "nothex"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not a raw member id"),
        "{}",
        text(&out.stderr)
    );

    // Replay one by id (far in the future: no daemon needed), purge by age, then the rest.
    let r = json(
        &config,
        &[
            "dead", "replay", "--source", "raw:a", "--id", &id, "--in", "1h", "--json",
        ],
    );
    assert_eq!(r["replayed"], 1, "{r:#}");
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg("raw:a")
        .arg("new-oversize")
        .query(&mut con)
        .unwrap();
    assert!(score.unwrap() as i64 >= now + 3_600_000);
    assert_eq!(
        ok(
            &config,
            &["dead", "purge", "--source", "raw:a", "--older-than", "1h"]
        )
        .trim(),
        "purged 1"
    );
    assert_eq!(raw_payloads(&[]), ["new-seconds"]);
    let p = json(&config, &["dead", "purge", "--source", "raw:a", "--json"]);
    assert_eq!(
        (&p["purged"], &p["source"]),
        (&Value::from(1), &Value::from("raw:a"))
    );
    assert_eq!(raw_payloads(&[]), Vec::<String>::new());
}

/// `n` dead jobs of route a, in its lane.
fn seed_many(con: &mut redis::Connection, n: usize) {
    let home = Home::of("", "a");
    let mut pipe = redis::pipe();
    for i in 0..n {
        let id = format!("bulk-{i}");
        pipe.hset(&home.jobs, &id, "bulk")
            .ignore()
            .zadd(&home.dead, &id, 5)
            .ignore()
            .hset(&home.reasons, &id, "seeded")
            .ignore();
    }
    pipe.query::<()>(con).expect("seed dead jobs");
}

/// Bulk replay and purge draw a progress bar on stderr when it is a terminal, and nothing
/// at all when it is not.
#[test]
fn progress_bar_only_on_a_terminal() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    seed_many(&mut con, 3000);
    let out = config.cli(&["dead", "replay", "--all"]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), "replayed 3000\n");
    assert_eq!(
        text(&out.stderr),
        "",
        "nothing on a stderr that is not a terminal"
    );

    // Under a pseudo-terminal (util-linux `script`), the bar shows.
    seed_many(&mut con, 3000);
    let command = format!(
        "{} --config {} dead purge --all",
        zdelay_bin().display(),
        config.path.display()
    );
    let out: Output = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("ZDELAY_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("script(1) runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let tty = text(&out.stdout);
    assert!(tty.contains("reading dead jobs"), "{tty:?}");
    assert!(tty.contains("purged 3000"), "{tty:?}");
    assert_eq!(total(&mut con, "dead"), 0);
}

/// Combinations that make no sense are refused before anything runs (exit 2, saying why).
#[test]
fn senseless_combinations_are_refused() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    seed_dead(
        &mut con,
        "keep-me",
        &envelope("a", "x", None),
        now - 1000,
        "x",
    );
    for (args, says) in [
        (&["dead", "replay"][..], "required"),
        (
            &["dead", "purge", "--all", "--route", "a"][..],
            "cannot be used with",
        ),
        (
            &["dead", "purge", "--id", "keep-me", "--older-than", "1s"][..],
            "cannot be used with",
        ),
        (
            &["dead", "replay", "--source", "raw:a", "--route", "a"][..],
            "--route",
        ),
        (
            &["dead", "replay", "--source", "raw:a", "--keep-attempts"][..],
            "--keep-attempts",
        ),
        (
            &["dead", "list", "--source", "raw:a", "--schedule", "s"][..],
            "--schedule",
        ),
        (
            &["dead", "replay", "--all", "--at", "1", "--in", "1s"][..],
            "cannot be used with",
        ),
        (&["dead", "purge", "--all", "--in", "1s"][..], "--in"),
        (
            &["dead", "purge", "--older-than", "1h", "--newer-than", "10m"][..],
            "no time window",
        ),
        (&["dead", "list", "--newer-than", "soon"][..], "soon"),
    ] {
        let out = config.cli(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(says),
            "{args:?} should say {says:?}: {}",
            text(&out.stderr)
        );
    }
    assert_eq!(
        get(&config, "keep-me").unwrap()["state"],
        "dead",
        "nothing ran"
    );
    let help = ok(&config, &["dead", "--help"]);
    for word in [
        "  show ",
        "--route NAME",
        "--reason TEXT",
        "--older-than DUR",
        "--newer-than DUR",
        "--schedule ID",
        "--keep-attempts do not",
    ] {
        assert!(help.contains(word), "dead --help lacks {word:?}:\n{help}");
    }
    let out = config.cli(&["dead", "show", "not-dead"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("not dead"),
        "{}",
        text(&out.stderr)
    );
}

/// The occurrences of a recurring schedule that die are selected by `--schedule`: listed,
/// replayed, purged; a job without a schedule never matches.
#[test]
fn a_schedules_dead_occurrences_are_selected_by_schedule() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let _: () = redis::cmd("SET")
        .arg("q:w")
        .arg("not a list")
        .query(&mut con)
        .expect("SET");
    let now = redis_now_ms(&mut con);
    seed_dead(
        &mut con,
        "plain",
        &envelope("w", "x", None),
        now - 1000,
        "x",
    );
    let _daemon = Daemon::start(&config);
    ok(
        &config,
        &[
            "schedule",
            "set",
            "tick",
            "--dest",
            "w",
            "--every",
            "200ms",
            "--payload",
            "t",
        ],
    );
    wait_for("two occurrences dead", Duration::from_secs(10), || {
        listed(&config, &["--schedule", "tick"]).len() >= 2
    });
    ok(&config, &["schedule", "delete", "tick"]);
    let ids = listed(&config, &["--schedule", "tick"]);
    assert!(ids.iter().all(|id| id.starts_with("{tick}:")), "{ids:?}");
    let v = json(&config, &["dead", "list", "--json", "--schedule", "tick"]);
    for job in v["jobs"].as_array().unwrap() {
        assert_eq!(job["schedule"], "tick", "{job:#}");
        assert!(
            job["reason"].as_str().unwrap().starts_with("WRONGTYPE"),
            "{job:#}"
        );
    }
    assert_eq!(
        listed(&config, &["--schedule", "tock"]),
        Vec::<String>::new()
    );
    let p = json(&config, &["dead", "purge", "--schedule", "tick", "--json"]);
    assert_eq!(p["purged"], ids.len(), "{p:#}");
    assert_eq!(listed(&config, &[]), ["plain"]);
}
