"""Who is at the other end: the principal in the certificate a server presents.

gRPC checks that the driver's certificate is signed by the job's CA and names the host
the agent dialled, but every certificate of that CA passes those checks when it carries
the host (a node's certificate with `127.0.0.1`, say, once made a node a driver to its
peers: it deleted their storage and silenced the real driver with a huge term). So before
the agent registers it opens one TLS handshake of its own to the same address and reads
the `role:name` SAN URI of the certificate served there: only `driver:*` is a driver, and
through a relay only the relay's own `node:<relay>`. A mismatch is refused and retried
like an unreachable driver, with a log line saying what was found.
"""

from __future__ import annotations

import socket
import ssl

from unbroken.common.principal import principal_of_peercert
from unbroken.common.tls import TlsConfig


class PeerIdentityError(Exception):
    """The server at an address is not the principal the agent expected."""


def peer_principal(target: str, tls: TlsConfig, timeout_s: float = 10.0) -> str | None:
    """The `role:name` in the certificate served at `target` (host:port), after checking
    it against our CA with our client certificate (None: the certificate names none)."""
    assert tls.ca and tls.cert and tls.key
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.check_hostname = False  # gRPC checks the host name; this checks the principal
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
        with ctx.wrap_socket(raw, server_hostname=host or None) as s:
            return principal_of_peercert(s.getpeercert())


def check_peer(target: str, tls: TlsConfig, *, role: str, name: str = "") -> str:
    """The principal at `target` when it has `role` (and `name`, when given).

    Raises:
        PeerIdentityError: it is another principal (or none).
        OSError, ssl.SSLError: the handshake failed.
    """
    who = peer_principal(target, tls)
    want = f"{role}:{name}" if name else f"{role}:*"
    got_role, _, got_name = (who or "").partition(":")
    if got_role != role or (name and got_name != name):
        raise PeerIdentityError(
            f"the server at {target} presents {who or 'no principal'}, not {want}: refused "
            "(is --driver the driver's address? a certificate of another role must never "
            "serve it)"
        )
    return str(who)
