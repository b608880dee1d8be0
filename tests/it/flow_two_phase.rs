//! Flow control on two-phase routes (storage layout 2), through real brokers: a route's rate
//! holds across its spread shards, each job once; a per-key rate spaces each key while the
//! others flow; a held broker route holds up no other route in its spread shard, local or
//! broker. (The buckets' math on generated inputs is in `flow_model`.)

use crate::common::{Daemon, RedisServer, Services, TestConfig, redis_now_ms, wait_for};
use crate::nats::make_stream;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zdelay::{Client, NewJob, OnConflict};

/// Every message on `subject` from now on, with the moment it arrived.
fn listen(
    rt: &tokio::runtime::Runtime,
    url: &str,
    subject: &str,
) -> Arc<Mutex<Vec<(Instant, String)>>> {
    use futures::StreamExt;
    let got = Arc::new(Mutex::new(Vec::new()));
    let client = rt
        .block_on(async_nats::connect(url))
        .expect("connect to nats");
    let mut sub = rt
        .block_on(client.subscribe(subject.to_owned()))
        .expect("subscribe");
    rt.block_on(client.flush()).expect("flush the subscription");
    let sink = got.clone();
    rt.spawn(async move {
        let _client = client;
        while let Some(m) = sub.next().await {
            let payload = String::from_utf8_lossy(&m.payload).into_owned();
            sink.lock().unwrap().push((Instant::now(), payload));
        }
    });
    got
}

fn enqueue(rt: &tokio::runtime::Runtime, client: &Client, dest: &str, n: usize, due_ms: i64) {
    let jobs = (0..n)
        .map(|i| NewJob::new(dest, format!("{dest}-{i}")).at(due_ms))
        .collect();
    let results = rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// The most jobs of `times` (sorted) in any window T: none over `burst + rate × T`, with 2
/// jobs and 50 ms of the rate for a publish's own timing.
fn assert_within(what: &str, times: &[Instant], burst: f64, rate: f64) {
    for i in 0..times.len() {
        for j in i..times.len() {
            let t = times[j].duration_since(times[i]).as_secs_f64();
            let allowed = burst + rate * (t + 0.05) + 2.0;
            assert!(
                (j - i + 1) as f64 <= allowed,
                "{what}: {} jobs within {t:.3} s; the bucket allows {allowed:.1}",
                j - i + 1
            );
        }
    }
}

/// A NATS stream, a Redis with 4 spread shards and two daemons that have shared them out,
/// for one route `name` to sink `bus` with the flow settings `limits` (TOML lines); and every
/// message on the route's subject from then on.
struct TwoDaemonsOnNats {
    rt: tokio::runtime::Runtime,
    redis: RedisServer,
    config: TestConfig,
    daemons: [Daemon; 2],
    got: Arc<Mutex<Vec<(Instant, String)>>>,
    _js: async_nats::jetstream::Context,
}

impl TwoDaemonsOnNats {
    fn start(name: &str, limits: &str) -> Self {
        let url = Services::get().nats_url();
        let rt = crate::common::runtime();
        let (js, _stream, prefix) = rt.block_on(make_stream(&url));
        let redis = RedisServer::start();
        let config = TestConfig::new(
            &redis.url(),
            4,
            &format!(
                "[sinks.bus]\nkind = \"nats\"\nurl = \"{url}\"\n\n[[routes]]\nname = \"{name}\"\n\
                 sink = \"bus\"\ntarget = \"{prefix}.{name}\"\n{limits}\n"
            ),
        );
        let daemons = [Daemon::start(&config), Daemon::start_instance(&config)];
        wait_for("the shards shared out", Duration::from_secs(15), || {
            daemons
                .iter()
                .all(|d| d.log_text().contains("poller slots rebalanced instances=2"))
        });
        let got = listen(&rt, &url, &format!("{prefix}.{name}"));
        TwoDaemonsOnNats {
            rt,
            redis,
            config,
            daemons,
            got,
            _js: js,
        }
    }

    /// Waits for `n` messages and a moment more (the last publishes may still be settling:
    /// nothing more may come); checks each job came once, and returns them as they arrived.
    fn received_once(&self, n: usize) -> Vec<(Instant, String)> {
        wait_for("every job through NATS", Duration::from_secs(30), || {
            self.got.lock().unwrap().len() >= n
        });
        std::thread::sleep(Duration::from_millis(300));
        let got = self.got.lock().unwrap().clone();
        let payloads: HashSet<&String> = got.iter().map(|(_, p)| p).collect();
        assert_eq!((got.len(), payloads.len()), (n, n), "each job once");
        got
    }

    /// The route's jobs moved after waiting for its limits, counted by both daemons.
    fn deferred(&self, route: &str) -> f64 {
        self.daemons
            .iter()
            .map(|d| d.metric("zdelay_deferred_total", &[("route", route)]))
            .sum()
    }
}

/// A NATS route with `key_rate = "20/s"` and `key_burst = 2` per `tenant`, published by two
/// daemons from 4 spread shards: tenant a's 60 jobs go at its rate (the first 2 at once, the
/// rest over about 2.9 s) while tenant b's 6, due after them, go at once; each job once, and
/// each tenant within its bucket in every window. The wait is counted as deferral.
#[test]
fn a_per_key_rate_on_a_nats_route_spaces_each_key_and_lets_the_others_flow() {
    const A: usize = 60;
    const B: usize = 6;
    const RATE: f64 = 20.0;
    const BURST: f64 = 2.0;
    let run = TwoDaemonsOnNats::start(
        "hooks",
        "key_header = \"tenant\"\nkey_rate = \"20/s\"\nkey_burst = 2",
    );
    let client = run.config.client(&run.rt);
    let due = redis_now_ms(&mut run.redis.conn()) + 300;
    let jobs = (0..A)
        .map(|i| {
            NewJob::new("hooks", format!("a-{i}"))
                .at(due)
                .header("tenant", "a")
        })
        .chain((0..B).map(|i| {
            NewJob::new("hooks", format!("b-{i}"))
                .at(due + 1)
                .header("tenant", "b")
        }))
        .collect();
    let results = run
        .rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let got = run.received_once(A + B);
    let of = |tenant: &str| -> Vec<Instant> {
        let mut times: Vec<Instant> = got
            .iter()
            .filter(|(_, p)| p.starts_with(tenant))
            .map(|(at, _)| *at)
            .collect();
        times.sort();
        times
    };
    let (a, b) = (of("a-"), of("b-"));
    assert_within("tenant a", &a, BURST, RATE);
    assert_within("tenant b", &b, BURST, RATE);
    let a_took = a[A - 1].duration_since(a[0]).as_secs_f64();
    let expected = (A as f64 - BURST) / RATE;
    eprintln!("tenant a: {A} jobs in {a_took:.2} s (its rate's {expected:.2} s)");
    assert!(a_took >= expected * 0.8, "tenant a went in {a_took:.2} s");
    // Tenant b's jobs do not wait behind tenant a's: all out before a's are half through.
    assert!(
        b[B - 1] < a[A / 2],
        "tenant b's last job came after half of tenant a's"
    );
    wait_for(
        "the wait counted as deferral",
        Duration::from_secs(10),
        || run.deferred("hooks") > 0.0,
    );
}

/// A NATS route with `rate = "50/s"` and `burst = 10`: 150 jobs due at once in 4 spread
/// shards, published by two daemons, arrive each once, never more in a window T than the bucket (10) + 50 × T (with a
/// little room for the publish's own timing), and at about the rate: the last one after
/// about (150 - 10) / 50 s. The wait is counted as deferral.
#[test]
fn a_rate_on_a_nats_route_holds_across_its_spread_shards_and_daemons() {
    const N: usize = 150;
    const RATE: f64 = 50.0;
    const BURST: f64 = 10.0;
    // Two daemons share the spread shards, and the route's one bucket; the rate is measured
    // once they have shared them out.
    let run = TwoDaemonsOnNats::start("limited", "rate = \"50/s\"\nburst = 10");
    let client = run
        .rt
        .block_on(Client::open(&run.redis.url()))
        .expect("open");
    let due = redis_now_ms(&mut run.redis.conn()) + 300;
    enqueue(&run.rt, &client, "limited", N, due);
    let times: Vec<Instant> = run.received_once(N).iter().map(|(at, _)| *at).collect();
    assert_within("the route", &times, BURST, RATE);
    let took = times[N - 1].duration_since(times[0]).as_secs_f64();
    let expected = (N as f64 - BURST) / RATE;
    eprintln!("{N} jobs at 50/s with a burst of 10: {took:.2} s (the rate's {expected:.2} s)");
    assert!(
        took >= expected * 0.85 && took <= expected + 2.0,
        "{N} jobs took {took:.2} s; at 50/s after a burst of 10: {expected:.2} s"
    );
    wait_for(
        "the wait counted as deferral",
        Duration::from_secs(10),
        || run.deferred("limited") > (N / 2) as f64,
    );
}

/// One spread shard, three routes: `slow` to NATS at 1 job a second, `fast` to the same NATS
/// sink and `local` to a list, none limited. The slow route's backlog, due first, waits its
/// turn; the other two routes' jobs all arrive at once.
#[test]
fn a_held_broker_route_holds_no_other_route_in_its_spread_shard() {
    let services = Services::get();
    let url = services.nats_url();
    let rt = crate::common::runtime();
    let (_js, _stream, prefix) = rt.block_on(make_stream(&url));
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        1,
        &format!(
            r#"
[sinks.bus]
kind = "nats"
url = "{url}"

[[routes]]
name = "slow"
sink = "bus"
target = "{prefix}.slow"
rate = "1/s"
burst = 1

[[routes]]
name = "fast"
sink = "bus"
target = "{prefix}.fast"

[[routes]]
name = "local"
sink = "local"
target = "q:local"
"#
        ),
    );
    let _daemon = Daemon::start(&config);
    let slow = listen(&rt, &url, &format!("{prefix}.slow"));
    let fast = listen(&rt, &url, &format!("{prefix}.fast"));
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut con = redis.conn();
    let due = redis_now_ms(&mut con) + 300;
    // The slow route's jobs are due first: ahead of the others in the shard.
    enqueue(&rt, &client, "slow", 200, due);
    enqueue(&rt, &client, "fast", 100, due + 100);
    enqueue(&rt, &client, "local", 100, due + 100);
    let started = Instant::now();
    wait_for(
        "the unlimited routes' jobs all delivered",
        Duration::from_secs(15),
        || {
            let local: usize = redis::cmd("LLEN").arg("q:local").query(&mut con).unwrap();
            local == 100 && fast.lock().unwrap().len() == 100
        },
    );
    let took = started.elapsed().as_secs_f64();
    let slow_count = slow.lock().unwrap().len();
    eprintln!("fast and local routes through in {took:.2} s; the slow route sent {slow_count}");
    assert!(
        (1..=3 + took.ceil() as usize).contains(&slow_count),
        "the slow route sent {slow_count} in {took:.2} s at 1/s with a burst of 1"
    );
}

/// A route to a list on another Redis with `max_length = 50`, its 500 jobs due at once in 4
/// spread shards (4 publishers): the list fills to 50 and stays there, never over; as a
/// consumer drains it the rest arrive, each once. The wait is deferral.
#[test]
fn max_length_on_a_remote_redis_route_holds_at_the_bound_and_resumes() {
    const N: usize = 500;
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "bounded"
sink = "other"
target = "q:bounded"
max_length = 50
"#,
            target.url()
        ),
    );
    let daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let mut far = target.conn();
    let due = redis_now_ms(&mut redis.conn()) + 200;
    enqueue(&rt, &client, "bounded", N, due);
    let llen = |con: &mut redis::Connection| -> usize {
        redis::cmd("LLEN").arg("q:bounded").query(con).unwrap()
    };
    let mut longest = 0;
    wait_for("the list at its bound", Duration::from_secs(15), || {
        let len = llen(&mut far);
        longest = longest.max(len);
        len == 50
    });
    let watch_until = Instant::now() + Duration::from_millis(700);
    while Instant::now() < watch_until {
        longest = longest.max(llen(&mut far));
    }
    assert_eq!(longest, 50, "the list never grows past its bound");
    // Held, as `zdelay stats` and the daemon's gauge say.
    let held_by = |config: &TestConfig| {
        let out = config.cli(&["stats", "--json"]);
        let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats json");
        let route = stats["flow"]
            .as_array()
            .and_then(|f| f.iter().find(|r| r["route"] == "bounded").cloned())
            .unwrap_or_else(|| panic!("no flow row for the route: {stats}"));
        (route["held_by"].clone(), route["held_since_ms"].is_i64())
    };
    assert_eq!(
        held_by(&config),
        (serde_json::json!("max_length"), true),
        "held by its bound"
    );
    wait_for("the route-held gauge", Duration::from_secs(10), || {
        daemon.metric(
            "zdelay_route_held",
            &[("route", "bounded"), ("by", "max_length")],
        ) == 1.0
    });
    // A consumer drains it: everything arrives, once each, never over the bound.
    let mut got: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < N && Instant::now() < deadline {
        let len = llen(&mut far);
        longest = longest.max(len);
        let popped: Option<Vec<String>> = redis::cmd("RPOP")
            .arg("q:bounded")
            .arg(20)
            .query(&mut far)
            .unwrap();
        match popped {
            Some(items) => got.extend(items),
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    let ids: HashSet<&String> = got.iter().collect();
    assert_eq!((got.len(), ids.len()), (N, N), "every job once");
    assert!(
        longest <= 50,
        "the list reached {longest}, over its bound of 50"
    );
    wait_for(
        "the wait counted as deferral",
        Duration::from_secs(10),
        || daemon.metric("zdelay_deferred_total", &[("route", "bounded")]) > 0.0,
    );
    wait_for("the route flows again", Duration::from_secs(10), || {
        held_by(&config) == (serde_json::Value::Null, false)
    });
}

/// A route to a RabbitMQ queue with `max_length = 20`: the queue fills to 20 messages and
/// stays there; a consumer drains it and every job arrives, once.
#[test]
fn max_length_on_a_rabbitmq_route_bounds_its_queue() {
    use crate::amqp::{consume, py};
    const N: usize = 60;
    let services = Services::get();
    let (url, python) = (services.amqp_url(), services.python());
    let queue = format!(
        "zd-bounded-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    py(&python, &url, &["declare", &queue]);
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[sinks.rabbit]
kind = "amqp"
url = "{url}"

[[routes]]
name = "bounded"
sink = "rabbit"
target = "/{queue}"
max_length = 20
"#
        ),
    );
    let _daemon = Daemon::start(&config);
    let rt = crate::common::runtime();
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let due = redis_now_ms(&mut redis.conn()) + 200;
    enqueue(&rt, &client, "bounded", N, due);
    let count = || -> usize {
        py(&python, &url, &["count", &queue])
            .trim()
            .parse()
            .expect("a count")
    };
    let mut most = 0;
    wait_for("the queue at its bound", Duration::from_secs(15), || {
        let n = count();
        most = most.max(n);
        n == 20
    });
    for _ in 0..4 {
        most = most.max(count());
    }
    assert_eq!(most, 20, "the queue never grows past its bound");
    let got = consume(&python, &url, &queue, N);
    let bodies: HashSet<Vec<u8>> = got.iter().map(|m| m.body.clone()).collect();
    assert_eq!((got.len(), bodies.len()), (N, N), "every job once");
    py(&python, &url, &["delete", &queue]);
}

/// A route to a subject a JetStream stream stores, with `max_length = 30`: the stream fills
/// to 30 messages and stays there; each purge makes room for 30 more, until all 100 went.
#[test]
fn max_length_on_a_nats_route_bounds_its_stream() {
    const N: usize = 100;
    let services = Services::get();
    let url = services.nats_url();
    let rt = crate::common::runtime();
    let (js, stream, prefix) = rt.block_on(make_stream(&url));
    let redis = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[sinks.bus]
kind = "nats"
url = "{url}"

[[routes]]
name = "bounded"
sink = "bus"
target = "{prefix}.bounded"
max_length = 30
"#
        ),
    );
    let _daemon = Daemon::start(&config);
    let got = listen(&rt, &url, &format!("{prefix}.bounded"));
    let client = rt.block_on(Client::open(&redis.url())).expect("open");
    let due = redis_now_ms(&mut redis.conn()) + 200;
    enqueue(&rt, &client, "bounded", N, due);
    let messages = || -> u64 {
        rt.block_on(async {
            let mut s = js.get_stream(&stream).await.expect("get stream");
            s.info().await.expect("stream info").state.messages
        })
    };
    let mut most = 0;
    while got.lock().unwrap().len() < N {
        wait_for("the stream at its bound", Duration::from_secs(15), || {
            let n = messages();
            most = most.max(n);
            n == 30 || got.lock().unwrap().len() == N
        });
        for _ in 0..5 {
            most = most.max(messages());
            std::thread::sleep(Duration::from_millis(20));
        }
        rt.block_on(async {
            js.get_stream(&stream)
                .await
                .expect("get stream")
                .purge()
                .await
                .expect("purge")
        });
    }
    assert!(most <= 30, "the stream held {most}, over its bound of 30");
    let got = got.lock().unwrap().clone();
    let payloads: HashSet<&String> = got.iter().map(|(_, p)| p).collect();
    assert_eq!((got.len(), payloads.len()), (N, N), "every job once");
}
