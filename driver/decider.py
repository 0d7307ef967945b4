"""The decider seam: what the journal records for an observation, and what is done after.

The journal (driver/journal.py) is given one `Decider` when a term builds it
(driver/term.py) and asks it about every queued observation:
`decide(state, observation) -> Decision(events, actions, after)`. `state` is the folded job
state with the decisions taken earlier in the same transaction; the decider never awaits
and never writes. `events` are recorded in order, in one transaction with the rest of the
batch; once they are durable the journal calls `after`, which performs `actions` (the
commands the shell sends to agents).

Two deciders exist:

- the job's recovery (driver/loop.py `RecoveryLoop`, around the pure machine of
  driver/machine.py), when the driver starts and recovers the job (`--nodes`);
- `RecordOnly`, when a launcher runs the job (torchrun, Kubernetes, Slurm): observations
  are recorded as they are, and an operator's eviction evicts the node at once.

Every caller takes one path in both modes (an operator's `Evict` is an observation); only
what the decider answers differs. `Decider.recovers` says which it is, for the answers
that name it (EvictResponse.recovering, a refused Resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

EVICT = "evict"  # OperatorAction.action of an eviction
OPERATOR = "operator"  # Event.cause of what an operator asked


@dataclass(frozen=True, slots=True)
class Decision:
    """What to record for one observation, and what to do once it is durable."""

    events: list[ev.Event]  # recorded in order (the observation itself first, if an event)
    actions: tuple[Any, ...] = ()  # the commands the shell sends (driver/machine.py Action)
    after: Callable[[], None] | None = None  # performs `actions` (None: nothing to do)


class Decider(Protocol):
    """What the journal asks about every observation (see the module docstring)."""

    @property
    def recovers(self) -> bool:
        """Whether this decider runs the job's recovery (False: a launcher does)."""
        ...

    def decide(self, state: ev.JobState, observation: Any) -> Decision: ...


class RecordOnly:
    """Launcher mode: every event is recorded as it is; an operator's eviction also records
    the NodeEvicted (the node is out at once: its launcher replaces it). Anything that is
    not an event (a recovery loop's progress report) has nobody to act on it: dropped."""

    recovers = False

    def decide(self, state: ev.JobState, observation: Any) -> Decision:
        if not isinstance(observation, ev.Event):
            log.warning("no recovery loop for an observation; ignored", kind=type(observation))
            return Decision([])
        if observation.WhichOneof("payload") == "operator_action":
            op = observation.operator_action
            # an operator's own (a cluster scheduler's drain is recorded as it is: the
            # scheduler took the node out already)
            if op.action == EVICT and observation.cause == OPERATOR:
                evicted = ev.Event(
                    cause=observation.event_id,
                    node_evicted=ev.NodeEvicted(node_id=op.target, reason=op.reason or "operator"),
                )
                return Decision([observation, evicted])
        return Decision([observation])
