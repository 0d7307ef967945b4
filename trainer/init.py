"""Parameter initialisation that any shard can compute alone: meta-device init for big models.

The single-process reference used to draw every parameter from one RNG stream, so a rank
could only get its shard's values by building the whole model first (the 1b preset is
~4.4 GB fp32 per rank at init, a 70B model 280 GB). Here a value depends only on
(seed, parameter name, row block): each parameter is cut into blocks of whole rows along
dim 0 (about `BLOCK_ELEMS` elements each), and each block is drawn from its own generator
seeded with a CRC of the three. A rank that holds rows [a, b) of a shard draws only the
blocks that overlap them, so building a model on the meta device, sharding it (tp, FSDP,
ep, pipeline cut) and then `materialize`-ing it costs each rank its own shard's memory and
time, and gives bit-for-bit the weights of the whole model in one process.

Shard placements whose local rows are not one contiguous range of the global tensor
(FSDP's `_StridedShard` over a tensor-parallel shard of the same dim) fall back to drawing
the whole parameter on the host and keeping the local part (one parameter at a time, never
the model).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

BLOCK_ELEMS = 1 << 16
STD = 0.02


def _std(name: str, n_layers: int) -> float:
    """Truncated-normal std: 0.02, scaled by 1/sqrt(2L) for the residual projections."""
    if name.endswith(("wo.weight", "w2.weight", ".w2")):
        return STD / math.sqrt(2 * n_layers)
    return STD


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMS // max(1, row))


def values(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    n_layers: int,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Rows [a, b) (default: all) of parameter `name`'s initial value, fp32 on the CPU.

    Vectors (norm weights) are ones; matrices and expert stacks are truncated normals at
    ±3 std, drawn block by block so any row range costs only its own blocks.
    """
    a, b = rows if rows is not None else (0, shape[0])
    if len(shape) == 1:
        return torch.ones(b - a)
    if b <= a:
        return torch.empty((0, *shape[1:]))
    std = _std(name, n_layers)
    per = _rows_per_block(shape)
    first, last = a // per, (b - 1) // per
    parts = []
    g = torch.Generator()
    for blk in range(first, last + 1):
        lo, hi = blk * per, min(shape[0], (blk + 1) * per)
        g.manual_seed(zlib.crc32(f"{seed}/{name}/{blk}".encode()))
        t = torch.empty((hi - lo, *shape[1:]))
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
        parts.append(t)
    full = torch.cat(parts)
    start = a - first * per
    return full[start : start + (b - a)]


def _contiguous_rows(p: DTensor) -> bool:
    """Whether each placement is a plain Shard or Replicate (local data is one box)."""
    return all(type(pl) is Shard or not pl.is_shard() for pl in p.placements)


@torch.no_grad()
def fill_(p: torch.Tensor, name: str, seed: int, n_layers: int) -> None:
    """Write parameter `name`'s initial values into `p` (a tensor or this rank's DTensor
    shard), drawing only the rows this rank holds where the placement allows."""
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        p.copy_(values(name, shape, seed, n_layers).to(p.dtype))
        return
    local = p.to_local()
    if local.numel() == 0:
        return
    if not _contiguous_rows(p):
        full = values(name, shape, seed, n_layers)
        part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        local.copy_(part.to_local().to(local.dtype))
        return
    lshape, offset = compute_local_shape_and_global_offset(shape, p.device_mesh, p.placements)
    rows = values(name, shape, seed, n_layers, rows=(offset[0], offset[0] + lshape[0]))
    box = rows
    for d in range(1, len(shape)):
        box = box.narrow(d, offset[d], lshape[d])
    local.copy_(box.reshape(local.shape).to(local.dtype))


def materialize(module: nn.Module, device: torch.device, values: bool = True) -> None:
    """Allocate a meta-device (stage) model's parameters on `device` and initialise them.

    Only the local shards are allocated (`to_empty` after tensor parallel and FSDP have
    replaced the parameters with sharded DTensors). The module's `reset_parameters` then
    fills every parameter by name and rebuilds its non-persistent buffers; with `values`
    False only the buffers (a restore is about to overwrite every parameter: the caller
    fills them, `reset_parameters()`, if it does not).
    """
    module.to_empty(device=device)
    reset = getattr(module, "reset_parameters", None)
    assert callable(reset), "the engine's Transformer knows how to initialise itself"
    if values:
        reset()
    else:
        reset(values=False)
