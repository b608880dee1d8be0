//! Secure broker connections against real servers on loopback, and refused credentials
//! reported as "authentication failed for …" (never as an unreachable broker):
//! - AMQP: RabbitMQ's TLS listener of `scripts/services.sh` (`ZDELAY_TEST_AMQPS_URL`, its test
//!   CA in `ZDELAY_TEST_TLS_DIR`);
//! - NATS: a nats-server started here per auth method, from a config file, on both versions
//!   (for `creds_file`: operator mode, with operator, account and user JWTs signed here with
//!   nkeys, as `nsc` would);
//! - Kafka: a tansu started here with `--authentication` (SASL SCRAM-SHA-256/512; tansu 0.6
//!   from crates.io offers no PLAIN and has no TLS listener, see docs/brokers/kafka.md).
//!
//! Plus the daemon: a sink whose credentials are refused stays paused, says so in `/readyz`
//! and `zdelay stats`, and its jobs are neither dead-lettered nor charged an attempt.

use crate::common::stored_total;
use crate::common::{Daemon, RedisServer, Services, TestConfig, free_port, runtime, wait_for};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use zdelay::client::{NewJob, OnConflict};
use zdelay::config::{
    AmqpSinkConfig, KafkaSasl, KafkaSinkConfig, NatsSinkConfig, SaslMechanism, TlsConfig,
};
use zdelay::sinks::amqp::AmqpSink;
use zdelay::sinks::kafka::KafkaSink;
use zdelay::sinks::nats::NatsSink;
use zdelay::sinks::{Message, Outcome};

const AUTH_FAILED: &str = "authentication failed for";

fn message(target: &str) -> Message {
    Message {
        id: ulid::Ulid::generate().to_string(),
        due_ms: 1_700_000_000_000,
        target: target.to_owned(),
        payload: b"secure".to_vec(),
        headers: BTreeMap::new(),
        priority: None,
    }
}

fn tls_dir(services: &Services) -> PathBuf {
    PathBuf::from(services.var("TLS_DIR"))
}

fn tls(dir: &Path, ca: &str, client_cert: bool) -> TlsConfig {
    TlsConfig {
        ca_file: Some(dir.join(ca)),
        cert_file: client_cert.then(|| dir.join("client.pem")),
        key_file: client_cert.then(|| dir.join("client.key")),
        insecure_skip_verify: false,
    }
}

fn unavailable_reason(outcomes: &[Outcome]) -> String {
    match outcomes {
        [Outcome::Unavailable(why)] => why.clone(),
        other => panic!("expected one Unavailable outcome, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// AMQP over TLS

fn amqp_sink(url: &str, tls: Option<TlsConfig>) -> AmqpSink {
    let config = AmqpSinkConfig {
        url: url.into(),
        tls,
        ..Default::default()
    };
    AmqpSink::new("rabbit", &config).expect("amqp sink")
}

fn amqp_tool(python: &str, url: &str, args: &[&str]) -> String {
    let tool = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/amqp_tool.py");
    let out = Command::new(python)
        .arg(tool)
        .arg(url)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "amqp_tool.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// amqps:// with the test CA (and with a client certificate): confirmed, and the
/// independent consumer (over plain amqp://) gets it. An unrelated CA is refused as a
/// certificate problem, a wrong password as "authentication failed for user guest".
#[test]
fn amqps_with_the_ca_delivers_and_bad_ca_or_password_are_told_apart() {
    let services = Services::get();
    let (plain, tls_url, python) = (
        services.amqp_url(),
        services.var("AMQPS_URL"),
        services.python(),
    );
    let dir = tls_dir(&services);
    let queue = format!(
        "zd-tls-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    amqp_tool(&python, &plain, &["declare", &queue]);
    let rt = runtime();
    let target = format!("/{queue}");

    for client_cert in [false, true] {
        let sink = amqp_sink(&tls_url, Some(tls(&dir, "ca.pem", client_cert)));
        rt.block_on(async {
            assert_eq!(sink.check().await, Ok(()), "client cert: {client_cert}");
            let out = sink.publish(&[message(&target)]).await;
            assert_eq!(out, vec![Outcome::Delivered], "client cert: {client_cert}");
        });
    }
    let consumed = amqp_tool(&python, &plain, &["consume", &queue, "2", "30"]);
    assert_eq!(consumed.lines().count(), 2, "{consumed}");

    let wrong_ca = amqp_sink(&tls_url, Some(tls(&dir, "other-ca.pem", false)));
    let why = unavailable_reason(&rt.block_on(wrong_ca.publish(&[message(&target)])));
    eprintln!("amqps, unrelated CA: {why}");
    assert!(
        why.to_lowercase().contains("certificate") || why.contains("UnknownIssuer"),
        "{why}"
    );
    assert!(!why.contains(AUTH_FAILED), "{why}");

    let bad_password = tls_url.replace("guest:guest@", "guest:wrong@");
    let refused = amqp_sink(&bad_password, Some(tls(&dir, "ca.pem", false)));
    let why = unavailable_reason(&rt.block_on(refused.publish(&[message(&target)])));
    eprintln!("amqps, wrong password: {why}");
    assert!(
        why.starts_with("authentication failed for user guest"),
        "{why}"
    );
    assert!(!why.contains("wrong"), "the password never appears: {why}");
    let checked = rt.block_on(refused.check()).expect_err("check fails");
    assert!(
        checked.starts_with("authentication failed for user guest"),
        "{checked}"
    );
    amqp_tool(&python, &plain, &["delete", &queue]);
}

// ---------------------------------------------------------------------------------------
// NATS: user/password, token, TLS (mutual), on both server versions

/// A nats-server started here with `conf`, stopped (by its pid) on drop.
pub(crate) struct NatsServer {
    child: Child,
    pub(crate) port: u16,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    pub(crate) fn start(bin: &str, conf: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, format!("listen: 127.0.0.1:{port}\n{conf}\n")).expect("conf");
        let child = Command::new(bin)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        let server = NatsServer {
            child,
            port,
            _dir: dir,
        };
        wait_for("nats-server listening", Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        server
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nats_sink(config: NatsSinkConfig) -> NatsSink {
    NatsSink::new("bus", &config).expect("nats sink")
}

/// Publishes one core NATS message through `sink` while an independent client (connected
/// with `options`) subscribes: the subscriber must receive it.
fn nats_delivers(
    rt: &tokio::runtime::Runtime,
    url: &str,
    options: async_nats::ConnectOptions,
    sink: &NatsSink,
) {
    rt.block_on(async {
        let client = options
            .connect(url)
            .await
            .expect("independent client connects");
        let subject = format!("sec.{}", ulid::Ulid::generate());
        let mut sub = client.subscribe(subject.clone()).await.expect("subscribe");
        client.flush().await.expect("flush");
        assert_eq!(sink.check().await, Ok(()));
        assert_eq!(
            sink.publish(&[message(&subject)]).await,
            vec![Outcome::Delivered]
        );
        let got = tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(&mut sub))
            .await
            .expect("the subscriber receives it")
            .expect("a message");
        assert_eq!(&got.payload[..], b"secure");
    });
}

#[test]
fn nats_user_password_token_and_tls_on_both_versions() {
    let services = Services::get();
    let dir = tls_dir(&services);
    let rt = runtime();
    for kind in crate::common::NATS_KINDS {
        let bin = services.var(&format!("{}_BIN", kind.to_uppercase()));
        let started = Instant::now();

        // user / password
        let server = NatsServer::start(&bin, "authorization { user: alice, password: s3cret }");
        let config = |password: &str| NatsSinkConfig {
            url: server.url().into(),
            user: Some("alice".into()),
            password: Some(password.into()),
            ..Default::default()
        };
        let options =
            async_nats::ConnectOptions::with_user_and_password("alice".into(), "s3cret".into());
        nats_delivers(&rt, &server.url(), options, &nats_sink(config("s3cret")));
        let refused = nats_sink(config("wrong-pass"));
        let why = unavailable_reason(&rt.block_on(refused.publish(&[message("sec.x")])));
        eprintln!("{kind}, wrong password: {why}");
        assert!(
            why.starts_with("authentication failed for user alice"),
            "{why}"
        );
        assert!(!why.contains("wrong-pass"), "{why}");
        let checked = rt.block_on(refused.check()).expect_err("check fails");
        assert!(checked.starts_with(AUTH_FAILED), "{checked}");
        drop(server);

        // token
        let server = NatsServer::start(&bin, "authorization { token: t0ken-ok }");
        let config = |token: &str| NatsSinkConfig {
            url: server.url().into(),
            token: Some(token.into()),
            ..Default::default()
        };
        let options = async_nats::ConnectOptions::with_token("t0ken-ok".into());
        nats_delivers(&rt, &server.url(), options, &nats_sink(config("t0ken-ok")));
        let refused = nats_sink(config("t0ken-bad"));
        let why = unavailable_reason(&rt.block_on(refused.publish(&[message("sec.x")])));
        assert!(why.starts_with("authentication failed for token"), "{why}");
        assert!(!why.contains("t0ken-bad"), "{why}");
        drop(server);

        // mutual TLS (the server verifies the client certificate) plus user / password
        let d = dir.display();
        let server = NatsServer::start(
            &bin,
            &format!(
                "tls {{ cert_file: \"{d}/server.pem\", key_file: \"{d}/server.key\", \
                 ca_file: \"{d}/ca.pem\", verify: true }}\n\
                 authorization {{ user: alice, password: s3cret }}"
            ),
        );
        let config = |ca: &str| NatsSinkConfig {
            url: server.url().into(),
            user: Some("alice".into()),
            password: Some("s3cret".into()),
            tls: Some(tls(&dir, ca, true)),
            ..Default::default()
        };
        let options =
            async_nats::ConnectOptions::with_user_and_password("alice".into(), "s3cret".into())
                .require_tls(true)
                .add_root_certificates(dir.join("ca.pem"))
                .add_client_certificate(dir.join("client.pem"), dir.join("client.key"));
        nats_delivers(&rt, &server.url(), options, &nats_sink(config("ca.pem")));
        let untrusted = nats_sink(config("other-ca.pem"));
        let why = unavailable_reason(&rt.block_on(untrusted.publish(&[message("sec.x")])));
        eprintln!("{kind}, unrelated CA: {why}");
        assert!(!why.contains(AUTH_FAILED), "{why}");
        assert!(
            why.to_lowercase().contains("tls") || why.contains("certificate"),
            "{why}"
        );
        drop(server);
        eprintln!(
            "{kind}: nats auth and TLS checks in {:?}",
            started.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// NATS: creds_file (decentralized JWT authentication), on both server versions

/// A NATS JWT (v2): `claims` completed with the issuer, subject and issue time, signed with
/// the issuer's nkey (what `nsc` writes).
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": ulid::Ulid::generate().to_string(),
        "iat": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        "iss": issuer.public_key(),
        "sub": subject,
        "name": name,
        "nats": nats,
    });
    let signed = format!("{header}.{}", b64(claims.to_string().as_bytes()));
    let signature = issuer.sign(signed.as_bytes()).expect("signs");
    format!("{signed}.{}", b64(&signature))
}

/// An operator, an account and one user: the nats-server config of operator mode (memory
/// resolver, account preloaded) and the user's `.creds` file content.
fn operator_mode() -> (String, String) {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "zd-operator",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
    });
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "zd-account",
        serde_json::json!({"limits": unlimited, "type": "account", "version": 2}),
    );
    let conf = format!(
        "operator: {operator_jwt}\nresolver: MEMORY\nresolver_preload: {{\n  {}: {account_jwt}\n}}",
        account.public_key()
    );
    (conf, user_creds(&account))
}

/// A `.creds` file for a new user of `account`.
fn user_creds(account: &nkeys::KeyPair) -> String {
    let user = nkeys::KeyPair::new_user();
    let jwt = nats_jwt(
        account,
        &user.public_key(),
        "zd-user",
        serde_json::json!({
            "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
            "type": "user", "version": 2,
        }),
    );
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
        user.seed().expect("seed")
    )
}

/// A `creds_file` (JWT and seed hand-built with nkeys, as `nsc` would) delivers to an
/// independent subscriber logged in with the same credentials; a user of an account the
/// server does not know is refused as "authentication failed for the user of <file>".
#[test]
fn nats_creds_file_on_both_versions() {
    let services = Services::get();
    let rt = runtime();
    let dir = tempfile::tempdir().expect("temp dir");
    for kind in crate::common::NATS_KINDS {
        let bin = services.var(&format!("{}_BIN", kind.to_uppercase()));
        let (conf, creds) = operator_mode();
        let server = NatsServer::start(&bin, &conf);
        let path = dir.path().join(format!("{kind}.creds"));
        std::fs::write(&path, &creds).expect("creds file");
        let config = |creds_file: &Path| NatsSinkConfig {
            url: server.url().into(),
            jetstream: false,
            creds_file: Some(creds_file.to_owned()),
            ..Default::default()
        };
        let options = async_nats::ConnectOptions::with_credentials(&creds).expect("creds parse");
        nats_delivers(&rt, &server.url(), options, &nats_sink(config(&path)));

        let stranger = dir.path().join(format!("{kind}-stranger.creds"));
        std::fs::write(&stranger, user_creds(&nkeys::KeyPair::new_account())).expect("creds");
        let refused = nats_sink(config(&stranger));
        let why = unavailable_reason(&rt.block_on(refused.publish(&[message("sec.x")])));
        eprintln!("{kind}, creds of an unknown account: {why}");
        assert!(
            why.starts_with(&format!(
                "authentication failed for the user of {}",
                stranger.display()
            )),
            "{why}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Kafka: SASL PLAIN and SCRAM against tansu --authentication

/// tansu with SQLite storage (where it keeps SCRAM credentials), stopped (by its pid) on
/// drop; `authentication`: SASL required.
pub(crate) struct AuthTansu {
    child: Child,
    pub(crate) port: u16,
}

impl AuthTansu {
    pub(crate) fn start(bin: &str, dir: &Path, port: u16, authentication: bool) -> Self {
        let listener = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(bin)
            .current_dir(dir)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("RUST_LOG", "warn")
            .args(["broker", "--cluster-id", "zdelay-sasl", "--silent"])
            .args(authentication.then_some("--authentication"))
            .args([
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &listener,
            ])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tansu starts");
        let broker = AuthTansu { child, port };
        wait_for("tansu listening", Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        broker
    }
}

impl Drop for AuthTansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn kafka_sink(brokers: &str, mechanism: SaslMechanism, password: &str) -> KafkaSink {
    let config = KafkaSinkConfig {
        brokers: brokers.to_owned(),
        sasl: Some(KafkaSasl {
            mechanism,
            username: "alice".into(),
            password: password.into(),
        }),
        ..Default::default()
    };
    KafkaSink::new("kafka", &config).expect("kafka sink")
}

#[test]
fn kafka_sasl_scram_delivers_and_a_wrong_password_is_told() {
    let services = Services::get();
    let bin = services.var("TANSU_BIN");
    let dir = tempfile::tempdir().expect("temp dir");
    // The SCRAM user and the topic are made before SASL is switched on: this tansu build
    // offers no mechanism but SCRAM, so no client could log in to make them.
    let open = AuthTansu::start(&bin, dir.path(), free_port(), false);
    let brokers = format!("127.0.0.1:{}", open.port);
    let topic = "sasl-topic";
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/it/py/kafka_scram.py");
    let out = Command::new(services.python())
        .arg(script)
        .args([&brokers, "alice", "scram-pass", topic])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "kafka_scram.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let port = open.port;
    drop(open);
    let broker = AuthTansu::start(&bin, dir.path(), port, true);
    assert_eq!(broker.port, port);
    let rt = runtime();
    for mechanism in [SaslMechanism::ScramSha256, SaslMechanism::ScramSha512] {
        let sink = kafka_sink(&brokers, mechanism, "scram-pass");
        rt.block_on(async {
            assert_eq!(sink.check().await, Ok(()), "{mechanism:?}");
            let out = sink.publish(&[message(topic)]).await;
            assert_eq!(out, vec![Outcome::Delivered], "{mechanism:?}");
        });
    }
    let refused = kafka_sink(&brokers, SaslMechanism::ScramSha256, "wrong-pass");
    let started = Instant::now();
    let why = unavailable_reason(&rt.block_on(refused.publish(&[message(topic)])));
    eprintln!(
        "kafka SCRAM, wrong password ({:?}): {why}",
        started.elapsed()
    );
    assert!(
        why.contains("authentication failed for user alice"),
        "{why}"
    );
    assert!(!why.contains("wrong-pass"), "{why}");
    let checked = rt.block_on(refused.check()).expect_err("check fails");
    assert!(
        checked.starts_with("authentication failed for user alice"),
        "{checked}"
    );
}

// ---------------------------------------------------------------------------------------
// The daemon with refused credentials

/// A daemon whose AMQP sink's password is wrong: `/readyz` and `zdelay stats` say
/// "authentication failed for user guest", the job is neither delivered nor dead-lettered,
/// and the sink backs off (few connection attempts, not a hot spin).
#[test]
fn daemon_reports_refused_credentials_and_keeps_the_jobs() {
    let services = Services::get();
    let url = services
        .amqp_url()
        .replace("guest:guest@", "guest:wrong-pass@");
    let redis = RedisServer::start();
    let extra = format!(
        r#"
[poller]
idle_poll = "50ms"
sink_pause = "200ms"

[sinks.rabbit]
kind = "amqp"
url = "{url}"

[[routes]]
name = "billing"
sink = "rabbit"
target = "/zd-never"
"#
    );
    const SHARDS: u16 = 2;
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let rt = runtime();
    // A producer given the config, deployed before the daemon: it registers the route.
    let client = config.client(&rt);
    let ids: Vec<String> = rt
        .block_on(
            client.enqueue_batch(
                (0..5)
                    .map(|i| NewJob::new("billing", format!("j{i}").into_bytes()))
                    .collect(),
                OnConflict::Error,
            ),
        )
        .expect("enqueue")
        .into_iter()
        .map(|r| r.expect("enqueued").0)
        .collect();
    // Not `start`: that waits for /readyz to pass, which it must not here.
    let daemon = Daemon::spawn(&config);
    wait_for(
        "/readyz names the refused login",
        Duration::from_secs(30),
        || {
            matches!(daemon.admin_get("/readyz"),
            Some((503, body)) if body.contains("authentication failed for user guest"))
        },
    );
    // `zdelay stats` reads the sink states the daemon's checker writes to Redis.
    let mut text = String::new();
    wait_for(
        "zdelay stats names the refused login",
        Duration::from_secs(30),
        || {
            let stats = config.cli(&["stats"]);
            text = String::from_utf8_lossy(&stats.stdout).into_owned();
            text.contains("authentication failed for user guest")
        },
    );
    assert!(!text.contains("wrong-pass"), "{text}");
    // Let it retry for a while: still no job dead, none delivered, every job still there.
    std::thread::sleep(Duration::from_secs(3)); // an observation window, not a wait for a condition
    let mut con = redis.conn();
    assert_eq!(stored_total(&mut con, "dead"), 0);
    for id in &ids {
        let job = rt
            .block_on(client.get(id))
            .expect("get")
            .expect("the job is kept");
        assert!(job.reason.is_none(), "{:?}", job.reason);
    }
    let log = daemon.log_text();
    assert!(
        !log.contains("wrong-pass"),
        "the password never reaches the log"
    );
    let refusals = log.matches("authentication failed for user guest").count();
    eprintln!("daemon log: {refusals} lines name the refused login");
    assert!(refusals >= 1, "the log says why");
    assert!(
        refusals < 100,
        "backoff, not a hot spin: {refusals} refusals logged"
    );
}
