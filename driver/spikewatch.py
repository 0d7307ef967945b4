"""The driver's loss-spike watch: the asyncio shell around `detectors.LossWatch`.

While the job runs it feeds the live loss curve to the spike detector, once per heartbeat of
the node whose lowest rank stands for the job (`LiveView.loss_beat`: that agent beats at once
on a loss that stands out), else once per heartbeat interval, and queues a `LossSpike` (the
machine decides the rollback). After a spike nothing more is queued until the log has moved
past it and the job runs again.

The spike names the steps every rank holds in memory below it, the rollback's candidate
targets. The ranks wait at the spiked step (trainer/spikewait.py) and their agents list the
rings anew for the heartbeat that reports it, so the watch waits (`RINGS_S` at most) for
every world node's heartbeat from that step on: the copy of the step before the spike is
then seen held, and the rollback goes back one step, not two.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from unbroken.common import aio
from unbroken.driver import detectors
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.loop import RecoveryLoop

log = structlog.get_logger(__name__)

RINGS_S = 0.15


async def watch(loop: RecoveryLoop) -> None:
    """Run the loss watch for `loop` until cancelled."""
    lw = detectors.LossWatch(loop.policy.spike)
    period = loop.service.config.live.heartbeat_interval_ms / 1000.0
    spiked_at = -1  # the state's last_seq when the last spike was queued
    view = loop.view
    beat = view.loss_beat = asyncio.Event()
    while True:
        with contextlib.suppress(TimeoutError):
            await aio.wait_for(beat.wait(), period)
        beat.clear()
        s = loop.state
        if s.phase != ev.PHASE_RUNNING or s.last_seq <= spiked_at:
            continue
        try:
            e = lw.sweep(view, s.world.node_ids)
        except Exception:
            log.exception("loss watch failed; continuing")
            continue
        finally:
            view.loss_node = lw.node
        if e is not None:
            spiked_at = s.last_seq
            p = e.loss_spike
            nodes = tuple(s.world.node_ids)
            await beats_reach(loop, nodes, p.step, RINGS_S)
            held = loop._ring_held(nodes)
            p.memory_steps.extend(sorted(x for x in held or () if x < p.step))
            log.warning("loss spike", step=p.step, loss=p.loss, baseline=p.baseline)
            loop.service.emit(e)


async def beats_reach(
    loop: RecoveryLoop, nodes: tuple[str, ...], step: int, limit_s: float
) -> None:
    """Wait up to `limit_s` until every alive node of `nodes` heartbeated a worker at `step`
    or later."""
    deadline = time.monotonic() + limit_s

    def behind(n: str) -> bool:
        slot = loop.view.nodes.get(n)
        if slot is None or not slot.alive:
            return False
        return max((w.step for w in slot.hb.workers), default=0) < step

    while time.monotonic() < deadline and any(behind(n) for n in nodes):
        await asyncio.sleep(0.005)
