"""Smoke check of the NATS JetStream test server with an independent client (nats-py).

JetStream publish awaiting the PubAck, a second publish with the same Nats-Msg-Id absorbed as a
duplicate, then a pull consumer reading the one message back with its headers.
Reads ZDELAY_TEST_NATS_URL.
"""
import asyncio
import os
import uuid


async def main():
    import nats

    nc = await nats.connect(os.environ["ZDELAY_TEST_NATS_URL"], connect_timeout=5)
    js = nc.jetstream(timeout=5)
    tag = uuid.uuid4().hex[:8]
    stream, subject = f"ZDSMOKE_{tag}", f"zdsmoke.{tag}.jobs"
    await js.add_stream(name=stream, subjects=[f"zdsmoke.{tag}.>"], duplicate_window=120)
    msg_id = f"{uuid.uuid4()}:1700000000000"
    hdrs = {"Nats-Msg-Id": msg_id, "zdelay-id": msg_id, "x-a": "1"}
    body = b"\x00smoke \xff payload"
    ack = await js.publish(subject, body, headers=hdrs)
    assert ack.stream == stream and ack.seq == 1 and not ack.duplicate, ack
    ack2 = await js.publish(subject, body, headers=hdrs)
    assert ack2.seq == 1 and ack2.duplicate, ack2
    info = await js.stream_info(stream)
    assert info.state.messages == 1, info.state
    sub = await js.pull_subscribe(subject, durable="smoke")
    msgs = await sub.fetch(1, timeout=5)
    m = msgs[0]
    assert m.data == body, m.data
    assert m.headers.get("Nats-Msg-Id") == msg_id and m.headers.get("x-a") == "1", m.headers
    await m.ack()
    await js.delete_stream(stream)
    await nc.close()
    print(f"nats ok: PubAck seq 1, duplicate absorbed, consumed {msg_id}")


asyncio.run(main())
