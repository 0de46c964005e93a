"""Delivery checks: phantom, aborted, premature, duplicate, beyond the token, and undelivered.

A delivered event id is matched to the fact of its stream with that event id (the one with the
lowest stream id if several). A reader's watermark ``WM(j, W)`` is the highest effective
position for W among its valid tokens up to seq j: a running maximum over the token components.
``undelivered`` pairs every completed fact with every reader whose final watermark covers it
(an equi-join with a small broadcast table), keeps the pairs whose room the reader was ever
in (:func:`_in_rooms_ever`), removes the delivered ones with an anti-join, and
finds, for the rest, the first covering token with the ordered as-of of
:func:`spark.checks_tokens.first_covering` (whose ``rooms`` decide whether the fact was due).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from spark.checks_tokens import first_covering, records
from spark.common import INF, Context, Sql, finish, lit, sentence, ts, txt, when


def matched(ctx: Context) -> DataFrame:
    """Deliveries with their token (issue time, validity) and their fact ``f`` (null: none)."""
    rel_inf = F.coalesce("rel", F.lit(INF))
    fstar = (ctx.facts.where(F.col("ev").isNotNull())
             .groupBy("stream", "ev")
             .agg(F.min(F.struct("sid", "writer", "res", rel_inf.alias("rel_inf"), "aborted", "rel",
                                 "room")).alias("f"))
             .withColumnRenamed("ev", "event_id"))
    tok = ctx.tokens.select("reader", "stream", "seq", "token", "issued", "valid")
    return ctx.deliveries.join(tok, ["reader", "stream", "seq"]).join(fstar, ["stream", "event_id"], "left")


def _common(df: DataFrame, check: str, explanation: Sql, **extra: str) -> DataFrame:
    return finish(df, check, stream="stream", reader="reader", seq="seq", token="token",
                  issued_at="issued", event_id="event_id", writer="f.writer", stream_id="f.sid",
                  room_id="f.room", reserved_at="f.res", completed_at="f.rel",
                  explanation=explanation, **extra)


def _who() -> list[str]:
    return ["reader ", txt("reader"), " was given ", txt("event_id"), " with token ", txt("token"),
            " (seq ", txt("seq"), ", issued ", ts("issued"), ")"]


def phantom_delivery(ctx: Context, m: DataFrame) -> DataFrame:
    """Delivered event ids that no fact of the stream carries."""
    return _common(m.where(F.col("f").isNull()), "phantom_delivery", sentence(
        *_who(), " but no writer of ", txt("stream"), " logged that event: it was invented."))


def aborted_delivery(ctx: Context, m: DataFrame) -> DataFrame:
    """Delivered facts whose reservation was aborted."""
    return _common(m.where(F.col("f.aborted")), "aborted_delivery", sentence(
        *_who(), " but ", txt("f.writer"), " aborted that fact (stream id ", txt("f.sid"),
        "): an aborted write was read."))


def premature_delivery(ctx: Context, m: DataFrame) -> DataFrame:
    """Facts delivered before they completed (a dirty read)."""
    late = when("f.rel IS NULL", lit("had not completed by the end of the log"),
                sentence("completed only at ", ts("f.rel")))
    cond = F.col("f.rel").isNull() | (F.col("f.rel") - F.lit(ctx.skew_us) > F.col("issued"))
    return _common(m.where(F.col("f").isNotNull() & cond), "premature_delivery", sentence(
        *_who(), " but that fact (stream id ", txt("f.sid"), ", ", txt("f.writer"), ") ", late,
        ": a write was read before it was durable."))


def duplicate_delivery(ctx: Context, m: DataFrame) -> DataFrame:
    """Second and later deliveries of one event id to one reader."""
    w = Window.partitionBy("reader", "stream", "event_id").orderBy("seq", "pos")
    df = (m.withColumn("_n", F.row_number().over(w)).withColumn("prev_seq", F.first("seq").over(w))
          .withColumn("prev_token", F.first("token").over(w)).where(F.col("_n") > 1))
    return _common(df, "duplicate_delivery", sentence(
        *_who(), " although it was already given it with token ", txt("prev_token"), " (seq ",
        txt("prev_seq"), "): the reader sees the fact twice."),
        prev_seq="prev_seq", prev_token="prev_token")


def watermarks(ctx: Context) -> DataFrame:
    """``WM(j, W)`` for every valid token j and writer W of its stream."""
    w = Window.partitionBy("reader", "stream", "writer").orderBy("seq", "issued", "token").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return ctx.comps.select("reader", "stream", "seq", "writer", F.max("eff").over(w).alias("wm"))


def delivered_beyond_token(ctx: Context, m: DataFrame) -> DataFrame:
    """Facts delivered with a valid token whose watermark does not cover them."""
    wm = watermarks(ctx).withColumnRenamed("writer", "_w")
    df = (m.where(F.col("valid") & F.col("f").isNotNull()).withColumn("_w", F.col("f.writer"))
          .join(wm, ["reader", "stream", "seq", "_w"]).where(F.col("f.sid") > F.col("wm")))
    return _common(df, "delivered_beyond_token", sentence(
        *_who(), " but that fact is stream id ", txt("f.sid"), " of ", txt("f.writer"),
        " and the reader's position for ", txt("f.writer"), " is only ", txt("wm"),
        ": resuming from this token would deliver it again."), claimed_pos="wm")


def _in_rooms_ever(ctx: Context, pairs: DataFrame) -> DataFrame:
    """The (fact, reader) pairs whose room the reader could have been due: a necessary condition.

    A fact is due to a reader only if the covering token's ``rooms`` is null or names the fact's
    room, so a pair survives if some valid token of the reader has null ``rooms`` or names the
    room. Both tables are small (distinct room lists, then their rooms), so this cuts the pairs
    to about the deliveries before the anti-join, and keeps large ``rooms`` lists out of the
    as-of lookup; the exact per-token test still runs on what is left.
    """
    lists = ctx.valid.select("reader", "stream", "rooms").distinct()
    unfiltered = lists.where(F.col("rooms").isNull()).select("reader", "stream", F.lit(True).alias("_all"))
    member = (lists.where(F.col("rooms").isNotNull())
              .select("reader", "stream", F.explode("rooms").alias("room")).distinct()
              .withColumn("_in", F.lit(True)))
    return (pairs.join(F.broadcast(unfiltered), ["reader", "stream"], "left")
            .join(F.broadcast(member), ["reader", "stream", "room"], "left")
            .where(F.col("_all").isNotNull() | F.col("_in").isNotNull()).drop("_all", "_in"))


def undelivered(ctx: Context) -> tuple[DataFrame, DataFrame]:
    """Completed facts covered by a reader's final watermark but never delivered to it.

    Returns:
        The violations, and a one-row frame counting the (reader, fact) pairs still pending
        above the readers' final watermarks.
    """
    final = ctx.comps.groupBy("stream", "writer", "reader").agg(F.max("eff").alias("wm"))
    done = ctx.facts.where(F.col("ev").isNotNull() & F.col("rel").isNotNull() & ~F.col("aborted"))
    pairs = done.join(F.broadcast(final), ["stream", "writer"])
    pending = pairs.where(F.col("sid") > F.col("wm")).agg(F.count(F.lit(1)).alias("pending"))
    due = _in_rooms_ever(ctx, pairs.where(F.col("sid") <= F.col("wm"))).join(
        ctx.deliveries.select("reader", "stream", F.col("event_id").alias("ev")),
        ["reader", "stream", "ev"], "left_anti").drop("wm")
    recs = records(ctx.comps.join(ctx.valid.select("reader", "stream", "seq", "rooms"),
                                  ["reader", "stream", "seq"]), ["seq"])
    df = first_covering(recs, due, ["seq", "token", "issued", "rooms"]).where(
        F.col("w.rooms").isNull() | F.coalesce(F.array_contains("w.rooms", F.col("room")), F.lit(False)))
    out = finish(df, "undelivered", stream="stream", reader="reader", writer="writer", stream_id="sid",
                 event_id="ev", room_id="room", reserved_at="res", completed_at="rel",
                 expected_seq="w.seq", token="w.token", issued_at="w.issued", claimed_pos="w.eff",
                 explanation=sentence(
                     "fact ", txt("ev"), " (stream id ", txt("sid"), ", ", txt("writer"),
                     ", completed ", ts("rel"), ") was covered by reader ", txt("reader"),
                     "'s token ", txt("w.token"), " (seq ", txt("w.seq"), ", ", txt("writer"),
                     " >= ", txt("w.eff"), ") but was never delivered to it: the reader lost it."))
    return out, pending


CHECKS = {"phantom_delivery": phantom_delivery, "aborted_delivery": aborted_delivery,
          "premature_delivery": premature_delivery, "duplicate_delivery": duplicate_delivery,
          "delivered_beyond_token": delivered_beyond_token}
