//! Secure connections: Redis over TLS (verified, mutual, refused, insecure), refused
//! credentials reported as authentication failures, and secrets that never reach any output.

use crate::broker_security::{AuthTansu, NatsServer};
use crate::common::tls::{TestCa, TlsRedis};
use crate::common::{
    Daemon, RedisServer, TestConfig, free_port, http_get, http_request, wait_for, zdelay_bin,
};
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
    // Each retry is logged at debug level (the episode once, as a warning).
    let daemon = Daemon::spawn_with_env(&config, &[("ZDELAY_LOG", "info,zdelay::app=debug")]);
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
    /// A `<field>_file` line of the TOML file naming a file that holds the value (for
    /// `creds_file`: a NATS credentials file).
    File(&'static str),
}

/// Every place a secret can be configured, one line each: (secret, how it is set). Each
/// broker is a real one that refuses the secret: `{port}` the scheduling Redis, `{amqp}`
/// RabbitMQ, `{nats_user}` a nats-server with user/password, `{nats_token}` one with a token,
/// `{kafka}` a tansu requiring SASL SCRAM; `{closed}` a port nothing listens on. Secrets that
/// are not part of a URL hold `"` and `\`, which JSON log lines and debug-printed errors
/// escape.
const PLANTED: &[(&str, Via)] = &[
    (
        "urlpw-0a1b",
        Via::Toml("redis.url = \"redis://zdsec:{}@127.0.0.1:{port}\""),
    ),
    ("redis\"pw\\-2c3d", Via::Env("ZDELAY_REDIS__PASSWORD")),
    (
        "kafka\"pw\\-4e5f",
        Via::File("sinks.k.librdkafka.\"sasl.password_file\""),
    ),
    (
        "kafka\"sasl\\-1a2b",
        Via::Toml(
            "sinks.ks.sasl = { mechanism = \"SCRAM-SHA-256\", username = \"alice\", \
             password = \"{}\" }",
        ),
    ),
    ("amqppw-6a7b", Via::Env("ZDELAY_SINKS__A__URL")),
    ("natspw-8c9d", Via::File("sinks.n.url_file")),
    ("nats\"pass\\-3e4f", Via::Toml("sinks.np.password = \"{}\"")),
    ("nats\"tok\\-5a6b", Via::Env("ZDELAY_SINKS__NT__TOKEN")),
    ("natsjwt-7c8d", Via::File("sinks.nc.creds_file")),
    (
        "sinkpw-0e1f",
        Via::Toml("sinks.r.url = \"redis://nosuch:{}@127.0.0.1:{port}\""),
    ),
    (
        "admin\"token\\-9e0f-1a2b",
        Via::Toml("admin.token = \"{}\""),
    ),
    (
        "otlppw-2a3b",
        Via::Toml(
            "tracing.otlp_endpoint = \"http://otel:{}@127.0.0.1:{closed}/v1/traces?tenant=t1&\
             api_key=otlpkey-4c5d\"",
        ),
    ),
];

/// A credential in the query of the collector's URL (planted with `otlppw-2a3b`).
const OTLP_QUERY_SECRET: &str = "otlpkey-4c5d";

/// `secret` as a TOML basic string's content.
fn toml_escaped(secret: &str) -> String {
    secret.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Every form `secret` takes in printed text: as is, escaped in a JSON string, debug-printed,
/// and debug-printed inside a JSON string.
fn printed_forms(secret: &str) -> Vec<String> {
    let json = |s: &str| {
        serde_json::Value::from(s)
            .to_string()
            .trim_matches('"')
            .to_owned()
    };
    let debug = |s: &str| format!("{s:?}").trim_matches('"').to_owned();
    vec![
        secret.to_owned(),
        json(secret),
        debug(secret),
        json(&debug(secret)),
    ]
}

/// The strings of every JSON value on the lines of `log` (the daemon's `--log-format json`
/// output), unescaped: a secret in any of them is a secret printed.
fn json_log_strings(log: &str) -> Vec<String> {
    fn strings(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
            serde_json::Value::Object(map) => map.values().for_each(|v| strings(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for line in log.lines().filter(|l| l.starts_with('{')) {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("a JSON log line: {e}: {line}"));
        strings(&value, &mut out);
    }
    out
}

/// A NATS user seed (async-nats' documentation example): valid, so the sink gets as far as
/// sending its CONNECT, with the planted JWT.
const NATS_SEED: &str = "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM";

/// What an env variable or file holds for a secret (URL fields take the whole URL), with
/// the `{…}` addresses still to fill in.
fn planted_value(via: &Via, secret: &str) -> String {
    match via {
        Via::Env("ZDELAY_SINKS__A__URL") => format!("amqp://guest:{secret}@{{amqp}}/%2f"),
        Via::File("sinks.n.url_file") => format!("nats://zd:{secret}@127.0.0.1:{{nats_user}}\n"),
        Via::File("sinks.nc.creds_file") => format!(
            "-----BEGIN NATS USER JWT-----\n{secret}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{NATS_SEED}\n------END USER NKEY SEED------\n"
        ),
        _ => format!("{secret}\n"),
    }
}

/// Every secret planted in the config, refused by real servers where there is one, never
/// appears — as is or escaped — in check-config, a failing CLI command, the daemon's log at
/// trace level (text and JSON lines), `zdelay stats` (table and JSON), `/metrics`,
/// `/readyz`, or the console's pages and API.
#[test]
fn secrets_never_reach_any_output() {
    let services = crate::common::Services::get();
    let redis_password = format!(">{}", PLANTED[1].0);
    let redis = RedisServer::start_with(&[
        "--user",
        "zdsec",
        "on",
        &redis_password,
        "~*",
        "&*",
        "+@all",
    ]);
    let nats_bin = services.var("NATS_BIN");
    let nats_user = NatsServer::start(&nats_bin, "authorization { user: alice, password: s3cret }");
    let nats_token = NatsServer::start(&nats_bin, "authorization { token: t0ken-ok }");
    let tansu_dir = tempfile::tempdir().unwrap();
    let kafka = AuthTansu::start(
        &services.var("TANSU_BIN"),
        tansu_dir.path(),
        free_port(),
        true,
    );
    let amqp = services.amqp_url();
    let amqp = amqp
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("amqp://user:pass@host:port/vhost")
        .to_owned();
    let closed = free_port();
    let admin_port = free_port();
    let fill = |text: &str| {
        text.replace("{port}", &redis.port.to_string())
            .replace("{amqp}", &amqp)
            .replace("{nats_user}", &nats_user.port.to_string())
            .replace("{nats_token}", &nats_token.port.to_string())
            .replace("{kafka}", &kafka.port.to_string())
            .replace("{closed}", &closed.to_string())
    };
    let dir = tempfile::tempdir().unwrap();
    let mut toml = fill(
        "[admin]\nlisten = \"127.0.0.1:ADMIN\"\n[redis]\nshards = 2\n[tracing]\n\
         [sinks.k]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{kafka}\"\n\
         [sinks.k.librdkafka]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\
         \"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"zd\"\n\
         [sinks.ks]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{kafka}\"\n\
         [sinks.a]\nkind = \"amqp\"\n[sinks.n]\nkind = \"nats\"\njetstream = false\n\
         [sinks.np]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:{nats_user}\"\nuser = \"alice\"\n\
         [sinks.nt]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:{nats_token}\"\n\
         [sinks.nc]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:{nats_user}\"\n\
         [sinks.r]\nkind = \"redis\"\n\
         [sinks.rok]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:{port}\"\n\
         [[routes]]\nname = \"default\"\nsink = \"local\"\ntarget = \"queue:default\"\n",
    )
    .replace("ADMIN", &admin_port.to_string());
    // `rok` delivers (to the scheduling Redis, two-phase): its span goes to the collector.
    let sinks = ["k", "ks", "a", "n", "np", "nt", "nc", "r", "rok"];
    for sink in sinks {
        toml.push_str(&format!(
            "[[routes]]\nname = \"{sink}\"\nsink = \"{sink}\"\ntarget = \"t\"\n"
        ));
    }
    let mut env = Vec::new();
    // Dotted TOML keys: each planted line becomes `[section]\nkey = value` appended last.
    for (i, (secret, via)) in PLANTED.iter().enumerate() {
        let line = match via {
            Via::Toml(line) => fill(&line.replace("{}", &toml_escaped(secret))),
            Via::Env(var) => {
                env.push((var.to_string(), fill(planted_value(via, secret).trim())));
                continue;
            }
            Via::File(key) => {
                let path = dir.path().join(format!("secret{i}"));
                std::fs::write(&path, fill(&planted_value(via, secret))).unwrap();
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
        let header = format!("[{section}]\n");
        assert!(toml.contains(&header), "no {header} for {line}");
        toml = toml.replacen(&header, &format!("{header}{key} = {assignment}\n"), 1);
    }
    let path = dir.path().join("zdelay.toml");
    std::fs::write(&path, &toml).unwrap();
    let zdelay = |args: &[&str], with_env: bool| {
        let mut cmd = Command::new(zdelay_bin());
        cmd.arg("--config")
            .arg(&path)
            .args(args)
            .env("ZDELAY_LOG", "trace")
            // Spans of the delivered job go to the (closed) collector at once.
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
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
    // One job for each route: the publishers try their refused brokers, and the local one is
    // delivered, so a span is exported to the collector URL.
    for route in std::iter::once("default").chain(sinks) {
        let out = zdelay(&["enqueue", "--dest", route, "--payload", "x"], true)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        outputs.push((format!("enqueue to {route}"), text(&out)));
    }

    let admin_token = PLANTED
        .iter()
        .find(|(_, via)| matches!(via, Via::Toml(line) if line.starts_with("admin.token")))
        .expect("a planted admin token")
        .0;
    // The daemon's log in both formats: JSON escapes `"` and `\` in every value.
    let mut json_strings = Vec::new();
    for format in ["text", "json"] {
        let log = dir.path().join(format!("daemon-{format}.log"));
        let mut daemon = zdelay(&["run"], true)
            .env("ZDELAY_LOG_FORMAT", format)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // Every broker refused its credentials (a real refusal, not a closed port), as
        // /readyz says, and the span export to the closed collector failed.
        let refusals = [
            "sink a (amqp): down: authentication failed for user guest",
            "sink k (kafka): down: authentication failed for user zd",
            "sink ks (kafka): down: authentication failed for user alice",
            "sink n (nats): down: authentication failed for user zd",
            "sink np (nats): down: authentication failed for user alice",
            "sink nt (nats): down: authentication failed for token authentication",
            "sink nc (nats): down: authentication failed for the user of",
            "sink r (redis): down: redis at redis://nosuch:***@127.0.0.1",
        ];
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let body = http_get(admin_port, "/readyz").map_or_else(String::new, |(_, b)| b);
            if refusals.iter().all(|r| body.contains(r)) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not every refusal in /readyz:\n{body}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        wait_for("the span export to fail", Duration::from_secs(30), || {
            std::fs::read_to_string(&log)
                .is_ok_and(|l| l.contains("BatchSpanProcessor.ExportError"))
        });
        for (name, args) in [
            ("stats", &["stats"][..]),
            ("stats --json", &["stats", "--json"][..]),
        ] {
            let out = zdelay(args, true).output().unwrap();
            outputs.push((name.into(), text(&out)));
        }
        for route in [
            "/metrics",
            "/readyz",
            "/",
            "/app.js",
            "/api/stats",
            "/api/forecast",
            "/api/dead",
            "/api/schedules",
        ] {
            let (_, body) = http_get(admin_port, route).expect("admin answers");
            outputs.push((route.into(), body));
        }
        let token = format!("Authorization: Bearer {admin_token}");
        let wrong = format!(
            "Authorization: Bearer {}x",
            &admin_token[..admin_token.len() - 1]
        );
        for (name, headers) in [
            ("POST /api/auth", vec![token.as_str()]),
            ("POST /api/auth, wrong token", vec![wrong.as_str()]),
        ] {
            let (_, body) =
                http_request(admin_port, "POST", "/api/auth", &headers).expect("answers");
            outputs.push((name.into(), body));
        }
        let _ = daemon.kill();
        let _ = daemon.wait();
        let log = std::fs::read_to_string(&log).unwrap();
        // The trace level reached the brokers' clients (they log the addresses they dial).
        assert!(log.contains("TRACE") && log.len() > 10_000, "{log}");
        if format == "json" {
            json_strings = json_log_strings(&log);
            assert!(json_strings.len() > 1000, "{log}");
        }
        outputs.push((format!("daemon log ({format})"), log));
    }

    let secrets = PLANTED
        .iter()
        .map(|(s, _)| *s)
        .chain([NATS_SEED, OTLP_QUERY_SECRET]);
    for secret in secrets {
        for (name, output) in &outputs {
            for form in printed_forms(secret) {
                assert!(!output.contains(&form), "{form} in {name}:\n{output}");
            }
        }
        for value in &json_strings {
            assert!(
                !value.contains(secret),
                "{secret} in a JSON log line: {value}"
            );
        }
    }
}
