"""Attack: a forged torchrun rendezvous state runs code on every node that unpickles it.

The attacker holds the driver's token, so it can call GetState/SetState like any torchrun
agent, and stores a pickle whose `__reduce__` runs `touch MARKER`. torch's own handler
(`--rdzv-backend=unbroken`, built by our entry point exactly as torchrun builds it) then
syncs: it must refuse the state with a RendezvousStateError and never unpickle it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import grpc
import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from tests.security.conftest import TOKEN, marker_payload
from unbroken.agent import rdzv, rdzvauth
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

pytestmark = pytest.mark.integration


def _handler(driver: dict[str, Any], run_id: str, **conf: str) -> Any:
    params = RendezvousParameters(
        "unbroken", driver["address"], run_id, 1, 2, local_addr="127.0.0.1",
        node_id="n-honest", token_file=str(driver["token_file"]), connect_timeout="20", **conf,
    )  # fmt: skip
    return rdzv.create_handler(params)


def _attacker_set(driver: dict[str, Any], run_id: str, state: bytes) -> None:
    """SetState with the stolen token, over plain gRPC (what the attacker did)."""
    with grpc.insecure_channel(driver["address"]) as ch:
        stub = rgrpc.RendezvousStub(ch)
        md = (("authorization", f"Bearer {TOKEN}"),)
        caller = rpb.Caller(run_id=run_id, node_id="n-evil")
        got = stub.GetState(rpb.GetStateRequest(caller=caller), metadata=md, timeout=10)
        resp = stub.SetState(
            rpb.SetStateRequest(caller=caller, state=state, token=got.token if got.found else 0),
            metadata=md,
            timeout=10,
        )
        assert resp.ok  # the driver stores opaque bytes: the refusal is the node's


def _sync_refused(handler: Any, marker: Path, match: str) -> None:
    handler._state_holder._cache_duration = 0  # read the stored state now
    with pytest.raises(RendezvousStateError, match=match):
        handler._state_holder.sync()
    assert not marker.exists(), "the forged state was unpickled: its payload ran"


def test_unsealed_pickle_is_refused_unread(driver: dict[str, Any], tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    handler = _handler(driver, "forge-plain")
    _attacker_set(driver, "forge-plain", marker_payload(marker))
    _sync_refused(handler, marker, "carries no MAC")


def test_state_sealed_with_another_key_is_refused(
    driver: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "rdzv.key"
    key_file.write_text("the-job-key-" + os.urandom(8).hex())
    marker = tmp_path / "pwned"
    handler = _handler(driver, "forge-mac", key_file=str(key_file))
    forged = rdzvauth.seal(b"guessed-key-0123456789", "forge-mac", marker_payload(marker))
    _attacker_set(driver, "forge-mac", forged)
    _sync_refused(handler, marker, "fails its MAC")


def test_payload_with_the_right_key_is_refused_by_the_unpickler(
    driver: dict[str, Any], tmp_path: Path
) -> None:
    """Even an attacker holding the key (here asked of the driver with the stolen token)
    runs nothing: only torch's rendezvous types are admitted."""
    marker = tmp_path / "pwned"
    handler = _handler(driver, "forge-key")
    with grpc.insecure_channel(driver["address"]) as ch:
        key = (
            rgrpc.RendezvousStub(ch)
            .GetKey(
                rpb.GetKeyRequest(caller=rpb.Caller(run_id="forge-key", node_id="n-evil")),
                metadata=(("authorization", f"Bearer {TOKEN}"),),
                timeout=10,
            )
            .key
        )
    assert key == handler._state_holder._backend._key  # what the honest node uses
    _attacker_set(driver, "forge-key", rdzvauth.seal(key, "forge-key", marker_payload(marker)))
    _sync_refused(handler, marker, r"names posix\.system")
    # a state object smuggled inside an allowed one is refused too
    s = _RendezvousState()
    s.participants = {_NodeDesc("h", 1, 0): 0}
    s.round = marker_payload(marker)  # type: ignore[assignment]  # bytes where an int belongs
    _attacker_set(driver, "forge-key", rdzvauth.seal(key, "forge-key", pickle.dumps(s)))
    _sync_refused(handler, marker, "round, complete or closed")


def test_honest_state_round_trips(driver: dict[str, Any]) -> None:
    handler = _handler(driver, "honest")
    holder = handler._state_holder
    holder.state.round = 3
    holder.mark_dirty()
    assert holder.sync() is True
    holder._cache_duration = 0
    holder.sync()
    assert holder.state.round == 3
