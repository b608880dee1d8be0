#!/usr/bin/env bash
# The "through brokers" benchmark of docs/operations/benchmarks.md, reproducible: a private
# Redis, a memory-storage Kafka (tansu) beside the brokers of scripts/services.sh, the topic,
# stream and queue, a config with one route per broker, then `zdelay-bench --route` for each.
# Each run also publishes the same messages through the broker's own client directly, before
# and after zdelay's drain, and prints zdelay's rate over theirs.
#
#   bash scripts/services.sh install && bash scripts/services.sh start amqp nats
#   cargo build --release -p zdelay-bench
#   bash scripts/bench-brokers.sh [BENCH_BINARY] [JOBS]   # default target/release/zdelay-bench 100000
#   bash scripts/services.sh stop
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$here/target/release/zdelay-bench}
jobs=${2:-100000}
services=${ZDELAY_SERVICES_DIR:-/tmp/zdelay-services}
work=$(mktemp -d /tmp/zdelay-bench-brokers.XXXXXX)
# shellcheck disable=SC1091
source "$services/env"
py=$ZDELAY_TEST_PYTHON

bash "$here/scripts/apt-ensure.sh" redis-server:redis-server redis-cli:redis-tools
redis_port=$((20000 + RANDOM % 5000))
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize yes --pidfile "$work/redis.pid" --logfile "$work/redis.log"
ZDELAY_TANSU_STORAGE=memory ZDELAY_SERVICES_DIR=$work/kafka \
    bash "$here/scripts/services.sh" start kafka >"$work/kafka.log" 2>&1
stop() {
    ZDELAY_SERVICES_DIR=$work/kafka bash "$here/scripts/services.sh" stop >/dev/null 2>&1 || true
    [ -f "$work/redis.pid" ] && kill "$(cat "$work/redis.pid")" 2>/dev/null || true
}
trap stop EXIT
# shellcheck disable=SC1091
kafka_brokers=$(. "$work/kafka/env" && echo "$ZDELAY_TEST_KAFKA_BROKERS")
ZDELAY_SERVICES_DIR=$work/kafka bash "$here/scripts/services.sh" kafka-topic zd-bench 4 >/dev/null
"$py" "$here/tests/it/py/amqp_tool.py" "$ZDELAY_TEST_AMQP_URL" declare zd-bench
"$py" - "$ZDELAY_TEST_NATS_URL" <<'EOF'
import asyncio, sys
import nats
from nats.js.api import StreamConfig

async def main():
    nc = await nats.connect(sys.argv[1])
    js = nc.jetstream()
    try:
        await js.delete_stream("ZDBENCH")
    except Exception:
        pass
    await js.add_stream(StreamConfig(name="ZDBENCH", subjects=["zdbench.>"]))
    await nc.close()

asyncio.run(main())
EOF
cat >"$work/zdelay.toml" <<EOF
[redis]
url = "redis://127.0.0.1:$redis_port"
[sinks.k]
kind = "kafka"
brokers = "$kafka_brokers"
[sinks.a]
kind = "amqp"
url = "$ZDELAY_TEST_AMQP_URL"
[sinks.n]
kind = "nats"
url = "$ZDELAY_TEST_NATS_URL"
[[routes]]
name = "k"
sink = "k"
target = "zd-bench"
[[routes]]
name = "a"
sink = "a"
target = "/zd-bench"
[[routes]]
name = "n"
sink = "n"
target = "zdbench.due"
EOF
for route in ${ROUTES:-k n a}; do
    "$bin" --config "$work/zdelay.toml" --route "$route" --jobs "$jobs"
done
