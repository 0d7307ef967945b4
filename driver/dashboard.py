"""The driver's live web dashboard: one page and one JSON endpoint, served in the driver's loop.

An operator wants to see the whole job at a glance without a CLI: which nodes are alive,
lost, evicted or spare, what the event log recorded, how loss and step time move, which
rank is slow (a per-rank step-time heatmap, as MegaScale built), and which checkpoints are
committed. This module serves that as a static page (driver/web/: plain HTML, JS and CSS,
no build step, no CDN) plus `GET /api/state`, which the page polls about every 0.5 s.

Why plain `asyncio.start_server` and not a web framework: the driver needs GET only, a
handful of routes, and must not gain a heavy dependency. HTTP/1.1 with keep-alive,
bounded request heads, a connection cap and idle deadlines is about a hundred lines.

Cost on the heartbeat path: none. Heartbeats are stored by reference in the live view
(driver/liveview.py); a sampler task reads the latest one of every alive node every
`sample_ms` and appends to bounded rings (loss and step-time points, heatmap columns).
Everything else is computed when a request comes: the folded job state is read from the
event log incrementally (only events newer than the last read, at most once per
`refresh_ms` however many browsers poll), and every list in a response is capped.

Roles: the leader serves its live view and its log. A standby serves the page too, marked
"standby": its job state is replayed read-only from etcd (nodes, events, checkpoints), but
it has no heartbeats (agents talk to the leader only), so it shows no live curves and
names the leader's gRPC address. Auth: when the driver runs with role tokens, the page and
the API require a *viewer* token (`--token-file viewer=PATH`; `Authorization: Bearer
<token>` or `?token=<token>`), never the control tokens of operators or nodes; the static
assets (code, no data) and `/healthz` are open. The dashboard binds loopback by default.

Connections are capped; at the cap, the connection idle longest (waiting for a request) is
closed to make room, so idle sockets cannot lock operators out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import json
import math
import ssl
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

import structlog
from google.protobuf import text_format

from unbroken.driver import goodput as goodputlib
from unbroken.driver import loghealth
from unbroken.driver import state as statelib
from unbroken.driver.eventlog import EventLog, EventLogError
from unbroken.driver.journal import Journal
from unbroken.driver.liveview import LiveView, NodeSlot
from unbroken.driver.security import RoleTokens
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.service import DriverService

log = structlog.get_logger(__name__)

WEB_DIR = Path(__file__).with_name("web")
STATIC_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
MAX_HEAD = 16 * 1024  # bytes of request line + headers
MAX_REQUESTS_PER_CONN = 10_000
READ_CHUNK = 1000  # events folded per refresh at most (the next refresh takes the rest)
DETAIL_CHARS = 240
SAMPLE_DUTY = 50  # the sampler sleeps at least this many times as long as a sample took
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),  # the token may be in the URL
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:"),
    ("Cache-Control", "no-store"),
)
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@dataclass(kw_only=True, slots=True)
class DashboardConfig:
    """Where the dashboard listens and how much history it keeps (every size is a cap)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    # The driver's role tokens: the dashboard accepts the viewer role's only (read-only; an
    # operator's or a node's token is refused here). None: open (a driver without tokens).
    tokens: RoleTokens | None = None
    # HTTPS with this certificate and key (the driver's, when it runs with mTLS); None: HTTP
    tls_cert: str | None = None
    tls_key: str | None = None
    sample_ms: int = 500  # how often the live view is sampled into the rings
    points: int = 600  # loss / step-time points kept
    columns: int = 60  # heatmap columns kept (one per sample)
    max_ranks: int = 128  # heatmap rows sent (the slowest ranks when there are more)
    max_nodes: int = 200  # node rows sent (lost and evicted first when there are more)
    events: int = 200  # timeline events kept and sent
    refresh_ms: int = 500  # at most one event-log read per this interval
    read_timeout_s: float = 5.0  # deadline of one event-log read
    max_connections: int = 64
    idle_timeout_s: float = 15.0  # a connection silent this long is closed
    slow_ratio: float = 1.5  # a rank whose median ratio to its peers exceeds this is slow

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"dashboard port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("dashboard host must not be empty")
        for name in ("sample_ms", "refresh_ms"):
            if not 50 <= getattr(self, name) <= 60_000:
                raise ValueError(f"{name} must be in [50, 60000], got {getattr(self, name)}")
        for name in ("points", "columns", "max_ranks", "max_nodes", "events", "max_connections"):
            if not 1 <= getattr(self, name) <= 100_000:
                raise ValueError(f"{name} must be in [1, 100000], got {getattr(self, name)}")
        if not self.read_timeout_s > 0 or not self.idle_timeout_s > 0:
            raise ValueError("read_timeout_s and idle_timeout_s must be > 0")
        if not self.slow_ratio > 1.0:
            raise ValueError(f"slow_ratio must be > 1, got {self.slow_ratio}")


# ---------------------------------------------------------------- pure core


def _num(x: float, digits: int = 4) -> float | None:
    """A JSON-safe number: NaN and infinities become null (JSON has no NaN)."""
    return round(x, digits) if math.isfinite(x) else None


class Series:
    """Bounded rings of what the heartbeats said over time (fed by the sampler).

    `points`: one per advance of the job's step: (unix time, step, mean loss of the ranks
    that report one, median and max step time). `columns`: one per sample: unix time, the
    median step time over every rank, and rank -> step-time ms for the `keep_ranks` slowest
    ranks of that moment (every rank in a world that small), where a rank that stopped
    progressing counts its time since its last step (so a hung rank turns as red as a slow
    one). Memory is bounded by points + columns x keep_ranks whatever the world size.
    """

    def __init__(self, points: int, columns: int, keep_ranks: int = 128) -> None:
        self.keep_ranks = keep_ranks
        self.points: collections.deque[tuple[float, int, float | None, float, float]] = (
            collections.deque(maxlen=points)
        )
        self.columns: collections.deque[tuple[float, float, dict[int, float]]] = collections.deque(
            maxlen=columns
        )
        self.step = 0  # the highest step of the last sample

    def sample(self, workers: Iterable[dpb.WorkerStatus], t_unix: float) -> None:
        """Add one sample of the workers of every alive node."""
        col: dict[int, float] = {}
        step = 0
        losses: list[float] = []
        times: list[float] = []
        isfinite = math.isfinite
        for w in workers:
            ws = w.step
            if ws <= 0 or w.global_rank < 0:
                continue
            if ws > step:
                step = ws
            ms = w.step_time_ms
            if ms > 0 and isfinite(ms):
                times.append(ms)
                col[w.global_rank] = max(ms, w.since_progress_ms)
            if w.has_loss and isfinite(w.loss):
                losses.append(w.loss)
        self.step = step
        if col:
            med = statistics.median(col.values())
            if len(col) > self.keep_ranks:
                col = dict(heapq.nlargest(self.keep_ranks, col.items(), key=lambda kv: kv[1]))
            self.columns.append((t_unix, med, col))
        if not step:
            return
        while self.points and self.points[-1][1] > step:  # restored to an earlier step
            self.points.pop()
        if self.points and self.points[-1][1] == step:
            return
        loss = statistics.fmean(losses) if losses else None
        med_t = statistics.median(times) if times else math.nan
        self.points.append((t_unix, step, loss, med_t, max(times, default=math.nan)))

    def curves(self, after_t: float | None = None) -> dict[str, Any]:
        """The loss and step-time curves as parallel arrays: every point (`full`), or only
        those after the point at time `after_t` (as sent: rounded to ms) when the rings
        still hold it. A page that sends its newest point's time gets the new points only;
        after a restore rewound the curves, or from another driver, it gets them whole."""
        points = list(self.points)
        full = True
        if after_t is not None:
            for i in range(len(points) - 1, -1, -1):
                if round(points[i][0], 3) == after_t:
                    points, full = points[i + 1 :], False
                    break
        return {
            "full": full,
            "max_points": self.points.maxlen,
            "t": [round(p[0], 3) for p in points],
            "step": [p[1] for p in points],
            "loss": [None if p[2] is None else _num(p[2], 6) for p in points],
            "step_ms": [_num(p[3], 2) for p in points],
            "step_ms_max": [_num(p[4], 2) for p in points],
        }

    def heatmap(self, max_ranks: int, slow_ratio: float) -> dict[str, Any]:
        """Ranks x time of step time, with each rank's median ratio to its column's median.

        Returns:
            `ranks` (sorted; the `max_ranks` slowest when there are more), `t` per column,
            `ms` as rows (rank) of columns (null: no report), `median` per column, `ratio`
            per rank, and `slow`: the ranks whose ratio exceeds `slow_ratio`.
        """
        ratios: dict[int, list[float]] = collections.defaultdict(list)
        for _, med, col in self.columns:
            if len(col) < 2 or not med > 0:
                continue
            for r, v in col.items():
                ratios[r].append(v / med)
        all_ranks = {r for _, _, col in self.columns for r in col}
        ratio = {r: statistics.median(ratios[r]) if ratios[r] else 1.0 for r in all_ranks}
        ranks = sorted(all_ranks)
        if len(ranks) > max_ranks:
            ranks = sorted(sorted(ranks, key=lambda r: -ratio[r])[:max_ranks])
        return {
            "ranks": ranks,
            "t": [round(t, 3) for t, _, _ in self.columns],
            "median": [_num(med, 1) for _, med, _ in self.columns],
            "ms": [
                [_num(col[r], 1) if r in col else None for _, _, col in self.columns] for r in ranks
            ],
            "ratio": [_num(ratio[r], 3) for r in ranks],
            "slow": [r for r in ranks if ratio[r] > slow_ratio],
        }


_STATE_ORDER = {"lost": 0, "evicted": 1, "active": 2, "spare": 3, "alive": 4}


def node_display_state(rec: ev.NodeRecord | None, slot: NodeSlot | None, *, live: bool) -> str:
    """What the page shows for a node: alive, lost, evicted, spare, or active (no live data).

    Args:
        rec: the node's record in the folded state (None: only the live view knows it).
        slot: its live-view slot (None: this driver has not heard from it).
        live: whether this driver has a live view (the leader); a standby knows only the log.
    """
    state = rec.state if rec is not None else ev.NODE_STATE_UNSPECIFIED
    if state == ev.NODE_STATE_EVICTED:
        return "evicted"
    if live and slot is not None:
        if not slot.alive:
            return "lost"
        return "spare" if state == ev.NODE_STATE_SPARE else "alive"
    return {ev.NODE_STATE_LOST: "lost", ev.NODE_STATE_SPARE: "spare"}.get(state, "active")


def node_json(
    node_id: str, rec: ev.NodeRecord | None, slot: NodeSlot | None, shown: str, now: float
) -> dict[str, Any]:
    """One node row of the page."""
    workers = [w for w in slot.hb.workers if w.step > 0] if slot is not None else []
    times = [w.step_time_ms for w in workers if w.step_time_ms > 0]
    losses = [w.loss for w in workers if w.has_loss]
    info = slot.info if slot is not None else None
    return {
        "id": node_id,
        "state": shown,
        "hostname": rec.hostname if rec is not None else info.hostname if info else "",
        "ip": rec.ip if rec is not None else info.ip if info else "",
        "epoch": slot.epoch if slot is not None and slot.epoch else rec.epoch if rec else 0,
        "workers": rec.num_workers if rec is not None else info.num_workers if info else 0,
        "ranks": sorted(w.global_rank for w in workers if w.global_rank >= 0),
        "step": max((w.step for w in workers), default=0),
        "loss": _num(losses[-1], 6) if losses else None,
        "step_ms": _num(statistics.median(times), 2) if times else None,
        "silent_ms": (
            _num((now - slot.last_seen) * 1000.0, 1)
            if slot is not None and slot.last_seen
            else None
        ),
        "failures": rec.failures if rec is not None else 0,
        "connected": slot is not None and slot.outbox is not None,
    }


def node_rows(
    state: ev.JobState, view: LiveView, *, live: bool, now: float, max_nodes: int
) -> tuple[list[dict[str, Any]], dict[str, int], int]:
    """The node rows (by id; lost and evicted nodes first when over `max_nodes`), the count
    of nodes per shown state, and the number of nodes."""
    slots = view.nodes if live else {}
    ids = set(state.nodes) | set(slots)
    shown = {i: node_display_state(state.nodes.get(i), slots.get(i), live=live) for i in ids}
    picked = sorted(ids)
    if len(picked) > max_nodes:
        picked = sorted(sorted(ids, key=lambda i: (_STATE_ORDER[shown[i]], i))[:max_nodes])
    rows = [node_json(i, state.nodes.get(i), slots.get(i), shown[i], now) for i in picked]
    return rows, dict(collections.Counter(shown.values())), len(ids)


def event_json(e: ev.Event) -> dict[str, Any]:
    """One timeline entry: seq, wall time, kind and a one-line, truncated detail."""
    kind = e.WhichOneof("payload") or "?"
    detail = text_format.MessageToString(getattr(e, kind), as_one_line=True) if kind != "?" else ""
    out: dict[str, Any] = {
        "seq": e.seq,
        "t": e.wall_time_unix_ns // 1_000_000,
        "kind": kind,
        "detail": detail[:DETAIL_CHARS],
        "cause": e.cause[:64],
    }
    if kind == "straggler_suspected":  # the heatmap marks the node's ranks
        out["node"] = e.straggler_suspected.node_id
        out["slowdown"] = _num(e.straggler_suspected.slowdown, 3)
    return out


def stragglers_json(events: Iterable[dict[str, Any]], world: ev.WorldLayout) -> dict[str, float]:
    """Nodes of the current world the straggler detector named since the world last changed,
    with their slowdown (the newest), from the page's event ring."""
    in_world = set(world.node_ids)
    out: dict[str, float] = {}
    for e in events:
        if e["kind"] in ("job_started", "world_resized"):
            out.clear()  # a new world: earlier suspicions were acted on or are stale
        elif e["kind"] == "straggler_suspected" and e.get("node") in in_world:
            out[e["node"]] = e["slowdown"]
    return out


def rank_nodes(ranks: Iterable[int], world: ev.WorldLayout) -> list[str]:
    """The node of each global rank in `world` ("" when the world does not place it)."""
    wpn, nodes = world.workers_per_node, list(world.node_ids)
    return [nodes[r // wpn] if wpn and 0 <= r // wpn < len(nodes) else "" for r in ranks]


def world_json(w: ev.WorldLayout) -> dict[str, Any]:
    """The parallel layout and the node order of a world."""
    return {
        "dp": w.dp,
        "pp": w.pp,
        "tp": w.tp,
        "nodes": list(w.node_ids),
        "workers_per_node": w.workers_per_node,
    }


def state_json(
    state: ev.JobState | None,
    view: LiveView,
    *,
    live: bool,
    now: float,
    max_nodes: int,
) -> dict[str, Any]:
    """The job's overview, nodes and checkpoints from its folded state and the live view."""
    st = state if state is not None else statelib.initial("")
    nodes, counts, total = node_rows(st, view, live=live, now=now, max_nodes=max_nodes)
    return {
        "phase": ev.Phase.Name(st.phase).removeprefix("PHASE_").lower(),
        "step": st.step,
        "last_seq": st.last_seq,
        "leader": st.leader,
        "leader_term": st.leader_term,
        "incident": {
            "id": st.incident_id,
            "cause": st.incident_cause,
            "suspects": list(st.suspects),
            "bad_nodes": list(st.bad_nodes),
            "failed_restores": st.failed_restores,
        },
        "finished_reason": st.finished_reason,
        "world": world_json(st.world),
        "trainer": st.trainer,
        "counts": counts,
        "nodes_total": total,
        "nodes": nodes,
        "checkpoints": [
            {"step": c.step, "bytes": c.bytes, "uri": c.uri, "seq": c.seq, "verified": c.verified}
            for c in reversed(st.checkpoints)
        ],
        "verified_steps": list(st.verified_steps),  # docs/sdc.md
        "sdc_suspected": st.sdc_suspected,
        "event_counts": dict(st.event_counts),
        "goodput": _goodput_json(st, view),
    }


def _goodput_json(st: ev.JobState, view: LiveView) -> dict[str, Any]:
    gp = goodputlib.goodput_now(st, view)
    return {
        "ratio": round(gp.ratio, 4),
        "wall_s": round(gp.wall_s, 1),
        "lost_s": {k: round(v, 1) for k, v in gp.lost_s_by_cause.items()},
        "badput_s": {
            k: round(gp.lost_s_by_category[k], 1)
            for k in goodputlib.CATEGORIES
            if k in gp.lost_s_by_category
        },
    }


# ---------------------------------------------------------------- HTTP


class HttpError(Exception):
    """A request the server answers with an error status (and then closes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Request:
    """One parsed request head (the dashboard reads no bodies)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Parse an HTTP/1.x request head (request line and headers, CRLF-terminated).

    Raises:
        HttpError: malformed, not HTTP/1.x, or carrying a body.
    """
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as e:  # pragma: no cover - latin-1 decodes any byte
        raise HttpError(400, "request head is not latin-1") from e
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"bad request line {lines[0][:80]!r}; expected 'GET /path HTTP/1.1'")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"bad header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
        raise HttpError(400, "request bodies are not accepted (the dashboard is read-only)")
    url = urlsplit(target)
    conn = headers.get("connection", "").lower()
    keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return Request(
        method=method,
        path=unquote(url.path),
        query=parse_qs(url.query),
        headers=headers,
        keep_alive=keep,
    )


def response_bytes(
    status: int,
    body: bytes,
    content_type: str,
    *,
    keep_alive: bool,
    head_only: bool = False,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A complete HTTP/1.1 response."""
    lines = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        *(f"{k}: {v}" for k, v in SECURITY_HEADERS),
        *(f"{k}: {v}" for k, v in extra),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


class Dashboard:
    """The dashboard of one driver process: sampler, state reader and HTTP server.

    Args:
        config: where to listen and the caps.
        service: the driver's `DriverService` (its live view, log, role and stats).
    """

    def __init__(self, config: DashboardConfig, service: DriverService) -> None:
        self.config = config
        self.service = service
        # read-only event log for a standby (set by the driver once etcd is connected)
        self.reader: EventLog | None = None
        self.series = Series(config.points, config.columns, config.max_ranks)
        self.port = 0
        self.requests = 0
        self.evicted_idle = 0  # idle connections closed to make room at the cap
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=config.events)
        self._state: ev.JobState | None = None
        self._source: EventLog | None = None
        self._journal: Journal | None = None  # the term whose events the ring follows
        self._read_at = -math.inf
        self._read_lock = asyncio.Lock()
        self._error = ""
        self._conns = 0
        self._server: asyncio.Server | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        # connections waiting for a request head -> since when (the first to close at the cap)
        self._idle: dict[asyncio.StreamWriter, float] = {}
        self._static = {name: (WEB_DIR / name).read_bytes() for name in STATIC_TYPES}
        self._index = (WEB_DIR / "index.html").read_bytes()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Listen and start the sampler; return the bound port."""
        try:
            ctx = None
            if self.config.tls_cert and self.config.tls_key:
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(self.config.tls_cert, self.config.tls_key)
            self._server = await asyncio.start_server(
                self._serve_conn,
                self.config.host,
                self.config.port,
                limit=MAX_HEAD,
                ssl=ctx,
                ssl_handshake_timeout=self.config.idle_timeout_s if ctx else None,
            )
        except OSError as e:
            raise OSError(
                f"the dashboard cannot listen on {self.config.host}:{self.config.port} ({e}); "
                "choose another --dashboard-port (0 picks a free one)"
            ) from e
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._sampler = asyncio.create_task(self._sample_loop())
        scheme = "https" if self.config.tls_cert else "http"
        log.info("dashboard listening", url=f"{scheme}://{self.config.host}:{self.port}/")
        return self.port

    async def close(self) -> None:
        """Stop listening, close open connections and the sampler."""
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    # ------------------------------------------------------------ sampler
    async def _sample_loop(self) -> None:
        period = self.config.sample_ms / 1000.0
        wait = period
        while True:
            await asyncio.sleep(wait)
            t0 = time.thread_time()  # CPU time: a loaded machine must not stretch the period
            try:
                self.sample()
            except Exception:
                log.exception("dashboard sample failed; continuing")
            # a huge world samples less often: the sampler keeps to ~2 % of the event loop
            wait = max(period, (time.thread_time() - t0) * SAMPLE_DUTY)

    def sample(self) -> None:
        """Append the current heartbeats of every alive node to the rings."""
        nodes = self.service.view.nodes.values()
        self.series.sample((w for s in nodes if s.alive for w in s.hb.workers), time.time())

    # ------------------------------------------------------------ state
    def _log(self) -> EventLog | None:
        elog: EventLog | None = self.service.log
        return elog if elog is not None else self.reader

    async def refresh(self) -> None:
        """Bring the folded state and the event ring up to date.

        On the leader the state is the journal's (memory) and the ring follows the journal;
        the log is read once per term for the ring's history. A standby folds the log
        read-only (rate-limited, one reader).
        """
        journal = self.service.journal
        if journal is not None and journal is self._journal and self._state is not None:
            self._state = journal.state
            return
        elog = self._log()
        if elog is None:
            self._error = "this driver has no event log yet (still connecting to etcd)"
            return
        period = self.config.refresh_ms / 1000.0
        if elog is self._source and time.monotonic() - self._read_at < period:
            return
        async with self._read_lock:
            if elog is self._source and time.monotonic() - self._read_at < period:
                return
            try:
                await asyncio.wait_for(self._read(elog), self.config.read_timeout_s)
                self._error = ""
                if journal is not None and journal is self.service.journal:
                    have = self._follow(journal)
                    if journal.state.last_seq > have:  # recorded while the read was awaited
                        missed = await asyncio.wait_for(
                            elog.read(have + 1, journal.state.last_seq),
                            self.config.read_timeout_s,
                        )
                        self._backfill(missed)
            except (TimeoutError, EventLogError) as e:
                self._error = (
                    f"the event log did not answer within {self.config.read_timeout_s:g} s "
                    f"({type(e).__name__}); is etcd reachable from the driver?"
                )
                log.warning("dashboard could not read the event log", error=repr(e))
            self._read_at = time.monotonic()

    def _backfill(self, events: Iterable[ev.Event]) -> None:
        """Put events the ring missed in their place (by seq; none twice)."""
        by_seq = {e["seq"]: e for e in self._events}
        for e in events:
            by_seq.setdefault(e.seq, event_json(e))
        self._events.clear()
        self._events.extend(by_seq[k] for k in sorted(by_seq))

    def _follow(self, journal: Journal) -> int:
        """Follow `journal`'s events into the ring from the state just read; the last seq
        the ring holds from that read (the journal may have recorded more since)."""
        self._journal = journal
        have = self._state.last_seq if self._state is not None else 0

        def on_event(e: ev.Event) -> None:
            if e.seq > have and self._journal is journal:
                self._events.append(event_json(e))

        journal.subscribers.append(on_event)
        self._state = journal.state
        return have

    async def _read(self, elog: EventLog) -> None:
        if elog is not self._source or self._state is None:
            state = await elog.replay()
            tail = []
            if state.last_seq:
                tail = await elog.read(max(1, state.last_seq - self.config.events + 1))
            self._state, self._source = state, elog
            self._events.clear()
            self._events.extend(event_json(e) for e in tail if e.seq <= state.last_seq)
            return
        last = await elog.last_seq()
        have = self._state.last_seq
        if last <= have:
            return
        new = await elog.read(have + 1, min(last, have + READ_CHUNK))
        self._state = statelib.fold(new, self._state)
        self._events.extend(event_json(e) for e in new)

    async def snapshot(self, since: int = 0, curves_after: float | None = None) -> dict[str, Any]:
        """Everything the page shows, as one JSON-ready dict: the events after `since` and
        the curve points after `curves_after` only (deltas); the node rows (at most
        `max_nodes`) and the heatmap (bounded, its ratios over every column) whole."""
        await self.refresh()
        svc = self.service
        live = svc.leader
        body = state_json(
            self._state,
            svc.view,
            live=live,
            now=time.monotonic(),
            max_nodes=self.config.max_nodes,
        )
        stats = svc.stats()
        body.update(
            {
                "driver_id": svc.driver_id,
                "job_id": svc.job_id,
                "role": "leader" if live else "standby",
                "leader_address": svc.leader_address,
                "diagnosis_running": svc.diagnosis_running,
                "now": int(time.time() * 1000),
                "error": self._error,
                "event_log": loghealth.summary(svc.journal),
                "events": [e for e in self._events if e["seq"] > since],
                "curves": self.series.curves(curves_after),
                "heatmap": self._heatmap(),
                "live_step": self.series.step if live else 0,
                "sample_ms": self.config.sample_ms,
                "stats": {
                    "heartbeats": stats.heartbeats,
                    "delivery_p99_ms": round(stats.delivery_p99_ms, 2),
                    "events_appended": stats.events_appended,
                },
            }
        )
        return body

    def _heatmap(self) -> dict[str, Any]:
        """The series' heatmap, its rows' nodes, and the nodes suspected of straggling."""
        hm = self.series.heatmap(self.config.max_ranks, self.config.slow_ratio)
        world = self._state.world if self._state is not None else ev.WorldLayout()
        hm["nodes"] = rank_nodes(hm["ranks"], world)
        hm["stragglers"] = stragglers_json(self._events, world)
        return hm

    # ------------------------------------------------------------ HTTP
    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        full = self._conns >= self.config.max_connections
        if full and self._idle:
            oldest = min(self._idle, key=self._idle.__getitem__)
            self._idle.pop(oldest)
            oldest.close()  # its task ends (and frees its place) on its next read
            self.evicted_idle += 1
        elif full:
            with contextlib.suppress(ConnectionError):
                writer.write(
                    response_bytes(
                        503, b"too many dashboard connections\n", "text/plain", keep_alive=False
                    )
                )
                await asyncio.wait_for(writer.drain(), 2.0)
            writer.close()
            return
        self._conns += 1
        self._writers.add(writer)
        try:
            for _ in range(MAX_REQUESTS_PER_CONN):
                self._idle[writer] = time.monotonic()
                try:
                    head = await asyncio.wait_for(
                        reader.readuntil(b"\r\n\r\n"), self.config.idle_timeout_s
                    )
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection (or we closed it at the cap)
                except asyncio.LimitOverrunError:
                    raise HttpError(431, f"request head larger than {MAX_HEAD} bytes") from None
                finally:
                    self._idle.pop(writer, None)
                req = parse_head(head[:-4])
                status, ctype, body, extra = await self._route(req)
                writer.write(
                    response_bytes(
                        status,
                        body,
                        ctype,
                        keep_alive=req.keep_alive,
                        head_only=req.method == "HEAD",
                        extra=extra,
                    )
                )
                await asyncio.wait_for(writer.drain(), self.config.idle_timeout_s)
                if not req.keep_alive:
                    return
        except HttpError as e:
            with contextlib.suppress(ConnectionError, TimeoutError):
                writer.write(
                    response_bytes(
                        e.status, f"{e}\n".encode(), "text/plain; charset=utf-8", keep_alive=False
                    )
                )
                await asyncio.wait_for(writer.drain(), 2.0)
        except (TimeoutError, ConnectionError):
            pass  # idle or gone: just close
        except Exception:
            log.exception("dashboard request failed")
        finally:
            self._conns -= 1
            self._writers.discard(writer)
            self._idle.pop(writer, None)
            writer.close()

    def _authorized(self, req: Request) -> bool:
        tokens = self.config.tokens
        if not tokens:
            return True
        given = ""
        auth = req.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        elif req.query.get("token"):
            given = req.query["token"][0]
        who = tokens.principal(given.encode()) if given else None
        return who is not None and who.role == "viewer"

    async def _route(self, req: Request) -> tuple[int, str, bytes, tuple[tuple[str, str], ...]]:
        self.requests += 1
        if req.method not in ("GET", "HEAD"):
            raise HttpError(405, f"method {req.method[:16]} not allowed: the dashboard is GET only")
        path = req.path
        if path == "/healthz":
            role = "leader" if self.service.leader else "standby"
            return 200, "text/plain; charset=utf-8", f"ok {role}\n".encode(), ()
        if path.startswith("/static/"):
            name = path[len("/static/") :]
            if name not in self._static:
                return 404, "text/plain; charset=utf-8", b"no such file\n", ()
            return 200, STATIC_TYPES[name], self._static[name], ()
        if path not in ("/", "/index.html", "/api/state"):
            return (
                404,
                "text/plain; charset=utf-8",
                f"no page {path[:100]!r}; the page is / and its data /api/state\n".encode(),
                (),
            )
        if not self._authorized(req):
            msg = (
                "this dashboard requires a viewer token (read-only; the driver's "
                "--token-file viewer=PATH): open /?token=<token> or send "
                "'Authorization: Bearer <token>'\n"
            )
            return 401, "text/plain; charset=utf-8", msg.encode(), (("WWW-Authenticate", "Bearer"),)
        if path == "/api/state":
            try:
                since = int(req.query.get("since", ["0"])[0])
            except ValueError:
                raise HttpError(400, "since must be an integer event sequence number") from None
            after: float | None = None
            if "curves_after" in req.query:
                try:
                    after = float(req.query["curves_after"][0])
                except ValueError:
                    after = math.nan
                if not math.isfinite(after):
                    raise HttpError(400, "curves_after must be a point's time (a number)")
            snap = await self.snapshot(since, after)
            body = json.dumps(snap, separators=(",", ":"), allow_nan=False)
            return 200, "application/json", body.encode(), ()
        return 200, "text/html; charset=utf-8", self._index, ()
