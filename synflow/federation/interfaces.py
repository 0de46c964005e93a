"""What the federation sender and receiver need from the rest of synflow.

The sender core (:mod:`synflow.federation.queue`,
:mod:`synflow.federation.sender`) and the inbound handler
(:mod:`synflow.federation.inbound`) are written against the protocols here;
the SQL stores and the HTTP transport implement them. The values passed
across (:class:`Pdu`, :class:`Edu`, :class:`DestinationRecord`) are frozen
attrs classes. The exact semantics each store method must have are in its
docstring and in ``docs/federation.md``.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
from twisted.internet.defer import Deferred

from synflow.errors import SynflowError
from synflow.federation.policy import RetryState
from synflow.tokens import StreamToken

JsonDict = dict[str, Any]


@attrs.frozen
class Pdu:
    """A persisted event to send to remote servers.

    Attributes:
        event_id: the event's ID.
        room_id: the room it belongs to.
        instance_id: the persistent ID of the events-stream writer that
            persisted it (the component of the vector clock it advances).
        stream_ordering: its position in that writer's events stream.
        json: the PDU body sent over federation.
    """

    event_id: str
    room_id: str
    instance_id: int
    stream_ordering: int
    json: JsonDict = attrs.field(hash=False, repr=False)


@attrs.frozen
class Edu:
    """An ephemeral data unit (typing, receipts, presence, ...).

    Attributes:
        edu_type: e.g. ``m.typing``.
        content: the EDU's content object.
    """

    edu_type: str
    content: JsonDict = attrs.field(hash=False)

    def to_json(self) -> JsonDict:
        """The EDU as it appears in a transaction's ``edus`` list."""
        return {"edu_type": self.edu_type, "content": self.content}


@attrs.frozen
class DestinationRecord:
    """A row of the ``destinations`` table.

    Attributes:
        destination: the remote server name.
        retry: its backoff state.
        last_successful: how far it got (see :class:`DestinationStore`); None
            if nothing was ever sent successfully.
    """

    destination: str
    retry: RetryState = RetryState()
    last_successful: StreamToken | None = None


class TransactionFailed(SynflowError):
    """A ``/send`` transaction did not succeed.

    Attributes:
        reason: what went wrong, for logs.
        retriable: False when the remote rejected the request outright (a 4xx
            other than 408/429); True for connection errors, timeouts, 5xx,
            408, 429 and malformed replies. The queue backs off and retries in
            both cases (as Synapse does for ``/send``); the flag tells logs and
            metrics which it was.
    """

    def __init__(self, reason: str, retriable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retriable = retriable


class DestinationStore(Protocol):
    """Per-destination state in the database (``destinations``, ``destination_rooms``).

    Positions: an entry of ``destination_rooms`` ``(destination, room_id,
    stream_ordering, instance_name)`` is *covered* by a token ``T`` when
    ``stream_ordering <= T.get(instance_id(instance_name))``.
    """

    def get_destination(self, destination: str) -> Deferred[DestinationRecord | None]:
        """The ``destinations`` row, or None if there is none."""
        ...

    def set_retry(self, destination: str, retry: RetryState) -> Deferred[None]:
        """Store the backoff state (upserting the row)."""
        ...

    def set_last_successful(self, destination: str, token: StreamToken) -> Deferred[None]:
        """Store how far the destination got (upserting the row).

        The sender only ever moves it forward.
        """
        ...

    def get_catch_up_pdus(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[list[Pdu]]:
        """The events the destination still needs, one per room.

        From ``destination_rooms`` (the latest event of each room to send to
        ``destination``): the entries **not covered by** ``after`` and
        **covered by** ``upto``, ordered by ``(stream_ordering,
        instance_id)`` ascending, at most ``limit``, each joined to its
        event to build the :class:`Pdu`.
        """
        ...

    def count_catch_up_events(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[int]:
        """How many local events the destination still needs, counting at most ``limit``.

        The events created here whose recorded destinations include
        ``destination``, **not covered by** ``after`` and **covered by**
        ``upto``; the count stops at ``limit`` (the caller passes
        ``catch_up_max_events + 1``).
        """
        ...

    def get_catch_up_events(
        self, destination: str, after: StreamToken, upto: StreamToken, limit: int
    ) -> Deferred[list[Pdu]]:
        """Every event the destination still needs, not only each room's latest.

        The events :meth:`count_catch_up_events` counts, ordered by
        ``(stream_ordering, instance_id)`` ascending, at most ``limit``.
        """
        ...

    def outstanding_destinations(self, upto: StreamToken) -> Deferred[list[str]]:
        """Destinations with at least one ``destination_rooms`` entry still needed.

        An entry is needed when it is covered by ``upto`` and not covered by
        the destination's ``last_successful`` (a NULL one covers nothing).
        Destinations still backing off may be left out.
        """
        ...


class FederationTransport(Protocol):
    """Sends one ``/send`` transaction to a remote server."""

    def send_transaction(self, destination: str, txn_id: str, body: JsonDict) -> Deferred[JsonDict]:
        """``PUT /_matrix/federation/v1/send/{txn_id}`` with ``body``.

        Returns:
            A Deferred firing with the reply (a JSON object), or failing with
            :class:`TransactionFailed`.
        """
        ...


class MissingEventsTransport(Protocol):
    """Asks a remote server for the events of a room this server is missing."""

    def get_missing_events(self, destination: str, room_id: str, body: JsonDict) -> Deferred[JsonDict]:
        """``POST /_matrix/federation/v1/get_missing_events/{room_id}`` with ``body``.

        Returns:
            A Deferred firing with the reply (a JSON object), or failing with
            :class:`TransactionFailed`.
        """
        ...


class DedupeStore(Protocol):
    """Remembers the response to each inbound transaction (``received_transactions``)."""

    def get_response(self, origin: str, txn_id: str) -> Deferred[tuple[int, JsonDict] | None]:
        """The stored ``(code, body)`` for ``(origin, txn_id)``, or None."""
        ...

    def store_response(self, origin: str, txn_id: str, code: int, body: JsonDict) -> Deferred[None]:
        """Remember the response to ``(origin, txn_id)``."""
        ...
