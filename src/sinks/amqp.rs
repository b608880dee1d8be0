//! The AMQP 0-9-1 sink (RabbitMQ), with publisher confirms.
//!
//! One connection and one confirm-mode channel per sink, opened on first use and opened
//! again after a channel or connection error (a 404 or 406 closes the channel, a broker
//! restart closes the connection). A batch is published in full, pipelined, and then every
//! publisher confirm is awaited: a job is delivered only when the broker acked it.
//!
//! Every message is `mandatory` (an unroutable message comes back instead of vanishing: it
//! waits, like one to a missing exchange, until a queue is bound — or dies, per its route), persistent (`delivery_mode` 2), carries the envelope headers plus
//! `zdelay-id`, and the route's priority when it has one.
//!
//! # Consumers dedupe with `message_id`
//!
//! Delivery is at least once: a poller that dies between the broker's confirm and the ack
//! in Redis, or a channel closed by another message's error before its confirms arrived,
//! makes zdelay publish the same job again. Every copy carries the same AMQP `message_id`
//! (and `zdelay-id` header), `<job id>:<due ms>`, stable across redeliveries of one
//! scheduled occurrence and different for the next occurrence of a recurring job. A
//! consumer that must not act twice keeps the ids it processed (e.g. `SET id NX EX <ttl>`
//! in Redis, or a unique key in its database, written in the same transaction as the
//! effect) and drops a message whose `message_id` it has already seen.

use crate::sinks::{IDEMPOTENCY_HEADER, Message, Outcome, SinkError};
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use std::collections::HashSet;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout, timeout_at};
use zdelay_core::config::{AmqpSinkConfig, TlsConfig};

/// Bound on connecting and opening the channel during a publish.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on the whole health check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The oldest RabbitMQ this sink is tested with and supports (Debian 12 ships 3.10.8).
pub const MIN_SERVER: (u32, u32) = (3, 10);
/// Default bound on publishing a batch and receiving all its confirms.
/// Bound on publishing one batch and receiving all its confirms; well under the poller's
/// lease. Unconfirmed messages at the deadline are `Unavailable` (a broker that blocks
/// publishers, e.g. on a memory alarm) and the connection is dropped.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Publish rounds per batch: messages whose channel was closed by another message's error
/// are published again on a fresh channel, at most this many times.
const MAX_ROUNDS: usize = 4;
/// Publishes in flight at once while sending a batch.
const PIPELINE: usize = 256;

/// The AMQP sink. Cheap to share behind an `Arc`; publishes from several tasks pipeline on
/// the one channel.
pub struct AmqpSink {
    name: String,
    url: String,
    /// The URL's user name (not secret), for "authentication failed for user …".
    user: String,
    /// `tls = { ... }`: files read at every connect, so renewed certificates are used.
    tls: Option<TlsConfig>,

    state: Mutex<State>,
    /// The broker's `max_message_size`, learned from its first 406 (0: unknown). Larger
    /// messages are then rejected without closing the channel again.
    max_message_size: AtomicUsize,
    generation: AtomicU64,
    /// The broker's version, once read (plain `amqp://` only).
    server_version: tokio::sync::OnceCell<String>,
}

#[derive(Default)]
struct State {
    connection: Option<Connection>,
    session: Option<Session>,
}

/// A confirm-mode channel on the current connection.
#[derive(Clone)]
struct Session {
    generation: u64,
    channel: Channel,
    /// Exchanges a passive declare found on this connection.
    exchanges: Arc<StdMutex<HashSet<String>>>,
}

/// A message ready to publish (validated once per batch).
#[derive(Debug)]
struct Prepared {
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
}

impl AmqpSink {
    /// Builds the sink; does not connect (the first publish or check does).
    pub fn new(name: &str, config: &AmqpSinkConfig) -> Result<Self, SinkError> {
        let url = config.url.expose();
        let uri = lapin::uri::AMQPUri::from_str(url).map_err(|e| SinkError::Config {
            sink: name.to_owned(),
            why: format!("url: {e}"),
        })?;
        Ok(AmqpSink {
            name: name.to_owned(),
            url: url.to_owned(),
            user: uri.authority.userinfo.username,
            tls: config.tls.clone(),
            state: Mutex::new(State::default()),
            max_message_size: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            server_version: tokio::sync::OnceCell::new(),
        })
    }

    /// Publishes the batch with publisher confirms and waits for every confirm: one
    /// outcome per message, in input order.
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let deadline = Instant::now() + CONFIRM_TIMEOUT;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut prepared = Vec::with_capacity(batch.len());
        let mut pending = Vec::with_capacity(batch.len());
        let max_size = self.max_message_size.load(Ordering::Relaxed);
        for (i, message) in batch.iter().enumerate() {
            match prepare(message, max_size) {
                Ok(p) => {
                    prepared.push(Some(p));
                    pending.push(i);
                }
                Err(reason) => {
                    prepared.push(None);
                    outcomes[i] = Some(Outcome::Reject(reason));
                }
            }
        }

        let mut rounds = 0;
        let mut last_cause = String::new();
        while !pending.is_empty() {
            if rounds == MAX_ROUNDS {
                for &i in &pending {
                    outcomes[i] = Some(Outcome::Retry(format!(
                        "channel closed {MAX_ROUNDS} times during the batch: {last_cause}"
                    )));
                }
                break;
            }
            rounds += 1;
            let session = match timeout_at(deadline, self.session(CONNECT_TIMEOUT)).await {
                Ok(Ok(session)) => session,
                Ok(Err(why)) => {
                    set_all(&mut outcomes, &pending, Outcome::Unavailable(why));
                    break;
                }
                Err(_) => {
                    set_all(
                        &mut outcomes,
                        &pending,
                        Outcome::Unavailable("timed out connecting".to_owned()),
                    );
                    break;
                }
            };

            // Unknown exchanges: a passive declare first, so a missing one rejects its own
            // messages instead of closing the channel under the whole batch.
            match self.check_exchanges(&session, &prepared, &pending).await {
                ExchangeCheck::Ok => {}
                ExchangeCheck::Missing { exchange, reason } => {
                    pending.retain(|&i| {
                        let p = prepared[i].as_ref().expect("pending messages are prepared");
                        if p.exchange.as_str() == exchange {
                            outcomes[i] = Some(Outcome::Missing(reason.clone()));
                            false
                        } else {
                            true
                        }
                    });
                    rounds -= 1; // progress made; the channel is closed: open a new one
                    continue;
                }
                ExchangeCheck::ChannelClosed => {
                    rounds -= 1; // that exchange is now skipped: the publish will tell
                    continue;
                }
            }

            let results = publish_round(&session, batch, &prepared, &pending, deadline).await;
            let mut again = Vec::new();
            let mut timed_out = false;
            for (i, result) in results {
                let outcome = match result {
                    Ok(confirm) => Verdict::Final(outcome_of_confirm(confirm, &batch[i].target)),
                    Err(failure) => {
                        timed_out |= matches!(failure, Failure::Timeout(_));
                        if let Some(max) = failure.max_message_size() {
                            self.max_message_size.store(max, Ordering::Relaxed);
                        }
                        let p = prepared[i].as_ref().expect("pending messages are prepared");
                        if let Failure::Closed { code: 404, .. } = failure {
                            session.forget_exchange(p.exchange.as_str());
                        }
                        classify_failure(&failure, p.exchange.as_str(), batch[i].payload.len())
                    }
                };
                match outcome {
                    Verdict::Final(o) => outcomes[i] = Some(o),
                    Verdict::Again(cause) => {
                        last_cause = cause;
                        again.push(i);
                    }
                }
            }
            if timed_out {
                self.reset(session.generation).await;
            }
            // Handled here: news only if publishing again fails too, which the sink's
            // outage episode then reports.
            if !again.is_empty() {
                tracing::info!(
                    sink = %self.name, republish = again.len(), cause = %last_cause,
                    "amqp channel closed under the batch; publishing the rest again"
                );
            }
            pending = again;
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::Retry("no outcome (bug)".to_owned())))
            .collect()
    }

    /// A real health check, bounded to about 2 s: connects and opens the channel if needed.
    pub async fn check(&self) -> Result<(), String> {
        match timeout(CHECK_TIMEOUT, self.session(CHECK_TIMEOUT)).await {
            Ok(Ok(session)) if session.channel.status().connected() => Ok(()),
            Ok(Ok(_)) => Err("channel closed".to_owned()),
            Ok(Err(why)) => Err(why),
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        }
    }

    /// Whether the object `target` needs exists, asked with a passive declare (which creates
    /// nothing): the exchange of `exchange/key`, or the queue of `/queue` (the default
    /// exchange routes to a queue by its name). `Ok(None)` when it exists, `Ok(Some(the
    /// broker's words))` when it does not, `Err` when the broker cannot be asked. Whether an
    /// exchange routes the key anywhere cannot be asked without publishing: an unroutable
    /// message is held when it is published.
    pub async fn missing_object(&self, target: &str) -> Result<Option<String>, String> {
        let Some((exchange, queue)) = target.split_once('/') else {
            return Err(format!(
                "amqp target '{target}' is not exchange/routing-key ('/queue' for the default \
                 exchange)"
            ));
        };
        let session = timeout(CHECK_TIMEOUT, self.session(CHECK_TIMEOUT))
            .await
            .map_err(|_| format!("no answer within {CHECK_TIMEOUT:?}"))??;
        let declare = async {
            if exchange.is_empty() {
                let options = lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                session
                    .channel
                    .queue_declare(queue.into(), options, FieldTable::default())
                    .await
                    .map(|_| ())
            } else {
                let options = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                session
                    .channel
                    .exchange_declare(
                        exchange.into(),
                        lapin::ExchangeKind::Direct,
                        options,
                        FieldTable::default(),
                    )
                    .await
            }
        };
        let result = timeout(CHECK_TIMEOUT, declare)
            .await
            .map_err(|_| format!("no answer within {CHECK_TIMEOUT:?}"))?;
        match result.as_ref().map_err(Failure::from) {
            Ok(()) => Ok(None),
            Err(Failure::Closed {
                code: 404, text, ..
            }) => Ok(Some(broker_reason(&text))),
            Err(_) => Err(result.err().map(|e| e.to_string()).unwrap_or_default()),
        }
    }

    /// The messages ready in the queue of a `/queue` target (the default exchange routes to
    /// a queue by its name), asked with a passive declare, for a route's `max_length`.
    pub async fn depth(&self, target: &str) -> Result<u64, String> {
        let Some(("", queue)) = target.split_once('/') else {
            return Err(format!(
                "amqp target '{target}' is not a queue ('/queue', the default exchange)"
            ));
        };
        let session = timeout(CHECK_TIMEOUT, self.session(CHECK_TIMEOUT))
            .await
            .map_err(|_| format!("no answer within {CHECK_TIMEOUT:?}"))??;
        let options = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declare = session
            .channel
            .queue_declare(queue.into(), options, FieldTable::default());
        match timeout(CHECK_TIMEOUT, declare).await {
            Ok(Ok(q)) => Ok(u64::from(q.message_count())),
            Ok(Err(e)) => Err(format!("queue {queue}: {e}")),
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        }
    }

    /// [`Self::check`], and once the broker answers, its version against [`MIN_SERVER`]
    /// (read from its `Connection.Start`; an `amqps://` broker is not probed).
    pub async fn health(&self) -> super::Health {
        if let Err(why) = self.check().await {
            return super::Health::Down(why);
        }
        if !self.url.starts_with("amqp://") {
            return super::Health::Up;
        }
        let Some(addr) = super::peer::urls(&self.url, 5672).into_iter().next() else {
            return super::Health::Up;
        };
        let version = self
            .server_version
            .get_or_try_init(|| async { super::peer::amqp_server_version(&addr).await.ok_or(()) })
            .await;
        match version {
            Ok(v) if !super::peer::at_least(v, MIN_SERVER) => super::Health::Unsupported(format!(
                "RabbitMQ {v} at {addr} is older than the oldest supported version, {}.{}",
                MIN_SERVER.0, MIN_SERVER.1
            )),
            _ => super::Health::Up,
        }
    }

    /// Nothing is queued client-side (a publish returns only once every confirm arrived):
    /// closes the connection cleanly.
    pub async fn flush(&self, limit: Duration) {
        let _ = timeout(limit, async {
            let connection = {
                let mut state = self.state.lock().await;
                state.session = None;
                state.connection.take()
            };
            if let Some(connection) = connection
                && connection.status().connected()
            {
                let _ = connection.close(200, "zdelay shutting down".into()).await;
            }
        })
        .await;
    }

    /// The current session, or a new one (connecting first if the connection is gone).
    async fn session(&self, limit: Duration) -> Result<Session, String> {
        let mut state = self.state.lock().await;
        if let Some(session) = &state.session
            && session.channel.status().connected()
        {
            return Ok(session.clone());
        }
        let old_exchanges = state.session.take().map(|s| s.exchanges);
        let connected = state
            .connection
            .as_ref()
            .is_some_and(|c| c.status().connected());
        if !connected {
            state.connection = None;
            let properties = ConnectionProperties::default()
                .with_connection_name(format!("zdelay sink {}", self.name).into());
            let tls = match &self.tls {
                Some(tls) => tls_config(tls)?,
                None => OwnedTLSConfig::default(),
            };
            let connect = Connection::connect_with_config(
                &self.url,
                properties,
                tls,
                lapin::runtime::default_runtime().map_err(|e| format!("connect: {e}"))?,
            );
            let connection = timeout(limit, connect)
                .await
                .map_err(|_| format!("timed out connecting after {limit:?}"))?
                .map_err(|e| connect_error(&e, &self.user))?;
            tracing::info!(sink = %self.name, "amqp connected");
            state.connection = Some(connection);
        }
        let connection = state.connection.as_ref().expect("connection set above");
        let channel = timeout(limit, async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(channel)
        })
        .await
        .map_err(|_| format!("timed out opening a channel after {limit:?}"))?
        .map_err(|e| format!("open channel: {e}"))?;
        let exchanges = if connected {
            // Same connection: what we learned about exchanges still holds.
            old_exchanges.unwrap_or_default()
        } else {
            Arc::default()
        };
        let session = Session {
            generation: self.generation.fetch_add(1, Ordering::Relaxed) + 1,
            channel,
            exchanges,
        };
        state.session = Some(session.clone());
        Ok(session)
    }

    /// Drops the connection of session `generation` (if still current): used when the
    /// broker stopped answering, so late confirms cannot meet a new batch.
    async fn reset(&self, generation: u64) {
        let mut state = self.state.lock().await;
        if state
            .session
            .as_ref()
            .is_some_and(|s| s.generation == generation)
        {
            state.session = None;
            state.connection = None;
            crate::sink_warning!(
                &self.name,
                sink = %self.name,
                "amqp connection dropped after a confirm timeout"
            );
        }
    }

    /// Passive-declares the exchanges of `pending` not yet known on this connection; stops
    /// at the first one the broker does not have (the channel is then closed).
    async fn check_exchanges(
        &self,
        session: &Session,
        prepared: &[Option<Prepared>],
        pending: &[usize],
    ) -> ExchangeCheck {
        let mut unknown: Vec<&ShortString> = Vec::new();
        {
            let known = session.exchanges.lock().expect("exchange set lock");
            for &i in pending {
                let p = prepared[i].as_ref().expect("pending messages are prepared");
                let name = p.exchange.as_str();
                if !name.is_empty() && !known.contains(name) && !unknown.contains(&&p.exchange) {
                    unknown.push(&p.exchange);
                }
            }
        }
        for exchange in unknown {
            let options = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            let result = session
                .channel
                .exchange_declare(
                    exchange.clone(),
                    lapin::ExchangeKind::Direct,
                    options,
                    FieldTable::default(),
                )
                .await;
            match result.as_ref().map_err(Failure::from) {
                Ok(()) => session.remember_exchange(exchange.as_str()),
                Err(Failure::Closed {
                    code: 404, text, ..
                }) => {
                    return ExchangeCheck::Missing {
                        exchange: exchange.to_string(),
                        reason: broker_reason(&text),
                    };
                }
                Err(Failure::Closed { .. }) => {
                    // Refused for another reason (e.g. 403): do not check it again; the
                    // publish gets the broker's verdict for its messages.
                    session.remember_exchange(exchange.as_str());
                    return ExchangeCheck::ChannelClosed;
                }
                // No connection: the publish meets it too, and says Unavailable.
                Err(_) => return ExchangeCheck::Ok,
            }
        }
        ExchangeCheck::Ok
    }
}

enum ExchangeCheck {
    Ok,
    Missing { exchange: String, reason: String },
    ChannelClosed,
}

impl Session {
    fn remember_exchange(&self, exchange: &str) {
        self.exchanges
            .lock()
            .expect("exchange set lock")
            .insert(exchange.to_owned());
    }

    fn forget_exchange(&self, exchange: &str) {
        self.exchanges
            .lock()
            .expect("exchange set lock")
            .remove(exchange);
    }
}

fn set_all(outcomes: &mut [Option<Outcome>], pending: &[usize], outcome: Outcome) {
    for &i in pending {
        outcomes[i] = Some(outcome.clone());
    }
}

/// Validates a message and builds its publish arguments; `Err` is a permanent reason.
fn prepare(message: &Message, max_size: usize) -> Result<Prepared, String> {
    let Some((exchange, routing_key)) = message.target.split_once('/') else {
        return Err(format!(
            "amqp target '{}' is not exchange/routing-key ('/queue' for the default exchange)",
            message.target
        ));
    };
    if max_size > 0 && message.payload.len() > max_size {
        return Err(too_large(message.payload.len(), max_size));
    }
    let short = |what: &str, s: &str| {
        ShortString::try_new(s).map_err(|_| format!("amqp {what} longer than 255 bytes: {s:.64}…"))
    };
    let exchange = short("exchange", exchange)?;
    let routing_key = short("routing key", routing_key)?;
    let message_id = short("message id", &message.idempotency_key())?;
    let mut headers = FieldTable::default();
    for (k, v) in &message.headers {
        headers.insert(
            short("header name", k)?,
            AMQPValue::LongString(LongString::from(v.as_bytes())),
        );
    }
    headers.insert(
        IDEMPOTENCY_HEADER.into(),
        AMQPValue::LongString(LongString::from(message_id.as_str().as_bytes())),
    );
    let mut properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(priority) = message.priority {
        properties = properties.with_priority(priority);
    }
    Ok(Prepared {
        exchange,
        routing_key,
        properties,
    })
}

/// Publishes `pending` (all of them first, then awaits every confirm) until `deadline`.
async fn publish_round(
    session: &Session,
    batch: &[Message],
    prepared: &[Option<Prepared>],
    pending: &[usize],
    deadline: Instant,
) -> Vec<(usize, Result<Confirm, Failure>)> {
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let mut results = Vec::with_capacity(pending.len());
    let mut confirms = Vec::with_capacity(pending.len());
    // Pipelined: up to PIPELINE publishes in flight. Each takes its delivery tag and queues
    // its frames in one synchronous step on its first poll, and first polls follow input
    // order, so the wire order is the batch order.
    let mut in_flight = futures::stream::FuturesOrdered::new();
    let mut next = 0;
    let mut done = vec![false; batch.len()];
    loop {
        while in_flight.len() < PIPELINE && next < pending.len() {
            let i = pending[next];
            next += 1;
            let p = prepared[i].as_ref().expect("pending messages are prepared");
            let publish = session.channel.basic_publish(
                p.exchange.clone(),
                p.routing_key.clone(),
                options,
                &batch[i].payload,
                p.properties.clone(),
            );
            in_flight.push_back(async move { (i, publish.await) });
        }
        match timeout_at(deadline, in_flight.next()).await {
            Ok(Some((i, result))) => {
                done[i] = true;
                match result {
                    Ok(confirm) => confirms.push((i, confirm)),
                    Err(e) => results.push((i, Err(Failure::from(&e)))),
                }
            }
            Ok(None) => break,
            Err(_) => {
                for &i in pending.iter().filter(|&&i| !done[i]) {
                    results.push((i, Err(Failure::Timeout("publishing".to_owned()))));
                }
                break;
            }
        }
    }
    for (i, confirm) in confirms {
        let result = match timeout_at(deadline, confirm).await {
            Ok(Ok(Confirmation::Ack(None))) => Ok(Confirm::Ack),
            Ok(Ok(Confirmation::Ack(Some(returned)))) => Ok(Confirm::Returned {
                code: returned.reply_code,
                text: returned.reply_text.to_string(),
            }),
            Ok(Ok(Confirmation::Nack(_))) => Ok(Confirm::Nack),
            Ok(Ok(Confirmation::NotRequested)) => Ok(Confirm::NotRequested),
            Ok(Err(e)) => Err(Failure::from(&e)),
            Err(_) => Err(Failure::Timeout("waiting for the confirm".to_owned())),
        };
        results.push((i, result));
    }
    results
}

/// The broker's answer to one published message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Confirm {
    Ack,
    /// Acked, but returned first: mandatory and no queue bound for its routing key.
    Returned {
        code: u16,
        text: String,
    },
    Nack,
    /// The channel was not in confirm mode (cannot happen: we select it).
    NotRequested,
}

/// The TLS settings lapin takes (rustls: PEM files as they are), read from the files now.
fn tls_config(tls: &TlsConfig) -> Result<OwnedTLSConfig, String> {
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("tls: cannot read {}: {e}", path.display()))
    };
    let cert_chain = match &tls.ca_file {
        Some(ca) => Some(
            String::from_utf8(read(ca)?)
                .map_err(|_| format!("tls: {} is not a PEM file", ca.display()))?,
        ),
        None => None,
    };
    let identity = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => Some(OwnedIdentity::PKCS8 {
            pem: read(cert)?,
            key: read(key)?,
        }),
        _ => None,
    };
    Ok(OwnedTLSConfig {
        identity,
        cert_chain,
    })
}

/// A failed connect in words: refused credentials (RabbitMQ closes the handshake with 403
/// ACCESS_REFUSED) say so, apart from an unreachable broker or a failed TLS handshake.
fn connect_error(e: &lapin::Error, user: &str) -> String {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403 => {
            super::auth_failed(&format!("user {user}"), &amqp.get_message().to_string())
        }
        _ => format!("connect: {e}"),
    }
}

/// Why a message got no confirm.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    /// No connection: refused, lost, missed heartbeats.
    Down(String),
    /// The broker closed the channel (soft error) or the connection (hard error).
    Closed {
        code: u16,
        text: String,
        hard: bool,
    },
    /// The channel was already closed when this message was to go out: it never left.
    NotSent(String),
    /// Nothing from the broker before the deadline.
    Timeout(String),
    Other(String),
}

impl From<&lapin::Error> for Failure {
    fn from(e: &lapin::Error) -> Self {
        match e.kind() {
            ErrorKind::ProtocolError(amqp) => Failure::Closed {
                code: amqp.get_id(),
                text: amqp.get_message().to_string(),
                hard: e.is_amqp_hard_error(),
            },
            ErrorKind::IOError(_)
            | ErrorKind::RuntimeShutdownError(_)
            | ErrorKind::MissingHeartbeatError
            | ErrorKind::InvalidConnectionState(_) => Failure::Down(e.to_string()),
            ErrorKind::InvalidChannelState(..) | ErrorKind::InvalidChannel(_) => {
                Failure::NotSent(e.to_string())
            }
            _ => Failure::Other(e.to_string()),
        }
    }
}

impl Failure {
    /// The broker's `max_message_size`, when this is its "message too large" close.
    fn max_message_size(&self) -> Option<usize> {
        match self {
            Failure::Closed {
                code: 406, text, ..
            } => number_after(text, "max size "),
            _ => None,
        }
    }
}

/// What to do with one message after a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Final(Outcome),
    /// It did not cause the failure and was not confirmed: publish it again on a new
    /// channel (the cause, for the log).
    Again(String),
}

/// Confirm → outcome: Ack → Delivered, Ack of a returned message → Missing (unroutable: no
/// queue is bound for it yet), Nack → Retry.
fn outcome_of_confirm(confirm: Confirm, target: &str) -> Outcome {
    match confirm {
        Confirm::Ack => Outcome::Delivered,
        Confirm::Returned { code, text } => {
            Outcome::Missing(format!("unroutable: {code} {text} (target {target})"))
        }
        Confirm::Nack => Outcome::Retry("nacked by the broker".to_owned()),
        Confirm::NotRequested => Outcome::Retry("channel not in confirm mode".to_owned()),
    }
}

/// Failure → outcome for one message (its exchange and payload size decide whether the
/// broker's channel close was about it). See the table in the module's tests.
fn classify_failure(failure: &Failure, exchange: &str, payload_len: usize) -> Verdict {
    use Verdict::{Again, Final};
    match failure {
        Failure::Down(why) => Final(Outcome::Unavailable(why.clone())),
        Failure::Timeout(what) => Final(Outcome::Unavailable(format!(
            "no answer from the broker {what} (blocked or unreachable)"
        ))),
        Failure::NotSent(why) => Again(why.clone()),
        Failure::Other(why) => Final(Outcome::Retry(why.clone())),
        Failure::Closed {
            code: 320, text, ..
        } => Final(Outcome::Unavailable(format!(
            "connection closed by the broker: {text}"
        ))),
        Failure::Closed {
            code,
            text,
            hard: true,
        } => Final(Outcome::Retry(format!(
            "connection closed by the broker: {code} {text}"
        ))),
        Failure::Closed {
            code: 406, text, ..
        } if text.contains("message size") => {
            let max = number_after(text, "max size ");
            let size = number_after(text, "message size ");
            let ours = match max {
                Some(max) => payload_len > max,
                None => size == Some(payload_len),
            };
            if ours {
                Final(Outcome::Reject(match max {
                    Some(max) => too_large(payload_len, max),
                    None => broker_reason(text),
                }))
            } else {
                Again(text.clone())
            }
        }
        Failure::Closed {
            code: 404, text, ..
        } => match quoted_after(text, "no exchange '") {
            Some(name) if name == exchange => Final(Outcome::Missing(broker_reason(text))),
            Some(_) => Again(text.clone()),
            None => Final(Outcome::Retry(broker_reason(text))),
        },
        Failure::Closed {
            code: 403, text, ..
        } => match quoted_after(text, "exchange '") {
            Some(name) if name != exchange => Again(text.clone()),
            _ => Final(Outcome::Reject(format!(
                "not authorized: {}",
                broker_reason(text)
            ))),
        },
        Failure::Closed { code, text, .. } => Final(Outcome::Retry(format!(
            "channel closed by the broker: {code} {text}"
        ))),
    }
}

fn too_large(len: usize, max: usize) -> String {
    format!("message too large: {len} bytes > the broker's max_message_size {max}")
}

/// `NOT_FOUND - no exchange 'x' in vhost '/'` → `no exchange 'x' in vhost '/'`.
fn broker_reason(text: &str) -> String {
    text.split_once(" - ")
        .map_or(text, |(_, rest)| rest)
        .to_owned()
}

fn number_after(text: &str, marker: &str) -> Option<usize> {
    let rest = &text[text.find(marker)? + marker.len()..];
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

fn quoted_after<'a>(text: &'a str, marker: &str) -> Option<&'a str> {
    let rest = &text[text.find(marker)? + marker.len()..];
    rest.split_once('\'').map(|(name, _)| name)
}

impl super::Sink for AmqpSink {
    fn depth<'a>(&'a self, target: &'a str) -> futures::future::BoxFuture<'a, Result<u64, String>> {
        Box::pin(AmqpSink::depth(self, target))
    }

    fn publish<'a>(&'a self, batch: &'a [Message]) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(AmqpSink::publish(self, batch))
    }

    fn check(&self) -> futures::future::BoxFuture<'_, super::Health> {
        Box::pin(AmqpSink::health(self))
    }

    fn flush(&self, timeout: Duration) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(AmqpSink::flush(self, timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn closed(code: u16, text: &str) -> Failure {
        Failure::Closed {
            code,
            text: text.to_owned(),
            hard: false,
        }
    }

    fn is_reject(v: &Verdict, needle: &str) -> bool {
        matches!(v, Verdict::Final(Outcome::Reject(r)) if r.contains(needle))
    }

    #[test]
    fn confirms() {
        assert_eq!(outcome_of_confirm(Confirm::Ack, "ex/k"), Outcome::Delivered);
        assert_eq!(
            outcome_of_confirm(
                Confirm::Returned {
                    code: 312,
                    text: "NO_ROUTE".into()
                },
                "ex/k"
            ),
            Outcome::Missing("unroutable: 312 NO_ROUTE (target ex/k)".into())
        );
        assert!(matches!(
            outcome_of_confirm(Confirm::Nack, "ex/k"),
            Outcome::Retry(_)
        ));
    }

    #[test]
    fn oversize_rejects_only_the_large_message() {
        let f = closed(
            406,
            "PRECONDITION_FAILED - message size 8388609 is larger than configured max size 8388608",
        );
        assert_eq!(f.max_message_size(), Some(8_388_608));
        let v = classify_failure(&f, "", 8_388_609);
        assert!(is_reject(&v, "message too large: 8388609 bytes"), "{v:?}");
        assert!(matches!(classify_failure(&f, "", 100), Verdict::Again(_)));
        // Without the max in the text, the size names the culprit.
        let f = closed(406, "PRECONDITION_FAILED - message size 10 is too large");
        assert!(is_reject(&classify_failure(&f, "", 10), "message size 10"));
        assert!(matches!(classify_failure(&f, "", 9), Verdict::Again(_)));
        // Another 406: nobody is identified, every message retries (attempts count).
        let f = closed(406, "PRECONDITION_FAILED - invalid expiration");
        assert!(matches!(
            classify_failure(&f, "", 9),
            Verdict::Final(Outcome::Retry(_))
        ));
    }

    #[test]
    fn a_missing_exchange_holds_its_messages() {
        let f = closed(404, "NOT_FOUND - no exchange 'nope' in vhost '/'");
        let v = classify_failure(&f, "nope", 1);
        assert_eq!(
            v,
            Verdict::Final(Outcome::Missing("no exchange 'nope' in vhost '/'".into()))
        );
        assert!(matches!(
            classify_failure(&f, "other", 1),
            Verdict::Again(_)
        ));
        assert!(matches!(classify_failure(&f, "", 1), Verdict::Again(_)));
    }

    #[test]
    fn access_refused_rejects() {
        let f = closed(
            403,
            "ACCESS_REFUSED - write access to exchange 'x' in vhost '/' refused for user 'u'",
        );
        assert!(is_reject(
            &classify_failure(&f, "x", 1),
            "not authorized: write access"
        ));
        assert!(matches!(classify_failure(&f, "y", 1), Verdict::Again(_)));
        let f = closed(403, "ACCESS_REFUSED - something");
        assert!(is_reject(&classify_failure(&f, "y", 1), "not authorized"));
    }

    #[test]
    fn connection_failures_are_unavailable() {
        for f in [
            Failure::Down("IO error: Connection refused (os error 111)".into()),
            Failure::Timeout("waiting for the confirm".into()),
            Failure::Closed {
                code: 320,
                text: "CONNECTION_FORCED - broker forced connection closure".into(),
                hard: true,
            },
        ] {
            assert!(
                matches!(
                    classify_failure(&f, "", 1),
                    Verdict::Final(Outcome::Unavailable(_))
                ),
                "{f:?}"
            );
        }
        let hard = Failure::Closed {
            code: 505,
            text: "UNEXPECTED_FRAME".into(),
            hard: true,
        };
        assert!(matches!(
            classify_failure(&hard, "", 1),
            Verdict::Final(Outcome::Retry(_))
        ));
        assert!(matches!(
            classify_failure(&Failure::NotSent("closed".into()), "", 1),
            Verdict::Again(_)
        ));
        assert!(matches!(
            classify_failure(&closed(405, "RESOURCE_LOCKED - x"), "", 1),
            Verdict::Final(Outcome::Retry(_))
        ));
    }

    fn message(target: &str) -> Message {
        Message {
            id: "01J".into(),
            due_ms: 1700,
            target: target.into(),
            payload: vec![0, 255, 1],
            headers: BTreeMap::from([("trace".to_owned(), "abc".to_owned())]),
            priority: Some(7),
        }
    }

    #[test]
    fn prepare_sets_properties() {
        let p = prepare(&message("/jobs"), 0).unwrap();
        assert_eq!(p.exchange.as_str(), "");
        assert_eq!(p.routing_key.as_str(), "jobs");
        assert_eq!(
            p.properties.message_id().as_ref().unwrap().as_str(),
            "01J:1700"
        );
        assert_eq!(*p.properties.delivery_mode(), Some(2));
        assert_eq!(*p.properties.priority(), Some(7));
        let headers = p.properties.headers().as_ref().unwrap();
        assert!(headers.inner().contains_key("trace"));
        assert!(headers.inner().contains_key(IDEMPOTENCY_HEADER));

        let p = prepare(&message("ex/a/b"), 0).unwrap();
        assert_eq!((p.exchange.as_str(), p.routing_key.as_str()), ("ex", "a/b"));
        assert!(
            prepare(&message("noslash"), 0)
                .unwrap_err()
                .contains("exchange/routing-key")
        );
        assert!(
            prepare(&message("/q"), 2)
                .unwrap_err()
                .contains("too large")
        );
        let long = format!("/{}", "k".repeat(300));
        assert!(
            prepare(&message(&long), 0)
                .unwrap_err()
                .contains("255 bytes")
        );
    }

    /// The poller spawns publishes: the futures must be `Send` (and refused is Unavailable).
    #[tokio::test]
    async fn publish_is_spawnable_and_refused_is_unavailable() {
        let config: AmqpSinkConfig =
            serde_json::from_value(serde_json::json!({ "url": "amqp://127.0.0.1:1/%2f" })).unwrap();
        let sink = Arc::new(AmqpSink::new("r", &config).unwrap());
        let batch = vec![message("/q"), message("bad")];
        let s = sink.clone();
        let outcomes = tokio::spawn(async move { s.publish(&batch).await })
            .await
            .unwrap();
        assert!(
            matches!(&outcomes[0], Outcome::Unavailable(_)),
            "{outcomes:?}"
        );
        assert!(matches!(&outcomes[1], Outcome::Reject(_)), "{outcomes:?}");
        let s = sink.clone();
        assert!(
            tokio::spawn(async move { s.check().await })
                .await
                .unwrap()
                .is_err()
        );
        sink.flush(Duration::from_secs(1)).await;
    }

    #[test]
    fn new_does_not_connect_and_checks_the_url() {
        let config = |url: &str| -> AmqpSinkConfig {
            serde_json::from_value(serde_json::json!({ "url": url })).unwrap()
        };
        assert!(AmqpSink::new("r", &config("amqp://guest:guest@127.0.0.1:1/%2f")).is_ok());
        assert!(AmqpSink::new("r", &config("http://x")).is_err());
    }
}
