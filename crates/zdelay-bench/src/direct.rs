//! `--route`'s baseline: the broker's own client publishing the same messages with the same
//! confirms, no Redis in the path. zdelay's rate over this one is what its path costs.

use anyhow::{Context, bail};
use std::collections::VecDeque;
use std::future::Future;
use std::time::{Duration, Instant};
use zdelay::sinks::IDEMPOTENCY_HEADER;
use zdelay_core::config::{AmqpSinkConfig, KafkaKey, KafkaSinkConfig, NatsSinkConfig, SinkConfig};

/// One direct publishing run.
#[derive(Debug, serde::Serialize)]
pub(super) struct Direct {
    /// Client library and confirm mode, for the report.
    pub(super) client: &'static str,
    pub(super) seconds: f64,
    pub(super) per_second: f64,
}

/// What every direct run publishes: `n` messages of `size` bytes to `target`, each with the
/// idempotency header (and, for Kafka, the record key) zdelay would give it, keeping up to
/// `window` unconfirmed.
pub(super) struct Plan<'a> {
    pub(super) sink: &'a str,
    pub(super) target: &'a str,
    pub(super) n: u64,
    pub(super) size: usize,
    pub(super) window: usize,
}

impl Plan<'_> {
    /// Ids unique to this run, so JetStream's duplicate window never drops one as a repeat
    /// of an earlier run.
    fn ids(&self) -> impl Iterator<Item = (String, String)> + use<> {
        let run = run_stamp();
        (0..self.n).map(move |i| {
            let id = format!("{run:013}{i:013}");
            let key = format!("{id}:{run}");
            (id, key)
        })
    }
}

/// This run's mark in its ids: the wall clock in ms.
fn run_stamp() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// Publishes the plan through the sink's broker client; `None` for a sink kind without one
/// (a remote Redis).
pub(super) async fn publish(
    config: &SinkConfig,
    plan: &Plan<'_>,
) -> anyhow::Result<Option<Direct>> {
    match config {
        SinkConfig::Kafka(cfg) => kafka(cfg, plan).await.map(Some),
        SinkConfig::Nats(cfg) if cfg.jetstream => nats(cfg, plan).await.map(Some),
        SinkConfig::Amqp(cfg) => amqp(cfg, plan).await.map(Some),
        _ => Ok(None),
    }
    .with_context(|| format!("publishing directly through sink {}'s client", plan.sink))
}

/// Runs `send` for each message in order, keeping at most `window` of the confirmations it
/// returns pending; timed from the first send to the last confirmation.
async fn windowed<C, F>(
    client: &'static str,
    plan: &Plan<'_>,
    mut send: impl AsyncFnMut(&str, &str, &[u8]) -> anyhow::Result<C>,
    confirmed: impl Fn(C) -> F,
) -> anyhow::Result<Direct>
where
    F: Future<Output = anyhow::Result<()>>,
{
    let payload = vec![b'x'; plan.size];
    let mut pending = VecDeque::with_capacity(plan.window);
    let started = Instant::now();
    for (id, key) in plan.ids() {
        if pending.len() >= plan.window {
            let oldest = pending.pop_front().expect("window is full");
            confirmed(oldest).await?;
        }
        pending.push_back(send(&id, &key, &payload).await?);
    }
    for c in pending {
        confirmed(c).await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Direct {
        client,
        seconds,
        per_second: plan.n as f64 / seconds,
    })
}

async fn kafka(cfg: &KafkaSinkConfig, plan: &Plan<'_>) -> anyhow::Result<Direct> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    /// What the sink sends: the idempotency header, and the job id as the record key unless
    /// the sink's `key` is `none`.
    fn record<'a>(
        target: &'a str,
        keyed: bool,
        id: &'a str,
        key: &str,
        payload: &'a [u8],
    ) -> FutureRecord<'a, str, [u8]> {
        let headers = OwnedHeaders::new().insert(Header {
            key: IDEMPOTENCY_HEADER,
            value: Some(key),
        });
        let rec = FutureRecord::to(target).payload(payload).headers(headers);
        if keyed { rec.key(id) } else { rec }
    }
    let producer: FutureProducer =
        zdelay::sinks::kafka::client_config(plan.sink, cfg, Duration::from_secs(30)).create()?;
    let keyed = cfg.key == KafkaKey::Id;
    // Metadata and the producer id first, as the sink's own check does before a drain.
    let warm = record(plan.target, keyed, "warm-up", "warm-up:0", b"x");
    producer
        .send(warm, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("warm-up: {e}"))?;
    windowed(
        "rdkafka FutureProducer, acks=all, idempotent (the sink's settings)",
        plan,
        async |id, key, payload| {
            producer
                .send_result(record(plan.target, keyed, id, key, payload))
                .map_err(|(e, _)| anyhow::anyhow!("enqueue: {e}"))
        },
        async |fut| match fut.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => bail!("delivery: {e}"),
            Err(_) => bail!("delivery report dropped"),
        },
    )
    .await
}

async fn nats(cfg: &NatsSinkConfig, plan: &Plan<'_>) -> anyhow::Result<Direct> {
    use async_nats::HeaderMap;
    if cfg.user.is_some() || cfg.token.is_some() || cfg.creds_file.is_some() || cfg.tls.is_some() {
        bail!("the direct run connects without authentication or TLS");
    }
    let client = async_nats::connect(cfg.url.expose()).await?;
    let js = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(1 << 16)
        .build(client);
    let headers = |key: &str| {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_HEADER, key);
        h.insert("Nats-Msg-Id", key);
        h
    };
    let warm_up = format!("warm-up:{}", run_stamp());
    js.publish_with_headers(plan.target.to_owned(), headers(&warm_up), "x".into())
        .await?
        .await?;
    windowed(
        "async-nats JetStream publish, PubAck awaited, Nats-Msg-Id set",
        plan,
        async |_, key, payload| {
            let ack = js
                .publish_with_headers(
                    plan.target.to_owned(),
                    headers(key),
                    payload.to_vec().into(),
                )
                .await?;
            Ok(ack)
        },
        async |ack| {
            ack.await?;
            Ok(())
        },
    )
    .await
}

async fn amqp(cfg: &AmqpSinkConfig, plan: &Plan<'_>) -> anyhow::Result<Direct> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
    if cfg.tls.is_some() {
        bail!("the direct run connects without TLS");
    }
    let Some((exchange, routing_key)) = plan.target.split_once('/') else {
        bail!("amqp target {:?} is not exchange/routing-key", plan.target);
    };
    let conn = Connection::connect(cfg.url.expose(), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let properties = |key: &str| {
        let mut headers = FieldTable::default();
        headers.insert(
            IDEMPOTENCY_HEADER.into(),
            AMQPValue::LongString(LongString::from(key.as_bytes())),
        );
        BasicProperties::default()
            .with_message_id(key.into())
            .with_delivery_mode(2)
            .with_headers(headers)
    };
    let run = windowed(
        "lapin, publisher confirms, persistent, mandatory",
        plan,
        async |_, key, payload| {
            let confirm = channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    options,
                    payload,
                    properties(key),
                )
                .await?;
            Ok(confirm)
        },
        async |confirm| match confirm.await? {
            Confirmation::Ack(None) => Ok(()),
            other => bail!("not a plain ack: {other:?}"),
        },
    )
    .await;
    let _ = channel.close(200, "bench done".into()).await;
    let _ = conn.close(200, "bench done".into()).await;
    run
}
