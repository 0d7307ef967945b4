"""Silent data corruption: the fingerprint hash, the driver's judge and book, the fold and
the machine's rollback to a verified step (docs/sdc.md)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.machine_harness import Sim, checkpoint, job
from unbroken.common.faults import SDC, RuntimeFault, SdcDetail, WorkerFault
from unbroken.driver import machine as m
from unbroken.driver import sdc as sdclib
from unbroken.proto import events_pb2 as ev
from unbroken.recovery import statehash
from unbroken.trainer import sdc

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- the hash
def test_every_single_bit_flip_changes_the_hash() -> None:
    rng = random.Random(7)
    t = torch.randn(3000)
    h0 = int(sdc.tensor_hash(t))
    for _ in range(500):
        u = t.clone()
        i, b = rng.randrange(u.numel()), rng.randrange(32)
        words = u.view(torch.int32)
        words[i] ^= torch.tensor(1 << b if b < 31 else -(1 << 31), dtype=torch.int32)
        assert int(sdc.tensor_hash(u)) != h0, (i, b)


def test_the_hash_does_not_depend_on_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(5000)
    whole = int(sdc.tensor_hash(t))
    monkeypatch.setattr(statehash, "CHUNK", 333)
    assert int(sdc.tensor_hash(t)) == whole
    # a swap of two words changes it too (the weights are positional)
    u = t.clone()
    u[[0, 1]] = u[[1, 0]]
    assert int(sdc.tensor_hash(u)) != whole


def test_flip_bit_changes_one_bit_of_the_named_tensor() -> None:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()

    class T:
        def __init__(self) -> None:
            self.optimizers = [opt]

    fp = sdc.Fingerprinter(T())
    before = fp.compute()
    w0 = model.weight.detach().clone()
    what, _ = sdc.flip_bit(T(), tensor="o0.g0.p0", bit=3, seed=1)
    assert what.startswith("o0.g0.p0[") and what.endswith("bit 3")
    diff = (w0.view(torch.int32) ^ model.weight.detach().view(torch.int32)).view(-1)
    assert int((diff != 0).sum()) == 1 and int(diff[diff != 0][0]) == 8
    after = fp.compute()
    assert after["all"] != before["all"] and after[sdc.PROBE_KEY] == before[sdc.PROBE_KEY]
    sdc.flip_bit(T(), target="optim", seed=2)
    assert fp.compute()["all"] != after["all"]
    with pytest.raises(ValueError, match="no 32-bit state tensor"):
        sdc.flip_bit(T(), tensor="nothing-like-it")


def test_a_matmul_fault_changes_the_probe_until_turned_off() -> None:
    clean = int(sdc.probe(torch.device("cpu")))
    fault = sdc.MatmulFault()
    fault.set(1e-3)
    try:
        assert int(sdc.probe(torch.device("cpu"))) != clean
        x = torch.ones(1, 4)
        lin = torch.nn.Linear(4, 4)
        ref = x @ lin.weight.T + lin.bias
        assert torch.allclose(lin(x), ref * (1 + 1e-3))
    finally:
        fault.set(0.0)
    assert int(sdc.probe(torch.device("cpu"))) == clean


def test_the_sdc_fault_round_trips_through_the_fault_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = WorkerFault(SDC, 7, "x", SdcDetail(local_rank=1, tensor="p3", bit=5, target="param"))
    f.write(tmp_path / "fault.json")
    assert WorkerFault.parse((tmp_path / "fault.json").read_text()) == f
    with pytest.raises(ValueError, match="bit must be 0-31"):
        SdcDetail(bit=32)
    with pytest.raises(ValueError, match="target must be"):
        SdcDetail(target="grads")
    assert RuntimeFault.of("sdc_matmul", sdc=SdcDetail(size=1e-3)).kind == "sdc-matmul"


# ---------------------------------------------------------------- the judge
def fps(**by_key: int) -> dict[str, int]:
    return dict(by_key)


def test_agreeing_replicas_verify_the_step() -> None:
    v = sdclib.judge(10, {0: fps(a=1, probe=9), 1: fps(a=1, probe=9)})
    assert v.verified and not v.disagreed and v.groups == 2


def test_a_rank_whose_state_nobody_else_holds_is_not_verified() -> None:
    """Pure FSDP: every shard key is alone; only the probe is compared."""
    v = sdclib.judge(10, {0: fps(a=1, probe=9), 1: fps(b=2, probe=9)})
    assert not v.verified and not v.disagreed


def test_the_minority_of_three_replicas_is_named() -> None:
    v = sdclib.judge(10, {0: fps(a=1), 1: fps(a=2), 2: fps(a=1)})
    assert v.disagreed and v.suspects == (1,) and v.resolved and not v.verified


def test_two_replicas_that_disagree_are_both_suspects_unresolved() -> None:
    v = sdclib.judge(10, {0: fps(a=1, probe=9), 1: fps(a=2, probe=9)})
    assert v.suspects == (0, 1) and not v.resolved


def test_the_probe_history_names_the_odd_one_of_two() -> None:
    v = sdclib.judge(10, {0: fps(a=1, probe=9), 1: fps(a=2, probe=8)}, probe_ref=9)
    assert v.suspects == (1,) and v.resolved
    # the state tie is broken by the rank the probe named
    assert "another key named" in v.detail


def test_the_book_judges_a_step_once_every_rank_reported() -> None:
    book = sdclib.FingerprintBook(2)
    book.add(0, 5, fps(a=1, probe=9))
    assert book.ready() == []
    book.add(1, 5, fps(a=1, probe=9))
    book.add(1, 5, fps(a=7, probe=9))  # a repeat (the next heartbeat): ignored
    (v,) = book.ready()
    assert v.verified and book.probe_ref == 9
    book.add(0, 5, fps(a=3))  # already judged
    assert book.ready() == [] and not book.pending
    book.add(0, 10, fps(a=1, probe=8))
    book.add(1, 10, fps(a=1, probe=9))
    (v,) = book.ready()
    assert v.suspects == (0,) and v.resolved


def test_the_rollback_target_is_the_newest_verified_held_step_before() -> None:
    assert sdclib.rollback_target(30, [10, 20, 25, 30], [10, 20, 30]) == 20
    assert sdclib.rollback_target(30, [25], [10, 20]) is None


# ---------------------------------------------------------------- fold and machine
def start() -> Sim:
    sim = Sim(m.Policy())
    sim.append(job(nodes=3))
    return sim


def verified(step: int) -> ev.Event:
    return ev.Event(step_verified=ev.StepVerified(step=step, ranks=3, groups=1))


def suspected(step: int, node: str = "n1", memory: tuple[int, ...] = ()) -> ev.Event:
    return ev.Event(
        sdc_suspected=ev.SdcSuspected(
            step=step, suspect_ranks=[1], suspect_nodes=[node], resolved=True,
            memory_steps=list(memory),
        )
    )  # fmt: skip


def test_a_commit_of_a_verified_step_is_marked_verified_either_order() -> None:
    sim = start()
    sim.feed(checkpoint(10))
    sim.feed(verified(10))
    sim.feed(verified(20))
    sim.feed(checkpoint(20))
    sim.feed(checkpoint(30))
    assert [(c.step, c.verified) for c in sim.state.checkpoints] == [
        (10, True),
        (20, True),
        (30, False),
    ]
    assert list(sim.state.verified_steps) == [10, 20]


def test_sdc_rolls_back_to_the_newest_verified_step_before_it() -> None:
    sim = start()
    for step in (10, 20, 30):
        sim.feed(checkpoint(step))
    sim.feed(verified(10))
    sim.feed(verified(15))  # verified but held nowhere (not committed, not in memory)
    d = sim.feed(suspected(40, memory=(38, 39)))
    kinds = [e.WhichOneof("payload") for e in d.events]
    assert kinds == ["sdc_suspected", "rollback", "recovery_transition"]
    rb = d.events[1].rollback
    assert (rb.from_step, rb.to_step, rb.skip_batches) == (40, 10, 0)
    assert "silent data corruption at step 40" in rb.reason
    assert sim.state.sdc_by_node["n1"] == 1 and sim.state.last_sdc_step == 40
    sim.training_step = 41
    d = sim.feed(m.Paused(step=41, restorable_step=41))
    (rs,) = [a for a in d.actions if isinstance(a, m.Restore)]
    assert rs.step == 10
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING and sim.state.step == 10


def test_sdc_with_no_verified_step_held_fails_the_job_with_advice() -> None:
    sim = start()
    sim.feed(checkpoint(30))
    d = sim.feed(suspected(40))
    assert d.phase == ev.PHASE_FAILED
    assert "no verified step before it" in d.events[-1].job_finished.reason


def test_a_node_named_twice_is_diagnosed_and_evicted_when_the_bisection_confirms() -> None:
    sim = start()
    sim.feed(checkpoint(10))
    sim.feed(verified(10))
    sim.feed(suspected(20))
    sim.drive(set())
    assert sim.state.phase == ev.PHASE_RUNNING
    sim.feed(verified(30))
    sim.feed(checkpoint(30))
    d = sim.feed(suspected(40))
    # rolled back to the verified step, and n1 diagnosed before any eviction
    rb = next(e.rollback for e in d.events if e.HasField("rollback"))
    assert rb.to_step == 30 and "diagnosed before an eviction" in rb.reason
    assert list(sim.state.suspects) == ["n1"] and sim.state.needs_diagnosis
    sim.training_step = 41
    sim.progress(set())  # paused
    assert sim.state.restore_step == 30
    sim.drive({"n1"})  # the bisection finds n1 bad
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_EVICTED
    assert sim.state.phase == ev.PHASE_RUNNING and sim.state.step == 30


def test_a_node_named_twice_that_the_bisection_clears_stays_and_is_rolled_back() -> None:
    sim = start()
    sim.feed(checkpoint(10))
    sim.feed(verified(10))
    sim.feed(suspected(20))
    sim.drive(set())
    sim.feed(verified(30))
    sim.feed(checkpoint(30))
    sim.feed(suspected(40))
    sim.training_step = 41
    sim.drive(set())  # the checks pass: nobody evicted, the rollback goes on
    assert sim.state.nodes["n1"].state != ev.NODE_STATE_EVICTED
    assert sim.state.phase == ev.PHASE_RUNNING and sim.state.step == 30
    # named a third time: evicted (a lasting fault the checks do not see)
    sim.feed(verified(50))
    sim.feed(checkpoint(50))
    d = sim.feed(suspected(60))
    assert "rollback" not in [e.WhichOneof("payload") for e in d.events]
    sim.drive(set())
    assert sim.state.nodes["n1"].state == ev.NODE_STATE_EVICTED


@pytest.mark.parametrize("chunk", [statehash.CHUNK, 300])
def test_hashing_many_tensors_together_gives_each_ones_own_hash(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hash_many` (the fingerprint's few kernels for all tensors) equals `tensor_hash` of
    each: float and integer words, odd byte sizes, empty, 0-d, non-contiguous, and groups
    split at `CHUNK` words (300: most tensors alone, one too big for any group)."""
    monkeypatch.setattr(statehash, "CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    tensors = [
        torch.randn(64, 64, generator=g),
        torch.randn(5, generator=g).to(torch.bfloat16),  # 10 bytes: not whole words
        torch.randn(6, generator=g).to(torch.bfloat16),
        torch.tensor(3.0),
        torch.randint(-(2**31), 2**31 - 1, (7, 3), dtype=torch.int32, generator=g),
        torch.empty(0, 4),
        torch.randn(250, generator=g).double(),
        torch.randn(8, 8, generator=g)[:, ::2],
        torch.randn(100, generator=g),
    ]
    together = statehash.hash_many(tensors, torch.device("cpu")).tolist()
    assert together == [int(statehash.tensor_hash(t)) for t in tensors]
