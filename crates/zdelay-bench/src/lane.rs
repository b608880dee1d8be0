//! `lane`: the route-lane scripts against the bare Lua move in the same run, called directly
//! (`drain` runs them through the daemon's poller instead): an all-due backlog enqueued by
//! `enqueue_lane` and drained by `move_lane` calls, then the same jobs in the bare id ZSET +
//! payload HASH, once with 26-character ids (ULIDs, what producers generated before route
//! lanes: the baseline the drain target is judged on) and once with the lane's own
//! 12-character stored ids (the script's own overhead); and Redis memory per job in a lane,
//! with generated and with 26-character ids. One lane has one mover, so every drain here is
//! one call at a time.

use super::load::{backlog_due, bar, payload, status};
use super::measure::{llen, redis_cpu_at, used_memory_at};
use super::report::{LANE_RATIO_TARGET, LaneBench, LaneMemory, Throughput};
use super::{Env, MEMORY_AIM_BYTES, MEMORY_AIM_PAYLOAD};
use anyhow::ensure;
use std::time::{Duration, Instant};
use zdelay::metrics::LATENESS_BOUNDS_MS;
use zdelay_core::job::{Due, OnConflict};
use zdelay_core::keys::Keys;
use zdelay_core::lane::Lane;
use zdelay_core::lane_id::StoredId;
use zdelay_core::store::Conn;
use zdelay_core::store::scripts::{self, LaneItem, MoveLane};

pub(super) async fn lane(env: &mut Env) -> anyhow::Result<LaneBench> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let out = env.scratch.out.clone();
    let lane = register(&mut env.con, &env.scratch.keys, &env.scratch.lane).await?;
    let short: Vec<String> = (0..n).map(stored_id).collect();
    let ulids = zdelay_core::client::IdGenerator::default();
    let long: Vec<String> = (0..n).map(|_| ulids.next()).collect();
    let lane_args = MoveLane {
        batch: env.batch,
        now_ms: None,
        // The bench's payloads must move, whatever the config's limit.
        max_payload: env.config.poller.max_payload.max(size),
        batch_bytes: env.config.poller.batch_bytes,
        bounds_ms: LATENESS_BOUNDS_MS,
        flow: None,
        trim: None,
    };
    let mut rounds = Vec::new();
    for round in 1..=env.args.rounds {
        // The three data sets side by side, drained one call of each in turn (the order
        // rotating every step): all three run on the same server state, so the ratios
        // compare the scripts, not the moment each ran.
        status(&format!("lane, round {round}: loading"));
        let now = env.redis_now_ms();
        let due = |i: u64| backlog_due(i, n, now);
        let keys = env.scratch.keys.clone();
        let (bare_26, bare_same) = (
            env.scratch.lane_bare[0].clone(),
            env.scratch.lane_bare[1].clone(),
        );
        load_side_by_side(
            &mut env.con,
            &keys,
            &lane,
            [(&bare_26, &long), (&bare_same, &short)],
            &short,
            size,
            &due,
        )
        .await?;
        status(&format!(
            "lane, round {round}: draining the three, one call of each in turn"
        ));
        let max_score = env.redis_now_ms() + 1;
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
                let cpu0 = redis_cpu_at(&mut probe, &out).await?;
                let started = Instant::now();
                let moved = match variant {
                    0 => {
                        let reply = scripts::move_lane(&mut env.con, &lane, &lane_args).await?;
                        ensure!(
                            reply.dead.iter().sum::<u64>() == 0,
                            "move_lane sent jobs to dead: {:?}",
                            reply.dead
                        );
                        reply.moved_total()
                    }
                    _ => {
                        let (due_key, jobs_key) = if variant == 1 { &bare_26 } else { &bare_same };
                        scripts::bench_bare_move_hash(
                            &mut env.con,
                            due_key,
                            jobs_key,
                            &out,
                            env.batch,
                            max_score,
                        )
                        .await?
                    }
                };
                let wall = started.elapsed();
                let cpu = redis_cpu_at(&mut probe, &out).await? - cpu0;
                let s = &mut spent[variant];
                *s = (s.0 + wall, s.1 + cpu, s.2 + moved, s.3 + 1);
                done[variant] = moved < env.batch as u64;
            }
            step += 1;
        }
        let run = |(wall, cpu, moved, calls): (Duration, f64, u64, u64)| {
            Throughput::new(moved, wall, cpu, calls)
        };
        let [lane_run, bare_26, bare_same] = spent.map(run);
        for (what, run) in [
            ("move_lane", &lane_run),
            ("bare, 26-character ids", &bare_26),
            ("bare, the lane's ids", &bare_same),
        ] {
            ensure!(run.jobs == n, "{what}: moved {} of {n}", run.jobs);
            status(&format!(
                "  {what}: {:.0} jobs/s, {:.2} Redis CPU s per million",
                run.jobs_per_sec, run.redis_cpu_s_per_million
            ));
        }
        ensure!(
            llen(&mut env.con, &out).await? == 3 * n,
            "the list has not every job"
        );
        env.scratch.clean(&mut env.con, false).await?;
        rounds.push((lane_run, bare_26, bare_same));
    }
    let ratio = |r: &(Throughput, Throughput, Throughput)| r.0.jobs_per_sec / r.1.jobs_per_sec;
    let all: Vec<f64> = rounds.iter().map(ratio).collect();
    rounds.sort_by(|a, b| ratio(a).total_cmp(&ratio(b)));
    let (lane_run, bare_26, bare_same) = rounds.swap_remove(rounds.len() / 2);
    let cpu = |bare: &Throughput| {
        bare.redis_cpu_s_per_million / lane_run.redis_cpu_s_per_million.max(1e-9)
    };
    let memory = memory(env, &lane, &short, &long).await?;
    let ratio_26 = lane_run.jobs_per_sec / bare_26.jobs_per_sec;
    Ok(LaneBench {
        ratio_same_ids: lane_run.jobs_per_sec / bare_same.jobs_per_sec,
        cpu_ratio_26: cpu(&bare_26),
        cpu_ratio_same_ids: cpu(&bare_same),
        meets_target: ratio_26 >= LANE_RATIO_TARGET && cpu(&bare_26) >= LANE_RATIO_TARGET,
        ratio_26,
        ratio_26_all_rounds: all,
        target_ratio: LANE_RATIO_TARGET,
        lane: lane_run,
        bare_26,
        bare_same_ids: bare_same,
        memory,
    })
}

/// The `i`-th stored id of one generator in one millisecond range, the shape `enqueue`
/// generates in layout 2 (12 characters; ASCII order = generation order).
pub(super) fn stored_id(i: u64) -> String {
    let (ms, counter) = (600_000_000_000 + (i >> 16), (i & 0xffff) as u16);
    StoredId::from_parts(ms, 0x155, counter)
        .expect("fields in range")
        .as_str()
        .to_owned()
}

/// Registers the bench route's lane in the scratch namespace's registry (which writes its
/// marker: the scratch clean-up deletes it with the data).
pub(super) async fn register(con: &mut Conn, keys: &Keys, lane: &Lane) -> anyhow::Result<Lane> {
    let (registered, _) =
        zdelay_core::store::lanes::register(con, keys, &lane.route, &lane.list, lane.push).await?;
    ensure!(
        registered.keys == lane.keys,
        "the registry placed the bench lane elsewhere"
    );
    Ok(registered)
}

/// Loads `ids` into the lane; with `tenants`, job `i` carries header `tenant` = `t<i % n>`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn load_lane(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    ids: &[String],
    size: usize,
    due: &impl Fn(u64) -> i64,
    what: &str,
    tenants: Option<u64>,
) -> anyhow::Result<()> {
    register(con, keys, lane).await?;
    let progress = bar(ids.len() as u64, what);
    for start in (0..ids.len()).step_by(1000) {
        let end = (start + 1000).min(ids.len());
        enqueue_chunk(con, lane, ids, start..end, size, due, tenants).await?;
        progress.inc((end - start) as u64);
    }
    progress.finish_and_clear();
    Ok(())
}

/// The lane and the two bare data sets (id ZSET + payload HASH in the lane's slot), loaded
/// 1,000 jobs of each in turn and job by job (as producers write), so the three are laid out
/// in memory alike and the move, not the loading, makes the difference.
async fn load_side_by_side(
    con: &mut Conn,
    keys: &Keys,
    lane: &Lane,
    bares: [(&(String, String), &Vec<String>); 2],
    lane_ids: &[String],
    size: usize,
    due: &impl Fn(u64) -> i64,
) -> anyhow::Result<()> {
    register(con, keys, lane).await?;
    let n = lane_ids.len();
    let progress = bar(n as u64, "loading the three side by side");
    for start in (0..n).step_by(1000) {
        let end = (start + 1000).min(n);
        enqueue_chunk(con, lane, lane_ids, start..end, size, due, None).await?;
        for ((due_key, jobs_key), ids) in bares {
            let mut pipe = redis::pipe();
            for (i, id) in ids.iter().enumerate().take(end).skip(start) {
                pipe.zadd(due_key, id, due(i as u64)).ignore();
                pipe.hset(jobs_key, id, payload(i as u64, size)).ignore();
            }
            let _: () = pipe.query_async(con).await?;
        }
        progress.inc((end - start) as u64);
    }
    progress.finish_and_clear();
    Ok(())
}

/// Enqueues `ids[range]` into `lane` in one `enqueue_lane` call.
async fn enqueue_chunk(
    con: &mut Conn,
    lane: &Lane,
    ids: &[String],
    range: std::ops::Range<usize>,
    size: usize,
    due: &impl Fn(u64) -> i64,
    tenants: Option<u64>,
) -> anyhow::Result<()> {
    let payloads: Vec<Vec<u8>> = range.clone().map(|i| payload(i as u64, size)).collect();
    let metas: Vec<Option<String>> = range
        .clone()
        .map(|i| tenants.map(|n| format!(r#"{{"headers":{{"tenant":"t{}"}}}}"#, i as u64 % n)))
        .collect();
    let items: Vec<LaneItem> = range
        .zip(&payloads)
        .zip(&metas)
        .map(|((i, p), meta)| LaneItem {
            id: &ids[i],
            due: Due::At(due(i as u64)),
            payload: p,
            meta: meta.as_deref(),
            max_lateness_ms: None,
            unique_for_ms: None,
        })
        .collect();
    let done = scripts::enqueue_lane(con, lane, OnConflict::Replace, "bench:wake", &items).await?;
    ensure!(
        done.iter().all(Option::is_some),
        "enqueue_lane refused a job"
    );
    Ok(())
}

async fn memory(
    env: &mut Env,
    lane: &Lane,
    short: &[String],
    long: &[String],
) -> anyhow::Result<LaneMemory> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let later = env.redis_now_ms() + 86_400_000;
    let due = |i: u64| later + i as i64;
    let mut per_job = Vec::new();
    for (what, ids) in [
        ("memory: lane, generated ids", short),
        ("memory: lane, 26-character ids", long),
    ] {
        status(what);
        env.scratch.clean(&mut env.con, false).await?;
        let before = used_memory_at(&mut env.con, &lane.list).await?;
        load_lane(
            &mut env.con,
            &env.scratch.keys,
            lane,
            ids,
            size,
            &due,
            what,
            None,
        )
        .await?;
        let after = used_memory_at(&mut env.con, &lane.list).await?;
        per_job.push((after - before) as f64 / n as f64);
        env.scratch.clean(&mut env.con, false).await?;
    }
    Ok(LaneMemory {
        jobs: n,
        payload_size: size,
        generated_id_bytes_per_job: per_job[0],
        id_26_bytes_per_job: per_job[1],
        aim_bytes: MEMORY_AIM_BYTES,
        meets_aim: (size == MEMORY_AIM_PAYLOAD).then_some(per_job[0] <= MEMORY_AIM_BYTES),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_ids_are_12_characters_in_numeric_order() {
        let ids: Vec<String> = (0..5000).map(stored_id).collect();
        assert!(ids.iter().all(|id| id.len() == 12));
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
    }
}
