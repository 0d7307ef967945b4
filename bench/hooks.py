"""What the hooks SDK costs a training step: DDP models with and without it, same run.

Two ranks (gloo, one thread each) train two identical copies of an MLP + AdamW in
alternating blocks of steps: the plain loop, and the same loop with the SDK attached to a
real `unbroken agent` (started here with `--no-start`: it owns the flash memory, starts no
workers) calling `hooks.report`, `hooks.save` (a flash save of model + optimizer into the
agent's memory, paced by the SDK to its 2 % budget, one save per 30 s persisted) and
`hooks.should_stop` every step. Three models, from 1 ms steps (the example's; shorter than
any real GPU step) to about 130 ms. Blocks alternate (ABBA) so load on the shared machine
hits both modes alike. Figures: the ratio of the median step times, sdk / plain; the ratio
of process CPU time per step (less sensitive to other load; it includes the flash writer
thread's copies); the time inside the three calls per step; and the agent's CPU per step
in SDK blocks against plain blocks (where it only idles), which on a node without a spare
core would come out of training. Also measured in this process: the cost of the same three
calls per step when no agent is reachable (the portable no-op path).

Writes bench/results/hooks.json and prints a markdown table. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/hooks.py [--steps 100 --rounds 4]`
(minutes; 15 under heavy load). Stops the agent and the workers, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "hooks.json"
MODELS = {  # name -> (input width, hidden widths, batch)
    "mlp-64x256 (example)": (64, [256], 32),
    "mlp-512x3": (512, [512, 512, 512], 64),
    "mlp-1024x4": (1024, [1024, 1024, 1024, 1024], 512),  # tens of ms per step on a CPU
}


def _model(width: int, hidden: list[int], seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    layers: list[Any] = []
    prev = width
    for h in hidden:
        layers += [torch.nn.Linear(prev, h), torch.nn.Tanh()]
        prev = h
    layers.append(torch.nn.Linear(prev, 1))
    return torch.nn.Sequential(*layers)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(out: str, steps: int, rounds: int) -> None:
    """One rank: time blocks of plain and SDK steps for every model; write JSON to `out`."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.trainer import hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    agent_pid = int(os.environ["BENCH_AGENT_PID"])
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    step_no = 0
    for name, (width, hidden, bs) in MODELS.items():
        hooks.reset()  # a fresh session (and save pacing) per model
        if not hooks.init():
            raise SystemExit("bench: the agent did not answer")
        pairs = {}
        for mode in ("plain", "sdk"):
            model = DDP(_model(width, hidden, seed=0))
            pairs[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        times: dict[str, list[float]] = {"plain": [], "sdk": []}
        agent_ms: dict[str, list[float]] = {"plain": [], "sdk": []}  # agent CPU ms per step
        cpu: dict[str, list[float]] = {"plain": [], "sdk": []}  # process CPU s per step, per block
        order = ["plain", "sdk", "sdk", "plain"] * rounds
        calls_s = 0.0  # time inside the three SDK calls (the measured sdk steps)
        for block, mode in enumerate([*order[:2], *order]):  # the first two blocks warm up
            model, opt = pairs[mode]
            state = {"model": model, "opt": opt}
            dist.barrier()
            c0 = time.process_time()
            a0 = _cpu_s(agent_pid)
            for _ in range(steps):
                g = torch.Generator().manual_seed(step_no * 1000 + rank)
                x = torch.randn(bs, width, generator=g)
                y = (x[:, :8].sum(dim=1, keepdim=True) / 3).sin()
                t0 = time.perf_counter()
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if mode == "sdk":
                    lv = loss.item()
                    t1 = time.perf_counter()
                    hooks.report(step_no, lv)
                    hooks.save(step_no, state)
                    hooks.should_stop()
                    if block >= 2:
                        calls_s += time.perf_counter() - t1
                else:
                    loss.item()
                if block >= 2:
                    times[mode].append(time.perf_counter() - t0)
                step_no += 1
            if mode == "sdk":
                hooks.flush()  # the block's last copy is part of its cost
            if block >= 2:
                cpu[mode].append((time.process_time() - c0) / steps)
                dist.barrier()  # both ranks' steps of the block are done
                agent_ms[mode].append((_cpu_s(agent_pid) - a0) * 1000.0 / steps)
        session = hooks._session
        pacer = session.pacer if session is not None else None
        state_bytes = sum(
            t.numel() * t.element_size()
            for t in [*pairs["sdk"][0].parameters()]
            + [v for s in pairs["sdk"][1].state.values() for v in s.values()]
            if isinstance(t, torch.Tensor)
        )
        results[name] = {
            "plain_ms": [t * 1000 for t in times["plain"]],
            "sdk_ms": [t * 1000 for t in times["sdk"]],
            "plain_cpu_ms": [t * 1000 for t in cpu["plain"]],
            "sdk_cpu_ms": [t * 1000 for t in cpu["sdk"]],
            "state_bytes": state_bytes,
            "saves_total": pacer.saves if pacer is not None else 0,
            "blocked_s_total": pacer.blocked_s if pacer is not None else 0.0,
            "save_every": pacer.every if pacer is not None else 0,
            "calls_us_per_step": calls_s / max(1, len(times["sdk"])) * 1e6,
            "agent_cpu_ms_per_step": {k: statistics.fmean(v) for k, v in agent_ms.items()},
        }
    hooks.close()
    Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def noop_cost_us(n: int = 20000) -> float:
    """Microseconds per step of report + save + should_stop with no reachable agent."""
    import warnings

    from unbroken.trainer import hooks

    hooks.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.init(os.path.join(tempfile.gettempdir(), f"no-agent-{os.getpid()}.sock"))
    state: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i in range(n):
        hooks.report(i, 0.5)
        hooks.save(i, state)
        hooks.should_stop()
    return (time.perf_counter() - t0) / n * 1e6


def _free_port() -> int:
    from unbroken.diagnostics.check import free_port

    return free_port()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(15.0)
            return
        except subprocess.TimeoutExpired:
            continue


def run(steps: int, rounds: int) -> dict[str, Any]:
    """Start an agent and two workers, collect their timings; return the results."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-hooks-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-hooks-", dir="/dev/shm"))  # as the agent's default
    sock, agent_log = tmp / "agent.sock", tmp / "agent.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "unbroken.cli", "agent",
        "--driver", f"127.0.0.1:{_free_port()}", "--node-id", "bench",
        "--worker-cmd", "true", "--nproc-per-node", "2", "--no-start",
        "--socket", str(sock), "--log-dir", str(tmp / "logs"),
        "--flash-dir", str(shm), "--persist-url", str(tmp / "persist"),
        "--max-disconnected-s", str(7 * 24 * 3600),  # no driver: the agent must not give up
    ]  # fmt: skip
    with open(agent_log, "wb") as f:
        agent = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 120
        while "flash.ready" not in agent_log.read_text():
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"the agent did not start:\n{agent_log.read_text()[-2000:]}")
            time.sleep(0.1)
        port = _free_port()
        for rank in (0, 1):
            wenv = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "UNBROKEN_AGENT_SOCKET": str(sock),
                "BENCH_AGENT_PID": str(agent.pid),
            }
            args = ["--worker", str(tmp / f"rank-{rank}.json"), "--steps", str(steps)]
            workers.append(
                subprocess.Popen(
                    [sys.executable, __file__, *args, "--rounds", str(rounds)],
                    env=wenv,
                    start_new_session=True,
                )
            )
        for w in workers:
            if w.wait(1800) != 0:
                raise RuntimeError(f"a worker failed (exit {w.returncode})")
        ranks = [json.loads((tmp / f"rank-{r}.json").read_text()) for r in (0, 1)]
    finally:
        for w in workers:
            _stop(w)
        _stop(agent)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {}
    for name in MODELS:
        plain = [t for r in ranks for t in r[name]["plain_ms"]]
        sdk = [t for r in ranks for t in r[name]["sdk_ms"]]
        saves = sum(r[name]["saves_total"] for r in ranks)
        plain_cpu = [t for r in ranks for t in r[name]["plain_cpu_ms"]]
        sdk_cpu = [t for r in ranks for t in r[name]["sdk_cpu_ms"]]
        out[name] = {
            "state_bytes_per_rank": ranks[0][name]["state_bytes"],
            "plain_step_ms_median": statistics.median(plain),
            "sdk_step_ms_median": statistics.median(sdk),
            "plain_step_ms_mean": statistics.fmean(plain),
            "sdk_step_ms_mean": statistics.fmean(sdk),
            "ratio_median": statistics.median(sdk) / statistics.median(plain),
            "ratio_mean": statistics.fmean(sdk) / statistics.fmean(plain),
            "plain_cpu_ms_per_step": statistics.fmean(plain_cpu),
            "sdk_cpu_ms_per_step": statistics.fmean(sdk_cpu),
            "cpu_ratio": statistics.fmean(sdk_cpu) / statistics.fmean(plain_cpu),
            "save_blocked_ms_mean": 1000.0
            * sum(r[name]["blocked_s_total"] for r in ranks)
            / max(saves, 1),
            "steps_per_mode": len(plain),
            "save_every_steps": ranks[0][name]["save_every"],
            "saves_per_rank": ranks[0][name]["saves_total"],
            "sdk_calls_us_per_step": statistics.fmean(r[name]["calls_us_per_step"] for r in ranks),
            # the agent's CPU per step (both ranks' reports and saves: reading reports,
            # noticing copies, persisting one per 30 s) beyond what it uses in plain blocks
            "agent_cpu_ms_per_step_sdk": ranks[0][name]["agent_cpu_ms_per_step"]["sdk"],
            "agent_cpu_ms_per_step_plain": ranks[0][name]["agent_cpu_ms_per_step"]["plain"],
        }
    return out


def main() -> int:
    """Run the benchmark (or, with --worker, one rank of it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per block")
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds per model")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if args.worker:
        worker(args.worker, args.steps, args.rounds)
        return 0
    import torch

    load = os.getloadavg()[0]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python bench/hooks.py", *sys.argv[1:]]),
        "load1": round(load, 2),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": 1,
            "load_avg_1m_at_start": load,
        },
        "noop_us_per_step_without_agent": noop_cost_us(),
        "models": run(args.steps, args.rounds),
    }
    results["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(
        "| model | state / rank | plain step (median) | with SDK | ratio | CPU / step ratio "
        "| saves every | save blocks | agent CPU / step, SDK (plain) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results["models"].items():
        print(
            f"| {name} | {r['state_bytes_per_rank'] / 1e6:.2f} MB "
            f"| {r['plain_step_ms_median']:.2f} ms | {r['sdk_step_ms_median']:.2f} ms "
            f"| {r['ratio_median']:.3f} | {r['cpu_ratio']:.3f} | {r['save_every_steps']} steps "
            f"| {r['save_blocked_ms_mean']:.2f} ms | {r['agent_cpu_ms_per_step_sdk']:.3f} ms "
            f"({r['agent_cpu_ms_per_step_plain']:.3f} ms) |"
        )
    print(
        f"no agent: report + save + should_stop cost "
        f"{results['noop_us_per_step_without_agent']:.2f} µs per step"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
