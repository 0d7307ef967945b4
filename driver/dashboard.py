"""The driver's live web dashboard: one page and one JSON endpoint, served in the driver's loop.

An operator wants to see the whole job at a glance without a CLI: which nodes are alive,
lost, evicted or spare, what the event log recorded, how loss and step time move, which
rank is slow (a per-rank step-time heatmap, as MegaScale built), and which checkpoints are
committed. This module serves that as a static page (driver/web/: plain HTML, JS and CSS,
no build step, no CDN) plus `GET /api/state`, which the page polls about every 0.5 s.

Why plain `asyncio.start_server` and not a web framework: the driver needs GET only, a
handful of routes, and must not gain a heavy dependency. HTTP/1.1 with keep-alive,
bounded request heads, a connection cap and idle deadlines is about a hundred lines
(the wire format in driver/http1.py, what the page shows in driver/dashview.py).

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
closed to make room, else the one stuck longest (over `STALL_S`) in writing an answer its
client does not read: neither idle sockets nor slow readers (a client that pipelines
requests for the open static script and reads nothing held the server's write for the idle
deadline, and a handful of them, renewed, kept the page from everyone) lock operators out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from unbroken.common import aio
from unbroken.driver import loghealth
from unbroken.driver import state as statelib
from unbroken.driver.dashview import Series, event_json, rank_nodes, state_json, stragglers_json
from unbroken.driver.eventlog import EventLog, EventLogError
from unbroken.driver.http1 import MAX_HEAD, HttpError, Request, parse_head, response_bytes
from unbroken.driver.journal import Journal
from unbroken.driver.security import RoleTokens
from unbroken.proto import events_pb2 as ev

if TYPE_CHECKING:
    from unbroken.driver.service import DriverService

log = structlog.get_logger(__name__)

WEB_DIR = Path(__file__).with_name("web")
STATIC_TYPES = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
MAX_REQUESTS_PER_CONN = 10_000
# a write this long unfinished (its client reads nothing) may be closed to make room at the cap
STALL_S = 0.5
READ_CHUNK = 1000  # events folded per refresh at most (the next refresh takes the rest)
SAMPLE_DUTY = 50  # the sampler sleeps at least this many times as long as a sample took


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
        self.evicted_stalled = 0  # connections stuck writing to a client that does not read
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
        self._writing: dict[asyncio.StreamWriter, float] = {}  # in a drain since
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
                await aio.wait_for(self._server.wait_closed(), 2.0)

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
                await aio.wait_for(self._read(elog), self.config.read_timeout_s)
                self._error = ""
                if journal is not None and journal is self.service.journal:
                    have = self._follow(journal)
                    if journal.state.last_seq > have:  # recorded while the read was awaited
                        missed = await aio.wait_for(
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
                "mass_silence": svc.mass_silence() if live else (0, 0.0, 0.0),
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
    def _stalled(self) -> asyncio.StreamWriter | None:
        """The connection stuck longest (over `STALL_S`) writing an answer, if any."""
        since = time.monotonic() - STALL_S
        stuck = [(t, id(w), w) for w, t in self._writing.items() if t <= since]
        return min(stuck)[2] if stuck else None

    def stalled_writers(self) -> int:
        """How many connections are stuck (over `STALL_S`) writing to their client."""
        since = time.monotonic() - STALL_S
        return sum(t <= since for t in self._writing.values())

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        full = self._conns >= self.config.max_connections
        if full and self._idle:
            oldest = min(self._idle, key=self._idle.__getitem__)
            self._idle.pop(oldest)
            oldest.close()  # its task ends (and frees its place) on its next read
            self.evicted_idle += 1
        elif full and (stuck := self._stalled()):
            self._writing.pop(stuck, None)
            stuck.transport.abort()  # its drain fails at once (close would flush first)
            self.evicted_stalled += 1
        elif full:
            with contextlib.suppress(ConnectionError):
                writer.write(
                    response_bytes(
                        503, b"too many dashboard connections\n", "text/plain", keep_alive=False
                    )
                )
                await aio.wait_for(writer.drain(), 2.0)
            writer.close()
            return
        self._conns += 1
        self._writers.add(writer)
        try:
            for _ in range(MAX_REQUESTS_PER_CONN):
                self._idle[writer] = time.monotonic()
                try:
                    head = await aio.wait_for(
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
                self._writing[writer] = time.monotonic()
                try:
                    await aio.wait_for(writer.drain(), self.config.idle_timeout_s)
                finally:
                    self._writing.pop(writer, None)
                if not req.keep_alive:
                    return
        except HttpError as e:
            with contextlib.suppress(ConnectionError, TimeoutError):
                writer.write(
                    response_bytes(
                        e.status, f"{e}\n".encode(), "text/plain; charset=utf-8", keep_alive=False
                    )
                )
                await aio.wait_for(writer.drain(), 2.0)
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
