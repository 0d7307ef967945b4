"""A failed self-check evicts its node without a diagnosis (`--self-check-evicts`), so a
hostile agent's report must reach no further than its own node: the driver names the node
from the agent's registered session, never from the report (a SelfCheckReport has no node
field), and caps what it keeps. A real driver service on loopback (tests/inproc.py), its
event fed to the recovery machine.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.inproc import driver, session_md, until
from tests.unit.machine_harness import Sim, job
from unbroken.driver import machine as m
from unbroken.driver.operator import MAX_DETAILS_JSON
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def test_a_self_check_report_evicts_only_the_node_that_sent_it_and_is_capped() -> None:
    async def go() -> ev.SelfCheckReported:
        async with driver() as (_, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                for node in ("n0", "n1"):
                    await stub.Register(dpb.RegisterRequest(node_id=node, epoch=1), timeout=5)
                live = stub.Session(metadata=session_md("n0", 1))
                await live.write(dpb.AgentMessage(heartbeat=dpb.Heartbeat(seq=1)))
                # n0 blames n1 in every field it has, with far more than is kept
                blame = "matmul: wrong matmul result on n1 " + "x" * 2000
                await live.write(
                    dpb.AgentMessage(
                        self_check_report=dpb.SelfCheckReport(
                            ok=False,
                            failures=[blame] * 1000,
                            details_json='{"node_id": "n1"}' + " " * (1 << 20),
                        )
                    )
                )

                def reported() -> list[ev.SelfCheckReported]:
                    return [
                        e.self_check_reported
                        for e in store.events
                        if e.HasField("self_check_reported")
                    ]

                await until(lambda: bool(reported()), 10, "SelfCheckReported")
                live.cancel()
                return reported()[0]

    got = asyncio.run(go())
    assert got.node_id == "n0" and not got.ok
    assert len(got.failures) <= 32 and all(len(f) <= 500 for f in got.failures)
    assert len(got.details_json) <= MAX_DETAILS_JSON

    sim = Sim(m.Policy())  # the default policy: a failed matmul evicts without a diagnosis
    sim.append(job(nodes=2, spares=1))
    sim.feed(ev.Event(self_check_reported=got))
    sim.drive(set())
    evicted = {e.node_evicted.node_id for e in sim.log if e.HasField("node_evicted")}
    assert evicted == {"n0"}
    assert list(sim.state.world.node_ids) == ["s0", "n1"]
