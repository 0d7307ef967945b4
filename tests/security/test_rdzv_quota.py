"""Attack: StoreSets with fresh keys and run ids fill etcd until the event log stops.

Against a real driver with its default quotas: a run takes at most 8 MiB, a job 64 runs
and 32 MiB; each write past a limit is answered RESOURCE_EXHAUSTED naming it and stores
nothing, while other runs keep working.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.security.conftest import TOKEN, bound_md
from unbroken.driver.rendezvous_state import Quota, RendezvousConfig
from unbroken.proto import rendezvous_pb2 as rpb
from unbroken.proto import rendezvous_pb2_grpc as rgrpc

pytestmark = pytest.mark.integration
MD = (("authorization", f"Bearer {TOKEN}"),)
BIG = b"x" * (512 * 1024 - 64)  # just under the per-value limit


def _set(stub: Any, run: str, key: str, value: bytes, who: str = "") -> grpc.StatusCode:
    """StoreSet as the unbound node token, or as node:`who` (a bound token)."""
    try:
        caller = rpb.Caller(run_id=run, node_id=who or "n-evil")
        stub.StoreSet(
            rpb.StoreSetRequest(caller=caller, key=key, value=value),
            metadata=bound_md(who) if who else MD,
            timeout=20,
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        _set.last = e.details()  # type: ignore[attr-defined]
        return e.code()


def _keys(stub: Any, run: str) -> int:
    caller = rpb.Caller(run_id=run, node_id="n-evil")
    return stub.StoreNumKeys(rpb.StoreNumKeysRequest(caller=caller), metadata=MD, timeout=10).count


def _delete_run(stub: Any, run: str, keys: list[str]) -> None:
    for key in keys:
        caller = rpb.Caller(run_id=run, node_id="n")
        stub.StoreDelete(rpb.StoreDeleteRequest(caller=caller, key=key), metadata=MD, timeout=10)


def test_one_principal_cannot_take_the_jobs_runs_or_bytes(driver: dict[str, Any]) -> None:
    """One node's credential begins at most 16 of the job's 64 runs and holds at most
    16 MiB of its 32 MiB; past either it is refused, and another node still writes."""
    with grpc.insecure_channel(
        driver["address"], options=[("grpc.max_send_message_length", 4 << 20)]
    ) as ch:
        stub = rgrpc.RendezvousStub(ch)
        try:
            codes = [_set(stub, f"own-{i}", "k", b"1", who="n-p5") for i in range(17)]
            assert codes[:16] == [grpc.StatusCode.OK] * 16
            assert codes[16] == grpc.StatusCode.RESOURCE_EXHAUSTED, "one node took a 17th run"
            assert "node:n-p5" in _set.last and "max_runs_per_principal=16" in _set.last  # type: ignore[attr-defined]
            assert _keys(stub, "own-16") == 0
            assert _set(stub, "other-0", "k", b"1", who="n-p0") == grpc.StatusCode.OK
            # bytes: 32 values of just under 512 KiB fit in 16 MiB, the 33rd does not
            codes = [_set(stub, f"own-{i // 16}", f"big{i}", BIG, who="n-p5") for i in range(33)]
            assert codes[:32] == [grpc.StatusCode.OK] * 32
            assert codes[32] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_principal_bytes" in _set.last  # type: ignore[attr-defined]
            assert _keys(stub, "own-2") == 1  # its small key only
            assert _set(stub, "other-0", "big", BIG, who="n-p0") == grpc.StatusCode.OK
        finally:
            for i in range(17):
                _delete_run(stub, f"own-{i}", ["k", *(f"big{j}" for j in range(33))])
            _delete_run(stub, "other-0", ["k", "big"])


def test_store_quotas_answer_resource_exhausted(driver: dict[str, Any]) -> None:
    with grpc.insecure_channel(
        driver["address"], options=[("grpc.max_send_message_length", 4 << 20)]
    ) as ch:
        stub = rgrpc.RendezvousStub(ch)
        # bytes per run: the 17th half-MiB value of one run passes 8 MiB
        # (each run written by a node of its own: one principal may hold only 16 MiB)
        codes = [_set(stub, "fill-0", f"k{i}", BIG, who="n-p0") for i in range(17)]
        assert codes[:16] == [grpc.StatusCode.OK] * 16
        assert codes[16] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_run_bytes" in _set.last  # type: ignore[attr-defined]
        assert _keys(stub, "fill-0") == 16  # nothing of the refused write landed
        # bytes per job: three more full runs come near 32 MiB; a fifth run's value is refused
        codes = [
            _set(stub, f"fill-{r}", f"k{i}", BIG, who=f"n-p{r}")
            for r in (1, 2, 3, 4)
            for i in range(16)
        ]
        assert grpc.StatusCode.OK not in codes[codes.index(grpc.StatusCode.RESOURCE_EXHAUSTED) :]
        assert codes.count(grpc.StatusCode.OK) == 48 and _keys(stub, "fill-4") == 0
        assert "max_job_bytes" in _set.last  # type: ignore[attr-defined]
        for r in (1, 2, 3):  # free the bytes again
            for i in range(16):
                caller = rpb.Caller(run_id=f"fill-{r}", node_id="n")
                req = rpb.StoreDeleteRequest(caller=caller, key=f"k{i}")
                stub.StoreDelete(req, metadata=MD, timeout=10)
        # runs per job: small keys in fresh runs; by the 64th run at the latest it is refused
        # (four nodes, 16 runs each at most: one principal alone may begin only 16)
        codes = [_set(stub, f"many-{i}", "k", b"1", who=f"n-p{i % 4 + 1}") for i in range(64)]
        assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_runs=64" in _set.last  # type: ignore[attr-defined]
        assert _keys(stub, "many-63") == 0
        # an existing run keeps working once it frees space
        caller = rpb.Caller(run_id="fill-0", node_id="n")
        stub.StoreDelete(rpb.StoreDeleteRequest(caller=caller, key="k0"), metadata=MD, timeout=10)
        assert _set(stub, "fill-0", "small", b"ok") == grpc.StatusCode.OK


def test_keys_per_run_quota() -> None:
    """The key-count limit, on the same bookkeeping the service uses (4096 RPCs are slow)."""
    cfg = RendezvousConfig(max_keys_per_run=3)
    q = Quota(cfg, b"/unbroken/j/rdzv/")
    for i in range(3):
        q.charge("r", f"/unbroken/j/rdzv/r/kv/{i}".encode(), 1)
    q.charge("r", b"/unbroken/j/rdzv/r/kv/0", 5)  # overwriting a key adds none
    with pytest.raises(Exception, match="max_keys_per_run=3"):
        q.charge("r", b"/unbroken/j/rdzv/r/kv/3", 1)
    q.forget("r", b"/unbroken/j/rdzv/r/kv/", prefix=True)
    q.charge("r", b"/unbroken/j/rdzv/r/kv/3", 1)
