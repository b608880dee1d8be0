//! What a person gets back for a mistake in the config or on the command line, from the real
//! `zdelay` binary: the field or flag named, where it was written (file and line, or the
//! environment variable), what is allowed, no Rust type or source path, and exit code 2
//! (a usage error, as clap exits for the flags it checks) with nothing done.

use crate::common::{RedisServer, TestConfig, zdelay_bin};
use std::process::{Command, Output};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// What no message to a user may contain: Rust paths and types, source locations, panics.
fn assert_readable(what: &str, err: &str) {
    for internal in [
        "::",
        ".rs:",
        "BTreeMap",
        "Value",
        "panicked",
        "alloc",
        "Serialized",
    ] {
        assert!(!err.contains(internal), "{what}: {internal:?} in: {err}");
    }
}

/// `TestConfig` writes `[redis]` (lines 1–3) and `[admin]` (5–6) first: the extra text
/// starts on line 8.
const FIRST_EXTRA_LINE: usize = 8;

#[test]
fn config_mistakes_name_the_field_the_line_and_what_is_allowed() {
    // (what, extra TOML, line of the mistake within it (1-based), what the message must say)
    let cases: &[(&str, &str, usize, &[&str])] = &[
        (
            "unknown field",
            "[poller]\nbatch = 10\nbatchh = 3\n",
            3,
            &["poller.batchh", "unknown field", "idle_poll"],
        ),
        (
            "typo in a table name",
            "[pollr]\nbatch = 3\n",
            1,
            &["pollr", "unknown field", "poller"],
        ),
        (
            "wrong type",
            "[poller]\nbatch = \"many\"\n",
            2,
            &["poller.batch", "\"many\"", "a whole number"],
        ),
        (
            "a table given a value",
            "[sinks]\nx = 3\n",
            2,
            &["sinks.x", "a table"],
        ),
        (
            "bad enum value",
            "[[sources]]\nkey = \"k\"\nroute = \"default\"\nscore_unit = \"minutes\"\n",
            4,
            &["sources[0].score_unit", "\"minutes\"", "ms"],
        ),
        (
            "bad sink kind",
            "[sinks.x]\nkind = \"carrier-pigeon\"\n",
            2,
            &["sinks.x", "carrier-pigeon", "kafka"],
        ),
        (
            "unknown field of a sink",
            "[sinks.x]\nkind = \"redis\"\nurll = \"redis://127.0.0.1\"\n",
            3,
            &["sinks.x.urll", "unknown field", "url"],
        ),
        (
            "bad duration",
            "[poller]\nidle_poll = \"soon\"\n",
            2,
            &["poller.idle_poll", "soon"],
        ),
        (
            "missing required field",
            "[[routes]]\nname = \"a\"\nsink = \"local\"\n",
            1,
            &["routes[0].target", "required"],
        ),
        (
            "wrong type in a list of tables",
            "[[routes]]\nname = \"a\"\nsink = \"local\"\ntarget = \"q\"\npush = 5\n",
            5,
            &["routes[0].push", "5"],
        ),
    ];
    for &(what, extra, line, needles) in cases {
        let config = TestConfig::new("redis://127.0.0.1:1", 1, extra);
        let out = config.cli(&["check-config"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(out.stdout.is_empty(), "{what}: nothing printed on stdout");
        let place = format!(
            "{} line {}",
            config.path.display(),
            FIRST_EXTRA_LINE - 1 + line
        );
        assert!(err.contains(&place), "{what}: {place:?} in: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{what}: {needle:?} in: {err}");
        }
        assert_readable(what, &err);
    }
    // Checks after parsing already named the field; they exit 2 as well.
    let config = TestConfig::new("redis://127.0.0.1:1", 1, "[poller]\nbatch = 5000\n");
    let out = config.cli(&["check-config"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("poller.batch"), "{}", stderr(&out));
    // A file that is not TOML: where, in the parser's words.
    let config = TestConfig::new("redis://127.0.0.1:1", 1, "[poller\nbatch = 3\n");
    let out = config.cli(&["check-config"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("line 8"), "{err}");
    assert_readable("not TOML", &err);
}

#[test]
fn environment_mistakes_name_the_variable() {
    let config = TestConfig::new("redis://127.0.0.1:1", 1, "");
    for (var, value, needles) in [
        (
            "ZDELAY_POLLER__BATCH",
            "lots",
            &["poller.batch", "environment variable ZDELAY_POLLER__BATCH"][..],
        ),
        (
            "ZDELAY_POLLER__BATCHH",
            "3",
            &[
                "poller.batchh",
                "environment variable ZDELAY_POLLER__BATCHH",
            ],
        ),
        (
            "ZDELAY_ROUTES",
            "[{name = \"a\", sink = \"local\", target = \"q\", push = \"up\"}]",
            &[
                "routes[0].push",
                "lpush, rpush",
                "environment variable ZDELAY_ROUTES",
            ],
        ),
    ] {
        let out = Command::new(zdelay_bin())
            .arg("--config")
            .arg(&config.path)
            .arg("check-config")
            .env("ZDELAY_LOG", "warn")
            .env(var, value)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{var}: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{var}: {needle:?} in: {err}");
        }
        assert_readable(var, &err);
    }
}

#[test]
fn flag_mistakes_exit_2_saying_what_is_allowed() {
    let redis = RedisServer::start();
    let config = TestConfig::new(&redis.url(), 1, "");
    let cases: &[(&[&str], &[&str])] = &[
        (
            &[
                "enqueue",
                "--dest",
                "default",
                "--at",
                "2027-12-01T09:00:00",
                "--payload",
                "x",
            ],
            &["--at", "no UTC offset", "add Z"],
        ),
        (
            &[
                "enqueue",
                "--dest",
                "default",
                "--at",
                "soon",
                "--payload",
                "x",
            ],
            &["--at", "RFC 3339"],
        ),
        (&["schedule", "preview", "--cron", "0 9 * *"], &["cron"]),
        (
            &[
                "schedule",
                "preview",
                "--cron",
                "0 9 * * *",
                "--tz",
                "Mars/Olympus",
            ],
            &["Mars/Olympus"],
        ),
        (
            &[
                "schedule",
                "set",
                "s",
                "--dest",
                "default",
                "--cron",
                "0 9 * *",
                "--payload",
                "x",
            ],
            &["cron"],
        ),
        (
            &[
                "schedule",
                "set",
                "s",
                "--dest",
                "default",
                "--cron",
                "0 9 * * *",
                "--tz",
                "Mars/Olympus",
                "--payload",
                "x",
            ],
            &["Mars/Olympus"],
        ),
        (
            &[
                "schedule",
                "preview",
                "--every",
                "1m",
                "--from",
                "2027-12-01",
            ],
            &["--from", "no UTC offset"],
        ),
        (
            &["dead", "replay", "--all", "--at", "2027-12-01T09:00:00.000"],
            &["--at", "no UTC offset"],
        ),
        (&["stats", "-o", "yaml"], &["yaml", "text, json"]),
        (
            &["enqueue", "--dest", "nowhere", "--payload", "x"],
            &["nowhere", "default"],
        ),
    ];
    for &(args, needles) in cases {
        let out = config.cli(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{args:?}: {needle:?} in: {err}");
        }
        assert_readable(&format!("{args:?}"), &err);
    }
    // Nothing was written but the schema marker a client leaves on connect.
    let mut con = redis.conn();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut con).unwrap();
    assert!(
        keys.iter().all(|k| k.ends_with(":schema")),
        "nothing written: {keys:?}"
    );
}
