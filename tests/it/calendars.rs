//! Calendars for schedules: a daemon does not fire on a calendar date and fires an occurrence
//! moved onto today; `schedule preview` shows skipped and moved occurrences with the reason;
//! ten years of three countries' public holidays (the `holidays` package's, in
//! fixtures/calendars) against a plain day-by-day computation; an .ics of the US federal
//! holidays by RRULE/EXDATE against the same holidays; the calendar CLI's errors.

use crate::common::{Daemon, RedisServer, TestConfig, llen, wait_for};
use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn config(redis: &RedisServer) -> TestConfig {
    let routes: String = ["l", "a", "b"]
        .iter()
        .map(|r| {
            format!(
                "\n[[routes]]\nname = \"{r}\"\nsink = \"local\"\ntarget = \"q:{r}\"\npush = \"rpush\"\n"
            )
        })
        .collect();
    TestConfig::new(
        &redis.url(),
        4,
        &format!("[poller]\nidle_poll = \"50ms\"\n{routes}"),
    )
}

fn ok(config: &TestConfig, args: &[&str]) -> String {
    let out = config.cli(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/fixtures/calendars")
        .join(name)
}

/// A dates file with `dates`, beside the config.
fn dates_file(config: &TestConfig, name: &str, dates: &[Date]) -> String {
    let path = config.path.with_file_name(name);
    let text: String = dates.iter().map(|d| format!("{d}\n")).collect();
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

fn today_in(tz: &str) -> Date {
    jiff::Timestamp::now()
        .to_zoned(TimeZone::get(tz).unwrap())
        .date()
}

/// Tests that compute "today" need it not to change while they run: they start a minute or
/// more before a UTC midnight, and before 10:00 UTC (midnight in Kiritimati, UTC+14).
fn clear_of_midnight() {
    wait_for(
        "a minute away from midnight in UTC and UTC+14",
        Duration::from_secs(70),
        || {
            let t = jiff::Timestamp::now().to_zoned(TimeZone::UTC).time();
            !(t.minute() == 59 && (t.hour() == 23 || t.hour() == 9))
        },
    );
}

#[test]
fn a_daemon_skips_a_calendar_date_and_fires_an_occurrence_moved_onto_today() {
    clear_of_midnight();
    let redis = RedisServer::start();
    let config = config(&redis);
    let _daemon = Daemon::start(&config);
    let today = today_in("UTC");
    let kiri_yesterday = today_in("Pacific/Kiritimati").yesterday().unwrap();
    let f1 = dates_file(&config, "today.txt", &[today]);
    let f2 = dates_file(&config, "kiri.txt", &[kiri_yesterday]);
    ok(
        &config,
        &[
            "calendar",
            "set",
            "today",
            "--dates",
            &f1,
            "--weekend",
            "none",
        ],
    );
    ok(
        &config,
        &[
            "calendar",
            "set",
            "kiri",
            "--dates",
            &f2,
            "--weekend",
            "none",
        ],
    );

    // Every second of today's day of the month: one schedule skips today, one does not.
    let every_second_today = format!("* * * {} * *", today.day());
    let out = ok(
        &config,
        &[
            "schedule",
            "set",
            "skipped",
            "--dest",
            "l",
            "--cron",
            &every_second_today,
            "--calendar",
            "today",
            "--payload",
            "s",
        ],
    );
    assert!(
        !out.contains(&format!("next occurrence {today}")),
        "today is skipped: {out}"
    );
    ok(
        &config,
        &[
            "schedule",
            "set",
            "control",
            "--dest",
            "a",
            "--cron",
            &every_second_today,
            "--payload",
            "c",
        ],
    );
    // Every second of yesterday's day of the month in Kiritimati, whose calendar lists
    // yesterday (its local date) and moves its occurrences to the next business day: today.
    let yesterdays = format!("* * * {} * *", kiri_yesterday.day());
    let out = ok(
        &config,
        &[
            "schedule",
            "set",
            "moved",
            "--dest",
            "b",
            "--cron",
            &yesterdays,
            "--tz",
            "Pacific/Kiritimati",
            "--calendar",
            "kiri",
            "--shift",
            "next",
            "--payload",
            "m",
        ],
    );
    assert!(
        out.contains(&format!(
            "next occurrence {}",
            today_in("Pacific/Kiritimati")
        )),
        "moved onto today: {out}"
    );
    let mut con = redis.conn();
    wait_for(
        "the control and the moved schedule fire twice",
        Duration::from_secs(15),
        || llen(&mut con, "q:a") >= 2 && llen(&mut con, "q:b") >= 2,
    );
    assert_eq!(llen(&mut con, "q:l"), 0, "no occurrence on a calendar date");
    let list = ok(&config, &["schedule", "list"]);
    assert!(list.contains("calendar today (skip)"), "{list}");
    assert!(list.contains("calendar kiri (next)"), "{list}");

    // A schedule naming a calendar that does not exist is refused, nothing written.
    let out = config.cli(&[
        "schedule",
        "set",
        "nope",
        "--dest",
        "l",
        "--cron",
        "0 9 * * *",
        "--calendar",
        "missing",
        "--payload",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no calendar named \"missing\""), "{err}");
    assert!(!ok(&config, &["schedule", "list"]).contains("nope"));
}

#[test]
fn preview_shows_each_skipped_or_moved_occurrence_and_why() {
    let redis = RedisServer::start();
    let config = config(&redis);
    let f = dates_file(&config, "fr.txt", &[jiff::civil::date(2026, 12, 25)]);
    ok(&config, &["calendar", "set", "fr", "--dates", &f]);
    let out = ok(
        &config,
        &[
            "schedule",
            "preview",
            "--cron",
            "0 9 * * *",
            "--tz",
            "Europe/Paris",
            "--from",
            "2026-12-24T00:00:00Z",
            "--count",
            "5",
            "--calendar",
            "fr",
            "--shift",
            "next",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert!(lines[0].starts_with("2026-12-24T09:00:00+01:00"), "{out}");
    assert!(!lines[0].contains("moved"), "{out}");
    assert!(
        lines[1].starts_with("2026-12-25T09:00:00+01:00")
            && lines[1].ends_with(
                "moved to 2026-12-28T09:00:00+01:00 (next business day): 2026-12-25 is listed in calendar fr"
            ),
        "{out}"
    );
    assert!(
        lines[2].ends_with("Saturday 2026-12-26 is a weekend day of calendar fr"),
        "{out}"
    );
    let json: serde_json::Value = serde_json::from_str(&ok(
        &config,
        &[
            "schedule",
            "preview",
            "--cron",
            "0 9 * * *",
            "--tz",
            "Europe/Paris",
            "--from",
            "2026-12-24T00:00:00Z",
            "--count",
            "2",
            "--calendar",
            "fr",
            "--json",
        ],
    ))
    .unwrap();
    assert!(json[0].get("calendar").is_none(), "{json}");
    assert_eq!(json[1]["calendar"]["shift"], "skip");
    assert_eq!(json[1]["calendar"]["date"], "2026-12-25");
    assert_eq!(json[1]["calendar"]["moved_to_ms"], serde_json::Value::Null);
    assert_eq!(
        json[1]["calendar"]["reason"],
        "2026-12-25 is listed in calendar fr"
    );
    // A named calendar that does not exist.
    let out = config.cli(&[
        "schedule",
        "preview",
        "--cron",
        "0 9 * * *",
        "--calendar",
        "nope",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no calendar named \"nope\""));
}

/// A fixture's holidays: (date, name).
fn holidays(file: &str) -> Vec<(Date, String)> {
    std::fs::read_to_string(fixture(file))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (d, name) = l.split_once(' ').unwrap();
            (d.parse().unwrap(), name.to_owned())
        })
        .collect()
}

/// Occurrences as `schedule preview --json` shows them, after the calendar: each kept at its
/// time or moved, skipped ones dropped, as local dates.
fn previewed_dates(json: &serde_json::Value, tz: &TimeZone) -> Vec<Date> {
    let set: BTreeSet<i64> = json
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| match o.get("calendar") {
            None => o["ms"].as_i64(),
            Some(c) => c["moved_to_ms"].as_i64(),
        })
        .collect();
    set.into_iter()
        .map(|ms| {
            tz.to_datetime(jiff::Timestamp::from_millisecond(ms).unwrap())
                .date()
        })
        .collect()
}

#[test]
fn ten_years_of_three_countries_holidays_agree_with_a_day_by_day_computation() {
    let redis = RedisServer::start();
    let config = config(&redis);
    let (first, last) = (
        jiff::civil::date(2026, 1, 1),
        jiff::civil::date(2035, 12, 31),
    );
    for (file, zone) in [
        ("us.txt", "America/New_York"),
        ("de.txt", "Europe/Berlin"),
        ("jp.txt", "Asia/Tokyo"),
    ] {
        let name = file.trim_end_matches(".txt");
        ok(
            &config,
            &[
                "calendar",
                "set",
                name,
                "--dates",
                fixture(file).to_str().unwrap(),
            ],
        );
        let off: BTreeSet<Date> = holidays(file).into_iter().map(|(d, _)| d).collect();
        assert!(off.len() > 80, "{file}: {}", off.len());
        let business = |d: Date| {
            !off.contains(&d) && !matches!(d.weekday(), Weekday::Saturday | Weekday::Sunday)
        };
        let days: Vec<Date> = first
            .series(jiff::Span::new().days(1))
            .take_while(|d| *d <= last)
            .collect();
        let shift = |mut d: Date, step: i64| {
            while !business(d) {
                d = d.checked_add(jiff::Span::new().days(step)).unwrap();
            }
            d
        };
        // The independent computation, one case per form.
        let daily_skip: Vec<Date> = days.iter().copied().filter(|d| business(*d)).collect();
        let mondays_next: Vec<Date> = days
            .iter()
            .filter(|d| d.weekday() == Weekday::Monday)
            .map(|d| shift(*d, 1))
            .collect();
        let last_business_day: Vec<Date> = days
            .iter()
            .filter(|d| d.tomorrow().unwrap().day() == 1)
            .map(|d| shift(*d, -1))
            .collect();
        let tz = TimeZone::get(zone).unwrap();
        let from = first
            .to_zoned(tz.clone())
            .unwrap()
            .timestamp()
            .as_millisecond()
            .to_string();
        for (cron, shift_name, count, want) in [
            ("0 9 * * *", "skip", days.len(), &daily_skip),
            ("0 9 * * 1", "next", mondays_next.len(), &mondays_next),
            ("0 18 L * *", "previous", 120, &last_business_day),
        ] {
            let json: serde_json::Value = serde_json::from_str(&ok(
                &config,
                &[
                    "schedule",
                    "preview",
                    "--cron",
                    cron,
                    "--tz",
                    zone,
                    "--from",
                    &from,
                    "--count",
                    &count.to_string(),
                    "--calendar",
                    name,
                    "--shift",
                    shift_name,
                    "--json",
                ],
            ))
            .unwrap();
            let got = previewed_dates(&json, &tz);
            assert_eq!(&got, want, "{file} {cron} {shift_name}");
            // And as a daemon's firings walk them (the schedule's own next occurrence).
            let days_json = serde_json::from_str::<serde_json::Value>(&ok(
                &config,
                &["calendar", "get", name, "--json"],
            ))
            .unwrap()["days"]
                .clone();
            let def = zdelay::schedule::ScheduleDef {
                calendar: Some(zdelay::schedule::ScheduleCalendar {
                    name: name.into(),
                    shift: zdelay::calendar::Shift::from_name(shift_name).unwrap(),
                    days: serde_json::from_value(days_json).unwrap(),
                }),
                ..zdelay::schedule::ScheduleDef::cron(cron, zone)
            };
            let s = def.compile().unwrap();
            let mut walked = vec![];
            let mut at = from.parse::<i64>().unwrap() - 1;
            while let Some(t) = s.next_after(at) {
                let d = tz
                    .to_datetime(jiff::Timestamp::from_millisecond(t).unwrap())
                    .date();
                if d > last {
                    break;
                }
                walked.push(d);
                at = t;
            }
            assert_eq!(&walked, want, "{file} {cron} {shift_name}: next_after");
        }
    }
}

#[test]
fn an_ics_of_yearly_rules_gives_the_us_federal_holidays() {
    let redis = RedisServer::start();
    let config = config(&redis);
    let ics = fixture("us-federal.ics");
    let out = ok(
        &config,
        &[
            "calendar",
            "set",
            "us-rules",
            "--ics",
            ics.to_str().unwrap(),
            "--until",
            "2035-12-31",
        ],
    );
    assert!(out.contains("created calendar us-rules"), "{out}");
    let got: serde_json::Value =
        serde_json::from_str(&ok(&config, &["calendar", "get", "us-rules", "--json"])).unwrap();
    let dates: BTreeSet<String> = got["days"]["dates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_owned())
        .collect();
    // The holidays package's, less the observed weekdays (which are not rules).
    let want: BTreeSet<String> = holidays("us.txt")
        .into_iter()
        .filter(|(_, name)| !name.contains("(observed)"))
        .map(|(d, _)| d.to_string())
        .collect();
    let in_range: BTreeSet<String> = dates
        .iter()
        .filter(|d| d.as_str() >= "2026")
        .cloned()
        .collect();
    assert_eq!(in_range, want);
    // Juneteenth starts in 2020 with that year excluded.
    assert!(!dates.contains("2020-06-19"), "{dates:?}");
    assert!(dates.contains("2021-06-19"), "{dates:?}");
    assert_eq!(got["days"]["weekend"], serde_json::json!(["sat", "sun"]));
    let list = ok(&config, &["calendar", "list"]);
    assert!(list.starts_with("us-rules  weekend sat,sun  "), "{list}");
}

#[test]
fn bad_calendars_are_refused_with_the_reason_and_nothing_written() {
    let redis = RedisServer::start();
    let config = config(&redis);
    let bad_dates = config.path.with_file_name("bad.txt");
    std::fs::write(&bad_dates, "2026-01-01\n2026-02-30\n").unwrap();
    let bad_ics = config.path.with_file_name("bad.ics");
    std::fs::write(
        &bad_ics,
        "BEGIN:VCALENDAR\r\nBEGIN:VEVENT\r\nSUMMARY:Every day\r\nDTSTART;VALUE=DATE:20260101\r\nRRULE:FREQ=DAILY\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n",
    )
    .unwrap();
    let big = config.path.with_file_name("big.ics");
    std::fs::write(&big, vec![b'x'; (1 << 20) + 1]).unwrap();
    let ok_dates = dates_file(&config, "ok.txt", &[jiff::civil::date(2026, 1, 1)]);
    for (args, why) in [
        (
            vec![
                "calendar",
                "set",
                "x",
                "--dates",
                bad_dates.to_str().unwrap(),
            ],
            "line 2",
        ),
        (
            vec![
                "calendar",
                "set",
                "x",
                "--ics",
                bad_ics.to_str().unwrap(),
                "--until",
                "2040-01-01",
            ],
            "more than 4000",
        ),
        (
            vec!["calendar", "set", "x", "--ics", big.to_str().unwrap()],
            "bytes",
        ),
        (
            vec![
                "calendar",
                "set",
                "x",
                "--dates",
                &ok_dates,
                "--weekend",
                "sat,funday",
            ],
            "funday",
        ),
        (
            vec![
                "calendar",
                "set",
                "x",
                "--dates",
                &ok_dates,
                "--weekend",
                "mon,tue,wed,thu,fri,sat,sun",
            ],
            "every day of the week",
        ),
        (
            vec!["calendar", "set", "a b", "--dates", &ok_dates],
            "letters, digits",
        ),
    ] {
        let out = config.cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
    }
    assert_eq!(
        ok(&config, &["calendar", "list"]).trim(),
        "",
        "nothing written"
    );
    assert_eq!(config.cli(&["calendar", "get", "x"]).status.code(), Some(3));
    // Saturdays only, on a calendar whose weekend has Saturday: never fires, refused.
    ok(&config, &["calendar", "set", "cal", "--dates", &ok_dates]);
    let out = config.cli(&[
        "schedule",
        "set",
        "sat",
        "--dest",
        "l",
        "--cron",
        "0 9 * * 6",
        "--calendar",
        "cal",
        "--payload",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("every occurrence falls on a day"));
    assert!(ok(&config, &["calendar", "delete", "cal"]).contains("deleted calendar cal"));
    assert_eq!(
        config.cli(&["calendar", "delete", "cal"]).status.code(),
        Some(3)
    );
}

#[test]
fn the_console_lists_the_coming_days_a_calendar_skips_and_why() {
    clear_of_midnight();
    let redis = RedisServer::start();
    let config = config(&redis);
    let _daemon = Daemon::start(&config);
    // The next two days (UTC) are listed; the schedule fires daily at noon UTC.
    let today = today_in("UTC");
    let days = [
        today.tomorrow().unwrap(),
        today.tomorrow().unwrap().tomorrow().unwrap(),
    ];
    let f = dates_file(&config, "next.txt", &days);
    ok(
        &config,
        &[
            "calendar",
            "set",
            "soon",
            "--dates",
            &f,
            "--weekend",
            "none",
        ],
    );
    ok(
        &config,
        &[
            "schedule",
            "set",
            "noon",
            "--dest",
            "l",
            "--cron",
            "0 12 * * *",
            "--calendar",
            "soon",
            "--shift",
            "next",
            "--payload",
            "x",
        ],
    );
    let base = format!("http://127.0.0.1:{}/", config.admin_port);
    let shot = std::env::var("ZDELAY_CONSOLE_SHOTS")
        .ok()
        .map(|dir| format!("{dir}/schedules-calendar.png"));
    let mut args = vec![base.as_str(), "noon"];
    args.extend(shot.as_deref());
    let r = crate::common::browser_script("console_calendar.py", &args);
    assert_eq!(r["calendar"], "soon (next, 2 dates)", "{r}");
    let after = days[1].tomorrow().unwrap();
    let want: Vec<String> = days
        .iter()
        .map(|d| {
            format!(
                "{d}T12:00:00+00:00: moved to {after}T12:00:00+00:00: {d} is listed in calendar soon"
            )
        })
        .collect();
    assert_eq!(r["skips"], serde_json::json!(want), "{r}");
}
