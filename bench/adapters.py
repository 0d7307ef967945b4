"""What an adapter costs a training step: each adapter's example with and without unbroken.

For each adapter (Transformers `Trainer`, Accelerate, Lightning, torchtitan) its example
(`unbroken.trainer.examples.*_unbroken`: a tiny GPT-2 from a config, torchtitan's a tiny
Llama 3 with FSDP2, 2 ranks, gloo, one thread each) runs under torchrun next to a real
`unbroken agent` (`--no-start`), and every step of an "on" block is flash-saved into the
agent's memory: the SDK's pacer still counts, measures and agrees (and picks the saves to
persist, about one per 30 s), but its choice to skip a save is overridden, since the figure
asked for is the cost at a save every step (left to itself, with a budget of 0.5, the pacer
skipped every 16th call to measure, and more when it judged a save dear: 0.54-0.95 saves a
step in the runs before). Within each run unbroken is on and off in alternating blocks
of `--block` steps, the same steps on both ranks: in an "off" block the adapter's report,
save and spike check are skipped (what remains is the plain library loop), in an "on"
block every step reports, flash-saves and judges its loss. So both modes share the process,
the warm caches and the load of the moment, and a loaded 2-core host hits both alike.

The step time of step s is rank 0's time between its saves of steps s-1 and s, counted in
the mode of step s-1 (whose save's copy overlaps step s); a step whose s-2 was in the
other mode is dropped (the copy of a save may spill over the block's edge), and so are the
first `WARMUP` steps. Figures per run: the median step time of each mode and their ratio;
per adapter the median of the runs' ratios (goal <= 1.03), their spread, and the saves per
"on" step the workers reported (`adapter.save_stats`).

Each adapter runs at every `--batch-sizes` (default 4, the examples' own, and 32): the same
model and state, so the save costs the same while the step grows; a tiny step on a CPU is
the worst case of a fixed per-step cost, a real model's step is longer still. And at every
`--widths` (the examples' `--width`, default 32, 256 and 512): two layers either way, so the
same tensors to save while their bytes and the step's compute grow (width 512: 214 times the
state, 76 MB a rank). A row's headline figures are the last width's at the last batch size:
the longest step, the nearest to a real model's (a tiny model's 4-30 ms step on a CPU is the
worst case of the save's fixed ~1 ms, which a GPU step never is); every combination is under
`by_width`, each with what the saves added to a step in ms and whether the goal holds, and
`summary` lists per adapter where the goal holds and, at the smallest state, the step length
from which the fixed part alone stays inside it.

Writes bench/results/adapters.json (with the load average) and prints a table. Run:
`make bench-adapters` or `OMP_NUM_THREADS=1 .venv/bin/python bench/adapters.py [--steps
120 --rounds 3 --block 5 --widths 32 256 512 --batch-sizes 4 32]` (the defaults: about 25
minutes on 2 cores; `--widths 32` alone, a few). Skips an adapter whose library
is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "adapters.json"
ADAPTERS = {  # name -> (example module, libraries it needs)
    "transformers": ("unbroken.trainer.examples.transformers_unbroken", ["transformers"]),
    "accelerate": ("unbroken.trainer.examples.accelerate_unbroken", ["accelerate"]),
    "lightning": ("unbroken.trainer.examples.lightning_unbroken", ["lightning"]),
    # torchtitan's own Trainer, a tiny Llama 3 with FSDP2 over the 2 ranks
    "torchtitan": ("unbroken.trainer.examples.torchtitan_unbroken", ["torchtitan"]),
}
WARMUP = 12
GOAL = 1.03  # the goal: a save every step costs a step at most 3 %
NO_DRIVER_S = 7 * 24 * 3600.0  # the agent's patience without a driver: the bench has none
SAVES = re.compile(r"adapter\.save_stats.*?saves=(\d+)")
# Attach, make every save call save; in the "off" blocks skip the SDK's report, save and
# spike check (the adapters call them through the module, so the patch reaches them);
# rank 0 writes (step, clock) at each save call to BENCH_OUT; then run the example.
RUNNER = """
import atexit, json, os, runpy, sys, time
from unbroken.trainer import hooks, pacer
hooks.init(save_budget=0.5)
counted = pacer.Pacer.due
pacer.Pacer.due = lambda self, step: counted(self, step) or True  # a save every call
block, out = int(os.environ["BENCH_BLOCK"]), os.environ["BENCH_OUT"]
save, report, stamps = hooks.save, hooks.report, []
on = lambda step: (step // block) % 2 == 0
def saving(step, state, **kw):
    stamps.append((step, time.perf_counter()))
    return save(step, state, **kw) if on(step) else False
hooks.save = saving
hooks.report = lambda step, *a, **kw: report(step, *a, **kw) if on(step) else False
spike = hooks.spike_wait
hooks.spike_wait = lambda step, *a, **kw: spike(step, *a, **kw) if on(step) else False
if os.environ.get("RANK") == "0":
    atexit.register(lambda: open(out, "w").write(json.dumps(stamps)))
sys.argv[0] = {mod!r}
runpy.run_module({mod!r}, run_name="__main__")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(sock: Path) -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "UNBROKEN_AGENT_SOCKET": str(sock)}
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for k in ("UNBROKEN_FLASH_ROOT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        e.pop(k, None)
    return e


def _run(
    module: str,
    steps: int,
    block: int,
    sock: Path,
    cwd: Path,
    shm: Path,
    batch_size: int,
    width: int,
) -> dict[str, Any]:
    """One torchrun of the example: rank 0's step times in each mode, the saves made."""
    stamps_file = cwd / "stamps.json"
    stamps_file.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", sys.executable, "-c", RUNNER.format(mod=module), "--steps", str(steps),
        "--batch-size", str(batch_size), "--width", str(width),
    ]  # fmt: skip
    env = {**_env(sock), "BENCH_BLOCK": str(block), "BENCH_OUT": str(stamps_file)}
    proc = subprocess.run(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False
    )
    text = proc.stdout.decode(errors="replace")
    if proc.returncode != 0 or not stamps_file.exists():
        raise RuntimeError(f"{module} failed (rc {proc.returncode}):\n{text[-3000:]}")
    at = dict(json.loads(stamps_file.read_text()))
    if sorted(at) != list(range(1, steps + 1)):
        raise RuntimeError(f"{module} did not save-call steps 1..{steps}:\n{text[-3000:]}")

    def on(step: int) -> bool:
        return (step // block) % 2 == 0

    times: dict[bool, list[float]] = {True: [], False: []}
    for s in range(max(3, WARMUP + 1), steps + 1):
        if on(s - 1) == on(s - 2):
            times[on(s - 1)].append(at[s] - at[s - 1])
    saves = [int(n) for n in SAVES.findall(text)]
    return {
        "on": times[True],
        "off": times[False],
        "saves": saves,
        "state_bytes": _copy_bytes(shm),
        "text": text,
    }


def _copy_bytes(shm: Path) -> int:
    """The largest file in the agent's flash store: one rank's copy of one step."""
    job = shm / "bench"
    sizes = [p.stat().st_size for p in job.rglob("*") if p.is_file()] if job.is_dir() else []
    return max(sizes, default=0)


def _forget(tmp: Path, shm: Path) -> None:
    """Drop the flash copies and persisted steps of the runs before."""
    job = shm / "bench"
    if job.is_dir():
        for p in job.iterdir():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(tmp / "persist", ignore_errors=True)


@contextlib.contextmanager
def _agent(tmp: Path, shm: Path) -> Any:
    sock, log = tmp / "agent.sock", tmp / "agent.log"
    args = [
        "--driver", f"127.0.0.1:{_free_port()}", "--node-id", "n0", "--worker-cmd", "true",
        "--nproc-per-node", "2", "--no-start", "--socket", str(sock),
        "--log-dir", str(tmp / "logs"), "--flash-dir", str(shm),
        "--flash-job", "bench", "--persist-url", str(tmp / "persist"),
        # no driver here: without this the agent gives up after 600 s, and a longer bench's
        # later runs found no agent and saved nothing
        "--max-disconnected-s", str(NO_DRIVER_S),
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.cli", "agent", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        end = time.monotonic() + 120
        while "flash.ready" not in log.read_text():
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError(f"the agent did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield sock
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _summary(rows: dict[str, Any]) -> dict[str, Any]:
    """Per adapter: each (width, batch) run's ratio, plain step and added ms, where the goal
    holds, and the added ms at the smallest state against the step that would absorb it."""
    out: dict[str, Any] = {}
    for name, row in rows.items():
        if "skipped" in row:
            continue
        cells = [b for w in row["by_width"].values() for b in w["by_batch_size"].values()]
        cells.sort(key=lambda b: b["median_step_ms_plain"])
        least = min(b["state_bytes_per_rank"] for b in cells)
        fixed = statistics.median(
            b["added_ms_per_step"] for b in cells if b["state_bytes_per_rank"] == least
        )
        out[name] = {
            "runs": {
                f"width {b['width']}, batch {b['batch_size']}": {
                    "plain_ms": b["median_step_ms_plain"],
                    "ratio": b["ratio"],
                    "added_ms": b["added_ms_per_step"],
                    "goal_met": b["goal_met"],
                }
                for b in cells
            },
            "goal_met_at": [
                f"width {b['width']}, batch {b['batch_size']}" for b in cells if b["goal_met"]
            ],
            "goal_met_longest_step": cells[-1]["goal_met"],
            # the smallest state's added ms (the median over its batch sizes) over the
            # goal's 3 %: the step length from which the fixed part alone stays inside it
            "fixed_ms_smallest_state": round(fixed, 3),
            "step_ms_for_goal_smallest_state": round(max(0.0, fixed) / (GOAL - 1), 1),
        }
    return out


def _write(args: argparse.Namespace, load_before: Any, rows: dict[str, Any]) -> dict[str, Any]:
    result = {
        "bench": "adapters",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python bench/adapters.py " + " ".join(sys.argv[1:]),
        "load1": round(load_before[0], 2),
        "steps": args.steps,
        "rounds": args.rounds,
        "block": args.block,
        "batch_sizes": args.batch_sizes,
        "widths": args.widths,
        "save_budget": 0.5,
        "save_every_step": True,  # the pacer's skips overridden (see the docstring)
        "goal_ratio": GOAL,
        "headline": "each adapter's ratio is at the last width and batch size (the longest "
        "step); every combination is under by_width, and summary says where the goal holds",
        "summary": _summary(rows),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "adapters": rows,
        "unix": time.time(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _measure(
    name: str,
    module: str,
    args: argparse.Namespace,
    batch_size: int,
    width: int,
    sock: Path,
    tmp: Path,
    shm: Path,
) -> dict[str, Any]:
    """`args.rounds` runs of one adapter's example at `batch_size` and `width`: step times
    and ratios."""
    runs = []
    for _ in range(args.rounds):
        _forget(tmp, shm)  # each run starts afresh, not from the last one's copies
        got = _run(module, args.steps, args.block, sock, tmp, shm, batch_size, width)
        if len(got["saves"]) != 2 or not all(got["saves"]):  # each worker saved
            raise RuntimeError(
                f"{name}: a worker made no flash saves ({got['saves']}: did the agent go?):\n"
                + got["text"][-3000:]
            )
        runs.append(got)
    ratios = [statistics.median(r["on"]) / statistics.median(r["off"]) for r in runs]
    n_on = sum((s // args.block) % 2 == 0 for s in range(1, args.steps + 1))
    return {
        "batch_size": batch_size,
        "width": width,
        "state_bytes_per_rank": max(r["state_bytes"] for r in runs),
        "median_step_ms_plain": round(
            1000 * statistics.median(t for r in runs for t in r["off"]), 3
        ),
        "median_step_ms_unbroken": round(
            1000 * statistics.median(t for r in runs for t in r["on"]), 3
        ),
        "ratio": round(statistics.median(ratios), 4),
        "ratio_per_run": [round(x, 4) for x in ratios],
        # what a save every step added to a step, in ms: the fixed part (state dicts, plan
        # check, slot, manifest) plus the copy's share of the 2 cores
        "added_ms_per_step": round(
            1000
            * statistics.median(
                statistics.median(r["on"]) - statistics.median(r["off"]) for r in runs
            ),
            3,
        ),
        "goal_met": statistics.median(ratios) <= GOAL,
        "steps_per_mode": sum(len(r["on"]) for r in runs),
        # per worker process (2 a run): the saves it made over its "on" steps
        "saves_per_on_step": round(
            sum(sum(r["saves"]) for r in runs) / max(1, 2 * args.rounds * n_on), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3, help="runs per adapter")
    parser.add_argument("--block", type=int, default=5, help="steps per on/off block")
    parser.add_argument("--only", nargs="*", default=list(ADAPTERS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[4, 32],
        help="sequences per rank per step, one set of runs each (the examples' own is 4; "
        "the last is the row's headline)",
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[32, 256, 512],
        help="the examples' model widths, one set of runs each (the examples' own is 32; "
        "the last is the row's headline)",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    # the flash store on tmpfs, as the agent's default (/dev/shm): on a disk's file system
    # every save's copy dirtied page-cache pages the kernel then wrote back (at 76 MB a rank
    # and batch 4 the DDP adapters' ratio was 1.36-1.44 on disk, 1.06-1.10 on tmpfs)
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-adapters-") as d,
        tempfile.TemporaryDirectory(prefix="bench-adapters-", dir=shm_root) as flash,
    ):
        tmp, shm = Path(d), Path(flash)
        with _agent(tmp, shm) as sock:
            for name in args.only:
                module, libs = ADAPTERS[name]
                missing = [lib for lib in libs if importlib.util.find_spec(lib) is None]
                if missing:
                    rows[name] = {"skipped": f"not installed: {missing}"}
                    continue
                # the last width's and batch size's figures (the longest step, the nearest
                # to a real model's) are the row's own; the last width's every size under
                # by_batch_size (the same model and state: the save costs the same, the step
                # grows), every width's under by_width
                by_width: dict[str, dict[str, Any]] = {}
                for width in args.widths:
                    by_size = by_width.setdefault(str(width), {})
                    for size in args.batch_sizes:
                        by_size[str(size)] = _measure(
                            name, module, args, size, width, sock, tmp, shm
                        )
                        print(name, by_size[str(size)], flush=True)
                    last = by_size  # (the widths so far: a partial file keeps them)
                    rows[name] = {
                        **last[str(args.batch_sizes[-1])],
                        "by_batch_size": last,
                        "by_width": {w: {"by_batch_size": b} for w, b in by_width.items()},
                    }
                    _write(args, load_before, rows)
    result = _write(args, load_before, rows)
    print(
        "| adapter | width | batch | state MB/rank | plain ms/step | unbroken ms/step "
        "| added ms/step | ratio (median of runs) | runs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | | | | | |")
            continue
        for width, w in r["by_width"].items():
            for size, b in w["by_batch_size"].items():
                print(
                    f"| {name} | {width} | {size} | {b['state_bytes_per_rank'] / 1e6:.2f} | "
                    f"{b['median_step_ms_plain']} | {b['median_step_ms_unbroken']} | "
                    f"{b['added_ms_per_step']} | {b['ratio']} | {b['ratio_per_run']} |"
                )
    print(f"load average {load_before} -> {result['loadavg_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
