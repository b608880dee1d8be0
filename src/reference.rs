//! The reference pages made from the code, so they cannot drift from it: the configuration
//! (from the config types' JSON Schema, `config::json_schema`), the command line (from the
//! clap `Command` tree), the metrics (from `metrics::METRICS`), and the `config` part of the
//! Helm chart's `values.schema.json` (from the same schema). `zdelay gen-docs` writes them; a
//! test fails when a committed file differs from what [`files`] makes now.

use crate::metrics::{METRICS, Metric};
use serde_json::Value;
use std::fmt::Write;

/// The configuration reference page.
pub const CONFIG_PAGE: &str = "docs/reference/config.md";
/// The command-line reference page.
pub const CLI_PAGE: &str = "docs/reference/cli.md";
/// The metrics reference page (also read by `scripts/deploy/checks.py metrics-list`).
pub const METRICS_PAGE: &str = "docs/reference/metrics.md";
/// The chart's values schema; only its `properties.config` is generated.
pub const VALUES_SCHEMA: &str = "charts/zdelay/values.schema.json";

/// How to regenerate, for the pages' header and the freshness test's message.
pub const REGENERATE: &str = "cargo run -- gen-docs";

/// Every generated file as it should be: (path from the repository root, content).
/// `values_schema` is the chart's current `values.schema.json`, whose `config` part is
/// replaced (the rest of that file is written by hand).
pub fn files(
    cli: clap::Command,
    values_schema: &str,
) -> Result<Vec<(&'static str, String)>, String> {
    let schema = crate::config::json_schema();
    Ok(vec![
        (CONFIG_PAGE, config_page(&schema)),
        (CLI_PAGE, cli_page(cli)),
        (METRICS_PAGE, metrics_page(METRICS)),
        (
            VALUES_SCHEMA,
            splice_config(values_schema, &chart_config_schema(&schema))?,
        ),
    ])
}

/// Compares the generated files under `root` with what [`files`] makes now, and unless
/// `check_only` writes those that differ. Returns the ones that differed.
pub fn update(
    root: &std::path::Path,
    cli: clap::Command,
    check_only: bool,
) -> Result<Vec<&'static str>, String> {
    let read = |path: &str| std::fs::read_to_string(root.join(path));
    let values_schema =
        read(VALUES_SCHEMA).map_err(|e| format!("cannot read {VALUES_SCHEMA}: {e}"))?;
    let mut stale = Vec::new();
    for (path, content) in files(cli, &values_schema)? {
        if update_file(root, path, &content, check_only)? {
            stale.push(path);
        }
    }
    Ok(stale)
}

/// Whether the file at `path` under `root` differs from `content`; unless `check_only`, one
/// that differs is written.
pub fn update_file(
    root: &std::path::Path,
    path: &str,
    content: &str,
    check_only: bool,
) -> Result<bool, String> {
    let full = root.join(path);
    if std::fs::read_to_string(&full).ok().as_deref() == Some(content) {
        return Ok(false);
    }
    if !check_only {
        if let Some(dir) = full.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        std::fs::write(&full, content).map_err(|e| format!("cannot write {path}: {e}"))?;
    }
    Ok(true)
}

fn header(source: &str) -> String {
    header_by(source, REGENERATE)
}

/// The generated pages' first line: made from `source` by `regenerate`.
fn header_by(source: &str, regenerate: &str) -> String {
    format!(
        "<!-- Generated from {source} in the code by `{regenerate}` (CONTRIBUTING.md): edit the \
         code, not this page. -->\n\n"
    )
}

// ---------------------------------------------------------------- configuration

/// The environment variable that sets a config field: `ZDELAY_` and the TOML path's
/// segments upper-cased, joined by `__` (`poller.batch` → `ZDELAY_POLLER__BATCH`,
/// `sinks.<name>.url` → `ZDELAY_SINKS__<NAME>__URL`).
pub fn env_name(path: &[&str]) -> String {
    let segments: Vec<String> = path.iter().map(|s| s.to_ascii_uppercase()).collect();
    format!("ZDELAY_{}", segments.join("__"))
}

/// One row of a section's table.
struct Row {
    path: String,
    ty: String,
    default: String,
    env: String,
    description: String,
}

/// A TOML table of the file: `[redis]`, `[sinks.<name>]` of one kind, `[[routes]]`, …
struct Section {
    title: String,
    intro: String,
    rows: Vec<Row>,
}

/// Where a section's fields live: their TOML path and, unless they are in a list, the
/// environment variable path.
struct At<'a> {
    toml: Vec<&'a str>,
    env: Option<Vec<&'a str>>,
}

impl<'a> At<'a> {
    fn child(&self, name: &'a str) -> At<'a> {
        let mut toml = self.toml.clone();
        toml.push(name);
        At {
            toml,
            env: self.env.as_ref().map(|e| {
                let mut e = e.clone();
                e.push(name);
                e
            }),
        }
    }
}

fn str_of<'a>(schema: &'a Value, key: &str) -> Option<&'a str> {
    schema.get(key).and_then(Value::as_str)
}

fn properties(schema: &Value) -> impl Iterator<Item = (&String, &Value)> {
    schema
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
}

fn is_table(schema: &Value) -> bool {
    schema.get("properties").is_some()
}

/// The configuration reference page.
pub fn config_page(schema: &Value) -> String {
    let mut sections = Vec::new();
    let mut top: Vec<(&String, &Value)> = properties(schema).collect();
    // The order of the file's usual layout; anything new goes last.
    let order = |name: &str| {
        SECTION_ORDER
            .iter()
            .position(|s| *s == name)
            .unwrap_or(SECTION_ORDER.len())
    };
    top.sort_by_key(|(name, _)| order(name));
    for (name, sub) in top {
        match name.as_str() {
            "sinks" => sink_sections(sub, &mut sections),
            "routes" | "sources" => {
                let items = &sub["items"];
                table_sections(
                    &format!("[[{name}]]"),
                    str_of(sub, "description").unwrap_or(""),
                    items,
                    At {
                        toml: vec![if name == "routes" {
                            "routes[]"
                        } else {
                            "sources[]"
                        }],
                        env: None,
                    },
                    &mut sections,
                );
            }
            _ => table_sections(
                &format!("[{name}]"),
                str_of(sub, "description").unwrap_or(""),
                sub,
                At {
                    toml: vec![name],
                    env: Some(vec![name]),
                },
                &mut sections,
            ),
        }
    }
    let mut out = header("the config types");
    out.push_str(CONFIG_INTRO);
    for section in sections {
        let _ = write!(out, "\n## `{}`\n\n", section.title);
        // A type's doc comment may open with its own title: `[redis]`: where …
        let intro = match section.intro.split_once("`: ") {
            Some((head, rest)) if head.starts_with("`[") => rest,
            _ => section.intro.as_str(),
        };
        if !intro.is_empty() {
            let _ = writeln!(out, "{}\n", no_html(&capitalized(&paragraphs(intro))));
        }
        if section.rows.is_empty() {
            continue;
        }
        out.push_str("| field | type | default | environment variable | description |\n");
        out.push_str("| --- | --- | --- | --- | --- |\n");
        for row in section.rows {
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} | {} |",
                row.path,
                row.ty,
                row.default,
                row.env,
                cell(&row.description)
            );
        }
    }
    out
}

const SECTION_ORDER: &[&str] = &[
    "redis", "poller", "admin", "tracing", "sinks", "routes", "sources", "testing",
];

const CONFIG_INTRO: &str = "\
# Configuration reference

zdelay reads `zdelay.toml` (the file `--config` or `ZDELAY_CONFIG` names; without one, the
defaults below), then the environment: a variable `ZDELAY_<SECTION>__<FIELD>` (sections and
fields joined by two underscores, upper case) sets that field over the file, e.g.
`ZDELAY_POLLER__BATCH=500` or `ZDELAY_SINKS__ORDERS__URL=amqp://…` for the sink named
`orders`. The lists `routes` and `sources` have no variable per field: `ZDELAY_ROUTES` or
`ZDELAY_SOURCES` replaces the whole list, written as an inline TOML array, e.g.
`ZDELAY_ROUTES='[{name = \"emails\", sink = \"local\", target = \"queue:emails\"}]'`.
`zdelay check-config` prints the effective configuration, secrets hidden (as TOML; with
`-o json` as JSON). A mistake is named with the field, where it was written (the file and
line, or the variable) and what is allowed, e.g. `invalid config: poller.batchh: unknown
field: [poller] takes batch, … (/etc/zdelay/zdelay.toml line 7)`; every command then exits 2
without doing anything.

- **Durations** are strings of `<number><unit>` parts: `250ms`, `30s`, `1min`, `1m30s`,
  `2h` (units `ns`, `us`, `ms`, `s`, `m`/`min`, `h`, `d`, `w`, and their long forms such as
  `seconds`).
- **Secrets** (type *secret*) are never shown: `check-config`, logs and errors print `***`
  (a URL keeps all but its password). A secret written as a number is read as its text.
- **Any field can come from a file**: `<field>_file = \"/path\"` sets `<field>` to the file's
  content without its trailing newline (the way Kubernetes mounts Secrets), e.g.
  `password_file` for `password`, `url_file` for a sink's `url`, or the environment
  variable `ZDELAY_REDIS__PASSWORD_FILE`. Setting both is an error.
";

/// `[name]` (or `[[name]]`) and, after it, a section per nested table.
fn table_sections(
    title: &str,
    intro: &str,
    schema: &Value,
    at: At<'_>,
    sections: &mut Vec<Section>,
) {
    table_sections_of(title, "", intro, schema, at, sections)
}

/// `suffix` follows the titles of nested tables: which kind of sink they belong to.
fn table_sections_of(
    title: &str,
    suffix: &str,
    intro: &str,
    schema: &Value,
    at: At<'_>,
    sections: &mut Vec<Section>,
) {
    let mut rows = Vec::new();
    let mut nested = Vec::new();
    let required = required_fields(schema);
    for (name, sub) in properties(schema) {
        if is_table(sub) {
            nested.push((name, sub));
            continue;
        }
        rows.push(row(name, sub, &at, required.contains(&name.as_str())));
    }
    sections.push(Section {
        title: title.to_owned(),
        intro: intro.to_owned(),
        rows,
    });
    for (name, sub) in nested {
        let child = at.child(name);
        let title = format!("[{}]{suffix}", child.toml.join("."));
        table_sections_of(
            &title,
            suffix,
            str_of(sub, "description").unwrap_or(""),
            sub,
            child,
            sections,
        );
    }
}

/// One section per sink kind: `[sinks.<name>]` with `kind = "…"`.
fn sink_sections(sinks: &Value, sections: &mut Vec<Section>) {
    sections.push(Section {
        title: "[sinks.<name>]".to_owned(),
        intro: str_of(sinks, "description").unwrap_or("").to_owned(),
        rows: Vec::new(),
    });
    let kinds = sinks["additionalProperties"]["oneOf"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for variant in &kinds {
        let kind = variant["properties"]["kind"]["const"]
            .as_str()
            .unwrap_or("?");
        let intro = str_of(variant, "description").unwrap_or("");
        table_sections_of(
            &format!("[sinks.<name>] kind = \"{kind}\""),
            &format!(" (kind = \"{kind}\")"),
            intro,
            variant,
            At {
                toml: vec!["sinks", "<name>"],
                env: Some(vec!["sinks", "<name>"]),
            },
            sections,
        );
    }
}

fn required_fields(schema: &Value) -> Vec<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn row(name: &str, schema: &Value, at: &At<'_>, required: bool) -> Row {
    let here = at.child(name);
    let default = match schema.get("default") {
        Some(v) => format!("`{}`", toml_value(v)),
        None if required => "required".to_owned(),
        None => "—".to_owned(),
    };
    let mut description = str_of(schema, "description").unwrap_or("").to_owned();
    if description.is_empty() && schema.get("const").is_some() {
        description = "Which kind of sink this is; the fields below depend on it.".to_owned();
    }
    if is_secret(schema) {
        let _ = write!(
            description,
            "\n\nOr `{name}_file`: a file holding it (see above)."
        );
    }
    Row {
        path: here.toml.join("."),
        ty: type_name(schema),
        default,
        env: match &here.env {
            Some(path) => format!("`{}`", env_name(path)),
            None => "—".to_owned(),
        },
        description,
    }
}

fn is_secret(schema: &Value) -> bool {
    schema.get("writeOnly") == Some(&Value::Bool(true))
}

/// What a value of this schema is, in words.
fn type_name(schema: &Value) -> String {
    if str_of(schema, "x-zdelay-type") == Some("duration") {
        return "duration".to_owned();
    }
    if let Some(value) = schema.get("const") {
        return format!("`{}`", toml_value(value));
    }
    let choices: Vec<String> = match (schema.get("enum"), schema.get("oneOf")) {
        (Some(Value::Array(values)), _) => values.iter().map(toml_value).collect(),
        (_, Some(Value::Array(variants))) => variants
            .iter()
            .filter_map(|v| v.get("const"))
            .map(toml_value)
            .collect(),
        _ => Vec::new(),
    };
    if !choices.is_empty() {
        let quoted: Vec<String> = choices.iter().map(|c| format!("`{c}`")).collect();
        return quoted.join(", ");
    }
    let base = match str_of(schema, "type") {
        Some("string") if is_secret(schema) => "secret".to_owned(),
        Some("array") => match str_of(&schema["items"], "type") {
            Some(item) => format!("list of {item}s"),
            None => "list".to_owned(),
        },
        Some("object") => match schema.get("additionalProperties") {
            Some(values @ Value::Object(_)) => format!("table of {}s", type_name(values)),
            _ => "table".to_owned(),
        },
        Some(other) => other.to_owned(),
        None => "any".to_owned(),
    };
    let range = match (schema.get("minimum"), schema.get("maximum")) {
        (Some(min), Some(max)) => format!(", {min} to {max}"),
        (Some(min), None) => format!(", at least {min}"),
        (None, Some(max)) => format!(", at most {max}"),
        (None, None) => String::new(),
    };
    let length = match schema.get("minLength").and_then(Value::as_u64) {
        Some(1) => ", non-empty".to_owned(),
        Some(n) => format!(", at least {n} characters"),
        None => String::new(),
    };
    format!("{base}{range}{length}")
}

/// A JSON value as it is written in TOML.
fn toml_value(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(toml_value).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(map) => {
            let pairs: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("{k} = {}", toml_value(v)))
                .collect();
            if pairs.is_empty() {
                "{}".to_owned()
            } else {
                format!("{{ {} }}", pairs.join(", "))
            }
        }
        other => other.to_string(),
    }
}

/// Doc-comment text as it reads in Markdown: paragraphs kept, lines joined.
fn paragraphs(text: &str) -> String {
    text.split("\n\n")
        .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// Text for a Markdown table cell: one line, `|` escaped, paragraphs as line breaks.
fn cell(text: &str) -> String {
    no_html(&paragraphs(text))
        .replace('|', "\\|")
        .replace("\n\n", "<br><br>")
}

/// `<` outside code spans written as `&lt;`, so `<sink>/<target>` is not read as HTML.
fn no_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_code = false;
    for c in text.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                out.push(c);
            }
            '<' if !in_code => out.push_str("&lt;"),
            _ => out.push(c),
        }
    }
    out
}

/// A sentence ends with punctuation (clap drops a doc comment's final period).
fn sentence(text: &str) -> String {
    let text = text.trim();
    if text.is_empty() || text.ends_with(['.', '!', '?', ':']) {
        text.to_owned()
    } else {
        format!("{text}.")
    }
}

// ---------------------------------------------------------------- the chart's config schema

/// Fields that hold nothing but a credential: the chart takes them from Secrets (the
/// rendered TOML is a ConfigMap), so its schema offers only `<field>_file`.
pub const CREDENTIAL_FIELDS: &[&str] = &["password", "token", "producer_token"];

/// Sections the chart writes itself: `[admin]` from `admin.*`, `redis.tls` from
/// `tls.redis`.
const CHART_OWNED: &[&[&str]] = &[&["admin"], &["redis", "tls"]];

/// The `config` part of the chart's values schema: the daemon's schema less what the chart
/// sets itself, with credentials only as `<field>_file` and a sink's `url` optional (it may
/// come from `secrets.sinks`).
pub fn chart_config_schema(schema: &Value) -> Value {
    let mut config = schema.clone();
    let root = config.as_object_mut().expect("the schema is an object");
    root.remove("$schema");
    root.remove("title");
    root.insert(
        "description".to_owned(),
        Value::from(
            "zdelay.toml (docs/reference/config.md), less what the chart sets: [admin] from \
             admin.*, redis.tls from tls.redis, credentials from secrets.* (or <field>_file \
             with secrets.files)",
        ),
    );
    for path in CHART_OWNED {
        let (last, parents) = path.split_last().expect("non-empty path");
        let mut at = &mut config;
        for p in parents {
            at = &mut at["properties"][*p];
        }
        if let Some(props) = at.get_mut("properties").and_then(Value::as_object_mut) {
            props.remove(*last);
        }
        if let Some(default) = at.get_mut("default").and_then(Value::as_object_mut) {
            default.remove(*last);
        }
    }
    if let Some(kinds) =
        config["properties"]["sinks"]["additionalProperties"]["oneOf"].as_array_mut()
    {
        for kind in kinds {
            if let Some(required) = kind.get_mut("required").and_then(Value::as_array_mut) {
                required.retain(|r| r != "url");
            }
        }
    }
    chart_tidy(&mut config);
    config
}

/// Credentials → `<field>_file`; keys only the reference page reads dropped.
fn chart_tidy(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(text)) = map.get_mut("description") {
                *text = paragraphs(text);
            }
            for key in ["writeOnly", "x-zdelay-type", "format"] {
                if map.get(key).is_some_and(|v| !v.is_object()) {
                    map.remove(key);
                }
            }
            if let Some(Value::Object(props)) = map.get_mut("properties") {
                for field in CREDENTIAL_FIELDS {
                    if props.remove(*field).is_some() {
                        props.insert(
                            format!("{field}_file"),
                            serde_json::json!({
                                "type": "string",
                                "minLength": 1,
                                "description": format!(
                                    "A file holding the {field}, e.g. mounted through \
                                     secrets.files (the value itself would land in a \
                                     ConfigMap); or set it from a Secret through secrets.env"
                                ),
                            }),
                        );
                    }
                }
                let props: Vec<String> = props.keys().cloned().collect();
                if let Some(Value::Array(required)) = map.get_mut("required") {
                    required.retain(|r| r.as_str().is_some_and(|r| props.iter().any(|p| p == r)));
                    if required.is_empty() {
                        map.remove("required");
                    }
                }
            }
            map.values_mut().for_each(chart_tidy);
        }
        Value::Array(items) => items.iter_mut().for_each(chart_tidy),
        _ => {}
    }
}

/// `values_schema` with the value of its top-level `properties.config` replaced by
/// `config`, everything else byte for byte as it was.
pub fn splice_config(values_schema: &str, config: &Value) -> Result<String, String> {
    let (start, end, indent) =
        config_span(values_schema).ok_or("values.schema.json has no properties.config object")?;
    let pretty = serde_json::to_string_pretty(config).map_err(|e| e.to_string())?;
    let indented = pretty.replace('\n', &format!("\n{}", " ".repeat(indent)));
    Ok(format!(
        "{}{}{}",
        &values_schema[..start],
        indented,
        &values_schema[end..]
    ))
}

/// The byte span of the value of `properties.config` at the top of a JSON document, and the
/// indentation of its key's line.
fn config_span(text: &str) -> Option<(usize, usize, usize)> {
    let bytes = text.as_bytes();
    // The key of each object or array entered ("" for the document and list items).
    let mut open: Vec<String> = Vec::new();
    let mut key: Option<String> = None;
    let mut last_string = String::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let start = i + 1;
                i = start + string_len(&text[start..])?;
                last_string = text[start..i].to_owned();
            }
            b':' => {
                let name = std::mem::take(&mut last_string);
                if name == "config" && open.len() == 2 && open[1] == "properties" {
                    let start = i + 1 + text[i + 1..].find('{')?;
                    let end = start + value_len(&text[start..])?;
                    let line_start = text[..i].rfind('\n').map_or(0, |n| n + 1);
                    let line = &text[line_start..];
                    return Some((start, end, line.len() - line.trim_start().len()));
                }
                key = Some(name);
            }
            b'{' | b'[' => open.push(key.take().unwrap_or_default()),
            b'}' | b']' => {
                open.pop()?;
            }
            b',' => key = None,
            _ => {}
        }
        i += 1;
    }
    None
}

/// Where the JSON string starting at `text` (after its opening quote) ends.
fn string_len(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The length of the JSON object or array at the start of `text`.
fn value_len(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i += 1 + string_len(&text[i + 1..])?,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

// ---------------------------------------------------------------- metrics

/// The metrics reference page: one table row per metric.
pub fn metrics_page(metrics: &[Metric]) -> String {
    let mut out = header("the metrics table");
    out.push_str(
        "# Metrics reference\n\n\
         Every metric `GET /metrics` exports (Prometheus text format), on `admin.listen` and on \
         `admin.metrics_listen` when set. Labels are bounded: route, source and sink names come \
         from the config, the other values from the fixed lists below; never a job id or a \
         payload. Histograms also export `_bucket`, `_sum` and `_count` series.\n\n\
         | metric | type | labels | meaning |\n\
         | --- | --- | --- | --- |\n",
    );
    for m in metrics {
        let labels: Vec<String> = m
            .labels
            .iter()
            .map(|l| {
                if l.values.is_empty() {
                    format!("`{}`", l.name)
                } else {
                    let values: Vec<String> = l.values.iter().map(|v| format!("`{v}`")).collect();
                    format!("`{}` ({})", l.name, values.join(", "))
                }
            })
            .collect();
        let meaning = if m.details.is_empty() {
            m.help.to_owned()
        } else {
            format!("{} {}", m.help, m.details)
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            m.name,
            m.kind.as_str(),
            labels.join(", "),
            cell(&meaning)
        );
    }
    out
}

// ---------------------------------------------------------------- command line

/// The command-line reference page: every command that is not hidden, its usage and its
/// arguments.
pub fn cli_page(cli: clap::Command) -> String {
    command_page(
        cli,
        "# Command-line reference\n\n\
         `zdelay <command> --help` prints the same; `zdelay man` prints a manual page. The \
         global options work with every command.\n",
        REGENERATE,
    )
}

/// A command-line page of another binary (the benchmark's): its title and introduction
/// (`intro`, Markdown), then every command as in [`cli_page`]; the header names
/// `regenerate`.
pub fn command_page(mut cli: clap::Command, intro: &str, regenerate: &str) -> String {
    cli.build();
    let mut out = header_by("the command-line definitions", regenerate);
    out.push_str(intro);
    command_section(&cli, &[], &mut out);
    out
}

fn command_section(cmd: &clap::Command, parents: &[&str], out: &mut String) {
    if cmd.is_hide_set() {
        return;
    }
    let mut names = parents.to_vec();
    names.push(cmd.get_name());
    let full = names.join(" ");
    let _ = write!(out, "\n## `{full}`\n\n");
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(out, "{}\n", no_html(&sentence(&about.to_string())));
    }
    let usage = cmd.clone().render_usage().to_string();
    let usage = usage.trim().trim_start_matches("Usage:").trim();
    let _ = writeln!(out, "```text\n{usage}\n```");
    let top = parents.is_empty();
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter(|a| top || !a.is_global_set())
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        out.push_str("\n| argument | description |\n| --- | --- |\n");
        for arg in args {
            let _ = writeln!(out, "| {} | {} |", arg_name(arg), cell(&arg_help(arg)));
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            command_section(sub, &names, out);
        }
    }
}

fn arg_name(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| {
            names
                .iter()
                .map(|n| format!("<{n}>"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| format!("<{}>", arg.get_id().as_str().to_ascii_uppercase()));
    if arg.is_positional() {
        return format!("`{value}`");
    }
    let takes_value = arg.get_action().takes_values();
    let mut forms = Vec::new();
    if let Some(short) = arg.get_short() {
        forms.push(format!("`-{short}`"));
    }
    if let Some(long) = arg.get_long() {
        if takes_value {
            forms.push(format!("`--{long} {value}`"));
        } else {
            forms.push(format!("`--{long}`"));
        }
    }
    forms.join(", ")
}

fn arg_help(arg: &clap::Arg) -> String {
    let mut help = sentence(
        &arg.get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default(),
    );
    let mut facts = Vec::new();
    if arg.is_required_set() {
        facts.push("required".to_owned());
    }
    let takes_value = arg.get_action().takes_values();
    let possible: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    if takes_value && !possible.is_empty() {
        facts.push(format!("one of {}", possible.join(", ")));
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if takes_value && !defaults.is_empty() {
        facts.push(format!("default `{}`", defaults.join(",")));
    }
    if let Some(env) = arg.get_env() {
        facts.push(format!("environment `{}`", env.to_string_lossy()));
    }
    if !facts.is_empty() {
        if !help.is_empty() {
            help.push_str("\n\n");
        }
        let _ = write!(help, "{}.", capitalized(&facts.join("; ")));
    }
    help
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_join_the_path_in_upper_case() {
        assert_eq!(env_name(&["poller", "batch"]), "ZDELAY_POLLER__BATCH");
        assert_eq!(
            env_name(&["poller", "idle_poll"]),
            "ZDELAY_POLLER__IDLE_POLL"
        );
        assert_eq!(
            env_name(&["sinks", "<name>", "sasl", "password"]),
            "ZDELAY_SINKS__<NAME>__SASL__PASSWORD"
        );
    }

    /// Every field and section a user can set carries a description: a field added without
    /// a doc comment fails here.
    /// The environment variable the page names sets its field: every integer, number,
    /// boolean and duration field of the `[section]` tables, set through its variable to a
    /// value other than its default, reads back as set.
    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
    fn the_environment_variables_shown_set_their_fields() {
        fn walk(path: Vec<String>, schema: &Value, out: &mut Vec<(Vec<String>, Value)>) {
            for (name, sub) in properties(schema) {
                let mut here = path.clone();
                here.push(name.clone());
                if is_table(sub) {
                    walk(here, sub, out);
                    continue;
                }
                let value = if str_of(sub, "x-zdelay-type") == Some("duration") {
                    Value::from("7s")
                } else {
                    match (str_of(sub, "type"), sub.get("default")) {
                        (Some("boolean"), Some(Value::Bool(b))) => Value::Bool(!b),
                        (Some("integer"), Some(default)) => {
                            let min = sub.get("minimum").cloned().unwrap_or(Value::from(1));
                            if &min == default {
                                sub.get("maximum").cloned().unwrap_or(Value::from(2))
                            } else {
                                min
                            }
                        }
                        (Some("number"), Some(_)) => Value::from(0.5),
                        _ => continue,
                    }
                };
                out.push((here, value));
            }
        }
        let schema = crate::config::json_schema();
        let mut fields = Vec::new();
        for (section, sub) in properties(&schema) {
            if is_table(sub) {
                walk(vec![section.clone()], sub, &mut fields);
            }
        }
        assert!(fields.len() >= 20, "{fields:?}");
        figment::Jail::expect_with(|jail| {
            // `admin.public_reads = false` needs a token.
            jail.set_env("ZDELAY_ADMIN__TOKEN", "0123456789abcdef");
            for (path, value) in &fields {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                jail.set_env(env_name(&path), text);
            }
            let config = crate::config::load(None).map_err(|e| e.to_string())?;
            let shown = serde_json::to_value(&config).unwrap();
            for (path, value) in &fields {
                let pointer = format!("/{}", path.join("/"));
                assert_eq!(shown.pointer(&pointer), Some(value), "{pointer}");
            }
            Ok(())
        });
    }

    #[test]
    fn every_config_field_is_documented() {
        fn walk(path: &str, schema: &Value, missing: &mut Vec<String>) {
            for (name, sub) in properties(schema) {
                let here = format!("{path}.{name}");
                if str_of(sub, "description").is_none_or(|d| d.trim().is_empty()) {
                    missing.push(here.clone());
                }
                walk(&here, sub, missing);
                if let Some(items) = sub.get("items") {
                    walk(&here, items, missing);
                }
                if let Some(Value::Array(kinds)) =
                    sub.get("additionalProperties").and_then(|a| a.get("oneOf"))
                {
                    for kind in kinds {
                        if str_of(kind, "description").is_none() {
                            missing.push(format!("{here} (a kind)"));
                        }
                        walk(&format!("{here}.<name>"), kind, missing);
                    }
                }
            }
        }
        let mut missing = Vec::new();
        walk("config", &crate::config::json_schema(), &mut missing);
        // `kind` is the tag schemars adds; its values are the sections' titles.
        missing.retain(|m| !m.ends_with(".kind"));
        assert!(
            missing.is_empty(),
            "fields without a doc comment: {missing:?}"
        );
    }

    #[test]
    fn every_secret_is_a_credential_or_a_url() {
        fn walk(name: &str, schema: &Value, seen: &mut Vec<String>) {
            if is_secret(schema) {
                seen.push(name.to_owned());
            }
            if let Value::Object(map) = schema {
                for (key, sub) in map {
                    let child = if matches!(key.as_str(), "properties") {
                        None
                    } else {
                        Some(name)
                    };
                    match (child, sub) {
                        (None, Value::Object(props)) => {
                            for (field, s) in props {
                                walk(field, s, seen);
                            }
                        }
                        (_, v) => walk(name, v, seen),
                    }
                }
            } else if let Value::Array(items) = schema {
                items.iter().for_each(|i| walk(name, i, seen));
            }
        }
        let mut seen = Vec::new();
        walk("", &crate::config::json_schema(), &mut seen);
        seen.sort();
        seen.dedup();
        for field in &seen {
            assert!(
                CREDENTIAL_FIELDS.contains(&field.as_str())
                    || matches!(field.as_str(), "url" | "otlp_endpoint"),
                "secret field {field}: add it to CREDENTIAL_FIELDS if the chart must take it from a Secret"
            );
        }
        assert!(seen.len() >= 4, "{seen:?}");
    }

    #[test]
    fn the_duration_pattern_accepts_only_what_the_daemon_parses() {
        let pattern = regex::Regex::new(crate::config::DURATION_PATTERN).unwrap();
        for ok in [
            "1min",
            "1m30s",
            "250ms",
            "2h",
            "10s",
            "1h 30m",
            "10 seconds",
            "3days",
            "1w",
            "1M",
            "2y",
            "500us",
            "7ns",
        ] {
            assert!(pattern.is_match(ok), "{ok} must match");
            assert!(humantime::parse_duration(ok).is_ok(), "{ok} parses");
        }
        for refused in [
            "", "soon", "10", "s", "1.5s", "-1s", "1 parsec", "1h-30m", "1mn",
        ] {
            assert!(!pattern.is_match(refused), "{refused:?} must not match");
        }
        // Not matched although humantime reads it: fractions (kept out of the chart's parser).
        assert!(humantime::parse_duration("1.5s").is_ok());
    }

    #[test]
    fn the_chart_schema_takes_credentials_from_files_and_leaves_out_what_the_chart_sets() {
        let chart = chart_config_schema(&crate::config::json_schema());
        let props = &chart["properties"];
        assert!(props.get("admin").is_none());
        assert!(props["redis"]["properties"].get("tls").is_none());
        assert!(props["redis"]["properties"].get("password").is_none());
        assert_eq!(
            props["redis"]["properties"]["password_file"]["type"],
            "string"
        );
        assert_eq!(props["poller"]["properties"]["per_shard"]["maximum"], 2);
        let kinds = props["sinks"]["additionalProperties"]["oneOf"]
            .as_array()
            .unwrap();
        let kafka = kinds
            .iter()
            .find(|k| k["properties"]["kind"]["const"] == "kafka")
            .unwrap();
        let sasl = &kafka["properties"]["sasl"];
        assert!(sasl["properties"].get("password").is_none());
        assert!(sasl["properties"].get("password_file").is_some());
        assert_eq!(
            sasl["required"],
            serde_json::json!(["mechanism", "username"]),
            "the password may come from the environment"
        );
        let text = chart.to_string();
        assert!(
            !text.contains("writeOnly") && !text.contains("x-zdelay"),
            "{text}"
        );
    }

    #[test]
    fn splicing_replaces_only_the_config_value() {
        let values = "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"a\": { \"config\": 1 },\n    \"config\": {\n      \"old\": \"}\"\n    },\n    \"z\": [1, {\"config\": {}}]\n  }\n}\n";
        let spliced = splice_config(values, &serde_json::json!({"new": [1]})).unwrap();
        assert_eq!(
            spliced,
            "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"a\": { \"config\": 1 },\n    \"config\": {\n      \"new\": [\n        1\n      ]\n    },\n    \"z\": [1, {\"config\": {}}]\n  }\n}\n"
        );
        assert!(splice_config("{\"properties\": {}}", &Value::Null).is_err());
    }

    #[test]
    fn the_sink_name_pattern_is_the_daemons_rule() {
        let pattern = regex::Regex::new(crate::config::SINK_NAME_PATTERN).unwrap();
        let long = "x".repeat(64);
        let too_long = "x".repeat(65);
        for name in [
            "a",
            "orders_eu2",
            "orders",
            &long,
            &too_long,
            "orders-eu",
            "Orders",
            "2nd",
            "_a",
            "a.b",
        ] {
            let daemon = crate::config::from_toml(&format!(
                "[sinks.{name:?}]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\""
            ))
            .is_ok();
            assert_eq!(pattern.is_match(name), daemon, "{name}");
        }
    }

    /// The chart parses `poller.shutdown_grace` itself: its parser knows the same units.
    #[test]
    fn the_charts_duration_parser_knows_the_schemas_units() {
        let helpers = include_str!("../charts/zdelay/templates/_helpers.tpl");
        let units = crate::config::DURATION_PATTERN
            .split_once(" *(")
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(units, _)| format!("({units})"))
            .unwrap();
        assert!(helpers.contains(&units), "_helpers.tpl lacks {units}");
    }

    #[test]
    fn metric_rows_show_labels_with_their_values() {
        let page = metrics_page(METRICS);
        assert!(page.contains(
            "| `zdelay_script_duration_seconds` | histogram | `script` (`move_due`, `move_raw`) |"
        ));
        assert_eq!(
            page.lines().filter(|l| l.starts_with("| `zdelay_")).count(),
            METRICS.len()
        );
    }

    #[test]
    fn toml_values_read_as_written() {
        assert_eq!(toml_value(&serde_json::json!("100ms")), "\"100ms\"");
        assert_eq!(toml_value(&serde_json::json!([])), "[]");
        assert_eq!(
            toml_value(&serde_json::json!({"local": {"kind": "redis"}, "x": null})),
            "{ local = { kind = \"redis\" } }"
        );
    }
}
