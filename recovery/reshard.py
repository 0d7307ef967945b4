"""Elastic resharding: a torch.distributed.checkpoint StorageReader over flash copies.

Every flash manifest records, for each tensor, the global shape and the offset of the
rank's local shard in it (from the DTensor's placements). `FlashStorageReader` merges
the manifests of all ranks of the saved world into a DCP `Metadata`, so DCP's own load
planners can restore into any new mesh (dp 2 -> 1, 1 -> 2, changed tp or pp): each new
rank reads exactly the chunks it needs from the old ranks' copies, out of shared memory
when they are there (the node's store or a buddy replica), else from storage files.
Keys are flattened the way DCP flattens them, so the same reader also serves a plain
`dcp.load` of a nested model/optimizer state dict. Every copy is verified against its
checksum before its bytes are used.
"""

from __future__ import annotations

import io
import mmap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from unbroken.recovery.flashcopy import CorruptCopyError, Manifest, dtype_from_name, tensor_view
from unbroken.recovery.sources import ShardSource, Survey, obtain

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Where:
    source: int  # index into the reader's sources
    key: str  # tensor fqn or object key
    is_object: bool


class FlashStorageReader(StorageReader):
    """Serves DCP loads from the flash copies (or persisted files) of one step.

    Args:
        sources: one shard source per rank of the saved world, all of the same step.
        opened: the sources already opened and verified (see `reader_from_survey`).
    """

    def __init__(
        self,
        sources: Sequence[ShardSource],
        opened: Sequence[tuple[Manifest, mmap.mmap | memoryview]] | None = None,
    ) -> None:
        super().__init__()
        if not sources:
            raise ValueError("FlashStorageReader needs at least one shard source")
        steps = {s.step for s in sources}
        if len(steps) != 1:
            raise ValueError(f"all sources must hold the same step, got {sorted(steps)}")
        self.sources = list(sources)
        self.step = steps.pop()
        self._manifests: list[Manifest] | None = None
        self._open: dict[int, tuple[Manifest, mmap.mmap | memoryview]] = dict(
            enumerate(opened or ())
        )
        self._storage_data: dict[MetadataIndex, _Where] = {}

    # -- StorageReader
    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: the reader is bound to its sources."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Not addressed by checkpoint id."""
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Merge every source's manifest into DCP metadata (manifests only, no data)."""
        manifests = [
            self._open[i][0] if i in self._open else s.manifest()
            for i, s in enumerate(self.sources)
        ]
        self._manifests = manifests
        sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, _Where] = {}
        for i, m in enumerate(manifests):
            for e in m.entries:
                idx = MetadataIndex(e.fqn, torch.Size(e.global_offset))
                if idx in storage:
                    continue  # a replicated tensor: any holder serves it
                md = sd_md.get(e.fqn)
                if md is None:
                    md = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype_from_name(e.dtype)),
                        size=torch.Size(e.global_shape),
                        chunks=[],
                    )
                    sd_md[e.fqn] = md
                assert isinstance(md, TensorStorageMetadata)
                md.chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(e.global_offset), sizes=torch.Size(e.shape)
                    )
                )
                storage[idx] = _Where(i, e.fqn, False)
            for key in m.objects:
                idx = MetadataIndex(key)
                if key not in sd_md:
                    sd_md[key] = BytesStorageMetadata()
                    storage[idx] = _Where(i, key, True)
        self._storage_data = storage
        return Metadata(
            state_dict_metadata=sd_md,
            storage_data=None,  # kept locally: every rank builds the same metadata
            storage_meta=StorageMeta(checkpoint_id=f"flash-step-{self.step}"),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a: Any) -> None:
        """Metadata is local to each rank; nothing to set up."""
        if not self._storage_data:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    def _data(self, i: int) -> tuple[Manifest, mmap.mmap | memoryview]:
        if i not in self._open:
            manifest, data = self.sources[i].open()
            assert self._manifests is not None
            if manifest != self._manifests[i]:
                raise CorruptCopyError(
                    f"source {i} changed between planning and reading (step {self.step})"
                )
            self._open[i] = (manifest, data)
        return self._open[i]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Copy each requested chunk out of its (verified) copy into the target."""
        for req in plan.items:
            where = self._storage_data[req.storage_index]
            manifest, data = self._data(where.source)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(manifest.objects[where.key]))
                continue
            entry = next(e for e in manifest.entries if e.fqn == where.key)
            src = tensor_view(data, entry)
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise CorruptCopyError(
                    f"{where.key}: chunk {tuple(src.size())} != target {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        """Release mapped copies."""
        for _, data in self._open.values():
            if isinstance(data, mmap.mmap):
                data.close()
        self._open.clear()


def reader_from_survey(survey: Survey, ranks: Sequence[int], step: int) -> FlashStorageReader:
    """A reader over `step` of the saved world's `ranks`, each opened from its best intact
    source (memory, else buddy, else storage; corrupt copies are skipped and recorded).

    Raises:
        CorruptCopyError: some rank has no intact copy of `step`.
    """
    opened = [obtain(survey, r, step) for r in ranks]
    return FlashStorageReader([o[0] for o in opened], [(o[1], o[2]) for o in opened])


def load_resharded(
    state_dict: dict[str, Any],
    sources: Sequence[ShardSource] | FlashStorageReader,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load one step's flash copies (any saved layout) into `state_dict` in place.

    Works inside an initialised process group (every rank calls it, each with the same
    sources) or in a single process without one.
    """
    reader = sources if isinstance(sources, FlashStorageReader) else FlashStorageReader(sources)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state_dict,
                storage_reader=reader,
                process_group=process_group,
                no_dist=not (dist.is_available() and dist.is_initialized()),
            )
    finally:
        reader.close()
