"""Flash checkpoints for a trainer running under a node agent: save every N steps, restore.

The agent owns the node's flash memory and tells its workers where it is through the
environment (`UNBROKEN_FLASH_ROOT`, `_JOB`, `_NODE`, `UNBROKEN_PERSIST_URL`: the
`WorkerEnv` contract of common/workerenv.py, which agent/flash.py writes). A worker
saves its rank's full sharded trainer state (model, optimizer, step, data position, RNG)
into its slots with `FlashWriter`; the agent persists and replicates it.

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
again without it. Nothing found anywhere: a fresh start.

From storage, one rank per replica group reads (the ranks holding identical state: the
data-parallel replicas of one position under `dp_mode="replicate"` or HSDP) and broadcasts
the verified copy over the group's `dp_replicate` process group; the others never open
storage. Under ZeRO (no two ranks hold the same shard) every rank is its own group.

Every copy records the layout it was saved under (world size and mesh shape, manifest meta
`layout`). When the newest step every rank can get was saved under another layout (the
world shrank or grew, or tp/pp changed), the ranks reshard instead: each opens every saved
rank's copy of that step from the best place it can reach (this node's memory, the replica
stores, else storage) and torch.distributed.checkpoint's load planner fills the new shards
from them (`unbroken.recovery.reshard`).

Only the shell (files, collectives) lives here; the decision is the pure
`unbroken.recovery.restore.decide`.
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from unbroken.common import workerenv
from unbroken.common.workerenv import WorkerEnv
from unbroken.recovery.flash import FlashWriter, SaveHandle, load_into
from unbroken.recovery.flashcopy import (
    LOCAL_STORE,
    PERSIST_META,
    CorruptCopyError,
    Manifest,
    checksum,
    list_copies,
    replica_store,
)
from unbroken.recovery.flashowner import FLASH_COPIES, FlashConfig, FlashOwner
from unbroken.recovery.flashplan import Shared, Snapshot
from unbroken.recovery.persist import TIMELINE_META, current_timeline
from unbroken.recovery.reshard import FlashStorageReader, load_resharded, reader_from_survey
from unbroken.recovery.restore import (
    Availability,
    NoCommonStepError,
    RestorePlan,
    Source,
    StepCopies,
    decide,
    describe_newest,
    newest_healable,
    newest_reshardable,
    restrict,
    same_layout_steps,
    saved_layouts,
)
from unbroken.recovery.sources import (
    LAYOUT_META,
    ShardSource,
    Survey,
    obtain,
    reach_of,
    survey,
)
from unbroken.recovery.statehash import SDC_META
from unbroken.trainer.plugin import GroupValue, Meshed, Optimizers, Snapshots, Stateful
from unbroken.trainer.rejoin import check_kept_caches
from unbroken.trainer.rtrace import mark

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

log = structlog.get_logger(__name__)

KEY = "trainer"
MAX_DECISIONS = 4  # re-decide at most this often when shards turn out corrupt
REPLICATE_DIM = "dp_replicate"  # the mesh dimension along which ranks hold the same state
# The longest a restore waits for its agent to finish fetching the copies it took over
# (a spare: `FlashOwner.fetching`); the fetch's own limit is shorter, so this is a backstop
# for a marker its agent left behind when it died.
FETCH_WAIT_S = 30.0
SPR = "stages_per_rank"


@dataclass(kw_only=True, slots=True)
class FlashEnv:
    """Where the local agent keeps flash copies (from the worker's environment)."""

    root: str
    job: str
    node: str
    persist_url: str = ""
    copies: int = FLASH_COPIES  # the ring's size the agent asks for

    def __post_init__(self) -> None:
        if not self.root or not self.job or not self.node:
            raise ValueError(
                f"{workerenv.FLASH_ROOT}, {workerenv.FLASH_JOB} and {workerenv.FLASH_NODE} "
                "must all be set "
                "(the agent sets them)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FlashEnv | None:
        """The agent's flash store, or None when not running under an agent that has one."""
        w = WorkerEnv.from_env(os.environ if env is None else env)
        if not w.flash_root:
            return None
        return cls(
            root=w.flash_root,
            job=w.flash_job,
            node=w.flash_node,
            persist_url=w.persist_url,
            copies=FLASH_COPIES if w.flash_copies is None else w.flash_copies,
        )


def _int(raw: str, default: int) -> int:
    try:
        return int(raw) if raw else default
    except ValueError:
        log.warning("flash.bad_env_value", value=raw, using=default)
        return default


@dataclass(frozen=True, slots=True)
class Restored:
    """What `FlashCheckpointer.restore` loaded."""

    step: int
    source: str  # this rank's: memory, buddy or storage (for a broadcast: the root's)
    sources: dict[int, str]  # every rank's
    read: bool = True  # this rank opened a copy itself (False: it received a broadcast)
    broadcast_from: int | None = None  # the rank whose copy this rank received
    resharded: bool = False  # saved under another layout, loaded through DCP's planner


def replica_dirs(owner: FlashOwner, own: str) -> dict[int, Path]:
    """Each rank's replica directory on this node, from the store written last.

    Several nodes may have sent this node a rank over time (each world's buddy of it): the
    store whose newest copy of the rank was made last holds the live timeline's. The first
    store listed was taken before, and a node lost after a grow-back resharded from a store
    of a node gone long before: step 275 where step 2012 was at hand (bench-recovery,
    replica mode: 482 steps lost). `own` (this node's own replica store) wins a tie.
    """
    out: dict[int, Path] = {}
    made: dict[int, float] = {}
    stores = owner.stores() if owner.job_dir.is_dir() else []
    for store in sorted(stores, key=lambda x: x != own):
        if store == LOCAL_STORE:
            continue
        for r in owner.ranks(store):
            rank_dir = owner.rank_dir(r, store)
            t = max((c.manifest.created_unix for c in list_copies(rank_dir)), default=-1.0)
            if r not in out or t > made[r]:
                out[r], made[r] = rank_dir, t
    return out


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
        local = _int(os.environ.get("LOCAL_WORLD_SIZE", ""), 1)
        self.owner = FlashOwner(
            FlashConfig(root=env.root, job=env.job, copies=env.copies, local_ranks=max(1, local))
        )
        self.writer = FlashWriter(rank, self.owner)
        self.saves = 0
        self.blocked_s = 0.0  # of finished saves; the one in flight is added when replaced
        self._last: SaveHandle | None = None
        self._guards: list[RemovableHandle] | None = None
        self._layout: dict[str, int] | None = None
        self._snaps: tuple[Stateful, bool] | None = None  # (trainer, implements Snapshots)

    def guard(self, trainer: Stateful) -> None:
        """Make the trainer's optimizer steps wait for the copy in flight (once; idempotent).

        Guards the trainer's own optimizers when it names them (`plugin.Optimizers`: the
        embedded gpt3d does), else every optimizer (torch's process-wide optimizer hook).
        """
        if self._guards is not None:
            return
        optimizers = list(trainer.optimizers) if isinstance(trainer, Optimizers) else None
        self._guards = self.writer.guard(optimizers)

    def prepare(self, trainer: Stateful) -> int:
        """Size, map (and on CUDA pin) the ring for the trainer's state before training, so
        the first save pays no allocation, page-table building or host registration.
        Returns the bytes per copy."""
        return self.writer.prepare(self._state(trainer))

    def save(
        self,
        trainer: Stateful,
        step: int,
        *,
        persist: bool = True,
        sdc: Mapping[str, Any] | None = None,
    ) -> bool:
        """Start saving the trainer's state of `step` into the ring in shared memory.

        Blocks only for the snapshot: with a trainer that implements `Snapshots` (the
        embedded engine) that is its few changing values, not `state_dict()`. The copy
        runs during the next step, whose optimizer step waits for it (`guard`, installed
        here on the first save); the checksum is never waited for. A copy for memory only
        (`persist=False`) is skipped when the ring has no free slot (counted in
        `writer.skipped_busy`); one the agent must persist always happens, and so does a
        fingerprinted one (`sdc`): it is the step a silent corruption rolls back to (a
        skipped step 15 under CI load sent a rollback to step 10).

        `sdc`: the step's fingerprints' plan over the copy's tensors (trainer/sdc.py
        `copy_meta`), so the buddy can recompute them from the copy.

        Returns:
            Whether a save started.
        """
        self.guard(trainer)
        meta = {
            LAYOUT_META: self.layout(trainer),
            TIMELINE_META: current_timeline(),
            PERSIST_META: persist,
        }
        if sdc is not None:
            meta[SDC_META] = dict(sdc)
        skip = not persist and sdc is None
        handle = self.writer.save_async(self._state(trainer), step, meta=meta, skip_if_busy=skip)
        if handle is None:
            return False
        self._account()
        self.saves += 1
        self._last = handle
        return True

    def _state(self, trainer: Stateful) -> Any:
        """What a save of `trainer` hands the writer: a `Snapshot` where the trainer takes
        them (`Snapshots`, with a key now), else its state dict."""
        if self._snaps is None or self._snaps[0] is not trainer:  # a protocol check is
            self._snaps = (trainer, isinstance(trainer, Snapshots))  # ~10 us: once
        snap: Snapshots = trainer  # type: ignore[assignment]
        key = snap.snapshot_key() if self._snaps[1] else None
        if key is None:
            return {KEY: trainer}
        return Snapshot(
            key=key, full=lambda: {KEY: trainer}, fresh=lambda: flat_fresh(snap), flat=True
        )

    def entry_names(self, tensors: list[Any]) -> list[str | None]:
        """The copy's entry name of each of `tensors` (local tensors of the saved state; None:
        not in the copy, or no save planned yet)."""
        return self.writer.entry_names(tensors)

    def _account(self) -> None:
        """Count the finished save's blocking (its guard waits included)."""
        if self._last is not None:
            self.blocked_s += self._last.blocked_s
            self._last = None

    def layout(self, trainer: Stateful) -> dict[str, int]:
        """The layout this rank's copies are saved under: world size, mesh shape, stages.

        A trainer without a mesh (not `plugin.Meshed`: a plugin) records only the world size.
        """
        if self._layout is None:
            layout = {"world": dist.get_world_size()}
            if isinstance(trainer, Meshed):
                mesh = trainer.device_mesh()
                if mesh.mesh_dim_names:
                    dims = zip(mesh.mesh_dim_names, mesh.shape, strict=True)
                    layout.update({str(n): int(x) for n, x in dims})
                layout[SPR] = trainer.stages_per_rank()
            self._layout = layout
        return self._layout

    def _replicas(self, trainer: Stateful) -> tuple[tuple[Any, ...], dist.ProcessGroup | None]:
        """This rank's replica key (equal on ranks holding identical state) and the process
        group of its replica group (None when it is alone)."""
        mesh = trainer.device_mesh() if isinstance(trainer, Meshed) else None
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        if mesh is None or REPLICATE_DIM not in names:
            return ("rank", self.rank), None
        coord = mesh.get_coordinate()
        assert coord is not None, "every rank of the world is in the trainer's mesh"
        key = tuple((n, c) for n, c in zip(names, coord, strict=True) if n != REPLICATE_DIM)
        sub = mesh[REPLICATE_DIM]
        return key, (sub.get_group() if sub.size() > 1 else None)

    def _await_fetch(self, limit_s: float = FETCH_WAIT_S) -> None:
        """Wait while the agent fetches the copies of the node this rank took over into
        their replica store (a spare's workers start during that fetch)."""
        marker = self.owner.fetching(replica_store(self.env.node))
        if not marker.exists():
            return
        t0 = time.monotonic()
        while marker.exists():
            if time.monotonic() - t0 > limit_s:
                log.warning("flash.fetch_wait_expired", marker=str(marker), waited_s=limit_s)
                return
            time.sleep(0.002)
        mark("r_fetched")

    def _survey(self) -> Survey:
        mem = self.owner.rank_dir(self.rank)
        buddy = self.owner.rank_dir(self.rank, replica_store(self.env.node))
        return survey(
            memory={self.rank: mem} if mem.is_dir() else {},
            buddy={self.rank: buddy} if buddy.is_dir() else {},
            storage_url=self.env.persist_url or None,
        )

    def _wide_survey(self) -> Survey:
        """Every rank's copies this process can reach: the node's store, every replica
        store it holds, and storage (what a reshard may read)."""
        memory = {r: self.owner.rank_dir(r) for r in self.owner.ranks()}
        buddy = replica_dirs(self.owner, replica_store(self.env.node))
        return survey(memory=memory, buddy=buddy, storage_url=self.env.persist_url or None)

    def restore(self, trainer: Stateful, *, not_after: int | None = None) -> Restored | None:
        """Restore the newest step every rank can obtain (collective over the world).

        Same layout: each rank loads its own shard (or receives it from its replica
        group's reader). Another layout: every rank reshards through DCP from all saved
        ranks' copies. The newer of the two candidates wins.

        Args:
            trainer: the trainer to load into.
            not_after: only steps <= this (a loss-spike rollback's committed target, which
                the driver passes as UNBROKEN_RESTORE_STEP); None: the newest.

        Returns:
            What was restored, or None for a fresh start (no rank holds any copy, or no
            step is common to all ranks).

        Raises:
            CorruptCopyError: shards stayed corrupt through `MAX_DECISIONS` decisions.
        """
        mark("r_begin")
        check_kept_caches()  # a rejoin's kept DTensor caches, checked before any state is read
        self._await_fetch()
        layout = self.layout(trainer)
        own, wide = self._survey(), self._wide_survey()
        key, group = self._replicas(trainer)
        world = dist.get_world_size()
        heal = True  # off after a heal that failed: the next decision reads what it can reach
        for _ in range(MAX_DECISIONS):
            mine = (
                own.availability([self.rank])[self.rank],
                reach_of(wide, storage_layouts=self.rank == 0),
                key,
            )
            everyone: list[Any] = [None] * world
            mark("r_survey")
            dist.all_gather_object(everyone, mine)
            mark("r_gathered")
            availability: dict[int, Availability] = {r: e[0] for r, e in enumerate(everyone)}
            reach: dict[int, dict[int, StepCopies]] = {r: e[1] for r, e in enumerate(everyone)}
            if not any(a.memory or a.buddy or a.storage for a in availability.values()) and not any(
                reach.values()
            ):
                log.info("flash.fresh_start", rank=self.rank)
                return None
            groups: dict[Any, list[int]] = {}
            for r, e in enumerate(everyone):
                groups.setdefault(e[2], []).append(r)
            plan, why = self._plan(
                availability, groups, same_layout_steps(reach, layout), not_after
            )
            other = newest_reshardable(reach, layout, not_after=not_after)
            healed = newest_healable(reach, not_after=not_after) if heal else None
            reachable = max(plan.step if plan is not None else -1, -1 if other is None else other)
            if healed is not None and healed > reachable:
                heal = False
                saved = saved_layouts(reach)[healed]
                assert saved, "a healable step has a known layout"
                done = self._heal(trainer, wide, healed, saved, reach)
            elif other is not None and (plan is None or other > plan.step):
                saved = saved_layouts(reach)[other]
                assert saved, "a reshardable step has a known layout"
                done = self._reshard(trainer, wide, other, saved, layout)
            elif plan is not None:
                done = self._load_own(trainer, own, plan, groups[key], group)
            else:
                log.warning("flash.no_common_step", rank=self.rank, error=why)
                return None
            if done is not None:
                return done
            # some copy turned out corrupt: the surveys now exclude it, decide again
        raise CorruptCopyError(
            f"rank {self.rank}: no step restorable after {MAX_DECISIONS} decisions "
            f"(corrupt: {sorted(own.corrupt | wide.corrupt)})"
        )

    def _plan(
        self,
        availability: dict[int, Availability],
        groups: dict[Any, list[int]],
        same: frozenset[int],
        not_after: int | None,
    ) -> tuple[RestorePlan | None, str]:
        """The restore of a step saved in this layout (None, and why, when none is common
        to every rank)."""
        try:
            plan = decide(
                {r: restrict(a, same) for r, a in availability.items()},
                list(groups.values()),
                not_after=not_after,
            )
        except NoCommonStepError as e:
            return None, str(e)
        if (
            self.rank == 0
            and Source.STORAGE in plan.source_by_rank.values()
            and any(a.memory or a.buddy for a in availability.values())
        ):  # copies in memory, none common to every rank: say what each one had
            log.warning(
                "flash.restore_from_storage",
                step=plan.step,
                newest=describe_newest(availability),
            )
        return plan, ""

    def _all_ok(self, ok: bool, label: str) -> dict[int, str] | None:
        """Every rank's label when every rank is ok, else None (collective)."""
        oks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(oks, (ok, label))
        if not all(o[0] for o in oks):
            return None
        return {r: str(o[1]) for r, o in enumerate(oks)}

    def _load_own(
        self,
        trainer: Stateful,
        s: Survey,
        plan: RestorePlan,
        group_ranks: list[int],
        group: dist.ProcessGroup | None,
    ) -> Restored | None:
        """Load this rank's own shard of `plan.step`: opened itself, or broadcast by the
        reader of its replica group."""
        bc = next((b for b in plan.broadcasts if b.root in group_ranks), None)
        receiving = bc is not None and self.rank != bc.root
        opened = None
        if not receiving:
            try:
                opened = obtain(s, self.rank, plan.step)
            except CorruptCopyError as e:
                log.warning("flash.shard_unusable", rank=self.rank, step=plan.step, error=str(e))
        # A receiver's source is its root's (the plan's); only readers report their own.
        label = plan.source_by_rank[self.rank].label if receiving else ""
        if opened is not None:
            label = opened[0].kind.label
        mark("r_opened")
        sources = self._all_ok(receiving or opened is not None, label)
        mark("r_agreed")
        if sources is None:
            if opened is not None and isinstance(opened[2], mmap.mmap):
                opened[2].close()
            return None
        data: Any
        if bc is not None:
            assert group is not None, "a broadcast plan implies a replica group"
            manifest, data = self._broadcast(bc.root, opened, group)
        else:
            assert opened is not None
            manifest, data = opened[1], opened[2]
        try:
            state = {KEY: trainer.state_dict()}
            mark("r_state_dict")
            load_into(state, manifest, data)
            mark("r_copied")
        finally:
            if isinstance(data, mmap.mmap):
                data.close()
        trainer.load_state_dict(state[KEY])
        mark("r_loaded")
        self.writer.invalidate_snapshot()
        done = Restored(
            step=manifest.step,
            source=sources[self.rank],
            sources=sources,
            read=not receiving,
            broadcast_from=bc.root if receiving and bc is not None else None,
        )
        log.info(
            "flash.restored",
            rank=self.rank,
            step=done.step,
            source=done.source,
            sources=sources,
            read=done.read,
            broadcast_from=done.broadcast_from,
        )
        return done

    def _broadcast(
        self,
        root: int,
        opened: tuple[Any, Manifest, Any] | None,
        group: dist.ProcessGroup | None,
    ) -> tuple[Manifest, Any]:
        """Send the root's verified copy to its replica group (None: the world) by a
        gloo/NCCL broadcast; every member receives it and checks it against the checksum."""
        head: list[Any] = [opened[1].to_bytes() if opened is not None else None]
        dist.broadcast_object_list(head, src=root, group=group)
        manifest = Manifest.from_bytes(head[0])
        if self.rank == root:
            assert opened is not None
            with warnings.catch_warnings():  # a read-only mapping: gloo only reads it
                warnings.simplefilter("ignore", UserWarning)
                buf = (
                    torch.frombuffer(opened[2], dtype=torch.uint8, count=manifest.data_nbytes)
                    if manifest.data_nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
        else:
            buf = torch.empty(manifest.data_nbytes, dtype=torch.uint8)
        dist.broadcast(buf, src=root, group=group)
        if opened is not None:
            del buf  # release the view of the root's own copy before it is closed
            return opened[1], opened[2]
        data = memoryview(buf.numpy().data)
        if checksum(data) != manifest.checksum:
            raise CorruptCopyError(
                f"rank {self.rank}: the copy of step {manifest.step} broadcast by rank {root} "
                "fails its checksum (corrupted in transfer)"
            )
        return manifest, data

    def _heal(
        self,
        trainer: Stateful,
        wide: Survey,
        step: int,
        saved: Mapping[str, int],
        reach: Mapping[int, Mapping[int, StepCopies]],
    ) -> Restored | None:
        """Load `step`, which some ranks of this world cannot reach whole: each saved
        rank's shard that not every rank can open is broadcast by the lowest rank that can
        (a heal from live peers), then DCP's planner reshards as from local copies.

        The case: a replica that sat out (the replica policy) while its node was lost comes
        back on a spare. The survivors' copies since the shrink went to no buddy (the lost
        node was their only peer), so the spare reaches nothing newer than storage; without
        the heal the grown world went back to the last persisted step, hundreds of steps.

        Collective. None when a copy could not be opened or failed its checksum in
        transfer on some rank (the caller decides again, without healing).
        """
        world = dist.get_world_size()
        ranks = range(int(saved["world"]))
        roots: dict[int, int] = {}  # saved rank -> the rank that sends its shard
        for sr in ranks:
            holders = [r for r in range(world) if step in reach[r] and sr in reach[r][step].ranks]
            if len(holders) < world:
                roots[sr] = holders[0]
        local: dict[int, tuple[ShardSource, Manifest, Any]] = {}
        ok = True
        for sr in ranks:
            if roots.get(sr, self.rank) != self.rank:
                continue  # received below
            try:
                local[sr] = obtain(wide, sr, step)
            except CorruptCopyError as e:
                log.warning("flash.heal_source_unusable", rank=self.rank, step=step, error=str(e))
                ok = False
                break
        got: dict[int, tuple[Manifest, Any]] = {}
        if self._all_ok(ok, "") is not None:
            for sr, root in sorted(roots.items()):  # every rank in every broadcast
                try:
                    manifest, data = self._broadcast(root, local.get(sr), None)
                except CorruptCopyError as e:
                    log.warning("flash.heal_transfer_failed", rank=self.rank, error=str(e))
                    ok = False
                    continue
                if self.rank != root:
                    got[sr] = (manifest, data)
        label = (
            "peer" if got else max((o[0].kind for o in local.values()), default=Source.MEMORY).label
        )
        sources = self._all_ok(ok, label)
        if sources is None:
            for src_manifest_data in local.values():
                if isinstance(src_manifest_data[2], mmap.mmap):
                    src_manifest_data[2].close()
            return None
        srcs = [
            local[sr][0] if sr in local else ShardSource(Source.MEMORY, sr, step) for sr in ranks
        ]
        opened = [(local[sr][1], local[sr][2]) if sr in local else got[sr] for sr in ranks]
        reader = FlashStorageReader(srcs, opened)
        return self._load(trainer, reader, step, label, sources, saved, healed_from=roots)

    def _reshard(
        self,
        trainer: Stateful,
        wide: Survey,
        step: int,
        saved: Mapping[str, int],
        layout: Mapping[str, int],
    ) -> Restored | None:
        """Load `step`, saved under `saved`, into this layout through DCP's load planner."""
        reader = None
        try:
            reader = reader_from_survey(wide, range(int(saved["world"])), step)
        except CorruptCopyError as e:
            log.warning("flash.reshard_source_unusable", rank=self.rank, step=step, error=str(e))
        label = ""
        if reader is not None:
            label = max((src.kind for src in reader.sources), default=Source.MEMORY).label
        sources = self._all_ok(reader is not None, label)
        if sources is None:
            if reader is not None:
                reader.close()
            return None
        assert reader is not None
        return self._load(trainer, reader, step, label, sources, saved, layout=dict(layout))

    def _load(
        self,
        trainer: Stateful,
        reader: FlashStorageReader,
        step: int,
        label: str,
        sources: dict[int, str],
        saved: Mapping[str, int],
        **said: Any,
    ) -> Restored:
        """Reshard `step` (saved under `saved`) from `reader` into the trainer through
        DCP's load planner (closes the reader); `said`: more for the log line."""
        state = {KEY: trainer.state_dict()}
        load_resharded(state, reader)
        trainer.load_state_dict(state[KEY])
        self.writer.invalidate_snapshot()
        log.info(
            "flash.restored",
            rank=self.rank,
            step=step,
            source=label,
            sources=sources,
            resharded=True,
            saved_layout=dict(saved),
            **said,
        )
        return Restored(step=step, source=label, sources=sources, resharded=True)

    def discard_after(self, step: int) -> int:
        """Forget this node's and storage's copies after `step`: a dead timeline (collective).

        After a rollback those copies hold the state the spike spoiled, and their step
        numbers will recur. Local rank 0 of each node discards every copy newer than `step`
        in the node's stores (its own and the replicas it holds for buddies), global rank 0
        those in storage; a barrier then keeps every rank from saving the next step before
        the discard is done. Returns the copies discarded here.
        """
        n = 0
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and self.owner.job_dir.is_dir():
            for store in self.owner.stores():
                n += self.owner.discard_newer_than(step, store)
        if self.rank == 0 and self.env.persist_url:
            from unbroken.recovery.persist import discard_after

            n += len(discard_after(self.env.persist_url, step))
        dist.barrier()
        log.info("flash.discarded_dead_timeline", rank=self.rank, after_step=step, copies=n)
        return n

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
                skipped_busy=self.writer.skipped_busy,
                snapshot_hits=self.writer.snapshot_hits,
                copies=self.writer.copies,
                blocked_ms_mean=round(1000.0 * self.blocked_s / self.saves, 3),
            )


# values DCP's flattening keeps whole (a tuple is a leaf to it; a list or a mapping is not)
_LEAVES = frozenset({float, int, bool, str, tuple, type(None)})


def flat_fresh(trainer: Snapshots) -> dict[str, Any]:
    """The trainer's fresh values under the keys DCP's `flatten_state_dict` gives
    `{KEY: state}`. A trainer with `snapshot_fresh_shared` (plugin.SharedSnapshots) gives
    its param-group values by group: one `Shared` entry each, naming the per-parameter keys
    that hold it. Otherwise an `optimizer` entry of scalars keyed by flattened names (the
    param-group values, one per parameter: hundreds) is prefixed, not traversed. The few
    other values go through DCP's flattening."""
    by_group = getattr(trainer, "snapshot_fresh_shared", None)
    if by_group is not None:
        rest, groups = by_group()
        out: dict[str, Any] = {}
        if not _flatten_into(out, KEY, rest):
            out = dict(flatten_state_dict({KEY: rest})[0])
        for name, (group, k, _) in zip(_shared_names(groups), groups, strict=True):
            out[name[0]] = Shared(name[1], group[k])
        return out
    fresh = trainer.snapshot_fresh()
    opt = fresh.get("optimizer")
    if not isinstance(opt, dict) or not all(type(v) in _LEAVES for v in opt.values()):
        return dict(flatten_state_dict({KEY: fresh})[0])
    rest = {k: v for k, v in fresh.items() if k != "optimizer"}
    out = dict(flatten_state_dict({KEY: rest})[0])
    prefix = f"{KEY}.optimizer."
    out.update({prefix + str(k): v for k, v in opt.items()})
    return out


def _flatten_into(out: dict[str, Any], prefix: str, value: Mapping[str, Any]) -> bool:
    """DCP's `flatten_state_dict` of `{prefix: value}` into `out`, for nested mappings
    whose leaves are no lists (a tenth of DCP's traversal: a step's few fresh values
    went through ~60 us of it per save). False where DCP could differ (a list, whose
    elements DCP may name by index; a key that repeats): flatten with DCP then."""
    for k, v in value.items():
        name = f"{prefix}.{k}"
        if isinstance(v, Mapping):
            if not _flatten_into(out, name, v):
                return False
        elif isinstance(v, list) or name in out:
            return False
        else:
            out[name] = v
    return True


# the last group list `_shared_names` saw and its names: (the Shared entry's own name, the
# full flattened keys that hold the value), built once per state, not per save
_names_last: tuple[Any, list[tuple[str, tuple[str, ...]]]] = (None, [])


def _shared_names(groups: Sequence[GroupValue]) -> list[tuple[str, tuple[str, ...]]]:
    global _names_last
    last = _names_last
    if last[0] is groups:
        return last[1]
    prefix = f"{KEY}.optimizer."
    names = [
        (f"{prefix}~shared.{i}.{k}", tuple(prefix + key for key in keys))
        for i, (_, k, keys) in enumerate(groups)
    ]
    _names_last = (groups, names)
    return names
