"""Inbound ``PUT /_matrix/federation/v1/send/{txnId}``: validation and dedupe.

Three layers, each usable alone:

* :func:`validate_transaction` -- a pure function from the raw request to a
  :class:`Transaction`, or an :class:`~synflow.errors.HttpApiError` (always
  400, with an ``errcode`` such as ``M_NOT_JSON``, ``M_TOO_LARGE`` or
  ``M_FORBIDDEN``) saying exactly what is wrong;
* :class:`InboundTransactionHandler` -- deduplicates on ``(origin, txn_id)``
  (the origin authenticated by :mod:`synflow.federation.auth`, never a
  claim in the body)
  through a :class:`~synflow.federation.interfaces.DedupeStore`, persists each
  PDU through an injected callable (each room's in order, the rooms side by
  side), reports the origin as up, and returns
  ``(code, json_body)`` (503, unremembered, when a PDU cannot be persisted
  now, so the sender retries);
* :class:`SendResource` -- the twisted.web glue: mount it at
  ``/_matrix/federation/v1/send`` (it reads the transaction ID from the
  remaining path). It declares the handler's body limit as its
  ``max_body_bytes``, which :func:`synflow.http.site.build_site` applies to
  requests reaching it, and answers a body the site stopped buffering with
  400 ``M_TOO_LARGE`` like any other oversized body.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, gatherResults, maybeDeferred, succeed
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from synflow.errors import HttpApiError, PersistRefused
from synflow.events.bounds import FieldError, check_json_value
from synflow.federation import metrics
from synflow.federation.interfaces import DedupeStore, JsonDict
from synflow.federation.pdus import INBOUND_PDUS_REFUSED, pdu_refusal
from synflow.federation.policy import MAX_EDUS_PER_TRANSACTION, MAX_PDUS_PER_TRANSACTION
from synflow.http.server import client_gone
from synflow.json_encoding import nested_deeper_than, reject_constant
from synflow.metrics import series

logger = logging.getLogger(__name__)
_inbound_transactions = series(metrics.INBOUND_TRANSACTIONS)

#: The default bound on a request body (``federation.max_body_bytes``).
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
#: The default bound on JSON nesting.
DEFAULT_MAX_JSON_DEPTH = 64
#: The longest transaction ID accepted.
MAX_TXN_ID_LENGTH = 255
#: ``persist_pdu`` errors that say this server cannot persist now (a persister
#: unreachable), not that the PDU is bad: the transaction is answered 503 and
#: not remembered, so the sender retries it.
TRANSIENT_PERSIST_CODES = frozenset({502, 503, 504})


@attrs.frozen
class Transaction:
    """A validated inbound transaction.

    Attributes:
        origin: the sending server.
        txn_id: its transaction ID.
        origin_server_ts: its timestamp (ms).
        pdus: the PDU objects, in order.
        edus: the EDU objects, in order.
    """

    origin: str
    txn_id: str
    origin_server_ts: int
    pdus: tuple[JsonDict, ...] = attrs.field(eq=False, repr=False)
    edus: tuple[JsonDict, ...] = attrs.field(eq=False, repr=False)
    #: Event ID -> why that PDU is refused (out of bounds); it is answered, never persisted.
    refused: dict[str, str] = attrs.field(factory=dict, eq=False, repr=False)


def _bad(message: str, errcode: str = "M_BAD_JSON") -> HttpApiError:
    return HttpApiError(400, errcode, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_pdu(index: int, pdu: Any) -> str | None:
    """Refuse the transaction for a PDU it cannot answer for; return why an answerable PDU is refused alone."""
    if not isinstance(pdu, dict):
        raise _bad(f"pdus[{index}] is {type(pdu).__name__}, not an object")
    if not isinstance(pdu.get("event_id"), str) or not pdu["event_id"]:
        raise _bad(f"pdus[{index}].event_id must be a non-empty string")
    return pdu_refusal(pdu)


def _check_edu(index: int, edu: Any) -> None:
    if not isinstance(edu, dict):
        raise _bad(f"edus[{index}] is {type(edu).__name__}, not an object")
    if not isinstance(edu.get("edu_type"), str) or not edu["edu_type"]:
        raise _bad(f"edus[{index}].edu_type must be a non-empty string")
    if not isinstance(edu.get("content"), dict):
        raise _bad(f"edus[{index}].content must be an object")


def _edu_in_bounds(index: int, edu: JsonDict, origin: str) -> bool:
    """Whether an EDU's content is in bounds (finite, ranged, UTF-8); one that is not is dropped alone."""
    try:
        check_json_value(edu, f"edus[{index}]")
    except FieldError as e:
        logger.info("dropped an EDU from %s: %s", origin, e)
        return False
    return True


def _parse(raw_body: bytes, max_body_bytes: int, max_json_depth: int) -> dict[str, Any]:
    if len(raw_body) > max_body_bytes:
        raise HttpApiError(400, "M_TOO_LARGE", f"body is {len(raw_body)} bytes, more than {max_body_bytes}")
    try:
        text = raw_body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"body is not UTF-8: {e.reason} at byte {e.start}", "M_NOT_JSON") from None
    try:
        body = json.loads(text, parse_constant=reject_constant)
    except RecursionError:
        raise _bad(f"JSON is nested more than {max_json_depth} levels deep") from None
    except ValueError as e:
        raise _bad(f"body is not valid JSON: {e}", "M_NOT_JSON") from None
    if not isinstance(body, dict):
        raise _bad(f"body is a JSON {type(body).__name__}, not an object")
    if nested_deeper_than(body, max_json_depth):
        raise _bad(f"JSON is nested more than {max_json_depth} levels deep")
    return body


def parse_body(raw_body: bytes, max_body_bytes: int, max_json_depth: int) -> dict[str, Any]:
    """A federation request body from a remote server as a JSON object, every refusal a 400.

    Raises:
        HttpApiError: 400 ``M_TOO_LARGE``, ``M_NOT_JSON`` (not UTF-8, not
            JSON, NaN or Infinity) or ``M_BAD_JSON`` (not an object, too deep).
    """
    return _parse(raw_body, max_body_bytes, max_json_depth)


def check_pdu(index: int, pdu: Any) -> None:
    """Check the shape of one PDU from a remote server, as ``/send`` does.

    Raises:
        HttpApiError: 400 ``M_BAD_JSON`` naming ``pdus[index]`` and the field.
    """
    _check_pdu(index, pdu)


def validate_transaction(
    origin_header_or_none: str | None,
    txn_id: str,
    raw_body: bytes,
    *,
    allowed_origins: Sequence[str] | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
) -> Transaction:
    """Check an inbound ``/send`` request and return the transaction it carries.

    Args:
        origin_header_or_none: the origin the request authenticated as (from
            its ``Authorization: X-Matrix`` header), if known; the body's
            ``origin``, if present, must then equal it (else 401
            ``M_UNAUTHORIZED``), and the transaction is that origin's.
        txn_id: the transaction ID from the URL.
        raw_body: the request body.
        allowed_origins: the servers allowed to send (None: any).
        max_body_bytes: the largest body accepted.
        max_json_depth: the deepest nesting of arrays/objects accepted.

    Raises:
        HttpApiError: 400 ``M_TOO_LARGE`` (body over the limit, more than 50
            PDUs or 100 EDUs), 400 ``M_NOT_JSON`` (not UTF-8, not JSON, NaN or
            Infinity), 400 ``M_BAD_JSON`` (not an object, too deep, a missing or
            ill-typed field, a PDU without a string ``event_id``, a malformed
            EDU, NaN/Infinity or an out-of-range integer outside the PDUs and
            EDUs), 400 ``M_INVALID_PARAM`` (a bad transaction ID), 400
            ``M_FORBIDDEN`` (origin not allowed), 401 ``M_UNAUTHORIZED`` (the
            body's origin is not the authenticated one); the ``errcode`` says
            which kind it was. A PDU with an ``event_id`` but bad otherwise is
            not a refusal of the transaction: it is listed in
            ``Transaction.refused`` and answered alone; an EDU out of bounds is
            dropped alone.
    """
    if not isinstance(txn_id, str) or not txn_id or len(txn_id) > MAX_TXN_ID_LENGTH:
        raise HttpApiError(400, "M_INVALID_PARAM", f"transaction ID must be 1 to {MAX_TXN_ID_LENGTH} characters")
    body = _parse(raw_body, max_body_bytes, max_json_depth)
    origin = body.get("origin", origin_header_or_none)
    if not isinstance(origin, str) or not origin:
        raise _bad("origin must be a non-empty string")
    if origin_header_or_none is not None and origin != origin_header_or_none:
        raise HttpApiError(401, "M_UNAUTHORIZED", f"origin {origin[:255]!r} is not the authenticated server")
    if allowed_origins is not None and origin not in allowed_origins:
        raise _bad(f"federation from {origin!r} is not allowed", "M_FORBIDDEN")
    origin_server_ts = body.get("origin_server_ts")
    if not _is_int(origin_server_ts):
        raise _bad("origin_server_ts must be an integer")
    pdus = body.get("pdus")
    if not isinstance(pdus, list):
        raise _bad("pdus must be an array")
    edus = body.get("edus", [])
    if not isinstance(edus, list):
        raise _bad("edus must be an array")
    if len(pdus) > MAX_PDUS_PER_TRANSACTION:
        raise HttpApiError(400, "M_TOO_LARGE", f"{len(pdus)} PDUs, more than {MAX_PDUS_PER_TRANSACTION}")
    if len(edus) > MAX_EDUS_PER_TRANSACTION:
        raise HttpApiError(400, "M_TOO_LARGE", f"{len(edus)} EDUs, more than {MAX_EDUS_PER_TRANSACTION}")
    refused: dict[str, str] = {}
    for i, pdu in enumerate(pdus):
        why = _check_pdu(i, pdu)
        if why is not None:
            refused.setdefault(pdu["event_id"], why)
    for i, edu in enumerate(edus):
        _check_edu(i, edu)
    try:
        check_json_value({k: v for k, v in body.items() if k not in ("pdus", "edus")}, "transaction")
    except FieldError as e:
        raise _bad(str(e)) from None
    edus = [edu for i, edu in enumerate(edus) if _edu_in_bounds(i, edu, origin)]
    assert isinstance(origin_server_ts, int)
    return Transaction(origin, txn_id, origin_server_ts, tuple(pdus), tuple(edus), refused)


PersistPdu = Callable[[str, JsonDict], "Deferred[object] | object"]


class InboundTransactionHandler:
    """Handles validated-or-not inbound transactions, once each.

    Args:
        dedupe_store: remembers the response to each ``(origin, txn_id)``.
        persist_pdu: ``persist_pdu(origin, pdu)`` persists one PDU (through
            the room's persister); an exception (or failed Deferred) is that
            PDU's error in the response.
        on_remote_server_up: called with the origin of every accepted
            request (clears its backoff, announces ``REMOTE_SERVER_UP``); not
            waited for.
        on_edu: optionally called with ``(origin, edu)`` for each EDU of a
            new transaction.
        allowed_origins: the servers allowed to send (None: any).
        max_body_bytes: the largest body accepted.
        max_json_depth: the deepest JSON nesting accepted.
    """

    def __init__(
        self,
        dedupe_store: DedupeStore,
        persist_pdu: PersistPdu,
        on_remote_server_up: Callable[[str], object],
        *,
        on_edu: Callable[[str, JsonDict], object] | None = None,
        allowed_origins: Sequence[str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    ) -> None:
        self._store = dedupe_store
        self._persist_pdu = persist_pdu
        self._on_remote_server_up = on_remote_server_up
        self._on_edu = on_edu
        self._allowed_origins = list(allowed_origins) if allowed_origins is not None else None
        self.max_body_bytes = max_body_bytes
        self._max_json_depth = max_json_depth
        self._in_progress: dict[tuple[str, str], Deferred[tuple[int, JsonDict]]] = {}

    def on_send(self, origin: str | None, txn_id: str, raw_body: bytes) -> Deferred[tuple[int, JsonDict]]:
        """Handle one ``/send`` request.

        Args:
            origin: the authenticated origin, if known (see
                :func:`validate_transaction`).
            txn_id: the transaction ID from the URL.
            raw_body: the request body.

        Returns:
            A Deferred firing with ``(code, json_body)``: ``(200, {"pdus":
            {event_id: {} | {"error": ...}}})`` for an accepted transaction
            (the same response again for a repeat), or the error status with
            ``{"errcode", "error"}``.
        """
        try:
            txn = validate_transaction(
                origin, txn_id, raw_body,
                allowed_origins=self._allowed_origins,
                max_body_bytes=self.max_body_bytes,
                max_json_depth=self._max_json_depth,
            )
        except HttpApiError as e:
            _inbound_transactions("rejected").inc()
            logger.info("rejected /send %s from %s: %s", txn_id, origin, e.msg)
            return succeed((e.code, e.to_json()))
        self._remote_up(txn.origin)
        key = (txn.origin, txn.txn_id)
        running = self._in_progress.get(key)
        if running is not None:
            # The same transaction, resent while the first copy is handled.
            _inbound_transactions("duplicate").inc()
            waiter: Deferred[tuple[int, JsonDict]] = Deferred()
            running.addBoth(_chain, waiter)
            return waiter
        d = Deferred.fromCoroutine(self._handle(txn))
        if not d.called:
            self._in_progress[key] = d
            d.addBoth(self._forget, key)
        return d

    def _forget(self, result: Any, key: tuple[str, str]) -> Any:
        self._in_progress.pop(key, None)
        return result

    async def _handle(self, txn: Transaction) -> tuple[int, JsonDict]:
        stored = await self._store.get_response(txn.origin, txn.txn_id)
        if stored is not None:
            _inbound_transactions("duplicate").inc()
            return stored
        _inbound_transactions("accepted").inc()
        results: dict[str, JsonDict] = {}
        rooms: dict[object, list[JsonDict]] = {}
        for pdu in txn.pdus:
            event_id = pdu["event_id"]
            if event_id in results:
                continue
            if event_id in txn.refused:
                INBOUND_PDUS_REFUSED.inc()
                results[event_id] = {"error": txn.refused[event_id]}
                continue
            results[event_id] = {}  # in the transaction's order; a PDU's error replaces it
            rooms.setdefault(pdu.get("room_id"), []).append(pdu)
        # Rooms are independent: each room's PDUs are persisted in order, the
        # rooms side by side, so the persist calls of one step for every room
        # share one RPC to each persister (EventRouter batches a turn's calls).
        retry: list[HttpApiError] = []
        await gatherResults([Deferred.fromCoroutine(self._persist_room(txn.origin, pdus, results, retry))
                             for pdus in rooms.values()])
        if retry:
            # Not a PDU's fault (a persister is unreachable): fail the whole transaction,
            # unremembered, so the sender retries it; what was persisted is idempotent.
            _inbound_transactions("retry").inc()
            logger.warning("/send %s from %s: %s; answering 503 for a retry", txn.txn_id, txn.origin, retry[0].msg)
            return 503, {"errcode": "M_UNKNOWN", "error": f"cannot persist now, retry: {retry[0].msg}"}
        if self._on_edu is not None:
            for edu in txn.edus:
                try:
                    await maybeDeferred(self._on_edu, txn.origin, edu)
                except Exception:
                    logger.exception("handling %s EDU from %s failed", edu.get("edu_type"), txn.origin)
        response: tuple[int, JsonDict] = (200, {"pdus": results})
        try:
            await self._store.store_response(txn.origin, txn.txn_id, *response)
        except Exception:
            logger.exception("could not remember the response to %s from %s", txn.txn_id, txn.origin)
        return response

    async def _persist_room(self, origin: str, pdus: list[JsonDict], results: dict[str, JsonDict],
                            retry: list[HttpApiError]) -> None:
        """Persist one room's PDUs in order; a PDU that cannot be persisted now stops the room (see ``retry``)."""
        for pdu in pdus:
            event_id = pdu["event_id"]
            try:
                await maybeDeferred(self._persist_pdu, origin, pdu)
            except HttpApiError as e:
                if e.code in TRANSIENT_PERSIST_CODES:
                    retry.append(e)  # the room's later PDUs wait for the sender's retry: never out of order
                    return
                results[event_id] = {"error": e.msg}
            except PersistRefused as e:
                results[event_id] = {"error": e.msg}  # the room rules or the persister refused this PDU
            except Exception as e:
                logger.warning("persisting %s from %s failed: %s", event_id, origin, e)
                results[event_id] = {"error": str(e) or type(e).__name__}

    def _remote_up(self, origin: str) -> None:
        try:
            d = maybeDeferred(self._on_remote_server_up, origin)
        except Exception:  # maybeDeferred captures errors; this is belt and braces
            logger.exception("on_remote_server_up(%s) failed", origin)
            return
        d.addErrback(lambda f: logger.warning("on_remote_server_up(%s): %s", origin, f.getErrorMessage()))

    def resource(self, origin_of: Callable[[IRequest], str | None] | None = None) -> SendResource:
        """The twisted.web resource to mount at ``/_matrix/federation/v1/send``."""
        return SendResource(self, origin_of=origin_of)


def _chain(result: Any, waiter: Deferred[Any]) -> Any:
    if isinstance(result, Failure):
        waiter.errback(result)
        return None
    waiter.callback(result)
    return result


class SendResource(Resource):
    """``PUT /_matrix/federation/v1/send/{txnId}`` over an :class:`InboundTransactionHandler`.

    Mount it at ``/_matrix/federation/v1/send``. It reads at most one byte
    more than the handler's body limit, passes the authenticated origin
    (from ``origin_of(request)``, e.g. an ``X-Matrix`` header check; None
    when not given) and writes the handler's JSON reply.

    Its :attr:`max_body_bytes` is the handler's limit: a site built with
    :func:`synflow.http.site.build_site` buffers bodies up to it for requests
    reaching this resource, whatever the listener's general limit. A body
    the site refused to buffer (``request.too_large``) is answered 400
    ``M_TOO_LARGE`` and never reaches the handler.

    Args:
        handler: the inbound handler.
        origin_of: returns the request's authenticated origin, or None.
    """

    isLeaf = True

    def __init__(
        self, handler: InboundTransactionHandler, origin_of: Callable[[IRequest], str | None] | None = None
    ) -> None:
        super().__init__()
        self._handler = handler
        self._origin_of = origin_of

    @property
    def max_body_bytes(self) -> int:
        """The largest ``/send`` body accepted (the handler's ``max_body_bytes``)."""
        return self._handler.max_body_bytes

    def render_PUT(self, request: Any) -> Any:
        segments = [s for s in request.postpath if s]
        if len(segments) != 1:
            return _write(request, 404, {"errcode": "M_UNRECOGNIZED", "error": "expected /send/{txnId}"})
        try:
            txn_id = segments[0].decode("utf-8")
        except UnicodeDecodeError:
            return _write(request, 400, {"errcode": "M_INVALID_PARAM", "error": "transaction ID is not UTF-8"})
        try:
            origin = self._origin_of(request) if self._origin_of is not None else None
        except HttpApiError as e:
            return _write(request, e.code, e.to_json())
        if getattr(request, "too_large", False):
            _inbound_transactions("rejected").inc()
            limit = self._handler.max_body_bytes
            return _write(request, 400, {"errcode": "M_TOO_LARGE", "error": f"body is more than {limit} bytes"})
        raw = request.content.read(self._handler.max_body_bytes + 1) if request.content is not None else b""
        d = self._handler.on_send(origin, txn_id, raw)

        def _reply(result: tuple[int, JsonDict]) -> None:
            if not client_gone(request):
                request.write(_write(request, *result))
                request.finish()

        def _error(f: Failure) -> None:
            logger.error("inbound /send %s failed: %s", txn_id, f.getTraceback())
            if not client_gone(request):
                request.write(_write(request, 500, {"errcode": "M_UNKNOWN", "error": "internal error"}))
                request.finish()

        d.addCallbacks(_reply, _error)
        return NOT_DONE_YET


def _write(request: Any, code: int, body: JsonDict) -> bytes:
    """Set the status and content type; return the encoded body."""
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")
