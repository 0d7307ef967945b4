"""`unbroken plan`: the capacity planner an infra team runs before booking a cluster.

Flags map one-to-one onto `PlanConfig` (trainer/plan.py), which holds the validation and
every formula; this module only parses, prints rich tables or `--json`, and turns bad input
into a one-line error with exit code 2. Sizes accept suffixes (`175B`, `3.5T`, `300e9`),
rates accept percentages (`0.1%`), durations accept units (`90s`, `2m`, `1h`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from unbroken.recovery import lifecycle
from unbroken.trainer.plan import (
    GB,
    GPUS,
    RECOMPUTE_CHOICES,
    ModelShape,
    Plan,
    PlanConfig,
    make_plan,
)

EXIT_OK, EXIT_USAGE = 0, 2

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DURATIONS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_SHAPE_FLAGS = ("layers", "hidden", "heads", "seq_len", "vocab")


def parse_count(text: str) -> float:
    """A positive size such as `175B`, `3.5T`, `7e9` or `1024`.

    Raises:
        argparse.ArgumentTypeError: not a number, or not positive.
    """
    t = text.strip().lower().replace("_", "").replace(",", "")
    scale = 1.0
    if t and t[-1] in _SUFFIXES:
        scale, t = _SUFFIXES[t[-1]], t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; write e.g. 175B, 3.5T or 7e9"
        ) from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def parse_int(text: str) -> int:
    """A positive integer (suffixes allowed, e.g. `4k`)."""
    value = parse_count(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number")
    return int(value)


def parse_fraction(text: str) -> float:
    """A fraction, written `0.001` or `0.1%`."""
    t = text.strip()
    try:
        return float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction; write 0.4 or 40%") from None


def parse_seconds(text: str) -> float:
    """A duration in seconds, written `90`, `90s`, `2m` or `1h`."""
    t = text.strip().lower()
    scale = 1.0
    if t and t[-1] in _DURATIONS:
        scale, t = _DURATIONS[t[-1]], t[:-1]
    try:
        return float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; write 90s, 2m or 1h"
        ) from None


def parse_layout(text: str) -> tuple[int, int]:
    """A tensor × pipeline layout written `TPxPP`, e.g. `8x8`."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        tp, pp = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a layout; write TPxPP, e.g. 8x8 or 4x12"
        ) from None
    return tp, pp


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `unbroken plan`."""
    m = parser.add_argument_group("model (give --params, or the shape, or both)")
    m.add_argument("--params", type=parse_count, help="parameter count, e.g. 175B")
    m.add_argument("--layers", type=parse_int, help="transformer layers")
    m.add_argument("--hidden", type=parse_int, help="hidden size")
    m.add_argument("--heads", type=parse_int, help="attention heads")
    m.add_argument("--seq-len", type=parse_int, help="sequence length")
    m.add_argument("--vocab", type=parse_int, help="vocabulary size")
    m.add_argument("--ffn-hidden", type=parse_int, help="MLP width (default 4 × hidden)")
    m.add_argument(
        "--no-position-table",
        action="store_true",
        help="rotary/ALiBi positions (no learned position embedding)",
    )
    r = parser.add_argument_group("run")
    r.add_argument("--tokens", type=parse_count, help="training tokens, e.g. 300B")
    r.add_argument("--gpus", type=parse_int, help="number of GPUs")
    r.add_argument("--gpu", help="GPU type (see --list-gpus)")
    r.add_argument("--mfu", type=parse_fraction, default=0.4, help="assumed MFU (default 0.4)")
    r.add_argument(
        "--recompute",
        choices=RECOMPUTE_CHOICES,
        default="none",
        help="activation recomputation; 'full' counts 8 FLOPs per parameter per token",
    )
    r.add_argument(
        "--layout",
        type=parse_layout,
        action="append",
        help="tensor x pipeline parallel layout TPxPP; repeat to compare (default 1x1)",
    )
    r.add_argument(
        "--cp", type=parse_int, default=1, help="context parallel: GPUs sharing each sequence"
    )
    r.add_argument(
        "--ep", type=parse_int, default=1, help="expert parallel: GPUs (of dp) sharing experts"
    )
    r.add_argument(
        "--expert-params",
        type=parse_count,
        default=0.0,
        help="MoE: how many of the parameters are experts, e.g. 40B",
    )
    r.add_argument("--micro-batch", type=parse_int, default=1, help="micro-batch size")
    r.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallel")
    f = parser.add_argument_group("failures and checkpoints")
    f.add_argument(
        "--failure-rate",
        type=parse_fraction,
        default=0.001,
        help="daily failure probability per GPU (default 0.1%%)",
    )
    f.add_argument(
        "--save-cost", type=parse_seconds, default=60.0, help="time one checkpoint blocks (60s)"
    )
    f.add_argument(
        "--restart-cost",
        type=parse_seconds,
        default=600.0,
        help="time from a failure to training again, excluding redone work (10m)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--list-gpus", action="store_true", help="list known GPU types")


def build_config(ns: argparse.Namespace) -> PlanConfig:
    """The `PlanConfig` the flags describe.

    Raises:
        ValueError: missing or inconsistent flags; the message names them.
    """
    missing = [f"--{n}" for n in ("tokens", "gpus", "gpu") if getattr(ns, n) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (see `unbroken plan --help`)")
    given = [n for n in _SHAPE_FLAGS if getattr(ns, n) is not None]
    model = None
    if given or ns.ffn_hidden is not None:
        lacking = [f"--{n.replace('_', '-')}" for n in _SHAPE_FLAGS if getattr(ns, n) is None]
        if lacking:
            raise ValueError(f"a model shape needs all five sizes; missing {', '.join(lacking)}")
        model = ModelShape(
            layers=ns.layers,
            hidden=ns.hidden,
            heads=ns.heads,
            seq_len=ns.seq_len,
            vocab=ns.vocab,
            ffn_hidden=ns.ffn_hidden,
            learned_positions=not ns.no_position_table,
        )
    if ns.params is None and model is None:
        raise ValueError("give --params (e.g. 175B) or the model shape (--layers --hidden ...)")
    return PlanConfig(
        params=ns.params,
        model=model,
        tokens=ns.tokens,
        gpus=ns.gpus,
        gpu=ns.gpu,
        mfu=ns.mfu,
        recompute=ns.recompute,
        layouts=ns.layout or [(1, 1)],
        cp=ns.cp,
        ep=ns.ep,
        expert_params=ns.expert_params,
        micro_batch=ns.micro_batch,
        sequence_parallel=ns.sequence_parallel,
        failure_rate_per_gpu_day=ns.failure_rate,
        save_cost_s=ns.save_cost,
        restart_cost_s=ns.restart_cost,
    )


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _bounded_min(minutes: object) -> float | None:
    """The interval the driver would send (its default floor and ceiling), in minutes."""
    if not isinstance(minutes, (int, float)) or not math.isfinite(minutes):
        return None
    policy = lifecycle.PersistPolicy()
    return min(policy.ceiling_s, max(policy.floor_s, minutes * 60.0)) / 60.0


def _fmt(x: object, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isinf(x)):
        return "∞"
    assert isinstance(x, int | float), f"not a number: {x!r}"
    return format(x, spec)


def print_plan(plan: Plan) -> None:
    """Render the plan as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    d = plan.to_dict()
    summary = Table(title="Training plan", show_header=False, title_justify="left")
    summary.add_column("what", style="bold")
    summary.add_column("value", justify="right")
    rows = [
        ("model", f"{_si(plan.params)} parameters, {_si(plan.tokens)} tokens"),
        ("cluster", f"{plan.gpus} × {plan.gpu.name} ({plan.gpu.peak_tflops:g} TFLOP/s peak)"),
        ("MFU", f"{plan.mfu:.1%} → {plan.achieved_tflops_per_gpu:.0f} TFLOP/s per GPU"),
        ("FLOPs", f"{plan.total_flops:.3e} ({plan.recompute} recomputation)"),
        ("compute", f"{plan.compute_days:.1f} days, {plan.gpu_hours:,.0f} GPU-hours"),
        ("P(a failure in a day)", f"{plan.failure_probability_per_day:.2%}"),
        (
            "failures per day",
            f"{plan.failures_per_day:.2f} (MTBF {_fmt(d['mtbf_hours'], '.1f')} h)",
        ),
        ("checkpoint every", f"{_fmt(d['checkpoint_interval_min'], '.1f')} min (Young/Daly)"),
        (
            "driver persists every",
            f"{_fmt(d['persist_interval_min'], '.1f')} min while the rings and buddies serve "
            f"the failures, {_fmt(_bounded_min(d['checkpoint_interval_min']), '.1f')} min if "
            "every failure read storage (it counts only those; within --persist-floor-s, "
            "--persist-ceiling-s)",
        ),
        ("goodput", f"{plan.goodput:.1%}"),
        (
            "wall clock",
            f"{_fmt(d['wall_days'], '.1f')} days, ~{plan.expected_failures:.0f} failures",
        ),
    ]
    for what, value in rows:
        summary.add_row(what, value)
    console.print(summary)

    mem = Table(title=f"Memory per GPU (GB of {plan.gpu.memory_gb:g})", title_justify="left")
    for col in (
        "tp×pp×dp" + ("×cp" if plan.memory[0].cp > 1 else ""),
        "ZeRO",
        "params",
        "grads",
        "optimizer",
        "activations",
        "total",
    ):
        mem.add_column(col, justify="right")
    mem.add_column("fits")
    for m in plan.memory:
        acts = "?" if m.activations_bytes is None else f"{m.activations_bytes / GB:.1f}"
        fits = m.total_bytes <= plan.gpu.memory_gb * GB
        layout = f"{m.tp}×{m.pp}×{m.dp}" + (f"×{m.cp}" if m.cp > 1 else "")
        mem.add_row(
            layout + (f" (ep{m.ep})" if m.ep > 1 else ""),
            str(m.zero_stage),
            f"{m.params_bytes / GB:.1f}",
            f"{m.grads_bytes / GB:.1f}",
            f"{m.optimizer_bytes / GB:.1f}",
            acts,
            f"{m.total_bytes / GB:.1f}",
            "[green]yes[/]" if fits else "[red]no[/]",
        )
    console.print(mem)
    if plan.memory and plan.memory[0].activations_bytes is None:
        console.print("activations need the model shape (--layers --hidden --heads ...)")


def print_gpus(as_json: bool) -> None:
    """The GPU table, as rich or JSON."""
    if as_json:
        print(
            json.dumps(
                [
                    {"name": g.name, "peak_tflops": g.peak_tflops, "memory_gb": g.memory_gb}
                    for g in GPUS.values()
                ],
                indent=2,
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Known GPU types (dense bf16 peak)", title_justify="left")
    t.add_column("name")
    t.add_column("TFLOP/s", justify="right")
    t.add_column("memory GB", justify="right")
    t.add_column("note")
    for g in GPUS.values():
        t.add_row(g.name, f"{g.peak_tflops:g}", f"{g.memory_gb:g}", g.note)
    Console().print(t)


def run(ns: argparse.Namespace) -> int:
    """`unbroken plan`: print the plan; exit 2 with a message on bad input."""
    if ns.list_gpus:
        print_gpus(ns.json)
        return EXIT_OK
    try:
        plan = make_plan(build_config(ns))
    except ValueError as e:
        print(f"unbroken plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if ns.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print_plan(plan)
    return EXIT_OK
