"""A launch of the node's workers is a value built per start command (agent/workers.py)."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.agent.launch import WorkerLaunch, WorkerSpec
from unbroken.proto import driver_pb2 as dpb

pytestmark = pytest.mark.unit

SPEC = WorkerSpec(cmd=["python", "t.py"], nproc=2, nnodes=3, node_rank=1, master_port=29400)


def test_the_first_launch_is_torchruns_world() -> None:
    launch = WorkerLaunch.of(SPEC)
    assert (launch.world_size, launch.rank_base) == (6, 2)
    assert launch.ranks(SPEC.nproc) == range(2, 4)
    env = launch.environ(SPEC, 1, "/tmp/sock")
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("3", "6", "1")


def test_a_start_command_builds_the_next_launch_and_changes_no_config() -> None:
    first = WorkerLaunch.of(SPEC)
    p = dpb.StartWorkers(
        world_size=8, global_rank_base=6, master_addr="10.0.0.9", master_port=29501, dp=4,
        timeline=2,
    )  # fmt: skip
    nxt = first.started(p, cmd=None, pin_master=False)
    assert (nxt.world_size, nxt.rank_base, nxt.master_addr) == (8, 6, "10.0.0.9")
    # the node's place in the world is the driver's, not the configured --node-rank
    # (Lightning derives a worker's global rank from GROUP_RANK and LOCAL_RANK)
    env = nxt.environ(SPEC, 1, "/tmp/sock")
    assert (env["RANK"], env["GROUP_RANK"], env["LOCAL_RANK"]) == ("7", "3", "1")
    assert int(env["GROUP_RANK"]) * SPEC.nproc + int(env["LOCAL_RANK"]) == int(env["RANK"])
    assert nxt.env["UNBROKEN_DP"] == "4" and nxt.cmd == ("python", "t.py")
    assert first == WorkerLaunch.of(SPEC)  # values, not mutation
    pinned = first.started(p, cmd=["python", "u.py"], pin_master=True)
    assert (pinned.master_addr, pinned.cmd) == ("127.0.0.1", ("python", "u.py"))
    # a start without a world keeps the current one (a restart in place)
    again = nxt.started(dpb.StartWorkers(timeline=3), cmd=None, pin_master=False)
    assert (again.world_size, again.rank_base) == (8, 6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPEC.nproc = 4  # type: ignore[misc]


def test_with_env_sets_and_removes() -> None:
    launch = WorkerLaunch.of(SPEC).with_env(A="1", B="2").with_env(A=None)
    assert launch.env == {"B": "2"}
