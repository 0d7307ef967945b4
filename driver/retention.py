"""What storage and memory keep and how often storage is written: retention, the rings'
verified copies and the persistence interval.

Beside the commit bookkeeping (driver/commits.py), from the log and the live view: a
commit or a rollback tells one connected agent per storage root what to keep
(`retention`), a verified step tells every node to keep its copies in the rings
(`send_ring_keep`), and every StartWorkers carries the persistence interval (Young/Daly from
the measured cost of persisting against the MTBF of the failures only storage could
serve, recovery/lifecycle.py). The keeper follows the log as a journal listener
(`on_appended`): a rollback reopens the steps after it, a torchrun round names the ranks'
owners.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import structlog

from unbroken.driver import commits as commits_mod
from unbroken.driver.commits import Commits
from unbroken.driver.config import ServiceConfig
from unbroken.driver.leadership import Leadership
from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery import lifecycle

log = structlog.get_logger(__name__)


class CheckpointKeeper:
    """Retention, the persistence interval and the newest commit, for the term that leads.

    Args:
        config: keep_checkpoints and the persistence policy.
        lead: who leads (its journal's folded state).
        view: the live view (the step each node reached, persisters that fail).
        commits: the shards counted toward commits (their storage roots).
        send: queues a command for a node's agent (`Sessions.send`).
    """

    def __init__(
        self,
        config: ServiceConfig,
        lead: Leadership,
        view: LiveView,
        commits: Commits,
        send: Callable[[str, dpb.DriverMessage], str],
    ) -> None:
        self.config = config
        self._lead = lead
        self.view = view
        self.commits = commits
        self._send = send
        # the unbroken node ids of the newest torchrun round's participants, in rank order
        # (None: no round seen, or one with a participant the rendezvous could not name)
        self.rdzv_members: list[str] | None = None

    def on_appended(self, event: ev.Event) -> None:
        """Bookkeeping that follows the log: a rollback reopens the steps after it; a
        commit or a rollback updates what storage keeps."""
        kind = event.WhichOneof("payload")
        if kind == "rollback":
            self.commits.rollback(event.rollback.to_step)
        if kind == "rendezvous_round" and not event.rendezvous_round.closed:
            self.rdzv_members = commits_mod.round_members(list(event.rendezvous_round.participants))
        if kind in ("checkpoint_committed", "rollback", "step_verified"):
            self.send_retention(event)
        if kind == "step_verified":
            self.send_ring_keep(event.step_verified.step)

    def retention(self, event: ev.Event | None = None) -> dpb.Retention | None:
        """What storage keeps, from the log (None before the first commit).

        The newest `keep_checkpoints` committed steps, the rollback target (pending or
        last), the newest verified commit (docs/sdc.md) and the step the open incident
        restores; `below` is the newest commit.
        A commit above the newest step the live world reached (by the lower median of
        its nodes' heartbeats) is not believed: storage never loses a step the workers
        could still need for a commit nobody's workers made.
        """
        journal = self._lead.journal
        if journal is None:
            return None
        st = journal.state
        committed = [c.step for c in st.checkpoints]
        if event is not None and event.WhichOneof("payload") == "checkpoint_committed":
            committed.append(event.checkpoint_committed.step)
        reached = self.reached_step()
        if reached is not None:
            beyond = [c for c in committed if c > reached]
            if beyond:
                log.warning(
                    "retention ignores commits beyond the live world's step",
                    reached=reached,
                    commits=beyond[-8:],
                )
            committed = [c for c in committed if c <= reached]
        if not committed:
            return None
        protect = [st.restore_step, st.last_rollback_to]
        # the newest verified commit: where a rollback after silent data corruption goes
        verified = [c.step for c in st.checkpoints if c.verified and c.step in committed]
        if verified:
            protect.append(max(verified))
        if st.HasField("rollback_to"):
            protect.append(st.rollback_to)
        keep = lifecycle.retained(
            committed, self.config.keep_checkpoints, (p for p in protect if p)
        )
        return dpb.Retention(keep_steps=sorted(keep), below=max(committed))

    def reached_step(self) -> int | None:
        """The newest step the live world reached (None when no node of it said): the
        lower median over its alive nodes (the current world's when there is one) of each
        node's step (its workers' in its newest heartbeat, or higher ones seen before)."""
        journal = self._lead.journal
        world = journal.state.world if journal is not None else None
        ids = list(world.node_ids) if world is not None and world.node_ids else None
        steps = []
        for node_id, slot in self.view.nodes.items():
            if (ids is None or node_id in ids) and slot.alive:
                seen = [w.step for w in slot.hb.workers] + list(slot.last_step.values())
                step = max(seen, default=0)
                if step > 0:  # 0: its workers report no steps (nothing known)
                    steps.append(step)
        return commits_mod.reached_step(steps)

    def send_ring_keep(self, step: int) -> None:
        """Tell every node of the world to keep `step`'s copies (a verified step) in its
        ranks' rings, so the rollback after silent data corruption still finds it in memory
        when the workers stop, however many steps they trained meanwhile."""
        journal = self._lead.journal
        if journal is None or not journal.state.world.node_ids:
            return
        for node_id in journal.state.world.node_ids:  # (send stamps each its own id)
            with contextlib.suppress(KeyError):  # not connected now: its next word comes
                self._send(node_id, dpb.DriverMessage(ring_keep=dpb.RingKeep(steps=[step])))

    def send_retention(self, event: ev.Event) -> None:
        """Tell one connected agent per storage root to apply the retention."""
        r = self.retention(event)
        if r is None:
            return
        done: set[str] = set()
        for node_id, url in list(self.commits.url_of.items()):
            if url in done:
                continue
            with contextlib.suppress(KeyError):  # not connected now: another node, or later
                self._send(node_id, dpb.DriverMessage(retention=r))
                done.add(url)

    def storage_mtbf_s(self) -> float:
        """The MTBF of the failures only storage could serve (the job's incidents whose
        restore read storage), with the policy's prior."""
        journal = self._lead.journal
        if journal is None:
            return self.config.persist.prior_mtbf_s
        g = journal.state.goodput
        wall = max(0.0, (time.time_ns() - g.started_ns) / 1e9) if g.started_ns else 0.0
        return lifecycle.mtbf_estimate_s(
            wall, g.storage_incidents, self.config.persist.prior_mtbf_s
        )

    def persist_every_s(self) -> float:
        """The persistence interval for the next StartWorkers (Young/Daly, bounded): the
        measured cost of persisting a checkpoint (folded from the commits) against the
        MTBF of the failures the memory tier (rings, buddies) could not serve
        (recovery/lifecycle.py)."""
        journal = self._lead.journal
        cost = journal.state.persist_cost_s if journal is not None else 0.0
        if cost <= 0:
            return 0.0  # nothing measured yet: the agents' own --persist-every-s
        return lifecycle.persist_interval_at_s(cost, self.storage_mtbf_s(), self.config.persist)

    def persistence(self) -> tuple[float, float, float]:
        """(the interval sent now or 0, the cost of persisting a checkpoint, the storage MTBF)."""
        cost = self._lead.journal.state.persist_cost_s if self._lead.journal is not None else 0.0
        return self.persist_every_s(), cost, self.storage_mtbf_s()

    def newest_commit(self) -> tuple[int, float]:
        """(the newest committed step, seconds since its commit event; -1 when none)."""
        j = self._lead.journal
        if j is None or not j.state.checkpoints:
            return 0, -1.0
        c = j.state.checkpoints[-1]
        wall = c.wall_time_unix_ns
        return c.step, max(0.0, (time.time_ns() - wall) / 1e9) if wall else -1.0

    def persist_failing(self) -> list[dpb.PersistFailure]:
        """The alive nodes whose persister fails now (from their newest heartbeat)."""
        return [
            dpb.PersistFailure(
                node_id=s.node_id,
                error=s.hb.persist_error,
                failures=s.hb.persist_failures,
                failing_s=s.hb.persist_failing_s,
            )
            for s in list(self.view.nodes.values())
            if s.alive and s.hb.persist_failures
        ]
