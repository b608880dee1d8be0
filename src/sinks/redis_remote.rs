//! The remote Redis list sink: lists on another Redis server (a `redis` sink with `url`).
//!
//! One script cannot span two servers, so this sink takes the two-phase path like the
//! brokers: the job is claimed on the scheduling Redis, pushed here in one pipeline, and
//! acknowledged after the push returned. At least once: a crash between push and ack
//! pushes again after the lease.

use crate::sinks::{Message, Outcome, SinkError};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::OnceCell;
use zdelay_client::config::{Config, Push, RedisConfig};
use zdelay_client::store::{self, Conn};

pub struct RedisRemoteSink {
    redis: RedisConfig,
    con: OnceCell<Conn>,
    /// List key → push command, from the routes that use this sink.
    commands: HashMap<String, Push>,
}

impl RedisRemoteSink {
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
        let commands = config
            .routes
            .iter()
            .filter(|r| r.sink == name)
            .map(|r| (r.list_key(), r.push))
            .collect();
        Ok(RedisRemoteSink {
            redis,
            con: OnceCell::new(),
            commands,
        })
    }

    async fn connection(&self) -> Result<Conn, String> {
        self.con
            .get_or_try_init(|| Conn::connect(&self.redis))
            .await
            .cloned()
            .map_err(|e| e.to_string())
    }

    /// Pushes the batch in one pipeline (one command per message, so one bad key rejects
    /// only its own messages).
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut con = match self.connection().await {
            Ok(con) => con,
            Err(e) => return vec![Outcome::Unavailable(e); batch.len()],
        };
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for m in batch {
            let command = match self.commands.get(&m.target).copied().unwrap_or_default() {
                Push::Lpush => "LPUSH",
                Push::Rpush => "RPUSH",
            };
            pipe.cmd(command).arg(&m.target).arg(&m.payload);
        }
        let replies: redis::RedisResult<Vec<redis::RedisResult<i64>>> =
            pipe.query_async(&mut con).await;
        match replies {
            Ok(results) => results.into_iter().map(classify).collect(),
            Err(e) => vec![Outcome::Unavailable(e.to_string()); batch.len()],
        }
    }

    pub async fn check(&self) -> Result<(), String> {
        let mut con = self.connection().await?;
        let ping = redis::cmd("PING");
        match tokio::time::timeout(Duration::from_secs(2), ping.query_async::<String>(&mut con))
            .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no answer to PING within 2s".into()),
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

impl super::Sink for RedisRemoteSink {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(RedisRemoteSink::publish(self, batch))
    }

    fn check(&self) -> futures::future::BoxFuture<'_, super::Health> {
        Box::pin(async move { super::Health::from(RedisRemoteSink::check(self).await) })
    }
}
