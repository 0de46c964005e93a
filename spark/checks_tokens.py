"""Tokens against writers: gap_skip, future_position, non_monotonic.

``gap_skip`` first finds, with a bucketed as-of maximum over all readers' token components
(:func:`spark.common.asof_reaches`), the facts that *some* token covered before they completed;
only those few facts are then matched per reader with the reader's "record" tokens (tokens
whose effective position exceeds all earlier ones), which makes "the earliest token covering
the fact" an ordered as-of lookup instead of a search.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from .checks_syntax import eff_of
from .common import (
    INF,
    Context,
    Sql,
    asof_max,
    asof_reaches,
    finish,
    lit,
    sentence,
    ts,
    txt,
    when,
    writer_name,
)


def records(comps: DataFrame, order: list[str]) -> DataFrame:
    """The component rows whose ``eff`` exceeds every earlier one of the same reader and writer."""
    w = Window.partitionBy("stream", "writer", "reader").orderBy(*order).rowsBetween(
        Window.unboundedPreceding, -1)
    return comps.withColumn("_pm", F.max("eff").over(w)).where(
        F.col("_pm").isNull() | (F.col("eff") > F.col("_pm"))).drop("_pm")


def first_covering(recs: DataFrame, queries: DataFrame, payload: list[str]) -> DataFrame:
    """For each query (``stream, writer, reader, sid``), the first record with ``eff >= sid``.

    Records rise in both order and ``eff``, so the first one in order that covers ``sid`` is
    the one with the smallest ``eff >= sid``: a descending sort with a running ``last``.

    Returns:
        ``queries`` with a struct column ``w`` (``eff`` plus ``payload``), null when none covers.
    """
    keys = ["stream", "writer", "reader"]
    rec = recs.select(*keys, F.col("eff").alias("_v"), F.lit(1).alias("_o"),
                      F.struct("eff", *payload).alias("w"))
    qcols = [c for c in queries.columns if c not in keys]
    rows = rec.select(*rec.columns, *[F.lit(None).cast(queries.schema[c].dataType).alias(c) for c in qcols])
    q = queries.select(*keys, F.col("sid").alias("_v"), F.lit(0).alias("_o"),
                       F.lit(None).cast(rec.schema["w"].dataType).alias("w"), *qcols)
    w = Window.partitionBy(*keys).orderBy(F.col("_v").desc(), F.col("_o").desc()).rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return (rows.unionByName(q).withColumn("w", F.last("w", ignorenulls=True).over(w))
            .where(F.col("_o") == 0).drop("_v", "_o"))


def gap_skip(ctx: Context) -> DataFrame:
    """Facts covered by a reader's token issued before the fact completed (data loss)."""
    events = ctx.comps.select("stream", "writer", F.col("issued").alias("t"), F.col("eff").alias("v"))
    due = F.when(F.col("rel").isNull(), F.lit(INF)).otherwise(F.col("rel") - F.lit(ctx.skew_us))
    queries = ctx.facts.select("stream", "writer", due.alias("t"), "sid", "ev", "room", "res", "rel")
    cand = asof_reaches(events, queries, ["stream", "writer"], ctx.bucket_us, inclusive=False,
                        at_least="sid", few_rows=ctx.token_rows * max(1, ctx.writers))
    readers = ctx.valid.select("stream", "reader").distinct()
    pairs = cand.join(F.broadcast(readers), "stream")
    # Every writer's records (a small table), so that the candidates are computed once.
    recs = records(ctx.comps, ["issued", "seq"])
    df = first_covering(recs, pairs, ["issued", "seq", "token"]).where(
        F.col("w").isNotNull() & (F.col("w.issued") < F.col("t")))
    late = when("rel IS NULL", lit("is still in flight at the end of the log"),
                sentence("completed only at ", ts("rel")))
    return finish(df, "gap_skip", stream="stream", reader="reader", writer="writer", stream_id="sid",
                  event_id="ev", room_id="room", seq="w.seq", token="w.token", issued_at="w.issued",
                  reserved_at="res", completed_at="rel", claimed_pos="w.eff", explanation=sentence(
                      "reader ", txt("reader"), "'s token ", txt("w.token"), " (seq ", txt("w.seq"),
                      ", issued ", ts("w.issued"), ") claims ", txt("writer"), " >= ",
                      txt("w.eff"), ", but fact ", txt("ev"), " (stream id ", txt("sid"), ", ",
                      txt("writer"), ") ", late, ": a reader resuming from this token skips it."))


def future_position(ctx: Context) -> DataFrame:
    """Tokens claiming a stream id that no writer had reserved when the token was issued."""
    events = ctx.facts.select("stream", F.col("res").alias("t"), F.col("sid").alias("v"))
    queries = ctx.valid.select("stream", F.col("issued").alias("t"), "reader", "seq", "token",
                               "min", "comps", "claim")
    lowest = ctx.writer_sids.groupBy("stream").agg(F.min("min_sid").alias("m"))
    first = F.lit(ctx.first_id - 1).cast("bigint")
    base = lowest.select("stream", F.least(first, F.when(F.col("m") > F.lit(-INF), F.col("m") - 1)
                                           .otherwise(F.col("m"))).alias("base"))
    df = (asof_max(events, queries, ["stream"], ctx.bucket_us, inclusive=True, few_rows=ctx.token_rows)
          .join(F.broadcast(base), "stream", "left")
          .withColumn("g", F.greatest("best", F.coalesce("base", first)))
          .where(F.col("claim") > F.col("g")))
    writer = when("claim > min", writer_name(ctx.instances, "filter(comps, c -> c.pos = claim)[0].id"))
    who = Sql(f"coalesce({writer}, 'every writer (the minimum)')")
    return finish(df, "future_position", stream="stream", reader="reader", seq="seq", token="token",
                  issued_at="t", writer=writer, claimed_pos="claim", explanation=sentence(
                      "reader ", txt("reader"), "'s token ", txt("token"), " (seq ", txt("seq"),
                      ", issued ", ts("t"), ") claims ", who, " >= ", txt("claim"),
                      ", but the highest stream id reserved by then was ", txt("g"),
                      ": the token invents a position."))


def non_monotonic(ctx: Context) -> DataFrame:
    """Valid tokens that go back, for some writer or in the minimum, from the reader's previous one."""
    w = Window.partitionBy("reader", "stream").orderBy("seq", "issued", "token")
    df = ctx.valid
    for c in ("min", "comps", "seq", "token"):
        df = df.withColumn(f"prev_{c}", F.lag(c).over(w))
    back = F.filter("prev_comps", lambda c: F.greatest(F.col("prev_min"), c["pos"]) > eff_of(c["id"]))
    df = df.withColumn("_back", back).where(
        (F.col("min") < F.col("prev_min")) | (F.size("_back") > 0))
    df = df.withColumn("_b", F.col("_back")[0]).withColumn("_b_now", eff_of(F.col("_b.id")))
    writer = when("size(_back) > 0", writer_name(ctx.instances, "_b.id"))
    what = when("size(_back) > 0", sentence(
        "writer ", writer, " goes from ", txt("greatest(prev_min, _b.pos)"), " to ", txt("_b_now")),
        sentence("the minimum goes from ", txt("prev_min"), " to ", txt("min")))
    return finish(df, "non_monotonic", stream="stream", reader="reader", seq="seq", token="token",
                  prev_seq="prev_seq", prev_token="prev_token", issued_at="issued", writer=writer,
                  explanation=sentence(
                      "reader ", txt("reader"), "'s token ", txt("token"), " (seq ", txt("seq"),
                      ") goes back from its previous token ", txt("prev_token"), " (seq ",
                      txt("prev_seq"), "): ", what, ", so resuming from it repeats facts."))


CHECKS = {"gap_skip": gap_skip, "future_position": future_position, "non_monotonic": non_monotonic}
