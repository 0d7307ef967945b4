"""Archived event history: segments of old events written through fsspec before etcd drops them.

The etcd log keeps only the events after the newest snapshot; everything older lives here,
one `ArchiveSegment` (proto/events.proto) per file, named by its first and last sequence
number so a reader finds a range without opening every file:

    <url>/<job_id>/<first:020d>-<last:020d>.seg

A segment is written to a temporary name and renamed, so a reader never sees half a file.
A leader that crashed after writing a segment but before moving etcd's "archived" marker
leaves a segment that the next leader rewrites (same first seq, maybe a later last seq);
`write_segment` removes such stale twins and `read` tolerates overlaps, so the archive never
serves an event twice. The class is synchronous (fsspec is); the log calls it through
`asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import fsspec

from unbroken.common import storage
from unbroken.proto import events_pb2 as ev

SUFFIX = ".seg"


def default_archive_url() -> str:
    """The default archive: `$UNBROKEN_ARCHIVE`, else a local directory under XDG data home."""
    env = os.environ.get("UNBROKEN_ARCHIVE")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "unbroken", "archive")


@dataclass(frozen=True, slots=True)
class Segment:
    """One archive file and the sequence range it holds."""

    first_seq: int
    last_seq: int
    path: str


class Archive:
    """Archived events of one job under an fsspec URL (a local path, file://, s3://, ...)."""

    def __init__(self, url: str, job_id: str) -> None:
        if not url:
            raise ValueError("archive url is empty; give a directory or an fsspec URL")
        # Local paths are made absolute: the URL is recorded in etcd for other processes.
        self.url = url if "://" in url else os.path.abspath(url)
        self.fs: fsspec.AbstractFileSystem
        self.fs, root = storage.url_to_fs(self.url)
        self.dir = f"{root.rstrip('/')}/{job_id}"

    def _name(self, first: int, last: int) -> str:
        return f"{self.dir}/{first:020d}-{last:020d}{SUFFIX}"

    def segments(self) -> list[Segment]:
        """Every segment file, ordered by first sequence number."""
        if not self.fs.exists(self.dir):
            return []
        out = []
        for path in self.fs.ls(self.dir, detail=False):
            name = str(path).rsplit("/", 1)[-1]
            if not name.endswith(SUFFIX):
                continue
            first, _, last = name[: -len(SUFFIX)].partition("-")
            out.append(Segment(int(first), int(last), str(path)))
        return sorted(out, key=lambda s: (s.first_seq, s.last_seq))

    def write_segment(self, events: list[ev.Event]) -> Segment:
        """Durably write `events` (dense, ascending seq) as one segment; return it."""
        assert events, "an empty segment"
        first, last = events[0].seq, events[-1].seq
        assert last - first + 1 == len(events), f"segment {first}-{last} is not dense"
        seg = ev.ArchiveSegment(first_seq=first, last_seq=last, events=events)
        self.fs.makedirs(self.dir, exist_ok=True)
        final = self._name(first, last)
        tmp = final + ".tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(seg.SerializeToString())
            f.flush()
            with contextlib.suppress(AttributeError, OSError, ValueError, NotImplementedError):
                os.fsync(f.fileno())  # local files: survive a power cut, not just a crash
        self.fs.mv(tmp, final)
        for other in self.segments():  # stale twins of a crashed archival (never committed)
            if other.first_seq == first and other.path != final:
                self.fs.rm(other.path)
        return Segment(first, last, final)

    def read(self, from_seq: int, to_seq: int) -> list[ev.Event]:
        """Archived events with from_seq <= seq <= to_seq, ascending, each once."""
        out: list[ev.Event] = []
        nxt = from_seq
        for seg in self.segments():
            if seg.last_seq < nxt or seg.first_seq > to_seq:
                continue
            if seg.first_seq > nxt:
                break  # a hole: the caller reports what is missing
            data = self.fs.cat_file(seg.path)
            for e in ev.ArchiveSegment.FromString(data).events:
                if nxt <= e.seq <= to_seq:
                    out.append(e)
                    nxt = e.seq + 1
            if nxt > to_seq:
                break
        return out
