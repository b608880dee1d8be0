//! A test clock (`[testing] clock = true`): "now" is Redis's clock plus an offset that
//! `zdelay clock advance` moves forward. Each test enqueues something far ahead, advances,
//! and sees it handled at once: moves (local and two-phase routes), leases, schedules and
//! misfire, max lateness, rate buckets, unique windows, debounce, forecast. Pollers sleep up
//! to a minute here (`idle_poll_max`) once wake-ups are confirmed, so only the advance's
//! wake-up explains an arrival within seconds. And the refusals: a setting that disagrees
//! with the namespace, an advance on a namespace without a test clock, a bad duration, an
//! HTTP advance without the admin token.

use crate::common::{
    self, Daemon, RedisServer, TestConfig, http_request, llen, redis_now_ms, wait_for,
};
use std::time::{Duration, Instant};
use zdelay::job::JobState;
use zdelay::schedule::Misfire;
use zdelay::schedules::{NewSchedule, Repeat};
use zdelay::{Client, Enqueued, NewJob, OnConflict};

const DAY: Duration = Duration::from_secs(86_400);
const HOUR: Duration = Duration::from_secs(3_600);
/// How long an arrival after an advance may take: far below the minute-long idle sleeps.
const PROMPT: Duration = Duration::from_secs(3);
const TOKEN: &str = "clock-test-admin-token-0123456789";

fn config(redis: &RedisServer, extra: &str) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        2,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
idle_poll_max = "60s"

[testing]
clock = true

{extra}
"#
        ),
    )
}

/// A daemon whose wake-ups are confirmed: from now on it sleeps until its next due time, at
/// most a minute, unless woken.
fn daemon(config: &TestConfig) -> Daemon {
    let daemon = Daemon::start(config);
    wait_for("wake-ups confirmed", Duration::from_secs(20), || {
        daemon.metric("zdelay_wakeups_confirmed", &[("targets", "shards")]) == 1.0
    });
    daemon
}

fn client(rt: &tokio::runtime::Runtime, config: &TestConfig) -> Client {
    config.client(rt)
}

/// `zdelay clock advance BY`, checked; the new offset, ms.
fn advance(config: &TestConfig, by: &str) -> i64 {
    let out = config.cli(&["clock", "advance", by, "-o", "json"]);
    assert!(
        out.status.success(),
        "clock advance {by}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reading: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    reading["offset_ms"].as_i64().expect("offset_ms")
}

/// The namespace's now, ms (`zdelay clock show`).
fn clock_now(config: &TestConfig) -> i64 {
    let out = config.cli(&["clock", "show", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reading: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    reading["now_ms"].as_i64().expect("now_ms")
}

/// A waiting job's due time, ms.
fn due_of(view: &zdelay::JobView) -> i64 {
    view.score.expect("a waiting job has a due time") as i64
}

/// Waits at most [`PROMPT`] for `cond`, and says how long it took.
fn promptly(what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    wait_for(what, PROMPT, &mut cond);
    started.elapsed()
}

#[test]
fn a_job_due_in_30_days_arrives_moments_after_the_clock_advances_30_days() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = config(
        &redis,
        &format!(
            r#"
[sinks.far]
kind = "redis"
url = "{}"

[[routes]]
name = "default"
sink = "local"
target = "queue:default"

[[routes]]
name = "there"
sink = "far"
target = "q:there"
"#,
            remote.url()
        ),
    );
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let (mut con, mut far) = (redis.conn(), remote.conn());
    for dest in ["default", "there"] {
        rt.block_on(lib.enqueue(
            NewJob::new(dest, "later").id("monthly").after(30 * DAY),
            OnConflict::Error,
        ))
        .expect("enqueue");
    }
    let view = rt
        .block_on(lib.get_in("default", "monthly"))
        .expect("get")
        .expect("stored");
    assert_eq!(view.state, JobState::Scheduled);
    let real_now = redis_now_ms(&mut con);
    assert!(
        (due_of(&view) - real_now - 30 * 86_400_000).abs() < 10_000,
        "due in 30 days of the namespace's clock, which starts at Redis's"
    );

    let offset = advance(&config, "30d");
    assert_eq!(offset, 30 * 86_400_000);
    let took = promptly("both jobs delivered after the advance", || {
        llen(&mut con, "queue:default") == 1 && llen(&mut far, "q:there") == 1
    });
    eprintln!("delivered {took:?} after advancing 30 days");
    // The clock moved for everyone: Redis's own did not.
    assert!(redis_now_ms(&mut con) - real_now < 60_000);
    assert!(clock_now(&config) >= real_now + offset);
    // An "in 1 day" now counts from the moved clock.
    rt.block_on(lib.enqueue(
        NewJob::new("default", "next").id("daily").after(DAY),
        OnConflict::Error,
    ))
    .expect("enqueue");
    let view = rt
        .block_on(lib.get_in("default", "daily"))
        .expect("get")
        .expect("stored");
    let now = clock_now(&config);
    assert!(
        (due_of(&view) - now - 86_400_000).abs() < 10_000,
        "{} vs {now}",
        due_of(&view)
    );
    assert_eq!(view.state, JobState::Scheduled);
    advance(&config, "1d");
    promptly("the next one too", || llen(&mut con, "queue:default") == 2);
}

#[test]
fn a_lease_runs_out_when_the_clock_passes_it() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = config(
        &redis,
        &format!(
            r#"
[sinks.far]
kind = "redis"
url = "{}"

[[routes]]
name = "there"
sink = "far"
target = "q:there"
"#,
            remote.url()
        ),
    );
    // The publisher publishes, then stalls before it settles: the job stays leased.
    let marker = tempfile::tempdir().expect("temp dir");
    let release = marker.path().join("release");
    let hold = format!("hold_after_publish={}", release.display());
    let daemon = Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", hold.as_str())]);
    daemon.wait_ready();
    let rt = common::runtime();
    let lib = client(&rt, &config);
    rt.block_on(lib.enqueue(NewJob::new("there", "x").id("leased"), OnConflict::Error))
        .expect("enqueue");
    let state = || {
        rt.block_on(lib.get_in("there", "leased"))
            .expect("get")
            .map(|v| v.state)
    };
    wait_for("the job leased", Duration::from_secs(10), || {
        state() == Some(JobState::InFlight)
    });
    let expired = || daemon.metric("zdelay_leases_expired_total", &[]);
    let before = expired();
    // The lease is the default 30 s: an hour later it has run out, and the mover takes the
    // job back for another attempt.
    advance(&config, "1h");
    promptly("the lease ran out", || expired() > before);
    assert_ne!(state(), Some(JobState::InFlight));
    std::fs::write(&release, b"go").expect("release the publisher");
}

#[test]
fn a_schedule_fires_as_the_clock_passes_its_occurrences_by_its_misfire_policy() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        r#"
[[routes]]
name = "skip"
sink = "local"
target = "q:skip"

[[routes]]
name = "catch"
sink = "local"
target = "q:catch"
"#,
    );
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    for (id, misfire) in [
        ("skip", Misfire::Skip),
        ("catch", Misfire::CatchUp { max: 100 }),
    ] {
        let mut spec = NewSchedule::new(id, id, id.to_owned(), Repeat::Every(DAY));
        spec.misfire = misfire;
        rt.block_on(lib.schedule_set(spec)).expect("schedule set");
    }
    // One day: the first occurrence of each.
    advance(&config, "1d");
    promptly("the first occurrences", || {
        llen(&mut con, "q:skip") == 1 && llen(&mut con, "q:catch") == 1
    });
    // Five days at once (and a little more: Redis's clock moved on meanwhile): the five
    // occurrences since were missed. Catch-up delivers every one of them, skip none.
    advance(&config, "5d");
    promptly("catch-up delivers the missed occurrences", || {
        llen(&mut con, "q:catch") == 6
    });
    assert_eq!(
        llen(&mut con, "q:skip"),
        1,
        "skip delivers none of the missed ones"
    );
    // Skip goes on along the grid: the next day's occurrence comes.
    advance(&config, "1d");
    promptly("skip's next occurrence", || llen(&mut con, "q:skip") == 2);
    assert_eq!(llen(&mut con, "q:catch"), 7);
}

#[test]
fn max_lateness_counts_on_the_moved_clock() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let job = |id: &str, lateness: Duration| {
        NewJob::new("default", id)
            .id(id)
            .after(HOUR)
            .max_lateness(lateness)
    };
    rt.block_on(lib.enqueue(job("strict", Duration::from_secs(60)), OnConflict::Error))
        .expect("enqueue");
    rt.block_on(lib.enqueue(job("lenient", 2 * DAY), OnConflict::Error))
        .expect("enqueue");
    // Two hours later the strict one is an hour late (it may be a minute late): dead, expired;
    // the lenient one is delivered.
    advance(&config, "2h");
    promptly("the lenient job delivered", || {
        llen(&mut con, "queue:default") == 1
    });
    let strict = rt
        .block_on(lib.get_in("default", "strict"))
        .expect("get")
        .expect("stored");
    assert_eq!(strict.state, JobState::Dead);
    assert!(
        strict
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("expired"),
        "{:?}",
        strict.reason
    );
}

#[test]
fn a_rate_bucket_refills_as_the_clock_moves() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        r#"
[[routes]]
name = "hourly"
sink = "local"
target = "q:hourly"
rate = "1/h"
burst = 1
"#,
    );
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let jobs = (0..3)
        .map(|i| NewJob::new("hourly", format!("{i}")))
        .collect();
    rt.block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    wait_for("the burst", Duration::from_secs(10), || {
        llen(&mut con, "q:hourly") == 1
    });
    // The bucket refills one token an hour of the namespace's clock.
    advance(&config, "1h");
    promptly("one more an hour later", || llen(&mut con, "q:hourly") == 2);
    assert_eq!(llen(&mut con, "q:hourly"), 2, "one token an hour");
    advance(&config, "1h");
    promptly("the last one", || llen(&mut con, "q:hourly") == 3);
}

#[test]
fn unique_windows_and_debounce_follow_the_clock() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    // Far from Redis's clock first, so that a window measured on it would show.
    advance(&config, "10d");

    let unique = || NewJob::new("default", "u").id("once").unique_for(DAY);
    let enqueue = |job: NewJob, policy| rt.block_on(lib.enqueue(job, policy)).expect("enqueue").1;
    assert_eq!(enqueue(unique(), OnConflict::Replace), Enqueued::Added);
    wait_for("delivered", Duration::from_secs(10), || {
        llen(&mut con, "queue:default") == 1
    });
    assert_eq!(enqueue(unique(), OnConflict::Replace), Enqueued::Duplicate);
    advance(&config, "23h");
    assert_eq!(
        enqueue(unique(), OnConflict::Replace),
        Enqueued::Duplicate,
        "still in the window"
    );
    advance(&config, "2h");
    assert_eq!(
        enqueue(unique(), OnConflict::Replace),
        Enqueued::Added,
        "the window ended"
    );

    // Debounce: each enqueue pushes the job 2 h out, but never past its first enqueue plus
    // 3 h of the namespace's clock.
    let debounce = OnConflict::Debounce { max_wait: 3 * HOUR };
    let job = || NewJob::new("default", "d").id("debounced").after(2 * HOUR);
    let first = clock_now(&config);
    assert_eq!(enqueue(job(), debounce), Enqueued::Added);
    advance(&config, "90m");
    assert_eq!(enqueue(job(), debounce), Enqueued::Replaced);
    let view = rt
        .block_on(lib.get_in("default", "debounced"))
        .expect("get")
        .expect("stored");
    let deadline = first + 3 * 3_600_000;
    assert!(
        (due_of(&view) - deadline).abs() < 10_000,
        "due at the first enqueue plus max_wait: {} vs {deadline}",
        due_of(&view)
    );
    let before = llen(&mut con, "queue:default");
    advance(&config, "90m");
    promptly("the debounced job delivered at its deadline", || {
        llen(&mut con, "queue:default") == before + 1
    });
}

#[test]
fn the_forecast_counts_from_the_moved_clock() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    // The daemon first: it creates the namespace with its test clock (a producer creating it
    // would create a production one).
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    rt.block_on(lib.enqueue(
        NewJob::new("default", "x").after(30 * DAY + HOUR),
        OnConflict::Error,
    ))
    .expect("enqueue");
    let forecast = || {
        let out = config.cli(&["forecast", "--next", "2d", "--step", "1d", "-o", "json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let f: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let steps: Vec<u64> = f["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .map(|s| s["count"].as_u64().expect("count"))
            .collect();
        (f["now_ms"].as_i64().expect("now_ms"), steps)
    };
    let (before, steps) = forecast();
    assert_eq!(steps, [0, 0], "nothing within two days of Redis's clock");
    advance(&config, "30d");
    let (after, steps) = forecast();
    assert_eq!(steps, [1, 0], "due within a day of the moved clock");
    assert!(after - before >= 30 * 86_400_000);
}

#[test]
fn a_test_clock_is_set_at_creation_only_and_moves_forward_only() {
    let redis = RedisServer::start();
    let mut con = redis.conn();
    // A production namespace (no [testing]) refuses a daemon and a CLI that want a test clock,
    // writing nothing, and refuses an advance.
    let production = TestConfig::new(&redis.url(), 2, "");
    let lib_rt = common::runtime();
    let _lib = production.client(&lib_rt);
    let schema_before: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .expect("schema");
    let testing = TestConfig::new(&redis.url(), 2, "[testing]\nclock = true\n");
    let mut refused = Daemon::spawn(&testing);
    assert!(!refused.wait_exit(Duration::from_secs(20)).success());
    let log = refused.log_text();
    assert!(
        log.contains("created without a test clock") && log.contains("[testing] clock = true"),
        "{log}"
    );
    let out = testing.cli(&["clock", "show"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("created without a test clock"));
    // check-config --connect says so before a daemon is started.
    let out = testing.cli(&["check-config", "--connect"]);
    assert!(!out.status.success());
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("created without a test clock"), "{report}");
    let out = production.cli(&["clock", "advance", "1h"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no test clock"), "{err}");
    let schema_after: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .expect("schema");
    assert_eq!(schema_before, schema_after, "nothing written");

    // A test namespace refuses a daemon without the setting.
    let other = RedisServer::start();
    let testing = config(&other, "");
    let daemon = daemon(&testing);
    let without = TestConfig::new(&other.url(), 2, "");
    let mut refused = Daemon::spawn(&without);
    assert!(!refused.wait_exit(Duration::from_secs(20)).success());
    let log = refused.log_text();
    assert!(
        log.contains("created with a test clock") && log.contains("[testing] clock = false"),
        "{log}"
    );
    // Bad durations are refused before anything is sent; the clock has not moved.
    for bad in ["-1h", "0s", "soon", "10"] {
        let out = testing.cli(&["clock", "advance", bad]);
        assert!(!out.status.success(), "{bad} refused");
        assert_eq!(out.status.code(), Some(2), "{bad}: a usage error");
    }
    let out = testing.cli(&["clock", "show", "-o", "json"]);
    let reading: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(reading["offset_ms"], 0);

    // Over HTTP: reading is public, moving needs the admin token (this daemon has none, so
    // the console is read-only); the next test's daemon has one.
    let (status, body) = daemon.admin_get("/api/clock").expect("answers");
    assert_eq!(status, 200, "{body}");
    let (status, _) =
        http_request(testing.admin_port, "POST", "/api/clock/advance?by=1h", &[]).expect("answers");
    assert_eq!(status, 403);
}

#[test]
fn the_admin_api_moves_the_clock_with_the_admin_token_only() {
    let redis = RedisServer::start();
    let config = config(&redis, "");
    // TestConfig writes `[admin]`: the token goes into that table.
    let text = std::fs::read_to_string(&config.path).expect("config");
    let text = text.replacen("[admin]\n", &format!("[admin]\ntoken = \"{TOKEN}\"\n"), 1);
    std::fs::write(&config.path, text).expect("config");
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    rt.block_on(lib.enqueue(NewJob::new("default", "x").after(DAY), OnConflict::Error))
        .expect("enqueue");
    let post = |query: &str, token: Option<&str>| {
        let bearer = token.map(|t| format!("Authorization: Bearer {t}"));
        let headers: Vec<&str> = bearer.as_deref().into_iter().collect();
        http_request(
            config.admin_port,
            "POST",
            &format!("/api/clock/advance{query}"),
            &headers,
        )
        .expect("answers")
    };
    assert_eq!(post("?by=1d", None).0, 403);
    assert_eq!(post("?by=1d", Some("wrong-token-wrong-token-wrong")).0, 403);
    assert_eq!(post("?by=-1d", Some(TOKEN)).0, 400);
    assert_eq!(post("", Some(TOKEN)).0, 400);
    assert_eq!(
        llen(&mut con, "queue:default"),
        0,
        "refused requests moved nothing"
    );
    let (status, body) = post("?by=1d", Some(TOKEN));
    assert_eq!(status, 200, "{body}");
    let reading: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(reading["offset_ms"], 86_400_000);
    promptly("delivered", || llen(&mut con, "queue:default") == 1);
}

#[test]
fn a_stream_trimmed_by_age_keeps_what_is_appended_after_an_advance() {
    let redis = RedisServer::start();
    let config = config(
        &redis,
        r#"
[[routes]]
name = "events"
sink = "local"
target = "s:events"
push = "xadd"
trim_max_age = "1h"
"#,
    );
    let _daemon = daemon(&config);
    let rt = common::runtime();
    let lib = client(&rt, &config);
    let mut con = redis.conn();
    let xlen = |con: &mut redis::Connection| -> usize {
        redis::cmd("XLEN").arg("s:events").query(con).expect("XLEN")
    };
    rt.block_on(lib.enqueue(
        NewJob::new("events", "a").after(30 * DAY),
        OnConflict::Error,
    ))
    .expect("enqueue");
    advance(&config, "30d");
    // The entry's id is Redis's millisecond, a month behind the test clock: trimming by age
    // counts on Redis's clock, so the entry just appended stays.
    promptly("the entry appended", || xlen(&mut con) == 1);
    rt.block_on(lib.enqueue(NewJob::new("events", "b"), OnConflict::Error))
        .expect("enqueue");
    promptly("the next one appended, the first kept", || {
        xlen(&mut con) == 2
    });
}
