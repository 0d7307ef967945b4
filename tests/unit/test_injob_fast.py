"""What makes an in-job recovery fast, piece by piece: the corpus read once per process
(and by a warm standby ahead of time), the recovery marks the bench reads its breakdown
from, and the agent's heartbeat at a worker's first step in a new world."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from unbroken.agent import warm
from unbroken.agent.hookserver import HookServer
from unbroken.agent.launch import WorkerSpec
from unbroken.agent.workers import Supervisor, Worker
from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import data, rtrace
from unbroken.trainer.config import DataConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_corpus_is_read_and_tokenized_once_per_process(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 1000)
    a = data.load_corpus(str(text), 8192)
    text.write_text("changed " * 2000)  # not read again: the process keeps its corpus
    assert data.load_corpus(str(text), 8192) is a
    assert data.load_corpus(str(text), 4096) is not a  # another size is another corpus
    one = data.TextLoader(a, seq_len=16, global_batch=4)
    two = data.TextLoader(a, seq_len=16, global_batch=4, dp_rank=1, dp_size=2)
    assert one.corpus is two.corpus and one.digest == two.digest
    assert one.corpus.tolist() == data.encode(a).tolist()


def test_a_standby_reads_the_default_corpus_while_it_waits() -> None:
    assert data.DEFAULT_MAX_BYTES == DataConfig().max_corpus_bytes
    assert "unbroken.trainer.data" in warm.DEFAULT_PRELOAD
    data._CORPORA.pop((None, data.DEFAULT_MAX_BYTES), None)
    getattr(data, warm.WARM_HOOK)()
    corpus = data._CORPORA[(None, data.DEFAULT_MAX_BYTES)]
    assert data.load_corpus(None, data.DEFAULT_MAX_BYTES) is corpus
    assert data._ENCODED[0][0] is corpus


def test_recovery_marks_go_to_the_named_file_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(rtrace.TRACE, raising=False)
    rtrace.mark("start")  # no file named: nothing, no error
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(rtrace.TRACE, str(path))
    monkeypatch.setenv("RANK", "3")
    rtrace.mark("left", step=7)
    rtrace.mark("held")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(m["phase"], m["rank"]) for m in lines] == [("left", "3"), ("held", "3")]
    assert lines[0]["step"] == 7 and lines[0]["t_ns"] <= lines[1]["t_ns"]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_recovery", ROOT / "bench/recovery.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_recovery"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_breakdown_adds_up_to_the_resume_time() -> None:
    b = _bench()
    f = b.Fault("worker_crash", "n0 pid 1", 0, 0.0)  # type: ignore[attr-defined]
    f.detect_s, f.resume_s = 0.3, 1.5
    f.timeline = [(0.3, "worker_failed"), (0.5, "recovery_transition:PHASE_RESTORING")]
    f.marks = [
        (0.05, 10, "left"),  # the survivor left before the detection (a peer's error)
        (0.1, 10, "held"),
        (0.6, 11, "start"),
        (0.7, 10, "pg_init"),
        (0.72, 11, "pg_init"),
        (0.9, 11, "setup"),
        (1.0, 10, "setup"),
        (1.1, 10, "restored"),
        (1.2, 11, "restored"),
        (1.4, 10, "first_step"),
        (1.45, 11, "first_step"),
    ]
    got = b.breakdown(f)  # type: ignore[attr-defined]
    assert list(got) == list(b.BREAKDOWN)  # type: ignore[attr-defined]
    assert got["detect"] == 0.3
    assert got["hold"] == 0.2  # held before the detection: the RESTORING transition ends it
    assert got["new_world"] == pytest.approx(0.22)
    assert got["rebuild"] == pytest.approx(0.28)
    assert got["restore"] == pytest.approx(0.2)
    assert got["first_step"] == pytest.approx(0.25)
    assert got["report"] == pytest.approx(0.05)
    assert sum(got.values()) == pytest.approx(1.5)


def test_a_workers_first_step_in_a_new_world_wakes_the_heartbeat(tmp_path: Path) -> None:
    path = str(tmp_path / "a.sock")
    sup = Supervisor(WorkerSpec(cmd=["true"], nproc=1, log_dir=str(tmp_path)), path)
    sup.workers[0] = Worker(0, 0, tmp_path / "w0.log")
    server = HookServer(path, sup, "n0")
    kicks: list[int] = []
    server.on_beat_now = lambda: kicks.append(1)
    scans: list[int] = []  # every step report scans the flash rings (`NodeFlash.poke`)
    server.on_step = lambda: scans.append(1)

    def step(n: int) -> None:
        rep = hpb.WorkerReport(local_rank=0, step=hpb.StepReport(step=n, step_time_ms=5.0))
        server.datagram_received(rep.SerializeToString(), 999_999)

    step(5)  # the first step of this world
    step(6)
    assert kicks == [1]
    sup.workers[0].step = 0  # rejoined a new world (agent/injob.py resets the step)
    step(6)
    assert kicks == [1, 1]
    assert len(scans) == 3


def _three_losses() -> list[float]:
    import argparse

    import torch.distributed as dist

    from unbroken.trainer.flags import add_arguments, to_config
    from unbroken.trainer.plugin import load_trainer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = to_config(parser.parse_args(["--preset", "tiny", "--device", "cpu"]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = load_trainer("gpt3d")
        trainer.setup(config)
        losses = [float(trainer.train_step()["loss"]) for _ in range(3)]
        trainer.close()
    finally:
        dist.destroy_process_group()
    return losses


def test_a_standbys_dry_run_leaves_no_world_and_no_trace_on_the_losses() -> None:
    import torch.distributed as dist

    from unbroken.trainer import warmup

    assert "unbroken.trainer.warmup" in warm.DEFAULT_PRELOAD
    before = _three_losses()
    getattr(warmup, warm.WARM_HOOK)()
    assert not dist.is_initialized()  # the worker joins its own world afterwards
    assert _three_losses() == before  # bitwise: the worker's set-up seeds everything again


def _state_dict_misses(world: int, dp: int) -> int:
    """DTensor sharding decisions not cached when a fresh trainer of a `dp`-way world (on
    torch's fake process group, whose meshes equal a real world's) takes its first state."""
    import argparse

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.trainer.flags import add_arguments, to_config
    from unbroken.trainer.gpt3d import GPT3DTrainer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = to_config(parser.parse_args(["--preset", "tiny", "--device", "cpu", "--dp", str(dp)]))
    prop = DTensor._op_dispatcher.sharding_propagator
    uncached = prop.propagate_op_sharding_non_cached
    made: list[int] = []

    def counted(schema: Any) -> Any:  # the path that skips the Python cache, counted
        made.append(1)
        return uncached(schema)

    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        trainer = GPT3DTrainer()
        trainer.setup(config)
        before = prop.propagate_op_sharding.cache_info().misses
        prop.propagate_op_sharding_non_cached = counted  # type: ignore[method-assign]
        try:
            trainer.state_dict()  # a restore's first call: the fresh optimizer's zero step
        finally:
            del prop.propagate_op_sharding_non_cached  # the class's method again
        misses = int(prop.propagate_op_sharding.cache_info().misses - before) + len(made)
        trainer.close()
    finally:
        dist.destroy_process_group()
    return misses


def test_a_standbys_dry_run_warms_the_jobs_own_world_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from unbroken.common.workerenv import WARM_ARGV
    from unbroken.trainer import warmup

    # the agent passes the worker's flags; the dry run builds that layout, on the CPU
    monkeypatch.setenv(WARM_ARGV, json.dumps(["--preset", "tiny", "--dp", "2", "--steps", "9"]))
    assert warmup.dry_run_argv()[-2:] == ["--device", "cpu"]
    getattr(warmup, warm.WARM_HOOK)()
    assert not dist.is_initialized()
    # a replacement in a dp2 world finds every sharding decision of its first state_dict
    # made (a 1-rank dry run left 19 of them, 0.4-0.5 s on a loaded 2-core host) ...
    assert _state_dict_misses(2, 2) == 0
    # ... where a world size the dry run did not take still makes them (the count works)
    assert _state_dict_misses(4, 4) > 0


def test_unreadable_warm_flags_fall_back_to_the_tiny_preset() -> None:
    from unbroken.common.workerenv import WARM_ARGV
    from unbroken.trainer import warmup

    for raw in ("", "not json", '{"a": 1}', "[1, 2]"):
        assert warmup.dry_run_argv({WARM_ARGV: raw}) == [*warmup.DEFAULT_ARGV, "--device", "cpu"]
    assert warmup.dry_run_argv({WARM_ARGV: '["--dp", "4"]'}) == ["--dp", "4", "--device", "cpu"]


def test_a_failed_worker_wakes_the_heartbeat_at_once(tmp_path: Path) -> None:
    import asyncio

    async def run() -> list[str]:
        spec = WorkerSpec(
            cmd=[sys.executable, "-c", "import sys; sys.exit(3)"],
            nproc=2,
            log_dir=str(tmp_path),
            warm=False,
        )
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        kicks: list[str] = []
        sup.on_failure = lambda: kicks.append("failed")
        w = await sup.start(0, refill=False)
        await asyncio.wait_for(w.tasks[-1], 60)
        assert w.exit_code == 3 and sup.exited
        sup.launch = dataclasses.replace(sup.launch, cmd=(sys.executable, "-c", "pass"))
        ok = await sup.start(1, refill=False)
        await asyncio.wait_for(ok.tasks[-1], 60)
        assert ok.exit_code == 0
        return kicks

    assert asyncio.run(run()) == ["failed"]  # a clean exit is no failure


def test_a_large_models_dry_run_builds_the_default_model_in_the_jobs_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from unbroken.common.workerenv import WARM_ARGV
    from unbroken.trainer import gpt3d, warmup

    built: list[tuple[int, int]] = []
    setup = gpt3d.GPT3DTrainer.setup

    def recorded(self: Any, config: Any) -> None:  # the real set-up, its model size noted
        built.append((config.model.n_params(), dist.get_world_size()))
        setup(self, config)

    monkeypatch.setattr(gpt3d.GPT3DTrainer, "setup", recorded)
    monkeypatch.setenv(WARM_ARGV, json.dumps(["--preset", "1b", "--dp", "2"]))
    getattr(warmup, warm.WARM_HOOK)()
    assert len(built) == 1 and built[0][1] == 2  # the job's world size ...
    assert built[0][0] <= warmup.MAX_DRY_RUN_PARAMS  # ... and not its 1b model on the CPU
    assert not dist.is_initialized()


def test_the_agent_hands_the_engines_flags_to_its_standbys_dry_run(tmp_path: Path) -> None:
    import asyncio

    from unbroken.common.workerenv import WARM_ARGV

    async def standby_env(cmd: list[str]) -> dict[str, str]:
        spec = WorkerSpec(
            cmd=cmd, nproc=1, log_dir=str(tmp_path), warm=True, warm_preload=("json",)
        )
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        sup.warm_up()
        try:
            for _ in range(600):
                if sup.standbys:
                    return dict(sup.standbys[0].env)
                await asyncio.sleep(0.01)
            raise AssertionError("no standby started")
        finally:
            await sup.close(grace_s=1.0)

    engine = [sys.executable, "-m", "unbroken.trainer.run", "--preset", "tiny", "--dp", "2"]
    env = asyncio.run(standby_env(engine))
    assert json.loads(env[WARM_ARGV]) == ["--preset", "tiny", "--dp", "2"]
    script = asyncio.run(standby_env([sys.executable, str(tmp_path / "train.py"), "--dp", "8"]))
    assert WARM_ARGV not in script  # a script's flags are not the engine's


def test_a_nodes_standbys_dry_run_as_each_of_its_ranks_and_each_rank_takes_its_own(
    tmp_path: Path,
) -> None:
    """A node of 2 workers keeps a standby per local rank's place (each dry run fills the
    caches of its RANK), and a restarted rank is handed the standby that dry-ran as it:
    when every standby took local rank 0's place, local rank 1's replacement always forgot
    them and made every sharding decision again."""
    import asyncio

    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(30)\n")

    async def run() -> tuple[list[str], str, int, int]:
        spec = WorkerSpec(
            cmd=[sys.executable, str(script)], nproc=2, log_dir=str(tmp_path), warm=True,
            warm_preload=("json",),
        )  # fmt: skip
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        sup.warm_up()
        try:
            for _ in range(3000):
                if len(sup.standbys) == 2 and all(s.ready for s in sup.standbys):
                    break
                await asyncio.sleep(0.01)
            places = sorted(s.env["LOCAL_RANK"] for s in sup.standbys)
            ranks1 = [s for s in sup.standbys if s.env["LOCAL_RANK"] == "1"]
            want = ranks1[0].proc.pid if ranks1 else -1
            w = await sup.start(1, refill=False)
            left = sup.standbys[0].env["LOCAL_RANK"] if sup.standbys else ""
            return places, left, w.pid, want
        finally:
            await sup.close(grace_s=1.0)

    places, left, pid, want = asyncio.run(run())
    assert places == ["0", "1"], places
    assert pid == want and left == "0", (pid, want, left)


def test_an_agent_waiting_for_its_workers_starts_its_standbys_after_warm_after_s(
    tmp_path: Path,
) -> None:
    """`--warm-after-s`: a spare's standbys wait (their imports would compete with the job's
    first step on a small host); StartWorkers before then leaves them to the refill that
    waits for the workers' steps; 0 starts them at once."""
    import asyncio
    import time

    with pytest.raises(ValueError, match="warm_after_s"):
        WorkerSpec(cmd=["x"], nproc=1, log_dir=str(tmp_path), warm_after_s=-1)

    async def standbys_after(after_s: float, wait_s: float) -> int:
        spec = WorkerSpec(
            cmd=[sys.executable, str(tmp_path / "train.py")], nproc=1, log_dir=str(tmp_path),
            warm=True, warm_preload=("json",), warm_after_s=after_s,
        )  # fmt: skip
        sup = Supervisor(spec, str(tmp_path / "agent.sock"))
        t0 = time.monotonic()
        sup.warm_up()
        try:
            while not sup.standbys and time.monotonic() - t0 < wait_s:
                await asyncio.sleep(0.01)
            return len(sup.standbys)
        finally:
            await sup.close(grace_s=1.0)

    assert asyncio.run(standbys_after(0.0, wait_s=60)) == 1
    assert asyncio.run(standbys_after(600.0, wait_s=0.5)) == 0


def test_a_loss_that_stands_out_heartbeats_at_once(tmp_path: Path) -> None:
    """The driver's spike detector reads losses from heartbeats: a loss it could call a
    spike (above 1.3x the recent median, or not finite) goes out at once, not with the next
    scheduled beat; a run of high losses kicks once, the curve's normal wobble never."""
    path = str(tmp_path / "a.sock")
    sup = Supervisor(WorkerSpec(cmd=["true"], nproc=1, log_dir=str(tmp_path)), path)
    w = sup.workers[0] = Worker(0, 0, tmp_path / "w0.log")
    server = HookServer(path, sup, "n0")
    kicks: list[int] = []
    server.on_outlier = lambda: kicks.append(w.step)
    firsts: list[int] = []
    server.on_beat_now = lambda: firsts.append(w.step)

    def step(n: int, loss: float, peak: float | None = None) -> None:
        s = hpb.StepReport(step=n, step_time_ms=5.0, loss=loss, has_loss=True)
        if peak is not None:
            s.peak_loss, s.peak_step, s.has_peak = peak, n - 1, True
        server.datagram_received(hpb.WorkerReport(local_rank=0, step=s).SerializeToString(), 1)

    step(1, 4.0)
    assert firsts == [1] and kicks == []  # the first step of the world
    for n in range(2, 30):
        step(n, 4.0 + 0.1 * (n % 3))  # wobble within 5 %
        w.status(time.monotonic())  # a heartbeat: the median as the driver will see it
    assert kicks == []
    step(30, 9.0)  # a spike
    step(31, 9.5)  # still high: the run has been said
    assert kicks == [30]
    step(32, 4.1)
    step(33, 4.0, peak=float("nan"))  # coalesced steps whose worst was NaN
    assert kicks == [30, 33] and firsts == [1]


def test_the_hold_waits_a_few_of_a_workers_steps_not_always_five_seconds(tmp_path: Path) -> None:
    """A rank its guard could not free from its step (a gloo rank blocked in its closing
    all-reduce after its sockets were shut) waited the whole 5 s for its kill in four drills
    of 0.45 s steps; a worker whose steps are short is given a few of them, at least 2 s."""
    from unbroken.agent import injob

    w = Worker(0, 0, tmp_path / "w.log")
    assert injob.hold_limit_s(w) == injob.HOLD_TIMEOUT_S  # no steps seen: the old limit
    w.step_times.extend([450.0] * 5)
    assert injob.hold_limit_s(w) == injob.HOLD_MIN_S  # 4 x 0.45 s, under the floor
    w.step_times.extend([800.0] * 10)
    assert injob.hold_limit_s(w) == pytest.approx(3.2)  # 4 x its median step
    w.step_times.extend([3000.0] * 30)
    assert injob.hold_limit_s(w) == injob.HOLD_TIMEOUT_S  # long steps: never past the limit
    assert injob.hold_limit_s(w, timeout_s=1.0) == 1.0  # a caller's shorter limit wins
