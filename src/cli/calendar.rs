//! `zdelay calendar`: named calendars of days schedules skip — set (from a dates file or an
//! iCalendar file), list, get, delete.

use super::ics;
use anyhow::Context;
use jiff::civil::Date;
use std::path::{Path, PathBuf};
use zdelay::Client;
use zdelay::calendar::{Calendar, WeekdayName};
use zdelay::calendars::StoredCalendar;

#[derive(clap::Subcommand)]
pub enum CalendarAction {
    /// Create or replace a calendar: the dates of a file (one YYYY-MM-DD a line) or of an
    /// iCalendar file's events, and the weekend days. A schedule takes a copy of the days
    /// when it is set (`schedule set --calendar NAME`): set it again to apply a change.
    Set(SetArgs),
    /// Every calendar: name, weekend days, how many dates, the first and the last.
    List {
        #[command(flatten)]
        output: super::Output,
    },
    /// One calendar with its dates (exit 3 if there is none).
    Get {
        name: String,
        /// Exit 0, printing nothing, when there is no such calendar.
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: super::Output,
    },
    /// Delete a calendar (exit 3 if there is none). Schedules that use it keep their copy of
    /// its days; setting them again is refused until it exists again.
    Delete {
        name: String,
        /// Exit 0, printing nothing, when there is no such calendar.
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: super::Output,
    },
}

/// Where a calendar's dates come from: exactly one of the flags.
#[derive(clap::Args, Clone)]
#[group(required = true, multiple = false)]
pub struct SourceArgs {
    /// A file of dates: one YYYY-MM-DD a line, optionally followed by a note; blank lines
    /// and lines starting with # are ignored.
    #[arg(long, value_name = "FILE")]
    dates: Option<PathBuf>,
    /// An iCalendar (.ics) file: the dates of its events (VEVENT), with their RRULE, RDATE
    /// and EXDATE, up to --until.
    #[arg(long, value_name = "FILE")]
    ics: Option<PathBuf>,
}

#[derive(clap::Args, Clone)]
pub struct SetArgs {
    /// The calendar's name: letters, digits, '-', '_', '.' (at most 64).
    name: String,
    #[command(flatten)]
    source: SourceArgs,
    /// The weekend days, also skipped: a comma-separated list of mon … sun, or none.
    #[arg(long, default_value = "sat,sun")]
    weekend: String,
    /// With --ics: recurring events are expanded up to this date (YYYY-MM-DD; default the
    /// end of the year ten years from now).
    #[arg(long, requires = "ics")]
    until: Option<Date>,
    #[command(flatten)]
    output: super::Output,
}

impl SetArgs {
    /// The calendar the flags describe, read from its file.
    pub fn calendar(&self) -> anyhow::Result<Calendar> {
        let weekend = WeekdayName::parse_list(&self.weekend)?;
        source_calendar(&self.source, weekend, self.until)
    }
}

/// A calendar from a dates file or an .ics file (its size checked before it is read).
pub fn source_calendar(
    source: &SourceArgs,
    weekend: Vec<WeekdayName>,
    until: Option<Date>,
) -> anyhow::Result<Calendar> {
    match (&source.dates, &source.ics) {
        (Some(path), _) => Ok(Calendar::parse_dates(&read_bounded(path)?, weekend)?),
        (_, Some(path)) => {
            let until = until.unwrap_or_else(default_until);
            let dates = ics::event_dates(&read_bounded(path)?, until)?;
            Ok(Calendar::new(weekend, dates)?)
        }
        (None, None) => unreachable!("clap requires --dates or --ics"),
    }
}

/// The end of the year ten years from now (UTC).
fn default_until() -> Date {
    let year = jiff::Timestamp::now()
        .to_zoned(jiff::tz::TimeZone::UTC)
        .year();
    jiff::civil::date(year + 10, 12, 31)
}

fn read_bounded(path: &Path) -> anyhow::Result<String> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    if size > ics::MAX_ICS_BYTES as u64 {
        return Err(super::UsageError(format!(
            "{} has {size} bytes, more than the {} a calendar file may have",
            path.display(),
            ics::MAX_ICS_BYTES
        ))
        .into());
    }
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

fn weekend_text(c: &Calendar) -> String {
    let days: Vec<_> = c.weekend().map(WeekdayName::name).collect();
    if days.is_empty() {
        "none".to_owned()
    } else {
        days.join(",")
    }
}

fn summary(c: &StoredCalendar) -> String {
    let mut dates = c.days.dates();
    let first = dates.next();
    let last = dates.last().or(first);
    format!(
        "{}  weekend {}  {} dates{}",
        c.name,
        weekend_text(&c.days),
        c.days.len(),
        match (first, last) {
            (Some(a), Some(b)) => format!("  {a} … {b}"),
            _ => String::new(),
        }
    )
}

fn to_json(c: &StoredCalendar) -> serde_json::Value {
    serde_json::to_value(c).expect("a calendar serializes")
}

pub async fn run(client: &Client, action: CalendarAction) -> anyhow::Result<i32> {
    match action {
        CalendarAction::Set(args) => {
            let days = args.calendar()?;
            let count = days.len();
            let created = client.calendar_set(&args.name, days).await?;
            let what = if created { "created" } else { "updated" };
            if args.output.is_json() {
                let v = serde_json::json!({ "name": args.name, what: true, "dates": count });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "{what} calendar {} ({count} dates, weekend {}); schedules take it when set",
                    args.name, args.weekend
                );
            }
            Ok(0)
        }
        CalendarAction::List { output } => {
            let all = client.calendar_list().await?;
            if output.is_json() {
                let v: Vec<_> = all.iter().map(to_json).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for c in &all {
                    println!("{}", summary(c));
                }
            }
            Ok(0)
        }
        CalendarAction::Get {
            name,
            ignore_not_found,
            output,
        } => match client.calendar_get(&name).await? {
            Some(c) if output.is_json() => {
                println!("{}", serde_json::to_string_pretty(&to_json(&c))?);
                Ok(0)
            }
            Some(c) => {
                println!("{}", summary(&c));
                for d in c.days.dates() {
                    println!("{d}");
                }
                Ok(0)
            }
            None => Ok(super::not_found(
                ignore_not_found,
                &format!("no calendar {name}"),
            )),
        },
        CalendarAction::Delete {
            name,
            ignore_not_found,
            output,
        } => {
            let done = client.calendar_delete(&name).await?;
            if !done {
                return Ok(super::not_found(
                    ignore_not_found,
                    &format!("no calendar {name}"),
                ));
            }
            if output.is_json() {
                println!("{}", serde_json::json!({ "name": name, "deleted": true }));
            } else {
                println!("deleted calendar {name}");
            }
            Ok(0)
        }
    }
}
