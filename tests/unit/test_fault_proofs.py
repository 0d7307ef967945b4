"""The one table of which event proves which fault (unbroken.cli.faults) covers every user."""

from __future__ import annotations

import pytest

from unbroken.cli.drill import DRILL
from unbroken.cli.faults import ALIASES, PROOF, proof, proves
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

BENCH_KINDS = (
    "worker_crash",
    "node_loss",
    "hang",
    "loss_spike",
    "silently_bad_node",
    "driver_kill",
)
CHAOS_KINDS = ("worker_kill", "agent_kill", "agent_stop", "driver_kill", "driver_kill_recovery",
               "etcd_kill", "net_cut")  # fmt: skip


@pytest.mark.parametrize("kind", sorted({*DRILL, *BENCH_KINDS, *CHAOS_KINDS}))
def test_every_fault_the_drill_bench_and_chaos_inject_has_an_entry(kind: str) -> None:
    assert ALIASES.get(kind, kind) in PROOF
    proof(kind)  # no KeyError


def test_every_alias_names_an_entry() -> None:
    assert set(ALIASES.values()) <= set(PROOF)


def test_a_node_fault_is_proven_only_on_its_node() -> None:
    lost = ev.Event(seq=3, node_lost=ev.NodeLost(node_id="n1"))
    assert proves(lost, "node_loss", "n1")
    assert proves(lost, "agent_kill", "n1")
    assert not proves(lost, "agent_kill", "n0")
    assert not proves(lost, "worker_kill", "n1")  # another fault's event


def test_a_self_check_proves_a_bad_node_only_when_it_failed() -> None:
    ok = ev.Event(self_check_reported=ev.SelfCheckReported(node_id="n0", ok=True))
    bad = ev.Event(self_check_reported=ev.SelfCheckReported(node_id="n0", ok=False))
    assert proves(bad, "bad_node", "n0") and not proves(ok, "bad_node", "n0")


def test_any_new_term_proves_a_driver_kill_and_nothing_proves_an_etcd_kill() -> None:
    elected = ev.Event(leader_elected=ev.LeaderElected(driver_id="whoever"))
    assert proves(elected, "driver_kill") and proves(elected, "driver_kill_mid_recovery")
    assert proof("etcd_kill") is None and not proves(elected, "etcd_kill")
