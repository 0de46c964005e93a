"""``memory``: RSS of master and workers across 1M replicated facts, and of a writer whose reader stops reading.

1. Flat with facts: a master (the hub with the master's own handler reading
   every row), a writer worker and a reader worker, as in ``tcp``; 1M facts
   (100k with ``--quick``) flow end to end while VmRSS of each process is
   sampled from ``/proc/<pid>/status`` every half second. "Flat" means the
   RSS grew by less than 5 MiB over the second half of the run (after
   warm-up): nothing is kept per fact.
2. Bounded under congestion: a writer serving its readers itself (the hub in
   the writer's process, as the master is for the streams it writes)
   produces as fast as it can while its one reader, connected, is stopped
   with SIGSTOP. The kernel's socket buffers fill, the connection pauses, its
   queue grows to ``HIGH_WATER_COMMANDS`` / ``HIGH_WATER_BYTES`` and from then
   on rows fold into one POSITION placeholder: the writer's RSS must level
   off at roughly start + the high-water bytes, never reaching the hard
   limits (which would close the connection).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Any

from scripts.benchmarks.common import BenchError, Children, Progress, rss_mb
from scripts.benchmarks.tcp import REPL, run_pipeline
from synflow.replication.core import (
    HARD_LIMIT_BYTES,
    HARD_LIMIT_COMMANDS,
    HIGH_WATER_BYTES,
    HIGH_WATER_COMMANDS,
)

FLAT_MB = 5.0

TARGETS = [
    {"row": "memory.growth.master", "field": "value", "op": "<=", "threshold": FLAT_MB,
     "label": f"master RSS flat with facts (< {FLAT_MB:g} MiB growth over the second half)"},
    {"row": "memory.growth.writer", "field": "value", "op": "<=", "threshold": FLAT_MB,
     "label": f"writer RSS flat with facts (< {FLAT_MB:g} MiB growth over the second half)"},
    {"row": "memory.growth.reader", "field": "value", "op": "<=", "threshold": FLAT_MB,
     "label": f"reader RSS flat with facts (< {FLAT_MB:g} MiB growth over the second half)"},
    {"row": "memory.congested.growth", "field": "value", "op": "<=", "threshold": HIGH_WATER_BYTES / 2**20 * 2,
     "label": "congested writer RSS bounded (growth ≤ 2 × high-water bytes)"},
]


def growth_second_half(curve: list[dict[str, Any]], name: str) -> float:
    points = [p for p in curve if p.get(name) is not None]
    if len(points) < 4:
        return float("nan")
    half = points[len(points) // 2:]
    return max(p[name] for p in half) - half[0][name]


def flat_with_facts(tmp: str, facts: int, progress: Progress) -> dict[str, Any]:
    curve: list[dict[str, Any]] = []
    last = [0.0]

    def sample(procs: dict[str, Any], ev: dict[str, Any]) -> None:
        point = {"facts": ev["produced"], "t": ev["t"]}
        for name in ("hub", "writer", "reader1"):
            point[name] = rss_mb(procs[name].pid)
        curve.append(point)
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            progress(f"{ev['produced']:,} facts: RSS MiB master {point['hub']:.1f}, writer {point['writer']:.1f}, "
                     f"reader {point['reader1']:.1f}")

    res = run_pipeline(os.path.join(tmp, "flat"), raw=False, transport="tcp", readers=1, facts=facts,
                       timeout=1800, master_handler=True, sample=sample)
    return {"curve": curve, "result": res}


def congested(tmp: str, duration: float, progress: Progress) -> dict[str, Any]:
    with Children(os.path.join(tmp, "congested")) as ch:
        writer = ch.python("writer", REPL, "writer", "--serve", "--readers", 1, "--window", 0,
                           "--duration", duration, "--chunk", 200)
        ready = writer.wait_event("ready", 60)
        reader = ch.python("reader1", REPL, "reader", "--name", "reader1", "--hub", ready["hub_port"],
                           "--control", ready["control_port"])
        writer.wait_event("readers_ready", 60)
        reader.signal(signal.SIGSTOP)
        progress(f"reader stopped (SIGSTOP); writer producing for {duration:.0f}s")
        t0 = time.monotonic()
        curve: list[dict[str, Any]] = []
        conn: dict[str, Any] = {}
        produced = 0
        while time.monotonic() - t0 < duration + 5:
            writer.poll(0.5)
            stats = writer.events("stats")  # the hub's view of the connection, once a second
            if stats and stats[-1]["connections"]:
                conn = stats[-1]["connections"][0]
            progressed = writer.events("progress")
            if progressed:
                produced = progressed[-1]["produced"]
            curve.append({"t": round(time.monotonic() - t0, 2), "writer": rss_mb(writer.pid),
                          "pending": conn.get("pending"), "pending_bytes": conn.get("pending_bytes"),
                          "folded": conn.get("folded"), "state": conn.get("state"), "produced": produced})
            if writer.events("result"):
                break
            if not writer.alive():
                raise BenchError(f"writer died:\n{writer.tail()}")
        reader.signal(signal.SIGCONT)
        progress(f"writer RSS went {curve[0]['writer']:.1f} -> {curve[-1]['writer']:.1f} MiB; "
                 f"last queue state {curve[-1]}")
        return {"curve": curve}


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    facts = 100_000 if quick else 1_000_000
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        progress(f"{facts:,} facts: master (hub + handler), writer, reader")
        flat = flat_with_facts(tmp, facts, progress)
        cong = congested(tmp, 10.0 if quick else 60.0, progress)
    curve = flat["curve"]
    rows = []
    for name, label in (("hub", "master"), ("writer", "writer"), ("reader1", "reader")):
        g = growth_second_half(curve, name)
        end = curve[-1][name] if curve else float("nan")
        rows.append({"key": f"memory.growth.{label}", "unit": "MiB", "value": g, "ceiling": None, "ratio": None,
                     "label": f"{label} RSS growth over the second half of {facts:,} facts (ends at {end:.1f} MiB)"})
    cc = cong["curve"]
    rss = [p["writer"] for p in cc if p["writer"] is not None]
    pend = [p["pending_bytes"] for p in cc if p.get("pending_bytes") is not None]
    rows.append({"key": "memory.congested.growth", "unit": "MiB", "value": max(rss) - rss[0], "ratio": None,
                 "label": f"congested writer RSS growth (from {rss[0]:.1f} to max {max(rss):.1f} MiB)",
                 "ceiling": HIGH_WATER_BYTES / 2**20, "ceiling_label": "high-water bytes (MiB)"})
    rows.append({"key": "memory.congested.queue", "unit": "MiB", "label": "largest queued bytes of the stopped reader",
                 "value": max(pend) / 2**20 if pend else 0.0, "ceiling": HARD_LIMIT_BYTES / 2**20,
                 "ceiling_label": "hard limit bytes (MiB)",
                 "ratio": (max(pend) / HARD_LIMIT_BYTES) if pend else 0.0})
    return {"rows": rows, "targets": TARGETS,
            "extra": {"flat_curve": curve, "congested_curve": cc, "tcp_result": flat["result"],
                      "limits": {"high_water_commands": HIGH_WATER_COMMANDS, "hard_limit_commands": HARD_LIMIT_COMMANDS,
                                 "high_water_bytes": HIGH_WATER_BYTES, "hard_limit_bytes": HARD_LIMIT_BYTES}},
            "memory": {"flat": curve, "congested": cc}}
