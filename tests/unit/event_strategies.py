"""Hypothesis strategies of events over a few nodes, for the fold's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from unbroken.proto import events_pb2 as ev

NODES = [f"n{i}" for i in range(5)]
node = st.sampled_from(NODES)
world = st.builds(
    lambda dp, ids: ev.WorldLayout(dp=dp, pp=1, tp=1, node_ids=ids, workers_per_node=1),
    st.integers(1, 4),
    st.lists(node, max_size=4, unique=True),
)
phase = st.sampled_from([p for p in ev.Phase.values() if p])

payloads = st.one_of(
    st.builds(
        lambda n, e, s: ev.Event(
            node_registered=ev.NodeRegistered(node_id=n, epoch=e, spare=s, num_workers=2)
        ),
        node,
        st.integers(1, 9),
        st.booleans(),
    ),
    st.builds(
        lambda n, e: ev.Event(node_lost=ev.NodeLost(node_id=n, epoch=e, silent_ms=300)),
        node,
        st.integers(0, 9),
    ),
    st.builds(lambda w: ev.Event(job_started=ev.JobStarted(world=w, min_nodes=1)), world),
    st.builds(
        lambda s, r: ev.Event(
            restore_started=ev.RestoreStarted(step=s, source_by_rank={0: "memory"}, reshard=r)
        ),
        st.integers(0, 100),
        st.booleans(),
    ),
    st.builds(
        lambda n, c: ev.Event(worker_failed=ev.WorkerFailed(node_id=n, exit_code=c)),
        node,
        st.integers(-15, 3),
    ),
    st.builds(lambda n: ev.Event(hang_suspected=ev.HangSuspected(node_id=n)), node),
    st.builds(lambda n: ev.Event(log_alert=ev.LogAlert(node_id=n, keyword="Xid")), node),
    st.builds(lambda n: ev.Event(node_evicted=ev.NodeEvicted(node_id=n)), node),
    st.builds(
        lambda a, b: ev.Event(spare_assigned=ev.SpareAssigned(spare_node_id=a, replaces_node_id=b)),
        node,
        node,
    ),
    st.builds(lambda w: ev.Event(world_resized=ev.WorldResized(new_world=w)), world),
    st.builds(
        lambda s: ev.Event(checkpoint_committed=ev.CheckpointCommitted(step=s, uri=f"mem://{s}")),
        st.integers(0, 10**6),
    ),
    st.builds(
        lambda a, b: ev.Event(rollback=ev.Rollback(from_step=a, to_step=b, skip_batches=5)),
        st.integers(0, 100),
        st.integers(0, 100),
    ),
    st.builds(
        lambda s, r: ev.Event(training_paused=ev.TrainingPaused(at_step=s, restore_step=r)),
        st.integers(0, 100),
        st.integers(0, 100),
    ),
    st.builds(
        lambda s, w: ev.Event(training_resumed=ev.TrainingResumed(at_step=s, world=w)),
        st.integers(0, 100),
        world,
    ),
    st.builds(
        lambda t: ev.Event(leader_elected=ev.LeaderElected(driver_id=f"d{t}", term=t)),
        st.integers(1, 9),
    ),
    st.builds(
        lambda a, b, i, sus, bad, dia: ev.Event(
            recovery_transition=ev.RecoveryTransition(
                from_phase=a,
                to_phase=b,
                incident_id=i,
                reason="x",
                suspects=sus,
                bad_nodes=bad,
                diagnose=dia,
            )
        ),
        phase,
        phase,
        st.sampled_from(["", "i1", "i2"]),
        st.lists(node, max_size=3, unique=True),
        st.lists(node, max_size=3, unique=True),
        st.booleans(),
    ),
    st.builds(lambda ok: ev.Event(job_finished=ev.JobFinished(ok=ok, step=9)), st.booleans()),
)


def numbered(events: list[ev.Event]) -> list[ev.Event]:
    for i, e in enumerate(events, 1):
        e.seq = i
    return events
