//! Counting what the pollers move, and lateness histograms in the scripts' buckets.

use super::report::Lateness;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::Notify;
use zdelay_core::store::scripts::MoveReply;

/// Adds up every reply the pollers see; signals when `target` jobs have moved.
pub(super) struct Tally {
    pub(super) moved: AtomicU64,
    pub(super) target: AtomicU64,
    pub(super) calls: AtomicU64,
    pub(super) dead: AtomicU64,
    pub(super) kept: AtomicU64,
    /// Redis TIME (µs) at the start of the first and the last call that moved jobs.
    pub(super) first_move_us: AtomicI64,
    pub(super) last_move_us: AtomicI64,
    pub(super) lateness: Mutex<Hist>,
    pub(super) done_at: Mutex<Option<(Instant, SystemTime)>>,
    pub(super) done: Notify,
}

impl Tally {
    pub(super) fn new(bounds: &[u64]) -> Arc<Self> {
        Arc::new(Tally {
            moved: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            calls: AtomicU64::new(0),
            dead: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            first_move_us: AtomicI64::new(i64::MAX),
            last_move_us: AtomicI64::new(i64::MIN),
            lateness: Mutex::new(Hist::new(bounds)),
            done_at: Mutex::new(None),
            done: Notify::new(),
        })
    }

    pub(super) fn observe(&self, reply: &MoveReply) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.dead
            .fetch_add(reply.dead.iter().sum::<u64>(), Ordering::Relaxed);
        self.kept.fetch_add(reply.kept as u64, Ordering::Relaxed);
        let n = reply.moved_total();
        if n == 0 {
            return;
        }
        self.first_move_us
            .fetch_min(reply.now_us, Ordering::Relaxed);
        self.last_move_us.fetch_max(reply.now_us, Ordering::Relaxed);
        self.lateness
            .lock()
            .expect("tally lock is never poisoned")
            .add_buckets(&reply.buckets, reply.max_lateness_ms);
        let total = self.moved.fetch_add(n, Ordering::AcqRel) + n;
        if total >= self.target.load(Ordering::Acquire) {
            self.mark_done();
        }
    }

    pub(super) fn mark_done(&self) {
        let mut done = self.done_at.lock().expect("tally lock is never poisoned");
        if done.is_none() {
            *done = Some((Instant::now(), SystemTime::now()));
            self.done.notify_one();
        }
    }

    pub(super) fn set_target(&self, n: u64) {
        self.target.store(n, Ordering::Release);
        if self.moved.load(Ordering::Acquire) >= n {
            self.mark_done();
        }
    }

    pub(super) fn done_at(&self) -> Option<(Instant, SystemTime)> {
        *self.done_at.lock().expect("tally lock is never poisoned")
    }

    /// Waits until the target is reached; `None` after `timeout`.
    pub(super) async fn wait(&self, timeout: Duration) -> Option<(Instant, SystemTime)> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(t) = self.done_at() {
                return Some(t);
            }
            if tokio::time::timeout_at(deadline, self.done.notified())
                .await
                .is_err()
            {
                return self.done_at();
            }
        }
    }

    pub(super) fn moved(&self) -> u64 {
        self.moved.load(Ordering::Acquire)
    }

    pub(super) fn hist(&self) -> Hist {
        self.lateness
            .lock()
            .expect("tally lock is never poisoned")
            .clone()
    }
}

/// Counts per lateness bucket, as the move scripts count them: bucket `i` holds
/// lateness `<= bounds[i]` (and `> bounds[i-1]`); the last one holds the rest.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Hist {
    pub(super) bounds: Vec<u64>,
    pub(super) counts: Vec<u64>,
    pub(super) max: i64,
}

impl Hist {
    pub(super) fn new(bounds: &[u64]) -> Self {
        Hist {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len() + 1],
            max: i64::MIN,
        }
    }

    pub(super) fn add_buckets(&mut self, buckets: &[u64], max: i64) {
        for (c, b) in self.counts.iter_mut().zip(buckets) {
            *c += b;
        }
        self.max = self.max.max(max);
    }

    pub(super) fn add(&mut self, late: i64) {
        self.counts[bucket_index(&self.bounds, late)] += 1;
        self.max = self.max.max(late);
    }

    pub(super) fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub(super) fn summary(&self) -> Lateness {
        let total = self.total();
        let q = |q| percentile(&self.bounds, &self.counts, self.max, q);
        Lateness {
            jobs: total,
            p50_ms: q(0.50),
            p90_ms: q(0.90),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: (total > 0).then_some(self.max),
        }
    }
}

/// The bucket the scripts put `late` in: the first bound `>= late`, or the overflow bucket.
pub(super) fn bucket_index(bounds: &[u64], late: i64) -> usize {
    bounds.partition_point(|&b| (b as i64) < late)
}

/// Nearest-rank percentile `q` (0..=1) from bucket counts: the upper bound of the bucket
/// holding the rank, capped by the largest value seen; the overflow bucket answers `max`.
/// Exact wherever buckets are 1 ms wide, since lateness is a whole number of ms.
pub(super) fn percentile(bounds: &[u64], counts: &[u64], max: i64, q: f64) -> Option<i64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (i, &c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(match bounds.get(i) {
                Some(&b) => (b as i64).min(max),
                None => max,
            });
        }
    }
    Some(max)
}

/// Lateness bounds for steady and same-ms: every ms up to 50, then coarser.
pub(super) fn fine_bounds() -> Vec<u64> {
    let mut b: Vec<u64> = (0..=50).collect();
    b.extend((60..=100).step_by(10));
    b.extend([
        150, 200, 250, 300, 400, 500, 750, 1_000, 1_500, 2_000, 3_000, 5_000, 10_000, 30_000,
        60_000,
    ]);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_match_the_scripts_rule() {
        let bounds = [0, 1, 2, 5];
        assert_eq!(bucket_index(&bounds, -3), 0);
        assert_eq!(bucket_index(&bounds, 0), 0);
        assert_eq!(bucket_index(&bounds, 1), 1);
        assert_eq!(bucket_index(&bounds, 3), 3);
        assert_eq!(bucket_index(&bounds, 5), 3);
        assert_eq!(bucket_index(&bounds, 6), 4);
    }

    #[test]
    fn percentile_uses_nearest_rank_and_caps_by_max() {
        let bounds = [0, 1, 2, 10];
        // 50 jobs at 0 ms, 40 at 1 ms, 9 at 2 ms, 1 in (2, 10] with max 7.
        let counts = [50, 40, 9, 1, 0];
        assert_eq!(percentile(&bounds, &counts, 7, 0.50), Some(0));
        assert_eq!(percentile(&bounds, &counts, 7, 0.51), Some(1));
        assert_eq!(percentile(&bounds, &counts, 7, 0.90), Some(1));
        assert_eq!(percentile(&bounds, &counts, 7, 0.99), Some(2));
        assert_eq!(percentile(&bounds, &counts, 7, 1.0), Some(7));
        assert_eq!(percentile(&bounds, &[0; 5], 0, 0.5), None);
        // The overflow bucket answers the largest value seen.
        assert_eq!(percentile(&bounds, &[0, 0, 0, 0, 3], 250, 0.5), Some(250));
    }

    #[test]
    fn hist_adds_script_buckets_and_single_values() {
        let mut h = Hist::new(&[0, 1, 2]);
        h.add_buckets(&[1, 2, 0, 0], 1);
        h.add(2);
        h.add(9);
        assert_eq!(h.counts, vec![1, 2, 1, 1]);
        assert_eq!(h.max, 9);
        let s = h.summary();
        assert_eq!(s.jobs, 5);
        assert_eq!(s.p50_ms, Some(1));
        assert_eq!(s.max_ms, Some(9));
        assert_eq!(Hist::new(&[1]).summary().max_ms, None);
    }

    #[test]
    fn fine_bounds_are_ascending_and_1ms_wide_to_50() {
        let b = fine_bounds();
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(&b[..51], &(0..=50).collect::<Vec<_>>()[..]);
        assert!(b.len() < 100, "stay far below Lua's unpack limit");
    }
}
