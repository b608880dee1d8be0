//! The `zdelay-bench` binary: arguments → logging → runtime → the benchmark → exit code.

use clap::Parser;
use std::time::Duration;
use zdelay::startup::{error_text, init_logging, quiet_clients};
use zdelay_bench::{Cli, REFERENCE_PAGE, REGENERATE};

fn main() {
    let cli = Cli::parse();
    if let Some(root) = &cli.gen_docs {
        std::process::exit(match zdelay_bench::gen_docs(root, cli.check) {
            Ok(false) => 0,
            Ok(true) if cli.check => {
                eprintln!("stale: {REFERENCE_PAGE}\nregenerate with: {REGENERATE}");
                1
            }
            Ok(true) => {
                eprintln!("wrote {REFERENCE_PAGE}");
                0
            }
            Err(e) => {
                eprintln!("zdelay-bench: error: {}", error_text(&e));
                1
            }
        });
    }
    init_logging(&quiet_clients(&cli.global.log), cli.global.log_format);
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    let result = runtime.block_on(async {
        let config = cli.global.load_config()?;
        zdelay_bench::run(config, cli.bench).await
    });
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("zdelay-bench: error: {}", error_text(&e));
            1
        }
    };
    // Do not wait for tasks stuck on I/O: the scratch keys are cleaned before this.
    runtime.shutdown_timeout(Duration::from_millis(100));
    std::process::exit(code);
}
