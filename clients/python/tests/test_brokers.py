"""A job enqueued by this client reaches each broker through a real daemon with its payload
and headers: NATS JetStream, RabbitMQ and a Kafka-protocol broker, at the addresses
scripts/services.sh writes (ZDELAY_TEST_*). Needs nats-py, pika and confluent-kafka, so
scripts/test.sh runs these in the services venv only (`-m broker`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid

import pytest

import zdelay

from .conftest import ROUTES, Daemon, wait_for

pytestmark = pytest.mark.broker
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
PAYLOAD = b'{"order": 7}'


def env(name: str) -> str:
    value = os.environ.get(name)
    assert value, f"{name} is not set: run scripts/services.sh start (scripts/test.sh does)"
    return value


def through(redis_url: str, sink: str, target: str, read) -> dict:
    """Enqueues one job with headers for a route to `target` on `sink` (TOML), runs a daemon,
    and returns the headers `read()` found with the payload."""
    routes = ROUTES + sink + f'\n[[routes]]\nname = "out"\nsink = "bus"\ntarget = "{target}"\n'
    daemon = Daemon(f'url = "{redis_url}"', routes=routes)
    try:
        done = zdelay.Client.from_url(redis_url).enqueue(
            "out", PAYLOAD, id=f"order-{uuid.uuid4().hex[:6]}", headers={"tenant": "acme", "Traceparent": TRACEPARENT}
        )
        payload, headers = read()
    finally:
        daemon.stop()
    assert payload == PAYLOAD
    assert headers["tenant"] == "acme" and TRACE_ID in headers["traceparent"], headers
    assert done.id in headers["zdelay-id"] or done.id in headers.get("Nats-Msg-Id", ""), headers
    return headers


def test_nats_jetstream(redis_url):
    import nats

    url = env("ZDELAY_TEST_NATS_URL")
    prefix = f"zdpy{uuid.uuid4().hex[:8]}"

    async def make_stream():
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name=prefix.upper(), subjects=[f"{prefix}.>"])
        await nc.close()

    async def fetch():
        nc = await nats.connect(url)
        sub = await nc.jetstream().pull_subscribe(f"{prefix}.due", durable="py")
        (msg,) = await sub.fetch(1, timeout=10)
        await msg.ack()
        await nc.close()
        return msg.data, dict(msg.headers)

    asyncio.run(make_stream())
    sink = f'\n[sinks.bus]\nkind = "nats"\nurl = "{url}"\nallow = ["{prefix}.*"]\n'
    through(redis_url, sink, f"{prefix}.due", lambda: asyncio.run(fetch()))


def test_rabbitmq(redis_url):
    import pika

    url = env("ZDELAY_TEST_AMQP_URL")
    queue = f"zd-py-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    channel = conn.channel()
    channel.queue_declare(queue)

    def read():
        got = []
        wait_for("the message in RabbitMQ", lambda: got.append(channel.basic_get(queue, auto_ack=True)) or got[-1][0])
        _, props, body = got[-1]
        return body, {k: v.decode() if isinstance(v, bytes) else v for k, v in props.headers.items()}

    try:
        sink = f'\n[sinks.bus]\nkind = "amqp"\nurl = "{url}"\n'
        through(redis_url, sink, f"/{queue}", read)
    finally:
        conn.close()


def test_kafka(redis_url):
    from confluent_kafka import Consumer

    brokers = env("ZDELAY_TEST_KAFKA_BROKERS")
    topic = f"zd-py-{uuid.uuid4().hex[:8]}"
    subprocess.run(f"{env('ZDELAY_TEST_KAFKA_TOPIC_CMD')} {topic} 1", shell=True, check=True)

    def read():
        consumer = Consumer({"bootstrap.servers": brokers, "group.id": topic, "auto.offset.reset": "earliest"})
        consumer.subscribe([topic])
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error():
                    return msg.value(), {k: v.decode() for k, v in msg.headers() or []}
            raise AssertionError("no message on the topic within 20 s")
        finally:
            consumer.close()

    sink = f'\n[sinks.bus]\nkind = "kafka"\nbrokers = "{brokers}"\n'
    through(redis_url, sink, topic, read)
