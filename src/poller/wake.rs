//! Wake-ups: a pub/sub listener that wakes a poller when its head may have changed.
//!
//! `enqueue_jobs`, `reschedule_job`, `replay_dead` and `settle_jobs` publish
//! `"<shard> <due ms>"` on `<ns>:wake` when they create a new head. A mover that queued jobs
//! for a two-phase part publishes `"q<shard> <origin> <part>"`: while two daemons poll a shard
//! (`poller.per_shard = 2`, or a hand-over), the other daemon's publisher of that part may be
//! the one to claim them, and would otherwise find them only at its idle poll. Raw sources are watched
//! through keyspace notifications (`__keyspace@<db>__:<key>`), which Redis sends only when
//! the server has `notify-keyspace-events` including `Kz`; without them raw sources rely on
//! the idle poll. After every (re)subscribe all pollers are woken, since wake-ups may have
//! been missed.
//!
//! The idle poll is only a fallback for a wake-up that did not come, so a poller sleeps
//! `poller.idle_poll_max` instead of `poller.idle_poll` while wake-ups are known to arrive:
//! for shards, while the listener sees its own probe (`probe`, published on the wake channel
//! every [`PROBE_EVERY`]) come back; for a raw source, while the server reports keyspace
//! events for `z` commands (`CONFIG GET notify-keyspace-events`, on one server only) or an
//! event for that source has arrived since the subscription. A probe not seen within
//! [`PROBE_TIMEOUT`] ends the subscription (a silently dead connection) and polls fall back
//! to `idle_poll` until a new one is confirmed (every poller is woken when a subscription
//! ends, so none finishes a long sleep first).
//!
//! The set of pollers changes at run time (the supervisor starts and stops them), so the
//! listener subscribes to every configured source and dispatches to whoever is registered.

use super::context::TargetId;
use crate::metrics::{self, WAKEUPS, WAKEUPS_CONFIRMED};
use futures::StreamExt;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How often the listener publishes its probe on the wake channel.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How long a probe may take to come back before the subscription counts as dead.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The probe's payload (the wake channel's other messages start with a shard number).
const PROBE: &str = "probe";
/// What `zdelay clock advance` publishes: `"clock <offset ms>"`.
const CLOCK: &str = "clock ";

/// A daemon's route lanes make at most this many targets' worth of fallback polls per
/// `idle_poll_max` while wake-ups are confirmed (the default shard count).
const FALLBACK_POLLERS: usize = 16;
/// The longest a stretched fallback sleep gets: what a wake-up lost on a live subscription
/// (a cluster node cut off from the others) can cost at most.
const LONGEST_FALLBACK: Duration = Duration::from_secs(60);

/// A running publisher of a shard: its part's name and what wakes it.
type PartPublisher = (String, Arc<Notify>);

/// One `Notify` per running poller, registered and removed by the supervisor, and what is
/// known about the wake-ups reaching them.
#[derive(Default)]
pub struct Wakers {
    pollers: RwLock<HashMap<TargetId, Arc<Notify>>>,
    /// How many of `pollers` are route lanes (kept with it, read by every lane's sleep).
    lanes: AtomicUsize,
    /// The listener's probe came back on the current subscription.
    wake_confirmed: AtomicBool,
    /// The server sends keyspace events for every source (its `notify-keyspace-events`).
    keyspace_all: AtomicBool,
    /// Sources an event arrived for on the current subscription.
    keyspace_seen: RwLock<HashSet<String>>,
    /// Route lanes a wake-up named since the stats sampler last asked, polled here or not.
    lane_writes: Mutex<HashSet<u32>>,
    /// A subscription ended (or was not confirmed) since the sampler last asked: wake-ups
    /// may have been missed, so `lane_writes` does not tell which lanes were written.
    lane_writes_unsure: AtomicBool,
    /// The running publishers of each shard, by part (`ReadyPart::name`).
    publishers: RwLock<HashMap<u16, Vec<PartPublisher>>>,
    /// Marks this process's own "queued" messages, which it has acted on already.
    origin: std::sync::OnceLock<String>,
}

/// A poller's side of the wake-ups: what wakes it, and how long it may sleep without one.
pub struct Waker {
    notify: Arc<Notify>,
    wakers: Arc<Wakers>,
    id: TargetId,
}

impl Waker {
    pub async fn notified(&self) {
        self.notify.notified().await
    }

    /// For a shard's mover: the wake message saying it queued jobs for `part`.
    pub fn queued_message(&self, part: &str) -> Option<String> {
        match self.id {
            TargetId::Shard(shard) => Some(self.wakers.queued_message(shard, part)),
            TargetId::Source(_) | TargetId::Lane(_) => None,
        }
    }

    /// The longest sleep without a wake-up: `min` until wake-ups are known to reach this
    /// poller; then `max`, and for a route lane `max` stretched so that a daemon's lanes make
    /// the fallback polls of [`FALLBACK_POLLERS`] targets however many there are (100 lanes
    /// sleep 6.25 × `max`), at most [`LONGEST_FALLBACK`]. Every lane write publishes its
    /// wake-up from inside its script, a lost subscription wakes every poller and they sleep
    /// `min` until it is confirmed again: the stretch only spaces out polls that find nothing.
    pub fn idle(&self, min: Duration, max: Duration) -> Duration {
        if !self.wakers.confirmed(&self.id) {
            return min;
        }
        if !matches!(self.id, TargetId::Lane(_)) {
            return max;
        }
        let lanes = self.wakers.lanes.load(Ordering::Relaxed);
        let stretch = (lanes as f64 / FALLBACK_POLLERS as f64).max(1.0);
        max.mul_f64(stretch).min(LONGEST_FALLBACK.max(max))
    }
}

impl Wakers {
    /// Registers the publisher of `part` in `shard`, woken by `notify` when another daemon's
    /// mover queued jobs there.
    pub fn register_publisher(&self, shard: u16, part: &str, notify: Arc<Notify>) {
        self.publishers
            .write()
            .expect("publishers lock is never poisoned")
            .entry(shard)
            .or_default()
            .push((part.to_owned(), notify));
    }

    /// What a mover publishes on the wake channel after it queued jobs for `part` of `shard`.
    pub fn queued_message(&self, shard: u16, part: &str) -> String {
        format!("q{shard} {} {part}", self.origin())
    }

    fn origin(&self) -> &str {
        self.origin
            .get_or_init(|| format!("{:016x}", rand::random::<u64>()))
    }

    /// Wakes `shard`'s publisher of `part` for another daemon's "queued" message.
    fn wake_queued(&self, payload: &str) -> bool {
        let Some((shard, rest)) = payload.strip_prefix('q').and_then(|p| p.split_once(' ')) else {
            return false;
        };
        let Some((origin, part)) = rest.split_once(' ') else {
            return false;
        };
        let Ok(shard) = shard.parse::<u16>() else {
            return false;
        };
        if origin == self.origin() {
            return false;
        }
        let publishers = self
            .publishers
            .read()
            .expect("publishers lock is never poisoned");
        let mut woken = false;
        for (name, notify) in publishers.get(&shard).into_iter().flatten() {
            if name == part {
                notify.notify_one();
                woken = true;
            }
        }
        woken
    }

    /// Registers a poller and returns the `Notify` it waits on.
    pub fn register(&self, id: &TargetId) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        let replaced = self.write().insert(id.clone(), notify.clone());
        if replaced.is_none() && matches!(id, TargetId::Lane(_)) {
            self.lanes.fetch_add(1, Ordering::Relaxed);
        }
        notify
    }

    /// The [`Waker`] of a registered poller.
    pub fn waker(self: &Arc<Self>, id: &TargetId, notify: Arc<Notify>) -> Waker {
        Waker {
            notify,
            wakers: self.clone(),
            id: id.clone(),
        }
    }

    /// Whether wake-ups are known to reach `id`'s poller.
    fn confirmed(&self, id: &TargetId) -> bool {
        if !self.wake_confirmed.load(Ordering::Relaxed) {
            return false;
        }
        match id {
            TargetId::Shard(_) | TargetId::Lane(_) => true,
            TargetId::Source(key) => {
                self.keyspace_all.load(Ordering::Relaxed)
                    || self
                        .keyspace_seen
                        .read()
                        .expect("keyspace lock is never poisoned")
                        .contains(key)
            }
        }
    }

    /// Sets the `zdelay_wakeups_confirmed` gauges from what is known now.
    fn publish_confirmed(&self, channels: &Channels) {
        let shards = self.wake_confirmed.load(Ordering::Relaxed);
        ::metrics::gauge!(WAKEUPS_CONFIRMED, "targets" => "shards")
            .set(f64::from(u8::from(shards)));
        if !channels.sources.is_empty() {
            let sources = shards
                && (self.keyspace_all.load(Ordering::Relaxed)
                    || self
                        .keyspace_seen
                        .read()
                        .expect("keyspace lock is never poisoned")
                        .len()
                        >= channels.sources.len());
            ::metrics::gauge!(WAKEUPS_CONFIRMED, "targets" => "sources")
                .set(f64::from(u8::from(sources)));
        }
    }

    /// The route lanes written since the last call, as far as wake-ups tell: `None` when
    /// wake-ups were not confirmed at some moment since, so any lane may have been written.
    pub fn take_lane_writes(&self) -> Option<HashSet<u32>> {
        let written = std::mem::take(
            &mut *self
                .lane_writes
                .lock()
                .expect("lane writes lock is never poisoned"),
        );
        let unsure = self.lane_writes_unsure.swap(false, Ordering::Relaxed)
            || !self.wake_confirmed.load(Ordering::Relaxed);
        (!unsure).then_some(written)
    }

    /// A new subscription: nothing is known about it yet.
    fn unconfirm(&self) {
        self.lane_writes_unsure.store(true, Ordering::Relaxed);
        self.wake_confirmed.store(false, Ordering::Relaxed);
        self.keyspace_all.store(false, Ordering::Relaxed);
        self.keyspace_seen
            .write()
            .expect("keyspace lock is never poisoned")
            .clear();
    }

    pub fn remove(&self, id: &TargetId) {
        if self.write().remove(id).is_some() && matches!(id, TargetId::Lane(_)) {
            self.lanes.fetch_sub(1, Ordering::Relaxed);
        }
        if let TargetId::Shard(shard) = id {
            self.publishers
                .write()
                .expect("publishers lock is never poisoned")
                .remove(shard);
        }
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

    /// A test clock moved (`"clock <offset ms>"`): whatever any poller or publisher sleeps
    /// until may be due now, so all wake. False for any other message.
    fn wake_on_clock(&self, payload: &str) -> bool {
        if !payload.starts_with(CLOCK) {
            return false;
        }
        self.wake_all();
        self.wake_all_publishers();
        true
    }

    fn wake_all_publishers(&self) {
        let publishers = self
            .publishers
            .read()
            .expect("publishers lock is never poisoned");
        publishers
            .values()
            .flatten()
            .for_each(|(_, n)| n.notify_one());
    }

    /// Wakes whom a message concerns; true when it is a probe.
    fn dispatch(&self, channels: &Channels, msg: &redis::Msg) -> bool {
        let channel = msg.get_channel_name();
        if channel == channels.wake {
            let payload = String::from_utf8_lossy(msg.get_payload_bytes());
            if payload == PROBE {
                return true;
            }
            if self.wake_on_clock(&payload) {
                ::metrics::counter!(WAKEUPS, "cause" => "clock").increment(1);
                return false;
            }
            if payload.starts_with('q') {
                if self.wake_queued(&payload) {
                    ::metrics::counter!(WAKEUPS, "cause" => "queued").increment(1);
                }
                return false;
            }
            // "<shard> <due>" (layout 1) or "l<lane> <due>" (a route lane, layout 2).
            let name = payload.split(' ').next().unwrap_or_default();
            let target = match name.strip_prefix('l') {
                Some(lane) => zdelay_core::lane_id::parse_base36(lane).map(TargetId::Lane),
                None => name.parse::<u16>().ok().map(TargetId::Shard),
            };
            if let Some(TargetId::Lane(lane)) = target {
                self.lane_writes
                    .lock()
                    .expect("lane writes lock is never poisoned")
                    .insert(lane);
            }
            if let Some(target) = target
                && self.wake(&target)
            {
                ::metrics::counter!(WAKEUPS, "cause" => "enqueue").increment(1);
            }
        } else if let Some(key) = channel.strip_prefix(&channels.keyspace_prefix) {
            // Every raw enqueue brings an event: the write lock only for a source's first.
            let known = self
                .keyspace_seen
                .read()
                .expect("keyspace lock is never poisoned")
                .contains(key);
            if !known {
                self.keyspace_seen
                    .write()
                    .expect("keyspace lock is never poisoned")
                    .insert(key.to_owned());
                self.publish_confirmed(channels);
            }
            if self.wake(&TargetId::Source(key.to_owned())) {
                ::metrics::counter!(WAKEUPS, "cause" => "keyspace").increment(1);
            }
        }
        false
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
    /// Every source lives on the server the listener subscribes to (not a cluster), so that
    /// server's `notify-keyspace-events` speaks for all of them.
    pub one_server: bool,
}

impl Channels {
    pub fn new(
        client: &redis::Client,
        wake: String,
        sources: Vec<String>,
        one_server: bool,
    ) -> Self {
        let db = client.get_connection_info().redis_settings().db();
        Channels {
            wake,
            keyspace_prefix: format!("__keyspace@{db}__:"),
            sources,
            one_server,
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
        wakers.unconfirm();
        wakers.publish_confirmed(&channels);
        match subscribe(client, &channels).await {
            Ok((pubsub, mut publisher)) => {
                delay = Duration::from_millis(100);
                metrics::recovered("pubsub", "wake listener");
                wakers.wake_all();
                if !channels.sources.is_empty() && channels.one_server {
                    let all = keyspace_events_for_zsets(&mut publisher).await;
                    wakers.keyspace_all.store(all, Ordering::Relaxed);
                    wakers.publish_confirmed(&channels);
                }
                let mut messages = pubsub.into_on_message();
                let mut probes = tokio::time::interval(PROBE_EVERY);
                // Since when a probe is out, not seen back yet.
                let mut probe_out: Option<Instant> = None;
                let ended = loop {
                    tokio::select! {
                        msg = messages.next() => match msg {
                            Some(msg) => if wakers.dispatch(&channels, &msg) {
                                probe_out = None;
                                if !wakers.wake_confirmed.swap(true, Ordering::Relaxed) {
                                    wakers.publish_confirmed(&channels);
                                }
                            },
                            None => break "subscription closed".to_owned(),
                        },
                        _ = probes.tick() => {
                            if let Some(sent) = probe_out
                                && sent.elapsed() >= PROBE_TIMEOUT
                            {
                                break format!(
                                    "the wake-up probe did not come back within {PROBE_TIMEOUT:?}"
                                );
                            }
                            let sent: redis::RedisResult<()> = redis::cmd("PUBLISH")
                                .arg(&channels.wake)
                                .arg(PROBE)
                                .query_async(&mut publisher)
                                .await;
                            match sent {
                                Ok(()) => {
                                    probe_out.get_or_insert_with(Instant::now);
                                }
                                // Unconfirmed until a probe goes out and comes back.
                                Err(_) => {
                                    wakers.wake_confirmed.store(false, Ordering::Relaxed);
                                    wakers.publish_confirmed(&channels);
                                }
                            }
                        }
                        _ = shutdown.cancelled() => return,
                    }
                };
                wakers.unconfirm();
                wakers.publish_confirmed(&channels);
                // Wake-ups may be missed from now on: every poller looks now, and sleeps
                // `idle_poll` again until a new subscription is confirmed.
                wakers.wake_all();
                metrics::error_event("pubsub", "wake listener", &ended);
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

/// The subscription, and a connection of its own to publish probes on.
async fn subscribe(
    client: &redis::Client,
    channels: &Channels,
) -> redis::RedisResult<(redis::aio::PubSub, redis::aio::MultiplexedConnection)> {
    let publisher = client.get_multiplexed_async_connection().await?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(&channels.wake).await?;
    for key in &channels.sources {
        pubsub
            .subscribe(format!("{}{key}", channels.keyspace_prefix))
            .await?;
    }
    Ok((pubsub, publisher))
}

/// Whether the server sends keyspace events for sorted-set commands: `K` and `z` (or `A`)
/// in its `notify-keyspace-events`. False when it cannot be read (e.g. `CONFIG` is refused
/// by an ACL or a managed service): then each source is confirmed by an event of its own.
async fn keyspace_events_for_zsets(con: &mut redis::aio::MultiplexedConnection) -> bool {
    let flags: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("notify-keyspace-events")
        .query_async(con)
        .await;
    flags
        .ok()
        .and_then(|f| f.get(1).cloned())
        .is_some_and(|f| notify_flags_cover_zsets(&f))
}

/// `notify-keyspace-events` flags that make keyspace (`K`) events of sorted-set commands
/// (`z`, or `A`: all classes).
fn notify_flags_cover_zsets(flags: &str) -> bool {
    flags.contains('K') && (flags.contains('z') || flags.contains('A'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn zset_keyspace_events_need_k_and_z_or_a() {
        assert!(notify_flags_cover_zsets("Kz"));
        assert!(notify_flags_cover_zsets("KEA"));
        assert!(notify_flags_cover_zsets("zK"));
        assert!(!notify_flags_cover_zsets("Ez"), "keyevent only");
        assert!(!notify_flags_cover_zsets("K$"), "strings only");
        assert!(!notify_flags_cover_zsets(""));
    }

    #[test]
    fn pollers_sleep_long_only_while_wake_ups_are_confirmed() {
        let wakers = Arc::new(Wakers::default());
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        let shard = wakers.waker(&TargetId::Shard(3), Arc::new(Notify::new()));
        let source = wakers.waker(&TargetId::Source("raw:a".into()), Arc::new(Notify::new()));
        assert_eq!(shard.idle(min, max), min, "nothing confirmed yet");
        wakers.wake_confirmed.store(true, Ordering::Relaxed);
        assert_eq!(shard.idle(min, max), max);
        assert_eq!(source.idle(min, max), min, "no keyspace event seen");
        wakers.keyspace_seen.write().unwrap().insert("raw:a".into());
        assert_eq!(source.idle(min, max), max);
        wakers.unconfirm();
        assert_eq!(
            shard.idle(min, max),
            min,
            "a new subscription starts unconfirmed"
        );
        assert_eq!(source.idle(min, max), min);
        wakers.wake_confirmed.store(true, Ordering::Relaxed);
        wakers.keyspace_all.store(true, Ordering::Relaxed);
        assert_eq!(
            source.idle(min, max),
            max,
            "the server sends every source's events"
        );
    }

    #[test]
    fn a_queued_message_wakes_another_daemons_publisher_of_that_part_only() {
        let (here, there) = (Wakers::default(), Wakers::default());
        let (bus, flow, other_shard) = (
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
        );
        there.register_publisher(3, "bus", bus.clone());
        there.register_publisher(3, "bus:limited", flow.clone());
        there.register_publisher(4, "bus", other_shard.clone());
        let message = here.queued_message(3, "bus:limited");
        assert!(!here.wake_queued(&message), "a daemon ignores its own");
        assert!(there.wake_queued(&message));
        let woken = |n: &Notify| n.notified().now_or_never().is_some();
        assert!(woken(&flow));
        assert!(
            !woken(&bus) && !woken(&other_shard),
            "only that part of that shard"
        );
        for bad in ["q", "q3", "q3 x", "qx y bus", "q99999 y bus", "q3 y nobody"] {
            assert!(!there.wake_queued(bad), "{bad:?}");
        }
        there.remove(&TargetId::Shard(3));
        assert!(
            !there.wake_queued(&message),
            "a stopped shard's publishers are gone"
        );
    }

    #[test]
    fn a_clock_message_wakes_every_poller_and_publisher() {
        let wakers = Wakers::default();
        let lane = wakers.register(&TargetId::Lane(7));
        let shard = wakers.register(&TargetId::Shard(2));
        let publisher = Arc::new(Notify::new());
        wakers.register_publisher(2, "bus", publisher.clone());
        let woken = |n: &Notify| n.notified().now_or_never().is_some();
        for other in [
            "probe",
            "l7 1700000000000",
            "2 1700000000000",
            "q2 x bus",
            "clockwork",
        ] {
            assert!(!wakers.wake_on_clock(other), "{other:?}");
        }
        assert!(!woken(&lane) && !woken(&shard) && !woken(&publisher));
        assert!(wakers.wake_on_clock("clock 2592000000"));
        assert!(woken(&lane) && woken(&shard) && woken(&publisher));
    }

    #[test]
    fn many_pollers_space_their_fallback_polls_out() {
        let wakers = Arc::new(Wakers::default());
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        for lane in 0..100 {
            wakers.register(&TargetId::Lane(lane));
        }
        let lane = wakers.waker(&TargetId::Lane(7), Arc::new(Notify::new()));
        assert_eq!(lane.idle(min, max), min, "nothing confirmed yet");
        wakers.wake_confirmed.store(true, Ordering::Relaxed);
        // 100 pollers poll like 16: each sleeps 100 / 16 × 5 s.
        assert_eq!(lane.idle(min, max), Duration::from_millis(31_250));
        for extra in 100..1000 {
            wakers.register(&TargetId::Lane(extra));
        }
        assert_eq!(lane.idle(min, max), LONGEST_FALLBACK);
        wakers.unconfirm();
        assert_eq!(lane.idle(min, max), min);
        // Shards keep `max`: raw producers may write their jobs without a wake-up.
        wakers.wake_confirmed.store(true, Ordering::Relaxed);
        for shard in 0..256 {
            wakers.register(&TargetId::Shard(shard));
        }
        let shard = wakers.waker(&TargetId::Shard(3), Arc::new(Notify::new()));
        assert_eq!(shard.idle(min, max), max);
    }
}
