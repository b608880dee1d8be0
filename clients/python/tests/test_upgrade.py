"""A namespace this client cannot use: one on storage layout 1 (created and served by the older
zdelay release), refused until this build's `zdelay upgrade` has moved it to layout 2, and one
that needs a newer client; and finding a job by id in every lane and while its lane moves."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import redis

import zdelay
from zdelay import _core

from .conftest import ROUTES, ZDELAY, Daemon, lane_keys, wait_for

ROOT = Path(__file__).resolve().parents[3]


class HeldUpgrade:
    """This build's `zdelay upgrade --yes`, held right after it fenced every layout-1 shard
    (nothing moved yet) until `release()`."""

    def __init__(self, config: Path) -> None:
        self.gate = config.parent / "upgrade-gate"
        self.proc = subprocess.Popen(
            [ZDELAY, "upgrade", "--yes", "--config", str(config)],
            env={**os.environ, "ZDELAY_FAILPOINT": f"upgrade_after_fence={self.gate}", "ZDELAY_LOG": "warn"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        wait_for("the upgrade fenced layout 1", lambda: self.gate.with_suffix(".reached").exists() or self.proc.poll() is not None)
        assert self.proc.poll() is None, self.proc.stderr.read().decode()

    def release(self) -> None:
        self.gate.write_text("go")

    def finish(self) -> None:
        self.release()
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()


def _stored(r: redis.Redis) -> dict:
    """Every key but the daemons' own bookkeeping, with its value: what a producer's call could
    have written."""
    out = {}
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        if kind == b"hash":
            out[key] = r.hgetall(key)
        elif kind == b"zset":
            out[key] = r.zrange(key, 0, -1, withscores=True)
        elif kind == b"string":
            out[key] = r.get(key)
        elif kind == b"list":
            out[key] = r.lrange(key, 0, -1)
        elif kind == b"set":
            out[key] = r.smembers(key)
    # The daemons' own: the registry and its plan, the sinks' health, their counters and locks.
    bookkeeping = rb"instances|:plan$|\}:sinks$|stats|activity|heartbeat|poller|sched_lock"
    return {k: v for k, v in out.items() if not re.search(bookkeeping, k)}


def _refused_on_layout_1(client: zdelay.Client, r: redis.Redis, upgrading: bool) -> None:
    """Every call of `client` refused naming `zdelay upgrade`, not retryable, nothing written."""
    before = _stored(r)
    calls = [lambda: client.enqueue("emails", "x", id="new", delay=timedelta(hours=1)),
             lambda: client.enqueue("mirror", "x", delay=timedelta(hours=1)),
             lambda: client.get("keep"), lambda: client.cancel("cancel", dest="emails"),
             lambda: client.reschedule("reschedule", delay=timedelta(hours=2)),
             lambda: client.schedule_set("s", "emails", "x", every=timedelta(hours=1))]
    for call in calls:
        with pytest.raises(zdelay.LayoutTooOld) as refused:
            call()
        text = str(refused.value)
        assert isinstance(refused.value, zdelay.ProtocolError) and not refused.value.retryable, text
        assert "storage layout 1" in text and "`zdelay upgrade`" in text and "\n" not in text, text
        assert ("is moving it to layout 2" in text) == upgrading, text
    assert _stored(r) == before, "nothing written"


def test_a_layout_1_namespace_is_refused_until_zdelay_upgrade_moved_it(redis_url, pinned_zdelay, tmp_path):
    # Served by the older release: its daemon on layout 1, with a local route and a two-phase one
    # (to a Redis sink), and its CLI's jobs; its library is protocol 1's only.
    routes = ROUTES + (f'\n[sinks.other]\nkind = "redis"\nurl = "{redis_url}"\n'
                       '\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n')
    old = Daemon(f'url = "{redis_url}"', routes=routes, shards=4, layout=1, binary=pinned_zdelay)
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.hget("zdelay:schema", "layout") == b"1"
        for id in ("keep", "cancel", "reschedule"):
            old.cli("enqueue", "--dest", "emails", "--id", id, "--in", "1h", "--payload", id)
        old.cli("enqueue", "--dest", "mirror", "--id", "far", "--in", "1h", "--payload", "far")
        client = zdelay.Client.from_url(redis_url)
        _refused_on_layout_1(client, r, upgrading=False)

        # This build's upgrade, held after its fence: still layout 1 (upgrading), still refused.
        config = tmp_path / "zdelay.toml"
        config.write_text(old.config.read_text().replace("layout = 1\n", ""))
        upgrade = HeldUpgrade(config)
        try:
            assert r.hget("zdelay:schema", "upgrading") == b"2"
            _refused_on_layout_1(client, r, upgrading=True)
        finally:
            upgrade.finish()
        assert r.hget("zdelay:schema", "layout") == b"2"

        # Moved, with the older daemon still running: only this release's daemons load the
        # library of protocol 2, so the client says that until one runs.
        with pytest.raises(zdelay.ProtocolError, match="library for protocol 2 is not on this server"):
            client.get("keep")
        new = Daemon(f'url = "{redis_url}"', routes=routes, shards=4)
    finally:
        old.stop()
    try:
        assert r.function_list(library="zdelay_p1") and r.function_list(library="zdelay_p2")
        # The jobs of layout 1, found by id where the upgrade moved them (local: the route's lane;
        # two-phase: its spread shard), as the same client (no new object) finds them.
        keep = client.get("keep")
        assert (keep["state"], keep["dest"], keep["payload"]) == ("scheduled", "emails", b"keep")
        assert client.get("far")["dest"] == "mirror"
        assert client.cancel("cancel", dest="emails") == "cancelled" and client.get("cancel") is None
        assert client.reschedule("reschedule", delay=0) is not None
        assert client.enqueue("emails", "now", delay=0).outcome == "added"
        wait_for("delivered by this build", lambda: sorted(r.lrange("q:emails", 0, -1)) == [b"now", b"reschedule"])
    finally:
        new.stop()


def test_the_asyncio_client_refuses_layout_1_too(redis_url, pinned_zdelay):
    old = Daemon(f'url = "{redis_url}"', shards=4, layout=1, binary=pinned_zdelay)
    try:
        old.cli("enqueue", "--dest", "emails", "--id", "keep", "--in", "1h", "--payload", "keep")

        async def run() -> None:
            client = zdelay.AsyncClient.from_url(redis_url)
            for call in (client.get("keep"), client.enqueue("emails", "x", id="new")):
                with pytest.raises(zdelay.LayoutTooOld, match="`zdelay upgrade`"):
                    await call
            await client.aclose()

        asyncio.run(run())
        assert not r_hexists_anywhere(redis.Redis.from_url(redis_url), b"new")
    finally:
        old.stop()


def r_hexists_anywhere(r: redis.Redis, field: bytes) -> bool:
    return any(r.type(k) == b"hash" and r.hexists(k, field) for k in r.scan_iter(count=1000))


def test_an_id_of_your_own_is_looked_for_in_every_lane_and_two_routes_need_dest(redis_url):
    routes = "".join(f'\n[[routes]]\nname = "{r}"\nsink = "local"\ntarget = "q:{r}"\n' for r in ("emails", "sms"))
    daemon = Daemon(f'url = "{redis_url}"', routes=routes, shards=4)
    try:
        client = zdelay.Client.from_url(redis_url)
        client.enqueue("sms", "text", id="one", delay=timedelta(hours=1))
        assert client.get("one")["dest"] == "sms"
        assert client.reschedule("one", delay=timedelta(hours=2)) is not None
        for dest in ("emails", "sms"):
            client.enqueue(dest, dest, id="two", delay=timedelta(hours=1))
        with pytest.raises(zdelay.InvalidJob) as refused:
            client.cancel("two")
        assert refused.value.field == "dest" and "emails, sms" in str(refused.value)
        assert client.cancel("two", dest="sms") == "cancelled" and client.get("two")["dest"] == "emails"
        assert client.cancel("none") == "not_pending" and client.get("none") is None
    finally:
        daemon.stop()


def test_a_namespace_that_needs_a_newer_client_is_refused_with_nothing_written(redis_url):
    # Beside the local route, a two-phase one: its jobs are in spread shards, whose markers a
    # newer storage layout sets to refuse this one's calls.
    routes = ROUTES + (f'\n[sinks.other]\nkind = "redis"\nurl = "{redis_url}"\n'
                       '\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n')
    daemon = Daemon(f'url = "{redis_url}"', routes=routes, shards=4)
    try:
        r = redis.Redis.from_url(redis_url)
        (jobs,) = lane_keys(r, "emails", "jobs")
        r.hset("zdelay:schema", "min_version", "99.0.0")
        client = zdelay.Client.from_url(redis_url)
        with pytest.raises(zdelay.LayoutTooNew) as refused:
            client.enqueue("emails", "x", id="too-old")
        assert "99.0.0" in str(refused.value) and not refused.value.retryable
        assert not r.hexists(jobs, "too-old")
        # This client's own version, or an older one, is fine; so is a pre-release of it.
        for version in (zdelay.VERSION, "0.0.9", "0.1.0-rc.1"):
            r.hset("zdelay:schema", "min_version", version)
            for dest in ("emails", "mirror"):
                done = zdelay.Client.from_url(redis_url).enqueue(dest, "x", id=f"ok-{version}", delay=timedelta(hours=1))
                assert done.outcome == "added"
        r.hset("zdelay:schema", "min_version", "not a version")
        with pytest.raises(zdelay.ProtocolError, match="min_version"):
            zdelay.Client.from_url(redis_url).get("x")
        # A spread shard fenced by a newer zdelay refuses a client that read the namespace before.
        r.hdel("zdelay:schema", "min_version")
        ns = client._namespace()
        assert ns.shards == 4
        for shard in range(ns.shards):
            r.set(ns.shard_keys(shard, "shards")[0], "layout 3 99.0.0")
        with pytest.raises(zdelay.LayoutTooNew, match="99.0.0"):
            client.cancel("ok-0.0.9", dest="mirror")
        assert client.get("ok-0.0.9", dest="emails")["state"] == "scheduled", "a lane is not a spread shard"
    finally:
        daemon.stop()


def test_versions_are_ordered_as_semantic_versions():
    order = ["0.1.0-alpha", "0.1.0-alpha.1", "0.1.0-alpha.beta", "0.1.0-beta.2", "0.1.0-beta.11", "0.1.0-rc.1",
             "0.1.0", "0.1.1", "0.2.0", "1.0.0+build.5"]
    keys = [_core.version_key(v) for v in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert _core.version_key("1.0.0+a") == _core.version_key("1.0.0+b")
    for bad in ("", "1.0", "v1.0.0", "1.0.x", "not a version"):
        assert _core.version_key(bad) is None, bad


def test_the_client_version_is_the_packages():
    pyproject = (ROOT / "clients/python/pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == zdelay.VERSION


def test_lookups_by_id_follow_a_lane_whose_route_moved_to_another_slot(redis_url, tmp_path):
    """A route's list moves to another hash slot: the daemon started with the new config retires
    the old lane and relocates its jobs (held here after its first put, so they are in both
    lanes); a client that read the registry before finds and cancels them by id meanwhile."""
    route = '\n[[routes]]\nname = "emails"\nsink = "local"\ntarget = "{}"\n'
    daemon = Daemon(f'url = "{redis_url}"', routes=route.format("q:emails"), shards=4)
    client = zdelay.Client.from_url(redis_url)
    generated = client.enqueue("emails", "generated", delay=timedelta(hours=1)).id
    client.enqueue("emails", "mine", id="mine", delay=timedelta(hours=1))
    client.enqueue("emails", "gone", id="gone", delay=timedelta(hours=1))
    assert generated.startswith("~")
    daemon.stop()
    gate = tmp_path / "put"
    moving = Daemon(f'url = "{redis_url}"', routes=route.format("q:elsewhere"), shards=4,
                    env={"ZDELAY_FAILPOINT": f"relocate_after_put={gate}"},
                    ready=lambda: gate.with_suffix(".reached").exists())
    try:
        # Still in the old lane (not forgotten there yet): a retryable refusal, never "not found".
        with pytest.raises(zdelay.Fenced) as refused:
            client.get(generated)
        assert refused.value.retryable and "new lane" in str(refused.value)
        threading.Timer(0.3, lambda: gate.write_text("go")).start()
        assert client.get(generated)["payload"] == b"generated"
        assert client.cancel("gone") == "cancelled"
        assert client.get("mine", dest="emails")["state"] == "scheduled"
        assert client.get("gone") is None
    finally:
        gate.write_text("go")
        moving.stop()
