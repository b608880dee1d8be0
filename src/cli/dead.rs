//! `zdelay dead list|show|replay|purge`: dead envelope jobs (and, with `--source`, dead
//! members of a raw source), by id or by filters. Bulk commands show a progress bar on a
//! terminal (stderr).

use super::render;
use super::{UsageError, When};
use clap::ArgGroup;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::time::Duration;
use zdelay::Client;
use zdelay::config::{Config, SourceConfig};
use zdelay::dead::{DeadFilter, DeadJob, DeadMember, DeadProgress, DeadSelection, ReplayOptions};

const AFTER_HELP: &str = "\
Filters (list, replay, purge) narrow what is taken; each one given must match:
  --route NAME         the job's dest, exactly (a route, or <sink>/<target>)
  --reason TEXT        a part of the reason it died with (case ignored)
  --older-than DUR     died at least DUR ago (30s, 15m, 2h, 7days…)
  --newer-than DUR     died less than DUR ago
  --schedule ID        an occurrence of recurring schedule ID (jobs without one never match)
Raw members (--source KEY) have no envelope: --reason and the ages apply to them, --route,
--schedule and --keep-attempts do not. Replay and purge take what matched when the command
started: a job that dies again meanwhile is left alone.";

#[derive(clap::Subcommand)]
#[command(after_help = AFTER_HELP)]
pub enum DeadAction {
    /// List dead jobs and dead raw members, oldest first across every shard and raw source:
    /// id, route, attempts, reason. JSON: {"jobs": [...], "raw": [...]}.
    List(ListArgs),
    /// Show one dead job: when and why it died, its earlier deaths (history), attempts and
    /// last error, route, headers, payload.
    Show(ShowArgs),
    /// Make dead jobs due again — now, or --at / --in — with their attempt count reset
    /// (--keep-attempts keeps it). Raw members (--source) go back into their source.
    /// JSON: {"replayed", "skipped", "orphans", "due_ms", "attempts" | "source"}.
    Replay(ReplayArgs),
    /// Delete dead jobs for good (envelope, reason and history). JSON: {"purged",
    /// "skipped", "source"?}.
    Purge(PurgeArgs),
}

/// The filters, shared by list, replay and purge.
#[derive(clap::Args)]
pub struct Filters {
    /// Only jobs whose dest is NAME, exactly (a route name, or <sink>/<target>).
    #[arg(long, value_name = "NAME")]
    route: Option<String>,
    /// Only jobs whose reason contains TEXT (ASCII case ignored).
    #[arg(long, value_name = "TEXT")]
    reason: Option<String>,
    /// Only jobs that died at least DURATION ago (30s, 15m, 2h, 7days…).
    #[arg(long, value_name = "DURATION", value_parser = zdelay::dead::parse_age)]
    older_than: Option<Duration>,
    /// Only jobs that died less than DURATION ago.
    #[arg(long, value_name = "DURATION", value_parser = zdelay::dead::parse_age)]
    newer_than: Option<Duration>,
    /// Only occurrences of the recurring schedule ID (the envelope meta's `schedule`); jobs
    /// without one never match.
    #[arg(long, value_name = "ID")]
    schedule: Option<String>,
}

impl Filters {
    fn filter(&self) -> DeadFilter {
        DeadFilter {
            route: self.route.clone(),
            reason: self.reason.clone(),
            older_than: self.older_than,
            newer_than: self.newer_than,
            schedule: self.schedule.clone(),
        }
    }
}

#[derive(clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct ListArgs {
    /// At most this many rows in all (jobs and raw members, after filtering): the oldest
    /// (1..=100000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    limit: u32,
    #[command(flatten)]
    output: super::Output,
    /// Only the dead members of this configured raw source (its key). Raw members have no
    /// envelope: --route and --schedule do not apply.
    #[arg(long, value_name = "KEY", conflicts_with_all = ["route", "schedule"])]
    source: Option<String>,
    #[command(flatten)]
    filters: Filters,
}

#[derive(clap::Args)]
pub struct ShowArgs {
    /// The job's id; with --source, the member's id as `dead list` prints it
    /// (<died ms>-<16 hex digits>, or <source>:<id>; the 16 hex digits alone are looked for
    /// among the oldest 10000 dead members only).
    id: String,
    /// ID is a dead member of this configured raw source (its key).
    #[arg(long, value_name = "KEY")]
    source: Option<String>,
    /// The job's destination (its route, or <sink>/<target>): a user-chosen id is unique per
    /// route only, and this finds it in one call, also when other routes hold the same id.
    #[arg(long, conflicts_with = "source")]
    dest: Option<String>,
    #[command(flatten)]
    output: super::Output,
}

/// Which dead jobs replay and purge take: ids, everything, one raw source, or filters.
#[derive(clap::Args)]
#[command(group(
    ArgGroup::new("which")
        .required(true)
        .multiple(true)
        .args(["ids", "all", "source", "route", "reason", "older_than", "newer_than", "schedule"])
))]
pub struct Select {
    /// These job ids (repeatable); with --source, these member ids. Not with filters: ids
    /// name jobs exactly.
    #[arg(
        long = "id",
        value_name = "ID",
        conflicts_with_all = ["all", "route", "reason", "older_than", "newer_than", "schedule"]
    )]
    ids: Vec<String>,
    /// Every job that is dead when the command starts. Not with filters or --source (they
    /// narrow the selection; --all takes everything).
    #[arg(long, conflicts_with_all = ["source", "route", "reason", "older_than", "newer_than", "schedule"])]
    all: bool,
    /// The dead members of this configured raw source (its key): all of them, or those
    /// --id, --reason, --older-than, --newer-than select. Raw members have no envelope:
    /// --route, --schedule and --keep-attempts do not apply.
    #[arg(long, value_name = "KEY", conflicts_with_all = ["route", "schedule"])]
    source: Option<String>,
    #[command(flatten)]
    filters: Filters,
}

impl Select {
    fn selection(&self) -> DeadSelection {
        if self.ids.is_empty() {
            DeadSelection::Matching(self.filters.filter())
        } else {
            DeadSelection::Ids(self.ids.clone())
        }
    }
}

#[derive(clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct ReplayArgs {
    #[command(flatten)]
    select: Select,
    #[command(flatten)]
    when: When,
    /// Keep each job's attempt count instead of resetting it to 0: a job that gave up gets
    /// one more try before it dies again.
    #[arg(long, conflicts_with = "source")]
    keep_attempts: bool,
    #[command(flatten)]
    output: super::Output,
}

#[derive(clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct PurgeArgs {
    #[command(flatten)]
    select: Select,
    #[command(flatten)]
    output: super::Output,
}

pub async fn run(client: &Client, config: &Config, action: DeadAction) -> anyhow::Result<i32> {
    match action {
        DeadAction::List(args) => list(client, config, args).await,
        DeadAction::Show(args) => show(client, config, args).await,
        DeadAction::Replay(args) => replay(client, config, args).await,
        DeadAction::Purge(args) => purge(client, config, args).await,
    }
}

async fn list(client: &Client, config: &Config, args: ListArgs) -> anyhow::Result<i32> {
    let filter = args.filters.filter();
    // One more than shown from each shard and source: then "more match" is exact.
    let read = (args.limit as usize).saturating_add(1);
    let (jobs, sources) = match &args.source {
        Some(key) => (Vec::new(), vec![source(config, key)?]),
        None => (
            client.operator().dead_jobs(&filter, read).await?,
            config.sources.iter().collect(),
        ),
    };
    let envelope_only = filter.envelope_only();
    let mut raw = Vec::new();
    if envelope_only.is_empty() {
        for source in sources {
            for member in client
                .operator()
                .raw_dead_members(source, &filter, read)
                .await?
            {
                raw.push((source.key.as_str(), member));
            }
        }
    } else if !config.sources.is_empty() {
        eprintln!(
            "raw members not listed: {} applies to envelope jobs only",
            envelope_only.join(" and ")
        );
    }
    let (jobs, raw, more) = oldest(jobs, raw, args.limit as usize);
    if args.output.is_json() {
        let raw: Vec<_> = raw.iter().map(|(source, m)| m.to_json(source)).collect();
        let v = serde_json::json!({ "jobs": jobs, "raw": raw });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        // One list, oldest first, whichever shard or source each row comes from.
        let mut rows: Vec<(i64, String)> = jobs
            .iter()
            .map(|j| (j.died_ms, render::dead_job_line(j)))
            .chain(
                raw.iter()
                    .map(|(source, m)| (m.died_ms, render::dead_member_line(source, m))),
            )
            .collect();
        rows.sort_by_key(|(died, _)| *died);
        for (_, line) in rows {
            println!("{line}");
        }
        eprintln!(
            "{} dead jobs, {} dead raw members{}",
            jobs.len(),
            raw.len(),
            if more {
                format!(" (the oldest {}: more match; raise --limit)", args.limit)
            } else {
                String::new()
            }
        );
    }
    Ok(0)
}

/// The `limit` oldest of every shard's and source's oldest (each read `limit` + 1, so the
/// overall oldest are among them), and whether any was left out.
fn oldest(
    mut jobs: Vec<DeadJob>,
    mut raw: Vec<(&str, DeadMember)>,
    limit: usize,
) -> (Vec<DeadJob>, Vec<(&str, DeadMember)>, bool) {
    let more = jobs.len() + raw.len() > limit;
    jobs.sort_by_key(|j| j.died_ms);
    raw.sort_by_key(|(_, m)| m.died_ms);
    // Merge by time of death: the cut-off is the `limit`-th oldest of both lists.
    let (mut taken_jobs, mut taken_raw) = (0, 0);
    while taken_jobs + taken_raw < limit {
        match (jobs.get(taken_jobs), raw.get(taken_raw)) {
            (Some(j), Some((_, m))) if j.died_ms <= m.died_ms => taken_jobs += 1,
            (_, Some(_)) => taken_raw += 1,
            (Some(_), None) => taken_jobs += 1,
            (None, None) => break,
        }
    }
    jobs.truncate(taken_jobs);
    raw.truncate(taken_raw);
    (jobs, raw, more)
}

async fn show(client: &Client, config: &Config, args: ShowArgs) -> anyhow::Result<i32> {
    if let Some(key) = &args.source {
        let source = source(config, key)?;
        return Ok(
            match client.operator().raw_dead_show(source, &args.id).await? {
                Some(m) => {
                    if args.output.is_json() {
                        let v = render::dead_member_detail_json(key, &m);
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        print!("{}", render::dead_member_detail(key, &m));
                    }
                    0
                }
                None => super::not_found(
                    false,
                    &format!("no dead member of {key} has the id {}", args.id),
                ),
            },
        );
    }
    Ok(
        match client
            .operator()
            .dead_show_at(args.dest.as_deref(), &args.id)
            .await?
        {
            Some(job) => {
                if args.output.is_json() {
                    let v = render::dead_detail_json(&job);
                    println!("{}", serde_json::to_string_pretty(&v)?);
                } else {
                    print!("{}", render::dead_detail(&job));
                }
                0
            }
            None => super::not_found(
                false,
                &format!(
                    "{} is not dead (`zdelay get {}` says whether and where it is stored)",
                    args.id, args.id
                ),
            ),
        },
    )
}

async fn replay(client: &Client, config: &Config, args: ReplayArgs) -> anyhow::Result<i32> {
    let selection = args.select.selection();
    let due = args.when.due();
    let bar = Progress::new("replayed");
    let r = match &args.select.source {
        Some(key) => {
            let source = source(config, key)?;
            client
                .operator()
                .raw_dead_replay_selected(source, &selection, due, bar.reporter())
                .await?
        }
        None => {
            let options = ReplayOptions {
                due,
                keep_attempts: args.keep_attempts,
            };
            client
                .operator()
                .dead_replay_selected(&selection, options, bar.reporter())
                .await?
        }
    };
    bar.finish();
    if args.output.is_json() {
        let mut v = serde_json::to_value(r)?;
        match &args.select.source {
            Some(key) => {
                v["source"] = key.as_str().into();
            }
            None => {
                v["attempts"] = if args.keep_attempts { "kept" } else { "reset" }.into();
            }
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("replayed {}", r.replayed);
    if let (Some(due), true) = (
        r.due_ms,
        args.when.at.is_some() || args.when.delay.is_some(),
    ) {
        eprintln!("due at {}", render::format_ms(due));
    }
    if r.orphans > 0 {
        eprintln!(
            "{} dead ids have no envelope and stay dead (purge them)",
            r.orphans
        );
    }
    if r.skipped > 0 {
        eprintln!(
            "{} were not dead, or died again since the command started: left as they are",
            r.skipped
        );
    }
    Ok(0)
}

async fn purge(client: &Client, config: &Config, args: PurgeArgs) -> anyhow::Result<i32> {
    let selection = args.select.selection();
    let bar = Progress::new("purged");
    let p = match &args.select.source {
        Some(key) => {
            let source = source(config, key)?;
            client
                .operator()
                .raw_dead_purge_selected(source, &selection, bar.reporter())
                .await?
        }
        None => {
            client
                .operator()
                .dead_purge_selected(&selection, bar.reporter())
                .await?
        }
    };
    bar.finish();
    if args.output.is_json() {
        let mut v = serde_json::to_value(p)?;
        if let Some(key) = &args.select.source {
            v["source"] = key.as_str().into();
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    println!("purged {}", p.purged);
    if p.skipped > 0 {
        eprintln!(
            "{} were not dead, or died again since the command started: left as they are",
            p.skipped
        );
    }
    Ok(0)
}

/// The progress bar of a bulk command: drawn on stderr when it is a terminal, hidden
/// otherwise (so piped or captured output stays clean).
struct Progress {
    bar: ProgressBar,
    verb: &'static str,
}

impl Progress {
    fn new(verb: &'static str) -> Self {
        let bar = if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} reading dead jobs: {msg}")
                    .expect("a valid template"),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        Progress { bar, verb }
    }

    /// The callback the library reports progress to.
    fn reporter(&self) -> impl FnMut(DeadProgress) + Send + use<> {
        let bar = self.bar.clone();
        let verb = self.verb;
        let mut acting = false;
        move |p| match p {
            DeadProgress::Selecting { scanned, selected } => {
                bar.set_message(format!("{scanned} read, {selected} selected"));
                bar.tick();
            }
            DeadProgress::Acting { done, total } => {
                if !acting {
                    acting = true;
                    bar.set_style(
                        ProgressStyle::with_template(&format!(
                            "{{bar:40}} {{pos}}/{{len}} {verb} ({{per_sec}}, {{eta}} left)"
                        ))
                        .expect("a valid template"),
                    );
                    bar.set_length(total);
                }
                bar.set_position(done);
            }
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn source<'a>(config: &'a Config, key: &str) -> anyhow::Result<&'a SourceConfig> {
    config.sources.iter().find(|s| s.key == key).ok_or_else(|| {
        let known: Vec<&str> = config.sources.iter().map(|s| s.key.as_str()).collect();
        UsageError(format!(
            "--source {key}: no such raw source in the config (configured: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        ))
        .into()
    })
}

#[cfg(test)]
mod tests {
    use crate::cli::Cli;
    use clap::Parser;
    use clap::error::ErrorKind;

    fn parse(args: &str) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("zdelay").chain(args.split_whitespace()))
    }

    fn refused(args: &str, kind: ErrorKind, says: &[&str]) {
        let e = match parse(args) {
            Ok(_) => panic!("{args:?} was accepted"),
            Err(e) => e,
        };
        assert_eq!(e.kind(), kind, "{args:?}: {e}");
        let text = e.to_string();
        for s in says {
            assert!(text.contains(s), "{args:?}: {text}");
        }
    }

    #[test]
    fn good_combinations_parse() {
        for args in [
            "dead list",
            "dead list --route emails --reason WRONGTYPE --older-than 1h --json",
            "dead list --source raw:a --reason seconds --newer-than 1d",
            "dead show some-id --json",
            "dead show --source raw:a a9993e364706816a",
            "dead replay --all",
            "dead replay --id a --id b --keep-attempts --in 10m",
            "dead replay --route emails --older-than 5m --at 2030-01-01T00:00:00Z --json",
            "dead replay --schedule nightly",
            "dead replay --source raw:a --reason seconds --in 1h",
            "dead replay --source raw:a --id a9993e364706816a",
            "dead purge --newer-than 1h --older-than 10m --json",
            "dead purge --source raw:a",
        ] {
            if let Err(e) = parse(args) {
                panic!("{args:?} refused: {e}");
            }
        }
    }

    #[test]
    fn senseless_combinations_are_refused() {
        let conflict = ErrorKind::ArgumentConflict;
        refused("dead replay", ErrorKind::MissingRequiredArgument, &["--id"]);
        refused(
            "dead purge --json",
            ErrorKind::MissingRequiredArgument,
            &["--all"],
        );
        refused(
            "dead replay --all --route x",
            conflict,
            &["--all", "--route"],
        );
        refused("dead purge --all --id x", conflict, &["--all", "--id"]);
        refused(
            "dead replay --id x --reason y",
            conflict,
            &["--id", "--reason"],
        );
        refused("dead replay --all --source raw:a", conflict, &["--source"]);
        refused(
            "dead replay --source raw:a --route x",
            conflict,
            &["--source", "--route"],
        );
        refused(
            "dead purge --source raw:a --schedule s",
            conflict,
            &["--schedule"],
        );
        refused(
            "dead replay --source raw:a --keep-attempts",
            conflict,
            &["--keep-attempts"],
        );
        refused(
            "dead replay --all --at 1 --in 1s",
            conflict,
            &["--at", "--in"],
        );
        refused("dead list --source raw:a --route x", conflict, &["--route"]);
        refused(
            "dead purge --all --in 1s",
            ErrorKind::UnknownArgument,
            &["--in"],
        );
        refused(
            "dead purge --all --keep-attempts",
            ErrorKind::UnknownArgument,
            &[],
        );
        refused("dead list --id x", ErrorKind::UnknownArgument, &["--id"]);
        refused(
            "dead list --older-than soon",
            ErrorKind::ValueValidation,
            &["soon"],
        );
        refused("dead show", ErrorKind::MissingRequiredArgument, &["<ID>"]);
    }
}
