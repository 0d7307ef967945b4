"""A worker's step reports cannot make its agent flood the driver: a loss that stands out
sends one extra heartbeat (with a ring rescan) at once, but a worker flipping its loss high
and low at every datagram gets at most one per `OUTLIER_BEAT_EVERY_S`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from unbroken.agent.config import AgentConfig
from unbroken.agent.daemon import OUTLIER_BEAT_EVERY_S, Agent
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor, Worker
from unbroken.proto import hooks_pb2 as hpb

pytestmark = pytest.mark.unit


def test_flipping_losses_get_bounded_extra_heartbeats(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(drivers=["127.0.0.1:1"], node_id="n0"))
    path = str(tmp_path / "a.sock")
    sup = Supervisor(WorkerSpec(cmd=["true"], nproc=1, log_dir=str(tmp_path)), path)
    w = sup.workers[0] = Worker(0, 0, tmp_path / "w0.log")
    server = HookServer(path, sup, "n0")
    server.on_outlier = agent._outlier_beat
    beats = 0

    def report(n: int, loss: float) -> None:
        nonlocal beats
        s = hpb.StepReport(step=n, step_time_ms=5.0, loss=loss, has_loss=True)
        server.datagram_received(hpb.WorkerReport(local_rank=0, step=s).SerializeToString(), 1)
        if agent._beat_soon.is_set():  # what the heartbeat loop does with a kick
            beats += 1
            agent._beat_soon.clear()
            agent._rescan_due = False

    for n in range(1, 30):
        report(n, 4.0)
        w.status(time.monotonic())  # a heartbeat: the median the outliers are judged by
    beats = 0
    t0 = time.monotonic()
    for n in range(30, 2030):  # high, low, high, ...: every other report starts a run
        report(n, 40.0 if n % 2 == 0 else 4.0)
    elapsed = time.monotonic() - t0
    assert 1 <= beats <= 1 + elapsed / OUTLIER_BEAT_EVERY_S, (beats, elapsed)
    time.sleep(OUTLIER_BEAT_EVERY_S)
    before = beats
    report(2031, 4.0)
    report(2032, 40.0)  # the next outlier after the interval is sent at once again
    assert beats == before + 1
