"""``audit``: what the audit log costs on the persist path.

Two deployments of master + 2 event persisters on PostgreSQL, identical but
for ``audit.enabled``, driven by the same throughput workload as ``persist``
(off first, then on). The figure is events/s with the audit log on; the
ceiling is events/s with it off; the ratio must be at least 0.95 (at most 5%
slower). Because a 5% difference is within the noise of one wall-clock run
on a shared machine, the CPU time synflow's processes spent per event is
reported beside it: that ratio is the steadier measure of the cost.
"""

from __future__ import annotations

import tempfile
from typing import Any

from scripts.benchmarks.common import Progress
from scripts.benchmarks.persist import run_throughput

TARGETS = [
    {"row": "audit.events", "field": "ratio", "op": ">=", "threshold": 0.95,
     "label": "audit on ≤ 5% slower than audit off (events/s)"},
]

SYNFLOW_PROCESSES = ("master", "persister1", "persister2")


def cpu_ms_per_event(tp: dict[str, Any]) -> float:
    used = tp["cpu"]["per_process_s"]
    return sum(used.get(p, 0.0) for p in SYNFLOW_PROCESSES) * 1000 / tp["sent"]


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        off = run_throughput(tmp, 2, quick, progress, audit=False)["throughput"]
        on = run_throughput(tmp, 2, quick, progress, audit=True)["throughput"]
    cpu_on, cpu_off = cpu_ms_per_event(on), cpu_ms_per_event(off)
    rows = [
        {"key": "audit.events", "label": "events/s with the audit log on (2 persisters)", "unit": "events/s",
         "value": on["events_per_s"], "ceiling": off["events_per_s"], "ceiling_label": "audit log off",
         "ratio": on["events_per_s"] / off["events_per_s"]},
        {"key": "audit.cpu", "label": "synflow CPU per event with the audit log on (master + persisters)",
         "unit": "ms/event", "value": cpu_on, "ceiling": cpu_off, "ceiling_label": "audit log off",
         "ratio": cpu_on / cpu_off},
    ]
    progress(f"audit on {on['events_per_s']:,.0f} events/s vs off {off['events_per_s']:,.0f}; "
             f"CPU {cpu_on:.2f} vs {cpu_off:.2f} ms/event")
    return {"rows": rows, "targets": TARGETS, "extra": {"audit_on": on, "audit_off": off}}
