"""The goodput ledger agrees with the workers' own account of a faulted run.

A real driver starts the tests' job (tests/jobs.py: two agents, the tiny trainer, dp 2,
flash saves every step); a worker is SIGKILLed and the loop recovers it. The driver's
`GetStatus` then gives the ledger's goodput and its lost time by cause and by category.
Independently, rank 0's own step log (`--metrics-out`: each step's time, its loop's host
time, its data loading and flash save times and when the turn ended) says which time
trained: for every step number the last run of it counts (a step run again after the
restore was wasted the first time), less its data loading and checkpoint save, up to the
moment of the status. The two goodputs agree within 2 % of the wall time, and the badput
categories sum to the lost time.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from tests.jobs import Job
from unbroken.cli.cluster import until
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration


def _productive_s(job: Job, until_unix_s: float) -> tuple[float, int]:
    """Seconds of training that counted, from rank 0's step log, and how many step runs
    were done twice (the first run of a redone step is lost)."""
    last: dict[int, float] = {}
    runs = 0
    for line in job.metrics.read_text().splitlines():
        m = json.loads(line)
        if m.get("end_unix_s", 0.0) > until_unix_s:
            continue
        runs += 1
        # the loop turn, less what it spent waiting for data and blocked on the flash save
        turn = float(m["step_time_s"]) + float(m.get("host_s", 0.0))
        last[int(m["step"])] = (
            turn - float(m.get("data_s", 0.0)) - float(m.get("flash_save_s", 0.0))
        )
    return sum(last.values()), runs - len(last)


def test_the_ledger_matches_the_workers_step_logs(job: Job) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 20, 180, "training to start", job)
    time.sleep(5)
    victim = job.worker("n1")
    assert victim is not None
    victim.kill()
    crash_step = job.max_step()
    until(
        lambda: (w := job.worker("n1")) is not None and w.pid != victim.pid,
        120,
        "the worker restarted",
        job,
    )
    until(lambda: job.max_step() >= crash_step + 20, 180, "training past the crash", job)
    time.sleep(10)

    with grpc.insecure_channel(job.address) as ch:
        st = dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=30)
    at = time.time()
    kinds = [e.WhichOneof("payload") for e in job.events()]
    assert "training_stepping" in kinds and kinds.count("training_resumed") >= 2, kinds
    productive, redone = _productive_s(job, at)
    wall = st.training_wall_s
    outside = productive / wall
    lost = dict(st.lost_s_by_category)
    detail = f"ledger {st.goodput:.4f}, steps {outside:.4f}, lost {lost}, redone runs {redone}"
    print(detail)
    assert st.goodput > 0 and abs(st.goodput - outside) <= 0.02, detail
    # the categories split the same lost time as the causes, and that is the ledger's figure
    assert abs(sum(lost.values()) - sum(st.lost_s_by_cause.values())) < 1e-6, detail
    assert abs(wall * (1 - st.goodput) - sum(lost.values())) < 0.01 * wall, detail
    assert lost.get("startup", 0) > 0 and lost.get("restore", 0) > 0, detail
    # the job flash-saves every step and draws every batch: both are charged, inside the loop
    assert lost.get("checkpoint_save", 0) > 0 and lost.get("data_loading", 0) > 0, detail
