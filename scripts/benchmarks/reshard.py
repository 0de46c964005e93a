"""``reshard``: live resharding under load, 2 -> 3 -> 2 event persisters.

A master and three event persisters on PostgreSQL and the TCP hub; rooms
shard over persister1 and persister2 at first, persister3 runs idle. Clients
send at a steady offered rate through the master and persister1 while every
user runs a sync chain; a third of the way in the master adds persister3
(``reshard`` over internal RPC, as ``synflowctl reshard --add`` does), two
thirds of the way in it removes persister2. Reported: the fraction of rooms
each change moved beside the ideal (1/3 going 2 -> 3; 1/3 in expectation
going 3 -> 2, exactly persister2's rooms), the hand-over time of each moved
room (propose -> commit of its epoch) p50/p99, the throughput in the seconds
around each change beside the steady rate, and the send p99 during the
changes beside the steady p99. Every run also checks that no message was
lost, duplicated or reordered in any sync chain.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from scripts.benchmarks.common import Progress, median
from scripts.benchmarks.deployment import Deployment

TARGETS = [
    {"row": "reshard.map_add", "field": "ratio", "op": "<=", "threshold": 1.1,
     "label": "2 → 3 moves ≤ 1.1 × the ideal 1/3 of the rooms"},
    {"row": "reshard.map_add", "field": "ratio", "op": ">=", "threshold": 0.9,
     "label": "2 → 3 moves ≥ 0.9 × the ideal 1/3 of the rooms"},
    {"row": "reshard.map_remove", "field": "ratio", "op": "<=", "threshold": 1.1,
     "label": "3 → 2 moves ≤ 1.1 × the ideal 1/3 of the rooms"},
    {"row": "reshard.map_remove", "field": "ratio", "op": ">=", "threshold": 0.9,
     "label": "3 → 2 moves ≥ 0.9 × the ideal 1/3 of the rooms"},
    {"row": "reshard.wait_max", "field": "value", "op": "<=", "threshold": 2000,
     "label": "no send waits longer than 2 s"},
]

#: Synthetic room IDs the map's moved fractions are measured over (the deployment's few hundred
#: rooms give the same expectation with a few percent of sampling noise).
MAP_ROOMS = 100_000
#: Seconds around a change counted as "during" it.
WINDOW_S = 1.0


def _rates(log: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """(bucket start, completed sends per second) in 0.5 s buckets."""
    buckets: dict[int, int] = {}
    for t0, lat in log:
        done = t0 + lat / 1000
        if start <= done < end:
            buckets[int((done - start) / 0.5)] = buckets.get(int((done - start) / 0.5), 0) + 1
    n = int((end - start) / 0.5)
    return [(start + i * 0.5, buckets.get(i, 0) / 0.5) for i in range(n)]


def _quantile(values: list[float], q: float) -> float:
    from synflow.tools.workload import quantile

    return quantile(values, q) if values else 0.0


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    from twisted.internet import reactor, threads
    from twisted.internet.defer import ensureDeferred

    from synflow.config import load_config
    from synflow.tools.ctl import call_rpc
    from synflow.tools.workload import Workload

    rate, seconds = (100, 12) if quick else (200, 30)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as work, \
            Deployment(work, persisters=3, events_writers=2) as deployment:
        master = load_config([deployment.shared_path, os.path.join(work, "master.yaml")])
        workload = Workload(deployment.urls("master", "persister1"), users=40, rooms=300, members_per_room=3,
                            messages=rate * seconds, concurrency=24, seed=3)
        changes: list[tuple[float, float, dict[str, Any]]] = []

        async def go() -> None:
            progress("setting up 40 users in 300 rooms")
            await workload.setup()
            chains = ensureDeferred(workload.sync_chains())
            progress(f"sending {rate * seconds} messages at {rate}/s; persister3 joins at 1/3, persister2 leaves at 2/3")
            t_start = time.monotonic()
            sending = ensureDeferred(workload.send_messages(rate_per_s=rate))
            for op, name, at in (("add", "persister3", seconds / 3), ("remove", "persister2", 2 * seconds / 3)):
                delay = t_start + at - time.monotonic()
                if delay > 0:
                    from twisted.internet.task import deferLater

                    await deferLater(reactor, delay, lambda: None)
                began = time.monotonic()
                changed = await threads.deferToThread(call_rpc, master, "master", "reshard", {"op": op, "writer": name})
                changes.append((began, time.monotonic(), changed))
                progress(f"epoch {changed['epoch']}: {op} {name}, {changed['moved']}/{changed['total']} "
                         f"rooms moved in {changed['seconds'] * 1000:.0f} ms")
            await sending
            result["t"] = (t_start, time.monotonic())
            workload.stop_syncing()
            await chains
            await workload.drain()

        def start() -> None:
            d = ensureDeferred(go())
            d.addErrback(lambda f: result.update(error=f))
            d.addBoth(lambda _: ensureDeferred(workload.close())).addBoth(lambda _: reactor.stop())

        reactor.callWhenRunning(start)
        reactor.run(installSignalHandlers=False)
        if "error" in result:
            raise RuntimeError(result["error"].getTraceback())
        deployment.check_alive()
    report = workload.verify()
    if not report.ok:
        raise RuntimeError(f"resharding lost or reordered messages: {report.as_dict()}")
    add, remove = (c[2] for c in changes)
    moved_add = add["moved"] / add["total"]
    moved_remove = remove["moved"] / remove["total"]
    per_room = [c[2]["seconds"] * 1000 for c in changes for _ in range(c[2]["moved"])]
    t_start, t_end = result["t"]
    rates = _rates(workload.send_log, t_start + 1.0, t_end)  # the first second ramps up

    def near(t: float) -> bool:
        return any(a - WINDOW_S <= t <= b + WINDOW_S for a, b, _ in changes)

    steady_rate = median([r for t, r in rates if not near(t)])
    dip_rate = min((r for t, r in rates if near(t)), default=0.0)
    during = [lat for t0, lat in workload.send_log if near(t0)]
    steady = [lat for t0, lat in workload.send_log if not near(t0)]
    from synflow.sharding import ShardMap, ShardStep

    m0 = ShardMap(["persister1", "persister2"])
    m1 = m0.then(ShardStep("add", "persister3"))
    m2 = m1.then(ShardStep("remove", "persister2"))
    keys = [f"!{i:x}bench:{i % 97}.example" for i in range(MAP_ROOMS)]
    map_add = sum(1 for k in keys if m0.owner(k) != m1.owner(k)) / MAP_ROOMS
    map_remove = sum(1 for k in keys if m1.owner(k) != m2.owner(k)) / MAP_ROOMS
    rows = [
        {"key": "reshard.map_add", "label": f"shard map: rooms moved going 2 → 3 ({MAP_ROOMS:,} room IDs)",
         "unit": "fraction", "value": map_add, "ceiling": 1 / 3, "ceiling_label": "ideal 1/3", "ratio": map_add * 3},
        {"key": "reshard.map_remove", "label": f"shard map: rooms moved going 3 → 2 ({MAP_ROOMS:,} room IDs)",
         "unit": "fraction", "value": map_remove, "ceiling": 1 / 3, "ceiling_label": "ideal 1/3",
         "ratio": map_remove * 3},
        {"key": "reshard.moved_add", "label": "deployment: rooms moved going 2 → 3 persisters", "unit": "fraction",
         "value": moved_add, "ceiling": 1 / 3, "ceiling_label": "ideal 1/3", "ratio": moved_add * 3},
        {"key": "reshard.moved_remove", "label": "deployment: rooms moved going 3 → 2 (persister2's rooms only)",
         "unit": "fraction", "value": moved_remove, "ceiling": 1 / 3, "ceiling_label": "ideal 1/3 (expected)",
         "ratio": moved_remove * 3},
        {"key": "reshard.handover_p50", "label": "hand-over time per moved room p50 (propose → commit)",
         "unit": "ms", "value": _quantile(per_room, 0.5)},
        {"key": "reshard.handover_p99", "label": "hand-over time per moved room p99", "unit": "ms",
         "value": _quantile(per_room, 0.99)},
        {"key": "reshard.dip", "label": f"throughput within {WINDOW_S:.0f} s of a change (lowest 0.5 s bucket)",
         "unit": "events/s", "value": dip_rate, "ceiling": steady_rate, "ceiling_label": "steady median",
         "ratio": dip_rate / steady_rate if steady_rate else None},
        {"key": "reshard.p99", "label": "send p99 during the changes", "unit": "ms",
         "value": _quantile(during, 0.99), "ceiling": _quantile(steady, 0.99), "ceiling_label": "steady p99",
         "ratio": _quantile(during, 0.99) / _quantile(steady, 0.99) if steady else None},
        {"key": "reshard.wait_max", "label": "longest send", "unit": "ms", "value": max(workload.send_latencies)},
    ]
    handovers = ", ".join(f"{c[2]['seconds'] * 1000:.0f} ms" for c in changes)
    progress(f"moved {moved_add:.1%} (add) and {moved_remove:.1%} (remove); hand-overs {handovers}; throughput dip "
             f"{dip_rate:.0f} vs {steady_rate:.0f}/s; p99 during {_quantile(during, 0.99):.0f} ms vs steady "
             f"{_quantile(steady, 0.99):.0f} ms")
    return {"rows": rows, "targets": TARGETS,
            "extra": {"changes": [c[2] for c in changes], "sent": report.sent, "rates": rates}}
