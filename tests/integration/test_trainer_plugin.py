"""A second trainer (plain DDP) plugs in through a real entry point, without touching the core.

The test writes a tiny installed distribution (module + `*.dist-info/entry_points.txt`
registering `ddp_bigram` in `unbroken.trainers`) into a temporary folder on sys.path; the
spawned workers inherit that path. The unchanged runner (`unbroken.trainer.run.train`)
discovers it by name, trains it on 2 processes, saves through DCP, and a resumed run on fresh
processes continues on exactly the curve of an uninterrupted run.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from unbroken.trainer.config import DataConfig, OptimConfig, ParallelConfig, TrainConfig, preset
from unbroken.trainer.launch import spawn
from unbroken.trainer.plugin import available, load_trainer
from unbroken.trainer.run import train

pytestmark = pytest.mark.integration

PLUGIN = textwrap.dedent(
    '''
    """A plain DDP bigram model over bytes: the smallest complete Trainer plugin."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from unbroken.trainer.data import TextLoader, load_corpus


    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 32)
            self.out = torch.nn.Linear(32, 256)

        def forward(self, x):
            return self.out(torch.tanh(self.emb(x)))


    class DDPTrainer:
        def setup(self, config):
            if config.parallel.pp != 1 or config.parallel.tp != 1:
                raise ValueError("ddp_bigram supports data parallelism only (pp = tp = 1)")
            torch.manual_seed(config.seed)
            self.model = DistributedDataParallel(Bigram())
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.optim.lr)
            d = config.data
            self.loader = TextLoader(
                load_corpus(d.path, d.max_corpus_bytes), seq_len=d.seq_len,
                global_batch=d.global_batch, dp_rank=dist.get_rank(),
                dp_size=dist.get_world_size(), seed=d.seed,
            )
            self.step = 0

        def train_step(self):
            t0 = time.perf_counter()
            x, y = self.loader.next_batch()
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            loss.backward()
            self.opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            self.step += 1
            dt = time.perf_counter() - t0
            return {"step": self.step, "loss": float(mean) / dist.get_world_size(),
                    "grad_norm": None, "lr": self.opt.param_groups[0]["lr"],
                    "tokens_per_s": x.numel() * dist.get_world_size() / dt,
                    "step_time_s": dt, "flops_per_s": None, "mfu": None,
                    "pipeline_idle_fraction": None}

        def state_dict(self):
            model, optim = get_state_dict(self.model, self.opt)
            return {"model": model, "optimizer": optim, "step": self.step,
                    "data": self.loader.state_dict()}

        def load_state_dict(self, sd):
            set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                           optim_state_dict=sd["optimizer"])
            self.step = int(sd["step"])
            self.loader.load_state_dict(sd["data"])

        def close(self):
            self.model = None
    '''
)


@pytest.fixture(scope="module")
def plugin_on_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Install `ddp_bigram` as a real distribution in a folder on sys.path."""
    root = tmp_path_factory.mktemp("site")
    (root / "ddp_bigram_plugin.py").write_text(PLUGIN)
    info = root / "ddp_bigram_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddp-bigram-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[unbroken.trainers]\nddp_bigram = ddp_bigram_plugin:DDPTrainer\n"
        "not_a_trainer = ddp_bigram_plugin:Bigram\n"
    )
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("ddp_bigram_plugin", None)


def config(steps: int) -> TrainConfig:
    return TrainConfig(
        model=preset("tiny"),
        parallel=ParallelConfig(dp=2),
        optim=OptimConfig(lr=1e-2),
        data=DataConfig(seq_len=32, global_batch=8, max_corpus_bytes=256 << 10),
        steps=steps,
    )


def test_plugin_is_discovered_next_to_gpt3d(plugin_on_path: Path) -> None:
    assert {"gpt3d", "ddp_bigram"} <= set(available())
    assert type(load_trainer("ddp_bigram")).__name__ == "DDPTrainer"
    with pytest.raises(ValueError, match=r"no trainer plugin named 'nope'.*ddp_bigram"):
        load_trainer("nope")
    with pytest.raises(ValueError, match="does not implement the Trainer protocol"):
        load_trainer("not_a_trainer")


def test_plugin_trains_and_round_trips_through_dcp(plugin_on_path: Path, tmp_path: Path) -> None:
    def losses(steps: int, **kw: str) -> list[float]:
        fn = functools.partial(train, replace(config(steps), trainer="ddp_bigram"), **kw)
        return [m["loss"] for m in spawn(fn, 2, timeout_s=240)[0]]

    ref = losses(6)
    ckpt = str(tmp_path / "ckpt")
    resumed = losses(3, save_to=ckpt) + losses(6, resume_from=ckpt)
    assert ref[-1] < ref[0]
    assert max(abs(a - b) for a, b in zip(ref, resumed, strict=True)) < 1e-6, (ref, resumed)
