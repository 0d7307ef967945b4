"""The step every rank can restore from memory after a stop (`driver.loop.common_steps`)."""

from __future__ import annotations

import random

import pytest

from unbroken.driver.buddies import buddy_index, is_buddy, ring_buddy_map, ring_buddy_of
from unbroken.driver.liveview import NodeSlot
from unbroken.driver.loop import common_steps, replica_address, ring_buddies
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


def _holder(listen: str, peer: str = "10.0.0.7", ip: str = "10.0.0.7", node: str = "h") -> NodeSlot:
    slot = NodeSlot(node)
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


def test_a_replica_server_is_reached_where_the_driver_saw_its_node() -> None:
    assert replica_address(_holder("10.0.0.7:29600")) == "10.0.0.7:29600"
    # a wildcard listen: the address the node connected from (then the one it claimed)
    assert replica_address(_holder("0.0.0.0:29600", peer="10.0.0.8")) == "10.0.0.8:29600"
    assert replica_address(_holder("[::]:29600", peer="fd00::8")) == "[fd00::8]:29600"
    assert replica_address(_holder("0.0.0.0:29600", peer="", ip="10.0.0.9")) == "10.0.0.9:29600"
    assert replica_address(_holder("")) == ""  # it serves no replicas


def test_a_world_is_paired_in_a_ring_in_world_order() -> None:
    """Every StartWorkers pairs the world again: after a spare took an evicted node's place,
    the others send to the spare, not to the server that left (seen in the recovery bench:
    every node kept sending to the first evicted node, and a later node loss restored from
    storage, 195 steps back)."""
    slots = {
        n: _holder(f"10.0.0.{i}:29600", peer=f"10.0.0.{i}", node=n) for i, n in enumerate("abc")
    }
    assert ring_buddies(["a", "b", "c"], slots) == {
        "a": "10.0.0.1:29600",
        "b": "10.0.0.2:29600",
        "c": "10.0.0.0:29600",
    }
    assert ring_buddies(["c", "a"], slots) == {"c": "10.0.0.0:29600", "a": "10.0.0.2:29600"}
    # each pairing is one the restore believes: the buddy's copies count for the node
    for node, buddy in ring_buddies(["a", "b", "c"], slots).items():
        holder = next(s for s in slots.values() if replica_address(s) == buddy)
        assert holder.node_id != node and is_buddy(buddy, holder)
    # a node without a replica server is skipped; one alone, or none, has no buddy
    slots["b"] = _holder("", node="b")
    assert ring_buddies(["a", "b", "c"], slots) == {"a": "10.0.0.2:29600", "c": "10.0.0.0:29600"}
    assert ring_buddies(["a"], slots) == {}
    assert ring_buddies(["a", "x"], slots) == {}  # x has no session (no slot)


def test_a_new_leader_finds_a_lost_nodes_copies_where_its_predecessor_paired_them() -> None:
    """A leader keeps the ring it paired in memory; its successor paired nothing yet. Two
    node losses right after a driver kill (bench-recovery, MTBF 20 s) were looked for at
    the lost node's registered --buddy, long replaced by the ring, and restored a persisted
    step ~600 steps back. `ring_buddy_of` gives the ring's pairing, also for a lost node the
    new leader never saw register."""
    from unbroken.driver.buddies import ring_buddy_of

    slots = {
        n: _holder(f"10.0.0.{i}:29600", peer=f"10.0.0.{i}", node=n) for i, n in enumerate("abcd")
    }
    world = ["a", "b", "c", "d"]
    ring = ring_buddies(world, slots)
    assert {n: ring_buddy_of(n, world, slots) for n in world} == ring
    lost = {n: s for n, s in slots.items() if n != "b"}  # b died before re-registering
    assert ring_buddy_of("b", world, lost) == ring["b"] == "10.0.0.2:29600"
    assert ring_buddy_of("a", world, lost) == "10.0.0.2:29600"  # b has no server: skip it
    assert ring_buddy_of("x", world, slots) == ""  # not of this world
    assert ring_buddy_of("a", ["a"], slots) == ""  # alone: no buddy


def test_the_ring_map_and_the_buddy_index_agree_with_their_one_node_rules() -> None:
    """An incident in a 10,240-node world asked `ring_buddy_of` once per gone node (each a
    walk of the world: 30 s of the driver's loop) and tested every holder against every gone
    node; `ring_buddy_map` and `buddy_index` give the same answers in one pass."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(0, 9)
        nodes = [f"n{i}" for i in range(n)]
        slots: dict[str, NodeSlot | None] = {}
        for x in nodes:
            r = rng.random()
            if r < 0.2:
                continue  # never registered with this leader
            listen = "" if r < 0.6 else f"{rng.choice(['0.0.0.0', '10.0.0.1', '[::]'])}:29{x[1:]}"
            slot = _holder(listen, peer=f"10.1.0.{x[1:]}", ip=f"10.1.0.{x[1:]}", node=x)
            slots[x] = slot
        asked = [*nodes, "stranger"]
        got = ring_buddy_map(nodes, slots)
        assert [got.get(x, "") for x in asked] == [ring_buddy_of(x, nodes, slots) for x in asked]
        buddy_of = {x: b for x in nodes if (b := got[x])}
        buddy_of["odd"] = rng.choice(["10.1.0.1:291", "host-h:292", ":293", "nohost"])
        held_by = buddy_index(buddy_of)
        for slot in slots.values():
            assert slot is not None
            expected = {x for x, b in buddy_of.items() if is_buddy(b, slot)}
            assert held_by(slot) == expected


def test_a_start_hands_out_the_replica_keys_of_the_ring_neighbours_and_the_replaced_node() -> None:
    """Without TLS each node checks its buddy, the node whose copies its server takes and
    the node whose copies it takes over by the keys those nodes registered
    (recovery/nodekey.py): StartWorkers carries them from the log's node records."""
    from unbroken.driver.actions import Layout, StartWorkers
    from unbroken.driver.buddies import start_messages
    from unbroken.driver.config import LoopConfig
    from unbroken.driver.liveview import LiveView, LiveViewConfig
    from unbroken.proto import events_pb2 as ev

    view = LiveView(LiveViewConfig())
    for i, n in enumerate(("a", "b", "s")):
        view.nodes[n] = _holder(f"127.0.0.1:{29600 + i}", node=n)
    keys = {n: bytes([i + 1]) * 32 for i, n in enumerate(("a", "b", "c", "s"))}
    records = {n: ev.NodeRecord(node_id=n, replica_pubkey=k) for n, k in keys.items()}
    # spare s takes lost c's place between a and b
    start = StartWorkers(Layout(3, 1, 1, ("a", "s", "b"), 1), (("a", 0), ("s", 1), ("b", 2)))
    msgs = start_messages(
        start, 29500, LoopConfig(), view, old=["a", "c", "b"], buddy_of=lambda n: "127.0.0.1:29602",
        records=records, timeline=0, persist_every_s=1.0, shard_bytes=0,
    )  # fmt: skip
    got = {
        n: (sw.buddy_node, sw.buddy_pubkey, sw.replicas_from, sw.replicas_from_pubkey,
            sw.replaces, sw.replaces_pubkey)
        for n, m in msgs.items()
        for sw in [m.start_workers]
    }  # fmt: skip
    assert got == {
        "a": ("s", keys["s"], "b", keys["b"], "", b""),
        "s": ("b", keys["b"], "a", keys["a"], "c", keys["c"]),
        "b": ("a", keys["a"], "s", keys["s"], "", b""),
    }
