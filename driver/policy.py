"""The recovery policy: how the machine (driver/machine.py) recovers, as flags.

`Policy` is the machine's only input beside the state and the observation: the world's
limits, what replaces a removed node (`Reshape`), which faults are diagnosed first, which
self-check failures evict at once, the recovery mode, the loss-spike policy. Every field is
a flag of `unbroken driver` (common/config.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from unbroken.diagnostics import selfcheck as selfchecklib
from unbroken.driver.eventkinds import DIAGNOSABLE
from unbroken.recovery import spike as spikelib

#: Recovery modes (RecoveryTransition.mode, TrainingResumed.mode). In-job: every healthy
#: worker keeps its process (imports, model, data pipeline), leaves its step, drops its
#: process groups and rejoins the new world in place; only the faulty ranks' processes (and
#: a lost or evicted node's) are replaced. Restart: every worker process is replaced.
IN_JOB, RESTART = "in_job", "restart"


class Reshape(enum.Enum):
    """What replaces a removed node."""

    SPARES_FIRST = "spares"  # a spare in its place (same world); shrink dp only when short
    SHRINK_FIRST = "shrink"  # shrink dp; spares only to stay at or above min_nodes


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """How the machine recovers. The limits are the job's (JobStarted carries the same)."""

    min_nodes: int = field(
        default=1,
        metadata={"help": "fail below this many nodes (after --await-nodes-s)"},
    )
    # Below min_nodes the reshape waits for nodes before the job fails: lost nodes that come
    # back (a host stall, a network partition, a rebooted machine) or new ones that join, as
    # a launcher's rendezvous waits for its minimum. A job failed on the spot is only
    # resumed by hand (a CI host stalled all three nodes of a chaos job 3-4 s at once: each
    # was declared lost, the job FAILED, and the three came back a moment later).
    await_nodes_s: float = field(
        default=300.0,
        metadata={
            "help": "below --min-nodes, wait this long for lost nodes to come back or new "
            "nodes or spares to join before the job fails (0: fail at once)"
        },
    )
    max_nodes: int = field(
        default=0,
        metadata={
            "help": "grow to at most this many nodes (0: the configured world's; the world "
            "never grows past its configured dp)"
        },
    )
    reshape: Reshape = field(
        default=Reshape.SPARES_FIRST,
        metadata={
            "parse": Reshape,
            "metavar": "{spares,shrink}",
            "help": "what replaces a removed node: a spare (shrink dp only when short), or "
            "shrink dp (spares only to stay at or above --min-nodes)",
        },
    )
    # Faults whose cause is unclear: the suspects are diagnosed (bisection) before
    # reshaping. A clean worker crash needs none; a lost node needs none (it is gone). A
    # NaN loss reaches the machine as the detectors' "non-finite loss" log alert on a node.
    diagnose_kinds: frozenset[str] = field(
        default=frozenset({"hang_suspected", "log_alert", "self_check_reported"}),
        metadata={
            "parse": lambda text: frozenset(x.strip() for x in text.split(",") if x.strip()),
            "help": "comma-separated fault kinds whose suspects are diagnosed (bisection) "
            "before reshaping",
        },
    )
    # Self-check items whose failure is the node's own proof (its device computed a wrong
    # exact checksum; its uncorrected ECC counter): it is evicted at once, without the
    # diagnosis that could only confirm it. Other failures, and a check that crashed
    # instead of reporting, follow `diagnose_kinds` ("self_check_reported").
    self_check_evicts: frozenset[str] = field(
        default=frozenset({"matmul", "ecc"}),
        metadata={
            "parse": lambda text: frozenset(x.strip() for x in text.split(",") if x.strip()),
            "help": "comma-separated self-check items (of "
            + ", ".join(sorted(selfchecklib.ITEM_NAMES))
            + ") whose failure evicts the node at once, without a diagnosis: the node's own "
            "result is the proof (a crashed check is not); other failed self-checks follow "
            "--diagnose-kinds; '' leaves every failed self-check to --diagnose-kinds",
        },
    )
    evict_slow: bool = field(
        default=True,
        metadata={
            "negate": "--no-evict-slow",
            "help": "keep the stragglers a diagnosis names (they are evicted otherwise)",
        },
    )
    grow_back: bool = field(
        default=True,
        metadata={
            "negate": "--no-grow-back",
            "help": "do not grow dp back when nodes return (it grows up to the configured world)",
        },
    )
    max_restore_attempts: int = field(
        default=3,
        metadata={
            "help": "failed restores per incident before the job fails (a restore cut short "
            "by an operator's own evict or diagnose does not count; `unbroken resume` re-arms)"
        },
    )
    spike: spikelib.SpikeConfig = field(
        default_factory=spikelib.SpikeConfig,
        metadata={"prefix": "spike-", "group": "loss-spike policy (recovery/spike.py)"},
    )
    in_job: bool = field(
        default=True,
        metadata={
            "negate": "--no-in-job",
            "help": "always restart every worker process in an incident (by default a worker "
            "that is not itself faulty keeps its process and rejoins the new world in place; "
            "a suspect fault, a diagnosis or a failed in-job restore restarts every process)",
        },
    )
    keep_training: bool = field(
        default=False,
        metadata={
            "help": "the replica policy: with dp >= 2 and a clear fault confined to one "
            "data-parallel replica (a worker killed or hung, a node lost), the other replicas "
            "train on at once with dp - 1 (the global batch kept: each takes a larger share) "
            "instead of waiting for the replica's replacement, which rejoins by a grow-back "
            "--replica-rejoin-s later (docs/in-job-recovery.md)"
        },
    )
    replica_rejoin_s: float = field(
        default=5.0,
        metadata={
            "help": "with --keep-training: how long a replica that sat out an incident waits "
            "before the grow-back that brings it in (its node's agent readies a worker "
            "meanwhile; 0: at once)"
        },
    )
    hang_diagnose_after: int = field(
        default=2,
        metadata={
            "help": "a hang whose rank's process is stopped (the culprit is known; a rank silent "
            "in its step is not enough, a peer waiting in FSDP's all-gather looks the same) "
            "restarts without a diagnosis until its node has this many faults on record "
            "within --fault-window-steps"
        },
    )
    fault_window_steps: int = field(
        default=1000,
        metadata={
            "help": "the faults on record that --hang-diagnose-after counts: those of the "
            "last this many steps (0: every fault of the node's life; then on a long run "
            "every stopped hang is diagnosed once a node has had two faults ever)"
        },
    )

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"Policy.min_nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < 0 or (self.max_nodes and self.max_nodes < self.min_nodes):
            raise ValueError(
                f"Policy.max_nodes ({self.max_nodes}) must be >= min_nodes ({self.min_nodes})"
            )
        if not isinstance(self.reshape, Reshape):
            raise ValueError(
                f"Policy.reshape must be one of {[r.value for r in Reshape]}, got {self.reshape!r}"
            )
        unknown = set(self.diagnose_kinds) - DIAGNOSABLE
        if unknown:
            raise ValueError(
                f"Policy.diagnose_kinds has unknown kinds {sorted(unknown)}; choose from "
                f"{sorted(DIAGNOSABLE)} (a lost node cannot be diagnosed: it is gone)"
            )
        unknown = set(self.self_check_evicts) - selfchecklib.ITEM_NAMES
        if unknown:
            raise ValueError(
                f"Policy.self_check_evicts has unknown self-check items {sorted(unknown)}; "
                f"choose from {sorted(selfchecklib.ITEM_NAMES)}, or none (every failed "
                "self-check then follows diagnose_kinds)"
            )
        if not 0 <= self.await_nodes_s <= 86_400:  # NaN too
            raise ValueError(
                f"Policy.await_nodes_s must be a number in [0, 86400], got {self.await_nodes_s}"
            )
        if not self.replica_rejoin_s >= 0:  # NaN too
            raise ValueError(
                f"Policy.replica_rejoin_s must be a number >= 0, got {self.replica_rejoin_s}"
            )
        if self.max_restore_attempts < 1:
            raise ValueError(
                f"Policy.max_restore_attempts must be >= 1, got {self.max_restore_attempts}"
            )
        if self.fault_window_steps < 0:
            raise ValueError(
                f"Policy.fault_window_steps must be >= 0 (0: no window), got "
                f"{self.fault_window_steps}"
            )
