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
from collections.abc import Callable, Mapping
from typing import Protocol

import structlog

from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb

log = structlog.get_logger(__name__)

LOGGED_ERRORS = 16  # a broadcast's failures named in its one log line (the count is whole)

Message = dpb.DriverMessage | Callable[[str], dpb.DriverMessage]
YIELD_EVERY = 256  # commands queued between two turns of the event loop


class Requester(Protocol):
    def send(self, node_id: str, msg: dpb.DriverMessage) -> str: ...

    def ask(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> asyncio.Future[dpb.AgentMessage]: ...


def _few(errors: dict[str, str]) -> dict[str, str]:
    return dict(itertools.islice(errors.items(), LOGGED_ERRORS))


async def _settle(
    replies: dict[str, asyncio.Future[dpb.AgentMessage]],
    bad: dict[str, str],
    acks: dict[str, dpb.CommandAck] | None = None,
) -> None:
    """Wait for every reply; each failure (no reply, a refusal) goes to `bad` by node, and
    each ack to `acks`."""
    if replies:
        await asyncio.wait(replies.values())
    for n, fut in replies.items():
        if fut.cancelled():
            bad[n] = "CancelledError"
        elif (failed := fut.exception()) is not None:
            bad[n] = f"{type(failed).__name__}: {failed}"
        else:
            ack = fut.result().ack
            if acks is not None:
                acks[n] = ack
            if not ack.ok:
                bad[n] = ack.detail or "refused"


def _seen(fut: asyncio.Future[dpb.AgentMessage]) -> None:
    if not fut.cancelled():
        fut.exception()  # a reply nobody awaits any more: its timeout is no error to log


class Fanout:
    """Broadcasts for one recovery loop; `stops_reused` counts the stops not sent again."""

    def __init__(self, host: Requester, view: LiveView, timeout_s: float) -> None:
        self.host = host
        self.view = view
        self.timeout_s = timeout_s
        self.stops_reused = 0
        # node -> (its session and the stop, the reply's future)
        self._stops: dict[str, tuple[tuple[object, ...], asyncio.Future[dpb.AgentMessage]]] = {}

    async def broadcast(
        self,
        nodes: tuple[str, ...],
        msg: Message,
        *,
        wait: bool = True,
        acks: dict[str, dpb.CommandAck] | None = None,
        current: Callable[[], bool] | None = None,
    ) -> dict[str, str]:
        """Send `msg` (or `msg(node)`: each node its own) to every node with a session;
        return node -> error for failures. `acks`: filled with each node's ack (with
        `wait`). A StopWorkers goes once per session (see the module).

        Every node's command is queued and its reply's future kept (each fails on its own
        at the deadline): no task and no waiter per node, and the event loop gets a turn
        every `YIELD_EVERY` nodes, so heartbeats are read while 10,240 commands go out.
        `current`: asked at each turn; once False (a newer decision took over, with its
        own broadcast) no more commands are queued, and those queued are waited for."""

        def build(n: str) -> dpb.DriverMessage:
            if callable(msg):
                return msg(n)
            m = dpb.DriverMessage()
            m.CopyFrom(msg)
            return m

        bad: dict[str, str] = {}
        replies: dict[str, asyncio.Future[dpb.AgentMessage]] = {}
        kind = "" if callable(msg) else str(msg.WhichOneof("kind"))
        # one command for all: its stop key serialized once, not once per node
        same = None if callable(msg) else msg.SerializeToString(deterministic=True)
        with self.view.fanning_out(len(nodes)):  # (the node watch: our backlog)
            for i, n in enumerate(nodes):
                if i and i % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                    if current is not None and not current():
                        break
                if wait and same is not None and kind == "stop_workers":
                    _, held = self._held(n, same)
                    if held is not None:  # (built and sent only when not: most, in a storm)
                        replies[n] = held
                        continue
                m = build(n)
                kind = kind or str(m.WhichOneof("kind"))
                try:
                    if not wait:
                        self.host.send(n, m)
                    elif kind == "stop_workers":
                        replies[n] = self._stop(n, m)
                    else:
                        replies[n] = self._ask(n, m)
                except KeyError as e:
                    bad[n] = f"KeyError: {e}"
            await _settle(replies, bad, acks)
        if bad:
            log.warning(
                "command not done everywhere",
                kind=kind,
                failed=len(bad),
                of=len(nodes),
                errors=_few(bad),
            )
        return {n: bad[n] for n in nodes if n in bad}

    async def start(
        self,
        nodes: tuple[str, ...],
        messages: Mapping[str, dpb.DriverMessage],
        point: dpb.RestorePoint | None,
        current: Callable[[], bool],
    ) -> tuple[dict[str, str], list[str]]:
        """Send each node its RestorePoint (when `point`) and its StartWorkers one after
        the other, without waiting between them, and wait for the starts' replies; return
        (node -> error, the nodes sent to). The agent takes its commands in the order they
        come on its stream (agent/daemon.py), so the point is set before the start reads
        it. Nobody waits for the point's reply: a refusal is logged as a failed command
        (driver/agentapi.py) and the start goes on (an agent without one restores the
        newest step). At 10,240 nodes a task per node waiting for the point's reply before
        sending the start cost a round trip through the relays and 10,240 tasks.
        `current`: asked before each node; once False (a newer decision) no more go."""
        bad: dict[str, str] = {}
        replies: dict[str, asyncio.Future[dpb.AgentMessage]] = {}
        sent: list[str] = []
        with self.view.fanning_out(len(nodes)):  # (the node watch: our backlog)
            for i, n in enumerate(nodes):
                if i and i % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                if not current():
                    break
                try:
                    if point is not None:  # its reply awaited by nobody: a refusal is logged
                        self.host.send(n, dpb.DriverMessage(restore_point=point))
                    self.forget(n)  # its workers start: a later stop goes again
                    replies[n] = self._ask(n, messages[n])
                except KeyError as e:
                    bad[n] = f"KeyError: {e}"
                sent.append(n)
            await _settle(replies, bad)
        return bad, sent

    def forget(self, node: str) -> None:
        """`node`'s workers were started or resumed: its next stop is sent again."""
        self._stops.pop(node, None)

    def close(self) -> None:
        for _, fut in self._stops.values():
            fut.cancel()
        self._stops.clear()

    def _held(
        self, n: str, wire: bytes
    ) -> tuple[tuple[object, ...], asyncio.Future[dpb.AgentMessage] | None]:
        """`n`'s stop key for the stop serialized as `wire` (its session and the command),
        and the reply's future of that stop when it is in flight or was acknowledged."""
        slot = self.view.nodes.get(n)
        key = (slot.epoch, slot.outbox, wire) if slot else ()
        held = self._stops.get(n)
        if held is not None and key and held[0] == key:
            fut = held[1]
            if not fut.done() or (
                not fut.cancelled() and fut.exception() is None and fut.result().ack.ok
            ):
                self.stops_reused += 1
                return key, fut
        return key, None

    def _stop(self, n: str, m: dpb.DriverMessage) -> asyncio.Future[dpb.AgentMessage]:
        """The future of `n`'s reply to stop `m`: the one in flight or acknowledged for
        the same session and command, else a new one (KeyError: no session)."""
        key, fut = self._held(n, m.SerializeToString(deterministic=True))
        if fut is None:
            fut = self._ask(n, m)
            self._stops[n] = (key, fut)
        return fut

    def _ask(self, n: str, m: dpb.DriverMessage) -> asyncio.Future[dpb.AgentMessage]:
        fut = self.host.ask(n, m, self.timeout_s)
        fut.add_done_callback(_seen)
        return fut
