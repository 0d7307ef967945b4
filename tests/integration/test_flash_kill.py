"""A worker SIGKILLed mid-save restores from its agent's shared memory and continues exactly.

Real processes: the test (standing in for the agent) owns the flash store; a worker
process trains a small model with dropout (so the RNG state matters), flash-saves after
every step, and SIGKILLs itself in the middle of copying step 4. The owner then finds
step 3 intact and step 4 invalid; a restarted worker restores step 3 from memory,
resumes at step 4, and its losses equal an uninterrupted run's exactly. Run twice: with
synchronous saves, and with overlapped ones (`save_async` + the optimizer guard), where the
kill lands on the writer's copy thread while the main thread runs the next step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = 8
KILL_AT = 4
REPO = Path(__file__).resolve().parents[2]


def worker_main(root: str, out: str, kill_at: int, restore: bool, overlap: bool = False) -> None:
    """One training worker (run in a subprocess)."""
    import torch

    from unbroken.recovery.flash import FlashWriter
    from unbroken.recovery.flashowner import FlashConfig, FlashOwner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 16)).sum().backward()  # materialise AdamW state for an in-place load
    opt.step()
    opt.zero_grad()
    torch.manual_seed(1)
    current = {"step": 0}

    def hook(i: int) -> None:
        if current["step"] == kill_at and i == 2:
            Path(out + ".killer").write_text(threading.current_thread().name)
            os.kill(os.getpid(), signal.SIGKILL)

    # The provider would be the agent over its hook socket; here the same files directly.
    writer = FlashWriter(0, FlashOwner(FlashConfig(root=root, job="kill")), progress_hook=hook)
    if overlap:
        writer.guard([opt])

    def state() -> dict[str, object]:
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "data": {"step": current["step"]},
            "rng": torch.get_rng_state(),
        }

    start = 0
    if restore:
        sd = state()
        manifest = writer.load(sd)
        model.load_state_dict(sd["model"])  # type: ignore[arg-type]
        opt.load_state_dict(sd["optim"])  # type: ignore[arg-type]
        torch.set_rng_state(sd["rng"])  # type: ignore[arg-type]
        start = sd["data"]["step"]  # type: ignore[index]
        assert start == manifest.step
    losses = {}
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)  # deterministic data by position
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        Path(out).write_text(json.dumps(losses))
        current["step"] = step
        if overlap:  # the copy overlaps the next step's forward/backward
            writer.save_async(state(), step)
            if step == kill_at:
                # This model's next forward/backward takes ~0.3 ms: on a loaded machine the
                # optimizer guard reached the copy first and took it over (as designed), and
                # the kill landed on the main thread (a CI run). Let the copy thread start.
                time.sleep(0.5)
        else:  # the checksum/manifest finish in the background
            writer.save(state(), step)
    writer.close()


def _spawn(
    root: str, out: Path, kill_at: int, restore: bool, overlap: bool
) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from tests.integration.test_flash_kill import worker_main; "
        "worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1', "
        "sys.argv[5] == '1')"
    )
    flags = ["1" if restore else "0", "1" if overlap else "0"]
    args = [sys.executable, "-c", code, root, str(out), str(kill_at), *flags]
    from unbroken.recovery.flash import IDLE_THREADS_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # The copy and checksum threads at normal priority: at idle priority (the default) a
    # loaded machine may leave the copy to the training thread (which takes it over) and
    # the older copies' manifests to later, and this test is about a kill inside the copy
    # thread with every earlier copy complete (test_flash_store covers the take-over).
    env[IDLE_THREADS_ENV] = "0"
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_sigkilled_worker_restores_from_memory_and_matches_exactly(
    shm: str, tmp_path: Path, overlap: bool
) -> None:
    from unbroken.recovery.flashowner import FlashConfig, FlashOwner

    ref_root = tempfile.mkdtemp(prefix="ub-kill-ref-", dir="/dev/shm")
    try:  # the uninterrupted reference run needs no process of its own
        worker_main(ref_root, str(tmp_path / "ref.json"), kill_at=-1, restore=False)
    finally:
        shutil.rmtree(ref_root, ignore_errors=True)
    reference = json.loads((tmp_path / "ref.json").read_text())

    killed = _spawn(shm, tmp_path / "killed.json", kill_at=KILL_AT, restore=False, overlap=overlap)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    killer = (tmp_path / "killed.json.killer").read_text()
    assert killer.startswith("flash-") if overlap else killer == "MainThread"

    owner = FlashOwner(FlashConfig(root=shm, job="kill"))
    copies = owner.copies()[0]
    # The step being copied when the worker died has no manifest; the ones before it (the
    # ring holds up to 8 copies of a state this small) are intact, and every slot's memory
    # outlived the process.
    assert [c.manifest.step for c in copies] == list(range(KILL_AT - 1, 0, -1))
    assert all((owner.rank_dir(0) / f"slot-{s}.data").exists() for s in range(KILL_AT))

    restarted = _spawn(shm, tmp_path / "restarted.json", kill_at=-1, restore=True, overlap=overlap)
    assert restarted.returncode == 0, restarted.stderr
    resumed = json.loads((tmp_path / "restarted.json").read_text())
    assert sorted(int(s) for s in resumed) == list(range(KILL_AT, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == reference[step], (step, loss, reference[step])
