"""The torchrun rendezvous's pure core: its limits, keys, decisions and quotas.

What the Rendezvous service (driver/rendezvous.py, its RPC surface) decides without I/O:
the etcd keys of a run, whether a caller is well-formed, TCPStore's add and compare_set,
which nodes are evicted, which state writes deserve a RendezvousRound event, which store
prefixes earlier rounds left behind, and the quota bookkeeping (per run, per job, per
principal) that refuses a write before it reaches etcd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unbroken.driver.detectors import node_id_problem
from unbroken.driver.etcdclient import Keys
from unbroken.proto import events_pb2 as ev
from unbroken.proto import rendezvous_pb2 as rpb


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
