"""The launcher gRPC API against a real driver process (on the session's etcd) and real agents.

One driver without a recovery loop (a launcher runs the workers) and two agents without
workers. A launcher registers its job, reports a failed worker and a lost node, lists
checkpoints and asks for one; every call is judged by its gRPC status and by what lands
in the event log, and the driver's Prometheus endpoint must show the same story (phase,
events by kind, per-node series). The helpers here also serve test_cli_checkpoints.py.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.procs import Procs, start_agent, start_driver, wait_nodes
from unbroken.diagnostics.check import free_port
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration


def events(stub: dgrpc.DriverStub, since: int = 0) -> list[ev.Event]:
    """The event log after `since`."""
    req = dpb.WatchEventsRequest(since_seq=since)
    return [r.event for r in stub.WatchEvents(req, timeout=30)]


def scrape(port: int) -> str:
    """The driver's Prometheus exposition text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.fixture(scope="module")
def cluster(etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("launcher")
    procs = Procs(tmp)
    try:
        job = f"launcher-{uuid.uuid4().hex[:8]}"
        # liveness is not under test: 2 shared cores starve heartbeats
        args = ("--etcd", etcd_server.endpoint, "--job-id", job, "--miss-limit", "100")
        addr, stub = start_driver(procs, tmp, *args)
        for node in ("n0", "n1"):
            start_agent(procs, addr, node)
        wait_nodes(stub, ["n0", "n1"], "connected")
        yield {"driver": addr, "metrics_port": procs.metrics_port, "stub": stub, "tmp": tmp}
    finally:
        procs.stop_all()


def code_of(call: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a call that must fail."""
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    e: Any = err.value
    return e.code(), e.details()


def _world(nodes: list[str], **kw: int) -> ev.WorldLayout:
    return ev.WorldLayout(node_ids=nodes, workers_per_node=kw.pop("wpn", 1), **kw)


def test_register_job(cluster: dict[str, Any]) -> None:
    stub = cluster["stub"]
    bad = [
        (dpb.RegisterJobRequest(world=_world([])), "node_ids is empty"),
        (dpb.RegisterJobRequest(world=_world(["n0", "n0"])), "duplicates"),
        (dpb.RegisterJobRequest(world=_world(["n0", "n1"], dp=3)), "dp x pp x tp"),
        (dpb.RegisterJobRequest(world=_world(["n0", "n1"]), min_nodes=3), "min_nodes"),
        (dpb.RegisterJobRequest(world=_world(["n0"]), config_json="{oops"), "not valid JSON"),
    ]
    for req, words in bad:
        code, details = code_of(stub.RegisterJob, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, details
    ok = dpb.RegisterJobRequest(
        trainer="torchrun", world=_world(["n0", "n1"], wpn=2, tp=2), config_json='{"lr": 0.1}'
    )
    resp = stub.RegisterJob(ok, timeout=30)
    assert resp.job_id.startswith("launcher-") and resp.seq > 0
    got = events(stub, resp.seq - 1)
    started = got[0]
    assert started.WhichOneof("payload") == "job_started" and started.cause == "launcher"
    assert started.job_started.trainer == "torchrun"
    w = started.job_started.world
    assert (w.dp, w.pp, w.tp, list(w.node_ids)) == (2, 1, 2, ["n0", "n1"])
    assert (started.job_started.min_nodes, started.job_started.max_nodes) == (1, 2)
    assert got[1].WhichOneof("payload") == "training_resumed"
    st = stub.GetStatus(dpb.GetStatusRequest(), timeout=30)
    assert st.phase == ev.PHASE_RUNNING
    code, details = code_of(stub.RegisterJob, ok)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already active" in details
    text = scrape(cluster["metrics_port"])
    assert 'unbroken_phase{phase="running"} 1.0' in text
    assert 'unbroken_events_total{kind="job_started"} 1.0' in text
    assert 'unbroken_node_alive{node="n0"} 1.0' in text


def test_checkpoints_without_workers(cluster: dict[str, Any]) -> None:
    stub = cluster["stub"]
    listed = stub.ListCheckpoints(dpb.ListCheckpointsRequest(), timeout=30)
    assert list(listed.checkpoints) == []
    assert [n.node_id for n in listed.nodes] == ["n0", "n1"]  # the registered world
    assert all(n.persisted_step == 0 and not n.ranks for n in listed.nodes)
    code, details = code_of(stub.RequestCheckpoint, dpb.RequestCheckpointRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "n0" in details and "n1" in details and "runs no workers" in details
    code, details = code_of(stub.RequestCheckpoint, dpb.RequestCheckpointRequest(timeout_s=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in details


def test_report_failure(cluster: dict[str, Any]) -> None:
    stub = cluster["stub"]
    bad = [
        (dpb.ReportFailureRequest(node_id="n0"), grpc.StatusCode.INVALID_ARGUMENT, "kind"),
        (
            dpb.ReportFailureRequest(kind=dpb.FAILURE_KIND_WORKER),
            grpc.StatusCode.INVALID_ARGUMENT,
            "node_id",
        ),
        (
            dpb.ReportFailureRequest(kind=dpb.FAILURE_KIND_NODE, node_id="nope"),
            grpc.StatusCode.NOT_FOUND,
            "unbroken nodes",
        ),
        (
            dpb.ReportFailureRequest(kind=dpb.FAILURE_KIND_WORKER, node_id="n0", local_rank=99999),
            grpc.StatusCode.INVALID_ARGUMENT,
            "local_rank",
        ),
    ]
    for req, want, words in bad:
        code, details = code_of(stub.ReportFailure, req)
        assert code == want and words in details, (code, details)
    worker = stub.ReportFailure(
        dpb.ReportFailureRequest(
            kind=dpb.FAILURE_KIND_WORKER,
            node_id="n0",
            local_rank=1,
            global_rank=1,
            exit_code=-9,
            last_step=42,
        ),
        timeout=30,
    )
    assert worker.event_kind == "worker_failed"
    node = stub.ReportFailure(
        dpb.ReportFailureRequest(kind=dpb.FAILURE_KIND_NODE, node_id="n1", reason="pod deleted"),
        timeout=30,
    )
    assert node.event_kind == "node_lost" and node.seq > worker.seq
    got = {e.seq: e for e in events(stub, worker.seq - 1)}
    wf, nl = got[worker.seq], got[node.seq]
    assert wf.cause == nl.cause == "launcher"
    assert (wf.worker_failed.node_id, wf.worker_failed.exit_code) == ("n0", -9)
    assert (wf.worker_failed.global_rank, wf.worker_failed.last_step) == (1, 42)
    assert nl.node_lost.node_id == "n1" and nl.node_lost.reason == "launcher: pod deleted"
    assert nl.node_lost.epoch > 0  # the registered agent's epoch: the fold applies it
    nodes = {n.node_id: n for n in stub.ListNodes(dpb.ListNodesRequest(), timeout=30).nodes}
    assert nodes["n1"].state == ev.NODE_STATE_LOST and nodes["n0"].failures == 1
    text = scrape(cluster["metrics_port"])
    assert 'unbroken_events_total{kind="worker_failed"} 1.0' in text
    assert 'unbroken_events_total{kind="node_lost"} 1.0' in text
    # an idempotency key: a retried report is not appended twice
    keyed = dpb.ReportFailureRequest(
        kind=dpb.FAILURE_KIND_WORKER, node_id="n0", exit_code=1, report_id="pod-n0-exit-1"
    )
    first = stub.ReportFailure(keyed, timeout=30)
    again = stub.ReportFailure(keyed, timeout=30)
    assert again.seq == first.seq and again.event_kind == "worker_failed"
    assert sum(e.event_id == "launcher-pod-n0-exit-1" for e in events(stub)) == 1
    keyed.report_id = "not a key"
    code, details = code_of(stub.ReportFailure, keyed)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "report_id" in details


def test_unreachable_driver() -> None:
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as ch:
        stub = dgrpc.DriverStub(ch)
        code, _ = code_of(stub.ListCheckpoints, dpb.ListCheckpointsRequest())
        assert code == grpc.StatusCode.UNAVAILABLE


def test_pure_helpers() -> None:
    from unbroken.driver.launcher_api import job_problem, normalized_world, rank_nodes

    ok = dpb.RegisterJobRequest(world=_world(["a", "b"], wpn=4, pp=2))
    assert job_problem(ok) == ""
    w = normalized_world(ok)
    assert (w.dp, w.pp, w.tp) == (4, 2, 1)
    assert "workers_per_node" in job_problem(dpb.RegisterJobRequest(world=_world(["a"], wpn=0)))
    assert "max_nodes" in job_problem(dpb.RegisterJobRequest(world=_world(["a", "b"]), max_nodes=1))
    # the node that reported the committed step wins over one with a newer, other step
    by_node = {"a": {0: 10, 1: 12}, "b": {1: 10}}
    assert rank_nodes(by_node, 10) == {0: "a", 1: "b"}
    assert rank_nodes(by_node, 12) == {0: "a", 1: "a"}
