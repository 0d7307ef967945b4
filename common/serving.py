"""What every gRPC server of ours does to a request before a handler sees it.

A request whose bytes are not a valid message must get INVALID_ARGUMENT naming the rpc, not
UNKNOWN with a Python class name: grpc's server runs the deserializer outside the handler,
and an exception there becomes `UNKNOWN: Unexpected <class '...DecodeError'>`. So
`MalformedRequests` (a server interceptor; put it innermost, after authentication, so a
refused call is still refused before its body is parsed) gives every handler a deserializer
that cannot raise: a bad message becomes a `Malformed` value, and the handler is wrapped so
that a `Malformed` request, or one read from a request stream (`async for` or
`context.read()`), ends the call with INVALID_ARGUMENT before any code of ours sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class Malformed:
    """A request that could not be parsed (what the tolerant deserializer returns)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    cls = getattr(deserializer, "__self__", None)  # Message.FromString is a bound classmethod
    descriptor = getattr(cls, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "")) or "request"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, or whatever a custom deserializer raises
            return Malformed(str(e) or type(e).__name__)

    return parse


class _CheckedContext:
    """The servicer context, whose `read()` refuses a malformed message of the stream."""

    def __init__(self, context: grpc.aio.ServicerContext, refuse: Callable[..., Any]) -> None:
        self._context = context
        self._refuse = refuse

    async def read(self) -> Any:
        msg = await self._context.read()
        if isinstance(msg, Malformed):
            await self._refuse(self._context, msg)
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


Prepare = Callable[[Any, Any], Awaitable[tuple[Any, Any]]]


def of_shape(
    handler: grpc.RpcMethodHandler,
    call: Callable[..., Any],
    deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s streaming shape and response serializer that runs `call`."""
    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(call, deserializer, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(call, deserializer, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(call, deserializer, ser)
    return grpc.unary_unary_rpc_method_handler(call, deserializer, ser)


def around(
    handler: grpc.RpcMethodHandler,
    prepare: Prepare,
    deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """`handler` with `prepare(request, context)` awaited first, in the call's own task; the
    handler then runs with the request and context `prepare` returns."""
    inner = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    call: Callable[..., Any]
    if inspect.isasyncgenfunction(inner):

        async def gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request, ctx = await prepare(request, context)
            async for item in inner(request, ctx):
                yield item

        call = gen
    else:

        async def plain(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request, ctx = await prepare(request, context)
            result = inner(request, ctx)
            return await result if inspect.isawaitable(result) else result

        call = plain
    return of_shape(handler, call, deserializer)


def checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a tolerant deserializer and malformed requests refused."""
    des = handler.request_deserializer
    expected = _message_name(des) if des is not None else "request"

    async def refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request is not a valid {expected} message ({bad.error})",
        )

    async def stream_of(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for msg in requests:
            if isinstance(msg, Malformed):
                await refuse(context, msg)
            yield msg

    async def prepare(request: Any, context: Any) -> tuple[Any, Any]:
        if handler.request_streaming:
            return stream_of(request, context), _CheckedContext(context, refuse)
        if isinstance(request, Malformed):
            await refuse(context, request)
        return request, context

    return around(handler, prepare, _tolerant(des))


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Malformed request bytes get INVALID_ARGUMENT on every method of the server."""

    def __init__(self) -> None:
        # method -> (the servicer's handler, its checked version): built once per method
        self._checked: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        hit = self._checked.get(details.method)
        if hit is None or hit[0] is not handler:
            hit = self._checked[details.method] = (handler, checked(handler, details.method))
        return hit[1]
