"""Bounded pages for every all-nodes call (ListNodes, LiveView), and a client that follows them.

At 10,240 nodes an unpaged ListNodes answer was over gRPC's default 4 MiB message limit,
so a call without a page gets DEFAULT_PAGE nodes and a `next_after` token, and any page
stops early at PAGE_BYTES (a node with many workers is large) with the token where it
stopped. Clients follow `next_after` until it is empty (`all_nodes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

DEFAULT_PAGE = 1000  # nodes in a page when the caller names no page_size
PAGE_BYTES = 3 << 20  # a page stops growing here, under gRPC's default 4 MiB message


class _Sized(Protocol):
    node_id: str

    def ByteSize(self) -> int: ...


T = TypeVar("T", bound=_Sized)


def page_size(requested: int) -> int:
    """The page size to serve for a request's `page_size` (0: DEFAULT_PAGE)."""
    return requested or DEFAULT_PAGE


def bounded(items: Sequence[T], limit: int, more: bool) -> tuple[list[T], str]:
    """The first items of a page of at most `limit` that fit PAGE_BYTES, and the token of the
    next page ("" when this page ends the list). `more`: items follow the `limit` given."""
    out: list[T] = []
    size = 0
    for item in items[:limit]:
        size += item.ByteSize() + 8
        if out and size > PAGE_BYTES:
            return out, out[-1].node_id
        out.append(item)
    return out, out[-1].node_id if out and (more or len(items) > limit) else ""


def all_nodes(call: Callable[..., Any], request: Any, **kw: Any) -> Iterator[Any]:
    """Every node of a paged all-nodes call: `call(request, **kw)` page after page."""
    req = type(request)()
    req.CopyFrom(request)
    while True:
        page = call(req, **kw)
        yield from page.nodes
        if not page.next_after:
            return
        req.after = page.next_after
