"""What keeps a 10,240-node job's paths small: a reconnect decides nothing (the recovery
loop records it without the decision's draft), RestoreStarted lists only the exceptions of a
large world, and a snapshot is stored compressed."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.event_strategies import numbered, payloads
from tests.unit.machine_harness import Sim, crash, job, register
from unbroken.driver import detectors, etcdsnapshot
from unbroken.driver import fold as foldlib
from unbroken.driver import machine as m
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import EventLogError
from unbroken.driver.liveview import Group, LiveView, LiveViewConfig
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def _reconnect_decides_nothing(s: ev.JobState, e: ev.Event) -> None:
    """What lets the loop skip `decide` for `e`: it records `e` alone, keeps the phase and
    the pending actions, and the fold leaves the node's state as it was."""
    node = e.node_registered.node_id
    policy = m.Policy()
    d = m.decide(s, e, policy)
    assert d.events == (e,) and d.phase == s.phase
    after = statelib.apply(s, e)
    assert after.nodes[node].state == s.nodes[node].state
    assert after.phase == s.phase and after.world == s.world
    assert tuple(m.pending_actions(after, policy)) == d.actions


def test_a_reconnect_of_each_kind_is_one_and_decides_nothing() -> None:
    sim = Sim(m.Policy())
    sim.append(job(nodes=4, wpn=2, spares=1))
    s = sim.state
    assert s.phase == ev.PHASE_RUNNING
    same_world, same_spare = register("n1", 1, 2), register("s0", 1, 2, spare=True)
    for e in (same_world, same_spare):
        assert m.reconnect(s, e)
        _reconnect_decides_nothing(s, e)
    # not reconnects: a new agent (its workers and flash memory are gone), an unknown node,
    # a spare's agent now saying it is a worker, a world node's saying it is a spare
    restarted = register("n1", 2, 2)
    assert not m.reconnect(s, restarted)
    assert m.decide(s, restarted, m.Policy()).phase == ev.PHASE_SUSPECTED
    assert not m.reconnect(s, register("n9", 1, 2))
    assert not m.reconnect(s, register("s0", 1, 2))
    assert not m.reconnect(s, register("n1", 1, 2, spare=True))
    assert not m.reconnect(s, crash("n1"))
    # a lost node coming back with its old epoch is no reconnect: its loss is decided
    sim.feed(ev.Event(node_lost=ev.NodeLost(node_id="n2", epoch=1)))
    assert not m.reconnect(sim.state, register("n2", 1, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(payloads, max_size=50), st.booleans())
def test_every_reconnect_in_any_state_decides_nothing(events: list[ev.Event], spare: bool) -> None:
    s = statelib.fold(numbered(events), statelib.initial("job"))
    if m.settle(s, m.Policy()).events:
        return  # a state the loop never decides on: it settles every state it records
    for node, rec in s.nodes.items():
        e = register(node, rec.epoch, spare=spare)
        if m.reconnect(s, e):
            _reconnect_decides_nothing(s, e)


def test_restore_started_of_81920_ranks_fits_an_event_and_names_every_source() -> None:
    ranks = 10_240 * 8
    sources = {r: "memory" for r in range(ranks)}
    sources.update({5: "buddy", 6: "buddy", 77_000: "storage"})
    e = m.restore_started(40, sources, reshard=False)
    assert e.source_default == "memory"
    assert dict(e.source_by_rank) == {5: "buddy", 6: "buddy", 77_000: "storage"}
    assert ev.Event(restore_started=e).ByteSize() < 1024
    assert all(m.restore_source(e, r) == src for r, src in sources.items())
    # a small world keeps every rank by name (what readers of small jobs see)
    small = m.restore_started(40, {0: "memory", 1: "buddy"}, reshard=True)
    assert small.source_default == "" and dict(small.source_by_rank) == {0: "memory", 1: "buddy"}
    assert m.restore_source(small, 1) == "buddy" and m.restore_source(small, 9) == ""


def _world_of(n: int, width: int) -> ev.JobState:
    ids = [
        f"gpu-{i:06d}.rack{i // 64:04d}.dc1.example.com".ljust(width, "x")[:width] for i in range(n)
    ]
    world = ev.WorldLayout(dp=n * 8, pp=1, tp=1, node_ids=ids, workers_per_node=8)
    events = [
        ev.Event(job_started=ev.JobStarted(trainer="t", world=world)),
        *(
            ev.Event(
                node_registered=ev.NodeRegistered(
                    node_id=i, epoch=1_700_000_000_000_000_000 + k, hostname=i, ip="10.1.2.3",
                    num_workers=8,
                )
            )
            for k, i in enumerate(ids)
        ),
        ev.Event(training_resumed=ev.TrainingResumed(world=world)),
    ]  # fmt: skip
    s = statelib.initial("job")
    foldlib.fold_in_place(s, numbered(events))
    return s


def test_a_10240_node_snapshot_with_40_character_names_is_stored_under_1_mib() -> None:
    s = _world_of(10_240, 40)
    assert s.ByteSize() > 2 << 20  # serialized as it is: over 2 MiB
    data = etcdsnapshot.snapshot_value(s.last_seq, s)
    assert len(data) <= 1 << 20
    snap = ev.Snapshot.FromString(data)
    assert snap.last_seq == s.last_seq and not snap.HasField("state")
    back = ev.JobState.FromString(etcdsnapshot.inflate(snap.state_deflated))
    assert back == s


def test_a_snapshot_that_does_not_inflate_says_so() -> None:
    with pytest.raises(EventLogError, match="does not inflate"):
        etcdsnapshot.inflate(b"not zlib data at all")


@settings(max_examples=200, deadline=None)
@given(st.lists(payloads, max_size=60), st.integers(1, 7))
def test_a_replay_folding_pages_equals_folding_event_by_event(
    events: list[ev.Event], page: int
) -> None:
    """A replay folds each page with the kinds counted once per page: the same state as
    the journal's event-by-event fold, whatever the events and the page size."""
    events = numbered(events)
    one_by_one = statelib.initial("job")
    for e in events:
        statelib.apply_in_place(one_by_one, e)
    paged = statelib.initial("job")
    for i in range(0, len(events), page):
        statelib.fold_into(paged, events[i : i + page])
    assert paged == one_by_one == statelib.fold(events, statelib.initial("job"))


def test_gone_nodes_past_the_limit_are_pruned_oldest_first_in_a_replay() -> None:
    """Past KEEP_GONE_NODES + PRUNE_SLACK losses the oldest records go, in a paged fold
    as in the journal's; world nodes and suspects are kept whatever their age."""
    n = statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK + 3
    events = [ev.Event(job_started=ev.JobStarted(world=ev.WorldLayout(node_ids=["n0", "n1"])))]
    events += [
        ev.Event(node_registered=ev.NodeRegistered(node_id=f"n{i}", epoch=1)) for i in range(n)
    ]
    events += [ev.Event(node_lost=ev.NodeLost(node_id=f"n{i}", epoch=1)) for i in range(n)]
    events = numbered(events)
    s = statelib.initial("job")
    for i in range(0, len(events), 500):
        statelib.fold_into(s, events[i : i + 500])
    assert s.gone_nodes == statelib.KEEP_GONE_NODES + 2
    assert s.pruned_nodes == n - s.gone_nodes
    assert {"n0", "n1", f"n{n - 1}"} <= set(s.nodes)
    first_kept = 2 + s.pruned_nodes  # n2.. went, oldest first
    assert f"n{first_kept - 1}" not in s.nodes and f"n{first_kept}" in s.nodes
    assert s == statelib.fold(events, statelib.initial("job"))


def _grouped_view(members: int) -> tuple[LiveView, Group]:
    view = LiveView(LiveViewConfig(jitter_k=0, starved_hold_ms=0))
    g = view.vouched("r0", 0.0)
    for i in range(members):
        slot = view.slot(f"m{i}")
        slot.relay, slot.connected = "r0", True
        view.join(slot, g, 0.0)
    return view, g


def test_a_vouching_batch_moves_one_timestamp_and_members_read_through_it() -> None:
    """A relay's vouch costs O(1) whatever its group's size; each member's last_seen and
    heartbeat count read through the group, and none sits in the deadline order."""
    view, g = _grouped_view(1000)
    assert not view.order and view.grouped == 1000 and view.alive_count() == 1000
    for t in (0.1, 0.2, 0.3):
        assert view.vouched("r0", t) is g
    slot = view.nodes["m7"]
    assert slot.last_seen == 0.3 and slot.heartbeats == 3 and view.tracked(slot)
    assert detectors.silent(view, 0.5) == []  # 200 ms after the vouch: not late
    # a member named in a batch on its own (news) stays in the group
    slot.heartbeats += 1
    view.join(slot, g, 0.35)
    assert slot.group is g and slot.last_seen == 0.35 and slot.heartbeats == 4


def test_a_member_named_late_is_lost_at_its_own_timeout_not_the_groups() -> None:
    view, g = _grouped_view(50)
    view.vouched("r0", 0.1)
    view.late(view.nodes["m3"], 0.05)  # the relay last heard it at 0.05
    assert view.nodes["m3"].group is None and view.grouped == 49
    for t in (0.2, 0.3, 0.4):
        view.vouched("r0", t)
    lost = detectors.silent(view, 0.36)
    assert [(s.node_id, why) for s, why in lost] == [("m3", "heartbeat timeout")]
    assert view.nodes["m3"].last_seen == 0.05
    # named alive again: back in the group, no longer tracked alone
    view.join(view.nodes["m3"], g, 0.45)
    assert not view.strays and not view.order and view.grouped == 50


def test_a_quiet_group_is_judged_member_by_member_and_rejoins_when_vouched_again() -> None:
    view, g = _grouped_view(64)
    direct = view.slot("d0")
    view.mark_alive(direct, 0.0)
    view.beat(direct, direct.hb, 0.5)
    lost = detectors.silent(view, 0.45)  # the group's vouch is 450 ms old, timeout 300
    assert sorted(s.node_id for s, _ in lost) == sorted(f"m{i}" for i in range(64))
    assert not g.members and len(g.parked) == 64 and view.grouped == 0
    # the relay vouches again before any was declared: the parked members rejoin
    view.vouched("r0", 0.5)
    for slot in list(g.parked.values()):
        view.join(slot, g, 0.5)
    g.parked.clear()
    assert view.grouped == 64 and detectors.silent(view, 0.6) == []
    # the relay's session ends: its members are tracked alone from its last vouch
    view.drop_group("r0")
    assert view.grouped == 0 and "r0" not in view.groups
    assert all(view.nodes[f"m{i}"].last_seen == 0.5 for i in range(64))
    view.beat(direct, direct.hb, 0.8)
    assert len(detectors.silent(view, 0.85)) == 64  # d0 beat meanwhile


def test_a_direct_heartbeat_or_a_loss_takes_a_member_out_of_its_group() -> None:
    view, _ = _grouped_view(3)
    m0, m1 = view.nodes["m0"], view.nodes["m1"]
    view.beat(m0, m0.hb, 0.2)  # it came to the driver directly
    assert m0.group is None and list(view.order) == ["m0"] and m0.heartbeats == 1
    view.mark_lost(m1)
    assert m1.group is None and not m1.alive and view.grouped == 1
    assert view.alive_count() == 2


def test_a_crowd_of_held_nodes_is_logged_in_a_few_lines_and_counted_whole() -> None:
    """Thousands of nodes late together (a stalled relay group, a starved host) cost a
    few log lines per sweep, not one each; every one that came back is still counted."""
    from structlog.testing import capture_logs

    from unbroken.driver import nodewatch as svc
    from unbroken.driver import service

    s = service.DriverService(service.ServiceConfig(), driver_id="d", job_id="j").nodewatch
    slots = []
    for i in range(500):
        slot = s.view.slot(f"n{i}")
        s.view.mark_alive(slot, 1.0)
        slots.append(slot)
    with capture_logs() as logs:
        s._note_held(slots, 2.0)
    assert len(logs) == svc.HELD_LOGS + 1
    assert logs[-1]["nodes"] == 500 - svc.HELD_LOGS
    for slot in slots:
        s.view.refresh(slot, 2.5)
    with capture_logs() as logs:
        s._note_held([], 2.6)
    assert s.starved_saved == 500 and len(logs) == svc.HELD_LOGS + 1
    assert logs[-1]["event"] == "more held nodes came back"


def test_a_slow_node_lost_sweep_takes_at_most_a_fifth_of_the_loop() -> None:
    """The node-lost sweep runs every interval/5; one that takes long (a whole world held
    late together: every late node read) waits SWEEP_SHARE times its own duration before
    the next, so the loop reads the streams that end the lateness."""
    import time

    from unbroken.driver import nodewatch, service

    s = service.DriverService(service.ServiceConfig(), driver_id="d", job_id="j").nodewatch
    s._lead = SimpleNamespace(leader=True)  # type: ignore[assignment]
    calls: list[float] = []

    def slow(now: float, slack_s: float) -> None:
        calls.append(time.monotonic())
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:  # 50 ms of work: the sweep period is 20 ms
            pass

    s._sweep_lost = slow  # type: ignore[method-assign]

    async def run() -> None:
        task = asyncio.create_task(s._lost_loop())
        await asyncio.sleep(1.2)
        task.cancel()

    asyncio.run(run())
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps and min(gaps) >= nodewatch.SWEEP_SHARE * 0.05 * 0.9, gaps


def test_the_loops_busy_share_is_its_cpu_over_the_wall_time_between_samples() -> None:
    """nodewatch.busy_share: (wall, CPU) samples of the event loop's thread."""
    import collections

    from unbroken.driver.nodewatch import busy_share

    assert busy_share(collections.deque()) == 0.0
    assert busy_share(collections.deque([(1.0, 5.0)])) == 0.0
    assert busy_share(collections.deque([(1.0, 5.0), (1.0, 5.1)])) == 0.0  # no wall time
    assert busy_share(collections.deque([(1.0, 5.0), (1.1, 5.02), (1.3, 5.24)])) == (
        pytest.approx(0.8)
    )


def test_a_command_to_many_nodes_marks_the_view_until_a_timeout_after_it() -> None:
    """LiveView.fanning_out: a command to more than mass_loss_min nodes is out (nested
    ones counted), and `fanned_out` holds for one timeout after the last came back; one to
    a few nodes marks nothing."""
    import math
    import time

    from unbroken.driver.liveview import LiveView, LiveViewConfig

    view = LiveView(LiveViewConfig(heartbeat_interval_ms=100, mass_loss_min=8))
    with view.fanning_out(8):
        assert view.fanning == 0 and view.fanned_at == -math.inf
    assert not view.fanned_out(time.monotonic())
    with view.fanning_out(9), view.fanning_out(10_240):
        assert view.fanning == 2 and view.fanned_out(time.monotonic() + 60)
    assert view.fanning == 0
    assert view.fanned_out(view.fanned_at + 0.29) and not view.fanned_out(view.fanned_at + 0.31)
