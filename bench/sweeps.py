"""The driver's periodic sweeps at 10,000 nodes x 8 workers: what each costs per period.

Before relays pay off, the driver's O(all ranks) sweeps must go (issue "Control plane at
10,000 nodes"). This measures, on one live view filled with 10,000 nodes' latest
heartbeats (8 workers each, every one running and reporting a loss):

- the loss watch (every heartbeat interval, 100 ms): the cached sweep, which reads the
  node holding the lowest rank and rescans the world every `rescan_every` sweeps, against
  the full scan it replaced (rescan_every=1), same view, same run: the ratio;
- the straggler sweep (every `straggler.sweep_ms`, 2 s) while training, reading each node's
  timing summary the agent sends (`Heartbeat.timing`), against the same sweep
  summarising every rank itself (a sender without the summary): the ratio (the hang sweep
  is gone: agents flag their hung ranks in the heartbeat);
- the node-lost sweep (every interval/5), O(1) on a healthy cluster;
- ListNodes' response (`node_infos`: all nodes, and one page of 1,000 as `unbroken nodes`
  fetches them), GetStatus (`status_of`) and the LiveView snapshot at 10,000 nodes;
- the dashboard's /api/state body (its 200 node rows, counts of all, as JSON) and its
  sampler (every rank into the curves and heatmap rings; it stretches its own period to
  keep ~2 % of the loop, so its "% of a core" is what it would cost unstretched).

Each figure is the median of `--repeat` timings; "% of a core" is the median time divided
by the sweep's period. Writes bench/results/sweeps.json and prints a table.
Usage: `make bench-sweeps` (`ARGS=--nodes 2000` for a smaller view).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from unbroken.common.timing import node_timing
from unbroken.driver import detectors
from unbroken.driver import state as statelib
from unbroken.driver.dashboard import DashboardConfig
from unbroken.driver.dashview import Series, state_json
from unbroken.driver.liveview import LiveView, LiveViewConfig
from unbroken.driver.nodewatch import SWEEP_CHUNK
from unbroken.driver.operator import node_infos, status_of
from unbroken.driver.straggler import StragglerConfig, StragglerWatch, sample
from unbroken.proto import driver_pb2 as dpb
from unbroken.recovery.spike import SpikeConfig

RESULTS = Path(__file__).parent / "results" / "sweeps.json"
WORKERS = 8


def build(nodes: int, now: float) -> tuple[LiveView, list[str]]:
    view = LiveView(LiveViewConfig())
    world = []
    for i in range(nodes):
        node = f"node-{i:05d}"
        world.append(node)
        slot = view.slot(node)
        view.mark_registered(slot, now)
        view.mark_alive(slot, now)
        hb = dpb.Heartbeat(seq=1)
        for r in range(WORKERS):
            hb.workers.add(
                local_rank=r,
                global_rank=i * WORKERS + r,
                state=dpb.WORKER_STATE_RUNNING,
                step=100,
                loss=2.5,
                has_loss=True,
                median_step_ms=100.0,
                since_progress_ms=50.0,
                compute_ms=80.0 + (i % 7),
                compute_mad_ms=2.0,
                wait_ms=20.0,
                window_steps=64,
            )
        timing = node_timing(hb.workers)  # the agent's summary, as every agent sends it
        assert timing is not None
        hb.timing.CopyFrom(timing)
        view.beat(slot, hb, now)
    return view, world


def timed(fn: Any, repeat: int) -> float:
    """Median seconds of `repeat` calls of `fn`."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=21)
    ns = ap.parse_args()
    load0 = os.getloadavg()[0]
    now = time.monotonic() + 3600.0  # every heartbeat "just arrived" when the sweeps run
    view, world = build(ns.nodes, now)
    cfg = StragglerConfig()
    watch = StragglerWatch(cfg)

    def stragglers() -> None:
        samples = []
        for n in world:
            got = sample(n, view.nodes[n].hb)
            if got is not None:
                samples.append(got)
        watch.sweep(samples)

    bare = {n: dpb.Heartbeat(workers=view.nodes[n].hb.workers) for n in world}

    def stragglers_from_ranks() -> None:  # the baseline: senders without the agent's summary
        samples = []
        for n in world:
            got = sample(n, bare[n])
            if got is not None:
                samples.append(got)
        watch.sweep(samples)

    def straggler_chunk() -> None:  # what the driver samples between two yields
        for n in world[:SWEEP_CHUNK]:
            sample(n, view.nodes[n].hb)

    samples_all = [s for n in world if (s := sample(n, view.nodes[n].hb)) is not None]

    spike = SpikeConfig()

    cached = detectors.LossWatch(spike)
    full = detectors.LossWatch(spike, rescan_every=1)
    cached.sweep(view, world)  # the first sweep scans and finds the node
    full.sweep(view, world)
    # amortized: 50 sweeps include one full scan (rescan_every = 50)
    t_cached = timed(lambda: [cached.sweep(view, world) for _ in range(50)], ns.repeat) / 50
    t_full = timed(lambda: full.sweep(view, world), ns.repeat)
    t_straggler = timed(stragglers, max(5, ns.repeat // 3))
    t_straggler_ranks = timed(stragglers_from_ranks, max(5, ns.repeat // 3))
    # the longest the event loop waits for it: one sampling chunk, or the statistics at the end
    t_slice = max(
        timed(straggler_chunk, ns.repeat),
        timed(lambda: watch.sweep(samples_all), max(5, ns.repeat // 3)),
    )
    t_lost = timed(lambda: detectors.silent(view, now), ns.repeat)
    state = statelib.initial("bench")
    t_nodes = timed(lambda: node_infos(state, view, now), max(3, ns.repeat // 5))
    t_page = timed(lambda: node_infos(state, view, now, limit=1000), max(3, ns.repeat // 5))
    t_status = timed(lambda: status_of(state, view), max(3, ns.repeat // 5))
    t_live = timed(lambda: view.snapshot(now), max(3, ns.repeat // 5))
    page = DashboardConfig()
    t_dash = timed(
        lambda: json.dumps(state_json(state, view, live=True, now=now, max_nodes=page.max_nodes)),
        max(3, ns.repeat // 5),
    )
    series = Series(page.points, page.columns, page.max_ranks)
    t_sample = timed(
        lambda: series.sample((w for s in view.nodes.values() for w in s.hb.workers), 0.0),
        max(3, ns.repeat // 5),
    )

    period = view.config.heartbeat_interval_ms / 1000.0
    rows = {
        "loss_watch_cached": (t_cached, period),
        "loss_watch_full_scan": (t_full, period),
        "straggler_sweep": (t_straggler, cfg.sweep_ms / 1000.0),
        "straggler_sweep_from_ranks": (t_straggler_ranks, cfg.sweep_ms / 1000.0),
        "straggler_sweep_longest_slice": (t_slice, None),
        "node_lost_sweep": (t_lost, period / 5),
        "list_nodes_all": (t_nodes, None),
        "list_nodes_page_1000": (t_page, None),
        "get_status": (t_status, None),
        "live_view_snapshot": (t_live, None),
        "dashboard_state": (t_dash, None),
        "dashboard_sample": (t_sample, page.sample_ms / 1000.0),
    }
    out: dict[str, Any] = {
        "nodes": ns.nodes,
        "workers_per_node": WORKERS,
        "sweeps": {
            k: {
                "ms": round(t * 1000, 3),
                "period_s": p,
                "core_percent": round(100 * t / p, 3) if p else None,
            }
            for k, (t, p) in rows.items()
        },
        "loss_watch_cached_vs_full_ratio": round(t_cached / t_full, 4),
        "straggler_summary_vs_ranks_ratio": round(t_straggler / t_straggler_ranks, 4),
        "loss_watch_full_scans": cached.full_scans,
        "machine": {
            "loadavg_1m_at_start": round(load0, 2),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "cpus": os.cpu_count(),
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"| sweep ({ns.nodes} nodes x {WORKERS} workers) | ms per sweep | period | % of a core |")
    print("|---|---:|---:|---:|")
    for k, v in out["sweeps"].items():
        per = f"{v['period_s']:g} s" if v["period_s"] else "per call"
        pct = f"{v['core_percent']:.2f}" if v["core_percent"] is not None else "-"
        print(f"| {k} | {v['ms']:.3f} | {per} | {pct} |")
    print(f"| loss watch cached / full scan | {out['loss_watch_cached_vs_full_ratio']} | | |")
    print(f"| straggler summary / ranks | {out['straggler_summary_vs_ranks_ratio']} | | |")


if __name__ == "__main__":
    main()
