"""The agreements that keep a world through a rollback (trainer/keepworld.py), over a real
TCPStore with each rank's vote on a thread of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from unbroken.proto import hooks_pb2 as hpb
from unbroken.trainer import keepworld

pytestmark = pytest.mark.unit


@pytest.fixture
def store() -> Iterator[Any]:
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    yield s


def _votes(store: Any, key: str, votes: list[bool | None], deadline_s: float) -> list[Any]:
    """Each rank's answer (None: that rank never votes), the ranks voting at once."""
    out: list[Any] = [None] * len(votes)

    def one(i: int, vote: bool) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        out[i] = keepworld.agree(client, key, len(votes), vote, deadline_s)

    threads = [
        threading.Thread(target=one, args=(i, v)) for i, v in enumerate(votes) if v is not None
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_voting_yes_keeps_the_world(store: Any) -> None:
    t0 = time.monotonic()
    assert _votes(store, "k/1", [True, True, True, True], 5.0) == [True] * 4
    assert time.monotonic() - t0 < 4.0  # decided when the last vote came, not at a deadline


def test_one_no_vote_makes_every_rank_leave_at_once(store: Any) -> None:
    t0 = time.monotonic()
    assert _votes(store, "k/2", [True, False, True], 5.0) == [False] * 3
    assert time.monotonic() - t0 < 4.0  # the no was written: nobody waited its deadline


def test_a_rank_that_never_votes_makes_the_others_leave_after_the_deadline(store: Any) -> None:
    t0 = time.monotonic()
    assert _votes(store, "k/3", [True, None, True], 0.3) == [False, None, False]
    assert time.monotonic() - t0 >= 0.3
    # ...and when it votes later (its collective failed, say), it reads the same decision
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    assert keepworld.agree(client, "k/3", 3, True, 0.3) is False


def test_a_dead_store_is_a_no() -> None:
    class Dead:
        def add(self, *a: Any) -> int:
            raise RuntimeError("Connection reset by peer")

        def compare_set(self, *a: Any) -> bytes:
            raise RuntimeError("Connection reset by peer")

    assert keepworld.agree(Dead(), "k", 2, True) is False


def test_same_place_compares_the_rank_and_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    new_port = hpb.Rejoin(env={"MASTER_PORT": "29555", "UNBROKEN_RESTORE_STEP": "40"})
    assert keepworld.same_place(new_port)
    assert keepworld.same_place(hpb.Rejoin(env={"RANK": "1", "WORLD_SIZE": "2"}))
    assert not keepworld.same_place(hpb.Rejoin(env={"RANK": "0"}))
    assert not keepworld.same_place(hpb.Rejoin(env={"WORLD_SIZE": "3"}))
    assert not keepworld.same_place(hpb.Rejoin(unset=["RANK"]))  # back to rank 0


def test_every_rank_waits_over_the_store_for_the_others_restores(store: Any) -> None:
    out: list[Any] = [None] * 3
    times: list[float] = [0.0] * 3

    def one(i: int, delay: float) -> None:
        time.sleep(delay)
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        out[i] = keepworld.all_restored(client, 3, wait_s=5.0)
        times[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i, 0.3 * i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [True, True, True]
    assert max(times) - min(times) < 0.2  # the first two waited for the last one


def test_a_peer_that_never_restores_costs_at_most_the_wait(store: Any) -> None:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    t0 = time.monotonic()
    assert keepworld.all_restored(client, 2, wait_s=0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_a_dead_store_does_not_stop_the_first_step() -> None:
    class Dead:
        def add(self, *a: Any) -> int:
            raise RuntimeError("Connection reset by peer")

    assert keepworld.all_restored(Dead(), 2) is False
