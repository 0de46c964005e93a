"""Field bounds every event meets before it is persisted, as Synapse bounds them.

Events come from clients (through the client API) and from remote servers
(PDUs through inbound federation); both are untrusted. Before an event is
queued for a persist transaction, :func:`check_event_fields` checks every
field against the named bounds below, so a bad event is refused alone -- with
its own error -- and can never reach the database, fail a batch, or produce
a replication line too long to encode:

* event IDs, room IDs, user IDs, types and state keys are at most
  :data:`MAX_ID_BYTES` bytes of strict UTF-8 (no lone surrogates);
* every integer is within the canonical JSON range, +/- :data:`MAX_SAFE_INTEGER`;
* no float is NaN or infinite (``1e999`` parses to infinity);
* every string, and every object key, anywhere in the content is strict UTF-8;
* the whole event encodes to at most :data:`MAX_PDU_BYTES` bytes, with
  :data:`PDU_RESERVE_BYTES` kept for the fields its PDU adds.

The checks are pure and raise :class:`FieldError` naming the field and the
value's problem.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from synflow.errors import BadEvent
from synflow.json_encoding import compact_json_unicode

#: The longest event ID, room ID, user ID, event type or state key, in UTF-8 bytes.
MAX_ID_BYTES = 255
#: The largest integer magnitude in canonical JSON (2**53 - 1).
MAX_SAFE_INTEGER = 2**53 - 1
#: The largest whole event (PDU), as compact JSON, in bytes.
MAX_PDU_BYTES = 65_536
#: Room an event leaves for what its PDU adds (event ID, ``prev_events``, ``depth``),
#: so an event accepted here is never too large for the servers it is sent to.
PDU_RESERVE_BYTES = 2 * MAX_ID_BYTES + 64
#: The deepest nesting of content checked (deeper content is refused).
MAX_CONTENT_DEPTH = 64


class FieldError(ValueError):
    """A field of an event is out of bounds; the message names the field."""

    errcode = "M_BAD_JSON"


class EventTooLarge(FieldError):
    """The whole event is over :data:`MAX_PDU_BYTES`."""

    errcode = "M_TOO_LARGE"


def utf8_length(value: str, field: str) -> int:
    """The strict UTF-8 length of ``value``.

    Raises:
        FieldError: ``value`` holds a lone surrogate (not encodable as UTF-8).
    """
    try:
        return _byte_length(value)
    except UnicodeEncodeError as e:
        raise FieldError(f"{field} is not valid UTF-8 (lone surrogate at {e.start})") from None


def _byte_length(text: str) -> int:
    """``len(text.encode("utf-8"))``, without encoding ASCII text (a byte a character).

    Raises:
        UnicodeEncodeError: ``text`` holds a lone surrogate.
    """
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _strict_utf8(text: str) -> bool:
    """Whether ``text`` encodes as strict UTF-8 (holds no lone surrogate)."""
    try:
        _byte_length(text)
    except UnicodeEncodeError:
        return False
    return True


def check_identifier(value: Any, field: str, *, allow_empty: bool = False) -> str:
    """Check an ID-like string field: a str of strict UTF-8 within :data:`MAX_ID_BYTES`.

    Args:
        value: the field's value (from a client or remote server).
        field: its name, for the error.
        allow_empty: whether "" is allowed (state keys may be empty).

    Raises:
        FieldError: not a string, empty when it must not be, too long or not UTF-8.
    """
    if not isinstance(value, str):
        raise FieldError(f"{field} must be a string, not {type(value).__name__}")
    if not value and not allow_empty:
        raise FieldError(f"{field} must not be empty")
    size = utf8_length(value, field)
    if size > MAX_ID_BYTES:
        raise FieldError(f"{field} is {size} bytes, more than {MAX_ID_BYTES}")
    return value


def check_integer(value: Any, field: str) -> int:
    """Check an integer field: an int (not bool) within +/- :data:`MAX_SAFE_INTEGER`.

    Raises:
        FieldError: not an integer, or out of the canonical JSON range.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise FieldError(f"{field} must be an integer, not {type(value).__name__}")
    if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
        raise FieldError(f"{field} is {value}, outside +/-{MAX_SAFE_INTEGER}")
    return value


def check_json_value(value: Any, field: str) -> None:
    """Check a JSON value and everything in it: bounded integers, finite floats, UTF-8 strings.

    Iterative, so deep nesting costs no recursion; nesting past
    :data:`MAX_CONTENT_DEPTH` is refused.

    Raises:
        FieldError: naming the path of the first bad value found.
    """
    if _within_bounds(value):
        return
    stack: list[tuple[Any, str, int]] = [(value, field, 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, bool) or node is None:
            continue
        if isinstance(node, int):
            check_integer(node, path)
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise FieldError(f"{path} is {node}; NaN and Infinity are not allowed")
        elif isinstance(node, str):
            utf8_length(node, path)
        elif isinstance(node, (dict, list)):
            if depth > MAX_CONTENT_DEPTH:
                raise FieldError(f"{path} is nested more than {MAX_CONTENT_DEPTH} levels deep")
            if isinstance(node, dict):
                for key, child in node.items():
                    if not isinstance(key, str):
                        raise FieldError(f"{path} has a key that is not a string")
                    utf8_length(key, f"{path} key")
                    stack.append((child, f"{path}.{key[:32]}", depth + 1))
            else:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(node))
        else:
            raise FieldError(f"{path} holds a {type(node).__name__}, not a JSON value")


def _within_bounds(value: Any) -> bool:
    """Whether :func:`check_json_value` passes ``value``, without building the path of each value it visits.

    One level of nesting at a time; only the exact JSON types (``dict``,
    ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``) are judged here.
    False means "not sure": the caller walks again, naming the path of what
    is wrong, and decides.
    """
    level = [value]
    depth = 1
    while level:
        below: list[Any] = []
        for node in level:
            kind = type(node)
            if kind is str:
                if not node.isascii() and not _strict_utf8(node):
                    return False
            elif kind is dict:
                if depth > MAX_CONTENT_DEPTH:
                    return False
                for key in node:
                    if type(key) is not str or not (key.isascii() or _strict_utf8(key)):
                        return False
                below.extend(node.values())
            elif kind is int:
                if not -MAX_SAFE_INTEGER <= node <= MAX_SAFE_INTEGER:
                    return False
            elif kind is list:
                if depth > MAX_CONTENT_DEPTH:
                    return False
                below.extend(node)
            elif kind is float:
                if not math.isfinite(node):
                    return False
            elif node is not None and kind is not bool:
                return False
        level = below
        depth += 1
    return True


def check_event_fields(fields: Mapping[str, Any]) -> None:
    """Check the fields of one event (an :class:`~synflow.events.persist.EventSpec` as a dict, or a PDU).

    Takes input from a client or a remote server: every field is bounded.
    ``event_id``, ``state_key`` and ``txn_id`` may be absent (None); ``txn_id``
    (the client's idempotency key, never sent) does not count toward the size.

    Raises:
        FieldError: the first field out of bounds.
    """
    for name in ("room_id", "type", "sender"):
        check_identifier(fields.get(name), name)
    if fields.get("event_id") is not None:
        check_identifier(fields["event_id"], "event_id")
    if fields.get("state_key") is not None:
        check_identifier(fields["state_key"], "state_key", allow_empty=True)
    if fields.get("origin"):
        check_identifier(fields["origin"], "origin")
    check_integer(fields.get("origin_server_ts", 0), "origin_server_ts")
    content = fields.get("content")
    if not isinstance(content, dict):
        raise FieldError("content must be an object")
    check_json_value(content, "content")
    present = {k: v for k, v in fields.items() if v is not None and k != "txn_id"}
    size = _byte_length(compact_json_unicode(present)) + PDU_RESERVE_BYTES
    if size > MAX_PDU_BYTES:
        raise EventTooLarge(f"the event is {size} bytes, more than {MAX_PDU_BYTES}")


def event_refusal(fields: Mapping[str, Any]) -> BadEvent | None:
    """The refusal of an event out of bounds (see :func:`check_event_fields`), or None."""
    try:
        check_event_fields(fields)
    except FieldError as e:
        return BadEvent(e.errcode, str(e))
    return None
