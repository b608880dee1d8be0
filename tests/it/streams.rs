//! Routes to Redis Streams (`push = "xadd"`) through the real daemon: consumer groups
//! (`XREADGROUP` + `XACK`, real consumers on their own connections) read every job once on one
//! Redis and on a cluster, through kill -9 of the daemon mid-drain; the entry's fields;
//! trimming; `max_length` held by `XLEN`; a stream on another Redis (two-phase) whose
//! duplicates after a crash are bounded and carry the same `zdelay-id`; bad configs refused
//! with nothing written.

use crate::common::{
    self, Daemon, RedisCluster, RedisServer, TestConfig, all_keys, redis_now_ms, stored_total,
    wait_for,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zdelay::client::{NewJob, OnConflict};

const STREAM: &str = "events";
const GROUP: &str = "workers";

/// One stream entry as a consumer reads it: its id and its fields in order.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    fields: Vec<(String, Vec<u8>)>,
}

impl Entry {
    fn field(&self, name: &str) -> Option<String> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

type StreamReply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;

fn entries(reply: StreamReply) -> Vec<Entry> {
    reply
        .unwrap_or_default()
        .into_iter()
        .flat_map(|(_, entries)| entries)
        .map(|(id, flat)| Entry {
            id,
            fields: flat
                .chunks(2)
                .map(|pair| {
                    (
                        String::from_utf8_lossy(&pair[0]).into_owned(),
                        pair[1].clone(),
                    )
                })
                .collect(),
        })
        .collect()
}

/// Every entry of the stream, oldest first.
fn xrange(con: &mut dyn redis::ConnectionLike, stream: &str) -> Vec<Entry> {
    let flat: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(con)
        .expect("XRANGE");
    entries(Some(vec![(stream.to_owned(), flat)]))
}

fn xlen(con: &mut dyn redis::ConnectionLike, stream: &str) -> usize {
    redis::cmd("XLEN").arg(stream).query(con).expect("XLEN")
}

fn create_group(con: &mut dyn redis::ConnectionLike, stream: &str) {
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(GROUP)
        .arg("$")
        .arg("MKSTREAM")
        .query(con)
        .expect("XGROUP CREATE");
}

/// Consumers of one group, each on its own connection and thread: `XREADGROUP … >` then
/// `XACK` of what it read. What they read, in order of reading.
struct Consumers {
    stop: Arc<AtomicBool>,
    read: Arc<Mutex<Vec<Entry>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Consumers {
    fn start(count: usize, connect: impl Fn() -> Box<dyn redis::ConnectionLike + Send>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let read = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..count)
            .map(|c| {
                let (stop, read, mut con) = (stop.clone(), read.clone(), connect());
                std::thread::spawn(move || {
                    let consumer = format!("c{c}");
                    while !stop.load(Ordering::Relaxed) {
                        let reply: StreamReply = redis::cmd("XREADGROUP")
                            .arg("GROUP")
                            .arg(GROUP)
                            .arg(&consumer)
                            .arg("COUNT")
                            .arg(200)
                            .arg("BLOCK")
                            .arg(100)
                            .arg("STREAMS")
                            .arg(STREAM)
                            .arg(">")
                            .query(&mut *con)
                            .expect("XREADGROUP");
                        let got = entries(reply);
                        if got.is_empty() {
                            continue;
                        }
                        let mut ack = redis::cmd("XACK");
                        ack.arg(STREAM).arg(GROUP);
                        for e in &got {
                            ack.arg(&e.id);
                        }
                        let acked: usize = ack.query(&mut *con).expect("XACK");
                        assert_eq!(acked, got.len(), "every entry read is acknowledged once");
                        read.lock().unwrap().extend(got);
                    }
                })
            })
            .collect();
        Consumers {
            stop,
            read,
            threads,
        }
    }

    fn count(&self) -> usize {
        self.read.lock().unwrap().len()
    }

    fn finish(self) -> Vec<Entry> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().expect("a consumer thread ends cleanly");
        }
        Arc::try_unwrap(self.read).unwrap().into_inner().unwrap()
    }
}

/// Each payload `p<i>` (i < total) read exactly once, with a `zdelay-id` of its own.
fn assert_read_once(read: &[Entry], total: usize) {
    let mut counts = vec![0u32; total];
    let mut ids = BTreeMap::new();
    for e in read {
        let payload = e.field("payload").expect("a payload field");
        let i: usize = payload
            .strip_prefix('p')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("foreign payload {payload:?}"));
        counts[i] += 1;
        let id = e.field("zdelay-id").expect("a zdelay-id field");
        assert!(ids.insert(id.clone(), i).is_none(), "zdelay-id {id} twice");
    }
    let missing: Vec<_> = (0..total).filter(|&i| counts[i] == 0).collect();
    let twice: Vec<_> = (0..total).filter(|&i| counts[i] > 1).collect();
    assert!(
        missing.is_empty() && twice.is_empty(),
        "{} missing (first {:?}), {} read more than once (first {:?})",
        missing.len(),
        &missing[..missing.len().min(10)],
        twice.len(),
        &twice[..twice.len().min(10)]
    );
}

fn pending(con: &mut dyn redis::ConnectionLike) -> usize {
    let summary: (usize, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(STREAM)
        .arg(GROUP)
        .query(con)
        .expect("XPENDING");
    summary.0
}

fn route(extra: &str) -> String {
    format!(
        r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "s"
sink = "local"
target = "{STREAM}"
push = "xadd"
{extra}
"#
    )
}

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// `p<i>`, every 100th with headers and trace context.
fn job(i: usize) -> NewJob {
    let job = NewJob::new("s", format!("p{i}"));
    if i.is_multiple_of(100) {
        job.header("tenant", "t1")
            .header("a", "first")
            .header("traceparent", TRACEPARENT)
    } else {
        job
    }
}

fn enqueue(rt: &tokio::runtime::Runtime, client: &zdelay::Client, jobs: Vec<NewJob>) {
    for chunk in jobs.chunks(10_000) {
        for r in rt
            .block_on(client.enqueue_batch(chunk.to_vec(), OnConflict::Error))
            .expect("enqueue")
        {
            r.expect("every job is accepted");
        }
    }
}

/// The fields of a job with headers, in the documented order. `lane_ids`: the jobs were
/// delivered from a route lane, so their generated ids have the public form `~<lane>.<id>`
/// (two-phase jobs have ULIDs).
fn assert_fields(read: &[Entry], lane_ids: bool) {
    let with_headers = read
        .iter()
        .find(|e| e.field("payload").as_deref() == Some("p100"))
        .expect("p100 read");
    let names: Vec<&str> = with_headers
        .fields
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(
        names,
        ["payload", "zdelay-id", "traceparent", "h:a", "h:tenant"]
    );
    assert_eq!(with_headers.field("traceparent").unwrap(), TRACEPARENT);
    assert_eq!(with_headers.field("h:tenant").unwrap(), "t1");
    let plain = read
        .iter()
        .find(|e| e.field("payload").as_deref() == Some("p1"))
        .expect("p1 read");
    let names: Vec<&str> = plain.fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["payload", "zdelay-id"]);
    let id = plain.field("zdelay-id").unwrap();
    let (job_id, due) = id.rsplit_once(':').expect("<id>:<due>");
    assert_eq!(
        job_id.starts_with('~'),
        lane_ids,
        "a generated id in its public form on a lane: {id}"
    );
    assert!(due.parse::<i64>().is_ok(), "a due in ms: {id}");
}

/// kill -9 of the daemon three times while it drains into a stream two consumers read as one
/// group: every job read exactly once, nothing left pending or stored.
#[test]
fn a_consumer_group_reads_every_job_once_through_kill9_mid_drain() {
    const TOTAL: usize = 30_000;
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 2, &route(""));
    let mut con = redis.conn();
    create_group(&mut con, STREAM);
    let rt = common::runtime();
    let client = config.client(&rt);
    let base = redis_now_ms(&mut con) + 1_000;
    enqueue(
        &rt,
        &client,
        (0..TOTAL)
            .map(|i| job(i).at(base + (i as i64 * 2_000 / TOTAL as i64)))
            .collect(),
    );
    let url = redis.url();
    let consumers = Consumers::start(2, || {
        Box::new(
            redis::Client::open(url.as_str())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
    });
    let mut daemon = Daemon::spawn(&config);
    let mut kills = Vec::new();
    for k in 1..=3usize {
        let target = TOTAL * k / 5;
        wait_for(
            &format!("{target} entries appended"),
            Duration::from_secs(60),
            || xlen(&mut con, STREAM) >= target,
        );
        daemon.kill9();
        kills.push(xlen(&mut con, STREAM));
        daemon = Daemon::spawn(&config);
    }
    wait_for("every job appended", Duration::from_secs(60), || {
        stored_total(&mut con, "due") == 0 && xlen(&mut con, STREAM) >= TOTAL
    });
    wait_for("every entry read", Duration::from_secs(30), || {
        consumers.count() >= TOTAL
    });
    let read = consumers.finish();
    assert_eq!(xlen(&mut con, STREAM), TOTAL, "no entry appended twice");
    assert_read_once(&read, TOTAL);
    assert_eq!(pending(&mut con), 0, "every entry acknowledged");
    assert_eq!(stored_total(&mut con, "jobs"), 0);
    assert_eq!(stored_total(&mut con, "dead"), 0);
    assert_fields(&read, true);
    eprintln!("killed at {kills:?} entries of {TOTAL}");
}

/// The same on a Redis Cluster: the stream's lane is in the stream's slot, so the append is
/// one script on its master; one kill -9 mid-drain.
#[test]
fn a_consumer_group_reads_every_job_once_on_a_cluster() {
    const TOTAL: usize = 8_000;
    let cluster = RedisCluster::start();
    let config = cluster.config(4, &route(""));
    let mut con = cluster.conn();
    create_group(&mut con, STREAM);
    let rt = common::runtime();
    let client = config.client(&rt);
    let base = common::redis_now_ms_any(&mut con) + 1_000;
    enqueue(
        &rt,
        &client,
        (0..TOTAL)
            .map(|i| job(i).at(base + (i as i64 * 1_500 / TOTAL as i64)))
            .collect(),
    );
    let seeds = cluster.seeds();
    let consumers = Consumers::start(2, || {
        Box::new(
            redis::cluster::ClusterClient::new(seeds.clone())
                .unwrap()
                .get_connection()
                .unwrap(),
        )
    });
    let mut daemon = Daemon::spawn(&config);
    wait_for("a third appended", Duration::from_secs(60), || {
        xlen(&mut con, STREAM) >= TOTAL / 3
    });
    daemon.kill9();
    let daemon = Daemon::spawn(&config);
    wait_for("every entry read", Duration::from_secs(60), || {
        consumers.count() >= TOTAL
    });
    let read = consumers.finish();
    assert_eq!(xlen(&mut con, STREAM), TOTAL, "no entry appended twice");
    assert_read_once(&read, TOTAL);
    assert_eq!(pending(&mut con), 0);
    assert_fields(&read, true);
    let log = daemon.log_text();
    assert!(!log.contains("CROSSSLOT"), "{log}");
}

/// Sets the server to 10 entries a stream node, then writes 20 entries from 1970 to the
/// stream `aged`: two whole nodes older than any age, which trimming by age drops.
fn seed_ancient_stream(con: &mut redis::Connection) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("stream-node-max-entries")
        .arg(10)
        .query(con)
        .unwrap();
    for seq in 1..=20 {
        let _: String = redis::cmd("XADD")
            .arg("aged")
            .arg(format!("1-{seq}"))
            .arg("payload")
            .arg("ancient")
            .query(con)
            .unwrap();
    }
}

/// `trim_max_len` keeps about that many entries, the newest; `trim_max_age` drops entries
/// older than the age (whole nodes: the server is set to 10 entries a node, so both are
/// exact to within 10).
#[test]
fn trimming_keeps_the_newest_entries_and_drops_old_ones() {
    let redis = RedisServer::start();
    let mut con = redis.conn();
    seed_ancient_stream(&mut con);
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!(
            "{}\n{}",
            route("trim_max_len = 500"),
            r#"
[[routes]]
name = "aged"
sink = "local"
target = "aged"
push = "xadd"
trim_max_age = "1h"
"#
        ),
    );
    let rt = common::runtime();
    let client = config.client(&rt);
    enqueue(
        &rt,
        &client,
        (0..3_000)
            .map(|i| NewJob::new("s", format!("p{i}")))
            .collect(),
    );
    enqueue(
        &rt,
        &client,
        (0..50)
            .map(|i| NewJob::new("aged", format!("n{i}")))
            .collect(),
    );
    let _daemon = Daemon::start(&config);
    wait_for("every job appended", Duration::from_secs(30), || {
        stored_total(&mut con, "due") == 0
    });
    let kept = xrange(&mut con, STREAM);
    assert!(
        (500..510).contains(&kept.len()),
        "about 500 entries kept: {}",
        kept.len()
    );
    let last = kept.last().unwrap().field("payload").unwrap();
    assert_eq!(last, "p2999", "the newest entry stays");
    let aged = xrange(&mut con, "aged");
    assert!(
        aged.iter()
            .all(|e| e.field("payload").unwrap() != "ancient"),
        "entries older than trim_max_age are trimmed"
    );
    assert_eq!(aged.len(), 50, "the new entries stay");
}

/// `max_length` reads `XLEN`: the route holds at the bound while nobody deletes entries (a
/// consumer group's reads and acks do not shorten a stream), and flows again when entries are
/// deleted; every job arrives once.
#[test]
fn max_length_holds_jobs_while_xlen_is_at_the_bound() {
    const TOTAL: usize = 500;
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 1, &route("max_length = 100"));
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = config.client(&rt);
    enqueue(
        &rt,
        &client,
        (0..TOTAL)
            .map(|i| NewJob::new("s", format!("p{i}")))
            .collect(),
    );
    let _daemon = Daemon::start(&config);
    let flow = common::lane_keys("s", STREAM).flow;
    let mut read = Vec::new();
    while read.len() < TOTAL {
        let left = TOTAL - read.len();
        if left > 100 {
            wait_for(
                "the route held at its bound",
                Duration::from_secs(10),
                || {
                    let held_by: Option<String> = redis::cmd("HGET")
                        .arg(&flow)
                        .arg("held_by")
                        .query(&mut con)
                        .unwrap();
                    xlen(&mut con, STREAM) == 100 && held_by.as_deref() == Some("max_length")
                },
            );
            assert_eq!(stored_total(&mut con, "due"), left - 100, "the rest waits");
        } else {
            wait_for("the rest appended", Duration::from_secs(10), || {
                xlen(&mut con, STREAM) == left
            });
        }
        // What a consumer that deletes what it handled does.
        let got = xrange(&mut con, STREAM);
        assert!(got.len() <= 100, "the bound holds: XLEN {}", got.len());
        for e in &got {
            let _: usize = redis::cmd("XDEL")
                .arg(STREAM)
                .arg(&e.id)
                .query(&mut con)
                .unwrap();
        }
        read.extend(got);
    }
    assert_read_once(&read, TOTAL);
}

/// A stream on another Redis: two-phase. A crash between the append and the ack appends
/// those jobs again after the lease: at most what was appended before the crash repeats,
/// each repeat with the same `zdelay-id` (consumers drop it; Redis 7 has no `IDMP`).
#[cfg(feature = "test-failpoints")]
#[test]
fn a_remote_stream_repeats_at_most_the_crash_window_with_the_same_zdelay_id() {
    const TOTAL: usize = 2_000;
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let config = TestConfig::new(
        &scheduler.url(),
        2,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
lease = "1s"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "s"
sink = "other"
target = "{STREAM}"
push = "xadd"
"#,
            target.url()
        ),
    );
    let rt = common::runtime();
    let client = config.client(&rt);
    enqueue(&rt, &client, (0..TOTAL).map(job).collect());
    let mut crashing =
        Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", "abort_after_publish")]);
    assert!(!crashing.wait_exit(Duration::from_secs(30)).success());
    let mut tcon = target.conn();
    let before_crash = xlen(&mut tcon, STREAM);
    assert!(before_crash > 0, "it crashed after appending");
    let daemon = Daemon::start(&config);
    let mut scon = scheduler.conn();
    common::wait_spread_settled(&mut scon, 2, Duration::from_secs(30));
    let all = xrange(&mut tcon, STREAM);
    let mut by_id: std::collections::HashMap<String, Vec<&Entry>> = Default::default();
    for e in &all {
        by_id
            .entry(e.field("zdelay-id").unwrap())
            .or_default()
            .push(e);
    }
    assert_eq!(
        by_id.len(),
        TOTAL,
        "every job appended, each under one zdelay-id"
    );
    let repeats = all.len() - TOTAL;
    assert!(repeats > 0, "the crash window shows as repeats");
    assert!(
        repeats <= before_crash,
        "only what was appended before the crash repeats: {repeats} > {before_crash}"
    );
    for entries in by_id.values() {
        let payloads: Vec<_> = entries.iter().map(|e| e.field("payload")).collect();
        assert!(
            payloads.windows(2).all(|w| w[0] == w[1]),
            "a repeat is the same job"
        );
    }
    // A consumer that drops a zdelay-id it has seen reads each job once.
    let mut seen = std::collections::HashSet::new();
    let once: Vec<Entry> = all
        .iter()
        .filter(|e| seen.insert(e.field("zdelay-id").unwrap()))
        .cloned()
        .collect();
    assert_read_once(&once, TOTAL);
    assert_fields(&once, false);
    let expired = daemon.metric("zdelay_leases_expired_total", &[]);
    eprintln!(
        "{repeats} repeats of {before_crash} appended before the crash; leases expired: {expired}"
    );
}

/// Trimming on a list route, and `xadd` on a broker sink, are refused by the config check;
/// `xadd` to a key that holds a list is refused at start, before anything is written.
#[test]
fn bad_stream_configs_are_refused_with_nothing_written() {
    let redis = RedisServer::start();
    let mut con = redis.conn();
    let list_trim = TestConfig::new(
        &redis.url(),
        1,
        r#"
[[routes]]
name = "l"
sink = "local"
target = "q"
trim_max_len = 10
"#,
    );
    let out = list_trim.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("trim_max_len") && said.contains("push = \"xadd\" only"),
        "{said}"
    );
    let raw_into_stream = TestConfig::new(
        &redis.url(),
        1,
        &format!("{}\n[[sources]]\nkey = \"raw\"\nroute = \"s\"\n", route("")),
    );
    let out = raw_into_stream.cli(&["check-config"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(said.contains("appends to a stream"), "{said}");
    assert!(
        all_keys(&mut con).is_empty(),
        "a config check writes nothing"
    );

    let _: () = redis::cmd("RPUSH")
        .arg(STREAM)
        .arg("x")
        .query(&mut con)
        .unwrap();
    let config = TestConfig::new(&redis.url(), 1, &route(""));
    let out = config.cli(&["check-config", "--connect"]);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("streams: route s appends to the stream events")
            && said.contains("holds a list"),
        "check-config --connect names the route and the key's type: {said}"
    );
    let mut daemon = Daemon::spawn(&config);
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert!(!status.success());
    let log = daemon.log_text();
    assert!(
        log.contains("appends to the stream events") && log.contains("holds a list"),
        "{log}"
    );
    assert_eq!(
        all_keys(&mut con).into_iter().collect::<Vec<_>>(),
        [STREAM.to_owned()],
        "nothing written but the list that was there"
    );
}

/// A stream on another Redis is trimmed as its route says after each batch it appended to.
#[test]
fn a_remote_stream_is_trimmed_as_its_route_says() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    let mut tcon = target.conn();
    seed_ancient_stream(&mut tcon);
    let config = TestConfig::new(
        &scheduler.url(),
        2,
        &format!(
            r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "s"
sink = "other"
target = "{STREAM}"
push = "xadd"
trim_max_len = 100

[[routes]]
name = "aged"
sink = "other"
target = "aged"
push = "xadd"
trim_max_age = "1h"
"#,
            target.url()
        ),
    );
    let rt = common::runtime();
    let client = config.client(&rt);
    enqueue(
        &rt,
        &client,
        (0..1_000)
            .map(|i| NewJob::new("s", format!("p{i}")))
            .collect(),
    );
    enqueue(
        &rt,
        &client,
        (0..30)
            .map(|i| NewJob::new("aged", format!("n{i}")))
            .collect(),
    );
    let _daemon = Daemon::start(&config);
    let mut scon = scheduler.conn();
    wait_for("every job appended", Duration::from_secs(30), || {
        common::spread_total(&mut scon, 2, "due") == 0
            && common::spread_total(&mut scon, 2, "inflight") == 0
    });
    let len = xlen(&mut tcon, STREAM);
    assert!((100..110).contains(&len), "about 100 entries kept: {len}");
    let aged = xrange(&mut tcon, "aged");
    assert!(
        aged.iter()
            .all(|e| e.field("payload").unwrap() != "ancient"),
        "entries older than trim_max_age are trimmed"
    );
    assert_eq!(aged.len(), 30, "the new entries stay");
}
