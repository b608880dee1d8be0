//! Metric names, descriptions and buckets, and the one function per event that writes
//! both the log line and the metric (so they cannot drift).
//!
//! Labels are bounded: route and source names come from the config, error kinds from
//! fixed lists; never a job id or a payload. Hot paths emit per batch, not per job.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const JOBS_MOVED: &str = "zdelay_jobs_moved_total";
pub const JOBS_DEAD: &str = "zdelay_jobs_dead_total";
pub const LATENESS: &str = "zdelay_lateness_seconds";
pub const BATCH_SIZE: &str = "zdelay_batch_size";
pub const SCRIPT_DURATION: &str = "zdelay_script_duration_seconds";
pub const ERRORS: &str = "zdelay_errors_total";
pub const WAKEUPS: &str = "zdelay_wakeups_total";
pub const DUE_BACKLOG: &str = "zdelay_due_backlog";
pub const SCHEDULED: &str = "zdelay_scheduled";
pub const OLDEST_DUE_AGE: &str = "zdelay_oldest_due_age_seconds";
pub const INFLIGHT: &str = "zdelay_inflight";
pub const DEAD: &str = "zdelay_dead";
pub const OWNED_SHARDS: &str = "zdelay_owned_shards";
pub const REDIS_UP: &str = "zdelay_redis_up";
pub const SINK_OUTCOMES: &str = "zdelay_sink_messages_total";
pub const SINK_PUBLISH_DURATION: &str = "zdelay_sink_publish_duration_seconds";
pub const SINK_UP: &str = "zdelay_sink_up";
pub const FENCED: &str = "zdelay_fenced_settles_total";
pub const LEASES_EXPIRED: &str = "zdelay_leases_expired_total";
pub const SINK_WAITING: &str = "zdelay_sink_waiting";
pub const SINK_OLDEST_WAITING: &str = "zdelay_sink_oldest_waiting_seconds";
pub const OCCURRENCES: &str = "zdelay_schedule_occurrences_total";
pub const TRACE_CONTEXT_INVALID: &str = "zdelay_trace_context_invalid_total";
pub const JOBS_REROUTED: &str = "zdelay_jobs_rerouted_total";
pub const SETTLE_RETRIES: &str = "zdelay_settle_retries_total";

/// Lateness buckets in ms: from 1 ms to 5 minutes. The move scripts count jobs per bucket.
pub const LATENESS_BOUNDS_MS: &[u64] = &[
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000,
];
const BATCH_BUCKETS: &[f64] = &[1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0];
const SCRIPT_BUCKETS: &[f64] = &[
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Installs the Prometheus recorder (once per process) and describes every metric.
pub fn install() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let lateness: Vec<f64> = LATENESS_BOUNDS_MS
                .iter()
                .map(|ms| *ms as f64 / 1000.0)
                .collect();
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(LATENESS.into()), &lateness)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(SCRIPT_DURATION.into()), SCRIPT_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(SINK_PUBLISH_DURATION.into()),
                        SCRIPT_BUCKETS,
                    )
                })
                .expect("bucket lists are non-empty")
                .install_recorder()
                .expect("the metrics recorder is installed once");
            describe();
            handle
        })
        .clone()
}

fn describe() {
    describe_counter!(JOBS_MOVED, "Jobs pushed onto their route's list, by route.");
    describe_counter!(JOBS_DEAD, "Jobs sent to dead, by source and reason.");
    describe_histogram!(LATENESS, "Delivery time minus due time, by source.");
    describe_histogram!(BATCH_SIZE, "Jobs taken per move script call.");
    describe_histogram!(SCRIPT_DURATION, "Round trip of a script call, by script.");
    describe_counter!(ERRORS, "Errors by kind.");
    describe_counter!(WAKEUPS, "Poller wake-ups received, by cause.");
    describe_gauge!(
        DUE_BACKLOG,
        "Jobs due now and not yet moved, by shard or source."
    );
    describe_gauge!(SCHEDULED, "Jobs scheduled later, by shard or source.");
    describe_gauge!(
        OLDEST_DUE_AGE,
        "Age of the oldest due job, by shard or source."
    );
    describe_gauge!(INFLIGHT, "Jobs claimed by two-phase sinks, by shard.");
    describe_gauge!(DEAD, "Dead jobs, by shard or source.");
    describe_gauge!(OWNED_SHARDS, "Shards this instance polls.");
    describe_gauge!(REDIS_UP, "1 when the last Redis health check passed.");
    describe_counter!(
        SINK_OUTCOMES,
        "Messages per two-phase sink and outcome: delivered (confirmed), retried, rejected, unavailable."
    );
    describe_histogram!(
        SINK_PUBLISH_DURATION,
        "Publish of one batch until confirmed, by sink."
    );
    describe_gauge!(
        SINK_UP,
        "1 when the sink's last health check or publish succeeded."
    );
    describe_counter!(
        FENCED,
        "Settles refused because the lease had passed to someone else."
    );
    describe_counter!(
        LEASES_EXPIRED,
        "Claimed jobs whose lease ran out, returned to due."
    );
    describe_gauge!(
        SINK_WAITING,
        "Jobs due and waiting for their two-phase sink to claim them, by sink."
    );
    describe_gauge!(
        SINK_OLDEST_WAITING,
        "How long the oldest job waiting for a two-phase sink has been due, by sink."
    );
    describe_counter!(
        OCCURRENCES,
        "Occurrences of recurring schedules, by outcome: fired (turned into a job), expired \
         (past max_lateness), skipped (misfire policy)."
    );
    describe_counter!(
        JOBS_REROUTED,
        "Jobs waiting for or claimed by a two-phase sink whose route leads elsewhere now (the \
         config changed), by the sink they waited for (`from`) and where they went (`to`: \
         sink, local, dead)."
    );
    describe_counter!(
        SETTLE_RETRIES,
        "Settles sent again after a passing fault (connection dropped, timeout, busy server)."
    );
    describe_counter!(
        TRACE_CONTEXT_INVALID,
        "Delivery attempts whose job carried a malformed traceparent (delivered as given, not \
         used as the delay-hop span's parent), by sink."
    );
}

/// Records a batch's per-bucket lateness counts (from a move script) into the histogram.
pub fn record_lateness(source: &str, buckets: &[u64], max_lateness_ms: i64) {
    let h = histogram!(LATENESS, "source" => source.to_owned());
    for (i, &count) in buckets.iter().enumerate() {
        if count == 0 {
            continue;
        }
        // A bucket's upper bound lands in exactly that Prometheus bucket; the overflow
        // bucket records the batch's largest lateness.
        let ms = LATENESS_BOUNDS_MS
            .get(i)
            .map(|b| *b as f64)
            .unwrap_or(max_lateness_ms as f64);
        h.record_many(ms / 1000.0, count as usize);
    }
}

/// Logs and counts one error event. `kind` is a bounded label.
pub fn error_event(kind: &'static str, context: &str, error: &dyn std::fmt::Display) {
    counter!(ERRORS, "kind" => kind).increment(1);
    tracing::warn!(kind, context, %error, "recovering from error");
}

/// Counts the messages of one batch whose `traceparent` is not W3C. Not an error of
/// zdelay's: the header is delivered as given, only not used as a span parent.
pub fn trace_context_invalid(sink: &str, messages: u64) {
    counter!(TRACE_CONTEXT_INVALID, "sink" => sink.to_owned()).increment(messages);
    tracing::debug!(sink, messages, "malformed traceparent ignored");
}
