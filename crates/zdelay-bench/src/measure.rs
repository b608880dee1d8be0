//! Facts about Redis and this machine: CPU and memory used, clocks, list lengths.

use anyhow::Context;
use std::time::{SystemTime, UNIX_EPOCH};
use zdelay_core::config::{RedisConfig, redact_url};
use zdelay_core::store::{self, Conn};

/// used_cpu_sys + used_cpu_user of the Redis process, seconds.
pub(super) async fn redis_cpu(con: &mut Conn) -> anyhow::Result<f64> {
    cpu_of(&store::info(con, "cpu").await?)
}

/// The same on the master serving `key` (the one server on one Redis).
pub(super) async fn redis_cpu_at(con: &mut Conn, key: &str) -> anyhow::Result<f64> {
    cpu_of(&info_at(con, key, "cpu").await?)
}

/// `used_memory` of the master serving `key`.
pub(super) async fn used_memory_at(con: &mut Conn, key: &str) -> anyhow::Result<i64> {
    info_at(con, key, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .context("INFO memory has no used_memory")
}

async fn info_at(
    con: &mut Conn,
    key: &str,
    section: &str,
) -> anyhow::Result<std::collections::HashMap<String, String>> {
    let mut cmd = redis::cmd("INFO");
    cmd.arg(section);
    let text: String = redis::from_redis_value(con.on_node_of(key.as_bytes(), cmd).await?)?;
    Ok(store::parse_info(&text))
}

fn cpu_of(info: &std::collections::HashMap<String, String>) -> anyhow::Result<f64> {
    let get = |k: &str| -> anyhow::Result<f64> {
        info.get(k)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("INFO cpu has no {k}"))
    };
    Ok(get("used_cpu_sys")? + get("used_cpu_user")?)
}

pub(super) async fn used_memory(con: &mut Conn) -> anyhow::Result<i64> {
    store::info(con, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .context("INFO memory has no used_memory")
}

pub(super) fn local_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

pub(super) fn local_now_ms() -> i64 {
    local_now_us() / 1000
}

pub(super) fn system_time_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Redis clock minus local clock (ms), from the sample with the shortest round trip.
pub(super) async fn clock_offset_ms(con: &mut Conn) -> redis::RedisResult<i64> {
    let mut best = (i64::MAX, 0);
    for _ in 0..7 {
        let before = local_now_us();
        let redis_us = store::server_time_us(con).await?;
        let after = local_now_us();
        let rtt = after - before;
        if rtt < best.0 {
            best = (rtt, redis_us - (before + after) / 2);
        }
    }
    Ok((best.1 as f64 / 1000.0).round() as i64)
}

pub(super) async fn llen(con: &mut Conn, key: &str) -> redis::RedisResult<u64> {
    redis::cmd("LLEN").arg(key).query_async(con).await
}

pub(super) async fn del(con: &mut Conn, key: &str) -> redis::RedisResult<()> {
    redis::cmd("DEL").arg(key).query_async(con).await
}

/// Sum of ZCARD or HLEN over keys: one pipeline on one Redis; on a cluster (where a pipeline
/// must stay in one slot) one command per key, all at once.
pub(super) async fn total_size(
    con: &mut Conn,
    cmd: &str,
    keys: &[String],
) -> redis::RedisResult<u64> {
    if con.is_cluster() {
        let counts = futures::future::try_join_all(keys.iter().map(|key| {
            let mut con = con.clone();
            async move { redis::cmd(cmd).arg(key).query_async::<u64>(&mut con).await }
        }))
        .await?;
        return Ok(counts.iter().sum());
    }
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd(cmd).arg(key);
    }
    let counts: Vec<u64> = pipe.query_async(con).await?;
    Ok(counts.iter().sum())
}

/// A Redis server of the deployment: the one server, or a node of the cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(super) struct Node {
    /// `host:port` (on one Redis: its URL without password).
    pub(super) addr: String,
    /// A master that serves slots. A node flagged master without slots serves no jobs: an
    /// empty master, or a replica whose new role has not reached this node by gossip yet
    /// (right after `redis-cli --cluster create`).
    pub(super) master: bool,
}

/// The nodes of `CLUSTER NODES` output that are up (no `fail`, `noaddr` or `handshake`
/// flag), masters first, each group in address order.
pub(super) fn parse_cluster_nodes(text: &str) -> Vec<Node> {
    let mut nodes: Vec<Node> = text
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_id, addr, flags) = (fields.next()?, fields.next()?, fields.next()?);
            // master id, ping sent, pong received, config epoch, link state, then slots.
            let serves_slots = fields.nth(5).is_some();
            let flags: Vec<&str> = flags.split(',').collect();
            if flags
                .iter()
                .any(|f| matches!(*f, "fail" | "noaddr" | "handshake"))
            {
                return None;
            }
            // `ip:port@cport[,hostname]`
            let addr = addr.split(['@', ',']).next()?.to_owned();
            Some(Node {
                addr,
                master: flags.contains(&"master") && serves_slots,
            })
        })
        .collect();
    nodes.sort_by(|a, b| b.master.cmp(&a.master).then_with(|| a.addr.cmp(&b.addr)));
    nodes
}

/// Every server of the deployment, each with a connection of its own, for what only a node
/// can tell (`INFO cpu`): the one Redis, or every node of the cluster, replicas included.
pub(super) struct Nodes {
    pub(super) nodes: Vec<(Node, Conn)>,
}

impl Nodes {
    pub(super) async fn connect(con: &mut Conn, cfg: &RedisConfig) -> anyhow::Result<Nodes> {
        if !con.is_cluster() {
            let node = Node {
                addr: redact_url(&cfg.url),
                master: true,
            };
            return Ok(Nodes {
                nodes: vec![(node, con.clone())],
            });
        }
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("NODES");
        let text: String = redis::from_redis_value(con.on_one_node(cmd).await?)?;
        let mut nodes = Vec::new();
        for node in parse_cluster_nodes(&text) {
            let one = RedisConfig {
                url: format!("redis://{}", node.addr),
                cluster_nodes: Vec::new(),
                ..cfg.clone()
            };
            let con = Conn::connect(&one)
                .await
                .with_context(|| format!("cluster node {}", node.addr))?;
            nodes.push((node, con));
        }
        anyhow::ensure!(!nodes.is_empty(), "CLUSTER NODES lists no node that is up");
        Ok(Nodes { nodes })
    }

    /// used_cpu_sys + used_cpu_user of every node, seconds, in `nodes` order.
    pub(super) async fn cpu(&mut self) -> anyhow::Result<Vec<f64>> {
        let mut out = Vec::with_capacity(self.nodes.len());
        for (_, con) in &mut self.nodes {
            out.push(redis_cpu(con).await?);
        }
        Ok(out)
    }

    pub(super) fn list(&self) -> Vec<Node> {
        self.nodes.iter().map(|(n, _)| n.clone()).collect()
    }
}

/// utime + stime of a process (all its threads), seconds, from `/proc/<pid>/stat`.
pub(super) fn process_cpu(pid: u32) -> Option<f64> {
    parse_proc_stat_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, seconds. The kernel reports
/// them in USER_HZ ticks, 100 per second on Linux whatever the kernel's own HZ.
pub(super) fn parse_proc_stat_cpu(stat: &str) -> Option<f64> {
    // The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

pub(super) fn read_first_line(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_nodes_are_parsed_masters_first() {
        let text = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@40003,node-c.example master - 0 1426238318243 3 connected 10923-16383
6ec2 127.0.0.1:30005@40005 slave,fail 67ed 1426238316232 1426238316232 5 disconnected
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
a9b0 127.0.0.1:30006@40006 master - 0 1426238316232 0 connected
";
        let nodes = parse_cluster_nodes(text);
        let addrs: Vec<(&str, bool)> = nodes.iter().map(|n| (n.addr.as_str(), n.master)).collect();
        assert_eq!(
            addrs,
            vec![
                ("127.0.0.1:30001", true),
                ("127.0.0.1:30002", true),
                ("127.0.0.1:30003", true),
                ("127.0.0.1:30004", false),
                ("127.0.0.1:30006", false),
            ]
        );
        assert!(parse_cluster_nodes("").is_empty());
    }

    #[test]
    fn proc_stat_cpu_counts_user_and_system_ticks() {
        // Field 2 with a space and a ')' inside; utime 250, stime 50 ticks.
        let stat = "4242 (zdelay (x) y) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(parse_proc_stat_cpu(stat), Some(3.0));
        assert_eq!(parse_proc_stat_cpu("garbage"), None);
        // This process has a stat file.
        assert!(process_cpu(std::process::id()).is_some());
    }
}

/// Redis's own execution time of one script, or of one plain command's calls, over a
/// measured window, from `SLOWLOG` recording every call.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct CallCost {
    /// The script's name in `lua/`, or a plain command's name in capitals.
    pub(super) name: String,
    pub(super) calls: u64,
    /// Execution time per job, µs (what `SLOWLOG` times: not the parsing or the network, which
    /// `used_cpu` adds).
    pub(super) us_per_job: f64,
}

/// `SLOWLOG` set to record every call on a single Redis, and the settings to put back.
pub(super) struct CallLog {
    threshold: String,
    max_len: String,
}

/// Entries the log keeps while measuring: the window's calls (scripts in batches, and the
/// bench's own polls), with room to spare; a log that fills is reported as such.
const CALL_LOG_LEN: u64 = 200_000;

impl CallLog {
    /// Starts recording every call (`slowlog-log-slower-than 0`), after an empty log. `None` on
    /// a cluster (one log per node) or where `CONFIG` is not allowed.
    pub(super) async fn start(con: &mut Conn) -> Option<CallLog> {
        if con.is_cluster() {
            return None;
        }
        let get = |name: &'static str| redis::cmd("CONFIG").arg("GET").arg(name).clone();
        let threshold: Vec<String> = get("slowlog-log-slower-than").query_async(con).await.ok()?;
        let max_len: Vec<String> = get("slowlog-max-len").query_async(con).await.ok()?;
        let log = CallLog {
            threshold: threshold.get(1)?.clone(),
            max_len: max_len.get(1)?.clone(),
        };
        let _: () = redis::pipe()
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-max-len")
            .arg(CALL_LOG_LEN)
            .cmd("SLOWLOG")
            .arg("RESET")
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(0)
            .query_async(con)
            .await
            .ok()?;
        Some(log)
    }

    /// Stops recording, puts the settings back and sums the log per script (by the SHA-1 of
    /// each script of `lua/`) and per plain command, per job. `ignore` names plain
    /// commands to leave out (the bench's own polls); `full` says the log filled (the sums
    /// then miss the window's first calls).
    pub(super) async fn finish(
        self,
        con: &mut Conn,
        jobs: u64,
        ignore: &[&str],
    ) -> anyhow::Result<(Vec<CallCost>, bool)> {
        let entries: redis::Value = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query_async(con)
            .await?;
        let _: () = redis::pipe()
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(&self.threshold)
            .cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-max-len")
            .arg(&self.max_len)
            .cmd("SLOWLOG")
            .arg("RESET")
            .query_async(con)
            .await?;
        let names: std::collections::HashMap<String, &str> = zdelay_core::store::scripts::ALL
            .iter()
            .map(|(name, source)| (redis::Script::new(source).get_hash().to_owned(), *name))
            .collect();
        let redis::Value::Array(entries) = entries else {
            anyhow::bail!("SLOWLOG GET answered {entries:?}");
        };
        let full = entries.len() as u64 >= CALL_LOG_LEN;
        let mut sums: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        for entry in &entries {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let (Some(redis::Value::Int(micros)), Some(redis::Value::Array(args))) =
                (fields.get(2), fields.get(3))
            else {
                continue;
            };
            let text = |v: Option<&redis::Value>| match v {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            };
            // A command a script ran is logged too, from client "?:0": its time is in the
            // script's.
            if text(fields.get(4)) == "?:0" {
                continue;
            }
            let command = text(args.first()).to_ascii_lowercase();
            let name = match command.as_str() {
                "evalsha" => {
                    let sha = text(args.get(1)).to_ascii_lowercase();
                    names.get(&sha).map_or(sha, |n| (*n).to_owned())
                }
                _ if ignore.contains(&command.as_str()) => continue,
                "slowlog" | "config" => continue,
                _ => command.to_ascii_uppercase(),
            };
            let sum = sums.entry(name).or_default();
            sum.0 += 1;
            sum.1 += *micros as u64;
        }
        let mut costs: Vec<CallCost> = sums
            .into_iter()
            .map(|(name, (calls, micros))| CallCost {
                name,
                calls,
                us_per_job: micros as f64 / jobs.max(1) as f64,
            })
            .collect();
        costs.sort_by(|a, b| b.us_per_job.total_cmp(&a.us_per_job));
        Ok((costs, full))
    }
}
