//! A namespace's test clock (`[testing] clock = true`): "now" is Redis `TIME` plus an offset
//! kept in the namespace's schema (`clock` = `test`, `clock_ms` = the offset, ms), which
//! `advance_clock` only ever raises. The offset lives in Redis so that every daemon, the CLI
//! and every client read the same clock. A namespace gets a test clock when it is created, or
//! never: a production namespace has no `clock` field, and its readers of "now" never look
//! for one (what the clock costs a production namespace is the one field read at start).

use super::{Conn, StoreError, scripts};
use crate::keys::Keys;
use std::time::Duration;

/// The schema field that says the namespace has a test clock (value [`TEST`]).
pub const CLOCK_FIELD: &str = "clock";
/// The value of [`CLOCK_FIELD`] on a namespace with a test clock.
pub const TEST: &str = "test";
/// The schema field holding the test clock's offset from Redis `TIME`, ms.
pub const OFFSET_FIELD: &str = "clock_ms";

/// What "now" is on a namespace: Redis `TIME`, or `TIME` plus its test clock's offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Clock {
    /// Production: Redis `TIME`, nothing else read.
    Redis,
    /// A test clock: `TIME` plus the offset in `<ns>:schema` (read at every use, so an
    /// advance by anyone is seen by the next reading).
    Test { schema: String },
}

/// One reading of a namespace's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Redis `TIME`, ms.
    pub redis_ms: i64,
    /// How far the test clock is ahead of Redis `TIME`, ms (0 without a test clock).
    pub offset_ms: i64,
}

impl Reading {
    /// The namespace's "now", ms.
    pub fn now_ms(&self) -> i64 {
        self.redis_ms + self.offset_ms
    }
}

impl Clock {
    /// The clock of the namespace whose schema says `clock` (the field as stored).
    pub fn of(keys: &Keys, clock: Option<&str>) -> Clock {
        if clock == Some(TEST) {
            Clock::Test {
                schema: keys.schema(),
            }
        } else {
            Clock::Redis
        }
    }

    pub fn is_test(&self) -> bool {
        matches!(self, Clock::Test { .. })
    }

    /// The test clock's offset, ms: 0 without a test clock (no I/O), else one `HGET`.
    pub async fn offset_ms(&self, con: &mut Conn) -> redis::RedisResult<i64> {
        match self {
            Clock::Redis => Ok(0),
            Clock::Test { schema } => {
                let offset: Option<i64> = redis::cmd("HGET")
                    .arg(schema)
                    .arg(OFFSET_FIELD)
                    .query_async(con)
                    .await?;
                Ok(offset.unwrap_or(0))
            }
        }
    }

    /// Redis `TIME` and the offset, in one round trip.
    pub async fn read(&self, con: &mut Conn) -> redis::RedisResult<Reading> {
        match self {
            Clock::Redis => Ok(Reading {
                redis_ms: super::server_time_ms(con).await?,
                offset_ms: 0,
            }),
            Clock::Test { schema } => {
                let ((secs, micros), offset): ((i64, i64), Option<i64>) = redis::pipe()
                    .cmd("TIME")
                    .hget(schema, OFFSET_FIELD)
                    .query_async(con)
                    .await?;
                Ok(Reading {
                    redis_ms: secs * 1000 + micros / 1000,
                    offset_ms: offset.unwrap_or(0),
                })
            }
        }
    }

    /// What a script's "now" override should be: `None` (the script reads Redis `TIME`)
    /// without a test clock, at no cost; the test clock's now with one.
    pub async fn script_now_ms(&self, con: &mut Conn) -> redis::RedisResult<Option<i64>> {
        match self {
            Clock::Redis => Ok(None),
            Clock::Test { .. } => Ok(Some(self.read(con).await?.now_ms())),
        }
    }
}

/// Reads the namespace's clock as its schema says (`<ns>:schema` must exist).
pub async fn of_namespace(con: &mut Conn, keys: &Keys) -> Result<Clock, StoreError> {
    let clock: Option<String> = redis::cmd("HGET")
        .arg(keys.schema())
        .arg(CLOCK_FIELD)
        .query_async(con)
        .await?;
    Ok(Clock::of(keys, clock.as_deref()))
}

/// The test clock's reading; a namespace without one is refused ([`StoreError::NoTestClock`]).
pub async fn show(con: &mut Conn, keys: &Keys) -> Result<Reading, StoreError> {
    let clock = of_namespace(con, keys).await?;
    if !clock.is_test() {
        return Err(StoreError::NoTestClock {
            namespace: keys.namespace().to_owned(),
        });
    }
    Ok(clock.read(con).await?)
}

/// Moves the test clock forward by `by` (at least 1 ms; whole ms) and wakes every daemon of
/// the namespace; answers the new reading. Refused, writing nothing, on a namespace without a
/// test clock ([`StoreError::NoTestClock`]) and for a duration under 1 ms.
pub async fn advance(con: &mut Conn, keys: &Keys, by: Duration) -> Result<Reading, StoreError> {
    let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err(StoreError::InvalidInput(format!(
            "a test clock moves forward by 1 ms or more, not {by:?}"
        )));
    }
    match scripts::advance_clock(con, keys, ms).await {
        Ok(_) => show(con, keys).await,
        Err(e) if e.code() == Some("ZDELAY_NO_TEST_CLOCK") => Err(StoreError::NoTestClock {
            namespace: keys.namespace().to_owned(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// Checks a daemon's `[testing] clock` against the namespace's (`stored`: the schema's
/// `clock` field): a mismatch either way is refused, naming both.
pub fn check_wanted(keys: &Keys, wanted: bool, stored: Option<&str>) -> Result<(), StoreError> {
    let has = stored == Some(TEST);
    if has == wanted {
        return Ok(());
    }
    Err(StoreError::ClockMismatch {
        namespace: keys.namespace().to_owned(),
        namespace_has_test_clock: has,
    })
}

/// Parses how far to move a test clock: a duration such as `30d`, `90m` or `1h 30m`, at
/// least 1 ms. A negative one is refused (a test clock never moves back), and so is anything
/// else that is no duration.
pub fn parse_advance(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(format!(
            "{text:?}: a test clock only moves forward; give a positive duration, like 30d"
        ));
    }
    let by = humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration like 30d, 90m or 1h 30m ({e})"))?;
    if by.as_millis() == 0 {
        return Err(format!("{text:?}: a test clock moves by 1ms or more"));
    }
    Ok(by)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advance_is_a_positive_duration_of_whole_milliseconds_or_more() {
        assert_eq!(parse_advance("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(parse_advance(" 1h 30m "), Ok(Duration::from_secs(5_400)));
        assert_eq!(parse_advance("1ms"), Ok(Duration::from_millis(1)));
        for bad in ["-1h", "-0s", "0s", "500us", "", "soon", "30", "1h-"] {
            assert!(parse_advance(bad).is_err(), "{bad:?} is refused");
        }
        assert!(
            parse_advance("-5m")
                .unwrap_err()
                .contains("only moves forward")
        );
    }

    #[test]
    fn a_mismatch_either_way_names_both_settings() {
        let keys = Keys::new("tests", 16);
        assert!(check_wanted(&keys, true, Some(TEST)).is_ok());
        assert!(check_wanted(&keys, false, None).is_ok());
        let created_without = check_wanted(&keys, true, None).unwrap_err().to_string();
        assert!(created_without.contains("created without a test clock"));
        assert!(created_without.contains("[testing] clock = true"));
        let created_with = check_wanted(&keys, false, Some(TEST))
            .unwrap_err()
            .to_string();
        assert!(created_with.contains("created with a test clock"));
        assert!(created_with.contains("[testing] clock = false"));
    }

    #[test]
    fn a_reading_is_redis_time_plus_the_offset() {
        let r = Reading {
            redis_ms: 1_700_000_000_000,
            offset_ms: 86_400_000,
        };
        assert_eq!(r.now_ms(), 1_700_086_400_000);
        assert_eq!(Clock::of(&Keys::new("t", 1), Some("prod")), Clock::Redis);
        assert!(Clock::of(&Keys::new("t", 1), Some(TEST)).is_test());
    }
}
