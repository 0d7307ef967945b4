"""World layouts too large for one event travel as a head event and `WorldNodes` parts.

An event is capped (64 KiB by default) and a world layout of 10,240 nodes with 30-character
names is about 330 KB, so a JobStarted, WorldResized, TrainingResumed or CheckpointCommitted
of that size could not be recorded. `split` moves the node ids of each oversized layout
into `WorldNodes` events that follow their head event in the same transaction (the journal
appends a decision atomically); the fold appends them in order to the layout the head set,
so the folded state is the one the whole event would have given (tests/unit/
test_worldsplit.py). `merged` puts them back together for a reader that wants whole events.
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.proto import events_pb2 as ev

#: (payload, layout field) of every event that carries a world layout.
LAYOUTS = (
    ("job_started", "world"),
    ("world_resized", "old_world"),
    ("world_resized", "new_world"),
    ("training_resumed", "world"),
    ("checkpoint_committed", "world"),
)
ENVELOPE_BYTES = 1024  # room kept for what the log stamps on an event (ids, times, writer)


def split(events: Iterable[ev.Event], max_event_bytes: int) -> list[ev.Event]:
    """`events` with every event over `max_event_bytes` (less the envelope) split into its
    head and WorldNodes parts of at most half that size each. Events that fit, and events
    without a layout to move, are returned as they are (the log refuses the latter)."""
    limit = max_event_bytes - ENVELOPE_BYTES
    part_bytes = max(1024, limit // 2)
    out: list[ev.Event] = []
    for e in events:
        if e.ByteSize() <= limit:
            out.append(e)
            continue
        kind = e.WhichOneof("payload")
        parts: list[ev.Event] = []
        head = e
        for payload, field in LAYOUTS:
            if payload != kind:
                continue
            if not getattr(getattr(e, payload), field).node_ids:
                continue
            if head is e:
                head = ev.Event()
                head.CopyFrom(e)
            layout = getattr(getattr(head, payload), field)
            ids = list(layout.node_ids)
            del layout.node_ids[:]
            parts.extend(_parts(f"{payload}.{field}", ids, part_bytes, e.cause or e.event_id))
        out.append(head)
        out.extend(parts)
    return out


def _parts(of: str, ids: list[str], part_bytes: int, cause: str) -> list[ev.Event]:
    out: list[ev.Event] = []
    chunk: list[str] = []
    size = 0
    for n in ids:
        if chunk and size + len(n) + 3 > part_bytes:
            out.append(ev.Event(cause=cause, world_nodes=ev.WorldNodes(of=of, node_ids=chunk)))
            chunk, size = [], 0
        chunk.append(n)
        size += len(n) + 3
    out.append(ev.Event(cause=cause, world_nodes=ev.WorldNodes(of=of, node_ids=chunk)))
    return out


def merged(events: Iterable[ev.Event]) -> list[ev.Event]:
    """`events` with WorldNodes parts folded back into copies of their head events."""
    out: list[ev.Event] = []
    head: ev.Event | None = None
    for e in events:
        if e.WhichOneof("payload") != "world_nodes":
            head = None
            out.append(e)
            continue
        if not out or out[-1].WhichOneof("payload") == "world_nodes":
            continue  # parts without their head (a read that began mid-way): dropped
        if head is None:
            head = ev.Event()
            head.CopyFrom(out[-1])
            out[-1] = head
        payload, field = e.world_nodes.of.split(".", 1)
        if head.WhichOneof("payload") == payload:
            getattr(getattr(head, payload), field).node_ids.extend(e.world_nodes.node_ids)
    return out
