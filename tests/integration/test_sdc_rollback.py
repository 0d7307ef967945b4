"""A bit flipped in one rank's parameters is found from the fingerprints and rolled back to
the newest verified step before it (docs/sdc.md), end to end.

`unbroken driver --nodes 2 --dp 2` runs the tiny trainer with `--dp-mode replicate` (the
two ranks hold the same bytes) and `--fingerprint-every 5` on two `unbroken agent` processes
with a ring of 16 copies, on the session's etcd. Once steps are verified (StepVerified in
the log), `InjectFault sdc` (the operator RPC) makes n1's agent write its worker's fault
file: after step S the worker flips bit 22 of one parameter element (the top mantissa bit:
the element moves by half, the loss does not). Nothing else is sent by the test:

- the next fingerprinted step at or after S disagrees: the driver's fingerprint watch
  appends SdcSuspected (two replicas: both named, unresolved);
- the machine appends Rollback to the newest verified step before S, pauses, and restarts
  the world at it; every worker restores that step and trains on;
- the losses after the resume equal, exactly, an uninterrupted reference run's (the flip is
  gone with the dead timeline).
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from tests.jobs import TRAIN, Job, reference
from unbroken.cli.cluster import read_metrics, until
from unbroken.driver.eventlog import LogUnavailableError
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import driver_pb2_grpc as dgrpc
from unbroken.proto import events_pb2 as ev

pytestmark = pytest.mark.integration

EVERY = 5
SDC_TRAIN = [*TRAIN, "--dp-mode", "replicate", "--fingerprint-every", str(EVERY)]
LEAD = 12  # steps between the injection and the flip: the agent writes the file first
RING = ("--flash-copies", "16")  # a verified step (every 5) stays in every ring


def _inject_sdc(address: str, node: str, step: int) -> str:
    with grpc.insecure_channel(address) as ch:
        req = dpb.InjectFaultRequest(
            node_id=node,
            kind="sdc",
            step=step,
            local_rank=0,
            # a silent flip: bit 30 (the exponent's top) blew the loss up within 6 steps, and
            # on a loaded host the loss-spike rollback came before the fingerprints' verdict
            sdc=dpb.SdcFault(tensor="o0.g0.p1", bit=22, target="param"),
        )
        resp = dgrpc.DriverStub(ch).InjectFault(req, timeout=30)
    assert resp.ok, resp.detail
    return str(resp.detail)


@pytest.mark.timeout(1200)  # the cluster on 2 loaded cores, then a reference run
def test_a_flipped_bit_rolls_back_to_the_newest_verified_step(job: Job, tmp_path: Path) -> None:
    base = job.worker_cmd

    def worker_cmd(dp: int = 2) -> str:
        return base(dp) + f" --dp-mode replicate --fingerprint-every {EVERY}"

    job.worker_cmd = worker_cmd  # type: ignore[method-assign]
    job.start_driver()
    job.start_agent("n0", buddy="n1", extra=RING)
    job.start_agent("n1", buddy="n0", extra=RING)

    def read_events() -> list[ev.Event]:
        """The job's events; none when etcd did not answer in time (a loaded host)."""
        try:
            return job.events()
        except LogUnavailableError:
            return []

    def verified() -> list[int]:
        return [e.step_verified.step for e in read_events() if e.HasField("step_verified")]

    until(lambda: len(verified()) >= 2, 300, "two verified steps", job)
    at = job.max_step() + LEAD
    detail = _inject_sdc(job.address, "n1", at)
    assert "local rank 0" in detail, detail

    def resumed_after_rollback() -> bool:
        kinds = [e.WhichOneof("payload") for e in read_events()]
        return "rollback" in kinds and "training_resumed" in kinds[kinds.index("rollback") :]

    until(resumed_after_rollback, 300, "the rollback's resume", job)
    events = job.events()
    k = next(i for i, e in enumerate(events) if e.HasField("sdc_suspected"))
    sdc = events[k].sdc_suspected
    text = job.worker_log("n1")
    applied = [int(m) for m in re.findall(r"sdc fault applied.*?step=(\d+)", text)]
    assert len(applied) == 1 and applied[0] >= at, (applied, at, text[-3000:])
    flipped = applied[0]
    # found at the first fingerprinted step at or after the flip (within one interval)
    assert flipped <= sdc.step < flipped + EVERY + 1 and sdc.step % EVERY == 0, (sdc, flipped)
    assert sorted(sdc.suspect_ranks) == [0, 1] and not sdc.resolved, sdc
    assert sdc.keys, sdc
    good = [e.step_verified.step for e in events[:k] if e.HasField("step_verified")]
    assert good and max(good) < flipped, (good, flipped)
    rollback = next(e.rollback for e in events[k:] if e.HasField("rollback"))
    assert rollback.from_step == sdc.step and rollback.skip_batches == 0
    # the newest verified step every rank holds (a fingerprinted copy is never skipped for a
    # busy ring, so on a quiet host that is the newest verified step itself)
    held = set(sdc.memory_steps) | {
        e.checkpoint_committed.step for e in events[:k] if e.HasField("checkpoint_committed")
    }
    assert rollback.to_step == max(set(good) & held), (rollback, good, sdc.memory_steps)
    resumed = next(e.training_resumed for e in events[k:] if e.HasField("training_resumed"))
    assert resumed.at_step == rollback.to_step, (resumed, rollback)
    for node in ("n0", "n1"):
        restored = [
            int(m) for m in re.findall(r"flash\.restored.*?step=(\d+)", job.worker_log(node))
        ]
        assert restored and restored[-1] == rollback.to_step, (node, restored)

    until(lambda: job.max_step() >= sdc.step + 2 * EVERY, 300, "training past the flip", job)
    # after the resume the replicas agree again: steps past the flip are verified
    until(lambda: max(verified()) > sdc.step, 120, "a verified step after the resume", job)
    assert len([e for e in job.events() if e.HasField("sdc_suspected")]) == 1

    # The losses of the new timeline equal an uninterrupted run's.
    lines = job.metrics.read_text().splitlines()
    # the new timeline: from the last time the step after the target was trained
    again = max(i for i, line in enumerate(lines) if f'"step": {rollback.to_step + 1},' in line)
    tail = job.tmp / "after.jsonl"
    tail.write_text("\n".join(lines[again:]) + "\n")
    got = {s: losses[0] for s, losses in read_metrics(tail).items()}
    last = max(got)
    job.close()
    want = reference(tmp_path / "ref", last, train=SDC_TRAIN)
    assert got and all(got[s] == want[s] for s in got), (got, want)
