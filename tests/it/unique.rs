//! Unique windows and debounce: a job enqueued `unique_for` a window is remembered once it is
//! delivered or dead, and an enqueue of its id within the window is answered `Duplicate`
//! without writing anything; a cancelled job is not remembered. `OnConflict::Debounce` pushes
//! a waiting job later on each enqueue but never past its first enqueue plus `max_wait`.
//! On both storage layouts, on a local list route and on a two-phase (remote Redis) route.

use crate::common::{Daemon, RedisServer, TestConfig, llen, redis_now_ms, wait_for};
use std::time::Duration;
use zdelay::{Cancelled, Client, Enqueued, NewJob, OnConflict};

const WINDOW: Duration = Duration::from_secs(3);

/// The two Redis servers (the namespace's and the remote sink's), a daemon on them, and a
/// client.
struct Setup {
    redis: RedisServer,
    remote: RedisServer,
    config: TestConfig,
    _daemon: Daemon,
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Setup {
    fn start() -> Self {
        let redis = RedisServer::start();
        let remote = RedisServer::start();
        let config = config(&redis, &remote);
        let daemon = Daemon::start(&config);
        let rt = crate::common::runtime();
        let client = rt.block_on(Client::open(&redis.url())).expect("open");
        Setup {
            redis,
            remote,
            config,
            _daemon: daemon,
            rt,
            client,
        }
    }
}

fn config(redis: &RedisServer, remote: &RedisServer) -> TestConfig {
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"

[sinks.remote]
kind = "redis"
url = "{}"

[[routes]]
name = "here"
sink = "local"
target = "q:here"

[[routes]]
name = "there"
sink = "remote"
target = "q:there"
"#,
        remote.url()
    );
    TestConfig::new(&redis.url(), 4, &extra)
}

fn enqueue(rt: &tokio::runtime::Runtime, client: &Client, job: NewJob) -> Enqueued {
    rt.block_on(client.enqueue(job, OnConflict::Replace))
        .expect("enqueue")
        .1
}

fn unique_windows_hold() {
    let Setup {
        redis,
        remote,
        config: _config,
        _daemon,
        rt,
        client,
    } = Setup::start();
    let mut con = redis.conn();
    let mut remote_con = remote.conn();
    let unique = |dest: &str, id: &str| NewJob::new(dest, id).id(id).unique_for(WINDOW);

    for (dest, list, con) in [
        ("here", "q:here", &mut con),
        ("there", "q:there", &mut remote_con),
    ] {
        let id = format!("once-{dest}");
        assert_eq!(enqueue(&rt, &client, unique(dest, &id)), Enqueued::Added);
        wait_for("the first delivery", Duration::from_secs(10), || {
            llen(con, list) == 1
        });
        let delivered_by = redis_now_ms(&mut redis.conn());
        // Within the window: answered as a duplicate, and nothing is scheduled.
        for policy in [OnConflict::Replace, OnConflict::Keep, OnConflict::Error] {
            let answer = rt
                .block_on(client.enqueue(unique(dest, &id), policy))
                .expect("enqueue")
                .1;
            assert_eq!(answer, Enqueued::Duplicate, "{dest}, {policy:?}");
        }
        assert!(
            rt.block_on(client.get_in(dest, &id))
                .expect("get")
                .is_none(),
            "{dest}: nothing written"
        );
        // After the window: scheduled and delivered again.
        wait_for("the window to pass", Duration::from_secs(10), || {
            redis_now_ms(&mut redis.conn()) > delivered_by + WINDOW.as_millis() as i64
        });
        assert_eq!(enqueue(&rt, &client, unique(dest, &id)), Enqueued::Added);
        wait_for("the second delivery", Duration::from_secs(10), || {
            llen(con, list) == 2
        });
    }

    // A job that dies (expired: due long ago, 1 ms of lateness allowed) is remembered too.
    let now = redis_now_ms(&mut con);
    let dies = unique("here", "dies")
        .at(now - 60_000)
        .max_lateness(Duration::from_millis(1));
    assert_eq!(enqueue(&rt, &client, dies.clone()), Enqueued::Added);
    wait_for("the job to die", Duration::from_secs(10), || {
        rt.block_on(client.get_in("here", "dies"))
            .expect("get")
            .is_some_and(|v| v.state == zdelay::job::JobState::Dead)
    });
    assert_eq!(enqueue(&rt, &client, dies), Enqueued::Duplicate);

    // A cancelled job is not remembered.
    let later = unique("here", "cancelled").after(Duration::from_secs(600));
    assert_eq!(enqueue(&rt, &client, later.clone()), Enqueued::Added);
    assert_eq!(
        rt.block_on(client.cancel_in("here", "cancelled"))
            .expect("cancel"),
        Cancelled::Cancelled
    );
    assert_eq!(enqueue(&rt, &client, later), Enqueued::Added);

    // What is left: the windows still open, and nothing for jobs that wait.
    let namespace_keys: Vec<String> = redis::cmd("KEYS")
        .arg("*unique*")
        .query(&mut con)
        .expect("KEYS");
    for key in namespace_keys {
        let fields: Vec<String> = redis::cmd("HKEYS").arg(&key).query(&mut con).unwrap();
        assert!(
            fields.iter().all(|f| f == "cancelled"),
            "{key}: only the waiting job's window is held, got {fields:?}"
        );
    }
}

#[test]
fn a_unique_job_is_answered_duplicate_within_its_window_after_delivery_or_death() {
    unique_windows_hold();
}

fn debounce_holds() {
    let Setup {
        redis,
        remote: _remote,
        config,
        _daemon,
        rt,
        client,
    } = Setup::start();
    let mut con = redis.conn();
    let debounce = OnConflict::Debounce {
        max_wait: Duration::from_secs(60),
    };
    let due_of = |id: &str| {
        rt.block_on(client.get_in("here", id))
            .expect("get")
            .and_then(|v| v.score)
            .expect("waiting") as i64
    };
    let before = redis_now_ms(&mut con);
    let first = NewJob::new("here", "v1").id("d").at(before + 30_000);
    assert_eq!(
        rt.block_on(client.enqueue(first, debounce))
            .expect("enqueue")
            .1,
        Enqueued::Added
    );
    let after = redis_now_ms(&mut con);
    assert_eq!(due_of("d"), before + 30_000);
    // Pushed later by each enqueue…
    let again = NewJob::new("here", "v2").id("d").at(before + 50_000);
    assert_eq!(
        rt.block_on(client.enqueue(again, debounce))
            .expect("enqueue")
            .1,
        Enqueued::Replaced
    );
    assert_eq!(due_of("d"), before + 50_000);
    // …but never past the first enqueue plus max_wait.
    let far = NewJob::new("here", "v3").id("d").at(before + 600_000);
    rt.block_on(client.enqueue(far, debounce)).expect("enqueue");
    let capped = due_of("d");
    assert!(
        (before + 60_000..=after + 60_000).contains(&capped),
        "due {capped} is the first enqueue ({before}..{after}) plus 60 s"
    );
    let view = rt
        .block_on(client.get_in("here", "d"))
        .expect("get")
        .expect("waiting");
    assert_eq!(
        view.envelope.expect("envelope").payload,
        b"v3",
        "the latest payload"
    );
    // An earlier due time is taken as asked.
    let sooner = NewJob::new("here", "v4").id("d").at(before + 10_000);
    rt.block_on(client.enqueue(sooner, debounce))
        .expect("enqueue");
    assert_eq!(due_of("d"), before + 10_000);
    // Delivered: the next enqueue starts a window of its own.
    let now = NewJob::new("here", "v5").id("d");
    rt.block_on(client.enqueue(now, debounce)).expect("enqueue");
    wait_for("the delivery", Duration::from_secs(10), || {
        llen(&mut con, "q:here") == 1
    });
    let restart = redis_now_ms(&mut con);
    let far = NewJob::new("here", "v6").id("d").at(restart + 600_000);
    assert_eq!(
        rt.block_on(client.enqueue(far, debounce))
            .expect("enqueue")
            .1,
        Enqueued::Added
    );
    let capped = due_of("d");
    assert!(
        capped >= restart + 60_000 && capped < restart + 70_000,
        "a new window from the new first enqueue: due {capped}, enqueued at {restart}"
    );
    // Bad input: debounce through the CLI needs its max wait.
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "here",
        "--payload",
        "x",
        "--on-conflict",
        "debounce",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--max-wait"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn debounce_pushes_a_waiting_job_later_but_never_past_its_first_enqueue_plus_max_wait() {
    debounce_holds();
}

/// A route removed from the config keeps its lane in the registry, and no enqueue reaches its
/// windows set (nor a spread shard's when no enqueue asks for a window): a running daemon drops
/// the windows that ended there, in bounded calls, and keeps the live ones.
#[test]
fn a_removed_routes_ended_windows_are_dropped_by_the_daemon() {
    use zdelay::keys::{Keys, LaneKeys, slot_tag};
    let redis = RedisServer::start();
    let two_routes = r#"
[poller]
stats_interval = "200ms"

[[routes]]
name = "here"
sink = "local"
target = "q:here"

[[routes]]
name = "gone"
sink = "local"
target = "q:gone"
"#;
    let config = TestConfig::new(&redis.url(), 4, two_routes);
    drop(Daemon::start(&config));
    let mut con = redis.conn();
    let entry: String = redis::cmd("HGET")
        .arg("zdelay:lanes")
        .arg("r:gone")
        .query(&mut con)
        .expect("the route's lane is registered");
    let slot: u16 = entry.split(' ').nth(2).unwrap().parse().unwrap();
    let lane_windows = LaneKeys::new("zdelay", slot_tag(slot), "gone").windows;
    let shard_windows = Keys::new("zdelay", 4).shard(3).windows;
    let now = redis_now_ms(&mut con);
    for key in [&lane_windows, &shard_windows] {
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(key).arg(now + 3_600_000).arg("u:live");
        for i in 0..2_500i64 {
            zadd.arg(now - 60_000 + i).arg(format!("u:ended-{i}"));
        }
        let _: () = zadd.query(&mut con).unwrap();
    }

    let (here, _gone) = two_routes.split_at(two_routes.rfind("[[routes]]").unwrap());
    let only_here = TestConfig::new(&redis.url(), 4, here);
    let _daemon = Daemon::start(&only_here);
    for key in [&lane_windows, &shard_windows] {
        wait_for(
            &format!("the ended windows of {key} dropped"),
            Duration::from_secs(20),
            || {
                let left: Vec<String> = redis::cmd("ZRANGE")
                    .arg(key)
                    .arg(0)
                    .arg(-1)
                    .query(&mut redis.conn())
                    .unwrap();
                left == ["u:live"]
            },
        );
    }
}
