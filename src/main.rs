//! The `zdelay` binary: arguments → logging → runtime → command (`cli`) → exit code.

mod cli;

use clap::Parser;
use cli::Cli;
use std::time::Duration;
use zdelay::startup::{error_text, init_logging};

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_filter(), cli.global.log_format);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    let code = match runtime.block_on(cli::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zdelay: error: {}", error_text(&e));
            cli::exit_code(&e)
        }
    };
    // Do not wait for tasks stuck on I/O: everything that matters is in Redis.
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}
