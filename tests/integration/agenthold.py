"""A real agent's in-job hold of one worker it runs (tests/integration/test_gloo_guard.py,
test_stepthread.py): a `Supervisor` and `HookServer` start the worker, wait until it says
`phase`, let the test act on it (`before`), then hold it and time the hold."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from unbroken.agent import injob
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor, Worker


async def hold_worker(
    tmp_path: Path,
    cmd: list[str],
    limit_s: float,
    phase: str,
    before: Callable[[Worker], Awaitable[None]],
) -> tuple[str, float, list[dict[str, object]]]:
    """What the hold said, how long it took and the agent's log lines meanwhile."""
    spec = WorkerSpec(
        cmd=cmd, nproc=1, log_dir=str(tmp_path), warm=False, extra_env={"OMP_NUM_THREADS": "1"}
    )
    sock = str(tmp_path / "agent.sock")
    sup = Supervisor(spec, sock)
    server = HookServer(sock, sup, node_id="n0")
    await server.start()
    try:
        w = await sup.start(0, refill=False)
        deadline = time.monotonic() + 90
        while not (w.reply_socket and w.phase == phase):
            assert time.monotonic() < deadline, f"the worker never said {phase!r}"
            assert w.proc is not None and w.proc.returncode is None, "the worker died"
            await asyncio.sleep(0.05)
        await before(w)
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            said = await injob.hold(sup, server, replace=(), timeout_s=limit_s)
            took = time.monotonic() - t0
        return said, took, logs
    finally:
        await sup.close(grace_s=1.0)
        server.close()
