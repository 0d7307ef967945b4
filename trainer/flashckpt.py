"""Flash checkpoints for a trainer running under a node agent: save every N steps, restore.

The agent owns the node's flash memory and tells its workers where it is through the
environment (`UNBROKEN_FLASH_ROOT`, `_JOB`, `_NODE`, `UNBROKEN_PERSIST_URL`; see
agent/flash.py). A worker saves its rank's full sharded trainer state (model, optimizer,
step, data position, RNG) into its slots with `FlashWriter`; the agent persists and
replicates it.

Saves overlap training: `save` takes the snapshot that must be taken now (the non-tensor
values, the slot) and returns while the writer's thread copies the tensors during the
next step's forward and backward; the writer's guard, installed once on the trainer's
optimizers, makes the next `optimizer.step()` (the first in-place write to saved tensors)
wait for that copy. Only what must block, blocks. A trainer that does not expose its
`optimizers` gets the process-wide optimizer guard; one whose forward writes saved state
in place (BatchNorm statistics) must not use the overlapped save.

At start every rank surveys what it can obtain (its node's memory, the replica this node
got back from its buddy after replacing a lost node, storage), the ranks exchange their
availability (`all_gather_object`), and each computes the same `restore.decide` plan: the
newest step every rank can get, each from its best source. Each rank then opens its shard,
verifying the checksum; a corrupt copy falls back to the next source of the same step
(`sources.obtain`), and if some rank has no intact copy of that step left, the ranks decide
again without it. Nothing found anywhere: a fresh start. Storage is read by every rank
that needs it (no broadcast from one reader per replica group yet).

Only the shell (files, collectives) lives here; the decision is the pure
`unbroken.recovery.restore.decide`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

from unbroken.recovery.flash import (
    CorruptCopyError,
    FlashConfig,
    FlashOwner,
    FlashWriter,
    SaveHandle,
    load_into,
    replica_store,
)
from unbroken.recovery.restore import NoCommonStepError, decide
from unbroken.recovery.sources import (
    ENV_FLASH_JOB,
    ENV_FLASH_NODE,
    ENV_FLASH_ROOT,
    ENV_PERSIST_URL,
    Survey,
    obtain,
    survey,
)
from unbroken.trainer.plugin import Trainer

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

log = structlog.get_logger(__name__)

KEY = "trainer"
MAX_DECISIONS = 4  # re-decide at most this often when shards turn out corrupt


@dataclass(kw_only=True, slots=True)
class FlashEnv:
    """Where the local agent keeps flash copies (from the worker's environment)."""

    root: str
    job: str
    node: str
    persist_url: str = ""

    def __post_init__(self) -> None:
        if not self.root or not self.job or not self.node:
            raise ValueError(
                f"{ENV_FLASH_ROOT}, {ENV_FLASH_JOB} and {ENV_FLASH_NODE} must all be set "
                "(the agent sets them)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FlashEnv | None:
        """The agent's flash store, or None when not running under an agent that has one."""
        e = os.environ if env is None else env
        if not e.get(ENV_FLASH_ROOT):
            return None
        return cls(
            root=e[ENV_FLASH_ROOT],
            job=e.get(ENV_FLASH_JOB, ""),
            node=e.get(ENV_FLASH_NODE, ""),
            persist_url=e.get(ENV_PERSIST_URL, ""),
        )


@dataclass(frozen=True, slots=True)
class Restored:
    """What `FlashCheckpointer.restore` loaded."""

    step: int
    source: str  # this rank's: memory, buddy or storage
    sources: dict[int, str]  # every rank's


class FlashCheckpointer:
    """One rank's flash saves and its start-up restore.

    Args:
        env: the agent's flash store.
        rank: this process's global rank.
    """

    def __init__(self, env: FlashEnv, rank: int) -> None:
        self.env = env
        self.rank = rank
        # The agent created and owns the job's folder; the worker only sizes its own slots.
        self.owner = FlashOwner(FlashConfig(root=env.root, job=env.job))
        self.writer = FlashWriter(rank, self.owner)
        self.saves = 0
        self.blocked_s = 0.0  # of finished saves; the one in flight is added when replaced
        self._last: SaveHandle | None = None
        self._guards: list[RemovableHandle] | None = None

    def guard(self, trainer: Trainer) -> None:
        """Make the trainer's optimizer steps wait for the copy in flight (once; idempotent).

        Uses `trainer.optimizers` when the trainer exposes them (the embedded gpt3d does),
        else torch's process-wide optimizer hook.
        """
        if self._guards is not None:
            return
        optimizers = getattr(trainer, "optimizers", None)
        self._guards = self.writer.guard(list(optimizers) if optimizers is not None else None)

    def save(self, trainer: Trainer, step: int) -> None:
        """Start saving the trainer's state of `step` into shared memory, overlapped.

        Blocks only for the snapshot (and, if still running, the previous save); the copy
        runs during the next step, whose optimizer step waits for it (`guard`, installed
        here on the first save).
        """
        self.guard(trainer)
        handle = self.writer.save_async({KEY: trainer}, step)
        if handle is not None:
            self._account()
            self.saves += 1
            self._last = handle

    def _account(self) -> None:
        """Count the finished save's blocking (its guard waits included)."""
        if self._last is not None:
            self.blocked_s += self._last.blocked_s
            self._last = None

    def _survey(self) -> Survey:
        mem = self.owner.rank_dir(self.rank)
        buddy = self.owner.rank_dir(self.rank, replica_store(self.env.node))
        return survey(
            memory={self.rank: mem} if mem.is_dir() else {},
            buddy={self.rank: buddy} if buddy.is_dir() else {},
            storage_url=self.env.persist_url or None,
        )

    def restore(self, trainer: Trainer) -> Restored | None:
        """Restore the newest step every rank can obtain (collective over the world).

        Returns:
            What was restored, or None for a fresh start (no rank holds any copy, or no
            step is common to all ranks).

        Raises:
            CorruptCopyError: shards stayed corrupt through `MAX_DECISIONS` decisions.
        """
        s = self._survey()
        world = dist.get_world_size()
        for _ in range(MAX_DECISIONS):
            mine = s.availability([self.rank])[self.rank]
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, mine)
            availability = dict(enumerate(everyone))
            if not any(a.memory or a.buddy or a.storage for a in availability.values()):
                log.info("flash.fresh_start", rank=self.rank)
                return None
            try:
                plan = decide(availability)
            except NoCommonStepError as e:
                log.warning("flash.no_common_step", rank=self.rank, error=str(e))
                return None
            opened = None
            try:
                opened = obtain(s, self.rank, plan.step)
            except CorruptCopyError as e:
                log.warning("flash.shard_unusable", rank=self.rank, step=plan.step, error=str(e))
            oks: list[Any] = [None] * world
            dist.all_gather_object(oks, opened[0].kind.label if opened else "")
            if not all(oks):
                if opened is not None and hasattr(opened[2], "close"):
                    opened[2].close()
                continue  # s.corrupt now excludes the bad copies: decide again
            assert opened is not None
            src, manifest, data = opened
            try:
                state = {KEY: trainer.state_dict()}
                load_into(state, manifest, data)
            finally:
                if hasattr(data, "close"):
                    data.close()
            trainer.load_state_dict(state[KEY])
            sources = {r: str(x) for r, x in enumerate(oks)}
            log.info(
                "flash.restored",
                rank=self.rank,
                step=manifest.step,
                source=src.kind.label,
                sources=sources,
            )
            return Restored(step=manifest.step, source=src.kind.label, sources=sources)
        raise CorruptCopyError(
            f"rank {self.rank}: no step restorable after {MAX_DECISIONS} decisions "
            f"(corrupt: {sorted(s.corrupt)})"
        )

    def close(self) -> None:
        """Finish the save in flight and remove the guard; the slots stay (the agent's)."""
        try:
            self.writer.close()
        finally:
            for h in self._guards or ():
                h.remove()
            self._guards = None
        self._account()
        if self.saves:
            log.info(
                "flash.save_stats",
                rank=self.rank,
                saves=self.saves,
                blocked_ms_mean=round(1000.0 * self.blocked_s / self.saves, 3),
            )
