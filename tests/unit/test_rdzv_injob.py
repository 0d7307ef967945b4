"""The in-job rounds of torchrun's `unbroken` backend (agent/rdzvinjob.py), on a real c10d store.

Two nodes' `InJobRounds` share one `HashStore` (what the driver's store is to the torchrun
agents): the failed node's `replace_me` waits in a thread while the healthy node's monitor
ticks (`poll`) pick the port, write the world file, see the worker's held marker and mark
the node. The timeouts fall back: an unmarked node aborts the generation, a worker that
does not hold makes its agent restart it. The end-to-end run is
tests/integration/test_torchrun_rdzv.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousInfo

from tests.injobnodes import Store, kept_env
from tests.injobnodes import node as _node
from unbroken.agent import rdzv
from unbroken.agent.rdzvinjob import InJobRounds
from unbroken.common.injobdir import DIR_ENV, GEN_ENV, held_file, world_file
from unbroken.trainer import torchrunhold

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _env() -> Iterator[None]:
    with kept_env():
        yield


def _hold(node: InJobRounds, gen: int, local_rank: int = 0, local_world: int = 1) -> None:
    """What a held worker writes (trainer/torchrunhold.py)."""
    with open(held_file(node.dir, gen, local_rank), "w") as f:
        json.dump({"pid": os.getpid(), "local_world_size": str(local_world)}, f)


def _replace_in_thread(node: InJobRounds) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(node.replace_me()))
    t.start()
    return t, out


def test_the_failed_node_waits_for_the_healthy_one_to_hold() -> None:
    store = Store()
    healthy, failed = _node(store, 0), _node(store, 1)
    t, out = _replace_in_thread(failed)
    deadline = time.monotonic() + 5
    while not os.path.exists(world_file(healthy.dir, 1)):
        assert not healthy.poll()
        assert time.monotonic() < deadline, "no world file"
        time.sleep(0.01)
    env = json.loads(open(world_file(healthy.dir, 1)).read())["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    time.sleep(0.2)
    assert t.is_alive()  # not until the healthy node's worker holds
    _hold(healthy, 1)
    assert not healthy.poll()
    t.join(5)
    info = out[0]
    assert isinstance(info, RendezvousInfo)
    assert (info.rank, info.world_size) == (1, 2)
    assert info.bootstrap_store_info.master_port == int(env["MASTER_PORT"])
    assert healthy.active and failed.active  # the workers' world serves its own store
    assert store.get("unbroken.injob/1/node/0") == b"held"
    assert store.get("unbroken.injob/1/node/1") == b"replaced"
    assert not healthy.poll()  # nothing new: the agent keeps its workers


def test_an_unmarked_node_aborts_the_generation() -> None:
    store = Store()
    healthy, failed = _node(store, 0, timeout_s=0.5), _node(store, 1, timeout_s=0.5)
    assert failed.replace_me() is None  # the healthy node never ticked: a normal round
    assert store.try_get("unbroken.injob/1/abort") == b"1"
    assert not healthy.poll() and healthy.pending is None and healthy.seen == 1
    # the next failure opens a new generation
    t, out = _replace_in_thread(failed)
    deadline = time.monotonic() + 5
    while not t.join(0.01) and t.is_alive():
        healthy.poll()
        if healthy.pending is not None:
            _hold(healthy, healthy.pending[0])
        assert time.monotonic() < deadline
    assert out[0] is not None and failed.seen == 2


def test_workers_that_do_not_hold_are_restarted_into_the_generation() -> None:
    store = Store()
    healthy, failed = _node(store, 0, timeout_s=0.3), _node(store, 1, timeout_s=5)
    t, out = _replace_in_thread(failed)
    deadline = time.monotonic() + 5
    while not healthy.poll():  # True: the agent restarts its workers
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert healthy.replace_me() is not None  # the agent's next_rendezvous: joins as replaced
    t.join(5)
    assert out[0] is not None
    assert store.get("unbroken.injob/1/node/0") == b"replaced"


def test_a_held_worker_reads_the_newest_world(tmp_path: Any) -> None:
    d = tmp_path / "injob"
    d.mkdir(mode=0o700)
    os.environ.update({DIR_ENV: str(d), "TORCHELASTIC_RUN_ID": "r", GEN_ENV: "1"})
    assert torchrunhold.directory() == str(d)
    for gen, port in ((1, "1"), (3, "3"), (2, "2")):
        with open(world_file(str(d), gen), "w") as f:
            json.dump({"generation": gen, "env": {"MASTER_PORT": port}}, f)
    assert torchrunhold.newer_world(str(d)) == 3
    assert torchrunhold.read_world(str(d), 3) == {"MASTER_PORT": "3"}
    (d / "world-4.json").write_text('{"generation": 5, "env": {}}')  # not its own
    assert torchrunhold.read_world(str(d), 4) is None
    d.chmod(0o755)  # others could read it; no longer private
    assert torchrunhold.directory() == ""


def test_conf_switches() -> None:
    assert not rdzv._flag(None) and not rdzv._flag("0") and rdzv._flag("true")
    with pytest.raises(ValueError, match="in_job"):
        rdzv._flag("maybe")
    with pytest.raises(ValueError, match="in_job_timeout"):
        InJobRounds(Store(), 0)


def test_a_lost_node_sends_everyone_to_torchs_next_round() -> None:
    """A whole node gone (its agent left torch's state): no generation can complete."""
    store, alive = Store(), [2]
    healthy = _node(store, 0)
    healthy.participants = lambda: alive[0]
    assert not healthy.poll()
    alive[0] = 1
    healthy._counted = (0.0, 0)  # count again now, not in 0.5 s
    assert healthy.poll()  # its agent restarts its workers ...
    t0 = time.monotonic()
    assert healthy.replace_me() is None  # ... into a normal round, without waiting it out
    assert time.monotonic() - t0 < 2.0
    assert store.try_get("unbroken.injob/1/abort") == b"1"
