//! The `zdelay` binary: arguments → logging → runtime → command (`cli`) → exit code.

mod cli;

use clap::Parser;
use cli::{Cli, LogFormat};
use std::time::Duration;

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_format);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    let code = match runtime.block_on(cli::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zdelay: error: {}", cli::error_text(&e));
            cli::exit_code(&e)
        }
    };
    // Do not wait for tasks stuck on I/O: everything that matters is in Redis.
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}

fn init_logging(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}
