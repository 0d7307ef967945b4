"""Where the flash copy runs: on the training thread's own core, or on any core.

A rank's copy thread (SCHED_IDLE) copies the state into the ring while the rank waits in
its collectives. By default it follows the training thread's core (pinned to the core the
save was taken on: recovery/flash.py `FlashWriter._follow_to`); with
`UNBROKEN_FLASH_FOLLOW_CORE=0` the kernel runs it on whichever core is idle, which on a
busy node is another rank's core. There the optimizer's next writes to every line the copy
read must take those lines back from the other core's cache, and the training thread pays
for it.

This runs the embedded trainer alone (tiny preset, dp2, two processes on loopback, the
flash store in a temporary /dev/shm folder, no agent; bench/sessions.py's harness) with
`--flash-ab 6` (memory saves in alternating 6-step blocks: short blocks put the host's
bursts of stolen CPU on both sides) and reports, per run, the steps per second of the
saving blocks over the others (each block's first 2 steps and the first 50 steps left
out): the `throughput_with_flash_vs_without` of bench-recovery, without the cluster. The
two settings are interleaved, `--reps` runs each; the median per setting, the load average
and the share of CPU time the hypervisor stole during the runs are recorded.

Run: ``make bench-flash_core`` or ``.venv/bin/python bench/flash_core.py [--steps 800]
[--reps 4]`` (about 50 s a run here). Writes bench/results/flash_core.json and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from sessions import WARMUP, report, run_ab  # (bench/ is not a package)

BLOCK = 6
SETTLE = 2
SETTINGS = {
    "any core": {"UNBROKEN_FLASH_FOLLOW_CORE": "0"},
    "follows the training thread": {},
}
OUT = Path(__file__).parent / "results" / "flash_core.json"


def _cpu_times() -> list[int]:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal ..."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800, help="steps per run (default 800)")
    ap.add_argument("--reps", type=int, default=4, help="runs per setting, interleaved")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results file (default {OUT})")
    ns = ap.parse_args()
    if ns.steps < WARMUP + 8 * BLOCK or ns.reps < 1:
        ap.error(f"--steps must be >= {WARMUP + 8 * BLOCK} and --reps >= 1")
    names = list(SETTINGS)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ub-flash-core-") as work:
        for rep in range(ns.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                before = _cpu_times()
                r = run_ab(
                    ns.steps, Path(work), extra_env=SETTINGS[name], block=BLOCK, settle=SETTLE
                )
                after = _cpu_times()
                spent = [b - a for a, b in zip(before, after, strict=True)]
                r = {"setting": name, **r, "steal_share": spent[7] / max(1, sum(spent))}
                runs.append(r)
                print(
                    f"{name:>28}: ratio {r['ratio']:.3f} "
                    f"({r['steps_per_s_with_flash']:.2f} / {r['steps_per_s_without_flash']:.2f}"
                    f" steps/s, load {r['load1_before']:.1f}, "
                    f"steal {100 * r['steal_share']:.1f} %)",
                    flush=True,
                )
    medians = {n: statistics.median(r["ratio"] for r in runs if r["setting"] == n) for n in names}
    out = {
        "what": (
            f"trainer alone, tiny dp2, --flash-ab {BLOCK} (first {SETTLE} steps of a block "
            "left out): steps/s of saving blocks over the others, copy thread on any core "
            "or following the training thread's"
        ),
        "steps": ns.steps,
        "reps": ns.reps,
        "cpus": os.cpu_count(),
        "runs": runs,
        "ratio_median": medians,
        "follow_over_any": medians[names[1]] / medians[names[0]],
    }
    report(out, ns.out, "setting", names)
    print(f"\nwrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
