"""Attacks through the agent's local sockets by another local user (`nobody`).

- sending reports (or a forged Hello) to the agent's hook socket;
- squatting the agent socket so the SDK writes its tensors where the squatter says;
- sending `stop` to a worker's reply socket (they were abstract-namespace sockets);
- planting the runtime directory before the agent creates it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.nobody import NOBODY_GID, NOBODY_UID, as_nobody
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor
from unbroken.common.paths import UnsafeRuntimeDirError, private_dir
from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import hookchannel, hooks

pytestmark = pytest.mark.integration


class _Agent:
    """The agent's real hook server on its own event loop thread."""

    def __init__(self, tmp: Path, path: str) -> None:
        spec = WorkerSpec(cmd=["true"], nproc=1, log_dir=str(tmp / "logs"))
        self.server = HookServer(path, Supervisor(spec, path), "n0")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is closed to nobody)."""
    d = Path(tempfile.mkdtemp(prefix="ub-sec-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def agent(open_dir: Path) -> Iterator[_Agent]:
    # nobody may reach the directory: only the socket's own mode and credentials guard it
    a = _Agent(open_dir, str(open_dir / "agent.sock"))
    try:
        yield a
    finally:
        a.close()


def _hello(pid: int = 4242) -> bytes:
    hello = hpb.Hello(reply_socket="/tmp/evil.sock", attach=True, rank=0, world_size=1)
    return hpb.WorkerReport(pid=pid, hello=hello).SerializeToString()


def _send(path: str, data: bytes) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)
    return "sent"


def test_another_user_cannot_send_to_the_agent_socket(agent: _Agent) -> None:
    path = agent.server.path
    assert os.stat(path).st_mode & 0o777 == 0o600
    got = as_nobody("send", path, _hello().hex())
    assert got.startswith("PermissionError"), got
    # a socket someone made world-writable: the kernel's credentials still give nobody away
    os.chmod(path, 0o666)
    assert as_nobody("send", path, _hello().hex()) == "sent"
    deadline = time.monotonic() + 5
    while agent.server.foreign < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert agent.server.foreign == 1
    assert agent.server.attached == {}  # the forged Hello attached nothing


def test_own_reports_carry_the_kernels_pid_not_the_claimed_one(agent: _Agent) -> None:
    _send(agent.server.path, _hello(pid=1))  # claims to be init
    deadline = time.monotonic() + 5
    while not agent.server.attached and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(agent.server.attached) == [os.getpid()]


def test_sdk_refuses_a_squatted_agent_socket(open_dir: Path) -> None:
    shared = open_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    squat = str(shared / "unbroken-agent.sock")

    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(as_nobody("squat", squat, 3.0)))
    t.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(squat) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.stat(squat).st_uid == NOBODY_UID
    hooks.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert hooks.init(squat, timeout_s=1.0) is False
        assert any("belongs to uid" in str(w.message) for w in caught), caught
    finally:
        hooks.reset()
    os.unlink(squat)  # the squatter gives up early
    t.join(15)
    assert result and result[0] in ("nothing", "OSError: timed out", "TimeoutError: timed out")


def test_worker_reply_socket_refuses_another_users_stop(tmp_path: Path) -> None:
    h = hookchannel.Hooks(socket_path=str(tmp_path / "no-agent.sock"))
    try:
        reply = h._reply
        assert reply.startswith("/") and not reply.startswith("\0")  # a path, not abstract
        assert os.stat(os.path.dirname(reply)).st_mode & 0o777 == 0o700
        stop = hpb.WorkerCommand(command_id="x", stop="evict").SerializeToString()
        got = as_nobody("send", reply, stop.hex())
        assert got.startswith("PermissionError"), got
        assert list(h.commands()) == []  # nothing arrived
    finally:
        h.close()
    assert not os.path.exists(reply)


def test_a_planted_runtime_directory_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "unbroken-0"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY_UID, NOBODY_GID) if os.geteuid() == 0 else pytest.skip("root only")
    with pytest.raises(UnsafeRuntimeDirError, match="belongs to uid"):
        private_dir(str(planted))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(UnsafeRuntimeDirError, match="symlink"):
        private_dir(str(link))
    assert (
        private_dir(str(tmp_path / "fresh"))
        and (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700
    )
