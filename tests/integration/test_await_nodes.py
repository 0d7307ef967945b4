"""Below --min-nodes the job waits for nodes, then fails: real driver, etcd and agents.

The job (tests/jobs.py: `unbroken driver --nodes 2 --min-nodes 2`, two `unbroken agent
--no-start`, no spare, the tiny trainer flash-saving every step) loses n1's agent
(SIGKILL). No world of two nodes can be built, so the reshape waits: `unbroken status`
says WAITING FOR NODES and what for. n1's agent starts again: its registration ends the
wait, the world is built again and every rank restores the step the loss stopped at (n1's
from its buddy's replica), and the losses stay the uninterrupted run's, bit for bit. Lost
again and not back within `--await-nodes-s`, the job fails with the reason
(`NodeWaitExpired`). Before, the job failed at once: a CI host once stalled all three
agents of a chaos job 3-4 s, each was declared lost and the job FAILED for good while the
three came back a moment later.
"""

from __future__ import annotations

import pytest

from tests.jobs import Job, reference
from unbroken.cli.cluster import until
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

AWAIT_S = 12  # long enough for an agent to start again on a busy 2-core host


def _status(job: Job) -> dpb.GetStatusResponse | None:
    return job.rpc("driver", "GetStatus", dpb.GetStatusRequest())  # type: ignore[no-any-return]


def _lose_n1(job: Job) -> int:
    """SIGKILL n1's agent; wait until the reshape waits for nodes; the step it stopped at."""
    job.kill("n1")
    st = until(
        lambda: (s := _status(job)) is not None and s.awaiting_nodes and s,
        60,
        "the reshape to wait for nodes",
        job,
    )
    assert st.phase == ev.PHASE_DIAGNOSED, st
    assert "min_nodes is 2" in st.awaiting_nodes and "--await-nodes-s" in st.awaiting_nodes
    assert "away: ['n1']" in st.awaiting_nodes, st.awaiting_nodes
    return int(st.step)


def test_below_min_nodes_the_job_waits_for_a_node_and_fails_once_the_wait_runs_out(
    job: Job,
) -> None:
    job.start_driver("--min-nodes", "2", "--await-nodes-s", str(AWAIT_S))
    job.start_agent("n0", buddy="n1")
    job.start_agent("n1", buddy="n0")
    until(lambda: job.max_step() >= 3, 120, "training to start", job)

    # 1. n1 is lost: the job waits (the CLI says so), and n1's return ends the wait
    resumes = len(job.payloads("training_resumed"))
    stopped = _lose_n1(job)
    out = job.cli("status")
    assert out.returncode == 0 and "WAITING FOR NODES" in out.stdout, out.stdout + out.stderr
    job.start_agent("n1", buddy="n0")
    until(
        lambda: len(job.payloads("training_resumed")) > resumes and job.max_step() >= stopped + 3,
        120,
        "training again on both nodes after n1's return",
        job,
    )
    back = job.max_step()
    resumed = job.payloads("training_resumed")[-1]
    assert sorted(resumed.world.node_ids) == ["n0", "n1"] and resumed.world.dp == 2, resumed
    assert not job.payloads("job_finished") and not job.payloads("node_wait_expired")

    # 2. lost again and not back in time: the job fails with the reason
    _lose_n1(job)
    until(lambda: job.payloads("job_finished"), AWAIT_S + 60, "the wait to run out", job)
    (expired,) = job.payloads("node_wait_expired")
    assert expired.waited_s >= AWAIT_S, expired
    (fin,) = job.payloads("job_finished")
    assert not fin.ok and "--await-nodes-s" in fin.reason and "unbroken resume" in fin.reason
    st = _status(job)
    assert st is not None and st.phase == ev.PHASE_FAILED and not st.awaiting_nodes, st

    # every step ran once its restore was done, and each loss is the uninterrupted run's
    got = job.steps()
    last = max(got)
    assert last >= back and sorted(got) == list(range(1, last + 1)), sorted(got)
    ref = reference(job.tmp / "reference", last)
    for step, values in got.items():
        assert set(values) == {ref[step]}, (step, values, ref[step])
