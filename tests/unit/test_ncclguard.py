"""The NCCL guard's parts that need no GPU: the agent's hold seen by a side thread without
taking it from the main thread, the watchdog setting a worker runs with, the guard's trip
read by the step loop, and NCCL's own peer-failure texts.

On a GPU the whole path (a peer SIGKILLed, the survivor's blocked collective aborted from the
guard's thread, the survivor rejoining the new world in its process) is measured by
`bench/gpu-recovery.sh`; its figures are in bench/results/recovery-gpu.json.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import hookchannel, ncclguard
from unbroken.trainer.rejoin import peer_failure

pytestmark = pytest.mark.unit

# What torch 2.11 raised on an H200 (NCCL 2.28.9) when the peer rank was SIGKILLed, and after
# the guard aborted the survivor's communicators (bench/gpu-recovery.sh).
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:253, remote process "
    "exited or there was a network error, NCCL version 2.28.9\nncclRemoteError: A call failed "
    "possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
    "socketProgress: Connection closed by remote peer localhost<35374>"
)
NCCL_ABORTED = "NCCL communicator was aborted on rank 0. "


def _agent_and_hooks(tmp_path: Path) -> tuple[socket.socket, hookchannel.Hooks]:
    path = str(tmp_path / "agent.sock")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(path)
    return agent, hookchannel.Hooks(socket_path=path, local_rank=0)


def _reply_path(h: hookchannel.Hooks) -> str:
    return h._reply


def _guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[socket.socket, hookchannel.Hooks, ncclguard.NcclGuard, list[int]]:
    """A fake agent, the worker's hooks, an active guard over them (started by the caller)
    and the list its aborts append to."""
    aborted: list[int] = []
    monkeypatch.setattr(ncclguard, "abort_groups", lambda: aborted.append(1) or 1)
    agent, h = _agent_and_hooks(tmp_path)
    g = ncclguard.NcclGuard(h, poll_s=0.01)
    monkeypatch.setattr(ncclguard, "_active", g)
    return agent, h, g, aborted


def test_a_waiting_hold_is_seen_and_still_read_by_the_main_thread(tmp_path: Path) -> None:
    agent, h = _agent_and_hooks(tmp_path)
    try:
        assert h.replies
        assert not h.hold_waiting()  # nothing waiting
        agent.sendto(hpb.WorkerCommand(flash_save=7).SerializeToString(), _reply_path(h))
        assert not h.hold_waiting()  # a command, not a hold
        assert [c.WhichOneof("kind") for c in h.commands()] == ["flash_save"]
        agent.sendto(hpb.WorkerCommand(hold="peer lost").SerializeToString(), _reply_path(h))
        assert h.hold_waiting() and h.hold_waiting()  # a look takes nothing
        got = h.commands()
        assert [(c.WhichOneof("kind"), c.hold) for c in got] == [("hold", "peer lost")]
        assert not h.hold_waiting()
        agent.sendto(b"\xff\x00 not a command", _reply_path(h))
        assert not h.hold_waiting()
    finally:
        h.close()
        agent.close()


def test_a_worker_under_an_agent_asks_the_watchdog_to_keep_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    ncclguard.nccl_keeps_process()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's own choice wins
    ncclguard.nccl_keeps_process()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_no_guard_without_an_nccl_world(tmp_path: Path) -> None:
    """CPU (gloo) worlds leave by `rejoin.sever`; no thread is started for them."""
    import torch.distributed as dist

    agent, h = _agent_and_hooks(tmp_path)
    try:
        assert ncclguard.NcclGuard.start_if_nccl(h) is None  # no world at all
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            assert ncclguard.NcclGuard.start_if_nccl(h) is None
            assert ncclguard.tripped() == ""
        finally:
            dist.destroy_process_group()
    finally:
        h.close()
        agent.close()


def test_a_hold_trips_the_guard_which_aborts_every_group_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's thread on a real (gloo) group: the agent's hold arrives while the main
    thread would be blocked; the guard aborts the groups, and the step loop reads why."""
    import torch.distributed as dist

    agent, h, g, aborted = _guard(tmp_path, monkeypatch)
    try:
        g._thread.start()
        time.sleep(0.05)
        assert ncclguard.tripped() == "" and not aborted
        agent.sendto(hpb.WorkerCommand(hold="node-1 lost").SerializeToString(), _reply_path(h))
        deadline = time.monotonic() + 5
        while not ncclguard.tripped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ncclguard.tripped() == "held by the agent" and aborted == [1]
        assert [c.hold for c in h.commands()] == ["node-1 lost"]  # still the main thread's
        g.stop()
        assert not g._thread.is_alive() and ncclguard.tripped() == ""
    finally:
        g.stop()
        h.close()
        agent.close()
    assert not dist.is_initialized()


def test_leaving_forgets_the_world_at_once_while_its_abort_ends_on_a_side_thread() -> None:
    """`_forget_world` (what `abort_world` does on an NCCL world) on real gloo groups: the
    process forgets its world at once and can make the next one while the old groups' abort
    is still under way; where the guard's thread began that abort, the side thread waits for
    it instead of aborting the same communicators again."""
    import threading

    import torch
    import torch.distributed as dist

    def aborters() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "unbroken-nccl-abort"]

    for th in aborters():  # an earlier test's
        th.join(timeout=5)
    guard_done = threading.Event()
    guard = ncclguard.NcclGuard(hooks=None)  # type: ignore[arg-type]  # its thread: aborting
    guard.why = "NCCL reported COMM_ERROR"
    guard._thread = threading.Thread(target=guard_done.wait, daemon=True)
    guard._thread.start()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0])
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    try:
        assert ncclguard._forget_world(guard)
        assert not dist.is_initialized() and ncclguard._world_guard is None
        waiting = aborters()
        assert len(waiting) == 1 and waiting[0].is_alive()  # waits for the guard's abort
        # the next world, at once, while the old one's abort is still under way
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0] and waiting[0].is_alive()
        guard_done.set()
        waiting[0].join(timeout=5)
        assert not waiting[0].is_alive()
        assert ncclguard._forget_world(None)  # no guard began: the side thread aborts
        for th in aborters():
            th.join(timeout=5)
            assert not th.is_alive()
        assert not dist.is_initialized()
    finally:
        guard_done.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_gloo_world_is_left_at_once_and_its_groups_freed_on_a_side_thread() -> None:
    """`drop_gloo_world` (a survivor leaving its gloo world): the process forgets its world at
    once and makes the next one while a side thread shuts the old groups down and frees them;
    the old groups are not used again."""
    import threading
    import weakref

    import torch
    import torch.distributed as dist

    assert not ncclguard.drop_gloo_world()  # no world: nothing to do
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    old = dist.new_group([0])
    gone = weakref.ref(old)
    t = torch.ones(3)
    dist.all_reduce(t, group=old)
    try:
        assert ncclguard.drop_gloo_world()
        assert not dist.is_initialized()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = dist.new_group([0])
        dist.all_reduce(t, group=group)  # the next world works at once
        assert t.tolist() == [1.0, 1.0, 1.0] and group is not old
        for th in [t for t in threading.enumerate() if t.name == "unbroken-gloo-drop"]:
            th.join(timeout=10)
            assert not th.is_alive()
        del old
        assert gone() is None  # freed: the side thread held the last reference
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_nccls_own_texts_are_peer_failures() -> None:
    assert peer_failure(RuntimeError(NCCL_REMOTE))
    assert peer_failure(RuntimeError(NCCL_ABORTED))
    assert not peer_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_the_sdks_recovery_loop_under_an_agent_keeps_the_process_on_nccl_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the script's own init_process_group: the watchdog's default would end a
    survivor of a peer's NCCL failure, and `recovery_loop` would have nothing to keep."""
    from unbroken.common.workerenv import AGENT_PID
    from unbroken.trainer import hooks

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv(AGENT_PID, raising=False)
    assert hooks.recovery_loop(lambda: 7) == 7  # no agent: nothing changes
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv(AGENT_PID, str(os.getppid()))
    assert hooks.recovery_loop(lambda: 8) == 8
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_a_hold_at_a_step_boundary_is_the_main_threads_and_trips_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the main thread waits at a step boundary (a spike's wait: no collective in
    flight, trainer/keepworld.py), a waiting hold is left to it: the world stays whole for
    it to keep. Once it is past the boundary, a hold trips the guard again."""
    agent, h, g, aborted = _guard(tmp_path, monkeypatch)
    try:
        g._thread.start()
        with ncclguard.at_boundary():
            agent.sendto(hpb.WorkerCommand(hold="rollback").SerializeToString(), _reply_path(h))
            time.sleep(0.2)  # twenty looks of the guard
            assert ncclguard.tripped() == "" and not aborted
            assert [c.hold for c in h.commands()] == ["rollback"]
        agent.sendto(hpb.WorkerCommand(hold="again").SerializeToString(), _reply_path(h))
        deadline = time.monotonic() + 5
        while not ncclguard.tripped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ncclguard.tripped() == "held by the agent" and aborted == [1]
    finally:
        g.stop()
        h.close()
        agent.close()
