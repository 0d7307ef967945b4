"""Quotas per principal on the agent-facing calls: registrations and relay members.

One credential must not wear out what the whole job shares. A node re-registering in a
loop (each new epoch is a NodeRegistered event in etcd) is held to
`registrations_per_minute` new registrations; a relay carries at most
`max_relay_members` members (each member's own registration names it), so one relay
cannot take the driver's heartbeat budget for thousands of nodes. Past a quota the call is
refused with RESOURCE_EXHAUSTED, naming the quota and what to do; other principals are
not affected. (The rendezvous' per-principal quotas are in driver/rendezvous.py, the
event watchers' in driver/operator.py; a newer session of a node replaces its older one,
driver/sessions.py.)

The counts live in the leader's memory, and a new leader starts them from the log, so a
failover hands nobody a fresh quota (`QuotaBook.seed`, called as a term begins):
- Registrations: every NodeRegistered of the last `WINDOW_S` s, by the event's own wall
  time (its envelope's, stamped by the leader that appended it; a skew between the drivers'
  clocks shifts the window by as much, and a time ahead of ours counts as now). The log
  reads them newest first and stops at the first event older than the window
  (`read_recent`): the last minute's events, not a replay. The event does not name the
  principal that registered; it is counted as `node:<node_id>`, which is exactly the
  principal of every counted registration: only an identified principal is counted, and
  the only identified principal that may register node X is X's own certificate or bound
  token (`Principal.is_node`). A registration acknowledged but not yet in the log when the
  old leader died is not counted (it is not in the job's history either).
- The re-registration a failover brings: each agent registers once more with the new
  leader, under the epoch the log already holds for its node. That is the same agent, not
  a new epoch, and is never counted (`QuotaBook.returning`; once per node per term, so a
  node whose quota is used up still comes back after a failover, and its next new epoch is
  refused). A leader that tracks the log's nodes (driver/term.py `expect_known_nodes`)
  sees it as a reconnect anyway; a launcher's driver, which does not, would otherwise
  count it.
- Relay members: the log does not record which relay a registration named, so each
  relay's member set starts empty with the term and is rebuilt from the members'
  re-registrations, each admitted only while the relay has room: the cap holds across a
  failover as before. What a term does not carry over is the old members' precedence over
  a newcomer that reaches the new leader through the same full relay first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from unbroken.driver.eventlog import EventLog
from unbroken.proto import events_pb2 as ev

WINDOW_S = 60.0
# Event.cause of a NodeRegistered the quota did not count: an agent back under the epoch
# the log holds (a new leader's first registration of it); a later term does not count it
RETURNED = "back with a new leader"
RECENT_PAGE = 1024  # events read per step back through the log (`read_recent`)
# an old leader's clock far ahead of ours must not make a term read the whole log back
RECENT_MAX_EVENTS = 250_000


@dataclass(frozen=True, kw_only=True, slots=True)
class PrincipalQuotas:
    """How much of the shared driver one principal may take."""

    registrations_per_minute: int = field(
        default=30,
        metadata={
            "help": "new registrations (new epochs: NodeRegistered events) one node's "
            "credential may make in a minute; more are RESOURCE_EXHAUSTED"
        },
    )
    max_relay_members: int = field(
        default=1024, metadata={"help": "members one relay may carry (past it: another relay)"}
    )

    def __post_init__(self) -> None:
        if self.registrations_per_minute < 1:
            raise ValueError(
                "registrations_per_minute must be >= 1 (--quota-registrations-per-minute), "
                f"got {self.registrations_per_minute}"
            )
        if self.max_relay_members < 1:
            raise ValueError(
                "max_relay_members must be >= 1 (--quota-max-relay-members), "
                f"got {self.max_relay_members}"
            )


class QuotaBook:
    """The counts behind `PrincipalQuotas`, in the leader's memory; a new leader starts
    them from the log (`seed`), letting each node back once under its logged epoch."""

    def __init__(self, quotas: PrincipalQuotas) -> None:
        self.quotas = quotas
        self._registered: dict[str, collections.deque[float]] = {}
        self._members: dict[str, set[str]] = {}  # relay -> nodes whose registration named it
        self._returning: dict[str, int] = {}  # node -> the epoch the log held at the term's start
        self.refused = 0

    def seed(
        self, state: ev.JobState, recent: Iterable[ev.Event], *, wall_ns: int, now: float
    ) -> None:
        """Start a term from the log, forgetting what an earlier term of this driver
        counted (the log holds that too): `recent` (`read_recent`) gives each principal's
        registrations of the last window, at their wall times seen from `wall_ns` (our
        clock) and placed on the monotonic clock at `now`; `state` (the folded log) the
        epoch each node may come back under once, uncounted. O(recent + nodes)."""
        times: dict[str, list[float]] = {}
        for e in recent:
            if not e.HasField("node_registered") or e.cause == RETURNED:
                continue
            age = max(0.0, (wall_ns - e.wall_time_unix_ns) / 1e9)  # ahead of our clock: now
            if age < WINDOW_S:
                times.setdefault(f"node:{e.node_registered.node_id}", []).append(now - age)
        self._registered = {who: collections.deque(sorted(t)) for who, t in times.items()}
        self._members = {}  # the log names no relay: rebuilt from the members' registrations
        self._returning = {n: rec.epoch for n, rec in state.nodes.items() if rec.epoch}

    def returning(self, node_id: str, epoch: int) -> bool:
        """Whether this registration of `node_id` is its agent back with a new leader: the
        node's first registration of the term, under the epoch the log held for it (not a
        new epoch, so not counted). Any registration of the node uses its one chance."""
        return self._returning.pop(node_id, 0) == epoch != 0

    def registration(self, who: str, now: float) -> str:
        """A new registration by `who` at monotonic `now`: "" when within its quota (and
        counted), else why not."""
        q = self.quotas.registrations_per_minute
        times = self._registered.setdefault(who, collections.deque())
        while times and now - times[0] >= WINDOW_S:
            times.popleft()
        if len(times) >= q:
            self.refused += 1
            wait = WINDOW_S - (now - times[0])
            return (
                f"{who} registered {len(times)} new epochs in the last {WINDOW_S:g} s, the most "
                f"one principal may (registrations_per_minute={q}); retry in {wait:.0f} s, and "
                "find out why this agent restarts so often"
            )
        times.append(now)
        if len(self._registered) > 100_000:  # forget the principals quiet for a window
            for k in [k for k, t in self._registered.items() if not t or now - t[-1] >= WINDOW_S]:
                del self._registered[k]
        return ""

    def relay_member(self, node_id: str, relay: str, still_member: Callable[[str], bool]) -> str:
        """`node_id` registers naming `relay` ("": none): "" when the relay may carry it
        (and it is counted), else why not. `still_member(n)`: whether node n's current
        registration still names `relay` (members that moved on are dropped lazily)."""
        for r, members in list(self._members.items()):
            if r != relay and node_id in members:
                members.discard(node_id)
                if not members:
                    del self._members[r]
        if not relay:
            return ""
        members = self._members.setdefault(relay, set())
        if node_id in members:
            return ""
        cap = self.quotas.max_relay_members
        if len(members) >= cap:
            members.intersection_update({n for n in members if still_member(n)})
        if len(members) >= cap:
            self.refused += 1
            return (
                f"relay {relay!r} already carries {len(members)} members, the most one relay "
                f"may (max_relay_members={cap}); register {node_id!r} with another relay or "
                "with the driver directly"
            )
        members.add(node_id)
        return ""


async def read_recent(log: EventLog, last_seq: int, wall_ns: int) -> list[ev.Event]:
    """The NodeRegistered events of `log`'s last `WINDOW_S` s (by their wall times, seen
    from `wall_ns`), oldest first, for `QuotaBook.seed`.

    Pages are read back from `last_seq` until one begins with an event older than the
    window: what a term reads is the last minute's events (and one page), not the log
    (replay folds from the newest snapshot, which may be younger than the minute). At most
    `RECENT_MAX_EVENTS` are read: an old leader's clock far ahead of ours cannot make a
    term read a whole log (past it, older registrations go uncounted: letting nodes in,
    not locking them out).
    """
    cutoff = wall_ns - int(WINDOW_S * 1e9)
    pages: list[list[ev.Event]] = []
    hi = last_seq
    while hi >= 1 and last_seq - hi < RECENT_MAX_EVENTS:
        lo = max(1, hi - RECENT_PAGE + 1)
        page = await log.read(lo, hi)
        pages.append(
            [e for e in page if e.HasField("node_registered") and e.wall_time_unix_ns >= cutoff]
        )
        if not page or page[0].wall_time_unix_ns < cutoff:
            break
        hi = lo - 1
    return [e for page in reversed(pages) for e in page]
