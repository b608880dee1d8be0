"""The checks behind scripts/deploy-check.sh, one subcommand each (run with the deploy venv's
python: helm-python-sdk, PyYAML). Every check prints what it looked at and exits non-zero
with the reason on the first mismatch.

  checks.py lint WORK                     helm lint --strict: chart (defaults and every ci/*-values.yaml) and example
  checks.py render OUT WORK               renders every ci/*-values.yaml and the example chart into OUT/<case>/
  checks.py assert OUT                    what the rendered manifests must say (security, probes, PDB, TOML, sidecar, rules)
  checks.py kubeval OUT KV                kubernetes-validate --strict -k 1.30.0 on OUT, plus a broken manifest it must refuse
  checks.py schema WORK                   bad values the chart must refuse (schema and template checks)
  checks.py metrics-list PAGE OUT         the exported metric names from the metrics reference page's table
  checks.py metrics METRICS               every metric the dashboard and the rules query is in METRICS
  checks.py dashboard-rules OUT           the dashboard's queries as a rules file, for promtool check rules
  checks.py chart-rules OUT               the chart's PrometheusRule with defaults = the rules file; written to OUT with its tests
  checks.py configs OUT ZDELAY            zdelay check-config on every rendered zdelay.toml
  checks.py helm3 OUT HELM                 a Helm 3 CLI's helm template of every case = OUT; kubeVersion enforced
  checks.py helm-test OUT ZDELAY BUSYBOX   the helm test Pod's script, with busybox, against a real zdelay and Redis
  checks.py chart-readme [--write]        charts/zdelay/README.md's values table = the one generated from values.yaml
"""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import tomllib

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "charts", "zdelay")
EXAMPLE = os.path.join(ROOT, "charts", "examples", "app-with-zdelay")
DASHBOARD = os.path.join(CHART, "dashboards", "zdelay.json")
RULES = os.path.join(CHART, "files", "zdelay-rules.yaml")
PLAIN_RULES = os.path.join(ROOT, "deploy", "prometheus", "zdelay-rules.yaml")
# Besides each chart's minimum (Chart.yaml kubeVersion), manifests are validated against this.
KUBE_VERSION = "1.30.0"
RELEASE = "demo"
NAMESPACE = "jobs"


class CheckError(Exception):
    pass


def fail(msg: str) -> None:
    raise CheckError(msg)


def helm():
    import helm_python

    return helm_python


def min_kube(chart_dir: str) -> str:
    """The oldest Kubernetes a chart supports: its Chart.yaml kubeVersion, ">=X.Y.Z-0"."""
    meta = yaml.safe_load(open(os.path.join(chart_dir, "Chart.yaml")))
    m = re.fullmatch(r">=\s*([0-9]+\.[0-9]+\.[0-9]+)(-0)?", str(meta.get("kubeVersion", "")).strip())
    if not m:
        fail(f"{os.path.relpath(chart_dir, ROOT)}/Chart.yaml: kubeVersion must be \">=X.Y.Z-0\", "
             f"is {meta.get('kubeVersion')!r}")
    return m.group(1)


def ci_values() -> list[tuple[str, dict]]:
    files = sorted(glob.glob(os.path.join(CHART, "ci", "*-values.yaml")))
    if not files:
        fail("no charts/zdelay/ci/*-values.yaml")
    return [(os.path.basename(f)[: -len("-values.yaml")], yaml.safe_load(open(f)) or {}) for f in files]


def example_copy(work: str) -> str:
    """The example chart with its zdelay dependency built from Chart.lock, in a copy of charts/
    (the working tree stays clean; the file:// path resolves the same way)."""
    dst = os.path.join(work, "charts")
    if not os.path.isdir(dst):
        shutil.copytree(os.path.join(ROOT, "charts"), dst, symlinks=False,
                        ignore=shutil.ignore_patterns("charts"))  # no vendored copy
        example = os.path.join(dst, "examples", "app-with-zdelay")
        try:
            helm().dependency_build(example, skip_refresh=True)
        except Exception as e:  # noqa: BLE001 - report the library's message
            fail(f"helm dependency build {os.path.relpath(EXAMPLE, ROOT)}: {e} "
                 "(Chart.lock out of date? run: helm dependency update charts/examples/app-with-zdelay)")
    return os.path.join(dst, "examples", "app-with-zdelay")


def example_cases() -> list[tuple[str, dict]]:
    cases = [("example", {})]
    for f in sorted(glob.glob(os.path.join(EXAMPLE, "values-*.yaml"))):
        name = os.path.basename(f)[len("values-"): -len(".yaml")]
        cases.append((f"example-{name}", yaml.safe_load(open(f)) or {}))
    return cases


# ---------------------------------------------------------------- lint

def lint_report(path: str, values: dict | None, what: str) -> None:
    report = helm().lint(path, values, strict=True, kube_version=f"v{min_kube(path)}",
                         namespace=NAMESPACE, with_subcharts=True)
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    if report.get("errors") or bad:
        for m in bad:
            print(f"    {m.get('path')}: {m.get('error')}")
        for e in report.get("errors") or []:
            print(f"    {e}")
        fail(f"helm lint --strict {what}: {len(bad)} findings, {len(report.get('errors') or [])} errors")
    print(f"  lint ok: {what} (Kubernetes {min_kube(path)})")


def cmd_lint(work: str) -> None:
    lint_report(CHART, None, "charts/zdelay (default values)")
    for name, values in ci_values():
        lint_report(CHART, values, f"charts/zdelay with ci/{name}-values.yaml")
    example = example_copy(work)
    for name, values in example_cases():
        lint_report(example, values, f"charts/examples/app-with-zdelay ({name})")


# ---------------------------------------------------------------- render

def render(chart_dir: str, values: dict, kube: str | None = None) -> dict[str, str]:
    """helm template, for Kubernetes `kube` (default: the chart's minimum, so that what the
    templates decide from .Capabilities holds on the oldest cluster the chart admits)."""
    from helm_python import _native  # the wrapper's render() has no kube_version; the engine has

    opts = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
            "kube_version": f"v{kube or min_kube(chart_dir)}"}
    with helm().Chart.load(chart_dir) as chart:
        rendered = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    return json.loads(rendered)


def cmd_render(out: str, work: str) -> None:
    cases = [("default", CHART, {})] + [(n, CHART, v) for n, v in ci_values()]
    example = example_copy(work)
    cases += [(n, example, v) for n, v in example_cases()]
    for name, chart_dir, values in cases:
        try:
            files = render(chart_dir, values)
        except Exception as e:  # noqa: BLE001
            fail(f"render {name}: {e}")
        case_dir = os.path.join(out, name)
        os.makedirs(case_dir, exist_ok=True)
        kinds = []
        for path, text in sorted(files.items()):
            if not path.endswith(".yaml") or not text.strip():
                continue
            target = os.path.join(case_dir, path.replace("/", "__"))
            with open(target, "w") as f:
                f.write(text)
            for doc in yaml.safe_load_all(text):
                if doc:
                    kinds.append(doc["kind"])
        print(f"  rendered {name}: {', '.join(sorted(kinds))}")


def load_case(out: str, name: str) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(os.path.join(out, name, "*.yaml"))):
        docs += [d for d in yaml.safe_load_all(open(path)) if d]
    if not docs:
        fail(f"nothing rendered for {name}")
    return docs


def one(docs: list[dict], kind: str, case: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        fail(f"{case}: expected one {kind}{' ' + name if name else ''}, found {len(found)}")
    return found[0]


# ---------------------------------------------------------------- assertions

def duration_ms(text: str) -> int:
    factors = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}
    return sum(int(n) * factors[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h)", text))


def exposed(admin: dict) -> dict[str, bool]:
    """What the values put on 0.0.0.0:9464 with a Service of its own: the console (when on
    and exposeConsole) and the HTTP enqueue (exposeHttpEnqueue)."""
    return {"console": admin.get("console", True) and admin.get("exposeConsole", False),
            "enqueue": admin.get("exposeHttpEnqueue", False)}


def check_container(c: dict, case: str, sidecar: bool, admin: dict | None = None) -> None:
    sc = c.get("securityContext") or {}
    want = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    for k, v in want.items():
        if sc.get(k) != v:
            fail(f"{case}: container zdelay securityContext.{k} is {sc.get(k)!r}, want {v!r}")
    if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
        fail(f"{case}: container zdelay must drop ALL capabilities")
    if (sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        fail(f"{case}: container zdelay seccompProfile must be RuntimeDefault")
    env = {e["name"]: e for e in c.get("env", [])}
    # The console and the HTTP enqueue on loopback unless exposed; probes and metrics on a
    # port of their own.
    admin = admin or {}
    port_open = any(exposed(admin).values())
    # exposeConsole binds 0.0.0.0 even with the console off (nothing but health there then).
    public = admin.get("exposeConsole", False) or port_open
    listen = ("0.0.0.0" if public else "127.0.0.1") + ":9464"
    if env.get("ZDELAY_ADMIN__LISTEN", {}).get("value") != listen:
        fail(f"{case}: ZDELAY_ADMIN__LISTEN must be {listen}")
    if env.get("ZDELAY_ADMIN__METRICS_LISTEN", {}).get("value") != "0.0.0.0:9465":
        fail(f"{case}: ZDELAY_ADMIN__METRICS_LISTEN must be 0.0.0.0:9465")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    metrics = "zdelay-metrics" if sidecar else "metrics"
    if ports.get(metrics) != 9465:
        fail(f"{case}: container port {metrics} must be 9465, ports are {ports}")
    if (9464 in ports.values()) != port_open:
        fail(f"{case}: the console's port 9464 is a container port iff admin.exposeConsole (with the "
             f"console) or admin.exposeHttpEnqueue: {ports}")
    if env.get("ZDELAY_CONFIG", {}).get("value") != "/etc/zdelay/zdelay.toml":
        fail(f"{case}: ZDELAY_CONFIG must be /etc/zdelay/zdelay.toml")
    instance = env.get("ZDELAY_POLLER__INSTANCE_ID", {}).get("valueFrom", {}).get("fieldRef", {})
    if instance.get("fieldPath") != "metadata.name":
        fail(f"{case}: ZDELAY_POLLER__INSTANCE_ID must be the pod name (fieldRef metadata.name)")
    for name, e in env.items():
        secretish = re.search(r"PASSWORD|__URL$|TOKEN|SECRET", name)
        if secretish and name != "ZDELAY_CONFIG" and "value" in e:
            fail(f"{case}: {name} is a literal value; credentials must come from a secretKeyRef")
    live = c.get("livenessProbe", {}).get("httpGet", {})
    if live.get("path") != "/healthz" or live.get("port") != metrics:
        fail(f"{case}: liveness probe must GET /healthz on port {metrics}, has {live}")
    ready = c.get("readinessProbe", {}).get("httpGet", {})
    # By default a broker outage must not make pods unready (rollouts would stall).
    if not sidecar and (ready.get("path") != "/readyz?sinks=ignore" or ready.get("port") != metrics):
        fail(f"{case}: readiness probe must GET /readyz?sinks=ignore on port {metrics}, has {ready}")
    start = c.get("startupProbe", {}).get("httpGet", {})
    if start.get("path") != "/healthz" or start.get("port") != metrics:
        fail(f"{case}: startup probe must GET /healthz on port {metrics}, has {start}")
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    if "/etc/zdelay/zdelay.toml" not in mounts:
        fail(f"{case}: the config is not mounted at /etc/zdelay/zdelay.toml")
    if not (c.get("resources") or {}).get("requests"):
        fail(f"{case}: container zdelay has no resource requests")


def config_of(docs: list[dict], case: str, name: str) -> dict:
    cm = one(docs, "ConfigMap", case, name)
    text = cm["data"]["zdelay.toml"]
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        fail(f"{case}: zdelay.toml is not valid TOML: {e}\n{text}")


THRESHOLD = re.compile(r"([<>=!]=?)\s*[0-9][0-9.e+-]*\s*$")


def expected_rules(values: dict) -> dict:
    """The PrometheusRule spec the chart must render for these values: the rules file with
    prometheusRule.rules, alertLabels and runbookBaseUrl applied (an implementation of its own,
    not the template's)."""
    pr = values.get("prometheusRule", {})
    settings = pr.get("rules", {})
    base = pr.get("runbookBaseUrl", "")
    groups = []
    for g in yaml.safe_load(open(RULES))["groups"]:
        rules = []
        for r in g["rules"]:
            s = settings.get(r["alert"], {})
            if s.get("enabled", True) is False:
                continue
            r = copy.deepcopy(r)
            if "threshold" in s:
                r["expr"], n = THRESHOLD.subn(lambda m: f"{m.group(1)} {s['threshold']}", r["expr"])
                if n != 1:
                    fail(f"rule {r['alert']}: no threshold to replace in {r['expr']!r}")
            if "for" in s:
                if s["for"]:
                    r["for"] = s["for"]
                else:
                    r.pop("for", None)
            labels = {**pr.get("alertLabels", {}), **r.get("labels", {})}
            if s.get("severity"):
                labels["severity"] = s["severity"]
            if labels:
                r["labels"] = labels
            if base:
                r.setdefault("annotations", {})["runbook_url"] = \
                    f"{base.rstrip('/')}/guides/monitoring.html#{r['alert'].lower()}"
            rules.append(r)
        if rules:
            groups.append({**g, "rules": rules})
    return {"groups": groups}


def check_common_labels(docs: list[dict], case: str, values: dict) -> None:
    """commonLabels on every object and on the pod template; never in a selector."""
    common = values.get("commonLabels", {})
    for d in docs:
        where = f"{case}: {d['kind']} {d['metadata']['name']}"
        labels = d["metadata"].get("labels", {})
        for k, v in common.items():
            if labels.get(k) != v:
                fail(f"{where}: commonLabels {k}={v} missing from its labels {labels}")
        if d["kind"] == "Deployment":
            pod = d["spec"]["template"]["metadata"].get("labels", {})
            if any(pod.get(k) != v for k, v in common.items()):
                fail(f"{where}: commonLabels missing from the pod template's labels {pod}")
            if any(k in d["spec"]["selector"]["matchLabels"] for k in common):
                fail(f"{where}: commonLabels must stay out of the selector (it cannot change)")


def check_test_pod(docs: list[dict], case: str, values: dict, fullname: str, container: dict) -> None:
    """helm test: one hook Pod that GETs the Service's readiness path and /metrics, which the
    Service and the PodDisruptionBudget do not select."""
    tests = [d for d in docs if d["kind"] == "Pod"]
    if values.get("test", {}).get("enabled", True) is False:
        if tests:
            fail(f"{case}: test Pod rendered though test.enabled is false")
        return
    if len(tests) != 1:
        fail(f"{case}: expected one helm test Pod, found {len(tests)}")
    pod = tests[0]
    if pod["metadata"].get("annotations", {}).get("helm.sh/hook") != "test":
        fail(f"{case}: the test Pod must carry helm.sh/hook: test")
    svc = one(docs, "Service", case, fullname)
    labels = pod["metadata"].get("labels", {})
    if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
        fail(f"{case}: the Service's selector {svc['spec']['selector']} selects the test Pod")
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    probe = container.get("readinessProbe", {}).get("httpGet", {}).get("path", "/readyz?sinks=ignore")
    want = {"HOST": fullname, "PORT": str(svc["spec"]["ports"][0]["port"]), "READY_PATH": probe}
    if {k: env.get(k) for k in want} != want:
        fail(f"{case}: the test Pod must GET {want}, has {env}")
    script = "\n".join(c.get("args", []))
    if '"$BASE$READY_PATH"' not in script or '"$BASE/metrics"' not in script:
        fail(f"{case}: the test Pod's script does not GET the readiness path and /metrics")
    # The test Pod runs under zdelay's own security contexts (admitted wherever zdelay is).
    dep = one(docs, "Deployment", case)
    if pod["spec"].get("securityContext") != dep["spec"]["template"]["spec"].get("securityContext") \
            or c.get("securityContext") != container.get("securityContext"):
        fail(f"{case}: the test Pod's security contexts must be zdelay's (podSecurityContext, containerSecurityContext)")
    if pod["spec"].get("restartPolicy") != "Never":
        fail(f"{case}: the test Pod must have restartPolicy Never")


def cmd_assert(out: str) -> None:
    if os.path.realpath(PLAIN_RULES) != os.path.realpath(RULES):
        fail("deploy/prometheus/zdelay-rules.yaml must be the chart's files/zdelay-rules.yaml (a link to it)")
    dashboard = json.load(open(DASHBOARD))
    fullname = f"{RELEASE}-zdelay"
    for name, values in [("default", {})] + ci_values():
        docs = load_case(out, name)
        mode = values.get("mode", "standalone")
        replicas = values.get("replicas", 1)
        external = values.get("existingConfigMap")
        check_common_labels(docs, name, values)
        if external:
            # The user's ConfigMap: the chart renders none and has no config to read.
            if [d for d in docs if d["kind"] == "ConfigMap" and "zdelay.toml" in d.get("data", {})]:
                fail(f"{name}: existingConfigMap is set, yet a zdelay.toml ConfigMap is rendered")
            cfg = {}
        else:
            cfg = config_of(docs, name, fullname)
        # Dashboard ConfigMap for Grafana's sidecar.
        dash = one(docs, "ConfigMap", name, f"{fullname}-dashboard")
        if dash["metadata"]["labels"].get("grafana_dashboard") != "1":
            fail(f"{name}: dashboard ConfigMap lacks label grafana_dashboard: \"1\"")
        if json.loads(dash["data"]["zdelay.json"]) != dashboard:
            fail(f"{name}: dashboard ConfigMap differs from dashboards/zdelay.json")
        # PrometheusRule: the same rules as the plain file.
        prs = [d for d in docs if d["kind"] == "PrometheusRule"]
        if values.get("prometheusRule", {}).get("enabled"):
            want_rules = expected_rules(values)
            if len(prs) != 1 or prs[0]["spec"] != want_rules:
                fail(f"{name}: PrometheusRule spec must be files/zdelay-rules.yaml with the values' "
                     f"prometheusRule settings applied:\n{yaml.safe_dump(want_rules)}\ngot:\n"
                     f"{yaml.safe_dump(prs[0]['spec']) if prs else 'none'}")
        elif prs:
            fail(f"{name}: PrometheusRule rendered though prometheusRule.enabled is false")
        deps = [d for d in docs if d["kind"] == "Deployment"]
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        if mode == "sidecar":
            if deps or pdbs or any(d["kind"] in ("Service", "ServiceMonitor") for d in docs):
                fail(f"{name}: sidecar mode must render no Deployment, Service, PDB or ServiceMonitor")
            pms = [d for d in docs if d["kind"] == "PodMonitor"]
            pm_values = values.get("podMonitor", {})
            if pm_values.get("enabled"):
                want = pm_values.get("selector")
                ends = pms[0]["spec"]["podMetricsEndpoints"] if len(pms) == 1 else []
                if (len(pms) != 1 or pms[0]["spec"]["selector"]["matchLabels"] != want
                        or [e.get("port") for e in ends] != ["zdelay-metrics"]):
                    fail(f"{name}: PodMonitor must select {want} and scrape port zdelay-metrics: {pms}")
            elif pms:
                fail(f"{name}: PodMonitor rendered though podMonitor.enabled is false")
            if any(d["kind"] == "Pod" for d in docs):
                fail(f"{name}: sidecar mode must render no helm test Pod (there is no Service to test)")
            print(f"  {name}: sidecar mode renders config, dashboard{', rules' if prs else ''}"
                  f"{', PodMonitor' if pms else ''} only")
            continue
        dep = one(docs, "Deployment", name)
        spec = dep["spec"]["template"]["spec"]
        if dep["spec"]["replicas"] != replicas:
            fail(f"{name}: replicas {dep['spec']['replicas']}, want {replicas}")
        psc = spec.get("securityContext", {})
        if not psc.get("runAsNonRoot") or psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            fail(f"{name}: pod securityContext must set runAsNonRoot and seccomp RuntimeDefault")
        if name == "openshift":
            containers = spec.get("containers", [])
            ids = [k for k in ("runAsUser", "runAsGroup", "fsGroup") if k in psc]
            ids += [k for c in containers for k in ("runAsUser", "runAsGroup")
                    if k in (c.get("securityContext") or {})]
            if ids:
                fail(f"{name}: the values dropped the fixed ids, yet {ids} are rendered")
        if spec.get("automountServiceAccountToken") is not False:
            fail(f"{name}: the pod must not mount a service account token")
        grace_ms = duration_ms(cfg.get("poller", {}).get("shutdown_grace", "10s"))
        tgps = spec.get("terminationGracePeriodSeconds", 30)
        if tgps * 1000 < grace_ms + 5000:
            fail(f"{name}: terminationGracePeriodSeconds {tgps} < shutdown_grace + 5 s")
        (c,) = [c for c in spec["containers"] if c["name"] == "zdelay"]
        check_container(c, name, sidecar=False, admin=values.get("admin"))
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        if "checksum/config" not in ann:
            fail(f"{name}: pod template lacks the checksum/config annotation")
        want_pdb = replicas > 1
        if want_pdb != bool(pdbs):
            fail(f"{name}: replicas {replicas} but {len(pdbs)} PodDisruptionBudget(s)")
        if pdbs and (pdbs[0]["spec"].get("maxUnavailable") != 1 or "minAvailable" in pdbs[0]["spec"]):
            fail(f"{name}: the PodDisruptionBudget must be maxUnavailable: 1")
        svc = one(docs, "Service", name, fullname)
        if [(p["name"], p["port"]) for p in svc["spec"]["ports"]] != [("metrics", 9465)]:
            fail(f"{name}: Service {fullname} must carry the metrics port 9465 alone, never the console")
        admin = values.get("admin", {})
        exposure = exposed(admin)
        for suffix, value in [("console", "admin.exposeConsole"), ("enqueue", "admin.exposeHttpEnqueue")]:
            svcs = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"{fullname}-{suffix}"]
            if bool(svcs) != exposure[suffix] or (svcs and svcs[0]["spec"]["ports"][0]["port"] != 9464):
                fail(f"{name}: Service {fullname}-{suffix} (port 9464) rendered iff {value}")
        producer = values.get("secrets", {}).get("producerToken", {})
        token = [e for e in c.get("env", []) if e["name"] == "ZDELAY_ADMIN__PRODUCER_TOKEN"]
        want_ref = {"name": producer.get("existingSecret"), "key": producer.get("key")}
        if bool(token) != bool(producer.get("existingSecret")) or (
                token and token[0].get("valueFrom", {}).get("secretKeyRef") != want_ref):
            fail(f"{name}: ZDELAY_ADMIN__PRODUCER_TOKEN from Secret {want_ref} iff secrets.producerToken: {token}")
        want_admin = {"console": values.get("admin", {}).get("console", True),
                      "public_reads": values.get("admin", {}).get("publicReads", True)}
        hosts = list(values.get("admin", {}).get("allowedHosts", []))
        if values.get("admin", {}).get("exposeHttpEnqueue"):
            # The enqueue Service's names, which producers in the cluster call it by.
            svc = f"{fullname}-enqueue"
            hosts += [svc, f"{svc}.{NAMESPACE}", f"{svc}.{NAMESPACE}.svc", f"{svc}.{NAMESPACE}.svc.cluster.local"]
        if hosts:
            want_admin["allowed_hosts"] = hosts
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if external:
            # What the chart would have written into [admin] comes as env (over the file).
            admin_env = {k[len("ZDELAY_ADMIN__"):].lower(): json.loads(v) for k, v in env.items()
                         if k.startswith("ZDELAY_ADMIN__") and not k.endswith("LISTEN") and v is not None}
            if admin_env != want_admin:
                fail(f"{name}: with existingConfigMap the admin env must be {want_admin}, is {admin_env}")
            vol = [v for v in spec["volumes"] if v["name"] == "zdelay-config"]
            if not vol or vol[0]["configMap"] != {"name": external, "items": [{"key": "zdelay.toml", "path": "zdelay.toml"}]}:
                fail(f"{name}: the config volume must be ConfigMap {external}, key zdelay.toml: {vol}")
            if values.get("tls", {}).get("redis", {}).get("enabled"):
                tls_env = {k: v for k, v in env.items() if k.startswith("ZDELAY_REDIS__TLS__")}
                if tls_env.get("ZDELAY_REDIS__TLS__CA_FILE") != "/etc/zdelay/tls/redis/ca.crt":
                    fail(f"{name}: with existingConfigMap, [redis.tls] must come as env, has {tls_env}")
        else:
            if cfg.get("admin", {}) != want_admin:
                fail(f"{name}: [admin] is {cfg.get('admin')}, want {want_admin}")
            if any(k.startswith("ZDELAY_ADMIN__") and not k.endswith(("LISTEN", "TOKEN")) for k in env):
                fail(f"{name}: [admin] is in the rendered file; no ZDELAY_ADMIN__ env besides listen and token")
        sms = [d for d in docs if d["kind"] == "ServiceMonitor"]
        if bool(sms) != bool(values.get("serviceMonitor", {}).get("enabled")):
            fail(f"{name}: ServiceMonitor rendered iff serviceMonitor.enabled")
        if sms and [e["port"] for e in sms[0]["spec"]["endpoints"]] != ["metrics"]:
            fail(f"{name}: the ServiceMonitor must scrape the metrics port")
        check_test_pod(docs, name, values, fullname, c)
        secret_refs = sorted(e["name"] for e in c.get("env", []) if "valueFrom" in e)
        extra = []
        if name == "tls":
            tls = cfg.get("redis", {}).get("tls")
            want = {"ca_file": "/etc/zdelay/tls/redis/ca.crt", "cert_file": "/etc/zdelay/tls/redis/tls.crt",
                    "key_file": "/etc/zdelay/tls/redis/tls.key", "insecure_skip_verify": False}
            if tls != want:
                fail(f"tls: [redis.tls] is {tls}, want {want}")
            vol = [v for v in spec["volumes"] if v["name"] == "zdelay-redis-tls"]
            mounts = [m for m in c["volumeMounts"] if m["name"] == "zdelay-redis-tls"]
            if not vol or vol[0]["secret"]["secretName"] != "zdelay-redis-tls" or not mounts \
                    or mounts[0]["mountPath"] != "/etc/zdelay/tls/redis":
                fail("tls: the TLS Secret must be mounted at /etc/zdelay/tls/redis")
            if not cfg["redis"].get("url", "").startswith("rediss://"):
                fail("tls: redis.url must be rediss://")
            extra.append("[redis.tls] ca/cert/key files from Secret zdelay-redis-tls")
        if name == "cluster":
            nodes = cfg.get("redis", {}).get("cluster_nodes")
            if not (isinstance(nodes, list) and len(nodes) == 3 and all(":" in n for n in nodes)):
                fail(f"cluster: redis.cluster_nodes is {nodes!r}, want three redis://host:port seeds")
            if "url" in cfg["redis"]:
                fail("cluster: redis.url must be left out (url: null) when cluster_nodes is set")
            extra.append(f"redis.cluster_nodes = {len(nodes)} seeds")
        shown = [s for s, on in exposure.items() if on]
        if shown:
            names = {"console": "console", "enqueue": "HTTP enqueue"}
            extra.append(f"{' and '.join(names[s] for s in shown)} exposed on 0.0.0.0:9464 with Service "
                         f"{', '.join('-' + s for s in shown)}; metrics Service 9465 alone")
        if external:
            extra.append(f"config from ConfigMap {external}, [admin] and [redis.tls] as env")
        if values.get("commonLabels"):
            extra.append(f"commonLabels on all {len(docs)} objects")
        if prs:
            extra.append(f"PrometheusRule with {sum(len(g['rules']) for g in prs[0]['spec']['groups'])} alerts")
        print(f"  {name}: Deployment x{replicas}, grace {tgps}s, PDB {'yes' if pdbs else 'no'}, "
              f"secret env {secret_refs or 'none'}{'; ' + '; '.join(extra) if extra else ''}")
    # The example parent chart: zdelay as a native sidecar in the app's pods.
    for name, values in example_cases():
        docs = load_case(out, name)
        app = one(docs, "Deployment", name)
        if any(d["kind"] == "Deployment" and d["metadata"]["name"] == fullname for d in docs):
            fail(f"{name}: the zdelay subchart must not render its own Deployment in sidecar mode")
        spec = app["spec"]["template"]["spec"]
        side = [c for c in spec.get("initContainers", []) if c["name"] == "zdelay"]
        if len(side) != 1 or side[0].get("restartPolicy") != "Always":
            fail(f"{name}: zdelay must be an init container with restartPolicy: Always (native sidecar)")
        check_container(side[0], name, sidecar=True)
        if "readinessProbe" in side[0]:
            fail(f"{name}: the sidecar has a readiness probe: a Redis outage would make the app unready")
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        cm_name = vols.get("zdelay-config", {}).get("configMap", {}).get("name")
        cfg = config_of(docs, name, cm_name)
        url = cfg["redis"]["url"]
        grace_ms = duration_ms(cfg.get("poller", {}).get("shutdown_grace", "10s"))
        if spec.get("terminationGracePeriodSeconds", 30) * 1000 < grace_ms + 5000:
            fail(f"{name}: pod terminationGracePeriodSeconds below zdelay's shutdown_grace + 5 s")
        local = [c["name"] for c in spec.get("initContainers", []) if c["name"] != "zdelay"]
        order = [c["name"] for c in spec.get("initContainers", [])]
        if "redis" in local and order.index("redis") > order.index("zdelay"):
            fail(f"{name}: the local Redis sidecar must start before zdelay")
        print(f"  {name}: app Deployment with native sidecar zdelay (initContainers {order}), "
              f"redis {url}, config {cm_name}")


# ---------------------------------------------------------------- kubernetes-validate

BROKEN = """apiVersion: apps/v1
kind: Deployment
metadata:
  name: broken
spec:
  selector:
    matchLabels: {app: x}
  template:
    metadata:
      labels: {app: x}
    spec:
      containers:
        - name: x
          image: x
          imagee: typo
"""


def kubeval_files(kv: str, version: str, files: list[str]) -> None:
    res = subprocess.run([kv, "--strict", "-k", version, *files], capture_output=True, text=True)
    lines = (res.stdout + res.stderr).splitlines()
    passed = [l for l in lines if l.startswith("INFO") and " passed " in l]
    unknown = [l for l in lines if "Couldn't find schema" in l]
    bad = [l for l in lines if l.strip() and l not in passed and l not in unknown]
    crd_only = all(re.search(r"kind (ServiceMonitor|PodMonitor|PrometheusRule) with api version monitoring\.coreos\.com/", l)
                   for l in unknown)
    if res.returncode != 0 or bad or not crd_only:
        print("\n".join(bad + [l for l in unknown]))
        fail(f"kubernetes-validate --strict -k {version}: exit {res.returncode}")
    print(f"  {len(passed)} resources valid against Kubernetes {version} (strict); "
          f"{len(unknown)} Prometheus Operator resources have no schema here (rules checked by promtool)")


def cmd_kubeval(out: str, kv: str) -> None:
    """Every rendered case against KUBE_VERSION and against its chart's minimum (kubeVersion)."""
    by_min: dict[str, list[str]] = {}
    every = []
    for case_dir in sorted(glob.glob(os.path.join(out, "*", ""))):
        case = os.path.basename(os.path.dirname(case_dir))
        files = sorted(glob.glob(os.path.join(case_dir, "*.yaml")))
        every += files
        by_min.setdefault(min_kube(EXAMPLE if case.startswith("example") else CHART), []).extend(files)
    kubeval_files(kv, KUBE_VERSION, every)
    for version, files in sorted(by_min.items()):
        print(f"  the chart's minimum, Kubernetes {version}:")
        kubeval_files(kv, version, files)
    broken = os.path.join(out, "broken.yaml.txt")
    with open(broken, "w") as f:
        f.write(BROKEN)
    res = subprocess.run([kv, "--strict", "-k", KUBE_VERSION, broken], capture_output=True, text=True)
    if res.returncode == 0:
        fail("kubernetes-validate accepted a Deployment with an unknown field: the check proves nothing")
    print("  control: a Deployment with a misspelt field is refused")


# ---------------------------------------------------------------- schema

def expect_refusal(values: dict, what: str, needle: str, chart_dir: str = CHART, kube: str | None = None) -> None:
    try:
        render(chart_dir, values, kube)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        if needle not in msg:
            fail(f"{what}: refused, but the message does not name {needle!r}: {msg}")
        first = " ".join(msg.split())[:150]
        print(f"  refused as it should: {what}: {first}")
        return
    fail(f"{what}: the chart rendered it; it must refuse it")


def cmd_schema(work: str) -> None:
    expect_refusal({"iamge": {"repository": "zdelay"}}, "typo at the top (iamge:)", "iamge")
    expect_refusal({"replicas": "two"}, "wrong type (replicas: \"two\")", "replicas")
    expect_refusal({"config": {"poller": {"batchh": 500}}}, "typo inside config (poller.batchh)", "batchh")
    expect_refusal({"config": {"redis": {"shards": "16"}}}, "wrong type inside config (redis.shards: \"16\")", "shards")
    expect_refusal({"config": {"poller": {"shutdown_grace": "10 secs later"}}}, "unsupported duration", "shutdown_grace")
    expect_refusal({"mode": "daemonset"}, "unknown mode", "mode")
    expect_refusal({"tls": {"redis": {"enabled": True, "existingSecrett": "x"}}}, "typo in tls.redis", "existingSecrett")
    expect_refusal({"config": {"sinks": {"rabbit": {"kind": "amqp", "brokers": "x"}}}},
                   "a Kafka field on an AMQP sink", "brokers")
    expect_refusal({"terminationGracePeriodSeconds": 12}, "grace below shutdown_grace + 5 s", "terminationGracePeriodSeconds")
    expect_refusal({"config": {"redis": {"url": "redis://zd:s3cret@redis:6379"}}},
                   "credentials in config.redis.url", "credentials")
    expect_refusal({"config": {"sinks": {"rabbit": {"kind": "amqp"}}}}, "AMQP sink without a URL", "rabbit")
    expect_refusal({"tls": {"redis": {"enabled": True, "existingSecret": "t"}}}, "TLS with a redis:// URL", "rediss://")
    expect_refusal({"admin": {"metricsPort": 9464}}, "the metrics port on the console's", "metricsPort")
    expect_refusal({"admin": {"allowedHosts": ["http://zdelay.example.com"]}}, "a URL as an allowed host",
                   "allowedHosts")
    expect_refusal({"secrets": {"adminToken": {"existingSecret": "zdelay-admin"}}}, "a token Secret without its key",
                   "adminToken")
    expect_refusal({"secrets": {"producerToken": {"key": "token"}}}, "a producer token key without its Secret",
                   "producerToken")
    expect_refusal({"admin": {"exposeHttpEnqueue": True}}, "the HTTP enqueue exposed without the producers' token",
                   "secrets.producerToken")
    expect_refusal({"config": {"poller": {"per_shard": 3}}}, "poller.per_shard above 2", "per_shard")
    expect_refusal({"config": {"sinks": {"orders-eu": {"kind": "nats", "url": "nats://n:4222"}}}},
                   "a sink name that cannot be an environment variable's", "orders-eu")
    expect_refusal({"config": {"redis": {"password": "x"}}}, "a password in the ConfigMap", "password")
    expect_refusal({"commonLabels": {"team": 5}}, "a number as a label value", "commonLabels")
    expect_refusal({"commonLabels": {"team!": "x"}}, "an invalid label name", "team!")
    expect_refusal({"commonLabels": {"app.kubernetes.io/instance": "x"}}, "a chart-owned label in commonLabels",
                   "commonLabels.app.kubernetes.io/instance")
    expect_refusal({"existingConfigMap": "My_Config"}, "an invalid ConfigMap name", "existingConfigMap")
    expect_refusal({"prometheusRule": {"enabled": True, "rules": {"ZdelayAbsnt": {"enabled": False}}}},
                   "a misspelt alert name", "ZdelayAbsnt")
    expect_refusal({"prometheusRule": {"enabled": True, "rules": {"ZdelayAbsent": {"threshold": 3}}}},
                   "a threshold on an alert without one", "threshold")
    expect_refusal({"prometheusRule": {"enabled": True, "rules": {"ZdelaySinkDown": {"for": "2 minutes"}}}},
                   "an alert's for not a duration", "for")
    expect_refusal({"prometheusRule": {"enabled": True, "rules": {"ZdelayLatenessHigh": {"threshold": "1s"}}}},
                   "a threshold with a unit", "threshold")
    expect_refusal({"prometheusRule": {"runbookBaseUrl": "docs.example.com/zdelay"}}, "a runbook base that is no URL",
                   "runbookBaseUrl")
    expect_refusal({"test": {"image": {"repository": "busybox", "tag": ""}}}, "a test image without a tag", "tag")
    example = example_copy(work)
    expect_refusal({}, "a native sidecar on Kubernetes 1.28", "sidecar.native", chart_dir=example, kube="1.28.0")
    ok = {"image": {"repository": "zdelay"}, "replicas": 2}
    render(CHART, ok)
    render(example, {"zdelay": {"sidecar": {"native": False}}}, kube="1.28.0")
    print("  control: a correct value set renders; so does the example with a regular sidecar on 1.28")
    # Every daemon field the chart offers, in the forms the daemon reads.
    full = {"config": {
        "poller": {"per_shard": 2, "slot_lease": "5s", "sink_concurrency": 8, "sink_inflight_bytes": 33554432,
                   "shutdown_grace": "1min", "lease": "1m30s", "idle_poll": "250ms"},
        "redis": {"password_file": "/var/run/zdelay/redis-password"},
        "sinks": {"events": {"kind": "kafka", "brokers": "kafka:9092",
                             "sasl": {"mechanism": "SCRAM-SHA-512", "username": "zdelay",
                                      "password_file": "/var/run/zdelay/kafka-password"},
                             "tls": {"ca_file": "/var/run/zdelay/ca.pem"}}},
        "routes": [{"name": "events", "sink": "events", "target": "events", "on_missing": "dead"}],
    }}
    docs = [d for path, text in render(CHART, full).items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    grace = [d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for d in docs if d.get("kind") == "Deployment"]
    if grace != [65]:
        fail(f"shutdown_grace 1min: terminationGracePeriodSeconds must be 60 + 5, is {grace}")
    print("  control: per_shard, slot_lease, sink limits, password_file, Kafka SASL/TLS and humantime durations render")


# ---------------------------------------------------------------- metrics

def cmd_metrics_list(page: str, out: str) -> None:
    """docs/reference/metrics.md: generated from the metric definitions, one row a metric."""
    names = []
    for line in open(page):
        m = re.match(r"\|\s*`(zdelay_[a-z0-9_]+)`\s*\|\s*(counter|gauge|histogram)\s*\|", line)
        if m:
            name, kind = m.groups()
            names.append(name)
            if kind == "histogram":
                names += [name + "_bucket", name + "_sum", name + "_count"]
    if len(names) < 10:
        fail(f"found only {len(names)} metric names in {page}'s metrics table")
    with open(out, "w") as f:
        f.write("\n".join(names) + "\n")
    print(f"  {len(names)} names (histograms with _bucket, _sum, _count) from {page}")


KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
            "group_left", "group_right", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside strings, label matchers,
    ranges and grouping clauses that are not functions, aggregations or keywords."""
    e = re.sub(r"\$\{?\w+\}?", "x", expr)                      # Grafana variables
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', e)  # strings
    e = re.sub(r"\{[^{}]*\}", "", e)                            # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                            # ranges, subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"(?<![\w.])[0-9][0-9.]*(?:[eE][+-]?[0-9]+)?(?:ms|s|m|h|d|w|y)?\b", " ", e)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if word.lower() in KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def queries() -> list[tuple[str, str]]:
    out = []
    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"dashboard panel {p.get('title')!r}", t["expr"]))
            walk(p.get("panels", []))
    dash = json.load(open(DASHBOARD))
    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.match(r"label_values\((.*),\s*\w+\)$", q or "")
        if m:
            out.append((f"dashboard variable {v['name']}", m.group(1)))
    for g in yaml.safe_load(open(RULES))["groups"]:
        for r in g["rules"]:
            out.append((f"rule {r.get('alert') or r.get('record')}", r["expr"]))
    return out


def cmd_metrics(metrics_file: str) -> None:
    exported = {l.strip() for l in open(metrics_file) if l.strip() and not l.startswith("#")}
    used: dict[str, list[str]] = {}
    for where, expr in queries():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    unknown = {n: w for n, w in used.items() if n not in exported}
    if unknown:
        for n, w in sorted(unknown.items()):
            print(f"    {n}: used by {', '.join(sorted(set(w)))}")
        fail(f"{len(unknown)} metric name(s) the daemon does not export ({metrics_file})")
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    unused = sorted({re.sub(r"_(bucket|sum|count)$", "", n) for n in exported} - base)
    print(f"  {len(used)} metric names in {len(queries())} queries, all exported"
          f"{'; not shown anywhere: ' + ', '.join(unused) if unused else ''}")


def cmd_chart_rules(out: str) -> None:
    """The PrometheusRule the chart renders with default values holds exactly the rules file's
    rules; written to OUT with the rules' unit tests, for promtool test rules."""
    files = render(CHART, {"prometheusRule": {"enabled": True}})
    docs = [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    plain = yaml.safe_load(open(RULES))
    if rule["spec"] != plain:
        fail("with default values the chart's PrometheusRule differs from deploy/prometheus/zdelay-rules.yaml: "
             "are prometheusRule.rules' defaults in values.yaml the numbers in the file?\n"
             + yaml.safe_dump(rule["spec"]))
    if any("runbook_url" in r.get("annotations", {}) for g in rule["spec"]["groups"] for r in g["rules"]):
        fail("runbook_url rendered though prometheusRule.runbookBaseUrl is empty")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "zdelay-rules.yaml"), "w") as f:
        yaml.safe_dump(rule["spec"], f)
    shutil.copy(os.path.join(os.path.dirname(PLAIN_RULES), "zdelay-rules.test.yaml"), out)
    n = sum(len(g["rules"]) for g in plain["groups"])
    print(f"  the chart's PrometheusRule with default values = deploy/prometheus/zdelay-rules.yaml ({n} alerts)")


def cmd_dashboard_rules(out: str) -> None:
    rules = []
    for i, (where, expr) in enumerate(queries()):
        if not where.startswith("dashboard"):
            continue
        e = expr.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$job", ".*")
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    with open(out, "w") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}, f)
    print(f"  {len(rules)} dashboard queries written as recording rules to {os.path.basename(out)}")


# ---------------------------------------------------------------- configs with the binary

PLACEHOLDER = "placeholder-secret-4711"


def pod_env(docs: list[dict], cfg: dict) -> dict[str, str]:
    """The zdelay container's environment as the pod would have it, with a stand-in value of
    the right shape for each Secret reference."""
    sinks = cfg.get("sinks", {})
    env = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["name"] != "zdelay":
                continue
            for e in c.get("env", []):
                name = e["name"]
                if "value" in e:
                    env[name] = str(e["value"])
                    continue
                if "fieldRef" in e.get("valueFrom", {}):
                    # The downward API: metadata.name, a pod name.
                    env[name] = "zdelay-7d9f8c6b5-x2q4w"
                    continue
                m = re.match(r"ZDELAY_SINKS__(.+)__URL$", name)
                kind = sinks.get(m.group(1).lower(), {}).get("kind") if m else None
                if name == "ZDELAY_REDIS__URL":
                    scheme = "rediss" if "tls" in cfg.get("redis", {}) else "redis"
                    env[name] = f"{scheme}://zdelay:{PLACEHOLDER}@redis.example:6379"
                elif kind == "amqp":
                    env[name] = f"amqp://zdelay:{PLACEHOLDER}@rabbit.example:5672/%2f"
                elif kind == "nats":
                    env[name] = f"nats://zdelay:{PLACEHOLDER}@nats.example:4222"
                elif kind == "redis":
                    env[name] = f"redis://:{PLACEHOLDER}@redis2.example:6379"
                else:
                    env[name] = PLACEHOLDER
    return env


# A user's zdelay.toml for existingConfigMap, whose [admin] and [redis.tls] contradict what the
# chart passes as env: check-config must show the env's values (env wins over the file).
STAND_IN = """# stands in for the user's ConfigMap (existingConfigMap)
[redis]
url = "rediss://redis.example:6379"
[redis.tls]
ca_file = "/elsewhere/ca.pem"
[admin]
listen = "0.0.0.0:1"
metrics_listen = "0.0.0.0:2"
console = true
public_reads = true
allowed_hosts = ["from-the-file.example"]
"""


def env_value(raw: str):
    """An env value as the daemon reads it: JSON-looking (true, 5, ["a"]) or a plain string."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def cmd_configs(out: str, zdelay: str) -> None:
    cases = [os.path.basename(d) for d in sorted(glob.glob(os.path.join(out, "*"))) if os.path.isdir(d)]
    for case in cases:
        docs = load_case(out, case)
        configs = [(d["data"]["zdelay.toml"], "rendered config") for d in docs
                   if d["kind"] == "ConfigMap" and "zdelay.toml" in d.get("data", {})]
        rendered_names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
        external = [v["configMap"]["name"] for d in docs if d["kind"] == "Deployment"
                    for v in d["spec"]["template"]["spec"].get("volumes", [])
                    if v["name"] == "zdelay-config" and v["configMap"]["name"] not in rendered_names]
        if external:
            configs.append((STAND_IN, f"stand-in for ConfigMap {external[0]} (env over its [admin], [redis.tls])"))
        for text, origin in configs:
            path = os.path.join(out, f"{case}.zdelay.toml")
            with open(path, "w") as f:
                f.write(text)
            cfg = tomllib.loads(text)
            env = {**pod_env(docs, cfg), "PATH": "/usr/bin:/bin", "ZDELAY_CONFIG": path}
            res = subprocess.run([zdelay, "check-config", "-o", "json"], capture_output=True, text=True, env=env)
            secrets = sorted(k for k, v in env.items() if PLACEHOLDER in v)
            if res.returncode != 0:
                fail(f"{case}: zdelay check-config refuses the {origin} with the pod's env "
                     f"{sorted(env)}:\n{res.stderr}\n{text}")
            shown = json.loads(res.stdout)
            if text == STAND_IN:
                # The user's file cannot be trusted with what the probes and Services rely on.
                need = ["ZDELAY_ADMIN__LISTEN", "ZDELAY_ADMIN__METRICS_LISTEN", "ZDELAY_ADMIN__CONSOLE",
                        "ZDELAY_ADMIN__PUBLIC_READS"]
                if any(v["name"] == "zdelay-redis-tls" for d in docs if d["kind"] == "Deployment"
                       for v in d["spec"]["template"]["spec"].get("volumes", [])):
                    need.append("ZDELAY_REDIS__TLS__CA_FILE")
                missing = [v for v in need if v not in env]
                if missing:
                    fail(f"{case}: with existingConfigMap the pod must set {missing}: the file's values would hold")
            # Every setting the pod passes for [admin] and [redis.tls] is what the daemon uses.
            for var, raw in sorted(env.items()):
                m = re.fullmatch(r"ZDELAY_(ADMIN|REDIS__TLS)__([A-Z_]+)", var)
                if not m or var in ("ZDELAY_ADMIN__TOKEN", "ZDELAY_ADMIN__PRODUCER_TOKEN"):
                    continue
                section = shown["admin"] if m.group(1) == "ADMIN" else shown["redis"].get("tls") or {}
                field = m.group(2).lower()
                if section.get(field) != env_value(raw):
                    fail(f"{case}: check-config shows {m.group(1).lower().replace('__', '.')}.{field} = "
                         f"{section.get(field)!r}, the pod sets {var}={raw}")
            if PLACEHOLDER in res.stdout + res.stderr:
                fail(f"{case}: check-config prints a secret given in {', '.join(secrets)}")
            print(f"  {case}: check-config accepts the {origin} config with the pod's env "
                  f"(secrets {secrets or 'none'}, not printed)")


# ---------------------------------------------------------------- a Helm 3 CLI

def cmd_helm3(out: str, helm_cli: str) -> None:
    """The real `helm template` of a Helm 3 built with Go < 1.18 (where a template's `and`
    and `or` evaluate every argument) renders every case exactly as the engine used above, and
    refuses a Kubernetes older than Chart.yaml's kubeVersion."""
    version = subprocess.run([helm_cli, "version", "--short"], capture_output=True, text=True).stdout.strip()
    kube = min_kube(CHART)
    for name, values in [("default", {})] + ci_values():
        args = [helm_cli, "template", RELEASE, CHART, "--namespace", NAMESPACE, "--kube-version", kube]
        if name != "default":
            args += ["-f", os.path.join(CHART, "ci", f"{name}-values.yaml")]
        res = subprocess.run(args, capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"helm {version} template ({name}): {res.stderr.strip()}")
        theirs = sorted(yaml.safe_dump(d) for d in yaml.safe_load_all(res.stdout) if d)
        ours = sorted(yaml.safe_dump(d) for d in load_case(out, name))
        if theirs != ours:
            fail(f"helm {version} renders {name} differently from the engine the other checks use")
    print(f"  helm {version} template renders every case as the other checks saw it (Kubernetes {kube})")
    major, minor, patch = (int(x) for x in kube.split("."))
    older = f"{major}.{minor - 1}.0"
    res = subprocess.run([helm_cli, "template", RELEASE, CHART, "--kube-version", older], capture_output=True, text=True)
    if res.returncode == 0 or "kubeVersion" not in res.stderr:
        fail(f"helm {version} template --kube-version {older} must refuse the chart (kubeVersion >={kube}): "
             f"exit {res.returncode} {res.stderr.strip()}")
    print(f"  and refuses Kubernetes {older}: {res.stderr.strip().splitlines()[0]}")


# ---------------------------------------------------------------- helm test, run for real

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(port: int, tmp: str, log) -> subprocess.Popen:
    """A throwaway redis-server on 127.0.0.1:`port`, no persistence, its files under `tmp`."""
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], env={"PATH": "/usr/bin:/bin"},
                            stdout=log, stderr=subprocess.STDOUT)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as res:
            return res.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(what: str, cond, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            fail(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.1)


def cmd_helm_test(out: str, zdelay: str, busybox: str) -> None:
    """The `helm test` Pod's script, as rendered, run by busybox's sh, wget, grep, nc, sleep and
    timeout (the default test.image's tools, and nothing else on PATH) against a real zdelay and Redis on loopback: it passes while
    zdelay is ready, fails (showing the reason /readyz gives) while Redis is down, and fails
    when nothing answers."""
    docs = load_case(out, "default")
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    (c,) = pod["spec"]["containers"]
    if c.get("command") != ["sh", "-c"] or len(c.get("args", [])) != 1:
        fail(f"the test Pod must run sh -c SCRIPT, runs {c.get('command')} {c.get('args')}")
    script = c["args"][0]
    pod_env = {e["name"]: e["value"] for e in c["env"]}
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "zdelay.toml" in d.get("data", {})]
    tmp = tempfile.mkdtemp(prefix="helm-test-", dir=out)
    tools = os.path.join(tmp, "bin")
    os.makedirs(tools)
    for applet in ("sh", "wget", "grep", "nc", "sleep", "timeout"):
        os.symlink(busybox, os.path.join(tools, applet))
    config = os.path.join(tmp, "zdelay.toml")
    with open(config, "w") as f:
        f.write(cm["data"]["zdelay.toml"])
    redis_port, metrics_port, console_port = free_port(), free_port(), free_port()
    procs = []

    def start(args: list[str], env: dict, log: str) -> subprocess.Popen:
        p = subprocess.Popen(args, env=env, stdout=open(os.path.join(tmp, log), "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def run_script(tries: int) -> subprocess.CompletedProcess:
        env = {**pod_env, "PATH": tools, "HOST": "127.0.0.1", "PORT": str(metrics_port), "TRIES": str(tries)}
        return subprocess.run([os.path.join(tools, "sh"), "-c", script], env=env, capture_output=True,
                              text=True, timeout=120)

    try:
        redis = start_redis(redis_port, tmp, open(os.path.join(tmp, "redis.log"), "w"))
        procs.append(redis)

        def redis_up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", redis_port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(16).startswith(b"+PONG")
            except OSError:
                return False
        wait_for("redis-server", redis_up, 10)
        daemon = start([zdelay, "run"], {
            "PATH": "/usr/bin:/bin", "ZDELAY_CONFIG": config,
            "ZDELAY_REDIS__URL": f"redis://127.0.0.1:{redis_port}",
            "ZDELAY_ADMIN__LISTEN": f"127.0.0.1:{console_port}",
            "ZDELAY_ADMIN__METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
            "ZDELAY_POLLER__INSTANCE_ID": "helm-test-check", "ZDELAY_LOG": "warn"}, "zdelay.log")
        ready = f"http://127.0.0.1:{metrics_port}{pod_env['READY_PATH']}"
        # The script waits for readiness itself: start it at once, as helm test right after an install.
        res = run_script(30)
        if res.returncode != 0 or res.stdout.count("ok: GET") != 2:
            fail(f"the test script failed against a ready zdelay (exit {res.returncode}):\n{res.stdout}{res.stderr}"
                 f"\nzdelay log:\n{open(os.path.join(tmp, 'zdelay.log')).read()[-2000:]}")
        print("  against a ready zdelay it passes:\n    " + res.stdout.strip().replace("\n", "\n    "))
        redis.terminate()
        redis.wait(10)
        wait_for(f"{ready} to answer 503 with Redis down", lambda: http_status(ready) == 503, 60)
        res = run_script(1)
        if res.returncode == 0 or "FAIL" not in res.stdout or "not ready" not in res.stdout:
            fail(f"with Redis down the test script must fail and show /readyz's reason (exit {res.returncode}):\n"
                 f"{res.stdout}{res.stderr}")
        why = [l for l in res.stdout.splitlines() if "not ready" in l]
        print(f"  with Redis down it fails, showing /readyz's reason: {why[0].strip()[:120]}")
        daemon.terminate()
        daemon.wait(30)
        res = run_script(1)
        if res.returncode == 0 or "FAIL" not in res.stdout:
            fail(f"with nothing listening the test script must fail (exit {res.returncode}):\n{res.stdout}{res.stderr}")
        print("  with nothing listening it fails")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- chart README

README = os.path.join(CHART, "README.md")
BEGIN = "<!-- BEGIN values: generated from values.yaml by `bash scripts/deploy-check.sh chart-readme`; do not edit -->"
END = "<!-- END values -->"
KEY_LINE = re.compile(r"^ *(?P<key>[A-Za-z0-9_.-]+|\"[^\"]+\"):(?P<rest>\s.*|)$")


def split_comment(rest: str) -> tuple[str, str | None]:
    """A value and its trailing comment: the first # after a blank outside quotes."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), None


class ValueDoc:
    def __init__(self, path: list[str], line: int, comment: list[str]):
        self.path = path
        self.line = line
        self.comment = comment


def values_docs(text: str) -> list[ValueDoc]:
    """Every key of values.yaml outside lists, with its comment: the comment lines right above
    it (no blank line between) and the comment after it on its line."""
    docs: list[ValueDoc] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    skip_below: int | None = None  # inside a list value: its items are the value, not keys
    lines = text.splitlines()
    for n, raw in enumerate(lines, 1):
        line = raw.rstrip()
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if skip_below is not None and (not stripped or indent > skip_below or
                                       (indent == skip_below and stripped.startswith("- "))):
            continue
        skip_below = None
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped[1:].strip())
            continue
        m = KEY_LINE.match(line)
        if not m:
            fail(f"values.yaml:{n}: cannot read {line!r} (a key: value line, a comment or a list item)")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = m.group("key").strip('"')
        value, trailing = split_comment(m.group("rest"))
        path = [k for _, k in stack] + [key]
        block = [" ".join(pending)] if pending else []
        docs.append(ValueDoc(path, n, block + ([trailing] if trailing else [])))
        pending = []
        stack.append((indent, key))
        if not value:
            # A block value: a map (its keys follow, deeper) or a list (its items follow).
            following = [l for l in lines[n:] if l.strip() and not l.strip().startswith("#")]
            if following and following[0].lstrip().startswith("- "):
                skip_below = indent
    return docs


def schema_at(schema: dict, path: list[str]) -> dict:
    node = schema
    for key in path:
        node = (node.get("properties") or {}).get(key) or {}
    return node


def md_text(text: str) -> str:
    """A table cell: pipes escaped, <placeholders> kept visible outside code spans, the book's
    pages linked (relative to charts/zdelay/)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        p = parts[i].replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = re.sub(r"(?<![\[/\w])(docs/[a-z0-9_/-]+\.md)", r"[\1](../../\1)", p)
    return "`".join(parts)


def type_of(value, schema: dict) -> str:
    t = schema.get("type")
    if isinstance(t, list):
        return " or ".join(t)
    if t:
        return "map" if t == "object" else "list" if t == "array" else t
    if "enum" in schema:
        return "string"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "map", type(None): "null"}[type(value)]


def values_table() -> str:
    text = open(os.path.join(CHART, "values.yaml")).read()
    values = yaml.safe_load(text)
    schema = json.load(open(os.path.join(CHART, "values.schema.json")))
    docs = values_docs(text)
    documented_below = {tuple(d.path[:i]) for d in docs if d.comment for i in range(1, len(d.path))}
    rows, undocumented = [], []
    for d in docs:
        if len(d.path) > 1 and tuple(d.path[:-1]) not in documented_below:
            continue  # part of a parent shown whole
        value = values
        for k in d.path:
            value = value[k]
        whole = not (isinstance(value, dict) and value and tuple(d.path) in documented_below)
        if not d.comment:
            if whole:
                undocumented.append(f"values.yaml:{d.line} {'.'.join(d.path)}")
            continue
        sch = schema_at(schema, d.path)
        default = f"`{json.dumps(value, ensure_ascii=False)}`" if whole else "see below"
        desc = ""
        for part in d.comment:
            desc += (" " if not desc or desc[-1] in ".:;!?" else ". ") + part if desc else part
        if "enum" in sch:
            desc += ("" if desc[-1] in ".:;!?" else ".") + " One of: " + ", ".join(f"`{v}`" for v in sch["enum"]) + "."
        rows.append(f"| `{'.'.join(d.path)}` | {type_of(value, sch)} | {md_text(default)} | {md_text(desc)} |")
    if undocumented:
        fail("values without a comment (write one above the key or after its value):\n    "
             + "\n    ".join(undocumented))
    return "\n".join(["| Key | Type | Default | Description |", "| --- | --- | --- | --- |", *rows])


def cmd_chart_readme(*flags: str) -> None:
    current = open(README).read() if os.path.exists(README) else ""
    if BEGIN not in current or END not in current:
        fail(f"{os.path.relpath(README, ROOT)} must hold the lines {BEGIN!r} and {END!r} around the values table")
    head, rest = current.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    wanted = f"{head}{BEGIN}\n{values_table()}\n{END}{tail}"
    if flags == ("--write",):
        with open(README, "w") as f:
            f.write(wanted)
        print(f"  wrote {os.path.relpath(README, ROOT)}")
        return
    if wanted != current:
        import difflib
        diff = difflib.unified_diff(current.splitlines(), wanted.splitlines(), "committed", "generated", lineterm="", n=0)
        print("\n".join(list(diff)[:40]))
        fail(f"{os.path.relpath(README, ROOT)}'s values table is not the one values.yaml gives: "
             "regenerate it with `bash scripts/deploy-check.sh chart-readme`")
    print(f"  {os.path.relpath(README, ROOT)}: the values table matches values.yaml ({values_table().count(chr(10)) - 1} values)")


def cmd_enqueue(out: str, zdelay: str) -> None:
    """The enqueue case's pod, as rendered (its config and env, with a stand-in token), on a
    real Redis on loopback: a producer calling the enqueue Service by its cluster name with
    the token gets its job enqueued; a foreign host name and a missing token are refused; the
    console is off."""
    docs = load_case(out, "enqueue")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "zdelay.toml" in d.get("data", {})]
    text = cm["data"]["zdelay.toml"]
    tmp = tempfile.mkdtemp(prefix="enqueue-", dir=out)
    config = os.path.join(tmp, "zdelay.toml")
    with open(config, "w") as f:
        f.write(text)
    redis_port, metrics_port, admin_port = free_port(), free_port(), free_port()
    env = {**pod_env(docs, tomllib.loads(text)), "PATH": "/usr/bin:/bin", "ZDELAY_CONFIG": config,
           "ZDELAY_REDIS__URL": f"redis://127.0.0.1:{redis_port}", "ZDELAY_LOG": "warn",
           # Loopback here, where the pod binds 0.0.0.0.
           "ZDELAY_ADMIN__LISTEN": f"127.0.0.1:{admin_port}",
           "ZDELAY_ADMIN__METRICS_LISTEN": f"127.0.0.1:{metrics_port}"}
    token = env["ZDELAY_ADMIN__PRODUCER_TOKEN"]
    procs = []
    try:
        procs.append(start_redis(redis_port, tmp, subprocess.DEVNULL))
        log = open(os.path.join(tmp, "zdelay.log"), "w")
        procs.append(subprocess.Popen([zdelay, "run"], env=env, stdout=log, stderr=subprocess.STDOUT))
        wait_for("zdelay ready", lambda: http_status(f"http://127.0.0.1:{metrics_port}/readyz") == 200, 30)

        def post(host: str, auth: str | None) -> int:
            req = urllib.request.Request(f"http://127.0.0.1:{admin_port}/api/jobs", method="POST",
                                         data=b'{"dest":"emails","payload":"hello","in":"1h"}',
                                         headers={"Host": host, "Content-Type": "application/json"})
            if auth:
                req.add_header("Authorization", f"Bearer {auth}")
            try:
                with urllib.request.urlopen(req, timeout=5) as res:
                    return res.status
            except urllib.error.HTTPError as e:
                return e.code

        svc = f"{RELEASE}-zdelay-enqueue"
        for host in (f"{svc}:9464", f"{svc}.{NAMESPACE}:9464", f"{svc}.{NAMESPACE}.svc.cluster.local:9464"):
            if (status := post(host, token)) != 201:
                fail(f"POST /api/jobs to {host} with the producers' token answered {status}, want 201:\n"
                     + open(os.path.join(tmp, "zdelay.log")).read()[-2000:])
        for host, auth, want in ((f"other.{NAMESPACE}:9464", token, 403), (f"{svc}:9464", None, 403)):
            if (status := post(host, auth)) != want:
                fail(f"POST /api/jobs to {host} {'with' if auth else 'without'} the token answered {status}, want {want}")
        if (status := http_status(f"http://127.0.0.1:{admin_port}/")) != 404:
            fail(f"with admin.console false the console's page answered {status}, want 404")
        print(f"  by its Service's names ({svc}, .{NAMESPACE}, .svc.cluster.local) with the token: 201;"
              " another host or no token: 403; no console (404)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    cmd, *args = sys.argv[1:]
    try:
        {
            "lint": lambda: cmd_lint(*args),
            "render": lambda: cmd_render(*args),
            "assert": lambda: cmd_assert(*args),
            "kubeval": lambda: cmd_kubeval(*args),
            "schema": lambda: cmd_schema(*args),
            "metrics-list": lambda: cmd_metrics_list(*args),
            "metrics": lambda: cmd_metrics(*args),
            "dashboard-rules": lambda: cmd_dashboard_rules(*args),
            "chart-rules": lambda: cmd_chart_rules(*args),
            "chart-readme": lambda: cmd_chart_readme(*args),
            "helm-test": lambda: cmd_helm_test(*args),
            "enqueue": lambda: cmd_enqueue(*args),
            "helm3": lambda: cmd_helm3(*args),
            "configs": lambda: cmd_configs(*args),
        }[cmd]()
    except CheckError as e:
        print(f"  FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
