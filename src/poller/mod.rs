//! The pollers: one move loop per owned target (envelope shard or raw source), started and
//! stopped at run time by a supervisor that follows a watch of owned targets, plus the
//! wake-up listener that cuts their sleeps short.
//!
//! - `context`: what the pollers share (connection, keys, routes, sinks, settings);
//! - `mover`: one target's loop (move script, sleep until the head is due);
//! - `publisher`: per owned shard and two-phase sink, claims the sink's waiting jobs;
//! - `takes`: what a shard's moves claim at once for this daemon's publishers, and the
//!   deliveries of those claims;
//! - `delivery`: the two-phase path for the jobs a publisher claimed (publish, confirm,
//!   settle);
//! - `wake`: the pub/sub listener;
//! - `ownership`: which targets this instance polls.
//!
//! Imports only go one way: `publisher` → `delivery` → `context`, `publisher` → `mover`
//! (its backoff) → `takes` → `delivery`; `delivery` never calls a loop.
//! The daemon (`app`) and the benchmark start pollers through [`start`] alike.

mod context;
mod delivery;
mod mover;
mod ownership;
mod publisher;
mod takes;
mod wake;

pub use context::{
    BatchObserver, DeliveryPolicy, ENVELOPE_SOURCE, MoverSettings, PollerContext, RawDelivery,
    RawSource, Sinks, Target, TargetId, refusal_message,
};
pub use delivery::retry_delay;
pub use mover::{move_once, move_walking, sleep_after};
pub use ownership::{InstanceIdInUse, Leases, Owned, Ownership, slot_name, target_of};

use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wake::Channels;
pub use wake::Wakers;

/// How pollers are started.
#[derive(Default)]
pub struct Options {
    /// Listen for wake-ups through these clients (pub/sub needs its own connection; on a
    /// cluster, one per seed node, tried in turn). Empty: pollers wake only at their head's
    /// due time or the idle poll.
    pub wake_clients: Vec<redis::Client>,
    pub on_batch: Option<BatchObserver>,
}

/// Running pollers. Stopping lets every poller finish its script call and the batch in
/// hand.
pub struct Pollers {
    tracker: TaskTracker,
    stop: CancellationToken,
    wakers: Arc<Wakers>,
}

impl Pollers {
    /// What the wake-up listener knows, for the stats sampler.
    pub fn wakers(&self) -> Arc<Wakers> {
        self.wakers.clone()
    }

    /// Stops every poller and waits for them.
    pub async fn stop(self) {
        self.stop.cancel();
        self.wait().await;
    }

    /// Waits until they stopped (after `shutdown` was cancelled).
    pub async fn wait(&self) {
        self.tracker.wait().await;
    }
}

/// Starts the supervisor (and the wake listener): a poller for every target in `owned`,
/// following its changes, until `shutdown`.
pub fn start(
    ctx: Arc<PollerContext>,
    owned: watch::Receiver<Owned>,
    options: Options,
    shutdown: &CancellationToken,
) -> Pollers {
    let stop = shutdown.child_token();
    let tracker = TaskTracker::new();
    let wakers = Arc::new(Wakers::default());
    if let Some(first) = options.wake_clients.first() {
        let sources = ctx.sources.iter().map(|s| s.keys.source.clone()).collect();
        let one_server = options.wake_clients.len() == 1 && !ctx.con.is_cluster();
        let channels = Channels::new(first, ctx.keys.wake_channel(), sources, one_server);
        tracker.spawn(wake::listen(
            options.wake_clients,
            channels,
            wakers.clone(),
            stop.clone(),
        ));
    }
    let supervisor = Supervisor {
        ctx,
        wakers: wakers.clone(),
        on_batch: options.on_batch,
        tracker: tracker.clone(),
        stop: stop.clone(),
        running: HashMap::new(),
    };
    tracker.spawn(supervisor.run(owned));
    tracker.close();
    Pollers {
        tracker,
        stop,
        wakers,
    }
}

struct Supervisor {
    ctx: Arc<PollerContext>,
    wakers: Arc<Wakers>,
    on_batch: Option<BatchObserver>,
    tracker: TaskTracker,
    stop: CancellationToken,
    /// The running pollers, each with its own stop token.
    running: HashMap<TargetId, CancellationToken>,
}

impl Supervisor {
    async fn run(mut self, mut owned: watch::Receiver<Owned>) {
        loop {
            let wanted = owned.borrow_and_update().clone();
            self.follow(&wanted);
            tokio::select! {
                changed = owned.changed() => if changed.is_err() {
                    // Nobody decides ownership any more: keep what runs until the stop.
                    self.stop.cancelled().await;
                    break;
                },
                _ = self.stop.cancelled() => break,
            }
        }
        for token in self.running.values() {
            token.cancel();
        }
    }

    /// Stops the pollers of targets no longer owned and starts those of new ones.
    fn follow(&mut self, wanted: &Owned) {
        let wakers = &self.wakers;
        self.running.retain(|id, token| {
            let keep = wanted.contains(id);
            if !keep {
                tracing::info!(target = ?id, "no longer polling");
                token.cancel();
                wakers.remove(id);
            }
            keep
        });
        for id in wanted {
            if self.running.contains_key(id) {
                continue;
            }
            let Some(target) = self.ctx.target(id) else {
                tracing::warn!(target = ?id, "asked to poll a target this config does not have");
                continue;
            };
            let token = self.stop.child_token();
            let notify = self.wakers.register(id);
            if let Target::Source(source) = &target
                && let RawDelivery::Sink(dest) = &source.delivery
            {
                match self.ctx.sinks.get(&dest.sink) {
                    Some(sink) => {
                        self.tracker.spawn(publisher::run_raw(
                            self.ctx.clone(),
                            source.clone(),
                            sink.clone(),
                            self.wakers.waker(id, notify),
                            token.clone(),
                        ));
                        self.running.insert(id.clone(), token);
                    }
                    None => tracing::warn!(
                        source = %source.keys.source,
                        sink = %dest.sink,
                        "raw source's sink is not built here; not polling it"
                    ),
                }
                continue;
            }
            let publishers = match &target {
                Target::Shard(shard) => self.start_publishers(*shard, &token),
                Target::Source(_) | Target::Lane(_) => Vec::new(),
            };
            self.tracker.spawn(mover::run(
                self.ctx.clone(),
                target,
                self.wakers.waker(id, notify),
                takes::Takes::new(publishers),
                self.tracker.clone(),
                token.clone(),
                self.on_batch.clone(),
            ));
            self.running.insert(id.clone(), token);
        }
    }

    /// A publisher per part of the ready set (two-phase sink or flow part) for `shard`,
    /// stopped with the shard's mover; returns the mover's links to them in `ctx.sink_order`.
    fn start_publishers(
        &self,
        shard: u16,
        token: &CancellationToken,
    ) -> Vec<Option<Arc<takes::Link>>> {
        self.ctx
            .sink_order
            .iter()
            .map(|part| {
                let part = part.as_ref()?;
                let link = Arc::new(takes::Link::default());
                self.wakers
                    .register_publisher(shard, &part.name, link.wake.clone());
                // Woken by the shard's mover, or another daemon's through the wake channel;
                // its fallback sleep follows the shard's wake-ups.
                self.tracker.spawn(publisher::run(
                    self.ctx.clone(),
                    shard,
                    part.clone(),
                    self.wakers
                        .waker(&TargetId::Shard(shard), link.wake.clone()),
                    link.clone(),
                    token.clone(),
                ));
                Some(link)
            })
            .collect()
    }
}
