//! The JSON form of a job: one object per line of `zdelay enqueue --batch`, and the body of the
//! HTTP enqueue (`POST /api/jobs`): one place for its fields and their checks.

use super::NewJob;
use crate::envelope::payload_from_json;
use crate::job::{Due, TimeArg};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::time::Duration;

/// A job as one JSON object: a line of `zdelay enqueue --batch` and the body of the HTTP
/// `POST /api/jobs`. `payload_encoding` is `utf8` (default) or `base64`; `at` is epoch ms or
/// RFC 3339 text (`job::parse_at`),
/// `in`, `max_lateness`, `spread` and `unique_for` are durations (`"250ms"`, `"1h"`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobLine {
    dest: String,
    payload: String,
    #[serde(default)]
    payload_encoding: Option<String>,
    #[serde(default)]
    at: Option<TimeArg>,
    #[serde(default, rename = "in", with = "humantime_serde")]
    delay: Option<Duration>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    max_attempts: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    max_lateness: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    spread: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    unique_for: Option<Duration>,
}

/// Parses one JSON object whose `headers` map names to strings, naming the first header
/// that is not a string (serde would say only "expected a string" and where).
pub(crate) fn from_json_with_headers<T: DeserializeOwned>(line: &str) -> Result<T, String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    if let Some((name, v)) = value
        .get("headers")
        .and_then(|h| h.as_object())
        .and_then(|h| h.iter().find(|(_, v)| !v.is_string()))
    {
        return Err(format!(
            "headers.{name}: header values must be strings, got {v}"
        ));
    }
    serde_json::from_value(value).map_err(|e| e.to_string())
}

impl NewJob {
    /// A job from its JSON form ([`JobLine`]); the error names what is wrong.
    pub fn from_json_line(line: &str) -> Result<NewJob, String> {
        let l: JobLine = from_json_with_headers(line)?;
        let payload = payload_from_json(l.payload, l.payload_encoding.as_deref())?;
        let mut job = NewJob::new(l.dest, payload);
        job.due = match (l.at, l.delay) {
            (Some(_), Some(_)) => return Err("give \"at\" or \"in\", not both".into()),
            (Some(at), None) => Due::At(at.ms("at")?),
            (None, Some(d)) => Due::In(d),
            (None, None) => Due::In(Duration::ZERO),
        };
        job.id = l.id;
        job.headers = l.headers;
        job.max_attempts = l.max_attempts;
        job.max_lateness = l.max_lateness;
        job.spread = l.spread;
        job.unique_for = l.unique_for;
        Ok(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_is_epoch_ms_or_rfc3339_text() {
        let due = |line: &str| NewJob::from_json_line(line).map(|j| j.due);
        assert_eq!(
            due(r#"{"dest":"q","payload":"x","at":1700000000000}"#),
            Ok(Due::At(1_700_000_000_000))
        );
        assert_eq!(
            due(r#"{"dest":"q","payload":"x","at":"2023-11-15T03:13:20.250+05:00"}"#),
            Ok(Due::At(1_700_000_000_250))
        );
        let err = due(r#"{"dest":"q","payload":"x","at":"2023-11-15T03:13:20"}"#).unwrap_err();
        assert!(
            err.starts_with("at: ") && err.contains("no UTC offset"),
            "{err}"
        );
        let err = due(r#"{"dest":"q","payload":"x","at":1700000000}"#).unwrap_err();
        assert!(err.contains("looks like epoch seconds"), "{err}");
    }
}
