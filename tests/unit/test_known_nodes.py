"""A leader expects the log's nodes back (driver.term.expect_known_nodes)."""

from __future__ import annotations

import time

import pytest

from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.driver.term import expect_known_nodes
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit

GRACE_S = 30.0


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
