"""Benchmark of the embedded 3D trainer (CPU, gloo): parity, dp scaling, bubbles, ZeRO memory.

Every figure is measured in this run against a baseline from the same run:
- parity_max_abs_loss_diff: pp2×dp2×tp2 (1F1B, sequence parallel, ZeRO-3) on 8 processes
  against one process, 20 steps, fp32, same data.
- dp2_vs_single_step_time_ratio: median step time at dp=2 over dp=1, same global batch.
- pipeline idle fraction of 1F1B at pp=2 for m ∈ {4, 8, 16} microbatches (1 − compute time /
  schedule time, per rank, averaged) against the theoretical bubble (p−1)/(m+p−1).
- bytes per rank of parameters + gradients + AdamW state for ZeRO-3, ZeRO-2 (FSDP2
  reshard_after_forward=False) and replication at dp 2 and 4, against the ZeRO paper's
  model-state formula for fp32 AdamW (4 B params + 4 B grads + K = 8 B optimizer state per
  parameter): replication 16Ψ, ZeRO-2 (P_os+g) 4Ψ + 12Ψ/N, ZeRO-3 (P_os+g+p) 16Ψ/N.
- engine: setup time and peak host memory per rank (ru_maxrss) of meta-device init against
  building the whole model first (125m preset, dp4); step time with 4-way gradient
  accumulation against one chunk (same global batch); cp2 against dp2 and ep2 (MoE preset,
  inside dp2) against dp2 with the same 2 processes and global batch; AdamW for-loop vs
  foreach vs fused; torch.compile of each block against eager (one process).

Writes bench/results/trainer.json (sections not run keep their previous values) and prints a
markdown table. Run: `make bench-trainer` (all) or `make bench-trainer ARGS="--only engine"`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.gpt3d import GPT3DTrainer
from unbroken.trainer.launch import spawn
from unbroken.trainer.run import train

RESULTS = Path(__file__).parent / "results" / "trainer.json"


def _config(
    model: str,
    steps: int,
    seq: int,
    batch: int,
    *,
    init: str = "meta",
    impl: str = "foreach",
    **parallel: Any,
) -> TrainConfig:
    return TrainConfig(
        model=preset(model, max_seq_len=max(seq, 64)),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(warmup_steps=5, decay_steps=max(steps, 1), impl=impl),
        data=DataConfig(seq_len=seq, global_batch=batch, max_corpus_bytes=1 << 20),
        steps=steps,
        init=init,
    )


def _run(cfg: TrainConfig) -> list[list[dict[str, Any]]]:
    return spawn(functools.partial(train, cfg), cfg.parallel.world_size, timeout_s=900)


def parity() -> dict[str, Any]:
    """pp2×dp2×tp2 1F1B vs one process, 20 steps."""
    ref = [m["loss"] for m in _run(_config("tiny", 20, 32, 8))[0]]
    par = _run(_config("tiny", 20, 32, 8, pp=2, dp=2, tp=2, microbatches=2, schedule="1F1B"))
    diff = max(abs(a - m["loss"]) for hist in par for a, m in zip(ref, hist, strict=True))
    return {"parity_max_abs_loss_diff": diff, "parity_steps": 20, "parity_final_loss": ref[-1]}


def _median_step(hist: list[list[dict[str, Any]]], skip: int) -> float:
    return statistics.median(
        max(h[i]["step_time_s"] for h in hist) for i in range(skip, len(hist[0]))
    )


def dp_scaling() -> dict[str, Any]:
    """Median step time of dp=2 over dp=1 at the same global batch (small preset)."""
    single = _median_step(_run(_config("small", 8, 128, 8)), skip=2)
    dp2 = _median_step(_run(_config("small", 8, 128, 8, dp=2)), skip=2)
    return {
        "dp_single_step_s": single,
        "dp2_step_s": dp2,
        "dp2_vs_single_step_time_ratio": dp2 / single,
    }


def bubbles() -> list[dict[str, Any]]:
    """Measured vs theoretical 1F1B idle fraction at pp=2, 2 sequences per microbatch."""
    rows = []
    for m in (4, 8, 16):
        hist = _run(_config("small", 5, 128, 2 * m, pp=2, microbatches=m, schedule="1F1B"))
        idle = statistics.mean(x["pipeline_idle_fraction"] for h in hist for x in h[2:])
        rows.append({"microbatches": m, "measured": idle, "theory": 1 / (m + 1)})
    return rows


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _after_forward(trainer: GPT3DTrainer, seen: list[int], *_: Any) -> None:
    """Record the bytes of parameters FSDP2 left unsharded between forward and backward."""
    seen.append(sum(_local_bytes(p) for p in trainer.parameters() if not isinstance(p, DTensor)))


def _memory_on_rank(dp: int) -> list[dict[str, Any]]:
    """Per mode: bytes of params/grads/optimizer state on this rank (runs inside spawn)."""
    out = []
    for mode in ("zero3", "zero2", "replicate"):
        trainer = GPT3DTrainer()
        trainer.setup(_config("tiny", 2, 32, 8, dp=dp, dp_mode=mode))
        seen: list[int] = []
        handle = trainer.parts[0].register_forward_hook(
            functools.partial(_after_forward, trainer, seen)
        )
        trainer.train_step()
        handle.remove()
        params = sum(_local_bytes(p) for p in trainer.parameters())
        grads = sum(_local_bytes(p.grad) for p in trainer.parameters() if p.grad is not None)
        optim = sum(
            _local_bytes(v)
            for opt in trainer.optimizers
            for state in opt.state.values()
            for k, v in state.items()
            if k != "step"
        )
        out.append(
            {
                "mode": mode,
                "dp": dp,
                "params_bytes": params,
                "grads_bytes": grads,
                "optim_bytes": optim,
                "unsharded_between_fwd_bwd_bytes": max(seen),
            }
        )
        trainer.close()
    return out


def memory() -> list[dict[str, Any]]:
    """Measured bytes per rank against the ZeRO paper's formula for fp32 AdamW."""
    psi = preset("tiny").n_params()
    formula = {
        "replicate": lambda n: 16 * psi,
        "zero2": lambda n: 4 * psi + 12 * psi / n,
        "zero3": lambda n: 16 * psi / n,
    }
    rows = []
    for dp in (2, 4):
        for row in spawn(_memory_on_rank, dp, dp, timeout_s=900)[0]:
            at_rest = row["params_bytes"] + row["grads_bytes"] + row["optim_bytes"]
            row["at_rest_bytes"] = at_rest
            row["peak_bytes"] = at_rest + row["unsharded_between_fwd_bwd_bytes"]
            row["zero_paper_bytes"] = formula[row["mode"]](dp)
            row["psi"] = psi
            rows.append(row)
    return rows


def _setup_cost(cfg: TrainConfig) -> dict[str, float]:
    """Inside spawn: setup seconds and how much the peak RSS grew during setup."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trainer = GPT3DTrainer()
    t0 = time.perf_counter()
    trainer.setup(cfg)
    dt = time.perf_counter() - t0
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    trainer.close()
    return {"setup_s": dt, "init_s": trainer.init_s, "peak_growth_bytes": float(grew)}


def _steps(cfg: TrainConfig, skip: int = 2) -> float:
    return _median_step(_run(cfg), skip=skip)


def engine() -> dict[str, Any]:
    """Meta vs full init; accumulation; cp and ep against dp; optimizer kernels; compile."""
    out: dict[str, Any] = {}
    for init in ("meta", "full"):
        cfg = _config("125m", 1, 64, 4, init=init, dp=4)
        rows = spawn(functools.partial(_setup_cost, cfg), 4, timeout_s=900)
        out[f"init_{init}_setup_s"] = max(r["setup_s"] for r in rows)
        out[f"init_{init}_peak_growth_mib"] = max(r["peak_growth_bytes"] for r in rows) / 2**20
    out["init_params"] = preset("125m").n_params()
    one = _steps(_config("small", 8, 128, 8))
    acc = _steps(_config("small", 8, 128, 8, microbatches=4))
    out |= {"accum1_step_s": one, "accum4_step_s": acc, "accum4_vs_1_step_time_ratio": acc / one}
    dp2 = _steps(_config("small", 8, 128, 8, dp=2))
    cp2 = _steps(_config("small", 8, 128, 8, cp=2))
    out |= {"dp2_step_s": dp2, "cp2_step_s": cp2, "cp2_vs_dp2_step_time_ratio": cp2 / dp2}
    moe_dp2 = _steps(_config("moe-small", 8, 128, 8, dp=2))
    moe_ep2 = _steps(_config("moe-small", 8, 128, 8, dp=2, ep=2))
    out |= {
        "moe_dp2_step_s": moe_dp2,
        "moe_ep2_step_s": moe_ep2,
        "ep2_vs_dp2_step_time_ratio": moe_ep2 / moe_dp2,
    }
    for impl in ("for-loop", "foreach", "fused"):
        out[f"adamw_{impl}_step_s"] = _steps(_config("small", 8, 128, 8, impl=impl))
    eager = _steps(_config("small", 10, 128, 8), skip=4)
    compiled = _steps(_config("small", 10, 128, 8, compile=True), skip=4)
    out |= {
        "eager_step_s": eager,
        "compiled_step_s": compiled,
        "compile_vs_eager_step_time_ratio": compiled / eager,
    }
    return out


def engine_table(e: dict[str, Any]) -> str:
    """Rows of the engine section."""
    return "\n".join(
        [
            "| metric | value |",
            "|---|---|",
            f"| setup, 125m preset, dp4: meta init / full init (max over ranks) "
            f"| {e['init_meta_setup_s']:.1f} s / {e['init_full_setup_s']:.1f} s |",
            f"| peak host memory growth per rank at setup: meta / full "
            f"| {e['init_meta_peak_growth_mib']:.0f} MiB / "
            f"{e['init_full_peak_growth_mib']:.0f} MiB "
            f"(whole model {e['init_params'] * 4 / 2**20:.0f} MiB fp32) |",
            f"| accum4_vs_1_step_time_ratio (small, 1 proc, same global batch) "
            f"| {e['accum4_vs_1_step_time_ratio']:.2f} |",
            f"| cp2_vs_dp2_step_time_ratio (small, 2 procs, same global batch) "
            f"| {e['cp2_vs_dp2_step_time_ratio']:.2f} |",
            f"| ep2_vs_dp2_step_time_ratio (moe-small, 2 procs, same global batch) "
            f"| {e['ep2_vs_dp2_step_time_ratio']:.2f} |",
            f"| AdamW step time for-loop / foreach / fused (small, 1 proc) "
            f"| {e['adamw_for-loop_step_s']:.3f} / {e['adamw_foreach_step_s']:.3f} / "
            f"{e['adamw_fused_step_s']:.3f} s |",
            f"| compile_vs_eager_step_time_ratio (small, 1 proc, CPU inductor) "
            f"| {e['compile_vs_eager_step_time_ratio']:.2f} |",
        ]
    )


def table(r: dict[str, Any]) -> str:
    """The README's markdown table."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| parity_max_abs_loss_diff (pp2×dp2×tp2 1F1B vs 1 proc, 20 steps, fp32) "
        f"| {r['parity_max_abs_loss_diff']:.2e} |",
        f"| dp2_vs_single_step_time_ratio (small preset, same global batch) "
        f"| {r['dp2_vs_single_step_time_ratio']:.2f} |",
    ]
    for b in r["bubbles"]:
        lines.append(
            f"| 1F1B pp2 idle fraction, m={b['microbatches']}: measured / theory (p−1)/(m+p−1) "
            f"| {b['measured']:.3f} / {b['theory']:.3f} |"
        )
    lines += [
        "",
        f"Bytes per rank, tiny preset (Ψ = {r['memory'][0]['psi']:,} parameters, fp32 AdamW):",
        "",
        "| mode | dp | at rest (P+G+OS) | peak (+ unsharded P fwd→bwd) | ZeRO paper |",
        "|---|---|---|---|---|",
    ]
    for m in r["memory"]:
        lines.append(
            f"| {m['mode']} | {m['dp']} | {m['at_rest_bytes']:,} | {m['peak_bytes']:,} "
            f"| {m['zero_paper_bytes']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the measurements, write the JSON, print the tables."""
    parser = argparse.ArgumentParser(description="bench of the embedded trainer")
    parser.add_argument("--only", choices=("3d", "engine"), help="run one section")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    result: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result |= {"torch": torch.__version__, "cpus": os.cpu_count()}
    if args.only in (None, "3d"):
        result |= parity()
        result |= dp_scaling()
        result["bubbles"] = bubbles()
        result["memory"] = memory()
        result["zero_formula"] = (
            "fp32 AdamW, K=8: replication 16Ψ; ZeRO-2 (P_os+g) 4Ψ + 12Ψ/N; ZeRO-3 (P_os+g+p) 16Ψ/N"
        )
    if args.only in (None, "engine"):
        result["engine"] = engine()
    result["bench_seconds"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    if "parity_max_abs_loss_diff" in result:
        print(table(result))
    if "engine" in result:
        print()
        print(engine_table(result["engine"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
