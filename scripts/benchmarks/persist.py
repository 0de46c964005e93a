"""``persist``: events/s through the client API on PostgreSQL with 1 and 2 event persisters, and latency.

For each size a fresh :class:`~scripts.benchmarks.deployment.Deployment`
(master + N persisters, TCP hub, every process started by twistd, a fresh
PostgreSQL database) is driven by :mod:`scripts.benchmarks.persistdriver` in
its own process: users in many rooms send messages through every client API
with 64 requests in flight (so each persister batches many events per
transaction), and the figure is events/s over the send phase. The CPU each
process (and this database's PostgreSQL backends) used over that phase is
recorded, which tells what limits the rate.

Latency (2 persisters): messages are sent to the master at a fixed offered
1,000 events/s while every user runs a sync chain against the persisters'
client APIs -- other processes -- and each event's time from send to its
appearance in a sync response is recorded (p50/p95/p99, ``latency.png``).
Full runs repeat it at 100 events/s, a load the deployment sustains on a
small machine, to separate the path's own latency from queueing.

Ceiling: one psycopg2 connection inserting the same rows into a copy of the
``events`` table of the same database, one transaction per row (unbatched)
and 256 rows per transaction (batched).

Each size also reports the machine's busy cores over the send phase and the
work the phase made, from the processes' own counters: events per persist
transaction and ``persist_events`` RPCs per 100 events. Last, the persist
transaction alone in one process (:mod:`scripts.benchmarks.persistproc`):
its CPU, fixed and per event, split between the reactor thread, the
database threads and PostgreSQL -- steadier than the process figures, for
judging a change on that path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from scripts.benchmarks.common import (
    ROOT,
    Children,
    Progress,
    cpu_seconds,
    create_database,
    drop_database,
    machine_cpu,
    pg_connect,
)
from scripts.benchmarks.deployment import Deployment
from scripts.benchmarks.profile import from_env

DRIVER = "scripts.benchmarks.persistdriver"

TARGETS = [
    {"row": "persist.2", "field": "value", "op": ">=", "threshold": 5000,
     "label": "≥ 5k events/s with 2 persisters"},
    {"row": "persist.latency.p99", "field": "value", "op": "<=", "threshold": 50,
     "label": "p99 send → visible in another process's sync ≤ 50 ms at 1k events/s"},
    {"row": "persist.scaling", "field": "value", "op": ">=", "threshold": 1.0,
     "label": "2 persisters no slower than 1"},
    {"row": "persist.cpu_synflow.1", "field": "value", "op": "<=", "threshold": 0.8,
     "label": "≤ 0.8 ms CPU per event over master + persisters, 1 persister"},
    {"row": "persist.cpu_synflow.2", "field": "value", "op": "<=", "threshold": 0.8,
     "label": "≤ 0.8 ms CPU per event over master + persisters, 2 persisters"},
]

#: The processes of the deployment itself (the load driver and PostgreSQL are not synflow's).
SYNFLOW_PROCESSES = ("master", "persister")


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    busy, total = machine_cpu()
    snap["_machine_busy"], snap["_machine_total"] = busy, total
    return snap


def cpu_used(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    """CPU seconds per process over a phase, PostgreSQL backends summed, and machine utilisation."""
    used: dict[str, float] = {}
    for name, v in after.items():
        if name.startswith("_"):
            continue
        key = "postgres" if name.startswith("postgres") else name
        used[key] = round(used.get(key, 0.0) + v - before.get(name, v), 2)
    ticks = os.sysconf("SC_CLK_TCK")
    busy = (after["_machine_busy"] - before["_machine_busy"]) / ticks
    return {"per_process_s": used, "machine_busy_cores": round(busy / seconds, 2) if seconds else 0.0,
            "ours_cores": round(sum(used.values()) / seconds, 2) if seconds else 0.0}


#: The counters of the work a phase made, summed over the deployment's processes (see :func:`work_done`).
WORK_COUNTERS = {
    "events": ("synflow_events_persisted_total", None),
    "transactions": ("synflow_persist_batch_events_count", None),
    "rpcs": ("synflow_rpc_served_total", ("name", "persist_events")),
    "client_sends": ("synflow_http_request_seconds_count", ("route", "on_send")),
}


def work_counts(dep: Deployment) -> dict[str, float]:
    """:data:`WORK_COUNTERS` now, summed over the master and the persisters (their ``/metrics``)."""
    totals = dict.fromkeys(WORK_COUNTERS, 0.0)
    for proc in ("master", *dep.writers):
        for family in text_string_to_metric_families(dep.metrics(proc)):
            for sample in family.samples:
                for key, (name, label) in WORK_COUNTERS.items():
                    if sample.name == name and (label is None or sample.labels.get(label[0]) == label[1]):
                        totals[key] += sample.value
    return totals


def work_done(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a phase did: events persisted, and per event the transactions, persist RPCs and client sends."""
    done = {k: after[k] - before[k] for k in WORK_COUNTERS}
    events = done["events"] or 1.0
    return {**done, "events_per_transaction": round(events / (done["transactions"] or 1.0), 2),
            "rpcs_per_100_events": round(100 * done["rpcs"] / events, 1)}


def drive(ch: Children, dep: Deployment, name: str, mode: str, args: list[Any], timeout: float,
          profile_as: str = "") -> dict[str, Any]:
    """Run the driver; returns its result plus the CPU use of every process over the send phase."""
    driver = ch.python(name, DRIVER, mode, *args)
    driver.wait_event("phase", 60)  # setup
    ev = driver.wait_event("phase", timeout)  # send
    assert ev["name"] == "send", ev
    pids = {**dep.pids(), "driver": driver.pid}
    profiler = from_env()
    if profile_as:
        for proc in ("master", *dep.writers, "driver"):
            profiler.attach(f"{profile_as}-{proc}", pids[proc], 15)
    # The counters are read outside the CPU snapshots: serving /metrics is not the phase's work.
    work_before = work_counts(dep)
    before, t0 = cpu_snapshot(pids), time.monotonic()
    driver.wait_event("phase", timeout)  # sent
    seconds = time.monotonic() - t0
    after = cpu_snapshot(pids)
    work_after = work_counts(dep)
    result = driver.wait_event("result", timeout)
    result["cpu"] = cpu_used(before, after, seconds)
    result["work"] = work_done(work_before, work_after)
    events = result.get("sent") or 1
    result["cpu"]["ms_per_event"] = {k: round(v * 1000 / events, 2) for k, v in result["cpu"]["per_process_s"].items()}
    dep.check_alive()
    profiler.finish()
    return result


def insert_ceiling(dbname: str, rows: int) -> dict[str, float]:
    """Single-connection INSERT rate of events-shaped rows: one per transaction, and 256 per transaction."""
    from psycopg2.extras import execute_values

    conn = pg_connect(dbname)
    conn.autocommit = False
    cur = conn.cursor()
    cur.execute("CREATE TABLE bench_insert (LIKE events INCLUDING ALL)")
    conn.commit()

    def row(i: int, tag: str) -> tuple[Any, ...]:
        content = json.dumps({"body": f"message {i}", "n": i}, separators=(",", ":"))
        return (i, "persister1", f"${tag}{i}:bench.local", f"!room{i % 40}:bench.local", "m.room.message", None,
                f"@tp{i % 20}:bench.local", None, content, 1_700_000_000_000 + i, "bench.local",
                f"${tag}{i - 1}:bench.local", i, 1_700_000_000_000 + i, "[]")

    sql = ("INSERT INTO bench_insert (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
           "membership, content, origin_server_ts, origin, prev_event_id, depth, received_ts, destinations) VALUES ")
    out = {}
    t = time.monotonic()
    n_single = max(500, rows // 4)
    for i in range(1, n_single + 1):
        cur.execute(sql + "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)", row(i, "u"))
        conn.commit()
    out["unbatched_rows_per_s"] = n_single / (time.monotonic() - t)
    t = time.monotonic()
    base = 10_000_000
    for start in range(0, rows, 256):
        execute_values(cur, sql + "%s", [row(base + i, "b") for i in range(start, min(rows, start + 256))],
                       page_size=256)
        conn.commit()
    out["batched_rows_per_s"] = rows / (time.monotonic() - t)
    cur.execute("DROP TABLE bench_insert")
    conn.commit()
    conn.close()
    return out


def throughput_args(quick: bool) -> list[Any]:
    return ["--users", 40, "--rooms", 200, "--members", 2, "--messages", 2000 if quick else 6000,
            "--warmup", 200 if quick else 600, "--concurrency", 64]


def run_throughput(tmp: str, persisters: int, quick: bool, progress: Progress, *, audit: bool = True,
                   latency: bool = False) -> dict[str, Any]:
    """One deployment: throughput (and optionally latency and the INSERT ceiling)."""
    workdir = os.path.join(tmp, f"p{persisters}-audit{int(audit)}")
    out: dict[str, Any] = {}
    with Deployment(workdir, persisters=persisters, audit=audit) as dep, Children(workdir) as ch:
        progress(f"{persisters} persister(s), audit {'on' if audit else 'off'}: deployment up; sending")
        out["throughput"] = drive(ch, dep, "driver-throughput", "throughput",
                                  ["--send", *dep.urls(), *throughput_args(quick), "--prefix", "tp"], timeout=900,
                                  profile_as=f"persist{persisters}" if audit else "")
        tp = out["throughput"]
        progress(f"{persisters} persister(s): {tp['events_per_s']:,.0f} events/s "
                 f"(CPU cores busy: machine {tp['cpu']['machine_busy_cores']}, ours {tp['cpu']['ours_cores']}; "
                 f"CPU ms per event: {tp['cpu']['ms_per_event']})")
        if latency:
            out["latency"] = {}
            for rate in ((1000,) if quick else (1000, 100)):
                messages = int(rate * (3 if quick else 8))
                progress(f"latency: {messages:,} events at {rate:,}/s sent to the master, synced on the persisters")
                lat = drive(ch, dep, f"driver-latency-{rate}", "latency",
                            ["--send", *dep.urls("master"), "--sync", *dep.urls(*dep.writers),
                             "--users", 16, "--rooms", 32, "--members", 2, "--messages", messages,
                             "--rate", rate, "--concurrency", 256, "--prefix", f"lat{rate}"], timeout=900)
                out["latency"][rate] = lat
                progress(f"latency at {rate:,}/s: achieved {lat['achieved_rate']:,.0f}/s, visible p50/p95/p99 "
                         f"{lat['visible_latency_ms']['p50']:.1f}/{lat['visible_latency_ms']['p95']:.1f}/"
                         f"{lat['visible_latency_ms']['p99']:.1f} ms, lost {lat['lost']}")
            progress("ceiling: single-connection INSERT of the same rows")
            out["ceiling"] = insert_ceiling(dep.dbname, 5000 if quick else 20_000)
            progress(f"ceiling: {out['ceiling']}")
    return out


def run_in_process(quick: bool, progress: Progress) -> dict[str, Any]:
    """:mod:`scripts.benchmarks.persistproc` on a fresh database: the transaction's CPU, fixed and per event."""
    dbname = create_database()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.benchmarks.persistproc", "--dbname", dbname,
             "--batches", str(200 if quick else 400), "--passes", str(2 if quick else 3)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600,
        )
    finally:
        drop_database(dbname)
    if proc.returncode != 0:
        raise RuntimeError(f"persistproc failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    progress(f"one process: {result['fixed_ms_per_transaction']:.2f} ms of CPU per transaction "
             f"({_split_text(result, 'per_transaction_ms', 2)}) + {result['ms_per_further_event']:.3f} ms per event")
    return result


def _split_text(inproc: dict[str, Any], part: str, digits: int) -> str:
    """``reactor X + database threads Y + PostgreSQL Z`` of one part of :mod:`persistproc`'s split."""
    split = inproc["split"]
    return " + ".join(f"{label} {split[key][part]:.{digits}f}" for key, label in
                      (("reactor", "reactor"), ("database_threads", "database threads"), ("postgres", "PostgreSQL")))


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-persist-") as tmp:
        one = run_throughput(tmp, 1, quick, progress)
        two = run_throughput(tmp, 2, quick, progress, latency=True)
    progress("one process: the persist transaction alone, batches of 1 and 8 events")
    inproc = run_in_process(quick, progress)
    ceiling = two["ceiling"]
    rows = []
    for n, res in ((1, one), (2, two)):
        eps = res["throughput"]["events_per_s"]
        rows.append({"key": f"persist.{n}", "label": f"events/s through the client API, {n} persister(s)",
                     "unit": "events/s", "value": eps, "ceiling": ceiling["batched_rows_per_s"],
                     "ceiling_label": "1-connection INSERT, 256 rows/txn", "ratio": eps / ceiling["batched_rows_per_s"]})
    rows.append({"key": "persist.scaling", "label": "scaling, 2 persisters vs 1", "unit": "×",
                 "value": rows[1]["value"] / rows[0]["value"], "ceiling": 2.0, "ceiling_label": "linear",
                 "ratio": rows[1]["value"] / rows[0]["value"] / 2})
    rows.append({"key": "persist.unbatched", "label": "1-connection INSERT, 1 row/txn (ceiling, unbatched)",
                 "unit": "rows/s", "value": ceiling["unbatched_rows_per_s"], "ceiling": None, "ratio": None})
    rows.append({"key": "persist.cpu", "label": "CPU per event, all processes (driver, master, persisters, PostgreSQL)",
                 "unit": "ms/event", "value": sum(two["throughput"]["cpu"]["ms_per_event"].values()),
                 "ceiling": None, "ratio": None})
    for n, res in ((1, one), (2, two)):
        per_event = res["throughput"]["cpu"]["ms_per_event"]
        rows.append({"key": f"persist.cpu_synflow.{n}", "unit": "ms/event", "ceiling": None, "ratio": None,
                     "label": f"CPU per event, master + persisters, {n} persister(s)",
                     "value": sum(v for k, v in per_event.items() if k.startswith(SYNFLOW_PROCESSES))})
    for n, res in ((1, one), (2, two)):
        tp = res["throughput"]
        cores = os.cpu_count() or 1
        busy = tp["cpu"]["machine_busy_cores"]
        rows.append({"key": f"persist.busy.{n}", "label": f"cores busy while sending, whole machine, {n} persister(s)",
                     "unit": "cores", "value": busy, "ceiling": cores, "ceiling_label": "cores",
                     "ratio": busy / cores})
        work = tp["work"]
        rows.append({"key": f"persist.txn_events.{n}", "unit": "events/txn", "ceiling": None, "ratio": None,
                     "label": f"events per persist transaction, {n} persister(s)",
                     "value": work["events_per_transaction"]})
        rows.append({"key": f"persist.rpcs.{n}", "unit": "per 100 events", "ceiling": None, "ratio": None,
                     "label": f"persist_events RPCs served per 100 events, {n} persister(s)",
                     "value": work["rpcs_per_100_events"]})
    rows.append({"key": "persist.inproc.transaction", "unit": "ms/txn", "ceiling": None, "ratio": None,
                 "value": inproc["fixed_ms_per_transaction"],
                 "label": "one process, no HTTP: CPU per persist transaction, its fixed part "
                          f"({_split_text(inproc, 'per_transaction_ms', 2)})"})
    rows.append({"key": "persist.inproc.event", "unit": "ms/event", "ceiling": None, "ratio": None,
                 "value": inproc["ms_per_further_event"],
                 "label": "one process, no HTTP: CPU per further event of a transaction "
                          f"({_split_text(inproc, 'per_event_ms', 3)})"})
    latency: dict[str, Any] = {}
    for rate, lat in two["latency"].items():
        suffix = "" if rate == 1000 else f".at{rate}"
        for q in ("p50", "p95", "p99"):
            rows.append({"key": f"persist.latency{suffix}.{q}", "unit": "ms", "value": lat["visible_latency_ms"][q],
                         "label": f"send → visible in another process's sync, {q}, at {rate:,} events/s offered",
                         "ceiling": None, "ratio": None})
        rows.append({"key": f"persist.latency{suffix}.achieved", "label": f"achieved send rate, {rate:,}/s offered",
                     "unit": "events/s", "value": lat["achieved_rate"], "ceiling": rate, "ceiling_label": "offered",
                     "ratio": lat["achieved_rate"] / rate})
        latency[str(rate)] = {"sample_ms": lat.pop("latencies_sample"), "percentiles": lat["visible_latency_ms"],
                              "send_percentiles": lat["send_latency_ms"]}
    return {"rows": rows, "targets": TARGETS,
            "extra": {"one_persister": one, "two_persisters": two, "in_process": inproc},
            "latency": latency,
            "scaling": {"persisters": [1, 2], "events_per_s": [rows[0]["value"], rows[1]["value"]]}}
