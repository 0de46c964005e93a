"""The ``receipts`` stream and the ``receipt_writer`` worker type.

A read receipt says a user has read a room up to an event. Receipts are a
stream of their own, written by the ``receipt_writer`` processes listed in
``stream_writers.receipts``, sharded by room: each room's receipts are
written by one writer, chosen with ``api.shard_for``.

HTTP, on a receipt writer's ``client`` listener:

* ``PUT /_synflow/client/v1/rooms/{room_id}/receipt/{event_id}`` -- the
  requester (``Authorization: Bearer``; joined to the room, else 403) has
  read ``room_id`` up to ``event_id``; answered by the room's writer (forwarded over internal RPC
  when another writer got the request) with ``{"stream_id": N}``;
* ``GET /_synflow/client/v1/rooms/{room_id}/receipts`` -- the receipts of a
  room the requester is joined to, in stream order, ``{"receipts": [{"user_id", "event_id", "stream_id"}]}``.
"""

from __future__ import annotations

from typing import Any

import attrs

from synflow import api

__all__ = ["RECEIPTS", "ReceiptRow", "ReceiptWriter", "ReceiptsConfig"]

PREFIX = "/_synflow/client/v1"
_ID = r"[^/]{1,255}"


@attrs.frozen
class ReceiptRow:
    """One receipt. Wire: ``[room_id, user_id, event_id]``."""

    room_id: str
    user_id: str
    event_id: str

    def to_wire(self) -> list[str]:
        return [self.room_id, self.user_id, self.event_id]

    @classmethod
    def from_wire(cls, row: list[Any]) -> ReceiptRow:
        return cls(*api.strings(row, 3))


RECEIPTS = api.Stream(
    name="receipts",
    row_type=ReceiptRow,
    table="receipts",
    id_column="stream_id",
    instance_column="instance_name",
    select=("room_id", "user_id", "event_id"),
    sequence="receipts_stream_seq",
    writers=api.Writers.CONFIGURED,
    shard_key=lambda row: row.room_id,
    schema=api.schema_dir(__name__.rpartition(".")[0]),
)


@attrs.frozen
class ReceiptsConfig:
    """``receipts:`` -- limits of the receipt writers."""

    #: The most receipts returned by one GET.
    max_list: int = attrs.field(default=1000, validator=api.positive)


class ReceiptWriter(api.WorkerType):
    """Writes the receipts of the rooms that shard to it."""

    name = "receipt_writer"
    summary = "writes read receipts for the rooms that shard to it (stream_writers.receipts)"
    config = api.Section("receipts", ReceiptsConfig)
    writes = (RECEIPTS,)

    ctx: api.ProcessContext

    def build(self, ctx: api.ProcessContext) -> None:
        self.ctx = ctx
        self.settings = ctx.section(ReceiptsConfig)
        ctx.rpc.register("put_receipt", self._rpc_put_receipt)
        resource = api.JsonResource(PREFIX)
        resource.route("PUT", rf"/rooms/(?P<room_id>{_ID})/receipt/(?P<event_id>{_ID})", self.on_put_receipt)
        resource.route("GET", rf"/rooms/(?P<room_id>{_ID})/receipts", self.on_get_receipts)
        ctx.listen("client", f"{PREFIX}/rooms", resource)

    async def put_receipt(self, row: ReceiptRow) -> int:
        """Store ``row`` on the room's writer (here, or over RPC); its stream ID."""
        owner = self.ctx.writer_for(RECEIPTS, row.room_id)
        if owner != self.ctx.config.instance_name:
            result = await self.ctx.rpc_client.call(owner, "put_receipt", {"row": row.to_wire()})
            return int(result["stream_id"])
        [stream_id] = await self.ctx.write_rows(RECEIPTS, [row])
        return stream_id

    async def _rpc_put_receipt(self, args: Any) -> dict[str, int]:
        try:
            row = ReceiptRow.from_wire(args["row"])
        except (KeyError, TypeError, api.StreamRowError) as e:
            raise api.HttpApiError(400, "M_BAD_JSON", f"put_receipt needs a row [room_id, user_id, event_id]: {e}") from None
        return {"stream_id": await self.put_receipt(row)}

    async def on_put_receipt(self, request: Any, room_id: str, event_id: str) -> tuple[int, dict[str, Any]]:
        user_id = await self.ctx.requester(request)
        if not room_id.startswith("!") or not event_id.startswith("$"):
            raise api.HttpApiError(400, "M_INVALID_PARAM", "room IDs start with '!' and event IDs with '$'")
        if await self.ctx.membership(room_id, user_id) != "join":
            raise api.HttpApiError(403, "M_FORBIDDEN", f"{user_id} is not in {room_id}")
        stream_id = await self.put_receipt(ReceiptRow(room_id, user_id, event_id))
        return 200, {"stream_id": stream_id}

    async def on_get_receipts(self, request: Any, room_id: str) -> tuple[int, dict[str, Any]]:
        user_id = await self.ctx.requester(request)
        if await self.ctx.membership(room_id, user_id) != "join":
            raise api.HttpApiError(403, "M_FORBIDDEN", f"{user_id} is not in {room_id}")
        rows = await self.ctx.db.run_interaction("get_receipts", _receipts_txn, room_id, self.settings.max_list,
                                                 read_only=True, idempotent=True)
        return 200, {"receipts": [{"user_id": u, "event_id": e, "stream_id": s} for s, u, e in rows]}


def _receipts_txn(txn: api.Txn, room_id: str, limit: int) -> list[tuple[int, str, str]]:
    txn.execute("SELECT stream_id, user_id, event_id FROM receipts WHERE room_id = ? ORDER BY stream_id LIMIT ?",
                (room_id, limit))
    return [(int(r[0]), r[1], r[2]) for r in txn.fetchall()]
