//! `zdelay enqueue`: one job from flags, or many from JSON lines (`--batch`).

use super::When;
use super::batch;
use anyhow::Context;
use clap::ValueEnum;
use std::path::PathBuf;
use std::time::Duration;
use zdelay::{Client, Enqueued, NewJob, OnConflict};

#[derive(clap::Args)]
pub struct EnqueueArgs {
    /// Destination: a configured route name, or <sink>/<target> for a Kafka, AMQP or NATS
    /// sink whose `allow` patterns admit the target.
    #[arg(long, required_unless_present = "batch")]
    dest: Option<String>,
    #[command(flatten)]
    when: When,
    /// Job id (default: a new ULID). Ids sharing a {tag} share a shard and keep their order.
    #[arg(long)]
    id: Option<String>,
    /// A message header K=V, delivered with the payload (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// The payload, as text.
    #[arg(
        long,
        conflicts_with = "payload_file",
        required_unless_present_any = ["payload_file", "batch"]
    )]
    payload: Option<String>,
    /// The payload, read from a file (bytes as they are).
    #[arg(long)]
    payload_file: Option<PathBuf>,
    /// Delivery attempts before the job goes to dead (Kafka, AMQP, NATS and remote Redis
    /// sinks; default poller.max_attempts).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Stale after this: a job not delivered within this of its due time goes to dead
    /// (reason expired) instead.
    #[arg(long, value_parser = humantime::parse_duration)]
    max_lateness: Option<Duration>,
    /// Spread over this window after the due time: the job is due at a point in it derived
    /// from its id (the same point each time that id is enqueued), so a burst of jobs is
    /// spread evenly; never before the window starts.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "batch")]
    spread: Option<Duration>,
    /// Unique for this long after it leaves: once the job is delivered or dead, enqueuing its
    /// id again within this window answers "duplicate" and schedules nothing.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "batch")]
    unique_for: Option<Duration>,
    /// When the id exists: replace it, keep the existing job, fail, or debounce (replace it,
    /// but a waiting job's due time never moves past its first enqueue plus --max-wait).
    #[arg(long, value_enum, default_value_t = Conflict::Replace)]
    on_conflict: Conflict,
    /// With --on-conflict debounce: the longest a job may be pushed back from its first
    /// enqueue.
    #[arg(long, value_parser = humantime::parse_duration)]
    max_wait: Option<Duration>,
    /// Read jobs from FILE ("-" = stdin), one JSON object a line:
    /// {"dest","payload","payload_encoding","at"|"in","id","headers","max_attempts",
    /// "max_lateness","spread","unique_for"}.
    /// Prints one id per input line, in order.
    #[arg(long, conflicts_with_all = ["dest", "payload", "payload_file", "id"])]
    batch: Option<String>,
    #[command(flatten)]
    output: super::Output,
}

/// `--on-conflict`, as the CLI spells it.
#[derive(Clone, Copy, ValueEnum)]
enum Conflict {
    /// Overwrite the job, whatever state it is in.
    Replace,
    /// Leave the existing job as it is.
    Keep,
    /// Fail (exit 1).
    Error,
    /// Replace it, pushing a waiting job later up to its first enqueue plus --max-wait.
    Debounce,
}

/// The policy `--on-conflict` and `--max-wait` name together.
fn policy_of(conflict: Conflict, max_wait: Option<Duration>) -> Result<OnConflict, String> {
    match (conflict, max_wait) {
        (Conflict::Debounce, Some(max_wait)) => Ok(OnConflict::Debounce { max_wait }),
        (Conflict::Debounce, None) => {
            Err("--on-conflict debounce needs --max-wait (e.g. --max-wait 1m)".into())
        }
        (_, Some(_)) => Err("--max-wait applies only with --on-conflict debounce".into()),
        (Conflict::Replace, None) => Ok(OnConflict::Replace),
        (Conflict::Keep, None) => Ok(OnConflict::Keep),
        (Conflict::Error, None) => Ok(OnConflict::Error),
    }
}

pub(super) fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or("expected K=V")?;
    if k.is_empty() {
        return Err("empty header name".into());
    }
    Ok((k.to_owned(), v.to_owned()))
}

pub async fn run(client: &Client, args: EnqueueArgs) -> anyhow::Result<i32> {
    let policy = policy_of(args.on_conflict, args.max_wait).map_err(super::UsageError)?;
    if let Some(path) = &args.batch {
        if args.output.is_json() {
            return Err(super::UsageError(
                "--batch prints one id per input line: -o json does not apply".into(),
            )
            .into());
        }
        return batch::run(path, "jobs enqueued", parse_line, async |jobs| {
            Ok(client
                .enqueue_batch(jobs, policy)
                .await?
                .into_iter()
                .map(|r| r.map(|(id, _)| id).map_err(|e| e.to_string()))
                .collect())
        })
        .await;
    }
    let dest = args.dest.expect("clap requires --dest without --batch");
    let payload = match (args.payload, &args.payload_file) {
        (Some(text), _) => text.into_bytes(),
        (_, Some(path)) => std::fs::read(path)
            .with_context(|| format!("cannot read --payload-file {}", path.display()))?,
        (None, None) => unreachable!("clap requires --payload or --payload-file"),
    };
    let mut job = NewJob::new(dest, payload);
    job.due = args.when.due();
    job.id = args.id;
    job.headers = args.headers.into_iter().collect();
    job.max_attempts = args.max_attempts;
    job.max_lateness = args.max_lateness;
    job.spread = args.spread;
    job.unique_for = args.unique_for;
    let (id, outcome) = client.enqueue(job, policy).await?;
    if args.output.is_json() {
        let kept = outcome == Enqueued::Kept;
        let duplicate = outcome == Enqueued::Duplicate;
        super::print_json(&serde_json::json!({ "id": id, "kept": kept, "duplicate": duplicate }))?;
    } else {
        println!("{id}");
    }
    match outcome {
        Enqueued::Kept => eprintln!("{id} exists; kept as it was (--on-conflict keep)"),
        Enqueued::Duplicate => eprintln!(
            "{id} was delivered or went dead within its unique window; not enqueued again"
        ),
        Enqueued::Added | Enqueued::Replaced => {}
    }
    Ok(0)
}

fn parse_line(line: &str) -> Result<NewJob, String> {
    NewJob::from_json_line(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zdelay::Due;

    #[test]
    fn a_seconds_looking_at_is_a_bad_line() {
        let err = parse_line(r#"{"dest":"q","payload":"x","at":1795250000}"#).unwrap_err();
        assert!(err.contains("looks like epoch seconds"), "{err}");
    }

    #[test]
    fn batch_lines_parse_or_say_why() {
        let job =
            parse_line(r#"{"dest":"q","payload":"aGk=","payload_encoding":"base64","in":"250ms"}"#)
                .unwrap();
        assert_eq!(job.payload, b"hi");
        assert_eq!(job.due, Due::In(Duration::from_millis(250)));
        assert!(
            parse_line(r#"{"dest":"q","payload":"x","at":1,"in":"1s"}"#)
                .unwrap_err()
                .contains("not both")
        );
        assert!(
            parse_line(r#"{"dest":"q","payload":"x","extra":1}"#)
                .unwrap_err()
                .contains("extra")
        );
        assert!(
            parse_line(r#"{"dest":"q","payload":"x","payload_encoding":"rot13"}"#)
                .unwrap_err()
                .contains("rot13")
        );
    }
}
