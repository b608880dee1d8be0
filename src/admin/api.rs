//! The console's JSON API under `<ui_prefix>/api/…`, used by the page and by scripts alike.
//! Reads go through the same library calls as the CLI (`stats::report`, `stats::forecast`,
//! `Client::get`, `dead_list`, `schedule_list`), so page, API and CLI agree. Each read is
//! bounded: counts by score range (ZCOUNT), lists by rank range with a limit, one job by id.
//! Actions (`POST`) pass `guard::check` first and are logged.

use super::guard;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use zdelay_client::config::{Config, Secret};
use zdelay_client::envelope::Envelope;
use zdelay_client::{Cancelled, Client, ClientError};

/// Characters of a payload shown by `GET /api/jobs/{id}`.
pub const PREVIEW_CHARS: usize = 2048;
/// Dead jobs listed per shard at most (`limit`).
pub const MAX_DEAD_LIMIT: usize = 500;
/// Schedules listed at most (`limit`).
pub const MAX_SCHEDULES: usize = 1000;

/// What the API reads and acts through, set once the daemon reached Redis.
pub struct Console {
    pub client: Client,
    pub config: Config,
}

#[derive(Clone)]
pub struct ApiState {
    pub console: Arc<OnceLock<Console>>,
    pub token: Option<Secret>,
}

impl ApiState {
    fn console(&self) -> Result<&Console, ApiError> {
        self.console.get().ok_or_else(|| {
            ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "not connected to Redis yet".into(),
            )
        })
    }

    /// Refuses an action the guard refuses (403, logged), and logs the ones let through.
    fn authorize(&self, headers: &HeaderMap, action: &str, id: &str) -> Result<(), ApiError> {
        match guard::check(headers, self.token.as_ref()) {
            Ok(()) => {
                tracing::info!(action, id, "console action");
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(action, id, why = %refused, "console action refused");
                Err(ApiError(StatusCode::FORBIDDEN, refused.to_string()))
            }
        }
    }
}

/// An error answer: `{"error": "…"}` with its status.
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> Self {
        let status = if e.is_retryable() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        ApiError(status, e.to_string())
    }
}

impl From<redis::RedisError> for ApiError {
    fn from(e: redis::RedisError) -> Self {
        ClientError::from(e).into()
    }
}

impl From<redis::ParsingError> for ApiError {
    fn from(e: redis::ParsingError) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

fn bad_request(why: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, why.into())
}

fn not_found(why: impl Into<String>) -> ApiError {
    ApiError(StatusCode::NOT_FOUND, why.into())
}

type Answer = Result<Json<Value>, ApiError>;

/// The API's routes under `prefix` (empty or `/something`).
pub fn routes(prefix: &str) -> Router<ApiState> {
    let at = |path: &str| format!("{prefix}/api{path}");
    Router::new()
        .route(&at("/stats"), get(stats))
        .route(&at("/forecast"), get(forecast))
        .route(&at("/dead"), get(dead))
        .route(&at("/jobs/{id}"), get(job))
        .route(&at("/schedules"), get(schedules))
        .route(&at("/auth"), post(auth))
        .route(&at("/dead/{id}/replay"), post(dead_replay))
        .route(&at("/dead/{id}/purge"), post(dead_purge))
        .route(&at("/jobs/{id}/cancel"), post(job_cancel))
        .route(&at("/schedules/{id}/pause"), post(schedule_pause))
        .route(&at("/schedules/{id}/resume"), post(schedule_resume))
        .route(&at("/schedules/{id}/run"), post(schedule_run))
}

async fn stats(State(s): State<ApiState>) -> Answer {
    let c = s.console()?;
    let mut v = crate::stats::report(&mut c.client.connection(), &c.config).await?;
    v["actions_enabled"] = s.token.is_some().into();
    Ok(Json(v))
}

#[derive(Deserialize)]
struct ForecastQuery {
    next: Option<String>,
    step: Option<String>,
}

async fn forecast(State(s): State<ApiState>, Query(q): Query<ForecastQuery>) -> Answer {
    let c = s.console()?;
    let parse = |name: &str, value: Option<&str>, default: &str| {
        humantime::parse_duration(value.unwrap_or(default))
            .map_err(|e| bad_request(format!("{name}: {e}")))
    };
    let next = parse("next", q.next.as_deref(), "10m")?;
    let step = parse("step", q.step.as_deref(), "1m")?;
    let horizon = crate::stats::Horizon::new(next, step).map_err(bad_request)?;
    let f = crate::stats::forecast(&mut c.client.connection(), &c.config, horizon).await?;
    Ok(Json(serde_json::to_value(f).map_err(anyhow::Error::from)?))
}

#[derive(Deserialize)]
struct DeadQuery {
    /// The job's destination, exactly (a route, or `<sink>/<target>`).
    route: Option<String>,
    /// A part of the reason.
    reason: Option<String>,
    /// Dead for at least this long (`10m`).
    min_age: Option<String>,
    limit: Option<usize>,
}

/// Dead jobs: the oldest `limit` of each shard (a rank range per shard), their destination
/// read from their envelopes (one HMGET per shard), then filtered.
async fn dead(State(s): State<ApiState>, Query(q): Query<DeadQuery>) -> Answer {
    let c = s.console()?;
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_DEAD_LIMIT);
    let min_age = q
        .min_age
        .as_deref()
        .filter(|a| !a.is_empty())
        .map(humantime::parse_duration)
        .transpose()
        .map_err(|e| bad_request(format!("min_age: {e}")))?
        .unwrap_or(Duration::ZERO);
    let mut con = c.client.connection();
    let now_ms = zdelay_client::store::server_time_ms(&mut con).await?;
    let listed = c.client.dead_list(limit).await?;
    let keys = c.client.keys();
    let mut by_shard: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
    for (i, job) in listed.iter().enumerate() {
        by_shard.entry(job.shard).or_default().push(i);
    }
    let mut dests: Vec<Option<String>> = vec![None; listed.len()];
    let mut totals = 0u64;
    let mut pipes = Vec::new();
    for shard in 0..keys.shards() {
        let mut pipe = redis::pipe();
        pipe.zcard(keys.dead(shard));
        if let Some(indexes) = by_shard.get(&shard) {
            let ids: Vec<&str> = indexes.iter().map(|&i| listed[i].id.as_str()).collect();
            pipe.cmd("HMGET").arg(keys.jobs(shard)).arg(ids);
        }
        pipes.push((shard, pipe));
    }
    let replies = futures::future::join_all(pipes.iter().map(|(shard, pipe)| {
        let mut con = con.clone();
        async move {
            (
                *shard,
                pipe.query_async::<Vec<redis::Value>>(&mut con).await,
            )
        }
    }))
    .await;
    for (shard, reply) in replies {
        // ZCARD, then the HMGET when the shard had jobs listed.
        let mut values = reply?.into_iter();
        totals += redis::from_redis_value::<u64>(values.next().unwrap_or_default())?;
        if let (Some(indexes), Some(envelopes)) = (by_shard.get(&shard), values.next()) {
            let envelopes: Vec<Option<Vec<u8>>> = redis::from_redis_value(envelopes)?;
            for (&i, raw) in indexes.iter().zip(envelopes) {
                dests[i] = raw.and_then(|r| Envelope::decode(&r).ok()).map(|e| e.dest);
            }
        }
    }
    let min_age_ms = min_age.as_millis() as i64;
    let mut jobs: Vec<Value> = listed
        .into_iter()
        .zip(dests)
        .filter(|(job, dest)| {
            q.route
                .as_deref()
                .is_none_or(|r| r.is_empty() || dest.as_deref() == Some(r))
                && q.reason
                    .as_deref()
                    .is_none_or(|r| job.reason.to_lowercase().contains(&r.to_lowercase()))
                && now_ms - job.died_ms >= min_age_ms
        })
        .map(|(job, dest)| {
            json!({
                "id": job.id,
                "shard": job.shard,
                "died_ms": job.died_ms,
                "reason": job.reason,
                "dest": dest,
            })
        })
        .collect();
    jobs.sort_by_key(|j| j["died_ms"].as_i64());
    Ok(Json(json!({
        "now_ms": now_ms,
        "total": totals,
        "limit_per_shard": limit,
        "jobs": jobs,
    })))
}

async fn job(State(s): State<ApiState>, Path(id): Path<String>) -> Answer {
    let c = s.console()?;
    let Some(view) = c.client.get(&id).await? else {
        return Err(not_found(format!(
            "no job {id} is stored: delivered, cancelled, purged, or never enqueued"
        )));
    };
    let mut v = view.to_json();
    v["payload_bytes"] = view
        .envelope
        .as_ref()
        .map_or(view.raw.len(), |e| e.payload.len())
        .into();
    if let Some(Value::String(payload)) = v.get_mut("payload")
        && payload.chars().count() > PREVIEW_CHARS
    {
        *payload = payload.chars().take(PREVIEW_CHARS).collect();
        v["payload_truncated"] = true.into();
    }
    Ok(Json(v))
}

#[derive(Deserialize)]
struct SchedulesQuery {
    limit: Option<usize>,
}

async fn schedules(State(s): State<ApiState>, Query(q): Query<SchedulesQuery>) -> Answer {
    let c = s.console()?;
    let limit = q.limit.unwrap_or(200).clamp(1, MAX_SCHEDULES);
    let mut con = c.client.connection();
    let now_ms = zdelay_client::store::server_time_ms(&mut con).await?;
    let mut list = c.client.schedule_list().await?;
    list.sort_by(|a, b| a.id.cmp(&b.id));
    let total = list.len();
    let schedules: Vec<Value> = list
        .into_iter()
        .take(limit)
        .map(|view| {
            let mut v = view.to_json();
            // The grid's latest occurrence before the pending one (or before now).
            let previous = view.def.compile().ok().and_then(|schedule| {
                schedule.previous_before(view.next_ms.unwrap_or(now_ms).min(now_ms + 1))
            });
            v["previous_ms"] = previous.into();
            v.as_object_mut().map(|o| o.remove("payload"));
            v
        })
        .collect();
    Ok(Json(json!({
        "now_ms": now_ms,
        "total": total,
        "schedules": schedules,
    })))
}

/// Lets the page check a token before it keeps it: 200 when it would be accepted.
async fn auth(State(s): State<ApiState>, headers: HeaderMap) -> Answer {
    s.authorize(&headers, "auth", "")?;
    Ok(Json(json!({ "ok": true })))
}

async fn dead_replay(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "dead replay", &id)?;
    let r = s
        .console()?
        .client
        .dead_replay(std::slice::from_ref(&id))
        .await?;
    if r.replayed == 0 && r.orphans == 0 {
        return Err(not_found(format!("{id} is not dead")));
    }
    Ok(Json(
        json!({ "ok": true, "replayed": r.replayed, "orphans": r.orphans }),
    ))
}

async fn dead_purge(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "dead purge", &id)?;
    let purged = s
        .console()?
        .client
        .dead_purge(std::slice::from_ref(&id))
        .await?;
    if purged == 0 {
        return Err(not_found(format!("{id} is not dead")));
    }
    Ok(Json(json!({ "ok": true, "purged": purged })))
}

async fn job_cancel(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "cancel", &id)?;
    match s.console()?.client.cancel(&id).await? {
        Cancelled::Cancelled => Ok(Json(json!({ "ok": true, "cancelled": id }))),
        Cancelled::InFlight => Err(ApiError(
            StatusCode::CONFLICT,
            format!("{id} is being delivered; not cancelled"),
        )),
        Cancelled::NotPending => Err(not_found(format!(
            "{id} is not pending (delivered, dead or unknown)"
        ))),
    }
}

async fn schedule_pause(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "schedule pause", &id)?;
    if !s.console()?.client.schedule_pause(&id).await? {
        return Err(not_found(format!("no schedule {id}")));
    }
    Ok(Json(json!({ "ok": true, "paused": id })))
}

async fn schedule_resume(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "schedule resume", &id)?;
    let Some(next) = s.console()?.client.schedule_resume(&id).await? else {
        return Err(not_found(format!("no schedule {id}")));
    };
    Ok(Json(json!({ "ok": true, "resumed": id, "next_ms": next })))
}

async fn schedule_run(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    s.authorize(&headers, "schedule run", &id)?;
    let Some(job) = s.console()?.client.schedule_run_now(&id).await? else {
        return Err(not_found(format!("no schedule {id}")));
    };
    Ok(Json(json!({ "ok": true, "job": job })))
}
