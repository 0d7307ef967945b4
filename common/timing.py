"""A node's step timing in six numbers, from its ranks' windows.

The agent summarises its running ranks into `Heartbeat.timing` every heartbeat, and the
driver's straggler sweep (driver/straggler.py) reads that summary: six fields per node
rather than every rank's, which keeps the sweep O(nodes) in protobuf reads. The driver
computes the same summary itself from `Heartbeat.workers` when a sender leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.proto import driver_pb2 as dpb


def node_timing(workers: Iterable[dpb.WorkerStatus]) -> dpb.NodeTiming | None:
    """The upper medians over the running ranks with a window of each rank's compute and
    wait and their MADs, the shortest window and a generation that changes with any rank's restart
    or in-job rejoin (a new place in a new world: a new baseline); None when no rank has a
    window."""
    compute, mad, wait, wait_mad = [], [], [], []
    generation, steps = 0, 1 << 30
    running = dpb.WORKER_STATE_RUNNING
    for w in workers:
        if w.state == running and w.window_steps:
            compute.append(w.compute_ms)
            mad.append(w.compute_mad_ms)
            wait.append(w.wait_ms)
            wait_mad.append(w.wait_mad_ms)
            generation += w.pid + 1_000_003 * (w.restarts + 65_537 * w.rejoins)
            steps = min(steps, w.window_steps)
    if not compute:
        return None
    mid = len(compute) // 2  # the upper median: one of the ranks' own values
    return dpb.NodeTiming(
        generation=generation,
        compute_ms=sorted(compute)[mid],
        mad_ms=sorted(mad)[mid],
        wait_ms=sorted(wait)[mid],
        wait_mad_ms=sorted(wait_mad)[mid],
        window_steps=steps,
    )
