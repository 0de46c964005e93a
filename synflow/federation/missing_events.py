"""Serving ``POST /_matrix/federation/v1/get_missing_events/{roomId}``.

A remote server that received one of our events whose ``prev_events`` it
does not know asks for the events in between (Matrix server-server API)::

    POST /_matrix/federation/v1/get_missing_events/{roomId}
    {"earliest_events": ["$known"], "latest_events": ["$received"], "limit": 10, "min_depth": 0}
    -> 200 {"events": [ ... oldest first ... ]}

Three layers, each usable alone:

* :func:`parse_missing_events_request` -- pure: the raw request to a
  :class:`MissingEventsRequest`, every field bounded, or an
  :class:`~synflow.errors.HttpApiError` 400 saying what is wrong;
* :class:`SqlMissingEventsStore` -- the walk: from each latest event back
  along ``prev_event_id`` (this server's chain of the room), never past an
  earliest event, at most ``limit`` events returned and
  :data:`MAX_WALK_STEPS` events looked at. Only events **created here whose
  recorded destinations include the requesting server** are returned:
  exactly what this server's sender owed it, so a server never sees an event
  from before it was in the room, nor one another server must vouch for;
* :class:`MissingEventsResource` -- the twisted.web glue, mounted at
  :data:`GET_MISSING_EVENTS_PREFIX`. The requesting origin comes from
  ``origin_of(request)`` (the request-authentication seam: the signing
  layer's verified ``X-Matrix`` origin), else from the ``X-Matrix`` header's
  ``origin`` as sent; it must be an allowed origin with a joined member in
  the room, else 403 ``M_FORBIDDEN``.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote_to_bytes

import attrs
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from synflow.errors import HttpApiError
from synflow.federation import metrics
from synflow.federation.inbound import DEFAULT_MAX_JSON_DEPTH, parse_body
from synflow.federation.interfaces import JsonDict
from synflow.federation.storage import PDU_COLUMNS, event_to_pdu
from synflow.http.server import client_gone
from synflow.storage.engines import Database, Txn

logger = logging.getLogger(__name__)

#: Where the resource is mounted (the room ID follows, URL-quoted).
GET_MISSING_EVENTS_PREFIX = "/_matrix/federation/v1/get_missing_events"
#: The ``limit`` when the request gives none (the Matrix default).
DEFAULT_LIMIT = 10
#: The most events one response carries; a larger ``limit`` is lowered to it.
MAX_LIMIT = 50
#: The most event IDs in ``earliest_events`` and in ``latest_events``.
MAX_EVENT_IDS = 20
#: The longest event or room ID accepted, in bytes of UTF-8.
MAX_ID_BYTES = 255
#: The most events one walk looks at (returned or not).
MAX_WALK_STEPS = 1000
#: The largest request body accepted.
MAX_BODY_BYTES = 64 * 1024
#: The largest ``min_depth`` (and depth) accepted: the Matrix integer range.
MAX_DEPTH = 2**53 - 1


@attrs.frozen
class MissingEventsRequest:
    """A validated ``get_missing_events`` request.

    Attributes:
        room_id: the room, from the URL.
        earliest_events: events the requester has; the walk stops at them.
        latest_events: where the walk starts (themselves not returned).
        limit: the most events to return (at most :data:`MAX_LIMIT`).
        min_depth: events of a lower depth are neither returned nor walked past.
    """

    room_id: str
    earliest_events: tuple[str, ...]
    latest_events: tuple[str, ...]
    limit: int
    min_depth: int


def _bad(message: str, errcode: str = "M_BAD_JSON") -> HttpApiError:
    return HttpApiError(400, errcode, message)


def check_id(value: Any, what: str) -> str:
    """``value`` if it is a non-empty string of at most :data:`MAX_ID_BYTES` bytes of strict UTF-8.

    Raises:
        HttpApiError: 400 ``M_BAD_JSON`` naming ``what``.
    """
    if not isinstance(value, str) or not value:
        raise _bad(f"{what} must be a non-empty string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad(f"{what} is not valid UTF-8") from None
    if size > MAX_ID_BYTES:
        raise _bad(f"{what} is {size} bytes, more than {MAX_ID_BYTES}")
    return value


def check_id_list(value: Any, what: str, *, required: bool) -> tuple[str, ...]:
    """A list of at most :data:`MAX_EVENT_IDS` event IDs (each checked by :func:`check_id`).

    Raises:
        HttpApiError: 400 ``M_BAD_JSON`` (not a list, too long, a bad ID) or
            ``M_MISSING_PARAM`` (absent when ``required``).
    """
    if value is None:
        if required:
            raise _bad(f"{what} is required", "M_MISSING_PARAM")
        return ()
    if not isinstance(value, list):
        raise _bad(f"{what} must be an array of event IDs")
    if len(value) > MAX_EVENT_IDS:
        raise _bad(f"{what} has {len(value)} event IDs, more than {MAX_EVENT_IDS}")
    return tuple(dict.fromkeys(check_id(v, f"{what}[{i}]") for i, v in enumerate(value)))


def _bounded_int(body: JsonDict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer")
    if not low <= value <= high:
        raise _bad(f"{key} must be in [{low}, {high}], got {value}")
    return value


def parse_missing_events_request(
    room_id: str, raw_body: bytes, *, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> MissingEventsRequest:
    """Check a ``get_missing_events`` request from a remote server and return what it asks.

    Args:
        room_id: the room ID from the URL (already unquoted).
        raw_body: the request body.
        max_json_depth: the deepest JSON nesting accepted.

    Raises:
        HttpApiError: 400 ``M_TOO_LARGE`` (body over :data:`MAX_BODY_BYTES`),
            ``M_NOT_JSON`` (not UTF-8 JSON, NaN/Infinity), ``M_BAD_JSON`` (not
            an object, a bad field: ID lists longer than
            :data:`MAX_EVENT_IDS` or with IDs over :data:`MAX_ID_BYTES` bytes,
            ``limit`` not in [0, 2^53), ``min_depth`` not in [0, 2^53)),
            ``M_MISSING_PARAM`` (no ``latest_events``). A ``limit`` above
            :data:`MAX_LIMIT` is lowered to it, as Matrix servers do.
    """
    check_id(room_id, "room ID")
    body = parse_body(raw_body, MAX_BODY_BYTES, max_json_depth)
    earliest = check_id_list(body.get("earliest_events"), "earliest_events", required=False)
    latest = check_id_list(body.get("latest_events"), "latest_events", required=True)
    limit = _bounded_int(body, "limit", DEFAULT_LIMIT, 0, MAX_DEPTH)
    min_depth = _bounded_int(body, "min_depth", 0, 0, MAX_DEPTH)
    return MissingEventsRequest(room_id, earliest, latest, min(limit, MAX_LIMIT), min_depth)


class SqlMissingEventsStore:
    """The walk behind ``get_missing_events``, on this server's events.

    Args:
        db: the database.
        server_name: this server (only events created here are served).
    """

    def __init__(self, db: Database, server_name: str) -> None:
        self.db = db
        self.server_name = server_name

    def missing_events(self, request: MissingEventsRequest, requester: str) -> Deferred[list[JsonDict] | None]:
        """The events ``requester`` is missing, oldest first; None if it has no joined member in the room."""
        return self.db.run_interaction("get_missing_events", self._walk_txn, request, requester,
                                       read_only=True, idempotent=True)

    def _walk_txn(self, txn: Txn, request: MissingEventsRequest, requester: str) -> list[JsonDict] | None:
        txn.execute(
            "SELECT 1 FROM room_memberships WHERE room_id = ? AND server_name = ? AND membership = 'join'",
            (request.room_id, requester),
        )
        if txn.fetchone() is None:
            return None
        seen = set(request.earliest_events)
        frontier: list[str] = []
        for event_id in request.latest_events:
            row = self._event_txn(txn, request.room_id, event_id)
            if row is not None and row[0]["prev_events"]:
                frontier.extend(row[0]["prev_events"])
            seen.add(event_id)
        found: list[JsonDict] = []
        steps = 0
        while frontier and len(found) < request.limit and steps < MAX_WALK_STEPS:
            event_id = frontier.pop(0)
            if event_id in seen:
                continue
            seen.add(event_id)
            steps += 1
            row = self._event_txn(txn, request.room_id, event_id)
            if row is None:
                continue  # not ours to know (or another room's): the walk ends on this branch
            pdu, destinations = row
            if pdu["depth"] < request.min_depth:
                continue
            if pdu["origin"] == self.server_name and requester in destinations:
                found.append(pdu)
            frontier.extend(pdu["prev_events"])
        found.sort(key=lambda p: p["depth"])
        return found

    @staticmethod
    def _event_txn(txn: Txn, room_id: str, event_id: str) -> tuple[JsonDict, list[str]] | None:
        txn.execute(
            f"SELECT {PDU_COLUMNS}, e.destinations FROM events e "
            "JOIN instance_map im ON im.instance_name = e.instance_name WHERE e.event_id = ? AND e.room_id = ?",
            (event_id, room_id),
        )
        row = txn.fetchone()
        if row is None:
            return None
        destinations = json.loads(row[-1]) if row[-1] else []
        return event_to_pdu(tuple(row[:-1])).json, destinations if isinstance(destinations, list) else []


def claimed_origin(request: IRequest) -> str | None:
    """The ``origin`` of the request's ``Authorization: X-Matrix`` header, as sent (not verified).

    The fallback of :class:`MissingEventsResource` until a verifying
    ``origin_of`` is given; the same trust as ``/send``'s body ``origin``.
    """
    raw = request.getHeader(b"authorization")
    header = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not header or not header.startswith("X-Matrix "):
        return None
    for part in header[len("X-Matrix "):].split(","):
        key, _, value = part.strip().partition("=")
        if key == "origin":
            return value.strip('"') or None
    return None


class MissingEventsResource(Resource):
    """``POST .../get_missing_events/{roomId}`` over a :class:`SqlMissingEventsStore`.

    Args:
        store: the walk.
        allowed_origins: the servers allowed to ask (None: any).
        origin_of: returns the request's authenticated origin, or None (then
            :func:`claimed_origin` is used); may raise
            :class:`~synflow.errors.HttpApiError` (e.g. 401).
        max_json_depth: the deepest JSON nesting accepted.
    """

    isLeaf = True
    max_body_bytes = MAX_BODY_BYTES

    def __init__(self, store: SqlMissingEventsStore, *, allowed_origins: Sequence[str] | None,
                 origin_of: Callable[[IRequest], str | None] | None = None,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        super().__init__()
        self._store = store
        self._allowed = None if allowed_origins is None else frozenset(allowed_origins)
        self._origin_of = origin_of
        self._max_json_depth = max_json_depth

    def render_POST(self, request: Any) -> Any:
        try:
            parsed, origin = self._check(request)
        except HttpApiError as e:
            logger.info("refused get_missing_events: %s", e.msg)
            return _write(request, e.code, e.to_json())
        d = self._store.missing_events(parsed, origin)

        def _reply(events: list[JsonDict] | None) -> None:
            if client_gone(request):
                return
            if events is None:
                body = {"errcode": "M_FORBIDDEN", "error": f"{origin} has no member in {parsed.room_id}"}
                request.write(_write(request, 403, body))
            else:
                metrics.MISSING_EVENTS_SERVED.inc(len(events))
                request.write(_write(request, 200, {"events": events}))
            request.finish()

        def _error(f: Failure) -> None:
            logger.error("get_missing_events in %s failed: %s", parsed.room_id, f.getTraceback())
            if not client_gone(request):
                request.write(_write(request, 500, {"errcode": "M_UNKNOWN", "error": "internal error"}))
                request.finish()

        d.addCallbacks(_reply, _error)
        return NOT_DONE_YET

    def _check(self, request: Any) -> tuple[MissingEventsRequest, str]:
        segments = [s for s in request.postpath if s]
        if len(segments) != 1:
            raise HttpApiError(404, "M_UNRECOGNIZED", "expected /get_missing_events/{roomId}")
        try:
            room_id = unquote_to_bytes(segments[0]).decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("room ID is not UTF-8", "M_INVALID_PARAM") from None
        origin = self._origin_of(request) if self._origin_of is not None else None
        if origin is None:
            origin = claimed_origin(request)
        if origin is None:
            raise HttpApiError(401, "M_UNAUTHORIZED", "no X-Matrix origin on the request")
        if self._allowed is not None and origin not in self._allowed:
            raise HttpApiError(403, "M_FORBIDDEN", f"federation from {origin!r} is not allowed")
        if getattr(request, "too_large", False):
            raise HttpApiError(400, "M_TOO_LARGE", f"body is more than {MAX_BODY_BYTES} bytes")
        raw = request.content.read(MAX_BODY_BYTES + 1) if request.content is not None else b""
        return parse_missing_events_request(room_id, raw, max_json_depth=self._max_json_depth), origin


def _write(request: Any, code: int, body: JsonDict) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")
