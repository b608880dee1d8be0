"""A job enqueued by this client reaches a broker through a real daemon with its payload and
headers: NATS JetStream (ZDELAY_TEST_NATS_URL, from scripts/services.sh). Needs nats-py, so
scripts/test.sh runs it in the services venv only (`-m broker` marks it)."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

import zdelay

from .conftest import ROUTES, Daemon

pytestmark = pytest.mark.broker
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_job_reaches_nats_jetstream_with_its_payload_and_headers(redis_url):
    url = os.environ.get("ZDELAY_TEST_NATS_URL")
    assert url, "ZDELAY_TEST_NATS_URL is not set: run scripts/services.sh start (scripts/test.sh does)"
    import nats

    prefix = f"zdpy{uuid.uuid4().hex[:8]}"

    async def make_stream():
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name=prefix.upper(), subjects=[f"{prefix}.>"])
        await nc.close()

    asyncio.run(make_stream())
    routes = ROUTES + f"""
[sinks.bus]
kind = "nats"
url = "{url}"
allow = ["{prefix}.*"]

[[routes]]
name = "events"
sink = "bus"
target = "{prefix}.due"
"""
    daemon = Daemon(f'url = "{redis_url}"', routes=routes)
    try:
        client = zdelay.Client.from_url(redis_url)
        done = client.enqueue("events", b'{"order": 7}', id="order-7", headers={"tenant": "acme", "Traceparent": TRACEPARENT})

        async def read():
            nc = await nats.connect(url)
            sub = await nc.jetstream().pull_subscribe(f"{prefix}.due", durable="py")
            (msg,) = await sub.fetch(1, timeout=10)
            await msg.ack()
            await nc.close()
            return msg

        msg = asyncio.run(read())
        assert msg.data == b'{"order": 7}'
        assert msg.headers["tenant"] == "acme"
        assert msg.headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
        assert done.id in msg.headers["Nats-Msg-Id"], msg.headers
    finally:
        daemon.stop()
