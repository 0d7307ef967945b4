"""The step every rank can restore from memory after a stop (`driver.loop.common_steps`)."""

from __future__ import annotations

import pytest

from unbroken.driver.liveview import NodeSlot
from unbroken.driver.loop import common_steps, is_buddy
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit


def test_every_rank_in_its_own_ring() -> None:
    own = {0: {8, 9, 10}, 1: {9, 10, 11}}
    assert common_steps(2, own, {}) == {9, 10}


def test_a_lost_nodes_ranks_count_the_copies_its_buddy_holds() -> None:
    own = {0: set(range(19, 27)), 1: set(range(19, 27))}  # node-0's two ranks
    buddies = {2: {20, 25}, 3: {20, 25}}  # node-1 is gone; node-0 held its replicas
    assert max(common_steps(4, own, buddies) or {0}) == 25
    # without the buddy's report the commits decide
    assert common_steps(4, own, {}) is None
    # a rank nobody holds: the commits decide
    assert common_steps(4, own, {2: {25}}) is None


def test_a_rank_of_its_own_wins_over_a_buddy_copy() -> None:
    assert common_steps(1, {0: {5}}, {0: {7}}) == {5}
    assert common_steps(0, {}, {}) is None


def _holder(listen: str, peer: str = "10.0.0.7", ip: str = "10.0.0.7") -> NodeSlot:
    slot = NodeSlot("h")
    slot.info = dpb.RegisterRequest(node_id="h", ip=ip, hostname="host-h", replica_listen=listen)
    slot.peer_host = peer
    return slot


def test_only_the_registered_buddy_is_believed() -> None:
    """A lost node's copies count only from the node whose replica server its --buddy names:
    the same port on an address the holder registered, listened on or connected from."""
    assert is_buddy("10.0.0.7:29600", _holder("10.0.0.7:29600"))
    assert is_buddy("host-h:29600", _holder("0.0.0.0:29600"))  # its hostname, any address
    assert is_buddy("127.0.0.1:5000", _holder("127.0.0.1:5000", peer="127.0.0.1"))
    assert not is_buddy("10.0.0.7:29601", _holder("10.0.0.7:29600"))  # another port
    assert not is_buddy("10.0.0.9:29600", _holder("0.0.0.0:29600"))  # another host
    assert not is_buddy("10.0.0.7:29600", _holder(""))  # it serves no replicas
    assert not is_buddy("", _holder("10.0.0.7:29600"))  # the lost node named no buddy
