"""Diagnosis through real node agents: the driver's service sends RunCheck commands.

An in-process DriverService (leader on an in-memory log) and 4 real `unbroken agent`
processes, one started with `--inject-fault wrong_matmul`, one with `--inject-fault
slow:2.0`. The diagnosis runs each group by sending RunCheck to the group's agents,
which run `python -m unbroken.diagnostics.check`; the verdict must name exactly the bad
and the slow node, and the round and verdict events must be in the log.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from tests.procs import Procs, start_agent
from unbroken.diagnostics.runner import (
    DiagnosisConfig,
    RoundRecord,
    diagnose,
    round_event,
    verdict_event,
)
from unbroken.driver.diagnose import AgentRunGroup, DriverDiagnoseConfig
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.liveview import LiveViewConfig
from unbroken.driver.service import DriverService, ServiceConfig, build_server
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

FAULTS = {"n0": "", "n1": "wrong_matmul", "n2": "slow:2.0", "n3": ""}
CHECK_TIMEOUT_S = 40.0


async def _scenario(tmp: Path) -> tuple[object, list[ev.Event]]:
    store = InMemoryStore()
    # Liveness is not under test here: 8 check processes importing torch on 2 shared cores
    # can starve an agent's 100 ms heartbeat past the default 300 ms NodeLost limit.
    live = LiveViewConfig(miss_limit=100)
    service = DriverService(ServiceConfig(live=live), driver_id="d", job_id="j")
    log_ = InMemoryEventLog(store, "j", store.elect("d"))
    service.lead(log_, "")
    service.start()
    server, port, _ = await build_server(service, "127.0.0.1:0")
    procs = Procs(tmp)
    try:
        for node, fault in FAULTS.items():  # the self-check runs (and the fault with it)
            start_agent(procs, f"127.0.0.1:{port}", node, "--inject-fault", fault, selfcheck=True)
        deadline = time.monotonic() + 60
        while not set(FAULTS) <= set(service.view.nodes):
            assert time.monotonic() < deadline, "agents did not register within 60 s"
            await asyncio.sleep(0.1)

        async def record(r: RoundRecord) -> None:
            await log_.append(
                ev.Event(
                    event_id=uuid.uuid4().hex, job_id="j", diagnosis_round=round_event("dg", r)
                )
            )

        d = await diagnose(
            list(FAULTS),
            run_group=AgentRunGroup(
                service, DriverDiagnoseConfig(check_timeout_s=CHECK_TIMEOUT_S, reply_slack_s=20.0)
            ),
            diagnosis_id="dg",
            on_round=record,
            config=DiagnosisConfig(round_timeout_s=120),
        )
        await log_.append(
            ev.Event(event_id=uuid.uuid4().hex, job_id="j", diagnosis_verdict=verdict_event(d))
        )
        return d, await log_.read()
    finally:
        await asyncio.to_thread(procs.stop_all)  # agents say goodbye to this loop's driver
        await server.stop(0.5)
        await service.close()


def test_agents_name_the_bad_and_the_slow_node(tmp_path: Path) -> None:
    d, events = asyncio.run(_scenario(tmp_path))
    v = d.verdict  # type: ignore[attr-defined]
    assert v.bad == ("n1",) and v.confirmed_directly == ("n1",)
    assert v.slow == ("n2",), d.slow_report  # type: ignore[attr-defined]
    kinds = [e.WhichOneof("payload") for e in events]
    assert "diagnosis_round" in kinds and kinds[-1] == "diagnosis_verdict"
    last = events[-1].diagnosis_verdict
    assert list(last.bad_nodes) == ["n1"] and list(last.slow_nodes) == ["n2"]
