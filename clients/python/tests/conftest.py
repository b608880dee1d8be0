"""Real servers for the client's tests: a private redis-server (or a 3-master cluster) and a
real `zdelay run` of this checkout (ZDELAY_BIN, else target/debug/zdelay)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import pytest
import redis

import zdelay

ROOT = Path(__file__).resolve().parents[3]
ZDELAY = os.environ.get("ZDELAY_BIN", str(ROOT / "target" / "debug" / "zdelay"))
REDIS_SERVER = os.environ.get("ZDELAY_TEST_REDIS_SERVER", "redis-server")
ROUTES = """
[[routes]]
name = "emails"
sink = "local"
target = "q:emails"
"""


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768 and up), where any
    outgoing connection may take a port between this choice and the server's bind."""
    while True:
        port = random.randrange(10000, 32768)
        if _free(port):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both below the ephemeral range."""
    for port in random.sample(range(20000, 30000), 200):
        if _free(port) and _free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_for(what: str, cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_redis(tmp: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_cluster_port() if "--cluster-enabled" in extra else free_port()
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    r = redis.Redis(port=port)
    wait_for("redis-server", lambda: _pings(r))
    return proc, port


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Daemon:
    """`zdelay run` on a config written for the test; stopped by its pid."""

    def __init__(self, redis_toml: str, routes: str = ROUTES, shards: int = 10, layout: Optional[int] = None,
                 env: Optional[dict] = None, ready=None, binary: str = ZDELAY) -> None:
        # env: added to the daemon's environment; ready: what counts as started (default /readyz)
        # routes: TOML of [[routes]] and [sinks.*] after [admin]; layout: None (no setting) is
        # what users get; `layout = 1` only for the older zdelay (`binary`, see pinned_zdelay)
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp())
        admin = free_port()
        self.config = self.dir / "zdelay.toml"
        self.config.write_text(
            f"[redis]\n{redis_toml}\nshards = {shards}\n{'' if layout is None else f'layout = {layout}'}\n\n"
            f"[admin]\nlisten = \"127.0.0.1:{admin}\"\n{routes}"
        )
        self.log = open(self.dir / "daemon.log", "wb")
        self.proc = subprocess.Popen([binary, "run", "--config", str(self.config)], stdout=self.log, stderr=self.log,
                                     env={**os.environ, **(env or {})})
        wait_for("the daemon ready", ready or (lambda: self._ready(admin)), timeout=30)

    def _ready(self, port: int) -> bool:
        assert self.proc.poll() is None, (self.dir / "daemon.log").read_text()
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200
        except OSError:
            return False

    def cli(self, *args: str) -> str:
        out = subprocess.run([self.binary, *args, "--config", str(self.config)], capture_output=True, check=True)
        return out.stdout.decode().strip()

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pinned_zdelay() -> str:
    """The older zdelay release, the last that serves storage layout 1 (what `zdelay upgrade`
    moves from; this build neither creates nor serves it): its binary's path, built once from
    the repository's history by scripts/pinned-zdelay.sh and cached under target/pinned."""
    # Its first build leaves the older binary at target/debug/zdelay too (cargo links a new
    # file there): a second link to this build's keeps it, to put back.
    ours = Path(f"{ZDELAY}.before-pinned")
    ours.unlink(missing_ok=True)
    os.link(ZDELAY, ours)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "pinned-zdelay.sh")], capture_output=True, text=True)
    if os.stat(ZDELAY).st_ino != ours.stat().st_ino:
        os.replace(ours, ZDELAY)
    ours.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def lane_keys(r: redis.Redis, route: str, *kinds: str) -> list[str]:
    """The keys of `route`'s lane (storage layout 2) in namespace zdelay, as the registry names
    it, e.g. `zdelay:{19b}:jobs:emails`."""
    lanes = zdelay.Client(r)._namespace().lanes
    assert route in lanes, f"no lane registered for {route}: {sorted(lanes)}"
    return lanes[route].keys("zdelay", *kinds)


@pytest.fixture
def redis_url(tmp_path):
    proc, port = start_redis(tmp_path)
    yield f"redis://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def daemon(redis_url):
    d = Daemon(f'url = "{redis_url}"')
    yield d
    d.stop()


@pytest.fixture
def cluster(tmp_path):
    """Three masters, no replicas: (seed URL, the processes)."""
    procs, ports = [], []
    for i in range(3):
        node = tmp_path / f"n{i}"
        node.mkdir()
        proc, port = start_redis(node, "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"))
        procs.append(proc)
        ports.append(port)
    subprocess.run(
        ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0", "--cluster-yes"],
        check=True, capture_output=True,
    )
    wait_for("cluster_state:ok", lambda: all(
        b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO") for p in ports))
    yield ports
    for proc in procs:
        stop(proc)
