"""The drill's bookkeeping: it waits for a warm spare before a fault whose ranks go to an
idle node, and a straggler's note says how soon after its naming training resumed.

`Drill._spare_warm` reads the leader's live view (which nodes are idle, how many workers a
world node runs) and the idle agents' own logs (`standby ready` since their last start or
hand-off). The logs here are real files in a run directory, written as agents write them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from unbroken.cli.drill import WARM_SPARE_LIMIT_S, Drill, ready_standbys
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit


class _Run:
    """The two things `_spare_warm` asks of the cluster and the watch."""

    def __init__(self, run: Path, nodes: list[dpb.NodeLive]) -> None:
        self.run = run
        self.nodes = nodes

    def log(self, name: str) -> str:
        p = self.run / f"{name}.log"
        return p.read_text() if p.exists() else ""


def _node(node_id: str, workers: int) -> dpb.NodeLive:
    ranks = [dpb.WorkerStatus(local_rank=i) for i in range(workers)]
    return dpb.NodeLive(node_id=node_id, alive=True, workers=ranks)


def _drill(run: _Run) -> Any:
    d = Drill.__new__(Drill)
    d.c, d.w = run, run
    d._warm_since, d._warm_wait_s = None, 0.0
    return d


def _warm(*pids: int) -> str:
    out = "flash.ready\n" + "".join(f"standby started pid={p}\n" for p in pids)
    return out + "".join(f"standby ready pid={p} import_s=4.1\n" for p in pids)


def test_ready_standbys_follow_the_agent_s_own_log() -> None:
    """Ready since the agent's last start, less those handed off or discarded since."""
    log = _warm(1, 2)
    assert ready_standbys(log) == 2
    log += "worker started local_rank=1 pid=2 restarts=1 warm=True\nstandby started pid=3\n"
    assert ready_standbys(log) == 1  # pid 1 still waits; pid 3 imports
    log += "standby ready pid=3 import_s=5.0\nstandby discarded pid=1 reason=env\n"
    assert ready_standbys(log) == 1
    assert ready_standbys(log + "flash.ready\nregistered\n") == 0  # a new life


def test_a_fault_waits_for_every_alive_node_to_hold_its_standbys(tmp_path: Path) -> None:
    """A world node replaces a crashed rank from its own standbys, and the driver may take
    any idle node, a node back from a loss before the spares (driver/worldplan.py
    `_pool`): the 19:22 drill's bad node went to the returned node-1, cold (4.4 s), while
    spare-0 waited warm."""
    nodes = [_node("node-0", 2), _node("spare-1", 2), _node("spare-0", 0), _node("node-1", 0)]
    for i, n in enumerate(("node-0", "spare-1", "spare-0")):
        (tmp_path / f"{n}.log").write_text(_warm(100 * i + 1, 100 * i + 2))
    # node-1 back from its loss, its standbys not started yet (12 s after its agent)
    (tmp_path / "node-1.log").write_text(_warm(7, 8) + "flash.ready\nregistered\n")
    d = _drill(_Run(tmp_path, nodes))
    assert not d._spare_warm(100.0)
    (tmp_path / "node-1.log").write_text(_warm(11))
    assert not d._spare_warm(101.0)
    (tmp_path / "node-1.log").write_text(_warm(11, 12))
    assert d._spare_warm(102.5) and d._warm_wait_s == pytest.approx(2.5)


def test_the_wait_is_bounded_and_nothing_is_awaited_without_standbys(tmp_path: Path) -> None:
    run = _Run(tmp_path, [_node("node-0", 1), _node("spare-0", 0)])
    (tmp_path / "node-0.log").write_text(_warm(1))
    (tmp_path / "spare-0.log").write_text("flash.ready\nstandby started pid=2\n")
    d = _drill(run)
    assert not d._spare_warm(10.0)
    assert d._spare_warm(10.0 + WARM_SPARE_LIMIT_S + 0.1)  # then to cold processes
    # --no-warm-workers: no agent starts standbys, nothing to wait for
    (tmp_path / "node-0.log").write_text("flash.ready\nworker started pid=5\n")
    (tmp_path / "spare-0.log").write_text("flash.ready\nregistered\n")
    assert _drill(run)._spare_warm(0.0)


def test_a_stragglers_note_says_how_soon_after_its_naming_training_resumed() -> None:
    """A straggler never stops the job: its row's "resumed in" counts from the slowdown,
    and its note gives the resume after the naming (the eviction's own cost)."""
    from unbroken.cli.drill import FaultRecord
    from unbroken.proto import events_pb2 as ev

    t0 = 1_000_000_000_000
    f = FaultRecord(
        fault="straggler (node 20% slower)", target="n1", injected_at=0.0,
        expect="straggler_suspected", kind="straggler", node="n1", recovers=True,
        injected_wall_ns=t0, seq_at_inject=10, note="named by the straggler sweep",
    )  # fmt: skip
    d = Drill.__new__(Drill)
    d.faults = [f]
    named = ev.Event(
        seq=11, wall_time_unix_ns=t0 + 12_500_000_000,
        straggler_suspected=ev.StragglerSuspected(node_id="n1", slowdown=1.2),
    )  # fmt: skip
    resumed = ev.Event(
        seq=19, wall_time_unix_ns=t0 + 13_750_000_000,
        training_resumed=ev.TrainingResumed(at_step=500, mode="in_job"),
    )  # fmt: skip
    d.observe([named, resumed], now=0.0)
    assert f.detected_s == pytest.approx(12.5) and f.resumed_s == pytest.approx(13.75)
    assert f.note.endswith(
        "; resumed 1.25 s after it was named (the job trained on, slower, until then)"
    )
