"""A job enqueued by this client, and one enqueued by the TypeScript client (clients/node,
built), reaches each broker through a real daemon with its payload and headers: NATS
JetStream, RabbitMQ and a Kafka-protocol broker, at the addresses scripts/services.sh writes
(ZDELAY_TEST_*). Needs nats-py, pika and confluent-kafka, so scripts/test.sh runs these in the
services venv only (`-m broker`), after building the TypeScript client."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import time
import uuid

import pytest

import zdelay

from .conftest import ROOT, ROUTES, Daemon, wait_for

pytestmark = pytest.mark.broker
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
PAYLOAD = b'{"order": 7}'


def env(name: str) -> str:
    value = os.environ.get(name)
    assert value, f"{name} is not set: run scripts/services.sh start (scripts/test.sh does)"
    return value


NODE_CLIENT = ROOT / "clients" / "node"
# Enqueues one job through the TypeScript client's CommonJS build: argv = url, id, payload (base64), headers JSON.
NODE_ENQUEUE = """
const [dist, ioredis, url, id, payload, headers] = process.argv.slice(1);
const { Client } = require(dist);
const Redis = require(ioredis);
const client = new Client(new Redis(url));
client.enqueue({ dest: "out", payload: Buffer.from(payload, "base64"), id, headers: JSON.parse(headers) })
  .then((r) => { console.log(JSON.stringify(r)); process.exit(0); }, (e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(params=["python", "node"])
def producer(request):
    """Enqueues (url, id, payload, headers) and returns the id, through one client."""
    if request.param == "python":
        return lambda url, id, payload, headers: zdelay.Client.from_url(url).enqueue("out", payload, id=id, headers=headers).id
    dist = NODE_CLIENT / "dist" / "cjs" / "index.js"
    if not dist.exists() and not os.environ.get("ZDELAY_TEST_NODE_CLIENT"):
        pytest.skip("the TypeScript client is not built (cd clients/node && npm ci && npm run build)")

    def enqueue(url, id, payload, headers):
        out = subprocess.run(["node", "-e", NODE_ENQUEUE, str(dist), str(NODE_CLIENT / "node_modules" / "ioredis"), url, id,
                              base64.b64encode(payload).decode(), json.dumps(headers)], capture_output=True, check=True)
        return json.loads(out.stdout)["id"]

    return enqueue


def through(redis_url: str, producer, sink: str, target: str, read) -> dict:
    """Enqueues one job with headers for a route to `target` on `sink` (TOML), runs a daemon,
    and returns the headers `read()` found with the payload."""
    routes = ROUTES + sink + f'\n[[routes]]\nname = "out"\nsink = "bus"\ntarget = "{target}"\n'
    daemon = Daemon(f'url = "{redis_url}"', routes=routes)
    try:
        done_id = producer(redis_url, f"order-{uuid.uuid4().hex[:6]}", PAYLOAD, {"tenant": "acme", "Traceparent": TRACEPARENT})
        payload, headers = read()
    finally:
        daemon.stop()
    assert payload == PAYLOAD
    assert headers["tenant"] == "acme" and TRACE_ID in headers["traceparent"], headers
    assert done_id in headers["zdelay-id"] or done_id in headers.get("Nats-Msg-Id", ""), headers
    return headers


def test_nats_jetstream(redis_url, producer):
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
    through(redis_url, producer, sink, f"{prefix}.due", lambda: asyncio.run(fetch()))


def test_rabbitmq(redis_url, producer):
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
        through(redis_url, producer, sink, f"/{queue}", read)
    finally:
        conn.close()


def test_kafka(redis_url, producer):
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
    through(redis_url, producer, sink, topic, read)
