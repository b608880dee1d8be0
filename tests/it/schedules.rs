//! Recurring schedules through the daemon: every occurrence once across a kill -9, several
//! daemons, misfire policies after a stop, upserts that keep the grid, a Redis restart,
//! 10k schedules on one second, max lateness; and the `schedule` CLI.

use crate::common::{Daemon, RedisServer, TestConfig, llen, redis_now_ms, runtime, wait_for};
use std::time::{Duration, Instant};
use zdelay::config::RedisConfig;
use zdelay::schedule::Misfire;
use zdelay::schedules::{NewSchedule, Repeat};
use zdelay::{Client, NewJob, OnConflict};

const SHARDS: u16 = 4;

fn config(redis: &RedisServer, extra: &str) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
{extra}

[[routes]]
name = "l"
sink = "local"
target = "q:l"
push = "rpush"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "rpush"
"#
        ),
    )
}

fn client(rt: &tokio::runtime::Runtime, redis: &RedisServer) -> Client {
    rt.block_on(Client::connect(&RedisConfig {
        url: redis.url(),
        shards: SHARDS,
        ..Default::default()
    }))
    .expect("client")
}

/// Every `every` from `start` (inclusive) to `end` (exclusive), catching up what it misses.
fn windowed(id: &str, dest: &str, every: Duration, start: i64, end: i64) -> NewSchedule {
    let mut spec = NewSchedule::new(id, dest, id.to_owned(), Repeat::Every(every));
    spec.start_at = Some(start);
    spec.end_at = Some(end);
    spec.misfire = Misfire::CatchUp { max: 100 };
    spec
}

#[test]
fn a_per_second_schedule_fires_each_occurrence_once_across_a_kill_9() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let start = redis_now_ms(&mut con) + 1_000;
    let end = start + 10_000;
    rt.block_on(lib.schedule_set(windowed("tick", "l", Duration::from_secs(1), start, end)))
        .expect("set");
    let mut daemon = Daemon::start(&config);
    wait_for("four fires", Duration::from_secs(10), || {
        llen(&mut con, "q:l") >= 4
    });
    daemon.kill9();
    std::thread::sleep(Duration::from_millis(2_500));
    let _daemon = Daemon::start(&config);
    let now = redis_now_ms(&mut con);
    wait_for(
        "the window over",
        Duration::from_millis((end - now).max(0) as u64 + 3_000),
        || redis_now_ms(&mut con) > end + 500,
    );
    assert_eq!(llen(&mut con, "q:l"), 10, "ten occurrences, each once");
    let view = rt.block_on(lib.schedule_get("tick")).unwrap().unwrap();
    assert_eq!(view.next_ms, None, "the window has ended");
}

#[test]
fn three_daemons_fire_a_per_second_schedule_exactly_sixty_times() {
    let redis = RedisServer::start();
    let config = config(&redis, "slot_lease = \"2s\"");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let mut daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start_instance(&config)).collect();
    let start = redis_now_ms(&mut con) + 1_000;
    let end = start + 60_000;
    rt.block_on(lib.schedule_set(windowed("minute", "l", Duration::from_secs(1), start, end)))
        .expect("set");
    wait_for("20 fires", Duration::from_secs(30), || {
        llen(&mut con, "q:l") >= 20
    });
    daemons.remove(0).kill9();
    wait_for("35 fires", Duration::from_secs(30), || {
        llen(&mut con, "q:l") >= 35
    });
    let mut restarted = daemons.remove(0);
    restarted.signal(libc::SIGTERM);
    restarted.wait_exit(Duration::from_secs(10));
    daemons.push(Daemon::start_instance(&config));
    let now = redis_now_ms(&mut con);
    wait_for(
        "the minute over",
        Duration::from_millis((end - now).max(0) as u64 + 5_000),
        || redis_now_ms(&mut con) > end + 1_000,
    );
    assert_eq!(llen(&mut con, "q:l"), 60, "exactly 60 fires");
}

#[test]
fn each_misfire_policy_after_a_five_second_stop() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let mut daemon = Daemon::start(&config);
    let start = redis_now_ms(&mut con) + 500;
    let end = start + 11_000;
    for (id, list, misfire) in [
        ("coalesce", "l", Misfire::Coalesce),
        ("skip", "a", Misfire::Skip),
        ("catch-up", "b", Misfire::CatchUp { max: 100 }),
    ] {
        let mut spec = windowed(id, list, Duration::from_secs(1), start, end);
        spec.misfire = misfire;
        rt.block_on(lib.schedule_set(spec)).expect("set");
    }
    wait_for("three fires each", Duration::from_secs(10), || {
        ["q:l", "q:a", "q:b"].iter().all(|l| llen(&mut con, l) >= 3)
    });
    daemon.signal(libc::SIGTERM);
    daemon.wait_exit(Duration::from_secs(10));
    let stopped = [
        llen(&mut con, "q:l"),
        llen(&mut con, "q:a"),
        llen(&mut con, "q:b"),
    ];
    std::thread::sleep(Duration::from_secs(5));
    let _daemon = Daemon::start(&config);
    let now = redis_now_ms(&mut con);
    wait_for(
        "the window over",
        Duration::from_millis((end - now).max(0) as u64 + 3_000),
        || redis_now_ms(&mut con) > end + 500,
    );
    let [coalesce, skip, catch_up] = [
        llen(&mut con, "q:l"),
        llen(&mut con, "q:a"),
        llen(&mut con, "q:b"),
    ];
    eprintln!(
        "11 occurrences, 5 s stop after {stopped:?}: coalesce {coalesce}, skip {skip}, catch_up {catch_up}"
    );
    assert_eq!(catch_up, 11, "catch_up delivers every occurrence");
    assert_eq!(
        coalesce,
        skip + 1,
        "coalesce delivers one for what skip drops"
    );
    assert!(
        coalesce <= 11 - 4,
        "at least five occurrences were missed and coalesced into one: {coalesce}"
    );
}

#[test]
fn quick_upserts_keep_one_pending_occurrence_and_the_grid() {
    let redis = RedisServer::start();
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let spec = || {
        let mut s = NewSchedule::new("grid", "l", "x", Repeat::Every(Duration::from_secs(7)));
        s.misfire = Misfire::Skip;
        s
    };
    let first = rt.block_on(lib.schedule_set(spec())).unwrap();
    assert!(first.created);
    let anchor_phase = first.next_ms.unwrap() % 7_000;
    // Twenty concurrent upserts of the same schedule (compare-and-set retries).
    let results = rt.block_on(futures::future::join_all((0..20).map(|i| {
        let lib = &lib;
        let mut s = spec();
        s.payload = format!("v{i}").into_bytes();
        async move { lib.schedule_set(s).await }
    })));
    for r in &results {
        let set = r.as_ref().expect("upserted");
        assert!(!set.created);
        assert_eq!(
            set.next_ms.unwrap() % 7_000,
            anchor_phase,
            "the grid did not move"
        );
    }
    let pending = |con: &mut redis::Connection| -> usize {
        (0..SHARDS)
            .map(|s| {
                redis::cmd("ZCARD")
                    .arg(format!("{{zdelay:{s}}}:sched_due"))
                    .query::<usize>(con)
                    .unwrap()
            })
            .sum()
    };
    assert_eq!(pending(&mut con), 1, "one pending occurrence");
    let view = rt.block_on(lib.schedule_get("grid")).unwrap().unwrap();
    assert_eq!(view.version, 21);
    // Delete, then create again (a cron: its grid is the clock's).
    assert!(rt.block_on(lib.schedule_delete("grid")).unwrap());
    assert_eq!(pending(&mut con), 0);
    let cron = || {
        NewSchedule::new(
            "grid",
            "l",
            "x",
            Repeat::Cron {
                expr: "*/5 * * * * *".into(),
                tz: "Europe/Paris".into(),
            },
        )
    };
    let a = rt.block_on(lib.schedule_set(cron())).unwrap();
    assert!(rt.block_on(lib.schedule_delete("grid")).unwrap());
    let b = rt.block_on(lib.schedule_set(cron())).unwrap();
    assert!(b.created);
    assert_eq!(a.next_ms.unwrap() % 5_000, 0);
    assert!(b.next_ms.unwrap() - a.next_ms.unwrap() <= 5_000);
    assert_eq!(pending(&mut con), 1);
}

#[test]
fn a_schedule_keeps_firing_across_a_redis_restart() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let start = redis_now_ms(&mut con) + 500;
    rt.block_on(lib.schedule_set(windowed(
        "survivor",
        "l",
        Duration::from_millis(500),
        start,
        start + 60_000,
    )))
    .expect("set");
    let _daemon = Daemon::start(&config);
    wait_for("fires", Duration::from_secs(10), || {
        llen(&mut con, "q:l") >= 3
    });
    redis.restart();
    let mut con = redis.conn();
    let before = llen(&mut con, "q:l");
    wait_for("fires after the restart", Duration::from_secs(15), || {
        llen(&mut con, "q:l") >= before + 4
    });
}

#[test]
fn ten_thousand_schedules_due_on_one_second_all_go_within_a_second() {
    const N: usize = 10_000;
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let _daemon = Daemon::start(&config);
    // All first due at T (start_at, on each schedule's grid), then hourly.
    let t = redis_now_ms(&mut con) + 15_000;
    let loaded = Instant::now();
    rt.block_on(futures::future::join_all((0..16).map(|part| {
        let lib = &lib;
        async move {
            for i in (part..N).step_by(16) {
                let mut spec = NewSchedule::new(
                    format!("s{i}"),
                    "l",
                    format!("s{i}"),
                    Repeat::Every(Duration::from_secs(3600)),
                );
                spec.start_at = Some(t);
                lib.schedule_set(spec).await.expect("set");
            }
        }
    })));
    eprintln!("10k schedules set in {:?}", loaded.elapsed());
    assert!(redis_now_ms(&mut con) < t, "set before T");
    wait_for("T", Duration::from_secs(20), || redis_now_ms(&mut con) >= t);
    wait_for("all 10k delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:l") >= N
    });
    let done = redis_now_ms(&mut con);
    eprintln!("10k occurrences due at T delivered by T + {} ms", done - t);
    assert_eq!(llen(&mut con, "q:l"), N);
    assert!(done - t < 1_000, "all within a second: T + {} ms", done - t);
}

#[test]
fn max_lateness_expires_stale_jobs_and_occurrences() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    // Due 10 s ago with 1 s of tolerance: stale. Due now with 5 s: fresh.
    let stale = NewJob::new("l", "stale")
        .id("stale")
        .at(now - 10_000)
        .max_lateness(Duration::from_secs(1));
    let fresh = NewJob::new("l", "fresh")
        .id("fresh")
        .max_lateness(Duration::from_secs(5));
    rt.block_on(lib.enqueue_batch(vec![stale, fresh], OnConflict::Error))
        .unwrap();
    // A schedule whose first occurrences pass while no daemon runs.
    let mut spec = windowed("old", "a", Duration::from_secs(1), now + 500, now + 60_000);
    spec.max_lateness = Some(Duration::from_millis(500));
    rt.block_on(lib.schedule_set(spec)).unwrap();
    wait_for("three occurrences passed", Duration::from_secs(10), || {
        redis_now_ms(&mut con) > now + 3_000
    });
    let _daemon = Daemon::start(&config);
    wait_for("the fresh job delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:l") == 1
    });
    let got = crate::common::lrange(&mut con, "q:l");
    assert_eq!(got, vec![b"fresh".to_vec()]);
    let view = rt.block_on(lib.get("stale")).unwrap().unwrap();
    assert_eq!(view.state, zdelay::JobState::Dead);
    assert!(
        view.reason
            .as_deref()
            .unwrap_or_default()
            .starts_with("expired"),
        "{:?}",
        view.reason
    );
    // The schedule's first occurrences were already stale when planned: expired, not sent.
    wait_for("the schedule back on time", Duration::from_secs(10), || {
        llen(&mut con, "q:a") >= 2
    });
    let dead = rt.block_on(lib.dead_list(100)).unwrap();
    assert!(
        dead.iter()
            .any(|d| d.id.starts_with("{old}:") && d.reason.starts_with("expired")),
        "{dead:?}"
    );
}

#[test]
fn the_schedule_cli_sets_shows_pauses_resumes_deletes_and_previews() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let ok = |args: &[&str]| {
        let out = config.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = ok(&[
        "schedule",
        "set",
        "report",
        "--dest",
        "l",
        "--cron",
        "0 9 * * 1-5",
        "--tz",
        "Europe/Paris",
        "--payload",
        "go",
    ]);
    assert!(out.contains("created report; next occurrence"), "{out}");
    assert!(
        out.contains("T09:00:00+01:00") || out.contains("T09:00:00+02:00"),
        "{out}"
    );
    let got: serde_json::Value =
        serde_json::from_str(&ok(&["schedule", "get", "report", "--json"])).unwrap();
    assert_eq!(got["dest"], "l");
    assert_eq!(got["recurrence"]["cron"]["tz"], "Europe/Paris");
    assert_eq!(got["paused"], false);
    assert!(got["next_ms"].as_i64().is_some());
    assert!(ok(&["schedule", "list"]).contains("report  l  cron \"0 9 * * 1-5\" Europe/Paris"));
    assert!(ok(&["schedule", "pause", "report"]).contains("paused report"));
    let got: serde_json::Value =
        serde_json::from_str(&ok(&["schedule", "get", "report", "--json"])).unwrap();
    assert_eq!(got["paused"], true);
    assert!(got["next_ms"].is_null());
    assert!(ok(&["schedule", "resume", "report"]).contains("next occurrence"));
    assert!(ok(&["schedule", "delete", "report"]).contains("deleted report"));
    let out = config.cli(&["schedule", "get", "report"]);
    assert_eq!(out.status.code(), Some(1));

    // Invalid definitions name the field and write nothing.
    for (args, field) in [
        (vec!["--cron", "0 9 * *"], "cron"),
        (vec!["--cron", "0 9 * * *", "--tz", "Mars/Olympus"], "tz"),
        (vec!["--every", "0s"], "every"),
        (vec!["--cron", "0 0 30 2 *"], "never fires"),
    ] {
        let mut full = vec!["schedule", "set", "bad", "--dest", "l", "--payload", "x"];
        full.extend(args.iter().copied());
        let out = config.cli(&full);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{full:?}");
        assert!(err.contains(field), "{full:?}: {err}");
    }
    assert!(
        ok(&["schedule", "list"]).trim().is_empty(),
        "nothing written"
    );

    // Preview: the spring-forward day in Paris fires once, at 03:00 local.
    let out = ok(&[
        "schedule",
        "preview",
        "--cron",
        "30 2 * * *",
        "--tz",
        "Europe/Paris",
        "--from",
        "2026-03-28T12:00:00Z",
        "--count",
        "3",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("2026-03-29T03:00:00+02:00"), "{out}");
    assert!(lines[1].starts_with("2026-03-30T02:30:00+02:00"), "{out}");
    let json: serde_json::Value = serde_json::from_str(&ok(&[
        "schedule", "preview", "--every", "250ms", "--from", "1000", "--count", "3", "--json",
    ]))
    .unwrap();
    let ms: Vec<i64> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["ms"].as_i64().unwrap())
        .collect();
    assert_eq!(ms, vec![1000, 1250, 1500]);

    // --batch: one line per schedule, bad lines by number.
    let file = config.path.with_file_name("schedules.jsonl");
    std::fs::write(
        &file,
        "{\"id\":\"b1\",\"dest\":\"l\",\"every\":\"1h\",\"payload\":\"x\"}\n{\"id\":\"b2\",\"dest\":\"l\",\"payload\":\"x\"}\n",
    )
    .unwrap();
    let out = config.cli(&["schedule", "set", "--batch", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "a bad line");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().next().unwrap().starts_with("b1 "),
        "{stdout}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}

/// Occurrences through a broker carry `<schedule-id>:<occurrence ms>` as their message id;
/// a two-phase job whose sink stays down past its max lateness dies `expired`.
#[test]
fn occurrences_on_a_broker_carry_the_schedule_id_and_their_time() {
    use crate::broker_faults::{make_stream, nats_message_ids};
    let services = crate::common::Services::get();
    let rt = runtime();
    let nats = services.nats_url();
    let (_js, stream, prefix) = rt.block_on(make_stream(&nats));
    let redis = RedisServer::start();
    let mut remote = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
sink_pause = "200ms"

[sinks.bus]
kind = "nats"
url = "{nats}"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "n"
sink = "bus"
target = "{prefix}.tick"

[[routes]]
name = "r"
sink = "other"
target = "q:r"
"#,
            remote.url()
        ),
    );
    let lib = client(&rt, &redis);
    let mut con = redis.conn();
    let _daemon = Daemon::start(&config);
    let start = redis_now_ms(&mut con) + 500;
    let spec = windowed(
        "tick",
        "n",
        Duration::from_millis(500),
        start,
        start + 3_000,
    );
    rt.block_on(lib.schedule_set(spec)).unwrap();
    let ids = nats_message_ids(&services.python(), &nats, &stream, &prefix, 6);
    let want: Vec<String> = (0..6)
        .map(|k| format!("tick:{}", start + k * 500))
        .collect();
    assert_eq!(
        ids, want,
        "one message per occurrence, id <schedule>:<occurrence ms>"
    );

    // The remote sink is down for 3 s; the job tolerates 1 s.
    remote.stop();
    let job = NewJob::new("r", "late")
        .id("late")
        .max_lateness(Duration::from_secs(1));
    rt.block_on(lib.enqueue(job, OnConflict::Error)).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    remote.restart();
    wait_for("the late job dead", Duration::from_secs(15), || {
        rt.block_on(lib.get("late"))
            .unwrap()
            .is_some_and(|v| v.state == zdelay::JobState::Dead)
    });
    let view = rt.block_on(lib.get("late")).unwrap().unwrap();
    assert!(view.reason.unwrap_or_default().starts_with("expired"));
    assert_eq!(llen(&mut remote.conn(), "q:r"), 0, "not delivered stale");
}
