"""Smoke check of the Kafka-protocol test broker (tansu) with an independent client
(confluent-kafka, librdkafka 2.16).

Creates a topic first (tansu has no auto-creation), produces one record with acks=all and
idempotence and waits for its delivery report, consumes it back in a consumer group and checks
key, value and headers; then checks that producing to a missing topic fails as
UNKNOWN_TOPIC_OR_PART.
Reads ZDELAY_TEST_KAFKA_BROKERS and ZDELAY_TEST_TANSU_BIN.
"""
import os
import subprocess
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaError, Producer

brokers = os.environ["ZDELAY_TEST_KAFKA_BROKERS"]
topic = f"zdelay-smoke-{uuid.uuid4().hex[:8]}"
subprocess.run(
    [os.environ["ZDELAY_TEST_TANSU_BIN"], "topic", "create", topic, "--partitions", "1",
     "--broker", f"tcp://{brokers}"],
    check=True, stdout=subprocess.DEVNULL,
)

msg_id = f"{uuid.uuid4()}:1700000000000"
body = b"\x00smoke \xff payload"
reports = []
p = Producer({"bootstrap.servers": brokers, "acks": "all", "enable.idempotence": True,
              "linger.ms": 5, "message.timeout.ms": 15000})
p.produce(topic, value=body, key=b"job-1", headers=[("zdelay-id", msg_id.encode()), ("x-a", b"1")],
          on_delivery=lambda err, msg: reports.append((err, msg)))
assert p.flush(20) == 0, "produce not delivered"
err, rec = reports[0]
assert err is None, err
offset = rec.offset()

c = Consumer({"bootstrap.servers": brokers, "group.id": f"smoke-{topic}",
              "auto.offset.reset": "earliest", "enable.auto.commit": False})
c.subscribe([topic])
deadline = time.monotonic() + 30
got = None
while got is None and time.monotonic() < deadline:
    m = c.poll(0.5)
    if m is None:
        continue
    if m.error():
        if m.error().code() == KafkaError._PARTITION_EOF:
            continue
        sys.exit(f"consume error: {m.error()}")
    got = m
c.close()
assert got is not None, "nothing consumed within 30 s"
assert got.value() == body and got.key() == b"job-1", (got.key(), got.value())
assert dict(got.headers()) == {"zdelay-id": msg_id.encode(), "x-a": b"1"}, got.headers()

# Missing topic: no auto-creation. librdkafka reports UNKNOWN_TOPIC_OR_PART once
# topic.metadata.propagation.max.ms (default 30 s) has passed; with a message.timeout.ms shorter
# than that the same record fails as _MSG_TIMED_OUT instead.
missing = []
p2 = Producer({"bootstrap.servers": brokers, "acks": "all", "message.timeout.ms": 20000,
               "topic.metadata.propagation.max.ms": 1000})
p2.produce(f"{topic}-missing", value=b"x", on_delivery=lambda e, m: missing.append(e))
p2.flush(30)
assert missing and missing[0] is not None, missing
assert missing[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART, missing[0]
print(f"kafka ok: acks=all delivered at offset {offset}, consumed {msg_id}; "
      f"missing topic -> {missing[0].name()}")
