//! `zdelay reshard --to N`: renders `zdelay::reshard` (progress on stderr, the outcome on
//! stdout) and asks before changing anything unless `--yes`.

use super::UsageError;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use zdelay::config::Config;
use zdelay::reshard::{self, Counts, Outcome, Plan, Progress};
use zdelay::reshard_spread;
use zdelay::store::{self, Conn};

#[derive(clap::Args)]
pub struct ReshardArgs {
    /// The new shard count (1..=16384).
    #[arg(long, value_name = "N")]
    to: u32,
    /// Do not ask: reshard at once (needed when stdin is not a terminal).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Check and count what would move; change nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    output: super::Output,
    /// Job ids per script call (1..=1000). (`--batch` is the old name: elsewhere --batch
    /// names an input file.)
    #[arg(long, alias = "batch", value_name = "N", default_value_t = reshard::DEFAULT_BATCH as u16, value_parser = clap::value_parser!(u16).range(1..=1000))]
    ids_per_call: u16,
    /// Old shards moved at once (1..=64).
    #[arg(long, default_value_t = reshard::DEFAULT_CONCURRENCY as u16, value_parser = clap::value_parser!(u16).range(1..=64))]
    concurrency: u16,
}

pub async fn run(config: &Config, args: ReshardArgs) -> anyhow::Result<i32> {
    let to = match u16::try_from(args.to) {
        Ok(to) if (1..=zdelay::config::MAX_SHARDS).contains(&to) => to,
        _ => {
            return Err(UsageError(format!(
                "--to {}: a namespace has 1..=16384 shards (the bounds of redis.shards)",
                args.to
            ))
            .into());
        }
    };
    let mut con = Conn::connect(&config.redis).await?;
    store::check_server(&mut con).await?;
    let namespace = &config.redis.namespace;
    let mut opts = reshard::Options::new(to);
    opts.batch = args.ids_per_call.into();
    opts.concurrency = args.concurrency.into();
    let quiet = |_: Progress| {};
    if !args.yes || args.dry_run {
        opts.dry_run = true;
        let outcome = reshard_spread::reshard(&con, namespace, &opts, &quiet).await?;
        let Outcome::DryRun(plan) = &outcome else {
            return print_outcome(&outcome, args.output.is_json());
        };
        if args.dry_run {
            return print_outcome(&outcome, args.output.is_json());
        }
        eprint!("{}", plan_text(plan));
        if !plan.online && !plan.daemons.is_empty() {
            // The real run refuses with the daemons' names; say it now.
            opts.dry_run = false;
            reshard_spread::reshard(&con, namespace, &opts, &quiet).await?;
        }
        if !super::confirm("resharding", &format!("reshard namespace {namespace} now?"))? {
            eprintln!("not resharded");
            return Ok(1);
        }
        opts.dry_run = false;
    }
    let printer = Printer::new(to);
    let outcome = reshard_spread::reshard(&con, namespace, &opts, &|p| printer.show(p)).await?;
    print_outcome(&outcome, args.output.is_json())
}

fn print_outcome(outcome: &Outcome, json: bool) -> anyhow::Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(outcome)?);
        return Ok(0);
    }
    match outcome {
        Outcome::AlreadyDone { namespace, shards } => {
            println!("namespace {namespace} already has {shards} shards: nothing to do");
        }
        Outcome::DryRun(plan) => print!("{}", plan_text(plan)),
        Outcome::Done(r) => {
            println!(
                "resharded namespace {} from {} to {} shards{}: moved {} jobs in {:.1} s",
                r.namespace,
                r.from,
                r.to,
                if r.resumed { " (resumed)" } else { "" },
                r.moved,
                r.elapsed_ms as f64 / 1000.0
            );
            println!("  before: {}", r.before);
            println!("  after:  {}", r.after);
            if r.superseded > 0 {
                println!(
                    "  {} ids were enqueued again into their new shard while the move ran: the \
                     newer job stayed",
                    r.superseded
                );
            }
            if r.online {
                println!(
                    "producers and daemons follow the new count on their own (redis.shards is \
                     only the count a new namespace gets; set it to {} to keep configs \
                     telling the truth)",
                    r.to
                );
            } else {
                println!(
                    "set redis.shards = {} in every config (daemons, CLI, producers) before \
                     starting daemons again; producers still connected follow on their own",
                    r.to
                );
            }
        }
    }
    Ok(0)
}

fn plan_text(plan: &Plan) -> String {
    let mut text = format!(
        "{} namespace {} from {} to {} shards: {} of {} would move\n",
        if plan.resume {
            "would resume the unfinished reshard of"
        } else {
            "would reshard"
        },
        plan.namespace,
        plan.from,
        plan.to,
        plan.to_move,
        plan.counts
    );
    if plan.online {
        text.push_str(&format!(
            "producers and daemons keep running: at the fence new work goes to the {} new spread \
             shards, and each daemon restarts its pollers on them; the two-phase jobs, dead jobs \
             and schedules of the old shards move earliest due first, with their unique windows \
             and debounce deadlines. Route lanes stay where they are\n",
            plan.to
        ));
    } else if plan.daemons.is_empty() {
        text.push_str(&format!(
            "no daemon is registered. While it runs, producers get a retryable error; those \
             connected then follow the new layout, and every config needs redis.shards = {}\n",
            plan.to
        ));
    } else {
        let names: Vec<&str> = plan.daemons.iter().map(|d| d.id.as_str()).collect();
        text.push_str(&format!(
            "refused while daemons are registered: {}\n",
            names.join(", ")
        ));
    }
    text
}

/// Progress lines on stderr, at most one "moved" line a second.
struct Printer {
    last: Mutex<Option<Instant>>,
    to: u16,
    #[cfg(feature = "test-failpoints")]
    failpoint: failpoint::Failpoint,
}

impl Printer {
    fn new(to: u16) -> Self {
        Printer {
            last: Mutex::new(None),
            to,
            #[cfg(feature = "test-failpoints")]
            failpoint: failpoint::Failpoint::from_env(),
        }
    }

    fn show(&self, progress: Progress) {
        #[cfg(feature = "test-failpoints")]
        self.failpoint.check(&progress);
        match progress {
            Progress::Start { from, to, resumed } => eprintln!(
                "{} from {from} to {to} shards",
                if resumed {
                    "resuming the unfinished reshard"
                } else {
                    "resharding"
                }
            ),
            Progress::Warning(text) => eprintln!("warning: {text}"),
            Progress::Fenced { counts } => eprintln!(
                "fenced: producers and daemons now use {} shards (each follows at its next \
                 call); moving what the old shards hold, earliest due first: {}",
                self.to,
                summary(&counts)
            ),
            Progress::Frozen { counts } => eprintln!(
                "frozen: until the end, producers get a retryable error and daemons cannot \
                 start; {}",
                summary(&counts)
            ),
            Progress::Moved { total } => {
                let mut last = self.last.lock().expect("printer lock");
                if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    *last = Some(Instant::now());
                    eprintln!("moved {total} jobs");
                }
            }
            Progress::ShardDone { shard, moved } if moved > 0 && self.to <= 64 => {
                eprintln!("shard {shard}: {moved} jobs moved out")
            }
            Progress::Verified { counts } => {
                eprintln!("verified: the new shards hold {}", summary(&counts))
            }
            Progress::Finishing => eprintln!("writing the new layout"),
            Progress::Copied { .. } | Progress::ShardDone { .. } => {}
        }
    }
}

fn summary(counts: &Counts) -> String {
    format!(
        "{} jobs, {} due or scheduled, {} in flight, {} waiting for a sink, {} dead",
        counts.jobs, counts.due, counts.inflight, counts.ready, counts.dead
    )
}

/// Test-only crash injection (feature `test-failpoints`): `ZDELAY_FAILPOINT=
/// reshard_abort_after=<event>[:<n>]` aborts the process, like `kill -9`, at the n-th (default
/// first) progress event of that kind: `frozen`, `fenced` (layout 2), `copied` (jobs written into their new shard,
/// not yet deleted from the old one), `verified`, `finishing` (markers set, schema not yet).
#[cfg(feature = "test-failpoints")]
mod failpoint {
    use std::sync::atomic::{AtomicU64, Ordering};
    use zdelay::reshard::Progress;

    pub struct Failpoint {
        at: Option<(String, u64)>,
        seen: AtomicU64,
    }

    impl Failpoint {
        pub fn from_env() -> Self {
            let at = std::env::var("ZDELAY_FAILPOINT").ok().and_then(|v| {
                let spec = v.strip_prefix("reshard_abort_after=")?;
                let (event, n) = spec.split_once(':').unwrap_or((spec, "1"));
                Some((event.to_owned(), n.parse().ok()?))
            });
            Failpoint {
                at,
                seen: AtomicU64::new(0),
            }
        }

        pub fn check(&self, progress: &Progress) {
            let Some((event, n)) = &self.at else { return };
            let name = match progress {
                Progress::Frozen { .. } => "frozen",
                Progress::Fenced { .. } => "fenced",
                Progress::Copied { .. } => "copied",
                Progress::Verified { .. } => "verified",
                Progress::Finishing => "finishing",
                _ => return,
            };
            if name == event && self.seen.fetch_add(1, Ordering::SeqCst) + 1 == *n {
                eprintln!("failpoint reshard_abort_after={event}:{n}");
                std::process::abort();
            }
        }
    }
}
