"""Decoder-only transformer (RMSNorm, RoPE, SwiGLU or MoE, causal SDPA) shaped for 3D parallelism.

Layers live in a `ModuleDict` keyed by their global index, so a pipeline stage that keeps only
some of them (and drops the embedding, final norm or output head) still names every parameter
by the same fully-qualified name as the whole model: checkpoints from any pipeline layout load
into any other. The attention reshapes with `-1` heads so a tensor-parallel shard that holds
`n_heads / tp` heads needs no special case; under context parallelism (context.py) it sees
its two chunks of the sequence, attends to the keys and values all ranks gathered, and takes
its rotary angles at the chunks' global positions.

Initialisation is a function of (seed, parameter name, row block) only (init.py), so a rank
that materialises one shard of one stage from the meta device gets exactly the values the
whole model has in a single process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from unbroken.trainer import context, init
from unbroken.trainer.config import ModelConfig
from unbroken.trainer.moe import MoE


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Cosine and sine of the rotary angles, shape (max_seq_len, head_dim // 2, 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of `x` (batch, seq, heads, head_dim) by position.

    `table` holds the angles of positions 0.. (the first `seq` rows are used), or exactly
    one row per token of `x` when its tokens are not 0..seq-1 (context parallelism).
    """
    seq = x.shape[1]
    cos = table[:seq, :, 0].to(x.dtype)[None, :, None, :]
    sin = table[:seq, :, 1].to(x.dtype)[None, :, None, :]
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Multi-head causal self-attention through `scaled_dot_product_attention`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cp: context.ContextParallel | None = None  # set by parallel.apply_cp

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Attend causally; `x` is (batch, seq, dim) or a tp shard of its heads."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.cp is not None:
            rope = rope[self.cp.positions(seq).to(rope.device)]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.cp is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = self.cp.attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Selective (per-op) recomputation keeps the outputs of these and recomputes everything else
# (norms, rotary, activations, residual adds): the matmuls and attention are the expensive
# part, the rest is cheap to redo and holds most of the activation bytes (Korthikanti 2022).
_SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
    }
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _op_context() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


class Block(nn.Module):
    """Pre-norm transformer block, optionally recomputed in backward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward: nn.Module = MoE(cfg) if cfg.is_moe else FeedForward(cfg)
        self.checkpointing = "none"  # "none", "full" or "op" (config.AC_MODES)

    def _body(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """One block; with `checkpointing`, activations are recomputed in backward."""
        if self.checkpointing != "none" and torch.is_grad_enabled():
            kwargs: dict[str, Any] = {}
            if self.checkpointing == "op":
                kwargs["context_fn"] = _op_context
            out = checkpoint(self._body, x, rope, use_reentrant=False, **kwargs)
            assert isinstance(out, torch.Tensor)
            return out
        return self._body(x, rope)


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (missing parts are `None`)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.seed = seed
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self, values: bool = True) -> None:
        """Deterministic init from `seed` and each parameter's name (init.py), and the rotary
        table (only the table when not `values`); a module on the meta device is left alone
        (`init.materialize` fills it)."""
        rope = self.rope
        assert isinstance(rope, torch.Tensor)
        if rope.is_meta:
            return
        with torch.no_grad():
            rope.copy_(rope_table(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta))
            for name, p in self.named_parameters() if values else ():
                init.fill_(p, name, self.seed, self.cfg.n_layers)

    def set_activation_checkpointing(self, mode: str | bool, every: int = 1) -> None:
        """Recompute activations in backward instead of storing them.

        Args:
            mode: "full" (whole blocks), "op" (selective: keep matmul and attention outputs,
                recompute the rest) or "none"; True means "full".
            every: with "full", only every k-th block (by global layer index) is recomputed.
        """
        if isinstance(mode, bool):
            mode = "full" if mode else "none"
        for name, block in self.layers.items():
            assert isinstance(block, Block)
            on = mode != "full" or int(name) % every == 0
            block.checkpointing = mode if on else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = self.rope
        assert isinstance(rope, torch.Tensor)
        for block in self.layers.values():
            h = block(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers of a (stage) model."""
    return [m for m in model.modules() if isinstance(m, MoE)]
