"""The whole cluster through the loss of etcd members (docs/testing.md).

The chaos cluster (tests/chaos/harness.py: a leader and a standby driver, two training
agents, the uninterrupted reference run) on a real 3-member etcd cluster. The member the
leader driver is connected to (read from its TCP connections) is SIGKILLed; once it is
restarted and healthy, the member the leader moved to is SIGKILLed too. Each time, with
two members healthy:

- the leader keeps leading: its etcd client moves to a live member and answers as the
  leader again within the lease TTL + 1 s, and no LeaderElected is appended (the lease
  was kept);
- training never pauses: no TrainingPaused in the log, and the step keeps advancing;
- at the end, every acknowledged event is in the log exactly once, the recovery loop's
  states equal the fold of the log, the leader's report equals it (run.py's live checks),
  each step's loss equals the uninterrupted run's, and no process is left behind.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from tests.chaos import checks
from tests.chaos.harness import ChaosCluster, ChaosError
from tests.chaos.run import _check_live, _leftovers
from unbroken.cli.cluster import until
from unbroken.driver.etcd import health

pytestmark = pytest.mark.chaos

TTL_S = 2.0  # the election's default lease (driver/election.py)


def connected_member(c: ChaosCluster, slot: str) -> int | None:
    """The index of the etcd member the driver of `slot` holds a connection to."""
    assert c.etcd_cluster is not None
    ports = {m.client_port: i for i, m in enumerate(c.etcd_cluster.members)}
    try:
        conns = psutil.Process(c.drivers[slot].pid).net_connections(kind="tcp")
    except psutil.Error:
        return None
    live = [
        ports[x.raddr.port]
        for x in conns
        if x.raddr and x.raddr.port in ports and x.status == psutil.CONN_ESTABLISHED
    ]
    return live[0] if len(set(live)) == 1 else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cluster_trains_through_losing_its_drivers_etcd_member_twice(tmp_path: Path) -> None:
    c = ChaosCluster(tmp_path, spares=0, etcd_members=3)
    problems: list[str] = []
    took: list[float] = []
    error: BaseException | None = None
    try:
        c.start()
        assert c.etcd_cluster is not None and c.reader is not None
        until(lambda: c.leader_slot() is not None, 60, "a leader")
        slot = c.leader_slot()
        assert slot is not None
        first = c.reader.read() or []
        elected = sum(e.WhichOneof("payload") == "leader_elected" for e in first)
        killed: list[int] = []
        for _ in range(2):
            until(lambda: connected_member(c, slot) is not None, 30, "the leader's etcd connection")
            index = connected_member(c, slot)
            assert index is not None
            member = c.etcd_cluster.members[index]
            step = c.max_step()
            member.kill()
            t0 = time.monotonic()
            killed.append(index)
            # leading again: connected to a live member and answering as the leader
            until(
                lambda i=index: (
                    connected_member(c, slot) not in (None, i) and c.leader_slot() == slot
                ),
                30,
                "the leader on a live member",
                poll_s=0.05,
            )
            took.append(time.monotonic() - t0)
            until(lambda s=step: c.max_step() >= s + 5, 120, "training to go on", poll_s=0.25)
            member.restart()
            until(lambda m=member: health(m.endpoint), 30, "the member to heal")
        assert len(set(killed)) == 2, f"the same member twice: {killed}"
        problems += _check_live(c)
        events = c.final_events
        kinds = [e.WhichOneof("payload") for e in events]
        if kinds.count("leader_elected") != elected:
            problems.append(f"a leader change: {kinds.count('leader_elected') - elected} more")
        if "training_paused" in kinds:
            problems.append("training paused")
        for i, t in enumerate(took):
            if t > TTL_S + 1.0:
                problems.append(f"kill {i + 1}: leading again after {t:.2f} s > TTL + 1 s")
        last = c.max_step()
        until(
            lambda: max(c.steps(c.ref_metrics), default=0) >= last,
            300,
            f"the reference run to reach step {last}",
            poll_s=0.5,
        )
    except Exception as e:
        error = e
    finally:
        logs = c.logs() if error is not None or problems else ""
        c.stop()
        problems += _leftovers(c)
    if error is None:
        loss_problems, compared = checks.check_losses(
            c.steps(), c.steps(c.ref_metrics), c.final_events
        )
        problems += loss_problems
        print(f"etcd member kills: leading again after {[round(t, 2) for t in took]} s; "
              f"{compared} losses compared")  # fmt: skip
    if error is not None or problems:
        raise ChaosError("\n".join([*(f"problem: {p}" for p in problems), repr(error), logs]))
