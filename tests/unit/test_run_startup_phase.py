"""A worker says "startup" to its agent before it joins the process group.

The agent judges a rank's hang only once the rank has said something (a phase or a step):
a rank stopped while it joined the group had said nothing and was never judged, so its peers
and the driver's restore waited out their limits (minutes; bench-recovery, session 7: a hang
injected 3 s into a restart stalled the job 80 s). `main` now says "startup" first; a rank
stopped from then on is flagged within STOPPED_AFTER_MS (agent/hang.py, and
tests/integration/test_hang_detect.py for a stopped rank's flag end to end).
"""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.trainer import hookchannel, run

pytestmark = pytest.mark.unit


class _Hooks:
    def __init__(self, said: list[str]) -> None:
        self.said = said

    def phase(self, name: str, step: int | None = None, source: str | None = None) -> bool:
        self.said.append(f"phase:{name}")
        return True


def test_startup_is_said_before_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(hookchannel, "install", lambda **_: _Hooks(said))

    def joined(config: Any) -> bool:
        said.append("init_distributed")
        raise RuntimeError("stop here")

    monkeypatch.setattr(run, "init_distributed", joined)
    with pytest.raises(RuntimeError, match="stop here"):
        run.main(["--preset", "tiny"])
    assert said == ["phase:startup", "init_distributed"]
