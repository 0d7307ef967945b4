"""The agent loop's lag while warm standbys import torch beside it: normal vs SCHED_RR.

A child process runs what the agent's loop runs for this (agent/starvation.py `LoopLag`,
a wake-up every 10 ms, its largest lateness taken every 100 ms) and starts `--standbys`
warm standbys (agent/warm.py, at nice 5, in its own session as the agent's are) that import
torch, until they are ready or `--seconds` passed. Each variant alternates `--reps` times:
`normal` (the loop as a normal task) and `realtime` (`starvation.realtime_loop`, as
`unbroken agent` runs it). Writes bench/results/agent_loop_lag.json with the load average:
per run the largest lag, its p99 and p90, and the probe's own run-queue delay in the
worst 100 ms (equal to the lag: it waited for a CPU, not for a lock).

`make bench-agent_loop_lag` (ARGS="--reps 3 --seconds 25").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "agent_loop_lag.json"

PROBE = r"""
import asyncio, json, os, sys, time
from unbroken.agent import starvation, warm
from unbroken.agent.launch import exec_wrapper

def rundelay():
    tot = 0
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/schedstat") as f:
            tot += int(f.read().split()[1])
    return tot / 1e6

async def main(rt, n, seconds):
    why = starvation.realtime_loop() if rt else "off"
    lag = starvation.LoopLag(0.01); lag.start()
    samples = []
    async def sampler():
        last = rundelay()
        while True:
            await asyncio.sleep(0.1)
            d = rundelay()
            samples.append((lag.take(), d - last)); last = d
    task = asyncio.create_task(sampler())
    target = warm.parse_target([sys.executable, "-m", "unbroken.trainer.run"])
    t0 = time.monotonic()
    sbs = [await warm.spawn_standby(target, dict(os.environ),
           wrapper=exec_wrapper(nice=5, die_with_agent=True), preload=warm.DEFAULT_PRELOAD)
           for _ in range(n)]
    while time.monotonic() - t0 < seconds and not all(s.ready for s in sbs):
        await asyncio.sleep(0.1)
    task.cancel()
    for s in sbs:
        await s.kill()
    lags = sorted(x[0] for x in samples)
    worst = max(samples)
    print(json.dumps({"realtime": rt and not why, "why_not": why if rt else "",
        "seconds": round(time.monotonic() - t0, 1), "ready": all(s.ready for s in sbs),
        "max_lag_ms": round(worst[0], 1), "rundelay_in_worst_ms": round(worst[1], 1),
        "p99_lag_ms": round(lags[int(len(lags) * 0.99)], 1),
        "p90_lag_ms": round(lags[int(len(lags) * 0.9)], 1), "load1": os.getloadavg()[0]}))

asyncio.run(main(sys.argv[1] == "realtime", int(sys.argv[2]), float(sys.argv[3])))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--standbys", type=int, default=2)
    ns = ap.parse_args()
    runs: dict[str, list[dict[str, object]]] = {"normal": [], "realtime": []}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(ns.reps):
        for variant in ("normal", "realtime"):
            out = subprocess.run(
                [sys.executable, "-c", PROBE, variant, str(ns.standbys), str(ns.seconds)],
                capture_output=True, text=True, check=True, env=env, start_new_session=True,
            )  # fmt: skip
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(variant, runs[variant][-1], flush=True)
    summary = {
        v: {
            "max_lag_ms_median": statistics.median(float(r["max_lag_ms"]) for r in rs),  # type: ignore[arg-type]
            "p99_lag_ms_median": statistics.median(float(r["p99_lag_ms"]) for r in rs),  # type: ignore[arg-type]
        }
        for v, rs in runs.items()
    }
    result = {"cores": os.cpu_count(), "standbys": ns.standbys, "runs": runs, "summary": summary}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
