"""A start of the workers that a newer decision overtook sends nothing more, and one whose
workers already run it is adopted (`driver.loop.RecoveryLoop._start_workers`).

Seen after a driver failover in the recovery bench: the new leader's replayed recovery waited
for a node's session; when the node registered it opened an incident of its own, and both
decisions' `restore_point` + `start_workers` went out ~40 ms apart, so the workers the stale
one started (in warm standbys) were killed and started again cold. Here the loop runs with a
fake service whose first command stands for the newer decision arriving.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from unbroken.driver import fanout, machine
from unbroken.driver.fanout import Fanout
from unbroken.driver.liveview import LiveView, LiveViewConfig, NodeSlot
from unbroken.driver.loop import RecoveryLoop
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit


class FakeService:
    """Sessions for `nodes`; `request` records each command; `on_first` runs at the first."""

    def __init__(self, loop: RecoveryLoop, nodes: tuple[str, ...], bump_at: int | None) -> None:
        self.loop = loop
        self.sent: list[tuple[str, str]] = []
        self.bump_at = bump_at
        self.view = LiveView(LiveViewConfig())
        for n in nodes:
            slot = NodeSlot(n)
            slot.alive, slot.outbox, slot.peer_host = True, object(), "127.0.0.1"
            slot.heartbeats = 1  # heard: its heartbeat (empty: no worker runs) is current
            self.view.nodes[n] = slot
        self.commits = SimpleNamespace(shard_bytes=0)
        self.submitted: list[Any] = []
        self.start_ids: list[str] = []

    def persist_every_s(self) -> float:
        return 0.0

    def submit(self, event: Any) -> None:
        self.submitted.append(event)

    def send(self, node: str, msg: dpb.DriverMessage) -> str:
        self.sent.append((node, str(msg.WhichOneof("kind"))))
        self.start_ids.append(msg.start_workers.start_id)
        if self.bump_at is not None and len(self.sent) == self.bump_at:
            self.loop._gen += 1  # a newer decision is performed meanwhile
        return str(len(self.sent))

    def ask(self, node: str, msg: dpb.DriverMessage, timeout_s: float) -> asyncio.Future[Any]:
        self.sent.append((node, str(msg.WhichOneof("kind"))))
        self.start_ids.append(msg.start_workers.start_id)
        if self.bump_at is not None and len(self.sent) == self.bump_at:
            self.loop._gen += 1  # a newer decision is performed meanwhile
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(SimpleNamespace(ack=dpb.CommandAck(ok=True)))
        return fut


def _loop(bump_at: int | None) -> tuple[RecoveryLoop, FakeService]:
    nodes = ("a", "b")
    loop = RecoveryLoop.__new__(RecoveryLoop)  # no journal, no service tasks: the one method
    loop.config = SimpleNamespace(
        restore_timeout_s=0.3, master_addr="127.0.0.1", command_timeout_s=1.0, worker_cmd="w"
    )
    loop._gen = 1
    loop._point = dpb.RestorePoint()
    loop._timeline = 0
    loop._buddy = {}
    loop.journal = SimpleNamespace(
        deciding_state=SimpleNamespace(
            incident_world=SimpleNamespace(node_ids=list(nodes)), nodes={}, sitting_out=[]
        )
    )
    svc = FakeService(loop, nodes, bump_at)
    loop.service = svc  # type: ignore[assignment]
    loop.view = svc.view  # type: ignore[assignment]
    loop.fanout = Fanout(svc, svc.view, 1.0)  # type: ignore[arg-type]
    return loop, svc


def _start(loop: RecoveryLoop) -> None:
    world = machine.Layout(dp=2, pp=1, tp=1, node_ids=("a", "b"), workers_per_node=1)
    start = machine.StartWorkers(world=world, rank_base=(("a", 0), ("b", 1)))
    restore = machine.Restore(step=5, sources=(), reshard=False, incident_id="i1", attempt=1)
    asyncio.run(loop._start_workers(1, start, restore))


def test_a_start_no_newer_decision_overtook_reaches_every_node() -> None:
    loop, svc = _loop(bump_at=None)
    _start(loop)
    assert sorted(svc.sent) == [
        ("a", "restore_point"),
        ("a", "start_workers"),
        ("b", "restore_point"),
        ("b", "start_workers"),
    ]


def test_a_newer_decision_stops_the_start_at_the_next_turn_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each node's point and start go together, and the loop turns every YIELD_EVERY nodes
    # (here 1): a newer decision landing with the first node's commands stops the rest
    monkeypatch.setattr(fanout, "YIELD_EVERY", 1)
    loop, svc = _loop(bump_at=1)
    _start(loop)
    assert svc.sent == [("a", "restore_point"), ("a", "start_workers")]
    assert svc.submitted == []  # and no RestoreFinished for the stale restore


def test_a_decision_newer_before_the_start_sends_nothing() -> None:
    loop, svc = _loop(bump_at=None)
    loop._gen = 2  # the start's decision (1) was overtaken while it waited its turn
    _start(loop)
    assert svc.sent == []


def test_each_node_gets_its_restore_point_before_its_start() -> None:
    # the agent applies its commands in the order they come: the point must come first
    loop, svc = _loop(bump_at=None)
    _start(loop)
    for n in ("a", "b"):
        kinds = [k for m, k in svc.sent if m == n]
        assert kinds == ["restore_point", "start_workers"]


def _running(svc: FakeService, node: str, start_id: str, state: int) -> None:
    hb = dpb.Heartbeat(start_id=start_id)
    hb.workers.add(local_rank=0, global_rank=0, state=state, step=9)  # type: ignore[arg-type]
    svc.view.nodes[node].hb = hb


def test_a_start_whose_workers_already_run_it_is_adopted() -> None:
    # a new leader took over a restore its predecessor started: the ranks run it, keep them
    loop, svc = _loop(bump_at=None)
    for n in ("a", "b"):
        _running(svc, n, "i1/1", dpb.WORKER_STATE_RUNNING)
    _start(loop)
    assert svc.sent == []
    assert loop._started is not None and loop._started.nodes == ("a", "b")


@pytest.mark.parametrize(
    "b", [("i1/0", dpb.WORKER_STATE_RUNNING), ("i1/1", dpb.WORKER_STATE_EXITED), ("", 0)]
)
def test_a_start_not_every_node_runs_goes_out_with_its_id(b: tuple[str, int]) -> None:
    # an older start, a rank that exited, a node whose workers were stopped: start them all
    loop, svc = _loop(bump_at=None)
    _running(svc, "a", "i1/1", dpb.WORKER_STATE_RUNNING)
    _running(svc, "b", *b)
    _start(loop)
    assert [kind for _, kind in svc.sent].count("start_workers") == 2
    assert [i for i in svc.start_ids if i] == ["i1/1", "i1/1"]
