"""The adapters' common core without an agent, and the adapter registry.

No agent answers here (the socket names nothing), so the hooks SDK is a no-op and what is
left is what a job sees at its first start: a DCP checkpoint as the starting point (one
`dcp.save` wrote, as torchtitan does), the data position, the rollback's skip.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unbroken.trainer import adapters, hooks
from unbroken.trainer.adapters.core import Resilient, RestorePoint

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("UNBROKEN_AGENT_SOCKET", str(tmp_path / "nobody.sock"))
    for var in ("UNBROKEN_RESTORE_STEP", "UNBROKEN_SKIP_BATCHES"):
        monkeypatch.delenv(var, raising=False)
    hooks.reset()
    yield
    hooks.reset()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))


def test_starts_from_a_dcp_checkpoint(tmp_path: Path) -> None:
    src = _model(1)
    opt = torch.optim.SGD(src.parameters(), lr=0.5)
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    dst = _model(2)
    opt2 = torch.optim.SGD(dst.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="no agent"):
        core = Resilient({"model": dst, "opt": opt2}, init_from=tmp_path / "ck")
        assert core.restore() == 0  # weights only: the steps start at the beginning
    assert core.restored_from == "dcp"
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert opt2.param_groups[0]["lr"] == 0.1  # not in the checkpoint: kept
    del opt


def test_a_dcp_checkpoint_without_the_state_keys_is_refused(tmp_path: Path) -> None:
    dcp.save({"other": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="holds none"):
        Resilient({"model": _model(0)}, init_from=tmp_path / "ck").restore()


def test_steps_and_the_rollback_skip_move_the_data_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UNBROKEN_SKIP_BATCHES", "3:5")
    with pytest.warns(RuntimeWarning):
        core = Resilient({"model": _model(0)})
        assert core.point == RestorePoint(step=None, skip_from_step=3, skip_batches=5)
        assert core.restore() == 0 and core.position == 0
        assert not core.step_end(1, torch.tensor(2.0))
        assert not core.step_end(2, 1.5)  # the next step is 3: skip 5 batches before it
    assert (core.step, core.position) == (2, 7)


def test_own_keys_and_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unbroken"):
        Resilient({"unbroken": 1})
    with pytest.raises(ValueError, match="save_every"):
        Resilient({}, save_every=0)


def test_registry_lists_the_adapters() -> None:
    names = adapters.available()
    assert {"accelerate", "lightning", "torchtitan", "transformers"} <= set(names), names
    with pytest.raises(ValueError, match="no adapter named"):
        adapters.load("nope")
    if importlib.util.find_spec("accelerate") is not None:
        from unbroken.trainer.adapters.accelerate import Unbroken

        assert adapters.load("accelerate") is Unbroken
    if importlib.util.find_spec("torchtitan") is not None:
        from unbroken.trainer.adapters.torchtitan import Unbroken as TitanUnbroken

        assert adapters.load("torchtitan") is TitanUnbroken


def test_an_injected_loss_spike_poisons_one_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unbroken.common.faults import WorkerFault

    fault_file = tmp_path / "fault.json"
    monkeypatch.setenv("UNBROKEN_FAULT_FILE", str(fault_file))
    hooks.reset()
    model = _model(3)
    x = torch.ones(2, 4)
    clean = model(x).detach()
    WorkerFault("loss-spike", 5, "f1").write(fault_file)
    ub = Resilient({"model": model})
    ub.step_begin(4, model)  # not yet
    assert torch.equal(model(x), clean)
    ub.step_begin(5, model)
    assert torch.allclose(model(x), clean * 1000.0)  # the output layer, scaled
    ub.step_end(5, 1.0)
    assert torch.equal(model(x), clean)  # one step only
    ub.step_begin(6, model)
    assert torch.equal(model(x), clean)  # applied once
    hooks.reset()  # a restarted worker: the applied id is remembered beside the file
    assert hooks.injected_fault(7) is None
    WorkerFault("nan", 0, "f2").write(fault_file)
    ub.step_begin(8, model)
    assert torch.isnan(model(x)).all()
    ub.fault_end()


def test_without_a_fault_file_no_fault_is_due() -> None:
    assert hooks.injected_fault(1) is None
    assert hooks.restored_source() == ""


def test_lightning_skips_the_rest_of_an_epoch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollback's skip that falls due mid-run and is longer than the epoch's rest ends that
    epoch; the next epochs give all their batches (the step the skip was for gets the next
    epoch's first batch), they do not each end at once."""
    pytest.importorskip("lightning")
    from torch.utils.data import TensorDataset

    from unbroken.trainer.adapters.lightning import ResumableDataLoader, Unbroken

    monkeypatch.setenv("UNBROKEN_RESTORE_STEP", "47")
    monkeypatch.setenv("UNBROKEN_SKIP_BATCHES", "50:200")
    ub = Unbroken()
    ub.core = Resilient({}, rng=False)
    assert ub.core.point == RestorePoint(step=47, skip_from_step=50, skip_batches=200)
    ub.feed_step, ub.restored_step = 48, 47  # as `setup` leaves them after the restore
    loader = ResumableDataLoader(TensorDataset(torch.arange(8)), batch_size=1, unbroken=ub)
    first = [int(b[0]) for (b,) in loader]
    assert first == [0, 1]  # steps 48 and 49; step 50's skip ran past the epoch's end
    for _ in range(2):
        assert [int(b[0]) for (b,) in loader] == list(range(8))
    assert ub.feed_step == 50 + 16
