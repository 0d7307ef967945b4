"""structlog set-up shared by every process (driver, agent, cli, trainer tools)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def setup_logging(fmt: str = "console", level: int = logging.INFO) -> None:
    """structlog to stderr, one line per event, with a timestamp."""
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


#: a worker's line times: structlog's default layout, to the microsecond, in UTC (Z; the
#: default's whole seconds could not order a recovery's steps against its agent's lines)
WORKER_TIME_FMT = "%Y-%m-%d %H:%M:%S.%fZ"


def setup_worker_logging(level: int = logging.INFO) -> None:
    """A worker's structlog: the default console lines (what `cli/drill.py` reads from
    worker logs), timestamps to the microsecond, `level` and above."""
    processors = [
        structlog.processors.TimeStamper(fmt=WORKER_TIME_FMT, utc=True)
        if isinstance(p, structlog.processors.TimeStamper)
        else p
        for p in structlog.get_config()["processors"]
    ]
    structlog.configure(
        processors=processors, wrapper_class=structlog.make_filtering_bound_logger(level)
    )
