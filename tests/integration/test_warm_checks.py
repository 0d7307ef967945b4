"""The agent's warm check process: torch imported ahead, the spec sent on stdin.

A real `python -m unbroken.diagnostics.check --warm` process (one-member group check on
CPU): the check it runs gives the same kind of result line a cold `--spec` process gives,
the agent's fault reaches it through the spec, the next check finds a new warm process,
and one that crashed before it was ready is replaced by a cold start, never used. The node
self-checks run in the same warm process (an on-demand RunSelfCheck found a silently bad
node 4-5 s late on a loaded machine: torch's import) and report what a cold one reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from unbroken.agent.checks import WarmCheck, run_check, run_selfcheck
from unbroken.common.autogroup import nice as autogroup_nice
from unbroken.diagnostics.check import free_port

pytestmark = pytest.mark.integration

WAITING_NICE = 5  # WarmCheck's default `nice`: a waiting process at it is not lowered further


def _spec(check_id: str) -> str:
    return json.dumps(
        {
            "check_id": check_id, "node_id": "n0", "group": ["n0"], "rank": 0,
            "store_host": "127.0.0.1", "store_port": free_port(), "timeout_s": 60,
            "matmul_n": 64, "matmul_iters": 2, "allgather_numel": 1024, "allgather_iters": 1,
            "device": "cpu",
        }
    )  # fmt: skip


async def _ready(warm: WarmCheck, timeout_s: float = 300.0) -> None:
    """Until the warm process said it is ready (or gave up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while warm._ready is None or not warm._ready.done():
        assert loop.time() < deadline, "the warm check process was not ready in time"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _warm() -> AsyncIterator[WarmCheck]:
    """A warm check process, ready; closed after. It waits at the niceness a taken check has
    (the idle-priority wait is the last test's business): at nice 19 beside two CPU hogs
    (`stress-ng -c 2` on 2 cores) its torch import got ~1.5 % of a core, and the first test
    below took 255 s of its 300."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warm = WarmCheck(wait_nice=WAITING_NICE)
    try:
        warm.refill()
        await _ready(warm)
        yield warm
    finally:
        await warm.close()


def test_checks_run_warm_and_a_broken_warm_process_falls_back_to_cold(tmp_path: Path) -> None:
    async def go() -> None:
        async with _warm() as warm:
            res = await run_check("c1", _spec("w1"), "", 60, warm=warm)
            assert warm.taken == 1, res
            assert res.exit_code == 0, res.stderr_tail
            line = json.loads(res.result_json)
            assert line["ok"] and line["check_id"] == "w1" and line["matmul_ms"] > 0, line

            # the next check finds the process started after the first: the agent's fault
            # (a check-level one) reaches it through the spec
            await _ready(warm)
            res = await run_check("c2", _spec("w2"), "wrong_matmul", 60, warm=warm)
            assert warm.taken == 2, res
            line = json.loads(res.result_json)
            assert not line["ok"] and line["failure"] == "matmul", line

            # a warm process that died before it was ready is never handed out: cold start
            await _ready(warm)
            broken = WarmCheck(module="unbroken.no_such_module", wait_nice=WAITING_NICE)
            broken.refill()
            await _ready(broken)
            assert await broken.take() is None and broken.taken == 0
            res = await run_check("c3", _spec("w3"), "", 60, module="unbroken.diagnostics.check")
            assert res.exit_code == 0 and json.loads(res.result_json)["ok"], res.stderr_tail

    asyncio.run(go())


def test_self_checks_run_in_the_warm_process_and_report_as_a_cold_one(tmp_path: Path) -> None:
    async def go() -> None:
        async with _warm() as warm:
            bad = await run_selfcheck("n0", "wrong_matmul", 60, disk_path=str(tmp_path), warm=warm)
            assert warm.taken == 1
            assert not bad.ok and any("matmul" in f for f in bad.failures), bad
            cold = await run_selfcheck("n0", "wrong_matmul", 60, disk_path=str(tmp_path))
            assert warm.taken == 1 and not cold.ok
            assert sorted(cold.failures) == sorted(bad.failures), (cold, bad)
            assert json.loads(bad.details_json) and bad.command_id == ""

            warm.refill()
            await _ready(warm)
            good = await run_selfcheck("n0", "", 60, disk_path=str(tmp_path), warm=warm)
            assert warm.taken == 2
            # the free-disk floor (10 GB) may fail on a small test disk: only the matmul
            # and the device checks are this test's business
            assert not any("matmul" in f for f in good.failures), good

    asyncio.run(go())


def _nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


@pytest.mark.timeout(600)  # its import at nice 19 took 88 s beside two CPU hogs
def test_a_warm_check_waits_at_idle_priority_and_runs_at_the_checks() -> None:
    """Its torch import takes idle CPU only (the node's workers start beside it); taken, it
    has the niceness a cold check would have had."""

    async def go() -> tuple[int, int, int, dict[str, Any]]:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        warm = WarmCheck(nice=5, wait_nice=19)
        if warm.wait_nice == warm.nice:
            pytest.skip("this process may not lower a child's niceness again")
        group: dict[str, Any] = {"own": warm._own_group}
        try:
            warm.refill()
            await _ready(warm)
            assert warm._proc is not None
            waiting = _nice_of(warm._proc.pid)
            group["sid"] = os.getsid(warm._proc.pid) == warm._proc.pid
            group["waiting"] = autogroup_nice(warm._proc.pid)
            proc = await warm.take()
            assert proc is not None
            taken = _nice_of(proc.pid)
            group["taken"] = autogroup_nice(proc.pid)
            proc.kill()
            await proc.wait()
            return waiting, taken, os.getpriority(os.PRIO_PROCESS, 0), group
        finally:
            await warm.close()

    waiting, taken, ours, group = asyncio.run(go())
    assert waiting == 19
    assert taken == min(19, ours + 5)
    # where autogroups exist and can be given back: it waits in a session of its own, its
    # autogroup nice 19 (the niceness alone bought nothing outside the agent's session)
    if group["own"]:
        assert group["sid"] is True
        assert (group["waiting"], group["taken"]) == (19, autogroup_nice())
