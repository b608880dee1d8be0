"""The zdelay producer protocol (docs/reference/protocol.md) without I/O: key names, frames,
ids, checks, and each operation as a generator that yields Redis commands and receives their
replies, so that the sync and the asyncio client share every rule."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Dict, Generator, List, Mapping, NamedTuple, Optional, Tuple, Union

PROTOCOL = 2
# This client's release: a namespace whose schema names a newer `min_version` is refused.
VERSION = "0.1.0"
# Seconds a lookup by id waits for a job being moved (by `zdelay reshard` to its new spread
# shard, or into its route's new lane) to leave where it was.
MOVE_WAIT = 3.0
SLOTS = 16384
Command = Tuple[Any, ...]
Op = Generator[List[Command], List[Any], Any]
Moment = Union[datetime, int]
Span = Union[timedelta, int]


class ZdelayError(Exception):
    """Base of every error this client raises; `retryable`: the same call may succeed later."""

    retryable = False


class NoNamespace(ZdelayError):
    retryable = True


class NoTestClock(ZdelayError):
    """The namespace was created without a test clock: its clock is Redis's."""


class ProtocolError(ZdelayError):
    pass


class Fenced(ZdelayError):
    """The namespace changed under the call (reshard, a lane moved): nothing was written."""

    retryable = True


class Upgrading(Fenced):
    """`zdelay reshard` has not moved the job looked up by id to its new spread shard yet (it
    is moved within moments): nothing was written; try again."""


class LayoutTooNew(ProtocolError):
    """The namespace needs a newer zdelay client (its schema's `min_version`, or a storage layout
    this client does not know): nothing was written, and only a newer client can use it."""


class LayoutTooOld(ProtocolError):
    """The namespace is on storage layout 1 (also while `zdelay upgrade` runs), which this client
    does not use: nothing was written. An operator runs `zdelay upgrade` with the older
    release's daemons and producers still running; then this client can use it."""


class UnknownDestination(ZdelayError):
    pass


class NoLane(UnknownDestination):
    """Storage layout 2: the destination has no route lane yet. A zdelay daemon whose config
    has the route registers it when it starts, and so does a zdelay producer given that config
    (`zdelay enqueue --config`, the Rust library with the config's routes); this client, which
    has no config, cannot. Nothing was written; try again once one has (a destination no config
    names stays refused)."""

    retryable = True


def no_lane(dest: str, ns: "Namespace") -> NoLane:
    known = ", ".join(sorted(ns.lanes) + sorted(ns.two_phase)) or "none"
    return NoLane(f"destination {dest!r} has no route lane yet: on storage layout 2 a daemon whose config has the "
                  "route registers it when it starts, and so does a producer given that config; nothing was "
                  f"written, try again once one has (registered: {known})")


class JobExists(ZdelayError):
    pass


class ScheduleRefused(ZdelayError):
    """A daemon could not apply a schedule request (a bad cron expression or time zone, an
    unknown destination…): the text names why. Nothing of that request was written."""


class NotApplied(ZdelayError):
    """No daemon applied the schedule request in time; it stays and is applied when one runs."""

    retryable = True


class InvalidJob(ZdelayError, ValueError):
    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(f"{field_name}: {why}")
        self.field = field_name


def _crc_table() -> List[int]:
    table = []
    for i in range(256):
        c = i << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x1021) if c & 0x8000 else c << 1
        table.append(c & 0xFFFF)
    return table


_CRC = _crc_table()


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum Redis Cluster hashes keys with."""
    c = 0
    for b in data:
        c = ((c << 8) & 0xFFFF) ^ _CRC[((c >> 8) ^ b) & 0xFF]
    return c


def hash_tag(key: bytes) -> bytes:
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def shard_of(job_id: str, shards: int) -> int:
    """The whole CRC-16 of the id's tag modulo the shard count (not the cluster slot)."""
    return crc16(hash_tag(job_id.encode())) % shards


_TAG_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_tags: Dict[int, str] = {}


def slot_tag(slot: int) -> str:
    """The shortest string over 0-9a-z in slot `slot`, the first in ASCII order among equals."""
    if slot not in _tags:
        # Enumerated from the start each time, so the first tag seen for a slot is its tag.
        for n in range(1, 5):
            for chars in itertools.product(_TAG_ALPHABET, repeat=n):
                tag = "".join(chars)
                at = crc16(tag.encode()) % SLOTS
                _tags.setdefault(at, tag)
                if at == slot:
                    return _tags[slot]
    return _tags[slot]


def base36(n: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = _TAG_ALPHABET[d] + out
        if n == 0:
            return out


@dataclass
class Lane:
    number: int
    route: str
    slot: int
    push: str
    list: str

    def keys(self, ns: str, *kinds: str) -> List[str]:
        tag = slot_tag(self.slot)
        return [f"{ns}:{{{tag}}}:{kind}:{self.route}" for kind in kinds]

    @property
    def marker(self) -> str:
        return f"2 {base36(self.number)} {self.push} {self.list}"


@dataclass
class Namespace:
    name: str
    # The spread shards' count: the two-phase routes' jobs are in spread shard `shard_of(id)`.
    shards: int
    lanes: Dict[str, Lane] = field(default_factory=dict)
    two_phase: Dict[str, str] = field(default_factory=dict)
    # Retired lanes (`#<lane>` -> `<route> <slot> retired`): their route's list moved to another
    # hash slot, and a daemon relocates their jobs into the route's live lane (same stored ids).
    retired: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    # `zdelay reshard` is moving the spread shards from this count to `shards`: two-phase jobs
    # it has not moved yet are still in their old shards.
    resharding_from: Optional[int] = None
    # Created with a test clock (`clock` = `test` in the schema): "now" is Redis's clock plus
    # the schema's `clock_ms`, which every call that reads the time adds.
    test_clock: bool = False

    def shard_keys(self, shard: int, *kinds: str) -> List[str]:
        """Spread shard `shard`'s keys, in the middle slot of its share of the slot range."""
        tag = slot_tag((2 * shard + 1) * SLOTS // (2 * self.shards))
        return [f"{self.name}:{{{tag}}}:s{shard}:{kind}" for kind in kinds]

    def lane_by_number(self, number: int) -> Lane:
        for lane in self.lanes.values():
            if lane.number == number:
                return lane
        # A retired lane's jobs are relocated into its route's live lane.
        route = self.retired.get(number, ("", 0))[0]
        if route in self.lanes:
            return self.lanes[route]
        raise Fenced(f"lane {base36(number)} is not in {self.name}:lanes")


def version_key(text: str) -> Optional[Tuple[Any, ...]]:
    """A semantic version's precedence as a sortable tuple (a pre-release sorts before its
    release; build metadata is ignored), or None for text that is no version."""
    core, _, pre = text.split("+", 1)[0].partition("-")
    parts = core.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    tags = tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in pre.split(".")) if pre else ()
    return (tuple(int(p) for p in parts), 0 if pre else 1, tags)


def too_new(name: Optional[str], layout: int, min_version: Optional[str]) -> LayoutTooNew:
    """`name`: the namespace, when known (a script's fence does not say)."""
    what = f"namespace {name}" if name else "the namespace"
    if min_version:
        return LayoutTooNew(f"{what} needs zdelay {min_version} or later (storage layout {layout}; this is the "
                            f"zdelay Python client {VERSION}): upgrade the client to {min_version} or later")
    return LayoutTooNew(f"{what} is on storage layout {layout}, which this client ({VERSION}) does not know "
                        "(it knows 2): upgrade the client")


def too_old(name: str, upgrading: bool) -> LayoutTooOld:
    if upgrading:
        return LayoutTooOld(f"namespace {name} is on storage layout 1 and `zdelay upgrade` is moving it to layout 2: "
                            f"this client ({VERSION}) uses it once the upgrade has finished; nothing was written")
    return LayoutTooOld(f"namespace {name} is on storage layout 1, which this client ({VERSION}) does not use: nothing "
                        "was written; run `zdelay upgrade` (with the older release's daemons and producers still "
                        "running), then use this client")


def load_namespace(name: str) -> Op:
    fields = ["layout", "shards", "migrating", "upgrading", "min_version", "resharding", "clock"]
    replies = yield [("HGET", f"{name}:schema", f) for f in fields] + [("FCALL", f"zd{PROTOCOL}_protocol", 0)]
    layout, shards, migrating, upgrading, min_version, resharding, clock, protocol = replies
    if shards is None:
        raise NoNamespace(f"namespace {name} does not exist yet: a zdelay daemon creates it when it starts")
    # Before the library: a namespace this client cannot use says what to do about it, where no
    # daemon of this release has loaded the library yet.
    # No layout field: a namespace as zdelay 0.1 created it, on layout 1.
    layout_text = b"1" if layout is None else layout
    if not layout_text.isdigit():
        text = layout_text.decode(errors="replace")
        raise ProtocolError(f"{name}:schema field layout holds {text!r}, not a layout number")
    layout_n = int(layout_text)
    if min_version is not None:
        needed = min_version.decode()
        key = version_key(needed)
        if key is None:
            raise ProtocolError(f"{name}:schema field min_version holds {needed!r}, not a version")
        if key > version_key(VERSION):
            raise too_new(name, layout_n, needed)
    if layout_n == 1:
        raise too_old(name, upgrading is not None)
    if layout_n != 2:
        raise too_new(name, layout_n, None)
    if isinstance(protocol, Exception):
        raise ProtocolError(
            f"the zdelay function library for protocol {PROTOCOL} is not on this server ({protocol}): "
            "a zdelay daemon of a release that speaks it loads it when it starts (Redis 7.0 or later, or Valkey 7.2)"
        )
    if protocol[0] != PROTOCOL:
        raise ProtocolError(f"the server's zd{PROTOCOL}_protocol says {protocol[0]}; this client speaks {PROTOCOL}")
    if migrating is not None:
        raise Fenced(f"namespace {name} is being resharded ({migrating.decode()}): try again")
    ns = Namespace(name, int(shards), resharding_from=int(resharding.split()[0]) if resharding is not None else None,
                   test_clock=clock == b"test")
    (registry,) = yield [("HGETALL", f"{name}:lanes")]
    if isinstance(registry, Exception):
        raise registry  # e.g. NOPERM: Redis's own error, as for any other refused command
    for key, value in _pairs(registry):
        if key.startswith("r:"):
            number, _, slot, push, lst = value.split(" ", 4)
            ns.lanes[key[2:]] = Lane(int(number, 36), key[2:], int(slot), push, lst)
        elif key.startswith("t:"):
            ns.two_phase[key[2:]] = value
        elif key.startswith("#") and value.endswith(" retired"):
            route, slot, _ = value.rsplit(" ", 2)
            ns.retired[int(key[1:], 36)] = (route, int(slot))
    return ns


def clock_offset(ns: Namespace) -> Op:
    """How far the namespace's test clock is ahead of Redis's, ms: 0 without one (no command)."""
    if not ns.test_clock:
        return 0
    (offset,) = yield [("HGET", f"{ns.name}:schema", "clock_ms")]
    if isinstance(offset, Exception):
        raise offset
    return int(offset or 0)


def clock(ns: Namespace) -> Op:
    """The namespace's clock: {"now_ms", "redis_ms", "offset_ms"}. Refused (NoTestClock) on a
    namespace created without a test clock."""
    if not ns.test_clock:
        raise NoTestClock(f"namespace {ns.name} has no test clock: only a namespace created with "
                          "[testing] clock = true has one")
    time_reply, offset = yield [("TIME",), ("HGET", f"{ns.name}:schema", "clock_ms")]
    for reply in (time_reply, offset):
        if isinstance(reply, Exception):
            raise reply
    redis_ms = int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000
    offset_ms = int(offset or 0)
    return {"now_ms": redis_ms + offset_ms, "redis_ms": redis_ms, "offset_ms": offset_ms}


def advance_clock(ns: Namespace, by: Span) -> Op:
    """Moves the test clock forward by `by` (1 ms or more; a negative one is refused) and wakes
    the daemons: what falls due in the time skipped is delivered at once. The offset only
    grows (HINCRBY), so concurrent advances add up. Answers the new clock."""
    ms = _ms(by, "by")
    if ms < 1:
        raise InvalidJob("by", f"a test clock moves forward by 1 ms or more, got {by!r}")
    if not ns.test_clock:
        yield from clock(ns)  # refuses
    (offset,) = yield [("HINCRBY", f"{ns.name}:schema", "clock_ms", ms)]
    if isinstance(offset, Exception):
        raise offset
    (published,) = yield [("PUBLISH", f"{ns.name}:wake", f"clock {offset}")]
    if isinstance(published, Exception):
        raise published
    return (yield from clock(ns))


def _pairs(reply: Any) -> List[Tuple[str, str]]:
    items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    return [(k.decode(), v.decode()) for k, v in items]


class _Ids:
    """ULIDs (a two-phase route's jobs, in the spread shards) and 12-character stored ids (a
    route lane's), increasing within a process."""

    ULID = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    STORED = "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = (0, 0)
        self._stored = (0, 0)
        self._random14 = int.from_bytes(os.urandom(2), "big") & 0x3FFF

    def ulid(self) -> str:
        with self._lock:
            ms = int(time.time() * 1000)
            rnd = int.from_bytes(os.urandom(10), "big")
            if ms <= self._last[0]:
                ms, rnd = self._last[0], self._last[1] + 1
            self._last = (ms, rnd)
        n = (ms << 80) | (rnd & ((1 << 80) - 1))
        return "".join(self.ULID[(n >> (5 * i)) & 31] for i in reversed(range(26)))

    def stored(self) -> str:
        with self._lock:
            ms = int(time.time() * 1000) - 1_704_067_200_000
            counter = self._stored[1] + 1 if ms <= self._stored[0] else 0
            ms = max(ms, self._stored[0])
            if counter > 0xFFFF:
                ms, counter = ms + 1, 0
            self._stored = (ms, counter)
        n = (ms << 30) | (self._random14 << 16) | counter
        return "".join(self.STORED[(n >> (6 * i)) & 63] for i in reversed(range(12)))


class Job(NamedTuple):
    dest: str
    payload: Union[bytes, str]
    at: Optional[Moment] = None
    delay: Optional[Span] = None
    id: Optional[str] = None
    headers: Optional[Mapping[str, str]] = None
    max_attempts: Optional[int] = None
    max_lateness: Optional[Span] = None
    spread: Optional[Span] = None
    unique_for: Optional[Span] = None  # once delivered or dead, its id is a duplicate this long


class Enqueued(NamedTuple):
    id: str
    outcome: str  # "added", "replaced", "kept" or "duplicate"


class Debounce(NamedTuple):
    """on_conflict=Debounce(max_wait): replace, but a waiting job is never made due later
    than its first enqueue plus max_wait."""
    max_wait: Span


def _ms(value: Span, name: str) -> int:
    ms = value // timedelta(milliseconds=1) if isinstance(value, timedelta) else value
    if not isinstance(ms, int) or isinstance(ms, bool) or ms < 0:
        raise InvalidJob(name, f"must be a timedelta or whole milliseconds >= 0, got {value!r}")
    return ms


def due_arg(at: Optional[Moment], delay: Optional[Span]) -> str:
    if at is not None and delay is not None:
        raise InvalidJob("at", "give at or delay, not both")
    if at is None:
        return f"+{_ms(delay or 0, 'delay')}"
    if isinstance(at, datetime):
        if at.tzinfo is None:
            raise InvalidJob("at", "a datetime needs a timezone (for example timezone.utc)")
        micros = (at - datetime.fromtimestamp(0, at.tzinfo)) // timedelta(microseconds=1)
        return str(-(-micros // 1000))  # rounded up: never due before the moment given
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        raise InvalidJob("at", f"must be an aware datetime or epoch milliseconds, got {at!r}")
    if 1_000_000_000 <= at < 100_000_000_000:
        raise InvalidJob("at", f"{at} looks like epoch seconds; at takes epoch milliseconds")
    return str(at)


def spread_offset(job_id: str, window_ms: int) -> int:
    """Where in a spread window a job falls: FNV-1a (64 bits) of its id's bytes mod the window."""
    h = 0xCBF29CE484222325
    for b in job_id.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % window_ms if window_ms else 0


def _spread(due: str, job_id: str, job: Job) -> str:
    if job.spread is None:
        return due
    offset = spread_offset(job_id, _ms(job.spread, "spread"))
    return f"+{int(due[1:]) + offset}" if due.startswith("+") else str(int(due) + offset)


def _headers(headers: Optional[Mapping[str, str]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for k, v in (headers or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidJob(f"headers.{k}", f"names and values must be strings, got {type(v).__name__}")
        out[k] = v
    for name in ("traceparent", "tracestate"):
        for k in [k for k in out if k != name and k.lower() == name]:
            out.setdefault(name, out.pop(k))
    return dict(sorted(out.items(), key=lambda kv: kv[0].encode()))


def _json(meta: Dict[str, Any]) -> bytes:
    return json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode() if meta else b""


def checked(job: Job, max_payload: Optional[int]) -> Tuple[bytes, Dict[str, Any], Optional[int]]:
    """The payload, the meta (headers, max attempts) and the max lateness of a valid job."""
    dest = job.dest.encode() if isinstance(job.dest, str) else b""
    if not dest or len(dest) > 512 or b"\n" in dest:
        raise InvalidJob("dest", f"must be a non-empty string of at most 512 bytes without newlines: {job.dest!r}")
    payload = job.payload.encode() if isinstance(job.payload, str) else job.payload
    if not isinstance(payload, bytes):
        raise InvalidJob("payload", f"must be bytes or str, got {type(job.payload).__name__}")
    if max_payload is not None and len(payload) > max_payload:
        raise InvalidJob("payload", f"{len(payload)} bytes exceeds max_payload {max_payload}")
    if job.id is not None and not (isinstance(job.id, str) and 0 < len(job.id.encode()) <= 256):
        raise InvalidJob("id", f"must be a non-empty string of at most 256 bytes: {job.id!r}")
    if job.id is not None and job.id.startswith("~"):
        raise InvalidJob("id", "ids starting with ~ are reserved for the ids zdelay generates")
    meta: Dict[str, Any] = {}
    if job.headers:
        meta["headers"] = _headers(job.headers)
    if job.max_attempts is not None:
        if not isinstance(job.max_attempts, int) or job.max_attempts < 1:
            raise InvalidJob("max_attempts", f"must be a whole number >= 1, got {job.max_attempts!r}")
        meta["max_attempts"] = job.max_attempts
    late = None if job.max_lateness is None else _ms(job.max_lateness, "max_lateness")
    return payload, meta, late


POLICIES = {"replace", "keep", "error"}
OUTCOMES = {1: "added", 2: "replaced", 0: "kept", 3: "duplicate"}
SHARD_ENQUEUE = ("due", "jobs", "inflight", "dead", "reasons", "scheduled", "ready", "ready_ids", "max_lateness", "shards")
LANE_ENQUEUE = ("due", "jobs", "meta", "maxlate", "large", "dead", "reasons", "lane")
# Taken only by calls that use them, so a producer whose ACL predates them still enqueues.
WINDOWS = ("unique", "windows")


def enqueue(ns: Namespace, jobs: List[Job], on_conflict: Union[str, Debounce], ids: _Ids, max_payload: Optional[int]) -> Op:
    if isinstance(on_conflict, Debounce):
        base = f"debounce {_ms(on_conflict.max_wait, 'max_wait')}"
    elif on_conflict in POLICIES:
        base = on_conflict
    else:
        raise InvalidJob("on_conflict", f"must be one of replace, keep, error or Debounce(max_wait): {on_conflict!r}")
    results: List[Any] = [None] * len(jobs)
    groups: Dict[Tuple[str, ...], List[Tuple[int, str, List[Any]]]] = {}
    wake = f"{ns.name}:wake"
    offset = yield from clock_offset(ns)
    # On a test clock, the time the call reads (a delay, debounce, unique windows) is its.
    clock_suffix = f" clock {offset}" if ns.test_clock else ""
    for i, job in enumerate(jobs):
        try:
            payload, meta, late = checked(job, max_payload)
            due = due_arg(job.at, job.delay)
            lane = ns.lanes.get(job.dest)
            if lane is None and job.dest not in ns.two_phase and "/" not in job.dest:
                raise no_lane(job.dest, ns)
            late_arg = "" if late is None else str(late)
            policy = base if job.unique_for is None else f"{base} unique {_ms(job.unique_for, 'unique_for')}"
            extra = WINDOWS if policy != on_conflict else ()
            policy += clock_suffix
            if lane is not None:
                stored = job.id or ids.stored()
                job_id = job.id or f"~{base36(lane.number)}.{stored}"
                head = ("zd2_enqueue_lane", len(LANE_ENQUEUE) + len(extra), *lane.keys(ns.name, *LANE_ENQUEUE, *extra),
                        lane.marker, policy, wake, f"l{base36(lane.number)}")
                item = [stored, _spread(due, stored, job), payload, _json(meta), late_arg]
            else:
                job_id = job.id or ids.ulid()
                shard = shard_of(job_id, ns.shards)
                if late is not None:
                    meta["max_lateness_ms"] = late
                m = _json(meta)
                frame = b"zd1:" + job.dest.encode() + b"\n" + str(len(m)).encode() + b"\n" + m + payload
                head = ("zd2_enqueue", len(SHARD_ENQUEUE) + len(extra), *ns.shard_keys(shard, *SHARD_ENQUEUE, *extra),
                        ns.shards, policy, wake, shard)
                item = [job_id, _spread(due, job_id, job), frame, late_arg]
            groups.setdefault(head, []).append((i, job_id, item))
        except ZdelayError as e:
            results[i] = e
    calls, members = [], []
    for head, items in groups.items():
        for start in range(0, len(items), 500):
            chunk = items[start : start + 500]
            calls.append(("FCALL", *head, *[a for _, _, item in chunk for a in item]))
            members.append((jobs[chunk[0][0]].dest, chunk))
    replies = yield calls
    for reply, (dest, chunk) in zip(replies, members):
        for n, (i, job_id, _) in enumerate(chunk):
            if isinstance(reply, Exception) and str(reply).startswith("ZDELAY_NO_LANE"):
                # Registered, but its marker not written yet: as good as no lane (nothing written).
                results[i] = no_lane(dest, ns)
            elif isinstance(reply, Exception):
                results[i] = reply
            elif reply[n] == -1:
                results[i] = JobExists(f"job {job_id} exists (on_conflict='error')")
            else:
                results[i] = Enqueued(job_id, OUTCOMES[reply[n]])
    return results


NOWHERE = (None, None)


def _place(ns: Namespace, job_id: str, dest: Optional[str]) -> Op:
    """Where an id lives: (its lane, stored id), (None, id) for a spread shard, or `NOWHERE`. An
    id of your own without `dest` is looked for in every lane and in its spread shard (one
    HEXISTS each); held in more than one place, it needs `dest`."""
    if job_id.startswith("~"):
        number, dot, stored = job_id[1:].partition(".")
        if not dot or len(stored) != 12:
            raise InvalidJob("id", f"{job_id!r} is not a generated id (~<lane>.<12 characters>)")
        return ns.lane_by_number(int(number, 36)), stored
    if dest is None:
        lanes = list(ns.lanes.values())
        shard = ns.shard_keys(shard_of(job_id, ns.shards), "jobs")[0]
        held = yield [("HEXISTS", lane.keys(ns.name, "jobs")[0], job_id) for lane in lanes] + [("HEXISTS", shard, job_id)]
        for reply in held:
            if isinstance(reply, Exception):
                raise reply
        places = [(lane, job_id) for lane, h in zip(lanes, held) if h] + ([(None, job_id)] if held[-1] else [])
        if len(places) > 1:
            names = ", ".join(lane.route if lane else "a two-phase destination" for lane, _ in places)
            raise InvalidJob("dest", f"job id {job_id!r} is stored for {names}: on storage layout 2 an id of your own "
                             "is unique per route; give dest")
        return places[0] if places else NOWHERE
    if dest in ns.lanes:
        return ns.lanes[dest], job_id
    return None, job_id


def still_relocating(ns: Namespace, job_id: str) -> Op:
    """Whether a retired lane (its route's list moved to another hash slot) still holds `job_id`:
    the relocation writes a job into the route's live lane before it deletes it from the retired
    one, and nothing else changes a retired lane, so once it is gone there the live lane has it
    (or it was delivered). The lane a generated id names; for an id of your own, every one."""
    live = {(lane.route, lane.slot) for lane in ns.lanes.values()}
    places: List[Tuple[Tuple[str, int], str]] = []
    if job_id.startswith("~"):
        number, dot, stored = job_id[1:].partition(".")
        try:
            retired = ns.retired.get(int(number, 36)) if dot else None
        except ValueError:
            retired = None
        if retired is not None and retired not in live:
            places.append((retired, stored))
    else:
        places = [(retired, job_id) for retired in set(ns.retired.values()) if retired not in live]
    if not places:
        return False
    held = yield [("HEXISTS", Lane(0, route, slot, "", "").keys(ns.name, "jobs")[0], stored)
                  for (route, slot), stored in places]
    for reply in held:
        if isinstance(reply, Exception):
            raise reply
    return any(held)


def not_relocated_yet(job_id: str) -> Fenced:
    return Fenced(f"job {job_id} is being moved to its route's new lane (the route's list moved to another hash "
                  "slot; a daemon with the new config moves it when it starts): nothing was written; try again")


def still_in_old_shard(ns: Namespace, job_id: str) -> Op:
    """While `zdelay reshard` moves the spread shards of a layout-2 namespace: whether the old
    spread shard of `job_id` still holds it. The reshard writes a job into its new shard before
    it deletes it from the old one, so once it is gone there, the new shard has it (or it was
    delivered or cancelled). A generated id (`~…`) names a lane, never a spread shard. Notes in
    `ns` when the reshard has finished."""
    if ns.resharding_from is None or job_id.startswith("~"):
        return False
    old = Namespace(ns.name, ns.resharding_from)
    (jobs,) = old.shard_keys(shard_of(job_id, old.shards), "jobs")
    resharding, held = yield [("HGET", f"{ns.name}:schema", "resharding"), ("HEXISTS", jobs, job_id)]
    if isinstance(resharding, Exception) or isinstance(held, Exception):
        raise resharding if isinstance(resharding, Exception) else held
    if resharding is None:
        ns.resharding_from = None
        return False
    return bool(held)


def not_moved_yet(ns: Namespace, job_id: str) -> Upgrading:
    return Upgrading(f"namespace {ns.name} is being resharded ({ns.resharding_from} to {ns.shards} spread shards) "
                     f"and job {job_id} is not moved yet: nothing was written; try again")


def cancel(ns: Namespace, job_id: str, dest: Optional[str]) -> Op:
    lane, stored = yield from _place(ns, job_id, dest)
    if stored is None:
        return "not_pending"
    # With the job's unique-window key (the functions require it): its window entry goes too.
    if lane is not None:
        keys = lane.keys(ns.name, "due", "jobs", "meta", "maxlate", "large", "lane", "unique")
        (code,) = yield [("FCALL", "zd2_cancel_lane", len(keys), *keys, lane.marker, stored)]
    else:
        shard = shard_of(job_id, ns.shards)
        keys = ns.shard_keys(shard, "due", "jobs", "inflight", "scheduled", "ready", "ready_ids", "max_lateness", "shards", "unique")
        (code,) = yield [("FCALL", "zd2_cancel", len(keys), *keys, ns.shards, job_id)]
    return {1: "cancelled", 0: "not_pending", -1: "in_flight"}[_ok(code)]


def reschedule(ns: Namespace, job_id: str, due: str, dest: Optional[str]) -> Op:
    lane, stored = yield from _place(ns, job_id, dest)
    if stored is None:
        return None
    if due.startswith("+"):
        # "+N" counts from Redis's clock in the function: a test clock's offset is added here.
        due = f"+{int(due[1:]) + (yield from clock_offset(ns))}"
    wake = f"{ns.name}:wake"
    if lane is not None:
        keys = lane.keys(ns.name, "due", "lane")
        (ms,) = yield [("FCALL", "zd2_reschedule_lane", 2, *keys, lane.marker, stored, due, wake, f"l{base36(lane.number)}")]
    else:
        shard = shard_of(job_id, ns.shards)
        keys = ns.shard_keys(shard, "due", "scheduled", "ready", "ready_ids", "shards")
        (ms,) = yield [("FCALL", "zd2_reschedule", 5, *keys, ns.shards, job_id, due, wake, shard)]
    ms = _ok(ms)
    return None if ms is None or ms == -1 else int(ms)


def get(ns: Namespace, job_id: str, dest: Optional[str]) -> Op:
    lane, stored = yield from _place(ns, job_id, dest)
    if stored is None:
        return None
    if lane is not None:
        keys = lane.keys(ns.name, "due", "jobs", "meta", "maxlate", "dead", "reasons", "lane")
        (r,) = yield [("FCALL", "zd2_get_lane", 7, *keys, lane.marker, stored)]
        sec, usec, due, payload, meta, late, dead, reason = _ok(r)
        ready = inflight = None
        meta_json = json.loads(meta) if meta else {}
        job_dest = lane.route
    else:
        shard = shard_of(job_id, ns.shards)
        keys = ns.shard_keys(shard, "due", "jobs", "inflight", "dead", "reasons", "ready_ids", "shards")
        (r,) = yield [("FCALL", "zd2_get", 7, *keys, ns.shards, job_id)]
        sec, usec, due, ready, inflight, dead, payload, reason = _ok(r)
        job_dest, meta_json, payload = _unframe(payload) if payload is not None else (None, {}, None)
        late = meta_json.get("max_lateness_ms")
    now = int(sec) * 1000 + int(usec) / 1000 + (yield from clock_offset(ns))
    if due is not None:
        state, score = ("scheduled" if float(due) > now else "due"), due
    elif ready is not None:
        state, score = "due", ready.split(b"\n")[1]
    elif inflight is not None or dead is not None:
        state, score = ("in_flight", inflight) if inflight is not None else ("dead", dead)
    elif payload is not None:
        state, score = "orphan", None
    else:
        return None
    return {
        "id": job_id, "state": state, "dest": job_dest, "payload": payload,
        "due_ms": None if score is None else int(float(score)),
        "headers": meta_json.get("headers", {}), "max_attempts": meta_json.get("max_attempts"),
        "max_lateness_ms": None if late is None else int(late),
        "reason": None if reason is None else reason.decode(errors="replace"),
    }


def _unframe(value: bytes) -> Tuple[Optional[str], Dict[str, Any], bytes]:
    if not value.startswith(b"zd1:"):
        return None, {}, value
    dest, _, rest = value[4:].partition(b"\n")
    length, _, rest = rest.partition(b"\n")
    n = int(length)
    return dest.decode(), json.loads(rest[:n]) if n else {}, rest[n:]


FENCES = ("ZDELAY_RESHARDED", "ZDELAY_MIGRATING", "ZDELAY_LAYOUT", "ZDELAY_LANE_MOVED", "ZDELAY_LANE_CHANGED")


def _ok(reply: Any) -> Any:
    """A reply, or the error it is: fences become `Fenced` (read the namespace again), a layout
    fence naming a newer layout or zdelay `LayoutTooNew`."""
    if isinstance(reply, Exception):
        text = str(reply)
        newer = text.split(" ")
        if newer[0] == "ZDELAY_LAYOUT" and len(newer) == 3 and newer[1].isdigit():
            key = version_key(newer[2])
            if int(newer[1]) > 2 or key is None or key > version_key(VERSION):
                raise too_new(None, int(newer[1]), newer[2]) from None
        if text.startswith(FENCES):
            raise Fenced(text)
        if text.startswith("ZDELAY_NO_LANE"):
            raise NoLane(f"this route's lane has no marker yet ({text}): a daemon or a producer given the route's "
                         "config registers it; nothing was written, try again")
        raise reply
    return reply


MISFIRES = {"coalesce", "skip", "catch_up"}
SHIFTS = {"skip", "next", "previous"}
# A calendar's name, as `zdelay calendar set` takes it.
CALENDAR_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def schedule_json(id: str, dest: str, payload: Union[bytes, str], *, cron: Optional[str] = None, tz: Optional[str] = None,
                  every: Optional[Span] = None, headers: Optional[Mapping[str, str]] = None, misfire: Optional[str] = None,
                  max_catch_up: Optional[int] = None, start_at: Optional[Moment] = None, end_at: Optional[Moment] = None,
                  max_lateness: Optional[Span] = None, max_attempts: Optional[int] = None,
                  jitter: Optional[Span] = None, calendar: Optional[str] = None, shift: Optional[str] = None) -> str:
    """A schedule in the JSON form a daemon applies (a line of `zdelay schedule set --batch`)."""
    if not isinstance(id, str) or not 0 < len(id.encode()) <= 512 or "\n" in id:
        raise InvalidJob("id", f"must be a non-empty string of at most 512 bytes without newlines: {id!r}")
    body, meta, late = checked(Job(dest, payload, headers=headers, max_attempts=max_attempts, max_lateness=max_lateness), None)
    if (cron is None) == (every is None):
        raise InvalidJob("cron", "give cron or every, not both")
    if tz is not None and cron is None:
        raise InvalidJob("tz", "applies to cron only")
    if misfire is not None and misfire not in MISFIRES:
        raise InvalidJob("misfire", f"must be one of coalesce, skip, catch_up: {misfire!r}")
    if calendar is not None and not CALENDAR_NAME.fullmatch(calendar if isinstance(calendar, str) else ""):
        raise InvalidJob("calendar", f"must be 1 to 64 letters, digits, '-', '_' or '.': {calendar!r}")
    if shift is not None:
        if shift not in SHIFTS:
            raise InvalidJob("shift", f"must be one of skip, next, previous: {shift!r}")
        if calendar is None:
            raise InvalidJob("shift", "needs a calendar")
        if shift != "skip" and cron is None:
            raise InvalidJob("shift", "next and previous move an occurrence to another day at the same local time: they need cron")
    out: Dict[str, Any] = {"id": id, "dest": dest, "cron": cron, "tz": tz, "misfire": misfire, "max_catch_up": max_catch_up,
                           "max_attempts": meta.get("max_attempts"), "headers": meta.get("headers"),
                           "calendar": calendar, "shift": shift}
    try:
        out["payload"] = body.decode()
    except UnicodeDecodeError:
        out["payload"], out["payload_encoding"] = base64.b64encode(body).decode(), "base64"
    if every is not None:
        if _ms(every, "every") == 0:
            raise InvalidJob("every", "must be at least 1 ms")
        out["every"] = f"{_ms(every, 'every')}ms"
    if late is not None:
        out["max_lateness"] = f"{late}ms"
    if jitter is not None:
        out["jitter"] = f"{_ms(jitter, 'jitter')}ms"
    for name, moment in (("start_at", start_at), ("end_at", end_at)):
        if moment is not None:
            out[name] = int(due_arg(moment, None))
    return json.dumps({k: v for k, v in out.items() if v is not None}, ensure_ascii=False, separators=(",", ":"))


def schedule_request(ns: Namespace, id: str, op: str, spec: Optional[str] = None) -> Op:
    """Asks the daemons to set, pause, resume or delete a schedule; the request's number."""
    keys = (f"{{{ns.name}}}:sched_requests", f"{{{ns.name}}}:sched_results")
    (seq,) = yield [("FCALL", "zd2_schedule", 2, *keys, id, op, *([spec] if spec is not None else []))]
    return int(_ok(seq))


def schedule_outcome(ns: Namespace, id: str, seq: int) -> Op:
    """The schedule's state once requests up to `seq` were applied, or None while they wait."""
    (text,) = yield [("HGET", f"{{{ns.name}}}:sched_results", id)]
    outcome = json.loads(text) if text else {}
    if outcome.get("seq", -1) < seq:
        return None
    if not outcome.get("ok"):
        raise ScheduleRefused(f"schedule {id}: {outcome.get('error')}")
    return {k: outcome.get(k) for k in ("exists", "paused", "next_ms")}
