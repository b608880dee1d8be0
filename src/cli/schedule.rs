//! `zdelay schedule`: recurring schedules — set (upsert), list, get, pause, resume, delete,
//! and preview (the next occurrences, computed by the code the daemon uses; no Redis).

use super::batch;
use super::enqueue::parse_header;
use super::render::format_ms;
use anyhow::Context;
use clap::ValueEnum;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use zdelay::Client;
use zdelay::calendar::Shift;
use zdelay::calendars::CalendarChoice;
use zdelay::job::parse_at;
use zdelay::schedule::{CalendarSkip, Misfire, ScheduleCalendar, ScheduleDef};
use zdelay::schedule_requests::MisfireName;
use zdelay::schedules::{NewSchedule, Quarantine, Repeat, ScheduleView};

#[derive(clap::Subcommand)]
pub enum ScheduleAction {
    /// Create or update a schedule (upsert by id); prints its next occurrence. An update keeps
    /// an interval's grid and a pause, and applies from the next occurrence.
    Set(Box<SetArgs>),
    /// Every schedule: id, destination, recurrence, next occurrence, paused, quarantined; the
    /// pending ones soonest first, then the paused, ended and quarantined ones.
    List {
        #[command(flatten)]
        output: super::Output,
    },
    /// One schedule (exit 3 if there is none), then its health: occurrences fired, missed,
    /// expired and skipped by calendar, and its last firing. JSON: the schedule's fields as
    /// `schedule list -o json` prints each, `health` among them.
    Get {
        id: String,
        /// Exit 0, printing nothing, when there is no such schedule.
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: super::Output,
    },
    /// Stop a schedule's occurrences until it is resumed.
    Pause {
        id: String,
        #[command(flatten)]
        output: super::Output,
    },
    /// Resume a paused schedule from now (occurrences missed while paused are not delivered).
    Resume {
        id: String,
        #[command(flatten)]
        output: super::Output,
    },
    /// Delete a schedule: no further occurrence (one already handed to a sink completes).
    Delete {
        id: String,
        #[command(flatten)]
        output: super::Output,
        /// Exit 0, printing nothing, when there is no such schedule.
        #[arg(long)]
        ignore_not_found: bool,
    },
    /// The next occurrences of a recurrence, RFC 3339 with offset (epoch ms in JSON); with a
    /// calendar, each occurrence it skips or moves, and why.
    Preview(PreviewArgs),
}

/// How a schedule repeats: exactly one of the flags.
#[derive(clap::Args, Clone)]
#[group(required = true, multiple = false)]
pub struct RepeatArgs {
    /// Cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 with
    /// seconds first; day-of-week 0 and 7 are Sunday.
    #[arg(long)]
    cron: Option<String>,
    /// Interval, on a grid anchored at the schedule's start (no drift): 250ms, 5m, 1h…
    #[arg(long, value_parser = humantime::parse_duration)]
    every: Option<Duration>,
}

#[derive(clap::Args)]
pub struct SetArgs {
    /// The schedule's id; braces only as a hash tag (user{42}:daily).
    #[arg(required_unless_present = "batch")]
    id: Option<String>,
    /// Destination: a configured route name, or <sink>/<target>.
    #[arg(long, required_unless_present = "batch")]
    dest: Option<String>,
    /// Cron expression: 5 fields (minute hour day-of-month month day-of-week) or 6 with
    /// seconds first; day-of-week 0 and 7 are Sunday.
    #[arg(long, conflicts_with = "every")]
    cron: Option<String>,
    /// Interval, on a grid anchored at the schedule's start (no drift): 250ms, 5m, 1h…
    #[arg(long, value_parser = humantime::parse_duration)]
    every: Option<Duration>,
    /// IANA time zone of the cron expression (default UTC).
    #[arg(long, requires = "cron")]
    tz: Option<String>,
    /// The payload every occurrence carries, as text.
    #[arg(long, conflicts_with = "payload_file")]
    payload: Option<String>,
    /// The payload, read from a file.
    #[arg(long)]
    payload_file: Option<PathBuf>,
    /// A message header K=V (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Missed occurrences (daemon down, sink paused): one delivery now (coalesce), none
    /// (skip), or each of them (catch_up, at most --max-catch-up).
    #[arg(long, value_enum, default_value_t = MisfireArg::Coalesce)]
    misfire: MisfireArg,
    /// catch_up: at most this many missed occurrences delivered (the latest).
    #[arg(long)]
    max_catch_up: Option<u32>,
    /// No occurrence before this: RFC 3339 with Z or a UTC offset, or epoch ms.
    #[arg(long, value_parser = parse_at)]
    start_at: Option<i64>,
    /// No occurrence at or after this: RFC 3339 with Z or a UTC offset, or epoch ms.
    #[arg(long, value_parser = parse_at)]
    end_at: Option<i64>,
    /// An occurrence not delivered within this of its time goes to dead (reason expired).
    #[arg(long, value_parser = humantime::parse_duration)]
    max_lateness: Option<Duration>,
    /// Delivery attempts of each occurrence on two-phase sinks.
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Each occurrence is due at a point of this window after its time, derived from its id
    /// (the same point every time): many schedules on one moment are spread over it.
    #[arg(long, value_parser = humantime::parse_duration)]
    jitter: Option<Duration>,
    #[command(flatten)]
    calendar: CalendarArgs,
    /// Read schedules from FILE ("-" = stdin), one JSON object a line:
    /// {"id","dest","cron"|"every","tz","payload","payload_encoding","headers","misfire",
    /// "max_catch_up","start_at","end_at","max_lateness","max_attempts","jitter","calendar",
    /// "shift"}. Prints
    /// "<id> <next occurrence>" per input line, in order.
    #[arg(long, conflicts_with_all = ["id", "dest", "cron", "every", "payload", "payload_file"])]
    batch: Option<String>,
    #[command(flatten)]
    output: super::Output,
}

#[derive(clap::Args)]
pub struct PreviewArgs {
    #[command(flatten)]
    repeat: RepeatArgs,
    /// IANA time zone of the cron expression (default UTC).
    #[arg(long, requires = "cron")]
    tz: Option<String>,
    /// From this time (RFC 3339 with Z or a UTC offset, or epoch ms; default now); for
    /// --every also the anchor.
    #[arg(long, value_parser = parse_at)]
    from: Option<i64>,
    /// How many occurrences (those a calendar skips or moves included).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    count: u32,
    #[command(flatten)]
    calendar: CalendarArgs,
    #[command(flatten)]
    output: super::Output,
}

impl PreviewArgs {
    /// A named calendar is read from Redis.
    pub fn needs_redis(&self) -> bool {
        self.calendar.calendar.is_some()
    }
}

/// A schedule's calendar.
#[derive(clap::Args, Clone)]
pub struct CalendarArgs {
    /// Skip the days of this calendar (`zdelay calendar set`), read in the schedule's zone
    /// (UTC for --every); the schedule takes a copy of its days now.
    #[arg(long, value_name = "NAME")]
    calendar: Option<String>,
    /// An occurrence on a day the calendar skips: skip it, or move it to the same local time
    /// on the next or the previous business day (--cron only). "0 18 L * *" with --shift
    /// previous fires on the last business day of each month.
    #[arg(long, value_enum, requires = "calendar", default_value_t = ShiftArg::Skip)]
    shift: ShiftArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum ShiftArg {
    Skip,
    Next,
    Previous,
}

impl CalendarArgs {
    fn choice(&self) -> Option<CalendarChoice> {
        let shift = match self.shift {
            ShiftArg::Skip => Shift::Skip,
            ShiftArg::Next => Shift::Next,
            ShiftArg::Previous => Shift::Previous,
        };
        self.calendar
            .clone()
            .map(|name| CalendarChoice { name, shift })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum MisfireArg {
    Coalesce,
    Skip,
    #[value(name = "catch_up", alias = "catch-up")]
    CatchUp,
}

impl From<MisfireArg> for MisfireName {
    fn from(arg: MisfireArg) -> Self {
        match arg {
            MisfireArg::Coalesce => MisfireName::Coalesce,
            MisfireArg::Skip => MisfireName::Skip,
            MisfireArg::CatchUp => MisfireName::CatchUp,
        }
    }
}

/// An occurrence as the schedule's own zone shows it (UTC for intervals).
fn occurrence(def: &ScheduleDef, ms: Option<i64>) -> String {
    match (ms, def.compile()) {
        (Some(ms), Ok(schedule)) => schedule.rfc3339(ms),
        (Some(ms), Err(_)) => format_ms(ms),
        (None, _) => "none".to_owned(),
    }
}

fn recurrence_text(def: &ScheduleDef) -> String {
    match &def.recurrence {
        zdelay::schedule::Recurrence::Cron { expr, tz } => format!("cron {expr:?} {tz}"),
        zdelay::schedule::Recurrence::Every { interval_ms, .. } => format!(
            "every {}",
            humantime::format_duration(Duration::from_millis(*interval_ms))
        ),
    }
}

fn calendar_text(def: &ScheduleDef) -> String {
    def.calendar.as_ref().map_or(String::new(), |c| {
        format!("  calendar {} ({})", c.name, c.shift.name())
    })
}

fn line(view: &ScheduleView) -> String {
    format!(
        "{}  {}  {}{}  next {}{}{}",
        view.id,
        view.dest,
        recurrence_text(&view.def),
        calendar_text(&view.def),
        occurrence(&view.def, view.next_ms),
        if view.paused { "  (paused)" } else { "" },
        view.quarantine
            .as_ref()
            .map_or(String::new(), |q| format!("  (quarantined: {})", q.reason))
    )
}

/// What `schedule get` prints under the schedule's line: its firings' counts, then its last
/// firing (in the schedule's zone) and how late that was.
fn health_line(view: &ScheduleView) -> String {
    let h = &view.health;
    let last = match (h.last_occurrence_ms, h.last_lateness_ms()) {
        (Some(at), Some(late)) => format!(
            "last fired the occurrence of {}, {} late",
            occurrence(&view.def, Some(at)),
            humantime::format_duration(Duration::from_millis(late.max(0) as u64))
        ),
        _ => "never fired".to_owned(),
    };
    format!(
        "  fired {}, missed {}, expired {}, skipped by calendar {}; {last}",
        h.fired, h.missed, h.expired, h.skipped_by_calendar
    )
}

/// A quarantined schedule whose definition cannot be read (no [`ScheduleView`]).
fn unreadable_line(id: &str, quarantine: &Quarantine) -> String {
    format!("{id}  quarantined: {}", quarantine.reason)
}

/// `place`: its shard, or its route lane on storage layout 2 (`None`: not known here).
fn unreadable_json(id: &str, place: Option<Place>, quarantine: &Quarantine) -> serde_json::Value {
    let mut v = serde_json::json!({ "id": id, "quarantine": quarantine.to_json() });
    match place {
        Some(Place::Shard(shard)) => v["shard"] = shard.into(),
        Some(Place::Lane(lane)) => v["lane"] = zdelay::lane_id::base36(lane).into(),
        None => {}
    }
    v
}

/// Where a schedule is kept.
enum Place {
    Shard(u16),
    Lane(u32),
}

impl Place {
    fn of(shard: u16, lane: Option<u32>) -> Place {
        lane.map_or(Place::Shard(shard), Place::Lane)
    }
}

/// `schedule list`: every schedule, page by page as it is read (bounded calls, and memory
/// bounded by a page and the quarantined ones): the pending ones soonest first, then the
/// paused and ended ones, then the quarantined ones whose definition cannot be read.
async fn list(client: &Client, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let operator = client.operator();
    // Quarantined schedules with a readable definition are listed with the others; the
    // ones not met there are listed last.
    let quarantined = operator.schedules_quarantined().await?;
    let mut unmet: std::collections::HashSet<&str> =
        quarantined.iter().map(|q| q.id.as_str()).collect();
    let mut out = std::io::stdout().lock();
    let mut first = true;
    // The JSON form is the pretty-printed array, written an element at a time.
    let mut emit = |out: &mut std::io::StdoutLock, v: serde_json::Value| -> anyhow::Result<()> {
        if json {
            let element = serde_json::to_string_pretty(&v)?.replace('\n', "\n  ");
            write!(out, "{}\n  {element}", if first { "[" } else { "," })?;
        }
        first = false;
        Ok(())
    };
    let mut shown = |out: &mut std::io::StdoutLock, views: Vec<ScheduleView>| {
        for view in views {
            unmet.remove(view.id.as_str());
            if json {
                emit(out, view.to_json())?;
            } else {
                writeln!(out, "{}", line(&view))?;
            }
        }
        anyhow::Ok(())
    };
    let mut after = None;
    loop {
        let page = operator
            .schedules_upcoming_page(after.as_ref(), LIST_PAGE)
            .await?;
        shown(&mut out, page.schedules)?;
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let mut from = Some(zdelay::schedules::IdleCursor::default());
    while let Some(cursor) = from {
        let idle = operator.schedules_idle(cursor, LIST_PAGE).await?;
        shown(&mut out, idle.schedules)?;
        from = idle.next;
    }
    for q in quarantined.iter().filter(|q| unmet.contains(q.id.as_str())) {
        if json {
            emit(
                &mut out,
                unreadable_json(&q.id, Some(Place::of(q.shard, q.lane)), &q.quarantine),
            )?;
        } else {
            writeln!(out, "{}", unreadable_line(&q.id, &q.quarantine))?;
        }
    }
    if json {
        writeln!(out, "{}", if first { "[]" } else { "\n]" })?;
    }
    Ok(())
}

/// Schedules `schedule list` reads per call.
const LIST_PAGE: usize = 1000;

/// Runs a `schedule` action that needs Redis.
pub async fn run(client: &Client, action: ScheduleAction) -> anyhow::Result<i32> {
    match action {
        ScheduleAction::Set(args) => set(client, *args).await,
        ScheduleAction::List { output } => {
            list(client, output.is_json()).await?;
            Ok(0)
        }
        ScheduleAction::Get {
            id,
            ignore_not_found,
            output,
        } => match client.schedule_get(&id).await? {
            Some(view) if output.is_json() => {
                println!("{}", serde_json::to_string_pretty(&view.to_json())?);
                Ok(0)
            }
            Some(view) => {
                println!("{}\n{}", line(&view), health_line(&view));
                Ok(0)
            }
            None => match client.operator().schedule_quarantine(&id).await? {
                Some(quarantine) if output.is_json() => {
                    // The lane was found by asking each one, and is not kept.
                    let v = unreadable_json(&id, None, &quarantine);
                    println!("{}", serde_json::to_string_pretty(&v)?);
                    Ok(0)
                }
                Some(quarantine) => {
                    println!("{}", unreadable_line(&id, &quarantine));
                    Ok(0)
                }
                None => Ok(super::not_found(
                    ignore_not_found,
                    &format!("no schedule {id}"),
                )),
            },
        },
        ScheduleAction::Pause { id, output } => {
            let done = client.schedule_pause(&id).await?;
            report(output.is_json(), &id, "paused", done, None)
        }
        ScheduleAction::Resume { id, output } => {
            let next = client.schedule_resume(&id).await?;
            let text = match (&next, client.schedule_get(&id).await?) {
                (Some(next), Some(view)) => Some(occurrence(&view.def, *next)),
                _ => None,
            };
            report(
                output.is_json(),
                &id,
                "resumed",
                next.is_some(),
                text.zip(next.flatten()),
            )
        }
        ScheduleAction::Delete {
            id,
            output,
            ignore_not_found,
        } => {
            let done = client.schedule_delete(&id).await?;
            if !done && ignore_not_found {
                return Ok(0);
            }
            report(output.is_json(), &id, "deleted", done, None)
        }
        ScheduleAction::Preview(args) => {
            let choice = args
                .calendar
                .choice()
                .expect("only a named calendar needs Redis");
            let stored = client.calendar_get(&choice.name).await?.ok_or_else(|| {
                super::UsageError(format!(
                    "no calendar named {:?} (create it with `zdelay calendar set`)",
                    choice.name
                ))
            })?;
            let calendar = ScheduleCalendar {
                name: choice.name,
                shift: choice.shift,
                days: stored.days,
            };
            preview(args, Some(calendar))
        }
    }
}

fn report(
    json: bool,
    id: &str,
    what: &str,
    done: bool,
    next: Option<(String, i64)>,
) -> anyhow::Result<i32> {
    if !done {
        // Like every "not found": a message on stderr, nothing on stdout, exit 3.
        eprintln!("no schedule {id}");
    } else if json {
        let mut v = serde_json::json!({ "id": id, what: true });
        if let Some((_, ms)) = &next {
            v["next_ms"] = (*ms).into();
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        match &next {
            Some((text, _)) => println!("{what} {id}; next occurrence {text}"),
            None => println!("{what} {id}"),
        }
    }
    Ok(if done { 0 } else { super::EXIT_NOT_FOUND })
}

async fn set(client: &Client, args: SetArgs) -> anyhow::Result<i32> {
    if let Some(path) = &args.batch {
        if args.output.is_json() {
            return Err(super::UsageError(
                "--batch prints one line per input line: -o json does not apply".into(),
            )
            .into());
        }
        return batch::run(
            path,
            "schedules set",
            NewSchedule::from_json_line,
            async |specs| {
                let mut out = Vec::with_capacity(specs.len());
                for spec in specs {
                    let id = spec.id.clone();
                    out.push(match client.schedule_set(spec).await {
                        Ok(set) => Ok(format!(
                            "{id} {}",
                            set.next_ms.map_or("none".to_owned(), format_ms)
                        )),
                        Err(e) => Err(e.to_string()),
                    });
                }
                Ok(out)
            },
        )
        .await;
    }
    let id = args.id.expect("clap requires an id without --batch");
    let dest = args.dest.expect("clap requires --dest without --batch");
    let payload = match (args.payload, &args.payload_file) {
        (Some(text), _) => text.into_bytes(),
        (_, Some(path)) => std::fs::read(path)
            .with_context(|| format!("cannot read --payload-file {}", path.display()))?,
        (None, None) => Vec::new(),
    };
    let repeat = Repeat::from_parts(args.cron, args.every, args.tz)
        .map_err(|why| super::UsageError(format!("{why} (--cron or --every)")))?;
    let mut spec = NewSchedule::new(id.clone(), dest, payload, repeat);
    spec.headers = args.headers.into_iter().collect();
    spec.misfire =
        Misfire::from_name(args.misfire.into(), args.max_catch_up).map_err(super::UsageError)?;
    spec.start_at = args.start_at;
    spec.end_at = args.end_at;
    spec.max_lateness = args.max_lateness;
    spec.max_attempts = args.max_attempts;
    spec.jitter = args.jitter;
    spec.calendar = args.calendar.choice();
    let set = client.schedule_set(spec).await?;
    let view = client.schedule_get(&id).await?;
    let next_text = view
        .as_ref()
        .map_or_else(|| "none".to_owned(), |v| occurrence(&v.def, set.next_ms));
    if args.output.is_json() {
        let mut v = view.map(|v| v.to_json()).unwrap_or_default();
        v["created"] = set.created.into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{} {id}; next occurrence {next_text}{}",
            if set.created { "created" } else { "updated" },
            set.next_ms.map_or(String::new(), |ms| format!(" ({ms})"))
        );
    }
    Ok(0)
}

/// `schedule preview`: pure computation (a named calendar was read before).
pub fn preview(args: PreviewArgs, calendar: Option<ScheduleCalendar>) -> anyhow::Result<i32> {
    let from = args.from.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
    });
    let mut def = match Repeat::from_parts(args.repeat.cron, args.repeat.every, args.tz)
        .map_err(super::UsageError)?
    {
        Repeat::Cron { expr, tz } => ScheduleDef::cron(expr, tz),
        Repeat::Every(every) => ScheduleDef::every(every.as_millis() as u64, from),
    };
    def.calendar = calendar;
    let schedule = def.compile()?;
    let times = schedule.preview(from, args.count as usize);
    if args.output.is_json() {
        let v: Vec<_> = times
            .iter()
            .map(|(ms, skip)| {
                let mut v = serde_json::json!({ "ms": ms, "at": schedule.rfc3339(*ms) });
                if let Some(skip) = skip {
                    v["calendar"] = skip_json(&schedule, skip);
                }
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (ms, skip) in &times {
            match skip {
                None => println!("{}  {ms}", schedule.rfc3339(*ms)),
                Some(skip) => println!(
                    "{}  {ms}  {}",
                    schedule.rfc3339(*ms),
                    skip_text(&schedule, skip)
                ),
            }
        }
    }
    Ok(0)
}

/// `skipped: <why>` or `moved to <when>: <why>`.
pub fn skip_text(schedule: &zdelay::schedule::Schedule, skip: &CalendarSkip) -> String {
    match skip.moved_to {
        None => format!("skipped: {}", skip.reason()),
        Some(to) => format!(
            "moved to {} ({} business day): {}",
            schedule.rfc3339(to),
            skip.shift.name(),
            skip.reason()
        ),
    }
}

fn skip_json(schedule: &zdelay::schedule::Schedule, skip: &CalendarSkip) -> serde_json::Value {
    serde_json::json!({
        "name": skip.calendar,
        "date": skip.date.to_string(),
        "shift": skip.shift.name(),
        "reason": skip.reason(),
        "moved_to_ms": skip.moved_to,
        "moved_to": skip.moved_to.map(|ms| schedule.rfc3339(ms)),
    })
}
