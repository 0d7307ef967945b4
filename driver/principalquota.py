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
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PrincipalQuotas:
    """How much of the shared driver one principal may take."""

    registrations_per_minute: int = 30  # new epochs (NodeRegistered events) per principal
    max_relay_members: int = 1024  # nodes one relay carries

    def __post_init__(self) -> None:
        if self.registrations_per_minute < 1:
            raise ValueError(
                f"registrations_per_minute must be >= 1, got {self.registrations_per_minute}"
            )
        if self.max_relay_members < 1:
            raise ValueError(f"max_relay_members must be >= 1, got {self.max_relay_members}")


class QuotaBook:
    """The counts behind `PrincipalQuotas` (in the leader's memory; a new leader starts
    from zero, which errs on the side of letting nodes back in after a failover)."""

    def __init__(self, quotas: PrincipalQuotas) -> None:
        self.quotas = quotas
        self._registered: dict[str, collections.deque[float]] = {}
        self._members: dict[str, set[str]] = {}  # relay -> nodes whose registration named it
        self.refused = 0

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
