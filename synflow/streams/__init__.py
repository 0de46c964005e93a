"""Stream definitions and their row types.

A stream is an append-only log of facts, each with a stream ID, written by
one or more writers. Each stream here names its row type (a frozen attrs
class with ``to_wire``/``from_wire``: the RDATA row is a JSON array), the
table that backs it (so readers can fetch missed rows of one writer from the
database, in pages) and who may write it:

=============  =======================================  =====================
stream         writers                                  row (JSON array)
=============  =======================================  =====================
``events``     ``stream_writers.events`` (by room)      event_id, room_id, type, state_key, sender, membership
``caches``     any process                              cache_name, keys or null, invalidation_ts
``federation`` the master (its worker type declares it)  destination, edu_type, content
=============  =======================================  =====================

Each is declared like a plugin's stream (:class:`StreamDef`, exported as
``synflow.api.Stream``) and registered through the ``synflow.streams`` entry
point group (``setup.cfg``); :func:`synflow.registry.streams` lists every
stream found, built-in or not.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Final, TypeAlias

import attrs

from synflow.errors import RemoteProtocolError
from synflow.slotted import check_layout

_new = object.__new__
_set = object.__setattr__


class StreamRowError(RemoteProtocolError):
    """An RDATA row does not have its stream's shape."""


def _need(row: Sequence[Any], n: int, stream: str) -> None:
    if not isinstance(row, list) or len(row) != n:
        raise StreamRowError(f"{stream} row must be a JSON array of {n} items, got {str(row)[:100]}")


def _str(value: Any, what: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise StreamRowError(f"{what} must be a string, got {value!r}")
    return value


class _EventsRowFields:
    """:class:`EventsRow`'s slots, writable: a row is filled in as one of these and then becomes an
    ``EventsRow`` (:mod:`synflow.slotted`)."""

    __slots__ = ("event_id", "room_id", "type", "state_key", "sender", "membership", "__weakref__")
    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    membership: str | None


@attrs.frozen(init=False)
class EventsRow(_EventsRowFields):
    """One persisted event.

    Wire: ``[event_id, room_id, type, state_key, sender, membership]``
    (state_key and membership may be null).
    """

    STREAM: ClassVar[str] = "events"
    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    membership: str | None

    def __new__(cls, event_id: str, room_id: str, type: str, state_key: str | None, sender: str,
                membership: str | None) -> EventsRow:
        if cls is EventsRow:  # one per event persisted: past attrs's __init__ (see _events_row)
            return _events_row(event_id, room_id, type, state_key, sender, membership)
        row = _new(cls)  # a subclass may add a __dict__: another layout
        for name, value in zip(_EVENTS_FIELDS, (event_id, room_id, type, state_key, sender, membership),
                               strict=True):
            _set(row, name, value)
        return row

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), attrs.astuple(self, recurse=False))

    def to_wire(self) -> list[Any]:
        return [self.event_id, self.room_id, self.type, self.state_key, self.sender, self.membership]

    @classmethod
    def from_wire(cls, row: list[Any]) -> EventsRow:
        if type(row) is list and len(row) == 6:
            event_id, room_id, type_, state_key, sender, membership = row
            if (type(event_id) is str and type(room_id) is str and type(type_) is str and type(sender) is str
                    and (state_key is None or type(state_key) is str)
                    and (membership is None or type(membership) is str)):
                if cls is EventsRow:  # the common, well-formed row
                    return _events_row(event_id, room_id, type_, state_key, sender, membership)
                return cls(event_id, room_id, type_, state_key, sender, membership)
        _need(row, 6, "events")
        return cls(
            _str(row[0], "event_id"), _str(row[1], "room_id"), _str(row[2], "type"),
            _str(row[3], "state_key", optional=True), _str(row[4], "sender"),
            _str(row[5], "membership", optional=True),
        )

    @property
    def is_membership(self) -> bool:
        return self.type == "m.room.member" and self.state_key is not None


def _events_row(event_id: str, room_id: str, type_: str, state_key: str | None, sender: str,
                membership: str | None) -> EventsRow:
    """An ``EventsRow``, filled in as its writable base (:mod:`synflow.slotted`); no field is checked."""
    fields = _new(_EventsRowFields)
    fields.event_id = event_id
    fields.room_id = room_id
    fields.type = type_
    fields.state_key = state_key
    fields.sender = sender
    fields.membership = membership
    fields.__class__ = EventsRow
    return fields  # type: ignore[return-value]  # it is one now


check_layout(EventsRow, _EventsRowFields)
_EVENTS_FIELDS: Final = tuple(f.name for f in attrs.fields(EventsRow))


@attrs.frozen
class CachesRow:
    """One cache invalidation: ``keys`` is the key tuple, or None for the whole cache.

    Wire: ``[cache_name, keys_or_null, invalidation_ts]``.
    """

    STREAM: ClassVar[str] = "caches"
    cache_name: str
    keys: tuple[Any, ...] | None
    invalidation_ts: int

    def to_wire(self) -> list[Any]:
        return [self.cache_name, None if self.keys is None else list(self.keys), self.invalidation_ts]

    @classmethod
    def from_wire(cls, row: list[Any]) -> CachesRow:
        _need(row, 3, "caches")
        keys = row[1]
        if keys is not None and not isinstance(keys, list):
            raise StreamRowError(f"caches keys must be a list or null, got {keys!r}")
        ts = row[2]
        if isinstance(ts, bool) or not isinstance(ts, int):
            raise StreamRowError(f"caches invalidation_ts must be an integer, got {ts!r}")
        return cls(_str(row[0], "cache_name"), None if keys is None else tuple(keys), ts)


@attrs.frozen
class FederationRow:
    """One EDU queued by the master for a destination.

    Wire: ``[destination, edu_type, content]``.
    """

    STREAM: ClassVar[str] = "federation"
    destination: str
    edu_type: str
    content: dict[str, Any]

    def to_wire(self) -> list[Any]:
        return [self.destination, self.edu_type, self.content]

    @classmethod
    def from_wire(cls, row: list[Any]) -> FederationRow:
        _need(row, 3, "federation")
        if not isinstance(row[2], dict):
            raise StreamRowError(f"federation content must be an object, got {row[2]!r}")
        return cls(_str(row[0], "destination"), _str(row[1], "edu_type"), row[2])


Row: TypeAlias = EventsRow | CachesRow | FederationRow


class Writers(enum.Enum):
    """Who may write a stream."""

    #: The instances listed in ``stream_writers.<stream>`` (else the stream's ``default_writers``).
    CONFIGURED = "configured"
    #: Every process.
    ANY = "any"
    #: The processes whose worker type lists the stream in its ``writes``.
    DECLARED = "declared"


@attrs.frozen
class StreamDef:
    """How one stream is stored and replicated.

    Attributes:
        name: the stream name on the wire.
        row_type: the row class.
        table: the backing table; ``id_column`` holds stream IDs and
            ``instance_column`` the writer's instance name.
        select: the columns (after the ID) that rebuild a row, in order.
        row_from_db: builds a row from those columns (default: ``row_type(*columns)``).
        sequence: the PostgreSQL sequence handing out IDs.
        writers: who may write it.
        idle_leaps: whether an idle writer advances its position to the highest
            ID allocated by anyone, so the stream's minimum never stalls behind
            a quiet writer (the shared cache tier relies on it for caches).
        shard_key: for a sharded stream, the row's sharding key (its writer is
            ``shard_for(shard_key(row), writers)``); None when any writer may
            write any row.
        default_writers: with ``Writers.CONFIGURED``, the writers when
            ``stream_writers.<name>`` is not set.
        schema: a directory of the stream's own migrations (see
            ``synflow/storage/prepare.py``); None when its tables come from
            elsewhere (synflow's own schema for the built-ins).
        row_to_db: the values of the ``select`` columns for a row (default:
            ``row.to_wire()``), used by ``ProcessContext.write_rows``.
        recover_audit: called as ``recover_audit(db, audit, instance_name)``
            (returning an awaitable) when a writer of the stream starts, to
            re-record rows a crash committed without their audit records;
            None for none.
        reshardable: writers join and leave while the deployment runs (``synflowctl
            reshard``); a process of a worker type that writes the stream may then run
            without being listed in ``stream_writers.<name>``, owning no keys until
            resharded in. Only ``events`` reshards today.
    """

    name: str
    row_type: type
    table: str
    id_column: str
    instance_column: str
    select: tuple[str, ...]
    sequence: str
    writers: Writers
    row_from_db: Callable[[tuple[Any, ...]], Any] = attrs.field(
        default=attrs.Factory(lambda self: _constructor(self.row_type), takes_self=True))
    idle_leaps: bool = True
    shard_key: Callable[[Any], str] | None = None
    default_writers: tuple[str, ...] = ()
    schema: str | None = None
    recover_audit: Callable[[Any, Any, str], Awaitable[int]] | None = None
    reshardable: bool = False
    row_to_db: Callable[[Any], Sequence[Any]] = lambda row: row.to_wire()


def _constructor(row_type: type) -> Callable[[tuple[Any, ...]], Any]:
    return lambda cols: row_type(*cols)


async def _recover_events_audit(db: Any, audit: Any, instance_name: str) -> int:
    from synflow.storage.id_generators import (
        recover_audit,  # the storage layer reads these definitions
    )

    return await recover_audit(db, audit, instance_name)


def _caches_from_db(cols: tuple[Any, ...]) -> CachesRow:
    name, keys, ts = cols
    return CachesRow(name, None if keys is None else tuple(json.loads(keys)), int(ts))


def _federation_from_db(cols: tuple[Any, ...]) -> FederationRow:
    destination, edu_type, content = cols
    return FederationRow(destination, edu_type, json.loads(content))


EVENTS: Final = StreamDef(
    name="events",
    row_type=EventsRow,
    table="events",
    id_column="stream_ordering",
    instance_column="instance_name",
    select=("event_id", "room_id", "type", "state_key", "sender", "membership"),
    sequence="events_stream_seq",
    writers=Writers.CONFIGURED,
    shard_key=lambda row: row.room_id,
    default_writers=("master",),
    recover_audit=_recover_events_audit,
    reshardable=True,
)

CACHES: Final = StreamDef(
    name="caches",
    row_type=CachesRow,
    table="cache_invalidations",
    id_column="stream_id",
    instance_column="instance_name",
    select=("cache_name", "keys", "invalidation_ts"),
    row_from_db=_caches_from_db,
    sequence="caches_stream_seq",
    writers=Writers.ANY,
)

FEDERATION: Final = StreamDef(
    name="federation",
    row_type=FederationRow,
    table="federation_outbox",
    id_column="stream_id",
    instance_column="instance_name",
    select=("destination", "edu_type", "content"),
    row_from_db=_federation_from_db,
    sequence="federation_stream_seq",
    writers=Writers.DECLARED,
)
