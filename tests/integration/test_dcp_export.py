"""Persisted steps are torch.distributed.checkpoint checkpoints: `dcp.load` reads them.

Real flash saves (`FlashWriter`) of two ranks go through the persister's `write_shard`;
the step directory then loads with plain `dcp.load`, here and in a fresh virtual
environment that has torch but not unbroken.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unbroken.recovery import dcpformat
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.persist import list_persisted, step_dir, write_shard

pytestmark = pytest.mark.integration


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-dcp-", dir="/dev/shm")
    own = FlashOwner(FlashConfig(root=root, job="t"))
    try:
        yield own
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _persist(owner: FlashOwner, url: str, step: int, states: list[dict[str, Any]]) -> str:
    for rank, state in enumerate(states):
        w = FlashWriter(rank, owner)
        w.save({"trainer": state}, step, meta={"layout": {"world": len(states)}}).wait()
        w.close()
        write_shard(owner.newest(rank), url)  # type: ignore[arg-type]
    return step_dir(url, step)


def test_persisted_step_loads_with_dcp(owner: FlashOwner, tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    extra = {
        "b16": torch.randn(5).to(torch.bfloat16),
        "i": torch.arange(9).reshape(3, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    states = [
        {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra, "pos": 40 + r}
        for r in range(2)
    ]
    url = str(tmp_path / "ckpt")
    d = _persist(owner, url, 7, states)
    assert sorted(list_persisted(url)[7]) == [0, 1]  # unbroken's own files stay
    names = {p.name for p in Path(d).iterdir()}
    assert {".metadata", "unbroken.json", "__0_0.distcp", "__1_0.distcp"} <= names

    fresh = _model()
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    fresh(torch.randn(4, 8)).sum().backward()
    opt2.step()  # an optimizer with state to load into
    target: dict[str, Any] = {
        "model": fresh.state_dict(),
        "optim": opt2.state_dict(),
        "extra": {k: torch.zeros_like(v) for k, v in extra.items()},
        "pos": 0,
    }
    dcp.load(target, checkpoint_id=d, no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(target["optim"]["state"][pid][k], v), (pid, k)
    assert target["optim"]["param_groups"][0]["lr"] == 1e-2
    for k, v in extra.items():
        assert target["extra"][k].dtype == v.dtype and torch.equal(target["extra"][k], v), k
    assert target["pos"] == 40  # a value the ranks differ in: the lowest rank's


def test_metadata_waits_for_every_rank(owner: FlashOwner, tmp_path: Path) -> None:
    model = _model()
    url = str(tmp_path / "ckpt")
    w = FlashWriter(0, owner)
    w.save({"trainer": {"model": model.state_dict()}}, 3, meta={"layout": {"world": 2}}).wait()
    w.close()
    write_shard(owner.newest(0), url)  # type: ignore[arg-type]
    d = Path(step_dir(url, 3))
    assert (d / "__0_0.distcp").is_file() and not (d / ".metadata").exists()
    assert not dcpformat.finish(str(d))


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float8"):
        dcpformat.tensor_archive("float8_e4m3fn", (2,), b"\0\0")


@pytest.mark.timeout(240)
def test_fresh_venv_without_unbroken_loads_it(owner: FlashOwner, tmp_path: Path) -> None:
    model = _model()
    url = str(tmp_path / "ckpt")
    d = _persist(owner, url, 5, [{"model": model.state_dict()} for _ in range(2)])
    torch.save(model.state_dict(), tmp_path / "expect.pt")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # torch's own site-packages on the path; its .pth files (unbroken's editable finder)
    # are not processed from a directory added this way
    (site / "torch_only.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import unbroken"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'unbroken'" in probe.stderr
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed.checkpoint as dcp
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        state = {{"model": model.state_dict()}}
        dcp.load(state, checkpoint_id={d!r}, no_dist=True)
        model.load_state_dict(state["model"])
        expect = torch.load({str(tmp_path / "expect.pt")!r})
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in expect.items()), "tensors differ"
        print("loaded", len(got))
        """
    )
    out = subprocess.run([py, "-c", script], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "loaded 4"
