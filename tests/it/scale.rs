//! Several daemons on one namespace, and a Redis Cluster under faults: poller slots shared
//! evenly, taken over when an instance dies, rebalanced when one joins or stops; an instance
//! stalled past its lease is harmless; one restarted under its stable instance id polls at
//! once, and a second one started with a running one's id refuses; a master killed, a script
//! cache flushed and a hung master are recovered from. Every job is counted: none lost, duplicates (two-phase routes
//! only) reported and bounded.

use crate::common::{
    Daemon, RedisCluster, RedisServer, TestConfig, runtime, wait_for, wait_for_or_show,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use zdelay::config::RedisConfig;
use zdelay::{Client, NewJob, OnConflict};

/// Producers enqueueing through the library until stopped: `per_tick` jobs every 20 ms to
/// `route`, payload `<tag>-<seq>`, due 0–199 ms later.
struct Load {
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    last_error: Arc<std::sync::Mutex<String>>,
    handle: std::thread::JoinHandle<LoadResult>,
}

struct LoadResult {
    /// Payloads whose enqueue the library acknowledged, with when (since the load started).
    accepted: Vec<(String, Duration)>,
    /// Batches refused with an error (not acknowledged, so not expected anywhere).
    errors: Vec<String>,
}

impl Load {
    fn start(redis: RedisConfig, route: &str, tag: &str, per_tick: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let last_error = Arc::new(std::sync::Mutex::new(String::new()));
        let (route, tag) = (route.to_owned(), tag.to_owned());
        let handle = std::thread::spawn({
            let (stop, count, last) = (stop.clone(), accepted.clone(), last_error.clone());
            move || {
                let rt = runtime();
                let client = rt
                    .block_on(Client::connect(&redis))
                    .expect("producer connects");
                let started = Instant::now();
                let mut result = LoadResult {
                    accepted: Vec::new(),
                    errors: Vec::new(),
                };
                let mut seq = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let payloads: Vec<String> = (seq..seq + per_tick)
                        .map(|i| format!("{tag}-{i}"))
                        .collect();
                    let jobs = payloads
                        .iter()
                        .enumerate()
                        .map(|(i, p)| {
                            NewJob::new(&route, p.clone())
                                .after(Duration::from_millis(((seq + i) % 200) as u64))
                        })
                        .collect();
                    seq += per_tick;
                    let sent = rt.block_on(async {
                        tokio::time::timeout(
                            Duration::from_secs(15),
                            client.enqueue_batch(jobs, OnConflict::Error),
                        )
                        .await
                    });
                    match sent {
                        Ok(Ok(replies)) => {
                            for (payload, reply) in payloads.into_iter().zip(replies) {
                                match reply {
                                    Ok(_) => result.accepted.push((payload, started.elapsed())),
                                    Err(e) => result.errors.push(e.to_string()),
                                }
                            }
                        }
                        Ok(Err(e)) => result.errors.push(e.to_string()),
                        Err(_) => result.errors.push("enqueue timed out".into()),
                    }
                    count.store(result.accepted.len(), Ordering::Relaxed);
                    if let Some(e) = result.errors.last() {
                        let mut last = last.lock().expect("last error");
                        if !last.contains(e.as_str()) {
                            last.push_str(&format!("\n{:?}: {e}", started.elapsed()));
                        }
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                result
            }
        });
        Load {
            stop,
            accepted,
            last_error,
            handle,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    fn last_error(&self) -> String {
        self.last_error.lock().expect("last error").clone()
    }

    fn finish(self) -> LoadResult {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("producer thread")
    }
}

/// `zdelay stats --json`'s instances: id → shards it polls.
fn instances(config: &TestConfig) -> BTreeMap<String, Vec<u16>> {
    let out = config.cli(&["stats", "--json"]);
    if !out.status.success() {
        return BTreeMap::new();
    }
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
    stats["instances"]
        .as_array()
        .expect("an instances array")
        .iter()
        .map(|i| {
            assert!(i["last_seen_ms"].as_i64().is_some(), "{i}");
            let shards = i["shards"]
                .as_array()
                .expect("shards")
                .iter()
                .map(|s| s.as_u64().expect("shard number") as u16)
                .collect();
            (i["id"].as_str().expect("id").to_owned(), shards)
        })
        .collect()
}

/// `n` live instances; each of `shards` polled by `per_shard` of them; nobody above its
/// fair share ⌈slots / n⌉.
fn balanced(config: &TestConfig, n: usize, shards: u16, per_shard: usize) -> bool {
    let seen = instances(config);
    let fair = (shards as usize * per_shard).div_ceil(n.max(1));
    let mut pollers: BTreeMap<u16, usize> = BTreeMap::new();
    for owned in seen.values() {
        for &s in owned {
            *pollers.entry(s).or_default() += 1;
        }
    }
    seen.len() == n
        && seen.values().all(|owned| owned.len() <= fair)
        && (0..shards).all(|s| pollers.get(&s) == Some(&per_shard.min(n)))
}

/// Waits until `balanced`, saying what the instances poll if it never is.
fn wait_balanced(config: &TestConfig, n: usize, shards: u16, per_shard: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while !balanced(config, n, shards, per_shard) {
        assert!(
            Instant::now() < deadline,
            "not {n} instances polling each of {shards} shards {per_shard}× within {within:?}: {:?}",
            instances(config)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How often each payload arrived.
fn counts(items: Vec<Vec<u8>>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for item in items {
        *out.entry(String::from_utf8(item).expect("utf-8 payload"))
            .or_default() += 1;
    }
    out
}

/// Checks every accepted payload arrived; returns (duplicates, the first few missing).
fn tally(accepted: &[(String, Duration)], got: &BTreeMap<String, usize>) -> (usize, Vec<String>) {
    let missing: Vec<String> = accepted
        .iter()
        .filter(|(p, _)| !got.contains_key(p))
        .map(|(p, _)| p.clone())
        .collect();
    let duplicates = got.values().map(|n| n - 1).sum();
    (duplicates, missing)
}

/// The list's items; none while the cluster cannot answer (a node hung or failing over).
fn lrange(con: &mut dyn redis::ConnectionLike, key: &str) -> Vec<Vec<u8>> {
    redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(con)
        .unwrap_or_default()
}

const CLUSTER_SHARDS: u16 = 16;

/// Route `a` to list `q:a`: on a cluster with shards in many slots, two-phase through the
/// local sink (at least once).
fn cluster_config(cluster: &RedisCluster, poller: &str) -> TestConfig {
    cluster.config(
        CLUSTER_SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
{poller}

[[routes]]
name = "a"
sink = "local"
target = "q:a"
push = "rpush"
"#
        ),
    )
}

#[test]
fn three_instances_share_the_shards_take_over_a_killed_one_and_rebalance_on_join() {
    let cluster = RedisCluster::start();
    let lease = Duration::from_secs(2);
    let config = cluster_config(&cluster, "slot_lease = \"2s\"\nlease = \"2s\"");
    let mut daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start_instance(&config)).collect();
    wait_balanced(&config, 3, CLUSTER_SHARDS, 1, Duration::from_secs(10));
    let load = Load::start(cluster.redis_config(CLUSTER_SHARDS), "a", "j", 10);
    let mut con = cluster.conn();
    wait_for("jobs flowing", Duration::from_secs(10), || {
        lrange(&mut con, "q:a").len() > 300
    });

    let mut killed = daemons.remove(1);
    killed.kill9();
    let at = Instant::now();
    wait_balanced(&config, 2, CLUSTER_SHARDS, 1, lease * 3);
    let takeover = at.elapsed();

    let before = load.accepted();
    daemons.push(Daemon::start_instance(&config));
    let at = Instant::now();
    wait_balanced(&config, 3, CLUSTER_SHARDS, 1, lease * 3);
    let rebalance = at.elapsed();
    wait_for("more jobs accepted", Duration::from_secs(10), || {
        load.accepted() > before + 500
    });
    let result = load.finish();
    wait_for(
        "every accepted job delivered",
        Duration::from_secs(30),
        || {
            let got = counts(lrange(&mut con, "q:a"));
            tally(&result.accepted, &got).1.is_empty()
        },
    );
    // Late duplicates of the killed instance's claims arrive within one job lease.
    std::thread::sleep(lease);
    let got = counts(lrange(&mut con, "q:a"));
    let (duplicates, missing) = tally(&result.accepted, &got);
    eprintln!(
        "3 instances on a cluster: {} jobs accepted ({} refused), {} delivered, {duplicates} \
         duplicates, takeover after kill -9 in {takeover:?}, rebalance on join in {rebalance:?}",
        result.accepted.len(),
        result.errors.len(),
        got.len()
    );
    assert!(
        missing.is_empty(),
        "lost: {:?}",
        &missing[..missing.len().min(5)]
    );
    assert!(result.errors.is_empty(), "{:?}", result.errors);
    // Only what the killed instance had claimed and not settled can come twice.
    assert!(
        duplicates <= 500,
        "{duplicates} duplicates: more than one killed instance's claims"
    );
    assert!(
        takeover <= lease + lease / 5 + Duration::from_millis(1500),
        "takeover took {takeover:?}, lease {lease:?}"
    );
    let owned: f64 = daemons
        .iter()
        .map(|d| d.metric("zdelay_owned_shards", &[]))
        .sum();
    assert_eq!(
        owned,
        f64::from(CLUSTER_SHARDS),
        "zdelay_owned_shards adds up"
    );
}

fn standalone_config(redis: &RedisServer, target: &RedisServer, poller: &str) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        8,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
{poller}

[sinks.other]
kind = "redis"
url = "{}"

[[routes]]
name = "l"
sink = "local"
target = "q:l"
push = "rpush"

[[routes]]
name = "m"
sink = "other"
target = "q:m"
push = "rpush"
"#,
            target.url()
        ),
    )
}

#[test]
fn two_pollers_per_shard_on_distinct_instances_and_a_graceful_stop_hands_back_at_once() {
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = standalone_config(&redis, &target, "per_shard = 2\nslot_lease = \"5s\"");
    let mut daemons: Vec<Daemon> = (0..3).map(|_| Daemon::start_instance(&config)).collect();
    wait_balanced(&config, 3, 8, 2, Duration::from_secs(10));
    let mut stopping = daemons.remove(0);
    stopping.signal(libc::SIGTERM);
    let at = Instant::now();
    assert!(stopping.wait_exit(Duration::from_secs(10)).success());
    wait_balanced(&config, 2, 8, 2, Duration::from_secs(5));
    let handover = at.elapsed();
    eprintln!("graceful stop: slots polled by the others {handover:?} after SIGTERM");
    // Well within the 5 s lease: the slots were handed back, not left to lapse.
    assert!(handover < Duration::from_secs(3), "{handover:?}");
}

#[cfg(feature = "test-failpoints")]
#[test]
fn an_instance_stalled_past_its_lease_delivers_nothing_twice_locally_and_is_fenced() {
    let redis = RedisServer::start();
    let target = RedisServer::start();
    let config = standalone_config(&redis, &target, "slot_lease = \"1s\"\nlease = \"1s\"");
    // The stalled instance publishes a two-phase batch and holds before settling it (until
    // the test lets go), then is stopped outright: its slot lease and its jobs' lease run out.
    let marker_dir = tempfile::tempdir().expect("temp dir");
    let release = marker_dir.path().join("release");
    let hold = format!("hold_after_publish={}", release.display());
    let port = crate::common::free_port();
    let listen = format!("127.0.0.1:{port}");
    let stalled = Daemon::spawn_with_env(
        &config,
        &[
            ("ZDELAY_FAILPOINT", hold.as_str()),
            ("ZDELAY_ADMIN__LISTEN", listen.as_str()),
        ],
    );
    let other = Daemon::start_instance(&config);
    wait_balanced(&config, 2, 8, 1, Duration::from_secs(10));
    let redis_config = RedisConfig {
        url: redis.url(),
        shards: 8,
        ..Default::default()
    };
    let local = Load::start(redis_config.clone(), "l", "l", 10);
    let remote = Load::start(redis_config, "m", "m", 10);
    let (mut con, mut tcon) = (redis.conn(), target.conn());
    wait_for("jobs flowing", Duration::from_secs(10), || {
        crate::common::llen(&mut tcon, "q:m") > 200 && crate::common::llen(&mut con, "q:l") > 200
    });
    wait_for(
        "the stalled instance holding a published batch",
        Duration::from_secs(10),
        || stalled.log_text().contains("failpoint hold_after_publish"),
    );
    stalled.signal(libc::SIGSTOP);
    wait_balanced(&config, 1, 8, 1, Duration::from_secs(10));
    // Its claims expire and the other instance delivers them again.
    std::thread::sleep(Duration::from_secs(2));
    std::fs::write(&release, b"go").expect("release the stalled instance");
    stalled.signal(libc::SIGCONT);
    wait_balanced(&config, 2, 8, 1, Duration::from_secs(10));
    crate::common::wait_for_or_show(
        "the stalled instance's late settle fenced",
        Duration::from_secs(10),
        || {
            crate::common::metric_value(
                &crate::common::http_get(port, "/metrics").map_or(String::new(), |r| r.1),
                "zdelay_fenced_settles_total",
                &[],
            )
            .unwrap_or(0.0)
                > 0.0
        },
        || stalled.log_text(),
    );
    let (local, remote) = (local.finish(), remote.finish());
    wait_for("every job delivered", Duration::from_secs(30), || {
        tally(
            &local.accepted,
            &counts(crate::common::lrange(&mut con, "q:l")),
        )
        .1
        .is_empty()
            && tally(
                &remote.accepted,
                &counts(crate::common::lrange(&mut tcon, "q:m")),
            )
            .1
            .is_empty()
    });
    std::thread::sleep(Duration::from_secs(2));
    let (local_dups, _) = tally(
        &local.accepted,
        &counts(crate::common::lrange(&mut con, "q:l")),
    );
    let (remote_dups, _) = tally(
        &remote.accepted,
        &counts(crate::common::lrange(&mut tcon, "q:m")),
    );
    let metrics = crate::common::http_get(port, "/metrics").map_or(String::new(), |r| r.1);
    let fenced = crate::common::metric_value(&metrics, "zdelay_fenced_settles_total", &[])
        .unwrap_or(0.0)
        + other.metric("zdelay_fenced_settles_total", &[]);
    eprintln!(
        "stalled past the lease: local {} jobs, {local_dups} duplicates; two-phase {} jobs, \
         {remote_dups} duplicates, {fenced} settles fenced",
        local.accepted.len(),
        remote.accepted.len()
    );
    assert_eq!(local_dups, 0, "a local list never gets a job twice");
    assert!(
        remote_dups >= 1,
        "the held batch was delivered again by the other instance"
    );
    assert!(
        remote_dups as f64 <= fenced,
        "every two-phase duplicate comes from a claim whose settle was fenced"
    );
}

/// Each master and the spread shards it serves.
fn shard_masters(cluster: &RedisCluster) -> BTreeMap<u16, BTreeSet<u16>> {
    let keys = zdelay::keys::Keys::new("zdelay", CLUSTER_SHARDS);
    let mut by_master: BTreeMap<u16, BTreeSet<u16>> = BTreeMap::new();
    for s in 0..CLUSTER_SHARDS {
        by_master
            .entry(cluster.master_of(&keys.due(s)))
            .or_default()
            .insert(s);
    }
    by_master
}

#[test]
fn a_killed_master_is_replaced_by_its_replica_and_the_daemon_recovers() {
    let mut cluster = RedisCluster::start();
    let config = cluster_config(&cluster, "lease = \"2s\"");
    let daemon = Daemon::start(&config);
    let load_started = Instant::now();
    let load = Load::start(cluster.redis_config(CLUSTER_SHARDS), "a", "f", 10);
    let mut con = cluster.conn();
    wait_for("jobs flowing", Duration::from_secs(10), || {
        lrange(&mut con, "q:a").len() > 300
    });
    // The master of route a's lane: where every job of the load waits.
    let lane_due = crate::common::lane_keys("a", "q:a").due;
    let victim = cluster.master_of(&lane_due);
    let killed_at = Instant::now();
    // On the load's clock (which started a moment after `load_started`).
    let kill_offset = killed_at - load_started;
    cluster.kill(victim);
    // The survivors mark it failed, then its replica is promoted.
    wait_for("its replica promoted", Duration::from_secs(20), || {
        cluster
            .master_serving(&lane_due)
            .is_ok_and(|master| master != victim)
    });
    cluster.wait_ok();
    let failed_over = killed_at.elapsed();
    let before = load.accepted();
    let deadline = Instant::now() + Duration::from_secs(20);
    while load.accepted() <= before + 500 {
        assert!(
            Instant::now() < deadline,
            "the producer did not recover from the failover: {}\ndaemon log:\n{}",
            load.last_error(),
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let result = load.finish();
    let mut con = cluster.conn();
    let settled = |con: &mut redis::cluster::ClusterConnection| {
        let got = counts(lrange(con, "q:a"));
        tally(&result.accepted, &got)
    };
    // Jobs acknowledged after the failover completed must all arrive.
    let after_failover: Vec<(String, Duration)> = result
        .accepted
        .iter()
        .filter(|(_, at)| *at > failed_over + Duration::from_secs(1))
        .cloned()
        .collect();
    wait_for(
        "every job after the failover delivered",
        Duration::from_secs(30),
        || {
            tally(&after_failover, &counts(lrange(&mut con, "q:a")))
                .1
                .is_empty()
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    let (duplicates, missing) = settled(&mut con);
    eprintln!(
        "master killed: failover in {failed_over:?}; {} jobs accepted, {} refused during the \
         failover, {} lost (acknowledged, not replicated before the kill), {duplicates} duplicates",
        result.accepted.len(),
        result.errors.len(),
        missing.len()
    );
    wait_for("the daemon is ready again", Duration::from_secs(10), || {
        matches!(daemon.admin_get("/readyz"), Some((200, _)))
    });
    // Redis replicates asynchronously: an enqueue acknowledged in the last moment before the
    // kill can be lost with the master — and only such an enqueue. Every lost job must have
    // been acknowledged within the replication window around the kill (a second here: the
    // replica may be short of CPU on a busy 2-core machine), never long before it.
    let accepted_at: BTreeMap<&str, Duration> = result
        .accepted
        .iter()
        .map(|(p, at)| (p.as_str(), *at))
        .collect();
    let window = Duration::from_secs(1);
    let outside: Vec<(&String, Duration)> = missing
        .iter()
        .map(|p| (p, accepted_at[p.as_str()]))
        // (A batch is acknowledged once all its nodes answered: a moment after the kill.)
        .filter(|(_, at)| *at + window < kill_offset || *at > kill_offset + window)
        .collect();
    assert!(
        outside.is_empty(),
        "lost jobs acknowledged more than {window:?} away from the kill at {kill_offset:?}: \
         {outside:?}"
    );
}

#[test]
fn script_flush_on_every_node_mid_run_is_recovered_from() {
    let cluster = RedisCluster::start();
    let config = cluster_config(&cluster, "");
    let daemon = Daemon::start(&config);
    let load = Load::start(cluster.redis_config(CLUSTER_SHARDS), "a", "s", 20);
    let mut con = cluster.conn();
    for round in 0..3 {
        let delivered = lrange(&mut con, "q:a").len();
        wait_for("jobs flowing", Duration::from_secs(10), || {
            lrange(&mut con, "q:a").len() > delivered + 200
        });
        for &port in &cluster.ports {
            let flushed = crate::common::redis_cli(port, &["SCRIPT", "FLUSH"]);
            assert_eq!(
                flushed.as_deref().map(str::trim),
                Some("OK"),
                "round {round}"
            );
        }
    }
    let result = load.finish();
    wait_for("every job delivered", Duration::from_secs(30), || {
        tally(&result.accepted, &counts(lrange(&mut con, "q:a")))
            .1
            .is_empty()
    });
    let (duplicates, _) = tally(&result.accepted, &counts(lrange(&mut con, "q:a")));
    eprintln!(
        "SCRIPT FLUSH ×3 on all 6 nodes: {} jobs, {duplicates} duplicates",
        result.accepted.len()
    );
    assert!(
        result.errors.is_empty(),
        "the producer reloads too: {:?}",
        result.errors
    );
    assert_eq!(duplicates, 0, "a flushed script cache costs no redelivery");
    let dead: f64 = daemon.metric("zdelay_jobs_dead_total", &[]);
    assert_eq!(dead, 0.0);
}

/// A hung master (SIGSTOP) holding spread shards stalls neither a daemon's start-up nor the
/// spread shards on the other masters: their jobs go out as usual, and the hung master's
/// jobs once it answers. The route is two-phase (to another Redis), so its jobs wait in the
/// spread shards, by id.
#[test]
fn a_hung_master_stalls_neither_start_up_nor_the_shards_on_other_nodes() {
    // A node timeout longer than the test: the hung master is not failed over meanwhile.
    let cluster = RedisCluster::start_with(&["--cluster-node-timeout", "60000"]);
    let target = RedisServer::start();
    // A claim the publisher gave up on while the node hung still runs once it answers (the
    // command was already in its socket), with a lease from then on: its jobs come back when
    // that lease runs out. 5 s instead of the default 30 s keeps that within the wait below.
    let config = cluster.config(
        CLUSTER_SHARDS,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
lease = "5s"

[sinks.far]
kind = "redis"
url = "{}"

[[routes]]
name = "a"
sink = "far"
target = "q:a"
push = "rpush"
"#,
            target.url()
        ),
    );
    let keys = zdelay::keys::Keys::new("zdelay", CLUSTER_SHARDS);
    let by_master = shard_masters(&cluster);
    // Hang a master that holds spread shards but neither the schema (start-up reads it), the
    // daemons' registry nor the lane registry.
    let needed = [
        cluster.master_of("zdelay:schema"),
        cluster.master_of("{zdelay}:instances"),
        cluster.master_of(&keys.lanes()),
    ];
    let hung = *by_master
        .keys()
        .find(|m| !needed.contains(m))
        .expect("a master without the schema and the registries");
    let on_hung = |id: &str| by_master[&hung].contains(&keys.shard_of(id));
    let rt = runtime();
    // A producer with the config: it registers the route before any daemon runs.
    let client = config.client(&rt);
    let enqueue = |jobs: Vec<NewJob>| {
        for r in rt
            .block_on(client.enqueue_batch(jobs, OnConflict::Error))
            .expect("enqueued")
        {
            r.expect("enqueued");
        }
    };
    // Jobs on the master about to hang, due in a second: they wait for it.
    let waiting: Vec<String> = (0..1000)
        .map(|i| format!("w-{i}"))
        .filter(|id| on_hung(id))
        .take(50)
        .collect();
    enqueue(
        waiting
            .iter()
            .map(|id| {
                NewJob::new("a", id.clone())
                    .id(id.clone())
                    .after(Duration::from_secs(1))
            })
            .collect(),
    );
    let daemon = Daemon::start(&config);
    let mut far = target.conn();
    let pid = cluster.pid(hung) as i32;
    // SAFETY: kill(2) on our own child's pid; the cluster's drop sends SIGCONT.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_secs(2));

    // While it hangs, jobs of the other masters' shards go out as usual...
    let healthy: Vec<String> = (0..600)
        .map(|i| format!("h-{i}"))
        .filter(|id| !on_hung(id))
        .take(300)
        .collect();
    let at = Instant::now();
    enqueue(
        healthy
            .iter()
            .map(|id| NewJob::new("a", id.clone()).id(id.clone()))
            .collect(),
    );
    let enqueued_in = at.elapsed();
    wait_for(
        "jobs of shards on healthy masters delivered",
        Duration::from_secs(20),
        || {
            let got = counts(lrange(&mut far, "q:a"));
            healthy.iter().all(|p| got.contains_key(p))
        },
    );
    let delivered_in = at.elapsed();
    // ...and another instance starts.
    let at = Instant::now();
    let second = Daemon::start_instance(&config);
    let started_in = at.elapsed();

    unsafe { libc::kill(pid, libc::SIGCONT) };
    crate::common::wait_for_or_show(
        "the hung master's jobs delivered once it answers",
        Duration::from_secs(30),
        || {
            let got = counts(lrange(&mut far, "q:a"));
            waiting.iter().all(|p| got.contains_key(p))
        },
        || {
            let mut con = cluster.conn();
            let state: Vec<String> = by_master[&hung]
                .iter()
                .map(|&s| {
                    let mut size = |key: String, cmd: &str| -> i64 {
                        redis::cmd(cmd).arg(key).query(&mut con).unwrap_or(-1)
                    };
                    format!(
                        "shard {s}: due {} ready {} inflight {} jobs {}",
                        size(keys.due(s), "ZCARD"),
                        size(keys.ready(s), "ZCARD"),
                        size(keys.inflight(s), "ZCARD"),
                        size(keys.jobs(s), "HLEN")
                    )
                })
                .collect();
            format!(
                "{}\nstats: {}\nfirst:\n{}\nsecond:\n{}",
                state.join("\n"),
                String::from_utf8_lossy(&config.cli(&["stats"]).stdout),
                daemon.log_text(),
                second.log_text()
            )
        },
    );
    eprintln!(
        "master {hung} hung: {} jobs of the {} other shards enqueued in {enqueued_in:?}, \
         delivered in {delivered_in:?}; a second instance ready in {started_in:?}",
        healthy.len(),
        CLUSTER_SHARDS as usize - by_master[&hung].len()
    );
    assert!(
        delivered_in < Duration::from_secs(2),
        "{delivered_in:?}; the daemon's log:\n{}",
        daemon.log_text()
    );
    assert!(
        started_in < Duration::from_secs(10),
        "{started_in:?}; its log:\n{}",
        second.log_text()
    );
}

/// 8 shards routed to a local list, with `poller` lines added to `[poller]`.
fn identity_config(redis: &RedisServer, poller: &str) -> TestConfig {
    TestConfig::new(
        &redis.url(),
        8,
        &format!(
            r#"
[poller]
idle_poll = "50ms"
{poller}

[[routes]]
name = "l"
sink = "local"
target = "q:l"
"#
        ),
    )
}

/// `n` jobs due now on route `l` (spread over the 8 shards by their ids).
fn enqueue_due_now(redis: &RedisServer, n: usize) {
    let rt = runtime();
    let client = crate::common::client(&rt, &redis.url(), 8);
    let jobs = (0..n)
        .map(|i| NewJob::new("l", format!("job-{i}")))
        .collect();
    for reply in rt
        .block_on(client.enqueue_batch(jobs, OnConflict::Error))
        .expect("enqueue")
    {
        reply.expect("enqueued");
    }
}

fn all_shards(id: &str) -> BTreeMap<String, Vec<u16>> {
    BTreeMap::from([(id.to_owned(), (0..8).collect())])
}

/// Waits until one instance is registered, polling all 8 shards.
fn wait_one_instance_polling_all(config: &TestConfig) {
    wait_for(
        "one instance polling every shard",
        Duration::from_secs(10),
        || {
            let instances = instances(config);
            instances.len() == 1 && instances.values().all(|shards| shards.len() == 8)
        },
    );
}

/// A daemon with a stable `poller.instance_id`, killed with `kill -9` and started again at
/// once, takes its previous life's registration and slots at its first heartbeat: the jobs
/// that fell due meanwhile on every shard are delivered within a moment of the restart, not
/// after the dead life's slot lease (10 s here) ran out.
#[test]
fn a_daemon_restarted_after_kill_9_takes_its_shards_back_at_once() {
    let redis = RedisServer::start();
    let lease = Duration::from_secs(10);
    let config = identity_config(&redis, "instance_id = \"worker-1\"\nslot_lease = \"10s\"");
    let mut first = Daemon::start(&config);
    wait_one_instance_polling_all(&config);
    first.kill9();
    enqueue_due_now(&redis, 80);
    let restarted = Instant::now();
    let second = Daemon::spawn(&config);
    let mut con = redis.conn();
    wait_for_or_show(
        "every job due meanwhile delivered",
        lease * 2,
        || crate::common::llen(&mut con, "q:l") == 80,
        || second.log_text(),
    );
    let took = restarted.elapsed();
    eprintln!(
        "restarted after kill -9: all 8 shards polled {took:?} after the new process started"
    );
    // The new process starts, connects and heartbeats in well under a second; waiting out
    // the dead life's registration would take 8–10 s.
    assert!(
        took < Duration::from_secs(5),
        "the restarted daemon polled every shard only {took:?} after it started (slot lease \
         {lease:?})"
    );
    assert_eq!(
        instances(&config),
        all_shards("worker-1"),
        "one registration, the new process's"
    );
    assert!(
        second
            .log_text()
            .contains("took over this instance id's registration"),
        "{}",
        second.log_text()
    );
}

/// A second daemon started with the instance id of a running one refuses to run: it exits
/// with an error naming the id, and the first keeps its registration, its shards and its
/// deliveries.
#[test]
fn a_second_daemon_with_a_running_ones_instance_id_refuses() {
    let redis = RedisServer::start();
    let config = identity_config(&redis, "instance_id = \"worker-1\"\nslot_lease = \"2s\"");
    let mut first = Daemon::start(&config);
    wait_one_instance_polling_all(&config);
    let listen = format!("127.0.0.1:{}", crate::common::free_port());
    let mut second = Daemon::spawn_with_env(&config, &[("ZDELAY_ADMIN__LISTEN", listen.as_str())]);
    let status = second.wait_exit(Duration::from_secs(30));
    let log = second.log_text();
    assert!(!status.success(), "{status:?}\n{log}");
    assert!(
        log.contains("poller.instance_id worker-1 is in use by another running daemon"),
        "{log}"
    );
    assert!(first.try_exit().is_none(), "the first daemon keeps running");
    assert!(
        first.log_text().contains("taken back"),
        "{}",
        first.log_text()
    );
    assert_eq!(instances(&config), all_shards("worker-1"));
    enqueue_due_now(&redis, 40);
    let mut con = redis.conn();
    wait_for(
        "the first daemon still delivers",
        Duration::from_secs(10),
        || crate::common::llen(&mut con, "q:l") == 40,
    );
    assert!(first.try_exit().is_none(), "the first daemon keeps running");
}

/// used_cpu_sys + used_cpu_user of the Redis server, seconds.
fn redis_cpu_s(con: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(con).expect("INFO cpu");
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("INFO cpu has no {name}"))
    };
    field("used_cpu_sys") + field("used_cpu_user")
}

/// Waits until the daemon's `zdelay_wakeups_confirmed` gauges show `value` for `targets`.
fn wait_confirmed(daemon: &Daemon, targets: &[&str], value: f64, within: Duration) {
    wait_for_or_show(
        &format!("zdelay_wakeups_confirmed {targets:?} = {value}"),
        within,
        || {
            targets
                .iter()
                .all(|t| daemon.metric("zdelay_wakeups_confirmed", &[("targets", t)]) == value)
        },
        || daemon.log_text(),
    );
}

/// Starts a daemon with `shards` and `extra` config on `redis`, waits until its wake-ups
/// are confirmed for `targets`, and returns Redis's and the daemon's CPU over the next
/// 10 s, % of a core.
fn idle_cost(redis: &RedisServer, shards: u16, extra: &str, targets: &[&str]) -> (f64, f64) {
    let config = TestConfig::new(&redis.url(), shards, extra);
    let daemon = Daemon::start(&config);
    wait_confirmed(&daemon, targets, 1.0, Duration::from_secs(30));
    let mut con = redis.conn();
    let (redis0, daemon0, started) = (
        redis_cpu_s(&mut con),
        crate::common::process_cpu(daemon.pid()),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(10));
    let secs = started.elapsed().as_secs_f64();
    let redis_pct = 100.0 * (redis_cpu_s(&mut con) - redis0) / secs;
    let daemon_pct =
        100.0 * (crate::common::process_cpu(daemon.pid()) - daemon0).as_secs_f64() / secs;
    (redis_pct, daemon_pct)
}

/// The idle-cost bound: 3 % of a core is the aim on a quiet machine (`zdelay-bench --mode
/// idle`); a shared test machine gets some slack.
const IDLE_REDIS_PCT: f64 = 5.0;

#[test]
fn an_idle_daemon_with_256_shards_costs_redis_under_5_percent_of_a_core() {
    let redis = RedisServer::start();
    // A two-phase route too: every shard runs a publisher beside its mover.
    let extra = format!(
        r#"
[[routes]]
name = "w"
sink = "local"
target = "q:w"

[sinks.remote]
kind = "redis"
url = "{}"

[[routes]]
name = "r"
sink = "remote"
target = "q:r"
"#,
        redis.url()
    );
    let (redis_pct, daemon_pct) = idle_cost(&redis, 256, &extra, &["shards"]);
    eprintln!("256 idle shards: Redis {redis_pct:.2} %, daemon {daemon_pct:.2} % of a core");
    assert!(
        redis_pct < IDLE_REDIS_PCT,
        "256 idle shards cost Redis {redis_pct:.2} % of a core"
    );
}

#[test]
fn an_idle_daemon_with_200_raw_sources_costs_redis_under_5_percent_of_a_core() {
    // Raw sources are woken by keyspace events: with them on, their idle polls back off.
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Kz"]);
    let mut extra = String::from("[[routes]]\nname = \"w\"\nsink = \"local\"\ntarget = \"q:w\"\n");
    for i in 0..200 {
        extra.push_str(&format!(
            "\n[[sources]]\nkey = \"raw:{i}\"\nroute = \"w\"\n"
        ));
    }
    let (redis_pct, daemon_pct) = idle_cost(&redis, 16, &extra, &["shards", "sources"]);
    eprintln!("200 idle raw sources: Redis {redis_pct:.2} %, daemon {daemon_pct:.2} % of a core");
    assert!(
        redis_pct < IDLE_REDIS_PCT,
        "200 idle raw sources cost Redis {redis_pct:.2} % of a core"
    );
}

/// Storage layout 2 gives every local route a lane of its own, polled as a target: with
/// 1,000 routes the lanes' fallback polls are spaced out to those of 16 targets once wake-ups
/// are confirmed, so an idle daemon makes about 20 script calls a second, not 200.
#[test]
fn an_idle_layout_2_daemon_with_1000_route_lanes_polls_like_16_targets() {
    let redis = RedisServer::start();
    let mut extra = String::new();
    for i in 0..1000 {
        extra.push_str(&format!(
            "\n[[routes]]\nname = \"r{i}\"\nsink = \"local\"\ntarget = \"q:{i}\"\n"
        ));
    }
    let config = TestConfig::new(&redis.url(), 16, &extra);
    let daemon = Daemon::start(&config);
    wait_confirmed(&daemon, &["shards"], 1.0, Duration::from_secs(30));
    // Every lane finishes the short sleep it was in (idle_poll_max is 5 s) and starts a long one.
    std::thread::sleep(Duration::from_secs(6));
    let mut con = redis.conn();
    let (calls0, redis0, started) = (
        crate::common::script_calls(&mut con),
        redis_cpu_s(&mut con),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(10));
    let secs = started.elapsed().as_secs_f64();
    let calls_per_s = (crate::common::script_calls(&mut con) - calls0) as f64 / secs;
    let redis_pct = 100.0 * (redis_cpu_s(&mut con) - redis0) / secs;
    eprintln!(
        "1,000 idle lanes: {calls_per_s:.1} script calls/s, Redis {redis_pct:.2} % of a core"
    );
    // 1,000 lanes each every 60 s (16.7/s) plus the heartbeat's and the sampler's scripts.
    assert!(
        calls_per_s < 40.0,
        "1,000 idle lanes made {calls_per_s:.1} script calls a second"
    );
    assert!(
        redis_pct < IDLE_REDIS_PCT,
        "Redis {redis_pct:.2} % of a core"
    );
}

#[test]
fn a_lost_wake_subscription_brings_the_fallback_poll_back_until_a_new_one_is_confirmed() {
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Kz"]);
    const SHARDS: u16 = 4;
    // idle_poll_max long enough that only the fallback poll can explain a prompt delivery.
    let config = TestConfig::new(
        &redis.url(),
        SHARDS,
        r#"
[poller]
idle_poll = "100ms"
idle_poll_max = "60s"

[[routes]]
name = "w"
sink = "local"
target = "q:w"

[[sources]]
key = "raw:a"
route = "w"
"#,
    );
    let daemon = Daemon::start(&config);
    wait_confirmed(
        &daemon,
        &["shards", "sources"],
        1.0,
        Duration::from_secs(30),
    );
    let mut con = redis.conn();
    // The subscription cannot come back while SUBSCRIBE is refused.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "-subscribe"][..])
        .query(&mut con)
        .unwrap();
    let killed: u64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "pubsub"][..])
        .query(&mut con)
        .unwrap();
    assert_eq!(killed, 1, "the daemon's one subscription");
    wait_confirmed(
        &daemon,
        &["shards", "sources"],
        0.0,
        Duration::from_secs(10),
    );

    // Written without a wake-up (no PUBLISH, no keyspace event reaches anyone): found by the
    // fallback poll, not after idle_poll_max.
    let lane = crate::common::lane_keys("w", "q:w");
    let due = crate::common::redis_now_ms(&mut con);
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("HSET")
        .arg(&lane.jobs)
        .arg("by-hand-1")
        .arg("by hand")
        .ignore()
        .cmd("ZADD")
        .arg(&lane.due)
        .arg(due)
        .arg("by-hand-1")
        .ignore()
        .cmd("ZADD")
        .arg("raw:a")
        .arg(due)
        .arg("raw by hand")
        .ignore();
    pipe.exec(&mut con).unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        let popped: Option<(String, String)> = redis::cmd("BLPOP")
            .arg("q:w")
            .arg(10)
            .query(&mut con)
            .unwrap();
        let (_, item) = popped.expect("delivered by the fallback poll within 10 s");
        got.push(item);
    }
    let late = crate::common::redis_now_ms(&mut con) - due;
    got.sort();
    assert_eq!(got, ["by hand", "raw by hand"]);
    assert!(
        late < 5_000,
        "found by the fallback poll (idle_poll 100 ms), not idle_poll_max (60 s): {late} ms"
    );

    // SUBSCRIBE allowed again: the listener's retries get a new subscription, confirmed by
    // its probe, and a library enqueue wakes its poller again.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "+subscribe"][..])
        .query(&mut con)
        .unwrap();
    wait_confirmed(
        &daemon,
        &["shards", "sources"],
        1.0,
        Duration::from_secs(30),
    );
    let rt = runtime();
    let client = rt
        .block_on(Client::connect(&crate::common::redis_config(
            &redis.url(),
            SHARDS,
        )))
        .unwrap();
    let (id, _) = rt
        .block_on(client.enqueue(
            NewJob::new("w", "woken").after(Duration::from_millis(300)),
            OnConflict::Error,
        ))
        .unwrap();
    let due = rt
        .block_on(client.get(&id))
        .unwrap()
        .unwrap()
        .score
        .unwrap() as i64;
    let popped: Option<(String, String)> = redis::cmd("BLPOP")
        .arg("q:w")
        .arg(10)
        .query(&mut con)
        .unwrap();
    assert_eq!(popped.expect("delivered").1, "woken");
    let late = crate::common::redis_now_ms(&mut con) - due;
    assert!(
        late < 1_000,
        "woken by the enqueue's PUBLISH on the new subscription: {late} ms late"
    );
}

#[test]
fn an_idle_raw_publisher_sleeps_until_its_sources_head_is_due_not_a_whole_idle_poll() {
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Kz"]);
    let target = RedisServer::start();
    let config = TestConfig::new(
        &redis.url(),
        4,
        &format!(
            r#"
[poller]
idle_poll = "100ms"
idle_poll_max = "60s"

[sinks.mirror]
kind = "redis"
url = "{}"

[[routes]]
name = "m"
sink = "mirror"
target = "q:m"

[[sources]]
key = "raw:m"
route = "m"
"#,
            target.url()
        ),
    );
    let daemon = Daemon::start(&config);
    wait_confirmed(
        &daemon,
        &["shards", "sources"],
        1.0,
        Duration::from_secs(30),
    );
    let mut con = redis.conn();
    let mut tcon = target.conn();
    // Its keyspace event wakes the publisher before it is due: the claim takes nothing and
    // says when the head is due, and the publisher sleeps until then, not idle_poll_max.
    for (i, ahead) in [800i64, 1_500].into_iter().enumerate() {
        let due = crate::common::redis_now_ms(&mut con) + ahead;
        let member = format!("later-{i}");
        let _: () = redis::cmd("ZADD")
            .arg("raw:m")
            .arg(due)
            .arg(&member)
            .query(&mut con)
            .unwrap();
        let popped: Option<(String, String)> = redis::cmd("BLPOP")
            .arg("q:m")
            .arg(10)
            .query(&mut tcon)
            .unwrap();
        let late = crate::common::redis_now_ms(&mut con) - due;
        assert_eq!(popped.expect("delivered within 10 s").1, member);
        assert!(
            (0..1_000).contains(&late),
            "{member} delivered {late} ms after its due time (idle_poll_max is 60 s)"
        );
    }
}
