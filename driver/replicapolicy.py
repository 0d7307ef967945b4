"""The replica policy: keep training through a lost data-parallel replica.

With `Policy.keep_training` and dp >= 2, a clear fault confined to one data-parallel replica
(a worker killed from outside or hung, a node lost) does not wait for the replica's
replacement: the incident's world drops the replica's nodes (they *sit out*,
`JobState.sitting_out`), the other replicas rejoin in their processes with dp - 1 and train on
(the global batch is kept: each replica takes a larger share of it), and the grow-back that
brings the replica (or a spare in its place) in again waits until the driver releases it
(`ReplicaReady`, `Policy.replica_rejoin_s` after the job runs again). The time the survivors
would have spent waiting for a process to start, a CUDA context, NCCL and the replacement's
restore is spent training; the cost is a second, shorter pause at the grow-back.

Ranks are laid out data-parallel outermost (trainer/parallel.py's mesh): replica d holds
the global ranks [d * unit, (d + 1) * unit) with unit = world size / dp. The policy applies
only where each replica is whole nodes (unit a multiple of the workers per node), so the
nodes that sit out hold nothing of the replicas that train on.

The helpers are pure; `watch` is the leader's timer that releases the replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import structlog

from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.loop import RecoveryLoop

log = structlog.get_logger(__name__)

#: How often the leader looks whether a replica that sits out may rejoin.
WATCH_PERIOD_S = 0.1


def replica_of_rank(w: ev.WorldLayout, rank: int) -> int:
    """The data-parallel index of global rank `rank` in world `w`."""
    size = len(w.node_ids) * max(1, w.workers_per_node)
    unit = max(1, size // max(1, w.dp))
    return rank // unit


def replica_nodes(w: ev.WorldLayout, replica: int) -> tuple[str, ...]:
    """The nodes of replica `replica` (whole nodes: see `sits_out`)."""
    wpn = max(1, w.workers_per_node)
    size = len(w.node_ids) * wpn
    unit = size // max(1, w.dp)
    first, last = replica * unit // wpn, ((replica + 1) * unit - 1) // wpn
    return tuple(w.node_ids[first : last + 1])


def sits_out(
    w: ev.WorldLayout, nodes: Iterable[str], ranks: Sequence[int], min_nodes: int
) -> tuple[str, ...]:
    """The nodes of the one replica that the fault on `nodes` (and `ranks`) hit, or ()
    when the policy does not apply: dp < 2, a replica that is not whole nodes, a fault that
    spans replicas, or the other replicas fewer than `min_nodes` nodes."""
    wpn = max(1, w.workers_per_node)
    size = len(w.node_ids) * wpn
    if w.dp < 2 or not w.node_ids or size % w.dp or (size // w.dp) % wpn:
        return ()
    index = {n: i for i, n in enumerate(w.node_ids)}
    hit = {replica_of_rank(w, r) for r in ranks if 0 <= r < size}
    for n in nodes:
        if n not in index:
            return ()  # not (any longer) in the world: nothing to sit out
        hit.add(replica_of_rank(w, index[n] * wpn))
    if len(hit) != 1:
        return ()
    out = replica_nodes(w, hit.pop())
    if len(w.node_ids) - len(out) < min_nodes:
        return ()
    return out


async def watch(loop: RecoveryLoop) -> None:
    """Release the replicas that sit out (a `ReplicaReady` event) once the job has run again
    for `Policy.replica_rejoin_s` with them out; the grow-back follows in the machine.

    The clock starts when this leader first sees the job RUNNING with them out (a new leader
    waits the whole delay again: a late grow-back costs nothing but dp)."""
    since: tuple[tuple[str, ...], float] | None = None
    asked_at = -1  # the state's last_seq when the last release was queued
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        s = loop.state
        out = tuple(s.sitting_out)
        if not out or s.phase != ev.PHASE_RUNNING or s.last_seq <= asked_at:
            since = None if not out else since
            continue
        now = time.monotonic()
        if since is None or since[0] != out:
            since = (out, now)
        if now - since[1] < loop.policy.replica_rejoin_s:
            continue
        asked_at = s.last_seq
        why = f"ran {now - since[1]:.1f} s with dp {s.world.dp}; the replica may rejoin"
        log.info("replica ready", nodes=list(out), why=why)
        loop.service.emit(ev.Event(replica_ready=ev.ReplicaReady(node_ids=list(out), reason=why)))
