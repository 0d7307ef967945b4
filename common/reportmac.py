"""A node's own signature on its shard reports, so a relay that carries them cannot forge them.

A relay forwards its members' messages up its own session (agent/relay.py). Heartbeats
and replies it may drop or forge (SECURITY.md: a relay is trusted with its members'
liveness), but a shard report decides which steps are committed and, through retention,
which are deleted: a relay must not make one up. So at Register (the member's own,
authenticated call) the driver hands each node a fresh random key for its epoch; the node
MACs every shard report with it (`SignedReport`), and the driver counts a report that
came through a relay only when the MAC verifies under that member's key. The relay never
sees the key (it is in the member's RegisterResponse only).
"""

from __future__ import annotations

import hashlib
import hmac

from unbroken.proto import driver_pb2 as dpb

KEY_BYTES = 32


def _mac(key: bytes, epoch: int, payload: bytes) -> bytes:
    head = b"shards\0" + (epoch & (2**64 - 1)).to_bytes(8, "big")
    return hmac.new(key, head + payload, hashlib.sha256).digest()


def sign(key: bytes, epoch: int, shards: dpb.ShardsPersisted) -> dpb.SignedReport:
    """`shards`, serialized and MACed under the node's report key for its `epoch`."""
    payload = shards.SerializeToString()
    return dpb.SignedReport(shards_persisted=payload, mac=_mac(key, epoch, payload))


def verify(key: bytes, epoch: int, report: dpb.SignedReport) -> dpb.ShardsPersisted | None:
    """The shards of `report` when its MAC verifies under `key` and `epoch`; else None."""
    if len(key) != KEY_BYTES or not hmac.compare_digest(
        _mac(key, epoch, report.shards_persisted), report.mac
    ):
        return None
    out = dpb.ShardsPersisted()
    try:
        out.ParseFromString(report.shards_persisted)
    except Exception:  # a MACed payload is the node's own bytes: only a buggy node gets here
        return None
    return out
