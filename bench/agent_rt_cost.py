"""What the agents' real-time (SCHED_RR) loop costs training: step time with it on and off.

The job `make run` trains in miniature: an embedded etcd, `unbroken driver --nodes 2 --dp 2`
and two `unbroken agent`s, each starting one rank of the tiny trainer (gloo, flash saves),
heartbeating every 100 ms. The agents run as `unbroken agent` does (`realtime`: the loop and
gRPC's threads at SCHED_RR 1) or with `--no-realtime` (`normal`). The variants alternate
`--reps` times, the order swapped each rep (a load that changes over the run falls on both);
each run trains `--warmup` steps, then its rank 0's own step log over `--seconds` gives the
median step time and the steps per second (the loop turn included: the save and the report).
`--hog N` adds N busy processes (stress-ng when installed) for the whole run: the real-time
threads only take a CPU from training when the CPUs are short, so the loaded figure is the
one that matters.

Writes bench/results/agent_rt_cost.json with the load average: each run, and the same-run
ratios realtime / normal of the median step time and of the throughput (medians over the
paired reps). `make bench-agent_rt_cost` (ARGS="--reps 3 --seconds 40 --hog 2").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unbroken.cli.cluster import LocalCluster, until
from unbroken.driver.etcd import EmbeddedEtcd

RESULTS = Path(__file__).parent / "results" / "agent_rt_cost.json"
REPLICA_KEY = "bench-rt-cost-replica-key-0123456789"
VARIANTS = ("realtime", "normal")


def _steps(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _hog(n: int) -> list[subprocess.Popen[bytes]]:
    if n <= 0:
        return []
    stress = shutil.which("stress-ng")
    cmd = (
        [[stress, "--cpu", str(n), "--timeout", "0"]]
        if stress
        else [[sys.executable, "-c", "while True: pass"] for _ in range(n)]
    )
    return [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        for c in cmd
    ]  # fmt: skip


def one_run(
    run: Path, etcd: EmbeddedEtcd, variant: str, warmup: int, seconds: float
) -> dict[str, Any]:
    metrics = run / "metrics.jsonl"
    train = (
        f"{sys.executable} -m unbroken.trainer.run --preset tiny --dp 2 --steps 100000000 "
        f"--log-every 100000 --metrics-out {metrics}"
    )
    c = LocalCluster(run, etcd=etcd, env={"UNBROKEN_REPLICA_KEY": REPLICA_KEY}, grace_s=15)
    try:
        c.start_driver(
            "driver",
            ["--nodes", "2", "--workers-per-node", "1", "--dp", "2", "--worker-cmd", train,
             "--master-addr", "127.0.0.1", "--miss-limit", "30", "--straggler-policy", "off",
             "--archive-url", str(run / "archive")],
            wait_s=180,
        )  # fmt: skip
        for node, buddy in (("n0", "n1"), ("n1", "n0")):
            args = [
                "--no-start", "--worker-cmd", f"{sys.executable} -c pass", "--allow-remote-cmd",
                "--flash-dir", str(run / f"shm-{node}"), "--flash-job", c.job,
                "--no-warm-checks",
            ]  # fmt: skip
            if variant == "normal":
                args.append("--no-realtime")
            c.start_agent(node, args, buddy=buddy)
        until(lambda: len(_steps(metrics)) >= warmup, 600, f"{warmup} steps", poll_s=1.0)
        t0, load0 = time.time(), os.getloadavg()[0]
        time.sleep(seconds)
        t1, load1 = time.time(), os.getloadavg()[0]
        window = [m for m in _steps(metrics) if t0 <= m.get("end_unix_s", 0.0) <= t1]
        if len(window) < 10:
            raise RuntimeError(f"{variant}: only {len(window)} steps in {seconds} s; see {run}")
        not_rt = sum("agent loop not real-time" in c.log(n) for n in ("n0", "n1"))
        return {
            "variant": variant,
            "steps": len(window),
            "median_step_ms": round(statistics.median(m["step_time_s"] for m in window) * 1e3, 3),
            "steps_per_s": round(len(window) / (t1 - t0), 3),
            "load1": round((load0 + load1) / 2, 2),
            "agents_not_realtime": not_rt,  # logged when SCHED_RR was refused
        }
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0, help="measured per run")
    ap.add_argument("--warmup", type=int, default=100, help="steps before measuring")
    ap.add_argument("--hog", type=int, default=2, help="busy processes beside it (0: none)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ns = ap.parse_args()
    if ns.reps < 1 or ns.seconds <= 0:
        raise SystemExit("agent_rt_cost: --reps must be >= 1 and --seconds > 0")
    base = Path(tempfile.mkdtemp(prefix="bench-rt-cost-"))
    out: dict[str, Any] = {"cores": os.cpu_count(), "load1_start": os.getloadavg()[0]}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    etcd = EmbeddedEtcd(base / "etcd").start()
    hogs = _hog(ns.hog)
    try:
        for rep in range(ns.reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for v in order:
                r = one_run(base / f"{v}-{rep}", etcd, v, ns.warmup, ns.seconds)
                print(json.dumps(r), flush=True)
                runs[v].append(r)
    finally:
        for p in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait()
        etcd.stop()
    pairs = list(zip(runs["realtime"], runs["normal"], strict=True))
    out.update({
        "runs": runs,
        "hog": ns.hog,
        "seconds_per_run": ns.seconds,
        "step_time_ratio_realtime_over_normal": round(
            statistics.median(a["median_step_ms"] / b["median_step_ms"] for a, b in pairs), 4
        ),
        "throughput_ratio_realtime_over_normal": round(
            statistics.median(a["steps_per_s"] / b["steps_per_s"] for a, b in pairs), 4
        ),
        "load1_end": os.getloadavg()[0],
        "logs": str(base),
    })  # fmt: skip
    ns.results.parent.mkdir(parents=True, exist_ok=True)
    ns.results.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
