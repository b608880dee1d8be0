"""Finding a job by id: while `zdelay upgrade` moves a namespace to storage layout 2 (a real upgrade
of this checkout, held after its fence by a failpoint), and in every lane on layout 2; and a
namespace that needs a newer client."""

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

from .conftest import ROUTES, ZDELAY, Daemon, lane_keys, legacy_namespace, wait_for

ROOT = Path(__file__).resolve().parents[3]


class HeldUpgrade:
    """`zdelay upgrade --yes`, held right after it fenced every layout-1 shard (nothing moved
    yet) until `release()`."""

    def __init__(self, daemon: Daemon) -> None:
        self.gate = daemon.dir / "upgrade-gate"
        self.proc = subprocess.Popen(
            [ZDELAY, "upgrade", "--yes", "--config", str(daemon.config)],
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


@pytest.fixture
def held_upgrade(redis_url):
    # A namespace of zdelay 0.1, on layout 1; no redis.layout in the daemon's config: it runs
    # on the namespace's layout and follows it onto layout 2.
    legacy_namespace(f'url = "{redis_url}"', shards=4)
    daemon = Daemon(f'url = "{redis_url}"', shards=4)
    client = zdelay.Client.from_url(redis_url)
    for id in ("keep", "cancel", "reschedule"):
        client.enqueue("emails", id, id=id, delay=timedelta(hours=1))
    upgrade = HeldUpgrade(daemon)
    yield client, upgrade
    upgrade.release()
    upgrade.proc.wait(60)
    daemon.stop()


def test_lookups_by_id_during_an_upgrade_find_jobs_not_moved_yet(held_upgrade):
    client, upgrade = held_upgrade
    # Not moved yet and nothing moves: a retryable refusal, never "not pending".
    with pytest.raises(zdelay.Upgrading) as refused:
        client.cancel("cancel", dest="emails")
    assert refused.value.retryable and "cancel" in str(refused.value)
    assert client._ns.layout == 2 and client._ns.upgrading
    # The upgrade goes on while a lookup waits: it finds each job where it was moved.
    threading.Timer(0.3, upgrade.release).start()
    assert client.cancel("cancel", dest="emails") == "cancelled"
    assert client.get("keep")["state"] == "scheduled"
    assert client.reschedule("reschedule", delay=timedelta(hours=2)) is not None
    upgrade.finish()
    assert client.get("cancel", dest="emails") is None
    assert client.get("keep", dest="emails")["payload"] == b"keep"
    assert not client._ns.upgrading, "the client saw the upgrade finish"


def test_the_asyncio_client_waits_for_the_upgrade_too(held_upgrade, redis_url):
    _, upgrade = held_upgrade

    async def run() -> None:
        client = zdelay.AsyncClient.from_url(redis_url)
        with pytest.raises(zdelay.Upgrading):
            await client.get("keep", dest="emails")
        asyncio.get_running_loop().call_later(0.3, upgrade.release)
        assert await client.cancel("cancel") == "cancelled"
        assert (await client.get("keep"))["dest"] == "emails"
        await client.aclose()

    asyncio.run(run())


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
    # Beside the local route, a two-phase one: its jobs are in spread shards, which a newer
    # storage layout fences as an upgrade to layout 2 fenced layout 1's shards.
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
        assert ns.layout == 2 and ns.shards == 4
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
