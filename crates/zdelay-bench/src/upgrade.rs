//! `upgrade`: `zdelay upgrade` of a layout-1 namespace holding `--jobs` waiting jobs of the
//! bench route: its duration per million jobs, Redis CPU per job moved, and the count check
//! (every job waiting before is in the route's lane after, and layout 1 holds none).
//!
//! This build neither writes nor reads layout 1 outside `zdelay upgrade`, so the namespace is
//! written as an older release wrote it: the schema says `layout` 1 and the shard count, and
//! the jobs (envelopes with 26-character ULIDs) go into the layout-1 shards through the shard
//! script `enqueue_jobs`. No daemon and no producer run meanwhile: this build's client
//! refuses a layout-1 namespace, also while it is upgraded.

use super::load::{bar, payload, status};
use super::measure::redis_cpu;
use super::report::UpgradeBench;
use super::{Env, ROUTE};
use anyhow::ensure;
use std::collections::BTreeMap;
use std::time::Instant;
use zdelay_core::Envelope;
use zdelay_core::client::IdGenerator;
use zdelay_core::job::{Due, OnConflict};
use zdelay_core::keys::Keys;
use zdelay_core::store::scripts::{self, EnqueueCall, EnqueueItem};
use zdelay_core::store::{Conn, lanes};
use zdelay_core::upgrade::{self, Outcome};

/// Jobs per `enqueue_jobs` call, as the client sends them.
const PER_CALL: usize = 500;

pub(super) async fn upgrade(env: &mut Env) -> anyhow::Result<UpgradeBench> {
    let n = env.args.jobs;
    let size = env.payload_size();
    let legacy = env.scratch.layout_1();
    // The scratch namespace was made on layout 2 when the bench connected: made again on
    // layout 1, as an older release made it.
    env.scratch.clean(&mut env.con, true).await?;
    let _: () = redis::cmd("HSET")
        .arg(legacy.schema())
        .arg("layout")
        .arg(1)
        .arg("shards")
        .arg(legacy.shards())
        .query_async(&mut env.con)
        .await?;
    let later = env.redis_now_ms() + 86_400_000;
    load_layout_1(&mut env.con, &legacy, n, size, |i| later + i as i64).await?;
    let keys = env.scratch.keys.clone();
    zdelay::app::register_lanes(&mut env.con, &env.config, &keys).await?;
    let registry = lanes::read_registry(&mut env.con, &keys).await?;

    status(&format!("upgrade: {n} waiting jobs to layout 2"));
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
    let mut left = 0u64;
    for shard in 0..legacy.shards() {
        left += redis::cmd("ZCARD")
            .arg(legacy.due(shard))
            .query_async::<u64>(&mut env.con)
            .await?;
    }
    ensure!(
        in_lane == n && left == 0 && report.to_lanes == n,
        "counts differ: {in_lane} in the lane, {left} left in layout 1, {} moved into lanes; \
         expected {n}",
        report.to_lanes
    );
    env.scratch.clean(&mut env.con, false).await?;
    Ok(UpgradeBench {
        jobs: n,
        payload_size: size,
        seconds,
        jobs_per_second: n as f64 / seconds,
        seconds_per_million: seconds * 1_000_000.0 / n as f64,
        redis_cpu_us_per_job: cpu * 1e6 / report.to_lanes.max(1) as f64,
        moved_to_lanes: report.to_lanes,
    })
}

/// Writes `n` jobs of the bench route into the layout-1 shards `legacy`, as a producer of an
/// older release did: 26-character ULIDs, the envelope of the route and payload, one
/// `enqueue_jobs` call per shard and 500 jobs, pipelined.
async fn load_layout_1(
    con: &mut Conn,
    legacy: &Keys,
    n: u64,
    size: usize,
    due: impl Fn(u64) -> i64,
) -> anyhow::Result<()> {
    let progress = bar(n, "enqueue on layout 1");
    let ids = IdGenerator::default();
    let mut i = 0u64;
    while i < n {
        let end = (i + 20_000).min(n);
        let mut by_shard: BTreeMap<u16, Vec<EnqueueItem>> = BTreeMap::new();
        for j in i..end {
            let id = ids.next();
            by_shard
                .entry(legacy.shard_of(&id))
                .or_default()
                .push(EnqueueItem {
                    id,
                    due: Due::At(due(j)),
                    envelope: Envelope::new(ROUTE, payload(j, size)).encode()?,
                    max_lateness_ms: None,
                    unique_for_ms: None,
                });
        }
        let calls: Vec<EnqueueCall> = by_shard
            .iter()
            .flat_map(|(shard, items)| {
                items.chunks(PER_CALL).map(|chunk| EnqueueCall {
                    keys: legacy.shard(*shard),
                    items: chunk,
                })
            })
            .collect();
        for answer in scripts::enqueue_jobs(con, OnConflict::Error, &calls).await? {
            ensure!(
                answer?.iter().all(Option::is_some),
                "enqueue_jobs on layout 1 refused a job (its id exists)"
            );
        }
        progress.inc(end - i);
        i = end;
    }
    progress.finish_and_clear();
    Ok(())
}
