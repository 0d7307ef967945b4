"""The reaper: when a process dies, however it dies, the processes it started die too.

A parent-death signal (`prctl(PR_SET_PDEATHSIG)`, `setpriv --pdeathsig`) covers only a
direct child, is cleared across setuid, and is not delivered at all by some kernels (this
project's CI sandbox, measured). Process groups do not help once a child starts its own
session (agents do, so that stopping one does not signal the others). So a small watcher
process does it from outside:

    python -m unbroken.common.reaper --parent PID

It notes every descendant of PID (pid and start time, so a reused pid is never
signalled) twice a second, including ones that later move to their own session or get
re-parented. When PID exits, on SIGKILL too, it sends SIGTERM to every noted process still
alive (an agent then stops its workers, a driver its etcd), waits `--grace` seconds, then
SIGKILLs what is left, then exits. When PID exits after stopping its children itself (the
normal case), it finds nothing alive and exits at once.

`unbroken up` starts one for itself (everything it runs dies with it); `unbroken driver`
starts one when it runs an embedded etcd, and `unbroken agent` one for its workers.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil

POLL_S = 0.5
REAPER = (sys.executable, "-m", "unbroken.common.reaper")


def start(parent: int | None = None, grace_s: float = 10.0) -> subprocess.Popen[bytes] | None:
    """Start a reaper for `parent` (default: this process); None where it cannot run."""
    pid = os.getpid() if parent is None else parent
    try:
        p = subprocess.Popen(
            [*REAPER, "--parent", str(pid), "--grace", str(grace_s), "--detach"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent's group must not stop it
            close_fds=True,
        )
        p.wait(30)  # the first process forks the watcher and exits: no child of ours
        return p
    except (OSError, subprocess.TimeoutExpired):
        return None


def _table() -> dict[int, psutil.Process]:
    """Every process, from one pass over the process table (its parent, status and start
    time read together; psutil keeps the objects, so a known pid's start time is not read
    again)."""
    return {p.pid: p for p in psutil.process_iter(["ppid", "status", "create_time"])}


def _alive_in(table: dict[int, psutil.Process], pid: int, created: float) -> bool:
    p = table.get(pid)
    return (
        p is not None
        and p.info.get("create_time") == created
        and p.info.get("status") != psutil.STATUS_ZOMBIE
    )


def _descendants(table: dict[int, psutil.Process], roots: Iterable[int]) -> set[int]:
    """The pids below `roots` in `table` (the roots themselves not included)."""
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for pid, p in table.items():
        ppid = p.info.get("ppid")
        if ppid is not None and ppid != pid:
            kids[ppid].append(pid)
    out: set[int] = set()
    stack = list(roots)
    while stack:
        for k in kids.get(stack.pop(), ()):
            if k not in out:
                out.add(k)
                stack.append(k)
    return out


def _alive(pid: int, created: float) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:
        pass
    return None


def watch(parent: int, grace_s: float, poll_s: float = POLL_S) -> int:
    """Note `parent`'s descendants until it exits, then stop them; how many were stopped.

    One pass over the process table a poll: asking each noted process for its children
    walked the whole table once per process (psutil reads every process's parent to find
    one's children), and `unbroken up`'s reaper, noting ~30, took 7 % of a core of the
    2-core drill host (a /proc sampler, 2026-12-07)."""
    me = os.getpid()
    try:
        root_created = psutil.Process(parent).create_time()
    except psutil.Error:
        return 0
    seen: dict[int, float] = {}
    while True:
        table = _table()
        if not _alive_in(table, parent, root_created):
            break
        for pid in list(seen):  # gone, or its pid reused
            if not _alive_in(table, pid, seen[pid]):
                del seen[pid]
        # its descendants, and those of processes already noted (re-parented ones included)
        for pid in _descendants(table, [parent, *seen]):
            created = table[pid].info.get("create_time")
            if pid != me and created is not None:
                seen.setdefault(pid, created)
        time.sleep(poll_s)
    left = [p for pid, c in seen.items() if (p := _alive(pid, c)) is not None]
    for p in left:
        try:
            for k in p.children(recursive=True):  # started since the last look
                left.append(k)
        except psutil.Error:
            pass
    for p in left:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(left)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parent", type=int, required=True, help="the process to watch")
    ap.add_argument("--grace", type=float, default=10.0, help="SIGTERM -> SIGKILL seconds")
    ap.add_argument("--detach", action="store_true", help="fork and let the caller go on")
    ns = ap.parse_args()
    if ns.detach and os.fork() > 0:
        os._exit(0)  # the watcher is nobody's child: counting a process's children ignores it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watch(ns.parent, ns.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
