"""The torchtitan adapter's rollback skip on a real torchtitan data loader (a torchdata
`StatefulDataLoader`): before the loop's iterator exists and while the loop holds it."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from unbroken.trainer.adapters.torchtitan import advance_loader
from unbroken.trainer.examples.torchtitan_unbroken import RandomTokenLoader

pytestmark = pytest.mark.unit


def loader(rank: int = 0) -> RandomTokenLoader:
    return RandomTokenLoader(
        RandomTokenLoader.Config(),
        dp_world_size=2, dp_rank=rank, tokenizer=None, seq_len=16, local_batch_size=4,
    )  # fmt: skip


def batches(n: int, rank: int = 0) -> list[list[int]]:
    it = iter(loader(rank))
    return [next(it)[1][:, 0].tolist() for _ in range(n)]


def test_skip_before_the_loop_starts_past_the_batches() -> None:
    want = batches(9)
    data = loader()
    it = iter(data)
    for _ in range(2):
        next(it)
    restored = loader()
    restored.load_state_dict(data.state_dict())  # a restore at step 2
    assert advance_loader(restored, 3, started=False)
    it = iter(restored)  # the loop's iterator
    assert [next(it)[1][:, 0].tolist() for _ in range(4)] == want[5:9]


def test_skip_while_the_loop_holds_the_iterator() -> None:
    want = batches(9, rank=1)
    data = loader(rank=1)
    it = iter(data)
    got = [next(it)[1][:, 0].tolist() for _ in range(2)]
    assert advance_loader(data, 4, started=True)
    got += [next(it)[1][:, 0].tolist() for _ in range(3)]
    assert got == want[:2] + want[6:9]
    # and the loader's saved position is past them too
    again = loader(rank=1)
    again.load_state_dict(data.state_dict())
    assert next(iter(again))[1][:, 0].tolist() == batches(10, rank=1)[9]


def test_another_loader_is_left_alone() -> None:
    assert not advance_loader([1, 2, 3], 2, started=False)
