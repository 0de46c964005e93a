"""``spark``: the token validator over generated logs of 1M and 10M writer rows, every check on, ``local[2]``.

This wraps ``scripts/bench_spark.py`` (the validator engineer's benchmark),
run once per size as a subprocess in its own process group so a size that
overruns its time limit is killed with everything it started (JVMs
included). For each size it generates a corpus with :mod:`spark.generate`
(every anomaly injected), converts it to Parquet, then times, each in a fresh
``local[2]`` JVM:

* the ceiling -- a job reading the same Parquet input and counting its rows;
* the validator with every check on (``python -m spark.validate_tokens``),
  scored against the injected anomalies.

``--quick`` runs 100k rows only: on a 2-core machine 1M rows alone (corpus,
conversion, two JVM jobs) takes several minutes, past the quick budget.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from scripts.benchmarks.common import ROOT, BenchError, Children, Progress

SCRIPT = os.path.join(ROOT, "scripts", "bench_spark.py")
LIMIT_10M_S = 120.0
#: Each size's whole run (generation, conversion, both jobs) is killed after this.
TIMEOUT_S = {100_000: 900, 1_000_000: 2400, 10_000_000: 7200}

TARGETS = [
    {"row": "spark.10000000", "field": "value", "op": "<=", "threshold": LIMIT_10M_S,
     "label": "validator over 10M writer rows ≤ 2 min (local[2])"},
]

#: Full runs do one repetition: 10M rows take tens of minutes per run.
REPETITIONS_FULL = 1


def run_size(workdir: str, rows: int, progress: Progress) -> dict[str, Any]:
    if not os.path.exists(SCRIPT):
        raise BenchError(f"{SCRIPT} is missing (the Spark validator's own benchmark)")
    out = os.path.join(workdir, "out")
    with Children(workdir) as ch:
        child = ch.spawn(f"bench_spark-{rows}", [sys.executable, SCRIPT, "--rows", str(rows), "--out", out,
                                                 "--readers", "2"], cwd=ROOT, group=True)
        deadline = time.monotonic() + TIMEOUT_S.get(rows, 7200)
        seen = 0
        while child.alive():
            child.poll(2.0)
            with open(child.log_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
            for line in lines[seen:]:
                if line.startswith("[bench_spark"):
                    progress(line.split("] ", 1)[-1])
            seen = len(lines)
            if time.monotonic() > deadline:
                child.stop()
                raise BenchError(f"{rows:,} rows: not done within {TIMEOUT_S.get(rows, 7200)}s; killed")
        if child.proc.returncode != 0:
            raise BenchError(f"bench_spark.py exited with {child.proc.returncode}:\n{child.tail()}")
    with open(os.path.join(out, "spark_bench.json"), encoding="utf-8") as f:
        return json.load(f)["results"][-1]


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    sizes = [100_000] if quick else [1_000_000, 10_000_000]
    rows, results = [], {}
    tmp = tempfile.mkdtemp(prefix="bench-spark-")
    try:
        for size in sizes:
            progress(f"{size:,} writer rows: corpus, Parquet, read+count baseline, validator")
            res = run_size(os.path.join(tmp, str(size)), size, progress)
            results[size] = res
            job, base = res["validator"], res["baseline"]
            ok = job["exit_code"] in (0, 1) and job["missing_injected"] == 0 and job["unexpected"] == 0
            rows.append({"key": f"spark.{size}", "label": f"validator wall time, {size:,} writer rows, every check",
                         "unit": "s", "value": job["wall_s"], "ceiling": base["wall_s"],
                         "ceiling_label": "read + count job, same input", "ratio": base["wall_s"] / job["wall_s"],
                         "note": "found exactly the injected anomalies" if ok else
                                 f"exit {job['exit_code']}, missing {job['missing_injected']}, "
                                 f"unexpected {job['unexpected']}"})
            progress(f"{size:,} rows: validator {job['wall_s']} s, baseline {base['wall_s']} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "targets": [t for t in TARGETS if any(r["key"] == t["row"] for r in rows)],
            "extra": {str(k): v for k, v in results.items()}}
