"""Principals (`role:name`) as certificates carry them: shared by the driver, which
issues and checks them, and the agent, which checks its driver's."""

from __future__ import annotations

import re
from collections.abc import Iterable

ROLES = ("node", "operator", "launcher", "driver", "viewer")
SERVING_ROLES = ("driver", "node")  # a node serves its replica port (and a relay)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_principal(text: str) -> tuple[str, str]:
    """`role:name` -> (role, name); ValueError naming the allowed roles otherwise."""
    role, sep, name = text.partition(":")
    if not sep or role not in ROLES or not _NAME.match(name):
        raise ValueError(
            f"principal {text!r} must be ROLE:NAME with ROLE one of {', '.join(ROLES)} and NAME "
            "letters, digits, '.', '_' or '-' (e.g. node:gpu-017, operator:alice)"
        )
    return role, name


def principal_of_san(values: Iterable[str | bytes]) -> str | None:
    """The first `role:name` among subjectAltName values (URIs; DNS names as a fallback)."""
    for v in values:
        s = v.decode(errors="replace") if isinstance(v, bytes) else v
        try:
            parse_principal(s)
        except ValueError:
            continue
        return s
    return None


def principal_of_peercert(cert: dict | None) -> str | None:
    """The principal in a certificate as Python's `ssl` reports it (`getpeercert()`)."""
    if not cert:
        return None
    sans = cert.get("subjectAltName", ())
    return principal_of_san([v for k, v in sans if k == "URI"] + [v for k, v in sans if k == "DNS"])
