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

The stores are in driver/rendezvous_kv.py: `EtcdKV`, and in the in-memory event-log
mode (`--event-log memory`) a `MemoryKV` (demos and tests; nothing survives the process).
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

from unbroken.common import channel
from unbroken.driver.detectors import node_id_problem
from unbroken.driver.etcdclient import Keys
from unbroken.driver.eventlog import (
    EventLog,
    EventLogError,
    LogUnavailableError,
    NotLeaderError,
)
from unbroken.driver.rendezvous_kv import KV, MemoryKV, UnknownOutcomeError, kv_for
from unbroken.driver.security import caller as principal
from unbroken.proto import events_pb2 as ev
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

log = structlog.get_logger(__name__)

SERVICE_NAME = "unbroken.rendezvous.v1.Rendezvous"
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    """Limits of the rendezvous service."""

    max_value_bytes: int = 512 * 1024  # one state or store value (etcd takes 1.5 MiB)
    max_key_bytes: int = 1024
    max_wait_ms: int = 30_000  # longest a blocking store call waits in one RPC
    etcd_timeout_s: float = 5.0  # deadline of one etcd call
    cas_attempts: int = 32  # compare-and-set retries of add / compare_set under contention
    evictions_refresh_s: float = 1.0  # how stale the evicted-node set may be
    names_kept: int = 100_000  # node descriptors remembered for events
    max_keys_per_run: int = 4096  # store keys of one run (torch uses a few per node per round)
    max_run_bytes: int = 8 << 20  # keys and values of one run, its state included
    max_runs: int = 64  # runs (torchrun --rdzv-id) of one job with keys in etcd
    max_job_bytes: int = 32 << 20  # all runs of the job (etcd's quota is 2 GiB, tests' 64 MiB)
    # what one principal (node:X, launcher:Y) may take of those: the runs it began and the
    # bytes it wrote, so one credential cannot fill the job's runs or bytes for the others
    max_runs_per_principal: int = 16
    max_principal_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not 1024 <= self.max_value_bytes <= 1024 * 1024:
            raise ValueError(
                f"max_value_bytes must be in [1 KiB, 1 MiB], got {self.max_value_bytes}"
            )
        if not 16 <= self.max_key_bytes <= 64 * 1024:
            raise ValueError(f"max_key_bytes must be in [16, 65536], got {self.max_key_bytes}")
        if not 10 <= self.max_wait_ms <= 300_000:
            raise ValueError(f"max_wait_ms must be in [10, 300000], got {self.max_wait_ms}")
        if not self.etcd_timeout_s > 0:
            raise ValueError(f"etcd_timeout_s must be > 0, got {self.etcd_timeout_s}")
        if not 1 <= self.cas_attempts <= 10_000:
            raise ValueError(f"cas_attempts must be in [1, 10000], got {self.cas_attempts}")
        if self.evictions_refresh_s < 0:
            raise ValueError(f"evictions_refresh_s must be >= 0, got {self.evictions_refresh_s}")
        if self.names_kept < 1:
            raise ValueError(f"names_kept must be >= 1, got {self.names_kept}")
        for name in (
            "max_keys_per_run",
            "max_run_bytes",
            "max_runs",
            "max_job_bytes",
            "max_runs_per_principal",
            "max_principal_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_run_bytes < self.max_value_bytes:
            raise ValueError("max_run_bytes must be >= max_value_bytes (one value must fit)")


# ---------------------------------------------------------------- pure core


@dataclass(frozen=True, slots=True)
class RdzvKeys:
    """The etcd keys of one run's rendezvous (see the module docstring)."""

    job_id: str
    run_id: str

    @property
    def base(self) -> bytes:
        return Keys(self.job_id).base + b"rdzv/" + self.run_id.encode() + b"/"

    @property
    def state(self) -> bytes:
        return self.base + b"state"

    @property
    def kv_prefix(self) -> bytes:
        return self.base + b"kv/"

    def kv(self, key: str) -> bytes:
        return self.kv_prefix + key.encode()


def caller_problem(caller: rpb.Caller) -> str:
    """Why a request's caller is malformed ('' when it is fine)."""
    run_id, node_id = caller.run_id, caller.node_id
    if not run_id or len(run_id) > 128 or "/" in run_id or not run_id.isprintable():
        return (
            f"run_id {run_id[:128]!r} must be 1-128 printable characters without '/' "
            "(torchrun --rdzv-id)"
        )
    if not node_id or len(node_id) > 256 or node_id_problem(node_id):
        return (
            f"node_id {node_id[:256]!r} must be 1-256 characters: "
            f"{node_id_problem(node_id) or 'empty or too long'} "
            "(rdzv conf node_id=..., env UNBROKEN_NODE_ID, default the hostname)"
        )
    if len(caller.node_desc) > 512:
        return "node_desc must be at most 512 characters"
    return ""


def compare_set(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bool, bytes]:
    """TCPStore's compare_set decision: (write `desired`?, the value to answer)."""
    if current is None:
        return (True, desired) if not expected else (False, expected)
    if current == expected:
        return True, desired
    return False, current


def add_to(current: bytes | None, delta: int, key: str) -> int:
    """The new value of an add; ValueError when the stored value is not an integer."""
    if current is None:
        return delta
    try:
        return int(current) + delta
    except ValueError:
        raise ValueError(
            f"store key {key!r} holds {current[:32]!r}, not an integer; add() needs one"
        ) from None


def evicted_nodes(state: ev.JobState) -> dict[str, str]:
    """Node id -> why, for every node the folded state marks evicted."""
    return {
        node_id: f"node {node_id} was evicted (see `unbroken events`: NodeEvicted)"
        for node_id, rec in state.nodes.items()
        if rec.state == ev.NODE_STATE_EVICTED
    }


Membership = tuple[int, bool, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def membership(summary: rpb.RoundSummary) -> Membership:
    """What a RendezvousRound event records: round, closed, participants, waiting, spares."""
    return (
        summary.round,
        summary.closed,
        tuple(summary.participants),
        tuple(summary.waiting),
        tuple(summary.spares),
    )


def round_event(
    run_id: str,
    summary: rpb.RoundSummary,
    recorded: Membership | None,
    name: Callable[[str], str],
) -> ev.Event | None:
    """The RendezvousRound event a state write deserves, or None.

    A completed round is recorded, and again whenever its membership changes (a node
    queues to join, a hot spare arrives, a dead participant is dropped); the close once.
    Keep-alive writes change none of it and record nothing.

    Args:
        run_id: the run.
        summary: what the written state says.
        recorded: `membership()` of the last event recorded for this run, if any.
        name: renders a node descriptor (adds the unbroken node id where known).
    """
    if not (summary.complete or summary.closed):
        return None
    if recorded is not None and (recorded == membership(summary) or recorded[1]):
        return None
    return ev.Event(
        cause="rendezvous",
        rendezvous_round=ev.RendezvousRound(
            run_id=run_id,
            round=summary.round,
            closed=summary.closed,
            participants=[name(d) for d in summary.participants],
            waiting=[name(d) for d in summary.waiting],
            spares=[name(d) for d in summary.spares],
        ),
    )


def stale_store_prefixes(run_id: str, first: int, current: int, keep: int = 64) -> list[str]:
    """Store key prefixes of the rounds before `current` that may still hold keys.

    torch's handler prefixes every store key of round r with `torch.rendezvous.<run>.<r>/`;
    once round `current` completed, every participant has moved on and rounds `first`
    .. `current - 1` are garbage. At most `keep` of them are returned (a new leader does
    not know `first` and starts from `current - keep`).
    """
    return [f"torch.rendezvous.{run_id}.{r}/" for r in range(max(first, current - keep), current)]


class QuotaError(Exception):
    """A write would take a run or the job past a rendezvous quota (RESOURCE_EXHAUSTED)."""


class PrincipalUsage:
    """Runs begun and bytes written, per principal ("" is nobody: not counted)."""

    def __init__(self) -> None:
        self._runs: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def runs(self, who: str) -> int:
        return self._runs.get(who, 0)

    def bytes(self, who: str) -> int:
        return self._bytes.get(who, 0)

    def add(self, who: str, *, runs: int = 0, nbytes: int = 0) -> None:
        if not who:
            return
        for table, delta in ((self._runs, runs), (self._bytes, nbytes)):
            if delta:
                left = table.get(who, 0) + delta
                if left > 0:
                    table[who] = left
                else:
                    table.pop(who, None)


class Quota:
    """What the job's rendezvous keys use, per run: full etcd key -> bytes (key + value).

    Pure bookkeeping; the service loads it from the store once per term (`load`) and
    reports every write (`charge`) and removal (`forget`). A charge is made before the write
    is sent, so concurrent writes can never overshoot together; a write that then fails
    leaves an overcount until the next term, which errs on the safe side.
    """

    def __init__(self, config: RendezvousConfig, base: bytes) -> None:
        self.config = config
        self.base = base  # /unbroken/<job>/rdzv/
        self.runs: dict[str, dict[bytes, int]] = {}
        # per principal (in memory: what a term's store held before it is nobody's)
        self.began: dict[str, str] = {}  # run -> the principal whose write began it
        self.wrote: dict[bytes, str] = {}  # key -> the principal that last wrote it
        self.usage = PrincipalUsage()

    def load(self, sizes: dict[bytes, int]) -> None:
        self.runs.clear()
        self.began.clear()
        self.wrote.clear()
        self.usage = PrincipalUsage()
        for key, size in sizes.items():
            run = key[len(self.base) :].split(b"/", 1)[0].decode(errors="replace")
            self.runs.setdefault(run, {})[key] = len(key) + size

    def total(self) -> int:
        return sum(sum(r.values()) for r in self.runs.values())

    def charge(self, run_id: str, key: bytes, value_len: int, who: str = "") -> None:
        """Account for `who` (a principal; "": nobody's) writing `value_len` bytes at `key`.

        Raises:
            QuotaError: naming the limit the write would pass (nothing is charged then).
        """
        c = self.config
        run = self.runs.get(run_id, {})
        if who and not run and self.usage.runs(who) >= c.max_runs_per_principal:
            raise QuotaError(
                f"{who} began {self.usage.runs(who)} rendezvous runs of this job, the most "
                f"one principal may (max_runs_per_principal={c.max_runs_per_principal}); "
                "delete its finished runs (etcdctl del --prefix <job>/rdzv/<run>/)"
            )
        if not run and len(self.runs) >= c.max_runs:
            raise QuotaError(
                f"job has {len(self.runs)} rendezvous runs, the most it keeps (max_runs="
                f"{c.max_runs}); delete finished runs (etcdctl del --prefix <job>/rdzv/<run>/)"
            )
        new, old = len(key) + value_len, run.get(key, 0)
        if key not in run and len(run) >= c.max_keys_per_run:
            raise QuotaError(
                f"run {run_id!r} holds {len(run)} store keys, the most a run keeps "
                f"(max_keys_per_run={c.max_keys_per_run})"
            )
        if sum(run.values()) - old + new > c.max_run_bytes:
            raise QuotaError(
                f"run {run_id!r} would hold more than {c.max_run_bytes} bytes of rendezvous "
                "keys and values (max_run_bytes)"
            )
        if self.total() - old + new > c.max_job_bytes:
            raise QuotaError(
                f"the job's rendezvous would hold more than {c.max_job_bytes} bytes (max_job_bytes)"
            )
        mine = old if self.wrote.get(key, "") == who else 0
        if who and self.usage.bytes(who) - mine + new > c.max_principal_bytes:
            raise QuotaError(
                f"{who} would hold more than {c.max_principal_bytes} bytes of this job's "
                "rendezvous keys and values (max_principal_bytes)"
            )
        if not run:
            self.began[run_id] = who
            self.usage.add(who, runs=1)
        self.usage.add(self.wrote.get(key, ""), nbytes=-old)
        self.usage.add(who, nbytes=new)
        self.wrote[key] = who
        self.runs.setdefault(run_id, {})[key] = new

    def forget(self, run_id: str, key: bytes, *, prefix: bool = False) -> None:
        """A key (or every key under a prefix) of `run_id` is gone."""
        run = self.runs.get(run_id)
        if run is None:
            return
        for k in [k for k in run if (k.startswith(key) if prefix else k == key)]:
            self.usage.add(self.wrote.pop(k, ""), nbytes=-run.pop(k))
        if not run:
            del self.runs[run_id]
            self.usage.add(self.began.pop(run_id, ""), runs=-1)


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
                await asyncio.wait_for(work, self.config.etcd_timeout_s * 2)
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
                await asyncio.wait_for(changed.wait(), min(left, 1.0))

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
