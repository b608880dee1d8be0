//! `zdelay clock`: a test namespace's clock (`[testing] clock = true`) — show it, move it
//! forward.

use super::render::format_ms;
use super::{Output, print_json};
use std::time::Duration;
use zdelay::Client;
use zdelay::store::clock::{Reading, parse_advance};

#[derive(clap::Subcommand)]
pub enum ClockAction {
    /// Move the namespace's test clock forward by DURATION (30d, 90m, 1h 30m), never back, and
    /// wake every daemon: what falls due in the time skipped is delivered at once. Refused on a
    /// namespace created without a test clock. Prints the new time. JSON: as clock show.
    Advance {
        /// How far: a duration of 1ms or more, like 30d, 90m or "1h 30m".
        #[arg(value_name = "DURATION", value_parser = parse_advance)]
        by: Duration,
        #[command(flatten)]
        output: Output,
    },
    /// The namespace's time: Redis's clock plus its test clock's offset. Refused on a namespace
    /// created without a test clock. JSON: {"now_ms", "now", "redis_ms", "offset_ms"}.
    Show {
        #[command(flatten)]
        output: Output,
    },
}

pub async fn run(client: &Client, action: ClockAction) -> anyhow::Result<i32> {
    let (reading, output) = match action {
        ClockAction::Advance { by, output } => (client.advance_clock(by).await?, output),
        ClockAction::Show { output } => (client.clock().await?, output),
    };
    if output.is_json() {
        print_json(&serde_json::json!({
            "now_ms": reading.now_ms(),
            "now": format_ms(reading.now_ms()),
            "redis_ms": reading.redis_ms,
            "offset_ms": reading.offset_ms,
        }))?;
    } else {
        println!("{}", text(&reading));
    }
    Ok(0)
}

fn text(r: &Reading) -> String {
    let ahead = Duration::from_millis(r.offset_ms.max(0) as u64);
    format!(
        "{} (test clock, {} ahead of Redis's clock)",
        format_ms(r.now_ms()),
        humantime::format_duration(ahead)
    )
}
