"""Normalising and validating the input tables into the frames the checks use.

``facts``: ``stream, writer, sid, room, ev, res, rel, aborted`` (µs; ``rel`` null while in
flight). ``tokens``: ``reader, stream, seq, token, issued, since, issued_by, lid`` (``lid``: the
hash of the row's ``rooms`` list, null when there is none). ``deliveries``: ``reader, stream,
seq, pos, event_id``. ``rooms``: ``reader, stream, lid, room``, one row per room of each distinct
rooms list. The tokens and the rooms lists are materialised (*locally checkpointed*: computed
once into the executors' block stores with their lineage cut, which also keeps the query plans
of the checks small); so are the facts and the deliveries of JSON Lines logs, which are parsed
once, with the input statistics observed during that pass. From Parquet, the facts and the
deliveries are read by each check, only the columns it needs, which costs no more than reading
materialised rows and keeps tens of millions of rows out of the block stores; the facts'
statistics come from one aggregation by (stream, writer), whose groups also give the small
table of each stream's writers with their lowest stream id (``Inputs.writer_sids``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pyspark.sql import DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F

from .common import materialise
from .gaps import Gaps, read_gaps
from .inputs import CORRUPT, InputError, Table, first_line, micros, read_table


@dataclass
class Inputs:
    """The validated, normalised input.

    Attributes:
        facts: fact rows (see module docstring).
        tokens: token rows without the delivered lists.
        deliveries: one row per delivered event id.
        rooms: the tokens' rooms lists: ``reader, stream, lid, room`` (``lid`` as in ``tokens``).
        instances: ``instance_id -> instance_name``.
        has_seq: whether the token log carries ``seq`` (else it was derived from ``issued_at``).
        end_of_log: the latest timestamp of the input, µs.
        stats: input counts for the summary.
        writer_sids: ``stream, writer, min_sid``: each writer of each stream with its lowest stream
            id (a small materialised table).
        gaps: what the logs say they could not record (:mod:`spark.gaps`).
    """

    facts: DataFrame
    tokens: DataFrame
    deliveries: DataFrame
    rooms: DataFrame
    instances: dict[int, str]
    has_seq: bool
    end_of_log: int
    stats: dict
    writer_sids: DataFrame
    gaps: Gaps | None = None


def _count(cond) -> F.Column:
    return F.sum(F.when(cond, 1).otherwise(0))


def _bad_time(raw: str, parsed: str) -> F.Column:
    return F.col(raw).isNotNull() & F.col(parsed).isNull()


def _problems(name: str, counts: dict, messages: dict[str, str]) -> list[str]:
    return [f"{name}: {counts[k]} {msg}" for k, msg in messages.items() if counts.get(k)]


def _corrupt_example(t: Table) -> str:
    if CORRUPT not in t.df.columns:
        return ""
    # Spark refuses queries over raw JSON that read only the corrupt-record column.
    probe = {"writer_logs": "writer", "token_logs": "reader"}.get(t.name, "instance_name")
    row = t.df.where(F.col(CORRUPT).isNotNull()).select(CORRUPT, probe).limit(1).collect()
    return f" (first: {row[0][0][:200]!r})" if row else ""


def _instances(t: Table) -> dict[int, str]:
    df = t.df
    corrupt = F.col(CORRUPT) if CORRUPT in df.columns else F.lit(None).cast("string")
    rows = df.select("instance_id", "instance_name", corrupt.alias("bad")).collect()
    bad = [r.bad for r in rows if r.bad is not None]
    if bad:
        raise InputError(f"{t.path}: {len(bad)} unreadable record(s) (first: {bad[0][:200]!r})")
    out: dict[int, str] = {}
    names: dict[str, int] = {}
    for iid, name, _ in rows:
        if iid is None or name is None:
            raise InputError(f"{t.path}: a row has a null instance_id or instance_name")
        if out.get(iid, name) != name or names.get(name, iid) != iid:
            raise InputError(f"{t.path}: instance {iid}/{name!r} conflicts with another row")
        out[iid], names[name] = name, iid
    return out


def _facts(t: Table) -> tuple[DataFrame, dict, DataFrame]:
    df = t.df
    corrupt = F.col(CORRUPT).isNotNull() if CORRUPT in df.columns else F.lit(False)
    norm = df.select(
        "stream", "writer", F.col("stream_id").alias("sid"), F.col("room_id").alias("room"),
        F.col("event_id").alias("ev"), micros(df, "reserved_at").alias("res"),
        micros(df, "completed_at").alias("rel"), "outcome",
        F.col("reserved_at").isNotNull().alias("res_raw"),
        F.col("completed_at").isNotNull().alias("rel_raw"),
        (F.col("kind").isNull() | (F.col("kind") == "fact")).alias("is_fact"),
        corrupt.alias("corrupt"),
    ).where("is_fact OR corrupt")
    counts = {
        "rows": F.lit(True), "corrupt": F.col("corrupt"),
        "null_stream": F.col("stream").isNull() & ~F.col("corrupt"),
        "null_writer": F.col("writer").isNull() & ~F.col("corrupt"),
        "null_sid": F.col("sid").isNull() & ~F.col("corrupt"),
        "null_res": ~F.col("res_raw") & ~F.col("corrupt"),
        "bad_res": _bad_time("res_raw", "res") & F.col("res_raw"),
        "bad_rel": F.col("rel_raw") & F.col("rel").isNull(),
        "bad_outcome": ~F.col("outcome").isin("ok", "aborted"),
        "in_flight": F.col("rel").isNull() & ~F.col("corrupt"),
    }
    maxima = {"max_res": F.col("res"), "max_rel": F.col("rel")}
    keep = ["stream", "writer", "sid", "room", "ev", "res", "rel",
            F.coalesce(F.col("outcome") == "aborted", F.lit(False)).alias("aborted")]
    if t.fmt == "parquet":
        # Parquet is columnar and typed: every check reads the columns it needs straight from
        # it, as fast as from materialised rows, so the facts are not materialised. The
        # statistics come from one aggregation by (stream, writer): its groups are few.
        groups = norm.groupBy("stream", "writer").agg(
            *[_count(c).alias(n) for n, c in counts.items()], *[F.max(c).alias(n) for n, c in maxima.items()],
            F.min(F.when(~F.col("corrupt"), F.col("sid"))).alias("min_sid"),
        ).collect()
        s = {n: sum(g[n] or 0 for g in groups) for n in counts}
        s.update({n: max((g[n] for g in groups if g[n] is not None), default=None) for n in maxima})
        s["streams"] = len({g["stream"] for g in groups if g["stream"] is not None})
        s["writers"] = len({g["writer"] for g in groups if g["writer"] is not None})
        facts = norm.where(~F.col("corrupt")).select(*keep)
        writer_sids = facts.sparkSession.createDataFrame(
            [(g["stream"], g["writer"], g["min_sid"]) for g in groups if g["rows"] - g["corrupt"] > 0],
            "stream string, writer string, min_sid bigint")
    else:
        # JSON Lines are parsed once: the statistics are observed while the facts are
        # materialised (one pass), and only the columns the checks use are kept.
        obs = Observation("writer_logs")
        facts = norm.observe(
            obs, *[_count(c).alias(n) for n, c in counts.items()],
            F.size(F.collect_set("stream")).alias("streams"), F.size(F.collect_set("writer")).alias("writers"),
            *[F.max(c).alias(n) for n, c in maxima.items()],
        ).where(~F.col("corrupt")).select(*keep).transform(materialise)
        s = dict(obs.get)
        writer_sids = facts.groupBy("stream", "writer").agg(F.min("sid").alias("min_sid")).transform(materialise)
    problems = _problems(t.path, s, {
        "corrupt": f"unreadable record(s){_corrupt_example(t) if s['corrupt'] else ''}",
        "null_stream": "fact(s) without stream", "null_writer": "fact(s) without writer",
        "null_sid": "fact(s) without stream_id", "null_res": "fact(s) without reserved_at",
        "bad_res": "unparseable reserved_at value(s)", "bad_rel": "unparseable completed_at value(s)",
        "bad_outcome": "fact(s) with an outcome other than ok/aborted/null"})
    if not problems and not s["rows"]:
        problems.append(f"{t.path}: no fact rows")
    if problems:
        raise InputError("; ".join(problems))
    return facts, s, writer_sids


def _tokens(t: Table) -> tuple[DataFrame, DataFrame, DataFrame, dict, bool]:
    df = t.df
    has_seq = "seq" in t.columns
    corrupt = F.col(CORRUPT).isNotNull() if CORRUPT in df.columns else F.lit(False)
    df = df.where(F.col("kind").isNull() | (F.col("kind") != "gap"))  # gap records: spark/gaps.py
    base = df.select("reader", "stream", "seq", "token", micros(df, "issued_at").alias("issued"),
                     F.col("issued_at").isNotNull().alias("issued_raw"), "delivered", "since",
                     "issued_by", "rooms", corrupt.alias("corrupt"))
    if not has_seq:
        w = Window.partitionBy("reader", "stream").orderBy("issued", "token")
        base = base.withColumn("seq", F.row_number().over(w).cast("bigint"))
    # A token's rooms list is replaced by its 64-bit hash ``lid``; the distinct lists are kept
    # once, as (reader, stream, lid, room) rows: lists of thousands of rooms repeated on every
    # token would otherwise be carried through every token computation. Two different lists
    # of one reader with one hash (for n distinct lists, a chance of about n^2 / 2^65) would
    # be taken for one.
    lid = F.when(F.col("rooms").isNotNull(), F.xxhash64("rooms"))
    obs = Observation("token_logs")
    tokens = base.withColumn("lid", lid).observe(
        obs, F.count(F.lit(1)).alias("rows"), _count(F.col("corrupt")).alias("corrupt"),
        _count(F.col("reader").isNull() & ~F.col("corrupt")).alias("null_reader"),
        _count(F.col("stream").isNull() & ~F.col("corrupt")).alias("null_stream"),
        _count(~F.col("issued_raw") & ~F.col("corrupt")).alias("null_issued"),
        _count(F.col("issued_raw") & F.col("issued").isNull()).alias("bad_issued"),
        _count(F.col("seq").isNull() & ~F.col("corrupt")).alias("null_seq"),
        _count(F.col("lid").isNotNull()).alias("with_rooms"),
        _count(F.col("since").isNotNull()).alias("with_since"),
        F.sum(F.when(F.col("delivered").isNotNull(), F.size("delivered")).otherwise(0)).alias("deliveries"),
        F.size(F.collect_set("reader")).alias("readers"), F.max("issued").alias("max_issued"),
    ).where(~F.col("corrupt")).select(
        "reader", "stream", "seq", "token", "issued", "since", "issued_by", "lid",
    ).transform(materialise)
    s = dict(obs.get)
    problems = _problems(t.path, s, {
        "corrupt": f"unreadable record(s){_corrupt_example(t) if s['corrupt'] else ''}",
        "null_reader": "row(s) without reader", "null_stream": "row(s) without stream",
        "null_issued": "row(s) without issued_at", "bad_issued": "unparseable issued_at value(s)",
        "null_seq": "row(s) with a null seq (seq must be set on every row when present)"})
    if not problems and not s["rows"]:
        problems.append(f"{t.path}: the token log is empty: nothing to validate")
    if problems:
        raise InputError("; ".join(problems))
    # The token rows above leave the delivered lists out. Only the per-event table reads them:
    # from Parquet they are read there, column by column; JSON Lines are parsed once, here.
    deliveries = (base.select("reader", "stream", "seq", F.posexplode("delivered").alias("pos", "event_id"))
                  .where(F.col("event_id").isNotNull()))
    if t.fmt != "parquet":
        deliveries = deliveries.transform(materialise)
    # Each distinct list is read from one token row that carries it (the first by seq): the
    # list ids and those rows come from the materialised tokens, and only the joined rows'
    # lists are hashed again (to pass over another row with the same seq).
    firsts = tokens.where(F.col("lid").isNotNull()).groupBy("reader", "stream", "lid").agg(F.min("seq").alias("seq"))
    lists = (base.join(F.broadcast(firsts), ["reader", "stream", "seq"])
             .where(F.xxhash64("rooms") == F.col("lid")).select("reader", "stream", "lid", "rooms")
             .dropDuplicates(["reader", "stream", "lid"]).transform(materialise))
    missing = firsts.select("reader", "stream", "lid").join(lists, ["reader", "stream", "lid"], "left_anti")
    if missing.limit(1).count():  # only when rows tie without a seq: find those lists by hashing every row
        lists = lists.unionByName(
            base.where(F.col("rooms").isNotNull()).withColumn("lid", lid).join(F.broadcast(missing), ["reader", "stream", "lid"])
            .select("reader", "stream", "lid", "rooms").dropDuplicates(["reader", "stream", "lid"]))
    rooms = (lists.select("reader", "stream", "lid", F.explode("rooms").alias("room")).distinct()
             .transform(materialise))
    return tokens, deliveries, rooms, s, has_seq


def load(spark: SparkSession, logs: str) -> Inputs:
    """Read, validate and normalise ``logs/{writer_logs,token_logs,instance_map}``.

    Raises:
        InputError: for any problem with the input.
    """
    tables = {n: read_table(spark, logs, n) for n in ("instance_map", "writer_logs", "token_logs")}
    try:
        instances = _instances(tables["instance_map"])
        # The writer log and the token log are materialised concurrently (two Spark jobs keep
        # the cores busy where one alone leaves one idle between its steps). A writer-log
        # error is reported first, as if the tables were read one after the other.
        with ThreadPoolExecutor(1, thread_name_prefix="load-writer-logs") as pool:
            writer_side = pool.submit(_facts, tables["writer_logs"])
            try:
                tokens, deliveries, rooms, tstats, has_seq = _tokens(tables["token_logs"])
                token_error = None
            except Exception as e:
                token_error = e
            facts, fstats, writer_sids = writer_side.result()
        if token_error is not None:
            raise token_error
        gaps = read_gaps(tables["writer_logs"], tables["token_logs"])
    except InputError:
        raise
    except Exception as e:  # unreadable files surface as Spark errors during the first pass
        raise InputError(f"cannot read the input under {logs}: {first_line(e)}") from e
    end = max(v for v in (fstats["max_res"], fstats["max_rel"], tstats["max_issued"]) if v is not None)
    stats = {
        "writer_logs": {"format": tables["writer_logs"].fmt, "files": tables["writer_logs"].files,
                        "fact_rows": fstats["rows"], "streams": fstats["streams"],
                        "writers": fstats["writers"], "in_flight": fstats["in_flight"]},
        "token_logs": {"format": tables["token_logs"].fmt, "files": tables["token_logs"].files,
                       "rows": tstats["rows"], "readers": tstats["readers"],
                       "deliveries": tstats["deliveries"], "seq": "given" if has_seq else "derived",
                       "rows_with_rooms": tstats["with_rooms"], "rows_with_since": tstats["with_since"]},
        "instance_map": {"format": tables["instance_map"].fmt, "rows": len(instances)},
    }
    return Inputs(facts, tokens, deliveries, rooms, instances, has_seq, end, stats, writer_sids, gaps)
