//! Fault tests against real `redis-server` and the real `zdelay run`: kill -9 mid-run,
//! SIGTERM mid-drain, a second signal, cancel and reschedule racing the mover, Redis down at
//! start-up, Redis restarted under the daemon, and the metrics a run leaves behind.
//!
//! Every test counts every job: payloads are unique (`p<i>`), so a duplicate or a loss shows
//! up as a count per payload, not just as a total.

use crate::common::{
    self, Daemon, RedisServer, SeededRng, TestConfig, layout2_keys, llen, lrange, redis_now_ms,
    stored_total, wait_for,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use zdelay::client::{Cancelled, Client, Due, NewJob, OnConflict};

/// Two routes: `a` → LPUSH `q:a`; `b` → RPUSH onto its priority lane `q:b-delayed`.
const ROUTES: &str = r#"
[[routes]]
name = "a"
sink = "local"
target = "q:a"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "rpush"
delayed_suffix = "-delayed"
"#;

const LIST_A: &str = "q:a";
const LIST_B: &str = "q:b-delayed";

fn config(redis: &RedisServer, shards: u16, extra: &str) -> TestConfig {
    TestConfig::new(&redis.url(), shards, &format!("{extra}\n{ROUTES}"))
}

fn enqueue_all(rt: &tokio::runtime::Runtime, client: &Client, jobs: Vec<NewJob>) {
    for chunk in jobs.chunks(20_000) {
        let results = rt
            .block_on(client.enqueue_batch(chunk.to_vec(), OnConflict::Error))
            .expect("batch enqueue");
        for r in results {
            r.expect("every job is accepted");
        }
    }
}

/// `p<i>` on route `a` for even `i`, `b` for odd.
fn job(i: usize) -> NewJob {
    NewJob::new(if i.is_multiple_of(2) { "a" } else { "b" }, format!("p{i}"))
}

fn delivered(con: &mut redis::Connection) -> usize {
    llen(con, LIST_A) + llen(con, LIST_B)
}

/// How many times each `p<i>` (i < total) sits in the lists; panics on a foreign payload or
/// a payload in the wrong route's list.
fn delivery_counts(con: &mut redis::Connection, total: usize) -> Vec<u32> {
    let mut counts = vec![0u32; total];
    for (list, parity) in [(LIST_A, 0), (LIST_B, 1)] {
        for payload in lrange(con, list) {
            let text = String::from_utf8(payload).expect("utf-8 payload");
            let i: usize = text
                .strip_prefix('p')
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("foreign payload {text:?} in {list}"));
            assert!(i < total, "payload {text} out of range");
            assert_eq!(i % 2, parity, "{text} landed in {list}, the wrong route");
            counts[i] += 1;
        }
    }
    counts
}

/// Asserts each of `p0..p<total>` was delivered exactly once.
fn assert_exactly_once(con: &mut redis::Connection, total: usize) {
    let counts = delivery_counts(con, total);
    let missing: Vec<usize> = (0..total).filter(|&i| counts[i] == 0).collect();
    let duplicated: Vec<usize> = (0..total).filter(|&i| counts[i] > 1).collect();
    assert!(
        missing.is_empty() && duplicated.is_empty(),
        "{} missing (first {:?}), {} duplicated (first {:?})",
        missing.len(),
        &missing[..missing.len().min(10)],
        duplicated.len(),
        &duplicated[..duplicated.len().min(10)]
    );
}

/// Nothing stored in any route lane or spread shard.
fn assert_nothing_stored(con: &mut redis::Connection) {
    for kind in ["due", "jobs", "inflight", "dead", "reasons"] {
        assert_eq!(stored_total(con, kind), 0, "{kind} should be empty");
    }
}

/// Jobs whose due time has passed and that are still waiting, over every lane.
fn due_now(con: &mut redis::Connection) -> usize {
    let now = redis_now_ms(con);
    layout2_keys(con, "due")
        .into_iter()
        .map(|key| {
            redis::cmd("ZCOUNT")
                .arg(key)
                .arg("-inf")
                .arg(now)
                .query::<usize>(con)
                .expect("ZCOUNT")
        })
        .sum()
}

fn local_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// kill -9 the daemon at least five times during a 100k-job run, restarting it each time:
/// every job is delivered exactly once, and nothing is left behind.
#[test]
fn kill9_repeatedly_during_a_run_delivers_every_job_exactly_once() {
    const TOTAL: usize = 100_000;
    const SHARDS: u16 = 4;
    let redis = RedisServer::start();
    let config = config(&redis, SHARDS, "");
    let rt = common::runtime();
    let lib = config.client(&rt);
    let mut con = redis.conn();

    // Due times spread over 2.5 s starting 1.5 s from now (loading takes part of that), so
    // the run lasts long enough to be interrupted at several points, both while following
    // the due front and while draining a backlog built up during a restart.
    let base = redis_now_ms(&mut con) + 1_500;
    let jobs = (0..TOTAL)
        .map(|i| job(i).at(base + (i as i64 * 2_500 / TOTAL as i64)))
        .collect();
    enqueue_all(&rt, &lib, jobs);
    assert_eq!(stored_total(&mut con, "due"), TOTAL);

    let mut kills = Vec::new();
    let mut daemon = Daemon::spawn(&config);
    for k in 1..=7usize {
        let before = delivered(&mut con);
        let target = (TOTAL * k / 9).max(before + 500);
        wait_for(
            &format!("progress past {target} (cycle {k})"),
            Duration::from_secs(30),
            || delivered(&mut con) >= target.min(TOTAL),
        );
        daemon.kill9();
        let at_kill = delivered(&mut con);
        if at_kill >= TOTAL {
            break;
        }
        kills.push(at_kill);
        if k % 2 == 0 {
            // Let a backlog build up, so the next daemon is killed while draining full
            // batches rather than while following the due front.
            wait_for("a backlog of due jobs", Duration::from_secs(10), || {
                due_now(&mut con) >= 3_000 || due_now(&mut con) == TOTAL - at_kill
            });
        }
        daemon = Daemon::spawn(&config);
    }
    assert!(
        kills.len() >= 5,
        "the run ended before five kills mid-run: kills at {kills:?}"
    );
    wait_for("every job delivered", Duration::from_secs(30), || {
        delivered(&mut con) >= TOTAL && stored_total(&mut con, "due") == 0
    });
    assert_nothing_stored(&mut con);
    assert_exactly_once(&mut con, TOTAL);
    eprintln!("killed at {kills:?} of {TOTAL}");
}

/// SIGTERM while draining a 150k backlog: exit 0 within the grace period, nothing duplicated,
/// delivered + still due = total; a restart delivers the rest exactly once.
#[test]
fn sigterm_mid_drain_exits_0_and_loses_nothing() {
    const TOTAL: usize = 150_000;
    const SHARDS: u16 = 4;
    let grace = Duration::from_secs(5);
    let redis = RedisServer::start();
    let config = config(&redis, SHARDS, "[poller]\nshutdown_grace = \"5s\"\n");
    let rt = common::runtime();
    let lib = config.client(&rt);
    let mut con = redis.conn();
    enqueue_all(&rt, &lib, (0..TOTAL).map(job).collect());

    let mut daemon = Daemon::spawn(&config);
    wait_for("the drain to start", Duration::from_secs(20), || {
        delivered(&mut con) > 0
    });
    daemon.signal(libc::SIGTERM);
    let signalled = Instant::now();
    let status = daemon.wait_exit(grace + Duration::from_secs(5));
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "graceful exit: {status:?}");
    assert!(took < grace, "exit took {took:?}, grace is {grace:?}");
    assert!(
        daemon.log_text().contains("signal received"),
        "{}",
        daemon.log_text()
    );

    let moved = delivered(&mut con);
    let still_due = stored_total(&mut con, "due");
    assert!(
        still_due > 0,
        "the backlog was drained before SIGTERM arrived; the test did not interrupt anything"
    );
    assert_eq!(moved + still_due, TOTAL, "delivered + still due");
    assert_eq!(stored_total(&mut con, "jobs"), still_due);
    let counts = delivery_counts(&mut con, TOTAL);
    assert!(counts.iter().all(|&c| c <= 1), "a job was delivered twice");
    eprintln!("SIGTERM after {moved} of {TOTAL}; exit in {took:?}");

    let _daemon = Daemon::start(&config);
    wait_for("the rest delivered", Duration::from_secs(30), || {
        delivered(&mut con) >= TOTAL && stored_total(&mut con, "due") == 0
    });
    assert_nothing_stored(&mut con);
    assert_exactly_once(&mut con, TOTAL);
}

/// A second SIGTERM exits at once (130), even while the graceful shutdown waits for script
/// calls stuck on a frozen Redis.
#[test]
fn second_sigterm_exits_at_once() {
    let redis = RedisServer::start();
    let config = config(&redis, 2, "[poller]\nshutdown_grace = \"30s\"\n");
    let mut daemon = Daemon::start(&config);
    let redis_pid = redis.pid().expect("redis runs") as i32;
    // Freeze Redis: the pollers' next calls hang, so graceful shutdown cannot finish soon.
    // SAFETY: kill(2) on the redis-server this test started.
    unsafe { libc::kill(redis_pid, libc::SIGSTOP) };
    wait_for("/readyz = 503", Duration::from_secs(10), || {
        matches!(daemon.admin_get("/readyz"), Some((503, _)))
    });

    daemon.signal(libc::SIGTERM);
    // Signals sent back to back may be coalesced into one; wait until the first is handled.
    wait_for("the first signal handled", Duration::from_secs(5), || {
        daemon.log_text().contains("signal received")
    });
    assert!(
        daemon.try_exit().is_none(),
        "graceful shutdown finished despite stuck calls: the test needs it to wait"
    );
    daemon.signal(libc::SIGTERM);
    let signalled = Instant::now();
    let status = daemon.wait_exit(Duration::from_secs(5));
    let took = signalled.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(redis_pid, libc::SIGCONT) };
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(took < Duration::from_secs(2), "second signal took {took:?}");
}

/// One job of a race round.
struct RaceJob {
    /// Also its payload.
    id: String,
    due: i64,
    /// Whether the test acts on it (cancel or reschedule), and when (epoch ms).
    act_at: Option<i64>,
}

/// One round of a race: `n` jobs due within 50 ms after `lead` ms from now on route `a`; a
/// random half are to be acted on around their due time, from 20 ms before to 4 ms after.
/// `lead` grows to twice what the enqueue took, so that on a loaded host the next round's
/// jobs are still waiting when their race starts (else every action comes too late).
fn prepare_round(
    rt: &tokio::runtime::Runtime,
    lib: &Client,
    con: &mut redis::Connection,
    rng: &mut SeededRng,
    (round, n): (usize, usize),
    lead: &mut i64,
) -> Vec<RaceJob> {
    let now = redis_now_ms(con);
    let started = std::time::Instant::now();
    let round: Vec<RaceJob> = (0..n)
        .map(|i| {
            let due = now + *lead + rng.range(0, 50);
            let chosen = rng.next_u64().is_multiple_of(2);
            RaceJob {
                id: format!("r{round}-{i}"),
                due,
                act_at: chosen.then(|| due + rng.range(-20, 5)),
            }
        })
        .collect();
    let jobs = round
        .iter()
        .map(|j| NewJob::new("a", j.id.clone()).id(j.id.clone()).at(j.due))
        .collect();
    let results = rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    assert!(results.iter().all(|r| r.is_ok()));
    *lead = (*lead).max(2 * started.elapsed().as_millis() as i64);
    round
}

/// Runs `act(id)` for every chosen job at its `act_at`, all concurrently; one outcome per
/// job, `None` for the jobs left alone.
fn race<T, F, Fut>(rt: &tokio::runtime::Runtime, round: &[RaceJob], mut act: F) -> Vec<Option<T>>
where
    T: Send + 'static,
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    rt.block_on(async {
        let tasks: Vec<_> = round
            .iter()
            .map(|j| {
                let act_at = j.act_at;
                let action = act_at.map(|_| act(j.id.clone()));
                tokio::spawn(async move {
                    let (at, action) = (act_at?, action?);
                    let wait = at - local_now_ms();
                    if wait > 0 {
                        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
                    }
                    Some(action.await)
                })
            })
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.expect("race task"));
        }
        out
    })
}

/// Cancel racing the mover, 5 × 2000 jobs: each job is delivered once XOR its cancel
/// returned `Cancelled`; never both, never neither.
#[test]
fn cancel_races_the_mover() {
    const N: usize = 2_000;
    const SHARDS: u16 = 4;
    let redis = RedisServer::start();
    let config = config(&redis, SHARDS, "");
    let _daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = config.client(&rt);
    let mut con = redis.conn();
    let mut rng = SeededRng::new(0x5eed_0003);
    let (mut won, mut lost) = (0usize, 0usize);
    let mut lead = 30;
    for round in 0..5 {
        redis::cmd("DEL")
            .arg(LIST_A)
            .query::<()>(&mut con)
            .expect("DEL");
        let jobs = prepare_round(&rt, &lib, &mut con, &mut rng, (round, N), &mut lead);
        let outcomes = race(&rt, &jobs, |id| {
            let lib = lib.clone();
            async move { lib.cancel(&id).await.expect("cancel") }
        });
        let cancelled = outcomes
            .iter()
            .filter(|o| **o == Some(Cancelled::Cancelled))
            .count();
        wait_for("the round settles", Duration::from_secs(20), || {
            stored_total(&mut con, "due") == 0 && llen(&mut con, LIST_A) >= N - cancelled
        });
        let mut count: BTreeMap<String, u32> = BTreeMap::new();
        for p in lrange(&mut con, LIST_A) {
            *count
                .entry(String::from_utf8(p).expect("utf-8"))
                .or_default() += 1;
        }
        for (job, outcome) in jobs.iter().zip(&outcomes) {
            let (id, n) = (&job.id, count.get(&job.id).copied().unwrap_or(0));
            match outcome {
                None => assert_eq!(n, 1, "{id} (not cancelled) delivered {n} times"),
                Some(Cancelled::Cancelled) => {
                    won += 1;
                    assert_eq!(n, 0, "{id} cancelled and delivered");
                }
                Some(Cancelled::NotPending) => {
                    lost += 1;
                    assert_eq!(n, 1, "{id} not pending, delivered {n} times");
                }
                Some(Cancelled::InFlight) => panic!("{id}: in flight on a local sink"),
            }
        }
        assert_eq!(count.values().sum::<u32>() as usize, N - cancelled);
        assert_nothing_stored(&mut con);
    }
    eprintln!("cancel won {won}, lost to the mover {lost}");
    assert!(
        won > 0 && lost > 0,
        "the race was not exercised: cancel won {won}, lost {lost}"
    );
}

/// Pops `list` until `stop`, recording (payload, local epoch ms at arrival).
fn consumer(
    url: String,
    list: &'static str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<(String, i64)>> {
    std::thread::spawn(move || {
        let mut con = redis::Client::open(url)
            .and_then(|c| c.get_connection())
            .expect("consumer connects");
        let mut got = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let popped: Option<(String, String)> = redis::cmd("BRPOP")
                .arg(list)
                .arg(0.05)
                .query(&mut con)
                .expect("BRPOP");
            if let Some((_, payload)) = popped {
                got.push((payload, local_now_ms()));
            }
        }
        got
    })
}

/// Reschedule racing the mover, 5 × 2000 jobs: a job whose reschedule returned `Some(due)`
/// arrives once, not before that due; one whose reschedule returned `None` had already
/// arrived, once. Untouched jobs arrive once, never early.
#[test]
fn reschedule_races_the_mover() {
    const N: usize = 2_000;
    const SHARDS: u16 = 4;
    let redis = RedisServer::start();
    let config = config(&redis, SHARDS, "");
    let _daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = config.client(&rt);
    let mut con = redis.conn();
    let mut rng = SeededRng::new(0x5eed_0004);
    let (mut moved_later, mut too_late) = (0usize, 0usize);
    let mut lead = 30;
    for round in 0..5 {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let popper = consumer(redis.url(), LIST_A, stop.clone());
        let jobs = prepare_round(&rt, &lib, &mut con, &mut rng, (round, N), &mut lead);
        let outcomes = race(&rt, &jobs, |id| {
            let lib = lib.clone();
            let delay = Duration::from_millis(rng.range(300, 600) as u64);
            async move {
                lib.reschedule(&id, Due::In(delay))
                    .await
                    .expect("reschedule")
            }
        });
        wait_for("the round settles", Duration::from_secs(20), || {
            stored_total(&mut con, "due") == 0 && llen(&mut con, LIST_A) == 0
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let arrivals = popper.join().expect("consumer thread");
        let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (p, t) in arrivals {
            seen.entry(p).or_default().push(t);
        }
        assert_eq!(seen.len(), N, "distinct payloads delivered");
        for (job, outcome) in jobs.iter().zip(&outcomes) {
            let id = &job.id;
            let times = seen.get(id).cloned().unwrap_or_default();
            assert_eq!(times.len(), 1, "{id} delivered {} times", times.len());
            let arrived = times[0];
            match outcome {
                None => assert!(
                    arrived >= job.due,
                    "{id} arrived at {arrived}, before its due {}",
                    job.due
                ),
                Some(Some(new_due)) => {
                    moved_later += 1;
                    assert!(
                        arrived >= *new_due,
                        "{id} rescheduled to {new_due} but arrived at {arrived}"
                    );
                }
                Some(None) => too_late += 1,
            }
        }
        assert_nothing_stored(&mut con);
    }
    eprintln!("rescheduled {moved_later}, already delivered {too_late}");
    assert!(
        moved_later > 0 && too_late > 0,
        "the race was not exercised: rescheduled {moved_later}, too late {too_late}"
    );
}

/// Redis down at start-up: the daemon serves /healthz, says not ready, does not spin, and
/// becomes ready and delivers once Redis appears on its port.
#[test]
fn unreachable_redis_at_startup_then_redis_appears() {
    let port = common::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let config = TestConfig::new(&url, 2, ROUTES);
    let mut daemon = Daemon::spawn(&config);
    wait_for("/healthz = 200", Duration::from_secs(10), || {
        matches!(daemon.admin_get("/healthz"), Some((200, _)))
    });
    let cpu_before = common::process_cpu(daemon.pid());
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(2) {
        let ready = daemon.admin_get("/readyz");
        assert!(
            matches!(ready, Some((503, _))),
            "/readyz without redis: {ready:?}"
        );
        assert!(
            daemon.try_exit().is_none(),
            "the daemon exited without redis"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let cpu = common::process_cpu(daemon.pid()) - cpu_before;
    assert!(
        cpu < Duration::from_millis(300),
        "{cpu:?} of CPU in 2 s while waiting for redis"
    );
    let log = daemon.log_text();
    assert_eq!(
        log.matches("recovering from error").count(),
        1,
        "one line for the whole outage, naming it:\n{log}"
    );
    assert!(log.contains(r#"kind="redis_connect""#), "{log}");

    let redis = RedisServer::start_on(port);
    daemon.wait_ready();
    let rt = common::runtime();
    let lib = config.client(&rt);
    rt.block_on(lib.enqueue(NewJob::new("a", "hello"), OnConflict::Error))
        .expect("enqueue");
    let mut con = redis.conn();
    wait_for("the job delivered", Duration::from_secs(10), || {
        llen(&mut con, LIST_A) == 1
    });
    assert_eq!(lrange(&mut con, LIST_A), vec![b"hello".to_vec()]);
}

/// Redis restarted between the daemon's connect and its start-up checks: the start-up is
/// retried, not abandoned, and the daemon delivers.
#[test]
fn redis_restarted_mid_start_up_is_retried() {
    let mut redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 2, ROUTES);
    let gate = config.path.with_file_name("start-up-gate");
    let hold = format!("start_up_hold_after_connect={}", gate.display());
    let mut daemon = Daemon::spawn_with_env(&config, &[("ZDELAY_FAILPOINT", &hold)]);
    wait_for(
        "start-up held after its connect",
        Duration::from_secs(10),
        || {
            daemon
                .log_text()
                .contains("failpoint start_up_hold_after_connect")
        },
    );
    redis.restart();
    std::fs::write(&gate, b"").expect("open the gate");
    daemon.wait_ready();
    assert!(daemon.try_exit().is_none(), "{}", daemon.log_text());
    let rt = common::runtime();
    let lib = config.client(&rt);
    rt.block_on(lib.enqueue(NewJob::new("a", "after"), OnConflict::Error))
        .expect("enqueue");
    let mut con = redis.conn();
    wait_for("the job delivered", Duration::from_secs(10), || {
        llen(&mut con, LIST_A) == 1
    });
    assert!(
        daemon.log_text().contains(r#"context="start-up""#),
        "{}",
        daemon.log_text()
    );
    wait_for("the episode closed", Duration::from_secs(15), || {
        daemon.log_text().contains("recovered")
    });
}

/// Redis restarted (data lost) under a running daemon: /readyz goes 503 then 200, and jobs
/// enqueued afterwards are delivered (reconnect; scripts reloaded after NOSCRIPT; the lanes,
/// lost with the data, registered again by the daemon), both envelope jobs and raw-source
/// members.
#[test]
fn redis_restart_under_a_running_daemon() {
    let mut redis = RedisServer::start();
    let raw = "\n[[sources]]\nkey = \"raw:a\"\nroute = \"a\"\n";
    let config = config(&redis, 2, raw);
    let mut daemon = Daemon::start(&config);
    let pid = daemon.pid();
    let rt = common::runtime();
    let lib = config.client(&rt);
    rt.block_on(lib.enqueue(NewJob::new("a", "before"), OnConflict::Error))
        .expect("enqueue");
    let mut con = redis.conn();
    wait_for("the first job", Duration::from_secs(10), || {
        llen(&mut con, LIST_A) == 1
    });

    redis.stop();
    wait_for(
        "/readyz = 503 with redis down",
        Duration::from_secs(10),
        || matches!(daemon.admin_get("/readyz"), Some((503, _))),
    );
    redis.start_again();
    wait_for("/readyz = 200 again", Duration::from_secs(20), || {
        matches!(daemon.admin_get("/readyz"), Some((200, _)))
    });
    assert!(daemon.try_exit().is_none(), "the daemon exited");
    assert_eq!(daemon.pid(), pid);

    let mut con = redis.conn();
    // The restarted Redis has no scripts: the daemon's pollers must reload them (NOSCRIPT)
    // to move this raw member, which nothing else loads scripts for.
    let now = redis_now_ms(&mut con);
    redis::cmd("ZADD")
        .arg("raw:a")
        .arg(now)
        .arg("raw-after")
        .query::<()>(&mut con)
        .expect("ZADD");
    wait_for("the raw member delivered", Duration::from_secs(10), || {
        llen(&mut con, LIST_A) == 1
    });
    // The restart lost the lane registry and markers: the daemon registers its lanes again,
    // so a producer that registers none (no routes) enqueues into them.
    common::wait_for_or_show(
        "the daemon's lanes registered again",
        Duration::from_secs(10),
        || {
            redis::cmd("HEXISTS")
                .arg("zdelay:lanes")
                .arg("r:b")
                .query::<bool>(&mut con)
                .expect("HEXISTS")
        },
        || daemon.log_text(),
    );
    let lib = common::client(&rt, &redis.url(), 2);
    rt.block_on(lib.enqueue(NewJob::new("b", "after"), OnConflict::Error))
        .expect("enqueue after restart");
    common::wait_for_or_show(
        "the job enqueued after restart",
        Duration::from_secs(10),
        || llen(&mut con, LIST_B) == 1,
        || daemon.log_text(),
    );
    assert_eq!(lrange(&mut con, LIST_A), vec![b"raw-after".to_vec()]);
    assert_eq!(lrange(&mut con, LIST_B), vec![b"after".to_vec()]);
    assert_nothing_stored(&mut con);
}

/// Prometheus text → (name, labels) → value.
fn parse_metrics(text: &str) -> BTreeMap<(String, BTreeMap<String, String>), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("labels close");
                let labels = body
                    .split(',')
                    .filter(|kv| !kv.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').expect("label k=v");
                        (k.to_owned(), v.trim_matches('"').to_owned())
                    })
                    .collect();
                (name.to_owned(), labels)
            }
            None => (series.to_owned(), BTreeMap::new()),
        };
        out.insert((name, labels), value);
    }
    out
}

fn metric(
    metrics: &BTreeMap<(String, BTreeMap<String, String>), f64>,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    let labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    metrics.get(&(name.to_owned(), labels)).copied()
}

/// After a run, /metrics counts the jobs moved per route exactly and has the lateness
/// histogram with its explicit buckets, per source, consistent with the jobs moved.
#[test]
fn metrics_after_a_run() {
    const SHARDS: u16 = 4;
    let redis = RedisServer::start();
    let raw = "\n[[sources]]\nkey = \"raw:a\"\nroute = \"a\"\n";
    let config = config(&redis, SHARDS, raw);
    let daemon = Daemon::start(&config);
    let rt = common::runtime();
    let lib = config.client(&rt);
    let mut con = redis.conn();
    let jobs = (0..500)
        .map(|i| {
            let dest = if i < 300 { "a" } else { "b" };
            NewJob::new(dest, format!("m{i}")).after(Duration::from_millis(i % 200))
        })
        .collect();
    enqueue_all(&rt, &lib, jobs);
    let now = redis_now_ms(&mut con);
    let mut zadd = redis::cmd("ZADD");
    zadd.arg("raw:a");
    for i in 0..100 {
        zadd.arg(now + i % 50).arg(format!("raw{i}"));
    }
    zadd.query::<()>(&mut con).expect("ZADD");
    wait_for("600 jobs delivered", Duration::from_secs(20), || {
        llen(&mut con, LIST_A) == 400 && llen(&mut con, LIST_B) == 200
    });

    // Counters are recorded right after each script returns: wait for the last batch.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (text, m) = loop {
        let (status, text) = daemon.admin_get("/metrics").expect("/metrics answers");
        assert_eq!(status, 200);
        let m = parse_metrics(&text);
        let done = metric(&m, "zdelay_jobs_moved_total", &[("route", "a")]) == Some(400.0)
            && metric(&m, "zdelay_jobs_moved_total", &[("route", "b")]) == Some(200.0);
        if done || Instant::now() > deadline {
            break (text, m);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        metric(&m, "zdelay_jobs_moved_total", &[("route", "a")]),
        Some(400.0),
        "{text}"
    );
    assert_eq!(
        metric(&m, "zdelay_jobs_moved_total", &[("route", "b")]),
        Some(200.0),
        "{text}"
    );
    let bounds = [
        "0.001", "0.002", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5",
        "10", "30", "60", "300", "+Inf",
    ];
    for (source, moved) in [("jobs", 500.0), ("raw:a", 100.0)] {
        let mut previous = 0.0;
        for le in bounds {
            let v = metric(
                &m,
                "zdelay_lateness_seconds_bucket",
                &[("source", source), ("le", le)],
            )
            .unwrap_or_else(|| panic!("no lateness bucket le={le} for {source}:\n{text}"));
            assert!(
                v >= previous,
                "buckets are cumulative: le={le} {v} < {previous}"
            );
            previous = v;
        }
        assert_eq!(previous, moved, "+Inf bucket of {source} = jobs moved");
        assert_eq!(
            metric(&m, "zdelay_lateness_seconds_count", &[("source", source)]),
            Some(moved),
            "{text}"
        );
    }
    assert!(text.contains("zdelay_batch_size_bucket"), "{text}");
    assert!(
        text.contains("zdelay_script_duration_seconds_bucket"),
        "{text}"
    );
}
