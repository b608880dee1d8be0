//! What the CLI prints for people: times, the stats table, dead-letter lines.

use std::time::{Duration, UNIX_EPOCH};
use zdelay::dead::{DeadJob, DeadJobDetail, DeadMember, payload_preview};
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
        for (target, why) in &sink.held {
            out.push_str(&format!(
                "  held {target}: destination missing, its jobs wait: {why}\n"
            ));
        }
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
        if w.jobs == 0 || stats.sinks.iter().any(|s| s.name == w.sink) {
            continue;
        }
        let state = if w.configured {
            "not checked by any daemon yet"
        } else {
            "not configured (a running daemon refiles its jobs by their route now)"
        };
        out.push_str(&format!(
            "sink {}: {state}; {} jobs waiting, the oldest due {} ms ago\n",
            w.sink, w.jobs, w.oldest_age_ms
        ));
    }
    out
}

/// Payload bytes shown by `dead show`.
const PREVIEW: usize = 200;

/// Text on one line: line breaks (broker errors carry some) become spaces.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}

/// One dead envelope job, as `dead list` prints it.
pub fn dead_job_line(j: &DeadJob) -> String {
    let attempts = match j.max_attempts {
        Some(max) => format!("{}/{max}", j.attempt),
        None => j.attempt.to_string(),
    };
    let earlier = match j.earlier_deaths {
        0 => String::new(),
        n => format!("  (+{n} earlier)"),
    };
    format!(
        "{}  shard {}  died {}  route {}  attempts {attempts}  {}{earlier}",
        j.id,
        j.shard,
        format_ms(j.died_ms),
        j.route.as_deref().unwrap_or("-"),
        one_line(&j.reason)
    )
}

/// The preview as one quoted line: `"text"`, or `base64 …`, with `…` when cut.
/// A payload's first bytes `start` (of `total`) on one line, cut at [`PREVIEW`].
fn payload_line(start: &[u8], total: u64) -> String {
    let p = payload_preview(start, PREVIEW, total);
    let more = if p.truncated { " …" } else { "" };
    match p.encoding.as_str() {
        "base64" => format!("base64 {}{more}", p.text),
        _ => format!("{}{more}", serde_json::Value::from(p.text)),
    }
}

/// `dead show ID --json`.
pub fn dead_detail_json(d: &DeadJobDetail) -> serde_json::Value {
    d.to_json(PREVIEW)
}

/// `dead show ID`, for people.
pub fn dead_detail(d: &DeadJobDetail) -> String {
    let j = &d.job;
    let mut out = String::new();
    let mut row = |name: &str, value: String| out.push_str(&format!("{name:<11} {value}\n"));
    row("id", j.id.clone());
    row("shard", j.shard.to_string());
    row("died", format_ms(j.died_ms));
    row("reason", one_line(&j.reason));
    if let Some(e) = &j.envelope_error {
        row("envelope", e.clone());
    }
    if let Some(route) = &j.route {
        row("route", route.clone());
        row(
            "attempts",
            match j.max_attempts {
                Some(max) => format!("{} of at most {max}", j.attempt),
                None => format!("{} (at most poller.max_attempts)", j.attempt),
            },
        );
        row(
            "last error",
            j.last_error
                .as_deref()
                .map_or_else(|| "-".to_owned(), one_line),
        );
    }
    if let Some(schedule) = &j.schedule {
        row("schedule", schedule.clone());
    }
    if j.route.is_some() {
        row(
            "headers",
            if d.headers.is_empty() {
                "-".to_owned()
            } else {
                d.headers
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        );
        row(
            "payload",
            format!(
                "{} bytes: {}",
                j.payload_size.unwrap_or_default(),
                payload_line(&d.payload, j.payload_size.unwrap_or_default())
            ),
        );
    }
    if d.history.is_empty() {
        row("history", "no earlier deaths".to_owned());
    } else {
        row(
            "history",
            format!("{} earlier deaths, oldest first:", d.history.len()),
        );
        for death in &d.history {
            out.push_str(&format!(
                "  {}  {}\n",
                format_ms(death.died_ms),
                one_line(&death.reason)
            ));
        }
    }
    out
}

/// One dead raw member, as `dead list` prints it.
pub fn dead_member_line(source: &str, m: &DeadMember) -> String {
    format!(
        "{}  {}  died {}  {}  payload {} bytes: {}",
        source,
        m.id(),
        format_ms(m.died_ms),
        one_line(&m.reason),
        m.size,
        payload_line(&m.preview, m.size)
    )
}

/// `dead show --source KEY ID --json`.
pub fn dead_member_detail_json(source: &str, m: &DeadMember) -> serde_json::Value {
    m.detail_json(source, PREVIEW)
}

/// `dead show --source KEY ID`, for people.
pub fn dead_member_detail(source: &str, m: &DeadMember) -> String {
    let message_id = m
        .message_id(source)
        .unwrap_or_else(|| "- (a member over 1 MiB: its hash is not its SHA-1's)".to_owned());
    format!(
        "{:<11} {source}\n{:<11} {}\n{:<11} {}\n{:<11} {}\n{:<11} {}\n{:<11} {} bytes: {}\n",
        "source",
        "id",
        m.id(),
        "message id",
        message_id,
        "died",
        format_ms(m.died_ms),
        "reason",
        one_line(&m.reason),
        "payload",
        m.size,
        payload_line(&m.preview, m.size)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_lines_quote_text_and_name_base64() {
        assert_eq!(payload_line(&[0xff, 0x00], 2), "base64 /wA=");
        assert_eq!(payload_line(b"a\"b", 3), "\"a\\\"b\"");
        assert!(payload_line("x".repeat(300).as_bytes(), 300).ends_with("\" …"));
        assert!(
            payload_line(b"xx", 5000).ends_with("\" …"),
            "only the start was read"
        );
    }
}
