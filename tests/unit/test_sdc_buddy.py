"""The buddy's third opinion on silent data corruption (docs/sdc.md): the buddy recomputes a
rank's fingerprints and the replay of its weights from the rank's real flash copy, and the
driver's judge names the rank whose own report differs from its buddy's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import structlog

from tests.sdcharness import Trainer, save_fingerprinted, shm_owner
from unbroken.common.sdckeys import REPLAY_SS, bits_float, float_bits, replay_agrees
from unbroken.driver import sdc as sdclib
from unbroken.recovery import sdcbuddy
from unbroken.recovery.flash import FlashWriter
from unbroken.recovery.flashcopy import CopyRef, find_copy, write_manifest
from unbroken.recovery.flashowner import FlashOwner
from unbroken.recovery.sdcbuddy import BuddyOpinions, opinion_messages
from unbroken.recovery.statehash import SDC_META
from unbroken.trainer import sdc

pytestmark = pytest.mark.unit


@pytest.fixture
def owner() -> Iterator[FlashOwner]:
    with shm_owner() as o:
        yield o


def test_the_buddys_recomputation_of_a_copy_equals_the_ranks_report(owner: FlashOwner) -> None:
    t = Trainer()
    report, ref = save_fingerprinted(owner, t, 10)
    buddy = BuddyOpinions()
    op = buddy.form("n0", ref)
    assert op is not None and not op.error, op
    assert (op.node, op.rank, op.step) == ("n0", 0, 10)
    # every replica key and the replay; the probe is the rank's own device's alone
    assert set(op.fingerprints) == set(report) - {sdc.PROBE_KEY}
    for k in op.fingerprints:
        assert op.fingerprints[k] == report[k], k  # CPU and CPU: even the replay bitwise
    assert sdclib.buddy_says(report, op.fingerprints) == ""
    msg = opinion_messages(buddy.to_send())[0]
    assert (msg.node, msg.fingerprint.global_rank, msg.fingerprint.step) == ("n0", 0, 10)
    assert dict(zip(msg.fingerprint.keys, msg.fingerprint.hashes, strict=True)) == {
        k: v & ((1 << 64) - 1) for k, v in op.fingerprints.items()
    }


def test_a_copy_written_over_while_its_opinion_forms_gets_none(
    owner: FlashOwner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica server receives on while an opinion forms, and its ring of two slots
    reuses a slot two copies later: when the copy's slot was written over meanwhile, what
    was read may be part of either copy, so the buddy forms no opinion of it (and says so)."""
    t = Trainer()
    _, ref = save_fingerprinted(owner, t, 10)
    real = sdcbuddy.recompute

    def overwritten(r: CopyRef, meta: dict[str, Any], device: str) -> Any:
        out = real(r, meta, device)
        newer = replace(r.manifest, generation=r.manifest.generation + 2, step=12)
        write_manifest(r.rank_dir, r.slot, newer)  # a newer copy took the slot meanwhile
        return out

    monkeypatch.setattr(sdcbuddy, "recompute", overwritten)
    buddy = BuddyOpinions()
    with structlog.testing.capture_logs() as logs:
        assert buddy.form("n0", ref) is None
    assert (buddy.formed, buddy.failed, buddy.skipped) == (0, 0, 1)
    assert buddy.to_send() == []
    assert [e["step"] for e in logs if e["event"] == "sdc.buddy_opinion_skipped"] == [10]


def test_a_flip_in_the_copy_alone_is_named_by_the_buddy(owner: FlashOwner) -> None:
    t = Trainer()
    report, ref = save_fingerprinted(owner, t, 10, flip_in_copy=True)
    assert sdc.Fingerprinter(t).compute() == report  # the live state is right
    op = BuddyOpinions().form("n0", ref)
    assert op is not None and not op.error
    why = sdclib.buddy_says(report, op.fingerprints)
    assert "differ from its copy's" in why, why


def test_a_wrong_matmul_on_the_rank_is_named_by_the_replay(owner: FlashOwner) -> None:
    t = Trainer()
    fault = sdc.MatmulFault()
    fault.set(1e-3)
    try:
        report, ref = save_fingerprinted(owner, t, 10)
    finally:
        fault.set(0)
    op = BuddyOpinions().form("n0", ref)
    assert op is not None and not op.error
    # the state's bytes agree (the fault only touched this replay), the replay does not
    assert all(op.fingerprints[k] == report[k] for k in op.fingerprints if k[0] != "~")
    assert sdclib.buddy_says(report, op.fingerprints).startswith("its replay")


def test_a_copy_without_its_tensors_gives_an_error_not_an_opinion(owner: FlashOwner) -> None:
    t = Trainer()
    w = FlashWriter(0, owner)
    meta = {"step": 5, "keys": [["all", ["model.nothing"]]], "params": []}
    w.save(t.state(), step=5, meta={SDC_META: meta}).wait()
    w.close()
    op = BuddyOpinions().form("n0", find_copy(owner.rank_dir(0), 5))
    assert op is not None and "no tensor 'model.nothing'" in op.error and not op.fingerprints


def test_replay_tolerance() -> None:
    a = {REPLAY_SS: float_bits(1000.0), "~replay.proj": float_bits(3.0)}
    near = {REPLAY_SS: float_bits(1000.0 * (1 + 1e-6)), "~replay.proj": float_bits(3.0001)}
    off = {REPLAY_SS: float_bits(1000.0 * (1 + 2e-3)), "~replay.proj": float_bits(3.0)}
    assert replay_agrees(a, near) and not replay_agrees(a, off)
    assert replay_agrees(a, {}) and bits_float(float_bits(-2.5)) == -2.5


# ---------------------------------------------------------------- the judge and the book
def _fp(state: int, replay: float = 1.0) -> dict[str, int]:
    return {"k": state, "probe": 7, REPLAY_SS: float_bits(replay)}


def test_a_tie_of_two_replicas_is_resolved_by_the_buddies() -> None:
    reports = {0: _fp(1), 1: _fp(2)}
    alone = sdclib.judge(20, reports)
    assert alone.suspects == (0, 1) and not alone.resolved  # two replicas: no majority
    # rank 1's buddy finds in its copy the state rank 0 has: rank 1's report is the odd one
    v = sdclib.judge(20, reports, opinions={0: _fp(1), 1: _fp(1)})
    assert v.suspects == (1,) and v.resolved and not v.verified, v
    assert "buddy:1" in v.keys and v.checked == 1
    # both consistent with their copies: the state differs, the copies cannot say who
    v = sdclib.judge(20, reports, opinions={0: _fp(1), 1: _fp(2)})
    assert v.suspects == (0, 1) and not v.resolved and v.checked == 2


def test_a_rank_without_replicas_is_checked_by_its_buddy() -> None:
    reports = {0: {"m0": 1, "probe": 7}, 1: {"m1": 2, "probe": 7}}  # pure FSDP
    assert not sdclib.judge(5, reports).disagreed
    v = sdclib.judge(5, reports, opinions={0: {"m0": 1}, 1: {"m1": 3}})
    assert v.suspects == (1,) and v.resolved and not v.verified
    ok = sdclib.judge(5, reports, opinions={0: {"m0": 1}, 1: {"m1": 2}})
    assert not ok.disagreed and ok.checked == 2 and ok.verified  # verified by the buddies
    half = sdclib.judge(5, reports, opinions={0: {"m0": 1}})
    assert not half.disagreed and not half.verified  # rank 1 compared with nobody


def test_a_replay_off_on_one_rank_names_it_though_the_states_agree() -> None:
    reports = {0: _fp(1, replay=1.0), 1: _fp(1, replay=1.002)}  # its matmuls are wrong
    v = sdclib.judge(5, reports, opinions={0: _fp(1, 1.0), 1: _fp(1, 1.0)})
    assert v.suspects == (1,) and v.resolved and "replay" in v.detail


def test_the_book_waits_for_the_buddies_of_a_tie_then_judges_without_them() -> None:
    book = sdclib.FingerprintBook(2, opinion_wait_s=5.0)
    book.add(0, 20, _fp(1))
    book.add(1, 20, _fp(2))
    assert book.ready(now=100.0) == []  # a tie: wait for the buddies
    book.add_opinion(1, 20, _fp(1))
    assert book.ready(now=101.0) == []  # rank 0's buddy still to come
    book.add_opinion(0, 20, _fp(1))
    (v,) = book.ready(now=101.5)
    assert v.suspects == (1,) and v.resolved
    # without opinions the wait ends: the tie is judged unresolved
    book = sdclib.FingerprintBook(2, opinion_wait_s=5.0)
    book.add(0, 20, _fp(1))
    book.add(1, 20, _fp(2))
    assert book.ready(now=100.0) == []
    (v,) = book.ready(now=105.0)
    assert v.suspects == (0, 1) and not v.resolved


def test_the_book_judges_at_once_without_buddies_and_waits_once_it_has_them() -> None:
    book = sdclib.FingerprintBook(2)
    book.add(0, 5, _fp(1))
    book.add(1, 5, _fp(1))
    (v,) = book.ready(now=0.0)  # agreement, and no buddy has spoken: judged now
    assert v.verified
    book.add_opinion(0, 10, _fp(1))
    book.add_opinion(1, 10, {})  # its buddy could form none (an error): answered
    book.add(0, 10, _fp(1))
    book.add(1, 10, _fp(1))
    (v,) = book.ready(now=0.0)
    assert v.verified and v.checked == 1
    book.add(0, 15, _fp(1))
    book.add(1, 15, _fp(1))
    assert book.ready(now=1.0) == []  # buddies exist: wait for theirs
    (v,) = book.ready(now=1.0 + sdclib.OPINION_WAIT_S)
    assert v.verified and v.checked == 0
