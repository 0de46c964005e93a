"""``federation``: PDUs/s from 2 federation senders to 10 loopback destinations, against bare treq.

Which hot path: the real :class:`~synflow.federation.sender.FederationSender`
(sharding, per-destination queues, 50-PDU transactions, one in flight per
destination, position bookkeeping) and the real treq transport, in two
sender processes, sending to 10 loopback destinations in a third process,
each one synflow's inbound ``/send`` endpoint (parsing and validating every
PDU, dedupe) with an in-memory dedupe store. Every event goes to all 10
destinations. Not on the path: the SQL destination store and the events
follower's reads (the follower reads 500 events per query, far off the
per-PDU cost) -- see :mod:`scripts.benchmarks.fedproc`.

Ceiling: two bare ``treq.put`` loops sending the same 50-PDU transactions to
the same receivers, one in flight per destination.
"""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Any

from scripts.benchmarks.common import Children, Progress, cpu_seconds
from scripts.benchmarks.profile import from_env

FED = "scripts.benchmarks.fedproc"
DESTINATIONS = 10
SENDERS = ("sender1", "sender2")

TARGETS = [
    {"row": "federation.pdus", "field": "value", "op": ">=", "threshold": 5000,
     "label": "≥ 5k PDUs/s, 2 senders → 10 destinations"},
]


def run_case(workdir: str, role: str, events: int, timeout: float) -> dict[str, Any]:
    with Children(workdir) as ch:
        receivers = ch.python("receivers", FED, "receivers", "--count", DESTINATIONS)
        ports = receivers.wait_event("ready", 60)["ports"]
        spec = ",".join(f"dest{i}.bench=http://127.0.0.1:{p}" for i, p in enumerate(ports))
        senders = [ch.python(name, FED, role, "--name", name, "--instances", ",".join(SENDERS),
                             "--destinations", spec, "--events", events) for name in SENDERS]
        owned = {s.name: s.wait_event("ready", 60)["owned"] for s in senders}
        procs = {"receivers": receivers, **{s.name: s for s in senders}}
        profiler = from_env()
        if role == "sender":
            for n, c in procs.items():
                profiler.attach(f"federation-{n}", c.pid, 15)
        cpu0 = {n: cpu_seconds(c.pid) for n, c in procs.items()}
        for s in senders:
            s.signal(signal.SIGUSR1)
        results = [s.wait_event("result", timeout) for s in senders]
        cpu = {n: round(cpu_seconds(c.pid) - cpu0[n], 2) for n, c in procs.items()}
        receivers.events("counts")  # drop the stale ones; the next is taken after every reply
        counts = receivers.wait_event("counts", 5)["counts"]
    profiler.finish()
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    pdus = sum(r["pdus"] for r in results)
    return {"pdus": pdus, "seconds": round(end - start, 3), "pdus_per_s": pdus / (end - start),
            "owned": owned, "cpu_s": cpu, "received": sum(counts), "machine_load": os.getloadavg()[0]}


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    events = 5_000 if quick else 20_000
    with tempfile.TemporaryDirectory(prefix="bench-fed-") as tmp:
        progress(f"synflow senders: {events:,} events × {DESTINATIONS} destinations")
        syn = run_case(os.path.join(tmp, "syn"), "sender", events, 600)
        progress(f"synflow: {syn['pdus_per_s']:,.0f} PDUs/s (CPU s: {syn['cpu_s']}, owned {syn['owned']})")
        progress("bare treq PUT loops, same transactions")
        raw = run_case(os.path.join(tmp, "raw"), "rawput", events, 600)
        progress(f"bare treq: {raw['pdus_per_s']:,.0f} PDUs/s (CPU s: {raw['cpu_s']})")
    rows = [{"key": "federation.pdus", "label": f"PDUs/s, 2 senders → {DESTINATIONS} destinations",
             "unit": "PDUs/s", "value": syn["pdus_per_s"], "ceiling": raw["pdus_per_s"],
             "ceiling_label": "bare treq PUT loop, same transactions", "ratio": syn["pdus_per_s"] / raw["pdus_per_s"]}]
    syn_cpu = sum(syn["cpu_s"].values()) * 1e6 / syn["pdus"]
    raw_cpu = sum(raw["cpu_s"].values()) * 1e6 / raw["pdus"]
    rows.append({"key": "federation.cpu", "unit": "µs/PDU", "value": syn_cpu, "ceiling": raw_cpu,
                 "label": "CPU per PDU, senders + receivers; ratio = bare ÷ synflow",
                 "ceiling_label": "bare treq PUT loop", "ratio": raw_cpu / syn_cpu})
    return {"rows": rows, "targets": TARGETS, "extra": {"synflow": syn, "bare_treq": raw}}
