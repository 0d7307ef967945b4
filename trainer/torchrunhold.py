"""In-job recovery of a worker under torchrun's `unbroken` backend with `in_job=1`.

The backend's handler in the torchrun agent (agent/rdzvinjob.py) names a private directory in
`UNBROKEN_TORCHRUN_INJOB_DIR`, which its workers inherit. When another node's worker dies,
the handler writes the new world's environment there (`world-<generation>.json`: the new
MASTER_ADDR and MASTER_PORT, and that the world's rank 0 serves its store). A worker in the
hooks SDK's `recovery_loop` whose collective failed, or that sees such a file at
`should_stop`, leaves its world (`rejoin.leave_world`), waits for the file, says it holds
(`held-<generation>-<local rank>`) and runs the script's body again with that environment,
in the same process. Reads only files the agent's user owns in a directory only it may write.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

import structlog

from unbroken.common.injobdir import DIR_ENV, GEN_ENV, WAIT_ENV, held_file, world_file
from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer.rejoin import HOLD_WAIT_S, Held, leave_world

log = structlog.get_logger(__name__)

POLL_S = 0.02


def directory() -> str:
    """The handler's directory when this process may use it ('' when not: not under torchrun
    with in_job, or a directory another user could have written)."""
    path = os.environ.get(DIR_ENV, "")
    if not path or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        log.warning("not using the in-job directory: not this user's private one", path=path)
        return ""
    return path


def generation() -> int:
    """The in-job generation this process's world belongs to (0: the first round's)."""
    try:
        return int(os.environ.get(GEN_ENV) or 0)
    except ValueError:
        return 0


def newer_world(path: str) -> int:
    """The newest generation with a world file in `path` newer than this process's; 0 if none."""
    mine, best = generation(), 0
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    for name in names:
        if name.startswith("world-") and name.endswith(".json"):
            try:
                gen = int(name[len("world-") : -len(".json")])
            except ValueError:
                continue
            if gen > mine:
                best = max(best, gen)
    return best


_seen_mtime: tuple[str, int] = ("", 0)  # the directory as `world_pending` last found it


def world_pending(path: str) -> bool:
    """Whether a newer world waits in `path`, for a check once a step: one `stat` of the
    directory, whose listing is read again only after an entry came or went."""
    global _seen_mtime
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return False
    if _seen_mtime == (path, mtime):
        return False
    if newer_world(path):
        return True  # not remembered: it stays pending until this process takes it
    _seen_mtime = (path, mtime)
    return False


def read_world(path: str, gen: int) -> dict[str, str] | None:
    """The environment of generation `gen`'s world, or None where its file is not valid."""
    try:
        st = os.lstat(world_file(path, gen))
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        with open(world_file(path, gen)) as f:
            doc: Any = json.load(f)
        env = doc["env"]
        if doc["generation"] != gen or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            return None
        return dict(env)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def hold(h: Held, wait_s: float = HOLD_WAIT_S) -> hpb.Rejoin | None:
    """Leave the world and wait for the handler's next one; its Rejoin, or None (none came)."""
    path = directory()
    try:
        wait_s = min(wait_s, float(os.environ.get(WAIT_ENV) or wait_s))
    except ValueError:
        pass
    log.warning("left the world; holding for torchrun's next one", why=h.why[:300], step=h.step)
    leave_world(h)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        gen = newer_world(path) if path else 0
        env = read_world(path, gen) if gen else None
        if env is not None:
            local = os.environ.get("LOCAL_RANK", "0")
            marker = held_file(path, gen, int(local))
            with open(marker + ".tmp", "w") as f:
                json.dump(
                    {"pid": os.getpid(), "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")},
                    f,
                )
            os.replace(marker + ".tmp", marker)
            log.info("rejoining torchrun's new world in this process", generation=gen)
            return hpb.Rejoin(env=env)
        time.sleep(POLL_S)
    log.error("no new world from torchrun's agent within the hold limit; exiting", wait_s=wait_s)
    return None
