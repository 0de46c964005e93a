"""The ``synflow-validate`` command line: parsing needs no Spark, running does.

``synflow-validate --help`` works in an install without PySpark; running the
job there stops with one line naming the extra that brings it.
"""

from __future__ import annotations

import argparse
import sys

from .checks import (
    BY_NAME,
    CHECK_NAMES,
    DEFAULT_BUCKET_S,
    DEFAULT_FIRST_ID,
    DEFAULT_UNRESOLVED_AFTER_S,
)

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="synflow-validate", description=(
        "Prove from the audit logs that no vector-clock token let a reader skip, repeat or "
        "invent a fact."))
    p.add_argument("--logs", required=True, help="directory (or URL) with writer_logs/, token_logs/, instance_map/")
    p.add_argument("--out", required=True, help="output directory (or URL)")
    p.add_argument("--fail-on", choices=("error", "warning", "never"), default="error",
                   help="lowest severity that makes the exit code 1 (default: error)")
    p.add_argument("--output-format", choices=("jsonl", "parquet"), default="jsonl",
                   help="format of violations/ (default: jsonl)")
    p.add_argument("--checks", default="all", help="comma-separated checks to run (default: all)")
    p.add_argument("--clock-skew-ms", type=float, default=0.0,
                   help="allowance when comparing completion and issue times across hosts")
    p.add_argument("--first-id", type=int, default=DEFAULT_FIRST_ID,
                   help="the first id of the sequences; lower ids are never in the future (default 2)")
    p.add_argument("--unresolved-after-s", type=float, default=DEFAULT_UNRESOLVED_AFTER_S,
                   help="age at the end of the log of an open reservation that is reported (default 60)")
    p.add_argument("--bucket-s", type=float, default=DEFAULT_BUCKET_S,
                   help="time bucket of the as-of computations (tuning only; default 1)")
    p.add_argument("--top", type=int, default=20, help="examples per check in report.md")
    p.add_argument("--master", help="Spark master (default: spark-submit's, SPARK_MASTER, else local[*])")
    p.add_argument("--shuffle-partitions", type=int, help="spark.sql.shuffle.partitions")
    p.add_argument("--driver-memory", default="6g", help="driver memory when this process starts Spark")
    p.add_argument("--parallel-stages", type=int, default=2,
                   help="stages run at a time, each in its own thread (default 2; 1: one after another)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    names = CHECK_NAMES if a.checks == "all" else tuple(c.strip() for c in a.checks.split(",") if c.strip())
    unknown = [c for c in names if c not in BY_NAME]
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECK_NAMES)}")
    a.check_names = [c for c in CHECK_NAMES if c in names]
    return a


def main(argv: list[str] | None = None) -> int:
    """``synflow-validate``: parse the arguments, then run the job (exit codes as the job's)."""
    parse_args(argv)  # --help and usage errors need no Spark
    try:
        from .validate_tokens import main as run
    except ImportError as e:
        if (e.name or "").split(".")[0] not in ("pyspark", "py4j"):
            raise
        print(f"synflow-validate: PySpark is not installed ({e}): pip install 'synflow[spark]'", file=sys.stderr)
        return 3
    return run(argv)
