"""Gaps: parts of the history the audit logs say they could not record.

synflow writes a ``kind: "gap"`` record into a log when it resumes after failing to write it
(a full disk, say; see ``synflow/audit_gaps.py``). A writer-log gap names a stream, a writer,
the range of stream ids whose facts were lost (``from_stream_id`` .. ``to_stream_id``, null when
only position announcements were lost) and the time window every lost record lies in
(``lost_from`` .. ``lost_until``). A token-log gap names the process that issued the lost tokens
(``issued_by``), the readers they were issued to (``readers``; null: possibly any reader) and the
same kind of window.

What a gap can cause, and so what is *unverifiable* rather than a violation (docs/validator.md,
"Gaps"):

* a lost fact is delivered: ``phantom_delivery`` of a token of its stream issued at or after the
  gap's ``lost_from``;
* a lost reservation is claimed: ``future_position`` of a token of its stream issued at or after
  ``lost_from`` whose claim is at most the gap's ``to_stream_id``;
* a lost token is the ``since`` of the next request: ``broken_chain`` of a reader of the gap at a
  token issued at or after ``lost_from``;
* a fact was delivered only with a lost token: ``undelivered`` for a reader of the gap of a fact
  completed at or before ``lost_until``, expected at a token issued at or after ``lost_from``.

These rows are left out of the violations and counted per check in ``summary.json``
(``gaps.unverifiable``), beside the gaps themselves. The gaps are few (one per failure of a
process's log), so they become literal conditions over the violation rows; past
:data:`MAX_GAP_TERMS` they are merged per stream (writer gaps) or into one (token gaps), which
can only widen what is unverifiable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from .common import lit
from .inputs import InputError, Table, micros

#: At most this many gap rows are read from one log (more means a log that failed constantly).
MAX_GAP_ROWS = 100_000
#: Past this many gaps of one kind, gaps are merged (see the module docstring).
MAX_GAP_TERMS = 64
#: A merged token gap lists at most this many readers (more: any reader).
MAX_MERGED_READERS = 10_000
#: The checks a gap can make unverifiable.
GAP_CHECKS = ("phantom_delivery", "future_position", "broken_chain", "undelivered")


@dataclass(frozen=True)
class WriterGap:
    """Facts (and position announcements) a writer could not log."""

    stream: str
    writer: str
    from_stream_id: int | None
    to_stream_id: int | None
    lost_from: int
    lost_until: int


@dataclass(frozen=True)
class TokenGap:
    """Tokens a process could not log."""

    issued_by: str | None
    readers: tuple[str, ...] | None
    lost_from: int
    lost_until: int


@dataclass
class Gaps:
    """The gaps of the input."""

    writer: list[WriterGap]
    tokens: list[TokenGap]

    def summary(self) -> dict:
        """The gaps for ``summary.json`` (readers lists shortened to their length)."""
        tokens = []
        for g in self.tokens:
            d = asdict(g)
            d["readers"] = None if g.readers is None else len(g.readers)
            tokens.append(d)
        return {"writer_logs": [asdict(g) for g in self.writer], "token_logs": tokens}


def _gap_rows(t: Table, cols: list[str]) -> list:
    df = t.df
    rows = (df.where(F.col("kind") == "gap")
            .select(*cols, micros(df, "lost_from").alias("_from"), micros(df, "lost_until").alias("_until"))
            .limit(MAX_GAP_ROWS + 1).collect())
    if len(rows) > MAX_GAP_ROWS:
        raise InputError(f"{t.path}: more than {MAX_GAP_ROWS} gap records")
    bad = [r for r in rows if r["_from"] is None or r["_until"] is None]
    if bad:
        raise InputError(f"{t.path}: a gap record without a valid lost_from/lost_until (first: {bad[0].asDict()})")
    return rows


def read_gaps(writer_logs: Table, token_logs: Table) -> Gaps:
    """The gap records of both logs.

    Raises:
        InputError: a gap record without its window, or too many gap records.
    """
    writer = [WriterGap(r["stream"], r["writer"], r["from_stream_id"], r["to_stream_id"], r["_from"], r["_until"])
              for r in _gap_rows(writer_logs, ["stream", "writer", "from_stream_id", "to_stream_id"])
              if r["stream"] is not None]
    tokens = [TokenGap(r["issued_by"], tuple(r["readers"]) if r["readers"] is not None else None,
                       r["_from"], r["_until"])
              for r in _gap_rows(token_logs, ["issued_by", "readers"])]
    return Gaps(_merge_writer(writer), _merge_tokens(tokens))


def _merge_writer(gaps: list[WriterGap]) -> list[WriterGap]:
    if len(gaps) <= MAX_GAP_TERMS:
        return gaps
    merged: dict[str, WriterGap] = {}
    for g in gaps:
        m = merged.get(g.stream)
        if m is None:
            merged[g.stream] = WriterGap(g.stream, "*", g.from_stream_id, g.to_stream_id, g.lost_from, g.lost_until)
            continue
        ids = [i for i in (m.from_stream_id, g.from_stream_id) if i is not None]
        tops = [i for i in (m.to_stream_id, g.to_stream_id) if i is not None]
        merged[g.stream] = WriterGap(g.stream, "*", min(ids, default=None), max(tops, default=None),
                                     min(m.lost_from, g.lost_from), max(m.lost_until, g.lost_until))
    return list(merged.values())


def _merge_tokens(gaps: list[TokenGap]) -> list[TokenGap]:
    if len(gaps) <= MAX_GAP_TERMS:
        return gaps
    readers: set[str] | None = set()
    for g in gaps:
        if g.readers is None or readers is None:
            readers = None
            continue
        readers.update(g.readers)
    if readers is not None and len(readers) > MAX_MERGED_READERS:
        readers = None
    return [TokenGap("*", tuple(sorted(readers)) if readers is not None else None,
                     min(g.lost_from for g in gaps), max(g.lost_until for g in gaps))]


def _readers(g: TokenGap) -> str:
    if g.readers is None:
        return "TRUE"
    if not g.readers:
        return "FALSE"
    return f"reader IN ({', '.join(lit(r) for r in g.readers)})"


def unverifiable(gaps: Gaps) -> Column | None:
    """A condition over violation rows: the row lies in a gap (None when there are no gaps)."""
    terms = []
    for g in gaps.writer:
        if g.to_stream_id is None:
            continue  # only position announcements were lost: no check depends on them
        in_gap = f"stream = {lit(g.stream)} AND unix_micros(issued_at) >= {g.lost_from}"
        terms.append(f"(`check` = 'phantom_delivery' AND {in_gap})")
        terms.append(f"(`check` = 'future_position' AND {in_gap} AND claimed_pos <= {g.to_stream_id})")
    for h in gaps.tokens:
        who = _readers(h)
        terms.append(f"(`check` = 'broken_chain' AND {who} AND unix_micros(issued_at) >= {h.lost_from})")
        terms.append(f"(`check` = 'undelivered' AND {who} AND unix_micros(completed_at) <= {h.lost_until} "
                     f"AND (issued_at IS NULL OR unix_micros(issued_at) >= {h.lost_from}))")
    if not terms:
        return None
    return F.coalesce(F.expr(" OR ".join(terms)), F.lit(False))


def split(v: DataFrame, gaps: Gaps | None) -> tuple[DataFrame, DataFrame | None]:
    """The violations outside every gap, and those inside one (None when there are no gaps)."""
    cond = unverifiable(gaps) if gaps is not None else None
    if cond is None:
        return v, None
    flagged = v.withColumn("_gap", cond)
    return flagged.where(~F.col("_gap")).drop("_gap"), flagged.where(F.col("_gap")).drop("_gap")
