"""Persisting events: the transaction an event persister runs, and its batching queue.

One writer per room: rooms shard over ``stream_writers.events`` with
:func:`~synflow.sharding.shard_for`, so the persister that owns a room is the
only process that writes it and may link each event to the room's previous
event without locks. A batch of events (from any rooms it owns) is written in
one transaction: for each event it checks the rules (room exists, sender is
of :mod:`synflow.events.auth`, with the room's members, join rule and power
levels as the transaction sees them), assigns its stream ID, writes the event, the room's head, its
current state and membership, the remote servers that must receive it, and
the cache invalidations the change implies -- and announces all of it only
once the transaction has committed. Being the only writer, it also keeps
what its committed transactions left of each room (:class:`OwnedRooms`) and
reads only the rooms it does not hold.

A client's ``(user, txn_id)`` makes a send idempotent: a retry returns the
event persisted the first time. The client API puts the whole request in
``txn_id`` (device, room, event type and the client's transaction ID), so
the same client transaction ID in another room is another send. A remote PDU is idempotent by its event ID.

Every event's fields are checked against :mod:`synflow.events.bounds` before
it is queued, so a malformed event is refused alone; and should a batch's
transaction still fail, each of its events is retried in a transaction of its
own, so one bad event never takes the others of its batch down with it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from synflow.caching import invalidation_rows
from synflow.errors import BadEvent, NotStored, PersistRefused, RoomMoving, WrongPersister
from synflow.events import auth
from synflow.events.auth import JoinRule, PowerLevels, RoomView
from synflow.events.bounds import event_refusal
from synflow.events.shards import ShardFence, ShardFollower, ShardState
from synflow.json_encoding import compact_json
from synflow.metrics import counter, histogram
from synflow.sharding import shard_for
from synflow.storage.id_generators import StreamWriteContext, StreamWriters
from synflow.streams import CachesRow, EventsRow

logger = logging.getLogger(__name__)

BATCH_SIZE = histogram("synflow_persist_batch_events", "Events per persist transaction",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_SECONDS = histogram("synflow_persist_batch_seconds", "Time per persist transaction",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
EVENTS_PERSISTED = counter("synflow_events_persisted_total", "Events persisted by this process")
ROOM_CACHE = counter("synflow_persist_room_cache_total",
                     "Rooms a persist transaction took from the persister's own rooms (hit) or read (miss)", ["result"])
_ROOM_CACHE_HITS, _ROOM_CACHE_MISSES = ROOM_CACHE.labels(result="hit"), ROOM_CACHE.labels(result="miss")

#: Events persisted per transaction at most.
MAX_BATCH = 256
#: Persist transactions running at once in one persister. Events that arrive while one runs go
#: together in the next: under load, fewer and larger transactions (on PostgreSQL, one at a time
#: rather than four took about half off the database's CPU per event and carried a fifth more
#: events per second); at low load a batch still starts at once.
MAX_IN_FLIGHT = 1
#: Rooms whose committed state a persister keeps for its next transactions, at most (least recently used go first).
ROOM_CACHE_ROOMS = 10_000
#: Memberships kept over all those rooms, at most (a room with more is not kept).
ROOM_CACHE_MEMBERS = 200_000

MEMBER = auth.MEMBER
CREATE = auth.CREATE
server_of = auth.server_of


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
        """The fields by name, ``content`` not copied (``attrs.asdict`` copies it, deeply: a large part of a
        federated event's cost on the internal RPC)."""
        return {
            "room_id": self.room_id, "type": self.type, "sender": self.sender, "content": self.content,
            "state_key": self.state_key, "origin": self.origin, "origin_server_ts": self.origin_server_ts,
            "txn_id": self.txn_id, "event_id": self.event_id,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventSpec:
        """An event from another process (internal RPC).

        Raises:
            BadEvent: unknown fields, or fields missing.
        """
        fields = {f.name for f in attrs.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise BadEvent("M_BAD_JSON", f"unknown event fields: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise BadEvent("M_BAD_JSON", f"bad event: {e}") from None


@attrs.frozen
class PersistResult:
    """What happened to one event of a batch: persisted, a duplicate, or refused (``error``)."""

    event_id: str | None
    stream_ordering: int | None
    instance_name: str
    error: PersistRefused | None = None
    duplicate: bool = False

    def raise_error(self) -> None:
        """Raise the event's refusal, if it was refused."""
        if self.error is not None:
            raise self.error


@attrs.define
class _RoomState:
    """A room's head, and what the rules see of it (``view``), as this transaction sees them."""

    view: RoomView
    created_ts: int = 0
    latest_event_id: str | None = None
    depth: int = 0
    #: The content text of the room's current join rules and power levels (``rooms``' columns), or None.
    join_rules: str | None = None
    power_levels: str | None = None

    @property
    def members(self) -> dict[str, str]:
        return self.view.members

    def remote_hosts(self, local: str) -> set[str]:
        return {server_of(u) for u, m in self.members.items() if m in ("join", "invite")} - {local}

    def copy(self) -> _RoomState:
        """A copy a transaction may change (the members its own; the parsed rules are read-only values)."""
        view = self.view
        return _RoomState(RoomView(view.room_id, view.exists, view.creator, dict(view.members), view.join_rule,
                                   view.power_levels),
                          self.created_ts, self.latest_event_id, self.depth, self.join_rules, self.power_levels)


#: A room's state as a committed transaction left it, and the shard-map epoch it committed under.
CachedRoom = tuple[_RoomState, int | None]


class OwnedRooms:
    """The committed state of the rooms a persister's transactions read and wrote, for its next transactions.

    A room's head, rules and memberships (``rooms`` and ``room_memberships``)
    are written by :func:`persist_events_txn` alone, in the transactions of
    the persister that owns the room. So what this persister's last committed
    transaction left of a room is what the database holds, for as long as it
    has owned the room since: within one shard-map epoch, which the fence
    reads (under its lock) in every transaction. Each entry is tagged with the
    epoch of the transaction that committed it; a transaction takes a copy of
    an entry of its own epoch only, and reads every other room. A transaction
    publishes its rooms once it has committed (:meth:`Txn.call_after`), so
    one rolled back leaves the entries as they were. Without a fence (no
    shard map followed) the epoch is None and ownership is the configured
    ``shard_for``.

    Bounded: at most ``max_rooms`` rooms and ``max_members`` memberships over
    them, least recently used first out; a room with more members than that
    is not kept. Used on the reactor thread only (transactions get a snapshot
    of the entries they need).
    """

    def __init__(self, max_rooms: int = ROOM_CACHE_ROOMS, max_members: int = ROOM_CACHE_MEMBERS) -> None:
        self.max_rooms = max_rooms
        self.max_members = max_members
        self._entries: OrderedDict[str, CachedRoom] = OrderedDict()
        self._members = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, room_ids: set[str]) -> dict[str, CachedRoom]:
        """The entries of ``room_ids`` that are kept (not to be changed: a transaction copies what it uses)."""
        found = {}
        for room_id in room_ids:
            entry = self._entries.get(room_id)
            if entry is not None:
                self._entries.move_to_end(room_id)
                found[room_id] = entry
        return found

    def publish(self, rooms: dict[str, _RoomState], epoch: int | None) -> None:
        """Keep ``rooms`` as a committed transaction of ``epoch`` left them."""
        self.discard(rooms)  # first all of them: nothing older of the batch stays if a store fails
        for room_id, room in rooms.items():
            if len(room.members) <= self.max_members:
                self._entries[room_id] = (room, epoch)
                self._members += len(room.members)
        while self._entries and (len(self._entries) > self.max_rooms or self._members > self.max_members):
            _, (evicted, _) = self._entries.popitem(last=False)
            self._members -= len(evicted.members)

    def discard(self, room_ids: Iterable[str]) -> None:
        """Forget ``room_ids`` (a transaction over them failed: whether it committed may be unknown)."""
        for room_id in room_ids:
            old = self._entries.pop(room_id, None)
            if old is not None:
                self._members -= len(old[0].members)


@attrs.define
class _Accepted:
    index: int
    spec: EventSpec
    event_id: str
    prev_event_id: str | None
    depth: int
    destinations: list[str] | None
    sender_vouched: bool


def _marks(n: int) -> str:
    return ", ".join("?" for _ in range(n))


def _load_rooms_txn(txn: Any, room_ids: set[str]) -> dict[str, _RoomState]:
    rooms = {r: _RoomState(RoomView(r)) for r in room_ids}
    ids = sorted(room_ids)
    txn.execute(
        "SELECT room_id, creator, created_ts, latest_event_id, latest_depth, join_rules, power_levels "
        f"FROM rooms WHERE room_id IN ({_marks(len(ids))})",
        ids,
    )
    for room_id, creator, created_ts, latest, depth, join_rules, power_levels in txn.fetchall():
        room = rooms[room_id] = _RoomState(RoomView(room_id, True, creator), int(created_ts), latest, int(depth),
                                           join_rules, power_levels)
        for event_type, content in ((auth.JOIN_RULES, join_rules), (auth.POWER_LEVELS, power_levels)):
            if content is None:
                continue
            # State stored before the rules existed may not parse: it then counts as absent.
            value = _parsed_rule(event_type, content)
            if isinstance(value, JoinRule):
                room.view.join_rule = value
            elif isinstance(value, PowerLevels):
                room.view.power_levels = value
            else:
                logger.warning("ignoring unparsable %s of room %s: %s", event_type, room_id, value)
    txn.execute(f"SELECT room_id, user_id, membership FROM room_memberships WHERE room_id IN ({_marks(len(ids))})", ids)
    for room_id, user_id, membership in txn.fetchall():
        rooms[room_id].members[user_id] = membership
    return rooms


def _rooms_txn(txn: Any, room_ids: set[str], cached: Mapping[str, CachedRoom] | None,
               epoch: int | None) -> dict[str, _RoomState]:
    """The batch's rooms: a copy of each kept one of this transaction's epoch, the others read."""
    rooms: dict[str, _RoomState] = {}
    missing = set()
    for room_id in room_ids:
        entry = cached.get(room_id) if cached else None
        if entry is not None and entry[1] == epoch:
            rooms[room_id] = entry[0].copy()
        else:
            missing.add(room_id)
    if missing:
        rooms.update(_load_rooms_txn(txn, missing))
    if cached is not None:
        _ROOM_CACHE_HITS.inc(len(rooms) - len(missing))
        _ROOM_CACHE_MISSES.inc(len(missing))
    return rooms


#: Parsed join rules and power levels by (type, content text): every batch loads its rooms' rules, which
#: rarely change. The values are immutable; bounded, cleared when full.
_RULES_PARSED: dict[tuple[str, str], JoinRule | PowerLevels | Exception] = {}
_RULES_PARSED_MAX = 4096


def _parsed_rule(event_type: str, content: str) -> JoinRule | PowerLevels | Exception:
    """The rule a join rules or power levels content holds, or the error that makes it unparsable."""
    key = (event_type, content)
    value = _RULES_PARSED.get(key)
    if value is None:
        try:
            parsed = json.loads(content)
            if event_type == auth.JOIN_RULES:
                value = JoinRule(parsed["join_rule"])
            else:
                value = PowerLevels.from_content(parsed)
                value = attrs.evolve(value, users=MappingProxyType(dict(value.users)))  # shared: read-only
        except (ValueError, KeyError, TypeError, PersistRefused) as e:
            value = e
        if len(_RULES_PARSED) >= _RULES_PARSED_MAX:
            _RULES_PARSED.clear()
        _RULES_PARSED[key] = value
    return value


def _existing_txn(txn: Any, specs: Sequence[EventSpec]) -> dict[tuple[str, str], tuple[str, int, str]]:
    """Already persisted events, keyed like :func:`_key`."""
    found: dict[tuple[str, str], tuple[str, int, str]] = {}
    event_ids = sorted({s.event_id for s in specs if s.event_id})
    if event_ids:
        txn.execute(
            f"SELECT event_id, stream_ordering, instance_name FROM events WHERE event_id IN ({_marks(len(event_ids))})",
            event_ids,
        )
        for event_id, so, inst in txn.fetchall():
            found[("event", event_id)] = (event_id, int(so), inst)
    pairs = sorted({(s.sender, s.txn_id) for s in specs if s.txn_id is not None and s.event_id is None})
    if pairs:
        # Every (sender, txn_id) of the batch in one statement (a join on the primary key, on both engines),
        # rather than one per sender.
        txn.execute(
            "SELECT t.user_id, t.txn_id, t.event_id, t.stream_ordering, t.instance_name "
            f"FROM (VALUES {', '.join('(?, ?)' for _ in pairs)}) v "
            "JOIN event_txn_ids t ON t.user_id = v.column1 AND t.txn_id = v.column2",
            [value for pair in pairs for value in pair],
        )
        for sender, txn_id, event_id, so, inst in txn.fetchall():
            found[("txn", f"{sender}\n{txn_id}")] = (event_id, int(so), inst)
    return found


def _key(spec: EventSpec) -> tuple[str, str] | None:
    if spec.event_id:
        return ("event", spec.event_id)
    if spec.txn_id:
        return ("txn", f"{spec.sender}\n{spec.txn_id}")
    return None


def persist_events_txn(
    ctx: StreamWriteContext,
    specs: Sequence[EventSpec],
    event_ids: Sequence[str],
    *,
    server_name: str,
    instance_name: str,
    now_ms: int,
    fence: ShardFence | None = None,
    cached: Mapping[str, CachedRoom] | None = None,
    owned: OwnedRooms | None = None,
) -> list[PersistResult]:
    """Validate and write a batch of events in the caller's transaction.

    The number of statements does not grow with the batch: existing events,
    room heads and memberships are read in bulk, checks run in memory, and
    every table is written with one multi-row statement.

    With a ``fence``, the stored shard map is read first (under its lock, see
    :mod:`synflow.events.shards`): an event of a room this persister does not
    own in the current epoch is refused (:class:`~synflow.errors.WrongPersister`),
    one of a room moving in the hand-over in progress too
    (:class:`~synflow.errors.RoomMoving`); the router re-routes both.

    ``cached`` holds entries of the persister's own rooms (``owned``'s
    :meth:`OwnedRooms.lookup`): those of the transaction's epoch are copied
    instead of read. Once the transaction is over, on the reactor thread,
    ``owned`` keeps the batch's rooms if it committed and forgets them if it
    failed.
    """
    epoch = None
    if fence is not None:
        state = fence.read_txn(ctx.txn)
        epoch = state.current.epoch
        refused = _fenced_out(specs, state, instance_name)
        if refused:
            kept = [i for i in range(len(specs)) if i not in refused]
            if kept:
                inner = _persist_txn(ctx, [specs[i] for i in kept], [event_ids[i] for i in kept], server_name,
                                     instance_name, now_ms, epoch, cached, owned)
                for i, result in zip(kept, inner, strict=True):
                    refused[i] = result
            return [refused[i] for i in range(len(specs))]
    return _persist_txn(ctx, specs, event_ids, server_name, instance_name, now_ms, epoch, cached, owned)


def _fenced_out(specs: Sequence[EventSpec], state: ShardState, instance_name: str) -> dict[int, PersistResult]:
    """The refusals of the events of rooms this persister does not own, or that are moving, by index."""
    refused: dict[int, PersistResult] = {}
    for i, spec in enumerate(specs):
        owner = state.current.owner(spec.room_id)
        if owner != instance_name:
            refused[i] = PersistResult(None, None, instance_name, WrongPersister(spec.room_id, owner, instance_name))
        elif state.moving(spec.room_id):
            refused[i] = PersistResult(None, None, instance_name, RoomMoving(
                "M_ROOM_MOVING", f"room {spec.room_id} is moving to another event persister (epoch "
                f"{state.pending.epoch if state.pending else '?'}); retry"))
    return refused


def _persist_txn(ctx: StreamWriteContext, specs: Sequence[EventSpec], event_ids: Sequence[str], server_name: str,
                 instance_name: str, now_ms: int, epoch: int | None, cached: Mapping[str, CachedRoom] | None,
                 owned: OwnedRooms | None) -> list[PersistResult]:
    """:func:`persist_events_txn` of events the fence let through (``epoch``: the map's, or None without one)."""
    txn = ctx.txn
    results: list[PersistResult | None] = [None] * len(specs)
    room_ids = {s.room_id for s in specs}
    if owned is not None:
        # A failure, even in COMMIT (which may then have committed), leaves these rooms to be read again.
        txn.call_on_exception(owned.discard, room_ids)
    existing = _existing_txn(txn, specs)
    rooms = _rooms_txn(txn, room_ids, cached, epoch)
    accepted: list[_Accepted] = []
    first_of: dict[tuple[str, str], int] = {}
    repeats: dict[int, int] = {}
    for i, spec in enumerate(specs):
        key = _key(spec)
        if key is not None:
            if key in first_of:
                repeats[i] = first_of[key]  # the same event twice in one batch
                continue
            first_of[key] = i
            if key in existing:
                event_id, so, inst = existing[key]
                results[i] = PersistResult(event_id, so, inst, duplicate=True)
                continue
        room = rooms[spec.room_id]
        try:
            decision = auth.authorize(spec, room.view, server_name=server_name, origin=spec.origin)
        except PersistRefused as e:
            results[i] = PersistResult(None, None, instance_name, e)
            continue
        local = spec.origin == server_name
        before = room.remote_hosts(server_name) if local else set()
        if not room.view.exists:
            # A room created here, or a remote room this server was just invited to.
            room.created_ts = now_ms
            room.view.creator = spec.sender if spec.type == CREATE else ""
        auth.apply(spec, room.view, decision)
        event_id = spec.event_id or event_ids[i]
        destinations = sorted(before | room.remote_hosts(server_name)) if local else None
        room.depth += 1
        accepted.append(_Accepted(i, spec, event_id, room.latest_event_id, room.depth, destinations,
                                  decision.sender_vouched))
        room.latest_event_id = event_id
    if accepted:
        ids = ctx.allocate("events", len(accepted))
        _write_txn(ctx, accepted, ids, rooms, instance_name, now_ms)
        for stream_id, a in zip(ids, accepted, strict=True):
            results[a.index] = PersistResult(a.event_id, stream_id, instance_name)
    for i, first in repeats.items():
        original = results[first]
        assert original is not None
        results[i] = attrs.evolve(original, duplicate=original.error is None)
    assert all(r is not None for r in results)
    if owned is not None:  # last: nothing of this function may fail after it (SQLite commits a failed one's savepoint)
        txn.call_after(owned.publish, rooms, epoch)
    return [r for r in results if r is not None]


def _write_txn(ctx: StreamWriteContext, accepted: list[_Accepted], ids: list[int], rooms: dict[str, _RoomState],
               instance_name: str, now_ms: int) -> None:
    txn = ctx.txn
    events, txn_ids, state, members, destinations = [], [], [], [], []
    heads: dict[str, tuple[str, int, int]] = {}
    # Room -> the members whose membership changed, for every room whose state changed.
    changed: dict[str, dict[str, None]] = {}
    for stream_id, a in zip(ids, accepted, strict=True):
        spec = a.spec
        content = compact_json(spec.content)
        events.append((
            stream_id, instance_name, a.event_id, spec.room_id, spec.type, spec.state_key, spec.sender,
            spec.membership, content, spec.origin_server_ts, spec.origin,
            a.prev_event_id, a.depth, now_ms, None if a.destinations is None else json.dumps(a.destinations),
        ))
        heads[spec.room_id] = (a.event_id, a.depth, stream_id)
        if spec.state_key is not None:
            state.append((spec.room_id, spec.type, spec.state_key, a.event_id))
            changed.setdefault(spec.room_id, {})
            if spec.state_key == "":  # the room's rules follow current_state, in the same transaction
                if spec.type == auth.JOIN_RULES:
                    rooms[spec.room_id].join_rules = content
                elif spec.type == auth.POWER_LEVELS:
                    rooms[spec.room_id].power_levels = content
        if a.sender_vouched:
            members.append((spec.room_id, spec.sender, server_of(spec.sender), "join", a.event_id, stream_id))
            changed.setdefault(spec.room_id, {})[spec.sender] = None
        if spec.membership is not None and spec.state_key is not None:
            members.append((spec.room_id, spec.state_key, server_of(spec.state_key), spec.membership, a.event_id,
                            stream_id))
            changed[spec.room_id][spec.state_key] = None
        for destination in a.destinations or ():
            destinations.append((destination, spec.room_id, stream_id, instance_name))
        if spec.txn_id is not None and spec.event_id is None:
            txn_ids.append((spec.sender, spec.txn_id, a.event_id, stream_id, instance_name))
        ctx.add_rows(
            "events", stream_id,
            [EventsRow(a.event_id, spec.room_id, spec.type, spec.state_key, spec.sender, spec.membership)],
            room_id=spec.room_id, event_id=a.event_id,
        )
    txn.insert_many("events", EVENT_COLUMNS, events)
    txn.upsert_many(
        "rooms", ("room_id",),
        ("creator", "created_ts", "latest_event_id", "latest_depth", "latest_stream_ordering", "join_rules",
         "power_levels"),
        [(r, rooms[r].view.creator, rooms[r].created_ts, *head, rooms[r].join_rules, rooms[r].power_levels)
         for r, head in heads.items()],
    )
    txn.upsert_many("current_state", ("room_id", "type", "state_key"), ("event_id",), state)
    txn.upsert_many("room_memberships", ("room_id", "user_id"),
                    ("server_name", "membership", "event_id", "stream_ordering"), members)
    txn.upsert_many("destination_rooms", ("destination", "room_id"), ("stream_ordering", "instance_name"), destinations)
    txn.insert_many("event_txn_ids", ("user_id", "txn_id", "event_id", "stream_ordering", "instance_name"), txn_ids)
    if changed:
        # One cs_cache_fake row per room (per 50 members): it clears every
        # room-keyed cache of the room -- its members, hosts and current
        # state -- and every user-keyed cache of each member listed.
        rows = invalidation_rows(now_ms, current_state={r: list(m) for r, m in changed.items()})
        write_invalidations_txn(ctx, instance_name, rows)


EVENT_COLUMNS = (
    "stream_ordering", "instance_name", "event_id", "room_id", "type", "state_key", "sender", "membership",
    "content", "origin_server_ts", "origin", "prev_event_id", "depth", "received_ts", "destinations",
)


def write_invalidations_txn(ctx: StreamWriteContext, instance_name: str, rows: Sequence[CachesRow]) -> None:
    """Record cache invalidations on the caches stream, in the caller's transaction."""
    ids = ctx.allocate("caches", len(rows))
    ctx.txn.insert_many(
        "cache_invalidations", ("stream_id", "instance_name", "cache_name", "keys", "invalidation_ts"),
        [(sid, instance_name, row.cache_name, None if row.keys is None else json.dumps(list(row.keys)),
          row.invalidation_ts) for sid, row in zip(ids, rows, strict=True)],
    )
    for sid, row in zip(ids, rows, strict=True):
        ctx.add_rows("caches", sid, [row])


def _first_error(failure: Any) -> Any:
    return failure.value.subFailure


class EventPersister:
    """Batches persist requests into transactions (``max_in_flight`` at once, over disjoint rooms).

    A room's events are never in two transactions at the same time, so each
    room is still written by one transaction after another, in request
    order; events of other rooms proceed in parallel.

    Args:
        writers: this process's stream writers (events and caches).
        server_name / instance_name: this server and persister.
        event_writers: the ordered persister list rooms shard over.
        clock: timestamps.
        new_event_id: makes a fresh event ID for a local event.
        max_batch: events per transaction at most.
        max_in_flight: transactions running at once at most.
        follower: the shard map this process follows (live resharding); with it every
            transaction is fenced by the stored map. Without it, rooms shard by
            ``shard_for`` over ``event_writers``.
    """

    def __init__(self, writers: StreamWriters, *, server_name: str, instance_name: str,
                 event_writers: Sequence[str], clock: IReactorTime, new_event_id: Any,
                 max_batch: int = MAX_BATCH, max_in_flight: int = MAX_IN_FLIGHT,
                 follower: ShardFollower | None = None) -> None:
        self.writers = writers
        self.server_name = server_name
        self.instance_name = instance_name
        self.event_writers = list(event_writers)
        self.clock = clock
        self.new_event_id = new_event_id
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self._pending: list[tuple[EventSpec, Deferred[PersistResult]]] = []
        self._busy_rooms: set[str] = set()
        self._in_flight = 0
        #: Batches whose transaction failed, being retried an event at a time (outside the in-flight cap).
        self._retrying = 0
        self._idle_waiters: list[Deferred[None]] = []
        self.batches = 0
        self.persisted = 0
        self.follower = follower
        self.fence = None if follower is None else ShardFence(event_writers)
        #: The rooms this persister's transactions committed, for its next ones.
        self.rooms = OwnedRooms()

    def owner_of(self, room_id: str) -> str:
        if self.follower is not None:
            return self.follower.state.current.owner(room_id)
        return shard_for(room_id, self.event_writers)

    def check_owner(self, specs: Sequence[EventSpec]) -> None:
        """Refuse events of rooms this persister does not own.

        Raises:
            WrongPersister: naming the first such room's owner.
        """
        for spec in specs:
            owner = self.owner_of(spec.room_id)
            if owner != self.instance_name:
                raise WrongPersister(spec.room_id, owner, self.instance_name)

    def persist(self, specs: Sequence[EventSpec]) -> Deferred[list[PersistResult]]:
        """Queue events for the next batches; fires with one result per event.

        Takes events from clients and remote servers (directly or over RPC):
        each is checked against :mod:`synflow.events.bounds` first, and one
        out of bounds gets its own :class:`~synflow.errors.BadEvent` result
        without being queued. A call with an event of a room another
        persister owns is refused whole (:class:`~synflow.errors.WrongPersister`),
        before any of its events is queued; when this process follows a shard map
        that says so, the map is re-read first (it may be an epoch behind).
        """
        try:
            self.check_owner(specs)
        except WrongPersister:
            if self.follower is None:
                raise
            return Deferred.fromCoroutine(self._persist_after_reload(specs))
        return self._enqueue(specs)

    async def _persist_after_reload(self, specs: Sequence[EventSpec]) -> list[PersistResult]:
        assert self.follower is not None
        await self.follower.reload()
        self.check_owner(specs)
        return await self._enqueue(specs)

    def _enqueue(self, specs: Sequence[EventSpec]) -> Deferred[list[PersistResult]]:
        from twisted.internet.defer import gatherResults

        ds = []
        for spec in specs:
            d: Deferred[PersistResult] = Deferred()
            refusal = event_refusal(spec.to_json())
            if refusal is not None:
                d.callback(PersistResult(None, None, self.instance_name, refusal))
            else:
                self._pending.append((spec, d))
            ds.append(d)
        self._start_batches()
        return gatherResults(ds, consumeErrors=True).addErrback(_first_error)

    def drain(self) -> Deferred[None]:
        """Fires once every queued and in-flight event has been persisted (for shutdown)."""
        d: Deferred[None] = Deferred()
        if self._idle:
            d.callback(None)
        else:
            self._idle_waiters.append(d)
        return d

    @property
    def _idle(self) -> bool:
        return not self._in_flight and not self._retrying and not self._pending

    def _start_batches(self) -> None:
        while self._pending and self._in_flight < self.max_in_flight:
            batch: list[tuple[EventSpec, Deferred[PersistResult]]] = []
            rest: list[tuple[EventSpec, Deferred[PersistResult]]] = []
            rooms: set[str] = set()
            blocked: set[str] = set()
            for item in self._pending:
                room_id = item[0].room_id
                # Keep a room's order: once one of its events waits, the later ones wait too.
                if len(batch) < self.max_batch and room_id not in self._busy_rooms and room_id not in blocked:
                    batch.append(item)
                    rooms.add(room_id)
                else:
                    blocked.add(room_id)
                    rest.append(item)
            if not batch:
                return
            self._pending = rest
            self._busy_rooms |= rooms
            self._in_flight += 1
            self._run_batch(batch, rooms)
        if self._idle:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)

    def _write(self, specs: list[EventSpec]) -> Deferred[list[PersistResult]]:
        ids = [s.event_id or self.new_event_id() for s in specs]
        now_ms = int(self.clock.seconds() * 1000)
        return self.writers.run_write(
            "persist_events", ["events", "caches"], persist_events_txn, specs, ids,
            server_name=self.server_name, instance_name=self.instance_name, now_ms=now_ms, fence=self.fence,
            cached=self.rooms.lookup({s.room_id for s in specs}), owned=self.rooms,
        )

    async def _write_alone(self, batch: list[tuple[EventSpec, Deferred[PersistResult]]]) -> list[PersistResult]:
        """After a batch failed: each event in a transaction of its own, in order; only a failing one fails."""
        results = []
        for spec, _ in batch:
            try:
                (result,) = await self._write([spec])
            except Exception as e:
                logger.warning("persisting event %s of room %s failed alone: %s", spec.event_id or spec.txn_id,
                               spec.room_id, e)
                result = PersistResult(None, None, self.instance_name,
                                       NotStored("M_UNKNOWN", f"the event could not be stored: {type(e).__name__}"))
            results.append(result)
        return results

    def _run_batch(self, batch: list[tuple[EventSpec, Deferred[PersistResult]]], rooms: set[str]) -> None:
        specs = [s for s, _ in batch]
        started = time.perf_counter()
        BATCH_SIZE.observe(len(batch))
        d = self._write(specs)
        holds_slot = [True]
        if len(batch) > 1:
            def alone(failure: Any) -> Deferred[list[PersistResult]]:
                logger.warning("persisting a batch of %d events failed (%s); retrying each alone",
                               len(batch), failure.getErrorMessage())
                # The retries give up the batch's in-flight slot: other rooms' events go on meanwhile
                # (this batch's rooms stay busy until the retries end, which keeps each room's order).
                holds_slot[0] = False
                self._in_flight -= 1
                self._retrying += 1
                self._start_batches()
                return Deferred.fromCoroutine(self._write_alone(batch))
            d.addErrback(alone)

        def done(results: list[PersistResult]) -> None:
            BATCH_SECONDS.observe(time.perf_counter() - started)
            self.batches += 1
            persisted = sum(1 for r in results if r.error is None and not r.duplicate)
            self.persisted += persisted
            EVENTS_PERSISTED.inc(persisted)
            for (_, waiter), result in zip(batch, results, strict=True):
                waiter.callback(result)

        def failed(failure: Any) -> None:
            logger.warning("persisting a batch of %d events failed: %s", len(batch), failure.getErrorMessage())
            for _, waiter in batch:
                waiter.errback(failure)

        def finished(_: Any) -> None:
            if holds_slot[0]:
                self._in_flight -= 1
            else:
                self._retrying -= 1
            self._busy_rooms -= rooms
            self._start_batches()

        d.addCallbacks(done, failed)
        d.addBoth(finished)
