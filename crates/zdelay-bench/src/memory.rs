//! `memory`: Redis memory per job in its route lane, and per job in the bare layout holding
//! the same ids and payloads.

use super::load::{load_bare_hash, load_jobs, status, stored_ids};
use super::measure::used_memory;
use super::report::Memory;
use super::{Env, MEMORY_AIM_BYTES, MEMORY_AIM_PAYLOAD};

pub(super) async fn memory(env: &mut Env) -> anyhow::Result<Memory> {
    let n = env.args.jobs;
    let size = env.payload_size();
    status(&format!(
        "memory: {n} jobs in the route lane, then the bare layout"
    ));
    env.scratch.clean(&mut env.con, false).await?;
    let later = env.redis_now_ms() + 86_400_000;
    let due = |i: u64| later + i as i64;
    let before = used_memory(&mut env.con).await?;
    let ids = load_jobs(&env.producer, n, size, due, "enqueue jobs").await?;
    let after = used_memory(&mut env.con).await?;
    let in_lane = (after - before) as f64 / n as f64;
    let stored = stored_ids(&ids)?;
    drop(ids);
    let sample: Vec<u8> = redis::cmd("HGET")
        .arg(&env.scratch.lane.keys.jobs)
        .arg(&stored[0])
        .query_async(&mut env.con)
        .await?;
    env.scratch.clean(&mut env.con, false).await?;

    let (bare_due, bare_jobs) = env.scratch.bare_same_ids();
    let before = used_memory(&mut env.con).await?;
    load_bare_hash(
        &mut env.con,
        (&bare_due, &bare_jobs),
        &stored,
        size,
        due,
        "load bare id+hash",
    )
    .await?;
    let after = used_memory(&mut env.con).await?;
    let bare = (after - before) as f64 / n as f64;
    env.scratch.clean(&mut env.con, false).await?;
    Ok(Memory {
        jobs: n,
        payload_size: size,
        envelope_bytes_per_job: in_lane,
        bare_bytes_per_job: bare,
        ratio: in_lane / bare,
        aim_bytes: MEMORY_AIM_BYTES,
        meets_aim: (size == MEMORY_AIM_PAYLOAD).then_some(in_lane <= MEMORY_AIM_BYTES),
        envelope_value_bytes: sample.len(),
    })
}
