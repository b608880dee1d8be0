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
use super::report::{FlowBench, FlowCase, KeyBurst, Throughput};
use anyhow::ensure;
use std::time::{Duration, Instant};
use zdelay::metrics::LATENESS_BOUNDS_MS;
use zdelay_core::config::RouteFlow;
use zdelay_core::store::scripts::{self, Held, MoveLane};

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
            trim: None,
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
    let key_burst = key_burst(env).await?;
    let (unique_waiting, unique_remembered) = unique_memory(env).await?;
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
        key_burst,
        unique_bytes_per_waiting_job: unique_waiting,
        unique_bytes_per_remembered_id: unique_remembered,
    })
}

/// `--jobs` jobs with 26-character ids enqueued with a one-hour unique window, then moved:
/// bytes per id of the window while they wait (`unique`) and once delivered (`windows`).
async fn unique_memory(env: &mut Env) -> anyhow::Result<(f64, f64)> {
    let n = env.args.jobs;
    status("flow: unique windows: loading");
    let keys = env.scratch.keys.clone();
    let lane = register(&mut env.con, &keys, &env.scratch.lane.clone()).await?;
    let now = env.redis_now_ms();
    let ids: Vec<String> = (0..n).map(|i| format!("{:026}", i)).collect();
    let payload = b"x".to_vec();
    for chunk in ids.chunks(1000) {
        let items: Vec<scripts::LaneItem> = chunk
            .iter()
            .map(|id| scripts::LaneItem {
                id,
                due: zdelay_core::Due::At(now),
                payload: &payload,
                meta: None,
                max_lateness_ms: None,
                unique_for_ms: Some(3_600_000),
            })
            .collect();
        let done = scripts::enqueue_lane(
            &mut env.con,
            &lane,
            zdelay_core::OnConflict::Replace,
            "bench:wake",
            &items,
        )
        .await?;
        ensure!(
            done.iter()
                .all(|d| *d == Some(zdelay_core::Enqueued::Added)),
            "unique windows: an id was not added (left from an earlier run?)"
        );
    }
    let probe = env.con.clone();
    let usage = |key: String| {
        let mut con = probe.clone();
        async move {
            let bytes: Option<u64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .arg("SAMPLES")
                .arg(0)
                .query_async(&mut con)
                .await?;
            anyhow::Ok(bytes.unwrap_or(0) as f64 / n.max(1) as f64)
        }
    };
    let waiting = usage(lane.keys.unique.clone()).await?;
    status("flow: unique windows: moving");
    let args = MoveLane {
        batch: env.batch,
        now_ms: None,
        max_payload: env.config.poller.max_payload,
        batch_bytes: env.config.poller.batch_bytes,
        bounds_ms: LATENESS_BOUNDS_MS,
        flow: None,
        trim: None,
    };
    let mut moved = 0;
    while moved < n {
        let now_moved = scripts::move_lane(&mut env.con, &lane, &args)
            .await?
            .moved_total();
        ensure!(now_moved > 0, "unique windows: a move call moved nothing");
        moved += now_moved;
    }
    let remembered = usage(lane.keys.windows.clone()).await?;
    env.scratch.clean(&mut env.con, false).await?;
    status(&format!(
        "  unique windows: {waiting:.0} B per job waiting, {remembered:.0} B per id remembered"
    ));
    Ok((waiting, remembered))
}

/// Key "a"'s `--jobs` jobs and key "b"'s 100, all due now, "b"'s last in due order, at
/// 1,000/s per key: how long "b" waits while the mover sets "a"'s burst aside.
async fn key_burst(env: &mut Env) -> anyhow::Result<KeyBurst> {
    const OTHER: u64 = 100;
    // The issue's burst: 100,000 (fewer with a smaller --jobs).
    let n = env.args.jobs.min(100_000);
    status("flow: one key's burst ahead of another's: loading");
    let keys = env.scratch.keys.clone();
    let lane = register(&mut env.con, &keys, &env.scratch.lane.clone()).await?;
    let ids: Vec<String> = (0..n + OTHER).map(stored_id).collect();
    let now = env.redis_now_ms();
    let size = env.payload_size();
    // Jobs 0..n are key a's (tenant t0 of one), then b's (t0 of one as well: a new lane key).
    load_lane(
        &mut env.con,
        &keys,
        &lane,
        &ids[..n as usize],
        size,
        &|_| now,
        "key a",
        Some(1),
    )
    .await?;
    let meta = r#"{"headers":{"tenant":"b"}}"#;
    let payloads: Vec<Vec<u8>> = (0..OTHER).map(|i| i.to_string().into_bytes()).collect();
    let items: Vec<scripts::LaneItem> = ids[n as usize..]
        .iter()
        .zip(&payloads)
        .map(|(id, p)| scripts::LaneItem {
            id,
            due: zdelay_core::Due::At(now),
            payload: p,
            meta: Some(meta),
            max_lateness_ms: None,
            unique_for_ms: None,
        })
        .collect();
    scripts::enqueue_lane(
        &mut env.con,
        &lane,
        zdelay_core::OnConflict::Replace,
        "bench:wake",
        &items,
    )
    .await?;
    let flow = RouteFlow {
        rate_per_s: None,
        burst: 0,
        max_length: None,
        per_key: Some(("tenant".to_owned(), 1000.0, 100)),
    };
    let args = MoveLane {
        batch: env.batch,
        now_ms: None,
        max_payload: env.config.poller.max_payload.max(size),
        batch_bytes: env.config.poller.batch_bytes,
        bounds_ms: LATENESS_BOUNDS_MS,
        flow: Some(&flow),
        trim: None,
    };
    status("flow: one key's burst ahead of another's: draining");
    let others = &ids[n as usize..];
    let mut probe = env.con.clone();
    let cpu0 = redis_cpu_at(&mut probe, &lane.list).await?;
    let started = Instant::now();
    let mut calls = 0u64;
    loop {
        scripts::move_lane(&mut env.con, &lane, &args).await?;
        calls += 1;
        let waiting: Vec<Option<f64>> = redis::cmd("ZMSCORE")
            .arg(&lane.keys.due)
            .arg(others)
            .query_async(&mut env.con)
            .await?;
        if waiting.iter().all(Option::is_none) {
            break;
        }
        ensure!(calls < 100_000, "key b's jobs never left");
    }
    let waited = started.elapsed();
    let cpu = redis_cpu_at(&mut probe, &lane.list).await? - cpu0;
    env.scratch.clean(&mut env.con, false).await?;
    let out = KeyBurst {
        burst_jobs: n,
        other_key_waited_ms: waited.as_secs_f64() * 1000.0,
        // All but key a's burst (100) are set aside before b's jobs are reached.
        redis_cpu_us_per_job_set_aside: cpu * 1e6 / n.max(1) as f64,
        calls,
    };
    status(&format!(
        "  one key's burst of {n}: the other key waited {:.0} ms, {:.2} µs Redis CPU per job set aside",
        out.other_key_waited_ms, out.redis_cpu_us_per_job_set_aside
    ));
    Ok(out)
}
