"""Token parsing in Spark and the syntax checks: malformed_token, noncanonical_component, broken_chain.

Parsing never throws under ANSI mode: the grammar is checked with a regular expression first,
and numbers are converted with ``try_cast`` only. The grammar is the one of
:data:`spark.tokens.TOKEN_RE`.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.window import WindowSpec

from .common import Context, Sql, finish, sentence, ts, txt, writer_name

TOKEN_SQL_RE = "^(?:s([0-9]+)|m([0-9]+)((?:~[0-9]+[.][0-9]+)*)~?)$"


def parse_tokens(tokens: DataFrame, instances: dict[int, str]) -> DataFrame:
    """Add ``reason`` (null when valid), ``valid``, ``min``, ``comps`` and ``claim`` to token rows.

    ``comps`` is ``array<struct<id:int,pos:bigint>>`` in listed order; ``claim`` is the highest id
    the token claims for any writer.
    """
    known = (f"array({', '.join(str(i) for i in sorted(instances))})" if instances
             else "cast(array() AS array<int>)")
    tok = F.col("token")
    grammar = tok.rlike(TOKEN_SQL_RE)
    min_str = F.when(tok.startswith("s"), F.expr("substring(token, 2)")).otherwise(
        F.regexp_extract(tok, "^m([0-9]+)", 1))
    parts = F.expr(f"filter(split(regexp_extract(token, '{TOKEN_SQL_RE}', 3), '~'), x -> x != '')")
    df = tokens.withColumn("_g", F.coalesce(grammar, F.lit(False))).withColumn(
        "_min", F.when(F.col("_g"), min_str.try_cast("bigint"))).withColumn(
        "_comps", F.when(F.col("_g"), F.transform(parts, lambda x: F.struct(
            F.substring_index(x, ".", 1).try_cast("int").alias("id"),
            F.substring_index(x, ".", -1).try_cast("bigint").alias("pos")))))
    overflow = F.col("_min").isNull() | F.exists("_comps", lambda c: c["id"].isNull() | c["pos"].isNull())
    dup = F.size(F.array_distinct(F.transform("_comps", lambda c: c["id"]))) < F.size("_comps")
    unknown = F.exists("_comps", lambda c: ~F.array_contains(F.expr(known), c["id"]))
    reason = (F.when(tok.isNull() | (tok == ""), "empty")
              .when(~F.col("_g") & tok.startswith("t"), "topological")
              .when(~F.col("_g"), "grammar")
              .when(overflow, "overflow")
              .when(dup, "duplicate_writer_id")
              .when(unknown, "unknown_writer_id"))
    df = df.withColumn("reason", reason).withColumn("valid", F.col("reason").isNull())
    df = df.withColumn("min", F.when(F.col("valid"), F.col("_min"))).withColumn(
        "comps", F.when(F.col("valid"), F.col("_comps")))
    claim = F.greatest("min", F.array_max(F.transform("comps", lambda c: c["pos"])))
    return df.withColumn("claim", F.when(F.col("valid"), claim)).drop("_g", "_min", "_comps")


def eff_of(wid: Column) -> Column:
    """``max(min, pos[wid])`` of the current row's token (``min`` for an unlisted writer)."""
    return F.aggregate("comps", F.col("min"),
                       lambda acc, c: F.when((c["id"] == wid) & (c["pos"] > acc), c["pos"]).otherwise(acc))


def writer_id(instances: dict[int, str], writer: Column) -> Column:
    """The instance id of the writer name ``writer`` (null when instance_map does not name it)."""
    ids = {n: i for i, n in instances.items()}
    id_map = F.create_map(*[x for n, i in sorted(ids.items()) for x in (F.lit(n), F.lit(i))]) \
        if ids else F.create_map().cast("map<string,int>")
    return F.try_element_at(id_map, writer)


def components(valid: DataFrame, writers: DataFrame, instances: dict[int, str]) -> DataFrame:
    """One row per (valid token, writer with facts in the token's stream) with its ``eff``.

    ``writers`` has a row per (stream, writer) with facts (:attr:`spark.load.Inputs.writer_sids`).
    """
    writers = writers.select("stream", "writer").withColumn("wid", writer_id(instances, F.col("writer")))
    return (valid.join(F.broadcast(writers), "stream")
            .select("reader", "stream", "seq", "token", "issued", "writer", "wid",
                    eff_of(F.col("wid")).alias("eff")))


def malformed_token(ctx: Context) -> DataFrame:
    """Tokens that do not parse, repeat an instance id or name one missing from instance_map."""
    bad = ctx.tokens.where(~F.col("valid"))
    return finish(bad, "malformed_token", stream="stream", reader="reader", seq="seq", token="token",
                  issued_at="issued", reason="reason", explanation=sentence(
                      "reader ", txt("reader"), " was issued token ", txt("to_json(array(token))"),
                      " (seq ", txt("seq"), ", issued ", ts("issued"), ") which is not a valid token (",
                      Sql("reason"), "): it is ignored by the other token checks."))


def noncanonical_component(ctx: Context) -> DataFrame:
    """Valid tokens listing a writer at or below the minimum (never written by a correct writer)."""
    low = F.filter("comps", lambda c: c["pos"] <= F.col("min"))
    df = ctx.valid.where(F.size(low) > 0).withColumn("_c", low[0])
    writer = writer_name(ctx.instances, "_c.id")
    return finish(df, "noncanonical_component", stream="stream", reader="reader", seq="seq",
                  token="token", issued_at="issued", writer=writer, claimed_pos="_c.pos",
                  explanation=sentence(
                      "reader ", txt("reader"), "'s token ", txt("token"), " (seq ", txt("seq"),
                      ") lists writer ", writer, " at ", txt("_c.pos"), ", not above the minimum ",
                      txt("min"), ": harmless (the minimum wins) but no correct writer encodes it."))


def chain_order() -> WindowSpec:
    """Each reader's tokens in a stream, in request order (needs an active session: a function)."""
    return Window.partitionBy("reader", "stream").orderBy("seq", "issued", "token")


def with_chain_breaks(tokens: DataFrame) -> DataFrame:
    """Add ``prev_seq``, ``prev_token`` and ``breaks_chain`` to token rows.

    A request breaks the chain when its ``since`` is present and is not the token the reader was
    given just before (any validity) in the stream. One window over each reader's tokens.
    """
    w = chain_order()
    df = tokens.withColumn("prev_seq", F.lag("seq").over(w)).withColumn("prev_token", F.lag("token").over(w))
    return df.withColumn("breaks_chain", F.col("since").isNotNull() & F.col("prev_seq").isNotNull()
                         & ~F.col("since").eqNullSafe(F.col("prev_token")))


def broken_chain(ctx: Context) -> DataFrame:
    """Requests whose ``since`` is not the token the reader was given just before."""
    df = with_chain_breaks(ctx.tokens).where("breaks_chain")
    return finish(df, "broken_chain", stream="stream", reader="reader", seq="seq", token="token",
                  prev_seq="prev_seq", prev_token="prev_token", issued_at="issued",
                  explanation=sentence(
                      "reader ", txt("reader"), " asked with since=", txt("since"), " (seq ",
                      txt("seq"), ") but its previous token was ", txt("prev_token"), " (seq ",
                      txt("prev_seq"), "): the client did not resume from the token it was given."))


CHECKS = {"malformed_token": malformed_token, "noncanonical_component": noncanonical_component,
          "broken_chain": broken_chain}
