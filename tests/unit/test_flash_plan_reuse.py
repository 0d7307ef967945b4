"""A flash save of a plain state dict reuses the last save's plan only when the layout fits,
copies what the state holds at the save, and restores exactly; the fast flattening is
DCP's; a copy becomes valid at the next save even when the writer's thread never runs."""

from __future__ import annotations

import collections
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import find_copy, load_object
from unbroken.recovery.flashowner import FlashConfig, FlashOwner
from unbroken.recovery.flashplan import PlanCache, dump_object, flatten, has_state
from unbroken.trainer import hooks

pytestmark = pytest.mark.unit


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    try:
        yield FlashOwner(FlashConfig(root=root, job="reuse"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 6, generator=g)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of what `state` holds now (its tensors cloned)."""
    flat = flatten(hooks.stateful(state).state_dict())
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# ------------------------------------------------------------------------ flatten


def test_flatten_is_dcps_on_a_real_training_state() -> None:
    model, opt = _model_and_opt()
    _train(model, opt, 1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "progress": {"step": 3, "skipped": 0, "epochs": [1, 2], "pairs": (1, 2.0)},
        "rng": {"cpu": torch.get_rng_state()},
        "listed": [torch.zeros(2), {"a": 1}, [3, 4], [torch.ones(1)]],
        "ordered": collections.OrderedDict(b=torch.ones(2), a=[[1, 2], [3]]),
        7: "an int key",
    }
    ours = flatten(state)
    dcp = flatten_state_dict(state)[0]
    assert list(ours) == list(dcp)
    assert all(ours[k] is dcp[k] for k in ours)


_leaf = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.none(), st.booleans()
)
_tensor = st.integers(0, 3).map(lambda n: torch.arange(n, dtype=torch.float32))
_tree = st.recursive(
    st.one_of(_leaf, _tensor),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.tuples(kids, kids),
        st.dictionaries(st.sampled_from(["a", "b", "0", "x"]), kids, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["m", "o", "p"]), _tree, min_size=1))
def test_flatten_is_dcps_on_any_nesting(state: dict[str, Any]) -> None:
    try:
        dcp = flatten_state_dict(state)[0]
    except ValueError:  # a duplicated key: ours refuses it too
        with pytest.raises(ValueError, match="duplicated flatten key"):
            flatten(state)
        return
    ours = flatten(state)
    assert list(ours) == list(dcp)
    assert all(ours[k] is dcp[k] for k in ours)


def test_flatten_refuses_a_key_two_paths_give() -> None:
    with pytest.raises(ValueError, match=r"duplicated flatten key a\.b"):
        flatten({"a": {"b": 1}, "a.b": 2})


def test_has_state_is_the_runtime_protocol_check() -> None:
    from torch.distributed.checkpoint.stateful import Stateful

    class NoneLoad:
        def state_dict(self) -> dict[str, Any]:
            return {}

        load_state_dict = None

    model, opt = _model_and_opt()
    for v in (model, opt, {}, torch.zeros(1), 3, NoneLoad(), hooks.stateful({})):
        assert has_state(v) == isinstance(v, Stateful), type(v)


# ------------------------------------------------------------------------ small values


def test_bytes_and_long_text_round_trip_through_the_manifest_format() -> None:
    blob = bytes(range(256)) * 8
    text = "x" * 1000 + "\u00e9"
    assert load_object(dump_object(blob)) == blob
    assert load_object(dump_object(text)) == text


# ------------------------------------------------------------------------ plan reuse


def test_a_second_save_of_the_same_layout_reuses_the_plan_with_the_new_tensors() -> None:
    model, opt = _model_and_opt()
    _train(model, opt, 1)
    cache = PlanCache(0)
    state = {"model": model, "optimizer": opt, "step": 1}
    plan1, _, objs1 = cache.take(state)
    _train(model, opt, 2)
    state["step"] = 2
    plan2, sources, objs2 = cache.take(state)
    assert plan2 is plan1 and cache.reused == 1
    now = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for key, i in plan2.index.items():
        assert torch.equal(sources[i], now[key])
    assert load_object(objs2["step"]) == 2 and load_object(objs1["step"]) == 1


def test_a_changed_shape_dtype_or_key_plans_again() -> None:
    cache = PlanCache(0)
    state: dict[str, Any] = {"w": torch.zeros(3), "n": 1}
    first = cache.take(state)[0]
    for changed in (
        {"w": torch.zeros(4), "n": 1},
        {"w": torch.zeros(4, dtype=torch.float64), "n": 1},
        {"w": torch.zeros(4, dtype=torch.float64), "m": 1},
        {"w": torch.zeros(4, dtype=torch.float64), "n": 1, "extra": torch.ones(1)},
        {"w": torch.zeros(4, dtype=torch.float64), "n": torch.ones(1)},
    ):
        plan = cache.take(changed)[0]
        assert plan is not first and cache.reused == 0, changed
        tensors = [k for k, v in changed.items() if torch.is_tensor(v)]
        assert [e.fqn for e in plan.entries] == tensors
        first = plan


def test_a_saved_mutable_value_is_serialised_as_it_is_at_each_save() -> None:
    cache = PlanCache(0)
    positions = [1, 2]
    state = {"w": torch.zeros(2), "positions": positions}
    cache.take(state)
    positions.append(3)  # the same list, changed in place
    objs = cache.take(state)[2]
    assert cache.reused == 1 and load_object(objs["positions"]) == [1, 2, 3]


def _save_then_load(owner: FlashOwner, rounds: list[Any]) -> None:
    """Each item: a callable changing the model before a save; every save's copy must load
    back bitwise equal to the state at that save."""
    model, opt = _model_and_opt()
    state = {"model": model, "optimizer": opt}
    w = FlashWriter(0, owner)
    w.guard([opt])
    _train(model, opt, 0)
    expected: dict[int, dict[str, Any]] = {}
    for step, change in enumerate(rounds, start=1):
        _train(model, opt, step)
        change(model)
        expected[step] = _snapshot(state)
        h = w.save_async({"trainer": hooks.stateful(state)}, step)
        assert h is not None
        h.wait()
        # what the next steps do to the tensors must not reach this copy
        fresh_model, fresh_opt = _model_and_opt(seed=99)
        _train(fresh_model, fresh_opt, 0)
        target = {"model": fresh_model, "optimizer": fresh_opt}
        w.load({"trainer": hooks.stateful(target, loading=True)}, step)
        _assert_bitwise(_snapshot(target), expected[step])
    w.close()
    assert find_copy(owner.rank_dir(0)).manifest.step == len(rounds)


def test_saves_that_reuse_the_plan_restore_exactly(owner: FlashOwner) -> None:
    _save_then_load(owner, [lambda m: None] * 4)


def test_a_replaced_parameter_is_copied_from_where_it_is_now(owner: FlashOwner) -> None:
    def replace_attr(m: torch.nn.Module) -> None:  # a new Parameter object
        m[0].bias = torch.nn.Parameter(torch.full_like(m[0].bias, 7.0))

    def replace_data(m: torch.nn.Module) -> None:  # the same object, another storage
        m[3].weight.data = torch.full_like(m[3].weight, -3.0)

    _save_then_load(owner, [lambda m: None, replace_attr, replace_data, lambda m: None])


def test_a_reshaped_parameter_plans_again(owner: FlashOwner) -> None:
    model, _ = _model_and_opt()
    w = FlashWriter(0, owner)
    state = {"model": model}
    w.save_async({"trainer": hooks.stateful(state)}, 1).wait()  # type: ignore[union-attr]
    model[3].weight.data = torch.ones(5, 8)  # the same Parameter, another shape
    h = w.save_async({"trainer": hooks.stateful(state)}, 2)
    assert h is not None
    manifest = h.wait()
    entry = next(e for e in manifest.entries if e.fqn == "trainer.model.3.weight")
    assert entry.shape == (5, 8) and w._plans.reused == 0
    w.close()


def test_the_previous_copy_is_valid_at_the_next_save_without_the_writer_thread(
    owner: FlashOwner,
) -> None:
    """On a node without a spare core the idle-priority writer thread may not run at all:
    the next save writes the previous copy's manifest, so the newest valid copy is one
    save old, not a ring's length."""
    model, opt = _model_and_opt()
    state = {"model": model, "optimizer": opt}
    w = FlashWriter(0, owner)
    w.guard([opt])
    release = threading.Event()
    w._pool.submit(release.wait, 30)  # the writer's thread is busy: it starts nothing
    try:
        _train(model, opt, 1)
        first = w.save_async({"trainer": hooks.stateful(state)}, 1)
        assert first is not None and not first.done()
        _train(model, opt, 2)  # the optimizer's guard copies the first save's tensors
        assert first.copied() and not first.done()
        w.save_async({"trainer": hooks.stateful(state)}, 2)
        assert first.done()
        assert find_copy(owner.rank_dir(0)).manifest.step == 1
    finally:
        release.set()
    w.close()
    assert find_copy(owner.rank_dir(0)).manifest.step == 2


def _offset_as(rank: int) -> tuple[int, ...]:
    """The global offset a flash save records for rank `rank`'s shard of a dp2 DTensor, in
    torch's fake 2-rank world (its meshes equal a real world's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unbroken.recovery.flashplan import _global_layout, local_tensor

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        t = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        _shape, offset = _global_layout("w", t, local_tensor(t))
        return offset
    finally:
        dist.destroy_process_group()


def test_a_shards_offset_follows_the_ranks_place_in_an_equal_mesh() -> None:
    """A survivor that rejoins a world whose mesh equals its old one (same shape and names:
    DeviceMesh compares no more) at another place records its new shard's offset: with the
    layout cached by mesh alone, rank 1 of dp2 that became rank 0 of a later dp2 world saved
    its copies as the second half, and the next reshard loaded that half twice."""
    assert _offset_as(1) == (4, 0)
    assert _offset_as(0) == (0, 0)  # the same process, the same equal mesh, another place
    assert _offset_as(1) == (4, 0)
