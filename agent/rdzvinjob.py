"""In-job rounds for torchrun's `unbroken` backend: a dead worker replaces its node's workers only.

torch's elastic agent restarts every worker of every node when one worker fails: the failed
node's agent joins a new rendezvous round, and every healthy agent sees a node waiting
(`num_nodes_waiting`) and restarts its own group to join it. With `--rdzv-conf in_job=1`
the handler (agent/rdzv.py) keeps the healthy nodes' worker processes instead, when their
script runs in the hooks SDK's `recovery_loop`:

- **The failed node** (its agent calls `next_rendezvous` after stopping its workers) opens
  an in-job generation in the driver's store, or joins the open one, marks itself
  `replaced`, and, when it holds group rank 0, picks the new world's store port. It waits
  until every node of the world has marked itself, then answers with the same round (its
  store, group rank and world size: the healthy agents never left it) and the new
  bootstrap address. torchrun starts its workers there as usual.
- **A healthy node** (its agent calls `num_nodes_waiting` every monitor interval) sees the
  generation, picks the port when it holds group rank 0, and writes the new world's
  environment into its private directory (`UNBROKEN_TORCHRUN_INJOB_DIR`, inherited by its
  workers). Its workers' collectives fail once their peer died; `recovery_loop` drops the
  process group, finds the file, says it is held, and runs the script's body again in the
  same process with the new MASTER_ADDR and MASTER_PORT (trainer/torchrunhold.py). Once
  every local worker said so, the node marks itself `held`.
- The new world's TCPStore is served by its rank 0 worker (`TORCHELASTIC_USE_AGENT_STORE`
  is False in it): the agents' old store carries on for their exit barrier, and a worker of
  the new world never reads a dead one's keys.

Anything that does not complete falls back to torch's own restart of every worker: a lost
node (its agent left torch's rendezvous state: its keep-alive lapsed) makes every node
restart its workers into torch's next round; a node not marked within `in_job_timeout`
seconds (its script has no recovery loop, it is stuck) aborts the generation and the failed
node joins a normal round, which the healthy agents then see waiting; a healthy node whose
workers did not all hold in time has its agent restart them into the generation as
`replaced`. torchrun restarts every local worker of the failed node (its
`_restart_workers`), so with --nproc-per-node > 1 that node's healthy ranks restart too; the
other nodes' keep their processes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from unbroken.common.injobdir import DIR_ENV, GEN_ENV, WAIT_ENV, held_file, world_file

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 30.0
POLL_S = 0.05


@dataclass(slots=True)
class Round:
    """The last normal round this node joined: what an in-job generation keeps."""

    store: Any  # the round's store (its prefix of the driver's store)
    rank: int  # this node's group rank
    world_size: int  # nodes
    master_addr: str  # group rank 0's host


def free_port() -> int:
    """A TCP port free now on this host (the new world's rank 0 binds it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class InJobRounds:
    """One torchrun agent's side of the in-job generations (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        participants: Callable[[], int] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"rdzv conf in_job_timeout must be > 0, got {timeout_s}")
        self.store = store  # the driver's store (DriverStore), shared by the run's agents
        self.prefix = "unbroken.injob/"  # the driver scopes the store's keys by run
        self.timeout_s = timeout_s
        # how many nodes torch's rendezvous state lists now (a dead node's agent is dropped
        # once its keep-alive lapses): a lost node cannot mark itself, so no generation
        # completes without it
        self.participants = participants
        self._counted = (0.0, 0)
        self.round: Round | None = None
        self.active = False  # the workers' world is an in-job generation's
        self.seen = 0  # the newest generation this node took part in
        self.pending: tuple[int, float] | None = None  # (generation, deadline) being held
        self.dir = tempfile.mkdtemp(prefix="unbroken-injob-")  # 0700: this user's only
        os.environ[DIR_ENV] = self.dir  # torchrun's workers inherit the agent's environment
        os.environ[WAIT_ENV] = str(2 * timeout_s)
        os.environ.pop(GEN_ENV, None)
        # torchrun passes its own value to the workers, default 1: NCCL's watchdog would end
        # a healthy rank's process with its peer's failure (2 only cleans up)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        atexit.register(shutil.rmtree, self.dir, True)

    # ------------------------------------------------------------------ store keys

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _get(self, key: str) -> bytes | None:
        return self.store.try_get(key)  # type: ignore[no-any-return]

    def _number(self, key: str, low: int = 0, high: int = 2**62) -> int | None:
        """The integer at `key`, or None where it is unset or not one in [low, high]: any
        node holding the role token writes this store, so a value is checked, not trusted."""
        raw = self._get(key)
        try:
            n = int(raw) if raw is not None else None
        except ValueError:
            n = None
        if n is None or not low <= n <= high:
            if raw is not None:
                log.warning("in-job round: ignoring a bad value", key=key, value=raw[:40])
            return None
        return n

    def _generation(self) -> int:
        return self._number(self._key("gen")) or 0

    def _node_keys(self, gen: int) -> list[str]:
        assert self.round is not None
        return [self._key(gen, "node", i) for i in range(self.round.world_size)]

    def _aborted(self, gen: int) -> bool:
        return self._get(self._key(gen, "abort")) is not None

    def _complete(self, gen: int) -> bool:
        return bool(self.store.check(self._node_keys(gen)))

    def _master(self, gen: int) -> int | None:
        """The new world's store port (group rank 0 picks it: its worker serves it)."""
        assert self.round is not None
        key = self._key(gen, "master")
        if self.round.rank == 0 and self._get(key) is None:
            self.store.compare_set(key, "", str(free_port()))
        return self._number(key, 1, 65535)

    def _node_lost(self) -> bool:
        """Whether a node of the round has left torch's rendezvous (counted every 0.5 s)."""
        if self.participants is None or self.round is None:
            return False
        at, n = self._counted
        if time.monotonic() - at >= 0.5:
            n = self.participants()
            self._counted = (time.monotonic(), n)
        return n < self.round.world_size

    # ------------------------------------------------------------------ the handler's calls

    def after_round(self, info: RendezvousInfo) -> None:
        """A normal round completed: its membership is what later generations keep."""
        boot = info.bootstrap_store_info
        self.active, self.pending = False, None
        if boot is None:  # a torch without it: no address for the next world, so no in-job
            log.warning("in-job rounds off: torch's round names no bootstrap store")
            self.round = None
            return
        self.round = Round(
            store=info.store,
            rank=info.rank,
            world_size=info.world_size,
            master_addr=boot.master_addr,
        )
        os.environ.pop(GEN_ENV, None)
        self._clear_files()

    def replace_me(self) -> RendezvousInfo | None:
        """This node's workers stopped: join the open generation as `replaced` (opening one
        if none is), wait for the world, and answer with it; None for a normal round."""
        r = self.round
        if r is None:
            return None
        current = self._generation()
        gen = current
        if not current or self._aborted(current) or self._complete(current):
            key = self._key("gen")
            self.store.compare_set(key, self._get(key) or "", str(current + 1))
            gen = self._generation()  # ours, or another node's that opened it first
            if gen <= current:
                return None  # the counter is not ours to use: a normal round
        self.store.set(self._key(gen, "node", r.rank), b"replaced")
        self.pending = None
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        port = None
        while time.monotonic() < deadline and not self._aborted(gen) and not self._node_lost():
            port = port or self._master(gen)
            if port and self._complete(gen):
                break
            time.sleep(POLL_S)
        else:
            self.store.set(self._key(gen, "abort"), b"1")
            log.warning(
                "in-job round not completed; every worker restarts",
                generation=gen,
                timeout_s=self.timeout_s,
                node_lost=self._node_lost(),
            )
            return None
        self.seen, self.active = gen, True
        os.environ[GEN_ENV] = str(gen)
        log.info(
            "in-job round: this node's workers restart into the new world",
            generation=gen,
            group_rank=r.rank,
            master=f"{r.master_addr}:{port}",
            waited_s=round(time.monotonic() - t0, 3),
        )
        return RendezvousInfo(
            r.store, r.rank, r.world_size, RendezvousStoreInfo(r.master_addr, int(port))
        )

    def poll(self) -> bool:
        """A healthy node's monitor tick: hold the workers for a new generation; True when
        they did not all hold in time (the agent then restarts them into it)."""
        r = self.round
        if r is None:
            return False
        if self._node_lost():
            # a whole node is gone (its agent too): nobody opens a generation for it, and
            # this node's workers may hold in vain. Restart them into torch's next round.
            log.warning("in-job round: a node left the rendezvous; this node's workers restart")
            self.pending = None
            return True
        if self.pending is None:
            gen = self._generation()
            if gen <= self.seen or self._aborted(gen):
                self.seen = max(self.seen, gen)
                return False
            if self._get(self._key(gen, "node", r.rank)) is not None:
                self.seen = gen
                return False
            self.pending = (gen, time.monotonic() + self.timeout_s)
            log.info("in-job round: holding this node's workers", generation=gen)
        gen, deadline = self.pending
        if self._aborted(gen):
            self.pending, self.seen = None, gen
            return False
        if not os.path.exists(world_file(self.dir, gen)):
            port = self._master(gen)
            if port is not None:
                self._write_world(gen, r.master_addr, port)
        if self._all_held(gen):
            self.store.set(self._key(gen, "node", r.rank), b"held")
            self.pending, self.seen, self.active = None, gen, True
            os.environ[GEN_ENV] = str(gen)
            log.info("in-job round: this node's workers hold in place", generation=gen)
            return False
        if time.monotonic() > deadline:
            log.warning(
                "in-job round: this node's workers did not hold in time; they restart",
                generation=gen,
                timeout_s=self.timeout_s,
            )
            return True
        return False

    # ------------------------------------------------------------------ files

    def _write_world(self, gen: int, addr: str, port: int) -> None:
        env = {
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            GEN_ENV: str(gen),
        }
        path = world_file(self.dir, gen)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".world-")
        with os.fdopen(fd, "w") as f:
            json.dump({"generation": gen, "env": env}, f)
        os.replace(tmp, path)

    def _all_held(self, gen: int) -> bool:
        """Whether every local worker said it holds for `gen` (each names how many there are:
        its LOCAL_WORLD_SIZE, which the agent does not tell its rendezvous handler)."""
        prefix = f"held-{gen}-"
        names = [n for n in os.listdir(self.dir) if n.startswith(prefix)]
        if not names:
            return False
        try:
            with open(os.path.join(self.dir, names[0])) as f:
                want = int(json.load(f)["local_world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all(os.path.exists(held_file(self.dir, gen, i)) for i in range(want))

    def _clear_files(self) -> None:
        for name in os.listdir(self.dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, name))
