"""The world's buddy ring, as the driver pairs it (pure, over the live view's slots).

Each world node replicates its newest flash copy to the replica server of the next node in
world order that has one; after a stop, the steps every rank can restore from memory are
those its own node's ring holds, or, for a gone node's ranks, those its buddy holds. A
restart tells each node its place in the new ring (`start_messages`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

from unbroken.driver.actions import StartWorkers
from unbroken.driver.config import LoopConfig
from unbroken.driver.liveview import LiveView, NodeSlot
from unbroken.proto import driver_pb2 as dpb
from unbroken.proto import events_pb2 as ev

_ANY_HOST = ("", "0.0.0.0", "::")


def _server(holder: NodeSlot) -> tuple[set[str], str]:
    """The host names `holder`'s replica server answers as (registered or connected
    from, brackets stripped) and its port."""
    lhost, _, lport = holder.info.replica_listen.rpartition(":")
    names = {holder.peer_host, holder.info.ip, holder.info.hostname}
    if lhost.strip("[]") not in _ANY_HOST:
        names.add(lhost)
    return {n.strip("[]") for n in names if n}, lport


def is_buddy(buddy: str, holder: NodeSlot) -> bool:
    """Whether `buddy` (a node's registered --buddy, host:port) is `holder`'s replica
    server: the same port, on a host the holder registered or connected from."""
    host, _, port = buddy.rpartition(":")
    names, lport = _server(holder)
    return bool(port) and port == lport and host.strip("[]") in names


def buddy_index(buddy_of: Mapping[str, str]) -> Callable[[NodeSlot], set[str]]:
    """For many nodes' buddies at once (node -> host:port): a function giving the nodes
    whose buddy a holder is, by `is_buddy`'s rule, in O(its names) rather than a test of
    every node against every holder."""
    index: dict[tuple[str, str], set[str]] = {}
    for node, buddy in buddy_of.items():
        host, _, port = buddy.rpartition(":")
        if port:
            index.setdefault((host.strip("[]"), port), set()).add(node)

    def held_by(holder: NodeSlot) -> set[str]:
        names, lport = _server(holder)
        out: set[str] = set()
        for name in names:
            out |= index.get((name, lport), set())
        return out

    return held_by


def replica_address(slot: NodeSlot) -> str:
    """Where `slot`'s replica server is reached: its registered --replica-listen, with a
    wildcard host replaced by the address the driver saw it connect from ("": none)."""
    host, _, port = slot.info.replica_listen.rpartition(":")
    if not port:
        return ""
    if host.strip("[]") in _ANY_HOST:
        host = slot.peer_host or slot.info.ip
        if not host:
            return ""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
    return f"{host}:{port}"


def ring_buddies(nodes: Sequence[str], slots: Mapping[str, NodeSlot | None]) -> dict[str, str]:
    """Each world node's buddy: the replica server of the next node in world order that has
    one (a ring). Nodes without a replica server are left out; fewer than 2: no pairs."""
    ring = [(n, addr) for n in nodes if (slot := slots.get(n)) and (addr := replica_address(slot))]
    if len(ring) < 2:
        return {}
    return {n: ring[(i + 1) % len(ring)][1] for i, (n, _) in enumerate(ring)}


def ring_buddy_of(node: str, nodes: Sequence[str], slots: Mapping[str, NodeSlot | None]) -> str:
    """`node`'s buddy in the ring `ring_buddies` pairs for `nodes`, also when `node` itself
    is not in `slots` (a lost node a new leader never saw register): the replica server of
    the next node after it in world order that has one ("": `node` is not in `nodes`, or
    no other node has a server)."""
    if node not in nodes:
        return ""
    i, n = nodes.index(node), len(nodes)
    for k in range(1, n):
        slot = slots.get(nodes[(i + k) % n])
        if slot is not None and (addr := replica_address(slot)):
            return addr
    return ""


def ring_buddy_map(nodes: Sequence[str], slots: Mapping[str, NodeSlot | None]) -> dict[str, str]:
    """`ring_buddy_of` for every node of `nodes` at once, in one backward pass around the
    ring (O(len(nodes))). Asked node by node for the gone nodes of a 10,240-node world
    whose simulated nodes run no replica server, it took the driver's loop 30 s."""
    n = len(nodes)
    addrs = [replica_address(s) if (s := slots.get(x)) is not None else "" for x in nodes]
    out: dict[str, str] = {}
    nxt, at = "", -1  # the nearest address after position k, and whose
    for k in range(2 * n - 1, -1, -1):
        i = k % n
        if k < n:
            out[nodes[i]] = nxt if at != i else ""
        if addrs[i]:
            nxt, at = addrs[i], i
    return out


def ring_order(nodes: Sequence[str], slots: Mapping[str, NodeSlot | None]) -> list[str]:
    """The nodes of `ring_buddies`' ring, in its order: each sends to the next and takes
    the copies of the previous (empty: fewer than 2 with a replica server)."""
    ring = [n for n in nodes if (slot := slots.get(n)) and replica_address(slot)]
    return ring if len(ring) >= 2 else []


def common_steps(
    world: int, own: dict[int, set[int]], buddies: dict[int, set[int]]
) -> set[int] | None:
    """The steps all `world` ranks can restore from memory: a rank's own ring (`own`), else
    the copies a buddy holds of it (`buddies`, for the ranks of a lost node). None when a
    rank is in neither (its node is gone and no buddy reported it: the commits decide)."""
    if not world:
        return None
    common: set[int] | None = None
    for rank in range(world):
        held = own.get(rank)
        if held is None:
            held = buddies.get(rank)
        if held is None:
            return None
        common = set(held) if common is None else common & held
    return common


def start_messages(
    a: StartWorkers,
    port: int,
    cfg: LoopConfig,
    view: LiveView,
    *,
    old: list[str],
    buddy_of: Callable[[str], str],
    records: Mapping[str, ev.NodeRecord] | None = None,
    timeline: int,
    persist_every_s: float,
    shard_bytes: int,
    sitting_out: Sequence[str] = (),
    start_id: str = "",
) -> StartMessages:
    """Each world node's StartWorkers: its rank base, the master (rank 0's node as the
    driver saw it connect), the new buddy ring, and the copies it takes over from the node
    whose slot it fills (`old`: the incident's world; `buddy_of`: where a node's copies
    live; `records`: the nodes as the log has them, for their replica keys; `sitting_out`:
    live nodes of a replica that sits out, kept in the ring)."""
    nodes = a.world.node_ids
    first = view.nodes.get(nodes[0])
    # rank 0's node as the driver saw it connect (not the IP it claimed in Register)
    addr = cfg.master_addr or (first.peer_host if first is not None else "")
    bases = dict(a.rank_base)
    # a node in the slot of a node that left the world takes over its ranks' copies
    staying = set(nodes)  # (a scan of the tuple per node was O(n²) when a world shrank)
    replaces = {
        n: old[i]
        for i, n in enumerate(nodes)
        if i < len(old) and old[i] != n and old[i] not in staying
    }
    # where each replaced node's copies live: the buddy it was paired with
    copies_at = {o: buddy_of(o) for o in replaces.values()}
    # and the new world's ring, from now on; with replicas sitting out (the replica
    # policy) they stay in it where they were, so the replicas training on keep sending
    # their copies to them and a replica rejoins with its peers' newest copies at hand
    # (its server still takes from the node before it: it got no new StartWorkers)
    ringed = list(nodes)
    if sitting_out:
        keep = set(nodes) | set(sitting_out)
        ringed = [n for n in old if n in keep] + [n for n in nodes if n not in set(old)]
    slots = {n: view.nodes.get(n) for n in ringed}
    ring = ring_buddies(ringed, slots)
    order = ring_order(ringed, slots)  # who each one sends to and takes copies from
    nxt = {n: order[(i + 1) % len(order)] for i, n in enumerate(order)}
    prev = {n: order[i - 1] for i, n in enumerate(order)}
    recs = records or {}
    key = functools.partial(_replica_key, recs)

    def one(n: str) -> dpb.DriverMessage:
        return dpb.DriverMessage(
            start_workers=dpb.StartWorkers(
                worker_cmd=cfg.worker_cmd,
                world_size=a.world.world_size,
                global_rank_base=bases[n],
                master_addr=addr or "127.0.0.1",
                master_port=port,
                dp=a.world.dp,
                pp=a.world.pp,
                tp=a.world.tp,
                timeline=timeline,
                persist_every_s=persist_every_s,
                flash_bytes_per_rank=shard_bytes,
                replaces=replaces.get(n, ""),
                replaces_from=copies_at.get(replaces.get(n, ""), ""),
                buddy=ring.get(n, ""),
                buddy_node=nxt.get(n, ""),
                replicas_from=prev.get(n, ""),
                buddy_pubkey=key(nxt.get(n, "")),
                replicas_from_pubkey=key(prev.get(n, "")),
                replaces_pubkey=key(replaces.get(n, "")),
                in_job=a.in_job,
                start_id=start_id,
            )
        )

    return StartMessages(nodes, one)


def _replica_key(records: Mapping[str, ev.NodeRecord], node: str) -> bytes:
    rec = records.get(node) if node else None
    return rec.replica_pubkey if rec is not None else b""


class StartMessages(Mapping[str, dpb.DriverMessage]):
    """Each world node's StartWorkers, built when first asked for: the fan-out builds
    each as it sends it (driver/fanout.py), with the event loop's turns between. All
    10,240 at once were a 0.24 s stall of the driver's loop in bench-scale."""

    def __init__(self, nodes: Sequence[str], build: Callable[[str], dpb.DriverMessage]) -> None:
        self._nodes = nodes
        self._members = set(nodes)
        self._build = build
        self._built: dict[str, dpb.DriverMessage] = {}

    def __getitem__(self, node: str) -> dpb.DriverMessage:
        msg = self._built.get(node)
        if msg is None:
            if node not in self._members:
                raise KeyError(node)
            msg = self._built[node] = self._build(node)
        return msg

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)
