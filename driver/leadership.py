"""Who leads this job right now, as the driver's gRPC handlers need to know it.

`Leadership` holds this driver's ids, the current term's journal (None while standing by)
and the leader's address. `require` is the one check every leader-only handler makes: it
returns the journal, or ends the call with FAILED_PRECONDITION naming the leader (and the
`x-unbroken-leader` trailer, which the CLI and agents follow).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import grpc

from unbroken.common import channel
from unbroken.driver.journal import Journal
from unbroken.driver.liveview import LiveView
from unbroken.driver.rpc import abort
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev


class Clearer(Protocol):
    """What the operator's ClearNode needs of the term's scheduler bridge."""

    async def clear(self, node_id: str, *, force: bool = ..., cause: str = ...) -> ev.Event: ...


class Leadership:
    """This driver's identity and its current term (if it leads)."""

    def __init__(self, driver_id: str, job_id: str, address: str = "") -> None:
        self.driver_id = driver_id
        self.job_id = job_id
        self.journal: Journal | None = None  # this term's only writer (None: standby)
        self.address = address  # the current leader's address (maybe our own)
        # node ids the torchrun rendezvous has heard from lately (driver/rendezvous.py):
        # nodes of the job that no agent registered, which an operator may still evict
        self.rendezvous_nodes: Callable[[], Collection[str]] = tuple
        # the term's cluster-scheduler bridge (None: standby, or no scheduler): the term
        # sets it when it begins and clears it when it ends
        self.bridge: Clearer | None = None

    @property
    def leader(self) -> bool:
        return self.journal is not None

    async def require(self, context: grpc.aio.ServicerContext) -> Journal:
        """This term's journal; a standby ends the call, naming the leader."""
        journal = self.journal
        if journal is None:
            where = self.address or "unknown yet"
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"driver {self.driver_id} is a standby, not the leader; the leader is at "
                f"{where} (use --driver {where})",
                trailing_metadata=((channel.LEADER_KEY, self.address),),
            )
        return journal


class Commands(Protocol):
    """What operator and launcher handlers need of the agent sessions (DriverService)."""

    view: LiveView

    async def request(
        self, node_id: str, msg: dpb.DriverMessage, timeout_s: float
    ) -> dpb.AgentMessage: ...

    def send(self, node_id: str, msg: dpb.DriverMessage) -> str: ...

    def emit(self, event: ev.Event, last_seen: float = ...) -> bool: ...

    def persistence(self) -> tuple[float, float, float]: ...

    def persist_failing(self) -> list[dpb.PersistFailure]: ...

    def newest_commit(self) -> tuple[int, float]: ...

    def mass_silence(self) -> tuple[int, float, float]: ...

    def awaiting_nodes(self, state: ev.JobState) -> str: ...
