"""Run a diagnostic check or the self-checks as a subprocess; capture the JSON result.

The driver's RunCheck command carries a JSON spec; the agent runs
`python -m unbroken.diagnostics.check --spec '<json>'` (the diagnostics package owns the
check itself) with the agent's injected fault added to the spec as "fault", and returns
the last stdout line that parses as JSON. A timeout kills the check. Checks run at a
lower CPU priority than the agent and die with it (see `workers.exec_wrapper`).

The node self-checks (`python -m unbroken.diagnostics.selfcheck`) run the same way, so the
agent never imports torch: a self-check that crashes, prints nothing or times out is
reported as failed with the reason, never as an exception.
"""

from __future__ import annotations

import asyncio
import json
import sys

from unbroken.agent.workers import exec_wrapper
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


async def run_selfcheck(
    node_id: str,
    fault: str,
    timeout_s: float,
    *,
    command_id: str = "",
    disk_path: str = "/",
    nice: int = 5,
    module: str = SELFCHECK_MODULE,
) -> dpb.SelfCheckReport:
    """Run the self-checks as a child process (nice, killed with the agent, with a deadline).

    Args:
        node_id: this node's id (in the report).
        fault: the agent's simulated fault spec (a wrong_matmul node fails its matmul).
        timeout_s: deadline; the child is killed after it.
        command_id: the RunSelfCheck's id ("" at registration).
        disk_path: where checkpoints are persisted (free-space check).
        nice: niceness added for the child.
        module: the module run with ``python -m`` (tests swap it).

    Returns:
        The report; a crash, a timeout or unreadable output is ok=false with the reason.
    """
    rep = dpb.SelfCheckReport(command_id=command_id)
    args = ["--node-id", node_id, "--disk-path", disk_path]
    if fault:
        args += ["--fault", fault]
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
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.communicate()
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
