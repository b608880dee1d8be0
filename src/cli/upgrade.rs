//! `zdelay upgrade`: renders `zdelay::upgrade` (progress on stderr, the outcome on stdout)
//! and asks before changing anything unless `--yes`.

use std::sync::Mutex;
use std::time::{Duration, Instant};
use zdelay::config::Config;
use zdelay::keys::Keys;
use zdelay::store::{self, Conn};
use zdelay::upgrade::{self, Outcome, Plan, Progress};

#[derive(clap::Args)]
pub struct UpgradeArgs {
    /// Do not ask: upgrade at once (needed when stdin is not a terminal).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Check and count; change nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    output: super::Output,
    /// Job ids per script call (1..=1000).
    #[arg(long, value_name = "N", default_value_t = upgrade::DEFAULT_BATCH as u16, value_parser = clap::value_parser!(u16).range(1..=1000))]
    ids_per_call: u16,
    /// Layout-1 shards moved at once (1..=64).
    #[arg(long, default_value_t = upgrade::DEFAULT_CONCURRENCY as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    concurrency: u16,
}

pub async fn run(config: &Config, args: UpgradeArgs) -> anyhow::Result<i32> {
    let mut con = Conn::connect(&config.redis).await?;
    store::check_server(&mut con).await?;
    store::scripts::load_all(&mut con).await?;
    let namespace = &config.redis.namespace;
    let keys = Keys::new(namespace, config.redis.shards);
    let mut opts = upgrade::Options {
        batch: args.ids_per_call.into(),
        concurrency: args.concurrency.into(),
        dry_run: true,
    };
    let quiet = |_: Progress| {};
    if !args.yes || args.dry_run {
        let registry = store::lanes::read_registry(&mut con, &keys).await?;
        let outcome = upgrade::upgrade(&con, namespace, &registry, &opts, &quiet).await?;
        let Outcome::DryRun(plan) = &outcome else {
            return print_outcome(&outcome, args.output.is_json());
        };
        if args.dry_run {
            return print_outcome(&outcome, args.output.is_json());
        }
        eprint!("{}", plan_text(plan, config));
        let question = format!("upgrade namespace {namespace} to storage layout 2 now?");
        if !super::confirm("upgrading", &question)? {
            eprintln!("not upgraded");
            return Ok(1);
        }
    }
    opts.dry_run = false;
    // Every local route of the config gets its lane before anything moves.
    zdelay::app::register_lanes(&mut con, config, &keys).await?;
    let registry = store::lanes::read_registry(&mut con, &keys).await?;
    let printer = Printer::default();
    let outcome = upgrade::upgrade(&con, namespace, &registry, &opts, &|p| printer.show(p)).await?;
    print_outcome(&outcome, args.output.is_json())
}

fn print_outcome(outcome: &Outcome, json: bool) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(outcome)?);
        return Ok(0);
    }
    match outcome {
        Outcome::AlreadyDone { namespace } => {
            println!("namespace {namespace} is on storage layout 2 already: nothing to do");
        }
        Outcome::DryRun(plan) => print!("{}", plan_text(plan, &Config::default())),
        Outcome::Done(r) => {
            println!(
                "upgraded namespace {} to storage layout 2{}: {} ids into route lanes, {} into \
                 spread shards in {:.1} s",
                r.namespace,
                if r.resumed { " (resumed)" } else { "" },
                r.to_lanes,
                r.to_spread_shards,
                r.elapsed_ms as f64 / 1000.0
            );
            if r.put_before > 0 {
                println!("  {} had been written by an interrupted run", r.put_before);
            }
            if r.superseded > 0 {
                println!(
                    "  {} were enqueued again under the same id during the upgrade: the newer \
                     job was kept",
                    r.superseded
                );
            }
            if r.redelivered > 0 {
                println!(
                    "  {} local-route jobs were in flight and were made due again (each may be \
                     delivered twice)",
                    r.redelivered
                );
            }
        }
    }
    Ok(0)
}

fn plan_text(plan: &Plan, config: &Config) -> String {
    let mut text = format!(
        "{} namespace {} ({} shards) to storage layout 2: {}\n",
        if plan.resume {
            "would resume the unfinished upgrade of"
        } else {
            "would upgrade"
        },
        plan.namespace,
        plan.shards,
        plan.counts
    );
    let local: Vec<&str> = config
        .routes
        .iter()
        .filter(|r| config.sinks.get(&r.sink).is_some_and(|s| s.is_local()))
        .map(|r| r.name.as_str())
        .collect();
    if !local.is_empty() {
        text.push_str(&format!("route lanes for: {}\n", local.join(", ")));
    }
    if plan.outdated.is_empty() {
        text.push_str(&format!(
            "{} daemon(s) registered, all able to follow the upgrade\n",
            plan.daemons.len()
        ));
    } else {
        let names: Vec<String> = plan
            .outdated
            .iter()
            .map(|d| {
                format!(
                    "{} ({})",
                    d.id,
                    d.version.as_deref().unwrap_or("no version")
                )
            })
            .collect();
        text.push_str(&format!(
            "refused while these daemons run an older build: {}\n",
            names.join(", ")
        ));
    }
    text
}

/// Progress lines on stderr, at most one "moved" line a second.
#[derive(Default)]
struct Printer {
    last: Mutex<Option<Instant>>,
}

impl Printer {
    fn show(&self, progress: Progress) {
        match progress {
            Progress::Start { shards, resumed } => eprintln!(
                "{} ({shards} layout-1 shards)",
                if resumed {
                    "resuming the unfinished upgrade"
                } else {
                    "upgrading to storage layout 2"
                }
            ),
            Progress::Announced => {
                eprintln!("announced: new jobs now go to layout 2")
            }
            Progress::Fenced => eprintln!(
                "layout-1 shards fenced: the older release's daemons and producers switch to \
                 route lanes (builds older than it stop)"
            ),
            Progress::Moved { total } => {
                let mut last = self.last.lock().expect("printer lock");
                if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    *last = Some(Instant::now());
                    eprintln!("moved {total} jobs");
                }
            }
            Progress::Settling {
                shard,
                jobs,
                lease_left_ms,
            } => eprintln!(
                "layout-1 shard {shard}: waiting for {jobs} jobs in flight to be settled by \
                 their publishers (their leases end within {:.1} s)",
                lease_left_ms.max(0) as f64 / 1000.0
            ),
            Progress::ShardDone { .. } => {}
            Progress::Finishing => eprintln!("every layout-1 shard is empty: writing layout 2"),
        }
    }
}
