"""Run a function as another local user (`nobody`) in a forked child; root only."""

from __future__ import annotations

import os
import pwd
import traceback
from collections.abc import Callable

import pytest


def as_nobody(fn: Callable[[], str]) -> str:
    """`fn()`'s result (or its exception's repr) as user nobody, from a forked child.

    Skips the test unless this process is root (only root can become another user).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user (nobody)")
    pw = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            try:
                out = fn()
            except BaseException as e:
                out = f"{type(e).__name__}: {e}"
            os.write(w, out.encode())
        except BaseException:
            os.write(w, traceback.format_exc().encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while data := os.read(r, 65536):
        chunks.append(data)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


NOBODY_UID = pwd.getpwnam("nobody").pw_uid
NOBODY_GID = pwd.getpwnam("nobody").pw_gid
