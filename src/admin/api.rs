//! The console's JSON API under `<ui_prefix>/api/…`, used by the page and by scripts alike.
//! Reads go through the same library calls as the CLI (`stats::report`, `stats::forecast`,
//! `Client::get_preview`, the dead-letter listing and show with `DeadFilter`, the schedules
//! in firing order), so page, API and CLI agree. Each read is bounded per request and per
//! Redis call: counts by score range (ZCOUNT), lists by score range with LIMIT (and a scan
//! bound where a filter reads content), one job by id, payloads cut inside Redis, bulk
//! actions at most [`MAX_BULK`] per request.
//! Every handler asks `guard::Policy::check` for the access it needs first (counts are
//! public reads, payloads and dead letters payload reads); actions (`POST`) are logged.

use super::guard::{Access, Policy, Refused};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use zdelay_core::config::{Config, SourceConfig};
use zdelay_core::dead::{DeadFilter, DeadSelection, ReplayOptions};
use zdelay_core::job::parse_at;
use zdelay_core::schedules::{IdleCursor, ScheduleView, UpcomingCursor};
use zdelay_core::store::StoreError;
use zdelay_core::{Cancelled, Client, ClientError, Due, Replayed};

/// Bytes of a payload shown by `GET /api/jobs/{id}` and `GET /api/dead/{id}` (cut inside
/// Redis: no more is read).
pub const PREVIEW_BYTES: usize = zdelay_core::dead::PREVIEW_BYTES;
/// Dead jobs (and members per raw source) listed at most (`limit`).
pub const MAX_DEAD_LIMIT: usize = 500;
/// Dead jobs (or raw members) one `POST /api/dead` replays or purges at most (`limit`):
/// a bulk request does a bounded amount of work; `complete: false` asks for another.
pub const MAX_BULK: usize = 10_000;
/// Dead entries read per shard (and per raw source) at most by one `GET /api/dead`.
pub const DEAD_SCAN: usize = 10_000;
/// Schedules listed at most (`limit`).
pub const MAX_SCHEDULES: usize = 1000;
/// Schedule definitions read per `GET /api/schedules` looking for paused and ended ones.
pub const IDLE_SCAN: usize = 2000;

/// What the API reads and acts through, set once the daemon reached Redis.
pub struct Console {
    pub client: Client,
    pub config: Config,
}

#[derive(Clone)]
pub struct ApiState {
    pub console: Arc<OnceLock<Console>>,
    pub policy: Arc<Policy>,
}

impl ApiState {
    pub(super) fn console(&self) -> Result<&Console, ApiError> {
        self.console.get().ok_or_else(|| {
            ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "not connected to Redis yet".into(),
            )
        })
    }

    /// Refuses an action the guard refuses (403, logged), and logs the ones let through.
    fn authorize(&self, headers: &HeaderMap, action: &str, id: &str) -> Result<(), ApiError> {
        match self.policy.check(headers, Access::Action) {
            Ok(()) => {
                tracing::info!(action, id, "console action");
                Ok(())
            }
            Err(refused) => {
                tracing::warn!(action, id, why = %refused, "console action refused");
                Err(ApiError::forbidden(refused))
            }
        }
    }

    /// Refuses a read the guard refuses (403).
    fn may_read(&self, headers: &HeaderMap, access: Access) -> Result<(), ApiError> {
        self.policy.check(headers, access).map_err(|refused| {
            tracing::info!(why = %refused, "console read refused");
            ApiError::forbidden(refused)
        })
    }
}

/// An error answer: `{"error": "…"}` with its status.
pub struct ApiError(StatusCode, String);

impl ApiError {
    pub fn new(status: StatusCode, why: impl Into<String>) -> Self {
        ApiError(status, why.into())
    }

    pub fn forbidden(refused: Refused) -> Self {
        ApiError(StatusCode::FORBIDDEN, refused.to_string())
    }

    pub fn status(&self) -> StatusCode {
        self.0
    }

    pub fn message(&self) -> &str {
        &self.1
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> Self {
        let status = if matches!(e, ClientError::InvalidSelection(_)) {
            StatusCode::BAD_REQUEST
        } else if matches!(e, ClientError::Store(StoreError::Unsupported(_))) {
            // What this namespace's storage layout does not offer (yet): not a fault.
            StatusCode::NOT_IMPLEMENTED
        } else if e.is_retryable() {
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
        .route(&at("/dead"), get(dead).post(dead_bulk))
        .route(&at("/dead/{id}"), get(dead_show))
        .route(&at("/jobs/{id}"), get(job))
        .route(&at("/schedules"), get(schedules))
        .route(&at("/auth"), post(auth))
        .route(&at("/dead/{id}/replay"), post(dead_replay))
        .route(&at("/dead/{id}/purge"), post(dead_purge))
        .route(&at("/jobs/{id}/cancel"), post(job_cancel))
        .route(&at("/schedules/{id}/pause"), post(schedule_pause))
        .route(&at("/schedules/{id}/resume"), post(schedule_resume))
        .route(&at("/schedules/{id}/run"), post(schedule_run))
        .route(&at("/clock"), get(clock_show))
        .route(&at("/clock/advance"), post(clock_advance))
}

async fn stats(State(s): State<ApiState>, headers: HeaderMap) -> Answer {
    s.may_read(&headers, Access::PublicRead)?;
    let c = s.console()?;
    let mut v = crate::stats::report(&mut c.client.connection(), &c.config).await?;
    v["actions_enabled"] = s.policy.actions_enabled().into();
    v["payload_reads"] = s.policy.payload_reads().into();
    Ok(Json(v))
}

#[derive(Deserialize)]
struct ForecastQuery {
    next: Option<String>,
    step: Option<String>,
}

async fn forecast(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<ForecastQuery>,
) -> Answer {
    s.may_read(&headers, Access::PublicRead)?;
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

/// The dead-letter filters and the raw source, as `GET /api/dead` and `POST /api/dead` take
/// them: the CLI's flags by name (`older_than` for `--older-than`), empty meaning unset.
#[derive(Deserialize, Default)]
struct DeadQuery {
    route: Option<String>,
    reason: Option<String>,
    older_than: Option<String>,
    newer_than: Option<String>,
    schedule: Option<String>,
    /// A configured raw source's key: its dead members only.
    source: Option<String>,
    /// Listing: at most this many jobs, and this many members per raw source.
    limit: Option<usize>,
    /// `POST`: `replay` or `purge`.
    action: Option<String>,
    /// `POST` without a filter: every dead job (or member of `source`), on purpose.
    all: Option<bool>,
    /// `POST action=replay`: due at (RFC 3339 or epoch ms) or in (`10m`); default now.
    at: Option<String>,
    #[serde(rename = "in")]
    delay: Option<String>,
    /// `POST action=replay`: keep attempt counts instead of resetting them.
    keep_attempts: Option<bool>,
}

impl DeadQuery {
    fn filter(&self) -> Result<DeadFilter, ApiError> {
        Ok(DeadFilter::from_text(
            self.route.as_deref(),
            self.reason.as_deref(),
            self.older_than.as_deref(),
            self.newer_than.as_deref(),
            self.schedule.as_deref(),
        )?)
    }

    /// The configured raw source named by `source`, if any.
    fn source<'a>(&self, config: &'a Config) -> Result<Option<&'a SourceConfig>, ApiError> {
        let Some(key) = self.source.as_deref().filter(|k| !k.is_empty()) else {
            return Ok(None);
        };
        config
            .sources
            .iter()
            .find(|s| s.key == key)
            .map(Some)
            .ok_or_else(|| bad_request(format!("source {key:?}: no such raw source configured")))
    }

    /// When a replay makes its jobs due: `at`, `in`, or now.
    fn due(&self) -> Result<Due, ApiError> {
        fn set(v: &Option<String>) -> Option<&str> {
            v.as_deref().map(str::trim).filter(|v| !v.is_empty())
        }
        match (set(&self.at), set(&self.delay)) {
            (Some(_), Some(_)) => Err(bad_request("give at or in, not both")),
            (Some(at), None) => parse_at(at)
                .map(Due::At)
                .map_err(|e| bad_request(format!("at: {e}"))),
            (None, Some(delay)) => humantime::parse_duration(delay)
                .map(Due::In)
                .map_err(|e| bad_request(format!("in: {e}"))),
            (None, None) => Ok(Due::In(Duration::ZERO)),
        }
    }

    fn options(&self) -> Result<ReplayOptions, ApiError> {
        Ok(ReplayOptions {
            due: self.due()?,
            keep_attempts: self.keep_attempts.unwrap_or(false),
        })
    }
}

/// Dead jobs and dead raw members the filters admit, oldest first: each shard's oldest
/// `limit` in the age window (`ZRANGEBYSCORE … LIMIT`), read through `peek_dead`, merged to
/// the oldest `limit`; raw members walked inside Redis (`walk_raw_dead`), each with its first
/// bytes; at most [`DEAD_SCAN`] entries read per shard or source, so a filter on reason,
/// route or schedule that matches little stays bounded (`complete: false` says so). With
/// `source`, that raw source's members only; route and schedule do not apply to them.
async fn dead(State(s): State<ApiState>, headers: HeaderMap, Query(q): Query<DeadQuery>) -> Answer {
    s.may_read(&headers, Access::PayloadRead)?;
    let c = s.console()?;
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_DEAD_LIMIT);
    let filter = q.filter()?;
    let now_ms = c.client.connection().now_ms().await?;
    let only = q.source(&c.config)?;
    let (mut jobs, mut complete) = (Vec::new(), true);
    if only.is_none() {
        let found = c
            .client
            .operator()
            .dead_jobs_bounded(&filter, limit, DEAD_SCAN)
            .await?;
        jobs = found.items;
        jobs.truncate(limit);
        complete &= found.complete;
    }
    let envelope_only = filter.envelope_only();
    let sources: Vec<&SourceConfig> = match only {
        Some(source) => vec![source],
        None if envelope_only.is_empty() => c.config.sources.iter().collect(),
        None => Vec::new(),
    };
    let mut raw = Vec::new();
    for source in sources {
        let found = c
            .client
            .operator()
            .raw_dead_members_bounded(source, &filter, limit, DEAD_SCAN)
            .await?;
        complete &= found.complete;
        raw.extend(found.items.iter().map(|m| m.to_json(&source.key)));
    }
    let total: u64 = c.client.operator().dead_counts().await?.iter().sum();
    Ok(Json(json!({
        "now_ms": now_ms,
        "total": total,
        "limit": limit,
        "complete": complete,
        "scan_limit": DEAD_SCAN,
        "jobs": jobs,
        "raw": raw,
        "raw_not_listed": (only.is_none() && !envelope_only.is_empty() && !c.config.sources.is_empty())
            .then(|| format!("{} applies to envelope jobs only", envelope_only.join(" and "))),
        "sources": c.config.sources.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(),
    })))
}

/// One dead job with its attempts, last error, history of deaths and the first
/// [`PREVIEW_BYTES`] of its payload; with `source`, one dead raw member by its id.
async fn dead_show(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<DeadQuery>,
) -> Answer {
    s.may_read(&headers, Access::PayloadRead)?;
    let c = s.console()?;
    if let Some(source) = q.source(&c.config)? {
        return match c.client.operator().raw_dead_show(source, &id).await? {
            Some(m) => Ok(Json(m.detail_json(&source.key, PREVIEW_BYTES))),
            None => Err(not_found(format!(
                "no dead member of {} has the id {id}",
                source.key
            ))),
        };
    }
    match c.client.operator().dead_show(&id).await? {
        Some(detail) => Ok(Json(detail.to_json(PREVIEW_BYTES))),
        None => Err(not_found(format!("{id} is not dead"))),
    }
}

async fn job(State(s): State<ApiState>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    s.may_read(&headers, Access::PayloadRead)?;
    let c = s.console()?;
    let Some(view) = c.client.get_preview(&id, PREVIEW_BYTES).await? else {
        return Err(not_found(format!(
            "no job {id} is stored: delivered, cancelled, purged, or never enqueued"
        )));
    };
    let mut v = view.to_json();
    v["payload_bytes"] = view.payload_size.into();
    if let Some(Value::String(payload)) = v.get_mut("payload") {
        // The preview, cut at a character or base64: what `payload_preview` shows.
        let start = view.envelope.as_ref().map_or(&[][..], |e| &e.payload);
        let p = zdelay_core::dead::payload_preview(start, PREVIEW_BYTES, view.payload_size);
        *payload = p.text;
        v["payload_encoding"] = p.encoding.into();
        v["payload_truncated"] = p.truncated.into();
    }
    Ok(Json(v))
}

#[derive(Deserialize)]
struct SchedulesQuery {
    /// The next this many to fire.
    limit: Option<usize>,
    /// Where the page of the next to fire starts (`next` of the last answer); from the
    /// soonest when absent.
    after: Option<String>,
    /// Where the scan for paused and ended schedules continues (`idle_next` of the last
    /// answer); from the start when absent.
    idle_from: Option<String>,
}

/// The next `limit` schedules to fire after `after` (a bounded page read by rank per shard or
/// lane, merged; only their definitions read; `next` continues it), and paused or ended ones
/// from a bounded scan of the definitions ([`IDLE_SCAN`] read; `idle_next` continues it).
async fn schedules(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<SchedulesQuery>,
) -> Answer {
    s.may_read(&headers, Access::PublicRead)?;
    let c = s.console()?;
    let limit = q.limit.unwrap_or(200).clamp(1, MAX_SCHEDULES);
    let from = match q.idle_from.as_deref().filter(|f| !f.is_empty()) {
        Some(text) => text
            .parse::<IdleCursor>()
            .map_err(|e| bad_request(format!("idle_from: {e}")))?,
        None => IdleCursor::default(),
    };
    let after = match q.after.as_deref().filter(|a| !a.is_empty()) {
        Some(text) => Some(
            text.parse::<UpcomingCursor>()
                .map_err(|e| bad_request(format!("after: {e}")))?,
        ),
        None => None,
    };
    let mut con = c.client.connection();
    let now_ms = con.now_ms().await?;
    let counts = c.client.operator().schedule_counts().await?;
    let upcoming = c
        .client
        .operator()
        .schedules_upcoming_page(after.as_ref(), limit)
        .await?;
    let next = upcoming.next.map(|n| n.to_string());
    let idle = c.client.operator().schedules_idle(from, IDLE_SCAN).await?;
    // Walking a cron back to its previous occurrence is CPU work, up to thousands per answer:
    // on a blocking thread, one answer's walks at a time, so requests cannot starve the
    // runtime the pollers share. The permit goes with the walks: a caller that hangs up
    // does not free it before they end.
    let walking = SCHEDULE_WALKS
        .acquire()
        .await
        .map_err(anyhow::Error::from)?;
    let (listed, idle_listed) = tokio::task::spawn_blocking(move || {
        let _walking = walking;
        let shown = |views: Vec<ScheduleView>| -> Vec<Value> {
            views
                .into_iter()
                .map(|view| schedule_timing(view, now_ms))
                .collect()
        };
        (shown(upcoming.schedules), shown(idle.schedules))
    })
    .await
    .map_err(anyhow::Error::from)?;
    Ok(Json(json!({
        "now_ms": now_ms,
        "total": counts.schedules,
        "pending": counts.pending,
        "limit": limit,
        "schedules": listed,
        "next": next,
        "idle": idle_listed,
        "idle_next": idle.next.map(|n| n.to_string()),
    })))
}

/// How far ahead, and how many, of a schedule's days its calendar skips the page lists.
const CALENDAR_HORIZON_MS: i64 = 366 * 86_400_000;
const CALENDAR_SKIPS_SHOWN: usize = 5;

/// One answer's cron walks at a time ([`schedules`]).
static SCHEDULE_WALKS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// A schedule as `/api/schedules` shows it: its definition and timing, never its payload
/// or headers (the listing is a public read), plus `previous_ms`: the grid's latest
/// occurrence before the pending one (or before now).
fn schedule_timing(view: ScheduleView, now_ms: i64) -> Value {
    let mut v = view.to_json();
    let previous = view.def.compile().ok().and_then(|schedule| {
        schedule.previous_before(view.next_ms.unwrap_or(now_ms).min(now_ms + 1))
    });
    v["previous_ms"] = previous.into();
    // The calendar in brief (its dates may be thousands), and the coming days it skips.
    if let Some(calendar) = &view.def.calendar {
        v["calendar"] = json!({
            "name": calendar.name,
            "shift": calendar.shift.name(),
            "dates": calendar.days.len(),
        });
        if let Ok(schedule) = view.def.compile() {
            let skips: Vec<Value> = schedule
                .upcoming_skips(now_ms, now_ms + CALENDAR_HORIZON_MS, CALENDAR_SKIPS_SHOWN)
                .into_iter()
                .map(|(ms, skip)| {
                    json!({
                        "ms": ms,
                        "at": schedule.rfc3339(ms),
                        "reason": skip.reason(),
                        "moved_to_ms": skip.moved_to,
                        "moved_to": skip.moved_to.map(|to| schedule.rfc3339(to)),
                    })
                })
                .collect();
            v["calendar_skips"] = skips.into();
        }
    }
    if let Some(o) = v.as_object_mut() {
        for field in ["payload", "payload_encoding", "headers"] {
            o.remove(field);
        }
    }
    v
}

/// Lets the page check a token before it keeps it: 200 when it would be accepted.
async fn auth(State(s): State<ApiState>, headers: HeaderMap) -> Answer {
    s.authorize(&headers, "auth", "")?;
    Ok(Json(json!({ "ok": true })))
}

/// Replays one dead job (`at`/`in`, `keep_attempts`) or, with `source`, one dead member.
async fn dead_replay(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<DeadQuery>,
) -> Answer {
    s.authorize(&headers, "dead replay", &id)?;
    let c = s.console()?;
    let ids = DeadSelection::Ids(vec![id.clone()]);
    let (r, attempts) = match q.source(&c.config)? {
        Some(source) => {
            let r = c
                .client
                .operator()
                .raw_dead_replay_selected(source, &ids, q.due()?, |_| {})
                .await?;
            (r, None)
        }
        None => {
            let options = q.options()?;
            let r = c
                .client
                .operator()
                .dead_replay_selected(&ids, options, |_| {})
                .await?;
            (r, Some(options.keep_attempts))
        }
    };
    if r.replayed == 0 && r.orphans == 0 {
        return Err(not_found(format!("{id} is not dead")));
    }
    Ok(Json(replayed_json(r, attempts)))
}

async fn dead_purge(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<DeadQuery>,
) -> Answer {
    s.authorize(&headers, "dead purge", &id)?;
    let c = s.console()?;
    let ids = DeadSelection::Ids(vec![id.clone()]);
    let p = match q.source(&c.config)? {
        Some(source) => {
            c.client
                .operator()
                .raw_dead_purge_selected(source, &ids, |_| {})
                .await?
        }
        None => {
            c.client
                .operator()
                .dead_purge_selected(&ids, |_| {})
                .await?
        }
    };
    if p.purged == 0 {
        return Err(not_found(format!("{id} is not dead")));
    }
    Ok(Json(json!({ "ok": true, "purged": p.purged })))
}

/// `POST /api/dead?action=replay|purge&<filters>&limit=N`: the dead jobs (or members of
/// `source`) the filters admit when the call starts, as `zdelay dead replay|purge` does, but
/// at most `limit` ([`MAX_BULK`], the default) per request: `complete: false` says more may
/// match (send it again). Without a filter only with `all=true`.
async fn dead_bulk(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<DeadQuery>,
) -> Answer {
    let action = q.action.as_deref().unwrap_or_default();
    if !matches!(action, "replay" | "purge") {
        return Err(bad_request("action: replay or purge"));
    }
    let filter = q.filter()?;
    let source = q.source(&s.console()?.config)?;
    if filter.is_empty() && source.is_none() && q.all != Some(true) {
        return Err(bad_request(
            "no filter: give one (route, reason, older_than, newer_than, schedule, source) or \
             all=true to take every dead job",
        ));
    }
    let most = q.limit.unwrap_or(MAX_BULK).clamp(1, MAX_BULK);
    let what = format!(
        "{action} {filter:?}{}",
        source.map_or("", |s| s.key.as_str())
    );
    s.authorize(&headers, "dead bulk", &what)?;
    let c = s.console()?;
    let selection = DeadSelection::AtMost(filter, most);
    let (mut v, taken) = if action == "purge" {
        let p = match source {
            Some(source) => {
                c.client
                    .operator()
                    .raw_dead_purge_selected(source, &selection, |_| {})
                    .await?
            }
            None => {
                c.client
                    .operator()
                    .dead_purge_selected(&selection, |_| {})
                    .await?
            }
        };
        let taken = p.purged + p.skipped;
        let mut v = serde_json::to_value(p).map_err(anyhow::Error::from)?;
        v["ok"] = true.into();
        (v, taken)
    } else {
        let (r, attempts) = match source {
            Some(source) => {
                let r = c
                    .client
                    .operator()
                    .raw_dead_replay_selected(source, &selection, q.due()?, |_| {})
                    .await?;
                (r, None)
            }
            None => {
                let options = q.options()?;
                let r = c
                    .client
                    .operator()
                    .dead_replay_selected(&selection, options, |_| {})
                    .await?;
                (r, Some(options.keep_attempts))
            }
        };
        (
            replayed_json(r, attempts),
            r.replayed + r.orphans + r.skipped,
        )
    };
    v["limit"] = most.into();
    v["complete"] = (taken < most as u64).into();
    Ok(Json(v))
}

/// A replay's answer; `attempts` (kept or reset) for envelope jobs only.
fn replayed_json(r: Replayed, keep_attempts: Option<bool>) -> Value {
    let mut v = serde_json::to_value(r).unwrap_or_default();
    v["ok"] = true.into();
    if let Some(keep) = keep_attempts {
        v["attempts"] = if keep { "kept" } else { "reset" }.into();
    }
    v
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
    let Some(job) = s.console()?.client.operator().schedule_run_now(&id).await? else {
        return Err(not_found(format!("no schedule {id}")));
    };
    Ok(Json(json!({ "ok": true, "job": job })))
}

/// `{"now_ms", "redis_ms", "offset_ms"}`: a test clock's reading.
fn clock_answer(r: zdelay_core::store::clock::Reading) -> Json<Value> {
    Json(json!({ "now_ms": r.now_ms(), "redis_ms": r.redis_ms, "offset_ms": r.offset_ms }))
}

/// A namespace without a test clock is a conflict with the request, not a fault.
fn clock_error(e: ClientError) -> ApiError {
    match e {
        ClientError::Store(StoreError::NoTestClock { .. }) => {
            ApiError(StatusCode::CONFLICT, e.to_string())
        }
        other => other.into(),
    }
}

async fn clock_show(State(s): State<ApiState>, headers: HeaderMap) -> Answer {
    s.may_read(&headers, Access::PublicRead)?;
    let reading = s.console()?.client.clock().await.map_err(clock_error)?;
    Ok(clock_answer(reading))
}

#[derive(Deserialize)]
struct AdvanceQuery {
    by: Option<String>,
}

async fn clock_advance(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Query(q): Query<AdvanceQuery>,
) -> Answer {
    let by_text = q.by.unwrap_or_default();
    s.authorize(&headers, "clock advance", &by_text)?;
    let by = zdelay_core::store::clock::parse_advance(&by_text)
        .map_err(|why| bad_request(format!("by: {why}")))?;
    let reading = s
        .console()?
        .client
        .advance_clock(by)
        .await
        .map_err(clock_error)?;
    Ok(clock_answer(reading))
}
