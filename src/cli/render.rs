//! What the CLI prints for people: times, the stats table, dead-letter lines.

use std::time::{Duration, UNIX_EPOCH};
use zdelay::DeadJob;
use zdelay::dead::DeadMember;
use zdelay::stats::{Forecast, Stats};

/// Epoch ms as RFC 3339 with milliseconds, UTC.
pub fn format_ms(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The table printed by `zdelay forecast`: one line per step (start, offset, count, the
/// schedules' occurrences, a bar, SPIKE), then what the spike threshold is.
pub fn forecast_table(f: &Forecast) -> String {
    let mut out = format!("overdue now: {} ({})\n", f.overdue, format_ms(f.now_ms));
    out.push_str(&format!(
        "{:<24} {:>8} {:>10} {:>9}\n",
        "step start", "in", "jobs", "schedules"
    ));
    let widest = f.steps.iter().map(|s| s.count).max().unwrap_or(0).max(1);
    for (i, step) in f.steps.iter().enumerate() {
        let offset = humantime::format_duration(Duration::from_millis(i as u64 * f.step_ms));
        let bar = "#".repeat(((step.count * 30).div_ceil(widest)) as usize);
        out.push_str(&format!(
            "{:<24} {:>8} {:>10} {:>9} {bar}{}\n",
            format_ms(step.start_ms),
            format!("+{offset}"),
            step.count,
            step.schedules,
            if step.spike { "  SPIKE" } else { "" }
        ));
    }
    match (f.delivery_rate_per_s, f.drain_per_step) {
        (Some(rate), Some(drain)) => out.push_str(&format!(
            "last hour's delivery rate: {rate:.1}/s, {drain} per step; SPIKE: a step holding more\n"
        )),
        _ => out.push_str("no deliveries recorded in the last hour: no spike threshold\n"),
    }
    out
}

/// The table printed by `zdelay stats`.
pub fn stats_table(stats: &Stats) -> String {
    let mut out = format!(
        "{:<24} {:>10} {:>10} {:>9} {:>8} {:>14}\n",
        "", "due now", "scheduled", "inflight", "dead", "oldest due ms"
    );
    let total = stats.total();
    for b in stats.shards.iter().chain(&stats.sources).chain([&total]) {
        out.push_str(&format!(
            "{:<24} {:>10} {:>10} {:>9} {:>8} {:>14}\n",
            b.name, b.due_now, b.scheduled, b.inflight, b.dead, b.oldest_due_age_ms
        ));
    }
    for sink in &stats.sinks {
        let age_s = (stats.now_ms as u64).saturating_sub(sink.at) / 1000;
        let state = match (&sink.up, &sink.error) {
            (true, _) => "up".to_owned(),
            (false, Some(e)) => format!("down: {e}"),
            (false, None) => "down".to_owned(),
        };
        let waiting = match stats.waiting.iter().find(|w| w.sink == sink.name) {
            Some(w) if w.jobs > 0 => format!(
                "; {} jobs waiting, the oldest due {} ms ago",
                w.jobs, w.oldest_age_ms
            ),
            _ => String::new(),
        };
        out.push_str(&format!(
            "sink {} ({}): {state} (checked {age_s}s ago){waiting}\n",
            sink.name, sink.kind
        ));
    }
    if stats.instances.is_empty() {
        out.push_str("instances: none running\n");
    }
    for i in &stats.instances {
        let polls = i
            .shards
            .iter()
            .map(|s| format!("shard {s}"))
            .chain(i.sources.iter().cloned())
            .collect::<Vec<_>>();
        let polls = if polls.is_empty() {
            "nothing".to_owned()
        } else {
            polls.join(", ")
        };
        out.push_str(&format!(
            "instance {} (seen {} ms ago): polls {polls}\n",
            i.id,
            (stats.now_ms - i.last_seen_ms).max(0)
        ));
    }
    for w in &stats.waiting {
        if w.jobs > 0 && !stats.sinks.iter().any(|s| s.name == w.sink) {
            out.push_str(&format!(
                "sink {}: not checked by any daemon yet; {} jobs waiting, the oldest due {} ms ago\n",
                w.sink, w.jobs, w.oldest_age_ms
            ));
        }
    }
    out
}

/// One dead envelope job, as `dead list` prints it.
pub fn dead_job_line(j: &DeadJob) -> String {
    format!(
        "{}  shard {}  died {}  {}",
        j.id,
        j.shard,
        format_ms(j.died_ms),
        j.reason
    )
}

/// A dead raw member as `dead list --json` shows it.
pub fn dead_member_json(source: &str, m: &DeadMember) -> serde_json::Value {
    serde_json::json!({
        "source": source,
        "payload": String::from_utf8_lossy(&m.member),
        "died_ms": m.died_ms,
        "reason": m.reason,
    })
}

/// One dead raw member, as `dead list` prints it.
pub fn dead_member_line(source: &str, m: &DeadMember) -> String {
    format!(
        "{}  died {}  {}  payload {}",
        source,
        format_ms(m.died_ms),
        m.reason,
        serde_json::Value::from(String::from_utf8_lossy(&m.member).into_owned())
    )
}
