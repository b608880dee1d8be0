//! An iCalendar (`.ics`, RFC 5545) file's event dates, for `zdelay calendar set --ics`.
//!
//! The `rrule` crate expands recurrence rules (chosen by testing its edge cases, 2026-11:
//! yearly `BYDAY=4TH` and `-1MO`, `COUNT`, `UNTIL`, monthly on the 31st, an invalid
//! `BYMONTH` refused; it refuses a `DTSTART` in a DST gap or fold and a date-only `UNTIL` with
//! a UTC start, so it is given wall times only, see below). The rest — unfolding lines,
//! `VEVENT` blocks, `DTSTART` as a DATE or a DATE-TIME (UTC, floating or with `TZID`),
//! `DTEND` of all-day events, `RDATE`, `EXDATE`, `RECURRENCE-ID`, `STATUS:CANCELLED` — is read
//! here, and only each occurrence's *date* is kept.
//!
//! Each event is expanded in its own wall time: its `DTSTART` in its zone (`TZID`), UTC for a
//! value in UTC, as written for a floating one. `rrule` gets that wall time labelled UTC (it
//! has no DST there, so no gap or fold to refuse); `UNTIL`, `RDATE` and `EXDATE` values are
//! turned into the event's wall time first. An `EXDATE` removes the occurrence on its date.

use jiff::Timestamp;
use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;
use std::collections::{BTreeSet, HashMap};
use zdelay::calendar::{CalendarError, MAX_CALENDAR_DATES};

/// The largest `.ics` file read.
pub const MAX_ICS_BYTES: usize = 1 << 20;
/// The longest all-day event counted (its `DTEND` after its `DTSTART`).
const MAX_EVENT_DAYS: i64 = 366;

fn bad(why: impl Into<String>) -> CalendarError {
    CalendarError(why.into())
}

/// One property line: name (upper case), parameters (names upper case), value.
struct Property {
    name: String,
    params: HashMap<String, String>,
    value: String,
}

fn parse_property(line: &str) -> Option<Property> {
    // The value starts after the first ':' outside a quoted parameter value.
    let mut quoted = false;
    let colon = line.char_indices().find_map(|(i, c)| {
        match c {
            '"' => quoted = !quoted,
            ':' if !quoted => return Some(i),
            _ => {}
        }
        None
    })?;
    let (head, value) = (&line[..colon], &line[colon + 1..]);
    let mut parts = head.split(';');
    let name = parts.next()?.trim().to_ascii_uppercase();
    let params = parts
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_ascii_uppercase(),
                v.trim().trim_matches('"').to_owned(),
            )
        })
        .collect();
    Some(Property {
        name,
        params,
        value: value.trim().to_owned(),
    })
}

/// Where an event's wall times are: a zone, or floating (as written).
#[derive(Clone)]
enum Wall {
    Zone(TimeZone),
    Floating,
}

/// A DATE or DATE-TIME value as a wall time of `wall` (the event's).
fn wall_time(
    value: &str,
    params: &HashMap<String, String>,
    wall: &Wall,
) -> Result<DateTime, CalendarError> {
    let what = || bad(format!("{value:?} is not an iCalendar date or date-time"));
    if params
        .get("VALUE")
        .is_some_and(|v| v.eq_ignore_ascii_case("DATE"))
        || value.len() == 8
    {
        let date = Date::strptime("%Y%m%d", value).map_err(|_| what())?;
        return Ok(date.to_datetime(jiff::civil::Time::midnight()));
    }
    let (text, utc) = match value.strip_suffix('Z') {
        Some(t) => (t, true),
        None => (value, false),
    };
    let civil = DateTime::strptime("%Y%m%dT%H%M%S", text).map_err(|_| what())?;
    let instant: Option<Timestamp> = if utc {
        Some(
            jiff::tz::Offset::UTC
                .to_timestamp(civil)
                .map_err(|_| what())?,
        )
    } else if let Some(tzid) = params.get("TZID") {
        let zone = zone(tzid)?;
        Some(
            zone.to_ambiguous_timestamp(civil)
                .compatible()
                .map_err(|_| what())?,
        )
    } else {
        None
    };
    Ok(match (instant, wall) {
        (Some(t), Wall::Zone(tz)) => tz.to_datetime(t),
        (Some(t), Wall::Floating) => TimeZone::UTC.to_datetime(t),
        (None, _) => civil,
    })
}

fn zone(tzid: &str) -> Result<TimeZone, CalendarError> {
    TimeZone::get(tzid).map_err(|_| bad(format!("unknown time zone TZID={tzid:?}")))
}

fn compact(dt: DateTime) -> String {
    dt.strftime("%Y%m%dT%H%M%S").to_string()
}

#[derive(Default)]
struct Event {
    props: Vec<Property>,
}

impl Event {
    fn get(&self, name: &str) -> Option<&Property> {
        self.props.iter().find(|p| p.name == name)
    }

    fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Property> + 'a {
        self.props.iter().filter(move |p| p.name == name)
    }
}

/// The dates of every event of `text` up to `until` (inclusive). Errors name the event (its
/// `SUMMARY` or `UID`) and what is wrong.
pub fn event_dates(text: &str, until: Date) -> Result<BTreeSet<Date>, CalendarError> {
    if text.len() > MAX_ICS_BYTES {
        return Err(bad(format!(
            "the .ics file has {} bytes, more than the {MAX_ICS_BYTES} read",
            text.len()
        )));
    }
    // Unfold: a line starting with a space or a tab continues the one before.
    let mut lines: Vec<String> = Vec::new();
    for raw in text.split('\n') {
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        match raw.chars().next() {
            Some(' ' | '\t') if !lines.is_empty() => {
                lines.last_mut().expect("not empty").push_str(&raw[1..])
            }
            _ => lines.push(raw.to_owned()),
        }
    }
    if !lines
        .iter()
        .any(|l| l.trim().eq_ignore_ascii_case("BEGIN:VCALENDAR"))
    {
        return Err(bad("not an iCalendar file: no BEGIN:VCALENDAR"));
    }
    let mut events = Vec::new();
    let mut current: Option<Event> = None;
    let mut nested = 0usize;
    for line in &lines {
        let Some(prop) = parse_property(line) else {
            continue;
        };
        let value = prop.value.to_ascii_uppercase();
        match (prop.name.as_str(), &mut current) {
            ("BEGIN", None) if value == "VEVENT" => current = Some(Event::default()),
            ("BEGIN", Some(_)) => nested += 1,
            ("END", Some(_)) if nested > 0 => nested -= 1,
            ("END", Some(_)) if value == "VEVENT" => events.push(current.take().expect("open")),
            (_, Some(event)) if nested == 0 => event.props.push(prop),
            _ => {}
        }
    }
    // RECURRENCE-ID: an instance of an event moved (or cancelled): the master's occurrence
    // on that date goes, the instance's own date comes.
    let mut moved: HashMap<String, BTreeSet<Date>> = HashMap::new();
    for event in &events {
        if let (Some(uid), Some(rid)) = (event.get("UID"), event.get("RECURRENCE-ID")) {
            let wall = event_wall(event)?;
            moved
                .entry(uid.value.clone())
                .or_default()
                .insert(wall_time(&rid.value, &rid.params, &wall)?.date());
        }
    }
    let mut dates = BTreeSet::new();
    for event in &events {
        let name = event
            .get("SUMMARY")
            .or(event.get("UID"))
            .map_or("an event".to_owned(), |p| format!("event {:?}", p.value));
        let cancelled = event
            .get("STATUS")
            .is_some_and(|s| s.value.eq_ignore_ascii_case("CANCELLED"));
        if cancelled {
            continue;
        }
        let mut own = expand(event, until).map_err(|e| bad(format!("{name}: {}", e.0)))?;
        if event.get("RECURRENCE-ID").is_none()
            && let Some(gone) = event.get("UID").and_then(|u| moved.get(&u.value))
        {
            own.retain(|d| !gone.contains(d));
        }
        dates.extend(own);
        if dates.len() > MAX_CALENDAR_DATES {
            return Err(bad(format!(
                "the events have more than the {MAX_CALENDAR_DATES} dates a calendar may hold up to {until}; \
                 give an earlier --until, or COUNT or UNTIL to the rules"
            )));
        }
    }
    Ok(dates)
}

fn event_wall(event: &Event) -> Result<Wall, CalendarError> {
    let start = event.get("DTSTART").ok_or_else(|| bad("no DTSTART"))?;
    Ok(match start.params.get("TZID") {
        Some(tzid) => Wall::Zone(zone(tzid)?),
        None if start.value.ends_with('Z') => Wall::Zone(TimeZone::UTC),
        None => Wall::Floating,
    })
}

/// One event's dates up to `until`.
fn expand(event: &Event, until: Date) -> Result<BTreeSet<Date>, CalendarError> {
    let start = event.get("DTSTART").ok_or_else(|| bad("no DTSTART"))?;
    let wall = event_wall(event)?;
    let first = wall_time(&start.value, &start.params, &wall)?;
    let all_day = start
        .params
        .get("VALUE")
        .is_some_and(|v| v.eq_ignore_ascii_case("DATE"))
        || start.value.len() == 8;
    // An all-day event covers each day from DTSTART up to DTEND (exclusive).
    let span_days = match event.get("DTEND") {
        Some(end) if all_day => {
            let end = wall_time(&end.value, &end.params, &wall)?.date();
            let days = first
                .date()
                .until(end)
                .map_err(|e| bad(e.to_string()))?
                .get_days() as i64;
            if !(1..=MAX_EVENT_DAYS).contains(&days) {
                return Err(bad(format!(
                    "DTEND must be 1 to {MAX_EVENT_DAYS} days after DTSTART, got {days}"
                )));
            }
            days
        }
        _ => 1,
    };
    let mut starts = BTreeSet::new();
    let rules: Vec<_> = event.all("RRULE").collect();
    if rules.is_empty() {
        starts.insert(first.date());
    } else {
        for rule in rules {
            starts.extend(expand_rule(first, &rule.value, &wall, until)?);
        }
    }
    for rdate in event.all("RDATE") {
        for value in rdate.value.split(',') {
            starts.insert(wall_time(value, &rdate.params, &wall)?.date());
        }
    }
    for exdate in event.all("EXDATE") {
        for value in exdate.value.split(',') {
            starts.remove(&wall_time(value, &exdate.params, &wall)?.date());
        }
    }
    let mut dates = BTreeSet::new();
    for day in starts {
        for k in 0..span_days {
            let d = day
                .checked_add(jiff::Span::new().days(k))
                .map_err(|e| bad(e.to_string()))?;
            if d <= until {
                dates.insert(d);
            }
        }
        if dates.len() > MAX_CALENDAR_DATES {
            break;
        }
    }
    Ok(dates)
}

/// The start dates of one RRULE from `first` (a wall time) up to `until`, by `rrule`.
fn expand_rule(
    first: DateTime,
    rule: &str,
    wall: &Wall,
    until: Date,
) -> Result<Vec<Date>, CalendarError> {
    use chrono::TimeZone as _;
    // UNTIL in the event's wall time, labelled UTC like DTSTART.
    let mut parts = Vec::new();
    for part in rule.split(';').filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((key, value)) if key.eq_ignore_ascii_case("UNTIL") => {
                let mut end = wall_time(value, &HashMap::new(), wall)?;
                if value.len() == 8 {
                    end = end.date().to_datetime(jiff::civil::time(23, 59, 59, 0));
                }
                parts.push(format!("UNTIL={}Z", compact(end)));
            }
            _ => parts.push(part.to_owned()),
        }
    }
    let text = format!("DTSTART:{}Z\nRRULE:{}", compact(first), parts.join(";"));
    let set: rrule::RRuleSet = text
        .parse()
        .map_err(|e: rrule::RRuleError| bad(format!("RRULE:{rule}: {e}")))?;
    let next_day = until.tomorrow().map_err(|e| bad(e.to_string()))?;
    let end = rrule::Tz::UTC
        .with_ymd_and_hms(
            next_day.year().into(),
            next_day.month() as u32,
            next_day.day() as u32,
            0,
            0,
            0,
        )
        .single()
        .ok_or_else(|| bad(format!("--until {until} is out of range")))?;
    let limit = u16::try_from(MAX_CALENDAR_DATES + 1).expect("fits");
    let result = set.before(end).all(limit);
    if result.dates.len() > MAX_CALENDAR_DATES {
        return Err(bad(format!(
            "RRULE:{rule} has more than {MAX_CALENDAR_DATES} occurrences up to {until}"
        )));
    }
    result
        .dates
        .iter()
        .map(|d| {
            use chrono::Datelike as _;
            jiff::civil::Date::new(d.year() as i16, d.month() as i8, d.day() as i8)
                .map_err(|e| bad(e.to_string()))
        })
        .filter(|d| d.as_ref().map_or(true, |d| *d <= until))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;

    fn ics(body: &str) -> String {
        format!("BEGIN:VCALENDAR\r\nVERSION:2.0\r\n{body}END:VCALENDAR\r\n")
    }

    fn dates(body: &str, until: Date) -> Result<Vec<String>, String> {
        event_dates(&ics(body), until)
            .map(|d| d.iter().map(ToString::to_string).collect())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn all_day_events_yearly_rules_exdate_and_rdate() {
        let body = "BEGIN:VEVENT\r\nUID:a\r\nSUMMARY:New Year\r\nDTSTART;VALUE=DATE:20260101\r\n\
                    RRULE:FREQ=YEARLY\r\nEXDATE;VALUE=DATE:20270101\r\nRDATE;VALUE=DATE:20260704\r\nEND:VEVENT\r\n";
        assert_eq!(
            dates(body, date(2029, 6, 30)).unwrap(),
            ["2026-01-01", "2026-07-04", "2028-01-01", "2029-01-01"]
        );
    }

    #[test]
    fn nth_weekday_rules_until_and_count() {
        // Thanksgiving (4th Thursday of November), Memorial Day (last Monday of May).
        let body = "BEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20261126\r\nRRULE:FREQ=YEARLY;BYMONTH=11;BYDAY=4TH;COUNT=3\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20260525\r\nRRULE:FREQ=YEARLY;BYMONTH=5;BYDAY=-1MO;UNTIL=20280601\r\nEND:VEVENT\r\n";
        assert_eq!(
            dates(body, date(2040, 1, 1)).unwrap(),
            [
                "2026-05-25",
                "2026-11-26",
                "2027-05-31",
                "2027-11-25",
                "2028-05-29",
                "2028-11-23"
            ]
        );
    }

    #[test]
    fn date_times_count_on_their_local_date_even_in_a_dst_gap_or_fold() {
        // 02:30 on 2026-03-29 does not exist in Paris, 01:30 on 2026-11-01 happens twice in
        // New York: rrule alone refuses both as DTSTART.
        let body = "BEGIN:VEVENT\r\nDTSTART;TZID=Europe/Paris:20260329T023000\r\nRRULE:FREQ=DAILY;COUNT=2\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nDTSTART;TZID=America/New_York:20261101T013000\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nDTSTART:20261231T230000Z\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nDTSTART;TZID=Asia/Tokyo:20270105T080000\r\nRRULE:FREQ=WEEKLY;COUNT=3\r\nEXDATE:20270111T230000Z\r\nEND:VEVENT\r\n";
        assert_eq!(
            dates(body, date(2030, 1, 1)).unwrap(),
            [
                "2026-03-29",
                "2026-03-30",
                "2026-11-01",
                "2026-12-31",
                "2027-01-05",
                "2027-01-19"
            ]
        );
    }

    #[test]
    fn multi_day_events_folded_lines_moved_and_cancelled_instances() {
        let body = "BEGIN:VEVENT\r\nUID:xmas\r\nSUMMARY:Christmas\r\n  break\r\nDTSTART;VALUE=DATE:20261224\r\nDTEND;VALUE=DATE:20261227\r\n\
                    BEGIN:VALARM\r\nTRIGGER:-PT15M\r\nEND:VALARM\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nUID:w\r\nDTSTART;VALUE=DATE:20260105\r\nRRULE:FREQ=WEEKLY;CO\r\n UNT=3\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nUID:w\r\nRECURRENCE-ID;VALUE=DATE:20260112\r\nDTSTART;VALUE=DATE:20260113\r\nEND:VEVENT\r\n\
                    BEGIN:VEVENT\r\nUID:c\r\nSTATUS:CANCELLED\r\nDTSTART;VALUE=DATE:20260301\r\nEND:VEVENT\r\n";
        assert_eq!(
            dates(body, date(2030, 1, 1)).unwrap(),
            [
                "2026-01-05",
                "2026-01-13",
                "2026-01-19",
                "2026-12-24",
                "2026-12-25",
                "2026-12-26"
            ]
        );
    }

    #[test]
    fn bad_files_are_refused_naming_the_event() {
        let until = date(2036, 12, 31);
        let e = dates(
            "BEGIN:VEVENT\r\nSUMMARY:Leap\r\nDTSTART;VALUE=DATE:20260229\r\nEND:VEVENT\r\n",
            until,
        )
        .unwrap_err();
        assert!(
            e.contains("event \"Leap\"") && e.contains("20260229"),
            "{e}"
        );
        let e = dates("BEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20260101\r\nRRULE:FREQ=YEARLY;BYMONTH=13\r\nEND:VEVENT\r\n", until).unwrap_err();
        assert!(e.contains("BYMONTH"), "{e}");
        let e = dates(
            "BEGIN:VEVENT\r\nDTSTART;TZID=Mars/Base:20260101T000000\r\nEND:VEVENT\r\n",
            until,
        )
        .unwrap_err();
        assert!(e.contains("Mars/Base"), "{e}");
        let e = dates(
            "BEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20260101\r\nRRULE:FREQ=DAILY\r\nEND:VEVENT\r\n",
            until,
        )
        .unwrap_err();
        assert!(e.contains("more than 4000"), "{e}");
        let e = dates("BEGIN:VEVENT\r\nSUMMARY:x\r\nEND:VEVENT\r\n", until).unwrap_err();
        assert!(e.contains("no DTSTART"), "{e}");
        let e = event_dates("hello", until).unwrap_err().to_string();
        assert!(e.contains("not an iCalendar file"), "{e}");
        let big = "X".repeat(MAX_ICS_BYTES + 1);
        assert!(
            event_dates(&big, until)
                .unwrap_err()
                .to_string()
                .contains("bytes")
        );
        // A rule that never matches ends; it does not spin.
        assert_eq!(
            dates("BEGIN:VEVENT\r\nDTSTART;VALUE=DATE:20260101\r\nRRULE:FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=30\r\nEND:VEVENT\r\n", until).unwrap_or_default(),
            Vec::<String>::new()
        );
    }
}
