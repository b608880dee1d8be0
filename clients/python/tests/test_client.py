"""The client against a real Redis and a real `zdelay run`: what it stores is byte for byte what
zdelay's own CLI stores, the daemon delivers it, and bad input is refused by name, unwritten."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis

import zdelay
from zdelay import _core

from .conftest import ZDELAY, Daemon, lane_keys, wait_for

ROOT = Path(__file__).resolve().parents[3]
VECTORS = json.loads((ROOT / "docs/reference/protocol-vectors.json").read_text())
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_keys_shards_slot_tags_and_frames_match_the_vectors():
    assert _core.crc16(b"123456789") == VECTORS["crc16_xmodem_check"]["crc16"]
    for case in VECTORS["shard_rule"]:
        assert _core.shard_of(case["id"], case["shards"]) == case["shard"], case
    for case in VECTORS["slot_tags"]["examples"]:
        assert _core.slot_tag(case["slot"]) == case["tag"]
    for case in VECTORS["lanes"]:
        slot = _core.crc16(_core.hash_tag(case["list"].encode())) % _core.SLOTS
        lane = _core.Lane(1, case["route"], slot, "LPUSH", case["list"])
        assert lane.keys(case["namespace"], "due", "lane") == [case["keys"]["due"], case["keys"]["marker"]]
    kinds = {kind: kind for kind in ("due", "jobs", "inflight", "dead", "reasons", "scheduled", "ready", "ready_ids",
                                     "max_lateness", "unique", "windows")}
    kinds["marker"] = "shards"
    for case in VECTORS["spread_shards"]:
        ns = _core.Namespace(case["namespace"], case["shards"])
        assert ns.shard_keys(case["shard"], *kinds.values()) == [case["keys"][k] for k in kinds], case
    for case in VECTORS["spread_offsets"]:
        assert _core.spread_offset(case["id"], case["window_ms"]) == case["offset_ms"], case
    for case in VECTORS["envelopes"]:
        # Framed as a two-phase route's job (in a spread shard) is.
        ns = _core.Namespace("zdelay", 16, two_phase={case["dest"]: "a-sink"})
        job = zdelay.Job(case["dest"], base64.b64decode(case["payload_base64"]), id="x", headers=case["headers"],
                         max_attempts=case["max_attempts"], max_lateness=case["max_lateness_ms"])
        op = _core.enqueue(ns, [job], "replace", _core._Ids(), None)
        (call,) = next(op)
        assert call[-2] == base64.b64decode(case["frame_base64"]), case["name"]


def test_a_job_is_stored_as_zdelay_stores_it_and_delivered(daemon, redis_url):
    client = zdelay.Client.from_url(redis_url)
    r = redis.Redis.from_url(redis_url)
    at = datetime.now(timezone.utc) + timedelta(hours=1)
    at_ms = -(-int(at.timestamp() * 1_000_000) // 1000)
    daemon.cli("enqueue", "--dest", "emails", "--id", "{u}:cli", "--at", str(at_ms), "--payload", "hi there",
               "--header", "tenant=acme", "--header", f"Traceparent={TRACEPARENT}", "--max-attempts", "3",
               "--max-lateness", "30s")
    done = client.enqueue("emails", "hi there", id="{u}:py", at=at_ms, headers={"tenant": "acme", "Traceparent": TRACEPARENT},
                          max_attempts=3, max_lateness=timedelta(seconds=30))
    assert done == zdelay.Enqueued("{u}:py", "added")
    # Both in the route's lane, ids of your own stored as given: payload, meta, lateness, due alike.
    due, *hashes = lane_keys(r, "emails", "due", "jobs", "meta", "maxlate")
    for key in hashes:
        assert r.hget(key, "{u}:py") == r.hget(key, "{u}:cli") is not None, key
    assert r.zscore(due, "{u}:py") == r.zscore(due, "{u}:cli") == at_ms

    job = client.get("{u}:py")
    assert job["state"] == "scheduled" and job["due_ms"] == at_ms and job["payload"] == b"hi there"
    assert job["headers"] == {"tenant": "acme", "traceparent": TRACEPARENT} and job["max_lateness_ms"] == 30000
    assert client.enqueue("emails", "other", id="{u}:py", on_conflict="keep").outcome == "kept"
    with pytest.raises(zdelay.JobExists):
        client.enqueue("emails", "other", id="{u}:py", on_conflict="error")
    daemon.cli("enqueue", "--dest", "emails", "--id", "s-cli", "--at", str(at_ms), "--payload", "x", "--spread", "10s")
    client.enqueue("emails", "x", id="s-py", at=at_ms, spread=timedelta(seconds=10))
    for spread_id in ("s-cli", "s-py"):
        assert client.get(spread_id)["due_ms"] == at_ms + _core.spread_offset(spread_id, 10_000)
    assert client.reschedule("{u}:py", delay=timedelta(hours=2)) > at_ms
    assert client.cancel("{u}:py") == "cancelled"
    assert client.cancel("{u}:py") == "not_pending" and client.get("{u}:py") is None

    # Many at once, due now by Redis's clock: every one delivered, in due order.
    results = client.enqueue_many([zdelay.Job("emails", f"p{i}", delay=i) for i in range(300)])
    assert all(isinstance(x, zdelay.Enqueued) for x in results)
    wait_for("300 delivered", lambda: r.llen("q:emails") == 300)
    assert sorted(r.lrange("q:emails", 0, -1)) == sorted(f"p{i}".encode() for i in range(300))


def test_unique_windows_and_debounce_answer_as_the_cli_does(daemon, redis_url):
    client = zdelay.Client.from_url(redis_url)
    r = redis.Redis.from_url(redis_url)
    assert client.enqueue("emails", "once", id="u1", unique_for=timedelta(minutes=5)).outcome == "added"
    wait_for("delivered", lambda: b"once" in r.lrange("q:emails", 0, -1))
    # Delivered within its window: a duplicate, whatever the policy, and nothing written.
    window = timedelta(minutes=5)
    assert client.enqueue("emails", "again", id="u1", unique_for=window).outcome == "duplicate"
    assert client.enqueue("emails", "again", id="u1", unique_for=window, on_conflict="error").outcome == "duplicate"
    assert client.get("u1") is None
    assert json.loads(daemon.cli("enqueue", "--dest", "emails", "--id", "u1", "--payload", "x", "--unique-for", "5m",
                                 "-o", "json"))["duplicate"]

    # Debounce: each enqueue pushes the job later, never past its first enqueue plus max_wait.
    debounce = zdelay.Debounce(timedelta(seconds=60))
    before = int(r.time()[0]) * 1000 + int(r.time()[1]) // 1000
    client.enqueue("emails", "v1", id="d1", at=before + 30_000, on_conflict=debounce)
    after = int(r.time()[0]) * 1000 + int(r.time()[1]) // 1000
    assert client.enqueue("emails", "v2", id="d1", at=before + 600_000, on_conflict=debounce).outcome == "replaced"
    job = client.get("d1")
    assert before + 60_000 <= job["due_ms"] <= after + 60_000 and job["payload"] == b"v2"
    daemon.cli("enqueue", "--dest", "emails", "--id", "d1", "--payload", "v3", "--at", str(before + 40_000),
               "--on-conflict", "debounce", "--max-wait", "60s")
    assert client.get("d1")["due_ms"] == before + 40_000
    with pytest.raises(zdelay.InvalidJob) as e:
        client.enqueue("emails", "x", on_conflict="debounce")
    assert e.value.field == "on_conflict"


def test_bad_input_is_refused_by_name_and_writes_nothing(daemon, redis_url):
    client = zdelay.Client.from_url(redis_url, max_payload=100)
    r = redis.Redis.from_url(redis_url)
    before = r.dbsize()
    cases = [
        (dict(headers={"n": 1}), "headers.n"),
        (dict(at=1_700_000_000), "at"),
        (dict(at=datetime(2030, 1, 1)), "at"),
        (dict(at=1, delay=1), "at"),
        (dict(id="~mine"), "id"),
        (dict(max_attempts=0), "max_attempts"),
        (dict(max_lateness=-5), "max_lateness"),
    ]
    for kw, field in cases:
        with pytest.raises(zdelay.InvalidJob) as e:
            client.enqueue("emails", "x", **kw)
        assert e.value.field == field, (kw, e.value)
    with pytest.raises(zdelay.InvalidJob, match="exceeds max_payload 100"):
        client.enqueue("emails", b"x" * 101)
    with pytest.raises(zdelay.InvalidJob, match="dest"):
        client.enqueue("a\nb", "x")
    mixed = client.enqueue_many([zdelay.Job("emails", "ok"), zdelay.Job("emails", "bad", headers={"h": None})])
    assert isinstance(mixed[0], zdelay.Enqueued) and isinstance(mixed[1], zdelay.InvalidJob)
    assert r.dbsize() <= before + 3, "only the good job (its due, jobs and nothing else) was written"


def test_schedules_are_set_paused_resumed_and_deleted_through_a_daemon(daemon, redis_url):
    client = zdelay.Client.from_url(redis_url)
    r = redis.Redis.from_url(redis_url)
    # The same cron schedule set by the CLI and by the client: the daemon plans both alike.
    daemon.cli("schedule", "set", "by-cli", "--dest", "emails", "--cron", "0 9 * * 1-5", "--tz", "Europe/Paris",
               "--payload", "report", "--header", "tenant=acme", "--misfire", "skip", "--max-lateness", "30s",
               "--jitter", "2m")
    state = client.schedule_set("by-py", "emails", "report", cron="0 9 * * 1-5", tz="Europe/Paris",
                                headers={"tenant": "acme"}, misfire="skip", max_lateness=timedelta(seconds=30),
                                jitter=timedelta(minutes=2))
    cli = json.loads(daemon.cli("schedule", "get", "by-cli", "-o", "json"))
    py = json.loads(daemon.cli("schedule", "get", "by-py", "-o", "json"))
    assert state == {"exists": True, "paused": False, "next_ms": cli["next_ms"]}
    for v in (cli, py):
        for k in ("id", "version", "created_ms", "updated_ms"):
            v.pop(k)
    assert py == cli and py["jitter_ms"] == 120_000 and "lane" in py

    # An interval fires through the daemon; pause, resume and delete answer the state after them.
    client.schedule_set("tick", "emails", b"tick", every=timedelta(milliseconds=200))
    wait_for("two occurrences", lambda: r.lrange("q:emails", 0, -1).count(b"tick") >= 2)
    assert client.schedule_pause("tick") == {"exists": True, "paused": True, "next_ms": None}
    assert client.schedule_resume("tick")["next_ms"] is not None
    assert client.schedule_delete("tick") == {"exists": False, "paused": None, "next_ms": None}
    assert client.schedule_pause("tick")["exists"] is False

    # What only the daemon can check comes back as ScheduleRefused naming it; what the client
    # can check is refused before anything is written.
    with pytest.raises(zdelay.ScheduleRefused, match="cron"):
        client.schedule_set("bad", "emails", "x", cron="61 * * * *")
    with pytest.raises(zdelay.ScheduleRefused, match="unknown destination"):
        client.schedule_set("bad", "nowhere", "x", every=1000)
    for kw, field in [(dict(), "cron"), (dict(cron="* * * * *", every=5), "cron"), (dict(every=5, tz="UTC"), "tz"),
                      (dict(every=0), "every"), (dict(every=5, misfire="later"), "misfire"),
                      (dict(every=5, start_at=1_700_000_000), "at"), (dict(every=5, headers={"n": 1}), "headers.n")]:
        with pytest.raises(zdelay.InvalidJob) as e:
            client.schedule_set("bad", "emails", "x", **kw)
        assert e.value.field == field, (kw, e.value)
    assert r.hlen("{zdelay}:sched_requests") == 0


def test_a_schedule_with_a_calendar_is_planned_as_the_cli_plans_it(daemon, redis_url, tmp_path):
    client = zdelay.Client.from_url(redis_url)
    dates = tmp_path / "holidays.txt"
    dates.write_text("2030-12-25\n2031-01-01\n")
    daemon.cli("calendar", "set", "hol", "--dates", str(dates))
    daemon.cli("schedule", "set", "cal-cli", "--dest", "emails", "--cron", "0 9 * * *", "--tz", "Europe/Paris",
               "--payload", "r", "--calendar", "hol", "--shift", "next")
    state = client.schedule_set("cal-py", "emails", "r", cron="0 9 * * *", tz="Europe/Paris", calendar="hol", shift="next")
    cli = json.loads(daemon.cli("schedule", "get", "cal-cli", "-o", "json"))
    py = json.loads(daemon.cli("schedule", "get", "cal-py", "-o", "json"))
    assert state["next_ms"] == cli["next_ms"]
    for v in (cli, py):
        for k in ("id", "version", "created_ms", "updated_ms"):
            v.pop(k)
    assert py == cli and "hol" in json.dumps(py)
    # A calendar that does not exist is the daemon's to refuse; a bad name or shift the client's.
    with pytest.raises(zdelay.ScheduleRefused, match="no calendar named"):
        client.schedule_set("cal-bad", "emails", "r", cron="0 9 * * *", calendar="nope")
    for kw, field in [(dict(calendar="no spaces"), "calendar"), (dict(calendar="hol", shift="later"), "shift"),
                      (dict(shift="next"), "shift")]:
        with pytest.raises(zdelay.InvalidJob) as e:
            client.schedule_set("cal-bad", "emails", "r", cron="0 9 * * *", **kw)
        assert e.value.field == field, (kw, e.value)
    with pytest.raises(zdelay.InvalidJob, match="need cron"):
        client.schedule_set("cal-bad", "emails", "r", every=60_000, calendar="hol", shift="previous")
    assert "cal-bad" not in daemon.cli("schedule", "list")


def test_a_schedule_request_waits_for_a_daemon(redis_url):
    r = redis.Redis.from_url(redis_url)
    daemon = Daemon(f'url = "{redis_url}"')
    daemon.stop()
    client = zdelay.Client.from_url(redis_url)
    with pytest.raises(zdelay.NotApplied) as e:
        client.schedule_set("later", "emails", "x", every=timedelta(hours=1), wait=0.3)
    assert e.value.retryable and r.hexists("{zdelay}:sched_requests", "later")
    daemon = Daemon(f'url = "{redis_url}"')
    try:
        wait_for("the request applied", lambda: not r.hexists("{zdelay}:sched_requests", "later"))
        assert client.schedule_pause("later")["paused"] is True
    finally:
        daemon.stop()


def test_before_any_daemon_the_namespace_is_missing_and_retryable(redis_url):
    with pytest.raises(zdelay.NoNamespace) as e:
        zdelay.Client.from_url(redis_url).enqueue("emails", "x")
    assert e.value.retryable and "does not exist yet" in str(e.value)
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_on_layout_2_a_route_without_a_lane_is_retryable_and_writes_nothing(redis_url, tmp_path):
    daemon = Daemon(f'url = "{redis_url}"', shards=4)
    try:
        r = redis.Redis.from_url(redis_url)
        lanes_before = r.hgetall("zdelay:lanes")
        keys_before = set(r.keys("zdelay:{*"))
        client = zdelay.Client.from_url(redis_url)
        for dest in ("sms", "nowhere"):
            with pytest.raises(zdelay.NoLane) as e:
                client.enqueue(dest, "x")
            assert e.value.retryable and isinstance(e.value, zdelay.UnknownDestination)
            assert f"destination '{dest}' has no route lane yet" in str(e.value)
            assert "a producer given that config" in str(e.value) and "nothing was written" in str(e.value)
        [refused, done] = client.enqueue_many([zdelay.Job("sms", "x"), zdelay.Job("emails", "y", delay=3_600_000)])
        assert isinstance(refused, zdelay.NoLane) and done.outcome == "added"
        assert r.hgetall("zdelay:lanes") == lanes_before
        assert {k for k in set(r.keys("zdelay:{*")) - keys_before if not k.endswith(b":emails")} == set()
        # A producer given a config with the route registers its lane; the same call then goes in.
        config = tmp_path / "sms.toml"
        config.write_text(f'[redis]\nurl = "{redis_url}"\nshards = 4\n\n'
                          '[[routes]]\nname = "sms"\nsink = "local"\ntarget = "q:sms"\n')
        out = subprocess.run([ZDELAY, "enqueue", "--config", str(config), "--dest", "sms", "--in", "1h", "--payload", "z"],
                             capture_output=True)
        assert out.returncode == 0, out.stderr
        assert client.enqueue("sms", "x").outcome == "added"
    finally:
        daemon.stop()


def test_a_server_without_the_library_or_speaking_another_protocol_is_refused_by_name(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.hset("zdelay:schema", mapping={"shards": 4, "layout": 2})
    with pytest.raises(zdelay.ProtocolError, match="function library for protocol 2 is not on this server"):
        zdelay.Client.from_url(redis_url).enqueue("emails", "x")
    # Protocol 1's library, as a release before protocol 2 loads it: not this client's.
    r.function_load((ROOT / "tests/it/fixtures/library_zdelay_p1_de46fba.lua").read_text())
    with pytest.raises(zdelay.ProtocolError, match="function library for protocol 2 is not on this server"):
        zdelay.Client.from_url(redis_url).enqueue("emails", "x")
    newer = "#!lua name=zdelay_p2\nredis.register_function('zd2_protocol', function() return {3, '9.0.0'} end)"
    r.function_load(newer)
    with pytest.raises(zdelay.ProtocolError, match="says 3; this client speaks 2"):
        zdelay.Client.from_url(redis_url).enqueue("emails", "x")
    r.function_load(newer.replace("{3,", "{2,"), replace=True)
    for layout, error, text in [(3, zdelay.LayoutTooNew, "storage layout 3"), (1, zdelay.LayoutTooOld, "`zdelay upgrade`"),
                                ("two", zdelay.ProtocolError, "field layout holds 'two'")]:
        r.hset("zdelay:schema", "layout", layout)
        with pytest.raises(error, match=text) as refused:
            zdelay.Client.from_url(redis_url).enqueue("emails", "x")
        assert not refused.value.retryable
    assert sorted(r.keys()) == [b"zdelay:schema"], "nothing written"


def test_the_asyncio_client_does_the_same(daemon, redis_url):
    async def main():
        client = zdelay.AsyncClient.from_url(redis_url)
        done = await client.enqueue("emails", b"async", id="a-1", delay=timedelta(hours=1))
        assert done.outcome == "added"
        assert (await client.get("a-1"))["state"] == "scheduled"
        assert await client.reschedule("a-1", delay=0) is not None
        results = await client.enqueue_many([zdelay.Job("emails", f"q{i}") for i in range(50)])
        assert len(results) == 50
        state = await client.schedule_set("a-s", "emails", "s", every=timedelta(hours=1))
        assert state["exists"] and not state["paused"]
        assert (await client.schedule_pause("a-s"))["paused"] is True
        assert (await client.schedule_delete("a-s"))["exists"] is False
        await client.aclose()

    asyncio.run(main())
    r = redis.Redis.from_url(redis_url)
    wait_for("51 delivered", lambda: r.llen("q:emails") == 51)


def test_on_a_cluster_on_layout_2_jobs_go_to_their_route_lane(cluster):
    seeds = ", ".join(f'"redis://127.0.0.1:{p}"' for p in cluster)
    daemon = Daemon(f"cluster_nodes = [{seeds}]", shards=4)
    try:
        client = zdelay.Client.from_url(f"redis://127.0.0.1:{cluster[0]}", cluster=True)
        generated = client.enqueue("emails", "later", delay=timedelta(hours=1))
        assert generated.id.startswith("~") and client.get(generated.id)["state"] == "scheduled"
        assert client.get("mine", dest="emails") is None
        client.enqueue("emails", "mine", id="mine", delay=timedelta(hours=1), headers={"k": "v"})
        assert client.get("mine", dest="emails")["headers"] == {"k": "v"}
        # Without its destination, an id of your own is looked for in every lane.
        assert client.get("mine")["dest"] == "emails" and client.get("nobody") is None
        with pytest.raises(zdelay.UnknownDestination):
            client.enqueue("nowhere", "x")
        assert client.cancel(generated.id) == "cancelled"
        client.enqueue("emails", "now", delay=0)
        r = redis.RedisCluster.from_url(f"redis://127.0.0.1:{cluster[0]}")
        wait_for("delivered from the lane", lambda: r.lrange("q:emails", 0, -1) == [b"now"])
        assert client.schedule_set("s", "emails", "tick", every=timedelta(milliseconds=200))["exists"]
        wait_for("an occurrence from the lane", lambda: b"tick" in r.lrange("q:emails", 0, -1))
        assert client.schedule_delete("s")["exists"] is False
    finally:
        daemon.stop()


def _documented_producer_acl() -> list[str]:
    """The producer's ACL rules from the security guide, with `+fcall` for the protocol."""
    guide = (Path(__file__).resolve().parents[3] / "docs/guides/security.md").read_text()
    block = guide.split("ACL SETUSER producer", 1)[1].split("```", 1)[0]
    rules = block.replace("\\\n", " ").split()
    return [r for r in rules if r not in ("+script|load", "+evalsha")] + ["+fcall"]


def test_a_producer_with_the_documented_acl_cancels_and_needs_the_windows_key_for_a_window(daemon, redis_url):
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "producer", "reset", *_documented_producer_acl())
    client = zdelay.Client.from_url(redis_url.replace("redis://", "redis://producer:secret@"))
    client.enqueue("emails", "x", id="acl-1", delay=timedelta(hours=1))
    # A cancel takes the unique key, which the documented ACL grants.
    assert client.cancel("acl-1") == "cancelled"
    assert client.get("acl-1") is None
    # A call that uses a window needs the windows key the guide says to add; nothing is written.
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.enqueue("emails", "x", id="acl-2", delay=timedelta(hours=1), unique_for=timedelta(hours=1))
    assert zdelay.Client.from_url(redis_url).get("acl-2") is None


def test_a_producer_that_may_not_read_the_lane_registry_gets_redis_refusal(daemon, redis_url):
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "no-registry", "on", ">secret", "~*", "&*", "+@all", "-hgetall")
    client = zdelay.Client.from_url(redis_url.replace("redis://", "redis://no-registry:secret@"))
    with pytest.raises(redis.exceptions.NoPermissionError, match="hgetall"):
        client.enqueue("emails", "x", id="refused")
    assert zdelay.Client.from_url(redis_url).get("refused") is None
