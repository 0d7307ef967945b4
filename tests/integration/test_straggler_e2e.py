"""A node slowed while training is named a straggler, evicted, and a spare takes its ranks.

`unbroken driver --nodes 2 --dp 2` runs the tiny trainer on two `unbroken agent --no-start`
processes plus a spare. Once both nodes have a full window of steps, `InjectFault
slow-train --factor 1.3` makes n1's trainer spend 30 % more time computing each step (a
fault the trainer applies, trainer/faultfile.py SlowFile). Nothing else is sent by the test:

- each worker reports its compute and collective-wait time per step; n0 now waits for n1
  in the all-reduce, so only n1's compute grows;
- the driver's straggler sweep (driver/straggler.py) appends StragglerSuspected(n1);
- with the default policy (evict) and a spare, the machine evicts n1 and the spare takes
  its rank; the world restores and trains on.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until
from unbroken.driver.straggler import StragglerConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

# 70-160 s on 2 cores: `make test-all` runs it; CI's `make test` stays under 20 minutes
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def slow(address: str, node: str, factor: float) -> str:
    async def call() -> dpb.InjectFaultResponse:
        async with grpc.aio.insecure_channel(address) as ch:
            req = dpb.InjectFaultRequest(node_id=node, kind="slow-train", factor=factor)
            return await dgrpc.DriverStub(ch).InjectFault(req, timeout=30)

    resp = asyncio.run(call())
    assert resp.ok, resp.detail
    return resp.detail


def live_nodes(address: str) -> list[dpb.NodeLive]:
    async def call() -> dpb.LiveViewResponse:
        async with grpc.aio.insecure_channel(address) as ch:
            return await dgrpc.DriverStub(ch).LiveView(dpb.LiveViewRequest(), timeout=10)

    return list(asyncio.run(call()).nodes)


def live_timings(address: str) -> list[tuple[str, float, float, float, int]]:
    """(node, compute, MAD, wait, window) per worker from the driver's live view."""
    nodes = live_nodes(address)
    return [
        (n.node_id, w.compute_ms, w.compute_mad_ms, w.wait_ms, w.window_steps)
        for n in nodes
        for w in n.workers
    ]


def test_slowed_node_is_named_evicted_and_replaced_by_the_spare(job: Job) -> None:
    job.start_driver("--persist-floor-s", "0.001", "--persist-ceiling-s", "0.001")
    # persist every step: the evicted node's ranks restore on the spare from storage (a
    # spare cannot reach the replica of the node it replaces yet), so the step after the
    # eviction is the newest one, not the last interval's
    every = ("--persist-every-s", "0.001")
    job.start_agent("n0", buddy="n1", extra=every)
    job.start_agent("n1", buddy="n0", extra=every)
    job.start_agent("s0", buddy="n0", spare=True, extra=every)
    until(lambda: job.max_step() >= 70, 240, "training to start", job)  # windows filled
    # the roles learnt once the restart's settle sweeps have passed (a slowdown before
    # that would be taken for n1's role)
    time.sleep(StragglerConfig().role_s(w for n in live_nodes(job.address) for w in n.workers))

    slow(job.address, "n1", 1.3)
    t0 = time.monotonic()

    def kinds() -> list[str]:
        return [str(e.WhichOneof("payload")) for e in job.events()]

    try:
        until(lambda: "straggler_suspected" in kinds(), 120, "StragglerSuspected", job)
    finally:
        print(live_timings(job.address))
    took = time.monotonic() - t0
    until(
        lambda: "training_resumed" in (k := kinds())[k.index("straggler_suspected") :],
        180,
        "the spare to take over and training to resume",
        job,
    )
    events = job.events()
    (s,) = [e.straggler_suspected for e in events if e.HasField("straggler_suspected")]
    assert s.node_id == "n1" and s.slowdown >= 1.1 and s.policy == "evict", s
    assert s.wait_ms <= s.others_wait_ms, s  # the straggler waits least
    evicted = [e.node_evicted.node_id for e in events if e.HasField("node_evicted")]
    assert evicted == ["n1"], evicted
    worlds = [e.world_resized for e in events if e.HasField("world_resized")]
    assert worlds and sorted(worlds[-1].new_world.node_ids) == ["n0", "s0"], worlds
    resumed_at = job.max_step()
    until(lambda: job.max_step() >= resumed_at + 5, 120, "training past the eviction", job)
    print(f"StragglerSuspected {took:.1f} s after the 1.3x slowdown; slowdown {s.slowdown:.2f}")
