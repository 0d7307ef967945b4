"""A rejoin keeps DTensor's caches only where the process keeps its place in the world
(trainer/rejoin.py `apply_rejoin`, `check_kept_caches`): a real 1-rank gloo world in a
child process, left and joined again three ways. A warm standby's dry run is forgotten
where the real world gives it another place (`forget_dry_run_caches`): in a fake dp2 world
in one process, and a real standby (agent/warm.py) promoted to pp stage 1 of a 4-rank gloo
world beside three cold workers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainenv import plain_worker_env
from unbroken.agent import warm as warmlib
from unbroken.common.workerenv import WARM_ARGV
from unbroken.driver.etcd import free_port
from unbroken.trainer.rtrace import TRACE

pytestmark = pytest.mark.integration

_CACHES = r"""
import json, os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor._redistribute import _gen_transform_infos as cache
from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import rejoin

os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")

def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    (x * 2 + x).sum().full_tensor()  # fills the redistribution cache
    return float((x * 3).full_tensor().sum())

out = {"first": world()}
out["filled"] = cache.cache_info().currsize
def leave():
    rejoin._left.groups = rejoin.world_groups()
    dist.destroy_process_group()
leave()
rejoin.apply_rejoin(hpb.Rejoin(env={"RANK": "0", "WORLD_SIZE": "1"}))
out["same_place_kept"] = [rejoin._left.kept, cache.cache_info().currsize]
out["again"] = world()  # the kept entries' meshes resolve the new world's groups
out["check"] = rejoin.check_kept_caches()
leave()
rejoin.apply_rejoin(hpb.Rejoin(env={"RANK": "0", "WORLD_SIZE": "1"}))
world()
rejoin._left.groups = {n: (7,) for n in rejoin._left.groups}  # as if named for other ranks
out["renamed"] = [rejoin.check_kept_caches(), cache.cache_info().currsize]
dist.destroy_process_group()
os.environ["RANK"] = "3"
rejoin.apply_rejoin(hpb.Rejoin(env={"RANK": "1", "WORLD_SIZE": "2"}))
out["moved"] = [rejoin._left.kept, cache.cache_info().currsize]
print(json.dumps(out))
"""


def test_a_rejoin_keeps_dtensor_caches_only_where_this_rank_keeps_its_place() -> None:
    """A survivor that keeps its rank in a world of its size keeps DTensor's sharding caches
    (their meshes name groups the new world recreates under the same names); a new place, or
    a new world whose groups' names belong to other ranks, empties them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _CACHES], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["filled"] > 0
    assert out["same_place_kept"] == [True, out["filled"]]
    assert out["again"] == out["first"] and out["check"] is True
    assert out["renamed"] == [False, 0]
    assert out["moved"] == [False, 0]


_DRY = r"""
import json, os, sys
from torch.distributed.tensor._redistribute import _gen_transform_infos as cache
from unbroken.trainer import rejoin, warmup

os.environ.update(RANK="0", WORLD_SIZE="2")
warmup.__unbroken_warm__()  # the engine's dry run, as rank 0 of a fake dp2 world
filled = cache.cache_info().currsize
os.environ["RANK"] = sys.argv[1]  # the place the real world gives this standby
forgot = rejoin.forget_dry_run_caches()
print(json.dumps({"filled": filled, "forgot": forgot, "left": cache.cache_info().currsize}))
"""


@pytest.mark.parametrize("real_rank", ["0", "1"])
def test_a_standbys_dry_run_caches_are_forgotten_when_its_real_rank_differs(
    real_rank: str,
) -> None:
    """A warm standby dry-runs the engine as the rank it guesses (its RANK then). Promoted to
    another rank, the cached decisions carried the dry run's coordinate: it loaded the other
    rank's FSDP shards. The worker's start now forgets them then, and keeps them otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _DRY, real_rank],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["filled"] > 0
    if real_rank == "0":
        assert out == {"filled": out["filled"], "forgot": False, "left": out["filled"]}
    else:
        assert out["forgot"] is True and out["left"] == 0


#: The worker's flags as `unbroken up` passes them (cli/up.py), in its default layout.
_PP_TP = ("--preset", "tiny", "--dp", "1", "--pp", "2", "--tp", "2", "--steps", "2")

_PP_DRY = r"""
import json, sys
import torch.distributed as dist
from torch.distributed.tensor._redistribute import _gen_transform_infos as cache
from unbroken.trainer import rejoin, warmup

hook = sys.excepthook
warmup.__unbroken_warm__()  # raises here, where the standby ignores it
print(json.dumps({
    "noted": rejoin._dry_place, "filled": cache.cache_info().currsize,
    "world_left": dist.is_initialized(), "hook_kept": sys.excepthook is hook,
}))
"""


def test_a_pipelines_dry_run_completes_and_notes_its_place() -> None:
    """The standby ignores its warm hook's errors, so a dry run that fails does so silently:
    a pp2×tp2 one failed in its step (the fake group's receive is uninitialised memory),
    before it noted its place. It now skips a pipeline's step, notes its place first, and
    leaves no world and no "[rank0]: " prefix on the worker's tracebacks."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    env[WARM_ARGV] = json.dumps(list(_PP_TP))
    done = subprocess.run(
        [sys.executable, "-c", _PP_DRY], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["noted"] == ["0", "4"] and out["filled"] > 0, out
    assert out["world_left"] is False and out["hook_kept"] is True, out


def test_a_standby_promoted_to_rank_2_of_pp2_tp2_trains_in_the_real_world(
    tmp_path: Path,
) -> None:
    """A warm standby dry-runs the engine (agent/warm.py, trainer/warmup.py) as rank 0 of a
    fake pp2×tp2 world, then becomes rank 2 of a real 4-rank gloo world (a spare's standby
    taking a lost node's pp stage 1) beside three cold workers.

    Its dry run failed in its pipeline step, silently (the standby ignores a warm hook's
    error), before it noted its place; the worker's start then kept its caches, and DTensor's
    fast-path cache handed rank 2 rank 0's tp mesh: "Could not resolve the process group
    registered under the name 19" in the first step, and the job restarted from scratch."""
    port = free_port()
    trace = tmp_path / "trace.jsonl"
    target = warmlib.Target(sys.executable, (), "unbroken.trainer.run", "", _PP_TP)

    def env(rank: int) -> dict[str, str]:
        e = plain_worker_env(rank, 4, port)
        e[TRACE] = str(trace)
        return e

    async def go() -> list[tuple[int, str]]:
        standby_env = {k: v for k, v in env(0).items() if k not in ("RANK", "LOCAL_RANK")}
        standby_env[WARM_ARGV] = json.dumps(list(_PP_TP))
        s = await warmlib.spawn_standby(
            target, standby_env, wrapper=[], preload=warmlib.DEFAULT_PRELOAD
        )
        procs: list[asyncio.subprocess.Process] = []
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while not s.ready:
                assert s.alive, "the standby exited before it was ready"
                assert asyncio.get_running_loop().time() < deadline, "standby not ready"
                await asyncio.sleep(0.05)
            for r in (0, 1, 3):
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        target.module,
                        *target.args,
                        env=env(r),
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.STDOUT,
                    )
                )
            procs.insert(2, await s.hand_off(target, env(2)))
            outs = await asyncio.wait_for(
                asyncio.gather(*(p.communicate() for p in procs)), timeout=120
            )
            return [
                (
                    -1 if p.returncode is None else p.returncode,
                    (o + (e or b"")).decode(errors="replace"),
                )
                for p, (o, e) in zip(procs, outs, strict=True)
            ]
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
            if s.proc.returncode is None:
                await s.kill()

    done = asyncio.run(go())
    for rank in (2, 0, 1, 3):  # the standby first: its peers fail because it did
        code, out = done[rank]
        errors = [x for x in out.splitlines() if "Error" in x][-3:]
        assert code == 0, f"rank {rank} exited {code}: {errors}\n{out[-2000:]}"
    marks = [json.loads(x) for x in trace.read_text().splitlines()]
    mine = [m for m in marks if m["rank"] == "2"]
    # the dry run was rank 0's, the real world made it rank 2: its caches were forgotten
    caches = [(m["kept"], m.get("dry_run")) for m in mine if m["phase"] == "caches"]
    assert caches == [(False, ["0", "4"])], mine
    assert any(m["phase"] == "first_step" for m in mine), mine
