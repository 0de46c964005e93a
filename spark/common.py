"""What the Spark checks share: the run context, the output row shape and a bucketed as-of max."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from .checks import BY_NAME, MAX_LONG, OUTPUT_COLUMNS

OUTPUT_TYPES: dict[str, T.DataType] = {
    c: T.LongType() if c in ("seq", "prev_seq", "stream_id", "claimed_pos", "expected_seq")
    else T.TimestampType() if c in ("issued_at", "reserved_at", "completed_at")
    else T.StringType()
    for c in OUTPUT_COLUMNS
}
INF = MAX_LONG


#: A table derived from the token log (tokens, their components) is broadcast up to this size.
BROADCAST_ROWS = 2_000_000


def small(df: DataFrame, rows: int) -> DataFrame:
    """``df`` with a broadcast hint when it has at most :data:`BROADCAST_ROWS` rows (``rows``)."""
    return F.broadcast(df) if rows <= BROADCAST_ROWS else df


def materialise(df: DataFrame) -> DataFrame:
    """Compute ``df`` now into the block stores and cut its lineage (a local checkpoint).

    The rows are kept serialized (memory, then disk): deserialized rows of tens of millions of
    facts and deliveries fill the driver's heap and leave the job to the garbage collector.
    """
    return df.localCheckpoint(eager=True, storageLevel=StorageLevel.MEMORY_AND_DISK)


#: For an aggregation whose keys are nearly all distinct: skip the pre-shuffle partial step.
NO_PARTIAL_AGGREGATION = {"spark.sql.execution.bypassPartialAggregation": "true"}


@contextmanager
def sql_conf(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Apply runtime SQL ``settings`` to ``spark`` for the ``with`` block, then restore them.

    Settings are read when a query is planned, so a query run (e.g. materialised) inside the
    block is planned with them.
    """
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


@dataclass
class Context:
    """Everything a check needs.

    Attributes:
        spark: the session.
        facts: normalised facts (:mod:`spark.load`).
        tokens: parsed token rows (:mod:`spark.checks_syntax`), all of them.
        valid: the valid tokens, with ``min``, ``comps``, ``claim``.
        deliveries: delivered event ids.
        rooms: the tokens' rooms lists, ``reader, stream, lid, room`` (tokens carry ``lid``).
        comps: one row per (valid token, writer of the token's stream): ``eff``.
        writer_sids: ``stream, writer, min_sid``: the writers of each stream, with their lowest
            stream id.
        instances: ``instance_id -> instance_name``.
        token_rows: the number of token rows (decides which token tables are broadcast).
        writers: the number of writers.
        first_id: ids below this are never in the future.
        skew_us: the clock-skew allowance, µs.
        unresolved_before: reservations open since before this µs time are unresolved.
        bucket_us: width of the as-of time buckets, µs.
        events: the materialised per-event table (:func:`spark.checks_delivery.by_event`), once
            a stage needs it.
        pending_above: the number of (reader, completed fact) pairs above the readers' final
            watermarks, when the triage that builds ``events`` counted them (else None).
    """

    spark: SparkSession
    facts: DataFrame
    tokens: DataFrame
    valid: DataFrame
    deliveries: DataFrame
    rooms: DataFrame
    comps: DataFrame
    writer_sids: DataFrame
    instances: dict[int, str]
    token_rows: int
    writers: int
    first_id: int
    skew_us: int
    unresolved_before: int
    bucket_us: int
    events: DataFrame | None = None
    pending_above: int | None = None


class Sql(str):
    """A Spark SQL expression (as opposed to literal text) inside :func:`sentence`."""


def lit(text: str) -> Sql:
    """A Spark SQL string literal."""
    return Sql("'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'")


def ts(c: str) -> Sql:
    """SQL for the ISO-8601 text of a µs expression ``c``, for explanations."""
    t = f"timestamp_micros({c})"
    return Sql(f"concat(date_format({t}, 'yyyy-MM-dd'), 'T', date_format({t}, 'HH:mm:ss.SSSSSS'), 'Z')")


def txt(c: str) -> Sql:
    """SQL for an expression as text (``null`` when null), for explanations."""
    return Sql(f"coalesce(cast({c} AS STRING), 'null')")


def sentence(*parts: str) -> Sql:
    """SQL concatenating literal text (plain ``str``) and :class:`Sql` parts."""
    return Sql("concat(" + ", ".join(p if isinstance(p, Sql) else lit(p) for p in parts) + ")")


def when(cond: str, then: str, otherwise: str = "NULL") -> Sql:
    """SQL ``CASE WHEN``."""
    return Sql(f"CASE WHEN {cond} THEN {then} ELSE {otherwise} END")


def finish(df: DataFrame, check: str | tuple[str, ...], **cols: str) -> DataFrame:
    """Shape ``df`` into the violation output columns.

    Args:
        df: the violating rows.
        check: the check name; or several check names with one key, when ``df`` has a
            ``_check`` column naming each row's check (the expressions may branch on it).
        **cols: SQL expressions for output columns (µs integers for the time columns); absent
            columns are null. ``explanation`` is required.

    Returns:
        A frame with :data:`spark.checks.OUTPUT_COLUMNS` and ``_key`` (the check's key as one
        string: the stage keeps one row per ``check, _key``).
    """
    names = (check,) if isinstance(check, str) else check
    keys = {BY_NAME[n].key for n in names}
    if len(keys) != 1:
        raise ValueError(f"checks {names} do not share one key")
    if isinstance(check, str):
        name, severity = lit(check), lit(BY_NAME[check].severity.value)
    else:
        name = Sql("_check")
        severity = Sql("CASE _check " + " ".join(
            f"WHEN {lit(n)} THEN {lit(BY_NAME[n].severity.value)}" for n in names) + " END")
    exprs = []
    for c in OUTPUT_COLUMNS:
        typ = OUTPUT_TYPES[c].simpleString()
        if c == "check":
            e = name
        elif c == "severity":
            e = severity
        elif c in cols:
            e = f"timestamp_micros({cols[c]})" if typ == "timestamp" else cols[c]
        else:
            e = "NULL"
        exprs.append(f"CAST({e} AS {typ}) AS `{c}`")
    key = ", ".join(f"coalesce(cast(`{k}` AS STRING), '\\u0000')" for k in keys.pop())
    return df.selectExpr(*exprs).selectExpr("*", f"concat_ws('\\u0001', {key}) AS _key")


def one_row_per_failed_check(df: DataFrame, rules: dict[str, tuple[Column, Sql]]) -> tuple[DataFrame, Sql]:
    """Evaluate several checks on each row of ``df`` in one pass.

    Args:
        df: the rows.
        rules: check name -> (condition that the row violates it, explanation SQL).

    Returns:
        The rows that fail some check, repeated once per check they fail with its name in
        ``_check``, and the explanation SQL choosing by ``_check`` (for :func:`finish`).
    """
    failed = F.filter(F.array(*[F.when(F.coalesce(cond, F.lit(False)), F.lit(n)) for n, (cond, _) in rules.items()]),
                      lambda c: c.isNotNull())
    out = df.withColumn("_checks", failed).where(F.size("_checks") > 0).withColumn("_check", F.explode("_checks"))
    return out, Sql("CASE _check " + " ".join(f"WHEN {lit(n)} THEN {x}" for n, (_, x) in rules.items()) + " END")


def name_map(instances: dict[int, str]) -> Sql:
    """SQL for a literal map ``instance_id -> instance_name``."""
    if not instances:
        return Sql("cast(map() AS map<int,string>)")
    return Sql("map(" + ", ".join(f"{i}, {lit(n)}" for i, n in sorted(instances.items())) + ")")


def writer_name(instances: dict[int, str], wid: str) -> Sql:
    """SQL for the instance name of the instance id expression ``wid`` (the id if unknown)."""
    return Sql(f"coalesce(try_element_at({name_map(instances)}, {wid}), cast({wid} AS STRING))")


#: The as-of computation with few events cuts time into at most about this many buckets (over all
#: its keys): each one is an element of the broadcast prefix arrays.
MAX_BUCKETS = 4_000_000


def _running(ev: DataFrame, q: DataFrame, keys: list[str], inclusive: bool) -> DataFrame:
    """Each query's max ``v`` over the events of its own (key, bucket) up to its time: ``inb``."""
    # Ties: for a strict comparison queries sort before events at the same time, else after.
    q_order, e_order = (1, 0) if inclusive else (0, 1)
    qcols = [c for c in q.columns if c not in (*keys, "t", "b")]
    rows = ev.select(*keys, "t", "b", "v", F.lit(e_order).alias("_o"),
                     *[F.lit(None).cast(q.schema[c].dataType).alias(c) for c in qcols])
    rows = rows.unionByName(q.select(*keys, "t", "b", F.lit(None).cast("bigint").alias("v"),
                                     F.lit(q_order).alias("_o"), *qcols))
    running = Window.partitionBy(*keys, "b").orderBy("t", "_o").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return rows.withColumn("inb", F.max("v").over(running)).where(F.col("_o") == q_order).drop("v", "_o")


def asof_max(events: DataFrame, queries: DataFrame, keys: list[str], bucket_us: int,
             inclusive: bool, few_rows: int) -> DataFrame:
    """For each of a few queries, the max ``v`` of the events with the same keys and an earlier time.

    ``events`` has ``keys, t, v``; ``queries`` has ``keys, t`` (``t`` may be :data:`INF`) and any
    other columns. An event counts when ``event.t < query.t`` (``<=`` when ``inclusive``).

    Time is cut into buckets of ``bucket_us`` (integer division, so the bucket grows with the
    time); the maximum over a query's earlier buckets is the running maximum of the events'
    per-bucket maxima, and a window over the rows of one (key, bucket), events and queries
    sorted by time together, gives the maximum within the query's own bucket. Only the events
    of buckets that hold a query enter that window (the queries' buckets, ``few_rows`` of
    them at most, are broadcast up to :data:`BROADCAST_ROWS`). The bucket width changes the
    cost, never the answer. Every step is a scan, an aggregation, a sort or an equi-join:
    near-linear, and parallel across keys and buckets.

    Returns:
        ``queries`` with an added column ``best`` (null when no event qualifies).
    """
    bucket = F.expr(f"t div {max(1, bucket_us)}")  # integer division: monotone in t, exact even for INF
    ev = events.select(*keys, "t", "v").withColumn("b", bucket)
    q = queries.withColumn("b", bucket)
    qcols = [c for c in q.columns if c not in (*keys, "t", "b")]
    per_bucket = ev.groupBy(*keys, "b").agg(F.max("v").alias("bmax"))
    before = Window.partitionBy(*keys).orderBy("b").rowsBetween(Window.unboundedPreceding, -1)
    q_buckets = q.select(*keys, "b").distinct()
    table = (per_bucket.unionByName(q_buckets.withColumn("bmax", F.lit(None).cast("bigint")))
             .groupBy(*keys, "b").agg(F.max("bmax").alias("bmax")))
    prefix = table.select(*keys, "b", F.max("bmax").over(before).alias("prefix"))
    inside = _running(ev.join(small(q_buckets, few_rows), [*keys, "b"], "left_semi"), q, keys, inclusive)
    return (inside.join(prefix, [*keys, "b"], "left")
            .select(*keys, "t", *qcols, F.greatest("prefix", "inb").alias("best")))


def asof_reaches(events: DataFrame, queries: DataFrame, keys: list[str], bucket_us: int,
                 inclusive: bool, at_least: str, few_rows: int) -> DataFrame:
    """The queries for which the max ``v`` of the few events with the same keys and an earlier
    time is at least the query's column ``at_least``.

    ``events`` (``keys, t, v``; ``few_rows`` rows at most) and ``queries`` (``keys, t`` and any
    other columns) are as in :func:`asof_max`. Time is cut into buckets at least ``bucket_us``
    wide (wider when the events span more than :data:`MAX_BUCKETS` of them). For each key, a
    broadcast array holds the running maximum of the events' per-bucket maxima, one element
    per bucket, so one scan of the many queries reads, for each, the maximum over the buckets
    before its own (a lower bound of its answer) and over those up to its own (an upper
    bound). A query whose upper bound is below ``at_least`` is dropped there, and one whose
    lower bound reaches it is kept; only the rest (few: an event of their own bucket decides)
    go through a window over the rows of their (key, bucket), events and queries sorted by
    time together. The queries are never shuffled.

    Returns:
        The qualifying rows of ``queries``.
    """
    ev = events.select(*keys, "t", "v")
    spans = ev.groupBy(*keys).agg(F.min("t").alias("lo"), F.max("t").alias("hi")).collect()
    width = max(1, bucket_us, -(-sum(r["hi"] - r["lo"] for r in spans) // MAX_BUCKETS))
    bucket = F.expr(f"t div {width}")  # integer division: monotone in t, exact even for INF
    ev = ev.withColumn("b", bucket)
    per_bucket = ev.groupBy(*keys, "b").agg(F.max("v").alias("bmax"))
    # Element i of a key's array: the max over its buckets up to b0 + i - 1 (null before any).
    ranges = per_bucket.groupBy(*keys).agg(F.min("b").alias("b0"), F.max("b").alias("b1"),
                                           F.max("bmax").alias("total"))
    before = Window.partitionBy(*keys).orderBy("b").rowsBetween(Window.unboundedPreceding, -1)
    dense = (ranges.select(*keys, F.explode(F.sequence("b0", "b1")).alias("b"))
             .join(per_bucket, [*keys, "b"], "left")
             .select(*keys, "b", F.max("bmax").over(before).alias("p"))
             .groupBy(*keys).agg(F.sort_array(F.collect_list(F.struct("b", "p"))).alias("_a"))
             .join(ranges, keys)
             .select(*keys, "b0", "b1", "total", F.transform("_a", lambda x: x["p"]).alias("_prefix")))

    b, b0, b1 = F.col("b"), F.col("b0"), F.col("b1")
    null = F.lit(None).cast("bigint")
    # The max over the buckets before b, and up to b (no arithmetic on b: it may be INF's).
    lower = F.when(b <= b0, null).when(b > b1, F.col("total")).otherwise(
        F.element_at("_prefix", (b - b0 + 1).cast("int")))
    upper = F.when(b < b0, null).when(b >= b1, F.col("total")).otherwise(
        F.element_at("_prefix", (b - b0 + 2).cast("int")))

    qcols = list(queries.columns)
    bounded = (queries.withColumn("b", bucket).join(F.broadcast(dense), keys, "left")
               .select(*qcols, "b", lower.alias("_lo"), upper.alias("_hi"))
               .where(F.col("_hi") >= F.col(at_least)).transform(materialise))
    sure = bounded.where(F.col("_lo") >= F.col(at_least))
    open_ = bounded.where(F.col("_lo").isNull() | (F.col("_lo") < F.col(at_least)))
    decided = _running(ev, open_.drop("_hi"), keys, inclusive).where(F.greatest("_lo", "inb") >= F.col(at_least))
    return sure.select(*qcols).unionByName(decided.select(*qcols))
