"""Decoder-only transformer (RMSNorm, RoPE, SwiGLU, causal SDPA) shaped for 3D parallelism.

Layers live in a `ModuleDict` keyed by their global index, so a pipeline stage that keeps only
some of them (and drops the embedding, final norm or output head) still names every parameter
by the same fully-qualified name as the whole model: checkpoints from any pipeline layout load
into any other. The attention reshapes with `-1` heads so a tensor-parallel shard that holds
`n_heads / tp` heads needs no special case.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from unbroken.trainer.config import ModelConfig


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Cosine and sine of the rotary angles, shape (max_seq_len, head_dim // 2, 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of `x` (batch, seq, heads, head_dim) by position."""
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

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """Attend causally; `x` is (batch, seq, dim) or a tp shard of its heads."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
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


class Block(nn.Module):
    """Pre-norm transformer block, optionally recomputed in backward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.checkpointing = False

    def _body(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """One block; with `checkpointing`, activations are recomputed in backward."""
        if self.checkpointing and torch.is_grad_enabled():
            out = checkpoint(self._body, x, rope, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self._body(x, rope)


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (missing parts are `None`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "rope", rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deterministic init from the current torch RNG (seed it first for parity)."""
        std = 0.02
        depth_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.trunc_normal_(p, std=depth_std, a=-3 * depth_std, b=3 * depth_std)
            else:
                nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward instead of storing them."""
        for block in self.layers.values():
            assert isinstance(block, Block)
            block.checkpointing = enabled

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
