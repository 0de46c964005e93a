"""The one SparkSession shared by every Spark test, and helpers to run the validator in it.

The session is created lazily on first use (``local[2]``, two shuffle partitions, no UI, UTC,
ANSI mode on explicitly, room to keep generated code compiled across validator runs) and never
stopped between tests: starting a JVM costs 10-25 s.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from tests.services import require_java

_SPARK = None

#: Generated classes the shared session keeps compiled (``spark.sql.codegen.cache.maxEntries``):
#: several validator runs' worth, so that each run reuses what the runs before it compiled.
CODEGEN_CACHE_ENTRIES = 4000


def spark():
    """The shared session; skips (fails under CI) when Java or pyspark is missing."""
    global _SPARK
    require_java()
    if _SPARK is None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        from pyspark.sql import SparkSession

        from tests import TEST_JVM_OPTIONS

        # This JVM lives as long as the test run and runs hundreds of jobs: the optimising JIT
        # compiler pays off here (the quick-compiler-only options of the short-lived JVMs cost the
        # in-process Spark tests about 15% more CPU).
        submit_opts = os.environ.get("SPARK_SUBMIT_OPTS")
        if submit_opts == TEST_JVM_OPTIONS:
            del os.environ["SPARK_SUBMIT_OPTS"]
        try:
            _SPARK = (SparkSession.builder.master("local[2]").appName("synflow-spark-tests")
                      .config("spark.ui.enabled", "false")
                      .config("spark.ui.showConsoleProgress", "false")
                      .config("spark.sql.shuffle.partitions", "2")
                      .config("spark.sql.adaptive.enabled", "false")
                      .config("spark.sql.session.timeZone", "UTC")
                      .config("spark.sql.ansi.enabled", "true")
                      .config("spark.driver.memory", "2g")
                      # Spark keeps the classes it compiled for generated code in a cache of
                      # 100 by default; one validator run compiles about 670, so every run
                      # evicted the last one's and compiled them all again. With room for them,
                      # a validator run after the first compiles about 30 and takes ~20% less CPU.
                      .config("spark.sql.codegen.cache.maxEntries", str(CODEGEN_CACHE_ENTRIES))
                      .getOrCreate())
        finally:
            if submit_opts is not None:
                os.environ["SPARK_SUBMIT_OPTS"] = submit_opts
        _SPARK.sparkContext.setLogLevel("ERROR")
    return _SPARK



def validate(logs: str, out: str, *extra: str) -> int:
    """Run the validator in the shared session; return its exit code."""
    spark()
    from spark.validate_tokens import main

    return main(["--logs", logs, "--out", out, "--quiet", "--shuffle-partitions", "2", *extra])


def violations(out: str) -> list[dict[str, Any]]:
    """The violation rows written under ``out/violations`` (JSONL output)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "violations", "*.json"))):
        with open(path, encoding="utf-8") as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


def parquet_violations(out: str) -> tuple[list[dict[str, Any]], Any]:
    """The violation rows and their schema under ``out/violations`` (Parquet output), read by Spark."""
    df = spark().read.parquet(os.path.join(out, "violations"))
    return [r.asDict() for r in df.collect()], df.schema


def summary(out: str) -> dict[str, Any]:
    """The run's ``summary.json``."""
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        return json.load(fh)
