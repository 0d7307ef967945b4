"""Straggler detection while the job trains (pure; the service's sweep calls it).

Each agent reports, per rank, the median compute time per step and its median absolute
deviation over a window of recent steps (compute = the step minus the time spent waiting
for peers in collectives; agent/workers.py). In a synchronous job a slow rank computes
longer and waits least; its peers' step time grows with it, so the step time alone cannot
name it, but compute time can.

Two tests, each a change point against what the node did while healthy, each normalised by
the rest of the world at the same sweep (a load that slows every node moves every value
alike). What it did while healthy, its *baseline*: the medians of its relative cost and wait
gap over its latest `drift_sweeps` healthy sweeps (or three lags, if more) *before its
current window* (the sweeps whose windows overlap the newer half of the current one are left
out: a straggler's onset is in them), once `baseline_sweeps` of them exist and they span a
window's length at least (SPAN lags: overlapping windows are nearly one sample, and their
scatter is none; under load a 6-sweep baseline taken right after a world change named a
healthy node 1.2x slow when its peer's own transient passed, a recorded drill in
tests/unit/data), after `settle_sweeps` more passed since its workers (re)started or
rejoined (a restart's transients: warm standbys import torch beside the new workers). How
far those sweeps scatter (1.4826 x their MAD) is the noise a change must stand out of, when
larger than the window medians' own error: a loaded host's wander and a slow drift raise the
bar, and a drift is followed as it moves the median. A sweep that finds the node slow does
not join its baseline; once a finding is confirmed, nor do its onset's sweeps, nor the
sweeps of its window's turnover after the finding ends: its slow steps are leaving the
window, and a baseline learnt from them had moved half-way to the next small straggler's
level before it was named (a simulation of the detector bench's 1.20, 1.10, 1.05x sequence:
the 1.05x unnamed in 120 s in 2 of 8 runs without the hold). Until 2026-12-06 the baseline
was the median of the first 3 sweeps, then an exponentially weighted mean and variance over
60: in a drill whose first minute's ratios wandered 10-15 % (standbys importing, first
checkpoints), the variance learnt then, and the straggler's own shift learnt as wander, left
a 20 % straggler unnamed for the run's 140 s; the same recorded steps replayed now name it
in 14 s (tests/unit/data).

* wait (the precise one, when the job reports collective waits): in a synchronous job
  the others wait for a slow node in every collective, so its *gap*, the others' median
  wait minus its own, grows by the extra time it computes. A wait's spread is a fraction
  of a compute time's (the common noise of a step cancels in it), so a 5 % slowdown stands
  out within one window where the compute test below would need several. The node is
  slow when `extra` = gap - its usual gap gives

      slowdown = compute / (compute - extra) >= `min_slowdown`, and
      extra >= `k` x the standard error of the gap (both medians' errors combined),

  and its own compute grew (its compute ratio is above its usual). When the job
  reports waits, this test alone decides: a node that computes longer but makes nobody
  wait longer (a load on its host that its peers' pipeline absorbs) is no straggler.
* compute (for jobs that report no waits): its compute median relative to the other
  nodes' median, over its usual relative cost (its role: pipeline stages and the loss
  stage compute different amounts, but each keeps its own ratio while healthy),

      slowdown = relative cost / role >= `min_slowdown`, and
      slowdown - 1 >= `k` x the standard error of that ratio (its median's and the
      others' combined: 1.2533 x 1.4826 x MAD / sqrt(window) / median each).

Either test must hold for `confirm` sweeps in a row. One `StragglerSuspected` per node
until it recovers or its workers restart. Nothing here reads a clock or the network
(tests/unit/test_straggler.py).
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from unbroken.common.timing import node_timing
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

POLICIES = ("evict", "alert", "off")


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """The straggler detector's thresholds and what the driver does with a finding."""

    policy: str = field(
        default="evict",
        metadata={
            "choices": POLICIES,
            "help": "a node persistently slower than the rest: evict it when a spare exists, "
            "alert (record StragglerSuspected only), or off. Hangs are judged by the agents "
            "(unbroken agent --hang-floor-ms)",
        },
    )
    min_slowdown: float = field(
        default=1.03,
        metadata={"help": "relative slowdown a straggler must reach, among other tests"},
    )
    k: float = field(
        default=3.0, metadata={"help": "...and k standard errors of its window median"}
    )
    confirm: int = field(
        default=3, metadata={"help": "consecutive sweeps before a straggler is reported"}
    )
    sweep_ms: float = field(default=2_000.0, metadata={"help": "between straggler sweeps"})
    min_steps: int = field(
        default=32, metadata={"help": "window steps a node needs before it is judged"}
    )
    settle_sweeps: int = field(
        default=5,
        metadata={
            "help": "sweeps after a node's workers (re)start that do not count towards its "
            "role: a restart's transients (the restore, warm standbys importing torch beside "
            "the workers, first steps faulting pages in) pass first"
        },
    )
    baseline_sweeps: int = field(
        default=6,
        metadata={
            "help": "healthy sweeps before its current window a node needs before it is "
            "judged, and at least a window's length of them: their medians are its baseline "
            "(its usual relative cost and wait gap)"
        },
    )
    drift_sweeps: int = field(
        default=30,
        metadata={
            "help": "its baseline is drawn from at most this many of its latest healthy "
            "sweeps before its current window, so a slow drift is followed, and how much they "
            "scatter (a loaded host's wander) is the noise a slowdown must stand out of "
            "(0: its first baseline_sweeps for good)"
        },
    )

    def role_s(self, workers: Iterable[dpb.WorkerStatus] = ()) -> float:
        """Seconds from a node's first judged window until its baseline is taken: its settle
        sweeps, the lag of the longest of `workers`' windows (the sweeps overlapping its
        newer half wait), its baseline sweeps (at least SPAN lags), plus one. Slow a node
        before that and the slowdown is its role."""
        window_ms = max((w.window_steps * (w.compute_ms + w.wait_ms) for w in workers), default=0)
        lag = lag_sweeps(window_ms / self.sweep_ms)
        baseline = least_sweeps(self.baseline_sweeps, lag)
        return (self.settle_sweeps + lag + baseline + 1) * self.sweep_ms / 1000.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"straggler policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.min_slowdown > 1.0:
            raise ValueError(f"straggler min_slowdown must be > 1, got {self.min_slowdown}")
        if not self.k > 0:
            raise ValueError(f"straggler k must be > 0, got {self.k}")
        if self.confirm < 1:
            raise ValueError(f"straggler confirm must be >= 1, got {self.confirm}")
        if not 100.0 <= self.sweep_ms <= 600_000.0:
            raise ValueError(f"straggler sweep_ms must be in [100, 600000], got {self.sweep_ms}")
        if self.settle_sweeps < 0:
            raise ValueError(f"straggler settle_sweeps must be >= 0, got {self.settle_sweeps}")
        if self.baseline_sweeps < 1:
            raise ValueError(f"straggler baseline_sweeps must be >= 1, got {self.baseline_sweeps}")
        if self.drift_sweeps < 0:
            raise ValueError(f"straggler drift_sweeps must be >= 0, got {self.drift_sweeps}")
        if self.min_steps < 4:
            raise ValueError(f"straggler min_steps must be >= 4, got {self.min_steps}")


@dataclass(frozen=True, slots=True)
class Sample:
    """One node's window: medians over its running ranks of each rank's window medians."""

    node_id: str
    generation: int  # changes when its workers restart (a new baseline)
    compute_ms: float
    mad_ms: float
    wait_ms: float
    steps: int
    wait_mad_ms: float = 0.0


def sample(node_id: str, hb: dpb.Heartbeat) -> Sample | None:
    """The node's `Sample` from its newest heartbeat: the agent's summary (`timing`), or the
    same summary of its workers when the sender left it out; None without timings."""
    t = hb.timing if hb.HasField("timing") else node_timing(hb.workers)
    if t is None:
        return None
    return Sample(
        node_id=node_id,
        generation=t.generation,
        compute_ms=t.compute_ms,
        mad_ms=t.mad_ms,
        wait_ms=t.wait_ms,
        steps=t.window_steps,
        wait_mad_ms=t.wait_mad_ms,
    )


def _plausible(s: Sample) -> bool:
    """Timings a sweep can judge: finite, a positive compute, no negative time (an agent's
    heartbeat is input: a NaN or an infinity would break the sorted baselines)."""
    values = (s.compute_ms, s.mad_ms, s.wait_ms, s.wait_mad_ms)
    return all(math.isfinite(v) and v >= 0.0 for v in values) and s.compute_ms > 0.0


def median_without(ordered: Sequence[float], x: float) -> float:
    """The median of sorted `ordered` with one element equal to `x` left out: O(log n)."""
    i = bisect.bisect_left(ordered, x)
    m = len(ordered) - 1

    def rest(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    if m % 2:
        return rest(m // 2)
    return (rest(m // 2 - 1) + rest(m // 2)) / 2.0


SE_MEDIAN = 1.2533 * 1.4826  # a median's standard error per MAD, times sqrt(n)
MAD_SD = 1.4826  # a normal spread's standard deviation per MAD
MAX_LAG = 64  # sweeps a window may span that its baseline leaves out, at most
SPAN = 2  # lags (a window's length) a baseline spans at least


def lag_sweeps(window_sweeps: float) -> int:
    """The newest sweeps that wait to join a baseline: those whose windows overlap the
    newer half of the current one (a straggler's onset is in them)."""
    return min(MAX_LAG, max(1, math.ceil(window_sweeps / 2)))


def least_sweeps(least: int, lag: int) -> int:
    """The sweeps a baseline needs: `least`, and at least SPAN lags (a window's length):
    overlapping windows are nearly one sample, and a scatter taken from them is none."""
    return max(least, SPAN * lag)


def _mid(ordered: Sequence[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2.0


def _sd(ordered: Sequence[float], mid: float) -> float:
    """A standard deviation from the MAD of `ordered` about its median `mid`."""
    return MAD_SD * _mid(sorted(abs(x - mid) for x in ordered))


@dataclass(slots=True)
class _History:
    """A node's healthy sweeps, (relative cost, wait gap) each: the newest `lag` wait
    (their windows overlap the current one's newer half, where a straggler's onset would
    be), and the ones before them are its baseline, kept sorted for their medians. O(log n)
    a sweep: at 10,000 nodes the sweep must not re-sort every node's history."""

    size: int  # drift_sweeps: the baseline's most recent sweeps (0: its first, for good)
    least: int  # baseline_sweeps: how many it needs
    lag: int = 0  # the newest sweeps that wait (the current window's newer half)
    pending: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    kept: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    rels: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)

    def add(self, x: tuple[float, float]) -> None:
        self.pending.append(x)

    def settle(self, lag: int) -> None:
        """The sweeps older than `lag` join the baseline, newer ones wait (the lag follows
        the window's length in sweeps); it keeps its latest max(size, 3 x lag): the median
        of a steady drift then lags it by less than 3 of its scatter's deviations."""
        grew, self.lag = (lag - self.lag if self.size else 0), lag
        for _ in range(min(grew, len(self.kept))):  # its newest baseline sweeps wait again
            x = self.kept.pop()
            self._drop(x)
            self.pending.appendleft(x)
        while len(self.pending) > lag:
            self._keep(self.pending.popleft())

    def _keep(self, x: tuple[float, float]) -> None:
        if not self.size and len(self.kept) >= least_sweeps(self.least, self.lag):
            return  # the first sweeps' baseline, for good
        self.kept.append(x)
        bisect.insort(self.rels, x[0])
        bisect.insort(self.gaps, x[1])
        while self.size and len(self.kept) > max(self.size, 3 * self.lag):
            self._drop(self.kept.popleft())

    def _drop(self, x: tuple[float, float]) -> None:
        del self.rels[bisect.bisect_left(self.rels, x[0])]
        del self.gaps[bisect.bisect_left(self.gaps, x[1])]

    def ready(self) -> bool:
        return len(self.kept) >= least_sweeps(self.least, self.lag)

    @property
    def role(self) -> float:  # its usual relative cost
        return _mid(self.rels)

    @property
    def gap(self) -> float:  # how much longer the others usually wait than it does
        return _mid(self.gaps)

    def role_sd(self) -> float:  # computed only for a node already slow by its window
        return _sd(self.rels, self.role)

    def gap_sd(self) -> float:
        return _sd(self.gaps, self.gap)


@dataclass(slots=True)
class _Track:
    generation: int
    history: _History
    settled: int = 0  # sweeps seen since its workers (re)started, up to settle_sweeps
    streak: int = 0
    reported: bool = False
    hold: int = 0  # sweeps its baseline holds still after a finding (its window's slow steps)


@dataclass(frozen=True, slots=True)
class _Finding:
    evidence: str
    slowdown: float
    z: float


@dataclass(frozen=True, slots=True)
class _Peers:
    """The sweep's ready nodes' figures, each sorted (for `median_without`)."""

    computes: list[float]
    waits: list[float]
    wait_mads: list[float]
    mads: list[float]

    @staticmethod
    def of(ready: Sequence[Sample]) -> _Peers:
        return _Peers(
            computes=sorted(s.compute_ms for s in ready),
            waits=sorted(s.wait_ms for s in ready),
            wait_mads=sorted(s.wait_mad_ms for s in ready),
            mads=sorted(s.mad_ms for s in ready),
        )


@dataclass(slots=True)
class StragglerWatch:
    """Per-node baselines and streaks across sweeps."""

    config: StragglerConfig
    tracks: dict[str, _Track] = field(default_factory=dict)

    def sweep(self, samples: Sequence[Sample]) -> list[ev.Event]:
        """`StragglerSuspected` for each node that just became a confirmed straggler."""
        c = self.config
        ready = [s for s in samples if s.steps >= c.min_steps and _plausible(s)]
        seen = {s.node_id for s in samples}
        for gone in [n for n in self.tracks if n not in seen]:
            del self.tracks[gone]
        if len(ready) < 2:
            return []
        peers = _Peers.of(ready)
        out = []
        for s in ready:
            t = self.tracks.get(s.node_id)
            if t is None or t.generation != s.generation:
                history = _History(size=c.drift_sweeps, least=c.baseline_sweeps)
                t = self.tracks[s.node_id] = _Track(s.generation, history)
            if t.settled < c.settle_sweeps:  # a restart's transients pass first
                t.settled += 1
                continue
            # its compute relative to the others' now: a load on every node cancels out
            others = median_without(peers.computes, s.compute_ms)
            rel = s.compute_ms / others
            others_wait = median_without(peers.waits, s.wait_ms)
            gap = others_wait - s.wait_ms
            window_sweeps = s.steps * (s.compute_ms + s.wait_ms) / c.sweep_ms
            # the sweeps whose windows overlap the newer half of the current one: a
            # straggler's onset is in them, so they are no baseline for it
            lag = lag_sweeps(window_sweeps)
            base = t.history
            base.settle(lag)
            found = self._judge(s, base, peers, rel, others_wait, gap) if base.ready() else None
            if found is None:
                self._healthy(t, rel, gap)
                continue
            t.streak += 1  # a slow sweep does not join its baseline
            if t.streak < c.confirm:
                continue
            if not t.hold:  # a confirmed finding: its onset's sweeps never join it either...
                base.pending.clear()
            t.hold = 2 * math.ceil(window_sweeps) + 1  # ...nor its window's turnover after it
            if t.reported:
                continue
            t.reported = True
            rest = [x for x in ready if x.node_id != s.node_id]
            out.append(
                ev.Event(
                    straggler_suspected=ev.StragglerSuspected(
                        node_id=s.node_id,
                        slowdown=found.slowdown,
                        compute_ms=s.compute_ms,
                        others_ms=statistics.median(x.compute_ms for x in rest),
                        wait_ms=s.wait_ms,
                        others_wait_ms=others_wait,
                        z=found.z,
                        window_steps=s.steps,
                        policy=c.policy,
                        evidence=found.evidence,
                        compute_slowdown=rel / base.role,
                    )
                )
            )
        return out

    def _judge(
        self,
        s: Sample,
        base: _History,
        peers: _Peers,
        rel: float,
        others_wait: float,
        gap: float,
    ) -> _Finding | None:
        """Whether `s` is slow against its baseline, with its evidence (None: not slow)."""
        c = self.config
        slowdown = rel / base.role
        if others_wait > 0 or s.wait_ms > 0:  # the job reports its collective waits
            extra = gap - base.gap
            wait_slowdown = s.compute_ms / max(s.compute_ms - extra, 0.1 * s.compute_ms)
            if wait_slowdown < c.min_slowdown or slowdown <= 1.0:
                return None
            # the window medians' own error, or how much the gap scattered while healthy
            window_se = (
                SE_MEDIAN
                * math.hypot(s.wait_mad_ms, median_without(peers.wait_mads, s.wait_mad_ms))
                / math.sqrt(s.steps)
            )
            if extra < c.k * window_se:
                return None
            wait_z = extra / max(window_se, base.gap_sd(), 1e-3)
            if wait_z >= c.k:
                return _Finding("wait", wait_slowdown, wait_z)
        elif slowdown >= c.min_slowdown:  # no waits: compute alone
            others = median_without(peers.computes, s.compute_ms)
            # the relative errors of its median and of the others' (their typical MAD),
            # or how much its ratio scattered while healthy
            window_se = (
                SE_MEDIAN
                * math.hypot(s.mad_ms / s.compute_ms, median_without(peers.mads, s.mad_ms) / others)
                / math.sqrt(s.steps)
            )
            if slowdown - 1.0 < c.k * window_se:
                return None
            z = (slowdown - 1.0) / max(window_se, base.role_sd() / base.role, 1e-6)
            if z >= c.k:
                return _Finding("compute", slowdown, z)
        return None

    def _healthy(self, t: _Track, rel: float, gap: float) -> None:
        """A sweep without a finding: the streak ends, and the sweep joins its history
        (unless its window still holds a finding's slow steps)."""
        t.streak, t.reported = 0, False
        if t.hold > 0:
            t.hold -= 1
        else:
            t.history.add((rel, gap))
