"""Run a diagnostic check as a subprocess and capture its one-line JSON result.

The driver's RunCheck command carries a JSON spec; the agent runs
`python -m unbroken.diagnostics.check --spec '<json>'` (the diagnostics package owns the
check itself) with the agent's injected fault added to the spec as "fault", and returns
the last stdout line that parses as JSON. A timeout kills the check. Checks run at a
lower CPU priority than the agent and die with it (see `workers.exec_wrapper`).
"""

from __future__ import annotations

import asyncio
import json
import sys

from unbroken.agent.workers import exec_wrapper
from unbroken.proto import driver_pb2 as dpb

CHECK_MODULE = "unbroken.diagnostics.check"


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


async def run_check(
    command_id: str, spec_json: str, fault: str, timeout_s: float, module: str = CHECK_MODULE
) -> dpb.CheckResult:
    """Run one check; the result carries its JSON line, exit code and stderr tail."""
    res = dpb.CheckResult(command_id=command_id)
    try:
        spec = build_spec(spec_json, fault)
    except ValueError as e:
        res.exit_code = 2
        res.stderr_tail = str(e)
        return res
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
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s if timeout_s > 0 else 300)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        res.exit_code = -9
        res.stderr_tail = f"check timed out after {timeout_s} s; " + err.decode()[-2000:]
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
