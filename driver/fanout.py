"""One command to many agents: the recovery loop's broadcasts (driver/loop.py).

Each node's command is sent and its reply awaited under the loop's command deadline, all
at once; the failures come back by node and are logged in one line however many there are
(at 10,240 nodes one line each was 243,498 lines in one bench run).

A stop is sent once: while a node's StopWorkers is in flight, or was acknowledged, and
nothing started or resumed its workers since, a later decision that stops it again (the
next lost node of the same incident: a decision each) waits for that same reply instead of
sending another. At 10,240 nodes every decision of an incident sent 10,240 stops, each a
request the driver writes and waits for, and the losses of one incident came one decision
at a time. The stop counts for the node's session it went down (its epoch and its outbox:
a new session, or a member attached to its relay again, gets it again) and for the same
command (an in-job stop's ranks to replace are part of it).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Protocol

import structlog

from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb

log = structlog.get_logger(__name__)

LOGGED_ERRORS = 16  # a broadcast's failures named in its one log line (the count is whole)

Message = dpb.DriverMessage | Callable[[str], dpb.DriverMessage]
Reply = tuple[str, dpb.CommandAck | None]  # the error ("": none) and the ack


class Requester(Protocol):
    def send(self, node_id: str, msg: dpb.DriverMessage) -> str: ...

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage: ...


class Fanout:
    """Broadcasts for one recovery loop; `stops_reused` counts the stops not sent again."""

    def __init__(self, host: Requester, view: LiveView, timeout_s: float) -> None:
        self.host = host
        self.view = view
        self.timeout_s = timeout_s
        self.stops_reused = 0
        # node -> (its session and the stop, the reply's task)
        self._stops: dict[str, tuple[tuple[object, ...], asyncio.Task[Reply]]] = {}

    async def broadcast(
        self,
        nodes: tuple[str, ...],
        msg: Message,
        *,
        wait: bool = True,
        acks: dict[str, dpb.CommandAck] | None = None,
    ) -> dict[str, str]:
        """Send `msg` (or `msg(node)`: each node its own) to every node with a session;
        return node -> error for failures. `acks`: filled with each node's ack (with
        `wait`). A StopWorkers goes once per session (see the module)."""

        def build(n: str) -> dpb.DriverMessage:
            if callable(msg):
                return msg(n)
            m = dpb.DriverMessage()
            m.CopyFrom(msg)
            return m

        async def one(n: str) -> str:
            m = build(n)
            if not wait:
                try:
                    self.host.send(n, m)
                    return ""
                except KeyError as e:
                    return f"KeyError: {e}"
            if m.WhichOneof("kind") == "stop_workers":
                error, ack = await asyncio.shield(self._stop(n, m))
            else:
                error, ack = await self._ask(n, m)
            if acks is not None and ack is not None:
                acks[n] = ack
            return error

        errors = dict(zip(nodes, await asyncio.gather(*(one(n) for n in nodes)), strict=True))
        bad = {n: e for n, e in errors.items() if e}
        if bad:
            first = dict(itertools.islice(bad.items(), LOGGED_ERRORS))
            log.warning(
                "command not done everywhere",
                kind=build(nodes[0]).WhichOneof("kind"),
                failed=len(bad),
                of=len(nodes),
                errors=first,
            )
        return bad

    def forget(self, node: str) -> None:
        """`node`'s workers were started or resumed: its next stop is sent again."""
        self._stops.pop(node, None)

    def close(self) -> None:
        for _, task in self._stops.values():
            task.cancel()
        self._stops.clear()

    def _stop(self, n: str, m: dpb.DriverMessage) -> asyncio.Task[Reply]:
        """The task of `n`'s reply to stop `m`: the one in flight or acknowledged for the
        same session and command, else a new one."""
        slot = self.view.nodes.get(n)
        key = (slot.epoch, slot.outbox, m.SerializeToString(deterministic=True)) if slot else ()
        held = self._stops.get(n)
        if held is not None and key and held[0] == key:
            task = held[1]
            if not task.done() or (not task.cancelled() and not task.result()[0]):
                self.stops_reused += 1
                return task
        task = asyncio.ensure_future(self._ask(n, m))
        self._stops[n] = (key, task)
        return task

    async def _ask(self, n: str, m: dpb.DriverMessage) -> Reply:
        try:
            r = await self.host.request(n, m, self.timeout_s)
        except (KeyError, TimeoutError) as e:
            return f"{type(e).__name__}: {e}", None
        return ("" if r.ack.ok else r.ack.detail or "refused"), r.ack
