"""Property tests of the recovery machine: any sequence of observations, any small cluster.

For every sequence (faults, progress reports, returning nodes, late spares, checkpoints,
loss spikes, operator actions, in any order), `Sim` checks after each decision that
(1) every event folds and the phase is the one `decide` intended, (2) a replay of the
log gives the same state and pending actions, and a crash after any prefix of a decision
carries on to the same phase and actions, (3) the world holds no lost or evicted node
once reshaped, dp x pp x tp equals its worker count, and it stays within min/max nodes.
Then (4) liveness: after the last fault, with every progress report arriving, the job
is RUNNING again unless no layout could be built (then it FAILED, checked by brute force).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.machine_harness import (
    Sim,
    alert,
    checkpoint,
    crash,
    feasible,
    hang,
    job,
    lost,
    operator,
    register,
    restored,
    selfcheck,
    spike,
    wrong_matmul,
)
from unbroken.driver import machine as m
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.spike import SpikeConfig

pytestmark = pytest.mark.unit

LAYOUTS = [  # (nodes, workers per node, pp, tp)
    (2, 1, 1, 1),
    (3, 1, 1, 1),
    (4, 1, 2, 1),
    (4, 2, 1, 1),
    (2, 2, 2, 2),
    (3, 2, 1, 2),
]
NODE_IDS = [f"n{i}" for i in range(4)] + ["s0", "s1", "x0", "x1"]
FAULT_OPS = ["lost", "crash", "hang", "alert", "selfcheck", "matmul", "evict"]
OPS = [*FAULT_OPS, "diagnose", "spike", "register", "spare", "ckpt", "progress", "bad_restore"]

op = st.tuples(st.sampled_from(OPS), st.sampled_from(NODE_IDS), st.booleans())


def apply_op(sim: Sim, kind: str, node: str, flag: bool, bad: set[str], epochs: dict) -> None:  # type: ignore[type-arg]
    """Turn a drawn operation into an observation (or a progress answer) and feed it."""
    faults = {
        "lost": lambda: lost(node, epochs.get(node, 1)),
        "crash": lambda: crash(node),
        "hang": lambda: hang(node),
        "alert": lambda: alert(node),
        "selfcheck": lambda: selfcheck(node),
        "matmul": lambda: wrong_matmul(node),  # a definitive self-check: evicted at once
        "evict": lambda: operator("evict", node),
    }
    if kind in faults:
        if flag and kind != "evict":
            bad.add(node)
        sim.feed(faults[kind]())
    elif kind == "diagnose":
        sim.feed(operator("diagnose", node if flag else ""))
    elif kind == "spike":
        sim.feed(spike(sim.training_step, non_finite=flag))
    elif kind in ("register", "spare"):
        epochs[node] = epochs.get(node, 1) + 1
        bad.discard(node)
        wpn = sim.state.world.workers_per_node
        sim.feed(register(node, epochs[node], wpn, spare=kind == "spare"))
    elif kind == "ckpt":
        sim.training_step += 3
        sim.feed(checkpoint(sim.training_step))
    elif kind == "bad_restore":
        sim.feed(restored(sim.state.restore_step, ok=False))
    else:
        sim.progress(bad, restorable=sim.training_step if flag else None)


@settings(max_examples=300, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    spares=st.integers(0, 2),
    min_nodes=st.integers(1, 3),
    shrink_first=st.booleans(),
    ops=st.lists(op, max_size=25),
)
def test_any_sequence_keeps_the_invariants_and_recovers(
    layout: tuple[int, int, int, int],
    spares: int,
    min_nodes: int,
    shrink_first: bool,
    ops: list[tuple[str, str, bool]],
) -> None:
    nodes, wpn, pp, tp = layout
    policy = m.Policy(
        min_nodes=min(min_nodes, nodes),
        max_nodes=8,
        reshape=m.Reshape.SHRINK_FIRST if shrink_first else m.Reshape.SPARES_FIRST,
        max_restore_attempts=1000,  # liveness is about faults, not the retry limit
        spike=SpikeConfig(max_rollbacks=1000),
    )
    sim = Sim(policy)
    sim.append(job(nodes=nodes, wpn=wpn, pp=pp, tp=tp, spares=spares))
    sim.append([checkpoint(0)])
    bad: set[str] = set()
    epochs: dict[str, int] = {}
    for kind, node, flag in ops:
        apply_op(sim, kind, node, flag, bad, epochs)
    sim.drive(bad)
    end = sim.state
    if end.phase == ev.PHASE_FAILED:
        assert sim.failed_state is not None
        reason = next(e for e in sim.log if e.WhichOneof("payload") == "job_finished")
        assert reason.job_finished.reason
        if "min_nodes" in reason.job_finished.reason:
            assert not feasible(sim.failed_state, policy)
    else:
        assert end.phase == ev.PHASE_RUNNING
        assert feasible(end, policy)
        for n in end.world.node_ids:
            assert end.nodes[n].state == ev.NODE_STATE_ACTIVE
