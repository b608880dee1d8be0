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

/// `FCALL zd1_enqueue` for one job: the shard's keys in the order the protocol lists them,
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
    cmd.arg("zd1_enqueue").arg(10);
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

#[test]
fn a_job_enqueued_by_fcall_is_stored_byte_for_byte_as_the_library_stores_it_and_delivered() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 10, ROUTES);
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();

    // The daemon loaded the library; it says which protocol it speaks.
    let (protocol, build): (u32, String) = redis::cmd("FCALL")
        .arg("zd1_protocol")
        .arg(0)
        .query(&mut con)
        .expect("zd1_protocol");
    assert_eq!((protocol, build.as_str()), (1, env!("CARGO_PKG_VERSION")));

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
    .expect("FCALL zd1_enqueue");
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

    // Due now (relative, on Redis's clock): the daemon, woken by the call, delivers the payload.
    let codes: Vec<i64> =
        fcall_enqueue(&keys, "replace", "now-1", "+0", b"zd1:emails\n0\nnow!", "")
            .query(&mut con)
            .unwrap();
    assert_eq!(codes, [1]);
    wait_for("the FCALL job delivered", Duration::from_secs(5), || {
        lrange(&mut redis.conn(), "q:emails") == [b"now!".to_vec()]
    });
}
