//! The HTTP enqueue, for producers that use neither a client library nor Redis: `POST
//! /api/jobs` (one job as JSON, or JSON lines: one result per line, as `zdelay enqueue
//! --batch`), `DELETE /api/jobs/{id}` and `POST /api/jobs/{id}/reschedule`, each through the
//! console's `Client`, behind `admin.producer_token` ([`Access::Produce`]).
//!
//! [`admit`] stands before every producer route: the token is checked from the headers
//! before any byte of the body is read, at most `admin.enqueue_concurrency` requests are
//! served at once (503 beyond), and a body not sent within `admin.enqueue_body_timeout` is
//! answered 408 and its connection closed. So a caller without the token holds no memory,
//! and one with it holds a bounded share for a bounded time.

use super::api::{ApiError, ApiState};
use super::guard::{Access, Policy};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Extension, Json, Router};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use zdelay_core::config::AdminConfig;
use zdelay_core::{Cancelled, ClientError, Due, Enqueued, NewJob, OnConflict};

/// The largest request body: a batch of JSON lines up to this size.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// What the producer routes need beyond the console's state.
struct Gate {
    policy: Arc<Policy>,
    /// One permit per request being served (`admin.enqueue_concurrency`).
    in_flight: Arc<Semaphore>,
    concurrency: usize,
    body_timeout: Duration,
    /// The `unique_for` given to jobs enqueued under an `Idempotency-Key`.
    idempotency_window: Duration,
}

/// The producers' routes under `prefix`, merged beside the console's API (`DELETE
/// /api/jobs/{id}` shares its path with the console's `GET`).
pub fn routes(prefix: &str, admin: &AdminConfig, policy: Arc<Policy>) -> Router<ApiState> {
    let gate = Arc::new(Gate {
        policy,
        in_flight: Arc::new(Semaphore::new(admin.enqueue_concurrency)),
        concurrency: admin.enqueue_concurrency,
        body_timeout: admin.enqueue_body_timeout,
        idempotency_window: admin.idempotency_window,
    });
    let at = |path: &str| format!("{prefix}/api{path}");
    Router::new()
        .route(&at("/jobs"), post(enqueue))
        .route(&at("/jobs/{id}"), delete(cancel))
        .route(&at("/jobs/{id}/reschedule"), post(reschedule))
        .route_layer(axum::middleware::from_fn_with_state(gate.clone(), admit))
        .layer(Extension(gate))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// The token (from the headers alone), a permit, then the whole body within the time
/// limit; only then the route.
async fn admit(State(gate): State<Arc<Gate>>, request: Request, next: Next) -> Response {
    if let Err(refused) = gate.policy.check(request.headers(), Access::Produce) {
        tracing::info!(why = %refused, "HTTP enqueue refused");
        return unread(ApiError::forbidden(refused));
    }
    // Refused rather than queued: a queue would hold the waiting requests' connections
    // (and their unread bodies) all the same, and a producer retries anyway.
    let Ok(_permit) = gate.in_flight.clone().try_acquire_owned() else {
        let why = format!(
            "{} HTTP enqueue requests are being served (admin.enqueue_concurrency): retry",
            gate.concurrency
        );
        let mut answer = unread(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why));
        answer
            .headers_mut()
            .insert(RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        return answer;
    };
    let (parts, body) = request.into_parts();
    let announced = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return unread(too_large());
    }
    let body = match tokio::time::timeout(gate.body_timeout, read_body(body)).await {
        Ok(Ok(body)) => body,
        Ok(Err(e)) => return unread(e),
        Err(_) => {
            let why = format!(
                "the body was not sent within {} (admin.enqueue_body_timeout)",
                humantime::format_duration(gate.body_timeout)
            );
            return unread(ApiError::new(StatusCode::REQUEST_TIMEOUT, why));
        }
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// An answer given before the body was read whole: the rest of it may still come, so the
/// connection cannot serve another request and is closed (rather than read to its end).
fn unread(refused: ApiError) -> Response {
    let mut answer = refused.into_response();
    answer
        .headers_mut()
        .insert(CONNECTION, axum::http::HeaderValue::from_static("close"));
    answer
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the body is over {} MiB", MAX_BODY_BYTES >> 20),
    )
}

/// The whole body, at most [`MAX_BODY_BYTES`] (a body sent without a length is cut off there
/// too).
async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    let mut chunks = body.into_data_stream();
    let mut whole = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| bad(format!("the body could not be read: {e}")))?;
        if whole.len() + chunk.len() > MAX_BODY_BYTES {
            return Err(too_large());
        }
        whole.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(whole))
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

fn bad(why: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, why)
}

/// A client error as the producer sees it: its own mistakes are 400, an existing id 409.
fn refused(e: ClientError) -> ApiError {
    match e {
        // On layout 2, this daemon's config and the route's registration (another daemon's
        // config) disagree: nothing was written.
        ClientError::Exists(_) | ClientError::RouteDiffers { .. } => {
            ApiError::new(StatusCode::CONFLICT, e.to_string())
        }
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

/// What a request's outcome answers: 201 for a job made, 200 otherwise.
fn outcome_status(o: Enqueued) -> StatusCode {
    if o == Enqueued::Added {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    }
}

async fn enqueue(
    State(s): State<ApiState>,
    Extension(gate): Extension<Arc<Gate>>,
    headers: HeaderMap,
    Query(q): Query<Target>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().map_err(|_| bad("Idempotency-Key is not text")))
        .transpose()?
        .map(|k| Idempotency {
            key: k.to_owned(),
            window: gate.idempotency_window,
        });
    if key.as_ref().is_some_and(|k| k.key.is_empty()) {
        return Err(bad("Idempotency-Key is empty"));
    }
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
        return batch(client, text, policy, key.as_ref()).await;
    }
    let mut job = NewJob::from_json_line(text).map_err(bad)?;
    if let Some(k) = &key {
        match &job.id {
            None => job.id = Some(k.key.clone()),
            Some(id) if *id != k.key => {
                return Err(bad(
                    "Idempotency-Key and the job's id differ: give one of them",
                ));
            }
            Some(_) => {}
        }
        k.remember(&mut job);
    }
    let sent = key.is_some().then(|| Sent::of(&job));
    let (id, done) = client.enqueue(job, policy).await.map_err(refused)?;
    if let Some(sent) = sent
        && done == Enqueued::Kept
        && sent.differs_from(client, &id).await?
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "Idempotency-Key {id:?} was used for another job (its destination, payload \
                 or headers differ): use a new key for a new job"
            ),
        ));
    }
    Ok((
        outcome_status(done),
        Json(json!({ "id": id, "outcome": outcome(done) })),
    )
        .into_response())
}

/// A request's `Idempotency-Key` and how long its jobs are remembered after delivery.
struct Idempotency {
    key: String,
    window: Duration,
}

impl Idempotency {
    /// The job is remembered for the window once delivered or dead (the `unique_for`
    /// mechanism), unless it asks for its own window.
    fn remember(&self, job: &mut NewJob) {
        job.unique_for.get_or_insert(self.window);
    }

    /// The id of a batch's line `line` that names none: the same on every retry of the
    /// batch under the same key.
    fn line_id(&self, line: usize) -> String {
        format!("{}:{line}", self.key)
    }
}

/// What a keyed request asked for, to tell a retry from another job under the same key.
struct Sent {
    dest: String,
    payload: Vec<u8>,
    headers: std::collections::BTreeMap<String, String>,
}

impl Sent {
    fn of(job: &NewJob) -> Self {
        Sent {
            dest: job.dest.clone(),
            payload: job.payload.clone(),
            headers: job.headers.clone(),
        }
    }

    /// Whether the waiting job `id` is another than this request's. The due time is not
    /// compared (`"in"` moves with every retry); a job no longer stored cannot be compared.
    async fn differs_from(&self, client: &zdelay_core::Client, id: &str) -> Result<bool, ApiError> {
        let Some(view) = client.get_at(Some(&self.dest), id, None).await? else {
            return Ok(false);
        };
        Ok(view.envelope.is_ok_and(|stored| {
            stored.dest != self.dest
                || stored.payload != self.payload
                || stored.meta.headers != self.headers
        }))
    }
}

/// JSON lines: every line parsed, the good ones enqueued in one batch, one result per line
/// (`line`, `id`, `status`, and `outcome` or `error`). Under an Idempotency-Key a line
/// without an id gets `<key>:<line>`, and every line its window.
async fn batch(
    client: &zdelay_core::Client,
    text: &str,
    policy: OnConflict,
    key: Option<&Idempotency>,
) -> Result<Response, ApiError> {
    let mut results: Vec<serde_json::Value> = Vec::new();
    let (mut jobs, mut lines) = (Vec::new(), Vec::new());
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let number = n + 1;
        match NewJob::from_json_line(line) {
            Ok(mut job) => {
                if let Some(k) = key {
                    job.id.get_or_insert_with(|| k.line_id(number));
                    k.remember(&mut job);
                }
                jobs.push(job);
                lines.push(number);
            }
            Err(why) => results.push(line_failed(
                number,
                key.map(|k| k.line_id(number)),
                bad(why),
            )),
        }
    }
    if jobs.is_empty() && results.is_empty() {
        return Err(bad("the body holds no job"));
    }
    let ids: Vec<Option<String>> = jobs.iter().map(|j| j.id.clone()).collect();
    let done = client.enqueue_batch(jobs, policy).await?;
    for ((line, id), r) in lines.into_iter().zip(ids).zip(done) {
        results.push(match r {
            Ok((id, done)) => json!({
                "line": line,
                "id": id,
                "status": outcome_status(done).as_u16(),
                "outcome": outcome(done),
            }),
            Err(e) => line_failed(line, id, refused(e)),
        });
    }
    results.sort_by_key(|r| r["line"].as_u64());
    let failed = results.iter().filter(|r| r.get("error").is_some()).count();
    let body = json!({ "enqueued": results.len() - failed, "failed": failed, "results": results });
    Ok((StatusCode::OK, Json(body)).into_response())
}

/// A batch line refused: its number, its id when known, and the status and error it would
/// have had alone.
fn line_failed(line: usize, id: Option<String>, e: ApiError) -> serde_json::Value {
    json!({ "line": line, "id": id, "status": e.status().as_u16(), "error": e.message() })
}

async fn cancel(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<Target>,
) -> Result<Json<serde_json::Value>, ApiError> {
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
    at: Option<zdelay_core::job::TimeArg>,
    #[serde(default, rename = "in", with = "humantime_serde")]
    delay: Option<Duration>,
}

async fn reschedule(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<Target>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
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
