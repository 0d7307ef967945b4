"""The driver's completion watch: a job whose every worker exited 0 has finished.

A worker that exits 0 has trained to its last step (a worker stopped by the driver, killed
or crashed exits otherwise, and any non-zero exit is a WorkerFailed). So while the job runs,
when every node of the world reports all its workers EXITED with code 0 in two heartbeats in
a row at least `HOLD_S` apart, the watch records `JobFinished(ok=true)`: the phase becomes
FINISHED, the machine records whatever comes after without reacting (an agent that leaves
is no incident), and `unbroken status` says so. A driver started with
`--exit-when-finished` (what `unbroken slurm submit` writes) then exits 0, so the batch
job ends and gives its nodes back instead of holding them to its time limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import structlog

from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.liveview import NodeSlot
    from unbroken.driver.loop import RecoveryLoop

log = structlog.get_logger(__name__)

HOLD_S = 1.0  # the world must read as done this long (two sweeps), never from one heartbeat


def done_step(
    nodes: Sequence[str], slots: Mapping[str, NodeSlot | None], workers_per_node: int
) -> int | None:
    """The highest step the world's workers reached when every one of them exited 0.

    None while some node of `nodes` is unknown, silent, or reports fewer than
    `workers_per_node` workers, any of them not EXITED or EXITED with a non-zero code.
    """
    if not nodes or workers_per_node <= 0:
        return None
    top = 0
    for n in nodes:
        slot = slots.get(n)
        if slot is None or not slot.alive:
            return None
        workers = slot.hb.workers
        if len(workers) < workers_per_node:
            return None
        for w in workers:
            if w.state != dpb.WORKER_STATE_EXITED or w.exit_code != 0:
                return None
            top = max(top, w.step)
    return top


async def watch(loop: RecoveryLoop) -> None:
    """Record JobFinished(ok=true) once the world's workers all exited 0, then return."""
    period = loop.service.config.live.heartbeat_interval_ms / 1000.0
    seen: tuple[float, dict[str, int]] | None = None  # (when, node -> heartbeats) first done
    while True:
        s = loop.state
        if s.phase == ev.PHASE_FINISHED:
            return
        await asyncio.sleep(period)
        if s.phase != ev.PHASE_RUNNING:
            seen = None
            continue
        nodes = tuple(s.world.node_ids)
        slots = loop.view.nodes
        try:
            step = done_step(nodes, slots, s.world.workers_per_node)
        except Exception:
            log.exception("completion watch failed; continuing")
            step = None
        if step is None:
            seen = None
            continue
        beats = {n: slots[n].heartbeats for n in nodes}
        now = time.monotonic()
        if seen is None:
            seen = (now, beats)
            continue
        if now - seen[0] < HOLD_S or any(beats[n] <= seen[1][n] for n in nodes):
            continue
        newest = s.checkpoints[-1].step if s.checkpoints else 0
        final = max(step, newest)
        reason = (
            f"training complete: all {len(nodes) * s.world.workers_per_node} workers of the "
            f"world exited 0 (step {final})"
        )
        log.info("job finished", step=final, nodes=len(nodes))
        loop.service.emit(ev.Event(job_finished=ev.JobFinished(step=final, ok=True, reason=reason)))
        # wait for the record to land (the next pass returns once the phase is FINISHED)
        deadline = time.monotonic() + 30.0
        while loop.state.phase == ev.PHASE_RUNNING and time.monotonic() < deadline:
            await asyncio.sleep(period)
        seen = None
