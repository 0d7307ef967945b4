"""A leader expects the log's nodes back (driver.term.expect_known_nodes)."""

from __future__ import annotations

import time

import pytest

from unbroken.driver import detectors
from unbroken.driver.liveview import LiveView, LiveViewConfig, NodeSlot
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.driver.term import expect_known_nodes
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

GRACE_S = 30.0
ASKED, WHOLE = detectors.ASKED_NOT_BACK, detectors.NOT_BACK


def _state(*nodes: tuple[str, int]) -> ev.JobState:
    s = ev.JobState()
    for node_id, state in nodes:
        s.nodes[node_id].node_id = node_id
        s.nodes[node_id].state = state  # type: ignore[assignment]
    return s


def test_nodes_of_an_earlier_term_of_this_driver_get_the_registration_grace() -> None:
    """The same driver leads again (its etcd came back): the nodes it tracked before have
    no session (its step-down ended them) and need the same backoff rounds as for any new
    leader; they used to be judged by the miss limit alone and were declared lost."""
    service = DriverService(
        ServiceConfig(live=LiveViewConfig(session_grace_ms=GRACE_S * 1000)),
        driver_id="a",
        job_id="j",
    )
    view = service.view
    long_ago = time.monotonic() - 60
    for node_id in ("spare", "gone", "online"):
        slot = view.slot(node_id)
        view.mark_alive(slot, long_ago)
    view.nodes["gone"].alive = False  # declared lost before: it stays lost
    view.nodes["online"].connected = True  # its session is open: it keeps its rhythm
    state = _state(
        ("spare", ev.NODE_STATE_SPARE),
        ("gone", ev.NODE_STATE_ACTIVE),
        ("online", ev.NODE_STATE_ACTIVE),
        ("fresh", ev.NODE_STATE_ACTIVE),  # only in the log (a failover)
        ("evicted", ev.NODE_STATE_EVICTED),
    )
    before = time.monotonic()
    expect_known_nodes(view, state, GRACE_S)  # the grace a term is given (driver/main.py)
    for node_id in ("spare", "fresh"):
        slot = view.nodes[node_id]
        assert slot.alive and slot.last_seen >= before + GRACE_S, node_id
        assert node_id in view.pending, node_id
    assert view.nodes["gone"].last_seen == long_ago and not view.nodes["gone"].alive
    assert view.nodes["online"].last_seen == long_ago
    assert "evicted" not in view.nodes


def _failover_view(asked: dict[str, float], *, at: float = 100.0) -> LiveView:
    """A standby that heard `asked` (node -> when) ask it for the leader, then won at `at`
    with the log's nodes a, b and c to await (the registration grace 5 s, the term's 5 s)."""
    view = LiveView(LiveViewConfig(session_grace_ms=5_000, miss_limit=1000))  # 100 s
    for node_id, when in asked.items():
        view.asked_for_leader(node_id, when)
    slots = [view.slot(n) for n in ("a", "b", "c")]
    view.await_nodes(slots, at, 5.0)
    return view


def _lost(view: LiveView, now: float) -> dict[str, str]:
    return {e.node_lost.node_id: e.node_lost.reason for e in detectors.expired(view, now)}


def test_a_node_that_asked_for_the_leader_is_lost_once_the_others_are_back_and_quiet() -> None:
    """bench-recovery at MTBF 20 s: a node lost 0.4 s after a leader kill was declared lost
    11.7 s after the kill (the whole grace of a node that may still be backing off) and the
    job stood still that long. An agent that asked the standby for the leader retries every
    --election-retry-s: 1.5 s after the win, with the others back and quiet for 1 s, it is
    lost."""
    view = _failover_view({"a": 99.0, "b": 99.0, "c": 99.2})
    for n, t in (("b", 100.3), ("c", 100.4)):
        view.mark_registered(view.nodes[n], t)
        view.mark_alive(view.nodes[n], t + 0.05)
    assert not view.settled(101.35)  # c came back 0.95 s ago
    assert _lost(view, 101.45) == {}  # quiet, but not 1.5 s after the win yet
    assert _lost(view, 101.55) == {"a": ASKED}
    assert _lost(view, 110.5) == {}  # once
    assert not view.nodes["a"].alive and "a" not in view.awaited
    assert view.nodes["b"].alive and view.nodes["c"].alive


def test_while_the_herd_still_comes_back_an_awaited_node_is_not_lost_early() -> None:
    """10,000 agents reconnect for seconds after a failover: a node that asked is held while
    others still come back (each return restarts the quiet time), up to its whole grace."""
    view = _failover_view({"a": 99.0, "b": 99.0, "c": 99.0})
    view.mark_alive(view.nodes["b"], 101.4)
    assert _lost(view, 102.3) == {}  # quiet only 0.9 s
    assert _lost(view, 102.45) == {"a": ASKED, "c": ASKED}
    many = LiveView(LiveViewConfig(session_grace_ms=5_000, miss_limit=1000, mass_loss_min=2))
    ids = [f"n{i}" for i in range(12)]
    for n in ids:
        many.asked_for_leader(n, 99.0)
    many.await_nodes([many.slot(n) for n in ids], 100.0, 5.0)
    many.mark_alive(many.nodes["n0"], 100.2)  # 11 of 12 still out: a slow herd, not deaths
    assert not many.settled(103.0) and _lost(many, 103.0) == {}
    nobody = _failover_view({"a": 99.0, "b": 99.0, "c": 99.0})
    # nobody came back (this leader may be cut off): every node gets its whole grace
    assert _lost(nobody, 109.9) == {}
    assert _lost(nobody, 110.1) == {"a": WHOLE, "b": WHOLE, "c": WHOLE}


def test_a_node_that_did_not_ask_or_asked_long_ago_gets_the_whole_grace() -> None:
    """A node not heard during the election may be deep in its backoff (a sole driver
    restarted: nobody could ask it); one that asked 30 s before may be too."""
    view = _failover_view({"b": 99.0, "c": 70.0})
    view.mark_alive(view.nodes["b"], 100.2)
    assert _lost(view, 105.0) == {}
    assert _lost(view, 109.9) == {}
    assert _lost(view, 110.1) == {"a": WHOLE, "c": WHOLE}
    assert view.asked == {}  # a term's own; the next election starts afresh


def test_failover_grace_zero_turns_the_rule_off_and_the_asking_is_bounded() -> None:
    view = LiveView(
        LiveViewConfig(session_grace_ms=5_000, failover_grace_ms=0, max_nodes=2, miss_limit=1000)
    )
    for n, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        view.asked_for_leader(n, t)
    assert set(view.asked) == {"a", "b"}  # full, and none older than the window
    view.asked_for_leader("c", 20.0)  # the old ones make room
    assert set(view.asked) == {"c"}
    view.await_nodes([view.slot("c"), view.slot("d")], 21.0, 5.0)
    view.mark_alive(view.nodes["d"], 21.1)
    assert _lost(view, 30.9) == {}
    assert _lost(view, 31.1) == {"c": WHOLE}
    with pytest.raises(ValueError, match="failover_grace_ms"):
        LiveViewConfig(failover_grace_ms=-1)


def test_a_node_back_from_a_failover_and_late_while_the_herd_returns_is_held() -> None:
    """bench-scale at 10,240 nodes: the herd of reconnecting sessions and registrations
    starved a simulator 300 ms, and the new leader declared its 40 relays (then 1,388
    members) lost. While the herd is coming back a connected node late past its timeout
    gets the starved hold; once it settled, the timeout alone again."""
    # timeout 0.3 s; no jitter slack (each node judged by the timeout alone)
    view = LiveView(LiveViewConfig(session_grace_ms=5_000, miss_limit=3, jitter_k=0))
    slots = [view.slot(n) for n in ("a", "b", "c")]
    view.await_nodes(slots, 100.0, 5.0)
    for n in ("a", "b"):
        view.nodes[n].connected = True
        view.mark_alive(view.nodes[n], 100.2)
        view.beat(view.nodes[n], view.nodes[n].hb, 100.2)
    view.nodes["a"].hb.seq = view.nodes["b"].hb.seq = 1
    view.beat(view.nodes["b"], view.nodes["b"].hb, 100.6)
    held: list[NodeSlot] = []
    assert view.herding(100.7)  # c still awaited, b back 0.1 s ago
    assert detectors.silent(view, 100.7, 0.0, held) == [] and held == [view.nodes["a"]]
    # the hold has an end: 2 s more than the timeout
    assert [s.node_id for s, _ in detectors.silent(view, 102.6)] == ["a"]
    view.mark_alive(view.nodes["c"], 102.0)
    view.beat(view.nodes["c"], view.nodes["c"].hb, 102.0)
    assert not view.herding(103.1)  # all back and quiet for 1 s: settled
    view.beat(view.nodes["b"], view.nodes["b"].hb, 102.9)
    view.beat(view.nodes["a"], view.nodes["a"].hb, 103.1)
    view.beat(view.nodes["c"], view.nodes["c"].hb, 103.1)
    assert [s.node_id for s, _ in detectors.silent(view, 103.25)] == ["b"]  # 0.35 s: lost


def test_a_node_late_during_a_storm_of_registrations_is_held() -> None:
    """A cluster's join: 10,240 registrations within seconds starved a simulator of 2,560
    nodes 300 ms in bench-scale, and its relays were declared lost. While more than
    `mass_loss_min` registrations keep coming (none 1 s apart) a late node is held."""
    view = LiveView(LiveViewConfig(miss_limit=3, jitter_k=0))  # timeout 0.3 s
    a = view.slot("a")
    view.mark_alive(a, 10.0)
    a.connected, a.hb.seq = True, 1
    for i in range(8):  # 8 is mass_loss_min: not a storm yet
        view.mark_registered(view.slot(f"j{i}"), 10.0 + i * 0.01)
    assert not view.herding(10.4)
    assert [s.node_id for s, _ in detectors.silent(view, 10.4)] == ["a"]
    view.mark_registered(view.slot("j8"), 10.35)
    held: list[NodeSlot] = []
    assert view.herding(10.4) and detectors.silent(view, 10.4, 0.0, held) == [] and held == [a]
    assert not view.herding(11.4)  # 1 s without a registration: the storm passed
    assert "a" in [s.node_id for s, _ in detectors.silent(view, 11.4)]
