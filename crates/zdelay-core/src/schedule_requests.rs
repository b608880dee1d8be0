//! Schedules asked for as JSON, and the schedule requests daemons apply.
//!
//! The JSON form of a schedule is one object: a line of `zdelay schedule set --batch`, and
//! what a producer in another language sends with the protocol's `zd2_schedule`. A producer
//! cannot plan a cron occurrence the way the daemon fires it (croner, IANA zones), so its
//! set, pause, resume and delete are requests: `schedule_request.lua` merges them per
//! schedule id into `{ns}:sched_requests`, and a daemon applies them here through the same
//! [`Client`] calls `zdelay schedule` makes, then records the outcome in `{ns}:sched_results`
//! for the producer waiting on it. One daemon at a time applies them (a lock), so the
//! requests of one schedule are applied in the order they were asked.

use crate::client::json_job::from_json_with_headers;
use crate::client::{Client, ClientError};
use crate::envelope::payload_from_json;
use crate::job::TimeArg;
use crate::schedule::{DEFAULT_MAX_CATCH_UP, Misfire};
use crate::schedules::{NewSchedule, Repeat};
use crate::store::{self, scripts};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Requests applied per call of [`apply_requests`].
pub const REQUESTS_PER_CALL: usize = 100;
/// How long an outcome is kept for its producer to read.
pub const RESULT_RETENTION: Duration = Duration::from_secs(3600);
/// How long the applying daemon holds the lock at most (a daemon that dies holding it
/// delays requests by this much).
const LOCK_FOR: Duration = Duration::from_secs(30);

/// How missed occurrences are handled, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MisfireName {
    Coalesce,
    Skip,
    CatchUp,
}

impl Misfire {
    /// The policy named, with `max_catch_up` for `catch_up` only.
    pub fn from_name(name: MisfireName, max_catch_up: Option<u32>) -> Result<Misfire, String> {
        match (name, max_catch_up) {
            (MisfireName::CatchUp, max) => Ok(Misfire::CatchUp {
                max: max.unwrap_or(DEFAULT_MAX_CATCH_UP),
            }),
            (_, Some(_)) => Err("max_catch_up applies to misfire catch_up only".into()),
            (MisfireName::Coalesce, None) => Ok(Misfire::Coalesce),
            (MisfireName::Skip, None) => Ok(Misfire::Skip),
        }
    }
}

impl Repeat {
    /// Exactly one of a cron expression (in `tz`, default UTC) and an interval.
    pub fn from_parts(
        cron: Option<String>,
        every: Option<Duration>,
        tz: Option<String>,
    ) -> Result<Repeat, String> {
        match (cron, every, tz) {
            (Some(expr), None, tz) => Ok(Repeat::Cron {
                expr,
                tz: tz.unwrap_or_else(|| "UTC".to_owned()),
            }),
            (None, Some(every), None) => Ok(Repeat::Every(every)),
            (None, Some(_), Some(_)) => Err("tz applies to cron only".into()),
            (Some(_), Some(_), _) => Err("give cron or every, not both".into()),
            (None, None, _) => Err("give cron or every".into()),
        }
    }
}

/// A schedule as one JSON object. `every`, `max_lateness` and `jitter` are durations (`"250ms"`,
/// `"1h"`), `start_at`/`end_at` epoch ms or RFC 3339 text (`job::parse_at`), `payload_encoding` `utf8` (default) or `base64`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleLine {
    id: String,
    dest: String,
    #[serde(default)]
    cron: Option<String>,
    #[serde(default, with = "humantime_serde")]
    every: Option<Duration>,
    #[serde(default)]
    tz: Option<String>,
    payload: String,
    #[serde(default)]
    payload_encoding: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    misfire: Option<MisfireName>,
    #[serde(default)]
    max_catch_up: Option<u32>,
    #[serde(default)]
    start_at: Option<TimeArg>,
    #[serde(default)]
    end_at: Option<TimeArg>,
    #[serde(default, with = "humantime_serde")]
    max_lateness: Option<Duration>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    jitter: Option<Duration>,
    #[serde(default)]
    calendar: Option<String>,
    #[serde(default)]
    shift: Option<String>,
}

impl NewSchedule {
    /// A schedule from its JSON form; the error names what is wrong. The recurrence itself
    /// (cron syntax, zone, window) is checked by [`Client::schedule_set`].
    pub fn from_json_line(line: &str) -> Result<NewSchedule, String> {
        let l: ScheduleLine = from_json_with_headers(line)?;
        let payload = payload_from_json(l.payload, l.payload_encoding.as_deref())?;
        let mut spec = NewSchedule::new(
            l.id,
            l.dest,
            payload,
            Repeat::from_parts(l.cron, l.every, l.tz)?,
        );
        spec.headers = l.headers;
        spec.misfire =
            Misfire::from_name(l.misfire.unwrap_or(MisfireName::Coalesce), l.max_catch_up)?;
        spec.start_at = l.start_at.map(|t| t.ms("start_at")).transpose()?;
        spec.end_at = l.end_at.map(|t| t.ms("end_at")).transpose()?;
        spec.max_lateness = l.max_lateness;
        spec.max_attempts = l.max_attempts;
        spec.jitter = l.jitter;
        spec.calendar = match (l.calendar, l.shift) {
            (Some(name), shift) => Some(crate::calendars::CalendarChoice {
                name,
                shift: shift.as_deref().map_or(
                    Ok(crate::calendar::Shift::Skip),
                    crate::calendar::Shift::from_name,
                )?,
            }),
            (None, Some(_)) => return Err("shift: needs a calendar".into()),
            (None, None) => None,
        };
        Ok(spec)
    }
}

/// The requests of one schedule not applied yet, as `schedule_request.lua` merged them.
#[derive(Debug, Default, Deserialize)]
struct Request {
    seq: u64,
    #[serde(default)]
    delete: bool,
    /// The schedule's JSON form.
    #[serde(default)]
    set: Option<String>,
    #[serde(default)]
    paused: Option<bool>,
}

/// What [`apply_requests`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Requests applied, with their outcome recorded.
    pub applied: usize,
    /// Of those, refused (the outcome names why).
    pub refused: usize,
    /// Left for later: Redis failed or the schedule was busy.
    pub deferred: usize,
    /// Why the last of those was left.
    pub deferred_why: Option<String>,
}

/// Applies what is waiting in `{ns}:sched_requests`, at most [`REQUESTS_PER_CALL`], unless
/// another daemon is applying them now. A request that fails for a passing reason (Redis,
/// a reshard, a busy schedule) stays for the next call; one that cannot succeed (a bad
/// definition, an unknown destination) is answered with why and removed.
pub async fn apply_requests(client: &Client, holder: &str) -> Result<Applied, ClientError> {
    let keys = client.keys();
    let mut con = client.con.clone();
    let (lock, requests) = (keys.schedule_requests_lock(), keys.schedule_requests());
    let taken: Option<String> = redis::cmd("SET")
        .arg(&lock)
        .arg(holder)
        .arg("NX")
        .arg("PX")
        .arg(LOCK_FOR.as_millis() as u64)
        .query_async(&mut con)
        .await?;
    if taken.is_none() {
        return Ok(Applied::default());
    }
    let result = async {
        let (_, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&requests)
            .arg(0)
            .arg("COUNT")
            .arg(REQUESTS_PER_CALL)
            .query_async(&mut con)
            .await?;
        let mut applied = Applied::default();
        // One clock read stamps the call's outcomes: it only dates them for pruning.
        let at = store::server_time_ms(&mut con).await?;
        for (id, text) in page.into_iter().take(REQUESTS_PER_CALL) {
            let request: Result<Request, _> = serde_json::from_str(&text);
            let seq = request.as_ref().map_or(0, |r| r.seq);
            let outcome = match request {
                Ok(request) => apply_one(client, &id, &request).await,
                Err(e) => Err(ClientError::InvalidSchedule(format!(
                    "unreadable request: {e}"
                ))),
            };
            let outcome = match outcome {
                Err(e) if e.is_retryable() || matches!(e, ClientError::Contended(_)) => {
                    applied.deferred += 1;
                    applied.deferred_why = Some(format!("schedule {id}: {e}"));
                    continue;
                }
                Err(e) => {
                    applied.refused += 1;
                    serde_json::json!({ "ok": false, "error": e.to_string() })
                }
                Ok(state) => state,
            };
            let mut outcome = outcome;
            outcome["seq"] = seq.into();
            outcome["at"] = at.into();
            scripts::schedule_request_done(&mut con, &keys, &id, seq, &outcome.to_string()).await?;
            applied.applied += 1;
        }
        Ok(applied)
    }
    .await;
    // A failed release leaves the lock to expire.
    let _ = scripts::unlock(&mut con, &lock, holder).await;
    result
}

/// Applies one schedule's requests in their order (delete, set, pause or resume); the
/// schedule's state after them.
async fn apply_one(
    client: &Client,
    id: &str,
    request: &Request,
) -> Result<serde_json::Value, ClientError> {
    if request.delete {
        client.schedule_delete(id).await?;
    }
    if let Some(line) = &request.set {
        let spec = NewSchedule::from_json_line(line).map_err(ClientError::InvalidSchedule)?;
        if spec.id != id {
            return Err(ClientError::InvalidSchedule(format!(
                "id: the schedule's id {:?} is not the id the request was made for",
                spec.id
            )));
        }
        client.schedule_set(spec).await?;
    }
    match request.paused {
        Some(true) => drop(client.schedule_pause(id).await?),
        Some(false) => drop(client.schedule_resume(id).await?),
        None => {}
    }
    Ok(match client.schedule_get(id).await? {
        Some(view) => serde_json::json!({
            "ok": true,
            "exists": true,
            "paused": view.paused,
            "next_ms": view.next_ms,
            "version": view.version,
        }),
        None => serde_json::json!({ "ok": true, "exists": false }),
    })
}

/// Removes outcomes older than [`RESULT_RETENTION`] (their producers have read them or
/// stopped waiting); how many.
pub async fn prune_results(client: &Client) -> Result<usize, ClientError> {
    let results = client.keys().schedule_results();
    let mut con = client.con.clone();
    let now = store::server_time_ms(&mut con).await?;
    let oldest = now - RESULT_RETENTION.as_millis() as i64;
    let (mut cursor, mut pruned) = (0u64, 0);
    loop {
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(&results)
            .arg(cursor)
            .arg("COUNT")
            .arg(500)
            .query_async(&mut con)
            .await?;
        let old: Vec<&String> = page
            .iter()
            .filter(|(id, text)| {
                !id.is_empty()
                    && serde_json::from_str::<serde_json::Value>(text)
                        .ok()
                        .and_then(|v| v["at"].as_i64())
                        .is_none_or(|at| at < oldest)
            })
            .map(|(id, _)| id)
            .collect();
        if !old.is_empty() {
            let n: usize = redis::cmd("HDEL")
                .arg(&results)
                .arg(&old)
                .query_async(&mut con)
                .await?;
            pruned += n;
        }
        if next == 0 {
            return Ok(pruned);
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::Repeat;

    #[test]
    fn batch_lines_parse_or_say_why() {
        let spec = NewSchedule::from_json_line(
            r#"{"id":"r","dest":"q","cron":"0 9 * * 1-5","tz":"Europe/Paris","payload":"x","misfire":"catch_up","max_catch_up":5}"#,
        )
        .unwrap();
        assert_eq!(spec.misfire, Misfire::CatchUp { max: 5 });
        assert!(matches!(spec.repeat, Repeat::Cron { ref tz, .. } if tz == "Europe/Paris"));
        let spec =
            NewSchedule::from_json_line(r#"{"id":"e","dest":"q","every":"250ms","payload":"x"}"#)
                .unwrap();
        assert_eq!(spec.repeat, Repeat::Every(Duration::from_millis(250)));
        let spec = NewSchedule::from_json_line(
            r#"{"id":"w","dest":"q","every":"1h","payload":"x","start_at":"2023-11-15T03:13:20+05:00","end_at":1800000000000}"#,
        )
        .unwrap();
        assert_eq!(
            (spec.start_at, spec.end_at),
            (Some(1_700_000_000_000), Some(1_800_000_000_000))
        );
        let spec = NewSchedule::from_json_line(
            r#"{"id":"c","dest":"q","cron":"0 18 L * *","payload":"x","calendar":"fr","shift":"previous"}"#,
        )
        .unwrap();
        assert_eq!(
            spec.calendar,
            Some(crate::calendars::CalendarChoice {
                name: "fr".into(),
                shift: crate::calendar::Shift::Previous
            })
        );
        for (bad, why) in [
            (
                r#"{"id":"b","dest":"q","cron":"0 9 * * *","payload":"x","calendar":"fr","shift":"later"}"#,
                "shift: \"later\"",
            ),
            (
                r#"{"id":"b","dest":"q","cron":"0 9 * * *","payload":"x","shift":"next"}"#,
                "shift: needs a calendar",
            ),
            (r#"{"id":"b","dest":"q","payload":"x"}"#, "cron or every"),
            (
                r#"{"id":"b","dest":"q","cron":"* * * * *","every":"1s","payload":"x"}"#,
                "not both",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","tz":"UTC","payload":"x"}"#,
                "cron only",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","max_catch_up":3}"#,
                "catch_up only",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","x":1}"#,
                "unknown field",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","headers":{"n":1}}"#,
                "headers.n",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","start_at":1764000000}"#,
                "seconds",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","end_at":"2030-01-01T00:00:00"}"#,
                "end_at: \"2030-01-01T00:00:00\" has no UTC offset",
            ),
            (
                r#"{"id":"b","dest":"q","every":"1s","payload":"x","misfire":"later"}"#,
                "unknown variant",
            ),
        ] {
            let err = NewSchedule::from_json_line(bad).map(|_| ()).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }
}
