"""Catch-up sources: missed rows of one writer, paged from the database.

A reader that finds a gap in a writer's positions (``POSITION prev new``
with its own position below ``prev``) asks the stream's source for the rows
that writer wrote in ``(from, to]``, about :data:`PAGE_ROWS` at a time, and
applies them before advancing. Every synflow stream is backed by a table, so
every source reads the shared database.

The storage layer reads the stream definitions (:mod:`synflow.streams`);
the streams package imports nothing of storage.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred

from synflow.storage.engines import Database, Txn
from synflow.streams import StreamDef

__all__ = ["PAGE_ROWS", "DatabaseSource", "Updates"]

#: Rows fetched per page of a catch-up.
PAGE_ROWS = 100

Updates = tuple[list[tuple[int, Any]], int, bool]


class DatabaseSource:
    """Reads one stream's rows of one writer from its backing table."""

    def __init__(self, db: Database, stream: StreamDef) -> None:
        self.db = db
        self.stream = stream
        cols = ", ".join((stream.id_column, *stream.select))
        self._sql = (
            f"SELECT {cols} FROM {stream.table} WHERE {stream.instance_column} = ? "
            f"AND {stream.id_column} > ? AND {stream.id_column} <= ? ORDER BY {stream.id_column} LIMIT ?"
        )

    def get_updates(self, instance: str, from_token: int, to_token: int, limit: int = PAGE_ROWS) -> Deferred[Updates]:
        """Rows of ``instance`` in ``(from_token, to_token]``, oldest first.

        Returns:
            ``(updates, upto, limited)``: ``(token, row)`` pairs; the token the
            page reaches (``to_token`` unless limited); whether more remain.
        """
        return self.db.run_interaction(
            f"catch_up_{self.stream.name}", self._get_updates_txn, instance, from_token, to_token, limit,
            idempotent=True,
        )

    def _get_updates_txn(self, txn: Txn, instance: str, from_token: int, to_token: int, limit: int) -> Updates:
        txn.execute(self._sql, (instance, from_token, to_token, limit))
        rows = txn.fetchall()
        updates = [(int(r[0]), self.stream.row_from_db(tuple(r[1:]))) for r in rows]
        if len(rows) == limit:
            return updates, updates[-1][0], True
        return updates, to_token, False
