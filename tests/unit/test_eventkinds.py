"""One table of event kinds (driver/eventkinds.py): what each column selects."""

from __future__ import annotations

import pytest

from unbroken.driver import eventkinds as k
from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

FAULTS = {
    "node_lost",
    "worker_failed",
    "hang_suspected",
    "loss_spike",
    "sdc_suspected",
    "self_check_reported",
    "straggler_suspected",
}


def test_every_row_is_a_payload_of_event() -> None:
    payloads = {f.name for f in ev.Event.DESCRIPTOR.oneofs_by_name["payload"].fields}
    assert set(k.KINDS) <= payloads, set(k.KINDS) - payloads
    assert {row.lane for row in k.KINDS.values()} <= {"faults", "main", "alerts"}


def test_the_columns_select_what_the_driver_treats_specially() -> None:
    assert k.FAULT_KINDS == FAULTS
    assert k.FAULT_LANE == FAULTS | {"node_registered", "node_refused"}
    assert k.OBSERVED == FAULTS | {
        "log_alert",
        "operator_action",
        "diagnosis_verdict",
        "restore_finished",
        "node_registered",
        "replica_ready",
        "node_wait_expired",
    }
    assert k.DIAGNOSABLE == {"worker_failed", "hang_suspected", "log_alert", "self_check_reported"}
    assert k.STALE_KINDS == {"worker_failed", "hang_suspected", "straggler_suspected"}
    assert k.CAUSE_KINDS == FAULTS | {
        "log_alert",
        "diagnosis_verdict",
        "operator_action",
        "node_evicted",
        "world_resized",
    }


def test_the_goodput_ledgers_causes_are_the_tables() -> None:
    """driver/state.py's goodput ledger reads the table's column (no copy of its own)."""
    assert statelib.CAUSE_KINDS == k.CAUSE_KINDS


@pytest.mark.parametrize("kind", sorted(k.BLAME_KINDS))
def test_a_blaming_kind_counts_one_failure_on_its_node(kind: str) -> None:
    """The fold's failure counter follows the table's `blames` column (no list of its own)."""
    assert k.BLAME_KINDS == {"worker_failed", "hang_suspected", "straggler_suspected", "log_alert"}
    s = statelib.apply(
        ev.JobState(), ev.Event(seq=1, node_registered=ev.NodeRegistered(node_id="n1"))
    )
    e = ev.Event(seq=2)
    getattr(e, kind).node_id = "n1"
    s = statelib.apply(s, e)
    assert s.nodes["n1"].failures == 1
