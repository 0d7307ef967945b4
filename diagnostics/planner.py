"""The bisection planner: which groups of nodes to check next, or the verdict. Pure.

The planner is a function of (nodes under diagnosis, nodes known good, outcomes so far);
it reads no clock and does no I/O, so the driver can replay it and the tests can run it
on simulated clusters of thousands of nodes.

Model. A *check* runs on a group of nodes at once (a matmul on each, an all-gather
across them). A group fails when at least one of its members is bad. In a round every
node is in at most one group, and all groups of a round run in parallel, so the cost that
matters is the number of rounds (each one is a rendezvous), then the number of checks.

Knowledge after some rounds:
* good: known-good nodes (``known_good``: spares or nodes with a clean history, trusted
  as partners and never named bad), every member of a group that passed, and members the
  judge cleared in a failed group (their part was right; a blamed member's own matmul
  explains the failure);
* bad, *confirmed directly*: a node the judge blames from its own output (its matmul
  checksum was wrong), or the only not-known-good member of a failed group whose other
  members were already known good when the round was planned (a suspect paired with a
  good node);
* bad, *inferred*: the only member of a failed group that is not good, once the others
  have been cleared by later rounds (a failed pair whose mate passed elsewhere);
* unknown: everything else. The verdict comes when nothing is unknown.

Rounds.
1. Round 1 pairs the nodes (node i with node i + N/2 in the given order; an odd one out
   joins the last pair: a three-way check).
   Members of failed pairs are suspects; everyone in a passed pair is good.
2. Later rounds pair each unknown node with a known-good partner, one partner per
   unknown, so one round settles them all when good nodes are plentiful (the usual case:
   a few bad nodes among many). When partners run short (many faults), the remaining
   unknowns are re-paired among themselves across the old failed pairs: group testing
   with groups of two. Pairs are the right group size here: partners are scarce only
   when the fault rate among unknowns is high, and above (3 - sqrt 5) / 2 ~ 38 % larger
   groups carry less information than pairs. Each such round clears the good pairs,
   which become partners, so the number of rounds grows like log of the fault count.
   Where partners are scarce the planner tests one member of a failed pair first; if it
   is good, the other is bad by elimination without a check of its own. When the fault
   rate estimated so far is above 38 % (so pairs of unknowns would mostly fail again),
   the unknowns without a partner get solo checks (below) instead.
3. Identifiability. With groups of two or more only, some cases cannot be decided: if
   every node is bad, or all but one, every group fails whatever the truth (N = 3 with
   two bad looks the same as three bad), and N = 1 or a failed pair of N = 2 has no
   partner at all. So when no node is known good after round 1 the planner falls back to
   *solo* checks (a group of one: the matmul checksum and a local collective). Solo checks
   exercise compute, not the network, which is why they are the last resort. With
   ``allow_solo=False`` such nodes end as ``undetermined`` instead. A failed group whose
   members are all good otherwise (possible only with a fault of the link between them,
   or a flaky check) is reported as a suspect link, not as a bad node.

Under truthful checks the verdict names exactly the bad nodes (property-tested in
tests/unit/test_planner_props.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Group = tuple[str, ...]

# Above this fault rate, testing one node at a time beats any group test (Ungar 1960).
SOLO_ABOVE_FAULT_RATE = 0.38


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """What the judge concluded about one group check.

    Attributes:
        nodes: the group's members, in rank order.
        ok: True when the check passed.
        failure: why it failed ("matmul", "nan", "allgather", "timeout", ...), "" if ok.
        blamed: members the judge can blame from their own output (wrong matmul, NaN).
        cleared: members the judge can clear although the group failed (their own matmul
            was right and the all-gather delivered every chunk, so the failure is wholly
            explained by the blamed members' own output).
    """

    nodes: Group
    ok: bool
    failure: str = ""
    blamed: frozenset[str] = frozenset()
    cleared: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Round:
    """The groups to check in round ``index`` (1-based); every node in at most one."""

    index: int
    groups: tuple[Group, ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The end of a diagnosis.

    Attributes:
        bad: nodes found bad (sorted).
        confirmed_directly: the subset of ``bad`` with direct evidence (own output wrong,
            or failed next to known-good partners); the rest were inferred by elimination.
        slow: nodes found slow (filled in by the judge; the planner sees no times).
        undetermined: nodes the checks could not decide (only with ``allow_solo=False``
            or when ``max_rounds`` ran out).
        suspect_links: failed groups whose members are all otherwise good.
        rounds: rounds used.
        checks: group checks used.
    """

    bad: tuple[str, ...]
    confirmed_directly: tuple[str, ...]
    slow: tuple[str, ...] = ()
    undetermined: tuple[str, ...] = ()
    suspect_links: tuple[Group, ...] = ()
    rounds: int = 0
    checks: int = 0


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """Planner settings.

    Attributes:
        allow_solo: use single-node checks when no node is known good (see module doc).
        max_rounds: stop and report the rest as undetermined after this many rounds.
    """

    allow_solo: bool = True
    max_rounds: int = 32

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")


@dataclass(slots=True)
class Knowledge:
    """What the outcomes so far prove (see the module docstring)."""

    good: set[str] = field(default_factory=set)
    bad: set[str] = field(default_factory=set)
    direct: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    open_failures: list[set[str]] = field(default_factory=list)  # unexplained, >= 2 unknown
    suspect_links: list[Group] = field(default_factory=list)


def analyze(
    nodes: Iterable[str], known_good: Iterable[str], history: Sequence[Sequence[GroupOutcome]]
) -> Knowledge:
    """Derive good, bad and unknown nodes from the outcomes of the rounds so far."""
    node_set = set(nodes)
    k = Knowledge(good=set(known_good))
    failed: list[GroupOutcome] = []
    for round_ in history:
        good_before = frozenset(k.good)
        for g in round_:
            if g.ok:
                k.good.update(g.nodes)
                continue
            failed.append(g)
            k.direct.update(g.blamed)
            k.good.update(g.cleared)
            rest = set(g.nodes) - good_before
            if len(rest) == 1:
                k.direct.update(rest)
    # Direct evidence wins over an earlier pass (an intermittent fault is still a fault).
    k.bad = set(k.direct)
    k.good -= k.bad
    changed = True
    while changed:
        changed = False
        for g in failed:
            rest = set(g.nodes) - k.good
            if rest & k.bad or len(rest) != 1:
                continue
            k.bad |= rest
            changed = True
    for g in failed:
        rest = set(g.nodes) - k.good
        if not rest:
            k.suspect_links.append(g.nodes)
        elif not rest & k.bad:
            k.open_failures.append(rest)
    k.unknown = node_set - k.good - k.bad
    return k


def next_step(
    nodes: Sequence[str],
    known_good: Iterable[str] = (),
    history: Sequence[Sequence[GroupOutcome]] = (),
    config: PlannerConfig | None = None,
) -> Round | Verdict:
    """The next round to run, or the verdict when every node is decided.

    Args:
        nodes: the nodes under diagnosis (ids must be unique).
        known_good: trusted healthy nodes (in ``nodes`` or outside it, e.g. spares) that
            may be used as partners; they are never named bad.
        history: the outcomes of every earlier round, in order.
        config: planner settings.

    Returns:
        A ``Round`` to run next, or the ``Verdict``.

    Raises:
        ValueError: when ``nodes`` is empty or has duplicates.
    """
    cfg = config or PlannerConfig()
    if not nodes:
        raise ValueError("nodes is empty: give at least one node to diagnose")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"nodes has duplicate ids: {sorted(nodes)}")
    k = analyze(nodes, known_good, history)
    rounds_done = len(history)
    if not k.unknown:
        return _verdict(k, history, ())
    if rounds_done >= cfg.max_rounds:
        return _verdict(k, history, k.unknown)
    order = {n: i for i, n in enumerate(nodes)}
    groups = _plan(k, order, first=rounds_done == 0, cfg=cfg)
    if not groups:
        return _verdict(k, history, k.unknown)
    return Round(index=rounds_done + 1, groups=tuple(groups))


def _verdict(
    k: Knowledge, history: Sequence[Sequence[GroupOutcome]], undetermined: Iterable[str]
) -> Verdict:
    return Verdict(
        bad=tuple(sorted(k.bad)),
        confirmed_directly=tuple(sorted(k.direct)),
        undetermined=tuple(sorted(undetermined)),
        suspect_links=tuple(k.suspect_links),
        rounds=len(history),
        checks=sum(len(r) for r in history),
    )


def _fault_rate(k: Knowledge) -> float:
    """A lower-bound estimate of the fault rate among the nodes tested so far."""
    tested = len(k.bad) + len(k.good) + len(k.unknown)
    return (len(k.bad) + len(k.open_failures)) / max(1, tested)


def _plan(k: Knowledge, order: dict[str, int], *, first: bool, cfg: PlannerConfig) -> list[Group]:
    def key(n: str) -> tuple[int, str]:
        return (order.get(n, len(order)), n)

    partners = sorted(k.good, key=key)
    if not first and not partners:
        # Nothing is known good after a full round: only solo checks can decide.
        if cfg.allow_solo:
            return [(n,) for n in sorted(k.unknown, key=key)]
        return []
    # Unknowns in an unexplained failure, ordered so one member of each comes first:
    # if partners run out, that member alone often settles its mate by elimination.
    firsts: list[str] = []
    seconds: list[str] = []
    seen: set[str] = set()
    for rest in sorted(k.open_failures, key=lambda r: min(key(n) for n in r)):
        members = [n for n in sorted(rest, key=key) if n not in seen]
        seen.update(members)
        firsts.extend(members[:1])
        seconds.extend(members[1:])
    others = sorted(k.unknown - seen, key=key)
    queue = firsts + seconds + others
    if len(partners) >= len(queue):
        return [(u, p) for u, p in zip(queue, partners, strict=False)]
    groups: list[Group] = [(u, p) for u, p in zip(queue, partners, strict=False)]
    rest_queue = queue[len(partners) :]
    if cfg.allow_solo and not first and _fault_rate(k) > SOLO_ABOVE_FAULT_RATE:
        # So many faults that pairs of unknowns would mostly fail again: decide now.
        return groups + [(n,) for n in rest_queue]
    # Group testing among the remaining unknowns: pair across old failed groups.
    # Sort by old failure so mates sit next to each other, then pair i with i + half.
    fail_of: dict[str, int] = {}
    for i, rest in enumerate(k.open_failures):
        for n in rest:
            fail_of.setdefault(n, i)
    rest_queue.sort(key=lambda n: (fail_of.get(n, len(k.open_failures)), key(n)))
    half = (len(rest_queue) + 1) // 2
    pairs = [(rest_queue[i], rest_queue[i + half]) for i in range(len(rest_queue) - half)]
    groups.extend(pairs)
    if len(rest_queue) % 2:
        odd = rest_queue[half - 1]
        if pairs:
            a, b = pairs[-1]
            groups[-1] = (a, b, odd)  # a three-way check
        elif not groups:
            return [(odd,)] if cfg.allow_solo else []
        # else: it waits one round for a partner freed by this round's passes.
    return groups
