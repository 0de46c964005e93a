"""The token validator job: ``synflow-validate --logs DIR --out DIR``.

Installed, the package is ``synflow_spark`` and the command ``synflow-validate``; from a checkout
``python -m spark.validate_tokens`` runs the same code. It also runs as a plain script
(``spark-submit …/validate_tokens.py``), and ``scripts/build_validator_zip`` builds the
``--py-files`` archive and driver for ``spark-submit`` on a cluster. Exit codes: 0 clean,
1 violations at or above ``--fail-on``, 2 bad input, 3 internal failure.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a script (spark-submit): import the package this file is in
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))
    __package__ = os.path.basename(_here)  # PEP 366: relative imports in a script

import argparse
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import reduce
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from . import checks_delivery, checks_syntax, checks_tokens, checks_writer, gaps
from .checks import BY_NAME
from .cli import parse_args
from .common import Context, materialise
from .inputs import InputError
from .load import Inputs, load
from .report import exit_code, remove, write_outputs, write_violations
from .session import get_session


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.start = time.monotonic()
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[validate_tokens {time.monotonic() - self.start:7.1f}s] {msg}", file=sys.stderr,
                  flush=True)


def _stage(name: str, dfs: dict[str, DataFrame], args: argparse.Namespace, summary: dict,
           examples: dict, progress: _Progress, writing: threading.Lock,
           summary_gaps: gaps.Gaps | None = None) -> None:
    """Compute one stage's checks in one Spark job, then summarise and write them.

    The checks' violations are unioned, deduplicated per key and cached; one query then
    returns the count and the first ``--top`` rows of each check, and one write appends the
    rows to ``violations/`` (holding ``writing``: two writes into one directory at once would
    share Spark's temporary directory there). Violations inside one of ``summary_gaps`` are
    counted under ``summary["gaps"]["unverifiable"]`` instead (:mod:`spark.gaps`).
    """
    t = time.monotonic()
    progress(f"stage {name}: {', '.join(dfs)}")
    frames = list({id(df): df for df in dfs.values()}.values())  # a frame may serve several checks
    v = reduce(DataFrame.unionByName, frames).dropDuplicates(["check", "_key"]).drop("_key")
    in_gap = gaps.unverifiable(summary_gaps) if summary_gaps is not None else None
    if in_gap is not None:
        v = v.withColumn("_gap", in_gap)
    persisted = v = v.persist(StorageLevel.MEMORY_AND_DISK)
    if in_gap is not None:
        # Violations inside a reported gap are unverifiable: counted, not reported.
        for row in v.where("_gap").groupBy("check").count().collect():
            summary["gaps"]["unverifiable"][row[0]] = row[1]
            progress(f"check {row[0]}: {row[1]} unverifiable (inside an audit gap)")
        v = v.where(~F.col("_gap")).drop("_gap")
    order = [c for c in ("stream", "reader", "seq", "writer", "stream_id", "event_id", "room_id")]
    ranked = (v.withColumn("_n", F.count(F.lit(1)).over(Window.partitionBy("check")))
              .withColumn("_r", F.row_number().over(Window.partitionBy("check").orderBy(*order)))
              .where(F.col("_r") <= args.top).drop("_r").collect())
    counts = {check: 0 for check in dfs}
    for row in ranked:
        d = row.asDict()
        counts[d["check"]] = d.pop("_n")
        examples.setdefault(d["check"], []).append(d)
    if any(counts.values()):
        with writing:
            write_violations(v, f"{args.out.rstrip('/')}/violations", args.output_format)
    persisted.unpersist()
    secs = round(time.monotonic() - t, 3)
    summary["timings"][name] = secs
    for check, n in counts.items():
        summary["checks"][check] = {"severity": BY_NAME[check].severity.value, "count": n,
                                    "stage_seconds": secs}
        progress(f"check {check}: {n} violation(s)")
    progress(f"stage {name} done in {secs:.1f}s")


def build_context(spark: SparkSession, inputs: Inputs, args: argparse.Namespace) -> Context:
    """Parse the tokens and build the token components (both materialised) for the checks."""
    tokens = checks_syntax.parse_tokens(inputs.tokens, inputs.instances).transform(materialise)
    valid = tokens.where("valid")
    comps = checks_syntax.components(valid, inputs.writer_sids, inputs.instances).transform(materialise)
    return Context(spark, inputs.facts, tokens, valid, inputs.deliveries, inputs.rooms, comps, inputs.writer_sids,
                   inputs.instances, inputs.stats["token_logs"]["rows"],
                   inputs.stats["writer_logs"]["writers"],
                   args.first_id, int(args.clock_skew_ms * 1000),
                   inputs.end_of_log - int(args.unresolved_after_s * 1_000_000),
                   max(1, int(args.bucket_s * 1_000_000)))


@dataclass
class Stage:
    """One stage: a group of checks computed and written together.

    Attributes:
        name: the stage name (``syntax``, ``writer``, ``tokens``, ``delivery``, ``undelivered``).
        checks: the names of the checks it can compute (it runs when one of them is wanted).
        needs_events: whether it reads the per-event table (``ctx.events``).
        build: returns the violation frames of its wanted checks and its pending-count frame
            (None except for ``undelivered``); several checks may map to one frame that
            computes them all (its rows name their check).
    """

    name: str
    checks: tuple[str, ...]
    needs_events: bool
    build: Callable[[], tuple[dict[str, DataFrame], DataFrame | None]]


def plan_stages(ctx: Context, wanted: set[str]) -> list[Stage]:
    """The stages that compute the ``wanted`` checks, in report order."""
    def table(checks: dict) -> Callable[[], tuple[dict[str, DataFrame], DataFrame | None]]:
        return lambda: ({n: fn(ctx) for n, fn in checks.items() if n in wanted}, None)

    def one_pass(checks: dict, together: tuple[str, ...], shared: Callable[[list[str]], DataFrame],
                 call: Callable[[Callable], DataFrame]) -> dict[str, DataFrame]:
        # The wanted checks of `together` map to one frame that computes them all.
        one = [n for n in together if n in wanted]
        frame = shared(one) if one else None
        return {n: frame if n in one else call(fn) for n, fn in checks.items() if n in wanted}

    def writer() -> tuple[dict[str, DataFrame], DataFrame | None]:
        return one_pass(checks_writer.CHECKS, checks_writer.PER_FACT, lambda one: checks_writer.per_fact(ctx, one),
                        lambda fn: fn(ctx)), None

    def delivery() -> tuple[dict[str, DataFrame], DataFrame | None]:
        e = ctx.events
        assert e is not None
        return one_pass(checks_delivery.CHECKS, checks_delivery.PER_DELIVERY,
                        lambda one: checks_delivery.per_delivery(ctx, e, one), lambda fn: fn(ctx, e)), None

    def undelivered() -> tuple[dict[str, DataFrame], DataFrame | None]:
        assert ctx.events is not None
        df, pending = checks_delivery.undelivered(ctx, ctx.events)
        return {"undelivered": df}, pending

    out = [Stage("syntax", tuple(checks_syntax.CHECKS), False, table(checks_syntax.CHECKS)),
           Stage("writer", tuple(checks_writer.CHECKS), "duplicate_event_id" in wanted, writer),
           Stage("tokens", tuple(checks_tokens.CHECKS), False, table(checks_tokens.CHECKS)),
           Stage("delivery", tuple(checks_delivery.CHECKS), True, delivery),
           Stage("undelivered", ("undelivered",), True, undelivered)]
    return [st for st in out if wanted & set(st.checks)]


def stages(ctx: Context, wanted: set[str]) -> Iterator[tuple[str, dict[str, DataFrame], DataFrame | None]]:
    """Each stage's name, the violation frames of its wanted checks, and its pending-count frame.

    One stage after another (the job itself runs them concurrently: :func:`run_checks`). The
    per-event table is materialised into ``ctx.events`` just before the first stage that reads it.
    """
    for st in plan_stages(ctx, wanted):
        if st.needs_events and ctx.events is None:
            ctx.events, _, ctx.pending_above = checks_delivery.events_table(ctx)
        dfs, pending = st.build()
        yield st.name, dfs, pending


def run_checks(spark: SparkSession, args: argparse.Namespace, summary: dict, examples: dict,
               progress: _Progress) -> None:
    """Load the input and run the selected checks, filling ``summary`` and ``examples``.

    The stages run ``--parallel-stages`` at a time (two by default), each in its own thread: a
    stage's Spark jobs leave cores idle between their steps, and another stage's tasks fill
    them. The per-event table is built first, alongside the stages that do not read it; the
    stages that read it start once it is there. Stage times therefore overlap.
    """
    t = time.monotonic()
    progress(f"stage load: reading {args.logs}")
    inputs = load(spark, args.logs)
    summary["inputs"], summary["end_of_log_us"] = inputs.stats, inputs.end_of_log
    if inputs.gaps is not None:
        summary["gaps"] = {**inputs.gaps.summary(), "unverifiable": {}}
        if inputs.gaps.writer or inputs.gaps.tokens:
            progress(f"stage load: {len(inputs.gaps.writer)} writer-log and {len(inputs.gaps.tokens)} "
                     "token-log gap(s): violations inside them are unverifiable")
    progress(f"stage load: {inputs.stats['writer_logs']['fact_rows']} facts, "
             f"{inputs.stats['token_logs']['rows']} tokens, "
             f"{inputs.stats['token_logs']['deliveries']} deliveries")
    ctx = build_context(spark, inputs, args)
    summary["timings"]["load"] = round(time.monotonic() - t, 3)
    plan = plan_stages(ctx, set(args.check_names))
    writing = threading.Lock()  # one write at a time into violations/

    def events() -> None:
        t = time.monotonic()
        spark.sparkContext.setJobDescription("validate_tokens: per-event table")
        progress("per-event table: building")
        ctx.events, suspects, ctx.pending_above = checks_delivery.events_table(ctx)
        summary["timings"]["events_table"] = round(time.monotonic() - t, 3)
        summary["events_table"] = {"triage": suspects is not None, "suspect_event_ids": suspects}
        what = "every event id" if suspects is None else f"{suspects} suspect event id(s)"
        progress(f"per-event table: {what}, built in {summary['timings']['events_table']:.1f}s")

    def run_stage(st: Stage) -> None:
        t = time.monotonic()
        spark.sparkContext.setJobDescription(f"validate_tokens: stage {st.name}")  # for the Spark UI
        dfs, pending = st.build()
        prepared = time.monotonic() - t  # eager preparation inside a check, e.g. a small table
        if prepared >= 0.5:
            summary["timings"][f"{st.name}_prepare"] = round(prepared, 3)
            progress(f"stage {st.name}: prepared in {prepared:.1f}s")
        if pending is not None:
            row = pending.first()
            summary["pending"]["above_reader_watermark"] = row[0] if row is not None else 0
        _stage(st.name, dfs, args, summary, examples, progress, writing, inputs.gaps)

    with ThreadPoolExecutor(max(1, args.parallel_stages), thread_name_prefix="stage") as pool:
        futures = []
        table = pool.submit(events) if any(st.needs_events for st in plan) else None
        futures += [pool.submit(run_stage, st) for st in plan if not st.needs_events]
        if table is not None:
            table.result()
            futures += [pool.submit(run_stage, st) for st in plan if st.needs_events]
        for f in futures:
            f.result()
    summary["pending"]["in_flight_facts"] = inputs.stats["writer_logs"]["in_flight"]


def run(spark: SparkSession, args: argparse.Namespace) -> int:
    """Run the job with parsed arguments on ``spark`` and write the output; return the exit code."""
    progress = _Progress(not args.quiet)
    t0 = time.monotonic()
    summary: dict[str, Any] = {
        "logs": args.logs, "out": args.out, "fail_on": args.fail_on, "checks": {}, "pending": {},
        "timings": {}, "started_at": datetime.now(UTC).isoformat(),
        "spark": {"version": spark.version, "master": spark.sparkContext.master,
                  "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions")},
        "parameters": {"clock_skew_ms": args.clock_skew_ms, "first_id": args.first_id,
                       "unresolved_after_s": args.unresolved_after_s, "bucket_s": args.bucket_s,
                       "checks": args.check_names},
    }
    examples: dict[str, list[dict[str, Any]]] = {}
    try:
        remove(spark, f"{args.out.rstrip('/')}/violations")
        run_checks(spark, args, summary, examples, progress)
        code = exit_code({c: r["count"] for c, r in summary["checks"].items()}, args.fail_on)
    except InputError as e:
        code, summary["error"] = 2, f"bad input: {e}"
        print(f"validate_tokens: bad input: {e}", file=sys.stderr)
    except Exception as e:  # the contract: any other failure is exit code 3
        code, summary["error"] = 3, f"internal failure: {type(e).__name__}: {e}"
        traceback.print_exc()
    summary["exit_code"] = code
    summary["timings"]["total"] = round(time.monotonic() - t0, 3)
    counts = {c: r["count"] for c, r in summary["checks"].items()}
    summary["violations"] = {"total": sum(counts.values()), "by_severity": {
        s: sum(n for c, n in counts.items() if BY_NAME[c].severity.value == s) for s in ("error", "warning")}}
    try:
        write_outputs(spark, args.out.rstrip("/"), summary, examples)
    except Exception as e:  # the output location itself is broken
        print(f"validate_tokens: cannot write {args.out}: {e}", file=sys.stderr)
        code = code or 3
    progress(f"done: exit {code}, {summary['violations']['total']} violation(s), "
             f"{summary['timings']['total']:.1f}s")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse arguments, get a session, run. Returns the exit code."""
    args = parse_args(argv)
    try:
        spark = get_session(args.master, args.shuffle_partitions, args.driver_memory)
    except Exception as e:
        print(f"validate_tokens: cannot start Spark: {e}", file=sys.stderr)
        return 3
    return run(spark, args)


if __name__ == "__main__":
    sys.exit(main())
