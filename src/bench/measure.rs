//! Facts about Redis and this machine: CPU and memory used, clocks, list lengths.

use anyhow::Context;
use std::time::{SystemTime, UNIX_EPOCH};
use zdelay_client::store::{self, Conn};

/// used_cpu_sys + used_cpu_user of the Redis process, seconds.
pub(super) async fn redis_cpu(con: &mut Conn) -> anyhow::Result<f64> {
    let info = store::info(con, "cpu").await?;
    let get = |k: &str| -> anyhow::Result<f64> {
        info.get(k)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("INFO cpu has no {k}"))
    };
    Ok(get("used_cpu_sys")? + get("used_cpu_user")?)
}

pub(super) async fn used_memory(con: &mut Conn) -> anyhow::Result<i64> {
    store::info(con, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .context("INFO memory has no used_memory")
}

fn local_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

pub(super) fn local_now_ms() -> i64 {
    local_now_us() / 1000
}

pub(super) fn system_time_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Redis clock minus local clock (ms), from the sample with the shortest round trip.
pub(super) async fn clock_offset_ms(con: &mut Conn) -> redis::RedisResult<i64> {
    let mut best = (i64::MAX, 0);
    for _ in 0..7 {
        let before = local_now_us();
        let redis_us = store::server_time_us(con).await?;
        let after = local_now_us();
        let rtt = after - before;
        if rtt < best.0 {
            best = (rtt, redis_us - (before + after) / 2);
        }
    }
    Ok((best.1 as f64 / 1000.0).round() as i64)
}

pub(super) async fn llen(con: &mut Conn, key: &str) -> redis::RedisResult<u64> {
    redis::cmd("LLEN").arg(key).query_async(con).await
}

pub(super) async fn del(con: &mut Conn, key: &str) -> redis::RedisResult<()> {
    redis::cmd("DEL").arg(key).query_async(con).await
}

/// Sum of ZCARD or HLEN over keys.
pub(super) async fn total_size(
    con: &mut Conn,
    cmd: &str,
    keys: &[String],
) -> redis::RedisResult<u64> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd(cmd).arg(key);
    }
    let counts: Vec<u64> = pipe.query_async(con).await?;
    Ok(counts.iter().sum())
}

pub(super) fn read_first_line(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().next().map(|l| l.trim().to_owned()))
}
