//! The admin HTTP port: `/metrics` (Prometheus), `/healthz` (the process serves requests),
//! `/readyz` (Redis answered the last health check and the pollers run), and the operator
//! console under `admin.ui_prefix`: its pages (`ui`) and its JSON API (`api`, actions
//! checked by `guard`).

mod api;
mod guard;
mod ui;

pub use api::Console;

use crate::metrics::REDIS_UP;
use crate::sinks::SinkHandle;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zdelay_client::config::AdminConfig;
use zdelay_client::store::Conn;

/// What readiness is made of.
#[derive(Default)]
pub struct Health {
    pub redis_ok: AtomicBool,
    pub pollers_running: AtomicBool,
    /// Two-phase sinks, checked in the background.
    pub sinks: std::sync::Mutex<Vec<Arc<SinkHandle>>>,
}

impl Health {
    /// Ready when Redis answers, the pollers run and every sink is healthy; the body names
    /// what is not.
    fn readiness(&self) -> Result<String, String> {
        if !self.redis_ok.load(Ordering::Relaxed) {
            return Err("redis unreachable".into());
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
        }
        if all_up {
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

/// Binds now (a bad address fails start-up) and serves until `shutdown`. The console's API
/// answers 503 until `console` is set (once the daemon reached Redis).
pub async fn serve(
    admin: &AdminConfig,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    console: Arc<OnceLock<Console>>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(admin.listen).await?;
    let prefix = admin.ui_prefix.as_str();
    let console = api::routes(prefix)
        .with_state(api::ApiState {
            console,
            token: admin.token.clone(),
        })
        .merge(ui::routes(prefix));
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<AdminState>| async move { s.metrics.render() }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<AdminState>| async move {
                match s.health.readiness() {
                    Ok(report) => (StatusCode::OK, format!("ready\n{report}")),
                    Err(why) => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    ),
                }
            }),
        )
        .with_state(AdminState { metrics, health })
        .merge(console);
    Ok(tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "admin server failed");
        }
    }))
}

/// Pings Redis every second; readiness follows the answer.
pub async fn check_redis(mut con: Conn, health: Arc<Health>, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        // On a cluster: the schema's node, the one every start-up needs.
        let ping = con.on_one_node(redis::cmd("PING"));
        let ok = matches!(
            tokio::time::timeout(Duration::from_secs(1), ping).await,
            Ok(Ok(_))
        );
        if ok != health.redis_ok.swap(ok, Ordering::Relaxed) {
            if ok {
                tracing::info!("redis reachable again");
            } else {
                tracing::error!("redis health check failed: not ready");
            }
        }
        metrics::gauge!(REDIS_UP).set(if ok { 1.0 } else { 0.0 });
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.cancelled() => {}
        }
    }
}
