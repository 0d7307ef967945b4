"""Why a driver cannot be reached: a TCP connect and a TLS handshake, done by hand.

grpc reports every failed connection as UNAVAILABLE, and with mutual TLS the cause (no
client certificate, a certificate of another CA, a certificate for another host name,
plaintext against TLS) is only in the driver's log. When a call fails that way the CLI
asks `diagnose` once, which repeats the connection with Python's `ssl` module, where each
of those causes is a distinct error, and says which in one line with what to do.
"""

from __future__ import annotations

import socket
import ssl

from unbroken.common.tls import TlsConfig

HINT = "is `unbroken driver` running there? Point --driver or $UNBROKEN_DRIVER at it"
FIX_CLIENT_CERT = (
    "give --tls-cert/--tls-key/--tls-ca (or $UNBROKEN_CERT/$UNBROKEN_KEY/$UNBROKEN_CA)"
)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def diagnose(address: str, tls: TlsConfig, timeout_s: float = 5.0) -> str | None:
    """One line naming why `address` refuses this client's connection (None: not known).

    Args:
        address: the driver's host:port.
        tls: the client's TLS files (all None: plaintext).
        timeout_s: the deadline of the connect and of the handshake.
    """
    host, port = _split(address)
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        return f"unreachable: no answer from {address} within {timeout_s:g} s (a firewall?); {HINT}"
    except OSError as e:
        why = e.strerror or type(e).__name__
        return f"unreachable: nothing accepts connections at {address} ({why}); {HINT}"
    with raw:
        raw.settimeout(timeout_s)
        if not tls.enabled:
            return _plaintext_against(raw, host, address)
        return _handshake(raw, host, address, tls)


def _plaintext_against(raw: socket.socket, host: str, address: str) -> str | None:
    """A plaintext client: does the driver speak TLS?"""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(raw, server_hostname=host or None):
            pass
    except (ssl.SSLError, OSError):
        return None  # not TLS either: grpc's own message says more
    return (
        f"no client certificate: the driver at {address} requires mutual TLS and this client "
        f"has no certificate; {FIX_CLIENT_CERT}"
    )


def _not_accepted(address: str, tls: TlsConfig, how: str) -> str:
    return (
        f"unknown CA: the driver at {address} does not accept your client certificate "
        f"({tls.cert}; {how}): it is signed by a CA the driver does not trust; issue one with "
        "the driver's CA (`unbroken certs issue operator:NAME --dir DIR`)"
    )


def _handshake(raw: socket.socket, host: str, address: str, tls: TlsConfig) -> str | None:
    assert tls.cert and tls.key and tls.ca
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols(["h2"])
    try:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            # TLS 1.3: a server that refuses our certificate says so after the handshake
            # (BoringSSL closes without an alert); a healthy gRPC server sends its HTTP/2
            # SETTINGS at once
            s.settimeout(1.0)
            try:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if s.recv(1) == b"":
                    return _not_accepted(address, tls, "it closed the connection")
            except TimeoutError:
                return None
    except ssl.SSLCertVerificationError as e:
        msg = e.verify_message or str(e)
        if "hostname" in msg.lower() or "ip address mismatch" in msg.lower():
            return (
                f"wrong host name: the driver's certificate is not valid for {host!r} ({msg}); "
                f"connect by a name the certificate carries, or reissue it with "
                f"`unbroken certs issue driver:NAME --host {host}`"
            )
        return (
            f"unknown CA: the driver's certificate at {address} is not signed by your CA "
            f"({tls.ca}: {msg}); use the CA of the driver's certificates (--tls-ca, $UNBROKEN_CA)"
        )
    except ssl.SSLError as e:
        text = f"{e.reason or ''} {e}".lower()
        if "unknown ca" in text or "bad certificate" in text or "certificate unknown" in text:
            return _not_accepted(address, tls, str(e.reason))
        if "wrong version number" in text or "record layer failure" in text:
            return (
                f"the driver at {address} does not speak TLS; drop --tls-* (and $UNBROKEN_CERT...)"
            )
        return f"TLS handshake with {address} failed: {e.reason or e}"
    except OSError:
        return None
    return None
