"""The straggler detector (driver/straggler.py): change point per node, normalised by the rest."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.machine_harness import Sim, job
from unbroken.common.timing import node_timing
from unbroken.driver import machine
from unbroken.driver.straggler import (
    Sample,
    StragglerConfig,
    StragglerWatch,
    median_without,
    sample,
)
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.unit


def samples(
    compute: dict[str, float],
    mad: float = 2.0,
    steps: int = 64,
    slow: str = "",
    extra: float = 10.0,
    wait_mad: float = 1.0,
) -> list[Sample]:
    """Node windows; `slow`'s peers wait `extra` ms longer than it does in the collectives."""
    return [
        Sample(
            node_id=n,
            generation=1,
            compute_ms=c,
            mad_ms=mad,
            wait_ms=1.0 if n == slow else 1.0 + (extra if slow else 0.0),
            steps=steps,
            wait_mad_ms=wait_mad,
        )
        for n, c in compute.items()
    ]


BASE = {"n0": 50.0, "n1": 80.0, "n2": 50.0, "n3": 80.0}  # two roles (pipeline stages)


def learn(w: StragglerWatch, batch: list[Sample], sweeps: int = 16) -> None:
    """Healthy sweeps, enough of them before the current window for a baseline (a window
    spans a few sweeps, and those are left out of it)."""
    for _ in range(sweeps):
        assert w.sweep(batch) == []


def test_a_slowed_node_is_named_after_confirm_sweeps_and_only_once() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=3))
    learn(w, samples(BASE))
    slow = {**BASE, "n1": 80.0 * 1.10}
    assert w.sweep(samples(slow, slow="n1", extra=8.0)) == []
    assert w.sweep(samples(slow, slow="n1", extra=8.0)) == []
    (e,) = w.sweep(samples(slow, slow="n1", extra=8.0))
    s = e.straggler_suspected
    assert s.node_id == "n1" and s.slowdown == pytest.approx(1.10) and s.policy == "evict"
    assert s.evidence == "wait" and s.compute_slowdown == pytest.approx(1.10)
    assert s.compute_ms == pytest.approx(88.0) and s.window_steps == 64
    assert w.sweep(samples(slow, slow="n1", extra=8.0)) == []  # reported once


def test_the_wait_gap_names_a_small_slowdown_the_compute_noise_hides() -> None:
    """3 % slower with a compute MAD of 10 % (z 1.3 over 128 steps: the compute test alone
    cannot tell) but the others wait 3 % of its compute longer with a wait MAD of 0.5 ms."""
    w = StragglerWatch(
        StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1, min_slowdown=1.025)
    )
    base = {n: 60.0 for n in ("n0", "n1", "n2")}
    learn(w, samples(base, mad=6.0, steps=128, wait_mad=0.5))
    slow = {**base, "n2": 60.0 * 1.03}
    (e,) = w.sweep(samples(slow, mad=6.0, steps=128, slow="n2", extra=1.8, wait_mad=0.5))
    s = e.straggler_suspected
    assert s.node_id == "n2" and s.evidence == "wait" and s.slowdown == pytest.approx(1.03)
    no_waits = StragglerWatch(
        StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1, min_slowdown=1.025)
    )
    learn(no_waits, [Sample(n, 1, c, 6.0, 0.0, 128) for n, c in base.items()])
    quiet = [Sample(n, 1, c, 6.0, 0.0, 128) for n, c in slow.items()]
    assert no_waits.sweep(quiet) == []  # without waits only the (too noisy) compute test
    much = [Sample(n, 1, c * (1.3 if n == "n2" else 1.0), 6.0, 0.0, 128) for n, c in base.items()]
    (e,) = no_waits.sweep(much)  # ...which names a larger slowdown
    assert e.straggler_suspected.evidence == "compute"
    assert e.straggler_suspected.slowdown == pytest.approx(1.3, rel=0.01)  # role drifted


def test_computing_longer_under_a_local_load_is_not_enough_when_nobody_waits_longer() -> None:
    """The false alarm of a loaded pipeline job (bench-detectors, 2026-11-24): a stage's
    compute 9 % above its usual (z 3.9 on its own MAD) while the other stage waited for it
    no longer than before. With waits reported, the wait test decides."""
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    pipe = {"n0": 355.0, "n1": 350.0}
    learn(w, samples(pipe, mad=20.0, steps=128, slow="n0", extra=20.0, wait_mad=8.0), 40)
    loaded = {**pipe, "n0": 355.0 * 1.09}
    assert w.sweep(samples(loaded, mad=20.0, steps=128, slow="n0", extra=20.0, wait_mad=8.0)) == []


def test_others_waiting_longer_is_not_enough_if_its_compute_did_not_grow() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    learn(w, samples(BASE, mad=1.0))
    assert w.sweep(samples(BASE, mad=1.0, slow="n1", extra=8.0)) == []


def test_a_node_that_computes_longer_but_makes_nobody_wait_is_not_named() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    learn(w, samples(BASE))
    assert w.sweep(samples({**BASE, "n1": 80.0 * 1.2})) == []  # waits as much as the rest


def test_roles_differ_but_nobody_is_a_straggler() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    for _ in range(5):
        assert w.sweep(samples(BASE)) == []


def test_a_load_that_slows_every_node_alike_is_not_a_straggler() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    learn(w, samples(BASE))
    assert w.sweep(samples({n: c * 1.5 for n, c in BASE.items()})) == []


def test_a_small_difference_within_the_noise_is_not_a_straggler() -> None:
    w = StragglerWatch(
        StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1, min_slowdown=1.04, k=4.0)
    )
    learn(w, samples(BASE, mad=10.0, steps=16))
    # 6 % slower, but the standard error of a 16-step median with MAD 10 ms is ~9 %
    assert w.sweep(samples({**BASE, "n1": 80.0 * 1.06}, mad=10.0, steps=16)) == []


def test_a_restart_sets_a_new_baseline() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    learn(w, samples(BASE))
    moved = [
        Sample(
            node_id=s.node_id,
            generation=2,
            compute_ms=s.compute_ms * (1.3 if s.node_id == "n1" else 1.0),
            mad_ms=2.0,
            wait_ms=10.0,
            steps=64,
        )
        for s in samples(BASE)
    ]
    assert w.sweep(moved) == []  # n1 restarted: a new baseline, nothing to compare yet


def test_too_few_steps_or_one_node_is_not_judged() -> None:
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1, min_steps=32))
    w.sweep(samples(BASE, steps=8))
    assert w.sweep(samples({**BASE, "n1": 200.0}, steps=8)) == []
    w2 = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    w2.sweep(samples({"n0": 50.0}))
    assert w2.sweep(samples({"n0": 100.0})) == []


@settings(max_examples=200)
@given(st.lists(st.floats(min_value=0.1, max_value=100), min_size=2, max_size=30), st.data())
def test_median_without_equals_the_median_of_the_rest(xs: list[float], data: st.DataObject) -> None:
    import statistics

    i = data.draw(st.integers(min_value=0, max_value=len(xs) - 1))
    rest = xs[:i] + xs[i + 1 :]
    assert median_without(sorted(xs), xs[i]) == pytest.approx(statistics.median(rest))


def test_no_false_straggler_in_noisy_healthy_windows() -> None:
    rnd = random.Random(7)
    w = StragglerWatch(StragglerConfig())
    for _ in range(2000):  # 2000 sweeps of 8 nodes whose window medians jitter 2 %
        got = w.sweep(
            [
                Sample(
                    node_id=f"n{i}",
                    generation=1,
                    compute_ms=60.0 * rnd.gauss(1.0, 0.02),
                    mad_ms=6.0,
                    wait_ms=abs(rnd.gauss(10.0, 3.0)),
                    steps=128,
                    wait_mad_ms=20.0,  # the per-step spread behind a 3 ms jitter of medians
                )
                for i in range(8)
            ]
        )
        assert got == []


def test_sample_takes_the_running_ranks_medians() -> None:
    ws = [
        dpb.WorkerStatus(
            local_rank=r,
            state=dpb.WORKER_STATE_RUNNING,
            pid=10 + r,
            compute_ms=c,
            compute_mad_ms=1.0,
            wait_ms=5.0,
            window_steps=40,
        )
        for r, c in enumerate((50.0, 60.0, 70.0))
    ] + [dpb.WorkerStatus(local_rank=9, state=dpb.WORKER_STATE_EXITED, compute_ms=999.0)]
    hb = dpb.Heartbeat(workers=ws)
    s = sample("n0", hb)
    assert s is not None and s.compute_ms == 60.0 and s.steps == 40
    assert sample("n0", dpb.Heartbeat()) is None
    # the agent's summary (what it sends) is what the driver computes from the ranks
    timing = node_timing(ws)
    assert timing is not None
    assert sample("n0", dpb.Heartbeat(timing=timing)) == s
    # and the driver reads the summary, not the ranks, when the agent sent one
    summary = dpb.NodeTiming(compute_ms=80.0, mad_ms=1.0, wait_ms=2.0, window_steps=64)
    assert sample("n0", dpb.Heartbeat(workers=ws, timing=summary)).compute_ms == 80.0  # type: ignore[union-attr]


def test_generation_changes_with_a_restart_or_an_in_job_rejoin() -> None:
    """A new baseline whenever a rank's place may have changed: a restart (a new process) or
    an in-job rejoin of the same process (a new world: another stage, other peers)."""

    def gen(**kw: int) -> int:
        w = dpb.WorkerStatus(
            state=dpb.WORKER_STATE_RUNNING, pid=4242, compute_ms=50.0, window_steps=8, **kw
        )
        t = node_timing([w])
        assert t is not None
        return t.generation

    first = gen()
    assert gen() == first  # steady: the same baseline heartbeat after heartbeat
    assert len({first, gen(restarts=1), gen(rejoins=1), gen(rejoins=2)}) == 4


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="policy"):
        StragglerConfig(policy="kill")
    with pytest.raises(ValueError, match="min_slowdown"):
        StragglerConfig(min_slowdown=1.0)


def _straggler(policy: str, node: str = "n1") -> ev.Event:
    return ev.Event(
        straggler_suspected=ev.StragglerSuspected(node_id=node, slowdown=1.2, policy=policy)
    )


def _start(spares: int) -> Sim:
    sim = Sim(machine.Policy())
    sim.append(job(nodes=2, spares=spares))
    assert sim.state.phase == ev.PHASE_RUNNING
    return sim


def test_policy_evict_replaces_the_straggler_with_a_spare() -> None:
    sim = _start(spares=1)
    d = sim.feed(_straggler("evict"))
    assert sim.state.bad_nodes == ["n1"] and d.phase == ev.PHASE_SUSPECTED
    sim.drive(set())
    assert "n1" not in sim.state.world.node_ids and len(sim.state.world.node_ids) == 2
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_EVICTED
    assert sim.state.phase == ev.PHASE_RUNNING


@pytest.mark.parametrize(("policy", "spares"), [("alert", 1), ("evict", 0)])
def test_alert_only_or_no_spare_records_without_a_recovery(policy: str, spares: int) -> None:
    sim = _start(spares=spares)
    d = sim.feed(_straggler(policy))
    assert [e.WhichOneof("payload") for e in d.events] == ["straggler_suspected"]
    assert d.phase == ev.PHASE_RUNNING and "n1" in sim.state.world.node_ids


def _pair(n1_compute: float, extra: float, wait_mad: float = 0.5) -> list[Sample]:
    """n0 and n1 computing 60 ms (n1: `n1_compute`); n0 waits `extra` ms longer than n1."""
    return [
        Sample("n0", 1, 60.0, 3.0, 1.0 + extra, 128, wait_mad),
        Sample("n1", 1, n1_compute, 3.0, 1.0, 128, wait_mad),
    ]


@pytest.mark.parametrize(("drift_sweeps", "named"), [(60, False), (0, True)])
def test_a_slow_drift_is_followed_not_flagged(drift_sweeps: int, named: bool) -> None:
    """A pipeline's balance shifting 10 % over 200 sweeps (a shared host's load changing):
    followed by the role; the first sweeps' role for good would call it a straggler."""
    w = StragglerWatch(
        StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1, drift_sweeps=drift_sweeps)
    )
    got = []
    for i in range(201):
        slower = 60.0 * (1.0 + 0.0005 * i)
        got += w.sweep(_pair(slower, slower - 60.0))
    assert bool(got) is named


def test_a_node_whose_gap_wanders_must_move_further() -> None:
    rnd = random.Random(3)
    calm, wandering = (
        StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1)) for _ in "ab"
    )
    for _ in range(150):
        calm.sweep(_pair(60.0, 0.0))
        assert wandering.sweep(_pair(60.0, rnd.gauss(0.0, 4.0))) == []
    step = _pair(66.0, 6.0)  # 10 % slower, the others wait 6 ms longer
    assert [e.straggler_suspected.node_id for e in calm.sweep(step)] == ["n1"]
    assert wandering.sweep(step) == []  # 1.5 sd of its usual wander
    (e,) = wandering.sweep(_pair(78.0, 18.0))  # 30 %: well outside it
    assert e.straggler_suspected.node_id == "n1"


@pytest.mark.parametrize("seed", range(10))
def test_a_straggler_with_slow_steps_is_not_absorbed_while_its_window_shifts(seed: int) -> None:
    """300 ms steps: a 128-step window takes ~20 sweeps to fill with the slow steps. The
    role follows no faster than over 6 windows, so the shift is a change, not a drift
    (the `make run` drill's pp2 job, 2026-11-24, whose 20 % straggler a 60-sweep role had
    absorbed; with these waits wandering 5 ms it misses 4 of these 10 seeds)."""
    rnd = random.Random(seed)
    w = StragglerWatch(StragglerConfig())

    def sweep(shift: float) -> list[ev.Event]:
        n1 = 280.0 * (1.0 + 0.2 * shift)
        return w.sweep(
            [
                Sample("n0", 1, 280.0, 25.0, 80.0 + (n1 - 280.0) + rnd.gauss(0, 5), 128, 15.0),
                Sample("n1", 1, n1, 25.0, 80.0 + rnd.gauss(0, 5), 128, 15.0),
            ]
        )

    for _ in range(40):
        assert sweep(0.0) == []
    named = [i for i in range(30) if sweep(min(1.0, i / 21)) != []]
    assert named and named[0] < 30, named


@pytest.mark.parametrize("settle", [0, 5])
def test_a_restart_transient_is_not_taken_for_a_role(settle: int) -> None:
    """After a restart one node's warm standby imports torch beside its new worker for a few
    sweeps: that node computes 8 % longer and its peer waits for it. A role taken from those
    sweeps holds the peer 8 % cheaper than it is; once the import is over the peer looks
    8 % slow (2026-11-24: a healthy node evicted 20 s after a loss-spike restart, with a role
    taken from 3 sweeps). The settle sweeps let the transient pass before a baseline is
    taken."""
    w = StragglerWatch(StragglerConfig(settle_sweeps=settle, confirm=3))
    base = {"n0": 50.0, "n1": 50.0}

    def at_generation(batch: list[Sample]) -> list[Sample]:
        return [Sample(s.node_id, 2, *[getattr(s, f) for f in FIELDS]) for s in batch]

    found: list[ev.Event] = []
    for _ in range(4):  # n0's standby imports torch
        found += w.sweep(at_generation(samples({**base, "n0": 54.0}, slow="n0", extra=4.0)))
    for _ in range(20):
        found += w.sweep(at_generation(samples(base)))
    named = {e.straggler_suspected.node_id for e in found}
    assert named == ({"n1"} if settle == 0 else set()), named


FIELDS = ("compute_ms", "mad_ms", "wait_ms", "steps", "wait_mad_ms")


def test_a_finding_s_tail_is_not_learnt_as_the_node_s_role() -> None:
    """Once a straggler recovers, its window still holds slow steps for a turnover: the
    sweeps of that tail, and those of its onset, do not join its baseline (learnt, they had
    lifted the bar for the next small straggler: the detector bench's 1.05x after its
    1.10x)."""
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    for _ in range(10):
        assert w.sweep(_pair(60.0, 0.0, wait_mad=3.0)) == []
    h = w.tracks["n1"].history
    assert h.pending, "the newest sweeps wait out the window before they join the baseline"
    kept = list(h.kept)
    (e,) = w.sweep(_pair(66.0, 6.0, wait_mad=3.0))
    assert e.straggler_suspected.node_id == "n1"
    t = w.tracks["n1"]
    assert not h.pending and list(h.kept) == kept  # its onset's sweeps left out
    for extra in (1.5, 1.0, 0.5, 0.0, 0.0, 0.0):  # the slow steps leave its window
        assert w.sweep(_pair(60.0 + extra, extra, wait_mad=3.0)) == []
    assert not h.pending and list(h.kept) == kept and t.hold > 0
    for _ in range(2 * math.ceil(128 * 61.0 / 2000.0) + 6):  # ...then it learns again
        w.sweep(_pair(60.0, 0.2, wait_mad=3.0))
    assert t.hold == 0 and list(h.kept) != kept


TRACES = Path(__file__).parent / "data" / "straggler_drill_traces.json"


def _replay(sweeps: list[list[list[Any]]]) -> list[tuple[int, str]]:
    w = StragglerWatch(StragglerConfig())
    return [
        (i, e.straggler_suspected.node_id)
        for i, batch in enumerate(sweeps)
        for e in w.sweep([Sample(*x) for x in batch])
    ]


def test_recorded_drills_a_slowed_node_is_named_within_seconds_and_nothing_else() -> None:
    """Two `unbroken up` drills' recorded per-step compute and wait times, summarised as the
    agents do (64-step windows) at every 2 s sweep (tests/unit/data, what it holds in its
    `about`). One slowed node-0 by 20 % after the job had trained a minute: named within
    10 sweeps, and nothing named before it (the baseline before the change: in that run the
    first minute's ratios wandered 10-15 % as standbys imported and the first checkpoints
    were written, and the baseline taken then, with the wander learnt from it, left the
    straggler unnamed for the run's 140 s). The other drilled every other fault (restarts,
    rejoins, a lost node, a driver kill) and no straggler: nothing named."""
    data = json.loads(TRACES.read_text())
    slowed = data["slowed"]
    named = _replay(slowed["sweeps"])
    assert named, "the slowed node was never named"
    first, node = named[0]
    assert node == slowed["node"]
    assert slowed["slowed_at"] < first <= slowed["slowed_at"] + 10, (first, slowed["slowed_at"])
    assert _replay(data["faults"]["sweeps"]) == []


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.floats(0.5, 2.0), st.floats(-50.0, 50.0), st.integers(0, 12)),
        min_size=1,
        max_size=120,
    ),
    st.sampled_from([0, 5, 30]),
)
def test_a_history_keeps_its_baseline_sorted_and_its_newest_waiting(
    sweeps: list[tuple[float, float, int]], size: int
) -> None:
    """The incremental history (O(log n) a sweep) against its definition: the newest `lag`
    sweeps wait, the baseline is the latest max(size, 3 x lag) before them (or the first
    `least`, for good, with size 0), and its sorted values are its sweeps'."""
    from unbroken.driver.straggler import SPAN, _History

    h = _History(size=size, least=4)
    most = 0
    for rel, gap, lag in sweeps:
        most = max(most, lag)
        h.add((rel, gap))
        h.settle(lag)
        assert len(h.pending) <= lag
        assert h.rels == sorted(r for r, _ in h.kept)
        assert h.gaps == sorted(g for _, g in h.kept)
        if size:
            assert len(h.kept) <= max(size, 3 * lag)
        else:
            assert len(h.kept) <= max(4, SPAN * most)
    if size and all(lag == 0 for _, _, lag in sweeps):
        # no sweep waits: the baseline is the latest sweeps
        pairs = [(r, g) for r, g, _ in sweeps]
        assert list(h.pending) == pairs[len(pairs) - len(h.pending) :]
        assert list(h.kept) == pairs[: len(pairs) - len(h.pending)][-len(h.kept) :]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -5.0])
@pytest.mark.parametrize("field_name", ["compute_ms", "mad_ms", "wait_ms", "wait_mad_ms"])
def test_an_agent_s_impossible_timings_are_not_judged(bad: float, field_name: str) -> None:
    """A heartbeat is input: a NaN, an infinity or a negative time in one node's summary
    never reaches the sorted baselines (a NaN breaks their order), is never named, and the
    other nodes are still judged."""
    w = StragglerWatch(StragglerConfig(settle_sweeps=0, baseline_sweeps=1, confirm=1))
    nodes = {"n0": 60.0, "n1": 60.0, "n2": 60.0}

    def batch(n1: float, extra: float) -> list[Sample]:
        out = samples({**nodes, "n1": n1}, steps=128, slow="n1" if extra else "", extra=extra)
        bad_one = Sample(**{**{f: getattr(out[2], f) for f in Sample.__slots__}, field_name: bad})
        return [out[0], out[1], bad_one]

    for _ in range(20):
        assert w.sweep(batch(60.0, 0.0)) == []
    assert "n2" not in w.tracks
    (e,) = w.sweep(batch(66.0, 6.0))  # n1 slowed 10 %: still named beside the bad node
    assert e.straggler_suspected.node_id == "n1"


def test_a_loaded_drill_a_new_world_s_wander_is_not_named_and_its_straggler_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver's own sweeps recorded in a drill beside `stress-ng -c 1` (load 12-15):
    node-1 joined the world as the bad node's replacement, and its peer's compute fell 25 %
    over the next minute as its own transient passed. A baseline of node-1's first 6 sweeps
    (its window spans 8) took that wander for its level and named node-1 1.2x slow at sweep
    95; one spanning a window's length at least names nothing there, and names spare-0,
    slowed 20 % at sweep 131, 10 sweeps later."""
    import unbroken.driver.straggler as straggler

    loaded = json.loads(TRACES.read_text())["loaded"]
    assert _replay(loaded["sweeps"]) == [(loaded["slowed_at"] + 10, loaded["node"])]
    monkeypatch.setattr(straggler, "SPAN", 1)  # the baseline's least: 6 sweeps, as before
    assert _replay(loaded["sweeps"])[0] == (95, "node-1")
