//! `zdelay bench`: measures the mover against a given Redis.

use crate::config::Config;

/// Options of `zdelay bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {}

pub async fn run(_config: Config, _args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench: not built yet")
}
