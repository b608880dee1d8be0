//! `zdelay reshard --to N` on real Redis servers and a real Redis Cluster: every job of every
//! state (scheduled, due, waiting for its two-phase sink, in flight, dead, with its history of
//! earlier deaths) lands in its shard under the new count with exactly what it had, and a daemon with the new count then delivers
//! each exactly once. Refused while a daemon runs; a daemon caught running by a reshard stops;
//! a producer connected before it follows the new layout and never writes into a wrong shard;
//! a crash at any step and a second run finish with the counts intact.
//!
//! This is storage layout 1's reshard, which freezes the namespace: these namespaces are
//! created with `redis.layout = 1`. Layout 2's online reshard is in `reshard_layout2.rs`.

use crate::common::{Daemon, RedisCluster, RedisServer, TestConfig, wait_for, zdelay_bin};
use redis::ConnectionLike;
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::time::Duration;
use zdelay::config::RedisConfig;
use zdelay::dead::{DeadSelection, ReplayOptions};
use zdelay::keys::Keys;
use zdelay::poller::{self, PollerContext, Target};
use zdelay::store::scripts;
use zdelay::{Client, Due, NewJob, OnConflict};

/// Every kind of shard key, with how to read it whole.
const STRUCTURES: [(&str, Kind); 17] = [
    ("due", Kind::Zset),
    ("jobs", Kind::Hash),
    ("inflight", Kind::Zset),
    ("dead", Kind::Zset),
    ("reasons", Kind::Hash),
    ("scheduled", Kind::Hash),
    ("ready", Kind::Zset),
    ("ready_ids", Kind::Hash),
    ("max_lateness", Kind::Hash),
    ("schedules", Kind::Hash),
    ("sched_env", Kind::Hash),
    ("sched_due", Kind::Zset),
    ("sched_fired", Kind::Zset),
    ("sched_quarantine", Kind::Hash),
    ("history", Kind::Hash),
    ("unique", Kind::Hash),
    ("windows", Kind::Zset),
];

#[derive(Clone, Copy)]
enum Kind {
    Hash,
    Zset,
}

/// What the namespace stores, by (structure, member), whatever the shard: scores and values
/// as Redis returns them.
type Snapshot = BTreeMap<(String, Vec<u8>), Vec<u8>>;

/// Reads shards `0..span` whole; checks every id sits in its shard under `shards` (when
/// given) and returns the contents without the shard numbers.
fn snapshot(con: &mut dyn ConnectionLike, span: u16, shards: Option<u16>) -> Snapshot {
    let mut out = Snapshot::new();
    for shard in 0..span {
        for (name, kind) in STRUCTURES {
            let key = format!("{{zdelay:{shard}}}:{name}");
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = match kind {
                Kind::Hash => redis::cmd("HGETALL").arg(&key).query(con),
                Kind::Zset => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(con),
            }
            .expect("read a shard key");
            for (member, value) in pairs {
                if let Some(shards) = shards {
                    let id = match name {
                        "ready" => zdelay::reshard::ready_member_id(&member)
                            .expect("a ready member")
                            .to_vec(),
                        // `u:<id>` (a unique window) or `d:<id>` (a debounce deadline).
                        "windows" => member[2..].to_vec(),
                        _ => member.clone(),
                    };
                    let owner = Keys::new("zdelay", shards).shard_of_bytes(&id);
                    assert!(
                        owner == shard,
                        "{} in {key} belongs to shard {owner} of {shards}",
                        String::from_utf8_lossy(&id)
                    );
                }
                let dup = out.insert((name.to_owned(), member), value);
                assert!(dup.is_none(), "a member twice in {name} across shards");
            }
        }
    }
    out
}

/// Shards `0..span` as they are, by (shard, structure, member): for a frozen namespace, where
/// an id may be in two shards at once.
fn dump(con: &mut dyn ConnectionLike, span: u16) -> BTreeMap<(u16, String, Vec<u8>), Vec<u8>> {
    let mut out = BTreeMap::new();
    for shard in 0..span {
        for (name, kind) in STRUCTURES {
            let key = format!("{{zdelay:{shard}}}:{name}");
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = match kind {
                Kind::Hash => redis::cmd("HGETALL").arg(&key).query(con),
                Kind::Zset => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(con),
            }
            .expect("read a shard key");
            for (member, value) in pairs {
                out.insert((shard, name.to_owned(), member), value);
            }
        }
    }
    out
}

/// Asserts two snapshots are equal, naming a few differences rather than printing both.
fn assert_same(got: &Snapshot, want: &Snapshot, what: &str) {
    if got == want {
        return;
    }
    let show = |k: &(String, Vec<u8>)| format!("{}:{}", k.0, String::from_utf8_lossy(&k.1));
    let missing: Vec<String> = want
        .keys()
        .filter(|k| !got.contains_key(*k))
        .take(5)
        .map(show)
        .collect();
    let extra: Vec<String> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .take(5)
        .map(show)
        .collect();
    let changed: Vec<String> = want
        .iter()
        .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
        .take(5)
        .map(|(k, _)| show(k))
        .collect();
    panic!(
        "{what}: {} entries, want {}; missing {missing:?}, extra {extra:?}, changed {changed:?}",
        got.len(),
        want.len()
    );
}

/// Every key of shards `from..to` that exists (data keys only).
fn stray_keys(con: &mut dyn ConnectionLike, from: u16, to: u16) -> Vec<String> {
    let mut out = Vec::new();
    for shard in from..to {
        for (name, _) in STRUCTURES {
            let key = format!("{{zdelay:{shard}}}:{name}");
            let exists: bool = redis::cmd("EXISTS").arg(&key).query(con).unwrap();
            if exists {
                out.push(key);
            }
        }
    }
    out
}

fn llen(con: &mut dyn ConnectionLike, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(con).expect("LLEN")
}

fn list_counts(con: &mut dyn ConnectionLike, key: &str) -> BTreeMap<String, usize> {
    let items: Vec<String> = redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(con)
        .expect("LRANGE");
    let mut out = BTreeMap::new();
    for item in items {
        *out.entry(item).or_default() += 1;
    }
    out
}

/// Where the scheduling Redis is: one server or a cluster.
enum Place<'a> {
    Single(&'a RedisServer),
    Cluster(&'a RedisCluster),
}

impl Place<'_> {
    fn redis_config(&self, shards: u16) -> RedisConfig {
        match self {
            Place::Single(r) => RedisConfig {
                url: r.url(),
                shards,
                layout: Some(1),
                ..Default::default()
            },
            Place::Cluster(c) => RedisConfig {
                cluster_nodes: c.seeds(),
                shards,
                layout: Some(1),
                ..Default::default()
            },
        }
    }

    fn conn(&self) -> Box<dyn ConnectionLike> {
        match self {
            Place::Single(r) => Box::new(r.conn()),
            Place::Cluster(c) => Box::new(c.conn()),
        }
    }

    /// A config with `shards`, a local route `here` (→ `q:local`) and a two-phase route
    /// `mirror` to a list on `remote`.
    fn config(&self, shards: u16, remote: &RedisServer) -> TestConfig {
        let extra = format!(
            r#"
[poller]
idle_poll = "50ms"
lease = "2s"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "here"
sink = "local"
target = "q:local"
push = "rpush"

[[routes]]
name = "mirror"
sink = "other"
target = "q:remote"
push = "rpush"
"#,
            remote.url()
        );
        match self {
            Place::Single(r) => TestConfig::new(&r.url(), shards, &extra).on_layout_1(),
            Place::Cluster(c) => {
                let config = TestConfig::new("redis://127.0.0.1:1", shards, &extra);
                let body = std::fs::read_to_string(&config.path).unwrap();
                let body = body.replacen(
                    "[redis]\n",
                    &format!("[redis]\ncluster_nodes = {}\n", c.seeds_toml()),
                    1,
                );
                std::fs::write(&config.path, body).unwrap();
                config.on_layout_1()
            }
        }
    }
}

/// A CLI run with extra environment (the failpoint).
fn cli_env(config: &TestConfig, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(args)
        .envs(env.iter().copied())
        .env("ZDELAY_LOG", "warn")
        .output()
        .expect("zdelay runs")
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `zdelay reshard --to N --yes --json`, which must succeed: its JSON outcome.
fn reshard(config: &TestConfig, to: u16) -> serde_json::Value {
    let out = config.cli(&["reshard", "--to", &to.to_string(), "--yes", "--json"]);
    assert!(out.status.success(), "reshard failed: {}", text(&out));
    serde_json::from_slice(&out.stdout).expect("reshard --json")
}

/// The jobs a scenario schedules, by kind.
struct Loaded {
    /// Local route, due within a few seconds.
    local: Vec<String>,
    /// Two-phase route: due, waiting for the sink in the ready set, or claimed (in flight).
    mirror: Vec<String>,
    /// Claimed by the test, never published: in flight with a lease that lapses.
    in_flight: usize,
    /// Unknown destination: dead, with a reason, replayed once and dead again (so each has
    /// one earlier death in its history).
    dead: Vec<String>,
}

/// Schedules jobs of every state into a namespace of `shards` shards: local jobs due a little
/// later, two-phase jobs queued in the ready set (some claimed, so in flight with a 1 s lease),
/// dead jobs that died twice (a history entry each). Nothing is delivered: no daemon runs.
fn load(place: &Place, config: &TestConfig, shards: u16, scale: usize) -> Loaded {
    let rt = crate::common::runtime();
    let client = rt
        .block_on(Client::connect(&place.redis_config(shards)))
        .expect("client connects");
    let mut con = place.conn();
    let now = crate::common::redis_now_ms_any(&mut *con);
    let id = |kind: &str, i: usize| {
        // Some ids share a tag: they share a shard under every count.
        if i.is_multiple_of(5) {
            format!("{{tag-{}}}:{kind}-{i}", i % 7)
        } else {
            format!("{kind}-{i}")
        }
    };
    let local: Vec<String> = (0..scale).map(|i| id("local", i)).collect();
    let mirror: Vec<String> = (0..scale / 4).map(|i| id("mirror", i)).collect();
    let dead: Vec<String> = (0..scale / 20).map(|i| id("dead", i)).collect();
    let mut jobs = Vec::new();
    for (i, id) in local.iter().enumerate() {
        // Due 1.5–4.5 s from now: still scheduled when moved, due soon after.
        jobs.push(
            NewJob::new("here", id.clone())
                .id(id)
                .at(now + 1500 + (i as i64 % 3000)),
        );
    }
    for id in &mirror {
        jobs.push(NewJob::new("mirror", id.clone()).id(id).at(now - 1000));
    }
    for id in &dead {
        jobs.push(NewJob::new("nowhere", id.clone()).id(id).at(now - 1000));
    }
    for r in rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }
    // Move what is due at now - 500 (two-phase and dead ones, not the local ones).
    let cfg = zdelay::config::load(Some(&config.path)).expect("config");
    let ctx = PollerContext::new(client.connection(), &cfg, Default::default());
    let move_due = || {
        for shard in 0..shards {
            loop {
                let reply = rt
                    .block_on(poller::move_once(
                        &ctx,
                        &Target::Shard(shard),
                        Some(now - 500),
                    ))
                    .expect("move_once");
                if reply.taken < ctx.mover.batch {
                    break;
                }
            }
        }
    };
    move_due();
    // Replay the dead ones, due before now - 500, and kill them again: each leaves its first
    // death in its history.
    let replayed = rt
        .block_on(client.operator().dead_replay_selected(
            &DeadSelection::Ids(dead.clone()),
            ReplayOptions {
                due: Due::At(now - 700),
                keep_attempts: false,
            },
            |_| {},
        ))
        .expect("dead replay");
    assert_eq!(replayed.replayed as usize, dead.len());
    move_due();
    // Claim a few waiting jobs per shard, as a publisher that then died would have.
    let keys = client.keys();
    let mut in_flight = 0;
    for shard in 0..shards {
        let claim = rt
            .block_on(scripts::claim_jobs(
                &mut client.connection(),
                &keys.shard(shard),
                "other",
                5,
                1000,
                1 << 20,
            ))
            .expect("claim");
        in_flight += claim.jobs.len();
    }
    Loaded {
        local,
        mirror,
        in_flight,
        dead,
    }
}

/// The whole story on one place: load, reshard from → to, check the namespace is the same
/// but for where each id lives, then a daemon with the new count delivers each job once.
fn reshard_and_deliver(place: &Place, from: u16, to: u16, scale: usize) {
    let remote = RedisServer::start();
    let old = place.config(from, &remote);
    let new = place.config(to, &remote);
    let loaded = load(place, &old, from, scale);
    assert!(loaded.in_flight > 0, "some jobs are in flight");
    // Recurring schedules and jobs with a max lateness move with the rest.
    let batch = old.path.with_file_name("schedules.jsonl");
    let lines: String = (0..20)
        .map(|i| {
            format!(
                "{{\"id\":\"sched-{i}\",\"dest\":\"here\",\"every\":\"1h\",\"payload\":\"s{i}\"}}\n"
            )
        })
        .collect();
    std::fs::write(&batch, lines).unwrap();
    config_cli_ok(
        &old,
        &["schedule", "set", "--batch", batch.to_str().unwrap()],
    );
    for i in 0..10 {
        config_cli_ok(
            &old,
            &[
                "enqueue",
                "--dest",
                "here",
                "--id",
                &format!("limited-{i}"),
                "--in",
                "1h",
                "--max-lateness",
                "1m",
                "--payload",
                "l",
            ],
        );
    }
    // Unique windows and debounce deadlines move with their ids: ten jobs waiting with a
    // window, ten debounced ones, and below ten ids remembered after their delivery.
    for i in 0..10 {
        let (unique, debounced) = (format!("unique-{i}"), format!("debounced-{i}"));
        config_cli_ok(
            &old,
            &["enqueue", "--dest", "here", "--id", &unique, "--in", "1h"]
                .into_iter()
                .chain(["--unique-for", "1h", "--payload", "u"])
                .collect::<Vec<_>>(),
        );
        config_cli_ok(
            &old,
            &[
                "enqueue", "--dest", "here", "--id", &debounced, "--in", "1h",
            ]
            .into_iter()
            .chain(["--on-conflict", "debounce", "--max-wait", "2h"])
            .chain(["--payload", "d"])
            .collect::<Vec<_>>(),
        );
    }
    let mut boxed = place.conn();
    let con: &mut dyn ConnectionLike = boxed.as_mut();
    let window_end = crate::common::redis_now_ms_any(con) + 3_600_000;
    for i in 0..10 {
        let id = format!("remembered-{i}");
        let _: () = redis::cmd("ZADD")
            .arg(old_keys_windows(from, &id))
            .arg(window_end)
            .arg(format!("u:{id}"))
            .query(con)
            .unwrap();
    }
    // A quarantine (what a firing leaves on a schedule it cannot read) moves too.
    let old_keys = Keys::new("zdelay", from);
    let _: () = redis::cmd("HSET")
        .arg(
            old_keys
                .shard(old_keys.shard_of("sched-0"))
                .sched_quarantine,
        )
        .arg("sched-0")
        .arg("1 unreadable definition: a test")
        .query(con)
        .unwrap();
    let before = snapshot(con, from, Some(from));
    let count = |structure: &str| before.keys().filter(|(s, _)| s == structure).count();
    assert_eq!(
        count("jobs"),
        loaded.local.len() + loaded.mirror.len() + loaded.dead.len() + 30,
        "the loaded jobs, the ten with a max lateness, the ten unique and the ten debounced"
    );
    assert_eq!(count("unique"), 10);
    let windows = |prefix: &str| {
        before
            .keys()
            .filter(|(s, m)| s == "windows" && m.starts_with(prefix.as_bytes()))
            .count()
    };
    assert_eq!((windows("u:"), windows("d:")), (10, 10));
    assert_eq!(count("max_lateness"), 10);
    assert_eq!(count("schedules"), 20);
    assert_eq!(count("sched_due"), 20);
    assert_eq!(
        count("sched_fired"),
        20,
        "each schedule's mark, its creation"
    );
    assert_eq!(count("sched_quarantine"), 1);
    assert_eq!(count("inflight"), loaded.in_flight);
    assert_eq!(count("ready"), loaded.mirror.len() - loaded.in_flight);
    assert_eq!(count("dead"), loaded.dead.len());
    assert_eq!(
        count("history"),
        loaded.dead.len(),
        "each dead job died twice"
    );
    assert_eq!(
        count("scheduled"),
        loaded.in_flight,
        "claims record the scheduled due"
    );

    let dry = config_cli_ok(
        &old,
        &["reshard", "--to", &to.to_string(), "--dry-run", "--json"],
    );
    let dry: serde_json::Value = serde_json::from_str(&dry).unwrap();
    assert_eq!(dry["outcome"], "dry_run", "{dry}");
    assert!(dry["to_move"].as_u64().unwrap() > 0, "{dry}");
    assert_same(
        &snapshot(con, from.max(to), Some(from)),
        &before,
        "a dry run changes nothing",
    );

    let report = reshard(&old, to);
    eprintln!("{from} → {to}: {report}");
    assert_eq!(report["outcome"], "done", "{report}");
    assert_eq!(report["before"], report["after"], "{report}");
    assert_eq!(
        report["after"]["jobs"].as_u64().unwrap() as usize,
        count("jobs")
    );
    let after = snapshot(con, to, Some(to));
    assert_same(
        &after,
        &before,
        "every job kept everything it had, in its new shard",
    );
    assert!(
        stray_keys(con, to, from.max(to)).is_empty(),
        "the retired shards are empty"
    );
    let markers: Vec<Option<String>> = (0..from.max(to))
        .map(|s| {
            redis::cmd("GET")
                .arg(format!("{{zdelay:{s}}}:shards"))
                .query(con)
                .unwrap()
        })
        .collect();
    assert!(
        markers
            .iter()
            .all(|m| m.as_deref() == Some(&to.to_string())),
        "every marker says {to}: {markers:?}"
    );
    let schedules: serde_json::Value =
        serde_json::from_str(&config_cli_ok(&new, &["schedule", "list", "--json"])).unwrap();
    assert_eq!(
        schedules.as_array().unwrap().len(),
        20,
        "every schedule moved"
    );
    for i in [0, 7, 19] {
        config_cli_ok(&new, &["schedule", "get", &format!("sched-{i}")]);
    }
    for i in 0..10 {
        for id in [
            format!("limited-{i}"),
            format!("unique-{i}"),
            format!("debounced-{i}"),
        ] {
            config_cli_ok(&new, &["cancel", &id]);
        }
    }
    // Running it again is a no-op.
    let again = reshard(&new, to);
    assert_eq!(again["outcome"], "already_done", "{again}");

    // The old config is refused; the new one works.
    let out = old.cli(&["stats"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("set redis.shards"), "{}", text(&out));
    let daemon = Daemon::start(&new);
    let mut rcon = remote.conn();
    wait_for("every job delivered", Duration::from_secs(60), || {
        llen(con, "q:local") >= loaded.local.len()
            && llen(&mut rcon, "q:remote") >= loaded.mirror.len()
    });
    crate::common::wait_for("nothing left but the dead", Duration::from_secs(30), || {
        let left = snapshot(con, to, None);
        // The schedules stay, with their next occurrence an hour away.
        left.keys().all(|(s, _)| {
            [
                "dead",
                "reasons",
                "jobs",
                "schedules",
                "sched_env",
                "sched_due",
                "sched_fired",
                "sched_quarantine",
                "history",
                "windows",
            ]
            .contains(&s.as_str())
        }) && left.keys().filter(|(s, _)| s == "jobs").count() == loaded.dead.len()
    });
    let local = list_counts(con, "q:local");
    let remote_got = list_counts(&mut rcon, "q:remote");
    let want_local: BTreeSet<&String> = loaded.local.iter().collect();
    let want_mirror: BTreeSet<&String> = loaded.mirror.iter().collect();
    assert_eq!(local.keys().collect::<BTreeSet<_>>(), want_local);
    assert_eq!(remote_got.keys().collect::<BTreeSet<_>>(), want_mirror);
    assert!(
        local.values().chain(remote_got.values()).all(|&n| n == 1),
        "each job once"
    );
    let dead = config_cli_ok(&new, &["dead", "list", "--json", "--limit", "10000"]);
    let dead: serde_json::Value = serde_json::from_str(&dead).unwrap();
    let dead = dead["jobs"].as_array().unwrap();
    assert_eq!(dead.len(), loaded.dead.len());
    assert!(
        dead.iter()
            .all(|d| d["reason"] == "unknown destination: nowhere" && d["earlier_deaths"] == 1),
        "{dead:?}"
    );
    // The history moved with its job: `dead show` reads it from the job's new shard.
    for id in [&loaded.dead[0], loaded.dead.last().unwrap()] {
        let show = config_cli_ok(&new, &["dead", "show", id, "--json"]);
        let show: serde_json::Value = serde_json::from_str(&show).unwrap();
        let history = show["history"].as_array().unwrap();
        assert_eq!(history.len(), 1, "{show}");
        assert_eq!(
            history[0]["reason"], "unknown destination: nowhere",
            "{show}"
        );
        // Both deaths were dated by the test's move (`now - 500`), so they may be the same ms.
        assert!(history[0]["died_ms"].as_i64().unwrap() <= show["died_ms"].as_i64().unwrap());
    }
    // The remembered ids are still remembered in their new shards.
    let again = config_cli_ok(
        &new,
        &[
            "enqueue",
            "--dest",
            "here",
            "--id",
            "remembered-3",
            "--unique-for",
            "1h",
        ]
        .into_iter()
        .chain(["--payload", "again", "--json"])
        .collect::<Vec<_>>(),
    );
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["duplicate"], true, "{again}");
    assert!(
        !daemon.log_text().contains("CROSSSLOT"),
        "{}",
        daemon.log_text()
    );
}

/// The `windows` key of `id`'s shard under `shards`.
fn old_keys_windows(shards: u16, id: &str) -> String {
    let keys = Keys::new("zdelay", shards);
    keys.shard(keys.shard_of(id)).windows
}

fn config_cli_ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn reshard_4_to_8_keeps_every_job_and_a_new_daemon_delivers_each_once() {
    let redis = RedisServer::start();
    reshard_and_deliver(&Place::Single(&redis), 4, 8, 3000);
}

#[test]
fn reshard_8_to_3_keeps_every_job_and_a_new_daemon_delivers_each_once() {
    let redis = RedisServer::start();
    reshard_and_deliver(&Place::Single(&redis), 8, 3, 3000);
}

#[test]
fn reshard_4_to_8_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    reshard_and_deliver(&Place::Cluster(&cluster), 4, 8, 1500);
}

#[test]
fn refused_while_a_daemon_runs_and_a_daemon_caught_running_stops() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let place = Place::Single(&redis);
    let old = place.config(4, &remote);
    let new = place.config(8, &remote);
    load(&place, &old, 4, 200);
    let mut con = redis.conn();

    let mut daemon = Daemon::start(&old);
    let stats: serde_json::Value =
        serde_json::from_str(&config_cli_ok(&old, &["stats", "--json"])).unwrap();
    let instance = stats["instances"][0]["id"].as_str().unwrap().to_owned();
    let out = old.cli(&["reshard", "--to", "8", "--yes"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("1 daemon is registered on namespace zdelay")
            && said.contains(&instance)
            && said.contains("Stop every daemon first"),
        "the refusal names the daemon: {said}"
    );
    let dry = config_cli_ok(&old, &["reshard", "--to", "8", "--dry-run"]);
    assert!(dry.contains("refused while daemons are registered") && dry.contains(&instance));
    let schema: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("zdelay:schema")
        .query(&mut con)
        .unwrap();
    assert_eq!(schema.get("shards").map(String::as_str), Some("4"));
    assert!(!schema.contains_key("migrating"), "{schema:?}");
    let markers: Vec<String> = redis::cmd("KEYS").arg("*:shards").query(&mut con).unwrap();
    assert!(markers.is_empty(), "a refusal sets no marker: {markers:?}");

    // Out of range, like redis.shards.
    for to in ["0", "16385"] {
        let out = old.cli(&["reshard", "--to", to, "--yes"]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains("1..=16384"), "{}", text(&out));
    }

    // A daemon a reshard catches running (it registered after the check) is refused by the
    // markers and stops with the reason, writing nothing.
    for s in 0..8 {
        let _: () = redis::cmd("SET")
            .arg(format!("{{zdelay:{s}}}:shards"))
            .arg("migrating 4 8")
            .query(&mut con)
            .unwrap();
    }
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(1), "{}", daemon.log_text());
    assert!(
        daemon
            .log_text()
            .contains("namespace zdelay is being resharded from 4 to 8 shards"),
        "{}",
        daemon.log_text()
    );
    let _: () = redis::cmd("DEL")
        .arg(
            (0..8)
                .map(|s| format!("{{zdelay:{s}}}:shards"))
                .collect::<Vec<_>>(),
        )
        .query(&mut con)
        .unwrap();
    let leftover: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("{zdelay}:instances")
        .query(&mut con)
        .unwrap();
    assert!(
        leftover.is_empty(),
        "it handed its registration back: {leftover:?}"
    );

    // A daemon stopped with SIGTERM hands its registration back: the reshard goes at once.
    let daemon = Daemon::start(&old);
    daemon.signal(libc::SIGTERM);
    let mut daemon = daemon;
    assert!(daemon.wait_exit(Duration::from_secs(20)).success());
    let before = snapshot(&mut con, 8, Some(4));
    // Frozen by a reshard that crashed: a daemon cannot start, with either count.
    let out = cli_env(
        &old,
        &["reshard", "--to", "8", "--yes"],
        &[("ZDELAY_FAILPOINT", "reshard_abort_after=copied:1")],
    );
    assert!(!out.status.success(), "{}", text(&out));
    for config in [&old, &new] {
        let mut d = Daemon::spawn(config);
        let status = d.wait_exit(Duration::from_secs(20));
        assert_eq!(status.code(), Some(1));
        assert!(
            d.log_text()
                .contains("is being resharded from 4 to 8 shards"),
            "{}",
            d.log_text()
        );
    }
    let report = reshard(&old, 8);
    assert_eq!(report["resumed"], true, "{report}");
    assert_same(
        &snapshot(&mut con, 8, Some(8)),
        &before,
        "after the resumed reshard",
    );

    // After: the old count is refused at start, the new one runs.
    let mut d = Daemon::spawn(&old);
    assert_eq!(d.wait_exit(Duration::from_secs(20)).code(), Some(1));
    assert!(
        d.log_text().contains("namespace zdelay has 8 shards"),
        "{}",
        d.log_text()
    );
    let _daemon = Daemon::start(&new);
}

#[test]
fn a_client_connected_before_a_reshard_follows_it_and_never_misroutes() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let place = Place::Single(&redis);
    let old = place.config(4, &remote);
    let rt = crate::common::runtime();
    let client = rt
        .block_on(Client::connect(&place.redis_config(4)))
        .unwrap();
    let reader = rt
        .block_on(Client::connect(&place.redis_config(4)))
        .unwrap();
    let enqueue = |prefix: &str, n: usize| {
        let jobs = (0..n)
            .map(|i| {
                NewJob::new("here", format!("{prefix}-{i}"))
                    .id(format!("{prefix}-{i}"))
                    .after(Duration::from_secs(3600))
            })
            .collect();
        rt.block_on(client.enqueue_batch(jobs, OnConflict::Error))
            .expect("the call itself works")
    };
    for r in enqueue("a", 300) {
        r.expect("enqueued");
    }
    let mut con = redis.conn();
    // Dead jobs (unknown destination, killed by one move), and an operator's client that
    // connected before the reshard.
    let operator = rt
        .block_on(Client::connect(&place.redis_config(4)))
        .unwrap();
    let now = crate::common::redis_now_ms(&mut con);
    let dead: Vec<String> = (0..20).map(|i| format!("d-{i}")).collect();
    let doomed = dead
        .iter()
        .map(|id| NewJob::new("nowhere", id.clone()).id(id).at(now - 1000))
        .collect();
    for r in rt
        .block_on(client.enqueue_batch(doomed, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }
    let cfg = zdelay::config::load(Some(&old.path)).expect("config");
    let ctx = PollerContext::new(client.connection(), &cfg, Default::default());
    for shard in 0..4 {
        rt.block_on(poller::move_once(&ctx, &Target::Shard(shard), Some(now)))
            .expect("move_once");
    }
    assert_eq!(
        rt.block_on(operator.operator().dead_list(100))
            .unwrap()
            .len(),
        20
    );

    // A reshard that crashed mid-way leaves the namespace frozen: writes and reads are
    // refused with a retryable error, and nothing is written.
    let out = cli_env(
        &old,
        &["reshard", "--to", "8", "--yes"],
        &[("ZDELAY_FAILPOINT", "reshard_abort_after=copied:2")],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let frozen = dump(&mut con, 8);
    for r in enqueue("x", 20) {
        let e = r.expect_err("refused while frozen");
        assert!(e.is_retryable(), "{e}");
        assert!(
            e.to_string()
                .contains("namespace zdelay is being resharded from 4 to 8 shards"),
            "{e}"
        );
    }
    let e = rt.block_on(client.get("a-1")).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    let e = rt.block_on(client.cancel("a-1")).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    let e = rt
        .block_on(client.reschedule("a-1", zdelay::Due::In(Duration::from_secs(1))))
        .unwrap_err();
    assert!(e.is_retryable(), "{e}");
    for shards in [4, 8] {
        let e = rt
            .block_on(Client::connect(&place.redis_config(shards)))
            .err()
            .expect("no connect while frozen");
        assert!(e.is_retryable(), "{e}");
    }
    // Every dead-letter call: listing, show, replay and purge by id or all.
    let refusals = [
        rt.block_on(operator.operator().dead_list(100)).map(|_| ()),
        rt.block_on(operator.operator().dead_show("d-1"))
            .map(|_| ()),
        rt.block_on(operator.operator().dead_replay(&["d-1".to_owned()]))
            .map(|_| ()),
        rt.block_on(operator.operator().dead_replay(&[]))
            .map(|_| ()),
        rt.block_on(operator.operator().dead_purge(&["d-2".to_owned()]))
            .map(|_| ()),
        rt.block_on(operator.operator().dead_purge(&[])).map(|_| ()),
    ];
    for r in refusals {
        let e = r.expect_err("refused while frozen");
        assert!(e.is_retryable(), "{e}");
    }
    assert!(dump(&mut con, 8) == frozen, "nothing was written");
    // Even a script called with the old layout by hand writes nothing.
    let stale = Keys::new("zdelay", 4);
    let item = scripts::EnqueueItem {
        id: "stale".into(),
        due: zdelay::Due::In(Duration::ZERO),
        envelope: b"zd1:here\n0\nx".to_vec(),
        max_lateness_ms: None,
        unique_for_ms: None,
    };
    let call = scripts::EnqueueCall {
        keys: stale.shard(stale.shard_of("stale")),
        items: std::slice::from_ref(&item),
    };
    let answers = rt
        .block_on(scripts::enqueue_jobs(
            &mut client.connection(),
            OnConflict::Replace,
            &[call],
        ))
        .unwrap();
    let refused = answers[0].as_ref().unwrap_err();
    assert_eq!(refused.code(), Some("ZDELAY_MIGRATING"), "{refused}");

    let report = reshard(&old, 8);
    assert_eq!(
        (report["resumed"].clone(), report["to"].clone()),
        (true.into(), 8.into())
    );

    // The connected client learns the new count at its first refused write and writes into
    // the right shards from then on; the other one at its first read.
    for r in enqueue("b", 300) {
        r.expect("enqueued after the reshard");
    }
    assert_eq!(client.keys().shards(), 8);
    let job = rt.block_on(reader.get("b-7")).unwrap().expect("found");
    assert_eq!(job.shard, Keys::new("zdelay", 8).shard_of("b-7"));
    assert_eq!(reader.keys().shards(), 8);
    let job = rt.block_on(client.get("a-5")).unwrap().expect("found");
    assert_eq!(job.shard, Keys::new("zdelay", 8).shard_of("a-5"));
    assert!(
        rt.block_on(client.reschedule("a-6", zdelay::Due::In(Duration::from_secs(7200))))
            .unwrap()
            .is_some()
    );
    assert_eq!(
        rt.block_on(client.cancel("a-7")).unwrap(),
        zdelay::Cancelled::Cancelled
    );
    assert_eq!(
        rt.block_on(reader.operator().dead_list(100)).unwrap().len(),
        20
    );
    // The operator's client follows too: it lists every dead job in its new shard, and
    // replays and purges by id there.
    let listed = rt.block_on(operator.operator().dead_list(100)).unwrap();
    assert_eq!(operator.keys().shards(), 8);
    assert_eq!(listed.len(), 20);
    assert!(
        listed
            .iter()
            .all(|d| d.shard == Keys::new("zdelay", 8).shard_of(&d.id)),
        "{listed:?}"
    );
    let shown = rt
        .block_on(operator.operator().dead_show("d-3"))
        .unwrap()
        .expect("dead");
    assert_eq!(shown.job.reason, "unknown destination: nowhere");
    assert_eq!(
        rt.block_on(operator.operator().dead_purge(&dead[..5]))
            .unwrap(),
        5,
        "purged in their new shards"
    );
    let replayed = rt
        .block_on(operator.operator().dead_replay_selected(
            &DeadSelection::Ids(dead[5..8].to_vec()),
            ReplayOptions {
                due: Due::In(Duration::from_secs(3600)),
                keep_attempts: false,
            },
            |_| {},
        ))
        .unwrap();
    assert_eq!(replayed.replayed, 3);
    // Every id in its shard under 8, each once: 300 + 300 - 1 cancelled, 15 of the dead.
    let all = snapshot(&mut con, 8, Some(8));
    assert_eq!(all.keys().filter(|(s, _)| s == "jobs").count(), 614);
    assert_eq!(all.keys().filter(|(s, _)| s == "dead").count(), 12);
    assert_eq!(all.keys().filter(|(s, _)| s == "history").count(), 3);
    assert!(stray_keys(&mut con, 8, 16).is_empty());

    // A stale script call on the resharded namespace is refused with the new count.
    let call = scripts::EnqueueCall {
        keys: stale.shard(stale.shard_of("stale")),
        items: std::slice::from_ref(&item),
    };
    let answers = rt
        .block_on(scripts::enqueue_jobs(
            &mut client.connection(),
            OnConflict::Replace,
            &[call],
        ))
        .unwrap();
    let refused = answers[0].as_ref().unwrap_err();
    assert_eq!(refused.code(), Some("ZDELAY_RESHARDED"), "{refused}");
    assert_eq!(refused.detail(), Some("8"));
    let exists: bool = redis::cmd("HEXISTS")
        .arg(format!("{{zdelay:{}}}:jobs", stale.shard_of("stale")))
        .arg("stale")
        .query(&mut con)
        .unwrap();
    assert!(!exists);
}

#[test]
fn a_crash_at_any_step_then_a_second_run_finishes_with_the_counts_intact() {
    for (from, to, point) in [
        (4, 8, "frozen:1"),
        (4, 8, "copied:1"),
        (4, 8, "copied:4"),
        (8, 3, "copied:3"),
        (4, 8, "verified:1"),
        (8, 3, "finishing:1"),
    ] {
        let redis = RedisServer::start();
        let remote = RedisServer::start();
        let place = Place::Single(&redis);
        let old = place.config(from, &remote);
        load(&place, &old, from, 1200);
        let mut con = redis.conn();
        let before = snapshot(&mut con, from, Some(from));
        let out = cli_env(
            &old,
            &[
                "reshard",
                "--to",
                &to.to_string(),
                "--yes",
                "--batch",
                "100",
            ],
            &[("ZDELAY_FAILPOINT", &format!("reshard_abort_after={point}"))],
        );
        assert!(
            !out.status.success() && text(&out).contains("failpoint"),
            "{point}: {}",
            text(&out)
        );
        if point.starts_with("copied") {
            // Copied, not yet deleted: some ids are in two shards now, identical.
            let span = from.max(to);
            let mut seen: BTreeMap<Vec<u8>, u16> = BTreeMap::new();
            let mut twice = 0;
            for shard in 0..span {
                let ids: Vec<Vec<u8>> = redis::cmd("HKEYS")
                    .arg(format!("{{zdelay:{shard}}}:jobs"))
                    .query(&mut con)
                    .unwrap();
                for id in ids {
                    twice += usize::from(seen.insert(id, shard).is_some());
                }
            }
            assert!(twice > 0, "{point}: the crash hit between copy and delete");
        }
        let report = reshard(&old, to);
        assert_eq!(report["resumed"], true, "{point}: {report}");
        assert_eq!(report["before"], report["after"], "{point}: {report}");
        assert_eq!(
            report["before"]["jobs"].as_u64().unwrap() as usize,
            before.keys().filter(|(s, _)| s == "jobs").count(),
            "{point}: the counts are those before the first run"
        );
        assert_same(
            &snapshot(&mut con, to, Some(to)),
            &before,
            &format!("{point}: nothing lost, nothing changed"),
        );
        assert!(stray_keys(&mut con, to, from.max(to)).is_empty(), "{point}");
    }
}
