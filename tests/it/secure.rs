//! Secure connections: Redis over TLS (verified, mutual, refused, insecure), refused
//! credentials reported as authentication failures, and secrets that never reach any output.

use crate::common::tls::{TestCa, TlsRedis};
use crate::common::{Daemon, RedisServer, TestConfig, free_port, http_get, wait_for, zdelay_bin};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn llen(server: &TlsRedis, ca: &TestCa, key: &str) -> usize {
    server
        .cli(&ca.cli_args(), &["LLEN", key])
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn mutual_tls_enqueue_and_delivery() {
    let ca = TestCa::new();
    let server = TlsRedis::start(&ca, "server", &["--tls-auth-clients", "yes"]);
    let config = TestConfig::new(&server.url(), 2, &ca.redis_tls_toml(true));
    let _daemon = Daemon::start(&config);
    let out = config.cli(&["enqueue", "--dest", "default", "--payload", "over-tls"]);
    assert!(out.status.success(), "{}", text(&out));
    wait_for(
        "the job delivered over TLS",
        Duration::from_secs(10),
        || llen(&server, &ca, "queue:default") == 1,
    );

    // The server requires a client certificate: without the pair, a clear TLS error.
    let no_pair = TestConfig::new(&server.url(), 2, &ca.redis_tls_toml(false));
    let out = no_pair.cli(&["enqueue", "--dest", "default", "--payload", "x"]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.to_lowercase().contains("certificate"), "{said}");
    assert!(said.contains("TLS"), "{said}");
}

#[test]
fn a_certificate_from_another_ca_is_refused_and_insecure_skip_verify_warns() {
    let ca = TestCa::new();
    let server = TlsRedis::start(&ca, "other-server", &[]);
    let config = TestConfig::new(&server.url(), 2, &ca.redis_tls_toml(false));
    let out = config.cli(&["enqueue", "--dest", "default", "--payload", "x"]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("UnknownIssuer"), "{said}");
    assert!(said.contains("redis.tls.ca_file"), "{said}");
    assert!(!said.contains("unreachable"), "{said}");

    let insecure = TestConfig::new(
        &server.url(),
        2,
        "[redis.tls]\ninsecure_skip_verify = true\n",
    );
    let out = insecure.cli(&["enqueue", "--dest", "default", "--payload", "x"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("WARN") && said.contains("insecure_skip_verify"),
        "{said}"
    );
    assert_eq!(llen(&server, &ca, "queue:default"), 0);
}

#[test]
fn tls_cluster_enqueue_and_delivery() {
    let ca = TestCa::new();
    let mut extra: Vec<String> = ca.server_args("server");
    extra.extend(
        [
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-auth-clients",
            "no",
        ]
        .map(String::from),
    );
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let cluster = crate::common::RedisCluster::start_tls(&extra, ca.cli_args());
    let config = cluster.config(4, &ca.redis_tls_toml(false));
    let _daemon = Daemon::start(&config);
    let out = config.cli(&["enqueue", "--dest", "default", "--payload", "over-tls"]);
    assert!(out.status.success(), "{}", text(&out));
    wait_for(
        "the job delivered on the TLS cluster",
        Duration::from_secs(10),
        || {
            cluster
                .cli_on_key("queue:default", &["LLEN", "queue:default"])
                .trim()
                == "1"
        },
    );
}

/// An ACL user whose password the config gets wrong: the CLI and the daemon say
/// "authentication failed for user …", the daemon retries with backoff, and becomes ready
/// once the server accepts the password.
#[test]
fn a_wrong_password_is_reported_as_an_authentication_failure() {
    let redis = RedisServer::start_with(&["--user", "bob", "on", ">rightpw1", "~*", "&*", "+@all"]);
    let url = redis.url().replacen("redis://", "redis://bob:wrongpw1@", 1);
    let config = TestConfig::new(&url, 2, "");
    for args in [
        &["enqueue", "--dest", "default", "--payload", "x"][..],
        &["stats"][..],
    ] {
        let out = config.cli(args);
        let said = text(&out);
        assert!(!out.status.success(), "{said}");
        assert!(
            said.contains("authentication failed for user bob"),
            "{args:?}: {said}"
        );
        assert!(
            !said.contains("unreachable") && !said.contains("wrongpw1"),
            "{said}"
        );
    }

    let started = Instant::now();
    let daemon = Daemon::spawn(&config);
    wait_for(
        "/readyz to name the refused credentials",
        Duration::from_secs(10),
        || {
            daemon.admin_get("/readyz").is_some_and(|(code, body)| {
                code == 503 && body.contains("authentication failed for user bob")
            })
        },
    );
    wait_for("a fourth attempt", Duration::from_secs(10), || {
        daemon.log_text().contains("attempt=4")
    });
    // Backoff 200 ms, 400 ms, 800 ms before the fourth attempt: no hot spin.
    assert!(started.elapsed() >= Duration::from_millis(1400));
    let log = daemon.log_text();
    assert!(log.contains("authentication failed for user bob"), "{log}");
    assert!(
        !log.contains("unreachable") && !log.contains("wrongpw1"),
        "{log}"
    );

    // The daemon kept retrying: the server now takes that password.
    let mut con = redis.conn();
    redis::cmd("ACL")
        .arg(&["SETUSER", "bob", ">wrongpw1"])
        .query::<()>(&mut con)
        .unwrap();
    daemon.wait_ready();
}

/// How a planted secret reaches zdelay.
enum Via {
    /// A line of the TOML file (the secret is substituted for `{}`).
    Toml(&'static str),
    /// An environment variable.
    Env(&'static str),
    /// A `<field>_file` line of the TOML file naming a file that holds the value.
    File(&'static str),
}

/// Every place a secret can be configured, one line each: (secret, how it is set). `{port}`
/// is the scheduling Redis, `{closed}` a port nothing listens on.
const PLANTED: &[(&str, Via)] = &[
    (
        "urlpw-0a1b",
        Via::Toml("redis.url = \"redis://zdsec:{}@127.0.0.1:{port}\""),
    ),
    ("redispw-2c3d", Via::Env("ZDELAY_REDIS__PASSWORD")),
    (
        "kafkapw-4e5f",
        Via::File("sinks.k.librdkafka.\"sasl.password_file\""),
    ),
    ("amqppw-6a7b", Via::Env("ZDELAY_SINKS__A__URL")),
    ("natspw-8c9d", Via::File("sinks.n.url_file")),
    (
        "sinkpw-0e1f",
        Via::Toml("sinks.r.url = \"redis://nosuch:{}@127.0.0.1:{port}\""),
    ),
];

/// What an env variable or file holds for a secret (URL fields take the whole URL).
fn planted_value(via: &Via, secret: &str, closed: u16) -> String {
    match via {
        Via::Env("ZDELAY_SINKS__A__URL") => format!("amqp://zd:{secret}@127.0.0.1:{closed}/%2f"),
        Via::File("sinks.n.url_file") => format!("nats://zd:{secret}@127.0.0.1:{closed}\n"),
        _ => format!("{secret}\n"),
    }
}

#[test]
fn secrets_never_reach_any_output() {
    let redis = RedisServer::start_with(&[
        "--user",
        "zdsec",
        "on",
        ">redispw-2c3d",
        "~*",
        "&*",
        "+@all",
    ]);
    let closed = free_port();
    let admin_port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let mut toml = format!(
        "[admin]\nlisten = \"127.0.0.1:{admin_port}\"\n[redis]\nshards = 2\n\
         [sinks.k]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{closed}\"\n\
         [sinks.k.librdkafka]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\
         \"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"zd\"\n\
         [sinks.a]\nkind = \"amqp\"\n[sinks.n]\nkind = \"nats\"\n[sinks.r]\nkind = \"redis\"\n\
         [[routes]]\nname = \"default\"\nsink = \"local\"\ntarget = \"queue:default\"\n\
         [[routes]]\nname = \"k\"\nsink = \"k\"\ntarget = \"t\"\n\
         [[routes]]\nname = \"a\"\nsink = \"a\"\ntarget = \"/q\"\n\
         [[routes]]\nname = \"n\"\nsink = \"n\"\ntarget = \"s\"\n\
         [[routes]]\nname = \"r\"\nsink = \"r\"\ntarget = \"q\"\n"
    );
    let mut env = Vec::new();
    // Dotted TOML keys: each planted line becomes `[section]\nkey = value` appended last.
    for (i, (secret, via)) in PLANTED.iter().enumerate() {
        let line = match via {
            Via::Toml(line) => line
                .replace("{}", secret)
                .replace("{port}", &redis.port.to_string()),
            Via::Env(var) => {
                env.push((
                    var.to_string(),
                    planted_value(via, secret, closed).trim().to_owned(),
                ));
                continue;
            }
            Via::File(key) => {
                let path = dir.path().join(format!("secret{i}"));
                std::fs::write(&path, planted_value(via, secret, closed)).unwrap();
                format!("{key} = {:?}", path.display().to_string())
            }
        };
        let (table, assignment) = line.split_once(" = ").unwrap();
        let (section, key) = table.rsplit_once('.').unwrap_or(("", table));
        let (section, key) = if key.ends_with('"') {
            // librdkafka."sasl.password_file": the quoted key holds a dot.
            let (s, k) = table.split_once(".\"").unwrap();
            (s.to_owned(), format!("\"{k}"))
        } else {
            (section.to_owned(), key.to_owned())
        };
        toml = toml.replacen(
            &format!("[{section}]\n"),
            &format!("[{section}]\n{key} = {assignment}\n"),
            1,
        );
    }
    let path = dir.path().join("zdelay.toml");
    std::fs::write(&path, &toml).unwrap();
    let zdelay = |args: &[&str], with_env: bool| {
        let mut cmd = Command::new(zdelay_bin());
        cmd.arg("--config")
            .arg(&path)
            .args(args)
            .env("ZDELAY_LOG", "trace");
        if with_env {
            cmd.envs(env.iter().map(|(k, v)| (k, v)));
        } else {
            cmd.envs(
                env.iter()
                    .filter(|(k, _)| k != "ZDELAY_REDIS__PASSWORD")
                    .map(|(k, v)| (k, v)),
            );
        }
        cmd
    };

    let mut outputs: Vec<(String, String)> = Vec::new();
    let out = zdelay(&["check-config"], true).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    outputs.push(("check-config".into(), text(&out)));
    // Without redis.password the URL's (wrong) password is used: refused.
    let out = zdelay(&["enqueue", "--dest", "default", "--payload", "x"], false)
        .output()
        .unwrap();
    assert!(
        text(&out).contains("authentication failed for user zdsec"),
        "{}",
        text(&out)
    );
    outputs.push(("failing enqueue".into(), text(&out)));

    let log = dir.path().join("daemon.log");
    let mut daemon = zdelay(&["run"], true)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut con = redis.conn();
    wait_for(
        "every sink checked (and down)",
        Duration::from_secs(30),
        || {
            redis::cmd("HLEN")
                .arg("{zdelay}:sinks")
                .query::<usize>(&mut con)
                .unwrap_or(0)
                >= 4
        },
    );
    for (name, args) in [
        ("stats", &["stats"][..]),
        ("stats --json", &["stats", "--json"][..]),
    ] {
        let out = zdelay(args, true).output().unwrap();
        outputs.push((name.into(), text(&out)));
    }
    for route in ["/metrics", "/readyz"] {
        let (_, body) = http_get(admin_port, route).expect("admin answers");
        outputs.push((route.into(), body));
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
    let log = std::fs::read_to_string(&log).unwrap();
    // The trace level reached the brokers' clients (they log the addresses they dial).
    assert!(log.contains("TRACE") && log.len() > 10_000, "{log}");
    outputs.push(("daemon log".into(), log));

    for (name, output) in &outputs {
        for (secret, _) in PLANTED {
            assert!(!output.contains(secret), "{secret} in {name}:\n{output}");
        }
    }
}
