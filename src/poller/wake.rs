//! Wake-ups: a pub/sub listener that wakes a poller when its head may have changed.
//!
//! `enqueue_jobs`, `reschedule_job`, `replay_dead` and `settle_jobs` publish
//! `"<shard> <due ms>"` on `<ns>:wake` when they create a new head. Raw sources are watched
//! through keyspace notifications (`__keyspace@<db>__:<key>`), which Redis sends only when
//! the server has `notify-keyspace-events` including `Kz`; without them raw sources rely on
//! the idle poll. After every (re)subscribe all pollers are woken, since wake-ups may have
//! been missed.
//!
//! The set of pollers changes at run time (the supervisor starts and stops them), so the
//! listener subscribes to every configured source and dispatches to whoever is registered.

use super::context::TargetId;
use crate::metrics::{self, WAKEUPS};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One `Notify` per running poller, registered and removed by the supervisor.
#[derive(Default)]
pub struct Wakers {
    pollers: RwLock<HashMap<TargetId, Arc<Notify>>>,
}

impl Wakers {
    /// Registers a poller and returns the `Notify` it waits on.
    pub fn register(&self, id: &TargetId) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        self.write().insert(id.clone(), notify.clone());
        notify
    }

    pub fn remove(&self, id: &TargetId) {
        self.write().remove(id);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<TargetId, Arc<Notify>>> {
        self.pollers.write().expect("wakers lock is never poisoned")
    }

    fn wake(&self, id: &TargetId) -> bool {
        let pollers = self.pollers.read().expect("wakers lock is never poisoned");
        match pollers.get(id) {
            Some(n) => {
                n.notify_one();
                true
            }
            None => false,
        }
    }

    fn wake_all(&self) {
        let pollers = self.pollers.read().expect("wakers lock is never poisoned");
        pollers.values().for_each(|n| n.notify_one());
    }

    fn dispatch(&self, channels: &Channels, msg: &redis::Msg) {
        let channel = msg.get_channel_name();
        if channel == channels.wake {
            let payload = String::from_utf8_lossy(msg.get_payload_bytes());
            let shard = payload
                .split(' ')
                .next()
                .and_then(|s| s.parse::<u16>().ok());
            if let Some(shard) = shard
                && self.wake(&TargetId::Shard(shard))
            {
                ::metrics::counter!(WAKEUPS, "cause" => "enqueue").increment(1);
            }
        } else if let Some(key) = channel.strip_prefix(&channels.keyspace_prefix)
            && self.wake(&TargetId::Source(key.to_owned()))
        {
            ::metrics::counter!(WAKEUPS, "cause" => "keyspace").increment(1);
        }
    }
}

/// What the listener subscribes to.
pub struct Channels {
    /// The enqueue wake channel, `<ns>:wake`.
    pub wake: String,
    /// `__keyspace@<db>__:`
    pub keyspace_prefix: String,
    /// Raw source keys watched through keyspace notifications.
    pub sources: Vec<String>,
}

impl Channels {
    pub fn new(client: &redis::Client, wake: String, sources: Vec<String>) -> Self {
        let db = client.get_connection_info().redis_settings().db();
        Channels {
            wake,
            keyspace_prefix: format!("__keyspace@{db}__:"),
            sources,
        }
    }
}

/// Listens until `shutdown`, resubscribing with backoff after any disconnect, through the
/// next of `clients` each time (on a cluster: its seed nodes; a wake-up published on any
/// node reaches every node's subscribers).
pub async fn listen(
    clients: Vec<redis::Client>,
    channels: Channels,
    wakers: Arc<Wakers>,
    shutdown: CancellationToken,
) {
    let mut delay = Duration::from_millis(100);
    let mut next = 0;
    while !shutdown.is_cancelled() && !clients.is_empty() {
        let client = &clients[next % clients.len()];
        next += 1;
        match subscribe(client, &channels).await {
            Ok(pubsub) => {
                delay = Duration::from_millis(100);
                metrics::recovered("pubsub", "wake listener");
                wakers.wake_all();
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        msg = messages.next() => match msg {
                            Some(msg) => wakers.dispatch(&channels, &msg),
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
    channels: &Channels,
) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&channels.wake).await?;
    for key in &channels.sources {
        pubsub
            .subscribe(format!("{}{key}", channels.keyspace_prefix))
            .await?;
    }
    Ok(pubsub)
}
