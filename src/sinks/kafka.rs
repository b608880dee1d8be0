//! Kafka sink: an idempotent librdkafka producer (`acks=all`, `enable.idempotence=true`)
//! whose delivery reports are awaited before a job counts as delivered.
//!
//! A batch is enqueued in full first (librdkafka batches and lingers), then every delivery
//! future is awaited. Both waits (for room in a full local queue, for the reports) end at one
//! deadline per batch, `poller.publish_deadline()` after it started (the claim lease less the
//! settle's margin): a message without a report by then is `Unavailable` and its job goes
//! back to due before its lease could pass to another poller. librdkafka's own
//! `message.timeout.ms` ends within that deadline too (capped by default, refused by config
//! validation when set above it), so it gives up on a message before the batch does.
//! Each message resolves to one [`Outcome`]:
//! - an unknown topic → `Missing` (the job waits for the topic, or dies per its route);
//! - broker errors that no retry can fix (too large, not authorized) → `Reject` with the
//!   broker's reason;
//! - the broker unreachable → `Unavailable`. librdkafka itself only says so by letting
//!   messages time out, so while a batch waits the sink probes the cluster (a metadata
//!   request bounded to [`PROBE_TIMEOUT`]) every [`PROBE_EVERY`]. A connection-level probe
//!   failure (refused, all brokers down) purges the producer's queued and in-flight
//!   messages, which resolve at once as `Unavailable`, and the producer is replaced (see
//!   `KafkaSink::rebuild`). A probe that merely times out (busy broker) purges nothing;
//!   messages that then time out count as `Unavailable` too, since the broker does not
//!   answer at all, while timeouts against a broker that answers are `Retry`;
//! - anything else (local queue full, timeouts while the broker answers, transient
//!   broker errors) → `Retry`.
//!
//! Every record carries the envelope headers plus `zdelay-id: <id>:<due>`, and by default
//! the job id as its key. tansu (the test broker) has no topic auto-creation, and librdkafka
//! reports a missing topic as `_MSG_TIMED_OUT` unless `topic.metadata.propagation.max.ms`
//! is below `message.timeout.ms`: the defaults here make it `Missing` within ~1 s.

use futures::FutureExt;
use std::collections::VecDeque;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use rdkafka::ClientContext;
use rdkafka::client::Client;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer, PurgeConfig};

use super::{IDEMPOTENCY_HEADER, Message, Outcome, SinkError};
use zdelay_core::config::{KafkaKey, KafkaSinkConfig};

/// How long a batch waits before the first connectivity probe, and between probes.
pub const PROBE_EVERY: Duration = Duration::from_secs(2);
/// Bound of one connectivity probe (metadata request) inside `publish`.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// Bound of [`KafkaSink::check`].
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause before retrying an enqueue that hit a full local queue with nothing of ours in
/// flight to wait for.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(10);

/// Producer defaults, applied before the user's `librdkafka` map (which wins).
pub const DEFAULTS: &[(&str, &str)] = &[
    // Delivered = on every in-sync replica; no duplicates from producer retries.
    ("acks", "all"),
    ("enable.idempotence", "true"),
    // Throughput: short linger, large batches, deep local queue.
    ("linger.ms", "5"),
    ("batch.num.messages", "10000"),
    ("compression.type", "none"),
    ("queue.buffering.max.messages", "1000000"),
    ("queue.buffering.max.kbytes", "1048576"),
    // Reconnect soon after a broker comes back (librdkafka's default backs off to 10 s).
    ("reconnect.backoff.max.ms", "2000"),
];

/// `message.timeout.ms` unless the sink's `librdkafka` map sets it: a delivery report comes
/// back within this, success or not. Capped to the publish deadline.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(15);
/// `topic.metadata.propagation.max.ms`, at most: below the message timeout, so a missing topic
/// fails as unknown (`Missing`) after 1 s instead of as a message timeout.
const TOPIC_PROPAGATION: Duration = Duration::from_secs(1);

/// What to do with a failed message, by librdkafka error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Permanent for this message: dead with the broker's reason.
    Reject,
    /// The topic does not exist: the job waits for it (or dies, per its route).
    Missing,
    /// Transient: back to due after backoff, one attempt counted.
    Retry,
    /// The sink as a whole cannot deliver: pause, no attempt counted.
    Unavailable,
    /// Timeouts and transport errors: `Unavailable` when a probe finds the broker
    /// unreachable, else `Retry`.
    ProbeBroker,
}

/// Classifies a produce or delivery error code. Pure: unit-tested over the codes.
pub fn classify(code: RDKafkaErrorCode) -> ErrorClass {
    use RDKafkaErrorCode as C;
    match code {
        C::MessageSizeTooLarge
        | C::MessageBatchTooLarge // RECORD_LIST_TOO_LARGE
        | C::InvalidMessageSize
        | C::UnknownPartition
        | C::InvalidTopic
        | C::TopicAuthorizationFailed
        | C::InvalidRecord
        | C::PolicyViolation
        | C::UnsupportedForMessageFormat => ErrorClass::Reject,
        C::UnknownTopicOrPartition | C::UnknownTopic => ErrorClass::Missing,
        // No broker, or nothing this producer sends can be accepted: the sink is down,
        // not the message. Purges come from our own probe finding the broker unreachable.
        C::AllBrokersDown
        | C::Resolve
        | C::PurgeQueue
        | C::PurgeInflight
        | C::Authentication
        | C::SSL
        | C::SaslAuthenticationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed => ErrorClass::Unavailable,
        C::MessageTimedOut
        | C::RequestTimedOut
        | C::OperationTimedOut
        | C::TimedOutQueue
        | C::BrokerTransportFailure
        | C::BrokerNotAvailable
        | C::NetworkException
        // UNKNOWN_SERVER_ERROR: what a broker that is shutting down may answer (tansu
        // does); the probe tells an outage from a one-off failure.
        | C::Unknown => ErrorClass::ProbeBroker,
        // QueueFull, leader elections, not enough replicas, fatal idempotence errors (the
        // producer is rebuilt), and whatever else.
        _ => ErrorClass::Retry,
    }
}

/// The librdkafka properties of the typed `sasl` and `tls` options. Pure: unit-tested.
pub fn security_properties(config: &KafkaSinkConfig) -> Vec<(&'static str, String)> {
    let protocol = match (&config.sasl, &config.tls) {
        (None, None) => return Vec::new(),
        (Some(_), None) => "SASL_PLAINTEXT",
        (None, Some(_)) => "SSL",
        (Some(_), Some(_)) => "SASL_SSL",
    };
    let mut props = vec![("security.protocol", protocol.to_owned())];
    if let Some(sasl) = &config.sasl {
        props.push(("sasl.mechanism", sasl.mechanism.as_str().to_owned()));
        props.push(("sasl.username", sasl.username.clone()));
        props.push(("sasl.password", sasl.password.expose().to_owned()));
    }
    if let Some(tls) = &config.tls {
        let path = |p: &std::path::Path| p.display().to_string();
        if let Some(ca) = &tls.ca_file {
            props.push(("ssl.ca.location", path(ca)));
        }
        if let Some(cert) = &tls.cert_file {
            props.push(("ssl.certificate.location", path(cert)));
        }
        if let Some(key) = &tls.key_file {
            props.push(("ssl.key.location", path(key)));
        }
        if tls.insecure_skip_verify {
            props.push(("enable.ssl.certificate.verification", "false".to_owned()));
            props.push(("ssl.endpoint.identification.algorithm", "none".to_owned()));
        }
    }
    props
}

/// The librdkafka configuration for a sink: [`DEFAULTS`], the message timeout (capped to
/// `publish_deadline`), the typed security options, then the user's map (which wins).
pub fn client_config(
    name: &str,
    config: &KafkaSinkConfig,
    publish_deadline: Duration,
) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &config.brokers);
    cc.set("client.id", format!("zdelay-{name}"));
    for (k, v) in DEFAULTS {
        cc.set(*k, *v);
    }
    let message_timeout = MESSAGE_TIMEOUT
        .min(publish_deadline)
        .max(Duration::from_millis(2));
    cc.set(
        "message.timeout.ms",
        message_timeout.as_millis().to_string(),
    );
    cc.set(
        "topic.metadata.propagation.max.ms",
        TOPIC_PROPAGATION
            .min(message_timeout / 2)
            .as_millis()
            .to_string(),
    );
    for (k, v) in security_properties(config) {
        cc.set(k, v);
    }
    for (k, v) in &config.librdkafka {
        cc.set(k, v);
    }
    cc
}

/// The last authentication failure librdkafka reported (its error callback), until a
/// metadata request succeeds again. librdkafka itself only lets requests time out when the
/// broker refuses the credentials, so this is what tells "wrong password" from "unreachable".
type AuthFailure = Arc<std::sync::Mutex<Option<String>>>;

/// Routes librdkafka's log lines and global errors to `tracing`, tagged with the sink. Its
/// errors (a broker unreachable, credentials refused) join the sink's outage episode
/// (`metrics::error_event`): logged when they start one, counted while it lasts, however
/// often librdkafka retries.
struct SinkContext {
    sink: String,
    auth_failure: AuthFailure,
}

/// Error codes that mean the broker refused our credentials (or the TLS handshake).
pub fn is_auth_failure(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed
    )
}

/// librdkafka's log facility for a broker connection that failed: each such line is also
/// reported to the error callback, which is where the sink's episode counts it.
const CONNECTION_FAILED: &str = "FAIL";

impl ClientContext for SinkContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, line: &str) {
        let sink = &self.sink;
        match level {
            _ if fac == CONNECTION_FAILED => tracing::debug!(sink, fac, "librdkafka: {line}"),
            // What librdkafka says while the sink is known to be down is part of that outage.
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
            | RDKafkaLogLevel::Warning => {
                crate::sink_warning!(sink, sink, fac, "librdkafka: {line}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(sink, fac, "librdkafka: {line}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(sink, fac, "librdkafka: {line}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let why = if error.rdkafka_error_code().is_some_and(is_auth_failure) {
            *self.auth_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_owned());
            format!("kafka authentication failed: {reason}")
        } else {
            format!("kafka client error: {reason}")
        };
        crate::metrics::error_event(super::handle::UNAVAILABLE, &self.sink, &why);
    }
}

type Prod = FutureProducer<SinkContext>;

/// A Kafka sink. Cheap to share behind an `Arc`; `publish` may run concurrently.
pub struct KafkaSink {
    name: String,
    config: ClientConfig,
    key: KafkaKey,
    /// Who authenticates: the SASL user, if any (for "authentication failed for user …").
    user: Option<String>,
    auth_failure: AuthFailure,
    /// How long one batch may take, enqueue to last report (see the module doc).
    publish_deadline: Duration,
    /// Replaced after a fatal (idempotence) error, which leaves a producer unusable.
    producer: RwLock<Arc<Prod>>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Outcomes of one batch as its delivery reports arrive.
struct Resolution<'a> {
    batch: &'a [Message],
    outcomes: Vec<Option<Outcome>>,
    /// Failures waiting for a probe verdict: (index, reason).
    suspect: Vec<(usize, String)>,
    /// A failure that leaves a hole in the idempotent sequence, if any.
    gap: Option<RDKafkaErrorCode>,
}

impl<'a> Resolution<'a> {
    fn new(batch: &'a [Message]) -> Self {
        Resolution {
            batch,
            outcomes: vec![None; batch.len()],
            suspect: Vec::new(),
            gap: None,
        }
    }

    /// A delivery report; `None` when the future was canceled (producer gone).
    fn settle(&mut self, i: usize, report: Option<OwnedDeliveryResult>) {
        match report {
            Some(Ok(_)) => self.outcomes[i] = Some(Outcome::Delivered),
            Some(Err((err, _))) => self.failed(i, &err),
            None => {
                let topic = &self.batch[i].target;
                self.outcomes[i] = Some(Outcome::Retry(format!(
                    "kafka topic {topic}: producer gone before the delivery report"
                )));
            }
        }
    }

    fn failed(&mut self, i: usize, err: &KafkaError) {
        let reason = format!("kafka topic {}: {err}", self.batch[i].target);
        let code = err.rdkafka_error_code();
        if let Some(code) = code
            && leaves_sequence_gap(code)
        {
            self.gap.get_or_insert(code);
        }
        let class = code.map(classify).unwrap_or(ErrorClass::Retry);
        self.outcomes[i] = match class {
            ErrorClass::Reject => Some(Outcome::Reject(reason)),
            ErrorClass::Missing => Some(Outcome::Missing(reason)),
            ErrorClass::Retry => Some(Outcome::Retry(reason)),
            ErrorClass::Unavailable => Some(Outcome::Unavailable(reason)),
            ErrorClass::ProbeBroker => {
                self.suspect.push((i, reason));
                None
            }
        };
    }

    /// No report by the publish deadline (or not even enqueued by then): the job goes back
    /// to due without an attempt counted, and the sink pauses until its broker answers.
    fn past_deadline(&mut self, i: usize, deadline: Duration, sent: bool) {
        let topic = &self.batch[i].target;
        let what = if sent {
            "no delivery report"
        } else {
            "local queue still full"
        };
        self.outcomes[i] = Some(Outcome::Unavailable(format!(
            "kafka topic {topic}: {what} within the publish deadline of {deadline:?} \
             (poller.lease less the settle margin)"
        )));
    }

    /// Outcomes in input order; `down` is the probe's verdict (Some = unreachable).
    fn finish(mut self, down: Option<&str>) -> Vec<Outcome> {
        for (i, reason) in std::mem::take(&mut self.suspect) {
            self.outcomes[i] = Some(match down {
                Some(why) => Outcome::Unavailable(format!("{reason} ({})", down_note(why))),
                None => Outcome::Retry(reason),
            });
        }
        self.outcomes
            .into_iter()
            .map(|o| match (o, down) {
                (Some(Outcome::Unavailable(r)), Some(why)) if !r.contains(why) => {
                    Outcome::Unavailable(format!("{r} ({})", down_note(why)))
                }
                (Some(o), _) => o,
                (None, _) => Outcome::Retry("kafka: message left unresolved".to_owned()),
            })
            .collect()
    }
}

impl KafkaSink {
    /// Builds the producer for the default `poller.lease`: see [`KafkaSink::with_deadline`].
    pub fn new(name: &str, config: &KafkaSinkConfig) -> Result<Self, SinkError> {
        Self::with_deadline(
            name,
            config,
            zdelay_core::config::PollerConfig::default().publish_deadline(),
        )
    }

    /// Builds the producer; a batch takes at most `publish_deadline`. Does not contact the
    /// broker (librdkafka connects lazily), so a sink can be built while its broker is down.
    pub fn with_deadline(
        name: &str,
        config: &KafkaSinkConfig,
        publish_deadline: Duration,
    ) -> Result<Self, SinkError> {
        let bad = |why: String| SinkError::Config {
            sink: name.to_owned(),
            why,
        };
        if config.brokers.trim().is_empty() {
            return Err(bad("brokers is empty".into()));
        }
        let cc = client_config(name, config, publish_deadline);
        let auth_failure = AuthFailure::default();
        let producer = create(name, &cc, &auth_failure).map_err(|e| bad(e.to_string()))?;
        Ok(KafkaSink {
            name: name.to_owned(),
            config: cc,
            key: config.key,
            // The librdkafka table wins over `sasl`, as it does for the client itself.
            user: config
                .librdkafka
                .get("sasl.username")
                .cloned()
                .or_else(|| config.sasl.as_ref().map(|s| s.username.clone())),
            auth_failure,
            publish_deadline,
            producer: RwLock::new(Arc::new(producer)),
        })
    }

    /// "authentication failed for user …" when librdkafka reported a refused login since
    /// the last successful metadata request.
    fn auth_failed(&self) -> Option<String> {
        let failure = self.auth_failure.lock().unwrap_or_else(|p| p.into_inner());
        failure.as_ref().map(|detail| match &self.user {
            Some(user) => super::auth_failed(&format!("user {user}"), detail),
            None => super::auth_failed("a client without SASL", detail),
        })
    }

    /// A probe through the current producer, read with what the error callback saw.
    async fn probe(&self, producer: &Arc<Prod>, timeout: Duration) -> Probe {
        let probe = probe(producer, timeout).await;
        if probe == Probe::Reachable {
            *self.auth_failure.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return probe;
        }
        match self.auth_failed() {
            Some(why) => Probe::Unreachable(why),
            None => probe,
        }
    }

    fn producer(&self) -> Arc<Prod> {
        match self.producer.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Publishes the batch and waits for every delivery report: one outcome per message,
    /// in input order. Returns by the publish deadline: sooner when every report is in, or
    /// when a probe finds the broker unreachable.
    pub async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let producer = self.producer();
        let deadline = Instant::now() + self.publish_deadline;
        let mut res = Resolution::new(batch);
        let mut pending: VecDeque<(usize, DeliveryFuture)> = VecDeque::with_capacity(batch.len());
        // Messages that got no report by the deadline: librdkafka may still hold them.
        let mut abandoned = false;

        // 1. Enqueue everything; librdkafka batches per partition.
        for (i, msg) in batch.iter().enumerate() {
            if Instant::now() >= deadline {
                // Not sent at all: nothing can reach the topic after the job went back.
                res.past_deadline(i, self.publish_deadline, false);
                continue;
            }
            let mut headers = OwnedHeaders::new_with_capacity(msg.headers.len() + 1);
            for (k, v) in &msg.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_str()),
                });
            }
            let idem = msg.idempotency_key();
            headers = headers.insert(Header {
                key: IDEMPOTENCY_HEADER,
                value: Some(idem.as_str()),
            });
            let mut record = FutureRecord::<str, [u8]>::to(&msg.target)
                .payload(&msg.payload)
                .headers(headers);
            if self.key == KafkaKey::Id {
                record = record.key(msg.id.as_str());
            }
            loop {
                match producer.send_result(record) {
                    Ok(fut) => {
                        pending.push_back((i, fut));
                        break;
                    }
                    Err((err, back))
                        if err.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull) =>
                    {
                        // Make room by waiting for our oldest message, or briefly when the
                        // queue is full of other batches' messages; never past the deadline.
                        record = back;
                        match pending.front_mut() {
                            Some((j, fut)) => {
                                if let Ok(report) = tokio::time::timeout_at(deadline, fut).await {
                                    res.settle(*j, report.ok());
                                    pending.pop_front();
                                }
                            }
                            None => {
                                let pause = Instant::now() + QUEUE_FULL_PAUSE;
                                tokio::time::sleep_until(pause.min(deadline)).await;
                            }
                        }
                        if Instant::now() >= deadline {
                            res.past_deadline(i, self.publish_deadline, false);
                            break;
                        }
                    }
                    Err((err, _)) => {
                        res.failed(i, &err);
                        break;
                    }
                }
            }
        }

        // 2. Await every delivery report until the deadline, probing the broker while they
        // are slow.
        let mut down: Option<String> = None;
        let mut probe_at = Instant::now() + PROBE_EVERY;
        while let Some((i, mut fut)) = pending.pop_front() {
            let report = loop {
                tokio::select! {
                    report = &mut fut => break Some(report.ok()),
                    _ = tokio::time::sleep_until(probe_at.min(deadline)) => {
                        let Some(left) = deadline.checked_duration_since(Instant::now())
                            .filter(|left| !left.is_zero())
                        else {
                            break None;
                        };
                        // Only a connection-level failure purges: a busy broker that is
                        // merely slow keeps its messages until message.timeout.ms.
                        if let Probe::Unreachable(why) =
                            self.probe(&producer, PROBE_TIMEOUT.min(left)).await
                        {
                            // The outage's episode already says the sink is down, once.
                            tracing::debug!(sink = %self.name, reason = %why,
                                "kafka broker unreachable; purging queued messages");
                            // Queued and in-flight messages resolve now with _PURGE_*
                            // (Unavailable); the producer is replaced below.
                            producer.purge(
                                PurgeConfig::default().queue().inflight().non_blocking(),
                            );
                            down = Some(why);
                        }
                        probe_at = Instant::now() + PROBE_EVERY;
                    }
                }
            };
            match report {
                Some(report) => res.settle(i, report),
                None => {
                    // The deadline: reports already in count, the rest are abandoned.
                    abandoned = true;
                    for (j, fut) in std::iter::once((i, fut)).chain(pending.drain(..)) {
                        match fut.now_or_never() {
                            Some(report) => res.settle(j, report.ok()),
                            None => res.past_deadline(j, self.publish_deadline, true),
                        }
                    }
                }
            }
        }

        // 3. Timeouts and transport errors: the broker's reachability decides.
        // Messages that timed out against a broker that does not even answer a metadata
        // request (unreachable or hung) are the sink's failure, not the job's.
        let purged = down.is_some();
        if !res.suspect.is_empty() && down.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            down = if left.is_zero() {
                Some("no time left to probe it before the publish deadline".to_owned())
            } else {
                match self.probe(&producer, PROBE_TIMEOUT.min(left)).await {
                    Probe::Reachable => None,
                    Probe::Slow(why) | Probe::Unreachable(why) => Some(why),
                }
            };
        }
        let gap = res.gap;
        let outcomes = res.finish(down.as_deref());

        let replaced = if let Some((code, reason)) = producer.client().fatal_error() {
            self.rebuild(&producer, &format!("fatal error {code:?}: {reason}"))
        } else if purged {
            self.rebuild(
                &producer,
                "messages purged while the broker was unreachable",
            )
        } else if let Some(code) = gap {
            self.rebuild(
                &producer,
                &format!("failed deliveries ({code:?}) left a sequence gap"),
            )
        } else if abandoned {
            // Whatever it still holds is dropped with it, rather than delivered after its
            // job went back to due (and would leave a sequence gap when it times out).
            self.rebuild(
                &producer,
                "messages left without a delivery report at the publish deadline",
            )
        } else {
            false
        };
        if replaced {
            // The last holder's drop purges and flushes (blocking): off the async threads.
            tokio::task::spawn_blocking(move || drop(producer));
        }
        outcomes
    }

    /// A real health check: a metadata request bounded to [`CHECK_TIMEOUT`].
    /// `Err(reason)` when no broker answers (or the producer hit a fatal error, in which
    /// case it is rebuilt and the next check may pass).
    pub async fn check(&self) -> Result<(), String> {
        let producer = self.producer();
        if let Some((code, reason)) = producer.client().fatal_error() {
            self.rebuild(&producer, &format!("fatal error {code:?}: {reason}"));
            return Err(format!("kafka producer fatal error {code:?}: {reason}"));
        }
        match self.probe(&producer, CHECK_TIMEOUT).await {
            Probe::Reachable => Ok(()),
            Probe::Slow(why) | Probe::Unreachable(why) => Err(why),
        }
    }

    /// Whether `topic` exists, from a metadata read of every topic: a request naming the
    /// topic could make a broker with `auto.create.topics.enable` create it. `Err` when no
    /// broker answers.
    pub async fn topic_exists(&self, topic: &str) -> Result<bool, String> {
        self.check().await?;
        let producer = self.producer();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, CHECK_TIMEOUT)
                .map(|m| m.topics().iter().any(|t| t.name() == topic))
                .map_err(|e| format!("metadata request failed: {e}"))
        })
        .await
        .map_err(|e| format!("metadata task failed: {e}"))?
    }

    /// Waits up to `timeout` for queued messages to be delivered (call before exit).
    pub async fn flush(&self, timeout: Duration) {
        let producer = self.producer();
        let name = self.name.clone();
        let res = tokio::task::spawn_blocking(move || {
            let res = producer.flush(timeout);
            (res, producer.in_flight_count())
        })
        .await;
        match res {
            Ok((Ok(()), _)) => {}
            Ok((Err(err), left)) => {
                tracing::warn!(sink = %name, error = %err, left, "kafka flush incomplete")
            }
            Err(err) => tracing::warn!(sink = %name, error = %err, "kafka flush task failed"),
        }
    }

    /// Replaces the producer `used` (unless another publish already did) with a fresh one,
    /// which gets a new producer id from the broker. Needed after a fatal error, and after
    /// failures that leave a gap in the idempotent sequence: librdkafka then bumps the
    /// producer epoch (KIP-360), which tansu does not support (every later produce fails
    /// with UNKNOWN_SERVER_ERROR). Batches still running on the old producer keep it alive
    /// until they resolve. Whether `used` is no longer the current producer.
    fn rebuild(&self, used: &Arc<Prod>, why: &str) -> bool {
        let mut slot = match self.producer.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if !Arc::ptr_eq(&slot, used) {
            return true;
        }
        // Routine after an outage purged messages (the outage itself is the sink's episode,
        // already logged): information, not a warning.
        tracing::info!(sink = %self.name, reason = %why, "replacing the kafka producer");
        match create(&self.name, &self.config, &self.auth_failure) {
            Ok(p) => {
                *slot = Arc::new(p);
                true
            }
            Err(err) => {
                tracing::error!(sink = %self.name, error = %err, "kafka producer rebuild failed");
                false
            }
        }
    }
}

/// Delivery failures after which the idempotent producer has a hole in its sequence
/// numbers (or lost its producer id) and would have to bump its epoch.
pub fn leaves_sequence_gap(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageTimedOut
            | C::PurgeQueue
            | C::PurgeInflight
            | C::OutOfOrderSequenceNumber
            | C::UnknownProducerId
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::Unknown
            | C::Fatal
    )
}

fn create(name: &str, cc: &ClientConfig, auth_failure: &AuthFailure) -> Result<Prod, KafkaError> {
    cc.create_with_context(SinkContext {
        sink: name.to_owned(),
        auth_failure: auth_failure.clone(),
    })
}

/// Why the sink is down, as a probe put it: refused credentials speak for themselves.
fn down_note(why: &str) -> String {
    if why.starts_with(super::AUTH_FAILED) {
        why.to_owned()
    } else {
        format!("broker unreachable: {why}")
    }
}

/// What a connectivity probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    Reachable,
    /// Connected, but no answer in time: an overloaded or hung broker.
    Slow(String),
    /// No connection at all: refused, resolve failure, all brokers down.
    Unreachable(String),
}

/// How a failed metadata request reads: only connection-level failures mean unreachable;
/// a timeout may be a busy broker.
pub fn probe_error_is_unreachable(code: Option<RDKafkaErrorCode>) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        Some(C::BrokerTransportFailure | C::AllBrokersDown | C::Resolve | C::NetworkException)
    )
}

/// A metadata request: does any broker answer within `timeout`?
async fn probe(producer: &Arc<Prod>, timeout: Duration) -> Probe {
    let producer = producer.clone();
    let res = tokio::task::spawn_blocking(move || {
        let client: &Client<_> = producer.client();
        client
            .fetch_metadata(None, timeout)
            .map(|m| m.brokers().len())
    })
    .await;
    match res {
        Ok(Ok(0)) => Probe::Unreachable("metadata lists no brokers".to_owned()),
        Ok(Ok(_)) => Probe::Reachable,
        Ok(Err(err)) if probe_error_is_unreachable(err.rdkafka_error_code()) => {
            Probe::Unreachable(format!("metadata request failed: {err}"))
        }
        Ok(Err(err)) => Probe::Slow(format!("metadata request failed: {err}")),
        Err(err) => Probe::Slow(format!("metadata task failed: {err}")),
    }
}

impl super::Sink for KafkaSink {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(KafkaSink::publish(self, batch))
    }

    fn check(&self) -> futures::future::BoxFuture<'_, super::Health> {
        Box::pin(async move { super::Health::from(KafkaSink::check(self).await) })
    }

    fn flush(&self, timeout: Duration) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(KafkaSink::flush(self, timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cfg(extra: &[(&str, &str)]) -> KafkaSinkConfig {
        KafkaSinkConfig {
            brokers: "127.0.0.1:1".into(),
            allow: vec![],
            key: KafkaKey::Id,
            librdkafka: extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            ..Default::default()
        }
    }

    #[test]
    fn security_options_map_to_librdkafka_properties() {
        use zdelay_core::config::{KafkaSasl, SaslMechanism, TlsConfig};
        let sasl = |mechanism| KafkaSasl {
            mechanism,
            username: "alice".into(),
            password: "s3cret".into(),
        };
        let tls = TlsConfig {
            ca_file: Some("/etc/ca.pem".into()),
            cert_file: Some("/etc/client.pem".into()),
            key_file: Some("/etc/client.key".into()),
            insecure_skip_verify: false,
        };
        let props = |c: &KafkaSinkConfig| {
            security_properties(c)
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect::<BTreeMap<_, _>>()
        };
        let mut c = cfg(&[]);
        assert!(props(&c).is_empty(), "plaintext sets nothing");

        c.sasl = Some(sasl(SaslMechanism::ScramSha512));
        let p = props(&c);
        assert_eq!(p["security.protocol"], "SASL_PLAINTEXT");
        assert_eq!(p["sasl.mechanism"], "SCRAM-SHA-512");
        assert_eq!(p["sasl.username"], "alice");
        assert_eq!(p["sasl.password"], "s3cret");
        assert!(!p.contains_key("ssl.ca.location"));

        c.tls = Some(tls.clone());
        let p = props(&c);
        assert_eq!(p["security.protocol"], "SASL_SSL");
        assert_eq!(p["ssl.ca.location"], "/etc/ca.pem");
        assert_eq!(p["ssl.certificate.location"], "/etc/client.pem");
        assert_eq!(p["ssl.key.location"], "/etc/client.key");
        assert!(!p.contains_key("enable.ssl.certificate.verification"));

        c.sasl = None;
        c.tls = Some(TlsConfig {
            insecure_skip_verify: true,
            ..TlsConfig::default()
        });
        let p = props(&c);
        assert_eq!(p["security.protocol"], "SSL");
        assert_eq!(p["enable.ssl.certificate.verification"], "false");
        assert_eq!(p["ssl.endpoint.identification.algorithm"], "none");
        assert_eq!(p.len(), 3, "{p:?}");

        c.sasl = Some(sasl(SaslMechanism::Plain));
        c.tls = Some(tls);
        let p = props(&c);
        assert_eq!(p["sasl.mechanism"], "PLAIN");
        // The typed options come before the pass-through table, which still wins.
        c.librdkafka
            .insert("security.protocol".into(), "SASL_PLAINTEXT".into());
        let cc = client_config("k", &c, MESSAGE_TIMEOUT);
        assert_eq!(cc.get("security.protocol"), Some("SASL_PLAINTEXT"));
        assert_eq!(cc.get("sasl.username"), Some("alice"));
        // Every mechanism librdkafka accepts, by its own name: the bundled build has them.
        for m in [
            SaslMechanism::Plain,
            SaslMechanism::ScramSha256,
            SaslMechanism::ScramSha512,
        ] {
            c.sasl = Some(sasl(m));
            c.tls = None;
            assert!(KafkaSink::new("k", &c).is_ok(), "{m:?}");
        }
    }

    #[test]
    fn config_has_safe_throughput_defaults() {
        let cc = client_config("k", &cfg(&[]), Duration::from_secs(25));
        assert_eq!(cc.get("bootstrap.servers"), Some("127.0.0.1:1"));
        assert_eq!(cc.get("client.id"), Some("zdelay-k"));
        assert_eq!(cc.get("acks"), Some("all"));
        assert_eq!(cc.get("enable.idempotence"), Some("true"));
        assert_eq!(cc.get("linger.ms"), Some("5"));
        assert_eq!(cc.get("batch.num.messages"), Some("10000"));
        assert_eq!(cc.get("compression.type"), Some("none"));
        let prop: u64 = cc
            .get("topic.metadata.propagation.max.ms")
            .unwrap()
            .parse()
            .unwrap();
        let timeout: u64 = cc.get("message.timeout.ms").unwrap().parse().unwrap();
        assert!(
            prop < timeout,
            "unknown topics must fail before messages time out"
        );
        assert_eq!(timeout, 15_000);
    }

    #[test]
    fn message_timeout_ends_within_the_publish_deadline() {
        let cc = client_config("k", &cfg(&[]), Duration::from_millis(2250));
        assert_eq!(cc.get("message.timeout.ms"), Some("2250"));
        assert_eq!(cc.get("topic.metadata.propagation.max.ms"), Some("1000"));
        let cc = client_config("k", &cfg(&[]), Duration::from_millis(750));
        assert_eq!(cc.get("message.timeout.ms"), Some("750"));
        assert_eq!(cc.get("topic.metadata.propagation.max.ms"), Some("375"));
    }

    #[test]
    fn passthrough_wins() {
        let cc = client_config(
            "k",
            &cfg(&[
                ("linger.ms", "50"),
                ("compression.type", "lz4"),
                ("message.max.bytes", "20000"),
                ("bootstrap.servers", "127.0.0.1:2"),
                ("message.timeout.ms", "900"),
            ]),
            MESSAGE_TIMEOUT,
        );
        assert_eq!(cc.get("linger.ms"), Some("50"));
        assert_eq!(cc.get("compression.type"), Some("lz4"));
        assert_eq!(cc.get("message.max.bytes"), Some("20000"));
        assert_eq!(cc.get("bootstrap.servers"), Some("127.0.0.1:2"));
        assert_eq!(cc.get("message.timeout.ms"), Some("900"));
        assert_eq!(cc.get("acks"), Some("all"));
    }

    #[test]
    fn new_needs_no_broker_and_rejects_bad_options() {
        let sink = KafkaSink::new("k", &cfg(&[])).expect("built without a broker");
        assert_eq!(sink.config.get("message.timeout.ms"), Some("15000"));
        let err = KafkaSink::new("k", &cfg(&[("no.such.option", "1")])).unwrap_err();
        assert!(err.to_string().contains("no.such.option"), "{err}");
        let err = KafkaSink::new("k", &cfg(&[("acks", "sometimes")])).unwrap_err();
        assert!(err.to_string().contains("sink k"), "{err}");
        let mut empty = cfg(&[]);
        empty.brokers = " ".into();
        assert!(KafkaSink::new("k", &empty).is_err());
    }

    #[test]
    fn classification() {
        use RDKafkaErrorCode as C;
        for code in [
            C::MessageSizeTooLarge,
            C::TopicAuthorizationFailed,
            C::InvalidTopic,
            C::MessageBatchTooLarge,
            C::UnknownPartition,
            C::InvalidRecord,
            C::PolicyViolation,
        ] {
            assert_eq!(classify(code), ErrorClass::Reject, "{code:?}");
        }
        for code in [C::UnknownTopicOrPartition, C::UnknownTopic] {
            assert_eq!(classify(code), ErrorClass::Missing, "{code:?}");
        }
        for code in [
            C::AllBrokersDown,
            C::Resolve,
            C::PurgeQueue,
            C::PurgeInflight,
            C::Authentication,
            C::SSL,
            C::SaslAuthenticationFailed,
            C::ClusterAuthorizationFailed,
        ] {
            assert_eq!(classify(code), ErrorClass::Unavailable, "{code:?}");
        }
        for code in [
            C::MessageTimedOut,
            C::RequestTimedOut,
            C::OperationTimedOut,
            C::BrokerTransportFailure,
            C::BrokerNotAvailable,
            C::NetworkException,
            C::Unknown,
        ] {
            assert_eq!(classify(code), ErrorClass::ProbeBroker, "{code:?}");
        }
        for code in [
            C::QueueFull,
            C::NotEnoughReplicas,
            C::NotEnoughReplicasAfterAppend,
            C::LeaderNotAvailable,
            C::NotLeaderForPartition,
            C::OutOfOrderSequenceNumber,
            C::Fatal,
        ] {
            assert_eq!(classify(code), ErrorClass::Retry, "{code:?}");
        }
    }

    #[test]
    fn only_connection_failures_mean_unreachable() {
        use RDKafkaErrorCode as C;
        for code in [C::BrokerTransportFailure, C::AllBrokersDown, C::Resolve] {
            assert!(probe_error_is_unreachable(Some(code)), "{code:?}");
        }
        for code in [C::OperationTimedOut, C::RequestTimedOut, C::Unknown] {
            assert!(!probe_error_is_unreachable(Some(code)), "{code:?}");
        }
        assert!(!probe_error_is_unreachable(None));
    }

    #[test]
    fn sequence_gaps() {
        use RDKafkaErrorCode as C;
        for code in [
            C::MessageTimedOut,
            C::PurgeQueue,
            C::OutOfOrderSequenceNumber,
            C::Unknown,
        ] {
            assert!(leaves_sequence_gap(code), "{code:?}");
        }
        for code in [C::MessageSizeTooLarge, C::UnknownTopic, C::QueueFull] {
            assert!(!leaves_sequence_gap(code), "{code:?}");
        }
    }

    #[tokio::test]
    async fn publish_to_a_dead_port_is_unavailable_not_retry() {
        // Nothing listens on port 1: the probe fails, queued messages are purged.
        let sink = KafkaSink::new("k", &cfg(&[])).unwrap();
        let msg = Message {
            id: "a".into(),
            due_ms: 1,
            target: "t".into(),
            payload: b"x".to_vec(),
            headers: BTreeMap::new(),
            priority: None,
        };
        let started = Instant::now();
        let out = sink.publish(&[msg.clone(), msg]).await;
        assert_eq!(out.len(), 2);
        for o in &out {
            assert!(matches!(o, Outcome::Unavailable(_)), "{o:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );
        assert!(sink.check().await.is_err());
        assert!(sink.publish(&[]).await.is_empty());
    }
}
