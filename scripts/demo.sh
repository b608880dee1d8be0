#!/usr/bin/env bash
# zdelay end to end on local defaults, on a fresh Debian machine:
#
#   bash scripts/demo.sh
#
# 1. installs redis-server, redis-tools and curl with apt when missing;
# 2. starts a PRIVATE redis-server on a free loopback port in a temp dir (a Redis someone
#    runs on 6379 is never touched), with `notify-keyspace-events Kz` so raw ZADDs wake the
#    daemon at once;
# 3. builds zdelay the way scripts/test.sh does (`cargo build --features test-failpoints`,
#    debug profile: the failpoint hooks stay inert without ZDELAY_FAILPOINT), so the demo and
#    the test suite share one build: whichever runs first compiles it (5.5 minutes on
#    2 cores from scratch), the other reuses it. ZDELAY_DEMO_PROFILE=release builds what you
#    would deploy and measure instead (`cargo build --release`, about 5 minutes);
# 4. runs `zdelay run --config config/zdelay.toml` with ZDELAY_REDIS__URL and
#    ZDELAY_ADMIN__LISTEN pointing at the private Redis and a free admin port; waits for
#    /readyz;
# 5. starts a consumer (`BRPOP queue:emails-delayed queue:emails`, then `TIME` right after
#    each pop, in one redis-cli), enqueues jobs with the CLI (--in 250ms/500ms/1s/2s), a
#    batch on stdin (one line deliberately bad), and one raw `ZADD delayed:emails`, plus one
#    raw score written in seconds by mistake, which goes to dead with its reason;
# 6. prints each arrival with its lateness (arrival by Redis TIME minus due time),
#    `zdelay stats`, `zdelay dead list` and a few /metrics lines;
# 7. stops the daemon with SIGTERM (shows its exit code, 0) and Redis by pid.
# Everything it started is stopped and its temp dir removed on any exit.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
PROFILE=${ZDELAY_DEMO_PROFILE:-debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-demo.XXXXXX")
REDIS_PID=""
ZDELAY_PID=""
CONSUMER_PID=""

say() { printf '\n==> %s\n' "$*"; }
die() {
    printf '\nscripts/demo.sh: %s\n' "$*" >&2
    exit 1
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $CONSUMER_PID ]]; then kill "$CONSUMER_PID" 2>/dev/null || true; fi
    if [[ -n $ZDELAY_PID ]] && kill -0 "$ZDELAY_PID" 2>/dev/null; then
        kill -TERM "$ZDELAY_PID" 2>/dev/null || true
        wait "$ZDELAY_PID" 2>/dev/null || true
    fi
    if ((rc != 0)) && [[ -s $WORK/zdelay.log ]]; then
        echo "--- last lines of the zdelay log ---" >&2
        tail -n 20 "$WORK/zdelay.log" >&2
    fi
    if [[ -n $REDIS_PID ]] && kill -0 "$REDIS_PID" 2>/dev/null; then
        kill -TERM "$REDIS_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'echo "scripts/demo.sh: interrupted" >&2; exit 130' INT TERM

# A loopback port nobody listens on (checked by connecting; the servers bind it right away),
# below the kernel's ephemeral range (32768 and up), where an outgoing connection may take it.
free_port() {
    local port
    for _ in $(seq 200); do
        port=$((20000 + RANDOM % 12000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die "no free loopback port found"
}

# Redis's clock in epoch ms: the clock zdelay schedules by.
redis_ms() {
    local t
    mapfile -t t < <(redis-cli -p "$REDIS_PORT" TIME)
    echo $((t[0] * 1000 + 10#${t[1]} / 1000))
}

# HH:MM:SS.mmm (UTC) of epoch ms.
clock() { date -u -d "@$(($1 / 1000)).$(printf '%03d' $(($1 % 1000)))" +%T.%3N; }

# Prints a command (arguments with shell-special characters in single quotes), then runs it.
show() {
    local arg line='$' sq="'" esc="'\\''"
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
            line+=" $arg"
        else
            line+=" '${arg//$sq/$esc}'"
        fi
    done
    printf '%s\n' "$line"
    "$@"
}

# --- 1. packages ----------------------------------------------------------------------------
say "packages"
bash scripts/apt-ensure.sh redis-server:redis-server redis-cli:redis-tools curl:curl
if ! command -v cargo >/dev/null 2>&1 && [[ -x $HOME/.cargo/bin/cargo ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || die "cargo not found: install the Rust toolchain (rustup)"
echo "$(redis-server --version | cut -d' ' -f1-3); $(cargo --version)"
# zdelay refuses a Redis older than 7.0; say so before building anything.
redis_major=$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
if ((${redis_major:-0} < 7)); then
    die "$(redis-server --version | cut -d' ' -f1-3) is older than Redis 7.0, which zdelay needs: install Redis 7.0 or newer (Debian 12 and Ubuntu 24.04 ship it; on older distributions use packages.redis.io), then run this again"
fi

# --- 2. a private Redis ---------------------------------------------------------------------
say "private redis-server"
for _ in 1 2 3; do
    REDIS_PORT=$(free_port)
    if redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --dir "$WORK" --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log" \
        --notify-keyspace-events Kz; then
        for _ in $(seq 100); do
            [[ -s $WORK/redis.pid ]] && redis-cli -p "$REDIS_PORT" PING 2>/dev/null | grep -q PONG && break
            sleep 0.05
        done
    fi
    if redis-cli -p "$REDIS_PORT" PING 2>/dev/null | grep -q PONG; then break; fi
done
REDIS_PID=$(cat "$WORK/redis.pid" 2>/dev/null) || die "redis-server did not start: $(tail -n 5 "$WORK/redis.log" 2>/dev/null)"
echo "redis-server pid $REDIS_PID on 127.0.0.1:$REDIS_PORT (dir $WORK, notify-keyspace-events Kz)"

# --- 3. build -------------------------------------------------------------------------------
say "build ($PROFILE)"
start=$SECONDS
if [[ $PROFILE == release ]]; then
    cargo build --release --bin zdelay
else
    cargo build --bin zdelay --features test-failpoints
fi
BIN="${CARGO_TARGET_DIR:-target}/$PROFILE/zdelay"
[[ -x $BIN ]] || die "no binary at $BIN"
echo "built $BIN in $((SECONDS - start))s"
zdelay() { "$BIN" "$@"; }

# --- 4. the daemon --------------------------------------------------------------------------
say "zdelay run"
ADMIN_PORT=$(free_port)
export ZDELAY_CONFIG=config/zdelay.toml # every zdelay command below reads it (like --config)
export ZDELAY_REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
export ZDELAY_ADMIN__LISTEN="127.0.0.1:$ADMIN_PORT"
echo "ZDELAY_REDIS__URL=$ZDELAY_REDIS__URL ZDELAY_ADMIN__LISTEN=$ZDELAY_ADMIN__LISTEN"
# Never let the demo fall back to a Redis on 6379: the overrides must be in effect.
effective=$(zdelay check-config -o json 2>&1) || die "zdelay check-config failed: $effective"
if ! grep -qF "\"url\": \"$ZDELAY_REDIS__URL\"" <<<"$effective" ||
    ! grep -qF "\"listen\": \"$ZDELAY_ADMIN__LISTEN\"" <<<"$effective"; then
    die "the ZDELAY_REDIS__URL / ZDELAY_ADMIN__LISTEN overrides are not in effect; zdelay check-config says:
$(grep -E '"(url|listen)"' <<<"$effective")"
fi
echo "$ zdelay run --config config/zdelay.toml &"
"$BIN" run --config config/zdelay.toml >"$WORK/zdelay.log" 2>&1 </dev/null &
ZDELAY_PID=$!
ready=""
for _ in $(seq 200); do
    kill -0 "$ZDELAY_PID" 2>/dev/null || die "zdelay run exited early"
    if ready=$(curl -fsS "http://127.0.0.1:$ADMIN_PORT/readyz" 2>/dev/null); then break; fi
    sleep 0.05
done
[[ $ready == ready* ]] || die "zdelay not ready after 10s"
echo "pid $ZDELAY_PID; GET /readyz -> $ready"

# --- 5. a consumer, then producers ----------------------------------------------------------
EXPECTED=8 # 4 CLI jobs + 3 good batch lines + 1 raw ZADD
say "consumer: BRPOP queue:emails-delayed queue:emails, then TIME, $EXPECTED times (one redis-cli)"
for _ in $(seq "$EXPECTED"); do
    printf 'BRPOP queue:emails-delayed queue:emails 15\nTIME\n'
done | redis-cli -p "$REDIS_PORT" >"$WORK/consumed.txt" &
CONSUMER_PID=$!

# The due time of each job, by the tag in its payload.
declare -A DUE=()
due_of() { zdelay get "$1" -o json | sed -n 's/^ *"due": *\([0-9]*\).*/\1/p'; }

say "enqueue with the CLI (--in is measured on Redis's clock)"
for delay in 250ms 500ms 1s 2s; do
    payload="{\"to\":\"ann@example.com\",\"tag\":\"cli-$delay\"}"
    echo "$ zdelay enqueue --dest emails --in $delay --payload '$payload'"
    id=$(zdelay enqueue --dest emails --in "$delay" --payload "$payload")
    echo "$id"
    DUE[cli-$delay]=$(due_of "$id")
done

say "enqueue a batch on stdin (line 3 is bad: output line 3 is empty, exit code 2)"
cat >"$WORK/batch.jsonl" <<'EOF'
{"dest":"emails","in":"300ms","payload":"{\"to\":\"bob@example.com\",\"tag\":\"batch-1\"}"}
{"dest":"emails","in":"700ms","payload":"{\"to\":\"cy@example.com\",\"tag\":\"batch-2\"}","headers":{"trace":"t-2"}}
{"dest":"emails","payload":"no due time is fine, but this line has an unknown field","when":"later"}
{"dest":"emails","in":"1200ms","payload":"{\"to\":\"di@example.com\",\"tag\":\"batch-3\"}"}
EOF
cat "$WORK/batch.jsonl"
echo "$ zdelay enqueue --batch - < batch.jsonl"
rc=0
zdelay enqueue --batch - <"$WORK/batch.jsonl" >"$WORK/batch.ids" 2>"$WORK/batch.err" || rc=$?
sed 's/^/stdout: /' "$WORK/batch.ids"
sed 's/^/stderr: /' "$WORK/batch.err"
echo "exit code $rc"
mapfile -t ids <"$WORK/batch.ids"
DUE[batch-1]=$(due_of "${ids[0]}")
DUE[batch-2]=$(due_of "${ids[1]}")
DUE[batch-3]=$(due_of "${ids[3]}")

say "raw producer: ZADD delayed:emails <due ms> <payload> (no library)"
due=$(($(redis_ms) + 1500))
show redis-cli -p "$REDIS_PORT" ZADD delayed:emails "$due" '{"to":"eve@example.com","tag":"raw-zadd"}'
DUE[raw-zadd]=$due
bad=$((due / 1000))
echo "and one written in seconds by mistake (score $bad in an ms source goes to dead, not to 1970):"
show redis-cli -p "$REDIS_PORT" ZADD delayed:emails "$bad" '{"to":"fay@example.com","tag":"raw-seconds"}'

# --- 6. arrivals ----------------------------------------------------------------------------
say "arrivals (lateness = Redis TIME right after the pop - due time)"
for _ in $(seq 300); do kill -0 "$CONSUMER_PID" 2>/dev/null || break; sleep 0.05; done
wait "$CONSUMER_PID" || die "the consumer failed"
CONSUMER_PID=""
mapfile -t lines <"$WORK/consumed.txt"
printf '  %-12s %-24s %-13s %-13s %s\n' job list due arrived lateness
got=0
i=0
while ((i + 3 < ${#lines[@]})); do
    list=${lines[i]} payload=${lines[i + 1]}
    arrived=$((lines[i + 2] * 1000 + 10#${lines[i + 3]} / 1000))
    i=$((i + 4))
    tag=$(sed -n 's/.*"tag":"\([^"]*\)".*/\1/p' <<<"$payload")
    due=${DUE[$tag]:-}
    [[ -n $due ]] || die "unexpected payload on $list: $payload"
    printf '  %-12s %-24s %-13s %-13s %4d ms\n' "$tag" "$list" "$(clock "$due")" "$(clock "$arrived")" $((arrived - due))
    ((arrived >= due)) || die "$tag arrived before its due time"
    got=$((got + 1))
done
((got == EXPECTED)) || die "expected $EXPECTED arrivals, got $got"
echo "$got of $EXPECTED jobs arrived, each once, none early"

say "zdelay stats"
show zdelay stats
say "zdelay dead list"
show zdelay dead list

say "GET /metrics (a few lines)"
curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics" >"$WORK/metrics.txt"
grep -E '^zdelay_(jobs_moved_total|jobs_dead_total|lateness_seconds_(bucket\{.*le="(0.001|0.005|0.025)"|count)|wakeups_total|redis_up)' \
    "$WORK/metrics.txt" || true

# --- 7. stop --------------------------------------------------------------------------------
say "stop"
echo "$ kill -TERM $ZDELAY_PID"
kill -TERM "$ZDELAY_PID"
rc=0
wait "$ZDELAY_PID" || rc=$?
ZDELAY_PID=""
grep -E 'signal received|shutting down|stopped' "$WORK/zdelay.log" | sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^/  log: /' || true
echo "zdelay exited with code $rc"
((rc == 0)) || die "zdelay should exit 0 on SIGTERM"
echo "$ kill $REDIS_PID   # the private redis-server"
kill -TERM "$REDIS_PID"
for _ in $(seq 50); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.1; done
REDIS_PID=""
say "demo done"
