//! The shipped Grafana dashboard and Prometheus rules query only metrics the daemon exports:
//! a daemon delivers local, two-phase, scheduled and dead jobs, its `/metrics` is scraped,
//! and every `zdelay_*` name the dashboard and the rules use must be in the scrape. A name
//! only a fault emits (an expired lease, a fenced settle) cannot be produced on demand here:
//! those few are listed below and must at least be metric names the daemon declares. Flow
//! control's come from a second daemon, on storage layout 2, whose route's rate holds.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use crate::common::{Daemon, RedisServer, TestConfig, llen, wait_for_or_show};

/// Emitted on fault paths only (see src/metrics.rs): checked against the declared names.
const FAULT_ONLY: &[&str] = &["zdelay_leases_expired_total", "zdelay_fenced_settles_total"];

fn names_used_in(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).expect("read dashboard or rules");
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("zdelay_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Series names in a Prometheus text exposition (histograms as `_bucket`, `_sum`, `_count`).
fn scraped_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn dashboard_and_rules_query_only_exported_metrics() {
    let redis = RedisServer::start();
    let target = RedisServer::start(); // another Redis: a two-phase sink
    let config = TestConfig::new(
        &redis.url(),
        2,
        &format!(
            r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{target}"

# Nothing listens there: its health check fails, which counts an error.
[sinks.gone]
kind = "redis"
url = "redis://127.0.0.1:{closed}"

[[routes]]
name = "g"
sink = "gone"
target = "q:g"

[[routes]]
name = "l"
sink = "local"
target = "q:l"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
"#,
            target = target.url(),
            closed = crate::common::free_port(),
        ),
    );
    // The schedule set below gets series of its own: the rules query them.
    let text = std::fs::read_to_string(&config.path).unwrap();
    let text = text.replacen("[admin]\n", "[admin]\nschedule_metrics = [\"tick\"]\n", 1);
    std::fs::write(&config.path, text).unwrap();
    let ok = |args: &[&str]| {
        let out = config.cli(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // Not ready while a sink is down: started without waiting for /readyz.
    let daemon = Daemon::spawn(&config);
    wait_for_or_show(
        "the daemon up but for the sink gone",
        Duration::from_secs(20),
        || {
            daemon.admin_get("/readyz").is_some_and(|(_, body)| {
                body.contains("not ready: sinks down") && body.contains("sink other (redis): up")
            })
        },
        || daemon.log_text(),
    );
    ok(&["enqueue", "--dest", "l", "--payload", "one"]);
    ok(&["enqueue", "--dest", "m", "--payload", "two"]);
    ok(&["enqueue", "--dest", "g", "--payload", "waits"]); // its publish fails: an error
    // A job a minute late with a second's max lateness: dead.
    let rt = crate::common::runtime();
    let lib = config.client(&rt);
    let past = crate::common::redis_now_ms(&mut redis.conn()) - 60_000;
    rt.block_on(
        lib.enqueue(
            zdelay::NewJob::new("l", "three")
                .at(past)
                .max_lateness(Duration::from_secs(1)),
            zdelay::OnConflict::Error,
        ),
    )
    .expect("enqueued");
    ok(&["enqueue", "--dest", "l", "--in", "1h", "--payload", "later"]);
    ok(&[
        "schedule",
        "set",
        "tick",
        "--dest",
        "l",
        "--every",
        "100ms",
        "--payload",
        "t",
    ]);
    let (mut con, mut tcon) = (redis.conn(), target.conn());
    wait_for_or_show(
        "local, two-phase and scheduled jobs delivered",
        Duration::from_secs(20),
        || llen(&mut con, "q:l") >= 3 && llen(&mut tcon, "q:m") == 1,
        || {
            let lens = (
                llen(&mut redis.conn(), "q:l"),
                llen(&mut target.conn(), "q:m"),
            );
            format!("q:l and q:m hold {lens:?}; log:\n{}", daemon.log_text())
        },
    );
    // The gauges are sampled periodically: wait for them, and for the counters of every kind.
    let mut scraped = BTreeSet::new();
    let wanted = [
        "zdelay_dead",
        "zdelay_jobs_dead_total",
        "zdelay_scheduled",
        "zdelay_sink_up",
        "zdelay_errors_total",
        "zdelay_wakeups_total",
        "zdelay_schedule_period_seconds",
    ];
    let scrape = || {
        let text = daemon.admin_get("/metrics").map(|(_, text)| text);
        scraped_names(&text.unwrap_or_default())
    };
    wait_for_or_show(
        "a scrape with every kind of metric",
        Duration::from_secs(20),
        || {
            scraped = scrape();
            wanted.iter().all(|w| scraped.contains(*w))
        },
        || format!("scraped: {:?}", scrape()),
    );

    scraped.extend(flow_control_metrics());

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let declared = std::fs::read_to_string(root.join("src/metrics.rs")).expect("metrics.rs");
    let mut missing = Vec::new();
    for file in [
        "charts/zdelay/dashboards/zdelay.json",
        "charts/zdelay/files/zdelay-rules.yaml",
    ] {
        let used = names_used_in(&root.join(file));
        assert!(used.len() >= 5, "{file} queries zdelay metrics: {used:?}");
        for name in used {
            // A histogram's base name (say, in an alert's text) stands for its series.
            let exported = scraped.contains(&name) || scraped.contains(&format!("{name}_count"));
            let fault_only =
                FAULT_ONLY.contains(&name.as_str()) && declared.contains(&format!("\"{name}\""));
            if !exported && !fault_only {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "metrics the dashboard or rules query but the daemon does not export: {missing:?}\n\
         scraped: {scraped:?}"
    );
}

/// The series a daemon exports once a rate has held a route back (storage layout 2): ten jobs
/// due at once on a route of 20 a second with a burst of one.
fn flow_control_metrics() -> BTreeSet<String> {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        2,
        r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "limited"
sink = "local"
target = "q:limited"
rate = "20/s"
burst = 1
"#,
    );
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt
        .block_on(zdelay::Client::open(&redis.url()))
        .expect("open");
    let jobs = (0..10)
        .map(|i| zdelay::NewJob::new("limited", i.to_string()))
        .collect();
    let results = rt
        .block_on(client.enqueue_batch(jobs, zdelay::OnConflict::Error))
        .expect("enqueue");
    assert!(results.iter().all(Result::is_ok));
    let wanted = [
        "zdelay_deferred_total",
        "zdelay_deferral_seconds_bucket",
        "zdelay_route_held",
    ];
    let mut scraped = BTreeSet::new();
    wait_for_or_show(
        "a scrape with the flow control metrics",
        Duration::from_secs(20),
        || {
            let text = daemon.admin_get("/metrics").map(|(_, text)| text);
            scraped = scraped_names(&text.unwrap_or_default());
            wanted.iter().all(|w| scraped.contains(*w))
        },
        || {
            let text = daemon.admin_get("/metrics").map(|(_, text)| text);
            let names = scraped_names(&text.unwrap_or_default());
            format!("scraped: {names:?}; log:\n{}", daemon.log_text())
        },
    );
    scraped
}
