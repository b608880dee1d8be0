"""Independent AMQP client (pika) for the amqp sink tests.

  amqp_tool.py URL declare QUEUE [--exchange EX --key KEY] [--max-priority N]
      durable queue (and a direct exchange with a binding), for the sink to publish to
  amqp_tool.py URL exchange EX          a direct exchange with no binding (unroutable keys)
  amqp_tool.py URL consume QUEUE COUNT [TIMEOUT_S]
      reads until COUNT messages arrived and the queue is empty (or the timeout), acks them,
      prints one JSON object per message: body (hex), message_id, headers, delivery_mode,
      priority, routing_key, exchange
  amqp_tool.py URL delete QUEUE [EXCHANGE]
"""
import json
import sys
import time

import pika


def main():
    url, cmd, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    if cmd == "declare":
        queue, opts = args[0], dict(zip(args[1::2], args[2::2]))
        arguments = {}
        if "--max-priority" in opts:
            arguments["x-max-priority"] = int(opts["--max-priority"])
        ch.queue_declare(queue, durable=True, arguments=arguments or None)
        if "--exchange" in opts:
            ch.exchange_declare(opts["--exchange"], exchange_type="direct", durable=True)
            ch.queue_bind(queue, opts["--exchange"], routing_key=opts["--key"])
    elif cmd == "count":
        print(ch.queue_declare(args[0], passive=True).method.message_count)
    elif cmd == "exchange":
        ch.exchange_declare(args[0], exchange_type="direct", durable=True)
    elif cmd == "consume":
        queue, count = args[0], int(args[1])
        deadline = time.monotonic() + (float(args[2]) if len(args) > 2 else 30.0)
        got = 0
        while time.monotonic() < deadline:
            method, props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                if got >= count:
                    break
                time.sleep(0.02)
                continue
            got += 1
            headers = {
                k: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
                for k, v in (props.headers or {}).items()
            }
            print(json.dumps({
                "body": body.hex(),
                "message_id": props.message_id,
                "headers": headers,
                "delivery_mode": props.delivery_mode,
                "priority": props.priority,
                "routing_key": method.routing_key,
                "exchange": method.exchange,
            }))
            ch.basic_ack(method.delivery_tag)
    elif cmd == "delete":
        ch.queue_delete(args[0])
        if len(args) > 1:
            ch.exchange_delete(args[1])
    else:
        sys.exit(f"unknown command {cmd}")
    conn.close()


main()
