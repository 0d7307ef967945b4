"""The node's flash-checkpoint memory: owned, persisted and replicated by the agent.

The agent, not the worker, owns the shared memory holding its ranks' flash copies, so a copy
survives the worker's crash. `NodeFlash` creates the job's `FlashOwner` at start, tells
workers where it is (environment variables read by `unbroken.trainer.flashckpt`), and runs
one background loop, on its own thread at a low priority (`LoopThread`, `--flash-nice`: the
workers keep the cores), that notices completed copies (a new manifest generation per rank,
polled every `poll_ms`) and then (1) hands them to the fsspec `Persister`, which writes and
verifies them off the event loop, and reports each verified shard to the driver (which
commits a step once every rank's shard is in), and (2) sends them to the buddy agent (the
next node of the ring), whose `ReplicaServer` verifies the checksum before keeping them (the
newest copy every few saves, spaced so the replicated step stays inside every rank's ring:
`ReplicaSender`). It also serves its own replica store to a buddy and, when this node
replaces a lost one, fetches that node's replicas back from the server holding them before
the workers start. A clean shutdown flushes persistence and removes the job's shared memory;
a crash leaves it for a restarted agent.

The replica stream is authenticated (recovery/replica.py): mutual TLS with the agent's own
certificate when it has one (a PUT only from the node itself; a GET only by the node or a
replacement named in `replica_grants`), else an HMAC under the job's replica key
(`--replica-key-file` or UNBROKEN_REPLICA_KEY, the same on every node). An agent with
neither keeps no replicas: it serves nobody, and a --buddy without one is refused at start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from unbroken.agent.ringwake import RingWake
from unbroken.common import aio
from unbroken.common.loopthread import LoopThread
from unbroken.common.tls import TlsConfig
from unbroken.common.workerenv import WorkerEnv
from unbroken.recovery.flashcopy import (
    CopyRef,
    FlashError,
    list_copies,
    replica_store,
    write_keep_mark,
)
from unbroken.recovery.flashowner import FLASH_COPIES, FlashConfig, FlashOwner, secure_dir
from unbroken.recovery.lifecycle import deletable
from unbroken.recovery.nodekey import NodeKey
from unbroken.recovery.persist import (
    PersistConfig,
    Persisted,
    Persister,
    delete_steps,
    list_persisted,
    persistable,
)
from unbroken.recovery.replica import ReplicaServer, fetch_replica
from unbroken.recovery.replicaauth import ReplicaAuth, ReplicaConfig
from unbroken.recovery.replicasend import REPLICA_DUTY, ReplicaSender
from unbroken.recovery.sdcbuddy import BuddyOpinions
from unbroken.recovery.sources import PERSIST_EVERY_S

log = structlog.get_logger(__name__)
# The flash thread's nice value: the workers' (`--worker-nice` 5), not 19, where on busy
# cores it waited for idle time and a lost node's ranks went back with its buddy's lagging
# copy. `--replica-duty` bounds the sends' CPU time at any nice value. Same-run ab phases
# (2026-12-05, load 6-8): flash saves cost nothing resolved at 5 against 19 (0.872, 0.878
# against 0.877, 0.850), and in-job node losses went back 0.75 steps on average at 5 (16
# losses, never more than 1) against 1.13 at 19 (up to 3). Persistence runs at 19 whatever
# this is.
IO_NICE = 5
# The persister's thread: writing and reading back whole copies is bulk work that waits for
# idle CPU time on every setting of the flash thread's.
PERSIST_NICE = 19
# A flash thread that finished no ring scan for this long is starved (said once, from the
# agent's own loop): at a high nice value it gets little CPU where every core is busy.
STARVED_S = 5.0
REPLICA_PREFIX = replica_store("x")[:-1]  # "replica-": a store of another node's copies
MAX_HELD_RANKS = 256  # replica holdings reported per heartbeat

KEEP_COPIES = 2  # verified copies a ring keeps (`keep`): the newest and the one before
REPORTS_KEPT = 1024  # verified-shard reports held while the driver is unreachable
REPORTS_RESENT = 64  # the newest reports already sent, sent again to a new session


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """`host:port` -> (host, port); ValueError naming `what` when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} {value!r} must be host:port (e.g. 10.0.0.2:29600)")
    return host, int(port)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeFlashConfig:
    """The agent's flash store: where, what is persisted, and who the buddy is."""

    root: str = field(
        default="/dev/shm/unbroken",
        metadata={
            "flag": "--flash-dir",
            "unset": True,
            "group": "flash checkpoints",
            "help": "tmpfs folder for flash copies (unset: /dev/shm/unbroken/<flash node>, so "
            "several agents on one host never share one)",
        },
    )
    job: str = field(
        default="default",
        metadata={
            "flag": "--flash-job",
            "group": "flash checkpoints",
            "help": "job name (a folder in --flash-dir)",
        },
    )
    # the ring slot this node fills; a replacement node reuses the lost one's
    node: str = field(
        metadata={
            "flag": "--flash-node",
            "group": "flash checkpoints",
            "help": "ring slot this node fills (unset: --node-id); a replacement for a lost "
            "node passes the lost node's name to get its copies back from the buddy",
        }
    )
    persist_url: str = field(
        default="unbroken-checkpoints",
        metadata={
            "unset": True,
            "group": "flash checkpoints",
            "help": "fsspec URL or directory for persisted copies, shared by every node and "
            "outliving them (required unless --no-flash)",
        },
    )
    persist_every_s: float = field(
        default=PERSIST_EVERY_S,
        metadata={
            "group": "flash checkpoints",
            "help": "about how often workers mark a flash copy for persistence, until the "
            "driver sends its own interval (Young/Daly from the job's failure rate and save "
            "cost)",
        },
    )
    copies: int = field(
        default=FLASH_COPIES,
        metadata={
            "flag": "--flash-copies",
            "group": "flash checkpoints",
            "help": "flash copies kept per rank in shared memory (the ring; 0: from a quarter "
            "of the tmpfs over the node's ranks, 2 to 8; fewer when the tmpfs cannot hold "
            "them, never under 2). More copies let a loss-spike rollback restore from memory "
            "a step from before the spike was detected",
        },
    )
    local_ranks: int = field(
        default=1, metadata={"flag": None, "why": "--nproc-per-node (they share the tmpfs)"}
    )
    listen: str = field(
        default="127.0.0.1:0",
        metadata={
            "flag": "--replica-listen",
            "group": "flash checkpoints",
            "help": "host:port of this node's replica server (port 0: a free one)",
        },
    )
    buddy: str = field(
        default="",
        metadata={
            "group": "flash checkpoints",
            "help": "host:port of the next node's replica server (the ring) until the driver "
            "pairs the world's nodes (every world start); empty: none until then",
        },
    )
    fetch_from_buddy: bool = field(
        default=True,
        metadata={"flag": None, "why": "at start, get this node's replicas back (always)"},
    )
    poll_ms: int = field(
        default=100,
        metadata={
            "flag": "--flash-poll-ms",
            "group": "flash checkpoints",
            "help": "how often the ring is scanned",
        },
    )
    replica_duty: float = field(
        default=REPLICA_DUTY,
        metadata={
            "flag": "--replica-duty",
            "group": "flash checkpoints",
            "help": "the share of the time (0-1] sending copies to the buddy may occupy "
            "(the sending thread's CPU time): while sends cost less, every newer copy goes, "
            "and a lost node's ranks restore a step or so back; lower it where the copies "
            "are large and the link is slower than the sender hashes (~1-2 GB/s)",
        },
    )
    replica_timeout_s: float = field(
        default=60.0,
        metadata={"group": "flash checkpoints", "help": "deadline of one replica transfer"},
    )
    io_nice: int = field(
        default=IO_NICE,
        metadata={
            "flag": "--flash-nice",
            "group": "flash checkpoints",
            "help": "nice value of the agent's flash thread (replication to the buddy, ring "
            "scans), 0-19: the workers' by default, so a lost node's copies are fresh at its "
            "buddy (19: idle time only, the replicas then lag on busy cores; persistence "
            "runs at 19 whatever this is); 0: the agent's own",
        },
    )
    replica_key: bytes | None = field(
        default=None, metadata={"flag": None, "why": "--replica-key-file or its variable"}
    )
    # without TLS: this node's own signing key, from its node token (recovery/nodekey.py)
    node_key: NodeKey | None = field(
        default=None, metadata={"flag": None, "why": "derived from the agent's node token"}
    )
    # mutual TLS (the agent's certificate) replaces the key
    tls: TlsConfig = field(
        default_factory=TlsConfig, metadata={"flag": None, "why": "--tls-cert/--tls-key/--tls-ca"}
    )
    replica_grants: str | None = field(
        default=None,
        metadata={
            "group": "flash checkpoints",
            "help": 'JSON file {lost node: ["node:REPLACEMENT", ...]}: who besides the node '
            "itself may fetch its replicas from this buddy (mTLS only; re-read on every fetch)",
        },
    )

    def __post_init__(self) -> None:
        if not self.node or "/" in self.node:
            raise ValueError(f"flash node name {self.node!r} must be a plain, non-empty name")
        if not self.persist_url:
            raise ValueError("persist_url must name a directory or fsspec URL (--persist-url)")
        if not 0 < self.persist_every_s <= 86400:
            raise ValueError(
                f"persist_every_s must be in (0, 86400] (--persist-every-s), got "
                f"{self.persist_every_s}"
            )
        if not 10 <= self.poll_ms <= 60_000:
            raise ValueError(f"poll_ms must be in [10, 60000], got {self.poll_ms}")
        if not 0 <= self.io_nice <= 19:
            raise ValueError(f"io_nice must be in [0, 19] (--flash-nice), got {self.io_nice}")
        if not 0 < self.replica_duty <= 1:
            raise ValueError(
                f"replica_duty must be in (0, 1] (--replica-duty), got {self.replica_duty}"
            )
        if self.replica_timeout_s <= 0:
            raise ValueError(f"replica_timeout_s must be > 0, got {self.replica_timeout_s}")
        parse_hostport(self.listen, "--replica-listen")
        if self.buddy:
            parse_hostport(self.buddy, "--buddy")
            if not self.tls.enabled and self.replica_key is None:
                raise ValueError(
                    "--buddy needs an authenticated replica stream: give the agent "
                    "--tls-cert/--tls-key/--tls-ca, or the job's replica key "
                    "(--replica-key-file PATH or UNBROKEN_REPLICA_KEY, the same on every node)"
                )
        if self.replica_key is not None and len(self.replica_key) < 16:
            raise ValueError("the replica key must be at least 16 bytes")
        FlashConfig(root=self.root, job=self.job, copies=self.copies)  # validates them


class NodeFlash:
    """One agent's flash store with its persister, replica server and replica sender.

    Its background work (the ring scans, persistence, the replica server and sends) runs
    on a `LoopThread` at `--flash-nice`; `start` and `close` are awaited from the agent's loop.
    """

    def __init__(self, config: NodeFlashConfig, world_size: int, node_id: str = "") -> None:
        self.config = config
        self.node_id = node_id or config.node
        self.world_size = world_size
        self.owner = FlashOwner(
            FlashConfig(
                root=config.root,
                job=config.job,
                copies=config.copies,
                local_ranks=max(1, config.local_ranks),
            )
        )
        self.replica_cfg = ReplicaConfig(
            timeout_s=config.replica_timeout_s, auth=replica_auth(config)
        )
        self.server = ReplicaServer(self.owner, self.replica_cfg)
        # as a buddy: the SDC third opinion on each fingerprinted copy it receives
        self.opinions = BuddyOpinions(helper=True)  # torch in a helper process, not here
        self.server.on_stored = self.opinions.form
        self.port = 0
        self.persister: Persister | None = None
        self.sender: ReplicaSender | None = None
        if config.buddy:
            self.sender = self._sender(parse_hostport(config.buddy, "--buddy"))
        self._ring: dict[int, list[int]] = {}  # rank -> steps its ring holds, newest first
        # rank -> the generations its keep mark spares (verified steps' copies, `keep`)
        self._kept: dict[int, list[int]] = {}
        self.live_ranks: frozenset[int] | None = None  # the workers' ranks (`set_ranks`)
        self._held: list[tuple[str, int, list[int]]] = []  # copies held for other nodes
        self._task: asyncio.Task[None] | None = None
        self._io: LoopThread | None = None
        self._wake: asyncio.Event | None = None  # set from any thread by `poke` (flash loop's)
        self.ring_wake: RingWake | None = None  # sets `_wake` when a copy is whole
        self.persisted: list[Persisted] = []
        # Verified shards not yet reported to the driver (appended by the persister thread,
        # taken by the agent's session; deque ends are thread-safe). Bounded: when the
        # driver is unreachable for long, the oldest reports go first (they can no longer
        # become the newest commit anyway).
        self.reports: collections.deque[Persisted] = collections.deque(maxlen=REPORTS_KEPT)
        # The newest reports written to a session: sent again in the next one (`resend`),
        # since a report in flight when the leader changed is lost with the old leader or
        # refused by the new one (signed with the old session's key). Duplicates are ignored.
        self.sent: collections.deque[Persisted] = collections.deque(maxlen=REPORTS_RESENT)
        self.fetched = 0
        self.prefault_s = 0.0  # the last pre-fault of freshly allocated rings (`prepare`)
        self.prefault_done = threading.Event()
        self.prefault_done.set()
        self.persist_error = ""  # the persister's last error, until a shard persists again
        self.persist_failures = 0  # failed writes in a row
        self.persist_failing_since = 0.0  # monotonic time of the first of them
        self.persisted_count = 0  # shards persisted and verified (metrics)
        self.persisted_bytes = 0
        # when the flash thread last finished a ring scan (monotonic; None: not yet), and
        # whether the agent's loop has said that it is starved (`starved`)
        self.scanned_at: float | None = None
        self._starved_said = False

    def env(self) -> dict[str, str]:
        """What a worker needs to find the store (set in every worker's environment)."""
        c = self.config
        return WorkerEnv(
            flash_root=c.root,
            flash_job=c.job,
            flash_node=c.node,
            persist_url=c.persist_url,
            persist_every_s=c.persist_every_s,
            flash_copies=c.copies,
        ).to_env()

    @property
    def replica_pubkey(self) -> bytes:
        """This node's replica key's public half (RegisterRequest; b"": it has none)."""
        nk = self.replica_cfg.auth.node_key
        return nk.public if nk is not None else b""

    def listen_address(self) -> str:
        """host:port the replica server listens on ("" while it does not)."""
        if not self.port:
            return ""
        host, _ = parse_hostport(self.config.listen, "--replica-listen")
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Listen for the buddy, fetch this node's replicas back, start persisting: on the
        flash thread (started here)."""
        io = self._io = LoopThread(f"flash-{self.node_id}"[:15], self.config.io_nice)
        try:
            await io.call(self._start())
        except BaseException:
            self._io = None
            await asyncio.to_thread(io.stop)
            raise

    async def _start(self) -> None:
        host, port = parse_hostport(self.config.listen, "--replica-listen")
        if self.replica_cfg.auth.enabled:
            self.port = await self.server.start(host, port)
        else:
            log.info("flash.no_replica_server", why="no TLS and no replica key: serves nobody")
        log.info("flash.ready", dir=str(self.owner.job_dir), replica_port=self.port)
        if self.sender is not None and self.config.fetch_from_buddy:
            bhost, bport = self.sender.buddy
            try:
                refs = await fetch_replica(
                    self.owner,
                    self.config.node,
                    bhost,
                    bport,
                    config=self.replica_cfg,
                    requester=self.node_id,
                )
                self.fetched = len(refs)
                log.info("flash.fetched_from_buddy", copies=len(refs), buddy=self.config.buddy)
            except (OSError, TimeoutError, ValueError) as e:
                # The buddy may not be up yet (first start of the job): nothing to get back.
                log.info("flash.no_buddy_replica", buddy=self.config.buddy, error=str(e))
        self.persister = Persister(
            PersistConfig(url=self.config.persist_url, nice=PERSIST_NICE),
            self._on_persisted,
            self._on_persist_error,
        )
        self._wake = asyncio.Event()
        self.ring_wake = RingWake(self._wake, self._send_wait)
        self._task = asyncio.create_task(self._loop())

    def _sender(self, buddy: tuple[str, int], buddy_node: str = "") -> ReplicaSender:
        """A sender of this node's copies to `buddy` (at the configured duty)."""
        c = self.config
        return ReplicaSender(
            self.owner, c.node, buddy, self.replica_cfg, buddy_node=buddy_node,
            duty=c.replica_duty,
        )  # fmt: skip

    def poke(self) -> None:
        """Scan the rings now rather than at the next poll (any thread: the agent's loop
        calls it when a worker reports a step, whose previous save's copy is whole by then).
        A worker's copy waited up to `poll_ms` for the scan that sends it to the buddy, and a
        lost node's ranks restore the buddy's newest copy: that wait was steps lost."""
        io, wake = self._io, self._wake
        if io is not None and wake is not None and not wake.is_set():
            with contextlib.suppress(RuntimeError):  # the flash loop is closing
                io.loop.call_soon_threadsafe(wake.set)

    def _send_wait(self) -> float:
        """Seconds until the sender may send again (`RingWake` waits that long)."""
        return self.sender.cheap_in(time.monotonic()) if self.sender is not None else 0.0

    def _on_persist_error(self, rank_dir: Path, e: Exception) -> None:
        """Persister thread: a write failed (storage full, permission denied, ...); the
        heartbeats carry it to the driver until a shard persists again."""
        if not self.persist_failures:
            self.persist_failing_since = time.monotonic()
        self.persist_failures += 1
        self.persist_error = f"{type(e).__name__}: {e}"[:500]

    def persist_health(self) -> tuple[str, int, float]:
        """(the last persist error or "", failures in a row, seconds failing)."""
        since = self.persist_failing_since
        failing = time.monotonic() - since if self.persist_failures and since else 0.0
        return self.persist_error, self.persist_failures, failing

    def _on_persisted(self, p: Persisted) -> None:
        """Persister thread: record it for the driver's report.

        Retention is the driver's (a `Retention` command, decided from the log): the agent
        never deletes a persisted step on its own, so it cannot delete a rollback target.
        """
        self.persist_error, self.persist_failures = "", 0
        self.persisted.append(p)
        del self.persisted[:-64]
        self.persisted_count += 1
        self.persisted_bytes += p.nbytes
        self.reports.append(p)

    def resend(self) -> int:
        """Queue the newest reports already sent for the new session (before anything not
        sent yet); returns how many."""
        again = [p for p in self.sent if p not in self.reports]
        self.sent.clear()
        self.reports.extendleft(reversed(again))
        return len(again)

    def retain(self, keep_steps: list[int], below: int) -> list[int]:
        """Apply the driver's retention: delete persisted steps under `below` not kept.

        Raises:
            ValueError: the retention would delete every persisted step (it keeps none of
                them: a commit nobody here made, or a driver that is not ours); refused,
                nothing deleted, and the refusal goes back to the driver in the ack.
        """
        try:
            have = list_persisted(self.config.persist_url)
            doomed = deletable(have, keep_steps, below)
            if have and len(doomed) == len(have):
                log.warning(
                    "flash.retention_refused",
                    persisted=sorted(have)[-8:],
                    kept=sorted(keep_steps)[-8:],
                    below=below,
                )
                raise ValueError(
                    f"retention refused: it would delete every persisted step "
                    f"(newest {max(have)}), keeping {sorted(keep_steps)[-8:]} below {below}"
                )
            gone = delete_steps(self.config.persist_url, doomed)
        except OSError as e:
            log.warning("flash.retention_failed", error=str(e))
            return []
        if gone:
            log.info("flash.retention", deleted=gone, kept=sorted(keep_steps), below=below)
        return gone

    def keep(self, steps: list[int]) -> dict[int, list[int]]:
        """Mark the copies of `steps` (the newest verified steps, `RingKeep`) in each local
        rank's ring for its writers to pass over, with the newest one marked before that is
        still there: if the new one's copy was overwritten before the driver's word came,
        the older verified copy stays. Returns rank -> the steps now kept."""
        out: dict[int, list[int]] = {}
        for rank in self.owner.ranks():
            rank_dir = self.owner.rank_dir(rank)
            refs = list_copies(rank_dir)
            gen_step = {r.manifest.generation: r.manifest.step for r in refs}
            new = sorted((g for g, st in gen_step.items() if st in steps), reverse=True)
            before = [g for g in self._kept.get(rank, []) if g in gen_step]
            kept = sorted(set(new[:1] + before), reverse=True)[:KEEP_COPIES]
            if kept != self._kept.get(rank):
                try:
                    write_keep_mark(rank_dir, kept)
                except OSError as e:  # the ring keeps cycling: a rollback finds less
                    log.warning("flash.keep_failed", rank=rank, error=str(e))
                    continue
                self._kept[rank] = kept
            out[rank] = [gen_step[g] for g in kept]
        return out

    def prepare(self, ranks: range, nbytes: int) -> float:
        """Allocate the rings of `ranks` for copies of `nbytes` before the workers start,
        then pre-fault what was allocated in a background thread (`prefault_s` when done),
        so a restarted or replacement worker maps touched pages instead of paying the first
        touch of fresh shared memory inside its start-up. Returns the seconds the
        allocation took; a tmpfs too small is logged, not raised (the worker then says so
        itself)."""
        t0 = time.monotonic()
        for r in ranks:
            try:
                self.owner.reserve(r, nbytes)
            except (OSError, ValueError, FlashError) as e:
                log.warning("flash.prepare_failed", rank=r, nbytes=nbytes, error=str(e))
                break
        took = time.monotonic() - t0
        log.info("flash.prepared", ranks=list(ranks), nbytes=nbytes, seconds=round(took, 3))
        if self.owner.grown:
            # the workers start meanwhile: their first slots come first in the ring order
            self.prefault_done.clear()
            threading.Thread(
                target=self._prefault, args=(list(ranks),), name="flash-prefault", daemon=True
            ).start()
        return took

    def _prefault(self, ranks: list[int]) -> None:
        try:
            self.prefault_s = self.owner.prefault()
            log.info("flash.prefaulted", ranks=ranks, seconds=round(self.prefault_s, 3))
        except (OSError, ValueError) as e:  # a full tmpfs, a vanished ring: the worker faults
            log.warning("flash.prefault_failed", ranks=ranks, error=str(e))
        finally:
            self.prefault_done.set()

    @property
    def buddy(self) -> str:
        """host:port this node's copies are replicated to now ("" without replication)."""
        if self.sender is None:
            return ""
        host, port = self.sender.buddy
        return f"{host}:{port}"

    def set_buddy(
        self,
        address: str,
        node: str = "",
        takes_from: str = "",
        keys: dict[str, bytes] | None = None,
    ) -> bool:
        """Replicate to `address` (host:port) from now on: the driver pairs the world's
        nodes in a ring when it starts a world, so a node whose buddy was replaced or
        evicted does not keep sending to a server that is gone. The new buddy holds
        nothing yet: the next copy goes at once. `node`: the buddy's node id (with mTLS a
        server that is not node:<node> gets nothing); `takes_from`: the node whose copies
        this node's replica server takes from now on (every other node's are refused);
        `keys`: those nodes' replica keys (node id -> public key; without TLS the sender and
        the server check them, recovery/nodekey.py). False when this node cannot replicate
        (no authenticated replica stream) or `address` is malformed."""
        if not self.replica_cfg.auth.enabled:
            log.warning(
                "flash.buddy_not_set",
                buddy=address,
                why="no authenticated replica stream (TLS or the job's replica key)",
            )
            return False
        try:
            target = parse_hostport(address, "buddy")
        except ValueError as e:
            log.warning("flash.buddy_not_set", buddy=address, error=str(e))
            return False
        for n, public in (keys or {}).items():
            self.replica_cfg.auth.learn(n, public)
        if takes_from:
            self.server.senders = {takes_from}
        if (
            self.sender is not None
            and self.sender.buddy == target
            and self.sender.buddy_node == node
        ):
            return True
        log.info("flash.buddy_changed", old=self.buddy, new=address, node=self.node_id)
        self.sender = self._sender(target, node)
        self.sender.only = self.live_ranks
        return True

    def set_ranks(self, ranks: Iterable[int]) -> None:
        """The global ranks this node's workers hold in the world now: only their copies
        are replicated (another world's rank directory stays for a reshard to read)."""
        self.live_ranks = frozenset(ranks)
        if self.sender is not None:
            self.sender.only = self.live_ranks

    def begin_take_over(
        self, node: str, requester: str, source: str = "", pubkey: bytes = b""
    ) -> asyncio.Task[bool] | None:
        """`take_over` as a task, with `node`'s replica store marked as being fetched
        (`FlashOwner.fetching`) until it ends, so a spare's workers start meanwhile and
        read that store once the copies are in (a spare's resume waited 25-40 ms for the
        fetch before its standby was released). None when there is nothing to fetch from."""
        if not self._can_fetch(source):
            return None
        marker = self.owner.fetching(replica_store(node))
        try:
            secure_dir(marker.parent)
            marker.write_text(f"{os.getpid()}\n")
        except (OSError, FlashError) as e:  # the workers then read the store at once
            log.warning("flash.fetch_marker_failed", node=node, error=str(e))

        async def fetch() -> bool:
            try:
                return await self.take_over(node, requester, source, pubkey)
            finally:
                with contextlib.suppress(OSError):
                    marker.unlink()

        return asyncio.create_task(fetch(), name=f"take-over-{node}")

    async def take_over(
        self, node: str, requester: str, source: str = "", pubkey: bytes = b""
    ) -> bool:
        """Fetch `node`'s replicas from `source` (host:port of the replica server that holds
        them; "": this node's buddy): a spare taking over `node`'s ranks; `pubkey`: `node`'s
        replica key (each copy must be signed with it). True when some copy came back;
        failures are logged (storage remains)."""
        if not self._can_fetch(source):
            return False
        self.replica_cfg.auth.learn(node, pubkey)
        try:
            if source:
                host, port = parse_hostport(source, "replaces_from")
            else:
                assert self.sender is not None
                host, port = self.sender.buddy
        except ValueError as e:
            log.warning("flash.take_over_failed", node=node, source=source, error=str(e))
            return False
        try:
            refs = await fetch_replica(
                self.owner, node, host, port, config=self.replica_cfg, requester=requester
            )
        except (OSError, TimeoutError, ValueError) as e:
            log.info("flash.take_over_failed", node=node, source=f"{host}:{port}", error=str(e))
            return False
        log.info("flash.took_over", node=node, copies=len(refs), source=f"{host}:{port}")
        return bool(refs)

    def _can_fetch(self, source: str) -> bool:
        """Whether a take-over has credentials and somewhere to fetch from (`source`, else
        this node's buddy)."""
        return self.replica_cfg.auth.enabled and bool(source or self.sender)

    def replicas_held(self) -> list[tuple[str, int, list[int]]]:
        """(node, global rank, steps newest first) of the copies this node holds as a buddy,
        as last polled."""
        return self._held

    def _poll_replicas(self) -> list[tuple[str, int, list[int]]]:
        out = []
        for store in self.owner.stores():
            if not store.startswith(REPLICA_PREFIX):
                continue
            node = store[len(REPLICA_PREFIX) :]
            for rank in self.owner.ranks(store)[:MAX_HELD_RANKS]:
                steps = [r.manifest.step for r in list_copies(self.owner.rank_dir(rank, store))]
                if steps:
                    out.append((node, rank, steps))
        return out[:MAX_HELD_RANKS]

    async def rescan(self) -> None:
        """Look at every local rank's ring now (after its workers stopped: their last
        copies are in), for `ring_steps`, and at the copies held for other nodes, for
        `replicas_held` (a lost node's last copy, come in after the last poll, was left out
        of the heartbeat the driver picks the restore step from); the rest waits for `tick`."""
        for rank in self.owner.ranks():
            refs = await asyncio.to_thread(list_copies, self.owner.rank_dir(rank))
            self._ring[rank] = [r.manifest.step for r in refs]
        if self.replica_cfg.auth.enabled:
            self._held = await asyncio.to_thread(self._poll_replicas)

    def ring_steps(self, rank: int) -> list[int]:
        """The steps `rank`'s ring holds (complete copies, newest first), as last polled."""
        return self._ring.get(rank, [])

    async def _loop(self) -> None:
        interval = self.config.poll_ms / 1000.0
        wake = self._wake
        assert wake is not None, "set by _start before the loop runs"
        while True:
            with contextlib.suppress(TimeoutError):
                await aio.wait_for(wake.wait(), interval)
            wake.clear()
            try:
                await self.tick()
            except Exception:  # background loop: log and continue
                log.exception("flash.tick_failed")
            self.scanned_at = time.monotonic()

    def scan_age_s(self, now: float) -> float:
        """Seconds since the flash thread last finished a ring scan (0 before its first)."""
        at = self.scanned_at
        return 0.0 if at is None else max(0.0, now - at)

    def starved(self, now: float) -> bool:
        """Called from the agent's own loop (its priority, not the flash thread's): True,
        and a warning once per episode, while the flash thread has not finished a scan in
        `STARVED_S`. At a high nice value it gets little CPU on a node whose cores are all busy
        (data loaders on every core): replication waits, and the operator should
        see it (`unbroken_agent_flash_scan_age_seconds`)."""
        age = self.scan_age_s(now)
        late = age > max(STARVED_S, 10 * self.config.poll_ms / 1000.0)
        if late and not self._starved_said:
            log.warning(
                "flash.starved",
                seconds=round(age, 1),
                nice=self.config.io_nice,
                why="the flash thread finished no ring scan: it gets no CPU (a lower "
                "--flash-nice gives it more under load) or waits on its buddy; replicas wait",
            )
        elif not late and self._starved_said:
            log.info("flash.scanning_again", after_s=round(age, 1))
        self._starved_said = late
        return late

    async def tick(self) -> None:
        """Persist and replicate every local rank's newest copy not handled yet."""
        # The listings run on this thread, not `to_thread`: a ring's listing is ~0.1 ms on
        # the tmpfs, and the hop to a pool thread and back cost more CPU than the listing
        # (two agents with a worker saving every 65 ms: 49 -> 39 ms of CPU a second each)
        listed: dict[int, list[CopyRef]] = {}
        if self.ring_wake is not None:  # a copy for the buddy wakes this loop when whole
            rings = self.owner.ranks() if self.sender is not None else []
            self.ring_wake.watch(self.owner.rank_dir(r) for r in rings)
        for rank in self.owner.ranks():
            rank_dir = self.owner.rank_dir(rank)
            refs = listed[rank] = list_copies(rank_dir)
            self._ring[rank] = [r.manifest.step for r in refs]
            if not refs:
                continue
            keep = persistable(refs)  # the SDK marks most copies memory-only
            if not keep:
                continue
            if self.persister is not None:
                self.persister.offer(rank_dir, keep[0].manifest.generation)
        if self.sender is not None:  # it decides which copies are due (spacing, idle flush)
            await self.sender.tick(listed)  # the copies listed above, not listed again
        if self.replica_cfg.auth.enabled:  # what this node holds for others, for the heartbeat
            self._held = self._poll_replicas()

    async def close(self, *, clean: bool) -> None:
        """Stop; on a clean shutdown flush persistence and free the shared memory."""
        io, self._io = self._io, None
        if io is None:
            await self._close(clean=clean)
            return
        try:
            await io.call(self._close(clean=clean))
        finally:
            await asyncio.to_thread(io.stop)

    async def _close(self, *, clean: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.ring_wake is not None:
            self.ring_wake.close()
        await self.server.stop()
        self.opinions.close()
        if self.persister is not None:
            try:
                await asyncio.to_thread(self.persister.close, 30.0)
            except TimeoutError as e:
                log.warning("flash.persist_flush_timeout", error=str(e))
        if clean:
            self.owner.cleanup()
            with contextlib.suppress(OSError):  # the per-node default root, when now empty
                os.rmdir(self.config.root)
            log.info("flash.cleaned", dir=str(self.owner.job_dir))


def replica_auth(config: NodeFlashConfig) -> ReplicaAuth:
    """The replica stream's credentials: mutual TLS, else the job key, else none."""
    tls = config.tls
    if tls.enabled:
        assert tls.cert and tls.key and tls.ca
        return ReplicaAuth.tls(tls.cert, tls.key, tls.ca, grants_file=config.replica_grants)
    if config.replica_key is not None:
        return ReplicaAuth.keyed(config.replica_key, node_key=config.node_key)
    return ReplicaAuth.none()
