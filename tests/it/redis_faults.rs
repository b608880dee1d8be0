//! Redis misbehaving under a running daemon, each with a steady producer and consumer: BUSY
//! (another client's script running 6 s), LOADING (a restart with a large dataset), OOM
//! (`maxmemory` reached), `CLIENT KILL` of every normal connection mid-batch (repeatedly), and
//! a replica promoted (`CLUSTER FAILOVER`).
//!
//! For each: every job the producer had acknowledged arrives exactly once, none before it is
//! due, none that was refused; the jobs that fell due while Redis misbehaved have all arrived
//! within 1 s of Redis answering normally again; and the daemon's log has one warning for the
//! episode and one "recovered" line, however long it lasted.

use crate::common::{
    self, Daemon, RedisCluster, RedisServer, TestConfig, redis_cli, wait_for, wait_for_or_show,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use zdelay::client::{Client, NewJob, OnConflict};
use zdelay::config::RedisConfig;

const SHARDS: u16 = 4;
const LIST: &str = "q:a";
const CONSUMER_NAME: &str = "zdelay-test-consumer";
/// How long after its enqueue a job is due: jobs fall due all through an episode.
const DUE_AFTER_MS: i64 = 300;
/// The bound the issue sets: deliveries resume within this of Redis answering normally.
const RECOVERY: Duration = Duration::from_secs(1);

const ROUTE: &str = r#"
[[routes]]
name = "a"
sink = "local"
target = "q:a"
"#;

fn local_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// What became of one enqueue.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    /// Acknowledged: must arrive exactly once.
    Acked,
    /// Refused with a server error (BUSY, LOADING, OOM): nothing was written, must not arrive.
    Refused(String),
    /// No answer (the connection was cut): may have been written, so arrives at most once.
    Unknown(String),
}

/// A producer enqueueing `per_tick` jobs every 5 ms, each due [`DUE_AFTER_MS`] later, as
/// `p<i>:<due ms>`, recording each outcome; and a consumer popping the list, recording when
/// each payload arrived.
struct Traffic {
    stop_producer: Arc<AtomicBool>,
    stop_consumer: Arc<AtomicBool>,
    sent: Arc<Mutex<Vec<(i64, Outcome)>>>,
    arrived: Arc<Mutex<Vec<(usize, i64, i64)>>>,
    producer: Option<JoinHandle<()>>,
    consumer: Option<JoinHandle<()>>,
}

type Connect = Box<dyn Fn() -> Option<Box<dyn redis::ConnectionLike>> + Send + Sync>;

impl Traffic {
    fn start(redis: RedisConfig, per_tick: usize, connect: Connect) -> Traffic {
        let stop_producer = Arc::new(AtomicBool::new(false));
        let stop_consumer = Arc::new(AtomicBool::new(false));
        let sent: Arc<Mutex<Vec<(i64, Outcome)>>> = Arc::default();
        let arrived: Arc<Mutex<Vec<(usize, i64, i64)>>> = Arc::default();
        let producer = std::thread::spawn({
            let (stop, sent) = (stop_producer.clone(), sent.clone());
            move || {
                let rt = common::runtime();
                let client = rt
                    .block_on(Client::connect(&redis))
                    .expect("producer connects");
                while !stop.load(Ordering::Relaxed) {
                    let due = local_now_ms() + DUE_AFTER_MS;
                    let first = sent.lock().expect("sent").len();
                    let jobs: Vec<NewJob> = (first..first + per_tick)
                        .map(|i| NewJob::new("a", format!("p{i}:{due}")).at(due))
                        .collect();
                    let reply = rt.block_on(async {
                        tokio::time::timeout(
                            Duration::from_secs(15),
                            client.enqueue_batch(jobs, OnConflict::Error),
                        )
                        .await
                    });
                    let outcomes: Vec<Outcome> = match reply {
                        Ok(Ok(results)) => results
                            .into_iter()
                            .map(|r| match r {
                                Ok(_) => Outcome::Acked,
                                Err(e) => Outcome::Refused(e.to_string()),
                            })
                            .collect(),
                        Ok(Err(e)) => {
                            let outcome = match &e {
                                zdelay::client::ClientError::Store(
                                    zdelay::store::StoreError::Redis(r),
                                ) if r.code().is_some() => Outcome::Refused(e.to_string()),
                                _ => Outcome::Unknown(e.to_string()),
                            };
                            vec![outcome; per_tick]
                        }
                        Err(_) => vec![Outcome::Unknown("timed out".into()); per_tick],
                    };
                    sent.lock()
                        .expect("sent")
                        .extend(outcomes.into_iter().map(|o| (due, o)));
                    // The producer's pace, not a wait for a condition.
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        });
        let consumer = std::thread::spawn({
            let (stop, arrived) = (stop_consumer.clone(), arrived.clone());
            move || {
                let mut con: Option<Box<dyn redis::ConnectionLike>> = None;
                while !stop.load(Ordering::Relaxed) {
                    let Some(c) = con.as_mut() else {
                        con = connect();
                        if let Some(c) = con.as_mut() {
                            // Spared by the CLIENT KILL test: a reply RPOP loses on a cut
                            // connection is the consumer's loss, not the daemon's.
                            let _ = redis::cmd("CLIENT")
                                .arg("SETNAME")
                                .arg(CONSUMER_NAME)
                                .query::<()>(c.as_mut());
                        }
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    };
                    let popped: redis::RedisResult<Option<Vec<String>>> =
                        redis::cmd("RPOP").arg(LIST).arg(1000).query(c.as_mut());
                    let now = local_now_ms();
                    match popped {
                        Ok(Some(payloads)) => {
                            let mut arrived = arrived.lock().expect("arrived");
                            for p in payloads {
                                let (i, due) = p
                                    .strip_prefix('p')
                                    .and_then(|p| p.split_once(':'))
                                    .and_then(|(i, due)| Some((i.parse().ok()?, due.parse().ok()?)))
                                    .unwrap_or_else(|| panic!("foreign payload {p:?}"));
                                arrived.push((i, due, now));
                            }
                        }
                        Ok(None) => std::thread::sleep(Duration::from_millis(2)),
                        Err(e) => {
                            if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() {
                                con = None;
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                }
            }
        });
        Traffic {
            stop_producer,
            stop_consumer,
            sent,
            arrived,
            producer: Some(producer),
            consumer: Some(consumer),
        }
    }

    fn arrived(&self) -> usize {
        self.arrived.lock().expect("arrived").len()
    }

    fn outcomes(&self) -> Vec<(i64, Outcome)> {
        self.sent.lock().expect("sent").clone()
    }

    /// Stops the producer, waits until every acknowledged job arrived, stops the consumer;
    /// then checks every job: acknowledged ones exactly once, refused ones never, unanswered
    /// ones at most once, none before it was due.
    fn finish(mut self, context: impl Fn() -> String) -> BTreeMap<&'static str, usize> {
        self.stop_producer.store(true, Ordering::Relaxed);
        self.producer
            .take()
            .expect("producer")
            .join()
            .expect("producer");
        let sent = self.outcomes();
        let acked = sent.iter().filter(|(_, o)| *o == Outcome::Acked).count();
        let arrived_acked = || {
            let arrived = self.arrived.lock().expect("arrived");
            let mut seen = vec![false; sent.len()];
            for (i, _, _) in arrived.iter() {
                if *i < sent.len() && sent[*i].1 == Outcome::Acked {
                    seen[*i] = true;
                }
            }
            seen.iter().filter(|s| **s).count()
        };
        wait_for_or_show(
            "every acknowledged job to arrive",
            Duration::from_secs(30),
            || arrived_acked() == acked,
            || format!("{} of {acked} arrived\n{}", arrived_acked(), context()),
        );
        // Whatever was written without an answer has had as long to arrive.
        std::thread::sleep(Duration::from_millis(300));
        self.stop_consumer.store(true, Ordering::Relaxed);
        self.consumer
            .take()
            .expect("consumer")
            .join()
            .expect("consumer");

        let arrived = self.arrived.lock().expect("arrived").clone();
        let mut times = vec![0u32; sent.len()];
        let mut early = Vec::new();
        for &(i, due, at) in &arrived {
            assert!(i < sent.len(), "p{i} arrived but was never sent");
            assert_eq!(due, sent[i].0, "p{i}'s due time");
            times[i] += 1;
            if at < due {
                early.push(format!("p{i} {} ms early", due - at));
            }
        }
        assert!(early.is_empty(), "jobs arrived early: {early:?}");
        let mut tally: BTreeMap<&'static str, usize> = BTreeMap::new();
        for (i, (_, outcome)) in sent.iter().enumerate() {
            let (label, ok) = match outcome {
                Outcome::Acked => ("acked", times[i] == 1),
                Outcome::Refused(_) => ("refused", times[i] == 0),
                Outcome::Unknown(_) => ("unanswered", times[i] <= 1),
            };
            assert!(ok, "p{i} ({outcome:?}) arrived {} times", times[i]);
            *tally.entry(label).or_default() += 1;
        }
        tally
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop_producer.store(true, Ordering::Relaxed);
        self.stop_consumer.store(true, Ordering::Relaxed);
    }
}

/// The due set of route `a`'s lane, in the slot of its list.
fn lane_due() -> String {
    use zdelay::keys::{LaneKeys, slot_of, slot_tag};
    LaneKeys::new("zdelay", slot_tag(slot_of(LIST)), "a").due
}

/// Jobs due by `at_ms` and not moved yet, in route `a`'s lane; `None` when Redis does not
/// answer.
fn backlog(con: &mut dyn redis::ConnectionLike, at_ms: i64) -> Option<usize> {
    redis::cmd("ZCOUNT")
        .arg(lane_due())
        .arg("-inf")
        .arg(at_ms)
        .query::<usize>(con)
        .ok()
}

/// How a fault went: when Redis answered normally again, and what was waiting then.
struct Episode {
    /// Local epoch ms when Redis answered normally again.
    ok_ms: i64,
    ok_at: Instant,
}

impl Episode {
    fn now() -> Episode {
        Episode {
            ok_ms: local_now_ms(),
            ok_at: Instant::now(),
        }
    }
}

/// Waits until every job due when Redis answered normally again has been moved, and asserts
/// it took at most [`RECOVERY`]; returns (jobs waiting then, time taken).
fn assert_recovered_in_time(
    episode: &Episode,
    mut con: impl FnMut() -> Option<Box<dyn redis::ConnectionLike>>,
    daemon: &Daemon,
) -> (usize, Duration) {
    let mut waiting_then = None;
    let mut c = None;
    loop {
        if c.is_none() {
            c = con();
        }
        let left = c.as_mut().and_then(|c| backlog(c.as_mut(), episode.ok_ms));
        if left.is_none() {
            c = None;
        }
        if waiting_then.is_none() {
            waiting_then = left;
        }
        if left == Some(0) {
            break;
        }
        assert!(
            episode.ok_at.elapsed() < RECOVERY * 10,
            "{left:?} jobs due {:?} ago still not moved; daemon log:\n{}",
            episode.ok_at.elapsed(),
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = episode.ok_at.elapsed();
    let waiting = waiting_then.unwrap_or_default();
    eprintln!("{waiting} jobs were due when redis answered again; all moved after {took:?}");
    assert!(
        took <= RECOVERY,
        "the {waiting} jobs due when redis answered normally again took {took:?} to move \
         (bound {RECOVERY:?}); daemon log:\n{}",
        daemon.log_text()
    );
    (waiting, took)
}

/// What a fault's log must show, from [`assert_one_line_per_episode`].
#[derive(Clone, Copy, PartialEq)]
enum Episodes {
    /// One episode: one "recovering from error" warning, then one "recovered" line.
    One,
    /// That, or no line at all (a fault the daemon rode out without an error).
    OneOrNone,
    /// No line, or episodes one after another, each its warning then its "recovered": faults
    /// repeated over longer than an episode's settling second, some of which the daemon rides
    /// out, may leave a quiet second between two errors, and then they are two episodes.
    EachOnce,
}

/// The daemon's log from byte `from` on: each episode has one "recovering from error" warning
/// and one "recovered" line after it, no other warning or error, as `expect` says.
fn assert_one_line_per_episode(daemon: &Daemon, from: usize, expect: Episodes) {
    // zdelay's own lines: the Redis client library logs its cluster slot refreshes itself.
    let tail = || {
        daemon
            .log_text()
            .get(from..)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(" zdelay"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let is_warning = |l: &str| l.contains(" WARN ") || l.contains(" ERROR ");
    let is_recovered = |l: &str| l.contains(" recovered ");
    if expect != Episodes::One && !tail().lines().any(is_warning) {
        eprintln!("no error at all: nothing to log");
        return;
    }
    wait_for_or_show(
        "each episode's \"recovered\" line",
        Duration::from_secs(20),
        || {
            let text = tail();
            let recovered = text.lines().filter(|l| is_recovered(l)).count();
            recovered >= 1 && recovered >= text.lines().filter(|l| is_warning(l)).count()
        },
        tail,
    );
    let text = tail();
    // In the order written: warning, recovered, warning, recovered…
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| is_warning(l) || is_recovered(l))
        .collect();
    eprintln!("episode log:\n{}", lines.join("\n"));
    let episodes = lines.len() / 2;
    assert!(
        lines.len().is_multiple_of(2)
            && lines.chunks(2).all(|pair| {
                pair[0].contains(" WARN ")
                    && pair[0].contains("recovering from error")
                    && is_recovered(pair[1])
            }),
        "one warning for each episode, then its recovered line:\n{}",
        lines.join("\n")
    );
    if expect != Episodes::EachOnce {
        assert_eq!(episodes, 1, "one episode:\n{text}");
    }
}

fn single_config(redis: &RedisServer) -> TestConfig {
    TestConfig::new(&redis.url(), SHARDS, ROUTE)
}

fn connector(url: String) -> Connect {
    Box::new(move || {
        let client = redis::Client::open(url.as_str()).ok()?;
        let con = client
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()?;
        con.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        Some(Box::new(con) as Box<dyn redis::ConnectionLike>)
    })
}

/// Starts the daemon and the traffic on `redis`, and waits for jobs to flow.
fn steady(redis: &RedisServer, per_tick: usize) -> (TestConfig, Daemon, Traffic) {
    let config = single_config(redis);
    let daemon = Daemon::start(&config);
    let traffic = Traffic::start(
        common::redis_config(&redis.url(), SHARDS),
        per_tick,
        connector(redis.url()),
    );
    wait_for_or_show(
        "jobs flowing",
        Duration::from_secs(15),
        || traffic.arrived() >= 20,
        || daemon.log_text(),
    );
    (config, daemon, traffic)
}

/// Another client's script runs `secs` seconds: Redis answers BUSY to everyone else until
/// it is killed.
fn busy_for(secs: u64) {
    let redis = RedisServer::start_with(&["--busy-reply-threshold", "100"]);
    let (_config, daemon, traffic) = steady(&redis, 1);
    let log_from = daemon.log_text().len();

    let url = redis.url();
    let busy = std::thread::spawn(move || {
        let mut con = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect");
        // Runs until killed (or 20 s, so it cannot outlive the test).
        let script = "local t = redis.call('TIME'); local start = t[1] * 1000000 + t[2]; \
                      repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > 20000000";
        redis::cmd("EVAL")
            .arg(script)
            .arg(0)
            .query::<()>(&mut con)
            .expect_err("the script is killed")
    });
    let mut con = redis.conn();
    wait_for("redis to answer BUSY", Duration::from_secs(5), || {
        redis::cmd("PING")
            .query::<String>(&mut con)
            .is_err_and(|e| e.code() == Some("BUSY"))
    });
    let started = Instant::now();
    wait_for("the script's time", Duration::from_secs(secs + 5), || {
        started.elapsed() >= Duration::from_secs(secs)
    });
    redis::cmd("SCRIPT")
        .arg("KILL")
        .query::<()>(&mut con)
        .expect("SCRIPT KILL");
    let episode = Episode::now();
    let killed = busy.join().expect("busy thread");
    assert!(killed.to_string().contains("killed"), "{killed}");

    assert_recovered_in_time(&episode, || (connector(redis.url()))(), &daemon);
    let tally = traffic.finish(|| daemon.log_text());
    eprintln!("busy {secs} s: {tally:?}");
    assert!(
        tally.get("refused").copied().unwrap_or_default() > 0,
        "BUSY refused enqueues"
    );
    assert_one_line_per_episode(&daemon, log_from, Episodes::One);
}

/// The issue's 6 s: longer than the poller slots' lease (5 s), so the daemon must take its
/// shards back as soon as Redis answers.
#[test]
fn busy_redis_another_clients_script_6s() {
    busy_for(6);
}

/// 4 s: the slots stay leased; the movers' own retries must not have backed off past the end.
#[test]
fn busy_redis_another_clients_script_4s() {
    busy_for(4);
}

/// Writes `keys` filler strings (`fill:<i>`, 64 bytes each) in script calls of 100k: a dataset
/// that takes Redis seconds to load.
fn fill(con: &mut redis::Connection, keys: usize) {
    let script = "for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do \
                  redis.call('SET', 'fill:' .. i, string.rep('x', 64)) end";
    for first in (0..keys).step_by(100_000) {
        redis::cmd("EVAL")
            .arg(script)
            .arg(0)
            .arg(first)
            .arg((first + 100_000).min(keys) - 1)
            .query::<()>(con)
            .expect("fill");
    }
}

/// Redis restarted (saved on shutdown, so nothing acknowledged is lost) with a dataset that
/// takes seconds to load: it answers LOADING until it has read it.
#[test]
fn loading_redis_restarted_with_a_large_dataset() {
    let mut redis = RedisServer::start();
    fill(&mut redis.conn(), 1_000_000);
    let (_config, daemon, traffic) = steady(&redis, 1);
    let log_from = daemon.log_text().len();

    // 1M keys take Redis seconds to load (2 to 5 s on 2 loaded cores).
    redis.restart_from_save(&[]);
    let restarted = Instant::now();
    let mut loading_seen = false;
    let connect = connector(redis.url());
    wait_for(
        "redis to answer PING again",
        Duration::from_secs(60),
        || {
            let Some(mut con) = connect() else {
                return false;
            };
            match redis::cmd("PING").query::<String>(con.as_mut()) {
                Ok(_) => true,
                Err(e) => {
                    loading_seen |= e.code() == Some("LOADING");
                    false
                }
            }
        },
    );
    let episode = Episode::now();
    eprintln!("restarted and loaded in {:?}", restarted.elapsed());
    assert!(loading_seen, "redis never answered LOADING");

    assert_recovered_in_time(&episode, || (connector(redis.url()))(), &daemon);
    let tally = traffic.finish(|| daemon.log_text());
    eprintln!("loading: {tally:?}");
    assert_one_line_per_episode(&daemon, log_from, Episodes::One);
}

/// `maxmemory` reached (noeviction): enqueues are refused with Redis's OOM error, the jobs
/// already due stay due (their moves cannot push), and once `maxmemory` is raised they all
/// arrive.
#[test]
fn oom_redis_maxmemory_reached() {
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"]);
    let (_config, daemon, traffic) = steady(&redis, 1);
    let log_from = daemon.log_text().len();

    let mut con = redis.conn();
    let set_maxmemory = |con: &mut redis::Connection, bytes: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query::<()>(con)
            .expect("CONFIG SET maxmemory");
    };
    set_maxmemory(&mut con, "1");
    let full_at = Instant::now();
    let refused = |traffic: &Traffic| {
        traffic
            .outcomes()
            .iter()
            .filter(|(_, o)| matches!(o, Outcome::Refused(_)))
            .count()
    };
    wait_for("enqueues refused", Duration::from_secs(10), || {
        refused(&traffic) > 0
    });
    // Jobs enqueued before fall due meanwhile and cannot be pushed.
    let arrived_before = traffic.arrived();
    wait_for("3 s of OOM", Duration::from_secs(10), || {
        full_at.elapsed() >= Duration::from_secs(3)
    });
    let due_now = backlog(&mut con, local_now_ms()).expect("ZCOUNT");
    assert!(
        due_now > 0,
        "jobs fell due during the OOM and are still due"
    );
    eprintln!(
        "oom: {} jobs arrived during it (moves that ran before the script's first refused \
         write), {due_now} still due",
        traffic.arrived() - arrived_before
    );
    set_maxmemory(&mut con, "0");
    let episode = Episode::now();

    assert_recovered_in_time(&episode, || (connector(redis.url()))(), &daemon);
    let reasons: Vec<String> = traffic
        .outcomes()
        .into_iter()
        .filter_map(|(_, o)| match o {
            Outcome::Refused(why) => Some(why),
            _ => None,
        })
        .collect();
    assert!(
        reasons.iter().all(|r| r.contains("OOM")),
        "refused enqueues say why: {reasons:?}"
    );
    let tally = traffic.finish(|| daemon.log_text());
    eprintln!("oom: {tally:?}");
    assert_one_line_per_episode(&daemon, log_from, Episodes::One);
}

/// `CLIENT KILL TYPE normal` ten times, 200 ms apart, while jobs flow at a few thousand a
/// second: the daemon's connections (and the producer's) are cut, mid-batch or between
/// batches. The consumer's is spared: an RPOP whose reply is cut loses what it popped, which
/// no daemon can help.
#[test]
fn client_kill_of_the_daemons_connections_mid_batch() {
    let redis = RedisServer::start();
    let (_config, daemon, traffic) = steady(&redis, 20);
    let log_from = daemon.log_text().len();

    let mut con = redis.conn();
    let mut killed = 0;
    for round in 0..10 {
        let round_start = Instant::now();
        killed += kill_clients_but_the_consumer(&mut con);
        if round < 9 {
            wait_for("the next round", Duration::from_secs(2), || {
                round_start.elapsed() >= Duration::from_millis(200)
            });
        }
    }
    let episode = Episode::now();
    eprintln!("client kill: {killed} connections cut");
    assert!(killed >= 10, "the daemon's connections were cut");

    assert_recovered_in_time(&episode, || (connector(redis.url()))(), &daemon);
    let tally = traffic.finish(|| daemon.log_text());
    eprintln!("client kill: {tally:?}");
    // A lane's move is one short call: a cut between two calls is mended by the reconnect
    // before the next, so the daemon may ride out every kill without an error to log, or
    // ride out enough of them in a row to end one episode before the next kill's error.
    assert_one_line_per_episode(&daemon, log_from, Episodes::EachOnce);
}

/// `CLIENT KILL`s every normal connection but this one and the test consumer's; returns how
/// many were cut.
fn kill_clients_but_the_consumer(con: &mut redis::Connection) -> u64 {
    let me: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query(con)
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query(con)
        .expect("CLIENT LIST");
    let mut killed = 0;
    for line in list.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or("")
        };
        let id: i64 = field("id").parse().unwrap_or(me);
        if id == me || field("name") == CONSUMER_NAME {
            continue;
        }
        killed += redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query::<u64>(con)
            .unwrap_or(0);
    }
    killed
}

/// The node ids and ports of a cluster's nodes, and which master each replica follows.
fn cluster_nodes(port: u16) -> Vec<(String, u16, bool, String)> {
    let text = redis_cli(port, &["CLUSTER", "NODES"]).expect("CLUSTER NODES");
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
            let is_master = f.get(2)?.contains("master");
            Some((f[0].to_owned(), port, is_master, f.get(3)?.to_string()))
        })
        .collect()
}

/// A replica promoted by `CLUSTER FAILOVER` (the manual failover, which loses nothing) while
/// the daemon moves jobs from the lane its master served.
#[test]
fn replica_promoted_in_a_cluster() {
    let cluster = RedisCluster::start();
    let config = cluster.config(SHARDS, ROUTE);
    let daemon = Daemon::start(&config);
    let seeds = cluster.seeds();
    let traffic = Traffic::start(
        cluster.redis_config(SHARDS),
        1,
        Box::new(move || {
            let con = redis::cluster::ClusterClient::new(seeds.clone())
                .ok()?
                .get_connection()
                .ok()?;
            Some(Box::new(con) as Box<dyn redis::ConnectionLike>)
        }),
    );
    wait_for_or_show(
        "jobs flowing",
        Duration::from_secs(15),
        || traffic.arrived() >= 20,
        || daemon.log_text(),
    );
    let log_from = daemon.log_text().len();

    let master = cluster.master_of(&lane_due());
    // The replica is known to its master once their link is up: wait for it.
    let mut replica = None;
    wait_for(
        "the master's replica known",
        Duration::from_secs(15),
        || {
            let nodes = cluster_nodes(master);
            let master_id = nodes.iter().find(|n| n.1 == master).map(|n| n.0.clone());
            replica = nodes
                .iter()
                .find(|n| !n.2 && Some(&n.3) == master_id.as_ref())
                .map(|n| n.1);
            replica.is_some()
        },
    );
    let replica = replica.expect("its replica");
    // A manual failover that cannot finish in Redis's own 5 s (the replica catching up, the
    // masters' votes) is dropped by Redis without a word: ask again, as an operator would.
    let promoted = || cluster.master_serving(&lane_due()) == Ok(replica);
    for attempt in 1..=3 {
        let out = redis_cli(replica, &["CLUSTER", "FAILOVER"]).expect("CLUSTER FAILOVER");
        if !out.contains("OK") {
            // Refused only by a node that is no longer a replica: the last attempt finished.
            assert!(attempt > 1 && promoted(), "{out}");
            break;
        }
        let asked = Instant::now();
        while !promoted() && asked.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if promoted() {
            break;
        }
        eprintln!("failover attempt {attempt} not finished in 10 s");
    }
    assert!(
        promoted(),
        "the replica was not promoted after 3 attempts\n{}",
        cluster.log_tails(20)
    );
    cluster.wait_ok();
    let episode = Episode::now();

    let seeds = cluster.seeds();
    assert_recovered_in_time(
        &episode,
        || {
            let con = redis::cluster::ClusterClient::new(seeds.clone())
                .ok()?
                .get_connection()
                .ok()?;
            Some(Box::new(con) as Box<dyn redis::ConnectionLike>)
        },
        &daemon,
    );
    let tally = traffic.finish(|| daemon.log_text());
    eprintln!("failover: {tally:?}");
    assert_one_line_per_episode(&daemon, log_from, Episodes::OneOrNone);
}
