"""The checks behind scripts/deploy-check.sh, one subcommand each (run with the deploy venv's
python: helm-python-sdk, PyYAML). Every check prints what it looked at and exits non-zero
with the reason on the first mismatch.

  checks.py lint WORK                     helm lint --strict: chart (defaults and every ci/*-values.yaml) and example
  checks.py render OUT WORK               renders every ci/*-values.yaml and the example chart into OUT/<case>/
  checks.py assert OUT                    what the rendered manifests must say (security, probes, PDB, TOML, sidecar, rules)
  checks.py kubeval OUT KV                kubernetes-validate --strict -k 1.30.0 on OUT, plus a broken manifest it must refuse
  checks.py schema                        bad values the chart must refuse (schema and template checks)
  checks.py metrics-list PAGE OUT         the exported metric names from the metrics reference page's table
  checks.py metrics METRICS               every metric the dashboard and the rules query is in METRICS
  checks.py dashboard-rules OUT           the dashboard's queries as a rules file, for promtool check rules
  checks.py configs OUT ZDELAY            zdelay check-config on every rendered zdelay.toml
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(ROOT, "charts", "zdelay")
EXAMPLE = os.path.join(ROOT, "charts", "examples", "app-with-zdelay")
DASHBOARD = os.path.join(CHART, "dashboards", "zdelay.json")
RULES = os.path.join(CHART, "files", "zdelay-rules.yaml")
PLAIN_RULES = os.path.join(ROOT, "deploy", "prometheus", "zdelay-rules.yaml")
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
    report = helm().lint(path, values, strict=True, kube_version=f"v{KUBE_VERSION}",
                         namespace=NAMESPACE, with_subcharts=True)
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    if report.get("errors") or bad:
        for m in bad:
            print(f"    {m.get('path')}: {m.get('error')}")
        for e in report.get("errors") or []:
            print(f"    {e}")
        fail(f"helm lint --strict {what}: {len(bad)} findings, {len(report.get('errors') or [])} errors")
    print(f"  lint ok: {what}")


def cmd_lint(work: str) -> None:
    lint_report(CHART, None, "charts/zdelay (default values)")
    for name, values in ci_values():
        lint_report(CHART, values, f"charts/zdelay with ci/{name}-values.yaml")
    example = example_copy(work)
    for name, values in example_cases():
        lint_report(example, values, f"charts/examples/app-with-zdelay ({name})")


# ---------------------------------------------------------------- render

def render(chart_dir: str, values: dict) -> dict[str, str]:
    with helm().Chart.load(chart_dir) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


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
    # The console on loopback unless exposed; probes and metrics on a port of their own.
    exposed = (admin or {}).get("exposeConsole", False)
    listen = ("0.0.0.0" if exposed else "127.0.0.1") + ":9464"
    if env.get("ZDELAY_ADMIN__LISTEN", {}).get("value") != listen:
        fail(f"{case}: ZDELAY_ADMIN__LISTEN must be {listen}")
    if env.get("ZDELAY_ADMIN__METRICS_LISTEN", {}).get("value") != "0.0.0.0:9465":
        fail(f"{case}: ZDELAY_ADMIN__METRICS_LISTEN must be 0.0.0.0:9465")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    metrics = "zdelay-metrics" if sidecar else "metrics"
    if ports.get(metrics) != 9465:
        fail(f"{case}: container port {metrics} must be 9465, ports are {ports}")
    if (9464 in ports.values()) != exposed:
        fail(f"{case}: the console's port 9464 is a container port iff admin.exposeConsole: {ports}")
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


def cmd_assert(out: str) -> None:
    rules_text = open(RULES).read()
    if os.path.realpath(PLAIN_RULES) != os.path.realpath(RULES):
        fail("deploy/prometheus/zdelay-rules.yaml must be the chart's files/zdelay-rules.yaml (a link to it)")
    rules = yaml.safe_load(rules_text)
    dashboard = json.load(open(DASHBOARD))
    fullname = f"{RELEASE}-zdelay"
    for name, values in [("default", {})] + ci_values():
        docs = load_case(out, name)
        mode = values.get("mode", "standalone")
        replicas = values.get("replicas", 1)
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
            if len(prs) != 1 or prs[0]["spec"] != rules:
                fail(f"{name}: PrometheusRule spec must equal files/zdelay-rules.yaml")
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
        exposed = values.get("admin", {}).get("exposeConsole", False)
        consoles = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"{fullname}-console"]
        if bool(consoles) != exposed or (consoles and consoles[0]["spec"]["ports"][0]["port"] != 9464):
            fail(f"{name}: Service {fullname}-console (port 9464) rendered iff admin.exposeConsole")
        admin_cfg = cfg.get("admin", {})
        want_admin = {"console": values.get("admin", {}).get("console", True),
                      "public_reads": values.get("admin", {}).get("publicReads", True)}
        if values.get("admin", {}).get("allowedHosts"):
            want_admin["allowed_hosts"] = values["admin"]["allowedHosts"]
        if admin_cfg != want_admin:
            fail(f"{name}: [admin] is {admin_cfg}, want {want_admin}")
        sms = [d for d in docs if d["kind"] == "ServiceMonitor"]
        if bool(sms) != bool(values.get("serviceMonitor", {}).get("enabled")):
            fail(f"{name}: ServiceMonitor rendered iff serviceMonitor.enabled")
        if sms and [e["port"] for e in sms[0]["spec"]["endpoints"]] != ["metrics"]:
            fail(f"{name}: the ServiceMonitor must scrape the metrics port")
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
        if exposed:
            extra.append("console exposed on 0.0.0.0:9464 with Service -console; metrics Service 9465 alone")
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


def cmd_kubeval(out: str, kv: str) -> None:
    files = sorted(glob.glob(os.path.join(out, "*", "*.yaml")))
    res = subprocess.run([kv, "--strict", "-k", KUBE_VERSION, *files], capture_output=True, text=True)
    lines = (res.stdout + res.stderr).splitlines()
    passed = [l for l in lines if l.startswith("INFO") and " passed " in l]
    unknown = [l for l in lines if "Couldn't find schema" in l]
    bad = [l for l in lines if l.strip() and l not in passed and l not in unknown]
    crd_only = all(re.search(r"kind (ServiceMonitor|PodMonitor|PrometheusRule) with api version monitoring\.coreos\.com/", l)
                   for l in unknown)
    if res.returncode != 0 or bad or not crd_only:
        print("\n".join(bad + [l for l in unknown]))
        fail(f"kubernetes-validate --strict -k {KUBE_VERSION}: exit {res.returncode}")
    print(f"  {len(passed)} resources valid against Kubernetes {KUBE_VERSION} (strict); "
          f"{len(unknown)} Prometheus Operator resources have no schema here (rules checked by promtool)")
    broken = os.path.join(out, "broken.yaml.txt")
    with open(broken, "w") as f:
        f.write(BROKEN)
    res = subprocess.run([kv, "--strict", "-k", KUBE_VERSION, broken], capture_output=True, text=True)
    if res.returncode == 0:
        fail("kubernetes-validate accepted a Deployment with an unknown field: the check proves nothing")
    print("  control: a Deployment with a misspelt field is refused")


# ---------------------------------------------------------------- schema

def expect_refusal(values: dict, what: str, needle: str, chart_dir: str = CHART) -> None:
    try:
        render(chart_dir, values)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        if needle not in msg:
            fail(f"{what}: refused, but the message does not name {needle!r}: {msg}")
        first = " ".join(msg.split())[:150]
        print(f"  refused as it should: {what}: {first}")
        return
    fail(f"{what}: the chart rendered it; it must refuse it")


def cmd_schema() -> None:
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
    expect_refusal({"config": {"poller": {"per_shard": 3}}}, "poller.per_shard above 2", "per_shard")
    expect_refusal({"config": {"sinks": {"orders-eu": {"kind": "nats", "url": "nats://n:4222"}}}},
                   "a sink name that cannot be an environment variable's", "orders-eu")
    expect_refusal({"config": {"redis": {"password": "x"}}}, "a password in the ConfigMap", "password")
    ok = {"image": {"repository": "zdelay"}, "replicas": 2}
    render(CHART, ok)
    print("  control: a correct value set renders")
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


def cmd_configs(out: str, zdelay: str) -> None:
    cases = [os.path.basename(d) for d in sorted(glob.glob(os.path.join(out, "*"))) if os.path.isdir(d)]
    for case in cases:
        docs = load_case(out, case)
        for cm in [d for d in docs if d["kind"] == "ConfigMap" and "zdelay.toml" in d.get("data", {})]:
            text = cm["data"]["zdelay.toml"]
            path = os.path.join(out, f"{case}.zdelay.toml")
            with open(path, "w") as f:
                f.write(text)
            cfg = tomllib.loads(text)
            env = {**pod_env(docs, cfg), "PATH": "/usr/bin:/bin", "ZDELAY_CONFIG": path}
            res = subprocess.run([zdelay, "check-config"], capture_output=True, text=True, env=env)
            secrets = sorted(k for k, v in env.items() if PLACEHOLDER in v)
            if res.returncode == 0:
                shown = json.loads(res.stdout)
                for field, var in [("listen", "ZDELAY_ADMIN__LISTEN"), ("metrics_listen", "ZDELAY_ADMIN__METRICS_LISTEN")]:
                    if var in env and shown["admin"][field] != env[var]:
                        fail(f"{case}: check-config shows admin.{field} {shown['admin'][field]}, the pod sets {env[var]}")
                if PLACEHOLDER in res.stdout + res.stderr:
                    fail(f"{case}: check-config prints a secret given in {', '.join(secrets)}")
                print(f"  {case}: check-config accepts it with the pod's env "
                      f"(secrets {secrets or 'none'}, not printed)")
            else:
                fail(f"{case}: zdelay check-config refuses the rendered config with the pod's env "
                     f"{sorted(env)}:\n{res.stderr}\n{text}")


def main() -> int:
    cmd, *args = sys.argv[1:]
    try:
        {
            "lint": lambda: cmd_lint(*args),
            "render": lambda: cmd_render(*args),
            "assert": lambda: cmd_assert(*args),
            "kubeval": lambda: cmd_kubeval(*args),
            "schema": lambda: cmd_schema(),
            "metrics-list": lambda: cmd_metrics_list(*args),
            "metrics": lambda: cmd_metrics(*args),
            "dashboard-rules": lambda: cmd_dashboard_rules(*args),
            "configs": lambda: cmd_configs(*args),
        }[cmd]()
    except CheckError as e:
        print(f"  FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
