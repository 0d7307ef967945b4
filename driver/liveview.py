"""The driver's in-memory live view of every node: the heartbeat hot path lives here.

Heartbeats are never events (docs/architecture.md#the-live-view): 20,000 of them a
second would swamp etcd and say nothing new. The live view keeps, per node, a
preallocated `NodeSlot` holding the last heartbeat message (by reference, never copied), a
monotonic timestamp and a counter.
`LiveView.order` is an insertion-ordered dict kept sorted by last heartbeat time (a beat
moves its node to the end), so the node-lost sweep reads only the stale front of it
instead of scanning every node on every tick.

A relay that vouches for its group (`RelayBatch.group_alive`) keeps its members out of
that order: they sit in the relay's `Group`, whose one timestamp the relay's batch moves,
so a batch costs the driver O(1) plus its named entries, not O(members). A member's
`last_seen` and `heartbeats` read through its group. A member the relay names late, or
every member of a group whose relay went quiet past the timeout, goes back to being
tracked alone (`strays`, read whole by the sweep, when it is older than the order's end).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from unbroken.common import aio
from unbroken.proto import driver_pb2 as dpb

# a node that asked this driver for the leader this recently before it won retries fast
ASKED_WINDOW_S = 10.0
# `LiveView.next_beat` returns no sooner than this: a large world's stream of heartbeats
# then wakes a waiter at most every few ms, not at each of its 100,000 a second
BEAT_WAIT_FLOOR_S = 0.002


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveViewConfig:
    """Liveness timing: a node is lost after `miss_limit` x `heartbeat_interval_ms` of silence."""

    heartbeat_interval_ms: int = field(
        default=100, metadata={"help": "agent heartbeat interval (10-60000)"}
    )
    miss_limit: int = field(default=3, metadata={"help": "missed heartbeats before a node is lost"})
    max_nodes: int = field(
        default=20_000,
        metadata={
            "flag": "--max-registered-nodes",
            "help": "a registration flood beyond this gets RESOURCE_EXHAUSTED",
        },
    )
    session_grace_ms: int = field(
        default=5_000, metadata={"help": "from Register to the session's start"}
    )
    # After a failover the new leader awaits the log's nodes for twice the session grace:
    # agents find it after their backoff. A node that asked this driver for the leader while
    # it was a standby retries every --election-retry-s (fast), so once the herd has come back
    # and gone quiet, such a node still missing is lost after failover_grace_ms, not 10 s
    # (bench-recovery at MTBF 20 s: a node lost 0.4 s after a leader kill stopped the job
    # for 12.3 s).
    failover_grace_ms: int = field(
        default=1_500,
        metadata={
            "help": "a node that asked this standby for the leader during the election and "
            "is not back this long after the win (at most --session-grace-ms), while the "
            "others came back and went quiet and no more than --mass-loss-min are still "
            "out, is lost (0: it gets the whole registration grace)"
        },
    )
    failover_quiet_ms: int = field(
        default=1_000,
        metadata={"help": "...quiet: no awaited node came back for this long"},
    )
    # mass silence (more than max(mass_loss_min, mass_loss_fraction x nodes) at once) is
    # held back for up to mass_loss_hold_ms: likely the driver's overload, not the nodes
    mass_loss_fraction: float = field(
        default=0.25,
        metadata={"help": "silence of more than this fraction of the nodes at once is held back"},
    )
    mass_loss_min: int = field(
        default=8,
        metadata={
            "help": "...and of more than this many nodes (while nobody at all is heard, "
            "any silent nodes of a world of two or more, their streams open)"
        },
    )
    mass_loss_hold_ms: int = field(
        default=3_000,
        metadata={"help": "how long such a mass silence is held back while others are heard"},
    )
    # ...and its hold's clock stops while no node at all is heard: a whole world silent at
    # once is the observer's silence (its loop behind its streams, its own network), not
    # 10,240 deaths (bench-scale: the leader once read no relay stream for 3 s, and all
    # 9,442 nodes it knew alive were silent together; a fixed 3 s hold declares them lost)
    mass_loss_max_hold_ms: int = field(
        default=30_000,
        metadata={
            "help": "the longest a mass silence is held in all, counting the time no node "
            "at all was heard (the driver's own silence)"
        },
    )
    # Jitter-adaptive miss limit: a node whose heartbeats recently came with gaps of g ms
    # is lost only after min(jitter_k x g, jitter_cap x the timeout) (and never sooner than
    # the timeout): a node on a loaded host is given the slack its own rhythm shows, a
    # steady node keeps the fast limit. 0 turns it off.
    jitter_k: float = field(
        default=2.0,
        metadata={
            "help": "a node whose heartbeats came with gaps of g ms is lost after "
            "min(this x g, --jitter-cap x the timeout), never sooner than the timeout (0: off)"
        },
    )
    jitter_cap: float = field(default=4.0, metadata={"help": "cap of the rule above"})
    jitter_decay: float = field(
        default=0.998,
        metadata={"help": "per heartbeat: an old gap is forgotten in about a minute"},
    )
    # a relayed node whose silence began with its relay's loss is held back this long
    # (beyond the timeout) while it reconnects to the driver directly
    relay_hold_ms: int = field(
        default=2_000,
        metadata={
            "help": "a relayed node silent since its relay's loss is held back this long "
            "while it reconnects directly"
        },
    )

    # A node whose own stream closed from its side (a killed agent's closes at once; the
    # driver ending a session is not that) is lost this long after its last heartbeat,
    # not the whole timeout, unless it registers or opens a session again first: an agent
    # that only reconnects does so within its backoff (50 ms). A node that just went quiet,
    # its stream still open, gets the timeout (bench-recovery: a SIGKILLed node was declared
    # 0.43-0.50 s after its death, the timeout less the age of its last heartbeat).
    closed_timeout_ms: int = field(
        default=200,
        metadata={
            "help": "a node whose stream its agent closed (a dead agent's closes at once) is "
            "lost this long after its last heartbeat unless it reconnects (at most the "
            "timeout; 0: the timeout)"
        },
    )

    # A node still connected (its stream open: a killed agent's closes at once) that is
    # silent past its timeout while it was starved (its last heartbeat said so: its own loop
    # lag or lateness, the host's CPU pressure or run queue; agent/starvation.py), or while
    # most nodes are late together (the observer's or the network's trouble), is given
    # starved_hold_ms more: a heartbeat or a same-epoch re-registration within it keeps its
    # place (no NodeLost, no replacement).
    starved_hold_ms: int = field(
        default=2_000,
        metadata={
            "help": "a connected node late while starved (or while most nodes are late) is "
            "given this much longer before it is lost (0: off)"
        },
    )
    starved_lag_ms: float = field(
        default=50.0,
        metadata={"help": "an agent whose loop lag or heartbeat lateness reached this is starved"},
    )
    starved_pressure_pct: float = field(
        default=20.0,
        metadata={"help": "...or whose host CPU pressure (PSI some avg10, percent) reached this"},
    )
    starved_runnable: float = field(
        default=1.5,
        metadata={"help": "...or whose host had this many runnable threads per CPU"},
    )
    late_share: float = field(
        default=0.5,
        metadata={
            "help": "more than this share of the nodes (2 at least) late together: hold "
            "each one's loss as if it were starved"
        },
    )

    def __post_init__(self) -> None:
        if not 10 <= self.heartbeat_interval_ms <= 60_000:
            raise ValueError(
                f"heartbeat_interval_ms must be in [10, 60000], got {self.heartbeat_interval_ms}"
            )
        if not 1 <= self.miss_limit <= 1000:
            raise ValueError(f"miss_limit must be in [1, 1000], got {self.miss_limit}")
        if self.session_grace_ms < self.heartbeat_interval_ms:
            raise ValueError(
                f"session_grace_ms must be >= heartbeat_interval_ms, got {self.session_grace_ms}"
            )
        if not 0 <= self.failover_grace_ms <= 600_000:
            raise ValueError(
                f"failover_grace_ms must be in [0, 600000], got {self.failover_grace_ms}"
            )
        if not 0 <= self.failover_quiet_ms <= 600_000:
            raise ValueError(
                f"failover_quiet_ms must be in [0, 600000], got {self.failover_quiet_ms}"
            )
        if not 0.0 < self.mass_loss_fraction <= 1.0:
            raise ValueError(f"mass_loss_fraction must be in (0, 1], got {self.mass_loss_fraction}")
        if self.mass_loss_min < 1 or self.mass_loss_hold_ms < 0:
            raise ValueError("mass_loss_min must be >= 1 and mass_loss_hold_ms >= 0")
        if self.mass_loss_max_hold_ms < self.mass_loss_hold_ms:
            raise ValueError("mass_loss_max_hold_ms must be >= mass_loss_hold_ms")
        if self.closed_timeout_ms and self.closed_timeout_ms < self.heartbeat_interval_ms:
            raise ValueError(
                "closed_timeout_ms must be 0 or >= heartbeat_interval_ms, got "
                f"{self.closed_timeout_ms}"
            )
        if not 0 <= self.relay_hold_ms <= 600_000:
            raise ValueError(f"relay_hold_ms must be in [0, 600000], got {self.relay_hold_ms}")
        if not 0 <= self.starved_hold_ms <= 600_000:
            raise ValueError(f"starved_hold_ms must be in [0, 600000], got {self.starved_hold_ms}")
        if not 0.0 < self.late_share <= 1.0:
            raise ValueError(f"late_share must be in (0, 1], got {self.late_share}")
        if self.starved_lag_ms <= 0 or self.starved_pressure_pct <= 0 or self.starved_runnable <= 0:
            raise ValueError(
                "starved_lag_ms, starved_pressure_pct and starved_runnable must be > 0, got "
                f"{self.starved_lag_ms}, {self.starved_pressure_pct}, {self.starved_runnable}"
            )
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {self.max_nodes}")
        if self.jitter_k < 0 or self.jitter_cap < 1.0 or not 0.0 < self.jitter_decay <= 1.0:
            raise ValueError(
                "jitter_k must be >= 0, jitter_cap >= 1 and jitter_decay in (0, 1], got "
                f"{self.jitter_k}, {self.jitter_cap}, {self.jitter_decay}"
            )

    @property
    def timeout_s(self) -> float:
        """Silence after which a node is declared lost, in seconds."""
        return self.heartbeat_interval_ms * self.miss_limit / 1000.0

    @property
    def closed_timeout_s(self) -> float:
        """Silence after which a node whose own stream closed is lost, in seconds."""
        if not self.closed_timeout_ms:
            return self.timeout_s
        return min(self.timeout_s, self.closed_timeout_ms / 1000.0)


class Group:
    """A relay's vouched members: heard as one while the relay's batches say so."""

    __slots__ = ("beats", "members", "parked", "relay", "seen")

    def __init__(self, relay: str, seen: float) -> None:
        self.relay = relay
        self.seen = seen  # monotonic time of the relay's last batch that vouched for them
        self.beats = 0  # batches that vouched, so far
        self.members: dict[str, NodeSlot] = {}
        # members the sweep took out when the group went quiet: vouched again (or, when lost
        # meanwhile, sent away) at the relay's next vouching batch
        self.parked: dict[str, NodeSlot] = {}


class NodeSlot:
    """One node's live state. Mutated only by the event loop thread."""

    __slots__ = (
        "_beats",
        "_seen",
        "alive",
        "connected",
        "epoch",
        "gap_s",
        "group",
        "group_mark",
        "hb",
        "hung_at",
        "info",
        "last_step",
        "leaving",
        "node_id",
        "outbox",
        "peer_host",
        "relay",
        "report_key",
        "reported_exits",
        "session",
    )

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.epoch = 0
        self.info = dpb.RegisterRequest()
        self.peer_host = ""  # the address the registration came from (transport, not claimed)
        self._seen = 0.0  # time.monotonic() of its last heartbeat (or registration)
        self.gap_s = 0.0  # the largest recent gap between its heartbeats (decaying)
        self.hb = dpb.Heartbeat()
        self._beats = 0
        self.group: Group | None = None  # its relay's group while the relay vouches for it
        self.group_mark = 0  # the group's `beats` when it joined
        self.alive = False
        self.connected = False
        self.relay = ""  # the relay its registration named ("": it heartbeats to us directly)
        self.report_key = b""  # its key for signed shard reports (common/reportmac.py)
        self.session = 0  # bumps per stream, so an old stream's exit does not clobber a new one
        self.outbox: object | None = None  # the session's bounded command queue
        self.reported_exits: set[tuple[int, int]] = set()  # (local_rank, restarts)
        self.hung_at: dict[int, int] = {}  # local_rank -> step a hang was reported at
        self.last_step: dict[int, int] = {}  # local_rank -> highest step seen
        # told to leave (evicted): its agent exits, so its silence is no loss (no NodeLost)
        self.leaving = False

    @property
    def last_seen(self) -> float:
        """time.monotonic() of its last heartbeat (or registration, or its group's batch)."""
        g = self.group
        return self._seen if g is None or g.seen < self._seen else g.seen

    @last_seen.setter
    def last_seen(self, value: float) -> None:
        self._seen = value

    @property
    def heartbeats(self) -> int:
        """Heartbeats heard (a grouped member's: one per vouching batch of its relay)."""
        g = self.group
        return self._beats if g is None else self._beats + g.beats - self.group_mark

    @heartbeats.setter
    def heartbeats(self, value: int) -> None:
        g = self.group
        self._beats = value if g is None else value - g.beats + self.group_mark


class LiveView:
    """Every node's slot plus the deadline order used by the node-lost sweep."""

    def __init__(self, config: LiveViewConfig) -> None:
        self.config = config
        self.nodes: dict[str, NodeSlot] = {}
        # alive nodes only, oldest heartbeat first (dicts keep insertion order)
        self.order: dict[str, NodeSlot] = {}
        # registered, session not started yet, oldest registration first: a registration
        # storm must not turn into false NodeLost events while sessions are being opened
        self.pending: dict[str, NodeSlot] = {}
        # alive nodes tracked alone but older than the end of `order` (a member its relay
        # named late, a quiet group's members): few, read whole by the sweep
        self.strays: dict[str, NodeSlot] = {}
        # relay id -> the group it vouches for, stalest batch first
        self.groups: dict[str, Group] = {}
        self.grouped = 0  # members in groups
        # alive nodes whose own direct stream closed from their side (`closed_timeout_ms`)
        # and that have not registered or opened a session since: few, read whole
        self.closed: dict[str, NodeSlot] = {}
        self.decay = config.jitter_decay
        # node id -> when it asked this driver, a standby then, for the leader
        self.asked: dict[str, float] = {}
        # after a failover, the log's nodes not back yet: node id -> the deadline of its
        # whole grace when it asked for the leader during the election (held only until
        # `settled`), else 0.0; `back_at`: when the last awaited node came back
        self.awaited: dict[str, float] = {}
        self.back_at = 0.0
        self._joins, self._joins_last = 0, -math.inf  # the registrations' burst (`herding`)
        # when any node was last heard (a heartbeat, a relay's batch or reply, a
        # registration): a mass silence with nobody heard is the driver's own
        self.heard_at = 0.0
        self.fanning = 0  # commands to many nodes out now (`fanning_out`)
        self.fanned_at = -math.inf  # ...when the last one came back (monotonic)
        # the node whose heartbeats carry the job's loss curve (`detectors.LossWatch`) and
        # what its direct heartbeat sets: the spike detector reads it then, not up to a
        # whole sweep interval later
        self.loss_node = ""
        self.loss_beat: asyncio.Event | None = None
        # set by every heartbeat once something waited for one (`next_beat`)
        self.any_beat: asyncio.Event | None = None

    @contextlib.contextmanager
    def fanning_out(self, nodes: int) -> Iterator[None]:
        """While a command to more than `mass_loss_min` nodes is out (the recovery loop's
        stops and starts, driver/fanout.py): the node watch takes a large silence then, and
        for one timeout after, for the driver's backlog of replies (driver/nodewatch.py)."""
        wide = nodes > self.config.mass_loss_min
        self.fanning += wide
        try:
            yield
        finally:
            if wide:
                self.fanning -= 1
                self.fanned_at = time.monotonic()

    def fanned_out(self, now: float) -> bool:
        """Whether a wide command is out, or one came back less than a timeout ago."""
        return self.fanning > 0 or now - self.fanned_at < self.config.timeout_s

    def slot(self, node_id: str) -> NodeSlot:
        """The slot of `node_id`, created on first use."""
        s = self.nodes.get(node_id)
        if s is None:
            s = self.nodes[node_id] = NodeSlot(node_id)
        return s

    def mark_closed(self, slot: NodeSlot) -> None:
        """`slot`'s own stream was closed by its side: it is lost after the closed timeout
        unless it comes back (`reopened`, `mark_alive`, `mark_registered`) first."""
        if slot.alive:
            self.closed[slot.node_id] = slot

    def reopened(self, slot: NodeSlot, now: float) -> None:
        """`slot`, whose stream had closed, registered again at `now`: proof of life, so
        it is followed as heard then and the closed timeout no longer applies."""
        if self.closed.pop(slot.node_id, None) is not None and slot.alive:
            if slot.node_id in self.order or slot.node_id in self.strays:
                self.refresh(slot, now)

    def _untrack(self, slot: NodeSlot) -> None:
        """Take `slot` out of every queue and group (its `last_seen` as it read)."""
        self.closed.pop(slot.node_id, None)
        if slot.group is not None:
            self._leave(slot)
        self.order.pop(slot.node_id, None)
        self.pending.pop(slot.node_id, None)
        self.strays.pop(slot.node_id, None)

    def _leave(self, slot: NodeSlot) -> None:
        g = slot.group
        assert g is not None
        seen, beats = slot.last_seen, slot.heartbeats
        del g.members[slot.node_id]
        self.grouped -= 1
        slot.group = None
        slot._seen, slot._beats = seen, beats

    def _track(self, slot: NodeSlot) -> None:
        """Track ungrouped `slot` alone: at the end of `order` when it is not older than
        that end, else among the strays."""
        order = self.order
        if order and next(reversed(order.values()))._seen > slot._seen:
            self.strays[slot.node_id] = slot
        else:
            order[slot.node_id] = slot

    def mark_registered(self, slot: NodeSlot, now: float) -> None:
        """`slot` registered at `now`; it has `session_grace_ms` to open its session."""
        if now - self._joins_last > self.config.failover_quiet_ms / 1e3:
            self._joins = 0  # a new burst of registrations (`herding`)
        self._joins += 1
        self._joins_last = now
        self._back(slot, now)
        self._untrack(slot)
        slot.alive = True
        slot.last_seen = self.heard_at = now
        self.pending[slot.node_id] = slot

    def mark_alive(self, slot: NodeSlot, now: float) -> None:
        """Start (or restart) tracking `slot`'s heartbeats from `now`."""
        self._back(slot, now)
        self._untrack(slot)
        slot.alive = True
        slot.last_seen = self.heard_at = now
        self.order[slot.node_id] = slot

    # ----------------------------------------------------------- after a failover
    def asked_for_leader(self, node_id: str, now: float) -> None:
        """`node_id` asked this driver, not the leader, for the leader (its agent retries
        fast while an election is under way). Bounded by `max_nodes`."""
        asked = self.asked
        if node_id not in asked and len(asked) >= self.config.max_nodes:
            old = now - ASKED_WINDOW_S
            for n in [n for n, t in asked.items() if t < old]:
                del asked[n]
            if len(asked) >= self.config.max_nodes:
                return
        asked[node_id] = now

    def await_nodes(self, slots: list[NodeSlot], now: float, grace_s: float) -> None:
        """A new leader awaits the log's `slots` from `now`: each has `grace_s` beyond the
        registration grace, or `failover_grace_ms` when it asked this driver for the leader
        within `ASKED_WINDOW_S` (those first: the pending order is oldest deadline first)."""
        c = self.config
        session_s = c.session_grace_ms / 1000.0
        fast_s = min(c.failover_grace_ms, c.session_grace_ms) / 1000.0
        recent = now - ASKED_WINDOW_S
        fast = [s for s in slots if fast_s and self.asked.get(s.node_id, -math.inf) >= recent]
        fast_ids = {s.node_id for s in fast}
        self.awaited.clear()
        self.back_at = 0.0
        for slot in fast + [s for s in slots if s.node_id not in fast_ids]:
            quick = slot.node_id in fast_ids
            self._untrack(slot)
            slot.alive = True
            slot.last_seen = now + (fast_s - session_s if quick else grace_s)
            self.pending[slot.node_id] = slot
            self.awaited[slot.node_id] = now + grace_s + session_s if quick else 0.0
        self.asked.clear()

    def _back(self, slot: NodeSlot, now: float) -> None:
        if self.awaited and self.awaited.pop(slot.node_id, None) is not None:
            self.back_at = now

    def settled(self, now: float) -> bool:
        """Since the failover some awaited node came back, none for `failover_quiet_ms`
        (the herd of reconnecting agents has passed), and no more than `mass_loss_min` are
        still awaited (the few a failover's coincidence may have killed; more is a slow
        herd, given the whole grace)."""
        c = self.config
        if not self.back_at or now - self.back_at < c.failover_quiet_ms / 1000.0:
            return False
        return len(self.awaited) <= c.mass_loss_min

    def herding(self, now: float) -> bool:
        """A herd is coming in: a failover's, some awaited node came back and it has not
        settled (`settled`); or a storm of registrations, more than `mass_loss_min` none
        of them `failover_quiet_ms` apart, the last within that time (a cluster's join)."""
        c = self.config
        if self._joins > c.mass_loss_min and now - self._joins_last < c.failover_quiet_ms / 1e3:
            return True
        return bool(self.back_at) and not self.settled(now)

    def refresh(self, slot: NodeSlot, now: float) -> None:
        """Alive `slot` heard at `now` (tracked alone: out of its group, if it was in one)."""
        slot.last_seen = self.heard_at = now
        order = self.order
        if order.pop(slot.node_id, None) is None:
            self.strays.pop(slot.node_id, None)
            if slot.group is not None:
                self._leave(slot)
                slot._seen = now
        order[slot.node_id] = slot

    # ------------------------------------------------------------ relay groups
    def vouched(self, relay: str, now: float) -> Group:
        """`relay`'s batch at `now` vouched for its group: O(1), whatever its size. The
        caller vouches again for (or sends away) the members in `parked`."""
        g = self.groups.pop(relay, None)
        if g is None:
            g = Group(relay, now)
        self.groups[relay] = g  # the freshest at the end
        g.seen = self.heard_at = now
        g.beats += 1
        return g

    def relay_heard(self, relay: NodeSlot, now: float) -> None:
        """A member's reply came up alive `relay`'s stream at `now`: the relay is heard, and
        so is the group it vouches for. Its batches are in order behind that reply, and
        still name the members gone late or silent: read later, not lost. (A world-wide
        command's 64 replies a group, read ahead of each relay's next batch, put the
        batches seconds behind at 10,240 nodes, and the quiet groups' members were
        declared lost.)"""
        self.refresh(relay, now)
        g = self.groups.pop(relay.node_id, None)
        if g is not None:
            self.groups[relay.node_id] = g  # the freshest at the end
            g.seen = now

    def join(self, slot: NodeSlot, group: Group, now: float) -> None:
        """Alive `slot`, heard at `now`, is vouched for by `group`'s relay from now on."""
        if slot.group is group:
            slot._seen = now
            return
        self._back(slot, now)
        self._untrack(slot)
        slot.alive = True
        slot._seen = now
        slot.group, slot.group_mark = group, group.beats
        group.members[slot.node_id] = slot
        self.grouped += 1

    def late(self, slot: NodeSlot, seen: float) -> None:
        """The relay no longer vouches for `slot`: last heard at `seen`, tracked alone."""
        self._untrack(slot)
        slot.alive = True
        slot._seen = min(slot._seen, seen)
        self._track(slot)

    def drop_group(self, relay: str) -> None:
        """`relay` is gone (its session ended): its members are tracked alone."""
        g = self.groups.pop(relay, None)
        if g is None:
            return
        for slot in list(g.members.values()):
            self._leave(slot)
            self._track(slot)
        g.parked.clear()

    def expand_quiet(self, now: float, timeout: float) -> None:
        """Members of a group whose relay vouched for none of them for `timeout` are
        tracked alone (parked, for the relay's next vouching batch); reads only the quiet
        front of `groups`."""
        for g in self.groups.values():
            if now - g.seen <= timeout:
                break
            for slot in list(g.members.values()):
                self._leave(slot)
                self._track(slot)
                g.parked[slot.node_id] = slot

    def tracked(self, slot: NodeSlot) -> bool:
        """Whether alive `slot`'s heartbeats are being followed (not only registered)."""
        return slot.alive and (
            slot.group is not None or slot.node_id in self.order or slot.node_id in self.strays
        )

    def heard(self) -> Iterable[NodeSlot]:
        """Alive nodes heard from: the deadline order's newest first, then grouped ones."""
        yield from reversed(self.order.values())
        for g in reversed(self.groups.values()):
            yield from g.members.values()

    def beat(self, slot: NodeSlot, hb: dpb.Heartbeat, now: float) -> None:
        """Record one heartbeat: the whole per-message cost of a healthy node."""
        if slot.heartbeats:  # the gap since the previous heartbeat (not the registration)
            gap = now - slot.last_seen
            decayed = slot.gap_s * self.decay
            slot.gap_s = gap if gap > decayed else decayed
        slot.hb = hb
        slot.heartbeats += 1
        if self.loss_beat is not None and slot.node_id == self.loss_node:
            self.loss_beat.set()
        if self.any_beat is not None:
            self.any_beat.set()
        if slot.alive:
            # pop + reinsert moves the node to the end of the deadline order
            self.refresh(slot, now)
        else:
            slot.last_seen = self.heard_at = now

    async def next_beat(self, limit_s: float, floor_s: float = BEAT_WAIT_FLOOR_S) -> None:
        """Return at the next heartbeat of any node, but not before `floor_s`, or after
        `limit_s`: a wait on what the heartbeats say (every rank stepping in a restore)
        sees it when the last one lands, not at its next poll (a 50 ms poll was ~25 ms of
        each in-job resume)."""
        beat = self.any_beat
        if beat is None:
            beat = self.any_beat = asyncio.Event()
        beat.clear()
        await asyncio.sleep(min(floor_s, limit_s))
        if not beat.is_set() and limit_s > floor_s:
            with contextlib.suppress(TimeoutError):
                await aio.wait_for(beat.wait(), limit_s - floor_s)

    def mark_lost(self, slot: NodeSlot) -> None:
        """Stop tracking `slot` (it was declared lost)."""
        self.awaited.pop(slot.node_id, None)
        self._untrack(slot)
        slot.alive = False

    def mark_leaving(self, node_id: str) -> None:
        """`node_id` was told to leave (evicted): its agent exits on the command, so the
        node-lost sweep forgets it when it goes silent rather than declaring it lost."""
        slot = self.nodes.get(node_id)
        if slot is not None:
            slot.leaving = True

    def alive_count(self) -> int:
        return len(self.order) + len(self.pending) + len(self.strays) + self.grouped

    def snapshot(
        self, now: float | None = None, *, after: str = "", limit: int = 0
    ) -> list[dpb.NodeLive]:
        """A copy of the view for tools (`LiveView` RPC): every node in registration order,
        or, with `limit`, a page of `limit` nodes in node-id order after the id `after`."""
        t = time.monotonic() if now is None else now
        out = []
        slots: Iterable[NodeSlot] = self.nodes.values()
        if limit:
            ids = sorted(self.nodes)
            start = bisect.bisect_right(ids, after) if after else 0
            slots = [self.nodes[i] for i in ids[start : start + limit]]
        for s in slots:
            n = dpb.NodeLive(
                node_id=s.node_id,
                epoch=s.epoch,
                alive=s.alive,
                silent_ms=(t - s.last_seen) * 1000.0 if s.last_seen else 0.0,
                heartbeats=s.heartbeats,
            )
            n.workers.extend(s.hb.workers)
            n.attached.extend(s.hb.attached)
            if s.hb.HasField("host"):
                n.host.CopyFrom(s.hb.host)
            out.append(n)
        return out
