"""Whether the event log takes the journal's writes: no silent failure when etcd is full.

When etcd refuses writes (its NOSPACE alarm once the database passes
--quota-backend-bytes, or it is unreachable) nothing the driver observes becomes durable:
a dead node stays "0 lost" in every view built from the log. The journal keeps its
observations and retries (driver/journal.py); this records *that* it is failing, since
when and why, so `unbroken status`, the dashboard and the metrics
`unbroken_event_log_failing_seconds` and `unbroken_event_log_full` say so, next to how many
faults wait to be recorded (`unbroken_faults_pending`). (No event can say it: the log is
what fails.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from unbroken.driver.eventlog import LogFullError

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class LogHealth:
    """The journal's appends: failing since when (monotonic; 0: they succeed), why."""

    failing_since: float = 0.0
    failures: int = 0  # failed appends in a row
    error: str = ""
    full: bool = False  # the store said it is out of space (etcd NOSPACE)

    def failed(self, e: Exception, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not self.failures:
            self.failing_since = now
            log.error("event log refuses writes; observations wait", error=str(e))
        self.failures += 1
        self.error = str(e)
        self.full = isinstance(e, LogFullError)

    def succeeded(self) -> None:
        if self.failures:
            log.warning(
                "event log takes writes again",
                failed_appends=self.failures,
                for_s=round(time.monotonic() - self.failing_since, 1),
            )
        self.failing_since, self.failures, self.error, self.full = 0.0, 0, "", False

    def failing_s(self, now: float | None = None) -> float:
        if not self.failures:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.failing_since)


def summary(journal: Any) -> dict[str, Any]:
    """What status, metrics and the dashboard show of the journal's writes (a standby,
    with no journal: nothing failing)."""
    if journal is None:
        return {"failing_s": 0.0, "error": "", "full": False, "faults_unrecorded": 0}
    h: LogHealth = journal.health
    return {
        "failing_s": h.failing_s(),
        "error": h.error,
        "full": h.full,
        "faults_unrecorded": journal.faults_pending() if h.failures else 0,
    }
