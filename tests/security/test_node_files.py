"""Attacks on the node's flash store by another local user (`nobody`).

- reading a rank's weights from the flash copies in /dev/shm;
- planting the predictable flash root (a directory of theirs, or a symlink to a victim
  directory) before the agent starts: the agent must refuse it and delete nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.security.nobody import NOBODY_GID, NOBODY_UID, as_nobody
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner, UnsafeFlashRootError

pytestmark = pytest.mark.integration


@pytest.fixture
def shm() -> Iterator[Path]:
    """A /dev/shm folder standing for /dev/shm/unbroken (sticky parent, like the real one)."""
    d = Path(f"/dev/shm/ub-sec-files-{os.getpid()}")
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_flash_copies_are_closed_to_other_users(shm: Path) -> None:
    owner = FlashOwner(FlashConfig(root=str(shm / "node-a"), job="j"))
    w = FlashWriter(0, owner)
    w.save({"w": torch.full((1024,), 3.0)}, 1).wait()  # type: ignore[union-attr]
    w.close()
    ref = owner.newest(0)
    assert ref is not None
    for p in [shm / "node-a", owner.job_dir, *owner.job_dir.rglob("*")]:
        mode = p.stat().st_mode & 0o777
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    data = str(ref.data_path)
    got = as_nobody("read", data)
    assert got.startswith("PermissionError"), got


def _agent(flash_dir: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """`unbroken agent` with workers, flash at `flash_dir`, no driver to reach."""
    cmd = [
        sys.executable, "-m", "unbroken.cli", "agent", "--driver", "127.0.0.1:1",
        "--node-id", "node-a", "--worker-cmd", "true", "--no-start", "--no-selfcheck",
        "--flash-dir", str(flash_dir), "--log-dir", str(tmp / "logs"),
        "--persist-url", str(tmp / "storage"),
        "--socket", str(tmp / "a.sock"), "--max-disconnected-s", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_a_planted_symlink_root_is_refused_and_nothing_deleted(shm: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    (victim / "default").mkdir(parents=True)
    (victim / "default" / "precious.txt").write_text("keep me")
    (shm / "node-a").symlink_to(victim)  # what the attacker planted
    out = _agent(shm / "node-a", tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "symlink" in out.stderr and "Traceback" not in out.stderr
    assert (victim / "default" / "precious.txt").read_text() == "keep me"
    with pytest.raises(UnsafeFlashRootError, match="symlink"):
        FlashOwner(FlashConfig(root=str(shm / "node-a"), job="default"))


def test_a_root_owned_by_another_user_is_refused(shm: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to nobody")
    planted = shm / "node-a"
    planted.mkdir(mode=0o777)
    os.chown(planted, NOBODY_UID, NOBODY_GID)
    out = _agent(planted, tmp_path)
    assert out.returncode == 2 and "belongs to uid" in out.stderr, out.stderr[-2000:]
    assert list(planted.iterdir()) == []  # the agent wrote nothing into it
    # and a directory of nobody's above the root: they could swap the root out
    os.chown(shm, NOBODY_UID, NOBODY_GID)
    with pytest.raises(UnsafeFlashRootError, match="could replace it"):
        FlashOwner(FlashConfig(root=str(shm / "node-b"), job="j"))
    os.chown(shm, 0, 0)
    shutil.rmtree(planted)
