//! `steady`: a paced producer, the real pollers and a consumer; lateness and exactly-once.

use super::load::{bar, parse_steady_payload, status, steady_payload};
use super::measure::redis_cpu;
use super::report::{Beside, ConsumerReport, Steady};
use super::tally::{Hist, Tally, fine_bounds};
use super::{Env, Polled, ROUTE, STEADY_DELAY_MS, STEADY_P99_TARGET_MS, STEADY_P99_TARGET_RATE};
use anyhow::ensure;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use zdelay_core::{NewJob, OnConflict};

/// Small deterministic RNG (SplitMix64) for due-time jitter: reproducible runs.
pub(super) struct SplitMix64(u64);

impl SplitMix64 {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-enough in `lo..=hi` (modulo bias is irrelevant at this range).
    pub(super) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Jobs the producer should have sent after `elapsed` at `rate` per second.
pub(super) fn due_by(rate: u64, elapsed: Duration) -> u64 {
    (rate as u128 * elapsed.as_micros() / 1_000_000) as u64
}

pub(super) async fn steady(env: &mut Env, rate: u64) -> anyhow::Result<Steady> {
    ensure!(rate > 0, "--rate must be > 0");
    let duration = env.args.steady_duration();
    status(&format!(
        "steady: {rate} jobs/s for {duration:?}, each due 100–500 ms after enqueue"
    ));
    env.scratch.clean(&mut env.con, false).await?;
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    let ctx = env.context(bounds.clone()).await?;
    let movers = env.spawn_movers(ctx, Polled::Jobs, &tally, true);
    wait_for_subscriber(env).await?;
    let consumer = Consumer::start(&env.redis, &env.scratch.out, bounds.clone()).await?;
    let probe_stop = CancellationToken::new();
    let probe = tokio::spawn(timer_probe(probe_stop.clone(), bounds));

    let beside = env.args.beside.clone();
    let mut hang = env.args.hang_pid.map(|pid| Hang::new(pid, env.args.hang));
    let cpu0 = redis_cpu(&mut env.con).await?;
    let started = Instant::now();
    let Produced {
        sent,
        produced_for,
        beside_sent,
    } = produce(env, rate, beside.as_deref(), hang.as_mut()).await?;
    let (hung_at_s, hung_for_s) = hang.map_or((None, None), Hang::finish);
    probe_stop.cancel();
    tally.set_target(sent);
    let wait = Duration::from_millis(STEADY_DELAY_MS.1) + Duration::from_secs(30);
    let done = tally.wait(wait).await;
    let cpu1 = redis_cpu(&mut env.con).await?;
    let elapsed = started.elapsed();
    movers.stop().await;
    let consumer = consumer.finish(sent, Duration::from_secs(10)).await;
    let left_due = env.due_left().await?;
    let beside = match beside {
        Some(route) => Some(Beside {
            waiting_at_end: env.stored().await?,
            route,
            enqueued: beside_sent,
            hung_at_s,
            hung_for_s,
        }),
        None => None,
    };
    let timer_overshoot = probe.await.ok().map(|h| h.summary());
    env.scratch.clean(&mut env.con, false).await?;
    if done.is_none() {
        tracing::warn!(
            moved = tally.moved(),
            sent,
            "steady: not everything moved in time"
        );
    }
    let hist = tally.hist();
    let lateness = hist.summary();
    let at_target_rate = rate == STEADY_P99_TARGET_RATE;
    let moved = tally.moved();
    let dead = tally.dead.load(Ordering::Relaxed);
    let all_once = consumer.early == 0
        && moved == sent
        && consumer.received == sent
        && consumer.duplicates == 0
        && consumer.missing == 0
        && left_due == 0
        && dead == 0;
    Ok(Steady {
        rate_target: rate,
        rate_achieved: sent as f64 / produced_for.as_secs_f64(),
        seconds: produced_for.as_secs_f64(),
        enqueued: sent,
        moved,
        early_jobs: consumer.early,
        consumer,
        timer_overshoot,
        script_calls_per_sec: tally.calls.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        redis_cpu_percent: (cpu1 - cpu0) * 100.0 / elapsed.as_secs_f64(),
        dead,
        left_due,
        all_delivered_once: all_once,
        target_p99_ms: at_target_rate.then_some(STEADY_P99_TARGET_MS),
        meets_target: at_target_rate
            .then(|| lateness.p99_ms.is_some_and(|p| p <= STEADY_P99_TARGET_MS) && all_once),
        beside,
        lateness,
    })
}

/// What the producer sent.
pub(super) struct Produced {
    pub(super) sent: u64,
    pub(super) produced_for: Duration,
    /// Jobs sent to the `--beside` route (on top of `sent`).
    pub(super) beside_sent: u64,
}

/// The paced producer: every millisecond, `Client::enqueue_batch` with as many jobs as
/// `rate` owes by then (catching up after a slow call), for `--duration`. Each job is due
/// 100–500 ms after its enqueue (Redis clock) and carries `<due> <seq>` for the consumer;
/// with `beside`, each job is sent to that route a second time.
pub(super) async fn produce(
    env: &mut Env,
    rate: u64,
    beside: Option<&str>,
    mut hang: Option<&mut Hang>,
) -> anyhow::Result<Produced> {
    let duration = env.args.steady_duration();
    let progress = bar(due_by(rate, duration), "enqueue (steady)");
    let mut rng = SplitMix64(rate ^ 0x5EED);
    let mut beside_sent = 0u64;
    let started = Instant::now();
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        let should = due_by(rate, elapsed);
        if should <= sent {
            continue;
        }
        if let Some(hang) = &mut hang {
            hang.at(elapsed)?;
        }
        let now = env.redis_now_ms();
        let mut jobs: Vec<NewJob> = (sent..should)
            .map(|seq| {
                let due = now + rng.between(STEADY_DELAY_MS.0, STEADY_DELAY_MS.1) as i64;
                NewJob::new(ROUTE, steady_payload(due, seq, env.args.payload_size)).at(due)
            })
            .collect();
        if let Some(route) = beside {
            let extra: Vec<NewJob> = jobs
                .iter()
                .map(|j| NewJob {
                    dest: route.to_owned(),
                    ..j.clone()
                })
                .collect();
            beside_sent += extra.len() as u64;
            jobs.extend(extra);
        }
        for r in env
            .producer
            .enqueue_batch(jobs, OnConflict::Replace)
            .await?
        {
            r?;
        }
        progress.inc(should - sent);
        sent = should;
    }
    let produced_for = started.elapsed();
    progress.finish_and_clear();
    Ok(Produced {
        sent,
        produced_for,
        beside_sent,
    })
}

/// A broker hung on purpose: SIGSTOP 2 s into the run, SIGCONT after its time (and always
/// when dropped, so the bench never leaves a broker stopped).
pub(super) struct Hang {
    pid: u32,
    length: Duration,
    stopped_at: Option<Duration>,
    resumed: bool,
}

impl Hang {
    const START: Duration = Duration::from_secs(2);

    fn new(pid: u32, length: Duration) -> Self {
        Hang {
            pid,
            length,
            stopped_at: None,
            resumed: false,
        }
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let status = std::process::Command::new("kill")
            .args([sig, &self.pid.to_string()])
            .status()?;
        ensure!(status.success(), "kill {sig} {} failed", self.pid);
        Ok(())
    }

    /// Stops or resumes the broker as the run's `elapsed` time says.
    fn at(&mut self, elapsed: Duration) -> anyhow::Result<()> {
        match self.stopped_at {
            None if elapsed >= Self::START => {
                self.signal("-STOP")?;
                status(&format!(
                    "hung the broker (pid {}) for {:?}",
                    self.pid, self.length
                ));
                self.stopped_at = Some(elapsed);
            }
            Some(at) if !self.resumed && elapsed >= at + self.length => {
                self.signal("-CONT")?;
                self.resumed = true;
            }
            _ => {}
        }
        Ok(())
    }

    /// (hung at, hung for) in seconds.
    fn finish(mut self) -> (Option<f64>, Option<f64>) {
        let at = self.stopped_at.map(|d| d.as_secs_f64());
        let length = at.map(|_| self.length.as_secs_f64());
        if self.stopped_at.is_some() && !self.resumed {
            let _ = self.signal("-CONT");
            self.resumed = true;
        }
        (at, length)
    }
}

impl Drop for Hang {
    fn drop(&mut self) {
        if self.stopped_at.is_some() && !self.resumed {
            let _ = self.signal("-CONT");
        }
    }
}

/// Sleeps 1–5 ms again and again, recording how late each timer fired.
pub(super) async fn timer_probe(stop: CancellationToken, bounds: Vec<u64>) -> Hist {
    let mut hist = Hist::new(&bounds);
    let mut rng = SplitMix64(7);
    while !stop.is_cancelled() {
        let target = Instant::now() + Duration::from_micros(rng.between(1_000, 5_000));
        tokio::time::sleep_until(target.into()).await;
        let late = Instant::now().saturating_duration_since(target);
        hist.add((late.as_micros() / 1000) as i64);
    }
    hist
}

/// Waits until the wake listener has subscribed (so the first wake-ups are not lost).
pub(super) async fn wait_for_subscriber(env: &mut Env) -> anyhow::Result<()> {
    let channel = env.scratch.keys.wake_channel();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, subscribers): (String, u64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut env.con)
            .await?;
        if subscribers > 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the wake listener did not subscribe in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Pops the output list as a worker would (BLMPOP), reading Redis TIME right after each
/// pop in the same pipeline: that time is after the move, so `time < due` proves an early
/// delivery. It also checks each job arrives exactly once (by its sequence number).
pub(super) struct Consumer {
    pub(super) expected: Arc<AtomicU64>,
    pub(super) stop: CancellationToken,
    pub(super) task: tokio::task::JoinHandle<anyhow::Result<ConsumerReport>>,
}

impl Consumer {
    /// Pops `list` on the server `client` names: on a cluster, the master of the list's slot
    /// (the pop and the `TIME` after it must run on one server, in that order).
    pub(super) async fn start(
        client: &redis::Client,
        list: &str,
        bounds: Vec<u64>,
    ) -> anyhow::Result<Self> {
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5)));
        let mut con = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let list = list.to_owned();
        let expected = Arc::new(AtomicU64::new(u64::MAX));
        let stop = CancellationToken::new();
        let (exp, stop2) = (expected.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut seen: Vec<u8> = Vec::new();
            let mut report = ConsumerReport::default();
            let mut hist = Hist::new(&bounds);
            while report.received < exp.load(Ordering::Acquire) && !stop2.is_cancelled() {
                type Popped = Option<(String, Vec<Vec<u8>>)>;
                let (popped, (secs, micros)): (Popped, (i64, i64)) = redis::pipe()
                    .cmd("BLMPOP")
                    .arg(0.1)
                    .arg(1)
                    .arg(&list)
                    .arg("RIGHT")
                    .arg("COUNT")
                    .arg(1000)
                    .cmd("TIME")
                    .query_async(&mut con)
                    .await?;
                let now_ms = secs * 1000 + micros / 1000;
                for p in popped.map(|(_, items)| items).unwrap_or_default() {
                    report.received += 1;
                    let Some((due, seq)) = parse_steady_payload(&p) else {
                        report.unparsable += 1;
                        continue;
                    };
                    let late = now_ms - due;
                    if late < 0 {
                        report.early += 1;
                    }
                    hist.add(late);
                    let seq = seq as usize;
                    if seq >= seen.len() {
                        seen.resize(seq + 1, 0);
                    }
                    seen[seq] = seen[seq].saturating_add(1);
                }
            }
            report.duplicates = seen.iter().map(|&c| c.saturating_sub(1) as u64).sum();
            let distinct = seen.iter().filter(|&&c| c > 0).count() as u64;
            let expected = exp.load(Ordering::Acquire);
            report.missing = expected.saturating_sub(distinct);
            report.end_to_end = Some(hist.summary());
            Ok(report)
        });
        Ok(Consumer {
            expected,
            stop,
            task,
        })
    }

    /// Tells the consumer how many jobs to expect and waits for them (or `timeout`).
    pub(super) async fn finish(self, expected: u64, timeout: Duration) -> ConsumerReport {
        self.expected.store(expected, Ordering::Release);
        let stop = self.stop.clone();
        let guard = tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            stop.cancel();
        });
        let report = match self.task.await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "steady consumer failed");
                ConsumerReport::default()
            }
            Err(e) => {
                tracing::warn!(error = %e, "steady consumer panicked");
                ConsumerReport::default()
            }
        };
        guard.abort();
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_schedule_and_rng() {
        assert_eq!(due_by(1_000, Duration::from_millis(1500)), 1_500);
        assert_eq!(due_by(50_000, Duration::from_micros(10)), 0);
        let mut r = SplitMix64(1);
        for _ in 0..1000 {
            assert!((100..=500).contains(&r.between(100, 500)));
        }
        assert_eq!(SplitMix64(9).next(), SplitMix64(9).next());
    }
}
