"""The event log: the driver's only durable memory (docs/architecture.md#the-event-log).

`EventLog` is the narrow interface; `InMemoryEventLog` (this file) and `EtcdEventLog`
(driver/etcdlog.py) implement it, and one contract suite (tests/unit/test_eventlog_contract.py
and its etcd twin) runs against both.

Semantics every implementation keeps:
- `append` assigns the next dense sequence number and is fenced: it succeeds only while
  the writer still holds leadership (`Leadership`); a stale leader gets `NotLeaderError`.
- Exactly-once: the writer picks `event_id`; an append that timed out is looked up by
  that id before it is retried, so an event is never written twice.
- Reads and watches start at any sequence number and see events in sequence order.
- Snapshots of the folded state every `snapshot_every` events; older events are archived
  and trimmed, and replay(snapshot + tail) equals replay(all history).
"""

from __future__ import annotations

import abc
import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

SCHEMA_VERSION = ev.SCHEMA_VERSION_1
DEFAULT_MAX_EVENT_BYTES = 64 * 1024


class EventLogError(Exception):
    """Base class of every error the event log raises."""


class NotLeaderError(EventLogError):
    """The append was fenced off: this writer no longer holds leadership."""


class EventTooLargeError(EventLogError, ValueError):
    """The serialized event exceeds the size cap; it never reached the store."""


class LogUnavailableError(EventLogError):
    """The store could not be reached within the deadline (names the endpoint)."""


class LogFullError(EventLogError):
    """The store refuses writes (etcd NOSPACE alarm); nothing acknowledged was lost."""


class SchemaError(EventLogError):
    """An event carries a schema version this code does not understand."""


@dataclass(frozen=True, slots=True)
class Leadership:
    """Proof of leadership that fences appends: a driver id and the lease it holds."""

    driver_id: str
    lease_id: int
    term: int
    # what `term` counts in: "<etcd cluster id>.<job incarnation>" ("" without etcd)
    scope: str = ""


def new_event_id() -> str:
    """A fresh unique event id (the exactly-once key)."""
    return uuid.uuid4().hex


def stamp(event: ev.Event, *, job_id: str, writer: str) -> ev.Event:
    """Fill the envelope fields a writer owns (id, time, job, schema, writer) if unset."""
    if not event.event_id:
        event.event_id = new_event_id()
    if not event.wall_time_unix_ns:
        event.wall_time_unix_ns = time.time_ns()
    if not event.job_id:
        event.job_id = job_id
    if not event.schema_version:
        event.schema_version = SCHEMA_VERSION
    if not event.writer:
        event.writer = writer
    return event


def check_size(event: ev.Event, max_bytes: int) -> bytes:
    """Serialize `event`, refusing it before it reaches the store if it is too large."""
    if event.WhichOneof("payload") is None:
        raise ValueError("event has no payload; set exactly one payload field")
    data = event.SerializeToString()
    if len(data) > max_bytes:
        raise EventTooLargeError(
            f"event {event.WhichOneof('payload')} is {len(data)} bytes, over the "
            f"{max_bytes}-byte cap; truncate large strings (log lines, stack dumps) first"
        )
    return data


class EventLog(abc.ABC):
    """An append-only, fenced, exactly-once log of `Event`s for one job."""

    job_id: str

    @abc.abstractmethod
    async def append(self, event: ev.Event) -> ev.Event:
        """Append one event; return it as stored (with `seq` set) once it is durable.

        Raises:
            NotLeaderError: this writer's leadership is gone.
            EventTooLargeError: the event is over the size cap.
            LogUnavailableError / LogFullError: the store refused or was unreachable.
        """

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        """Append several events in order; implementations may batch them."""
        return [await self.append(e) for e in events]

    @abc.abstractmethod
    async def read(self, from_seq: int = 1, to_seq: int | None = None) -> list[ev.Event]:
        """Events with from_seq <= seq <= to_seq, in order, including archived ones."""

    @abc.abstractmethod
    def watch(self, from_seq: int = 1) -> AsyncIterator[ev.Event]:
        """Every event with seq >= from_seq, in order, then new ones as they are appended."""

    @abc.abstractmethod
    async def last_seq(self) -> int:
        """The sequence number of the newest event (0 when the log is empty)."""

    @abc.abstractmethod
    async def find(self, event_id: str) -> ev.Event | None:
        """The stored event with this id, if any (the exactly-once lookup)."""

    @abc.abstractmethod
    async def latest_snapshot(self) -> ev.Snapshot | None:
        """The newest snapshot of the folded state, if one was taken."""

    async def replay(self) -> ev.JobState:
        """The job state: newest snapshot folded forward with every later event."""
        snap = await self.latest_snapshot()
        if snap is None:
            base = statelib.initial(self.job_id)
            start = 1
        else:
            base = snap.state
            start = snap.last_seq + 1
        return statelib.fold(await self.read(start), base)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background tasks."""


class InMemoryStore:
    """The shared backing store of in-memory logs: what etcd is to `EtcdEventLog`.

    Several `InMemoryEventLog`s (drivers) may share one store; leadership is held here
    so fencing behaves as it does on etcd.
    """

    def __init__(self) -> None:
        self.events: list[ev.Event] = []
        self.by_id: dict[str, int] = {}
        self.snapshots: list[ev.Snapshot] = []
        self.leader: Leadership | None = None
        self.term = 0
        self.changed = asyncio.Condition()

    def elect(self, driver_id: str) -> Leadership:
        """Make `driver_id` the leader (the in-memory stand-in for an etcd election)."""
        self.term += 1
        self.leader = Leadership(driver_id=driver_id, lease_id=self.term, term=self.term)
        return self.leader


class InMemoryEventLog(EventLog):
    """The reference implementation: same semantics as etcd, in one process's memory."""

    def __init__(
        self,
        store: InMemoryStore,
        job_id: str,
        leadership: Leadership | None,
        *,
        snapshot_every: int = 1000,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.store = store
        self.job_id = job_id
        self.leadership = leadership
        self.snapshot_every = snapshot_every
        self.max_event_bytes = max_event_bytes
        self._state: ev.JobState | None = None

    async def append(self, event: ev.Event) -> ev.Event:
        return (await self.append_many([event]))[0]

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        """Append all of `events` or none (one fence check, no await in between)."""
        writer = self.leadership.driver_id if self.leadership else ""
        events = list(events)
        datas = []
        for e in events:
            e.ClearField("seq")
            stamp(e, job_id=self.job_id, writer=writer)
            datas.append(check_size(e, self.max_event_bytes))
        if self.leadership is None or self.store.leader != self.leadership:
            raise NotLeaderError(f"{writer or 'this driver'} does not hold leadership")
        out = []
        snapshot_at = 0
        for e, data in zip(events, datas, strict=True):
            existing = self.store.by_id.get(e.event_id)
            if existing is not None:
                out.append(self.store.events[existing])
                continue
            stored = ev.Event.FromString(data)
            stored.seq = len(self.store.events) + 1
            self.store.events.append(stored)
            self.store.by_id[stored.event_id] = stored.seq - 1
            if stored.seq % self.snapshot_every == 0:
                snapshot_at = stored.seq
            out.append(stored)
        if snapshot_at:
            await self._snapshot(snapshot_at)
        async with self.store.changed:
            self.store.changed.notify_all()
        return out

    async def _snapshot(self, upto: int) -> None:
        snap = self.store.snapshots[-1] if self.store.snapshots else None
        base = snap.state if snap else statelib.initial(self.job_id)
        start = snap.last_seq if snap else 0
        state = statelib.fold(self.store.events[start:upto], base)
        self.store.snapshots.append(
            ev.Snapshot(last_seq=upto, state=state, wall_time_unix_ns=time.time_ns())
        )

    async def read(self, from_seq: int = 1, to_seq: int | None = None) -> list[ev.Event]:
        if from_seq < 1:
            raise ValueError(f"from_seq must be >= 1, got {from_seq}")
        end = len(self.store.events) if to_seq is None else min(to_seq, len(self.store.events))
        return [
            ev.Event.FromString(e.SerializeToString())
            for e in self.store.events[from_seq - 1 : end]
        ]

    async def watch(self, from_seq: int = 1) -> AsyncIterator[ev.Event]:
        nxt = max(from_seq, 1)

        def ready() -> bool:
            return len(self.store.events) >= nxt

        while True:
            async with self.store.changed:
                await self.store.changed.wait_for(ready)
            for e in await self.read(nxt):
                yield e
                nxt = e.seq + 1

    async def last_seq(self) -> int:
        return len(self.store.events)

    async def find(self, event_id: str) -> ev.Event | None:
        idx = self.store.by_id.get(event_id)
        if idx is None:
            return None
        return ev.Event.FromString(self.store.events[idx].SerializeToString())

    async def latest_snapshot(self) -> ev.Snapshot | None:
        return self.store.snapshots[-1] if self.store.snapshots else None
