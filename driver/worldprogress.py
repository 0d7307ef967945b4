"""A restarted world's progress, from its nodes' heartbeats (pure, over the live view).

Whether every rank of a world the driver started steps (or exited 0), how long the world
has trained by its ranks' own reports, the step it really restored and how many of its
ranks read their state from storage: what RestoreFinished and TrainingStepping record.
"""

from __future__ import annotations

import time

from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb


def trained_s(view: LiveView, nodes: tuple[str, ...], t0: float, *, restored: bool) -> float:
    """How long the world started at `t0` has been training now, from its ranks' own
    reports: the steps each made since its start (its restored step) at its step time,
    plus its time since progress and the heartbeat's age. The least of the ranks (the
    world trains when they all do); 0 when one has not said enough."""
    now = time.monotonic()
    least = now - t0
    for n in nodes:
        slot = view.nodes.get(n)
        if slot is None or not slot.hb.workers:
            return 0.0
        for w in slot.hb.workers:
            if restored and not w.HasField("restored_step"):
                return 0.0
            steps = w.step - (w.restored_step if restored else 0)
            if steps <= 0 or w.step_time_ms <= 0:
                return 0.0
            ran = steps * w.step_time_ms / 1000.0 + w.since_progress_ms / 1000.0
            least = min(least, ran + max(0.0, now - slot.last_seen))
    return max(0.0, least)


def restored_step(view: LiveView, nodes: tuple[str, ...]) -> int:
    """The step the restarted world really restored: the oldest step its ranks said
    they started from (`WorkerStatus.restored_step`); 0 when a rank has not said. The
    plan (from the rings and buddies the heartbeats listed when the driver decided) is
    a floor: a replica that reached the buddy after the decision is newer."""
    said = []
    for n in nodes:
        slot = view.nodes.get(n)
        workers = slot.hb.workers if slot is not None else ()
        if not workers:
            return 0
        for w in workers:
            if not w.HasField("restored_step"):
                return 0
            said.append(w.restored_step)
    return min(said) if said else 0


def storage_ranks(view: LiveView, nodes: tuple[str, ...]) -> int:
    """The restarted world's ranks that said their state was read from storage
    (`WorkerStatus.restored_from`): the incident needed the storage tier."""
    n = 0
    for node in nodes:
        slot = view.nodes.get(node)
        if slot is not None:
            n += sum(w.restored_from == "storage" for w in slot.hb.workers)
    return n


def runs_start(view: LiveView, nodes: tuple[str, ...], start_id: str, per_node: int) -> bool:
    """Whether every node's latest heartbeat says all its `per_node` workers run the start
    `start_id` (Heartbeat.start_id)."""
    for n in nodes:
        slot = view.nodes.get(n)
        if slot is None or not slot.heartbeats or slot.hb.start_id != start_id:
            return False
        running = [w for w in slot.hb.workers if w.state == dpb.WORKER_STATE_RUNNING]
        if len(running) != len(slot.hb.workers) or len(running) != per_node:
            return False
    return True


def all_stepping(view: LiveView, nodes: tuple[str, ...], marks: dict[str, int]) -> bool:
    """Every node sent a heartbeat since the start in which all its workers step or
    exited 0 (restored at the last step, a rank has nothing left to train: the job
    resumed, and the completion watch then finishes it)."""
    for n in nodes:
        slot = view.nodes.get(n)
        if slot is None or slot.heartbeats <= marks[n] + 1 or not slot.hb.workers:
            return False
        for w in slot.hb.workers:
            if w.state == dpb.WORKER_STATE_EXITED and w.exit_code == 0:
                continue  # done: it may have exited before its first step report
            if w.state != dpb.WORKER_STATE_RUNNING or w.step == 0:
                return False
    return True
