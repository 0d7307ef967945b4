"""Configuration tree of the embedded trainer: model, parallelism, optimizer, data, run.

One source of truth: the CLI flags of `unbroken.trainer.run` map onto these dataclasses, and
every invariant the parallel engine relies on (dp × pp × tp equals the world, heads and widths
divide by tp, the batch divides into microbatches, enough microbatches and layers for the
pipeline) is checked here, before any process group exists, with a message naming the field
and the fix. This module imports no torch so the driver and the CLI can validate cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "ZBV")
# none; full: recompute whole blocks (every `ac_every`-th one); op: selective, per operator
# (matmul outputs are kept, the cheap elementwise/norm/softmax ops are recomputed).
AC_MODES: tuple[str, ...] = ("none", "full", "op")
OPTIMIZER_IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")
INIT_MODES: tuple[str, ...] = ("meta", "full")
# Schedules that place several (virtual) stages on each pipeline rank.
MULTI_STAGE_SCHEDULES: frozenset[str] = frozenset({"Interleaved1F1B", "ZBV"})
DP_MODES: tuple[str, ...] = ("zero3", "zero2", "replicate", "hsdp")
# titles of flag groups in `unbroken train --help`
DATA_OPTIM = "data and optimizer"
OUTPUT = "checkpoint and output"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Decoder-only transformer shape (byte-level vocabulary by default)."""

    dim: int = field(
        default=64, metadata={"unset": True, "help": "model width (unset: the preset's)"}
    )
    n_layers: int = field(
        default=4,
        metadata={
            "unset": True,
            "flag": "--layers",
            "help": "transformer blocks (unset: the preset's)",
        },
    )
    n_heads: int = field(
        default=4, metadata={"unset": True, "help": "attention heads (unset: the preset's)"}
    )
    ffn_hidden: int = field(
        default=0,
        metadata={
            "unset": True,
            "help": "SwiGLU hidden width (0: 8/3 x dim rounded up to a multiple of 32; unset: "
            "the preset's)",
        },
    )
    vocab_size: int = field(
        default=256,
        metadata={"unset": True, "help": "vocabulary (>= 256, the bytes; unset: the preset's)"},
    )
    max_seq_len: int = field(
        default=64,
        metadata={
            "unset": True,
            "help": "longest sequence (unset: the preset's, or --seq-len if longer)",
        },
    )
    norm_eps: float = field(
        default=1e-5, metadata={"unset": True, "help": "RMSNorm epsilon (unset: the preset's)"}
    )
    rope_theta: float = field(
        default=10000.0, metadata={"unset": True, "help": "rotary base (unset: the preset's)"}
    )
    moe_experts: int = field(
        default=0,
        metadata={
            "unset": True,
            "help": "0: dense SwiGLU; E > 0: a mixture of E SwiGLU experts per block (unset: "
            "the preset's)",
        },
    )
    moe_top_k: int = field(
        default=2,
        metadata={"unset": True, "help": "experts each token is routed to (unset: the preset's)"},
    )
    moe_aux_weight: float = field(
        default=0.01,
        metadata={"unset": True, "help": "weight of the load-balancing loss (unset: the preset's)"},
    )

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "moe_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_experts < 0 or (self.moe_experts and self.moe_top_k > self.moe_experts):
            raise ValueError(
                f"model.moe_experts ({self.moe_experts}) must be 0 (dense) or >= "
                f"model.moe_top_k ({self.moe_top_k})"
            )
        if self.moe_aux_weight < 0:
            raise ValueError(f"model.moe_aux_weight must be >= 0, got {self.moe_aux_weight}")
        if self.ffn_hidden < 0:
            raise ValueError(f"model.ffn_hidden must be >= 0 (0 = default), got {self.ffn_hidden}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}); "
                "pick a head count that divides the width"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.dim / model.n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.vocab_size < 256:
            raise ValueError(
                f"model.vocab_size must be >= 256 for the byte tokenizer, got {self.vocab_size}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        """SwiGLU hidden width."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return ((8 * self.dim // 3) + 31) // 32 * 32

    @property
    def is_moe(self) -> bool:
        """Mixture-of-experts feed-forward layers."""
        return self.moe_experts > 0

    def n_params(self, *, active: bool = False) -> int:
        """Number of parameters (embedding and output projection are untied).

        Args:
            active: count only the experts one token passes through (top-k of E).
        """
        ffn = 3 * self.dim * self.hidden
        if self.is_moe:
            ffn = (
                ffn * (self.moe_top_k if active else self.moe_experts) + self.dim * self.moe_experts
            )
        per_layer = 4 * self.dim * self.dim + ffn + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N plus attention 12·L·H·Q·T (PaLM appendix B).

        N excludes the input embedding (a lookup, not a matmul) and counts only the experts
        a token is routed to.
        """
        n = self.n_params(active=True) - self.vocab_size * self.dim
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return float(6 * n + attention)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=4, n_heads=4, max_seq_len=64),
    "small": ModelConfig(dim=256, n_layers=8, n_heads=8, max_seq_len=256),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "1b": ModelConfig(dim=2048, n_layers=20, n_heads=16, max_seq_len=2048),
    # Mixture of experts: 8 SwiGLU experts of a quarter width per block, top-2 routing.
    "moe-tiny": ModelConfig(
        dim=64, n_layers=4, n_heads=4, max_seq_len=64, ffn_hidden=64, moe_experts=8
    ),
    "moe-small": ModelConfig(
        dim=256, n_layers=8, n_heads=8, max_seq_len=256, ffn_hidden=256, moe_experts=8
    ),
}


def preset(name: str, **overrides: int | float) -> ModelConfig:
    """A named model size, optionally with some fields replaced.

    Raises:
        ValueError: the preset name is unknown or an override is invalid.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How the world is split: dp × cp × pp × tp ranks (ep inside dp), schedule, ZeRO mode.

    Context parallelism (cp) splits every sequence over cp ranks; they hold the same
    parameters, so FSDP shards (and averages gradients) over dp × cp. Expert parallelism (ep)
    borrows its ranks from the dp shard group, as in torchtitan: the experts of each MoE layer
    are split over ep consecutive dp ranks, and tokens travel to them by all-to-all. So ep
    must divide dp / dp_replicate; an elastic shrink of dp lowers ep with it (flags.py).
    """

    dp: int = field(default=1, metadata={"help": "data-parallel degree"})
    cp: int = field(default=1, metadata={"help": "context-parallel degree (splits each sequence)"})
    ep: int = field(
        default=1,
        metadata={
            "help": "expert-parallel degree for MoE presets (ranks borrowed from dp; must "
            "divide it)"
        },
    )
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree"})
    dp_replicate: int = field(
        default=1, metadata={"help": "HSDP: replicate groups within dp (--dp-mode hsdp)"}
    )
    dp_mode: str = field(default="zero3", metadata={"choices": DP_MODES, "help": "ZeRO mode"})
    schedule: str = field(
        default="1F1B", metadata={"choices": SCHEDULES, "help": "pipeline schedule"}
    )
    microbatches: int = field(
        default=1,
        metadata={"unset": True, "help": "microbatches per step (unset or 0: pp, 1 without pp)"},
    )
    sequence_parallel: bool = field(
        default=True,
        metadata={"negate": "--no-sequence-parallel", "help": "no sequence parallel with tp"},
    )
    activation_checkpointing: str = field(
        default="none",
        metadata={
            "choices": AC_MODES,
            "nargs": "?",
            "const": "full",
            "help": "recompute in backward: full blocks, or op (selective: keep matmul "
            "outputs); the bare flag means full",
        },
    )
    ac_every: int = field(
        default=1,
        metadata={"help": "with full: recompute every k-th block only (1: all of them)"},
    )
    cpu_offload: bool = field(default=False, metadata={"help": "FSDP2 CPU offload"})
    compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each block (off by default: no gain on CPU, bench)"},
    )

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"parallel.activation_checkpointing {self.activation_checkpointing!r} is "
                f"unknown; choose one of {list(AC_MODES)}"
            )
        for name in ("dp", "cp", "ep", "pp", "tp", "dp_replicate", "microbatches", "ac_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.schedule {self.schedule!r} is unknown; choose one of {list(SCHEDULES)}"
            )
        if self.dp_mode not in DP_MODES:
            raise ValueError(
                f"parallel.dp_mode {self.dp_mode!r} is unknown; choose one of {list(DP_MODES)}"
            )
        if self.dp_mode == "hsdp":
            if self.dp % self.dp_replicate or self.dp_replicate == self.dp:
                raise ValueError(
                    f"parallel.dp_replicate ({self.dp_replicate}) must divide parallel.dp "
                    f"({self.dp}) and leave a shard group of at least 2 for dp_mode='hsdp'"
                )
        elif self.dp_replicate != 1:
            raise ValueError(
                "parallel.dp_replicate is only used with dp_mode='hsdp'; set it to 1 "
                f"or set dp_mode='hsdp' (got dp_replicate={self.dp_replicate})"
            )
        if self.pp > 1 and self.microbatches < self.pp:
            raise ValueError(
                f"parallel.microbatches ({self.microbatches}) must be >= parallel.pp "
                f"({self.pp}) so every pipeline stage has work; raise --microbatches"
            )
        if self.ep > 1:
            if self.dp_shard % self.ep:
                raise ValueError(
                    f"parallel.ep ({self.ep}) must divide the dp shard group (parallel.dp / "
                    f"parallel.dp_replicate = {self.dp_shard}): expert parallelism borrows "
                    "its ranks from data parallelism; raise --dp or lower --ep"
                )
            if self.cp > 1 or self.tp > 1:
                raise ValueError(
                    f"parallel.ep ({self.ep}) cannot be combined with parallel.cp ({self.cp}) "
                    f"or parallel.tp ({self.tp}) yet; use dp × ep × pp for MoE models"
                )

    @property
    def world_size(self) -> int:
        """dp × cp × pp × tp (ep lives inside dp)."""
        return self.dp * self.cp * self.pp * self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks of one FSDP shard group within dp (1 under pure replication)."""
        if self.dp_mode == "replicate":
            return 1
        return self.dp // self.dp_replicate

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages held by each pp rank (2 for interleaved and V schedules)."""
        return 2 if self.pp > 1 and self.schedule in MULTI_STAGE_SCHEDULES else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm gradient clipping."""

    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr: float = field(
        default=3e-4, metadata={"help": "learning rate at the end of the decay (<= --lr)"}
    )
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps"})
    decay_steps: int = field(default=1000, metadata={"flag": None, "why": "--steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "global-norm gradient clipping (0 disables it; the norm is reported)"},
    )
    impl: str = field(
        default="foreach",
        metadata={
            "flag": "--optimizer-impl",
            "choices": OPTIMIZER_IMPLS,
            "help": "AdamW kernels: for-loop, foreach (multi-tensor) or fused",
        },
    )

    def __post_init__(self) -> None:
        if self.impl not in OPTIMIZER_IMPLS:
            raise ValueError(
                f"optim.impl {self.impl!r} is unknown; choose one of {list(OPTIMIZER_IMPLS)}"
            )
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr], got {self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError(
                "optim.warmup_steps must be >= 0 and optim.decay_steps >= 1, got "
                f"{self.warmup_steps} and {self.decay_steps}"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1/beta2 must be in [0, 1), got {self.beta1}/{self.beta2}")
        if self.max_grad_norm < 0:
            raise ValueError(f"optim.max_grad_norm must be >= 0, got {self.max_grad_norm}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Byte-level text data: a file or folder, or the Python stdlib sources by default."""

    path: str | None = field(
        default=None,
        metadata={
            "flag": "--data",
            "help": "text file or folder (unset: the Python standard library's own .py files)",
        },
    )
    seq_len: int = field(default=64, metadata={"help": "tokens per sequence"})
    global_batch: int = field(
        default=8, metadata={"help": "sequences per optimizer step across all dp ranks"}
    )
    replica_batch: int = field(
        default=0,
        metadata={
            "help": "sequences per dp replica per step (0: unset). Set, the global batch "
            "follows the world (replica_batch x dp: a world shrunk by a lost replica trains a "
            "smaller batch) and the learning rate scales with it, linearly against "
            "data.global_batch; unset, the global batch stays data.global_batch at any dp "
            "(each replica takes a larger share)"
        },
    )
    max_corpus_bytes: int = field(default=4 << 20, metadata={"help": "bytes of text read"})
    seed: int = field(default=1234, metadata={"flag": "--data-seed", "help": "data order seed"})

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.global_batch < 1:
            raise ValueError(f"data.global_batch must be >= 1, got {self.global_batch}")
        if self.replica_batch < 0:
            raise ValueError(f"data.replica_batch must be >= 0, got {self.replica_batch}")
        if self.max_corpus_bytes < 1024:
            raise ValueError(f"data.max_corpus_bytes must be >= 1024, got {self.max_corpus_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The root: one training job's full configuration, cross-checked."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"group": "model"})
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig, metadata={"group": "parallelism"}
    )
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"group": DATA_OPTIM})
    data: DataConfig = field(default_factory=DataConfig, metadata={"group": DATA_OPTIM})
    steps: int = field(default=100, metadata={"group": "model", "help": "optimizer steps to run"})
    seed: int = field(default=0, metadata={"group": "model", "help": "model init seed"})
    dtype: str = field(
        default="auto",
        metadata={
            "group": "model",
            "choices": ("auto", "fp32", "bf16"),
            "help": "auto: bf16 mixed precision on GPU, fp32 on CPU",
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "group": "model",
            "choices": ("auto", "cpu", "cuda"),
            "help": "auto: cuda if available, else cpu",
        },
    )
    init: str = field(
        default="meta",
        metadata={
            "group": "model",
            "choices": INIT_MODES,
            "help": "meta: each rank materialises only its own shards; full: the whole model first",
        },
    )
    trainer: str = field(
        default="gpt3d",
        metadata={"group": "model", "help": "trainer plugin (entry point name)"},
    )
    log_every: int = field(
        default=10, metadata={"group": OUTPUT, "help": "log metrics every N steps"}
    )
    flash_every: int | None = field(
        default=None,
        metadata={
            "group": OUTPUT,
            "help": "flash-save every N steps into the agent's memory (unset: 1 under an "
            "agent with a flash store, else off; 0: off, and no flash restore)",
        },
    )
    fingerprint_every: int = field(
        default=25,
        metadata={
            "group": OUTPUT,
            "help": "hash every rank's whole state (parameters and optimizer state, on its "
            "device) every N steps and after each persisted save, so the driver can compare "
            "replicas and find silent data corruption (docs/sdc.md); 0: off",
        },
    )
    flash_ab: int = field(
        default=0,
        metadata={
            "group": OUTPUT,
            "help": "measure what the flash saves cost this job: alternate N steps with "
            "memory saves and N without (persisted and requested saves still happen); each "
            "metrics row says which (flash_block). 0: off",
        },
    )

    def __post_init__(self) -> None:
        m, p, d = self.model, self.parallel, self.data
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.flash_every is not None and self.flash_every < 0:
            raise ValueError(f"flash_every must be >= 0 (--flash-every), got {self.flash_every}")
        if self.fingerprint_every < 0:
            raise ValueError(
                f"fingerprint_every must be >= 0 (--fingerprint-every; 0: off), "
                f"got {self.fingerprint_every}"
            )
        if self.flash_ab < 0:
            raise ValueError(f"flash_ab must be >= 0 (--flash-ab), got {self.flash_ab}")
        if self.init not in INIT_MODES:
            raise ValueError(f"init must be one of {list(INIT_MODES)}; got {self.init!r}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be one of auto, fp32, bf16; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda; got {self.device!r}")
        if m.n_heads % p.tp:
            raise ValueError(
                f"model.n_heads ({m.n_heads}) must be divisible by parallel.tp ({p.tp}); "
                "choose a tp that divides the head count"
            )
        if m.hidden % p.tp:
            raise ValueError(
                f"model.ffn_hidden ({m.hidden}) must be divisible by parallel.tp ({p.tp})"
            )
        if m.vocab_size % p.tp:
            raise ValueError(
                f"model.vocab_size ({m.vocab_size}) must be divisible by parallel.tp ({p.tp})"
            )
        if d.seq_len % (2 * p.cp) and p.cp > 1:
            raise ValueError(
                f"data.seq_len ({d.seq_len}) must be divisible by 2 × parallel.cp "
                f"({2 * p.cp}): each cp rank takes two chunks (load-balanced causal mask)"
            )
        if p.tp > 1 and p.sequence_parallel and (d.seq_len // p.cp) % p.tp:
            raise ValueError(
                f"data.seq_len / parallel.cp ({d.seq_len // p.cp}) must be divisible by "
                f"parallel.tp ({p.tp}) with sequence parallel; change --seq-len or pass "
                "--no-sequence-parallel"
            )
        if p.ep > 1 and (not m.is_moe or m.moe_experts % p.ep):
            raise ValueError(
                f"model.moe_experts ({m.moe_experts}) must be a positive multiple of "
                f"parallel.ep ({p.ep}); a dense model has no experts to shard (pick a moe preset)"
            )
        if m.is_moe and p.tp > 1:
            raise ValueError(
                f"parallel.tp ({p.tp}) is not supported with a mixture-of-experts model yet; "
                "shard the experts with --ep instead"
            )
        if d.seq_len > m.max_seq_len:
            raise ValueError(
                f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})"
            )
        if not d.replica_batch and d.global_batch % p.dp:
            raise ValueError(
                f"data.global_batch ({d.global_batch}) must be divisible by parallel.dp "
                f"({p.dp}); each dp rank takes an equal slice (or set data.replica_batch)"
            )
        local_batch = self.step_batch // p.dp
        what = "data.replica_batch" if d.replica_batch else "data.global_batch / parallel.dp"
        if local_batch % p.microbatches:
            raise ValueError(
                f"the per-dp-rank batch ({what} = {local_batch}) must "
                f"be divisible by parallel.microbatches ({p.microbatches})"
            )
        n_stages = p.pp * p.stages_per_rank
        if m.n_layers < n_stages:
            raise ValueError(
                f"model.n_layers ({m.n_layers}) must be >= the number of pipeline stages "
                f"({n_stages} = pp {p.pp} × {p.stages_per_rank} per rank for {p.schedule})"
            )

    @property
    def step_batch(self) -> int:
        """Sequences per optimizer step in this world: data.global_batch, or
        data.replica_batch x dp when that is set."""
        d = self.data
        return d.replica_batch * self.parallel.dp if d.replica_batch else d.global_batch

    @property
    def lr_scale(self) -> float:
        """The learning rate's factor in this world: the step's batch against the batch
        the rate is set for (linear scaling; 1 unless data.replica_batch is set)."""
        return self.step_batch / self.data.global_batch

    def uses_cuda(self) -> bool:
        """Whether this job runs on CUDA: asked for, or `auto` with a GPU present."""
        import torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def check_world(self, world_size: int) -> None:
        """Check that dp × cp × pp × tp equals the number of processes.

        Raises:
            ValueError: the product differs from `world_size`.
        """
        p = self.parallel
        if p.world_size != world_size:
            raise ValueError(
                f"parallel.dp × parallel.cp × parallel.pp × parallel.tp = "
                f"{p.dp}×{p.cp}×{p.pp}×{p.tp} = "
                f"{p.world_size} must equal the world size ({world_size}); change the "
                "layout or the number of processes"
            )
