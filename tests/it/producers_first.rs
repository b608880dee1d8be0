//! Producers first on storage layout 2: a producer given the config (the CLI, the library built
//! with `Routes::from_config`) registers a route's lane itself, through the daemons'
//! registration scripts, so jobs enqueued before any daemon ran are delivered once one starts,
//! exactly once; producers and a daemon registering at the same moment give each route one
//! lane; a producer without the config gets a retryable error and writes nothing; one whose
//! config disagrees with a registration is refused and writes nothing.

use crate::common::{self, Daemon, RedisCluster, RedisServer, TestConfig, lrange, wait_for};
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::Duration;
use zdelay::{Client, ClientError, NewJob, OnConflict, Routes};

/// Two local routes (pushed from either end) and a two-phase one to another Redis.
fn routes(remote: &str) -> String {
    format!(
        r#"
[poller]
idle_poll = "50ms"

[sinks.other]
kind = "redis"
url = "{remote}"

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"

[[routes]]
name = "b"
sink = "local"
target = "q:b"
push = "lpush"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
"#
    )
}

fn cli_ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn registry(con: &mut dyn redis::ConnectionLike) -> BTreeMap<String, String> {
    registry_of(con, "zdelay")
}

fn registry_of(con: &mut dyn redis::ConnectionLike, namespace: &str) -> BTreeMap<String, String> {
    redis::cmd("HGETALL")
        .arg(format!("{namespace}:lanes"))
        .query(con)
        .expect("HGETALL zdelay:lanes")
}

/// Each route's lane as the registry names it, checked to be the only lane given out for it:
/// as many lanes created (`#<lane>`, `next`) as routes, each live, and each lane's marker
/// written as registered.
fn one_lane_per_route(
    con: &mut dyn redis::ConnectionLike,
    namespace: &str,
    local: &[(&str, &str, &str)],
) {
    let registry = registry_of(con, namespace);
    let created: Vec<(&String, &String)> = registry
        .iter()
        .filter(|(f, _)| f.starts_with('#'))
        .collect();
    assert_eq!(created.len(), local.len(), "lanes created: {registry:?}");
    assert_eq!(
        registry.get("next").map(String::as_str),
        Some(local.len().to_string().as_str()),
        "lane numbers given out: {registry:?}"
    );
    for (route, list, push) in local {
        let entry = &registry[&format!("r:{route}")];
        let number = entry.split(' ').next().expect("lane number");
        let slot = zdelay::keys::slot_of(list);
        assert_eq!(*entry, format!("{number} local {slot} {push} {list}"));
        assert_eq!(
            registry[&format!("#{number}")],
            format!("{route} {slot} live")
        );
        let tag = zdelay::keys::slot_tag(slot);
        let marker: Option<String> = redis::cmd("GET")
            .arg(format!("{namespace}:{{{tag}}}:lane:{route}"))
            .query(con)
            .expect("GET marker");
        assert_eq!(marker, Some(format!("2 {number} {push} {list}")), "{route}");
    }
}

/// How often each `p<i>` payload is in `lists`.
fn counts(lists: &[Vec<Vec<u8>>], total: usize) -> Vec<u32> {
    let mut counts = vec![0u32; total];
    for item in lists.iter().flatten() {
        let text = String::from_utf8_lossy(item);
        let i: usize = text
            .strip_prefix('p')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected item {text:?}"));
        counts[i] += 1;
    }
    counts
}

/// With no daemon ever started: one job per route through the CLI, a `--batch` through the CLI
/// and a batch through the library given the config's routes, all accepted and held; then a
/// daemon starts and delivers every job exactly once.
fn producers_before_any_daemon(
    config: &TestConfig,
    con: &mut dyn redis::ConnectionLike,
    far: &mut redis::Connection,
) {
    const TOTAL: usize = 63;
    let dest = |i: usize| ["a", "b", "m"][i % 3];
    // A schedule first: it registers route b's lane, where it lives (no occurrence for ages).
    cli_ok(
        config,
        &[
            "schedule",
            "set",
            "someday",
            "--dest",
            "b",
            "--every",
            "1h",
            "--start-at",
            "2099-01-01T00:00:00Z",
            "--payload",
            "tick",
        ],
    );
    let shown = cli_ok(config, &["schedule", "get", "someday", "-o", "json"]);
    assert!(shown.contains("\"dest\": \"b\""), "{shown}");
    for i in 0..3 {
        cli_ok(
            config,
            &["enqueue", "--dest", dest(i), "--payload", &format!("p{i}")],
        );
    }
    let batch = tempfile::NamedTempFile::new().expect("batch file");
    let lines: String = (3..33)
        .map(|i| format!("{{\"dest\":\"{}\",\"payload\":\"p{i}\"}}\n", dest(i)))
        .collect();
    std::fs::write(batch.path(), lines).expect("batch file");
    cli_ok(
        config,
        &["enqueue", "--batch", common::path_str(batch.path())],
    );
    // The library as a producer, given the config's routes.
    let rt = common::runtime();
    let cfg = zdelay::config::load(Some(&config.path)).expect("config");
    let lib = rt
        .block_on(Client::attach(&cfg.redis))
        .expect("attach")
        .with_routes(Routes::from_config(&cfg));
    let jobs = (33..TOTAL)
        .map(|i| NewJob::new(dest(i), format!("p{i}")))
        .collect();
    for answer in rt
        .block_on(lib.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue_batch")
    {
        answer.expect("each job enqueued");
    }
    one_lane_per_route(
        con,
        "zdelay",
        &[("a", "q:a", "RPUSH"), ("b", "q:b", "LPUSH")],
    );
    let registry = registry(con);
    assert_eq!(registry.get("t:m").map(String::as_str), Some("other"));
    assert!(registry.contains_key("s:other"), "{registry:?}");
    assert!(lrange(con, "q:a").is_empty() && lrange(far, "q:m").is_empty());

    let daemon = Daemon::start(config);
    wait_for("every job delivered", Duration::from_secs(20), || {
        lrange(con, "q:a").len() + lrange(con, "q:b").len() + lrange(far, "q:m").len() >= TOTAL
    });
    // Anything delivered twice would have arrived by now too.
    std::thread::sleep(Duration::from_millis(300));
    let lists = [lrange(con, "q:a"), lrange(con, "q:b"), lrange(far, "q:m")];
    let counts = counts(&lists, TOTAL);
    let wrong: Vec<(usize, u32)> = (0..TOTAL)
        .map(|i| (i, counts[i]))
        .filter(|(_, n)| *n != 1)
        .collect();
    assert!(
        wrong.is_empty(),
        "(job, times delivered) not once: {wrong:?}"
    );
    for (list, route) in lists.iter().zip(["a", "b", "m"]) {
        for item in list {
            let i: usize = String::from_utf8_lossy(&item[1..]).parse().expect("p<i>");
            assert_eq!(dest(i), route, "p{i} delivered to route {route}");
        }
    }
    let log = daemon.log_text();
    assert!(
        !log.contains("ZDELAY_") && !log.contains("CROSSSLOT"),
        "{log}"
    );
}

#[test]
fn producers_given_the_config_register_lanes_before_any_daemon() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, &routes(&remote.url()));
    producers_before_any_daemon(&config, &mut redis.conn(), &mut remote.conn());
}

#[test]
fn producers_given_the_config_register_lanes_before_any_daemon_on_a_cluster() {
    let cluster = RedisCluster::start();
    let remote = RedisServer::start();
    let config = cluster.config(4, &routes(&remote.url()));
    producers_before_any_daemon(&config, &mut cluster.conn(), &mut remote.conn());
}

/// Two producers (`zdelay enqueue --batch` with the config) and a daemon start at the same
/// moment, over and over on a fresh namespace: every route gets one lane, never two, and every
/// job is delivered exactly once. `config` makes round `n`'s config from its extra TOML.
fn racing_registrations(con: &mut dyn redis::ConnectionLike, config: impl Fn(&str) -> TestConfig) {
    const ROUTES: usize = 12;
    const ROUNDS: usize = 5;
    for round in 0..ROUNDS {
        let namespace = format!("race{round}");
        let lists: Vec<(String, String)> = (0..ROUTES)
            .map(|r| (format!("r{r}"), format!("q{round}:r{r}")))
            .collect();
        let mut extra = String::from("[poller]\nidle_poll = \"50ms\"\n");
        for (route, list) in &lists {
            extra.push_str(&format!(
                "\n[[routes]]\nname = \"{route}\"\nsink = \"local\"\ntarget = \"{list}\"\npush = \"rpush\"\n"
            ));
        }
        let config = config(&extra);
        let body = std::fs::read_to_string(&config.path).expect("config");
        std::fs::write(
            &config.path,
            body.replacen(
                "[redis]\n",
                &format!("[redis]\nnamespace = \"{namespace}\"\n"),
                1,
            ),
        )
        .expect("config");
        let batch = |producer: usize| {
            let file = tempfile::NamedTempFile::new().expect("batch file");
            let lines: String = lists
                .iter()
                .map(|(route, _)| format!("{{\"dest\":\"{route}\",\"payload\":\"{producer}\"}}\n"))
                .collect();
            std::fs::write(file.path(), lines).expect("batch file");
            file
        };
        let files = [batch(0), batch(1)];
        let producers: Vec<std::process::Child> = files
            .iter()
            .map(|file| {
                Command::new(common::zdelay_bin())
                    .arg("--config")
                    .arg(&config.path)
                    .args(["enqueue", "--batch", common::path_str(file.path())])
                    .env("ZDELAY_LOG", "warn")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("zdelay enqueue runs")
            })
            .collect();
        let daemon = Daemon::spawn(&config);
        for producer in producers {
            let out = producer.wait_with_output().expect("producer ends");
            assert!(
                out.status.success(),
                "round {round}: a producer failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        daemon.wait_ready();
        wait_for("every job delivered", Duration::from_secs(20), || {
            lists.iter().all(|(_, list)| lrange(con, list).len() >= 2)
        });
        std::thread::sleep(Duration::from_millis(300));
        for (_, list) in &lists {
            let mut got = lrange(con, list);
            got.sort();
            assert_eq!(got, [b"0".to_vec(), b"1".to_vec()], "round {round}: {list}");
        }
        let local: Vec<(&str, &str, &str)> = lists
            .iter()
            .map(|(r, l)| (r.as_str(), l.as_str(), "RPUSH"))
            .collect();
        one_lane_per_route(con, &namespace, &local);
        drop(daemon);
    }
}

#[test]
fn producers_and_a_daemon_registering_at_once_give_each_route_one_lane() {
    let redis = RedisServer::start();
    racing_registrations(&mut redis.conn(), |extra| {
        TestConfig::new(&redis.url(), 4, extra)
    });
}

#[test]
fn producers_and_a_daemon_registering_at_once_give_each_route_one_lane_on_a_cluster() {
    let cluster = RedisCluster::start();
    racing_registrations(&mut cluster.conn(), |extra| cluster.config(4, extra));
}

/// A producer without the config (the library attached without routes, or with route names
/// only) cannot register a lane: enqueueing to a route no one registered yet is a retryable
/// error naming who registers it, and nothing is written.
#[test]
fn a_producer_without_the_config_gets_a_retryable_error_and_writes_nothing() {
    let redis = RedisServer::start();
    // The namespace exists and route a has its lane (a daemon whose config has route a only
    // made both).
    let only_a = "[[routes]]\nname = \"a\"\nsink = \"local\"\ntarget = \"q:a\"\n";
    drop(Daemon::start(&TestConfig::new(&redis.url(), 4, only_a)));
    let mut con = redis.conn();
    let before = (common::all_keys(&mut con), registry(&mut con));
    let rt = common::runtime();
    let attached = rt
        .block_on(Client::attach(&common::redis_config(&redis.url(), 4)))
        .expect("attach");
    let named = attached
        .clone()
        .with_destinations(["a".to_owned(), "b".to_owned()]);
    // With route names only, a destination outside them is refused as unknown first.
    for (lib, dests) in [(&attached, &["b", "m"][..]), (&named, &["b"][..])] {
        for &dest in dests {
            let err = rt
                .block_on(lib.enqueue(NewJob::new(dest, "y"), OnConflict::Error))
                .expect_err("no lane for the route yet");
            assert_eq!(err.kind(), "no_lane", "{err:?}");
            assert!(err.is_retryable(), "{err}");
            let text = err.to_string();
            assert!(
                text.contains(&format!("destination {dest:?} has no route lane yet"))
                    && text.contains("a daemon whose config has the route registers it")
                    && text.contains("a producer given that config")
                    && text.contains("nothing was written"),
                "{text}"
            );
        }
        // In a batch the job for a registered route goes in; the other fails alone.
        let answers = rt
            .block_on(lib.enqueue_batch(
                vec![
                    NewJob::new("b", "y").id("later"),
                    NewJob::new("a", "z").id("now").after(Duration::from_secs(3600)),
                ],
                OnConflict::Replace,
            ))
            .expect("enqueue_batch");
        assert_eq!(
            answers[0].as_ref().map_err(ClientError::kind).err(),
            Some("no_lane"),
            "{answers:?}"
        );
        assert!(answers[1].is_ok(), "{answers:?}");
    }
    let after = (common::all_keys(&mut con), registry(&mut con));
    assert_eq!(after.1, before.1, "the registry is unchanged");
    // Only the job for route a, in its lane.
    let new: BTreeSet<&String> = after
        .0
        .difference(&before.0)
        .filter(|k| !k.ends_with(":a"))
        .collect();
    assert!(new.is_empty(), "keys written: {new:?}");
    assert!(
        rt.block_on(attached.get_in("a", "now"))
            .expect("get")
            .is_some(),
        "the job for route a"
    );
}

/// A producer whose config says otherwise of a route than its registration (another push side,
/// local against two-phase) is refused, naming both, and writes nothing.
#[test]
fn a_producer_whose_config_disagrees_with_the_registry_is_refused() {
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, &routes(&remote.url()));
    drop(Daemon::start(&config));
    let changed = TestConfig::new(
        &redis.url(),
        4,
        r#"
[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "lpush"

[[routes]]
name = "m"
sink = "local"
target = "q:m"
"#,
    );
    let mut con = redis.conn();
    let before = (common::all_keys(&mut con), registry(&mut con));
    for (dest, registered, says) in [
        (
            "a",
            "a local route to list \"q:a\" (RPUSH)",
            "a local route to list \"q:a\" (LPUSH)",
        ),
        (
            "m",
            "a two-phase route to sink other",
            "a local route to list \"q:m\" (LPUSH)",
        ),
    ] {
        let out = changed.cli(&["enqueue", "--dest", dest, "--payload", "y"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!(
                "route {dest:?} is registered as {registered}, but this config says {says}"
            )) && err.contains("start a daemon with this config"),
            "{err}"
        );
    }
    let after = (common::all_keys(&mut con), registry(&mut con));
    assert_eq!(after.1, before.1, "the registry is unchanged");
    let new: BTreeSet<&String> = after.0.difference(&before.0).collect();
    assert!(new.is_empty(), "keys written: {new:?}");
}

/// The registration scripts in a producer's mode, asked directly about routes registered
/// otherwise: they answer the registered entry and write nothing.
#[test]
fn a_producers_registration_of_a_route_registered_otherwise_writes_nothing() {
    use zdelay::routes::{LaneRoute, LocalRoute};
    let redis = RedisServer::start();
    let remote = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 4, &routes(&remote.url()));
    for dest in ["a", "m"] {
        cli_ok(
            &config,
            &["enqueue", "--dest", dest, "--in", "1h", "--payload", "x"],
        );
    }
    let mut con = redis.conn();
    let before = (common::all_keys(&mut con), registry(&mut con));
    let rt = common::runtime();
    let mut lcon = rt
        .block_on(zdelay::store::Conn::connect(&common::redis_config(
            &redis.url(),
            4,
        )))
        .expect("connect");
    let keys = zdelay::keys::Keys::new("zdelay", 4);
    let lpush = LocalRoute {
        name: "a".to_owned(),
        list: "q:a".to_owned(),
        push: zdelay::config::Push::Lpush,
    };
    let registered = rt
        .block_on(zdelay::store::lanes::register_missing(
            &mut lcon,
            &keys,
            LaneRoute::Local(&lpush),
        ))
        .expect("register_missing");
    let slot = zdelay::keys::slot_of("q:a");
    assert_eq!(registered, Some(format!("1 local {slot} RPUSH q:a")));
    let sink = rt
        .block_on(zdelay::store::lanes::register_missing(
            &mut lcon,
            &keys,
            LaneRoute::TwoPhase {
                route: "a",
                sink: "other",
            },
        ))
        .expect("register_missing");
    assert_eq!(sink, Some(format!("1 local {slot} RPUSH q:a")));
    let local = LocalRoute {
        name: "m".to_owned(),
        list: "q:m".to_owned(),
        push: zdelay::config::Push::Rpush,
    };
    let two_phase = rt
        .block_on(zdelay::store::lanes::register_missing(
            &mut lcon,
            &keys,
            LaneRoute::Local(&local),
        ))
        .expect("register_missing");
    assert_eq!(two_phase.as_deref(), Some("sink other"));
    let after = (common::all_keys(&mut con), registry(&mut con));
    assert_eq!(after, before, "nothing written");
}

/// A producer given the config whose Redis user may read the lane registry but not write it:
/// a route with no lane yet is refused with the retryable error, naming the refusal and what to
/// grant, and nothing is written; with write access to the registry it registers the route.
#[test]
fn a_producer_whose_user_may_not_register_is_told_what_to_grant() {
    let producer_rules = "%R~zdelay:schema %R~zdelay:lanes ~zdelay:{* ~q:* &zdelay:wake \
        +@read +@write +@scripting +@connection +publish -@dangerous +info +time";
    let mut args = vec!["--user", "producer", "on", ">producer-secret"];
    args.extend(producer_rules.split_whitespace());
    let redis = RedisServer::start_with(&args);
    // A daemon whose config has route a only has run (with the default user's rights).
    let only_a = "[[routes]]\nname = \"a\"\nsink = \"local\"\ntarget = \"q:a\"\n";
    drop(Daemon::start(&TestConfig::new(&redis.url(), 4, only_a)));
    let producer_url = redis
        .url()
        .replacen("redis://", "redis://producer:producer-secret@", 1);
    let with_n =
        format!("{only_a}\n[[routes]]\nname = \"n\"\nsink = \"local\"\ntarget = \"q:n\"\n");
    let producer = TestConfig::new(&producer_url, 4, &with_n);
    let mut con = redis.conn();
    let before = (common::all_keys(&mut con), registry(&mut con));
    let out = producer.cli(&["enqueue", "--dest", "n", "--payload", "x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("destination \"n\" has no route lane yet and this producer's Redis user may not register it")
            && err.contains("(NOPERM this user has no permissions")
            && err.contains("grant it write access to the lane registry zdelay:lanes and the lane markers zdelay:{*}:lane:* with +hincrby and +set")
            && err.contains("start a daemon whose config has the route first")
            && !err.contains("producer-secret"),
        "{err}"
    );
    // Its routes that have a lane take jobs as before.
    cli_ok(
        &producer,
        &["enqueue", "--dest", "a", "--in", "1h", "--payload", "y"],
    );
    let after = (common::all_keys(&mut con), registry(&mut con));
    assert_eq!(after.1, before.1, "the registry is unchanged");
    let new: BTreeSet<&String> = after
        .0
        .difference(&before.0)
        .filter(|k| !k.ends_with(":a"))
        .collect();
    assert!(new.is_empty(), "keys written: {new:?}");
    // Granted the registry, it registers route n itself.
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("producer")
        .arg("~zdelay:lanes")
        .query(&mut con)
        .expect("ACL SETUSER");
    cli_ok(&producer, &["enqueue", "--dest", "n", "--payload", "x"]);
    one_lane_per_route(
        &mut con,
        "zdelay",
        &[("a", "q:a", "LPUSH"), ("n", "q:n", "LPUSH")],
    );
}
