//! What a shard's mover claims at once for this daemon's publishers.
//!
//! A due job of a two-phase route is claimed by the move that takes it off the due set when a
//! publisher of its part of the ready set here has room (a batch slot and bytes of its sink's
//! in-flight bounds): its envelope comes back in the move's reply and is published at once.
//! Queueing it in the ready set first, and claiming it from there, costs Redis about twice as
//! much per job; that path stays for the parts whose jobs cannot be published now: a paused
//! sink, a route with flow control (claimed through its gate), a sink with no handle or no
//! running publisher here, and a sink that stayed without room for [`PARK_AFTER`] while its
//! jobs held up the move, until it has room again. A sink that keeps delivering is waited
//! for longer when the last look found no other part's jobs behind its jobs (a slow broker
//! with the shard to itself: its jobs keep the cheaper path); a look reads on past its jobs
//! without queueing them, so looking again costs a read, not a detour of a batch.

use super::context::PollerContext;
use super::delivery;
use crate::metrics;
use crate::sinks::{InFlight, SinkHandle};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zdelay_core::store::scripts::{MoveReply, PartClaim, Take};

/// How long a move whose batch a part without room cut waits for that part's room before it
/// queues the part's jobs in the ready set instead: a slow or hung broker holds up the other
/// parts' jobs that long at most (see [`Takes::wait_for_room`]).
pub const PARK_AFTER: Duration = Duration::from_millis(250);

/// How long a slow sink whose jobs had nothing behind them is waited for before the next
/// move looks again whether other parts' jobs wait behind them: how long such jobs may
/// wait behind a slow sink's backlog.
pub const LOOK_BEHIND_EVERY: Duration = Duration::from_secs(5);

/// A sink without room that delivered a batch within this is slow, not hung (a broker's
/// batches in flight complete in bursts, and a broker such as RabbitMQ pauses for a second
/// or more now and then, so this is well over [`PARK_AFTER`]). It only keeps a sink's jobs
/// waiting that no other part's jobs are behind.
pub const SLOW_NOT_HUNG: Duration = Duration::from_secs(2);

/// A shard mover's link to its publisher of one part of the ready set.
pub struct Link {
    /// Wakes the publisher: the mover queued jobs for it.
    pub wake: Arc<Notify>,
    /// The publisher runs: the mover may claim for its part.
    pub started: AtomicBool,
    /// One batch of the part in flight at a time, claimed by the mover or the publisher: a
    /// daemon whose settle hangs publishes a job once, however often its lease runs out.
    pub gate: Arc<Semaphore>,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            wake: Arc::default(),
            started: AtomicBool::new(false),
            gate: Arc::new(Semaphore::new(1)),
        }
    }
}

impl Link {
    pub fn mark_started(&self) {
        self.started.store(true, Ordering::Release);
    }

    /// Room for a batch of up to `bytes` of `sink` now, if there is any.
    fn try_room(&self, sink: &SinkHandle, bytes: usize) -> Option<Room> {
        let turn = self.gate.clone().try_acquire_owned().ok()?;
        Some(Room {
            _turn: turn,
            in_flight: sink.try_permit(bytes)?,
        })
    }

    /// Waits for room for a batch of up to `bytes` of `sink`: the part's turn, then the
    /// sink's in-flight bounds.
    pub async fn room(&self, sink: &SinkHandle, bytes: usize) -> Room {
        let turn = self
            .gate
            .clone()
            .acquire_owned()
            .await
            .expect("the gate is never closed");
        Room {
            _turn: turn,
            in_flight: sink.permit(bytes).await,
        }
    }
}

/// Room for one batch of a part: its turn (the link's gate) and its sink's in-flight bounds.
/// Dropping it (once the batch is settled) gives both back.
pub struct Room {
    _turn: OwnedSemaphorePermit,
    in_flight: InFlight,
}

impl Room {
    /// The claim took `used` bytes: the rest goes back at once (`InFlight::keep`).
    pub fn keep(&mut self, used: usize) {
        self.in_flight.keep(used);
    }
}

/// Per part of the ready set (in `ctx.sink_order`): what the next move takes for it.
pub struct Takes {
    links: Vec<Option<Arc<Link>>>,
    /// Queueing this part's jobs until its sink has room again.
    parking: Vec<bool>,
    /// When a look last found no other part's job behind this part's jobs: while its sink
    /// delivers, waiting for its room holds up nothing else, for [`LOOK_BEHIND_EVERY`].
    alone: Vec<Option<Instant>>,
    /// The next move without room for this part looks behind its jobs ([`Take::Look`]).
    looking: Vec<bool>,
    /// Room waited for after a cut, for the next move.
    held: Vec<Option<Room>>,
}

impl Takes {
    pub fn new(links: Vec<Option<Arc<Link>>>) -> Self {
        let n = links.len();
        Takes {
            links,
            parking: vec![false; n],
            // Until a first look says otherwise, a slow sink is taken to have the shard to
            // itself (a hung one is not waited for either way).
            alone: vec![Some(Instant::now()); n],
            looking: vec![false; n],
            held: (0..n).map(|_| None).collect(),
        }
    }

    pub fn links(&self) -> &[Option<Arc<Link>>] {
        &self.links
    }

    /// What the next move takes per part, with the room taken for the parts it claims for
    /// (dropped unused once the move answered).
    pub fn next(&mut self, ctx: &PollerContext) -> (Vec<Take>, Vec<Option<Room>>) {
        let policy = &ctx.delivery;
        let mut takes = Vec::with_capacity(self.links.len());
        let mut room = Vec::with_capacity(self.links.len());
        for (i, part) in ctx.sink_order.iter().enumerate() {
            let link = self.links.get(i).and_then(Option::as_ref);
            let claimable = part.as_ref().zip(link).filter(|(part, link)| {
                part.flow.is_none()
                    && !part.sink.is_paused()
                    && link.started.load(Ordering::Acquire)
            });
            let Some((part, link)) = claimable else {
                self.held[i] = None;
                takes.push(Take::Queue);
                room.push(None);
                continue;
            };
            let bytes = policy.batch_bytes.min(part.sink.bytes_bound());
            let permit = self.held[i]
                .take()
                .or_else(|| link.try_room(&part.sink, bytes));
            takes.push(match (&permit, self.parking[i]) {
                (Some(_), _) => {
                    self.parking[i] = false;
                    Take::Claim {
                        jobs: policy.batch,
                        bytes,
                    }
                }
                (None, true) => Take::Queue,
                (None, false) if self.looking[i] => Take::Look {
                    depth: policy.batch,
                },
                (None, false) => Take::Wait,
            });
            room.push(permit);
        }
        (takes, room)
    }

    /// A move was cut by `part`'s lack of room: waits up to [`PARK_AFTER`] for it (kept for
    /// the next move), else queues its jobs until it has room again; waits on while its sink
    /// delivers if the last look found nothing else behind its jobs, and has the next move
    /// look again once that look is [`LOOK_BEHIND_EVERY`] old.
    pub async fn wait_for_room(
        &mut self,
        ctx: &PollerContext,
        part: usize,
        stop: &CancellationToken,
    ) {
        let (Some(Some(ready)), Some(Some(link))) =
            (ctx.sink_order.get(part), self.links.get(part))
        else {
            return;
        };
        let bytes = ctx.delivery.batch_bytes.min(ready.sink.bytes_bound());
        let room = link.room(&ready.sink, bytes);
        tokio::pin!(room);
        loop {
            tokio::select! {
                room = tokio::time::timeout(PARK_AFTER, &mut room) => match room {
                    Ok(room) => self.held[part] = Some(room),
                    // A sink that delivers is slow, not stuck: its jobs keep their place,
                    // unless other parts' jobs wait behind them.
                    Err(_)
                        if self.alone[part].is_some()
                            && ready.sink.progressed_within(SLOW_NOT_HUNG) =>
                    {
                        if self.alone[part].is_some_and(|at| at.elapsed() < LOOK_BEHIND_EVERY) {
                            continue;
                        }
                        self.looking[part] = true;
                    }
                    Err(_) => self.parking[part] = true,
                },
                _ = stop.cancelled() => {}
            }
            return;
        }
    }

    /// Learns from a move whether the jobs of the parts it looked behind, or queued for want
    /// of room, had other parts' jobs behind them.
    pub fn learn(&mut self, takes: &[Take], reply: &MoveReply) {
        for (part, take) in takes.iter().enumerate() {
            let looked = matches!(take, Take::Look { .. });
            if !looked && (*take != Take::Queue || !self.parking[part]) {
                continue;
            }
            let others = reply.claimed.iter().any(|c| c.part != part)
                || reply
                    .queued
                    .iter()
                    .enumerate()
                    .any(|(q, n)| q != part && *n > 0);
            self.alone[part] = (!others).then(Instant::now);
            self.looking[part] = false;
            // Queueing its jobs freed nothing else: wait for its room again instead.
            if !others {
                self.parking[part] = false;
            }
        }
    }

    /// The part to wait for instead of moving, when a move now would likely read its jobs
    /// only to leave them due: `blocking` (the part that cut the last move or filled its
    /// batch) has no room, or the only part has none.
    pub fn wait_first(takes: &[Take], blocking: Option<usize>) -> Option<usize> {
        match blocking {
            Some(part) if takes.get(part) == Some(&Take::Wait) => Some(part),
            _ => (takes.len() == 1 && takes[0] == Take::Wait).then_some(0),
        }
    }
}

/// Publishes and settles each part's claimed jobs in a task of its own (tracked, so a stop
/// waits for them), holding the room taken for it until settled.
pub fn deliver(
    ctx: &Arc<PollerContext>,
    shard: u16,
    claimed: Vec<PartClaim>,
    room: &mut [Option<Room>],
    claimed_at: Instant,
    tracker: &TaskTracker,
) {
    for PartClaim { part, claim } in claimed {
        let (Some(Some(ready)), Some(mut permit)) = (
            ctx.sink_order.get(part),
            room.get_mut(part).and_then(Option::take),
        ) else {
            // Never claimed without both; the lease brings the jobs back if it ever were.
            tracing::error!(
                part,
                "claimed jobs for a part without room; their lease returns them"
            );
            continue;
        };
        permit.keep(claim.bytes());
        let (ctx, ready) = (ctx.clone(), ready.clone());
        tracker.spawn(async move {
            let batch = delivery::ClaimedBatch {
                part: &ready.name,
                claim: &claim,
                claimed_at,
                held_since_ms: None,
                turns: &[],
            };
            let sink: &SinkHandle = &ready.sink;
            if let Err(e) = delivery::deliver(&ctx, shard, sink, &batch).await {
                // The batch stays in flight; its lease lapses wherever it lands.
                let label = format!("sink {} shard {shard}", ready.name);
                metrics::error_event("redis", &label, &e);
            }
            drop(permit);
        });
    }
}
