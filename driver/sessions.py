"""The agents' command streams: bounded outboxes, requests and their replies.

Each agent's `Session` stream has one bounded outbox (`stream_buffer` commands for each node
it carries: the agent, and a relay's members too); a command that does not fit means the
agent does not read its stream, so the stream is ended (RESOURCE_EXHAUSTED; the agent
reconnects) instead of letting the driver's memory grow.
`request` sends a command and waits, under a deadline, for the agent's reply carrying the
same command id. The `Session` handler (driver/service.py) owns the stream itself and asks
`Sessions` how and when to end it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import uuid
from collections.abc import Callable

import grpc
import structlog

from unbroken.driver.liveview import LiveView
from unbroken.proto import driver_pb2 as dpb

log = structlog.get_logger(__name__)

Trailer = tuple[tuple[str, str], ...]
DOWN_BATCH_MAX = 256  # members' commands in one RelayedDownBatch
DOWN_BATCH_BYTES = 1 << 20  # ...and about this many bytes (gRPC's limit is 4 MiB)
EXPIRY_TICK_S = 0.05  # a reply's deadline is rounded up to this tick (one timer per tick)


class Ending:
    """How a session should end when the driver ends it (set from any task)."""

    __slots__ = ("event", "status", "writing")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.writing = False
        self.status: tuple[grpc.StatusCode, str, Trailer] | None = None


class Outbox(asyncio.Queue[dpb.DriverMessage]):
    """A stream's outbox: `per_node` commands for each node whose commands it carries.

    A relay's stream carries its members' commands too, and a command to the whole world
    (StopWorkers, StartWorkers) puts one per node into it before the stream's writer runs:
    with one node's bound a group of 64 overflowed at every incident, and every member's
    stream and the relay's own were dropped (a 10,240-node bench: 10,556 streams dropped,
    and each lost node opened the next incident)."""

    def __init__(self, per_node: int) -> None:
        super().__init__()
        self.per_node = per_node
        self.nodes = 1

    def full(self) -> bool:
        return self.qsize() >= self.per_node * self.nodes


class RelayOutbox:
    """A relayed node's outbox: its commands go down its relay's Session, wrapped."""

    __slots__ = ("node_id", "queue", "relay")

    def __init__(self, relay: str, queue: asyncio.Queue[dpb.DriverMessage], node_id: str) -> None:
        self.relay = relay
        self.queue = queue
        self.node_id = node_id

    def put_nowait(self, msg: dpb.DriverMessage) -> None:
        """Queue `msg` for the relay (QueueFull when the relay's buffer is full)."""
        self.queue.put_nowait(
            dpb.DriverMessage(relayed=dpb.RelayedDown(node_id=self.node_id, command=msg))
        )


class Sessions:
    """Open sessions by node, their outboxes (in the live view's slots) and pending replies."""

    def __init__(
        self,
        view: LiveView,
        driver_id: str,
        term: Callable[[], int] = lambda: 0,
        scope: Callable[[], str] = lambda: "",
    ) -> None:
        self.view = view
        self.driver_id = driver_id
        self.dropped_commands = 0
        self._open: dict[str, Ending] = {}
        # command id -> (the node asked, the future of its reply)
        self._replies: dict[str, tuple[str, asyncio.Future[dpb.AgentMessage]]] = {}
        # the replies' deadlines by EXPIRY_TICK_S tick: one timer per tick, not per command
        self._expiry: dict[tuple[asyncio.AbstractEventLoop, int], list[tuple[str, float]]] = {}
        self._ids = itertools.count(1)
        self._nonce = uuid.uuid4().hex[:12]  # this driver's incarnation, in its command ids
        self._term = term  # the leader term stamped on every command
        self._scope = scope  # ...and what it counts in (the etcd cluster, the incarnation)

    def opened(self, node_id: str) -> Ending:
        """A new session of `node_id` began; returns how the driver may end it. The node's
        older session, if one is still open, is ended (ABORTED): one principal, one stream,
        so a node's credential cannot hold streams (and their reader tasks) without bound,
        and commands go only to the newest."""
        self.end(
            node_id,
            grpc.StatusCode.ABORTED,
            f"replaced by a newer session of node {node_id}: a node holds one session",
        )
        ending = self._open[node_id] = Ending()
        return ending

    def closed(self, node_id: str, ending: Ending) -> None:
        """The session that `opened` returned `ending` for is over."""
        if self._open.get(node_id) is ending:
            del self._open[node_id]

    def end(
        self, node_id: str, code: grpc.StatusCode, details: str, trailing: Trailer = ()
    ) -> None:
        """Ask `node_id`'s session handler to end its stream with this status."""
        ending = self._open.pop(node_id, None)
        if ending is not None:
            ending.status = (code, details, trailing)
            ending.event.set()

    def end_all(self, code: grpc.StatusCode, details: str, trailing: Trailer = ()) -> None:
        for node_id in list(self._open):
            self.end(node_id, code, details, trailing)

    def send(self, node_id: str, msg: dpb.DriverMessage) -> str:
        """Queue a command for `node_id`'s agent; return its command id.

        Raises:
            KeyError: the node has no open session.
        A stream whose buffer is full is a consumer that cannot keep up: it is dropped
        (the agent reconnects; a member's full buffer is its relay's stream, which is
        dropped with all its members), and the command is lost with it.
        """
        slot = self.view.nodes.get(node_id)
        if slot is None or slot.outbox is None:
            raise KeyError(f"node {node_id!r} has no open session")
        if not msg.command_id:  # (a uuid each was 0.3 s of a 10,240-node start)
            msg.command_id = f"{self.driver_id}-{self._nonce}-{next(self._ids)}"
        msg.term = self._term()
        msg.term_scope = self._scope()
        outbox = slot.outbox
        assert isinstance(outbox, asyncio.Queue | RelayOutbox)
        try:
            outbox.put_nowait(msg)
        except asyncio.QueueFull:
            self.dropped_commands += 1
            # the stream that does not drain is the relay's when the node is a member
            stream = outbox.relay if isinstance(outbox, RelayOutbox) else node_id
            log.error("command buffer full; dropping the stream", node=node_id, stream=stream)
            slot.outbox = None
            self.end(
                stream,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the driver's command buffer for {stream} is full (the agent "
                "does not read its stream); reconnect",
            )
        return msg.command_id

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage:
        """Send a command and wait (at most `timeout_s`) for its ack or check result."""
        fut = self.ask(node_id, msg, timeout_s)
        try:
            return await fut
        finally:
            fut.cancel()  # (done already, unless this wait was cancelled)

    def ask(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> asyncio.Future[dpb.AgentMessage]:
        """Send a command; the future of its reply, failed with TimeoutError after
        `timeout_s` (up to EXPIRY_TICK_S later; KeyError at once: no session). No task,
        waiter or timer of its own: a broadcast to 10,240 nodes asks each this way."""
        cid = self.send(node_id, msg)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dpb.AgentMessage] = loop.create_future()
        self._replies[cid] = (node_id, fut)
        key = (loop, math.ceil((loop.time() + timeout_s) / EXPIRY_TICK_S))
        due = self._expiry.get(key)
        if due is None:
            due = self._expiry[key] = []
            loop.call_at(key[1] * EXPIRY_TICK_S, self._expire, key)
        due.append((cid, timeout_s))
        return fut

    def _expire(self, key: tuple[asyncio.AbstractEventLoop, int]) -> None:
        """The replies due at this tick that did not come: each future fails."""
        for cid, timeout_s in self._expiry.pop(key, ()):
            entry = self._replies.pop(cid, None)
            if entry is not None and not entry[1].done():
                entry[1].set_exception(TimeoutError(f"no reply from {entry[0]} in {timeout_s:g} s"))

    def reply(self, command_id: str, msg: dpb.AgentMessage, node_id: str) -> bool:
        """Hand `node_id`'s reply to the request waiting for it; False when none waits
        for that node's (a command id is a counter: a relay that guesses another node's
        cannot answer for it)."""
        entry = self._replies.get(command_id)
        if entry is None or entry[0] != node_id:
            return False
        del self._replies[command_id]
        if entry[1].done():
            return False
        entry[1].set_result(msg)
        return True

    @staticmethod
    async def pump(
        outbox: asyncio.Queue[dpb.DriverMessage],
        context: grpc.aio.ServicerContext,
        ending: Ending,
        *,
        batch: bool = False,
    ) -> None:
        """Write the outbox to the stream until the session ends. `batch` (a relay that
        takes `RelayedDownBatch`): the members' commands queued one after another go as
        one message (a command to a 10,240-node world: 160 writes, not 10,240)."""
        held: dpb.DriverMessage | None = None  # taken from the outbox, not a member's
        while not ending.event.is_set():
            msg, held = (held, None) if held is not None else (await outbox.get(), None)
            if ending.event.is_set():
                return
            if batch and not outbox.empty() and msg.WhichOneof("kind") == "relayed":
                msg, held = _batched(msg, outbox)
            ending.writing = True
            try:
                await context.write(msg)
            finally:
                ending.writing = False


def _batched(
    first: dpb.DriverMessage, outbox: asyncio.Queue[dpb.DriverMessage]
) -> tuple[dpb.DriverMessage, dpb.DriverMessage | None]:
    """`first` (a member's command) and the members' commands queued right behind it, as
    one `RelayedDownBatch` of at most `DOWN_BATCH_BYTES`; and the message taken after
    them that is not a member's (None: none), which goes next, in order."""
    out = dpb.DriverMessage()
    downs = out.relayed_batch.down
    downs.append(first.relayed)
    size = first.relayed.ByteSize()
    while not outbox.empty() and len(downs) < DOWN_BATCH_MAX:
        nxt = outbox.get_nowait()
        if nxt.WhichOneof("kind") != "relayed":
            return out, nxt
        size += nxt.relayed.ByteSize()
        downs.append(nxt.relayed)
        if size >= DOWN_BATCH_BYTES:
            break
    return out, None
