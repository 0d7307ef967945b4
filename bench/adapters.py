"""What an adapter costs a training step: each adapter's example with and without unbroken.

For each adapter (Transformers `Trainer`, Accelerate, Lightning) its example
(`unbroken.trainer.examples.*_unbroken`: a tiny GPT-2 from a config, 2 ranks, gloo, one
thread each) runs under torchrun in alternating blocks (ABBA, so load on the shared machine
hits both alike): with no agent (the adapter's calls are no-ops: the plain library loop),
and next to a real `unbroken agent` (`--no-start`) with the SDK's save budget raised to
0.5 so that every step is flash-saved into the agent's memory (one save per 30 s
persisted). The step time is rank 0's wall time between its `step N loss X` lines (median
over the steps after the first WARMUP), read as they are printed. Figures: the median step
time of each mode and their ratio (goal <= 1.03), and the saves per step the workers
reported (`adapter.save_stats`).

Writes bench/results/adapters.json (with the load average) and prints a table. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/adapters.py [--steps 60 --rounds 1]`
(minutes a run on a loaded host). Skips an adapter whose library is not installed.
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
}
WARMUP = 10
# searched, not matched: another rank's log line may run into it (one pipe, two writers)
STEP = re.compile(rb"step (\d+) loss \S+")
SAVES = re.compile(r"adapter\.save_stats.*?saves=(\d+)")
# attach with a save budget that lets every step save, then run the example as __main__
RUNNER = (
    "import runpy, sys; from unbroken.trainer import hooks; "
    "hooks.init(save_budget=0.5); sys.argv[0] = {mod!r}; "
    "runpy.run_module({mod!r}, run_name='__main__')"
)


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


def _run(module: str, steps: int, sock: Path, cwd: Path) -> dict[str, Any]:
    """One torchrun of the example; rank 0's step times from its lines as they come."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--no-python", sys.executable, "-c", RUNNER.format(mod=module), "--steps", str(steps),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=_env(sock), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    stamps: dict[int, float] = {}
    out: list[bytes] = []
    for line in proc.stdout:
        now = time.perf_counter()
        out.append(line)
        m = STEP.search(line)
        if m:
            stamps.setdefault(int(m.group(1)), now)
    rc = proc.wait()
    text = b"".join(out).decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"{module} failed (rc {rc}):\n{text[-3000:]}")
    if max(stamps, default=0) != steps or len(stamps) < 0.9 * steps:
        raise RuntimeError(f"{module} did not run steps 1..{steps}:\n{text[-3000:]}")
    times = [
        stamps[s] - stamps[s - 1] for s in range(WARMUP + 1, steps + 1) if {s, s - 1} <= set(stamps)
    ]
    saves = [int(n) for n in SAVES.findall(text)]
    return {"step_s": times, "saves": saves, "text": text}


def _forget(tmp: Path) -> None:
    """Drop the flash copies and persisted steps of the runs before."""
    job = tmp / "shm" / "bench"
    if job.is_dir():
        for p in job.iterdir():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(tmp / "persist", ignore_errors=True)


@contextlib.contextmanager
def _agent(tmp: Path) -> Any:
    sock, log = tmp / "agent.sock", tmp / "agent.log"
    args = [
        "--driver", f"127.0.0.1:{_free_port()}", "--node-id", "n0", "--worker-cmd", "true",
        "--nproc-per-node", "2", "--no-start", "--socket", str(sock),
        "--log-dir", str(tmp / "logs"), "--flash-dir", str(tmp / "shm"),
        "--flash-job", "bench", "--persist-url", str(tmp / "persist"),
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


def _write(args: argparse.Namespace, load_before: Any, rows: dict[str, Any]) -> dict[str, Any]:
    result = {
        "bench": "adapters",
        "steps": args.steps,
        "rounds": args.rounds,
        "save_budget": 0.5,
        "goal_ratio": 1.03,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "adapters": rows,
        "unix": time.time(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA blocks per adapter")
    parser.add_argument("--only", nargs="*", default=list(ADAPTERS))
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-adapters-") as d:
        tmp = Path(d)
        with _agent(tmp) as sock:
            for name in args.only:
                module, libs = ADAPTERS[name]
                missing = [lib for lib in libs if importlib.util.find_spec(lib) is None]
                if missing:
                    rows[name] = {"skipped": f"not installed: {missing}"}
                    continue
                modes: dict[str, dict[str, list[Any]]] = {
                    m: {"step_s": [], "saves": []} for m in ("plain", "unbroken")
                }
                for _ in range(args.rounds):
                    for mode in ("plain", "unbroken", "unbroken", "plain"):
                        target = sock if mode == "unbroken" else tmp / "no-agent.sock"
                        _forget(tmp)  # each run starts afresh, not from the last one's copies
                        got = _run(module, args.steps, target, tmp)
                        if mode == "unbroken" and not got["saves"]:
                            raise RuntimeError(
                                f"{name}: no flash saves reported with the agent:\n"
                                + got["text"][-3000:]
                            )
                        modes[mode]["step_s"] += got["step_s"]
                        modes[mode]["saves"] += got["saves"]
                plain = statistics.median(modes["plain"]["step_s"])
                ub = statistics.median(modes["unbroken"]["step_s"])
                runs = 2 * args.rounds
                rows[name] = {
                    "median_step_ms_plain": round(1000 * plain, 3),
                    "median_step_ms_unbroken": round(1000 * ub, 3),
                    "ratio": round(ub / plain, 4),
                    "steps_per_mode": len(modes["unbroken"]["step_s"]),
                    # per worker process: the saves it made over its run's steps
                    "saves_per_step": round(
                        sum(modes["unbroken"]["saves"]) / max(1, 2 * runs * args.steps), 3
                    ),
                }
                print(name, rows[name], flush=True)
                _write(args, load_before, rows)
    result = _write(args, load_before, rows)
    print("| adapter | plain ms/step | unbroken ms/step | ratio | saves/step |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | |")
        else:
            print(
                f"| {name} | {r['median_step_ms_plain']} | {r['median_step_ms_unbroken']} "
                f"| {r['ratio']} | {r['saves_per_step']} |"
            )
    print(f"load average {load_before} -> {result['loadavg_after']}; wrote {RESULTS}")


if __name__ == "__main__":
    main()
