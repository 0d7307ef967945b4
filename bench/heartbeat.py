"""Heartbeat-plane benchmark: how many 100 ms nodes one driver process carries.

Simulated agents are real gRPC clients in separate processes, one TCP connection per
simulated node (a local subchannel pool per channel), each sending a heartbeat with 8
workers' status every 100 ms on its own random phase (host stats once a second). The
driver runs in its own process with the real `DriverService` (in-memory event log: this
measures the heartbeat plane, not etcd). Figures, all from the same run:

- per load (500 / 1,000 / 2,000 nodes): heartbeats/s handled, delivery p50/p99 (agent
  send -> handled, same host monotonic clock), the handler's own time p50/p99, false
  NodeLost events, driver CPU;
- max_nodes_sustained_100ms: the largest load with no false NodeLost, delivery p99
  under 20 ms and >= 95 % of the expected heartbeats;
- detect_p50_ms / detect_p99_ms: SIGKILL of a single-node simulator process -> the
  NodeLost event's wall time, over >= 20 kills under 500-node background load;
- handler_vs_transport_ratio: driver CPU per heartbeat with our handler divided by that
  with a do-nothing handler at the same load (1.0 = our handler costs nothing);
- agent_cpu_percent: a real `unbroken agent` with 2 hook-reporting workers, default
  interval, CPU of the agent process alone;
- auth_vs_open_ratio: driver CPU per heartbeat with role tokens and the authorization
  interceptor (every node presents a node token; Register and Session are checked) divided
  by that of the same driver with no credentials, alternating runs in the same process
  tree (median of the pairs). `--auth-only` runs just this comparison.

Usage: `python bench/heartbeat.py` (writes bench/results/heartbeat.json, prints a table).
`--quick` runs smaller loads for a smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from unbroken.cli.cluster import stop_groups
from unbroken.common import channel
from unbroken.common.tls import token_metadata
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "heartbeat.json"
RESULTS_AUTH = HERE / "results" / "heartbeat_auth.json"
NODE_TOKEN = "bench-node-token-0123456789"  # node X presents NODE_TOKEN-X, bound to X
VIEWER_TOKEN = "bench-viewer-token-0123456789"  # the bench's own LiveView reads


def auth_md(node_id: str) -> tuple[tuple[str, str], ...]:
    """Node `node_id`'s bearer token (bound to it: the driver refuses unbound node tokens)."""
    return token_metadata(f"{NODE_TOKEN}-{node_id}")


def bench_node_ids() -> list[str]:
    """Every node id a simulator of this bench may use (the prefixes below, up to 20k each)."""
    return [f"{p}{i}-{j}" for p in ("s", "bg") for i in range(40) for j in range(NODES_PER_SIM)] + [
        f"v{i}-0" for i in range(1000)
    ]


NODES_PER_SIM = 500
WORKERS_PER_NODE = 8


# ---------------------------------------------------------------- driver side
class NullService(dgrpc.DriverServicer):
    """The transport baseline: accepts everything and does nothing with it."""

    def __init__(self) -> None:
        self.count = 0

    async def Register(self, request: Any, context: Any) -> dpb.RegisterResponse:
        return dpb.RegisterResponse(heartbeat_interval_ms=100, miss_limit=3)

    async def Session(self, request_iterator: Any, context: Any) -> None:
        read = context.read
        eof = grpc.aio.EOF
        while True:
            msg = await read()
            if msg is eof:
                return
            self.count += 1

    async def LiveView(self, request: Any, context: Any) -> dpb.LiveViewResponse:
        return dpb.LiveViewResponse(stats=dpb.LiveStats(heartbeats=self.count))


async def serve(mode: str, port_file: str, events_file: str) -> None:
    from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
    from unbroken.driver.security import AuthInterceptor, RoleTokens
    from unbroken.driver.service import DriverService, ServiceConfig

    nodes = [f"{NODE_TOKEN}-{n} {n}" for n in bench_node_ids()] if mode == "auth" else []
    tokens = RoleTokens({"node": nodes, "viewer": [VIEWER_TOKEN]})
    interceptors = [AuthInterceptor(tokens, tls=False)] if mode == "auth" else []
    server = grpc.aio.server(interceptors=interceptors, options=channel.SERVER_OPTIONS)
    service: Any
    if mode == "null":
        service = NullService()
    else:
        store = InMemoryStore()
        cfg = ServiceConfig(tokens=tokens) if mode == "auth" else ServiceConfig()
        service = DriverService(cfg, driver_id="bench", job_id="bench")
        service.lead(InMemoryEventLog(store, "bench", store.elect("bench")), "")
        out = open(events_file, "a", buffering=1)

        def record(e: Any) -> None:
            kind = e.WhichOneof("payload")
            if kind == "node_lost":
                out.write(
                    json.dumps({"node": e.node_lost.node_id, "wall_ns": e.wall_time_unix_ns}) + "\n"
                )

        service.listeners.append(record)
        service.start()
    dgrpc.add_DriverServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # SIGUSR1 clears the latency samples (between warm-up and measuring)
    loop.add_signal_handler(signal.SIGUSR1, getattr(service, "reset_samples", lambda: None))
    await stop.wait()
    await server.stop(0.5)


# ---------------------------------------------------------------- simulated agents
def _workers() -> list[dpb.WorkerStatus]:
    return [
        dpb.WorkerStatus(
            local_rank=r,
            global_rank=r,
            pid=1000 + r,
            state=dpb.WORKER_STATE_RUNNING,
            step=1,
            loss=2.5,
            step_time_ms=900.0,
            since_progress_ms=100.0,
            median_step_ms=900.0,
            has_loss=True,
        )
        for r in range(WORKERS_PER_NODE)
    ]


async def sim_node(
    target: str, node_id: str, interval_s: float, stop: asyncio.Event, sent: list[int]
) -> None:
    ch = grpc.aio.insecure_channel(target, options=channel.CLIENT_OPTIONS)
    stub = dgrpc.DriverStub(ch)
    epoch = time.time_ns()
    for attempt in range(20):
        try:
            await stub.Register(
                dpb.RegisterRequest(node_id=node_id, epoch=epoch, hostname=node_id, num_workers=8),
                timeout=10,
                metadata=auth_md(node_id),
            )
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2 * (attempt + 1))
    call = stub.Session(
        metadata=((channel.NODE_KEY, node_id), (channel.EPOCH_KEY, str(epoch)), *auth_md(node_id))
    )
    workers = _workers()
    host = dpb.HostStats(cpu_percent=50.0, mem_used_bytes=1 << 34, mem_total_bytes=1 << 36)
    await asyncio.sleep(random.uniform(0, interval_s))
    nxt = time.monotonic()
    seq = 0
    while not stop.is_set():
        seq += 1
        for w in workers:
            w.step = seq // 9
        hb = dpb.Heartbeat(seq=seq, sent_mono_ns=time.monotonic_ns())
        hb.workers.extend(workers)
        if seq % 10 == 0:
            hb.host.CopyFrom(host)
        await call.write(dpb.AgentMessage(heartbeat=hb))
        sent[0] += 1
        nxt += interval_s
        d = nxt - time.monotonic()
        if d < 0:
            nxt = time.monotonic()
            d = 0
        await asyncio.sleep(d)
    await ch.close(None)


async def simulate(target: str, prefix: str, nodes: int, interval_ms: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    sent = [0]
    tasks = [
        asyncio.create_task(sim_node(target, f"{prefix}-{i}", interval_ms / 1000, stop, sent))
        for i in range(nodes)
    ]
    await stop.wait()
    for t in tasks:
        t.cancel()


# ---------------------------------------------------------------- wire-level simulated agents
# grpc.aio costs the client about as much per message as the server: 2,000 simulated
# nodes would need the 2 cores before the driver got any. These simulators speak gRPC on
# the wire themselves (HTTP/2 frames, HPACK literals, gRPC length-prefixed messages), one
# TCP connection per node, with pre-built frames and one timer wheel per process, so the
# driver under test gets the CPU. `--sim-client aio` uses grpc.aio clients instead.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
T_DATA, T_HEADERS, T_RST, T_SETTINGS, T_PING, T_GOAWAY, T_WINDOW = 0, 1, 3, 4, 6, 7, 8
F_END_STREAM, F_END_HEADERS, F_ACK = 0x1, 0x4, 0x1


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Literal header fields without indexing, new names, no Huffman (RFC 7541 6.2.2)."""
    out = b""
    for k, v in headers:
        kb, vb = k.encode(), v.encode()
        out += b"\x00" + _int(len(kb), 7) + kb + _int(len(vb), 7) + vb
    return out


def _frame(ftype: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes([ftype, flags])
        + stream.to_bytes(4, "big")
        + payload
    )


def _grpc(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


class WireNode(asyncio.Protocol):
    """One simulated node: one TCP connection, Register on stream 1, Session on stream 3."""

    def __init__(self, authority: str, node_id: str) -> None:
        self.authority = authority
        self.node_id = node_id
        self.epoch = time.time_ns()
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.registered = asyncio.get_running_loop().create_future()
        self.closed = False
        self.send_window = 65535
        self.seq = 0
        self.sent = 0
        self.index = 0
        self.rejoining = False

    def _headers(self, path: str, extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *auth_md(self.node_id),  # ignored by a driver without tokens: both modes parse it
            *extra,
        ]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        req = dpb.RegisterRequest(
            node_id=self.node_id,
            epoch=self.epoch,
            hostname=self.node_id,
            num_workers=WORKERS_PER_NODE,
        )
        transport.write(
            PREFACE
            + _frame(T_SETTINGS, 0, 0, b"")
            + _frame(
                T_HEADERS,
                F_END_HEADERS,
                1,
                _hpack(self._headers("/unbroken.driver.v1.Driver/Register", [])),
            )
            + _frame(T_DATA, F_END_STREAM, 1, _grpc(req.SerializeToString()))
        )

    def open_session(self) -> None:
        assert self.transport is not None
        md = [(channel.NODE_KEY, self.node_id), (channel.EPOCH_KEY, str(self.epoch))]
        self.transport.write(
            _frame(
                T_HEADERS,
                F_END_HEADERS,
                3,
                _hpack(self._headers("/unbroken.driver.v1.Driver/Session", md)),
            )
        )

    def beat(self, workers: list[dpb.WorkerStatus], host: dpb.HostStats | None) -> None:
        if self.closed or self.transport is None:
            return
        self.seq += 1
        hb = dpb.Heartbeat(seq=self.seq, sent_mono_ns=time.monotonic_ns())
        hb.workers.extend(workers)
        if host is not None:
            hb.host.CopyFrom(host)
        body = _grpc(dpb.AgentMessage(heartbeat=hb).SerializeToString())
        if len(body) > self.send_window:  # flow control: never overrun the driver's window
            return
        self.send_window -= len(body)
        self.transport.write(_frame(T_DATA, 0, 3, body))
        self.sent += 1

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            ftype, flags = buf[3], buf[4]
            stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload = buf[9 : 9 + n]
            buf = buf[9 + n :]
            self._on_frame(ftype, flags, stream, payload)
        self.buf = buf

    def _on_frame(self, ftype: int, flags: int, stream: int, payload: bytes) -> None:
        assert self.transport is not None
        if ftype == T_SETTINGS and not flags & F_ACK:
            for i in range(0, len(payload), 6):
                if int.from_bytes(payload[i : i + 2], "big") == 0x4:  # INITIAL_WINDOW_SIZE
                    self.send_window = int.from_bytes(payload[i + 2 : i + 6], "big")
            self.transport.write(_frame(T_SETTINGS, F_ACK, 0, b""))
        elif ftype == T_PING and not flags & F_ACK:
            self.transport.write(_frame(T_PING, F_ACK, 0, payload))
        elif ftype == T_WINDOW and stream in (0, 3):
            if stream == 3:
                self.send_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
        elif ftype == T_DATA and stream == 1 and not self.registered.done():
            self.registered.set_result(True)  # a RegisterResponse arrived
        elif ftype == T_DATA and payload:
            # commands from the driver: give the window back so it can send more
            inc = len(payload).to_bytes(4, "big")
            self.transport.write(_frame(T_WINDOW, 0, 0, inc) + _frame(T_WINDOW, 0, stream, inc))
        elif (
            ftype in (T_HEADERS, T_RST)
            and stream == 1
            and flags & F_END_STREAM
            and not self.registered.done()
        ):
            self.registered.set_result(False)  # trailers only: registration refused
        elif ftype in (T_GOAWAY, T_RST) or (
            ftype == T_HEADERS and stream == 3 and flags & F_END_STREAM
        ):
            if stream in (0, 3):
                self.closed = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.registered.done():
            self.registered.set_result(False)


async def simulate_wire(target: str, prefix: str, nodes: int, interval_ms: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    host_s, port_s = target.rsplit(":", 1)
    # a timer wheel: every node on its own random phase, one wake-up per slot
    slots = 20
    wheel: list[list[WireNode]] = [[] for _ in range(slots)]
    sims: list[WireNode] = []
    workers = _workers()

    async def join(i: int) -> None:
        for attempt in range(10):
            _, node = await loop.create_connection(
                lambda: WireNode(target, f"{prefix}-{i}"), host_s, int(port_s)
            )
            if await asyncio.wait_for(node.registered, 30):
                node.open_session()
                node.beat(workers, None)
                sims.append(node)
                wheel[random.randrange(slots)].append(node)
                node.index = i
                return
            assert node.transport is not None
            node.transport.close()
            await asyncio.sleep(0.1 * (attempt + 1))

    async def join_all() -> None:
        # agents of a real cluster start over seconds, not in one instant: join at a
        # bounded rate (a registration storm is the bad-input tests' business)
        for start in range(0, nodes, 25):
            await asyncio.gather(*(join(i) for i in range(start, min(nodes, start + 25))))
            await asyncio.sleep(0.1)

    joins = asyncio.ensure_future(join_all())
    rejoins: set[asyncio.Future[None]] = set()
    host = dpb.HostStats(cpu_percent=50.0, mem_used_bytes=1 << 34, mem_total_bytes=1 << 36)
    period = interval_ms / 1000.0
    t0 = time.monotonic()
    tick = 0
    while not stop.is_set():
        k = tick % slots
        rnd = tick // slots
        for w in workers:
            w.step = rnd // 9
        for n in list(wheel[k]):
            if n.closed and not n.rejoining:
                # the driver ended the session (declared lost): re-register, as agents do
                n.rejoining = True
                rejoins.add(asyncio.ensure_future(join(n.index)))
                wheel[k].remove(n)
                continue
            n.beat(workers, host if rnd % 10 == 0 else None)
        tick += 1
        delay = t0 + tick * period / slots - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    joins.cancel()
    for n in sims:
        if n.transport is not None:
            n.transport.close()


# ---------------------------------------------------------------- orchestration
class Bench:
    def __init__(self, tmp: Path, sim_client: str = "wire") -> None:
        self.tmp = tmp
        self.sim_client = sim_client
        self.procs: list[subprocess.Popen[bytes]] = []

    def sim(self, target: str, prefix: str, nodes: int) -> subprocess.Popen[bytes]:
        return self.spawn(
            "--sim",
            target,
            "--prefix",
            prefix,
            "--nodes",
            str(nodes),
            "--sim-client",
            self.sim_client,
        )

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, __file__, *args],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "err.log", "ab"),
            start_new_session=True,  # stop() ends its whole group
        )
        self.procs.append(p)
        return p

    def stop(self, procs: list[subprocess.Popen[bytes]]) -> None:
        stop_groups(procs, grace_s=10)

    def close(self) -> None:
        self.stop(self.procs)

    def driver(self, mode: str) -> tuple[subprocess.Popen[bytes], str]:
        pf = self.tmp / f"port-{mode}-{len(self.procs)}"
        p = self.spawn(
            "--serve", mode, "--port-file", str(pf), "--events-file", str(self.tmp / "events.jsonl")
        )
        deadline = time.monotonic() + 30
        while not (pf.exists() and pf.read_text()):
            if time.monotonic() > deadline:
                raise RuntimeError("bench driver did not start")
            time.sleep(0.05)
        return p, f"127.0.0.1:{pf.read_text()}"


def stats(target: str, attempts: int = 3) -> dpb.LiveStats:
    """The driver's counters; an overloaded driver gets a few tries (then RpcError)."""
    for i in range(attempts):
        try:
            with grpc.insecure_channel(target) as ch:
                req = dpb.LiveViewRequest(summary_only=True)
                md = token_metadata(VIEWER_TOKEN)
                return dgrpc.DriverStub(ch).LiveView(req, timeout=10, metadata=md).stats
        except grpc.RpcError:
            if i == attempts - 1:
                raise
    raise AssertionError("unreachable")


def reset(driver: subprocess.Popen[bytes]) -> None:
    os.kill(driver.pid, signal.SIGUSR1)


def load_level(b: Bench, mode: str, nodes: int, warm_s: float, measure_s: float) -> dict[str, Any]:
    drv, target = b.driver(mode)
    sims = [
        b.sim(target, f"s{i}", min(NODES_PER_SIM, nodes - i * NODES_PER_SIM))
        for i in range((nodes + NODES_PER_SIM - 1) // NODES_PER_SIM)
    ]
    try:
        # wait until every node registered and streams
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = stats(target)
            if mode == "null" or s.nodes_alive >= nodes:
                break
            time.sleep(0.5)
        time.sleep(warm_s)
        reset(drv)
        proc = psutil.Process(drv.pid)
        s0, c0, t0 = stats(target), proc.cpu_times(), time.monotonic()
        w0 = time.time_ns()
        time.sleep(measure_s)
        s1, c1, t1 = stats(target), proc.cpu_times(), time.monotonic()
        w1 = time.time_ns()
        lost_in_window = (
            sum(
                1
                for line in (b.tmp / "events.jsonl").read_text().splitlines()
                if w0 <= json.loads(line)["wall_ns"] <= w1
            )
            if (b.tmp / "events.jsonl").exists()
            else 0
        )
        dt = t1 - t0
        cpu = c1.user + c1.system - c0.user - c0.system
        hb = s1.heartbeats - s0.heartbeats
        lost_before = s0.nodes_lost
        return {
            "nodes": nodes,
            "mode": mode,
            "heartbeats_per_s": round(hb / dt, 1),
            "expected_per_s": nodes * 10,
            "delivery_p50_ms": round(s1.delivery_p50_ms, 3),
            "delivery_p99_ms": round(s1.delivery_p99_ms, 3),
            "handler_p50_us": round(s1.handler_p50_us, 2),
            "handler_p99_us": round(s1.handler_p99_us, 2),
            "false_node_lost": lost_in_window,
            "lost_during_startup": int(lost_before),
            "driver_cpu_percent": round(100 * cpu / dt, 1),
            "driver_cpu_us_per_heartbeat": round(1e6 * cpu / hb, 2) if hb else None,
        }
    finally:
        b.stop([*sims, drv])


def detection(b: Bench, kills: int, background: int) -> dict[str, Any]:
    events = b.tmp / "events.jsonl"
    events.write_text("")
    drv, target = b.driver("real")
    sims = max(1, -(-background // NODES_PER_SIM))  # a quick run's 250: one simulator
    per = background // sims
    background = per * sims
    bg = [b.sim(target, f"bg{i}", per) for i in range(sims)]
    victims = [b.sim(target, f"v{i}", 1) for i in range(kills)]
    try:
        deadline = time.monotonic() + 60
        while stats(target).nodes_alive < background + kills:
            if time.monotonic() > deadline:
                raise RuntimeError("simulators did not all register")
            time.sleep(0.5)
        time.sleep(2.0)
        killed: dict[str, int] = {}
        for i, p in enumerate(victims):
            time.sleep(random.uniform(0.1, 0.25))  # random phase against the heartbeat
            killed[f"v{i}-0"] = time.time_ns()
            p.kill()
        time.sleep(1.5)
        lost = {}
        for line in events.read_text().splitlines():
            d = json.loads(line)
            lost[d["node"]] = d["wall_ns"]
        delays = sorted((lost[n] - t) / 1e6 for n, t in killed.items() if n in lost)
        false = [n for n in lost if n not in killed]
        return {
            "kills": kills,
            "detected": len(delays),
            "background_nodes": background,
            "detect_p50_ms": round(statistics.median(delays), 1) if delays else None,
            "detect_p99_ms": round(delays[min(len(delays) - 1, int(0.99 * len(delays)))], 1)
            if delays
            else None,
            "detect_max_ms": round(max(delays), 1) if delays else None,
            "false_node_lost": len(false),
        }
    finally:
        b.stop([*bg, *victims, drv])


WORKER = """
import time
from unbroken.trainer import hooks
h = hooks.install()
step = 0
while True:
    step += 1
    time.sleep(0.05)
    h.step(step, loss=1.0 / step)
"""


def agent_cpu(b: Bench, measure_s: float) -> dict[str, Any]:
    drv, target = b.driver("real")
    script = b.tmp / "worker.py"
    script.write_text(WORKER)
    out = open(b.tmp / "agent.log", "wb")
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken.cli.main",
            "agent",
            "--driver",
            target,
            "--node-id",
            "real-agent",
            "--nproc-per-node",
            "2",
            "--worker-cmd",
            f"{sys.executable} {script}",
            "--persist-url",
            str(b.tmp / "storage"),
            "--log-dir",
            str(b.tmp / "alogs"),
            "--socket",
            str(b.tmp / "agent.sock"),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # stop() ends its whole group
    )
    try:
        time.sleep(4.0)
        proc = psutil.Process(agent.pid)
        c0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(measure_s)
        c1, t1 = proc.cpu_times(), time.monotonic()
        return {
            "agent_cpu_percent": round(
                100 * (c1.user + c1.system - c0.user - c0.system) / (t1 - t0), 2
            ),
            "agent_workers": 2,
            "interval_ms": 100,
        }
    finally:
        b.stop([agent, drv])


def auth_overhead(b: Bench, nodes: int, warm: float, measure: float, pairs: int) -> dict[str, Any]:
    """Driver CPU per heartbeat, role tokens + authorization vs none, alternating pairs."""
    runs = []
    for _ in range(pairs):
        open_ = load_level(b, "real", nodes, warm, measure)
        auth = load_level(b, "auth", nodes, warm, measure)
        runs.append((open_, auth))
    ratios = [
        a["driver_cpu_us_per_heartbeat"] / o["driver_cpu_us_per_heartbeat"]
        for o, a in runs
        if a["driver_cpu_us_per_heartbeat"] and o["driver_cpu_us_per_heartbeat"]
    ]
    return {
        "nodes": nodes,
        "pairs": [
            {
                "open_cpu_us_per_hb": o["driver_cpu_us_per_heartbeat"],
                "auth_cpu_us_per_hb": a["driver_cpu_us_per_heartbeat"],
                "open_handler_p50_us": o["handler_p50_us"],
                "auth_handler_p50_us": a["handler_p50_us"],
                "auth_false_node_lost": a["false_node_lost"],
            }
            for o, a in runs
        ],
        "auth_vs_open_ratio": round(statistics.median(ratios), 3) if ratios else None,
    }


def auth_table(r: dict[str, Any]) -> str:
    rows = [
        f"| pair ({r['nodes']} nodes) | open CPU µs/hb | auth CPU µs/hb | ratio "
        "| handler p50 µs open / auth |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, p in enumerate(r["pairs"], 1):
        ratio = p["auth_cpu_us_per_hb"] / p["open_cpu_us_per_hb"]
        rows.append(
            f"| {i} | {p['open_cpu_us_per_hb']} | {p['auth_cpu_us_per_hb']} | {ratio:.3f} | "
            f"{p['open_handler_p50_us']} / {p['auth_handler_p50_us']} |"
        )
    rows.append(f"| **median** | | | **{r['auth_vs_open_ratio']}** | |")
    return "\n".join(rows)


def table(r: dict[str, Any]) -> str:
    rows = [
        "| nodes | heartbeats/s (expected) | delivery p50 / p99 ms | handler p50 / p99 µs "
        "| false NodeLost | driver CPU % | CPU µs/hb |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["levels"]:
        rows.append(
            f"| {x['nodes']} | {x['heartbeats_per_s']:.0f} ({x['expected_per_s']}) | "
            f"{x['delivery_p50_ms']:.2f} / {x['delivery_p99_ms']:.2f} | "
            f"{x['handler_p50_us']:.1f} / {x['handler_p99_us']:.1f} | "
            f"{x['false_node_lost']} | {x['driver_cpu_percent']} | "
            f"{x['driver_cpu_us_per_heartbeat']} |"
        )
    d = r["detection"]
    rows += [
        "",
        "| metric | value |",
        "|---|---:|",
        f"| max_nodes_sustained_100ms | {r['max_nodes_sustained_100ms']} |",
        f"| detect_p50_ms / detect_p99_ms ({d['kills']} SIGKILLs, "
        f"{d['background_nodes']} background nodes) | {d['detect_p50_ms']} / "
        f"{d['detect_p99_ms']} |",
        f"| handler_vs_transport_ratio (CPU per heartbeat, ours / do-nothing, "
        f"{r['transport']['nodes']} nodes) | {r['handler_vs_transport_ratio']} |",
        f"| agent_cpu_percent (2 workers, 100 ms) | {r['agent']['agent_cpu_percent']} |",
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--serve", choices=("real", "null", "auth"))
    ap.add_argument(
        "--auth-only", action="store_true", help="only the authorization overhead comparison"
    )
    ap.add_argument("--port-file")
    ap.add_argument("--events-file", default=os.devnull)
    ap.add_argument("--sim")
    ap.add_argument("--prefix", default="s")
    ap.add_argument(
        "--sim-client",
        choices=("wire", "aio"),
        default="wire",
        help="simulated agents: wire-level gRPC (default) or grpc.aio clients",
    )
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="small loads (smoke test)")
    ap.add_argument("--levels", default="", help="comma-separated node counts")
    ap.add_argument(
        "--relay",
        action="store_true",
        help="the relay mode (bench/heartbeat_relay.py): up to 10,240 nodes behind relays",
    )
    ns = ap.parse_args()
    if ns.relay:
        sys.path.insert(0, str(HERE))
        import heartbeat_relay

        sys.argv = [
            heartbeat_relay.__file__,
            *(["--quick"] if ns.quick else []),
            *(["--levels", ns.levels] if ns.levels else []),
        ]
        heartbeat_relay.main()
        return
    if ns.serve:
        asyncio.run(serve(ns.serve, ns.port_file, ns.events_file))
        return
    if ns.sim:
        fn = simulate_wire if ns.sim_client == "wire" else simulate
        asyncio.run(fn(ns.sim, ns.prefix, ns.nodes, 100))
        return
    levels = (
        [int(x) for x in ns.levels.split(",")]
        if ns.levels
        else [100, 250]
        if ns.quick
        else [500, 1000, 2000]
    )
    warm, measure = (2.0, 3.0) if ns.quick else (3.0, 8.0)
    load_at_start = round(os.getloadavg()[0], 2)
    if ns.auth_only:
        with tempfile.TemporaryDirectory(prefix="bench-hb-") as tmp:
            b = Bench(Path(tmp), ns.sim_client)
            try:
                n = levels[0] if ns.levels else (250 if ns.quick else 1000)
                r = auth_overhead(b, n, warm, measure, 2 if ns.quick else 3)
            finally:
                b.close()
        r["machine"] = {
            "loadavg_1m_at_start": load_at_start,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        }
        RESULTS_AUTH.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_AUTH.write_text(json.dumps(r, indent=2) + "\n")
        print(auth_table(r))
        return
    with tempfile.TemporaryDirectory(prefix="bench-hb-") as tmp:
        b = Bench(Path(tmp), ns.sim_client)
        try:
            out: dict[str, Any] = {"levels": []}
            for n in levels:
                try:
                    out["levels"].append(load_level(b, "real", n, warm, measure))
                except grpc.RpcError as e:  # the driver stopped answering: not sustained
                    out["levels"].append(
                        {
                            "nodes": n,
                            "mode": "real",
                            "heartbeats_per_s": 0.0,
                            "expected_per_s": n * 10,
                            "delivery_p50_ms": math.inf,
                            "delivery_p99_ms": math.inf,
                            "handler_p50_us": 0.0,
                            "handler_p99_us": 0.0,
                            "false_node_lost": -1,
                            "driver_cpu_percent": None,
                            "driver_cpu_us_per_heartbeat": None,
                            "error": f"driver unresponsive: {e.code()}",
                        }
                    )
                print(json.dumps(out["levels"][-1]), flush=True)
            ok = [
                x["nodes"]
                for x in out["levels"]
                if x["false_node_lost"] == 0
                and x["delivery_p99_ms"] < 20
                and x["heartbeats_per_s"] >= 0.95 * x["expected_per_s"]
            ]
            out["max_nodes_sustained_100ms"] = max(ok) if ok else 0
            tn = levels[1] if len(levels) > 1 else levels[0]
            null = load_level(b, "null", tn, warm, measure)
            real = next(x for x in out["levels"] if x["nodes"] == tn)
            out["transport"] = null
            out["handler_vs_transport_ratio"] = round(
                real["driver_cpu_us_per_heartbeat"] / null["driver_cpu_us_per_heartbeat"], 3
            )
            out["detection"] = detection(b, 8 if ns.quick else 24, 250 if ns.quick else 500)
            out["detect_p50_ms"] = out["detection"]["detect_p50_ms"]
            out["detect_p99_ms"] = out["detection"]["detect_p99_ms"]
            out["agent"] = agent_cpu(b, 3.0 if ns.quick else 10.0)
            out["agent_cpu_percent"] = out["agent"]["agent_cpu_percent"]
            out["machine"] = {
                "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
                "cpus": os.cpu_count(),
                "python": sys.version.split()[0],
                "grpc": grpc.__version__,
            }
        finally:
            b.close()
    out["machine"]["loadavg_1m_at_start"] = load_at_start
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():  # keep the relay mode's figures (bench/heartbeat_relay.py)
        old = json.loads(RESULTS.read_text())
        out.update({k: v for k, v in old.items() if "relay" in k or k.endswith("_10k")})
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))


if __name__ == "__main__":
    main()
