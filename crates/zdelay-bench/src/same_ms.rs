//! `same-ms`: many jobs due at one millisecond; time until the last one moved.

use super::load::{load_envelopes, status};
use super::measure::{llen, redis_cpu, system_time_ms};
use super::report::SameMs;
use super::tally::{Tally, fine_bounds};
use super::{Env, SAME_MS_TARGET_JOBS, SAME_MS_TARGET_MS};
use anyhow::{Context, ensure};
use std::sync::atomic::Ordering;
use std::time::Duration;
use zdelay_core::store;

pub(super) async fn same_ms(env: &mut Env) -> anyhow::Result<SameMs> {
    let n = env.args.same_ms_jobs;
    let size = env.payload_size();
    status(&format!("same-ms: {n} jobs due at one millisecond"));
    env.scratch.clean(&mut env.con, false).await?;
    // Loaded with score 1 while no poller runs; then every shard's ZSET is rescored to T
    // in one command (ZUNIONSTORE with WEIGHTS T: 1 × T = T exactly), so T can be chosen
    // after the load, whatever the load took.
    load_envelopes(&env.producer, n, size, |_| 1, "enqueue same-ms jobs").await?;
    let t_ms = store::server_time_ms(&mut env.con).await? + 1_500;
    let mut pipe = redis::pipe();
    for s in 0..env.scratch.keys.shards() {
        let due = env.scratch.keys.due(s);
        pipe.cmd("ZUNIONSTORE")
            .arg(&due)
            .arg(1)
            .arg(&due)
            .arg("WEIGHTS")
            .arg(t_ms)
            .ignore();
    }
    let _: () = pipe.query_async(&mut env.con).await?;
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    tally.set_target(n);
    let margin_ms = t_ms - store::server_time_ms(&mut env.con).await?;
    ensure!(
        margin_ms > 100,
        "same-ms: rescoring took too long (margin {margin_ms} ms); Redis is overloaded"
    );
    let movers = env.spawn_movers(env.shard_targets(), bounds, &tally, true);
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
