"""Independent NATS reader for the zdelay NATS sink tests (nats-py, not zdelay's client).

  nats_read.py stream URL STREAM SUBJECT COUNT   read COUNT messages of a JetStream stream
                                                 (ephemeral pull consumer filtered on SUBJECT)
  nats_read.py sub URL SUBJECT COUNT              core NATS: subscribe, print "ready", collect COUNT messages

Prints one JSON document on stdout (after "ready" for `sub`):
  {"stream_messages": N or null, "messages": [{"subject", "data_b64", "headers"}]}
Stops after COUNT messages or 20 s without a new one.
"""
import asyncio
import base64
import json
import sys


def record(m):
    return {
        "subject": m.subject,
        "data_b64": base64.b64encode(m.data).decode(),
        "headers": dict(m.headers or {}),
    }


async def read_stream(url, stream, subject, count):
    import nats

    nc = await nats.connect(url, connect_timeout=5)
    js = nc.jetstream(timeout=10)
    info = await js.stream_info(stream)
    sub = await js.pull_subscribe(subject, stream=stream)
    out = []
    while len(out) < count:
        try:
            msgs = await sub.fetch(min(500, count - len(out)), timeout=20)
        except nats.errors.TimeoutError:
            break
        for m in msgs:
            out.append(record(m))
            await m.ack()
    await nc.close()
    return {"stream_messages": info.state.messages, "messages": out}


async def read_sub(url, subject, count):
    import nats

    nc = await nats.connect(url, connect_timeout=5)
    sub = await nc.subscribe(subject)
    await nc.flush()
    print("ready", flush=True)
    out = []
    while len(out) < count:
        try:
            m = await sub.next_msg(timeout=20)
        except nats.errors.TimeoutError:
            break
        out.append(record(m))
    await nc.close()
    return {"stream_messages": None, "messages": out}


def main():
    mode, url, args, count = sys.argv[1], sys.argv[2], sys.argv[3:-1], int(sys.argv[-1])
    fn = {"stream": read_stream, "sub": read_sub}[mode]
    print(json.dumps(asyncio.run(fn(url, *args, count))), flush=True)


main()
