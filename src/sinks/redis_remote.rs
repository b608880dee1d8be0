//! The two-phase Redis list sink: lists on another Redis server (a `redis` sink with `url`),
//! or, on a Redis Cluster, lists of the scheduling cluster in another slot than the shards.
//!
//! One script cannot span two servers (or two slots), so this sink takes the two-phase path
//! like the brokers: the job is claimed on the scheduling Redis, pushed here, and
//! acknowledged after the push returned. At least once: a crash between push and ack pushes
//! again after the lease. A batch is one variadic push per list (in one pipeline on a
//! single server; all at once on a cluster, one slot each).

use crate::sinks::{Message, Outcome, SinkError};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::OnceCell;
use zdelay_core::config::{Config, Push, RedisConfig};
use zdelay_core::store::{self, Conn};

pub struct RedisRemoteSink {
    redis: RedisConfig,
    con: OnceCell<Conn>,
    /// List key → push command, from the routes that use this sink.
    commands: HashMap<String, Push>,
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
        let commands = config
            .routes
            .iter()
            .filter(|r| r.sink == name)
            .map(|r| (r.list_key(), r.push))
            .collect();
        RedisRemoteSink {
            redis,
            con: OnceCell::new(),
            commands,
        }
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
        // List → the indexes of its messages, lists in order of first appearance.
        let mut lists: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            match lists.iter_mut().find(|(list, _)| *list == m.target) {
                Some((_, indexes)) => indexes.push(i),
                None => lists.push((&m.target, vec![i])),
            }
        }
        let commands: Vec<redis::Cmd> = lists
            .iter()
            .map(|(list, indexes)| {
                let mut cmd = redis::cmd(
                    self.commands
                        .get(*list)
                        .copied()
                        .unwrap_or_default()
                        .command(),
                );
                cmd.arg(*list);
                for &i in indexes {
                    cmd.arg(&batch[i].payload);
                }
                cmd
            })
            .collect();
        let results: Vec<redis::RedisResult<i64>> = if con.is_cluster() {
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
                .query_async::<Vec<redis::RedisResult<i64>>>(&mut con)
                .await
            {
                Ok(results) => results,
                Err(e) => return vec![Outcome::Unavailable(e.to_string()); batch.len()],
            }
        };
        let mut out = vec![Outcome::Retry("no answer recorded".to_owned()); batch.len()];
        for ((_, indexes), result) in lists.iter().zip(results) {
            let outcome = classify(result);
            for &i in indexes {
                out[i] = outcome.clone();
            }
        }
        out
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

fn classify(result: redis::RedisResult<i64>) -> Outcome {
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
    /// The length of the list `target` (0 when it does not exist).
    pub async fn depth(&self, target: &str) -> Result<u64, String> {
        let mut con = self.connection().await?;
        redis::cmd("LLEN")
            .arg(target)
            .query_async(&mut con)
            .await
            .map_err(|e| format!("LLEN {target}: {e}"))
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
