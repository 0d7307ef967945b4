"""Silent data corruption: judging the ranks' state fingerprints (docs/sdc.md).

Each rank of the embedded engine hashes its whole state every `--fingerprint-every` steps
(trainer/sdc.py) and sends one 64-bit fingerprint per *replica key* (the bytes it must
hold); its agent passes the newest few on in every heartbeat (`WorkerStatus.fingerprints`).
Ranks that report the same key at the same step must report the same fingerprint. The
`FingerprintBook` gathers them per step from the live view; once every rank of the world
reported a step, `judge` compares each key's group:

- every group agrees, and every rank's state was compared with at least one other rank's:
  the step is *verified* (a `StepVerified` event; a checkpoint of it is known to be good);
- a group disagrees: the ranks outside its strict majority are the suspects, an
  `SdcSuspected` event. With two ranks (or several of the same size) no majority exists: the
  compute probe's history (every rank computes the same bytes, so a rank whose probe left
  the world's earlier agreed value is the odd one) or a suspect named by another key breaks
  the tie; otherwise both sides are named and the event says it is unresolved.

A third opinion comes from each rank's buddy, the node holding its flash copies: it
recomputes the rank's fingerprints and the replay of the rank's weights from the rank's copy
of the step (recovery/sdcbuddy.py). A rank whose own report differs from its buddy's is a
suspect whatever its replicas say, breaks a tie it is part of, and a rank no replica holds
is verified by a buddy that agreed (`judge`'s `opinions`; the book waits for them).

Everything here is pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from unbroken.common.sdckeys import REPLAY_PREFIX, replay_agrees

PROBE_KEY = "probe"  # trainer/sdc.py's compute probe: every rank of a world agrees
KEEP_PENDING = 8  # steps waiting for their last ranks' fingerprints
KEEP_MAX = 4 * KEEP_PENDING  # steps kept at most (fingerprints and opinions)
# how long a complete step waits for its buddies' opinions (the copy's send, the buddy's
# recomputation and its next heartbeat: well under a second on an idle host)
OPINION_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one fingerprinted step says."""

    step: int
    verified: bool  # every group agreed and every rank's state was compared
    suspects: tuple[int, ...] = ()  # ranks holding the minority's bytes
    resolved: bool = True  # the suspects are a minority (not both sides of a tie)
    keys: tuple[str, ...] = ()  # the keys that disagreed
    groups: int = 0  # groups of two or more ranks compared
    detail: str = ""
    checked: int = 0  # ranks whose report their buddy's recomputation of their copy matched

    @property
    def disagreed(self) -> bool:
        return bool(self.keys)


def buddy_says(own: Mapping[str, int], buddy: Mapping[str, int]) -> str:
    """Why a rank's own report of a step differs from its buddy's recomputation of the
    rank's copy of that step ("" when they agree): a replica key's hash (the state the rank
    hashed is not the state it copied, or its device hashed wrong) or the replay of its
    weights (its device multiplies differently from the buddy's)."""
    keys = sorted(
        k for k in own if k in buddy and not k.startswith(REPLAY_PREFIX) and k != PROBE_KEY
    )
    bad = [k for k in keys if own[k] != buddy[k]]
    if bad:
        return f"keys {bad} differ from its copy's"
    if not replay_agrees(own, buddy):
        return "its replay of its own weights differs from the buddy's"
    return ""


def judge(
    step: int,
    reports: Mapping[int, Mapping[str, int]],
    probe_ref: int | None = None,
    opinions: Mapping[int, Mapping[str, int]] | None = None,
) -> Verdict:
    """Compare the fingerprints every rank reported for `step` ({rank: {key: hash}}).

    `probe_ref`: the probe's value the world last agreed on (None: not known yet), which
    names the odd rank of a tied probe. `opinions`: the buddies' recomputations from the
    ranks' copies of `step` ({rank: {key: hash}}, those formed): a rank whose own report
    differs from its buddy's (`buddy_says`) is a suspect whatever its replicas say, and
    names the odd side of a tie it is part of.
    """
    by_key: dict[str, dict[int, int]] = {}
    for rank, fps in reports.items():
        for key, h in fps.items():
            if not key.startswith(REPLAY_PREFIX):  # compared with the buddy's alone
                by_key.setdefault(key, {})[rank] = h
    resolved_bad, bad_keys, notes, checked = _buddy_opinions(reports, opinions or {})
    ties: list[tuple[str, set[int]]] = []
    groups = 0
    compared: dict[int, bool] = {r: True for r in reports}
    for key in sorted(by_key):
        members = by_key[key]
        if len(members) >= 2:
            groups += 1
        elif key != PROBE_KEY:
            for r in members:
                compared[r] = False  # nobody else holds these bytes
        counts = Counter(members.values())
        if len(counts) <= 1:
            continue
        bad_keys.append(key)
        (top, n_top), *rest = counts.most_common()
        if rest and rest[0][1] == n_top:  # a tie: no majority
            if key == PROBE_KEY and probe_ref is not None and probe_ref in counts:
                odd = {r for r, h in members.items() if h != probe_ref}
                resolved_bad |= odd
                notes.append(f"{key}: ranks {sorted(odd)} left the probe's agreed value")
            else:
                ties.append((key, set(members)))
            continue
        odd = {r for r, h in members.items() if h != top}
        resolved_bad |= odd
        notes.append(f"{key}: ranks {sorted(odd)} against {n_top} agreeing")
    resolved = True
    suspects = set(resolved_bad)
    for key, tied in ties:
        if tied & resolved_bad:
            notes.append(f"{key}: a tie, whose odd rank another key named (or its buddy)")
            continue
        suspects |= tied
        resolved = False
        notes.append(f"{key}: ranks {sorted(tied)} disagree with no majority")
    # a rank no replica holds is verified by its buddy: its copy holds what it hashed
    verified = (
        not bad_keys and bool(reports) and all(c or r in checked for r, c in compared.items())
    )
    return Verdict(
        step=step,
        verified=verified,
        suspects=tuple(sorted(suspects)),
        resolved=resolved,
        keys=tuple(bad_keys),
        groups=groups,
        detail="; ".join(notes),
        checked=len(checked),
    )


def _buddy_opinions(
    reports: Mapping[int, Mapping[str, int]], opinions: Mapping[int, Mapping[str, int]]
) -> tuple[set[int], list[str], list[str], set[int]]:
    """(ranks their buddies contradict, their keys, notes, ranks their buddies confirm)."""
    bad: set[int] = set()
    keys: list[str] = []
    notes: list[str] = []
    checked: set[int] = set()
    for rank, theirs in sorted(opinions.items()):
        own = reports.get(rank)
        if own is None:
            continue
        why = buddy_says(own, theirs)
        if why:
            bad.add(rank)
            keys.append(f"buddy:{rank}")
            notes.append(f"rank {rank}: {why} (its buddy's recomputation)")
        else:
            checked.add(rank)
    return bad, keys, notes, checked


@dataclass(slots=True)
class FingerprintBook:
    """The fingerprints of a running world, per step, until every rank reported one.

    `add` the fingerprints read from heartbeats (repeats are ignored), and `add_opinion`
    the buddies' recomputations from the ranks' copies; then `ready` returns the verdict of
    each step every one of `world_size` ranks reported, oldest first. A complete step waits
    up to `opinion_wait_s` for its buddies' opinions: always when its replicas tie, and for
    every step once any opinion came (a world with buddies). Steps at or before a judged
    one are dropped, and so are incomplete steps `KEEP_PENDING` steps behind; a complete
    step waiting for opinions is judged with those it has once `KEEP_MAX // 2` newer steps
    came; at most `KEEP_MAX` are kept.
    """

    world_size: int
    pending: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)
    judged: int = -1  # the newest judged step
    probe_ref: int | None = None  # the probe value of the newest step whose probe agreed
    opinion_wait_s: float = OPINION_WAIT_S
    opinions: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)
    opinions_seen: bool = False  # a buddy formed an opinion in this world
    complete_at: dict[int, float] = field(default_factory=dict)  # step -> when complete

    def add_opinion(self, rank: int, step: int, fingerprints: Mapping[str, int]) -> None:
        """A buddy's recomputation of `rank`'s copy of `step` (empty: it could form none)."""
        if rank < 0 or rank >= self.world_size:
            return
        self.opinions_seen = True  # (a late one too: the next steps wait for theirs)
        if step <= self.judged:
            return
        self.opinions.setdefault(step, {}).setdefault(rank, dict(fingerprints))
        while len(self.opinions) > KEEP_MAX:
            del self.opinions[min(self.opinions)]

    def add(self, rank: int, step: int, fingerprints: Mapping[str, int]) -> None:
        if step <= self.judged or rank < 0 or rank >= self.world_size:
            return
        at = self.pending.setdefault(step, {})
        at.setdefault(rank, dict(fingerprints))
        while len(self.pending) > KEEP_MAX:
            del self.pending[min(self.pending)]

    def ready(self, now: float = 0.0) -> list[Verdict]:
        """The verdicts of the steps complete now (`now`: a monotonic clock, for the wait
        for opinions)."""
        out: list[Verdict] = []
        steps = sorted(self.pending)
        for i, step in enumerate(steps):
            reports = self.pending[step]
            newer = len(steps) - i - 1
            if len(reports) < self.world_size:
                if newer >= KEEP_PENDING:
                    del self.pending[step]  # its last ranks' reports will not come
                continue
            got = self.opinions.get(step, {})
            opinions = {r: fps for r, fps in got.items() if fps}
            v = judge(step, reports, self.probe_ref, opinions)
            waiting = len(got) < self.world_size and (
                self.opinions_seen or (v.disagreed and not v.resolved)
            )
            since = now - self.complete_at.setdefault(step, now)
            if waiting and newer < KEEP_MAX // 2 and since < self.opinion_wait_s:
                break  # judged in order: later steps wait behind it
            probes = {fps.get(PROBE_KEY) for fps in reports.values()}
            if len(probes) == 1 and None not in probes:
                self.probe_ref = probes.pop()
            out.append(v)
            self.judged = step
        for book in (self.pending, self.opinions, self.complete_at):
            for step in [s for s in book if s <= self.judged]:
                del book[step]
        return out


def rollback_target(step: int, verified: Iterable[int], held: Iterable[int]) -> int | None:
    """The newest verified step before `step` that can be restored (`held`: committed or in
    every rank's ring), or None."""
    ok = set(held)
    good = [v for v in verified if v < step and v in ok]
    return max(good) if good else None
