//! `stream`: a stream route (`push = "xadd"`) drained by `move_lane`, against a bare Lua XADD
//! move of the same jobs (`bench_bare_move_stream`: id ZSET + payload HASH, one XADD per job
//! with its payload and `<id>:<due>`), one call of each in turn on the same server state, so
//! the ratio compares the scripts, not the moment each ran. Both append to one stream in the
//! lane's slot; one lane has one mover, so one call at a time.

use super::Env;
use super::lane::{load_lane, stored_id};
use super::load::{backlog_due, load_bare_hash, status};
use super::measure::redis_cpu_at;
use super::report::{StreamBench, Throughput};
use anyhow::ensure;
use std::time::{Duration, Instant};
use zdelay::metrics::LATENESS_BOUNDS_MS;
use zdelay_core::config::Push;
use zdelay_core::lane::Lane;
use zdelay_core::store::scripts::{self, MoveLane};

/// The bench's stream route: beside the bench route, onto the same scratch key (a stream here).
const STREAM_ROUTE: &str = "bench-stream";

pub(super) async fn stream(env: &mut Env) -> anyhow::Result<StreamBench> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    let keys = env.scratch.keys.clone();
    let unregistered = Lane::for_list(keys.namespace(), 0, STREAM_ROUTE, &out, Push::Xadd);
    let ids: Vec<String> = (0..n).map(stored_id).collect();
    let (bare_due, bare_jobs) = env.scratch.bare_same_ids();
    let args = MoveLane {
        batch: env.batch,
        now_ms: None,
        max_payload: env.config.poller.max_payload.max(size),
        batch_bytes: env.config.poller.batch_bytes,
        bounds_ms: LATENESS_BOUNDS_MS,
        flow: None,
        trim: None,
    };
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        env.scratch.clean(&mut env.con, false).await?;
        status(&format!("stream, round {round}: loading"));
        let now = env.redis_now_ms();
        let due = |i: u64| backlog_due(i, n, now);
        // The registry's lane: its number is in the marker the scripts check.
        let lane = super::lane::register(&mut env.con, &keys, &unregistered).await?;
        load_lane(
            &mut env.con,
            &keys,
            &lane,
            &ids,
            size,
            &due,
            "loading the stream lane",
            None,
        )
        .await?;
        load_bare_hash(
            &mut env.con,
            (&bare_due, &bare_jobs),
            &ids,
            size,
            due,
            "loading the bare id ZSET and payload HASH",
        )
        .await?;
        status(&format!(
            "stream, round {round}: move_lane (XADD) and the bare XADD move, one call of each in turn"
        ));
        let max_score = env.redis_now_ms() + 1;
        let mut probe = env.con.clone();
        let mut spent = [(Duration::ZERO, 0.0f64, 0u64, 0u64); 2];
        let mut done = [false; 2];
        let mut step = 0usize;
        while done.iter().any(|d| !d) {
            for k in 0..2 {
                let variant = (k + step) % 2;
                if done[variant] {
                    continue;
                }
                let cpu0 = redis_cpu_at(&mut probe, &out).await?;
                let started = Instant::now();
                let moved = if variant == 0 {
                    let reply = scripts::move_lane(&mut env.con, &lane, &args).await?;
                    ensure!(
                        reply.dead.iter().sum::<u64>() == 0 && reply.kept == 0,
                        "move_lane did not append every job: dead {:?}, kept {} ({})",
                        reply.dead,
                        reply.kept,
                        reply.kept_error
                    );
                    reply.moved_total()
                } else {
                    scripts::bench_bare_move_stream(
                        &mut env.con,
                        &bare_due,
                        &bare_jobs,
                        &out,
                        env.batch,
                        max_score,
                    )
                    .await?
                };
                let wall = started.elapsed();
                let cpu = redis_cpu_at(&mut probe, &out).await? - cpu0;
                let s = &mut spent[variant];
                *s = (s.0 + wall, s.1 + cpu, s.2 + moved, s.3 + 1);
                done[variant] = moved < env.batch as u64;
            }
            step += 1;
        }
        let [lane_run, bare] =
            spent.map(|(wall, cpu, moved, calls)| Throughput::new(moved, wall, cpu, calls));
        for (what, run) in [("move_lane (XADD)", &lane_run), ("bare XADD", &bare)] {
            ensure!(run.jobs == n, "{what}: moved {} of {n}", run.jobs);
            status(&format!(
                "  {what}: {:.0} jobs/s, {:.2} Redis CPU s per million",
                run.jobs_per_sec, run.redis_cpu_s_per_million
            ));
        }
        let xlen: u64 = redis::cmd("XLEN")
            .arg(&out)
            .query_async(&mut env.con)
            .await?;
        ensure!(
            xlen == 2 * n,
            "the stream has {xlen} entries, not {}",
            2 * n
        );
        rounds.push((lane_run, bare));
    }
    env.scratch.clean(&mut env.con, false).await?;
    let ratio = |r: &(Throughput, Throughput)| r.0.jobs_per_sec / r.1.jobs_per_sec;
    let all: Vec<f64> = rounds.iter().map(ratio).collect();
    rounds.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
    let (lane_run, bare) = rounds.swap_remove(rounds.len() / 2);
    Ok(StreamBench {
        ratio: lane_run.jobs_per_sec / bare.jobs_per_sec,
        cpu_ratio: bare.redis_cpu_s_per_million / lane_run.redis_cpu_s_per_million.max(1e-9),
        ratio_all_rounds: all,
        lane: lane_run,
        bare,
    })
}
