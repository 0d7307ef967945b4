"""The etcd event log's write path: group commit in fenced, exactly-once transactions.

Concurrent appends queue up and one committer task writes them in batches, each ONE
transaction that compares (a) the leader key is still on this driver's lease, (b) head ==
the expected seq, (c) no event id of the batch exists yet, and then writes the events,
their id keys and the new head. (a) fences off a stale leader, (b) makes a blind resend
after a timeout harmless, (c) makes a caller's retry of an event that did land return the
stored event instead of writing it twice. The client never retries a write on its own
(grpc retries are disabled on the channel); the committer does, a bounded number of times,
after looking at what landed.

Batches stay under etcd's default limits (--max-txn-ops 128, 1.5 MiB requests): at most
60 events (121 ops) and 1 MiB per transaction, so an external etcd needs no flags. The
events an `append_many` call brings together go in one transaction when they fit one.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from aetcd import rpc

from unbroken.common import aio
from unbroken.driver.etcdcalls import LogCalls
from unbroken.driver.etcdclient import classify, cmp_op, endpoint_of, first_kv, get_op, put_op
from unbroken.driver.eventlog import (
    EventLogError,
    LogFullError,
    LogUnavailableError,
    NotLeaderError,
)
from unbroken.proto import events_pb2 as ev

MAX_BATCH_EVENTS = 60  # 2 ops per event + head = 121 <= etcd's default --max-txn-ops 128
MAX_BATCH_BYTES = 1 << 20  # under etcd's 1.5 MiB request limit with room for keys
MAX_ATTEMPTS = 5  # per batch, for unreachable etcd or an unknown outcome


def backoff_s(attempt: int) -> float:
    """The pause before retry `attempt` (1, 2, ...) of a batch."""
    return min(0.05 * 2**attempt, 1.0)


@dataclass(slots=True)
class _Pending:
    event: ev.Event
    data: bytes
    futures: list[asyncio.Future[ev.Event]] = field(default_factory=list)
    group: int = 0  # the append_many call it came with (a group shares one transaction)


class GroupCommit:
    """The queue of appends and the task that commits them (see the module docstring).

    Args:
        calls: the log's calls to etcd and its writer's fence (`calls.leadership` set).
        max_pending: appends queued at most; more wait for room, up to the call deadline.
        stored: reads back the event stored at a seq (an append that landed unseen).
        on_commit: told (old head, new head) after every committed batch.
        log: the log's bound logger.
    """

    def __init__(
        self,
        calls: LogCalls,
        *,
        max_pending: int,
        stored: Callable[[int], Awaitable[ev.Event | None]],
        on_commit: Callable[[int, int], None],
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.calls = calls
        self._stored = stored
        self._on_commit = on_commit
        self._log = log
        self._pending: collections.deque[_Pending] = collections.deque()
        self._slots = asyncio.Semaphore(max_pending)
        self._wake = asyncio.Event()
        self._committer: asyncio.Task[None] | None = None
        self._head: int | None = None
        self._groups = 0
        self._closed = False
        self.unknown_outcomes = 0  # append transactions whose outcome had to be looked up

    async def submit(self, events: Sequence[ev.Event], datas: Sequence[bytes]) -> list[ev.Event]:
        """Queue stamped `events` (serialized as `datas`) as one group; the stored events."""
        if self.calls.leadership is None:
            raise NotLeaderError(
                "this log was opened without leadership (read-only); win Election.campaign() first"
            )
        if self.calls.fenced is not None:
            raise NotLeaderError(str(self.calls.fenced))
        if self._closed:
            raise EventLogError("the event log is closed")
        if not events:
            return []
        loop = asyncio.get_running_loop()
        taken = 0
        try:
            for _ in events:  # room for the whole group before any of it is queued
                await aio.wait_for(self._slots.acquire(), self.calls.timeout_s)
                taken += 1
        except TimeoutError as err:
            for _ in range(taken):
                self._slots.release()
            raise LogUnavailableError(
                f"{len(self._pending)} appends are queued and etcd at "
                f"{endpoint_of(self.calls.client)} is not keeping up"
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
                    self.calls.fenced = e
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
        errors = 0
        rounds = 0
        while batch:
            rounds += 1
            assert rounds <= 4 * MAX_ATTEMPTS, "append kept losing races it cannot lose"
            if self._head is None:
                try:
                    self._head = await self.calls.last_seq()
                except LogUnavailableError:
                    errors += 1
                    if errors >= MAX_ATTEMPTS:
                        raise
                    await asyncio.sleep(backoff_s(errors))
                    continue
            head = self._head
            try:
                resp = await self.calls.client.kvstub.Txn(
                    self._request(head, batch), timeout=self.calls.timeout_s
                )
            except grpc.aio.AioRpcError as e:
                errors += 1
                self._unknown_outcome(e, errors)
                # Unknown outcome: the head compare makes the resend safe, and the id
                # compares tell us on the next round whether the first try landed.
                self._head = None
                await asyncio.sleep(backoff_s(errors))
                continue
            if resp.succeeded:
                self._head = head + len(batch)
                for p in batch:
                    _resolve(p, p.event)
                self._on_commit(head, self._head)
                return
            batch = await self._settle_refused(resp, batch)

    def _request(self, head: int, batch: list[_Pending]) -> rpc.TxnRequest:
        """The batch's transaction after `head`: fenced, at that head, no id written twice
        (it numbers the batch's events from head + 1)."""
        k = self.calls.keys
        compare = [
            self.calls.fence(),
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
        return rpc.TxnRequest(compare=compare, success=success, failure=failure)

    def _unknown_outcome(self, e: grpc.aio.AioRpcError, errors: int) -> None:
        """Raise the typed error of a failed transaction that etcd surely refused (or the
        last of MAX_ATTEMPTS unknown outcomes); count and log an unknown outcome."""
        err = classify(e, self.calls.client)
        if isinstance(err, LogFullError) or (
            err is not None and not isinstance(err, LogUnavailableError)
        ):
            raise err from e
        self.unknown_outcomes += 1
        if errors >= MAX_ATTEMPTS:
            raise (
                err
                or LogUnavailableError(
                    f"etcd at {endpoint_of(self.calls.client)} did not confirm an append in "
                    f"{MAX_ATTEMPTS} tries of {self.calls.timeout_s:g} s"
                )
            ) from e
        self._log.info(
            "append outcome unknown; checking before resending", code=e.code().name, attempt=errors
        )

    async def _settle_refused(self, resp: rpc.TxnResponse, batch: list[_Pending]) -> list[_Pending]:
        """After a refused transaction: raise if the lease is gone, else resolve the events
        that had landed (a resend's first try) and return the rest to write again."""
        leader_kv, head_kv = first_kv(resp.responses[0]), first_kv(resp.responses[1])
        lead = self.calls.leadership
        assert lead is not None
        if leader_kv is None or leader_kv.lease != lead.lease_id:
            who = json.loads(leader_kv.value)["driver_id"] if leader_kv else "nobody"
            raise NotLeaderError(
                f"{lead.driver_id} lost leadership of job {self.calls.job_id} "
                f"(lease {lead.lease_id:x}); the leader is now {who}"
            )
        self._head = int(head_kv.value) if head_kv else 0
        landed = [
            (p, int(kv.value))
            for p, r in zip(batch, resp.responses[2:], strict=True)
            if (kv := first_kv(r)) is not None
        ]
        for p, seq in landed:
            stored = await self._stored(seq)
            _resolve(p, stored if stored is not None else _stored_copy(p, seq))
        done = {id(p) for p, _ in landed}
        return [p for p in batch if id(p) not in done]

    async def close(self) -> None:
        """Stop the committer; every append still queued fails."""
        self._closed = True
        if self._committer is not None and not self._committer.done():
            self._committer.cancel()
            try:
                await self._committer
            except asyncio.CancelledError:
                pass
        for p in self._pending:
            _fail(p, EventLogError("the event log was closed before this append"))
        self._pending.clear()


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
