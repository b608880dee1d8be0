//! The daemon: wires the admin server, the Redis connection, the wake listener, the
//! pollers and the sampler, and owns the shutdown order.
//!
//! Start-up never dies because Redis is down: it retries with backoff while `/readyz`
//! says not ready. It does stop on what retrying cannot fix: an admin address that cannot
//! be bound, or a namespace whose schema does not match this build or config.
//!
//! Shutdown (`shutdown` cancelled): pollers stop claiming after the script call in hand,
//! the listener and sampler stop, and `run` returns once they are done or the grace period
//! ends. Anything left is still in Redis: an abrupt exit costs latency, never jobs.

use crate::admin::{self, Health};
use crate::client::{self, ensure_schema, redis_client};
use crate::config::Config;
use crate::poller::{self, PollerContext, RawSource, Target};
use crate::scripts;
use crate::shards::ShardOwnership;
use crate::sinks::SinkHandle;
use crate::stats;
use crate::wake::{self, Wakers};
use anyhow::Context;
use redis::aio::ConnectionManager;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = crate::metrics::install();
    let health = Arc::new(Health::default());
    let admin = admin::serve(
        config.admin.listen,
        metrics,
        health.clone(),
        shutdown.clone(),
    )
    .await
    .with_context(|| format!("cannot listen on admin.listen {}", config.admin.listen))?;
    tracing::info!(listen = %config.admin.listen, "admin server up");

    let redis = redis_client(&config.redis).context("invalid redis.url")?;
    let Some(mut con) = connect_with_retry(&redis, &shutdown).await else {
        return Ok(());
    };
    let sinks = crate::sinks::build_all(&config)?;
    let poller_ctx = PollerContext::new(con.clone(), &config, sinks.clone());
    ensure_schema(&mut con, &poller_ctx.keys).await?;
    scripts::load_all(&mut con).await?;
    health.redis_ok.store(true, Ordering::Relaxed);

    let ownership = ShardOwnership::all(config.redis.shards);
    let mut wakers = Wakers::default();
    let mut targets = Vec::new();
    for &shard in ownership.owned() {
        let notify = Arc::new(Notify::new());
        wakers.shards.insert(shard, notify.clone());
        targets.push((Target::Shard(shard), notify));
    }
    for source in &config.sources {
        let resolved = RawSource::resolve(source, &poller_ctx.routes).with_context(|| {
            format!(
                "source {}: route {} is not a local list route",
                source.key, source.route
            )
        })?;
        let notify = Arc::new(Notify::new());
        wakers.sources.insert(source.key.clone(), notify.clone());
        targets.push((Target::Source(Arc::new(resolved)), notify));
    }

    let tracker = TaskTracker::new();
    let poller_ctx = Arc::new(poller_ctx);
    let keys = poller_ctx.keys.clone();
    for (target, notify) in targets {
        tracker.spawn(poller::run(
            poller_ctx.clone(),
            target,
            notify,
            shutdown.clone(),
        ));
    }
    tracker.spawn(wake::listen(
        redis,
        keys.clone(),
        Arc::new(wakers),
        shutdown.clone(),
    ));
    tracker.spawn(admin::check_redis(
        con.clone(),
        health.clone(),
        shutdown.clone(),
    ));
    tracker.spawn(sample_stats(con.clone(), config.clone(), shutdown.clone()));
    for sink in sinks.values() {
        tracker.spawn(check_sink(
            sink.clone(),
            con.clone(),
            keys.sink_states(),
            shutdown.clone(),
        ));
    }
    *health.sinks.lock().expect("sinks lock") = sinks.values().cloned().collect();
    tracker.close();
    health.pollers_running.store(true, Ordering::Relaxed);
    tracing::info!(
        shards = ownership.owned().len(),
        sources = config.sources.len(),
        routes = config.routes.len(),
        "zdelay running"
    );

    shutdown.cancelled().await;
    health.pollers_running.store(false, Ordering::Relaxed);
    tracing::info!(grace = ?config.poller.shutdown_grace, "shutting down: finishing batches in hand");
    if tokio::time::timeout(config.poller.shutdown_grace, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("grace period over with tasks still running; their jobs stay in Redis");
    }
    for sink in sinks.values() {
        // Anything a client library still queues must reach its broker before exit.
        sink.sink.flush(Duration::from_secs(5)).await;
    }
    admin.abort();
    tracing::info!("stopped");
    Ok(())
}

/// Connects, retrying with capped backoff until it works or shutdown is asked.
async fn connect_with_retry(
    redis: &redis::Client,
    shutdown: &CancellationToken,
) -> Option<ConnectionManager> {
    let mut delay = Duration::from_millis(200);
    let mut attempt = 1u32;
    loop {
        match client::connect(redis.clone()).await {
            Ok(con) => return Some(con),
            Err(e) => {
                crate::metrics::error_event("redis_connect", "start-up", &e);
                tracing::warn!(attempt, retry_in = ?delay, "redis unreachable; not ready");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return None,
        }
        delay = (delay * 2).min(Duration::from_secs(5));
        attempt += 1;
    }
}

/// Samples backlog gauges at `poller.stats_interval`, off the hot path.
async fn sample_stats(mut con: ConnectionManager, config: Config, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        match stats::gather(&mut con, &config).await {
            Ok(s) => stats::publish_gauges(&s),
            Err(e) => crate::metrics::error_event("redis", "stats sampler", &e),
        }
        tokio::select! {
            _ = tokio::time::sleep(config.poller.stats_interval) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}

/// Checks a sink every few seconds (faster while it is down) for `/readyz`, the gauge, and
/// `zdelay stats` (through the `<ns>:sinks` hash).
async fn check_sink(
    sink: Arc<SinkHandle>,
    mut con: ConnectionManager,
    states_key: String,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let result = sink.sink.check().await;
        let up = result.is_ok();
        let state = serde_json::json!({
            "kind": sink.kind,
            "up": up,
            "error": result.as_ref().err(),
            "at": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or_default(),
        });
        sink.checked(result);
        let write = redis::cmd("HSET")
            .arg(&states_key)
            .arg(&sink.name)
            .arg(state.to_string())
            .query_async::<()>(&mut con)
            .await;
        if let Err(e) = write {
            crate::metrics::error_event("redis", "sink state", &e);
        }
        ::metrics::gauge!(crate::metrics::SINK_UP, "sink" => sink.name.clone()).set(if up {
            1.0
        } else {
            0.0
        });
        let every = if up {
            Duration::from_secs(5)
        } else {
            Duration::from_secs(1)
        };
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}
