//! `flow`: what a route's flow control costs Redis. One lane's all-due backlog is drained by
//! `move_lane` calls: with no flow control, with a rate that never holds (the bucket's
//! bookkeeping alone), with a rate that holds (`--rate`'s first value), the mover sleeping
//! until the time each held call names, as the daemon does; then with jobs of 10,000 keys (a
//! header each), without flow control and with a per-key rate that never holds. Redis CPU per
//! job of each, and the rate the held drain reached against the one configured.

use super::Env;
use super::lane::{load_lane, register, stored_id};
use super::load::{backlog_due, status};
use super::measure::{llen, redis_cpu_at};
use super::report::{FlowBench, FlowCase, Throughput};
use crate::metrics::LATENESS_BOUNDS_MS;
use anyhow::ensure;
use std::time::{Duration, Instant};
use zdelay_client::config::RouteFlow;
use zdelay_client::store::scripts::{self, Held, MoveLane};

/// Keys of the per-key cases.
const KEYS: u64 = 10_000;

pub(super) async fn flow(env: &mut Env) -> anyhow::Result<FlowBench> {
    let n = env.args.jobs;
    let rate = *env.args.rate.first().expect("--rate has a default") as f64;
    let burst = (rate / 10.0).ceil().max(1.0) as u32;
    let ids: Vec<String> = (0..n).map(stored_id).collect();
    let never = |per_key: Option<(String, f64, u32)>| RouteFlow {
        rate_per_s: per_key.is_none().then_some(1e12),
        burst: u32::MAX,
        max_length: None,
        per_key,
    };
    let cases = [
        ("no flow control", None, None),
        ("a rate that never holds", Some(never(None)), None),
        (
            "a rate that holds",
            Some(RouteFlow {
                rate_per_s: Some(rate),
                burst,
                max_length: None,
                per_key: None,
            }),
            None,
        ),
        ("10,000 keys, no flow control", None, Some(KEYS)),
        (
            "10,000 keys, a key rate that never holds",
            Some(never(Some(("tenant".to_owned(), 1e12, u32::MAX)))),
            Some(KEYS),
        ),
    ];
    let mut out = Vec::new();
    for (what, flow, tenants) in cases {
        status(&format!("flow: {what}: loading"));
        let now = env.redis_now_ms();
        let due = |i: u64| backlog_due(i, n, now);
        let keys = env.scratch.keys.clone();
        let lane = register(&mut env.con, &keys, &env.scratch.lane.clone()).await?;
        let size = env.payload_size();
        load_lane(&mut env.con, &keys, &lane, &ids, size, &due, what, tenants).await?;
        let _: () = redis::cmd("DEL")
            .arg(&lane.keys.flow)
            .query_async(&mut env.con)
            .await?;
        status(&format!("flow: {what}: draining"));
        let args = MoveLane {
            batch: env.batch,
            now_ms: None,
            max_payload: env.config.poller.max_payload.max(env.payload_size()),
            batch_bytes: env.config.poller.batch_bytes,
            bounds_ms: LATENESS_BOUNDS_MS,
            flow: flow.as_ref(),
        };
        let mut probe = env.con.clone();
        let cpu0 = redis_cpu_at(&mut probe, &lane.list).await?;
        let started = Instant::now();
        let (mut moved, mut calls, mut held_calls, mut deferred) = (0u64, 0u64, 0u64, 0u64);
        while moved < n {
            let reply = scripts::move_lane(&mut env.con, &lane, &args).await?;
            ensure!(
                reply.dead.iter().sum::<u64>() == 0,
                "{what}: jobs went to dead"
            );
            moved += reply.moved_total();
            deferred += reply.deferred;
            calls += 1;
            if reply.held != Held::Flowing {
                held_calls += 1;
                // As the mover: sleep until the time the held call named.
                let wait_us = reply
                    .next_due
                    .map_or(0.0, |ms| ms * 1000.0 - reply.now_us as f64);
                tokio::time::sleep(Duration::from_micros(wait_us.clamp(0.0, 1e6) as u64)).await;
            } else {
                ensure!(
                    reply.taken > 0 || moved >= n,
                    "{what}: a flowing call moved nothing with jobs due"
                );
            }
        }
        let wall = started.elapsed();
        let cpu = redis_cpu_at(&mut probe, &lane.list).await? - cpu0;
        ensure!(
            llen(&mut env.con, &lane.list).await? == n,
            "{what}: the list has not every job"
        );
        env.scratch.clean(&mut env.con, false).await?;
        let run = Throughput::new(n, wall, cpu, calls);
        status(&format!(
            "  {what}: {:.0} jobs/s, {:.2} Redis CPU s per million, {calls} calls ({held_calls} held)",
            run.jobs_per_sec, run.redis_cpu_s_per_million
        ));
        out.push(FlowCase {
            case: what,
            run,
            held_calls,
            deferred,
        });
    }
    let cpu = |k: usize| {
        out[k].run.redis_cpu_s_per_million / out[0].run.redis_cpu_s_per_million.max(1e-9)
    };
    Ok(FlowBench {
        rate_per_s: rate,
        burst,
        cpu_ratio_never_holds: cpu(1),
        cpu_ratio_holds: cpu(2),
        cpu_ratio_per_key: out[4].run.redis_cpu_s_per_million
            / out[3].run.redis_cpu_s_per_million.max(1e-9),
        // The held drain after its first burst, against the rate configured.
        reached_rate: (n.saturating_sub(u64::from(burst))) as f64 / out[2].run.seconds.max(1e-9),
        cases: out,
    })
}
