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
    let meant = jiff::Timestamp::from_second(ms).map_or_else(|_| "?".to_owned(), |t| t.to_string());
    Err(format!(
        "{ms} looks like epoch seconds ({meant} if so): due times are epoch milliseconds \
         ({ms}000) or RFC 3339"
    ))
}

/// Every time a user types — `--at`, `--start-at`, `--end-at`, `--from`, `dead replay --at`,
/// the `at`, `start_at` and `end_at` of JSON lines and HTTP bodies — as epoch milliseconds.
///
/// Takes epoch milliseconds (digits; seconds-looking numbers are refused, see
/// [`check_epoch_ms`]) or an RFC 3339 time with `Z` or a UTC offset
/// (`2026-12-01T09:00:00+01:00`, `2026-11-21T14:03:07.250Z`), read by `jiff` (which also
/// takes `t` or a space for `T`, `z` for `Z`, and the RFC 9557 / ISO 8601 forms of the same).
/// A time without an offset is refused rather than guessed: UTC and the local zone would
/// both be wrong for someone. Fractions finer than a millisecond are cut off (`.2509Z` is
/// `.250Z`): due times are kept in milliseconds, and a job is never due later than asked.
pub fn parse_at(text: &str) -> Result<i64, String> {
    let text = text.trim();
    let digits = text.strip_prefix('-').unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        let ms = text
            .parse::<i64>()
            .map_err(|_| format!("{text} is out of range for epoch milliseconds"))?;
        return check_epoch_ms(ms);
    }
    match text.parse::<jiff::Timestamp>() {
        Ok(t) if t < jiff::Timestamp::UNIX_EPOCH => Err(format!(
            "{text} is before 1970-01-01T00:00:00Z: due times are from 1970 on"
        )),
        // Whole milliseconds, floored (jiff truncates toward zero; from 1970 on the same).
        Ok(t) => Ok(t.as_millisecond()),
        Err(_) if text.parse::<jiff::civil::DateTime>().is_ok() => {
            let full = with_time_of_day(text);
            Err(format!(
                "{text:?} has no UTC offset: add Z for UTC or the offset meant \
                 ({full}Z, {full}+01:00, …)"
            ))
        }
        Err(e) => Err(format!(
            "{text:?} is not a time: expected RFC 3339 with Z or an offset \
             (2026-12-01T09:00:00+01:00, 2026-11-21T14:03:07.250Z) or epoch milliseconds ({e})"
        )),
    }
}

/// `text` as the start of a suggestion: a date alone gets a midnight.
fn with_time_of_day(text: &str) -> String {
    if text.len() == 10 {
        format!("{text}T00:00:00")
    } else {
        text.to_owned()
    }
}

/// A time in a JSON body (`at`, `start_at`, `end_at`): epoch milliseconds as a number, or
/// text as [`parse_at`] reads it. Resolved by [`TimeArg::ms`], whose error names the field.
#[derive(Debug, Clone, PartialEq)]
pub enum TimeArg {
    Ms(i64),
    Text(String),
}

impl TimeArg {
    /// Epoch ms; the error starts with `field`.
    pub fn ms(&self, field: &str) -> Result<i64, String> {
        match self {
            TimeArg::Ms(ms) => check_epoch_ms(*ms),
            TimeArg::Text(text) => parse_at(text),
        }
        .map_err(|e| format!("{field}: {e}"))
    }
}

impl<'de> serde::Deserialize<'de> for TimeArg {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = TimeArg;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("epoch milliseconds (a whole number) or an RFC 3339 time (text)")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<TimeArg, E> {
                Ok(TimeArg::Ms(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<TimeArg, E> {
                i64::try_from(v)
                    .map(TimeArg::Ms)
                    .map_err(|_| E::custom(format!("{v} is out of range for epoch milliseconds")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TimeArg, E> {
                Ok(TimeArg::Text(v.to_owned()))
            }
        }
        d.deserialize_any(Visit)
    }
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
    /// of the call are remembered for a window after they leave, then ` clock <ms>` on a
    /// namespace with a test clock (its offset).
    pub(crate) fn as_arg(self, unique_for_ms: Option<u64>, clock_offset_ms: Option<i64>) -> String {
        let policy = match self {
            OnConflict::Replace => "replace".to_owned(),
            OnConflict::Keep => "keep".to_owned(),
            OnConflict::Error => "error".to_owned(),
            OnConflict::Debounce { max_wait } => format!("debounce {}", max_wait.as_millis()),
        };
        let policy = match unique_for_ms {
            Some(ms) => format!("{policy} unique {ms}"),
            None => policy,
        };
        match clock_offset_ms {
            Some(ms) => format!("{policy} clock {}", ms.max(0)),
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
        assert_eq!(OnConflict::Keep.as_arg(None, None), "keep");
        assert_eq!(
            OnConflict::Replace.as_arg(Some(3_600_000), None),
            "replace unique 3600000"
        );
        let debounce = OnConflict::Debounce {
            max_wait: Duration::from_secs(60),
        };
        assert_eq!(debounce.as_arg(None, None), "debounce 60000");
        assert_eq!(debounce.as_arg(Some(5), None), "debounce 60000 unique 5");
        assert_eq!(
            debounce.as_arg(Some(5), Some(86_400_000)),
            "debounce 60000 unique 5 clock 86400000"
        );
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

    /// `parse_at` against jiff's own arithmetic on generated RFC 3339 texts: every offset
    /// from -14:00 to +14:00 by the minute, 0–9 fraction digits, `Z`/`z`, `T`/`t`/space.
    #[test]
    fn rfc3339_times_read_as_jiff_computes_them() {
        use jiff::civil::date;
        use jiff::tz::Offset;
        // A fixed-seed generator (xorshift): the same cases every run.
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut checked = 0;
        for offset_min in -14 * 60..=14 * 60_i32 {
            let year = 1971 + next(8000) as i16;
            let month = 1 + next(12) as i8;
            let day = 1 + next(28) as i8;
            let (hour, minute, second) = (next(24) as i8, next(60) as i8, next(60) as i8);
            let nanos = next(1_000_000_000) as i32;
            let digits = (offset_min.unsigned_abs() % 10) as usize;
            let separator = ["T", "t", " "][next(3) as usize];
            let fraction = if digits == 0 {
                String::new()
            } else {
                format!(".{}", &format!("{nanos:09}")[..digits])
            };
            let kept_nanos: i32 = format!("{:0<9}", fraction.trim_start_matches('.'))
                .parse()
                .unwrap();
            let numeric = format!(
                "{}{:02}:{:02}",
                if offset_min < 0 { '-' } else { '+' },
                offset_min.abs() / 60,
                offset_min.abs() % 60
            );
            let utc = ["Z", "z", "+00:00", "-00:00"][next(4) as usize];
            let civil = date(year, month, day).at(hour, minute, second, kept_nanos);
            for (offset, seconds) in [(numeric.as_str(), offset_min * 60), (utc, 0)] {
                let text = format!(
                    "{year:04}-{month:02}-{day:02}{separator}{hour:02}:{minute:02}:{second:02}\
                     {fraction}{offset}"
                );
                let expected = Offset::from_seconds(seconds)
                    .unwrap()
                    .to_timestamp(civil)
                    .unwrap();
                // Whole milliseconds: the sub-millisecond digits are cut off.
                let expected_ms = expected.as_second() * 1000 + i64::from(kept_nanos / 1_000_000);
                if expected_ms < 0 || SECONDS_LIKE_MS.contains(&expected_ms) {
                    continue;
                }
                assert_eq!(parse_at(&text), Ok(expected_ms), "{text}");
                checked += 1;
            }
        }
        assert!(checked > 3000, "{checked} cases");
    }

    #[test]
    fn times_without_an_offset_are_refused_saying_what_to_add() {
        for text in ["2027-12-01T09:00:00", "2027-12-01 09:00:00.5", "2027-12-01"] {
            let err = parse_at(text).unwrap_err();
            assert!(err.contains("no UTC offset"), "{text}: {err}");
            assert!(err.contains("add Z"), "{text}: {err}");
        }
        assert!(
            parse_at("2027-12-01")
                .unwrap_err()
                .contains("2027-12-01T00:00:00Z")
        );
    }

    #[test]
    fn the_issue_s_examples_read_as_written() {
        // 09:00 at +05:00 is 04:00 UTC, with or without a fraction.
        let four_utc = parse_at("2027-12-01T04:00:00Z").unwrap();
        assert_eq!(parse_at("2027-12-01T09:00:00.000+05:00"), Ok(four_utc));
        assert_eq!(parse_at("2027-12-01T09:00:00+05:00"), Ok(four_utc));
        assert_eq!(parse_at(" 2027-12-01T04:00:00.0009Z "), Ok(four_utc));
        for bad in [
            "tomorrow",
            "2027-13-01T00:00:00Z",
            "1969-12-31T23:59:59Z",
            "",
            "-",
        ] {
            assert!(parse_at(bad).is_err(), "{bad:?} accepted");
        }
        assert!(
            parse_at("99999999999999999999")
                .unwrap_err()
                .contains("out of range")
        );
    }

    #[test]
    fn json_times_take_numbers_and_text_and_name_the_field() {
        let read = |json: &str| serde_json::from_str::<TimeArg>(json).map_err(|e| e.to_string());
        assert_eq!(
            read("1700000000000").unwrap().ms("at"),
            Ok(1_700_000_000_000)
        );
        assert_eq!(
            read("\"2023-11-14T22:13:20.250Z\"").unwrap().ms("at"),
            Ok(1_700_000_000_250)
        );
        let err = read("\"2027-12-01T09:00:00\"")
            .unwrap()
            .ms("start_at")
            .unwrap_err();
        assert!(err.starts_with("start_at: "), "{err}");
        assert!(read("1.5").unwrap_err().contains("epoch milliseconds"));
        assert!(
            read("1700000000")
                .unwrap()
                .ms("at")
                .unwrap_err()
                .contains("at: ")
        );
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
