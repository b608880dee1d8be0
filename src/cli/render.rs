//! What the CLI prints for people: times, the stats table, dead-letter lines.

use std::time::{Duration, UNIX_EPOCH};
use zdelay::dead::{DeadJob, DeadJobDetail, DeadMember, payload_preview};
use zdelay::stats::{Backlog, Forecast, Stats};

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
    for (route, limit) in &f.route_limits {
        out.push_str(&format!(
            "route {route} is limited to {:.1}/s, {} per step: overdue clears in {}; {} step(s) \
             over its rate, spread by the limit\n",
            limit.rate_per_s,
            limit.drain_per_step,
            duration(limit.overdue_clears_in_ms),
            limit.over_rate_steps.len()
        ));
    }
    out
}

/// A duration for people: its two largest units, no spaces ("3m12s", "250ms", "2d4h").
pub fn duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let units = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ];
    let mut out = String::new();
    let mut rest = ms;
    let mut shown = 0;
    for (name, size) in units {
        let n = rest / size;
        rest %= size;
        if n > 0 || shown > 0 {
            if n > 0 {
                out.push_str(&format!("{n}{name}"));
            }
            shown += 1;
            if shown == 2 {
                break;
            }
        }
    }
    out
}

/// Shard numbers as ranges: "0-7, 9".
fn shard_ranges(shards: &[u16]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < shards.len() {
        let start = shards[i];
        let mut end = start;
        while i + 1 < shards.len() && shards[i + 1] == end + 1 {
            i += 1;
            end = shards[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(", ")
}

/// "N due now (the oldest 3m12s overdue), N scheduled, N in flight, N dead".
fn backlog_text(b: &Backlog) -> String {
    let oldest = if b.due_now > 0 {
        format!(" (the oldest {} overdue)", duration(b.oldest_due_age_ms))
    } else {
        String::new()
    };
    format!(
        "{} due now{oldest}, {} scheduled, {} in flight, {} dead",
        b.due_now, b.scheduled, b.inflight, b.dead
    )
}

/// What `zdelay stats` prints: totals, one line per raw source, sink and daemon; with
/// `shards`, also the per-shard table.
pub fn stats_text(stats: &Stats, shards: bool) -> String {
    let total = stats.total();
    let mut out = format!("total: {}\n", backlog_text(&total));
    if shards {
        out.push_str(&format!(
            "{:<24} {:>10} {:>10} {:>9} {:>8} {:>12}\n",
            "", "due now", "scheduled", "inflight", "dead", "oldest due"
        ));
        for b in &stats.shards {
            out.push_str(&format!(
                "{:<24} {:>10} {:>10} {:>9} {:>8} {:>12}\n",
                b.name,
                b.due_now,
                b.scheduled,
                b.inflight,
                b.dead,
                if b.due_now > 0 {
                    duration(b.oldest_due_age_ms)
                } else {
                    "-".to_owned()
                }
            ));
        }
    } else if !stats.shards.is_empty() {
        out.push_str(&format!(
            "shards: {} (one row each: --shards)\n",
            stats.shards.len()
        ));
    }
    for b in &stats.sources {
        out.push_str(&format!("source {}: {}\n", b.name, backlog_text(b)));
    }
    for b in &stats.lanes {
        out.push_str(&format!("route lane {}: {}\n", b.name, backlog_text(b)));
    }
    for sink in &stats.sinks {
        let age_ms = (stats.now_ms as u64).saturating_sub(sink.at);
        let state = match (&sink.up, &sink.error) {
            (true, _) => "up".to_owned(),
            (false, Some(e)) => format!("down: {e}"),
            (false, None) => "down".to_owned(),
        };
        let waiting = match stats.waiting.iter().find(|w| w.sink == sink.name) {
            Some(w) if w.jobs > 0 => format!(
                "; {} jobs waiting, the oldest due {} ago",
                w.jobs,
                duration(w.oldest_age_ms)
            ),
            _ => String::new(),
        };
        out.push_str(&format!(
            "sink {} ({}): {state} (checked {} ago){waiting}\n",
            sink.name,
            sink.kind,
            duration(age_ms)
        ));
        for (target, why) in &sink.held {
            out.push_str(&format!(
                "  held {target}: destination missing, its jobs wait: {why}\n"
            ));
        }
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
            "sink {}: {state}; {} jobs waiting, the oldest due {} ago\n",
            w.sink,
            w.jobs,
            duration(w.oldest_age_ms)
        ));
    }
    for f in &stats.flow {
        let limits: Vec<String> = f
            .rate
            .iter()
            .map(|r| format!("rate {r}"))
            .chain(f.max_length.map(|n| format!("max_length {n}")))
            .collect();
        let state = match f.held_since_ms {
            Some(since) => format!(
                "held for {}",
                duration(stats.now_ms.saturating_sub(since).max(0) as u64)
            ),
            None => "flowing".to_owned(),
        };
        out.push_str(&format!(
            "route {} ({}): {state}\n",
            f.route,
            limits.join(", ")
        ));
    }
    if stats.instances.is_empty() {
        out.push_str("instances: none running\n");
    }
    for i in &stats.instances {
        let mut polls = Vec::new();
        if !i.shards.is_empty() {
            polls.push(format!("shards {}", shard_ranges(&i.shards)));
        }
        polls.extend(i.sources.iter().cloned());
        let polls = if polls.is_empty() {
            "nothing".to_owned()
        } else {
            polls.join(", ")
        };
        let version = i
            .version
            .as_deref()
            .map_or(String::new(), |v| format!("zdelay {v}, "));
        out.push_str(&format!(
            "instance {} ({version}seen {} ago): polls {polls}\n",
            i.id,
            duration((stats.now_ms - i.last_seen_ms).max(0) as u64)
        ));
    }
    out
}

/// What `zdelay get` prints for people: one field a line, times as RFC 3339 with how far
/// from `now_ms` (the namespace's clock), the payload as text (or base64, as stored).
pub fn job_text(job: &serde_json::Value, now_ms: i64) -> String {
    let mut out = String::new();
    let Some(fields) = job.as_object() else {
        return format!("{job}\n");
    };
    // The identity first, then the rest in the JSON's order; the envelope's format version
    // ("v") is for programs only.
    let first = ["id", "state", "dest", "due", "lease_deadline", "died"];
    let keys: Vec<String> = first
        .iter()
        .filter(|k| fields.contains_key(**k))
        .map(|k| k.to_string())
        .chain(
            fields
                .keys()
                .filter(|k| !first.contains(&k.as_str()) && k.as_str() != "v")
                .cloned(),
        )
        .collect();
    let width = keys.iter().map(String::len).max().unwrap_or(0);
    for key in keys {
        let value = &fields[&key];
        let text = match (key.as_str(), value) {
            ("due" | "lease_deadline" | "died", serde_json::Value::Number(n)) => {
                let ms = n.as_i64().unwrap_or_default();
                let when = if ms >= now_ms {
                    format!("in {}", duration((ms - now_ms) as u64))
                } else {
                    format!("{} ago", duration((now_ms - ms) as u64))
                };
                format!("{} ({when})", format_ms(ms))
            }
            (_, serde_json::Value::String(text)) => one_line(text),
            (_, serde_json::Value::Object(map)) if map.is_empty() => "-".to_owned(),
            (_, serde_json::Value::Object(map)) => map
                .iter()
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => format!("{k}={s}"),
                    other => format!("{k}={other}"),
                })
                .collect::<Vec<_>>()
                .join(", "),
            (_, serde_json::Value::Null) => "-".to_owned(),
            (_, other) => other.to_string(),
        };
        out.push_str(&format!("{key:<width$}  {text}\n"));
    }
    out
}

/// Payload bytes shown by `dead show`.
const PREVIEW: usize = 200;

/// Text on one line: line breaks (broker errors carry some) become spaces.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}

/// Where a dead job is kept: `shard <n>`, or `lane <n>` on storage layout 2.
fn dead_place(j: &DeadJob) -> [String; 2] {
    match j.lane {
        Some(lane) => ["lane".into(), zdelay::lane_id::base36(lane)],
        None => ["shard".into(), j.shard.to_string()],
    }
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
        "{}  {}  died {}  route {}  attempts {attempts}  {}{earlier}",
        j.id,
        dead_place(j).join(" "),
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
    let [name, value] = dead_place(j);
    row(&name, value);
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
    fn durations_read_as_durations() {
        assert_eq!(duration(0), "0ms");
        assert_eq!(duration(250), "250ms");
        assert_eq!(duration(1000), "1s");
        assert_eq!(duration(192_000), "3m12s");
        assert_eq!(duration(3_600_000), "1h");
        assert_eq!(duration(3_601_000), "1h");
        assert_eq!(duration(3_660_000), "1h1m");
        assert_eq!(duration(2 * 86_400_000 + 4 * 3_600_000 + 5000), "2d4h");
    }

    #[test]
    fn shard_lists_read_as_ranges() {
        assert_eq!(shard_ranges(&[0, 1, 2, 3, 5, 7, 8]), "0-3, 5, 7-8");
        assert_eq!(shard_ranges(&[4]), "4");
        assert_eq!(shard_ranges(&[]), "");
    }

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
