//! `drain`: an all-due backlog moved by the real movers, then by a bare Lua move, as a ratio.

use super::load::{backlog_due, load_bare_hash, load_envelopes, load_raw, status};
use super::measure::{del, llen, redis_cpu};
use super::report::{Drain, Throughput};
use super::tally::Tally;
use super::{ENVELOPE_RATIO_TARGET, Env, RAW_RATIO_TARGET};
use anyhow::{Context, ensure};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use zdelay::metrics::LATENESS_BOUNDS_MS;
use zdelay_client::store::scripts;

pub(super) async fn drain_raw(env: &mut Env) -> anyhow::Result<Drain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let key = env.scratch.raw.source.clone();
    let out = env.scratch.out.clone();
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        status(&format!("drain raw, round {round}: real move_raw"));
        let now = env.redis_now_ms();
        load_raw(
            &mut env.con,
            &key,
            n,
            size,
            |i| backlog_due(i, n, now),
            "load raw (real)",
        )
        .await?;
        let tally = Tally::new(LATENESS_BOUNDS_MS);
        tally.set_target(n);
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(env.raw_target(), LATENESS_BOUNDS_MS.to_vec(), &tally, false);
        let done = tally.wait(drain_timeout(n)).await;
        let cpu1 = redis_cpu(&mut env.con).await?;
        movers.stop().await;
        let (done, _) = done
            .with_context(|| format!("real raw drain stalled: {} of {n} moved", tally.moved()))?;
        let real = Throughput::new(
            n,
            done - started,
            cpu1 - cpu0,
            tally.calls.load(Ordering::Relaxed),
        );
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "raw: list length != jobs"
        );
        del(&mut env.con, &out).await?;

        status(&format!("drain raw, round {round}: bare_move_raw"));
        let now = env.redis_now_ms();
        load_raw(
            &mut env.con,
            &key,
            n,
            size,
            |i| backlog_due(i, n, now),
            "load raw (bare)",
        )
        .await?;
        let max_score = env.redis_now_ms();
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let mut moved = 0u64;
        let mut calls = 0u64;
        loop {
            let got = scripts::bench_bare_move_raw(&mut env.con, &key, &out, env.batch, max_score)
                .await?;
            calls += 1;
            moved += got;
            if got < env.batch as u64 {
                break;
            }
        }
        let elapsed = started.elapsed();
        let cpu1 = redis_cpu(&mut env.con).await?;
        ensure!(moved == n, "bare raw moved {moved} of {n}");
        let bare = Throughput::new(n, elapsed, cpu1 - cpu0, calls);
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "bare raw: list length != jobs"
        );
        del(&mut env.con, &out).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead));
    }
    Ok(pick_median("raw", rounds, 1, RAW_RATIO_TARGET))
}

pub(super) async fn drain_envelope(env: &mut Env) -> anyhow::Result<Drain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    let shards = env.scratch.keys.shards();
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        status(&format!("drain envelope, round {round}: real move_due"));
        let now = env.redis_now_ms();
        let due = |i| backlog_due(i, n, now);
        let ids = load_envelopes(&env.producer, n, size, due, "enqueue envelopes").await?;
        let tally = Tally::new(LATENESS_BOUNDS_MS);
        tally.set_target(n);
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(
            env.shard_targets(),
            LATENESS_BOUNDS_MS.to_vec(),
            &tally,
            false,
        );
        let done = tally.wait(drain_timeout(n)).await;
        let cpu1 = redis_cpu(&mut env.con).await?;
        movers.stop().await;
        let (done, _) = done.with_context(|| {
            format!(
                "real envelope drain stalled: {} of {n} moved",
                tally.moved()
            )
        })?;
        let real = Throughput::new(
            n,
            done - started,
            cpu1 - cpu0,
            tally.calls.load(Ordering::Relaxed),
        );
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "envelope: list length != jobs"
        );
        del(&mut env.con, &out).await?;

        status(&format!("drain envelope, round {round}: bare_move_hash"));
        load_bare_hash(
            &mut env.con,
            &env.scratch.bare,
            &ids,
            size,
            due,
            "load bare id+hash",
        )
        .await?;
        drop(ids);
        let max_score = env.redis_now_ms();
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let loops = (0..shards).map(|s| {
            let mut con = env.con.clone();
            let (due_key, jobs_key) = (env.scratch.bare.due(s), env.scratch.bare.jobs(s));
            let (out, batch) = (out.clone(), env.batch);
            async move {
                let (mut moved, mut calls) = (0u64, 0u64);
                loop {
                    let got = scripts::bench_bare_move_hash(
                        &mut con, &due_key, &jobs_key, &out, batch, max_score,
                    )
                    .await?;
                    calls += 1;
                    moved += got;
                    if got < batch as u64 {
                        return Ok::<_, redis::RedisError>((moved, calls));
                    }
                }
            }
        });
        let results = futures::future::join_all(loops).await;
        let elapsed = started.elapsed();
        let cpu1 = redis_cpu(&mut env.con).await?;
        let (mut moved, mut calls) = (0, 0);
        for r in results {
            let (m, c) = r?;
            moved += m;
            calls += c;
        }
        ensure!(moved == n, "bare hash moved {moved} of {n}");
        let bare = Throughput::new(n, elapsed, cpu1 - cpu0, calls);
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "bare hash: list length != jobs"
        );
        env.scratch.clean(&mut env.con, false).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead));
    }
    Ok(pick_median(
        "envelope",
        rounds,
        shards as usize,
        ENVELOPE_RATIO_TARGET,
    ))
}

pub(super) fn drain_timeout(n: u64) -> Duration {
    Duration::from_secs(60 + n / 10_000)
}

/// Keeps the round with the median real/bare ratio; lists every round's ratio.
pub(super) fn pick_median(
    source: &'static str,
    mut rounds: Vec<(Throughput, Throughput, u64)>,
    concurrency: usize,
    target: f64,
) -> Drain {
    let ratio = |r: &(Throughput, Throughput, u64)| r.0.jobs_per_sec / r.1.jobs_per_sec;
    let all: Vec<f64> = rounds.iter().map(ratio).collect();
    rounds.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
    let (real, bare, dead) = rounds.swap_remove(rounds.len() / 2);
    let r = real.jobs_per_sec / bare.jobs_per_sec;
    let (mover, baseline) = match source {
        "raw" => ("move_raw (poller::run)", "bench_bare_move_raw"),
        _ => ("move_due (poller::run)", "bench_bare_move_hash"),
    };
    Drain {
        source,
        routes: 1,
        mover,
        baseline,
        concurrency,
        real,
        bare,
        ratio: r,
        ratio_all_rounds: all,
        target_ratio: target,
        meets_target: r >= target,
        dead,
    }
}
