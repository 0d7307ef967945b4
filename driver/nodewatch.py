"""The node watch: the leader's sweeps over the live view (lost nodes, stragglers).

Every heartbeat interval / 5 the node-lost sweep reads the stale front of the live view
(driver/liveview.py) and declares the silent nodes lost, holding back a node whose host
is starved (the agent said so), a relayed node whose relay was lost (it gets time to come
to the driver directly), an evicted node's departure (not a loss) and a mass silence (the
driver itself is overloaded or partitioned). Every `straggler.sweep_ms` the straggler sweep
samples the world's step times (driver/straggler.py). The lateness of the sweep's own
wake-ups is the driver's stall: it is the detector's slack. Detections go to `emit` (the
journal's intake); the watch sweeps only while this driver leads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Awaitable, Callable

import structlog

from unbroken.driver import detectors
from unbroken.driver.config import ServiceConfig
from unbroken.driver.leadership import Leadership
from unbroken.driver.liveview import LiveView, NodeSlot
from unbroken.driver.sessions import RelayOutbox
from unbroken.driver.straggler import Sample, StragglerWatch, sample
from unbroken.proto import events_pb2 as ev

log = structlog.get_logger(__name__)

SWEEP_CHUNK = 512  # nodes a straggler sweep samples between yields to the event loop
HELD_LOGS = 16  # late nodes logged by name per sweep (the rest: one line with the count)
SWEEP_SHARE = 5.0  # the node-lost sweep waits at least this many times its own duration
# The event loop's own CPU over the last timeout window at or above this share of it: the
# driver is behind its streams (see `_mass`)
BUSY_SHARE = 0.8


class NodeWatch:
    """The lost-node and straggler sweeps of the leader.

    Args:
        config: the service's (the live view's timeouts, the straggler policy).
        lead: who leads (the sweeps run only while this driver does).
        view: the live view the sweeps read.
        emit: hands a detection to the journal (`last_seen`: when the fault began).
    """

    def __init__(
        self,
        config: ServiceConfig,
        lead: Leadership,
        view: LiveView,
        emit: Callable[[ev.Event, float], bool],
    ) -> None:
        self.config = config
        self._lead = lead
        self.view = view
        self._emit = emit
        self.stragglers = StragglerWatch(config.straggler)
        self._mass_since = 0.0  # monotonic time a mass silence was first held back
        self._mass_ran = 0.0  # ...of its hold, the time some node was heard
        self._mass_tick = 0.0  # the sweep that last advanced that clock
        self.mass_held = 0  # nodes a mass silence holds back now (0: none)
        self.relay_held = 0  # sweeps that held back a relayed node whose relay was lost
        self._starved_held: dict[str, float] = {}  # late nodes held as starved, since
        self._crowd = 0  # the most nodes held late together since none was held (see _mass)
        self.starved_saved = 0  # ...that came back within their grace (losses avoided)
        self.busy = 0.0  # the event loop's CPU share over the last timeout window
        self._busy_said = False  # ...logged as at BUSY_SHARE or more, not yet as under
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the sweeps (call inside the event loop)."""
        self._tasks.append(asyncio.create_task(self._lost_loop()))
        st = self.config.straggler
        if st.policy != "off":
            period = st.sweep_ms / 1000.0
            self._tasks.append(
                asyncio.create_task(self._loop("straggler", self._sweep_stragglers, period))
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def conditions(self, state: ev.JobState) -> list[ev.Event]:
        """What the live view knows that `state` does not: nodes declared lost (the level
        check of driver/journal.py). Also frees the slots of nodes gone for good."""
        out = []
        now = time.monotonic()
        retention = self.config.slot_retention_s
        for slot in list(self.view.nodes.values()):
            if slot.alive or not slot.epoch:
                continue
            rec = state.nodes.get(slot.node_id)
            if (
                rec is not None
                and rec.epoch == slot.epoch
                and rec.state in (ev.NODE_STATE_ACTIVE, ev.NODE_STATE_SPARE)
            ):
                out.append(detectors.node_lost(slot, now, "heartbeat timeout"))
            elif now - slot.last_seen > retention and slot.outbox is None:
                del self.view.nodes[slot.node_id]  # its history stays in the log
        return out

    async def _loop(self, name: str, body: Callable[[], Awaitable[None]], period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                if self._lead.leader:
                    await body()
            except Exception:
                log.exception("detector sweep failed; continuing", detector=name)

    async def _lost_loop(self) -> None:
        """The node-lost sweep, every interval/5, and the event-loop stall watchdog.

        The lateness of this loop's own wake-ups is the driver's stall; the largest one
        within the last timeout window is passed to the detector as slack, so a driver that
        stalled (GC, a registration storm, a slow disk) does not blame its nodes.
        """
        period = self.config.live.heartbeat_interval_ms / 5000.0
        window = int(self.config.live.timeout_s / period) + 2
        lags: collections.deque[float] = collections.deque([0.0], maxlen=window)
        # (wall, this thread's CPU) at each wake: the loop's busy share over the window
        cpu: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        due = time.monotonic() + period
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            lag = now - due
            lags.append(lag)
            cpu.append((now, time.thread_time()))
            self.busy = busy = busy_share(cpu)
            if busy >= BUSY_SHARE and not self._busy_said:  # once an episode
                log.warning("driver event loop busy: large silences held", busy=round(busy, 2))
                self._busy_said = True
            elif busy < BUSY_SHARE - 0.1 and self._busy_said:  # (not on every wobble)
                log.info("driver event loop no longer busy", busy=round(busy, 2))
                self._busy_said = False
            if lag > 0.1:
                log.warning("driver event loop stalled", stall_ms=round(lag * 1000))
            took = 0.0
            try:
                if self._lead.leader:
                    t0 = time.perf_counter()
                    self._sweep_lost(now, max(lags))
                    took = time.perf_counter() - t0
            except Exception:
                log.exception("node-lost sweep failed; continuing")
            # at most a fifth of the loop: a sweep over a world held late together reads
            # every late node (at 10,240 nodes 30-60 ms each, every 20 ms, the loop did
            # little else and read the relays' streams, which would end the lateness, last)
            due = now + max(period, SWEEP_SHARE * took)

    def _sweep_lost(self, now: float, slack_s: float) -> None:
        held: list[NodeSlot] = []
        lost = detectors.silent(self.view, now, slack_s, held)
        crowd = self._crowd  # the crowd these losses come out of, before it is counted again
        self._note_held(held, now)
        self._crowd = max(crowd, len(self._starved_held)) if self._starved_held else 0
        if lost:  # (a member never carried is in no relay's set yet)
            kept = [x for x in lost if not self._held_for_relay(x[0], now)]
            self.relay_held += len(lost) - len(kept)
            lost = kept
        if lost:  # an evicted node's agent exits: its silence is its departure
            left = [slot for slot, _ in lost if slot.leaving]
            for slot in left:
                self.view.mark_lost(slot)
                log.info("evicted node's agent left", node=slot.node_id)
            if left:
                lost = [x for x in lost if not x[0].leaving]
        if lost and (why := self._mass(lost, now, crowd)) and self._hold_mass(lost, now, why):
            return
        self._mass_since, self.mass_held = 0.0, 0
        if not lost:
            return
        for e in detectors.declare(self.view, lost, now):
            self._emit(e, now - e.node_lost.silent_ms / 1000.0)
            log.warning(
                "node lost", node=e.node_lost.node_id, silent_ms=round(e.node_lost.silent_ms, 1)
            )

    def _mass(self, lost: list[tuple[NodeSlot, str]], now: float, crowd: int = 0) -> str:
        """Why `lost` is a mass silence ("": it is not): more than a `mass_loss_fraction` of the
        nodes; or any part of one whose hold is under way (the rest of a silence that is
        coming back gets the rest of the hold, not its loss at once: its nodes come back
        one stream read at a time, and the last one or two of a crowd were declared lost
        the moment they were no more than `mass_loss_min`); or more than `mass_loss_min`
        while nobody is heard (the driver's own silence: at 10,240 nodes the loop read no
        relay stream for 3 s and 640 members, a sixteenth of the world, were declared lost
        before a quarter was silent), or however few while nobody is heard (`_everyone`); or
        more than `mass_loss_min` coming out of a `crowd` of nodes held late together that
        was itself a mass silence. At 10,240 nodes an
        incident's stop to every node kept the leader from reading the relays' streams for
        0.5-1.2 s: all 10,096 nodes were held late together, 9,000 came back within the
        grace as their streams were read again, and the 500-2,000 read last were declared
        lost at its end (fewer than a quarter, and others were heard), each a decision. Or
        more than `mass_loss_min` while this loop was busy (`BUSY_SHARE` of the last timeout
        window on its own CPU): it reads its streams late, and those it reads last are
        silent here only (2026-12-06, bench-scale at 10,240: the 2,520 nodes of one
        simulator, just under a quarter, were declared lost 0.43 s into an incident's
        fan-out, the loop busy with it and the others' acks; nobody was held before). Or
        more than `mass_loss_min` while a command to many nodes is out, or came back less
        than a timeout ago (`LiveView.fanned_out`): their replies are the driver's backlog
        (in a later run the loop's own CPU stayed under `BUSY_SHARE` through the stops)."""
        limit = detectors.mass_limit(self.view)
        if self._mass_since:
            return "held already"
        if len(lost) > limit:
            return "over the fraction"
        live = self.config.live
        if len(lost) <= live.mass_loss_min:
            return "nobody heard" if self._everyone(lost, now) else ""
        for why, holds in (
            ("out of a held crowd", crowd > limit),
            ("nobody heard", self._unheard(now)),
            ("driver loop busy", self.busy >= BUSY_SHARE),
            ("command to many nodes out", self.view.fanned_out(now)),
        ):
            if holds:
                return why
        return ""

    def _everyone(self, lost: list[tuple[NodeSlot, str]], now: float) -> bool:
        """Whether nobody at all is heard in a world of two nodes alive or more, and each
        node of `lost` still has its stream open: a small world's mass silence (the others
        are silent too, some not yet past their timeout). A CI host stalled the three
        agents of a chaos job 3-4 s at once (their streams open); each was declared lost and,
        below --min-nodes, the job failed while the three came back. A killed agent's stream
        closes: such a silence is the node's own, never held here."""
        if self.view.alive_count() < 2 or not self._unheard(now):
            return False
        return all(slot.connected and why != detectors.STREAM_CLOSED for slot, why in lost)

    def _unheard(self, now: float) -> bool:
        """Whether no node at all was heard for two heartbeat intervals."""
        return now - self.view.heard_at > 2 * self.config.live.heartbeat_interval_ms / 1e3

    def _hold_mass(self, lost: list[tuple[NodeSlot, str]], now: float, why: str = "") -> bool:
        """Whether the mass silence `lost` is still held back.

        The hold (`mass_loss_hold_ms`) runs only while some node is heard: a world silent
        all at once is the observer's silence (its loop behind its streams, its own
        network), so with nobody heard its clock stops, up to `mass_loss_max_hold_ms` in
        all. At 10,240 nodes (bench-scale) the leader once read no relay stream for 3 s and
        all 9,442 nodes it knew alive were silent together: a fixed 3 s hold (as before)
        declares such a world lost."""
        live = self.config.live
        if not self._mass_since:
            self._mass_since = self._mass_tick = now
            self._mass_ran = 0.0
            log.error(
                "mass silence: holding NodeLost back (driver overloaded or partitioned?)",
                silent=len(lost),
                why=why,
                hold_ms=live.mass_loss_hold_ms,
                unheard_ms=round((now - self.view.heard_at) * 1000),
                alive=self.view.alive_count(),
            )
        if not self._unheard(now):
            self._mass_ran += now - self._mass_tick
        self._mass_tick = now
        self.mass_held = len(lost)
        if now - self._mass_since > live.mass_loss_max_hold_ms / 1e3:
            log.error(
                "mass silence held its longest: declaring the silent nodes lost",
                silent=len(lost),
                held_ms=round((now - self._mass_since) * 1000),
                unheard_ms=round((now - self.view.heard_at) * 1000),
            )
            return False
        return self._mass_ran <= live.mass_loss_hold_ms / 1e3

    def mass_silence(self, now: float) -> tuple[int, float, float]:
        """The mass silence held now: its nodes, for how long, since when nobody was heard
        (seconds; (0, 0, 0) when none is held)."""
        if not self.mass_held or not self._mass_since:
            return 0, 0.0, 0.0
        return self.mass_held, now - self._mass_since, max(0.0, now - self.view.heard_at)

    def _note_held(self, held: list[NodeSlot], now: float) -> None:
        """Log a late node held as starved once, and once more when it came back (a false
        loss avoided) or was lost after all: each of the first HELD_LOGS of a sweep by
        name, the rest in one line (a whole relay group late together is 64 nodes, a
        stalled simulator or network thousands: a line each stalled the loop seconds)."""
        fresh = 0
        for slot in held:
            if slot.node_id not in self._starved_held:
                self._starved_held[slot.node_id] = slot.last_seen
                fresh += 1
                if fresh > HELD_LOGS:
                    continue
                hb = slot.hb
                log.warning(
                    "node late while starved: held",
                    node=slot.node_id,
                    silent_ms=round((now - slot.last_seen) * 1000),
                    loop_lag_ms=round(hb.loop_lag_ms),
                    late_ms=round(hb.late_ms),
                    cpu_pressure_pct=hb.cpu_pressure_pct,
                    runnable_per_cpu=round(hb.runnable_per_cpu, 2),
                )
        if fresh > HELD_LOGS:
            log.warning("more nodes late while starved: held", nodes=fresh - HELD_LOGS)
        ids = {s.node_id for s in held}
        if len(ids) == len(self._starved_held):
            return  # every one held is still held
        done = {"held node came back": 0, "held node lost after its grace": 0}
        for node_id, since in list(self._starved_held.items()):
            if node_id in ids:
                continue
            del self._starved_held[node_id]
            now_slot = self.view.nodes.get(node_id)
            back = now_slot is not None and now_slot.alive and now_slot.last_seen > since
            if back:
                self.starved_saved += 1
            what = "held node came back" if back else "held node lost after its grace"
            done[what] += 1
            if done[what] <= HELD_LOGS:
                log.info(what, node=node_id)
        for what, n in done.items():
            if n > HELD_LOGS:
                log.info(what.replace("held node", "more held nodes"), nodes=n - HELD_LOGS)

    def _held_for_relay(self, slot: NodeSlot, now: float) -> bool:
        """Whether `slot`'s silence began with its relay's loss (and is still young enough
        to wait for the node to come to us directly).

        A node registered through a relay that is down before the relay carried it (no
        session yet) has the session grace twice: it comes when its relay is back (it
        registers again through it) or on its own. At a 10,240-node join a relay lost
        while its 64 members were registering took them all with it 5 s later (3,700
        NodeLost in one run), though each registered again once its relay was back."""
        if not slot.relay or not isinstance(slot.outbox, RelayOutbox | None):
            return False
        relay = self.view.nodes.get(slot.relay)
        if relay is None:
            return False
        live = self.view.config
        down = not relay.connected or now - relay.last_seen > 2 * live.heartbeat_interval_ms / 1e3
        if down and slot.node_id in self.view.pending:
            return now - slot.last_seen <= 2 * live.session_grace_ms / 1e3
        return down and now - slot.last_seen <= live.timeout_s + live.relay_hold_ms / 1e3

    async def _sweep_stragglers(self) -> None:
        """StragglerSuspected for a world node persistently slower (driver/straggler.py).

        O(world ranks) every `sweep_ms` (2 s), only while the job trains. The sampling
        yields to the event loop every `SWEEP_CHUNK` nodes, so at 10,000 nodes heartbeats and
        operator calls wait for a chunk, not the whole sweep.
        """
        journal = self._lead.journal
        if journal is None or journal.state.phase != ev.PHASE_RUNNING:
            self.stragglers.tracks.clear()  # a recovery restarts the workers: new baselines
            return
        samples: list[Sample] = []
        for i, node_id in enumerate(list(journal.state.world.node_ids)):
            if i and i % SWEEP_CHUNK == 0:
                await asyncio.sleep(0)
                if self._lead.journal is not journal or journal.state.phase != ev.PHASE_RUNNING:
                    return  # the term or the world changed under the sweep: next period
            slot = self.view.nodes.get(node_id)
            if slot is not None and slot.alive:
                got = sample(node_id, slot.hb)
                if got is not None:
                    samples.append(got)
        for e in self.stragglers.sweep(samples):
            self._emit(e, math.nan)
            s = e.straggler_suspected
            log.warning(
                "straggler suspected",
                node=s.node_id,
                slowdown=round(s.slowdown, 3),
                z=round(s.z, 1),
                policy=s.policy,
            )


def busy_share(samples: collections.deque[tuple[float, float]]) -> float:
    """The share of the wall time between the first and last of `samples` (wall, CPU) that
    the thread spent on its CPU (0 until two samples span some time)."""
    if len(samples) < 2:
        return 0.0
    (w0, c0), (w1, c1) = samples[0], samples[-1]
    return (c1 - c0) / (w1 - w0) if w1 > w0 else 0.0
