"""Helpers shared by the driver's gRPC handlers.

`abort` is `context.abort` typed `NoReturn`: grpc.aio's own stub is typed as returning
None, so every handler used to follow an abort with `raise AssertionError("unreachable")`
or an `assert x is not None` to convince the type checker of what grpc already does.
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
