//! The daemon: wires the admin server, the Redis connection, the pollers (through their
//! supervisor), the sink checkers and the stats sampler, and owns the shutdown order.
//!
//! Start-up never dies because Redis is down: it retries with backoff while `/readyz`
//! says not ready. It does stop on what retrying cannot fix: an admin address that cannot
//! be bound, or a namespace whose schema does not match this build or config, or that
//! `zdelay reshard` is moving to another shard count. A running daemon whose scripts a
//! shard's layout fence refuses (the namespace was resharded under it) stops the same way,
//! through the graceful shutdown, and `run` returns the reason; so does a daemon whose
//! instance id another running daemon holds (`poller::InstanceIdInUse`).
//!
//! Shutdown (`shutdown` cancelled): pollers stop claiming after the script call in hand and
//! settle the batch in hand, the listener and sampler stop, the sinks flush their client
//! queues (all at once), and `run` returns once done or when the grace period ends.
//! Anything left is still in Redis: an abrupt exit costs latency, never jobs.

use crate::admin::{self, Health};
use crate::poller::{self, Leases, Options, Ownership, PollerContext};
use crate::sinks::{self, SinkHandle};
use crate::stats;
use crate::trace::HopTracer;
use anyhow::Context;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zdelay_core::config::Config;
use zdelay_core::keys::Keys;
use zdelay_core::lane::Lane;
use zdelay_core::store::{self, Conn, Layout, StoreError, scripts};
use zdelay_core::{Client, Routes};

/// How long each sink may take to flush its client-side queue at exit.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let metrics = crate::metrics::install();
    tokio::spawn(crate::metrics::run_upkeep(
        metrics.clone(),
        shutdown.clone(),
    ));
    let health = Arc::new(Health::default());
    let console = Arc::new(std::sync::OnceLock::new());
    let admin = admin::serve(
        &config.admin,
        metrics,
        health.clone(),
        console.clone(),
        shutdown.clone(),
    )
    .await
    .context("starting the admin server")?;
    tracing::info!(
        listen = %config.admin.listen,
        console = config.admin.console,
        metrics_listen = ?config.admin.metrics_listen,
        "admin server up"
    );

    let sinks = sinks::build_all(&config)?;
    // `zdelay reshard` changes the spread shards' count under running daemons, and Redis
    // may lose the namespace's data: the pollers start again on what the schema says then.
    loop {
        match serve(&config, &sinks, &health, &console, &shutdown).await? {
            Served::Stopped => break,
            Served::Follow => {
                tracing::info!(
                    "starting again on the namespace's new shard count, or to register its \
                     lost lanes"
                )
            }
        }
    }
    admin.abort();
    tracing::info!("stopped");
    Ok(())
}

/// How one run of the pollers ended.
enum Served {
    /// Shutdown was asked (or start-up was interrupted by it).
    Stopped,
    /// A fence refused them because the spread shards moved to another count, or a lane
    /// lost its marker.
    Follow,
}

/// Runs the pollers, the sink checkers and the stats sampler on the namespace as the schema
/// says it now, until shutdown or a fence that asks to start again.
async fn serve(
    config: &Config,
    sinks: &sinks::Sinks,
    health: &Arc<Health>,
    console: &Arc<std::sync::OnceLock<admin::Console>>,
    outer: &CancellationToken,
) -> anyhow::Result<Served> {
    let config = config.clone();
    let sinks = sinks.clone();
    let health = health.clone();
    // Cancelled by the outer shutdown, or by this run alone when it follows an upgrade.
    let shutdown = outer.child_token();
    let pubsub = store::pubsub_clients(&config.redis)?;
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    // Redis may drop between the connect and the checks: the whole sequence is retried.
    let started = retry_start_up(&health, &shutdown, || async {
        let Some(mut con) = connect_with_retry(&config, &health, &shutdown).await else {
            return Ok(None);
        };
        // Tests restart Redis in this window.
        zdelay_core::failpoint::hold("start_up_hold_after_connect").await;
        let server = store::check_server(&mut con).await?;
        // Before anything is written: a stream route whose key holds a list would kill
        // every job.
        if let Some(why) = store::lanes::stream_key_conflict(&mut con, &config).await? {
            anyhow::bail!(why);
        }
        let shards = store::ensure_schema(&mut con, &keys, Some(config.testing.clock))
            .await
            .map_err(|e| match e {
                StoreError::Resharding { from, to, .. } => {
                    anyhow::anyhow!(poller::refusal_message(
                        keys.namespace(),
                        keys.shards(),
                        Layout::Migrating { from, to }
                    ))
                }
                other => other.into(),
            })?;
        scripts::load_all(&mut con).await?;
        load_producer_functions(&mut con).await;
        // The namespace's count (a reshard changes it under running daemons).
        let keys = Keys::new(keys.namespace(), shards);
        let lanes = register_lanes(&mut con, &config, &keys).await?;
        // The console reads and acts through a client of its own, like the CLI.
        let console_client = Client::connect(&config.redis).await?;
        Ok(Some((con, server, console_client, (keys, lanes))))
    })
    .await?;
    let Some((mut con, server, console_client, (keys, lanes))) = started else {
        return Ok(Served::Stopped);
    };
    tracing::info!(%server, "redis reachable");
    refuse_unsupported_brokers(&sinks).await?;
    health.redis_ok.store(true, Ordering::Relaxed);
    let console_client = console_client
        .with_routes(Routes::from_config(&config))
        .with_max_payload(config.poller.max_payload);
    let requests_client = console_client.clone();
    let _ = console.set(admin::Console {
        client: console_client,
        config: config.clone(),
    });

    let mut ctx = PollerContext::new(con.clone(), &config, sinks.clone());
    ctx.with_lanes(keys.clone(), lanes);
    if con.clock().is_test() {
        tracing::warn!(
            namespace = keys.namespace(),
            "the namespace has a test clock"
        );
    }
    ctx.tracer = HopTracer::from_config(&config.tracing).map_err(anyhow::Error::msg)?;
    // The heartbeat and the stats sampler (which reads every shard) get connections of
    // their own on a cluster, like each master's shards: nothing waits for a hung node it
    // does not need. All connect at once (a hung node costs each its connect timeout).
    let independent = || {
        retry_start_up(&health, &shutdown, || async {
            Ok(Some(con.independent(&config.redis).await?))
        })
    };
    let (_, leases_con, sampler_con) = tokio::join!(
        ctx.connect_lanes(&config.redis),
        independent(),
        independent(),
    );
    let (Some(leases_con), Some(sampler_con)) = (leases_con?, sampler_con?) else {
        return Ok(Served::Stopped);
    };
    let ctx = Arc::new(ctx);
    // What this daemon polls is decided by poller-slot leases shared with the others.
    let instance = Leases::instance_id(config.poller.instance_id.as_deref());
    let nonce = Leases::nonce();
    let ownership = Ownership::new(Default::default());
    let owned = ownership.subscribe();
    let leases = Leases {
        con: leases_con,
        keys: keys.clone(),
        instance: instance.clone(),
        nonce: nonce.clone(),
        per_target: config.poller.per_shard,
        lease: config.poller.slot_lease,
        shards: ctx.polled_shards(),
        sources: ctx
            .all_targets()
            .into_iter()
            .filter(|t| !matches!(t, poller::TargetId::Shard(_)))
            .collect(),
    };
    let pollers = poller::start(
        ctx.clone(),
        owned,
        Options {
            wake_clients: pubsub,
            on_batch: None,
        },
        &shutdown,
    );

    let tracker = TaskTracker::new();
    let mut registration = tracker.spawn(leases.run(ownership, shutdown.clone()));
    tracker.spawn(admin::check_redis(
        con.clone(),
        config.redis.clone(),
        health.clone(),
        shutdown.clone(),
    ));
    tracker.spawn(sample_stats(
        sampler_con,
        requests_client.clone(),
        config.clone(),
        pollers.wakers(),
        shutdown.clone(),
    ));
    tracker.spawn(apply_schedule_requests(
        requests_client,
        con.clone(),
        format!("{instance} {nonce}"),
        shutdown.clone(),
    ));
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
        %instance,
        shards = keys.shards(),
        sources = config.sources.len(),
        routes = config.routes.len(),
        per_shard = config.poller.per_shard,
        "zdelay running"
    );

    let mut in_use = None;
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = ctx.refused.cancelled() => shutdown.cancel(),
        Ok(Err(e)) = &mut registration => {
            in_use = Some(e);
            shutdown.cancel();
        }
    }
    health.pollers_running.store(false, Ordering::Relaxed);
    tracing::info!(grace = ?config.poller.shutdown_grace, "shutting down: finishing batches in hand");
    let stopped = async {
        pollers.wait().await;
        // The batches in hand are settled: hand the slots to the other daemons at once.
        Leases::release(&mut con, &keys, &instance, &nonce).await;
        // The last interval's deliveries count in the shared activity too.
        if let Err(e) = crate::activity::flush(&mut con, &keys).await {
            crate::metrics::error_event("redis", "activity", &e);
        }
        tracker.wait().await;
    };
    if tokio::time::timeout(config.poller.shutdown_grace, stopped)
        .await
        .is_err()
    {
        tracing::warn!("grace period over with tasks still running; their jobs stay in Redis");
    }
    // Anything a client library still queues must reach its broker before exit.
    sinks::flush_all(&sinks, FLUSH_TIMEOUT).await;
    if let Some(tracer) = &ctx.tracer {
        let tracer = tracer.clone();
        // Blocking (the SDK's shutdown waits for its export thread), bounded.
        let _ = tokio::task::spawn_blocking(move || tracer.shutdown(FLUSH_TIMEOUT)).await;
    }
    if let Some(in_use) = in_use {
        return Err(in_use.into());
    }
    if ctx.restarts_pollers() && !outer.is_cancelled() {
        return Ok(Served::Follow);
    }
    match ctx.refusal() {
        Some(why) => Err(anyhow::anyhow!(why)),
        None => Ok(Served::Stopped),
    }
}

/// Checks every sink once, together: a broker that answers with a version older than its
/// sink supports stops start-up with that message (better than a stall later). A broker
/// that does not answer yet is fine: sinks connect lazily and pause while it is down.
async fn refuse_unsupported_brokers(sinks: &sinks::Sinks) -> anyhow::Result<()> {
    let checks = sinks.values().map(|sink| async move {
        let health = tokio::time::timeout(Duration::from_secs(5), sink.sink.check()).await;
        (sink, health)
    });
    for (sink, health) in futures::future::join_all(checks).await {
        match health {
            Ok(sinks::Health::Unsupported(why)) => {
                anyhow::bail!("sink {} ({}): {why}", sink.name, sink.kind)
            }
            Ok(health) => sink.checked(health.into_result()),
            Err(_) => {}
        }
    }
    Ok(())
}

/// Runs a start-up step until it succeeds, fails in a way retrying cannot fix, or shutdown
/// is asked (`Ok(None)`, as when the step itself returns it). A Redis that drops, restarts,
/// loads or is busy mid-way is retried with capped backoff, logged once per episode.
async fn retry_start_up<T, Step, Fut>(
    health: &Health,
    shutdown: &CancellationToken,
    mut step: Step,
) -> anyhow::Result<Option<T>>
where
    Step: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let mut delay = Duration::from_millis(200);
    loop {
        match step().await {
            Ok(done) => {
                crate::metrics::recovered("redis", "start-up");
                return Ok(done);
            }
            Err(e) if is_transient_start_up(&e) => {
                health.redis_ok.store(false, Ordering::Relaxed);
                crate::metrics::error_event("redis", "start-up", &e);
            }
            Err(e) => return Err(e),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => return Ok(None),
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Whether a start-up step failed on Redis in a way that passes (see `store::is_transient`).
fn is_transient_start_up(e: &anyhow::Error) -> bool {
    use zdelay_core::ClientError;
    let store_transient = |e: &StoreError| match e {
        StoreError::Connect { .. } => true,
        StoreError::Redis(r) => store::is_transient(r),
        _ => false,
    };
    e.chain().any(|cause| {
        cause
            .downcast_ref::<redis::RedisError>()
            .is_some_and(store::is_transient)
            || cause.downcast_ref::<StoreError>().is_some_and(store_transient)
            || matches!(cause.downcast_ref::<ClientError>(), Some(ClientError::Store(s)) if store_transient(s))
    })
}

/// On a namespace on storage layout 2: marks the layout-1 shards so that layout-1 calls are
/// refused instead of writing where nothing reads, registers every local route's lane
/// (writing its marker) and the two-phase routes and sinks (whose jobs the spread shards
/// hold). A route that changed between local and two-phase is refused: its waiting jobs
/// would stay where nothing moves them (moving them is not built yet).
pub async fn register_lanes(
    con: &mut Conn,
    config: &Config,
    keys: &Keys,
) -> anyhow::Result<Vec<Arc<Lane>>> {
    // The layout-1 shards' fence is a SET on every master: written in the background, so a
    // master that hangs holds up neither this start nor the other masters' shards.
    tokio::spawn(mark_layout_1_shards(con.clone(), keys.clone()));
    let registry = store::lanes::read_registry(con, keys).await?;
    let is_local = |route: &zdelay_core::config::RouteConfig| {
        config.sinks.get(&route.sink).is_some_and(|s| s.is_local())
    };
    for route in &config.routes {
        let (was, is) = match (is_local(route), &registry) {
            (true, r) if r.two_phase.contains_key(&route.name) => {
                ("two-phase", "local (a route lane)")
            }
            (false, r) if r.by_route.contains_key(&route.name) => {
                ("local (a route lane)", "two-phase")
            }
            _ => continue,
        };
        anyhow::bail!(
            "in namespace {}, route {} was {was} and is {is} in this config: a route's waiting \
             jobs are not moved between a route lane and the spread shards; give the changed \
             route a new name",
            keys.namespace(),
            route.name
        );
    }
    let plan = zdelay_core::routes::LaneRoutes::from_config(config);
    store::lanes::register_two_phase(con, keys, &plan.two_phase, &plan.sinks).await?;
    let mut lanes = Vec::new();
    for route in &plan.local {
        let (lane, change) =
            store::lanes::register(con, keys, &route.name, &route.list, route.push).await?;
        tracing::info!(route = %route.name, lane = %lane.wake_name(), list = %lane.list, ?change, "route lane");
        lanes.push(Arc::new(lane));
    }
    relocate_lanes(con, keys, &lanes).await?;
    Ok(lanes)
}

/// Marks the layout-1 shards of a layout-2 namespace ([`store::mark_layout_1_shards`]), again
/// until every master took its markers.
async fn mark_layout_1_shards(mut con: Conn, keys: Keys) {
    let mut delay = Duration::from_millis(200);
    while let Err(e) = store::mark_layout_1_shards(&mut con, &keys).await {
        tracing::warn!(error = %e, "marking the layout-1 shards: trying again");
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Moves what the retired lanes of each route still hold (its list moved to another hash
/// slot, now or at an earlier start that did not finish) into the route's live lane, before
/// the pollers start. Other daemons starting meanwhile wait for it (one run at a time).
async fn relocate_lanes(con: &mut Conn, keys: &Keys, lanes: &[Arc<Lane>]) -> anyhow::Result<()> {
    let registry = store::lanes::read_registry(con, keys).await?;
    for lane in lanes {
        let retired: Vec<_> = registry.retired_of(&lane.route).collect();
        if !store::relocate::unfinished(con, keys, &retired).await? {
            continue;
        }
        tracing::info!(route = %lane.route, lane = %lane.wake_name(), "relocating the route's jobs from its retired lanes (its list moved to another hash slot)");
        let done = store::relocate::relocate(con, keys, lane, &retired).await?;
        tracing::info!(
            route = %lane.route,
            moved = done.moved,
            windows = done.windows,
            put_before = done.put_before,
            superseded = done.superseded,
            "relocated"
        );
    }
    Ok(())
}

/// Connects, retrying with capped backoff until it works or shutdown is asked.
/// Refused credentials are reported as such (they will not fix themselves, but a server's
/// ACL may change), on the same backoff.
async fn connect_with_retry(
    config: &Config,
    health: &Health,
    shutdown: &CancellationToken,
) -> Option<Conn> {
    let mut delay = Duration::from_millis(200);
    let mut attempt = 1u32;
    loop {
        match Conn::connect(&config.redis).await {
            Ok(con) => {
                crate::metrics::recovered("redis_auth", "start-up");
                crate::metrics::recovered("redis_connect", "start-up");
                return Some(con);
            }
            // Logged once per episode by `error_event`; each retry only at debug level.
            Err(e) if e.is_auth() => {
                health.redis_failed(&e);
                crate::metrics::error_event("redis_auth", "start-up", &e);
                tracing::debug!(attempt, retry_in = ?delay, "redis refuses the credentials");
            }
            Err(e) => {
                health.redis_failed(&e);
                crate::metrics::error_event("redis_connect", "start-up", &e);
                tracing::debug!(attempt, retry_in = ?delay, "redis unreachable; not ready");
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

/// Samples backlog gauges and writes this process's activity tally (`activity`) at
/// `poller.stats_interval`, off the hot path.
async fn sample_stats(
    mut con: Conn,
    client: Client,
    config: Config,
    wakers: Arc<poller::Wakers>,
    shutdown: CancellationToken,
) {
    let keys = Keys::new(&config.redis.namespace, config.redis.shards);
    let mut lanes = stats::LaneSampler::default();
    let mut windows = WindowSweep::default();
    let mut top_missed = stats::TopMissed::default();
    while !shutdown.is_cancelled() {
        lanes.written(wakers.take_lane_writes());
        match stats::gather_sampled(&mut con, &config, Some(&mut lanes)).await {
            Ok(s) => {
                stats::publish_gauges(&s);
                crate::metrics::recovered("redis", "stats sampler");
            }
            Err(e) => crate::metrics::error_event("redis", "stats sampler", &e),
        }
        match crate::activity::flush(&mut con, &keys).await {
            Ok(_) => crate::metrics::recovered("redis", "activity"),
            Err(e) => crate::metrics::error_event("redis", "activity", &e),
        }
        // Producers in other languages need the library on every master, also after a
        // restart that lost it or an older daemon's start that put its older revision back;
        // where the start-up load could not run it stays a warning.
        match zdelay_core::store::functions::sync(&mut con).await {
            Ok(outcomes) => report_producer_functions(&outcomes),
            Err(e) => tracing::debug!(error = %e, "producer functions not loaded"),
        }
        match windows.step(&mut con, &keys).await {
            Ok(()) => crate::metrics::recovered("redis", "unique windows"),
            Err(e) => crate::metrics::error_event("redis", "unique windows", &e),
        }
        match crate::gone::step(&mut con, &config, &keys).await {
            Ok(_) => crate::metrics::recovered("redis", "gone routes"),
            Err(e) => crate::metrics::error_event("redis", "gone routes", &e),
        }
        match stats::schedule_series(&client, &config.admin, &mut top_missed).await {
            Ok(rows) => {
                crate::metrics::set_schedule_series(&rows);
                crate::metrics::recovered("redis", "schedule health");
            }
            Err(e) => crate::metrics::error_event("redis", "schedule health", &e),
        }
        tokio::select! {
            _ = tokio::time::sleep(config.poller.stats_interval) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}

/// Windows sets [`WindowSweep`] looks at per stats sample.
const WINDOW_SETS_PER_SAMPLE: usize = 16;

/// Drops the unique windows that ended from every windows set in turn (each spread shard's,
/// each lane's the registry ever gave out), a few sets per stats sample. Enqueues
/// drop some at each call; this reaches the sets no enqueue does: a removed route's lane, a
/// retired lane, a shard after a quiet spell.
#[derive(Default)]
struct WindowSweep {
    sets: Vec<String>,
    /// The registry's field count when `sets` was made (it grows with every lane).
    registry_fields: Option<usize>,
    next: usize,
}

impl WindowSweep {
    async fn step(&mut self, con: &mut Conn, keys: &Keys) -> anyhow::Result<()> {
        use zdelay_core::store::{lanes, scripts};
        let fields: usize = redis::cmd("HLEN")
            .arg(keys.lanes())
            .query_async(con)
            .await?;
        if self.registry_fields != Some(fields) {
            self.sets = (0..keys.shards())
                .map(|s| keys.shard(s).windows)
                .chain(lanes::every_lanes_windows(con, keys).await?)
                .collect();
            self.registry_fields = Some(fields);
        }
        for _ in 0..WINDOW_SETS_PER_SAMPLE.min(self.sets.len()) {
            self.next %= self.sets.len();
            let dropped = scripts::drop_ended_windows(con, &self.sets[self.next]).await?;
            if dropped > 0 {
                tracing::debug!(set = %self.sets[self.next], dropped, "ended unique windows dropped");
            }
            self.next += 1;
        }
        Ok(())
    }
}

/// How often a daemon looks for producers' schedule requests (one `EXISTS`).
const SCHEDULE_REQUESTS_EVERY: Duration = Duration::from_millis(250);

/// Applies producers' schedule requests (`zd2_schedule`, `schedule_requests`) soon after they
/// are made, and prunes their outcomes once they are an hour old.
async fn apply_schedule_requests(
    client: Client,
    mut con: Conn,
    holder: String,
    shutdown: CancellationToken,
) {
    use zdelay_core::schedule_requests;
    let requests = client.keys().schedule_requests();
    let mut pruned_at = std::time::Instant::now();
    while !shutdown.is_cancelled() {
        let waiting: redis::RedisResult<bool> = redis::cmd("EXISTS")
            .arg(&requests)
            .query_async(&mut con)
            .await;
        let mut again = false;
        if waiting.is_ok() {
            crate::metrics::recovered("redis", "schedule requests");
        }
        match waiting {
            Ok(true) => match schedule_requests::apply_requests(&client, &holder).await {
                Ok(applied) => {
                    if let Some(why) = &applied.deferred_why {
                        tracing::debug!(deferred = applied.deferred, %why, "schedule requests left for later");
                    }
                    // A full call: more may wait.
                    again = applied.applied >= schedule_requests::REQUESTS_PER_CALL;
                }
                Err(e) => crate::metrics::error_event("redis", "schedule requests", &e),
            },
            Ok(false) => {}
            Err(e) => crate::metrics::error_event("redis", "schedule requests", &e),
        }
        if pruned_at.elapsed() >= Duration::from_secs(60) {
            pruned_at = std::time::Instant::now();
            if let Err(e) = schedule_requests::prune_results(&client).await {
                crate::metrics::error_event("redis", "schedule requests", &e);
            }
        }
        if again {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(SCHEDULE_REQUESTS_EVERY) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}

/// Checks a sink every few seconds (faster while it is down) for `/readyz`, the gauge, and
/// `zdelay stats` (through the `<ns>:sinks` hash).
async fn check_sink(
    sink: Arc<SinkHandle>,
    mut con: Conn,
    states_key: String,
    shutdown: CancellationToken,
) {
    // What the sink's address turned out to hold, probed at most every 30 s while down.
    let mut finding: Option<(std::time::Instant, Option<String>)> = None;
    while !shutdown.is_cancelled() {
        let mut result = sink.sink.check().await.into_result();
        if let Err(why) = &mut result {
            let stale = finding
                .as_ref()
                .is_none_or(|(at, _)| at.elapsed() > Duration::from_secs(30));
            if stale {
                let (protocol, addrs) = &sink.endpoints;
                let found = match addrs.first() {
                    Some(addr) => sinks::peer::explain(addr, *protocol).await,
                    None => None,
                };
                finding = Some((std::time::Instant::now(), found));
            }
            // Library errors may span lines and quote the address they were given; the state
            // is read on one line, by anyone who can read the namespace.
            let mut text = zdelay_core::config::redact_known(why).replace('\n', " ");
            if let Some((_, Some(found))) = &finding {
                text = format!("{found}; {text}");
            }
            *why = text;
        } else {
            finding = None;
        }
        let up = result.is_ok();
        let state = serde_json::json!({
            "kind": sink.kind,
            "up": up,
            "error": result.as_ref().err(),
            "held": sink.held(),
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
        match write {
            Ok(()) => crate::metrics::recovered("redis", "sink state"),
            Err(e) => crate::metrics::error_event("redis", "sink state", &e),
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

/// First SIGTERM/SIGINT: cancels `shutdown` (graceful). Second: exits at once (code 130).
pub async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("signal received: stopping (a second signal exits at once)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    eprintln!("zdelay: second signal: exiting now; unfinished work stays in Redis");
    std::process::exit(130);
}

/// Loads the producer protocol's function library (`store::functions`), for producers in
/// other languages (`FCALL`), unless a newer revision is there. Not fatal: the daemon itself
/// runs scripts, so a server without Functions (before Redis 7.0) or a user without
/// `+function|load` only leaves those producers without it, which the warning says.
async fn load_producer_functions(con: &mut store::Conn) {
    use zdelay_core::store::functions;
    match functions::sync(con).await {
        Ok(outcomes) => report_producer_functions(&outcomes),
        Err(e) => tracing::warn!(
            library = functions::LIBRARY,
            error = %e,
            "the producer protocol's function library was not loaded: producers that call \
             FCALL zd{}_… cannot enqueue until a daemon loads it (it needs Redis 7.0 or \
             Valkey 7.2, and the daemon's ACL user needs +function|load)",
            functions::PROTOCOL
        ),
    }
}

/// Logs what a sync of the function library found on each master: a load or a replace each
/// time, a newer revision or another body once while it stays (the sampler syncs at every
/// sample).
fn report_producer_functions(outcomes: &[zdelay_core::store::functions::NodeOutcome]) {
    use zdelay_core::store::functions::{self, Outcome};
    static REPORTED: std::sync::Mutex<Vec<functions::NodeOutcome>> =
        std::sync::Mutex::new(Vec::new());
    let mut reported = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
    let mine = functions::identity();
    for (node, outcome) in outcomes {
        let again = reported.iter().any(|(n, o)| n == node && o == outcome);
        let node = if node.is_empty() {
            "redis"
        } else {
            node.as_str()
        };
        match outcome {
            Outcome::Current => {}
            Outcome::Loaded => tracing::info!(
                library = functions::LIBRARY, node, this_build = %mine, "producer functions loaded"
            ),
            Outcome::Replaced(old) => tracing::info!(
                library = functions::LIBRARY, node, this_build = %mine, replaced = %old,
                "producer functions: replaced an older revision (a daemon of an older build \
                 started, or this is the first start of this build)"
            ),
            Outcome::Newer(newer) if !again => tracing::info!(
                library = functions::LIBRARY, node, this_build = %mine, loaded = %newer,
                "producer functions: a newer revision is loaded and left as it is (it serves \
                 this build's producers too)"
            ),
            Outcome::OtherBody(other) if !again => tracing::error!(
                library = functions::LIBRARY, node, this_build = %mine, loaded = %other,
                "producer functions: the loaded library has this build's revision with another \
                 body, so one of the two builds is wrong; left as it is: run one build of zdelay \
                 per revision"
            ),
            Outcome::Newer(_) | Outcome::OtherBody(_) => {}
        }
    }
    *reported = outcomes.to_vec();
}
