"""Deterministic byte-level text data: a corpus, a tokenizer and a resumable sharded loader.

The default corpus is the Python standard library's own `.py` sources (sorted paths), so every
machine can train without a download; `path` takes any file or folder instead. The corpus is
cut into `seq_len + 1`-byte windows, shuffled once per epoch by a seeded permutation, and
served in global batches: sample `i` of the run is the same bytes whatever the dp size, and each
dp rank reads its contiguous slice of every global batch. The loader's whole state is the index
of the next sample, so a run restored from a checkpoint (under any dp size) sees exactly the
data an uninterrupted run would have seen, and `skip(n)` jumps over batches after a loss spike.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Any

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".cfg", ".c", ".h")


def encode(text: str | bytes) -> torch.Tensor:
    """Byte-level tokenizer: UTF-8 bytes as int64 token ids in [0, 256)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    """Inverse of `encode` (invalid UTF-8 is replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return out


#: Corpora read in this process, by (path, max_bytes): a worker that rejoins a new world
#: in its process (in-job recovery), or a warm standby that read the default corpus while
#: it waited (`__unbroken_warm__`), does not walk and read the files again (0.8 s of a
#: 1.7 s trainer set-up on a loaded 2-core host).
_CORPORA: dict[tuple[str | None, int], bytes] = {}
#: The last corpus's token tensor and digest, for the same bytes object.
_ENCODED: list[tuple[bytes, torch.Tensor, str]] = []
DEFAULT_MAX_BYTES = 4 << 20  # the trainer's default `--max-corpus-bytes`


def load_corpus(path: str | None, max_bytes: int) -> bytes:
    """Read up to `max_bytes` of text: a file, a folder (sorted), or the stdlib by default.

    Read once per process for a (path, max_bytes): the files are not read again.

    Raises:
        ValueError: the path does not exist or holds too little text.
    """
    key = (path, max_bytes)
    got = _CORPORA.get(key)
    if got is None:
        got = _CORPORA[key] = _read_corpus(path, max_bytes)
    return got


def __unbroken_warm__() -> None:
    """What a warm standby does after importing this module while it waits for its rank
    (agent/warm.py): read and tokenize the default corpus, which a worker would otherwise
    read at its set-up, on the resume's critical path."""
    corpus = load_corpus(None, DEFAULT_MAX_BYTES)
    _encoded(corpus)


def _encoded(corpus: bytes) -> tuple[torch.Tensor, str]:
    """`corpus`'s token ids and digest, computed once for the same bytes object (the
    tensor is shared: the loader only reads it)."""
    if _ENCODED and _ENCODED[0][0] is corpus:
        return _ENCODED[0][1], _ENCODED[0][2]
    tokens, digest = encode(corpus), hashlib.sha1(corpus).hexdigest()[:16]
    _ENCODED[:] = [(corpus, tokens, digest)]
    return tokens, digest


def _read_corpus(path: str | None, max_bytes: int) -> bytes:
    if path is None:
        files = _files(Path(sysconfig.get_paths()["stdlib"]), (".py",))
        where = "the Python standard library"
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"data path {path!r} does not exist; pass a text file or folder")
        files = [p] if p.is_file() else _files(p, TEXT_SUFFIXES)
        where = repr(path)
    chunks, size = [], 0
    for f in files:
        if size >= max_bytes:
            break
        try:
            chunk = f.read_bytes()[: max_bytes - size]
        except OSError:
            continue
        chunks.append(chunk)
        size += len(chunk)
    corpus = b"".join(chunks)
    if len(corpus) < 4096:
        raise ValueError(
            f"{where} holds only {len(corpus)} bytes of text; training needs at least 4096 "
            f"(folders are searched for {', '.join(TEXT_SUFFIXES)})"
        )
    return corpus


class TextLoader:
    """Global batches of (inputs, targets) windows; this dp rank's slice of each.

    Args:
        corpus: the raw corpus bytes (tokenized here by `encode`).
        seq_len: tokens per sample (each window holds seq_len + 1 bytes).
        global_batch: samples per step across all dp ranks.
        dp_rank: this rank's index in the data-parallel group.
        dp_size: number of data-parallel ranks (must divide global_batch).
        seed: shuffling seed (each epoch is permuted by seed + epoch).
    """

    def __init__(
        self,
        corpus: bytes,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global_batch ({global_batch}) must divide by dp size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.n_windows = (len(corpus) - 1) // (seq_len + 1)
        if self.n_windows < global_batch:
            raise ValueError(
                f"the corpus holds {self.n_windows} windows of {seq_len + 1} bytes, fewer than "
                f"one global batch ({global_batch}); use more text or a smaller batch"
            )
        self.corpus, self.digest = _encoded(corpus)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.sample_index = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _window(self, sample: int) -> torch.Tensor:
        epoch, pos = divmod(sample, self.n_windows)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.n_windows, generator=gen)
            self._perm_epoch = epoch
        start = int(self._perm[pos]) * (self.seq_len + 1)
        return self.corpus[start : start + self.seq_len + 1]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets), each (global_batch / dp_size, seq_len)."""
        local = self.global_batch // self.dp_size
        first = self.sample_index + self.dp_rank * local
        windows = torch.stack([self._window(first + i) for i in range(local)])
        self.sample_index += self.global_batch
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def skip(self, n_batches: int) -> None:
        """Jump over `n_batches` global batches (loss-spike recovery)."""
        if n_batches < 0:
            raise ValueError(f"skip needs n_batches >= 0, got {n_batches}")
        self.sample_index += n_batches * self.global_batch

    def state_dict(self) -> dict[str, Any]:
        """The position: identical on every rank, independent of the dp size."""
        return {"sample_index": self.sample_index, "seed": self.seed, "digest": self.digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position.

        Raises:
            ValueError: the state was saved over a different corpus or seed.
        """
        if state["digest"] != self.digest or int(state["seed"]) != self.seed:
            raise ValueError(
                "the checkpoint's data position belongs to another corpus or seed "
                f"(digest {state['digest']} seed {state['seed']}, this run {self.digest} "
                f"seed {self.seed}); resume with the same --data and data seed"
            )
        self.sample_index = int(state["sample_index"])
