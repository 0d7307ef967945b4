"""Which flash copies an agent sends its buddy, and when (`ReplicaSender`).

The transfer itself (authentication, the wire format, the buddy's checks) is
recovery/replica.py; this module decides the copies: every rank's copy of the same step, spaced
out so the replicated step stays inside every rank's ring, flushed when training idles, and
retried with a capped backoff.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from unbroken.common.sdckeys import SDC_META
from unbroken.recovery.flashcopy import CopyRef, CorruptCopyError, list_copies, read_copy
from unbroken.recovery.flashowner import FlashOwner
from unbroken.recovery.replica import SendResult, send_copy
from unbroken.recovery.replicaauth import ReplicaConfig

log = structlog.get_logger(__name__)


# How far inside the ring a replicated step is kept when sends are spaced out (copies).
REPLICA_MARGIN = 3
# A newest copy no newer save has followed for this long is sent whatever the spacing.
IDLE_FLUSH_S = 1.0
# A replica is never older than about this when saves are slower than the ring's spacing.
REPLICA_EVERY_S = 1.0
#: The share of the agent's time that sending replicas may take: the sends' CPU time on the
#: flash thread over the time between them. While the last sends cost less (a small state:
#: milliseconds a copy), every newer copy goes at the next tick, so a lost node's ranks
#: restore a step or two back, not up to `k - REPLICA_MARGIN` saves (bench recovery, tiny
#: model, 0.06 s steps, a ring of 16: node loss lost 1 step, median of 5). Not higher by
#: default: at 0.2 (of the wall time, as it was measured then) the steps with flash saves ran
#: at 0.83-0.85 of those without, where 0.05 gave 0.92-0.98 in the same rounds, and 0.05 of
#: the CPU time 0.90-1.02, median 0.946 (`--replica-duty`; docs/in-job-recovery.md).
REPLICA_DUTY = 0.05
# After a failed send a rank's next try waits this long, doubling per failure up to the cap.
RETRY_FIRST_S = 0.1
RETRY_CAP_S = 5.0


class ReplicaSender:
    """The sending agent's side: ships each local rank's newest copy to the buddy (the
    newest step all local ranks hold, the same for every rank: `same_step`).

    Not every copy: with a ring of k copies a copy goes every `k - REPLICA_MARGIN` saves
    (every save when k <= 4), or once `REPLICA_EVERY_S` has passed since the last one
    when that comes first (slow steps), so the replicated step stays inside every rank's ring (a
    restore after this node is lost needs one step that all ranks hold in memory, and the
    survivors' rings turn at the same pace as this one), while the agent spends a fraction
    of the CPU it would copying every step. A copy no newer save has followed for
    `IDLE_FLUSH_S` goes at once: when training pauses or stops, the last copy is the one
    worth having. And while the sends cost little (their CPU time stays under
    `REPLICA_DUTY` of the time between them), every newer copy goes: the spacing is for
    states whose copies are costly. The agent calls `tick()` on its poll timer.

    A failed send is retried after `RETRY_FIRST_S`, doubling up to `RETRY_CAP_S` while the
    buddy stays unreachable (not 10 tries a second, each logged). A copy the buddy received
    whole but found corrupt is read back here: if it fails its checksum here too it is never
    sent again (the next newer copy is); if not, it was damaged in transit and is retried.
    """

    def __init__(
        self,
        owner: FlashOwner,
        node: str,
        buddy: tuple[str, int],
        config: ReplicaConfig | None = None,
        *,
        idle_flush_s: float = IDLE_FLUSH_S,
        every_s: float = REPLICA_EVERY_S,
        buddy_node: str = "",
        duty: float = REPLICA_DUTY,
    ) -> None:
        self.owner = owner
        self.node = node
        self.buddy = buddy
        self.buddy_node = buddy_node  # who the buddy must be (TLS); "": any node of the CA
        self.config = config or ReplicaConfig()
        self.idle_flush_s = idle_flush_s
        self.every_s = every_s
        self.duty = duty
        self._send_cost_s: float | None = None  # a tick's sends, smoothed (None: none yet)
        self._picked_at: float | None = None  # when the last tick's sends ended
        self._sent: dict[int, int] = {}  # rank -> generation acknowledged by the buddy
        self._sent_at: dict[int, float] = {}  # rank -> when the buddy acknowledged it
        self._newest_seen: dict[int, tuple[int, float]] = {}  # rank -> (generation, first seen)
        self._retry: dict[int, tuple[int, float]] = {}  # rank -> (failures in a row, next try)
        self._corrupt: dict[int, int] = {}  # rank -> generation the buddy found corrupt
        self.sent_copies = 0  # copies the buddy accepted (metrics)
        self.sent_bytes = 0
        self.spaced_out = 0  # ticks that left a newer copy for a later send (metrics)
        self.failed = 0  # sends that failed (metrics)
        # the ranks this node's workers hold now (None: every rank with a directory). After
        # an in-job world change a worker may hold another rank than before; the old rank's
        # directory stays (a reshard may read it), but its copies are not this node's to
        # replicate any more: counted with the live ranks, `same_step` pinned every send to
        # the newest step both held, the old world's, and the buddy never got a newer copy
        self.only: frozenset[int] | None = None

    def due(self, rank: int, refs: list[CopyRef], now: float) -> CopyRef | None:
        """The copy of `rank` to send now (its newest), or None; `refs` newest first."""
        if not refs:
            return None
        newest = refs[0]
        gen = newest.manifest.generation
        acked = self._sent.get(rank)
        if self._held_back(rank, gen, now):
            return None
        seen = self._newest_seen.get(rank)
        if seen is None or seen[0] != gen:
            seen = self._newest_seen[rank] = (gen, now)
        gens = [r.manifest.generation for r in refs]
        if acked is None or acked not in gens:
            return newest
        newer = sum(1 for g in gens if g > acked)
        if (
            newer >= max(1, len(refs) - REPLICA_MARGIN)
            or now - seen[1] >= self.idle_flush_s
            or now - self._sent_at.get(rank, now) >= self.every_s
        ):
            return newest
        self.spaced_out += 1
        return None

    async def tick(self, listed: dict[int, list[CopyRef]] | None = None) -> list[SendResult]:
        """Send every rank's newest copy that is due (see the class docstring); `listed`:
        each rank's copies as the caller just listed them (else they are listed here)."""
        results = []
        by_rank: dict[int, list[CopyRef]] = {}
        for rank in self.owner.ranks():
            if self.only is not None and rank not in self.only:
                continue
            refs = listed.get(rank) if listed is not None else None
            by_rank[rank] = refs if refs is not None else list_copies(self.owner.rank_dir(rank))
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        picked = self.picks(by_rank, t0)
        for rank, ref in picked.items():
            host, port = self.buddy
            res = await send_copy(
                ref, self.node, host, port, config=self.config, buddy_node=self.buddy_node
            )
            local_ok = True
            if res.corrupt:  # in transit, or here? Read it back (rare: once per refusal).
                local_ok = await asyncio.to_thread(_verifies, ref)
            self._settle(rank, ref, res, time.monotonic(), local_ok=local_ok)
            results.append(res)
        if results and all(r.ok for r in results):
            # what the sends occupied: this thread's CPU time, not the wall time. The wall
            # time is mostly waiting on a busy host: for a CPU (at --flash-nice 19, most of
            # it), and for the buddy's flash thread, as low in priority, to take the copy in.
            # Counted in, a send measured 20-80 ms against 3-9 ms of CPU, and a lost node's
            # ranks went back 7-10 steps (bench recovery, node loss; with the own wait
            # taken out but not the buddy's); before that, a starved thread measured 50-100
            # ms a send and spaced the sends to one a second
            self.sent(time.thread_time() - cpu0, time.monotonic())
        return results

    def sent(self, took_s: float, now: float) -> None:
        """Book what one tick's sends took (for `cheap`)."""
        prev = self._send_cost_s
        # down at once, up smoothed: the first sends into a new buddy cost ten times the
        # later ones (it lays out its ring), and an average that remembered them spaced the
        # sends a second apart through the first seconds of every new world
        if prev is None or took_s < prev:
            self._send_cost_s = took_s
        else:
            self._send_cost_s = 0.7 * prev + 0.3 * took_s
        self._picked_at = now

    def cheap(self, now: float) -> bool:
        """Whether sending now keeps the sends under `duty` of the time (measured: after a
        first send; a failed tick is not booked, so a failing buddy is not hurried)."""
        cost, at = self._send_cost_s, self._picked_at
        return cost is not None and at is not None and now - at >= cost / self.duty

    def cheap_in(self, now: float) -> float:
        """Seconds until `cheap` holds (0: now, or no send booked yet)."""
        cost, at = self._send_cost_s, self._picked_at
        if cost is None or at is None:
            return 0.0
        return max(0.0, at + cost / self.duty - now)

    def picks(self, by_rank: dict[int, list[CopyRef]], now: float) -> dict[int, CopyRef]:
        """The copies to send now: when any rank's copy is due, every rank's copy of the
        same step (`same_step`) not acknowledged yet. Decided per rank, the ranks' counts
        since their last replica drifted apart (one rank due a tick before the other): a
        drill's buddy held ranks 2 and 3 at steps 265 and 264, no step in common, and the
        evicted node's ranks restored from the first commit, 264 steps back."""
        trimmed = same_step(by_rank)
        checked = self._fingerprinted(trimmed, now)
        if checked:
            return checked
        due = {rank: self.due(rank, refs, now) for rank, refs in trimmed.items()}
        if not any(ref is not None for ref in due.values()) and not self.cheap(now):
            return {}
        out = {}
        for rank, refs in trimmed.items():
            ref = due[rank] or (refs[0] if refs else None)
            if ref is None:
                continue
            if not self._held_back(rank, ref.manifest.generation, now):
                out[rank] = ref
        return out

    def _fingerprinted(self, by_rank: dict[int, list[CopyRef]], now: float) -> dict[int, CopyRef]:
        """Every rank's copy of the oldest fingerprinted step (`SDC_META`) not sent yet,
        whatever the spacing: the buddy recomputes the fingerprints from exactly those
        copies (docs/sdc.md), so none is skipped, also when a slow tick finds several (a
        starved agent once sent step 20, then 35: the flipped copy of 25 was never checked).
        Empty unless every rank holds such a copy of one step."""
        steps: list[dict[int, CopyRef]] = []
        for rank, refs in by_rank.items():
            acked = self._sent.get(rank, -1)
            mine = {
                r.manifest.step: r
                for r in refs
                if SDC_META in r.manifest.meta
                and r.manifest.generation > acked
                and not self._held_back(rank, r.manifest.generation, now)
            }
            steps.append(mine)
        if not steps:
            return {}
        common = set.intersection(*(set(m) for m in steps))
        if not common:
            return {}
        first = min(common)
        return {rank: m[first] for rank, m in zip(by_rank, steps, strict=True)}

    def _held_back(self, rank: int, gen: int, now: float) -> bool:
        """Whether `rank`'s copy `gen` is not to be sent now: acknowledged already, found
        corrupt, or the rank waits for its retry time."""
        if self._sent.get(rank) == gen or self._corrupt.get(rank) == gen:
            return True
        retry = self._retry.get(rank)
        return retry is not None and now < retry[1]

    def _settle(
        self, rank: int, ref: CopyRef, res: SendResult, now: float, *, local_ok: bool = False
    ) -> None:
        """Book one send's outcome: acknowledged, corrupt here (the buddy found it corrupt
        and `local_ok` is false: it fails its checksum here too), or retried later."""
        if res.ok:
            self._sent[rank] = ref.manifest.generation
            self._sent_at[rank] = now
            self._retry.pop(rank, None)
            self.sent_copies += 1
            self.sent_bytes += ref.manifest.data_nbytes
            return
        self.failed += 1
        if res.corrupt and not local_ok:
            self._corrupt[rank] = ref.manifest.generation
            self._retry.pop(rank, None)
            log.error(
                "replica.local_copy_corrupt",
                rank=rank,
                step=res.step,
                slot=ref.slot,
                error=res.error,
                hint="this node's memory copy failed its checksum at the buddy; it is not "
                "sent again, the next copy is",
            )
            return
        n = self._retry.get(rank, (0, 0.0))[0] + 1
        self._retry[rank] = (n, now + min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** (n - 1)))
        log.warning("replica.send_failed", rank=rank, step=res.step, error=res.error, tries=n)


def same_step(by_rank: dict[int, list[CopyRef]]) -> dict[int, list[CopyRef]]:
    """Each rank's copies (newest first) up to the newest step every rank holds, so the
    node's ranks replicate the same step: the buddy keeps two copies a rank, and ranks
    whose newest copies were a step apart when sent (17 and 18, 23 and 24) left the buddy
    no step in common, and a lost node's restore fell back to the newest commit (a drill
    lost 25 steps). Unchanged when the ranks hold no step in common."""
    if len(by_rank) < 2:
        return by_rank
    steps = [{r.manifest.step for r in refs} for refs in by_rank.values()]
    common = set.intersection(*steps)
    if not common:
        return by_rank
    top = max(common)
    return {rank: [r for r in refs if r.manifest.step <= top] for rank, refs in by_rank.items()}


def _verifies(ref: CopyRef) -> bool:
    """Whether the copy still matches its checksum (False: corrupt, truncated, or gone)."""
    try:
        read_copy(ref).close()
    except CorruptCopyError:
        return False
    return True
