//! A namespace taken over by a newer storage layout (issue 16, step 0 of the layout-2 plan):
//! a shard whose marker says `layout 2 <version>` (or `upgrading 2 <version>`) refuses this
//! build's producers and stops its daemons, writing nothing; a schema whose `min_version` is
//! above this build stops a daemon at start. Every refusal names the version to run.
//!
//! The markers' test is about a layout-1 namespace (what an older build's namespace looks
//! like when a newer one upgrades it), so it asks for layout 1; the schema's test runs on the
//! layout a new namespace gets.

use crate::common::{Daemon, RedisServer, TestConfig, all_keys, client, llen};
use std::collections::BTreeSet;
use std::time::Duration;
use zdelay::store::StoreError;
use zdelay::{ClientError, Due, NewJob, OnConflict};

const SHARDS: u16 = 4;

fn config(redis: &RedisServer) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[poller]
idle_poll = "50ms"

[[routes]]
name = "here"
sink = "local"
target = "q:here"
"#,
    )
}

fn set_markers(con: &mut redis::Connection, value: impl Fn(u16) -> String) {
    for s in 0..SHARDS {
        let _: () = redis::cmd("SET")
            .arg(format!("{{zdelay:{s}}}:shards"))
            .arg(value(s))
            .query(con)
            .unwrap();
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_newer_layouts_marker_refuses_producers_and_stops_a_daemon_writing_nothing() {
    let redis = RedisServer::start();
    let config = config(&redis).on_layout_1();
    let mut con = redis.conn();
    let rt = crate::common::runtime();
    let producer = rt
        .block_on(zdelay::Client::connect(&zdelay::config::RedisConfig {
            layout: Some(1),
            ..crate::common::redis_config(&redis.url(), SHARDS)
        }))
        .expect("a layout-1 namespace");
    // Jobs due now, written before the newer layout took the shards over.
    let waiting: Vec<String> = (0..20)
        .map(|i| {
            let job = NewJob::new("here", format!("job {i}"));
            rt.block_on(producer.enqueue(job, OnConflict::Error))
                .expect("enqueued")
                .0
        })
        .collect();
    let before = all_keys(&mut con);
    let due_before: usize = crate::common::shard_total(&mut con, SHARDS, "due");
    assert_eq!(due_before, waiting.len());

    // Half the shards moved to layout 2, half on their way: both refuse this build.
    set_markers(&mut con, |s| {
        if s % 2 == 0 {
            "layout 2 9.9.9".to_owned()
        } else {
            "upgrading 2 9.9.9".to_owned()
        }
    });
    let want = format!(
        "namespace zdelay needs zdelay 9.9.9 or later (storage layout 2; this is zdelay {}): \
         run zdelay 9.9.9 or later",
        env!("CARGO_PKG_VERSION")
    );

    // The library: every job of a batch fails with the reason (every shard is refused),
    // and so do one enqueue, cancel, reschedule and get.
    let jobs: Vec<NewJob> = (0..40)
        .map(|i| NewJob::new("here", format!("new {i}")).id(format!("new-{i}")))
        .collect();
    let results = rt
        .block_on(producer.enqueue_batch(jobs, OnConflict::Replace))
        .expect("the batch call itself answers");
    for result in &results {
        match result {
            Err(e @ ClientError::Store(StoreError::LayoutTooNew { .. })) => {
                assert_eq!(e.to_string(), want);
                assert!(!e.is_retryable());
                assert_eq!(e.kind(), "layout_too_new");
            }
            other => panic!("{other:?}"),
        }
    }
    let one = rt.block_on(producer.enqueue(NewJob::new("here", "x"), OnConflict::Replace));
    assert_eq!(one.unwrap_err().to_string(), want);
    let id = &waiting[0];
    let cancel = rt.block_on(producer.cancel(id));
    assert_eq!(cancel.unwrap_err().to_string(), want);
    let reschedule = rt.block_on(producer.reschedule(id, Due::In(Duration::from_secs(60))));
    assert_eq!(reschedule.unwrap_err().to_string(), want);
    let get = rt.block_on(producer.get(id));
    assert_eq!(get.unwrap_err().to_string(), want);

    // The CLI says the same and exits 1.
    let out = config.cli(&["enqueue", "--dest", "here", "--payload", "p"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&want),
        "{}",
        text(&out)
    );

    // A daemon starts (the schema still says layout 1), is refused by the first shard it
    // polls, and stops with the reason: exit 1, nothing delivered.
    let mut daemon = Daemon::spawn(&config);
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(1), "{}", daemon.log_text());
    assert!(daemon.log_text().contains(&want), "{}", daemon.log_text());
    assert_eq!(llen(&mut con, "q:here"), 0, "nothing delivered");

    // Nothing written anywhere: the same keys (the markers aside), the same jobs due.
    let markers: BTreeSet<String> = (0..SHARDS)
        .map(|s| format!("{{zdelay:{s}}}:shards"))
        .collect();
    let after: BTreeSet<String> = all_keys(&mut con).difference(&markers).cloned().collect();
    assert_eq!(after, before);
    assert_eq!(
        crate::common::shard_total(&mut con, SHARDS, "due"),
        due_before
    );
    assert_eq!(
        crate::common::shard_total(&mut con, SHARDS, "jobs"),
        due_before
    );
}

#[test]
fn a_schema_that_needs_a_newer_build_stops_a_daemon_and_a_producer_at_start() {
    let redis = RedisServer::start();
    let config = config(&redis);
    let mut con = redis.conn();
    let rt = crate::common::runtime();
    drop(client(&rt, &redis.url(), SHARDS));
    let _: () = redis::cmd("HSET")
        .arg("zdelay:schema")
        .arg("min_version")
        .arg("9.9.9")
        .query(&mut con)
        .unwrap();
    let want = format!(
        "namespace zdelay needs zdelay 9.9.9 or later (storage layout 2; this is zdelay {}): \
         run zdelay 9.9.9 or later",
        env!("CARGO_PKG_VERSION")
    );

    let mut daemon = Daemon::spawn(&config);
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(1), "{}", daemon.log_text());
    assert!(daemon.log_text().contains(&want), "{}", daemon.log_text());

    let producer = rt.block_on(zdelay::Client::connect(&crate::common::redis_config(
        &redis.url(),
        SHARDS,
    )));
    let e = producer.err().expect("refused");
    assert!(matches!(
        e,
        ClientError::Store(StoreError::LayoutTooNew { .. })
    ));
    assert_eq!(e.to_string(), want);

    let out = config.cli(&["enqueue", "--dest", "here", "--payload", "p"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&want),
        "{}",
        text(&out)
    );

    // A schema on layout 3 that names no version: refused as a layout this build does not know.
    let _: () = redis::cmd("HSET")
        .arg("zdelay:schema")
        .arg("layout")
        .arg("3")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("HDEL")
        .arg("zdelay:schema")
        .arg("min_version")
        .query(&mut con)
        .unwrap();
    let mut daemon = Daemon::spawn(&config);
    assert_eq!(
        daemon.wait_exit(Duration::from_secs(20)).code(),
        Some(1),
        "{}",
        daemon.log_text()
    );
    assert!(
        daemon
            .log_text()
            .contains("namespace zdelay is on storage layout 3, which this build"),
        "{}",
        daemon.log_text()
    );
    // Nothing of a namespace was written by either refused start.
    let keys: BTreeSet<String> = all_keys(&mut con);
    assert_eq!(
        keys,
        BTreeSet::from(["zdelay:schema".to_owned()]),
        "only the schema"
    );
}
