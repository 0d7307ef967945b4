"""Node self-checks through real agents: reported at registration and on demand.

A real `unbroken driver` process (on the session's real etcd, no job: the recovery loop is
off) and two real `unbroken agent` processes: n0 healthy, n1 started with
`--inject-fault wrong_matmul` (a silently corrupt device). Each agent runs
`python -m unbroken.diagnostics.selfcheck` as a child right after registering and sends the
report up its session; the driver appends SelfCheckReported. The operator RPC
RunSelfCheck runs them again on demand. A third agent, n2 (wrong_matmul too), skips the
registration self-check, as the recovery bench's agents do: it still keeps a check process
warm from its first session, so its first on-demand self-check does not import torch.
Assertions are on the log's events, the RPC's replies and the agents' log lines, never on
timings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import grpc
import pytest

from tests.jobs import operator_cluster
from unbroken.cli.cluster import LocalCluster, until
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc

pytestmark = pytest.mark.integration

WAIT_S = 120.0  # torch imports on 2 shared cores: generous, the asserts are on events


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, etcd_server: object
) -> Iterator[LocalCluster]:
    """A driver (no job: the recovery loop is off) and two agents without workers."""
    with operator_cluster(tmp_path_factory.mktemp("selfcheck"), etcd_server, wait_s=WAIT_S) as c:
        c.start_agent("n0")
        c.start_agent("n1", ["--inject-fault", "wrong_matmul"])
        c.start_agent("n2", ["--inject-fault", "wrong_matmul", "--no-selfcheck"])
        yield c


async def _rpc(address: str, fn: Callable[[dgrpc.DriverStub], object]) -> object:
    async with grpc.aio.insecure_channel(address) as ch:
        return await fn(dgrpc.DriverStub(ch))  # type: ignore[misc]


def test_reported_at_registration(cluster: LocalCluster) -> None:
    def both() -> bool:
        return {c.node_id for c in cluster.payloads("self_check_reported")} >= {"n0", "n1"}

    until(both, WAIT_S, "both registration self-checks in the log", cluster.logs)
    got = {
        c.node_id: c for c in cluster.payloads("self_check_reported") if c.trigger == "registration"
    }
    assert got["n0"].ok, got["n0"]
    assert not got["n1"].ok, got["n1"]
    assert any(f.startswith("matmul") for f in got["n1"].failures), got["n1"]
    items = {i["name"]: i for i in json.loads(got["n1"].details_json)}
    assert not items["matmul"]["ok"] and items["disk"]["ok"], items


def test_on_demand_and_unknown_node(cluster: LocalCluster) -> None:
    until(
        lambda: {c.node_id for c in cluster.payloads("self_check_reported")} >= {"n0", "n1"},
        WAIT_S,
        "both agents registered",
        cluster.logs,
    )
    before = len(cluster.payloads("self_check_reported"))
    resp = asyncio.run(
        _rpc(
            cluster.driver_address(),
            lambda s: s.RunSelfCheck(
                dpb.RunSelfCheckRequest(node_ids=["n1", "n0"]), timeout=WAIT_S + 30
            ),
        )
    )
    assert isinstance(resp, dpb.RunSelfCheckResponse)
    by = {r.node_id: r for r in resp.results}
    assert [r.node_id for r in resp.results] == ["n1", "n0"]
    assert by["n0"].ok and not by["n0"].error, by["n0"]
    assert not by["n1"].ok and any("matmul" in f for f in by["n1"].failures), by["n1"]

    def logged() -> bool:
        return (
            sum(c.trigger == "on demand" for c in cluster.payloads("self_check_reported")[before:])
            >= 2
        )

    until(logged, 30, "the on-demand reports in the log", cluster.logs)
    actions = [e.operator_action for e in cluster.events() if e.HasField("operator_action")]
    assert any(a.action == "selfcheck" and a.target == "n1,n0" for a in actions), actions

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(
            _rpc(
                cluster.driver_address(),
                lambda s: s.RunSelfCheck(dpb.RunSelfCheckRequest(node_ids=["nope"]), timeout=30),
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unbroken nodes" in (info.value.details() or "")


def test_an_agent_without_a_registration_self_check_runs_its_first_one_warm(
    cluster: LocalCluster,
) -> None:
    until(lambda: "registered" in cluster.log("n2"), WAIT_S, "n2 registered", cluster.logs)
    assert not any(c.node_id == "n2" for c in cluster.payloads("self_check_reported"))
    resp = asyncio.run(
        _rpc(
            cluster.driver_address(),
            lambda s: s.RunSelfCheck(dpb.RunSelfCheckRequest(node_ids=["n2"]), timeout=WAIT_S + 30),
        )
    )
    assert isinstance(resp, dpb.RunSelfCheckResponse)
    (n2,) = resp.results
    assert not n2.ok and any("matmul" in f for f in n2.failures), n2
    lines = [ln for ln in cluster.log("n2").splitlines() if "self-check" in ln]
    assert lines and "warm=True" in lines[-1], lines


def test_a_spares_registration_self_check_can_wait(cluster: LocalCluster) -> None:
    """`--selfcheck-after-s` (what `unbroken up` gives its spares, so their checks do not
    take the cores from the workers' imports at the job's start): the agent registers at
    once and runs its registration self-check that long after it started, then reports it
    as any other."""
    from datetime import datetime

    cluster.start_agent("n3", ["--selfcheck-after-s", "6"])

    def reported() -> bool:
        return any(c.node_id == "n3" for c in cluster.payloads("self_check_reported"))

    until(reported, WAIT_S, "n3's registration self-check in the log", cluster.logs)
    log = cluster.log("n3")

    def at(what: str) -> datetime:
        line = next(x for x in log.splitlines() if f"] {what} " in x)
        return datetime.fromisoformat(line.split()[0].rstrip("Z"))

    # registered at once, checked no sooner than 6 s after the agent set itself up (which
    # is just before it registers; 3 s leaves a loaded host's slow Register its time)
    assert (at("self-check") - at("registered")).total_seconds() >= 3.0, log[-2000:]
    (rep,) = [c for c in cluster.payloads("self_check_reported") if c.node_id == "n3"]
    assert rep.ok and rep.trigger == "registration", rep
