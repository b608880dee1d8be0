//! The HTTP enqueue, for producers that use neither a client library nor Redis: `POST
//! /api/jobs` (one job as JSON, or JSON lines: one result per line, as `zdelay enqueue
//! --batch`), `DELETE /api/jobs/{id}` and `POST /api/jobs/{id}/reschedule`, each through the
//! console's `Client`, behind `admin.producer_token` ([`Access::Produce`]).

use super::api::{ApiError, ApiState};
use super::guard::Access;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header::CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use std::time::Duration;
use zdelay_client::{Cancelled, ClientError, Due, Enqueued, NewJob, OnConflict};

/// The largest request body: a batch of JSON lines up to this size.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// The producers' routes under `prefix`, merged beside the console's API (`DELETE
/// /api/jobs/{id}` shares its path with the console's `GET`).
pub fn routes(prefix: &str) -> Router<ApiState> {
    let at = |path: &str| format!("{prefix}/api{path}");
    Router::new()
        .route(&at("/jobs"), post(enqueue))
        .route(&at("/jobs/{id}"), delete(cancel))
        .route(&at("/jobs/{id}/reschedule"), post(reschedule))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

#[derive(Deserialize)]
struct Target {
    /// Layout 2: the route of an id of the caller's own.
    dest: Option<String>,
    on_conflict: Option<String>,
    /// With `on_conflict=debounce`: how far a waiting job may be pushed from its first
    /// enqueue (`"1m"`).
    max_wait: Option<String>,
}

fn produce(s: &ApiState, headers: &HeaderMap) -> Result<(), ApiError> {
    s.policy.check(headers, Access::Produce).map_err(|refused| {
        tracing::info!(why = %refused, "HTTP enqueue refused");
        ApiError::forbidden(refused)
    })
}

fn bad(why: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, why)
}

/// A client error as the producer sees it: its own mistakes are 400, an existing id 409.
fn refused(e: ClientError) -> ApiError {
    match e {
        ClientError::Exists(_) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
        ClientError::UnknownDestination { .. }
        | ClientError::Oversize { .. }
        | ClientError::BadId(_)
        | ClientError::ReservedId(_)
        | ClientError::Envelope(_)
        | ClientError::SecondsLikeDue(_)
        | ClientError::AmbiguousId { .. }
        | ClientError::Id(_) => bad(e.to_string()),
        other => other.into(),
    }
}

fn outcome(o: Enqueued) -> &'static str {
    match o {
        Enqueued::Added => "added",
        Enqueued::Replaced => "replaced",
        Enqueued::Kept => "kept",
        Enqueued::Duplicate => "duplicate",
    }
}

async fn enqueue(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<Target>,
    body: Bytes,
) -> Result<Response, ApiError> {
    produce(&s, &headers)?;
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().map_err(|_| bad("Idempotency-Key is not text")))
        .transpose()?;
    // A request sent again under its Idempotency-Key finds its job and leaves it as it is.
    let max_wait = q
        .max_wait
        .as_deref()
        .map(|t| humantime::parse_duration(t).map_err(|e| bad(format!("max_wait: {e}"))))
        .transpose()?;
    let policy = match (q.on_conflict.as_deref(), max_wait) {
        (Some("debounce"), Some(max_wait)) => OnConflict::Debounce { max_wait },
        (Some("debounce"), None) => return Err(bad("on_conflict=debounce needs max_wait")),
        (_, Some(_)) => return Err(bad("max_wait applies only with on_conflict=debounce")),
        (None, None) if key.is_some() => OnConflict::Keep,
        (None | Some("replace"), None) => OnConflict::Replace,
        (Some("keep"), None) => OnConflict::Keep,
        (Some("error"), None) => OnConflict::Error,
        (Some(other), None) => {
            return Err(bad(format!(
                "on_conflict: {other:?} is not replace, keep, error or debounce"
            )));
        }
    };
    let text = std::str::from_utf8(&body).map_err(|_| bad("the body is not UTF-8 JSON"))?;
    let kind = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let client = &s.console()?.client;
    if matches!(kind.as_str(), "application/x-ndjson" | "application/jsonl") {
        if key.is_some() {
            return Err(bad(
                "Idempotency-Key names one job: give each line its own id instead",
            ));
        }
        return batch(client, text, policy).await;
    }
    let mut job = NewJob::from_json_line(text).map_err(bad)?;
    match (&job.id, key) {
        (None, Some(key)) => job.id = Some(key.to_owned()),
        (Some(id), Some(key)) if id != key => {
            return Err(bad(
                "Idempotency-Key and the job's id differ: give one of them",
            ));
        }
        _ => {}
    }
    let (id, done) = client.enqueue(job, policy).await.map_err(refused)?;
    let status = if done == Enqueued::Added {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(json!({ "id": id, "outcome": outcome(done) }))).into_response())
}

/// JSON lines: every line parsed, the good ones enqueued in one batch, one result per line.
async fn batch(
    client: &zdelay_client::Client,
    text: &str,
    policy: OnConflict,
) -> Result<Response, ApiError> {
    let mut results: Vec<serde_json::Value> = Vec::new();
    let (mut jobs, mut lines) = (Vec::new(), Vec::new());
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        match NewJob::from_json_line(line) {
            Ok(job) => {
                jobs.push(job);
                lines.push(n + 1);
            }
            Err(why) => results.push(json!({ "line": n + 1, "error": why })),
        }
    }
    if jobs.is_empty() && results.is_empty() {
        return Err(bad("the body holds no job"));
    }
    for (line, r) in lines.iter().zip(client.enqueue_batch(jobs, policy).await?) {
        results.push(match r {
            Ok((id, done)) => json!({ "line": line, "id": id, "outcome": outcome(done) }),
            Err(e) => json!({ "line": line, "error": e.to_string() }),
        });
    }
    results.sort_by_key(|r| r["line"].as_u64());
    let failed = results.iter().filter(|r| r.get("error").is_some()).count();
    let body = json!({ "enqueued": results.len() - failed, "failed": failed, "results": results });
    Ok((StatusCode::OK, Json(body)).into_response())
}

async fn cancel(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<Target>,
) -> Result<Json<serde_json::Value>, ApiError> {
    produce(&s, &headers)?;
    match s
        .console()?
        .client
        .cancel_at(q.dest.as_deref(), &id)
        .await
        .map_err(refused)?
    {
        Cancelled::Cancelled => Ok(Json(json!({ "id": id, "cancelled": true }))),
        Cancelled::InFlight => Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("{id} is being delivered; not cancelled"),
        )),
        Cancelled::NotPending => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("{id} is not pending (delivered, dead or unknown)"),
        )),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct When {
    at: Option<zdelay_client::job::TimeArg>,
    #[serde(default, rename = "in", with = "humantime_serde")]
    delay: Option<Duration>,
}

async fn reschedule(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<Target>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    produce(&s, &headers)?;
    let when: When = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let due = match (when.at, when.delay) {
        (Some(at), None) => Due::At(at.ms("at").map_err(bad)?),
        (None, Some(d)) => Due::In(d),
        _ => {
            return Err(bad(
                "give \"at\" (epoch ms or RFC 3339) or \"in\" (a duration), one of them",
            ));
        }
    };
    match s
        .console()?
        .client
        .reschedule_at(q.dest.as_deref(), &id, due)
        .await
        .map_err(refused)?
    {
        Some(due_ms) => Ok(Json(json!({ "id": id, "due_ms": due_ms }))),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("{id} is not pending (delivered, dead, in flight or unknown)"),
        )),
    }
}
