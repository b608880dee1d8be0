//! The two-phase Redis list sink: lists on another Redis server (a `redis` sink with `url`),
//! or, on a Redis Cluster, lists of the scheduling cluster in another slot than the shards.
//!
//! One script cannot span two servers (or two slots), so this sink takes the two-phase path
//! like the brokers: the job is claimed on the scheduling Redis, pushed here, and
//! acknowledged after the push returned. At least once: a crash between push and ack pushes
//! again after the lease. A batch is one variadic push per list (in one pipeline on a
//! single server; all at once on a cluster, one slot each).
//!
//! A stream target (`push = "xadd"`) gets one `XADD` per job, with the fields the local move
//! writes. Where the server has `XADD … IDMP` (Redis 8.6), the append names the job's
//! idempotency key, so the server drops a repeat within its IDMP window; elsewhere a repeat
//! is a second entry with the same `zdelay-id`, which consumers drop.

use crate::sinks::{IDEMPOTENCY_HEADER, Message, Outcome, SinkError};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::OnceCell;
use zdelay_core::config::{Config, Push, RedisConfig, StreamTrim};
use zdelay_core::store::{self, Conn};
use zdelay_core::trace_context::{self, TRACEPARENT, TRACESTATE};

/// The producer id of zdelay's idempotent appends (`XADD … IDMP zdelay <key>`).
pub const IDMP_PRODUCER: &str = "zdelay";

pub struct RedisRemoteSink {
    name: String,
    redis: RedisConfig,
    con: OnceCell<Conn>,
    /// Target key → how it receives jobs, from the routes that use this sink.
    commands: HashMap<String, Push>,
    /// Stream targets' trimming, from their routes.
    trims: HashMap<String, StreamTrim>,
    /// Whether the server takes `XADD … IDMP`: probed once, on the first stream append.
    idmp: OnceCell<bool>,
}

impl RedisRemoteSink {
    /// A sink pushing to the Redis at `url`.
    pub fn new(name: &str, url: &str, config: &Config) -> Result<Self, SinkError> {
        let redis = RedisConfig {
            url: url.to_owned(),
            ..RedisConfig::default()
        };
        // Checked now, so a bad URL is a config error rather than an outage.
        store::client(&redis).map_err(|e| SinkError::Config {
            sink: name.to_owned(),
            why: format!("url: {e}"),
        })?;
        Ok(Self::on(name, redis, config))
    }

    /// A sink pushing to the lists of the Redis (or cluster) `redis` describes.
    pub fn on(name: &str, redis: RedisConfig, config: &Config) -> Self {
        let routes = || config.routes.iter().filter(|r| r.sink == name);
        RedisRemoteSink {
            name: name.to_owned(),
            redis,
            con: OnceCell::new(),
            commands: routes().map(|r| (r.list_key(), r.push)).collect(),
            trims: routes()
                .filter_map(|r| Some((r.list_key(), r.trim()?)))
                .collect(),
            idmp: OnceCell::new(),
        }
    }

    fn push_of(&self, target: &str) -> Push {
        self.commands.get(target).copied().unwrap_or_default()
    }

    /// Whether appends carry `IDMP`: asked of the server once. A server that does not answer
    /// `INFO` (an ACL without it) is taken to lack it: consumers then dedupe, which is
    /// always safe.
    async fn idmp(&self, con: &mut Conn) -> bool {
        *self
            .idmp
            .get_or_init(|| async {
                let server = store::probe_server(con).await;
                let idmp = server.as_ref().is_ok_and(|s| s.stream_idmp);
                let name = server.map_or_else(|_| "the server".to_owned(), |s| s.name);
                if idmp {
                    tracing::info!(sink = %self.name, server = %name,
                        "stream appends are idempotent (XADD IDMP): the server drops a repeat");
                } else {
                    tracing::info!(sink = %self.name, server = %name,
                        "the server has no XADD IDMP: a repeated append is a second entry with \
                         the same zdelay-id, which consumers drop");
                }
                idmp
            })
            .await
    }

    async fn connection(&self) -> Result<Conn, String> {
        self.con
            .get_or_try_init(|| Conn::connect(&self.redis))
            .await
            .cloned()
            .map_err(|e| e.to_string())
    }

    /// Pushes the batch: one variadic push per list, in the batch's order (so one bad key
    /// rejects only its own list's messages).
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut con = match self.connection().await {
            Ok(con) => con,
            Err(e) => return vec![Outcome::Unavailable(e); batch.len()],
        };
        // Target → the indexes of its messages, targets in order of first appearance.
        let mut targets: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            match targets.iter_mut().find(|(target, _)| *target == m.target) {
                Some((_, indexes)) => indexes.push(i),
                None => targets.push((&m.target, vec![i])),
            }
        }
        let idmp = if targets.iter().any(|(t, _)| self.push_of(t).is_stream()) {
            self.idmp(&mut con).await
        } else {
            false
        };
        // One command per list (all its messages), one per stream entry: each with the
        // indexes of the messages its answer settles.
        let mut lists: Vec<(Vec<usize>, redis::Cmd)> = Vec::new();
        for (target, indexes) in &targets {
            let push = self.push_of(target);
            if push.is_stream() {
                for &i in indexes {
                    lists.push((vec![i], xadd(target, &batch[i], idmp)));
                }
            } else {
                let mut cmd = redis::cmd(push.command());
                cmd.arg(*target);
                for &i in indexes {
                    cmd.arg(&batch[i].payload);
                }
                lists.push((indexes.clone(), cmd));
            }
        }
        let commands: Vec<redis::Cmd> = lists.iter().map(|(_, cmd)| cmd.clone()).collect();
        let results: Vec<redis::RedisResult<redis::Value>> = if con.is_cluster() {
            futures::future::join_all(commands.iter().map(|cmd| {
                let mut con = con.clone();
                async move { cmd.query_async(&mut con).await }
            }))
            .await
        } else {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for cmd in &commands {
                pipe.add_command(cmd.clone());
            }
            match pipe
                .query_async::<Vec<redis::RedisResult<redis::Value>>>(&mut con)
                .await
            {
                Ok(results) => results,
                Err(e) => return vec![Outcome::Unavailable(e.to_string()); batch.len()],
            }
        };
        let mut out = vec![Outcome::Retry("no answer recorded".to_owned()); batch.len()];
        for ((indexes, _), result) in lists.iter().zip(results) {
            let outcome = classify(result);
            for &i in indexes {
                out[i] = outcome.clone();
            }
        }
        self.trim(&con, &targets, &out).await;
        out
    }

    /// Trims the streams this batch appended to, as their routes say. A failed trim is
    /// logged, not an outcome: the jobs were delivered, and the next batch trims again.
    async fn trim(&self, con: &Conn, targets: &[(&str, Vec<usize>)], out: &[Outcome]) {
        let trims = targets.iter().filter_map(|(target, indexes)| {
            let trim = self.trims.get(*target)?;
            indexes
                .iter()
                .any(|&i| out[i] == Outcome::Delivered)
                .then_some((*target, trim))
        });
        let trims: Vec<_> = trims.collect();
        if trims.is_empty() {
            return;
        }
        // MINID from the server's clock: the entry ids are its milliseconds.
        let now_ms = if trims.iter().any(|(_, t)| t.max_age_ms.is_some()) {
            match store::server_time_ms(&mut con.clone()).await {
                Ok(ms) => Some(ms),
                Err(e) => {
                    tracing::warn!(sink = %self.name, error = %e, "reading the time to trim streams");
                    None
                }
            }
        } else {
            None
        };
        let calls = trims.into_iter().flat_map(|(target, trim)| {
            let max_len = trim.max_len.map(|n| {
                redis::cmd("XTRIM")
                    .arg(target)
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(n)
                    .clone()
            });
            let min_id = now_ms
                .zip(trim.max_age_ms)
                .map(|(now, age)| now - age as i64)
                .filter(|min_id| *min_id > 0);
            let max_age = min_id.map(|min_id| {
                redis::cmd("XTRIM")
                    .arg(target)
                    .arg("MINID")
                    .arg("~")
                    .arg(min_id)
                    .clone()
            });
            [max_len, max_age].into_iter().flatten()
        });
        for cmd in calls {
            let mut con = con.clone();
            if let Err(e) = cmd.query_async::<redis::Value>(&mut con).await {
                tracing::warn!(sink = %self.name, error = %e, "trimming a stream failed");
            }
        }
    }

    /// PINGs the server, or on a cluster the nodes serving this sink's lists (another
    /// node hanging is not this sink's outage).
    pub async fn check(&self) -> Result<(), String> {
        let con = self.connection().await?;
        let lists: Vec<&String> = if con.is_cluster() {
            self.commands.keys().collect()
        } else {
            Vec::new()
        };
        let pings = lists.iter().map(|list| Some(list.as_bytes())).chain(
            // One Redis, or a cluster sink with no list yet: any node.
            lists.is_empty().then_some(None),
        );
        let answers = futures::future::join_all(pings.map(|list| {
            let mut con = con.clone();
            async move {
                let ping = redis::cmd("PING");
                let answer = match list {
                    Some(key) => con.on_node_of(key, ping).await,
                    None => con.on_one_node(ping).await,
                };
                (list, answer)
            }
        }));
        match tokio::time::timeout(Duration::from_secs(2), answers).await {
            Err(_) => Err("no answer to PING within 2s".into()),
            Ok(answers) => answers
                .into_iter()
                .find_map(|(list, answer)| {
                    let e = answer.err()?;
                    Some(match list {
                        Some(key) => format!("{e} (list {})", String::from_utf8_lossy(key)),
                        None => e.to_string(),
                    })
                })
                .map_or(Ok(()), Err),
        }
    }
}

/// One job's stream entry: `XADD <stream> [IDMP zdelay <key>] * payload <payload> zdelay-id
/// <key>`, then `traceparent` and `tracestate` when it has them, then `h:<name>` per other
/// header in name order (the fields the local move writes).
fn xadd(stream: &str, message: &Message, idmp: bool) -> redis::Cmd {
    let key = message.idempotency_key();
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream);
    if idmp {
        cmd.arg("IDMP").arg(IDMP_PRODUCER).arg(&key);
    }
    cmd.arg("*")
        .arg("payload")
        .arg(&message.payload)
        .arg(IDEMPOTENCY_HEADER)
        .arg(&key);
    let mut headers = message.headers.clone();
    trace_context::normalize_header_names(&mut headers);
    for name in [TRACEPARENT, TRACESTATE] {
        if let Some(value) = headers.remove(name) {
            cmd.arg(name).arg(value);
        }
    }
    for (name, value) in headers {
        cmd.arg(format!("h:{name}")).arg(value);
    }
    cmd
}

fn classify(result: redis::RedisResult<redis::Value>) -> Outcome {
    match result {
        Ok(_) => Outcome::Delivered,
        Err(e) if e.code() == Some("WRONGTYPE") => Outcome::Reject(e.to_string()),
        Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
            Outcome::Unavailable(e.to_string())
        }
        Err(e) => Outcome::Retry(e.to_string()),
    }
}

impl RedisRemoteSink {
    /// The length of the list or stream `target` (0 when it does not exist).
    pub async fn depth(&self, target: &str) -> Result<u64, String> {
        let mut con = self.connection().await?;
        let command = self.push_of(target).length_command();
        redis::cmd(command)
            .arg(target)
            .query_async(&mut con)
            .await
            .map_err(|e| format!("{command} {target}: {e}"))
    }
}

impl super::Sink for RedisRemoteSink {
    fn depth<'a>(&'a self, target: &'a str) -> futures::future::BoxFuture<'a, Result<u64, String>> {
        Box::pin(RedisRemoteSink::depth(self, target))
    }

    fn publish<'a>(&'a self, batch: &'a [Message]) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(RedisRemoteSink::publish(self, batch))
    }

    fn check(&self) -> futures::future::BoxFuture<'_, super::Health> {
        Box::pin(async move { super::Health::from(RedisRemoteSink::check(self).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn args(cmd: &redis::Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not a byte argument>".to_owned(),
            })
            .collect()
    }

    #[test]
    fn a_stream_entry_has_the_documented_fields_in_order() {
        let headers: BTreeMap<String, String> = [
            ("tenant", "t1"),
            (
                "TraceParent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "k=v"),
            ("a", "first"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let message = Message {
            id: "~1.0PQ3aZr-x_9F".into(),
            due_ms: 1700,
            target: "orders".into(),
            payload: b"{\"n\":1}".to_vec(),
            headers,
            priority: None,
        };
        assert_eq!(
            args(&xadd("orders", &message, false)),
            [
                "XADD",
                "orders",
                "*",
                "payload",
                "{\"n\":1}",
                "zdelay-id",
                "~1.0PQ3aZr-x_9F:1700",
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate",
                "k=v",
                "h:a",
                "first",
                "h:tenant",
                "t1",
            ]
        );
        let plain = Message {
            headers: BTreeMap::new(),
            ..message
        };
        assert_eq!(
            args(&xadd("orders", &plain, true)),
            [
                "XADD",
                "orders",
                "IDMP",
                "zdelay",
                "~1.0PQ3aZr-x_9F:1700",
                "*",
                "payload",
                "{\"n\":1}",
                "zdelay-id",
                "~1.0PQ3aZr-x_9F:1700",
            ]
        );
    }
}
