//! The producer library builds without the daemon: no broker client, HTTP server or CLI
//! parser, no OpenTelemetry among its dependencies (`scripts/test.sh` also builds it alone).

use std::process::Command;

/// Crates only the daemon may pull in.
const DAEMON_ONLY: &[&str] = &[
    "rdkafka",
    "rdkafka-sys",
    "lapin",
    "async-nats",
    "axum",
    "hyper",
    "clap",
    "metrics-exporter-prometheus",
    "indicatif",
    // Trace context is plain headers on the producer side; spans are the daemon's.
    "opentelemetry",
    "opentelemetry_sdk",
    "opentelemetry-otlp",
    "reqwest",
];

#[test]
fn producer_crate_needs_no_broker_client_http_server_or_cli_parser() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "zdelay-client",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        ["zdelay-client", "zdelay-core", "redis"]
            .iter()
            .all(|c| crates.contains(c)),
        "the tree lists the producer crate, the core under it and its Redis client: {tree}"
    );
    for name in DAEMON_ONLY {
        assert!(
            !crates.contains(name),
            "the producer crate depends on {name}:\n{tree}"
        );
    }
}

/// A producer takes the namespace as the daemons made it: `Client::open` reads the shard count
/// (10 here, not the default 16, so a two-phase job lands in the spread shard the whole CRC
/// modulo 10 names, not the key slot modulo 10), and before any daemon it is refused,
/// retryably, writing nothing: a producer that created the namespace would choose the shard
/// count itself.
#[test]
fn a_producer_reads_the_shard_count_from_the_namespace_and_never_creates_it() {
    use crate::common::{self, Daemon, RedisServer, TestConfig};
    use zdelay::store::StoreError;
    use zdelay::{Client, ClientError, NewJob, OnConflict};

    let redis = RedisServer::start();
    let rt = common::runtime();
    let url = redis.url();
    let mut con = redis.conn();
    let dbsize = |con: &mut redis::Connection| -> u64 { redis::cmd("DBSIZE").query(con).unwrap() };

    let err = rt
        .block_on(Client::open(&url))
        .err()
        .expect("no namespace yet");
    assert!(
        matches!(&err, ClientError::Store(StoreError::NoNamespace { namespace }) if namespace == "zdelay"),
        "{err}"
    );
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("start one"), "{err}");
    assert_eq!(dbsize(&mut con), 0, "a refused producer writes nothing");

    // A daemon at start creates the namespace from its config and registers its routes (here
    // a two-phase one, to a Redis list: its jobs wait in the spread shards).
    let config = TestConfig::new(
        &url,
        10,
        &format!(
            "[sinks.other]\nkind = \"redis\"\nurl = \"{}\"\n\n[[routes]]\nname = \"emails\"\n\
             sink = \"other\"\ntarget = \"q:emails\"\n",
            redis.url()
        ),
    );
    let _daemon = Daemon::start(&config);

    let producer = rt.block_on(Client::open(&url)).expect("open");
    assert_eq!(producer.keys().shards(), 10);
    let id = "{user-42}:invoice";
    let later = NewJob::new("emails", "hi")
        .id(id)
        .after(std::time::Duration::from_secs(3600));
    rt.block_on(producer.enqueue(later, OnConflict::Replace))
        .expect("enqueue");
    // CRC-16 of "user-42" is 63,739: shard 9 of 10; its key slot 14,587 would say 7.
    let spread = zdelay::keys::Keys::new("zdelay", 10);
    let in_shard = |s: u16| -> bool {
        redis::cmd("HEXISTS")
            .arg(spread.jobs(s))
            .arg(id)
            .query(&mut redis.conn())
            .unwrap()
    };
    assert!(in_shard(9) && !in_shard(7));
}
