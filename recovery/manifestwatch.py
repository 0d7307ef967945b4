"""Which slots of a rank's ring changed, from inotify(7), so a writer need not stat them all.

The writer (`unbroken.recovery.flashring`) asks before each save; where inotify is not
available it falls back to statting every manifest (`flashcopy.manifest_sig`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
from pathlib import Path
from typing import Any

from unbroken.recovery.flashcopy import KEEP_MARK

# inotify(7): the events that create, replace or remove a manifest, and those that end
# the watch (the directory removed or moved, the queue overflowed)
_IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO = 0x8, 0x40, 0x80
_IN_CREATE, _IN_DELETE = 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_Q_OVERFLOW, _IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
_IN_CHANGES = _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
#: The events of a copy made whole: its manifest renamed into place (`write_manifest`).
MADE_WHOLE = _IN_MOVED_TO
_IN_LOST = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_Q_OVERFLOW | _IN_IGNORED
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_IN_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_IN_READ = 65536  # bytes per read of the event queue
_KEEP = os.fsencode(KEEP_MARK)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


class ManifestWatch:
    """Which slots' manifests any process changed since the last look, from inotify(7).

    A writer must notice another process's change to its ring (a discard, a restored or
    fetched copy) before choosing a slot. Statting every slot's manifest at every save
    (`manifest_sig`) cost a 16-slot ring ~120 us per step on the training thread; the
    kernel's event queue says which few slots to stat. `changed()` returns the slots named
    by events since the last call, or None when the watch cannot say (no inotify, the
    queue overflowed, the directory went away): then the caller stats them all. Events
    naming the agent's keep mark count in `keep_events` (the writer re-reads it then).
    `open()` returns None where inotify is unavailable (not Linux, the per-user instance
    limit reached).
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lost = False
        self.keep_events = 0  # events that named the keep mark (`flashcopy.KEEP_MARK`)

    @classmethod
    def open(cls, rank_dir: Path, events: int = _IN_CHANGES) -> ManifestWatch | None:
        """A watch of `rank_dir` for `events` (every change of a manifest by default;
        `MADE_WHOLE`: only copies made whole)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = _libc()
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return None
            path = os.fsencode(os.fspath(rank_dir))
            if libc.inotify_add_watch(fd, path, events | _IN_DELETE_SELF | _IN_MOVE_SELF) < 0:
                os.close(fd)
                return None
        except (OSError, AttributeError):
            return None
        return cls(fd)

    def changed(self) -> set[int] | None:
        """The slots whose manifest was created, replaced or removed since the last call
        (empty: none), or None when the watch cannot tell (stat every slot)."""
        if self._lost or self._fd < 0:
            return None
        named: set[int] = set()
        while True:
            try:
                raw = os.read(self._fd, _IN_READ)
            except BlockingIOError:
                return named
            except OSError:
                self._lost = True
                return None
            at = 0
            while at + _IN_EVENT.size <= len(raw):
                _, mask, _, n = _IN_EVENT.unpack_from(raw, at)
                name = raw[at + _IN_EVENT.size : at + _IN_EVENT.size + n].rstrip(b"\0")
                at += _IN_EVENT.size + n
                if mask & _IN_LOST:
                    self._lost = True
                    return None
                if name == _KEEP:
                    self.keep_events += 1
                elif name.startswith(b"slot-") and name.endswith(b".manifest"):
                    number = name[5:-9]
                    if number.isdigit():
                        named.add(int(number))
            if len(raw) <= _IN_READ // 2:  # the queue was drained (a save's few events):
                return named  # no second read only to be told so (a system call, a raise)

    def fileno(self) -> int:
        """The inotify descriptor (readable when events wait: for an event loop's reader)."""
        return self._fd

    def keep_changes(self) -> int:
        """How many events named the keep mark (as of the last `changed()`), or -1 when
        the watch cannot tell (read the mark every time)."""
        return -1 if self._lost or self._fd < 0 else self.keep_events

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
