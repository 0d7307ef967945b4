"""Byte tokenizer, corpus loading and the deterministic, resumable, dp-sliced loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.trainer.data import TextLoader, decode, encode, load_corpus

pytestmark = pytest.mark.unit

CORPUS = (b"def f(x):\n    return x * 2\n" * 400)[:9000] + bytes(range(256)) * 4


def test_byte_tokenizer_round_trips_text() -> None:
    text = "héllo wörld → ✓"
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert decode(ids) == text


def test_default_corpus_is_stdlib_and_deterministic() -> None:
    a = load_corpus(None, 64 << 10)
    b = load_corpus(None, 64 << 10)
    assert a == b and len(a) == 64 << 10
    assert b"import" in a or b"def " in a


def test_corpus_from_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"B" * 5000)
    (tmp_path / "a.md").write_bytes(b"A" * 5000)
    (tmp_path / "skip.bin").write_bytes(b"Z" * 5000)
    folder = load_corpus(str(tmp_path), 1 << 20)
    assert folder == b"A" * 5000 + b"B" * 5000
    assert load_corpus(str(tmp_path / "b.txt"), 1 << 20) == b"B" * 5000
    assert load_corpus(str(tmp_path / "b.txt"), 4096) == b"B" * 4096


def test_corpus_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"), 1 << 20)
    (tmp_path / "t.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="at least 4096"):
        load_corpus(str(tmp_path), 1 << 20)


def _loader(**kw: int) -> TextLoader:
    args = {"seq_len": 16, "global_batch": 8, "dp_rank": 0, "dp_size": 1, "seed": 3} | kw
    return TextLoader(CORPUS, **args)


def test_targets_are_inputs_shifted_by_one() -> None:
    x, y = _loader().next_batch()
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_dp_slices_concatenate_to_the_global_batch() -> None:
    ref = _loader()
    full = [ref.next_batch()[0] for _ in range(3)]
    ranks = [_loader(dp_rank=r, dp_size=4) for r in range(4)]
    for step in range(3):
        parts = [ld.next_batch()[0] for ld in ranks]
        assert all(p.shape == (2, 16) for p in parts)
        assert torch.equal(torch.cat(parts), full[step])


def test_state_and_skip_resume_the_same_stream_under_another_dp() -> None:
    ref = _loader()
    batches = [ref.next_batch()[0] for _ in range(6)]
    a = _loader(dp_rank=1, dp_size=2)
    a.next_batch()
    a.skip(2)
    b = _loader()
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.next_batch()[0], batches[3])


def test_epochs_reshuffle_deterministically() -> None:
    ld = _loader(global_batch=1)
    first_epoch = [decode(ld.next_batch()[0][0]) for _ in range(ld.n_windows)]
    second = ld.next_batch()[0]
    in_order = [decode(t) for t in encode(CORPUS)[: ld.n_windows * 17].view(-1, 17)[:, :-1]]
    assert sorted(first_epoch) == sorted(in_order) and first_epoch != in_order
    again = _loader(global_batch=1)
    again.skip(again.n_windows)
    assert torch.equal(again.next_batch()[0], second)


def test_loader_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="dp size"):
        _loader(global_batch=6, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        _loader(dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TextLoader(CORPUS[:100], seq_len=16, global_batch=8)
    with pytest.raises(ValueError, match="n_batches"):
        _loader().skip(-1)
    other = _loader(seed=4)
    with pytest.raises(ValueError, match="same --data"):
        other.load_state_dict(_loader().state_dict())
