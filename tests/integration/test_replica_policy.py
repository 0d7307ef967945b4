"""The replica policy end to end: the other replica trains on through a killed worker.

`unbroken driver --nodes 2 --dp 2 --keep-training --replica-rejoin-s 1.5` runs the tiny
trainer on two `unbroken agent --no-start` processes (one worker each) on the session's real
etcd; real processes, gloo; nothing in the test sends a recovery command.

Rank 0's worker is SIGKILLed. The machine does not wait for a replacement: its node sits
out, and the other worker (rank 1) leaves the dp2 world, rejoins a dp1 world as its rank 0
in its own process (the same pid), reshards from memory and trains on alone with the whole
global batch, while the victim's node runs no worker. 1.5 s later the driver releases it
(ReplicaReady), the grow-back brings it in with a new worker that restores the survivor's
newest copy (the survivor kept replicating to it while it sat out), and both train to the
last step; the survivor's worker is still the process it was before the fault.

The global batch stays the same, so every loss stays on the uninterrupted dp2 run's curve
up to the reduction order (dp1 and dp2 sum in a different order: the gap grows with the
steps, from 1e-7 to a few 1e-4 over 300 steps of this model).
"""

from __future__ import annotations

import pytest

from tests.jobs import Job, reference
from unbroken.cli.cluster import until

pytestmark = pytest.mark.integration

STEPS = 120
# relative, on the loss: the reduction order differs between dp1 and dp2 and the gap grows
# with the steps (measured 1e-7 early, 7e-4 by step 300 in one run, 2.7e-3 by step 79 in
# another on a loaded host). A batch skipped or repeated moves a loss by about the spread
# between consecutive batches here (about 10 %), and a broken restore by far more (a
# shard loaded from the wrong half gave 5.6 against 2.9); the steps before the fault must
# match exactly.
TOLERANCE = 1e-2


def _worlds(job: Job) -> list[tuple[int, tuple[str, ...], str]]:
    return [
        (
            e.training_resumed.world.dp,
            tuple(e.training_resumed.world.node_ids),
            e.training_resumed.mode,
        )
        for e in job.events()
        if e.HasField("training_resumed")
    ]


def _start(job: Job) -> None:
    """The driver with the replica policy (the survivor alone 1.5 s) and two agents,
    training."""
    job.start_driver("--keep-training", "--replica-rejoin-s", "1.5", steps=STEPS)
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 5, 180, "training to start", job)


def _world_nodes(job: Job) -> tuple[str, str]:
    """The first world's nodes: (rank 0's, rank 1's)."""
    started = next(e.job_started.world for e in job.events() if e.HasField("job_started"))
    first, second = started.node_ids
    return first, second


def test_a_killed_worker_s_replica_sits_out_while_the_other_trains_on(job: Job) -> None:
    # the survivor sits alone 1.5 s: the dp1 steps' reduction order moves the losses from
    # the dp2 reference's (the longer alone, the larger), and a sharp batch (step 161 of
    # this run, grad norm 54 against 1.2) turned 1e-3 of drift into 6 % of loss
    _start(job)
    # rank 0's node is the victim, so the survivor's rank changes (1 of dp2, then 0 of dp1):
    # it keeps its process all the same, its caches of the old world forgotten
    # (trainer/rejoin.py apply_rejoin) and its shards resharded from the rings
    out, stay = _world_nodes(job)
    kept, victim = job.worker(stay), job.worker(out)
    assert kept is not None and victim is not None

    victim.kill()
    crash_step = job.max_step()
    # the survivor trains on alone, in its own process, while the victim's node has none
    until(
        lambda: (1, (stay,), "in_job") in _worlds(job) and job.max_step() >= crash_step + 3,
        180,
        "the survivor training alone past the crash",
        job,
    )
    alone = job.worker(stay)
    assert alone is not None and alone.pid == kept.pid, (kept.pid, alone)
    # then the replica rejoins by the grow-back
    until(
        lambda: (
            _worlds(job)[-1][0] == 2
            and set(_worlds(job)[-1][1]) == {stay, out}
            and job.worker(out) is not None
        ),
        180,
        "the replica back in a dp2 world",
        job,
    )
    after = job.worker(stay)
    assert after is not None and after.pid == kept.pid, (kept.pid, after)
    # the grow-back may come within 5 steps of the end (the survivor alone ran ~40 steps a
    # second on a quiet host): the job's last step then proves the training on
    grown = job.max_step()
    until(lambda: job.max_step() >= min(grown + 5, STEPS), 180, "training on dp2 again", job)

    events = job.events()
    opened = next(
        e.recovery_transition
        for e in events
        if e.HasField("recovery_transition") and e.recovery_transition.sit_out
    )
    assert list(opened.sit_out) == [out] and opened.mode == "in_job", opened
    assert any(e.HasField("replica_ready") for e in events)
    resized = [e.world_resized for e in events if e.HasField("world_resized")]
    assert [(r.old_world.dp, r.new_world.dp) for r in resized] == [(2, 1), (1, 2)], resized
    why = [
        e.recovery_transition.reason
        for e in events
        if e.HasField("recovery_transition") and e.recovery_transition.incident_id
    ]
    modes = [m for _, _, m in _worlds(job)[1:]]
    assert modes == ["in_job", "in_job"], (_worlds(job), why)

    until(lambda: job.max_step() >= STEPS, 600, "training to its last step", job)
    got = job.steps()
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    ref = reference(job.tmp / "reference", STEPS, total_steps=STEPS)
    for step, values in got.items():
        for v in values:
            if step <= crash_step - 1:  # both ranks saved it before the fault: exact
                assert v == ref[step], (step, v, ref[step])
            assert abs(v - ref[step]) <= TOLERANCE * abs(ref[step]), (step, v, ref[step])
    # the steps redone around the two pauses: none lost beyond the copies at hand
    redone = sum(len(v) - 1 for v in got.values())
    assert redone <= 4, {s: v for s, v in got.items() if len(v) > 1}


def test_a_survivor_whose_rank_moved_reshards_soundly_at_the_next_loss(job: Job) -> None:
    """The survivor goes rank 1 of dp2 -> rank 0 of dp1 -> rank 0 of dp2 in one process; its
    copies must then name rank 0's shard. They named rank 1's (a shard layout cached by the
    mesh, which compares equal across worlds: recovery/flashplan.py), so when the new rank 1
    was lost as well, the dp1 reshard loaded one half twice (bench-recovery's replica mode:
    loss 6 where the curve was at 2, and every rollback restored it broken again)."""
    _start(job)
    out, stay = _world_nodes(job)
    kept, victim = job.worker(stay), job.worker(out)
    assert kept is not None and victim is not None
    victim.kill()
    until(
        lambda: (
            _worlds(job)[-1][0] == 2
            and _worlds(job)[-1][1] == (stay, out)
            and job.worker(out) is not None
        ),
        180,
        "the survivor rank 0 of a dp2 world again",
        job,
    )
    grown = job.max_step()
    until(lambda: job.max_step() >= grown + 5, 180, "training on dp2 again", job)
    again = job.worker(out)
    assert again is not None
    again.kill()  # the survivor, now rank 0, reshards dp2 -> dp1 from its own and the buddy's
    lost = job.max_step()
    until(lambda: job.max_step() >= min(lost + 10, STEPS), 180, "the survivor alone again", job)
    survivor = job.worker(stay)
    assert survivor is not None and survivor.pid == kept.pid, (kept.pid, survivor)
    resized = [e.world_resized for e in job.events() if e.HasField("world_resized")]
    assert [(r.old_world.dp, r.new_world.dp) for r in resized][:3] == [(2, 1), (1, 2), (2, 1)]
    assert not [e for e in job.events() if e.HasField("loss_spike")], "a broken reshard"
    ref = reference(job.tmp / "reference", STEPS, total_steps=STEPS)
    for step, values in job.steps().items():
        for v in values:
            assert abs(v - ref[step]) <= TOLERANCE * abs(ref[step]), (step, v, ref[step])


def test_a_lost_replicas_node_comes_back_on_a_spare_from_the_survivors_memory(job: Job) -> None:
    """The replica's node is lost (its agent SIGKILLed). The survivor trains on alone with
    no buddy (its only peer is gone), so the spare that takes the lost node's place at the
    grow-back holds none of its copies: the spare heals from the survivor over the new
    world's group (trainer/flashckpt.py `_heal`). Before, a spare whose warm standby
    restored before the survivor's first send to it restored the last persisted step
    (step 1), and the job looped on loss spikes (bench-recovery's replica mode)."""
    _start(job)
    stay, out = _world_nodes(job)
    kept = job.worker(stay)
    assert kept is not None

    job.kill(out)  # its worker dies with it (pdeathsig): NodeLost
    until(lambda: (1, (stay,), "in_job") in _worlds(job), 180, "the survivor alone", job)
    # the spare registers after the shrink's start: no ring has it, the survivor sends to nobody
    job.start_agent("s2", buddy=stay, spare=True)
    until(
        lambda: _worlds(job)[-1][:2] == (2, (stay, "s2")) and job.worker("s2") is not None,
        240,
        "the spare in the lost replica's place, dp2 again",
        job,
    )
    healed = next(
        (line for line in job.worker_log("s2").splitlines() if "flash.restored" in line), ""
    )
    # from the survivor over the group, or (when the spare's worker started slower than the
    # survivor's idle flush to its new buddy) from the copy it was sent: never from storage
    assert "source=peer" in healed or "source=buddy" in healed, job.worker_log("s2")[-3000:]
    until(lambda: job.max_step() >= STEPS, 600, "training to its last step", job)
    events = job.events()
    assert not [e for e in events if e.HasField("loss_spike")], "a spike: a restore went back"
    got = job.steps()
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    redone = sum(len(v) - 1 for v in got.values())
    assert redone <= 12, {s: v for s, v in got.items() if len(v) > 1}
    ref = reference(job.tmp / "reference", STEPS, total_steps=STEPS)
    for step, values in got.items():
        for v in values:
            assert abs(v - ref[step]) <= TOLERANCE * abs(ref[step]), (step, v, ref[step])
