"""``tcp``: RDATA/s from one writer through the TCP hub to 1 and 4 readers, against raw Twisted.

Processes (each its own OS process): the hub (the master's
``ReplicationHub``, relay-only), a writer (generator + handler announcing
committed facts, connected with the real reconnecting client), and readers
(handlers decoding every row and applying it to their view of the writer's
position). The figure is rows applied by every reader per second, end to
end, with the writer held to a window of unapplied rows so nothing is folded.

Ceiling: the same topology with bare ``LineOnlyReceiver`` processes -- a
writer sending the very same bytes, a relay forwarding lines, readers
counting them -- under the same flow control.

Beside them, the three roles' Python alone (:mod:`scripts.benchmarks.inproc`):
each in one process on transports that drop what is written, against the raw
roles measured the same way -- steadier than the figures over processes on a
shared machine, for judging a change to the code on the path.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from scripts.benchmarks.common import BenchError, Children, Progress, cpu_seconds
from scripts.benchmarks.inproc import ROLES
from scripts.benchmarks.inproc import measure as measure_in_process
from scripts.benchmarks.profile import from_env

REPL = "scripts.benchmarks.replproc"
RAW = "scripts.benchmarks.rawproc"
WINDOW = 5000
CHUNK = 100

TARGETS = [
    {"row": "tcp.1", "field": "value", "op": ">=", "threshold": 100_000,
     "label": "≥ 100k RDATA/s end to end, 1 reader"},
    {"row": "tcp.1", "field": "ratio", "op": ">=", "threshold": 0.5, "label": "≥ 0.5 of raw LineOnlyReceiver"},
    {"row": "tcp.1", "field": "ratio", "op": ">=", "threshold": 0.35,
     "label": "≥ 0.35 of raw LineOnlyReceiver (the hub relays rows without decoding them)"},
    {"row": "tcp.cpu1", "field": "value", "op": "<=", "threshold": 12,
     "label": "≤ 12 µs of CPU per RDATA, writer + hub + 1 reader"},
]


def run_pipeline(workdir: str, *, raw: bool, transport: str, readers: int, facts: int, timeout: float,
                 redis_prefix: str = "", master_handler: bool = False, sample: Any = None,
                 profile_as: str = "") -> dict[str, Any]:
    """One writer -> (hub or Redis) -> ``readers`` readers; returns the writer's result and CPU use.

    Args:
        raw: run the ceiling processes instead of synflow's.
        transport: ``tcp`` or ``redis``.
        sample: optionally called as ``sample(children_by_name, event)`` for each
            writer ``progress`` event (the memory benchmark samples RSS there).
        profile_as: with ``scripts/bench --profile``, record py-spy profiles
            of every process under this name.
    """
    module = RAW if raw else REPL
    with Children(workdir) as ch:
        procs = {}
        hub_args: list[Any] = []
        if transport == "tcp":
            hub = ch.python("hub", module, "relay" if raw else "hub", *(["--master-handler"] if master_handler else []))
            port = hub.wait_event("ready", 60)["port"]
            procs["hub"] = hub
            hub_args = ["--relay" if raw else "--hub", port]
        else:
            hub_args = ["--redis-prefix", redis_prefix]
        writer = ch.python("writer", module, "writer", *hub_args, "--facts", facts, "--readers", readers,
                           "--window", WINDOW, "--chunk", CHUNK)
        control = writer.wait_event("ready", 60)["control_port"]
        procs["writer"] = writer
        for i in range(readers):
            procs[f"reader{i + 1}"] = ch.python(f"reader{i + 1}", module, "reader", "--name", f"reader{i + 1}",
                                                *hub_args, "--control", control)
        writer.wait_event("readers_ready", 60)
        profiler = from_env()
        if profile_as:
            for name, c in procs.items():
                profiler.attach(f"{profile_as}-{name}", c.pid, 20)
        cpu0 = {name: cpu_seconds(c.pid) for name, c in procs.items()}
        if sample is None:
            result = writer.wait_event("result", timeout)
        else:
            deadline = time.monotonic() + timeout
            while True:
                for ev in writer.events("progress"):
                    sample(procs, ev)
                done = writer.events("result")
                if done:
                    result = done[0]
                    break
                if not writer.alive() or time.monotonic() > deadline:
                    raise BenchError(f"writer ended or timed out without a result:\n{writer.tail()}")
                writer.poll(0.5)
        cpu = {name: round(cpu_seconds(c.pid) - cpu0[name], 2) for name, c in procs.items()}
        result["cpu_s"] = cpu
        result["cpu_us_per_row"] = {name: round(v * 1e6 / result["rows"], 1) for name, v in cpu.items()}
        result["pids"] = {name: c.pid for name, c in procs.items()}
    profiler.finish()
    return result


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    facts = 50_000 if quick else 300_000
    rows = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tcp-") as tmp:
        for readers in (1, 4):
            got = {}
            for raw in (False, True):
                what = "raw LineOnlyReceiver" if raw else "synflow"
                progress(f"{what}: 1 writer -> hub -> {readers} reader(s), {facts:,} rows")
                res = run_pipeline(os.path.join(tmp, f"{'raw' if raw else 'syn'}-{readers}"), raw=raw,
                                   transport="tcp", readers=readers, facts=facts, timeout=600,
                                   profile_as="" if raw else f"tcp{readers}")
                got[raw] = res
                progress(f"{what}, {readers} reader(s): {res['rows_per_s']:,.0f} rows/s per reader "
                         f"(CPU µs per row: {res['cpu_us_per_row']})")
            syn, raw_res = got[False], got[True]
            rows.append({
                "key": f"tcp.{readers}", "label": f"RDATA/s end to end, 1 writer → hub → {readers} reader(s)",
                "unit": "RDATA/s", "value": syn["rows_per_s"], "ceiling": raw_res["rows_per_s"],
                "ceiling_label": "raw LineOnlyReceiver, same bytes and topology",
                "ratio": syn["rows_per_s"] / raw_res["rows_per_s"],
            })
            syn_cpu, raw_cpu = sum(syn["cpu_us_per_row"].values()), sum(raw_res["cpu_us_per_row"].values())
            rows.append({
                "key": f"tcp.cpu{readers}", "unit": "µs/RDATA",
                "label": f"CPU per RDATA, all processes (writer + hub + {readers} reader(s)); ratio = raw ÷ synflow",
                "value": syn_cpu, "ceiling": raw_cpu, "ceiling_label": "raw LineOnlyReceiver", "ratio": raw_cpu / syn_cpu,
            })
            extra[f"readers_{readers}"] = {"synflow": syn, "raw": raw_res}
    progress("in one process, no system calls: writer, hub and reader against the raw roles")
    inproc = measure_in_process(quick)
    extra["in_process_us_per_row"] = inproc
    syn_total, raw_total = sum(inproc["synflow"].values()), sum(inproc["raw"].values())
    rows.append({"key": "tcp.inproc", "unit": "µs/RDATA", "value": syn_total, "ceiling": raw_total,
                 "label": "CPU per RDATA in one process, no system calls (writer + hub + reader); ratio = raw ÷ synflow",
                 "ceiling_label": "the raw roles, same bytes", "ratio": raw_total / syn_total})
    for role in ROLES:
        syn_us, raw_us = inproc["synflow"][role], inproc["raw"][role]
        rows.append({"key": f"tcp.inproc.{role}", "unit": "µs/RDATA", "value": syn_us, "ceiling": raw_us,
                     "label": f"CPU per RDATA in one process: the {role}", "ceiling_label": f"the raw {role}",
                     "ratio": raw_us / syn_us})
    progress("in one process, µs per row: " + ", ".join(
        f"{role} {inproc['synflow'][role]:.2f} (raw {inproc['raw'][role]:.2f})" for role in ROLES))
    one, four = (next(r for r in rows if r["key"] == f"tcp.{n}") for n in (1, 4))
    rows.append({"key": "tcp.deliveries4", "label": "RDATA deliveries/s with 4 readers (4 × rows/s)",
                 "unit": "RDATA/s", "value": four["value"] * 4, "ceiling": four["ceiling"] * 4,
                 "ceiling_label": "raw", "ratio": four["ratio"]})
    return {"rows": rows, "targets": TARGETS, "extra": extra,
            "scaling": {"readers": [1, 4], "per_reader": [one["value"], four["value"]],
                        "raw_per_reader": [one["ceiling"], four["ceiling"]]}}
