//! Flow control at release (storage layout 2, local routes): a route's rate holds across
//! daemons, keeps due order and drops nothing; a list's bound holds the route until its
//! consumers drain it; other routes keep flowing; bad settings are refused by name. A small
//! burst still reaches its rate, a hold lasts until its backlog is gone, a key's turns take
//! its tokens, and a job the script cannot handle goes to dead instead of stalling its route
//! (the bucket's math on generated inputs is in `flow_model`).

use crate::common::{Daemon, RedisServer, TestConfig, redis_now_ms, wait_for};
use crate::flow_model::{Rig, rate_flow};
use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use zdelay::store::scripts::Held;
use zdelay::{Client, NewJob, OnConflict};

fn epoch_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// The due set of local route `route`'s lane (its list `list`): its jobs waiting, by due time.
fn lane_due(route: &str, list: &str) -> String {
    crate::common::lane_keys(route, list).due
}

/// Enqueues `n` jobs for `dest`, job `i` due at `due(i)`, payload `i`.
fn enqueue(
    rt: &tokio::runtime::Runtime,
    client: &Client,
    dest: &str,
    n: usize,
    due: impl Fn(usize) -> i64,
) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
        let jobs = chunk
            .iter()
            .map(|&i| NewJob::new(dest, i.to_string()).at(due(i)))
            .collect();
        let results = rt
            .block_on(client.enqueue_batch(jobs, OnConflict::Replace))
            .expect("enqueue");
        assert!(results.iter().all(Result::is_ok));
    }
}

/// Pops `list` until `n` arrived or `timeout`: (local ms at the pop, payload) per job.
fn consume(
    con: &mut redis::Connection,
    list: &str,
    n: usize,
    timeout: Duration,
) -> Vec<(i64, usize)> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::with_capacity(n);
    while got.len() < n && Instant::now() < deadline {
        let popped: Option<Vec<String>> = redis::cmd("RPOP").arg(list).arg(500).query(con).unwrap();
        let at = epoch_ms();
        match popped {
            Some(items) => got.extend(items.iter().map(|p| (at, p.parse().unwrap()))),
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    got
}

#[test]
fn a_rate_limited_route_goes_at_its_rate_across_three_daemons_in_order_none_twice_none_early() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        r#"
[[routes]]
name = "limited"
sink = "local"
target = "q:limited"
rate = "10000/s"
burst = 1000

[[routes]]
name = "free"
sink = "local"
target = "q:free"
"#,
    );
    let daemons = [
        Daemon::start(&config),
        Daemon::start_instance(&config),
        Daemon::start_instance(&config),
    ];
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    // 300,000 jobs due within 100 ms of one another: a burst the rate spreads over 30 s.
    const N: usize = 300_000;
    let base = redis_now_ms(&mut con) + 2_000;
    let due = |i: usize| base + (i / 3_000) as i64;
    // The consumer pops from the start, so a slow enqueue cannot bunch its pops.
    let mut consumer_con = redis.conn();
    let consumer = std::thread::spawn(move || {
        consume(&mut consumer_con, "q:limited", N, Duration::from_secs(90))
    });
    let enqueue_start = Instant::now();
    enqueue(&rt, &client, "limited", N, due);
    eprintln!("{N} jobs enqueued in {:?}", enqueue_start.elapsed());
    // Another route on the same namespace, due while the limited one is held.
    let mut free_con = redis.conn();
    let url = redis.url();
    let free = std::thread::spawn(move || {
        let pause = (base + 1500 - epoch_ms()).max(0) as u64;
        std::thread::sleep(Duration::from_millis(pause));
        let rt = crate::common::runtime();
        let client = rt.block_on(Client::open(&url)).expect("open");
        let at = epoch_ms();
        enqueue(&rt, &client, "free", 100, |_| at);
        let got = consume(&mut free_con, "q:free", 100, Duration::from_secs(5));
        (at, got)
    });

    let got = consumer.join().expect("consumer");
    assert_eq!(got.len(), N, "every job arrives");
    let ids: HashSet<usize> = got.iter().map(|(_, i)| *i).collect();
    assert_eq!(ids.len(), N, "none twice");
    for (at, i) in &got {
        assert!(
            *at >= due(*i),
            "job {i} arrived at {at}, before its due time {}",
            due(*i)
        );
    }
    // In due order: each job's due time is at least that of the one before.
    assert!(
        got.windows(2).all(|w| due(w[0].1) <= due(w[1].1)),
        "jobs leave in due order"
    );
    // At most rate × 1 s + burst in any one-second window (with 5% for the pops' timing).
    let times: Vec<i64> = got.iter().map(|(at, _)| *at).collect();
    let mut most = 0;
    let mut start = 0;
    for end in 0..times.len() {
        while times[end] - times[start] >= 1000 {
            start += 1;
        }
        most = most.max(end - start + 1);
    }
    assert!(
        most <= 11_550,
        "{most} jobs within one second; the rate is 10000/s with a burst of 1000"
    );
    // The burst at once, then 10,000 a second: never sooner than 30 s - 5 %. Not much later
    // either, though three debug daemons and this consumer on a loaded test machine may fall
    // behind the rate; a limiter that let half its rate through would still fail here, and
    // the rate a driven route reaches exactly is checked against the reference model in
    // flow_model.
    let took = (times[N - 1] - base) as f64 / 1000.0;
    let expected = (N - 1000) as f64 / 10_000.0;
    eprintln!("{N} jobs in {took:.2} s (expected {expected:.2} s); at most {most} in one second");
    assert!(
        took >= expected * 0.95 && took <= expected * 1.5,
        "{N} jobs took {took:.2} s; at 10000/s after a burst of 1000: {expected:.2} s"
    );

    // The wait while held is deferral, reported apart from lateness.
    let deferred: f64 = daemons
        .iter()
        .map(|d| d.metric("zdelay_deferred_total", &[("route", "limited")]))
        .sum();
    assert!(
        deferred > (N / 2) as f64,
        "deferred jobs counted: {deferred}"
    );

    let (free_at, free_got) = free.join().expect("free route consumer");
    assert_eq!(free_got.len(), 100, "the other route's jobs all arrive");
    let last = free_got.iter().map(|(at, _)| *at).max().unwrap();
    eprintln!(
        "the other route's 100 jobs arrived within {} ms",
        last - free_at
    );
    // Held behind the limited route's backlog, they would wait for most of its 30 s.
    assert!(
        last - free_at < 3_000,
        "the other route is not slowed by the limited one's backlog: {} ms",
        last - free_at
    );
}

#[test]
fn a_bounded_route_holds_while_its_list_is_full_and_resumes_as_consumers_drain_it() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        r#"
[[routes]]
name = "bounded"
sink = "local"
target = "q:bounded"
max_length = 100
"#,
    );
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    enqueue(&rt, &client, "bounded", 1000, |_| now);
    // No consumer: the list fills to its bound and stays there.
    let mut longest = 0;
    wait_for("the list at its bound", Duration::from_secs(10), || {
        let len: usize = redis::cmd("LLEN").arg("q:bounded").query(&mut con).unwrap();
        longest = longest.max(len);
        len == 100
    });
    let watch_until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < watch_until {
        let len: usize = redis::cmd("LLEN").arg("q:bounded").query(&mut con).unwrap();
        longest = longest.max(len);
    }
    assert_eq!(longest, 100, "the list never grows past its bound");
    wait_for("the route reported held", Duration::from_secs(15), || {
        daemon.metric(
            "zdelay_route_held",
            &[("route", "bounded"), ("by", "max_length")],
        ) == 1.0
    });
    let out = config.cli(&["stats", "-o", "json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    let flow = &stats["flow"][0];
    assert_eq!(
        (&flow["route"], &flow["max_length"]),
        (&"bounded".into(), &100.into()),
        "{stats:#}"
    );
    assert!(flow["held_since_ms"].as_i64().is_some(), "{stats:#}");
    assert_eq!(flow["held_by"], "max_length", "{stats:#}");
    let text = String::from_utf8_lossy(&config.cli(&["stats"]).stdout).into_owned();
    assert!(
        text.contains("route bounded (max_length 100): held for"),
        "{text}"
    );
    // A consumer drains it: everything arrives, once each.
    let got = consume(&mut con, "q:bounded", 1000, Duration::from_secs(20));
    let ids: HashSet<usize> = got.iter().map(|(_, i)| *i).collect();
    assert_eq!((got.len(), ids.len()), (1000, 1000), "every job once");
    wait_for("the route flowing again", Duration::from_secs(15), || {
        daemon.metric(
            "zdelay_route_held",
            &[("route", "bounded"), ("by", "max_length")],
        ) == 0.0
    });
}

#[test]
fn bad_flow_settings_are_refused_naming_the_field() {
    let url = "redis://127.0.0.1:1";
    let route = |extra: &str| {
        format!("[[routes]]\nname = \"r\"\nsink = \"local\"\ntarget = \"q\"\n{extra}")
    };
    let kafka = "[sinks.k]\nkind = \"kafka\"\nbrokers = \"127.0.0.1:1\"\n[[routes]]\nname = \"r\"\nsink = \"k\"\ntarget = \"t\"\n";
    let amqp = "[sinks.a]\nkind = \"amqp\"\nurl = \"amqp://127.0.0.1:1\"\n[[routes]]\nname = \"r\"\nsink = \"a\"\ntarget = \"x/k\"\n";
    let core_nats = "[sinks.n]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:1\"\njetstream = false\n[[routes]]\nname = \"r\"\nsink = \"n\"\ntarget = \"s\"\n";
    let cases = [
        (
            route("rate = \"0/s\""),
            vec!["routes[0] (r).rate", "more than 0"],
        ),
        (
            route("rate = \"-5/s\""),
            vec!["routes[0] (r).rate", "more than 0"],
        ),
        (
            route("rate = \"fast\""),
            vec!["routes[0] (r).rate", "not a rate"],
        ),
        (
            route("rate = \"10/d\""),
            vec!["routes[0] (r).rate", "unknown unit"],
        ),
        (
            route("burst = 5"),
            vec!["routes[0] (r).burst", "with rate only"],
        ),
        (
            route("rate = \"5/s\"\nburst = 0"),
            vec!["routes[0] (r).burst", "at least 1"],
        ),
        (
            route("max_length = 0"),
            vec!["routes[0] (r).max_length", "at least 1"],
        ),
        (
            format!("{kafka}max_length = 10\n"),
            vec![
                "routes[0] (r).max_length",
                "Kafka",
                "no queue depth",
                "rate",
            ],
        ),
        (
            format!("{amqp}max_length = 10\n"),
            vec!["routes[0] (r).max_length", "\"/<queue>\"", "\"x/k\""],
        ),
        (
            format!("{core_nats}max_length = 10\n"),
            vec!["routes[0] (r).max_length", "needs JetStream"],
        ),
        (
            route("key_rate = \"5/s\""),
            vec!["routes[0] (r).key_rate", "needs key_header"],
        ),
        (
            route("key_header = \"tenant\""),
            vec!["routes[0] (r).key_header", "needs key_rate"],
        ),
        (
            route("key_header = \"t\"\nkey_rate = \"0/s\""),
            vec!["routes[0] (r).key_rate", "more than 0"],
        ),
        (
            route("key_burst = 3"),
            vec!["routes[0] (r).key_burst", "with key_rate only"],
        ),
    ];
    for (toml, needles) in cases {
        let config = TestConfig::new(url, 1, &toml);
        let out = config.cli(&["check-config"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{toml}: must fail");
        for needle in needles {
            assert!(
                err.contains(needle),
                "{toml}: stderr names {needle:?}: {err}"
            );
        }
    }
}

#[test]
fn a_spread_burst_is_flat_over_its_window_none_early_and_each_id_falls_in_one_place() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        "[[routes]]\nname = \"r\"\nsink = \"local\"\ntarget = \"q:r\"\n",
    );
    let _daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    let base = redis_now_ms(&mut con) + 3_600_000;
    const N: usize = 10_000;
    const WINDOW_MS: i64 = 10_000;
    let jobs = (0..N)
        .map(|i| {
            NewJob::new("r", "x")
                .id(format!("job-{i}"))
                .at(base)
                .spread(Duration::from_millis(WINDOW_MS as u64))
        })
        .collect();
    let results = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Replace))
        .unwrap();
    assert!(results.iter().all(Result::is_ok));
    let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(lane_due("r", "q:r"))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut con)
        .unwrap();
    let dues: Vec<i64> = page.into_iter().map(|(_, s)| s as i64).collect();
    assert_eq!(dues.len(), N);
    assert!(
        dues.iter().all(|d| (base..base + WINDOW_MS).contains(d)),
        "all within the window, none early"
    );
    // Flat: chi-square over 20 equal bins below the 0.1 % critical value (19 degrees: 43.82).
    let mut bins = [0f64; 20];
    for d in &dues {
        bins[((d - base) * 20 / WINDOW_MS) as usize] += 1.0;
    }
    let expected = N as f64 / 20.0;
    let chi2: f64 = bins.iter().map(|o| (o - expected).powi(2) / expected).sum();
    assert!(chi2 < 43.82, "chi-square {chi2:.1} over {bins:?}");
    // The same id enqueued again lands on the same point; the CLI spreads alike.
    let again = rt
        .block_on(
            client.enqueue(
                NewJob::new("r", "x")
                    .id("job-7")
                    .at(base)
                    .spread(Duration::from_millis(WINDOW_MS as u64)),
                OnConflict::Replace,
            ),
        )
        .unwrap();
    assert_eq!(again.0, "job-7");
    let score = |con: &mut redis::Connection, id: &str| -> i64 {
        let s: f64 = redis::cmd("ZSCORE")
            .arg(lane_due("r", "q:r"))
            .arg(id)
            .query(con)
            .unwrap();
        s as i64
    };
    let offset = zdelay::client::spread_offset_ms("job-7", WINDOW_MS as u64) as i64;
    assert_eq!(score(&mut con, "job-7"), base + offset);
    let out = config.cli(&[
        "enqueue",
        "--dest",
        "r",
        "--payload",
        "x",
        "--id",
        "job-7",
        "--at",
        &base.to_string(),
        "--spread",
        "10s",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(score(&mut con, "job-7"), base + offset);
}

#[test]
fn the_forecast_and_the_console_show_what_each_limit_will_do() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        r#"
[[routes]]
name = "limited"
sink = "local"
target = "q:l"
rate = "10/s"

[[routes]]
name = "bounded"
sink = "local"
target = "q:b"
max_length = 5

[[routes]]
name = "keyed"
sink = "local"
target = "q:k"
key_header = "tenant"
key_rate = "50/s"
"#,
    );
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    // 900 jobs due in 2 minutes: at 10/s a 60 s step drains 600 of them.
    let at = redis_now_ms(&mut con) + 90_000;
    enqueue(&rt, &client, "limited", 900, |_| at);
    let out = config.cli(&["forecast", "--next", "3m", "--step", "60s", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let limit = &f["route_limits"]["limited"];
    assert_eq!(limit["rate_per_s"], 10.0, "{f:#}");
    assert_eq!(limit["drain_per_step"], 600, "{f:#}");
    assert_eq!(limit["over_rate_steps"], serde_json::json!([1]), "{f:#}");
    let text = config.cli(&["forecast", "--next", "3m", "--step", "60s"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("route limited is limited to 10.0/s, 600 per step"),
        "{text}"
    );

    // The console, in a real browser: each limit, and whether its route holds work back now.
    let now = redis_now_ms(&mut con);
    enqueue(&rt, &client, "bounded", 10, |_| now);
    wait_for("the bounded route held", Duration::from_secs(15), || {
        daemon.metric(
            "zdelay_route_held",
            &[("route", "bounded"), ("by", "max_length")],
        ) == 1.0
    });
    let base = format!("http://127.0.0.1:{}/", config.admin_port);
    let page = crate::common::browser_script("console_flow.py", &[&base]);
    let row = |table: &str, route: &str| -> Vec<String> {
        serde_json::from_value(page[table][route].clone()).unwrap_or_else(|_| panic!("{page:#}"))
    };
    assert_eq!(row("flow", "limited")[..4], ["limited", "10/s", "—", "—"]);
    assert_eq!(row("flow", "limited")[4], "flowing");
    assert_eq!(
        row("flow", "keyed")[..4],
        ["keyed", "—", "50/s per tenant", "—"]
    );
    assert_eq!(row("flow", "bounded")[..4], ["bounded", "—", "—", "5"]);
    assert!(
        row("flow", "bounded")[4].starts_with("held for"),
        "{page:#}"
    );
    let limited = row("limits", "limited");
    assert_eq!(limited[..3], ["limited", "10", "600"], "{page:#}");
    assert!(
        limited[4].contains('+'),
        "the step over its rate is named: {page:#}"
    );
}

#[test]
fn a_schedule_s_jitter_spreads_each_occurrence_over_its_window_from_its_id() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        "[[routes]]\nname = \"r\"\nsink = \"local\"\ntarget = \"q:r\"\n",
    );
    let _daemon = Daemon::start(&config);
    let out = config.cli(&[
        "schedule",
        "set",
        "tick",
        "--dest",
        "r",
        "--every",
        "1s",
        "--jitter",
        "900ms",
        "--payload",
        "t",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut con = redis.conn();
    // Each occurrence's job waits in its route's lane until its jittered time.
    let mut seen = Vec::new();
    wait_for(
        "three jittered occurrences",
        Duration::from_secs(15),
        || {
            let page: Vec<(String, f64)> = redis::cmd("ZRANGE")
                .arg(lane_due("r", "q:r"))
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query(&mut con)
                .unwrap();
            for (id, score) in page {
                if !seen.iter().any(|(s, _)| *s == id) {
                    seen.push((id, score as i64));
                }
            }
            seen.len() >= 3
        },
    );
    for (id, due) in &seen {
        let t: i64 = id.rsplit(':').next().unwrap().parse().unwrap();
        let offset = zdelay::client::spread_offset_ms(id, 900) as i64;
        assert_eq!(
            *due,
            t + offset,
            "{id}: due at its occurrence plus its offset"
        );
    }
    assert!(
        seen.iter()
            .any(|(id, due)| *due > id.rsplit(':').next().unwrap().parse::<i64>().unwrap())
    );
    wait_for("occurrences delivered", Duration::from_secs(10), || {
        crate::common::llen(&mut con, "q:r") >= 3
    });
    let bad = config.cli(&[
        "schedule",
        "set",
        "bad",
        "--dest",
        "r",
        "--every",
        "1s",
        "--jitter",
        "0s",
        "--payload",
        "t",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("jitter"));
}

#[test]
fn one_key_s_burst_waits_at_its_rate_while_other_keys_flow() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        r#"
[[routes]]
name = "hooks"
sink = "local"
target = "q:hooks"
key_header = "tenant"
key_rate = "1000/s"
key_burst = 100
"#,
    );
    let _daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    // As the issue tells it: tenant A enqueues 100,000 jobs due now, then tenant B 100 due
    // now. (All of them due at one moment, B's last in due order, is measured by `zdelay
    // bench --mode flow`: there B waits while the mover sets A's whole burst aside.)
    let tenant_jobs = |tenant: &str, n: usize| -> Vec<NewJob> {
        (0..n)
            .map(|i| NewJob::new("hooks", format!("{tenant}{i}")).header("tenant", tenant))
            .collect()
    };
    // A consumer from the start, on its own thread.
    let mut consumer_con = redis.conn();
    let consumer = std::thread::spawn(move || {
        let mut got: Vec<(i64, String)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let popped: Option<Vec<String>> = redis::cmd("RPOP")
                .arg("q:hooks")
                .arg(1000)
                .query(&mut consumer_con)
                .unwrap();
            let now = epoch_ms();
            match popped {
                Some(items) => got.extend(items.into_iter().map(|p| (now, p))),
                None => std::thread::sleep(Duration::from_millis(1)),
            }
            let b = got.iter().filter(|(_, p)| p.starts_with('b')).count();
            if b == 100 && got.len() >= 3_500 {
                break;
            }
        }
        got
    });
    let a_start = epoch_ms();
    for chunk in tenant_jobs("a", 100_000).chunks(5000) {
        let r = rt
            .block_on(client.enqueue_batch(chunk.to_vec(), OnConflict::Replace))
            .unwrap();
        assert!(r.iter().all(Result::is_ok));
    }
    let b_start = epoch_ms();
    let r = rt
        .block_on(client.enqueue_batch(tenant_jobs("b", 100), OnConflict::Replace))
        .unwrap();
    assert!(r.iter().all(Result::is_ok));
    let got = consumer.join().expect("consumer");
    let b_times: Vec<i64> = got
        .iter()
        .filter(|(_, p)| p.starts_with('b'))
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(b_times.len(), 100, "tenant B's jobs all arrive");
    let b_after = b_times.iter().max().unwrap() - b_start;
    eprintln!(
        "tenant A's 100,000 enqueued in {} ms; tenant B's 100 arrived within {b_after} ms of their enqueue",
        b_start - a_start
    );
    // Behind A's whole burst at A's rate B would wait 100 s; how soon it goes is measured by
    // the benchmark, and this bound only tells the two apart on a loaded test machine.
    assert!(
        b_after < 10_000,
        "tenant B waited {b_after} ms behind tenant A's burst"
    );
    // Tenant A goes at its rate: in the 3 s from its first enqueue, its burst (100) and about
    // 3,000 more, never more. Fewer when a loaded test machine's daemon or consumer falls
    // behind; the rate a driven key reaches exactly is checked against the reference model.
    let a_by_3s = got
        .iter()
        .filter(|(t, p)| p.starts_with('a') && *t <= a_start + 3_000)
        .count();
    eprintln!("tenant A: {a_by_3s} jobs in the first 3 s");
    assert!(
        (1_500..=3_300).contains(&a_by_3s),
        "tenant A: {a_by_3s} jobs in 3 s at 1000/s"
    );
    let a: HashSet<&String> = got
        .iter()
        .filter(|(_, p)| p.starts_with('a'))
        .map(|(_, p)| p)
        .collect();
    assert_eq!(
        a.len(),
        got.iter().filter(|(_, p)| p.starts_with('a')).count(),
        "none twice"
    );
}

/// Drives a rate-limited lane as the mover does, on the script's clock from `start` for
/// `span_ms`: again at once after a full batch, else at the time the call named, 1 ms late.
/// Returns the jobs moved.
fn drive_as_the_mover(
    rig: &mut Rig,
    flow: &zdelay::config::RouteFlow,
    batch: usize,
    start: i64,
    span_ms: i64,
) -> usize {
    let (mut now, mut moved, mut calls) = (start, 0, 0);
    while now < start + span_ms {
        let reply = rig.call(Some(now), batch, Some(flow)).expect("move_lane");
        moved += rig.take_moved().len();
        calls += 1;
        assert!(calls < 100_000, "the mover spins");
        if reply.taken >= batch {
            continue;
        }
        let Some(next) = reply.next_due else { break };
        now = (next as i64).max(now + 1) + 1;
    }
    moved
}

fn lane_jobs(
    prefix: &str,
    n: usize,
    due: i64,
    meta: Option<&str>,
) -> Vec<(String, i64, Option<String>)> {
    (0..n)
        .map(|i| (format!("{prefix}{i:05}"), due, meta.map(str::to_owned)))
        .collect()
}

#[test]
fn a_rate_of_1000_per_s_with_burst_1_moves_1000_a_second_not_10() {
    let mut rig = Rig::start();
    let t0 = 1_700_000_000_000;
    rig.enqueue(&lane_jobs("j", 3_000, t0, None));
    let moved = drive_as_the_mover(&mut rig, &rate_flow(1000.0, 1), 1000, t0, 3_000);
    // The bucket holds 1 + 10 ms of the rate (11), then 1000 a second.
    assert!(
        (2_950..=3_000).contains(&moved),
        "{moved} jobs in 3 s at 1000/s, burst 1"
    );
}

#[test]
fn a_rate_of_1000_per_s_with_burst_1_delivers_about_1000_a_second_from_a_daemon() {
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        "[[routes]]\nname = \"r\"\nsink = \"local\"\ntarget = \"q:r\"\nrate = \"1000/s\"\nburst = 1\n",
    );
    let _daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    let now = redis_now_ms(&mut con);
    enqueue(&rt, &client, "r", 6_000, |_| now);
    let got = consume(&mut con, "q:r", 6_000, Duration::from_secs(4));
    let first = got.first().expect("jobs arrive").0;
    let in_3s = got.iter().filter(|(at, _)| *at < first + 3_000).count();
    eprintln!("{in_3s} jobs in the first 3 s at 1000/s, burst 1");
    // Before the rate math was mended: 30 (one job per tenth of a second). Generous bounds:
    // the pops' timing and a loaded machine's timers.
    assert!(
        (2_000..=3_300).contains(&in_3s),
        "{in_3s} jobs in 3 s at 1000/s with burst 1"
    );
}

#[test]
fn a_rate_hold_lasts_until_the_backlog_is_gone_so_its_wait_is_never_lateness() {
    let mut rig = Rig::start();
    let t0 = 1_700_000_000_000;
    // 20,000/s with a batch of 1,000: a held call's tenth of a second of tokens is a whole
    // batch, so calls the rate does not cut come between the ones it does.
    rig.enqueue(&lane_jobs("j", 10_000, t0, None));
    let flow = rate_flow(20_000.0, 2_000);
    let (mut now, mut moved, mut held_since) = (t0, 0, None);
    while moved < 10_000 {
        let reply = rig.call(Some(now), 1000, Some(&flow)).expect("move_lane");
        moved += rig.take_moved().len();
        assert_eq!(
            reply.max_lateness_ms, 0,
            "at {now}: the backlog's wait while held is deferral, not lateness: {reply:?}"
        );
        let since = rig.flow_field("held_since");
        if moved < 10_000 && since.is_some() {
            assert!(
                held_since.is_none() || held_since == since,
                "at {now}: the hold since {held_since:?} restarted at {since:?}"
            );
            held_since = since;
            assert_ne!(
                reply.held,
                Held::Flowing,
                "at {now}: held while due work is left"
            );
        }
        if reply.taken < 1000 {
            now = reply.next_due.expect("a backlog is left") as i64;
        }
    }
    assert!(held_since.is_some(), "the route was held");
    assert_eq!(
        rig.flow_field("held_since"),
        None,
        "caught up: the hold ends"
    );
}

#[test]
fn a_key_s_turns_take_its_tokens_so_it_never_gets_more_than_burst_plus_rate_times_t() {
    let mut rig = Rig::start();
    let t0 = 1_700_000_000_000;
    let meta = r#"{"headers":{"tenant":"a"}}"#;
    let flow = zdelay::config::RouteFlow {
        rate_per_s: None,
        burst: 1,
        max_length: None,
        per_key: Some(("tenant".to_owned(), 100.0, 10)),
    };
    // 30 at once: the burst (10) goes, 20 are given turns 10 ms apart.
    rig.enqueue(&lane_jobs("a", 30, t0, Some(meta)));
    let mut moved = 0;
    for now in (t0..=t0 + 201).step_by(1) {
        rig.call(Some(now), 1000, Some(&flow)).expect("move_lane");
        moved += rig.take_moved().len();
    }
    assert_eq!(moved, 30, "the burst and every turn by its time");
    // 10 more of the same key once its last turn is past: the turns took its tokens, so
    // they wait too (before, the bucket was full again and all 10 went at once).
    rig.enqueue(&lane_jobs("b", 10, t0 + 211, Some(meta)));
    rig.call(Some(t0 + 211), 1000, Some(&flow))
        .expect("move_lane");
    moved += rig.take_moved().len();
    // In 211 ms: at most the burst (10) + 100/s × 0.211 s.
    assert!(
        moved as f64 <= 10.0 + 21.1,
        "{moved} jobs of one key within 211 ms at 100/s, burst 10"
    );
}

#[test]
fn a_job_whose_meta_cannot_be_read_for_its_key_goes_to_dead_and_the_route_moves_on() {
    let mut rig = Rig::start();
    let t0 = 1_700_000_000_000;
    let flow = zdelay::config::RouteFlow {
        rate_per_s: None,
        burst: 1,
        max_length: None,
        per_key: Some(("tenant".to_owned(), 1000.0, 100)),
    };
    let mut jobs = lane_jobs("bad", 1, t0, Some(r#"{"headers":{"tenant":"b"}}"#));
    jobs.extend(lane_jobs(
        "good",
        3,
        t0,
        Some(r#"{"headers":{"tenant":"a"}}"#),
    ));
    rig.enqueue(&jobs);
    // The producer functions refuse such a meta, so it is written as an older client or a raw
    // write could have left it.
    let _: () = redis::cmd("HSET")
        .arg(&rig.lane.keys.meta)
        .arg("bad00000")
        .arg(r#"{"headers":{"tenant":"abc"#)
        .query(rig.raw())
        .unwrap();
    let reply = rig.call(Some(t0), 1000, Some(&flow)).expect("move_lane");
    let mut moved = rig.take_moved();
    moved.sort();
    assert_eq!(moved, ["good00000", "good00001", "good00002"]);
    assert_eq!((reply.taken, reply.dead[0]), (4, 1), "{reply:?}");
    let reason: Option<String> = redis::cmd("HGET")
        .arg(&rig.lane.keys.reasons)
        .arg("bad00000")
        .query(rig.raw())
        .unwrap();
    let reason = reason.expect("a reason");
    assert!(
        reason.contains("not valid JSON") && reason.contains("tenant"),
        "{reason}"
    );
    let dead: Option<f64> = redis::cmd("ZSCORE")
        .arg(&rig.lane.keys.dead)
        .arg("bad00000")
        .query(rig.raw())
        .unwrap();
    assert!(dead.is_some(), "in the dead set");
    assert!(rig.due().is_empty(), "nothing left due");
}

#[test]
fn a_bounded_route_whose_list_key_is_not_a_list_sends_its_jobs_to_dead_instead_of_wedging() {
    let mut rig = Rig::start();
    let t0 = 1_700_000_000_000;
    let list = rig.lane.list.clone();
    let _: () = redis::cmd("SET")
        .arg(&list)
        .arg("x")
        .query(rig.raw())
        .unwrap();
    rig.enqueue(&lane_jobs("j", 3, t0, None));
    let flow = zdelay::config::RouteFlow {
        rate_per_s: None,
        burst: 1,
        max_length: Some(10),
        per_key: None,
    };
    let reply = rig.call(Some(t0), 1000, Some(&flow)).expect("move_lane");
    assert_eq!((reply.taken, reply.dead[2]), (3, 3), "{reply:?}");
    let reason: Option<String> = redis::cmd("HGET")
        .arg(&rig.lane.keys.reasons)
        .arg("j00000")
        .query(rig.raw())
        .unwrap();
    assert!(reason.unwrap_or_default().contains("not a list"));
    assert!(rig.due().is_empty(), "nothing left due");
}
