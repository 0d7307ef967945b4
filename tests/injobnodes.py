"""Two torchrun nodes' in-job rounds (agent/rdzvinjob.py) on a real c10d HashStore, for the
unit tests and the security tests of the rounds: no processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

from unbroken.agent.rdzvinjob import InJobRounds
from unbroken.common.injobdir import DIR_ENV, GEN_ENV


class Store(dist.HashStore):
    """A HashStore with the driver store's non-blocking read."""

    def try_get(self, key: str) -> bytes | None:
        return bytes(self.get(key)) if self.check([key]) else None


@contextlib.contextmanager
def kept_env() -> Iterator[None]:
    """The variables the rounds set for their workers, as they were before."""
    saved = {k: os.environ.get(k) for k in (DIR_ENV, GEN_ENV, "TORCHELASTIC_RUN_ID")}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def node(store: Store, rank: int, timeout_s: float = 5.0) -> InJobRounds:
    """Group rank `rank` of a 2-node round, its rounds ready."""
    rounds = InJobRounds(store, timeout_s)
    info = RendezvousInfo(
        dist.PrefixStore("torch.rendezvous.run.1", store),
        rank,
        2,
        RendezvousStoreInfo("127.0.0.1", 29500),
    )
    rounds.after_round(info)
    return rounds
