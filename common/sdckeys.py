"""Fingerprint keys of the SDC replay and how two replays are compared (docs/sdc.md).

Shared by the ranks and buddies that compute replays (recovery/statehash.py) and the driver
that compares them (driver/sdc.py), without torch.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

MASK64 = (1 << 64) - 1
#: manifest meta key of a fingerprinted copy: {"step": S, "keys": [[key, [entry names]]],
#: "params": [entry names of the replay's weights]}
SDC_META = "sdc"
#: fingerprint keys that are no replica key: compared with a tolerance, never bitwise
REPLAY_PREFIX = "~"
REPLAY_SS = "~replay.ss"
REPLAY_PROJ = "~replay.proj"
#: how far two devices' replays of the same weights may differ (float32 rounding is ~1e-7;
#: a wrong matmul of relative size 1e-3 moves the sum of squares by 2e-3)
REPLAY_TOL = 1e-4


def float_bits(x: float) -> int:
    """The IEEE-754 bits of float64 `x` as an unsigned 64-bit integer."""
    return int(struct.unpack("<Q", struct.pack("<d", x))[0])


def bits_float(b: int) -> float:
    """The float64 whose IEEE-754 bits are `b`."""
    return float(struct.unpack("<d", struct.pack("<Q", b & MASK64))[0])


def replay_agrees(a: Mapping[str, int], b: Mapping[str, int], tol: float = REPLAY_TOL) -> bool:
    """Whether two replays (fingerprint maps holding REPLAY_SS and REPLAY_PROJ) agree to
    `tol` of their size; True when either has none."""
    if REPLAY_SS not in a or REPLAY_SS not in b:
        return True
    sa, sb = bits_float(a[REPLAY_SS]), bits_float(b[REPLAY_SS])
    pa, pb = bits_float(a.get(REPLAY_PROJ, 0)), bits_float(b.get(REPLAY_PROJ, 0))
    if not all(math.isfinite(v) for v in (sa, sb, pa, pb)):
        return sa == sb and pa == pb  # a NaN or inf on both sides alike
    scale = max(abs(sa), abs(sb))
    return abs(sa - sb) <= tol * scale and abs(pa - pb) <= tol * math.sqrt(scale) * 4
