"""A test namespace's clock ([testing] clock = true): a job enqueued 30 days ahead arrives
moments after the clock is advanced 30 days, from this client; the clock only moves forward,
and a namespace without one refuses to move."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
import redis

import zdelay

from .conftest import ROUTES, Daemon, wait_for

TESTING = '\n[poller]\nidle_poll_max = "60s"\n\n[testing]\nclock = true\n' + ROUTES


@pytest.fixture
def test_clock_daemon(redis_url):
    d = Daemon(f'url = "{redis_url}"', routes=TESTING)
    yield d
    d.stop()


def test_a_job_30_days_ahead_arrives_moments_after_advancing_30_days(test_clock_daemon, redis_url):
    client = zdelay.Client.from_url(redis_url)
    r = redis.Redis.from_url(redis_url)
    before = client.clock()
    assert before["offset_ms"] == 0
    job = client.enqueue("emails", "renewal reminder", id="renewal", delay=timedelta(days=30))
    view = client.get(job.id)
    assert view["state"] == "scheduled"
    assert abs(view["due_ms"] - (before["now_ms"] + 30 * 86_400_000)) < 10_000

    moved = client.advance_clock(timedelta(days=30))
    assert moved["offset_ms"] == 30 * 86_400_000
    assert moved["now_ms"] >= before["now_ms"] + 30 * 86_400_000
    started = time.monotonic()
    wait_for("the job delivered", lambda: r.llen("q:emails") == 1, timeout=3)
    print(f"delivered {time.monotonic() - started:.3f} s after the advance")
    assert r.lrange("q:emails", 0, -1) == [b"renewal reminder"]

    # A delay now counts from the moved clock: a day ahead of it, not of Redis's.
    later = client.enqueue("emails", "tomorrow", delay=timedelta(days=1))
    due = client.get(later.id)["due_ms"]
    assert abs(due - (client.clock()["now_ms"] + 86_400_000)) < 10_000
    assert client.get(later.id)["state"] == "scheduled"
    # Rescheduling "in 2 days" counts from it too.
    new_due = client.reschedule(later.id, delay=timedelta(days=2))
    assert abs(new_due - (client.clock()["now_ms"] + 2 * 86_400_000)) < 10_000


def test_the_asyncio_client_advances_too(test_clock_daemon, redis_url):
    async def run():
        client = zdelay.AsyncClient.from_url(redis_url)
        await client.enqueue("emails", "a", delay=timedelta(hours=2))
        moved = await client.advance_clock(2 * 3_600_000)
        assert moved["offset_ms"] == 2 * 3_600_000
        assert (await client.clock())["offset_ms"] == 2 * 3_600_000

    asyncio.run(run())
    r = redis.Redis.from_url(redis_url)
    wait_for("the job delivered", lambda: r.llen("q:emails") == 1, timeout=3)


def test_a_clock_moves_forward_only_and_only_on_a_test_namespace(daemon, redis_url):
    client = zdelay.Client.from_url(redis_url)
    with pytest.raises(zdelay.NoTestClock):
        client.clock()
    with pytest.raises(zdelay.NoTestClock):
        client.advance_clock(timedelta(days=1))
    r = redis.Redis.from_url(redis_url)
    assert r.hget("zdelay:schema", "clock_ms") is None, "nothing written"
    for bad in (timedelta(days=-1), -5, 0, "1d"):
        with pytest.raises(zdelay.InvalidJob):
            client.advance_clock(bad)
