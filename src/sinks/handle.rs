//! A sink with its run-time state: paused while unavailable, bounds on the batches and bytes
//! it has in flight, and its health for `/readyz`, the `zdelay_sink_up` gauge and `zdelay
//! stats`.

use super::Sink;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Longest pause of an unavailable sink.
const MAX_PAUSE: Duration = Duration::from_secs(30);

/// The error kind (`zdelay_errors_total`) and episode of a sink that cannot deliver.
pub const UNAVAILABLE: &str = "sink_unavailable";

/// The byte bound of a handle built without one (`poller.sink_inflight_bytes`' default).
const DEFAULT_BYTES: usize = 64 << 20;

/// One batch's room in its sink's in-flight bounds: a batch slot, and the bytes reserved for
/// its claim. Dropping it (once the batch is settled) gives both back.
pub struct InFlight {
    _batch: OwnedSemaphorePermit,
    bytes: OwnedSemaphorePermit,
}

impl InFlight {
    /// The claim took `used` bytes: the rest of the reservation goes back at once. A claim of
    /// one job larger than the reservation keeps the reservation (the bound is exceeded by
    /// that job alone).
    pub fn keep(&mut self, used: usize) {
        let reserved = self.bytes.num_permits();
        if used < reserved {
            drop(self.bytes.split(reserved - used));
        }
    }
}

/// A held target: the broker's latest reason, and whether its warning was logged.
struct Held {
    why: String,
    logged: bool,
}

/// A sink with its run-time state: paused while unavailable, health for `/readyz`.
pub struct SinkHandle {
    pub name: String,
    pub kind: &'static str,
    pub sink: Box<dyn Sink>,
    /// Where the sink connects, and what it expects there (for diagnosing a failed check).
    pub endpoints: (super::peer::Protocol, Vec<String>),
    first_pause: Duration,
    /// (paused until, next pause length)
    pause: Mutex<(Option<Instant>, Duration)>,
    /// Set by `pause`, cleared by a passing health check: a paused sink resumes only once
    /// its broker answers again, so no poller blocks on a publish to a broker known down.
    awaiting_check: AtomicBool,
    healthy: AtomicBool,
    last_error: Mutex<String>,
    /// One permit per batch in flight (across shards): a slow sink cannot pile up claims.
    in_flight: Arc<Semaphore>,
    /// One permit per byte claimed and not yet settled (across shards and raw sources): a
    /// slow sink cannot pile up large payloads either.
    in_flight_bytes: Arc<Semaphore>,
    /// The size of `in_flight_bytes`.
    bytes_bound: usize,
    /// Signalled when the sink is usable again, for publishers waiting out a pause.
    resumed: Notify,
    /// Targets whose destination object is missing, with the broker's reason and whether
    /// that was logged: their jobs wait (`Outcome::Missing`) until a message to them is
    /// delivered.
    held: Mutex<BTreeMap<String, Held>>,
    /// When the sink last made progress: a publish went through, or it went from no batch in
    /// flight to one (its first batches may take a while to go through).
    last_progress: Mutex<Option<Instant>>,
    /// Batches it may have in flight at once (`in_flight`'s size).
    concurrency: usize,
}

impl SinkHandle {
    /// `first_pause`: the first pause after an unavailable outcome (it doubles while the sink
    /// stays down); `concurrency`: batches it may have in flight at once.
    pub fn new(
        name: &str,
        kind: &'static str,
        sink: Box<dyn Sink>,
        first_pause: Duration,
        concurrency: usize,
    ) -> Self {
        // Exported from the start (0), so dashboards and alerts see the series before any
        // target is held.
        ::metrics::gauge!(crate::metrics::SINK_HELD_TARGETS, "sink" => name.to_owned()).set(0.0);
        SinkHandle {
            name: name.to_owned(),
            kind,
            sink,
            endpoints: (super::peer::Protocol::Redis, Vec::new()),
            first_pause,
            pause: Mutex::new((None, first_pause)),
            awaiting_check: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            last_error: Mutex::new(String::new()),
            in_flight: Arc::new(Semaphore::new(concurrency.max(1))),
            in_flight_bytes: Arc::new(Semaphore::new(DEFAULT_BYTES)),
            bytes_bound: DEFAULT_BYTES,
            resumed: Notify::new(),
            held: Mutex::default(),
            last_progress: Mutex::default(),
            concurrency: concurrency.max(1),
        }
    }

    /// Bounds the bytes the sink has in flight at `bytes` (at least 1).
    pub fn with_inflight_bytes(mut self, bytes: usize) -> Self {
        self.bytes_bound = bytes.clamp(1, u32::MAX as usize);
        self.in_flight_bytes = Arc::new(Semaphore::new(self.bytes_bound));
        self
    }

    /// Waits for room for one more batch in flight of up to `bytes` (at most the whole byte
    /// bound): the batch's claim may then take that many bytes.
    pub async fn permit(&self, bytes: usize) -> InFlight {
        let batch = self
            .in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("the in-flight semaphore is never closed");
        self.started_batch();
        let bytes = bytes.clamp(1, self.bytes_bound) as u32;
        let bytes = self
            .in_flight_bytes
            .clone()
            .acquire_many_owned(bytes)
            .await
            .expect("the in-flight bytes semaphore is never closed");
        InFlight {
            _batch: batch,
            bytes,
        }
    }

    /// Room for one more batch of up to `bytes` now, if there is any (see [`Self::permit`]).
    pub fn try_permit(&self, bytes: usize) -> Option<InFlight> {
        let batch = self.in_flight.clone().try_acquire_owned().ok()?;
        let bytes = bytes.clamp(1, self.bytes_bound) as u32;
        let bytes = self
            .in_flight_bytes
            .clone()
            .try_acquire_many_owned(bytes)
            .ok()?;
        self.started_batch();
        Some(InFlight {
            _batch: batch,
            bytes,
        })
    }

    /// The most bytes the sink may have in flight.
    pub fn bytes_bound(&self) -> usize {
        self.bytes_bound
    }

    /// Bytes in flight now (claimed, not yet settled), for tests and metrics.
    pub fn bytes_in_flight(&self) -> usize {
        self.bytes_bound - self.in_flight_bytes.available_permits()
    }

    /// Waits until the sink may be usable again: resumed, or `limit` passed (a pause also
    /// ends by the clock; the caller checks `is_paused` again).
    pub async fn wait_resumed(&self, limit: Duration) {
        let resumed = self.resumed.notified();
        if !self.is_paused() {
            return;
        }
        let _ = tokio::time::timeout(limit, resumed).await;
    }

    /// Paused: for the pause's length, and after it until a health check passes.
    pub fn is_paused(&self) -> bool {
        let pause = self.pause.lock().expect("pause lock");
        pause.0.is_some_and(|until| Instant::now() < until)
            || self.awaiting_check.load(Ordering::Relaxed)
    }

    /// How long a pause has left: the rest of its time, or, once only the health check is
    /// awaited, the next pause's length (it grows while the sink stays down).
    pub fn pause_remaining(&self) -> Duration {
        let pause = self.pause.lock().expect("pause lock");
        let left = pause
            .0
            .map(|until| until.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        if left.is_zero() && self.awaiting_check.load(Ordering::Relaxed) {
            pause.1
        } else {
            left
        }
    }

    /// The sink was found unavailable: pause it, doubling the pause while it stays down.
    pub fn pause(&self, why: &str) -> Duration {
        let mut pause = self.pause.lock().expect("pause lock");
        let length = pause.1;
        *pause = (Some(Instant::now() + length), (length * 2).min(MAX_PAUSE));
        self.awaiting_check.store(true, Ordering::Relaxed);
        self.set_health(Err(why.to_owned()));
        length
    }

    /// A background health check's answer: a pass lets a paused sink resume after its pause.
    pub fn checked(&self, result: Result<(), String>) {
        if result.is_ok() && self.awaiting_check.swap(false, Ordering::Relaxed) {
            self.resumed.notify_waiters();
        }
        self.set_health(result);
    }

    fn progressed(&self) {
        *self.last_progress.lock().expect("progress lock") = Some(Instant::now());
    }

    /// A batch was taken into flight: the first while none was counts as progress (none had
    /// the time to go through yet).
    fn started_batch(&self) {
        if self.in_flight.available_permits() + 1 >= self.concurrency {
            self.progressed();
        }
    }

    /// A publish went through within `window`, or the sink's batches in flight started
    /// within it from none: the sink is slow, not stuck.
    pub fn progressed_within(&self, window: Duration) -> bool {
        self.last_progress
            .lock()
            .expect("progress lock")
            .is_some_and(|at| at.elapsed() < window)
    }

    /// A publish went through: the sink works again.
    pub fn resume(&self) {
        self.progressed();
        let mut pause = self.pause.lock().expect("pause lock");
        *pause = (None, self.first_pause);
        self.awaiting_check.store(false, Ordering::Relaxed);
        drop(pause);
        self.resumed.notify_waiters();
        self.set_health(Ok(()));
    }

    /// Records what the sink's last check or publish found. Its log is one line when an outage
    /// starts and one when it ends (the errors between are counted, not logged): the episode
    /// is `metrics::error_event`'s, which the Kafka client's own errors join.
    pub fn set_health(&self, result: Result<(), String>) {
        let ok = result.is_ok();
        // Broker errors may quote the address with its credentials.
        *self.last_error.lock().expect("error lock") = result
            .as_ref()
            .err()
            .map(|e| crate::config::redact_known(e).into_owned())
            .unwrap_or_default();
        self.healthy.store(ok, Ordering::Relaxed);
        match result {
            Ok(()) => crate::metrics::recovered(UNAVAILABLE, &self.name),
            Err(why) => crate::metrics::error_event(UNAVAILABLE, &self.name, &why),
        }
    }

    /// Marks `target` held: its destination object is missing. Logged when it starts, or
    /// when it outlasts the sink's outage: a broker starting or stopping may answer "no such
    /// destination" for a moment, which is part of the outage (counted into its end line),
    /// not news of its own.
    pub fn hold(&self, target: &str, why: &str) {
        let why = crate::config::redact_known(why).replace('\n', " ");
        let mut held = self.held.lock().expect("held lock");
        let entry = match held.get_mut(target) {
            Some(entry) => {
                entry.why = why;
                entry
            }
            None => {
                held.insert(target.to_owned(), Held { why, logged: false });
                ::metrics::gauge!(crate::metrics::SINK_HELD_TARGETS, "sink" => self.name.clone())
                    .set(held.len() as f64);
                held.get_mut(target).expect("inserted above")
            }
        };
        if !entry.logged && !crate::metrics::absorbed_by_outage(&self.name) {
            entry.logged = true;
            tracing::warn!(
                sink = %self.name,
                target,
                reason = %entry.why,
                "destination missing: its jobs wait (no attempt counted) until it exists"
            );
        }
    }

    /// A message to `target` was delivered: it is not held (any more).
    pub fn unhold(&self, target: &str) {
        let mut held = self.held.lock().expect("held lock");
        let Some(was) = held.remove(target) else {
            return;
        };
        if was.logged {
            tracing::info!(sink = %self.name, target, "destination exists again: its jobs flow");
        }
        ::metrics::gauge!(crate::metrics::SINK_HELD_TARGETS, "sink" => self.name.clone())
            .set(held.len() as f64);
    }

    /// The held targets and why.
    pub fn held(&self) -> BTreeMap<String, String> {
        let held = self.held.lock().expect("held lock");
        held.iter()
            .map(|(target, h)| (target.clone(), h.why.clone()))
            .collect()
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn last_error(&self) -> String {
        self.last_error.lock().expect("error lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sinks::redis_remote::RedisRemoteSink;
    use zdelay_core::config::from_toml;

    fn unreachable_sink() -> Box<dyn Sink> {
        Box::new(
            RedisRemoteSink::new("other", "redis://127.0.0.1:1", &from_toml("").unwrap()).unwrap(),
        )
    }

    #[test]
    fn a_paused_sink_resumes_only_after_its_pause_and_a_passing_check() {
        let h = SinkHandle::new("other", "redis", unreachable_sink(), Duration::ZERO, 1);
        assert!(!h.is_paused());
        h.pause("connection refused");
        assert!(!h.is_healthy());
        assert!(
            h.is_paused(),
            "paused although the pause itself is zero: no check yet"
        );
        h.checked(Err("still refused".into()));
        assert!(h.is_paused());
        h.checked(Ok(()));
        assert!(!h.is_paused());
        assert!(h.is_healthy());
        // The pause doubles while the sink stays down, and resets once it works.
        let h = SinkHandle::new(
            "other",
            "redis",
            unreachable_sink(),
            Duration::from_millis(100),
            1,
        );
        assert_eq!(h.pause("x"), Duration::from_millis(100));
        assert_eq!(h.pause("x"), Duration::from_millis(200));
        h.resume();
        assert_eq!(h.pause("x"), Duration::from_millis(100));
    }

    #[test]
    fn a_target_missing_during_the_sinks_outage_is_logged_only_if_it_outlasts_it() {
        // Sink names of their own: the episode table is the process's.
        let logged = |h: &SinkHandle, target: &str| h.held.lock().unwrap()[target].logged;
        let calm = SinkHandle::new("held-calm", "redis", unreachable_sink(), Duration::ZERO, 1);
        calm.hold("q", "no such queue");
        assert!(logged(&calm, "q"), "no outage: the missing target is news");

        let h = SinkHandle::new("held-down", "redis", unreachable_sink(), Duration::ZERO, 1);
        crate::metrics::error_event(UNAVAILABLE, "held-down", &"connection refused");
        h.hold("q", "no such queue (broker stopping)");
        h.hold("r", "no such queue (broker stopping)");
        assert!(!logged(&h, "q"), "part of the outage");
        h.unhold("r");
        assert_eq!(h.held().len(), 1, "a quiet hold ends like any other");
        // The outage ends once nothing failed for its settle time.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while crate::metrics::sink_outage_open("held-down") {
            crate::metrics::recovered(UNAVAILABLE, "held-down");
            assert!(
                std::time::Instant::now() < deadline,
                "the outage never ended"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        h.hold("q", "no such queue");
        assert!(
            logged(&h, "q"),
            "still missing after the outage: logged now"
        );
        assert_eq!(h.held()["q"], "no such queue", "with the latest reason");
    }

    #[tokio::test]
    async fn claims_take_bytes_from_the_bound_and_give_back_what_they_did_not_use() {
        let h = SinkHandle::new("other", "redis", unreachable_sink(), Duration::ZERO, 16)
            .with_inflight_bytes(1000);
        let mut first = h.permit(800).await;
        assert_eq!(h.bytes_in_flight(), 800);
        first.keep(300);
        assert_eq!(h.bytes_in_flight(), 300, "the unused reservation went back");
        let second = h.permit(700).await;
        assert_eq!(h.bytes_in_flight(), 1000);
        // No byte left: the next claim waits until a batch is settled.
        let waiting = tokio::time::timeout(Duration::from_millis(50), h.permit(1)).await;
        assert!(waiting.is_err(), "no byte left, the claim waits");
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), h.permit(100))
            .await
            .expect("room again once a batch settled");
        assert_eq!(h.bytes_in_flight(), 800);
        drop((second, third));
        assert_eq!(h.bytes_in_flight(), 0);
        // A reservation is at most the whole bound, so a huge one still gets its turn.
        let whole = h.permit(usize::MAX).await;
        assert_eq!(h.bytes_in_flight(), 1000);
        drop(whole);
    }
}
