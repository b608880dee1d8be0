//! Metric names, descriptions and buckets, and the one function per event that writes
//! both the log line and the metric (so they cannot drift).
//!
//! Labels are bounded: route and source names come from the config, error kinds from
//! fixed lists; never a job id or a payload. Hot paths emit per batch, not per job.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub const JOBS_MOVED: &str = "zdelay_jobs_moved_total";
pub const JOBS_DEAD: &str = "zdelay_jobs_dead_total";
pub const LATENESS: &str = "zdelay_lateness_seconds";
pub const BATCH_SIZE: &str = "zdelay_batch_size";
pub const SCRIPT_DURATION: &str = "zdelay_script_duration_seconds";
pub const ERRORS: &str = "zdelay_errors_total";
pub const WAKEUPS: &str = "zdelay_wakeups_total";
pub const WAKEUPS_CONFIRMED: &str = "zdelay_wakeups_confirmed";
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
pub const SINK_HELD_TARGETS: &str = "zdelay_sink_held_targets";
pub const FENCED: &str = "zdelay_fenced_settles_total";
pub const LEASES_EXPIRED: &str = "zdelay_leases_expired_total";
pub const SINK_WAITING: &str = "zdelay_sink_waiting";
pub const SINK_OLDEST_WAITING: &str = "zdelay_sink_oldest_waiting_seconds";
pub const OCCURRENCES: &str = "zdelay_schedule_occurrences_total";
pub const TRACE_CONTEXT_INVALID: &str = "zdelay_trace_context_invalid_total";
pub const JOBS_REROUTED: &str = "zdelay_jobs_rerouted_total";
pub const DEFERRED: &str = "zdelay_deferred_total";
pub const DEFERRAL: &str = "zdelay_deferral_seconds";
pub const ROUTE_HELD: &str = "zdelay_route_held";
pub const SETTLE_RETRIES: &str = "zdelay_settle_retries_total";
pub const SCHEDULE_RECORDED: &str = "zdelay_schedule_occurrences_recorded";
pub const SCHEDULE_LAST_FIRED: &str = "zdelay_schedule_last_fired_timestamp_seconds";
pub const SCHEDULE_LAST_LATENESS: &str = "zdelay_schedule_last_lateness_seconds";
pub const SCHEDULE_NEXT_DUE: &str = "zdelay_schedule_next_due_timestamp_seconds";
pub const SCHEDULE_PERIOD: &str = "zdelay_schedule_period_seconds";

/// The series with a `schedule` label: rendered by [`set_schedule_series`] and appended to
/// the scrape, not kept by the recorder, which cannot drop a series (a schedule deleted or
/// no longer among the most missed must stop being exported).
pub const PER_SCHEDULE: &[&str] = &[
    SCHEDULE_RECORDED,
    SCHEDULE_LAST_FIRED,
    SCHEDULE_LAST_LATENESS,
    SCHEDULE_NEXT_DUE,
    SCHEDULE_PERIOD,
];

/// Lateness buckets in ms: from 1 ms to 5 minutes. The move scripts count jobs per bucket.
pub const LATENESS_BOUNDS_MS: &[u64] = &[
    1, 2, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000,
];
const BATCH_BUCKETS: &[f64] = &[1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0];
const SCRIPT_BUCKETS: &[f64] = &[
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// How often the recorder's upkeep runs (see [`run_upkeep`]).
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder (once per process) and describes every metric. Its
/// upkeep is the caller's: [`run_upkeep`].
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
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(DEFERRAL.into()), &lateness))
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

/// Folds the histogram samples recorded since the last pass into their buckets, every
/// [`UPKEEP_EVERY`] until `shutdown`. The recorder keeps every sample until then (a scrape
/// does it too): without this, a daemon nobody scrapes grows with every job it moves.
pub async fn run_upkeep(handle: PrometheusHandle, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(UPKEEP_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => handle.run_upkeep(),
            _ = shutdown.cancelled() => return,
        }
    }
}

/// What a metric counts or measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One label of a metric: its name and, when the set is fixed, its values.
#[derive(Debug, Clone, Copy)]
pub struct Label {
    pub name: &'static str,
    pub values: &'static [&'static str],
}

const fn label(name: &'static str) -> Label {
    Label { name, values: &[] }
}

const fn label_of(name: &'static str, values: &'static [&'static str]) -> Label {
    Label { name, values }
}

/// A metric the daemon exports: the one definition its description (`# HELP`) and the
/// reference page (`docs/reference/metrics.md`) are made from.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [Label],
    /// One sentence, the `# HELP` text.
    pub help: &'static str,
    /// More for the reference page (Markdown): label values, units, how to read it.
    pub details: &'static str,
}

/// Every metric, in the order the reference page lists them.
pub const METRICS: &[Metric] = &[
    Metric {
        name: DEFERRED,
        kind: Kind::Counter,
        labels: &[label("route")],
        help: "Jobs moved after waiting while their route was held by its rate or its list's bound.",
        details: "Routes with `rate` or `max_length` only. Their wait while held is counted in \
                  `zdelay_deferral_seconds`, not in `zdelay_lateness_seconds`, so lateness \
                  still means late against the promise.",
    },
    Metric {
        name: DEFERRAL,
        kind: Kind::Histogram,
        labels: &[label("route")],
        help: "How long deferred jobs waited while their route was held (lateness's buckets).",
        details: "Each call's deferred jobs are recorded at their mean deferral.",
    },
    Metric {
        name: ROUTE_HELD,
        kind: Kind::Gauge,
        labels: &[label("route"), label("by")],
        help: "1 while a route holds back due work, by `rate` or `max_length`; else 0.",
        details: "Sampled from the route's flow state in Redis every `poller.stats_interval` \
                  by every instance, like the backlog gauges: combine with `max`.",
    },
    Metric {
        name: JOBS_MOVED,
        kind: Kind::Counter,
        labels: &[label("route")],
        help: "Jobs pushed onto their route's list, by route.",
        details: "",
    },
    Metric {
        name: JOBS_DEAD,
        kind: Kind::Counter,
        labels: &[label("source"), label("reason")],
        help: "Jobs sent to dead, by source and reason.",
        details: "`source` is `jobs` for envelope shards or the raw source key. `reason`: from the \
                  move scripts `malformed`, `unknown_destination`, `wrong_type`, `oversize`, \
                  `missing` (envelopes) or `implausible_score`, `wrong_type`, `oversize` (raw); on \
                  the two-phase path `undeliverable` (malformed, not admitted, oversize before \
                  publishing), `rejected` (the broker refused it, or the destination \
                  object is missing on a route with `on_missing = \"dead\"`), `gave_up` \
                  (`max_attempts` reached), `expired` (past `max_lateness`) and `route_gone` \
                  (claimed, and its `dest` resolves to nothing any more); a mover's walk of the \
                  ready set counts the jobs whose route is gone as `unknown_destination`.",
    },
    Metric {
        name: LATENESS,
        kind: Kind::Histogram,
        labels: &[label("source")],
        help: "Delivery time minus due time, by source.",
        details: "Measured on Redis `TIME`; buckets 1, 2, 5, 10, 25, 50, 100, 250, 500 ms, 1, 2.5, \
                  5, 10, 30, 60, 300 s. Local moves (`source` = `jobs` or the raw source key): the \
                  move script counts jobs per bucket, so each job is recorded at its bucket's \
                  upper bound (`_sum` is an upper bound). Two-phase sinks (`source` = the sink \
                  name): measured when the broker confirmed, exact.",
    },
    Metric {
        name: BATCH_SIZE,
        kind: Kind::Histogram,
        labels: &[],
        help: "Jobs taken per move script call.",
        details: "Buckets 1 … 1000.",
    },
    Metric {
        name: SCRIPT_DURATION,
        kind: Kind::Histogram,
        labels: &[label_of("script", &["move_due", "move_raw"])],
        help: "Round trip of a script call, by script.",
        details: "",
    },
    Metric {
        name: ERRORS,
        kind: Kind::Counter,
        labels: &[label_of(
            "kind",
            &[
                "redis",
                "redis_connect",
                "redis_auth",
                "pubsub",
                "push_failed",
                "sink_unavailable",
                "sink_outcomes",
                "schedule_quarantined",
            ],
        )],
        help: "Errors by kind.",
        details: "Recovered errors, each counted; the log has one line per episode. \
                  `sink_unavailable`: a sink's failed health check, unavailable publish or broker \
                  client connection error (librdkafka and async-nats report each reconnect \
                  attempt), one episode per sink. \
                  `schedule_quarantined` is counted once per quarantine and logged at ERROR: an \
                  operator must fix or delete the schedule. `sink_outcomes`: a sink answered a batch \
                  with the wrong number of outcomes (the batch is released and tried again).",
    },
    Metric {
        name: WAKEUPS,
        kind: Kind::Counter,
        labels: &[label_of("cause", &["enqueue", "keyspace", "queued"])],
        help: "Poller wake-ups received, by cause.",
        details: "`queued`: another daemon's mover queued jobs for a two-phase sink in a shard \
                  this daemon also publishes (both poll it: `poller.per_shard = 2`, or a \
                  hand-over).",
    },
    Metric {
        name: WAKEUPS_CONFIRMED,
        kind: Kind::Gauge,
        labels: &[label_of("targets", &["shards", "sources"])],
        help: "1 while wake-ups are known to reach the pollers, so idle polls wait \
               poller.idle_poll_max instead of poller.idle_poll.",
        details: "`shards`: the wake listener's probe, published on the wake channel every 5 s, \
                  came back on the current subscription. `sources` (only with raw sources \
                  configured): keyspace events are known to arrive for every configured source \
                  (the server's `notify-keyspace-events` covers sorted sets, or an event for each \
                  one arrived). 0 after the subscription ends, until a new one is confirmed; a \
                  value that stays 0 means every idle target is polled every `poller.idle_poll`.",
    },
    Metric {
        name: DUE_BACKLOG,
        kind: Kind::Gauge,
        labels: &[label("shard"), label("source"), label("route")],
        help: "Jobs due now and not yet moved, by shard, source or route lane.",
        details: "One of the backlog gauges, sampled every `poller.stats_interval` by a task of \
                  its own (never in the delivery loop); a series has `shard` (a spread shard) or \
                  `source`, or `route` for a route lane.",
    },
    Metric {
        name: SCHEDULED,
        kind: Kind::Gauge,
        labels: &[label("shard"), label("source"), label("route")],
        help: "Jobs scheduled later, by shard, source or route lane.",
        details: "",
    },
    Metric {
        name: OLDEST_DUE_AGE,
        kind: Kind::Gauge,
        labels: &[label("shard"), label("source"), label("route")],
        help: "Age of the oldest due job, by shard, source or route lane.",
        details: "",
    },
    Metric {
        name: INFLIGHT,
        kind: Kind::Gauge,
        labels: &[label("shard"), label("source"), label("route")],
        help: "Jobs claimed by two-phase sinks and not yet settled, by shard, source or route lane.",
        details: "",
    },
    Metric {
        name: DEAD,
        kind: Kind::Gauge,
        labels: &[label("shard"), label("source"), label("route")],
        help: "Dead jobs, by shard, source or route lane.",
        details: "",
    },
    Metric {
        name: OWNED_SHARDS,
        kind: Kind::Gauge,
        labels: &[],
        help: "Shards this instance polls.",
        details: "",
    },
    Metric {
        name: OCCURRENCES,
        kind: Kind::Counter,
        labels: &[label_of(
            "outcome",
            &["fired", "expired", "missed", "skipped_by_calendar"],
        )],
        help: "Occurrences of recurring schedules, by outcome: fired (turned into a job), expired \
               (past max_lateness, into a dead letter), missed (passed over by the misfire \
               policy), skipped_by_calendar (on a date the schedule's calendar excludes).",
        details: "Every schedule, counted by the daemon whose firing decided the occurrence: \
                  combine instances with `sum`. `missed`: of the occurrences due at once after \
                  an outage or a pause of the sink, `coalesce` counts all but the one it \
                  delivers, `skip` all of them, `catch_up` those older than its `max` latest.",
    },
    Metric {
        name: SCHEDULE_RECORDED,
        kind: Kind::Gauge,
        labels: &[
            label("schedule"),
            label_of(
                "outcome",
                &["fired", "missed", "expired", "skipped_by_calendar"],
            ),
        ],
        help: "A schedule's occurrences by outcome since it was created, from its health record \
               in Redis.",
        details: "The per-schedule series (this one and the four below) exist only for the \
                  schedules named in `admin.schedule_metrics` and the \
                  `admin.schedule_metrics_top_missed` ones that missed the most (default 5), so \
                  the `schedule` label stays bounded (which ones missed the most is looked for \
                  once a minute: it reads every schedule's record). Sampled every \
                  `poller.stats_interval` by every instance, the same values: combine with \
                  `max`. A schedule deleted, or no longer among those, stops being exported at \
                  the next sample.",
    },
    Metric {
        name: SCHEDULE_LAST_FIRED,
        kind: Kind::Gauge,
        labels: &[label("schedule")],
        help: "When a firing last turned one of the schedule's occurrences into a job (Unix \
               seconds); before its first firing, when it was created or its start, whichever \
               is later.",
        details: "",
    },
    Metric {
        name: SCHEDULE_LAST_LATENESS,
        kind: Kind::Gauge,
        labels: &[label("schedule")],
        help: "How late the schedule's last firing was: when it fired minus the time of the \
               occurrence it delivered (0 before its first firing).",
        details: "",
    },
    Metric {
        name: SCHEDULE_NEXT_DUE,
        kind: Kind::Gauge,
        labels: &[label("schedule")],
        help: "The schedule's pending occurrence (Unix seconds); 0 when it has none (paused or \
               ended).",
        details: "",
    },
    Metric {
        name: SCHEDULE_PERIOD,
        kind: Kind::Gauge,
        labels: &[label("schedule")],
        help: "The gap between the schedule's next two occurrences, seconds; 0 when it is paused \
               or ended (nothing is expected of it).",
        details: "A cron schedule's period varies (a daily pattern's is a day, one of weekdays \
                  three days over a weekend): the alert on silent schedules compares \
                  `time() - zdelay_schedule_last_fired_timestamp_seconds` with a multiple of it.",
    },
    Metric {
        name: REDIS_UP,
        kind: Kind::Gauge,
        labels: &[],
        help: "1 when the last Redis health check passed.",
        details: "",
    },
    Metric {
        name: SINK_OUTCOMES,
        kind: Kind::Counter,
        labels: &[
            label("sink"),
            label_of(
                "outcome",
                &["delivered", "retried", "rejected", "unavailable", "held"],
            ),
        ],
        help: "Messages per two-phase sink and outcome: delivered (confirmed), retried, rejected, \
               unavailable, held (the destination object is missing, or full).",
        details: "`held`: the job waits with no attempt counted; for a missing object it dies \
                  instead on a route with `on_missing = \"dead\"`, for a full one (a JetStream \
                  stream at its limits) never. A retry \
                  that reaches `max_attempts` counts as `retried` and dies.",
    },
    Metric {
        name: SINK_HELD_TARGETS,
        kind: Kind::Gauge,
        labels: &[label("sink")],
        help: "Targets of a sink (topics, exchange/routing keys, subjects) whose jobs wait because \
               the destination object does not exist, by sink.",
        details: "Exported as 0 for every sink from the start, so an alert on it has a series \
                  before the first target is held.",
    },
    Metric {
        name: SINK_PUBLISH_DURATION,
        kind: Kind::Histogram,
        labels: &[label("sink")],
        help: "Publish of one batch until confirmed, by sink.",
        details: "Buckets 0.2 ms … 1 s.",
    },
    Metric {
        name: SINK_UP,
        kind: Kind::Gauge,
        labels: &[label("sink")],
        help: "1 when the sink's last health check or publish succeeded.",
        details: "",
    },
    Metric {
        name: FENCED,
        kind: Kind::Counter,
        labels: &[],
        help: "Settles refused because the lease had passed to someone else.",
        details: "A steady rate means `poller.lease` is shorter than publishes take.",
    },
    Metric {
        name: LEASES_EXPIRED,
        kind: Kind::Counter,
        labels: &[],
        help: "Claimed jobs whose lease ran out, returned to due.",
        details: "",
    },
    Metric {
        name: SINK_WAITING,
        kind: Kind::Gauge,
        labels: &[label("sink")],
        help: "Jobs due and waiting for their two-phase sink to claim them, by sink.",
        details: "A sink that is down shows its backlog here; every sink found in the ready \
                  sets has a series, configured or not.",
    },
    Metric {
        name: SINK_OLDEST_WAITING,
        kind: Kind::Gauge,
        labels: &[label("sink")],
        help: "How long the oldest job waiting for a two-phase sink has been due, by sink.",
        details: "",
    },
    Metric {
        name: JOBS_REROUTED,
        kind: Kind::Counter,
        labels: &[label("from"), label_of("to", &["sink", "local", "dead"])],
        help: "Jobs waiting for or claimed by a two-phase sink whose route leads elsewhere now (the \
               config changed), by the sink they waited for (`from`) and where they went (`to`: \
               sink, local, dead).",
        details: "",
    },
    Metric {
        name: SETTLE_RETRIES,
        kind: Kind::Counter,
        labels: &[],
        help: "Settles sent again after a passing fault (connection dropped, timeout, busy server).",
        details: "",
    },
    Metric {
        name: TRACE_CONTEXT_INVALID,
        kind: Kind::Counter,
        labels: &[label("sink")],
        help: "Delivery attempts whose job carried a malformed traceparent (delivered as given, not \
               used as the delay-hop span's parent), by sink.",
        details: "",
    },
];

fn describe() {
    for m in METRICS.iter().filter(|m| !PER_SCHEDULE.contains(&m.name)) {
        match m.kind {
            Kind::Counter => describe_counter!(m.name, m.help),
            Kind::Gauge => describe_gauge!(m.name, m.help),
            Kind::Histogram => describe_histogram!(m.name, m.help),
        }
    }
}

/// One schedule's per-schedule series, as the stats sampler read them.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleSeries {
    pub id: String,
    pub health: zdelay_core::schedules::ScheduleHealth,
    /// When it last fired, or before that when it began (created or its start), ms.
    pub last_fired_ms: i64,
    pub next_ms: Option<i64>,
    /// 0 when nothing is expected of it.
    pub period_ms: i64,
}

static SCHEDULE_SERIES_TEXT: Mutex<String> = Mutex::new(String::new());

/// Replaces the per-schedule series the scrape carries (see [`PER_SCHEDULE`]).
pub fn set_schedule_series(rows: &[ScheduleSeries]) {
    let text = render_schedule_series(rows);
    *SCHEDULE_SERIES_TEXT
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = text;
}

/// The scrape: the recorder's series, then the per-schedule ones.
pub fn render(handle: &PrometheusHandle) -> String {
    let mut out = handle.render();
    out.push_str(
        &SCHEDULE_SERIES_TEXT
            .lock()
            .unwrap_or_else(|p| p.into_inner()),
    );
    out
}

/// The Prometheus text of the per-schedule series: each metric's HELP and TYPE, then one
/// line per schedule (and outcome).
fn render_schedule_series(rows: &[ScheduleSeries]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let seconds = |ms: i64| ms as f64 / 1000.0;
    for name in PER_SCHEDULE {
        let m = METRICS
            .iter()
            .find(|m| m.name == *name)
            .expect("every per-schedule metric is in the table");
        let _ = writeln!(out, "# HELP {} {}", m.name, m.help);
        let _ = writeln!(out, "# TYPE {} gauge", m.name);
        for row in rows {
            let id = escape_label(&row.id);
            let h = &row.health;
            let mut line = |labels: String, value: f64| {
                let _ = writeln!(out, "{}{{{labels}}} {value}", m.name);
            };
            match *name {
                SCHEDULE_RECORDED => {
                    for (outcome, n) in [
                        ("fired", h.fired),
                        ("missed", h.missed),
                        ("expired", h.expired),
                        ("skipped_by_calendar", h.skipped_by_calendar),
                    ] {
                        line(format!("schedule=\"{id}\",outcome=\"{outcome}\""), n as f64);
                    }
                }
                SCHEDULE_LAST_FIRED => {
                    line(format!("schedule=\"{id}\""), seconds(row.last_fired_ms))
                }
                SCHEDULE_LAST_LATENESS => line(
                    format!("schedule=\"{id}\""),
                    seconds(h.last_lateness_ms().unwrap_or(0).max(0)),
                ),
                SCHEDULE_NEXT_DUE => line(
                    format!("schedule=\"{id}\""),
                    seconds(row.next_ms.unwrap_or(0)),
                ),
                _ => line(format!("schedule=\"{id}\""), seconds(row.period_ms)),
            }
        }
    }
    out
}

/// A label value as the text format quotes it.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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

/// Counts one error event, and logs it when it opens an episode: while errors go on (Redis
/// busy, loading, out of memory, connections cut, a broker down), the first is logged and the
/// rest only counted, so a minute-long outage is one warning, not one per poll. The errors
/// about Redis (`redis`, `push_failed`, `pubsub`, `redis_connect`, `redis_auth`) make one
/// episode; each sink's errors (the `sink_*` kinds, `context` = the sink's name) make one per
/// sink; any other `kind` (a bounded label) is its own. The caller reports the success that
/// follows with [`recovered`], with the same kind and context.
pub fn error_event(kind: &'static str, context: &str, error: &dyn std::fmt::Display) {
    counter!(ERRORS, "kind" => kind).increment(1);
    let opened = episodes().error(kind, context, Instant::now());
    // Broker errors may quote an address with its credentials, and span lines.
    let error = zdelay_core::config::redact_known(&error.to_string()).replace('\n', " ");
    match (opened, Subject::of(kind, context)) {
        (true, Subject::Sink(sink)) => tracing::warn!(sink, kind, error, "sink unavailable"),
        (true, _) => tracing::warn!(kind, context, error, "recovering from error"),
        (false, _) => tracing::debug!(kind, context, error, "error goes on"),
    }
}

/// A warning about sink `$sink` (the rest: `tracing` fields and message): logged at DEBUG and
/// counted into the sink's outage while one is open ([`absorbed_by_outage`]), else a WARN.
#[macro_export]
macro_rules! sink_warning {
    ($sink:expr, $($event:tt)+) => {
        if $crate::metrics::absorbed_by_outage($sink) {
            ::tracing::debug!($($event)+)
        } else {
            ::tracing::warn!($($event)+)
        }
    };
}

/// True while `sink`'s outage episode is open: the caller's warning about it (a retried
/// publish, a client library's complaint) is counted into the episode, whose end line reports
/// it among the suppressed errors, instead of being logged as news of its own.
pub fn absorbed_by_outage(sink: &str) -> bool {
    if OPEN_EPISODES.load(Ordering::Relaxed) == 0 {
        return false;
    }
    episodes().absorb(&Subject::Sink(sink.to_owned()), Instant::now())
}

/// Whether `sink`'s outage episode is open, without counting anything into it.
#[cfg(test)]
pub(crate) fn sink_outage_open(sink: &str) -> bool {
    let subject = Subject::Sink(sink.to_owned());
    episodes().open.iter().any(|(s, _)| *s == subject)
}

/// A flow-controlled route's move: the jobs it deferred and for how long. (Whether the route
/// is held is sampled from Redis with the backlog gauges, `stats::publish_gauges`.)
pub fn record_flow(route: &str, reply: &zdelay_core::store::scripts::MoveReply) {
    deferred(route, reply.deferred, reply.deferral_ms);
}

/// `jobs` of `route` went out after waiting `deferral_ms` in all while it was held.
pub fn deferred(route: &str, jobs: u64, deferral_ms: u64) {
    if jobs > 0 {
        ::metrics::counter!(DEFERRED, "route" => route.to_owned()).increment(jobs);
        let mean_s = deferral_ms as f64 / jobs as f64 / 1000.0;
        ::metrics::histogram!(DEFERRAL, "route" => route.to_owned())
            .record_many(mean_s, jobs as usize);
    }
}

/// Reports that `context` works again after errors of `kind`; once nothing of the episode
/// has failed for [`EPISODE_SETTLE`], the episode ends with one line (how long it lasted, how
/// many errors it counted, how many of them were not logged). Cheap when no episode is open:
/// it runs after every successful call.
pub fn recovered(kind: &'static str, context: &str) {
    if OPEN_EPISODES.load(Ordering::Relaxed) == 0 {
        return;
    }
    let Some(closed) = episodes().success(kind, context, Instant::now()) else {
        return;
    };
    let suppressed = closed.errors - 1;
    match &closed.subject {
        Subject::Sink(sink) => tracing::info!(
            sink = %sink,
            errors = closed.errors,
            suppressed,
            lasted = ?closed.lasted,
            "sink available again"
        ),
        Subject::Kind(episode) => tracing::info!(
            episode,
            errors = closed.errors,
            suppressed,
            lasted = ?closed.lasted,
            "recovered"
        ),
    }
}

/// Logs (ERROR: an operator must act) and counts a schedule that a firing took off its
/// timeline because it cannot be read; it is reported once, as it is not fired again.
pub fn schedule_quarantined(source: &str, id: &str, reason: &str) {
    counter!(ERRORS, "kind" => "schedule_quarantined").increment(1);
    tracing::error!(
        source,
        schedule = id,
        reason,
        "schedule quarantined: no occurrence until `zdelay schedule set` writes it again"
    );
}

/// Counts the messages of one batch whose `traceparent` is not W3C. Not an error of
/// zdelay's: the header is delivered as given, only not used as a span parent.
pub fn trace_context_invalid(sink: &str, messages: u64) {
    counter!(TRACE_CONTEXT_INVALID, "sink" => sink.to_owned()).increment(messages);
    tracing::debug!(sink, messages, "malformed traceparent ignored");
}

/// What an episode is about: everything that goes wrong when Redis misbehaves is one; each
/// sink's troubles are one per sink.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Subject {
    Kind(&'static str),
    Sink(String),
}

impl Subject {
    fn of(kind: &'static str, context: &str) -> Self {
        match kind {
            "redis" | "push_failed" | "pubsub" | "redis_connect" | "redis_auth" => {
                Subject::Kind("redis")
            }
            kind if kind.starts_with("sink_") => Subject::Sink(context.to_owned()),
            other => Subject::Kind(other),
        }
    }
}

/// How many episodes are open (the fast path of [`recovered`] reads it without the lock).
static OPEN_EPISODES: AtomicUsize = AtomicUsize::new(0);

fn episodes() -> std::sync::MutexGuard<'static, Episodes> {
    static EPISODES: Mutex<Episodes> = Mutex::new(Episodes::new());
    // Every update is complete before anything can panic: the data stays consistent.
    EPISODES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An episode ends only after this long without an error, so a Redis that keeps failing and
/// recovering (connections killed again and again) is one episode, not one per failure.
const EPISODE_SETTLE: Duration = Duration::from_secs(1);

/// A context that has reported no error for this long counts as recovered even if it never
/// said so (its task stopped: a shard handed to another daemon, a shutdown), so it cannot
/// hold an episode open and silence the next one.
const EPISODE_STALE: Duration = Duration::from_secs(60);

/// Open error episodes, by subject.
struct Episodes {
    open: Vec<(Subject, Episode)>,
}

struct Episode {
    started: Instant,
    errors: u64,
    last_error: Instant,
    /// What still fails, (kind, context), with the time of its last error.
    failing: HashMap<(&'static str, String), Instant>,
}

/// An episode that ended.
#[derive(Debug, PartialEq)]
struct Closed {
    subject: Subject,
    errors: u64,
    lasted: Duration,
}

impl Episodes {
    const fn new() -> Self {
        Episodes { open: Vec::new() }
    }

    /// Records an error; true when it opens an episode.
    fn error(&mut self, kind: &'static str, context: &str, now: Instant) -> bool {
        let subject = Subject::of(kind, context);
        let failing = (kind, context.to_owned());
        if let Some((_, episode)) = self.open.iter_mut().find(|(s, _)| *s == subject) {
            if now.duration_since(episode.last_error) < EPISODE_STALE {
                episode.forget_stale(now);
                episode.errors += 1;
                episode.last_error = now;
                episode.failing.insert(failing, now);
                return false;
            }
            // Everything fell silent long ago: whatever this is, it is news.
            *episode = Episode::starting(failing, now);
            return true;
        }
        self.open.push((subject, Episode::starting(failing, now)));
        OPEN_EPISODES.store(self.open.len(), Ordering::Relaxed);
        true
    }

    /// Counts an error into `subject`'s episode if one is open (and not stale); true if so.
    fn absorb(&mut self, subject: &Subject, now: Instant) -> bool {
        match self.open.iter_mut().find(|(s, _)| s == subject) {
            Some((_, episode)) if now.duration_since(episode.last_error) < EPISODE_STALE => {
                episode.errors += 1;
                episode.last_error = now;
                true
            }
            _ => false,
        }
    }

    /// Records a success; the episode it belongs to when nothing of it fails any more.
    fn success(&mut self, kind: &'static str, context: &str, now: Instant) -> Option<Closed> {
        let subject = Subject::of(kind, context);
        let at = self.open.iter().position(|(s, _)| *s == subject)?;
        let episode = &mut self.open[at].1;
        if matches!(subject, Subject::Sink(_)) {
            // A sink that published or passed its check works, whatever failed before.
            episode.failing.clear();
        } else {
            episode.failing.remove(&(kind, context.to_owned()));
        }
        episode.forget_stale(now);
        if !episode.failing.is_empty() || now.duration_since(episode.last_error) < EPISODE_SETTLE {
            return None;
        }
        let (_, episode) = self.open.swap_remove(at);
        OPEN_EPISODES.store(self.open.len(), Ordering::Relaxed);
        Some(Closed {
            subject,
            errors: episode.errors,
            lasted: now.duration_since(episode.started),
        })
    }
}

impl Episode {
    fn starting(failing: (&'static str, String), now: Instant) -> Self {
        Episode {
            started: now,
            errors: 1,
            last_error: now,
            failing: HashMap::from([(failing, now)]),
        }
    }

    fn forget_stale(&mut self, now: Instant) {
        self.failing
            .retain(|_, last| now.duration_since(*last) < EPISODE_STALE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_schedule_series_are_the_rows_given_and_quote_their_ids() {
        assert_eq!(
            render_schedule_series(&[]),
            "",
            "no schedule: no series at all"
        );
        let health = zdelay_core::schedules::ScheduleHealth::parse("9 3 1 0 10500 10000");
        let row = ScheduleSeries {
            id: "a\"b\\c".into(),
            health,
            last_fired_ms: 10_500,
            next_ms: Some(12_000),
            period_ms: 2_000,
        };
        let text = render_schedule_series(&[row]);
        let id = r#"schedule="a\"b\\c""#;
        for line in [
            format!("zdelay_schedule_occurrences_recorded{{{id},outcome=\"missed\"}} 3"),
            format!("zdelay_schedule_occurrences_recorded{{{id},outcome=\"fired\"}} 9"),
            format!("zdelay_schedule_last_fired_timestamp_seconds{{{id}}} 10.5"),
            format!("zdelay_schedule_last_lateness_seconds{{{id}}} 0.5"),
            format!("zdelay_schedule_next_due_timestamp_seconds{{{id}}} 12"),
            format!("zdelay_schedule_period_seconds{{{id}}} 2"),
            "# TYPE zdelay_schedule_period_seconds gauge".to_owned(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        // Only the labels the table declares.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, rest) = line.split_once('{').unwrap();
            let m = METRICS.iter().find(|m| m.name == name).unwrap();
            for pair in rest.split("\",") {
                let label = pair.split('=').next().unwrap();
                assert!(m.labels.iter().any(|l| l.name == label), "{line}");
            }
        }
        // Eight lines a schedule (four outcomes, four single series), each metric's HELP
        // and TYPE once.
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 8);
        assert_eq!(text.lines().filter(|l| l.starts_with("# HELP")).count(), 5);
    }

    #[test]
    fn an_episode_logs_once_and_ends_when_everything_works_again() {
        let mut e = Episodes::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(
            e.error("redis", "shard 0", at(0)),
            "the first error opens it"
        );
        assert!(!e.error("redis", "shard 0", at(50)), "a retry is not news");
        assert!(
            !e.error("redis", "shard 1", at(60)),
            "nor another context's error"
        );
        assert!(
            !e.error("push_failed", "shard 2", at(65)),
            "nor another redis kind's"
        );
        assert!(
            e.error("schedule", "shard 0", at(70)),
            "another subject has its own"
        );
        assert_eq!(
            e.success("redis", "shard 0", at(100)),
            None,
            "shard 1 still fails"
        );
        assert!(
            !e.error("redis", "shard 0", at(150)),
            "a relapse mid-episode is silent"
        );
        let settled = 150 + EPISODE_SETTLE.as_millis() as u64;
        assert_eq!(e.success("redis", "shard 0", at(settled)), None);
        assert_eq!(
            e.success("redis", "shard 1", at(settled)),
            None,
            "shard 2 fails"
        );
        assert_eq!(
            e.success("redis", "shard 2", at(settled)),
            None,
            "a success of another kind does not end shard 2's push failures"
        );
        assert_eq!(
            e.success("push_failed", "shard 2", at(settled)),
            Some(Closed {
                subject: Subject::Kind("redis"),
                errors: 5,
                lasted: Duration::from_millis(settled)
            })
        );
        assert_eq!(
            e.success("redis", "shard 1", at(settled)),
            None,
            "already over"
        );
        assert!(
            e.error("redis", "shard 0", at(settled + 1)),
            "the next one is logged"
        );
        assert!(e.success("schedule", "shard 0", at(settled)).is_some());
    }

    #[test]
    fn a_sinks_other_warnings_join_its_open_outage_only() {
        let mut e = Episodes::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let kafka = Subject::Sink("kafka".to_owned());
        assert!(!e.absorb(&kafka, at(0)), "no outage: the warning is news");
        assert!(e.error("sink_unavailable", "kafka", at(10)));
        assert!(e.absorb(&kafka, at(20)), "counted into the outage");
        assert!(
            !e.absorb(&Subject::Sink("nats".to_owned()), at(20)),
            "another sink's outage does not hide it"
        );
        let settled = 20 + EPISODE_SETTLE.as_millis() as u64;
        assert_eq!(
            e.success("sink_unavailable", "kafka", at(settled - 1)),
            None,
            "an absorbed warning is an error of the episode: it settles after it"
        );
        assert_eq!(
            e.success("sink_unavailable", "kafka", at(settled)),
            Some(Closed {
                subject: kafka.clone(),
                errors: 2,
                lasted: Duration::from_millis(settled - 10)
            })
        );
        assert!(!e.absorb(&kafka, at(settled + 1)), "over: news again");
        assert!(e.error("sink_unavailable", "kafka", at(settled + 2)));
        let stale = settled + 2 + EPISODE_STALE.as_millis() as u64;
        assert!(!e.absorb(&kafka, at(stale)), "a stale outage hides nothing");
    }

    #[test]
    fn each_sink_has_its_own_episode_and_ends_it_when_it_works() {
        let mut e = Episodes::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(e.error("sink_unavailable", "kafka", at(0)), "kafka's opens");
        assert!(
            e.error("sink_unavailable", "rabbit", at(10)),
            "another sink's is news too"
        );
        for ms in (20..2_000).step_by(20) {
            assert!(
                !e.error("sink_unavailable", "kafka", at(ms)),
                "kafka at {ms}"
            );
            assert!(!e.error("sink_outcomes", "kafka", at(ms)), "any sink kind");
        }
        assert_eq!(
            e.success("sink_unavailable", "kafka", at(2_100)),
            None,
            "not settled yet"
        );
        let closed = e
            .success("sink_unavailable", "kafka", at(1_980) + EPISODE_SETTLE)
            .expect("kafka works: whatever failed before, its episode ends");
        assert_eq!(closed.subject, Subject::Sink("kafka".into()));
        assert_eq!(closed.errors, 1 + 2 * 99);
        assert!(
            e.error("sink_unavailable", "kafka", at(5_000)),
            "the next outage is logged"
        );
        assert_eq!(
            e.success("sink_unavailable", "rabbit", at(1_010) + EPISODE_SETTLE)
                .map(|c| (c.subject, c.errors)),
            Some((Subject::Sink("rabbit".into()), 1)),
            "rabbit's ends on its own"
        );
    }

    #[test]
    fn failures_in_quick_succession_are_one_episode() {
        let mut e = Episodes::new();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // Connections killed every 200 ms, each recovered from at once.
        assert!(e.error("redis", "shard 0", at(0)));
        for kill in 1..10 {
            assert_eq!(e.success("redis", "shard 0", at(kill * 200 - 150)), None);
            assert!(!e.error("redis", "shard 0", at(kill * 200)), "kill {kill}");
        }
        assert_eq!(
            e.success("redis", "shard 0", at(1850)),
            None,
            "not settled yet"
        );
        let closed = e.success("redis", "shard 0", at(1800) + EPISODE_SETTLE);
        assert_eq!(closed.map(|c| c.errors), Some(10));
    }

    #[test]
    fn what_fell_silent_does_not_hold_an_episode_open() {
        let mut e = Episodes::new();
        let t0 = Instant::now();
        assert!(e.error("redis", "shard 3", t0));
        // shard 3's task stopped without reporting success; shard 0 fails much later.
        let later = t0 + EPISODE_STALE + Duration::from_secs(1);
        assert!(e.error("redis", "shard 0", later), "a new episode, logged");
        let settled = later + EPISODE_SETTLE;
        assert!(e.success("redis", "shard 0", settled).is_some());
        assert!(e.error("redis", "shard 1", settled));
        let much_later = settled + EPISODE_STALE * 2;
        assert!(
            e.success("redis", "health check", much_later).is_some(),
            "any success ends it once what failed has been silent for long"
        );
    }
}
