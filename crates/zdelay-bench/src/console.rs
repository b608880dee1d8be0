//! `console`: the operator console's answer times on a large namespace. Loads `--jobs`
//! scheduled jobs (spread over the next day), 1000 dead jobs and 10,000 schedules (1 in 100
//! paused), all in the bench route's lane, serves the
//! admin port in process (`admin::serve`, as the daemon does), then times every page and
//! API read over HTTP on loopback (20 requests each: median and max), and `stats::forecast`
//! called directly (the 10 minutes ahead in 1-minute steps, and a day in 10-minute steps).

use super::load::{load_jobs, status};
use super::report::{ConsoleBench, ConsoleTiming};
use super::{Env, Polled, ROUTE};
use anyhow::{Context, ensure};
use futures::{StreamExt, TryStreamExt};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use zdelay::admin::{self, Console, Health};
use zdelay::stats::{self, Horizon};
use zdelay_core::schedules::{NewSchedule, Repeat};
use zdelay_core::store;
use zdelay_core::{NewJob, OnConflict};

const REQUESTS: usize = 20;
const DEAD: u64 = 1000;
const SCHEDULES: u64 = 10_000;
/// Of the schedules, every this many is paused (listed by the console's bounded scan).
const PAUSE_EVERY: u64 = 100;

pub(super) async fn console(env: &mut Env) -> anyhow::Result<ConsoleBench> {
    env.scratch.clean(&mut env.con, false).await?;
    let n = env.args.jobs;
    status(&format!(
        "console: loading {n} scheduled jobs, {DEAD} dead, {SCHEDULES} schedules"
    ));
    let now = store::server_time_ms(&mut env.con).await?;
    let ids = load_jobs(
        &env.producer,
        n,
        env.payload_size(),
        |i| now + 60_000 + (i as i64 * 86_400_000) / n as i64,
        "scheduled jobs",
    )
    .await?;
    // Dead jobs: expired on arrival, sent to dead by the real movers.
    let expired: Vec<NewJob> = (0..DEAD)
        .map(|i| {
            NewJob::new(ROUTE, format!("dead {i}"))
                .id(format!("dead-{i}"))
                .at(now - 10_000)
                .max_lateness(Duration::from_millis(1))
        })
        .collect();
    for r in env
        .producer
        .enqueue_batch(expired, OnConflict::Replace)
        .await?
    {
        r?;
    }
    let tally = super::tally::Tally::new(&[1]);
    let ctx = env.context(vec![1]).await?;
    let movers = env.spawn_movers(ctx, Polled::Jobs, &tally, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.dead_total().await? < DEAD {
        ensure!(
            Instant::now() < deadline,
            "console: dead jobs did not arrive"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    movers.stop().await;
    // Concurrently: each upsert is a few round trips.
    let producer = &env.producer;
    futures::stream::iter(0..SCHEDULES)
        .map(|i| async move {
            let id = format!("bench-schedule-{i}");
            producer
                .schedule_set(NewSchedule::new(
                    &id,
                    ROUTE,
                    "tick",
                    Repeat::Every(Duration::from_secs(60 + i % 3600)),
                ))
                .await?;
            if i % PAUSE_EVERY == 0 {
                producer.schedule_pause(&id).await?;
            }
            Ok::<_, anyhow::Error>(())
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;

    // The admin port, as the daemon serves it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    // On loopback without a token, as a console without one serves every read there; no
    // second listener.
    let admin_cfg = zdelay_core::config::AdminConfig {
        listen: ([127, 0, 0, 1], port).into(),
        ui_prefix: env.config.admin.ui_prefix.clone(),
        ..Default::default()
    };
    let console = Arc::new(OnceLock::new());
    let _ = console.set(Console {
        client: env.producer.clone(),
        config: env.config.clone(),
    });
    let shutdown = CancellationToken::new();
    let server = admin::serve(
        &admin_cfg,
        zdelay::metrics::install(),
        Arc::new(Health::default()),
        console,
        shutdown.clone(),
    )
    .await
    .context("console: serving the admin port")?;
    let prefix = env.config.admin.ui_prefix.clone();
    let job = format!("/api/jobs/{}", ids[ids.len() / 2]);
    let mut timings = Vec::new();
    for (label, path) in [
        ("/", "/"),
        ("/api/stats", "/api/stats"),
        (
            "/api/forecast?next=10m&step=1m",
            "/api/forecast?next=10m&step=1m",
        ),
        (
            "/api/forecast?next=1d&step=10m",
            "/api/forecast?next=1d&step=10m",
        ),
        ("/api/dead", "/api/dead"),
        (
            "/api/dead?reason=expired&older_than=1s",
            "/api/dead?reason=expired&older_than=1s",
        ),
        (
            "/api/dead?reason=no-such (reads every dead job)",
            "/api/dead?reason=no-such",
        ),
        ("/api/dead/{id}", "/api/dead/dead-500"),
        ("/api/schedules", "/api/schedules"),
        ("/api/jobs/{id}", job.as_str()),
    ] {
        let url = format!("{prefix}{path}");
        let mut times = Vec::new();
        for _ in 0..REQUESTS {
            let t = Instant::now();
            let status = get(port, &url).await?;
            times.push(t.elapsed());
            ensure!(status == 200, "console: {url} answered {status}");
        }
        timings.push(timing(label, &mut times));
    }
    shutdown.cancel();
    server.await.ok();
    let mut con = env.con.clone();
    let mut direct = Vec::new();
    for (what, next, step) in [
        ("forecast 10m/1m (direct)", 600, 60),
        ("forecast 1d/10m (direct)", 86_400, 600),
    ] {
        let horizon = Horizon::new(Duration::from_secs(next), Duration::from_secs(step))
            .map_err(anyhow::Error::msg)?;
        let mut times = Vec::new();
        for _ in 0..REQUESTS {
            let t = Instant::now();
            let f = stats::forecast(&mut con, &env.config, horizon).await?;
            times.push(t.elapsed());
            ensure!(f.steps.len() as u64 == horizon.steps);
        }
        direct.push(timing(what, &mut times));
    }
    timings.extend(direct);
    Ok(ConsoleBench {
        scheduled_jobs: n,
        dead_jobs: DEAD,
        schedules: SCHEDULES,
        requests: REQUESTS,
        timings,
    })
}

fn timing(what: &str, times: &mut [Duration]) -> ConsoleTiming {
    times.sort();
    ConsoleTiming {
        what: what.to_owned(),
        median_ms: times[times.len() / 2].as_secs_f64() * 1000.0,
        max_ms: times.last().map_or(0.0, |t| t.as_secs_f64() * 1000.0),
    }
}

/// One HTTP/1.0 GET on loopback, the body read whole; its status.
async fn get(port: u16, path: &str) -> anyhow::Result<u16> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await?;
    let text = String::from_utf8_lossy(&reply);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("console: no HTTP status")
}
