//! What the `zdelay` and `zdelay-bench` binaries share before and after their command: the
//! options every command takes (config file, Redis URL, logging), the config they load,
//! logging and panics with every known secret scrubbed, and an error as one line.

use crate::config::{self, Config, redact_known};
use std::io::Write;
use std::path::PathBuf;

/// The options every command takes (global in `zdelay`'s subcommands).
#[derive(clap::Args, Clone, Debug)]
pub struct GlobalArgs {
    /// Config file (TOML). Without it: built-in defaults (Redis at 127.0.0.1:6379, one
    /// route "default" → list queue:default). ZDELAY_<SECTION>__<FIELD> variables override
    /// either.
    #[arg(long, global = true, env = "ZDELAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Redis URL, over the config file and ZDELAY_REDIS__URL (prefer the variable for a URL
    /// that carries a password: command lines are visible to other users of the host).
    #[arg(short = 'u', long, global = true)]
    pub redis_url: Option<String>,
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "zdelay=debug". Logs go to
    /// stderr.
    #[arg(long, global = true, env = "ZDELAY_LOG", default_value = "info")]
    pub log: String,
    /// Log line format: "text" for people, "json" (one object a line) for log collectors.
    #[arg(long, global = true, env = "ZDELAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl GlobalArgs {
    /// The config from `--config` (or the defaults), the environment and `--redis-url`,
    /// with a warning when the Redis server's certificate is not verified.
    pub fn load_config(&self) -> Result<Config, config::ConfigError> {
        let config =
            config::load_with_redis_url(self.config.as_deref(), self.redis_url.as_deref())?;
        if config.redis.tls.insecure_skip_verify {
            tracing::warn!(
                "redis.tls.insecure_skip_verify = true: the Redis server's certificate is NOT \
                 verified, so anyone on the network path can impersonate it and read the \
                 traffic; use redis.tls.ca_file instead outside tests"
            );
        }
        Ok(config)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Broker client libraries whose own lines repeat with every reconnect attempt (async-nats
/// logs each at INFO, lapin each failed connection at ERROR): the sinks log their outages
/// once per episode instead. A filter that names the library keeps its level.
const CLIENT_LEVELS: &[(&str, &str)] = &[("async_nats", "warn"), ("lapin", "off")];

/// `filter` with [`CLIENT_LEVELS`] for the libraries it does not name.
pub fn quiet_clients(filter: &str) -> String {
    let mut filter = filter.to_owned();
    for (library, level) in CLIENT_LEVELS {
        if !filter.contains(library) {
            filter.push_str(&format!(",{library}={level}"));
        }
    }
    filter
}

/// Logs to stderr through `filter` (EnvFilter syntax; "info" when it does not parse) in
/// `format`, every known secret scrubbed; and a panic hook that scrubs them too.
pub fn init_logging(filter: &str, format: LogFormat) {
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
    redact_panics();
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

/// An error chain as one line, each cause once (libraries often repeat their source's text
/// in their own message), every known secret scrubbed.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let message = cause.to_string();
        if message.is_empty() || text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    redact_known(&text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_names_each_cause_once() {
        let io = std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        );
        let e = anyhow::Error::new(io)
            .context("redis: Connection refused (os error 111)")
            .context("cannot use redis at redis://127.0.0.1:1");
        assert_eq!(
            error_text(&e),
            "cannot use redis at redis://127.0.0.1:1: redis: Connection refused (os error 111)"
        );
    }
}
