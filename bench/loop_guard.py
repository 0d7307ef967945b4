"""The agent loop's lag while a nice-19 thread of its process holds the GIL on busy cores.

The agent's loop runs at SCHED_RR, but its background threads (the persister at nice 19,
the flash thread) take the GIL now and then, and one preempted while it holds it keeps the
loop waiting (agent/loopguard.py). A child process runs what the agent runs for this: its
loop at SCHED_RR (`starvation.realtime_loop`) with `LoopLag` (a wake-up every 20 ms, its
largest lateness taken every 100 ms), and a thread at nice 19 that holds the GIL as often as
pure Python does (the worst case of the persister's Python between its writes), beside
`cores + 2` busy normal processes in its session (Linux's autogroup shares the CPU among
sessions first, and an agent's workers run in its session). Three variants alternate
`--reps` times, in one run:

- `none`: nothing lifts the thread (the loop waits until the scheduler runs it);
- `in_loop`: `GilBoost` fed by the loop's own lag, as the agent did before the guard (it
  lifts the thread, but only once the loop holds the GIL again, after the late heartbeat);
- `guard`: the loop guard's process (`LoopGuard`), as `unbroken agent` runs it now.

Writes bench/results/loop_guard.json (per run the largest lag, its p99 and p50, and the
boosts; medians per variant; the ratios guard / in_loop) with the load average. The
driver declares a node lost after 300 ms of silence (3 heartbeats), less what its
starvation grace adds: a loop lag near that is a false NodeLost.

`make bench-loop_guard` (ARGS="--reps 3 --seconds 20").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "loop_guard.json"

PROBE = r"""
import asyncio, json, os, subprocess, sys, threading, time
from unbroken.agent import loopguard, starvation

variant, seconds = sys.argv[1], float(sys.argv[2])
why = starvation.realtime_loop()
if why:
    print(json.dumps({"skip": why})); raise SystemExit

def busy():
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    x = 0
    while True:
        for i in range(10000):
            x += i * i

async def main():
    # the busy workers: children in the agent's session (its autogroup), as its workers are
    hog = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(hog) for _ in range(int(sys.argv[3]))]
    lag = starvation.LoopLag(0.02)
    guard = loopguard.LoopGuard.start(lag.period_s) if variant == "guard" else None
    boost = loopguard.GilBoost() if variant == "in_loop" else None
    if guard is not None:
        lag.stamp = guard.stamp
        while not guard.ready():
            await asyncio.sleep(0.01)
    lag.start()
    await asyncio.sleep(0.2)
    threading.Thread(target=busy, daemon=True).start()
    lags = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(0.1)
        lags.append(lag.take())
        if boost is not None:  # what the agent's heartbeat did with its loop's lag
            boost.note(lags[-1], time.monotonic())
    boosts = guard.boosts if guard else (boost.boosts if boost else 0)
    if guard is not None:
        guard.stop()
    for h in hogs:
        h.kill()
    lags.sort()
    print(json.dumps({
        "max_lag_ms": round(lags[-1], 1), "p99_lag_ms": round(lags[int(0.99 * len(lags))], 1),
        "p50_lag_ms": round(lags[len(lags) // 2], 1), "samples": len(lags),
        "over_300ms": sum(x > 300 for x in lags), "boosts": boosts,
        "load1": round(os.getloadavg()[0], 2)}))

asyncio.run(main())
"""

VARIANTS = ("none", "in_loop", "guard")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ns = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()
    cores = os.cpu_count() or 2
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(ns.reps):
        for variant in VARIANTS:
            out = subprocess.run(
                [sys.executable, "-c", PROBE, variant, str(ns.seconds), str(cores + 2)],
                capture_output=True, text=True, check=True, env=env, start_new_session=True,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            if "skip" in r:
                sys.exit(f"bench-loop_guard needs real-time scheduling: {r['skip']}")
            runs[variant].append(r)
            print(variant, r, flush=True)

    def med(v: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[v])

    summary = {
        v: {k: med(v, k) for k in ("max_lag_ms", "p99_lag_ms", "p50_lag_ms", "over_300ms")}
        for v in VARIANTS
    }
    result = {
        "bench": "loop_guard",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "command": f"make bench-loop_guard ARGS='--reps {ns.reps} --seconds {ns.seconds:g}'",
        "cpus": cores,
        "busy_processes": cores + 2,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "summary": summary,
        "max_lag_ms_guard": summary["guard"]["max_lag_ms"],
        "max_lag_ms_in_loop": summary["in_loop"]["max_lag_ms"],
        "max_lag_ms_none": summary["none"]["max_lag_ms"],
        "max_lag_ratio_guard_vs_in_loop": round(
            summary["guard"]["max_lag_ms"] / max(summary["in_loop"]["max_lag_ms"], 1e-3), 3
        ),
        "p99_lag_ratio_guard_vs_in_loop": round(
            summary["guard"]["p99_lag_ms"] / max(summary["in_loop"]["p99_lag_ms"], 1e-3), 3
        ),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    day = result["date"][:10].replace("-", "")
    shutil.copy(RESULTS, RESULTS.with_name(f"loop_guard-{day}.json"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
