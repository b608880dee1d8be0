"""Smoke check of the RabbitMQ test broker with an independent client (pika).

Publishes one persistent message with publisher confirms and `mandatory`, reads it back, checks
body, headers and message_id; then checks that an unroutable mandatory publish is returned.
Reads ZDELAY_TEST_AMQP_URL.
"""
import os
import sys
import uuid

import pika
import pika.exceptions

url = os.environ["ZDELAY_TEST_AMQP_URL"]
conn = pika.BlockingConnection(pika.URLParameters(url))
ch = conn.channel()
ch.confirm_delivery()
queue = f"zdelay-smoke-{uuid.uuid4().hex[:8]}"
ch.queue_declare(queue, durable=True)
msg_id = f"{uuid.uuid4()}:1700000000000"
body = b"\x00smoke \xff payload"
# With confirms on, basic_publish returns only after the broker's ack (raises on nack/return).
ch.basic_publish(
    exchange="",
    routing_key=queue,
    body=body,
    properties=pika.BasicProperties(
        message_id=msg_id, delivery_mode=2, headers={"zdelay-id": msg_id, "x-a": "1"}
    ),
    mandatory=True,
)
method, props, got = ch.basic_get(queue, auto_ack=True)
assert method is not None, "message not in queue"
assert got == body, got
assert props.message_id == msg_id, props.message_id
assert props.headers == {"zdelay-id": msg_id, "x-a": "1"}, props.headers
assert props.delivery_mode == 2
try:
    ch.basic_publish(exchange="", routing_key=f"{queue}-nowhere", body=b"x", mandatory=True)
    sys.exit("unroutable mandatory publish was not returned")
except pika.exceptions.UnroutableError:
    pass
ch.queue_delete(queue)
conn.close()
print(f"amqp ok: confirmed + consumed {msg_id}, unroutable returned")
