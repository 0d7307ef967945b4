"""One chaos run: start the cluster, inject a seeded plan, check every pass criterion.

`run_chaos` never returns with a process of the run alive, and raises `ChaosError` with
the seed, the replay command, what was injected, every problem found and the logs' tails
when any criterion fails. A JSON report lands in `<tmp>/report.json` either way.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from tests.chaos import checks
from tests.chaos.driverprobe import read_acks, read_states
from tests.chaos.faults import ETCD_STOP_S, KINDS, Injector, plan
from tests.chaos.harness import ChaosCluster, ChaosError
from unbroken.cli.cluster import until

REFERENCE_TIMEOUT_S = 300.0
LEFTOVER_GRACE_S = 15.0
STATUS_TRIES = 20


def replay_hint(seed: int, test: str) -> str:
    return f"replay: .venv/bin/python -m pytest tests/chaos -k '{test}' --chaos-seed {seed}"


def run_chaos(
    tmp: Path,
    seed: int,
    n_faults: int,
    *,
    kinds: tuple[str, ...] = KINDS,
    test: str = "",
    settle_timeout_s: float = 900.0,
    stall_s: float = 180.0,
    etcd_stop_s: float = ETCD_STOP_S,
) -> dict[str, Any]:
    """Run one seeded chaos experiment in `tmp`; return its report (raise on failure)."""
    faults = plan(seed, n_faults, kinds, etcd_stop_s=etcd_stop_s)
    print(f"chaos seed {seed}: {', '.join(f.describe() for f in faults)}", flush=True)
    c = ChaosCluster(tmp)
    inj = Injector(c, settle_timeout_s, stall_s)
    problems: list[str] = []
    report: dict[str, Any] = {"seed": seed, "faults": [f.describe() for f in faults]}
    error: BaseException | None = None
    t0 = time.monotonic()
    try:
        try:
            c.start()
            report["start_s"] = round(time.monotonic() - t0, 1)
            inj.run(faults)
            problems += _check_live(c)
            last = c.max_step()
            until(
                lambda: max(c.steps(c.ref_metrics), default=0) >= last,
                REFERENCE_TIMEOUT_S,
                f"the reference run to reach step {last}",
                poll_s=0.5,
            )
        except Exception as e:  # the cluster is stopped and the seed reported below
            error = e
        logs = c.logs() if error is not None or problems else ""
    finally:  # also on a pytest timeout or Ctrl-C: nothing of the run survives it
        inj.faults.close()
        c.stop()
        problems += _leftovers(c)
    if error is None:
        loss_problems, compared = checks.check_losses(
            c.steps(), c.steps(c.ref_metrics), c.final_events
        )
        problems += loss_problems
        report["losses_compared"] = compared
        report["events"] = len(c.final_events)
    report["injected"] = [
        {**asdict(r), "fault": r.fault.describe(), "took_s": round(r.took_s, 1)} for r in inj.done
    ]
    report["max_step"] = c.max_step()
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["problems"] = problems
    report["error"] = repr(error) if error else ""
    (tmp / "report.json").write_text(json.dumps(report, indent=1))
    if error is not None or problems:
        lines = [
            f"chaos seed {seed} FAILED ({replay_hint(seed, test or 'chaos')})",
            *(
                f"  injected: {i['fault']} on {i['target']} at step {i['step']}:{i['note']}"
                for i in report["injected"]
            ),
            *(f"  problem: {p}" for p in problems),
        ]
        if error is not None:
            lines.append(f"  error: {error}")
        lines.append(logs)
        raise ChaosError("\n".join(lines)) from error
    print(f"chaos seed {seed} passed: {json.dumps(report)}", flush=True)
    return report


def _check_live(c: ChaosCluster) -> list[str]:
    """Criteria 1-3 on the running cluster (the leader must answer)."""
    assert c.reader is not None
    st = nodes = None
    events: list[Any] | None = None
    acks: list[tuple[int, str, str]] = []
    states: list[bytes] = []
    for _ in range(STATUS_TRIES):
        first = c.status()
        if first is None:
            time.sleep(0.5)
            continue
        slot, st = first
        nodes = c.list_nodes(slot)
        again = c.status()
        # what was acknowledged BEFORE the log is read must be in what is read (the job
        # keeps committing checkpoints: acks read after the log raced with new appends)
        acks = read_acks(str(c.records))
        states = read_states(str(c.records))
        events = c.reader.read()
        if nodes is not None and again is not None and again[1].last_seq == st.last_seq:
            break
        st = None
        time.sleep(0.2)
    if st is None or nodes is None or events is None:
        return ["the leader never gave a consistent GetStatus/ListNodes pair"]
    out = checks.check_log(events, acks)
    out += checks.check_loop_states(c.job, events, states)
    out += checks.check_status(c.job, events, st, nodes)
    c.final_events = events
    print(
        f"log: {len(events)} events, {len(acks)} acknowledged appends, "
        f"{len(states)} loop states checked",
        flush=True,
    )
    return out


def _leftovers(c: ChaosCluster) -> list[str]:
    """Processes of the run still alive after stop (then killed, so none leaks)."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = c.leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = c.leftovers()
    out = []
    for p in left:
        try:
            out.append(f"process left behind: pid {p.pid} {' '.join(p.cmdline())[:160]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return out
