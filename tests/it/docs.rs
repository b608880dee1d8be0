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
    let mut stack = vec![root.join(dir)];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                found.push(path.strip_prefix(root).expect("under root").to_owned());
            }
        }
    }
    found.sort();
    found
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
        "README.md: 2026-12-01T09:00:00+01:00",
        "docs/getting-started.md: 2026-12-01T09:00:00+01:00",
    ] {
        assert!(
            seen.iter().any(|s| s == example),
            "{example} not found in {seen:?}"
        );
    }
}
