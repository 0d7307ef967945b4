"""Which copy the replica sender ships, and when (`ReplicaSender.due`)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from unbroken.common.loopthread import runqueue_wait_s
from unbroken.recovery.flashcopy import CopyRef, Manifest
from unbroken.recovery.replica import SendResult
from unbroken.recovery.replicasend import (
    REPLICA_DUTY,
    REPLICA_MARGIN,
    RETRY_CAP_S,
    ReplicaSender,
    same_step,
)
from unbroken.recovery.statehash import SDC_META

pytestmark = pytest.mark.unit


def ring(newest_step: int, k: int) -> list[CopyRef]:
    """A full ring of k copies, newest first; generation == step."""
    return [
        CopyRef(Path("/nonexistent"), (s % k), Manifest(0, s, s, 0, 0, (), {}))
        for s in range(newest_step, newest_step - k, -1)
        if s >= 0
    ]


def sender() -> ReplicaSender:
    return ReplicaSender(None, "n0", ("127.0.0.1", 1), idle_flush_s=1.0)  # type: ignore[arg-type]


def sent_steps(k: int, steps: int) -> list[int]:
    """The steps shipped when one save lands per tick, 0.1 s apart."""
    s, out = sender(), []
    for step in range(steps):
        ref = s.due(0, ring(step, k), now=step * 0.1)
        if ref is not None:
            s._sent[0] = ref.manifest.generation  # the buddy acknowledged it
            out.append(ref.manifest.step)
    return out


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_short_ring_ships_every_copy(k: int) -> None:
    assert sent_steps(k, 20) == list(range(20))


@pytest.mark.parametrize("k", [5, 6, 8])
def test_a_long_ring_ships_every_few_copies_and_the_replica_stays_in_the_ring(k: int) -> None:
    got = sent_steps(k, 60)
    full = [s for s in got if s >= k]  # while the ring fills it is short: every copy goes
    gaps = {b - a for a, b in itertools.pairwise(full)}
    assert gaps == {k - REPLICA_MARGIN}
    # at every step, the newest replicated step is still one the ring holds, with margin
    for step in range(got[0], 60):
        replica = max(s for s in got if s <= step)
        assert step - replica <= k - REPLICA_MARGIN < k - 1


def test_a_copy_nothing_follows_is_flushed_after_the_idle_time() -> None:
    s = sender()
    s._sent[0] = 10
    refs = ring(11, 8)  # one newer copy: not due by spacing
    assert s.due(0, refs, now=100.0) is None
    assert s.due(0, refs, now=100.5) is None
    ref = s.due(0, refs, now=101.0)
    assert ref is not None and ref.manifest.step == 11
    assert s.spaced_out == 2


def test_a_replica_that_left_the_ring_is_replaced_at_once() -> None:
    s = sender()
    s._sent[0] = 3  # long gone from a ring holding 20..13
    ref = s.due(0, ring(20, 8), now=0.0)
    assert ref is not None and ref.manifest.step == 20
    assert s.due(0, [], now=0.0) is None


def test_a_failed_send_is_retried_after_a_doubling_delay() -> None:
    s = sender()
    ref = ring(5, 4)[0]
    down = SendResult(0, 5, False, "ConnectionRefusedError")
    tries: list[float] = []
    for tick in range(2000):  # a 10 ms poll timer for 20 s
        now = tick / 100
        if s.due(0, ring(5, 4), now) is not None:
            tries.append(now)
            s._settle(0, ref, down, now)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[:6] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2], abs=0.011)
    assert gaps[6:] == pytest.approx([RETRY_CAP_S] * len(gaps[6:]), abs=0.011)
    assert s.failed == len(tries)
    s._settle(0, ref, SendResult(0, 5, True), now)  # the buddy is back
    assert s.due(0, ring(6, 4), now) is not None  # the next copy goes at once


def test_a_copy_the_buddy_found_corrupt_is_not_sent_again() -> None:
    s = sender()
    refs = ring(5, 4)
    ref = s.due(0, refs, now=0.0)
    assert ref is not None
    s._settle(0, ref, SendResult(0, 5, False, "checksum mismatch", corrupt=True), 0.0)
    assert all(s.due(0, refs, now=t) is None for t in (0.1, 1.0, 10.0, 100.0))
    newer = s.due(0, ring(6, 4), now=100.0)  # the next save is a fresh copy: it goes
    assert newer is not None and newer.manifest.step == 6


def test_a_copy_damaged_in_transit_is_sent_again() -> None:
    """The buddy found it corrupt, but it reads back whole here: the wire damaged it."""
    s = sender()
    refs = ring(5, 4)
    ref = s.due(0, refs, now=0.0)
    assert ref is not None
    bad = SendResult(0, 5, False, "checksum mismatch", corrupt=True)
    s._settle(0, ref, bad, 0.0, local_ok=True)
    assert s.due(0, refs, now=0.05) is None
    again = s.due(0, refs, now=0.1)
    assert again is not None and again.manifest.step == 5


def test_slow_saves_are_replicated_about_every_second() -> None:
    """A ring of 16 spaces sends 13 saves apart; with a save every 0.4 s that would leave
    the replica 5 s behind, so the time rule sends one about every second instead."""
    s = sender()
    out = []
    for step in range(40):
        now = step * 0.4
        ref = s.due(0, ring(step, 16), now)
        if ref is not None:
            s._settle(0, ref, SendResult(0, step, True), now)
            out.append(ref.manifest.step)
    gaps = {b - a for a, b in itertools.pairwise(x for x in out if x >= 16)}
    assert gaps == {3}  # 1.2 s: the first save at least REPLICA_EVERY_S after the last send


def test_a_nodes_ranks_replicate_the_same_step() -> None:
    """The buddy keeps two copies a rank: ranks sent a step apart (17 and 18, then 23 and
    24) left no step in common and a lost node's restore fell back to the newest commit."""
    lagging = {2: ring(18, 16), 3: ring(17, 16)}  # rank 3's step 18 is still being copied
    picked = same_step(lagging)
    assert [refs[0].manifest.step for refs in picked.values()] == [17, 17]
    s = sender()
    assert [s.due(r, refs, now=0.0).manifest.step for r, refs in picked.items()] == [17, 17]  # type: ignore[union-attr]
    assert same_step({2: ring(18, 2), 3: ring(30, 2)}) == {2: ring(18, 2), 3: ring(30, 2)}
    assert same_step({0: ring(5, 3)}) == {0: ring(5, 3)}  # one rank: its newest


def test_when_one_rank_is_due_every_rank_of_the_node_sends_the_same_step() -> None:
    """Counted per rank, ranks last replicated a step apart stay apart (rank 2 due at 265
    while rank 3 waits, then rank 3 at 266...): the node decides once for all its ranks."""
    s = sender()
    s._sent[2], s._sent_at[2] = 252, 0.0  # rank 2 last replicated step 252
    s._sent[3], s._sent_at[3] = 253, 0.0  # rank 3 one step later
    by_rank = {2: ring(265, 16), 3: ring(265, 16)}
    assert s.due(2, by_rank[2], now=0.5) is not None  # 13 newer: due
    assert s.due(3, ring(265, 16), now=0.5) is None  # 12 newer: not yet, alone
    picked = s.picks(by_rank, now=0.5)
    assert {r: ref.manifest.step for r, ref in picked.items()} == {2: 265, 3: 265}
    s._sent[2] = s._sent[3] = 265
    assert s.picks(by_rank, now=0.6) == {}  # acknowledged: nothing until the next is due
    s._retry[3] = (1, 9.0)  # rank 3's buddy send failed: it waits for its retry time
    assert set(s.picks({2: ring(280, 16), 3: ring(280, 16)}, now=1.0)) == {2}


def _ticks(cost_s: float, steps: int = 60) -> list[int]:
    """The steps a ring of 16 ships when one save lands per tick, 0.1 s apart, and each
    tick's sends take `cost_s`."""
    s = sender()
    out = []
    for step in range(steps):
        now = step * 0.1
        picked = s.picks({0: ring(step, 16)}, now)
        for rank, ref in picked.items():
            s._settle(rank, ref, SendResult(0, ref.manifest.step, True), now)
            out.append(ref.manifest.step)
        if picked:
            s.sent(cost_s, now + cost_s)
    return out


def test_cheap_sends_ship_every_copy_and_costly_ones_are_spaced_to_the_duty() -> None:
    """A node lost 2-10 steps (median 6) in bench-recovery: its buddy held a copy up to
    13 saves old (a ring of 16), though one send took milliseconds. While a tick's sends cost
    under REPLICA_DUTY of the time between them, every newer copy goes."""
    assert REPLICA_DUTY == 0.05
    assert _ticks(0.002) == list(range(60))  # 2 ms a send: every 0.1 s tick is cheap
    costly = [x for x in _ticks(0.02) if x >= 16]  # 20 ms: at most one every 0.4 s
    gaps = {b - a for a, b in itertools.pairwise(costly)}
    assert gaps == {5}  # the first tick at least 0.4 s after the last send's end
    # 1 s a send: the duty would allow one every 20 s; the older rules (a copy about every
    # REPLICA_EVERY_S, and within k - REPLICA_MARGIN saves) still hold
    slow = [x for x in _ticks(1.0) if x >= 16]
    assert {b - a for a, b in itertools.pairwise(slow)} <= {10, 11}


def test_the_send_cost_falls_at_once_and_rises_smoothed() -> None:
    """The first sends into a new buddy cost ten times the later ones (it lays out its
    ring); an average that remembered them spaced the sends a second apart through the
    first seconds of every new world, and the first node lost in a bench run went back
    12 steps. A cheaper send sets the estimate; a dearer one moves it 30 %."""
    s = sender()
    assert not s.cheap(0.0)  # nothing measured yet
    s.sent(0.5, 1.0)  # the first send: the buddy laid out its ring
    assert not s.cheap(5.0)  # 0.5 s / 0.05: 10 s to wait
    s.sent(0.005, 5.5)  # the next, in the steady state
    assert s._send_cost_s == 0.005 and s.cheap(5.61)  # 0.005 / 0.05 = 0.1 s
    s.sent(0.105, 6.0)  # one slow send: 0.7 * 0.005 + 0.3 * 0.105
    assert s._send_cost_s == pytest.approx(0.035)
    assert not s.cheap(6.6) and s.cheap(6.71)


def test_the_cost_of_a_send_leaves_out_the_wait_for_a_cpu() -> None:
    """At --flash-nice 19 on a busy host the flash thread waits for a CPU most of a send's
    wall time; that wait costs the training nothing. The kernel's count of it grows while
    this thread is runnable and others hold the CPUs, and never goes back."""
    first = runqueue_wait_s()
    assert first >= 0.0
    sum(range(200_000))  # some CPU time, maybe a wait for a core
    assert runqueue_wait_s() >= first


def test_a_fingerprinted_copy_goes_first_whatever_the_spacing() -> None:
    """The buddy recomputes a rank's fingerprints from exactly the fingerprinted copy
    (docs/sdc.md): every rank's copy of the newest fingerprinted step not sent yet goes at
    once, even where the spacing would wait or send a newer copy."""

    def marked(refs: list[CopyRef], step: int) -> list[CopyRef]:
        return [
            CopyRef(r.rank_dir, r.slot, replace(r.manifest, meta={SDC_META: {"step": step}}))
            if r.manifest.step == step
            else r
            for r in refs
        ]

    s = sender()
    s._sent = {0: 30, 1: 30}  # both acknowledged step 30 just now: spacing holds newer ones
    s._sent_at = {0: 100.0, 1: 100.0}
    by_rank = {0: marked(ring(33, 8), 32), 1: marked(ring(33, 8), 32)}
    got = s.picks(by_rank, now=100.01)
    assert {r: ref.manifest.step for r, ref in got.items()} == {0: 32, 1: 32}
    # only a step every rank marked; one already acknowledged is not sent again
    s._sent = {0: 32, 1: 30}
    assert 0 not in s._fingerprinted(by_rank, 100.02)
    # several not sent yet (a slow tick): the oldest first, then the next
    s._sent = {0: 30, 1: 30}
    two = {r: marked(marked(ring(37, 8), 32), 36) for r in (0, 1)}
    assert {r: x.manifest.step for r, x in s._fingerprinted(two, 100.03).items()} == {0: 32, 1: 32}
    s._sent = {0: 32, 1: 32}
    assert {r: x.manifest.step for r, x in s._fingerprinted(two, 100.04).items()} == {0: 36, 1: 36}
    assert s._fingerprinted({0: marked(ring(33, 8), 32), 1: ring(33, 8)}, 100.02) == {}
