//! The generated reference (docs/reference/*.md and the config part of the chart's values
//! schema) matches what the code makes now, and the metric definitions name every label the
//! code sets.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// `ZDELAY_BLESS=1` rewrites the files instead of failing.
#[test]
fn reference_pages_are_current() {
    let root = env!("CARGO_MANIFEST_DIR");
    let bless = std::env::var_os("ZDELAY_BLESS").is_some_and(|v| v == "1");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zdelay"));
    cmd.args(["gen-docs", root]);
    if !bless {
        cmd.arg("--check");
    }
    let out = cmd.output().expect("zdelay gen-docs runs");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "generated reference files are stale:\n{said}\nregenerate them with \
         `cargo run -- gen-docs` or \
         `ZDELAY_BLESS=1 cargo test --test it reference_pages_are_current`, and commit them"
    );
    // The benchmark's own page, from its binary's command line.
    let mut cmd = Command::new(crate::common::bench_bin());
    cmd.args(["--gen-docs", root]);
    if !bless {
        cmd.arg("--check");
    }
    let out = cmd.output().expect("zdelay-bench --gen-docs runs");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the benchmark's reference page is stale:\n{said}\nregenerate it with \
         `cargo run -p zdelay-bench -- --gen-docs .` or \
         `ZDELAY_BLESS=1 cargo test --test it reference_pages_are_current`, and commit it"
    );
}

/// Every label a metric is recorded with in the source is declared in `metrics::METRICS`
/// (which the reference page lists), and every declared metric is recorded somewhere.
#[test]
fn metric_definitions_name_every_label_the_code_sets() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let metrics_rs = std::fs::read_to_string(root.join("src/metrics.rs")).unwrap();
    // const NAME: &str = "zdelay_…";
    let consts: BTreeMap<String, String> =
        regex::Regex::new(r#"pub const (\w+): &str = "(zdelay_\w+)";"#)
            .unwrap()
            .captures_iter(&metrics_rs)
            .map(|c| (c[1].to_owned(), c[2].to_owned()))
            .collect();
    assert!(consts.len() >= 20, "{consts:?}");
    let call =
        regex::Regex::new(r"(?:counter|gauge|histogram)!\(\s*(?:crate::metrics::)?([A-Z_]+)")
            .unwrap();
    let label = regex::Regex::new(r#""(\w+)"\s*=>"#).unwrap();
    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![root.join("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for c in call.captures_iter(&text) {
                    let Some(name) = consts.get(&c[1]) else {
                        continue;
                    };
                    let labels = used.entry(name.clone()).or_default();
                    let args = macro_arguments(&text[c.get(0).unwrap().end()..]);
                    for l in label.captures_iter(args) {
                        labels.insert(l[1].to_owned());
                    }
                }
            }
        }
    }
    // The per-schedule series are rendered as text, not recorded (a unit test of
    // `metrics` checks their labels against the table).
    for m in zdelay::metrics::METRICS
        .iter()
        .filter(|m| !zdelay::metrics::PER_SCHEDULE.contains(&m.name))
    {
        let declared: BTreeSet<&str> = m.labels.iter().map(|l| l.name).collect();
        let Some(set) = used.get(m.name) else {
            panic!("{} is declared but never recorded", m.name)
        };
        for l in set {
            assert!(
                declared.contains(l.as_str()),
                "{} is recorded with label {l}, which METRICS does not declare",
                m.name
            );
        }
    }
    for name in used.keys() {
        assert!(
            zdelay::metrics::METRICS.iter().any(|m| m.name == name),
            "{name} is recorded but not in METRICS"
        );
    }
}

/// The text up to the `)` that closes a macro call whose `(` came before `text`.
fn macro_arguments(text: &str) -> &str {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return &text[..i],
            ')' => depth -= 1,
            _ => {}
        }
    }
    text
}
