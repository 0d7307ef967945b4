"""Mixture of experts: top-k routing, a per-sequence load-balancing loss, expert parallelism.

Each MoE layer holds E SwiGLU experts as stacked weights (E, hidden, dim) and a router. A
token goes to its top-k experts (softmax over the router logits, the k weights renormalised
to sum to 1) and comes back as the weighted sum of their outputs.

Load balancing (Switch Transformer, Fedus et al. 2021, eq. 4) is computed per sequence and
averaged over sequences (the "sequence-wise" form of DeepSeek-V3): E · Σ_e f_e · P_e with
f_e the fraction of the sequence's k·s assignments that went to expert e and P_e its mean
router probability. Per sequence, so a batch split over dp ranks or microbatches gives the
same total as one process, which is what makes ep/dp parity exact. The loss enters training
the way Megatron-LM's `MoEAuxLossAutoScaler` does: the layer's output carries it into
backward (its gradient is `aux_weight · aux_scale`), so it works under a pipeline schedule
that only sees the final cross entropy.

Expert parallelism: with an `ep` group of n ranks, rank r keeps experts [r·E/n, (r+1)·E/n)
as a DTensor sharded on dim 0 over the ep mesh, so the checkpoint holds every expert once
with its global index and DCP reshards it to another ep. Tokens are sorted by expert and
travel to the owning rank by `all_to_all_single` (sizes exchanged first), are processed
there expert by expert, and come back the same way; autograd runs the exchange in reverse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from unbroken.trainer.config import ModelConfig


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with split sizes; backward sends gradients back the same way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `scale` (its loss weight)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full(ctx.aux_shape, ctx.scale, device=grad.device), None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a load-balancing loss; expert parallel over `ep`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, h = cfg.moe_experts, cfg.dim, cfg.hidden
        self.n_experts, self.top_k, self.aux_weight = e, cfg.moe_top_k, cfg.moe_aux_weight
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, h, d))
        self.w3 = nn.Parameter(torch.empty(e, h, d))
        self.w2 = nn.Parameter(torch.empty(e, d, h))
        self.ep_group: dist.ProcessGroup | None = None  # set by parallel.apply_ep
        self.ep_size, self.ep_rank = 1, 0
        self.aux_scale = 1.0  # 1 / microbatches under manual accumulation (gpt3d)
        self.last_aux: torch.Tensor | None = None

    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run rows of `x`, grouped by local expert (`counts` rows each), through them."""
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        outs = []
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())
            outs.append(h @ w2[e].t())
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token of `x` (batch, seq, dim) to its top-k experts and combine."""
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)

        counts_te = F.one_hot(idx, self.n_experts).sum(1).view(bsz, seq, -1)
        f = counts_te.float().mean(1) / self.top_k  # (batch, E): fraction of assignments
        p = probs.view(bsz, seq, -1).mean(1)  # (batch, E): mean router probability
        aux = (self.n_experts * (f * p).sum(-1)).mean()
        self.last_aux = aux.detach()

        flat = idx.reshape(-1)  # (T·k,) expert of each assignment
        order = flat.argsort(stable=True)
        src = order // self.top_k  # token of each sorted assignment
        sorted_x = tokens[src]
        per_expert = torch.bincount(flat, minlength=self.n_experts)
        if self.ep_group is None:
            y = self._experts(sorted_x, per_expert.tolist())
        else:
            y = self._dispatch(sorted_x, per_expert)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, src, y)
        if self.training and torch.is_grad_enabled() and self.aux_weight > 0:
            out = _AuxLoss.apply(out, aux, self.aux_weight * self.aux_scale)
        return out.view(bsz, seq, dim)

    def _dispatch(self, sorted_x: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Send assignments to the ranks owning their experts, compute, bring them back."""
        n, group = self.ep_size, self.ep_group
        local_e = self.n_experts // n
        # counts[r, j]: assignments this rank sends to expert j of rank r
        send_counts = per_expert.view(n, local_e)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(sorted_x, out_splits, in_splits, group)
        # `received` is grouped by source rank, then by local expert: regroup by expert.
        rc = recv_counts.tolist()
        chunks = received.split([c for row in rc for c in row])
        by_expert: list[torch.Tensor] = []
        sizes: list[int] = []
        for j in range(local_e):
            for r in range(n):
                by_expert.append(chunks[r * local_e + j])
            sizes.append(sum(rc[r][j] for r in range(n)))
        grouped = torch.cat(by_expert) if by_expert else received
        y = self._experts(grouped, sizes)
        # back to (source rank, expert) order
        pieces = y.split([rc[r][j] for j in range(local_e) for r in range(n)])
        back = [pieces[j * n + r] for r in range(n) for j in range(local_e)]
        y_src = torch.cat(back) if back else y
        return _AllToAll.apply(y_src, in_splits, out_splits, group)
