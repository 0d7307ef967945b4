"""Do one thing as another local user (`nobody`) in a fresh interpreter; root only.

The interpreter is started by root (`nobody` may not run this machine's Python: it lives
under /root) and drops to `nobody` before it does anything else. It is a new process from
`exec`, not a `fork` of pytest: pytest's process has gRPC's, torch's and the agents' threads
running, and a forked child of it can die before its first line (a CI run of two files at a
time, 2026-12-05: the child aborted with "double free or corruption" after gRPC skipped its
fork handlers, and the test read an empty result).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys

import pytest

NOBODY_UID = pwd.getpwnam("nobody").pw_uid
NOBODY_GID = pwd.getpwnam("nobody").pw_gid

# The child: become nobody, then run one operation; prints its result or the exception's
# "Type: message". Standard library only (-I: no site, no environment, no checkout on the path).
_CHILD = r"""
import json, os, socket, sys
uid, gid, op, args = json.loads(sys.stdin.read())
os.setgroups([]); os.setgid(gid); os.setuid(uid)

def read(path):
    with open(path, "rb") as f:
        return str(len(f.read()))

def send(path, hex_data):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(bytes.fromhex(hex_data), path)
    return "sent"

def squat(path, timeout_s):
    # bind a datagram socket where an agent's should be; what arrives within the timeout
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    os.chmod(path, 0o666)
    s.settimeout(timeout_s)
    try:
        return f"got {len(s.recv(65536))} bytes"
    except TimeoutError:
        return "nothing"

try:
    out = {"read": read, "send": send, "squat": squat}[op](*args)
except BaseException as e:
    out = f"{type(e).__name__}: {e}"
sys.stdout.write(out)
"""


def as_nobody(op: str, *args: str | float) -> str:
    """Run `op` as user nobody: "read" (path: the file's length), "send" (path, hex bytes:
    one datagram to a Unix socket, "sent") or "squat" (path, timeout_s: bind a datagram
    socket there, "got N bytes" or "nothing"). Returns its result or its exception as
    "Type: message".

    Skips the test unless this process is root (only root can become another user).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user (nobody)")
    request = json.dumps([NOBODY_UID, NOBODY_GID, op, list(args)])
    done = subprocess.run(
        [sys.executable, "-I", "-c", _CHILD],
        input=request,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"the child as nobody exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout
