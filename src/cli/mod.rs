//! The `zdelay` command line: argument definitions and dispatch. Each command is a thin
//! layer: parse → one library call → render (`render`), with JSON-lines input in `batch`.
//!
//! Exit codes: 0 success; 1 an error; 2 a usage error (clap's own, or [`UsageError`]) or bad
//! `--batch` lines; 3 ([`EXIT_NOT_FOUND`]) no such job or schedule, or not pending;
//! 130 a second signal during `run`. Messages about failures go to stderr, data to stdout.
//!
//! Output: every command that prints takes `-o text|json` ([`Output`]; `--json` is the same
//! as `-o json`): text for people, JSON (one document) for scripts.

mod batch;
mod calendar;
mod clock;
mod dead;
mod doctor;
mod enqueue;
mod ics;
mod render;
mod reshard;
mod schedule;
mod upgrade;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zdelay::config::{self, Config};
use zdelay::startup::{GlobalArgs, quiet_clients};
use zdelay::{Cancelled, Client, ClientError, Due, Routes};

#[derive(Parser)]
#[command(
    name = "zdelay",
    version,
    about = "Precise, reliable delayed delivery from Redis sorted sets to Redis lists, Kafka \
             topics, RabbitMQ (AMQP) exchanges and queues, and NATS subjects."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The log filter to use: `--log`, except for `check-config --connect` left at the
    /// default, where the broker clients' own connection chatter (a passive declare of a
    /// missing exchange is an ERROR to lapin) and the sinks' outage lines would bury the
    /// checks' lines, which already say what each sink found.
    pub fn log_filter(&self) -> String {
        match self.command {
            Command::CheckConfig { connect: true, .. } if self.global.log == "info" => {
                "warn,lapin=off,async_nats=off,rdkafka=off,zdelay::sinks=off,zdelay::metrics=off"
                    .to_owned()
            }
            _ => quiet_clients(&self.global.log),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: deliver due jobs to their routes (Redis lists, Kafka, AMQP, NATS)
    /// until SIGTERM or SIGINT.
    Run,
    /// Schedule a job and print its id, or many with --batch (one id per input line).
    /// JSON (one job): {"id", "kept", "duplicate"} (kept: the id existed and --on-conflict keep left it; duplicate: it was delivered or dead within its --unique-for window, nothing written).
    Enqueue(enqueue::EnqueueArgs),
    /// Cancel a pending job by id (exit 3 if it is delivered, dead or unknown; 1 if it is
    /// being delivered). JSON: {"id", "cancelled": true}.
    Cancel {
        /// The job's id, as enqueue printed it.
        id: String,
        /// The job's destination (its route, or <sink>/<target>): a user-chosen id is unique
        /// per route only, and this finds it in one call, also when other routes hold the
        /// same id.
        #[arg(long)]
        dest: Option<String>,
        /// Exit 0, printing nothing, when the job is not pending.
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Move a pending job to a new due time (exit 3 if it is not pending). JSON: {"id",
    /// "due_ms", "due"} (due as RFC 3339).
    Reschedule {
        /// The job's id, as enqueue printed it.
        id: String,
        /// The job's destination (its route, or <sink>/<target>): a user-chosen id is unique
        /// per route only, and this finds it in one call, also when other routes hold the
        /// same id.
        #[arg(long)]
        dest: Option<String>,
        #[command(flatten)]
        when: RequiredWhen,
        #[command(flatten)]
        output: Output,
    },
    /// Show a job by id: destination, payload, headers, state, due time (exit 3 if no job
    /// with this id is stored). JSON: the envelope's fields plus "id", "shard", "state" and
    /// "due" | "lease_deadline" | "died" (epoch ms).
    Get {
        /// The job's id, as enqueue printed it.
        id: String,
        /// The job's destination (its route, or <sink>/<target>): a user-chosen id is unique
        /// per route only, and this finds it in one call, also when other routes hold the
        /// same id.
        #[arg(long)]
        dest: Option<String>,
        /// Exit 0, printing nothing, when no job with this id is stored.
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Backlog: totals (due now, scheduled later, in flight, dead, oldest due age), one line
    /// per raw source, per two-phase sink (health, jobs waiting, held targets) and per
    /// running daemon; per-shard rows with --shards. JSON (always in full): {"now_ms",
    /// "total", "shards", "sources", "sinks", "waiting", "instances", "recent"}.
    Stats {
        /// Also one row per shard (text; JSON always has them).
        #[arg(long)]
        shards: bool,
        #[command(flatten)]
        output: Output,
    },
    /// What falls due in each step ahead (per shard and raw source, and in total), the
    /// overdue backlog, and steps holding more than the last hour's delivery rate drains
    /// (spikes). Counted in Redis with ZCOUNT per step: cheap on millions of jobs. JSON: the
    /// shape of GET /api/forecast.
    Forecast {
        /// How far ahead (at most 1440 steps).
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        next: Duration,
        /// Step length (at least 1s).
        #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
        step: Duration,
        #[command(flatten)]
        output: Output,
    },
    /// Recurring schedules: set (create or update), list, get, pause, resume, delete, and
    /// preview the next occurrences of a cron expression or interval.
    Schedule {
        #[command(subcommand)]
        action: schedule::ScheduleAction,
    },
    /// Calendars: named sets of days schedules skip (dates, an iCalendar file's events, and
    /// weekend days): set, list, get, delete.
    Calendar {
        #[command(subcommand)]
        action: calendar::CalendarAction,
    },
    /// A test namespace's clock ([testing] clock = true): show it, or move it forward so
    /// that jobs, schedules, leases and windows far ahead fall due now.
    Clock {
        #[command(subcommand)]
        action: clock::ClockAction,
    },
    /// Dead jobs: list them (with filters), show one with its history, replay them (now or
    /// later, attempts reset), or purge them.
    Dead {
        #[command(subcommand)]
        action: dead::DeadAction,
    },
    /// Move the namespace's jobs to another shard count, without loss or duplicates.
    ///
    /// Changes the number of spread shards (the jobs, dead jobs, schedules, unique windows and
    /// debounce deadlines of two-phase routes: Kafka, RabbitMQ, NATS, remote Redis) online,
    /// with producers and daemons running: they follow the new count at its fence, and the
    /// old shards move earliest due first. Route lanes (local routes) are not resharded: each
    /// lives in its list's slot.
    ///
    /// Each job is copied into its new shard before the old copy is deleted, so a crash loses
    /// nothing: run the same command again and it finishes. A namespace still on storage
    /// layout 1 is upgraded first (zdelay upgrade). Without --yes it shows what it would do
    /// and asks.
    Reshard(reshard::ReshardArgs),
    /// Move a namespace an older release created on storage layout 1 onto route lanes and
    /// spread shards, while that release's producers enqueue and its daemons deliver.
    ///
    /// Run it with the older release's daemons and producers still running (they follow the
    /// upgrade onto route lanes at its fence; this release's refuse the namespace until it
    /// has finished), then roll out this release. It refuses while a registered daemon cannot
    /// follow (and names it). It registers the config's route lanes, announces the upgrade,
    /// fences the layout-1 shards, then moves every job, dead job and schedule, earliest due
    /// first: local routes' into their lanes, the rest into spread shards. Each job is
    /// written once into its new home before it is deleted from the old one, so a crash
    /// loses nothing and delivers nothing twice: run the same command again and it finishes.
    /// Without --yes it shows what it would do and asks.
    Upgrade(upgrade::UpgradeArgs),
    /// Load and validate the config, then print the effective config (secrets as ***): as
    /// TOML, the config file's own form, or with -o json as JSON; and a summary of sinks and
    /// routes on stderr. Offline unless --connect.
    ///
    /// With --connect: connect to Redis and to every sink and check what the daemon will
    /// need — login, ACL rights, the namespace's layout, each route's destination object
    /// (Kafka topic, AMQP exchange, JetStream stream and its duplicate window). One line per
    /// check, with what to create when something is missing; exit 0 when all pass, 1
    /// otherwise. JSON: {"ok", "checks": [{"check", "ok", "detail", "hint"?}]}.
    CheckConfig {
        /// Check Redis, the ACL rights and every sink's destination objects.
        #[arg(long)]
        connect: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Print the hash tag of a Redis Cluster slot: the shortest string over 0-9a-z whose
    /// CRC-16 modulo 16384 is the slot (the first in ASCII order among equally short ones).
    /// A local route's lane keeps its jobs in its list's slot under this tag.
    ///
    /// A number 0..=16383 is a slot; anything else is a key, and its slot (of its own hash
    /// tag, if it has one) is printed too. Needs no config and no Redis. JSON: {"slot",
    /// "tag"}, with "key" for a key.
    SlotTag {
        /// A slot number (0..=16383), or a key.
        #[arg(value_name = "SLOT_OR_KEY")]
        slot_or_key: String,
        /// Take the argument as a key even when it is a number.
        #[arg(long)]
        key: bool,
        #[command(flatten)]
        output: Output,
    },
    /// Print a shell completion script, e.g.
    /// `zdelay completions bash > /etc/bash_completion.d/zdelay`.
    Completions { shell: clap_complete::Shell },
    /// Print the manual page (roff), every command in one page, e.g.
    /// `zdelay man > /usr/local/share/man/man1/zdelay.1`.
    Man,
    /// Write the reference pages made from the code (docs/reference/) and the config part of
    /// the chart's values schema; with --check, only list the files that differ (exit 1).
    #[command(hide = true)]
    GenDocs {
        /// The repository's root.
        #[arg(default_value = ".")]
        root: PathBuf,
        #[arg(long)]
        check: bool,
    },
}

/// How a command prints: `-o text|json`, `--json` the same as `-o json`.
/// Asks `question` on the terminal; `Ok(false)` unless answered yes. Without a terminal it
/// refuses ("not <doing>: pass --yes …"): a script must say `--yes`.
fn confirm(doing: &str, question: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Err(UsageError(format!(
            "not {doing}: pass --yes to go ahead (or --dry-run to only look)"
        ))
        .into());
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

#[derive(clap::Args, Clone, Copy, Default, Debug)]
pub struct Output {
    /// Output format: text for people, json (stable, for scripts).
    #[arg(
        short = 'o',
        long = "output",
        value_enum,
        value_name = "FORMAT",
        default_value_t
    )]
    format: Format,
    /// The same as -o json.
    #[arg(long, conflicts_with = "format")]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Default, Debug)]
pub enum Format {
    #[default]
    Text,
    Json,
}

impl Output {
    pub fn is_json(&self) -> bool {
        self.json || self.format == Format::Json
    }
}

/// Prints `v` as pretty JSON on stdout.
pub fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// When a job is due; neither flag means now.
#[derive(clap::Args, Default)]
#[group(multiple = false)]
pub struct When {
    /// Due time: RFC 3339 with Z or a UTC offset (2026-12-01T09:00:00+01:00,
    /// 2026-11-21T14:03:07.250Z), or epoch milliseconds.
    #[arg(long, value_parser = zdelay::job::parse_at)]
    at: Option<i64>,
    /// Delay from now, measured on Redis's clock: 250ms, 5s, 1h30m, …
    #[arg(long = "in", value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
}

impl When {
    pub fn due(&self) -> Due {
        match (self.at, self.delay) {
            (Some(ms), _) => Due::At(ms),
            (_, Some(d)) => Due::In(d),
            _ => Due::In(Duration::ZERO),
        }
    }
}

/// A new due time: exactly one of the flags.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct RequiredWhen {
    /// New due time: RFC 3339 with Z or a UTC offset (2026-12-01T09:00:00+01:00,
    /// 2026-11-21T14:03:07.250Z), or epoch milliseconds.
    #[arg(long, value_parser = zdelay::job::parse_at)]
    at: Option<i64>,
    /// New delay from now, measured on Redis's clock: 250ms, 5s, 1h30m, …
    #[arg(long = "in", value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
}

impl RequiredWhen {
    fn due(&self) -> Due {
        When {
            at: self.at,
            delay: self.delay,
        }
        .due()
    }
}

/// Exit code of "no such job or schedule" and "not pending" (0 with `--ignore-not-found`).
pub const EXIT_NOT_FOUND: i32 = 3;

/// `EXIT_NOT_FOUND`, with `why` on stderr, or 0 and nothing printed when ignored.
fn not_found(ignore: bool, why: &str) -> i32 {
    if ignore {
        return 0;
    }
    eprintln!("{why}");
    EXIT_NOT_FOUND
}

/// A command used wrongly in a way clap cannot see (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Runs the command; returns the exit code.
pub async fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    // Needing no config: they describe the command line, or the key layout, itself.
    match &cli.command {
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            // Into a buffer first: `generate` panics on a write error (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut cmd, "zdelay", &mut script);
            return write_stdout(&script);
        }
        Command::Man => {
            return write_stdout(&man_page(<Cli as clap::CommandFactory>::command())?);
        }
        Command::SlotTag {
            slot_or_key,
            key,
            output,
        } => return slot_tag(slot_or_key, *key, *output),
        Command::GenDocs { root, check } => {
            let cli = <Cli as clap::CommandFactory>::command();
            let stale = zdelay::reference::update(root, cli, *check).map_err(anyhow::Error::msg)?;
            for path in &stale {
                eprintln!("{} {path}", if *check { "stale:" } else { "wrote" });
            }
            if *check && !stale.is_empty() {
                eprintln!("regenerate with: {}", zdelay::reference::REGENERATE);
                return Ok(1);
            }
            return Ok(0);
        }
        _ => {}
    }
    let config = cli.global.load_config()?;
    let origin = ConfigOrigin(cli.global.config.clone());
    match cli.command {
        Command::Run => {
            let shutdown = CancellationToken::new();
            tokio::spawn(zdelay::app::watch_signals(shutdown.clone()));
            zdelay::app::run(config, shutdown).await?;
            Ok(0)
        }
        Command::CheckConfig {
            connect: true,
            output,
        } => doctor::run(&config, output).await,
        Command::CheckConfig { output, .. } => {
            if output.is_json() {
                print_json(&config)?;
            } else {
                print!("{}", config_toml(&config)?);
            }
            eprintln!(
                "config OK ({}): {} sinks, {} routes, {} sources{}",
                origin,
                config.sinks.len(),
                config.routes.len(),
                config.sources.len(),
                if config.redis.cluster_nodes.is_empty() {
                    ""
                } else {
                    ", on a Redis Cluster"
                }
            );
            for line in Routes::from_config(&config).explain_lanes() {
                eprintln!("  {line}");
            }
            Ok(0)
        }
        Command::Schedule {
            action: schedule::ScheduleAction::Preview(args),
        } if !args.needs_redis() => schedule::preview(args, None),
        // Not through `client()`: the namespace may be frozen, or resharded already.
        Command::Reshard(args) => reshard::run(&config, args).await,
        Command::Upgrade(args) => upgrade::run(&config, args).await,
        command => {
            let client = client(&config).await?;
            operate(&client, &config, &origin, command)
                .await
                .map_err(|e| origin.explain(e))
        }
    }
}

/// The effective config as TOML: a file that loads as this config (secrets as ***).
fn config_toml(config: &Config) -> anyhow::Result<String> {
    // Through JSON: TOML has no null, and a table must follow the plain values of its parent.
    let value = serde_json::to_value(config)?;
    Ok(toml::to_string(&without_nulls(value))?)
}

fn without_nulls(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(without_nulls).collect()),
        other => other,
    }
}

/// Where the config came from, for messages that depend on it.
struct ConfigOrigin(Option<PathBuf>);

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(path) => write!(f, "{}", path.display()),
            None => f.write_str("built-in defaults, no --config"),
        }
    }
}

impl ConfigOrigin {
    /// Adds where the routes came from to an unknown-destination error.
    fn explain(&self, e: anyhow::Error) -> anyhow::Error {
        if !matches!(
            e.downcast_ref::<ClientError>(),
            Some(ClientError::UnknownDestination { .. })
        ) {
            return e;
        }
        let hint = match &self.0 {
            Some(path) => format!("routes are read from {}", path.display()),
            None => "no --config given, so only the built-in route \"default\" exists: pass \
                     --config FILE (or set ZDELAY_CONFIG)"
                .to_owned(),
        };
        e.context(hint)
    }
}

async fn client(config: &Config) -> anyhow::Result<Client> {
    // With [testing] clock = true a namespace the CLI creates gets a test clock, so the daemon
    // started later agrees, and a production one is refused; without it the CLI takes the
    // namespace as it is (a test's commands need not repeat the setting).
    Ok(
        Client::connect_testing(&config.redis, config.testing.clock.then_some(true))
            .await?
            .with_routes(Routes::from_config(config))
            .with_max_payload(config.poller.max_payload),
    )
}

async fn operate(
    client: &Client,
    config: &Config,
    origin: &ConfigOrigin,
    command: Command,
) -> anyhow::Result<i32> {
    match command {
        Command::Enqueue(args) => enqueue::run(client, args).await,
        Command::Cancel {
            id,
            dest,
            ignore_not_found,
            output,
        } => Ok(match client.cancel_at(dest.as_deref(), &id).await? {
            Cancelled::Cancelled => {
                if output.is_json() {
                    print_json(&serde_json::json!({ "id": id, "cancelled": true }))?;
                } else {
                    println!("cancelled {id}");
                }
                0
            }
            Cancelled::InFlight => {
                eprintln!("{id} is being delivered; not cancelled");
                1
            }
            Cancelled::NotPending => not_found(
                ignore_not_found,
                &format!("{id} is not pending (delivered, dead or unknown)"),
            ),
        }),
        Command::Reschedule {
            id,
            dest,
            when,
            output,
        } => Ok(
            match client
                .reschedule_at(dest.as_deref(), &id, when.due())
                .await?
            {
                Some(due) => {
                    if output.is_json() {
                        print_json(&serde_json::json!({
                            "id": id, "due_ms": due, "due": render::format_ms(due)
                        }))?;
                    } else {
                        println!("{id} due at {}", render::format_ms(due));
                    }
                    0
                }
                None => not_found(
                    false,
                    &format!("{id} is not pending (delivered, dead, in flight or unknown)"),
                ),
            },
        ),
        Command::Get {
            id,
            dest,
            ignore_not_found,
            output,
        } => Ok(match client.get_at(dest.as_deref(), &id, None).await? {
            Some(job) if output.is_json() => {
                print_json(&job.to_json())?;
                0
            }
            Some(job) => {
                // "in 30d" from the namespace's clock: a test clock's, once moved.
                let now_ms = client.connection().now_ms().await?;
                print!("{}", render::job_text(&job.to_json(), now_ms));
                0
            }
            None => not_found(
                ignore_not_found,
                &format!(
                    "no job {id} is stored: it was delivered, cancelled or purged, or never \
                     enqueued (in namespace {} of {origin})",
                    config.redis.namespace
                ),
            ),
        }),
        Command::Stats { shards, output } => {
            if output.is_json() {
                let v = zdelay::stats::report(&mut client.connection(), config)
                    .await
                    .context("gathering stats")?;
                print_json(&v)?;
            } else {
                let stats = zdelay::stats::gather(&mut client.connection(), config)
                    .await
                    .context("gathering stats")?;
                print!("{}", render::stats_text(&stats, shards));
            }
            Ok(0)
        }
        Command::Forecast { next, step, output } => {
            let horizon = zdelay::stats::Horizon::new(next, step).map_err(UsageError)?;
            let forecast = zdelay::stats::forecast(&mut client.connection(), config, horizon)
                .await
                .context("forecast")?;
            if output.is_json() {
                print_json(&forecast)?;
            } else {
                print!("{}", render::forecast_table(&forecast));
            }
            Ok(0)
        }
        Command::Clock { action } => clock::run(client, action).await,
        Command::Dead { action } => dead::run(client, config, action).await,
        Command::Schedule { action } => schedule::run(client, action).await,
        Command::Calendar { action } => calendar::run(client, action).await,
        Command::Run
        | Command::CheckConfig { .. }
        | Command::Reshard(_)
        | Command::Upgrade(_)
        | Command::Completions { .. }
        | Command::SlotTag { .. }
        | Command::Man
        | Command::GenDocs { .. } => {
            unreachable!("handled above")
        }
    }
}

/// `zdelay slot-tag`: a slot's tag, or a key's slot and its tag.
fn slot_tag(arg: &str, as_key: bool, output: Output) -> anyhow::Result<i32> {
    use zdelay::keys::{SLOTS, slot_of, slot_tag};
    let is_number = !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_digit());
    let (key, slot) = if is_number && !as_key {
        let slot = arg.parse::<u16>().ok().filter(|&s| s < SLOTS).ok_or_else(|| {
            UsageError(format!(
                "slot {arg} is out of range 0..={}; to look up a key that is a number, add --key",
                SLOTS - 1
            ))
        })?;
        (None, slot)
    } else {
        (Some(arg), slot_of(arg))
    };
    let tag = slot_tag(slot);
    if output.is_json() {
        let mut v = serde_json::json!({ "slot": slot, "tag": tag });
        if let Some(key) = key {
            v["key"] = key.into();
        }
        print_json(&v)?;
    } else {
        match key {
            Some(key) => println!("key {key:?}: slot {slot}, tag {tag}"),
            None => println!("slot {slot}: tag {tag}"),
        }
    }
    Ok(0)
}

/// The manual page, every command in it: the top page, then a COMMANDS section with each
/// command's synopsis, description and options (`zdelay dead list` under `zdelay dead`).
/// One page, so that it names no page `zdelay man` does not write (clap_mangen's own page
/// lists `zdelay-enqueue(1)` and the like, one page per command).
fn man_page(mut cli: clap::Command) -> std::io::Result<Vec<u8>> {
    cli.build();
    let mut commands = Vec::new();
    fn walk(cmd: &clap::Command, into: &mut Vec<clap::Command>) {
        for sub in cmd.get_subcommands() {
            if sub.is_hide_set() || sub.get_name() == "help" {
                continue;
            }
            into.push(sub.clone());
            walk(sub, into);
        }
    }
    walk(&cli, &mut commands);
    // The top page without its list of per-command pages.
    let names: Vec<String> = cli
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    let top = names
        .iter()
        .fold(cli, |cmd, name| cmd.mut_subcommand(name, |s| s.hide(true)));
    let mut page = Vec::new();
    clap_mangen::Man::new(top).render(&mut page)?;
    page.extend_from_slice(b".SH COMMANDS\n");
    for cmd in commands {
        let name = cmd.get_bin_name().unwrap_or(cmd.get_name()).to_owned();
        let man = clap_mangen::Man::new(cmd);
        let mut parts = Vec::new();
        man.render_synopsis_section(&mut parts)?;
        man.render_description_section(&mut parts)?;
        man.render_options_section(&mut parts)?;
        page.extend_from_slice(format!(".SS \"{name}\"\n").as_bytes());
        // The sections' own headings would each start a top-level section.
        for line in String::from_utf8_lossy(&parts).lines() {
            if line.starts_with(".SH") {
                page.extend_from_slice(b".PP\n");
            } else {
                page.extend_from_slice(line.as_bytes());
                page.push(b'\n');
            }
        }
    }
    Ok(page)
}

/// Writes `bytes` to stdout; a reader that closed the pipe early (`| head`) is no error.
fn write_stdout(bytes: &[u8]) -> anyhow::Result<i32> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(0),
    }
}

/// The exit code for an error that ended a command: 2 when what the user wrote is wrong — a
/// flag or argument (as clap exits for the ones it checks), the config, or the job, schedule
/// or selection given — and nothing was done; 1 when something failed on the way.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    let refused_input = matches!(
        e.downcast_ref::<ClientError>(),
        Some(
            ClientError::InvalidSelection(_)
                | ClientError::InvalidSchedule(_)
                | ClientError::BadScheduleId { .. }
                | ClientError::Schedule(_)
                | ClientError::BadId(_)
                | ClientError::ReservedId(_)
                | ClientError::SecondsLikeDue(_)
                | ClientError::UnknownDestination { .. }
                | ClientError::RouteDiffers { .. }
                | ClientError::Oversize { .. }
        )
    );
    if refused_input
        || e.downcast_ref::<UsageError>().is_some()
        || e.downcast_ref::<zdelay::schedule::ScheduleError>()
            .is_some()
        || e.downcast_ref::<zdelay::calendar::CalendarError>()
            .is_some()
        || e.downcast_ref::<config::ConfigError>().is_some()
    {
        2
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        // Every flattened `-o/--json` and alias must sit with the other flags without clash.
        <Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn the_manual_page_carries_every_command_and_names_no_other_page() {
        let page =
            String::from_utf8(man_page(<Cli as clap::CommandFactory>::command()).unwrap()).unwrap();
        // Pages are named as name(section): only the page's own title may have one.
        assert!(!page.contains("(1)"), "refers to another page");
        for command in [
            "zdelay enqueue",
            "zdelay dead list",
            "zdelay schedule preview",
        ] {
            assert!(
                page.contains(&format!(".SS \"{command}\"")),
                "{command} missing"
            );
        }
        assert!(
            page.contains("\\-\\-start\\-at"),
            "options of nested commands"
        );
    }

    #[test]
    fn usage_errors_exit_2() {
        assert_eq!(exit_code(&UsageError("x".into()).into()), 2);
        assert_eq!(
            exit_code(&ClientError::InvalidSelection("x".into()).into()),
            2
        );
        assert_eq!(exit_code(&anyhow::anyhow!("x")), 1);
        let bad_config = config::from_toml("[poller]\nbatchh = 3").unwrap_err();
        assert_eq!(exit_code(&bad_config.into()), 2);
        let bad_cron = zdelay::schedule::ScheduleDef::cron("0 9 * *", "UTC").compile();
        assert_eq!(exit_code(&bad_cron.unwrap_err().into()), 2);
    }
}
