//! The `zdelay` binary: arguments → logging → runtime → command (`cli`) → exit code.

mod cli;

use clap::Parser;
use cli::{Cli, LogFormat};
use std::io::Write;
use std::time::Duration;
use zdelay::config::redact_known;

fn main() {
    let cli = Cli::parse();
    init_logging(&cli.log_filter(), cli.log_format);
    redact_panics();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    let code = match runtime.block_on(cli::dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("zdelay: error: {}", redact_known(&cli::error_text(&e)));
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
        .with_writer(|| RedactedStderr);
    match format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

/// Standard error with every secret the config holds scrubbed: the brokers' and Redis's
/// clients log the addresses they were given (with credentials) at debug and trace level,
/// and their errors quote them. tracing writes one whole event per `write`.
struct RedactedStderr;

impl Write for RedactedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        std::io::stderr().write_all(redact_known(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// A panic message may hold a value that carries a secret: print it scrubbed.
fn redact_panics() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let _ = writeln!(
            std::io::stderr(),
            "thread '{name}' {}",
            redact_known(&info.to_string())
        );
    }));
}
