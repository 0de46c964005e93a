"""Delivery checks: phantom, aborted, premature, duplicate, beyond the token, and undelivered.

All of them start from one table with a row per (stream, event id) (:func:`by_event`): the facts
carrying the event id and the deliveries of it, gathered together with one shuffle. The table
holds only the event ids a fixed-width triage aggregation of every fact and delivery finds
suspect (:func:`suspects`), which is where every violation of these checks lies. A delivered
event id is matched to the fact of its stream with that event id (the one with the lowest
stream id if several). A reader's watermark ``WM(j, W)`` is the highest effective position for
W among its valid tokens up to seq j: a running maximum over the token components.
``duplicate_delivery`` reads each event's sorted delivery list, and for its repeats a running
count of each reader's chain breaks and the request's ``since``. ``undelivered`` gives every
completed fact the covering readers that could be due it (small broadcast tables), keeps those
missing from the event's delivery list, and finds, for them, the first covering token with the
ordered as-of of :func:`spark.checks_tokens.first_covering` (whose rooms list decides whether
the fact was due).
"""

from __future__ import annotations

from functools import reduce

from pyspark.sql import Column, DataFrame, Observation, Window
from pyspark.sql import functions as F

from .checks_syntax import chain_order, eff_of, parse_tokens, with_chain_breaks, writer_id
from .checks_tokens import first_covering, records
from .common import (
    NO_PARTIAL_AGGREGATION,
    Context,
    Sql,
    finish,
    lit,
    materialise,
    one_row_per_failed_check,
    sentence,
    small,
    sql_conf,
    ts,
    txt,
    when,
)


def by_event(ctx: Context, only: DataFrame | None = None) -> DataFrame:
    """One row per (stream, event id) that a fact carries or a reader was given.

    Columns: ``stream, ev``; ``fs``: the facts with that event id sorted by stream id (null:
    none), ``struct(sid, writer, res, aborted, rel, room)``; ``d``: its deliveries
    (null: none), ``struct(reader, seq, pos)``.

    The facts and the deliveries are unioned, each row carrying its own struct and a null for
    the other side, and grouped once (``collect_list`` skips the nulls): one shuffle and one
    aggregation of both, and no join (:func:`events_table` materialises it).

    Args:
        ctx: the run context.
        only: when given, a ``stream, ev`` table: only those event ids get a row (their facts
            and deliveries are picked out with an equi-join, broadcast while it is small).
    """
    f = F.struct("sid", "writer", "res", "aborted", "rel", "room")
    d = F.struct("reader", "seq", "pos")
    facts = ctx.facts.where(F.col("ev").isNotNull()).select("stream", "ev", f.alias("_f"))
    dels = ctx.deliveries.select("stream", F.col("event_id").alias("ev"), d.alias("_d"))
    if only is not None:
        facts = facts.join(only, ["stream", "ev"], "left_semi")
        dels = dels.join(only, ["stream", "ev"], "left_semi")
    rows = (facts.withColumn("_d", F.lit(None).cast(dels.schema["_d"].dataType))
            .unionByName(dels.withColumn("_f", F.lit(None).cast(facts.schema["_f"].dataType))))
    grouped = rows.groupBy("stream", "ev").agg(F.collect_list("_f").alias("fs"), F.collect_list("_d").alias("d"))
    return grouped.select("stream", "ev", F.when(F.size("fs") > 0, F.array_sort("fs")).alias("fs"),
                          F.when(F.size("d") > 0, F.col("d")).alias("d"))


#: :func:`suspects` is used up to this many readers (one bit each in a 64-bit mask) ...
TRIAGE_MAX_READERS = 64
#: ... and this many writers (a column of watermarks each).
TRIAGE_MAX_WRITERS = 64


def _bit(i: int) -> int:
    """Bit ``i`` (0-63) of a 64-bit mask as a signed 64-bit integer."""
    return (1 << i) - (1 << 64) * (i == 63)


def _literal_map(names: list[str], values: list[int], value_type: str) -> Column:
    """A literal map ``names[i] -> values[i]``."""
    if not names:
        return F.create_map().cast(f"map<string,{value_type}>")
    return F.create_map(*[x for n, v in zip(names, values) for x in (F.lit(n), F.lit(v).cast(value_type))])


def _or_all(cols: list[Column]) -> Column:
    return reduce(lambda a, c: a.bitwiseOR(c), cols, F.lit(0).cast("bigint"))


def suspects(ctx: Context) -> tuple[DataFrame, int] | None:
    """The ``stream, ev`` keys that could hold a violation of a check reading the per-event table.

    One hash aggregation of every fact and delivery by (stream, event id), with fixed-width
    results only (no lists): the number of facts and of deliveries; the fact's stream id,
    writer, completion time and abort; the earliest issue time of the tokens it was delivered
    with; for each writer, the lowest watermark of the valid ones among those tokens; and
    64-bit masks of the readers it was delivered to and of the readers it is due to (as
    :func:`undelivered` reads them). An event id is a suspect when, read off those, a check
    *could* fail: not exactly one fact (``duplicate_event_id``, ``phantom_delivery``), an
    aborted, unfinished or later-completed fact that was delivered, a stream id above some
    delivering token's watermark, more deliveries than readers given it, or a due reader
    missing. Each is a necessary condition of its check, so the checks computed on the
    suspects' rows alone (:func:`events_table`) find exactly what they find on every row.
    Every expression is a plain column expression (no lambdas), so all of it is compiled.

    The same pass counts the (reader, completed fact) pairs above the readers' final
    watermarks (the pending count of :func:`undelivered`).

    Returns:
        The suspects, materialised, and the pending count; or None when there are more than
        :data:`TRIAGE_MAX_READERS` readers or :data:`TRIAGE_MAX_WRITERS` writers (the
        per-event table then holds every event id).
    """
    readers = sorted(r[0] for r in ctx.tokens.select("reader").distinct().collect() if r[0] is not None)
    writers = sorted(r[0] for r in ctx.comps.select("writer").distinct().collect() if r[0] is not None)
    if len(readers) > TRIAGE_MAX_READERS or len(writers) > TRIAGE_MAX_WRITERS:
        return None
    zero, none = F.lit(0).cast("bigint"), F.lit(None).cast("bigint")
    bit_of = F.try_element_at(_literal_map(readers, [_bit(i) for i in range(len(readers))], "bigint"), F.col("reader"))
    # Each token: its issue time, validity and, when valid, its watermark for every writer.
    wm = (watermarks(ctx).groupBy("reader", "stream", "seq")
          .agg(*[F.max(F.when(F.col("writer") == w, F.col("wm"))).alias(f"_wm{k}") for k, w in enumerate(writers)]))
    tok = small(ctx.tokens.select("reader", "stream", "seq", "issued", "valid")
                .join(wm, ["reader", "stream", "seq"], "left"), ctx.token_rows)
    # Fact rows and delivery rows share their value columns ("slots"): a fact row carries its
    # stream id, completion, due readers and writer with its abort flag; a delivery row its
    # token's issue time, its reader's bit and (when valid) the token's watermark per writer.
    slots = max(4, 2 + len(writers))

    def row(*values: Column) -> list[Column]:
        return [v.cast("bigint").alias(f"_s{i}") for i, v in enumerate(values)] + \
            [none.alias(f"_s{i}") for i in range(len(values), slots)]

    # A delivery without a token row still counts (for duplicates and the readers given it).
    d_rows = ctx.deliveries.join(tok, ["reader", "stream", "seq"], "left").select(
        "stream", F.col("event_id").alias("ev"), F.lit(False).alias("_fact"), *row(F.col("issued"), F.coalesce(bit_of, zero),
             *[F.when(F.col("valid"), F.col(f"_wm{k}")) for k in range(len(writers))]))
    # Each completed fact: the readers it may be due to (the necessary condition of undelivered).
    final, unfiltered, membership = _due_inputs(ctx)
    finals = small(final.groupBy("stream", "writer").agg(*[
        F.max(F.when(F.col("reader") == r, F.col("wm"))).alias(f"_f{i}") for i, r in enumerate(readers)]), ctx.token_rows)
    anyroom = F.broadcast(unfiltered.groupBy("stream").agg(F.bit_or(F.coalesce(bit_of, zero)).alias("_any")))
    rooms = F.broadcast(membership.groupBy("stream", "room").agg(F.bit_or(F.coalesce(bit_of, zero)).alias("_member")))
    covering = _or_all([F.when(F.col("sid") <= F.col(f"_f{i}"), F.lit(_bit(i)).cast("bigint")).otherwise(zero)
                        for i in range(len(readers))])
    done = F.col("rel").isNotNull() & ~F.col("aborted")
    due = F.when(done, covering.bitwiseAND(
        F.coalesce("_any", zero).bitwiseOR(F.coalesce("_member", zero)))).otherwise(zero)
    # The writer's position in `writers` (len(writers) when it has none), times 2, plus the abort flag.
    writer_abort = (F.coalesce(F.try_element_at(_literal_map(writers, list(range(len(writers))), "int"), F.col("writer")),
                               F.lit(len(writers))) * 2 + F.col("aborted").cast("int"))
    above = reduce(lambda a, c: a + c, [F.when(F.col("sid") > F.col(f"_f{i}"), 1).otherwise(0) for i in range(len(readers))],
                   F.lit(0))
    pending = Observation("pending above the readers' watermarks")
    f_rows = (ctx.facts.where(F.col("ev").isNotNull())
              .join(finals, ["stream", "writer"], "left").join(anyroom, "stream", "left")
              .join(rooms, ["stream", "room"], "left")
              .observe(pending, F.coalesce(F.sum(F.when(done, above)), F.lit(0)).cast("bigint").alias("n"))
              .select("stream", "ev", F.lit(True).alias("_fact"), *row(F.col("sid"), F.col("rel"), due, writer_abort)))

    def fact(i: int) -> Column:
        return F.when(F.col("_fact"), F.col(f"_s{i}"))

    def delivery(i: int) -> Column:
        return F.when(~F.col("_fact"), F.col(f"_s{i}"))

    g = f_rows.unionByName(d_rows).groupBy("stream", "ev").agg(
        F.count_if("_fact").alias("nf"), F.count_if(~F.col("_fact")).alias("nd"),
        F.max(fact(0)).alias("sid"), F.max(fact(1)).alias("rel"), F.coalesce(F.bit_or(fact(2)), zero).alias("due"),
        F.max(fact(3)).alias("wa"), F.min(delivery(0)).alias("first_issued"),
        F.coalesce(F.bit_or(delivery(1)), zero).alias("got"),
        *[F.min(delivery(2 + k)).alias(f"wm{k}") for k in range(len(writers))])
    # With exactly one fact, the fact columns above are that fact's own; a null is a false.
    writer_wm = none
    for k in range(len(writers)):
        writer_wm = F.when(F.floor(F.col("wa") / 2) == k, F.col(f"wm{k}")).otherwise(writer_wm)
    late = F.col("rel").isNull() | (F.col("rel") - F.lit(ctx.skew_us) > F.col("first_issued"))
    parts = [F.col("nf") != 1, (F.col("nd") > 0) & ((F.col("wa") % 2 == 1) | late), F.col("sid") > writer_wm,
             F.col("nd") > F.bit_count("got"), F.col("due").bitwiseAND(F.bitwise_not(F.col("got"))) != 0]
    suspect = reduce(lambda a, c: a | c, [F.coalesce(p, F.lit(False)) for p in parts])
    with sql_conf(ctx.spark, NO_PARTIAL_AGGREGATION):  # nearly every key is distinct
        keys = g.where(suspect).select("stream", "ev").transform(materialise)
    return keys, pending.get["n"]


def events_table(ctx: Context) -> tuple[DataFrame, int | None, int | None]:
    """The materialised :func:`by_event` table of the :func:`suspects` (of every event id when
    there is no triage), planned without partial aggregation.

    The grouping's keys are nearly all distinct (a delivered event is one fact and a few
    deliveries), so a pre-shuffle partial aggregation would only copy the rows.

    Returns:
        The table; the number of suspect event ids it holds and the triage's pending count
        (both None without a triage).
    """
    triage = suspects(ctx)
    only, n, pending = None, None, None
    if triage is not None:
        only, pending = triage
        n = only.count()
        only = small(only, n)
    with sql_conf(ctx.spark, NO_PARTIAL_AGGREGATION):
        return by_event(ctx, only).transform(materialise), n, pending


def _tok(ctx: Context) -> DataFrame:
    return small(ctx.tokens.select("reader", "stream", "seq", "token", "issued", "valid"), ctx.token_rows)


def matched(ctx: Context, e: DataFrame) -> DataFrame:
    """Deliveries with their token (issue time, validity) and their fact ``f`` (null: none)."""
    return (e.where(F.col("d").isNotNull())
            .select("stream", F.col("ev").alias("event_id"), F.try_element_at("fs", F.lit(1)).alias("f"),
                    F.explode("d").alias("_d"))
            .select("stream", "event_id", "f", "_d.reader", "_d.seq", "_d.pos")
            .join(_tok(ctx), ["reader", "stream", "seq"]))


def _common(df: DataFrame, check: str | tuple[str, ...], explanation: Sql, **extra: str) -> DataFrame:
    return finish(df, check, stream="stream", reader="reader", seq="seq", token="token",
                  issued_at="issued", event_id="event_id", writer="f.writer", stream_id="f.sid",
                  room_id="f.room", reserved_at="f.res", completed_at="f.rel",
                  explanation=explanation, **extra)


def _who() -> list[str]:
    return ["reader ", txt("reader"), " was given ", txt("event_id"), " with token ", txt("token"),
            " (seq ", txt("seq"), ", issued ", ts("issued"), ")"]


def _per_delivery(ctx: Context) -> dict[str, tuple[F.Column, Sql]]:
    """The checks read off one matched delivery (with ``wm``): each one's condition and explanation."""
    late = when("f.rel IS NULL", lit("had not completed by the end of the log"),
                sentence("completed only at ", ts("f.rel")))
    premature = F.col("f.rel").isNull() | (F.col("f.rel") - F.lit(ctx.skew_us) > F.col("issued"))
    return {
        "phantom_delivery": (F.col("f").isNull(), sentence(
            *_who(), " but no writer of ", txt("stream"), " logged that event: it was invented.")),
        "aborted_delivery": (F.col("f.aborted"), sentence(
            *_who(), " but ", txt("f.writer"), " aborted that fact (stream id ", txt("f.sid"),
            "): an aborted write was read.")),
        "premature_delivery": (F.col("f").isNotNull() & premature, sentence(
            *_who(), " but that fact (stream id ", txt("f.sid"), ", ", txt("f.writer"), ") ", late,
            ": a write was read before it was durable.")),
        "delivered_beyond_token": (F.col("valid") & F.col("f").isNotNull() & (F.col("f.sid") > F.col("wm")),
                                   sentence(*_who(), " but that fact is stream id ", txt("f.sid"), " of ",
                                            txt("f.writer"), " and the reader's position for ",
                                            txt("f.writer"), " is only ", txt("wm"),
                                            ": resuming from this token would deliver it again.")),
    }


#: The checks :func:`per_delivery` computes in one pass over the matched deliveries.
PER_DELIVERY = ("phantom_delivery", "aborted_delivery", "premature_delivery", "delivered_beyond_token")


def per_delivery(ctx: Context, e: DataFrame, names: list[str] | tuple[str, ...]) -> DataFrame:
    """The violations of the wanted :data:`PER_DELIVERY` checks, in one pass over the deliveries.

    Each delivery is matched once with its token and fact (and, for ``delivered_beyond_token``,
    its watermark, from a broadcast table); every wanted check's condition is evaluated on the
    row, and the row is repeated once per check it fails.
    """
    rules = {n: r for n, r in _per_delivery(ctx).items() if n in names}
    m = matched(ctx, e)
    if "delivered_beyond_token" in rules:
        wm = small(watermarks(ctx).withColumnRenamed("writer", "_w"), ctx.token_rows * max(1, ctx.writers))
        m = m.withColumn("_w", F.col("f.writer")).join(wm, ["reader", "stream", "seq", "_w"], "left")
    df, explanation = one_row_per_failed_check(m, rules)
    extra = {"claimed_pos": when(f"_check = {lit('delivered_beyond_token')}", "wm")} if "wm" in df.columns else {}
    return _common(df, tuple(rules), explanation, **extra)


def phantom_delivery(ctx: Context, e: DataFrame) -> DataFrame:
    """Delivered event ids that no fact of the stream carries."""
    return per_delivery(ctx, e, ["phantom_delivery"])


def aborted_delivery(ctx: Context, e: DataFrame) -> DataFrame:
    """Delivered facts whose reservation was aborted."""
    return per_delivery(ctx, e, ["aborted_delivery"])


def premature_delivery(ctx: Context, e: DataFrame) -> DataFrame:
    """Facts delivered before they completed (a dirty read)."""
    return per_delivery(ctx, e, ["premature_delivery"])


def chain_breaks(ctx: Context) -> DataFrame:
    """Every token row with ``since`` and ``breaks``: the reader's chain breaks up to and including it.

    A row breaks the chain as in ``broken_chain`` (:func:`spark.checks_syntax.with_chain_breaks`).
    """
    return (with_chain_breaks(ctx.tokens.select("reader", "stream", "seq", "token", "issued", "since"))
            .withColumn("breaks", F.sum(F.col("breaks_chain").cast("bigint")).over(
                chain_order().rowsBetween(Window.unboundedPreceding, Window.currentRow)))
            .drop("prev_seq", "prev_token", "breaks_chain"))


def duplicate_delivery(ctx: Context, e: DataFrame) -> DataFrame:
    """Second and later deliveries of one event id to one reader, except retries.

    An event's deliveries, sorted by (reader, seq, position), repeat a reader exactly where an
    element has the reader of the element before it, the delivery it repeats. A repeat is a
    retry, not a violation, when the reader's chain broke after the delivery it repeats (up to
    and including its own request: :func:`chain_breaks`) and its request's ``since`` is a valid
    token that does not cover the event's fact: the client resumed from a token older than the
    earlier delivery, so it never saw it.
    """
    ds = F.array_sort("d")
    marked = F.transform(ds, lambda x, i: F.struct(x.alias("x"), F.when(i > 0, F.element_at(ds, i)).alias("p")))
    repeats = F.filter(marked, lambda y: y["p"]["reader"] == y["x"]["reader"])
    chain = chain_breaks(ctx)
    prev = small(chain.select("reader", "stream", F.col("seq").alias("prev_seq"), F.col("token").alias("prev_token"),
                              F.col("breaks").alias("prev_breaks")), ctx.token_rows)
    chain = small(chain, ctx.token_rows)
    df = (e.where(F.size("d") > 1)
          .select("stream", F.col("ev").alias("event_id"), F.try_element_at("fs", F.lit(1)).alias("f"),
                  F.explode(repeats).alias("_r"))
          .select("stream", "event_id", "f", F.col("_r.x.reader").alias("reader"), F.col("_r.x.seq").alias("seq"),
                  F.col("_r.p.seq").alias("prev_seq"))
          .join(chain, ["reader", "stream", "seq"])
          .join(prev, ["reader", "stream", "prev_seq"]))
    # Parse the request's since (as `token`, for parse_tokens) and compare it with the fact.
    since = parse_tokens(df.select("stream", "event_id", "f", "reader", "seq", "prev_seq", "prev_token",
                                   "issued", F.col("token").alias("_token"), F.col("since").alias("token"),
                                   (F.col("breaks") > F.col("prev_breaks")).alias("_broke")),
                         ctx.instances)
    retried = (F.col("_broke") & F.col("valid")
               & (eff_of(writer_id(ctx.instances, F.col("f.writer"))) < F.col("f.sid")))
    df = since.where(~F.coalesce(retried, F.lit(False))).withColumn("token", F.col("_token"))
    return _common(df, "duplicate_delivery", sentence(
        *_who(), " although it was already given it with token ", txt("prev_token"), " (seq ",
        txt("prev_seq"), "): the reader sees the fact twice."),
        prev_seq="prev_seq", prev_token="prev_token")


def watermarks(ctx: Context) -> DataFrame:
    """``WM(j, W)`` for every valid token j and writer W of its stream."""
    w = Window.partitionBy("reader", "stream", "writer").orderBy("seq", "issued", "token").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    return ctx.comps.select("reader", "stream", "seq", "writer", F.max("eff").over(w).alias("wm"))


def delivered_beyond_token(ctx: Context, e: DataFrame) -> DataFrame:
    """Facts delivered with a valid token whose watermark does not cover them."""
    return per_delivery(ctx, e, ["delivered_beyond_token"])


def _due_inputs(ctx: Context) -> tuple[DataFrame, DataFrame, DataFrame]:
    """What decides which readers a completed fact can be due to (small tables).

    Returns:
        ``stream, writer, reader, wm``: each reader's final watermark for each writer;
        ``reader, stream``: the readers with a valid token whose ``rooms`` is null (they may be
        due any room's facts); ``stream, room, reader``: the rooms the readers' valid tokens'
        ``rooms`` ever named. A fact is due to a reader only if the covering token's ``rooms``
        is null or names the fact's room, so a reader that is neither unfiltered nor a member
        of the fact's room is never due it (a necessary condition; the exact per-token test
        runs on what is left).
    """
    final = ctx.comps.groupBy("stream", "writer", "reader").agg(F.max("eff").alias("wm"))
    lists = ctx.valid.select("reader", "stream", "lid").distinct()
    unfiltered = lists.where(F.col("lid").isNull()).select("reader", "stream")
    membership = lists.join(ctx.rooms, ["reader", "stream", "lid"]).select("stream", "room", "reader")
    return final, unfiltered, membership


def _coverage(ctx: Context) -> tuple[DataFrame, DataFrame]:
    """The :func:`_due_inputs` per (stream, writer) and per (stream, room).

    Returns:
        ``(stream, writer) -> cov``: an array of ``(reader, wm, all)``, one per reader with a
        valid token in the stream (``all``: it is unfiltered); ``(stream, room) -> members``.
    """
    final, unfiltered, membership = _due_inputs(ctx)
    cov = (final.join(unfiltered.withColumn("all", F.lit(True)), ["reader", "stream"], "left")
           .groupBy("stream", "writer")
           .agg(F.collect_list(F.struct("reader", "wm", F.coalesce("all", F.lit(False)).alias("all")))
                .alias("cov")))
    members = membership.groupBy("stream", "room").agg(F.collect_set("reader").alias("members"))
    return cov, members


def undelivered(ctx: Context, e: DataFrame) -> tuple[DataFrame, DataFrame]:
    """Completed facts covered by a reader's final watermark but never delivered to it.

    Each completed fact meets, through small broadcast tables (:func:`_coverage`), the readers
    whose final watermark covers it and who could be due its room; only those missing from its
    event's delivery list (few) go on to the as-of lookup of the first covering token. No
    (fact, reader) pair is materialised for the facts that were delivered.

    Returns:
        The violations, and a one-row frame counting the (reader, fact) pairs still pending
        above the readers' final watermarks.
    """
    cov, members = _coverage(ctx)
    done = ctx.facts.where(F.col("ev").isNotNull() & F.col("rel").isNotNull() & ~F.col("aborted"))
    if ctx.pending_above is not None:  # counted by the triage
        pending = ctx.spark.createDataFrame([(ctx.pending_above,)], "pending bigint")
    else:
        pending = done.join(F.broadcast(cov), ["stream", "writer"]).agg(F.coalesce(
            F.sum(F.size(F.filter("cov", lambda x: x["wm"] < F.col("sid")))), F.lit(0)).cast("bigint").alias("pending"))
    facts = (e.where(F.col("fs").isNotNull())
             .select("stream", "ev", "d", F.explode(F.filter(
                 "fs", lambda f: f["rel"].isNotNull() & ~f["aborted"])).alias("f"))
             .select("stream", "ev", "d", "f.writer", "f.sid", "f.room", "f.res", "f.rel"))
    missing = F.filter("cov", lambda x: (x["wm"] >= F.col("sid"))
                       & (x["all"] | F.coalesce(F.array_contains("members", x["reader"]), F.lit(False)))
                       & ~F.coalesce(F.exists("d", lambda y: y["reader"] == x["reader"]), F.lit(False)))
    due = (facts.join(F.broadcast(cov), ["stream", "writer"])
           .join(F.broadcast(members), ["stream", "room"], "left")
           .select("stream", "writer", "sid", "room", "ev", "res", "rel", F.explode(missing).alias("x"))
           .select("stream", "writer", "sid", "room", "ev", "res", "rel", F.col("x.reader").alias("reader")))
    recs = records(ctx.comps.join(ctx.valid.select("reader", "stream", "seq", "lid"),
                                  ["reader", "stream", "seq"]), ["seq"])
    # Due only if the first covering token has no rooms list, or its list names the fact's room.
    listed = ctx.rooms.select("reader", "stream", F.col("lid").alias("_lid"), "room", F.lit(True).alias("_in"))
    df = (first_covering(recs, due, ["seq", "token", "issued", "lid"]).withColumn("_lid", F.col("w.lid"))
          .join(listed, ["reader", "stream", "_lid", "room"], "left")
          .where(F.col("w.lid").isNull() | F.col("_in").isNotNull()))
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
