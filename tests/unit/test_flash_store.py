"""Flash store: save/load, double buffering, corruption, persistence, source fallback."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from unbroken.common.workerenv import TIMELINE as ENV_TIMELINE
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import (
    UNSEALED,
    CorruptCopyError,
    NoCopyError,
    ShmTooSmallError,
    checksum,
    find_copy,
    list_copies,
    manifest_path,
    open_copy,
    read_copy,
    read_persisted_mark,
    replica_store,
    seal,
    slots,
    write_keep_mark,
    write_raw_copy,
)
from unbroken.recovery.flashowner import MAX_AUTO_COPIES, FlashConfig, FlashOwner
from unbroken.recovery.flashring import WriterRing
from unbroken.recovery.persist import (
    PERSIST_META,
    TIMELINE_META,
    CommitTracker,
    PersistConfig,
    Persisted,
    Persister,
    apply_retention,
    current_timeline,
    discard_after,
    list_persisted,
    persistable,
    read_shard,
    write_shard,
)
from unbroken.recovery.reshard import load_resharded
from unbroken.recovery.restore import Source, decide
from unbroken.recovery.sources import obtain, survey

pytestmark = pytest.mark.unit


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    own = FlashOwner(FlashConfig(root=root, job="t"))
    try:
        yield own
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g),
            "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 100, (3, 3), generator=g),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(float(seed)),
        },
        "optim": {"param_groups": [{"lr": 0.1 * seed, "params": [0, 1]}]},
        "data": {"position": seed * 10, "epoch": 1},
        "rng": torch.get_rng_state(),
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return None

    return z(sd)


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_save_load_roundtrip_keeps_dtypes_and_values(owner: FlashOwner) -> None:
    w = FlashWriter(0, owner)
    sd = _state(3)
    m = w.save(sd, step=7, meta={"dp": 1}).wait()
    assert (m.step, m.rank, m.meta["dp"]) == (7, 0, 1)
    target = _zeros_like(sd)
    assert w.load(target).step == 7
    _assert_same(sd, target)
    w.close()


def test_a_load_decodes_each_distinct_small_value_once_and_shares_no_mutable_one(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optimizer's param-group values are one key per parameter, mostly equal: a restore
    decodes each distinct immutable value once; a list or dict is decoded for each key, so
    two keys never share one object."""
    from unbroken.recovery import flash

    sd: dict[str, Any] = {"w": torch.arange(4.0), "lists": {}}
    sd.update({f"lr{i}": 0.001 for i in range(50)})
    sd["lists"] = {f"p{i}": [1, 2] for i in range(3)}
    w = FlashWriter(0, owner)
    w.save(sd, step=1).wait()
    calls: list[bytes] = []
    real = flash.load_object

    def counting(raw: bytes) -> Any:
        calls.append(raw)
        return real(raw)

    monkeypatch.setattr(flash, "load_object", counting)
    target: dict[str, Any] = {"w": torch.zeros(4), "lists": {f"p{i}": None for i in range(3)}}
    target.update({f"lr{i}": 0.0 for i in range(50)})
    w.load(target)
    _assert_same(sd, target)
    assert len(calls) == 1 + 3  # the learning rate once, each list for its own key
    lists = list(target["lists"].values())
    assert lists[0] is not lists[1] and lists[1] is not lists[2]
    w.close()


def test_ring_keeps_previous_copies_and_cycles_slots(owner: FlashOwner) -> None:
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="ring3", copies=3))
    w = FlashWriter(0, owner)
    slots = []
    for step in (1, 2, 3, 4):
        w.save(_state(step), step).wait()
        slots.append(owner.newest(0).slot)  # type: ignore[union-attr]
    assert w.copies == 3
    assert slots == [0, 1, 2, 0]
    assert [r.manifest.step for r in list_copies(owner.rank_dir(0))] == [4, 3, 2]
    target = _zeros_like(_state(0))
    w.load(target, step=2)
    _assert_same(_state(2), target)
    w.close()


def test_a_copy_awaiting_persistence_keeps_its_slot_until_the_agent_marks_it(
    owner: FlashOwner,
) -> None:
    """The newest copy marked for persistence is pinned: memory-only saves cycle through
    the other slots until the agent's persisted mark names its generation."""
    from unbroken.recovery.flashcopy import write_persisted_mark

    owner = FlashOwner(FlashConfig(root=owner.config.root, job="pin", copies=4))
    w = FlashWriter(0, owner)
    rank_dir = owner.rank_dir(0)
    first = w.save(_state(1), 1).wait()  # marked for persistence (the default)
    slots = []
    for step in range(2, 7):
        w.save(_state(step), step, meta={PERSIST_META: False}).wait()
        slots.append(owner.newest(0).slot)  # type: ignore[union-attr]
    assert slots == [1, 2, 3, 1, 2]  # slot 0 (step 1) is never reused
    assert 1 in [r.manifest.step for r in list_copies(rank_dir)]
    write_persisted_mark(rank_dir, first.generation)
    for step in (7, 8):
        w.save(_state(step), step, meta={PERSIST_META: False}).wait()
    assert 1 not in [r.manifest.step for r in list_copies(rank_dir)]  # released, reused
    w.close()


def _steps(rank_dir: Path) -> list[int]:
    return [r.manifest.step for r in list_copies(rank_dir)]


def test_the_agents_keep_mark_spares_the_verified_copies_while_the_ring_cycles(
    owner: FlashOwner,
) -> None:
    """`RingKeep` (docs/sdc.md): the agent marks the newest verified step's copy with the
    one it marked before; the worker's saves pass over both however many steps follow, a
    verified step whose copy is already gone leaves the older mark, and a newer one
    releases the oldest."""
    from unbroken.agent.flash import NodeFlash, NodeFlashConfig

    root = owner.config.root
    agent = NodeFlash(NodeFlashConfig(root=root, job="keep", node="n0", copies=6), 1)
    w = FlashWriter(0, agent.owner)
    rank_dir = agent.owner.rank_dir(0)
    no_persist = {PERSIST_META: False}
    for step in range(1, 6):
        w.save(_state(step), step, meta=no_persist).wait()
    assert agent.keep([5]) == {0: [5]}
    for step in range(6, 11):
        w.save(_state(step), step, meta=no_persist).wait()
    assert agent.keep([10]) == {0: [10, 5]}
    for step in range(11, 40):
        w.save(_state(step), step, meta=no_persist).wait()
    held = _steps(rank_dir)
    assert 5 in held and 10 in held and held[:4] == [39, 38, 37, 36], held
    assert agent.keep([2]) == {0: [10, 5]}  # step 2's copy is long gone: the marks stay
    assert agent.keep([38]) == {0: [38, 10]}  # a newer verified step releases step 5
    for step in range(40, 46):
        w.save(_state(step), step, meta=no_persist).wait()
    held = _steps(rank_dir)
    assert 38 in held and 10 in held and 5 not in held, held
    target = _zeros_like(_state(0))
    w.load(target, step=10)  # the rollback's restore reads the kept copy
    _assert_same(_state(10), target)
    w.close()


def test_fingerprinted_copies_wait_for_their_verdict_in_the_ring(owner: FlashOwner) -> None:
    """The newest fingerprinted copies (`SDC_META`) newer than the kept verified one are
    spared until the driver's verdict reaches the agent, at most half the ring."""
    from unbroken.common.sdckeys import SDC_META

    owner = FlashOwner(FlashConfig(root=owner.config.root, job="fp", copies=8))
    w = FlashWriter(0, owner)
    rank_dir = owner.rank_dir(0)
    for step in range(1, 41):
        meta: dict[str, Any] = {PERSIST_META: False}
        if step % 5 == 0:
            meta[SDC_META] = {"step": step, "keys": []}
        w.save(_state(step), step, meta=meta).wait()
    # 4 of 8 slots spared besides the newest: the fingerprinted steps 20..35
    assert _steps(rank_dir) == [40, 39, 38, 37, 35, 30, 25, 20], _steps(rank_dir)
    ten = next(r for r in list_copies(rank_dir) if r.manifest.step == 30)
    write_keep_mark(rank_dir, [ten.manifest.generation])  # step 30 verified
    for step in range(41, 47):
        w.save(_state(step), step, meta={PERSIST_META: False}).wait()
    # 30 kept; only fingerprinted copies newer than it wait (35, 40); 25 is released
    assert _steps(rank_dir) == [46, 45, 44, 43, 42, 40, 35, 30]
    w.close()


def test_a_small_ring_keeps_nothing(owner: FlashOwner) -> None:
    """A ring too small to spare slots and still hold the newest copies ignores the mark."""
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="small", copies=3))
    w = FlashWriter(0, owner)
    rank_dir = owner.rank_dir(0)
    first = w.save(_state(1), 1, meta={PERSIST_META: False}).wait()
    write_keep_mark(rank_dir, [first.generation])
    for step in range(2, 6):
        w.save(_state(step), step, meta={PERSIST_META: False}).wait()
    assert _steps(rank_dir) == [5, 4, 3]
    w.close()


def _stall_mapper(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the writer's mapper thread wait for `go` before it maps; `stalled` is set once
    it waits."""
    stalled, go = threading.Event(), threading.Event()
    mapped = WriterRing._map_rest

    def slow_mapper(self: WriterRing, first: int, end: int, t0: float) -> None:
        stalled.set()
        go.wait(30)
        mapped(self, first, end, t0)

    monkeypatch.setattr(WriterRing, "_map_rest", slow_mapper)
    return stalled, go


def test_a_start_maps_two_slots_and_the_ring_follows_in_the_background(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare` maps the slots the next saves take; a mapper thread maps the rest. A save
    that needs a slot the mapper has not reached maps it itself: the ring is the same."""
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="lazy", copies=5))
    w = FlashWriter(0, owner)
    stalled, go = _stall_mapper(monkeypatch)
    w.prepare(_state(0))
    assert stalled.wait(10) and sorted(w.ring.maps) == [0, 1] and w.ring_ready_s is None
    slots = []
    for step in (1, 2, 3, 4, 5, 6):  # slots 2-4 mapped by the saves, not the stalled mapper
        w.save(_state(step), step).wait()
        slots.append(owner.newest(0).slot)  # type: ignore[union-attr]
    assert slots == [0, 1, 2, 3, 4, 0]
    assert [r.manifest.step for r in list_copies(owner.rank_dir(0))] == [6, 5, 4, 3, 2]
    go.set()
    w.wait_ring(30)
    assert sorted(w.ring.maps) == [0, 1, 2, 3, 4] and w.ring_ready_s is not None
    target = _zeros_like(_state(0))
    w.load(target, step=3)
    _assert_same(_state(3), target)
    w.close()


def test_closing_stops_the_mapper(owner: FlashOwner, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="lazy-close", copies=4))
    w = FlashWriter(0, owner)
    stalled, go = _stall_mapper(monkeypatch)
    w.prepare(_state(0))
    assert stalled.wait(10)
    closing = threading.Thread(target=w.close)
    closing.start()
    go.set()  # the mapper sees the stop before its next slot
    closing.join(30)
    assert not closing.is_alive() and w.ring.maps == {} and w.ring._mapper is None


def test_crash_mid_copy_leaves_last_complete_copy(owner: FlashOwner) -> None:
    FlashWriter(0, owner).save(_state(1), 1).wait()

    class Crash(Exception):
        pass

    def crash(i: int) -> None:
        if i == 2:
            raise Crash

    w = FlashWriter(0, owner, progress_hook=crash)
    with pytest.raises(Crash):
        w.save(_state(2), 2)
    refs = list_copies(owner.rank_dir(0))
    assert [r.manifest.step for r in refs] == [1]
    target = _zeros_like(_state(0))
    FlashWriter(0, owner).load(target)
    _assert_same(_state(1), target)


def test_too_small_shm_says_how_much_is_needed(owner: FlashOwner) -> None:
    small = FlashOwner(FlashConfig(root=str(owner.job_dir.parent), job="t", headroom_bytes=1 << 50))
    with pytest.raises(ShmTooSmallError, match=r"needs .* GiB more .*--shm-size"):
        FlashWriter(0, small).save(_state(1), 1)


def test_a_writers_copy_is_sealed_on_demand(owner: FlashOwner) -> None:
    """A save does not hash its bytes; `seal` does, and a reused slot is refused."""
    w = FlashWriter(0, owner)
    m = w.save(_state(1), 1).wait()
    assert not m.sealed and m.checksum == UNSEALED
    ref = find_copy(owner.rank_dir(0))
    sealed = seal(ref)
    assert sealed.sealed and dataclasses.replace(sealed, checksum=UNSEALED) == m
    assert sealed.checksum == checksum(ref.data_path.read_bytes()[: m.data_nbytes])
    opened, data = open_copy(ref)  # what a restore broadcasts: the sealed manifest
    data.close()
    assert opened == sealed
    w.close()
    # the slot reused after its manifest was read (a writer unlinks the manifest first)
    os.unlink(manifest_path(ref.rank_dir, ref.slot))
    with pytest.raises(CorruptCopyError, match="overwritten"):
        seal(ref)


def test_bit_flip_and_truncation_are_caught(owner: FlashOwner) -> None:
    """A sealed copy (a buddy's replica, a copy restored from storage) is verified at
    every read; a writer's unsealed copy is checked for its length."""
    w = FlashWriter(0, owner)
    w.save(_state(1), 1).wait()
    w.close()
    mine = find_copy(owner.rank_dir(0))
    rank_dir = owner.rank_dir(0, replica_store("n9"))
    ref = write_raw_copy(
        rank_dir, seal(mine), mine.data_path.read_bytes()[: mine.manifest.data_nbytes]
    )
    read_copy(ref).close()
    with open(ref.data_path, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCopyError, match="checksum"):
        read_copy(ref)
    with open(ref.data_path, "r+b") as f:
        f.truncate(ref.manifest.data_nbytes // 2)
    with pytest.raises(CorruptCopyError, match="truncated"):
        read_copy(ref)
    with open(mine.data_path, "r+b") as f:
        f.truncate(mine.manifest.data_nbytes // 2)
    with pytest.raises(CorruptCopyError, match="truncated"):
        read_copy(mine)
    with pytest.raises(CorruptCopyError):
        FlashWriter(0, owner).load(_zeros_like(_state(0)))


def test_damaged_manifest_means_no_copy(owner: FlashOwner) -> None:
    FlashWriter(0, owner).save(_state(1), 1).wait()
    mpath = owner.rank_dir(0) / "slot-0.manifest"
    mpath.write_bytes(mpath.read_bytes()[:-3] + b"bad")
    with pytest.raises(NoCopyError):
        find_copy(owner.rank_dir(0))


def test_a_slot_manifest_holds_its_head_and_names_its_plan_stored_once(
    owner: FlashOwner,
) -> None:
    """The slot form: each save writes a small head; the entries and keys lines (the same
    every save of a plan) are stored once, beside it, under their hash."""
    from unbroken.recovery.flashcopy import Manifest, plan_path

    w = FlashWriter(0, owner)
    for step in (1, 2, 3):
        w.save(_state(step), step).wait()  # type: ignore[union-attr]
    rank_dir = owner.rank_dir(0)
    plans = sorted(p.name for p in rank_dir.glob("plan-*.lines"))
    assert len(plans) == 1
    refs = list_copies(rank_dir)
    assert [r.manifest.step for r in refs] == [3, 2, 1]
    m = refs[0].manifest
    raw = (rank_dir / f"slot-{refs[0].slot}.manifest").read_bytes()
    wire = m.to_bytes()  # the wire and storage form: self-contained, version 3
    assert Manifest.from_bytes(wire) == m
    assert raw.count(b"\n") == 1 and len(raw) < len(wire)
    plan_id = json.loads(raw.split(b"\n")[0])["plan"]
    assert plan_path(rank_dir, plan_id).name == plans[0]
    with pytest.raises(CorruptCopyError, match="read from its slot"):
        Manifest.from_bytes(raw)  # off the wire: never resolves a file
    target = _zeros_like(_state(0))
    w.load(target)
    _assert_same(_state(3), target)
    w.close()


@pytest.mark.parametrize("damage", ["missing", "tampered", "traversal"])
def test_a_slot_manifest_whose_plan_is_missing_or_wrong_is_no_copy(
    owner: FlashOwner, damage: str
) -> None:
    import zlib

    from unbroken.recovery import flashcopy

    FlashWriter(0, owner).save(_state(1), 1).wait()  # type: ignore[union-attr]
    rank_dir = owner.rank_dir(0)
    flashcopy._plans.clear()  # this process wrote it: read it as another would
    flashcopy._parsed.clear()
    (plan,) = rank_dir.glob("plan-*.lines")
    mpath = rank_dir / "slot-0.manifest"
    if damage == "missing":
        plan.unlink()
    elif damage == "tampered":
        plan.write_bytes(plan.read_bytes().replace(b"float32", b"float64", 1))
    else:
        head = json.loads(mpath.read_bytes().split(b"\n")[0])
        head["plan"] = "../../../../etc/"
        body = json.dumps(head, separators=(",", ":")).encode()
        mpath.write_bytes(body + b"\n" + f"{zlib.crc32(body):08x}".encode())
    with pytest.raises(NoCopyError):
        find_copy(rank_dir)


def _plan_state(step: int, layout: str) -> dict[str, Any]:
    """`_state(step)` with one more small value whose key names the layout (a new plan)."""
    return _state(step) | {f"layout_{layout}": step}


@pytest.mark.parametrize("keep_s", [0.0, None])
def test_plans_no_manifest_names_go_when_a_new_plan_is_written(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch, keep_s: float | None
) -> None:
    """Each reshard or restart with other state writes a new plan file: the ones no slot
    names any more are deleted then (once older than PLAN_KEEP_S), the named ones stay."""
    from unbroken.recovery import flashcopy

    if keep_s is not None:
        monkeypatch.setattr(flashcopy, "PLAN_KEEP_S", keep_s)
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="plans", copies=3))
    w = FlashWriter(0, owner)
    rank_dir: Path | None = None  # set after the first save

    def plans() -> set[str]:
        assert rank_dir is not None
        return {p.name for p in rank_dir.glob("plan-*.lines")}

    for step in (1, 2, 3):
        w.save(_plan_state(step, "a"), step).wait()
    rank_dir = owner.rank_dir(0)
    (plan_a,) = plans()
    stale_tmp = rank_dir / ".plan-0123456789abcdef.999.tmp"  # a crashed writer's
    stale_tmp.write_bytes(b"x")
    os.utime(stale_tmp, (time.time() - 3600, time.time() - 3600))
    w.save(_plan_state(4, "b"), 4).wait()  # slot 0: slots 1 and 2 still name plan a
    assert plan_a in plans() and len(plans()) == 2
    for step in (5, 6):
        w.save(_plan_state(step, "b"), step).wait()  # no slot names plan a any more
    (plan_b,) = plans() - {plan_a}
    w.save(_plan_state(7, "c"), 7).wait()  # a new plan: the unnamed ones go
    if keep_s == 0.0:
        assert plan_a not in plans() and plan_b in plans() and len(plans()) == 2
        assert not stale_tmp.exists()
    else:  # plan a is seconds old: kept for now (a writer may be about to name it)
        assert {plan_a, plan_b} <= plans()
    assert [r.manifest.step for r in list_copies(rank_dir)] == [7, 6, 5]
    target = _zeros_like(_plan_state(0, "b"))
    w.load(target, step=5)
    _assert_same(_plan_state(5, "b"), target)
    w.close()


def test_an_unreadable_manifest_keeps_every_plan(owner: FlashOwner) -> None:
    from unbroken.recovery.flashcopy import prune_plans

    w = FlashWriter(0, owner)
    w.save(_plan_state(1, "a"), 1).wait()
    w.save(_plan_state(2, "b"), 2).wait()
    rank_dir = owner.rank_dir(0)
    w.save(_plan_state(3, "b"), 3).wait()  # slot 0 names plan a, the others plan b
    assert len(list(rank_dir.glob("plan-*.lines"))) == 2
    manifest_path(rank_dir, 0).write_bytes(b"not a manifest")
    assert prune_plans(rank_dir, min_age_s=0.0) == []
    assert len(list(rank_dir.glob("plan-*.lines"))) == 2
    manifest_path(rank_dir, 0).unlink()  # now nothing names plan a
    assert [n for n in prune_plans(rank_dir, min_age_s=0.0) if n.endswith(".lines")]
    assert len(list(rank_dir.glob("plan-*.lines"))) == 1
    w.close()


def test_owner_lists_discards_and_cleans(owner: FlashOwner) -> None:
    for rank in (0, 1):
        w = FlashWriter(rank, owner)
        for step in (4, 5):
            w.save(_state(step), step).wait()
        w.close()
    assert owner.ranks() == [0, 1]
    assert {r: [c.manifest.step for c in cs] for r, cs in owner.copies().items()} == {
        0: [5, 4],
        1: [5, 4],
    }
    assert owner.used_bytes() > 0
    assert owner.discard_newer_than(4) == 2
    assert owner.newest(0).manifest.step == 4  # type: ignore[union-attr]
    owner.delete_rank(1)
    assert owner.ranks() == [0]
    owner.cleanup()
    assert not owner.job_dir.exists()


def test_writer_generation_survives_restart(owner: FlashOwner) -> None:
    FlashWriter(0, owner).save(_state(1), 1).wait()
    w2 = FlashWriter(0, owner)  # a restarted worker
    w2.save(_state(2), 2).wait()
    assert owner.newest(0).manifest.step == 2  # type: ignore[union-attr]
    w2.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"root": ""}, "root"), ({"job": "a/b"}, "job"), ({"headroom_bytes": -1}, "headroom")],
)
def test_flash_config_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FlashConfig(**kwargs)


# ---------------------------------------------------------------- persistence


def test_persist_verify_commit_and_retention(owner: FlashOwner, tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    tracker = CommitTracker(world_size=2, url=url)
    commits = []
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            FlashWriter(rank, owner).save(_state(step + rank), step).wait()
            p = write_shard(owner.newest(rank), url)  # type: ignore[arg-type]
            c = tracker.record(p)
            assert (c is None) == (rank == 0)  # only the last rank's report commits
            if c is not None:
                commits.append(c)
    assert [c.step for c in commits] == [1, 2, 3, 4]
    assert commits[0].ranks == 2 and len(commits[0].checksum) == 8
    manifest, _ = read_shard(list_persisted(url)[4][1])
    assert (manifest.step, manifest.rank) == (4, 1)
    assert apply_retention(url, tracker.committed, keep=2) == [1, 2]
    assert sorted(list_persisted(url)) == [3, 4]


def test_uncommitted_step_is_not_committed_and_not_deleted(tmp_path: Path) -> None:
    tr = CommitTracker(world_size=3, url=str(tmp_path))
    for r in (0, 1):
        assert tr.record(Persisted(rank=r, step=9, uri="u", nbytes=1, checksum=r)) is None
    assert tr.committed == []
    with pytest.raises(ValueError, match="outside world"):
        tr.record(Persisted(rank=3, step=9, uri="u", nbytes=1, checksum=0))


def test_persisted_truncation_and_bit_flip_are_detected(owner: FlashOwner, tmp_path: Path) -> None:
    FlashWriter(0, owner).save(_state(1), 1).wait()
    p = write_shard(owner.newest(0), str(tmp_path))  # type: ignore[arg-type]
    path = Path(p.uri)
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])
    with pytest.raises(CorruptCopyError, match="truncated"):
        read_shard(p.uri)
    flipped = bytearray(raw)
    flipped[-20] ^= 0x04
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCopyError, match="checksum"):
        read_shard(p.uri)


def test_background_persister_reports_each_new_copy_once(owner: FlashOwner, tmp_path: Path) -> None:
    got: list[Persisted] = []
    pers = Persister(PersistConfig(url=str(tmp_path), keep=2), got.append)
    w = FlashWriter(0, owner)
    w.save(_state(1), 1).wait()
    pers.submit(owner.rank_dir(0))
    pers.submit(owner.rank_dir(0))  # same copy: persisted once
    deadline = time.monotonic() + 30
    while len(got) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.save(_state(2), 2).wait()
    pers.submit(owner.rank_dir(0))
    pers.close(timeout_s=60)
    w.close()
    assert [(p.rank, p.step) for p in got] == [(0, 1), (0, 2)]


def test_a_persister_that_skipped_a_copy_persists_it_once_the_newest_is_done(
    owner: FlashOwner, tmp_path: Path
) -> None:
    """Behind, the persister skips to the newest copy; once that one is persisted and
    still the newest, the copy it skipped (the step a crashed peer may stop at) follows,
    once. A first persist (nothing persisted before it) backfills nothing."""
    got: list[Persisted] = []
    pers = Persister(PersistConfig(url=str(tmp_path), keep=2), got.append)
    w = FlashWriter(0, owner)
    rank_dir = owner.rank_dir(0)
    try:
        w.save(_state(1), 1).wait()
        w.save(_state(2), 2).wait()
        assert pers.persist_now(rank_dir).step == 2  # type: ignore[union-attr]
        assert not pers.backfill_due(rank_dir)  # a first persist: step 1 stays in memory
        for step in (3, 4, 5):
            w.save(_state(step), step).wait()
        assert pers.persist_now(rank_dir).step == 5  # type: ignore[union-attr]
        assert pers.backfill_due(rank_dir)
        assert pers.persist_now(rank_dir).step == 4  # type: ignore[union-attr]  # not 3
        assert not pers.backfill_due(rank_dir) and pers.persist_now(rank_dir) is None
        assert sorted(list_persisted(str(tmp_path))) == [2, 4, 5]
        w.save(_state(6), 6).wait()
        assert pers.persist_now(rank_dir).step == 6  # type: ignore[union-attr]
        assert not pers.backfill_due(rank_dir)  # it kept up: nothing skipped
        read_shard(list_persisted(str(tmp_path))[4][0])  # the backfilled shard verifies
    finally:
        pers.close(timeout_s=60)
        w.close()


def test_the_persister_offers_a_failed_copy_again_a_bounded_number_of_times(
    owner: FlashOwner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`offer` queues a new copy at once and the same copy again only when it failed:
    `RETRY_PERSIST_S` after the last try, at most `PERSIST_TRIES` times; once storage
    works again the copy persists, and a persisted copy is not queued again."""
    from unbroken.recovery import persist

    monkeypatch.setattr(persist, "RETRY_PERSIST_S", 3600.0)
    blocked = tmp_path / "storage"
    blocked.write_text("a file where the checkpoint directory should be")
    errors: list[Exception] = []
    got: list[Persisted] = []
    pers = Persister(
        PersistConfig(url=str(blocked / "ckpt"), keep=2), got.append, lambda _d, e: errors.append(e)
    )
    w = FlashWriter(0, owner)
    rank_dir = owner.rank_dir(0)

    def settle(n_errors: int) -> None:
        deadline = time.monotonic() + 30
        while len(errors) < n_errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(errors) == n_errors

    try:
        gen = w.save(_state(1), 1).wait().generation  # type: ignore[union-attr]
        assert pers.offer(rank_dir, gen)  # new: queued
        settle(1)
        assert not pers.offer(rank_dir, gen)  # failed, but not due yet
        monkeypatch.setattr(persist, "RETRY_PERSIST_S", 0.0)  # due at every offer now
        tries = 0
        while pers.offer(rank_dir, gen):
            tries += 1
            settle(1 + tries)
            assert tries <= persist.PERSIST_TRIES
        assert tries == persist.PERSIST_TRIES and not pers.offer(rank_dir, gen)
        blocked.unlink()  # storage works again; a new copy is offered and persists
        gen2 = w.save(_state(2), 2).wait().generation  # type: ignore[union-attr]
        assert pers.offer(rank_dir, gen2)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p.step for p in got] == [2]
        assert not pers.offer(rank_dir, gen2)  # persisted: never again
    finally:
        pers.close(timeout_s=60)
        w.close()


def test_memory_only_copies_are_not_persisted(owner: FlashOwner, tmp_path: Path) -> None:
    """The hooks SDK marks most saves memory-only: the persister takes the newest copy that
    is not, and a memory-only copy never reaches storage."""
    got: list[Persisted] = []
    pers = Persister(PersistConfig(url=str(tmp_path), keep=2), got.append)
    w = FlashWriter(0, owner)
    w.save(_state(1), 1, meta={PERSIST_META: True}).wait()
    w.save(_state(2), 2, meta={PERSIST_META: False}).wait()
    refs = list_copies(owner.rank_dir(0))
    assert [r.manifest.step for r in refs] == [2, 1]
    assert [r.manifest.step for r in persistable(refs)] == [1]
    pers.submit(owner.rank_dir(0))
    pers.close(timeout_s=60)
    w.close()
    assert [p.step for p in got] == [1]
    assert sorted(list_persisted(str(tmp_path))) == [1]


def test_a_persisted_shard_carries_its_copys_timeline(
    owner: FlashOwner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TIMELINE, "2")  # as the agent sets it after two rollbacks
    assert current_timeline() == 2
    w = FlashWriter(0, owner)
    w.save(_state(1), 1, meta={TIMELINE_META: current_timeline()}).wait()
    (ref,) = list_copies(owner.rank_dir(0))
    assert write_shard(ref, str(tmp_path)).timeline == 2
    w.close()
    monkeypatch.setenv(ENV_TIMELINE, "junk")
    assert current_timeline() == 0


def test_persist_config_validation() -> None:
    with pytest.raises(ValueError, match="keep"):
        PersistConfig(url="x", keep=0)


# ---------------------------------------------------------------- restore with fallback


def test_corrupt_memory_falls_back_to_buddy_then_storage(owner: FlashOwner, tmp_path: Path) -> None:
    sd = _state(5)
    w = FlashWriter(0, owner)
    w.save(sd, 5).wait()
    w.close()
    ref = owner.newest(0)
    assert ref is not None
    buddy_dir = owner.rank_dir(0, "replica-nodeA")
    with open(ref.data_path, "rb") as f:  # what the buddy stores: the sealed copy
        write_raw_copy(buddy_dir, seal(ref), f.read(ref.manifest.data_nbytes))
    write_shard(ref, str(tmp_path))
    # damage memory and buddy: the restore must come from storage, intact (the memory copy
    # is unsealed: its bytes are compared with the checksum its sealed twins carry)
    for path in (ref.data_path, find_copy(buddy_dir).data_path):
        with open(path, "r+b") as f:
            f.write(b"\xff\xff\xff\xff")
    sv = survey(memory={0: owner.rank_dir(0)}, buddy={0: buddy_dir}, storage_url=str(tmp_path))
    plan = decide(sv.availability([0]))
    assert plan.source_by_rank[0] is Source.MEMORY  # manifests alone look fine
    src, _, _ = obtain(sv, 0, plan.step)
    assert src.kind is Source.STORAGE
    assert {(s, st) for _, s, st in sv.corrupt} == {(Source.MEMORY, 5), (Source.BUDDY, 5)}
    assert decide(sv.availability([0])).source_by_rank[0] is Source.STORAGE
    target = _zeros_like(sd)
    load_resharded(target, [src])
    _assert_same(sd, target)


def test_an_unsealed_copy_without_a_twin_is_checked_for_its_length_only(
    owner: FlashOwner, tmp_path: Path
) -> None:
    """A writer's copy is not hashed at save time: alone, flipped bytes go unnoticed (as in
    the live state it was copied from); a twin sealed from another save of the same step
    (a rerun after a rollback) is not taken for its twin."""
    w = FlashWriter(0, owner)
    w.save(_state(5), 5).wait()
    ref = owner.newest(0)
    assert ref is not None
    with open(ref.data_path, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    src, manifest, data = obtain(survey(memory={0: owner.rank_dir(0)}), 0, 5)
    assert src.kind is Source.MEMORY and manifest.sealed  # sealed now, from the bytes read
    data.close()
    # the step saved again (different values: created later, another generation), persisted
    w.save(_state(6), 5).wait()
    w.close()
    again = owner.newest(0)
    assert again is not None and again.slot != ref.slot
    write_shard(again, str(tmp_path))
    os.unlink(manifest_path(owner.rank_dir(0), again.slot))  # memory keeps the first save
    sv = survey(memory={0: owner.rank_dir(0)}, storage_url=str(tmp_path))
    src, _, data = obtain(sv, 0, 5)
    assert src.kind is Source.MEMORY and not sv.corrupt
    data.close()


def test_all_sources_corrupt_is_an_error(owner: FlashOwner) -> None:
    FlashWriter(0, owner).save(_state(1), 1).wait()
    ref = owner.newest(0)
    assert ref is not None
    os.truncate(ref.data_path, 5)
    sv = survey(memory={0: owner.rank_dir(0)})
    with pytest.raises(CorruptCopyError, match="no intact copy of rank 0 step 1"):
        obtain(sv, 0, 1)


class _Counter:
    """A DCP `Stateful`, like the trainer: saved through its state dict."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((4,), value)
        self.pos = int(value)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t.copy_(sd["t"])
        self.pos = sd["pos"]


def test_stateful_objects_save_and_load_like_dcp(owner: FlashOwner) -> None:
    w = FlashWriter(0, owner)
    w.save({"trainer": _Counter(3.0)}, 1).wait()  # type: ignore[union-attr]
    fresh = _Counter(0.0)
    w.load({"trainer": fresh})
    assert fresh.pos == 3 and torch.equal(fresh.t, torch.full((4,), 3.0))
    w.close()


def test_rollback_forgets_the_dead_timeline(owner: FlashOwner, tmp_path: Path) -> None:
    url = str(tmp_path)
    tr = CommitTracker(world_size=1, url=url)
    w = FlashWriter(0, owner)
    for step in (1, 2, 3):
        w.save(_state(step), step).wait()  # type: ignore[union-attr]
        assert tr.record(write_shard(owner.newest(0), url)) is not None  # type: ignore[arg-type]
    assert discard_after(url, 1) == [2, 3]
    tr.rollback(1)
    owner.discard_newer_than(1)
    w.save(_state(20), 2).wait()  # type: ignore[union-attr]
    c = tr.record(write_shard(owner.newest(0), url))  # type: ignore[arg-type]
    assert c is not None and c.step == 2 and tr.committed == [1, 2]
    w.close()


def test_prepare_sizes_both_slots_before_the_first_save(owner: FlashOwner) -> None:
    w = FlashWriter(0, owner)
    sd = _state(1)
    nbytes = w.prepare(sd)
    assert nbytes >= 16 * 8 * 4 + 5 * 2 + 9 * 8 + 4
    for slot in (0, 1):
        assert (owner.rank_dir(0) / f"slot-{slot}.data").stat().st_size >= nbytes
    assert list_copies(owner.rank_dir(0)) == []  # sized, but no copy yet
    w.save(sd, 1).wait()  # type: ignore[union-attr]
    w.close()


def test_save_async_roundtrip_and_skip_if_busy(owner: FlashOwner) -> None:
    release = threading.Event()

    def hold(i: int) -> None:
        release.wait(10)

    w = FlashWriter(0, owner, progress_hook=hold)
    h = w.save_async(_state(1), 1)
    assert h is not None and not h.copied()  # the copy waits on the hook: still in flight
    assert w.save_async(_state(2), 2, skip_if_busy=True) is None
    release.set()
    assert h.wait().step == 1 and h.copied()
    h2 = w.save_async(_state(2), 2)
    assert h2 is not None and h2.wait().step == 2
    target = _zeros_like(_state(0))
    w.load(target)
    _assert_same(_state(2), target)
    w.close()


def test_the_copy_thread_only_copies_the_training_thread_built_the_slot_views(
    owner: FlashOwner,
) -> None:
    """The idle-priority copy thread runs no Python it can be starved in while the optimizer
    step waits: a save into a slot whose tensor views are not built yet builds them on the
    saving thread (a starved copy thread held there for over a second made a false hang)."""
    w = FlashWriter(0, owner)
    started, release = threading.Event(), threading.Event()
    w._pool.submit(lambda: (started.set(), release.wait(10)))  # the copy thread, busy
    assert started.wait(10)
    h = w.save_async(_state(1), 1)
    assert h is not None and not h.copied()  # the copy has not run...
    slot = next(iter(w._inflight))
    assert slot in w.ring._views  # ...but its slot's views are there
    release.set()
    assert h.wait().step == 1
    w.close()


def test_failed_overlapped_copy_surfaces_once_and_keeps_last_copy(owner: FlashOwner) -> None:
    class Crash(Exception):
        pass

    step = {"n": 0}

    def crash(i: int) -> None:
        if step["n"] == 2 and i == 2:
            raise Crash

    w = FlashWriter(0, owner, progress_hook=crash)
    step["n"] = 1
    w.save_async(_state(1), 1).wait()  # type: ignore[union-attr]
    step["n"] = 2
    h = w.save_async(_state(2), 2)
    assert h is not None
    with pytest.raises(Crash):
        w.wait_copied()  # what the optimizer guard calls
    with pytest.raises(Crash):
        h.wait()
    assert [r.manifest.step for r in list_copies(owner.rank_dir(0))] == [1]
    with pytest.raises(Crash):  # the next save reports it, once
        w.save_async(_state(3), 3)
    step["n"] = 3
    assert w.save_async(_state(3), 3).wait().step == 3  # type: ignore[union-attr]
    assert [r.manifest.step for r in list_copies(owner.rank_dir(0))] == [3, 1]
    w.close()


@pytest.mark.parametrize("every_optimizer", [False, True], ids=["listed", "global"])
def test_guard_makes_optimizer_step_wait_for_the_copy(
    owner: FlashOwner, every_optimizer: bool
) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    release = threading.Event()
    w = FlashWriter(0, owner, progress_hook=lambda i: release.wait(10))
    guards = w.guard(None if every_optimizer else [opt])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h = w.save_async({"model": model.state_dict()}, 1)
    assert h is not None
    model(torch.ones(1, 4)).sum().backward()
    threading.Timer(0.2, release.set).start()
    opt.step()  # waits in the guard until the copy is out
    assert h.copied() and h.blocked_s > 0
    target = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    w.load(target)
    _assert_same({"model": before}, target)
    for g in guards:
        g.remove()
    w.close()


def _manifest_steps(owner: FlashOwner) -> list[int]:
    return [r.manifest.step for r in list_copies(owner.rank_dir(0))]


def test_an_overlapped_save_is_published_by_the_writer_thread_right_after_its_checksum(
    owner: FlashOwner,
) -> None:
    """Copy, checksum and manifest run on the writer's thread: the copy is valid without
    any optimizer step or later save (a rank stuck in a collective right after a save, or
    killed in the next step's forward, keeps it), and the training thread never writes it."""
    from unbroken.recovery import flash

    model = torch.nn.Linear(4, 4)
    w = FlashWriter(0, owner)
    written: list[str] = []
    real = flash.write_manifest

    def spy(*a: Any, **k: Any) -> Any:
        written.append(threading.current_thread().name)
        return real(*a, **k)

    flash.write_manifest = spy  # type: ignore[assignment]
    try:
        h = w.save_async({"model": model.state_dict()}, 1)
        assert h is not None
        deadline = time.monotonic() + 10
        while not _manifest_steps(owner) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _manifest_steps(owner) == [1] and h.done()
        assert written and threading.current_thread().name not in written
        assert h.wait().checksum == list_copies(owner.rank_dir(0))[0].manifest.checksum
        target = {"model": _zeros_like(model.state_dict())}
        w.load(target)
        _assert_same({"model": model.state_dict()}, target)
    finally:
        flash.write_manifest = real  # type: ignore[assignment]
        w.close()


def test_back_to_back_saves_are_both_published_in_order(owner: FlashOwner) -> None:
    """The second save starts while the first is still being copied or checksummed (the
    ring has a free slot): neither waits for the other's checksum, both become valid."""
    w = FlashWriter(0, owner)
    h1 = w.save_async(_state(1), 1)
    h2 = w.save_async(_state(2), 2)
    assert h1 is not None and h2 is not None
    assert h1.wait(10).step == 1 and h2.wait(10).step == 2
    assert sorted(_manifest_steps(owner)) == [1, 2]
    assert _manifest_steps(owner)[0] == 2  # newest generation first
    w.close()


@pytest.mark.parametrize(
    "value",
    [True, 1, 2**70, 0.0, -0.0, float("-inf"), "s", None, (0.9, 0.95), [1, 2], {"a": (1,)}],
)
def test_small_values_keep_their_type_and_sign(value: Any) -> None:
    from unbroken.recovery.flashcopy import load_object
    from unbroken.recovery.flashplan import dump_object as _dump_object
    from unbroken.recovery.flashplan import immutable as _immutable

    for probe in (1, 0.0, value):  # after equal-but-different values were cached
        load_object(_dump_object(probe))
    back = load_object(_dump_object(value))
    assert repr(back) == repr(value) and type(back) is type(value)
    if _immutable(value):  # framed by hand: byte for byte what torch.save writes
        out = io.BytesIO()
        torch.save(value, out, _use_new_zipfile_serialization=False)
        assert _dump_object(value) == out.getvalue()


def test_a_manifest_stores_each_distinct_small_value_once_and_reads_version_1() -> None:
    """Hundreds of per-parameter optimizer values share a few values: each distinct one's
    bytes are in the manifest once. A version 1 manifest (bytes per key) still reads."""
    import base64
    import json
    import zlib

    from unbroken.recovery.flashcopy import Manifest
    from unbroken.recovery.flashplan import dump_object as _dump_object

    lr, betas = _dump_object(3e-4), _dump_object((0.9, 0.95))
    objects = {f"optimizer.param_groups.layer{i}.{k}": v for i in range(300) for k, v in
               (("lr", lr), ("betas", betas))}  # fmt: skip
    m = Manifest(0, 7, 3, 0, 0, (), objects, {"world": 2}, 1.0)
    raw = m.to_bytes()
    assert Manifest.from_bytes(raw) == m
    assert raw.count(base64.b64encode(lr)) == 1 and raw.count(base64.b64encode(betas)) == 1
    head, entries, _keys = raw.rpartition(b"\n")[0].split(b"\n")
    doc = json.loads(head)
    del doc["object_index"]
    doc["version"], doc["entries"] = 1, json.loads(entries)
    doc["objects"] = {k: base64.b64encode(v).decode() for k, v in objects.items()}
    del doc["blobs"]
    body = json.dumps(doc).encode()
    assert Manifest.from_bytes(body + b"\n" + f"{zlib.crc32(body):08x}".encode()) == m
    del doc["entries"]
    doc["version"], doc["objects"], doc["blobs"] = 2, {"x": 5}, []  # names a missing blob
    body = json.dumps(doc).encode() + b"\n" + entries
    with pytest.raises(CorruptCopyError, match="does not hold"):
        Manifest.from_bytes(body + b"\n" + f"{zlib.crc32(body):08x}".encode())


def test_a_manifests_tensor_entries_are_serialised_and_parsed_once_per_plan() -> None:
    from unbroken.recovery import flashcopy
    from unbroken.recovery.flashcopy import Manifest, TensorEntry

    entries = tuple(
        TensorEntry(f"w{i}", "float32", (4, 4), 64 * i, 64, (8, 4), (0, 0)) for i in range(50)
    )
    # an optimizer's param-group values: hundreds of keys, a few distinct values
    objects = {f"optimizer.param_groups.w{i}.{k}": v for i in range(50) for k, v in
               (("lr", b"\x01"), ("eps", b"\x02"), ("betas", b"\x03"))}  # fmt: skip
    a = Manifest(0, 1, 1, 3200, 1, entries, objects, {}, 1.0)
    b = Manifest(0, 2, 2, 3200, 2, entries, {**objects, "optimizer.param_groups.w7.lr": b"\x04"})
    raw_a, raw_b = a.to_bytes(), b.to_bytes()
    lines_a, lines_b = raw_a.split(b"\n"), raw_b.split(b"\n")
    assert len(lines_a) == 4 and lines_a[1:3] == lines_b[1:3]  # entries and keys: as before
    assert len(lines_a[0]) < 1000  # the head: blob indices, not the 150 keys
    pa, pb = Manifest.from_bytes(raw_a), Manifest.from_bytes(raw_b)
    assert (pa, pb) == (a, b)
    assert pa.entries is pb.entries  # parsed once, shared
    assert flashcopy._ENTRIES.last[0] is entries
    assert pb.objects["optimizer.param_groups.w7.lr"] == b"\x04"


def test_a_version_2_manifest_still_reads_and_a_short_index_is_corrupt() -> None:
    """Copies written before the keys line (version 2, each key in the head) still restore;
    a version 3 head whose index does not match its keys is a corrupt copy, not a crash."""
    import base64
    import json
    import zlib

    from unbroken.recovery.flashcopy import CorruptCopyError, Manifest

    def sealed(head: dict[str, Any], *lines: bytes) -> bytes:
        body = b"\n".join((json.dumps(head).encode(), *lines))
        return body + b"\n" + f"{zlib.crc32(body):08x}".encode()

    head = {"version": 2, "rank": 0, "step": 5, "generation": 5, "data_nbytes": 0,
            "checksum": 0, "checksum_algo": "xxh3_64", "objects": {"a": 0, "b": 0},
            "blobs": [base64.b64encode(b"x").decode()], "meta": {},
            "created_unix": 0.0}  # fmt: skip
    old = Manifest.from_bytes(sealed(head, b"[]"))
    assert old.step == 5 and old.objects == {"a": b"x", "b": b"x"}
    v3 = {**head, "version": 3, "object_index": [0]}
    del v3["objects"]
    with pytest.raises(CorruptCopyError, match="small value"):
        Manifest.from_bytes(sealed(v3, b"[]", b'["a","b"]'))
    with pytest.raises(CorruptCopyError, match="keys"):
        Manifest.from_bytes(sealed(v3, b"[]"))
    with pytest.raises(CorruptCopyError, match="does not parse"):
        Manifest.from_bytes(sealed(v3, b"[]", b'{"a":1}'))


# ---------------------------------------------------------------- lifecycle (docs/checkpoints.md)


def test_a_shard_is_fsynced_before_it_is_reported(
    owner: FlashOwner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard file and its directory reach the disk (os.fsync) before the report."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    FlashWriter(0, owner).save(_state(1), 1).wait()
    reported: list[tuple[str, list[str]]] = []
    url = str(tmp_path / "ckpt")
    persister = Persister(PersistConfig(url=url), lambda p: reported.append((p.uri, list(synced))))
    try:
        persister.submit(owner.rank_dir(0))
        deadline = time.monotonic() + 30
        while not reported and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        persister.close()
    assert reported, "the persister never reported"
    uri, synced_before = reported[0]
    step_dir = os.path.dirname(uri)
    assert any(s.endswith("rank-00000.ubf.partial") for s in synced_before), synced_before
    assert step_dir in synced_before and os.path.dirname(step_dir) in synced_before
    # the persister told the writer the copy is on storage (its ring slot is released)
    assert read_persisted_mark(owner.rank_dir(0)) == owner.newest(0).manifest.generation  # type: ignore[union-attr]


def test_a_truncated_shard_is_skipped_for_the_next_source(
    owner: FlashOwner, tmp_path: Path
) -> None:
    """A truncated stored shard is detected at restore and the memory copy used instead;
    with no other source the step is marked corrupt so the next decision avoids it."""
    FlashWriter(0, owner).save(_state(5), 5).wait()
    url = str(tmp_path / "ckpt")
    p = write_shard(owner.newest(0), url)  # type: ignore[arg-type]
    Path(p.uri).write_bytes(Path(p.uri).read_bytes()[:-7])
    s = survey(storage_url=url)
    with pytest.raises(CorruptCopyError, match="truncated"):
        obtain(s, 0, 5)
    assert (0, Source.STORAGE, 5) in s.corrupt
    s = survey(memory={0: owner.rank_dir(0)}, storage_url=url)
    src, manifest, data = obtain(s, 0, 5)
    assert src.kind == Source.MEMORY and manifest.step == 5
    data.close()  # type: ignore[union-attr]


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for g in opt.param_groups:
        g["lr"] = 0.01 / (1 + step)  # a schedule: a small value that changes every step
    x = torch.randn(4, 8)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_snapshot_saves_equal_full_saves_step_after_step(owner: FlashOwner) -> None:
    """The cheap path (plan and tensor references cached, fresh small values only) writes
    exactly what a full state-dict save writes, every step, and a key change re-plans."""
    from unbroken.recovery.flashplan import Snapshot

    model, opt = _trained()
    step = {"n": 0}

    def full() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step["n"],
                "rng": torch.get_rng_state()}  # fmt: skip

    def fresh() -> dict[str, Any]:
        return {"optim": {"param_groups": opt.state_dict()["param_groups"]}, "step": step["n"],
                "rng": torch.get_rng_state()}  # fmt: skip

    fast = FlashWriter(0, owner)
    slow = FlashWriter(1, owner)
    for n in range(1, 6):
        _train_step(model, opt, n)
        step["n"] = n
        key = ("v1", len(opt.state))
        a = fast.save_async(Snapshot(key=key, full=full, fresh=fresh), n)
        b = slow.save_async(full(), n)
        assert a is not None and b is not None
        ma, mb = a.wait(), b.wait()
        sums = [seal(find_copy(owner.rank_dir(r), n)).checksum for r in (0, 1)]
        assert sums[0] == sums[1], n  # the same bytes
        assert ma.objects == mb.objects, n  # the same small values (lr of this step)
    assert fast.snapshot_hits == 4  # planned at step 1, reused at steps 2-5
    fast.close()
    slow.close()


def test_a_shared_value_stands_for_its_keys_and_is_serialised_only_when_it_changes(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Shared` in a flat fresh(): one value for many keys (a param group's lr, once per
    parameter). Saved bytes equal a full save's; an unchanged immutable is not serialised
    again; a key the plan lacks takes the full path."""
    from unbroken.recovery import flashplan as flash_mod
    from unbroken.recovery.flashplan import Shared, Snapshot

    w = torch.zeros(8)
    group = {"lr": 0.1, "betas": (0.9, 0.95)}
    names = [f"opt.param_groups.p{i}" for i in range(40)]

    def full() -> dict[str, Any]:
        return {"w": w, "opt": {"param_groups": {f"p{i}": dict(group) for i in range(40)}}}

    def fresh() -> dict[str, Any]:
        return {k: Shared(tuple(f"{n}.{k}" for n in names), group[k]) for k in group}

    dumps: list[Any] = []
    real = flash_mod.dump_object
    monkeypatch.setattr(flash_mod, "dump_object", lambda v: dumps.append(v) or real(v))
    fast, slow = FlashWriter(0, owner), FlashWriter(1, owner)
    for n in range(1, 5):
        w.add_(1.0)
        if n > 1:
            group["lr"] = 0.1 / n  # a new float each step, as a scheduler sets it
        dumps.clear()
        a = fast.save_async(Snapshot(key="k", full=full, fresh=fresh, flat=True), n)
        assert a is not None
        got = dumps.copy()
        ma, mb = a.wait(), slow.save_async(full(), n).wait()  # type: ignore[union-attr]
        assert ma.checksum == mb.checksum and ma.objects == mb.objects, n
        if n == 2:  # the first save on the plan: each group value once
            assert got == [0.1 / n, (0.9, 0.95)], (n, got)
        elif n > 2:  # then the lr once; the betas (the same tuple object) not at all
            assert got == [0.1 / n], (n, got)
    assert fast.snapshot_hits == 3

    def stray() -> dict[str, Any]:
        return {"x": Shared(("opt.param_groups.p0.lr", "opt.param_groups.nope.lr"), 1.0)}

    b = fast.save_async(Snapshot(key="k", full=full, fresh=stray, flat=True), 9)
    assert b is not None and b.wait().objects == slow.save_async(full(), 9).wait().objects  # type: ignore[union-attr]
    assert fast.snapshot_hits == 3  # the full path
    fast.close()
    slow.close()


def test_an_automatic_ring_is_sized_from_the_tmpfs_budget(owner: FlashOwner) -> None:
    import os

    root = owner.config.root
    st = os.statvfs(root)
    tmpfs = st.f_blocks * st.f_frsize
    small = FlashOwner(FlashConfig(root=root, job="auto-small"))
    assert len(slots(Path(small.reserve(0, 4096)))) == MAX_AUTO_COPIES  # tiny state: the cap
    # a state of a tenth of the tmpfs, 1 rank per node, a quarter of the tmpfs: 2 copies
    big = FlashOwner(FlashConfig(root=root, job="auto-big", local_ranks=1))
    assert big._auto_copies(tmpfs // 10, tmpfs) == 2
    assert big._auto_copies(tmpfs // 40, tmpfs) == 10
    assert big._auto_copies(tmpfs // 400, tmpfs) == MAX_AUTO_COPIES
    shared = FlashOwner(FlashConfig(root=root, job="auto-8", local_ranks=8))
    assert shared._auto_copies(tmpfs // 160, tmpfs) == 5  # 1/32 of the tmpfs per rank
    with pytest.raises(ValueError, match="copies"):
        FlashConfig(root=root, copies=1)


def _resident(path: Path, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """(pages of `path` in [lo, hi) a process would map without a first touch, pages):
    mincore counts a tmpfs page only once it was touched, not when it was fallocated."""
    import ctypes
    import ctypes.util
    import mmap
    import os

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    os.close(fd)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    view = ctypes.c_char.from_buffer(m)
    try:
        assert libc.mincore(ctypes.addressof(view), size, vec) == 0, ctypes.get_errno()
    finally:
        del view
        m.close()
    first, last = lo // mmap.PAGESIZE, -(-(size if hi is None else hi) // mmap.PAGESIZE)
    return sum(b & 1 for b in vec[first:last]), last - first


@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "write-each-page"])
def test_prefault_touches_what_a_grown_ring_allocated_and_keeps_its_copies(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch, madvise: bool
) -> None:
    """Memory prepared ahead (docs/checkpoints.md). `reserve` remembers what it allocated;
    `prefault` touches exactly that (the worker then maps touched pages), in chunks on threads,
    and a copy already in a slot that grew reads back unchanged."""
    from unbroken.recovery import flashowner

    if not madvise:  # an older kernel (no MADV_POPULATE_WRITE): a write of each page
        monkeypatch.setattr(flashowner, "_madvise", lambda: None)
    owner = FlashOwner(FlashConfig(root=owner.config.root, job="pf", copies=3))
    w = FlashWriter(0, owner)
    w.save(_state(1), 1).wait()
    w.close()
    small = list(owner.grown)
    assert len(small) == 3 and all(lo == 0 for _, lo, _ in small)
    owner.grown.clear()

    big = 6 << 20
    owner.reserve(0, big)
    grown = sorted(owner.grown)
    assert [(p.name, hi) for p, _, hi in grown] == [(f"slot-{s}.data", big) for s in range(3)]
    for p, lo, hi in grown:
        assert _resident(p, lo + 4096, hi)[0] == 0  # allocated, never touched
    took = owner.prefault(threads=2)
    assert took > 0 and owner.grown == []
    for p, lo, hi in grown:
        got, pages = _resident(p, lo, hi)
        assert got == pages, (p.name, got, pages)
    assert owner.prefault() == 0.0  # nothing new allocated: nothing to do

    again = FlashWriter(0, owner)
    target = _zeros_like(_state(0))
    again.load(target, step=1)
    _assert_same(_state(1), target)
    again.close()


def test_the_agent_prefaults_its_ranks_rings_before_the_workers_map_them(tmp_path: Path) -> None:
    """StartWorkers with flash_bytes_per_rank: the agent allocates its ranks' rings, then
    pre-faults them in the background; a worker's own reserve afterwards allocates nothing."""
    from unbroken.agent.flash import NodeFlash, NodeFlashConfig

    root = tempfile.mkdtemp(prefix="ub-test-", dir="/dev/shm")
    try:
        cfg = NodeFlashConfig(
            root=root, job="j", node="n0", copies=3, persist_url=str(tmp_path / "ckpt")
        )
        node = NodeFlash(cfg, world_size=2)
        nbytes = 3 << 20
        assert node.prepare(range(0, 2), nbytes) >= 0
        assert node.prefault_done.wait(60) and node.prefault_s > 0
        for rank in (0, 1):
            for s in range(3):
                got, pages = _resident(node.owner.rank_dir(rank) / f"slot-{s}.data")
                assert got == pages and pages == nbytes // 4096, (rank, s, got, pages)
        worker_side = FlashOwner(FlashConfig(root=root, job="j"))
        worker_side.reserve(1, nbytes)
        assert worker_side.grown == []
        node.prepare(range(0, 2), nbytes)  # the same rings again: nothing to pre-fault
        assert node.owner.grown == [] and node.prefault_done.is_set()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("watched", [True, False])
def test_a_writer_sees_every_change_another_process_makes_to_its_ring(
    owner: FlashOwner, watched: bool
) -> None:
    """The writer stats only the manifests inotify says changed (`ManifestWatch`); what it
    believes each slot holds must equal a fresh listing after a discard, a copy written
    into the ring by someone else (a fetched replica) and its own saves, with or without
    the watch (`watched=False`: inotify unavailable, every slot statted)."""
    from unbroken.recovery.flashcopy import manifest_sig

    w = FlashWriter(0, owner)
    try:
        for step in (1, 2, 3):
            w.save(_state(step), step).wait()
        rank_dir = w.ring.dir
        assert rank_dir is not None and w.copies >= 4
        if not watched:
            assert w.ring.watch is not None
            w.ring.watch.close()
            w.ring.watch = None

        def listed() -> dict[int, int]:
            return {r.slot: r.manifest.generation for r in list_copies(rank_dir)}

        def agrees() -> None:
            assert w._free_slot(rank_dir) is not None
            assert w.ring.sig == manifest_sig(rank_dir, w.copies)
            assert w.ring.known == listed()

        agrees()
        owner.discard_newer_than(1)  # the agent rolls the ring back
        agrees()
        newest = list_copies(rank_dir)[0]
        data = bytes(read_copy(newest))
        # a replica fetched from a buddy: newer than anything in the ring
        fetched = dataclasses.replace(newest.manifest, generation=newest.manifest.generation + 10)
        write_raw_copy(rank_dir, fetched, data)
        agrees()
        w.save(_state(4), 4).wait()  # the writer's own change
        agrees()
        held = {r.manifest.step for r in list_copies(rank_dir)}
        assert {1, 4} <= held, held  # the fetched copy (step 1, newest generation) kept
    finally:
        w.close()


def test_the_manifest_watch_names_changed_slots_and_gives_up_when_the_ring_goes(
    tmp_path: Path,
) -> None:
    from unbroken.recovery.manifestwatch import ManifestWatch

    watch = ManifestWatch.open(tmp_path)
    if watch is None:
        pytest.skip("no inotify here")
    try:
        assert watch.changed() == set()
        (tmp_path / ".slot-3.manifest.tmp").write_bytes(b"m")
        (tmp_path / ".slot-3.manifest.tmp").replace(tmp_path / "slot-3.manifest")
        (tmp_path / "slot-1.data").write_bytes(b"d")  # data files do not count
        (tmp_path / "slot-x.manifest").write_bytes(b"?")  # nor names that are no slot
        assert watch.changed() == {3}
        (tmp_path / "slot-3.manifest").unlink()
        assert watch.changed() == {3}
        assert watch.changed() == set()
        shutil.rmtree(tmp_path)
        assert watch.changed() is None  # the directory is gone: stat every slot
        assert watch.changed() is None
    finally:
        watch.close()


def test_a_counter_is_framed_as_torch_save_frames_it() -> None:
    from unbroken.recovery.flashcopy import load_object
    from unbroken.recovery.flashplan import dump_object as _dump_object

    for value in (0, 7, -3, 2**70):
        out = io.BytesIO()
        torch.save(value, out, _use_new_zipfile_serialization=False)
        assert _dump_object(value) == out.getvalue()
        assert load_object(_dump_object(value)) == value


def test_the_fresh_values_flatten_as_dcp_flattens_them() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from unbroken.trainer.flashckpt import _flatten_into

    rng = torch.zeros(4, dtype=torch.uint8)
    for state in (
        {"step": 3, "data": {"sample_index": 8, "seed": 1, "digest": "ab"}, "rng": rng},
        {"empty": {}, "t": (1, 2), "n": None, 1: {2: 3.0}},
    ):
        out: dict[str, Any] = {}
        assert _flatten_into(out, "trainer", state)
        dcp = dict(flatten_state_dict({"trainer": state})[0])
        assert list(out) == list(dcp) and all(out[k] is dcp[k] for k in dcp)
    for state in ({"a": [1, 2]}, {"a.b": 1, "a": {"b": 2}}):  # DCP's own cases
        assert not _flatten_into({}, "trainer", state)


def test_a_copy_its_thread_has_not_started_is_made_by_the_thread_that_needs_it(
    owner: FlashOwner,
) -> None:
    """The copy and checksum threads run at idle priority and may not have run when the
    optimizer needs the tensors or someone waits for the copy: the waiting thread then
    does the work itself, and the writer's thread, when it gets to it, does not redo it."""
    w = FlashWriter(0, owner)
    gate = threading.Event()
    try:
        state = _state(1)
        w.prepare(state)
        w._pool.submit(gate.wait, 30)  # both threads are busy (starved)
        w._sums.submit(gate.wait, 30)
        h = w.save_async(state, 1)
        assert h is not None and not h.copied()
        w.wait_copied(5.0)  # what the optimizer guard calls
        assert h.copied() and not h.done()
        manifest = h.wait(5.0)  # the checksum and manifest, on this thread
        assert manifest.step == 1 and h.done() and not gate.is_set()
        gate.set()
        w.save_async(_state(2), 2).wait(10.0)  # type: ignore[union-attr]  # the threads go on
        back = _state(9)
        w.load(back, step=1)
        assert torch.equal(back["model"]["w"], state["model"]["w"])
    finally:
        gate.set()
        w.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_writer_threads_run_at_idle_priority_unless_told_not_to(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unbroken.recovery.flash import IDLE_THREADS_ENV

    def policies() -> set[int]:
        w = FlashWriter(0, owner)
        try:
            w.save_async(_state(1), 1).wait(10.0)  # type: ignore[union-attr]
            threads = [*w._pool._threads, *w._sums._threads]  # type: ignore[attr-defined]
            return {os.sched_getscheduler(t.native_id) for t in threads}
        finally:
            w.close()

    assert policies() == {os.SCHED_IDLE}
    monkeypatch.setenv(IDLE_THREADS_ENV, "0")
    assert policies() == {os.SCHED_OTHER}


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux CPU affinity and two CPUs",
)
def test_the_copy_thread_follows_the_training_threads_core_unless_told_not_to(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each save pins the copy thread to the core the training thread saved from (its reads
    of the state stay in that core's cache); `UNBROKEN_FLASH_FOLLOW_CORE=0` leaves it free.
    Only the copy thread is pinned: the training thread's own affinity is never touched."""
    from unbroken.common.loopthread import current_cpu
    from unbroken.recovery.flash import FOLLOW_CORE_ENV

    allowed = sorted(os.sched_getaffinity(0))
    saver_cpus: list[int | None] = []
    copier_cpus: list[set[int]] = []

    def saver(w: FlashWriter, cpu: int, step: int) -> None:
        os.sched_setaffinity(0, {cpu})  # this test thread only: it plays the training thread
        saver_cpus.append(current_cpu())
        w.save_async(_state(step), step).wait(10.0)  # type: ignore[union-attr]
        # `wait` runs a copy the (idle-priority) copy thread has not started yet itself, so
        # on a busy host it can return before that thread took the job: a no-op queued
        # behind it returns once the thread has run it (and pinned itself first)
        w._pool.submit(lambda: None).result(10.0)  # type: ignore[attr-defined]
        (copier,) = w._pool._threads  # type: ignore[attr-defined]
        copier_cpus.append(os.sched_getaffinity(copier.native_id))

    def run(w: FlashWriter) -> None:
        try:
            # the copy thread starts here, unpinned (threads inherit their creator's mask)
            w.save_async(_state(0), 0).wait(10.0)  # type: ignore[union-attr]
            for step, cpu in enumerate((allowed[0], allowed[1], allowed[0]), start=1):
                t = threading.Thread(target=saver, args=(w, cpu, step))
                t.start()
                t.join(30.0)
        finally:
            w.close()

    before = os.sched_getaffinity(0)
    run(FlashWriter(0, owner))
    assert saver_cpus == [allowed[0], allowed[1], allowed[0]]
    assert copier_cpus == [{allowed[0]}, {allowed[1]}, {allowed[0]}]
    assert os.sched_getaffinity(0) == before

    saver_cpus.clear()
    copier_cpus.clear()
    monkeypatch.setenv(FOLLOW_CORE_ENV, "0")
    run(FlashWriter(0, owner))
    assert copier_cpus == [set(allowed)] * 3


def test_a_rank_sent_by_several_buddies_is_read_from_the_store_written_last(
    owner: FlashOwner,
) -> None:
    """Each world's buddy of a rank sends it into its own store here; the live timeline's
    copies are the newest made, whatever the stores' listing order."""
    from unbroken.trainer.flashckpt import replica_dirs

    w = FlashWriter(1, owner)
    w.save(_state(1), 275).wait()
    stale = find_copy(owner.rank_dir(1))
    data = stale.data_path.read_bytes()[: stale.manifest.data_nbytes]
    for name in ("a-gone", "z-gone"):  # listed before or after the live one
        write_raw_copy(owner.rank_dir(1, replica_store(name)), seal(stale), data)
    time.sleep(0.01)
    w.save(_state(2), 2012).wait()
    w.close()
    live = find_copy(owner.rank_dir(1), 2012)
    fresh = live.data_path.read_bytes()[: live.manifest.data_nbytes]
    write_raw_copy(owner.rank_dir(1, replica_store("m-live")), seal(live), fresh)
    got = replica_dirs(owner, replica_store("this-node"))
    assert got == {1: owner.rank_dir(1, replica_store("m-live"))}
    assert [c.manifest.step for c in list_copies(got[1])] == [2012]
