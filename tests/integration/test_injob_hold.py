"""A worker the agent cannot hold is dumped, then killed: the fallback says where it was stuck.

A real agent `Supervisor` and `HookServer` start a worker that says hello through the SDK
(`hookchannel.install`: its reply socket and its faulthandler stack signal) and then never
reads a command, as a rank stuck in its teardown would be (seen once on an H200: the
survivor of a peer's crash stopped after its flash ring closed, and the agent's hold ran out).
`injob.hold` must not wait past its limit, must say which rank it could not hold, must log
that rank's Python stacks before it kills it, and must kill it.

A rank the driver names as faulty is killed and not waited for: the hold answers while the
killed process still tears down its memory, and the rank's replacement starts only once it
has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from unbroken.agent import injob, procexit
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor, Worker

pytestmark = pytest.mark.integration

STUCK = """
import time
from unbroken.trainer import hookchannel

h = hookchannel.install()
h.phase("checkpoint")  # a teardown's phase, never "held"
print("ready", flush=True)

def stuck_in_teardown():
    while True:
        time.sleep(0.05)

stuck_in_teardown()
"""


@contextlib.asynccontextmanager
async def _agent(
    tmp_path: Path, code: str, **spec: Any
) -> AsyncIterator[tuple[Supervisor, HookServer]]:
    """A real Supervisor and HookServer running `code` as local rank 0's worker."""
    ws = WorkerSpec(cmd=[sys.executable, "-c", code], nproc=1, log_dir=str(tmp_path), **spec)
    sock = str(tmp_path / "agent.sock")
    sup = Supervisor(ws, sock)
    server = HookServer(sock, sup, node_id="n0")
    await server.start()
    try:
        yield sup, server
    finally:
        await sup.close(grace_s=1.0)
        server.close()


async def _said_hello(w: Worker, ready: Callable[[Worker], bool]) -> None:
    """Until `w` said hello through the SDK as `ready` wants it."""
    deadline = time.monotonic() + 60
    while not ready(w):
        assert time.monotonic() < deadline, "the worker never said hello"
        assert w.proc is not None and w.proc.returncode is None, "the worker died"
        await asyncio.sleep(0.05)


def test_a_worker_not_held_in_time_has_its_stacks_logged_and_is_killed(tmp_path: Path) -> None:
    async def run() -> tuple[str, float, int | None, list[dict[str, object]]]:
        async with _agent(tmp_path, STUCK, warm=False) as (sup, server):
            w = await sup.start(0, refill=False)
            await _said_hello(
                w, lambda w: bool(w.reply_socket and w.stack_signal and w.phase == "checkpoint")
            )
            with structlog.testing.capture_logs() as logs:
                t0 = time.monotonic()
                said = await injob.hold(sup, server, replace=(), timeout_s=1.0)
                took = time.monotonic() - t0
            assert w.proc is not None
            code = await asyncio.wait_for(procexit.exit_code(w.proc), 10.0)  # killed, not reaped
            return said, took, code, logs

    said, took, code, logs = asyncio.run(run())
    assert "stopped [0]" in said and "held local ranks []" in said, said
    assert took < 1.0 + injob.STACKS_TIMEOUT_S + 5.0 + 1.0, took  # the limit, the dump, the kill
    assert code == -9  # SIGKILLed
    (late,) = [e for e in logs if "not held in time" in str(e.get("event"))]
    assert late["local_ranks"] == [0]
    stacks = str(late["stacks"])
    assert "--- local rank 0 ---" in stacks and "stuck_in_teardown" in stacks, stacks
    (summary,) = [e for e in logs if e.get("event") == "in-job hold"]
    assert summary["not_held_in_time"] == [0]


BIG = """
import time
from unbroken.trainer import hookchannel

ballast = bytearray(1 << 30)  # touched: 1 GiB for the kernel to free at the exit
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
h = hookchannel.install()
h.phase("train")
while True:
    time.sleep(0.05)
"""


def test_a_faulty_rank_is_killed_without_waiting_for_its_exit_and_replaced_after_it(
    tmp_path: Path,
) -> None:
    async def run() -> tuple[str, int | None, int, int | None, int]:
        async with _agent(tmp_path, BIG, warm=False, nice=19) as (sup, server):
            old = await sup.start(0, refill=False)
            await _said_hello(old, lambda w: w.phase == "train")
            said = await injob.hold(sup, server, replace=(0,))
            assert old.proc is not None
            at_answer = old.proc.returncode  # the 1 GiB teardown at nice 19 is still running
            await injob.rejoin(sup, server)
            new = sup.workers[0]
            assert new is not old and new.proc is not None
            return said, at_answer, old.proc.returncode, new.proc.returncode, new.pid

    said, at_answer, code, new_code, new_pid = asyncio.run(run())
    assert "stopped [0]" in said, said
    assert at_answer is None, "the hold waited for the killed worker's exit"
    assert code == -9, "the replacement started before the killed worker had exited"
    assert new_code is None and new_pid > 0


TIMED = """
import time
from unbroken.trainer import hookchannel

h = hookchannel.install()
h.coalesce_s = 0.0  # one report per step
h.phase("train")
for step in range(1, 41):
    h.step(step, loss=2.0, step_time_ms=12.0, compute=9.0, collective_wait=3.0)
    time.sleep(0.01)  # the SDK drops a report the agent's socket has no room for
h.phase("held")  # as the in-job hold leaves it: at a step boundary, out of its world
while True:
    h.commands()
    time.sleep(0.02)
"""


def test_a_rejoined_worker_starts_a_new_timing_window_and_generation(tmp_path: Path) -> None:
    """A rank that rejoins a new world in its process takes a new place (another stage, other
    peers): its step timings of the old place must not be judged against the new one's role,
    so its window starts empty (and its node's timing generation changes with `rejoins`:
    tests/unit/test_straggler.py)."""
    from unbroken.common.timing import node_timing

    async def run() -> tuple[int, int, int, bool]:
        async with _agent(tmp_path, TIMED, warm=False) as (sup, server):
            w = await sup.start(0, refill=False)
            await _said_hello(w, lambda w: w.phase == injob.HELD_PHASE and w.step == 40)
            before = node_timing([w.status(time.monotonic())])
            assert before is not None and before.window_steps > 10
            said = await injob.rejoin(sup, server)
            assert "rejoined local ranks [0]" in said, said
            assert sup.workers[0] is w, "the held worker was replaced, not rejoined"
            after = node_timing([w.status(time.monotonic())])
            return len(w.compute_times), len(w.wait_times), w.rejoins, after is None

    computes, waits, rejoins, no_window = asyncio.run(run())
    assert (computes, waits, rejoins) == (0, 0, 1)
    assert no_window, "the node's summary still carried the old world's window"
