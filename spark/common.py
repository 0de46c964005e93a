"""What the Spark checks share: the run context, the output row shape and a bucketed as-of max."""

from __future__ import annotations

from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from spark.checks import BY_NAME, MAX_LONG, OUTPUT_COLUMNS

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
        instances: ``instance_id -> instance_name``.
        token_rows: the number of token rows (decides which token tables are broadcast).
        writers: the number of writers.
        first_id: ids below this are never in the future.
        skew_us: the clock-skew allowance, µs.
        unresolved_before: reservations open since before this µs time are unresolved.
        bucket_us: width of the as-of time buckets, µs.
    """

    spark: SparkSession
    facts: DataFrame
    tokens: DataFrame
    valid: DataFrame
    deliveries: DataFrame
    rooms: DataFrame
    comps: DataFrame
    instances: dict[int, str]
    token_rows: int
    writers: int
    first_id: int
    skew_us: int
    unresolved_before: int
    bucket_us: int


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


def finish(df: DataFrame, check: str, **cols: str) -> DataFrame:
    """Shape ``df`` into the violation output columns.

    Args:
        df: the violating rows.
        check: the check name.
        **cols: SQL expressions for output columns (µs integers for the time columns); absent
            columns are null. ``explanation`` is required.

    Returns:
        A frame with :data:`spark.checks.OUTPUT_COLUMNS` and ``_key`` (the check's key as one
        string: the stage keeps one row per ``check, _key``).
    """
    exprs = []
    for c in OUTPUT_COLUMNS:
        typ = OUTPUT_TYPES[c].simpleString()
        if c == "check":
            e = lit(check)
        elif c == "severity":
            e = lit(BY_NAME[check].severity.value)
        elif c in cols:
            e = f"timestamp_micros({cols[c]})" if typ == "timestamp" else cols[c]
        else:
            e = "NULL"
        exprs.append(f"CAST({e} AS {typ}) AS `{c}`")
    key = ", ".join(f"coalesce(cast(`{k}` AS STRING), '\\u0000')" for k in BY_NAME[check].key)
    return df.selectExpr(*exprs).selectExpr("*", f"concat_ws('\\u0001', {key}) AS _key")


def name_map(instances: dict[int, str]) -> Sql:
    """SQL for a literal map ``instance_id -> instance_name``."""
    if not instances:
        return Sql("cast(map() AS map<int,string>)")
    return Sql("map(" + ", ".join(f"{i}, {lit(n)}" for i, n in sorted(instances.items())) + ")")


def writer_name(instances: dict[int, str], wid: str) -> Sql:
    """SQL for the instance name of the instance id expression ``wid`` (the id if unknown)."""
    return Sql(f"coalesce(try_element_at({name_map(instances)}, {wid}), cast({wid} AS STRING))")


def asof_max(events: DataFrame, queries: DataFrame, keys: list[str], bucket_us: int,
             inclusive: bool, query_rows: int | None = None) -> DataFrame:
    """For each query, the max ``v`` of the events with the same keys and an earlier time.

    ``events`` has ``keys, t, v``; ``queries`` has ``keys, t`` (``t`` may be :data:`INF`) and any
    other columns. An event counts when ``event.t < query.t`` (``<=`` when ``inclusive``). Time is
    cut into buckets: a small table of per-bucket maxima gives the maximum over earlier buckets,
    and a window over one bucket's rows (events and queries together) gives the rest. Every step
    is a sort, an aggregation or an equi-join: O(n log n), parallel across keys and buckets.

    When the queries are few (``query_rows`` at most :data:`BROADCAST_ROWS`), only the events in
    a bucket that holds a query enter the window (a broadcast semi-join): the others count only
    through the per-bucket maxima.

    Returns:
        ``queries`` with an added column ``best`` (null when no event qualifies).
    """
    bucket = F.floor(F.col("t") / F.lit(bucket_us)).cast("bigint")
    ev = events.select(*keys, "t", "v").withColumn("b", bucket)
    q = queries.withColumn("b", bucket)
    per_bucket = ev.groupBy(*keys, "b").agg(F.max("v").alias("bmax"))
    q_buckets = q.select(*keys, "b").distinct().withColumn("bmax", F.lit(None).cast("bigint"))
    table = per_bucket.unionByName(q_buckets).groupBy(*keys, "b").agg(F.max("bmax").alias("bmax"))
    before = Window.partitionBy(*keys).orderBy("b").rowsBetween(Window.unboundedPreceding, -1)
    prefix = table.select(*keys, "b", F.max("bmax").over(before).alias("prefix"))
    # Ties: for a strict comparison queries sort before events at the same time, else after.
    q_order, e_order = (1, 0) if inclusive else (0, 1)
    qcols = [c for c in q.columns if c not in (*keys, "t", "b")]
    if query_rows is not None and query_rows <= BROADCAST_ROWS:
        ev = ev.join(F.broadcast(q.select(*keys, "b").distinct()), [*keys, "b"], "left_semi")
    rows = ev.select(*keys, "t", "b", "v", F.lit(e_order).alias("_o"),
                     *[F.lit(None).cast(q.schema[c].dataType).alias(c) for c in qcols])
    rows = rows.unionByName(q.select(*keys, "t", "b", F.lit(None).cast("bigint").alias("v"),
                                     F.lit(q_order).alias("_o"), *qcols))
    running = Window.partitionBy(*keys, "b").orderBy("t", "_o").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    inb = rows.withColumn("inb", F.max("v").over(running)).where(F.col("_o") == q_order)
    joined = inb.join(prefix, [*keys, "b"], "left")
    return joined.select(*keys, "t", *qcols, F.greatest("prefix", "inb").alias("best"))
