"""``room_stats``: per-room message and receipt counts, a consumer of two streams.

It writes no stream. It follows ``events`` (counting ``m.room.message``
events) and ``receipts`` with ``ctx.follow``: every row exactly once, in
order per writer, the counts and the position applied per writer stored in
one transaction -- so a restarted (or SIGKILLed) ``room_stats`` resumes
where its last committed transaction left off, catching up from the streams'
tables, and never counts a row twice.

HTTP, on its ``client`` listener:
``GET /_synflow/client/v1/rooms/{room_id}/stats`` ->
``{"room_id", "messages", "receipts"}`` (needs an access token).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from synflow import api

__all__ = ["RoomStats"]

PREFIX = "/_synflow/client/v1"
STREAMS = ("events", "receipts")


class RoomStats(api.WorkerType):
    """Counts messages and receipts per room."""

    name = "room_stats"
    summary = "per-room message and receipt counts over HTTP (follows events and receipts)"
    follows = STREAMS
    schema = api.schema_dir(__name__.rpartition(".")[0], "stats_schema")

    ctx: api.ProcessContext

    async def build(self, ctx: api.ProcessContext) -> None:
        self.ctx = ctx
        stored = await ctx.db.run_interaction("room_stats_positions", _positions_txn, read_only=True, idempotent=True)
        self.followers = {
            stream: ctx.follow(stream, lambda w, t, rows, s=stream: self.apply(s, w, t, rows), stored.get(stream, {}))
            for stream in STREAMS
        }
        resource = api.JsonResource(PREFIX)
        resource.route("GET", r"/rooms/(?P<room_id>[^/]{1,255})/stats", self.on_stats)
        ctx.listen("client", f"{PREFIX}/rooms", resource)
        ctx.add_health_check(self._catching_up)

    def _catching_up(self) -> str | None:
        pending = [s for s, f in self.followers.items() if not f.caught_up.called]
        return f"catching up on {', '.join(pending)}" if pending else None

    async def apply(self, stream: str, writer: str, position: int, rows: list[Any]) -> None:
        """Count ``rows`` and record ``position`` for ``writer`` in one transaction."""
        counts: Counter[str] = Counter()
        for row in rows:
            if stream == "receipts" or getattr(row, "type", None) == "m.room.message":
                counts[row.room_id] += 1
        column = "receipts" if stream == "receipts" else "messages"
        await self.ctx.db.run_interaction("room_stats_apply", _apply_txn, column, dict(counts), stream, writer, position)

    async def on_stats(self, request: Any, room_id: str) -> tuple[int, dict[str, Any]]:
        await self.ctx.requester(request)
        messages, receipts = await self.ctx.db.run_interaction("room_stats_get", _stats_txn, room_id,
                                                               read_only=True, idempotent=True)
        return 200, {"room_id": room_id, "messages": messages, "receipts": receipts}

    def health_details(self) -> dict[str, Any]:
        return {"room_stats": {stream: dict(f.positions) for stream, f in self.followers.items()}}


def _positions_txn(txn: api.Txn) -> dict[str, dict[str, int]]:
    txn.execute("SELECT stream_name, writer, position FROM room_stats_positions")
    result: dict[str, dict[str, int]] = {}
    for stream, writer, position in txn.fetchall():
        result.setdefault(stream, {})[writer] = int(position)
    return result


def _apply_txn(txn: api.Txn, column: str, counts: dict[str, int], stream: str, writer: str, position: int) -> None:
    for room_id, n in counts.items():
        txn.execute(f"INSERT INTO room_stats (room_id, {column}) VALUES (?, ?) "
                    f"ON CONFLICT (room_id) DO UPDATE SET {column} = room_stats.{column} + excluded.{column}",
                    (room_id, n))
    txn.execute("INSERT INTO room_stats_positions (stream_name, writer, position) VALUES (?, ?, ?) "
                "ON CONFLICT (stream_name, writer) DO UPDATE SET position = excluded.position",
                (stream, writer, position))


def _stats_txn(txn: api.Txn, room_id: str) -> tuple[int, int]:
    txn.execute("SELECT messages, receipts FROM room_stats WHERE room_id = ?", (room_id,))
    row = txn.fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)
