//! CLI integration tests: the real `zdelay` binary against a real `redis-server`, checking
//! what it prints, its exit codes, and the Redis state it leaves (jobs, lists, dead letters).

use crate::common::stored_total;
use crate::common::{self, Daemon, RedisServer, TestConfig, llen, lrange, redis_now_ms, wait_for};
use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, UNIX_EPOCH};
use zdelay::client::{Client, NewJob, OnConflict};
use zdelay::config::RedisConfig;

const SHARDS: u16 = 4;

/// Routes `a` (LPUSH `q:a`) and `b` (RPUSH `q:b`), and a raw ms source `raw:a` → `a`.
const EXTRA: &str = r#"
[[routes]]
name = "a"
sink = "local"
target = "q:a"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "rpush"

[[sources]]
key = "raw:a"
score_unit = "ms"
route = "a"
"#;

fn setup() -> (RedisServer, TestConfig) {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), SHARDS, EXTRA);
    (redis, config)
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs a command that must succeed; returns its stdout.
fn ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(
        out.status.success(),
        "zdelay {args:?} failed ({:?}): {}{}",
        out.status,
        stdout(&out),
        stderr(&out)
    );
    stdout(&out)
}

/// `zdelay get ID` as JSON, or `None` when it says there is no such job (exit 3).
fn get(config: &TestConfig, id: &str) -> Option<Value> {
    let out = config.cli(&["get", id, "-o", "json"]);
    if out.status.code() == Some(3) && stderr(&out).contains(&format!("no job {id}")) {
        return None;
    }
    assert!(out.status.success(), "get {id}: {}", stderr(&out));
    Some(serde_json::from_str(&stdout(&out)).expect("get prints JSON"))
}

/// Whether `s` is an id `enqueue` generates (`~<lane>.<12 characters>`).
fn is_generated_id(s: &str) -> bool {
    zdelay::lane_id::LaneId::parse(s).is_ok()
}

/// The single id `enqueue` printed.
fn one_id(out: &str) -> String {
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "enqueue prints one line: {out:?}");
    lines[0].to_owned()
}

fn strings(list: Vec<Vec<u8>>) -> Vec<String> {
    list.into_iter()
        .map(|b| String::from_utf8(b).expect("utf-8 payload"))
        .collect()
}

/// `--in`, `--at` (RFC 3339 and epoch ms), `--header`, `--payload-file` with binary bytes:
/// the due times and headers are stored as given, and every job arrives byte-identical.
#[test]
fn enqueue_one_job_at_a_time() {
    let (redis, config) = setup();
    let mut con = redis.conn();

    let before = redis_now_ms(&mut con);
    let id_in = one_id(&ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "a",
            "--in",
            "200ms",
            "--payload",
            "in-200",
        ],
    ));
    let after = redis_now_ms(&mut con);
    assert!(is_generated_id(&id_in), "{id_in:?} is not a generated id");
    let job = get(&config, &id_in).expect("the job exists");
    let due = job["due"].as_i64().expect("due");
    assert!(
        (before + 200..=after + 200).contains(&due),
        "--in 200ms: due {due} not in [{}, {}]",
        before + 200,
        after + 200
    );
    // Due in 200 ms: scheduled, in the words `zdelay stats` uses.
    assert_eq!(job["state"], "scheduled");
    assert_eq!(job["dest"], "a");
    assert_eq!(job["payload"], "in-200");

    // --at as RFC 3339 with milliseconds, and as epoch ms.
    let at_rfc = redis_now_ms(&mut con) + 300;
    let rfc = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(at_rfc as u64))
        .to_string();
    let id_rfc = one_id(&ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "b",
            "--at",
            &rfc,
            "--payload",
            "at-rfc",
        ],
    ));
    assert_eq!(get(&config, &id_rfc).expect("job")["due"], at_rfc, "{rfc}");
    let at_ms = redis_now_ms(&mut con) + 400;
    let id_ms = one_id(&ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "a",
            "--at",
            &at_ms.to_string(),
            "--header",
            "K=V",
            "--header",
            "trace=a=b",
            "--payload",
            "at-ms",
        ],
    ));
    let job = get(&config, &id_ms).expect("job");
    assert_eq!(job["due"], at_ms);
    assert_eq!(
        job["headers"],
        serde_json::json!({"K": "V", "trace": "a=b"}),
        "{job}"
    );

    // Binary payload: every byte value, plus a NUL-and-newline tail.
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("payload.bin");
    let mut bytes: Vec<u8> = (0..=255u8).collect();
    bytes.extend_from_slice(b"\0\n\r\xff");
    std::fs::write(&file, &bytes).expect("write payload");
    let id_bin = one_id(&ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "b",
            "--payload-file",
            common::path_str(&file),
        ],
    ));
    assert_eq!(
        get(&config, &id_bin).expect("job")["payload_encoding"],
        "base64"
    );

    let _daemon = Daemon::start(&config);
    wait_for("4 jobs delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:a") == 2 && llen(&mut con, "q:b") == 2
    });
    let mut a = strings(lrange(&mut con, "q:a"));
    a.sort();
    assert_eq!(a, vec!["at-ms", "in-200"]);
    let mut b = lrange(&mut con, "q:b");
    b.sort();
    assert_eq!(b, vec![bytes.clone(), b"at-rfc".to_vec()]);
    for id in [&id_in, &id_rfc, &id_ms, &id_bin] {
        assert!(
            get(&config, id).is_none(),
            "{id} still stored after delivery"
        );
    }
}

/// `--id` with `--on-conflict keep | error | replace`.
/// A typed time is the instant it names, whatever its offset: 09:00 at +05:00 is 04:00 UTC,
/// on `enqueue --at`, `reschedule --at` and `schedule preview --from` alike.
#[test]
fn typed_times_are_the_instants_they_name() {
    let (_redis, config) = setup();
    let utc = |text: &str| text.parse::<jiff::Timestamp>().unwrap().as_millisecond();
    let four_utc = utc("2027-12-01T04:00:00Z");
    for (id, at) in [
        ("with-fraction", "2027-12-01T09:00:00.000+05:00"),
        ("as-documented", "2027-12-01T09:00:00+05:00"),
        ("lower-case", "2027-12-01t04:00:00.0009z"),
        ("west", "2027-11-30T23:00:00-05:00"),
    ] {
        ok(
            &config,
            &[
                "enqueue",
                "--dest",
                "a",
                "--id",
                id,
                "--at",
                at,
                "--payload",
                "x",
            ],
        );
        assert_eq!(get(&config, id).expect("job")["due"], four_utc, "{at}");
    }
    let out = ok(
        &config,
        &[
            "reschedule",
            "west",
            "--at",
            "2027-12-01T10:30:00+05:30",
            "-o",
            "json",
        ],
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["due_ms"], utc("2027-12-01T05:00:00Z"), "{v}");
    let out = ok(
        &config,
        &[
            "schedule",
            "preview",
            "--every",
            "1h",
            "--from",
            "2027-12-01T09:00:00+05:00",
            "--count",
            "1",
            "-o",
            "json",
        ],
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["ms"], four_utc, "{v}");
}

#[test]
fn enqueue_with_id_and_conflict_policies() {
    let (_redis, config) = setup();
    let enqueue = |payload: &str, policy: Option<&str>| {
        let mut args = vec![
            "enqueue",
            "--dest",
            "a",
            "--in",
            "1h",
            "--id",
            "order-42",
            "--payload",
            payload,
        ];
        if let Some(p) = policy {
            args.extend(["--on-conflict", p]);
        }
        config.cli(&args)
    };
    let out = enqueue("one", None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "order-42\n");

    let out = enqueue("two", Some("keep"));
    assert!(out.status.success(), "keep exits 0: {}", stderr(&out));
    assert_eq!(stdout(&out), "order-42\n");
    assert!(stderr(&out).contains("kept"), "{}", stderr(&out));
    assert_eq!(get(&config, "order-42").expect("job")["payload"], "one");

    let out = enqueue("three", Some("error"));
    assert!(!out.status.success(), "error policy must fail");
    assert!(
        stderr(&out).contains("order-42 exists"),
        "message names the id: {}",
        stderr(&out)
    );
    assert_eq!(stdout(&out), "", "no id printed on failure");
    assert_eq!(get(&config, "order-42").expect("job")["payload"], "one");

    let out = enqueue("four", Some("replace"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(get(&config, "order-42").expect("job")["payload"], "four");
    // Still one job.
    let mut con = _redis.conn();
    assert_eq!(stored_total(&mut con, "due"), 1);
    assert_eq!(stored_total(&mut con, "jobs"), 1);
}

/// `enqueue --batch FILE`: one output line per input line in order (empty for a bad line),
/// bad lines named on stderr, exit 2, and the good lines delivered.
#[test]
fn enqueue_batch_file_with_bad_lines() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let past = redis_now_ms(&mut con) - 1_000;
    let lines = [
        r#"{"dest":"a","payload":"g1"}"#.to_owned(),
        r#"{"dest":"a","payload":"g2","in":"100ms"}"#.to_owned(),
        r#"{"dest":"a","payload":"#.to_owned(),
        r#"{"dest":"a","payload":"g4","id":"batch-4","headers":{"h":"v"}}"#.to_owned(),
        format!(r#"{{"dest":"a","payload":"g5","at":{past}}}"#),
        r#"{"payload":"no dest"}"#.to_owned(),
        r#"{"dest":"b","payload":"AAEC/w==","payload_encoding":"base64"}"#.to_owned(),
        r#"{"dest":"nope","payload":"unknown dest"}"#.to_owned(),
        r#"{"dest":"a","payload":"g9"}"#.to_owned(),
        r#"{"dest":"a","payload":"g10","in":"50ms"}"#.to_owned(),
        "   ".to_owned(), // blank: skipped, not bad
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("jobs.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write batch");

    let out = config.cli(&["enqueue", "--batch", common::path_str(&file)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let text = stdout(&out);
    let printed: Vec<&str> = text.split_terminator('\n').collect();
    assert_eq!(
        printed.len(),
        11,
        "one output line per input line: {text:?}"
    );
    let bad = [3, 6, 8];
    for (i, line) in printed.iter().enumerate() {
        let number = i + 1;
        if bad.contains(&number) || number == 11 {
            assert_eq!(
                *line, "",
                "line {number} is bad or blank: empty output line"
            );
        } else if number == 4 {
            assert_eq!(*line, "batch-4");
        } else {
            assert!(is_generated_id(line), "line {number}: {line:?}");
        }
    }
    let err = stderr(&out);
    for number in 1..=11 {
        assert_eq!(
            err.contains(&format!("line {number}:")),
            bad.contains(&number),
            "stderr and line {number}: {err}"
        );
    }
    assert!(err.contains("nope"), "the unknown dest is named: {err}");
    assert!(err.contains("dest"), "the missing field is named: {err}");
    assert_eq!(
        get(&config, "batch-4").expect("job")["headers"],
        serde_json::json!({"h": "v"})
    );

    let _daemon = Daemon::start(&config);
    wait_for("the 7 good jobs", Duration::from_secs(10), || {
        llen(&mut con, "q:a") == 6 && llen(&mut con, "q:b") == 1
    });
    let mut a = strings(lrange(&mut con, "q:a"));
    a.sort();
    assert_eq!(a, vec!["g1", "g10", "g2", "g4", "g5", "g9"]);
    assert_eq!(lrange(&mut con, "q:b"), vec![vec![0u8, 1, 2, 255]]);
    assert_eq!(stored_total(&mut con, "due"), 0);
    assert_eq!(stored_total(&mut con, "dead"), 0);
}

/// `enqueue --batch -` reads 20 000 lines from stdin: 20 000 distinct ids, all stored.
#[test]
fn enqueue_batch_from_stdin() {
    const N: usize = 20_000;
    let (redis, config) = setup();
    let mut child = Command::new(common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["enqueue", "--batch", "-"])
        .env("ZDELAY_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("zdelay runs");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || {
        let mut input = String::new();
        for i in 0..N {
            input.push_str(&format!(
                "{{\"dest\":\"{}\",\"payload\":\"s{i}\",\"in\":\"1h\"}}\n",
                if i % 2 == 0 { "a" } else { "b" }
            ));
        }
        stdin.write_all(input.as_bytes()).expect("write stdin");
    });
    let out = child.wait_with_output().expect("zdelay exits");
    writer.join().expect("writer");
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let ids: Vec<&str> = text.lines().collect();
    assert_eq!(ids.len(), N);
    assert!(
        ids.iter().all(|id| is_generated_id(id)),
        "every line is an id"
    );
    let distinct: std::collections::BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), N, "ids are unique");
    let mut con = redis.conn();
    assert_eq!(stored_total(&mut con, "due"), N);
    assert_eq!(stored_total(&mut con, "jobs"), N);
    // Output line i answers input line i.
    for i in [0, 1, N / 2, N - 1] {
        assert_eq!(
            get(&config, ids[i]).expect("job")["payload"],
            format!("s{i}")
        );
    }
}

/// `get` shows state, due, dest, payload and headers; `reschedule --in 1h` moves the due
/// time; `cancel` removes the job (`get` → not found), and a second cancel says so.
#[test]
fn get_reschedule_cancel() {
    let (redis, config) = setup();
    let mut con = redis.conn();
    let before = redis_now_ms(&mut con);
    let id = one_id(&ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "b",
            "--in",
            "10m",
            "--header",
            "tenant=acme",
            "--payload",
            r#"{"to":"a@b.c"}"#,
        ],
    ));
    let after = redis_now_ms(&mut con);
    let job = get(&config, &id).expect("job");
    assert_eq!(job["id"], id.as_str());
    assert_eq!(job["state"], "scheduled");
    assert_eq!(job["dest"], "b");
    assert_eq!(job["payload"], r#"{"to":"a@b.c"}"#);
    assert_eq!(job["headers"], serde_json::json!({"tenant": "acme"}));
    let due = job["due"].as_i64().expect("due");
    assert!((before + 600_000..=after + 600_000).contains(&due), "{due}");

    let before = redis_now_ms(&mut con);
    let out = ok(&config, &["reschedule", &id, "--in", "1h"]);
    let after = redis_now_ms(&mut con);
    assert!(out.contains(&id) && out.contains("due at"), "{out}");
    let due = get(&config, &id).expect("job")["due"]
        .as_i64()
        .expect("due");
    assert!(
        (before + 3_600_000..=after + 3_600_000).contains(&due),
        "rescheduled due {due}"
    );
    let at = before + 7_200_000;
    ok(&config, &["reschedule", &id, "--at", &at.to_string()]);
    assert_eq!(get(&config, &id).expect("job")["due"], at);

    let out = ok(&config, &["cancel", &id]);
    assert!(out.contains("cancelled"), "{out}");
    assert!(get(&config, &id).is_none(), "cancelled job still found");
    assert_eq!(stored_total(&mut con, "due"), 0);
    assert_eq!(stored_total(&mut con, "jobs"), 0);

    // Not pending: exit 3, said on stderr; --ignore-not-found makes a cancel idempotent.
    let out = config.cli(&["cancel", &id]);
    assert_eq!(out.status.code(), Some(3));
    assert!(stderr(&out).contains("not pending"), "{}", stderr(&out));
    let out = config.cli(&["cancel", &id, "--ignore-not-found"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stdout(&out) + &stderr(&out), "");
    let out = config.cli(&["reschedule", &id, "--in", "1h"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(stderr(&out).contains("not pending"), "{}", stderr(&out));
}

/// Seeds dead jobs (route `b`, whose list is not a list) and a dead raw member (a seconds
/// score in a millisecond source) through the daemon, then stops it. `q:b` stays a string, so
/// `b`'s jobs die again when replayed.
fn seed_dead(redis: &RedisServer, config: &TestConfig, rt: &tokio::runtime::Runtime) {
    let mut con = redis.conn();
    redis::cmd("SET")
        .arg("q:b")
        .arg("not a list")
        .query::<()>(&mut con)
        .expect("SET");
    let lib = config.client(rt);
    for i in 1..=3 {
        let job = NewJob::new("b", format!("dead payload {i}")).id(format!("dead-{i}"));
        rt.block_on(lib.enqueue(job, OnConflict::Error))
            .expect("enqueue");
    }
    redis::cmd("ZADD")
        .arg("raw:a")
        .arg(1_700_000_000)
        .arg("raw-dead")
        .query::<()>(&mut con)
        .expect("ZADD");
    let mut daemon = Daemon::start(config);
    wait_for(
        "3 dead jobs and 1 dead raw member",
        Duration::from_secs(10),
        || stored_total(&mut con, "dead") == 3 && zcard(&mut con, "raw:a:dead") == 1,
    );
    daemon.signal(libc::SIGTERM);
    assert_eq!(daemon.wait_exit(Duration::from_secs(15)).code(), Some(0));
}

/// Why [`seed_dead`]'s jobs die.
const WRONG_TYPE: &str = "WRONGTYPE: q:b holds a string, not a list";

fn zcard(con: &mut redis::Connection, key: &str) -> usize {
    redis::cmd("ZCARD").arg(key).query(con).expect("ZCARD")
}

/// `stats` and `stats --json` report exactly the seeded due-now, scheduled and dead counts,
/// per shard, per raw source and in total.
#[test]
fn stats_reflect_seeded_counts() {
    let (redis, config) = setup();
    let rt = common::runtime();
    seed_dead(&redis, &config, &rt);
    let lib = config.client(&rt);
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let mut jobs = Vec::new();
    for i in 0..5 {
        jobs.push(NewJob::new("a", format!("now{i}")).at(now - 2_000));
    }
    for i in 0..7 {
        jobs.push(NewJob::new("a", format!("later{i}")).after(Duration::from_secs(3600)));
    }
    for r in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
    {
        r.expect("accepted");
    }
    let mut zadd = redis::cmd("ZADD");
    zadd.arg("raw:a")
        .arg(now - 500)
        .arg("r-now-1")
        .arg(now - 400)
        .arg("r-now-2");
    for i in 0..4 {
        zadd.arg(now + 3_600_000 + i).arg(format!("r-later-{i}"));
    }
    zadd.query::<()>(&mut con).expect("ZADD");

    let v: Value = serde_json::from_str(&ok(&config, &["stats", "--json"])).expect("JSON");
    let total = &v["total"];
    assert_eq!(total["due_now"], 7, "{v:#}");
    assert_eq!(total["scheduled"], 11, "{v:#}");
    assert_eq!(total["inflight"], 0, "{v:#}");
    assert_eq!(total["dead"], 4, "{v:#}");
    assert!(total["oldest_due_age_ms"].as_u64().expect("age") >= 2_000);
    // A local route's jobs wait in its route lane, one row each; the spread shards (for
    // two-phase routes) hold none of them.
    let counts = |b: &Value| -> (u64, u64, u64) {
        let n = |field: &str| b[field].as_u64().unwrap();
        (n("due_now"), n("scheduled"), n("dead"))
    };
    let lanes = v["lanes"].as_array().expect("lanes");
    let lane = |route: &str| {
        let row = lanes.iter().find(|l| l["name"] == route);
        counts(row.unwrap_or_else(|| panic!("no lane row {route}: {v:#}")))
    };
    assert_eq!((lane("a"), lane("b")), ((5, 7, 0), (0, 0, 3)), "{v:#}");
    let shards = v["shards"].as_array().expect("shards");
    assert_eq!(shards.len(), SHARDS as usize);
    assert!(shards.iter().all(|s| counts(s) == (0, 0, 0)), "{v:#}");
    let sources = v["sources"].as_array().expect("sources");
    assert_eq!(sources.len(), 1);
    assert_eq!(sources[0]["name"], "raw:a");
    assert_eq!(
        (
            &sources[0]["due_now"],
            &sources[0]["scheduled"],
            &sources[0]["dead"]
        ),
        (&Value::from(2), &Value::from(4), &Value::from(1)),
        "{v:#}"
    );
    assert!(sources[0]["oldest_due_age_ms"].as_u64().expect("age") >= 500);

    // Compact by default: totals, one line per raw source, no per-shard rows; durations as
    // durations (the oldest due job waited at least 2 s).
    let text = ok(&config, &["stats"]);
    let total = text
        .lines()
        .find(|l| l.starts_with("total: "))
        .unwrap_or_else(|| panic!("a total line:\n{text}"));
    assert!(
        total.starts_with("total: 7 due now (the oldest ")
            && total.ends_with("overdue), 11 scheduled, 0 in flight, 4 dead"),
        "{text}"
    );
    assert!(!total.contains(" ms"), "a duration, not ms: {total}");
    assert!(
        text.contains("source raw:a: 2 due now (the oldest "),
        "{text}"
    );
    assert!(
        text.contains("route lane a: 5 due now (the oldest ")
            && text.contains("route lane b: 0 due now, 0 scheduled, 0 in flight, 3 dead"),
        "{text}"
    );
    assert!(
        text.contains(&format!("shards: {SHARDS} (one row each: --shards)")),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("shard ")).count(),
        0,
        "{text}"
    );

    let table = ok(&config, &["stats", "--shards"]);
    let header = table.lines().nth(1).expect("a header line");
    for column in ["due now", "scheduled", "inflight", "dead", "oldest due"] {
        assert!(header.contains(column), "{table}");
    }
    let rows: Vec<Vec<&str>> = table
        .lines()
        .filter(|l| l.starts_with("shard "))
        .map(|l| l.split_whitespace().skip(2).collect())
        .collect();
    assert_eq!(rows.len(), SHARDS as usize, "{table}");
    let column = |i: usize| -> u64 { rows.iter().map(|r| r[i].parse::<u64>().unwrap()).sum() };
    assert_eq!((column(0), column(1), column(3)), (0, 0, 0), "{table}");
    assert!(table.contains("route lane b: 0 due now"), "{table}");
}

/// `dead list [--json]`, `dead replay --id / --all / --source`, `dead purge --id / --all`.
#[test]
fn dead_list_replay_purge() {
    let (redis, config) = setup();
    let rt = common::runtime();
    seed_dead(&redis, &config, &rt);
    let mut con = redis.conn();

    let v: Value = serde_json::from_str(&ok(&config, &["dead", "list", "--json"])).expect("JSON");
    let jobs = v["jobs"].as_array().expect("jobs");
    let mut ids: Vec<&str> = jobs.iter().map(|j| j["id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, ["dead-1", "dead-2", "dead-3"], "{v:#}");
    for j in jobs {
        assert_eq!(j["reason"], WRONG_TYPE, "{v:#}");
        assert!(j["died_ms"].as_i64().expect("died_ms") > 1_700_000_000_000);
    }
    let raw = v["raw"].as_array().expect("raw");
    assert_eq!(raw.len(), 1, "{v:#}");
    assert_eq!(raw[0]["source"], "raw:a");
    assert_eq!(raw[0]["payload_preview"], "raw-dead");
    assert!(
        raw[0]["reason"].as_str().unwrap().contains("seconds"),
        "{v:#}"
    );
    let out = config.cli(&["dead", "list"]);
    assert!(out.status.success());
    let text = stdout(&out);
    for id in ["dead-1", "dead-2", "dead-3", "raw-dead", "WRONGTYPE"] {
        assert!(text.contains(id), "dead list shows {id}: {text}");
    }

    // Replay one, then the rest: due again, no longer dead.
    assert_eq!(
        ok(&config, &["dead", "replay", "--id", "dead-1"]).trim(),
        "replayed 1"
    );
    assert_eq!(get(&config, "dead-1").expect("job")["state"], "due");
    let dead2 = get(&config, "dead-2").expect("job");
    assert_eq!(dead2["state"], "dead");
    assert_eq!(dead2["reason"], WRONG_TYPE);
    assert_eq!(
        ok(&config, &["dead", "replay", "--all"]).trim(),
        "replayed 2"
    );
    for id in ["dead-1", "dead-2", "dead-3"] {
        assert_eq!(get(&config, id).expect("job")["state"], "due", "{id}");
    }
    assert_eq!(stored_total(&mut con, "dead"), 0);
    assert_eq!(stored_total(&mut con, "reasons"), 0);
    assert_eq!(stored_total(&mut con, "due"), 3);

    // The daemon sends them to dead again; purge one by id, then all.
    let _daemon = Daemon::start(&config);
    wait_for("3 dead again", Duration::from_secs(10), || {
        stored_total(&mut con, "dead") == 3
    });
    assert_eq!(
        ok(&config, &["dead", "purge", "--id", "dead-1"]).trim(),
        "purged 1"
    );
    assert!(get(&config, "dead-1").is_none());
    assert_eq!(ok(&config, &["dead", "purge", "--all"]).trim(), "purged 2");
    for id in ["dead-2", "dead-3"] {
        assert!(get(&config, id).is_none(), "{id} purged");
    }
    for kind in ["due", "jobs", "dead", "reasons"] {
        assert_eq!(stored_total(&mut con, kind), 0, "{kind}");
    }
    let v: Value = serde_json::from_str(&ok(&config, &["dead", "list", "--json"])).expect("JSON");
    assert_eq!(v["jobs"], serde_json::json!([]));

    // Raw source: replay puts the member back due now; the daemon delivers it as-is.
    assert_eq!(
        ok(&config, &["dead", "replay", "--source", "raw:a"]).trim(),
        "replayed 1"
    );
    wait_for("the replayed raw member", Duration::from_secs(10), || {
        llen(&mut con, "q:a") == 1
    });
    assert_eq!(lrange(&mut con, "q:a"), vec![b"raw-dead".to_vec()]);
    assert_eq!(zcard(&mut con, "raw:a:dead"), 0);
    assert_eq!(zcard(&mut con, "raw:a"), 0);
    let reasons: usize = redis::cmd("HLEN")
        .arg("raw:a:dead:reasons")
        .query(&mut con)
        .expect("HLEN");
    assert_eq!(reasons, 0);

    // Raw purge: a new dead member, purged.
    redis::cmd("ZADD")
        .arg("raw:a")
        .arg(1_700_000_001)
        .arg("raw-dead-2")
        .query::<()>(&mut con)
        .expect("ZADD");
    wait_for("a new dead raw member", Duration::from_secs(10), || {
        zcard(&mut con, "raw:a:dead") == 1
    });
    assert_eq!(
        ok(&config, &["dead", "purge", "--source", "raw:a"]).trim(),
        "purged 1"
    );
    assert_eq!(zcard(&mut con, "raw:a:dead"), 0);
    assert_eq!(llen(&mut con, "q:a"), 1, "a purged member is not delivered");

    let out = config.cli(&["dead", "replay", "--source", "raw:none"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("raw:none"), "{}", stderr(&out));
}

/// `zdelay completions <shell>` and `zdelay man` describe the command line, needing no
/// config (even a missing one named in the environment).
#[test]
fn completions_and_the_man_page_need_no_config() {
    let run = |args: &[&str]| {
        let out = Command::new(common::zdelay_bin())
            .args(args)
            .env("ZDELAY_CONFIG", "/nonexistent/zdelay.toml")
            .output()
            .expect("zdelay runs");
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
    };
    let bash = run(&["completions", "bash"]);
    assert!(
        bash.contains("_zdelay") && bash.contains("reshard"),
        "{bash}"
    );
    assert!(run(&["completions", "zsh"]).contains("#compdef zdelay"));
    let man = run(&["man"]);
    assert!(
        man.starts_with(".ie") || man.contains(".TH zdelay"),
        "{man}"
    );
    assert!(man.contains("enqueue"), "{man}");
}

/// The benchmark is a binary of its own: `zdelay-bench --help` shows its modes and the
/// options it shares with `zdelay`, and keeps its fault-injection flags out of sight.
#[test]
fn the_bench_binary_has_its_own_help() {
    let out = Command::new(common::bench_bin())
        .arg("--help")
        .output()
        .expect("zdelay-bench runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    for flag in [
        "--mode",
        "--daemons",
        "--zdelay-bin",
        "--config",
        "--redis-url",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}: {help}");
    }
    assert!(!help.contains("hang-pid"), "{help}");
}

/// Every file in `config/examples/` passes `check-config` as shipped, and names the routes
/// it says it has.
#[test]
fn the_example_configs_pass_check_config() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("config/examples")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    let expected = ["cluster", "kafka", "nats", "rabbitmq", "streams", "tls"];
    let stems: Vec<String> = names
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(stems, expected);
    for path in &names {
        let mut cmd = Command::new(common::zdelay_bin());
        for (k, _) in std::env::vars() {
            if k.starts_with("ZDELAY_") {
                cmd.env_remove(k);
            }
        }
        let out = cmd
            .arg("--config")
            .arg(path)
            .args(["check-config", "-o", "json"])
            .output()
            .expect("zdelay runs");
        assert!(out.status.success(), "{}: {}", path.display(), stderr(&out));
        let v: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
        assert!(
            v["routes"].as_array().is_some_and(|r| !r.is_empty()),
            "{v:#}"
        );
    }
}

/// `-u/--redis-url` names the Redis without a config file, over `ZDELAY_REDIS__URL`.
#[test]
fn redis_url_flag_names_the_redis_over_the_environment() {
    let redis = RedisServer::start();
    let out = Command::new(common::zdelay_bin())
        .args(["-u", &redis.url(), "stats", "--json"])
        .env("ZDELAY_REDIS__URL", "redis://127.0.0.1:1")
        .env_remove("ZDELAY_CONFIG")
        .output()
        .expect("zdelay runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert!(v["shards"].is_array() && v["total"].is_object(), "{v:#}");
}

fn shipped_config() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/zdelay.toml")
}

/// `check-config` on the shipped config succeeds and prints it as JSON with `-o json`, and as
/// TOML that loads as the same config without; environment overrides apply (upper-case
/// variables, as users write them), and a password from the environment prints as `***`.
#[test]
fn check_config_on_the_shipped_file() {
    let run_as = |format: &str, envs: &[(&str, &str)]| {
        let mut cmd = Command::new(common::zdelay_bin());
        cmd.arg("--config")
            .arg(shipped_config())
            .args(["check-config", "-o", format]);
        for (k, _) in std::env::vars() {
            if k.starts_with("ZDELAY_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(envs.iter().copied());
        cmd.output().expect("zdelay runs")
    };
    let run = |envs: &[(&str, &str)]| run_as("json", envs);
    // For people: the config file's own form, which reads back as the same config.
    let out = run_as("text", &[("ZDELAY_POLLER__BATCH", "250")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        !text.trim_start().starts_with('{'),
        "TOML, not JSON: {text}"
    );
    let shown = zdelay::config::from_toml(&text).expect("the printed TOML loads");
    assert_eq!(shown.poller.batch, 250, "{text}");
    let file = zdelay::config::load(Some(&shipped_config())).unwrap();
    assert_eq!(
        serde_json::to_value(&shown).unwrap(),
        serde_json::to_value(&file)
            .map(|mut v| {
                v["poller"]["batch"] = 250.into();
                v
            })
            .unwrap(),
        "the printed TOML is the effective config"
    );
    let out = run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert_eq!(v["redis"]["namespace"], "zdelay");
    assert!(v["redis"].get("password").is_none(), "{v:#}");
    let routes: Vec<&str> = v["routes"]
        .as_array()
        .expect("routes")
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(routes, ["default", "emails"]);
    assert_eq!(v["sources"][0]["key"], "delayed:emails");

    let out = run(&[
        ("ZDELAY_REDIS__PASSWORD", "123456"),
        ("ZDELAY_POLLER__BATCH", "250"),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["redis"]["password"], "***", "{v:#}");
    assert_eq!(v["poller"]["batch"], 250, "the override applies");
    assert!(
        !text.contains("123456") && !stderr(&out).contains("123456"),
        "the secret leaked: {text}"
    );
}

/// `zdelay --help` names every command.
#[test]
fn help_lists_every_command() {
    let out = Command::new(common::zdelay_bin())
        .arg("--help")
        .output()
        .expect("zdelay runs");
    assert!(out.status.success());
    let text = stdout(&out);
    let commands: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for c in [
        "run",
        "enqueue",
        "cancel",
        "reschedule",
        "get",
        "stats",
        "dead",
        "check-config",
    ] {
        assert!(commands.contains(&c), "--help lacks {c}: {text}");
    }
    // The benchmark is `zdelay-bench`, not part of the shipped binary.
    assert!(!commands.contains(&"bench"), "--help lists bench: {text}");
    let dead = Command::new(common::zdelay_bin())
        .args(["dead", "--help"])
        .output()
        .expect("zdelay runs");
    let dead = stdout(&dead);
    for c in ["list", "replay", "purge"] {
        assert!(dead.contains(&format!("  {c} ")), "dead --help lacks {c}");
    }
}

#[test]
fn stats_count_a_custom_raw_dead_key() {
    let redis = RedisServer::start();
    let extra = r#"
[[routes]]
name = "a"
sink = "local"
target = "q:a"

[[sources]]
key = "raw:c"
route = "a"
dead_key = "graveyard:c"
"#;
    let config = TestConfig::new(&redis.url(), 2, extra);
    let mut con = redis.conn();
    let _: () = redis::cmd("ZADD")
        .arg("graveyard:c")
        .arg(1)
        .arg("m1")
        .arg(2)
        .arg("m2")
        .query(&mut con)
        .expect("ZADD");
    let stats: Value = serde_json::from_str(&ok(&config, &["stats", "--json"])).expect("json");
    assert_eq!(stats["sources"][0]["name"], "raw:c");
    assert_eq!(stats["sources"][0]["dead"], 2, "{stats}");
}

#[test]
fn replaying_an_orphan_keeps_it_dead_and_counts_it() {
    let redis = RedisServer::start();
    let mut con = redis.conn();
    let rt = common::runtime();
    let cfg = RedisConfig {
        url: redis.url(),
        shards: 2,
        ..RedisConfig::default()
    };
    let client = rt.block_on(Client::connect(&cfg)).expect("client");
    let shard = client.keys().shard_of("orphan-1");
    let dead = client.keys().dead(shard);
    let reasons = client.keys().reasons(shard);
    let _: () = redis::pipe()
        .zadd(&dead, "orphan-1", 5)
        .hset(&reasons, "orphan-1", "no envelope stored for this id")
        .query(&mut con)
        .expect("seed an orphan");
    let r = rt
        .block_on(client.operator().dead_replay(&["orphan-1".to_owned()]))
        .expect("replay");
    assert_eq!((r.replayed, r.orphans), (0, 1));
    let r = rt
        .block_on(client.operator().dead_replay(&[]))
        .expect("replay all");
    assert_eq!((r.replayed, r.orphans), (0, 1));
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(&dead)
        .arg("orphan-1")
        .query(&mut con)
        .expect("ZSCORE");
    assert_eq!(score, Some(5.0), "the orphan stays dead");
    let reason: Option<String> = redis::cmd("HGET")
        .arg(&reasons)
        .arg("orphan-1")
        .query(&mut con)
        .expect("HGET");
    assert_eq!(reason.as_deref(), Some("no envelope stored for this id"));
}
