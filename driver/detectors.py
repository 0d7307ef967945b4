"""Failure detectors: pure functions from the live view (and a clock reading) to events.

Each detector turns what heartbeats say into transition events (heartbeats are not
events, transitions are: docs/architecture.md#the-live-view):
- node lost: no heartbeat for `miss_limit` x interval, by the driver's monotonic clock;
- worker failed: a worker reported with a non-zero exit code (once per exit);
- hang suspected: the agent flagged a heartbeat STALLED, having judged a rank hung from
  its own step rhythm and phase (agent/hang.py); one event per node and episode, with the
  stacks of the node's ranks (`hung`);
- log alert: a keyword line the agent's log scanner caught; also bad telemetry
  (a step that went backwards, a non-finite loss) is reported as an alert, not trusted;
- refusal: a stale epoch or a second live agent claiming a node id;
- loss spike: `LossWatch` feeds the job's loss curve (one loss per step, from the lowest
  global rank of the world that reports one) into `recovery.spike.SpikeDetector`; a loss
  far above the robust baseline, or a non-finite one, is a `LossSpike`.

Nothing here reads a clock, the network or etcd; the service passes `now` in and appends
what comes out, so every rule is unit-tested without processes (tests/unit/test_detectors.py).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from unbroken.driver.liveview import LiveView, LiveViewConfig, NodeSlot
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.nodekey import PUBLIC_BYTES
from unbroken.recovery.spike import RESTORE_RESET_STEPS, Prior, SpikeConfig, SpikeDetector

MAX_LINE_CHARS = 4096  # an alert line longer than this is cut (events have a size cap)
MAX_STACK_CHARS = 48 * 1024  # the agent caps a node's stacks at this (agent/hang.py)


def truncate(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, marking the cut."""
    if len(text) <= limit:
        return text
    return text[: limit - 15] + " ...[truncated]"


def starved(hb: dpb.Heartbeat, config: LiveViewConfig) -> bool:
    """Whether a node's heartbeat said its agent was starved of CPU (agent/starvation.py)."""
    c = config
    return (
        hb.loop_lag_ms >= c.starved_lag_ms
        or hb.late_ms >= c.starved_lag_ms
        or hb.cpu_pressure_pct >= c.starved_pressure_pct
        or hb.runnable_per_cpu >= c.starved_runnable
    )


def late_together(view: LiveView, now: float) -> bool:
    """Whether more than `late_share` of the heartbeating nodes (2 at least) are late (two
    intervals without a heartbeat) at this moment: the trouble is likely the observer's or
    the network's, not each node's. Reads only the late front of the deadline order."""
    c = view.config
    late_after = 2 * c.heartbeat_interval_ms / 1000.0
    late = 0
    for slot in view.order.values():
        if now - slot.last_seen <= late_after:
            break
        late += 1
    late += sum(1 for slot in view.strays.values() if now - slot.last_seen > late_after)
    for g in view.groups.values():
        if now - g.seen <= late_after:
            break
        late += len(g.members)
    heard = len(view.order) + len(view.strays) + view.grouped
    return late >= 2 and late > c.late_share * heard


# why a node the log knows was lost after a failover: it did not find the new leader within
# the whole grace, or it asked for the leader during the election and the others came back
NOT_BACK = "not back after the failover"
ASKED_NOT_BACK = "not back after the failover (it asked during the election)"
STREAM_CLOSED = "stream closed"


def silent(
    view: LiveView,
    now: float,
    slack_s: float = 0.0,
    held: list[NodeSlot] | None = None,
) -> list[tuple[NodeSlot, str]]:
    """Alive nodes silent for longer than the timeout, with the reason (nothing is marked).

    Reads only the front of `view.order` (oldest heartbeat first) and stops at the first
    fresh node, so a healthy cluster costs O(1) per sweep; registered nodes that never
    opened a session expire after `session_grace_ms`.

    `slack_s` is how late the driver's own event loop recently ran: heartbeats that sat
    in the driver's socket buffers during its stall are not the node's silence. A node
    whose own heartbeats recently came with long gaps (a loaded host) gets up to
    `jitter_k` x its largest recent gap, capped (`LiveViewConfig`): a jitter-adaptive miss
    limit, so each node is judged against its own rhythm.

    A node still connected whose last heartbeat said it was starved (`starved`), that has
    sent none since it registered, that is late while most nodes are (`late_together`), or
    while a herd is coming in (`LiveView.herding`: a failover's reconnects or a join's
    registrations; at 10,240 nodes they starved a simulator of 2,560 nodes 300 ms, and its
    40 relays and their members were declared lost), gets `starved_hold_ms` more; such
    nodes are appended to `held`. A disconnected node (a killed agent's stream closes at
    once) gets neither that nor the jitter slack: it is lost at the timeout (plus the
    driver's slack), or at the closed timeout when its agent's side closed the stream
    (`LiveView.closed`).
    """
    out: list[tuple[NodeSlot, str]] = []
    c = view.config
    grace_s = c.session_grace_ms / 1000.0
    cap = c.jitter_cap * c.timeout_s
    hold = c.starved_hold_ms / 1000.0
    crowd: bool | None = None  # late_together, read once per sweep when needed
    herd = view.herding(now)
    # a relay group quiet past the timeout: its members are judged one by one below
    view.expand_quiet(now, c.timeout_s + slack_s)
    for queue, timeout, reason, adaptive in (
        (view.order, c.timeout_s + slack_s, "heartbeat timeout", c.jitter_k > 0),
        (view.strays, c.timeout_s + slack_s, "heartbeat timeout", c.jitter_k > 0),
        (view.pending, grace_s + slack_s, "no session after registration", False),
    ):
        whole = queue is view.strays  # out of order: read whole (few)
        beating = whole or queue is view.order
        awaited = view.awaited if queue is view.pending else None
        for slot in queue.values():
            silence = now - slot.last_seen
            if silence <= timeout:
                if whole:
                    continue
                break
            if awaited and (deadline := awaited.get(slot.node_id)) is not None:
                # awaited since a failover; one that asked for the leader (before the
                # deadline of its whole grace) is lost early only once the herd has passed
                if now >= deadline:
                    out.append((slot, NOT_BACK))
                elif view.settled(now):
                    out.append((slot, ASKED_NOT_BACK))
                continue
            # only the stale front is read: the nodes past the fixed timeout
            # (only while its stream is open: a killed agent's closed stream is its loss)
            jitter = min(cap, c.jitter_k * slot.gap_s)
            if adaptive and slot.connected and silence <= jitter + slack_s:
                continue
            if beating and hold and slot.connected and silence <= timeout + hold:
                # ...or that has not sent its first heartbeat since it registered: its
                # registration proved it alive, and under load the first beat is start-up
                # (bench overload, load 64: a spare registered and was lost 506 ms later,
                # then registered again with the same epoch 200 ms after)
                hungry = herd or not slot.hb.seq or starved(slot.hb, c)
                if not hungry and crowd is None:
                    crowd = late_together(view, now)
                if hungry or crowd:
                    if held is not None:
                        held.append(slot)
                    continue
            out.append((slot, reason))
    if view.closed:
        _closed(view, now, slack_s, out)
    return out


def _closed(view: LiveView, now: float, slack_s: float, out: list[tuple[NodeSlot, str]]) -> None:
    """Adds to `out` the nodes whose own stream closed (their agent's exit) silent past
    the closed timeout, not the whole one."""
    closed_s = view.config.closed_timeout_s + slack_s
    named = {slot.node_id for slot, _ in out} if out else set()
    for slot in view.closed.values():
        if now - slot.last_seen > closed_s and slot.node_id not in named:
            out.append((slot, STREAM_CLOSED))


def node_lost(slot: NodeSlot, now: float, reason: str) -> ev.Event:
    """The NodeLost event of `slot`'s agent, silent since its last heartbeat."""
    return ev.Event(
        node_lost=ev.NodeLost(
            node_id=slot.node_id,
            epoch=slot.epoch,
            silent_ms=(now - slot.last_seen) * 1000.0,
            reason=reason,
        )
    )


def declare(view: LiveView, lost: list[tuple[NodeSlot, str]], now: float) -> list[ev.Event]:
    """Mark `lost` nodes lost and return their NodeLost events."""
    for slot, _ in lost:
        view.mark_lost(slot)
    return [node_lost(slot, now, reason) for slot, reason in lost]


def expired(view: LiveView, now: float, slack_s: float = 0.0) -> list[ev.Event]:
    """NodeLost events for every silent node (`silent` then `declare`)."""
    return declare(view, silent(view, now, slack_s), now)


def mass_limit(view: LiveView) -> int:
    """More nodes than this silent at once is a mass silence (see `LiveViewConfig`).

    A mass silence is more likely the driver's own overload or network than that many
    nodes dying in the same 20 ms, so the service holds it back for `mass_loss_hold_ms`.
    """
    c = view.config
    return max(c.mass_loss_min, int(c.mass_loss_fraction * view.alive_count()))


def flagged(slot: NodeSlot, hb: dpb.Heartbeat) -> list[ev.Event]:
    """Events from a heartbeat that carries flags: worker exits, log alerts, bad telemetry."""
    out: list[ev.Event] = []
    for w in hb.workers:
        if w.state == dpb.WORKER_STATE_EXITED and w.exit_code != 0:
            key = (w.local_rank, w.restarts)
            if key not in slot.reported_exits:
                slot.reported_exits.add(key)
                out.append(
                    ev.Event(
                        worker_failed=ev.WorkerFailed(
                            node_id=slot.node_id,
                            local_rank=w.local_rank,
                            global_rank=w.global_rank,
                            exit_code=w.exit_code,
                            last_step=w.step,
                            silent_ms=w.since_progress_ms,
                        )
                    )
                )
    for a in hb.alerts:
        out.append(
            ev.Event(
                log_alert=ev.LogAlert(
                    node_id=slot.node_id,
                    local_rank=a.local_rank,
                    keyword=truncate(a.keyword, 128),
                    line=truncate(a.line, MAX_LINE_CHARS),
                )
            )
        )
    if hb.flags & dpb.HEARTBEAT_FLAG_STALLED:
        out.extend(hung(slot, hb))
    out.extend(telemetry(slot, hb))
    return out


def telemetry(slot: NodeSlot, hb: dpb.Heartbeat) -> list[ev.Event]:
    """Alerts for telemetry that cannot be right: a step that went backwards, a NaN loss.

    A restarted worker (its `restarts` counter bumped) may legitimately start lower, so the
    per-rank high-water mark is kept per (rank, restarts) via `slot.last_step`.
    """
    out = []
    for w in hb.workers:
        key = w.local_rank * 1_000_003 + w.restarts
        prev = slot.last_step.get(key, 0)
        if w.step < prev:
            out.append(
                _alert(
                    slot,
                    w.local_rank,
                    "step went backwards",
                    f"rank {w.local_rank} reported step {w.step} after {prev}",
                )
            )
        else:
            slot.last_step[key] = w.step
        if w.has_loss and not math.isfinite(w.loss):
            out.append(
                _alert(
                    slot,
                    w.local_rank,
                    "non-finite loss",
                    f"rank {w.local_rank} reported loss {w.loss} at step {w.step}",
                )
            )
    return out


def _alert(slot: NodeSlot, local_rank: int, keyword: str, line: str) -> ev.Event:
    return ev.Event(
        log_alert=ev.LogAlert(
            node_id=slot.node_id, local_rank=local_rank, keyword=keyword, line=line
        )
    )


def hung(slot: NodeSlot, hb: dpb.Heartbeat) -> list[ev.Event]:
    """HangSuspected from a heartbeat flagged STALLED: the agent judged ranks hung.

    The agent decides from each rank's own rhythm and phase (agent/hang.py), so the driver
    reads only flagged heartbeats and never sweeps every rank. One event per node and hang
    episode: it names the longest-silent hung rank, every hung local rank, and carries the
    stacks of the node's ranks the agent sent with the flag. A hung rank whose stuck step
    was already reported is not reported again; progress (a new step) re-arms it.
    """
    ranks = [w for w in hb.workers if w.hung and w.state == dpb.WORKER_STATE_RUNNING]
    live = {w.local_rank for w in ranks}
    for r in [r for r in slot.hung_at if r not in live]:
        del slot.hung_at[r]
    new = [w for w in ranks if slot.hung_at.get(w.local_rank) != w.step]
    if not new:
        return []
    for w in ranks:
        slot.hung_at[w.local_rank] = w.step
    # a rank whose process is stopped, else one silent in its own work rather than waiting
    # for a peer in a collective, else the longest silent
    worst = max(
        ranks, key=lambda w: (w.phase == "stopped", w.phase != "collective", w.since_progress_ms)
    )
    return [
        ev.Event(
            hang_suspected=ev.HangSuspected(
                node_id=slot.node_id,
                local_rank=worst.local_rank,
                global_rank=worst.global_rank,
                stuck_at_step=worst.step,
                silent_ms=worst.since_progress_ms,
                threshold_ms=worst.hang_threshold_ms,
                stack_dump=truncate(hb.hang_stacks, MAX_STACK_CHARS),
                phase=worst.phase,
                hung_ranks=sorted(live),
            )
        )
    ]


def admit(view: LiveView, req: dpb.RegisterRequest, now: float) -> tuple[str, ev.Event | None]:
    """Decide a registration: ("", NodeRegistered) to admit, (reason, NodeRefused) to refuse.

    Refused: an epoch older than the one already seen for this node id ("stale epoch"), or
    a second agent while the current one is still connected and heartbeating ("duplicate
    node id"). A known node coming back (same or newer epoch, old session gone) is admitted.
    Returns ("", None) for a reconnect of the same live epoch that needs no new event.
    """
    slot = view.nodes.get(req.node_id)
    if slot is not None and slot.epoch:
        if req.epoch < slot.epoch:
            reason = f"stale epoch {req.epoch}: this node id already registered epoch {slot.epoch}"
            return reason, _refused(req, "stale epoch")
        fresh = slot.alive and now - slot.last_seen <= view.config.timeout_s
        # the same agent process (same epoch: its start time) is a reconnect, never a
        # duplicate: a relayed node coming to us directly after its relay's loss, or an
        # agent whose stream broke while the driver still holds it open
        if slot.connected and fresh and req.epoch != slot.epoch:
            reason = (
                f"duplicate node id {req.node_id!r}: an agent with epoch {slot.epoch} "
                "is connected and heartbeating; give each agent its own --node-id"
            )
            return reason, _refused(req, "duplicate node id")
        if req.epoch == slot.epoch and slot.alive:
            return "", None  # a reconnect (new session, or a new leader) of a live node
    elif slot is None and len(view.nodes) >= view.config.max_nodes:
        return f"node limit {view.config.max_nodes} reached", None
    return "", ev.Event(
        node_registered=ev.NodeRegistered(
            node_id=req.node_id,
            epoch=req.epoch,
            hostname=req.hostname,
            ip=req.ip,
            pod_name=req.pod_name,
            num_workers=req.num_workers,
            num_gpus=len(req.inventory.gpus),
            agent_version=req.agent_version,
            spare=req.spare,
            replica_buddy=req.replica_buddy,
            replica_pubkey=req.replica_pubkey,
        )
    )


def _refused(req: dpb.RegisterRequest, reason: str) -> ev.Event:
    return ev.Event(
        node_refused=ev.NodeRefused(node_id=req.node_id, epoch=req.epoch, reason=reason)
    )


NODE_ID_CHARS = frozenset(string.ascii_letters + string.digits + "._-:")


def node_id_problem(nid: str) -> str:
    """Why `nid` is no node id ("" when it is): ASCII letters, digits and . _ - : only
    (no look-alike letters of other scripts), not starting with '.' or '-' (a node id
    becomes a file name and a command-line word: `-rf`, `..`)."""
    if not all(c in NODE_ID_CHARS for c in nid):
        return f"node_id {nid[:40]!r} may contain only ASCII letters, digits and . _ - :"
    if nid[:1] in (".", "-"):
        return f"node_id {nid[:40]!r} must not start with '.' or '-'"
    return ""


def validate_register(req: dpb.RegisterRequest) -> str:
    """What is wrong with a registration request ("" when it is fine)."""
    nid = req.node_id
    if not nid:
        return "node_id is empty; pass --node-id (default: the hostname)"
    if len(nid) > 128:
        return f"node_id is {len(nid)} characters; at most 128 are allowed"
    problem = node_id_problem(nid)
    if problem:
        return problem
    if req.epoch == 0:
        return "epoch must be > 0 (the agent's start time in ns)"
    for name in ("hostname", "ip", "pod_name", "agent_version", "replica_buddy", "replica_listen"):
        if len(getattr(req, name)) > 256:
            return f"{name} is longer than 256 characters"
    for name, flag in (("replica_buddy", "--buddy"), ("replica_listen", "--replica-listen")):
        value = getattr(req, name)
        host, sep, port = value.rpartition(":")
        if value and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            return f"{name} {value[:60]!r} must be host:port (the agent's {flag})"
    if req.num_workers > 1024:
        return f"num_workers {req.num_workers} is over 1024"
    if len(req.replica_pubkey) not in (0, PUBLIC_BYTES):
        return (
            f"replica_pubkey is {len(req.replica_pubkey)} bytes; an Ed25519 public key is "
            f"{PUBLIC_BYTES} (or none)"
        )
    return ""


def _lowest_rank(slot: NodeSlot) -> dpb.WorkerStatus | None:
    """The node's running worker with the lowest global rank that reports a loss."""
    best: dpb.WorkerStatus | None = None
    for w in slot.hb.workers:
        running = w.state == dpb.WORKER_STATE_RUNNING and w.has_loss and w.step > 0
        if running and (best is None or w.global_rank < best.global_rank):
            best = w
    return best


@dataclass(slots=True)
class LossWatch:
    """The job's loss curve from heartbeats, one loss per step, into a spike detector.

    Every rank of the embedded engine reports the same (all-reduced) loss, so one rank
    stands for the job: the lowest global rank among the world's running workers that
    report a loss. A step is fed once (heartbeats repeat it until the next step); a step
    lower than the last one fed (a restore) is fed too: it belongs to the new timeline.
    Spiking losses never enter the baseline, so after a rollback the curve is judged
    against the losses before the spike; a restore more than `RESTORE_RESET_STEPS` back
    starts a new baseline.
    """

    config: SpikeConfig
    detector: SpikeDetector = field(init=False)
    last_step: int = 0
    last_restarts: int = -1
    last_peak: tuple[int, float] | None = None  # (step, loss) of the last peak fed
    rescan_every: int = 50  # sweeps between full scans of the world (5 s at 100 ms)
    sweeps: int = 0
    full_scans: int = 0
    _node: str = ""  # the node holding the lowest reporting rank at the last full scan

    def __post_init__(self) -> None:
        self.detector = SpikeDetector(self.config)

    @staticmethod
    def _scan(view: LiveView, world: Sequence[str]) -> tuple[dpb.WorkerStatus | None, str]:
        """The lowest global rank reporting a loss in the whole world, and its node."""
        best: dpb.WorkerStatus | None = None
        node = ""
        for node_id in world:
            slot = view.nodes.get(node_id)
            if slot is None or not slot.alive:
                continue
            w = _lowest_rank(slot)
            if w is not None and (best is None or w.global_rank < best.global_rank):
                best, node = w, node_id
        return best, node

    @property
    def node(self) -> str:
        """The node whose heartbeats the watch reads ("" before the first full scan)."""
        return self._node

    def sweep(self, view: LiveView, world: Sequence[str]) -> ev.Event | None:
        """A `LossSpike` event when the newest step's loss spikes, else None.

        O(workers of one node) per sweep: the node that held the lowest rank at the last
        full scan is read alone; the whole world is scanned again when that node stops
        reporting, when it looks like a new timeline (restarts changed, step went back), and
        every `rescan_every` sweeps (a lower rank may have appeared elsewhere).
        """
        self.sweeps += 1
        best: dpb.WorkerStatus | None = None
        if self._node and self.sweeps % self.rescan_every:
            slot = view.nodes.get(self._node)
            if slot is not None and slot.alive and self._node in world:
                best = _lowest_rank(slot)
        if best is None or best.restarts != self.last_restarts or best.step < self.last_step:
            best, self._node = self._scan(view, world)
            self.full_scans += 1
        if best is None:
            return None
        if best.step == self.last_step and best.restarts == self.last_restarts:
            return None
        new_timeline = best.restarts != self.last_restarts or best.step < self.last_step
        if new_timeline:
            self.last_peak = None
            if best.step + RESTORE_RESET_STEPS < self.last_step:
                # A restore far behind the curve (an older commit): the baseline's losses
                # belong to later training and would flag the earlier, higher losses as
                # spikes; the detector learns the curve again from here.
                self.detector = SpikeDetector(self.config)
        # Steps faster than heartbeats: the peak of the last few heartbeats' steps (the
        # agent repeats it in PEAK_BEATS heartbeats, so one overwritten unseen is not
        # lost) stands for the steps the heartbeats skipped over; each peak is fed once.
        points = []
        peak = (best.peak_step, best.peak_loss)
        skipped = best.has_peak and best.peak_step != best.step and peak != self.last_peak
        if skipped and (new_timeline or best.peak_step > self.last_step):
            points.append(peak)
            self.last_peak = peak
        points.append((best.step, best.loss))
        self.last_step, self.last_restarts = best.step, best.restarts
        # A leader that has just taken over has no loss history: until it has, the rank's
        # own recent losses (its agent's median and MAD) are the baseline, so a spike right
        # after a failover is not trained through (bench-recovery: one 1.3 s after a driver
        # kill went unseen).
        prior = Prior(best.loss_median, best.loss_mad, best.loss_window)
        for step, loss in points:
            spike = self.detector.observe(step, loss, prior)
            if spike is not None:
                return ev.Event(loss_spike=spike.to_event())
        return None
