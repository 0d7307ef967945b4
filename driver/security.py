"""Security of the driver's gRPC API: who is calling (a principal) and what its role may do.

Every call but the standard health service has a principal: from the mTLS client
certificate (a SAN URI `node:<id>`, `operator:<name>`, `launcher:<name>`, `viewer:<name>`,
`driver:<name>`; `unbroken certs` issues them) or, without TLS, from one of the role tokens
the driver was given (`--token-file ROLE=PATH`, several per role so they rotate). One
table, `AUTHZ`, says which role may call which RPC; `AuthInterceptor` applies it before any
handler runs, and handlers read the principal with `caller()` (an agent may only act as its
own node; an operator action's `who` is the principal). A driver with no credentials at all
serves every call as `*:anonymous`: it refuses to listen beyond loopback unless told
`--insecure` (driver/main.py). SECURITY.md has the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from unbroken.common.serving import around, of_shape
from unbroken.common.tls import MIN_TOKEN, check_private
from unbroken.driver.certs import ROLES, parse_principal, principal_of_san

OPEN_METHODS = ("/grpc.health.v1.Health/",)


# ---------------------------------------------------------------- principals and roles
ANY_ROLE = "*"  # the anonymous principal of a driver without credentials (loopback only)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a role and a name (`*`: a role token not bound to one name)."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"

    def may(self, roles: frozenset[str]) -> bool:
        return self.role == ANY_ROLE or self.role in roles

    @property
    def identified(self) -> bool:
        """Whether this names one party (not the anonymous caller of a driver without
        credentials, nor a role token bound to no name): per-principal quotas count only
        such principals; the others share the job's quotas."""
        return self.role != ANY_ROLE and self.name != "*"

    def is_node(self, node_id: str) -> bool:
        """Whether this principal may act as node `node_id` (Register, Session, shards)."""
        if self.role == ANY_ROLE:
            return True
        return self.role == "node" and self.name in ("*", node_id)


ANONYMOUS = Principal(ANY_ROLE, "anonymous")
CALLER: ContextVar[Principal] = ContextVar("unbroken_caller", default=ANONYMOUS)


def caller() -> Principal:
    """The authenticated principal of the RPC being handled (set by `AuthInterceptor`)."""
    return CALLER.get()


# One table says which role may call which RPC. tests/unit/test_authz.py walks every
# service in proto/ and fails when a method has no entry here.
_D = "/unbroken.driver.v1.Driver/"
_R = "/unbroken.rendezvous.v1.Rendezvous/"
NODE = frozenset({"node"})
OPERATOR = frozenset({"operator"})
LAUNCHER = frozenset({"launcher"})
READERS = frozenset({"operator", "viewer", "launcher"})
RENDEZVOUS = frozenset({"node", "launcher"})  # torchrun's agent on each node
AUTHZ: dict[str, frozenset[str]] = {
    _D + "Register": NODE,
    _D + "Session": NODE,
    _D + "LiveView": READERS | {"driver"},
    _D + "GetStatus": READERS,
    _D + "ListNodes": READERS,
    _D + "WatchEvents": READERS,
    _D + "ListCheckpoints": READERS,
    _D + "Diagnose": OPERATOR,
    _D + "Evict": OPERATOR,
    _D + "ClearNode": OPERATOR,  # resumes a drained node in the cluster scheduler
    _D + "RunSelfCheck": OPERATOR,
    _D + "InjectFault": OPERATOR,  # and only on a driver run with --allow-fault-injection
    _D + "Resume": OPERATOR,  # a failed or stuck job: a new incident, a fresh restore budget
    _D + "RegisterJob": LAUNCHER,
    _D + "ReportFailure": LAUNCHER,
    _D + "RequestCheckpoint": OPERATOR | LAUNCHER,
    **{
        _R + m: RENDEZVOUS
        for m in (
            "GetState",
            "GetKey",
            "SetState",
            "StoreSet",
            "StoreGet",
            "StoreAdd",
            "StoreCompareSet",
            "StoreWait",
            "StoreCheck",
            "StoreDelete",
            "StoreNumKeys",
            "GetKey",
        )
    },
}
# The RPCs that speak as one node id: an unbound node token (one not followed by a node id
# in the token file) could speak as every node, so it is refused for them.
NODE_IDENTITY = frozenset({_D + "Register", _D + "Session"})
UNBOUND_NODE_TOKEN = (
    "this node token is not bound to a node id, so it could act as any node: the driver "
    "refuses it for Register and Session. Give each node its own token bound to its id, a "
    "line `<token> <node-id>` in the driver's node token file (make tokens with `openssl "
    "rand -hex 32`; `unbroken up` writes them, one file per node), or a `node:<id>` "
    "certificate (`unbroken certs issue node:<id>`)"
)
# any authenticated principal (server reflection, when enabled, only describes the API)
AUTHENTICATED_PREFIXES = ("/grpc.reflection.",)


class RoleTokens:
    """The bearer tokens a driver accepts, by role; several per role, so they can rotate.

    A token file holds one token per line, optionally followed by a name that binds the
    token to one principal (`<token> node-a` may act only as node `node-a`); a token
    without a name may act as any principal of its role. `#` starts a comment. Lookup is
    by the token's SHA-256 digest, then a constant-time compare.
    """

    def __init__(self, entries: Mapping[str, Iterable[str]]) -> None:
        self._by_digest: dict[bytes, tuple[bytes, Principal]] = {}
        for role, lines in entries.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
            for line in lines:
                words = line.split()
                if not words or words[0].startswith("#"):
                    continue
                token, name = words[0], (words[1] if len(words) > 1 else "*")
                if len(token) < MIN_TOKEN:
                    raise ValueError(
                        f"a {role} token is shorter than {MIN_TOKEN} characters; make one "
                        "with `openssl rand -hex 32`"
                    )
                if name != "*":
                    parse_principal(f"{role}:{name}")
                d = hashlib.sha256(token.encode()).digest()
                if d in self._by_digest and self._by_digest[d][1].role != role:
                    raise ValueError(
                        f"the same token is listed for roles {self._by_digest[d][1].role} and "
                        f"{role}: give each role its own tokens"
                    )
                self._by_digest[d] = (token.encode(), Principal(role, name))

    def __len__(self) -> int:
        return len(self._by_digest)

    def principal(self, presented: bytes) -> Principal | None:
        """The principal of a presented token, None when it is not one of ours."""
        hit = self._by_digest.get(hashlib.sha256(presented).digest())
        if hit is None or not hmac.compare_digest(hit[0], presented):
            return None
        return hit[1]

    @classmethod
    def from_files(cls, specs: Iterable[str]) -> RoleTokens:
        """`ROLE=PATH` specs (the driver's `--token-file`), each file read as above."""
        entries: dict[str, list[str]] = {}
        for spec in specs:
            role, sep, path = spec.partition("=")
            if not sep or not path:
                raise ValueError(
                    f"--token-file {spec!r}: expected ROLE=PATH with ROLE one of "
                    f"{', '.join(ROLES)} (e.g. --token-file node=/etc/unbroken/node.tokens)"
                )
            p = Path(path)
            if not p.is_file():
                raise ValueError(f"token file {path!r} (role {role}) does not exist")
            check_private(p, f"token file (role {role})")
            entries.setdefault(role, []).extend(p.read_text().splitlines())
        return cls(entries)


def tls_principal(context: grpc.aio.ServicerContext) -> Principal | None:
    """The principal in the peer's certificate (a `role:name` SAN URI), None without one."""
    auth = context.auth_context() or {}
    values = [*auth.get("x509_uri", ()), *auth.get("x509_subject_alternative_name", ())]
    text = principal_of_san(values)
    if text is None:
        return None
    role, name = parse_principal(text)
    return Principal(role, name)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call and checks the authorization table before any handler runs.

    Bearer tokens are checked here, on the metadata, before the request is parsed (a
    refused call's body is never deserialized). With mTLS the certificate's principal is
    read inside the call (gRPC exposes the peer only there); the handshake has already
    proven the peer holds a key our CA signed. With tokens and TLS both, the certificate is
    enough; a token sent along must be valid and name the certificate's role.
    """

    def __init__(self, tokens: RoleTokens | None, *, tls: bool) -> None:
        self.tokens = tokens if tokens else None
        self.tls = tls

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(OPEN_METHODS):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        roles = AUTHZ.get(method)
        if roles is None and method.startswith(AUTHENTICATED_PREFIXES):
            roles = frozenset(ROLES)
        if roles is None:
            return _denied(
                handler, grpc.StatusCode.PERMISSION_DENIED, f"{method}: no role may call it"
            )
        by_token: Principal | None = None
        if self.tokens is not None:
            got = b""
            for k, v in details.invocation_metadata or ():
                if k == "authorization":
                    got = v.encode() if isinstance(v, str) else v
                    break
            if got.startswith(b"Bearer "):
                by_token = self.tokens.principal(got[7:])
            # with mTLS the certificate is enough; a token, when sent, must be valid
            if by_token is None and (got or not self.tls):
                return _denied(
                    handler,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong bearer token; give the client its role's token in a "
                    "file (--token-file) or $UNBROKEN_TOKEN",
                )
            if not self.tls:
                assert by_token is not None  # refused above otherwise
                if not by_token.may(roles):
                    return _denied(
                        handler,
                        grpc.StatusCode.PERMISSION_DENIED,
                        _forbidden(by_token, method, roles),
                    )
                if by_token.role == "node" and by_token.name == "*" and method in NODE_IDENTITY:
                    return _denied(handler, grpc.StatusCode.PERMISSION_DENIED, UNBOUND_NODE_TOKEN)
                return _as(handler, by_token)
        if not self.tls:
            return _as(handler, ANONYMOUS)  # no credentials configured (loopback or --insecure)
        return _as_peer(handler, method, roles, by_token)


def _forbidden(p: Principal, method: str, roles: frozenset[str]) -> str:
    return (
        f"{p} may not call {method.rsplit('/', 1)[-1]}: it needs the role "
        f"{' or '.join(sorted(roles))} (see SECURITY.md)"
    )


def _wrap(
    handler: grpc.RpcMethodHandler, before: Callable[[Any], Awaitable[None]]
) -> grpc.RpcMethodHandler:
    """`handler` with `before(context)` awaited first, in the call's own task."""

    async def prepare(request: Any, context: Any) -> tuple[Any, Any]:
        await before(context)
        return request, context

    return around(handler, prepare, handler.request_deserializer)


def _as(handler: grpc.RpcMethodHandler, principal: Principal) -> grpc.RpcMethodHandler:
    async def before(context: Any) -> None:
        CALLER.set(principal)

    return _wrap(handler, before)


def _as_peer(
    handler: grpc.RpcMethodHandler,
    method: str,
    roles: frozenset[str],
    by_token: Principal | None,
) -> grpc.RpcMethodHandler:
    async def before(context: Any) -> None:
        p = tls_principal(context)
        if p is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "the client certificate names no principal: issue it with a SAN URI such as "
                "node:<id> or operator:<name> (`unbroken certs issue`)",
            )
        assert p is not None
        if by_token is not None and by_token.role != p.role:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the token's role ({by_token.role}) and the certificate's ({p}) differ",
            )
        if not p.may(roles):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, _forbidden(p, method, roles))
        CALLER.set(p)

    return _wrap(handler, before)


def _denied(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that aborts with `code` without parsing the request."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return of_shape(handler, deny, _unparsed)


def _unparsed(data: bytes) -> None:
    """The request deserializer of a refused call: its bytes are never parsed."""
    return None
