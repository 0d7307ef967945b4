"""Run a diagnostic check or the self-checks as a subprocess; capture the JSON result.

The driver's RunCheck command carries a JSON spec; the agent runs
`python -m unbroken.diagnostics.check --spec '<json>'` (the diagnostics package owns the
check itself) with the agent's injected fault added to the spec as "fault", and returns
the last stdout line that parses as JSON. A timeout kills the check. Checks run at a
lower CPU priority than the agent and die with it (see `launch.exec_wrapper`).

The node self-checks (`python -m unbroken.diagnostics.selfcheck`) run the same way, so the
agent never imports torch: a self-check that crashes, prints nothing or times out is
reported as failed with the reason, never as an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

from unbroken.agent import warm as warmlib
from unbroken.agent.launch import exec_wrapper
from unbroken.common import aio, autogroup
from unbroken.diagnostics.check import WARM_READY, WARM_SELFCHECK_KEY
from unbroken.proto import driver_pb2 as dpb

CHECK_MODULE = "unbroken.diagnostics.check"
SELFCHECK_MODULE = "unbroken.diagnostics.selfcheck"


def build_spec(spec_json: str, fault: str) -> str:
    """The spec with the agent's fault added (ValueError when it is not a JSON object)."""
    try:
        spec = json.loads(spec_json) if spec_json else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"check spec is not valid JSON: {e}") from e
    if not isinstance(spec, dict):
        raise ValueError("check spec must be a JSON object")
    if fault and "fault" not in spec:
        spec["fault"] = fault
    return json.dumps(spec)


class WarmCheck:
    """One check process that has imported torch and waits for its spec on stdin
    (`python -m unbroken.diagnostics.check --warm`), so a diagnosis round does not pay
    torch's import (seconds) on every node. `take()` hands it over when it is ready;
    `refill()` starts the next one in the background (after the self-check, after each
    check). It runs below the agent's priority and dies with the agent, like a check.

    It waits at `wait_nice` (19: idle CPU only) where the agent may give it back the
    check's `nice` when it is taken, as a warm standby does (agent/warm.py): the refill
    after the registration self-check imports torch while the node's workers start, and
    the one after a failed self-check while the job restores around the evicted node."""

    def __init__(self, module: str = CHECK_MODULE, nice: int = 5, wait_nice: int = 19) -> None:
        self.module = module
        self.nice = nice
        # absolute niceness of a taken check (`nice -n` adds to the agent's own)
        self._target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        low = wait_nice > nice and warmlib.may_raise_priority(self._target)
        self.wait_nice = wait_nice if low else nice
        # It waits in a session of its own whose autogroup is nice `wait_nice` too: in the
        # agent's session its niceness bought no idle-only CPU, and its torch import took
        # 0.35 s of CPU during a 0.65 s first step after a worker crash (`make run`, a
        # /proc sampler, 2026-12-07). Only where the autogroup can be given back its
        # niceness when the check is taken (`_group_back`).
        self._group_back = autogroup.nice()
        self._own_group = (
            low and self._group_back is not None and warmlib.may_raise_priority(self._group_back)
        )
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Task[bool] | None = None
        self.taken = 0  # checks that ran warm

    def refill(self) -> None:
        """Start a warm process unless one is starting or waiting."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._spawn())

    async def _spawn(self) -> bool:
        proc = await asyncio.create_subprocess_exec(
            *exec_wrapper(nice=self.wait_nice, die_with_agent=True),
            sys.executable,
            "-m",
            self.module,
            "--warm",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=self._own_group,
        )
        if self._own_group:
            autogroup.set_nice(proc.pid, self.wait_nice)
        self._proc = proc
        assert proc.stdout is not None
        line = await proc.stdout.readline()  # EOF (a crash) reads b""
        return line.decode("utf-8", "replace").strip() == WARM_READY

    async def take(self, wait_s: float = 60.0) -> asyncio.subprocess.Process | None:
        """The warm process once it is ready (the caller owns it now), or None (none was
        started, it crashed, or it was not ready within `wait_s`: the caller starts a cold
        one). One still importing torch is waited for: it started before any cold one
        could, so it is ready first."""
        ready = self._ready
        if ready is None:
            return None
        if self._proc is not None and self.wait_nice != self.nice:
            self._give_back(self._proc.pid)  # the check's own priority
        with contextlib.suppress(Exception):
            await aio.wait_for(asyncio.shield(ready), wait_s)
        proc = self._proc
        if not ready.done() or proc is None:
            return None
        self._ready, self._proc = None, None
        if ready.cancelled() or ready.exception() is not None or not ready.result():
            await aio.reap(proc)
            return None
        if self.wait_nice != self.nice:  # (again: it may have started after the first)
            self._give_back(proc.pid)
        self.taken += 1
        return proc

    def _give_back(self, pid: int) -> None:
        """The taken check's priority: the check's niceness, and its session's autogroup
        the agent's own niceness."""
        warmlib.renice_process(pid, self._target)
        if self._own_group and self._group_back is not None:
            autogroup.set_nice(pid, self._group_back)

    async def close(self) -> None:
        if self._ready is not None:
            self._ready.cancel()
        proc, self._proc, self._ready = self._proc, None, None
        if proc is not None:
            await aio.reap(proc)


async def run_check(
    command_id: str,
    spec_json: str,
    fault: str,
    timeout_s: float,
    module: str = CHECK_MODULE,
    warm: WarmCheck | None = None,
) -> dpb.CheckResult:
    """Run one check (in the warm process when one is ready); the result carries its JSON
    line, exit code and stderr tail."""
    res = dpb.CheckResult(command_id=command_id)
    try:
        spec = build_spec(spec_json, fault)
    except ValueError as e:
        res.exit_code = 2
        res.stderr_tail = str(e)
        return res
    proc = await warm.take(timeout_s / 2 if timeout_s > 0 else 60.0) if warm is not None else None
    stdin: bytes | None = None
    if proc is not None:
        stdin = spec.encode() + b"\n"
    else:
        proc = await asyncio.create_subprocess_exec(
            # below the agent's priority, and killed with it, like a worker
            *exec_wrapper(nice=5, die_with_agent=True),
            sys.executable,
            "-m",
            module,
            "--spec",
            spec,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    if warm is not None:
        warm.refill()  # the next check of this diagnosis runs warm
    try:
        out, err = await aio.communicate(proc, stdin, timeout_s if timeout_s > 0 else 300)
    except TimeoutError:  # (killed and reaped: its output up to now is lost with it)
        res.exit_code = -9
        res.stderr_tail = f"check timed out after {timeout_s} s"
        return res
    res.exit_code = proc.returncode if proc.returncode is not None else -1
    res.stderr_tail = err.decode("utf-8", "replace")[-4000:]
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        try:
            json.loads(line)
        except ValueError:
            continue
        res.result_json = line
        break
    return res


async def run_selfcheck(
    node_id: str,
    fault: str,
    timeout_s: float,
    *,
    command_id: str = "",
    disk_path: str = "/",
    nice: int = 5,
    module: str = SELFCHECK_MODULE,
    warm: WarmCheck | None = None,
) -> dpb.SelfCheckReport:
    """Run the self-checks as a child process (nice, killed with the agent, with a deadline):
    in the warm check process when one is ready (torch already imported), else a cold one.

    Args:
        node_id: this node's id (in the report).
        fault: the agent's simulated fault spec (a wrong_matmul node fails its matmul).
        timeout_s: deadline; the child is killed after it.
        command_id: the RunSelfCheck's id ("" at registration).
        disk_path: where checkpoints are persisted (free-space check).
        nice: niceness added for the child.
        module: the module a cold start runs with ``python -m`` (tests swap it).
        warm: the node's warm check process; taken when ready (a diagnosis's checks and
            self-checks share it), refilled after.

    Returns:
        The report; a crash, a timeout or unreadable output is ok=false with the reason.
    """
    rep = dpb.SelfCheckReport(command_id=command_id)
    args = ["--node-id", node_id, "--disk-path", disk_path]
    if fault:
        args += ["--fault", fault]
    # a warm process still importing is waited for (it started first), but not for long:
    # the cold start must still fit the deadline
    proc = await warm.take(min(10.0, timeout_s / 4)) if warm is not None else None
    stdin: bytes | None = None
    if proc is not None:
        stdin = json.dumps({WARM_SELFCHECK_KEY: args}).encode() + b"\n"
    else:
        proc = await asyncio.create_subprocess_exec(
            *exec_wrapper(nice=nice, die_with_agent=True),
            sys.executable,
            "-m",
            module,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    try:
        out, err = await aio.communicate(proc, stdin, timeout_s)
    except TimeoutError:
        rep.failures.append(f"selfcheck: timed out after {timeout_s:g} s")
        return rep
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "ok" in data:
            rep.ok = bool(data["ok"])
            rep.failures.extend(str(f) for f in data.get("failures", []))
            rep.details_json = json.dumps(data.get("items", []))
            return rep
    tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
    rep.failures.append(
        f"selfcheck: exited with {proc.returncode} and no report ({' | '.join(tail)[-500:]})"
    )
    return rep
