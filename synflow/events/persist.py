"""Persisting events: the transaction an event persister runs, and its batching queue.

One writer per room: rooms shard over ``stream_writers.events`` with
:func:`~synflow.sharding.shard_for`, so the persister that owns a room is the
only process that writes it and may link each event to the room's previous
event without locks. A batch of events (from any rooms it owns) is written in
one transaction: for each event it checks the rules (room exists, sender is
joined, ...), assigns its stream ID, writes the event, the room's head, its
current state and membership, the remote servers that must receive it, and
the cache invalidations the change implies -- and announces all of it only
once the transaction has committed.

A client's ``(user, txn_id)`` makes a send idempotent: a retry returns the
event persisted the first time. A remote PDU is idempotent by its event ID.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.caching import CURRENT_STATE_CACHE_NAME
from synflow.errors import HttpApiError
from synflow.sharding import shard_for
from synflow.storage.id_generators import StreamWriteContext, StreamWriters
from synflow.streams import CachesRow, EventsRow

logger = logging.getLogger(__name__)

#: Events persisted per transaction at most.
MAX_BATCH = 256
#: The batched cache name for a room's current-state change (keys: room, members).
CURRENT_STATE_CACHE = CURRENT_STATE_CACHE_NAME

MEMBER = "m.room.member"
CREATE = "m.room.create"


def server_of(user_id: str) -> str:
    """The server part of ``@user:server``."""
    return user_id.partition(":")[2]


@attrs.frozen
class EventSpec:
    """An event to persist: built by the client API or received over federation."""

    room_id: str
    type: str
    sender: str
    content: dict[str, Any]
    state_key: str | None = None
    origin: str = ""
    origin_server_ts: int = 0
    txn_id: str | None = None
    event_id: str | None = None

    @property
    def membership(self) -> str | None:
        if self.type == MEMBER and self.state_key is not None:
            value = self.content.get("membership")
            return value if isinstance(value, str) else None
        return None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventSpec:
        fields = {f.name for f in attrs.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise HttpApiError(400, "M_BAD_JSON", f"unknown event fields: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise HttpApiError(400, "M_BAD_JSON", f"bad event: {e}") from None


@attrs.frozen
class PersistResult:
    """What happened to one event of a batch."""

    event_id: str | None
    stream_ordering: int | None
    instance_name: str
    error: tuple[int, str, str] | None = None
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PersistResult:
        error = data.get("error")
        return cls(data.get("event_id"), data.get("stream_ordering"), data["instance_name"],
                   tuple(error) if error else None, bool(data.get("duplicate")))

    def raise_error(self) -> None:
        if self.error is not None:
            code, errcode, msg = self.error
            raise HttpApiError(code, errcode, msg)


class _Refused(Exception):
    def __init__(self, code: int, errcode: str, msg: str) -> None:
        self.error = (code, errcode, msg)


class _RoomState:
    """A room's head and memberships as this transaction sees them."""

    def __init__(self, txn: Any, room_id: str) -> None:
        txn.execute("SELECT latest_event_id, latest_depth FROM rooms WHERE room_id = ?", (room_id,))
        row = txn.fetchone()
        self.exists = row is not None
        self.latest_event_id: str | None = row[0] if row else None
        self.depth: int = int(row[1]) if row else 0
        self.created = False
        txn.execute("SELECT user_id, membership FROM room_memberships WHERE room_id = ?", (room_id,))
        self.members: dict[str, str] = {u: m for u, m in txn.fetchall()}

    def remote_hosts(self, local: str) -> list[str]:
        return sorted({server_of(u) for u, m in self.members.items() if m in ("join", "invite")} - {local})


def persist_events_txn(
    ctx: StreamWriteContext,
    specs: Sequence[EventSpec],
    event_ids: Sequence[str],
    *,
    server_name: str,
    instance_name: str,
    now_ms: int,
) -> list[PersistResult]:
    """Validate and write a batch of events in the caller's transaction."""
    txn = ctx.txn
    rooms: dict[str, _RoomState] = {}
    results: list[PersistResult | None] = [None] * len(specs)
    accepted: list[tuple[int, EventSpec, str]] = []
    first_of: dict[tuple[str, str], int] = {}
    repeats: dict[int, int] = {}
    for i, spec in enumerate(specs):
        key = ("event", spec.event_id) if spec.event_id else ("txn", f"{spec.sender}\n{spec.txn_id}") if spec.txn_id else None
        if key is not None and key in first_of:
            repeats[i] = first_of[key]  # the same event twice in one batch
            continue
        if key is not None:
            first_of[key] = i
        try:
            existing = _existing_txn(txn, spec)
            if existing is not None:
                results[i] = PersistResult(existing[0], existing[1], existing[2], duplicate=True)
                continue
            room = rooms.get(spec.room_id) or rooms.setdefault(spec.room_id, _RoomState(txn, spec.room_id))
            _check(spec, room, server_name)
            _apply_to_state(spec, room, server_name)
            accepted.append((i, spec, spec.event_id or event_ids[i]))
        except _Refused as r:
            results[i] = PersistResult(None, None, instance_name, r.error)
    if not accepted:
        return _resolve_repeats(results, repeats)
    ids = ctx.allocate("events", len(accepted))
    invalidations: list[CachesRow] = []
    for stream_id, (i, spec, event_id) in zip(ids, accepted, strict=True):
        room = rooms[spec.room_id]
        if _write_event_txn(txn, ctx, stream_id, spec, event_id, room, server_name, instance_name, now_ms):
            invalidations.append(CachesRow(CURRENT_STATE_CACHE, (spec.room_id, spec.sender), now_ms))
        if spec.membership is not None:
            invalidations.append(CachesRow(CURRENT_STATE_CACHE, (spec.room_id, spec.state_key), now_ms))
        elif spec.type == CREATE:
            invalidations.append(CachesRow("get_room", (spec.room_id,), now_ms))
        results[i] = PersistResult(event_id, stream_id, instance_name)
    if invalidations:
        write_invalidations_txn(ctx, instance_name, invalidations)
    return _resolve_repeats(results, repeats)


def _resolve_repeats(results: list[PersistResult | None], repeats: dict[int, int]) -> list[PersistResult]:
    for i, first in repeats.items():
        original = results[first]
        assert original is not None
        results[i] = attrs.evolve(original, duplicate=original.error is None)
    return [r for r in results if r is not None]


def write_invalidations_txn(ctx: StreamWriteContext, instance_name: str, rows: Sequence[CachesRow]) -> None:
    """Record cache invalidations on the caches stream, in the caller's transaction."""
    ids = ctx.allocate("caches", len(rows))
    for stream_id, row in zip(ids, rows, strict=True):
        ctx.txn.execute(
            "INSERT INTO cache_invalidations (stream_id, instance_name, cache_name, keys, invalidation_ts) "
            "VALUES (?, ?, ?, ?, ?)",
            (stream_id, instance_name, row.cache_name, None if row.keys is None else json.dumps(list(row.keys)),
             row.invalidation_ts),
        )
        ctx.add_rows("caches", stream_id, [row])


def _existing_txn(txn: Any, spec: EventSpec) -> tuple[str, int, str] | None:
    if spec.event_id is not None:
        txn.execute("SELECT event_id, stream_ordering, instance_name FROM events WHERE event_id = ?", (spec.event_id,))
    elif spec.txn_id is not None:
        txn.execute(
            "SELECT event_id, stream_ordering, instance_name FROM event_txn_ids WHERE user_id = ? AND txn_id = ?",
            (spec.sender, spec.txn_id),
        )
    else:
        return None
    row = txn.fetchone()
    return (row[0], int(row[1]), row[2]) if row else None


def _check(spec: EventSpec, room: _RoomState, server_name: str) -> None:
    local = spec.origin == server_name
    if spec.type == CREATE:
        if room.exists or room.created:
            raise _Refused(409, "M_ROOM_IN_USE", f"room {spec.room_id} already exists")
        return
    if not (room.exists or room.created):
        if local:
            raise _Refused(404, "M_NOT_FOUND", f"unknown room {spec.room_id}")
        return  # the first PDU we see of a remote room creates our record of it
    if not local:
        return
    membership = room.members.get(spec.sender)
    kind = spec.membership
    if kind == "join":
        if spec.state_key != spec.sender:
            raise _Refused(403, "M_FORBIDDEN", "a user can only join as themselves")
    elif kind == "leave":
        if spec.state_key != spec.sender:
            raise _Refused(403, "M_FORBIDDEN", "a user can only leave as themselves")
        if membership not in ("join", "invite"):
            raise _Refused(403, "M_FORBIDDEN", f"{spec.sender} is not in room {spec.room_id}")
    elif membership != "join":
        raise _Refused(403, "M_FORBIDDEN", f"{spec.sender} is not joined to room {spec.room_id}")


def _apply_to_state(spec: EventSpec, room: _RoomState, server_name: str) -> None:
    if spec.type == CREATE:
        room.created = True
    if not room.exists and not room.created:
        room.created = True  # a remote room, known from now on
    if spec.origin != server_name and spec.sender not in room.members:
        # A remote server's user acting in the room is in it, as far as we know
        # (without full state resolution, that is what we can tell).
        room.members[spec.sender] = "join"
    if spec.membership is not None and spec.state_key is not None:
        room.members[spec.state_key] = spec.membership


def _write_event_txn(
    txn: Any, ctx: StreamWriteContext, stream_id: int, spec: EventSpec, event_id: str,
    room: _RoomState, server_name: str, instance_name: str, now_ms: int,
) -> bool:
    if not room.exists:
        txn.execute(
            "INSERT INTO rooms (room_id, creator, created_ts, latest_depth) VALUES (?, ?, ?, 0)",
            (spec.room_id, spec.sender, now_ms),
        )
        room.exists = True
    local = spec.origin == server_name
    destinations = room.remote_hosts(server_name) if local else []
    room.depth += 1
    txn.execute(
        "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
        "membership, content, origin_server_ts, origin, prev_event_id, depth, received_ts, destinations) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (stream_id, instance_name, event_id, spec.room_id, spec.type, spec.state_key, spec.sender,
         spec.membership, json.dumps(spec.content, separators=(",", ":")), spec.origin_server_ts, spec.origin,
         room.latest_event_id, room.depth, now_ms, json.dumps(destinations) if local else None),
    )
    room.latest_event_id = event_id
    txn.execute(
        "UPDATE rooms SET latest_event_id = ?, latest_depth = ?, latest_stream_ordering = ? WHERE room_id = ?",
        (event_id, room.depth, stream_id, spec.room_id),
    )
    if spec.state_key is not None:
        _upsert(txn, "current_state", ("room_id", "type", "state_key"), ("event_id",),
                (spec.room_id, spec.type, spec.state_key, event_id))
    member_cols = ("server_name", "membership", "event_id", "stream_ordering")
    implicit_join = not local and not _membership_known(txn, spec.room_id, spec.sender)
    if implicit_join:
        _upsert(txn, "room_memberships", ("room_id", "user_id"), member_cols,
                (spec.room_id, spec.sender, server_of(spec.sender), "join", event_id, stream_id))
    if spec.membership is not None and spec.state_key is not None:
        _upsert(txn, "room_memberships", ("room_id", "user_id"), member_cols,
                (spec.room_id, spec.state_key, server_of(spec.state_key), spec.membership, event_id, stream_id))
    for destination in destinations:
        _upsert(txn, "destination_rooms", ("destination", "room_id"), ("stream_ordering", "instance_name"),
                (destination, spec.room_id, stream_id, instance_name))
    if spec.txn_id is not None and local:
        txn.execute(
            "INSERT INTO event_txn_ids (user_id, txn_id, event_id, stream_ordering, instance_name) VALUES (?, ?, ?, ?, ?)",
            (spec.sender, spec.txn_id, event_id, stream_id, instance_name),
        )
    ctx.add_rows(
        "events", stream_id,
        [EventsRow(event_id, spec.room_id, spec.type, spec.state_key, spec.sender, spec.membership)],
        room_id=spec.room_id, event_id=event_id,
    )
    return implicit_join


def _membership_known(txn: Any, room_id: str, user_id: str) -> bool:
    txn.execute("SELECT 1 FROM room_memberships WHERE room_id = ? AND user_id = ?", (room_id, user_id))
    return txn.fetchone() is not None


def _upsert(txn: Any, table: str, keys: Sequence[str], values: Sequence[str], args: Sequence[Any]) -> None:
    cols = (*keys, *values)
    marks = ", ".join("?" for _ in cols)
    updates = ", ".join(f"{v} = excluded.{v}" for v in values)
    txn.execute(
        f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks}) ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}",
        tuple(args),
    )


def _first_error(failure: Any) -> Any:
    return failure.value.subFailure


class EventPersister:
    """Batches persist requests into one transaction at a time.

    Args:
        writers: this process's stream writers (events and caches).
        server_name / instance_name: this server and persister.
        event_writers: the ordered persister list rooms shard over.
        clock: timestamps.
        new_event_id: makes a fresh event ID for a local event.
    """

    def __init__(self, writers: StreamWriters, *, server_name: str, instance_name: str,
                 event_writers: Sequence[str], clock: IReactorTime, new_event_id: Any,
                 max_batch: int = MAX_BATCH) -> None:
        self.writers = writers
        self.server_name = server_name
        self.instance_name = instance_name
        self.event_writers = list(event_writers)
        self.clock = clock
        self.new_event_id = new_event_id
        self.max_batch = max_batch
        self._pending: list[tuple[EventSpec, Deferred[PersistResult]]] = []
        self._running = False
        self._idle_waiters: list[Deferred[None]] = []
        self.batches = 0
        self.persisted = 0

    def owner_of(self, room_id: str) -> str:
        return shard_for(room_id, self.event_writers)

    def persist(self, specs: Sequence[EventSpec]) -> Deferred[list[PersistResult]]:
        """Queue events for the next batch; fires with one result per event."""
        from twisted.internet.defer import gatherResults

        ds = []
        for spec in specs:
            owner = self.owner_of(spec.room_id)
            if owner != self.instance_name:
                raise HttpApiError(409, "M_WRONG_PERSISTER",
                                   f"room {spec.room_id} belongs to event persister {owner!r}, not {self.instance_name!r}",
                                   owner=owner)
            d: Deferred[PersistResult] = Deferred()
            self._pending.append((spec, d))
            ds.append(d)
        if not self._running:
            self._run_batch()
        return gatherResults(ds, consumeErrors=True).addErrback(_first_error)

    def drain(self) -> Deferred[None]:
        """Fires once every queued and in-flight event has been persisted (for shutdown)."""
        d: Deferred[None] = Deferred()
        if not self._running:
            d.callback(None)
        else:
            self._idle_waiters.append(d)
        return d

    def _run_batch(self) -> None:
        if not self._pending:
            self._running = False
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)
            return
        self._running = True
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
        specs = [s for s, _ in batch]
        ids = [s.event_id or self.new_event_id() for s in specs]
        now_ms = int(self.clock.seconds() * 1000)
        d = self.writers.run_write(
            "persist_events", ["events", "caches"], persist_events_txn, specs, ids,
            server_name=self.server_name, instance_name=self.instance_name, now_ms=now_ms,
        )

        def done(results: list[PersistResult]) -> None:
            self.batches += 1
            self.persisted += sum(1 for r in results if r.error is None and not r.duplicate)
            for (_, waiter), result in zip(batch, results, strict=True):
                waiter.callback(result)

        def failed(failure: Any) -> None:
            logger.warning("persisting a batch of %d events failed: %s", len(batch), failure.getErrorMessage())
            for _, waiter in batch:
                waiter.errback(failure)

        d.addCallbacks(done, failed)
        d.addBoth(lambda _: self._run_batch())
