//! Route lanes end to end against real Redis and a real Redis Cluster: `zdelay run` registers
//! each local route's lane and moves it; the library enqueues into lanes with generated
//! (`~<lane>.<id>`) and user-chosen ids, and gets, cancels and reschedules by either; a route
//! changing between local and two-phase, and a namespace an older release left on layout 1,
//! are refused by name; a lane whose marker was lost is registered again; on a cluster a local
//! route is delivered exactly once through kill -9 of the daemon.

use crate::common::{
    self, Daemon, RedisCluster, RedisServer, TestConfig, lrange, redis_now_ms, wait_for,
};
use std::collections::BTreeMap;
use std::time::Duration;
use zdelay::config::RedisConfig;
use zdelay::{Client, ClientError, NewJob, OnConflict};

const ROUTES: &str = r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "lpush"
"#;

fn connect(rt: &tokio::runtime::Runtime, cfg: RedisConfig) -> Client {
    rt.block_on(Client::connect(&cfg))
        .expect("library client on the layout-2 namespace")
}

/// How often each `p<i>` payload is in `lists`.
fn delivered(lists: &[Vec<Vec<u8>>], total: usize) -> Vec<u32> {
    let mut counts = vec![0u32; total];
    for list in lists {
        for item in list {
            let text = String::from_utf8_lossy(item);
            let i: usize = text
                .strip_prefix('p')
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("unexpected item {text:?}"));
            counts[i] += 1;
        }
    }
    counts
}

fn assert_exactly_once(counts: &[u32]) {
    let missing: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] == 0).collect();
    let twice: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 1).collect();
    assert!(
        missing.is_empty() && twice.is_empty(),
        "{} missing (first {:?}), {} delivered more than once (first {:?})",
        missing.len(),
        &missing[..missing.len().min(10)],
        twice.len(),
        &twice[..twice.len().min(10)]
    );
}

#[test]
fn a_layout_2_namespace_delivers_each_route_from_its_lane() {
    const TOTAL: usize = 3_000;
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, ROUTES);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    // A producer with no layout in its config follows the namespace.
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let mut con = redis.conn();

    // Even jobs to a (generated ids), odd ones to b (user ids), due over 1.5 s in reverse
    // enqueue order; one far in the future stays.
    let base = redis_now_ms(&mut con) + 500;
    let jobs: Vec<NewJob> = (0..TOTAL)
        .map(|i| {
            let due = base + ((TOTAL - i) as i64 * 1_500 / TOTAL as i64);
            let job = NewJob::new(if i % 2 == 0 { "a" } else { "b" }, format!("p{i}")).at(due);
            if i % 2 == 0 {
                job
            } else {
                job.id(format!("user-{i}")).header("tenant", "t1")
            }
        })
        .collect();
    let answers = rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    let ids: Vec<String> = answers
        .into_iter()
        .map(|a| a.expect("each job enqueued").0)
        .collect();
    for (i, id) in ids.iter().enumerate() {
        if i % 2 == 0 {
            assert!(id.starts_with('~') && id.len() > 14, "generated id {id}");
        } else {
            assert_eq!(*id, format!("user-{i}"));
        }
    }
    let (far, _) = rt
        .block_on(lib.enqueue(
            NewJob::new("a", "far").after(Duration::from_secs(600)),
            OnConflict::Error,
        ))
        .expect("enqueue far");

    // A preview of a large payload is cut inside Redis; the size is the whole payload's.
    let (big, _) = rt
        .block_on(lib.enqueue(
            NewJob::new("b", vec![b'x'; 10_000]).after(Duration::from_secs(600)),
            OnConflict::Error,
        ))
        .expect("enqueue big");
    let view = rt
        .block_on(lib.get_preview(&big, 100))
        .expect("get_preview")
        .expect("stored");
    let envelope = view.envelope.as_ref().expect("readable");
    assert_eq!((envelope.payload.len(), view.payload_size), (100, 10_000));
    assert_eq!(
        rt.block_on(lib.cancel(&big)).expect("cancel big"),
        zdelay::Cancelled::Cancelled
    );
    // No layout-1 shard holds anything: the jobs are in their routes' lanes.
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).expect("KEYS");
    assert!(
        !keys
            .iter()
            .any(|k| k.starts_with("{zdelay:") && k.ends_with(":due")),
        "a layout-1 shard holds jobs: {keys:?}"
    );
    let tag_a = zdelay::keys::slot_tag(zdelay::keys::slot_of("q:a"));
    assert!(
        keys.contains(&format!("zdelay:{{{tag_a}}}:due:a")),
        "route a's lane is in q:a's slot: {keys:?}"
    );

    wait_for("every job delivered", Duration::from_secs(30), || {
        common::llen(&mut con, "q:a") + common::llen(&mut con, "q:b") >= TOTAL
    });
    let a = lrange(&mut con, "q:a");
    let b = lrange(&mut con, "q:b");
    assert_exactly_once(&delivered(&[a.clone(), b.clone()], TOTAL));
    // Each route's list got its own jobs, in due order (b is LPUSHed: reversed).
    let order = |list: &[Vec<u8>]| -> Vec<usize> {
        list.iter()
            .map(|p| String::from_utf8_lossy(&p[1..]).parse().expect("p<i>"))
            .collect()
    };
    let a_order = order(&a);
    assert!(a_order.iter().all(|i| i % 2 == 0), "only a's jobs in q:a");
    assert!(
        a_order.windows(2).all(|w| w[0] > w[1]),
        "q:a in due order (later index = earlier due)"
    );
    let mut b_order = order(&b);
    b_order.reverse();
    assert!(b_order.iter().all(|i| i % 2 == 1), "only b's jobs in q:b");
    assert!(b_order.windows(2).all(|w| w[0] > w[1]), "q:b in due order");
    // Moved per route, counted by route.
    assert_eq!(
        daemon.metric("zdelay_jobs_moved_total", &[("route", "a")]),
        (TOTAL / 2) as f64
    );

    // `zdelay stats` and the backlog gauges count the lanes (the far job waits in a's).
    let out = config.cli(&["stats", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    let lanes = stats["lanes"].as_array().expect("lanes in stats");
    let lane_a = lanes
        .iter()
        .find(|l| l["name"] == "a")
        .expect("route a's lane");
    assert_eq!(lane_a["scheduled"], 1, "{stats:#}");
    // The daemon registered the version it runs.
    assert_eq!(
        stats["instances"][0]["version"],
        zdelay::store::VERSION,
        "{stats:#}"
    );
    assert_eq!(lane_a["due_now"], 0, "{stats:#}");
    assert_eq!(stats["total"]["scheduled"], 1, "{stats:#}");
    // The spread shards (two-phase jobs) are counted too, and hold nothing here.
    let shards = stats["shards"].as_array().expect("shards");
    assert_eq!(shards.len(), 4, "{stats:#}");
    assert!(shards.iter().all(|b| b["scheduled"] == 0), "{stats:#}");
    let out = config.cli(&["forecast", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let forecast: serde_json::Value = serde_json::from_slice(&out.stdout).expect("forecast JSON");
    let ahead: u64 = forecast["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| {
            s["by_route"]["a"]
                .as_u64()
                .expect("route a counted per step")
        })
        .sum();
    assert_eq!(ahead, 1, "the far job, due in 10 minutes: {forecast:#}");
    assert_eq!(forecast["overdue_by_route"]["a"], 0, "{forecast:#}");
    let text = String::from_utf8_lossy(&config.cli(&["stats"]).stdout).into_owned();
    assert!(
        text.contains("route lane a: 0 due now, 1 scheduled"),
        "{text}"
    );
    wait_for(
        "the daemon's gauge of route a's lane",
        Duration::from_secs(15),
        || daemon.metric("zdelay_scheduled", &[("route", "a")]) == 1.0,
    );

    // The far job waits in its lane: get, reschedule and cancel by its generated id.
    let view = rt
        .block_on(lib.get(&far))
        .expect("get")
        .expect("the far job is stored");
    assert_eq!(view.state, zdelay::JobState::Scheduled);
    assert_eq!(view.envelope.as_ref().expect("readable").dest, "a");
    let json = view.to_json();
    assert_eq!(json["payload"], "far");
    assert!(
        json.get("lane").is_some() && json.get("shard").is_none(),
        "{json}"
    );
    let soon = redis_now_ms(&mut con) + 300;
    let moved = rt
        .block_on(lib.reschedule(&far, zdelay::Due::At(soon)))
        .expect("reschedule");
    assert_eq!(moved, Some(soon));
    wait_for(
        "the rescheduled job delivered",
        Duration::from_secs(10),
        || lrange(&mut con, "q:a").last().map(Vec::as_slice) == Some(b"far".as_slice()),
    );
    assert!(rt.block_on(lib.get(&far)).expect("get").is_none());
    assert_eq!(
        rt.block_on(lib.cancel(&far)).expect("cancel"),
        zdelay::Cancelled::NotPending
    );

    // Lane b is empty in the gauges now; a write to it shows there within a stats interval
    // or two: its wake-up tells the sampler to look (idle lanes are otherwise probed only
    // once a minute).
    wait_for(
        "lane b empty in the gauges",
        Duration::from_secs(15),
        || daemon.metric("zdelay_scheduled", &[("route", "b")]) == 0.0,
    );
    rt.block_on(
        lib.enqueue(
            NewJob::new("b", "gauged")
                .id("gauged-1")
                .after(Duration::from_secs(600)),
            OnConflict::Error,
        ),
    )
    .expect("enqueue gauged-1");
    wait_for(
        "the gauge of lane b counts the new job",
        Duration::from_secs(15),
        || daemon.metric("zdelay_scheduled", &[("route", "b")]) == 1.0,
    );
    assert_eq!(
        rt.block_on(lib.cancel("gauged-1")).expect("cancel"),
        zdelay::Cancelled::Cancelled
    );

    // A user-chosen id, found by asking every lane; cancelled before it is due.
    rt.block_on(
        lib.enqueue(
            NewJob::new("b", "late")
                .id("order-7")
                .after(Duration::from_secs(600)),
            OnConflict::Error,
        ),
    )
    .expect("enqueue order-7");
    let view = rt
        .block_on(lib.get("order-7"))
        .expect("get")
        .expect("stored");
    assert_eq!(view.envelope.as_ref().expect("readable").dest, "b");
    assert_eq!(
        rt.block_on(lib.cancel("order-7")).expect("cancel"),
        zdelay::Cancelled::Cancelled
    );
    assert!(rt.block_on(lib.get("order-7")).expect("get").is_none());

    // The same user id in two routes' lanes: found in both, so refused by id alone.
    for dest in ["a", "b"] {
        rt.block_on(
            lib.enqueue(
                NewJob::new(dest, "twice")
                    .id("dup-1")
                    .after(Duration::from_secs(600)),
                OnConflict::Error,
            ),
        )
        .expect("enqueue dup-1");
    }
    let err = rt.block_on(lib.cancel("dup-1")).expect_err("ambiguous");
    assert!(
        matches!(&err, ClientError::AmbiguousId { routes, .. } if routes == &["a", "b"]),
        "{err}"
    );
    assert!(err.to_string().contains("routes a and b"), "{err}");
    // With its destination it is found in one call: the library and the CLI.
    let in_a = rt
        .block_on(lib.get_in("a", "dup-1"))
        .expect("get_in")
        .expect("stored for a");
    assert!(in_a.lane.is_some(), "{in_a:?}");
    assert_eq!(in_a.envelope.as_ref().expect("readable").dest, "a");
    assert_eq!(
        rt.block_on(lib.cancel_in("b", "dup-1")).expect("cancel_in"),
        zdelay::Cancelled::Cancelled
    );
    let out = config.cli(&["get", "dup-1", "--dest", "a", "--json"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && shown.contains("\"dest\": \"a\""),
        "{shown}"
    );
    let out = config.cli(&["cancel", "dup-1"]);
    assert!(
        out.status.success(),
        "only a holds it now: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = rt
        .block_on(lib.cancel_in("nowhere", "dup-1"))
        .expect_err("an unknown destination");
    assert!(
        matches!(err, ClientError::NoLane { .. }) && err.is_retryable(),
        "{err}"
    );

    // Refused, with the reason, writing nothing.
    let err = rt
        .block_on(lib.enqueue(NewJob::new("a", "x").id("~1.abc"), OnConflict::Error))
        .expect_err("a reserved id");
    assert!(matches!(err, ClientError::ReservedId(_)), "{err}");
    let err = rt
        .block_on(lib.enqueue(NewJob::new("nowhere", "x"), OnConflict::Error))
        .expect_err("a destination without a lane");
    assert!(err.to_string().contains("no route lane"), "{err}");
    let err = rt
        .block_on(lib.get("~zz.short"))
        .expect_err("not a generated id");
    assert!(matches!(err, ClientError::Id(_)), "{err}");
    // The spread shards reshard online; the route lanes stay where they are.
    let lanes = |con: &mut redis::Connection| {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg("zdelay:{*}:lane:*")
            .query(con)
            .unwrap();
        keys.sort();
        keys
    };
    let lanes_before = lanes(&mut con);
    assert_eq!(lanes_before.len(), 2, "{lanes_before:?}");
    let out = config.cli(&["reshard", "--to", "8", "--yes"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "reshard: {stderr}");
    assert!(stderr.contains("fenced"), "{stderr}");
    assert_eq!(lanes(&mut con), lanes_before);
    // The daemon's own readers (the stats sampler) never hit a layout-1 shard's refusal.
    let log = daemon.log_text();
    assert!(
        !log.contains("ZDELAY_LAYOUT") && !log.contains("stats sampler"),
        "{log}"
    );
    drop(daemon);
}

#[test]
fn dead_letters_of_route_lanes_are_listed_shown_replayed_and_purged() {
    use zdelay::dead::{DeadFilter, DeadSelection, ReplayOptions};
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, ROUTES);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let mut con = redis.conn();
    // b's list is not a list: its jobs die with WRONGTYPE; a's jobs die expired.
    let _: () = redis::cmd("SET")
        .arg("q:b")
        .arg("x")
        .query(&mut con)
        .unwrap();
    let past = redis_now_ms(&mut con) - 60_000;
    let expired = |id: Option<&str>, payload: &str| {
        let job = NewJob::new("a", payload.to_owned())
            .at(past)
            .max_lateness(Duration::from_secs(1))
            .header("tenant", "t1");
        match id {
            Some(id) => job.id(id),
            None => job,
        }
    };
    let enqueue = |job: NewJob| {
        rt.block_on(lib.enqueue(job, OnConflict::Error))
            .expect("enqueue")
            .0
    };
    let gen_a = enqueue(expired(None, "pa0"));
    enqueue(expired(Some("exp-1"), "pa1"));
    enqueue(expired(Some("dup-d"), "pa2"));
    let gen_b = enqueue(NewJob::new("b", "pb0"));
    enqueue(NewJob::new("b", "pb1").id("wt-1"));
    enqueue(NewJob::new("b", "pb2").id("dup-d"));
    // A listing takes the jobs that died before Redis's clock of the call: wait for it.
    wait_for("six dead letters", Duration::from_secs(10), || {
        rt.block_on(lib.operator().dead_list(100)).unwrap().len() == 6
    });
    assert_eq!(
        rt.block_on(lib.operator().dead_counts())
            .unwrap()
            .iter()
            .sum::<u64>(),
        6
    );
    let dead = rt
        .block_on(lib.operator().dead_list(100))
        .expect("dead list");
    for job in &dead {
        let route = job.route.as_deref().expect("a lane job's route");
        assert!(job.lane.is_some(), "{job:?}");
        let why = if route == "a" { "expired" } else { "WRONGTYPE" };
        assert!(job.reason.contains(why), "{job:?}");
        assert_eq!(job.payload_size, Some(3), "{job:?}");
    }
    let ids: Vec<&str> = dead.iter().map(|j| j.id.as_str()).collect();
    for id in [gen_a.as_str(), gen_b.as_str(), "exp-1", "wt-1"] {
        assert!(ids.contains(&id), "{id} not among {ids:?}");
    }
    // Shown by generated id and by user id, with headers and payload; an id two lanes hold
    // is refused by name.
    let shown = rt
        .block_on(lib.operator().dead_show("exp-1"))
        .expect("show")
        .expect("dead");
    assert_eq!(
        (shown.job.route.as_deref(), shown.payload.as_slice()),
        (Some("a"), &b"pa1"[..])
    );
    assert_eq!(shown.headers.get("tenant").map(String::as_str), Some("t1"));
    let shown = rt
        .block_on(lib.operator().dead_show(&gen_b))
        .expect("show")
        .expect("dead");
    assert_eq!(shown.payload, b"pb0");
    let err = rt
        .block_on(lib.operator().dead_show("dup-d"))
        .expect_err("two lanes");
    assert!(
        matches!(&err, ClientError::AmbiguousId { routes, .. } if routes == &["a", "b"]),
        "{err}"
    );
    // With its destination it is found in one call.
    let in_b = rt
        .block_on(lib.operator().dead_show_at(Some("b"), "dup-d"))
        .expect("show in b")
        .expect("dead in b");
    assert_eq!(in_b.payload, b"pb2");
    let out = config.cli(&["dead", "show", "dup-d", "--dest", "a", "--json"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && shown.contains("pa2"), "{shown}");
    // The CLI and the console list them with their lanes.
    let out = config.cli(&["dead", "list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        listed.contains("\"lane\"") && listed.contains(&gen_a),
        "{listed}"
    );
    let out = config.cli(&["dead", "show", "exp-1"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("lane ") && !shown.contains("shard"),
        "{shown}"
    );
    let (status, body) = daemon.admin_get("/api/dead").expect("console API");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("exp-1") && body.contains("\"lane\""),
        "{body}"
    );

    // Replay b's by route once its list is a list again: delivered once each.
    let _: () = redis::cmd("DEL").arg("q:b").query(&mut con).unwrap();
    let route_b = DeadFilter {
        route: Some("b".into()),
        ..DeadFilter::default()
    };
    let replayed = rt
        .block_on(lib.operator().dead_replay_selected(
            &DeadSelection::Matching(route_b),
            ReplayOptions::default(),
            |_| {},
        ))
        .expect("replay b");
    assert_eq!(
        (replayed.replayed, replayed.skipped),
        (3, 0),
        "{replayed:?}"
    );
    wait_for("b's three delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:b").len() == 3
    });
    // Replayed by id: its max lateness went when it died, so it is delivered now.
    let r = rt
        .block_on(
            lib.operator()
                .dead_replay(&["exp-1".to_owned(), "no-such".to_owned()]),
        )
        .expect("replay exp-1");
    assert_eq!((r.replayed, r.skipped), (1, 1), "{r:?}");
    wait_for("exp-1 delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:a") == [b"pa1".to_vec()]
    });
    // Purged: one by its generated id, the rest by filter; nothing of them is left.
    assert_eq!(
        rt.block_on(lib.operator().dead_purge(std::slice::from_ref(&gen_a)))
            .unwrap(),
        1
    );
    assert_eq!(rt.block_on(lib.operator().dead_purge(&[])).unwrap(), 1);
    assert_eq!(
        rt.block_on(lib.operator().dead_counts())
            .unwrap()
            .iter()
            .sum::<u64>(),
        0
    );
    let mut left: Vec<String> = Vec::new();
    for kind in [
        "jobs", "meta", "dead", "reasons", "history", "due", "maxlate", "large",
    ] {
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(format!("zdelay:{{*}}:{kind}:*"))
            .query(&mut con)
            .unwrap();
        left.extend(found);
    }
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(lrange(&mut con, "q:b").len(), 3, "nothing delivered twice");
    drop(daemon);
}

#[test]
fn schedules_live_and_fire_in_their_destinations_lanes() {
    use zdelay::schedules::{NewSchedule, Repeat};
    let redis = RedisServer::start();
    // Each occurrence written at its time: the schedule stays pending (counted below) until
    // its first one.
    let routes = ROUTES.replacen("[poller]\n", "[poller]\nfire_ahead = \"0s\"\n", 1);
    let config = TestConfig::new(&redis.url(), 4, &routes);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let mut con = redis.conn();
    // Five occurrences 200 ms apart, from half a second on: then the schedule ends.
    let base = redis_now_ms(&mut con) + 500;
    // A schedule id may start with `~` (only job ids are generated in that form).
    let tilde = NewSchedule::new(
        "~hourly",
        "b",
        "h",
        Repeat::Every(Duration::from_secs(3600)),
    );
    rt.block_on(lib.schedule_set(tilde))
        .expect("a ~ schedule id");
    assert!(
        rt.block_on(lib.schedule_delete("~hourly"))
            .expect("delete it")
    );
    let mut spec = NewSchedule::new("tick", "a", "t", Repeat::Every(Duration::from_millis(200)));
    spec.start_at = Some(base);
    spec.end_at = Some(base + 900);
    spec.headers.insert("tenant".into(), "t1".into());
    let set = rt
        .block_on(lib.schedule_set(spec.clone()))
        .expect("schedule set");
    assert!(set.created);
    assert_eq!(set.next_ms, Some(base));
    // It is kept in route a's lane, in the slot of a's list.
    let tag = zdelay::keys::slot_tag(zdelay::keys::slot_of("q:a"));
    let sched_key = format!("zdelay:{{{tag}}}:sched:a");
    let held: bool = redis::cmd("HEXISTS")
        .arg(&sched_key)
        .arg("tick")
        .query(&mut con)
        .unwrap();
    assert!(held, "{sched_key} holds tick");
    let view = rt
        .block_on(lib.schedule_get("tick"))
        .expect("get")
        .expect("stored");
    assert!(view.lane.is_some() && view.to_json().get("shard").is_none());
    assert_eq!(view.dest, "a");
    let counts = rt
        .block_on(lib.operator().schedule_counts())
        .expect("counts");
    assert_eq!((counts.schedules, counts.pending), (1, 1));
    // Its id cannot move to another route's lane by a set.
    let mut elsewhere = spec.clone();
    elsewhere.dest = "b".into();
    let err = rt
        .block_on(lib.schedule_set(elsewhere))
        .expect_err("another route");
    assert!(
        matches!(&err, ClientError::ScheduleElsewhere { route, .. } if route == "a"),
        "{err}"
    );
    // The daemon fires each occurrence into the lane and moves it: five, each once, then
    // the schedule has ended.
    wait_for(
        "five occurrences delivered",
        Duration::from_secs(10),
        || lrange(&mut con, "q:a").len() >= 5,
    );
    wait_for("the schedule ended", Duration::from_secs(10), || {
        rt.block_on(lib.schedule_get("tick"))
            .unwrap()
            .is_some_and(|v| v.next_ms.is_none())
    });
    assert_eq!(lrange(&mut con, "q:a"), vec![b"t".to_vec(); 5]);
    // Run now: one more, off the grid.
    let run = rt
        .block_on(lib.operator().schedule_run_now("tick"))
        .expect("run now")
        .expect("a schedule");
    assert!(run.starts_with("{tick}:") && run.ends_with(":run"), "{run}");
    wait_for("the run delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:a").len() == 6
    });
    // Listed by the CLI and the console, with its lane.
    let out = config.cli(&["schedule", "list", "--json"]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && listed.contains("\"lane\""),
        "{listed}"
    );
    let (status, body) = daemon.admin_get("/api/schedules").expect("console API");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("tick"), "{body}");
    // Paused, resumed and deleted by id alone: found in its lane.
    assert!(rt.block_on(lib.schedule_pause("tick")).expect("pause"));
    assert!(
        rt.block_on(lib.schedule_get("tick"))
            .unwrap()
            .is_some_and(|v| v.paused)
    );
    assert!(
        rt.block_on(lib.schedule_resume("tick"))
            .expect("resume")
            .is_some()
    );
    assert!(rt.block_on(lib.schedule_delete("tick")).expect("delete"));
    assert!(rt.block_on(lib.schedule_get("tick")).unwrap().is_none());
    assert!(
        !rt.block_on(lib.schedule_delete("tick"))
            .expect("delete again")
    );
    assert_eq!(lrange(&mut con, "q:a").len(), 6, "nothing delivered twice");
    let log = daemon.log_text();
    assert!(
        !log.contains("ZDELAY_LAYOUT") && !log.contains("ERROR"),
        "{log}"
    );
    drop(daemon);
}

/// Two-phase routes on layout 2: their jobs wait in the spread shards (layout 1's shard keys
/// at evenly spread slots) and go through claim, publish and fenced settle, here to a remote
/// Redis; local routes keep their lanes. Ids, cancel, get and schedules find either.
#[test]
fn two_phase_routes_go_through_the_spread_shards() {
    use zdelay::schedules::{NewSchedule, Repeat};
    const TOTAL: usize = 1_000;
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
push = "rpush"
"#,
            target.url()
        ),
    );
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let (mut con, mut far) = (redis.conn(), target.conn());
    let base = redis_now_ms(&mut con) + 700;
    let jobs: Vec<NewJob> = (0..TOTAL)
        .map(|i| {
            let job = NewJob::new(if i % 2 == 0 { "a" } else { "m" }, format!("p{i}"))
                .at(base + (i as i64 % 300));
            if i % 4 == 1 {
                job.id(format!("m-{i}"))
            } else {
                job
            }
        })
        .collect();
    let ids: Vec<String> = rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
        .into_iter()
        .map(|a| a.expect("each enqueued").0)
        .collect();
    // Local jobs got lane ids; two-phase ones layout 1's ids, in the spread shards.
    assert!(
        ids[0].starts_with('~') && !ids[3].starts_with('~'),
        "{ids:?}"
    );
    let spread: Vec<String> = redis::cmd("KEYS")
        .arg("zdelay:{*}:s*:due")
        .query(&mut con)
        .expect("KEYS");
    assert!(
        !spread.is_empty(),
        "no spread shard holds the two-phase jobs"
    );
    let keys = zdelay::keys::Keys::new("zdelay", 4);
    for key in &spread {
        let shard: u16 = key.rsplit(':').nth(1).unwrap()[1..].parse().unwrap();
        assert_eq!(key, &keys.due(shard));
        assert_eq!(
            zdelay::keys::slot_of(key),
            zdelay::keys::spread_slot(shard, 4)
        );
    }
    // By id: a two-phase job is found in its spread shard, and one is cancelled.
    let view = rt.block_on(lib.get("m-1")).expect("get").expect("stored");
    assert_eq!(view.envelope.as_ref().expect("readable").dest, "m");
    assert_eq!(view.lane, None);
    let by_dest = rt.block_on(lib.get_in("m", "m-1")).expect("get_in");
    assert_eq!(by_dest.map(|v| v.id), Some("m-1".to_owned()));
    assert_eq!(
        rt.block_on(lib.cancel("m-5")).expect("cancel"),
        zdelay::Cancelled::Cancelled
    );
    let err = rt
        .block_on(lib.enqueue(NewJob::new("nowhere", "x"), OnConflict::Error))
        .expect_err("not a route");
    assert!(err.to_string().contains("has no route lane yet"), "{err}");
    // A schedule to the two-phase route lives in its id's spread shard: three occurrences.
    let sched_base = redis_now_ms(&mut con) + 400;
    let mut spec = NewSchedule::new("t", "m", "tick", Repeat::Every(Duration::from_millis(200)));
    spec.start_at = Some(sched_base);
    spec.end_at = Some(sched_base + 500);
    rt.block_on(lib.schedule_set(spec)).expect("schedule set");
    let view = rt
        .block_on(lib.schedule_get("t"))
        .unwrap()
        .expect("schedule");
    assert_eq!(view.lane, None);

    let expected_m = TOTAL / 2 - 1 + 3;
    wait_for("every job delivered", Duration::from_secs(20), || {
        lrange(&mut con, "q:a").len() == TOTAL / 2 && lrange(&mut far, "q:m").len() >= expected_m
    });
    let local = lrange(&mut con, "q:a");
    let remote = lrange(&mut far, "q:m");
    let mut seen = std::collections::BTreeMap::new();
    for item in local.iter().chain(&remote) {
        *seen
            .entry(String::from_utf8_lossy(item).into_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(seen.get("tick"), Some(&3), "three occurrences");
    assert_eq!(seen.get("p5"), None, "the cancelled job");
    let twice: Vec<_> = seen
        .iter()
        .filter(|(k, n)| **n > 1 && *k != "tick")
        .collect();
    assert!(twice.is_empty(), "delivered twice with no fault: {twice:?}");
    assert_eq!(seen.len(), TOTAL - 1 + 1, "every job once, and the ticks");
    assert_eq!(
        daemon.metric("zdelay_jobs_moved_total", &[("route", "a")]),
        (TOTAL / 2) as f64
    );
    let log = daemon.log_text();
    assert!(
        !log.contains("ZDELAY_") && !log.contains("CROSSSLOT"),
        "{log}"
    );
    drop(daemon);
}

/// Raw sources work as on layout 1: members `ZADD`ed by any client reach the route's list.
#[test]
fn a_raw_source_delivers_on_layout_2() {
    let redis = RedisServer::start();
    let routes = format!("{ROUTES}\n[[sources]]\nkey = \"delayed:a\"\nroute = \"a\"\n");
    let config = TestConfig::new(&redis.url(), 4, &routes);
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    for i in 0..50 {
        let _: () = redis::cmd("ZADD")
            .arg("delayed:a")
            .arg(now + 200 + i)
            .arg(format!("r{i}"))
            .query(&mut con)
            .unwrap();
    }
    wait_for("the raw members delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:a").len() == 50
    });
    let expected: Vec<Vec<u8>> = (0..50).map(|i| format!("r{i}").into_bytes()).collect();
    assert_eq!(lrange(&mut con, "q:a"), expected, "in due order, once each");
    drop(daemon);
}

/// Route lanes are dealt in poll groups named by their members: two daemons whose configs
/// differ (a rolling change: one has routes the other lacks) register different names for a
/// group they hold different lanes of, so every lane is polled whichever holds what.
#[test]
fn daemons_with_different_routes_leave_no_lane_unpolled() {
    let routes = |n: usize| -> String {
        // One daemon a slot: with two, both would poll every group anyway.
        let mut text = String::from("[poller]\nidle_poll = \"50ms\"\nper_shard = 1\n");
        for i in 0..n {
            text.push_str(&format!(
                "\n[[routes]]\nname = \"r{i}\"\nsink = \"local\"\ntarget = \"q:r{i}\"\n"
            ));
        }
        text
    };
    let redis = RedisServer::start();
    // The first registers 70 lanes (numbers 0 to 69: group 0 holds lanes 0 and 64), the
    // second knows the first 64 routes only (group 0: lane 0 alone).
    let wide = TestConfig::new(&redis.url(), 4, &routes(70));
    let narrow = TestConfig::new(&redis.url(), 4, &routes(64));
    let first = Daemon::start(&wide);
    let second = Daemon::start(&narrow);
    // Until the heartbeats have dealt the groups out, the first daemon still polls them all.
    wait_for(
        "the groups dealt to both daemons",
        Duration::from_secs(15),
        || {
            let out = wide.cli(&["stats", "--json"]);
            let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let held: Vec<Vec<String>> = stats["instances"]
                .as_array()
                .map(|all| {
                    all.iter()
                        .map(|i| {
                            i["sources"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .filter_map(|s| s.as_str())
                                .filter(|s| s.starts_with("lanes:"))
                                .map(str::to_owned)
                                .collect()
                        })
                        .collect()
                })
                .unwrap_or_default();
            let distinct: std::collections::BTreeSet<&String> = held.iter().flatten().collect();
            held.len() == 2
                && held.iter().all(|h| !h.is_empty())
                && distinct.len() == held.iter().map(Vec::len).sum::<usize>()
        },
    );
    // The first daemon follows the plan at its next heartbeat, which it logs.
    wait_for(
        "the first daemon rebalanced",
        Duration::from_secs(15),
        || {
            first
                .log_text()
                .lines()
                .any(|l| l.contains("poller slots rebalanced") && l.contains("instances=2"))
        },
    );
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let mut con = redis.conn();
    // Lanes 64 to 69 share groups 0 to 5 with lanes the second daemon also has.
    let sent = ["r0", "r1", "r64", "r65", "r66", "r67", "r68", "r69"];
    for route in sent {
        rt.block_on(lib.enqueue(NewJob::new(route, route.to_owned()), OnConflict::Error))
            .expect("enqueue");
    }
    wait_for(
        "every route's job delivered",
        Duration::from_secs(15),
        || {
            sent.iter()
                .all(|r| lrange(&mut con, &format!("q:{r}")) == [r.as_bytes().to_vec()])
        },
    );
    drop((first, second));
}

#[test]
fn a_daemon_moves_a_lane_registered_again_by_another_config() {
    use zdelay::store::{Conn, lanes};
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, ROUTES);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let mut con = redis.conn();
    let enqueue = |payload: &str| {
        rt.block_on(lib.enqueue(NewJob::new("a", payload.to_owned()), OnConflict::Error))
            .expect("enqueue");
    };
    enqueue("p0");
    wait_for("p0 delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:a") == [b"p0".to_vec()]
    });
    // Another daemon's config (as in a rolling change) points route a at another list in the
    // same slot, pushed from the other end: the lane stays, its marker changes.
    let moved_list = "{q:a}:v2";
    let mut lcon = rt
        .block_on(Conn::connect(&common::redis_config(&redis.url(), 4)))
        .expect("connect");
    let (lane, _) = rt
        .block_on(lanes::register(
            &mut lcon,
            &zdelay::keys::Keys::new("zdelay", 4),
            "a",
            moved_list,
            zdelay::config::Push::Lpush,
        ))
        .expect("register again");
    assert_eq!(lane.list, moved_list);
    enqueue("p1");
    enqueue("p2");
    // The running daemon's mover was refused by the new marker: it reads the registry and
    // moves the lane as registered now.
    wait_for(
        "p1 and p2 delivered by the new marker",
        Duration::from_secs(10),
        || lrange(&mut con, moved_list) == [b"p2".to_vec(), b"p1".to_vec()],
    );
    assert_eq!(lrange(&mut con, "q:a"), [b"p0".to_vec()]);
    let log = daemon.log_text();
    assert!(log.contains("registered again"), "{log}");
    drop(daemon);
}

#[test]
fn a_route_changing_kind_and_a_layout_1_namespace_are_refused_by_name() {
    let redis = RedisServer::start();
    // A route that changes between local and two-phase: its waiting jobs would stay where
    // nothing moves them, so the daemon refuses to start, naming the route.
    let target = RedisServer::start();
    let local = TestConfig::new(&redis.url(), 4, ROUTES);
    drop(Daemon::start(&local));
    let changed = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "a"
sink = "other"
target = "q:a"
"#,
            target.url()
        ),
    );
    let mut daemon = Daemon::spawn(&changed);
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert!(!status.success());
    let log = daemon.log_text();
    assert!(
        log.contains("route a was local (a route lane)") && log.contains("new name"),
        "{log}"
    );

    // A namespace an older release left on layout 1 (its schema, one waiting job in a
    // layout-1 shard) is refused by the daemon, the CLI and the library with one line naming
    // `zdelay upgrade`, also while an upgrade runs; nothing is written. A config that asks
    // for layout 1 is refused when it is read.
    let rt = common::runtime();
    let redis = RedisServer::start();
    let mut con = redis.conn();
    let legacy = zdelay::keys::Keys::new("zdelay", 4).layout_1().shard(0);
    let _: () = redis::pipe()
        .hset("zdelay:schema", "layout", 1)
        .hset("zdelay:schema", "shards", 4)
        .zadd(&legacy.due, "old-1", 1)
        .hset(&legacy.jobs, "old-1", "zd1:a\n0\nx")
        .query(&mut con)
        .unwrap();
    let config = TestConfig::new(&redis.url(), 4, ROUTES);
    for upgrading in [false, true] {
        if upgrading {
            let _: () = redis::cmd("HSET")
                .arg("zdelay:schema")
                .arg("upgrading")
                .arg(2)
                .query(&mut con)
                .unwrap();
        }
        let before = common::all_keys(&mut con);
        let mut daemon = Daemon::spawn(&config);
        let status = daemon.wait_exit(Duration::from_secs(20));
        assert!(!status.success());
        let log = daemon.log_text();
        let said = if upgrading {
            "is being moved off storage layout 1 by zdelay upgrade"
        } else {
            "is on storage layout 1, which this zdelay"
        };
        assert!(
            log.contains(said) && log.contains("zdelay upgrade"),
            "{log}"
        );
        let out = config.cli(&["enqueue", "--dest", "a", "--payload", "x"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said) && err.lines().count() == 1, "{err}");
        let refused = rt
            .block_on(Client::attach(&common::redis_config(&redis.url(), 4)))
            .err()
            .expect("refused");
        assert!(!refused.is_retryable(), "{refused}");
        assert!(refused.to_string().contains(said), "{refused}");
        assert_eq!(common::all_keys(&mut con), before, "nothing written");
    }
    let config = TestConfig::new(&redis.url(), 4, ROUTES).with_layout(1);
    let out = config.cli(&["check-config"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("redis.layout") && err.contains("zdelay upgrade"),
        "{err}"
    );
}

/// A lane's marker lost while the lane is empty (a failover to a replica that had not received
/// it yet, or the key deleted): producers are refused, retryable and writing nothing, so the
/// lane stays empty and nothing is due in it; only the daemon's idle look at the lane can
/// notice. It registers the lane again within its idle polls, and the producer's next call
/// goes through and is delivered.
#[test]
fn an_empty_lane_whose_marker_was_lost_is_registered_again() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, ROUTES);
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let marker = common::lane_keys("a", "q:a").marker;
    let exists = |con: &mut redis::Connection| -> bool {
        redis::cmd("EXISTS").arg(&marker).query(con).unwrap()
    };
    wait_for("the lane registered", Duration::from_secs(10), || {
        exists(&mut con)
    });
    let _: () = redis::cmd("DEL").arg(&marker).query(&mut con).unwrap();
    let rt = common::runtime();
    let lib = connect(&rt, common::redis_config(&redis.url(), 4));
    let refused = rt
        .block_on(lib.enqueue(NewJob::new("a", "before"), OnConflict::Error))
        .expect_err("refused while the lane has no marker");
    assert!(
        refused.is_retryable() && refused.to_string().contains("ZDELAY_NO_LANE"),
        "{refused}"
    );
    wait_for(
        "the daemon registered the lane again",
        Duration::from_secs(15),
        || exists(&mut con),
    );
    rt.block_on(lib.enqueue(NewJob::new("a", "after"), OnConflict::Error))
        .expect("accepted once the lane is registered again");
    wait_for("delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:a") == [b"after".to_vec()]
    });
    let log = daemon.log_text();
    assert!(log.contains("registering the lanes again"), "{log}");
}

/// On a cluster a local route's lane sits in its list's slot, so the move is one script
/// there too: 21,000 jobs for two local routes on two masters and a two-phase one, the daemon
/// killed with SIGKILL three times mid-drain; every local job delivered exactly once, every
/// two-phase one at least once, and no command crossed slots.
#[test]
fn on_a_cluster_lanes_deliver_exactly_once_through_kill_9() {
    const TOTAL: usize = 21_000;
    let cluster = RedisCluster::start();
    // A third route is two-phase (to another Redis): its jobs wait in the spread shards.
    let remote = RedisServer::start();
    let routes = format!(
        "{ROUTES}\n[sinks.other]\nkind = \"redis\"\nurl = \"{}\"\n\n[[routes]]\nname = \"m\"\nsink = \"other\"\ntarget = \"q:m\"\n",
        remote.url()
    );
    let config = cluster.config(4, &routes);
    assert_ne!(
        cluster.master_of("q:a"),
        cluster.master_of("q:b"),
        "the two routes' lists are on two masters"
    );
    // The first daemon registers the lanes.
    let mut daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = connect(&rt, cluster.redis_config(4));
    let mut con = cluster.conn();
    let mut far = remote.conn();
    let now = common::redis_now_ms_any(&mut con);
    // Due over 2 s from 1 s ahead: the daemon is killed both while following the front and
    // while draining a backlog.
    let jobs: Vec<NewJob> = (0..TOTAL)
        .map(|i| {
            NewJob::new(["a", "b", "m"][i % 3], format!("p{i}"))
                .at(now + 1_000 + (i as i64 * 2_000 / TOTAL as i64))
        })
        .collect();
    for answer in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
    {
        answer.expect("each job enqueued");
    }
    let count = |con: &mut redis::cluster::ClusterConnection, far: &mut redis::Connection| {
        ["q:a", "q:b"]
            .iter()
            .map(|l| redis::cmd("LLEN").arg(l).query::<usize>(con).expect("LLEN"))
            .sum::<usize>()
            + redis::cmd("LLEN")
                .arg("q:m")
                .query::<usize>(far)
                .expect("LLEN")
    };
    let mut kills = Vec::new();
    for k in 1..=3usize {
        let target = TOTAL * k / 5;
        wait_for(
            &format!("progress past {target}"),
            Duration::from_secs(30),
            || count(&mut con, &mut far) >= target,
        );
        assert!(
            !daemon.log_text().contains("CROSSSLOT"),
            "{}",
            daemon.log_text()
        );
        daemon.kill9();
        kills.push(count(&mut con, &mut far));
        daemon = Daemon::spawn(&config);
    }
    // Counted by distinct payloads: a two-phase job claimed by a killed daemon comes back
    // once its lease runs out, after redeliveries of others may have been counted.
    let distinct = |far: &mut redis::Connection| {
        lrange(far, "q:m")
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    wait_for("every job delivered", Duration::from_secs(90), || {
        count(&mut con, &mut far) >= TOTAL && distinct(&mut far) == TOTAL / 3
    });
    let mut lists: Vec<Vec<Vec<u8>>> = ["q:a", "q:b"]
        .iter()
        .map(|l| {
            redis::cmd("LRANGE")
                .arg(l)
                .arg(0)
                .arg(-1)
                .query(&mut con)
                .expect("LRANGE")
        })
        .collect();
    let local = delivered(&lists, TOTAL);
    let local: Vec<u32> = (0..TOTAL)
        .filter(|i| i % 3 != 2)
        .map(|i| local[i])
        .collect();
    assert_exactly_once(&local);
    // The two-phase route: at least once, the redeliveries bounded and reported.
    lists = vec![lrange(&mut far, "q:m")];
    let two_phase = delivered(&lists, TOTAL);
    let missing = (0..TOTAL)
        .filter(|i| i % 3 == 2 && two_phase[*i] == 0)
        .count();
    let again: u32 = two_phase.iter().map(|n| n.saturating_sub(1)).sum();
    assert_eq!(missing, 0, "two-phase jobs lost");
    assert!(again <= 3 * 1000, "{again} redeliveries through 3 kills");
    let log = daemon.log_text();
    assert!(
        !log.contains("CROSSSLOT") && !log.contains("crossed slots"),
        "{log}"
    );
    // Nothing left in the lanes.
    let mut left = BTreeMap::new();
    for route in ["a", "b"] {
        let list = format!("q:{route}");
        let tag = zdelay::keys::slot_tag(zdelay::keys::slot_of(&list));
        let n: usize = redis::cmd("ZCARD")
            .arg(format!("zdelay:{{{tag}}}:due:{route}"))
            .query(&mut con)
            .expect("ZCARD");
        left.insert(route, n);
    }
    assert!(left.values().all(|n| *n == 0), "{left:?}");
    eprintln!("killed at {kills:?} of {TOTAL}; two-phase redeliveries: {again}");
}
