//! Calendars for schedules, the pure part: a set of days a schedule does not fire on (listed
//! dates plus weekend days), business-day arithmetic over it, and what a schedule does with an
//! occurrence on such a day ([`Shift`]). No Redis and no iCalendar here: the CLI turns a
//! dates file or an `.ics` file into a [`Calendar`], `calendars` stores it under a name, and
//! a schedule that names it carries a copy in its definition (so a firing needs no extra
//! read, and every daemon computes from the same dates).

use std::collections::BTreeSet;

use jiff::civil::{Date, Weekday};
use serde::{Deserialize, Serialize};

/// The most dates one calendar may list (a century of a country's holidays fits).
pub const MAX_CALENDAR_DATES: usize = 4_000;
/// The longest calendar name.
pub const MAX_CALENDAR_NAME: usize = 64;

/// Days on which a schedule does not fire: the listed `dates` and every `weekend` day.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "CalendarData", into = "CalendarData")]
pub struct Calendar {
    weekend: BTreeSet<WeekdayName>,
    dates: BTreeSet<Date>,
}

/// A calendar as stored: weekday names and `YYYY-MM-DD` strings.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CalendarData {
    #[serde(default)]
    weekend: Vec<WeekdayName>,
    #[serde(default)]
    dates: Vec<String>,
}

/// A weekday by its three-letter name, as users write it (`sat`, `sun`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeekdayName {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

impl WeekdayName {
    pub const ALL: [WeekdayName; 7] = [
        WeekdayName::Mon,
        WeekdayName::Tue,
        WeekdayName::Wed,
        WeekdayName::Thu,
        WeekdayName::Fri,
        WeekdayName::Sat,
        WeekdayName::Sun,
    ];

    fn of(day: Weekday) -> Self {
        Self::ALL[day.to_monday_zero_offset() as usize]
    }

    pub fn name(self) -> &'static str {
        ["mon", "tue", "wed", "thu", "fri", "sat", "sun"][self as usize]
    }

    /// The day's English name, for reasons shown to users.
    pub fn long_name(self) -> &'static str {
        [
            "Monday",
            "Tuesday",
            "Wednesday",
            "Thursday",
            "Friday",
            "Saturday",
            "Sunday",
        ][self as usize]
    }

    /// `sat,sun`, `fri,sat`, or `none`: the `--weekend` flag's form.
    pub fn parse_list(text: &str) -> Result<Vec<WeekdayName>, CalendarError> {
        if text.trim().eq_ignore_ascii_case("none") {
            return Ok(Vec::new());
        }
        text.split(',')
            .map(|part| {
                let part = part.trim().to_ascii_lowercase();
                Self::ALL
                    .into_iter()
                    .find(|d| {
                        part.len() >= 3 && d.long_name().to_ascii_lowercase().starts_with(&part)
                    })
                    .ok_or_else(|| {
                        CalendarError(format!(
                            "weekend: {part:?} is not a weekday (mon … sun, or none)"
                        ))
                    })
            })
            .collect()
    }
}

/// Why a calendar could not be made: said for a user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid calendar: {0}")]
pub struct CalendarError(pub String);

impl TryFrom<CalendarData> for Calendar {
    type Error = CalendarError;
    fn try_from(data: CalendarData) -> Result<Self, CalendarError> {
        let dates = data
            .dates
            .iter()
            .map(|d| {
                d.parse::<Date>()
                    .map_err(|e| CalendarError(format!("date {d:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Calendar::new(data.weekend, dates)
    }
}

impl From<Calendar> for CalendarData {
    fn from(c: Calendar) -> Self {
        CalendarData {
            weekend: c.weekend.into_iter().collect(),
            dates: c.dates.iter().map(ToString::to_string).collect(),
        }
    }
}

/// A run of skipped days is at most this long (every listed date plus the weekends among
/// them): business-day searches stop there.
const MAX_SKIPPED_RUN: i32 = (MAX_CALENDAR_DATES as i32) * 7 / 5 + 7;

impl Calendar {
    /// At most [`MAX_CALENDAR_DATES`] dates and six weekend days (a week needs a business day).
    pub fn new(
        weekend: impl IntoIterator<Item = WeekdayName>,
        dates: impl IntoIterator<Item = Date>,
    ) -> Result<Self, CalendarError> {
        let weekend: BTreeSet<_> = weekend.into_iter().collect();
        if weekend.len() == 7 {
            return Err(CalendarError(
                "weekend: every day of the week would be skipped".into(),
            ));
        }
        let dates: BTreeSet<_> = dates.into_iter().collect();
        if dates.len() > MAX_CALENDAR_DATES {
            return Err(CalendarError(format!(
                "{} dates, more than the {MAX_CALENDAR_DATES} a calendar may hold",
                dates.len()
            )));
        }
        Ok(Calendar { weekend, dates })
    }

    /// A dates file: one `YYYY-MM-DD` a line, optionally followed by whitespace and a note;
    /// blank lines and lines starting with `#` are ignored. Errors name the line.
    pub fn parse_dates(
        text: &str,
        weekend: impl IntoIterator<Item = WeekdayName>,
    ) -> Result<Self, CalendarError> {
        let mut dates = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let word = line.split_whitespace().next().unwrap_or_default();
            let date = word.parse::<Date>().map_err(|_| {
                CalendarError(format!(
                    "line {}: {word:?} is not a date (YYYY-MM-DD)",
                    i + 1
                ))
            })?;
            dates.push(date);
            if dates.len() > MAX_CALENDAR_DATES {
                return Err(CalendarError(format!(
                    "more than the {MAX_CALENDAR_DATES} dates a calendar may hold"
                )));
            }
        }
        Calendar::new(weekend, dates)
    }

    pub fn weekend(&self) -> impl Iterator<Item = WeekdayName> + '_ {
        self.weekend.iter().copied()
    }

    pub fn dates(&self) -> impl Iterator<Item = Date> + '_ {
        self.dates.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.dates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.dates.is_empty() && self.weekend.is_empty()
    }

    /// Why `date` is skipped (a listed date, or a weekend day), or `None` on a business day.
    pub fn why_skipped(&self, date: Date) -> Option<DayOff> {
        if self.dates.contains(&date) {
            return Some(DayOff::Listed);
        }
        let day = WeekdayName::of(date.weekday());
        self.weekend.contains(&day).then_some(DayOff::Weekend(day))
    }

    pub fn is_business_day(&self, date: Date) -> bool {
        self.why_skipped(date).is_none()
    }

    /// The first business day after `date` (`None` past the end of time).
    pub fn next_business_day(&self, date: Date) -> Option<Date> {
        self.business_day_from(date, 1)
    }

    /// The last business day before `date`.
    pub fn previous_business_day(&self, date: Date) -> Option<Date> {
        self.business_day_from(date, -1)
    }

    /// `date` itself when it is a business day, else where `shift` moves it (`None` for
    /// [`Shift::Skip`]).
    pub fn shifted(&self, date: Date, shift: Shift) -> Option<Date> {
        if self.is_business_day(date) {
            return Some(date);
        }
        match shift {
            Shift::Skip => None,
            Shift::Next => self.next_business_day(date),
            Shift::Previous => self.previous_business_day(date),
        }
    }

    fn business_day_from(&self, date: Date, step: i32) -> Option<Date> {
        let mut day = date;
        for _ in 0..MAX_SKIPPED_RUN {
            day = day.checked_add(jiff::Span::new().days(step)).ok()?;
            if self.is_business_day(day) {
                return Some(day);
            }
        }
        None
    }
}

/// Why a day is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DayOff {
    /// The calendar lists the date.
    Listed,
    /// A weekend day of the calendar.
    Weekend(WeekdayName),
}

/// What a schedule does with an occurrence whose local date the calendar skips.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shift {
    /// No occurrence that day.
    #[default]
    Skip,
    /// At the same local time on the next business day.
    Next,
    /// At the same local time on the previous business day.
    Previous,
}

impl Shift {
    pub fn name(self) -> &'static str {
        match self {
            Shift::Skip => "skip",
            Shift::Next => "next",
            Shift::Previous => "previous",
        }
    }

    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "skip" => Ok(Shift::Skip),
            "next" => Ok(Shift::Next),
            "previous" => Ok(Shift::Previous),
            other => Err(format!(
                "shift: {other:?} is not one of skip, next, previous"
            )),
        }
    }
}

/// A calendar name: 1 to [`MAX_CALENDAR_NAME`] characters of letters, digits, `-`, `_`, `.`.
pub fn valid_calendar_name(name: &str) -> Result<(), CalendarError> {
    if name.is_empty()
        || name.len() > MAX_CALENDAR_NAME
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(CalendarError(format!(
            "name {name:?}: 1 to {MAX_CALENDAR_NAME} letters, digits, '-', '_' or '.'"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;

    fn sat_sun(dates: &[Date]) -> Calendar {
        Calendar::new([WeekdayName::Sat, WeekdayName::Sun], dates.iter().copied()).unwrap()
    }

    #[test]
    fn business_days_skip_weekends_and_listed_dates() {
        // 2026-12-25 is a Friday, 2026-12-28 the Monday after.
        let c = sat_sun(&[date(2026, 12, 25), date(2026, 12, 28)]);
        assert_eq!(c.why_skipped(date(2026, 12, 24)), None);
        assert_eq!(c.why_skipped(date(2026, 12, 25)), Some(DayOff::Listed));
        assert_eq!(
            c.why_skipped(date(2026, 12, 26)),
            Some(DayOff::Weekend(WeekdayName::Sat))
        );
        assert_eq!(
            c.next_business_day(date(2026, 12, 24)),
            Some(date(2026, 12, 29))
        );
        assert_eq!(
            c.previous_business_day(date(2026, 12, 29)),
            Some(date(2026, 12, 24))
        );
        assert_eq!(
            c.shifted(date(2026, 12, 26), Shift::Next),
            Some(date(2026, 12, 29))
        );
        assert_eq!(
            c.shifted(date(2026, 12, 26), Shift::Previous),
            Some(date(2026, 12, 24))
        );
        assert_eq!(c.shifted(date(2026, 12, 26), Shift::Skip), None);
        assert_eq!(
            c.shifted(date(2026, 12, 24), Shift::Skip),
            Some(date(2026, 12, 24))
        );
    }

    #[test]
    fn a_reference_model_agrees_on_generated_calendars() {
        // The model: scan day by day with the plainest checks.
        let mut seed: u64 = 7;
        let mut rand = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let base = date(2026, 1, 1);
        for _ in 0..200 {
            let weekend: Vec<_> = WeekdayName::ALL
                .into_iter()
                .filter(|_| rand(3) == 0)
                .take(6)
                .collect();
            let dates: Vec<Date> = (0..rand(60))
                .map(|_| {
                    base.checked_add(jiff::Span::new().days(rand(120) as i64))
                        .unwrap()
                })
                .collect();
            let c = Calendar::new(weekend.clone(), dates.clone()).unwrap();
            let off =
                |d: Date| dates.contains(&d) || weekend.contains(&WeekdayName::of(d.weekday()));
            for k in 0..130 {
                let d = base.checked_add(jiff::Span::new().days(k)).unwrap();
                assert_eq!(c.is_business_day(d), !off(d));
                let mut n = d.tomorrow().unwrap();
                while off(n) {
                    n = n.tomorrow().unwrap();
                }
                let mut p = d.yesterday().unwrap();
                while off(p) {
                    p = p.yesterday().unwrap();
                }
                assert_eq!(c.next_business_day(d), Some(n));
                assert_eq!(c.previous_business_day(d), Some(p));
            }
        }
    }

    #[test]
    fn bad_calendars_are_refused_with_the_reason() {
        let e = Calendar::new(WeekdayName::ALL, []).unwrap_err();
        assert!(e.to_string().contains("every day of the week"), "{e}");
        let e = Calendar::parse_dates("2026-01-01\n2026-02-30 oops\n", []).unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        let many: String = (0..=MAX_CALENDAR_DATES as i64)
            .map(|k| {
                format!(
                    "{}\n",
                    date(2000, 1, 1)
                        .checked_add(jiff::Span::new().days(k))
                        .unwrap()
                )
            })
            .collect();
        let e = Calendar::parse_dates(&many, []).unwrap_err();
        assert!(e.to_string().contains("4000"), "{e}");
        assert!(WeekdayName::parse_list("sat,funday").is_err());
        assert_eq!(
            WeekdayName::parse_list("fri, Saturday").unwrap(),
            [WeekdayName::Fri, WeekdayName::Sat]
        );
        assert_eq!(WeekdayName::parse_list("none").unwrap(), []);
        assert!(valid_calendar_name("us-federal.2026").is_ok());
        assert!(valid_calendar_name("a b").is_err());
        assert!(valid_calendar_name("").is_err());
    }

    #[test]
    fn json_form() {
        let c = Calendar::parse_dates(
            "# holidays\n2026-12-25 Christmas\n\n2026-01-01\n",
            [WeekdayName::Sun, WeekdayName::Sat],
        )
        .unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"weekend":["sat","sun"],"dates":["2026-01-01","2026-12-25"]}"#
        );
        assert_eq!(serde_json::from_str::<Calendar>(&json).unwrap(), c);
        assert!(serde_json::from_str::<Calendar>(r#"{"dates":["2026-13-01"]}"#).is_err());
    }
}
