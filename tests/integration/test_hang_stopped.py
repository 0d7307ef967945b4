"""A hung rank whose process is stopped is named the culprit (agent/hang.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.agent import hang
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor

pytestmark = pytest.mark.integration


def _wait_for(pred: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_sigstopped_process_reads_as_stopped_and_a_running_one_does_not() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not hang.process_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        _wait_for(lambda: hang.process_stopped(p.pid), "the stop to be delivered")
        os.kill(p.pid, signal.SIGCONT)
        _wait_for(lambda: not hang.process_stopped(p.pid), "the process to run again")
    finally:
        p.kill()
        p.wait()
    assert not hang.process_stopped(p.pid)  # gone: not stopped
    assert not hang.process_stopped(os.getpid())


def test_the_supervisors_watch_times_a_stop_and_ignores_a_brief_one(tmp_path: Path) -> None:
    """`Supervisor.watch_stops` on a real worker process: a SIGSTOP that lasts is judged
    hung ("stopped", `STOPPED_AFTER_MS`) within a few polls and asks for a heartbeat once;
    a stop of 30 ms (a debugger's or py-spy's trace stop) is neither; a moment of running
    inside a long stop (a stopped worker's stack dump) does not restart its timing."""

    async def run() -> None:
        d = tmp_path
        spec = WorkerSpec(
            cmd=[sys.executable, "-c", "import time; time.sleep(60)"],
            nproc=1,
            log_dir=str(d / "logs"),
            warm=False,
        )
        sup = Supervisor(spec, str(d / "agent.sock"))
        kicks: list[float] = []
        watch = asyncio.create_task(sup.watch_stops(lambda: kicks.append(time.monotonic())))
        try:
            w = await sup.start(0, refill=False)
            w.last_progress = time.monotonic() - 10  # silent long enough: the stop decides
            await asyncio.sleep(0.1)
            os.kill(w.pid, signal.SIGSTOP)  # brief: not a hang
            await asyncio.sleep(0.03)
            os.kill(w.pid, signal.SIGCONT)
            await asyncio.sleep(0.3)
            assert not kicks and not sup.statuses(time.monotonic())[0].hung

            t0 = time.monotonic()
            os.kill(w.pid, signal.SIGSTOP)
            while not kicks:
                assert time.monotonic() - t0 < 5.0, "the stop was never timed"
                await asyncio.sleep(0.005)
            took = kicks[0] - t0
            assert hang.STOPPED_AFTER_MS / 1000.0 <= took < 1.0, took
            (st,) = sup.statuses(time.monotonic())
            assert st.hung and st.phase == "stopped"
            assert st.hang_threshold_ms == hang.STOPPED_AFTER_MS

            since = w.stopped_since
            os.kill(w.pid, signal.SIGCONT)  # a dump's moment of running...
            os.kill(w.pid, signal.SIGSTOP)  # ...and stopped again
            await asyncio.sleep(0.2)
            assert w.stopped_since == since and len(kicks) == 1
            assert sup.statuses(time.monotonic())[0].hung

            os.kill(w.pid, signal.SIGCONT)  # running for good: the stop is over
            await asyncio.sleep(0.2)
            assert w.stopped_since is None and not sup.statuses(time.monotonic())[0].hung
        finally:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
            await sup.close(grace_s=1.0)

    asyncio.run(run())
