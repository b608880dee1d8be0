//! Delivery against a real `redis-server`: exactly once at scale, order, never early, raw
//! sources, the priority lane and push direction, wake-up precision, hand-written JSON
//! envelopes. Each test seeds Redis, runs the daemon (or one move script with an explicit
//! "now"), and asserts every key afterwards, including what must not move.

use crate::common::{
    self, Daemon, RedisServer, TestConfig, data_keys, lane_keys, llen, lrange, metric_value,
    redis_config, redis_now_ms, subscribers, wait_for,
};
use base64::Engine;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zdelay::client::JobState;
use zdelay::keys::Keys;
use zdelay::poller::{self, PollerContext, RawSource, Target};
use zdelay::routes::Routes;
use zdelay::{Client, NewJob, OnConflict};

/// The namespace every test here uses (each test has its own server).
const NS: &str = "zdelay";

fn connect(rt: &tokio::runtime::Runtime, url: &str, shards: u16) -> Client {
    rt.block_on(Client::connect(&redis_config(url, shards)))
        .expect("client connects")
}

fn zcard(con: &mut redis::Connection, key: &str) -> u64 {
    redis::cmd("ZCARD").arg(key).query(con).expect("ZCARD")
}

fn hlen(con: &mut redis::Connection, key: &str) -> u64 {
    redis::cmd("HLEN").arg(key).query(con).expect("HLEN")
}

fn zrange_withscores(con: &mut redis::Connection, key: &str) -> Vec<(Vec<u8>, f64)> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(con)
        .expect("ZRANGE")
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn bytes(items: &[&str]) -> Vec<Vec<u8>> {
    items.iter().map(|s| s.as_bytes().to_vec()).collect()
}

/// Asserts every spread shard's due, jobs, inflight, dead and reasons keys are empty (local
/// routes' lanes are checked by the tests' `data_keys`: an empty key does not exist).
fn assert_shards_empty(con: &mut redis::Connection, shards: u16) {
    let keys = Keys::new(NS, shards);
    for s in 0..shards {
        assert_eq!(zcard(con, &keys.due(s)), 0, "shard {s} due");
        assert_eq!(hlen(con, &keys.jobs(s)), 0, "shard {s} jobs");
        assert_eq!(zcard(con, &keys.inflight(s)), 0, "shard {s} inflight");
        assert_eq!(zcard(con, &keys.dead(s)), 0, "shard {s} dead");
        assert_eq!(hlen(con, &keys.reasons(s)), 0, "shard {s} reasons");
    }
}

/// Pops one item with a blocking pop (`BLPOP` or `BRPOP`) and reads Redis `TIME` right after.
fn pop_timed(con: &mut redis::Connection, pop: &str, lists: &[&str]) -> (String, Vec<u8>, i64) {
    let (list, item): (String, Vec<u8>) = redis::cmd(pop)
        .arg(lists)
        .arg(8)
        .query::<Option<(String, Vec<u8>)>>(con)
        .expect("blocking pop")
        .unwrap_or_else(|| panic!("nothing arrived on {lists:?} within 8 s"));
    let now = redis_now_ms(con);
    (list, item, now)
}

/// An atomic snapshot of some lists together with Redis `TIME` (MULTI … EXEC): whatever a
/// snapshot shows delivered was delivered at or before that time.
fn snapshot(con: &mut redis::Connection, lists: &[&str]) -> (i64, Vec<Vec<Vec<u8>>>) {
    let mut pipe = redis::pipe();
    pipe.atomic();
    for list in lists {
        pipe.cmd("LRANGE").arg(*list).arg(0).arg(-1);
    }
    pipe.cmd("TIME");
    let mut values: Vec<redis::Value> = pipe.query(con).expect("MULTI snapshot");
    let (s, us): (i64, i64) =
        redis::from_redis_value(values.pop().expect("TIME reply")).expect("TIME");
    let lists = values
        .into_iter()
        .map(|v| redis::from_redis_value(v).expect("LRANGE reply"))
        .collect();
    (s * 1000 + us / 1000, lists)
}

/// `got` and `expected` hold the same items with the same multiplicities; on failure,
/// reports a few missing, unexpected and duplicated items instead of two huge vectors.
fn assert_same_items(what: &str, got: &[Vec<u8>], expected: &[Vec<u8>]) {
    let mut counts: HashMap<&[u8], i64> = HashMap::with_capacity(expected.len());
    for e in expected {
        *counts.entry(e).or_default() += 1;
    }
    for g in got {
        *counts.entry(g).or_default() -= 1;
    }
    let missing: Vec<_> = counts.iter().filter(|(_, c)| **c > 0).take(5).collect();
    let extra: Vec<_> = counts.iter().filter(|(_, c)| **c < 0).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty() && got.len() == expected.len(),
        "{what}: got {} items, expected {}; missing (item, count) {missing:?}; \
         unexpected or duplicated (item, -extra) {extra:?}",
        got.len(),
        expected.len()
    );
}

/// `got` equals `want` item for item; on failure, shows where they first differ.
fn assert_same_order<A: AsRef<[u8]>, B: AsRef<[u8]>>(what: &str, got: &[A], want: &[B]) {
    let at = |items: &[&[u8]], i: usize| -> Vec<String> {
        let end = (i + 3).min(items.len());
        let start = i.min(end);
        items[start..end]
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    };
    let got: Vec<&[u8]> = got.iter().map(AsRef::as_ref).collect();
    let want: Vec<&[u8]> = want.iter().map(AsRef::as_ref).collect();
    if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
        panic!(
            "{what}: first difference at position {i} (got {} items, expected {}): \
             got {:?}…, expected {:?}…",
            got.len(),
            want.len(),
            at(&got, i),
            at(&want, i)
        );
    }
}

/// Payload of job `i` in the exactly-once test: unique (the index, big-endian, so it often
/// starts with NUL bytes), not UTF-8, with NUL, CR and LF inside, and of varying length.
fn binary_payload(i: u32) -> Vec<u8> {
    let mut p = i.to_be_bytes().to_vec();
    p.extend_from_slice(b"\0\n\xff\xfe\r\n");
    p.extend_from_slice(format!("job-{i}").as_bytes());
    p.extend(std::iter::repeat_n(b'\x80', (i % 17) as usize));
    p
}

#[test]
fn exactly_once_200k_binary_jobs_over_4_shards_and_3_routes() {
    const JOBS: u32 = 200_000;
    const SHARDS: u16 = 4;
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[sinks.local]
kind = "redis"

[[routes]]
name = "left"
sink = "local"
target = "q:left"
push = "lpush"

[[routes]]
name = "right"
sink = "local"
target = "q:right"
push = "rpush"

[[routes]]
name = "lane"
sink = "local"
target = "q:lane"
delayed_suffix = "-delayed"
"#,
    );
    let routes = ["left", "right", "lane"];
    let lists = ["q:left", "q:right", "q:lane-delayed"];
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), SHARDS);

    // Due 3–7 s from now, mostly after the load (about 2.5 s in a debug build; on a busy
    // machine the first due jobs move while the producer still enqueues).
    let base = redis_now_ms(&mut con) + 3_000;
    let started = Instant::now();
    let mut expected: Vec<Vec<Vec<u8>>> = vec![Vec::new(); routes.len()];
    for chunk_start in (0..JOBS).step_by(20_000) {
        let jobs: Vec<NewJob> = (chunk_start..(chunk_start + 20_000).min(JOBS))
            .map(|i| {
                let route = (i % 3) as usize;
                let payload = binary_payload(i);
                expected[route].push(payload.clone());
                NewJob::new(routes[route], payload).at(base + (i as i64 * 7_919) % 4_000)
            })
            .collect();
        let results = rt
            .block_on(client.enqueue_batch(jobs, OnConflict::Error))
            .expect("batch enqueue");
        assert!(
            results.iter().all(|r| r.is_ok()),
            "every job is accepted: {:?}",
            results.iter().find(|r| r.is_err())
        );
    }
    let loaded = started.elapsed();
    let delivered_during_load: usize = lists.iter().map(|l| llen(&mut con, l)).sum();

    // Every job handled: then whatever is on the lists is all there will be.
    let lanes: Vec<_> = routes
        .iter()
        .zip(lists)
        .map(|(route, list)| lane_keys(route, list))
        .collect();
    wait_for(
        "every lane's due set empty",
        Duration::from_secs(45),
        || lanes.iter().all(|lane| zcard(&mut con, &lane.due) == 0),
    );
    let delivered = started.elapsed();

    // Nothing left behind, nothing dead, nothing in flight; no other key exists (the plain
    // `q:lane` list stays untouched: its route delivers to the priority lane).
    assert_shards_empty(&mut con, SHARDS);
    assert_eq!(
        data_keys(&mut con),
        set(&["zdelay:schema", "q:left", "q:right", "q:lane-delayed"])
    );
    for (route, list) in lists.iter().enumerate() {
        let got = lrange(&mut con, list);
        assert_same_items(list, &got, &expected[route]);
    }
    // The daemon's counters agree with what arrived.
    let (_, metrics) = daemon.admin_get("/metrics").expect("metrics");
    for (route, items) in routes.iter().zip(&expected) {
        let moved = metric_value(&metrics, "zdelay_jobs_moved_total", &[("route", route)]);
        assert_eq!(moved, Some(items.len() as f64), "moved counter of {route}");
    }
    eprintln!(
        "200k jobs: loaded in {loaded:?} ({delivered_during_load} delivered by then), \
         all delivered {delivered:?} after the start"
    );
}

#[test]
fn equal_due_jobs_leave_in_enqueue_order_per_shard() {
    // Ordering at equal due time is a per-shard guarantee, and a local route's lane is its one
    // shard: the lane's ZSET orders equal scores by member, and the library's ids increase
    // within a process (its generated `~<lane>.<id>` ids, and the ULIDs of `new_id` for ids
    // chosen by the caller). So each route keeps a total order, whether its jobs came in
    // batches or one at a time. The two kinds of ids do not compare with each other: each
    // route here gets one kind.
    const SHARDS: u16 = 4;
    const PER_GROUP: usize = 2_000;
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[[routes]]
name = "tagged"
sink = "local"
target = "q:tagged"
push = "rpush"

[[routes]]
name = "spread"
sink = "local"
target = "q:spread"
push = "lpush"
"#,
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), SHARDS);

    let due = redis_now_ms(&mut con) + 2_000;
    let mut tagged = Vec::new(); // payloads in enqueue order (ids chosen with `new_id`)
    let mut spread = Vec::new(); // payloads in enqueue order (generated ids)
    // Interleave the two groups over several batch calls and single enqueues.
    for round in 0..4 {
        let mut jobs = Vec::new();
        for i in 0..PER_GROUP / 4 {
            let n = round * PER_GROUP / 4 + i;
            let id = format!("{{grp}}:{}", client.new_id());
            let payload = format!("tagged-{n}");
            tagged.push(payload.clone().into_bytes());
            jobs.push(NewJob::new("tagged", payload).id(id).at(due));
            let payload = format!("spread-{n}");
            spread.push(payload.clone().into_bytes());
            jobs.push(NewJob::new("spread", payload).at(due));
        }
        let results = rt
            .block_on(client.enqueue_batch(jobs, OnConflict::Error))
            .unwrap();
        assert!(results.iter().all(|r| r.is_ok()));
        // One job enqueued on its own between batches, with a library-generated id.
        let n = PER_GROUP + round;
        let payload = format!("spread-{n}");
        rt.block_on(client.enqueue(
            NewJob::new("spread", payload.clone()).at(due),
            OnConflict::Error,
        ))
        .unwrap();
        spread.push(payload.into_bytes());
    }

    wait_for("both groups delivered", Duration::from_secs(20), || {
        llen(&mut con, "q:tagged") + llen(&mut con, "q:spread") == tagged.len() + spread.len()
    });
    // RPUSH: a BLPOP consumer reads the list left to right: exactly the enqueue order.
    assert_same_order("tagged group", &lrange(&mut con, "q:tagged"), &tagged);
    // LPUSH: a BRPOP consumer reads right to left: exactly the enqueue order too.
    let mut consumed = lrange(&mut con, "q:spread");
    consumed.reverse();
    assert_same_order("spread group", &consumed, &spread);
    assert_shards_empty(&mut con, SHARDS);
    assert_eq!(
        data_keys(&mut con),
        set(&["zdelay:schema", "q:tagged", "q:spread"])
    );
}

#[test]
fn never_early_with_an_explicit_now() {
    // One move script call at a time, with "now" given: a job due at T stays at T-1 and
    // leaves at T. Same for raw sources in ms and in (fractional) seconds.
    let redis = RedisServer::start();
    let mut con = redis.conn();
    let config = zdelay::config::from_toml(&format!(
        r#"
[redis]
url = "{}"
shards = 2

[poller]
batch = 10

[[routes]]
name = "r"
sink = "local"
target = "q:r"
push = "rpush"

[[sources]]
key = "src:ms"
score_unit = "ms"
route = "r"

[[sources]]
key = "src:s"
score_unit = "s"
route = "r"
"#,
        redis.url()
    ))
    .expect("valid config");
    let rt = common::runtime();
    // Given the config, the client registers route r's lane, as a producer deployed first does.
    let client = connect(&rt, &redis.url(), 2).with_routes(Routes::from_config(&config));

    // Far from Redis's own clock on purpose: only the explicit now decides.
    const T: i64 = 1_900_000_000_123;
    for (id, due, payload) in [("{t}:a", T, "a"), ("{t}:b", T + 1, "b")] {
        rt.block_on(client.enqueue(NewJob::new("r", payload).id(id).at(due), OnConflict::Error))
            .unwrap();
    }
    let registry = rt
        .block_on(zdelay::store::lanes::read_registry(
            &mut client.connection(),
            &client.keys(),
        ))
        .expect("the lane registry");
    let lane = Arc::new(registry.by_route["r"].clone());
    let mut ctx = PollerContext::new(client.connection(), &config, Default::default());
    // Raw sources resolve their route among every route; the context on layout 2 keeps the
    // two-phase ones only (local routes have lanes).
    let sources: Vec<Target> = config
        .sources
        .iter()
        .map(|s| {
            Target::Source(Arc::new(
                RawSource::resolve(s, &ctx.routes).expect("local route"),
            ))
        })
        .collect();
    let source = |i: usize| sources[i].clone();
    ctx.with_lanes(client.keys(), vec![lane.clone()]);
    let lane_keys = lane.keys.clone();
    let target = Target::Lane(lane);

    let reply = rt
        .block_on(poller::move_once(&ctx, &target, Some(T - 1)))
        .unwrap();
    assert_eq!(reply.taken, 0, "nothing is due at T-1");
    assert_eq!(reply.next_due, Some(T as f64), "the head is reported");
    assert_eq!(reply.now_us, (T - 1) * 1000, "the explicit now is used");
    assert_eq!(llen(&mut con, "q:r"), 0);
    assert_eq!(
        zrange_withscores(&mut con, &lane_keys.due),
        vec![
            (b"{t}:a".to_vec(), T as f64),
            (b"{t}:b".to_vec(), (T + 1) as f64)
        ]
    );
    assert_eq!(hlen(&mut con, &lane_keys.jobs), 2);

    let reply = rt
        .block_on(poller::move_once(&ctx, &target, Some(T)))
        .unwrap();
    assert_eq!(
        (reply.taken, reply.moved_total()),
        (1, 1),
        "exactly a is due at T"
    );
    assert_eq!(reply.max_lateness_ms, 0);
    assert_eq!(reply.next_due, Some((T + 1) as f64));
    assert_eq!(lrange(&mut con, "q:r"), bytes(&["a"]));
    assert_eq!(
        zrange_withscores(&mut con, &lane_keys.due),
        vec![(b"{t}:b".to_vec(), (T + 1) as f64)]
    );
    let jobs: Vec<String> = redis::cmd("HKEYS")
        .arg(&lane_keys.jobs)
        .query(&mut con)
        .unwrap();
    assert_eq!(jobs, vec!["{t}:b"]);

    let reply = rt
        .block_on(poller::move_once(&ctx, &target, Some(T + 1)))
        .unwrap();
    assert_eq!((reply.taken, reply.next_due), (1, None));
    assert_eq!(lrange(&mut con, "q:r"), bytes(&["a", "b"]));
    for shard in 0..2 {
        let reply = rt
            .block_on(poller::move_once(&ctx, &Target::Shard(shard), Some(T + 10)))
            .unwrap();
        assert_eq!(reply.taken, 0, "spread shard {shard} never held these jobs");
    }
    redis::cmd("DEL").arg("q:r").exec(&mut con).unwrap();

    // Raw ms source.
    redis::cmd("ZADD")
        .arg("src:ms")
        .arg(T)
        .arg("raw-ms")
        .exec(&mut con)
        .unwrap();
    let ms = source(0);
    let reply = rt
        .block_on(poller::move_once(&ctx, &ms, Some(T - 1)))
        .unwrap();
    assert_eq!((reply.taken, reply.next_due), (0, Some(T as f64)));
    assert_eq!(llen(&mut con, "q:r"), 0);
    assert_eq!(zcard(&mut con, "src:ms"), 1);
    let reply = rt.block_on(poller::move_once(&ctx, &ms, Some(T))).unwrap();
    assert_eq!((reply.taken, reply.moved_total()), (1, 1));
    assert_eq!(lrange(&mut con, "q:r"), bytes(&["raw-ms"]));
    assert_eq!(zcard(&mut con, "src:ms"), 0);
    redis::cmd("DEL").arg("q:r").exec(&mut con).unwrap();

    // Raw seconds source with a fractional score: due at T_S exactly, to the ms.
    const T_S: &str = "1900000000.250";
    const T_S_MS: i64 = 1_900_000_000_250;
    redis::cmd("ZADD")
        .arg("src:s")
        .arg(T_S)
        .arg("raw-s")
        .exec(&mut con)
        .unwrap();
    let s = source(1);
    let reply = rt
        .block_on(poller::move_once(&ctx, &s, Some(T_S_MS - 1)))
        .unwrap();
    assert_eq!((reply.taken, reply.next_due), (0, Some(1_900_000_000.25)));
    assert_eq!(llen(&mut con, "q:r"), 0);
    assert_eq!(zcard(&mut con, "src:s"), 1);
    let reply = rt
        .block_on(poller::move_once(&ctx, &s, Some(T_S_MS)))
        .unwrap();
    assert_eq!((reply.taken, reply.moved_total()), (1, 1));
    assert_eq!(lrange(&mut con, "q:r"), bytes(&["raw-s"]));

    // Nothing else appeared: no dead keys, no leftovers.
    assert_shards_empty(&mut con, 2);
    assert_eq!(data_keys(&mut con), set(&["zdelay:schema", "q:r"]));
}

#[test]
fn never_early_by_redis_time_with_the_daemon() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        2,
        r#"
[[routes]]
name = "t"
sink = "local"
target = "q:t"
push = "rpush"

[[sources]]
key = "src:t"
route = "t"
"#,
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut consumer = redis.conn();
    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), 2);

    let now = redis_now_ms(&mut con);
    let mut dues = BTreeMap::new();
    for k in 0..15i64 {
        let due = now + 300 + 37 * k;
        let env = format!("env:{due}");
        rt.block_on(client.enqueue(NewJob::new("t", env.clone()).at(due), OnConflict::Error))
            .unwrap();
        let raw = format!("raw:{due}");
        redis::cmd("ZADD")
            .arg("src:t")
            .arg(due)
            .arg(&raw)
            .exec(&mut con)
            .unwrap();
        dues.insert(env, due);
        dues.insert(raw, due);
    }
    let mut worst = i64::MIN;
    for _ in 0..dues.len() {
        let (_, item, arrived) = pop_timed(&mut consumer, "BLPOP", &["q:t"]);
        let item = String::from_utf8(item).unwrap();
        let due = dues
            .remove(&item)
            .unwrap_or_else(|| panic!("unexpected or twice: {item}"));
        assert!(
            arrived >= due,
            "{item} arrived at {arrived}, before its due time {due}"
        );
        worst = worst.max(arrived - due);
    }
    assert!(dues.is_empty());
    assert!(worst < 1_000, "worst lateness {worst} ms");
    assert_shards_empty(&mut con, 2);
    assert_eq!(data_keys(&mut con), set(&["zdelay:schema"]));
}

#[test]
fn raw_sources_in_ms_and_s_deliver_members_as_is() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        r#"
[[routes]]
name = "rawms"
sink = "local"
target = "q:rawms"
push = "rpush"

[[routes]]
name = "raws"
sink = "local"
target = "q:raws"
push = "lpush"

[[sources]]
key = "delayed:ms"
score_unit = "ms"
route = "rawms"

[[sources]]
key = "delayed:s"
score_unit = "s"
route = "raws"
"#,
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    let secs = |ms: i64| format!("{:.3}", ms as f64 / 1000.0);
    let bin_ms: &[u8] = b"\0\xff\nbin-ms";
    let bin_s: &[u8] = b"\0\xfe\r\nbin-s";
    let far_ms = now + 3_600_000;
    let far_s = secs(now + 3_600_250);
    // (member, score as sent, due in ms)
    let ms_members: Vec<(Vec<u8>, String, i64)> = vec![
        (b"zero".to_vec(), "0".into(), 0),
        (b"past".to_vec(), (now - 5_000).to_string(), now - 5_000),
        (bin_ms.to_vec(), (now + 300).to_string(), now + 300),
        (b"later".to_vec(), (now + 600).to_string(), now + 600),
    ];
    let s_members: Vec<(Vec<u8>, String, i64)> = vec![
        (b"s-past".to_vec(), secs(now - 5_500), now - 5_500),
        (b"s-soon".to_vec(), secs(now + 450), now + 450),
        (bin_s.to_vec(), secs(now + 750), now + 750),
    ];
    let mut pipe = redis::pipe();
    for (m, score, _) in &ms_members {
        pipe.cmd("ZADD")
            .arg("delayed:ms")
            .arg(score)
            .arg(m)
            .ignore();
    }
    pipe.cmd("ZADD")
        .arg("delayed:ms")
        .arg(far_ms)
        .arg("far")
        .ignore();
    for (m, score, _) in &s_members {
        pipe.cmd("ZADD").arg("delayed:s").arg(score).arg(m).ignore();
    }
    pipe.cmd("ZADD")
        .arg("delayed:s")
        .arg(&far_s)
        .arg("s-far")
        .ignore();
    pipe.exec(&mut con).unwrap();

    let due_of: HashMap<Vec<u8>, i64> = ms_members
        .iter()
        .chain(&s_members)
        .map(|(m, _, due)| (m.clone(), *due))
        .collect();
    let lists = ["q:rawms", "q:raws"];
    wait_for("raw members delivered", Duration::from_secs(10), || {
        // Each snapshot is atomic with TIME: anything it shows was delivered by then.
        let (at, contents) = snapshot(&mut con, &lists);
        for item in contents.iter().flatten() {
            let due = due_of[item];
            assert!(
                at >= due,
                "{item:?} delivered by {at}, before its due {due}"
            );
        }
        contents[0].len() == ms_members.len() && contents[1].len() == s_members.len()
    });
    // RPUSH: left to right in due order; LPUSH: right to left.
    assert_eq!(
        lrange(&mut con, "q:rawms"),
        vec![
            b"zero".to_vec(),
            b"past".to_vec(),
            bin_ms.to_vec(),
            b"later".to_vec()
        ]
    );
    assert_eq!(
        lrange(&mut con, "q:raws"),
        vec![bin_s.to_vec(), b"s-soon".to_vec(), b"s-past".to_vec()]
    );
    // The far members stay, with their scores untouched; no dead keys appeared.
    assert_eq!(
        zrange_withscores(&mut con, "delayed:ms"),
        vec![(b"far".to_vec(), far_ms as f64)]
    );
    assert_eq!(
        zrange_withscores(&mut con, "delayed:s"),
        vec![(b"s-far".to_vec(), far_s.parse::<f64>().unwrap())]
    );
    assert_eq!(
        data_keys(&mut con),
        set(&[
            "zdelay:schema",
            "q:rawms",
            "q:raws",
            "delayed:ms",
            "delayed:s"
        ])
    );
}

#[test]
fn priority_lane_and_push_direction() {
    // One shard, so the envelope jobs leave strictly in due order whatever the lateness.
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        r#"
[[routes]]
name = "lane"
sink = "local"
target = "q:lane"
delayed_suffix = "-delayed"

[[routes]]
name = "left"
sink = "local"
target = "q:left"
push = "lpush"

[[routes]]
name = "right"
sink = "local"
target = "q:right"
push = "rpush"

[[sources]]
key = "delayed:lane"
route = "lane"
"#,
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), 1);
    // The workers' regular queue already holds work (producers LPUSH, workers BRPOP).
    redis::cmd("LPUSH")
        .arg("q:lane")
        .arg("regular-1")
        .arg("regular-2")
        .exec(&mut con)
        .unwrap();

    let now = redis_now_ms(&mut con);
    let mut jobs = Vec::new();
    for k in 0..5i64 {
        let due = now + 300 + 50 * k;
        for route in ["lane", "left", "right"] {
            jobs.push(NewJob::new(route, format!("{route}-{k}")).at(due));
        }
    }
    let results = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .unwrap();
    assert!(results.iter().all(|r| r.is_ok()));
    redis::cmd("ZADD")
        .arg("delayed:lane")
        .arg(now + 320)
        .arg("raw-lane")
        .exec(&mut con)
        .unwrap();

    wait_for("all delivered", Duration::from_secs(10), || {
        llen(&mut con, "q:lane-delayed") == 6
            && llen(&mut con, "q:left") == 5
            && llen(&mut con, "q:right") == 5
    });
    // The regular queue is untouched; due jobs sit in the lane only.
    assert_eq!(
        lrange(&mut con, "q:lane"),
        bytes(&["regular-2", "regular-1"])
    );
    assert_shards_empty(&mut con, 1);
    assert_eq!(
        data_keys(&mut con),
        set(&[
            "zdelay:schema",
            "q:lane",
            "q:lane-delayed",
            "q:left",
            "q:right"
        ])
    );

    // A worker watching the lane ahead of the queue gets every delayed job first.
    let mut lane_order = Vec::new();
    for _ in 0..8 {
        let (list, item, _) = pop_timed(&mut con, "BRPOP", &["q:lane-delayed", "q:lane"]);
        lane_order.push((list, String::from_utf8(item).unwrap()));
    }
    let from_lane: Vec<&str> = lane_order
        .iter()
        .take(6)
        .map(|(l, i)| {
            assert_eq!(l, "q:lane-delayed", "{i}: the lane comes first");
            i.as_str()
        })
        .collect();
    // Envelope jobs in due order; the raw member (another poller) somewhere among them.
    let envelope: Vec<&str> = from_lane
        .iter()
        .copied()
        .filter(|i| *i != "raw-lane")
        .collect();
    assert_eq!(envelope, ["lane-0", "lane-1", "lane-2", "lane-3", "lane-4"]);
    assert!(from_lane.contains(&"raw-lane"));
    assert_eq!(
        lane_order[6..],
        [
            ("q:lane".to_owned(), "regular-1".to_owned()),
            ("q:lane".to_owned(), "regular-2".to_owned())
        ]
    );
    // LPUSH: BRPOP consumers get FIFO. RPUSH: BLPOP consumers get FIFO.
    let left: Vec<String> = (0..5)
        .map(|_| String::from_utf8(pop_timed(&mut con, "BRPOP", &["q:left"]).1).unwrap())
        .collect();
    assert_eq!(left, ["left-0", "left-1", "left-2", "left-3", "left-4"]);
    let right: Vec<String> = (0..5)
        .map(|_| String::from_utf8(pop_timed(&mut con, "BLPOP", &["q:right"]).1).unwrap())
        .collect();
    assert_eq!(
        right,
        ["right-0", "right-1", "right-2", "right-3", "right-4"]
    );
    assert_eq!(data_keys(&mut con), set(&["zdelay:schema"]));
}

/// Lateness bound for the wake-up tests: far below the 5 s idle poll they configure, so
/// only a wake-up followed by a sleep until the head can meet it; loose enough for a 2-core
/// machine busy compiling (typically 1–5 ms; 571 ms seen once at load 5). Timing numbers
/// belong to the benchmark.
const WAKE_BOUND_MS: i64 = 1_000;

/// Config with a 5 s idle poll: the fallback would be 5× too slow for `WAKE_BOUND_MS`.
const IDLE_5S: &str = r#"
[poller]
idle_poll = "5s"

[[routes]]
name = "w"
sink = "local"
target = "q:w"
push = "rpush"
"#;

#[test]
fn wake_up_delivers_within_milliseconds_while_idle_poll_is_5s() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 2, IDLE_5S);
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut consumer = redis.conn();
    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), 2);
    wait_for(
        "the wake listener subscribed",
        Duration::from_secs(10),
        || subscribers(&mut con, "zdelay:wake") >= 1,
    );
    let due_of = |id: &str| -> i64 {
        let job = rt.block_on(client.get(id)).unwrap().expect("job stored");
        assert_eq!(job.state, JobState::Scheduled);
        job.score.expect("due score") as i64
    };
    let mut check = |what: &str, expect: &str, due: i64| {
        let (_, item, arrived) = pop_timed(&mut consumer, "BLPOP", &["q:w"]);
        assert_eq!(item, expect.as_bytes(), "{what}");
        let late = arrived - due;
        assert!(
            (0..WAKE_BOUND_MS).contains(&late),
            "{what}: lateness {late} ms (idle poll is 5 s; a wake-up should make it ~0)"
        );
    };

    // 1. Library, `.after(300ms)`, into an empty, idle shard.
    for round in 0..2 {
        let payload = format!("after-{round}");
        let (id, _) = rt
            .block_on(client.enqueue(
                NewJob::new("w", payload.clone()).after(Duration::from_millis(300)),
                OnConflict::Error,
            ))
            .unwrap();
        check("library .after(300ms)", &payload, due_of(&id));
    }

    // 2. A new head in a shard whose poller sleeps until a later head: woken, it sleeps
    //    until the new head, then until the old one (sleep-until-head, not the idle poll).
    let (later, _) = rt
        .block_on(
            client.enqueue(
                NewJob::new("w", "later")
                    .id("{w}:later")
                    .after(Duration::from_millis(2_000)),
                OnConflict::Error,
            ),
        )
        .unwrap();
    let (soon, _) = rt
        .block_on(
            client.enqueue(
                NewJob::new("w", "soon")
                    .id("{w}:soon")
                    .after(Duration::from_millis(300)),
                OnConflict::Error,
            ),
        )
        .unwrap();
    let (due_soon, due_later) = (due_of(&soon), due_of(&later));
    check("new head", "soon", due_soon);
    check("old head after the new one", "later", due_later);

    // 3. The CLI, `--in 300ms`.
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "w",
        "--in",
        "300ms",
        "--payload",
        "cli",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    check("CLI --in 300ms", "cli", due_of(&id));

    assert_shards_empty(&mut con, 2);
    assert_eq!(data_keys(&mut con), set(&["zdelay:schema"]));
}

/// ZADDs `member` due in 200 ms into `delayed:kn` and checks it arrives on time.
fn deliver_raw_on_time(
    con: &mut redis::Connection,
    consumer: &mut redis::Connection,
    member: &str,
) {
    let due = redis_now_ms(con) + 200;
    redis::cmd("ZADD")
        .arg("delayed:kn")
        .arg(due)
        .arg(member)
        .exec(con)
        .unwrap();
    let (_, item, arrived) = pop_timed(consumer, "BLPOP", &["q:w"]);
    assert_eq!(item, member.as_bytes());
    let late = arrived - due;
    assert!(
        (0..WAKE_BOUND_MS).contains(&late),
        "{member}: lateness {late} ms (idle poll is 5 s)"
    );
}

#[test]
fn keyspace_notifications_wake_raw_source_pollers() {
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Kz"]);
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!("{IDLE_5S}\n[[sources]]\nkey = \"delayed:kn\"\nroute = \"w\"\n"),
    );
    let daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut consumer = redis.conn();
    wait_for("the keyspace subscription", Duration::from_secs(10), || {
        subscribers(&mut con, "__keyspace@0__:delayed:kn") >= 1
    });
    // Into an empty source.
    deliver_raw_on_time(&mut con, &mut consumer, "first");
    deliver_raw_on_time(&mut con, &mut consumer, "second");
    // Into a source whose head is an hour away: the poller sleeps the idle 5 s.
    let far = redis_now_ms(&mut con) + 3_600_000;
    redis::cmd("ZADD")
        .arg("delayed:kn")
        .arg(far)
        .arg("far")
        .exec(&mut con)
        .unwrap();
    deliver_raw_on_time(&mut con, &mut consumer, "before-far");

    assert_eq!(
        zrange_withscores(&mut con, "delayed:kn"),
        vec![(b"far".to_vec(), far as f64)]
    );
    assert_eq!(data_keys(&mut con), set(&["zdelay:schema", "delayed:kn"]));
    let (_, metrics) = daemon.admin_get("/metrics").unwrap();
    let wakeups = metric_value(&metrics, "zdelay_wakeups_total", &[("cause", "keyspace")]);
    assert!(
        wakeups.unwrap_or(0.0) >= 3.0,
        "keyspace wake-ups: {wakeups:?}"
    );
}

#[test]
fn hand_written_json_envelopes_are_delivered_decoded() {
    // DESIGN §3: a producer may HSET a JSON envelope and ZADD its id itself. On storage layout
    // 2 envelopes are what the spread shards hold (two-phase routes: here a remote Redis
    // sink, a second server); a local route's lane holds raw payloads, written by hand in
    // `idle_shards_back_off_to_idle_poll_max_once_wake_ups_are_confirmed`.
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        2,
        &format!(
            r#"
[sinks.remote]
kind = "redis"
url = "{}"

[[routes]]
name = "j"
sink = "remote"
target = "q:j"
push = "rpush"
"#,
            remote.url()
        ),
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut rcon = remote.conn();
    let keys = Keys::new(NS, 2);
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let binary: &[u8] = b"\0\xff\xfe binary \n\r\0";
    // (id, envelope, payload expected on the list). Ids share a tag: one shard, id order.
    let cases: Vec<(&str, String, Vec<u8>)> = vec![
        (
            "{j}:1",
            serde_json::json!({"v": 1, "dest": "j", "payload": b64(binary),
                "payload_encoding": "base64", "due": 0, "headers": {"k": "v"}, "custom": 7})
            .to_string(),
            binary.to_vec(),
        ),
        // Base64 padding: two and one trailing '='.
        (
            "{j}:2",
            serde_json::json!({"v": 1, "dest": "j", "payload": b64(b"\0"),
                "payload_encoding": "base64"})
            .to_string(),
            b"\0".to_vec(),
        ),
        (
            "{j}:3",
            serde_json::json!({"v": 1, "dest": "j", "payload": b64(b"\xff\x00"),
                "payload_encoding": "base64"})
            .to_string(),
            b"\xff\x00".to_vec(),
        ),
        (
            "{j}:4",
            serde_json::json!({"v": 1, "dest": "j", "payload": "h\u{e9}llo \u{2713} \"q\"\n"})
                .to_string(),
            "h\u{e9}llo \u{2713} \"q\"\n".as_bytes().to_vec(),
        ),
        (
            "{j}:5",
            serde_json::json!({"v": 1, "dest": "j", "payload": "{\"a\":1}",
                "payload_encoding": "utf8"})
            .to_string(),
            b"{\"a\":1}".to_vec(),
        ),
    ];
    let shard = keys.shard_of("{j}:1");
    let due = redis_now_ms(&mut con) + 300;
    let mut pipe = redis::pipe();
    pipe.atomic();
    for (id, envelope, _) in &cases {
        pipe.cmd("HSET")
            .arg(keys.jobs(shard))
            .arg(*id)
            .arg(envelope)
            .ignore();
        pipe.cmd("ZADD")
            .arg(keys.due(shard))
            .arg(due)
            .arg(*id)
            .ignore();
    }
    pipe.exec(&mut con).unwrap();

    wait_for("JSON envelopes delivered", Duration::from_secs(10), || {
        llen(&mut rcon, "q:j") == cases.len()
    });
    let expected: Vec<Vec<u8>> = cases.iter().map(|(_, _, p)| p.clone()).collect();
    assert_eq!(lrange(&mut rcon, "q:j"), expected);
    common::wait_spread_settled(&mut con, 2, Duration::from_secs(10));
    assert_shards_empty(&mut con, 2);
    // Left: the shard's claim counter (never deleted) and the sinks' states.
    let lease_seq = keys.shard(shard).lease_seq;
    assert_eq!(
        data_keys(&mut con),
        set(&["zdelay:schema", &lease_seq, "{zdelay}:sinks"])
    );
}

/// Script calls (`EVALSHA`) the server has run since it started.
fn evalsha_calls(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(con)
        .expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// While wake-ups are confirmed (the daemon's probe on the wake channel comes back), idle
/// shards are polled every `idle_poll_max` instead of every `idle_poll`, so an idle daemon's
/// cost does not grow with its shards; a job enqueued through the library still goes out at
/// once (its wake-up arrives), and one written by hand without the `PUBLISH` within
/// `idle_poll_max`.
#[test]
fn idle_shards_back_off_to_idle_poll_max_once_wake_ups_are_confirmed() {
    const SHARDS: u16 = 16;
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[poller]
idle_poll = "50ms"
idle_poll_max = "2s"

[[routes]]
name = "w"
sink = "local"
target = "q:w"
push = "rpush"
"#,
    );
    let _daemon = Daemon::start(&config);
    let mut con = redis.conn();
    let mut consumer = redis.conn();
    // Script calls per second over a 2 s window: 16 shards every 50 ms would be 320 a second;
    // every 2 s, 8 (plus the daemon's slot leases and stats).
    let rate = |con: &mut redis::Connection| {
        let before = evalsha_calls(con);
        std::thread::sleep(Duration::from_secs(2));
        (evalsha_calls(con) - before) / 2
    };
    let mut last = u64::MAX;
    wait_for("idle polls backed off", Duration::from_secs(30), || {
        last = rate(&mut con);
        last < 60
    });
    eprintln!("{last} script calls a second with {SHARDS} idle shards");

    let rt = common::runtime();
    let client = connect(&rt, &redis.url(), SHARDS);
    let (id, _) = rt
        .block_on(client.enqueue(
            NewJob::new("w", "woken").after(Duration::from_millis(300)),
            OnConflict::Error,
        ))
        .unwrap();
    let due = rt
        .block_on(client.get(&id))
        .unwrap()
        .unwrap()
        .score
        .unwrap() as i64;
    let (_, item, arrived) = pop_timed(&mut consumer, "BLPOP", &["q:w"]);
    assert_eq!(item, b"woken");
    assert!(
        (0..WAKE_BOUND_MS).contains(&(arrived - due)),
        "a library enqueue wakes the poller: lateness {} ms",
        arrived - due
    );

    // Written by hand into the route's lane (its raw payload), no PUBLISH: found by the next
    // idle poll, at most 2 s later.
    let lane = lane_keys("w", "q:w");
    let due = redis_now_ms(&mut con);
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("HSET")
        .arg(&lane.jobs)
        .arg("h1")
        .arg("by hand")
        .ignore()
        .cmd("ZADD")
        .arg(&lane.due)
        .arg(due)
        .arg("h1")
        .ignore();
    pipe.exec(&mut con).unwrap();
    let (_, item, arrived) = pop_timed(&mut consumer, "BLPOP", &["q:w"]);
    assert_eq!(item, b"by hand");
    assert!(
        arrived - due < 2_000 + WAKE_BOUND_MS,
        "found by an idle poll within idle_poll_max: {} ms",
        arrived - due
    );
}

/// `move_raw` reads a batch in chunks (the byte budget: it cannot know a member's size before
/// reading it) and pushes each chunk as read: the list must still hold the batch in due
/// order, for either push side, and a budget must stop the batch at the member it cannot hold.
#[test]
fn a_raw_batch_read_in_chunks_reaches_the_list_in_due_order_and_stops_at_the_byte_budget() {
    use zdelay::config::{Push, ScoreUnit};
    use zdelay::keys::RawKeys;
    use zdelay::store::Conn;
    use zdelay::store::scripts::{self, MoveRaw};
    let redis = RedisServer::start();
    let rt = common::runtime();
    let mut con = rt
        .block_on(Conn::connect(&redis_config(&redis.url(), 1)))
        .expect("connect");
    let mut plain = redis.conn();
    let now = redis_now_ms(&mut plain);
    // Members of 100 bytes, named in due order; scores in reverse order of insertion so that
    // insertion order cannot pass for due order.
    let load = |con: &mut redis::Connection, key: &str, n: usize| -> Vec<Vec<u8>> {
        let members: Vec<Vec<u8>> = (0..n).map(|i| format!("{i:0>100}").into_bytes()).collect();
        for (i, m) in members.iter().enumerate().rev() {
            let _: () = redis::cmd("ZADD")
                .arg(key)
                .arg(now - 10_000 + i as i64)
                .arg(m)
                .query(con)
                .unwrap();
        }
        members
    };
    let mut call = |source: &str, list: &str, push: Push, max_payload: usize, bytes: usize| {
        let args = MoveRaw {
            batch: 1000,
            now_ms: None,
            unit: ScoreUnit::Millis,
            max_payload,
            batch_bytes: bytes,
            list,
            push,
            bounds_ms: &[1, 1_000, 60_000],
        };
        rt.block_on(scripts::move_raw(
            &mut con,
            &RawKeys::new(source, None),
            &args,
        ))
        .expect("move_raw")
    };

    // 300 small members: a first chunk of 4, then chunks of 64.
    let members = load(&mut plain, "delayed:r", 300);
    let reply = call("delayed:r", "q:r", Push::Rpush, 1 << 20, 4 << 20);
    assert_eq!((reply.moved_total(), reply.kept), (300, 0), "{reply:?}");
    assert_eq!(lrange(&mut plain, "q:r"), members, "RPUSH: head first");
    assert_eq!(reply.buckets.iter().sum::<u64>(), 300, "{reply:?}");

    let members = load(&mut plain, "delayed:l", 300);
    let reply = call("delayed:l", "q:l", Push::Lpush, 1 << 20, 4 << 20);
    assert_eq!(reply.moved_total(), 300, "{reply:?}");
    let mut reversed = members.clone();
    reversed.reverse();
    assert_eq!(
        lrange(&mut plain, "q:l"),
        reversed,
        "LPUSH: the earliest at the tail"
    );

    // A budget of 1,024 bytes holds 10 members of 100: each call moves 10, in order.
    let members = load(&mut plain, "delayed:b", 35);
    let mut calls = 0;
    loop {
        let reply = call("delayed:b", "q:b", Push::Rpush, 4096, 1024);
        calls += 1;
        assert!(reply.moved_total() <= 10, "over the budget: {reply:?}");
        if reply.moved_total() < 10 {
            break;
        }
    }
    assert_eq!(calls, 4, "10 + 10 + 10 + 5");
    assert_eq!(lrange(&mut plain, "q:b"), members);
    let left: u64 = redis::cmd("ZCARD")
        .arg("delayed:b")
        .query(&mut plain)
        .unwrap();
    assert_eq!(left, 0);
}
