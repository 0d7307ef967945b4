"""Flash copies of CUDA state: pinned slots, the side-stream copy, the optimizer guard.

These need a CUDA GPU and skip without one (CI has none): run them on a GPU machine with
`.venv/bin/python -m pytest tests/gpu`. They check what the CPU tests cannot: that
`prepare` registers the first slots as pinned memory, that a copy of GPU state reads the values
of the step it was taken after even when the next optimizer step is enqueued at once (the
race the guard's device-side wait prevents), and that a copy restores into GPU tensors.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import find_copy, read_copy, tensor_view
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.flashplan import Snapshot
from unbroken.recovery.flashring import EAGER_SLOTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Large enough that a device-to-host copy takes milliseconds: an unordered write would
# land while it runs.
BIG = 64 << 20  # floats: 256 MB


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-gpu-", dir="/dev/shm")
    own = FlashOwner(FlashConfig(root=root, job="gpu"))
    try:
        yield own
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _host_copy(owner: FlashOwner, step: int) -> dict[str, torch.Tensor]:
    """The tensors of rank 0's copy of `step`, read back from shared memory."""
    ref = find_copy(owner.rank_dir(0), step)
    data = read_copy(ref)
    try:
        return {e.fqn: tensor_view(data, e).clone() for e in ref.manifest.entries if e.nbytes}
    finally:
        data.close()


def test_prepare_pins_every_slot_and_a_copy_restores_into_gpu_tensors(owner: FlashOwner) -> None:
    dev = torch.device("cuda", 0)
    state: dict[str, Any] = {
        "w": torch.randn(1024, 1024, device=dev),
        "b16": torch.randn(4096, device=dev).to(torch.bfloat16),
        "cpu_step": torch.tensor(7.0),  # AdamW keeps `step` on the CPU: a mixed state
        "step": 7,
    }
    writer = FlashWriter(0, owner)
    try:
        writer.prepare(state)
        assert writer.copies >= 2
        # the slots the next saves take are registered (CUDA sees the pages as pinned);
        # the rest of the ring is mapped in the background and registered at first use
        for slot in range(EAGER_SLOTS):
            view = torch.frombuffer(writer.ring.map(slot), dtype=torch.uint8, count=16)
            assert view.is_pinned()
        writer.save(state, 7).wait()
        back = {
            "w": torch.zeros_like(state["w"]),
            "b16": torch.zeros_like(state["b16"]),
            "cpu_step": torch.tensor(0.0),
            "step": 0,
        }
        manifest = writer.load(back)
        assert manifest.step == 7
        assert back["w"].is_cuda and torch.equal(back["w"], state["w"])
        assert torch.equal(back["b16"], state["b16"])
        assert back["cpu_step"].item() == 7.0 and back["step"] == 7
    finally:
        writer.close()


def test_async_copy_reads_the_saved_step_although_the_next_update_is_enqueued_at_once(
    owner: FlashOwner,
) -> None:
    """save_async returns before the device has copied; the optimizer guard makes the next
    in-place update wait for the copy on the device, so each copy holds its own step."""
    dev = torch.device("cuda", 0)
    p = torch.nn.Parameter(torch.zeros(BIG, device=dev))
    opt = torch.optim.SGD([p], lr=1.0)
    writer = FlashWriter(0, owner)
    guards = writer.guard([opt])
    try:
        writer.prepare({"p": p.detach()})
        steps = 4
        handles = []
        for step in range(1, steps + 1):
            p.grad = torch.full_like(p, -1.0)
            opt.step()  # p == step everywhere, enqueued behind the previous copy
            snap = Snapshot(key="p", full=lambda: {"p": p.detach()}, fresh=lambda: {})
            h = writer.save_async(snap, step, meta={"persist": False})
            assert h is not None
            handles.append(h)
        for h in handles:
            h.wait()
        torch.cuda.synchronize()
        assert float(p.detach()[0]) == steps
        # The ring keeps at least the newest two copies; each is exactly its step.
        for step in (steps - 1, steps):
            got = _host_copy(owner, step)["p"]
            assert torch.all(got == float(step)), f"copy of step {step} is torn"
        assert max(h.blocked_s for h in handles) < 0.5  # the host never waited for a copy
    finally:
        for g in guards:
            g.remove()
        writer.close()


def test_a_larger_state_re_reserves_and_pins_the_new_slots(owner: FlashOwner) -> None:
    """Growing the state maps new slots: the old registrations go first (a new mapping at
    the same address would otherwise be refused as registered already)."""
    dev = torch.device("cuda", 0)
    writer = FlashWriter(0, owner)
    try:
        small = {"w": torch.randn(1 << 16, device=dev)}
        writer.prepare(small)
        writer.save(small, 1).wait()
        big = {"w": torch.randn(1 << 24, device=dev)}
        writer.save(big, 2).wait()
        # The new slot the save took is pinned (registering it again had failed without
        # the old registration's removal); the others are pinned when first used.
        assert writer._cuda.registered == {1}
        assert torch.frombuffer(writer.ring.map(1), dtype=torch.uint8, count=16).is_pinned()
        assert torch.equal(_host_copy(owner, 2)["w"], big["w"].cpu())
    finally:
        writer.close()
