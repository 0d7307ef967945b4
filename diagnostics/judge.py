"""The judge: from the members' check results, did the group fail, whom to blame, who is slow.

Failures (``judge_group``). A group fails when any member's matmul checksum is wrong or
holds NaN (silent corruption; that member is *blamed* directly, since the product was
computed on its own device), when any chunk of the all-gather is wrong, when a member
times out or never reports. Members whose own matmul was right and who received every
all-gather chunk intact are *cleared* when the only failures are blamed members' own
matmuls; otherwise the failure cannot be pinned on a member and the planner bisects.

Slowness (``find_slow``). Each round every member reports its device time per matmul
iteration; the judge takes the lower quartile (interference from other processes only
ever adds time, a slow device slows every iteration). Rounds differ (round 1 holds
everyone, round 2 a few suspects and partners), so times are fitted as
``log t[node, round] = speed[node] + level[round]`` by alternating medians (median
polish): a round's level is estimated from every node's own speed, and a slow partner
in a small round does not make its mates look fast. A node's score is
exp(its speed minus the median speed of the *other* nodes) (leave-one-out: a slow node
cannot drag the reference toward itself, and the rule works with two nodes). It is
slow when

    score > 1 + max(min_rel, k * sqrt(spread**2 + noise**2))

where ``spread`` is the scaled MAD (1.4826 * MAD, a robust sigma) of the other nodes'
scores and ``noise`` the node's own measurement noise: the scaled MAD of its per-iteration
times over their median, divided by sqrt(iterations). For large N ``spread`` dominates
(median + k * MAD across the fleet); for N = 2 or 3, where a MAD across nodes means
nothing, the repeated timings of each node stand in for it, and ``min_rel`` keeps
ordinary part-to-part variation from being named. ``k`` rises with N (see
``JudgeConfig.family_alpha``) so that the chance of naming any healthy node stays small
in a fleet of thousands. The same rule runs per group on the
all-gather times (per link): a node whose groups are slow with at least two different
partners is named; a single slow group is reported as a suspect link pair.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TypeVar

from unbroken.diagnostics.planner import GroupOutcome
from unbroken.diagnostics.schema import CheckResult

K = TypeVar("K")
MAD_TO_SIGMA = 1.4826
_OWN_FAULTS = ("matmul", "nan")
_PRECEDENCE = ("matmul", "nan", "allgather", "timeout", "rendezvous", "missing", "error")


@dataclass(kw_only=True, slots=True)
class JudgeConfig:
    """Thresholds of the slow-node rule (see the module docstring).

    Attributes:
        k: how many robust sigmas above the reference counts as slow.
        min_rel: the smallest relative slowdown ever named (0.05 = 5 %).
        link_min_rel: the same for all-gather times, which are noisier.
        family_alpha: the chance of naming any healthy node in a fleet of Gaussian noise;
            ``k`` grows to the normal quantile 1 - family_alpha / N when that is larger
            (4.0 at N = 316, 4.6 at N = 4096), so big fleets do not name a node per run.
    """

    k: float = 4.0
    min_rel: float = 0.05
    link_min_rel: float = 0.5
    family_alpha: float = 0.01

    def __post_init__(self) -> None:
        if not (math.isfinite(self.k) and self.k > 0):
            raise ValueError(f"k must be > 0, got {self.k}")
        if not 0 <= self.min_rel < 10:
            raise ValueError(f"min_rel must be in [0, 10), got {self.min_rel}")
        if not 0 < self.family_alpha < 1:
            raise ValueError(f"family_alpha must be in (0, 1), got {self.family_alpha}")
        if not 0 <= self.link_min_rel < 10:
            raise ValueError(f"link_min_rel must be in [0, 10), got {self.link_min_rel}")


def judge_group(group: Sequence[str], results: Mapping[str, CheckResult | None]) -> GroupOutcome:
    """The outcome of one group check from its members' results (absent = never reported)."""
    failures: dict[str, str] = {}
    for node in group:
        r = results.get(node)
        if r is None:
            failures[node] = "missing"
        elif not r.ok:
            failures[node] = r.failure or "error"
    if not failures:
        return GroupOutcome(nodes=tuple(group), ok=True)
    blamed = frozenset(n for n, f in failures.items() if f in _OWN_FAULTS)
    only_own = set(failures) == blamed
    cleared = frozenset(n for n in group if n not in failures) if only_own else frozenset()
    reasons = sorted(set(failures.values()), key=lambda f: _rank(f))
    return GroupOutcome(
        nodes=tuple(group), ok=False, failure=reasons[0], blamed=blamed, cleared=cleared
    )


def _rank(failure: str) -> int:
    return _PRECEDENCE.index(failure) if failure in _PRECEDENCE else len(_PRECEDENCE)


def scaled_mad(xs: Sequence[float]) -> float:
    """1.4826 * median absolute deviation: a sigma estimate that ignores outliers."""
    if len(xs) < 2:
        return 0.0
    med = statistics.median(xs)
    return MAD_TO_SIGMA * statistics.median(abs(x - med) for x in xs)


@dataclass(kw_only=True, slots=True)
class SlowReport:
    """Who is slow, with the numbers behind it.

    Attributes:
        slow: nodes named slow (compute or link), sorted.
        scores: node -> median ratio of its matmul time to the others'.
        thresholds: node -> the score above which it would be named.
        link_scores: node -> median ratio of its groups' all-gather time to the others'.
        slow_links: slow groups that cannot be pinned on one member.
    """

    slow: tuple[str, ...] = ()
    scores: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    link_scores: dict[str, float] = field(default_factory=dict)
    slow_links: tuple[tuple[str, ...], ...] = ()


def _device_time(r: CheckResult) -> float:
    """The lower quartile of a node's matmul times: interference only ever adds time."""
    xs = sorted(x for x in r.matmul_samples_ms if x > 0)
    return xs[(len(xs) - 1) // 4] if len(xs) >= 4 else r.matmul_ms


def _rel_noise(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return 0.0
    med = statistics.median(samples)
    return scaled_mad(samples) / med / math.sqrt(len(samples)) if med > 0 else 0.0


# Above this many values, leaving one out moves a median or MAD by nothing that matters,
# and the O(N^2) leave-one-out would cost seconds at thousands of nodes.
_LOO_MAX = 64


def _leave_one_out(values: Mapping[K, float]) -> dict[K, float]:
    out: dict[K, float] = {}
    whole = statistics.median(values.values()) if len(values) > _LOO_MAX else 0.0
    for n, v in values.items():
        if whole:
            ref = whole
        else:
            others = [x for m, x in values.items() if m != n]
            ref = statistics.median(others) if others else 0.0
        if ref > 0:
            out[n] = v / ref
    return out


def _median_polish(per_round: Sequence[Mapping[str, float]], sweeps: int = 10) -> dict[str, float]:
    """Per-node log speed from ``log t[node, round] = s[node] + c[round]`` fitted by medians.

    Rounds differ in load and size (round 2 may hold four nodes, two of them slow), so a
    node's time is compared with the round's level as estimated from every node's own
    speed, not with whoever happened to share that round.
    """
    logs = [{n: math.log(t) for n, t in r.items() if t > 0} for r in per_round]
    nodes = {n for r in logs for n in r}
    s = dict.fromkeys(nodes, 0.0)
    c = [0.0] * len(logs)
    for _ in range(sweeps):
        c = [statistics.median(v - s[n] for n, v in r.items()) if r else 0.0 for r in logs]
        s = {n: statistics.median(r[n] - c[i] for i, r in enumerate(logs) if n in r) for n in nodes}
    return s


def _leave_one_out_log(values: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    whole = statistics.median(values.values()) if len(values) > _LOO_MAX else None
    for n, v in values.items():
        if whole is not None:
            out[n] = v - whole
            continue
        others = [x for m, x in values.items() if m != n]
        if others:
            out[n] = v - statistics.median(others)
    return out


def _named(
    scores: Mapping[str, float], noise: Mapping[str, float], min_rel: float, cfg: JudgeConfig
) -> tuple[set[str], dict[str, float]]:
    named: set[str] = set()
    k = max(cfg.k, NormalDist().inv_cdf(1.0 - cfg.family_alpha / max(1, len(scores))))
    thresholds: dict[str, float] = {}
    whole = scaled_mad(list(scores.values())) if len(scores) > _LOO_MAX else None
    for n, s in scores.items():
        if whole is not None:
            spread = whole
        else:
            others = [x for m, x in scores.items() if m != n]
            spread = scaled_mad(others) if len(others) >= 3 else 0.0
        thr = 1.0 + max(min_rel, k * math.hypot(spread, noise.get(n, 0.0)))
        thresholds[n] = thr
        if s > thr:
            named.add(n)
    return named, thresholds


def find_slow(
    rounds: Sequence[Mapping[tuple[str, ...], Mapping[str, CheckResult | None]]],
    *,
    exclude: Sequence[str] = (),
    config: JudgeConfig | None = None,
) -> SlowReport:
    """Name the slow nodes from every round's results.

    Args:
        rounds: per round, group -> (node -> result).
        exclude: nodes already found bad (their times mean nothing).
        config: thresholds.

    Returns:
        The report; ``slow`` never contains an excluded node.
    """
    cfg = config or JudgeConfig()
    skip = set(exclude)
    noises: dict[str, list[float]] = defaultdict(list)
    link_ratios: dict[str, list[float]] = defaultdict(list)
    link_noise: dict[str, list[float]] = defaultdict(list)
    partners: dict[str, list[tuple[tuple[str, ...], float]]] = defaultdict(list)
    per_round: list[dict[str, float]] = []
    for round_ in rounds:
        times: dict[str, float] = {}
        for members in round_.values():
            for n, r in members.items():
                usable = r is not None and r.failure not in _OWN_FAULTS and r.matmul_ms > 0
                if n not in skip and usable and r is not None:
                    times[n] = _device_time(r)
                    noises[n].append(_rel_noise(r.matmul_samples_ms))
        per_round.append(times)
        gtimes: dict[tuple[str, ...], float] = {}
        gnoise: dict[tuple[str, ...], float] = {}
        for group, members in round_.items():
            rs = [r for r in members.values() if r is not None and r.allgather_ms > 0]
            if len(group) >= 2 and len(rs) == len(group) and not set(group) & skip:
                gtimes[group] = statistics.median(r.allgather_ms for r in rs)
                gnoise[group] = statistics.median(_rel_noise(r.allgather_samples_ms) for r in rs)
        for group, ratio in _leave_one_out(gtimes).items():
            for n in group:
                link_ratios[n].append(ratio)
                link_noise[n].append(gnoise[group])
                partners[n].append((group, ratio))
    speed = _median_polish(per_round)
    scores = {n: math.exp(v) for n, v in _leave_one_out_log(speed).items()}
    noise = {n: statistics.median(v) for n, v in noises.items() if v}
    slow, thresholds = _named(scores, noise, cfg.min_rel, cfg)
    link_scores = {n: statistics.median(v) for n, v in link_ratios.items()}
    lnoise = {n: statistics.median(v) for n, v in link_noise.items() if v}
    link_slow, link_thr = _named(link_scores, lnoise, cfg.link_min_rel, cfg)
    slow_links: set[tuple[str, ...]] = set()
    for n in link_slow:
        slow_groups = {g for g, ratio in partners[n] if ratio > link_thr[n]}
        mates = {m for g in slow_groups for m in g if m != n}
        if len(slow_groups) >= 2 and len(mates) >= 2:
            slow.add(n)
        else:
            slow_links.update(slow_groups)
    slow_links = {g for g in slow_links if not set(g) & slow}
    return SlowReport(
        slow=tuple(sorted(slow)),
        scores=scores,
        thresholds=thresholds,
        link_scores=link_scores,
        slow_links=tuple(sorted(slow_links)),
    )
