//! The daemon's memory under a steady load when nothing scrapes `/metrics`.

use crate::common::{Daemon, RedisServer, TestConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The resident set of a process, in kB (`VmRSS` of /proc/<pid>/status).
fn rss_kb(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

/// Members due now into a raw source, `per_tick` every 10 ms, until stopped; the list they
/// are moved to is trimmed so Redis stays small; `added` counts them.
fn load(redis_url: String, per_tick: usize, stop: Arc<AtomicBool>, added: Arc<AtomicU64>) {
    let mut con = redis::Client::open(redis_url)
        .and_then(|c| c.get_connection())
        .expect("loader connects");
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64;
        let mut pipe = redis::pipe();
        let mut zadd = redis::cmd("ZADD");
        zadd.arg("load:raw");
        for _ in 0..per_tick {
            zadd.arg(now_ms).arg(format!("m{seq}"));
            seq += 1;
        }
        pipe.add_command(zadd).ignore();
        pipe.cmd("LTRIM").arg("q:raw").arg(-1000).arg(-1).ignore();
        let _: () = pipe.query(&mut con).expect("load pipeline");
        added.store(seq, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A daemon moving a few thousand jobs a second that nobody scrapes keeps a flat resident
/// set: the Prometheus recorder folds its histogram samples into buckets on a timer, instead
/// of keeping every sample until a scrape.
#[test]
fn a_daemon_nobody_scrapes_keeps_its_memory_flat_under_load() {
    const WARM_UP: Duration = Duration::from_secs(15);
    const MEASURED: Duration = Duration::from_secs(60);
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        2,
        r#"
[poller]
idle_poll = "20ms"

[[routes]]
name = "raw"
sink = "local"
target = "q:raw"

[[sources]]
key = "load:raw"
route = "raw"
"#,
    );
    let daemon = Daemon::start(&config);
    let stop = Arc::new(AtomicBool::new(false));
    let added = Arc::new(AtomicU64::new(0));
    let loader = std::thread::spawn({
        let (url, stop, added) = (redis.url(), stop.clone(), added.clone());
        move || load(url, 50, stop, added)
    });
    let started = Instant::now();
    std::thread::sleep(WARM_UP);
    let (rss_before, added_before) = (rss_kb(daemon.pid()), added.load(Ordering::Relaxed));
    let mut peak = rss_before;
    let measured = Instant::now();
    while measured.elapsed() < MEASURED {
        std::thread::sleep(Duration::from_secs(1));
        peak = peak.max(rss_kb(daemon.pid()));
    }
    let rss_after = rss_kb(daemon.pid());
    let moved = added.load(Ordering::Relaxed) - added_before;
    stop.store(true, Ordering::Relaxed);
    loader.join().expect("loader thread");
    let mut con = redis.conn();
    let backlog: u64 = redis::cmd("ZCARD")
        .arg("load:raw")
        .query(&mut con)
        .expect("ZCARD");
    let rate = moved as f64 / MEASURED.as_secs_f64();
    eprintln!(
        "{moved} jobs in {MEASURED:?} ({rate:.0}/s, {backlog} left), never scraped: RSS \
         {rss_before} kB → {rss_after} kB (peak {peak} kB) after a {:?} warm-up",
        WARM_UP.min(started.elapsed())
    );
    assert!(
        rate > 1000.0 && backlog < 20_000,
        "the load did not go through: {rate:.0}/s, {backlog} left"
    );
    // Keeping every histogram sample until a scrape costs about 17 bytes a job (measured:
    // 4.2 MB over this run at 4k jobs/s); with the upkeep the resident set moves by a few
    // pages. Allowed: a quarter of that cost, at least 512 kB for the allocator's own moves.
    let growth = peak.saturating_sub(rss_before);
    let allowed = (moved * 4 / 1024).max(512);
    assert!(
        growth < allowed,
        "RSS grew {growth} kB (allowed {allowed} kB) in {MEASURED:?} ({rss_before} → peak \
         {peak} kB) while moving {rate:.0} jobs/s"
    );
}
