//! The `zdelay` binary: CLI → config → telemetry → command.

use anyhow::{Context, bail};
use base64::Engine;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;
use zdelay::client::{Cancelled, Client, Due, Enqueued, NewJob, OnConflict};
use zdelay::config::{self, Config};

#[derive(Parser)]
#[command(
    name = "zdelay",
    version,
    about = "Precise, reliable delayed delivery from Redis sorted sets to Redis lists."
)]
struct Cli {
    /// Config file (TOML). Without it: built-in defaults. ZDELAY_<SECTION>__<FIELD> variables override either.
    #[arg(long, global = true, env = "ZDELAY_CONFIG")]
    config: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "zdelay=debug".
    #[arg(long, global = true, env = "ZDELAY_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: move due jobs onto their lists until SIGTERM/SIGINT.
    Run,
    /// Schedule a job (prints its id), or many with --batch (one id per input line).
    Enqueue(EnqueueArgs),
    /// Cancel a pending job by id.
    Cancel { id: String },
    /// Move a pending job to a new due time.
    Reschedule {
        id: String,
        #[command(flatten)]
        when: When,
    },
    /// Show a job by id, as JSON.
    Get { id: String },
    /// Backlog per shard and raw source: due now, scheduled, in flight, dead, oldest due age.
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// Dead jobs: list them with their reason, replay them, or purge them.
    Dead {
        #[command(subcommand)]
        action: DeadAction,
    },
    /// Measure move throughput and lateness against a Redis (use a scratch Redis or namespace).
    Bench(zdelay::bench::BenchArgs),
    /// Load and validate the config, then print the effective config (secrets hidden).
    CheckConfig,
}

#[derive(clap::Args, Default)]
#[group(multiple = false)]
struct When {
    /// Due time: RFC 3339 (2026-11-21T14:03:07.250Z) or epoch milliseconds.
    #[arg(long, value_parser = parse_at)]
    at: Option<i64>,
    /// Delay from now (Redis's clock), e.g. 250ms, 5s, 1h30m.
    #[arg(long = "in", value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
}

impl When {
    fn due(&self) -> Due {
        match (self.at, self.delay) {
            (Some(ms), _) => Due::At(ms),
            (_, Some(d)) => Due::In(d),
            _ => Due::In(Duration::ZERO),
        }
    }
}

#[derive(clap::Args)]
struct EnqueueArgs {
    /// Destination: a route name, or <sink>/<target> admitted by that sink's `allow`.
    #[arg(long, required_unless_present = "batch")]
    dest: Option<String>,
    #[command(flatten)]
    when: When,
    /// Job id (default: a new ULID). Ids sharing a {tag} share a shard and keep their order.
    #[arg(long)]
    id: Option<String>,
    /// Header K=V (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Payload text.
    #[arg(long, conflicts_with = "payload_file")]
    payload: Option<String>,
    /// Payload from a file (bytes as-is).
    #[arg(long)]
    payload_file: Option<PathBuf>,
    /// Delivery attempts before a job goes to dead (two-phase sinks).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// When the id exists: replace it, keep the existing job, or fail.
    #[arg(long, value_enum, default_value_t = OnConflict::Replace)]
    on_conflict: OnConflict,
    /// JSON lines from FILE ("-" = stdin): {"dest","payload","at"|"in","id","headers","payload_encoding"}.
    #[arg(long, conflicts_with_all = ["dest", "payload", "payload_file", "id"])]
    batch: Option<String>,
}

#[derive(Subcommand)]
enum DeadAction {
    /// List dead jobs (oldest first) with their reason.
    List {
        /// At most this many per shard or source.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Make dead jobs due now.
    Replay(DeadSelect),
    /// Delete dead jobs for good.
    Purge(DeadSelect),
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct DeadSelect {
    /// Job ids (envelope jobs).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Every dead envelope job.
    #[arg(long)]
    all: bool,
    /// Every dead member of this raw source.
    #[arg(long)]
    source: Option<String>,
}

fn parse_at(s: &str) -> Result<i64, String> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    let t = humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("{e}: expected RFC 3339 or epoch milliseconds"))?;
    Ok(t.duration_since(UNIX_EPOCH)
        .map_err(|_| "before 1970".to_owned())?
        .as_millis() as i64)
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("expected K=V")?;
    if k.is_empty() {
        return Err("empty header name".into());
    }
    Ok((k.to_owned(), v.to_owned()))
}

fn main() {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    let code = match runtime.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zdelay: error: {e:#}");
            1
        }
    };
    // Do not wait for tasks stuck on I/O: everything that matters is in Redis.
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}

async fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    let config = config::load(cli.config.as_deref())?;
    match cli.command {
        Command::Run => {
            let shutdown = CancellationToken::new();
            tokio::spawn(watch_signals(shutdown.clone()));
            zdelay::app::run(config, shutdown).await?;
            Ok(0)
        }
        Command::CheckConfig => {
            println!("{}", serde_json::to_string_pretty(&config)?);
            eprintln!(
                "config OK: {} sinks, {} routes, {} sources",
                config.sinks.len(),
                config.routes.len(),
                config.sources.len()
            );
            Ok(0)
        }
        Command::Bench(args) => {
            zdelay::bench::run(config, args).await?;
            Ok(0)
        }
        command => {
            let client = client(&config).await?;
            operate(&client, &config, command).await
        }
    }
}

async fn client(config: &Config) -> anyhow::Result<Client> {
    Ok(Client::connect(&config.redis)
        .await
        .with_context(|| format!("cannot use redis at {}", config.redis.url))?
        .with_destinations(config.routes.iter().map(|r| r.name.clone()))
        .with_remote_routes(zdelay::sinks::RemoteRoutes::from_config(config))
        .with_max_payload(config.poller.max_payload))
}

async fn operate(client: &Client, config: &Config, command: Command) -> anyhow::Result<i32> {
    match command {
        Command::Enqueue(args) => match &args.batch {
            Some(path) => enqueue_batch(client, path, args.on_conflict).await,
            None => enqueue_one(client, args).await,
        },
        Command::Cancel { id } => Ok(match client.cancel(&id).await? {
            Cancelled::Cancelled => {
                println!("cancelled {id}");
                0
            }
            Cancelled::InFlight => {
                println!("{id} is being delivered; not cancelled");
                1
            }
            Cancelled::NotPending => {
                println!("{id} is not pending (delivered, dead or unknown)");
                1
            }
        }),
        Command::Reschedule { id, when } => {
            if when.at.is_none() && when.delay.is_none() {
                bail!("reschedule needs --at or --in");
            }
            Ok(match client.reschedule(&id, when.due()).await? {
                Some(due) => {
                    println!("{id} due at {}", format_ms(due));
                    0
                }
                None => {
                    println!("{id} is not pending (delivered, dead, in flight or unknown)");
                    1
                }
            })
        }
        Command::Get { id } => Ok(match client.get(&id).await? {
            Some(job) => {
                println!("{}", serde_json::to_string_pretty(&job.to_json())?);
                0
            }
            None => {
                eprintln!("no job {id}");
                1
            }
        }),
        Command::Stats { json } => {
            let stats = zdelay::stats::gather(&mut client.connection(), config).await?;
            if json {
                let mut v = serde_json::to_value(&stats)?;
                v["total"] = serde_json::to_value(stats.total())?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", zdelay::stats::render_table(&stats));
            }
            Ok(0)
        }
        Command::Dead { action } => dead(client, config, action).await,
        Command::Run | Command::CheckConfig | Command::Bench(_) => unreachable!("handled above"),
    }
}

async fn enqueue_one(client: &Client, args: EnqueueArgs) -> anyhow::Result<i32> {
    let dest = args.dest.expect("clap requires --dest without --batch");
    let payload = match (&args.payload, &args.payload_file) {
        (Some(text), _) => text.clone().into_bytes(),
        (_, Some(path)) => std::fs::read(path)
            .with_context(|| format!("cannot read --payload-file {}", path.display()))?,
        _ => bail!("give --payload or --payload-file"),
    };
    let mut job = NewJob::new(dest, payload);
    job.due = args.when.due();
    job.id = args.id;
    job.headers = args.headers.into_iter().collect();
    job.max_attempts = args.max_attempts;
    let (id, outcome) = client.enqueue(job, args.on_conflict).await?;
    println!("{id}");
    if outcome == Enqueued::Kept {
        eprintln!("{id} exists; kept as it was (--on-conflict keep)");
    }
    Ok(0)
}

/// One line of `enqueue --batch`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchLine {
    dest: String,
    payload: String,
    #[serde(default)]
    payload_encoding: Option<String>,
    #[serde(default)]
    at: Option<i64>,
    #[serde(default, rename = "in", with = "humantime_serde")]
    delay: Option<Duration>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    max_attempts: Option<u32>,
}

fn parse_batch_line(line: &str) -> Result<NewJob, String> {
    let l: BatchLine = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let payload = match l.payload_encoding.as_deref() {
        None | Some("utf8") => l.payload.into_bytes(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(l.payload)
            .map_err(|e| format!("invalid base64 payload: {e}"))?,
        Some(other) => return Err(format!("unknown payload_encoding {other:?}")),
    };
    let mut job = NewJob::new(l.dest, payload);
    job.due = match (l.at, l.delay) {
        (Some(_), Some(_)) => return Err("give \"at\" or \"in\", not both".into()),
        (Some(ms), None) => Due::At(ms),
        (None, Some(d)) => Due::In(d),
        (None, None) => Due::In(Duration::ZERO),
    };
    job.id = l.id;
    job.headers = l.headers;
    job.max_attempts = l.max_attempts;
    Ok(job)
}

/// Reads JSON lines, enqueues them in chunks, prints one id per input line (an empty line
/// for a bad one, so output line N answers input line N), reports bad lines on stderr.
async fn enqueue_batch(client: &Client, path: &str, policy: OnConflict) -> anyhow::Result<i32> {
    const CHUNK: usize = 10_000;
    let reader: Box<dyn BufRead> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(path).with_context(|| format!("cannot open --batch {path}"))?,
        ))
    };
    let progress = ProgressBar::new_spinner();
    progress.set_style(
        ProgressStyle::with_template("{spinner} {pos} jobs enqueued ({per_sec}) {msg}")
            .expect("a valid template"),
    );
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut bad = 0usize;
    let mut lines = reader.lines().enumerate().peekable();
    while lines.peek().is_some() {
        // (line number, parsed job or the reason it is bad)
        let mut chunk: Vec<(usize, Result<NewJob, String>)> = Vec::with_capacity(CHUNK);
        for (i, line) in lines.by_ref().take(CHUNK) {
            let line = line.context("reading --batch input")?;
            if line.trim().is_empty() {
                // Not a job: an empty output line keeps line N answering line N.
                chunk.push((i + 1, Err(String::new())));
                continue;
            }
            chunk.push((i + 1, parse_batch_line(&line)));
        }
        let jobs: Vec<NewJob> = chunk
            .iter()
            .filter_map(|(_, j)| j.as_ref().ok().cloned())
            .collect();
        let mut results = client.enqueue_batch(jobs, policy).await?.into_iter();
        for (number, parsed) in chunk {
            let outcome = match parsed {
                Err(why) => Err(why),
                Ok(_) => results
                    .next()
                    .expect("one result per job")
                    .map(|(id, _)| id)
                    .map_err(|e| e.to_string()),
            };
            match outcome {
                Ok(id) => writeln!(out, "{id}")?,
                Err(why) if why.is_empty() => writeln!(out)?,
                Err(why) => {
                    bad += 1;
                    writeln!(out)?;
                    progress.suspend(|| eprintln!("line {number}: {why}"));
                }
            }
            progress.inc(1);
        }
        out.flush()?;
    }
    progress.finish_and_clear();
    if bad > 0 {
        eprintln!("{bad} bad lines were not enqueued; the others were");
        return Ok(2);
    }
    Ok(0)
}

async fn dead(client: &Client, config: &Config, action: DeadAction) -> anyhow::Result<i32> {
    match action {
        DeadAction::List { limit, json } => {
            let jobs = client.dead_list(limit).await?;
            let mut raw = Vec::new();
            for source in &config.sources {
                for (member, died, reason) in client.raw_dead_list(source, limit).await? {
                    raw.push(serde_json::json!({
                        "source": source.key, "payload": String::from_utf8_lossy(&member),
                        "died_ms": died, "reason": reason,
                    }));
                }
            }
            if json {
                let v = serde_json::json!({ "jobs": jobs, "raw": raw });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for j in &jobs {
                    println!(
                        "{}  shard {}  died {}  {}",
                        j.id,
                        j.shard,
                        format_ms(j.died_ms),
                        j.reason
                    );
                }
                for r in &raw {
                    println!(
                        "{}  died {}  {}  payload {}",
                        r["source"].as_str().unwrap_or_default(),
                        format_ms(r["died_ms"].as_i64().unwrap_or_default()),
                        r["reason"].as_str().unwrap_or_default(),
                        r["payload"]
                    );
                }
                eprintln!("{} dead jobs, {} dead raw members", jobs.len(), raw.len());
            }
            Ok(0)
        }
        DeadAction::Replay(select) => {
            match &select.source {
                Some(key) => {
                    let n = client.raw_dead_replay(source(config, key)?).await?;
                    println!("replayed {n}");
                }
                None => {
                    let r = client.dead_replay(&select.ids).await?;
                    println!("replayed {}", r.replayed);
                    if r.orphans > 0 {
                        eprintln!(
                            "{} dead ids have no envelope and stay dead (purge them)",
                            r.orphans
                        );
                    }
                }
            }
            Ok(0)
        }
        DeadAction::Purge(select) => {
            let n = match &select.source {
                Some(key) => client.raw_dead_purge(source(config, key)?).await?,
                None => client.dead_purge(&select.ids).await?,
            };
            println!("purged {n}");
            Ok(0)
        }
    }
}

fn source<'a>(config: &'a Config, key: &str) -> anyhow::Result<&'a config::SourceConfig> {
    config
        .sources
        .iter()
        .find(|s| s.key == key)
        .with_context(|| format!("no configured source {key}"))
}

fn format_ms(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// First SIGTERM/SIGINT: graceful shutdown. Second: exit at once.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("signal received: stopping (a second signal exits at once)");
    shutdown.cancel();
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    eprintln!("zdelay: second signal: exiting now; unfinished work stays in Redis");
    std::process::exit(130);
}
