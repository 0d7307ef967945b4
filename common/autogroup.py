"""Linux's autogroup niceness: a session's share of the CPU against other sessions.

Autogroup scheduling (on by default for processes outside a cpu cgroup) shares the CPU
among sessions first and applies a process's niceness only within its session: a nice-19
process in a session of its own competes with the others as their equal unless its
autogroup is nice too (`/proc/PID/autogroup`, "/autogroup-N nice K"). Background work that
must wait for idle CPU (the SDC opinion helper, a waiting warm check) therefore sits in a
session of its own whose autogroup is nice 19. On this VM, two busy loops in sessions of
their own and a third beside them: the third got 2.1 s of a 3 s run at nice 19, and
0.11 s at autogroup nice 19.
"""

from __future__ import annotations


def nice(pid: int = 0) -> int | None:
    """The niceness of process `pid`'s autogroup (0: this one's); None where the kernel
    has no autogroup."""
    try:
        with open(f"/proc/{pid or 'self'}/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_nice(pid: int, value: int) -> bool:
    """Set the niceness of process `pid`'s autogroup (0: this one's; a session leader's
    own, or it changes its session's); False where it cannot (no autogroup, or lowering it
    without CAP_SYS_NICE or RLIMIT_NICE)."""
    try:
        with open(f"/proc/{pid or 'self'}/autogroup", "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False
