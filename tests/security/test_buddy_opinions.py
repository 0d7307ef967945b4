"""A buddy's SDC opinions (driver.proto `BuddyOpinion`) are an agent's word about another
node's ranks: the driver takes them only from the node that holds that node's copies (the
next node of the replica ring), only about ranks that node runs, and only of the current
timeline, so an agent cannot name another node's rank as corrupt on its own say."""

from __future__ import annotations

from types import SimpleNamespace

from unbroken.driver import sdc as sdclib
from unbroken.driver.liveview import NodeSlot
from unbroken.driver.sdcwatch import _feed, _opinions
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev


def _slot(node: str, rank: int, port: int) -> NodeSlot:
    s = NodeSlot(node)
    s.alive = True
    s.peer_host = "127.0.0.1"
    s.info.replica_listen = f"127.0.0.1:{port}"
    s.hb.workers.add(global_rank=rank)
    return s


def _opinion(node: str, rank: int, step: int, h: int, timeline: int = 0) -> dpb.BuddyOpinion:
    fp = ev.RankFingerprint(step=step, keys=["k"], hashes=[h], global_rank=rank)
    return dpb.BuddyOpinion(node=node, fingerprint=fp, timeline=timeline)


def test_only_the_ring_buddy_speaks_for_a_nodes_ranks_of_this_timeline() -> None:
    nodes = ("n0", "n1", "n2")  # ring n0 -> n1 -> n2 -> n0: n1 holds n0's copies
    slots = {n: _slot(n, r, 9000 + r) for r, n in enumerate(nodes)}
    loop = SimpleNamespace(view=SimpleNamespace(nodes=slots), _timeline=2)
    # n2 is not n0's buddy; n1 names a rank n0 does not run; an old timeline; n1 for n0: kept
    slots["n2"].hb.buddy_opinions.append(_opinion("n0", 0, 10, 1, timeline=2))
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 2, 10, 1, timeline=2))
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 5, 1, timeline=1))
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 10, 7, timeline=2))
    book = sdclib.FingerprintBook(3)
    assert _feed(loop, book, nodes) == {0: "n0", 1: "n1", 2: "n2"}  # type: ignore[arg-type]
    assert book.opinions == {10: {0: {"k": 7}}}


def test_opinions_heard_before_the_book_began_are_not_about_this_run() -> None:
    """After a restart a step is trained again; the buddy's opinion of the previous run's copy
    of it, still repeated in heartbeats, must not be compared with the new run's report."""
    nodes = ("n0", "n1")
    slots = {n: _slot(n, r, 9000 + r) for r, n in enumerate(nodes)}
    loop = SimpleNamespace(view=SimpleNamespace(nodes=slots), _timeline=0)
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 10, 1))
    stale = set(_opinions(loop, nodes))  # type: ignore[arg-type]
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 15, 2))  # formed in this run
    book = sdclib.FingerprintBook(2)
    _feed(loop, book, nodes, stale)  # type: ignore[arg-type]
    assert book.opinions == {15: {0: {"k": 2}}}


def test_a_heartbeat_already_fed_is_not_read_again() -> None:
    """The watch keeps, per book, each node's heartbeat fed last: a node whose newest
    heartbeat is that one is skipped (at 10,240 nodes the whole feed every 100 ms was 13 %
    of the driver), and its next heartbeat, with its fingerprints and opinions, is fed."""
    nodes = ("n0", "n1")
    slots = {n: _slot(n, r, 9000 + r) for r, n in enumerate(nodes)}
    loop = SimpleNamespace(view=SimpleNamespace(nodes=slots), _timeline=0)
    book = sdclib.FingerprintBook(2)
    fed: dict[str, dpb.Heartbeat] = {}
    node_of: dict[int, str] = {}
    assert _feed(loop, book, nodes, (), fed, node_of) == {0: "n0", 1: "n1"}  # type: ignore[arg-type]
    assert fed == {n: slots[n].hb for n in nodes}
    # the same heartbeat object changed behind the book's back is not read again
    slots["n0"].hb.workers[0].fingerprints.add(step=3, keys=["k"], hashes=[1], global_rank=0)
    _feed(loop, book, nodes, (), fed, node_of)  # type: ignore[arg-type]
    assert book.pending == {}
    # a new heartbeat is: its fingerprints and its buddy's opinion count
    for n, h in (("n0", 1), ("n1", 1)):
        hb = dpb.Heartbeat()
        w = hb.workers.add(global_rank=nodes.index(n))
        w.fingerprints.add(step=4, keys=["k"], hashes=[h], global_rank=nodes.index(n))
        slots[n].hb = hb
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 4, 1))
    _feed(loop, book, nodes, (), fed, node_of)  # type: ignore[arg-type]
    assert book.pending == {4: {0: {"k": 1}, 1: {"k": 1}}}
    assert book.opinions == {4: {0: {"k": 1}}}


def test_a_node_that_says_none_of_its_ranks_has_a_fingerprint_is_not_walked() -> None:
    """A heartbeat with `fingerprint_ranks` 0 is not read rank by rank (at 10,240 nodes that
    walk was 44 % of the driver's samples); one from an older agent (unset) still is. The
    buddy's opinion of a rank on a node never walked is checked against that node's
    newest heartbeat: still only the ranks it runs."""
    nodes = ("n0", "n1", "n2")
    slots = {n: _slot(n, r, 9000 + r) for r, n in enumerate(nodes)}
    loop = SimpleNamespace(view=SimpleNamespace(nodes=slots), _timeline=0)
    for n in ("n0", "n1"):
        slots[n].hb.fingerprint_ranks = 0
    # n2's ranks carry a fingerprint and it does not say so (an older agent): read
    slots["n2"].hb.workers[0].fingerprints.add(step=4, keys=["k"], hashes=[5], global_rank=2)
    # n0 claims 0 yet carries one: it is not read (the count is the agent's word)
    slots["n0"].hb.workers[0].fingerprints.add(step=4, keys=["k"], hashes=[9], global_rank=0)
    # n1, n0's buddy: one opinion of a rank n0 runs, one of a rank it does not run
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 0, 4, 1))
    slots["n1"].hb.buddy_opinions.append(_opinion("n0", 2, 4, 1))
    book = sdclib.FingerprintBook(3)
    node_of = _feed(loop, book, nodes)  # type: ignore[arg-type]
    assert node_of == {2: "n2", 0: "n0"}  # n2 walked; n0's rank 0 found for the opinion
    assert book.pending == {4: {2: {"k": 5}}}
    assert book.opinions == {4: {0: {"k": 1}}}
