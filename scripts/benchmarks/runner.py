"""The benchmark runner behind ``scripts/bench``: repeat, bound, aggregate, report.

``scripts/bench [--quick] [--only NAME[,NAME...]] [--out DIR] [--repetitions N]``

Each repetition of each benchmark runs as ``python -m scripts.benchmarks.runone``
in a process group of its own, under a time limit: a benchmark that hangs is
killed with everything it started, whatever it recorded for cleanup (a
PostgreSQL database, Redis keys) is removed, the failure is noted, and the
rest still runs. Figures are aggregated over the repetitions (median, and
min-max as the spread), every target is judged on the median, and the
results go to ``DIR/bench.json``, ``DIR/bench.md`` and the plots
(:mod:`scripts.benchmarks.report`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from scripts.benchmarks import BENCHMARKS
from scripts.benchmarks.common import ROOT, machine_info, median, run_cleanups, ts
from scripts.benchmarks.report import write_outputs

#: Per-repetition time limits in seconds (quick, full).
TIMEOUTS = {
    "codec": (120, 300), "tcp": (300, 1500), "redis": (300, 1800), "persist": (600, 2400),
    "federation": (300, 900), "audit": (600, 2400), "spark": (1200, 10800), "memory": (300, 1200),
    "mainjob": (300, 900), "reshard": (300, 900),
}


def say(msg: str) -> None:
    print(f"[bench {ts()}] {msg}", file=sys.stderr, flush=True)


def run_repetition(name: str, rep: int, reps: int, quick: bool, out: str) -> dict[str, Any]:
    """One repetition in its own process group, killed after its time limit."""
    result_path = os.path.join(out, "raw", f"{name}-{rep}.json")
    cleanup_path = os.path.join(out, "raw", f"{name}-{rep}.cleanup")
    limit = TIMEOUTS.get(name, (600, 1800))[0 if quick else 1]
    label = f"{name} [{rep}/{reps}]"
    cmd = [sys.executable, "-u", "-m", "scripts.benchmarks.runone", name, "--result", result_path, "--label", label]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ, PYTHONPATH=ROOT, SYNFLOW_BENCH_CLEANUP=cleanup_path, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    timed_out = False
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        say(f"{label}: no result after {limit}s: killing it and everything it started")
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the group still around
        except ProcessLookupError:
            pass
        proc.wait()
        for done in run_cleanups(cleanup_path):
            if timed_out or proc.returncode:
                say(f"{label}: cleaned up {done}")
    if timed_out:
        return {"error": f"timed out after {limit}s (killed; the rest of the suite still ran)",
                "seconds": round(time.monotonic() - started, 1)}
    try:
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": f"exited with {proc.returncode} without a result", "seconds": round(time.monotonic() - started, 1)}


def aggregate(name: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max of every row over the repetitions; targets judged on the median."""
    good = [r for r in reps if "error" not in r]
    rows: dict[str, dict[str, Any]] = {}
    for r in good:
        for row in r["rows"]:
            agg = rows.setdefault(row["key"], {k: v for k, v in row.items() if k not in ("value", "ceiling", "ratio")}
                                  | {"values": [], "ceilings": [], "ratios": []})
            agg["values"].append(row["value"])
            agg["ceilings"].append(row.get("ceiling"))
            agg["ratios"].append(row.get("ratio"))
    for agg in rows.values():
        for field, values in (("value", agg["values"]), ("ceiling", agg["ceilings"]), ("ratio", agg["ratios"])):
            vals = [v for v in values if isinstance(v, int | float) and v == v]
            agg[field] = median(vals) if vals else None
            agg[f"{field}_min"] = min(vals) if vals else None
            agg[f"{field}_max"] = max(vals) if vals else None
    targets = []
    declared = good[0]["targets"] if good else _module_targets(name)
    for t in declared:
        row = rows.get(t["row"])
        value = row.get(t["field"]) if row else None
        met = None if value is None else (value >= t["threshold"] if t["op"] == ">=" else value <= t["threshold"])
        targets.append({**t, "value": value, "met": met})
    return {"name": name, "repetitions": len(reps), "succeeded": len(good), "rows": list(rows.values()),
            "targets": targets, "errors": [r["error"] for r in reps if "error" in r],
            "seconds": [r.get("seconds") for r in reps], "raw": reps}


def _module_targets(name: str) -> list[dict[str, Any]]:
    import importlib

    try:
        return list(importlib.import_module(f"scripts.benchmarks.{name}").TARGETS)
    except Exception:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, 1 repetition, under 5 minutes (CI)")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only these benchmarks (repeatable or comma-separated): {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default=os.path.join(ROOT, "bench-out"), help="output directory (default bench-out/)")
    p.add_argument("--repetitions", type=int, default=0, help="override the repetitions (default 3, quick 1)")
    p.add_argument("--profile", action="store_true",
                   help="record py-spy profiles of the hot processes into DIR/profiles (needs `pip install py-spy`)")
    args = p.parse_args(argv)
    names = [n for item in args.only for n in item.split(",") if n] or list(BENCHMARKS)
    skipped = {}
    if args.quick and not args.only:
        # The validator's own JVM jobs (Parquet conversion, baseline, validator)
        # take about 4 minutes even at 100k rows on 2 cores: past the quick budget.
        names.remove("spark")
        skipped["spark"] = "skipped in --quick (its three JVM jobs alone take ~4 min on 2 cores); run " \
                           "`scripts/bench --quick --only spark` for 100k rows"
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    if args.profile:
        os.environ["SYNFLOW_BENCH_PROFILE"] = os.path.join(out, "profiles")
    started = time.monotonic()
    machine = machine_info()
    say(f"{'quick' if args.quick else 'full'} run of {', '.join(names)} -> {out}")
    for name, why in skipped.items():
        say(f"{name}: {why}")
    say(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gb']} GB RAM, Python {machine['python']}, "
        f"PostgreSQL {machine['postgresql']}, Redis {machine['redis']}; load average {machine['loadavg_at_start']:.2f}")

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    results: list[dict[str, Any]] = []
    try:
        _run_all(names, args, out, results)
    except KeyboardInterrupt:
        say("interrupted: the running benchmark was killed and cleaned up; writing what was measured")
    report = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "machine": machine | {"loadavg_at_end": os.getloadavg()[0]},
        "seconds": round(time.monotonic() - started, 1),
        "benchmarks": results,
        "skipped": skipped,
    }
    paths = write_outputs(report, out)
    say(f"finished in {report['seconds']:.0f}s; wrote {', '.join(os.path.relpath(x, ROOT) for x in paths)}")
    with open(os.path.join(out, "bench.md"), encoding="utf-8") as f:
        print(f.read())
    return 0


def _run_all(names: list[str], args: argparse.Namespace, out: str, results: list[dict[str, Any]]) -> None:
    for name in names:
        reps = args.repetitions or (1 if args.quick else _full_repetitions(name))
        runs: list[dict[str, Any]] = []
        try:
            for rep in range(1, reps + 1):
                say(f"==> {name} [{rep}/{reps}] (load average {os.getloadavg()[0]:.2f})")
                res = run_repetition(name, rep, reps, args.quick, out)
                res["loadavg_after"] = os.getloadavg()[0]
                runs.append(res)
                say(f"<== {name} [{rep}/{reps}] "
                    f"{'FAILED: ' + res['error'].splitlines()[0] if 'error' in res else 'done'} in {res.get('seconds', 0):.0f}s")
        finally:
            if runs:  # an interrupted benchmark keeps the repetitions it finished
                results.append(aggregate(name, runs))


def _full_repetitions(name: str) -> int:
    import importlib

    module = importlib.import_module(f"scripts.benchmarks.{name}")
    return int(getattr(module, "REPETITIONS_FULL", 3))
