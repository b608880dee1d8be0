//! The import rules of `docs/internals/architecture.md`, checked on the source: no cycle
//! between the top-level modules of a crate, nor between the sibling files of a folder, the
//! producer crate never names the daemon's modules, the daemon never names the benchmark, and
//! the benchmark calls the daemon's modules the page lists and no other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (e.g. `poller::mover`) → source file, for every `.rs` file under `src`.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// The module paths a file refers to through `crate::…` and `super::…`, resolved against
/// the known modules (longest known prefix).
fn references(module: &str, text: &str, known: &BTreeMap<String, PathBuf>) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let parent: Vec<&str> = {
        let mut p: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
        // A folder's mod.rs is the folder itself: `super` is its parent too.
        p.pop();
        p
    };
    let mut out = BTreeSet::new();
    for (prefix, base) in [("crate::", Vec::new()), ("super::", parent)] {
        for (i, _) in code.match_indices(prefix) {
            if i > 0 && {
                let before = code.as_bytes()[i - 1];
                before.is_ascii_alphanumeric() || before == b'_' || before == b':'
            } {
                continue;
            }
            let rest = &code[i + prefix.len()..];
            let path: Vec<&str> = rest
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .next()
                .unwrap_or("")
                .split("::")
                .filter(|s| !s.is_empty())
                .collect();
            let mut full: Vec<&str> = base.clone();
            full.extend(path);
            while !full.is_empty() {
                let candidate = full.join("::");
                if known.contains_key(&candidate) {
                    out.insert(candidate);
                    break;
                }
                full.pop();
            }
        }
    }
    out
}

/// The first cycle in a directed graph, if any.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

/// Edges between top-level modules, and between siblings of each folder.
fn check_crate(src: &Path) {
    let known = modules(src);
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut siblings: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (module, path) in &known {
        let text = std::fs::read_to_string(path).expect("read source");
        let from: Vec<&str> = module.split("::").collect();
        for target in references(module, &text, &known) {
            let to: Vec<&str> = target.split("::").collect();
            if !module.is_empty() && from[0] != to[0] {
                top.entry(from[0].to_owned())
                    .or_default()
                    .insert(to[0].to_owned());
            }
            // Siblings: same parent folder, both below it (a folder's mod.rs is its face).
            if from.len() >= 2 && to.len() >= 2 && from[..from.len() - 1] == to[..to.len() - 1] {
                let folder = from[..from.len() - 1].join("::");
                siblings
                    .entry(folder)
                    .or_default()
                    .entry(module.clone())
                    .or_default()
                    .insert(target.clone());
            }
        }
    }
    if let Some(c) = cycle(&top) {
        panic!(
            "{}: top-level import cycle {}",
            src.display(),
            c.join(" → ")
        );
    }
    for (folder, graph) in &siblings {
        if let Some(c) = cycle(graph) {
            panic!(
                "{}: import cycle in {folder}: {}",
                src.display(),
                c.join(" → ")
            );
        }
    }
}

#[test]
fn no_import_cycles_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    check_crate(&root.join("src"));
    check_crate(&root.join("crates/zdelay-core/src"));
    check_crate(&root.join("crates/zdelay-client/src"));
    check_crate(&root.join("crates/zdelay-bench/src"));
}

/// Every `.rs` file under `dir` with its text (a crate's `lib.rs` and `main.rs` both, which
/// [`modules`] takes for one module).
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read source");
                out.push((path, text));
            }
        }
    }
    out
}

/// The benchmark is a crate of its own: the daemon's crate neither depends on it nor names
/// it, so the shipped `zdelay` binary does not contain it.
#[test]
fn the_daemon_never_names_the_benchmark() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (path, text) in sources(&root.join("src")) {
        assert!(
            !text.contains("zdelay_bench") && !text.contains("mod bench"),
            "{} names the benchmark",
            path.display()
        );
    }
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml");
    let dependencies = manifest.split("\n[").filter(|table| {
        table.starts_with("dependencies]") || table.starts_with("dev-dependencies]")
    });
    for table in dependencies {
        assert!(
            !table.contains("zdelay-bench"),
            "the zdelay package depends on zdelay-bench: [{table}"
        );
    }
}

/// The daemon's modules the benchmark calls are the ones `docs/internals/architecture.md`
/// lists for it ("The benchmark calls these modules of the daemon: …"), no more and no less.
#[test]
fn the_benchmark_calls_the_daemon_modules_the_page_lists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/internals/architecture.md"))
        .expect("read architecture.md");
    const LEAD: &str = "The benchmark calls these modules of the daemon:";
    let line = page
        .lines()
        .find(|l| l.starts_with(LEAD))
        .unwrap_or_else(|| panic!("architecture.md has no line starting {LEAD:?}"));
    let listed: BTreeSet<String> = line[LEAD.len()..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    let call = regex::Regex::new(r"\bzdelay::([a-z_]+)").unwrap();
    let called: BTreeSet<String> = sources(&root.join("crates/zdelay-bench/src"))
        .iter()
        .flat_map(|(_, text)| {
            call.captures_iter(text)
                .map(|c| c[1].to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        called, listed,
        "the daemon modules zdelay-bench calls (left) differ from architecture.md's list (right)"
    );
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(cycle(&graph).unwrap(), ["a", "b", "c", "a"]);
    let known: BTreeMap<String, PathBuf> = ["poller", "poller::mover", "poller::delivery"]
        .iter()
        .map(|m| (m.to_string(), PathBuf::new()))
        .collect();
    let refs = references(
        "poller::mover",
        "use super::delivery;\nuse crate::poller::delivery::x;",
        &known,
    );
    assert_eq!(refs, BTreeSet::from(["poller::delivery".to_owned()]));
}

#[test]
fn the_core_and_the_producer_crate_never_name_the_daemon() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crates = ["crates/zdelay-core/src", "crates/zdelay-client/src"];
    for (module, path) in crates.iter().flat_map(|c| modules(&root.join(c))) {
        let text = std::fs::read_to_string(&path).expect("read source");
        for daemon in [
            "zdelay::",
            "rdkafka::",
            "lapin::",
            "async_nats::",
            "axum::",
            "clap::",
            "opentelemetry::",
            "opentelemetry_sdk::",
        ] {
            assert!(
                !text.contains(daemon),
                "{} (module {module}) names {daemon}",
                path.display()
            );
        }
    }
}
