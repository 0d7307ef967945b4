"""State fingerprints for silent data corruption (docs/sdc.md), and the drills' SDC faults.

Every `fingerprint_every` steps, after the optimizer step, each rank hashes the raw bytes of
its whole state (its local shards of the parameters and of the optimizer's state) on the
device the state lives on: each tensor is viewed as 32-bit integers, each word multiplied by
an odd weight of its position (wrapping in 32 bits) and the products summed in 64 bits. A
flip of any bit b of word i changes that word by ±2^b, its product by ±2^b·(2i+1), which is
never 0 modulo 2^32, so the sum changes: every single-bit flip anywhere in the state changes
the fingerprint (no sampling, no blind spot). Only one 64-bit integer per tensor comes back
to the host, where they are folded into one 64-bit fingerprint per *replica key*.

A replica key names what bytes a rank must hold: its coordinates on the mesh dimensions the
tensors are sharded or split over (pipeline stage, FSDP shard, tensor-parallel rank), with
the dimensions they are replicated over left out (HSDP's `dp_replicate`, plain replication,
tensor-parallel `Replicate` placements). Ranks reporting the same key must report the same
fingerprint; the driver compares them (driver/sdc.py).

A second, layout-free opinion is the *compute probe*: every rank multiplies a fixed input by
a fixed weight with `torch.nn.functional.linear` (the training matmuls' own path) and hashes
the result bitwise. Every rank of a world computes the same bytes, so a rank whose matmuls
are silently wrong stands out even where no other rank holds its state (pure FSDP).

The rank also reports the *replay* of its own weights (recovery/statehash.py `replay`), and
tells its flash copy of a fingerprinted step which of the copy's tensors make up each key
(`Fingerprinter.copy_meta`), so the buddy holding the copy can recompute both on its own
device: the third opinion (recovery/sdcbuddy.py).

The drills' faults (`unbroken inject sdc`, `unbroken inject sdc-matmul`): `flip_bit` flips
one bit of one rank's parameter or optimizer state in place; `MatmulFault` makes every
`linear` of this rank off by a relative `size` until turned off. `flip_bit` with target
"copy" is applied by the training loop around the save (trainer/run.py), so that only the
copy carries the flip.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.recovery.statehash import fold as _fold
from unbroken.recovery.statehash import hash_many, replay, replayable, sdc_meta, tensor_hash

__all__ = ["Fingerprinter", "MatmulFault", "flip_bit", "probe", "tensor_hash"]

#: the compute probe's replica key: every rank of a world computes the same bytes
PROBE_KEY = "probe"
PROBE_DIM = 128
# flattened mesh dimensions and the dimensions they stand for (trainer/parallel.py)
FLATTENED = {
    "dp_shard": ("dp_mod_ep", "ep"),
    "dp_shard_cp": ("dp_mod_ep", "ep", "cp"),
    "expert_replicas": ("dp_replicate", "dp_mod_ep"),
}
# a key names each kept dimension by a letter and its coordinate ("m0e0c0p1t0"): heartbeats
# carry the keys
SHORT = {"dp_replicate": "r", "dp_mod_ep": "m", "ep": "e", "cp": "c", "pp": "p", "tp": "t"}


def _local(t: Any) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def replica_key(t: Any, coords: dict[str, int]) -> str:
    """The replica key of tensor `t` on a rank at mesh coordinates `coords`."""
    replicated: set[str] = set()
    mesh = getattr(t, "device_mesh", None)
    placements = getattr(t, "placements", None)
    if mesh is not None and placements is not None:
        names = mesh.mesh_dim_names or ()
        for name, p in zip(names, placements, strict=False):
            if p.is_replicate():
                replicated.update(FLATTENED.get(name, (name,)))
    else:
        replicated = set()
    kept = [f"{SHORT.get(d, d)}{c}" for d, c in coords.items() if d not in replicated]
    return "".join(kept) or "all"


def mesh_coords(mesh: Any) -> dict[str, int]:
    """This rank's coordinate on each named dimension of `mesh` (a DeviceMesh)."""
    names = mesh.mesh_dim_names or ()
    return {n: int(mesh.get_local_rank(n)) for n in names}


def state_tensors(trainer: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every parameter and optimizer-state tensor, in a fixed order."""
    for i, opt in enumerate(getattr(trainer, "optimizers", ()) or ()):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                yield f"o{i}.g{g}.p{j}", p
                st = opt.state.get(p, {})
                for k in sorted(st):
                    v = st[k]
                    if isinstance(v, torch.Tensor):
                        yield f"o{i}.g{g}.p{j}.{k}", v


def probe(device: torch.device) -> torch.Tensor:
    """The compute probe's hash on `device` (0-d int64): a fixed `linear` of fixed inputs
    (drawn once per device; the product is computed every time)."""
    key = str(device)
    inputs = _probe_inputs.get(key)
    if inputs is None:
        gen = torch.Generator().manual_seed(0x5DC)
        x = torch.randn(PROBE_DIM, PROBE_DIM, generator=gen).to(device)
        w = torch.randn(PROBE_DIM, PROBE_DIM, generator=gen).to(device)
        inputs = _probe_inputs[key] = (x, w)
    return tensor_hash(torch.nn.functional.linear(*inputs))


_probe_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(slots=True)
class Fingerprinter:
    """This rank's fingerprints of `trainer` (an embedded-engine trainer: `optimizers` and
    `device_mesh()`), keyed by replica key; the plan (keys, tensor order) is cached."""

    trainer: Any
    _plan: list[tuple[str, str, Any]] | None = None
    _version: int = -1

    def plan(self) -> list[tuple[str, str, Any]]:
        version = int(getattr(self.trainer, "state_version", 0))
        if self._plan is None or version != self._version:
            mesh = self.trainer.device_mesh() if hasattr(self.trainer, "device_mesh") else None
            coords = mesh_coords(mesh) if mesh is not None else {}
            plan: list[tuple[str, str, Any]] = []
            key = "all"
            for n, t in state_tensors(self.trainer):
                if _is_param(n):  # a parameter; its optimizer state follows it and
                    key = replica_key(t, coords)  # is laid out alike (the AdamW step too)
                plan.append((key, n, t))
            self._plan = plan
            self._version = version
        return self._plan

    def compute(self) -> dict[str, int]:
        """{replica key: 64-bit fingerprint}, the probe's under `PROBE_KEY`, and the replay
        of the rank's own weights (recovery/statehash.py `replay`) under its keys."""
        plan = self.plan()
        locals_ = [_local(t) for _, _, t in plan]
        device = locals_[0].device if locals_ else torch.device("cpu")
        hs = torch.cat([hash_many(locals_, device), probe(device).reshape(1)])
        values = hs.cpu().tolist()  # one small host copy: a word per tensor
        by: dict[str, list[int]] = {}
        for (key, _, _), v in zip(plan, values, strict=False):
            by.setdefault(key, []).append(int(v))
        out = {k: _fold(v) for k, v in by.items()}
        out[PROBE_KEY] = _fold([int(values[-1])])
        out.update(replay(t for (_, n, _), t in zip(plan, locals_, strict=True) if _is_param(n)))
        return out

    def copy_meta(
        self, step: int, names_of: Callable[[list[torch.Tensor]], list[str | None]]
    ) -> dict[str, Any] | None:
        """What a flash copy of `step` tells its buddy to recompute these fingerprints
        (recovery/statehash.py `SDC_META`): each key's tensors by the copy's entry names,
        in folding order, and the replay's weights. `names_of` gives the copy's name of
        each local tensor (None: not in the copy); None when one is missing."""
        plan = self.plan()
        locals_ = [_local(t) for _, _, t in plan]
        names = names_of(locals_)
        if len(names) != len(locals_) or any(n is None for n in names):
            return None
        keys: dict[str, list[str]] = {}
        params: list[str] = []
        for (key, n, _), local, name in zip(plan, locals_, names, strict=True):
            assert name is not None
            keys.setdefault(key, []).append(name)
            if _is_param(n) and replayable(local):
                params.append(name)
        return sdc_meta(step, list(keys.items()), params)


def _is_param(name: str) -> bool:
    """Whether a `state_tensors` name is a parameter's (not its optimizer state's)."""
    return name.count(".") == 2


# ---------------------------------------------------------------- the drills' faults
def flip_bit(
    trainer: Any,
    *,
    tensor: str = "",
    bit: int = -1,
    target: str = "",
    seed: int | None = None,
    at: tuple[str, int, int] | None = None,
) -> tuple[str, tuple[str, int, int]]:
    """Flip one bit of this rank's state in place; returns what was flipped, in words and
    as `at` (flipping the same `at` again undoes it).

    Args:
        tensor: a name from `state_tensors` ("o0.g0.p3" a parameter, "o0.g0.p3.exp_avg" its
            optimizer state) or a substring of it; "" picks one at random.
        bit: the bit of the element's 32-bit word (0-31); -1 picks one at random.
        target: "param" or "optim" restricts the random pick; "" or "copy" either.
        seed: for the random picks (None: fresh randomness).
        at: (tensor name, element, bit) to flip exactly (the others are then ignored).
    """
    rng = random.Random(seed)
    cands = []
    for name, t in state_tensors(trainer):
        local = _local(t)
        if local.numel() == 0 or local.element_size() != 4:
            continue
        is_optim = name.count(".") > 2
        if target in ("param", "optim") and (target == "optim") != is_optim:
            continue
        if at is not None and name != at[0]:
            continue
        if tensor and tensor != name and tensor not in name and at is None:
            continue
        cands.append((name, local))
    if not cands:
        raise ValueError(f"no 32-bit state tensor matches tensor={tensor!r} target={target!r}")
    exact = [c for c in cands if c[0] == tensor]
    name, local = exact[0] if exact else rng.choice(cands)
    b = at[2] if at is not None else rng.randrange(32) if bit < 0 else bit
    if not 0 <= b < 32:
        raise ValueError(f"bit must be 0-31, got {bit}")
    i = at[1] if at is not None else rng.randrange(local.numel())
    with torch.no_grad():
        words = local.view(-1).view(torch.int32)
        mask = torch.tensor(1 << b if b < 31 else -(1 << 31), dtype=torch.int32)
        words[i] = words[i] ^ mask.to(words.device)
    return f"{name}[{i}] bit {b}", (name, i, b)


class MatmulFault:
    """While on, every `torch.nn.functional.linear` of this process returns its result times
    (1 + size): the training's matmuls (nn.Linear) and the compute probe alike."""

    def __init__(self) -> None:
        self.size = 0.0
        self._orig: Callable[..., Any] | None = None

    def set(self, size: float) -> None:
        """Turn the fault on at relative `size` (0: off)."""
        self.size = float(size)
        F = torch.nn.functional
        if self.size and self._orig is None:
            orig = self._orig = F.linear

            def wrong(*args: Any, **kwargs: Any) -> Any:
                return orig(*args, **kwargs) * (1.0 + self.size)

            F.linear = wrong  # type: ignore[assignment]
        elif not self.size and self._orig is not None:
            F.linear = self._orig  # type: ignore[assignment]
            self._orig = None
