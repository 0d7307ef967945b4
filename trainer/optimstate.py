"""An Adam or AdamW optimizer's state, created without a step (`create_adam_state`).

torch's distributed state-dict API (`get_optimizer_state_dict`) gives an optimizer that has
not stepped a state by running its `step()` once on zero gradients at a learning rate of 0.
On FSDP2's DTensor parameters every op of that step goes through DTensor's sharding
propagation, and where its caches are cold (a fresh process, or a worker whose caches were
forgotten because its rank is not the one its warm standby's dry run guessed:
trainer/rejoin.py) the zero step cost 0.16 s on a quiet host and 0.19-0.26 s on a loaded
one (bench-recovery, node loss: the replacement's restore, before it read a byte). The
state it makes is known: per parameter a `step` scalar and zero moments shaped like the
parameter. Made here, that costs a `zeros_like` per moment. A restore overwrites every value
it holds; a state saved before any step holds `step` 0 (the zero step left 1, so the first
real step after such a restore used the bias correction of the second).

Only `torch.optim.Adam` and `AdamW` themselves, not subclasses (their `_init_group` may make
more state): any other optimizer keeps torch's path.
"""

from __future__ import annotations

import torch


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype Adam gives `step` (torch.optim.optimizer._get_scalar_dtype)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def create_adam_state(opt: torch.optim.Optimizer) -> bool:
    """Give an Adam/AdamW that has no state yet the state its first step would create
    (values zero). False, and nothing changed, for any other optimizer, one that has state,
    or one whose parameters have gradients (torch's path leaves those alone too)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or opt.state:
        return False
    groups = opt.param_groups
    if any(p.grad is not None for g in groups for p in g["params"]):
        return False
    for group in groups:
        fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = opt.state[p]
            if fused or capturable:
                state["step"] = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype(False))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True
