"""State hashes for silent data corruption (docs/sdc.md), shared by a rank and its buddy.

A rank fingerprints its state after the optimizer step (trainer/sdc.py) with `tensor_hash`
and `fold`; the buddy that holds the rank's flash copy of that step recomputes the same
fingerprints from the copy's bytes (`opinion`) on its own device, a third opinion beside
the rank's and its replicas'. For that, a fingerprinted copy names in its manifest
(`SDC_META`) which of its tensors make up each replica key, in the order they were folded.

`tensor_hash` views a tensor as 32-bit words, multiplies word i by the odd weight 2i+1
(wrapping in 32 bits) and sums the products in 64 bits: a flip of any bit b of word i
changes the sum by ±2^b·(2i+1), never 0 modulo 2^32, so every single-bit flip changes it.

The *replay* is a small deterministic computation on the rank's own weights: each 2-D
parameter shard W times a fixed input x (`torch.nn.functional.linear`, the training
matmuls' path), summed into two float64 figures, the sum of squares and a fixed random
projection of the outputs. The rank computes it on its device, the buddy on its own from
the copy; they agree to rounding (`replay_agrees`) unless one device computes wrong. Its
figures travel as fingerprint keys under `REPLAY_PREFIX` (their IEEE bits), which replicas
never compare bitwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from unbroken.common.sdckeys import MASK64 as MASK64
from unbroken.common.sdckeys import REPLAY_PROJ, REPLAY_SS, float_bits
from unbroken.common.sdckeys import SDC_META as SDC_META

# elements hashed at once (the weights and products are this many 32-bit words at most)
CHUNK = 1 << 22
REPLAY_ROWS = 4  # rows of the fixed input

_weights: dict[str, torch.Tensor] = {}
_inputs: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _odd_weights(n: int, device: torch.device) -> torch.Tensor:
    """1, 3, 5, ... (2n - 1) as int32 on `device` (cached per device, grown as needed)."""
    key = str(device)
    w = _weights.get(key)
    if w is None or w.numel() < n:
        size = max(n, 1024)
        w = torch.arange(size, dtype=torch.int64, device=device).mul_(2).add_(1)
        w = w.to(torch.int32)  # wraps past 2^31: still odd
        _weights[key] = w
    return w[:n]


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """The 64-bit position-weighted sum of `t`'s 32-bit words, as a 0-d int64 on its device.

    Tensors whose byte size is not a multiple of 4 are hashed as bytes widened to int32.
    """
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw.to(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), CHUNK):
        part = words[start : start + CHUNK]
        if start:  # the position's weight, 2i+1, from the chunk's offset (wrapping)
            n = part.numel()
            w = torch.arange(start, start + n, dtype=torch.int64, device=part.device)
            w = w.mul_(2).add_(1).to(torch.int32)
        else:
            w = _odd_weights(part.numel(), part.device)
        total += (part * w).sum(dtype=torch.int64)
    return total


def hash_many(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`tensor_hash` of each of `tensors`, as one int64 tensor on `device`, in a few kernels
    per `CHUNK` words: the fingerprint of a model's hundreds of small tensors paid a chain
    of kernels per tensor (2.9 of its 4.2 ms for the tiny model on a CPU). Tensors of whole
    32-bit words on `device` are hashed in groups of at most `CHUNK` words (their words laid
    end to end, each multiplied by its weight within its own tensor, and summed per tensor:
    the same integers as `tensor_hash`, modulo 2^64); the rest one by one."""
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    group: list[tuple[int, torch.Tensor]] = []
    held = 0
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if flat.device != device or nbytes % 4 or not 0 < nbytes <= 4 * CHUNK:
            out[i] = tensor_hash(t).to(device)
            continue
        if held + nbytes // 4 > CHUNK:
            _hash_group(group, out)
            group, held = [], 0
        group.append((i, flat.contiguous().view(torch.uint8).view(torch.int32)))
        held += nbytes // 4
    _hash_group(group, out)
    return out


def _hash_group(group: Sequence[tuple[int, torch.Tensor]], out: torch.Tensor) -> None:
    """Hash `group` (index into `out`, the tensor's words) together into `out`."""
    if not group:
        return
    words = [w for _, w in group]
    weights, ends = _layout_weights(tuple(w.numel() for w in words), out.device)
    prod = torch.cat(words).mul_(weights)  # int32, wrapping like `tensor_hash`'s
    sums = prod.to(torch.int64).cumsum_(0)[ends]
    sums[1:] -= sums[:-1].clone()
    out[torch.tensor([i for i, _ in group], device=out.device)] = sums


_layouts: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}


def _layout_weights(
    sizes: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's odd weights end to end, and each tensor's last index (cached: a
    trainer's tensors keep their sizes)."""
    key = (sizes, str(device))
    got = _layouts.get(key)
    if got is None:
        weights = torch.cat([_odd_weights(n, device) for n in sizes])
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).sub_(1).to(device)
        if len(_layouts) > 64:
            _layouts.clear()
        got = _layouts[key] = (weights, ends)
    return got


def fold(hashes: Sequence[int]) -> int:
    """One 64-bit fingerprint of an ordered list of 64-bit tensor hashes."""
    h = hashlib.blake2b(digest_size=8)
    for x in hashes:
        h.update((x & MASK64).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def replayable(t: torch.Tensor) -> bool:
    """Whether the replay multiplies `t` (a 2-D floating-point shard with elements)."""
    return t.dim() == 2 and t.is_floating_point() and t.numel() > 0


def _fixed(cols: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed input (REPLAY_ROWS x cols) and projection (REPLAY_ROWS x rows) of a weight
    of shape (rows, cols), the same on every device (drawn on the CPU)."""
    key = (cols, rows, str(device))
    got = _inputs.get(key)
    if got is None:
        gen = torch.Generator().manual_seed(0x5DC0 + 7919 * cols + rows)
        x = torch.randn(REPLAY_ROWS, cols, generator=gen).to(device)
        u = torch.randn(REPLAY_ROWS, rows, generator=gen, dtype=torch.float64).to(device)
        if len(_inputs) > 4096:
            _inputs.clear()
        got = _inputs[key] = (x, u)
    return got


@torch.no_grad()
def replay(weights: Iterable[torch.Tensor], device: torch.device | None = None) -> dict[str, int]:
    """The replay of `weights` (2-D shards, others skipped) on `device` (None: where each
    lives), as fingerprint keys: {REPLAY_SS: bits, REPLAY_PROJ: bits}. In full float32
    precision whatever the process set (TF32 would be off by ~1e-3 from a CPU buddy)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return _replay(weights, device)
    finally:
        torch.set_float32_matmul_precision(precision)


def _replay(weights: Iterable[torch.Tensor], device: torch.device | None) -> dict[str, int]:
    ss: torch.Tensor | None = None
    proj: torch.Tensor | None = None
    for w in weights:
        if not replayable(w):
            continue
        dev = device if device is not None else w.device
        wf = w.detach().to(device=dev, dtype=torch.float32)
        x, u = _fixed(wf.shape[1], wf.shape[0], dev)
        y = torch.nn.functional.linear(x, wf).to(torch.float64)
        a, b = y.square().sum(), (y * u).sum()
        ss = a if ss is None else ss + a.to(ss.device)
        proj = b if proj is None else proj + b.to(proj.device)
    s, p = (float(ss), float(proj)) if ss is not None and proj is not None else (0.0, 0.0)
    return {REPLAY_SS: float_bits(s), REPLAY_PROJ: float_bits(p)}


def sdc_meta(step: int, keys: Sequence[tuple[str, Sequence[str]]], params: Sequence[str]) -> dict:
    """The manifest meta of a copy fingerprinted at `step` (see `SDC_META`)."""
    return {"step": int(step), "keys": [[k, list(n)] for k, n in keys], "params": list(params)}


def opinion(
    entries: Sequence[Any],
    views: Sequence[torch.Tensor],
    meta: Mapping[str, Any],
    device: torch.device | None = None,
) -> dict[str, int]:
    """A rank's fingerprints recomputed from its flash copy, on `device` (default CPU).

    Args:
        entries: the copy manifest's tensor entries (their `fqn`).
        views: the copy's tensors, one per entry (zero-copy views of its bytes).
        meta: the copy's `SDC_META` value.

    Returns:
        {replica key: fingerprint} for each key the rank folded, and the replay's keys.

    Raises:
        ValueError: the meta names a tensor the copy does not hold, or is malformed.
    """
    dev = device or torch.device("cpu")
    by_name = {e.fqn: v for e, v in zip(entries, views, strict=True)}
    keys = meta.get("keys")
    params = meta.get("params", [])
    if not isinstance(keys, list) or not isinstance(params, list):
        raise ValueError(f"malformed {SDC_META} meta: {str(meta)[:200]}")
    out: dict[str, int] = {}
    for row in keys:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], list)):
            raise ValueError(f"malformed {SDC_META} key row: {str(row)[:200]}")
        key, names = str(row[0]), row[1]
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"the copy holds no tensor {missing[0]!r} of key {key!r}")
        values = hash_many([by_name[n].to(dev) for n in names], dev).cpu().tolist()
        out[key] = fold([int(v) for v in values])
    missing = [n for n in params if n not in by_name]
    if missing:
        raise ValueError(f"the copy holds no weight {missing[0]!r}")
    out.update(replay((by_name[n] for n in params), dev))
    return out
