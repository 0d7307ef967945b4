"""A worker's death is seen when it happens, even while a child it left holds its pipes.

A real agent `Supervisor` starts a worker that leaves a background child (as a data loader's
workers, a compile pool or a helper daemon would) holding its stdout and stderr, then exits
with 3. asyncio's `Process.wait` returns only once those pipes close (here 60 s later); the
agent reports the failure at once all the same (agent/procexit.py), with the worker's last
line read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.integration


def test_a_worker_whose_child_holds_its_pipes_is_reported_when_it_exits(tmp_path: Path) -> None:
    script = "sleep 60 & echo 'RuntimeError: the last words'; exit 3"

    left: list[object] = []

    async def run() -> tuple[int, int | None, str]:
        spec = WorkerSpec(cmd=["sh", "-c", script], nproc=1, log_dir=str(tmp_path), warm=False)
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        failed = asyncio.Event()
        sup.on_failure = failed.set
        w = await sup.start(0, refill=False)
        try:
            await asyncio.wait_for(failed.wait(), 20)  # the child lives 60 s
            alerts = " ".join(a.line for a in sup.take_alerts())
            return w.state, w.exit_code, alerts
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.pid, signal.SIGKILL)  # the child, in the worker's group
            await sup.close(grace_s=1.0)
            # nothing of the dead worker's is left to the loop's end: its reaper, still
            # waiting for the pipes, used to be cancelled there with them open, and their
            # finalizer raised later ("Event loop is closed") wherever the collector ran
            left.extend(t for t in w.tasks if not t.done())
            # (the process's transport: asyncio gives a Process no public look at its pipes)
            left.extend([] if w.proc._transport.is_closing() else ["the pipes are open"])  # type: ignore[union-attr]

    state, code, alerts = asyncio.run(run())
    assert state == dpb.WORKER_STATE_EXITED and code == 3
    assert "the last words" in alerts
    assert not left, left
