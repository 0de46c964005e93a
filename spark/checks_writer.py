"""Writer-log checks: duplicates, bad intervals, per-writer id order, room sharding, stuck reservations.

Each aggregates or windows the facts once; context for the explanation is gathered only for the
violating rows (count first, explain afterwards).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from .checks_delivery import by_event
from .common import (
    INF,
    Context,
    finish,
    lit,
    materialise,
    one_row_per_failed_check,
    sentence,
    small,
    ts,
    txt,
    when,
)


def duplicate_stream_id(ctx: Context) -> DataFrame:
    """Stream ids used by more than one fact of a stream.

    Stream ids are cut into blocks of 64 (``sid div 64``); a block's facts OR together the bit
    ``pmod(sid, 64)`` of their ids, and a block holds a repeated id exactly when it has more
    facts than bits set. That aggregation has ~64 facts per key, so most of it happens before
    the shuffle. Only the facts of such blocks (few, materialised) are then grouped by stream
    id, with what the explanation needs.
    """
    block = F.expr("sid div 64")
    bit = F.call_function("shiftleft", F.lit(1).cast("bigint"), F.pmod("sid", F.lit(64)).cast("int"))
    blocks = (ctx.facts.select("stream", block.alias("_b"), bit.alias("_bit")).groupBy("stream", "_b")
              .agg(F.count(F.lit(1)).alias("n"), F.bit_or("_bit").alias("bits"))
              .where(F.col("n") > F.bit_count("bits")).select("stream", "_b").transform(materialise))
    in_blocks = (ctx.facts.withColumn("_b", block).join(small(blocks, blocks.count()), ["stream", "_b"], "left_semi")
                 .select("stream", "sid", "res", "writer", "ev").transform(materialise))
    df = (in_blocks.groupBy("stream", "sid")
          .agg(F.count(F.lit(1)).alias("n"), F.min(F.struct("res", "writer", "ev")).alias("a"),
               F.max(F.struct("res", "writer", "ev")).alias("b"))
          .where(F.col("n") > 1))
    return finish(df, "duplicate_stream_id", stream="stream", stream_id="sid", writer="a.writer",
                  event_id="a.ev", reserved_at="a.res", explanation=sentence(
                      txt("n"), " facts of stream ", txt("stream"), " use stream id ", txt("sid"),
                      ", e.g. ", txt("a.ev"), " by ", txt("a.writer"), " (reserved ", ts("a.res"),
                      ") and ", txt("b.ev"), " by ", txt("b.writer"), " (reserved ", ts("b.res"),
                      "): the sequence handed out one id twice or a writer invented it."))


def duplicate_event_id(ctx: Context) -> DataFrame:
    """Event ids carried by more than one fact of a stream.

    Read from the per-event table (:func:`spark.checks_delivery.by_event`), whose facts per
    event id are sorted by stream id: no shuffle of its own.
    """
    e = ctx.events if ctx.events is not None else by_event(ctx)
    df = e.where(F.size("fs") > 1).select(
        "stream", "ev", F.size("fs").alias("n"), F.col("fs")[0].alias("a"),
        F.element_at("fs", -1).alias("b"))
    return finish(df, "duplicate_event_id", stream="stream", event_id="ev", stream_id="a.sid",
                  writer="a.writer", explanation=sentence(
                      "event ", txt("ev"), " appears in ", txt("n"), " facts of stream ",
                      txt("stream"), ", at stream ids ", txt("a.sid"), " (", txt("a.writer"),
                      ") and ", txt("b.sid"), " (", txt("b.writer"),
                      "): readers would be handed it twice."))


#: The checks :func:`per_fact` computes in one pass over the facts.
PER_FACT = ("invalid_interval", "writer_sid_regression", "unresolved_reservation")


def _regressions(ctx: Context) -> DataFrame:
    """``stream, writer, sid, prev_sid, prev_res`` of the facts whose stream id is lower than the
    writer's previous reservation's (ordered by reservation time, then stream id).

    The window sorts only the four columns it orders by; the few rows found are materialised.
    """
    w = Window.partitionBy("stream", "writer").orderBy("res", "sid")
    return (ctx.facts.select("stream", "writer", "res", "sid")
            .withColumn("prev_sid", F.lag("sid").over(w)).withColumn("prev_res", F.lag("res").over(w))
            .where(F.col("sid") < F.col("prev_sid")).select("stream", "writer", "sid", "prev_sid", "prev_res")
            .transform(materialise))


def per_fact(ctx: Context, names: list[str] | tuple[str, ...]) -> DataFrame:
    """The violations of the wanted :data:`PER_FACT` checks, in one pass over the facts.

    ``writer_sid_regression`` first finds its few rows with a narrow window
    (:func:`_regressions`); the pass then joins them (broadcast while they are few) and evaluates
    every wanted check's condition on each fact, repeating the row once per check it fails.
    """
    expl = {
        "invalid_interval": sentence(
            "fact ", txt("ev"), " (stream id ", txt("sid"), ", ", txt("writer"), ") completed at ",
            ts("rel"), ", before it was reserved at ", ts("res"), ": the writer's clock or log is wrong."),
        "writer_sid_regression": sentence(
            txt("writer"), " reserved stream id ", txt("sid"), " at ", ts("res"), " after reserving ",
            txt("prev_sid"), " at ", ts("prev_res"), ": ids from one sequence must grow with time "
            "(clock skew, a reset sequence or a foreign writer)."),
        "unresolved_reservation": sentence(
            txt("writer"), " reserved stream id ", txt("sid"), " of ", txt("stream"), " at ", ts("res"),
            " and had not completed it by the end of the log, more than the allowance later: a stuck "
            "reservation holds back every reader's position."),
    }
    conds = {
        "invalid_interval": F.col("rel") < F.col("res"),
        "writer_sid_regression": F.col("prev_sid").isNotNull(),
        "unresolved_reservation": F.col("rel").isNull() & (F.col("res") < F.lit(ctx.unresolved_before)),
    }
    wanted = [n for n in PER_FACT if n in names]
    df = ctx.facts
    if "writer_sid_regression" in wanted:
        reg = _regressions(ctx)
        df = df.join(small(reg, reg.count()), ["stream", "writer", "sid"], "left")
    df, explanation = one_row_per_failed_check(df, {n: (conds[n], expl[n]) for n in wanted})
    return finish(df, tuple(wanted), stream="stream", writer="writer", stream_id="sid", event_id="ev",
                  room_id="room", reserved_at="res", completed_at="rel", explanation=explanation)


def invalid_interval(ctx: Context) -> DataFrame:
    """Facts completed before they were reserved."""
    return per_fact(ctx, ["invalid_interval"])


def writer_sid_regression(ctx: Context) -> DataFrame:
    """Facts whose stream id is lower than that of the writer's previous reservation."""
    return per_fact(ctx, ["writer_sid_regression"])


def unresolved_reservation(ctx: Context) -> DataFrame:
    """Reservations still open long before the end of the log (they hold every token's minimum)."""
    return per_fact(ctx, ["unresolved_reservation"])


def sharding_violation(ctx: Context) -> DataFrame:
    """Facts reserved while another writer still held an open reservation in the same room.

    Only rooms with two or more writers are examined. They are found with a hash aggregation of
    the distinct (room, writer) pairs, and their facts, filtered from the facts with a
    broadcast table of them, are materialised: one scan of the facts each, and what follows
    reads only the facts of those rooms. For each such room and each of its writers W, W's facts
    are sorted with the other writers' facts; a running maximum of the others' release times
    tells whether any of them was still open when W reserved.
    """
    f = ctx.facts.where(F.col("room").isNotNull())
    # The rooms with two or more writers are few (hand-overs): a small table, aggregated map-side.
    multi = (f.select("stream", "room", "writer").distinct().groupBy("stream", "room").count()
             .where("count > 1").select("stream", "room").transform(materialise))
    f = f.join(F.broadcast(multi), ["stream", "room"], "left_semi").transform(materialise)
    room_writers = f.select("stream", "room", F.col("writer").alias("me")).distinct()
    rel_inf = F.coalesce("rel", F.lit(INF))
    others = (f.join(room_writers, ["stream", "room"]).where(F.col("writer") != F.col("me"))
              .select("stream", "room", "me", "res", "sid", F.lit(1).alias("_o"),
                      F.struct(rel_inf.alias("rel"), "writer", "sid", "ev").alias("open"),
                      F.lit(None).cast("string").alias("ev"), F.lit(None).cast("bigint").alias("rel")))
    mine = f.select("stream", "room", F.col("writer").alias("me"), "res", "sid", F.lit(0).alias("_o"),
                    F.lit(None).cast(others.schema["open"].dataType).alias("open"), "ev", "rel")
    w = Window.partitionBy("stream", "room", "me").orderBy("res", "sid", "_o").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    df = (mine.unionByName(others).withColumn("w", F.max("open").over(w))
          .where((F.col("_o") == 0) & (F.col("w.rel") > F.col("res"))))
    open_until = when(f"w.rel = {INF}", lit("is still open"), sentence("was open until ", ts("w.rel")))
    return finish(df, "sharding_violation", stream="stream", room_id="room", writer="me",
                  stream_id="sid", event_id="ev", reserved_at="res", completed_at="rel",
                  explanation=sentence(
                      txt("me"), " reserved stream id ", txt("sid"), " (", txt("ev"), ") in room ",
                      txt("room"), " at ", ts("res"), " while ", txt("w.writer"),
                      "'s reservation ", txt("w.sid"), " (", txt("w.ev"), ") in that room ",
                      open_until, ": two writers wrote one room at once."))


CHECKS = {"duplicate_stream_id": duplicate_stream_id, "duplicate_event_id": duplicate_event_id,
          "invalid_interval": invalid_interval, "writer_sid_regression": writer_sid_regression,
          "sharding_violation": sharding_violation, "unresolved_reservation": unresolved_reservation}
