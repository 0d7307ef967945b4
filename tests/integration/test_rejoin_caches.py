"""A rejoin keeps DTensor's caches only where the process keeps its place in the world
(trainer/rejoin.py `apply_rejoin`, `check_kept_caches`): a real 1-rank gloo world in a
child process, left and joined again three ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
