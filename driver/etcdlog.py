"""The event log on etcd: fenced, exactly-once, gap-free, and small however long the job runs.

Key layout of one job (`etcdctl get --prefix /unbroken/<job>/ --keys-only` shows it):

    /unbroken/<job>/leader          JSON {driver_id, address, lease_id, term}; on the lease
    /unbroken/<job>/term            the election counter
    /unbroken/<job>/head            seq of the newest event ("0" never stored: absent = empty)
    /unbroken/<job>/ev/<seq:020d>   one serialized `Event`
    /unbroken/<job>/id/<event_id>   its seq: the exactly-once index
    /unbroken/<job>/snapshot        the newest `Snapshot` (folded state at a multiple of N)
    /unbroken/<job>/archived        JSON {seq, parts: [{upto, url}]}: events 1..seq are in
                                    the archive, (previous upto, upto] at each url

Three parts, one per concern, share the log's calls and fence (driver/etcdcalls.py):

- the write path (driver/etcdcommit.py): appends are group-committed, each batch ONE
  transaction fenced on the leader key's lease, at the expected head, with no event id
  written twice; a resend after a timeout is harmless and a retried event that landed is
  returned as stored;
- retention (driver/etcdsnapshot.py): every `snapshot_every` events the leader snapshots
  the folded state, archives the events before it (driver/archive.py, fsspec), deletes
  them from etcd and compacts, so the database holds only the tail;
- reads (this module): `read`, `replay` and `watch` go to the archive for archived ranges
  by themselves; `find` covers events still in etcd, which is the retry window it serves.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aetcd
import grpc
import structlog
from aetcd import rpc

from unbroken.driver import state as statelib
from unbroken.driver.archive import Archive, default_archive_url
from unbroken.driver.etcdcalls import LogCalls
from unbroken.driver.etcdclient import (
    ROOT,
    EtcdClient,
    Keys,
    connect,
    decode,
    decode_all,
    endpoint_of,
    is_compacted,
    read_stream,
)
from unbroken.driver.etcdcommit import MAX_ATTEMPTS, MAX_BATCH_BYTES, GroupCommit
from unbroken.driver.etcdsnapshot import Maintainer, parse_marker, read_snapshot
from unbroken.driver.eventlog import (
    DEFAULT_MAX_EVENT_BYTES,
    EventLog,
    EventLogError,
    Leadership,
    LogFullError,
    LogUnavailableError,
    NotLeaderError,
    check_size,
    stamp,
)
from unbroken.proto import events_pb2 as ev

__all__ = [
    "NO_ARCHIVE",
    "ROOT",
    "EtcdClient",
    "EtcdEventLog",
    "Keys",
    "LogFullError",
    "LogUnavailableError",
    "NotLeaderError",
    "connect",
]

log = structlog.get_logger(__name__)

NO_ARCHIVE = ""  # archive_url value that keeps every event in etcd (snapshots still taken)
READ_PAGE = 500  # keys per range request (each event <= 64 KiB; grpc messages <= 64 MiB)
READ_PARALLEL = 4  # range requests of one read in flight at once


class EtcdEventLog(EventLog):
    """The `EventLog` on etcd (see the module docstring for keys and guarantees).

    Args:
        client: a connected client (`connect()`); the caller owns and closes it.
        job_id: the job whose log this is.
        leadership: proof of leadership from `Election.campaign()`; None opens the log
            read-only (append raises NotLeaderError; no snapshots or archival).
        snapshot_every: snapshot (and archive what precedes it) every this many events.
        archive_url: fsspec URL or directory for archived events; None = the default local
            directory (`archive.default_archive_url()`), NO_ARCHIVE ("") = keep all in etcd.
        max_event_bytes: events larger than this are refused before they reach etcd.
        append_timeout_s: deadline of one append transaction; an append gives up after
            MAX_ATTEMPTS such attempts.
    """

    def __init__(
        self,
        client: aetcd.Client,
        job_id: str,
        leadership: Leadership | None,
        *,
        snapshot_every: int = 1000,
        archive_url: str | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        append_timeout_s: float = 5.0,
        max_pending: int = 10_000,
    ) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if not 0 < max_event_bytes <= MAX_BATCH_BYTES:
            raise ValueError(
                f"max_event_bytes must be in 1..{MAX_BATCH_BYTES}, got {max_event_bytes}"
            )
        if append_timeout_s <= 0:
            raise ValueError(f"append_timeout_s must be > 0, got {append_timeout_s}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.client = client
        self.job_id = job_id
        self.keys = Keys(job_id)
        self.leadership = leadership
        self.snapshot_every = snapshot_every
        url = default_archive_url() if archive_url is None else archive_url
        self.archive = Archive(url, job_id) if url else None
        self.max_event_bytes = max_event_bytes
        self.append_timeout_s = append_timeout_s
        self._log = log.bind(job=job_id, writer=leadership.driver_id if leadership else None)
        self.calls = LogCalls(client, job_id, leadership, append_timeout_s)
        self.maintainer = Maintainer(
            self.calls,
            snapshot_every=snapshot_every,
            archive=self.archive,
            read=self.read,
            log=self._log,
        )
        self.commits = GroupCommit(
            self.calls,
            max_pending=max_pending,
            stored=self._get_event,
            on_commit=self.maintainer.after_commit,
            log=self._log,
        )

    # ------------------------------------------------------------ counters of the parts

    @property
    def unknown_outcomes(self) -> int:
        """Append transactions whose outcome had to be looked up."""
        return self.commits.unknown_outcomes

    @property
    def snapshots_too_large(self) -> int:
        """Snapshots refused before the put: over the parts' limit."""
        return self.maintainer.snapshots_too_large

    @property
    def snapshot_bytes(self) -> int:
        """The newest snapshot written, stored (its parts together)."""
        return self.maintainer.snapshot_bytes

    @property
    def max_snapshot_bytes(self) -> int:
        """A snapshot value over this goes in parts (one put under etcd's request limit)."""
        return self.maintainer.max_snapshot_bytes

    @max_snapshot_bytes.setter
    def max_snapshot_bytes(self, value: int) -> None:
        self.maintainer.max_snapshot_bytes = value

    # ------------------------------------------------------------ append

    async def append(self, event: ev.Event) -> ev.Event:
        return (await self.append_many([event]))[0]

    async def append_many(self, events: Iterable[ev.Event]) -> list[ev.Event]:
        """Append events in order, in ONE transaction when they fit one (<= 60 events,
        <= 1 MiB; a larger group is split at those limits, in order)."""
        writer = self.leadership.driver_id if self.leadership else ""
        events = list(events)
        datas = []
        for e in events:
            e.ClearField("seq")  # the log assigns it (a retried event may carry a stale one)
            stamp(e, job_id=self.job_id, writer=writer)
            datas.append(check_size(e, self.max_event_bytes))
        return await self.commits.submit(events, datas)

    # ------------------------------------------------------------ snapshots and archival

    async def maintain_once(self) -> bool:
        """One round: snapshot at the newest multiple of N, archive and trim what precedes it.

        Returns:
            True when it did something (call again to catch up), False when up to date.
        """
        return await self.maintainer.maintain_once()

    async def status(self) -> rpc.StatusResponse:
        """etcd's Status of the member we talk to (dbSize, dbSizeInUse, ...)."""
        return await self.calls.status()

    async def latest_snapshot(self) -> ev.Snapshot | None:
        return await read_snapshot(self.calls)

    # ------------------------------------------------------------ reads

    async def last_seq(self) -> int:
        return await self.calls.last_seq()

    async def _get_event(self, seq: int) -> ev.Event | None:
        r = await self.calls.get(self.keys.event(seq))
        if r.kvs:
            return decode(r.kvs[0].value)
        got = await self.read(seq, seq)
        return got[0] if got else None

    async def find(self, event_id: str) -> ev.Event | None:
        r = await self.calls.get(self.keys.event_id(event_id))
        return await self._get_event(int(r.kvs[0].value)) if r.kvs else None

    async def read(self, from_seq: int = 1, to_seq: int | None = None) -> list[ev.Event]:
        if from_seq < 1:
            raise ValueError(f"from_seq must be >= 1, got {from_seq}")
        for _ in range(MAX_ATTEMPTS):
            try:
                events, _rev = await self._read_at_one_revision(from_seq, to_seq)
                return events
            except grpc.aio.AioRpcError as e:  # compacted under a paged read: read again
                assert is_compacted(e), e
        raise LogUnavailableError(
            f"read of job {self.job_id} from {from_seq} kept racing etcd compaction; retry"
        )

    async def replay(self) -> ev.JobState:
        """The job state: newest snapshot folded forward with every later event.

        Each page is folded as it arrives while the next ones are in flight (etcd works
        on them meanwhile), into one copy of the snapshot's state, with no list of the
        whole tail kept; a read that raced compaction starts over from a fresh copy."""
        for _ in range(MAX_ATTEMPTS):
            snap = await self.latest_snapshot()
            state = statelib.initial(self.job_id) if snap is None else snap.state
            start = 1 if snap is None else snap.last_seq + 1
            out = ev.JobState()
            out.CopyFrom(state)
            try:
                await self._read_at_one_revision(
                    start, None, sink=functools.partial(statelib.fold_into, out)
                )
                return out
            except grpc.aio.AioRpcError as e:
                assert is_compacted(e), e
        raise LogUnavailableError(f"replay of job {self.job_id} kept racing etcd compaction; retry")

    async def _read_at_one_revision(
        self,
        from_seq: int,
        to_seq: int | None,
        sink: Callable[[list[ev.Event]], None] | None = None,
    ) -> tuple[list[ev.Event], int]:
        """Events from_seq..to_seq and the etcd revision they were read at (archive included).

        With `sink`, each page goes to it, in order, instead of the list (returned empty)."""
        k = self.keys
        first = await self.calls.get(k.archived)
        if to_seq is not None and to_seq < from_seq:
            return [], first.header.revision
        rev = first.header.revision
        out: list[ev.Event] = []
        if first.kvs:
            archived, parts = parse_marker(first.kvs[0].value)
            lo = 1
            for upto_part, url in parts:
                if from_seq <= upto_part and (to_seq is None or to_seq >= from_seq):
                    upto = upto_part if to_seq is None else min(upto_part, to_seq)
                    got = await self._read_archive(url, from_seq, upto)
                    if sink is None:
                        out += got
                    else:
                        sink(got)
                    from_seq = upto + 1
                lo = upto_part + 1
            assert lo == archived + 1, f"archive marker parts end at {lo - 1}, not {archived}"
        if to_seq is not None and from_seq > to_seq:
            return out, rev
        # the head at the same revision bounds the pages exactly
        h = await self.calls.get(k.head, rev)
        head = int(h.kvs[0].value) if h.kvs else 0
        to_seq = head if to_seq is None else min(to_seq, head)
        # Event keys are dense: each page is an exact key range, so etcd never walks past it
        # (a `limit` over an open range made etcd scan the rest of the log on every page:
        # 3.5 s for 100k events against 0.4 s), and a few pages are in flight at once.
        # A window of READ_PARALLEL pages stays in flight: the oldest is decoded (and given
        # to the sink) while etcd serves the others.
        last = to_seq

        def page(a: int) -> asyncio.Future[Any]:
            req = rpc.RangeRequest(
                key=k.event(a), range_end=k.event(min(a + READ_PAGE, last + 1)), revision=rev
            )
            return asyncio.ensure_future(self.calls.call(self.client.kvstub.Range, req))

        starts = iter(range(from_seq, to_seq + 1, READ_PAGE))
        window = collections.deque(page(a) for a in itertools.islice(starts, READ_PARALLEL))
        try:
            while window:
                r = await window.popleft()
                nxt = next(starts, None)
                if nxt is not None:
                    window.append(page(nxt))
                got = decode_all(kv.value for kv in r.kvs)
                if sink is None:
                    out += got
                else:
                    sink(got)
        finally:
            for f in window:
                f.cancel()
        return out, rev

    async def _read_archive(self, url: str, from_seq: int, upto: int) -> list[ev.Event]:
        archive = self.archive if self.archive and self.archive.url == url else None
        archive = archive or Archive(url, self.job_id)
        out = await asyncio.to_thread(archive.read, from_seq, upto)
        if len(out) != upto - from_seq + 1:
            raise EventLogError(
                f"archive {url} lacks events of {from_seq}..{upto} for job "
                f"{self.job_id} (found {len(out)}); was it moved or deleted?"
            )
        return out

    async def watch(self, from_seq: int = 1) -> AsyncIterator[ev.Event]:  # type: ignore[override]
        """Every event from `from_seq` on, in order and gap-free, then new ones as they land.

        Catches up by `read` (archive included), then follows an etcd watch from the
        revision of that read. Whenever the watch breaks (compaction, a lost stream, a gap)
        it catches up again from the next expected seq, so nothing is skipped or repeated.
        """
        if from_seq < 1:
            raise ValueError(f"from_seq must be >= 1, got {from_seq}")
        nxt = from_seq
        failures = 0
        while True:
            try:
                events, rev = await self._read_at_one_revision(nxt, None)
            except (grpc.aio.AioRpcError, LogUnavailableError) as err:  # compacted or down
                failures += 1
                if failures > MAX_ATTEMPTS:
                    raise LogUnavailableError(
                        f"watch of job {self.job_id} cannot read etcd at "
                        f"{endpoint_of(self.client)}: {err}"
                    ) from err
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            for old in events:
                yield old
                nxt = old.seq + 1
            try:
                async for new in self._follow(nxt, rev + 1):
                    failures = 0
                    yield new
                    nxt = new.seq + 1
            except (grpc.aio.AioRpcError, LogUnavailableError) as err:
                failures += 1
                if failures > MAX_ATTEMPTS:
                    raise LogUnavailableError(
                        f"watch of job {self.job_id} lost etcd at {endpoint_of(self.client)}: {err}"
                    ) from err
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def _follow(self, nxt: int, start_revision: int) -> AsyncIterator[ev.Event]:
        """Events nxt, nxt+1, ... from an etcd watch; returns when it must resync."""
        k = self.keys
        await self.client.connect()
        call = rpc.WatchStub(self.client.channel).Watch()
        try:
            await call.write(
                rpc.WatchRequest(
                    create_request=rpc.WatchCreateRequest(
                        key=k.event(nxt),
                        range_end=k.ev_end,
                        start_revision=start_revision,
                        filters=[rpc.WatchCreateRequest.NODELETE],
                    )
                )
            )
            while True:
                resp = await read_stream(call)
                if resp is grpc.aio.EOF:
                    raise LogUnavailableError(
                        "etcd closed the watch stream (or its channel, after a failover)"
                    )
                if resp.canceled or resp.compact_revision:
                    return  # compacted past us: catch up by reading
                for wev in resp.events:
                    seq = Keys.seq_of(wev.kv.key)
                    if seq < nxt:
                        continue
                    if seq > nxt:
                        return  # cannot happen with dense appends; resync by reading
                    yield decode(wev.kv.value)
                    nxt += 1
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.commits.close()
        await self.maintainer.close()
