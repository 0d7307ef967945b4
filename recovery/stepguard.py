"""Where an optimizer step waits for the flash copy in flight (`FlashWriter.guard`).

A save's tensors are copied on a background thread while the next step runs; the parameter
update must not start before that copy is out. The guard is an optimizer step pre-hook. A
step called plainly (`opt.step()`, after the loop's own forward and backward) waits there.
A step called with a closure runs the forward and backward inside `step` (Lightning's
automatic optimization does: `optimizer.step(closure=...)` evaluates `training_step` and
`backward` in the closure): waiting before it kept the copy off the whole next step, on
the step's path. So for torch's own optimizers, which call the closure before they touch
a tensor, the hook hands `step` a closure that runs the caller's and then waits: the copy
overlaps the forward and backward, and the update still waits for it. Any other optimizer
(one that may change parameters before it evaluates the closure, as SAM's first step
does) waits before its step, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class _Pending(Protocol):
    def wait_copied(self, timeout_s: float = ...) -> None: ...


def closure_first(opt: Any) -> bool:
    """Whether `opt`'s `step` is one of torch's own (`torch.optim`), which evaluate a given
    closure before they change any tensor (the class's, or the one it inherits)."""
    step = getattr(type(opt), "step", None)
    module = getattr(step, "__module__", None) or ""
    return module == "torch.optim" or module.startswith("torch.optim.")


def pre_hook(pending: Callable[[], _Pending | None]) -> Callable[..., Any]:
    """An optimizer step pre-hook (`register_step_pre_hook`'s or the global one's
    signature) that waits for `pending()`'s copy: before the step, or after the step's
    closure (see the module docstring). A copy already out returns at once from
    `wait_copied` (a GPU copy's `copied` is only its enqueueing: always ask `wait_copied`)."""

    def wait_before_step(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        handle = pending()
        if handle is None:
            return None
        # `args` starts with the optimizer itself (torch passes `step`'s own arguments)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1:] or (None,))[0]
        if closure is None or not callable(closure) or not closure_first(opt):
            handle.wait_copied()
            return None

        def then_wait(*a: Any, **kw: Any) -> Any:
            try:
                return closure(*a, **kw)
            finally:
                handle.wait_copied()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_wait}
        return (args[0], then_wait, *args[2:]), kwargs

    return wait_before_step
