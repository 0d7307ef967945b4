"""The rendezvous service's pure core and in-memory store; the client's config and summary.

The etcd `KV` runs the same contract in tests/integration/test_torchrun_rdzv.py.
"""

from __future__ import annotations

import asyncio
import pickle
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from unbroken.agent import rdzv
from unbroken.driver import rendezvous_kv as rkv
from unbroken.driver import rendezvous_state as rz
from unbroken.proto import events_pb2 as ev
from unbroken.proto import rendezvous_pb2 as rpb

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- compare_set / add


def test_compare_set_follows_tcpstore() -> None:
    assert rz.compare_set(None, b"", b"new") == (True, b"new")  # missing + empty: create
    assert rz.compare_set(None, b"x", b"new") == (False, b"x")  # missing: echo expected
    assert rz.compare_set(b"x", b"x", b"y") == (True, b"y")
    assert rz.compare_set(b"z", b"x", b"y") == (False, b"z")


@given(st.lists(st.integers(-1000, 1000), max_size=20))
def test_add_accumulates(deltas: list[int]) -> None:
    cur: bytes | None = None
    total = 0
    for d in deltas:
        total += d
        new = rz.add_to(cur, d, "k")
        assert new == total
        cur = str(new).encode()


def test_add_to_a_non_integer_says_so() -> None:
    with pytest.raises(ValueError, match="'k' holds b'abc', not an integer"):
        rz.add_to(b"abc", 1, "k")


# ---------------------------------------------------------------- callers, keys, config


@pytest.mark.parametrize(
    ("run_id", "node_id", "problem"),
    [
        ("job", "n0", ""),
        ("", "n0", "run_id"),
        ("a/b", "n0", "without '/'"),
        ("x" * 129, "n0", "1-128"),
        ("job", "", "node_id"),
        ("job", "bad\nid", "ASCII letters"),
        ("job", "-rf", "must not start"),
    ],
)
def test_caller_problem(run_id: str, node_id: str, problem: str) -> None:
    got = rz.caller_problem(rpb.Caller(run_id=run_id, node_id=node_id))
    assert (problem in got) if problem else got == ""


def test_keys_live_under_the_job() -> None:
    k = rz.RdzvKeys("job1", "run7")
    assert k.state == b"/unbroken/job1/rdzv/run7/state"
    assert k.kv("torch.rendezvous.run7.0/MASTER_ADDR") == (
        b"/unbroken/job1/rdzv/run7/kv/torch.rendezvous.run7.0/MASTER_ADDR"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_value_bytes", 10), ("max_wait_ms", 0), ("etcd_timeout_s", 0), ("cas_attempts", 0)],
)
def test_config_names_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        rz.RendezvousConfig(**{field: value})  # type: ignore[arg-type]


# ---------------------------------------------------------------- events


def _summary(rnd: int, *, complete: bool = True, closed: bool = False) -> rpb.RoundSummary:
    return rpb.RoundSummary(
        round=rnd, complete=complete, closed=closed, participants=["a_1_0", "b_2_0"]
    )


def test_round_events_follow_membership_and_the_close() -> None:
    def name(d: str) -> str:
        return {"a_1_0": "n0@a_1_0"}.get(d, d)

    assert rz.round_event("r", _summary(0, complete=False), None, name) is None
    first = _summary(0)
    e = rz.round_event("r", first, None, name)
    assert e is not None and e.rendezvous_round.participants == ["n0@a_1_0", "b_2_0"]
    seen = rz.membership(first)
    assert rz.round_event("r", _summary(0), seen, name) is None  # a keep-alive rewrite
    spare = _summary(0)
    spare.spares.append("c_3_0")
    e2 = rz.round_event("r", spare, seen, name)
    assert e2 is not None and list(e2.rendezvous_round.spares) == ["c_3_0"]
    assert rz.round_event("r", _summary(1), rz.membership(spare), name) is not None
    closed = rz.round_event("r", _summary(1, closed=True), rz.membership(_summary(1)), name)
    assert closed is not None and closed.rendezvous_round.closed
    after = rz.membership(_summary(1, closed=True))
    assert rz.round_event("r", _summary(1, closed=True, complete=False), after, name) is None


def test_stale_store_prefixes_cover_finished_rounds_only() -> None:
    assert rz.stale_store_prefixes("r", 0, 0) == []
    assert rz.stale_store_prefixes("r", 0, 2) == ["torch.rendezvous.r.0/", "torch.rendezvous.r.1/"]
    assert rz.stale_store_prefixes("r", 2, 3) == ["torch.rendezvous.r.2/"]
    assert len(rz.stale_store_prefixes("r", 0, 1000, keep=64)) == 64
    assert rkv.prefix_end(b"a/b/") == b"a/b0"


def test_evicted_nodes_of_a_folded_state() -> None:
    s = ev.JobState()
    s.nodes["n0"].state = ev.NODE_STATE_ACTIVE
    s.nodes["n1"].state = ev.NODE_STATE_EVICTED
    got = rz.evicted_nodes(s)
    assert list(got) == ["n1"] and "n1 was evicted" in got["n1"]


# ---------------------------------------------------------------- the in-memory KV


def test_memory_kv_compare_and_set_on_revisions() -> None:
    async def go() -> None:
        kv = rkv.MemoryKV()
        assert await kv.get(b"k") is None
        ok, val, rev = await kv.cas(b"k", b"v1", 0)
        assert ok and val == b"v1" and rev > 0
        assert await kv.cas(b"k", b"v2", 0) == (False, b"v1", rev)  # exists already
        ok2, _, rev2 = await kv.cas(b"k", b"v2", rev)
        assert ok2 and rev2 > rev
        assert await kv.cas(b"k", b"v3", rev) == (False, b"v2", rev2)  # stale token
        assert await kv.cas(b"gone", b"x", 5) == (False, None, 0)
        await kv.put(b"p/a", b"1")
        await kv.put(b"p/b", b"2")
        assert await kv.count(b"p/") == 2
        assert await kv.delete(b"p/a") and not await kv.delete(b"p/a")
        await kv.put(b"p/c", b"3")
        await kv.put(b"q", b"4")
        assert await kv.delete_prefix(b"p/") == 2
        assert await kv.count(b"p/") == 0 and await kv.get(b"q") is not None

    asyncio.run(go())


# ---------------------------------------------------------------- the client


def _params(endpoint: str = "drv:1234", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("unbroken", endpoint, "job-1", 1, 2, **conf)


def test_client_config_from_torchrun_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rdzv.TOKEN_ENV, "t" * 20)
    monkeypatch.setenv(rdzv.NODE_ID_ENV, "node-7")
    cfg = rdzv.config_from_params(_params("localhost:1234", rpc_timeout="3"))
    assert (cfg.endpoint, cfg.run_id, cfg.node_id, cfg.token) == (
        "localhost:1234",
        "job-1",
        "node-7",
        "t" * 20,
    )
    assert cfg.rpc_timeout_s == 3.0
    # a token goes to loopback only (without TLS); elsewhere the job's key seals the state
    monkeypatch.delenv(rdzv.TOKEN_ENV)
    monkeypatch.setenv("UNBROKEN_RDZV_KEY", "k" * 20)
    assert rdzv.config_from_params(_params("drv")).endpoint == "drv:50051"
    assert rdzv.config_from_params(_params(node_id="n9")).node_id == "n9"
    several = rdzv.config_from_params(_params("d1, d2:7"))
    assert several.endpoints == ["d1:50051", "d2:7"]


@pytest.mark.parametrize(
    ("endpoint", "conf", "message"),
    [
        ("", {}, "--rdzv-endpoint is empty"),
        ("drv:notaport", {}, "must be the driver's host:port"),
        ("drv:1", {"rpc_timeout": "soon"}, "rpc_timeout='soon' must be a number"),
        ("drv:1", {"token_file": "/nonexistent/tok"}, "no such file"),
        ("drv:1", {"token": "t" * 20}, "visible to every local user"),
        ("drv:1", {"tls_cert": "/x"}, "must be given together"),
    ],
)
def test_client_config_errors_say_what_to_fix(
    endpoint: str, conf: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rdzv.config_from_params(_params(endpoint, **conf))


def test_summary_of_torch_state_lists_ranks_waiting_and_spares() -> None:
    s = _RendezvousState()
    a, b, c, d = (_NodeDesc(f"h{i}", 100 + i, 0) for i in range(4))
    s.round, s.complete = 3, True
    s.participants = {b: 0, a: 1}
    s.wait_list = {c}
    s.redundancy_list = {d}
    s.last_heartbeats = {a: datetime.now(UTC)}
    got = rdzv.summarize(pickle.dumps(s))
    assert got.round == 3 and got.complete and not got.closed
    assert list(got.participants) == ["h1_101_0", "h0_100_0"]  # rank order
    assert list(got.waiting) == ["h2_102_0"] and list(got.spares) == ["h3_103_0"]


def test_evicted_error_is_a_closed_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    assert issubclass(rdzv.NodeEvictedError, RendezvousClosedError)
