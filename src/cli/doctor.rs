//! `zdelay check-config --connect`: renders `zdelay::preflight` — one line per check, what
//! to do under a failed one; exit 0 when every check passed, 1 otherwise.

use super::Output;
use zdelay::config::Config;

pub async fn run(config: &Config, output: Output) -> anyhow::Result<i32> {
    let checks = zdelay::preflight::run(config).await;
    let ok = checks.iter().all(|c| c.ok);
    if output.is_json() {
        super::print_json(&serde_json::json!({ "ok": ok, "checks": checks }))?;
    } else {
        for c in &checks {
            println!(
                "{:<7} {}: {}",
                if c.ok { "ok" } else { "PROBLEM" },
                c.check,
                c.detail
            );
            if let Some(hint) = &c.hint {
                println!("        to fix: {hint}");
            }
        }
        let failed = checks.iter().filter(|c| !c.ok).count();
        if failed > 0 {
            eprintln!("{failed} of {} checks failed", checks.len());
        }
    }
    Ok(if ok { 0 } else { 1 })
}
