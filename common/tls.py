"""TLS credentials and bearer tokens: one way to load them for every client and server.

Every gRPC endpoint of ours (the driver's service, an agent's session, a relay, the torchrun
rendezvous client) takes the same three files, `TlsConfig`: a certificate, its key and the
CA that signs the other side, all three or none, so both directions are verified (mutual
TLS). The etcd client is the one exception in shape, not in code: etcd may be reached with
a CA alone, so it calls `channel_credentials_from` with what it has.

A bearer token comes from a file (`--token-file`, rdzv conf `token_file=`) or from
`$UNBROKEN_TOKEN`, never from argv, which every local user reads in `ps`; `read_token`
is the only reader and refuses one shorter than `MIN_TOKEN` characters (`openssl rand -hex
32` makes a good one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

MIN_TOKEN = 16
TOKEN_ENV = "UNBROKEN_TOKEN"  # the token itself
TOKEN_FILE_ENV = "UNBROKEN_TOKEN_FILE"  # a file holding it


@dataclass(frozen=True, kw_only=True, slots=True)
class TlsConfig:
    """Certificate files for mutual TLS: all three (cert, key, CA), or none (plaintext)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.cert, self.key, self.ca)]
        if any(given) and not all(given):
            raise ValueError(
                "tls: cert, key and ca must be given together (--tls-cert, --tls-key, --tls-ca; "
                "rdzv conf tls_cert, tls_key, tls_ca)"
            )
        for name in ("cert", "key", "ca"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"tls.{name}: no such file {p!r}")

    @property
    def enabled(self) -> bool:
        return self.cert is not None


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file (ValueError naming `what` when it cannot be read)."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path!r}: {e.strerror}") from e


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """mTLS server credentials: our cert, and client certificates required and verified."""
    assert tls.cert and tls.key and tls.ca
    return grpc.ssl_server_credentials(
        [(read_pem(tls.key, "tls.key"), read_pem(tls.cert, "tls.cert"))],
        root_certificates=read_pem(tls.ca, "tls.ca"),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """mTLS client credentials: our certificate, and the CA that signed the server's."""
    assert tls.cert and tls.key and tls.ca
    return channel_credentials_from(ca=tls.ca, key=tls.key, cert=tls.cert)


def channel_credentials_from(
    *,
    ca: str | None,
    key: str | None = None,
    cert: str | None = None,
    names: tuple[str, str, str] = ("tls.ca", "tls.key", "tls.cert"),
) -> grpc.ChannelCredentials:
    """Client TLS credentials from whichever files are given (None: grpc's defaults).

    Args:
        ca: the CA bundle that signs the server (None: the system roots).
        key: our private key, for a client certificate.
        cert: our certificate chain.
        names: how error messages name the three files (`tls.ca: cannot read ...`).

    Raises:
        ValueError: a file cannot be read (the message names it).
    """
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, names[0]) if ca else None,
        private_key=read_pem(key, names[1]) if key else None,
        certificate_chain=read_pem(cert, names[2]) if cert else None,
    )


def check_private(path: Path, what: str) -> None:
    """Refuse a secret file that group or other users may read or write.

    Raises:
        ValueError: its mode lets others in (the message says to chmod 600).
    """
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"{what} {str(path)!r} is open to other users (mode {mode:04o}): a token anyone "
            f"on the host can read is anyone's. Run `chmod 600 {path}`"
        )


def read_token(
    token: str | None, token_file: str | None, *, argv_token: str | None = None
) -> str | None:
    """A client's bearer token: `token_file`'s first word, else `token` (from the environment).

    Tokens never come from argv (every local user sees argv in `ps`); callers pass
    `$UNBROKEN_TOKEN` (or a conf value that is not argv) as `token`, and the value of a
    hidden, retired `--token` flag as `argv_token`, which is refused. In a token file, blank
    lines and `#` comments are skipped; the first word of the first other line is the token.

    Raises:
        ValueError: a token was given on the command line, the file is missing, open to
            other users or holds no token, or the token is shorter than `MIN_TOKEN`
            characters.
    """
    if argv_token is not None:
        raise ValueError(
            "--token is gone: a token on the command line is visible to every local user "
            f"(ps). Use --token-file PATH or ${TOKEN_ENV}"
        )
    if token_file:
        p = Path(token_file)
        if not p.is_file():
            raise ValueError(f"token file {token_file!r} does not exist (no such file)")
        check_private(p, "token file")
        words = [
            ln.split()[0]
            for ln in p.read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")
        ]
        if not words:
            raise ValueError(f"token file {token_file!r} holds no token")
        token = words[0]
    if token and len(token) < MIN_TOKEN:
        raise ValueError(
            f"the bearer token must be at least {MIN_TOKEN} characters "
            "(make one with `openssl rand -hex 32`)"
        )
    return token or None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
