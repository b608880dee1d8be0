//! `zdelay dead list|replay|purge`.

use super::UsageError;
use super::render;
use zdelay::Client;
use zdelay::config::{Config, SourceConfig};

#[derive(clap::Subcommand)]
pub enum DeadAction {
    /// List dead jobs and dead raw members (oldest first) with their reason.
    List {
        /// At most this many per shard or raw source.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON ({"jobs": [...], "raw": [...]}) instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Make dead jobs due now (raw members go back into their source).
    Replay(DeadSelect),
    /// Delete dead jobs for good.
    Purge(DeadSelect),
}

/// Which dead jobs: exactly one of the flags.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct DeadSelect {
    /// These job ids (repeatable).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// Every job that is dead when the command starts.
    #[arg(long)]
    all: bool,
    /// Every dead member of this configured raw source (its key).
    #[arg(long)]
    source: Option<String>,
}

pub async fn run(client: &Client, config: &Config, action: DeadAction) -> anyhow::Result<i32> {
    match action {
        DeadAction::List { limit, json } => {
            let jobs = client.dead_list(limit).await?;
            let mut raw = Vec::new();
            for source in &config.sources {
                for member in client.raw_dead_list(source, limit).await? {
                    raw.push((source.key.as_str(), member));
                }
            }
            if json {
                let raw: Vec<_> = raw
                    .iter()
                    .map(|(source, m)| render::dead_member_json(source, m))
                    .collect();
                let v = serde_json::json!({ "jobs": jobs, "raw": raw });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for j in &jobs {
                    println!("{}", render::dead_job_line(j));
                }
                for (source, m) in &raw {
                    println!("{}", render::dead_member_line(source, m));
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
