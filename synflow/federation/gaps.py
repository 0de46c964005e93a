"""Filling a room's gap before persisting a received PDU (the pulling side of ``get_missing_events``).

A sender past ``federation.catch_up_max_events`` sends only the latest event
of each room; the events before it reach this server because this server
pulls them. :class:`GapFiller` wraps the inbound handler's ``persist_pdu``:
for a PDU whose ``prev_events`` include an event this server does not have,
in a room it knows, it asks the PDU's origin for the events in between
(``POST get_missing_events/{roomId}``, pages of :data:`PAGE_LIMIT`, at most
:data:`MAX_EVENTS_PER_GAP` per gap) and persists them, oldest first, through
the same ``persist_pdu`` -- the same checks as any PDU from that origin --
before the PDU itself. Users syncing here then see the room's events once
each, in the origin's order.

Only the origin's own events are persisted from its answer (an event of
another server is that server's to send). A failed request, or a gap larger
than the bound, is logged and counted; the PDU is persisted anyway, since
refusing it would not bring the older events back. A pulled event this
server cannot persist *now* (a persister unreachable) fails the whole
transaction instead, so the sender retries it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from twisted.internet.defer import Deferred, maybeDeferred

from synflow.errors import HttpApiError
from synflow.events.persist import server_of
from synflow.federation import metrics
from synflow.federation.inbound import TRANSIENT_PERSIST_CODES, PersistPdu, check_pdu
from synflow.federation.interfaces import JsonDict, MissingEventsTransport, TransactionFailed
from synflow.federation.missing_events import (
    MAX_DEPTH,
    MAX_EVENT_IDS,
    MAX_LIMIT,
    check_id,
    check_id_list,
)
from synflow.storage.engines import Database, Txn

logger = logging.getLogger(__name__)

#: The most ``prev_events`` a PDU may list (as Matrix servers bound them).
MAX_PREV_EVENTS = MAX_EVENT_IDS
#: The events asked for per ``get_missing_events`` request.
PAGE_LIMIT = MAX_LIMIT
#: The most events pulled to fill one gap (one received PDU's).
MAX_EVENTS_PER_GAP = 200


class GapStore(Protocol):
    """What the gap filler reads from this server's events."""

    def unknown_events(self, event_ids: Sequence[str]) -> Deferred[set[str]]:
        """The IDs among ``event_ids`` of events this server does not have."""
        ...

    def room_known(self, room_id: str) -> Deferred[bool]:
        """Whether this server has the room."""
        ...

    def latest_event_from(self, room_id: str, origin: str) -> Deferred[str | None]:
        """The ID of the latest event of ``room_id`` this server got from ``origin``, if any."""
        ...


class SqlGapStore:
    """:class:`GapStore` over the ``events`` and ``rooms`` tables."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def unknown_events(self, event_ids: Sequence[str]) -> Deferred[set[str]]:
        return self.db.run_interaction("unknown_events", self._unknown_txn, list(event_ids),
                                       read_only=True, idempotent=True)

    @staticmethod
    def _unknown_txn(txn: Txn, event_ids: list[str]) -> set[str]:
        if not event_ids:
            return set()
        marks = ", ".join("?" for _ in event_ids)
        txn.execute(f"SELECT event_id FROM events WHERE event_id IN ({marks})", event_ids)
        return set(event_ids) - {r[0] for r in txn.fetchall()}

    def room_known(self, room_id: str) -> Deferred[bool]:
        return self.db.run_interaction("room_known", self._room_txn, room_id, read_only=True, idempotent=True)

    @staticmethod
    def _room_txn(txn: Txn, room_id: str) -> bool:
        txn.execute("SELECT 1 FROM rooms WHERE room_id = ?", (room_id,))
        return txn.fetchone() is not None

    def latest_event_from(self, room_id: str, origin: str) -> Deferred[str | None]:
        return self.db.run_interaction("latest_event_from", self._latest_txn, room_id, origin,
                                       read_only=True, idempotent=True)

    @staticmethod
    def _latest_txn(txn: Txn, room_id: str, origin: str) -> str | None:
        txn.execute("SELECT event_id FROM events WHERE room_id = ? AND origin = ? "
                    "ORDER BY stream_ordering DESC LIMIT 1", (room_id, origin))
        row = txn.fetchone()
        return str(row[0]) if row else None


def prev_events_of(pdu: JsonDict) -> tuple[str, ...]:
    """The ``prev_events`` of a PDU from a remote server, bounded (absent: none).

    Raises:
        HttpApiError: 400 ``M_BAD_JSON`` -- not a list of at most
            :data:`MAX_PREV_EVENTS` event IDs of at most 255 bytes each.
    """
    return check_id_list(pdu.get("prev_events"), "prev_events", required=False)


def _depth_of(event: JsonDict, index: int) -> int:
    depth = event.get("depth")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_DEPTH:
        raise HttpApiError(400, "M_BAD_JSON", f"events[{index}].depth must be an integer in [0, {MAX_DEPTH}]")
    return depth


def check_reply(reply: JsonDict, limit: int) -> list[JsonDict]:
    """The events of a ``get_missing_events`` reply from a remote server, each checked.

    Raises:
        HttpApiError: 400 ``M_BAD_JSON`` -- ``events`` missing or not a list,
            more than ``limit`` events, or an event that is not a well-formed
            PDU (as ``/send`` checks them) with an integer ``depth`` and
            bounded IDs and ``prev_events``.
    """
    events = reply.get("events")
    if not isinstance(events, list):
        raise HttpApiError(400, "M_BAD_JSON", "get_missing_events reply has no events array")
    if len(events) > limit:
        raise HttpApiError(400, "M_BAD_JSON", f"get_missing_events reply has {len(events)} events, asked {limit}")
    for i, event in enumerate(events):
        check_pdu(i, event)
        check_id(event["event_id"], f"events[{i}].event_id")
        check_id(event["room_id"], f"events[{i}].room_id")
        prev_events_of(event)
        _depth_of(event, i)
    return events


class GapFiller:
    """Wraps ``persist_pdu`` so a PDU's missing predecessors are pulled and persisted first.

    Args:
        store: reads this server's events.
        transport: asks the origin (through the signed federation client).
        persist_pdu: the inbound handler's ``persist_pdu(origin, pdu)``.
        max_per_gap: the most events pulled per gap.
        page_limit: the events asked for per request.
    """

    def __init__(self, store: GapStore, transport: MissingEventsTransport, persist_pdu: PersistPdu, *,
                 max_per_gap: int = MAX_EVENTS_PER_GAP, page_limit: int = PAGE_LIMIT) -> None:
        self._store = store
        self._transport = transport
        self._persist = persist_pdu
        self._max_per_gap = max_per_gap
        self._page_limit = page_limit

    def persist_pdu(self, origin: str, pdu: JsonDict) -> Deferred[None]:
        """Persist ``pdu`` from ``origin`` (a remote server), after the events it follows that are missing here."""
        return Deferred.fromCoroutine(self._persist_after_gap(origin, pdu))

    async def _persist_after_gap(self, origin: str, pdu: JsonDict) -> None:
        prev = prev_events_of(pdu)
        if prev and await self._store.unknown_events(prev) and await self._store.room_known(pdu["room_id"]):
            await self._fill(origin, pdu)
        await maybeDeferred(self._persist, origin, pdu)

    async def _fill(self, origin: str, pdu: JsonDict) -> None:
        room_id = pdu["room_id"]
        known = await self._store.latest_event_from(room_id, origin)
        earliest = [known] if known is not None else []
        pulled = await self._pull(origin, room_id, pdu["event_id"], earliest)
        if not pulled:
            return
        theirs = [e for e in pulled if e["room_id"] == room_id and server_of(e["sender"]) == origin]
        if len(theirs) < len(pulled):
            metrics.MISSING_EVENTS_PULLED.labels(outcome="refused").inc(len(pulled) - len(theirs))
            logger.info("%s: %d pulled events of %s were not its own; ignored",
                        room_id, len(pulled) - len(theirs), origin)
        unknown = await self._store.unknown_events([e["event_id"] for e in theirs])
        for event in sorted((e for e in theirs if e["event_id"] in unknown), key=lambda e: e["depth"]):
            try:
                await maybeDeferred(self._persist, origin, event)
            except HttpApiError as e:
                if e.code in TRANSIENT_PERSIST_CODES:
                    raise  # the whole transaction is retried; what was persisted is idempotent
                self._refused(room_id, event, origin, e)
            except Exception as e:
                self._refused(room_id, event, origin, e)
            else:
                metrics.MISSING_EVENTS_PULLED.labels(outcome="persisted").inc()

    @staticmethod
    def _refused(room_id: str, event: JsonDict, origin: str, error: Exception) -> None:
        metrics.MISSING_EVENTS_PULLED.labels(outcome="refused").inc()
        logger.warning("%s: pulled event %s from %s refused: %s", room_id, event["event_id"], origin, error)

    async def _pull(self, origin: str, room_id: str, event_id: str, earliest: list[str]) -> list[JsonDict]:
        """The events between ``earliest`` and ``event_id``, page by page back from ``event_id``."""
        pulled: dict[str, JsonDict] = {}
        latest = event_id
        while len(pulled) < self._max_per_gap:
            limit = min(self._page_limit, self._max_per_gap - len(pulled))
            body = {"earliest_events": earliest, "latest_events": [latest], "limit": limit, "min_depth": 0}
            try:
                reply = await self._transport.get_missing_events(origin, room_id, body)
                events = check_reply(reply, limit)
            except (TransactionFailed, HttpApiError) as e:
                metrics.MISSING_EVENTS_REQUESTS.labels(outcome="failed").inc()
                logger.warning("%s: get_missing_events from %s before %s failed: %s", room_id, origin, event_id, e)
                return list(pulled.values())
            new = [e for e in events if e["event_id"] not in pulled and e["event_id"] != event_id]
            pulled.update((e["event_id"], e) for e in new)
            if len(events) < limit or not new:
                metrics.MISSING_EVENTS_REQUESTS.labels(outcome="ok").inc()
                return list(pulled.values())
            latest = min(new, key=_depth_key)["event_id"]
        metrics.MISSING_EVENTS_REQUESTS.labels(outcome="gap_left").inc()
        logger.warning("%s: the gap before %s from %s is over %d events; older ones are not pulled",
                       room_id, event_id, origin, self._max_per_gap)
        return list(pulled.values())


def _depth_key(event: Any) -> int:
    return int(event["depth"])
