"""The prune of gone node records as a full scan of the nodes, and random histories for it.

`prune_by_scan` is how driver/state.py pruned before it kept a heap of gone records: the
reference that tests/unit/test_prune_index.py and bench/scale.py's ``prune`` section compare
the indexed prune with.
"""

from __future__ import annotations

import random

from unbroken.driver import state as statelib
from unbroken.proto import events_pb2 as ev

_GONE = (ev.NODE_STATE_LOST, ev.NODE_STATE_EVICTED)


def prune_by_scan(s: ev.JobState) -> None:
    """Drop the oldest gone node records once there are PRUNE_SLACK more than kept, by
    sorting every gone record of the state (the code the indexed prune replaced); not
    again, after one that could not get down to KEEP_GONE_NODES, until PRUNE_SLACK more
    records are gone."""
    if s.gone_nodes <= max(statelib.KEEP_GONE_NODES + statelib.PRUNE_SLACK, s.prune_mark):
        return
    keep = {*s.world.node_ids, *s.suspects, *s.bad_nodes, *s.incident_world.node_ids}
    nodes = s.nodes
    gone = []
    for n in nodes:
        r = nodes[n]
        if r.state in _GONE and n not in keep:
            gone.append((r.gone_seq, n))
    gone.sort()
    for _, n in gone[: s.gone_nodes - statelib.KEEP_GONE_NODES]:
        if statelib._touch is not None:
            statelib._touch(n)
        del s.nodes[n]
        s.gone_nodes -= 1
        s.pruned_nodes += 1
    keep_over = s.gone_nodes > statelib.KEEP_GONE_NODES
    s.prune_mark = s.gone_nodes + statelib.PRUNE_SLACK if keep_over else 0


def random_history(rng: random.Random, events: int, *, world: int, pool: int) -> list[ev.Event]:
    """A job of `world` nodes and a pool of `pool` others that register (as spares or
    not), get lost, come back under a new epoch, are evicted; now and then the world is
    resized. Seqs are dense from 1, but one event in 20 carries none (the fold then dates
    a loss at the state's last seq, so gone records tie on it)."""
    names = [f"w{i:04d}" for i in range(world)] + [f"p{i:05d}" for i in range(pool)]
    epochs = dict.fromkeys(names, 1)
    layout = ev.WorldLayout(dp=world, node_ids=names[:world], workers_per_node=1)
    out = [ev.Event(job_started=ev.JobStarted(world=layout))]
    for _ in range(events):
        n = rng.choice(names) if rng.random() < 0.3 else rng.choice(names[world:])
        roll = rng.random()
        if roll < 0.35:
            epochs[n] += 1
            e = ev.Event(
                node_registered=ev.NodeRegistered(
                    node_id=n, epoch=epochs[n], hostname=f"h-{n}", spare=rng.random() < 0.3
                )
            )
        elif roll < 0.9:
            e = ev.Event(node_lost=ev.NodeLost(node_id=n, epoch=epochs[n]))
        elif roll < 0.98:
            e = ev.Event(node_evicted=ev.NodeEvicted(node_id=n, reason="test"))
        else:
            ids = rng.sample(names, world)
            e = ev.Event(
                world_resized=ev.WorldResized(
                    new_world=ev.WorldLayout(dp=world, node_ids=ids, workers_per_node=1)
                )
            )
        out.append(e)
    seq = 0
    for e in out:
        if rng.random() >= 0.05:
            seq += 1
            e.seq = seq
    return out
