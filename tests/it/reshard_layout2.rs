//! `zdelay reshard` on storage layout 2, on one Redis and on a Redis Cluster: the spread shards
//! (the two-phase jobs of a NATS JetStream route and a remote-Redis route) go 16 → 4 → 32
//! while a producer (the library, and the CLI between the runs) enqueues and a daemon
//! delivers. Every job is counted where it arrives: none lost, none before its due, none
//! twice; a unique window, a debounce deadline, a recurring schedule and dead letters that
//! lived in the old shards hold in the new ones.

use crate::common::{
    Daemon, RedisCluster, RedisServer, Services, TestConfig, lrange, redis_now_ms_any, wait_for,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zdelay::config::RedisConfig;
use zdelay::schedules::{NewSchedule, Repeat};
use zdelay::{Client, Enqueued, NewJob, OnConflict};

/// Where the namespace lives.
enum Place {
    One(RedisServer),
    Cluster(RedisCluster),
}

impl Place {
    fn config(&self, shards: u16, extra: &str) -> TestConfig {
        match self {
            Place::One(r) => TestConfig::new(&r.url(), shards, extra),
            Place::Cluster(c) => c.config(shards, extra),
        }
    }

    fn redis_config(&self, shards: u16) -> RedisConfig {
        match self {
            Place::One(r) => crate::common::redis_config(&r.url(), shards),
            Place::Cluster(c) => c.redis_config(shards),
        }
    }

    fn conn(&self) -> Box<dyn redis::ConnectionLike + Send> {
        match self {
            Place::One(r) => Box::new(r.conn()),
            Place::Cluster(c) => Box::new(c.conn()),
        }
    }
}

/// An item of the remote list, with Redis's time when it was popped.
type Popped = (Vec<u8>, i64);

/// A job the producer enqueued: its number, route and due ms (the payload is `p<n>:<due>`).
#[derive(Clone, Copy)]
struct Sent {
    n: usize,
    nats: bool,
    due: i64,
}

fn parse_payload(payload: &[u8]) -> Option<(usize, i64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (n, due) = text.strip_prefix('p')?.split_once(':')?;
    Some((n.parse().ok()?, due.parse().ok()?))
}

fn reshard(config: &TestConfig, to: u16) -> serde_json::Value {
    let out = config.cli(&["reshard", "--to", &to.to_string(), "--yes", "--json"]);
    assert!(
        out.status.success(),
        "reshard --to {to} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("reshard --json")
}

fn reshard_online(place: Place) {
    let services = Services::get();
    let (kind, nats_url) = services.nats_servers().pop().expect("a NATS server");
    let rt = crate::common::runtime();
    rt.block_on(crate::common::nats_version(kind, &nats_url));
    let (js, stream, prefix) = rt.block_on(crate::nats::make_stream(&nats_url));
    let remote = RedisServer::start();
    let config = place.config(
        16,
        &format!(
            r#"
[poller]
idle_poll = "50ms"

[sinks.bus]
kind = "nats"
url = "{nats_url}"

[sinks.other]
kind = "redis"
url = "{remote}"

[[routes]]
name = "n"
sink = "bus"
target = "{prefix}.due"

[[routes]]
name = "r"
sink = "other"
target = "q:r"
push = "rpush"
"#,
            remote = remote.url()
        ),
    );
    let daemon = Daemon::start(&config);
    let lib = rt
        .block_on(Client::connect(&place.redis_config(16)))
        .expect("library client");
    let mut con = place.conn();
    let now = redis_now_ms_any(&mut *con);

    // What lives in the old spread shards besides waiting jobs: a unique window of a
    // delivered job, a debounced job and its deadline, a recurring schedule, dead letters.
    let unique = || {
        NewJob::new("r", "unique")
            .id("u-1")
            .unique_for(Duration::from_secs(600))
    };
    assert_eq!(
        rt.block_on(lib.enqueue(unique(), OnConflict::Error))
            .unwrap()
            .1,
        Enqueued::Added
    );
    let debounce = OnConflict::Debounce {
        max_wait: Duration::from_secs(110),
    };
    let first = now + 100_000;
    rt.block_on(lib.enqueue(NewJob::new("r", "debounced").id("d-1").at(first), debounce))
        .unwrap();
    let mut spec = NewSchedule::new(
        "tick",
        "r",
        "tick",
        Repeat::Every(Duration::from_millis(300)),
    );
    spec.start_at = Some(now);
    rt.block_on(lib.schedule_set(spec)).expect("schedule set");
    const DEAD: usize = 20;
    let dead: Vec<NewJob> = (0..DEAD)
        .map(|i| {
            NewJob::new("r", format!("dead-{i}"))
                .id(format!("dead-{i}"))
                .at(now - 10_000)
                .max_lateness(Duration::from_millis(1))
        })
        .collect();
    for r in rt
        .block_on(lib.enqueue_batch(dead, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }
    let mut far = remote.conn();
    wait_for("the unique job delivered", Duration::from_secs(20), || {
        lrange(&mut far, "q:r").iter().any(|p| p == b"unique")
    });
    wait_for("the expired jobs dead", Duration::from_secs(20), || {
        rt.block_on(lib.operator().dead_list(100)).unwrap().len() == DEAD
    });

    // The consumer of the remote route: every item with Redis's time at its pop.
    let stop = Arc::new(AtomicBool::new(false));
    let popped: Arc<Mutex<Vec<Popped>>> = Arc::default();
    let consumer = {
        let (stop, popped) = (stop.clone(), popped.clone());
        let mut far = remote.conn();
        std::thread::spawn(move || {
            loop {
                let item: Option<(String, Vec<u8>)> = redis::cmd("BLPOP")
                    .arg("q:r")
                    .arg(0.1)
                    .query(&mut far)
                    .expect("BLPOP");
                match item {
                    Some((_, payload)) => {
                        let at = crate::common::redis_now_ms(&mut far);
                        popped.lock().unwrap().push((payload, at));
                    }
                    None if stop.load(Ordering::SeqCst) => return,
                    None => {}
                }
            }
        })
    };
    // The producer: batches of both routes due within 1.5 s, each job retried while its
    // error is retryable (none is expected: a refused call follows the new count).
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let retried = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (sent, retried, producing, lib) = (
            sent.clone(),
            retried.clone(),
            producing.clone(),
            lib.clone(),
        );
        let mut clock = place.conn();
        std::thread::spawn(move || {
            let rt = crate::common::runtime();
            let mut n = 0;
            while producing.load(Ordering::SeqCst) {
                let now = redis_now_ms_any(&mut *clock);
                let batch: Vec<Sent> = (n..n + 40)
                    .map(|n| Sent {
                        n,
                        nats: n.is_multiple_of(2),
                        due: now + (n as i64 * 37) % 1500,
                    })
                    .collect();
                n += 40;
                let mut pending = batch;
                while !pending.is_empty() {
                    let jobs = pending.iter().map(|s| {
                        NewJob::new(
                            if s.nats { "n" } else { "r" },
                            format!("p{}:{}", s.n, s.due),
                        )
                        .at(s.due)
                    });
                    let answers = rt
                        .block_on(lib.enqueue_batch(jobs.collect(), OnConflict::Error))
                        .expect("enqueue batch");
                    let mut again = Vec::new();
                    for (s, answer) in pending.iter().zip(answers) {
                        match answer {
                            Ok(_) => sent.lock().unwrap().push(*s),
                            Err(e) if e.is_retryable() => {
                                retried.fetch_add(1, Ordering::Relaxed);
                                again.push(*s);
                            }
                            Err(e) => panic!("job {} refused: {e}", s.n),
                        }
                    }
                    pending = again;
                    if !pending.is_empty() {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let enqueued = |at_least: usize| {
        wait_for("the producer enqueued", Duration::from_secs(60), || {
            sent.lock().unwrap().len() >= at_least
        })
    };
    // The CLI enqueues too, each run a new process with the config's (old) shard count.
    let cli_jobs = Mutex::new(Vec::new());
    let cli_enqueue = |n: usize| {
        let due = redis_now_ms_any(&mut *place.conn()) + 300;
        let out = config.cli(&[
            "enqueue",
            "--dest",
            if n.is_multiple_of(2) { "n" } else { "r" },
            "--at",
            &due.to_string(),
            "--payload",
            &format!("p{n}:{due}"),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        cli_jobs.lock().unwrap().push(Sent {
            n,
            nats: n.is_multiple_of(2),
            due,
        });
    };
    const CLI_BASE: usize = 10_000_000;

    enqueued(1_000);
    let down = reshard(&config, 4);
    assert_eq!(down["outcome"], "done", "{down}");
    assert_eq!(
        (down["from"].as_u64(), down["to"].as_u64()),
        (Some(16), Some(4))
    );
    assert_eq!(down["online"], true);
    assert!(down["moved"].as_u64().unwrap() > 0, "{down}");
    cli_enqueue(CLI_BASE);
    cli_enqueue(CLI_BASE + 1);
    let mid = sent.lock().unwrap().len();
    enqueued(mid + 1_000);
    let up = reshard(&config, 32);
    assert_eq!(up["outcome"], "done", "{up}");
    assert_eq!(
        (up["from"].as_u64(), up["to"].as_u64()),
        (Some(4), Some(32))
    );
    cli_enqueue(CLI_BASE + 2);
    cli_enqueue(CLI_BASE + 3);
    let late = sent.lock().unwrap().len();
    enqueued(late + 500);
    producing.store(false, Ordering::SeqCst);
    producer.join().expect("producer");
    let mut sent = sent.lock().unwrap().clone();
    sent.extend(cli_jobs.lock().unwrap().iter().copied());
    let (to_nats, to_redis): (Vec<Sent>, Vec<Sent>) = sent.iter().partition(|s| s.nats);

    // Every job arrives: the remote list's consumer and the stream.
    let rt_js = &rt;
    let stream_count = || {
        rt_js
            .block_on(async {
                let mut stream = js.get_stream(&stream).await.ok()?;
                stream.info().await.ok().map(|i| i.state.messages)
            })
            .unwrap_or(0)
    };
    let arrived = |popped: &[Popped]| {
        popped
            .iter()
            .filter(|(p, _)| parse_payload(p).is_some())
            .count()
    };
    wait_for("every job delivered", Duration::from_secs(90), || {
        arrived(&popped.lock().unwrap()) >= to_redis.len() && stream_count() >= to_nats.len() as u64
    });

    // The remote route: each job once, none popped before its due.
    let popped_jobs: Vec<(usize, i64, i64)> = popped
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(p, at)| parse_payload(p).map(|(n, due)| (n, due, *at)))
        .collect();
    let mut seen: BTreeMap<usize, u32> = BTreeMap::new();
    for &(n, due, at) in &popped_jobs {
        *seen.entry(n).or_default() += 1;
        assert!(at >= due, "job {n} popped at {at}, before its due {due}");
    }
    let twice: Vec<usize> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(n, _)| *n)
        .collect();
    let missing: Vec<usize> = to_redis
        .iter()
        .map(|s| s.n)
        .filter(|n| !seen.contains_key(n))
        .collect();
    println!(
        "remote route: {} jobs, {} delivered twice; {} producer retries",
        to_redis.len(),
        twice.len(),
        retried.load(Ordering::Relaxed)
    );
    assert!(missing.is_empty(), "lost: {missing:?}");
    assert!(twice.is_empty(), "delivered twice: {twice:?}");
    assert_eq!(
        seen.len(),
        to_redis.len(),
        "nothing the producer did not send"
    );

    // The stream: each job once (a duplicate publish would be a second message unless the
    // stream's duplicate window dropped it: zdelay's own retries reuse the message id), none
    // stored before its due.
    let count = stream_count();
    assert_eq!(count, to_nats.len() as u64, "stream messages");
    let messages = rt.block_on(async {
        let stream = js.get_stream(&stream).await.expect("stream");
        let mut out = Vec::new();
        for seq in 1..=count {
            out.push(stream.get_raw_message(seq).await.expect("message"));
        }
        out
    });
    let mut in_stream = BTreeMap::new();
    for m in &messages {
        let (n, due) = parse_payload(&m.payload).expect("a producer's payload");
        let stored = m.time.unix_timestamp_nanos() / 1_000_000;
        assert!(
            stored >= due as i128,
            "job {n} stored at {stored}, before its due {due}"
        );
        *in_stream.entry(n).or_insert(0) += 1;
    }
    let expected: std::collections::BTreeSet<usize> = to_nats.iter().map(|s| s.n).collect();
    assert_eq!(
        in_stream
            .keys()
            .copied()
            .collect::<std::collections::BTreeSet<_>>(),
        expected
    );

    // What lived in the old shards holds in the new ones.
    assert_eq!(
        rt.block_on(lib.enqueue(unique(), OnConflict::Error))
            .unwrap()
            .1,
        Enqueued::Duplicate,
        "the unique window moved with the shard"
    );
    rt.block_on(lib.enqueue(
        NewJob::new("r", "debounced").id("d-1").at(now + 400_000),
        debounce,
    ))
    .unwrap();
    let view = rt
        .block_on(lib.get("d-1"))
        .unwrap()
        .expect("the debounced job");
    let due = view.score.expect("a due") as i64;
    assert!(
        (first..=now + 110_000 + 1_000).contains(&due),
        "the debounce deadline moved with the shard: due {due}, first enqueue {now}"
    );
    assert_eq!(
        rt.block_on(lib.operator().dead_list(100)).unwrap().len(),
        DEAD,
        "dead letters moved"
    );
    assert!(rt.block_on(lib.schedule_get("tick")).unwrap().is_some());
    let ticks = || {
        popped
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == b"tick")
            .count()
    };
    let before = ticks();
    wait_for(
        "the schedule fires in its new shard",
        Duration::from_secs(10),
        || ticks() >= before + 3,
    );
    stop.store(true, Ordering::SeqCst);
    consumer.join().expect("consumer");

    // The namespace says 32 and nothing of a reshard; the daemon followed both in place.
    let field = |con: &mut dyn redis::ConnectionLike, name: &str| -> Option<String> {
        redis::cmd("HGET")
            .arg("zdelay:schema")
            .arg(name)
            .query(con)
            .unwrap()
    };
    let (shards, resharding) = (field(&mut *con, "shards"), field(&mut *con, "resharding"));
    assert_eq!((shards.as_deref(), resharding), (Some("32"), None));
    let log = daemon.log_text();
    assert!(
        log.matches("starting again").count() >= 2,
        "the daemon restarts its pollers at each fence: {log}"
    );
    // The old counts' spread shards hold nothing (their markers stay, fencing stale
    // processes).
    for old in [16, 4] {
        let keys = zdelay::keys::Keys::new("zdelay", old);
        for shard in 0..old {
            let k = keys.shard(shard);
            for key in [
                &k.jobs,
                &k.due,
                &k.inflight,
                &k.ready,
                &k.dead,
                &k.schedules,
                &k.unique,
                &k.windows,
            ] {
                let exists: bool = redis::cmd("EXISTS").arg(key).query(&mut *con).unwrap();
                assert!(!exists, "{key} left behind");
            }
            let marker: String = redis::cmd("GET").arg(&k.layout).query(&mut *con).unwrap();
            assert_eq!(marker, if old == 16 { "4" } else { "32" });
        }
    }
    rt.block_on(js.delete_stream(&stream))
        .expect("delete stream");
}

#[test]
fn layout_2_reshards_its_spread_shards_online_on_one_redis() {
    reshard_online(Place::One(RedisServer::start()));
}

#[test]
fn layout_2_reshards_its_spread_shards_online_on_a_redis_cluster() {
    reshard_online(Place::Cluster(RedisCluster::start()));
}

/// A layout-2 namespace of 4 spread shards with one remote-Redis route `r` (list `q:r` on
/// `remote`), a daemon delivering it and a library client; `extra` goes before the sink.
struct RemoteRoute {
    redis: RedisServer,
    remote: RedisServer,
    config: TestConfig,
    daemon: Daemon,
    rt: tokio::runtime::Runtime,
    lib: Client,
}

impl RemoteRoute {
    fn start(extra: &str) -> Self {
        let redis = RedisServer::start();
        let remote = RedisServer::start();
        let config = TestConfig::new(
            &redis.url(),
            4,
            &format!(
                "{extra}[sinks.other]\nkind = \"redis\"\nurl = \"{}\"\n\n[[routes]]\nname = \"r\"\nsink = \"other\"\ntarget = \"q:r\"\n",
                remote.url()
            ),
        );
        let daemon = Daemon::start(&config);
        let rt = crate::common::runtime();
        let lib = rt
            .block_on(Client::connect(&crate::common::redis_config(
                &redis.url(),
                4,
            )))
            .expect("library client");
        RemoteRoute {
            redis,
            remote,
            config,
            daemon,
            rt,
            lib,
        }
    }
}

/// A reshard held right after its fence (nothing moved yet): a lookup by id of a two-phase job
/// still in its old shard waits for it and then fails with a retryable error, never "not
/// found"; once the move runs, the same calls find the job in its new shard. Enqueues follow
/// the new count at once.
#[test]
fn lookups_by_id_wait_while_a_held_reshard_has_not_moved_the_job() {
    let RemoteRoute {
        redis,
        remote: _remote,
        config,
        daemon,
        rt,
        lib,
    } = RemoteRoute::start("");
    for id in ["keep", "cancel", "reschedule"] {
        rt.block_on(lib.enqueue(
            NewJob::new("r", id).id(id).after(Duration::from_secs(3600)),
            OnConflict::Error,
        ))
        .expect("enqueued");
    }
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    let mut held = std::process::Command::new(crate::common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["reshard", "--to", "8", "--yes"])
        .env(
            "ZDELAY_FAILPOINT",
            format!("reshard_after_fence={}", gate.display()),
        )
        .env("ZDELAY_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("zdelay reshard runs");
    let reached = gate.with_extension("reached");
    wait_for(
        "the reshard fenced its old shards",
        Duration::from_secs(20),
        || reached.exists(),
    );

    // New work goes to the new shards at once.
    let (id, _) = rt
        .block_on(lib.enqueue(
            NewJob::new("r", "new").after(Duration::from_secs(3600)),
            OnConflict::Error,
        ))
        .expect("an enqueue follows the new count");
    let new_keys = zdelay::keys::Keys::new("zdelay", 8);
    let mut con = redis.conn();
    let in_new: bool = redis::cmd("HEXISTS")
        .arg(new_keys.jobs(new_keys.shard_of(&id)))
        .arg(&id)
        .query(&mut con)
        .unwrap();
    assert!(in_new, "the new job is in its new shard");
    // Held: the job is still in its old shard. Not "not found": a retryable refusal.
    let err = rt.block_on(lib.get("keep")).expect_err("held");
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("resharded"), "{err}");
    // A cancel waits for the move, which the gate now lets run.
    let cancel = {
        let lib = lib.clone();
        std::thread::spawn(move || crate::common::runtime().block_on(lib.cancel("cancel")))
    };
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(&gate, "go").unwrap();
    assert_eq!(
        cancel.join().unwrap().expect("cancel"),
        zdelay::Cancelled::Cancelled
    );
    let status = held.wait().expect("reshard exits");
    let mut stderr = String::new();
    std::io::Read::read_to_string(held.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    let view = rt.block_on(lib.get("keep")).unwrap().expect("moved, found");
    assert_eq!(view.id, "keep");
    assert!(
        rt.block_on(lib.reschedule("reschedule", zdelay::Due::In(Duration::from_secs(7200))))
            .unwrap()
            .is_some()
    );
    assert!(rt.block_on(lib.get("cancel")).unwrap().is_none());
    drop(daemon);
}

/// The reshard killed (SIGKILL) after it wrote a batch into its new shard and before it deleted
/// it from the old one, with a daemon delivering meanwhile; run again, it finishes: every job
/// delivered once: the new shard remembers what it received, so a job the daemon delivered
/// from there between the two runs is not written again.
#[test]
fn a_killed_online_reshard_runs_again_to_the_end_with_each_job_delivered_once() {
    const JOBS: usize = 3_000;
    let RemoteRoute {
        redis,
        remote,
        config,
        daemon,
        rt,
        lib,
    } = RemoteRoute::start("[poller]\nidle_poll = \"50ms\"\n\n");
    let mut con = redis.conn();
    let base = crate::common::redis_now_ms(&mut con) + 1_500;
    let jobs: Vec<NewJob> = (0..JOBS)
        .map(|i| {
            let due = base + (i as i64 % 1_000);
            NewJob::new("r", format!("p{i}:{due}"))
                .id(format!("j{i}"))
                .at(due)
        })
        .collect();
    for r in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .unwrap()
    {
        r.expect("enqueued");
    }
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    let mut first = std::process::Command::new(crate::common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["reshard", "--to", "7", "--yes", "--ids-per-call", "200"])
        .env(
            "ZDELAY_FAILPOINT",
            format!("upgrade_after_put={}", gate.display()),
        )
        .env("ZDELAY_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("zdelay reshard runs");
    let reached = gate.with_extension("reached");
    wait_for(
        "a batch written into its new shard",
        Duration::from_secs(20),
        || reached.exists(),
    );
    // Jobs in both places while the daemon delivers from the new shards.
    first.kill().unwrap();
    first.wait().unwrap();
    let mut far = remote.conn();
    wait_for(
        "the daemon delivers what reached a new shard",
        Duration::from_secs(20),
        || crate::common::llen(&mut far, "q:r") > 0,
    );
    let second = reshard(&config, 7);
    assert_eq!(second["outcome"], "done", "{second}");
    assert_eq!(second["resumed"], true, "{second}");
    assert!(
        second["put_before"].as_u64().unwrap() > 0,
        "the first run left jobs in both shards: {second}"
    );

    wait_for("every job delivered", Duration::from_secs(60), || {
        crate::common::llen(&mut far, "q:r") >= JOBS
    });
    // Every job settled: nothing is left to deliver twice.
    let keys = zdelay::keys::Keys::new("zdelay", 7);
    crate::common::wait_all_settled_in(&mut con, &keys, Duration::from_secs(20));
    let mut seen = vec![0u32; JOBS];
    for item in lrange(&mut far, "q:r") {
        let (n, _) = parse_payload(&item).expect("a job's payload");
        seen[n] += 1;
    }
    let twice: Vec<usize> = (0..JOBS).filter(|&i| seen[i] > 1).collect();
    let missing: Vec<usize> = (0..JOBS).filter(|&i| seen[i] == 0).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    assert!(twice.is_empty(), "delivered twice: {twice:?}");
    let transit: Vec<String> = redis::cmd("KEYS")
        .arg("zdelay:*:transit_in")
        .query(&mut con)
        .unwrap();
    assert!(transit.is_empty(), "transit sets left: {transit:?}");
    drop(daemon);
}
