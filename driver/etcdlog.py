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

Append is group commit: concurrent `append` calls queue up and one committer task writes
them in batches, each ONE transaction that compares (a) the leader key is still on this
driver's lease, (b) head == the expected seq, (c) no event id of the batch exists yet, and
then writes the events, their id keys and the new head. (a) fences off a stale leader,
(b) makes a blind resend after a timeout harmless, (c) makes a caller's retry of an event
that did land return the stored event instead of writing it twice. The client never
retries a write on its own (grpc retries are disabled on the channel); the committer does,
a bounded number of times, after looking at what landed.

Batches stay under etcd's default limits (--max-txn-ops 128, 1.5 MiB requests): at most
60 events (121 ops) and 1 MiB per transaction, so an external etcd needs no flags.

Every `snapshot_every` events a background task snapshots the folded state, writes the
events up to it to the archive (driver/archive.py, fsspec), deletes them and their id keys
from etcd, and compacts (defragmenting when most of the file is free), so the database
holds only the tail. Reads and watches go to the archive for archived ranges by
themselves; `find` covers events still in etcd, which is the retry window it serves.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aetcd
import grpc
import structlog
from aetcd import rpc

from unbroken.driver import state as statelib
from unbroken.driver.archive import Archive, default_archive_url
from unbroken.driver.etcdclient import (
    ROOT,
    EtcdClient,
    Keys,
    classify,
    cmp_op,
    connect,
    decode,
    decode_all,
    delete_op,
    endpoint_of,
    first_kv,
    get_op,
    is_compacted,
    put_op,
    read_stream,
)
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
MAX_BATCH_EVENTS = 60  # 2 ops per event + head = 121 <= etcd's default --max-txn-ops 128
MAX_BATCH_BYTES = 1 << 20  # under etcd's 1.5 MiB request limit with room for keys
MAX_SNAPSHOT_BYTES = 1400 * 1024  # one put under etcd's default 1.5 MiB request limit
#: A larger state is written as parts of this size under their own keys (one put each),
#: then the snapshot key names how many (a 10,240-node state is about 2-3 MB).
SNAPSHOT_PART_BYTES = 1024 * 1024
MAX_SNAPSHOT_PARTS = 64
MAX_STATE_BYTES = MAX_SNAPSHOT_PARTS * SNAPSHOT_PART_BYTES * 16  # a stored state inflated


def snapshot_value(seq: int, state: ev.JobState) -> bytes:
    """The snapshot key's value for `state` at `seq`: the state serialized and compressed
    (`Snapshot.state_deflated`; host names repeat their pattern: 10,240 nodes with
    40-character names are 2.4 MB serialized, about 0.25 MB stored)."""
    return ev.Snapshot(
        last_seq=seq,
        wall_time_unix_ns=time.time_ns(),
        state_deflated=zlib.compress(state.SerializeToString(), 6),
    ).SerializeToString()


def inflate(data: bytes) -> bytes:
    """A stored state's serialized bytes from their compressed form (EventLogError when
    they are not zlib data or inflate past `MAX_STATE_BYTES`)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, MAX_STATE_BYTES)
    except zlib.error as e:
        raise EventLogError(
            f"a stored snapshot does not inflate ({e}): was it changed by hand?"
        ) from e
    if d.unconsumed_tail:
        raise EventLogError(f"a stored snapshot inflates past {MAX_STATE_BYTES} bytes")
    return out


MAX_ATTEMPTS = 5  # per batch, for unreachable etcd or an unknown outcome
READ_PAGE = 500  # keys per range request (each event <= 64 KiB; grpc messages <= 64 MiB)
READ_PARALLEL = 4  # range requests of one read in flight at once
MAINTAIN_MAX_SNAPSHOTS = 10  # multiples of snapshot_every archived per maintenance round
DEFRAG_MIN_BYTES = 64 << 20  # defragment only a DB this large whose file is mostly free

# ---------------------------------------------------------------- the log


@dataclass(slots=True)
class _Pending:
    event: ev.Event
    data: bytes
    futures: list[asyncio.Future[ev.Event]] = field(default_factory=list)
    group: int = 0  # the append_many call it came with (a group shares one transaction)


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
        self._pending: collections.deque[_Pending] = collections.deque()
        self._slots = asyncio.Semaphore(max_pending)
        self._wake = asyncio.Event()
        self._committer: asyncio.Task[None] | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self._maintain_wake = asyncio.Event()
        self._maintaining = asyncio.Lock()
        self._head: int | None = None
        self._groups = 0
        self._fenced: NotLeaderError | None = None
        self._closed = False
        self.unknown_outcomes = 0  # append transactions whose outcome had to be looked up
        self.snapshots_too_large = 0  # snapshots refused before the put (see maintain_once)
        self.snapshot_bytes = 0  # the newest snapshot written, stored (its parts together)
        # a snapshot value over this goes in parts (one put under etcd's request limit)
        self.max_snapshot_bytes = MAX_SNAPSHOT_BYTES

    # ------------------------------------------------------------ small helpers

    async def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """One unary RPC with a deadline; grpc errors become our typed errors."""
        await self.client.connect()
        try:
            return await method(request, timeout=timeout or self.append_timeout_s)
        except grpc.aio.AioRpcError as e:
            if is_compacted(e):
                raise
            err = classify(e, self.client)
            if err is None:
                err = LogUnavailableError(
                    f"etcd at {endpoint_of(self.client)} did not answer "
                    f"within {timeout or self.append_timeout_s:g} s"
                )
            raise err from e

    async def _txn(
        self,
        compare: Sequence[rpc.Compare],
        success: Sequence[rpc.RequestOp],
        failure: Sequence[rpc.RequestOp] = (),
    ) -> rpc.TxnResponse:
        return await self._call(
            self.client.kvstub.Txn,
            rpc.TxnRequest(compare=compare, success=success, failure=failure),
        )

    def _fence(self) -> rpc.Compare:
        assert self.leadership is not None
        return cmp_op(self.keys.leader, "LEASE", self.leadership.lease_id)

    # ------------------------------------------------------------ append (group commit)

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
        if self.leadership is None:
            raise NotLeaderError(
                "this log was opened without leadership (read-only); win Election.campaign() first"
            )
        if self._fenced is not None:
            raise NotLeaderError(str(self._fenced))
        if self._closed:
            raise EventLogError("the event log is closed")
        if not events:
            return []
        loop = asyncio.get_running_loop()
        taken = 0
        try:
            for _ in events:  # room for the whole group before any of it is queued
                await asyncio.wait_for(self._slots.acquire(), self.append_timeout_s)
                taken += 1
        except TimeoutError as err:
            for _ in range(taken):
                self._slots.release()
            raise LogUnavailableError(
                f"{len(self._pending)} appends are queued and etcd at "
                f"{endpoint_of(self.client)} is not keeping up"
            ) from err
        self._groups += 1
        futures: list[asyncio.Future[ev.Event]] = []
        for e, data in zip(events, datas, strict=True):  # no await: the group stays together
            fut: asyncio.Future[ev.Event] = loop.create_future()
            fut.add_done_callback(lambda _f: self._slots.release())
            self._pending.append(_Pending(e, data, [fut], self._groups))
            futures.append(fut)
        self._wake.set()
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_loop(), name="etcdlog-commit")
        return list(await asyncio.gather(*futures))

    def _take_batch(self) -> list[_Pending]:
        batch: dict[str, _Pending] = {}
        size = 0
        while self._pending and len(batch) < MAX_BATCH_EVENTS:
            p = self._pending[0]
            twin = batch.get(p.event.event_id)
            if twin is not None:  # the same event appended twice at once: one write
                twin.futures.extend(p.futures)
                self._pending.popleft()
                continue
            if batch and size + len(p.data) > MAX_BATCH_BYTES:
                break
            if batch and p.group != self._pending_group_of(batch) and not self._fits(p, batch):
                break  # the next group would be split: it goes whole into the next batch
            batch[p.event.event_id] = self._pending.popleft()
            size += len(p.data)
        return list(batch.values())

    @staticmethod
    def _pending_group_of(batch: dict[str, _Pending]) -> int:
        return next(reversed(batch.values())).group

    def _fits(self, first: _Pending, batch: dict[str, _Pending]) -> bool:
        """Whether the whole group starting at `first` fits the batch's remaining room."""
        n, size = len(batch), sum(len(p.data) for p in batch.values())
        for p in self._pending:
            if p.group != first.group:
                break
            n, size = n + 1, size + len(p.data)
            if n > MAX_BATCH_EVENTS or size > MAX_BATCH_BYTES:
                return False
        return True

    async def _commit_loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._take_batch()
                try:
                    await self._commit(batch)
                except NotLeaderError as e:
                    self._fenced = e
                    self._log.warning("append fenced off: not the leader", error=str(e))
                    for p in [*batch, *self._pending]:
                        _fail(p, NotLeaderError(str(e)))
                    self._pending.clear()
                except EventLogError as e:
                    for p in batch:
                        _fail(p, e)
                except Exception as e:  # a bug: fail the callers, keep the loop alive
                    self._log.exception("commit failed unexpectedly")
                    for p in batch:
                        _fail(p, EventLogError(f"append failed: {e!r}"))
                except asyncio.CancelledError:  # close() mid-commit: no caller waits forever
                    for p in batch:
                        _fail(p, EventLogError("the event log was closed during this append"))
                    raise

    async def _commit(self, batch: list[_Pending]) -> None:
        """Write `batch` in one fenced transaction, resolving each pending future."""
        k = self.keys
        errors = 0
        rounds = 0
        while batch:
            rounds += 1
            assert rounds <= 4 * MAX_ATTEMPTS, "append kept losing races it cannot lose"
            if self._head is None:
                try:
                    self._head = await self.last_seq()
                except LogUnavailableError:
                    errors += 1
                    if errors >= MAX_ATTEMPTS:
                        raise
                    await asyncio.sleep(min(0.05 * 2**errors, 1.0))
                    continue
            head = self._head
            compare = [
                self._fence(),
                cmp_op(k.head, "VALUE", b"%d" % head) if head else cmp_op(k.head, "CREATE", 0),
            ]
            success = [put_op(k.head, b"%d" % (head + len(batch)))]
            for i, p in enumerate(batch, start=head + 1):
                p.event.seq = i
                compare.append(cmp_op(k.event_id(p.event.event_id), "CREATE", 0))
                success.append(put_op(k.event(i), _with_seq(p.data, i)))
                success.append(put_op(k.event_id(p.event.event_id), b"%d" % i))
            failure = [get_op(k.leader), get_op(k.head)] + [
                get_op(k.event_id(p.event.event_id)) for p in batch
            ]
            try:
                resp = await self.client.kvstub.Txn(
                    rpc.TxnRequest(compare=compare, success=success, failure=failure),
                    timeout=self.append_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                err = classify(e, self.client)
                if isinstance(err, LogFullError) or (
                    err is not None and not isinstance(err, LogUnavailableError)
                ):
                    raise err from e
                errors += 1
                self.unknown_outcomes += 1
                if errors >= MAX_ATTEMPTS:
                    raise (
                        err
                        or LogUnavailableError(
                            f"etcd at {endpoint_of(self.client)} did not confirm an append in "
                            f"{MAX_ATTEMPTS} tries of {self.append_timeout_s:g} s"
                        )
                    ) from e
                # Unknown outcome: the head compare makes the resend safe, and the id
                # compares tell us on the next round whether the first try landed.
                self._log.info(
                    "append outcome unknown; checking before resending",
                    code=e.code().name,
                    attempt=errors,
                )
                self._head = None
                await asyncio.sleep(min(0.05 * 2**errors, 1.0))
                continue
            if resp.succeeded:
                self._head = head + len(batch)
                for p in batch:
                    _resolve(p, p.event)
                self._after_commit(head, self._head)
                return
            leader_kv, head_kv = first_kv(resp.responses[0]), first_kv(resp.responses[1])
            lead = self.leadership
            assert lead is not None
            if leader_kv is None or leader_kv.lease != lead.lease_id:
                who = json.loads(leader_kv.value)["driver_id"] if leader_kv else "nobody"
                raise NotLeaderError(
                    f"{lead.driver_id} lost leadership of job {self.job_id} "
                    f"(lease {lead.lease_id:x}); the leader is now {who}"
                )
            self._head = int(head_kv.value) if head_kv else 0
            landed = [
                (p, int(kv.value))
                for p, r in zip(batch, resp.responses[2:], strict=True)
                if (kv := first_kv(r)) is not None
            ]
            for p, seq in landed:
                stored = await self._get_event(seq)
                _resolve(p, stored if stored is not None else _stored_copy(p, seq))
            done = {id(p) for p, _ in landed}
            batch = [p for p in batch if id(p) not in done]

    def _after_commit(self, old_head: int, new_head: int) -> None:
        if self._maintainer is None:
            self._maintainer = asyncio.create_task(self._maintain_loop(), name="etcdlog-maintain")
            self._maintain_wake.set()  # a new leader finishes what a crashed one began
        if old_head // self.snapshot_every != new_head // self.snapshot_every:
            self._maintain_wake.set()

    # ------------------------------------------------------------ snapshots and archival

    async def _maintain_loop(self) -> None:
        while not self._closed and self._fenced is None:
            await self._maintain_wake.wait()
            self._maintain_wake.clear()
            try:
                while await self.maintain_once():
                    pass
            except NotLeaderError as e:
                self._fenced = e
                return
            except EventLogError as e:  # etcd trouble: the next trigger tries again
                self._log.warning("snapshot/archival round failed; retrying later", error=str(e))
            except Exception:  # a bug: log it, keep the loop alive
                self._log.exception("snapshot/archival round failed unexpectedly")

    async def _archived(self) -> tuple[int, bytes | None, list[tuple[int, str]]]:
        """(archived upto seq, the marker's raw bytes, its parts [(upto seq, url), ...])."""
        kv = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.archived))
        if not kv.kvs:
            return 0, None, []
        seq, parts = _parse_marker(kv.kvs[0].value)
        return seq, kv.kvs[0].value, parts

    async def maintain_once(self) -> bool:
        """One round: snapshot at the newest multiple of N, archive and trim what precedes it.

        Returns:
            True when it did something (call again to catch up), False when up to date.
        """
        if self.leadership is None:
            return False
        async with self._maintaining:
            return await self._maintain_locked()

    async def _maintain_locked(self) -> bool:
        assert self.leadership is not None
        n = self.snapshot_every
        head = await self.last_seq()
        snap = await self.latest_snapshot()
        snap_seq = snap.last_seq if snap else 0
        archived, archived_raw, parts = await self._archived()
        lo = archived if self.archive else snap_seq
        target = min(head - head % n, (lo // n + MAINTAIN_MAX_SNAPSHOTS) * n)
        want_snap = target > snap_seq
        want_archive = self.archive is not None and target > archived
        if not (want_snap or want_archive):
            return False
        events = await self.read(lo + 1, target)
        assert [e.seq for e in events] == list(range(lo + 1, target + 1)), "a hole in the log"
        if want_snap:
            base = snap.state if snap else statelib.initial(self.job_id)
            state = statelib.fold((e for e in events if e.seq > snap_seq), base)
            data = snapshot_value(target, state)
            self.snapshot_bytes = len(data)  # the newest snapshot's size, parts together
            if len(data) > self.max_snapshot_bytes:
                data = await self._write_parts(target, ev.Snapshot.FromString(data).state_deflated)
            older_parts = delete_op(self.keys.snapshot_parts, self.keys.snapshot_part(target, 0))
            resp = await self._txn([self._fence()], [put_op(self.keys.snapshot, data), older_parts])
            if not resp.succeeded:
                raise NotLeaderError(
                    f"{self.leadership.driver_id} lost leadership while writing a snapshot"
                )
            self._log.debug("snapshot written", seq=target)
        if want_archive:
            assert self.archive is not None
            await self._archive_and_trim(
                [e for e in events if e.seq > archived], archived, archived_raw, parts
            )
        return True

    async def _archive_and_trim(
        self,
        events: list[ev.Event],
        archived: int,
        archived_raw: bytes | None,
        parts: list[tuple[int, str]],
    ) -> None:
        assert self.archive is not None and events
        k = self.keys
        first, last = events[0].seq, events[-1].seq
        await asyncio.to_thread(self.archive.write_segment, events)
        if parts and parts[-1][1] == self.archive.url:
            parts = [*parts[:-1], (last, self.archive.url)]
        else:  # a leader archiving elsewhere: earlier parts stay where they are
            parts = [*parts, (last, self.archive.url)]
        marker = json.dumps(
            {"seq": last, "parts": [{"upto": u, "url": url} for u, url in parts]}
        ).encode()
        resp = await self._txn(
            [
                self._fence(),
                cmp_op(k.archived, "VALUE", archived_raw)
                if archived_raw
                else cmp_op(k.archived, "CREATE", 0),
            ],
            [delete_op(k.event(first), k.event(last + 1)), put_op(k.archived, marker)],
            [get_op(k.leader)],
        )
        if not resp.succeeded:
            leader = first_kv(resp.responses[0])
            assert self.leadership is not None
            if leader is None or leader.lease != self.leadership.lease_id:
                raise NotLeaderError(
                    f"{self.leadership.driver_id} lost leadership of job "
                    f"{self.job_id} while archiving"
                )
            self._log.warning("archive marker moved under us; will re-check", first=first)
            return
        for i in range(0, len(events), 120):  # id keys: not a range, so in chunks
            await self._txn([], [delete_op(k.event_id(e.event_id)) for e in events[i : i + 120]])
        rev = resp.header.revision
        try:
            await self._call(self.client.kvstub.Compact, rpc.CompactionRequest(revision=rev))
        except grpc.aio.AioRpcError as e:
            if not is_compacted(e):
                raise
        await self._maybe_defrag()
        self._log.debug("archived and trimmed", first=first, last=last, revision=rev)

    async def _maybe_defrag(self) -> None:
        st = await self.status()
        if st.dbSize >= DEFRAG_MIN_BYTES and st.dbSizeInUse * 2 < st.dbSize:
            self._log.info("defragmenting etcd", db_bytes=st.dbSize, in_use=st.dbSizeInUse)
            await self._call(
                self.client.maintenancestub.Defragment, rpc.DefragmentRequest(), timeout=60.0
            )

    async def status(self) -> rpc.StatusResponse:
        """etcd's Status of the member we talk to (dbSize, dbSizeInUse, ...)."""
        return await self._call(self.client.maintenancestub.Status, rpc.StatusRequest())

    # ------------------------------------------------------------ reads

    async def last_seq(self) -> int:
        r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.head))
        return int(r.kvs[0].value) if r.kvs else 0

    async def _get_event(self, seq: int) -> ev.Event | None:
        r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.event(seq)))
        if r.kvs:
            return decode(r.kvs[0].value)
        got = await self.read(seq, seq)
        return got[0] if got else None

    async def find(self, event_id: str) -> ev.Event | None:
        r = await self._call(
            self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.event_id(event_id))
        )
        return await self._get_event(int(r.kvs[0].value)) if r.kvs else None

    async def _write_parts(self, seq: int, state: bytes) -> bytes:
        """Write a serialized state too large for one put as parts (fenced, one put each);
        the snapshot key's value that names them."""
        n = -(-len(state) // SNAPSHOT_PART_BYTES)
        if n > MAX_SNAPSHOT_PARTS:
            self.snapshots_too_large += 1
            raise EventLogError(
                f"the snapshot at seq {seq} is {len(state)} bytes, over the "
                f"{MAX_SNAPSHOT_PARTS * SNAPSHOT_PART_BYTES}-byte limit of "
                f"{MAX_SNAPSHOT_PARTS} parts: it is not written and events are not archived "
                "until it fits (too many nodes in the job's state?); "
                "unbroken_snapshots_too_large_total counts these"
            )
        for i in range(n):
            part = state[i * SNAPSHOT_PART_BYTES : (i + 1) * SNAPSHOT_PART_BYTES]
            resp = await self._txn([self._fence()], [put_op(self.keys.snapshot_part(seq, i), part)])
            if not resp.succeeded:
                raise NotLeaderError("lost leadership while writing a snapshot's parts")
        return ev.Snapshot(
            last_seq=seq, wall_time_unix_ns=time.time_ns(), parts=n, parts_deflated=True
        ).SerializeToString()

    async def latest_snapshot(self) -> ev.Snapshot | None:
        r = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=self.keys.snapshot))
        if not r.kvs:
            return None
        snap = ev.Snapshot.FromString(r.kvs[0].value)
        if snap.parts:
            data = []
            for i in range(snap.parts):  # one part (<= 1 MiB) per read
                key = self.keys.snapshot_part(snap.last_seq, i)
                got = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=key))
                if not got.kvs:
                    raise EventLogError(
                        f"part {i} of {snap.parts} of the snapshot at seq {snap.last_seq} is "
                        f"missing from etcd ({key.decode()}): the log under "
                        f"{self.keys.base.decode()} was changed by hand?"
                    )
                data.append(got.kvs[0].value)
            whole = b"".join(data)
            snap.state.ParseFromString(inflate(whole) if snap.parts_deflated else whole)
            snap.parts = 0
            snap.parts_deflated = False
        elif snap.state_deflated:
            snap.state.ParseFromString(inflate(snap.state_deflated))
            snap.state_deflated = b""
        return snap

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
        first = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=k.archived))
        if to_seq is not None and to_seq < from_seq:
            return [], first.header.revision
        rev = first.header.revision
        out: list[ev.Event] = []
        if first.kvs:
            archived, parts = _parse_marker(first.kvs[0].value)
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
        h = await self._call(self.client.kvstub.Range, rpc.RangeRequest(key=k.head, revision=rev))
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
            return asyncio.ensure_future(self._call(self.client.kvstub.Range, req))

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
        self._closed = True
        for task in (self._committer, self._maintainer):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for p in self._pending:
            _fail(p, EventLogError("the event log was closed before this append"))
        self._pending.clear()


def _parse_marker(raw: bytes) -> tuple[int, list[tuple[int, str]]]:
    doc = json.loads(raw)
    return int(doc["seq"]), [(int(p["upto"]), str(p["url"])) for p in doc["parts"]]


def _with_seq(data: bytes, seq: int) -> bytes:
    # Field 1 (seq) is unset in `data`; concatenated protobuf messages parse as one.
    return data + ev.Event(seq=seq).SerializeToString()


def _stored_copy(p: _Pending, seq: int) -> ev.Event:
    e = ev.Event.FromString(p.data)
    e.seq = seq
    return e


def _resolve(p: _Pending, event: ev.Event) -> None:
    for f in p.futures:
        if not f.done():
            f.set_result(event)


def _fail(p: _Pending, err: BaseException) -> None:
    for f in p.futures:
        if not f.done():
            f.set_exception(err)
