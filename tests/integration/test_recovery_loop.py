"""The recovery loop end to end: a real driver process recovers a worker crash and a lost node.

`unbroken driver --nodes 2 --dp 2` (on the session's real etcd) starts the job itself on
two `unbroken agent --no-start` processes (one worker each: the tiny trainer, dp2,
flash-saving every step) and keeps a third agent registered as a spare. Nothing in this
test sends a command: the driver's loop does everything.

1. A worker is SIGKILLed: the loop stops both workers and restarts them with a fresh
   master port; they restore from flash memory and training continues past the crash.
2. A node's agent is SIGKILLed (its worker dies with it): the spare takes its rank and
   restores from the buddy replica or storage; training continues.

Every step that ran twice (before a crash and again after the restore) has the same loss
both times (deterministic data; the restored state is exact). The log holds the
transitions, the spare's assignment, the world change and two TrainingResumed after the
start's.
"""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest

from tests.jobs import Job, reference
from unbroken.cli.cluster import until
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev
from unbroken.recovery.lifecycle import PersistPolicy

pytestmark = pytest.mark.integration


def test_worker_crash_and_lost_node_are_recovered(job: Job) -> None:
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    # the spare's own buddy is n1, the node it will replace: n1's copies are on n0, and the
    # driver tells the spare so (n1's registration named its replica holder)
    job.start_agent("s0", buddy="n1", spare=True)
    until(lambda: job.max_step() >= 3, 120, "training to start", job)

    # 1. A worker crash: both workers restart and restore; training goes on.
    victim = job.worker("n1")
    assert victim is not None
    victim.kill()
    crash_step = job.max_step()
    until(
        lambda: (
            (w := job.worker("n1")) is not None
            and w.pid != victim.pid
            and job.max_step() >= crash_step + 3
        ),
        120,
        "training past the crash",
        job,
    )
    # each agent rescanned its ring after the stop and said so in its ack (the heartbeat
    # with the rings came first), so the driver waited for no later heartbeat
    paused = [ln for ln in job.log("driver").splitlines() if "workers paused" in ln]
    assert paused and "rings_fresh=['n0', 'n1']" in paused[0], paused

    # 2. A lost node: the spare takes its place.
    job.procs["n1"].kill()  # SIGKILL the agent; its worker dies with it
    job.procs["n1"].wait(10)
    lost_step = job.max_step()
    until(
        lambda: job.worker("s0") is not None and job.max_step() >= lost_step + 3,
        150,
        "the spare to train past the loss",
        job,
    )
    assert "restored" in job.worker_log("s0"), job.worker_log("s0")[-3000:]
    took = [ln for ln in job.log("s0").splitlines() if "flash.took_over" in ln]
    assert took and f"source=127.0.0.1:{job.port('n0')}" in took[0], took

    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    # the restore after the loss counted the copies n0 held of n1's rank (its heartbeats list
    # them): a step a few saves old, not the newest commit (this job's first step)
    lost_at = kinds.index("node_lost")
    restore = next(e.restore_started for e in events[lost_at:] if e.HasField("restore_started"))
    assert restore.step >= lost_step - 12 and restore.step > 1, (restore, lost_step)
    # what the restart really lost: the step the ranks say they restored (their workers'
    # logs agree), never older than the plan
    finished = next(e.restore_finished for e in events[lost_at:] if e.HasField("restore_finished"))
    restored = [
        int(re.findall(r"flash\.restored.*?\bstep=(\d+)", job.worker_log(n))[-1])
        for n in ("n0", "s0")
    ]
    assert finished.ok and finished.step == restore.step, (finished, restore)
    assert finished.restored_step == min(restored) >= restore.step, (finished, restored)
    # ... and counted the ranks that read storage as the ranks said (n0 restores from its
    # own ring, the spare from n1's copies that n0 held, unless only storage had the step):
    # the incidents that count toward the persistence interval's failure rate
    sources = [
        re.findall(r"flash\.restored.*?source=(\w+)", job.worker_log(n))[-1] for n in ("n0", "s0")
    ]
    assert finished.storage_ranks == sources.count("storage"), (finished, sources)
    crash = next(e.restore_finished for e in events[:lost_at] if e.HasField("restore_finished"))
    assert crash.ok and crash.storage_ranks == 0, crash  # both ranks from their own rings
    assert kinds.count("job_started") == 1
    resumed = [e.training_resumed for e in events if e.HasField("training_resumed")]
    assert len(resumed) >= 3, kinds  # the start, after the crash, after the loss
    start = next(e.job_started.world for e in events if e.HasField("job_started"))
    replaced = ["s0" if n == "n1" else n for n in start.node_ids]  # the spare in n1's rank
    assert sorted(start.node_ids) == ["n0", "n1"], start
    assert list(resumed[-1].world.node_ids) == replaced, resumed[-1]
    spares = [e.spare_assigned for e in events if e.HasField("spare_assigned")]
    assert [(s.spare_node_id, s.replaces_node_id) for s in spares] == [("s0", "n1")]
    assert "world_resized" in kinds and "worker_failed" in kinds and "node_lost" in kinds
    phases = [
        ev.Phase.Name(e.recovery_transition.to_phase)
        for e in events
        if e.HasField("recovery_transition")
    ]
    for p in ("PHASE_SUSPECTED", "PHASE_DIAGNOSED", "PHASE_RESHAPED"):
        assert p in phases, phases
    assert "training_paused" in kinds and "restore_started" in kinds

    # The persistence interval: the commits carry their persist time (the job's first
    # save at least), every leader folds it, and with no storage-served incident the
    # MTBF it is computed from is the prior's (wall time plus a day over one).
    commits = [e.checkpoint_committed for e in events if e.HasField("checkpoint_committed")]
    assert commits and all(c.persist_s > 0 for c in commits), commits
    with grpc.insecure_channel(job.address) as ch:
        st = dgrpc.DriverStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=30)
    prior = PersistPolicy().prior_mtbf_s
    assert st.persist_cost_s > 0 and st.storage_mtbf_s >= prior, st
    assert PersistPolicy().floor_s <= st.persist_every_s <= PersistPolicy().ceiling_s, st

    # Every step's loss, before and after each restore, equals an uninterrupted run's.
    got = job.steps()
    last = max(got)
    assert sorted(got) == list(range(1, last + 1)), sorted(got)
    ref = reference(job.tmp / "reference", last)
    for step, values in got.items():
        for v in values:
            assert v == ref[step], (step, v, ref[step])


def test_an_operator_eviction_starts_the_recovery_at_once(job: Job) -> None:
    """`unbroken evict n1`: the spare takes n1's rank without waiting for a NodeLost."""
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    job.start_agent("s0", buddy="n0", spare=True)
    until(lambda: job.max_step() >= 3, 120, "training to start", job)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken.cli.main",
            "evict",
            "n1",
            "--driver",
            job.address,
            "--reason",
            "bad ECC counts",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "recovery loop" in out.stdout, out.stdout
    evicted_step = job.max_step()
    until(
        lambda: job.worker("s0") is not None and job.max_step() >= evicted_step + 3,
        150,
        "the spare to train past the eviction",
        job,
    )
    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    at = kinds.index("operator_action")
    after = events[at:]
    evicted = next(i for i, e in enumerate(after) if e.HasField("node_evicted"))
    assert after[evicted].node_evicted.node_id == "n1"
    spare = next(i for i, e in enumerate(after) if e.HasField("spare_assigned"))
    assert (
        after[spare].spare_assigned.spare_node_id,
        after[spare].spare_assigned.replaces_node_id,
    ) == ("s0", "n1")
    assert evicted < spare
    lost = [
        i for i, e in enumerate(after) if e.HasField("node_lost") and e.node_lost.node_id == "n1"
    ]
    # no NodeLost was needed to start it, and none came after: the evicted node's agent
    # exits on the command, which is its departure, not a loss
    assert not lost, kinds[at:]
    assert job.procs["n1"].wait(timeout=30) is not None  # the agent left
    assert after[0].operator_action.action == "evict"
    assert after[1].HasField("recovery_transition"), kinds[at:]  # decided in the same breath


def test_after_an_eviction_the_world_is_paired_again_and_a_later_loss_restores_from_memory(
    job: Job,
) -> None:
    """Every node's --buddy names n1, which is evicted: the driver pairs the new world
    (n0 and a spare) in a ring when it starts it, so n0 replicates to that spare from then
    on; when n0 is lost too, the other spare gets n0's copies from the first, not from the
    server that left.
    (Before, every node kept sending to the evicted node's closed port, and the recovery
    bench's next node loss restored from storage, 195 steps back.)"""
    job.start_driver()
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    job.start_agent("s0", buddy="n1", spare=True)
    job.start_agent("s1", buddy="n1", spare=True)
    until(lambda: job.max_step() >= 3, 120, "training to start", job)
    out = subprocess.run(
        [sys.executable, "-m", "unbroken.cli.main", "evict", "n1", "--driver", job.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    evicted_step = job.max_step()

    def first_spare() -> str:
        got = [e.spare_assigned for e in job.events() if e.HasField("spare_assigned")]
        return got[0].spare_node_id if got else ""

    first = until(first_spare, 60, "a spare for n1", job, poll_s=0.5)
    second = "s1" if first == "s0" else "s0"
    until(
        lambda: job.worker(first) is not None and job.max_step() >= evicted_step + 3,
        150,
        "the spare to train past the eviction",
        job,
    )
    until(
        lambda: any(
            "replica.stored" in ln and "node=n0" in ln for ln in job.log(first).splitlines()
        ),
        60,
        f"{first} to hold n0's copies (n0 paired with it)",
        job,
    )
    changed = [ln for ln in job.log("n0").splitlines() if "flash.buddy_changed" in ln]
    assert changed and f"new=127.0.0.1:{job.port(first)}" in changed[-1], changed

    job.procs["n0"].kill()  # SIGKILL the agent; its worker dies with it
    job.procs["n0"].wait(10)
    lost_step = job.max_step()
    until(
        lambda: job.worker(second) is not None and job.max_step() >= lost_step + 3,
        150,
        "the second spare to train past the loss",
        job,
    )
    took = [ln for ln in job.log(second).splitlines() if "flash.took_over" in ln]
    assert took and f"source=127.0.0.1:{job.port(first)}" in took[-1], took
    events = job.events()
    kinds = [e.WhichOneof("payload") for e in events]
    lost_at = kinds.index("node_lost")
    restore = next(e.restore_started for e in events[lost_at:] if e.HasField("restore_started"))
    # a step a few saves old, from memory and the buddy's copies, not the newest commit
    assert restore.step >= lost_step - 12, (restore, lost_step)
    assert "storage" not in set(restore.source_by_rank.values()), restore
