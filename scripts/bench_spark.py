#!/usr/bin/env python
"""Benchmark the Spark token validator on generated corpora of 1M and 10M writer rows.

For each size it generates a log with :mod:`spark.generate` (every anomaly injected), converts
it to Parquet with Spark, then times, each in a fresh ``local[2]`` process:

* the baseline: a job reading the same Parquet input and counting its rows (and summing the
  columns the checks use, so that they are really read);
* the validator with every check on (``python -m spark.validate_tokens``).

It reports wall times and rows/s, checks that the job found exactly the injected anomalies,
and writes everything to ``DIR/spark_bench.json`` (for a later ``scripts/bench`` harness).

Usage::

    python scripts/bench_spark.py [--rows 1000000 10000000] [--out DIR] [--readers 2]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from spark.checks import violation_key  # noqa: E402
from spark.generate import Config, generate, write_injected, write_jsonl  # noqa: E402
from spark.inject import expected_keys  # noqa: E402

BASELINE = """
import sys, time
from pyspark.sql import SparkSession, functions as F
t = time.monotonic()
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.driver.memory", "6g").getOrCreate())
spark.sparkContext.setLogLevel("WARN")
logs = sys.argv[1]
w = spark.read.parquet(logs + "/writer_logs").agg(F.count(F.lit(1)), F.sum("stream_id")).first()
k = spark.read.parquet(logs + "/token_logs").agg(
    F.count(F.lit(1)), F.sum(F.size("delivered"))).first()
print(w[0], k[0], k[1], round(time.monotonic() - t, 3))
"""


def log(msg: str) -> None:
    """Print a progress line."""
    print(f"[bench_spark {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _env() -> dict[str, str]:
    return dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=ROOT,
                PYSPARK_PYTHON=sys.executable)


def prepare(rows: int, readers: int, workdir: str) -> tuple[str, dict]:
    """Generate and convert the corpus for ``rows`` writer rows (reused when already there)."""
    base = os.path.join(workdir, f"corpus-{rows}")
    parquet = os.path.join(base, "parquet")
    meta_path = os.path.join(base, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as fh:
            return parquet, json.load(fh)
    cfg = Config(facts=rows - rows // 100, cache_facts=rows // 100, writers=4, readers=readers,
                 rooms=max(40, rows // 1000), tokens_per_reader=max(60, rows // 500),
                 position_every=0, seed=11)
    t = time.monotonic()
    log(f"generating {rows} writer rows, {readers} readers, {cfg.tokens_per_reader} tokens each")
    corpus = generate(cfg)
    gen_s = time.monotonic() - t
    t = time.monotonic()
    write_jsonl(corpus, os.path.join(base, "jsonl"))
    write_injected(corpus, os.path.join(base, "injected.json"))
    jsonl_s = time.monotonic() - t
    meta = {"writer_rows": len(corpus.facts), "token_rows": sum(len(c) for c in corpus.chains.values()),
            "deliveries": sum(len(t["delivered"]) for c in corpus.chains.values() for t in c),
            "injected": len(corpus.injected), "generate_s": round(gen_s, 1),
            "write_jsonl_s": round(jsonl_s, 1)}
    del corpus
    log(f"converting to Parquet ({meta['writer_rows']} writer rows, {meta['deliveries']} deliveries)")
    t = time.monotonic()
    src = os.path.join(base, "jsonl")
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from spark.session import get_session; "
            "from spark.inputs import convert_to_parquet; "
            f"convert_to_parquet(get_session('local[2]', driver_memory='6g'), {src!r}, {parquet!r})")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    meta["convert_parquet_s"] = round(time.monotonic() - t, 1)
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    return parquet, meta


def baseline(parquet: str) -> dict:
    """Time a fresh local[2] job that reads the input and counts rows."""
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", BASELINE, parquet], check=True, env=_env(),
                         capture_output=True, text=True).stdout.split()
    return {"wall_s": round(time.monotonic() - t, 1), "in_process_s": float(out[3]),
            "writer_rows": int(out[0]), "token_rows": int(out[1]), "deliveries": int(out[2])}


def validator(parquet: str, out: str, injected_path: str) -> dict:
    """Time the validator with every check on, and score it against the injected anomalies."""
    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "spark.validate_tokens", "--logs", parquet,
                             "--out", out, "--master", "local[2]", "--output-format", "jsonl"],
                            cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    assert proc.stderr is not None
    for line in proc.stderr:  # progress goes on to our stderr; the tail is kept for a failure
        sys.stderr.write(line)
        tail.append(line)
    proc.wait()
    wall = time.monotonic() - t
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"the validator exited with {proc.returncode}:\n{''.join(tail)}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    got = set()
    for path in glob.glob(os.path.join(out, "violations", "*.json")):
        with open(path, encoding="utf-8") as fh:
            got |= {violation_key(r["check"], r) for r in map(json.loads, fh)}
    with open(injected_path, encoding="utf-8") as fh:
        expected = expected_keys(json.load(fh)["injected"])
    return {"wall_s": round(wall, 1), "exit_code": proc.returncode,
            "job_timings_s": summary["timings"], "violations": len(got),
            "missing_injected": len(expected - got), "unexpected": len(got - expected)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each ``--rows`` size and write ``spark_bench.json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench-out"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    results = []
    for rows in a.rows:
        parquet, meta = prepare(rows, a.readers, a.out)
        load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews the times
        log(f"{rows}: baseline read+count (load average {load[0]})")
        base = baseline(parquet)
        log(f"{rows}: baseline {base['wall_s']} s; running the validator (every check)")
        job = validator(parquet, os.path.join(a.out, f"result-{rows}"),
                        os.path.join(os.path.dirname(parquet), "injected.json"))
        res = {"rows": rows, "corpus": meta, "baseline": base, "validator": job, "load_average": load,
               "rows_per_s": round(meta["writer_rows"] / job["wall_s"]),
               "baseline_rows_per_s": round(meta["writer_rows"] / base["wall_s"])}
        results.append(res)
        log(f"{rows}: validator {job['wall_s']} s ({res['rows_per_s']} writer rows/s), exit "
            f"{job['exit_code']}, missing {job['missing_injected']}, unexpected {job['unexpected']}")
        with open(os.path.join(a.out, "spark_bench.json"), "w", encoding="utf-8") as fh:
            json.dump({"machine": {"cores": os.cpu_count(), "master": "local[2]"},
                       "results": results}, fh, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
