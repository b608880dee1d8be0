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
#   ROUTES="k n a" DAEMONS="0 1 2 3" bash scripts/bench-brokers.sh   # which routes, how many daemons
#   CLUSTER=1 DAEMONS="1 2 3" bash scripts/bench-brokers.sh            # on a 3+3 Redis Cluster
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
# CLUSTER=1: a cluster of 3 masters + 3 replicas on ports redis_port..+5 (bus ports +10000)
# instead of one Redis.
nodes=1
[ "${CLUSTER:-0}" = 1 ] && nodes=6
for i in $(seq 0 $((nodes - 1))); do
    port=$((redis_port + i))
    cluster_flags=()
    [ "$nodes" -gt 1 ] && cluster_flags=(--cluster-enabled yes --cluster-node-timeout 5000
        --cluster-config-file "$work/nodes-$port.conf")
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --pidfile "$work/redis-$port.pid" --logfile "$work/redis-$port.log" \
        --dir "$work" "${cluster_flags[@]}"
done
ZDELAY_TANSU_STORAGE=memory ZDELAY_SERVICES_DIR=$work/kafka \
    bash "$here/scripts/services.sh" start kafka >"$work/kafka.log" 2>&1
stop() {
    ZDELAY_SERVICES_DIR=$work/kafka bash "$here/scripts/services.sh" stop >/dev/null 2>&1 || true
    for pid in "$work"/redis-*.pid; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
}
trap stop EXIT
for i in $(seq 0 $((nodes - 1))); do
    until redis-cli -p $((redis_port + i)) ping 2>/dev/null | grep -q PONG; do sleep 0.02; done
done
redis_section="url = \"redis://127.0.0.1:$redis_port\""
if [ "$nodes" -gt 1 ]; then
    seeds=()
    for i in $(seq 0 5); do seeds+=("127.0.0.1:$((redis_port + i))"); done
    redis-cli --cluster create "${seeds[@]}" --cluster-replicas 1 --cluster-yes >"$work/cluster.log"
    for i in $(seq 0 5); do
        until redis-cli -p $((redis_port + i)) cluster info | grep -q cluster_state:ok; do
            sleep 0.1
        done
    done
    redis_section="cluster_nodes = [\"redis://${seeds[0]}\", \"redis://${seeds[1]}\", \"redis://${seeds[2]}\"]"
fi
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
$redis_section
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
# DAEMONS="0 1 2 3": 0 runs the pollers in the bench's process, N > 0 that many `zdelay run`
# processes (the zdelay beside the bench binary).
for route in ${ROUTES:-k n a}; do
    for daemons in ${DAEMONS:-0}; do
        flags=()
        [ "$daemons" -gt 0 ] && flags=(--daemons "$daemons")
        "$bin" --config "$work/zdelay.toml" --route "$route" --jobs "$jobs" "${flags[@]}" ${BENCH_FLAGS:-}
    done
done
