//! `same-ms`: many jobs due at one millisecond; time until the last one moved.

use super::fleet::{PARKED_DUE_MS, rescore, rescore_lead_ms};
use super::load::{load_jobs, status};
use super::measure::{llen, redis_cpu, system_time_ms};
use super::report::SameMs;
use super::tally::{Tally, fine_bounds};
use super::{Env, Polled, SAME_MS_TARGET_JOBS, SAME_MS_TARGET_MS};
use anyhow::{Context, ensure};
use std::sync::atomic::Ordering;
use std::time::Duration;
use zdelay_core::store;

pub(super) async fn same_ms(env: &mut Env) -> anyhow::Result<SameMs> {
    let n = env.args.same_ms_jobs;
    let size = env.payload_size();
    status(&format!("same-ms: {n} jobs due at one millisecond"));
    env.scratch.clean(&mut env.con, false).await?;
    // Loaded parked while no poller runs; then the lane's ZSET is rescored to T in one
    // command (as `--daemons` does: exact, see `fleet::rescore`), so T can be chosen after
    // the load, whatever the load took.
    load_jobs(
        &env.producer,
        n,
        size,
        |_| PARKED_DUE_MS,
        "enqueue same-ms jobs",
    )
    .await?;
    let t_ms = store::server_time_ms(&mut env.con).await? + rescore_lead_ms(n);
    rescore(env, t_ms).await?;
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    tally.set_target(n);
    let margin_ms = t_ms - store::server_time_ms(&mut env.con).await?;
    ensure!(
        margin_ms > 100,
        "same-ms: rescoring took too long (margin {margin_ms} ms); Redis is overloaded"
    );
    let ctx = env.context(bounds).await?;
    let movers = env.spawn_movers(ctx, Polled::Jobs, &tally, true);
    // CPU is read around the whole wait; before T the pollers only sleep.
    let cpu0 = redis_cpu(&mut env.con).await?;
    let done = tally
        .wait(Duration::from_secs(60) + Duration::from_millis(margin_ms as u64))
        .await;
    let cpu1 = redis_cpu(&mut env.con).await?;
    movers.stop().await;
    let (_, done_wall) =
        done.with_context(|| format!("same-ms stalled: {} of {n} moved", tally.moved()))?;
    ensure!(
        llen(&mut env.con, &env.scratch.out.clone()).await? == n,
        "same-ms: list length != jobs"
    );
    env.scratch.clean(&mut env.con, false).await?;
    let all_moved = system_time_ms(done_wall) + env.clock_offset_ms as f64 - t_ms as f64;
    let first = tally.first_move_us.load(Ordering::Relaxed) as f64 / 1000.0 - t_ms as f64;
    let last = tally.last_move_us.load(Ordering::Relaxed) as f64 / 1000.0 - t_ms as f64;
    let moving_s = ((all_moved - first) / 1000.0).max(1e-6);
    Ok(SameMs {
        jobs: n,
        margin_ms,
        first_move_after_t_ms: first,
        last_call_started_after_t_ms: last,
        all_moved_after_t_ms: all_moved,
        jobs_per_sec: n as f64 / moving_s,
        redis_cpu_s_per_million: (cpu1 - cpu0) * 1e6 / n as f64,
        script_calls: tally.calls.load(Ordering::Relaxed),
        lateness: tally.hist().summary(),
        target_ms: SAME_MS_TARGET_MS,
        meets_target: (n >= SAME_MS_TARGET_JOBS).then_some(all_moved < SAME_MS_TARGET_MS),
    })
}
