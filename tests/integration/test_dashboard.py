"""The driver's web dashboard over HTTP: its pure core, its HTTP edges, a live cluster, a standby.

The cluster is real: the session's etcd, one `unbroken driver --dashboard-port 0 --token ...`
process and two `unbroken agent` processes with two workers each (a small script using the
hooks SDK, no torch: step, loss and step time like a trainer's; global rank 3 steps twice
as slowly, so the heatmap must name it). `/api/state` must show both nodes alive, the four
ranks, loss and step-time curves, the slow rank, and the log's events; the token is
required for the page and the API but not for the static assets. A second driver on the
same job is a standby: its dashboard serves the job state replayed from etcd, marked
standby. The cluster is tests/jobs.py's `DashCluster` (the browser test's too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.jobs import NODE_TOKEN, OPERATOR_TOKEN, SLOW_RANK, TOKEN, DashCluster
from unbroken.cli.cluster import until
from unbroken.driver.dashboard import Dashboard, DashboardConfig
from unbroken.driver.dashview import (
    Series,
    event_json,
    node_display_state,
    node_rows,
    rank_nodes,
    stragglers_json,
)
from unbroken.driver.eventlog import InMemoryEventLog, InMemoryStore
from unbroken.driver.http1 import HttpError, parse_head
from unbroken.driver.liveview import LiveView, LiveViewConfig, NodeSlot
from unbroken.driver.security import RoleTokens
from unbroken.driver.service import DriverService, ServiceConfig
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

TOKENS = RoleTokens({"viewer": [TOKEN], "node": [NODE_TOKEN], "operator": [OPERATOR_TOKEN]})


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET `url`; (status, headers, body), also for error statuses."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def state(base: str) -> dict[str, Any]:
    status, _, body = get(f"{base}/api/state", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    return dict(json.loads(body))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, etcd_server: Any) -> Iterator[DashCluster]:
    with DashCluster(tmp_path_factory.mktemp("dash"), etcd_server) as c:
        c.start_driver()
        c.start_agents()
        yield c


# ---------------------------------------------------------------- the pure core


def _w(rank: int, step: int, ms: float, loss: float = 1.0, since: float = 0.0) -> dpb.WorkerStatus:
    return dpb.WorkerStatus(
        global_rank=rank, step=step, step_time_ms=ms, loss=loss, has_loss=True,
        since_progress_ms=since,
    )  # fmt: skip


def test_series_names_the_slow_rank_and_stays_bounded() -> None:
    s = Series(points=5, columns=4)
    for i in range(10):
        ms = [50.0, 51.0, 49.0, 100.0]
        s.sample([_w(r, 10 + i, ms[r], loss=2.0 - 0.1 * i) for r in range(4)], 1000.0 + i)
    assert len(s.points) == 5 and len(s.columns) == 4
    curves = s.curves()
    assert curves["step"] == [15, 16, 17, 18, 19]
    assert curves["loss"][-1] == pytest.approx(2.0 - 0.9)
    assert curves["step_ms_max"][-1] == 100.0
    hm = s.heatmap(max_ranks=128, slow_ratio=1.5)
    assert hm["ranks"] == [0, 1, 2, 3] and hm["slow"] == [3]
    assert hm["ratio"][3] == pytest.approx(2.0, rel=0.05)
    # only the slowest ranks when there are more than max_ranks
    assert s.heatmap(max_ranks=1, slow_ratio=1.5)["ranks"] == [3]
    # a hung rank (no progress for 800 ms) counts its silence, so it stands out too
    s.sample([_w(r, 30, 50.0, since=800.0 if r == 1 else 10.0) for r in range(4)], 2000.0)
    assert s.columns[-1][2][1] == 800.0
    # a restore to an earlier step rewinds the curves; NaN losses are left out
    s.sample([_w(r, 12, 50.0, loss=float("nan")) for r in range(4)], 2001.0)
    assert s.curves()["step"] == [12] and s.curves()["loss"] == [None]
    json.dumps(s.curves(), allow_nan=False)
    json.dumps(s.heatmap(8, 1.5), allow_nan=False)


def test_the_curves_are_sent_as_deltas_after_the_pages_newest_point() -> None:
    s = Series(points=5, columns=4)
    for i in range(3):
        s.sample([_w(r, 10 + i, 50.0, loss=2.0) for r in range(2)], 1000.0 + i / 3)
    whole = s.curves()
    assert whole["full"] and whole["step"] == [10, 11, 12] and whole["max_points"] == 5
    s.sample([_w(r, 13, 50.0, loss=2.0) for r in range(2)], 1001.5)
    delta = s.curves(after_t=whole["t"][-1])  # the time as the page sent it back
    assert not delta["full"] and delta["step"] == [13] and delta["t"] == [1001.5]
    assert s.curves(after_t=1001.5)["step"] == [] and not s.curves(after_t=1001.5)["full"]
    # a time the rings no longer hold (a restore rewound them, another driver): whole again
    s.sample([_w(r, 11, 50.0, loss=2.0) for r in range(2)], 1002.0)
    again = s.curves(after_t=1001.5)
    assert again["full"] and again["step"] == [10, 11]


def test_the_heatmap_marks_the_nodes_the_straggler_detector_named() -> None:
    world = ev.WorldLayout(node_ids=["n0", "n1"], workers_per_node=2, dp=4)
    assert rank_nodes([0, 1, 2, 3, 9], world) == ["n0", "n0", "n1", "n1", ""]

    def e(seq: int, **payload: Any) -> dict[str, Any]:
        return event_json(ev.Event(seq=seq, **payload))

    def slow(node: str, x: float) -> ev.StragglerSuspected:
        return ev.StragglerSuspected(node_id=node, slowdown=x)

    ring = [
        e(1, job_started=ev.JobStarted(world=world)),
        e(2, straggler_suspected=slow("n1", 1.1)),
        e(3, straggler_suspected=slow("n1", 1.25)),
        e(4, straggler_suspected=slow("n7", 2.0)),  # not in this world
    ]
    assert ring[1]["node"] == "n1" and ring[1]["slowdown"] == 1.1
    assert stragglers_json(ring, world) == {"n1": 1.25}
    # a reshape (the straggler evicted, a spare in) starts over
    ring.append(e(5, world_resized=ev.WorldResized(new_world=world)))
    assert stragglers_json(ring, world) == {}


def test_node_display_states() -> None:
    def rec(state: int) -> ev.NodeRecord:
        return ev.NodeRecord(node_id="n", state=state)  # type: ignore[arg-type]

    alive, silent = NodeSlot("n"), NodeSlot("n")
    alive.alive = True
    active, spare, lost = (rec(s) for s in (1, 2, 3))
    assert node_display_state(active, alive, live=True) == "alive"
    assert node_display_state(active, silent, live=True) == "lost"
    assert node_display_state(spare, alive, live=True) == "spare"
    assert node_display_state(rec(ev.NODE_STATE_EVICTED), alive, live=True) == "evicted"
    assert node_display_state(None, alive, live=True) == "alive"  # registered, not logged yet
    # no live data (a standby, or a new leader the agent has not reached yet): the log says
    assert node_display_state(active, None, live=True) == "active"
    assert node_display_state(active, alive, live=False) == "active"
    assert node_display_state(lost, None, live=False) == "lost"


def test_node_rows_put_problem_nodes_first_when_capped() -> None:
    st = ev.JobState()
    view = LiveView(LiveViewConfig())
    for i in range(10):
        st.nodes[f"n{i}"].state = ev.NODE_STATE_ACTIVE
        view.slot(f"n{i}").alive = i != 7
    rows, counts, total = node_rows(st, view, live=True, now=0.0, max_nodes=3)
    assert [r["id"] for r in rows] == ["n0", "n1", "n7"] and rows[2]["state"] == "lost"
    assert counts == {"alive": 9, "lost": 1} and total == 10


def test_parse_head() -> None:
    r = parse_head(b"GET /api/state?since=5&token=x HTTP/1.1\r\nHost: a\r\nConnection: close")
    assert (r.method, r.path, r.query["since"], r.keep_alive) == ("GET", "/api/state", ["5"], False)
    assert parse_head(b"GET / HTTP/1.1\r\nHost: a").keep_alive
    assert not parse_head(b"GET / HTTP/1.0").keep_alive
    for bad in (b"GET /", b"GET / SPDY/3", b"GET / HTTP/1.1\r\nno colon", b"POST / HTTP/1.1\r\n"
                b"Content-Length: 3"):  # fmt: skip
        with pytest.raises(HttpError):
            parse_head(bad)


# ---------------------------------------------------------------- HTTP edges, in process


async def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        with contextlib.suppress(TimeoutError):
            while chunk := await asyncio.wait_for(reader.read(65536), timeout):
                out += chunk
        return out
    finally:
        writer.close()


def test_http_edges_in_process() -> None:
    """Keep-alive, HEAD, 404, 405, 400, 431, the token, and the connection cap."""

    async def go() -> None:
        svc = DriverService(ServiceConfig(), driver_id="d1", job_id="j")
        store = InMemoryStore()
        elog = InMemoryEventLog(store, "j", store.elect("d1"))
        await elog.append(ev.Event(node_registered=ev.NodeRegistered(node_id="n0", epoch=1)))
        svc.lead(elog, "127.0.0.1:1", await elog.replay())
        dash = Dashboard(DashboardConfig(tokens=TOKENS, max_connections=2, idle_timeout_s=1), svc)
        port = await dash.start()
        try:
            auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
            two = await _raw(
                port,
                b"GET /api/state HTTP/1.1\r\n" + auth + b"\r\n"
                b"HEAD / HTTP/1.1\r\n" + auth + b"Connection: close\r\n\r\n",
            )
            assert two.count(b"HTTP/1.1 200 OK") == 2, two[:300]
            body = json.loads(two.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])
            assert body["role"] == "leader" and body["nodes"][0]["id"] == "n0"
            assert body["nodes"][0]["state"] == "active"  # in the log; never heard from here
            assert two.rstrip().endswith(b"Cache-Control: no-store")  # HEAD: no body
            for head, status in (
                (b"GET /nope HTTP/1.1", b"404"),
                (b"DELETE /api/state HTTP/1.1", b"405"),
                (b"GET / HTTP/1.1\r\nContent-Length: 5", b"400"),
                (b"GET /api/state?since=x HTTP/1.1\r\n" + auth.strip(), b"400"),
                (b"GET /api/state HTTP/1.1", b"401"),
                (b"GET /?token=wrong HTTP/1.1", b"401"),
                # the control tokens are refused: the dashboard takes viewer tokens only
                (f"GET /?token={OPERATOR_TOKEN} HTTP/1.1".encode(), b"401"),
                (f"GET /api/state HTTP/1.1\r\nAuthorization: Bearer {NODE_TOKEN}".encode(), b"401"),
                (b"GET /static/../dashboard.py HTTP/1.1", b"404"),
                (b"GET / HTTP/1.1\r\nX: " + b"a" * 20_000, b"431"),
            ):
                out = await _raw(port, head + b"\r\nConnection: close\r\n\r\n")
                assert out.startswith(b"HTTP/1.1 " + status), (head[:60], out[:200])
            ok = await _raw(
                port, f"GET /?token={TOKEN} HTTP/1.1\r\nConnection: close\r\n\r\n".encode()
            )
            assert ok.startswith(b"HTTP/1.1 200") and b"static/app.js" in ok
            js = await _raw(port, b"GET /static/app.js HTTP/1.0\r\n\r\n")  # open: code, no data
            assert js.startswith(b"HTTP/1.1 200") and b"api/state" in js
            # two idle connections fill the cap: a third closes the oldest idle one and is
            # served (idle sockets cannot lock operators out)
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.2)
            out = await _raw(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 200"), out[:100]
            assert dash.evicted_idle == 1
            assert await asyncio.wait_for(held[0][0].read(), 2) == b""  # the oldest: closed
            for _, w in held:
                w.close()
        finally:
            await dash.close()
            await svc.close()

    asyncio.run(go())


# ---------------------------------------------------------------- a live cluster


def test_live_state_over_http(cluster: DashCluster) -> None:
    base = cluster.dashboard

    def ready() -> dict[str, Any] | None:
        s = state(base)
        alive = [n for n in s["nodes"] if n["state"] == "alive"]
        ok = (
            len(alive) == 2
            and len(s["heatmap"]["ranks"]) == 4
            and len(s["curves"]["step"]) >= 5
            and len(s["heatmap"]["t"]) >= 6
        )
        return s if ok else None

    try:
        s = until(ready, 60, "2 alive nodes, 4 ranks and curves on /api/state", poll_s=0.5)
    except AssertionError:
        print(cluster.log("driver"), cluster.log("node-0"))
        raise
    assert s["role"] == "leader" and s["job_id"] == cluster.job and s["driver_id"] == "driver"
    assert sorted(n["id"] for n in s["nodes"]) == ["node-0", "node-1"]
    assert sorted(r for n in s["nodes"] for r in n["ranks"]) == [0, 1, 2, 3]
    assert all(n["step"] > 0 and n["loss"] is not None for n in s["nodes"])
    assert s["heatmap"]["slow"] == [SLOW_RANK], s["heatmap"]
    assert s["curves"]["step"] == sorted(s["curves"]["step"])
    assert all(x is not None and 0.5 < x < 3.5 for x in s["curves"]["loss"])
    kinds = [e["kind"] for e in s["events"]]
    assert kinds.count("node_registered") == 2 and "leader_elected" in kinds
    seqs = [e["seq"] for e in s["events"]]
    assert seqs == sorted(seqs) and seqs[-1] == s["last_seq"]
    # only the events after `since`
    status, _, body = get(f"{base}/api/state?since={s['last_seq']}&token={TOKEN}")
    assert status == 200 and json.loads(body)["events"] == []
    # and only the curve points after the page's newest one
    newest = s["curves"]["t"][-1]
    status, _, body = get(f"{base}/api/state?curves_after={newest}&token={TOKEN}")
    delta = json.loads(body)["curves"]
    assert status == 200 and not delta["full"] and all(t > newest for t in delta["t"]), delta
    assert get(f"{base}/api/state?curves_after=nan&token={TOKEN}")[0] == 400
    # the token guards the page and the API, not the static code
    assert get(f"{base}/api/state")[0] == 401
    assert get(f"{base}/")[0] == 401
    status, headers, page = get(f"{base}/?token={TOKEN}")
    assert status == 200 and b'<canvas id="heatmap"' in page
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for asset in ("app.js", "style.css"):
        assert get(f"{base}/static/{asset}")[0] == 200


def test_standby_dashboard_replays_the_log(cluster: DashCluster, etcd_server: Any) -> None:
    """A standby's dashboard (no live view, a read-only log on etcd): the replayed job."""
    from unbroken.driver.etcdlog import EtcdEventLog, connect

    until(lambda: len(state(cluster.dashboard)["nodes"]) == 2, 60, "two nodes on the leader")

    async def go() -> dict[str, Any]:
        client = await connect(etcd_server.config)
        svc = DriverService(
            ServiceConfig(), driver_id="standby", job_id=cluster.job, leader_address=cluster.address
        )
        dash = Dashboard(DashboardConfig(tokens=TOKENS), svc)
        dash.reader = EtcdEventLog(client, cluster.job, None)
        port = await dash.start()
        try:
            return await asyncio.to_thread(state, f"http://127.0.0.1:{port}")
        finally:
            await dash.close()
            await svc.close()
            await client.close()

    s = asyncio.run(go())
    assert s["role"] == "standby" and s["leader_address"] == cluster.address
    assert {n["id"]: n["state"] for n in s["nodes"]} == {"node-0": "active", "node-1": "active"}
    assert [e["kind"] for e in s["events"]].count("node_registered") == 2
    assert s["heatmap"]["ranks"] == [] and s["curves"]["step"] == [] and not s["error"]


@pytest.mark.slow
def test_standby_driver_process_serves_the_page(cluster: DashCluster) -> None:
    """The same through `unbroken driver` (main.py hands the standby its read-only log)."""
    until(lambda: len(state(cluster.dashboard)["nodes"]) == 2, 60, "two nodes on the leader")
    standby = cluster.start_driver("standby")

    def replayed() -> dict[str, Any] | None:
        s = state(standby)
        return s if s["role"] == "standby" and len(s["nodes"]) == 2 else None

    s = until(replayed, 30, "the standby's replayed state", poll_s=0.3)
    assert {n["state"] for n in s["nodes"]} == {"active"}  # the log knows them, no heartbeats
    assert s["leader_address"] in ("", cluster.address)
    assert [e["kind"] for e in s["events"]].count("node_registered") == 2
    assert s["heatmap"]["ranks"] == [] and s["curves"]["step"] == []
    assert get(f"{standby}/healthz")[2] == b"ok standby\n"
