"""Capacity planning for a training run: time, memory per GPU, failures and checkpoint cadence.

An infra team answers four questions before it books a cluster: how many days will the run
take, does the model fit in each GPU's memory under the chosen ZeRO stage and tp/pp layout,
how often will a GPU fail, and how often should the job checkpoint so that failures cost
the least. This module answers them with the standard closed-form estimates, each stated in
the docstring of the function that computes it, so that a planner's number can be traced
back to a paper. Everything here is pure arithmetic on a `PlanConfig`; `unbroken plan`
(trainer/plan_cli.py) only parses flags and prints. No torch import: the planner runs on a
laptop.

Sources:
- Compute: Kaplan et al. 2020 ("Scaling Laws for Neural Language Models"), 6 FLOPs per
  parameter per token for forward + backward; Narayanan et al. 2021 ("Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM"), 8 per parameter per token
  when every layer's forward is recomputed in the backward pass.
- Model state: Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models"), section 3.1 and 5.
- Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models"), section 4 and table 2.
- Checkpoint interval: Young 1974 ("A first order approximation to the optimum checkpoint
  interval"); Daly 2006 ("A higher order estimate of the optimum checkpoint interval for
  restart dumps").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unbroken.recovery import lifecycle

SECONDS_PER_DAY = 86_400.0
GB = 1e9  # memory sizes below are decimal gigabytes, as in GPU datasheets

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full")


@dataclass(kw_only=True, slots=True, frozen=True)
class GPUSpec:
    """One accelerator: dense (no sparsity) 16-bit tensor peak and memory per device."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core peak, TFLOP/s (fp16 where bf16 is missing)
    memory_gb: float
    note: str = ""


# Peak dense bf16 FLOP/s and memory, from the vendors' datasheets. "Dense" means without
# the 2:4 structured-sparsity factor that datasheets often print first.
_GPU_LIST: tuple[GPUSpec, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 with sparsity); the
    # 40 GB and 80 GB SXM parts share the compute figure.
    GPUSpec(name="a100-40gb", peak_tflops=312.0, memory_gb=40.0),
    GPUSpec(name="a100-80gb", peak_tflops=312.0, memory_gb=80.0),
    # A800: the export variant of the A100 (NVLink cut to 400 GB/s), same compute.
    GPUSpec(name="a800-80gb", peak_tflops=312.0, memory_gb=80.0),
    # NVIDIA H100 datasheet: SXM BF16 1,979 TFLOPS with sparsity -> 989 dense, 80 GB HBM3;
    # PCIe 1,513 with sparsity -> 756 dense, 80 GB HBM2e.
    GPUSpec(name="h100-sxm", peak_tflops=989.0, memory_gb=80.0),
    GPUSpec(name="h100-pcie", peak_tflops=756.0, memory_gb=80.0),
    # H800: the export variant of the H100 SXM (reduced NVLink and FP64), same BF16 peak.
    GPUSpec(name="h800", peak_tflops=989.0, memory_gb=80.0),
    # NVIDIA H200 datasheet: same tensor cores as H100 SXM, 141 GB HBM3e.
    GPUSpec(name="h200", peak_tflops=989.0, memory_gb=141.0),
    # NVIDIA HGX B200 datasheet: FP16/BF16 4.5 PFLOPS with sparsity -> 2,250 dense, 180 GB.
    GPUSpec(name="b200", peak_tflops=2250.0, memory_gb=180.0),
    # NVIDIA V100 datasheet: no bf16; FP16 tensor 125 TFLOPS (SXM2), 16 or 32 GB HBM2.
    GPUSpec(name="v100-16gb", peak_tflops=125.0, memory_gb=16.0, note="fp16; no bf16"),
    GPUSpec(name="v100-32gb", peak_tflops=125.0, memory_gb=32.0, note="fp16; no bf16"),
    # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), 48 GB GDDR6.
    GPUSpec(name="l40s", peak_tflops=362.05, memory_gb=48.0),
    # AMD Instinct MI250X datasheet: BF16 383 TFLOPS per OAM module (two GCDs), 128 GB HBM2e.
    GPUSpec(name="mi250x", peak_tflops=383.0, memory_gb=128.0, note="per module (2 GCDs)"),
    # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense, 192 GB HBM3.
    GPUSpec(name="mi300x", peak_tflops=1307.4, memory_gb=192.0),
    # AMD Instinct MI325X datasheet: same compute as MI300X, 256 GB HBM3E.
    GPUSpec(name="mi325x", peak_tflops=1307.4, memory_gb=256.0),
)
GPUS: dict[str, GPUSpec] = {g.name: g for g in _GPU_LIST}


def _normalise_gpu_name(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def lookup_gpu(name: str) -> GPUSpec:
    """The spec of a GPU type, matched ignoring case, spaces, dashes and underscores.

    Args:
        name: e.g. "a100-80gb", "H100 SXM", "mi300x".

    Returns:
        The GPU's spec.

    Raises:
        ValueError: the name is not in the table; the message lists the known names.
    """
    wanted = _normalise_gpu_name(name)
    for spec in _GPU_LIST:
        if _normalise_gpu_name(spec.name) == wanted:
            return spec
    close = [g for g in GPUS if _normalise_gpu_name(g).startswith(wanted)] if wanted else []
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ValueError(f"gpu: unknown GPU type {name!r}; {hint}known types: {', '.join(GPUS)}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """A GPT-style decoder: the sizes that fix its parameter count and activation memory."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None  # default 4 × hidden
    learned_positions: bool = True  # False for rotary/ALiBi models (no position table)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"ffn_hidden: must be positive, got {self.ffn_hidden}")
        if self.hidden % self.heads:
            raise ValueError(
                f"heads: hidden size {self.hidden} is not divisible by {self.heads} heads"
            )

    @property
    def params(self) -> int:
        """Parameter count of the decoder with a tied input/output embedding.

        Per layer: attention 4h² + 4h (QKV and output projections with biases), MLP
        2hf + f + h, two layer norms 4h; so 12h² + 13h when f = 4h (Narayanan et al. 2021,
        eq. for P). Plus the token embedding Vh, a learned position table sh if any, and
        the final layer norm 2h.
        """
        h, f = self.hidden, self.ffn_hidden or 4 * self.hidden
        per_layer = 4 * h * h + 2 * h * f + f + 9 * h
        positions = self.seq_len * h if self.learned_positions else 0
        return self.layers * per_layer + self.vocab * h + positions + 2 * h


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """Everything `unbroken plan` needs. Either `params` or `model` (or both: `params` wins
    for the compute and model-state estimates, `model` is still used for activations)."""

    params: float | None = None
    model: ModelShape | None = None
    tokens: float
    gpus: int
    gpu: str
    mfu: float = 0.4
    recompute: Recompute = "none"
    layouts: list[tuple[int, int]] = field(default_factory=lambda: [(1, 1)])  # (tp, pp)
    cp: int = 1  # context parallel: each sequence split over cp GPUs (dp = GPUs / tp·pp·cp)
    ep: int = 1  # expert parallel: experts split over ep of the dp GPUs
    expert_params: float = 0.0  # the part of the parameters that are MoE experts
    micro_batch: int = 1
    sequence_parallel: bool = False
    failure_rate_per_gpu_day: float = 0.001
    save_cost_s: float = 60.0
    restart_cost_s: float = 600.0

    def __post_init__(self) -> None:
        if self.params is None and self.model is None:
            raise ValueError("params: give the parameter count or the model shape")
        if self.params is not None and not (self.params > 0 and math.isfinite(self.params)):
            raise ValueError(f"params: must be a positive number, got {self.params}")
        if not (self.tokens > 0 and math.isfinite(self.tokens)):
            raise ValueError(f"tokens: must be a positive number, got {self.tokens}")
        if self.gpus <= 0:
            raise ValueError(f"gpus: must be a positive integer, got {self.gpus}")
        lookup_gpu(self.gpu)
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu: must be in (0, 1] (e.g. 0.4 for 40 %), got {self.mfu}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(
                f"recompute: must be one of {', '.join(RECOMPUTE_CHOICES)}, got {self.recompute!r}"
            )
        if not self.layouts:
            raise ValueError("layouts: give at least one tp×pp layout")
        if self.cp <= 0 or self.ep <= 0:
            raise ValueError(f"cp, ep: must be positive, got cp={self.cp} ep={self.ep}")
        if not 0 <= self.expert_params < (self.params or math.inf):
            raise ValueError(f"expert_params: must be in [0, params), got {self.expert_params}")
        if self.ep > 1 and not self.expert_params:
            raise ValueError("ep: expert parallelism needs expert_params (the experts' share)")
        for tp, pp in self.layouts:
            if tp <= 0 or pp <= 0:
                raise ValueError(f"layouts: tp and pp must be positive, got {tp}x{pp}")
            if self.gpus % (tp * pp * self.cp):
                raise ValueError(
                    f"layouts: {self.gpus} GPUs are not divisible by tp×pp×cp = "
                    f"{tp}x{pp}x{self.cp}; pick a layout whose product divides the GPU count"
                )
            dp = self.gpus // (tp * pp * self.cp)
            if dp % self.ep:
                raise ValueError(
                    f"ep: {self.ep} must divide dp = {dp} for layout {tp}x{pp} (expert "
                    "parallelism borrows its GPUs from data parallelism)"
                )
        if self.micro_batch <= 0:
            raise ValueError(f"micro_batch: must be a positive integer, got {self.micro_batch}")
        if not 0 <= self.failure_rate_per_gpu_day < 1:
            raise ValueError(
                "failure_rate_per_gpu_day: must be in [0, 1) (e.g. 0.001 for 0.1 %/day), "
                f"got {self.failure_rate_per_gpu_day}"
            )
        if self.save_cost_s < 0:
            raise ValueError(f"save_cost_s: must be >= 0 seconds, got {self.save_cost_s}")
        if self.restart_cost_s < 0:
            raise ValueError(f"restart_cost_s: must be >= 0 seconds, got {self.restart_cost_s}")

    @property
    def n_params(self) -> float:
        """The parameter count used for compute and model state."""
        if self.params is not None:
            return self.params
        assert self.model is not None
        return float(self.model.params)


# ---------------------------------------------------------------------------------------
# Compute


def flops_per_token_factor(recompute: Recompute) -> int:
    """FLOPs per parameter per token: 6, or 8 when every layer's forward runs twice.

    Forward is 2N FLOPs per token (a multiply and an add per weight), backward 4N; full
    activation recomputation repeats the forward in the backward pass: 2N more. Selective
    recomputation only redoes the attention softmax/dropout, a few percent, so it stays 6.
    """
    return 8 if recompute == "full" else 6


def training_flops(params: float, tokens: float, recompute: Recompute = "none") -> float:
    """Total FLOPs of a run: tokens × 6 × params (× 8 with full recomputation)."""
    return tokens * flops_per_token_factor(recompute) * params


def training_seconds(flops: float, gpus: int, peak_tflops: float, mfu: float) -> float:
    """Wall-clock seconds without failures: flops / (GPUs × peak FLOP/s × MFU).

    With full recomputation the FLOPs include the recomputed forward, so `mfu` is then the
    hardware FLOPs utilisation that Megatron-style throughput logs report.
    """
    return flops / (gpus * peak_tflops * 1e12 * mfu)


# ---------------------------------------------------------------------------------------
# Memory


@dataclass(kw_only=True, slots=True, frozen=True)
class Memory:
    """Bytes per GPU for one ZeRO stage and tp×pp layout."""

    zero_stage: int
    tp: int
    pp: int
    dp: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float | None  # None when the model shape is unknown
    cp: int = 1
    ep: int = 1

    @property
    def total_bytes(self) -> float:
        """Sum of the four parts (activations counted as 0 when unknown)."""
        return (
            self.params_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + (self.activations_bytes or 0.0)
        )


def model_state_bytes(
    params: float, *, zero_stage: int, dp: int, tp: int = 1, pp: int = 1
) -> tuple[float, float, float]:
    """Bytes per GPU of parameters, gradients and optimizer state, mixed-precision AdamW.

    ZeRO paper (Rajbhandari et al. 2020) section 3.1: with Ψ parameters, 16-bit weights take
    2Ψ bytes, 16-bit gradients 2Ψ, and AdamW's fp32 master weights, momentum and variance
    KΨ with K = 12. Tensor and pipeline parallelism first split the model, so each GPU holds
    Ψ' = Ψ / (tp × pp). ZeRO then partitions over the dp data-parallel replicas:
    stage 0: 2Ψ' + 2Ψ' + 12Ψ'; stage 1 (P_os): 2Ψ' + 2Ψ' + 12Ψ'/dp;
    stage 2 (P_os+g): 2Ψ' + (2 + 12)Ψ'/dp; stage 3 (P_os+g+p): (2 + 2 + 12)Ψ'/dp.

    Returns:
        (parameter bytes, gradient bytes, optimizer-state bytes) per GPU.

    Raises:
        ValueError: a stage outside 0-3 or a non-positive degree.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage}")
    if dp <= 0 or tp <= 0 or pp <= 0:
        raise ValueError(f"dp, tp, pp: must be positive, got dp={dp} tp={tp} pp={pp}")
    shard = params / (tp * pp)
    p, g, o = 2.0 * shard, 2.0 * shard, 12.0 * shard
    if zero_stage >= 1:
        o /= dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        p /= dp
    return p, g, o


def activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
) -> float:
    """Bytes of activations one transformer layer keeps for the backward pass.

    Korthikanti et al. 2022, table 2, with s = sequence length, b = micro-batch size,
    h = hidden size, a = attention heads, t = tensor-parallel degree (16-bit activations,
    1-byte dropout masks):
    no parallelism: sbh(34 + 5as/h);
    tensor parallel: sbh(10 + 24/t + 5as/(ht));
    tensor + sequence parallel: sbh/t × (34 + 5as/h);
    tensor parallel + selective recomputation: sbh(10 + 24/t);
    tensor + sequence parallel + selective recomputation: 34 sbh/t;
    full recomputation: 2sbh (only the layer's input is kept; t-fold less with sequence
    parallelism, which splits that input along the sequence).
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = float(s * b * h)
    if recompute == "full":
        return 2 * sbh / t if sequence_parallel else 2 * sbh
    if recompute == "selective":
        return 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def activation_bytes_per_gpu(
    model: ModelShape,
    *,
    micro_batch: int,
    tp: int,
    pp: int,
    sequence_parallel: bool,
    recompute: Recompute,
    cp: int = 1,
) -> float:
    """Peak activation bytes on the busiest GPU: the first pipeline stage.

    Korthikanti et al. 2022 section 4.2.3: under the 1F1B schedule the first stage holds
    the activations of pp micro-batches in flight, each over L/pp layers, so it stores L
    layers' worth whatever pp is: L × (bytes per layer). Without a pipeline it is the same
    L layers for the one micro-batch. The embedding and loss terms (a few sbh) are left out.
    Context parallelism keeps s/cp tokens (and s/cp query rows of the attention scores)
    per GPU, so every term divides by cp; the all-gathered keys and values of the whole
    sequence (16-bit, 2 × sbh/t) stay for backward (the all-gather form, context.py).
    """
    del pp  # the first stage's activations do not depend on pp; kept for the call's clarity
    per = activation_bytes_per_layer(
        seq_len=model.seq_len,
        micro_batch=micro_batch,
        hidden=model.hidden,
        heads=model.heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    if cp > 1 and recompute != "full":
        per = per / cp + 4.0 * model.seq_len * micro_batch * model.hidden / tp
    elif cp > 1:
        per = per / cp
    return model.layers * per


def memory_table(cfg: PlanConfig) -> list[Memory]:
    """Per-GPU memory for every configured tp×pp layout under ZeRO stages 0-3."""
    rows: list[Memory] = []
    for tp, pp in cfg.layouts:
        dp = cfg.gpus // (tp * pp * cfg.cp)
        acts = (
            activation_bytes_per_gpu(
                cfg.model,
                micro_batch=cfg.micro_batch,
                tp=tp,
                pp=pp,
                sequence_parallel=cfg.sequence_parallel,
                recompute=cfg.recompute,
                cp=cfg.cp,
            )
            if cfg.model is not None
            else None
        )
        dense = cfg.n_params - cfg.expert_params
        for stage in (0, 1, 2, 3):
            # cp GPUs hold the same weights as dp replicas do, so ZeRO shards over dp × cp;
            # experts are split over ep first and ZeRO-sharded over the remaining dp·cp/ep.
            p, g, o = model_state_bytes(dense, zero_stage=stage, dp=dp * cfg.cp, tp=tp, pp=pp)
            if cfg.expert_params:
                ep_, eg, eo = model_state_bytes(
                    cfg.expert_params / cfg.ep,
                    zero_stage=stage,
                    dp=dp * cfg.cp // cfg.ep,
                    tp=tp,
                    pp=pp,
                )
                p, g, o = p + ep_, g + eg, o + eo
            rows.append(
                Memory(
                    zero_stage=stage,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    params_bytes=p,
                    grads_bytes=g,
                    optimizer_bytes=o,
                    activations_bytes=acts,
                    cp=cfg.cp,
                    ep=cfg.ep,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------
# Failures and checkpoints


def failure_probability_per_day(rate_per_gpu_day: float, gpus: int) -> float:
    """Probability that at least one of `gpus` GPUs fails in a day: 1 − (1 − p)^GPUs."""
    return 1.0 - (1.0 - rate_per_gpu_day) ** gpus


def failures_per_day(rate_per_gpu_day: float, gpus: int) -> float:
    """Expected failures per day of the whole job: λ = −GPUs × ln(1 − p).

    Each GPU survives a day with probability 1 − p; with exponential lifetimes that is a
    failure rate of −ln(1 − p) per GPU-day (≈ p for small p), and the job's rate is the sum.
    The same λ gives back P(no failure in a day) = e^−λ = (1 − p)^GPUs.
    """
    return -gpus * math.log1p(-rate_per_gpu_day)


def mtbf_seconds(rate_per_gpu_day: float, gpus: int) -> float:
    """Mean time between failures of the job: 1 / λ days (infinite when p = 0)."""
    lam = failures_per_day(rate_per_gpu_day, gpus)
    return math.inf if lam == 0 else SECONDS_PER_DAY / lam


def optimal_checkpoint_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young's interval sqrt(2 × save_cost × MTBF) that minimises the expected lost work.

    Between checkpoints the job pays save_cost per interval τ and loses τ/2 on average per
    failure; the sum save_cost/τ + τ/(2 MTBF) is least at τ = sqrt(2 δ M) (Young 1974;
    Daly 2006 shows the first-order form is within a few percent while δ ≪ M).
    A free checkpoint (δ = 0) would be taken every step: the interval is 0.
    """
    if math.isinf(mtbf_s):
        return math.inf
    return lifecycle.young_daly_s(save_cost_s, mtbf_s)  # the driver's formula, the same T


def goodput(interval_s: float, save_cost_s: float, restart_cost_s: float, mtbf_s: float) -> float:
    """Fraction of wall-clock time that advances training, to first order.

    A segment is τ of work plus δ of saving; a failure, on average once per MTBF M, costs
    half a segment of redone work plus the restart R. So
    goodput = τ/(τ + δ) × (1 − ((τ + δ)/2 + R)/M), clipped to [0, 1].
    """
    if math.isinf(mtbf_s):
        return 1.0  # no failures: Young's interval is infinite, so nothing is ever saved
    seg = interval_s + save_cost_s
    if seg == 0:
        return max(0.0, 1.0 - restart_cost_s / mtbf_s)
    useful = interval_s / seg * (1.0 - (seg / 2.0 + restart_cost_s) / mtbf_s)
    return min(1.0, max(0.0, useful))


# ---------------------------------------------------------------------------------------
# The whole plan


@dataclass(kw_only=True, slots=True)
class Plan:
    """The planner's answer; `unbroken plan --json` prints it as a dict."""

    params: float
    tokens: float
    gpus: int
    gpu: GPUSpec
    mfu: float
    recompute: Recompute
    total_flops: float
    achieved_tflops_per_gpu: float
    compute_days: float
    gpu_hours: float
    failure_probability_per_day: float
    failures_per_day: float
    mtbf_hours: float
    expected_failures: float
    checkpoint_interval_min: float
    # what the driver sends while the rings and buddies serve every failure: Young/Daly at
    # the storage-served MTBF's prior, within the driver's default floor and ceiling
    persist_interval_min: float
    goodput: float
    wall_days: float
    memory: list[Memory]

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict, memory rows in GB."""
        return {
            "params": self.params,
            "tokens": self.tokens,
            "gpus": self.gpus,
            "gpu": {
                "name": self.gpu.name,
                "peak_tflops": self.gpu.peak_tflops,
                "memory_gb": self.gpu.memory_gb,
            },
            "mfu": self.mfu,
            "recompute": self.recompute,
            "total_flops": self.total_flops,
            "achieved_tflops_per_gpu": self.achieved_tflops_per_gpu,
            "compute_days": self.compute_days,
            "gpu_hours": self.gpu_hours,
            "failure_probability_per_day": self.failure_probability_per_day,
            "failures_per_day": self.failures_per_day,
            "mtbf_hours": _finite_or_none(self.mtbf_hours),
            "expected_failures": self.expected_failures,
            "checkpoint_interval_min": _finite_or_none(self.checkpoint_interval_min),
            "persist_interval_min": self.persist_interval_min,
            "goodput": self.goodput,
            "wall_days": _finite_or_none(self.wall_days),
            "memory": [
                {
                    "zero_stage": m.zero_stage,
                    "tp": m.tp,
                    "pp": m.pp,
                    "dp": m.dp,
                    "cp": m.cp,
                    "ep": m.ep,
                    "params_gb": m.params_bytes / GB,
                    "grads_gb": m.grads_bytes / GB,
                    "optimizer_gb": m.optimizer_bytes / GB,
                    "activations_gb": (
                        None if m.activations_bytes is None else m.activations_bytes / GB
                    ),
                    "total_gb": m.total_bytes / GB,
                    "fits": m.total_bytes <= self.gpu.memory_gb * GB,
                }
                for m in self.memory
            ],
        }


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def make_plan(cfg: PlanConfig) -> Plan:
    """Compute every estimate of the plan from its config.

    Args:
        cfg: the validated config.

    Returns:
        The plan: compute days and GPU hours, failure rate and MTBF, Young's checkpoint
        interval, the goodput it leaves and the wall-clock days that follow, and the memory
        table.
    """
    gpu = lookup_gpu(cfg.gpu)
    n = cfg.n_params
    flops = training_flops(n, cfg.tokens, cfg.recompute)
    seconds = training_seconds(flops, cfg.gpus, gpu.peak_tflops, cfg.mfu)
    mtbf = mtbf_seconds(cfg.failure_rate_per_gpu_day, cfg.gpus)
    interval = optimal_checkpoint_interval_s(cfg.save_cost_s, mtbf)
    gp = goodput(interval, cfg.save_cost_s, cfg.restart_cost_s, mtbf)
    wall = seconds / gp if gp > 0 else math.inf
    lam = failures_per_day(cfg.failure_rate_per_gpu_day, cfg.gpus)
    return Plan(
        params=n,
        tokens=cfg.tokens,
        gpus=cfg.gpus,
        gpu=gpu,
        mfu=cfg.mfu,
        recompute=cfg.recompute,
        total_flops=flops,
        achieved_tflops_per_gpu=gpu.peak_tflops * cfg.mfu,
        compute_days=seconds / SECONDS_PER_DAY,
        gpu_hours=seconds * cfg.gpus / 3600.0,
        failure_probability_per_day=failure_probability_per_day(
            cfg.failure_rate_per_gpu_day, cfg.gpus
        ),
        failures_per_day=lam,
        mtbf_hours=mtbf / 3600.0,
        expected_failures=lam * (wall if math.isfinite(wall) else seconds) / SECONDS_PER_DAY,
        checkpoint_interval_min=interval / 60.0,
        persist_interval_min=lifecycle.persist_interval_at_s(
            cfg.save_cost_s, lifecycle.PRIOR_MTBF_S
        )
        / 60.0,
        goodput=gp,
        wall_days=wall / SECONDS_PER_DAY,
        memory=memory_table(cfg),
    )
