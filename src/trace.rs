//! The delay-hop span: one OpenTelemetry span per delivery attempt of a two-phase job, from
//! the time the attempt was due to the sink's answer, exported over OTLP/HTTP.
//!
//! The span is a child of the job's own `traceparent` (kept and delivered unchanged, see
//! `zdelay_core::trace_context`) and links to it, so every retry is a sibling linked to
//! the same origin. Without one, it starts a trace of its own, sampled by
//! `tracing.sample_ratio`; with one, the `sampled` flag decides (parent-based sampling).
//! zdelay never adds or rewrites trace headers.
//!
//! INVARIANT: nothing here waits for the collector. Ending a span hands it to the SDK's
//! batch processor (a bounded queue drained by its own thread; a full queue drops spans),
//! and `shutdown` gives the last export a bounded time.
//!
//! The spans are built with the OpenTelemetry API rather than `tracing` spans: a hop
//! starts at the job's due time, in the past, on the Redis clock, which a `tracing` span
//! (started when created, on the local clock) cannot say.

use crate::sinks::{Message, Outcome};
use opentelemetry::trace::{
    Link, Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer, TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use zdelay_core::config::{TracingConfig, redact_url};
use zdelay_core::trace_context::{self, Origin, TRACESTATE};

/// Span attributes (bounded values: the route comes from the config).
pub const ATTR_ROUTE: &str = "zdelay.route";
pub const ATTR_ATTEMPT: &str = "zdelay.attempt";
pub const ATTR_LATENESS_MS: &str = "zdelay.lateness_ms";
pub const ATTR_OUTCOME: &str = "zdelay.outcome";
pub const ATTR_SINK: &str = "zdelay.sink";
pub const ATTR_JOB_ID: &str = "zdelay.job_id";
pub const SPAN_NAME: &str = "zdelay delay";

/// The tracer of the delay-hop spans; `None` in the context when tracing is off.
#[derive(Clone)]
pub struct HopTracer {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// One attempt, as the span records it. Times are Redis time, ms since the epoch.
pub struct Hop<'a> {
    pub message: &'a Message,
    /// The destination the job named (route or `<sink>/<target>`), or the raw source.
    pub route: &'a str,
    pub sink: &'a str,
    /// 1 for the first delivery attempt.
    pub attempt: u32,
    pub answered_ms: i64,
    pub outcome: &'a Outcome,
}

impl HopTracer {
    /// The exporter and its batch processor, or `None` when `otlp_endpoint` is unset. Reads
    /// the standard `OTEL_BSP_*` variables (queue size, schedule delay).
    pub fn from_config(config: &TracingConfig) -> Result<Option<Self>, String> {
        use opentelemetry_otlp::WithExportConfig;
        let Some(endpoint) = &config.otlp_endpoint else {
            return Ok(None);
        };
        let url = traces_url(endpoint.expose());
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|e| {
                format!(
                    "tracing.otlp_endpoint {}: {e}",
                    redact_url(endpoint.expose())
                )
            })?;
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("zdelay");
        tracing::info!(endpoint = %redact_url(&url), "exporting delay-hop spans over OTLP");
        Ok(Some(HopTracer { provider, tracer }))
    }

    /// Records one attempt's span, from its due time to the sink's answer.
    pub fn record(&self, hop: &Hop) {
        let message = hop.message;
        let parent = match trace_context::origin(&message.headers) {
            Origin::Valid(tp) => {
                let state = trace_context::header(&message.headers, TRACESTATE)
                    .and_then(|s| TraceState::from_str(s).ok())
                    .unwrap_or_default();
                Some(SpanContext::new(
                    TraceId::from_bytes(tp.trace_id),
                    SpanId::from_bytes(tp.span_id),
                    TraceFlags::new(tp.flags),
                    true,
                    state,
                ))
            }
            Origin::None | Origin::Malformed => None,
        };
        let lateness_ms = hop.answered_ms - message.due_ms;
        let mut builder = self
            .tracer
            .span_builder(SPAN_NAME)
            .with_kind(SpanKind::Producer)
            .with_start_time(epoch_ms(message.due_ms))
            .with_attributes([
                KeyValue::new(ATTR_ROUTE, hop.route.to_owned()),
                KeyValue::new(ATTR_SINK, hop.sink.to_owned()),
                KeyValue::new(ATTR_ATTEMPT, i64::from(hop.attempt)),
                KeyValue::new(ATTR_LATENESS_MS, lateness_ms),
                KeyValue::new(ATTR_OUTCOME, hop.outcome.label()),
                KeyValue::new(ATTR_JOB_ID, message.id.clone()),
                KeyValue::new("messaging.destination.name", message.target.clone()),
                KeyValue::new("messaging.message.id", message.idempotency_key()),
            ]);
        if let Some(origin) = &parent {
            builder = builder.with_links(vec![Link::with_context(origin.clone())]);
        }
        let cx = match parent {
            Some(origin) => Context::new().with_remote_span_context(origin),
            None => Context::new(),
        };
        let mut span = builder.start_with_context(&self.tracer, &cx);
        match hop.outcome {
            Outcome::Delivered => span.set_status(Status::Ok),
            Outcome::Retry(why)
            | Outcome::Reject(why)
            | Outcome::Unavailable(why)
            | Outcome::Missing(why)
            | Outcome::Full(why) => span.set_status(Status::error(why.clone())),
        }
        span.end_with_timestamp(epoch_ms(hop.answered_ms));
    }

    /// Exports what is queued, waiting at most `timeout` (a dead collector must not hold
    /// the exit): the SDK's shutdown blocks, so it runs on a thread left behind if late.
    pub fn shutdown(&self, timeout: Duration) {
        let provider = self.provider.clone();
        let (done, finished) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("otlp-shutdown".into())
            .spawn(move || {
                let _ = done.send(provider.shutdown());
            });
        if spawned.is_err() {
            return;
        }
        match finished.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "last span export failed"),
            Err(_) => tracing::warn!(?timeout, "last span export unfinished; spans dropped"),
        }
    }
}

/// The collector URL the exporter posts to: `/v1/traces` when `endpoint` has no path.
fn traces_url(endpoint: &str) -> String {
    let after_scheme = endpoint.find("://").map_or(0, |i| i + 3);
    match endpoint[after_scheme..].find('/') {
        Some(slash) if endpoint.len() > after_scheme + slash + 1 => endpoint.to_owned(),
        Some(_) => format!("{}v1/traces", endpoint),
        None => format!("{endpoint}/v1/traces"),
    }
}

fn epoch_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_without_a_path_gets_the_traces_path() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://127.0.0.1:4318/"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://collector/custom/traces"),
            "https://collector/custom/traces"
        );
    }

    #[test]
    fn tracing_is_off_without_an_endpoint() {
        assert!(
            HopTracer::from_config(&TracingConfig::default())
                .expect("valid")
                .is_none()
        );
    }
}
