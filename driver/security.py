"""Transport security of the driver's gRPC API: mTLS and a bearer token.

mTLS: the driver presents its certificate and requires a client certificate signed by the
job's CA (a client without one fails the TLS handshake and never reaches a handler).
Bearer token: a server interceptor checks `authorization: Bearer <token>` on every call
except the standard health service, and answers UNAUTHENTICATED before any handler runs,
so a client without valid credentials changes nothing. Both can be combined.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/",)


@dataclass(kw_only=True, slots=True)
class TlsConfig:
    """Certificate files; all three (cert, key, CA) are needed for mTLS."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None  # client side: override the name checked in the cert

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.cert, self.key, self.ca)]
        if any(given) and not all(given):
            raise ValueError(
                "tls: cert, key and ca must be given together (--tls-cert, --tls-key, --tls-ca)"
            )
        for name in ("cert", "key", "ca"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"tls.{name}: no such file {p!r}")

    @property
    def enabled(self) -> bool:
        return self.cert is not None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """mTLS server credentials: our cert, and client certificates required and verified."""
    assert tls.cert and tls.key and tls.ca
    return grpc.ssl_server_credentials(
        [(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
        root_certificates=Path(tls.ca).read_bytes(),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """mTLS client credentials (the agent's certificate, the CA that signed the driver's)."""
    assert tls.cert and tls.key and tls.ca
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca).read_bytes(),
        private_key=Path(tls.key).read_bytes(),
        certificate_chain=Path(tls.cert).read_bytes(),
    )


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The bearer token from a flag or a file (the file wins; whitespace stripped)."""
    if token_file:
        p = Path(token_file)
        if not p.is_file():
            raise ValueError(f"token file {token_file!r} does not exist")
        token = p.read_text().strip()
    if token is not None and len(token) < 16:
        raise ValueError("the bearer token must be at least 16 characters")
    return token or None


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `authorization` metadata is not `Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        got = b""
        for k, v in details.invocation_metadata or ():
            if k == "authorization":
                got = v.encode() if isinstance(v, str) else v
                break
        if got and hmac.compare_digest(got, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        return _denied(
            handler,
            "missing or wrong bearer token; pass --token or --token-file with the job's token",
        )


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
