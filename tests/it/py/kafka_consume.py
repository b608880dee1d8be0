"""Independent Kafka consumer for the sink tests (confluent-kafka, not zdelay's client).

usage: kafka_consume.py BROKERS TOPIC COUNT TIMEOUT_S
Reads COUNT records (COUNT = -N: at least N, then on until nothing new comes for 2 s) from
every partition of TOPIC from the beginning (no consumer group: partitions are assigned
directly) and prints one JSON object per record:
{"partition", "offset", "key": hex or null, "value": hex, "headers": [[name, hex], ...]}.
Exits 1 when fewer than COUNT arrive within TIMEOUT_S.
"""
import json
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

brokers, topic, count, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
c = Consumer({
    "bootstrap.servers": brokers,
    "group.id": "zdelay-test-unused",
    "enable.auto.commit": False,
    "enable.partition.eof": False,
})
deadline = time.time() + timeout
md = c.list_topics(topic, timeout=10)
parts = sorted(md.topics[topic].partitions)
if not parts:
    sys.exit(f"topic {topic} has no partitions")
c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
at_least = count < 0
count = abs(count)
seen = 0
last = time.time()
while time.time() < deadline:
    if seen >= count and (not at_least or time.time() - last > 2):
        break
    for m in c.consume(num_messages=1000, timeout=0.5):
        last = time.time()
        if m.error():
            sys.exit(f"consume error: {m.error()}")
        print(json.dumps({
            "partition": m.partition(),
            "offset": m.offset(),
            "key": None if m.key() is None else m.key().hex(),
            "value": m.value().hex(),
            "headers": [[k, None if v is None else v.hex()] for k, v in (m.headers() or [])],
        }))
        seen += 1
c.close()
if seen < count:
    sys.exit(f"only {seen} of {count} records within {timeout} s")
