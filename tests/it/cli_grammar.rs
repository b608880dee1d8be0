//! One CLI grammar: `-o text|json` (and `--json`) with the same meaning on every command that
//! prints, errors on stderr and data on stdout, exit codes; and `check-config --connect`
//! against a real Redis (with an ACL user) and the real brokers of `scripts/services.sh`.

use crate::common::{RedisServer, Services, TestConfig, redis_now_ms, runtime};
use serde_json::Value;
use std::process::Output;
use std::time::Duration;

const SHARDS: u16 = 4;

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    stdout(&out)
}

fn json(config: &TestConfig, args: &[&str]) -> Value {
    let text = ok(config, args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {text}"))
}

/// Text for people, JSON for scripts, `--json` the same as `-o json`; "not found" exits 3 with
/// its message on stderr and nothing on stdout, whatever the format.
#[test]
fn every_printing_command_speaks_text_and_json() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), SHARDS, "");

    // enqueue: the id alone, or {"id", "kept"}.
    let id = ok(
        &config,
        &[
            "enqueue",
            "--dest",
            "default",
            "--in",
            "1h",
            "--payload",
            "hello",
            "--header",
            "k=v",
        ],
    )
    .trim()
    .to_owned();
    assert!(zdelay::lane_id::LaneId::parse(&id).is_ok(), "{id}");
    // A generated id is never given back (`~` is reserved): a job of one's own is kept.
    let mine = |policy: &str| {
        json(
            &config,
            &[
                "enqueue",
                "--dest",
                "default",
                "--in",
                "1h",
                "--payload",
                "x",
                "--id",
                "mine",
                "--on-conflict",
                policy,
                "-o",
                "json",
            ],
        )
    };
    for (policy, kept) in [("error", false), ("keep", true)] {
        let v = mine(policy);
        assert_eq!(
            (v["id"].as_str(), v["kept"].as_bool()),
            (Some("mine"), Some(kept)),
            "{v}"
        );
    }

    // get: one field a line with times as durations, or the JSON document.
    let text = ok(&config, &["get", &id]);
    let field = |name: &str| -> String {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} line:\n{text}"))
            .to_owned()
    };
    assert!(field("id").ends_with(&id), "{text}");
    assert!(field("state").ends_with("scheduled"), "{text}");
    assert!(field("payload").ends_with("hello"), "{text}");
    assert!(field("headers").ends_with("k=v"), "{text}");
    let due = field("due");
    assert!(due.contains("(in 59m") || due.contains("(in 1h"), "{due}");
    for args in [&["get", &id, "-o", "json"][..], &["get", &id, "--json"]] {
        let v = json(&config, args);
        assert_eq!(v["payload"], "hello", "{v}");
        assert_eq!(v["state"], "scheduled", "{v}");
    }

    // reschedule and cancel.
    let v = json(&config, &["reschedule", &id, "--in", "2h", "-o", "json"]);
    assert_eq!(v["id"], id.as_str());
    assert!(v["due_ms"].as_i64().unwrap() > 0 && v["due"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        json(&config, &["cancel", &id, "--json"]),
        serde_json::json!({ "id": id, "cancelled": true })
    );
    for args in [
        &["cancel", &id, "-o", "json"][..],
        &["reschedule", &id, "--in", "1h", "-o", "json"],
        &["get", &id, "-o", "json"],
        &["schedule", "pause", "nope", "-o", "json"],
        &["schedule", "get", "nope", "--json"],
    ] {
        let out = config.cli(args);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {}", stderr(&out));
        assert!(
            stdout(&out).is_empty(),
            "{args:?}: data only: {}",
            stdout(&out)
        );
        assert!(!stderr(&out).is_empty(), "{args:?} says why on stderr");
    }

    for args in [
        &["get", &id, "--ignore-not-found"][..],
        &[
            "schedule",
            "get",
            "nope",
            "--ignore-not-found",
            "-o",
            "json",
        ],
    ] {
        let out = config.cli(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert!(
            stdout(&out).is_empty() && stderr(&out).is_empty(),
            "{args:?}"
        );
    }

    // schedules: text and JSON.
    ok(
        &config,
        &[
            "schedule", "set", "tick", "--dest", "default", "--every", "1h",
        ],
    );
    let text = ok(&config, &["schedule", "get", "tick"]);
    assert!(text.starts_with("tick  default  every 1h  next "), "{text}");
    assert_eq!(
        json(&config, &["schedule", "get", "tick", "-o", "json"])["id"],
        "tick"
    );
    assert_eq!(
        json(&config, &["schedule", "list", "-o", "json"])[0]["id"],
        "tick"
    );
    assert_eq!(
        json(&config, &["schedule", "pause", "tick", "-o", "json"]),
        serde_json::json!({ "id": "tick", "paused": true })
    );
    let v = json(
        &config,
        &[
            "schedule", "preview", "--every", "1m", "--from", "0", "--count", "2", "-o", "json",
        ],
    );
    assert_eq!(v[1]["ms"], 60_000);

    // stats and forecast.
    assert!(json(&config, &["stats", "-o", "json"])["total"].is_object());
    assert!(json(&config, &["forecast", "-o", "json"])["steps"].is_array());
    assert!(json(&config, &["dead", "list", "-o", "json"])["jobs"].is_array());

    // Bad input: a clear usage error (exit 2), never a panic.
    for (args, says) in [
        (&["stats", "-o", "yaml"][..], "invalid value 'yaml'"),
        (&["stats", "-o", "text", "--json"], "cannot be used with"),
        (
            &["enqueue", "--batch", "-", "-o", "json"],
            "-o json does not apply",
        ),
    ] {
        let out = config.cli(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    }
    // reshard's chunk size has its own name; the old one still works.
    let out = config.cli(&[
        "reshard",
        "--to",
        "2",
        "--dry-run",
        "--batch",
        "10",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = config.cli(&["reshard", "--to", "2", "--dry-run", "--ids-per-call", "10"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `dead list --limit N` prints N rows in all, the oldest across every shard and raw source.
/// `slot-tag` needs no Redis: a slot's tag, a key's slot and tag, in text and JSON; a number
/// that is no slot is a usage error (exit 2) unless `--key` says it is a key.
#[test]
fn slot_tag_answers_for_a_slot_and_for_a_key() {
    // A config naming a Redis that is not there: the command never connects.
    let config = TestConfig::new("redis://127.0.0.1:1", SHARDS, "");
    assert_eq!(ok(&config, &["slot-tag", "1"]), "slot 1: tag emj\n");
    let v = json(&config, &["slot-tag", "16383", "-o", "json"]);
    assert_eq!(v, serde_json::json!({ "slot": 16383, "tag": "hia" }));
    // CLUSTER KEYSLOT foo = 12182; a key's slot is its hash tag's.
    assert_eq!(
        ok(&config, &["slot-tag", "foo"]),
        "key \"foo\": slot 12182, tag foo\n"
    );
    let v = json(&config, &["slot-tag", "zdelay:{emj}:due:emails", "--json"]);
    assert_eq!(
        v,
        serde_json::json!({ "key": "zdelay:{emj}:due:emails", "slot": 1, "tag": "emj" })
    );
    for bad in ["16384", "99999999999999999999"] {
        let out = config.cli(&["slot-tag", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", stderr(&out));
        assert!(stdout(&out).is_empty());
        assert!(
            stderr(&out).contains(&format!("slot {bad} is out of range 0..=16383"))
                && stderr(&out).contains("--key"),
            "{}",
            stderr(&out)
        );
    }
    let v = json(&config, &["slot-tag", "--key", "16384", "--json"]);
    assert_eq!(v["key"], "16384");
    assert_eq!(v["slot"], 3025);
    assert_eq!(v["tag"], "657");
}

#[test]
fn dead_list_limit_counts_rows_in_all() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        "[[routes]]\nname = \"raw\"\nsink = \"local\"\ntarget = \"q:raw\"\n\n\
         [[sources]]\nkey = \"raw:a\"\nroute = \"raw\"\n",
    );
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    // Route raw's lane, registered by a producer given the config (its job cancelled).
    let rt = runtime();
    let lib = config.client(&rt);
    let (first, _) = rt
        .block_on(lib.enqueue(
            zdelay::NewJob::new("raw", "x").after(Duration::from_secs(3600)),
            zdelay::OnConflict::Error,
        ))
        .expect("enqueue");
    rt.block_on(lib.cancel(&first)).expect("cancel");
    let lane = crate::common::lane_keys("raw", "q:raw");
    // 40 dead jobs in the lane, one a second older than the next; raw members in between.
    let mut pipe = redis::pipe();
    for i in 0..40i64 {
        let id = format!("job-{i:02}");
        pipe.zadd(&lane.dead, &id, now - 100_000 + i * 1000)
            .hset(&lane.jobs, &id, "payload")
            .hset(&lane.reasons, &id, "seeded");
    }
    for i in 0..5i64 {
        let member = format!("member-{i}");
        pipe.zadd("raw:a:dead", &member, now - 99_500 + i * 1000)
            .hset("raw:a:dead:reasons", &member, "seeded");
    }
    pipe.query::<()>(&mut con).expect("seed dead jobs");

    let v = json(&config, &["dead", "list", "--limit", "7", "-o", "json"]);
    let jobs: Vec<&str> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    let raw = v["raw"].as_array().unwrap();
    // The 7 oldest: job-00, member-0, job-01, member-1, job-02, member-2, job-03.
    assert_eq!(jobs, ["job-00", "job-01", "job-02", "job-03"], "{v:#}");
    assert_eq!(raw.len(), 3, "{v:#}");

    // No rows asked for is a usage error, not an empty answer.
    let out = config.cli(&["dead", "list", "--limit", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--limit"), "{}", stderr(&out));
    assert!(stdout(&out).is_empty());

    let out = config.cli(&["dead", "list", "--limit", "10"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<String> = stdout(&out).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 10, "{lines:#?}");
    assert!(lines[0].starts_with("job-00 "), "oldest first: {lines:#?}");
    assert!(
        lines[1].starts_with("raw:a "),
        "merged by time of death: {lines:#?}"
    );
    assert!(
        stderr(&out).contains("more match; raise --limit"),
        "{}",
        stderr(&out)
    );
    // "more match" is exact, even when all the rows come from one source.
    for (limit, more) in [("4", true), ("5", false)] {
        let out = config.cli(&["dead", "list", "--source", "raw:a", "--limit", limit]);
        assert_eq!(
            stdout(&out).lines().count(),
            limit.parse::<usize>().unwrap()
        );
        assert_eq!(
            stderr(&out).contains("more match"),
            more,
            "{}",
            stderr(&out)
        );
    }
    let all = config.cli(&["dead", "list", "--limit", "1000"]);
    assert_eq!(stdout(&all).lines().count(), 45);
    assert!(!stderr(&all).contains("more match"), "{}", stderr(&all));
}

/// A route per destination object: each that exists passes, each missing one fails with
/// what to create, and the exit code says whether all passed.
#[test]
fn check_config_connect_checks_every_destination_object() {
    let svc = Services::get();
    let redis = RedisServer::start();
    let tag = ulid::Ulid::generate().to_string().to_lowercase();

    let topic = format!("zd-doctor-{tag}");
    crate::kafka::create_topic(&svc.var("KAFKA_TOPIC_CMD"), &topic, 1);
    let (exchange, queue) = (format!("zd-doctor-ex-{tag}"), format!("zd-doctor-q-{tag}"));
    crate::amqp::py(&svc.python(), &svc.amqp_url(), &["exchange", &exchange]);
    crate::amqp::py(&svc.python(), &svc.amqp_url(), &["declare", &queue]);
    // Both NATS servers the suite runs (2.15 and Debian's 2.9): their stream lookups differ.
    let nats = svc.nats_servers();
    runtime().block_on(async {
        for (kind, url) in &nats {
            let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
            for (name, window) in [
                ("long", Duration::from_secs(600)),
                ("short", Duration::from_secs(120)),
            ] {
                js.create_stream(async_nats::jetstream::stream::Config {
                    name: format!("ZD_DOCTOR_{kind}_{name}_{tag}").to_uppercase(),
                    subjects: vec![format!("doctor.{tag}.{kind}.{name}.>")],
                    duplicate_window: window,
                    ..Default::default()
                })
                .await
                .expect("create stream");
            }
        }
    });

    let mut sinks = format!(
        "[sinks.k]\nkind = \"kafka\"\nbrokers = \"{}\"\n\n\
         [sinks.a]\nkind = \"amqp\"\nurl = \"{}\"\n\n",
        svc.kafka_brokers(),
        svc.amqp_url()
    );
    for (kind, url) in &nats {
        sinks.push_str(&format!(
            "[sinks.{kind}]\nkind = \"nats\"\nurl = \"{url}\"\n\n"
        ));
    }
    let route = |name: &str, sink: &str, target: &str| {
        format!("[[routes]]\nname = \"{name}\"\nsink = \"{sink}\"\ntarget = \"{target}\"\n\n")
    };
    let mut good = [
        route("k-ok", "k", &topic),
        route("a-ex", "a", &format!("{exchange}/key")),
        route("a-q", "a", &format!("/{queue}")),
    ]
    .concat();
    let mut bad = [
        route("k-missing", "k", &format!("{topic}-missing")),
        route("a-missing", "a", &format!("{exchange}-missing/key")),
        route("a-q-missing", "a", &format!("/{queue}-missing")),
    ]
    .concat();
    for (kind, _) in &nats {
        let subject = |name: &str| format!("doctor.{tag}.{kind}.{name}.x");
        good.push_str(&route(&format!("{kind}-ok"), kind, &subject("long")));
        bad.push_str(&route(&format!("{kind}-short"), kind, &subject("short")));
        bad.push_str(&route(&format!("{kind}-missing"), kind, &subject("none")));
    }

    let all_good = TestConfig::new(&redis.url(), SHARDS, &format!("{sinks}{good}"));
    let out = all_good.cli(&["check-config", "--connect"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", stderr(&out));
    let nats_sinks: Vec<String> = nats
        .iter()
        .map(|(kind, _)| format!("sink {kind}"))
        .collect();
    for check in ["redis", "redis rights", "namespace", "sink k", "sink a"]
        .into_iter()
        .chain(nats_sinks.iter().map(String::as_str))
    {
        assert!(
            text.contains(&format!("ok      {check}: ")),
            "{check}:\n{text}"
        );
    }
    assert!(
        text.contains(&format!("route k-ok: topic {topic} exists")),
        "{text}"
    );
    assert!(
        text.contains(&format!("route a-ex: exchange {exchange} exists")),
        "{text}"
    );
    assert!(
        text.contains(&format!("route a-q: queue {queue} exists")),
        "{text}"
    );
    for (kind, _) in &nats {
        let stream = format!("ZD_DOCTOR_{kind}_LONG_").to_uppercase();
        assert!(
            text.contains(&format!("route {kind}-ok: stream {stream}")),
            "{text}"
        );
    }
    assert!(!text.contains("guest:guest"), "no credentials: {text}");

    let with_bad = TestConfig::new(&redis.url(), SHARDS, &format!("{sinks}{good}{bad}"));
    let out = with_bad.cli(&["check-config", "--connect"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    let failed = 3 + 2 * nats.len();
    assert!(
        stderr(&out).contains(&format!("{failed} of ")),
        "{}",
        stderr(&out)
    );
    let problem = |route: &str, fix: &str| {
        let at = text
            .find(&format!("PROBLEM route {route}: "))
            .unwrap_or_else(|| panic!("no problem line for {route}:\n{text}"));
        let next_two: Vec<&str> = text[at..].lines().take(2).collect();
        assert!(
            next_two[1].trim_start().starts_with("to fix: ") && next_two[1].contains(fix),
            "{route}: {next_two:#?}"
        );
    };
    problem("k-missing", &format!("--create --topic {topic}-missing"));
    problem(
        "a-missing",
        &format!("rabbitmqadmin declare exchange name={exchange}-missing"),
    );
    problem(
        "a-q-missing",
        &format!("rabbitmqadmin declare queue name={queue}-missing"),
    );
    for (kind, _) in &nats {
        let stream = format!("ZD_DOCTOR_{kind}_SHORT_").to_uppercase();
        problem(
            &format!("{kind}-short"),
            &format!("nats stream edit {stream}"),
        );
        problem(
            &format!("{kind}-missing"),
            &format!("nats stream add <NAME> --subjects 'doctor.{tag}.{kind}.none.x'"),
        );
    }
    assert!(text.contains("duplicate window, 2m, is shorter"), "{text}");
    assert!(
        text.contains("ok      route k-ok: "),
        "the good ones still pass: {text}"
    );

    let out = with_bad.cli(&["check-config", "--connect", "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["ok"], false);
    let checks = v["checks"].as_array().unwrap();
    let by_name = |name: &str| {
        checks
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no {name}: {v:#}"))
    };
    assert_eq!(by_name("route k-ok")["ok"], true);
    assert_eq!(by_name("route k-missing")["ok"], false);
    for (kind, _) in &nats {
        let hint = &by_name(&format!("route {kind}-short"))["hint"];
        assert!(
            hint.as_str().unwrap().contains("--dupe-window 5m30s"),
            "{hint}"
        );
        assert!(by_name(&format!("route {kind}-ok")).get("hint").is_none());
    }
    assert!(!stdout(&out).contains("guest:guest"));
}

/// A Redis older than 7.0 (a real 6.2 server) is named with its version and what to install,
/// by `check-config --connect` (a PROBLEM line and a "to fix" line), by `enqueue` and by the
/// daemon, which exit at once; nothing is written to it.
#[test]
fn an_older_redis_is_refused_with_what_to_install() {
    let old = Services::get().var("OLD_REDIS_SERVER");
    let redis = RedisServer::start_bin(&old, &[]);
    let config = TestConfig::new(&redis.url(), SHARDS, "");
    let install = "install Redis 7.0 or newer, or Valkey";
    let too_old = "redis 6.2.14 is older than the oldest supported Redis, 7.0";

    let out = config.cli(&["check-config", "--connect"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    assert!(
        text.contains(&format!("PROBLEM redis: {too_old}")),
        "{text}"
    );
    assert!(text.contains(&format!("to fix: {install}")), "{text}");

    let out = config.cli(&[
        "enqueue",
        "--dest",
        "default",
        "--payload",
        "x",
        "--in",
        "1s",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("{too_old}; {install}")),
        "{}",
        stderr(&out)
    );

    let mut daemon = crate::common::Daemon::spawn(&config);
    let status = daemon.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "the daemon refuses to run");
    assert!(
        daemon.log_text().contains(&format!("{too_old}; {install}")),
        "{}",
        daemon.log_text()
    );

    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query(&mut redis.conn())
        .unwrap();
    assert!(keys.is_empty(), "nothing written: {keys:?}");
}

/// Redis: a user the ACL refuses part of what the daemon needs fails "redis rights" with the
/// rule to set; a namespace with another shard count than the config fails "namespace"; an
/// unreachable sink fails its line; plain `check-config` stays offline.
#[test]
fn check_config_connect_checks_redis_rights_and_layout() {
    let redis = RedisServer::start_with(&[
        "--user",
        "narrow",
        "on",
        ">narrow-secret",
        "~zdelay:*",
        "~{zdelay:*",
        "~{zdelay}:*",
        "&zdelay:*",
        "+@read",
        "+@write",
        "+@scripting",
        "+@pubsub",
        "+@connection",
        "-@dangerous",
        "+info",
        "+time",
    ]);
    let url = redis
        .url()
        .replacen("redis://", "redis://narrow:narrow-secret@", 1);
    let routes = "[[routes]]\nname = \"jobs\"\nsink = \"local\"\ntarget = \"q:jobs\"\n\n\
                  [sinks.gone]\nkind = \"amqp\"\nurl = \"amqp://u:gone-secret@127.0.0.1:1/%2f\"\n";
    let config = TestConfig::new(&url, SHARDS, routes);
    let out = config.cli(&["check-config", "--connect"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}\n{}", stderr(&out));
    assert!(text.contains("ok      redis: connected"), "{text}");
    assert!(
        text.contains("PROBLEM redis rights: refused by the server's ACL: LREM q:jobs"),
        "{text}"
    );
    assert!(
        text.contains("to fix: ACL SETUSER <user> ~zdelay:*"),
        "{text}"
    );
    assert!(
        text.contains("~q:jobs"),
        "the hint names the route's list: {text}"
    );
    assert!(
        text.contains("ok      namespace: zdelay does not exist yet"),
        "{text}"
    );
    assert!(text.contains("PROBLEM sink gone: "), "{text}");
    for secret in ["narrow-secret", "gone-secret"] {
        assert!(!text.contains(secret), "{secret} shown: {text}");
        assert!(
            !stderr(&out).contains(secret),
            "{secret} shown: {}",
            stderr(&out)
        );
    }

    // The namespace made with 4 shards, checked with a config that says 2: on layout 2 the
    // namespace's count is the one used (a reshard changes it online), which the check says.
    let full = TestConfig::new(&redis.url(), SHARDS, "");
    ok(&full, &["enqueue", "--dest", "default", "--payload", "x"]);
    let namespace_check = |config: &TestConfig, exit: i32| -> Value {
        let out = config.cli(&["check-config", "--connect", "-o", "json"]);
        assert_eq!(out.status.code(), Some(exit), "{}", stdout(&out));
        let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "namespace")
            .expect("a namespace check")
            .clone()
    };
    let two = TestConfig::new(&redis.url(), 2, "");
    let namespace = namespace_check(&two, 0);
    assert_eq!(namespace["ok"], true, "{namespace}");
    assert!(
        namespace["detail"].as_str().unwrap().contains(
            "has 4 spread shards (redis.shards says 2: daemons and producers use the \
             namespace's count)"
        ),
        "{namespace}"
    );
    // A namespace an older release left on layout 1 fails, naming the upgrade.
    let legacy = RedisServer::start();
    let _: () = redis::pipe()
        .hset("zdelay:schema", "layout", 1)
        .hset("zdelay:schema", "shards", 4)
        .query(&mut legacy.conn())
        .unwrap();
    let namespace = namespace_check(&TestConfig::new(&legacy.url(), 2, ""), 1);
    assert_eq!(namespace["ok"], false, "{namespace}");
    assert!(
        namespace["detail"]
            .as_str()
            .unwrap()
            .contains("is on storage layout 1"),
        "{namespace}"
    );
    assert!(
        namespace["hint"]
            .as_str()
            .unwrap()
            .contains("zdelay upgrade")
    );
    // Every right the default user has: passes.
    let out = full.cli(&["check-config", "--connect"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("ok      namespace: zdelay has 4 shards, as configured"),
        "{}",
        stdout(&out)
    );

    // Offline as before without --connect, even with Redis down.
    let offline = TestConfig::new("redis://127.0.0.1:1", SHARDS, "");
    let out = offline.cli(&["check-config"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = offline.cli(&["check-config", "--connect"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("PROBLEM redis: cannot use redis"),
        "{}",
        stdout(&out)
    );
}

/// Every kind of sink with nothing listening at its address: `check-config --connect` answers
/// within seconds with one line per sink naming the cause, and nothing else (no retry chatter
/// from the broker clients), never showing a password.
#[test]
fn check_config_connect_reports_each_unreachable_sink_in_one_line() {
    let redis = RedisServer::start();
    let closed = crate::common::free_port();
    let mut extra = format!(
        "[sinks.k]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:{closed}\"\n\n\
         [sinks.a]\nkind = \"amqp\"\nurl = \"amqp://u:amqp-secret@127.0.0.1:{closed}/%2f\"\n\n\
         [sinks.n]\nkind = \"nats\"\nurl = \"nats://u:nats-secret@127.0.0.1:{closed}\"\n\n\
         [sinks.r]\nkind = \"redis\"\nurl = \"redis://:redis-secret@127.0.0.1:{closed}\"\n\n"
    );
    for sink in ["k", "a", "n", "r"] {
        extra.push_str(&format!(
            "[[routes]]\nname = \"to-{sink}\"\nsink = \"{sink}\"\ntarget = \"t.{sink}\"\n\n"
        ));
    }
    let config = TestConfig::new(&redis.url(), SHARDS, &extra);
    let started = std::time::Instant::now();
    // At the default log level, as an operator runs it.
    let out = std::process::Command::new(crate::common::zdelay_bin())
        .arg("--config")
        .arg(&config.path)
        .args(["check-config", "--connect"])
        .env_remove("ZDELAY_LOG")
        .output()
        .expect("zdelay runs");
    let took = started.elapsed();
    let (text, errors) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}\n{errors}");
    for sink in ["k", "a", "n", "r"] {
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(&format!(" sink {sink}: ")))
            .collect();
        assert!(
            lines.len() == 1 && lines[0].starts_with("PROBLEM sink "),
            "one line for sink {sink}:\n{text}"
        );
    }
    assert!(
        text.lines().count() <= 8,
        "the checks and nothing else:\n{text}"
    );
    assert!(
        errors.lines().count() == 1 && errors.starts_with("4 of "),
        "stderr has the summary only:\n{errors}"
    );
    for secret in ["amqp-secret", "nats-secret", "redis-secret"] {
        assert!(!text.contains(secret), "{secret} shown: {text}");
    }
    assert!(took < Duration::from_secs(30), "answered in {took:?}");
    eprintln!("check-config --connect with 4 sinks down: {took:?}\n{text}");
}

/// On a Redis Cluster the same checks run, each command on the node of its key; a route's
/// list in another slot than the shards' is still tried.
#[test]
fn check_config_connect_on_a_cluster() {
    let cluster = crate::common::RedisCluster::start();
    let config = cluster.config(
        SHARDS,
        "[[routes]]\nname = \"jobs\"\nsink = \"local\"\ntarget = \"{q}:jobs\"\n",
    );
    let out = config.cli(&["check-config", "--connect", "-o", "json"]);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("JSON ({e}): {}\n{}", stdout(&out), stderr(&out)));
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    let checks: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["check"].as_str().unwrap())
        .collect();
    assert_eq!(
        checks,
        ["redis", "redis rights", "namespace", "sink local"],
        "{v:#}"
    );
}
