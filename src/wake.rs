//! Wake-ups: a pub/sub listener that wakes a poller when its head may have changed.
//!
//! `enqueue_jobs`, `reschedule_job` and `replay_dead` publish `"<shard> <due ms>"` on
//! `<ns>:wake` when they create a new head. Raw sources are watched through keyspace
//! notifications (`__keyspace@<db>__:<key>`), which Redis sends only when the server has
//! `notify-keyspace-events` including `Kz`; without them raw sources rely on the idle poll.
//! After every (re)subscribe all pollers are woken, since wake-ups may have been missed.

use crate::keys::Keys;
use crate::metrics::{self, WAKEUPS};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One `Notify` per poller.
#[derive(Default)]
pub struct Wakers {
    pub shards: HashMap<u16, Arc<Notify>>,
    pub sources: HashMap<String, Arc<Notify>>,
}

impl Wakers {
    fn wake_all(&self) {
        self.shards
            .values()
            .chain(self.sources.values())
            .for_each(|n| n.notify_one());
    }

    fn dispatch(&self, wake_channel: &str, keyspace_prefix: &str, msg: &redis::Msg) {
        let channel = msg.get_channel_name();
        if channel == wake_channel {
            let payload = String::from_utf8_lossy(msg.get_payload_bytes());
            let shard = payload
                .split(' ')
                .next()
                .and_then(|s| s.parse::<u16>().ok());
            if let Some(n) = shard.and_then(|s| self.shards.get(&s)) {
                ::metrics::counter!(WAKEUPS, "cause" => "enqueue").increment(1);
                n.notify_one();
            }
        } else if let Some(key) = channel.strip_prefix(keyspace_prefix)
            && let Some(n) = self.sources.get(key)
        {
            ::metrics::counter!(WAKEUPS, "cause" => "keyspace").increment(1);
            n.notify_one();
        }
    }
}

/// Listens until `shutdown`, resubscribing with backoff after any disconnect.
pub async fn listen(
    client: redis::Client,
    keys: Keys,
    wakers: Arc<Wakers>,
    shutdown: CancellationToken,
) {
    let db = client.get_connection_info().redis_settings().db();
    let wake_channel = keys.wake_channel();
    let keyspace_prefix = format!("__keyspace@{db}__:");
    let mut delay = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        match subscribe(&client, &wake_channel, &keyspace_prefix, &wakers).await {
            Ok(pubsub) => {
                delay = Duration::from_millis(100);
                wakers.wake_all();
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        msg = messages.next() => match msg {
                            Some(msg) => wakers.dispatch(&wake_channel, &keyspace_prefix, &msg),
                            None => break,
                        },
                        _ = shutdown.cancelled() => return,
                    }
                }
                metrics::error_event("pubsub", "wake listener", &"subscription closed");
            }
            Err(e) => metrics::error_event("pubsub", "wake listener", &e),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return,
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

async fn subscribe(
    client: &redis::Client,
    wake_channel: &str,
    keyspace_prefix: &str,
    wakers: &Wakers,
) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(wake_channel).await?;
    for key in wakers.sources.keys() {
        pubsub.subscribe(format!("{keyspace_prefix}{key}")).await?;
    }
    Ok(pubsub)
}
