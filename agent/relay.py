"""An agent acting as the relay of a group of nodes: the control plane at 10k nodes.

See docs/relays.md.

Python gRPC costs the driver ~55-100 us per message while its heartbeat work is ~1 us, so
past ~1,000 nodes the driver cannot take one message per node per interval. An agent
started with `--relay-listen HOST:PORT` serves the `Driver.Session` stream to its group's
members (each started with `--relay ID@HOST:PORT`) and forwards one `RelayBatch` per
heartbeat interval up its own Session to the driver, with the relay's own heartbeat in it
(one message per interval carries the whole group):

- `beats`: the members whose heartbeat changed (step, worker state, flags, alerts, loss
  peaks), and every `full_every` batches every member's latest heartbeat (host stats);
- `alive`: the ids of members that beat on time with nothing new, each named once: the
  periodic batch says `group_alive` (every member named before and not named late or
  silent since beat on time), so the driver's work per batch is O(1) plus the entries;
- `late`: a member named before without a heartbeat this interval (the driver tracks it
  alone until it is named again);
- `silent`: members silent for the relay's timeout (detected here, where the heartbeats
  arrive): the driver declares them lost at once. A member whose stream its side closed (a
  killed agent's closes at once) is silent after the driver's closed timeout
  (`RegisterResponse.closed_timeout_ms`, 200 ms) unless it comes back first, as the driver
  treats its own direct streams.
A batch goes at once (not at the next interval) when a member's heartbeat carries flags or
a member went silent. Members' other messages (acks, check results, shard and self-check
reports) go up as `RelayedUp` as they arrive; commands come down as `RelayedDown`. With a
driver that takes them (`RegisterResponse.relay_batches`) the messages that arrive within
`UP_WINDOW_S` of each other go up as one `RelayedUpBatch`, and the driver sends the
members' commands queued together as one `RelayedDownBatch` (this relay registers with
`relay_batches`): a command to every node is one message per relay each way, not one per
member (the driver's reading of 10,240 acks, one gRPC message each, was most of an
incident's fan-out at 10,240 nodes).

Authority: a member registers with the driver itself, under its own credentials, naming its
relay (call metadata x-unbroken-relay); the driver accepts a batch entry only for a member
that named this relay, at its registered epoch. Here, a member must prove its node id: its
client certificate's `node:<id>` SAN (mTLS) or the node token this relay holds itself.

When the relay loses its driver session it ends every member's stream (UNAVAILABLE), and a
member whose relay is gone, refuses, or sends nothing (not even its empty tick every
`TICK_S`) for `SILENT_S` goes to the driver directly at once (agent/link.py);
the driver holds back a group's silence that coincides with its relay's loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from unbroken.common import aio, channel
from unbroken.common.serving import MalformedRequests
from unbroken.common.tls import TlsConfig, server_credentials, token_metadata
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

log = structlog.get_logger(__name__)

Send = Callable[[dpb.AgentMessage], Awaitable[None]]
MEMBER_BUFFER = 64  # commands queued per member before its stream is dropped
# an empty DriverMessage goes down every member's stream when no command did for this long:
# a member that hears nothing for SILENT_S takes its relay for stopped or cut off and goes
# to the driver directly (a SIGSTOPped or partitioned relay breaks no connection)
TICK_S = 0.25
SILENT_S = 1.0
UP_WINDOW_S = 0.002  # members' messages gathered into one RelayedUpBatch for this long
SILENCE_SLACK_S = 0.001  # a member is looked at this long after its timeout passes
UP_BATCH_MAX = 256  # ...at most this many
UP_BUFFER = 4096  # members' messages waiting to go up (a member's reader waits beyond it)


@dataclass(kw_only=True, slots=True)
class RelayConfig:
    """A relay's listening address and pace."""

    listen: str  # host:port members connect to (port 0: a free one)
    full_every: int = 10  # every member's full heartbeat once per this many batches
    max_members: int = 1024
    tls: TlsConfig = field(default_factory=TlsConfig)
    token: str | None = None  # members must present this bearer token (without mTLS)

    def __post_init__(self) -> None:
        if ":" not in self.listen:
            raise ValueError(f"relay listen address {self.listen!r} must be host:port")
        if not 1 <= self.full_every <= 1000:
            raise ValueError(f"full_every must be in [1, 1000], got {self.full_every}")
        if not 1 <= self.max_members <= 100_000:
            raise ValueError(f"max_members must be in [1, 100000], got {self.max_members}")


def parse_relay(text: str) -> tuple[str, str]:
    """`ID@HOST:PORT` -> (relay node id, endpoint); ValueError saying what to pass."""
    rid, at, endpoint = text.partition("@")
    if not at or not rid or ":" not in endpoint:
        raise ValueError(
            f"--relay {text!r}: pass the relay agent's node id and address as ID@HOST:PORT"
        )
    return rid, endpoint


class Member:
    """One member's stream at this relay."""

    __slots__ = (
        "closed",
        "end",
        "ending",
        "epoch",
        "fresh",
        "hb",
        "last_seen",
        "node_id",
        "outbox",
        "sent_sig",
        "sig",
        "vouched",
    )

    def __init__(self, node_id: str, epoch: int) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.hb: dpb.Heartbeat | None = None  # newest, not forwarded yet (None: forwarded)
        self.vouched = False  # named to the driver, not named late since: in the group
        self.fresh = False  # beat since the last periodic batch
        self.last_seen = time.monotonic()
        self.sig: tuple[Any, ...] = ()
        self.sent_sig: tuple[Any, ...] = ()
        self.outbox: asyncio.Queue[dpb.DriverMessage] = asyncio.Queue(MEMBER_BUFFER)
        self.ending = asyncio.Event()
        self.end = ""  # the driver sent this member away: the reason (it registers again)
        self.closed = False  # its side ended its stream: the closed timeout applies


def signature(hb: dpb.Heartbeat) -> tuple[Any, ...]:
    """What makes a heartbeat news for the driver (a step, a state, a restart)."""
    return (
        tuple((w.step, w.state, w.restarts) for w in hb.workers),
        tuple((w.pid, w.step) for w in hb.attached),
    )


class Relay(dgrpc.DriverServicer):
    """The relay's `Driver.Session` server for members, and its batcher."""

    def __init__(self, config: RelayConfig, node_id: str, interval_s: float) -> None:
        self.config = config
        self.node_id = node_id
        self.interval_s = interval_s
        self.miss_limit = 3
        self.closed_timeout_s = 0.0  # the driver's (RegisterResponse); 0: the timeout
        self.members: dict[str, Member] = {}
        self.upstream: Send | None = None
        self.batch_up = False  # the driver takes RelayedUpBatch (RegisterResponse)
        self.ups: asyncio.Queue[dpb.RelayedUp] = asyncio.Queue(UP_BUFFER)
        self.flush = asyncio.Event()
        self.batches = 0
        self.forwarded = 0  # member heartbeats that went up
        self.server: grpc.aio.Server | None = None
        self.port = 0

    # ------------------------------------------------------------ server
    async def start(self) -> int:
        """Listen for members; returns the bound port."""
        c = self.config
        server = grpc.aio.server(interceptors=[MalformedRequests()], options=channel.SERVER_OPTIONS)
        dgrpc.add_DriverServicer_to_server(self, server)
        if c.tls.enabled:
            port = server.add_secure_port(c.listen, server_credentials(c.tls))
        else:
            port = server.add_insecure_port(c.listen)
        if port == 0:
            raise ValueError(f"could not bind the relay's port {c.listen!r}")
        await server.start()
        self.server, self.port = server, port
        log.info("relay listening", port=port)
        return port

    async def close(self) -> None:
        self.drop_members("the relay is stopping")
        if self.server is not None:
            await self.server.stop(0.5)

    def _authentic(self, context: grpc.aio.ServicerContext, node_id: str) -> str:
        """Why the caller may not be member `node_id` ("" when it may)."""
        c = self.config
        if c.tls.enabled:
            auth = context.auth_context() or {}
            names = [
                v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                for v in (*auth.get("x509_uri", ()), *auth.get("x509_subject_alternative_name", ()))
            ]
            if f"node:{node_id}" not in names:
                return f"the client certificate does not name node:{node_id}"
            return ""
        if c.token:
            got = ""
            for k, v in context.invocation_metadata() or ():
                if k == "authorization":
                    got = str(v)
            expected = dict(token_metadata(c.token))["authorization"]
            if not hmac.compare_digest(got.encode(), expected.encode()):
                return "missing or wrong node token"
        return ""

    async def Register(
        self, request: dpb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dpb.RegisterResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a relay takes only Session: register with the driver, naming this relay",
        )
        raise AssertionError  # abort raised

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        node_id, epoch = "", 0
        for k, v in context.invocation_metadata() or ():
            if k == channel.NODE_KEY:
                node_id = str(v)[:128]
            elif k == channel.EPOCH_KEY:
                epoch = int(v) if str(v).isdigit() else 0
        problem = self._authentic(context, node_id) if node_id and epoch else "no node id/epoch"
        if problem:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"relay: {problem}")
        if self.upstream is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"relay {self.node_id} has no driver session now; go to the driver directly",
            )
        old = self.members.get(node_id)
        if old is None and len(self.members) >= self.config.max_members:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"relay {self.node_id} is full ({self.config.max_members} members)",
            )
        if old is not None:
            old.ending.set()
        me = self.members[node_id] = Member(node_id, epoch)
        pump = asyncio.create_task(self._pump(me, context))
        reader = asyncio.create_task(self._read(me, context))
        stop = asyncio.create_task(me.ending.wait())
        try:
            await asyncio.wait({pump, reader, stop}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and not reader.cancelled():
                reader.result()
            elif me.ending.is_set() and me.end:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, me.end)
            elif me.ending.is_set():
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"relay {self.node_id} dropped this member; go to the driver directly",
                )
        finally:
            for t in (pump, reader, stop):
                t.cancel()
            # a stream that broke stays a member until it comes back or the batcher finds
            # it silent (and tells the driver), after the closed timeout when its side
            # ended it (a dead agent's stream ends at once); one the relay ended leaves now
            if self.members.get(node_id) is me:
                if me.ending.is_set():
                    del self.members[node_id]
                else:
                    me.closed = True

    async def _pump(self, me: Member, context: grpc.aio.ServicerContext) -> None:
        while True:
            try:
                msg = await aio.wait_for(me.outbox.get(), TICK_S)
            except TimeoutError:
                msg = dpb.DriverMessage()  # no command: "this relay is alive"
            await context.write(msg)

    async def _read(self, me: Member, context: grpc.aio.ServicerContext) -> None:
        eof = grpc.aio.EOF
        while True:
            msg = await context.read()
            if msg is eof:
                return
            if msg.WhichOneof("kind") == "heartbeat":
                hb = msg.heartbeat
                me.hb = hb
                me.last_seen = time.monotonic()
                me.fresh = True
                me.sig = signature(hb)
                if hb.flags or hb.alerts:
                    self.flush.set()
                continue
            if self.upstream is None:
                log.warning("member message dropped: no driver session", member=me.node_id)
                continue
            if msg.WhichOneof("kind") == "ack" and msg.ack.ring_fresh:
                me.sent_sig = ()  # its rescanned rings go in full, whichever batch takes them
            await self.ups.put(dpb.RelayedUp(node_id=me.node_id, epoch=me.epoch, message=msg))

    # ------------------------------------------------------------ commands down
    def deliver(self, down: dpb.RelayedDown) -> None:
        """A command from the driver for one member (dropped when it is not here)."""
        me = self.members.get(down.node_id)
        if me is None:
            log.warning("command for a member not connected here", member=down.node_id)
            return
        if down.end:
            me.end = down.end
            me.ending.set()
            return
        try:
            me.outbox.put_nowait(down.command)
        except asyncio.QueueFull:
            log.error("member does not read its stream; dropping it", member=down.node_id)
            me.ending.set()

    def drop_members(self, why: str) -> None:
        """End every member's stream (they go to the driver directly)."""
        if self.members:
            log.warning("relay dropping its members", members=len(self.members), why=why)
        for me in list(self.members.values()):
            me.ending.set()

    # ------------------------------------------------------------ batches up
    def timeouts(self) -> tuple[float, float]:
        """Silence after which a member is reported: (stream open, stream its side closed)."""
        timeout = self.interval_s * self.miss_limit  # (a registration may change them)
        closed = min(timeout, self.closed_timeout_s) if self.closed_timeout_s > 0 else timeout
        return timeout, closed

    def batch(self, now: float, own: dpb.Heartbeat | None = None) -> dpb.RelayBatch:
        """The next batch: the periodic one carries the relay's `own` heartbeat (and every
        `full_every`-th every member's full heartbeat); members silent past the timeout
        leave the group."""
        full = False
        if own is not None:
            self.batches += 1
            full = self.batches % self.config.full_every == 0
        timeout, closed = self.timeouts()
        out = dpb.RelayBatch()
        periodic = own is not None
        quiet = 0
        if own is not None:
            out.own.CopyFrom(own)
            out.group_alive = True
        for me in list(self.members.values()):
            silent = now - me.last_seen
            if silent > (closed if me.closed else timeout):
                out.silent.add(node_id=me.node_id, epoch=me.epoch, silent_ms=silent * 1000.0)
                del self.members[me.node_id]
                me.ending.set()
                continue
            hb = me.hb
            if hb is None:
                # nothing since the last batch: its silence grows; the periodic batch
                # stops vouching for it when it sent nothing this interval either
                if periodic and me.vouched and not me.fresh:
                    out.late.add(node_id=me.node_id, epoch=me.epoch, silent_ms=silent * 1000.0)
                    me.vouched = False
                me.fresh = me.fresh and not periodic
                continue
            if full or hb.flags or hb.alerts or me.sig != me.sent_sig or _peaks(hb):
                out.beats.add(node_id=me.node_id, epoch=me.epoch).heartbeat.CopyFrom(hb)
                me.sent_sig = me.sig
            elif not me.vouched:
                out.alive.append(me.node_id)
            else:
                quiet += 1  # on time, nothing new, vouched for: not named
            me.vouched = True
            me.hb = None
            if periodic:
                me.fresh = False
        self.forwarded += len(out.beats) + len(out.alive) + quiet
        return out

    async def forward(self, send: Send) -> None:
        """While the driver session is open: between the periodic batches (the agent's
        heartbeat loop sends them, with its own heartbeat), send one at once when a member's
        heartbeat carries flags or a member went silent."""
        self.upstream = send
        ups = asyncio.create_task(self._send_ups(send))
        try:
            tick = self.interval_s / 5  # silence is looked for 5x per interval at least...
            wait = tick
            while True:
                with contextlib.suppress(TimeoutError):
                    await aio.wait_for(self.flush.wait(), wait)
                now = time.monotonic()
                timeout, closed = self.timeouts()
                # ...and at the moment the first member's timeout passes, not up to a tick
                # later (bench-scale's detection p99 was the timeout plus ~80 ms)
                members = self.members.values()
                due = min(
                    (m.last_seen + (closed if m.closed else timeout) for m in members),
                    default=math.inf,
                )
                wait = min(tick, max(SILENCE_SLACK_S, due - now + SILENCE_SLACK_S))
                if not self.flush.is_set() and now <= due:
                    continue
                self.flush.clear()
                b = self.batch(now)
                if b.beats or b.alive or b.silent:
                    await send(dpb.AgentMessage(relay_batch=b))
        finally:
            self.upstream = None
            ups.cancel()
            while not self.ups.empty():  # the old session's: no reply goes to a new one
                self.ups.get_nowait()
            self.drop_members("the relay lost its driver session")

    async def _send_ups(self, send: Send) -> None:
        """Members' messages up, in the order they came: with `batch_up`, those that came
        within `UP_WINDOW_S` of the first as one `RelayedUpBatch`; each behind the fresh
        heartbeats its acks speak for (`_fresh_beats`)."""
        while True:
            first = await self.ups.get()
            if not self.batch_up:
                if beats := self._fresh_beats((first,)):
                    await send(beats)
                await send(dpb.AgentMessage(relayed=first))
                continue
            await asyncio.sleep(UP_WINDOW_S)  # the other members' replies to the same command
            out = dpb.AgentMessage()
            batch = out.relayed_batch.up
            batch.append(first)
            while not self.ups.empty() and len(batch) < UP_BATCH_MAX:
                batch.append(self.ups.get_nowait())
            if beats := self._fresh_beats(batch):
                await send(beats)
            await send(out if len(batch) > 1 else dpb.AgentMessage(relayed=first))

    def _fresh_beats(self, ups: Iterable[dpb.RelayedUp]) -> dpb.AgentMessage | None:
        """One batch of the pending heartbeats of the members whose acks in `ups` say
        `ring_fresh` (None: none), to go up ahead of those acks.

        A member acks a stop with `ring_fresh` right after a heartbeat carrying its rings
        rescanned (agent/daemon.py `ring_heartbeat`), and the driver then reads the steps
        each rank holds from that heartbeat without waiting for more. Left to the periodic
        batch it came after the ack, or never in full: a new copy in a ring changes no
        step, so the signature is the same and the member was only counted alive; the
        driver chose the restore step from the rings as they were a heartbeat earlier.
        One batch for all of a window's acks: a world-wide stop is 64 acks a relay."""
        out: dpb.RelayBatch | None = None
        for up in ups:
            if not (up.message.WhichOneof("kind") == "ack" and up.message.ack.ring_fresh):
                continue
            me = self.members.get(up.node_id)
            if me is None or me.hb is None or me.epoch != up.epoch:
                continue
            out = out or dpb.RelayBatch()
            out.beats.add(node_id=me.node_id, epoch=me.epoch).heartbeat.CopyFrom(me.hb)
            me.sent_sig, me.hb, me.vouched = me.sig, None, True
            self.forwarded += 1
        return dpb.AgentMessage(relay_batch=out) if out is not None else None


def _peaks(hb: dpb.Heartbeat) -> bool:
    return any(w.has_peak for w in hb.workers)
