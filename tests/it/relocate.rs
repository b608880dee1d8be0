//! A route lane relocated (storage layout 2): the route's list moves to another hash slot while
//! a producer enqueues, and the daemon restarted with the new config moves the old lane's
//! waiting jobs, `unique_for` windows and debounce deadlines into the new lane — through a
//! kill -9 in the middle of the move — on one Redis and on a Redis Cluster. Every job arrives
//! once (at the old list if delivered before, else at the new one), none before its due, and
//! jobs in the middle of the move are found and cancelled by id.

use crate::common::{self, Daemon, RedisCluster, RedisServer, TestConfig, wait_for};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zdelay::config::RedisConfig;
use zdelay::job::{Cancelled, Enqueued};
use zdelay::{Client, ClientError, NewJob, OnConflict};

/// Jobs the producer enqueues, in batches, while the route moves.
const TOTAL: usize = 2_000;
const BATCH: usize = 50;

fn route(list: &str) -> String {
    format!(
        "[poller]\nidle_poll = \"50ms\"\n\n[[routes]]\nname = \"a\"\nsink = \"local\"\n\
         target = \"{list}\"\npush = \"rpush\"\n"
    )
}

/// A payload popped from a list, and Redis's clock (ms) just after the pop.
type Popped = (String, &'static str, i64);

/// Retries `call` while it fails with a retryable error (a job in the middle of the move is
/// waited for a moment, then reported retryable), for up to 60 s.
fn answered<T>(mut call: impl FnMut() -> Result<T, ClientError>) -> T {
    let started = Instant::now();
    loop {
        match call() {
            Ok(out) => return out,
            Err(e) if e.is_retryable() && started.elapsed() < Duration::from_secs(60) => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// The relocation end to end: `old` and `new` configs name lists in two slots; `lists` are
/// their names; `con` and `consumer` connect to the scheduling Redis (or cluster).
fn relocates_every_job_once_never_early(
    old: &TestConfig,
    new: &TestConfig,
    lists: [&'static str; 2],
    redis: RedisConfig,
    mut con: impl redis::ConnectionLike,
    mut consumer: impl redis::ConnectionLike + Send + 'static,
) {
    assert_ne!(
        zdelay::keys::slot_of(lists[0]),
        zdelay::keys::slot_of(lists[1]),
        "the lists are in two slots"
    );
    let rt = common::runtime();
    let mut first = Daemon::start(old);
    let lib = rt.block_on(Client::connect(&redis)).expect("client");
    let now = common::redis_now_ms_any(&mut con);

    // Jobs looked for by id while they move, and windows that must move with them: one
    // delivered before the move (its window in the old lane), one waiting through it (its
    // window travels with it), one debounced (its deadline stays the first enqueue's).
    let far = NewJob::new("a", "get-me").at(now + 120_000);
    let (get_me, _) = rt.block_on(lib.enqueue(far, OnConflict::Error)).unwrap();
    let far = NewJob::new("a", "cancel-me").at(now + 120_000);
    let (cancel_me, _) = rt.block_on(lib.enqueue(far, OnConflict::Error)).unwrap();
    let window = Duration::from_secs(600);
    let unique = |id: &str, due: i64| {
        NewJob::new("a", id.to_owned())
            .id(id)
            .at(due)
            .unique_for(window)
    };
    rt.block_on(lib.enqueue(unique("uniq-before", now), OnConflict::Error))
        .unwrap();
    rt.block_on(lib.enqueue(unique("uniq-after", now + 8_000), OnConflict::Error))
        .unwrap();
    let debounce = OnConflict::Debounce {
        max_wait: Duration::from_secs(60),
    };
    let deb = NewJob::new("a", "deb").id("deb").at(now + 30_000);
    rt.block_on(lib.enqueue(deb, debounce)).unwrap();

    // A consumer pops both lists and notes Redis's clock after each pop: a job popped before
    // its due was pushed before it.
    let popped: Arc<Mutex<Vec<Popped>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let consuming = {
        let (popped, stop) = (popped.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut none = true;
                for list in lists {
                    let items: Option<Vec<String>> = redis::cmd("LPOP")
                        .arg(list)
                        .arg(1000)
                        .query(&mut consumer)
                        .expect("LPOP");
                    let Some(items) = items else { continue };
                    none = false;
                    let at = common::redis_now_ms_any(&mut consumer);
                    let mut popped = popped.lock().unwrap();
                    popped.extend(items.into_iter().map(|p| (p, list, at)));
                }
                if none {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        })
    };
    let count = |popped: &Mutex<Vec<Popped>>, prefix: &str| {
        popped
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| p.starts_with(prefix))
            .count()
    };

    // The producer: batches of jobs due 0.3–6 s ahead, before, through and after the move.
    let dues: Arc<Mutex<BTreeMap<String, i64>>> = Arc::default();
    std::thread::scope(|scope| {
        let producer = scope.spawn(|| {
            for b in 0..TOTAL / BATCH {
                let at = now + b as i64 * 100;
                let jobs: Vec<NewJob> = (b * BATCH..(b + 1) * BATCH)
                    .map(|i| {
                        let due = at + 300 + (i as i64 * 7919 % 5_700);
                        dues.lock().unwrap().insert(format!("p{i}"), due);
                        NewJob::new("a", format!("p{i}")).at(due)
                    })
                    .collect();
                // A job refused while its lane is being retired wrote nothing: sent again.
                let mut pending = jobs;
                while !pending.is_empty() {
                    let answers = rt
                        .block_on(lib.enqueue_batch(pending.clone(), OnConflict::Error))
                        .expect("enqueue");
                    let mut again = Vec::new();
                    for (job, answer) in pending.into_iter().zip(answers) {
                        match answer {
                            Ok(_) => {}
                            Err(e) if e.is_retryable() => again.push(job),
                            Err(e) => panic!("{e}"),
                        }
                    }
                    pending = again;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });

        wait_for(
            "deliveries at the old list",
            Duration::from_secs(30),
            || count(&popped, "p") >= 100,
        );
        first.signal(libc::SIGTERM);
        first.wait_exit(Duration::from_secs(10));
        // Restarted with the new list: held after its first put (the earliest jobs are in
        // both lanes, the rest in the old one), then killed.
        let dir = tempfile::tempdir().unwrap();
        let hold = dir.path().join("put");
        let env = format!("relocate_after_put={}", hold.display());
        let mut moving = Daemon::spawn_with_env(new, &[("ZDELAY_FAILPOINT", env.as_str())]);
        wait_for(
            "the relocation put a batch",
            Duration::from_secs(30),
            || hold.with_extension("reached").exists(),
        );
        // Looked for by id in the middle of the move: answered once it is where it goes.
        let found = scope.spawn(|| answered(|| rt.block_on(lib.get(&get_me))));
        let cancelled = scope.spawn(|| answered(|| rt.block_on(lib.cancel(&cancel_me))));
        std::thread::sleep(Duration::from_millis(300));
        moving.kill9();
        let restarted = Daemon::spawn(new);
        let found = found.join().unwrap().expect("get-me is found");
        assert_eq!(found.envelope.as_ref().unwrap().payload, b"get-me");
        assert_eq!(found.score, Some((now + 120_000) as f64));
        assert_eq!(cancelled.join().unwrap(), Cancelled::Cancelled);
        producer.join().unwrap();

        wait_for("every job delivered", Duration::from_secs(60), || {
            count(&popped, "p") >= TOTAL && count(&popped, "uniq-after") == 1
        });
        // A moment more: a job delivered twice would show now.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        consuming.join().unwrap();
        let log = restarted.log_text();
        assert!(log.contains("relocated"), "{log}");
        drop(restarted);
    });

    let popped = popped.lock().unwrap();
    let dues = dues.lock().unwrap();
    let mut times: BTreeMap<&str, u32> = BTreeMap::new();
    let mut early = Vec::new();
    for (payload, list, at) in popped.iter() {
        *times.entry(payload).or_default() += 1;
        if let Some(due) = dues.get(payload)
            && at < due
        {
            early.push(format!("{payload} at {at} due {due} ({list})"));
        }
    }
    let missing: Vec<&String> = dues
        .keys()
        .filter(|p| !times.contains_key(p.as_str()))
        .collect();
    let twice: Vec<(&&str, &u32)> = times.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        missing.is_empty(),
        "{} missing: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert!(twice.is_empty(), "delivered twice: {twice:?}");
    assert!(early.is_empty(), "early: {early:?}");
    let at_new = popped.iter().filter(|(_, l, _)| *l == lists[1]).count();
    assert!(at_new > 0, "nothing reached the new list");
    assert!(
        !times.contains_key("cancel-me"),
        "a cancelled job was delivered"
    );
    drop(popped);

    // The windows moved with the jobs: both unique ids are duplicates now, and the debounced
    // job keeps the deadline of its first enqueue (not the waiting due it had).
    let again = |id: &str| {
        rt.block_on(lib.enqueue(unique(id, now), OnConflict::Replace))
            .unwrap()
            .1
    };
    assert_eq!(again("uniq-before"), Enqueued::Duplicate);
    assert_eq!(again("uniq-after"), Enqueued::Duplicate);
    let later = common::redis_now_ms_any(&mut con);
    let deb = NewJob::new("a", "deb").id("deb").at(later + 100_000);
    rt.block_on(lib.enqueue(deb, debounce)).unwrap();
    let deb = rt.block_on(lib.get("deb")).unwrap().expect("deb waits");
    let due = deb.score.unwrap() as i64;
    assert!(
        due > now + 30_000 && due <= later + 60_000 && due <= now + 61_000,
        "debounced to {due}: its first deadline was about {}",
        now + 60_000
    );
    assert!(rt.block_on(lib.get(&cancel_me)).unwrap().is_none());
    // The old lane is gone, and so is the record of what moved.
    let old_tag = zdelay::keys::slot_tag(zdelay::keys::slot_of(lists[0]));
    let new_tag = zdelay::keys::slot_tag(zdelay::keys::slot_of(lists[1]));
    for key in [
        format!("zdelay:{{{old_tag}}}:due:a"),
        format!("zdelay:{{{old_tag}}}:jobs:a"),
        format!("zdelay:{{{old_tag}}}:windows:a"),
        format!("zdelay:{{{new_tag}}}:transit_in:a"),
        format!("zdelay:{{{new_tag}}}:relocating:a"),
    ] {
        let n: u64 = redis::cmd("EXISTS").arg(&key).query(&mut con).unwrap();
        assert_eq!(n, 0, "{key} is left");
    }
}

#[test]
fn a_route_whose_list_moves_slot_keeps_every_job_through_a_kill_9() {
    let redis = RedisServer::start();
    let config = |list: &str| TestConfig::new(&redis.url(), 4, &route(list));
    relocates_every_job_once_never_early(
        &config("q:a"),
        &config("q:b"),
        ["q:a", "q:b"],
        common::redis_config(&redis.url(), 4),
        redis.conn(),
        redis.conn(),
    );
}

#[test]
fn on_a_cluster_a_route_whose_list_moves_slot_keeps_every_job_through_a_kill_9() {
    let cluster = RedisCluster::start();
    let config = |list: &str| cluster.config(4, &route(list));
    assert_ne!(
        cluster.master_of("q:a"),
        cluster.master_of("q:b"),
        "the two lists are on two masters"
    );
    relocates_every_job_once_never_early(
        &config("q:a"),
        &config("q:b"),
        ["q:a", "q:b"],
        cluster.redis_config(4),
        cluster.conn(),
        cluster.conn(),
    );
}
