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

/// Epoch milliseconds that read as epoch *seconds*: as ms they are 1970-01-12 … 1973-03-03,
/// when nobody schedules a job, while a seconds timestamp of 2001 … 5138 falls here. Refused
/// (a job would be delivered at once); raw sources send such scores to dead (`move_raw.lua`).
pub const SECONDS_LIKE_MS: std::ops::Range<i64> = 1_000_000_000..100_000_000_000;

/// `ms` unless it looks like epoch seconds; the message shows the time likely meant.
pub fn check_epoch_ms(ms: i64) -> Result<i64, String> {
    if !SECONDS_LIKE_MS.contains(&ms) {
        return Ok(ms);
    }
    let meant = std::time::UNIX_EPOCH + Duration::from_secs(ms as u64);
    Err(format!(
        "{ms} looks like epoch seconds ({} if so): due times are epoch milliseconds \
         ({ms}000) or RFC 3339",
        humantime::format_rfc3339(meant)
    ))
}

/// A due time as a user writes it: epoch milliseconds, or RFC 3339
/// (`2026-11-21T14:03:07.250Z`); epoch ms. Seconds-looking numbers are refused.
pub fn parse_at(text: &str) -> Result<i64, String> {
    if let Ok(ms) = text.parse::<i64>() {
        return check_epoch_ms(ms);
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
    /// Replace the job, but a job still waiting keeps its due time no later than its first
    /// enqueue plus `max_wait`: each enqueue pushes it later (to the new due time), up to
    /// that point. A job not waiting (dead, or being delivered) is replaced and starts a
    /// window of its own.
    Debounce { max_wait: Duration },
}

impl OnConflict {
    /// The scripts' form (`enqueue_jobs.lua`): the policy, then ` unique <ms>` when the jobs
    /// of the call are remembered for a window after they leave.
    pub(crate) fn as_arg(self, unique_for_ms: Option<u64>) -> String {
        let policy = match self {
            OnConflict::Replace => "replace".to_owned(),
            OnConflict::Keep => "keep".to_owned(),
            OnConflict::Error => "error".to_owned(),
            OnConflict::Debounce { max_wait } => format!("debounce {}", max_wait.as_millis()),
        };
        match unique_for_ms {
            Some(ms) => format!("{policy} unique {ms}"),
            None => policy,
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
    /// The id was delivered or died within the unique window it was enqueued with
    /// (`NewJob::unique_for`): nothing was written.
    Duplicate,
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
    fn policies_are_sent_as_the_scripts_read_them() {
        assert_eq!(OnConflict::Keep.as_arg(None), "keep");
        assert_eq!(
            OnConflict::Replace.as_arg(Some(3_600_000)),
            "replace unique 3600000"
        );
        let debounce = OnConflict::Debounce {
            max_wait: Duration::from_secs(60),
        };
        assert_eq!(debounce.as_arg(None), "debounce 60000");
        assert_eq!(debounce.as_arg(Some(5)), "debounce 60000 unique 5");
    }

    #[test]
    fn at_takes_rfc3339_and_epoch_ms() {
        assert_eq!(parse_at("1700000000000"), Ok(1_700_000_000_000));
        assert_eq!(parse_at("2023-11-14T22:13:20.250Z"), Ok(1_700_000_000_250));
        assert!(parse_at("tomorrow").is_err());
        // "Due now" in the past stays accepted.
        assert_eq!(parse_at("0"), Ok(0));
        assert_eq!(parse_at("1"), Ok(1));
    }

    #[test]
    fn seconds_looking_times_are_refused_showing_the_likely_time() {
        let err = parse_at("1795250000").unwrap_err();
        assert!(err.contains("looks like epoch seconds"), "{err}");
        assert!(err.contains("2026-11-21T08:33:20Z"), "{err}");
        assert!(err.contains("1795250000000"), "{err}");
        assert!(check_epoch_ms(999_999_999).is_ok());
        assert!(check_epoch_ms(1_000_000_000).is_err());
        assert!(check_epoch_ms(99_999_999_999).is_err());
        assert!(check_epoch_ms(100_000_000_000).is_ok());
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
