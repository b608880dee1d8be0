//! The words of the job life cycle, shared by the client API and the store's script
//! wrappers: when a job is due, what an enqueue does with an existing id, and what became of
//! an enqueue, a cancel or a lookup.

use std::time::Duration;

/// When a job becomes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Epoch milliseconds (UTC).
    At(i64),
    /// After this delay, measured from Redis's clock when the enqueue runs.
    In(Duration),
}

impl Due {
    /// The scripts' form: epoch ms, or `+N` for N ms after Redis `TIME`.
    pub(crate) fn as_arg(self) -> String {
        match self {
            Due::At(ms) => ms.to_string(),
            Due::In(d) => format!("+{}", d.as_millis()),
        }
    }
}

/// A due time as a user writes it: epoch milliseconds, or RFC 3339
/// (`2026-11-21T14:03:07.250Z`); epoch ms.
pub fn parse_at(text: &str) -> Result<i64, String> {
    if let Ok(ms) = text.parse::<i64>() {
        return Ok(ms);
    }
    let t = humantime::parse_rfc3339_weak(text)
        .map_err(|e| format!("{e}: expected RFC 3339 or epoch milliseconds"))?;
    Ok(t.duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "before 1970".to_owned())?
        .as_millis() as i64)
}

/// What to do when the id being enqueued exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnConflict {
    /// Overwrite the job, whatever state it is in.
    #[default]
    Replace,
    /// Leave the existing job as it is and report `Kept`.
    Keep,
    /// Fail with `ClientError::Exists`.
    Error,
}

impl OnConflict {
    pub(crate) fn as_arg(self) -> &'static str {
        match self {
            OnConflict::Replace => "replace",
            OnConflict::Keep => "keep",
            OnConflict::Error => "error",
        }
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    Added,
    /// The id existed and was overwritten (`OnConflict::Replace`).
    Replaced,
    /// The id existed and was left as it was (`OnConflict::Keep`).
    Kept,
}

/// Outcome of `cancel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    Cancelled,
    /// Delivered, dead, or never enqueued.
    NotPending,
    /// Claimed by a two-phase sink: being delivered now.
    InFlight,
}

/// Where a job is. The same words as `zdelay stats`: a job is *scheduled* until its due time,
/// then *due* until the daemon takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Waiting for its due time.
    Scheduled,
    /// Due time passed; waiting for a poller.
    Due,
    /// Claimed by a two-phase sink: being delivered.
    #[serde(rename = "inflight")]
    InFlight,
    Dead,
    /// Stored but in no ZSET: an inconsistency an operator should look at.
    Orphan,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_takes_rfc3339_and_epoch_ms() {
        assert_eq!(parse_at("1700000000000"), Ok(1_700_000_000_000));
        assert_eq!(parse_at("2023-11-14T22:13:20.250Z"), Ok(1_700_000_000_250));
        assert!(parse_at("tomorrow").is_err());
    }

    #[test]
    fn due_args() {
        assert_eq!(Due::At(1_700_000_000_000).as_arg(), "1700000000000");
        assert_eq!(Due::In(Duration::from_millis(250)).as_arg(), "+250");
    }

    #[test]
    fn states_serialize_in_the_stats_vocabulary() {
        let names: Vec<String> = [
            JobState::Scheduled,
            JobState::Due,
            JobState::InFlight,
            JobState::Dead,
            JobState::Orphan,
        ]
        .iter()
        .map(|s| {
            serde_json::to_value(s)
                .unwrap()
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
        assert_eq!(names, ["scheduled", "due", "inflight", "dead", "orphan"]);
    }
}
