//! Configuration: `config/zdelay.toml` (or `--config PATH`) overridden by `ZDELAY_…`
//! environment variables (`ZDELAY_REDIS__URL`, `ZDELAY_POLLER__BATCH`, …: sections split on
//! `__`). Every field has a default, so no file at all runs on local defaults. `load`
//! validates cross-references (route → sink, source → route) and names the field at fault.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// A configuration that cannot be used, with the field at fault named.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    Missing(String),
    #[error("{0}")]
    Parse(String),
    #[error("invalid config: {field}: {why}")]
    Invalid { field: String, why: String },
}

fn invalid(field: impl Into<String>, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        why: why.into(),
    }
}

/// A secret: accepts any scalar (env values parse as TOML, so `123456` is an integer) and
/// never prints its value: `Debug` and `Serialize` (hence `check-config`) give `***`, or for
/// a URL the URL with its password hidden. Every secret read is also registered with
/// [`redact_known`], which scrubs it from logs, error output and panic messages.
#[derive(Clone, Default, PartialEq)]
pub struct Secret(String);

/// In a schema: a string, marked `writeOnly` (a value zdelay reads and never shows).
impl schemars::JsonSchema for Secret {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Secret".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "writeOnly": true })
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if EXPOSED.get() {
            return s.serialize_str(&self.0);
        }
        s.serialize_str(&redacted(&self.0))
    }
}

thread_local! {
    /// Set on this thread while [`with_secrets_exposed`] runs.
    static EXPOSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every [`Secret`] serializing its value instead of its redaction, on this
/// thread: for a tool that hands settings to a process it starts, through that process's
/// environment (never a file, a log or an output).
pub fn with_secrets_exposed<T>(f: impl FnOnce() -> T) -> T {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            EXPOSED.set(false);
        }
    }
    EXPOSED.set(true);
    let _reset = Reset;
    f()
}

/// How a secret value shows: a URL keeps its scheme, user, host and port.
fn redacted(value: &str) -> String {
    if value.contains("://") {
        redact_url(value)
    } else {
        "***".to_owned()
    }
}

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn new(value: String) -> Self {
        register_secret(&value);
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret::new(s.to_owned())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret::new(s)
    }
}

/// A URL (or comma-separated URLs) fit for logs and error messages: a `user:pass@` part
/// becomes `user:***@`, a lone `token@` becomes `***@`, and so do the values of query
/// parameters and path segments named like credentials (`?password=***`, `&access_key=***`,
/// `/token/***`, `;api_key=***`).
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|url| {
            let mut shown = String::with_capacity(url.len());
            let mut from = 0;
            for span in secret_spans(url) {
                shown.push_str(&url[from..span.start]);
                shown.push_str("***");
                from = span.end;
            }
            shown.push_str(&url[from..]);
            shown
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The secrets of each URL in `urls` (see [`redact_url`]), as written and percent-decoded.
fn url_secrets(urls: &str) -> Vec<String> {
    let mut found = Vec::new();
    for url in urls.split(',') {
        for span in secret_spans(url) {
            let secret = &url[span];
            found.push(secret.to_owned());
            found.push(percent_decode(secret));
        }
    }
    found
}

/// Where the secrets of one URL are, in order: the password (or lone token) of its user
/// info, then the values of path segments and query parameters named like credentials.
/// Deliberately eager: the user info runs to the URL's last `@` (a password may hold an
/// unescaped `/` or `?`), and a value that only looks secret is hidden too.
fn secret_spans(url: &str) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let Some(scheme) = url.find("://") else {
        return spans;
    };
    let mut host = scheme + 3;
    if let Some(at) = url.rfind('@')
        && at >= host
    {
        let password = url[host..at]
            .find(':')
            .map_or(host, |colon| host + colon + 1);
        spans.push(password..at);
        host = at + 1;
    }
    let Some(path) = url[host..].find(['/', '?', '#']).map(|i| host + i) else {
        return spans;
    };
    let end = url[path..].find('#').map_or(url.len(), |i| path + i);
    let query = url[path..end].find('?').map_or(end, |i| path + i);
    // Path segments: `name=value` (also after `;`), or a segment after one that names a
    // credential (`/token/<value>`).
    let mut start = path;
    let mut after_name = false;
    for segment in url[path..query].split('/') {
        let segment_start = start;
        start += segment.len() + 1;
        if after_name && !segment.is_empty() {
            spans.push(segment_start..segment_start + segment.len());
            after_name = false;
            continue;
        }
        after_name = !segment.contains(['=', ';']) && is_credential_name(segment);
        secret_values(url, segment_start, segment, ';', &mut spans);
    }
    if query < end {
        secret_values(url, query + 1, &url[query + 1..end], '&', &mut spans);
    }
    spans
}

/// The spans of the values of `name=value` pairs in `part` (at `offset` in `url`, pairs split
/// on `separator` and `;`) whose name is a credential's.
fn secret_values(
    url: &str,
    offset: usize,
    part: &str,
    separator: char,
    spans: &mut Vec<std::ops::Range<usize>>,
) {
    let mut start = offset;
    for pair in part.split([separator, ';']) {
        let pair_start = start;
        start += pair.len() + 1;
        if let Some((name, value)) = pair.split_once('=')
            && !value.is_empty()
            && is_credential_name(name)
        {
            let value_start = pair_start + name.len() + 1;
            debug_assert_eq!(&url[value_start..value_start + value.len()], value);
            spans.push(value_start..value_start + value.len());
        }
    }
}

/// Whether a URL parameter or path segment named `name` carries a credential.
fn is_credential_name(name: &str) -> bool {
    const WORDS: &[&str] = &[
        "password",
        "passwd",
        "pwd",
        "secret",
        "token",
        "apikey",
        "api_key",
        "access_key",
        "accesskey",
        "private_key",
        "credential",
        "signature",
        "authorization",
        "jwt",
    ];
    let name = percent_decode(name).to_ascii_lowercase().replace('-', "_");
    matches!(name.as_str(), "key" | "pass" | "sig" | "auth")
        || name.ends_with("_key")
        || WORDS.iter().any(|word| name.contains(word))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Secrets shorter than this are not scrubbed from free text (a 2-character password would
/// turn every log line into asterisks); structured output still hides them.
const MIN_SCRUBBED_LEN: usize = 4;

/// Every form a secret may take in printed text, with what replaces it there.
static KNOWN_SECRETS: std::sync::Mutex<BTreeMap<String, String>> =
    std::sync::Mutex::new(BTreeMap::new());

/// Remembers a secret value (and the secrets of any URL in it) for [`redact_known`].
pub fn register_secret(value: &str) {
    let mut known = KNOWN_SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    for secret in std::iter::once(value.to_owned()).chain(url_secrets(value)) {
        if secret.len() < MIN_SCRUBBED_LEN {
            continue;
        }
        let shown = redacted(&secret);
        for escape in ESCAPES {
            known.insert(escape(&secret), escape(&shown));
        }
    }
}

/// The ways a printed value gets escaped: none (text), inside a JSON string (JSON log lines,
/// JSON output), Rust's `{:?}` (debug-printed errors), and `{:?}` inside JSON. A secret holding
/// `"` or `\` only appears in those forms.
const ESCAPES: [fn(&str) -> String; 4] = [
    |s| s.to_owned(),
    json_escaped,
    debug_escaped,
    |s| json_escaped(&debug_escaped(s)),
];

fn json_escaped(s: &str) -> String {
    let quoted = serde_json::Value::from(s).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

fn debug_escaped(s: &str) -> String {
    let quoted = format!("{s:?}");
    quoted[1..quoted.len() - 1].to_owned()
}

/// `text` with every secret this process has read replaced by `***` (a URL keeps what
/// [`redact_url`] shows), also where it appears escaped: for anything printed that may quote
/// a third party (library errors and logs, panics).
pub fn redact_known(text: &str) -> std::borrow::Cow<'_, str> {
    let known = KNOWN_SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    let mut text = std::borrow::Cow::Borrowed(text);
    // Longest first: a URL holding a password goes before the password alone.
    let mut forms: Vec<(&String, &String)> = known.iter().collect();
    forms.sort_by_key(|(form, _)| std::cmp::Reverse(form.len()));
    for (form, shown) in forms {
        if text.contains(form.as_str()) {
            text = std::borrow::Cow::Owned(text.replace(form.as_str(), shown));
        }
    }
    text
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redacted(&self.0))
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Scalar {
            S(String),
            I(i64),
            F(f64),
            B(bool),
        }
        Ok(Secret::new(match Scalar::deserialize(d)? {
            Scalar::S(s) => s,
            Scalar::I(i) => i.to_string(),
            Scalar::F(f) => f.to_string(),
            Scalar::B(b) => b.to_string(),
        }))
    }
}

/// For URL fields kept as `String` (`redis.url`, `redis.cluster_nodes`): serialized with the
/// password hidden, their passwords registered for [`redact_known`] when read.
mod url_field {
    use serde::{Deserialize, Deserializer, Serializer};

    /// A Redis URL (`redis://`, `rediss://`, or a Unix socket): its password, if any, is
    /// hidden when shown, so the schema marks it `writeOnly` like a secret.
    pub fn schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^(rediss?|redis\\+unix|unix)://",
            "writeOnly": true,
        })
    }

    pub fn list_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "array",
            "items": { "type": "string", "pattern": "^rediss?://[^\\s]+$" },
        })
    }

    pub fn serialize<S: Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::redact_url(url))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let url = String::deserialize(d)?;
        super::register_secret_parts(&url);
        Ok(url)
    }

    pub mod list {
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
            s.collect_seq(urls.iter().map(|u| super::super::redact_url(u)))
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
            let urls = Vec::<String>::deserialize(d)?;
            urls.iter()
                .for_each(|u| super::super::register_secret_parts(u));
            Ok(urls)
        }
    }
}

/// The durations every duration field accepts (a subset of what `humantime` parses: whole
/// numbers only): one or more `<number><unit>` parts, e.g. `250ms`, `30s`, `1min`,
/// `1m30s`, `2h`. Units: `ns`, `us`, `ms`, `s`/`sec`, `m`/`min`, `h`/`hr`, `d`, `w`, `M`
/// (month), `y` (year), with their long forms.
pub const DURATION_PATTERN: &str = "^([0-9]+ *(nanos|nsec|ns|usec|us|µs|millis|msec|ms|seconds|second|secs|sec|s|minutes|minute|mins|min|m|hours|hour|hrs|hr|h|days|day|d|weeks|week|wks|wk|w|months|month|M|years|year|yrs|yr|y) *)+$";

/// The schema of a duration field: a string in [`DURATION_PATTERN`], marked
/// `x-zdelay-type: duration` for the reference page.
fn duration_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "pattern": DURATION_PATTERN,
        "x-zdelay-type": "duration",
    })
}

fn optional_duration_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    duration_schema(generator)
}

/// Registers only the password part of a URL (the URL itself is not secret).
fn register_secret_parts(url: &str) {
    for secret in url_secrets(url) {
        register_secret(&secret);
    }
}

/// librdkafka options that hold secrets: hidden by `check-config`, scrubbed from logs.
pub fn is_secret_librdkafka_key(key: &str) -> bool {
    [
        "password",
        "secret",
        "oauthbearer.config",
        "ssl.key.pem",
        "ssl_key",
    ]
    .iter()
    .any(|word| key.contains(word))
}

mod librdkafka_options {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(
        options: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(options.iter().map(|(k, v)| {
            let shown = if super::is_secret_librdkafka_key(k) {
                "***"
            } else {
                v.as_str()
            };
            (k, shown)
        }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        let options = BTreeMap::<String, String>::deserialize(d)?;
        for (k, v) in &options {
            if super::is_secret_librdkafka_key(k) {
                super::register_secret(v);
            }
        }
        Ok(options)
    }
}

/// The security options of a broker sink: each combination either works or is refused here.
fn validate_security(name: &str, sink: &SinkConfig) -> Result<(), ConfigError> {
    let field = |f: &str| format!("sinks.{name}.{f}");
    let tls = match sink {
        SinkConfig::Redis(_) => None,
        SinkConfig::Kafka(k) => {
            if let Some(sasl) = &k.sasl
                && sasl.username.is_empty()
            {
                return Err(invalid(field("sasl.username"), "must be non-empty"));
            }
            k.tls.as_ref()
        }
        SinkConfig::Amqp(a) => {
            if a.tls.is_some() && !a.url.expose().starts_with("amqps://") {
                return Err(invalid(field("tls"), "needs an amqps:// url"));
            }
            a.tls.as_ref()
        }
        SinkConfig::Nats(n) => {
            let methods = [n.user.is_some(), n.token.is_some(), n.creds_file.is_some()];
            if methods.iter().filter(|&&m| m).count() > 1 {
                return Err(invalid(
                    field("user"),
                    "choose one of user/password, token, creds_file",
                ));
            }
            if n.user.is_some() != n.password.is_some() {
                return Err(invalid(field("password"), "user and password go together"));
            }
            if let Some(creds) = &n.creds_file
                && !creds.is_file()
            {
                return Err(invalid(
                    field("creds_file"),
                    format!("{} is not a readable file", creds.display()),
                ));
            }
            n.tls.as_ref()
        }
    };
    if let Some(tls) = tls {
        tls.validate(&field("tls"))?;
        if tls.insecure_skip_verify && !matches!(sink, SinkConfig::Kafka(_)) {
            return Err(invalid(
                field("tls.insecure_skip_verify"),
                "only the kafka sink offers it",
            ));
        }
    }
    Ok(())
}

/// librdkafka's names for the time it may take to deliver a message (the second an alias).
pub const KAFKA_MESSAGE_TIMEOUT_KEYS: [&str; 2] = ["message.timeout.ms", "delivery.timeout.ms"];

/// A Kafka sink's own message timeout must end within the publish deadline: a message
/// librdkafka still tries to deliver after the batch gave up on it would reach the topic
/// after its job went back to due, and be delivered again.
/// A route's `rate`, `burst` and `max_length`: well formed, and on a local route only.
fn validate_flow(
    route: &RouteConfig,
    sink: Option<&SinkConfig>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if let Some(rate) = &route.rate {
        parse_rate(rate).map_err(|why| invalid(field("rate"), why))?;
    }
    match route.burst {
        Some(_) if route.rate.is_none() => {
            return Err(invalid(field("burst"), "applies with rate only"));
        }
        Some(0) => return Err(invalid(field("burst"), "must be at least 1")),
        _ => {}
    }
    if route.max_length == Some(0) {
        return Err(invalid(field("max_length"), "must be at least 1"));
    }
    if let Some(rate) = &route.key_rate {
        parse_rate(rate).map_err(|why| invalid(field("key_rate"), why))?;
    }
    match (&route.key_header, &route.key_rate) {
        (Some(h), _) if h.is_empty() => {
            return Err(invalid(field("key_header"), "must be non-empty"));
        }
        (Some(_), None) => return Err(invalid(field("key_header"), "needs key_rate")),
        (None, Some(_)) => {
            return Err(invalid(
                field("key_rate"),
                "needs key_header, the header naming a job's key",
            ));
        }
        _ => {}
    }
    match route.key_burst {
        Some(_) if route.key_rate.is_none() => {
            return Err(invalid(field("key_burst"), "applies with key_rate only"));
        }
        Some(0) => return Err(invalid(field("key_burst"), "must be at least 1")),
        _ => {}
    }
    if let Some(sink) = sink.filter(|s| !s.is_local())
        && route.max_length.is_some()
    {
        bounded_destination(route, sink).map_err(|why| invalid(field("max_length"), why))?;
    }
    Ok(())
}

/// A stream route (`push = "xadd"`): on a Redis sink; trimming only there.
fn validate_stream(
    route: &RouteConfig,
    sink: Option<&SinkConfig>,
    field: &dyn Fn(&str) -> String,
) -> Result<(), ConfigError> {
    if route.push.is_stream() {
        if !matches!(sink, Some(SinkConfig::Redis(_))) {
            return Err(invalid(
                field("push"),
                "\"xadd\" appends to a Redis stream: it needs a redis sink",
            ));
        }
    } else {
        let setting = if route.trim_max_len.is_some() {
            Some("trim_max_len")
        } else if route.trim_max_age.is_some() {
            Some("trim_max_age")
        } else {
            None
        };
        if let Some(setting) = setting {
            return Err(invalid(
                field(setting),
                "trims a stream: it applies with push = \"xadd\" only",
            ));
        }
    }
    if route.trim_max_len == Some(0) {
        return Err(invalid(field("trim_max_len"), "must be at least 1"));
    }
    if route
        .trim_max_age
        .is_some_and(|age| age < Duration::from_millis(1))
    {
        return Err(invalid(
            field("trim_max_age"),
            "must be at least 1ms (a duration like \"24h\")",
        ));
    }
    Ok(())
}

/// Whether a two-phase route's destination has a depth `max_length` can bound: a remote
/// Redis list (its length), an AMQP queue (`/queue`: its messages), a subject a JetStream
/// stream stores (the stream's messages). Kafka has none: a topic keeps its messages for
/// every consumer group, whatever they have read.
fn bounded_destination(route: &RouteConfig, sink: &SinkConfig) -> Result<(), String> {
    match sink {
        SinkConfig::Kafka(_) => Err(
            "has no meaning on Kafka: a topic keeps every message for each consumer group \
             until its retention ends, so it has no queue depth to bound; limit the route \
             with rate instead"
                .to_owned(),
        ),
        SinkConfig::Nats(n) if !n.jetstream => Err(
            "needs JetStream (jetstream = true): core NATS stores no messages, so it has no \
             depth to bound"
                .to_owned(),
        ),
        SinkConfig::Amqp(_) if !route.list_key().starts_with('/') => Err(format!(
            "bounds a queue: give the route the target \"/<queue>\" (the default exchange, \
             whose routing key is the queue it counts), not {:?}",
            route.list_key()
        )),
        _ => Ok(()),
    }
}

fn validate_message_timeout(
    name: &str,
    kafka: &KafkaSinkConfig,
    poller: &PollerConfig,
) -> Result<(), ConfigError> {
    let deadline = poller.publish_deadline().as_millis();
    for key in KAFKA_MESSAGE_TIMEOUT_KEYS {
        let Some(value) = kafka.librdkafka.get(key) else {
            continue;
        };
        let field = format!("sinks.{name}.librdkafka.\"{key}\"");
        let ms: u128 = value
            .trim()
            .parse()
            .map_err(|_| invalid(&field, format!("{value:?} is not a number of ms")))?;
        if ms == 0 || ms > deadline {
            return Err(invalid(
                field,
                format!(
                    "{ms} ms does not fit in the publish deadline of {deadline} ms (poller.lease \
                     less its settle margin{}): set 1..={deadline}, or raise poller.lease",
                    if ms == 0 { "; 0 means never" } else { "" }
                ),
            ));
        }
    }
    Ok(())
}

/// The whole configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[redis]`: where jobs are scheduled.
    pub redis: RedisConfig,
    /// `[poller]`: how due jobs are found and moved.
    pub poller: PollerConfig,
    /// `[admin]`: the HTTP port for metrics, probes and the operator console.
    pub admin: AdminConfig,
    /// Delay-hop spans and their OTLP export (off by default).
    pub tracing: TracingConfig,
    /// Named sinks. A `local` Redis sink (the scheduling Redis itself) always exists.
    /// A name is 1 to 64 lowercase letters, digits and `_`, starting with a letter, so
    /// `ZDELAY_SINKS__<NAME>__<FIELD>` can set its fields.
    #[schemars(extend("propertyNames" = { "pattern": SINK_NAME_PATTERN }))]
    pub sinks: BTreeMap<String, SinkConfig>,
    /// Configured destinations. Default: `default` → list `queue:default` on `local`.
    pub routes: Vec<RouteConfig>,
    /// Raw ZSETs for producers that just `ZADD`.
    pub sources: Vec<SourceConfig>,
    /// `[testing]`: settings for a namespace used by integration tests, never production.
    pub testing: TestingConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            redis: RedisConfig::default(),
            poller: PollerConfig::default(),
            admin: AdminConfig::default(),
            tracing: TracingConfig::default(),
            sinks: BTreeMap::from([(
                LOCAL_SINK.to_owned(),
                SinkConfig::Redis(RedisSinkConfig::default()),
            )]),
            routes: vec![RouteConfig::new("default", LOCAL_SINK, "queue:default")],
            sources: Vec::new(),
            testing: TestingConfig::default(),
        }
    }
}

/// `[redis.tls]`: used with `rediss://` URLs (standalone and cluster seeds).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RedisTlsConfig {
    /// PEM file of the CA(s) that signed the server's certificate. Default: the system's
    /// trust store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate (chain), for servers that require mutual TLS
    /// (`tls-auth-clients yes`); set together with `key_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<std::path::PathBuf>,
    /// Accept any server certificate and host name. For tests only: it gives up the
    /// protection TLS is for, and zdelay logs a warning at every connect.
    pub insecure_skip_verify: bool,
}

impl RedisTlsConfig {
    fn is_default(&self) -> bool {
        *self == RedisTlsConfig::default()
    }
}

/// Name of the sink that is always there: the scheduling Redis itself.
pub const LOCAL_SINK: &str = "local";

/// The most envelope shards a namespace may have (`redis.shards`, `zdelay reshard --to`): one
/// per Redis Cluster slot.
pub const MAX_SHARDS: u16 = 16384;

/// `[redis]`: where jobs are scheduled.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Redis URL: `redis://[user[:password]@]host:port[/db]`, `rediss://` for TLS. Default
    /// `redis://127.0.0.1:6379`. Not used when `cluster_nodes` is set. Shown with its
    /// password hidden.
    #[serde(with = "url_field")]
    #[schemars(schema_with = "url_field::schema")]
    pub url: String,
    /// Redis Cluster seed nodes (`redis://host:port` or `rediss://`, a few are enough: the
    /// client learns the rest). Set, zdelay runs on the cluster and `url` is not used.
    /// Default: none.
    #[serde(
        with = "url_field::list",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(schema_with = "url_field::list_schema")]
    pub cluster_nodes: Vec<String>,
    /// Password, overriding any in the URL (`ZDELAY_REDIS__PASSWORD`, or `password_file`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// `[redis.tls]`: certificates for `rediss://` URLs.
    #[serde(skip_serializing_if = "RedisTlsConfig::is_default")]
    pub tls: RedisTlsConfig,
    /// Prefix of every key. Default `zdelay`. Must not contain `{` or `}`.
    #[schemars(regex(pattern = r"^[^{}]+$"))]
    pub namespace: String,
    /// Number of spread shards (which hold two-phase routes' jobs) a new namespace gets.
    /// Default 16. An existing namespace keeps its own count (`<ns>:schema`), changed online
    /// with `zdelay reshard --to N`.
    #[schemars(range(min = 1, max = 16384))]
    pub shards: u16,
    /// No longer a setting: every namespace is on route lanes (storage layout 2), and a new
    /// one is created on them. `2` is accepted and changes nothing; `1` is refused (this
    /// zdelay neither creates nor serves layout 1: `zdelay upgrade` moves an existing layout-1
    /// namespace). Default: unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 2))]
    pub layout: Option<u32>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            cluster_nodes: Vec::new(),
            password: None,
            tls: RedisTlsConfig::default(),
            namespace: "zdelay".into(),
            shards: 16,
            layout: None,
        }
    }
}

/// `[poller]`: how due jobs are found and moved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PollerConfig {
    /// Jobs per script call, 1..=1000. Default 1000. Lower it only if a single batch's
    /// script call holds Redis for too long.
    #[schemars(range(min = 1, max = 1000))]
    pub batch: usize,
    /// Longest a poller sleeps without a wake-up while wake-ups are not known to arrive
    /// (at start, after a lost subscription, for a raw source without keyspace events).
    /// Default `100ms`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub idle_poll: Duration,
    /// Longest a poller sleeps without a wake-up while wake-ups are known to arrive (the
    /// daemon's probe on the wake channel comes back; for a raw source, the server sends its
    /// keyspace events). A job written without its wake-up (a producer that skips the
    /// `PUBLISH`) can wait this long, and so can two-phase jobs that another daemon queued or
    /// released for a sink only this one publishes (a shard's publishers look at least once a
    /// second while wake-ups are not confirmed). At least `idle_poll`. Default `5s`. A daemon
    /// with more than 16 route lanes stretches each lane's sleep so that its lanes poll like
    /// 16 would (at most 60 s); every lane write wakes its lane.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub idle_poll_max: Duration,
    /// Claim deadline for two-phase sinks: a claimed job not settled by then goes back to due
    /// (and is delivered again). At least `1s`. Default `30s`. Raise it when publishes to a
    /// broker take longer than a few seconds (leases expiring shows in
    /// `zdelay_leases_expired_total`).
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub lease: Duration,
    /// Largest payload delivered, in bytes; larger ones go to dead. Default 1048576 (1 MiB).
    #[schemars(range(min = 1, max = 536870912))]
    pub max_payload: usize,
    /// Payload bytes one script call reads at most: a move or claim batch ends at `batch` jobs
    /// or at this many bytes, whichever comes first (a single larger job moves alone), so a
    /// burst of large payloads never blocks Redis for long (a megabyte costs a few ms of Redis
    /// CPU through a script). A raw source's members and a two-phase job's envelope cannot be
    /// measured before they are read: the mover reads them in chunks the budget holds at
    /// `max_payload` each, and once every one read in the call is small (at most
    /// `max_payload` / 16) in chunks sized for such, so a call that meets large ones right
    /// after small ones may read up to 16 times this before it stops. Default 4194304
    /// (4 MiB).
    #[schemars(range(min = 1024, max = 536870912))]
    pub batch_bytes: usize,
    /// Bytes one two-phase sink may have claimed and not yet settled at once, across all
    /// shards and raw sources (with `sink_concurrency`, which bounds the batches). Each claim
    /// takes its bytes from this bound before it runs; one job larger than what is left may
    /// exceed it. Default 67108864 (64 MiB).
    #[schemars(range(min = 1024, max = 4294967295u32))]
    pub sink_inflight_bytes: usize,
    /// How long SIGTERM waits for the batch in hand. Default `10s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub shutdown_grace: Duration,
    /// How often backlog gauges are sampled. A route lane found empty is looked at again when
    /// a write to it publishes its wake-up, and at least once a minute. Default `5s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub stats_interval: Duration,
    /// Delivery attempts to a two-phase sink before a job goes to dead, unless the job
    /// sets its own `max_attempts`. Default 10.
    #[schemars(range(min = 1))]
    pub max_attempts: u32,
    /// Retry backoff: attempt n waits a random time in [0, min(retry_cap, retry_base × 2^n)]
    /// (exponential with full jitter). Default `1s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub retry_base: Duration,
    /// The longest wait between two delivery attempts (see `retry_base`); at least
    /// `retry_base`. Default `5m`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub retry_cap: Duration,
    /// First pause of a sink found unavailable; doubles while it stays down, up to 30s.
    /// Its jobs wait without losing attempts. Default `1s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub sink_pause: Duration,
    /// Batches one two-phase sink may have in flight at once, across all shards (each up to
    /// `batch` jobs). A sink that is slow or hung holds up at most this many batches of its
    /// own jobs and nothing else. Default 16.
    #[schemars(range(min = 1, max = 1024))]
    pub sink_concurrency: usize,
    /// Pollers per shard (and per raw source) across all daemons on the namespace: 1 or 2.
    /// Daemons share the poller slots evenly and take over the slots of one that stops.
    /// Default 1. Set 2 for high availability: a standby poller takes over a shard within
    /// `slot_lease` when its daemon dies.
    #[schemars(range(min = 1, max = 2))]
    pub per_shard: u8,
    /// How long a daemon keeps its poller slots without renewing them (it renews five times
    /// per lease); a daemon that dies loses them within this. Default `5s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub slot_lease: Duration,
    /// This daemon's identity among the instances on the namespace, kept across restarts: a
    /// daemon restarted after a crash takes its poller slots back at its first heartbeat
    /// instead of waiting out `slot_lease`. Two live daemons with one id: the one started
    /// last refuses to run. Letters, digits, `.`, `_`, `-`; at most 253 characters.
    /// Default: on Kubernetes (`KUBERNETES_SERVICE_HOST` set) the pod name (`POD_NAME`,
    /// else `HOSTNAME`); elsewhere `<host>-<ULID>`, new at every start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Za-z0-9._-]{1,253}$"))]
    pub instance_id: Option<String>,
    /// How long before its time a schedule's occurrence is written as a job, due at that
    /// time: the firing of a crowded moment (a hundred thousand schedules on one second) is
    /// spread over the seconds before it, and when it comes only the jobs' move remains. A
    /// change to a schedule (update, pause, delete) takes back its occurrences written ahead
    /// that still wait. A schedule firing more often than this has several occurrences
    /// waiting at once. `0s` writes each occurrence when it is due. At most `60s`. Default
    /// `10s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub fire_ahead: Duration,
}

/// The longest instance id: a Kubernetes object name (DNS subdomain) fits.
pub const MAX_INSTANCE_ID_LEN: usize = 253;

/// Whether `id` can be an instance id: 1..=253 letters, digits, `.`, `_`, `-` (pod names
/// and host names are; nothing that would need quoting in logs or Redis).
pub fn valid_instance_id(id: &str) -> bool {
    (1..=MAX_INSTANCE_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The most a two-phase batch keeps back from `poller.lease` for its settle.
const SETTLE_MARGIN_MAX: Duration = Duration::from_secs(5);

impl PollerConfig {
    /// How long a two-phase sink may take to publish a batch and collect the broker's
    /// confirmations: `lease` less what the settle needs (a quarter of the lease, at most
    /// 5 s). Whatever is not confirmed by then goes back to due, well before the lease would
    /// hand the jobs to another poller.
    pub fn publish_deadline(&self) -> Duration {
        self.lease - (self.lease / 4).min(SETTLE_MARGIN_MAX)
    }
}

impl Default for PollerConfig {
    fn default() -> Self {
        PollerConfig {
            batch: 1000,
            idle_poll: Duration::from_millis(100),
            idle_poll_max: Duration::from_secs(5),
            lease: Duration::from_secs(30),
            max_payload: 1 << 20,
            batch_bytes: 4 << 20,
            sink_inflight_bytes: 64 << 20,
            shutdown_grace: Duration::from_secs(10),
            stats_interval: Duration::from_secs(5),
            max_attempts: 10,
            retry_base: Duration::from_secs(1),
            retry_cap: Duration::from_secs(300),
            sink_pause: Duration::from_secs(1),
            sink_concurrency: 16,
            per_shard: 1,
            slot_lease: Duration::from_secs(5),
            instance_id: None,
            fire_ahead: Duration::from_secs(10),
        }
    }
}

/// `[admin]`: the HTTP port for `/metrics`, `/healthz`, `/readyz` and the operator console
/// (pages and `/api/…`), and optionally a second port with the first three only.
///
/// Who may read what on the console's API: counts, the forecast and schedule timing are
/// public unless `public_reads = false`; payloads, headers and dead letters need the token
/// (without one configured: only on a loopback `listen`); actions always need the token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Listen address. Default `127.0.0.1:9464`.
    pub listen: SocketAddr,
    /// The console's key: callers send `Authorization: Bearer <token>`. It unlocks the
    /// actions (`POST /api/…`: replay, purge, cancel, pause, resume, run) and the reads that
    /// show payloads, headers or dead letters (`GET /api/jobs/{id}`, `/api/dead`,
    /// `/api/dead/{id}`). Without it every action is refused (403), and those reads are
    /// served only when `listen` is a loopback address. At least 16 characters.
    #[schemars(length(min = 16))]
    pub token: Option<Secret>,
    /// The producers' key for the HTTP enqueue (`POST /api/jobs`, `DELETE /api/jobs/{id}`,
    /// `POST /api/jobs/{id}/reschedule`): callers send `Authorization: Bearer <producer_token>`.
    /// Distinct from `token`: it enqueues, cancels and reschedules, and reads nothing. Unset
    /// (the default): the HTTP enqueue is off (403). At least 16 characters.
    #[schemars(length(min = 16))]
    pub producer_token: Option<Secret>,
    /// Whether counts, the forecast and schedule timing (`GET /api/stats`, `/api/forecast`,
    /// `/api/schedules`) are readable without the token. `false` needs `token`. Default
    /// `true`.
    pub public_reads: bool,
    /// Serve the console (its pages and `/api/…`) on `listen`. `false`: only `/metrics`,
    /// `/healthz` and `/readyz` are served there, and the HTTP enqueue when `producer_token`
    /// is set; every other path is 404. Default `true`.
    pub console: bool,
    /// A second listen address serving only `/metrics`, `/healthz` and `/readyz` (no
    /// console), for a metrics Service or probes that must not reach the console. Default:
    /// none.
    pub metrics_listen: Option<SocketAddr>,
    /// Host names the console answers to, besides IP addresses and `localhost` (the `Host`
    /// header, port ignored; ASCII case ignored), e.g. the name of an ingress in front of
    /// it. A request naming another host is refused (403): a page elsewhere cannot reach a
    /// console through a DNS name it controls (DNS rebinding). Default: none.
    pub allowed_hosts: Vec<String>,
    /// Path the console and its API are served under, e.g. `/zdelay` (default: `/`).
    pub ui_prefix: String,
    /// HTTP enqueue requests served at once, counted once their token is accepted; one
    /// more is answered 503 with `Retry-After: 1` (it is not queued). 1..=10000. Default
    /// `64`.
    #[schemars(range(min = 1, max = 10000))]
    pub enqueue_concurrency: usize,
    /// How long an HTTP enqueue request may take to send its body, from its headers on: a
    /// client still sending after it is answered 408 and its connection closed. Default
    /// `30s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub enqueue_body_timeout: Duration,
    /// How long a job enqueued over HTTP with an `Idempotency-Key` is remembered after it
    /// is delivered or dies (its `unique_for`, unless the job sets its own): a request sent
    /// again within it is answered `duplicate` and enqueues nothing. At least `1s`. Default
    /// `24h`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub idempotency_window: Duration,
    /// Schedules (by id) whose health `/metrics` exports as series of their own
    /// (`zdelay_schedule_*` with a `schedule` label): occurrences by outcome, last firing,
    /// its lateness, the next occurrence and the period, for alerts per schedule. Besides
    /// these, the `schedule_metrics_top_missed` schedules that missed the most are exported.
    /// At most 1000. Default: none.
    #[schemars(length(max = 1000))]
    pub schedule_metrics: Vec<String>,
    /// How many of the schedules that missed the most occurrences get series of their own,
    /// beside `schedule_metrics`: the guard on the `schedule` label's cardinality. Looked for
    /// once a minute (it reads every schedule's health record). 0..=100. Default `5`.
    #[schemars(range(min = 0, max = 100))]
    pub schedule_metrics_top_missed: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            token: None,
            producer_token: None,
            public_reads: true,
            console: true,
            metrics_listen: None,
            allowed_hosts: Vec::new(),
            ui_prefix: String::new(),
            enqueue_concurrency: 64,
            enqueue_body_timeout: Duration::from_secs(30),
            idempotency_window: Duration::from_secs(24 * 3600),
            schedule_metrics: Vec::new(),
            schedule_metrics_top_missed: 5,
        }
    }
}

/// `[tracing]`: the daemon's delay-hop spans, exported over OTLP/HTTP (protobuf). Off
/// unless `otlp_endpoint` is set; trace headers travel with jobs either way.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP traces URL, e.g. `http://127.0.0.1:4318/v1/traces` (a URL
    /// without a path gets `/v1/traces`). Default: none, tracing off.
    #[schemars(extend("pattern" = "^https?://"))]
    pub otlp_endpoint: Option<Secret>,
    /// Share of traces started here (jobs without a `traceparent`) that are sampled,
    /// 0.0..=1.0; a job's own `traceparent` decides by its sampled flag. Default 1.0.
    #[schemars(range(min = 0.0, max = 1.0))]
    pub sample_ratio: f64,
    /// `service.name` of the spans. Default `zdelay`.
    #[schemars(length(min = 1))]
    pub service_name: String,
    /// How long one export may take before it is abandoned (spans are exported in the
    /// background: delivery never waits for it). Default `10s`.
    #[serde(with = "humantime_serde")]
    #[schemars(schema_with = "duration_schema")]
    pub export_timeout: Duration,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            sample_ratio: 1.0,
            service_name: "zdelay".to_owned(),
            export_timeout: Duration::from_secs(10),
        }
    }
}

/// `[testing]`: for a namespace that integration tests use.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TestingConfig {
    /// Create the namespace with a test clock: "now" is Redis's clock plus an offset that
    /// `zdelay clock advance` moves forward, never back, for every daemon and client of the
    /// namespace. Set when the namespace is created, never later: a daemon whose setting
    /// disagrees with its namespace refuses to start. Default `false`.
    pub clock: bool,
}

/// `[sinks.<name>]`: a connection to a delivery system.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum SinkConfig {
    /// Redis lists. Without `url`, the scheduling Redis: moves are atomic, exactly once.
    /// With `url`, another Redis: claim → push → fenced ack, at least once.
    Redis(RedisSinkConfig),
    /// Kafka topics: `acks=all`, idempotent producer, delivery reports awaited.
    Kafka(KafkaSinkConfig),
    /// RabbitMQ (AMQP 0-9-1): publisher confirms, persistent, mandatory.
    Amqp(AmqpSinkConfig),
    /// NATS subjects: JetStream publish awaiting PubAck (or core NATS, best effort).
    Nats(NatsSinkConfig),
}

impl SinkConfig {
    /// Glob patterns of targets a job may name as `<sink>/<target>`.
    pub fn allow(&self) -> &[String] {
        match self {
            SinkConfig::Redis(_) => &[],
            SinkConfig::Kafka(c) => &c.allow,
            SinkConfig::Amqp(c) => &c.allow,
            SinkConfig::Nats(c) => &c.allow,
        }
    }

    /// True for the sink whose delivery happens inside the move script.
    pub fn is_local(&self) -> bool {
        matches!(self, SinkConfig::Redis(RedisSinkConfig { url: None }))
    }

    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::Redis(_) => "redis",
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::Amqp(_) => "amqp",
            SinkConfig::Nats(_) => "nats",
        }
    }
}

/// `kind = "redis"`: pushes onto Redis lists.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisSinkConfig {
    /// Another Redis to deliver to (two-phase, at least once). None: the scheduling Redis.
    /// A secret: it may carry a password (`ZDELAY_SINKS__<NAME>__URL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<Secret>,
}

/// Which Kafka record key a job gets.
#[derive(
    Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum KafkaKey {
    /// The job id (default): jobs with one id keep partition order.
    #[default]
    Id,
    /// No key: records spread over partitions.
    None,
}

/// `kind = "kafka"`: produces to Kafka topics.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// The brokers to bootstrap from, `host:port` comma-separated (librdkafka's
    /// `bootstrap.servers`).
    #[schemars(length(min = 1))]
    pub brokers: String,
    /// Targets (topics) jobs may name as `<sink>/<topic>`; globs. Default none.
    #[serde(default)]
    #[schemars(inner(length(min = 1)))]
    pub allow: Vec<String>,
    /// Record key: `id` (default) or `none`.
    #[serde(default)]
    pub key: KafkaKey,
    /// SASL authentication (`security.protocol` SASL_PLAINTEXT, or SASL_SSL with `tls`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<KafkaSasl>,
    /// TLS to the brokers (`security.protocol` SSL, or SASL_SSL with `sasl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// Raw librdkafka options, applied last (e.g. `"linger.ms" = "5"`). Options that hold
    /// secrets (`sasl.password`, `ssl.key.password`, …) are hidden when shown.
    #[serde(default, with = "librdkafka_options")]
    #[schemars(with = "BTreeMap<String, String>")]
    pub librdkafka: BTreeMap<String, String>,
}

/// `[sinks.<name>.sasl]` of a Kafka sink.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSasl {
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    pub mechanism: SaslMechanism,
    /// The SASL user name.
    #[schemars(length(min = 1))]
    pub username: String,
    /// The SASL password (`ZDELAY_SINKS__<NAME>__SASL__PASSWORD`, or `password_file`).
    pub password: Secret,
}

/// The SASL mechanisms the Kafka sink offers (librdkafka's names).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// `tls = { ... }` of a broker sink: which CA to trust (default: the system's roots), and a
/// client certificate for mutual TLS. Paths, read when the sink connects.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the CA certificate(s) that signed the broker's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM client certificate (with `key_file`): mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<std::path::PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<std::path::PathBuf>,
    /// Kafka only: accept any broker certificate (testing only; the connection is then
    /// encrypted but not authenticated).
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

impl TlsConfig {
    /// The checks every sink shares: cert and key come together, files exist.
    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid(
                format!("{field}.cert_file"),
                "cert_file and key_file go together (mutual TLS)",
            ));
        }
        for (name, path) in [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
        ] {
            if let Some(path) = path
                && !path.is_file()
            {
                return Err(invalid(
                    format!("{field}.{name}"),
                    format!("{} is not a readable file", path.display()),
                ));
            }
        }
        Ok(())
    }
}

/// `kind = "amqp"`: publishes to RabbitMQ exchanges (AMQP 0-9-1).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AmqpSinkConfig {
    /// `amqp://user:pass@host:port/vhost` (`amqps://` for TLS); put credentials in
    /// `ZDELAY_SINKS__<NAME>__URL` or `url_file`.
    #[schemars(extend("pattern" = "^amqps?://"))]
    pub url: Secret,
    /// Targets (`exchange/routing-key`) jobs may name as `<sink>/<target>`; globs.
    #[serde(default)]
    #[schemars(inner(length(min = 1)))]
    pub allow: Vec<String>,
    /// TLS for an `amqps://` URL: the CA to trust, a client certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
}

/// `kind = "nats"`: publishes to NATS subjects.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// `nats://host:port` (comma-separated for several servers). A secret: it may carry
    /// credentials (`ZDELAY_SINKS__<NAME>__URL`).
    #[schemars(extend("minLength" = 1))]
    pub url: Secret,
    /// JetStream publish awaiting PubAck (default true). false = core NATS: best effort,
    /// a flush is not an acknowledgement.
    #[serde(default = "yes")]
    pub jetstream: bool,
    /// Subjects jobs may name as `<sink>/<subject>`; globs.
    #[serde(default)]
    #[schemars(inner(length(min = 1)))]
    pub allow: Vec<String>,
    /// User name for user/password authentication (with `password`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Password for user/password authentication (with `user`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// Token authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    /// A `.creds` file (user JWT + nkey seed): decentralized (operator/JWT) authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creds_file: Option<std::path::PathBuf>,
    /// TLS: the CA to trust, a client certificate. Setting it requires TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
}

impl NatsSinkConfig {
    /// Who this sink authenticates as, for "authentication failed for …" messages.
    pub fn identity(&self) -> String {
        if let Some(user) = &self.user {
            format!("user {user}")
        } else if self.token.is_some() {
            "token authentication".to_owned()
        } else if let Some(creds) = &self.creds_file {
            format!("the user of {}", creds.display())
        } else {
            // Credentials in a URL: `nats://user:pass@…`, or `nats://token@…`.
            let userinfo = self.url.expose().split(',').find_map(|url| {
                let (_, rest) = url.split_once("://")?;
                Some(rest.rsplit_once('@')?.0)
            });
            match userinfo.map(|u| u.split_once(':')) {
                Some(Some((user, _))) => format!("user {user}"),
                Some(None) => "token authentication".to_owned(),
                None => "anonymous user".to_owned(),
            }
        }
    }
}

fn yes() -> bool {
    true
}

/// What a two-phase route does with a job whose destination object (Kafka topic, AMQP
/// exchange or binding, JetStream stream) does not exist.
#[derive(
    Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnMissing {
    /// The job waits, no attempt counted, and is tried again every few seconds: the route
    /// shows as held (stats, `/readyz?verbose`, `zdelay_sink_held_targets`) until the object
    /// exists.
    #[default]
    Wait,
    /// The job goes to dead with the broker's reason.
    Dead,
}

/// How a Redis route's target receives a job: pushed onto either end of a list, or appended
/// to a stream.
#[derive(
    Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Push {
    /// `LPUSH`: consumers take from the other end with `BRPOP` (first in, first out).
    #[default]
    Lpush,
    /// `RPUSH`: consumers take with `BLPOP`.
    Rpush,
    /// `XADD`: the target is a stream; each job is one entry (fields `payload`, `zdelay-id`,
    /// then its trace context and headers), read with `XREADGROUP`/`XACK`.
    Xadd,
}

impl Push {
    pub fn command(self) -> &'static str {
        match self {
            Push::Lpush => "LPUSH",
            Push::Rpush => "RPUSH",
            Push::Xadd => "XADD",
        }
    }

    /// The command that reads the target's length, for `max_length`.
    pub fn length_command(self) -> &'static str {
        match self {
            Push::Lpush | Push::Rpush => "LLEN",
            Push::Xadd => "XLEN",
        }
    }

    /// The push a lane marker or registry entry names (`LPUSH`, `RPUSH`, `XADD`).
    pub fn from_command(command: &str) -> Option<Push> {
        match command {
            "LPUSH" => Some(Push::Lpush),
            "RPUSH" => Some(Push::Rpush),
            "XADD" => Some(Push::Xadd),
            _ => None,
        }
    }

    pub fn is_stream(self) -> bool {
        self == Push::Xadd
    }
}

/// How a stream route trims its stream after appending, as the mover and the remote sink
/// apply it: `XTRIM <stream> MAXLEN ~ <n>` and `XTRIM <stream> MINID ~ <now - age>`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamTrim {
    pub max_len: Option<u64>,
    pub max_age_ms: Option<u64>,
}

impl StreamTrim {
    pub fn is_none(&self) -> bool {
        self.max_len.is_none() && self.max_age_ms.is_none()
    }
}

/// `[[routes]]`: a named destination.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// What jobs name in `dest`.
    #[schemars(regex(pattern = r"^[^/\n]+$"))]
    pub name: String,
    /// A sink name from `[sinks]`.
    #[schemars(length(min = 1))]
    pub sink: String,
    /// Where the sink delivers: a list key (Redis; a stream key with `push = "xadd"`), a topic
    /// (Kafka), `exchange/routing-key`
    /// (AMQP; `/q` = the default exchange, queue `q`) or a subject (NATS).
    #[schemars(length(min = 1))]
    pub target: String,
    /// Redis routes: `lpush` (default; consumers `BRPOP`), `rpush` (consumers `BLPOP`), or
    /// `xadd`: the target is a stream, each job one entry (consumer groups read it with
    /// `XREADGROUP` and `XACK`).
    #[serde(default)]
    pub push: Push,
    /// `push = "xadd"` only: after appending, the stream is trimmed to about this many
    /// entries (`XTRIM MAXLEN ~`: Redis removes whole nodes, so up to 100 more may stay).
    /// Entries are trimmed whether or not a consumer group has read them. Unset: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub trim_max_len: Option<u64>,
    /// `push = "xadd"` only: after appending, entries whose stream id is older than this on
    /// the Redis clock are trimmed (`XTRIM MINID ~ <now - age>`, whole nodes), e.g. `"24h"`.
    /// Unset: entries are kept whatever their age.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(schema_with = "optional_duration_schema")]
    pub trim_max_age: Option<Duration>,
    /// Priority lane: due jobs go to `<target><suffix>`, e.g. `-delayed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub delayed_suffix: Option<String>,
    /// AMQP only: the lane as a message priority (0..=255) instead of a suffix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Two-phase routes: `wait` (default) or `dead` when the destination object is missing.
    #[serde(default)]
    pub on_missing: OnMissing,
    /// Every route: at most this many jobs reach the list (or are handed
    /// to the broker), counted across every daemon on Redis's clock: `"10000/s"`, `"600/m"`,
    /// `"36000/h"`. Jobs over the rate wait in due order and go as soon as it allows: none is
    /// dropped or expired by the wait, which counts as deferral, not lateness, and other
    /// routes flow on. Unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?/(s|m|h)$"))]
    pub rate: Option<String>,
    /// With `rate`: how many jobs may go at once after a quiet spell. Default: a tenth of a
    /// second's worth of the rate, at least 1. Whatever it says, the bucket holds at least one
    /// job plus 10 ms of the rate, so that a daemon's wake-ups can keep up with the rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub burst: Option<u32>,
    /// The route is held while its destination holds this many messages
    /// or more (its consumers stopped or slow) and resumes as they drain it, so it never
    /// grows past it: a list's length or a stream's `XLEN` (local or remote Redis), a RabbitMQ queue's message
    /// count (target `/<queue>`), the messages of the JetStream stream that stores the
    /// subject. Refused on Kafka (a topic has no queue depth) and core NATS. Unset: no bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_length: Option<u64>,
    /// Every route, with `key_rate`: the header whose value is a job's key
    /// (a tenant, a customer). Each key gets its own rate, so one key's burst waits while the
    /// other keys' jobs flow. A job without the header has the key `""`, which has a rate of
    /// its own like any other key. Header names match exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub key_header: Option<String>,
    /// With `key_header`: at most this many jobs of one key reach the destination, like
    /// `rate` (`"1000/s"`). Jobs over it are put later, in due order, never dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9]+(\.[0-9]+)?/(s|m|h)$"))]
    pub key_rate: Option<String>,
    /// With `key_rate`: how many jobs of one key may go at once after a quiet spell. Default:
    /// a tenth of a second's worth, at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub key_burst: Option<u32>,
}

/// A route's flow control as the mover applies it (`move_lane`).
#[derive(Debug, Clone, PartialEq)]
pub struct RouteFlow {
    /// Jobs per second, when the route has a rate.
    pub rate_per_s: Option<f64>,
    /// Jobs the rate's bucket holds.
    pub burst: u32,
    /// The list's bound.
    pub max_length: Option<u64>,
    /// Per-key rates: the header naming a job's key, jobs per second per key, and the burst
    /// per key.
    pub per_key: Option<(String, f64, u32)>,
}

/// A rate as configured, `<jobs>/<s|m|h>`, in jobs per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let (count, unit) = text.split_once('/').ok_or_else(|| {
        format!("{text:?} is not a rate: write <jobs>/s, /m or /h, e.g. \"10000/s\"")
    })?;
    let per = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("unknown unit {other:?} in {text:?}: use s, m or h")),
    };
    let count: f64 = count
        .trim()
        .parse()
        .map_err(|_| format!("{count:?} in {text:?} is not a number of jobs"))?;
    if !count.is_finite() || count <= 0.0 {
        return Err(format!("{text:?}: the rate must be more than 0"));
    }
    Ok(count / per)
}

impl RouteConfig {
    /// A route to `target` on `sink`, every other field at its default (push `lpush`, no
    /// priority lane, no flow control).
    pub fn new(
        name: impl Into<String>,
        sink: impl Into<String>,
        target: impl Into<String>,
    ) -> Self {
        RouteConfig {
            name: name.into(),
            sink: sink.into(),
            target: target.into(),
            push: Push::Lpush,
            trim_max_len: None,
            trim_max_age: None,
            delayed_suffix: None,
            priority: None,
            on_missing: Default::default(),
            rate: None,
            burst: None,
            max_length: None,
            key_header: None,
            key_rate: None,
            key_burst: None,
        }
    }

    /// Its flow control, or `None` when it has neither a rate nor a bound (a rate that does
    /// not parse is refused by [`Config::validate`]).
    pub fn flow(&self) -> Option<RouteFlow> {
        let rate_per_s = self.rate.as_deref().and_then(|r| parse_rate(r).ok());
        let tenth = |rate: f64| (rate / 10.0).ceil().max(1.0) as u32;
        let per_key = match (&self.key_header, self.key_rate.as_deref()) {
            (Some(header), Some(rate)) => parse_rate(rate).ok().map(|r| {
                (
                    header.clone(),
                    r,
                    self.key_burst.unwrap_or_else(|| tenth(r)),
                )
            }),
            _ => None,
        };
        if rate_per_s.is_none() && self.max_length.is_none() && per_key.is_none() {
            return None;
        }
        Some(RouteFlow {
            rate_per_s,
            burst: self
                .burst
                .unwrap_or_else(|| tenth(rate_per_s.unwrap_or(0.0))),
            max_length: self.max_length,
            per_key,
        })
    }

    /// Its stream trimming (`push = "xadd"`), `None` when it has none.
    pub fn trim(&self) -> Option<StreamTrim> {
        let trim = StreamTrim {
            max_len: self.trim_max_len,
            max_age_ms: self.trim_max_age.map(|d| d.as_millis() as u64),
        };
        (!trim.is_none()).then_some(trim)
    }

    /// Where due jobs land: the target, or its priority lane `<target><delayed_suffix>`.
    pub fn list_key(&self) -> String {
        match &self.delayed_suffix {
            Some(suffix) => format!("{}{}", self.target, suffix),
            None => self.target.clone(),
        }
    }
}

/// Unit of a raw source's scores.
#[derive(
    Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum ScoreUnit {
    /// Epoch milliseconds.
    #[default]
    #[serde(rename = "ms")]
    Millis,
    /// Epoch seconds (fractions allowed).
    #[serde(rename = "s")]
    Seconds,
}

impl ScoreUnit {
    pub fn as_arg(self) -> &'static str {
        match self {
            ScoreUnit::Millis => "ms",
            ScoreUnit::Seconds => "s",
        }
    }

    /// A score in this unit as epoch ms.
    pub fn to_ms(self, score: f64) -> f64 {
        match self {
            ScoreUnit::Millis => score,
            ScoreUnit::Seconds => score * 1000.0,
        }
    }
}

/// `[[sources]]`: a raw ZSET, member = payload, score = due time.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The ZSET producers `ZADD` into.
    #[schemars(length(min = 1))]
    pub key: String,
    /// `ms` (default) or `s`.
    #[serde(default)]
    pub score_unit: ScoreUnit,
    /// The route due members are delivered to.
    #[schemars(length(min = 1))]
    pub route: String,
    /// Where undeliverable members go. Default `<key>:dead` (reasons in `<dead_key>:reasons`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub dead_key: Option<String>,
}

impl SourceConfig {
    /// The source's keys (its dead ZSET defaults to `<key>:dead`).
    pub fn keys(&self) -> crate::keys::RawKeys {
        crate::keys::RawKeys::new(&self.key, self.dead_key.as_deref())
    }
}

/// What [`env_safe_name`] accepts, as a regular expression (for schemas).
pub const SINK_NAME_PATTERN: &str = "^[a-z][a-z0-9_]{0,63}$";

/// Whether a name can be a segment of an environment variable's name as it is
/// (`ZDELAY_SINKS__<NAME>__…`: the environment's keys are read lowercased).
fn env_safe_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    name.len() <= 64
        && bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The top-level sections the environment may set (`ZDELAY_<SECTION>__…`); a unit test
/// checks it against `Config`'s fields.
const SECTIONS: &[&str] = &[
    "redis", "poller", "admin", "tracing", "sinks", "routes", "sources", "testing",
];

/// The JSON Schema (draft 7) of `zdelay.toml`, every type inlined: the source of the
/// configuration reference page and of the Helm chart's values schema. Optional fields are
/// given as their type alone (TOML has no null: an optional field is left out).
pub fn json_schema() -> serde_json::Value {
    let generator = schemars::generate::SchemaSettings::draft07()
        .with(|s| s.inline_subschemas = true)
        .for_deserialize()
        .into_generator();
    let mut schema = generator.into_root_schema_for::<Config>().to_value();
    drop_null(&mut schema);
    only_kafka_skips_verify(&mut schema);
    schema
}

/// The sinks share [`TlsConfig`], but only Kafka takes `tls.insecure_skip_verify`
/// (`validate_security` refuses it elsewhere): the other sinks' schemas do not offer it.
fn only_kafka_skips_verify(schema: &mut serde_json::Value) {
    let variants = schema
        .pointer_mut("/properties/sinks/additionalProperties/oneOf")
        .and_then(serde_json::Value::as_array_mut);
    for variant in variants.into_iter().flatten() {
        if variant.pointer("/properties/kind/const") == Some(&"kafka".into()) {
            continue;
        }
        if let Some(tls) = variant
            .pointer_mut("/properties/tls/properties")
            .and_then(serde_json::Value::as_object_mut)
        {
            tls.remove("insecure_skip_verify");
        }
    }
}

/// Removes `null` from `type` lists, `{"type": "null"}` from `anyOf` (collapsing what is
/// left alone) and null defaults.
fn drop_null(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            if map.get("default").is_some_and(Value::is_null) {
                map.remove("default");
            }
            if let Some(Value::Object(default)) = map.get_mut("default") {
                default.retain(|_, v| !v.is_null());
            }
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if types.len() == 1 {
                    let only = types.remove(0);
                    map.insert("type".to_owned(), only);
                }
            }
            if let Some(Value::Array(any)) = map.get_mut("anyOf") {
                any.retain(|s| s.get("type").is_none_or(|t| t != "null"));
                if any.len() == 1 {
                    let Some(Value::Object(only)) = any.pop() else {
                        unreachable!("schemas are objects")
                    };
                    map.remove("anyOf");
                    for (k, v) in only {
                        map.entry(k).or_insert(v);
                    }
                }
            }
            map.values_mut().for_each(drop_null);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_null),
        _ => {}
    }
}

/// Loads defaults ← file ← environment, then validates.
///
/// `path`: a file named on the command line must exist; `None` means defaults + environment.
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    load_with_redis_url(path, None)
}

/// Like [`load`], with `redis.url` set over the file and the environment (the CLI's
/// `--redis-url`) when given.
pub fn load_with_redis_url(
    path: Option<&Path>,
    redis_url: Option<&str>,
) -> Result<Config, ConfigError> {
    let mut layers = Figment::new();
    let mut written = Written::default();
    if let Some(path) = path {
        if !path.is_file() {
            return Err(ConfigError::Missing(path.display().to_string()));
        }
        written.file = std::fs::read_to_string(path)
            .ok()
            .map(|text| (path.display().to_string(), text));
        layers = layers.merge(Toml::file_exact(path));
    }
    layers = layers.merge(
        Env::prefixed("ZDELAY_")
            .split("__")
            // Only section keys: ZDELAY_CONFIG, ZDELAY_LOG and test variables are not config.
            .filter(|key| {
                // Keys arrive in the variable's own case (REDIS.URL): compare without case.
                let first = key.as_str().split('.').next().unwrap_or("");
                SECTIONS.iter().any(|s| s.eq_ignore_ascii_case(first))
            }),
    );
    written.environment = true;
    if let Some(url) = redis_url {
        layers = layers.merge(Serialized::default("redis.url", url));
    }
    from_layers(layers, &written)
}

/// Parses TOML text on top of the defaults (no environment); for tests and examples.
pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
    let written = Written {
        file: Some(("the config text".to_owned(), text.to_owned())),
        environment: false,
    };
    from_layers(Figment::from(Toml::string(text)), &written)
}

/// What the user wrote, to point at a bad value: the file (its name and text) and whether
/// `ZDELAY_…` variables were read.
#[derive(Default)]
struct Written {
    file: Option<(String, String)>,
    environment: bool,
}

/// What the user wrote (file, environment), `<field>_file` references read, on top of the
/// defaults. The references are read before the defaults join, so a default value never
/// counts as "both set".
fn from_layers(layers: Figment, written: &Written) -> Result<Config, ConfigError> {
    let mut values: figment::value::Dict = layers.extract().map_err(|e| explain(e, written))?;
    read_file_references(&mut values, "")?;
    let config: Config = Figment::from(Serialized::defaults(Config::default()))
        .merge(Serialized::defaults(&values))
        .extract()
        .map_err(|e| explain(inside_sink(e, &values), written))?;
    config.validate()?;
    Ok(config)
}

/// Fields that end in `_file` and are paths, not `<field>_file` references.
const PATH_FIELDS: &[&str] = &["ca_file", "cert_file", "key_file", "creds_file"];

/// Replaces each `<field>_file = "<path>"` by `<field>` = the file's content without its
/// trailing newline: every secret (and any other field) can come from a mounted file, the
/// Kubernetes way. Both set, or a file that cannot be read: an error naming the field and
/// the path, never the content.
fn read_file_references(dict: &mut figment::value::Dict, at: &str) -> Result<(), ConfigError> {
    use figment::value::Value;
    let name = |key: &str| {
        if at.is_empty() {
            key.to_owned()
        } else {
            format!("{at}.{key}")
        }
    };
    let references: Vec<String> = dict
        .keys()
        .filter(|k| k.ends_with("_file") && !PATH_FIELDS.contains(&k.as_str()))
        .cloned()
        .collect();
    for reference in references {
        let field = reference.trim_end_matches("_file").to_owned();
        if dict.contains_key(&field) {
            return Err(invalid(
                name(&reference),
                format!("{} is set too: set one of them", name(&field)),
            ));
        }
        let Some(Value::String(_, path)) = dict.remove(&reference) else {
            return Err(invalid(name(&reference), "must be a file path"));
        };
        let content = std::fs::read_to_string(&path)
            .map_err(|e| invalid(name(&reference), format!("cannot read {path}: {e}")))?;
        let content = content.trim_end_matches(['\n', '\r']).to_owned();
        dict.insert(field, Value::from(content));
    }
    for (key, value) in dict.iter_mut() {
        match value {
            Value::Dict(_, inner) => read_file_references(inner, &name(key))?,
            Value::Array(_, items) => {
                for (i, item) in items.iter_mut().enumerate() {
                    if let Value::Dict(_, inner) = item {
                        read_file_references(inner, &format!("{}[{i}]", name(key)))?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// An error about a whole sink (`sinks.x`) from inside it: serde reads a sink's fields only
/// after its `kind`, and loses their path on the way. Read again as its kind's own type, the
/// sink names the field at fault.
fn inside_sink(e: figment::Error, values: &figment::value::Dict) -> figment::Error {
    use figment::value::Value;
    let [section, name] = e.path.as_slice() else {
        return e;
    };
    let sink = match values.get(section.as_str()) {
        Some(Value::Dict(_, sinks)) if section == "sinks" => sinks.get(name.as_str()),
        _ => None,
    };
    let Some(Value::Dict(_, sink)) = sink else {
        return e;
    };
    let mut fields = sink.clone();
    let kind = fields.remove("kind").and_then(|k| k.into_string());
    let fields = Figment::from(Serialized::defaults(fields));
    let inner = match kind.as_deref() {
        Some("redis") => fields.extract::<RedisSinkConfig>().err(),
        Some("kafka") => fields.extract::<KafkaSinkConfig>().err(),
        Some("amqp") => fields.extract::<AmqpSinkConfig>().err(),
        Some("nats") => fields.extract::<NatsSinkConfig>().err(),
        _ => None,
    };
    match inner {
        Some(mut inner) => {
            inner.path.splice(0..0, [section.clone(), name.clone()]);
            inner
        }
        None => e,
    }
}

/// A figment error in the words of the config: the field (`poller.batch`,
/// `routes[0].sink`), what is wrong and what is allowed, and where it was written (the
/// file and line, or the environment variable). figment's own text names Rust types and
/// source locations of zdelay (the defaults are a serialized value), which mean nothing to
/// the person who wrote the config.
fn explain(e: figment::Error, written: &Written) -> ConfigError {
    use figment::error::Kind;
    let mut path = e.path.clone();
    let choices = || choices_at(&path).map(|c| format!("one of {}", c.join(", ")));
    let why = match &e.kind {
        // The path ends with the unknown field.
        Kind::UnknownField(name, allowed) => {
            if path.last() != Some(name) {
                path.push(name.clone());
            }
            let within = match &path[..path.len() - 1] {
                [] => "the config".to_owned(),
                parent => format!("[{}]", field_name(parent)),
            };
            if allowed.is_empty() {
                format!("unknown field: {within} takes no fields")
            } else {
                format!("unknown field: {within} takes {}", allowed.join(", "))
            }
        }
        Kind::UnknownVariant(name, allowed) => {
            format!("{name:?} is not one of {}", allowed.join(", "))
        }
        Kind::MissingField(name) => {
            if path.last().map(String::as_str) != Some(name.as_ref()) {
                path.push(name.to_string());
            }
            "required, and not set".to_owned()
        }
        Kind::DuplicateField(name) => format!("{name} is given twice"),
        Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => format!(
            "{} is not allowed: expected {}",
            actual_text(actual),
            choices().unwrap_or_else(|| expected_text(expected))
        ),
        Kind::InvalidLength(n, expected) => {
            format!(
                "{n} items is not allowed: expected {}",
                expected_text(expected)
            )
        }
        Kind::Message(message) => message.clone(),
        other => other.to_string(),
    };
    let why = redact_known(&scrub(&why)).into_owned();
    let place = where_written(&path, written);
    if path.is_empty() {
        // Not a field: the file is not TOML, say. The parser's words say where.
        return ConfigError::Parse(match place {
            Some(place) => format!("invalid config: {place}: {why}"),
            None => format!("invalid config: {why}"),
        });
    }
    invalid(
        field_name(&path),
        match place {
            Some(place) => format!("{why} ({place})"),
            None => why,
        },
    )
}

/// The values the schema allows at `path`, when it lists them (an enum's names).
fn choices_at(path: &[String]) -> Option<Vec<String>> {
    use serde_json::Value;
    let schema = json_schema();
    // Candidates: a map of sink kinds offers each kind's fields.
    let mut nodes = vec![&schema];
    for key in path {
        let mut next = Vec::new();
        for node in nodes {
            let variants = node["oneOf"].as_array().into_iter().flatten();
            for node in std::iter::once(node).chain(variants) {
                if key.parse::<usize>().is_ok() {
                    next.extend(node.get("items"));
                } else if let Some(field) = node.pointer(&format!("/properties/{key}")) {
                    next.push(field);
                } else {
                    next.extend(node.get("additionalProperties").filter(|v| v.is_object()));
                }
            }
        }
        nodes = next;
    }
    let node = nodes.first()?;
    let names = |v: &Value| -> Vec<String> {
        let of = |v: &Value| {
            v.get("const")
                .into_iter()
                .chain(v["enum"].as_array().into_iter().flatten())
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let mut all = of(v);
        for variant in ["oneOf", "anyOf"]
            .iter()
            .flat_map(|k| v[k].as_array().into_iter().flatten())
        {
            all.extend(of(variant));
        }
        all
    };
    Some(names(node)).filter(|n| !n.is_empty())
}

/// `["routes", "0", "sink"]` as `routes[0].sink`.
fn field_name(path: &[String]) -> String {
    let mut name = String::new();
    for key in path {
        if key.parse::<usize>().is_ok() {
            name.push_str(&format!("[{key}]"));
        } else {
            if !name.is_empty() {
                name.push('.');
            }
            name.push_str(key);
        }
    }
    name
}

/// A value as the user wrote it.
fn actual_text(actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    match actual {
        Actual::Bool(v) => v.to_string(),
        Actual::Unsigned(v) => v.to_string(),
        Actual::Signed(v) => v.to_string(),
        Actual::Float(v) => v.to_string(),
        Actual::Char(v) => format!("{v:?}"),
        Actual::Str(v) => format!("{v:?}"),
        Actual::Seq => "a list".to_owned(),
        Actual::Map => "a table".to_owned(),
        Actual::Unit | Actual::Option => "an empty value".to_owned(),
        other => other.to_string(),
    }
}

/// What serde expected, in the words of TOML rather than of Rust types.
fn expected_text(expected: &str) -> String {
    let expected = expected.trim();
    let unsigned = ["u8", "u16", "u32", "u64", "u128", "usize"];
    let signed = ["i8", "i16", "i32", "i64", "i128", "isize"];
    if unsigned.contains(&expected) {
        "a whole number, 0 or more".to_owned()
    } else if signed.contains(&expected) {
        "a whole number".to_owned()
    } else if expected == "f32" || expected == "f64" {
        "a number".to_owned()
    } else if expected == "a boolean" || expected == "bool" {
        "true or false".to_owned()
    } else if expected.contains("string") {
        "text in quotes".to_owned()
    } else if expected.starts_with("struct ")
        || expected.starts_with("enum ")
        || expected.starts_with("internally tagged enum")
        || expected.contains("map")
    {
        "a table".to_owned()
    } else if expected.contains("sequence") {
        "a list".to_owned()
    } else if expected == "a duration" {
        "a duration such as \"250ms\", \"30s\" or \"1m30s\"".to_owned()
    } else {
        expected.to_owned()
    }
}

/// Text that may quote a Rust path (`a::b::C`) with the path cut to its last name.
fn scrub(text: &str) -> String {
    text.split(' ')
        .map(|word| match word.rfind("::") {
            Some(i) => &word[i + 2..],
            None => word,
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Where the value at `path` was written: the environment variable that sets it (it wins
/// over the file), or the file and the line of its key (of the nearest enclosing key the
/// file has).
fn where_written(path: &[String], written: &Written) -> Option<String> {
    if path.is_empty() {
        return written.file.as_ref().map(|(name, _)| name.clone());
    }
    if written.environment {
        // The variable of the field, or of a table or list holding it (`ZDELAY_ROUTES`).
        let names: Vec<String> = path
            .iter()
            .take_while(|k| k.parse::<usize>().is_err())
            .map(|k| k.to_ascii_uppercase())
            .collect();
        for len in (1..=names.len()).rev() {
            let var = format!("ZDELAY_{}", names[..len].join("__"));
            if std::env::var_os(&var).is_some() {
                return Some(format!("environment variable {var}"));
            }
        }
    }
    let (name, text) = written.file.as_ref()?;
    Some(match line_of(text, path) {
        Some(line) => format!("{name} line {line}"),
        None => name.clone(),
    })
}

/// The line of `path` in TOML `text`: of its key, or of the deepest enclosing key written.
fn line_of(text: &str, path: &[String]) -> Option<usize> {
    use toml_edit::{Item, TableLike, Value};
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let mut table: &dyn TableLike = doc.as_table();
    // Where the deepest key (or list element) found so far starts.
    let mut start = None;
    let mut keys = path.iter().peekable();
    while let Some(key) = keys.next() {
        let Some((k, item)) = table.get_key_value(key) else {
            break;
        };
        start = k.span().map(|s| s.start).or(start);
        let element = keys.peek().and_then(|k| k.parse::<usize>().ok());
        let next: Option<&dyn TableLike> = match (item, element) {
            (Item::ArrayOfTables(tables), Some(i)) => {
                keys.next();
                let t = tables.get(i);
                start = t.and_then(|t| t.span()).map(|s| s.start).or(start);
                t.map(|t| t as &dyn TableLike)
            }
            (Item::Value(Value::Array(values)), Some(i)) => {
                keys.next();
                let v = values.get(i);
                start = v.and_then(|v| v.span()).map(|s| s.start).or(start);
                v.and_then(|v| v.as_inline_table())
                    .map(|t| t as &dyn TableLike)
            }
            _ => item.as_table_like(),
        };
        match next {
            Some(t) => table = t,
            None => break,
        }
    }
    start.map(|start| text[..start].matches('\n').count() + 1)
}

impl Config {
    /// Cross-field checks; each error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = &self.redis;
        if r.namespace.is_empty() || r.namespace.contains(['{', '}']) {
            return Err(invalid(
                "redis.namespace",
                "must be non-empty and contain no { or }",
            ));
        }
        if r.shards == 0 || r.shards > MAX_SHARDS {
            return Err(invalid("redis.shards", "must be 1..=16384"));
        }
        match r.layout {
            None | Some(crate::keys::LAYOUT) => {}
            Some(1) => {
                return Err(invalid(
                    "redis.layout",
                    "storage layout 1 is no longer created or served: remove the setting (a new \
                     namespace is on route lanes); an existing layout-1 namespace is moved by \
                     zdelay upgrade",
                ));
            }
            Some(other) => {
                return Err(invalid(
                    "redis.layout",
                    format!("is no longer a setting (every namespace is on layout 2), not {other}"),
                ));
            }
        }
        for (i, node) in r.cluster_nodes.iter().enumerate() {
            if !node.starts_with("redis://") && !node.starts_with("rediss://") {
                return Err(invalid(
                    format!("redis.cluster_nodes[{i}]"),
                    "must be a redis:// or rediss:// URL",
                ));
            }
        }
        let tls_seeds = r
            .cluster_nodes
            .iter()
            .filter(|n| n.starts_with("rediss://"));
        if !(tls_seeds.count() == 0 || r.cluster_nodes.iter().all(|n| n.starts_with("rediss://"))) {
            return Err(invalid(
                "redis.cluster_nodes",
                "mixes redis:// and rediss:// seeds: a cluster is all TLS or none",
            ));
        }
        if r.tls.cert_file.is_some() != r.tls.key_file.is_some() {
            return Err(invalid(
                "redis.tls.cert_file",
                "cert_file and key_file go together (the client's certificate and its key)",
            ));
        }
        let a = &self.admin;
        if a.token.as_ref().is_some_and(|t| t.expose().len() < 16) {
            return Err(invalid("admin.token", "must be at least 16 characters"));
        }
        if a.producer_token
            .as_ref()
            .is_some_and(|t| t.expose().len() < 16)
        {
            return Err(invalid(
                "admin.producer_token",
                "must be at least 16 characters",
            ));
        }
        if let (Some(p), Some(t)) = (&a.producer_token, &a.token)
            && p.expose() == t.expose()
        {
            return Err(invalid(
                "admin.producer_token",
                "must differ from admin.token (producers must not get the operator's rights)",
            ));
        }
        if !a.public_reads && a.token.is_none() {
            return Err(invalid(
                "admin.public_reads",
                "false needs admin.token: without a token nothing could read the counts \
                 (to turn the console off, set admin.console = false)",
            ));
        }
        if a.metrics_listen == Some(a.listen) {
            return Err(invalid(
                "admin.metrics_listen",
                "must differ from admin.listen (it is a second listener)",
            ));
        }
        if let Some((i, host)) = a.allowed_hosts.iter().enumerate().find(|(_, h)| {
            h.is_empty()
                || !h
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        }) {
            return Err(invalid(
                format!("admin.allowed_hosts[{i}]"),
                format!("{host:?} is not a host name (letters, digits, - . _; no port or scheme)"),
            ));
        }
        let prefix = a.ui_prefix.as_str();
        let prefix_ok = prefix.is_empty()
            || (prefix.starts_with('/')
                && !prefix.ends_with('/')
                && prefix[1..].split('/').all(|part| {
                    !part.is_empty()
                        && part
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                })
                && !matches!(prefix, "/api" | "/metrics" | "/healthz" | "/readyz"));
        if !prefix_ok {
            return Err(invalid(
                "admin.ui_prefix",
                "must be empty or a path like /zdelay (letters, digits, - _ . segments, no \
                 trailing /, not /api, /metrics, /healthz or /readyz)",
            ));
        }
        if !(1..=10_000).contains(&a.enqueue_concurrency) {
            return Err(invalid("admin.enqueue_concurrency", "must be 1..=10000"));
        }
        if a.enqueue_body_timeout.is_zero() {
            return Err(invalid(
                "admin.enqueue_body_timeout",
                "must be more than 0 (a duration like \"30s\")",
            ));
        }
        if a.idempotency_window < Duration::from_secs(1) {
            return Err(invalid(
                "admin.idempotency_window",
                "must be at least 1s (a duration like \"24h\")",
            ));
        }
        if a.schedule_metrics.len() > 1000 {
            return Err(invalid(
                "admin.schedule_metrics",
                "at most 1000 schedules get series of their own",
            ));
        }
        if a.schedule_metrics_top_missed > 100 {
            return Err(invalid(
                "admin.schedule_metrics_top_missed",
                "must be 0..=100",
            ));
        }
        let p = &self.poller;
        if p.batch == 0 || p.batch > 1000 {
            return Err(invalid("poller.batch", "must be 1..=1000"));
        }
        if p.idle_poll.is_zero() {
            return Err(invalid("poller.idle_poll", "must be greater than 0"));
        }
        if p.idle_poll_max < p.idle_poll {
            return Err(invalid(
                "poller.idle_poll_max",
                format!(
                    "must be at least poller.idle_poll ({})",
                    humantime::format_duration(p.idle_poll)
                ),
            ));
        }
        if p.lease < Duration::from_secs(1) {
            return Err(invalid("poller.lease", "must be at least 1s"));
        }
        if p.fire_ahead > Duration::from_secs(60) {
            return Err(invalid("poller.fire_ahead", "must be at most 60s"));
        }
        if p.max_payload == 0 || p.max_payload > 512 << 20 {
            return Err(invalid("poller.max_payload", "must be 1..=536870912 bytes"));
        }
        if p.batch_bytes < 1024 || p.batch_bytes > 512 << 20 {
            return Err(invalid(
                "poller.batch_bytes",
                "must be 1024..=536870912 bytes",
            ));
        }
        // A claim takes its bytes from a semaphore whose acquisitions count in u32.
        if p.sink_inflight_bytes < 1024 || p.sink_inflight_bytes > u32::MAX as usize {
            return Err(invalid(
                "poller.sink_inflight_bytes",
                "must be 1024..=4294967295 bytes",
            ));
        }
        if p.stats_interval.is_zero() {
            return Err(invalid("poller.stats_interval", "must be greater than 0"));
        }
        if p.max_attempts == 0 {
            return Err(invalid("poller.max_attempts", "must be at least 1"));
        }
        if p.retry_base.is_zero() || p.retry_cap < p.retry_base {
            return Err(invalid(
                "poller.retry_base",
                "must be greater than 0 and at most poller.retry_cap",
            ));
        }
        if p.sink_pause.is_zero() {
            return Err(invalid("poller.sink_pause", "must be greater than 0"));
        }
        if !(1..=2).contains(&p.per_shard) {
            return Err(invalid("poller.per_shard", "must be 1 or 2"));
        }
        if p.slot_lease < Duration::from_secs(1) {
            return Err(invalid("poller.slot_lease", "must be at least 1s"));
        }
        if p.sink_concurrency == 0 || p.sink_concurrency > 1024 {
            return Err(invalid("poller.sink_concurrency", "must be 1..=1024"));
        }
        if let Some(id) = &p.instance_id
            && !valid_instance_id(id)
        {
            return Err(invalid(
                "poller.instance_id",
                format!(
                    "{id:?}: must be 1 to {MAX_INSTANCE_ID_LEN} letters, digits, '.', '_' or '-'"
                ),
            ));
        }
        let t = &self.tracing;
        if let Some(endpoint) = &t.otlp_endpoint
            && !(endpoint.expose().starts_with("http://")
                || endpoint.expose().starts_with("https://"))
        {
            return Err(invalid(
                "tracing.otlp_endpoint",
                "must be an http:// or https:// URL",
            ));
        }
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            return Err(invalid("tracing.sample_ratio", "must be 0.0..=1.0"));
        }
        if t.service_name.is_empty() {
            return Err(invalid("tracing.service_name", "must be non-empty"));
        }
        if t.export_timeout.is_zero() {
            return Err(invalid("tracing.export_timeout", "must be greater than 0"));
        }
        for (name, sink) in &self.sinks {
            if !env_safe_name(name) {
                return Err(invalid(
                    format!("sinks.{name:?}"),
                    "a sink name is 1 to 64 lowercase letters, digits and _, starting with a \
                     letter (so ZDELAY_SINKS__<NAME>__<FIELD> can set its fields)",
                ));
            }
            for (i, pattern) in sink.allow().iter().enumerate() {
                if pattern.is_empty() {
                    return Err(invalid(format!("sinks.{name}.allow[{i}]"), "empty pattern"));
                }
            }
            match sink {
                SinkConfig::Kafka(k) if k.brokers.is_empty() => {
                    return Err(invalid(
                        format!("sinks.{name}.brokers"),
                        "must be non-empty",
                    ));
                }
                SinkConfig::Kafka(k) => validate_message_timeout(name, k, p)?,
                SinkConfig::Amqp(a) if !a.url.expose().starts_with("amqp") => {
                    return Err(invalid(
                        format!("sinks.{name}.url"),
                        "must be an amqp:// or amqps:// URL",
                    ));
                }
                SinkConfig::Nats(n) if n.url.expose().is_empty() => {
                    return Err(invalid(format!("sinks.{name}.url"), "must be non-empty"));
                }
                _ => {}
            }
            validate_security(name, sink)?;
        }
        let mut names = BTreeSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let field = |f: &str| format!("routes[{i}] ({}).{f}", route.name);
            if route.name.is_empty() || route.name.contains(['\n', '/']) {
                return Err(invalid(
                    field("name"),
                    "must be non-empty, without / or newline",
                ));
            }
            if !names.insert(route.name.as_str()) {
                return Err(invalid(field("name"), "another route has this name"));
            }
            if !self.sinks.contains_key(&route.sink) {
                let known: Vec<_> = self.sinks.keys().map(String::as_str).collect();
                return Err(invalid(
                    field("sink"),
                    format!(
                        "sink {:?} is not defined; defined sinks: {}",
                        route.sink,
                        known.join(", ")
                    ),
                ));
            }
            if route.target.is_empty() {
                return Err(invalid(field("target"), "must be non-empty"));
            }
            if route.priority.is_some()
                && !matches!(self.sinks.get(&route.sink), Some(SinkConfig::Amqp(_)))
            {
                return Err(invalid(
                    field("priority"),
                    "only AMQP routes take a priority",
                ));
            }
            if route.delayed_suffix.as_deref() == Some("") {
                return Err(invalid(
                    field("delayed_suffix"),
                    "must be non-empty when set",
                ));
            }
            validate_flow(route, self.sinks.get(&route.sink), &field)?;
            validate_stream(route, self.sinks.get(&route.sink), &field)?;
        }
        let mut keys = BTreeSet::new();
        for (i, source) in self.sources.iter().enumerate() {
            let field = |f: &str| format!("sources[{i}] ({}).{f}", source.key);
            if source.key.is_empty() {
                return Err(invalid(field("key"), "must be non-empty"));
            }
            if !keys.insert(source.key.as_str()) {
                return Err(invalid(field("key"), "another source has this key"));
            }
            if !r.cluster_nodes.is_empty() {
                // A source's dead and claims keys are built around its key: on a cluster they
                // share its slot only through a hash tag.
                if !crate::keys::has_hash_tag(&source.key) {
                    return Err(invalid(
                        field("key"),
                        format!(
                            "on a Redis Cluster a source key needs a hash tag, e.g. \
                             {{{}}}, so its dead and claims keys share its slot",
                            source.key
                        ),
                    ));
                }
                let dead = source.keys().dead;
                if crate::keys::slot_of(&dead) != crate::keys::slot_of(&source.key) {
                    return Err(invalid(
                        field("dead_key"),
                        format!(
                            "{dead} is in another cluster slot than {}: give it the same hash tag",
                            source.key
                        ),
                    ));
                }
            }
            if !names.contains(source.route.as_str()) {
                return Err(invalid(
                    field("route"),
                    format!(
                        "route {:?} is not defined; defined routes: {}",
                        source.route,
                        names.iter().copied().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            if self
                .routes
                .iter()
                .any(|r| r.name == source.route && r.push.is_stream())
            {
                return Err(invalid(
                    field("route"),
                    format!(
                        "route {:?} appends to a stream (push = \"xadd\"): a raw source's \
                         members are delivered to lists only",
                        source.route
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn route(&self, name: &str) -> Option<&RouteConfig> {
        self.routes.iter().find(|r| r.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_to_jobs_per_second_or_say_why() {
        assert_eq!(parse_rate("10000/s"), Ok(10_000.0));
        assert_eq!(parse_rate("600/m"), Ok(10.0));
        assert_eq!(parse_rate("36000/h"), Ok(10.0));
        assert_eq!(parse_rate("0.5/s"), Ok(0.5));
        for (bad, why) in [
            ("0/s", "more than 0"),
            ("-3/s", "more than 0"),
            ("NaN/s", "more than 0"),
            ("10", "not a rate"),
            ("ten/s", "not a number"),
            ("10/d", "unknown unit"),
        ] {
            let err = parse_rate(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn a_route_s_flow_defaults_its_burst_to_a_tenth_of_a_second() {
        let mut route = Config::default().routes.remove(0);
        assert_eq!(route.flow(), None);
        route.rate = Some("2000/s".into());
        assert_eq!(route.flow().map(|f| f.burst), Some(200));
        route.rate = Some("5/m".into());
        assert_eq!(route.flow().map(|f| f.burst), Some(1));
        route.burst = Some(7);
        route.max_length = Some(9);
        let flow = route.flow().unwrap();
        assert_eq!((flow.burst, flow.max_length), (7, Some(9)));
    }

    #[test]
    fn nats_identity_names_the_user_of_the_config_or_the_url() {
        let nats = |url: &str| NatsSinkConfig {
            url: url.into(),
            ..Default::default()
        };
        assert_eq!(nats("nats://127.0.0.1:4222").identity(), "anonymous user");
        assert_eq!(
            nats("nats://127.0.0.1:4222,nats://zd:pw@127.0.0.1:4223").identity(),
            "user zd"
        );
        assert_eq!(
            nats("nats://s3cr3t-token@127.0.0.1:4222").identity(),
            "token authentication"
        );
        let configured = NatsSinkConfig {
            user: Some("alice".into()),
            ..nats("nats://zd:pw@127.0.0.1:4222")
        };
        assert_eq!(configured.identity(), "user alice");
    }

    /// The reference (made from the schema) offers `tls.insecure_skip_verify` on a sink kind
    /// exactly when a config of that kind with it set is accepted.
    #[test]
    fn the_schema_offers_skip_verify_where_the_config_takes_it() {
        let schema = json_schema();
        let variants = schema["properties"]["sinks"]["additionalProperties"]["oneOf"]
            .as_array()
            .unwrap();
        let mut with_tls = 0;
        for variant in variants {
            let kind = variant["properties"]["kind"]["const"].as_str().unwrap();
            let Some(tls) = variant["properties"]["tls"]["properties"].as_object() else {
                continue;
            };
            with_tls += 1;
            let connect = match kind {
                "kafka" => "brokers = \"127.0.0.1:9092\"",
                "amqp" => "url = \"amqps://127.0.0.1\"",
                "nats" => "url = \"tls://127.0.0.1:4222\"",
                other => panic!("a sink kind with tls this test does not know: {other}"),
            };
            let toml = format!(
                "[sinks.s]\nkind = \"{kind}\"\n{connect}\ntls = {{ insecure_skip_verify = true }}\n"
            );
            assert_eq!(
                tls.contains_key("insecure_skip_verify"),
                from_toml(&toml).is_ok(),
                "{kind}: {:?}",
                from_toml(&toml).err()
            );
        }
        assert_eq!(with_tls, 3, "kafka, amqp and nats take tls");
    }

    #[test]
    fn broker_security_options_parse_and_bad_combinations_name_the_field() {
        let ok = from_toml(
            r#"
[sinks.k]
kind = "kafka"
brokers = "127.0.0.1:9092"
sasl = { mechanism = "SCRAM-SHA-256", username = "alice", password = 12345 }
tls = { insecure_skip_verify = true }
"#,
        )
        .expect("valid kafka security");
        let SinkConfig::Kafka(k) = &ok.sinks["k"] else {
            panic!("kafka sink")
        };
        let sasl = k.sasl.as_ref().expect("sasl");
        assert_eq!(sasl.mechanism, SaslMechanism::ScramSha256);
        assert_eq!(sasl.password.expose(), "12345");
        assert!(
            !format!("{ok:?}").contains("12345"),
            "the password is a Secret"
        );

        let err = |toml: &str| from_toml(toml).expect_err(toml).to_string();
        let e = err(r#"
[sinks.k]
kind = "kafka"
brokers = "b"
sasl = { mechanism = "GSSAPI", username = "a", password = "p" }
"#);
        assert!(e.contains("GSSAPI") || e.contains("mechanism"), "{e}");
        let e = err(r#"
[sinks.r]
kind = "amqp"
url = "amqp://127.0.0.1"
tls = {}
"#);
        assert!(e.contains("sinks.r.tls") && e.contains("amqps://"), "{e}");
        let e = err(r#"
[sinks.r]
kind = "amqp"
url = "amqps://127.0.0.1"
tls = { ca_file = "/nonexistent/ca.pem" }
"#);
        assert!(e.contains("sinks.r.tls.ca_file"), "{e}");
        let e = err(r#"
[sinks.r]
kind = "amqp"
url = "amqps://127.0.0.1"
tls = { insecure_skip_verify = true }
"#);
        assert!(e.contains("insecure_skip_verify"), "{e}");
        let e = err(r#"
[sinks.n]
kind = "nats"
url = "nats://127.0.0.1"
user = "a"
password = "p"
token = "t"
"#);
        assert!(e.contains("sinks.n.user"), "{e}");
        let e = err(r#"
[sinks.n]
kind = "nats"
url = "nats://127.0.0.1"
user = "a"
"#);
        assert!(e.contains("sinks.n.password"), "{e}");
    }

    #[test]
    fn defaults_are_valid_and_documented() {
        let c = from_toml("").unwrap();
        assert_eq!(c.redis.url, "redis://127.0.0.1:6379");
        assert_eq!(c.redis.shards, 16);
        assert_eq!(c.redis.namespace, "zdelay");
        assert_eq!(c.poller.batch, 1000);
        assert_eq!(c.poller.idle_poll, Duration::from_millis(100));
        assert!(matches!(c.sinks.get("local"), Some(SinkConfig::Redis(_))));
        assert_eq!(c.routes[0].name, "default");
    }

    #[test]
    fn shipped_config_parses() {
        let text = include_str!("../../../config/zdelay.toml");
        let c = from_toml(text).unwrap();
        assert!(c.route("emails").is_some());
    }

    #[test]
    fn design_example_section_parses() {
        let c = from_toml(
            r#"
            [redis]
            url = "redis://127.0.0.1:6379"
            namespace = "zdelay"
            shards = 16
            [poller]
            batch = 1000
            idle_poll = "100ms"
            lease = "30s"
            [admin]
            listen = "127.0.0.1:9464"
            [sinks.local]
            kind = "redis"
            [[routes]]
            name = "emails"
            sink = "local"
            target = "queue:emails"
            push = "lpush"
            delayed_suffix = "-delayed"
            [[sources]]
            key = "delayed:emails"
            score_unit = "ms"
            route = "emails"
            "#,
        )
        .unwrap();
        assert_eq!(
            c.routes.len(),
            1,
            "a configured route list replaces the default"
        );
        assert_eq!(c.routes[0].list_key(), "queue:emails-delayed");
        assert_eq!(c.sources[0].keys().dead, "delayed:emails:dead");
        assert_eq!(c.sources[0].keys().reasons, "delayed:emails:dead:reasons");
    }

    fn err(text: &str) -> String {
        from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn http_enqueue_limits_have_defaults_and_are_checked() {
        let c = from_toml("").unwrap();
        assert_eq!(c.admin.enqueue_concurrency, 64);
        assert_eq!(c.admin.enqueue_body_timeout, Duration::from_secs(30));
        assert_eq!(c.admin.idempotency_window, Duration::from_secs(86_400));
        let c = from_toml(
            "[admin]\nenqueue_concurrency = 8\nenqueue_body_timeout = \"5s\"\n\
             idempotency_window = \"1h\"",
        )
        .unwrap();
        assert_eq!(
            (
                c.admin.enqueue_concurrency,
                c.admin.enqueue_body_timeout,
                c.admin.idempotency_window
            ),
            (8, Duration::from_secs(5), Duration::from_secs(3600))
        );
        for (bad, field) in [
            ("enqueue_concurrency = 0", "admin.enqueue_concurrency"),
            ("enqueue_concurrency = 10001", "admin.enqueue_concurrency"),
            (
                "enqueue_body_timeout = \"0s\"",
                "admin.enqueue_body_timeout",
            ),
            ("idempotency_window = \"500ms\"", "admin.idempotency_window"),
            (
                "schedule_metrics_top_missed = 101",
                "admin.schedule_metrics_top_missed",
            ),
        ] {
            let said = err(&format!("[admin]\n{bad}"));
            assert!(said.contains(field), "{bad}: {said}");
        }
    }

    #[test]
    fn admin_access_settings_are_checked() {
        let c = from_toml("").unwrap();
        assert!(c.admin.public_reads && c.admin.console);
        assert_eq!(c.admin.metrics_listen, None);
        let c = from_toml(
            "[admin]\ntoken = \"0123456789abcdef\"\npublic_reads = false\nconsole = false\n\
             metrics_listen = \"0.0.0.0:9465\"\nallowed_hosts = [\"zdelay.example.com\"]",
        )
        .unwrap();
        assert!(!c.admin.public_reads && !c.admin.console);
        assert_eq!(c.admin.metrics_listen, Some(([0, 0, 0, 0], 9465).into()));
        assert!(err("[admin]\npublic_reads = false").contains("admin.public_reads"));
        assert!(
            err("[admin]\nlisten = \"127.0.0.1:9464\"\nmetrics_listen = \"127.0.0.1:9464\"")
                .contains("admin.metrics_listen")
        );
        assert!(
            err("[admin]\nallowed_hosts = [\"ok.example\", \"http://x\"]")
                .contains("admin.allowed_hosts[1]")
        );
    }

    #[test]
    fn bad_config_names_the_field() {
        assert!(err("[poller]\nbatchh = 3").contains("batchh"));
        assert!(err("[poller]\nidle_poll = \"soon\"").contains("idle_poll"));
        assert!(err("[poller]\nbatch = 5000").contains("poller.batch"));
        assert!(err("[poller]\nbatch_bytes = 10").contains("poller.batch_bytes"));
        assert!(
            err("[poller]\nsink_inflight_bytes = 5000000000")
                .contains("poller.sink_inflight_bytes")
        );
        assert!(
            err("[[routes]]\nname=\"a\"\nsink=\"nope\"\ntarget=\"q\"")
                .contains("routes[0] (a).sink: sink \"nope\" is not defined")
        );
        assert!(
            err("[[sources]]\nkey=\"k\"\nroute=\"missing\"")
                .contains("sources[0] (k).route: route \"missing\" is not defined")
        );
        assert!(err("[sinks.x]\nkind = \"carrier-pigeon\"").contains("carrier-pigeon"));
        assert!(err("[sinks.x]\nkind = \"redis\"\nurll = \"x\"").contains("urll"));
        assert!(err("[redis]\nnamespace = \"a{b\"").contains("redis.namespace"));
        assert!(
            err("[[routes]]\nname=\"a\"\nsink=\"local\"\ntarget=\"q\"\n[[routes]]\nname=\"a\"\nsink=\"local\"\ntarget=\"r\"")
                .contains("another route")
        );
    }

    #[test]
    fn stream_routes_are_checked() {
        let route = |extra: &str| {
            format!("[[routes]]\nname=\"s\"\nsink=\"local\"\ntarget=\"events\"\n{extra}")
        };
        let ok = from_toml(&route(
            "push=\"xadd\"\ntrim_max_len=1000\ntrim_max_age=\"24h\"",
        ))
        .expect("a stream route with trimming");
        assert_eq!(ok.routes[0].push, Push::Xadd);
        assert_eq!(
            ok.routes[0].trim(),
            Some(StreamTrim {
                max_len: Some(1000),
                max_age_ms: Some(86_400_000)
            })
        );
        assert_eq!(
            from_toml(&route("push=\"xadd\"")).unwrap().routes[0].trim(),
            None
        );
        assert!(
            err(&route("trim_max_len=10"))
                .contains("routes[0] (s).trim_max_len: trims a stream: it applies with push")
        );
        assert!(err(&route("push=\"rpush\"\ntrim_max_age=\"1h\"")).contains("trim_max_age"));
        assert!(err(&route("push=\"xadd\"\ntrim_max_len=0")).contains("at least 1"));
        assert!(
            err("[sinks.k]\nkind=\"kafka\"\nbrokers=\"127.0.0.1:9092\"\n[[routes]]\nname=\"s\"\nsink=\"k\"\ntarget=\"t\"\npush=\"xadd\"")
                .contains("needs a redis sink")
        );
        assert!(
            err(&format!(
                "{}\n[[sources]]\nkey=\"raw\"\nroute=\"s\"",
                route("push=\"xadd\"")
            ))
            .contains("appends to a stream")
        );
        for push in [Push::Lpush, Push::Rpush, Push::Xadd] {
            assert_eq!(Push::from_command(push.command()), Some(push));
        }
        assert_eq!(Push::from_command("SADD"), None);
    }

    #[test]
    fn parse_errors_say_where_and_what_is_allowed_in_toml_words() {
        for (toml, says) in [
            (
                "[poller]\nbatchh = 3",
                "poller.batchh: unknown field: [poller] takes batch,",
            ),
            (
                "[poller]\n\nbatch = \"x\"",
                "\"x\" is not allowed: expected a whole number",
            ),
            (
                "[[routes]]\nname=\"a\"\nsink=\"local\"\ntarget=\"q\"\npush=\"up\"",
                "lpush, rpush",
            ),
            (
                "[sinks.k]\nkind=\"kafka\"\nbrokers=\"b\"\nkey=1",
                "sinks.k.key: 1 is not allowed",
            ),
        ] {
            let e = err(toml);
            let line = toml.lines().count();
            assert!(e.contains(says), "{toml}: {e}");
            assert!(
                e.contains(&format!("(the config text line {line})")),
                "{toml}: {e}"
            );
            assert!(
                !e.contains("::") && !e.contains(".rs") && !e.contains("Value"),
                "{e}"
            );
        }
    }

    #[test]
    fn secrets_accept_numbers_and_hide() {
        let c = from_toml("[redis]\npassword = 123456").unwrap();
        assert_eq!(c.redis.password.as_ref().unwrap().expose(), "123456");
        assert_eq!(format!("{:?}", c.redis.password.unwrap()), "***");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
    fn upper_case_environment_overrides_apply_and_others_are_ignored() {
        figment::Jail::expect_with(|jail| {
            jail.set_env("ZDELAY_POLLER__BATCH", "250");
            jail.set_env("ZDELAY_REDIS__URL", "redis://127.0.0.1:7000");
            jail.set_env("ZDELAY_REDIS__PASSWORD", "123456");
            jail.set_env("ZDELAY_CONFIG", "/not/a/config/key");
            jail.set_env("ZDELAY_TEST_REDIS_URL", "ignored");
            jail.set_env("ZDELAY_TRACING__SERVICE_NAME", "from-env");
            let c = load(None).map_err(|e| e.to_string())?;
            assert_eq!(c.tracing.service_name, "from-env");
            let flag = load_with_redis_url(None, Some("redis://127.0.0.1:7001"))
                .map_err(|e| e.to_string())?;
            assert_eq!(flag.redis.url, "redis://127.0.0.1:7001", "the flag wins");
            assert_eq!(c.poller.batch, 250);
            assert_eq!(c.redis.url, "redis://127.0.0.1:7000");
            assert_eq!(c.redis.password.unwrap().expose(), "123456");
            Ok(())
        });
    }

    #[test]
    fn sink_names_must_fit_an_environment_variable() {
        let sink = |name: &str| {
            from_toml(&format!(
                "[sinks.{name}]\nkind = \"nats\"\nurl = \"nats://127.0.0.1:4222\""
            ))
        };
        assert!(sink("orders_eu2").is_ok());
        for bad in ["\"orders-eu\"", "Orders", "\"2nd\"", "\"a.b\""] {
            let e = sink(bad).unwrap_err().to_string();
            assert!(e.contains("lowercase letters, digits and _"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_config_section_can_come_from_the_environment() {
        let default = serde_json::to_value(Config::default()).unwrap();
        let mut fields: Vec<&str> = default
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut sections = SECTIONS.to_vec();
        fields.sort_unstable();
        sections.sort_unstable();
        assert_eq!(fields, sections);
    }

    #[test]
    fn urls_are_redacted_for_messages() {
        assert_eq!(redact_url("nats://u:p@h:4222"), "nats://u:***@h:4222");
        assert_eq!(
            redact_url("nats://h:1,nats://t@h:2"),
            "nats://h:1,nats://***@h:2"
        );
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn secret_fields_come_from_files_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, content: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            path.display().to_string()
        };
        let pw = file("pw", "from-a-file\n");
        let url = file("url", "nats://u:filepass@127.0.0.1:4222\r\n");
        let kafka = file("kafka", "kafkafilepw");
        let c = from_toml(&format!(
            "[redis]\npassword_file = {pw:?}\n[sinks.n]\nkind = \"nats\"\nurl_file = {url:?}\n\
             [sinks.k]\nkind = \"kafka\"\nbrokers = \"b:1\"\n\
             librdkafka.\"sasl.password_file\" = {kafka:?}\n"
        ))
        .unwrap();
        assert_eq!(c.redis.password.unwrap().expose(), "from-a-file");
        let Some(SinkConfig::Nats(n)) = c.sinks.get("n") else {
            panic!("nats sink")
        };
        assert_eq!(n.url.expose(), "nats://u:filepass@127.0.0.1:4222");
        let Some(SinkConfig::Kafka(k)) = c.sinks.get("k") else {
            panic!("kafka sink")
        };
        assert_eq!(k.librdkafka["sasl.password"], "kafkafilepw");
        assert_eq!(redact_known("x filepass kafkafilepw y"), "x *** *** y");
    }

    #[test]
    fn file_references_fail_clearly() {
        let both = err("[redis]\npassword = \"a\"\npassword_file = \"/x\"");
        assert!(both.contains("redis.password_file") && both.contains("redis.password is set too"));
        let missing = err("[redis]\npassword_file = \"/nonexistent/pw\"");
        assert!(
            missing.contains("redis.password_file") && missing.contains("/nonexistent/pw"),
            "{missing}"
        );
        // Paths in [redis.tls] are not references.
        let c = from_toml("[redis.tls]\nca_file = \"/ca.pem\"").unwrap();
        assert_eq!(c.redis.tls.ca_file.unwrap(), Path::new("/ca.pem"));
        assert!(err("[redis.tls]\ncert_file = \"/c.pem\"").contains("key_file"));
    }

    #[test]
    fn secrets_show_redacted() {
        let c = from_toml(
            "[redis]\nurl = \"redis://app:urlpw1234@127.0.0.1:6379\"\n\
             [sinks.a]\nkind = \"amqp\"\nurl = \"amqp://guest:amqppw99@127.0.0.1:5672/%2f\"",
        )
        .unwrap();
        let shown = serde_json::to_string(&c).unwrap();
        assert!(shown.contains("redis://app:***@127.0.0.1:6379"), "{shown}");
        assert!(shown.contains("amqp://guest:***@127.0.0.1:5672"), "{shown}");
        assert!(!shown.contains("urlpw1234") && !shown.contains("amqppw99"));
        assert_eq!(redact_url("nats://tok3n@h:1"), "nats://***@h:1");
        assert_eq!(
            redact_known("at redis://app:urlpw1234@h"),
            "at redis://app:***@h"
        );
    }

    #[test]
    fn instance_ids_are_checked() {
        let c = from_toml("[poller]\ninstance_id = \"zdelay-7d9f-x2q4.worker_1\"").unwrap();
        assert_eq!(
            c.poller.instance_id.as_deref(),
            Some("zdelay-7d9f-x2q4.worker_1")
        );
        assert_eq!(from_toml("").unwrap().poller.instance_id, None);
        for bad in ["", "a b", "a:b", "é", &"x".repeat(254)] {
            let e = err(&format!("[poller]\ninstance_id = {bad:?}"));
            assert!(e.contains("poller.instance_id"), "{bad:?}: {e}");
        }
        assert!(valid_instance_id(&"x".repeat(253)));
    }

    #[test]
    fn kafka_message_timeout_must_fit_in_the_publish_deadline() {
        let kafka = |lease: &str, option: &str| {
            format!(
                "[poller]\nlease = \"{lease}\"\n[sinks.k]\nkind = \"kafka\"\nbrokers = \"b:9092\"\n\
                 librdkafka.{option}\n"
            )
        };
        // Default lease 30s: 25 s to publish.
        assert_eq!(
            PollerConfig::default().publish_deadline(),
            Duration::from_secs(25)
        );
        from_toml(&kafka("30s", "\"message.timeout.ms\" = \"25000\"")).unwrap();
        let e = err(&kafka("30s", "\"message.timeout.ms\" = \"25001\""));
        assert!(
            e.contains("sinks.k.librdkafka.\"message.timeout.ms\"")
                && e.contains("publish deadline of 25000 ms"),
            "{e}"
        );
        // A short lease keeps a quarter for the settle.
        let e = err(&kafka("4s", "\"delivery.timeout.ms\" = \"3500\""));
        assert!(
            e.contains("sinks.k.librdkafka.\"delivery.timeout.ms\"") && e.contains("3000 ms"),
            "{e}"
        );
        assert!(err(&kafka("4s", "\"message.timeout.ms\" = \"0\"")).contains("0 means never"));
        assert!(err(&kafka("4s", "\"message.timeout.ms\" = \"soon\"")).contains("not a number"));
        from_toml(&kafka("4s", "\"linger.ms\" = \"5\"")).unwrap();
    }

    #[test]
    fn credentials_in_a_url_path_or_query_are_redacted() {
        for (url, shown) in [
            (
                "https://otlp.example/v1/traces?api_key=K3y-123&tenant=acme",
                "https://otlp.example/v1/traces?api_key=***&tenant=acme",
            ),
            (
                "unix:///run/redis.sock?db=1&pass=hunter22",
                "unix:///run/redis.sock?db=1&pass=***",
            ),
            (
                "https://h/x?X-Amz-Credential=AKIA1%2F2&X-Amz-Signature=abcd1234#frag",
                "https://h/x?X-Amz-Credential=***&X-Amz-Signature=***#frag",
            ),
            (
                "https://u:pw12@h:1/hooks/token/T0KEN-VALUE/more",
                "https://u:***@h:1/hooks/token/***/more",
            ),
            ("http://h/p;password=abc123/q", "http://h/p;password=***/q"),
            (
                "amqp://h:5672/%2f?heartbeat=10",
                "amqp://h:5672/%2f?heartbeat=10",
            ),
            ("redis://h:6379/0", "redis://h:6379/0"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        register_secret("https://otlp.example/v1?access_key=Q9-query-secret");
        assert_eq!(
            redact_known("GET /v1?access_key=Q9-query-secret failed; Q9-query-secret"),
            "GET /v1?access_key=*** failed; ***"
        );
    }

    #[test]
    fn escaped_secrets_are_redacted_in_json_and_debug_output() {
        let secret = "pa\"ss\\w0rd";
        register_secret(secret);
        let line = serde_json::json!({
            "fields": { "message": format!("auth failed with {secret}"), "error": format!("{secret:?}") }
        })
        .to_string();
        assert!(
            line.contains(r#"pa\"ss\\w0rd"#),
            "the form JSON logs print: {line}"
        );
        let shown = redact_known(&line);
        assert!(!shown.contains("w0rd"), "{shown}");
        assert!(
            serde_json::from_str::<serde_json::Value>(&shown).is_ok(),
            "{shown}"
        );
        assert_eq!(
            redact_known(&format!("error: {:?}", format!("x {secret} y"))),
            r#"error: "x *** y""#
        );
    }

    #[test]
    fn missing_file_is_an_error() {
        let e = load(Some(Path::new("/nonexistent/zdelay.toml"))).unwrap_err();
        assert!(e.to_string().contains("does not exist"));
    }
}
