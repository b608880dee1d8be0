//! `upgrade`: `zdelay upgrade` of a layout-1 namespace holding `--jobs` waiting jobs, while
//! a producer enqueues: its duration per million jobs, Redis CPU per job moved, and the
//! count check (every job waiting before, and every one enqueued during it, is in layout 2
//! after). No daemon runs, so nothing is delivered meanwhile.

use super::load::{load_envelopes, payload, status};
use super::measure::redis_cpu;
use super::report::UpgradeBench;
use super::{Env, ROUTE};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;
use zdelay_core::keys::Keys;
use zdelay_core::store::lanes;
use zdelay_core::upgrade::{self, Outcome};
use zdelay_core::{NewJob, OnConflict};

/// The producer's rate while the upgrade runs, jobs/s.
const PRODUCER_RATE: u64 = 5_000;

pub(super) async fn upgrade(env: &mut Env) -> anyhow::Result<UpgradeBench> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let later = env.redis_now_ms() + 86_400_000;
    load_envelopes(
        &env.producer,
        n,
        size,
        |i| later + i as i64,
        "enqueue on layout 1",
    )
    .await?;
    let keys = env.scratch.keys.clone();
    zdelay::app::register_lanes(&mut env.con, &env.config, &keys).await?;
    let registry = lanes::read_registry(&mut env.con, &keys).await?;

    status(&format!(
        "upgrade: {n} waiting jobs to layout 2, a producer enqueueing {PRODUCER_RATE}/s meanwhile"
    ));
    let producing = Arc::new(AtomicBool::new(true));
    let produced = Arc::new(AtomicU64::new(0));
    let producer = {
        let (client, producing, produced) =
            (env.producer.clone(), producing.clone(), produced.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut k = 0u64;
            while producing.load(Ordering::Relaxed) {
                // Batches of 50 on a 10 ms beat.
                let jobs: Vec<NewJob> = (0..PRODUCER_RATE / 100)
                    .map(|j| NewJob::new(ROUTE, payload(n + k + j, size)).at(later))
                    .collect();
                for r in client.enqueue_batch(jobs, OnConflict::Error).await? {
                    r?;
                    k += 1;
                }
                produced.store(k, Ordering::Relaxed);
                let next = std::time::Duration::from_millis(k * 1000 / PRODUCER_RATE);
                tokio::time::sleep(next.saturating_sub(started.elapsed())).await;
            }
            anyhow::Ok(k)
        })
    };
    let cpu_before = redis_cpu(&mut env.con).await?;
    let started = Instant::now();
    let outcome = upgrade::upgrade(
        &env.con,
        keys.namespace(),
        &registry,
        &upgrade::Options::default(),
        &|_| {},
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = redis_cpu(&mut env.con).await? - cpu_before;
    producing.store(false, Ordering::Relaxed);
    let during = produced.load(Ordering::Relaxed);
    let produced = producer.await??;
    let Outcome::Done(report) = outcome else {
        anyhow::bail!("the scratch namespace was not on layout 1: {outcome:?}");
    };

    // Every job is in the route's lane now, and layout 1 holds nothing.
    let lane = registry
        .by_route
        .get(ROUTE)
        .ok_or_else(|| anyhow::anyhow!("no lane registered for {ROUTE}"))?;
    let in_lane: u64 = redis::cmd("ZCARD")
        .arg(&lane.keys.due)
        .query_async(&mut env.con)
        .await?;
    let legacy = Keys::new(keys.namespace(), keys.shards()).layout_1();
    let mut left = 0u64;
    for shard in 0..legacy.shards() {
        left += redis::cmd("ZCARD")
            .arg(legacy.due(shard))
            .query_async::<u64>(&mut env.con)
            .await?;
    }
    anyhow::ensure!(
        in_lane == n + produced && left == 0,
        "counts differ: {in_lane} in the lane, {left} left in layout 1; expected {} ({n} \
         waiting + {produced} produced)",
        n + produced
    );
    Ok(UpgradeBench {
        jobs: n,
        payload_size: size,
        seconds,
        jobs_per_second: n as f64 / seconds,
        seconds_per_million: seconds * 1_000_000.0 / n as f64,
        redis_cpu_us_per_job: cpu * 1e6 / report.to_lanes.max(1) as f64,
        produced_during: during,
        produced_total: produced,
        moved_to_lanes: report.to_lanes,
    })
}
