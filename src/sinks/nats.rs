//! NATS sink: JetStream publish awaiting the PubAck (default), or core NATS as an explicit
//! best-effort option.
//!
//! # Delivery
//! - **JetStream** (`jetstream = true`): every message of a batch is published with its headers
//!   (pipelined: all publishes are sent, then all PubAcks are awaited concurrently). A message is
//!   `Delivered` only once the stream's PubAck came back, i.e. the server stored it.
//! - **Core NATS** (`jetstream = false`): best effort. NATS has no publish confirmation; after
//!   the batch a round trip on the same connection (a request the server answers) proves the
//!   server *read* every message of the batch, so `Delivered` means "the server received it", not
//!   that any subscriber did. A subscriber that is slow, absent or reconnecting loses messages.
//!   A flush is not an ack.
//!
//! # Idempotency and consumer dedupe
//! Every message carries the envelope headers plus `zdelay-id: <id>:<due>` and
//! `Nats-Msg-Id: <id>:<due>` (the same [`Message::idempotency_key`]). zdelay is at-least-once: a
//! crash (or a lost connection) between the publish and the fenced ack in Redis republishes the
//! job with the same key. JetStream drops a message whose `Nats-Msg-Id` it already stored within
//! the stream's `duplicate_window` (default 2 minutes, set per stream) and answers with a PubAck
//! marked `duplicate`, so a redelivery inside the window never reaches consumers twice. Make the
//! window at least the poller's lease plus its retry backoff. Consumers that must be exact
//! beyond the window (or in core NATS mode, which has no dedupe) keep the `zdelay-id` values
//! they processed and drop repeats.
//!
//! # Outcomes (see [`classify`])
//! | cause | outcome |
//! |---|---|
//! | no stream for the subject (no responders, stream not found), confirmed by the JetStream API | Missing |
//! | no responders while the JetStream API does not answer, or names a stream for the subject | Unavailable |
//! | over the server's `max_payload`, stream's max message/header size | Reject |
//! | invalid subject or header, sealed stream, expected-last-* mismatch | Reject |
//! | JetStream not enabled for the account | Reject |
//! | not connected (server down), or an ack timeout while disconnected, or every message of the batch timed out | Unavailable |
//! | credentials refused (authorization violation): "authentication failed for …" | Unavailable |
//! | ack lost with the connection | Unavailable |
//! | other JetStream errors (store failed, resources exceeded, …), a lone timeout | Retry |
//!
//! # Connection
//! The client is created lazily on first use, one bounded connect attempt per publish or check
//! until one succeeds (so building the sink, and starting the daemon, never needs the server),
//! then with unlimited reconnects. `user`/`password`, `token` or `creds_file` authenticate;
//! `tls` requires TLS with the given CA and client certificate. async-nats
//! buffers publishes while it reconnects; to give a bounded answer we check the connection state
//! before sending, watch it while awaiting acks (a lost connection resolves the outstanding
//! acks as `Unavailable` at once) and bound every send and ack by [`ACK_TIMEOUT`]. A message
//! reported `Unavailable` may still sit in the client's buffer and reach the server after the
//! reconnect: that is the at-least-once duplicate the `Nats-Msg-Id` absorbs.

use std::str::FromStr;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::{
    self, ErrorCode,
    context::{PublishAckFuture, PublishErrorKind},
};
use async_nats::{Client, ConnectOptions, HeaderMap, HeaderName, HeaderValue, ServerAddr};
use futures::future::join_all;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Health, IDEMPOTENCY_HEADER, Message, Outcome, SinkError};
use zdelay_core::config::NatsSinkConfig;

/// Bound on one publish send and on waiting for its PubAck (or the core-mode round trip).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a publish waits for a connection that is still being (re)established before it
/// answers `Unavailable`.
pub const CONNECT_WAIT: Duration = Duration::from_secs(1);
/// Bound on [`NatsSink::check`].
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The oldest nats-server this sink is tested with and supports (Debian 12 ships 2.9.10).
pub const MIN_SERVER: (i64, i64, i64) = (2, 9, 0);
/// Messages whose acks are outstanding at once within one `publish` call.
const CHUNK: usize = 1024;
/// JetStream ack permits; far above what concurrent `publish` calls use, so never a limit.
const ACK_PERMITS: usize = 1 << 16;
/// How often the connection state is polled while acks are outstanding.
const STATE_POLL: Duration = Duration::from_millis(20);
/// Reconnect back-off cap (the async-nats default is 4 s).
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// JetStream's dedupe header.
const NATS_MSG_ID: &str = "Nats-Msg-Id";

/// A NATS sink: one client (connected lazily) shared by every publish.
pub struct NatsSink {
    name: String,
    url: String,
    servers: Vec<ServerAddr>,
    jetstream: bool,
    /// `user`/`password`, `token`, `creds_file` and `tls` of the config.
    security: NatsSinkConfig,
    /// Who it authenticates as, for "authentication failed for …" (the URL may say).
    identity: String,
    conn: OnceCell<Conn>,
    /// Whether the health check's surprise was logged already.
    surprised: std::sync::atomic::AtomicBool,
}

struct Conn {
    client: Client,
    js: jetstream::Context,
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("jetstream", &self.jetstream)
            .finish_non_exhaustive()
    }
}

/// The client's connection troubles (a lost connection, each failed reconnect) join the
/// sink's outage episode: logged when they start one, counted while it lasts.
fn episode_events(
    sink: String,
) -> impl Fn(async_nats::Event) -> futures::future::Ready<()> + Send + Sync + 'static {
    move |event| {
        use async_nats::Event as E;
        if matches!(event, E::Disconnected | E::ClientError(_)) {
            crate::metrics::error_event(
                super::handle::UNAVAILABLE,
                &sink,
                &format!("nats client: {event}"),
            );
        }
        futures::future::ready(())
    }
}

impl NatsSink {
    /// Validates the config; does not connect (the first publish or check does, in the
    /// background, retrying until the server is there).
    pub fn new(name: &str, config: &NatsSinkConfig) -> Result<Self, SinkError> {
        let bad = |why: String| SinkError::Config {
            sink: name.to_owned(),
            why,
        };
        let servers = config
            .url
            .expose()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                ServerAddr::from_str(s)
                    .map_err(|e| bad(format!("url {:?}: {e}", crate::config::redact_url(s))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err(bad("url is empty".to_owned()));
        }
        Ok(NatsSink {
            name: name.to_owned(),
            // Only for messages: without credentials.
            url: crate::config::redact_url(config.url.expose()),
            servers,
            jetstream: config.jetstream,
            identity: config.identity(),
            security: NatsSinkConfig {
                url: Default::default(),
                allow: Vec::new(),
                ..config.clone()
            },
            conn: OnceCell::new(),
            surprised: std::sync::atomic::AtomicBool::new(false),
        })
    }

    async fn conn(&self) -> Result<&Conn, String> {
        self.conn
            .get_or_try_init(|| async {
                // async-nats builds its TLS config from the process-wide provider.
                crate::store::install_crypto_provider();
                // No retry_on_initial_connect: async-nats gives up for good on an
                // authorization violation during a background first connect, so the first
                // connect is ours, bounded, and repeated by the next publish or check.
                let client = self
                    .connect_options()
                    .await?
                    .name(format!("zdelay/{}", self.name))
                    .event_callback(episode_events(self.name.clone()))
                    .max_reconnects(None)
                    .connection_timeout(CHECK_TIMEOUT)
                    .reconnect_delay_callback(|attempts| {
                        let ms = 50u64.saturating_mul(1 << attempts.min(10));
                        Duration::from_millis(ms).min(RECONNECT_MAX)
                    })
                    .connect(self.servers.clone())
                    .await
                    .map_err(|e| self.connect_error(&e))?;
                let js = jetstream::ContextBuilder::new()
                    .timeout(ACK_TIMEOUT)
                    .ack_timeout(ACK_TIMEOUT)
                    .max_ack_inflight(ACK_PERMITS)
                    .backpressure_on_inflight(true)
                    .build(client.clone());
                Ok(Conn { client, js })
            })
            .await
    }

    /// The authentication and TLS options of the config.
    async fn connect_options(&self) -> Result<ConnectOptions, String> {
        let sec = &self.security;
        let mut options = if let (Some(user), Some(password)) = (&sec.user, &sec.password) {
            ConnectOptions::with_user_and_password(user.clone(), password.expose().to_owned())
        } else if let Some(token) = &sec.token {
            ConnectOptions::with_token(token.expose().to_owned())
        } else if let Some(creds) = &sec.creds_file {
            let failed = |e: std::io::Error| format!("nats creds_file {}: {e}", creds.display());
            let contents = tokio::fs::read_to_string(creds).await.map_err(failed)?;
            // The JWT and the seed are secrets like any password: registered, they are
            // scrubbed from every output (async-nats masks them in its own CONNECT trace).
            let mut lines = contents.lines().map(str::trim);
            while let Some(line) = lines.next() {
                if line.starts_with("-----BEGIN")
                    && let Some(block) = lines.find(|l| !l.is_empty())
                {
                    crate::config::register_secret(block);
                }
            }
            ConnectOptions::with_credentials(&contents).map_err(failed)?
        } else {
            ConnectOptions::new()
        };
        if let Some(tls) = &sec.tls {
            options = options.require_tls(true);
            if let Some(ca) = &tls.ca_file {
                options = options.add_root_certificates(ca.clone());
            }
            if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
        }
        Ok(options)
    }

    /// A failed connect in words: refused credentials say so, apart from an unreachable
    /// server or a failed TLS handshake.
    fn connect_error(&self, e: &async_nats::ConnectError) -> String {
        use async_nats::ConnectErrorKind as K;
        match e.kind() {
            K::AuthorizationViolation | K::Authentication => {
                super::auth_failed(&self.identity, &format!("nats {}: {e}", self.url))
            }
            _ => format!("nats {}: {e}", self.url),
        }
    }

    /// Connects if needed and waits up to `wait` for the connection to be up.
    async fn connected(&self, wait: Duration) -> Result<&Conn, String> {
        let conn = self.conn().await?;
        let deadline = Instant::now() + wait;
        loop {
            let state = conn.client.connection_state();
            if state == State::Connected {
                return Ok(conn);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "nats server {} not connected ({})",
                    self.url,
                    state_name(&state)
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Publishes a batch; one outcome per message, in input order. Never panics.
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        let conn = match self.connected(CONNECT_WAIT).await {
            Ok(conn) => conn,
            Err(why) => return vec![Outcome::Unavailable(why); batch.len()],
        };
        let mut out = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(CHUNK) {
            let outcomes = if self.jetstream {
                self.publish_jetstream(conn, chunk).await
            } else {
                self.publish_core(conn, chunk).await
            };
            out.extend(outcomes);
        }
        self.confirm_missing(batch, &mut out).await;
        out
    }

    /// A publish answered "no responders" means no stream listens on the subject, or that
    /// JetStream itself is not answering: a server shutting down stops JetStream before it
    /// closes connections, and a clustered stream has no leader while it elects one. Only the
    /// first is a missing destination (whose jobs a route may send to dead): each subject
    /// with a `Missing` outcome is looked up in the JetStream API once, and the outcome
    /// becomes `Unavailable` unless the API answers that no stream covers the subject.
    async fn confirm_missing(&self, batch: &[Message], out: &mut [Outcome]) {
        let mut verdicts: std::collections::HashMap<&str, Option<Outcome>> = Default::default();
        for (msg, outcome) in batch.iter().zip(out.iter_mut()) {
            let Outcome::Missing(why) = outcome else {
                continue;
            };
            if !verdicts.contains_key(msg.target.as_str()) {
                let verdict = match self.stream_name_for(&msg.target).await {
                    Ok(None) => None,
                    Ok(Some(stream)) => Some(Outcome::Unavailable(format!(
                        "stream {stream} stores {} but did not answer the publish ({why})",
                        msg.target
                    ))),
                    Err(lookup) => Some(Outcome::Unavailable(format!(
                        "JetStream on {} is not answering: {lookup} (after: {why})",
                        self.url
                    ))),
                };
                verdicts.insert(&msg.target, verdict);
            }
            if let Some(Some(verdict)) = verdicts.get(msg.target.as_str()) {
                *outcome = verdict.clone();
            }
        }
    }

    async fn publish_jetstream(&self, conn: &Conn, chunk: &[Message]) -> Vec<Outcome> {
        let mut out: Vec<Option<Outcome>> = vec![None; chunk.len()];
        let mut pending: Vec<(usize, PublishAckFuture)> = Vec::with_capacity(chunk.len());
        // Phase 1: send every publish (in order), keeping the ack futures. A send that cannot
        // even be queued within the timeout means the connection is not draining: the rest of
        // the chunk gets the same answer instead of waiting out the timeout one by one.
        let mut stalled: Option<Outcome> = None;
        for (i, msg) in chunk.iter().enumerate() {
            let headers = match headers_for(msg) {
                Ok(h) => h,
                Err(why) => {
                    out[i] = Some(Outcome::Reject(why));
                    continue;
                }
            };
            if let Some(o) = &stalled {
                out[i] = Some(o.clone());
                continue;
            }
            if conn.client.connection_state() != State::Connected {
                out[i] = Some(self.lost());
                continue;
            }
            let payload = msg.payload.clone().into();
            let sent = tokio::time::timeout(
                ACK_TIMEOUT,
                conn.js
                    .publish_with_headers(msg.target.clone(), headers, payload),
            )
            .await;
            let connected = conn.client.connection_state() == State::Connected;
            match sent {
                Ok(Ok(ack)) => pending.push((i, ack)),
                Ok(Err(err)) if err.kind() != PublishErrorKind::TimedOut => {
                    let ctx = Ctx {
                        connected,
                        batch_heard: true,
                    };
                    out[i] = Some(classify(js_cause(&err), &err.to_string(), &msg.target, ctx));
                }
                Ok(Err(_)) | Err(_) => {
                    let ctx = Ctx {
                        connected,
                        batch_heard: false,
                    };
                    let o = classify(
                        Cause::TimedOut,
                        "timed out queueing the publish",
                        &msg.target,
                        ctx,
                    );
                    stalled = Some(o.clone());
                    out[i] = Some(o);
                }
            }
        }

        // Phase 2: await every ack concurrently; a lost connection resolves the rest at once
        // (their acks can no longer arrive on this connection).
        let lost = CancellationToken::new();
        let acks = join_all(pending.into_iter().map(|(i, ack)| {
            let lost = lost.clone();
            async move {
                tokio::select! {
                    biased;
                    r = ack => (i, Some(r)),
                    _ = lost.cancelled() => (i, None),
                }
            }
        }));
        let watch = async {
            loop {
                tokio::time::sleep(STATE_POLL).await;
                if conn.client.connection_state() != State::Connected {
                    lost.cancel();
                    return;
                }
            }
        };
        tokio::pin!(acks);
        let results = tokio::select! {
            r = &mut acks => r,
            _ = watch => acks.await,
        };

        // Did the server answer anything in this batch? If every ack timed out it is down (or
        // hung) rather than failing one message.
        let batch_heard = results.iter().any(|(_, r)| {
            matches!(r, Some(Ok(_)))
                || matches!(r, Some(Err(e)) if e.kind() != PublishErrorKind::TimedOut)
        });
        let connected = conn.client.connection_state() == State::Connected;
        for (i, r) in results {
            out[i] = Some(match r {
                Some(Ok(_ack)) => Outcome::Delivered,
                Some(Err(err)) => classify(
                    js_cause(&err),
                    &err.to_string(),
                    &chunk[i].target,
                    Ctx {
                        connected,
                        batch_heard,
                    },
                ),
                None => self.lost(),
            });
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::Retry("no outcome recorded".to_owned())))
            .collect()
    }

    async fn publish_core(&self, conn: &Conn, chunk: &[Message]) -> Vec<Outcome> {
        let mut out: Vec<Option<Outcome>> = vec![None; chunk.len()];
        let mut stalled = false;
        for (i, msg) in chunk.iter().enumerate() {
            let headers = match headers_for(msg) {
                Ok(h) => h,
                Err(why) => {
                    out[i] = Some(Outcome::Reject(why));
                    continue;
                }
            };
            if stalled || conn.client.connection_state() != State::Connected {
                out[i] = Some(self.lost());
                continue;
            }
            let payload = msg.payload.clone().into();
            let sent = tokio::time::timeout(
                ACK_TIMEOUT,
                conn.client
                    .publish_with_headers(msg.target.clone(), headers, payload),
            )
            .await;
            out[i] = match sent {
                Ok(Ok(())) => None, // settled by the round trip below
                Ok(Err(err)) => Some(classify(
                    core_cause(err.kind()),
                    &err.to_string(),
                    &msg.target,
                    Ctx {
                        connected: conn.client.connection_state() == State::Connected,
                        batch_heard: true,
                    },
                )),
                Err(_) => {
                    // Not even queued within the timeout: the connection is not draining.
                    stalled = true;
                    Some(self.lost())
                }
            };
        }
        if out.iter().any(Option::is_none) {
            // The server handles a connection's messages in order: its answer to this request
            // means it has read every publish above.
            let settled = match round_trip(&conn.client, ACK_TIMEOUT).await {
                Ok(()) => Outcome::Delivered,
                Err(why) if conn.client.connection_state() != State::Connected => {
                    Outcome::Unavailable(why)
                }
                Err(why) => Outcome::Retry(why),
            };
            for o in out.iter_mut().filter(|o| o.is_none()) {
                *o = Some(settled.clone());
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::Retry("no outcome recorded".to_owned())))
            .collect()
    }

    fn lost(&self) -> Outcome {
        Outcome::Unavailable(format!("nats server {} disconnected", self.url))
    }

    /// Health, asking only what publishing needs, in requests every supported server
    /// version answers the same way: connected to a server at least [`MIN_SERVER`], the
    /// server reads what we send (a round trip), and, for JetStream, the JetStream API
    /// answers for this account. An answer the check cannot make sense of (a server newer
    /// than this build, say) is logged once with the server's version and counts as up: a
    /// surprise in the check must never keep a sink paused. Bounded by [`CHECK_TIMEOUT`].
    pub async fn health(&self) -> Health {
        let deadline = Instant::now() + CHECK_TIMEOUT;
        let conn = match self.connected(CHECK_TIMEOUT).await {
            Ok(conn) => conn,
            Err(why) => return Health::Down(why),
        };
        let version = conn.client.server_info().version;
        let (major, minor, patch) = MIN_SERVER;
        if !version.is_empty() && !conn.client.is_server_compatible(major, minor, patch) {
            return Health::Unsupported(format!(
                "nats-server {version} at {} is older than the oldest supported version, \
                 {major}.{minor}.{patch}",
                self.url
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if let Err(why) = round_trip(&conn.client, left).await {
            return Health::Down(format!("nats-server {} ({version}): {why}", self.url));
        }
        if !self.jetstream {
            return Health::Up;
        }
        // $JS.API.INFO, read as plain JSON: every version's reply parses.
        let empty = serde_json::json!({});
        let info = conn.js.request::<_, _, serde_json::Value>("INFO", &empty);
        match tokio::time::timeout_at(deadline, info).await {
            Ok(Ok(reply)) => match reply.get("error") {
                None => Health::Up,
                Some(error) => Health::Down(format!(
                    "JetStream on nats-server {} ({version}) refused this account: {error} \
                     (is JetStream enabled for it?)",
                    self.url
                )),
            },
            Ok(Err(e)) if e.kind() == jetstream::context::RequestErrorKind::NoResponders => {
                Health::Down(format!(
                    "JetStream is not enabled on nats-server {} ({version}): start it with -js \
                     (or set jetstream = false for core NATS)",
                    self.url
                ))
            }
            Ok(Err(e)) if e.kind() == jetstream::context::RequestErrorKind::TimedOut => {
                Health::Down(format!(
                    "JetStream on nats-server {} ({version}) did not answer within \
                     {CHECK_TIMEOUT:?}",
                    self.url
                ))
            }
            Ok(Err(e)) => {
                self.surprise(&version, &e.to_string());
                Health::Up
            }
            Err(_) => Health::Down(format!(
                "JetStream on nats-server {} ({version}) did not answer within {CHECK_TIMEOUT:?}",
                self.url
            )),
        }
    }

    /// The name of the JetStream stream that stores `subject` (one API request): `Ok(None)`
    /// when no stream covers it (publishes would be held), `Err` when the server cannot be
    /// asked. Core NATS (`jetstream = false`) has no streams: `Err`.
    async fn stream_name_for(&self, subject: &str) -> Result<Option<String>, String> {
        if !self.jetstream {
            return Err("core NATS (jetstream = false) stores nothing: no stream to check".into());
        }
        let conn = self.connected(CHECK_TIMEOUT).await?;
        let found = tokio::time::timeout(CHECK_TIMEOUT, conn.js.stream_by_subject(subject))
            .await
            .map_err(|_| format!("JetStream did not answer within {CHECK_TIMEOUT:?}"))?;
        match found {
            Ok(name) => Ok(Some(name)),
            Err(e)
                if matches!(
                    e.kind(),
                    jetstream::context::GetStreamByNameErrorKind::NotFound
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(format!("JetStream stream lookup for {subject}: {e}")),
        }
    }

    /// The JetStream stream named `name`, with its info as the server gave it now.
    async fn stream_named(&self, name: &str) -> Result<jetstream::stream::Stream, String> {
        let conn = self.connected(CHECK_TIMEOUT).await?;
        tokio::time::timeout(CHECK_TIMEOUT, conn.js.get_stream(name))
            .await
            .map_err(|_| format!("JetStream did not answer within {CHECK_TIMEOUT:?}"))?
            .map_err(|e| format!("JetStream stream {name}: {e}"))
    }

    /// The JetStream stream that stores `subject` and its duplicate window: `Ok(None)` when
    /// no stream covers it, `Err` when the server cannot be asked (see [`Self::stream_name_for`]).
    pub async fn stream_for(&self, subject: &str) -> Result<Option<(String, Duration)>, String> {
        let Some(name) = self.stream_name_for(subject).await? else {
            return Ok(None);
        };
        let window = self
            .stream_named(&name)
            .await?
            .cached_info()
            .config
            .duplicate_window;
        Ok(Some((name, window)))
    }

    /// The messages the JetStream stream that stores `subject` holds (a work-queue stream's
    /// are the ones not yet consumed), for a route's `max_length`.
    pub async fn depth(&self, subject: &str) -> Result<u64, String> {
        let Some(name) = self.stream_name_for(subject).await? else {
            return Err(format!("no JetStream stream stores {subject}"));
        };
        Ok(self.stream_named(&name).await?.cached_info().state.messages)
    }

    /// [`Self::health`] as a result: `Err` says why it cannot deliver.
    pub async fn check(&self) -> Result<(), String> {
        self.health().await.into_result()
    }

    /// An answer the check did not expect: logged once per sink, never a reason to pause.
    fn surprise(&self, version: &str, what: &str) {
        if !self
            .surprised
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                sink = %self.name,
                server_version = version,
                answer = what,
                "unexpected answer to the nats health check; the sink counts as up (publishing \
                 decides)"
            );
        }
    }

    /// Writes out whatever the client still buffers (core NATS publishes), bounded by
    /// `timeout`. JetStream publishes are settled by their acks already.
    pub async fn flush(&self, timeout: Duration) {
        if let Some(conn) = self.conn.get() {
            match tokio::time::timeout(timeout, conn.client.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(sink = %self.name, error = %e, "nats flush failed"),
                Err(_) => tracing::warn!(sink = %self.name, ?timeout, "nats flush timed out"),
            }
        }
    }
}

/// A request the server itself answers: "no responders" (or a reply, should something listen on
/// the probe subject) proves the round trip.
async fn round_trip(client: &Client, timeout: Duration) -> Result<(), String> {
    let subject = format!("_zdelay.probe.{}", ulid::Ulid::generate());
    match tokio::time::timeout(timeout, client.request(subject, Vec::new().into())).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => Ok(()),
        Ok(Err(e)) => Err(format!("round trip failed: {e}")),
        Err(_) => Err(format!("server did not answer within {timeout:?}")),
    }
}

fn state_name(state: &State) -> &'static str {
    match state {
        State::Pending => "connecting",
        State::Connected => "connected",
        State::Disconnected => "disconnected",
    }
}

/// Envelope headers, then the idempotency key as `zdelay-id` and `Nats-Msg-Id` (these two win
/// over envelope headers of the same name).
fn headers_for(msg: &Message) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for (k, v) in &msg.headers {
        let name = HeaderName::from_str(k).map_err(|_| format!("invalid header name {k:?}"))?;
        let value =
            HeaderValue::from_str(v).map_err(|_| format!("invalid value for header {k:?}"))?;
        headers.insert(name, value);
    }
    let key = msg.idempotency_key();
    let value = HeaderValue::from_str(&key).map_err(|_| format!("invalid job id {:?}", msg.id))?;
    headers.insert(IDEMPOTENCY_HEADER, value.clone());
    headers.insert(NATS_MSG_ID, value);
    Ok(headers)
}

/// Why a publish failed, reduced from the async-nats error kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// No stream listens on the subject (JetStream answers "no responders").
    NoStream,
    /// Over the server's `max_payload`, or the stream's max message or header size.
    TooLarge,
    InvalidSubject,
    /// A permanent JetStream refusal (sealed stream, expected-last-* mismatch, JetStream off).
    Refused,
    /// No ack within the timeout.
    TimedOut,
    /// The ack channel closed (connection lost or client closed).
    BrokenPipe,
    /// The client could not queue the message (client closed).
    SendFailed,
    /// The stream is at a limit (maximum messages or bytes, storage) or the client has as
    /// many acks pending as it allows: the destination asks to slow down.
    Full,
    /// Anything else (other JetStream store failures, …): transient.
    Other,
}

/// Maps a JetStream publish error to its [`Cause`].
pub(crate) fn js_cause(err: &jetstream::context::PublishError) -> Cause {
    match err.kind() {
        PublishErrorKind::StreamNotFound => Cause::NoStream,
        PublishErrorKind::MaxPayloadExceeded => Cause::TooLarge,
        PublishErrorKind::TimedOut => Cause::TimedOut,
        PublishErrorKind::BrokenPipe => Cause::BrokenPipe,
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            Cause::Refused
        }
        PublishErrorKind::MaxAckPending => Cause::Full,
        PublishErrorKind::Other => {
            let source = std::error::Error::source(err);
            if let Some(js) = source.and_then(|s| s.downcast_ref::<jetstream::Error>()) {
                js_code_cause(js.error_code(), &js.to_string())
            } else if source
                .and_then(|s| s.downcast_ref::<async_nats::SubjectError>())
                .is_some()
            {
                Cause::InvalidSubject
            } else {
                Cause::Other
            }
        }
    }
}

/// Maps a JetStream API error code (from a negative PubAck) to its [`Cause`].
pub(crate) fn js_code_cause(code: ErrorCode, description: &str) -> Cause {
    // 10047: storage resources exceeded; 10077: a store failure, which names the limit hit
    // ("maximum messages exceeded", "maximum bytes exceeded", "… per subject …").
    let full =
        code == ErrorCode(10047) || (code == ErrorCode(10077) && description.contains("maximum"));
    if full {
        return Cause::Full;
    }
    match code {
        ErrorCode::STREAM_NOT_FOUND => Cause::NoStream,
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => {
            Cause::TooLarge
        }
        ErrorCode::STREAM_SEALED
        | ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID
        | ErrorCode::STREAM_WRONG_LAST_SEQUENCE
        | ErrorCode::JETSTREAM_NOT_ENABLED
        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT => Cause::Refused,
        _ => Cause::Other,
    }
}

/// Maps a core NATS publish error to its [`Cause`].
pub(crate) fn core_cause(kind: async_nats::client::PublishErrorKind) -> Cause {
    use async_nats::client::PublishErrorKind as K;
    match kind {
        K::MaxPayloadExceeded => Cause::TooLarge,
        K::InvalidSubject => Cause::InvalidSubject,
        K::Send => Cause::SendFailed,
    }
}

/// What the connection looked like when the error was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ctx {
    /// The client was connected when the error was classified.
    pub connected: bool,
    /// The server answered at least one message of the batch (an ack or an error reply).
    pub batch_heard: bool,
}

/// The outcome for one failed message. Pure: the whole classification table lives here.
pub(crate) fn classify(cause: Cause, detail: &str, subject: &str, ctx: Ctx) -> Outcome {
    match cause {
        Cause::NoStream => Outcome::Missing(format!(
            "no JetStream stream for subject {subject} ({detail})"
        )),
        Cause::TooLarge => Outcome::Reject(format!("message too large for {subject}: {detail}")),
        Cause::InvalidSubject => Outcome::Reject(format!("invalid subject {subject:?}: {detail}")),
        Cause::Refused => Outcome::Reject(format!("refused by JetStream: {detail}")),
        Cause::TimedOut if !ctx.connected => {
            Outcome::Unavailable(format!("nats server disconnected: {detail}"))
        }
        Cause::TimedOut if !ctx.batch_heard => Outcome::Unavailable(format!(
            "nats server not answering (no ack for the whole batch): {detail}"
        )),
        Cause::TimedOut => Outcome::Retry(detail.to_owned()),
        Cause::BrokenPipe | Cause::SendFailed => {
            Outcome::Unavailable(format!("nats connection lost: {detail}"))
        }
        Cause::Full => Outcome::Full(format!("{subject}: the stream is full ({detail})")),
        Cause::Other if !ctx.connected => {
            Outcome::Unavailable(format!("nats server disconnected: {detail}"))
        }
        Cause::Other => Outcome::Retry(detail.to_owned()),
    }
}

impl super::Sink for NatsSink {
    fn depth<'a>(&'a self, target: &'a str) -> futures::future::BoxFuture<'a, Result<u64, String>> {
        Box::pin(NatsSink::depth(self, target))
    }

    fn publish<'a>(&'a self, batch: &'a [Message]) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(NatsSink::publish(self, batch))
    }

    fn check(&self) -> futures::future::BoxFuture<'_, Health> {
        Box::pin(NatsSink::health(self))
    }

    fn flush(&self, timeout: Duration) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(NatsSink::flush(self, timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::context::PublishError;
    use std::collections::BTreeMap;

    const UP: Ctx = Ctx {
        connected: true,
        batch_heard: true,
    };
    const DOWN: Ctx = Ctx {
        connected: false,
        batch_heard: false,
    };
    const SILENT: Ctx = Ctx {
        connected: true,
        batch_heard: false,
    };

    fn js_err(err_code: u64, description: &str) -> PublishError {
        let e: jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": err_code, "description": description,
        }))
        .expect("a jetstream error");
        PublishError::with_source(PublishErrorKind::Other, e)
    }

    fn kind(o: &Outcome) -> &'static str {
        match o {
            Outcome::Delivered => "delivered",
            Outcome::Retry(_) => "retry",
            Outcome::Reject(_) => "reject",
            Outcome::Unavailable(_) => "unavailable",
            Outcome::Missing(_) => "missing",
            Outcome::Full(_) => "full",
        }
    }

    #[test]
    fn causes_from_async_nats_errors() {
        let cases: Vec<(PublishError, Cause)> = vec![
            (
                PublishError::new(PublishErrorKind::StreamNotFound),
                Cause::NoStream,
            ),
            (
                PublishError::new(PublishErrorKind::MaxPayloadExceeded),
                Cause::TooLarge,
            ),
            (
                PublishError::new(PublishErrorKind::TimedOut),
                Cause::TimedOut,
            ),
            (
                PublishError::new(PublishErrorKind::BrokenPipe),
                Cause::BrokenPipe,
            ),
            (
                PublishError::new(PublishErrorKind::WrongLastSequence),
                Cause::Refused,
            ),
            (
                PublishError::new(PublishErrorKind::MaxAckPending),
                Cause::Full,
            ),
            (PublishError::new(PublishErrorKind::Other), Cause::Other),
            (
                js_err(10054, "message size exceeds maximum allowed"),
                Cause::TooLarge,
            ),
            (
                js_err(10097, "header size exceeds maximum"),
                Cause::TooLarge,
            ),
            (js_err(10059, "stream not found"), Cause::NoStream),
            (js_err(10109, "stream is sealed"), Cause::Refused),
            (js_err(10076, "jetstream not enabled"), Cause::Refused),
            (js_err(10077, "maximum messages exceeded"), Cause::Full),
            (js_err(10077, "maximum bytes exceeded"), Cause::Full),
            (js_err(10077, "store failed: io error"), Cause::Other),
            (js_err(10047, "insufficient storage"), Cause::Full),
            (
                PublishError::with_source(
                    PublishErrorKind::Other,
                    async_nats::SubjectError::InvalidFormat,
                ),
                Cause::InvalidSubject,
            ),
        ];
        for (err, want) in cases {
            assert_eq!(js_cause(&err), want, "{err}");
        }
        use async_nats::client::PublishErrorKind as K;
        assert_eq!(core_cause(K::MaxPayloadExceeded), Cause::TooLarge);
        assert_eq!(core_cause(K::InvalidSubject), Cause::InvalidSubject);
        assert_eq!(core_cause(K::Send), Cause::SendFailed);
    }

    #[test]
    fn classification_table() {
        let table = [
            (Cause::NoStream, UP, "missing"),
            (Cause::NoStream, DOWN, "missing"),
            (Cause::TooLarge, UP, "reject"),
            (Cause::InvalidSubject, UP, "reject"),
            (Cause::Refused, UP, "reject"),
            (Cause::TimedOut, DOWN, "unavailable"),
            (Cause::TimedOut, SILENT, "unavailable"),
            (Cause::TimedOut, UP, "retry"),
            (Cause::BrokenPipe, UP, "unavailable"),
            (Cause::SendFailed, UP, "unavailable"),
            (Cause::Other, UP, "retry"),
            (Cause::Full, UP, "full"),
            (Cause::Full, DOWN, "full"),
            (Cause::Other, DOWN, "unavailable"),
        ];
        for (cause, ctx, want) in table {
            let got = classify(cause, "detail", "a.b", ctx);
            assert_eq!(kind(&got), want, "{cause:?} {ctx:?}: {got:?}");
        }
        match classify(Cause::NoStream, "no responders", "orders.created", UP) {
            Outcome::Missing(why) => {
                assert!(why.starts_with("no JetStream stream for subject orders.created"))
            }
            other => panic!("{other:?}"),
        }
    }

    fn message(headers: &[(&str, &str)]) -> Message {
        Message {
            id: "01J0000000000000000000000A".to_owned(),
            due_ms: 1_700_000_000_123,
            target: "a.b".to_owned(),
            payload: vec![0, 255],
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            priority: None,
        }
    }

    #[test]
    fn headers_carry_envelope_headers_and_the_idempotency_key() {
        let msg = message(&[("x-trace", "t1"), ("Nats-Msg-Id", "forged")]);
        let h = headers_for(&msg).expect("valid headers");
        let key = "01J0000000000000000000000A:1700000000123";
        assert_eq!(h.get("x-trace").map(|v| v.as_str()), Some("t1"));
        assert_eq!(h.get(IDEMPOTENCY_HEADER).map(|v| v.as_str()), Some(key));
        assert_eq!(h.get(NATS_MSG_ID).map(|v| v.as_str()), Some(key));
        assert_eq!(h.get_all(NATS_MSG_ID).count(), 1);
    }

    #[test]
    fn invalid_headers_are_errors_not_panics() {
        assert!(headers_for(&message(&[("bad:name", "v")])).is_err());
        assert!(headers_for(&message(&[("k", "line\r\nbreak")])).is_err());
    }

    #[test]
    fn new_validates_the_url_without_connecting() {
        let cfg = |url: &str| NatsSinkConfig {
            url: url.into(),
            jetstream: true,
            ..Default::default()
        };
        assert!(NatsSink::new("bus", &cfg("nats://127.0.0.1:1")).is_ok());
        assert!(NatsSink::new("bus", &cfg("nats://127.0.0.1:1, nats://127.0.0.1:2")).is_ok());
        assert!(NatsSink::new("bus", &cfg("")).is_err());
    }

    #[tokio::test]
    async fn server_down_is_unavailable_quickly() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let sink = NatsSink::new(
            "bus",
            &NatsSinkConfig {
                url: format!("nats://127.0.0.1:{port}").into(),
                jetstream: true,
                ..Default::default()
            },
        )
        .expect("sink");
        let started = std::time::Instant::now();
        let out = sink.publish(&[message(&[]), message(&[])]).await;
        assert!(
            out.iter().all(|o| matches!(o, Outcome::Unavailable(_))),
            "{out:?}"
        );
        assert!(sink.check().await.is_err());
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
