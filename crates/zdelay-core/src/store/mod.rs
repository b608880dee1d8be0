//! The one module that talks to Redis as zdelay's store: the connection type, the schema
//! check, the server's clock, and (in `scripts`) one typed function per Lua script. Nothing
//! outside this module builds KEYS or ARGV or calls EVAL.
//!
//! [`Conn`] is a multiplexed, self-reconnecting connection that is cheap to clone, to one
//! Redis or to a Redis Cluster (`redis.cluster_nodes`); it implements
//! `redis::aio::ConnectionLike`, so plain commands work on it too. On a cluster every
//! command and script call touches one slot (a shard's keys share its hash tag); MOVED, ASK
//! and failover are the cluster client's job.

pub mod clock;
pub mod functions;
pub mod lanes;
#[cfg(test)]
mod lua_bounds;
pub mod relocate;
pub mod scripts;

use crate::config::{RedisConfig, redact_url};
use crate::keys::{Keys, LAYOUT, LEGACY_LAYOUT};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, Pipeline, RedisFuture, Value};
use std::sync::LazyLock;
use std::time::Duration;

/// Why the store cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A producer ([`crate::Client::open`]) found no `<ns>:schema`: no daemon has created the
    /// namespace yet, and a producer does not create one (it would pick the shard count).
    #[error(
        "namespace {namespace} does not exist yet: a zdelay daemon (zdelay run) creates it \
         when it starts, with the shard count of its config; start one, or check \
         redis.namespace"
    )]
    NoNamespace { namespace: String },
    #[error("cannot use redis at {url}: {}", tls_hint(source))]
    Connect {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    /// The server refused the credentials (or wanted some): retrying cannot help until the
    /// password, the ACL user or the server's ACL changes.
    #[error(
        "redis at {url}: authentication failed for {}: check the user and password \
         (redis.url, redis.password or redis.password_file) and the server's ACL",
        user.as_deref().map_or("the default user".to_owned(), |u| format!("user {u}"))
    )]
    Auth { url: String, user: Option<String> },
    /// `[redis.tls]` cannot be used (a file missing or not PEM).
    #[error("{0}")]
    Tls(String),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("{0}")]
    Schema(String),
    #[error("{0}")]
    Unsupported(String),
    /// `zdelay reshard` is moving the namespace to another shard count: the refused script
    /// wrote nothing. Retryable once the reshard has finished.
    #[error(
        "namespace {namespace} is being resharded from {from} to {to} shards (zdelay reshard): \
         retry once the reshard has finished"
    )]
    Resharding {
        namespace: String,
        from: u16,
        to: u16,
    },
    /// The namespace now has `shards` shards and this process was set up with `configured`.
    #[error(
        "namespace {namespace} has been resharded to {shards} shards, and this process uses \
         {configured}: set redis.shards = {shards}"
    )]
    Resharded {
        namespace: String,
        shards: u16,
        configured: u16,
    },
    /// The namespace is on storage layout 1, which this build no longer serves: `zdelay
    /// upgrade`, run while the older release's daemons and producers still serve it, moves it
    /// to route lanes. Nothing was written. Not retryable.
    #[error("{}", legacy_message(namespace, *upgrading))]
    LegacyLayout { namespace: String, upgrading: bool },
    /// The namespace, or one of its shards, is on a storage layout this build does not know,
    /// or needs a newer zdelay (`min_version`): nothing was written, and only that version
    /// or a later one can use it. Not retryable.
    #[error("{}", too_new_message(namespace, *layout, min_version.as_ref()))]
    LayoutTooNew {
        namespace: String,
        layout: u32,
        /// The oldest zdelay that may use the namespace, when the namespace names it.
        min_version: Option<semver::Version>,
    },
    /// A request that can only be wrong (a test clock moved by less than 1 ms).
    #[error("{0}")]
    InvalidInput(String),
    /// `zdelay clock` on a namespace created without a test clock. Nothing was written.
    #[error(
        "namespace {namespace} has no test clock: only a namespace created with \
         [testing] clock = true has one, and its clock is Redis TIME"
    )]
    NoTestClock { namespace: String },
    /// A daemon's `[testing] clock` disagrees with the namespace's. Nothing was written.
    #[error("{}", clock_mismatch_message(namespace, *namespace_has_test_clock))]
    ClockMismatch {
        namespace: String,
        namespace_has_test_clock: bool,
    },
}

fn clock_mismatch_message(namespace: &str, has: bool) -> String {
    if has {
        format!(
            "namespace {namespace} was created with a test clock, and this config has \
             [testing] clock = false: a test namespace never serves production; set \
             [testing] clock = true, or use another redis.namespace"
        )
    } else {
        format!(
            "namespace {namespace} was created without a test clock, and this config has \
             [testing] clock = true: a test clock is set when a namespace is created, never \
             on one that may hold jobs; use a new redis.namespace, or remove [testing] clock"
        )
    }
}

/// This build's version: a namespace whose `min_version` is above it is refused. The daemon
/// is released with the same version (a test checks they agree).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

static THIS_VERSION: LazyLock<semver::Version> =
    LazyLock::new(|| semver::Version::parse(VERSION).expect("Cargo versions are semver"));

/// The oldest release that runs route lanes (storage layout 2) and follows `zdelay upgrade`
/// onto them: what a namespace on route lanes asks of the processes that use it
/// (`min_version`), what the upgrade's shard markers name, and what a daemon registered during
/// an upgrade must run. Not this build's version: a release that only changes other things
/// must not refuse the releases that share its storage, or stop them mid-upgrade.
pub const LAYOUT_SINCE: &str = "0.1.0";

static LAYOUT_SINCE_VERSION: LazyLock<semver::Version> =
    LazyLock::new(|| semver::Version::parse(LAYOUT_SINCE).expect("a semver version"));

/// [`LAYOUT_SINCE`], parsed.
pub fn layout_since() -> &'static semver::Version {
    &LAYOUT_SINCE_VERSION
}

/// [`VERSION`], parsed.
pub fn this_version() -> &'static semver::Version {
    &THIS_VERSION
}

/// What [`StoreError::LayoutTooNew`] says: the version to run, when the namespace names one.
fn too_new_message(namespace: &str, layout: u32, min_version: Option<&semver::Version>) -> String {
    match min_version {
        Some(min) => format!(
            "namespace {namespace} needs zdelay {min} or later (storage layout {layout}; this \
             is zdelay {VERSION}): run zdelay {min} or later"
        ),
        None => format!(
            "namespace {namespace} is on storage layout {layout}, which this build (zdelay \
             {VERSION}) does not know (it knows layout {LAYOUT}): run a newer zdelay"
        ),
    }
}

/// What [`StoreError::LegacyLayout`] says: one line, naming `zdelay upgrade`.
fn legacy_message(namespace: &str, upgrading: bool) -> String {
    if upgrading {
        format!(
            "namespace {namespace} is being moved off storage layout 1 by zdelay upgrade: this \
             zdelay ({VERSION}) can use it once the upgrade has finished"
        )
    } else {
        format!(
            "namespace {namespace} is on storage layout 1, which this zdelay ({VERSION}) no \
             longer serves: run zdelay upgrade while the older release's daemons still serve \
             it, then start this one"
        )
    }
}

/// Refuses a namespace whose schema says a layout above this build's or a `min_version`
/// above [`VERSION`] (fields as stored; a layout that is no number is left to the caller's
/// own check, which names it).
fn refuse_newer(
    keys: &Keys,
    layout: Option<&str>,
    min_version: Option<&str>,
) -> Result<(), StoreError> {
    let min_version = match min_version {
        Some(text) => Some(semver::Version::parse(text).map_err(|e| {
            StoreError::Schema(format!(
                "{} field min_version holds {text:?}, not a version ({e})",
                keys.schema()
            ))
        })?),
        None => None,
    };
    let layout_number = layout.and_then(|l| l.parse::<u32>().ok());
    let newer_layout = layout_number.is_some_and(|n| n > LAYOUT);
    let newer_build = min_version
        .as_ref()
        .is_some_and(|min| min.cmp_precedence(&THIS_VERSION).is_gt());
    if newer_layout || newer_build {
        return Err(StoreError::LayoutTooNew {
            namespace: keys.namespace().to_owned(),
            layout: layout_number.unwrap_or(LEGACY_LAYOUT),
            min_version,
        });
    }
    Ok(())
}

impl StoreError {
    /// Whether the same call may succeed later, unchanged: the connection or the server failed
    /// for a moment ([`is_transient`]: dropped, timed out, refused, `BUSY`, `LOADING`, a
    /// cluster failing over, `OOM`), a reshard or an upgrade is running, or the namespace
    /// waits for its first daemon. Not after refused credentials or a wrong config.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Resharding { .. } | StoreError::NoNamespace { .. } => true,
            StoreError::Redis(e) | StoreError::Connect { source: e, .. } => is_transient(e),
            _ => false,
        }
    }

    /// Whether the server refused the credentials.
    pub fn is_auth(&self) -> bool {
        matches!(self, StoreError::Auth { .. })
    }

    /// Classifies a failure to connect to (or first talk with) `cfg`'s Redis: refused
    /// credentials are [`StoreError::Auth`], anything else [`StoreError::Connect`]; the
    /// address is named with its password hidden.
    pub fn connecting(cfg: &RedisConfig, source: redis::RedisError) -> StoreError {
        let url = if cfg.cluster_nodes.is_empty() {
            redact_url(&cfg.url)
        } else {
            redact_url(&cfg.cluster_nodes.join(","))
        };
        if is_auth_error(&source) {
            return StoreError::Auth {
                url,
                user: user_of(cfg),
            };
        }
        StoreError::Connect { url, source }
    }
}

/// Whether `e` says the credentials were refused (`WRONGPASS`, a failed `AUTH`) or missing
/// (`NOAUTH`). The cluster client wraps node errors in text, hence the look at the message.
pub fn is_auth_error(e: &redis::RedisError) -> bool {
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
    {
        return true;
    }
    let text = e.to_string();
    [
        "WRONGPASS",
        "NOAUTH",
        "AuthenticationFailed",
        "authentication failed",
    ]
    .iter()
    .any(|word| text.contains(word))
}

/// Whether `e` is a passing fault of the connection or the server, after which the same call
/// (every zdelay script is safe to re-run) may well succeed: the connection dropped or timed
/// out, or the server was busy (`BUSY` running a script, `LOADING`, `TRYAGAIN`, a cluster
/// failing over, `OOM` until memory is freed).
pub fn is_transient(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
        )
        || matches!(e.code(), Some("BUSY" | "OOM"))
}

/// The ACL user the connection authenticates as (`None`: the default user).
fn user_of(cfg: &RedisConfig) -> Option<String> {
    let url = cfg.cluster_nodes.first().unwrap_or(&cfg.url);
    let (scheme, at) = (url.find("://")?, url.rfind('@')?);
    let userinfo = url.get(scheme + 3..at)?;
    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
    (!user.is_empty()).then(|| user.to_owned())
}

/// A connect error, with a word on TLS when the handshake failed on a certificate (rustls
/// says `invalid peer certificate: UnknownIssuer`).
fn tls_hint(e: &redis::RedisError) -> String {
    let text = e.to_string();
    let lower = text.to_lowercase();
    if lower.contains("certificate") || lower.contains("handshake") {
        format!(
            "TLS handshake failed ({text}): check redis.tls.ca_file (the CA that signed the \
             server's certificate) and, if the server requires client certificates, \
             redis.tls.cert_file and key_file"
        )
    } else {
        text
    }
}

/// What a shard's layout marker (`{ns:s}:shards`, [`Keys::layout`]) says, and what a
/// script's layout fence answered: the error `ZDELAY_RESHARDED <shards>`,
/// `ZDELAY_MIGRATING <from> <to>` or `ZDELAY_LAYOUT <layout> <min version>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// The namespace has this many shards.
    Shards(u16),
    /// `zdelay reshard` is moving it from `from` to `to` shards.
    Migrating { from: u16, to: u16 },
    /// A newer storage layout owns the shard, or is being moved into it: the marker
    /// `layout <layout> <min version>`, or `upgrading <layout> <min version>` while the
    /// upgrade runs. This build may not touch it either way, and both read as this variant.
    Newer {
        layout: u32,
        min_version: semver::Version,
    },
}

impl Layout {
    /// The marker's value: `"8"`, `"migrating 4 8"` or `"layout 2 0.3.0"`.
    pub fn marker(&self) -> String {
        match self {
            Layout::Shards(n) => n.to_string(),
            Layout::Migrating { from, to } => format!("migrating {from} {to}"),
            Layout::Newer {
                layout,
                min_version,
            } => format!("layout {layout} {min_version}"),
        }
    }

    /// Reads a marker's value.
    pub fn parse(marker: &str) -> Option<Layout> {
        if let Some(rest) = marker.strip_prefix("migrating ") {
            let (from, to) = rest.split_once(' ')?;
            return Some(Layout::Migrating {
                from: from.parse().ok()?,
                to: to.parse().ok()?,
            });
        }
        if let Some(rest) = marker
            .strip_prefix("layout ")
            .or_else(|| marker.strip_prefix("upgrading "))
        {
            return Layout::newer(rest);
        }
        marker.parse().ok().map(Layout::Shards)
    }

    /// `<layout> <min version>`, as a marker and a `ZDELAY_LAYOUT` error carry it.
    fn newer(text: &str) -> Option<Layout> {
        let (layout, min_version) = text.split_once(' ')?;
        Some(Layout::Newer {
            layout: layout.parse().ok()?,
            min_version: semver::Version::parse(min_version).ok()?,
        })
    }

    /// The layout a script's fence refused the call with, if `e` is such a refusal. A
    /// `ZDELAY_RESHARDED` that carries a newer layout's marker (what the scripts of builds
    /// that predate `ZDELAY_LAYOUT` answer) reads as that layout.
    pub fn of_error(e: &redis::RedisError) -> Option<Layout> {
        let detail = e.detail().unwrap_or_default().trim();
        match e.code()? {
            "ZDELAY_RESHARDED" => match Layout::parse(detail)? {
                Layout::Migrating { .. } => None,
                layout => Some(layout),
            },
            "ZDELAY_MIGRATING" => Layout::parse(&format!("migrating {detail}")),
            "ZDELAY_LAYOUT" => Layout::newer(detail),
            _ => None,
        }
    }

    /// The error a process set up with `keys` reports for this layout.
    pub fn error(&self, keys: &Keys) -> StoreError {
        match self {
            Layout::Migrating { from, to } => StoreError::Resharding {
                namespace: keys.namespace().to_owned(),
                from: *from,
                to: *to,
            },
            Layout::Shards(shards) => StoreError::Resharded {
                namespace: keys.namespace().to_owned(),
                shards: *shards,
                configured: keys.shards(),
            },
            Layout::Newer {
                layout,
                min_version,
            } => StoreError::LayoutTooNew {
                namespace: keys.namespace().to_owned(),
                layout: *layout,
                min_version: Some(min_version.clone()),
            },
        }
    }
}

/// `<ns>:schema` as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema {
    pub layout: Option<String>,
    pub shards: Option<u16>,
    /// `(from, to)` while `zdelay reshard` runs.
    pub migrating: Option<(u16, u16)>,
    /// The job counts taken when the running reshard froze the namespace.
    pub migrating_counts: Option<String>,
    /// The oldest zdelay that may use the namespace (written by the build that moves it to a
    /// newer layout).
    pub min_version: Option<semver::Version>,
    /// The layout `zdelay upgrade` is moving the namespace to (`layout` is still the old one).
    pub upgrading: Option<u32>,
    /// `(from, to)` while `zdelay reshard` moves a layout-2 namespace's spread shards online
    /// (`shards` says `to` already: new work goes there).
    pub resharding: Option<(u16, u16)>,
    /// `clock` as stored: `test` on a namespace with a test clock.
    pub clock: Option<String>,
}

/// Reads `<ns>:schema` (every field absent when it does not exist), and sets `con`'s clock
/// from it. Refuses a namespace on a newer layout, or that needs a newer zdelay
/// ([`StoreError::LayoutTooNew`]).
pub async fn read_schema(con: &mut Conn, keys: &Keys) -> Result<Schema, StoreError> {
    // One HGET a field, pipelined: the producer's ACL grants HGET, not HMGET.
    let mut pipe = redis::pipe();
    for field in [
        "layout",
        "shards",
        "migrating",
        "migrating_counts",
        "min_version",
        "upgrading",
        "resharding",
        clock::CLOCK_FIELD,
    ] {
        pipe.hget(keys.schema(), field);
    }
    let [
        layout,
        shards,
        migrating,
        counts,
        min_version,
        upgrading,
        resharding,
        stored_clock,
    ]: [Option<String>; 8] = pipe.query_async(con).await?;
    con.clock = clock::Clock::of(keys, stored_clock.as_deref());
    refuse_newer(keys, layout.as_deref(), min_version.as_deref())?;
    let bad = |field: &str, value: &str| {
        StoreError::Schema(format!(
            "{} field {field} holds {value:?}, not what zdelay writes",
            keys.schema()
        ))
    };
    let shards = match shards {
        Some(s) => Some(s.parse::<u16>().map_err(|_| bad("shards", &s))?),
        None => None,
    };
    let migrating = match migrating {
        Some(m) => match Layout::parse(&format!("migrating {m}")) {
            Some(Layout::Migrating { from, to }) => Some((from, to)),
            _ => return Err(bad("migrating", &m)),
        },
        None => None,
    };
    let upgrading = match upgrading {
        Some(u) => Some(u.parse::<u32>().map_err(|_| bad("upgrading", &u))?),
        None => None,
    };
    let resharding = match resharding {
        Some(r) => match Layout::parse(&format!("migrating {r}")) {
            Some(Layout::Migrating { from, to }) => Some((from, to)),
            _ => return Err(bad("resharding", &r)),
        },
        None => None,
    };
    Ok(Schema {
        layout,
        shards,
        migrating,
        migrating_counts: counts,
        min_version: min_version.and_then(|v| semver::Version::parse(&v).ok()),
        upgrading,
        resharding,
        clock: stored_clock,
    })
}

/// The oldest Redis this build is tested with and supports (Debian 12 ships 7.0.15; Valkey
/// reports a Redis-compatible version, 7.2.4, beside its own).
pub const MIN_REDIS: (u32, u32) = (7, 0);

/// A connection to the scheduling Redis or Redis Cluster. Clones share one multiplexed
/// connection.
#[derive(Clone)]
pub struct Conn {
    inner: Inner,
    /// The cluster slot of the namespace's schema key: where node-wide commands (`INFO`,
    /// `TIME`) go, so they only depend on the node start-up needs anyway.
    home_slot: u16,
    /// What "now" is on the namespace (set by [`ensure_schema`]; clones share it): the script
    /// wrappers pass a test clock's time to the scripts that read it.
    clock: clock::Clock,
}

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

fn home_slot(cfg: &RedisConfig) -> u16 {
    crate::keys::slot_of(&Keys::new(&cfg.namespace, cfg.shards).schema())
}

/// How long one command may take before it counts as failed (a hung node must not stall a
/// caller for ever; the cluster client has no default).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Per cluster node: a connection meets every node (the client connects to all of them), so a
/// hung one costs each new connection this much, twice (seeds, then the slot map).
const CLUSTER_NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

impl Conn {
    /// What "now" is on the namespace this connection serves.
    pub fn clock(&self) -> &clock::Clock {
        &self.clock
    }

    /// The scripts' "now" override: `None` (Redis TIME, no I/O) without a test clock, the test
    /// clock's time (one round trip) with one; `at` (tests) wins.
    pub async fn script_now_ms(&mut self, at: Option<i64>) -> redis::RedisResult<Option<i64>> {
        if at.is_some() {
            return Ok(at);
        }
        let clock = self.clock.clone();
        clock.script_now_ms(self).await
    }

    /// The namespace's now, ms: Redis TIME plus a test clock's offset.
    pub async fn now_ms(&mut self) -> redis::RedisResult<i64> {
        let clock = self.clock.clone();
        Ok(clock.read(self).await?.now_ms())
    }

    /// The test clock's offset, ms (0 without one, no I/O).
    pub async fn clock_offset_ms(&mut self) -> redis::RedisResult<i64> {
        let clock = self.clock.clone();
        clock.offset_ms(self).await
    }

    /// Connects once (bounded), with the `[redis]` password override applied: to
    /// `cluster_nodes` when set, else to `url`. The error names the address with any
    /// password hidden.
    pub async fn connect(cfg: &RedisConfig) -> Result<Conn, StoreError> {
        if !cfg.cluster_nodes.is_empty() {
            return Self::connect_cluster(cfg).await;
        }
        let connect_error = |source| StoreError::connecting(cfg, source);
        let client = client(cfg)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let inner = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(connect_error)?;
        let mut con = Conn {
            inner: Inner::Single(inner),
            home_slot: home_slot(cfg),
            clock: clock::Clock::Redis,
        };
        con.ping(cfg).await?;
        Ok(con)
    }

    /// One `PING`: a server that wants a password zdelay did not give answers `NOAUTH` here,
    /// not at some later command.
    async fn ping(&mut self, cfg: &RedisConfig) -> Result<(), StoreError> {
        let ping = redis::cmd("PING");
        self.on_one_node(ping)
            .await
            .map(drop)
            .map_err(|e| StoreError::connecting(cfg, e))
    }

    async fn connect_cluster(cfg: &RedisConfig) -> Result<Conn, StoreError> {
        let connect_error = |source| StoreError::connecting(cfg, source);
        let mut builder = redis::cluster::ClusterClient::builder(cfg.cluster_nodes.clone())
            .connection_timeout(CLUSTER_NODE_CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .retries(4);
        if let Some(password) = &cfg.password {
            builder = builder.password(password.expose());
        }
        if cfg.cluster_nodes.iter().any(|n| n.starts_with("rediss://")) {
            install_crypto_provider();
            if cfg.tls.insecure_skip_verify {
                // Set before the certificates, which would otherwise choose verified TLS.
                builder = builder.tls(redis::TlsMode::Insecure);
            }
            builder = builder.certs(tls_certificates(&cfg.tls)?);
        }
        let client = builder.build().map_err(connect_error)?;
        // The initial connect has no overall bound of its own (redis-rs #1953).
        let inner = tokio::time::timeout(CONNECT_TIMEOUT * 3, client.get_async_connection())
            .await
            .map_err(|_| {
                connect_error(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no cluster node answered in time",
                )))
            })?
            .map_err(connect_error)?;
        let mut con = Conn {
            inner: Inner::Cluster(inner),
            home_slot: home_slot(cfg),
            clock: clock::Clock::Redis,
        };
        con.ping(cfg).await?;
        Ok(con)
    }

    /// Whether this is a Redis Cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner, Inner::Cluster(_))
    }

    /// Runs `cmd` on every primary (a cluster's masters, or the one server); fails if any
    /// does. For `SCRIPT LOAD` and the like.
    pub async fn on_every_primary(&mut self, cmd: Cmd) -> redis::RedisResult<Value> {
        match &mut self.inner {
            Inner::Single(c) => cmd.query_async(c).await,
            Inner::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                c.route_command(cmd, routing).await
            }
        }
    }

    /// Runs `cmd` on every primary and answers each one's reply, error replies included, by
    /// its address (`host:port`; empty on one Redis), for [`Conn::on_primary`] to follow up.
    pub async fn on_each_primary(
        &mut self,
        cmd: Cmd,
    ) -> redis::RedisResult<Vec<(String, redis::RedisResult<Value>)>> {
        match &mut self.inner {
            Inner::Single(c) => Ok(vec![(String::new(), cmd.query_async(c).await)]),
            Inner::Cluster(c) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                // Without a response policy the client answers a map of address → reply.
                let Value::Map(replies) = c.route_command(cmd, routing).await? else {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "a command on every master did not answer per master",
                    )));
                };
                Ok(replies
                    .into_iter()
                    .map(|(node, reply)| {
                        let node = redis::from_redis_value::<String>(node).unwrap_or_default();
                        let reply = match reply {
                            Value::ServerError(e) => Err(e.into()),
                            other => Ok(other),
                        };
                        (node, reply)
                    })
                    .collect())
            }
        }
    }

    /// Runs `cmd` on the primary at `node` as [`Conn::on_each_primary`] named it.
    pub async fn on_primary(&mut self, node: &str, cmd: Cmd) -> redis::RedisResult<Value> {
        match &mut self.inner {
            Inner::Single(c) => cmd.query_async(c).await,
            Inner::Cluster(c) => {
                let (host, port) = node
                    .rsplit_once(':')
                    .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
                    .ok_or_else(|| {
                        redis::RedisError::from((
                            redis::ErrorKind::Client,
                            "not a master's address",
                            node.to_owned(),
                        ))
                    })?;
                let routing =
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                c.route_command(cmd, routing).await
            }
        }
    }

    /// Runs `cmd` on one node: on a cluster the primary of the schema key's slot (`INFO`,
    /// `TIME`).
    pub async fn on_one_node(&mut self, cmd: Cmd) -> redis::RedisResult<Value> {
        let slot = self.home_slot;
        self.on_slot(slot, cmd).await
    }

    /// Runs `cmd` on the primary serving `key`'s slot (the server itself on one Redis): for
    /// `SCRIPT LOAD` where a script was missing, without touching any other node.
    pub async fn on_node_of(&mut self, key: &[u8], cmd: Cmd) -> redis::RedisResult<Value> {
        self.on_slot(crate::keys::slot_of_bytes(key), cmd).await
    }

    async fn on_slot(&mut self, slot: u16, cmd: Cmd) -> redis::RedisResult<Value> {
        match &mut self.inner {
            Inner::Single(c) => cmd.query_async(c).await,
            Inner::Cluster(c) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::new(slot, SlotAddr::Master),
                ));
                c.route_command(cmd, routing).await
            }
        }
    }

    /// A connection of its own (a cluster's requests all wait while its client recovers
    /// from a failed node, so work that must not wait for another's node gets its own); on
    /// one Redis a clone (one server: nothing to isolate).
    pub async fn independent(&self, cfg: &RedisConfig) -> Result<Conn, StoreError> {
        if self.is_cluster() {
            let mut con = Conn::connect(cfg).await?;
            con.clock = self.clock.clone();
            Ok(con)
        } else {
            Ok(self.clone())
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.inner {
            Inner::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            Inner::Single(c) => c.get_db(),
            Inner::Cluster(c) => c.get_db(),
        }
    }
}

/// A redis-rs client for `[redis]` (for pub/sub), with the password override applied.
pub fn client(cfg: &RedisConfig) -> Result<redis::Client, StoreError> {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    let connect_error = |source| StoreError::connecting(cfg, source);
    let mut info = cfg
        .url
        .as_str()
        .into_connection_info()
        .map_err(connect_error)?;
    if let Some(password) = &cfg.password {
        let settings = info
            .redis_settings()
            .clone()
            .set_password(password.expose());
        info = info.set_redis_settings(settings);
    }
    let ConnectionAddr::TcpTls { host, port, .. } = info.addr().clone() else {
        return redis::Client::open(info).map_err(connect_error);
    };
    install_crypto_provider();
    let info = info.set_addr(ConnectionAddr::TcpTls {
        host,
        port,
        insecure: cfg.tls.insecure_skip_verify,
        tls_params: None,
    });
    redis::Client::build_with_tls(info, tls_certificates(&cfg.tls)?).map_err(connect_error)
}

/// rustls needs one process-wide crypto provider; the daemon links two (ring, aws-lc-rs)
/// through the brokers' clients, so none is implied, and a TLS connection made without one
/// panics. Called before every client that may speak TLS; installing twice is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// `[redis.tls]`'s files, read; an error names the field and the path.
fn tls_certificates(
    tls: &crate::config::RedisTlsConfig,
) -> Result<redis::TlsCertificates, StoreError> {
    let read = |field: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            StoreError::Tls(format!(
                "redis.tls.{field}: cannot read {}: {e}",
                path.display()
            ))
        })
    };
    let root_cert = match &tls.ca_file {
        Some(path) => Some(read("ca_file", path)?),
        None => None,
    };
    let client_tls = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("cert_file", cert)?,
            client_key: read("key_file", key)?,
        }),
        _ => None,
    };
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert,
    })
}

/// Clients for pub/sub (which needs its own connection): the one server, or on a cluster
/// each seed node, tried in turn. A message published on any node of a cluster reaches
/// subscribers on every node.
pub fn pubsub_clients(cfg: &RedisConfig) -> Result<Vec<redis::Client>, StoreError> {
    if cfg.cluster_nodes.is_empty() {
        return Ok(vec![client(cfg)?]);
    }
    cfg.cluster_nodes
        .iter()
        .map(|node| {
            client(&RedisConfig {
                url: node.clone(),
                ..cfg.clone()
            })
        })
        .collect()
}

/// Redis `TIME` in µs: the one clock zdelay trusts.
pub async fn server_time_us(con: &mut Conn) -> redis::RedisResult<i64> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(con).await?;
    Ok(secs * 1_000_000 + micros)
}

/// Redis `TIME` in ms.
pub async fn server_time_ms(con: &mut Conn) -> redis::RedisResult<i64> {
    Ok(server_time_us(con).await? / 1000)
}

/// What to do about a Redis older than [`MIN_REDIS`]. Distributions still supported ship
/// Redis 6 (Debian 11, Ubuntu 22.04), and zdelay needs 7.0's Functions and commands.
pub const OLD_REDIS_HINT: &str = "install Redis 7.0 or newer, or Valkey: Debian 12 and Ubuntu \
     24.04 ship Redis 7 (`apt-get install redis-server`); on older distributions use the \
     packages of packages.redis.io or the `redis:7` container image";

/// The server zdelay talks to: its name and version (`redis 7.0.15`, `valkey 9.1.0`) and
/// whether its Redis-compatible version is at least [`MIN_REDIS`].
pub struct Server {
    pub name: String,
    pub supported: bool,
    /// Whether `XADD` takes `IDMP <producer> <id>` (Redis 8.6 and newer): the server itself
    /// drops a repeated append of the same id.
    pub stream_idmp: bool,
}

/// Redis's first version whose `XADD` takes `IDMP`.
pub const STREAM_IDMP_REDIS: (u32, u32) = (8, 6);

/// Whether the server of these `INFO server` fields has `XADD … IDMP`: Redis 8.6 or newer. A
/// Valkey reports a fixed `redis_version` (7.2.4) and has no `IDMP`.
pub fn has_stream_idmp(info: &std::collections::HashMap<String, String>) -> bool {
    !info.contains_key("valkey_version") && redis_version(info) >= STREAM_IDMP_REDIS
}

/// `redis_version` as (major, minor); (0, 0) when absent or unreadable.
fn redis_version(info: &std::collections::HashMap<String, String>) -> (u32, u32) {
    let compatible = info.get("redis_version").map_or("", String::as_str);
    let mut parts = compatible.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

impl Server {
    /// The problem with a server older than [`MIN_REDIS`], without what to do about it.
    pub fn too_old(&self) -> String {
        format!(
            "{} is older than the oldest supported Redis, {}.{}",
            self.name, MIN_REDIS.0, MIN_REDIS.1
        )
    }
}

/// Reads `INFO server`: which server it is, and whether zdelay supports it.
pub async fn probe_server(con: &mut Conn) -> Result<Server, StoreError> {
    let info = info(con, "server").await?;
    Ok(Server {
        name: server_name(&info),
        supported: redis_version(&info) >= MIN_REDIS,
        stream_idmp: has_stream_idmp(&info),
    })
}

/// The server's name and version; an error naming both versions and what to install when
/// the server is older than [`MIN_REDIS`].
pub async fn check_server(con: &mut Conn) -> Result<String, StoreError> {
    let server = probe_server(con).await?;
    if !server.supported {
        return Err(StoreError::Unsupported(format!(
            "{}; {OLD_REDIS_HINT}",
            server.too_old()
        )));
    }
    Ok(server.name)
}

/// The server's name and version from its `INFO server` fields: `valkey 9.1.2` when it has
/// `valkey_version` (Valkey's `redis_version` is a fixed 7.2.4 kept for clients), else
/// `redis <redis_version>`.
pub fn server_name(info: &std::collections::HashMap<String, String>) -> String {
    match info.get("valkey_version") {
        Some(v) => format!("valkey {v}"),
        None => format!(
            "redis {}",
            info.get("redis_version").map_or("?", String::as_str)
        ),
    }
}

/// Creates `<ns>:schema` if missing (on route lanes, with `keys`' shard count) and checks it:
/// returns the namespace's shard count (the stored one: `zdelay reshard` changes it online, so
/// `keys`' count is only what a new namespace gets). Refuses a layout-1 namespace
/// ([`StoreError::LegacyLayout`]: only `zdelay upgrade` reads those), a namespace on a newer
/// layout or that needs a newer zdelay ([`StoreError::LayoutTooNew`]). `test_clock`: a
/// daemon's `[testing] clock`, which a new namespace gets and an existing one must match
/// ([`StoreError::ClockMismatch`], checked before anything is written); `None` (producers)
/// takes the namespace as it is.
pub async fn ensure_schema(
    con: &mut Conn,
    keys: &Keys,
    test_clock: Option<bool>,
) -> Result<u16, StoreError> {
    let key = keys.schema();
    // One HGET each (not HMGET): a producer's narrowest ACL grants `+hget` on the schema.
    let read = |pipe: &mut Pipeline| {
        for field in [
            "layout",
            "shards",
            "min_version",
            "upgrading",
            clock::CLOCK_FIELD,
        ] {
            pipe.hget(&key, field);
        }
    };
    type Fields = (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let mut pipe = redis::pipe();
    read(&mut pipe);
    let mut fields: Fields = pipe.query_async(con).await?;
    // Before writing anything: a newer layout's schema gets no field of this one.
    refuse_newer(keys, fields.0.as_deref(), fields.2.as_deref())?;
    if fields.0.is_some()
        && let Some(wanted) = test_clock
    {
        // An existing namespace keeps the clock it was created with.
        clock::check_wanted(keys, wanted, fields.4.as_deref())?;
    }
    if fields.0.is_none() || fields.1.is_none() {
        // Written only when missing, so a producer whose ACL may only read the schema
        // connects to a namespace a daemon created (HSETNX needs write access even when it
        // writes nothing). Builds that predate route lanes refuse the namespace, naming the
        // version to run.
        let mut pipe = redis::pipe();
        pipe.hset_nx(&key, "layout", LAYOUT)
            .ignore()
            .hset_nx(&key, "shards", keys.shards())
            .ignore()
            .hset_nx(&key, "min_version", LAYOUT_SINCE)
            .ignore();
        if test_clock == Some(true) {
            pipe.hset_nx(&key, clock::CLOCK_FIELD, clock::TEST)
                .ignore()
                .hset_nx(&key, clock::OFFSET_FIELD, 0)
                .ignore();
        }
        read(&mut pipe);
        fields = pipe.query_async(con).await.map_err(|e| {
            if e.code() == Some("NOPERM") {
                StoreError::Schema(format!(
                    "{key} does not exist and this user may not create it ({e}): start a \
                     daemon on namespace {} first",
                    keys.namespace()
                ))
            } else {
                e.into()
            }
        })?;
    }
    let (layout, shards, min_version, upgrading, stored_clock) = fields;
    refuse_newer(keys, layout.as_deref(), min_version.as_deref())?;
    check_layout_field(keys, layout.as_deref(), upgrading.is_some())?;
    if let Some(wanted) = test_clock {
        // Read again after the creation: another process may have created it first.
        clock::check_wanted(keys, wanted, stored_clock.as_deref())?;
    }
    con.clock = clock::Clock::of(keys, stored_clock.as_deref());
    match shards.as_deref().and_then(|s| s.parse::<u16>().ok()) {
        Some(n) if (1..=crate::config::MAX_SHARDS).contains(&n) => Ok(n),
        _ => Err(StoreError::Schema(format!(
            "{key} field shards holds {:?}, not a shard count",
            shards.unwrap_or_default()
        ))),
    }
}

/// Refuses a schema whose `layout` is not this build's: layout 1 (also while `zdelay upgrade`
/// moves it) with [`StoreError::LegacyLayout`], anything else as unreadable.
pub fn check_layout_field(
    keys: &Keys,
    layout: Option<&str>,
    upgrading: bool,
) -> Result<(), StoreError> {
    match layout.map(str::parse::<u32>) {
        Some(Ok(LAYOUT)) => Ok(()),
        Some(Ok(LEGACY_LAYOUT)) => Err(StoreError::LegacyLayout {
            namespace: keys.namespace().to_owned(),
            upgrading,
        }),
        _ => Err(StoreError::Schema(format!(
            "{} says layout {:?}; this build knows layout {LAYOUT}",
            keys.schema(),
            layout.unwrap_or_default()
        ))),
    }
}

/// On a namespace on layout 2, marks every layout-1 shard (`layout 2 <this version>`), so
/// that every layout-1 script of an older process refuses it instead of writing where
/// nothing reads. The daemon writes them at every start (a SET of the same value); a
/// producer never needs to. Nothing while `zdelay upgrade` runs.
pub async fn mark_layout_1_shards(con: &mut Conn, keys: &Keys) -> Result<(), StoreError> {
    let layout = LAYOUT;
    // While `zdelay upgrade` runs (`layout` is still 1 in the schema) the layout-1 shards
    // hold jobs it has not moved yet: the upgrade retires each once it is empty.
    let schema = read_schema(con, keys).await?;
    if schema.layout.as_deref() != Some(&layout.to_string()) || schema.upgrading.is_some() {
        return Ok(());
    }
    let marker = Layout::Newer {
        layout,
        min_version: layout_since().clone(),
    }
    .marker();
    let keys = keys.layout_1();
    for shard in 0..keys.shards() {
        // One command a shard: on a cluster each marker is in its shard's slot.
        let _: () = redis::cmd("SET")
            .arg(keys.layout(shard))
            .arg(&marker)
            .query_async(con)
            .await?;
    }
    Ok(())
}

/// Which master serves which slots (`CLUSTER SLOTS`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SlotMasters {
    /// (first slot, last slot, master "host:port").
    ranges: Vec<(u16, u16, String)>,
}

impl SlotMasters {
    pub fn master_of(&self, slot: u16) -> Option<String> {
        self.ranges
            .iter()
            .find(|(first, last, _)| (*first..=*last).contains(&slot))
            .map(|(_, _, master)| master.clone())
    }

    fn parse(reply: Value) -> redis::RedisResult<SlotMasters> {
        let rows: Vec<Vec<Value>> = redis::from_redis_value(reply)?;
        let mut ranges = Vec::new();
        for row in rows {
            let mut it = row.into_iter();
            let (Some(first), Some(last), Some(master)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            let first: u16 = redis::from_redis_value(first)?;
            let last: u16 = redis::from_redis_value(last)?;
            let node: Vec<Value> = redis::from_redis_value(master)?;
            let mut node = node.into_iter();
            let host: String = redis::from_redis_value(node.next().unwrap_or_default())?;
            let port: u16 = redis::from_redis_value(node.next().unwrap_or_default())?;
            ranges.push((first, last, format!("{host}:{port}")));
        }
        Ok(SlotMasters { ranges })
    }
}

/// The cluster's slot map as one node sees it (empty on one Redis).
pub async fn slot_masters(con: &mut Conn) -> redis::RedisResult<SlotMasters> {
    if !con.is_cluster() {
        return Ok(SlotMasters::default());
    }
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SLOTS");
    SlotMasters::parse(con.on_one_node(cmd).await?)
}

/// `INFO <section>` as key → value (of one node, on a cluster).
pub async fn info(
    con: &mut Conn,
    section: &str,
) -> redis::RedisResult<std::collections::HashMap<String, String>> {
    let mut cmd = redis::cmd("INFO");
    cmd.arg(section);
    let text: String = redis::from_redis_value(con.on_one_node(cmd).await?)?;
    Ok(parse_info(&text))
}

/// Parses `INFO` text (and `/proc` files of the same `key: value` shape).
pub fn parse_info(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_idmp_is_redis_8_6_and_newer_never_valkey() {
        let info = |fields: &[(&str, &str)]| {
            fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<std::collections::HashMap<_, _>>()
        };
        for (version, idmp) in [
            ("7.0.15", false),
            ("8.4.0", false),
            ("8.5.9", false),
            ("8.6.0", true),
            ("8.10.1", true),
            ("9.0.0", true),
            ("", false),
            ("garbage", false),
        ] {
            assert_eq!(
                has_stream_idmp(&info(&[("redis_version", version)])),
                idmp,
                "{version}"
            );
        }
        let valkey = info(&[("redis_version", "9.9.9"), ("valkey_version", "9.1.2")]);
        assert!(!has_stream_idmp(&valkey));
    }

    #[test]
    fn slot_masters_parse() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7003),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node("10.0.0.2", 7001),
            ]),
        ]);
        let masters = SlotMasters::parse(reply).unwrap();
        assert_eq!(masters.master_of(0).as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(masters.master_of(5460).as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(masters.master_of(5461).as_deref(), Some("10.0.0.2:7001"));
        assert_eq!(SlotMasters::default().master_of(3), None);
    }

    #[test]
    fn info_parses() {
        let info = parse_info("# CPU\r\nused_cpu_sys:1.50\r\nused_cpu_user:2.25\r\n");
        assert_eq!(info["used_cpu_sys"], "1.50");
        assert_eq!(info["used_cpu_user"], "2.25");
    }

    #[test]
    fn server_name_prefers_valkey_version() {
        let valkey = parse_info(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n",
        );
        assert_eq!(server_name(&valkey), "valkey 9.1.2");
        let redis = parse_info("# Server\r\nredis_version:7.0.15\r\n");
        assert_eq!(server_name(&redis), "redis 7.0.15");
    }

    fn newer(layout: u32, min_version: &str) -> Layout {
        Layout::Newer {
            layout,
            min_version: semver::Version::parse(min_version).unwrap(),
        }
    }

    #[test]
    fn layout_markers_round_trip() {
        for layout in [
            Layout::Shards(8),
            Layout::Migrating { from: 4, to: 8 },
            newer(2, "0.3.0"),
            newer(3, "1.0.0-rc.1"),
        ] {
            assert_eq!(Layout::parse(&layout.marker()), Some(layout));
        }
        assert_eq!(newer(2, "0.3.0").marker(), "layout 2 0.3.0");
        // While the upgrade moves a shard in, this build may not touch it either.
        assert_eq!(Layout::parse("upgrading 2 0.3.0"), Some(newer(2, "0.3.0")));
        assert_eq!(Layout::Shards(3).marker(), "3");
        assert_eq!(
            Layout::Migrating { from: 8, to: 3 }.marker(),
            "migrating 8 3"
        );
        for bad in [
            "",
            "x",
            "migrating",
            "migrating 4",
            "migrating a b",
            "70000",
            "layout",
            "layout 2",
            "layout 2 0.3",
            "layout x 0.3.0",
            "upgrading 2 v0.3.0",
            "layout2 0.3.0",
        ] {
            assert_eq!(Layout::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn passing_faults_are_told_from_lasting_ones() {
        let server = |reply: &str| match redis::parse_redis_value(reply.as_bytes()).unwrap() {
            redis::Value::ServerError(e) => redis::RedisError::from(e),
            other => panic!("{other:?}"),
        };
        for transient in [
            server("-BUSY Redis is busy running a script\r\n"),
            server("-LOADING Redis is loading the dataset in memory\r\n"),
            server("-TRYAGAIN Multiple keys request during rehashing of slot\r\n"),
            server("-OOM command not allowed when used memory > 'maxmemory'.\r\n"),
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)),
        ] {
            assert!(is_transient(&transient), "{transient}");
        }
        for lasting in [
            server("-ZDELAY_RESHARDED 8\r\n"),
            server("-NOPERM this user has no permissions\r\n"),
            server("-ERR wrong number of arguments\r\n"),
            redis::RedisError::from((redis::ErrorKind::Client, "refused")),
        ] {
            assert!(!is_transient(&lasting), "{lasting}");
        }
    }

    #[test]
    fn fence_errors_are_recognised() {
        let keys = Keys::new("zdelay", 4);
        // As a script's error reply arrives.
        let err = |code: &str, detail: &str| {
            let reply = format!("-{code} {detail}\r\n");
            match redis::parse_redis_value(reply.as_bytes()).unwrap() {
                redis::Value::ServerError(e) => redis::RedisError::from(e),
                other => panic!("{other:?}"),
            }
        };
        let resharded = err("ZDELAY_RESHARDED", "8");
        assert_eq!(Layout::of_error(&resharded), Some(Layout::Shards(8)));
        let migrating = err("ZDELAY_MIGRATING", "4 8");
        let layout = Layout::of_error(&migrating).unwrap();
        assert_eq!(layout, Layout::Migrating { from: 4, to: 8 });
        assert!(layout.error(&keys).is_retryable());
        assert!(
            Layout::Shards(8)
                .error(&keys)
                .to_string()
                .contains("set redis.shards = 8")
        );
        assert_eq!(Layout::of_error(&err("ERR", "8")), None);

        let too_new = err("ZDELAY_LAYOUT", "2 0.3.0");
        let layout = Layout::of_error(&too_new).unwrap();
        assert_eq!(layout, newer(2, "0.3.0"));
        let error = layout.error(&keys);
        assert!(!error.is_retryable());
        assert!(matches!(
            &error,
            StoreError::LayoutTooNew { layout: 2, min_version: Some(v), .. } if v.to_string() == "0.3.0"
        ));
        assert_eq!(
            error.to_string(),
            format!(
                "namespace zdelay needs zdelay 0.3.0 or later (storage layout 2; this is zdelay \
                 {VERSION}): run zdelay 0.3.0 or later"
            )
        );
        // A build that predates ZDELAY_LAYOUT answers a newer marker as "resharded" to it.
        let old_script = err("ZDELAY_RESHARDED", "layout 2 0.3.0");
        assert_eq!(Layout::of_error(&old_script), Some(newer(2, "0.3.0")));
        let old_script = err("ZDELAY_RESHARDED", "upgrading 2 0.3.0");
        assert_eq!(Layout::of_error(&old_script), Some(newer(2, "0.3.0")));
        // Unreadable: left as the plain Redis error it is.
        assert_eq!(Layout::of_error(&err("ZDELAY_LAYOUT", "2")), None);
        assert_eq!(Layout::of_error(&err("ZDELAY_LAYOUT", "2 soon")), None);
        assert_eq!(
            Layout::of_error(&err("ZDELAY_RESHARDED", "migrating 4 8")),
            None
        );
    }

    #[test]
    fn a_schema_that_needs_a_newer_build_is_refused() {
        let keys = Keys::new("zdelay", 4);
        let refused = |layout: Option<&str>, min: Option<&str>| {
            refuse_newer(&keys, layout, min).map_err(|e| e.to_string())
        };
        // This build's own, or older, or nothing said.
        assert_eq!(refused(Some("1"), None), Ok(()));
        assert_eq!(refused(None, None), Ok(()));
        assert_eq!(refused(Some("1"), Some(VERSION)), Ok(()));
        assert_eq!(refused(Some("1"), Some("0.0.1")), Ok(()));
        // A pre-release of this version is older than it; build metadata does not count.
        let this = THIS_VERSION.clone();
        let pre = format!("{}.{}.{}-rc.1", this.major, this.minor, this.patch);
        assert_eq!(refused(Some("1"), Some(&pre)), Ok(()));
        assert_eq!(
            refused(Some("1"), Some(&format!("{VERSION}+build.7"))),
            Ok(())
        );
        // Newer: by version (compared as versions, not as text), by layout, or both.
        let next_patch = format!("{}.{}.{}", this.major, this.minor, this.patch + 1);
        for min in ["9.9.9", next_patch.as_str(), "0.10.0"] {
            if semver::Version::parse(min).unwrap() <= this {
                continue;
            }
            let e = refused(Some("1"), Some(min)).unwrap_err();
            assert_eq!(
                e,
                format!(
                    "namespace zdelay needs zdelay {min} or later (storage layout 1; this is \
                     zdelay {VERSION}): run zdelay {min} or later"
                )
            );
        }
        let e = refused(Some("2"), Some("9.9.9")).unwrap_err();
        assert!(
            e.contains("needs zdelay 9.9.9 or later (storage layout 2"),
            "{e}"
        );
        // Layout 2 is known; layout 3 is not.
        assert_eq!(refused(Some("2"), None), Ok(()));
        assert_eq!(refused(Some("2"), Some(VERSION)), Ok(()));
        let e = refused(Some("3"), None).unwrap_err();
        assert_eq!(
            e,
            format!(
                "namespace zdelay is on storage layout 3, which this build (zdelay {VERSION}) \
                 does not know (it knows layout 2): run a newer zdelay"
            )
        );
        // A version that is none: named as such.
        let e = refused(Some("1"), Some("0.3")).unwrap_err();
        assert!(
            e.starts_with("zdelay:schema field min_version holds \"0.3\", not a version"),
            "{e}"
        );
        // A layout that is no number is the caller's to name (as before).
        assert_eq!(refused(Some("x"), None), Ok(()));
    }

    #[test]
    fn connect_errors_hide_the_password() {
        let err = StoreError::Connect {
            url: redact_url("redis://:s3cret@127.0.0.1:1"),
            source: redis::RedisError::from((redis::ErrorKind::Io, "refused")),
        };
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
