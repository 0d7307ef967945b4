"""The torchrun rendezvous state, authenticated before torch unpickles it.

torch's DynamicRendezvousHandler keeps its state as a pickle (`_RendezvousState`) and every
torchrun agent of a run calls `pickle.loads` on whatever the backend hands it. Our backend
(agent/rdzv.py) fetches that state from the driver, so anybody able to call the driver's
SetState could make every torchrun agent run code (issue 14: `os.system` in a pickle ran as
root on every node). Two locks, both always on:

1. **A MAC per state.** The backend seals each state it writes:
   `MAGIC || HMAC-SHA256(key, MAGIC || run_id || 0x00 || pickle) || pickle`, and opens each
   state it reads by checking the MAC (constant-time) before looking at a byte of the
   pickle. The key is shared by the job's torchrun agents: by default the driver makes it
   and hands it to principals allowed to rendezvous (Rendezvous.GetKey), or the operator
   gives every node the same one (`rdzv_key`). The MAC proves "a torchrun agent of this
   job", so an unauthenticated writer of the stored state, or one with only etcd access and
   a configured key, cannot forge a state. The run id is inside the MAC, so a state of one
   run cannot be replayed into another.
2. **A restricted unpickler.** Even a state with a good MAC is first loaded by
   `StateUnpickler`, which resolves only the globals a `_RendezvousState` needs
   (`ALLOWED`), and is then checked field by field; only then are the bytes given to torch,
   whose own `pickle.loads` therefore meets only those globals.

A state that fails either check raises `StateAuthError` (a `RendezvousStateError`'s cause):
it is never unpickled. What the MAC does not stop: a holder of the key (a torchrun agent of
the run) can still write a valid but wrong state, and an older sealed state of the same run
can be written back by anyone who can call SetState (the driver's compare-and-set token
and torch's own round logic bound what that does: a stale round).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

MAGIC = b"UBRZ1\n"
MAC_LEN = 32
KEY_ENV = "UNBROKEN_RDZV_KEY"  # the key itself (any string of 16+ characters)
KEY_FILE_ENV = "UNBROKEN_RDZV_KEY_FILE"  # a file holding it (rdzv conf key_file= wins)
MIN_KEY_BYTES = 16
_DYN = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

#: The only globals a rendezvous state may name: torch's two classes, datetime's values
#: (deadline, last_heartbeats) and the set types older pickle protocols spell as globals.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DYN, "_RendezvousState"),
        (_DYN, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class StateAuthError(pickle.UnpicklingError):
    """A rendezvous state that is not authentic or not a plain torch rendezvous state."""


class StateUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of `ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise StateAuthError(
                f"the rendezvous state names {module}.{name}, which is not a type of torch's "
                "rendezvous state; refused, not unpickled"
            )
        return super().find_class(module, name)


def rdzv_key(params: Mapping[str, Any]) -> bytes | None:
    """The key the operator configured for the run's rendezvous states (None: none).

    In order: rdzv conf `key_file=PATH`, env `UNBROKEN_RDZV_KEY_FILE`, env
    `UNBROKEN_RDZV_KEY`. Without one, the backend asks the driver for the job's key
    (Rendezvous.GetKey, over the node's authenticated channel), so a node needs no secret
    beyond its own credential. Never from argv alone.

    Raises:
        ValueError: a key file is missing, or the key is too short.
    """
    path = params.get("key_file") or os.environ.get(KEY_FILE_ENV)
    if path:
        p = Path(str(path))
        if not p.is_file():
            raise ValueError(f"rendezvous key file {str(path)!r} does not exist (key_file)")
        raw = p.read_bytes().strip()
        where = f"key file {path}"
    elif os.environ.get(KEY_ENV):
        raw, where = os.environ[KEY_ENV].strip().encode(), KEY_ENV
    else:
        return None
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(f"the rendezvous key ({where}) must be at least {MIN_KEY_BYTES} bytes")
    return raw


def _mac(key: bytes, run_id: str, state: bytes) -> bytes:
    return hmac.new(key, MAGIC + run_id.encode() + b"\0" + state, hashlib.sha256).digest()


def seal(key: bytes, run_id: str, state: bytes) -> bytes:
    """The bytes stored for `state` (torch's pickle) in run `run_id`."""
    return MAGIC + _mac(key, run_id, state) + state


def open_sealed(key: bytes, run_id: str, blob: bytes) -> bytes:
    """torch's pickle inside `blob`, once its MAC and its content are checked.

    Raises:
        StateAuthError: a wrong or missing MAC, or a pickle that is not a plain
            `_RendezvousState` (it was never unpickled with torch's `pickle.loads`).
    """
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + MAC_LEN:
        raise StateAuthError(
            "the rendezvous state carries no MAC (written by something other than an "
            "unbroken torchrun agent of this job); refused, not unpickled"
        )
    mac, state = blob[len(MAGIC) : len(MAGIC) + MAC_LEN], blob[len(MAGIC) + MAC_LEN :]
    if not hmac.compare_digest(mac, _mac(key, run_id, state)):
        raise StateAuthError(
            f"the rendezvous state of run {run_id!r} fails its MAC: it was forged or sealed "
            f"with another key (every node needs the same key: leave {KEY_ENV} unset on "
            "all of them, or set it on all); refused, not unpickled"
        )
    load_state(state)
    return state


def load_state(state: bytes) -> Any:
    """A `_RendezvousState` from `state` with the restricted unpickler, its fields checked.

    Raises:
        StateAuthError: another type, or fields of the wrong types.
    """
    try:
        obj = StateUnpickler(io.BytesIO(state)).load()
    except StateAuthError:
        raise
    except Exception as e:  # any malformed pickle
        raise StateAuthError(f"the rendezvous state is not a valid pickle: {e}") from None
    check_state(obj)
    return obj


def check_state(obj: Any) -> None:
    """StateAuthError unless `obj` is a `_RendezvousState` whose fields have torch's types."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    def bad(what: str) -> StateAuthError:
        return StateAuthError(f"the rendezvous state is malformed ({what}); refused")

    def node(n: Any) -> bool:
        return (
            type(n) is _NodeDesc
            and set(vars(n)) == {"addr", "pid", "local_id"}
            and isinstance(n.addr, str)
            and type(n.pid) is int
            and type(n.local_id) is int
        )

    if type(obj) is not _RendezvousState:
        raise bad(f"a {type(obj).__name__}, not a _RendezvousState")
    fields = {
        "round",
        "complete",
        "deadline",
        "closed",
        "participants",
        "wait_list",
        "redundancy_list",
        "last_heartbeats",
    }
    if set(vars(obj)) != fields:
        raise bad(f"fields {sorted(vars(obj))}")
    if type(obj.round) is not int or type(obj.complete) is not bool or type(obj.closed) is not bool:
        raise bad("round, complete or closed")
    if obj.deadline is not None and type(obj.deadline) is not datetime:
        raise bad("deadline")
    if type(obj.participants) is not dict or not all(
        node(n) and type(r) is int for n, r in obj.participants.items()
    ):
        raise bad("participants")
    for name in ("wait_list", "redundancy_list"):
        s = getattr(obj, name)
        if type(s) is not set or not all(node(n) for n in s):
            raise bad(name)
    hb = obj.last_heartbeats
    if type(hb) is not dict or not all(node(n) and type(t) is datetime for n, t in hb.items()):
        raise bad("last_heartbeats")
