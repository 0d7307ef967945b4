"""What one session changes: the flash saves' cost with ranks in sessions of their own or in one.

Linux's autogroup scheduling (on by default for processes outside a cpu cgroup) shares the
CPU among sessions first and applies niceness and SCHED_IDLE only inside one. The trainer's
copy threads run at SCHED_IDLE so that they use only CPU time training does not want; with
each rank in a session of its own (as the agent started its workers until session 3), a
rank's copy thread competed with the other rank's training thread as an equal.

This runs the embedded trainer alone (tiny preset, dp2, two processes on loopback, the flash
store in a temporary /dev/shm folder, no agent) with `--flash-ab 25` (memory saves in
alternating 25-step blocks) and reports, per run, the steps per second of the saving blocks
over the others (each block's first 3 steps and the first 50 steps left out): the
`throughput_with_flash_vs_without` of bench-recovery, without the cluster. The two layouts
are interleaved, `--reps` runs each, so the host's drift falls on both; the median per
layout and the load average are recorded.

Run: ``make bench-sessions`` or ``.venv/bin/python bench/sessions.py [--steps 600] [--reps 3]``
(about 40 s a run here). Writes bench/results/sessions.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 25
SETTLE = 3  # steps left out at the start of each block (the previous block's save)
WARMUP = 50  # steps left out at the start (first touch, the persist clock's calibration)
LAYOUTS = ("own sessions", "one session")
OUT = Path(__file__).parent / "results" / "sessions.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(layout: str, steps: int, work: Path) -> dict[str, Any]:
    """Two ranks of the tiny model with flash saves in alternating blocks; the ratio."""
    return {"layout": layout, **run_ab(steps, work, own_sessions=layout == "own sessions")}


def run_ab(
    steps: int,
    work: Path,
    *,
    own_sessions: bool = False,
    extra_env: dict[str, str] | None = None,
    block: int = BLOCK,
    settle: int = SETTLE,
) -> dict[str, Any]:
    """Two ranks of the tiny model (each in a session of its own, or both in this one),
    `extra_env` added to their environment, with flash saves in alternating `block`-step blocks;
    the steps per second of the saving blocks over the others (the first `settle` steps
    of each block and the first `WARMUP` steps left out)."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ub-sessions-"))
    metrics = work / f"metrics-{time.monotonic_ns()}.jsonl"
    port = _free_port()
    group = {"start_new_session": True} if own_sessions else {"process_group": 0}
    procs: list[subprocess.Popen[bytes]] = []
    load0 = os.getloadavg()[0]
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "UNBROKEN_FLASH_ROOT": str(root),
                "UNBROKEN_FLASH_JOB": "bench", "UNBROKEN_FLASH_NODE": "n0", **(extra_env or {}),
            }  # fmt: skip
            cmd = [
                sys.executable, "-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2",
                "--steps", str(steps), "--log-every", str(10 * steps),
                "--flash-ab", str(block), "--metrics-out", str(metrics),
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **group
                )
            )
        for p in procs:
            _, err = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"a rank exited {p.returncode}: {err.decode()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)
    walls: dict[bool, list[float]] = {True: [], False: []}
    save_ms: list[float] = []
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        if m["step"] < WARMUP or m["step"] % block < settle or "flash_block" not in m:
            continue
        walls[m["flash_block"]].append(m["step_time_s"] + m.get("host_s", 0.0))
        if m.get("flash_save_s") is not None:
            save_ms.append(1000.0 * m["flash_save_s"])
    rate = {on: len(w) / sum(w) for on, w in walls.items()}
    return {
        "ratio": rate[True] / rate[False],
        "steps_per_s_with_flash": rate[True],
        "steps_per_s_without_flash": rate[False],
        "flash_save_ms_median": statistics.median(save_ms) if save_ms else None,
        "steps_counted": len(walls[True]) + len(walls[False]),
        "load1_before": load0,
        "load1_after": os.getloadavg()[0],
    }


def report(out: dict[str, Any], path: Path, key: str, names: list[str]) -> None:
    """Write `out` to `path` and print its runs' ratios as a markdown table, a row per
    `names` entry (the runs whose `key` is that name) with the median `out["ratio_median"]`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n| {key} | ratio per run | median |\n|---|---|---|")
    for name in names:
        each = ", ".join(f"{r['ratio']:.3f}" for r in out["runs"] if r[key] == name)
        print(f"| {name} | {each} | **{out['ratio_median'][name]:.3f}** |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="steps per run (default 600)")
    ap.add_argument("--reps", type=int, default=3, help="runs per layout, interleaved")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results file (default {OUT})")
    ns = ap.parse_args()
    if ns.steps < WARMUP + 4 * BLOCK or ns.reps < 1:
        ap.error(f"--steps must be >= {WARMUP + 4 * BLOCK} and --reps >= 1")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ub-sessions-") as work:
        for rep in range(ns.reps):
            for layout in LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]:
                r = run_once(layout, ns.steps, Path(work))
                runs.append(r)
                print(
                    f"{layout:>13}: ratio {r['ratio']:.3f} "
                    f"({r['steps_per_s_with_flash']:.2f} / {r['steps_per_s_without_flash']:.2f}"
                    f" steps/s, load {r['load1_before']:.1f})",
                    flush=True,
                )
    medians = {
        layout: statistics.median(r["ratio"] for r in runs if r["layout"] == layout)
        for layout in LAYOUTS
    }
    out = {
        "what": "trainer alone, tiny dp2, --flash-ab 25: steps/s of saving blocks over the others",
        "steps": ns.steps,
        "reps": ns.reps,
        "cpus": os.cpu_count(),
        "autogroup": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
        if Path("/proc/sys/kernel/sched_autogroup_enabled").exists()
        else None,
        "runs": runs,
        "ratio_median": medians,
    }
    report(out, ns.out, "layout", list(LAYOUTS))
    print(f"\nautogroup: {out['autogroup']}; wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
