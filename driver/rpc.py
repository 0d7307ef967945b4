"""Helpers shared by the driver's gRPC handlers.

`abort` is `context.abort` typed `NoReturn`: grpc.aio's own stub is typed as returning
None, so every handler used to follow an abort with `raise AssertionError("unreachable")`
or an `assert x is not None` to convince the type checker of what grpc already does.

`within_deadline` bounds a wait inside a handler by what is left of the caller's deadline:
a handler that has already recorded an event must answer before the caller gives up, or
the caller reads "cannot reach the driver" for an action that was done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    details: str,
    trailing_metadata: Sequence[tuple[str, str]] = (),
) -> NoReturn:
    """End the call with `code` and `details` (a message a person can act on)."""
    await context.abort(code, details, trailing_metadata=tuple(trailing_metadata))
    raise AssertionError("grpc's context.abort returned")  # it raises; never reached


# answer this long before the caller's deadline: the reply still has to travel back
REPLY_MARGIN_S = 0.5
# the shortest wait left to a command once it is sent (its ack may still come in time)
MIN_WAIT_S = 0.1


def within_deadline(context: grpc.aio.ServicerContext, wanted_s: float) -> float:
    """`wanted_s`, cut to the caller's time left less a margin (at least `MIN_WAIT_S`)."""
    left = context.time_remaining()
    if left is None:
        return wanted_s
    return max(MIN_WAIT_S, min(wanted_s, left - REPLY_MARGIN_S))
