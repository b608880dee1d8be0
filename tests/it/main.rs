//! Integration tests: one binary, real `redis-server` processes started per test on free
//! loopback ports (see `common`), and the real `zdelay` binary for daemon and CLI tests.

mod amqp;
mod architecture;
mod bad_input;
mod broker_faults;
mod cli;
mod cluster;
mod common;
mod delivery;
mod faults;
mod kafka;
mod nats;
mod producer;
mod raw_sinks;
mod reshard;
mod seeds;
mod two_phase;

#[test]
fn harness_starts_redis_and_daemon() {
    let redis = common::RedisServer::start();
    let config = common::TestConfig::new(&redis.url(), 2, "");
    let daemon = common::Daemon::start(&config);
    let (status, body) = daemon.admin_get("/healthz").expect("admin answers");
    assert_eq!(status, 200, "{body}");
}
