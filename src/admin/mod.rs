//! The admin HTTP port: `/metrics` (Prometheus), `/healthz` (the process serves requests),
//! `/readyz` (Redis answered the last health check and the pollers run), and the operator
//! console under `admin.ui_prefix` (unless `admin.console = false`): its pages (`ui`) and
//! its JSON API (`api`), beside the HTTP enqueue (`produce`, once `admin.producer_token` is
//! set, with the console or without it); `guard` decides who may read and act. `admin.metrics_listen` adds
//! a second port with the first three only, so what serves Prometheus and the probes need
//! not expose the console.

mod api;
mod guard;
mod produce;
mod ui;

pub use api::Console;

use crate::metrics::REDIS_UP;
use crate::sinks::SinkHandle;
use axum::Router;
use axum::extract::{Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zdelay_core::config::{AdminConfig, RedisConfig, redact_known};
use zdelay_core::store::{Conn, StoreError};

/// What readiness is made of.
#[derive(Default)]
pub struct Health {
    pub redis_ok: AtomicBool,
    /// Why Redis is not usable when `redis_ok` is false; empty: unreachable.
    redis_problem: std::sync::Mutex<String>,
    pub pollers_running: AtomicBool,
    /// Two-phase sinks, checked in the background.
    pub sinks: std::sync::Mutex<Vec<Arc<SinkHandle>>>,
}

impl Health {
    /// Records why Redis cannot be used: refused credentials are named as such (retrying
    /// does not help until they change), anything else reads "unreachable".
    pub fn redis_failed(&self, error: &StoreError) {
        self.redis_ok.store(false, Ordering::Relaxed);
        *self.redis_problem.lock().expect("problem lock") = if error.is_auth() {
            redact_known(&error.to_string()).into_owned()
        } else {
            String::new()
        };
    }

    /// Ready when Redis answers, the pollers run and (when `sinks_required`) every sink is
    /// healthy; the body names what is not, and each sink's state either way.
    fn readiness(&self, sinks_required: bool) -> Result<String, String> {
        self.readiness_unredacted(sinks_required)
            .map(|r| redact_known(&r).into_owned())
            .map_err(|r| redact_known(&r).into_owned())
    }

    fn readiness_unredacted(&self, sinks_required: bool) -> Result<String, String> {
        if !self.redis_ok.load(Ordering::Relaxed) {
            let problem = self.redis_problem.lock().expect("problem lock");
            return Err(if problem.is_empty() {
                "redis unreachable".into()
            } else {
                problem.clone()
            });
        }
        if !self.pollers_running.load(Ordering::Relaxed) {
            return Err("pollers not running".into());
        }
        let mut report = String::new();
        let mut all_up = true;
        for sink in self.sinks.lock().expect("sinks lock").iter() {
            let state = if sink.is_healthy() {
                "up".to_owned()
            } else {
                all_up = false;
                format!("down: {}", sink.last_error())
            };
            report.push_str(&format!("sink {} ({}): {state}\n", sink.name, sink.kind));
            // A missing destination object holds only its own jobs: not a readiness failure.
            for (target, why) in sink.held() {
                report.push_str(&format!("  held {target}: {why}\n"));
            }
        }
        if all_up || !sinks_required {
            Ok(report)
        } else {
            Err(format!("sinks down\n{report}"))
        }
    }
}

#[derive(Clone)]
struct AdminState {
    metrics: PrometheusHandle,
    health: Arc<Health>,
}

/// `/readyz?sinks=ignore`: ready on Redis and the pollers alone, the sinks' state still in
/// the text (a broker outage must not take every pod out of rotation, or stall a rollout).
#[derive(serde::Deserialize, Default)]
struct ReadyQuery {
    sinks: Option<String>,
}

impl ReadyQuery {
    fn sinks_required(&self) -> bool {
        self.sinks.as_deref() != Some("ignore")
    }
}

/// `/metrics`, `/healthz` and `/readyz`: what both listeners serve.
fn health_routes(state: AdminState) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(s): State<AdminState>| async move { crate::metrics::render(&s.metrics) }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(
                |State(s): State<AdminState>, Query(q): Query<ReadyQuery>| async move {
                    match s.health.readiness(q.sinks_required()) {
                        Ok(report) => (StatusCode::OK, format!("ready\n{report}")),
                        Err(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                },
            ),
        )
        .with_state(state)
}

/// Under `admin.ui_prefix`, behind the site check ([`guard::Policy::site`]): the console's
/// pages and API unless `admin.console = false`, and the HTTP enqueue once
/// `admin.producer_token` is set, with the console or without it.
fn console_routes(admin: &AdminConfig, console: Arc<OnceLock<Console>>) -> Router {
    let prefix = admin.ui_prefix.as_str();
    let policy = Arc::new(guard::Policy::new(admin));
    let api_prefix = format!("{prefix}/api/");
    let state = api::ApiState {
        console,
        policy: policy.clone(),
    };
    let app = if admin.console {
        api::routes(prefix)
            .merge(produce::routes(prefix, admin, policy.clone()))
            .with_state(state)
            .merge(ui::routes(prefix))
    } else {
        produce::routes(prefix, admin, policy.clone()).with_state(state)
    };
    app.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| {
            let policy = policy.clone();
            let api = request.uri().path().starts_with(&api_prefix);
            async move {
                match policy.site(request.headers(), api) {
                    Ok(()) => next.run(request).await,
                    Err(refused) => {
                        tracing::info!(
                            path = request.uri().path(),
                            why = %refused,
                            "console request refused"
                        );
                        api::ApiError::forbidden(refused).into_response()
                    }
                }
            }
        },
    ))
}

/// Binds now (a bad address fails start-up) and serves until `shutdown`: `admin.listen`
/// with the health routes and, unless `admin.console = false`, the console, and the HTTP
/// enqueue when `admin.producer_token` is set; and
/// `admin.metrics_listen`, when set, with the health routes alone. The console's API
/// answers 503 until `console` is set (once the daemon reached Redis).
pub async fn serve(
    admin: &AdminConfig,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    console: Arc<OnceLock<Console>>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let bind = |field: &'static str, addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on admin.{field} {addr}: {e}"),
            )
        })
    };
    let listener = bind("listen", admin.listen).await?;
    let metrics_listener = match admin.metrics_listen {
        Some(addr) => Some(bind("metrics_listen", addr).await?),
        None => None,
    };
    let state = AdminState { metrics, health };
    let mut app = health_routes(state.clone());
    if admin.console || admin.producer_token.is_some() {
        app = app.merge(console_routes(admin, console));
    }
    let serve = |listener: tokio::net::TcpListener, app: Router| {
        let shutdown = shutdown.clone();
        async move {
            let result = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = result {
                tracing::error!(error = %e, "admin server failed");
            }
        }
    };
    let main = serve(listener, app);
    let second = metrics_listener.map(|l| serve(l, health_routes(state)));
    Ok(tokio::spawn(async move {
        match second {
            Some(second) => {
                tokio::join!(main, second);
            }
            None => main.await,
        }
    }))
}

/// Pings Redis every second; readiness follows the answer.
pub async fn check_redis(
    mut con: Conn,
    config: RedisConfig,
    health: Arc<Health>,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        // On a cluster: the schema's node, the one every start-up needs.
        let ping = con.on_one_node(redis::cmd("PING"));
        let failure = match tokio::time::timeout(Duration::from_secs(1), ping).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(StoreError::connecting(&config, e)),
            Err(_) => Some(StoreError::connecting(
                &config,
                redis::RedisError::from((redis::ErrorKind::Io, "no answer within 1s")),
            )),
        };
        let ok = failure.is_none();
        let was_ok = health.redis_ok.load(Ordering::Relaxed);
        // Not ready while it fails; logged with the episode of Redis errors it belongs to
        // (one line however long it lasts), unless the credentials are refused: an operator
        // must act on that.
        match failure {
            None => {
                health.redis_ok.store(true, Ordering::Relaxed);
                crate::metrics::recovered("redis", "health check");
            }
            Some(e) => {
                health.redis_failed(&e);
                if was_ok && e.is_auth() {
                    tracing::error!(error = %e, "redis refuses the credentials: not ready");
                }
                crate::metrics::error_event("redis", "health check", &e);
            }
        }
        metrics::gauge!(REDIS_UP).set(if ok { 1.0 } else { 0.0 });
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}
