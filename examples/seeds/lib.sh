# Helpers shared by the worked examples in examples/seeds/*/run.sh (sourced, not run).
#
# The caller provides REDIS_PORT (a private redis-server on 127.0.0.1, which the example may
# fill and reconfigure) and ZDELAY (the zdelay binary). Every example prints a transcript:
# plain lines are deterministic (the test suite compares them), lines starting with "# "
# carry what varies from run to run (lateness, pids). Everything started here is stopped by
# pid on exit, and the temp dir removed.
set -euo pipefail

: "${REDIS_PORT:?set REDIS_PORT to the port of a private redis-server on 127.0.0.1}"
: "${ZDELAY:?set ZDELAY to the zdelay binary, e.g. target/debug/zdelay}"
[[ -x $ZDELAY ]] || { echo "ZDELAY=$ZDELAY is not an executable" >&2; exit 1; }

EXAMPLE_DIR=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[1]}")")" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-seed.XXXXXX")
DAEMON_PID=""
DAEMON_RUNS=0
BG_PIDS=()
INSTANCE_PIDS=()
INSTANCE_ADMIN=()
REDIS2_PID=""
REDIS2_PORT=""

# Every zdelay command below (daemon and CLI) reads the example's config, pointed at the
# caller's Redis; the CLI logs warnings only, so stderr stays quiet.
export ZDELAY_CONFIG="$EXAMPLE_DIR/zdelay.toml"
export ZDELAY_REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
export ZDELAY_LOG=warn

die() {
    echo "FAILED: $*" >&2
    exit 1
}

# The transcript: a deterministic line, a section header, a varying (ignored) line.
say() { printf '%s\n' "$*"; }
section() { printf '== %s\n' "$*"; }
note() { printf '# %s\n' "$*"; }

rcli() { redis-cli -p "$REDIS_PORT" "$@"; }
zdelay() { "$ZDELAY" "$@"; }

# Redis's clock, the one zdelay schedules by, in epoch ms.
redis_ms() {
    local t
    mapfile -t t < <(rcli TIME)
    echo $((t[0] * 1000 + 10#${t[1]} / 1000))
}

# Epoch ms as epoch seconds with three decimals (for score_unit = "s" sources).
ms_to_s() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }

# slot_tag SLOT_OR_KEY [--key]: the hash tag storage layout 2 gives a slot (or a key's slot).
slot_tag() {
    local tag
    tag=$(zdelay slot-tag "$@" -o json | sed -n 's/^ *"tag": *"\([^"]*\)".*/\1/p')
    [[ -n $tag ]] || die "no slot tag for $1"
    echo "$tag"
}

# lane_key KIND ROUTE LIST: the key of kind KIND (due, jobs, sched_due, ...) of local route
# ROUTE's lane, whose jobs are pushed onto LIST: zdelay:{<tag of LIST's slot>}:KIND:ROUTE.
lane_key() { printf 'zdelay:{%s}:%s:%s' "$(slot_tag "$3" --key)" "$1" "$2"; }

# spread_key KIND SHARD SHARDS: the key of kind KIND (due, jobs, scheduled, ...) of spread
# shard SHARD of SHARDS, where two-phase jobs wait: zdelay:{<tag>}:s<SHARD>:KIND, at the middle
# slot of the shard's share of the 16384 slots.
spread_key() {
    printf 'zdelay:{%s}:s%d:%s' "$(slot_tag $(((2 * $2 + 1) * 16384 / (2 * $3))))" "$2" "$1"
}

# expect WHAT GOT WANT: fails the example unless GOT is WANT, so a run that prints OK has
# checked its numbers itself (the test suite compares the transcript as well).
expect() {
    [[ $2 == "$3" ]] || die "$1: got '$2', expected '$3'"
}

# wait_until SECONDS WHAT COMMAND...: runs COMMAND every 20 ms until it succeeds; fails the
# example with WHAT after SECONDS.
wait_until() {
    local limit=$1 what=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what"
        sleep 0.02
    done
}

# Conditions for wait_until.
llen_is() { [[ $(rcli LLEN "$1") == "$2" ]]; }
llen_at_least() { (($(rcli LLEN "$1") >= $2)); }
redis_time_past() { (($(redis_ms) >= $1)); }
has_subscriber() { [[ $(rcli PUBSUB NUMSUB "$1" | sed -n 2p) -ge 1 ]]; }
alive() { kill -0 "$1" 2>/dev/null; }
not_alive() { ! kill -0 "$1" 2>/dev/null; }

# A loopback port nobody listens on (checked by connecting), below the kernel's ephemeral range
# (32768 and up), where an outgoing connection may take it before the server binds it. 18000–19999
# is this library's band: the test harness that runs these examples keeps its own servers and
# brokers in other bands, so the two never pick the same port (tests/it/common/mod.rs).
free_port() {
    local port
    for _ in $(seq 200); do
        port=$((18000 + RANDOM % 2000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die "no free loopback port"
}

# Starts `zdelay run` on a free admin port and waits until /readyz answers 200. Retries on
# another port if the daemon exits at once (the port was taken meanwhile).
start_daemon() {
    local attempt port log
    for attempt in 1 2 3; do
        port=$(free_port)
        DAEMON_RUNS=$((DAEMON_RUNS + 1))
        log="$WORK/zdelay-$DAEMON_RUNS.log"
        ZDELAY_LOG=info ZDELAY_ADMIN__LISTEN="127.0.0.1:$port" "$ZDELAY" run >"$log" 2>&1 </dev/null &
        DAEMON_PID=$!
        ADMIN_PORT=$port
        local deadline=$((SECONDS + 20))
        while alive "$DAEMON_PID" && ((SECONDS < deadline)); do
            if curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1; then
                note "zdelay run: pid $DAEMON_PID, admin on 127.0.0.1:$port (attempt $attempt)"
                return 0
            fi
            sleep 0.02
        done
        if alive "$DAEMON_PID"; then
            die "zdelay not ready within 20s: $(tail -n 5 "$log")"
        fi
        wait "$DAEMON_PID" 2>/dev/null || true
        DAEMON_PID=""
        echo "zdelay run exited at start (attempt $attempt): $(tail -n 3 "$log")" >&2
    done
    die "zdelay run did not start"
}

# SIGTERM, and the daemon must exit 0.
stop_daemon() {
    local rc=0
    kill -TERM "$DAEMON_PID"
    wait "$DAEMON_PID" || rc=$?
    DAEMON_PID=""
    ((rc == 0)) || die "zdelay run exited with $rc on SIGTERM"
}

# SIGKILL: the daemon dies wherever it is, as in a crash.
kill9_daemon() {
    kill -KILL "$DAEMON_PID"
    wait "$DAEMON_PID" 2>/dev/null || true
    DAEMON_PID=""
}

metric() {
    curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics" | awk -v s="$1" '$1 == s { print $2 }'
}

# Several daemons on one namespace. start_instance starts one more (as start_daemon) and files
# it under INSTANCE_PIDS / INSTANCE_ADMIN, index 0, 1, …; stop_instance N (SIGTERM, must exit
# 0) and kill9_instance N end one; instance_metric N NAME reads its /metrics. Instances still
# running are stopped on exit.
start_instance() {
    start_daemon
    INSTANCE_PIDS+=("$DAEMON_PID")
    INSTANCE_ADMIN+=("$ADMIN_PORT")
    DAEMON_PID=""
}
stop_instance() {
    DAEMON_PID=${INSTANCE_PIDS[$1]}
    INSTANCE_PIDS[$1]=""
    stop_daemon
}
kill9_instance() {
    DAEMON_PID=${INSTANCE_PIDS[$1]}
    INSTANCE_PIDS[$1]=""
    kill9_daemon
}
instance_metric() { ADMIN_PORT=${INSTANCE_ADMIN[$1]} metric "$2"; }

# plan_is INSTANCES PER_SHARD SHARDS: `zdelay stats` lists INSTANCES live instances, and each
# of the SHARDS shards, and each group of route lanes (`lanes:<group>:<hash>`) polled at all,
# is polled by PER_SHARD of them.
plan_is() {
    local out s line group polled=""
    out=$(zdelay stats | grep '^instance ') || return 1
    [[ $(wc -l <<<"$out") == "$1" ]] || return 1
    while IFS= read -r line; do polled+=$(shards_polled "$line")$'\n'; done <<<"$out"
    for ((s = 0; s < $3; s++)); do
        [[ $(grep -cx "$s" <<<"$polled") == "$2" ]] || return 1
    done
    for group in $(grep -o 'lanes:[^ ,]*' <<<"$out" | sort -u); do
        [[ $(grep -cF "$group" <<<"$out") == "$2" ]] || return 1
    done
}
# shards_polled LINE: the shard numbers an `instance …: polls shards 0-3, 5, <source>` line
# of `zdelay stats` names, one a line.
shards_polled() {
    local polls=${1#*: polls shards } part parts
    [[ $polls == "$1" ]] && return 0
    IFS=',' read -ra parts <<<"$polls"
    for part in "${parts[@]}"; do
        part=${part// /}
        if [[ $part =~ ^([0-9]+)-([0-9]+)$ ]]; then
            seq "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
        elif [[ $part =~ ^[0-9]+$ ]]; then
            echo "$part"
        fi
    done
}

# A second private redis-server on loopback, e.g. the far end of a remote `redis` sink.
# start_redis2 picks a free port the first time (REDIS2_PORT) and the same one on a restart;
# it starts empty (no persistence). A first start whose port was taken meanwhile (the server
# exits at once) moves to another port. stop_redis2: SIGTERM by pid. Stopped on exit too.
# redis-server comes from PATH, or REDIS_SERVER.
start_redis2() {
    local attempt first="" why deadline
    [[ -n $REDIS2_PORT ]] || first=1
    mkdir -p "$WORK/redis2"
    for attempt in 1 2 3; do
        [[ -z $first ]] || REDIS2_PORT=$(free_port)
        rm -f "$WORK/redis2/redis.log"
        "${REDIS_SERVER:-redis-server}" --port "$REDIS2_PORT" --bind 127.0.0.1 --save '' \
            --appendonly no --dir "$WORK/redis2" --logfile redis.log </dev/null >/dev/null 2>&1 &
        REDIS2_PID=$!
        deadline=$((SECONDS + 10))
        while alive "$REDIS2_PID" && ((SECONDS < deadline)); do
            # By pid: another process's server on this port must not pass for ours.
            if redis-cli -p "$REDIS2_PORT" INFO server 2>/dev/null | grep -q "^process_id:$REDIS2_PID"; then
                return 0
            fi
            sleep 0.02
        done
        if alive "$REDIS2_PID"; then die "redis-server on 127.0.0.1:$REDIS2_PORT not answering within 10s"; fi
        wait "$REDIS2_PID" 2>/dev/null || true
        REDIS2_PID=""
        why=$(tail -n 1 "$WORK/redis2/redis.log" 2>/dev/null)
        [[ -n $first ]] || die "redis-server on 127.0.0.1:$REDIS2_PORT exited: $why"
        echo "redis-server exited at start (attempt $attempt): $why" >&2
    done
    die "redis-server did not start"
}
stop_redis2() {
    kill -TERM "$REDIS2_PID"
    wait "$REDIS2_PID" || true
    REDIS2_PID=""
}

# show_cmd DISPLAY COMMAND...: prints "$ DISPLAY", runs COMMAND, prints its standard output
# (through `relative "$T0" "$TNAME"` when T0 is set) and "(exit N)"; its stderr follows as
# "# " lines (it may name paths).
show_cmd() {
    local display=$1 out rc=0 line
    shift
    say "\$ $display"
    out=$("$@" 2>"$WORK/stderr") || rc=$?
    if [[ -n $out ]]; then
        if [[ -n ${T0:-} ]]; then out=$(relative "$T0" "${TNAME:-T}" <<<"$out"); fi
        say "$out"
    fi
    while IFS= read -r line; do note "stderr: $line"; done <"$WORK/stderr"
    say "(exit $rc)"
}

# relative T0 [NAME]: copies stdin to stdout with each epoch-ms number (13 digits) and each
# RFC 3339 time rewritten as <NAME+offset ms> from T0 (NAME defaults to T), so a transcript
# shows times that do not depend on the clock.
relative() {
    local t0=$1 name=${2:-T} line m ms off
    while IFS= read -r line; do
        while [[ $line =~ ([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+(Z|[+-][0-9]{2}:[0-9]{2})) ]]; do
            m=${BASH_REMATCH[1]}
            ms=$(date -d "$m" +%s%3N)
            off=$((ms - t0))
            ((off < 0)) || off="+$off"
            line=${line//"$m"/"<$name${off}ms>"}
        done
        while [[ $line =~ (^|[^0-9])([0-9]{13})([^0-9]|$) ]]; do
            m=${BASH_REMATCH[2]}
            off=$((m - t0))
            ((off < 0)) || off="+$off"
            line=${line//"$m"/"<$name${off}ms>"}
        done
        printf '%s\n' "$line"
    done
}

cleanup() {
    local rc=$?
    trap - EXIT
    local pid
    for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "$DAEMON_PID" "${INSTANCE_PIDS[@]}" "$REDIS2_PID"; do
        if [[ -n $pid ]] && alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    if ((rc != 0)); then
        local log
        for log in "$WORK"/zdelay-*.log; do
            [[ -s $log ]] || continue
            echo "--- last lines of $(basename "$log") ---" >&2
            tail -n 15 "$log" >&2
        done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
