//! `drain`: an all-due backlog moved by the real movers, then by a bare Lua move, as a ratio.
//!
//! Jobs enqueued through the client wait in their route's lane: one ZSET of ids and one HASH
//! of payloads, moved by one mover. Its baseline is the same: one bare id ZSET + payload
//! HASH holding the same stored ids and payloads, moved by one loop of the bare script. The
//! `lane` mode compares the scripts themselves, called in turn on the same server state;
//! this one runs the daemon's poller loop, fed by the client, as a user runs them.

use super::load::{backlog_due, load_bare_hash, load_jobs, load_raw, status, stored_ids};
use super::measure::{del, llen, redis_cpu};
use super::report::{CheckedBaseline, Drain, LANE_RATIO_TARGET, Throughput};
use super::tally::Tally;
use super::{Env, Polled, RAW_CHECKED_RATIO_TARGET, RAW_RATIO_TARGET};
use anyhow::{Context, ensure};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use zdelay::metrics::LATENESS_BOUNDS_MS;
use zdelay_core::store::scripts;

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
        let ctx = env.context(LATENESS_BOUNDS_MS.to_vec()).await?;
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(ctx, Polled::Raw, &tally, false);
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
        let side_by_side = drain_raw_checked(env, round).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead, Some(side_by_side)));
    }
    Ok(pick_median("raw", rounds, 1, RAW_RATIO_TARGET))
}

/// `move_raw` (the script the poller runs) against the bare raw move and against
/// `bench_bare_move_raw_checked` (the bare move plus the size checks a raw source cannot
/// skip: each member's size, the byte budget, read in budget-sized chunks), the same members
/// loaded into three ZSETs and drained one call of each in turn, the order rotating every
/// step, with the Redis CPU read around each call (as the lane mode does): all three run on
/// the same server state, so the ratios compare the scripts, not the moment each ran.
/// Returns (move_raw, bare, checked).
async fn drain_raw_checked(
    env: &mut Env,
    round: usize,
) -> anyhow::Result<(Throughput, Throughput, Throughput)> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let raw = env.scratch.raw.clone();
    let out = env.scratch.out.clone();
    // The bare comparisons' two ZSETs (scratch keys, cleaned with the rest) as raw sources.
    let (bare_key, checked_key) = (
        env.scratch.lane_bare[0].0.clone(),
        env.scratch.lane_bare[1].0.clone(),
    );
    status(&format!(
        "drain raw, round {round}: move_raw, bare and checked side by side"
    ));
    let now = env.redis_now_ms();
    for (key, what) in [
        (&raw.source, "load raw (move_raw)"),
        (&bare_key, "load raw (bare)"),
        (&checked_key, "load raw (bare, checked)"),
    ] {
        load_raw(&mut env.con, key, n, size, |i| backlog_due(i, n, now), what).await?;
    }
    let max_score = env.redis_now_ms();
    // The poller's own limits, as the real move gets them.
    let (max_payload, budget) = (env.config.poller.max_payload, env.config.poller.batch_bytes);
    let args = scripts::MoveRaw {
        batch: env.batch,
        now_ms: None,
        unit: Default::default(),
        max_payload,
        batch_bytes: budget,
        list: &out,
        push: Default::default(),
        bounds_ms: LATENESS_BOUNDS_MS,
    };
    let mut probe = env.con.clone();
    let mut spent = [(Duration::ZERO, 0.0f64, 0u64, 0u64); 3];
    let mut done = [false; 3];
    let mut step = 0usize;
    while done.iter().any(|d| !d) {
        for k in 0..3 {
            let variant = (k + step) % 3;
            if done[variant] {
                continue;
            }
            let cpu0 = redis_cpu(&mut probe).await?;
            let started = Instant::now();
            let moved = match variant {
                0 => {
                    let reply = scripts::move_raw(&mut env.con, &raw, &args).await?;
                    ensure!(
                        reply.dead.iter().sum::<u64>() == 0,
                        "move_raw sent members to dead: {:?}",
                        reply.dead
                    );
                    reply.moved_total()
                }
                1 => {
                    scripts::bench_bare_move_raw(
                        &mut env.con,
                        &bare_key,
                        &out,
                        env.batch,
                        max_score,
                    )
                    .await?
                }
                _ => {
                    scripts::bench_bare_move_raw_checked(
                        &mut env.con,
                        &checked_key,
                        &out,
                        (env.batch, max_score),
                        (max_payload, budget),
                    )
                    .await?
                }
            };
            let wall = started.elapsed();
            let cpu = redis_cpu(&mut probe).await? - cpu0;
            let s = &mut spent[variant];
            *s = (s.0 + wall, s.1 + cpu, s.2 + moved, s.3 + 1);
            done[variant] = moved < env.batch as u64;
        }
        step += 1;
    }
    let [real, bare, checked] =
        spent.map(|(wall, cpu, moved, calls)| Throughput::new(moved, wall, cpu, calls));
    for (what, run) in [("move_raw", &real), ("bare", &bare), ("checked", &checked)] {
        ensure!(
            run.jobs == n,
            "raw side by side, {what}: moved {} of {n}",
            run.jobs
        );
    }
    ensure!(
        llen(&mut env.con, &out).await? == 3 * n,
        "raw side by side: the list has not every member"
    );
    del(&mut env.con, &out).await?;
    Ok((real, bare, checked))
}

pub(super) async fn drain_lane(env: &mut Env) -> anyhow::Result<Drain> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    let (bare_due, bare_jobs) = env.scratch.bare_same_ids();
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        status(&format!(
            "drain jobs, round {round}: the route lane's poller (move_lane)"
        ));
        let now = env.redis_now_ms();
        let due = |i| backlog_due(i, n, now);
        let ids = load_jobs(&env.producer, n, size, due, "enqueue jobs").await?;
        let tally = Tally::new(LATENESS_BOUNDS_MS);
        tally.set_target(n);
        let ctx = env.context(LATENESS_BOUNDS_MS.to_vec()).await?;
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let movers = env.spawn_movers(ctx, Polled::Jobs, &tally, false);
        let done = tally.wait(drain_timeout(n)).await;
        let cpu1 = redis_cpu(&mut env.con).await?;
        movers.stop().await;
        let (done, _) = done
            .with_context(|| format!("real lane drain stalled: {} of {n} moved", tally.moved()))?;
        let real = Throughput::new(
            n,
            done - started,
            cpu1 - cpu0,
            tally.calls.load(Ordering::Relaxed),
        );
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "lane: list length != jobs"
        );
        del(&mut env.con, &out).await?;

        status(&format!(
            "drain jobs, round {round}: bare_move_hash, the same ids"
        ));
        load_bare_hash(
            &mut env.con,
            (&bare_due, &bare_jobs),
            &stored_ids(&ids)?,
            size,
            due,
            "load bare id+hash",
        )
        .await?;
        drop(ids);
        let max_score = env.redis_now_ms();
        let cpu0 = redis_cpu(&mut env.con).await?;
        let started = Instant::now();
        let (mut moved, mut calls) = (0u64, 0u64);
        loop {
            let got = scripts::bench_bare_move_hash(
                &mut env.con,
                &bare_due,
                &bare_jobs,
                &out,
                env.batch,
                max_score,
            )
            .await?;
            calls += 1;
            moved += got;
            if got < env.batch as u64 {
                break;
            }
        }
        let elapsed = started.elapsed();
        let cpu1 = redis_cpu(&mut env.con).await?;
        ensure!(moved == n, "bare hash moved {moved} of {n}");
        let bare = Throughput::new(n, elapsed, cpu1 - cpu0, calls);
        ensure!(
            llen(&mut env.con, &out).await? == n,
            "bare hash: list length != jobs"
        );
        env.scratch.clean(&mut env.con, false).await?;
        let dead = tally.dead.load(Ordering::Relaxed);
        rounds.push((real, bare, dead, None));
    }
    Ok(pick_median("lane", rounds, 1, LANE_RATIO_TARGET))
}

pub(super) fn drain_timeout(n: u64) -> Duration {
    Duration::from_secs(60 + n / 10_000)
}

/// One drain round: the real move, the bare one, the real move's dead jobs, and (raw) the
/// scripts side by side: `move_raw`, the bare move, the bare move with the size checks.
type Round = (
    Throughput,
    Throughput,
    u64,
    Option<(Throughput, Throughput, Throughput)>,
);

/// Keeps the round with the median real/bare ratio; lists every round's ratio.
pub(super) fn pick_median(
    source: &'static str,
    mut rounds: Vec<Round>,
    concurrency: usize,
    target: f64,
) -> Drain {
    let ratio = |r: &Round| r.0.jobs_per_sec / r.1.jobs_per_sec;
    let all: Vec<f64> = rounds.iter().map(ratio).collect();
    let cpu_ratio = |real: &Throughput, bare: &Throughput| {
        bare.redis_cpu_s_per_million / real.redis_cpu_s_per_million.max(1e-9)
    };
    // Side by side (raw): move_raw against the checked baseline, by wall and by CPU, and
    // against the bare move by CPU.
    let side_ratios = |r: &Round| {
        r.3.as_ref().map(|(real, bare, checked)| {
            (
                real.jobs_per_sec / checked.jobs_per_sec,
                cpu_ratio(real, checked),
                cpu_ratio(real, bare),
            )
        })
    };
    let side_all: Vec<(f64, f64, f64)> = rounds.iter().filter_map(side_ratios).collect();
    rounds.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
    let median = rounds.swap_remove(rounds.len() / 2);
    let side = side_ratios(&median);
    let (real, bare, dead, side_runs) = median;
    let checked = side_runs
        .zip(side)
        .map(|((script, _, c), (r, cpu, cpu_bare))| CheckedBaseline {
            baseline: "bench_bare_move_raw_checked",
            script,
            bare: c,
            ratio: r,
            cpu_ratio: cpu,
            cpu_ratio_to_bare: cpu_bare,
            ratio_all_rounds: side_all.iter().map(|r| r.0).collect(),
            cpu_ratio_all_rounds: side_all.iter().map(|r| r.1).collect(),
            target_ratio: RAW_CHECKED_RATIO_TARGET,
            meets_target: side_all.iter().all(|r| r.1 >= RAW_CHECKED_RATIO_TARGET),
        });
    let r = real.jobs_per_sec / bare.jobs_per_sec;
    let cpu_r = cpu_ratio(&real, &bare);
    let (mover, baseline) = match source {
        "raw" => ("move_raw (poller::run)", "bench_bare_move_raw"),
        _ => ("move_lane (poller::run)", "bench_bare_move_hash"),
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
        cpu_ratio: cpu_r,
        ratio_all_rounds: all,
        target_ratio: target,
        meets_target: r >= target,
        dead,
        checked,
    }
}
