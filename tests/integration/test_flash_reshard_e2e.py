"""Flash restore into a changed world, and one storage reader per replica group, end to end.

Real processes (`trainer.launch.spawn`, gloo) run the tiny gpt3d trainer with the worker's
flash checkpointer (`trainer.flashckpt.FlashCheckpointer`) saving every step into a flash
store on /dev/shm, as they do under an agent.

1. Reshard: dp2 trains 3 steps (and writes a DCP checkpoint of step 3); a dp1 world
   restores the newest step from the two dp2 flash copies through DCP's planner and trains
   on to step 5, flash-saving (its copies overwrite rank 0's slots; rank 1's still hold dp2
   steps); a dp2 world restores step 5 from the one dp1 copy and trains to step 7. The
   reference resumes the same DCP checkpoint of step 3 on dp1 and trains to step 7; every
   step after a reshard must match it within 1e-6.
2. One reader per replica group: dp2 with `dp_mode="replicate"` trains 5 steps and its
   step-3 copies are persisted; the flash memory is then wiped, and a dp2 world restores
   step 3 from storage: rank 0 reads its shard and broadcasts it over the dp group; rank 1
   never opens a storage file (counted), and the losses of steps 4 and 5 equal the first
   run's exactly.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn
from unbroken.trainer.run import train

pytestmark = pytest.mark.integration

TOTAL = 7


def config(steps: int, **parallel: Any) -> TrainConfig:
    return TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(**parallel),
        optim=OptimConfig(warmup_steps=2, decay_steps=TOTAL),
        data=DataConfig(seq_len=32, global_batch=8, max_corpus_bytes=256 << 10),
        steps=steps,
    )


def _worker(
    cfg: TrainConfig,
    env: dict[str, str],
    persist_at: int | None,
    dcp_to: str | None,
    roots: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Restore from flash, train to `cfg.steps` flash-saving every step; report. `roots`:
    each rank's node's flash root (its own memory), else every rank's is the env's."""
    import torch.distributed as dist

    from unbroken.recovery import sources
    from unbroken.recovery.persist import write_shard
    from unbroken.trainer import checkpoint
    from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv
    from unbroken.trainer.gpt3d import GPT3DTrainer

    # Count every storage file this rank opens (whole shards and manifest-only reads).
    reads: list[str] = []
    read_shard, read_manifest = sources.read_shard, sources.read_stored_manifest

    def counting_shard(uri: str, *, verify: bool = True) -> Any:
        reads.append(uri)
        return read_shard(uri, verify=verify)

    def counting_manifest(uri: str) -> Any:
        reads.append(uri)
        return read_manifest(uri)

    sources.read_shard = counting_shard  # type: ignore[assignment]
    sources.read_stored_manifest = counting_manifest  # type: ignore[assignment]
    rank = dist.get_rank()
    if roots:
        env = {**env, "UNBROKEN_FLASH_ROOT": roots[rank], "UNBROKEN_FLASH_NODE": f"n{rank}"}
    flash = FlashCheckpointer(FlashEnv.from_env(env), rank)  # type: ignore[arg-type]
    trainer = GPT3DTrainer()
    try:
        trainer.setup(cfg)
        restored = flash.restore(trainer)
        restore_reads = list(reads)
        flash.guard(trainer)
        losses: dict[int, float] = {}
        while trainer.step < cfg.steps:
            m = trainer.train_step()
            losses[int(m["step"])] = float(m["loss"])
            flash.save(trainer, int(m["step"]))
            if m["step"] == persist_at:
                flash.writer.wait_copied()
                assert flash._last is not None
                flash._last.wait()
                newest = flash.owner.newest(rank)
                assert newest is not None
                write_shard(newest, env["UNBROKEN_PERSIST_URL"])
        if dcp_to is not None:
            flash.writer.wait_copied()
            checkpoint.save(trainer, dcp_to)
        return {"losses": losses, "restored": restored, "storage_reads": restore_reads}
    finally:
        flash.close()
        trainer.close()


def _env(shm: str, storage: Path) -> dict[str, str]:
    return {
        "UNBROKEN_FLASH_ROOT": shm,
        "UNBROKEN_FLASH_JOB": "job",
        "UNBROKEN_FLASH_NODE": "n0",
        "UNBROKEN_PERSIST_URL": str(storage),
    }


def _run(
    cfg: TrainConfig,
    env: dict[str, str],
    *,
    persist_at: int | None = None,
    dcp_to: str | None = None,
    roots: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    fn = functools.partial(_worker, cfg, env, persist_at, dcp_to, roots)
    return spawn(fn, cfg.parallel.world_size, timeout_s=180, env=env)


def _close(got: dict[int, float], ref: dict[int, float]) -> None:
    diff = max(abs(v - ref[s]) for s, v in got.items())
    print(f"max |Δloss| vs the DCP reference over steps {sorted(got)}: {diff:.3g}")
    assert diff <= 1e-6, f"max |Δloss| {diff:.3g}: {got} vs {ref}"


def test_flash_restore_reshards_dp2_to_dp1_and_back(shm: str, tmp_path: Path) -> None:
    env = _env(shm, tmp_path / "storage")
    dcp3 = str(tmp_path / "dcp3")
    first = _run(config(3, dp=2), env, dcp_to=dcp3)
    assert first[0]["restored"] is None and sorted(first[0]["losses"]) == [1, 2, 3]

    dp1 = _run(config(5), env)[0]
    r = dp1["restored"]
    assert r is not None and r.resharded and r.step == 3 and r.source == "memory", r
    assert sorted(dp1["losses"]) == [4, 5]

    dp2 = _run(config(TOTAL, dp=2), env)
    for out in dp2:
        r = out["restored"]
        assert r is not None and r.resharded and r.step == 5 and r.source == "memory", r
    assert sorted(dp2[0]["losses"]) == [6, 7]

    reference = train_from_dcp(config(TOTAL), dcp3)
    _close(dp1["losses"], reference)
    _close(dp2[0]["losses"], reference)


def test_a_rank_on_a_new_node_heals_from_its_live_peer(shm: str, tmp_path: Path) -> None:
    """The replica policy's grow-back onto a spare: dp1 trained on n0 alone, its copies on
    n0 only (no buddy); a dp2 world puts rank 1 on a new node, which reaches nothing. Rank 0
    broadcasts its dp1 copy, both reshard it, and training goes on from step 5, not from
    scratch (nothing was persisted), on the uninterrupted run's losses."""
    env = _env(shm, tmp_path / "storage")
    dcp3 = str(tmp_path / "dcp3")
    first = _run(config(3, dp=2), env, dcp_to=dcp3)
    assert sorted(first[0]["losses"]) == [1, 2, 3]
    dp1 = _run(config(5), env)[0]
    assert dp1["restored"].step == 3 and sorted(dp1["losses"]) == [4, 5]

    spare = tmp_path / "spare-shm"
    spare.mkdir()
    grown = _run(config(TOTAL, dp=2), env, roots=(shm, str(spare)))
    r0, r1 = grown[0]["restored"], grown[1]["restored"]
    assert r0 is not None and r1 is not None, (r0, r1)
    assert r0.step == r1.step == 5 and r0.resharded and r1.resharded, (r0, r1)
    assert r0.source == "memory" and r1.source == "peer", (r0, r1)
    assert sorted(grown[0]["losses"]) == [6, 7]
    _close(grown[0]["losses"], train_from_dcp(config(TOTAL), dcp3))


def train_from_dcp(cfg: TrainConfig, path: str) -> dict[int, float]:
    """The reference: resume the DCP checkpoint on `cfg`'s layout, without flash."""
    hist = spawn(functools.partial(train, cfg, resume_from=path), cfg.parallel.world_size)
    return {int(m["step"]): float(m["loss"]) for m in hist[0]}


def test_storage_restore_reads_once_per_replica_group_and_broadcasts(
    shm: str, tmp_path: Path
) -> None:
    env = _env(shm, tmp_path / "storage")
    cfg = config(5, dp=2, dp_mode="replicate")
    first = _run(cfg, env, persist_at=3)
    assert sorted(first[0]["losses"]) == [1, 2, 3, 4, 5]
    shutil.rmtree(Path(shm) / "job")  # the nodes' memory is gone; storage holds step 3

    again = _run(cfg, env)
    r0, r1 = again[0]["restored"], again[1]["restored"]
    assert r0 is not None and r1 is not None
    assert r0.step == r1.step == 3
    assert r0.read and r0.source == "storage" and r0.broadcast_from is None, r0
    assert not r1.read and r1.broadcast_from == 0 and r1.source == "storage", r1
    assert {Path(u).name for u in again[0]["storage_reads"]} == {"rank-00000.ubf"}
    assert again[1]["storage_reads"] == []
    assert again[0]["losses"] == {s: first[0]["losses"][s] for s in (4, 5)}


@pytest.mark.parametrize(
    "layout",
    [
        # CI runs the pipeline's round trip; make test-all the tensor-parallel one too
        pytest.param({"tp": 2}, id="tp2-tp1-tp2", marks=pytest.mark.slow),
        pytest.param({"pp": 2, "microbatches": 2}, id="pp2-pp1-pp2"),
    ],
)
def test_flash_restore_reshards_tp_and_pp_to_one_process_and_back(
    shm: str, tmp_path: Path, layout: dict[str, Any]
) -> None:
    """A lost node with no spare may force another tp or pp layout, not only another dp."""
    env = _env(shm, tmp_path / "storage")
    dcp3 = str(tmp_path / "dcp3")
    first = _run(config(3, **layout), env, dcp_to=dcp3)
    assert first[0]["restored"] is None and sorted(first[0]["losses"]) == [1, 2, 3]

    one = _run(config(5), env)[0]
    r = one["restored"]
    assert r is not None and r.resharded and r.step == 3 and r.source == "memory", r

    again = _run(config(TOTAL, **layout), env)
    for out in again:
        r = out["restored"]
        assert r is not None and r.resharded and r.step == 5 and r.source == "memory", r
    last = again[0]  # every rank reports the global loss (all-reduced over stages)
    assert sorted(last["losses"]) == [6, 7]

    reference = train_from_dcp(config(TOTAL), dcp3)
    _close(one["losses"], reference)
    _close(last["losses"], reference)


def _restore_and_list(cfg: TrainConfig, env: dict[str, str]) -> dict[str, Any]:
    """The engine's own restore (`trainer.run._restore`), then this rank's ring."""
    import torch.distributed as dist

    from unbroken.recovery.flashcopy import list_copies
    from unbroken.recovery.sources import LAYOUT_META
    from unbroken.trainer.flashckpt import FlashCheckpointer, FlashEnv
    from unbroken.trainer.gpt3d import GPT3DTrainer
    from unbroken.trainer.persistclock import PersistClock
    from unbroken.trainer.run import RestorePoint, _restore

    rank = dist.get_rank()
    flash = FlashCheckpointer(FlashEnv.from_env(env), rank)  # type: ignore[arg-type]
    trainer = GPT3DTrainer()
    try:
        trainer.setup(cfg)
        step, source = _restore(trainer, flash, PersistClock(3600.0), RestorePoint(), None)
        flash.writer.wait_copied()
        assert flash._last is not None
        flash._last.wait()
        ring = [
            (r.manifest.step, r.manifest.meta.get(LAYOUT_META, ""))
            for r in list_copies(flash.owner.rank_dir(rank))
        ]
        return {"step": step, "source": source, "ring": ring}
    finally:
        flash.close()
        trainer.close()


def test_a_resharded_restore_puts_the_restored_step_into_the_new_layouts_ring(
    shm: str, tmp_path: Path
) -> None:
    """The old layout's copies do not stay (the ring is sized anew for the new shards), so
    a rollback soon after a reshard found no step before the spike in any ring and went
    back to the last commit; the engine now saves the restored step in the new layout at
    once, where the driver's rollback sees it."""
    env = _env(shm, tmp_path / "storage")
    _run(config(3, dp=2), env)
    out = spawn(functools.partial(_restore_and_list, config(5), env), 1, timeout_s=180, env=env)[0]
    assert out["step"] == 3 and out["source"] == "memory", out
    newest_step, layout = out["ring"][0]
    assert newest_step == 3 and layout["world"] == 1, out["ring"]
