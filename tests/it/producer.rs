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
        crates.contains(&"zdelay-client") && crates.contains(&"redis"),
        "the tree lists the producer crate and its Redis client: {tree}"
    );
    for name in DAEMON_ONLY {
        assert!(
            !crates.contains(name),
            "the producer crate depends on {name}:\n{tree}"
        );
    }
}
