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
