"""A node id is one node, never a Slurm hostlist.

scontrol reads `NodeName=` as a hostlist: a launcher that registered the world `n[1-64]`
had the driver drain 64 Slurm nodes outside the job when that "node" was lost, and
`n[1-99999999]` has slurmctld expand a list of a hundred million names. The driver refuses
such an id where it enters (RegisterJob's world, ReportFailure) and the Slurm scheduler
refuses it again before any scontrol runs. Real gRPC against the driver service.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tests.inproc import driver, status_of
from unbroken.driver.scheduler import SchedulerError
from unbroken.driver.slurm import SlurmConfig, SlurmScheduler
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

HOSTLISTS = ["n[1-64]", "n1,n2", "n[1-99999999]", "n1 n2"]


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_a_hostlist_is_no_node_id_and_slurm_never_sees_one(hostlist: str, tmp_path: Path) -> None:
    async def go() -> None:
        async with driver() as (svc, store, addr):
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = dgrpc.DriverStub(ch)
                world = ev.WorldLayout(node_ids=["good-0", hostlist], workers_per_node=1)
                job = stub.RegisterJob(dpb.RegisterJobRequest(world=world))
                assert await status_of(job) == grpc.StatusCode.INVALID_ARGUMENT
                failure = stub.ReportFailure(
                    dpb.ReportFailureRequest(node_id=hostlist, kind=dpb.FAILURE_KIND_NODE)
                )
                assert await status_of(failure) == grpc.StatusCode.INVALID_ARGUMENT
            assert svc.journal is not None and not svc.journal.state.world.node_ids
            assert not any(e.WhichOneof("payload") == "node_lost" for e in store.events)
        # the scheduler's own check: no scontrol in bin_dir, so any command it ran would
        # fail with "not found"; the refusal comes first and says why
        slurm = SlurmScheduler(SlurmConfig(bin_dir=str(tmp_path)))
        for call in (slurm.drain(hostlist, "unbroken: x"), slurm.resume(hostlist)):
            with pytest.raises(SchedulerError, match="not one Slurm node name"):
                await call

    asyncio.run(go())
