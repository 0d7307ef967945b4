"""A rank's NCCL world, left at once when a peer fails or the agent says hold.

Gloo's pending operations fail when their sockets are shut down (`rejoin.sever`); NCCL's do
not: a kernel waiting for a peer that died keeps the rank's main thread blocked in its next
device sync, where it reads no command. Measured on one H200 (two ranks, NCCL 2.28, torch
2.11, `bench/gpu-recovery.sh`): the watchdog saw the peer's closed connection at once
("ncclRemoteError") but, asked to clean up only (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), left the
rank blocked until the test's end, 45 s later; an abort from another thread returned the
blocked rank 0.5 s after it was called, raising "NCCL communicator was aborted".

So a worker under an agent runs `NcclGuard`: a side thread that aborts every group of the
world when the NCCL backend reports an error (`get_error`, where torch has it) or when the
agent's next command is a hold (peeked, so the main thread still reads it). The step that
was running then raises, or returns values no one may keep: `tripped` makes the loop leave
the world before that step is saved or reported.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

import structlog

from unbroken.trainer.rtrace import mark

if TYPE_CHECKING:
    from unbroken.trainer.hookchannel import Hooks

log = structlog.get_logger(__name__)

#: How often the guard looks (an abort frees a blocked rank about 0.5 s after it is called).
POLL_S = 0.05

_active: NcclGuard | None = None


def nccl_keeps_process() -> None:
    """Ask torch's NCCL watchdog not to end this process on a peer's failure. Its default
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) aborts the process: a healthy rank would die with the
    faulty one and in-job recovery would have nothing to keep. 2 cleans up only; the guard
    does the rest. A value the user set wins. Called before the world's group is made."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def tripped() -> str:
    """Why the running guard aborted the world ("" when it did not, or none runs)."""
    g = _active
    return g.why if g is not None else ""


class NcclGuard:
    """Aborts this rank's NCCL groups from a side thread (see the module's docstring)."""

    def __init__(self, hooks: Hooks, poll_s: float = POLL_S) -> None:
        self.hooks = hooks
        self.poll_s = poll_s
        self.why = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-nccl-guard", daemon=True)

    @classmethod
    def start_if_nccl(cls, hooks: Hooks) -> NcclGuard | None:
        """Start a guard when this process's world is an NCCL one the agent can hold."""
        global _active
        import torch.distributed as dist

        if not hooks.replies or not dist.is_initialized() or dist.get_backend() != "nccl":
            return None
        _active = g = cls(hooks)
        g._thread.start()
        return g

    def stop(self) -> None:
        """Stop looking, and wait for an abort already begun (about 0.5 s: the world must
        not be destroyed under it)."""
        global _active
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if _active is self:
            _active = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            why = self._backend_error() or (
                "held by the agent" if self.hooks.hold_waiting() else ""
            )
            if why:
                self.why = why
                log.warning("aborting this rank's NCCL world", why=why)
                n = abort_groups()
                mark("guard_abort", why=why, groups=n)
                return

    @staticmethod
    def _backend_error() -> str:
        """The default group's NCCL error, where torch reports one ("" when none)."""
        import torch
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            pg = dist.group.WORLD
            if pg is None:
                return ""
            backend = pg._get_backend(torch.device("cuda"))
            get_error = getattr(backend, "get_error", None)
            if get_error is not None:
                err = get_error()
                if getattr(err, "name", "SUCCESS") != "SUCCESS":
                    return f"NCCL reported {err.name}"
        return ""


def abort_groups() -> int:
    """Abort every process group's communicators (not the world's bookkeeping: the main
    thread leaves and destroys it). Returns how many were aborted."""
    import torch.distributed as dist

    n = 0
    for pg in list(dist.distributed_c10d._world.pg_names):
        with contextlib.suppress(Exception):
            pg.abort()
            n += 1
    return n


def abort_world() -> bool:
    """Abort every NCCL group of this process's world, its bookkeeping too (the main
    thread, leaving: `rejoin.hold`): a kernel still waiting for a peer that left returns,
    and destroying the group cannot block on it. Returns whether there was an NCCL world."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()  # every group, the default one too
            mark("aborted")
            return True
    return False
