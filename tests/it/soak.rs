//! Issue 14's soak test, "nothing grows with time": a steady 2,000 jobs/s through one daemon,
//! half to a list on the scheduling Redis (exactly once) and half to a list on a second Redis
//! through the two-phase `redis` sink, a schedule firing every second, the console API polled
//! and `/metrics` never scraped. After a warm-up, the daemon's RSS and the scheduling Redis's
//! `used_memory` must stay flat (the median of the last quarter of the samples within 10 % of
//! the median of the first quarter), every job must be delivered exactly once (no faults: a
//! two-phase repeat needs a crash) and every occurrence of the schedule once.
//!
//! `ZDELAY_SOAK_SECS` sets the measured time after the warm-up (default 90 s; issue 14's full
//! soak is `ZDELAY_SOAK_SECS=600`). The samples are printed whatever the outcome.

use crate::common::{Daemon, RedisServer, TestConfig, http_get, redis_now_ms, runtime};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use zdelay::schedules::{NewSchedule, Repeat};
use zdelay::{Client, NewJob, OnConflict};

const RATE: u64 = 2_000;
const WARMUP: Duration = Duration::from_secs(20);
const DEFAULT_SECS: u64 = 90;
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How much either memory may grow between the first and the last quarter of the samples.
const FLAT: f64 = 1.10;
const SHARDS: u16 = 4;
const LOCAL_LIST: &str = "soak:local";
const REMOTE_LIST: &str = "soak:remote";
const TICKS_LIST: &str = "soak:ticks";

fn config(redis: &RedisServer, remote: &RedisServer) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        SHARDS,
        &format!(
            r#"
[sinks.remote]
kind = "redis"
url = "{remote}"

[[routes]]
name = "sl"
sink = "local"
target = "{LOCAL_LIST}"
push = "rpush"

[[routes]]
name = "sr"
sink = "remote"
target = "{REMOTE_LIST}"
push = "rpush"

[[routes]]
name = "st"
sink = "local"
target = "{TICKS_LIST}"
push = "rpush"
"#,
            remote = remote.url()
        ),
    )
}

/// Resident set size of a process, KiB (`VmRSS` in `/proc/<pid>/status`).
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

fn used_memory(con: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("memory").query(con).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

/// Pops every item of `list` until `stop`, counting each job number's deliveries.
fn consume(
    port: u16,
    list: &'static str,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<u64>> {
    std::thread::spawn(move || {
        let mut con = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|c| c.get_connection())
            .expect("consumer connects");
        let mut seen = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let items: Option<Vec<String>> = redis::cmd("LPOP")
                .arg(list)
                .arg(1000)
                .query(&mut con)
                .expect("LPOP");
            match items {
                Some(items) => seen.extend(
                    items
                        .iter()
                        .map(|i| i.parse::<u64>().expect("a job number")),
                ),
                // Empty: the next batch comes within milliseconds.
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        seen
    })
}

/// The median of a quarter of the samples.
fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values[values.len() / 2]
}

#[test]
fn a_steady_load_keeps_memory_flat_and_delivers_every_job_once() {
    let secs = std::env::var("ZDELAY_SOAK_SECS")
        .map(|s| {
            s.trim()
                .parse()
                .expect("ZDELAY_SOAK_SECS is a number of seconds")
        })
        .unwrap_or(DEFAULT_SECS);
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = config(&redis, &remote);
    let daemon = Daemon::start(&config);
    let rt = runtime();
    let client = rt
        .block_on(Client::connect(&crate::common::redis_config(
            &redis.url(),
            SHARDS,
        )))
        .expect("client");
    let mut con = redis.conn();
    let set = rt
        .block_on(client.schedule_set(NewSchedule::new(
            "tick",
            "st",
            "tick",
            Repeat::Every(Duration::from_secs(1)),
        )))
        .expect("the per-second schedule");
    let first_tick = set.next_ms.expect("a next occurrence");

    let stop = Arc::new(AtomicBool::new(false));
    let consumers = [
        consume(redis.port, LOCAL_LIST, stop.clone()),
        consume(remote.port, REMOTE_LIST, stop.clone()),
    ];
    let sent = Arc::new(AtomicU64::new(0));
    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (client, sent, producing) = (client.clone(), sent.clone(), producing.clone());
        rt.spawn(async move {
            // Paced by what the rate owes at each tick, so a slow call is caught up.
            let start = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while producing.load(Ordering::SeqCst) {
                tick.tick().await;
                let owed = (RATE as u128 * start.elapsed().as_micros() / 1_000_000) as u64;
                let from = sent.load(Ordering::SeqCst);
                let jobs: Vec<NewJob> = (from..owed)
                    .map(|n| {
                        let route = if n % 2 == 0 { "sl" } else { "sr" };
                        NewJob::new(route, n.to_string())
                            .after(Duration::from_millis(200 + n % 800))
                    })
                    .collect();
                for r in client
                    .enqueue_batch(jobs, OnConflict::Error)
                    .await
                    .expect("enqueue batch")
                {
                    r.expect("each job enqueued");
                }
                sent.store(owed.max(from), Ordering::SeqCst);
            }
        })
    };
    let console = {
        let (port, stop) = (config.admin_port, stop.clone());
        std::thread::spawn(move || {
            let pages = [
                "/api/stats",
                "/api/forecast?next=10m&step=1m",
                "/api/schedules",
                "/api/dead",
            ];
            let mut polls = 0u64;
            while !stop.load(Ordering::SeqCst) {
                for page in pages {
                    let (status, body) = http_get(port, page).expect("the console answers");
                    assert_eq!(status, 200, "{page}: {body}");
                    polls += 1;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            polls
        })
    };

    // (seconds since start, daemon RSS KiB, Redis used_memory bytes)
    let started = Instant::now();
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    let end = WARMUP + Duration::from_secs(secs);
    while started.elapsed() < end {
        std::thread::sleep(SAMPLE_EVERY);
        let at = started.elapsed();
        if at >= WARMUP {
            samples.push((
                at.as_secs_f64(),
                rss_kib(daemon.pid()),
                used_memory(&mut con),
            ));
        }
    }
    producing.store(false, Ordering::SeqCst);
    rt.block_on(producer).expect("the producer");
    let produced_for = started.elapsed();
    let sent = sent.load(Ordering::SeqCst);
    let deleted_at = redis_now_ms(&mut con);
    rt.block_on(client.schedule_delete("tick"))
        .expect("delete the schedule");

    // Everything sent must come out: wait until the daemon holds nothing and the lists are
    // empty, then let the consumers stop.
    crate::common::wait_nothing_stored(&mut con, Duration::from_secs(60));
    let mut remote_con = remote.conn();
    crate::common::wait_for(
        "both lists read to the end",
        Duration::from_secs(30),
        || {
            crate::common::llen(&mut con, LOCAL_LIST) == 0
                && crate::common::llen(&mut remote_con, REMOTE_LIST) == 0
        },
    );
    stop.store(true, Ordering::SeqCst);
    let polls = console.join().expect("the console poller");
    let mut counts = vec![0u32; sent as usize];
    for consumer in consumers {
        for n in consumer.join().expect("a consumer") {
            assert!(n < sent, "job {n} delivered, only {sent} sent");
            counts[n as usize] += 1;
        }
    }
    let ticks = crate::common::llen(&mut con, TICKS_LIST) as i64;

    eprintln!("soak: t(s)  daemon RSS (KiB)  redis used_memory (B)");
    for (t, rss, used) in &samples {
        eprintln!("soak: {t:6.1}  {rss:10}  {used:12}");
    }
    let quarter = (samples.len() / 4).max(1);
    let first =
        |pick: fn(&(f64, u64, u64)) -> u64| median(samples[..quarter].iter().map(pick).collect());
    let last = |pick: fn(&(f64, u64, u64)) -> u64| {
        median(
            samples[samples.len() - quarter..]
                .iter()
                .map(pick)
                .collect(),
        )
    };
    let (rss_first, rss_last) = (first(|s| s.1), last(|s| s.1));
    let (mem_first, mem_last) = (first(|s| s.2), last(|s| s.2));
    let rate = sent as f64 / produced_for.as_secs_f64();
    let lost: Vec<usize> = (0..counts.len()).filter(|&n| counts[n] == 0).collect();
    let repeated: Vec<usize> = (0..counts.len()).filter(|&n| counts[n] > 1).collect();
    let expected_ticks = (deleted_at - first_tick).div_euclid(1000) + 1;
    eprintln!(
        "soak: {sent} jobs at {rate:.0}/s over {produced_for:?}; {} lost, {} repeated; {ticks} \
         ticks (grid {expected_ticks}); {polls} console requests; daemon RSS {rss_first} -> \
         {rss_last} KiB ({:+.1} %), redis used_memory {mem_first} -> {mem_last} B ({:+.1} %)",
        lost.len(),
        repeated.len(),
        (rss_last as f64 / rss_first as f64 - 1.0) * 100.0,
        (mem_last as f64 / mem_first as f64 - 1.0) * 100.0,
    );

    assert!(
        rate >= RATE as f64 * 0.95,
        "the producer kept {rate:.0} jobs/s, not {RATE}: the soak did not run at its load"
    );
    assert!(
        lost.is_empty() && repeated.is_empty(),
        "every job once: lost {:?}…, repeated {:?}…",
        &lost[..lost.len().min(10)],
        &repeated[..repeated.len().min(10)]
    );
    assert!(
        ticks <= expected_ticks + 1 && ticks >= expected_ticks - 2,
        "{ticks} ticks delivered, the grid had {expected_ticks} occurrences until the delete"
    );
    assert!(
        rss_last as f64 <= rss_first as f64 * FLAT,
        "daemon RSS grew from {rss_first} to {rss_last} KiB after warm-up (more than 10 %)"
    );
    assert!(
        mem_last as f64 <= mem_first as f64 * FLAT,
        "redis used_memory grew from {mem_first} to {mem_last} bytes after warm-up (more than 10 %)"
    );
}
