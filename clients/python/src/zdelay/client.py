"""The sync and asyncio clients: each runs the protocol's operations (`_core`) on a redis-py
connection, reading the namespace once and again when a call meets a fence."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, List, Optional, Sequence, Union

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from . import _core
from ._core import Debounce, Enqueued, Fenced, Job, JobExists, Moment, Namespace, NotApplied, Op, Span, Upgrading

# "replace", "keep", "error", or Debounce(max_wait).
Policy = Union[str, Debounce]

POLL = 0.02  # seconds between reads of a schedule request's outcome


def _drive(op: Op, execute: Callable[[List[Any]], List[Any]]) -> Any:
    try:
        commands = next(op)
        while True:
            commands = op.send(execute(commands))
    except StopIteration as done:
        return done.value


class _Base:
    def __init__(self, conn: Any, namespace: str = "zdelay", max_payload: Optional[int] = None) -> None:
        self.redis = conn
        self.namespace = namespace
        self.max_payload = max_payload
        self._ns: Optional[Namespace] = None
        self._ids = _core._Ids()

    @staticmethod
    def _late(id: str, wait: float, deadline: float) -> bool:
        if time.monotonic() < deadline:
            return False
        raise NotApplied(f"no zdelay daemon applied the request for schedule {id} within {wait} s; "
                         "it stays, and is applied when a daemon runs")

    @staticmethod
    def _one(results: List[Any]) -> Enqueued:
        result = results[0]
        if isinstance(result, Exception):
            raise result
        return result


def _job(dest: str, payload: Union[bytes, str], **kw: Any) -> Job:
    return Job(dest, payload, **kw)


def _refused(results: List[Any]) -> List[int]:
    """Jobs worth sending again after reading the namespace again: refused by a fence, or for a
    destination without a lane in the registry as last read (one may have been registered)."""
    return [i for i, r in enumerate(results)
            if isinstance(r, _core.NoLane) or (isinstance(r, Exception) and str(r).startswith(_core.FENCES))]


class Client(_Base):
    """A producer on a redis-py `Redis` or `RedisCluster` (bytes replies: the default)."""

    @classmethod
    def from_url(cls, url: str, namespace: str = "zdelay", cluster: bool = False, **kw: Any) -> "Client":
        conn = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
        return cls(conn, namespace, **kw)

    def _execute(self, commands: List[Any]) -> List[Any]:
        if isinstance(self.redis, RedisCluster):
            out = []
            for c in commands:
                try:
                    out.append(self.redis.execute_command(*c))
                except redis.ResponseError as e:
                    out.append(e)
            return out
        pipe = self.redis.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        return pipe.execute(raise_on_error=False)

    def _namespace(self, again: bool = False) -> Namespace:
        if self._ns is None or again:
            self._ns = _drive(_core.load_namespace(self.namespace), self._execute)
        return self._ns

    def _run(self, make: Callable[[Namespace], Op], job_id: Optional[str] = None) -> Any:
        """`make` on the namespace; once more after reading it again when a fence refused the
        call. With `job_id` (a lookup by id), first waits while `zdelay reshard` has not moved
        that job to its new spread shard, or a daemon not into its route's new lane."""
        try:
            return _drive(make(self._moved(self._namespace(), job_id)), self._execute)
        except Upgrading:
            raise
        except Fenced:
            return _drive(make(self._moved(self._namespace(again=True), job_id)), self._execute)

    def _moved(self, ns: Namespace, job_id: Optional[str]) -> Namespace:
        deadline = time.monotonic() + _core.MOVE_WAIT
        while job_id is not None and _drive(_core.still_in_old_shard(ns, job_id), self._execute):
            if time.monotonic() > deadline:
                raise _core.not_moved_yet(ns, job_id)
            time.sleep(POLL)
        while job_id is not None and _drive(_core.still_relocating(ns, job_id), self._execute):
            if time.monotonic() > deadline:
                raise _core.not_relocated_yet(job_id)
            time.sleep(POLL)
        return ns

    def enqueue_many(self, jobs: Sequence[Job], on_conflict: Policy = "replace") -> List[Union[Enqueued, Exception]]:
        """One result per job, in order: `Enqueued`, or the error of that job alone."""
        jobs = list(jobs)
        results = self._run(lambda ns: _core.enqueue(ns, jobs, on_conflict, self._ids, self.max_payload))
        again = _refused(results)
        if again:
            retried = _drive(
                _core.enqueue(self._namespace(again=True), [jobs[i] for i in again], on_conflict, self._ids, self.max_payload),
                self._execute,
            )
            for i, r in zip(again, retried):
                results[i] = r
        return results

    def enqueue(self, dest: str, payload: Union[bytes, str], *, on_conflict: Policy = "replace", **kw: Any) -> Enqueued:
        """Enqueue one job: `at` (aware datetime or epoch ms) or `delay` (on Redis's clock),
        `id`, `headers`, `max_attempts`, `max_lateness`, `spread`, `unique_for`. Raises
        `JobExists` with on_conflict="error"; outcome "duplicate": delivered or dead within
        its unique window, nothing written."""
        return self._one(self.enqueue_many([_job(dest, payload, **kw)], on_conflict))

    def cancel(self, id: str, dest: Optional[str] = None) -> str:
        """"cancelled", "not_pending" (delivered, dead, unknown) or "in_flight"."""
        return self._run(lambda ns: _core.cancel(ns, id, dest), id)

    def reschedule(self, id: str, *, at: Optional[Moment] = None, delay: Optional[Span] = None, dest: Optional[str] = None) -> Optional[int]:
        """The new due time in epoch ms, or None when the job is not pending."""
        due = _core.due_arg(at, delay)
        return self._run(lambda ns: _core.reschedule(ns, id, due, dest), id)

    def get(self, id: str, dest: Optional[str] = None) -> Optional[dict]:
        """The job (state, dest, payload, due_ms, headers, …), or None when there is none."""
        return self._run(lambda ns: _core.get(ns, id, dest), id)

    def clock(self) -> dict:
        """A test namespace's clock ([testing] clock = true): {"now_ms", "redis_ms",
        "offset_ms"}. Raises `NoTestClock` on a namespace created without one."""
        return self._run(_core.clock)

    def advance_clock(self, by: Span) -> dict:
        """Moves a test namespace's clock forward by `by` (a timedelta or ms, 1 ms or more) and
        wakes the daemons: what falls due in the time skipped is delivered at once. Answers the
        new clock, as `clock()`. Raises `NoTestClock` on a namespace created without one."""
        return self._run(lambda ns: _core.advance_clock(ns, by))

    def schedule_set(self, id: str, dest: str, payload: Union[bytes, str] = b"", *, wait: float = 5.0, **kw: Any) -> Optional[dict]:
        """Create or update a recurring schedule: `cron` (with `tz`) or `every`; `headers`,
        `misfire`, `max_catch_up`, `start_at`, `end_at`, `max_lateness`, `max_attempts`, `jitter`;
        `calendar` (a calendar's name: its days are skipped) with `shift` (skip, next, previous). A daemon
        plans it: waits up to `wait` s for the outcome ({"exists", "paused", "next_ms"}), raising
        `ScheduleRefused` (why) or `NotApplied`; wait=0 returns None at once."""
        return self._schedule(id, "set", _core.schedule_json(id, dest, payload, **kw), wait)

    def schedule_pause(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return self._schedule(id, "pause", None, wait)

    def schedule_resume(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return self._schedule(id, "resume", None, wait)

    def schedule_delete(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return self._schedule(id, "delete", None, wait)

    def _schedule(self, id: str, op: str, spec: Optional[str], wait: float) -> Optional[dict]:
        seq = self._run(lambda ns: _core.schedule_request(ns, id, op, spec))
        deadline = time.monotonic() + wait
        while wait > 0:
            outcome = self._run(lambda ns: _core.schedule_outcome(ns, id, seq))
            if outcome is not None or self._late(id, wait, deadline):
                return outcome
            time.sleep(POLL)
        return None


class AsyncClient(_Base):
    """The same producer on `redis.asyncio.Redis` or `redis.asyncio.cluster.RedisCluster`."""

    @classmethod
    def from_url(cls, url: str, namespace: str = "zdelay", cluster: bool = False, **kw: Any) -> "AsyncClient":
        conn = AsyncRedisCluster.from_url(url) if cluster else redis.asyncio.Redis.from_url(url)
        return cls(conn, namespace, **kw)

    async def _execute(self, commands: List[Any]) -> List[Any]:
        if isinstance(self.redis, AsyncRedisCluster):
            out = []
            for c in commands:
                try:
                    out.append(await self.redis.execute_command(*c))
                except redis.ResponseError as e:
                    out.append(e)
            return out
        pipe = self.redis.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        return await pipe.execute(raise_on_error=False)

    async def _drive(self, op: Op) -> Any:
        try:
            commands = next(op)
            while True:
                commands = op.send(await self._execute(commands))
        except StopIteration as done:
            return done.value

    async def _namespace(self, again: bool = False) -> Namespace:
        if self._ns is None or again:
            self._ns = await self._drive(_core.load_namespace(self.namespace))
        return self._ns

    async def _run(self, make: Callable[[Namespace], Op], job_id: Optional[str] = None) -> Any:
        try:
            return await self._drive(make(await self._moved(await self._namespace(), job_id)))
        except Upgrading:
            raise
        except Fenced:
            return await self._drive(make(await self._moved(await self._namespace(again=True), job_id)))

    async def _moved(self, ns: Namespace, job_id: Optional[str]) -> Namespace:
        deadline = time.monotonic() + _core.MOVE_WAIT
        while job_id is not None and await self._drive(_core.still_in_old_shard(ns, job_id)):
            if time.monotonic() > deadline:
                raise _core.not_moved_yet(ns, job_id)
            await asyncio.sleep(POLL)
        while job_id is not None and await self._drive(_core.still_relocating(ns, job_id)):
            if time.monotonic() > deadline:
                raise _core.not_relocated_yet(job_id)
            await asyncio.sleep(POLL)
        return ns

    async def enqueue_many(self, jobs: Sequence[Job], on_conflict: Policy = "replace") -> List[Union[Enqueued, Exception]]:
        jobs = list(jobs)
        results = await self._run(lambda ns: _core.enqueue(ns, jobs, on_conflict, self._ids, self.max_payload))
        again = _refused(results)
        if again:
            ns = await self._namespace(again=True)
            retried = await self._drive(_core.enqueue(ns, [jobs[i] for i in again], on_conflict, self._ids, self.max_payload))
            for i, r in zip(again, retried):
                results[i] = r
        return results

    async def enqueue(self, dest: str, payload: Union[bytes, str], *, on_conflict: Policy = "replace", **kw: Any) -> Enqueued:
        return self._one(await self.enqueue_many([_job(dest, payload, **kw)], on_conflict))

    async def cancel(self, id: str, dest: Optional[str] = None) -> str:
        return await self._run(lambda ns: _core.cancel(ns, id, dest), id)

    async def reschedule(self, id: str, *, at: Optional[Moment] = None, delay: Optional[Span] = None, dest: Optional[str] = None) -> Optional[int]:
        due = _core.due_arg(at, delay)
        return await self._run(lambda ns: _core.reschedule(ns, id, due, dest), id)

    async def get(self, id: str, dest: Optional[str] = None) -> Optional[dict]:
        return await self._run(lambda ns: _core.get(ns, id, dest), id)

    async def clock(self) -> dict:
        return await self._run(_core.clock)

    async def advance_clock(self, by: Span) -> dict:
        return await self._run(lambda ns: _core.advance_clock(ns, by))

    async def schedule_set(self, id: str, dest: str, payload: Union[bytes, str] = b"", *, wait: float = 5.0, **kw: Any) -> Optional[dict]:
        return await self._schedule(id, "set", _core.schedule_json(id, dest, payload, **kw), wait)

    async def schedule_pause(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return await self._schedule(id, "pause", None, wait)

    async def schedule_resume(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return await self._schedule(id, "resume", None, wait)

    async def schedule_delete(self, id: str, *, wait: float = 5.0) -> Optional[dict]:
        return await self._schedule(id, "delete", None, wait)

    async def _schedule(self, id: str, op: str, spec: Optional[str], wait: float) -> Optional[dict]:
        seq = await self._run(lambda ns: _core.schedule_request(ns, id, op, spec))
        deadline = time.monotonic() + wait
        while wait > 0:
            outcome = await self._run(lambda ns: _core.schedule_outcome(ns, id, seq))
            if outcome is not None or self._late(id, wait, deadline):
                return outcome
            await asyncio.sleep(POLL)
        return None

    async def aclose(self) -> None:
        # redis-py 5 renamed close() to aclose().
        await getattr(self.redis, "aclose", self.redis.close)()


__all__ = ["Client", "AsyncClient", "JobExists"]
