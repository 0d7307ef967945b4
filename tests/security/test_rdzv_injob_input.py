"""Hostile values in the in-job rounds of torchrun's backend (agent/rdzvinjob.py).

The driver's store a run's torchrun agents share is writable by any caller holding the node
role token, so a node can write the in-job keys: a generation counter or a store port that
is not a number, or out of range, is ignored with a warning (no crash in torch's monitor
loop, no worker sent to port 0 or 99999), and the counter recovers on the next failure.
The worker side reads only its agent's private directory: a world file it does not own, or
in a directory others may enter, is not read. A real c10d HashStore stands in for the
driver's store (the same Store semantics); no processes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.injobnodes import Store, kept_env, node
from unbroken.agent.rdzvinjob import InJobRounds
from unbroken.common.injobdir import DIR_ENV, GEN_ENV, world_file
from unbroken.trainer import torchrunhold

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _env() -> Iterator[None]:
    with kept_env():
        yield


def _node(store: Store, rank: int) -> InJobRounds:
    return node(store, rank, 0.3)


@pytest.mark.parametrize("value", [b"x", b"-5", b"9" * 40])
def test_a_bad_generation_counter_is_ignored(value: bytes) -> None:
    store = Store()
    store.set("unbroken.injob/gen", value)
    healthy = _node(store, 0)
    assert not healthy.poll() and healthy.pending is None  # no crash, nothing to hold
    failed = _node(store, 1)
    # the next failure takes the counter over: a new generation 1, which nobody completes
    # here (the healthy node does not tick), so it aborts into a normal round
    assert failed.replace_me() is None
    assert store.get("unbroken.injob/gen") == b"1"
    assert store.get("unbroken.injob/1/abort") == b"1"


@pytest.mark.parametrize("port", [b"0", b"99999", b"http://x"])
def test_a_bad_store_port_sends_no_worker_anywhere(port: bytes) -> None:
    store = Store()
    store.set("unbroken.injob/gen", b"1")
    store.set("unbroken.injob/1/master", port)  # written before group rank 0 could
    healthy = _node(store, 1)
    healthy.poll()
    assert not os.path.exists(world_file(healthy.dir, 1))  # no world for its workers
    assert _node(store, 0).replace_me() is None  # no port: the round aborts, none is used


def test_a_world_file_not_ours_or_not_private_is_not_read(tmp_path: Path) -> None:
    d = tmp_path / "injob"
    d.mkdir(mode=0o700)
    os.environ.update({DIR_ENV: str(d), "TORCHELASTIC_RUN_ID": "r", GEN_ENV: "0"})
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"generation": 1, "env": {"MASTER_PORT": "1"}}))
    os.symlink(target, world_file(str(d), 1))  # a link is not the handler's file
    assert torchrunhold.read_world(str(d), 1) is None
    (d / "world-2.json").write_text('{"generation": 2, "env": {"LD_PRELOAD": 5}}')
    assert torchrunhold.read_world(str(d), 2) is None  # values must be strings
    d.chmod(0o770)
    assert torchrunhold.directory() == ""
