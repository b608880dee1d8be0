//! Route lanes whose route no running daemon has any more (removed or renamed in every
//! daemon's config): their jobs go to dead as they fall due, as layout 1 sent a removed
//! route's jobs to dead. A lane is polled only by the daemons whose config has its route, so
//! the others sweep it, once no daemon has had the route for [`grace`]: every daemon records
//! its local routes in `{ns}:routes_seen` at each stats sample. A lane no daemon has had yet
//! (a producer registered it before any daemon with the route started) has no entry there:
//! its jobs wait for that daemon.

use crate::metrics::JOBS_DEAD;
use crate::poller::ENVELOPE_SOURCE;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;
use zdelay_core::config::Config;
use zdelay_core::keys::Keys;
use zdelay_core::routes::Routes;
use zdelay_core::store::{self, Conn, lanes, scripts};

/// The shortest time a route must have been in no running daemon's config before its due
/// jobs go to dead: long enough for every daemon to record its routes a few times, so a
/// daemon started with a config that lacks the route (a rolling update, a canary) sends
/// nothing to dead while another daemon still has it.
pub const GRACE: Duration = Duration::from_secs(60);

/// Jobs sent to dead per script call.
const BATCH: usize = 500;

/// How long the route must have been gone, for a daemon sampling every `stats_interval`.
pub fn grace(stats_interval: Duration) -> Duration {
    // Tests shorten it (`ZDELAY_FAILPOINT=routes_gone_grace_ms=<ms>`, test builds only).
    if let Some(ms) =
        zdelay_core::failpoint::value("routes_gone_grace_ms").and_then(|v| v.parse::<u64>().ok())
    {
        return Duration::from_millis(ms);
    }
    GRACE.max(stats_interval * 3)
}

/// Records this daemon's local routes as seen now, then sends the due jobs of every lane
/// whose route has not been seen for [`grace`] to dead. Returns how many went.
pub async fn step(con: &mut Conn, config: &Config, keys: &Keys) -> anyhow::Result<u64> {
    // Only a layout-2 namespace has lanes (its registry exists once a daemon registered).
    let registered: bool = redis::cmd("EXISTS")
        .arg(keys.lanes())
        .query_async(con)
        .await?;
    if !registered {
        return Ok(0);
    }
    let now_ms = store::server_time_ms(con).await?;
    let routes = Routes::from_config(config);
    let mine: BTreeSet<&str> = routes
        .lane_routes()
        .map(|l| l.local.iter().map(|r| r.name.as_str()).collect())
        .unwrap_or_default();
    if !mine.is_empty() {
        let mut seen = redis::cmd("HSET");
        seen.arg(keys.routes_seen());
        for route in &mine {
            seen.arg(*route).arg(now_ms);
        }
        seen.query_async::<()>(con).await?;
    }
    let seen: HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(keys.routes_seen())
        .query_async(con)
        .await?;
    let gone_ms = grace(config.poller.stats_interval).as_millis() as i64;
    let stale: Vec<&String> = seen
        .iter()
        .filter(|(route, at)| !mine.contains(route.as_str()) && now_ms - **at >= gone_ms)
        .map(|(route, _)| route)
        .collect();
    if stale.is_empty() {
        return Ok(0);
    }
    let registry = lanes::read_registry(con, keys).await?;
    let mut total = 0;
    for route in stale {
        let Some(lane) = registry.by_route.get(route) else {
            continue;
        };
        let reason = format!("route gone: route {route} is in no running daemon's config");
        let mut dead = 0;
        loop {
            match scripts::route_gone_lane(con, lane, BATCH, None, &reason).await {
                Ok((n, more)) => {
                    dead += n;
                    if !more {
                        break;
                    }
                }
                // Registered again meanwhile (a daemon with the route started): leave it.
                Err(e) if lanes::is_lane_refusal(&e) => break,
                Err(e) => return Err(e.into()),
            }
        }
        if dead > 0 {
            ::metrics::counter!(JOBS_DEAD, "source" => ENVELOPE_SOURCE, "reason" => "route_gone")
                .increment(dead);
            tracing::warn!(
                route = %route,
                jobs = dead,
                "jobs of a route no running daemon has sent to dead"
            );
            total += dead;
        }
    }
    Ok(total)
}
