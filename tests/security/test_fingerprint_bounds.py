"""A worker's fingerprint datagram (hooks.proto `Fingerprint`) is a local peer's word: the
agent passes on a bounded amount of it in its heartbeats, whatever the worker sends, and
attributes it to the worker's own rank, never to the rank the worker might name."""

from __future__ import annotations

from pathlib import Path

from unbroken.agent.workers import MAX_FINGERPRINT_KEYS, Worker
from unbroken.proto import hooks_pb2 as hpb


def test_an_oversized_fingerprint_is_cut_and_kept_to_the_workers_rank(tmp_path: Path) -> None:
    w = Worker(0, 0, tmp_path / "w.log")
    w.global_rank = 3
    huge = hpb.Fingerprint(step=7, keys=["k" * 10_000] * 5_000, hashes=list(range(5_000)))
    for _ in range(10_000):
        w.on_fingerprint(huge)
    status = w.status(0.0)
    assert status.fingerprints, "the newest fingerprint is passed on"
    assert len(w.fingerprints) <= (w.fingerprints.maxlen or 0) < 10_000
    for rf in status.fingerprints:
        assert rf.global_rank == 3
        assert len(rf.keys) == len(rf.hashes) == MAX_FINGERPRINT_KEYS
        assert all(len(k) <= 128 for k in rf.keys)
    assert status.ByteSize() < 64 << 10
