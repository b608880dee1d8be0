//! The producer protocol through Redis Functions, as a client in another language uses it:
//! nothing but `FCALL`, the shard count read from the schema, and the key and frame rules of
//! `docs/reference/protocol-vectors.json`.

use crate::common::{self, Daemon, RedisServer, TestConfig, lrange, redis_now_ms, wait_for};
use std::time::Duration;
use zdelay::keys::Keys;
use zdelay::{Client, NewJob, OnConflict};

const ROUTES: &str = r#"
[[routes]]
name = "emails"
sink = "local"
target = "q:emails"
"#;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// `FCALL zd2_enqueue` for one job: the shard's keys in the order the protocol lists them,
/// then the shard count, the conflict policy, the wake channel, the shard, and the job.
fn fcall_enqueue(
    keys: &Keys,
    policy: &str,
    id: &str,
    due: &str,
    frame: &[u8],
    max_lateness: &str,
) -> redis::Cmd {
    let shard = keys.shard_of(id);
    let k = keys.shard(shard);
    let mut cmd = redis::cmd("FCALL");
    cmd.arg("zd2_enqueue").arg(10);
    for key in [
        &k.due,
        &k.jobs,
        &k.inflight,
        &k.dead,
        &k.reasons,
        &k.scheduled,
        &k.ready,
        &k.ready_ids,
        &k.max_lateness,
        &k.layout,
    ] {
        cmd.arg(key);
    }
    cmd.arg(keys.shards())
        .arg(policy)
        .arg(keys.wake_channel())
        .arg(shard)
        .arg(id)
        .arg(due)
        .arg(frame)
        .arg(max_lateness);
    cmd
}

/// `FCALL zd2_get` for `id`: the seven keys of its shard, the shard count, the id.
pub(crate) fn fcall_get(keys: &Keys, id: &str) -> redis::Cmd {
    let k = keys.shard(keys.shard_of(id));
    let mut cmd = redis::cmd("FCALL");
    cmd.arg("zd2_get").arg(7);
    for key in [
        &k.due,
        &k.jobs,
        &k.inflight,
        &k.dead,
        &k.reasons,
        &k.ready_ids,
        &k.layout,
    ] {
        cmd.arg(key);
    }
    cmd.arg(keys.shards()).arg(id);
    cmd
}

/// `FCALL zd2_get_lane` for a stored id: the lane's seven keys, the marker expected, the id.
pub(crate) fn fcall_get_lane(keys: &zdelay::keys::LaneKeys, marker: &str, id: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg("zd2_get_lane").arg(7);
    for key in [
        &keys.due,
        &keys.jobs,
        &keys.meta,
        &keys.maxlate,
        &keys.dead,
        &keys.reasons,
        &keys.marker,
    ] {
        cmd.arg(key);
    }
    cmd.arg(marker).arg(id);
    cmd
}

/// On one Redis, through a two-phase route (to another Redis): its jobs are kept in the spread
/// shards (the shard keys and `zd1` frames of docs/reference/protocol.md), so `zd2_enqueue`
/// and `zd2_get` are called there as a client in another language calls them for such a route.
#[test]
fn a_job_enqueued_by_fcall_is_stored_byte_for_byte_as_the_library_stores_it_and_delivered() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        10,
        &format!(
            r#"
[sinks.remote]
kind = "redis"
url = "{}"

[[routes]]
name = "emails"
sink = "remote"
target = "q:emails"
"#,
            remote.url()
        ),
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();

    // The daemon loaded the library; it says which protocol it speaks.
    let (protocol, build, revision, body): (u32, String, u32, String) = redis::cmd("FCALL")
        .arg("zd2_protocol")
        .arg(0)
        .query(&mut con)
        .expect("zd2_protocol");
    let mine = zdelay::store::functions::identity();
    assert_eq!((protocol, build.as_str()), (2, env!("CARGO_PKG_VERSION")));
    assert_eq!((revision, &body), (mine.revision, &mine.body));

    // A client reads the shard count (10: not a power of two) from the schema.
    let shards: u16 = redis::cmd("HGET")
        .arg("zdelay:schema")
        .arg("shards")
        .query(&mut con)
        .unwrap();
    assert_eq!(shards, 10);
    let keys = Keys::new("zdelay", shards);

    // The same job through the Rust library and through FCALL, under two ids of one tag.
    let rt = common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let far = redis_now_ms(&mut con) + 3_600_000;
    let payload = b"\0bytes \xff\n{\"a\":1}".to_vec();
    let job = |id: &str| {
        NewJob::new("emails", payload.clone())
            .id(id)
            .at(far)
            .header("tenant", "acme")
            .header("Traceparent", TRACEPARENT)
            .max_attempts(3)
            .max_lateness(Duration::from_secs(30))
    };
    rt.block_on(client.enqueue(job("{u1}:rust"), OnConflict::Replace))
        .expect("enqueue");
    // The frame as the storage reference describes it: headers sorted, trace context names
    // lowercase, the meta's length in bytes.
    let meta = format!(
        r#"{{"headers":{{"tenant":"acme","traceparent":"{TRACEPARENT}"}},"max_attempts":3,"max_lateness_ms":30000}}"#
    );
    let mut frame = format!("zd1:emails\n{}\n{meta}", meta.len()).into_bytes();
    frame.extend_from_slice(&payload);
    let codes: Vec<i64> = fcall_enqueue(
        &keys,
        "replace",
        "{u1}:fcall",
        &far.to_string(),
        &frame,
        "30000",
    )
    .query(&mut con)
    .expect("FCALL zd2_enqueue");
    assert_eq!(codes, [1], "added");

    let shard = keys.shard(keys.shard_of("{u1}:fcall"));
    let stored = |con: &mut redis::Connection, id: &str| -> (Vec<u8>, f64, String) {
        redis::pipe()
            .hget(&shard.jobs, id)
            .zscore(&shard.due, id)
            .hget(&shard.max_lateness, id)
            .query(con)
            .unwrap()
    };
    let by_library = stored(&mut con, "{u1}:rust");
    assert_eq!(by_library, stored(&mut con, "{u1}:fcall"));
    assert_eq!(
        by_library.0, frame,
        "the library stores the frame the protocol describes"
    );

    // Read back in one call: Redis's clock, the due score, no ready member, not in flight,
    // not dead, the frame, no reason.
    type Read = (
        i64,
        i64,
        Option<f64>,
        Option<String>,
        Option<f64>,
        Option<f64>,
        Option<Vec<u8>>,
        Option<String>,
    );
    let read: Read = fcall_get(&keys, "{u1}:fcall")
        .query(&mut con)
        .expect("FCALL zd2_get");
    assert!(read.0 > 1_700_000_000, "TIME seconds: {read:?}");
    assert_eq!(
        (read.2, read.3, read.4, read.5, read.6.as_deref(), read.7),
        (
            Some(far as f64),
            None,
            None,
            None,
            Some(frame.as_slice()),
            None
        )
    );

    // The conflict policies answer as documented: kept, exists.
    for (policy, code) in [("keep", 0), ("error", -1), ("replace", 2)] {
        let codes: Vec<i64> = fcall_enqueue(
            &keys,
            policy,
            "{u1}:fcall",
            &far.to_string(),
            &frame,
            "30000",
        )
        .query(&mut con)
        .unwrap();
        assert_eq!(codes, [code], "{policy}");
    }

    // A server that lost the library (a restart without persistence, FUNCTION FLUSH) gets it
    // back from the running daemon at its next stats sample.
    let _: () = redis::cmd("FUNCTION").arg("FLUSH").query(&mut con).unwrap();
    wait_for("the library loaded again", Duration::from_secs(15), || {
        redis::cmd("FCALL")
            .arg("zd2_protocol")
            .arg(0)
            .query::<Vec<redis::Value>>(&mut redis.conn())
            .is_ok()
    });

    // Due now (relative, on Redis's clock): the daemon, woken by the call, delivers the payload.
    let codes: Vec<i64> =
        fcall_enqueue(&keys, "replace", "now-1", "+0", b"zd1:emails\n0\nnow!", "")
            .query(&mut con)
            .unwrap();
    assert_eq!(codes, [1]);
    wait_for("the FCALL job delivered", Duration::from_secs(15), || {
        lrange(&mut remote.conn(), "q:emails") == [b"now!".to_vec()]
    });
}

/// On a Redis Cluster on storage layout 2: the daemon loaded the library on every master, and
/// a job enqueued into a route's lane by `FCALL` (keys from the lane registry and the slot's
/// tag, the marker the registry implies) is stored as the Rust library stores it and
/// delivered exactly once from the list's master.
#[test]
fn on_a_cluster_a_lane_job_enqueued_by_fcall_matches_the_library_and_is_delivered() {
    use crate::common::RedisCluster;
    use zdelay::keys::{LaneKeys, slot_tag};

    let cluster = RedisCluster::start();
    let config = cluster.config(4, ROUTES);
    let _daemon = Daemon::start(&config);
    let mut con = cluster.conn();

    // Masters got the library from the daemon at its start, replicas by replication (which
    // may lag a moment).
    let has_library = |port: u16| -> (bool, bool) {
        let mut node = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .unwrap()
            .get_connection()
            .unwrap();
        let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut node).unwrap();
        let master = role.first() == Some(&redis::Value::BulkString(b"master".to_vec()));
        let listed: Vec<redis::Value> = redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg("zdelay_p2")
            .query(&mut node)
            .unwrap();
        (master, listed.len() == 1)
    };
    let masters: Vec<u16> = cluster
        .ports
        .iter()
        .copied()
        .filter(|&p| has_library(p).0)
        .collect();
    assert_eq!(masters.len(), 3, "{:?}", cluster.ports);
    for &port in &masters {
        assert!(has_library(port).1, "master {port} has the library");
    }
    wait_for(
        "every replica has the library",
        Duration::from_secs(10),
        || cluster.ports.iter().all(|&p| has_library(p).1),
    );

    // What a client reads: the route's lane, then the lane's keys from its slot's tag.
    let entry: String = redis::cmd("HGET")
        .arg("zdelay:lanes")
        .arg("r:emails")
        .query(&mut con)
        .expect("the daemon registered the route's lane");
    let fields: Vec<&str> = entry.split(' ').collect();
    let [lane, "local", slot, push, list] = fields[..] else {
        panic!("registry entry {entry:?}")
    };
    assert_eq!(list, "q:emails");
    let tag = slot_tag(slot.parse().unwrap());
    let keys = LaneKeys::new("zdelay", tag, "emails");
    let marker = format!("2 {lane} {push} {list}");
    let fcall = |expected: &str,
                 policy: &str,
                 id: &str,
                 due: &str,
                 payload: &[u8],
                 meta: &str,
                 max_lateness: &str| {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg("zd2_enqueue_lane").arg(8);
        for key in [
            &keys.due,
            &keys.jobs,
            &keys.meta,
            &keys.maxlate,
            &keys.large,
            &keys.dead,
            &keys.reasons,
            &keys.marker,
        ] {
            cmd.arg(key);
        }
        cmd.arg(expected)
            .arg(policy)
            .arg("zdelay:wake")
            .arg(format!("l{lane}"))
            .arg(id)
            .arg(due)
            .arg(payload)
            .arg(meta)
            .arg(max_lateness);
        cmd
    };

    let rt = common::runtime();
    let client = rt
        .block_on(Client::attach(&cluster.redis_config(4)))
        .expect("attach");
    let far = common::redis_now_ms_any(&mut con) + 3_600_000;
    let payload = b"lane \xff payload".to_vec();
    rt.block_on(
        client.enqueue(
            NewJob::new("emails", payload.clone())
                .id("rust-1")
                .at(far)
                .header("tenant", "acme")
                .max_attempts(3)
                .max_lateness(Duration::from_secs(30)),
            OnConflict::Replace,
        ),
    )
    .expect("enqueue");
    let meta = r#"{"headers":{"tenant":"acme"},"max_attempts":3}"#;
    let codes: Vec<i64> = fcall(
        &marker,
        "replace",
        "fcall-1",
        &far.to_string(),
        &payload,
        meta,
        "30000",
    )
    .query(&mut con)
    .expect("FCALL zd2_enqueue_lane");
    assert_eq!(codes, [1]);
    let stored = |con: &mut redis::cluster::ClusterConnection,
                  id: &str|
     -> (Vec<u8>, Option<String>, f64, Option<String>) {
        (
            redis::cmd("HGET")
                .arg(&keys.jobs)
                .arg(id)
                .query(con)
                .unwrap(),
            redis::cmd("HGET")
                .arg(&keys.meta)
                .arg(id)
                .query(con)
                .unwrap(),
            redis::cmd("ZSCORE")
                .arg(&keys.due)
                .arg(id)
                .query(con)
                .unwrap(),
            redis::cmd("HGET")
                .arg(&keys.maxlate)
                .arg(id)
                .query(con)
                .unwrap(),
        )
    };
    let by_library = stored(&mut con, "rust-1");
    assert_eq!(by_library, stored(&mut con, "fcall-1"));
    assert_eq!(by_library.1.as_deref(), Some(meta));

    // Read back in one call: the due score, payload, meta and max lateness.
    type Read = (
        i64,
        i64,
        Option<f64>,
        Option<Vec<u8>>,
        Option<String>,
        Option<String>,
        Option<f64>,
        Option<String>,
    );
    let read: Read = fcall_get_lane(&keys, &marker, "fcall-1")
        .query(&mut con)
        .expect("FCALL zd2_get_lane");
    assert_eq!(
        (
            read.2,
            read.3,
            read.4.as_deref(),
            read.5.as_deref(),
            read.6,
            read.7
        ),
        (
            Some(far as f64),
            Some(payload.clone()),
            Some(meta),
            Some("30000"),
            None,
            None
        )
    );

    // A stale marker writes nothing and says the lane changed.
    let stale = format!("2 {lane} {push} q:other");
    let err = fcall(&stale, "replace", "fcall-2", "+0", b"x", "", "")
        .query::<Vec<i64>>(&mut con)
        .unwrap_err();
    assert_eq!(err.code(), Some("ZDELAY_LANE_CHANGED"), "{err}");
    let held: bool = redis::cmd("HEXISTS")
        .arg(&keys.jobs)
        .arg("fcall-2")
        .query(&mut con)
        .unwrap();
    assert!(!held, "a refused call writes nothing");

    // Due now: delivered from the lane by the list's master, once.
    let codes: Vec<i64> = fcall(&marker, "replace", "fcall-now", "+0", b"lane now", "", "")
        .query(&mut con)
        .unwrap();
    assert_eq!(codes, [1]);
    wait_for("the lane job delivered", Duration::from_secs(5), || {
        let got: Vec<Vec<u8>> = redis::cmd("LRANGE")
            .arg("q:emails")
            .arg(0)
            .arg(-1)
            .query(&mut cluster.conn())
            .unwrap();
        got == [b"lane now".to_vec()]
    });
}

/// `FCALL zd2_schedule`: the namespace's request and result hashes, the id, the operation and
/// (set) the schedule's JSON; the request's sequence number.
pub(crate) fn fcall_schedule(
    con: &mut redis::Connection,
    id: &str,
    op: &str,
    json: Option<&str>,
) -> redis::RedisResult<u64> {
    let keys = Keys::new("zdelay", 1);
    let mut cmd = redis::cmd("FCALL");
    cmd.arg("zd2_schedule")
        .arg(2)
        .arg(keys.schedule_requests())
        .arg(keys.schedule_results())
        .arg(id)
        .arg(op);
    if let Some(json) = json {
        cmd.arg(json);
    }
    cmd.query(con)
}

/// The outcome a daemon recorded for the requests of `id` up to `seq`.
pub(crate) fn outcome(con: &mut redis::Connection, id: &str, seq: u64) -> serde_json::Value {
    let results = Keys::new("zdelay", 1).schedule_results();
    let mut found = serde_json::Value::Null;
    wait_for(
        "a daemon to apply the schedule request",
        Duration::from_secs(10),
        || {
            let text: Option<String> = redis::cmd("HGET").arg(&results).arg(id).query(con).unwrap();
            found = text.map_or(serde_json::Value::Null, |t| {
                serde_json::from_str(&t).unwrap()
            });
            found["seq"].as_u64().is_some_and(|s| s >= seq)
        },
    );
    found
}

/// The daemons' lock on schedule requests, held by the test so that requests wait; released
/// on drop.
struct HeldRequests(redis::Connection);

impl HeldRequests {
    fn take(redis: &RedisServer) -> Self {
        let mut con = redis.conn();
        let lock = Keys::new("zdelay", 1).schedule_requests_lock();
        wait_for("the schedule request lock", Duration::from_secs(10), || {
            let taken: Option<String> = redis::cmd("SET")
                .arg(&lock)
                .arg("test")
                .arg("NX")
                .arg("PX")
                .arg(60_000)
                .query(&mut con)
                .unwrap();
            taken.is_some()
        });
        HeldRequests(con)
    }
}

impl Drop for HeldRequests {
    fn drop(&mut self) {
        let lock = Keys::new("zdelay", 1).schedule_requests_lock();
        let _: redis::RedisResult<()> = redis::cmd("DEL").arg(lock).query(&mut self.0);
    }
}

#[test]
fn schedule_requests_by_fcall_are_applied_by_a_daemon_in_order_with_their_outcome() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 10, ROUTES);
    // Two daemons: one at a time applies the requests.
    let _daemons = [Daemon::start(&config), Daemon::start_instance(&config)];
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");

    // The same cron schedule through the library and through a request.
    let json = |id: &str, payload: &str| {
        format!(
            r#"{{"id":"{id}","dest":"emails","cron":"0 9 * * 1-5","tz":"Europe/Paris","payload":"{payload}","headers":{{"tenant":"acme","Traceparent":"{TRACEPARENT}"}},"misfire":"skip","max_lateness":"30s","max_attempts":3}}"#
        )
    };
    let spec = zdelay::schedules::NewSchedule::from_json_line(&json("by-lib", "report")).unwrap();
    rt.block_on(client.schedule_set(spec))
        .expect("schedule_set");
    let seq = fcall_schedule(
        &mut con,
        "by-fcall",
        "set",
        Some(&json("by-fcall", "report")),
    )
    .unwrap();
    let done = outcome(&mut con, "by-fcall", seq);
    assert_eq!(done["ok"], true, "{done}");
    assert_eq!(done["exists"], true, "{done}");
    let (lib, req) = rt
        .block_on(async {
            Ok::<_, zdelay::ClientError>((
                client.schedule_get("by-lib").await?.unwrap(),
                client.schedule_get("by-fcall").await?.unwrap(),
            ))
        })
        .unwrap();
    assert_eq!(
        (&req.dest, &req.def, req.paused),
        (&lib.dest, &lib.def, false)
    );
    assert_eq!(req.next_ms, lib.next_ms);
    assert_eq!(done["next_ms"].as_i64(), req.next_ms);
    let (mut lib_env, mut req_env) = (lib.envelope.unwrap(), req.envelope.unwrap());
    assert_eq!(req_env.meta.schedule.take().as_deref(), Some("by-fcall"));
    lib_env.meta.schedule = None;
    assert_eq!(req_env, lib_env, "an occurrence carries the same");

    // An interval schedule fires through the daemon: its occurrences reach the list.
    let every = r#"{"id":"tick","dest":"emails","every":"200ms","payload":"tick"}"#;
    let seq = fcall_schedule(&mut con, "tick", "set", Some(every)).unwrap();
    assert_eq!(outcome(&mut con, "tick", seq)["ok"], true);
    wait_for("two occurrences delivered", Duration::from_secs(10), || {
        lrange(&mut con, "q:emails")
            .iter()
            .filter(|p| p.as_slice() == b"tick")
            .count()
            >= 2
    });

    // Requests made before a daemon applies them are applied in the order asked: pause, then
    // a set (which keeps the pause), is paused with the new payload.
    let held = HeldRequests::take(&redis);
    fcall_schedule(&mut con, "tick", "pause", None).unwrap();
    let changed = every.replace(r#""payload":"tick""#, r#""payload":"tock""#);
    let seq = fcall_schedule(&mut con, "tick", "set", Some(&changed)).unwrap();
    drop(held);
    let done = outcome(&mut con, "tick", seq);
    assert_eq!(
        (&done["paused"], &done["next_ms"]),
        (&true.into(), &serde_json::Value::Null),
        "{done}"
    );
    let view = rt.block_on(client.schedule_get("tick")).unwrap().unwrap();
    assert_eq!(view.envelope.unwrap().payload, b"tock");
    let seq = fcall_schedule(&mut con, "tick", "resume", None).unwrap();
    let done = outcome(&mut con, "tick", seq);
    assert_eq!(done["paused"], false, "{done}");
    assert!(done["next_ms"].as_i64().is_some(), "{done}");

    // A delete drops what was asked before it, and a pause after it changes nothing.
    let held = HeldRequests::take(&redis);
    fcall_schedule(&mut con, "tick", "set", Some(every)).unwrap();
    fcall_schedule(&mut con, "tick", "delete", None).unwrap();
    let seq = fcall_schedule(&mut con, "tick", "pause", None).unwrap();
    drop(held);
    assert_eq!(outcome(&mut con, "tick", seq)["exists"], false);
    assert!(rt.block_on(client.schedule_get("tick")).unwrap().is_none());

    // What cannot succeed is answered with why and removed; what is malformed is refused at
    // once, writing nothing.
    for (id, line, why) in [
        (
            "bad-cron",
            r#"{"id":"bad-cron","dest":"emails","cron":"61 * * * *","payload":""}"#,
            "cron",
        ),
        (
            "bad-dest",
            r#"{"id":"bad-dest","dest":"nowhere","every":"1s","payload":""}"#,
            "unknown destination",
        ),
        (
            "bad-header",
            r#"{"id":"bad-header","dest":"emails","every":"1s","payload":"","headers":{"n":1}}"#,
            "headers.n",
        ),
        (
            "other-id",
            r#"{"id":"not-me","dest":"emails","every":"1s","payload":""}"#,
            "id",
        ),
    ] {
        let seq = fcall_schedule(&mut con, id, "set", Some(line)).unwrap();
        let done = outcome(&mut con, id, seq);
        assert_eq!(done["ok"], false, "{id}: {done}");
        assert!(
            done["error"].as_str().unwrap().contains(why),
            "{id}: {done}"
        );
        assert!(
            rt.block_on(client.schedule_get(id)).unwrap().is_none(),
            "{id}"
        );
    }
    let requests = Keys::new("zdelay", 1).schedule_requests();
    for (op, json, why) in [
        ("stop", None, "op"),
        ("set", None, "JSON object"),
        ("set", Some("not json"), "JSON object"),
    ] {
        let err = fcall_schedule(&mut con, "x", op, json).unwrap_err();
        assert!(
            err.to_string().contains("ZDELAY_BAD_REQUEST") && err.to_string().contains(why),
            "{err}"
        );
    }
    let err = fcall_schedule(&mut con, "", "pause", None).unwrap_err();
    assert_eq!(err.code(), Some("ZDELAY_BAD_REQUEST"), "{err}");
    assert!(err.detail().is_some_and(|d| d.starts_with("id:")), "{err}");
    let waiting: bool = redis::cmd("HEXISTS")
        .arg(&requests)
        .arg("x")
        .query(&mut con)
        .unwrap();
    assert!(!waiting, "a refused request writes nothing");
}

/// Protocol 1's function library as the release before revisions (commit de46fba) loads it,
/// byte for byte: every start of that release puts it back with `FUNCTION LOAD REPLACE`.
/// Older producers call it until they are upgraded, so it stays beside this build's.
const PROTOCOL_1_LIBRARY: &str = include_str!("fixtures/library_zdelay_p1_de46fba.lua");

/// Samples (and library syncs) every 300 ms, so a repair is seen quickly.
const QUICK_SAMPLES: &str = "[poller]\nstats_interval = \"300ms\"\n";

/// A library as `zd2_protocol` names it: (revision, body, build).
type Loaded = (u32, String, String);

/// What each master holds of this protocol version (`None`: no library).
fn loaded_on(masters: &[u16]) -> Vec<Option<Loaded>> {
    masters
        .iter()
        .map(|port| {
            let mut con = node_conn(*port);
            let answer: redis::RedisResult<Vec<redis::Value>> = redis::cmd("FCALL_RO")
                .arg("zd2_protocol")
                .arg(0)
                .query(&mut con);
            let values = answer.ok()?;
            let text = |i: usize| -> String {
                values
                    .get(i)
                    .and_then(|v| redis::from_redis_value(v.clone()).ok())
                    .unwrap_or_default()
            };
            let revision = redis::from_redis_value(values[2].clone()).expect("a revision");
            Some((revision, text(3), text(1)))
        })
        .collect()
}

/// Protocol 1's library on each master, as its code, and what its `zd1_protocol` answers
/// (`None`: not loaded).
fn protocol_1_on(masters: &[u16]) -> Vec<Option<(String, (u32, String))>> {
    masters
        .iter()
        .map(|port| {
            let mut con = node_conn(*port);
            let listed: Vec<Vec<redis::Value>> = redis::cmd("FUNCTION")
                .arg("LIST")
                .arg("LIBRARYNAME")
                .arg("zdelay_p1")
                .arg("WITHCODE")
                .query(&mut con)
                .expect("FUNCTION LIST");
            let library = listed.into_iter().find(|fields| {
                fields.chunks(2).any(|kv| {
                    kv[0] == redis::Value::BulkString(b"library_name".to_vec())
                        && kv[1] == redis::Value::BulkString(b"zdelay_p1".to_vec())
                })
            })?;
            let code = library
                .chunks(2)
                .find(|kv| kv[0] == redis::Value::BulkString(b"library_code".to_vec()))
                .map(|kv| redis::from_redis_value(kv[1].clone()).expect("code"))
                .expect("library_code");
            let answer = redis::cmd("FCALL_RO")
                .arg("zd1_protocol")
                .arg(0)
                .query(&mut con)
                .expect("zd1_protocol");
            Some((code, answer))
        })
        .collect()
}

/// Every master holds protocol 1's library as that release loaded it.
fn protocol_1_left_alone(masters: &[u16], what: &str) {
    let want = Some((PROTOCOL_1_LIBRARY.to_owned(), (1, "0.1.0".to_owned())));
    for held in protocol_1_on(masters) {
        assert!(held == want, "{what}: protocol 1's library is {held:?}");
    }
}

fn node_conn(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// What a start of the release before revisions does on every master (a release of protocol
/// 1: it loads `zdelay_p1` only).
fn protocol_1_release_starts(masters: &[u16]) {
    for port in masters {
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(PROTOCOL_1_LIBRARY)
            .query(&mut node_conn(*port))
            .expect("protocol 1's library loads");
    }
}

fn flush_functions(masters: &[u16]) {
    for port in masters {
        let _: () = redis::cmd("FUNCTION")
            .arg("FLUSH")
            .query(&mut node_conn(*port))
            .unwrap();
    }
}

/// A daemon of this build, or of this build claiming another revision or body
/// (`library_claims=<revision>[:<mark>]`), as another release would be.
fn daemon(config: &TestConfig, claims: Option<&str>) -> Daemon {
    let spec = claims.map(|c| format!("library_claims={c}"));
    let env: Vec<(&str, &str)> = spec
        .iter()
        .map(|s| ("ZDELAY_FAILPOINT", s.as_str()))
        .collect();
    let daemon = Daemon::spawn_instance_with_env(config, &env);
    daemon.wait_ready();
    daemon
}

fn every_master_holds(masters: &[u16], what: &str, expected: impl Fn(&Loaded) -> bool) -> Loaded {
    let held = loaded_on(masters);
    let first = held[0]
        .clone()
        .unwrap_or_else(|| panic!("{what}: no library: {held:?}"));
    assert!(
        held.iter().all(|h| h.as_ref() == Some(&first)) && expected(&first),
        "{what}: {held:?}"
    );
    first
}

/// A release of protocol 1 (its library, loaded as it loads it), this build, and this build
/// claiming an older revision, a newer one, or another body of its own, start in every order
/// of each pair on `masters`: this build loads its protocol's library beside protocol 1's and
/// never touches that one (nor a release of protocol 1 this build's), and no start puts an
/// older or another body of this protocol's library over it.
fn no_start_order_downgrades(config: &TestConfig, masters: &[u16]) {
    let mine = zdelay::store::functions::identity();
    let is_mine = |l: &Loaded| l.0 == mine.revision && l.1 == mine.body;
    let older_revision = format!("{}:older", mine.revision - 1);
    let log_says = |d: &Daemon, what: &str| {
        wait_for(what, Duration::from_secs(15), || {
            d.log_text().contains(what)
        });
    };

    // A release of protocol 1, then this build: its library loaded beside protocol 1's.
    flush_functions(masters);
    protocol_1_release_starts(masters);
    assert!(loaded_on(masters).iter().all(Option::is_none));
    let this = daemon(config, None);
    every_master_holds(masters, "this build after protocol 1's release", is_mine);
    log_says(&this, "producer functions loaded");
    // A few samples later, protocol 1's library is still as that release loaded it.
    std::thread::sleep(Duration::from_secs(1));
    protocol_1_left_alone(masters, "this build's samples");

    // This build, then a release of protocol 1 (restarting mid-rollout or on rollback): it
    // replaces its own library only.
    protocol_1_release_starts(masters);
    every_master_holds(masters, "after protocol 1's release restarted", is_mine);
    protocol_1_left_alone(masters, "its own start");

    // This build, then an older revision of a later release: left alone, logged once.
    let older = daemon(config, Some(&older_revision));
    log_says(&older, "a newer revision is loaded");
    // This build, then another body of its revision: left alone, an error.
    let other = daemon(config, Some(&format!("{}:other", mine.revision)));
    log_says(&other, "with another body");
    // A few samples of all three later, still this build's.
    std::thread::sleep(Duration::from_secs(1));
    every_master_holds(masters, "after older and other bodies started", is_mine);
    for d in [&older, &other] {
        assert_eq!(
            d.log_text().matches("producer functions:").count(),
            masters.len(),
            "logged once per master, not at every sample:\n{}",
            d.log_text()
        );
    }
    drop((this, older, other));

    // This build, then a newer revision: replaced; this build restarting after it leaves it.
    let _this = daemon(config, None);
    let newer = daemon(config, Some(&format!("{}:newer", mine.revision + 1)));
    let next = every_master_holds(masters, "a newer revision after this build", |l| {
        l.0 == mine.revision + 1
    });
    drop(_this);
    let this = daemon(config, None);
    log_says(&this, "a newer revision is loaded");
    std::thread::sleep(Duration::from_secs(1));
    every_master_holds(masters, "this build after a newer revision", |l| *l == next);
    drop((this, newer));

    // An older revision, then this build: replaced.
    flush_functions(masters);
    let older = daemon(config, Some(&older_revision));
    let older_body = every_master_holds(masters, "an older revision alone", |l| {
        l.0 == mine.revision - 1
    });
    assert_ne!(older_body.1, mine.body);
    let this = daemon(config, None);
    every_master_holds(masters, "this build after an older revision", is_mine);
    log_says(&this, "replaced an older revision");
    drop((older, this));

    // Another body of this revision, then this build: left alone, an error.
    flush_functions(masters);
    let other = daemon(config, Some(&format!("{}:other", mine.revision)));
    let theirs = every_master_holds(masters, "another body alone", |l| {
        l.0 == mine.revision && l.1 != mine.body
    });
    let this = daemon(config, None);
    log_says(&this, "with another body");
    std::thread::sleep(Duration::from_secs(1));
    every_master_holds(masters, "another body after this build", |l| *l == theirs);
    drop((other, this));
}

#[test]
fn no_daemon_start_puts_an_older_or_other_library_body_back_on_one_redis() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, &format!("{QUICK_SAMPLES}{ROUTES}"));
    no_start_order_downgrades(&config, &[redis.port]);
}

#[test]
fn no_daemon_start_puts_an_older_or_other_library_body_back_on_a_cluster() {
    use crate::common::RedisCluster;
    let cluster = RedisCluster::start();
    let config = cluster.config(4, &format!("{QUICK_SAMPLES}{ROUTES}"));
    let masters: Vec<u16> = cluster
        .ports
        .iter()
        .copied()
        .filter(|&p| {
            let role: Vec<redis::Value> = redis::cmd("ROLE").query(&mut node_conn(p)).unwrap();
            role.first() == Some(&redis::Value::BulkString(b"master".to_vec()))
        })
        .collect();
    assert_eq!(masters.len(), 3, "{:?}", cluster.ports);
    no_start_order_downgrades(&config, &masters);
}
