//! Recurring schedules through the daemon: every occurrence once across a kill -9, several
//! daemons, misfire policies after a stop, upserts that keep the grid, a Redis restart,
//! 10k schedules on one second, max lateness; and the `schedule` CLI. Issue 14: a set racing
//! a firing (deterministic, through a failpoint) and concurrent re-applies never fire an
//! occurrence twice or skip one, an update while no daemon runs leaves due occurrences to
//! the misfire policy, a big catch-up is written in bounded calls, and an unreadable
//! schedule is quarantined without making the mover spin.

use crate::common::{
    Daemon, RedisServer, TestConfig, llen, metric_value, redis_now_ms, runtime, wait_for,
};
use std::time::{Duration, Instant};
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

/// A producer with `config`'s routes: it registers their lanes if no daemon has yet.
fn client(rt: &tokio::runtime::Runtime, config: &TestConfig) -> Client {
    config.client(rt)
}

/// The keys of `route`'s lane (its list is `q:<route>`), where its schedules and their
/// occurrences are kept.
fn lane_keys(route: &str) -> zdelay::keys::LaneKeys {
    crate::common::lane_keys(route, &format!("q:{route}"))
}

/// When schedule `id`'s occurrence at `at_ms` is due, if it waits in `route`'s lane as a job.
fn occurrence_due(con: &mut redis::Connection, route: &str, id: &str, at_ms: i64) -> Option<f64> {
    redis::cmd("ZSCORE")
        .arg(lane_keys(route).due)
        .arg(zdelay::keys::occurrence_id(id, at_ms))
        .query(con)
        .expect("ZSCORE")
}

/// Jobs stored in the lanes of `routes` (occurrences written and not delivered yet).
fn lane_jobs(con: &mut redis::Connection, routes: &[&str]) -> usize {
    routes
        .iter()
        .map(|route| {
            redis::cmd("HLEN")
                .arg(lane_keys(route).jobs)
                .query::<usize>(con)
                .expect("HLEN")
        })
        .sum()
}

/// `route`'s lane as the registry gives it (the producer or the daemon registered it).
fn lane(rt: &tokio::runtime::Runtime, lib: &Client, route: &str) -> zdelay::lane::Lane {
    let registry = rt
        .block_on(zdelay::store::lanes::read_registry(
            &mut lib.connection(),
            &lib.keys(),
        ))
        .expect("the lane registry");
    registry.by_route[route].clone()
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
    let lib = client(&rt, &config);
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
    let lib = client(&rt, &config);
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
    // Each occurrence written at its time: the misfire policy decides those of the stop.
    let config = config(&redis, "fire_ahead = \"0s\"");
    let rt = runtime();
    let lib = client(&rt, &config);
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
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
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
        redis::cmd("ZCARD")
            .arg(lane_keys("l").sched_due)
            .query::<usize>(con)
            .unwrap()
    };
    assert_eq!(pending(&mut con), 1, "one pending occurrence");
    let view = rt.block_on(lib.schedule_get("grid")).unwrap().unwrap();
    // One write each, counted from the version the schedule was created with.
    let created = first.version;
    assert_eq!(view.version, created + 20);
    // Re-applying an unchanged schedule writes nothing: its version (which firings are
    // fenced on) stays.
    let unchanged = || {
        let mut s = spec();
        s.payload = b"final".to_vec();
        rt.block_on(lib.schedule_set(s)).unwrap()
    };
    assert_eq!(unchanged().version, created + 21);
    assert_eq!(
        unchanged().version,
        created + 21,
        "an unchanged set writes nothing"
    );
    assert!(rt.block_on(lib.schedule_pause("grid")).unwrap());
    assert_eq!(
        rt.block_on(lib.schedule_get("grid"))
            .unwrap()
            .unwrap()
            .version,
        created + 22
    );
    rt.block_on(lib.schedule_resume("grid")).unwrap();
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
    assert!(b.version > a.version, "created again: a version never used");
    assert_eq!(a.next_ms.unwrap() % 5_000, 0);
    assert!(b.next_ms.unwrap() - a.next_ms.unwrap() <= 5_000);
    assert_eq!(pending(&mut con), 1);
}

#[test]
fn a_schedule_keeps_firing_across_a_redis_restart() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
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

/// 10,000 schedules whose first occurrence is the same moment T: none goes before T, each
/// goes once. How soon after T they have all gone is measured by `zdelay-bench --mode
/// schedules` (docs/operations/benchmarks.md), not asserted here: a test machine's load sets it.
#[test]
fn ten_thousand_schedules_due_on_one_second_all_go_at_it_once() {
    const N: usize = 10_000;
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let _daemon = Daemon::start(&config);
    // All first due at T (start_at, on each schedule's grid), then hourly. T leaves the load
    // room on a slow machine; the default fire_ahead writes them ahead while it waits.
    let t = redis_now_ms(&mut con) + 25_000;
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
    wait_for("T", Duration::from_secs(30), || {
        // The list first: a job seen there and a clock read after it still before T went early.
        let waiting = llen(&mut con, "q:l");
        let now = redis_now_ms(&mut con);
        assert!(now >= t || waiting == 0, "{waiting} delivered before T");
        now >= t
    });
    wait_for("all 10k delivered", Duration::from_secs(60), || {
        llen(&mut con, "q:l") >= N
    });
    eprintln!(
        "10k occurrences due at T delivered by T + {} ms",
        redis_now_ms(&mut con) - t
    );
    let got = crate::common::lrange(&mut con, "q:l");
    let distinct: std::collections::HashSet<&Vec<u8>> = got.iter().collect();
    assert_eq!((got.len(), distinct.len()), (N, N), "each once");
}

#[test]
fn max_lateness_expires_stale_jobs_and_occurrences() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
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
    let dead = rt.block_on(lib.operator().dead_list(100)).unwrap();
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
    assert_eq!(out.status.code(), Some(3));
    let out = config.cli(&["schedule", "delete", "report"]);
    assert_eq!(out.status.code(), Some(3));
    let out = config.cli(&["schedule", "delete", "report", "--ignore-not-found"]);
    assert_eq!(out.status.code(), Some(0));

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
    let lib = client(&rt, &config);
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

/// Fires what is due in `lane` at `now` (explicit: tests drive time), then moves what is due
/// at `now` to its list; returns the occurrences written as jobs.
#[cfg(feature = "test-failpoints")]
fn fire_and_move(
    rt: &tokio::runtime::Runtime,
    lib: &Client,
    ctx: &zdelay::poller::PollerContext,
    lane: &std::sync::Arc<zdelay::lane::Lane>,
    now: i64,
) -> u64 {
    let mut con = lib.connection();
    let mut cache = zdelay::schedules::ScheduleCache::default();
    let wake_channel = lib.keys().wake_channel();
    let at = zdelay::schedules::SchedAt::Lane {
        lane,
        wake_channel: &wake_channel,
    };
    let report = rt
        .block_on(zdelay::schedules::fire_due(
            &mut con,
            at,
            Some(now),
            0,
            &mut cache,
            None,
        ))
        .expect("fire_due");
    rt.block_on(zdelay::poller::move_once(
        ctx,
        &zdelay::poller::Target::Lane(lane.clone()),
        Some(now),
    ))
    .expect("move_once");
    report.fired.created
}

/// `zdelay schedule set ARGS` stalled after it read the schedule and Redis's clock (the
/// `schedule_hold_after_read` failpoint): returns once it is there, with the file whose
/// creation lets it go on.
#[cfg(feature = "test-failpoints")]
fn stalled_set(config: &TestConfig, args: &[&str]) -> (std::process::Child, std::path::PathBuf) {
    let release = config.path.with_file_name(format!(
        "release-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let child = std::process::Command::new(crate::common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["schedule", "set"])
        .args(args)
        .env("ZDELAY_LOG", "warn")
        .env(
            "ZDELAY_FAILPOINT",
            format!("schedule_hold_after_read={}", release.display()),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("zdelay schedule set starts");
    let reached = release.with_extension("reached");
    wait_for("the set read the schedule", Duration::from_secs(20), || {
        reached.exists()
    });
    (child, release)
}

#[cfg(feature = "test-failpoints")]
fn release_set(child: std::process::Child, release: &std::path::Path) -> String {
    std::fs::write(release, b"").unwrap();
    let out = child.wait_with_output().expect("the set ends");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the race tests share: a Redis, a config with a local route, a client, a poller
/// context to move jobs with an explicit clock, and the lane of route `l`, where the
/// schedules are kept and fire.
#[cfg(feature = "test-failpoints")]
struct Race {
    redis: RedisServer,
    config: TestConfig,
    rt: tokio::runtime::Runtime,
    lib: Client,
    ctx: zdelay::poller::PollerContext,
    lane: std::sync::Arc<zdelay::lane::Lane>,
}

#[cfg(feature = "test-failpoints")]
impl Race {
    fn new() -> Self {
        let redis = RedisServer::start();
        let config = config(&redis, "");
        let rt = runtime();
        let lib = client(&rt, &config);
        let lanes = config.register_routes(&rt);
        let lane = lanes
            .iter()
            .find(|lane| lane.route == "l")
            .expect("route l's lane")
            .clone();
        let mut ctx = zdelay::poller::PollerContext::new(
            lib.connection(),
            &config.load(),
            Default::default(),
        );
        ctx.with_lanes(lib.keys(), lanes);
        Race {
            redis,
            config,
            rt,
            lib,
            ctx,
            lane,
        }
    }

    /// Creates an hourly schedule (so a set reads the clock well before its first
    /// occurrence whatever the machine's load; time is driven explicitly from there on) and
    /// returns that occurrence.
    fn hourly(&self, id: &str) -> i64 {
        let spec = NewSchedule::new(id, "l", "x", Repeat::Every(Duration::from_secs(3600)));
        let set = self.rt.block_on(self.lib.schedule_set(spec)).unwrap();
        set.next_ms.unwrap()
    }

    /// Fires and moves at `now` what is due in the lane of the schedules.
    fn fire_and_move(&self, now: i64) -> u64 {
        fire_and_move(&self.rt, &self.lib, &self.ctx, &self.lane, now)
    }

    fn delivered(&self) -> usize {
        llen(&mut self.redis.conn(), "q:l")
    }

    fn next_ms(&self, id: &str) -> Option<i64> {
        let view = self.rt.block_on(self.lib.schedule_get(id)).unwrap();
        view.expect("the schedule exists").next_ms
    }
}

/// The arguments of `schedule set` for [`Race::hourly`]'s schedule, unchanged.
#[cfg(feature = "test-failpoints")]
const HOURLY: [&str; 6] = ["--dest", "l", "--every", "1h", "--payload", "x"];

/// Issue 14, defect 1, made deterministic: a `schedule set` re-applying a schedule unchanged
/// reads it and Redis's clock just before occurrence O; O fires and is delivered; then the
/// set writes. O must not be pending again (it would be written and delivered twice), and
/// the grid stays.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_set_racing_a_firing_never_fires_an_occurrence_twice() {
    let race = Race::new();
    let o = race.hourly("race");
    let (child, release) = stalled_set(&race.config, &[&["race"], &HOURLY[..]].concat());
    assert_eq!(race.fire_and_move(o), 1, "O fires");
    assert_eq!(race.delivered(), 1);
    release_set(child, &release);
    assert_eq!(
        race.fire_and_move(o + 1_800_000),
        0,
        "nothing is due half an hour after O"
    );
    assert_eq!(race.delivered(), 1, "O delivered once");
    assert_eq!(race.next_ms("race"), Some(o + 3_600_000), "the grid kept");
}

/// The same race with a set that changes the timing (an end far away): its next occurrence
/// is planned again, after what fired meanwhile.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_timing_change_racing_a_firing_plans_after_what_fired() {
    let race = Race::new();
    let o = race.hourly("race");
    let end = (o + 100 * 3_600_000).to_string();
    let args = [&["race"], &HOURLY[..], &["--end-at", &end]].concat();
    let (child, release) = stalled_set(&race.config, &args);
    assert_eq!(race.fire_and_move(o), 1, "O fires");
    release_set(child, &release);
    assert_eq!(race.fire_and_move(o + 1_800_000), 0);
    assert_eq!(race.delivered(), 1, "O delivered once");
    assert_eq!(race.next_ms("race"), Some(o + 3_600_000));
}

/// The same race with the schedule deleted and created again between the set's read and its
/// write (the one created again has the version the set read): the set does not bring
/// back the old grid's O.
#[cfg(feature = "test-failpoints")]
#[test]
fn a_set_racing_a_delete_and_create_never_fires_an_occurrence_twice() {
    let race = Race::new();
    let o = race.hourly("race");
    let (child, release) = stalled_set(&race.config, &[&["race"], &HOURLY[..]].concat());
    assert_eq!(race.fire_and_move(o), 1, "O fires");
    assert!(race.rt.block_on(race.lib.schedule_delete("race")).unwrap());
    let next = race.hourly("race");
    assert!(next > o, "a new grid, anchored later");
    release_set(child, &release);
    assert_eq!(race.fire_and_move(next - 1), 0, "O is not pending again");
    assert_eq!(race.delivered(), 1, "O delivered once");
}

/// Issue 14, defect 1, through the real daemon: a per-second schedule to a local list,
/// re-applied unchanged by four concurrent loops of `zdelay schedule set` (as deploy tooling
/// does) for its whole ten-second window: each of its ten occurrences is written once (read
/// from `MONITOR`: the job each firing writes) and delivered once, none skipped.
#[test]
fn concurrent_unchanged_sets_keep_every_occurrence_exactly_once() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let mut con = redis.conn();
    let monitor_file = tempfile::NamedTempFile::new().expect("temp file");
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "MONITOR"])
        .stdout(std::process::Stdio::from(
            monitor_file.reopen().expect("reopen"),
        ))
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-cli MONITOR");
    let _daemon = Daemon::start(&config);
    let start = (redis_now_ms(&mut con) / 1000 + 3) * 1000;
    let end = start + 10_000;
    let (start_text, end_text) = (start.to_string(), end.to_string());
    let args = [
        "schedule",
        "set",
        "tick",
        "--dest",
        "l",
        "--cron",
        "* * * * * *",
        "--payload",
        "x",
        "--start-at",
        &start_text,
        "--end-at",
        &end_text,
    ];
    let set = |config: &TestConfig| {
        let out = config.cli(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    set(&config);
    let sets = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut con = redis.conn();
                while redis_now_ms(&mut con) < end + 500 {
                    set(&config);
                    sets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let lib_rt = runtime();
    let lib = client(&lib_rt, &config);
    wait_for(
        "the window over and delivered",
        Duration::from_secs(20),
        || {
            let counts = lib_rt.block_on(lib.operator().schedule_counts()).unwrap();
            counts.pending == 0 && lane_jobs(&mut con, &["l"]) == 0
        },
    );
    let delivered = llen(&mut con, "q:l");
    let _: String = redis::cmd("ECHO")
        .arg("schedules-monitor-end")
        .query(&mut con)
        .expect("ECHO");
    wait_for("MONITOR caught up", Duration::from_secs(20), || {
        std::fs::read_to_string(monitor_file.path())
            .unwrap_or_default()
            .contains("schedules-monitor-end")
    });
    let _ = monitor.kill();
    let _ = monitor.wait();
    let text = std::fs::read_to_string(monitor_file.path()).unwrap();
    // Every job a firing wrote: HSETNX <lane>:jobs {tick}:<ms> <payload>, run by a script;
    // and every element a script pushed onto q:l (the schedule's only route, nothing else is
    // enqueued here): the occurrences a firing pushed straight on (due when it fired) and the
    // written jobs their moves pushed.
    let commands: Vec<_> = text
        .lines()
        .filter_map(crate::keys_declared::parse_monitor_line)
        .filter(|(client, _)| client == "lua")
        .map(|(_, args)| args)
        .collect();
    let mut written: Vec<i64> = commands
        .iter()
        .filter(|args| args.len() == 4 && args[0].eq_ignore_ascii_case(b"HSETNX"))
        .filter_map(|args| {
            let field = String::from_utf8(args[2].clone()).ok()?;
            field.strip_prefix("{tick}:")?.parse().ok()
        })
        .collect();
    written.sort_unstable();
    written.dedup();
    let pushed: usize = commands
        .iter()
        .filter(|args| {
            args[0].eq_ignore_ascii_case(b"RPUSH") && args.get(1).is_some_and(|k| k == b"q:l")
        })
        .map(|args| args.len() - 2)
        .sum();
    eprintln!(
        "{} concurrent sets; occurrences written as jobs {written:?}, elements pushed {pushed}",
        sets.load(std::sync::atomic::Ordering::Relaxed)
    );
    let want: Vec<i64> = (0..10).map(|k| start + k * 1000).collect();
    assert!(
        written.iter().all(|o| want.contains(o)),
        "only the window's occurrences: {written:?}"
    );
    // The moves push the written jobs onto q:l too: every element pushed is one delivered.
    assert_eq!(pushed, delivered, "nothing pushed twice");
    let view = lib_rt
        .block_on(lib.schedule_get("tick"))
        .unwrap()
        .expect("the schedule");
    assert_eq!(
        (view.health.fired, view.health.missed),
        (10, 0),
        "each occurrence fired once, none skipped"
    );
    assert_eq!(delivered, 10, "each delivered once");
}

/// Issue 14: an update while no daemon runs (the pending occurrence already due) does not
/// drop the due occurrences: a daemon started afterwards delivers what each misfire policy
/// says, with the updated payload.
#[test]
fn an_update_while_no_daemon_runs_leaves_due_occurrences_to_the_misfire_policy() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    // Three occurrences (start, +1 s, +2 s), all past before any daemon runs.
    let start = redis_now_ms(&mut con) + 500;
    let end = start + 3_000;
    let policies = [
        ("coalesce", "l", Misfire::Coalesce),
        ("skip", "a", Misfire::Skip),
        ("catch-up", "b", Misfire::CatchUp { max: 100 }),
    ];
    let spec = |id: &str, list: &str, misfire: Misfire, payload: &str| {
        let mut spec = windowed(id, list, Duration::from_secs(1), start, end);
        spec.misfire = misfire;
        spec.payload = payload.as_bytes().to_vec();
        spec
    };
    for (id, list, misfire) in policies {
        rt.block_on(lib.schedule_set(spec(id, list, misfire, "v1")))
            .expect("set");
    }
    wait_for("the window over", Duration::from_secs(10), || {
        redis_now_ms(&mut con) > end + 100
    });
    for (id, list, misfire) in policies {
        let set = rt
            .block_on(lib.schedule_set(spec(id, list, misfire, "v2")))
            .expect("update");
        assert_eq!(
            set.next_ms,
            Some(start),
            "{id}: the due occurrence stays pending"
        );
    }
    let _daemon = Daemon::start(&config);
    wait_for("every schedule fired", Duration::from_secs(10), || {
        rt.block_on(lib.operator().schedule_counts())
            .unwrap()
            .pending
            == 0
            && lane_jobs(&mut con, &["l", "a", "b"]) == 0
    });
    let got = |con: &mut redis::Connection, list: &str| crate::common::lrange(con, list);
    assert_eq!(got(&mut con, "q:l"), vec![b"v2".to_vec()], "coalesce: one");
    assert!(got(&mut con, "q:a").is_empty(), "skip: none");
    assert_eq!(
        got(&mut con, "q:b"),
        vec![b"v2".to_vec(); 3],
        "catch_up: each of the three"
    );
}

/// The Redis time (µs) `SLOWLOG` recorded for each call of the script `sha` since the last
/// `SLOWLOG RESET`, which it then does.
fn slowlog_script_us(con: &mut redis::Connection, sha: &str) -> Vec<i64> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(con)
        .expect("SLOWLOG GET");
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(con).unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    entries
        .iter()
        .filter_map(|entry| match entry {
            redis::Value::Array(fields) => match (&fields.get(2)?, &fields.get(3)?) {
                (redis::Value::Int(us), redis::Value::Array(args))
                    if args.len() > 1
                        && text(&args[0]).eq_ignore_ascii_case("EVALSHA")
                        && text(&args[1]) == sha =>
                {
                    Some(*us)
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// Issue 14, defect 4: 30 schedules that each missed 10,000 occurrences, with `catch_up` up
/// to 10,000 (300,000 occurrences; one unbounded call would have written them all, and one
/// schedule alone is ten calls' worth): every fire call writes at most 1,000 of them (a short
/// script: its time in Redis is read from `SLOWLOG`), and over the calls each occurrence
/// the policy keeps is written exactly once. The jobs are taken away after each call, as a
/// mover would move them, so Redis holds no more than one call's worth.
/// Fires `lane`'s due schedules at `now` (explicit: the test drives time), pushing what is due
/// straight onto the list as the daemon does; returns (written as jobs, pushed).
fn fire_direct(
    rt: &tokio::runtime::Runtime,
    lib: &Client,
    lane: &zdelay::lane::Lane,
    now: i64,
    max_payload: usize,
) -> (u64, u64, Vec<u64>) {
    let wake_channel = lib.keys().wake_channel();
    let at = zdelay::schedules::SchedAt::Lane {
        lane,
        wake_channel: &wake_channel,
    };
    let direct = zdelay::schedules::DirectPush {
        push: lane.push,
        now_ms: None,
        max_payload,
        bounds_ms: &[50, 500],
    };
    let report = rt
        .block_on(zdelay::schedules::fire_due(
            &mut lib.connection(),
            at,
            Some(now),
            0,
            &mut zdelay::schedules::ScheduleCache::default(),
            Some(direct),
        ))
        .expect("fire_due");
    let fired = report.fired;
    (fired.created, fired.pushed, fired.pushed_buckets)
}

#[test]
fn due_occurrences_go_straight_onto_the_list_unless_a_job_waits_before_them() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let lanes = config.register_routes(&rt);
    let lane = lanes.iter().find(|l| l.route == "l").unwrap().clone();
    let mut ctx =
        zdelay::poller::PollerContext::new(lib.connection(), &config.load(), Default::default());
    ctx.with_lanes(lib.keys(), lanes);
    let move_at = |now: i64| {
        rt.block_on(zdelay::poller::move_once(
            &ctx,
            &zdelay::poller::Target::Lane(lane.clone()),
            Some(now),
        ))
        .expect("move_once")
    };
    // Every second from T (an hour ahead: time is driven explicitly from here on).
    let t = redis_now_ms(&mut con) + 3_600_000;
    rt.block_on(lib.schedule_set(windowed("a", "l", Duration::from_secs(1), t, t + 60_000)))
        .unwrap();
    // A job due just before T waits in the lane: the occurrence at T must not pass it.
    let early = NewJob::new("l", "early").id("early").at(t - 1);
    rt.block_on(lib.enqueue(early, OnConflict::Error)).unwrap();
    assert_eq!(
        fire_direct(&rt, &lib, &lane, t + 100, 1 << 20).0,
        1,
        "written as a job"
    );
    move_at(t + 100);
    assert_eq!(
        crate::common::lrange(&mut con, "q:l"),
        vec![b"early".to_vec(), b"a".to_vec()],
        "in due order"
    );
    // Nothing waits before the next: pushed in the firing, no job written, no move needed;
    // its lateness (120 ms) counted in the bucket (50, 500].
    assert_eq!(
        fire_direct(&rt, &lib, &lane, t + 1_120, 1 << 20),
        (0, 1, vec![0, 1, 0])
    );
    assert_eq!(lane_jobs(&mut con, &["l"]), 0);
    assert_eq!(llen(&mut con, "q:l"), 3);
    // A payload over the push's largest waits as a job, for its move to judge (here the
    // move's largest is the config's, and it delivers it).
    assert_eq!(fire_direct(&rt, &lib, &lane, t + 2_000, 0), (1, 0, vec![]));
    move_at(t + 2_000);
    assert_eq!(llen(&mut con, "q:l"), 4);
    // A list key of another type: the push writes nothing, the occurrence is written as a
    // job instead, and its move sends it to dead (wrong_type). Nothing is lost either way.
    let _: () = redis::cmd("RENAME")
        .arg("q:l")
        .arg("q:l:kept")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("q:l")
        .arg("not a list")
        .query(&mut con)
        .unwrap();
    assert_eq!(
        fire_direct(&rt, &lib, &lane, t + 3_000, 1 << 20),
        (1, 0, vec![])
    );
    move_at(t + 3_000);
    let view = rt
        .block_on(lib.get(&format!("{{a}}:{}", t + 3_000)))
        .unwrap()
        .expect("the occurrence, dead");
    assert_eq!(view.state, zdelay::JobState::Dead);
    let reason = view.reason.unwrap_or_default();
    assert!(reason.starts_with("WRONGTYPE"), "{reason}");
    assert_eq!(llen(&mut con, "q:l:kept"), 4);
}

#[test]
fn a_big_catch_up_is_written_in_bounded_calls_each_occurrence_once() {
    const SCHEDULES: usize = 30;
    const MISSED: i64 = 10_000;
    /// The most occurrences one call may write (`schedules::FIRE_MAX_OCCURRENCES`).
    const BOUND: u64 = 1_000;
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let created: Vec<Vec<(String, i64)>> =
        rt.block_on(futures::future::join_all((0..16).map(|part| {
            let lib = &lib;
            async move {
                let mut out = Vec::new();
                for i in (part..SCHEDULES).step_by(16) {
                    let id = format!("big-{i}");
                    let mut spec =
                        NewSchedule::new(&id, "l", "x", Repeat::Every(Duration::from_secs(1)));
                    spec.misfire = Misfire::CatchUp { max: MISSED as u32 };
                    let set = lib.schedule_set(spec).await.expect("set");
                    out.push((id, set.next_ms.expect("a next occurrence")));
                }
                out
            }
        })));
    let first: std::collections::HashMap<String, i64> = created.into_iter().flatten().collect();
    // As if no daemon ran for 10,000 s: each schedule has at least 10,000 due occurrences.
    let now = first.values().max().unwrap() + (MISSED - 1) * 1000;
    let (_, source) = zdelay::store::scripts::ALL
        .iter()
        .find(|(name, _)| *name == "fire_schedules_lane")
        .unwrap();
    let sha = redis::Script::new(source).get_hash().to_owned();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut con).unwrap();
    let mut written: std::collections::HashMap<String, Vec<i64>> = Default::default();
    let (mut calls, mut most, mut script_us) = (0, 0, Vec::new());
    let started = Instant::now();
    // Every schedule is kept in route l's lane and fires there.
    let lane = lane(&rt, &lib, "l");
    let wake_channel = lib.keys().wake_channel();
    let keys = &lane.keys;
    {
        let mut fire_con = lib.connection();
        let mut cache = zdelay::schedules::ScheduleCache::default();
        loop {
            let at = zdelay::schedules::SchedAt::Lane {
                lane: &lane,
                wake_channel: &wake_channel,
            };
            let report = rt
                .block_on(zdelay::schedules::fire_due(
                    &mut fire_con,
                    at,
                    Some(now),
                    0,
                    &mut cache,
                    None,
                ))
                .expect("fire_due");
            let n = report.fired.created + report.fired.expired;
            assert!(n <= BOUND, "one call wrote {n} occurrences");
            calls += 1;
            most = most.max(n);
            script_us.extend(slowlog_script_us(&mut con, &sha));
            let ids: Vec<String> = redis::cmd("ZRANGE")
                .arg(&keys.due)
                .arg(0)
                .arg(-1)
                .query(&mut con)
                .unwrap();
            assert_eq!(ids.len() as u64, report.fired.created);
            for id in ids {
                let (schedule, at) = id
                    .strip_prefix('{')
                    .and_then(|rest| rest.split_once("}:"))
                    .unwrap_or_else(|| panic!("an occurrence id: {id}"));
                written
                    .entry(schedule.to_owned())
                    .or_default()
                    .push(at.parse().unwrap());
            }
            let _: () = redis::cmd("UNLINK")
                .arg(&keys.due)
                .arg(&keys.jobs)
                .arg(&keys.meta)
                .arg(&keys.maxlate)
                .arg(&keys.large)
                .query(&mut con)
                .unwrap();
            if report.due == 0 {
                break;
            }
        }
    }
    script_us.sort_unstable();
    let at = |q: f64| script_us[((script_us.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{} occurrences in {calls} calls ({:?}): at most {most} per call; the script's time \
         in Redis: median {} µs, p99 {} µs, max {} µs",
        written.values().map(Vec::len).sum::<usize>(),
        started.elapsed(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    assert_eq!(written.len(), SCHEDULES);
    for (id, mut times) in written {
        let first = first[&id];
        let last = first + (now - first) / 1000 * 1000;
        times.sort_unstable();
        let want: Vec<i64> = (0..MISSED)
            .map(|k| last - (MISSED - 1 - k) * 1000)
            .collect();
        assert!(times == want, "{id}: each of the latest 10,000 once");
    }
}

/// Issue 14, defect 7 (part): schedules a firing cannot read (a first line that is not a
/// version, a cut JSON, a pending occurrence that is not a whole ms) are quarantined at their
/// first firing, with a reason `schedule list` and `get` show and the daemon logs once; the
/// mover does not retry them in a loop (its script calls stay at their idle rate), a healthy
/// schedule in the same lane keeps firing, and `schedule set` puts a quarantined one back
/// on its timeline.
#[test]
fn an_unreadable_schedule_is_quarantined_and_the_mover_does_not_spin() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[poller]
idle_poll = "500ms"

[[routes]]
name = "l"
sink = "local"
target = "q:l"
push = "rpush"
"#,
    );
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let every = |id: &str, every: Duration| NewSchedule::new(id, "l", id, Repeat::Every(every));
    rt.block_on(lib.schedule_set(every("healthy", Duration::from_millis(200))))
        .unwrap();
    let now = redis_now_ms(&mut con);
    for (id, record) in [("no-version", "v2\n{}"), ("cut", "1\n{\"dest\":\"l\",")] {
        rt.block_on(lib.schedule_set(every(id, Duration::from_secs(3600))))
            .unwrap();
        let keys = lane_keys("l");
        let _: () = redis::pipe()
            .hset(&keys.schedules, id, record)
            .zadd(&keys.sched_due, id, now)
            .query(&mut con)
            .unwrap();
    }
    // A pending occurrence that is not a whole ms (a score written by hand), at the head of
    // the healthy schedule's lane: it must not hold that lane's schedules up either.
    let fraction = "fraction".to_owned();
    rt.block_on(lib.schedule_set(every(&fraction, Duration::from_secs(3600))))
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(lane_keys("l").sched_due)
        .arg(now as f64 + 0.5)
        .arg(&fraction)
        .query(&mut con)
        .unwrap();
    let daemon = Daemon::start(&config);
    wait_for(
        "the healthy schedule fires",
        Duration::from_secs(10),
        || llen(&mut con, "q:l") >= 3,
    );
    let (before, t0) = (crate::common::script_calls(&mut con), Instant::now());
    // The measurement window (a rate needs a duration).
    std::thread::sleep(Duration::from_secs(1));
    let rate = (crate::common::script_calls(&mut con) - before) as f64 / t0.elapsed().as_secs_f64();
    eprintln!("script calls per second with three quarantined schedules: {rate:.0}");
    assert!(rate < 200.0, "the mover spins: {rate:.0} script calls/s");

    let ok = |args: &[&str]| {
        let out = config.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let list = ok(&["schedule", "list"]);
    let reasons = [
        (
            "no-version",
            "unreadable definition: its first line is not a version",
        ),
        ("cut", "unreadable definition: EOF"),
        (fraction.as_str(), "its pending occurrence"),
    ];
    for (id, reason) in reasons {
        let line = list
            .lines()
            .find(|l| l.starts_with(&format!("{id} ")))
            .unwrap_or_else(|| panic!("{id} listed: {list}"));
        assert!(line.contains(&format!("quarantined: {reason}")), "{line}");
        let got = ok(&["schedule", "get", id]);
        assert!(got.contains(&format!("quarantined: {reason}")), "{got}");
        let json: serde_json::Value =
            serde_json::from_str(&ok(&["schedule", "get", id, "--json"])).unwrap();
        assert!(
            json["quarantine"]["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with(reason)),
            "{json}"
        );
        let log = daemon.log_text();
        let logged = log
            .lines()
            .filter(|l| l.contains("quarantined") && l.contains(id))
            .count();
        assert_eq!(logged, 1, "{id} logged once:\n{log}");
    }
    let fired = llen(&mut con, "q:l");
    wait_for(
        "the healthy schedule keeps firing",
        Duration::from_secs(10),
        || llen(&mut con, "q:l") >= fired + 3,
    );
    // Pausing one that cannot be read says so; set again, it is back on its timeline.
    let out = config.cli(&["schedule", "pause", "cut"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("schedule cut cannot be read"),
        "{out:?}"
    );
    ok(&[
        "schedule",
        "set",
        "cut",
        "--dest",
        "l",
        "--every",
        "1h",
        "--payload",
        "x",
    ]);
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["schedule", "get", "cut", "--json"])).unwrap();
    assert!(
        json["next_ms"].is_i64() && json["quarantine"].is_null(),
        "{json}"
    );
}

/// A schedule's health across a stop of every daemon for three of its periods: `schedule
/// get` (JSON and text), the API and the scrape agree with the grid (coalesce misses all but
/// one of the occurrences due at once, skip all of them), and the alert on missed occurrences
/// fires on series shaped like the scrape (promtool).
#[test]
fn schedule_health_counts_a_stop_of_every_daemon_across_three_periods() {
    const PERIOD: i64 = 2_000;
    let redis = RedisServer::start();
    // Each occurrence written at its time: the misfire policy decides those of the stop (one
    // written ahead would be delivered late instead, see the test after this one).
    let config = config(&redis, "stats_interval = \"200ms\"\nfire_ahead = \"0s\"");
    let text = std::fs::read_to_string(&config.path).unwrap();
    let text = text.replacen(
        "[admin]\n",
        "[admin]\nschedule_metrics = [\"coalesced\", \"skipped\"]\n",
        1,
    );
    std::fs::write(&config.path, text).unwrap();
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    // One grid, one lane: both are fired by the same call, at the same now.
    let start = redis_now_ms(&mut con) + 500;
    for (id, misfire) in [("coalesced", Misfire::Coalesce), ("skipped", Misfire::Skip)] {
        let mut spec = NewSchedule::new(id, "l", id, Repeat::Every(Duration::from_secs(2)));
        spec.start_at = Some(start);
        spec.misfire = misfire;
        rt.block_on(lib.schedule_set(spec)).expect("set");
    }
    let read = |id: &str| {
        let out = config.cli(&["schedule", "get", id, "-o", "json"]);
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v["health"].clone(), v["next_ms"].as_i64())
    };
    // Its record and pending occurrence are read in one pipeline, which a firing may split:
    // twice the same is one state.
    let health = |id: &str| loop {
        let first = read(id);
        if read(id) == first {
            return first;
        }
    };
    let mut daemon = Daemon::start(&config);
    wait_for("two firings each", Duration::from_secs(10), || {
        ["coalesced", "skipped"]
            .iter()
            .all(|id| health(id).0["fired"].as_u64() >= Some(2))
    });
    let scrape = |d: &Daemon| d.admin_get("/metrics").map(|(_, t)| t).unwrap_or_default();
    let missed_series = [("schedule", "coalesced"), ("outcome", "missed")];
    wait_for(
        "the coalesced schedule exported",
        Duration::from_secs(10),
        || {
            metric_value(
                &scrape(&daemon),
                "zdelay_schedule_occurrences_recorded",
                &missed_series,
            ) == Some(0.0)
        },
    );
    daemon.signal(libc::SIGTERM);
    daemon.wait_exit(Duration::from_secs(10));
    let (before, next_before) = health("coalesced");
    let (skip_before, _) = health("skipped");
    let stopped_at = redis_now_ms(&mut con);
    wait_for(
        "three periods without a daemon",
        Duration::from_secs(10),
        || redis_now_ms(&mut con) > stopped_at + 3 * PERIOD + 200,
    );
    let daemon = Daemon::start(&config);
    wait_for(
        "the firing after the restart",
        Duration::from_secs(10),
        || health("coalesced").0["fired"].as_u64() > before["fired"].as_u64(),
    );
    let restarted_at = redis_now_ms(&mut con);
    let (after, next_after) = health("coalesced");
    let (skip_after, skip_next) = health("skipped");
    // Every occurrence from the start to the pending one was decided once: delivered or
    // missed, whatever firings ran between the reads above.
    let decided = |next: Option<i64>| ((next.expect("pending") - start) / PERIOD) as u64;
    let count = |h: &serde_json::Value, field: &str| h[field].as_u64().unwrap();
    assert_eq!(
        count(&after, "fired") + count(&after, "missed"),
        decided(next_after),
        "coalesce: {after}"
    );
    assert_eq!(
        count(&skip_after, "fired") + count(&skip_after, "missed"),
        decided(skip_next),
        "skip: {skip_after}"
    );
    // The restart found the occurrences of the stop due at once: coalesce missed all but
    // one, skip all (one call fired both, at one now); none was missed before.
    assert_eq!(
        (count(&before, "missed"), count(&skip_before, "missed")),
        (0, 0)
    );
    let missed = count(&after, "missed");
    let due_at_once = missed + 1;
    assert_eq!(count(&skip_after, "missed"), due_at_once, "{skip_after}");
    let stopped_periods = ((restarted_at - next_before.expect("pending")) / PERIOD + 1) as u64;
    assert!(
        (3..=stopped_periods).contains(&due_at_once),
        "three periods stopped: {due_at_once} due at once, at most {stopped_periods}"
    );
    assert_eq!(count(&after, "expired"), 0);
    assert_eq!(count(&after, "skipped_by_calendar"), 0);
    let lateness = after["last_lateness_ms"].as_i64().unwrap();
    assert!(
        (0..PERIOD).contains(&lateness),
        "a firing delivers the latest due occurrence: {lateness} ms late"
    );
    let latest = after["last_occurrence_ms"].as_i64().unwrap();
    // The text form says the same.
    let out = config.cli(&["schedule", "get", "coalesced"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains(&format!(
            "missed {missed}, expired 0, skipped by calendar 0"
        )),
        "{shown}"
    );
    // The API lists it.
    let api = daemon
        .admin_get("/api/schedules")
        .expect("the API answers")
        .1;
    let api: serde_json::Value = serde_json::from_str(&api).unwrap();
    let listed = api["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "coalesced")
        .expect("listed");
    assert_eq!(listed["health"]["missed"].as_u64(), Some(missed));
    // The scrape: the record's counts, the last firing and the period.
    let mut text = String::new();
    wait_for(
        "the scrape has the new count",
        Duration::from_secs(10),
        || {
            text = scrape(&daemon);
            metric_value(
                &text,
                "zdelay_schedule_occurrences_recorded",
                &missed_series,
            ) == Some(missed as f64)
        },
    );
    let one = [("schedule", "coalesced")];
    assert_eq!(
        metric_value(&text, "zdelay_schedule_period_seconds", &one),
        Some(2.0)
    );
    let last_fired = metric_value(&text, "zdelay_schedule_last_fired_timestamp_seconds", &one)
        .expect("exported");
    assert!(last_fired * 1000.0 >= latest as f64, "{last_fired}");
    let skip_missed = [("schedule", "skipped"), ("outcome", "missed")];
    assert_eq!(
        metric_value(&text, "zdelay_schedule_occurrences_recorded", &skip_missed),
        Some(due_at_once as f64)
    );
    assert!(
        metric_value(
            &text,
            "zdelay_schedule_occurrences_total",
            &[("outcome", "missed")]
        )
        .unwrap_or(0.0)
            >= (2 * due_at_once - 1) as f64,
        "this daemon counted both schedules' misses"
    );
    check_missed_alert(missed);
}

/// The missed-occurrences alert on series shaped like the scrapes above: the first daemon
/// exported 0 for five minutes and stopped, the second exports `missed` from minute 6 on.
fn check_missed_alert(missed: u64) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = root.join("charts/zdelay/files/zdelay-rules.yaml");
    let dir = tempfile::tempdir().unwrap();
    let series = |instance: &str, values: &str| {
        format!(
            "      - series: 'zdelay_schedule_occurrences_recorded{{job=\"zdelay\",namespace=\"ns\",\
             instance=\"{instance}\",schedule=\"coalesced\",outcome=\"missed\"}}'\n        values: '{values}'\n"
        )
    };
    let test = format!(
        "rule_files:\n  - {rules}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{a}{b}\
         \x20   alert_rule_test:\n      - eval_time: 3m\n        alertname: ZdelayScheduleMissed\n        exp_alerts: []\n\
         \x20     - eval_time: 7m\n        alertname: ZdelayScheduleMissed\n        exp_alerts:\n\
         \x20         - exp_labels: {{severity: warning, job: zdelay, namespace: ns, schedule: coalesced}}\n\
         \x20           exp_annotations:\n\
         \x20             summary: 'zdelay schedule coalesced missed {missed} occurrences'\n\
         \x20             description: 'Schedule coalesced of zdelay (ns) had {missed} occurrences passed over \
         by its misfire policy in the last hour: no daemon fired them in time (all stopped, or the shard \
         had no poller). `zdelay schedule get coalesced` shows its counts and last firing.'\n",
        rules = rules.display(),
        a = series("a", "0 0 0 0 0 _ _ _ _ _"),
        b = series("b", &format!("_ _ _ _ _ _ {missed}x20")),
    );
    let file = dir.path().join("missed.test.yaml");
    std::fs::write(&file, test).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .expect("promtool (Debian's prometheus package) runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The schedules that missed the most, found over every route lane's health records (the
/// per-schedule series beside those named in the config), most first, those that missed
/// none left out; `schedule delete` removes a record.
#[test]
fn the_schedules_that_missed_the_most_are_found_across_lanes() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let records = [
        ("l", "few", "5 1 0 0 - -"),
        ("a", "most", "2 40 0 0 - -"),
        ("b", "some", "9 7 1 0 1000 900"),
        ("b", "none", "12 0 0 0 1000 950"),
    ];
    for (route, id, record) in records {
        let spec = NewSchedule::new(id, route, id, Repeat::Every(Duration::from_secs(3600)));
        rt.block_on(lib.schedule_set(spec)).expect("set");
        redis::cmd("HSET")
            .arg(lane_keys(route).sched_health)
            .arg(id)
            .arg(record)
            .query::<()>(&mut con)
            .unwrap();
    }
    let top = |n| {
        rt.block_on(lib.operator().schedules_most_missed(n))
            .expect("scan")
            .into_iter()
            .map(|(id, h)| (id, h.missed))
            .collect::<Vec<_>>()
    };
    assert_eq!(top(2), [("most".to_owned(), 40), ("some".to_owned(), 7)]);
    assert_eq!(
        top(10).len(),
        3,
        "the schedule that missed none is left out"
    );
    assert!(top(0).is_empty());
    let view = rt.block_on(lib.schedule_get("some")).unwrap().unwrap();
    assert_eq!(view.health.last_lateness_ms(), Some(100));
    assert!(rt.block_on(lib.schedule_delete("most")).unwrap());
    assert_eq!(top(1), [("some".to_owned(), 7)]);
}

/// Redis's counters of commands run and bytes sent to clients (`INFO stats`).
fn redis_work(con: &mut redis::Connection) -> (u64, u64) {
    let info: String = redis::cmd("INFO").arg("stats").query(con).expect("INFO");
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in INFO stats"))
    };
    (
        field("total_commands_processed"),
        field("total_net_output_bytes"),
    )
}

#[test]
fn two_hundred_thousand_schedules_are_paged_in_bounded_calls() {
    // 100,000 a lane, in two lanes; 2,000 of them pending at each millisecond, so pages end
    // among equal moments, within a lane and across the two.
    const PER_LANE: u64 = 100_000;
    const TIED: u64 = 1_000;
    const PAGE: usize = 1_000;
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let t = redis_now_ms(&mut con) + 86_400_000;
    // One schedule set through the client per lane; its records copied under other ids by a
    // script (a definition does not hold its id): quick, and what the reads meet.
    let copy = redis::Script::new(
        r#"
        local record = redis.call('HGET', KEYS[1], ARGV[1])
        local env = redis.call('HGET', KEYS[2], ARGV[1])
        local t, tied = tonumber(ARGV[3]), tonumber(ARGV[4])
        for i = 1, tonumber(ARGV[2]) - 1 do
          local id = ARGV[1] .. '-' .. i
          redis.call('HSET', KEYS[1], id, record)
          redis.call('HSET', KEYS[2], id, env)
          redis.call('ZADD', KEYS[3], t + math.floor(i / tied), id)
        end
        redis.call('ZADD', KEYS[3], t, ARGV[1])
        "#,
    );
    for route in ["a", "b"] {
        let mut spec = NewSchedule::new(
            format!("{route}0"),
            route,
            "x",
            Repeat::Every(Duration::from_secs(3600)),
        );
        spec.start_at = Some(t);
        rt.block_on(lib.schedule_set(spec)).expect("set");
        let keys = lane_keys(route);
        let () = copy
            .key(&keys.schedules)
            .key(&keys.sched_env)
            .key(&keys.sched_due)
            .arg(format!("{route}0"))
            .arg(PER_LANE)
            .arg(t)
            .arg(TIED)
            .invoke(&mut con)
            .expect("copies");
    }
    let op = lib.operator();
    let counts = rt.block_on(op.schedule_counts()).unwrap();
    assert_eq!(
        (counts.schedules, counts.pending),
        (2 * PER_LANE, 2 * PER_LANE)
    );

    // Page by page, each id once, in (moment, home, id) order; one page in the middle
    // measured: its commands and bytes do not grow with the set (reading every pending
    // occurrence would send tens of megabytes).
    let mut seen = std::collections::HashSet::new();
    let mut last: Option<(i64, String)> = None;
    let mut after = None;
    let mut pages = 0;
    loop {
        let measured = pages == 100;
        let before = redis_work(&mut con);
        let started = Instant::now();
        let page = rt
            .block_on(op.schedules_upcoming_page(after.as_ref(), PAGE))
            .expect("a page");
        if measured {
            let (commands, bytes) = redis_work(&mut con);
            let (commands, bytes) = (commands - before.0, bytes - before.1);
            eprintln!(
                "page {pages} of {PAGE}: {commands} commands, {bytes} bytes, {:?}",
                started.elapsed()
            );
            assert!(commands < 100, "{commands} commands for a page");
            assert!(bytes < 2_000_000, "{bytes} bytes for a page");
        }
        pages += 1;
        for view in &page.schedules {
            assert!(seen.insert(view.id.clone()), "{} listed twice", view.id);
            let at = view.next_ms.expect("pending");
            if let Some((prev, _)) = &last {
                assert!(*prev <= at, "soonest first: {prev} then {at}");
            }
            last = Some((at, view.id.clone()));
        }
        match page.next {
            Some(next) => {
                assert_eq!(page.schedules.len(), PAGE);
                let last = page.schedules.last().unwrap();
                assert_eq!(
                    (next.next_ms, next.id.as_str()),
                    (last.next_ms.unwrap(), last.id.as_str())
                );
                // Once, the cursor's schedule leaves its moment (it fired, or was deleted):
                // the next page starts after where it stood all the same.
                if pages == 150 {
                    let route = &next.id[..1];
                    let () = redis::cmd("ZREM")
                        .arg(lane_keys(route).sched_due)
                        .arg(&next.id)
                        .query(&mut con)
                        .unwrap();
                }
                after = Some(next);
            }
            None => break,
        }
    }
    assert_eq!(
        seen.len() as u64,
        2 * PER_LANE,
        "every pending schedule listed once"
    );
    assert_eq!(pages, (2 * PER_LANE as usize).div_ceil(PAGE));
}

/// `poller.fire_ahead`: an occurrence is written as a job before its time and delivered at
/// it. An update, a pause and a delete take back the occurrences written ahead that still
/// wait, so what is delivered is what the schedule says at its time, once; an occurrence
/// written ahead is a job, so a stop of every daemon delivers it late instead of leaving it
/// to the misfire policy.
#[test]
fn occurrences_written_ahead_are_taken_back_by_a_change() {
    let redis = RedisServer::start();
    let config = config(&redis, "fire_ahead = \"6s\"");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let t = redis_now_ms(&mut con) + 8_000;
    let hourly = |id: &str, route: &str, payload: &str| {
        let mut spec =
            NewSchedule::new(id, route, payload, Repeat::Every(Duration::from_secs(3600)));
        spec.start_at = Some(t);
        spec.misfire = Misfire::Skip;
        spec
    };
    let cases = [
        ("updated", "l"),
        ("paused", "a"),
        ("deleted", "b"),
        ("late", "b"),
    ];
    for (id, route) in cases {
        rt.block_on(lib.schedule_set(hourly(id, route, "old")))
            .expect("set");
    }
    let waiting = |con: &mut redis::Connection, id: &str, route: &str| {
        occurrence_due(con, route, id, t) == Some(t as f64)
    };
    let mut daemon = Daemon::start(&config);
    wait_for(
        "each written ahead, due at its time",
        Duration::from_secs(6),
        || cases.iter().all(|(id, route)| waiting(&mut con, id, route)),
    );
    assert!(
        redis_now_ms(&mut con) < t - 1_000,
        "written well before its time"
    );
    let view = |id: &str| rt.block_on(lib.schedule_get(id)).unwrap().unwrap();
    let health = |id: &str| view(id).health;
    assert_eq!(health("updated").fired, 1);
    assert_eq!(
        view("updated").next_ms,
        Some(t),
        "the occurrence written ahead is the next one"
    );
    // Set again unchanged: nothing is taken back, and the set names it as the next one.
    let same = rt
        .block_on(lib.schedule_set(hourly("updated", "l", "old")))
        .expect("set unchanged");
    assert_eq!(same.next_ms, Some(t));
    assert!(
        waiting(&mut con, "updated", "l"),
        "an unchanged set takes nothing back"
    );
    // An update takes its occurrence back and fires it again with the new payload; a pause
    // takes it back, and the resume fires it again; a delete takes it back for good.
    rt.block_on(lib.schedule_set(hourly("updated", "l", "new")))
        .expect("update");
    assert!(rt.block_on(lib.schedule_pause("paused")).expect("pause"));
    assert!(!waiting(&mut con, "paused", "a"), "a pause takes it back");
    assert!(rt.block_on(lib.schedule_delete("deleted")).expect("delete"));
    assert!(!waiting(&mut con, "deleted", "b"), "a delete takes it back");
    rt.block_on(lib.schedule_resume("paused")).expect("resume");
    wait_for("written ahead again", Duration::from_secs(3), || {
        waiting(&mut con, "updated", "l") && waiting(&mut con, "paused", "a")
    });
    assert!(redis_now_ms(&mut con) < t, "written again before its time");
    // Every daemon stops with "late" written ahead: a job, it is delivered once one is back.
    daemon.signal(libc::SIGTERM);
    daemon.wait_exit(Duration::from_secs(10));
    wait_for("T + 500 ms with no daemon", Duration::from_secs(10), || {
        redis_now_ms(&mut con) > t + 500
    });
    assert_eq!(
        llen(&mut con, "q:b"),
        0,
        "nothing delivered while no daemon runs"
    );
    let _daemon = Daemon::start(&config);
    wait_for("the occurrences delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:l") == 1 && llen(&mut con, "q:a") == 1 && llen(&mut con, "q:b") == 1
    });
    let list = |con: &mut redis::Connection, key: &str| {
        redis::cmd("LRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .query::<Vec<String>>(con)
            .expect("LRANGE")
    };
    assert_eq!(list(&mut con, "q:l"), ["new"], "the update's payload, once");
    assert_eq!(
        list(&mut con, "q:a"),
        ["old"],
        "the resumed occurrence, once"
    );
    assert_eq!(
        list(&mut con, "q:b"),
        ["old"],
        "the late one; nothing of the deleted one"
    );
    // Fired once each: the occurrence taken back is not counted twice.
    assert_eq!(health("updated").fired, 1);
    assert_eq!(health("paused").fired, 1);
    assert_eq!(health("late").missed, 0);
}

/// A schedule deleted and written again under the same id fires on its new definition only:
/// the daemon that compiled the old one (it wrote its occurrences ahead) never plans the new
/// one by it, and the new one's version is not the old one's.
#[test]
fn a_schedule_deleted_and_written_again_fires_on_its_new_definition_only() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let rt = runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let _daemon = Daemon::start(&config);
    let t = redis_now_ms(&mut con) + 3_000;
    // The old definition: two occurrences, t and t + 1 s, then it ends.
    let mut old = NewSchedule::new("s", "l", "old", Repeat::Every(Duration::from_secs(1)));
    old.start_at = Some(t);
    old.end_at = Some(t + 1_500);
    let first = rt.block_on(lib.schedule_set(old)).expect("set the old one");
    let written_ahead = |con: &mut redis::Connection| occurrence_due(con, "l", "s", t).is_some();
    wait_for("the old one written ahead", Duration::from_secs(5), || {
        written_ahead(&mut con)
    });
    assert!(rt.block_on(lib.schedule_delete("s")).expect("delete"));
    assert!(!written_ahead(&mut con), "the delete took it back");
    // The new definition: hourly from t + 4 s, off the old one's times and after its end.
    let mut new = NewSchedule::new("s", "l", "new", Repeat::Every(Duration::from_secs(3600)));
    new.start_at = Some(t + 4_000);
    new.misfire = Misfire::Skip;
    let second = rt.block_on(lib.schedule_set(new)).expect("set the new one");
    assert!(second.created);
    assert_ne!(second.version, first.version, "a version is never reused");

    let mut arrived = None;
    wait_for("the new one's occurrence", Duration::from_secs(15), || {
        if llen(&mut con, "q:l") == 0 {
            return false;
        }
        arrived.get_or_insert(redis_now_ms(&mut con));
        true
    });
    let arrived = arrived.expect("arrived");
    assert!(
        arrived >= t + 4_000,
        "delivered {} ms before the new definition's first occurrence",
        t + 4_000 - arrived
    );
    wait_for("t + 4.5 s", Duration::from_secs(5), || {
        redis_now_ms(&mut con) > t + 4_500
    });
    let delivered: Vec<String> = redis::cmd("LRANGE")
        .arg("q:l")
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .expect("LRANGE");
    assert_eq!(
        delivered,
        ["new"],
        "the new occurrence, once; nothing at the old times"
    );
}
