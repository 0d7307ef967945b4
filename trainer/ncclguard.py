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
the world before that step is saved or reported. Leaving, the rank forgets its world at once
and the abort ends on a side thread (`ASYNC_ABORT`), never aborting what the guard already
did (`_world_guard`).

Gloo's pending operations fail once their sockets are shut down, but a rank's own peers do
not always do it: in one `make run` drill (pp2 x tp2, gloo) the stage-0 rank whose pipeline
peer was SIGKILLed stayed blocked in its receive while its other peers left, its agent's
hold went unread for 2.5 s, the rank was called hung and every process restarted. So a
gloo world runs `GlooGuard`: on the agent's hold (peeked) it shuts down this rank's own
world sockets (`rejoin.sever`), which fails whatever gloo operation the main thread waits
in, at once, and the rank leaves the step as on a peer's failure.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.trainer.rtrace import mark

if TYPE_CHECKING:
    from unbroken.trainer.hookchannel import Hooks

log = structlog.get_logger(__name__)

#: How often the guard looks (an abort frees a blocked rank about 0.5 s after it is called).
POLL_S = 0.05

#: Leave an NCCL world without waiting for its abort: the communicators are aborted on a side
#: thread while this rank forgets the world and joins the next one. NCCL's proxy thread looks
#: at the abort flag between 500 ms polls, so a waited-for abort kept the survivor about
#: 0.5 s (one H200, `bench/gpu-recovery.sh`: an in-job worker crash resumed in 2.02 s instead
#: of 2.90, a restart of every worker 2.33). UNBROKEN_NCCL_ASYNC_ABORT=0 waits, as before.
ASYNC_ABORT = os.environ.get("UNBROKEN_NCCL_ASYNC_ABORT", "1") != "0"

_active: NcclGuard | None = None
#: The guard of this process's current world, kept after `stop` until the world is left: a
#: guard that began aborting the world's groups (`why` set) is waited for, never followed by
#: a second abort of the same communicators, which can block (seen once in three on one
#: H200: torch's `_abort_process_group` after the guard's abort waited out the 60 s timeout).
_world_guard: NcclGuard | None = None


def nccl_keeps_process() -> None:
    """Ask torch's NCCL watchdog not to end this process on a peer's failure. Its default
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) aborts the process: a healthy rank would die with the
    faulty one and in-job recovery would have nothing to keep. 2 cleans up only; the guard
    does the rest. A value the user set wins. Called before the world's group is made."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


#: Set while the main thread itself waits for the agent's commands at a step boundary (no
#: collective in flight: trainer/keepworld.py): a hold waiting then is the main thread's to
#: read, and the world stays whole for it to keep.
_boundary = threading.Event()


@contextlib.contextmanager
def at_boundary() -> Iterator[None]:
    """The main thread waits at a step boundary: the guard leaves a waiting hold to it."""
    _boundary.set()
    try:
        yield
    finally:
        _boundary.clear()


def active() -> NcclGuard | None:
    """The guard watching this process's world (None: none runs)."""
    return _active


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
        global _active, _world_guard
        import torch.distributed as dist

        if not hooks.replies or not dist.is_initialized() or dist.get_backend() != "nccl":
            return None
        _active = _world_guard = g = cls(hooks)
        g._thread.start()
        return g

    #: Whether `stop` waits for the guard's thread: for an abort already begun (about 0.5 s:
    #: the world must not be destroyed under it), except with `ASYNC_ABORT`, where the world
    #: is only forgotten, not destroyed, and the abort ends on its own.
    JOIN_ON_STOP = not ASYNC_ABORT

    def stop(self) -> None:
        """Stop looking, and wait for what the guard began where `JOIN_ON_STOP` says."""
        global _active
        self._stop.set()
        alive = self._thread.is_alive() and self._thread is not threading.current_thread()
        if alive and self.JOIN_ON_STOP:
            self._thread.join(timeout=5.0)
        if _active is self:
            _active = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            why = self._backend_error() or (
                "held by the agent" if not _boundary.is_set() and self.hooks.hold_waiting() else ""
            )
            if why:
                self.why = why  # `abort_world` will not abort the world again
                self._trip(why)
                return

    def _trip(self, why: str) -> None:
        log.warning("aborting this rank's NCCL world", why=why)
        n = abort_groups()
        mark("guard_abort", why=why, groups=n)

    def _backend_error(self) -> str:
        return nccl_error()


class GlooGuard(NcclGuard):
    """Shuts this rank's gloo world down from a side thread on the agent's hold (see the
    module's docstring): its sockets opened since `world_since` (taken just before the
    world's rendezvous), so a blocked operation fails at once."""

    def __init__(
        self, hooks: Hooks, world_since: frozenset[tuple[int, str]], poll_s: float = POLL_S
    ) -> None:
        super().__init__(hooks, poll_s)
        self.world_since = world_since
        self._thread.name = "unbroken-gloo-guard"

    @classmethod
    def start_if_gloo(
        cls, hooks: Hooks, world_since: frozenset[tuple[int, str]]
    ) -> GlooGuard | None:
        """Start a guard when this process's world is a gloo one the agent can hold."""
        global _active
        import torch.distributed as dist

        if not hooks.replies or not dist.is_initialized() or dist.get_backend() != "gloo":
            return None
        _active = g = cls(hooks, world_since)
        g._thread.start()
        return g

    #: a shutdown already begun takes milliseconds, and the world's descriptors are closed
    #: next: one reused by then must not be shut down
    JOIN_ON_STOP = True

    def _backend_error(self) -> str:
        return ""  # gloo's errors reach the main thread: it is blocked only on a live peer

    def _trip(self, why: str) -> None:
        from unbroken.trainer.rejoin import sever

        n = sever(self.world_since)
        log.warning("shut this rank's gloo world down", why=why, sockets=n)
        mark("guard_sever", why=why, sockets=n)


def start_guard(hooks: Hooks, world_since: frozenset[tuple[int, str]]) -> NcclGuard | None:
    """The guard for this process's world (NCCL or gloo; None for another backend)."""
    return NcclGuard.start_if_nccl(hooks) or GlooGuard.start_if_gloo(hooks, world_since)


def nccl_error() -> str:
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
    guard = _world_guard
    if (ASYNC_ABORT or (guard is not None and guard.why)) and _forget_world(guard):
        return True
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()  # every group, the default one too
            mark("aborted")
            return True
    return False


def _forget_world(guard: NcclGuard | None) -> bool:
    """`abort_world` without the wait: this process forgets its world at once (the registry
    part of torch's `_abort_process_group`) and its groups are aborted on a side thread (as
    that function does, in one NCCL group call), so the next world can be made while the old
    communicators' proxy threads wind down. The side thread first stops the world's `guard`
    and waits for its thread; where the guard began aborting the groups, it only waits for
    that abort (keeping the groups alive until then) and aborts nothing again. False (nothing
    done) where this torch lacks what it needs: the caller aborts as before."""
    global _world_guard
    import torch
    import torch.distributed as dist

    if not _can_forget():
        return False
    world = dist.distributed_c10d._world
    groups = sorted(world.pg_names, key=lambda pg: world.pg_names[pg], reverse=True)
    backend: Any = None  # ProcessGroupNCCL: its group calls bracket the aborts
    with contextlib.suppress(RuntimeError):
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
    grouped = backend is not None and hasattr(backend, "_group_start")

    def abort() -> None:
        if guard is not None:  # stopped, it ends at once unless it is aborting the groups
            guard._stop.set()
            if guard._thread.is_alive():
                guard._thread.join()
        by_guard = guard is not None and bool(guard.why)
        if not by_guard:
            with contextlib.suppress(Exception):
                if grouped:  # one NCCL group: the comms' aborts cannot deadlock each other
                    backend._group_start()
                for pg in groups:
                    with contextlib.suppress(Exception):
                        pg.abort()
                if grouped:
                    backend._group_end()
        mark("aborted", background=True, by_guard=by_guard)

    threading.Thread(target=abort, name="unbroken-nccl-abort", daemon=True).start()
    _forget_registry()
    _world_guard = None
    mark("forgotten")
    return True


#: torch's registry of a process's groups (torch.distributed.distributed_c10d `_world`)
_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg")


def _can_forget() -> bool:
    """Whether this torch has what `_forget_registry` needs."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    return (
        hasattr(c10d, "_update_default_pg")
        and hasattr(c10d, "_unregister_all_process_groups")
        and all(hasattr(c10d._world, t) for t in _TABLES)
    )


def _forget_registry() -> None:
    """Forget every group of this process's world (the registry part of torch's
    `destroy_process_group`): the next world can be made at once; the groups themselves
    live on as long as something holds them."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    world = c10d._world
    c10d._update_default_pg(None)
    for t in _TABLES:
        getattr(world, t).clear()
    if hasattr(world, "pg_coalesce_state"):
        world.pg_coalesce_state.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def drop_gloo_world() -> bool:
    """Leave a gloo world without waiting for its groups to be destroyed: the registry is
    forgotten here and the groups are shut down and freed on a side thread.

    Destroying a survivor's gloo groups after a peer died took 20-30 ms on an idle 2-core
    host and 45 ms in bench-recovery (the default group and the mesh's four), most of it
    in the groups' destructors, which hold no GIL: the rank told its agent it is held
    before, but its next world waited. False (nothing done) where this is no gloo world
    or this torch lacks what it needs: the caller destroys the world as before."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo" or not _can_forget():
        return False
    world = dist.distributed_c10d._world
    groups = list(world.pg_names)

    def drop() -> None:
        for pg in groups:
            with contextlib.suppress(Exception):
                pg.shutdown()
        groups.clear()  # the last references: the destructors run here
        mark("dropped", background=True)

    _forget_registry()
    threading.Thread(target=drop, name="unbroken-gloo-drop", daemon=True).start()
    return True
