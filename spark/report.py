"""Writing the validator's output: ``violations/``, ``summary.json`` and ``report.md``.

Files are written through Hadoop's FileSystem so that ``--out`` may be any Spark-writable URL
(a local path, ``hdfs://``, ``s3a://``).
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from .checks import BY_NAME, CHECKS, fails


def _fs_path(spark: SparkSession, path: str):
    jvm = spark.sparkContext._jvm
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), p


def write_text(spark: SparkSession, path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing it."""
    fs, p = _fs_path(spark, path)
    stream = fs.create(p, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def remove(spark: SparkSession, path: str) -> None:
    """Delete ``path`` recursively if it exists."""
    fs, p = _fs_path(spark, path)
    if fs.exists(p):
        fs.delete(p, True)


def write_violations(df: DataFrame, path: str, fmt: str) -> None:
    """Append violations as one JSONL or Parquet file to the directory ``path``."""
    writer = df.coalesce(1).write.mode("append")
    if fmt == "parquet":
        writer.option("compression", "zstd").parquet(path)
    else:
        # Spark's JSON writer drops null fields by default; every row carries every column.
        (writer.option("timestampFormat", "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX")
         .option("ignoreNullFields", "false").json(path))


def exit_code(counts: dict[str, int], fail_on: str) -> int:
    """1 when any check at or above ``fail_on`` has violations, else 0."""
    return int(any(n and fails(BY_NAME[c].severity.value, fail_on) for c, n in counts.items()))


def render_report(summary: dict[str, Any], examples: dict[str, list[dict[str, Any]]]) -> str:
    """The Markdown report: verdict, counts per check, then the top examples of each check."""
    lines = ["# Token validation report", ""]
    verdict = {0: "PASSED", 1: "FAILED", 2: "BAD INPUT", 3: "INTERNAL FAILURE"}[summary["exit_code"]]
    lines += [f"**{verdict}** (exit {summary['exit_code']}, `--fail-on {summary['fail_on']}`), "
              f"logs `{summary['logs']}`, {summary['timings'].get('total', 0):.1f} s.", ""]
    if summary.get("error"):
        lines += ["## Error", "", summary["error"], ""]
        return "\n".join(lines)
    ins = summary["inputs"]
    lines += [f"Input: {ins['writer_logs']['fact_rows']} facts in {ins['writer_logs']['streams']} "
              f"stream(s), {ins['token_logs']['rows']} tokens of {ins['token_logs']['readers']} "
              f"reader(s), {ins['token_logs']['deliveries']} deliveries. Pending (not violations): "
              f"{summary['pending'].get('in_flight_facts', 0)} facts in flight, "
              f"{summary['pending'].get('above_reader_watermark', 'n/a')} (reader, fact) pairs "
              "above the reader's final position.", "",
              "| check | severity | violations | stage seconds |", "|---|---|---|---|"]
    gaps = summary.get("gaps") or {}
    if gaps.get("writer_logs") or gaps.get("token_logs"):
        unverifiable = ", ".join(f"{c} {n}" for c, n in sorted(gaps.get("unverifiable", {}).items())) or "none"
        lines[-2:-2] = [f"Gaps (the logs could not record part of the history): "
                        f"{len(gaps.get('writer_logs', []))} in writer logs, {len(gaps.get('token_logs', []))} "
                        f"in token logs; unverifiable, not counted as violations: {unverifiable}.", ""]
    for c in CHECKS:
        r = summary["checks"].get(c.name)
        if r is not None:
            lines.append(f"| {c.name} | {c.severity.value} | {r['count']} | {r['stage_seconds']:.2f} |")
    lines.append("")
    for c in CHECKS:
        rows = examples.get(c.name) or []
        if not rows:
            continue
        n = summary["checks"][c.name]["count"]
        lines += [f"## {c.name} ({n})", "", f"_{c.summary}._", ""]
        lines += [f"- {r['explanation']}" for r in rows]
        if n > len(rows):
            lines.append(f"- … and {n - len(rows)} more in `violations/` (check = {c.name}).")
        lines.append("")
    return "\n".join(lines)


def write_outputs(spark: SparkSession, out: str, summary: dict[str, Any],
                  examples: dict[str, list[dict[str, Any]]]) -> None:
    """Write ``summary.json`` and ``report.md`` under ``out``."""
    write_text(spark, f"{out}/summary.json", json.dumps(summary, indent=2, sort_keys=True, default=str))
    write_text(spark, f"{out}/report.md", render_report(summary, examples))
