"""The wait for nodes below min_nodes: the leader's timer that ends it.

When an incident's reshape finds too few healthy nodes for any world (`plan_world`: below
`Policy.min_nodes`, or pp x tp not whole nodes), the machine does not fail the job on the
spot: it stays DIAGNOSED with `JobState.awaiting_nodes` set, and every registration (a lost
node's agent back after a host stall, a partition or a reboot; a new node; a spare) is
planned again, so the first world that fits goes on to its restore. This timer ends the
wait: `Policy.await_nodes_s` after this leader first saw it, it appends `NodeWaitExpired`
and the machine fails the job with the reason (`unbroken resume` waits again).

The clock starts when this leader first sees the incident waiting (a new leader waits the
whole time again: a later failure costs nothing that a resume would not).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.loop import RecoveryLoop

log = structlog.get_logger(__name__)

#: How often the leader looks whether the wait ran out.
WATCH_PERIOD_S = 0.25


class NodeWait:
    """The open wait as this leader sees it: which incident, since when (the service holds
    one for `unbroken status`; the term's recovery loop sets `limit_s` and runs `watch`)."""

    def __init__(self) -> None:
        self.limit_s = 0.0  # Policy.await_nodes_s of the loop that watches (0: none does)
        self.incident = ""
        self.since = 0.0
        self.asked_at = -1  # the state's last_seq when the expiry was queued

    def see(self, s: ev.JobState, now: float) -> float | None:
        """Seconds waited so far when `s` waits for nodes, else None (and forget it)."""
        if s.phase != ev.PHASE_DIAGNOSED or not s.awaiting_nodes:
            self.incident = ""
            return None
        if s.incident_id != self.incident:
            self.incident, self.since = s.incident_id, now
        return now - self.since

    def line(self, s: ev.JobState, now: float) -> str:
        """What `s` waits for and how long it still may (`unbroken status`), or ""."""
        waited = self.see(s, now)
        if waited is None:
            return ""
        if not self.limit_s:
            return s.awaiting_nodes
        left = max(0.0, self.limit_s - waited)
        return (
            f"{s.awaiting_nodes}; waited {waited:.0f} s, the job fails in {left:.0f} s "
            "(--await-nodes-s) unless lost nodes come back or nodes or spares join"
        )


async def watch(loop: RecoveryLoop) -> None:
    """Append `NodeWaitExpired` once the open incident waited `Policy.await_nodes_s`."""
    wait = loop.service.node_wait
    wait.limit_s = loop.policy.await_nodes_s
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        s = loop.state
        waited = wait.see(s, time.monotonic())
        if waited is None or waited < wait.limit_s or s.last_seq <= wait.asked_at:
            continue
        wait.asked_at = s.last_seq
        log.error(
            "no nodes came back in time: the job fails",
            incident=s.incident_id,
            waited_s=round(waited, 1),
            why=s.awaiting_nodes,
        )
        loop.service.emit(
            ev.Event(
                node_wait_expired=ev.NodeWaitExpired(
                    incident_id=s.incident_id, waited_s=waited, reason=s.awaiting_nodes
                )
            )
        )
