"""The torchrun rendezvous served by the driver: state and c10d store in etcd v3.

`torchrun --rdzv-backend=unbroken --rdzv-endpoint=<driver>` (client: unbroken.agent.rdzv)
runs torch's own DynamicRendezvousHandler, whose state lives here instead of in torch's
etcd-v2 or TCPStore backends. torch's etcd backends speak only the v2 API that etcd 3.6
removed; this one goes through the driver, so the state sits in the same etcd v3 as the
event log, written only by the leader (every write is fenced on the leader key's lease),
and survives a driver failover.

Key layout (`etcdctl get --prefix /unbroken/<job>/rdzv/ --keys-only`):

    /unbroken/<job>/rdzv/<run_id>/state        torch's pickled rendezvous state (opaque)
    /unbroken/<job>/rdzv/<run_id>/kv/<key>     the run's c10d store, one key per key
    /unbroken/<job>/rdzv-key                   the job's state key (GetKey), 32 random bytes

The store stays small: once round r completes, the keys of earlier rounds are deleted
(torch prefixes them `torch.rendezvous.<run_id>.<round>/`), and all of them once the
rendezvous closes; the state key stays, so a late node learns the run is over.

The state's fencing token is its etcd mod revision: SetState is one transaction that
compares (a) the leader key is on this driver's lease and (b) the state's mod revision is
the caller's token (or, for token 0, that no state exists), and otherwise answers with
what is stored. Store keys are compare-and-set on their mod revision too (add,
compare_set), with a bounded number of attempts. Blocking store reads wait in the driver:
every write wakes the waiters, so a get returns as soon as the key lands.

Exclusion: a node whose id has a NodeEvicted event in the log (a diagnosis verdict or
`unbroken evict`) is refused with FAILED_PRECONDITION naming the reason, and one
RendezvousRefused event records it. Completed rounds are recorded as RendezvousRound
events, so the log tells which nodes trained in which round.

Quotas: a run keeps at most `max_keys_per_run` keys and `max_run_bytes` of keys and values,
a job at most `max_runs` runs and `max_job_bytes` in all, and one principal (a node's
credential, a launcher's) may begin at most `max_runs_per_principal` of the runs and hold
`max_principal_bytes` of what was written (so one credential cannot take every run from
the job's other nodes; only identified principals are counted so: the anonymous caller of
a driver without credentials and an unbound role token share the job's quotas); a write
past one is refused with
RESOURCE_EXHAUSTED naming the limit, before it reaches etcd (114 unbounded StoreSets once
filled a 64 MiB etcd and stopped the event log). The usage is counted in memory, read from
etcd once per leader term (`Quota`), and updated by every write, delete and sweep.

The state itself is opaque here: torchrun agents seal it with an HMAC and open it with a
restricted unpickler (agent/rdzvauth.py), so the driver neither needs nor tries to check it.
Unless the nodes were given a key of their own, the key is the driver's: GetKey makes one
at random per job (create-if-absent, so every node and a later leader hand out the same
one) and gives it only to principals allowed to rendezvous, over the same authenticated
channel as every other call. That way `torchrun` needs no secret beyond the node's own
credential (its certificate or token), and nodes with per-node tokens share one key.

This module is the gRPC surface. The limits, keys, decisions and quota bookkeeping are
pure, in driver/rendezvous_state.py. The stores are in driver/rendezvous_kv.py: `EtcdKV`,
and in the in-memory event-log mode (`--event-log memory`) a `MemoryKV` (demos and tests;
nothing survives the process).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog

from unbroken.common import aio, channel
from unbroken.driver.etcdclient import Keys
from unbroken.driver.eventlog import (
    EventLog,
    EventLogError,
    LogUnavailableError,
    NotLeaderError,
)
from unbroken.driver.rendezvous_kv import KV, MemoryKV, UnknownOutcomeError, kv_for
from unbroken.driver.rendezvous_state import (
    Membership,
    Quota,
    QuotaError,
    RdzvKeys,
    RendezvousConfig,
    add_to,
    caller_problem,
    compare_set,
    evicted_nodes,
    membership,
    round_event,
    stale_store_prefixes,
)
from unbroken.driver.security import caller as principal
from unbroken.proto import events_pb2 as ev
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

log = structlog.get_logger(__name__)

SERVICE_NAME = "unbroken.rendezvous.v1.Rendezvous"
T = TypeVar("T")


# ---------------------------------------------------------------- the service


@dataclass(slots=True)
class _Evictions:
    """The evicted-node set, refreshed from the log when its head moves."""

    seq: int = -1
    at: float = -1e9
    nodes: dict[str, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RendezvousService(rgrpc.RendezvousServicer):
    """The Rendezvous gRPC service; it follows the `DriverService`'s leadership.

    Args:
        driver: the driver's agent-facing service: its `log` (None while standing by),
            `leader_address`, `driver_id` and `job_id` are read on every call.
        config: limits.
    """

    def __init__(self, driver: Any, config: RendezvousConfig | None = None) -> None:
        self.driver = driver
        self.config = config or RendezvousConfig()
        self.memory = MemoryKV()
        self._changed = asyncio.Event()
        self._evictions = _Evictions()
        self._names: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._recorded: dict[str, Membership] = {}
        self._swept: dict[str, int] = {}  # run -> the lowest round whose store keys may remain
        self._refused: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._kv: tuple[EventLog, KV] | None = None
        self._quota: tuple[KV, Quota] | None = None
        self._quota_lock = asyncio.Lock()

    @classmethod
    def attach(
        cls, server: grpc.aio.Server, driver: Any, config: RendezvousConfig | None = None
    ) -> RendezvousService:
        """Create the service and add it to `server` (the driver's, so its auth applies)."""
        service = cls(driver, config)
        rgrpc.add_RendezvousServicer_to_server(service, server)
        leadership = getattr(driver, "leadership", None)
        if leadership is not None:  # `unbroken evict` may name a torchrun-only node
            leadership.rendezvous_nodes = service.known_nodes
        return service

    def known_nodes(self) -> set[str]:
        """The node ids of the torchrun agents heard from lately (at most `names_kept`)."""
        return set(self._names.values())

    # ------------------------------------------------------------ plumbing
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _kv_of(self, elog: EventLog) -> KV:
        if self._kv is None or self._kv[0] is not elog:
            self._kv = (elog, kv_for(elog, self.memory, self.config.etcd_timeout_s))
        return self._kv[1]

    async def _quota_of(self, kv: KV) -> Quota:
        """The usage of this term's store (read from it once per term)."""
        async with self._quota_lock:
            if self._quota is None or self._quota[0] is not kv:
                base = Keys(self.driver.job_id).base + b"rdzv/"
                quota = Quota(self.config, base)
                quota.load(await kv.scan(base))
                self._quota = (kv, quota)
            return self._quota[1]

    async def _charge(self, kv: KV, run_id: str, key: bytes, value_len: int) -> None:
        who = principal()
        (await self._quota_of(kv)).charge(
            run_id, key, value_len, str(who) if who.identified else ""
        )

    async def _begin(
        self, caller: rpb.Caller, context: grpc.aio.ServicerContext
    ) -> tuple[EventLog, KV]:
        """Check leadership, the caller and evictions; return the log and the store."""
        elog = self.driver.log
        if elog is None:
            where = self.driver.leader_address or "unknown yet"
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"driver {self.driver.driver_id} is not the leader; the leader is at {where}",
                trailing_metadata=((channel.LEADER_KEY, self.driver.leader_address),),
            )
        problem = caller_problem(caller)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        who = principal()
        if who.role == "node" and not who.is_node(caller.node_id):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{who} may speak in the rendezvous only as node {who.name!r}, not as "
                f"{caller.node_id[:256]!r} (set UNBROKEN_NODE_ID or rdzv conf node_id= to "
                "the node id its credential names)",
            )
        if caller.node_desc:
            self._remember(caller.node_desc, caller.node_id)
        why = await self._guard(context, lambda: self._evicted(elog, caller.node_id))
        if why:
            self._record_refusal(elog, caller, why)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{why}; the rendezvous of job {self.driver.job_id} refuses it. Repair or "
                "replace the node and give the new one another node id (UNBROKEN_NODE_ID)",
            )
        return elog, self._kv_of(elog)

    def _remember(self, desc: str, node_id: str) -> None:
        self._names[desc] = node_id
        self._names.move_to_end(desc)
        while len(self._names) > self.config.names_kept:
            self._names.popitem(last=False)

    def _name(self, desc: str) -> str:
        node_id = self._names.get(desc)
        return f"{node_id}@{desc}" if node_id else desc

    async def _evicted(self, elog: EventLog, node_id: str) -> str:
        """Why `node_id` is evicted ("" when it is not), from the journal's state in memory."""
        journal = self.driver.journal
        if journal is None:
            return ""
        ev_ = self._evictions
        state = journal.state
        if state.last_seq != ev_.seq:
            ev_.nodes = evicted_nodes(state)
            ev_.seq = state.last_seq
        return ev_.nodes.get(node_id, "")

    def _later(self, work: Coroutine[Any, Any, None], what: str) -> None:
        """Run `work` (with a deadline) without holding up the caller; failures are logged."""

        async def run() -> None:
            try:
                await aio.wait_for(work, self.config.etcd_timeout_s * 2)
            except (TimeoutError, EventLogError, ValueError) as e:
                log.warning("rendezvous background work failed", what=what, error=str(e) or repr(e))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _append_later(self, elog: EventLog, event: ev.Event) -> None:
        """Record `event` through the term's journal without holding up the caller.

        Dropped (with a log line) only when `elog`'s term has ended meanwhile.
        """
        journal = self.driver.journal
        if journal is None or journal.log is not elog:
            log.warning(
                "term ended; rendezvous event not recorded", kind=event.WhichOneof("payload")
            )
            return

        async def record() -> None:
            await journal.record(event)

        self._later(record(), f"record {event.WhichOneof('payload')}")

    def _record_refusal(self, elog: EventLog, caller: rpb.Caller, why: str) -> None:
        key = (caller.run_id, caller.node_id)
        if key in self._refused:
            return
        self._refused.add(key)
        log.warning("rendezvous refused an evicted node", run=caller.run_id, node=caller.node_id)
        self._append_later(
            elog,
            ev.Event(
                cause="rendezvous",
                rendezvous_refused=ev.RendezvousRefused(
                    run_id=caller.run_id, node_id=caller.node_id, reason=why
                ),
            ),
        )

    async def _guard(
        self, context: grpc.aio.ServicerContext, body: Callable[[], Awaitable[T]]
    ) -> T:
        """Run `body`, turning store failures into gRPC statuses a client can act on."""
        try:
            return await body()
        except NotLeaderError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{e}; retry: the new leader serves the rendezvous",
                trailing_metadata=((channel.LEADER_KEY, ""),),
            )
        except UnknownOutcomeError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except LogUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except EventLogError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"etcd did not answer within {self.config.etcd_timeout_s:g} s; retry",
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QuotaError as e:
            log.warning("rendezvous quota", error=str(e))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        raise AssertionError("unreachable")

    def _check_key(self, key: str) -> None:
        if not key or len(key.encode()) > self.config.max_key_bytes:
            raise ValueError(f"store keys must be 1-{self.config.max_key_bytes} bytes")

    def _check_value(self, what: str, value: bytes) -> None:
        if len(value) > self.config.max_value_bytes:
            raise ValueError(
                f"{what} is {len(value)} bytes; the rendezvous keeps at most "
                f"{self.config.max_value_bytes} per value"
            )

    async def _wait(self, probe: Callable[[], Awaitable[T | None]], wait_ms: int) -> T | None:
        """Call `probe` until it returns a value or `wait_ms` (capped) has passed."""
        wait_s = min(max(wait_ms, 0), self.config.max_wait_ms) / 1000.0
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._changed  # taken before probing: no wake-up is lost
            got = await probe()
            left = deadline - time.monotonic()
            if got is not None or left <= 0:
                return got
            with contextlib.suppress(TimeoutError):
                await aio.wait_for(changed.wait(), min(left, 1.0))

    # ------------------------------------------------------------ state
    async def GetState(
        self, request: rpb.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> rpb.GetStateResponse:
        _, kv = await self._begin(request.caller, context)
        keys = RdzvKeys(self.driver.job_id, request.caller.run_id)
        got = await self._guard(context, lambda: kv.get(keys.state))
        if got is None:
            return rpb.GetStateResponse(found=False)
        return rpb.GetStateResponse(found=True, state=got[0], token=got[1])

    async def GetKey(
        self, request: rpb.GetKeyRequest, context: grpc.aio.ServicerContext
    ) -> rpb.GetKeyResponse:
        """The run's state key: HMAC(the job's secret, run_id). The secret is made once
        (compare-and-set on a missing key), so every leader hands out the same keys."""
        _, kv = await self._begin(request.caller, context)
        where = Keys(self.driver.job_id).base + b"rdzv-secret"

        async def body() -> bytes:
            got = await kv.get(where)
            if got is None:
                _, stored, _ = await kv.cas(where, secrets.token_bytes(32), 0)
                got = (stored, 0) if stored is not None else await kv.get(where)
            if got is None or not got[0]:
                raise ValueError("the job's rendezvous secret could not be stored")
            return got[0]

        secret = await self._guard(context, body)
        run = request.caller.run_id.encode()
        key = hmac.new(secret, b"rdzv-key\0" + run, hashlib.sha256).digest()
        return rpb.GetKeyResponse(key=key)

    async def SetState(
        self, request: rpb.SetStateRequest, context: grpc.aio.ServicerContext
    ) -> rpb.SetStateResponse:
        elog, kv = await self._begin(request.caller, context)
        run_id = request.caller.run_id
        keys = RdzvKeys(self.driver.job_id, run_id)

        async def body() -> tuple[bool, bytes | None, int]:
            self._check_value("the rendezvous state", request.state)
            if request.token < 0:
                raise ValueError(f"token must be >= 0, got {request.token}")
            await self._charge(kv, run_id, keys.state, len(request.state))
            return await kv.cas(keys.state, request.state, request.token)

        ok, value, token = await self._guard(context, body)
        if ok:
            self._notify()
            event = round_event(run_id, request.summary, self._recorded.get(run_id), self._name)
            if event is not None:
                self._recorded[run_id] = membership(request.summary)
                log.info(
                    "rendezvous round",
                    run=run_id,
                    round=request.summary.round,
                    closed=request.summary.closed,
                    participants=len(request.summary.participants),
                    spares=len(request.summary.spares),
                )
                self._append_later(elog, event)
                self._sweep(kv, keys, run_id, request.summary)
        return rpb.SetStateResponse(ok=ok, state=value or b"", token=token)

    def _sweep(self, kv: KV, keys: RdzvKeys, run_id: str, summary: rpb.RoundSummary) -> None:
        """Delete the store keys of finished rounds (all of them once the run closed)."""
        if summary.closed:
            prefixes = [keys.kv_prefix]
        else:
            first = self._swept.get(run_id, 0)
            prefixes = [keys.kv(p) for p in stale_store_prefixes(run_id, first, summary.round)]
            self._swept[run_id] = summary.round

        async def sweep() -> None:
            n = 0
            for p in prefixes:
                n += await kv.delete_prefix(p)
                (await self._quota_of(kv)).forget(run_id, p, prefix=True)
            if n:
                log.info("rendezvous store swept", run=run_id, keys=n, round=summary.round)

        self._later(sweep(), "sweep")

    # ------------------------------------------------------------ store
    async def StoreSet(
        self, request: rpb.StoreSetRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreSetResponse:
        _, kv = await self._begin(request.caller, context)
        keys = RdzvKeys(self.driver.job_id, request.caller.run_id)

        async def body() -> None:
            self._check_key(request.key)
            self._check_value(f"store value of {request.key!r}", request.value)
            await self._charge(kv, request.caller.run_id, keys.kv(request.key), len(request.value))
            await kv.put(keys.kv(request.key), request.value)

        await self._guard(context, body)
        self._notify()
        return rpb.StoreSetResponse()

    async def StoreGet(
        self, request: rpb.StoreGetRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreGetResponse:
        _, kv = await self._begin(request.caller, context)
        key = RdzvKeys(self.driver.job_id, request.caller.run_id).kv(request.key)

        async def body() -> tuple[bytes, int] | None:
            self._check_key(request.key)
            return await self._wait(lambda: kv.get(key), request.wait_ms)

        got = await self._guard(context, body)
        return rpb.StoreGetResponse(found=got is not None, value=got[0] if got else b"")

    async def _update(
        self,
        kv: KV,
        run_id: str,
        key: bytes,
        change: Callable[[bytes | None], tuple[bool, bytes, T]],
    ) -> T:
        """Read-modify-write `key` with compare-and-set; `change` -> (write?, value, answer)."""
        for _ in range(self.config.cas_attempts):
            got = await kv.get(key)
            write, value, answer = change(got[0] if got else None)
            if not write:
                return answer
            await self._charge(kv, run_id, key, len(value))
            ok, _, _ = await kv.cas(key, value, got[1] if got else 0)
            if ok:
                self._notify()
                return answer
        raise LogUnavailableError(
            f"{self.config.cas_attempts} compare-and-set attempts on one store key all lost "
            "to concurrent writers; retry"
        )

    async def StoreAdd(
        self, request: rpb.StoreAddRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreAddResponse:
        _, kv = await self._begin(request.caller, context)
        key = RdzvKeys(self.driver.job_id, request.caller.run_id).kv(request.key)

        def change(cur: bytes | None) -> tuple[bool, bytes, int]:
            new = add_to(cur, request.delta, request.key)
            return True, str(new).encode(), new

        async def body() -> int:
            self._check_key(request.key)
            return await self._update(kv, request.caller.run_id, key, change)

        return rpb.StoreAddResponse(value=await self._guard(context, body))

    async def StoreCompareSet(
        self, request: rpb.StoreCompareSetRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreCompareSetResponse:
        _, kv = await self._begin(request.caller, context)
        key = RdzvKeys(self.driver.job_id, request.caller.run_id).kv(request.key)

        def change(cur: bytes | None) -> tuple[bool, bytes, bytes]:
            write, answer = compare_set(cur, request.expected, request.desired)
            return write, request.desired, answer

        async def body() -> bytes:
            self._check_key(request.key)
            self._check_value(f"store value of {request.key!r}", request.desired)
            return await self._update(kv, request.caller.run_id, key, change)

        return rpb.StoreCompareSetResponse(value=await self._guard(context, body))

    async def StoreWait(
        self, request: rpb.StoreWaitRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreWaitResponse:
        _, kv = await self._begin(request.caller, context)
        keys = RdzvKeys(self.driver.job_id, request.caller.run_id)
        missing: list[str] = []

        async def probe() -> bool | None:
            missing[:] = [k for k in request.keys if await kv.get(keys.kv(k)) is None]
            return None if missing else True

        async def body() -> bool:
            for k in request.keys:
                self._check_key(k)
            return bool(await self._wait(probe, request.wait_ms))

        ready = await self._guard(context, body)
        return rpb.StoreWaitResponse(ready=ready, missing=[] if ready else missing)

    async def StoreCheck(
        self, request: rpb.StoreCheckRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreCheckResponse:
        _, kv = await self._begin(request.caller, context)
        keys = RdzvKeys(self.driver.job_id, request.caller.run_id)

        async def body() -> bool:
            for k in request.keys:
                self._check_key(k)
                if await kv.get(keys.kv(k)) is None:
                    return False
            return True

        return rpb.StoreCheckResponse(ready=await self._guard(context, body))

    async def StoreDelete(
        self, request: rpb.StoreDeleteRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreDeleteResponse:
        _, kv = await self._begin(request.caller, context)
        key = RdzvKeys(self.driver.job_id, request.caller.run_id).kv(request.key)

        async def body() -> bool:
            deleted = await kv.delete(key)
            (await self._quota_of(kv)).forget(request.caller.run_id, key)
            return deleted

        deleted = await self._guard(context, body)
        self._notify()
        return rpb.StoreDeleteResponse(deleted=deleted)

    async def StoreNumKeys(
        self, request: rpb.StoreNumKeysRequest, context: grpc.aio.ServicerContext
    ) -> rpb.StoreNumKeysResponse:
        _, kv = await self._begin(request.caller, context)
        prefix = RdzvKeys(self.driver.job_id, request.caller.run_id).kv_prefix
        return rpb.StoreNumKeysResponse(count=await self._guard(context, lambda: kv.count(prefix)))

    async def close(self) -> None:
        """Wait (briefly) for event appends still in flight."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.config.etcd_timeout_s)
