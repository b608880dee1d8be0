//! A namespace taken over by a newer storage layout or a newer build, against real Redis.
//!
//! - This build: a schema whose `min_version` is above it, or whose layout it does not know,
//!   stops a daemon and refuses a producer at start, naming the version to run; a layout-1
//!   namespace (which only `zdelay upgrade` reads now) refuses its daemon, CLI and library,
//!   naming `zdelay upgrade`, before and while the upgrade runs.
//! - The older release that serves layout 1 ([`crate::common::pinned_bin`]): a layout-1 shard
//!   whose marker says `layout 2 <version>` (or `upgrading 2 <version>`) for a version newer
//!   than it refuses its producers and stops its daemons, writing nothing: the fence that keeps
//!   an older build out of shards a newer one took over.

use crate::common::{Daemon, RedisServer, TestConfig, all_keys, client, llen, pinned_bin};
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;
use zdelay::ClientError;
use zdelay::store::StoreError;

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

/// The version the older release says it is (`zdelay --version`).
fn pinned_version() -> String {
    let out = Command::new(pinned_bin())
        .arg("--version")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    said.trim()
        .rsplit(' ')
        .next()
        .expect("zdelay <version>")
        .to_owned()
}

#[test]
fn a_newer_layouts_marker_refuses_the_older_releases_producers_and_stops_its_daemon() {
    let redis = RedisServer::start();
    let config = config(&redis).legacy_namespace();
    let mut con = redis.conn();
    // Jobs due now, written before the newer layout took the shards over.
    let jobs: Vec<serde_json::Value> = (0..20)
        .map(|i| serde_json::json!({ "dest": "here", "payload": format!("job {i}") }))
        .collect();
    let waiting = config.pinned_batch(&jobs);
    let before = all_keys(&mut con);
    let due_before: usize = crate::common::layout_1_total(&mut con, SHARDS, "due");
    assert_eq!(due_before, waiting.len());

    // Half the shards moved to layout 2, half on their way, by a build newer than the older
    // release: both refuse it.
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
        pinned_version()
    );

    // Every job of a batch is refused with the reason (every shard is), and so are one
    // enqueue, cancel, reschedule and get: exit 1.
    let jobs: Vec<serde_json::Value> = (0..40)
        .map(|i| {
            let (payload, id) = (format!("new {i}"), format!("new-{i}"));
            serde_json::json!({ "dest": "here", "payload": payload, "id": id })
        })
        .collect();
    let lines = crate::common::json_lines(&jobs);
    let out = config.pinned_cli(&["enqueue", "--batch", crate::common::path_str(lines.path())]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    for line in 1..=jobs.len() {
        assert!(err.contains(&format!("line {line}: {want}\n")), "{err}");
    }
    let id = waiting[0].as_str();
    for args in [
        &["enqueue", "--dest", "here", "--payload", "p"][..],
        &["cancel", id],
        &["reschedule", id, "--in", "60s"],
        &["get", id],
    ] {
        let out = config.pinned_cli(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(&want),
            "{args:?}: {}",
            text(&out)
        );
    }

    // Its daemon starts (the schema still says layout 1), is refused by the first shard it
    // polls, and stops with the reason: exit 1, nothing delivered.
    let mut daemon = Daemon::spawn_bin(&pinned_bin(), &config, &[]);
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
        crate::common::layout_1_total(&mut con, SHARDS, "due"),
        due_before
    );
    assert_eq!(
        crate::common::layout_1_total(&mut con, SHARDS, "jobs"),
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

/// Every key with its serialized value (`DUMP`), but the registry of running daemons that
/// [`all_keys`] leaves out: to check that nothing was written.
#[cfg(feature = "test-failpoints")]
fn contents(con: &mut redis::Connection) -> std::collections::BTreeMap<String, Vec<u8>> {
    all_keys(con)
        .into_iter()
        .map(|key| {
            let value: Vec<u8> = redis::cmd("DUMP").arg(&key).query(con).unwrap();
            (key, value)
        })
        .collect()
}

/// This build's daemon, `zdelay enqueue` and library meet a layout-1 namespace (the older
/// release's) and refuse, naming `zdelay upgrade`, not retryable, writing nothing: before the
/// upgrade, and while it runs (`upgrading` = 2 in the schema). Once it is done they run.
#[cfg(feature = "test-failpoints")]
#[test]
fn this_build_refuses_a_layout_1_namespace_before_and_while_it_is_upgraded() {
    let redis = RedisServer::start();
    let config = config(&redis).legacy_namespace();
    let mut con = redis.conn();
    let jobs: Vec<serde_json::Value> = (0..20)
        .map(|i| serde_json::json!({ "dest": "here", "payload": format!("job {i}"), "in": "1h" }))
        .collect();
    config.pinned_batch(&jobs);
    let rt = crate::common::runtime();
    let refused = |con: &mut redis::Connection, when: &str| {
        let before = contents(con);
        for attach in [false, true] {
            let redis_config = crate::common::redis_config(&redis.url(), SHARDS);
            let connected = rt.block_on(async {
                if attach {
                    zdelay::Client::attach(&redis_config).await
                } else {
                    zdelay::Client::connect(&redis_config).await
                }
            });
            let e = connected.err().unwrap_or_else(|| {
                panic!("{when}: the library connected to a layout-1 namespace (attach: {attach})")
            });
            let said = e.to_string();
            assert!(said.contains("zdelay upgrade"), "{when}: {said}");
            assert!(!said.contains('\n'), "{when}: one line: {said}");
            assert!(!e.is_retryable(), "{when}: {said}");
        }
        let out = config.cli(&["enqueue", "--dest", "here", "--payload", "p"]);
        assert!(!out.status.success(), "{when}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("zdelay upgrade"), "{when}: {}", text(&out));
        assert_eq!(err.trim().lines().count(), 1, "{when}: {}", text(&out));
        let mut daemon = Daemon::spawn(&config);
        let status = daemon.wait_exit(Duration::from_secs(20));
        assert!(!status.success(), "{when}: {}", daemon.log_text());
        assert!(
            daemon.log_text().contains("zdelay upgrade"),
            "{when}: {}",
            daemon.log_text()
        );
        assert_eq!(contents(con), before, "{when}: nothing written");
    };
    refused(&mut con, "before the upgrade");

    // An upgrade that fenced the shards and waits there.
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("upgrade");
    let mut upgrade = Command::new(crate::common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["upgrade", "--yes"])
        .env(
            "ZDELAY_FAILPOINT",
            format!("upgrade_after_fence={}", release.display()),
        )
        .env("ZDELAY_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    crate::common::wait_for(
        "the upgrade fenced the shards",
        Duration::from_secs(20),
        || release.with_extension("reached").exists(),
    );
    let upgrading: Option<String> = redis::cmd("HGET")
        .arg("zdelay:schema")
        .arg("upgrading")
        .query(&mut con)
        .unwrap();
    assert_eq!(upgrading.as_deref(), Some("2"));
    refused(&mut con, "while the upgrade runs");

    std::fs::write(&release, b"go").unwrap();
    assert!(upgrade.wait().unwrap().success());
    let out = config.cli(&["enqueue", "--dest", "here", "--payload", "p"]);
    assert!(out.status.success(), "after the upgrade: {}", text(&out));
    Daemon::start(&config);
}
