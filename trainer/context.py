"""Context parallelism: every sequence split over the cp ranks, attention over all of it.

torch's own `torch.distributed.tensor.experimental.context_parallel` dispatches the CUDA
flash/efficient SDPA kernels only (ring attention on NCCL); on this CPU/gloo build SDPA runs
`_scaled_dot_product_flash_attention_for_cpu`, which it does not handle. So this is the
all-gather form Llama 3 trained with (Dubey et al. 2024, section 3.3.2): each rank keeps
its queries and gathers every rank's keys and values (autograd: the gradient is summed over
the group and each rank keeps its slice; gloo has no reduce-scatter, so all-reduce + slice).

Load balance under the causal mask: the sequence is cut into 2·cp chunks and rank i holds
chunks i and 2·cp−1−i (an early and a late one), so every rank's queries see about the same
number of unmasked keys. Rotary angles are taken at the chunks' global positions and the
mask compares global positions, so the result equals one process attending to the whole
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2·cp sequence chunks held by cp rank `rank`."""
    return rank, 2 * cp - 1 - rank


def positions(seq_total: int, cp: int, rank: int) -> torch.Tensor:
    """Global token positions held by cp rank `rank` of a `seq_total`-token sequence."""
    c = seq_total // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat((torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)))


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's part of a tensor whose dim `dim` is the whole sequence."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp, rank)
    return torch.cat((chunks[a], chunks[b]), dim=dim)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (batch, heads, seq, head_dim); backward sums and slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        n = dist.get_world_size(group)
        ctx.group, ctx.n, ctx.rank = group, n, dist.get_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        g = grad.contiguous()
        dist.all_reduce(g, group=ctx.group)
        mine = g.chunk(ctx.n, dim=2)[ctx.rank]
        return mine.contiguous(), None


@dataclass(kw_only=True, slots=True)
class ContextParallel:
    """One rank's place in its cp group; attention modules call it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    _pos: dict[int, torch.Tensor] = field(default_factory=dict)
    _all: dict[int, torch.Tensor] = field(default_factory=dict)

    def positions(self, seq_local: int) -> torch.Tensor:
        """Global positions of this rank's `seq_local` tokens."""
        if seq_local not in self._pos:
            self._pos[seq_local] = positions(seq_local * self.size, self.size, self.rank)
        return self._pos[seq_local]

    def _gathered_positions(self, seq_local: int) -> torch.Tensor:
        if seq_local not in self._all:
            total = seq_local * self.size
            self._all[seq_local] = torch.cat(
                [positions(total, self.size, r) for r in range(self.size)]
            )
        return self._all[seq_local]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of local queries over every rank's keys and values.

        Args:
            q, k, v: (batch, heads, seq_local, head_dim), rotary already applied.
        """
        seq = q.shape[2]
        k_all = _GatherSeq.apply(k, self.group)
        v_all = _GatherSeq.apply(v, self.group)
        qpos = self.positions(seq).to(q.device)
        kpos = self._gathered_positions(seq).to(q.device)
        mask = qpos[:, None] >= kpos[None, :]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
