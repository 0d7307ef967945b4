"""What keeps the etcd event log small: snapshots, archival, trimming and compaction.

Every `snapshot_every` events a background task snapshots the folded state, writes the
events up to it to the archive (driver/archive.py, fsspec), deletes them and their id keys
from etcd, and compacts (defragmenting when most of the file is free), so the database
holds only the tail. Only the leader maintains; every write here is fenced on its lease.

A snapshot is the folded state serialized and compressed under one key; a state too
large for one put (etcd's 1.5 MiB request limit) is written as parts under their own keys,
and the snapshot key names how many. The archive marker (`archived`) says which events
live in which archive part: JSON {seq, parts: [{upto, url}]}.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Awaitable, Callable

import grpc
import structlog
from aetcd import rpc

from unbroken.driver import state as statelib
from unbroken.driver.archive import Archive
from unbroken.driver.etcdcalls import LogCalls
from unbroken.driver.etcdclient import cmp_op, delete_op, first_kv, get_op, is_compacted, put_op
from unbroken.driver.eventlog import EventLogError, NotLeaderError
from unbroken.proto import events_pb2 as ev

MAX_SNAPSHOT_BYTES = 1400 * 1024  # one put under etcd's default 1.5 MiB request limit
#: A larger state is written as parts of this size under their own keys (one put each),
#: then the snapshot key names how many (a 10,240-node state is about 2-3 MB).
SNAPSHOT_PART_BYTES = 1024 * 1024
MAX_SNAPSHOT_PARTS = 64
MAX_STATE_BYTES = MAX_SNAPSHOT_PARTS * SNAPSHOT_PART_BYTES * 16  # a stored state inflated
MAINTAIN_MAX_SNAPSHOTS = 10  # multiples of snapshot_every archived per maintenance round
DEFRAG_MIN_BYTES = 64 << 20  # defragment only a DB this large whose file is mostly free
ID_DELETES_PER_TXN = 120  # id keys are not a range: deleted in chunks under --max-txn-ops


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


def parse_marker(raw: bytes) -> tuple[int, list[tuple[int, str]]]:
    """The archive marker's (archived upto seq, [(upto seq, url), ...])."""
    doc = json.loads(raw)
    return int(doc["seq"]), [(int(p["upto"]), str(p["url"])) for p in doc["parts"]]


async def read_snapshot(calls: LogCalls) -> ev.Snapshot | None:
    """The newest snapshot with its state inflated (its parts read and joined)."""
    keys = calls.keys
    r = await calls.get(keys.snapshot)
    if not r.kvs:
        return None
    snap = ev.Snapshot.FromString(r.kvs[0].value)
    if snap.parts:
        data = []
        for i in range(snap.parts):  # one part (<= 1 MiB) per read
            key = keys.snapshot_part(snap.last_seq, i)
            got = await calls.get(key)
            if not got.kvs:
                raise EventLogError(
                    f"part {i} of {snap.parts} of the snapshot at seq {snap.last_seq} is "
                    f"missing from etcd ({key.decode()}): the log under "
                    f"{keys.base.decode()} was changed by hand?"
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


class Maintainer:
    """The leader's snapshot and archival rounds (see the module docstring).

    Args:
        calls: the log's calls to etcd and its writer's fence.
        snapshot_every: snapshot (and archive what precedes it) every this many events.
        archive: where archived events go; None keeps every event in etcd.
        read: the log's read of events from..to (archive included).
        log: the log's bound logger.
    """

    def __init__(
        self,
        calls: LogCalls,
        *,
        snapshot_every: int,
        archive: Archive | None,
        read: Callable[[int, int], Awaitable[list[ev.Event]]],
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.calls = calls
        self.snapshot_every = snapshot_every
        self.archive = archive
        self._read = read
        self._log = log
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._maintaining = asyncio.Lock()
        self._closed = False
        self.snapshots_too_large = 0  # snapshots refused before the put (see _write_parts)
        self.snapshot_bytes = 0  # the newest snapshot written, stored (its parts together)
        # a snapshot value over this goes in parts (one put under etcd's request limit)
        self.max_snapshot_bytes = MAX_SNAPSHOT_BYTES

    def after_commit(self, old_head: int, new_head: int) -> None:
        """Start the rounds with the term's first commit; wake them at each multiple."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="etcdlog-maintain")
            self._wake.set()  # a new leader finishes what a crashed one began
        if old_head // self.snapshot_every != new_head // self.snapshot_every:
            self._wake.set()

    async def _loop(self) -> None:
        while not self._closed and self.calls.fenced is None:
            await self._wake.wait()
            self._wake.clear()
            try:
                while await self.maintain_once():
                    pass
            except NotLeaderError as e:
                self.calls.fenced = e
                return
            except EventLogError as e:  # etcd trouble: the next trigger tries again
                self._log.warning("snapshot/archival round failed; retrying later", error=str(e))
            except Exception:  # a bug: log it, keep the loop alive
                self._log.exception("snapshot/archival round failed unexpectedly")

    async def _archived(self) -> tuple[int, bytes | None, list[tuple[int, str]]]:
        """(archived upto seq, the marker's raw bytes, its parts [(upto seq, url), ...])."""
        kv = await self.calls.get(self.calls.keys.archived)
        if not kv.kvs:
            return 0, None, []
        seq, parts = parse_marker(kv.kvs[0].value)
        return seq, kv.kvs[0].value, parts

    async def maintain_once(self) -> bool:
        """One round: snapshot at the newest multiple of N, archive and trim what precedes it.

        Returns:
            True when it did something (call again to catch up), False when up to date.
        """
        if self.calls.leadership is None:
            return False
        async with self._maintaining:
            return await self._maintain_locked()

    async def _maintain_locked(self) -> bool:
        n = self.snapshot_every
        head = await self.calls.last_seq()
        snap = await read_snapshot(self.calls)
        snap_seq = snap.last_seq if snap else 0
        archived, archived_raw, parts = await self._archived()
        lo = archived if self.archive else snap_seq
        target = min(head - head % n, (lo // n + MAINTAIN_MAX_SNAPSHOTS) * n)
        want_snap = target > snap_seq
        want_archive = self.archive is not None and target > archived
        if not (want_snap or want_archive):
            return False
        events = await self._read(lo + 1, target)
        assert [e.seq for e in events] == list(range(lo + 1, target + 1)), "a hole in the log"
        if want_snap:
            base = snap.state if snap else statelib.initial(self.calls.job_id)
            state = statelib.fold((e for e in events if e.seq > snap_seq), base)
            await self._write_snapshot(target, state)
        if want_archive:
            await self._archive_and_trim(
                [e for e in events if e.seq > archived], archived, archived_raw, parts
            )
        return True

    async def _write_snapshot(self, seq: int, state: ev.JobState) -> None:
        keys = self.calls.keys
        data = snapshot_value(seq, state)
        self.snapshot_bytes = len(data)  # the newest snapshot's size, parts together
        if len(data) > self.max_snapshot_bytes:
            data = await self._write_parts(seq, ev.Snapshot.FromString(data).state_deflated)
        older_parts = delete_op(keys.snapshot_parts, keys.snapshot_part(seq, 0))
        resp = await self.calls.txn(
            [self.calls.fence()], [put_op(keys.snapshot, data), older_parts]
        )
        if not resp.succeeded:
            assert self.calls.leadership is not None
            raise NotLeaderError(
                f"{self.calls.leadership.driver_id} lost leadership while writing a snapshot"
            )
        self._log.debug("snapshot written", seq=seq)

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
            resp = await self.calls.txn(
                [self.calls.fence()], [put_op(self.calls.keys.snapshot_part(seq, i), part)]
            )
            if not resp.succeeded:
                raise NotLeaderError("lost leadership while writing a snapshot's parts")
        return ev.Snapshot(
            last_seq=seq, wall_time_unix_ns=time.time_ns(), parts=n, parts_deflated=True
        ).SerializeToString()

    async def _archive_and_trim(
        self,
        events: list[ev.Event],
        archived: int,
        archived_raw: bytes | None,
        parts: list[tuple[int, str]],
    ) -> None:
        assert self.archive is not None and events
        k = self.calls.keys
        first, last = events[0].seq, events[-1].seq
        await asyncio.to_thread(self.archive.write_segment, events)
        if parts and parts[-1][1] == self.archive.url:
            parts = [*parts[:-1], (last, self.archive.url)]
        else:  # a leader archiving elsewhere: earlier parts stay where they are
            parts = [*parts, (last, self.archive.url)]
        marker = json.dumps(
            {"seq": last, "parts": [{"upto": u, "url": url} for u, url in parts]}
        ).encode()
        resp = await self.calls.txn(
            [
                self.calls.fence(),
                cmp_op(k.archived, "VALUE", archived_raw)
                if archived_raw
                else cmp_op(k.archived, "CREATE", 0),
            ],
            [delete_op(k.event(first), k.event(last + 1)), put_op(k.archived, marker)],
            [get_op(k.leader)],
        )
        if not resp.succeeded:
            leader = first_kv(resp.responses[0])
            lead = self.calls.leadership
            assert lead is not None
            if leader is None or leader.lease != lead.lease_id:
                raise NotLeaderError(
                    f"{lead.driver_id} lost leadership of job {self.calls.job_id} while archiving"
                )
            self._log.warning("archive marker moved under us; will re-check", first=first)
            return
        for i in range(0, len(events), ID_DELETES_PER_TXN):
            chunk = events[i : i + ID_DELETES_PER_TXN]
            await self.calls.txn([], [delete_op(k.event_id(e.event_id)) for e in chunk])
        rev = resp.header.revision
        try:
            await self.calls.call(
                self.calls.client.kvstub.Compact, rpc.CompactionRequest(revision=rev)
            )
        except grpc.aio.AioRpcError as e:
            if not is_compacted(e):
                raise
        await self._maybe_defrag()
        self._log.debug("archived and trimmed", first=first, last=last, revision=rev)

    async def _maybe_defrag(self) -> None:
        st = await self.calls.status()
        if st.dbSize >= DEFRAG_MIN_BYTES and st.dbSizeInUse * 2 < st.dbSize:
            self._log.info("defragmenting etcd", db_bytes=st.dbSize, in_use=st.dbSizeInUse)
            await self.calls.call(
                self.calls.client.maintenancestub.Defragment, rpc.DefragmentRequest(), timeout=60.0
            )

    async def close(self) -> None:
        """Stop the rounds (a round in flight is cancelled; the next leader redoes it)."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
