"""In-job recovery in a worker process: leave the world, keep the process, rejoin the next.

A worker whose step fails because a peer failed (`peer_failure`), or that its agent tells to
hold, raises `Held`; `hold` then drops its process groups (a peer still in a collective with
it fails at once), tells the agent it is held and waits for the agent's Rejoin, whose
environment `apply_rejoin` puts into this process's. The embedded engine (trainer/run.py) and
the hooks SDK's `recovery_loop` (trainer/hooks.py) both use it. Imports no torch until a
process group is dropped.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.common.workerenv import AGENT_PID
from unbroken.trainer import keeptrainer
from unbroken.trainer.ncclguard import abort_world, drop_gloo_world
from unbroken.trainer.rtrace import mark

if TYPE_CHECKING:
    from unbroken.trainer.hookchannel import Hooks

log = structlog.get_logger(__name__)

#: A held worker waits this long for the agent's Rejoin before it exits (the driver chose a
#: restart, or there is no recovery loop).
HOLD_WAIT_S = 120.0
#: The phase a held worker reports (the agent's in-job hold waits for it).
HELD_PHASE = "held"
#: Error texts that say a peer, not this process, failed: the collective's connection closed
#: or reset, or it timed out. Anything else is this worker's own error and is raised.
PEER_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "Timed out",
    "timed out",
    "Connection refused",
    "communicator was aborted",
    # NCCL (its socket transport, and torch's watchdog once it aborted the communicator)
    "ncclRemoteError",
    "remote process exited or there was a network error",
)


def started_by_agent() -> bool:
    """Whether this process was started by a node agent (which can hold it and send it a
    Rejoin); a script under another launcher is restarted by that launcher instead."""
    return bool(os.environ.get(AGENT_PID))


class Held(Exception):
    """This worker left its world: the agent said hold, or a peer's failure broke a collective."""

    def __init__(self, why: str, step: int, *, boundary: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.step = step
        #: held between steps, its collectives done: the world may be kept (keepworld.py)
        self.boundary = boundary
        #: the new world's Rejoin, when a rank that kept its world got one for another world
        self.rejoin: Any = None
        #: stopped while it kept its world (no Rejoin follows)
        self.stopped = False
        mark("left", step=step, peer=not why.startswith("held by"))


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e`, then what it was raised from or while handling, each once (torch wraps: the
    pipelining stage's backward raises a plain RuntimeError *from* gloo's error)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def peer_failure(e: BaseException) -> bool:
    """Whether `e` (raised by a step) says a peer failed rather than this process."""
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", ())
    return any(
        isinstance(c, network) or any(p in f"{type(c).__name__}: {c}" for p in PEER_FAILURES)
        for c in _chain(e)
    )


def drop_frames(e: BaseException) -> None:
    """Clear the locals of every finished frame in `e`'s tracebacks (and its causes').

    The failed step's frames hold the old world: the trainer, its DTensors and meshes, and
    through them the process groups. While one is referenced, destroying the group closes
    none of its gloo connections, so a peer blocked in a collective with this rank (a tp
    peer in the optimizer's all-reduce, say) is never told and waits until the hang rule
    restarts every process.
    """
    for c in _chain(e):
        if c.__traceback__ is not None:
            traceback.clear_frames(c.__traceback__)  # skips the frames still running


def open_sockets() -> frozenset[tuple[int, str]]:
    """This process's open sockets as (fd, inode) pairs (empty where there is no /proc)."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:"):
                    out.add((int(fd), target))
    return frozenset(out)


def sever(since: frozenset[tuple[int, str]]) -> int:
    """Shut down (not close) every connected TCP socket opened after `since` was taken.

    Gloo cannot abort: a rank that leaves its world with a collective still queued blocks in
    the group's destructor until that collective ends, and a peer blocked in a collective
    with it waits until its timeout (30 min) or the hang rule restarts every process. The
    world's connections (its store's and gloo's pairs) were all opened after `since` (taken
    just before the world's rendezvous); shut down, every pending operation on both ends
    fails at once with "Connection closed by peer", and the peers leave the world too.
    Listening sockets are left alone (gloo's accept loop aborts the process on an error),
    and the descriptors stay gloo's to close. Returns how many were shut down.
    """
    n = 0
    for fd, _inode in open_sockets() - since:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=fd)
            try:
                tcp = s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                if tcp and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.getpeername()  # connected only
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
            except OSError:
                pass
            finally:
                s.detach()
    return n


def hold(
    h: Held,
    hooks: Hooks,
    wait_s: float = HOLD_WAIT_S,
    *,
    world_since: frozenset[tuple[int, str]] | None = None,
) -> Any:
    """Leave the world in this process and wait for the agent's Rejoin (in-job recovery).

    Says `HELD_PHASE` to the agent first (the caller has finished its flash copy, so the
    ring is final and the driver need not wait for the rest), then shuts the old world's
    connections down (`sever`, where the caller says which: `world_since`) and drops the
    process group (a peer still in a collective with this rank then fails at once instead of
    waiting for its timeout), and waits.

    Returns:
        The Rejoin command's message, or None (a stop, or no Rejoin within `wait_s`).
    """
    log.warning("left the world; holding for the next one", why=h.why[:300], step=h.step)
    hooks.flush_steps()
    hooks.phase(HELD_PHASE)
    said = time.monotonic()
    leave_world(h, world_since)
    return await_rejoin(hooks, wait_s, said)


def await_rejoin(hooks: Hooks, wait_s: float, said: float) -> Any:
    """Wait for the agent's Rejoin (its message; None: a stop, or none within `wait_s`),
    saying `HELD_PHASE` again each second from `said` (when it was last said)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        if now - said >= 1.0:  # again now and then: a datagram lost to a full buffer (the
            hooks.phase(HELD_PHASE)  # marker's late "collective" no longer follows it)
            said = now
        hooks.wait(0.2)
        for c in hooks.commands():
            kind = c.WhichOneof("kind")
            if kind == "rejoin":
                log.info("rejoining the new world in this process", pid=os.getpid())
                return c.rejoin
            if kind == "stop":
                log.warning("stopped while held", reason=c.stop)
                return None
    log.error("no new world within the hold limit; exiting", wait_s=wait_s)
    return None


def leave_world(h: Held, world_since: frozenset[tuple[int, str]] | None = None) -> None:
    """Drop this process's part in its world: its connections (`sever`, where the caller says
    which: `world_since`), the failed step's frames, and the process groups."""
    import torch.distributed as dist

    if world_since is not None:
        mark("severed", sockets=sever(world_since))
    drop_frames(h)
    # DDP/FSDP state may still hold the group: free it, so it really closes. A kept trainer
    # holds its model and optimizer on (trainer/keeptrainer.py): what is garbage then is
    # the failed step's, young, and the full collection cost 0.15-0.3 s at `make run`'s
    # load (2026-12-05: the slowest survivor's, on the path to the new world's rendezvous)
    gc.collect(1 if keeptrainer.holding() else 2)
    mark("collected")
    _left.groups = world_groups()
    abort_world()  # NCCL
    drop_gloo_world()  # gloo: its groups are destroyed on a side thread
    if dist.is_initialized():  # (another backend, or a torch without what those need)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    mark("held")


@dataclass(slots=True)
class _Left:
    """What this process knew of the world it left: its groups' ranks by name, and whether
    DTensor's caches of that world were kept (`apply_rejoin`)."""

    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kept: bool = False


_left = _Left()


def world_groups() -> dict[str, tuple[int, ...]]:
    """Every process group of this world that this process belongs to: its ranks by name."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    out: dict[str, tuple[int, ...]] = {}
    with contextlib.suppress(Exception):
        for pg, name in list(c10d._world.pg_names.items()):
            with contextlib.suppress(Exception):
                out[str(name)] = tuple(dist.get_process_group_ranks(pg))
    return out


def check_kept_caches() -> bool:
    """After a rejoin that kept DTensor's caches: forget them after all if a group of the
    new world has a name the old world gave to other ranks (the kept meshes would resolve
    it); the first restore calls it, before any state is read. True: the caches hold."""
    if not _left.kept:
        return True
    _left.kept = False
    old, new = _left.groups, world_groups()
    moved = sorted(n for n, ranks in new.items() if n in old and old[n] != ranks)
    if not moved:
        return True
    log.warning("the new world renamed its groups; DTensor caches forgotten", groups=moved[:4])
    forget_world_caches()
    return False


#: The place a warm standby's dry run took (trainer/warmup.py), until the real world's start.
_dry_place: tuple[str, str] | None = None


def note_dry_run(rank: int, world: int) -> None:
    """A warm standby's dry run filled DTensor's caches as `rank` of `world`."""
    global _dry_place
    _dry_place = (str(rank), str(world))


def forget_dry_run_caches() -> bool:
    """At a worker's start: forget what a warm standby's dry run cached when the real world
    gave this process another place than the one the dry run guessed (its RANK then).

    The dry run's meshes equal the real world's (same shape and names), so their cached
    decisions are used, but with the dry run's coordinate: a standby that dry-ran as rank 0
    and became rank 1 loaded rank 0's FSDP shards (both ranks the same half), and the first
    step after its restore spiked (bench-recovery, replica mode: loss 4.3 against 1.7, then
    a rollback to the last commit, 165-322 steps back). True: forgotten."""
    global _dry_place
    dry, _dry_place = _dry_place, None
    if dry is None or dry == world_place():
        return False
    forget_world_caches()
    mark("caches", kept=False, dry_run=list(dry))
    return True


def world_place() -> tuple[str, str]:
    """This process's place in its world, as its launcher said it: (RANK, WORLD_SIZE)."""
    return os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")


def forget_world_caches() -> None:
    """Clear DTensor's process-wide caches of the world just left.

    A DeviceMesh hashes and compares by its shape and dimension names, not by this rank's
    place in it. DTensor's sharding propagation and redistribution caches are keyed by such
    meshes, so after a rejoin they handed the new world's ops specs that carried the old
    world's mesh: its coordinate was this process's rank there. A survivor that was rank 1
    of a dp2 world and rejoined a later dp2 world as rank 0 resharded its FSDP shards as the
    second half: both ranks loaded the same half and the job trained on from a broken model
    (the replica policy's grow-back, loss 5.6 where the curve was at 2.9). A cached spec's
    mesh also names the old world's groups: a warm standby that dry-ran as rank 0 and became
    rank 2 of a pp2×tp2 world got rank 0's tp mesh from the fast path's cache and failed in
    its first step ("Could not resolve the process group registered under the name 19":
    rank 2's tp group is "20"). The redistribution planners are keyed by a weak reference to
    their mesh, which an equal mesh matches while the old one lives (a frozen cycle lives
    for good), and plan with its coordinate. Torch's own clears where it has them; each is
    skipped where this torch lacks it. The sharding cache is per thread: it is cleared on the
    step thread too where one runs (trainer/stepthread.py).
    """
    from unbroken.trainer import stepthread

    _clear_sharding_cache()
    if stepthread.started():
        stepthread.call(_clear_sharding_cache)
    with contextlib.suppress(Exception):
        from torch.distributed.tensor._api import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
        prop._propagate_tensor_meta_cached.cache_clear()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor._redistribute import _gen_transform_infos

        _gen_transform_infos.cache_clear()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor._collective_utils import MeshTopoInfo

        MeshTopoInfo.build_from_mesh.cache_clear()
    with contextlib.suppress(Exception):  # keyed by a weak reference to an equal mesh
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        clear_redistribute_planner_cache()
    with contextlib.suppress(Exception):  # ours: keyed by the place too, but it holds
        from unbroken.recovery.flashplan import _shard_layout  # the old world's meshes

        _shard_layout.cache_clear()


def _clear_sharding_cache() -> None:
    """DTensor's sharding propagation caches of the calling thread (its Python one is per
    thread; its native fast path's too, as far as can be told: both are cleared)."""
    with contextlib.suppress(Exception):
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def apply_env(rejoin: Any) -> None:
    """Put a Rejoin's environment into this process's (its variables set, its `unset` gone)."""
    for k in rejoin.unset:
        os.environ.pop(k, None)
    os.environ.update(rejoin.env)


def apply_rejoin(rejoin: Any) -> None:
    """Put the new world's environment (a hooks Rejoin) into this process's, and forget the
    old world's DTensor caches when this process's place in the world changed.

    A process that keeps its rank in a world of the same size keeps the caches: their
    entries hold the old world's meshes, and such a mesh names its groups, which the new
    world's mesh (built by the same code, in the same order, after the old default group's
    teardown reset torch's group count) creates under the same names, with this rank at the
    same coordinate. Refilling them cost a survivor 0.18 s in its first `state_dict` (the
    optimizer's state initialised through DTensor ops) and 0.05 s in its first step on a
    quiet 2-core host, 0.3 s at load 10: a third of an in-job resume.
    """
    before = world_place()
    apply_env(rejoin)
    _left.kept = world_place() == before
    if not _left.kept:
        forget_world_caches()
    mark("caches", kept=_left.kept)
