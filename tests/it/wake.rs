//! Wake-ups between daemons: a mover that queues jobs for a two-phase sink wakes the other
//! daemons' publishers of that shard, which would otherwise find them at their idle poll.

use crate::common::{self, Daemon, RedisServer, TestConfig, llen, redis_now_ms, wait_for};
use std::time::{Duration, Instant};
use zdelay::{NewJob, OnConflict};

#[test]
fn another_daemons_publisher_claims_what_a_mover_queued_without_waiting_for_its_idle_poll() {
    let scheduler = RedisServer::start();
    let target = RedisServer::start();
    // Both daemons move and publish the one spread shard; a publisher that nobody wakes
    // looks again only after `idle_poll_max`.
    let config = TestConfig::new(
        &scheduler.url(),
        1,
        &format!(
            r#"
[poller]
per_shard = 2
idle_poll = "50ms"
idle_poll_max = "30s"

[sinks.far]
kind = "redis"
url = "{}"

[[routes]]
name = "mirror"
sink = "far"
target = "q:remote"
"#,
            target.url()
        ),
    );
    // One daemon's publishers never start: every job its mover queues must be claimed by the
    // other daemon's publisher.
    let dir = tempfile::tempdir().unwrap();
    let never = dir.path().join("never");
    let stuck = Daemon::spawn_with_env(
        &config,
        &[(
            "ZDELAY_FAILPOINT",
            &format!("publisher_start={}", never.display()),
        )],
    );
    stuck.wait_ready();
    let publishing = Daemon::start_instance(&config);
    let confirmed = |d: &Daemon| d.metric("zdelay_wakeups_confirmed", &[("targets", "shards")]);
    wait_for(
        "wake-ups confirmed on both daemons",
        Duration::from_secs(20),
        || confirmed(&stuck) == 1.0 && confirmed(&publishing) == 1.0,
    );
    wait_for(
        "both daemons poll the shard",
        Duration::from_secs(20),
        || {
            [&stuck, &publishing]
                .iter()
                .all(|d| d.log_text().contains("poller slots rebalanced instances=2"))
        },
    );

    let rt = common::runtime();
    let client = config.client(&rt);
    let (mut con, mut far) = (scheduler.conn(), target.conn());
    // Either mover may move a wave; over 12 waves the stuck daemon's moves some.
    for wave in 1..=12 {
        let due = redis_now_ms(&mut con) + 100;
        rt.block_on(client.enqueue(
            NewJob::new("mirror", format!("wave-{wave}")).at(due),
            OnConflict::Error,
        ))
        .expect("enqueue");
        let started = Instant::now();
        wait_for(
            &format!("wave {wave} delivered well before an idle poll"),
            Duration::from_secs(5),
            || llen(&mut far, "q:remote") == wave,
        );
        eprintln!("wave {wave}: {:?}", started.elapsed());
    }
    assert!(
        publishing.metric("zdelay_wakeups_total", &[("cause", "queued")]) >= 1.0,
        "the stuck daemon's mover queued some waves: {}",
        publishing.log_text()
    );
}
