"""Inbound PDUs: the shape and bounds a remote event must meet, and its conversion to an event to persist.

A PDU arrives from a remote server inside a ``/send`` transaction. Before it
reaches a persister, :func:`pdu_refusal` checks it -- the fields synflow
reads, their types, and every bound of :mod:`synflow.events.bounds` (IDs and
types of at most 255 bytes of strict UTF-8, integers within +/-(2**53 - 1), no
NaN or Infinity anywhere, at most 65,536 bytes in all). A refused PDU is
answered in the transaction's ``pdus`` map with its own error; the others of
the transaction are persisted as usual. :func:`pdu_to_spec` then makes the
:class:`~synflow.events.persist.EventSpec` the persister judges with the room
rules (:mod:`synflow.events.auth`), acting as the authenticated origin.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
from typing import Any

from synflow.events.bounds import MAX_PDU_BYTES, FieldError, check_event_fields, check_json_value
from synflow.events.persist import EventSpec
from synflow.metrics import counter

INBOUND_PDUS_REFUSED = counter(
    "synflow_federation_inbound_pdus_refused_total", "Inbound PDUs refused alone for their shape or bounds"
)

#: The PDU fields synflow reads (others, such as ``prev_events`` or ``hashes``, are carried, not used).
_STRING_KEYS = ("event_id", "room_id", "type", "sender")


def pdu_refusal(pdu: dict[str, Any]) -> str | None:
    """Why one PDU from a remote server is refused, or None if its shape and bounds are good.

    Takes input from a remote server: every field synflow reads is typed and
    bounded, and the whole PDU (including fields synflow does not read) is
    checked for non-finite numbers, out-of-range integers, invalid UTF-8 and size.

    Args:
        pdu: the PDU object (its ``event_id`` already known to be a non-empty string).
    """
    for key in _STRING_KEYS:
        if not isinstance(pdu.get(key), str) or not pdu[key]:
            return f"{key} must be a non-empty string"
    if not isinstance(pdu.get("content"), dict):
        return "content must be an object"
    ts = pdu.get("origin_server_ts")
    if not isinstance(ts, int) or isinstance(ts, bool):
        return "origin_server_ts must be an integer"
    if "state_key" in pdu and not isinstance(pdu["state_key"], str):
        return "state_key must be a string"
    try:
        check_event_fields({key: pdu.get(key) for key in (*_STRING_KEYS, "state_key", "content", "origin_server_ts")})
        check_json_value(pdu, "pdu")
        size = len(json.dumps(pdu, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except FieldError as e:
        return str(e)
    if size > MAX_PDU_BYTES:
        return f"the PDU is {size} bytes, more than {MAX_PDU_BYTES}"
    return None


def pdu_to_spec(origin: str, pdu: dict[str, Any]) -> EventSpec:
    """The event to persist for a PDU that passed :func:`pdu_refusal`, acting as ``origin``.

    Args:
        origin: the authenticated origin server of the transaction.
        pdu: the PDU.
    """
    return EventSpec(
        room_id=pdu["room_id"], type=pdu["type"], sender=pdu["sender"], content=pdu["content"],
        state_key=pdu.get("state_key"), origin=origin, origin_server_ts=pdu["origin_server_ts"],
        event_id=pdu["event_id"],
    )
