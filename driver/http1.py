"""HTTP/1.1 on the wire for the dashboard: parse a request head, build a response.

The dashboard answers GET and HEAD only and reads no bodies, so this is the whole of
HTTP it needs: a request line and headers in (bounded by `MAX_HEAD`), a complete
response with the security headers out. No framework, no dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

MAX_HEAD = 16 * 1024  # bytes of request line + headers
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),  # the token may be in the URL
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:"),
    ("Cache-Control", "no-store"),
)
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class HttpError(Exception):
    """A request the server answers with an error status (and then closes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Request:
    """One parsed request head (the dashboard reads no bodies)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Parse an HTTP/1.x request head (request line and headers, CRLF-terminated).

    Raises:
        HttpError: malformed, not HTTP/1.x, or carrying a body.
    """
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as e:  # pragma: no cover - latin-1 decodes any byte
        raise HttpError(400, "request head is not latin-1") from e
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"bad request line {lines[0][:80]!r}; expected 'GET /path HTTP/1.1'")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"bad header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    if headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers:
        raise HttpError(400, "request bodies are not accepted (the dashboard is read-only)")
    url = urlsplit(target)
    conn = headers.get("connection", "").lower()
    keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return Request(
        method=method,
        path=unquote(url.path),
        query=parse_qs(url.query),
        headers=headers,
        keep_alive=keep,
    )


def response_bytes(
    status: int,
    body: bytes,
    content_type: str,
    *,
    keep_alive: bool,
    head_only: bool = False,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A complete HTTP/1.1 response."""
    lines = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        *(f"{k}: {v}" for k, v in SECURITY_HEADERS),
        *(f"{k}: {v}" for k, v in extra),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)
