"""Where shards can be restored from: survey the sources, open one verified, fall back.

The thin shell around the pure `restore.decide`: `survey` lists what each rank's memory
(its node's flash store), the buddy's replica store and storage hold, reading manifests
only; `ShardSource.open` maps or reads the bytes and verifies them against the checksum (a
writer's unsealed memory copy, hashed when opened, against a sealed twin of the same save
in the buddy or storage when one exists; alone, only its length and manifest are checked);
`obtain` opens the best source of one rank's step and, when a copy turns out truncated or
bit-flipped, records it as corrupt and falls back to the next source. A corrupt copy is
never handed to a caller. `reach_of` says, per step, which saved ranks a survey can reach
and the layout the step was saved under (from manifests; a persisted shard's manifest is
read from its file header alone), the input of `restore.newest_reshardable`.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from unbroken.recovery.flashcopy import CopyRef, CorruptCopyError, Manifest, list_copies, open_copy
from unbroken.recovery.persist import _HEADER, MAGIC, _fs, list_persisted, read_shard
from unbroken.recovery.restore import Availability, Source, StepCopies

log = structlog.get_logger(__name__)

PERSIST_EVERY_S = 30.0  # the persistence interval when neither agent nor driver set one


@dataclass(frozen=True, slots=True)
class ShardSource:
    """One rank's shard of one step in one place."""

    kind: Source
    rank: int
    step: int
    ref: CopyRef | None = None  # memory and buddy copies
    uri: str | None = None  # storage files

    def manifest(self) -> Manifest:
        """The manifest (memory/buddy: from the slot; storage: read with the file)."""
        if self.ref is not None:
            return self.ref.manifest
        assert self.uri is not None
        return read_stored_manifest(self.uri)

    def open(self, expect: int | None = None) -> tuple[Manifest, mmap.mmap | memoryview]:
        """The verified (or, for a writer's unsealed copy, newly sealed) manifest and data.

        `expect`: the checksum an unsealed copy must have (that of a sealed copy of the
        very same save elsewhere: `obtain` finds one).

        Raises:
            CorruptCopyError: the copy fails its checksum (or `expect`), or is truncated
                or gone.
        """
        if self.ref is not None:
            manifest, data = open_copy(self.ref)
            if expect is not None and not self.ref.manifest.sealed and manifest.checksum != expect:
                data.close()
                raise CorruptCopyError(
                    f"{self.ref.data_path} checksum mismatch at step {self.step}: its bytes "
                    "differ from the sealed copy of the same save (buddy or storage)"
                )
            return manifest, data
        assert self.uri is not None
        return read_shard(self.uri, verify=True)


@dataclass(slots=True)
class Survey:
    """What every rank can obtain, and where each (rank, source, step) lives."""

    shards: dict[tuple[int, Source, int], ShardSource]
    corrupt: set[tuple[int, Source, int]]

    def availability(self, ranks: Iterable[int]) -> dict[int, Availability]:
        """The input of `restore.decide` for `ranks`."""
        out = {}
        for r in ranks:
            steps: dict[Source, set[int]] = {s: set() for s in Source}
            for rank, src, step in self.shards:
                if rank == r:
                    steps[src].add(step)
            bad = frozenset((src, step) for rank, src, step in self.corrupt if rank == r)
            out[r] = Availability(
                frozenset(steps[Source.MEMORY]),
                frozenset(steps[Source.BUDDY]),
                frozenset(steps[Source.STORAGE]),
                bad,
            )
        return out

    def candidates(self, rank: int, step: int) -> list[ShardSource]:
        """Usable sources of `rank`'s `step`, best first."""
        return [
            self.shards[(rank, src, step)]
            for src in Source
            if (rank, src, step) in self.shards and (rank, src, step) not in self.corrupt
        ]


def survey(
    *,
    memory: Mapping[int, Path] | None = None,
    buddy: Mapping[int, Path] | None = None,
    storage_url: str | None = None,
) -> Survey:
    """List every copy by manifest (no data is read).

    Args:
        memory: rank -> its slot directory in its node's flash store.
        buddy: rank -> its slot directory in the buddy's replica store.
        storage_url: the persistence URL.
    """
    shards: dict[tuple[int, Source, int], ShardSource] = {}
    for kind, dirs in ((Source.MEMORY, memory or {}), (Source.BUDDY, buddy or {})):
        for rank, d in dirs.items():
            for ref in list_copies(Path(d)):
                key = (rank, kind, ref.manifest.step)
                shards.setdefault(key, ShardSource(kind, rank, ref.manifest.step, ref=ref))
    if storage_url:
        for step, by_rank in list_persisted(storage_url).items():
            for rank, uri in by_rank.items():
                shards[(rank, Source.STORAGE, step)] = ShardSource(
                    Source.STORAGE, rank, step, uri=uri
                )
    return Survey(shards, set())


def obtain(
    survey: Survey, rank: int, step: int
) -> tuple[ShardSource, Manifest, mmap.mmap | memoryview]:
    """Open `rank`'s `step` from its best source, falling back past corrupt copies.

    Corrupt copies are added to `survey.corrupt`, so a following `decide` avoids them.

    Raises:
        CorruptCopyError: every source of this shard is corrupt or missing.
    """
    errors = []
    candidates = survey.candidates(rank, step)
    for src in candidates:
        try:
            manifest, data = src.open(_sealed_twin(src, candidates))
        except CorruptCopyError as e:
            log.warning(
                "restore.corrupt_copy", rank=rank, step=step, source=src.kind.label, error=str(e)
            )
            survey.corrupt.add((rank, src.kind, step))
            errors.append(f"{src.kind.label}: {e}")
            continue
        if manifest.rank != rank or manifest.step != step:
            survey.corrupt.add((rank, src.kind, step))
            errors.append(f"{src.kind.label}: holds rank {manifest.rank} step {manifest.step}")
            continue
        return src, manifest, data
    raise CorruptCopyError(
        f"no intact copy of rank {rank} step {step}: " + ("; ".join(errors) or "no source")
    )


def _sealed_twin(src: ShardSource, candidates: list[ShardSource]) -> int | None:
    """The checksum of a sealed copy of the very save `src` holds unsealed (a writer's
    memory copy): its buddy replica or its persisted shard, sealed from it, carry the
    same manifest but for the checksum (same generation, same creation time, so a step
    computed again after a rollback never matches). None: no such twin, or `src` is sealed."""
    if src.ref is None or src.ref.manifest.sealed:
        return None
    mine = src.ref.manifest
    for other in candidates:
        if other is src:
            continue
        try:
            theirs = other.manifest()
        except (CorruptCopyError, OSError, ValueError, KeyError):
            continue  # its own turn in `obtain` reports it
        if theirs.sealed and replace(theirs, checksum=mine.checksum) == mine:
            return theirs.checksum
    return None


LAYOUT_META = "layout"  # manifest meta key: the parallel layout the copy was saved under


def layout_of(manifest: Manifest) -> dict[str, int]:
    """The layout recorded in a copy's manifest (empty for copies saved without one)."""
    raw = manifest.meta.get(LAYOUT_META) or {}
    return {str(k): int(v) for k, v in raw.items()}


def read_stored_manifest(uri: str) -> Manifest:
    """The manifest of a persisted shard, reading only the file's header (no data).

    Raises:
        CorruptCopyError: the header or the manifest is damaged or truncated.
    """
    fs, path = _fs(uri)
    try:
        with fs.open(path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise CorruptCopyError(f"{uri} truncated: no header")
            magic, mlen = _HEADER.unpack(head)
            if magic != MAGIC:
                raise CorruptCopyError(f"{uri} is not an unbroken shard (magic {magic!r})")
            raw = f.read(mlen)
    except OSError as e:  # removed by retention since it was listed
        raise CorruptCopyError(f"{uri} cannot be read: {e}") from e
    if len(raw) < mlen:
        raise CorruptCopyError(f"{uri} truncated inside its manifest")
    return Manifest.from_bytes(raw)


def reach_of(survey: Survey, *, storage_layouts: bool = True) -> dict[int, StepCopies]:
    """Step -> its saved layout and the saved ranks with a usable copy in `survey`.

    Layouts come from memory and buddy manifests when there are any; a step found only in
    storage costs one manifest read (the first rank's file header) to learn its layout,
    unless `storage_layouts` is False (the layout is left empty: another rank of the world
    reads it, and `restore.saved_layouts` merges what the ranks saw).
    """
    ranks: dict[int, set[int]] = {}
    layouts: dict[int, dict[str, int]] = {}
    for (rank, src, step), shard in sorted(
        survey.shards.items(), key=lambda kv: (kv[0][1], kv[0][0])
    ):
        if (rank, src, step) in survey.corrupt:
            continue
        ranks.setdefault(step, set()).add(rank)
        if step not in layouts and (storage_layouts or src is not Source.STORAGE):
            try:
                layouts[step] = layout_of(shard.manifest())
            except CorruptCopyError as e:
                log.warning("restore.unreadable_manifest", rank=rank, step=step, error=str(e))
                survey.corrupt.add((rank, src, step))
                ranks[step].discard(rank)
    return {s: StepCopies(layouts.get(s, {}), frozenset(r)) for s, r in ranks.items()}
