"""The journal: the driver's one writer of the event log, one per leader term.

Everything that changes the job's history goes through here (docs/architecture.md#the-journal).
`record(*events)` appends the events in ONE fenced transaction, folds them into the
one in-memory `JobState` and then tells the subscribers (the recovery loop's actions,
commits, metrics, the dashboard, watchers). `submit(observation)` queues what a detector,
an operator, a launcher or a diagnosis saw; the journal's writer task asks the decider it
was built with (driver/decider.py: the recovery loop's, or `RecordOnly` when no job is
configured) what to record and records the whole decision at once, so there is never half a decision
to repair. Up to 64 queued observations are decided in a row, each on the state after the
decisions before it, and recorded in one transaction (<= 60 events): group commit without
concurrent appenders (20,000 node churns took 200 s one transaction each, 19 s batched).
Nothing else in the driver calls `EventLog.append` or `append_many` (tests/unit/
test_journal.py checks it). This is eventsourcing's `Application.save ->
recorder.insert(list) -> notify` shape.

A detected failure is never lost:
- Observations wait in three lanes, served in this order: **faults** (NodeLost,
  WorkerFailed, HangSuspected, a failed SelfCheckReported, LossSpike, and membership:
  NodeRegistered, NodeRefused, so a loss never overtakes its node's registration),
  **main** (every other observation: progress, verdicts, commits, operator requests) and
  **alerts** (LogAlert).
  Faults and main are never dropped, and a storm of log alerts cannot delay a fault (one
  node printing "NCCL WARN" 1,000 times a second once delayed another node's NodeLost by
  10-22 s through a shared queue; tests/chaos/test_log_storm.py).
- Log alerts are coalesced per node and keyword: the first line of a window is recorded at
  once, the rest of the window's lines are counted into one LogAlert (`repeats`) at its
  end. Only alerts are shed when their lane is full, and a counter says how many.
- A failed append leaves the observation at the front of its lane. The writer reads back
  what landed (an "unknown outcome" may have landed), waits with backoff and decides again
  on the state the log now has. A fenced append (leadership lost) ends the term: the
  service steps down and carries the unrecorded observations into its next term.
- Detection is level-triggered: on taking the lead, after a failed append, and every
  `reconcile_ms`, the journal asks `conditions(state)` (the live view's truths: "this
  node is silent") for whatever is true but not durable yet, and records it.
- One condition is recorded once: a NodeLost of a node the state already has lost at
  that epoch is not recorded again (a loss carried over from a term that ended in an
  etcd stall, next to the same loss the new term's level check found, was recorded
  twice and counted as two failures), and after a failed append what landed is folded
  before anything is decided again.
- Wall times (`wall_time_unix_ns`) are stamped here and never go backwards within a term:
  a clock stepped back, or an observation stamped at an append that failed and recorded
  later, is stamped 1 ns after the term's previous event.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from unbroken.common import aio
from unbroken.driver import fold as foldlib
from unbroken.driver import worldsplit
from unbroken.driver.decider import Decider, RecordOnly
from unbroken.driver.eventkinds import FAULT_LANE, KINDS
from unbroken.driver.eventlog import (
    DEFAULT_MAX_EVENT_BYTES,
    EventLog,
    EventLogError,
    EventTooLargeError,
    NotLeaderError,
)
from unbroken.driver.loghealth import LogHealth
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

Subscriber = Callable[[ev.Event], None]

MAX_BATCH_OBSERVATIONS = 64  # observations decided into one transaction
MAX_BATCH_EVENTS = 60  # events per transaction (etcd's default --max-txn-ops 128: 2 per event)
MAX_BATCH_BYTES = 512 * 1024  # of serialized events per transaction


class JournalClosedError(EventLogError):
    """The journal's term ended (stepped down or stopped) before the observation was recorded."""


@dataclass(kw_only=True, slots=True)
class JournalConfig:
    """Bounds and cadences of the journal."""

    alert_queue: int = 1000  # log alerts waiting; more are shed (counted)
    max_pending: int = 1_000_000  # faults + main observations: a bug or attack past this
    alert_window_ms: int = 1000  # one LogAlert per node and keyword per window, plus a count
    max_alert_keys: int = 10_000  # (node, keyword) windows tracked at once
    reconcile_ms: int = 1000  # the level check between failures
    retry_min_ms: int = 50  # backoff after a failed append...
    retry_max_ms: int = 2000  # ...doubling up to this

    def __post_init__(self) -> None:
        for name in ("alert_queue", "max_pending", "max_alert_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("alert_window_ms", "reconcile_ms", "retry_min_ms", "retry_max_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_max_ms < self.retry_min_ms:
            raise ValueError(
                f"retry_max_ms ({self.retry_max_ms}) must be >= retry_min_ms ({self.retry_min_ms})"
            )


@dataclass(slots=True)
class Pending:
    """One queued observation: an event or a decider-specific object."""

    obj: Any
    detected: float = math.nan  # monotonic time the detector saw it (nan: not a detection)
    done: asyncio.Future[list[ev.Event]] | None = None
    carried: bool = False  # from an earlier term: it may have landed before the fence


@dataclass(slots=True)
class _Window:
    """The open coalescing window of one (node, keyword)."""

    start: float
    count: int = 0
    last: ev.Event | None = None


@dataclass(slots=True)
class JournalStats:
    """Counters the service exports (LiveStats, metrics)."""

    recorded: int = 0
    transactions: int = 0
    failed_appends: int = 0
    alerts_coalesced: int = 0
    alerts_shed: int = 0
    rederived: int = 0
    too_large: int = 0
    duplicates: int = 0  # conditions not recorded again: the state had them already
    durable_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=4096)
    )


def _lane_of(obj: Any) -> str:
    if isinstance(obj, ev.Event):
        kind = obj.WhichOneof("payload")
        row = KINDS.get(kind or "")
        if row is not None and row.lane == "alerts":
            return "alerts"
        if kind in FAULT_LANE and not (
            kind == "self_check_reported" and obj.self_check_reported.ok
        ):
            return "faults"
    return "main"


def condition_holds(state: ev.JobState, e: ev.Event) -> bool:
    """Whether `state` already records the condition `e` states: a NodeLost of a node
    that is lost at that very epoch (a second one would count a second failure)."""
    if e.WhichOneof("payload") != "node_lost":
        return False
    rec = state.nodes.get(e.node_lost.node_id)
    return (
        rec is not None
        and bool(e.node_lost.epoch)
        and rec.epoch == e.node_lost.epoch
        and rec.state == ev.NODE_STATE_LOST
    )


def condition_key(e: ev.Event) -> tuple[str, str, int] | None:
    """The identity of a level-triggered condition (None: the event is not one)."""
    if e.WhichOneof("payload") == "node_lost":
        return ("node_lost", e.node_lost.node_id, e.node_lost.epoch)
    return None


class Journal:
    """The driver's only writer of `log` for one leader term.

    Args:
        log_: the leader's event log (fenced by this term's leadership).
        state: the replayed state of the log (`log_.replay()`); the journal owns it from
            now on and keeps it equal to the fold of the log.
        config: bounds and cadences.
        conditions: the live view's truths for a state (events that should be durable and
            are not); called on start, after failed appends and every `reconcile_ms`.
        on_fenced: called once when an append is fenced off (this driver lost leadership).
        decider: what to record for an observation, and the actions after it
            (driver/decider.py; default `RecordOnly`: each observation as it is).
        on_resync: called when events landed unseen (an append that reported failure).
        term: the leader term and its scope this journal writes under (the election's),
            known before its `LeaderElected` is recorded; None: the state's.
    """

    def __init__(
        self,
        log_: EventLog,
        state: ev.JobState,
        *,
        config: JournalConfig | None = None,
        conditions: Callable[[ev.JobState], list[ev.Event]] | None = None,
        on_fenced: Callable[[NotLeaderError], None] | None = None,
        decider: Decider | None = None,
        on_resync: Callable[[], None] | None = None,
        clock: Callable[[], int] = time.time_ns,
        term: tuple[int, str] | None = None,
    ) -> None:
        self.log = log_
        self._term = term
        self._clock = clock  # wall time (ns) for the events' stamps
        self._last_wall = 0  # the newest stamp of this term
        self.config = config or JournalConfig()
        self._state = state
        self.decider: Decider = decider if decider is not None else RecordOnly()
        self.on_resync = on_resync  # an observation landed unseen
        self.subscribers: list[Subscriber] = []
        self.stats = JournalStats()
        self.health = LogHealth()  # whether appends succeed (status, metrics, dashboard)
        self._conditions = conditions
        self._on_fenced = on_fenced
        self._lanes: dict[str, collections.deque[Pending]] = {
            "faults": collections.deque(),
            "main": collections.deque(),
            "alerts": collections.deque(),
        }
        self._keys: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self._windows: dict[tuple[str, str], _Window] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one append + fold + notify at a time
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._fenced: NotLeaderError | None = None
        self._recent_ids: set[str] = set()  # ids of events a resync folded
        self._draft: foldlib.Savepoint | None = None  # see `deciding_state`
        self._dirty = False  # an append failed: fold what landed before the next one

    # ------------------------------------------------------------ reading
    @property
    def state(self) -> ev.JobState:
        """The folded state of every recorded event (read-only: never mutate it).

        The journal folds into this one object in place (O(event), not O(state)), so it
        changes under a reader that keeps it across an await; `snapshot()` is a copy.
        """
        return self._state

    @property
    def term(self) -> tuple[int, str]:
        """The leader term and scope this journal writes under: the term agents register
        under and commands carry. The election's from the start, so an agent that
        registers while `LeaderElected` is being written is not told the previous term's
        scope (every later command of this term would be refused as of another scope)."""
        if self._term is not None:
            return self._term
        return self._state.leader_term, self._state.leader_scope

    def snapshot(self) -> ev.JobState:
        """A copy of the folded state that later records do not change."""
        out = ev.JobState()
        out.CopyFrom(self._state)
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        """Observations waiting to be recorded (faults and main; alerts not counted)."""
        return len(self._lanes["faults"]) + len(self._lanes["main"])

    def faults_pending(self) -> int:
        return len(self._lanes["faults"])

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the writer and the level check (inside the event loop)."""
        self._tasks = [
            asyncio.create_task(self._writer(), name="journal-writer"),
            asyncio.create_task(self._ticker(), name="journal-ticker"),
        ]
        self.reconcile()

    async def close(self) -> list[Pending]:
        """End the term; return the observations that were not recorded (faults first).

        Callers waiting on `observe` get `JournalClosedError`; the unrecorded observations
        are for the next term (the service resubmits them when it leads again).
        """
        self._closed = True
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        left: list[Pending] = []
        for lane in ("faults", "main", "alerts"):
            for p in self._lanes[lane]:
                if p.done is not None and not p.done.done():
                    p.done.set_exception(
                        JournalClosedError("this driver's term ended before it was recorded")
                    )
                left.append(Pending(p.obj, p.detected, carried=True))
            self._lanes[lane].clear()
        self._keys.clear()
        return left

    # ------------------------------------------------------------ writing
    async def record(self, *events: ev.Event, wait_s: float | None = None) -> list[ev.Event]:
        """Append `events` in one fenced transaction, fold them, notify; return them stored.

        For writes that are facts, not observations to decide on (LeaderElected, an
        operator's request, a diagnosis round). `wait_s` bounds the wait for the writer
        (busy retrying while etcd is down); the append itself is bounded by the log's own
        deadlines and is never abandoned half way. Raises what the log raises, and
        TimeoutError when the writer stayed busy for `wait_s`.
        """
        if self._closed:
            raise JournalClosedError("this driver's term has ended; it is not the leader")
        await aio.wait_for(self._lock.acquire(), wait_s)
        try:
            return await self._record_locked(list(events))
        finally:
            self._lock.release()

    async def _record_locked(self, events: list[ev.Event]) -> list[ev.Event]:
        if not events:
            return []
        if self._dirty:  # an earlier append failed: what landed must be folded first
            await self._resync_locked()
        # a world layout too large for one event follows its head event in parts
        n = len(events)
        events = worldsplit.split(
            events, getattr(self.log, "max_event_bytes", DEFAULT_MAX_EVENT_BYTES)
        )
        for e in events:  # monotonic within the term, whatever the clock did
            wall = e.wall_time_unix_ns or self._clock()
            e.wall_time_unix_ns = self._last_wall = max(wall, self._last_wall + 1)
        try:
            stored = await self.log.append_many(events)
        except NotLeaderError as e:
            self._fence(e)
            raise
        except EventLogError as e:
            self.stats.failed_appends += 1
            if not isinstance(e, EventTooLargeError):  # that event's fault, not the log's
                self.health.failed(e)
            self._dirty = True  # its outcome may be unknown (landed after all)
            raise
        self.health.succeeded()
        self.stats.transactions += 1
        foldlib.fold_in_place(self._state, stored)
        self.stats.recorded += len(stored)
        self._notify(stored)
        return worldsplit.merged(stored) if len(stored) > n else stored

    def _notify(self, events: list[ev.Event]) -> None:
        for one in events:
            for fn in list(self.subscribers):
                try:
                    fn(one)
                except Exception:
                    log.exception("journal subscriber failed", kind=one.WhichOneof("payload"))

    def _fence(self, e: NotLeaderError) -> None:
        if self._fenced is None:
            self._fenced = e
            log.error("journal fenced off: this driver lost leadership", error=str(e))
            if self._on_fenced is not None:
                self._on_fenced(e)

    def submit(self, obj: Any, detected: float = math.nan) -> bool:
        """Queue an observation for the writer; False only for a shed log alert.

        Faults and every other non-alert observation are always accepted while the term
        lasts (a closed journal refuses: the service keeps them for the next term).
        """
        return self._enqueue(Pending(obj, detected)) is not None

    def carry_over(self, left: Iterable[Pending]) -> int:
        """Queue a previous term's unrecorded observations (`close()`'s result); how many."""
        n = 0
        for p in left:
            n += self._enqueue(Pending(p.obj, p.detected, carried=True)) is not None
        return n

    async def observe(self, obj: Any, timeout_s: float) -> list[ev.Event]:
        """Queue an observation and wait until its decision is durable; return its events.

        Raises:
            TimeoutError: not durable within `timeout_s` (it stays queued and is recorded
                later; a retry with the same event id is recorded once).
            JournalClosedError: the term ended first.
            EventTooLargeError: the event can never be recorded.
        """
        fut: asyncio.Future[list[ev.Event]] = asyncio.get_running_loop().create_future()
        if self._enqueue(Pending(obj, math.nan, fut)) is None:
            raise JournalClosedError("the journal refused the observation (term ended)")
        return await aio.wait_for(asyncio.shield(fut), timeout_s)

    def _enqueue(self, p: Pending) -> Pending | None:
        if self._closed:
            return None
        lane = _lane_of(p.obj)
        if lane == "alerts":
            return self._coalesce(p)
        if self.pending() >= self.config.max_pending:
            log.error("journal queue at its hard limit; refusing", limit=self.config.max_pending)
            return None
        if isinstance(p.obj, ev.Event):
            key = condition_key(p.obj)
            if key is not None:
                self._keys[key] += 1
        self._lanes[lane].append(p)
        self._wake.set()
        return p

    def _coalesce(self, p: Pending) -> Pending | None:
        a = p.obj.log_alert
        key = (a.node_id, a.keyword)
        now = time.monotonic()
        w = self._windows.get(key)
        if w is not None and now - w.start < self.config.alert_window_ms / 1000.0:
            w.count += 1 + a.repeats
            w.last = p.obj
            self.stats.alerts_coalesced += 1
            return p
        if w is not None:
            self._flush_window(w)
        if len(self._windows) >= self.config.max_alert_keys:
            self._flush_windows(now, force=True)
        self._windows[key] = _Window(now)
        return self._push_alert(p)

    def _push_alert(self, p: Pending) -> Pending | None:
        lane = self._lanes["alerts"]
        if len(lane) >= self.config.alert_queue:
            self.stats.alerts_shed += 1
            if self.stats.alerts_shed % 1000 == 1:
                log.warning("log alerts shed under pressure", shed=self.stats.alerts_shed)
            return None
        lane.append(p)
        self._wake.set()
        return p

    def _flush_window(self, w: _Window) -> None:
        if w.count and w.last is not None:
            out = ev.Event()
            out.CopyFrom(w.last)
            out.event_id = ""
            out.log_alert.repeats = w.count
            self._push_alert(Pending(out))
        w.count, w.last = 0, None

    def _flush_windows(self, now: float, *, force: bool = False) -> None:
        window = self.config.alert_window_ms / 1000.0
        for key, w in list(self._windows.items()):
            if force or now - w.start >= window:
                self._flush_window(w)
                del self._windows[key]

    def _take(self, limit: int) -> list[tuple[str, Pending]]:
        """Up to `limit` observations from the head of the lanes, faults first."""
        out: list[tuple[str, Pending]] = []
        for lane in ("faults", "main", "alerts"):
            for p in self._lanes[lane]:
                if len(out) >= limit:
                    return out
                out.append((lane, p))
        return out

    async def _writer(self) -> None:
        backoff = self.config.retry_min_ms / 1000.0
        limit = MAX_BATCH_OBSERVATIONS
        while not self._closed:
            batch = self._take(limit)
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                done = await self._handle(batch)
            except asyncio.CancelledError:
                raise
            except NotLeaderError:
                return  # the service steps down and carries the lanes into its next term
            except EventTooLargeError as e:
                if len(batch) > 1:
                    limit = 1  # find the one that cannot be recorded: one at a time
                    continue
                lane, p = batch[0]
                self.stats.too_large += 1
                log.error("event too large; it is dropped", error=str(e), kind=_kind(p.obj))
                if p.done is not None and not p.done.done():
                    p.done.set_exception(e)
                done = 1
            except EventLogError as e:
                log.warning(
                    "recording failed; the observations wait and are decided again",
                    error=str(e),
                    kind=_kind(batch[0][1].obj),
                    waiting=self.pending(),
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.retry_max_ms / 1000.0)
                await self._resync()
                self.reconcile()
                continue
            except Exception:
                log.exception(
                    "deciding an observation failed; it is dropped", kind=_kind(batch[0][1].obj)
                )
                done = 1
            backoff = self.config.retry_min_ms / 1000.0
            if limit == 1 and done:
                limit = MAX_BATCH_OBSERVATIONS
            for lane, p in batch[:done]:
                self._pop(lane, p)

    def _pop(self, lane: str, p: Pending) -> None:
        q = self._lanes[lane]
        if q and q[0] is p:
            q.popleft()
        else:
            with contextlib.suppress(ValueError):
                q.remove(p)
        if isinstance(p.obj, ev.Event):
            key = condition_key(p.obj)
            if key is not None:
                self._keys[key] -= 1
                if self._keys[key] <= 0:
                    del self._keys[key]

    @property
    def deciding_state(self) -> ev.JobState:
        """The state a decider decides on: the durable state plus the decisions taken
        earlier in the same transaction (the durable state between writes).

        The same object as `state`: the draft decisions are folded into it in place while
        the deciders run (which never await) and undone before the append awaits."""
        return self._state

    async def _handle(self, batch: list[tuple[str, Pending]]) -> int:
        """Decide on a batch of observations and record all decisions in ONE transaction.

        Each decision sees the state after the ones before it: the draft decisions are
        folded into the live state in place (O(event)) while the deciders run, which never
        await, and undone before anything awaits, so no reader sees them. Returns how many
        observations of the batch are done (a prefix).
        """
        async with self._lock:
            if self._dirty:  # an append failed: what landed is folded before deciding
                await self._resync_locked()
            events: list[ev.Event] = []
            decided: list[tuple[Pending, int, int, Callable[[], None] | None]] = []
            size = 0
            drafted = 0  # events[:drafted] are folded into the draft
            try:
                for _, p in batch:
                    if isinstance(p.obj, ev.Event) and p.obj.event_id and p.carried:
                        self._undo_draft()  # _landed may await: readers see durable state
                        drafted = 0
                    if isinstance(p.obj, ev.Event) and p.obj.event_id and await self._landed(p):
                        decided.append((p, len(events), len(events), None))
                        continue
                    if drafted < len(events):
                        if self._draft is None:
                            self._draft = foldlib.Savepoint(self._state)
                        for e in events[drafted:]:
                            self._draft.apply(e)
                        drafted = len(events)
                    if isinstance(p.obj, ev.Event) and condition_holds(self._state, p.obj):
                        self.stats.duplicates += 1  # recorded already (this term or before)
                        decided.append((p, len(events), len(events), None))
                        continue
                    decision = self.decider.decide(self._state, p.obj)
                    mine, then = decision.events, decision.after
                    grown = size + sum(e.ByteSize() for e in mine)
                    if decided and (
                        len(events) + len(mine) > MAX_BATCH_EVENTS or grown > MAX_BATCH_BYTES
                    ):
                        break  # the next transaction decides it again, on the new state
                    decided.append((p, len(events), len(events) + len(mine), then))
                    events.extend(mine)
                    size = grown
            finally:
                self._undo_draft()
            stored = await self._record_locked(events)
        now = time.monotonic()
        for p, a, b, then in decided:
            if not math.isnan(p.detected):
                self.stats.durable_s.append(now - p.detected)
            self._resolve(p, stored[a:b])
            if then is not None:
                try:
                    then()
                except Exception:
                    log.exception("recovery actions failed to start")
        return len(decided)

    def _undo_draft(self) -> None:
        if self._draft is not None:
            self._draft.undo()
            self._draft = None

    async def _landed(self, p: Pending) -> bool:
        """Whether `p`'s event is already in the log (folded by a resync, or carried over
        from a term whose fenced append may have landed it)."""
        event_id = p.obj.event_id
        if event_id in self._recent_ids:
            return True
        return p.carried and await self.log.find(event_id) is not None

    @staticmethod
    def _resolve(p: Pending, stored: list[ev.Event]) -> None:
        if p.done is not None and not p.done.done():
            p.done.set_result(stored)

    # ------------------------------------------------------------ after failures
    async def _resync(self) -> None:
        """Fold what landed in the log although its append reported a failure."""
        async with self._lock:
            try:
                landed = await self._resync_locked()
            except EventLogError as e:
                log.info("log still unavailable after a failed append", error=str(e))
                return
        if landed and self.on_resync is not None:
            self.on_resync()

    async def _resync_locked(self) -> int:
        """Read the log past the state and fold it (raises when the log cannot be read)."""
        tail = await self.log.read(self._state.last_seq + 1)
        self._dirty = False
        if not tail:
            return 0
        log.warning("events landed despite a failed append; folding them", events=len(tail))
        self._recent_ids = {one.event_id for one in tail}
        foldlib.fold_in_place(self._state, tail)
        self._notify(tail)
        return len(tail)

    def reconcile(self) -> int:
        """Queue every live-view truth that is not durable yet; return how many."""
        if self._conditions is None or self._closed:
            return 0
        try:
            truths = self._conditions(self._state)
        except Exception:
            log.exception("level check failed; continuing")
            return 0
        n = 0
        for e in truths:
            key = condition_key(e)
            if key is not None and self._keys.get(key):
                continue  # already waiting
            e.cause = e.cause or "level check"
            if self._enqueue(Pending(e, time.monotonic())) is not None:
                n += 1
        if n:
            self.stats.rederived += n
            log.warning("recording conditions the log did not have yet", events=n)
        return n

    async def _ticker(self) -> None:
        period = self.config.reconcile_ms / 1000.0
        window = self.config.alert_window_ms / 1000.0
        while not self._closed:
            await asyncio.sleep(min(period, window))
            try:
                self._flush_windows(time.monotonic())
                self.reconcile()
            except Exception:
                log.exception("journal tick failed; continuing")


def _kind(obj: Any) -> str:
    return str(obj.WhichOneof("payload")) if isinstance(obj, ev.Event) else type(obj).__name__
