"""A rank held at a step boundary keeps its world through a rollback (in-job recovery).

A loss spike's rollback replaces no process: every rank of the embedded engine sees the same
all-reduced loss, waits at the spiked step for the driver's verdict (trainer/spikewait.py)
and is held there, outside any collective. Leaving the world then (dropping its process
groups, making them again, and the trainer's meshes, model and first step with them) was
most of such a resume: about 0.3 s of 0.5-0.7 s on a 2-core host, and on GPUs a new NCCL
communicator for every group. Such a rank keeps its world when two agreements hold, each
reached through the world's own store, not a collective (a rank still blocked in one
would pair with it):

1. every rank of the world is held at the same boundary (else one is still in a
   collective: the world is left as before, and its shutdown fails that collective);
2. the Rejoin gives every rank the place it has (rank and world size), and every rank of
   the old world votes so (a replaced rank's process is new: it is not in this store).

Each decision is written once (`compare_set`, the first writer wins): "keep" only by a rank
that counted every rank's vote, "leave" by one that votes no or whose `AGREE_S` passed
first, so every rank reads the same. The kept world then restores the agreed step from each
rank's own ring in place (trainer/run.py `_keep`). A rank held inside its step (a peer
failed) leaves its world as before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.trainer import ncclguard
from unbroken.trainer.rejoin import HELD_PHASE, HOLD_WAIT_S, Held, apply_env, await_rejoin
from unbroken.trainer.rtrace import mark

if TYPE_CHECKING:
    from unbroken.trainer.hookchannel import Hooks

log = structlog.get_logger(__name__)

#: How long a rank waits for every rank's vote. The holds of a rollback reach the ranks
#: within milliseconds of each other (every rank waits at the spiked step, up to 0.5 s), as
#: do their Rejoins; only a rank that never votes (its spike's wait ran out and it went on
#: into a collective, or it was replaced) costs this, once. Under the agent's shortest hold
#: limit (agent/injob.py HOLD_MIN_S, 2 s).
AGREE_S = 1.0
#: Between looks at the votes (a store round trip each).
POLL_S = 0.002


@dataclass(slots=True)
class _Count:
    """Worlds kept since this world began (the agreements' keys: the same on every rank)."""

    kept: int = 0


_count = _Count()


def new_world() -> None:
    """A world was joined (its store is new): the agreements' keys start again."""
    _count.kept = 0


def agree(store: Any, key: str, world: int, vote: bool, deadline_s: float = AGREE_S) -> bool:
    """Whether all `world` ranks vote yes under `key` (each rank calls it once; all read the
    same answer). A store that fails (its host gone) is a no."""
    decided = key + "/decision"
    try:
        want = "leave"
        if vote:
            n = store.add(key + "/votes", 1)
            end = time.monotonic() + deadline_s
            while n < world and time.monotonic() < end and not store.check([decided]):
                time.sleep(POLL_S)
                n = store.add(key + "/votes", 0)
            want = "keep" if n >= world else "leave"
        return bool(store.compare_set(decided, "", want) == b"keep")
    except Exception as e:  # the store's host (rank 0's process) is gone, or unreachable
        log.warning("the world's store failed while agreeing to keep it", error=str(e)[:200])
        return False


def same_place(rejoin: Any) -> bool:
    """Whether `rejoin` leaves this process's rank and world size as they are."""
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1")):
        now = os.environ.get(name, default)
        after = default if name in rejoin.unset else rejoin.env.get(name, now)
        if after != now:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Outcome:
    """What `hold_in_place` did: `kept` the world (the Rejoin's environment applied), or
    got the `rejoin` of another world (leave this one for it), or was `stopped`."""

    kept: bool = False
    rejoin: Any = None
    stopped: bool = False


def hold_in_place(h: Held, hooks: Hooks, wait_s: float = HOLD_WAIT_S) -> Outcome | None:
    """Hold `h`'s rank in its world when every rank is held at the same boundary, and keep
    the world when the Rejoin changes nobody's place. None: the world cannot be kept and
    nothing was read (leave it as before)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not h.boundary or not dist.is_initialized() or ncclguard.tripped():
        return None
    world = dist.get_world_size()
    store = c10d._get_default_store()
    key = f"unbroken/kept/{_count.kept}/{h.step}"
    t0 = time.monotonic()
    if not agree(store, key + "/held", world, True):
        log.info("held at a step boundary, not every rank with it: leaving", step=h.step)
        return None
    log.warning("held at a step boundary with every rank: keeping the world", step=h.step)
    hooks.flush_steps()
    hooks.phase(HELD_PHASE)
    mark("held", kept=True, agreed_ms=round((time.monotonic() - t0) * 1e3, 1))
    with ncclguard.at_boundary():  # the Rejoin is this thread's to read, not a trip
        rejoin = await_rejoin(hooks, wait_s, time.monotonic())
    if rejoin is None:
        return Outcome(stopped=True)
    if not agree(store, key + "/rejoin", world, same_place(rejoin) and not ncclguard.tripped()):
        log.info("the new world is another one: leaving this one", step=h.step)
        return Outcome(rejoin=rejoin)
    apply_env(rejoin)  # the new world's restore point and skip; the place is the same
    _count.kept += 1
    mark("rejoin", kept=True)
    return Outcome(kept=True)


#: How long a rank waits over the store for its peers' restores before its first step
#: (then it goes on: the step's collectives wait, and fail, as they always did).
RESTORED_WAIT_S = 2.0


def all_restored(
    store: Any = None, world: int | None = None, wait_s: float = RESTORED_WAIT_S
) -> bool:
    """Wait, over the world's store (default: the default group's), until all `world` ranks
    have their restored state in place (False: not within `wait_s`, or the store failed;
    the caller goes on either way).

    Used on GPUs before a world's first step. A rank that enters the step first waits for
    the others inside its first collective, and NCCL waits by spinning a kernel on the
    device: where ranks share a GPU (one GPU in bench/gpu-recovery.sh, MPS), the spinning
    rank takes the device's time slices from a peer still restoring. On one H200 a
    replaced rank's first copy of its state to the device took 0.28 s while the surviving
    rank spun, against 0.01 s in a restart, where both ranks restore at once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    key = f"unbroken/restored/{_count.kept}"
    try:
        store = c10d._get_default_store() if store is None else store
        world = dist.get_world_size() if world is None else world
        if store.add(key, 1) >= world:
            store.set(key + "/all", "1")
        end = time.monotonic() + wait_s
        while not store.check([key + "/all"]):
            if time.monotonic() > end:
                return False
            time.sleep(POLL_S)
        return True
    except Exception as e:  # the store's host is gone: the step's collective will say so
        log.warning("the world's store failed while waiting for the restores", error=str(e)[:200])
        return False
