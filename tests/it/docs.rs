//! The documentation's links hold: every relative link in README.md, CONTRIBUTING.md,
//! SECURITY.md, CHANGELOG.md and the book (`docs/**/*.md`) names a file that exists, and every
//! `#anchor` names a heading of its page (the slug rule mdBook and GitHub share). Every page
//! under `docs/` is in `docs/SUMMARY.md`, each alert of the Prometheus rules has its runbook
//! heading, and the README stays short. Markdown is parsed with pulldown-cmark (the parser
//! mdBook uses), so links inside code are not links and links may span lines.

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};
use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

const README_MAX_LINES: usize = 200;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn parser(text: &str) -> Parser<'_> {
    Parser::new_ext(text, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH)
}

/// A heading's anchor: trimmed, lower-case, whitespace to `-`, every character dropped that is
/// not alphanumeric, `-` or `_` (mdBook's `id_from_content`; GitHub's rule for the same text).
fn slug(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().collect::<String>())
            } else if c.is_whitespace() {
                Some("-".to_owned())
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a page's headings; an anchor already taken gets the first free `-1`, `-2`, …
/// suffix, as mdBook's `unique_id` does.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut heading: Option<String> = None;
    for event in parser(markdown) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let mut id = base.clone();
                let mut n = 0;
                while !found.insert(id.clone()) {
                    n += 1;
                    id = format!("{base}-{n}");
                }
            }
            _ => {}
        }
    }
    found
}

/// Every link and image target of a page, in order (code spans and blocks hold none).
fn link_targets(markdown: &str) -> Vec<String> {
    parser(markdown)
        .filter_map(|event| match event {
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => Some(dest_url.into_string()),
            _ => None,
        })
        .collect()
}

fn is_external(target: &str) -> bool {
    ["http://", "https://", "mailto:"]
        .iter()
        .any(|scheme| target.starts_with(scheme))
}

/// `a/b/../c` → `a/c`, without touching the file system (the target may not exist).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Every broken link of `files` (paths relative to `root`), one line each: a target file that
/// does not exist, or an anchor no heading of the target page has.
fn broken_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut page_anchors: HashMap<PathBuf, BTreeSet<String>> = HashMap::new();
    let mut anchors_of = |page: &Path| -> Option<BTreeSet<String>> {
        if let Some(found) = page_anchors.get(page) {
            return Some(found.clone());
        }
        let text = std::fs::read_to_string(root.join(page)).ok()?;
        let found = anchors(&text);
        page_anchors.insert(page.to_owned(), found.clone());
        Some(found)
    };
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        let dir = file.parent().unwrap_or(Path::new(""));
        for target in link_targets(&text) {
            if is_external(&target) {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let page = if path.is_empty() {
                file.clone()
            } else {
                normalize(&dir.join(path))
            };
            if !root.join(&page).exists() {
                problems.push(format!(
                    "{}: link {target}: {} does not exist",
                    file.display(),
                    page.display()
                ));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if page.extension().is_some_and(|e| e == "md") {
                let found = anchors_of(&page).unwrap_or_default();
                if !found.contains(anchor) {
                    problems.push(format!(
                        "{}: link {target}: {} has no heading #{anchor}",
                        file.display(),
                        page.display()
                    ));
                }
            }
        }
    }
    problems
}

/// The book's pages: every `.md` under `dir`, relative to `root`, sorted.
fn markdown_under(root: &Path, dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    files_under(&root.join(dir), &mut found);
    let mut pages: Vec<PathBuf> = found
        .into_iter()
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .map(|path| path.strip_prefix(root).expect("under root").to_owned())
        .collect();
    pages.sort();
    pages
}

fn checked_files(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "README.md",
        "CONTRIBUTING.md",
        "SECURITY.md",
        "CHANGELOG.md",
    ]
    .into_iter()
    .map(PathBuf::from)
    .collect();
    files.extend(markdown_under(root, Path::new("docs")));
    files
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = repo_root();
    let files = checked_files(&root);
    assert!(
        files.len() > 30,
        "the book's pages were not found: {files:?}"
    );
    let problems = broken_links(&root, &files);
    assert!(
        problems.is_empty(),
        "{} broken links:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_book_page_is_in_the_summary() {
    let root = repo_root();
    let summary = std::fs::read_to_string(root.join("docs/SUMMARY.md")).expect("docs/SUMMARY.md");
    let listed: BTreeSet<PathBuf> = link_targets(&summary)
        .iter()
        .map(|t| normalize(&Path::new("docs").join(t)))
        .collect();
    let missing: Vec<_> = markdown_under(&root, Path::new("docs"))
        .into_iter()
        .filter(|page| page != Path::new("docs/SUMMARY.md") && !listed.contains(page))
        .collect();
    assert!(
        missing.is_empty(),
        "pages not in docs/SUMMARY.md (mdBook would not build them): {missing:?}"
    );
}

#[test]
fn every_alert_has_its_runbook() {
    let root = repo_root();
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/zdelay-rules.yaml"))
        .expect("deploy/prometheus/zdelay-rules.yaml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- alert:"))
        .map(str::trim)
        .collect();
    assert!(
        alerts.len() >= 5,
        "alerts not found in the rules: {alerts:?}"
    );
    let guide = std::fs::read_to_string(root.join("docs/guides/monitoring.md"))
        .expect("docs/guides/monitoring.md");
    let runbooks = guide
        .split_once("\n## Runbooks\n")
        .map(|(_, rest)| rest)
        .expect("docs/guides/monitoring.md has a ## Runbooks section");
    let headings: BTreeSet<&str> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .collect();
    let missing: Vec<_> = alerts.iter().filter(|a| !headings.contains(**a)).collect();
    assert!(
        missing.is_empty(),
        "alerts without a `### <name>` runbook: {missing:?}"
    );
    let unknown: Vec<_> = headings.iter().filter(|h| !alerts.contains(h)).collect();
    assert!(unknown.is_empty(), "runbooks of no alert: {unknown:?}");
}

#[test]
fn the_readme_stays_short() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; at most {README_MAX_LINES}: move detail into the book (docs/)"
    );
}

#[test]
fn slugs_follow_the_mdbook_rule() {
    assert_eq!(slug("Leases and fencing"), "leases-and-fencing");
    assert_eq!(slug("Raw producers: just ZADD"), "raw-producers-just-zadd");
    assert_eq!(slug("1. Create the topic"), "1-create-the-topic");
    assert_eq!(slug("ZdelayDestinationMissing"), "zdelaydestinationmissing");
    assert_eq!(slug("The daemon's user"), "the-daemons-user");
    assert_eq!(slug("snake_case and-dash"), "snake_case-and-dash");
    assert_eq!(slug("… says layout …"), "-says-layout-");
    assert_eq!(slug("  Ünïcode Stays  "), "ünïcode-stays");
}

#[test]
fn headings_links_and_code_are_told_apart() {
    let page = "# Title\n\n## Same\n\n## Same-1\n\n## Same\n\n### `code` in it\n\n\
                See [a\nlink](b.md#x) and ![img](i.png).\n\n\
                ```sh\n[not](a-link.md)\n# not a heading\n```\n\n`[nor](this.md)`\n";
    assert_eq!(
        anchors(page).into_iter().collect::<Vec<_>>(),
        ["code-in-it", "same", "same-1", "same-2", "title"]
    );
    assert_eq!(link_targets(page), ["b.md#x", "i.png"]);
}

/// The checker itself fails on what it must catch: a missing file, a missing anchor on
/// another page and on the same page; it passes good links and skips web links.
#[test]
fn broken_links_are_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    std::fs::create_dir_all(root.join("docs/guides")).expect("mkdir");
    std::fs::write(root.join("docs/guides/b.md"), "# B\n\n## Real heading\n").expect("write");
    std::fs::write(
        root.join("docs/a.md"),
        "# A\n\n[ok](guides/b.md#real-heading) [ok](#a) [web](https://example.com/x#y)\n\
         [gone](guides/missing.md) [bad](guides/b.md#no-such) [self](#nowhere)\n",
    )
    .expect("write");
    let problems = broken_links(root, &[PathBuf::from("docs/a.md")]);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(
        problems[0].contains("docs/guides/missing.md does not exist"),
        "{problems:#?}"
    );
    assert!(
        problems[1].contains("has no heading #no-such"),
        "{problems:#?}"
    );
    assert!(
        problems[2].contains("docs/a.md has no heading #nowhere"),
        "{problems:#?}"
    );
}

/// Every time the pages show being typed (`--at`, `--from`, `--start-at`, `--end-at`, JSON
/// `at`/`start_at`/`end_at`, `?at=`) is read by zdelay's one time parser, as jiff reads it.
#[test]
fn every_example_time_in_the_docs_is_read_as_written() {
    let root = repo_root();
    let pattern = regex::Regex::new(
        r#"--(?:at|from|start-at|end-at)[ =]([0-9][^ `'"]*)|"(?:at|start_at|end_at)" *: *"?([0-9][^",} ]*)|[?&]at=([0-9][^& `]*)"#,
    )
    .unwrap();
    let mut seen = Vec::new();
    for file in checked_files(&root) {
        if file == Path::new("CHANGELOG.md") {
            continue;
        }
        let text = std::fs::read_to_string(root.join(&file)).expect("page");
        for found in pattern.captures_iter(&text) {
            let time = (1..=3).find_map(|i| found.get(i)).unwrap().as_str();
            let read = zdelay::job::parse_at(time)
                .unwrap_or_else(|e| panic!("{}: {time}: {e}", file.display()));
            if time.contains(['T', 't', ' ']) {
                let jiff: jiff::Timestamp = time.parse().unwrap();
                assert_eq!(read, jiff.as_millisecond(), "{}: {time}", file.display());
            }
            seen.push(format!("{}: {time}", file.display()));
        }
    }
    for example in [
        "docs/getting-started.md: 2026-12-01T09:00:00+01:00",
        "docs/concepts/schedules.md: 2026-03-28T12:00:00Z",
    ] {
        assert!(
            seen.iter().any(|s| s == example),
            "{example} not found in {seen:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// User pages for users: no insider text outside docs/internals.

/// The pages a user reads: the book except its internals, the READMEs of what users install,
/// and the comments of the example configs.
fn user_pages(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = markdown_under(root, Path::new("docs"))
        .into_iter()
        .filter(|page| !page.starts_with("docs/internals"))
        .collect();
    for readme in [
        "README.md",
        "clients/python/README.md",
        "clients/node/README.md",
        "crates/zdelay-client/README.md",
        "charts/zdelay/README.md",
        "config/zdelay.toml",
    ] {
        if root.join(readme).exists() {
            files.push(PathBuf::from(readme));
        }
    }
    let mut examples = Vec::new();
    files_under(&root.join("config/examples"), &mut examples);
    let mut configs: Vec<PathBuf> = examples
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| p.strip_prefix(root).expect("under root").to_owned())
        .collect();
    configs.sort();
    files.extend(configs);
    files
}

/// What the insider-text lint compares pages with, gathered from the repository.
struct InsiderRules {
    /// Names of the test functions under `tests/` (only those with a `_`: a one-word name
    /// cannot be told apart from prose).
    test_names: BTreeSet<String>,
    /// Features of the workspace's crates that exist for the tests (`test-failpoints`).
    test_features: BTreeSet<String>,
    /// Every commit of the repository's history (empty outside a git checkout).
    commits: Vec<String>,
    /// The file name of every Markdown file in the repository.
    markdown_names: BTreeSet<String>,
    /// The repository's top-level directories (a path starting with one names a file here).
    top_dirs: BTreeSet<String>,
    /// The daemon's and its core's module names (`poller`, `wake`): a Rust path starting with
    /// one names code users do not call (the library's public paths start with its crate).
    internal_modules: BTreeSet<String>,
}

/// Every file under `dir` (absolute paths), leaving out build output, dependencies and hidden
/// directories.
fn files_under(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "node_modules" | "build" | "dist" | ".git")
                && !name.starts_with('.')
            {
                files_under(&path, found);
            }
        } else {
            found.push(path);
        }
    }
}

impl InsiderRules {
    fn of_repository(root: &Path) -> Self {
        let test_fn = regex::Regex::new(
            r"#\[(?:tokio::)?test[^\]]*\]\s*(?:#\[[^\]]*\]\s*)*(?:pub\s+)?(?:async\s+)?fn\s+(\w+)",
        )
        .unwrap();
        let mut test_names = BTreeSet::new();
        let mut sources = Vec::new();
        files_under(&root.join("tests"), &mut sources);
        for file in sources
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        {
            let text = std::fs::read_to_string(file).expect("test source");
            for found in test_fn.captures_iter(&text) {
                let name = &found[1];
                if name.contains('_') {
                    test_names.insert(name.to_owned());
                }
            }
        }
        let mut test_features = BTreeSet::new();
        let mut manifests = vec![root.join("Cargo.toml")];
        if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
            manifests.extend(crates.map(|c| c.expect("dir entry").path().join("Cargo.toml")));
        }
        for manifest in manifests {
            let Ok(text) = std::fs::read_to_string(&manifest) else {
                continue;
            };
            let Some((_, features)) = text.split_once("\n[features]\n") else {
                continue;
            };
            for line in features.lines().take_while(|l| !l.starts_with('[')) {
                if let Some((name, _)) = line.split_once('=') {
                    let name = name.trim();
                    if name.contains("test") || name.contains("failpoint") {
                        test_features.insert(name.to_owned());
                    }
                }
            }
        }
        let commits = std::process::Command::new("git")
            .args(["log", "--all", "--format=%H"])
            .current_dir(root)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| {
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let mut all = Vec::new();
        files_under(root, &mut all);
        let markdown_names = all
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect();
        let top_dirs = std::fs::read_dir(root)
            .expect("repository root")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| p.is_dir())
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .filter(|n| !n.starts_with('.') && n != "target")
            .collect();
        let mut internal_sources = Vec::new();
        files_under(&root.join("src"), &mut internal_sources);
        files_under(&root.join("crates/zdelay-core/src"), &mut internal_sources);
        let mut internal_modules = BTreeSet::new();
        for file in internal_sources
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        {
            let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            let names = [
                stem,
                file.parent()
                    .and_then(|d| d.file_name()?.to_str())
                    .unwrap_or(""),
            ];
            for name in names {
                if !matches!(name, "" | "lib" | "main" | "mod" | "src") {
                    internal_modules.insert(name.to_owned());
                }
            }
        }
        InsiderRules {
            test_names,
            test_features,
            commits,
            markdown_names,
            top_dirs,
            internal_modules,
        }
    }
}

/// Pages about a tool that is only built from the repository (the benchmark): they may show
/// its build path.
const BUILT_FROM_SOURCE_PAGES: [&str; 2] =
    ["docs/operations/benchmarks.md", "docs/reference/bench.md"];

/// Every line of a user page that carries insider text, as `file:line: why: the line`. The
/// rules:
/// - **source paths**: a path into `src/`, `tests/` or `benches/` (of any crate or client):
///   users read the docs, not the code;
/// - **build paths**: `target/debug` anywhere (a debug build is the developers'); `target/release`
///   only under a heading that says "source" (such as "Build from source") or on the
///   benchmark's pages, whose tool is built from the repository only;
/// - **test names**: the name of a test function under `tests/`;
/// - **test features**: a Cargo feature that exists for the tests (`test-failpoints`);
/// - **issue numbers**: "issue 16", "PR 12", "#16";
/// - **commit hashes**: a word of 7–40 hex digits that starts a commit of this repository,
///   anywhere; or, in prose (outside code), any such word with both digits and letters
///   (inside code such words are ids, trace ids, keys);
/// - **files not in the repository**: a `*.md` file no file of the repository is named, or a
///   path starting with one of the repository's top-level directories that does not exist;
/// - **the design documents**: "design contract", "DESIGN §": they are not published;
/// - **Rust paths into the daemon's code** (`poller::run`): the library's public paths start
///   with its crate (`zdelay_client::…`) and pass.
///
/// In TOML files only comments are read.
fn insider_text(root: &Path, file: &Path, text: &str, rules: &InsiderRules) -> Vec<String> {
    let source_path =
        regex::Regex::new(r"(?:^|[^\w./-])((?:[\w.-]+/)*(?:src|tests|benches)/[\w./-]*)").unwrap();
    let build_path = regex::Regex::new(r"\btarget/(debug|release)\b").unwrap();
    let issue = regex::Regex::new(
        r"(?i)\b((?:issues?|PRs?|pull\s+requests?)\s*#?\d+)\b|(?:^|[\s(\[,;])(#\d+)(?:$|[^\w-])",
    )
    .unwrap();
    let hex = regex::Regex::new(r"(?:^|[^0-9A-Za-z_])([0-9a-f]{7,40})(?:$|[^0-9A-Za-z_])").unwrap();
    let md_file = regex::Regex::new(r"(?:^|[^\w./-])([\w./-]*[\w-]\.md)\b").unwrap();
    let repo_path = regex::Regex::new(r"(?:^|[\s(`'\x22=])((?:[\w.-]+/)+[\w.-]*)").unwrap();
    let design = regex::Regex::new(r"(?i)design\s+contract|\bDESIGN\s+§").unwrap();
    let rust_path = regex::Regex::new(r"(?:^|[^\w:])(([a-z_]+)::[\w:]*\w)").unwrap();
    let is_toml = file.extension().is_some_and(|e| e == "toml");
    let built_from_source_page = BUILT_FROM_SOURCE_PAGES.iter().any(|p| file == Path::new(p));
    let dir = file.parent().unwrap_or(Path::new(""));

    // In TOML only the comments are read; lines keep their numbers.
    let text: String = if is_toml {
        text.lines()
            .map(|l| toml_comment(l).unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        text.to_owned()
    };
    let raw_lines: Vec<&str> = text.lines().collect();
    let line_of = |offset: usize| text[..offset].matches('\n').count();
    // Phrases may be wrapped over two lines: these are matched on the whole text.
    let mut phrases: Vec<(usize, String)> = Vec::new();
    for found in issue.captures_iter(&text) {
        let m = found.get(1).or(found.get(2)).expect("a group");
        phrases.push((
            line_of(m.start()),
            format!(
                "issue number `{}`: say what changed, not where it was discussed",
                m.as_str().split_whitespace().collect::<Vec<_>>().join(" ")
            ),
        ));
    }
    for found in design.find_iter(&text) {
        phrases.push((
            line_of(found.start()),
            format!(
                "`{}`: the design documents are not published; say what zdelay does",
                found
                    .as_str()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        ));
    }

    let mut problems = Vec::new();
    let mut in_fence = false;
    let mut heading = String::new();
    for (n, &line) in raw_lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if !is_toml && (trimmed.starts_with("```") || trimmed.starts_with("~~~")) {
            in_fence = !in_fence;
            continue;
        }
        if !is_toml && !in_fence && trimmed.starts_with('#') {
            heading = trimmed.trim_start_matches('#').trim().to_lowercase();
        }
        let mut why = Vec::new();
        for found in source_path.captures_iter(line) {
            let path = found[1].trim_end_matches(['.', ',', ':', ';']);
            why.push(format!(
                "source path `{path}`: say what it does for the user"
            ));
        }
        for found in build_path.captures_iter(line) {
            let release_ok =
                &found[1] == "release" && (built_from_source_page || heading.contains("source"));
            if !release_ok {
                why.push(format!(
                    "build path `{}`: users run the installed `zdelay` (a release build's \
                     path only under a heading about building from source)",
                    &found[0]
                ));
            }
        }
        for found in rust_path.captures_iter(line) {
            if rules.internal_modules.contains(&found[2]) {
                why.push(format!(
                    "Rust path `{}` into the daemon's code: say what it does",
                    &found[1]
                ));
            }
        }
        for word in line.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if rules.test_names.contains(word) {
                why.push(format!(
                    "test name `{word}`: say what is checked, not which test"
                ));
            }
        }
        for feature in &rules.test_features {
            if line.contains(feature.as_str()) {
                why.push(format!("test feature `{feature}`: users never build it"));
            }
        }
        let prose = if in_fence || is_toml {
            String::new()
        } else {
            outside_code_spans(line)
        };
        for found in hex.captures_iter(line) {
            let word = &found[1];
            let commit = rules.commits.iter().any(|c| c.starts_with(word));
            let mixed = word.bytes().any(|b| b.is_ascii_digit())
                && word.bytes().any(|b| b.is_ascii_alphabetic());
            let in_prose = hex.captures_iter(&prose).any(|p| &p[1] == word);
            if commit || (mixed && in_prose) {
                why.push(format!(
                    "commit hash `{word}`: say which release, or what changed"
                ));
            }
        }
        for found in md_file.captures_iter(line) {
            let path = &found[1];
            let first = path.split('/').next().unwrap_or("");
            if rules.top_dirs.contains(first) {
                continue; // a path into the repository: checked as one below
            }
            let name = Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("");
            let exists = root.join(dir).join(path).exists()
                || root.join(path).exists()
                || rules.markdown_names.contains(name);
            if !exists {
                why.push(format!(
                    "`{path}` is not in the repository: users cannot read it"
                ));
            }
        }
        for found in repo_path.captures_iter(line) {
            let path = found[1].trim_end_matches(['.', ',', ':', ';']);
            let first = path.split('/').next().unwrap_or("");
            if !rules.top_dirs.contains(first)
                || path.contains(['<', '>', '*', '…', '{', '$'])
                || path.contains("...")
            {
                continue;
            }
            if !root.join(path).exists() && !root.join(dir).join(path).exists() {
                why.push(format!("`{path}` does not exist in the repository"));
            }
        }
        why.extend(
            phrases
                .iter()
                .filter(|(at, _)| *at == n)
                .map(|(_, reason)| reason.clone()),
        );
        for reason in why {
            problems.push(format!(
                "{}:{}: {reason}: {}",
                file.display(),
                n + 1,
                line.trim()
            ));
        }
    }
    problems
}

/// The comment of a TOML line (after a `#` outside a string), if it has one.
fn toml_comment(line: &str) -> Option<&str> {
    let mut quote: Option<char> = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '#') => return Some(&line[i + 1..]),
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            _ => {}
        }
    }
    None
}

/// A line with its `code spans` blanked out.
fn outside_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if in_code {
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

fn insider_text_of(root: &Path, files: &[PathBuf], rules: &InsiderRules) -> Vec<String> {
    files
        .iter()
        .flat_map(|file| {
            let text = std::fs::read_to_string(root.join(file))
                .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
            insider_text(root, file, &text, rules)
        })
        .collect()
}

#[test]
fn user_pages_carry_no_insider_text() {
    let root = repo_root();
    let rules = InsiderRules::of_repository(&root);
    assert!(
        rules.test_names.len() > 100 && rules.test_features.contains("test-failpoints"),
        "the tests' names and features were not found: {} names, features {:?}",
        rules.test_names.len(),
        rules.test_features
    );
    let files = user_pages(&root);
    assert!(files.len() > 30, "the user pages were not found: {files:?}");
    let problems = insider_text_of(&root, &files, &rules);
    assert!(
        problems.is_empty(),
        "{} lines of user pages carry insider text (users read the docs, not the code: say \
         what to do, what happens, what it costs):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The lint catches an example of each kind, and leaves alone what looks like them but is not.
#[test]
fn insider_text_is_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    for d in ["docs/guides", "config", "scripts"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    std::fs::write(root.join("config/zdelay.toml"), "").expect("write");
    std::fs::write(root.join("README.md"), "").expect("write");
    let rules = InsiderRules {
        test_names: ["a_crash_loses_nothing".to_owned()].into(),
        test_features: ["test-failpoints".to_owned()].into(),
        commits: vec!["5319fa6c0ffee5319fa6c0ffee5319fa6c0ffee5".to_owned()],
        markdown_names: ["README.md".to_owned(), "a.md".to_owned()].into(),
        top_dirs: ["config".to_owned(), "scripts".to_owned(), "docs".to_owned()].into(),
        internal_modules: ["poller".to_owned(), "schedule".to_owned()].into(),
    };
    let bad = [
        "The cron code is in crates/zdelay-core/src/schedule.rs.",
        "See `tests/it/schedules.rs` for the cases.",
        "Run `target/debug/zdelay run`.",
        "Then `target/release/zdelay stats`.",
        "The test a_crash_loses_nothing shows it.",
        "Build with `--features test-failpoints`.",
        "Since issue 16 the lanes are the default.",
        "Fixed in #16.",
        "Fixed by commit 5319fa6.",
        "A hash in prose: 9f0bd1b.",
        "As DESIGN.md says, it holds.",
        "Start from `config/missing.toml`.",
        "The bench starts `poller::run` tasks.",
        "It is part of the design",
        "contract's API (a phrase wrapped over two lines is still found).",
    ];
    let good = [
        "# Build from source",
        "```sh",
        "target/release/zdelay --config config/zdelay.toml run   # under a heading about source",
        "redis-cli ZADD k 1795449639493 '{\"trace\":\"4bf92f3577b34da6\"}'   # ids in code are data",
        "```",
        "## Next",
        "See [the README](../../README.md), `config/zdelay.toml`, `scripts/`, `examples/seeds/<name>/`.",
        "Headings link as [first](#1-create-the-topic); a member id `1795449639493-3f0c9a1e2b4d5c6f`.",
        "A job is due at 1795250000250 ms; a crash loses nothing; a test suite runs it.",
        "The library's `zdelay_client::core::schedule::ScheduleDef` computes occurrences.",
    ];
    let page = format!("# A\n\n{}\n\n{}\n", good.join("\n"), bad.join("\n"));
    let problems = insider_text(root, Path::new("docs/guides/a.md"), &page, &rules);
    let expect = [
        "source path `crates/zdelay-core/src/schedule.rs`",
        "source path `tests/it/schedules.rs`",
        "build path `target/debug`",
        "build path `target/release`",
        "test name `a_crash_loses_nothing`",
        "test feature `test-failpoints`",
        "issue number `issue 16`",
        "issue number `#16",
        "commit hash `5319fa6`",
        "commit hash `9f0bd1b`",
        "`DESIGN.md` is not in the repository",
        "`config/missing.toml` does not exist",
        "Rust path `poller::run`",
        "`design contract`",
    ];
    // The wrapped phrase is reported once, on the line it starts on.
    let reported_bad = &bad[..bad.len() - 1];
    for (line, what) in reported_bad.iter().zip(expect) {
        assert!(
            problems
                .iter()
                .any(|p| p.contains(what) && p.ends_with(line)),
            "not reported: {what} in {line:?}; reported:\n{}",
            problems.join("\n")
        );
    }
    assert_eq!(
        problems.len(),
        reported_bad.len(),
        "reported other than the bad lines, once each:\n{}",
        problems.join("\n")
    );
    let first_bad = page.lines().position(|l| l == bad[0]).expect("in the page") + 1;
    assert!(
        problems[0].starts_with(&format!("docs/guides/a.md:{first_bad}: source path")),
        "file:line first: {}",
        problems[0]
    );

    let config = "# Kafka example: see tests/it/kafka.rs\nkey = \"#16 is a string\"   # fine\n";
    let problems = insider_text(root, Path::new("config/examples/k.toml"), config, &rules);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        problems[0].starts_with("config/examples/k.toml:1: source path"),
        "{problems:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// One source for figures: what the introduction and the README say zdelay measures comes from
// the benchmarks page.

const BENCHMARKS: &str = "docs/operations/benchmarks.md";

/// A figure: a number or range with a unit (`966k jobs/s`, `0.92×`, `2–3 ms`, `282 B`,
/// `4.6–5.7 µs`, `0.29 %`).
fn figure_pattern() -> regex::Regex {
    regex::Regex::new(
        r"(?:^|[^\w.,])(\d[\d,]*(?:\.\d+)?(?:\s*[–-]\s*\d[\d,]*(?:\.\d+)?)?[kM]?\s?(?:µs|ms|s|jobs/s|msgs/s|/s|×|B|KiB|MiB|MB|%)(?:/s)?)(?:$|[^\w])",
    )
    .unwrap()
}

/// Whether a figure is a measurement, not a setting or a bound: its unit only a measurement
/// has (µs, a rate, a ratio, bytes per job, a share of a core), or a time said to be measured
/// ("about 20 ms", "p99 2 ms", "lateness … 3 ms", "under 25 ms").
fn is_measured(figure: &str, before: &str) -> bool {
    let unit_only_measured = ["µs", "/s", "×", " B", "%"]
        .iter()
        .any(|u| figure.ends_with(u))
        || figure.ends_with('B') && !figure.ends_with("MB") && !figure.ends_with("iB");
    let context: String = before
        .chars()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let said_measured =
        regex::Regex::new(r"(?i)\b(p\d+|lateness|late|about|around|under|takes|costs?)\b|[~≈]")
            .unwrap()
            .is_match(&context);
    unit_only_measured || said_measured
}

fn squash(text: &str) -> String {
    text.replace('\u{a0}', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The text of a page's section: from the heading with `anchor` to the next heading of the
/// same or a higher level (the whole page without an anchor).
fn section(markdown: &str, anchor: Option<&str>) -> Option<String> {
    let Some(anchor) = anchor else {
        return Some(markdown.to_owned());
    };
    let mut taken: BTreeSet<String> = BTreeSet::new();
    let mut found: Option<usize> = None;
    let mut in_fence = false;
    let mut out = String::new();
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_fence = !in_fence;
        }
        let level = if in_fence {
            0
        } else {
            trimmed.chars().take_while(|c| *c == '#').count()
        };
        if level > 0 && trimmed[level..].starts_with(' ') {
            if let Some(start) = found
                && level <= start
            {
                return Some(out);
            }
            let base = slug(&trimmed[level..].replace('`', ""));
            let mut id = base.clone();
            let mut n = 0;
            while !taken.insert(id.clone()) {
                n += 1;
                id = format!("{base}-{n}");
            }
            if found.is_none() && id == anchor {
                found = Some(level);
            }
        }
        if found.is_some() {
            out.push_str(line);
            out.push('\n');
        }
    }
    found.map(|_| out)
}

/// Whether a benchmarks section states a figure: word for word, or its number on a line (a
/// table row) that names its unit (`Kafka 114–158k` in the row of "confirmed msgs/s").
fn states(section: &str, figure: &str) -> bool {
    if squash(section).contains(figure) {
        return true;
    }
    let split = figure
        .char_indices()
        .skip(1)
        .find(|(_, c)| !(c.is_ascii_digit() || matches!(c, ',' | '.' | '–' | '-' | 'k' | 'M')))
        .map(|(i, _)| i)
        .unwrap_or(figure.len());
    let (number, unit) = (figure[..split].trim(), figure[split..].trim());
    let token = regex::Regex::new(&format!(
        r"(?:^|[^\w.,–-]){}(?:$|[^\w.,–-])",
        regex::escape(number)
    ))
    .unwrap();
    !unit.is_empty()
        && section
            .lines()
            .any(|line| token.is_match(line) && line.contains(unit))
}

/// Every problem with the figures of `file` (relative to `root`): a figure in a link to the
/// benchmarks page that the linked section does not state, or a measured figure not linked to
/// the benchmarks page. Code (commands, config) holds settings, not figures, and is skipped.
fn figure_problems(root: &Path, file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join(file))
        .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let benchmarks_page = std::fs::read_to_string(root.join(BENCHMARKS)).expect("benchmarks page");
    let dir = file.parent().unwrap_or(Path::new(""));
    let figure = figure_pattern();
    let mut problems = Vec::new();
    // Prose outside links to the benchmarks page, block by block; a linked figure's text.
    let mut prose = String::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut link: Option<(Option<String>, String)> = None;
    let mut in_code_block = false;
    for event in parser(&text) {
        match event {
            Event::Start(Tag::Link { dest_url, .. }) => {
                let (path, anchor) = match dest_url.split_once('#') {
                    Some((p, a)) => (p.to_owned(), Some(a.to_owned())),
                    None => (dest_url.to_string(), None),
                };
                if !path.is_empty() && normalize(&dir.join(&path)) == Path::new(BENCHMARKS) {
                    link = Some((anchor, String::new()));
                }
            }
            Event::End(TagEnd::Link) => {
                if let Some((anchor, linked)) = link.take() {
                    let linked = squash(&linked);
                    let Some(source) = section(&benchmarks_page, anchor.as_deref()) else {
                        problems.push(format!(
                            "{}: link to {BENCHMARKS}#{} names no section",
                            file.display(),
                            anchor.unwrap_or_default()
                        ));
                        continue;
                    };
                    let mut any = false;
                    for found in figure.captures_iter(&linked) {
                        any = true;
                        let f = squash(&found[1]);
                        if !states(&source, &f) {
                            problems.push(format!(
                                "{}: `{f}` (in \"{linked}\") is not on the benchmarks page{}: \
                                 take the figure from there",
                                file.display(),
                                anchor
                                    .as_deref()
                                    .map(|a| format!(" under #{a}"))
                                    .unwrap_or_default()
                            ));
                        }
                    }
                    if any {
                        prose.push_str(" [figure] ");
                    } else {
                        prose.push_str(&linked);
                    }
                }
            }
            Event::Start(Tag::CodeBlock(_)) => in_code_block = true,
            Event::End(TagEnd::CodeBlock) => in_code_block = false,
            Event::Text(t) if !in_code_block => match link.as_mut() {
                Some((_, linked)) => linked.push_str(&t),
                None => prose.push_str(&t),
            },
            Event::Code(_) => prose.push_str(" `code` "),
            Event::SoftBreak | Event::HardBreak => match link.as_mut() {
                Some((_, linked)) => linked.push(' '),
                None => prose.push(' '),
            },
            Event::End(
                TagEnd::Paragraph | TagEnd::Item | TagEnd::TableCell | TagEnd::Heading(_),
            ) => {
                blocks.push(std::mem::take(&mut prose));
            }
            _ => {}
        }
    }
    blocks.push(prose);
    for block in blocks {
        for found in figure.captures_iter(&block) {
            let m = found.get(1).expect("group");
            if is_measured(m.as_str(), &block[..m.start()]) {
                problems.push(format!(
                    "{}: measured figure `{}` not linked to the benchmarks page: link it to the \
                     section it comes from ([{}]({}#…)): …{}…",
                    file.display(),
                    m.as_str(),
                    m.as_str(),
                    BENCHMARKS,
                    block[m.start().saturating_sub(60)..]
                        .chars()
                        .take(120)
                        .collect::<String>()
                        .trim()
                ));
            }
        }
    }
    problems
}

#[test]
fn the_introductions_figures_come_from_the_benchmarks_page() {
    let root = repo_root();
    let mut problems = Vec::new();
    let mut linked = 0;
    for file in ["docs/introduction.md", "README.md"] {
        problems.extend(figure_problems(&root, Path::new(file)));
        let text = std::fs::read_to_string(root.join(file)).expect("page");
        linked += link_targets(&text)
            .iter()
            .filter(|t| t.contains("operations/benchmarks.md"))
            .count();
    }
    assert!(
        problems.is_empty(),
        "{} figures do not come from {BENCHMARKS}:\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert!(
        linked >= 2,
        "the introduction and README link no figures to {BENCHMARKS}"
    );
}

/// The figures check catches a figure the linked section does not state, a link to a section
/// that does not exist and a measured figure with no link; it passes settings and bounds.
#[test]
fn figures_not_from_the_benchmarks_page_are_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    std::fs::create_dir_all(root.join("docs/operations")).expect("mkdir");
    std::fs::write(
        root.join(BENCHMARKS),
        "# Benchmarks\n\n## In short\n\n| a | b |\n| --- | --- |\n| drain | 966k jobs/s, 0.92× |\n\
         | lateness p99 | 2 ms |\n| confirmed msgs/s | Kafka 114–158k |\n| other | 77k |\n\n\
         ## Memory\n\n282 B per job.\n",
    )
    .expect("write");
    std::fs::write(
        root.join("docs/introduction.md"),
        "# Introduction\n\n\
         Good: [966k jobs/s and 0.92×](operations/benchmarks.md#in-short), \
         [282 B a job](operations/benchmarks.md#memory), [p99 2 ms](operations/benchmarks.md), \
         [Kafka 114–158k msgs/s](operations/benchmarks.md#in-short).\n\n\
         Settings and bounds: `poller.idle_poll` (100 ms), at most every 0.5 s, up to 4 MiB, \
         within 1 s, `--in 250ms`.\n\n\
         ```sh\nzdelay enqueue --in 5ms   # about 9 ms\n```\n\n\
         Bad: [p99 3 ms](operations/benchmarks.md#in-short), [282 B](operations/benchmarks.md#in-short), \
         [1 ms](operations/benchmarks.md#nowhere), 1.2M jobs/s unlinked, lateness p99 of 1 ms, \
         [77k msgs/s](operations/benchmarks.md#in-short).\n",
    )
    .expect("write");
    let problems = figure_problems(root, Path::new("docs/introduction.md"));
    let expect = [
        "`3 ms` (in \"p99 3 ms\") is not on the benchmarks page under #in-short",
        "`282 B` (in \"282 B\") is not on the benchmarks page under #in-short",
        "link to docs/operations/benchmarks.md#nowhere names no section",
        "measured figure `1.2M jobs/s` not linked",
        "measured figure `1 ms` not linked",
        "`77k msgs/s` (in \"77k msgs/s\") is not on the benchmarks page under #in-short",
    ];
    for what in expect {
        assert!(
            problems.iter().any(|p| p.contains(what)),
            "not reported: {what}; reported:\n{}",
            problems.join("\n")
        );
    }
    assert_eq!(problems.len(), expect.len(), "{problems:#?}");
}
