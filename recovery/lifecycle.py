"""The checkpoint lifecycle's decisions, pure: how often to persist, what storage keeps.

    step -> ring (k copies per rank in the agent's shared memory, every step)
         -> buddy (the newest copy, replicated to the next node)
         -> storage (one copy per interval T, every rank's shard of the same step)
         -> commit (CheckpointCommitted once every rank's shard is verified)

**The interval.** Persisting costs the node I/O and a pinned ring slot; not persisting
risks redoing the work since the last persisted step when memory and the buddy are both
lost. Young's first-order optimum (Daly's refinement changes it little while the cost is
far below the MTBF) is T = sqrt(2 * C * MTBF), with C the cost of one persisted save and
MTBF the mean time between the failures the save is for. C is measured: the agents report
how long each shard took to write and verify, and a commit's cost is its slowest node's
time for all its ranks' shards (one persister thread per node), folded from the log so
every leader computes the same T (`JobState.persist_cost_s`). Storage is the second level of a
multi-level scheme (as in SCR, Moody et al. 2010, and Gemini, Wang et al. 2023): a crash,
a hang, a loss spike or one lost node is restored from the rings and the buddies, and
only a failure they cannot serve (a node and its buddy lost together, a corrupt ring)
reads storage and loses the work since the last persisted step. So the MTBF is that of
the storage-served failures, estimated from the log (the incidents whose restore read
storage, `GoodputLedger.storage_incidents`, over the job's wall time) with a prior of one
per `prior_mtbf_s`, so a young job does not persist once a week. Counting every failure
instead held a job that faults every few minutes at the floor, persisting and committing
far more often than its storage-served failures justify. A floor and a ceiling bound T.

**Retention.** Decided in one place (the driver) from the log: storage keeps the newest
`keep` committed steps, the step a loss-spike rollback returns to, and the step a restore
in progress reads; everything older than the newest commit and not kept may go; nothing at
or above the newest commit is touched (it is in flight).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PRIOR_MTBF_S = 24 * 3600.0  # one failure a day: the belief before the log has any
FLOOR_S = 30.0
CEILING_S = 1800.0


@dataclass(frozen=True, slots=True)
class PersistPolicy:
    """The bounds of the persistence interval (driver flags `--persist-*`)."""

    floor_s: float = field(
        default=FLOOR_S,
        metadata={
            "help": "shortest persistence interval the driver sends workers (Young/Daly: "
            "sqrt(2 x persist cost x MTBF))"
        },
    )
    ceiling_s: float = field(default=CEILING_S, metadata={"help": "longest persistence interval"})
    prior_mtbf_s: float = field(
        default=PRIOR_MTBF_S,
        metadata={
            "flag": "--mtbf-prior-s",
            "help": "the MTBF believed before the log has seen failures (one interval of it is "
            "added to the job's wall time, one failure to its count)",
        },
    )

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(
                f"persist interval floor ({self.floor_s} s) must be > 0 and <= the ceiling "
                f"({self.ceiling_s} s)"
            )
        if not self.prior_mtbf_s > 0:
            raise ValueError(f"prior MTBF must be > 0 s, got {self.prior_mtbf_s}")


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 * C * MTBF) (seconds)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need cost >= 0 and MTBF > 0, got {cost_s} and {mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def mtbf_estimate_s(wall_s: float, failures: int, prior_s: float = PRIOR_MTBF_S) -> float:
    """The job's MTBF: (wall time + one prior interval) over (failures + 1)."""
    return (max(0.0, wall_s) + prior_s) / (max(0, failures) + 1)


def persist_interval_s(
    cost_s: float, wall_s: float, failures: int, policy: PersistPolicy = PersistPolicy()
) -> float:
    """How often to persist after `failures` storage-served failures in `wall_s`, bounded
    by the policy's floor and ceiling."""
    mtbf = mtbf_estimate_s(wall_s, failures, policy.prior_mtbf_s)
    return persist_interval_at_s(cost_s, mtbf, policy)


def persist_interval_at_s(
    cost_s: float, mtbf_s: float, policy: PersistPolicy = PersistPolicy()
) -> float:
    """Young/Daly at a known MTBF, bounded by the policy's floor and ceiling."""
    t = young_daly_s(max(0.0, cost_s), mtbf_s)
    return min(policy.ceiling_s, max(policy.floor_s, t))


STEADY_RATIO = 1.3  # an agreed persistence interval in steps moves only past this ratio


def persist_steps(current: int, wanted: int) -> int:
    """The persistence interval in steps: `wanted` rounded down to four values an octave
    (so ranks and restarts with about the same step time pick the same one), kept at
    `current` while within `STEADY_RATIO` of it.

    Workers persist the steps that are multiples of the interval (every rank marks the same
    steps without talking). An interval re-derived from each re-measured step time (338,
    375, 346 steps in a row) hits few multiples: a drill persisted nothing in 685 steps at
    T = 88 s, about 270 steps."""
    n = max(1, int(wanted))
    if n >= 8:
        shift = n.bit_length() - 3
        n = (n >> shift) << shift
    if current > 0 and current / STEADY_RATIO <= n <= current * STEADY_RATIO:
        return current
    return n


def retained(committed: Iterable[int], keep: int, protect: Iterable[int] = ()) -> set[int]:
    """The persisted steps storage keeps: the newest `keep` committed ones and `protect`
    (the rollback target, the step a restore in progress reads)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    newest = sorted(set(committed))[-keep:]
    return set(newest) | {int(s) for s in protect if s is not None and s >= 0}


def deletable(persisted: Iterable[int], keep_steps: Iterable[int], below: int) -> list[int]:
    """The persisted steps that may be deleted: under `below` (the newest commit) and not
    kept. Steps at or above `below` are in flight and never deleted."""
    keep = set(keep_steps)
    return sorted(s for s in set(persisted) if s < below and s not in keep)
