"""Finding a job by id while `zdelay reshard` moves a layout-2 namespace's spread shards (a real
reshard of this checkout, held after its fence by a failpoint): a two-phase job still in its old
shard is waited for, never answered "not pending"; enqueues follow the new count at once."""

from __future__ import annotations

import os
import subprocess
import threading
from datetime import timedelta

import pytest

import zdelay

from .conftest import ZDELAY, Daemon, start_redis, stop, wait_for


def test_lookups_by_id_during_a_reshard_find_two_phase_jobs_not_moved_yet(redis_url, tmp_path):
    (tmp_path / "remote").mkdir()
    remote, port = start_redis(tmp_path / "remote")
    routes = (f'\n[sinks.other]\nkind = "redis"\nurl = "redis://127.0.0.1:{port}"\n'
              '\n[[routes]]\nname = "mirror"\nsink = "other"\ntarget = "q:mirror"\n')
    daemon = Daemon(f'url = "{redis_url}"', routes=routes, shards=4)
    gate = daemon.dir / "reshard-gate"
    proc = None
    try:
        client = zdelay.Client.from_url(redis_url)
        for id in ("keep", "cancel", "reschedule"):
            client.enqueue("mirror", id, id=id, delay=timedelta(hours=1))
        proc = subprocess.Popen(
            [ZDELAY, "reshard", "--to", "8", "--yes", "--config", str(daemon.config)],
            env={**os.environ, "ZDELAY_FAILPOINT": f"reshard_after_fence={gate}", "ZDELAY_LOG": "warn"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        wait_for("the reshard fenced the old shards", lambda: gate.with_suffix(".reached").exists() or proc.poll() is not None)
        assert proc.poll() is None, proc.stderr.read().decode()
        # New work goes to the new shards (the client follows the fence on its own).
        assert client.enqueue("mirror", "new", delay=timedelta(hours=1)).outcome == "added"
        assert client._ns.shards == 8 and client._ns.resharding_from == 4
        # Not moved yet and nothing moves: a retryable refusal, never "not pending".
        with pytest.raises(zdelay.Upgrading) as refused:
            client.cancel("cancel", dest="mirror")
        assert refused.value.retryable and "resharded" in str(refused.value)
        # The move goes on while a lookup waits: it finds each job where it was moved.
        threading.Timer(0.3, lambda: gate.write_text("go")).start()
        assert client.cancel("cancel", dest="mirror") == "cancelled"
        assert client.get("keep")["state"] == "scheduled"
        assert client.reschedule("reschedule", delay=timedelta(hours=2)) is not None
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert client.get("cancel", dest="mirror") is None
        assert client.get("keep", dest="mirror")["payload"] == b"keep"
        assert client._ns.resharding_from is None, "the client saw the reshard finish"
    finally:
        gate.write_text("go")
        if proc is not None:
            proc.wait(60)
        daemon.stop()
        stop(remote)
