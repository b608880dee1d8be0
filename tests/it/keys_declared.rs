//! Every key a script touches is declared in its KEYS. Redis only enforces that on a cluster
//! and only across slots; this test enforces it everywhere: it runs every script of the
//! product (daemon, library, CLI) against a Redis under `MONITOR`, which prints each script
//! call followed by the commands the script ran, asks the server which arguments of each of
//! those commands are keys (`COMMAND GETKEYS`), and fails on any key the call did not declare.
//! The layout-1 namespace that `zdelay upgrade` reads is the older release's work: its script
//! calls are checked too, but only this build's own, from the upgrade on, count as having run
//! a script of the product.

use crate::common::{
    Daemon, RedisServer, TestConfig, pinned_bin, redis_now_ms, wait_for, zdelay_bin,
};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use zdelay::keys::Keys;
use zdelay::store::functions;
use zdelay::store::scripts::ALL;

/// One line of `redis-cli MONITOR`: the client (`lua` for commands run by a script) and the
/// command's arguments, unescaped.
pub(crate) fn parse_monitor_line(line: &str) -> Option<(String, Vec<Vec<u8>>)> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let client = line[open + 1..close].split(' ').nth(1)?.to_owned();
    let mut args = Vec::new();
    let mut rest = &line.as_bytes()[close + 1..];
    while let Some(start) = rest.iter().position(|&b| b == b'"') {
        rest = &rest[start + 1..];
        let mut arg = Vec::new();
        let mut i = 0;
        loop {
            match *rest.get(i)? {
                b'"' => break,
                b'\\' => {
                    let escaped = *rest.get(i + 1)?;
                    i += 2;
                    match escaped {
                        b'n' => arg.push(b'\n'),
                        b'r' => arg.push(b'\r'),
                        b't' => arg.push(b'\t'),
                        b'a' => arg.push(7),
                        b'b' => arg.push(8),
                        b'x' => {
                            let hex = std::str::from_utf8(rest.get(i..i + 2)?).ok()?;
                            arg.push(u8::from_str_radix(hex, 16).ok()?);
                            i += 2;
                        }
                        other => arg.push(other),
                    }
                }
                b => {
                    arg.push(b);
                    i += 1;
                }
            }
        }
        args.push(arg);
        rest = &rest[i + 1..];
    }
    Some((client, args))
}

#[test]
fn monitor_lines_parse() {
    let (client, args) = parse_monitor_line(
        r#"1795444563.112684 [0 127.0.0.1:59266] "EVALSHA" "ab" "1" "k\\1" "a b\"c\x01\n""#,
    )
    .unwrap();
    assert_eq!(client, "127.0.0.1:59266");
    assert_eq!(
        args,
        vec![
            b"EVALSHA".to_vec(),
            b"ab".to_vec(),
            b"1".to_vec(),
            b"k\\1".to_vec(),
            b"a b\"c\x01\n".to_vec()
        ]
    );
    let (client, _) = parse_monitor_line(r#"1.5 [0 lua] "SET" "k" "v""#).unwrap();
    assert_eq!(client, "lua");
}

/// The work of the daemon and the CLI (`bin`, with `config`) on one namespace: envelope jobs
/// local and two-phase (delivered, dead, cancelled, rescheduled, read by the producer
/// protocol), raw members, dead letters replayed and purged, schedules and a producer's
/// schedule request, and a dead job with a history of earlier deaths. `run` tells the runs'
/// ids apart.
fn exercise(
    config: &TestConfig,
    bin: &Path,
    con: &mut redis::Connection,
    tcon: &mut redis::Connection,
    run: &str,
) {
    let ok = |args: &[&str]| {
        let out = config.cli_with(bin, args);
        assert!(
            out.status.success(),
            "{} {args:?}: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let keys = {
        let mut schema = |field: &str| -> String {
            redis::cmd("HGET")
                .arg("zdelay:schema")
                .arg(field)
                .query(con)
                .expect("the schema")
        };
        let (layout, shards) = (schema("layout"), schema("shards"));
        let keys = Keys::new("zdelay", shards.parse().expect("shards"));
        // Layout 1 while the pinned release runs it, before the upgrade.
        if layout == "1" { keys.layout_1() } else { keys }
    };
    let now = redis_now_ms(con);
    // A job that goes dead at once: due a minute ago, stale after 1 ms.
    let past = (now - 60_000).to_string();
    let expired = |dest: &str, payload: &str, id: Option<&str>| {
        let mut args = vec![
            "enqueue",
            "--dest",
            dest,
            "--at",
            &past,
            "--max-lateness",
            "1ms",
            "--payload",
            payload,
        ];
        if let Some(id) = id {
            args.extend(["--id", id]);
        }
        ok(&args)
    };
    // Envelope jobs: local and two-phase, one dead (expired), one cancelled and one
    // rescheduled.
    for (dest, payload) in [("l", "one"), ("m", "two")] {
        ok(&["enqueue", "--dest", dest, "--payload", payload]);
    }
    expired("m", "three", None);
    let later = ok(&["enqueue", "--dest", "l", "--in", "1h", "--payload", "later"]);
    ok(&["reschedule", &later, "--in", "2h"]);
    ok(&["get", &later]);
    ok(&["cancel", &later]);
    // The producer protocol's read of a job in a spread shard (the writes are the scripts
    // above under other names). The older release loaded its own protocol's library, which
    // is its code, not this build's: only this build's is called.
    let this_build = bin == crate::common::zdelay_bin();
    let later = ok(&["enqueue", "--dest", "m", "--in", "1h", "--payload", "later"]);
    if this_build {
        let read: Vec<redis::Value> = crate::protocol::fcall_get(&keys, &later)
            .query(con)
            .expect("FCALL zd2_get");
        assert_eq!(read.len(), 8);
    }
    ok(&["reschedule", &later, "--in", "2h"]);
    ok(&["get", &later]);
    ok(&["cancel", &later]);
    // Raw members: local, two-phase, one too large (dead).
    let big = "x".repeat(100);
    for (key, member) in [("raw:l", "r1"), ("raw:m", "r2"), ("raw:l", big.as_str())] {
        let _: () = redis::cmd("ZADD")
            .arg(key)
            .arg(now)
            .arg(member)
            .query(con)
            .expect("ZADD");
    }
    wait_for(
        "everything delivered or dead",
        Duration::from_secs(20),
        || {
            crate::common::llen(con, "q:l") == 2
                && crate::common::llen(tcon, "q:m") == 2
                && ok(&["dead", "list"]).lines().count() == 2
        },
    );
    // Replayed due in the past, the expired job is dead again at once.
    ok(&["dead", "replay", "--all", "--at", &past]);
    ok(&["dead", "replay", "--source", "raw:l"]);
    wait_for("dead again", Duration::from_secs(20), || {
        ok(&["dead", "list"]).lines().count() == 2
    });
    ok(&["dead", "purge", "--all"]);
    ok(&["dead", "purge", "--source", "raw:l"]);
    // Schedules of both routes (on layout 2 in the local route's lane and in a spread shard):
    // set, fire a few occurrences, pause, resume, delete; a job with a lateness limit.
    for (id, dest) in [("tick", "l"), ("tock", "m")] {
        ok(&[
            "schedule",
            "set",
            id,
            "--dest",
            dest,
            "--every",
            "200ms",
            "--payload",
            "t",
        ]);
    }
    ok(&[
        "enqueue",
        "--dest",
        "l",
        "--max-lateness",
        "5s",
        "--payload",
        "limited",
    ]);
    wait_for("occurrences fired", Duration::from_secs(20), || {
        crate::common::llen(con, "q:l") >= 6 && crate::common::llen(tcon, "q:m") >= 4
    });
    for id in ["tick", "tock"] {
        ok(&["schedule", "pause", id]);
        ok(&["schedule", "resume", id]);
        ok(&["schedule", "delete", id]);
    }
    // A producer's schedule request, applied by the daemon.
    if this_build {
        let seq = crate::protocol::fcall_schedule(
            con,
            "asked",
            "set",
            Some(r#"{"id":"asked","dest":"l","every":"1h","payload":"a"}"#),
        )
        .expect("FCALL zd2_schedule");
        crate::protocol::outcome(con, "asked", seq);
    }
    ok(&[
        "schedule",
        "set",
        "later",
        "--dest",
        "l",
        "--every",
        "1h",
        "--payload",
        "t",
    ]);
    ok(&[
        "enqueue",
        "--dest",
        "l",
        "--in",
        "1h",
        "--max-lateness",
        "5s",
        "--payload",
        "x",
    ]);
    // A dead job with a history of earlier deaths (replayed by id, dead again), for the
    // reshard to move: its id changes shard from 4 to 8 shards, so the reshard's scripts run
    // whatever the other (random) ids do.
    let (four, eight) = (Keys::new("zdelay", 4), Keys::new("zdelay", 8));
    let moving = (0..)
        .map(|i| format!("twice-{run}-{i}"))
        .find(|id| four.shard_of(id) != eight.shard_of(id))
        .expect("some id moves");
    let twice = expired("m", "four", Some(&moving));
    wait_for("dead", Duration::from_secs(20), || {
        ok(&["dead", "list"]).contains(&twice)
    });
    ok(&["dead", "replay", "--id", &twice, "--at", &past]);
    wait_for("dead again", Duration::from_secs(20), || {
        // Not dead (exit 1) until the mover took it again.
        String::from_utf8_lossy(&config.cli_with(bin, &["dead", "show", &twice]).stdout)
            .contains("1 earlier deaths")
    });
    ok(&["stats"]);
}

/// Echoed just before this build's `zdelay upgrade`: where this build's own work starts.
const UPGRADE_MARK: &str = "keys-declared-upgrade";

#[test]
fn every_key_a_script_touches_is_declared() {
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let monitor_file = tempfile::NamedTempFile::new().expect("temp file");
    let mut monitor = Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "MONITOR"])
        .stdout(Stdio::from(monitor_file.reopen().expect("reopen")))
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli MONITOR");
    let routes = format!(
        r#"
[poller]
idle_poll = "50ms"
max_payload = 64

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "l"
sink = "local"
target = "q:l"

[[routes]]
name = "m"
sink = "other"
target = "q:m"

[[sources]]
key = "raw:l"
route = "l"

[[sources]]
key = "raw:m"
route = "m"
"#,
        target.url()
    );
    let mut con = redis.conn();
    let mut tcon = target.conn();
    let rt = crate::common::runtime();
    // Layout 1 first, which only the older release serves: its daemon and CLI do the work,
    // and its reshard moves the namespace from 4 shards to 8, for this build's `zdelay
    // upgrade` (which runs only from layout 1) to move to layout 2.
    let config = TestConfig::new(&redis.url(), 4, &routes).legacy_namespace();
    let pinned = pinned_bin();
    let mut daemon = Daemon::start_with_bin(&pinned, &config);
    exercise(&config, &pinned, &mut con, &mut tcon, "one");
    // A graceful stop (release_slots), then a reshard, which moves jobs, schedules and the
    // dead job's history, and needs no daemon running.
    daemon.signal(libc::SIGTERM);
    daemon.wait_exit(Duration::from_secs(10));
    config.pinned_ok(&["reshard", "--to", "8", "--yes"]);
    // Then the upgrade to storage layout 2: the local route's waiting job and schedule go
    // into its lane, the dead job into a spread shard.
    let eight = TestConfig::new(&redis.url(), 8, &routes);
    // What ran before this mark does not count as run: the older release's scripts are this
    // build's only while they are the same.
    let _: String = redis::cmd("ECHO")
        .arg(UPGRADE_MARK)
        .query(&mut con)
        .expect("ECHO");
    let upgraded = eight.cli(&["upgrade", "--yes"]);
    assert!(
        upgraded.status.success(),
        "upgrade: {}",
        String::from_utf8_lossy(&upgraded.stderr)
    );
    // This build's daemon and CLI do the same work on layout 2, from empty lists and no
    // dead job.
    let mut daemon = Daemon::start(&eight);
    let _: () = redis::cmd("DEL").arg("q:l").query(&mut con).expect("DEL");
    let _: () = redis::cmd("DEL").arg("q:m").query(&mut tcon).expect("DEL");
    let purged = eight.cli(&["dead", "purge", "--all"]);
    assert!(purged.status.success(), "dead purge --all");
    exercise(&eight, &zdelay_bin(), &mut con, &mut tcon, "two");
    // The route-lane scripts of storage layout 2 run in the bench's preview of it so far.
    let out = eight.bench(&["--mode", "lane", "--jobs", "2000"]);
    assert!(
        out.status.success(),
        "zdelay-bench --mode lane: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The per-id lane calls, which nothing runs yet but the library: in a namespace of their
    // own.
    let now = redis_now_ms(&mut con);
    {
        use zdelay::store::{Conn, lanes, scripts};
        let mut lcon = rt
            .block_on(Conn::connect(&crate::common::redis_config(&redis.url(), 4)))
            .expect("connect");
        let lane_keys = Keys::new("lanecalls", 4);
        let (lane, _) = rt
            .block_on(lanes::register(
                &mut lcon,
                &lane_keys,
                "emails",
                "q:lanecalls",
                zdelay::config::Push::Lpush,
            ))
            .expect("register");
        rt.block_on(lanes::register_two_phase(
            &mut lcon,
            &lane_keys,
            &[("m".to_owned(), "other".to_owned())],
            &["other".to_owned()],
        ))
        .expect("register two-phase");
        let item = scripts::LaneItem {
            id: "w",
            due: zdelay::job::Due::At(now + 3_600_000),
            payload: b"p",
            meta: Some("{}"),
            max_lateness_ms: Some(5_000),
            unique_for_ms: Some(60_000),
        };
        rt.block_on(scripts::enqueue_lane(
            &mut lcon,
            &lane,
            zdelay::OnConflict::Error,
            "zdelay:wake",
            &[item],
        ))
        .expect("enqueue_lane");
        let read: Vec<redis::Value> =
            crate::protocol::fcall_get_lane(&lane.keys, &lane.marker(), "w")
                .query(&mut con)
                .expect("FCALL zd2_get_lane");
        assert_eq!(read.len(), 8);
        let due = rt
            .block_on(scripts::reschedule_lane(
                &mut lcon,
                &lane,
                "zdelay:wake",
                "w",
                zdelay::job::Due::In(Duration::from_secs(60)),
            ))
            .expect("reschedule_lane");
        assert!(due.is_some(), "rescheduled");
        // A move under flow control (a rate and a bound), which reads and writes the lane's
        // flow state; the job is not due, so nothing moves.
        let flow = zdelay::config::RouteFlow {
            rate_per_s: Some(10.0),
            burst: 1,
            max_length: Some(5),
            per_key: Some(("tenant".into(), 10.0, 1)),
        };
        let args = scripts::MoveLane {
            batch: 10,
            now_ms: None,
            max_payload: 1 << 20,
            batch_bytes: 1 << 20,
            bounds_ms: &[1, 10],
            flow: Some(&flow),
            trim: None,
        };
        let moved = rt
            .block_on(scripts::move_lane(&mut lcon, &lane, &args))
            .expect("move_lane");
        assert_eq!(moved.taken, 0);
        // A two-phase route's admission (its rate and its bound's lock), then the give back.
        let take = scripts::TakeFlow {
            shard: 0,
            want: 5,
            give_back: 0,
            found: scripts::Found::Nothing,
            now_ms: None,
            rate: Some((10.0, 1)),
            lock: Some(("t", 1000)),
            release: false,
        };
        let flow_key = Keys::new("zdelay", 4).route_flow("m");
        let taken = rt
            .block_on(scripts::take_flow(&mut lcon, &flow_key, &take))
            .expect("take_flow");
        let back = scripts::TakeFlow {
            want: 0,
            give_back: taken.granted,
            found: scripts::Found::CaughtUp,
            release: true,
            ..take
        };
        rt.block_on(scripts::take_flow(&mut lcon, &flow_key, &back))
            .expect("take_flow give back");
        // Its per-key rate: a key's second job gets a turn, and goes at it.
        let per_key = |now| {
            rt.block_on(scripts::take_keys(
                &mut lcon.clone(),
                &Keys::new("zdelay", 4),
                "m",
                0,
                (1.0, 1),
                Some(now),
                &[("k1", "t"), ("k2", "t")],
            ))
            .expect("take_keys")
        };
        let turns = per_key(1_000_000);
        assert_eq!(turns[0], scripts::KeyTurn::Now);
        assert!(matches!(turns[1], scripts::KeyTurn::Later(_)), "{turns:?}");
        let cancelled = rt
            .block_on(scripts::cancel_lane(&mut lcon, &lane, "w"))
            .expect("cancel_lane");
        assert!(cancelled);
        // A dead letter of the lane (set dead by hand: a move would need a daemon on the
        // lane), shown, replayed, dead again, purged, and its history pruned.
        let kill = |con: &mut redis::Connection| {
            let k = &lane.keys;
            let _: () = redis::pipe()
                .zrem(&k.due, "w")
                .zadd(&k.dead, "w", 1)
                .hset(&k.reasons, "w", "x")
                .hset(&k.jobs, "w", "p")
                .query(con)
                .expect("kill by hand");
        };
        kill(&mut con);
        let peeked = rt
            .block_on(scripts::peek_dead_lane(
                &mut lcon,
                &lane,
                &["w".to_owned()],
                8,
            ))
            .expect("peek_dead_lane");
        assert_eq!(peeked[0].died, Some(1.0));
        let w = [("w".to_owned(), None)];
        let replayed = rt
            .block_on(scripts::replay_dead_lane(
                &mut lcon,
                &lane,
                "zdelay:wake",
                zdelay::job::Due::In(Duration::from_secs(60)),
                5,
                &w,
            ))
            .expect("replay_dead_lane");
        assert_eq!(replayed.replayed, 1);
        kill(&mut con);
        let purged = rt
            .block_on(scripts::purge_dead_lane(&mut lcon, &lane, &w))
            .expect("purge_dead_lane");
        assert_eq!(purged, (1, 0));
        rt.block_on(scripts::prune_history_lane(
            &mut lcon,
            &lane,
            &["w".to_owned()],
        ))
        .expect("prune_history_lane");
        // A schedule in the lane: written, read as due, fired (one occurrence delivered, one
        // expired), deleted.
        let at = scripts::SchedAt::Lane {
            lane: &lane,
            wake_channel: "zdelay:wake",
        };
        let frame = zdelay::Envelope::new("emails", b"s".to_vec())
            .encode()
            .expect("a frame");
        let write = scripts::ScheduleWrite {
            id: "s",
            expected_version: 0,
            read_mark: None,
            definition: "{}",
            envelope: &frame,
            pending: scripts::PendingWrite::Next(Some(now - 1_000)),
            now_ms: now - 2_000,
            withdraw: scripts::Withdraw::default(),
        };
        let created = match rt
            .block_on(scripts::upsert_schedule(&mut lcon, at, &write))
            .expect("upsert_schedule_lane")
        {
            scripts::Upserted::Written { version, .. } => version,
            stale => panic!("a new schedule is written: {stale:?}"),
        };
        let (_, due) = rt
            .block_on(scripts::due_schedules(&mut lcon, at, Some(now), 0, 10))
            .expect("due_schedules_lane");
        let firing = scripts::Firing {
            id: "s".into(),
            read_score: due[0].score.clone(),
            read_version: created.to_string(),
            mark_ms: Some(now + 6_000),
            next_ms: None,
            max_lateness_ms: Some(5),
            quarantine: None,
            deliver: vec![
                ("s:1".into(), now - 1_000, now - 1_000),
                ("s:3".into(), now + 5_000, now + 5_000),
                ("s:4".into(), now + 6_000, now + 6_000),
            ],
            expired: vec![("s:2".into(), now - 900)],
            missed: 2,
            skipped_by_calendar: 1,
        };
        let fired = rt
            .block_on(scripts::fire_schedules(
                &mut lcon,
                at,
                now,
                3_600_000,
                &[firing],
                Some(scripts::DirectPush {
                    push: zdelay::config::Push::Lpush,
                    now_ms: Some(now),
                    max_payload: 1 << 20,
                    bounds_ms: &[10, 100],
                }),
            ))
            .expect("fire_schedules_lane");
        assert_eq!((fired.created, fired.pushed, fired.expired), (3, 0, 1));
        // Its occurrences written ahead are withdrawn: s:4 by an update, s:3 by the delete.
        let (mark, withdrawn) = ((now + 6_000).to_string(), ["s:4".to_owned()]);
        let write = scripts::ScheduleWrite {
            expected_version: created,
            read_mark: Some(&mark),
            pending: scripts::PendingWrite::Next(Some(now + 10_000)),
            withdraw: scripts::Withdraw {
                jobs: &withdrawn,
                mark_ms: now + 5_999,
            },
            ..write
        };
        let upserted = rt
            .block_on(scripts::upsert_schedule(&mut lcon, at, &write))
            .expect("upsert_schedule_lane withdrawing");
        assert!(
            matches!(upserted, scripts::Upserted::Written { version, .. } if version == created + 1)
        );
        let mark = (now + 5_999).to_string();
        let withdraw = ["s:3".to_owned()];
        assert_eq!(
            rt.block_on(scripts::delete_schedule(
                &mut lcon,
                at,
                "s",
                3_600_000,
                Some(&mark),
                &withdraw
            ))
            .expect("delete_schedule_lane"),
            Some(true)
        );
        // The route's list moves to another slot: the lane is retired holding the fired
        // occurrences, and the relocation moves it into the new lane and ends the old one.
        let (moved, _) = rt
            .block_on(lanes::register(
                &mut lcon,
                &lane_keys,
                "emails",
                "q:lanecalls:elsewhere",
                zdelay::config::Push::Lpush,
            ))
            .expect("register elsewhere");
        let registry = rt
            .block_on(lanes::read_registry(&mut lcon, &lane_keys))
            .expect("registry");
        let retired: Vec<_> = registry.retired_of("emails").collect();
        let relocated = rt
            .block_on(zdelay::store::relocate::relocate(
                &mut lcon, &lane_keys, &moved, &retired,
            ))
            .expect("relocate");
        // The delivered occurrence, waiting, and the expired one, dead.
        assert_eq!(relocated.moved, 2, "{relocated:?}");
        // A route no daemon has any more: its due jobs go to dead.
        let (gone, _) = rt
            .block_on(scripts::route_gone_lane(
                &mut lcon,
                &moved,
                10,
                Some(i64::MAX / 4),
                "route gone",
            ))
            .expect("route_gone_lane");
        assert!(gone >= 1, "the relocated occurrence is due by then");
        // A test clock moved, in a namespace created with one.
        let clock_keys = Keys::new("clockcalls", 4);
        rt.block_on(zdelay::store::ensure_schema(
            &mut lcon,
            &clock_keys,
            Some(true),
        ))
        .expect("a namespace with a test clock");
        let offset = rt
            .block_on(scripts::advance_clock(&mut lcon, &clock_keys, 60_000))
            .expect("advance_clock");
        assert_eq!(offset, 60_000);
    }
    daemon.signal(libc::SIGTERM);
    daemon.wait_exit(Duration::from_secs(10));
    // MONITOR reaches its file a little after the commands ran: wait for a last command of
    // our own before reading it, or the reshard's scripts may be cut off.
    let _: String = redis::cmd("ECHO")
        .arg("keys-declared-end")
        .query(&mut con)
        .expect("ECHO");
    wait_for("MONITOR caught up", Duration::from_secs(20), || {
        std::fs::read_to_string(monitor_file.path())
            .unwrap_or_default()
            .contains("keys-declared-end")
    });
    let _ = monitor.kill();
    let _ = monitor.wait();

    let script_names: BTreeMap<String, &str> = ALL
        .iter()
        .map(|(name, source)| (redis::Script::new(source).get_hash().to_owned(), *name))
        .collect();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut undeclared: Vec<String> = Vec::new();
    let mut current: Option<(&str, BTreeSet<Vec<u8>>)> = None;
    let mut upgrading = false;
    let file = std::fs::File::open(monitor_file.path()).expect("monitor output");
    for line in BufReader::new(file).lines() {
        let line = line.expect("a line");
        upgrading |= line.contains(UPGRADE_MARK);
        let Some((client, args)) = parse_monitor_line(&line) else {
            continue;
        };
        let Some(command) = args.first() else {
            continue;
        };
        if client != "lua" {
            let upper = command.to_ascii_uppercase();
            current = None;
            let called = if upper == b"EVALSHA" || upper == b"EVAL" {
                let sha = String::from_utf8_lossy(&args[1]).into_owned();
                Some(
                    script_names
                        .get(&sha)
                        .copied()
                        .unwrap_or("an unknown script"),
                )
            } else if upper == b"FCALL" || upper == b"FCALL_RO" {
                // The producer protocol's functions run the same scripts.
                let function = String::from_utf8_lossy(&args[1]).into_owned();
                Some(functions::script_of(&function).unwrap_or("an unknown function"))
            } else {
                None
            };
            if let Some(name) = called {
                let count: usize = String::from_utf8_lossy(&args[2]).parse().expect("numkeys");
                if upgrading {
                    seen.insert(name);
                }
                current = Some((name, args[3..3 + count].iter().cloned().collect()));
            }
            continue;
        }
        let (name, declared) = current.as_ref().expect("a script command follows its call");
        let mut getkeys = redis::cmd("COMMAND");
        getkeys.arg("GETKEYS");
        for arg in &args {
            getkeys.arg(arg.as_slice());
        }
        // Commands without keys (TIME, PUBLISH…) answer an error here.
        let keys: Vec<Vec<u8>> = getkeys.query(&mut con).unwrap_or_default();
        for key in keys {
            if !declared.contains(&key) {
                undeclared.push(format!(
                    "{name}: {} {}",
                    String::from_utf8_lossy(command),
                    String::from_utf8_lossy(&key)
                ));
            }
        }
    }
    assert!(undeclared.is_empty(), "undeclared keys: {undeclared:#?}");
    let product: BTreeSet<&str> = ALL
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !name.starts_with("bench_"))
        .collect();
    let missed: Vec<&&str> = product.difference(&seen).collect();
    assert!(
        missed.is_empty(),
        "scripts this test did not run: {missed:?}"
    );
}
