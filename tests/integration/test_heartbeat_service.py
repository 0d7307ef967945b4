"""The driver service in-process (real gRPC server, in-memory log) against real clients.

Commands down the stream to a real agent process (restart with a stack dump of a hung
worker, pause forwarded to workers, a start's id in the heartbeats, a diagnostic check,
shutdown), and bad input from raw clients: unknown node, invalid and oversized
registrations, stale epochs, duplicate node ids, a registration flood, impossible
telemetry, a consumer that cannot keep up, and a standby that sends agents to the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.inproc import driver, session_md, status_of, until
from unbroken.common import channel
from unbroken.driver.etcd import free_port
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

WORKER = """
import os, time
from unbroken.trainer import hooks
h = hooks.install()
step = 0
while True:
    step += 1
    time.sleep(0.05)
    h.step(step, loss=1.0 / step, forward=10.0)
    for c in h.commands():
        print("GOT", c.WhichOneof("kind"), flush=True)
"""


def kinds(store: InMemoryStore) -> list[str]:
    return [str(e.WhichOneof("payload")) for e in store.events]


def reg(node: str = "n0", epoch: int = 1, **kw: Any) -> dpb.RegisterRequest:
    return dpb.RegisterRequest(node_id=node, epoch=epoch, **kw)


def test_a_shutdown_s_reply_is_read_though_the_driver_is_slow_to_read_it(tmp_path: Path) -> None:
    """The agent answers a shutdown, half-closes its stream and exits; the driver's loop,
    busy, reads the reply only later. The agent lets the session end by itself (the driver
    ends it once it read the reply) before closing its channel: closed at once, the call
    was cancelled with the reply unread (a clean-clone CI run: "no reply from n0 in 20 s")."""

    async def go() -> None:
        async with driver() as (svc, _store, addr):
            agent = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "unbroken.cli.main", "agent", "--driver", addr,
                "--node-id", "n0", "--log-dir", str(tmp_path), "--socket",
                str(tmp_path / "a.sock"), "--no-start",
                stdout=open(tmp_path / "agent.log", "wb"), stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            try:
                await until(lambda: svc.view.nodes.get("n0") is not None
                            and svc.view.nodes["n0"].hb.seq > 2, 30, "n0's heartbeats")  # fmt: skip
                fut = svc.sessions.ask("n0", dpb.DriverMessage(shutdown=dpb.Shutdown()), 20)
                log = tmp_path / "agent.log"
                await until(lambda: "kind=shutdown" in log.read_text(), 20, "the command")
                time.sleep(1.5)  # this loop reads nothing while the agent answers and exits
                ack = await fut
                assert ack.ack.ok, ack.ack.detail
                assert await asyncio.wait_for(agent.wait(), 20) == 0
            finally:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()

    asyncio.run(go())


def test_commands_reach_a_real_agent(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    async def go() -> None:
        async with driver() as (svc, store, addr):
            agent = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "unbroken.cli.main",
                "agent",
                "--driver",
                addr,
                "--node-id",
                "n0",
                "--nproc-per-node",
                "2",
                "--worker-cmd",
                f"{sys.executable} {script}",
                "--persist-url",
                str(tmp_path / "storage"),
                "--log-dir",
                str(tmp_path),
                "--socket",
                str(tmp_path / "a.sock"),
                "--inject-fault",
                "none",
                stdout=open(tmp_path / "agent.log", "wb"),
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            try:
                await scenario(svc, store, agent)
            finally:
                if agent.returncode is None:
                    agent.terminate()  # the agent stops its workers
                    try:
                        await asyncio.wait_for(agent.wait(), 10)
                    except TimeoutError:
                        agent.kill()
                        await agent.wait()

    async def scenario(
        svc: DriverService, store: InMemoryStore, agent: asyncio.subprocess.Process
    ) -> None:
        def workers() -> list[dpb.WorkerStatus]:
            s = svc.view.nodes.get("n0")
            return list(s.hb.workers) if s else []

        await until(
            lambda: len(workers()) == 2 and all(w.step > 3 for w in workers()),
            30,
            "two stepping workers",
        )
        w0 = workers()[0]
        assert w0.median_step_ms > 40 and w0.has_loss and w0.loss > 0
        os.kill(w0.pid, signal.SIGSTOP)  # hung: must still yield its stacks
        ack = await svc.request(
            "n0",
            dpb.DriverMessage(
                restart_workers=dpb.RestartWorkers(local_ranks=[0], dump_stacks=True)
            ),
            20,
        )
        assert ack.ack.ok, ack.ack.detail
        assert "local rank 0" in ack.ack.detail and "worker.py" in ack.ack.detail
        await until(
            lambda: any(w.local_rank == 0 and w.restarts == 1 and w.step > 2 for w in workers()),
            30,
            "worker 0 restarted",
        )
        assert (tmp_path / "worker-0.log").exists()

        ack = await svc.request("n0", dpb.DriverMessage(pause=dpb.Pause(reason="test")), 10)
        assert ack.ack.ok and ack.ack.detail == "pause forwarded to 2 workers"
        await until(
            lambda: "GOT pause" in (tmp_path / "worker-1.log").read_text(),
            10,
            "the worker to receive pause",
        )

        # a start's id is in every heartbeat while its workers run (a new leader adopts
        # them, driver/loop.py); restarted ranks are no longer the start's
        start = dpb.StartWorkers(
            world_size=2, master_addr="127.0.0.1", master_port=free_port(), start_id="i9/2"
        )
        ack = await svc.request("n0", dpb.DriverMessage(start_workers=start), 30)
        assert ack.ack.ok, ack.ack.detail

        def hb() -> dpb.Heartbeat:
            return svc.view.nodes["n0"].hb

        running = dpb.WORKER_STATE_RUNNING
        await until(
            lambda: hb().start_id == "i9/2" and all(w.state == running for w in workers()),
            20,
            "the start's id in the heartbeats",
        )
        restart = dpb.RestartWorkers(local_ranks=[1])
        assert (await svc.request("n0", dpb.DriverMessage(restart_workers=restart), 20)).ack.ok
        await until(lambda: hb().start_id == "", 10, "the id gone after a restart")

        port = free_port()
        spec = {
            "check_id": "c1",
            "node_id": "n0",
            "group": ["n0"],
            "rank": 0,
            "store_host": "127.0.0.1",
            "store_port": port,
            "matmul_n": 16,
            "matmul_iters": 1,
            "allgather_numel": 8,
            "allgather_iters": 1,
            "timeout_s": 60,
            "device": "cpu",
        }
        res = await svc.request(
            "n0",
            dpb.DriverMessage(run_check=dpb.RunCheck(spec_json=json.dumps(spec), timeout_s=90)),
            120,
        )
        assert res.WhichOneof("kind") == "check_result", res
        out = json.loads(res.check_result.result_json)
        assert out["check_id"] == "c1" and out["node_id"] == "n0", out
        assert out["fault"] == "none"  # the agent's --inject-fault went into the spec

        ack = await svc.request("n0", dpb.DriverMessage(shutdown=dpb.Shutdown()), 20)
        assert ack.ack.ok
        assert await asyncio.wait_for(agent.wait(), 20) == 0
        assert kinds(store).count("node_registered") == 1

    asyncio.run(go())


def test_bad_input_gets_clear_statuses_and_never_wedges_the_driver() -> None:
    async def go() -> None:
        cfg = ServiceConfig(live=LiveViewConfig(max_nodes=50), stream_buffer=4)
        async with driver(cfg) as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                await scenario(svc, store, dgrpc.DriverStub(ch), ch)

    async def scenario(
        svc: DriverService, store: InMemoryStore, stub: dgrpc.DriverStub, ch: grpc.aio.Channel
    ) -> None:
        S = grpc.StatusCode
        # a stream from a node that never registered
        call = stub.Session(metadata=session_md("ghost", 1))
        assert await status_of(call.read()) == S.FAILED_PRECONDITION
        # invalid, absurdly long, oversized
        assert await status_of(stub.Register(reg("bad id!"), timeout=5)) == S.INVALID_ARGUMENT
        assert (
            await status_of(stub.Register(reg(hostname="h" * 10_000), timeout=5))
            == S.INVALID_ARGUMENT
        )
        assert (
            await status_of(stub.Register(reg(hostname="h" * (5 << 20)), timeout=5))
            == S.RESOURCE_EXHAUSTED
        )
        assert svc.view.nodes == {} and store.events == []

        # a healthy node with a session
        await stub.Register(reg("n0", epoch=10), timeout=5)
        live = stub.Session(metadata=session_md("n0", 10))
        await live.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
        await until(lambda: svc.view.nodes["n0"].heartbeats == 1, 5, "first heartbeat")
        # stale epoch, and a second agent claiming the live node id
        err = None
        try:
            await stub.Register(reg("n0", epoch=9), timeout=5)
        except grpc.aio.AioRpcError as e:
            err = e
        assert err is not None and err.code() == S.FAILED_PRECONDITION
        assert "stale epoch" in (err.details() or "")
        assert (
            await status_of(stub.Register(reg("n0", epoch=11), timeout=5)) == S.FAILED_PRECONDITION
        )
        await until(lambda: kinds(store).count("node_refused") == 2, 5, "two NodeRefused")
        assert sorted(
            e.node_refused.reason for e in store.events if e.HasField("node_refused")
        ) == ["duplicate node id", "stale epoch"]

        # impossible telemetry: NaN loss and a step that goes backwards -> alerts
        for seq, step, loss in ((2, 100, 1.0), (3, 50, math.nan)):
            await live.write(
                dpb.AgentMessage(
                    heartbeat=dpb.Heartbeat(
                        seq=seq,
                        flags=dpb.HEARTBEAT_FLAG_LOG_ALERTS,
                        workers=[
                            dpb.WorkerStatus(
                                local_rank=0,
                                state=dpb.WORKER_STATE_RUNNING,
                                step=step,
                                loss=loss,
                                has_loss=True,
                            )
                        ],
                    )
                )
            )
        await until(lambda: kinds(store).count("log_alert") == 2, 5, "two alerts")
        assert {e.log_alert.keyword for e in store.events if e.HasField("log_alert")} == {
            "non-finite loss",
            "step went backwards",
        }

        # a registration flood beyond the node limit: clear refusals, driver still fine
        codes = await asyncio.gather(
            *(status_of(stub.Register(reg(f"f{i}"), timeout=10)) for i in range(120))
        )
        assert codes.count(S.OK) == 49 and codes.count(S.RESOURCE_EXHAUSTED) == 71
        health = health_pb2_grpc.HealthStub(ch)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # the flood nodes never opened sessions: lost after the grace, not before
        assert svc.view.nodes["f0"].alive

        # a consumer that cannot keep up is dropped, memory stays bounded
        for _ in range(50):
            with contextlib.suppress(KeyError):
                svc.send("n0", dpb.DriverMessage(pause=dpb.Pause(reason="flood")))
        assert svc.dropped_commands >= 1
        assert await status_of(_drain(live)) == S.RESOURCE_EXHAUSTED
        assert svc.view.nodes["n0"].outbox is None

    asyncio.run(go())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_standby_sends_agents_to_the_leader() -> None:
    async def go() -> None:
        async with driver(leader=False, leader_address="10.0.0.7:50051") as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await stub.Register(reg(), timeout=5)
                e = ei.value
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert "not the leader" in (e.details() or "")
                assert dict(e.trailing_metadata() or ())[channel.LEADER_KEY] == "10.0.0.7:50051"
                assert svc.view.nodes == {} and store.events == []

    asyncio.run(go())


def test_a_returning_leader_gives_every_node_time_to_reconnect() -> None:
    """Re-elected (same driver, new term): a node whose session the step-down ended is not
    judged lost before the registration grace, and a node still streaming keeps a full
    miss limit; a node the old term declared lost is recorded by the level check."""
    from unbroken.driver import detectors

    async def go() -> None:
        cfg = ServiceConfig(live=LiveViewConfig(session_grace_ms=2_000))
        async with driver(cfg) as (svc, store, addr):
            ch = grpc.aio.insecure_channel(addr)
            stub = dgrpc.DriverStub(ch)
            for n in ("a", "b"):
                await stub.Register(reg(n, epoch=1), timeout=5)
            live = stub.Session(metadata=session_md("a", 1))
            await live.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
            await until(lambda: svc.view.nodes["a"].heartbeats == 1, 5, "a's heartbeat")
            await until(lambda: kinds(store).count("node_registered") == 2, 5, "registrations")
            svc.view.mark_lost(svc.view.nodes["b"])  # declared lost, never recorded
            svc.step_down()  # ends a's stream
            await until(lambda: svc.view.nodes["a"].outbox is None, 5, "a's stream to end")
            elog = InMemoryEventLog(store, "job", store.elect("d1"))
            journal = svc.lead(elog, "", await elog.replay())
            now = time.monotonic()
            timeout_s = cfg.live.timeout_s
            silent = {s.node_id for s, _ in detectors.silent(svc.view, now + timeout_s + 0.5)}
            assert "a" not in silent  # no session yet: it has the registration grace
            silent = {s.node_id for s, _ in detectors.silent(svc.view, now + 2.5)}
            assert "a" in silent  # ... and no more
            await until(
                lambda: journal.state.nodes["b"].state == ev.NODE_STATE_LOST, 5, "b's NodeLost"
            )
            assert kinds(store).count("node_lost") == 1
            await ch.close()

    asyncio.run(go())


def test_a_leader_that_took_over_knows_where_each_node_replicates() -> None:
    """A node reconnecting to a new leader (same epoch: no new NodeRegistered) still gives it
    its registration: the new leader's view, rebuilt from the log, had no --replica-listen,
    so the world's buddy ring was empty after every failover (bench-recovery 2026-11-24: a
    node kept replicating to an evicted node's closed port and its loss restored from
    storage, 271 steps back)."""
    from unbroken.driver.loop import ring_buddies
    from unbroken.driver.service import build_server
    from unbroken.driver.term import expect_known_nodes

    async def go() -> None:
        async with driver() as (svc, store, addr):
            ch = grpc.aio.insecure_channel(addr)
            stub = dgrpc.DriverStub(ch)
            for i, n in enumerate(("a", "b")):
                await stub.Register(reg(n, epoch=1, replica_listen=f"127.0.0.1:{7001 + i}"))
            await until(lambda: kinds(store).count("node_registered") == 2, 5, "registrations")
            svc.step_down()
            await ch.close()
            # another driver takes over the same log
            new = DriverService(ServiceConfig(), driver_id="d2", job_id="job")
            elog = InMemoryEventLog(store, "job", store.elect("d2"))
            journal = new.lead(elog, "", await elog.replay())
            # as a term does on taking the lead (driver/term.py)
            expect_known_nodes(new.view, journal.state, new.config.live.session_grace_ms / 1e3)
            assert all(new.view.nodes[n].alive for n in ("a", "b"))
            new.start()
            server, port, _ = await build_server(new, "127.0.0.1:0")
            try:
                ch2 = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                stub2 = dgrpc.DriverStub(ch2)
                for i, n in enumerate(("a", "b")):
                    await stub2.Register(reg(n, epoch=1, replica_listen=f"127.0.0.1:{7001 + i}"))
                assert kinds(store).count("node_registered") == 2  # reconnects, no new event
                slots = {n: new.view.nodes.get(n) for n in ("a", "b")}
                assert ring_buddies(("a", "b"), slots) == {
                    "a": "127.0.0.1:7002",
                    "b": "127.0.0.1:7001",
                }
                await ch2.close()
            finally:
                await server.stop(0)
                await new.close()

    asyncio.run(go())
