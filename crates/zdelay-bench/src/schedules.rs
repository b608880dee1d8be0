//! `schedules`: N recurring schedules whose occurrence falls on one moment T; how fast and how
//! late the occurrences go out. The schedules of a local route live in its lane, and its
//! mover fires them (plan + one script per batch of schedules), `poller.fire_ahead` before T
//! as jobs due at T, then moves those jobs at T; with `fire_ahead = "0s"` at T, pushing the
//! occurrences straight onto the list.

use super::load::status;
use super::measure::{llen, redis_cpu, system_time_ms, used_memory};
use super::report::ScheduleFiring;
use super::tally::{Tally, fine_bounds};
use super::{Env, Polled, ROUTE};
use anyhow::{Context, ensure};
use futures::{StreamExt, TryStreamExt};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use zdelay_core::schedules::{NewSchedule, Repeat};
use zdelay_core::store;

/// Schedule writes in flight while loading.
const LOAD_CONCURRENCY: usize = 64;

pub(super) async fn schedules(env: &mut Env, n: u64) -> anyhow::Result<ScheduleFiring> {
    status(&format!("schedules: {n} schedules firing at one moment"));
    env.scratch.clean(&mut env.con, false).await?;
    let memory_empty = used_memory(&mut env.con).await?;
    // The schedules' first occurrence T leaves time to load them (about 200 µs each at first,
    // and on a host too busy for that, again with the time the last try took, and half more),
    // then `fire_ahead` and two seconds: schedules exist well before their moment, and the
    // pollers start when they are loaded.
    let fire_ahead_ms = env.config.poller.fire_ahead.as_millis() as u64;
    let mut per_schedule_us = 200.0;
    let (t_ms, load_s, memory_loaded, margin_ms) = loop {
        let t_ms = store::server_time_ms(&mut env.con).await?
            + 2_000
            + fire_ahead_ms as i64
            + (n as f64 * per_schedule_us / 1000.0) as i64;
        let loaded = Instant::now();
        load_schedules(env, n, t_ms).await?;
        let load_s = loaded.elapsed().as_secs_f64();
        let memory_loaded = used_memory(&mut env.con).await?;
        let margin_ms = t_ms - store::server_time_ms(&mut env.con).await?;
        if margin_ms > fire_ahead_ms as i64 + 100 {
            break (t_ms, load_s, memory_loaded, margin_ms);
        }
        ensure!(
            per_schedule_us < 5_000.0,
            "schedules: loading took too long ({load_s:.1} s for {n}); Redis is overloaded"
        );
        status(&format!(
            "schedules: loading took {load_s:.1} s, past T: loading again with more time"
        ));
        env.scratch.clean(&mut env.con, false).await?;
        per_schedule_us = load_s * 1e6 / n as f64 * 1.5;
    };
    let bounds = fine_bounds();
    let tally = Tally::new(&bounds);
    tally.set_target(n);
    let ctx = env.context(bounds).await?;
    let movers = env.spawn_movers(ctx, Polled::Jobs, &tally, true);
    let cpu0 = redis_cpu(&mut env.con).await?;
    let done = tally
        .wait(Duration::from_secs(120) + Duration::from_millis(margin_ms as u64))
        .await;
    let cpu1 = redis_cpu(&mut env.con).await?;
    movers.stop().await;
    let (_, done_wall) =
        done.with_context(|| format!("schedules stalled: {} of {n} fired", tally.moved()))?;
    ensure!(
        llen(&mut env.con, &env.scratch.out.clone()).await? == n,
        "schedules: list length != schedules"
    );
    let all_fired = system_time_ms(done_wall) + env.clock_offset_ms as f64 - t_ms as f64;
    let first = tally.first_move_us.load(Ordering::Relaxed) as f64 / 1000.0 - t_ms as f64;
    let list_bytes: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&env.scratch.out)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut env.con)
        .await?;
    let memory_fired = used_memory(&mut env.con).await? - list_bytes;
    let page_ms = console_page_ms(&env.producer).await?;
    let firing_s = ((all_fired - first) / 1000.0).max(1e-6);
    env.scratch.clean(&mut env.con, false).await?;
    Ok(ScheduleFiring {
        schedules: n,
        load_s,
        margin_ms,
        fire_ahead_ms,
        first_delivery_after_t_ms: first,
        all_delivered_after_t_ms: all_fired,
        per_sec: n as f64 / firing_s,
        redis_cpu_s_per_million: (cpu1 - cpu0) * 1e6 / n as f64,
        lateness: tally.hist().summary(),
        bytes_per_schedule_loaded: (memory_loaded - memory_empty) as f64 / n as f64,
        bytes_per_schedule_fired: (memory_fired - memory_empty) as f64 / n as f64,
        page_ms,
    })
}

/// Writes `n` hourly schedules of the bench route whose grid starts at `t_ms`.
async fn load_schedules(env: &Env, n: u64, t_ms: i64) -> anyhow::Result<()> {
    let producer = &env.producer;
    let size = env.payload_size();
    futures::stream::iter(0..n)
        .map(|i| async move {
            let mut spec = NewSchedule::new(
                format!("bench-{i}"),
                ROUTE,
                format!("{i:0>width$}", width = size.max(8)),
                Repeat::Every(Duration::from_secs(3600)),
            );
            spec.start_at = Some(t_ms);
            producer.schedule_set(spec).await
        })
        .buffer_unordered(LOAD_CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await
        .context("loading schedules")?;
    Ok(())
}

/// What one `GET /api/schedules` reads, timed: the next 200 to fire after the first 200, and
/// a 2000-definition scan for paused and ended ones.
async fn console_page_ms(client: &zdelay_core::Client) -> anyhow::Result<f64> {
    let op = client.operator();
    let first = op.schedules_upcoming_page(None, 200).await?;
    let started = Instant::now();
    let page = op.schedules_upcoming_page(first.next.as_ref(), 200).await?;
    op.schedules_idle(Default::default(), 2000).await?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    ensure!(
        first.next.is_none() || !page.schedules.is_empty(),
        "schedules: the second page is empty"
    );
    Ok(ms)
}
