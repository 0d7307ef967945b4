"""Event kinds: one table of what the driver does with each kind of event.

A row per payload of `Event` (proto/events.proto) that some part of the driver treats
specially; a kind not in the table is recorded and folded, nothing more. The columns:

- `fault`: a fault signal. Its own journal lane, served first and never dropped
  (driver/journal.py); its detection latency is measured (driver/service.py).
- `lane`: the journal lane ("faults": faults, and membership, so a node's loss never
  overtakes its own registration; "alerts": log alerts, coalesced and shed; "main").
- `observed`: the recovery machine reacts to it (driver/loop.py, driver/machine.py);
  every other kind is recorded as it is.
- `cause`: it names an incident's cause in the goodput ledger (driver/state.py).
- `diagnosable`: `Policy.diagnose_kinds` may name it (driver/machine.py).
- `stale`: from an idle node that came back after it was replaced, it is the old world's
  cleanup, not the node's health: recorded only (driver/machine.py).
- `blames`: the fold counts one failure on the node its payload names (`node_id`;
  driver/state.py), the record the diagnosis and the dashboard read.

A new fault kind is one row here, its payload in proto/events.proto, and its reaction in
driver/machine.py: three files (and the stubs `make proto` regenerates).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Kind:
    """What the driver does with one event kind (see the module docstring)."""

    fault: bool = False
    lane: str = "main"
    observed: bool = False
    cause: bool = False
    diagnosable: bool = False
    stale: bool = False
    blames: bool = False


def _fault(*, diagnosable: bool = False, stale: bool = False, blames: bool = False) -> Kind:
    """A fault: the fault lane, reacted to, an incident's cause."""
    return Kind(
        fault=True,
        lane="faults",
        observed=True,
        cause=True,
        diagnosable=diagnosable,
        stale=stale,
        blames=blames,
    )


KINDS: dict[str, Kind] = {
    "node_lost": _fault(),
    "worker_failed": _fault(diagnosable=True, stale=True, blames=True),
    "hang_suspected": _fault(diagnosable=True, stale=True, blames=True),
    "straggler_suspected": _fault(stale=True, blames=True),
    "loss_spike": _fault(),
    "sdc_suspected": _fault(),
    "self_check_reported": _fault(diagnosable=True),
    "log_alert": Kind(lane="alerts", observed=True, cause=True, diagnosable=True, blames=True),
    "node_registered": Kind(lane="faults", observed=True),
    "node_refused": Kind(lane="faults"),
    "operator_action": Kind(observed=True, cause=True),
    "diagnosis_verdict": Kind(observed=True, cause=True),
    "restore_finished": Kind(observed=True),
    "replica_ready": Kind(observed=True),
    "node_wait_expired": Kind(observed=True),
    "node_evicted": Kind(cause=True),
    "world_resized": Kind(cause=True),
}


def _where(column: str, value: object = True) -> frozenset[str]:
    return frozenset(k for k, row in KINDS.items() if getattr(row, column) == value)


#: Faults: their own lane, served first, never dropped.
FAULT_KINDS = _where("fault")
#: The fault lane: faults and membership (a node's loss never overtakes its registration).
FAULT_LANE = _where("lane", "faults")
#: The kinds the recovery machine reacts to; everything else is appended as it is.
OBSERVED = _where("observed")
#: The kinds whose event names an incident's cause in the goodput ledger.
CAUSE_KINDS = _where("cause")
#: Fault kinds that `Policy.diagnose_kinds` may name.
DIAGNOSABLE = _where("diagnosable")
#: Faults of an idle node that are its own cleanup, not its health.
STALE_KINDS = _where("stale")
#: The kinds whose node the fold counts a failure on.
BLAME_KINDS = _where("blames")
