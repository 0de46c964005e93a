"""The pure policy of the federation sender: bounds, retry state, positions.

Nothing here touches a clock, a socket or a database; every function takes
the values it needs and returns new values, so the rules are tested with
hypothesis on their own (``tests/federation/test_policy.py``):

* **bounds** -- a transaction carries at most :data:`MAX_PDUS_PER_TRANSACTION`
  PDUs and :data:`MAX_EDUS_PER_TRANSACTION` EDUs, oldest first; catch-up reads
  and sends :data:`CATCH_UP_BATCH` entries at a time;
* **catch-up mode** -- :func:`choose_catch_up_mode`: every unacknowledged
  event (:attr:`CatchUpMode.EVERY_EVENT`) while a destination owes at most
  ``federation.catch_up_max_events``, else the latest event of each room
  (:attr:`CatchUpMode.LATEST_PER_ROOM`), whose gaps the remote pulls;
* **retry state** -- :class:`RetryState` is what the ``destinations`` table
  stores (``retry_last_ts``, ``retry_interval``, ``failure_ts``, all ms) with
  its transitions: a failure grows the interval (capped exponential with
  jitter), a success clears it, and an interval beyond the catch-up threshold
  sends the destination into catch-up mode;
* **positions** -- how far a destination got is a vector-clock
  :class:`~synflow.tokens.StreamToken`; :func:`advance_for_sent` and
  :func:`catch_up_position` compute its next value without ever covering a
  PDU that was not handled (see ``docs/federation.md``).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import itertools
import random
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from synflow.backoff import Backoff
from synflow.errors import StorageError
from synflow.tokens import StreamToken

if TYPE_CHECKING:
    from synflow.federation.interfaces import Edu, Pdu

#: The most PDUs one ``/send`` transaction carries (the Matrix limit).
MAX_PDUS_PER_TRANSACTION: Final = 50
#: The most EDUs one ``/send`` transaction carries (the Matrix limit).
MAX_EDUS_PER_TRANSACTION: Final = 100
#: How many entries one catch-up step reads and sends as one transaction (at
#: most :data:`MAX_PDUS_PER_TRANSACTION`).
CATCH_UP_BATCH: Final = 50


class CatchUpMode(enum.Enum):
    """What a catch-up sends to a destination."""

    #: Every event the destination has not acknowledged, oldest first.
    EVERY_EVENT = "every_event"
    #: Only the latest event of each room; the remote pulls the gaps with ``get_missing_events``.
    LATEST_PER_ROOM = "latest_per_room"


def choose_catch_up_mode(owed: int, max_events: int) -> CatchUpMode:
    """The catch-up mode of a destination that owes ``owed`` events.

    Args:
        owed: how many unacknowledged events the destination needs (a count
            read with limit ``max_events + 1`` is enough).
        max_events: ``federation.catch_up_max_events``.

    Returns:
        :attr:`CatchUpMode.EVERY_EVENT` when ``owed <= max_events``, else
        :attr:`CatchUpMode.LATEST_PER_ROOM`.
    """
    if owed < 0 or max_events < 0:
        raise ValueError(f"owed ({owed}) and max_events ({max_events}) must be >= 0")
    return CatchUpMode.EVERY_EVENT if owed <= max_events else CatchUpMode.LATEST_PER_ROOM

T = TypeVar("T")


def take_oldest(pending: Iterable[T], limit: int) -> list[T]:
    """The first ``limit`` items of ``pending`` (queued oldest first), without removing them."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return list(itertools.islice(pending, limit))


def compose_transaction(
    pending_pdus: Iterable[Pdu],
    pending_edus: Iterable[Edu],
    *,
    max_pdus: int = MAX_PDUS_PER_TRANSACTION,
    max_edus: int = MAX_EDUS_PER_TRANSACTION,
) -> tuple[list[Pdu], list[Edu]]:
    """The PDUs and EDUs of the next transaction: the oldest of each, within the bounds.

    Args:
        pending_pdus: queued PDUs, oldest first.
        pending_edus: queued EDUs, oldest first.
        max_pdus: the PDU bound (defaults to the Matrix limit).
        max_edus: the EDU bound (defaults to the Matrix limit).

    Returns:
        ``(pdus, edus)``; both empty when nothing is pending.
    """
    return take_oldest(pending_pdus, max_pdus), take_oldest(pending_edus, max_edus)


def transaction_body(
    origin: str, origin_server_ts: int, pdus: Sequence[Pdu], edus: Sequence[Edu]
) -> dict[str, Any]:
    """The JSON body of ``PUT /send/{txnId}``; ``edus`` appears only when non-empty."""
    body: dict[str, Any] = {
        "origin": origin,
        "origin_server_ts": origin_server_ts,
        "pdus": [p.json for p in pdus],
    }
    if edus:
        body["edus"] = [e.to_json() for e in edus]
    return body


#: Random bytes in each transaction ID (base64url-encoded).
TXN_ID_RANDOM_BYTES = 16


def _random_token() -> str:
    return secrets.token_urlsafe(TXN_ID_RANDOM_BYTES)


class TransactionIds:
    """Transaction IDs: ``<ms at creation>.<counter>.<random>``.

    Unique per generator, and across restarts as long as two generators are
    not created in the same millisecond; the random part (128 bits from the
    operating system's CSPRNG) makes the next ID unguessable, so no one can
    pre-send a transaction under an ID this server will use. A transaction
    keeps its ID across retries; only a new transaction takes a new one.

    Args:
        start_ms: the creation time in ms (the caller reads its clock).
        token: makes the random part (tests may inject a fixed one).
    """

    def __init__(self, start_ms: int, token: Callable[[], str] = _random_token) -> None:
        self._start_ms = start_ms
        self._counter = itertools.count(1)
        self._token = token

    def next_id(self) -> str:
        """A new, never-returned ID."""
        return f"{self._start_ms}.{next(self._counter)}.{self._token()}"


@attrs.frozen
class RetryState:
    """A destination's backoff, as the ``destinations`` table stores it.

    Attributes:
        retry_last_ts: when the last failure happened (ms), 0 if none.
        retry_interval: how long to wait after ``retry_last_ts`` (ms), 0 if
            not backing off.
        failure_ts: when the current run of failures began (ms), None if the
            destination is not failing.
    """

    retry_last_ts: int = 0
    retry_interval: int = 0
    failure_ts: int | None = None

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed (the state is not the cleared one)."""
        return self.retry_interval > 0 or self.failure_ts is not None

    @property
    def due_at_ms(self) -> int:
        """The time (ms) from which the next attempt may be made."""
        return self.retry_last_ts + self.retry_interval if self.retry_interval > 0 else 0

    def is_due(self, now_ms: int) -> bool:
        """Whether an attempt may be made at ``now_ms`` (the backoff has expired)."""
        return self.retry_interval <= 0 or now_ms >= self.due_at_ms

    def needs_catch_up(self, catch_up_after_s: float) -> bool:
        """Whether the interval exceeds the threshold beyond which queues are dropped."""
        return self.retry_interval > catch_up_after_s * 1000

    def after_failure(self, now_ms: int, backoff: Backoff, rng: random.Random) -> RetryState:
        """The state after a failed attempt at ``now_ms``.

        The first failure waits ``backoff.initial_s``; each further one
        multiplies the interval by ``backoff.multiplier`` times a jitter
        factor drawn from ``[1 - jitter, 1 + jitter]``. The interval never
        shrinks and never exceeds ``backoff.max_s``.

        Args:
            now_ms: the time of the failure.
            backoff: the parameters (initial, multiplier, cap, jitter).
            rng: the source of the jitter.
        """
        cap_ms = backoff.max_s * 1000
        if self.retry_interval <= 0:
            interval = backoff.initial_s * 1000
        else:
            factor = backoff.multiplier
            if backoff.jitter:
                factor *= rng.uniform(1 - backoff.jitter, 1 + backoff.jitter)
            interval = max(self.retry_interval * factor, self.retry_interval)
        interval = min(interval, cap_ms)
        failure_ts = self.failure_ts if self.failure_ts is not None else now_ms
        return RetryState(retry_last_ts=now_ms, retry_interval=max(1, round(interval)), failure_ts=failure_ts)

    def after_success(self) -> RetryState:
        """The cleared state: no backoff, no failure."""
        return RetryState()


def advance_for_sent(last: StreamToken | None, pdus: Iterable[Pdu]) -> StreamToken:
    """How far a destination got after a transaction of queued PDUs succeeded.

    Each writer's component moves to the highest ``stream_ordering`` of that
    writer's PDUs sent. Queued PDUs of one writer arrive in that writer's
    order and a queue only leaves catch-up once everything below is handled,
    so this never covers a PDU that was not sent.

    Args:
        last: the previous position (None: never succeeded, i.e. ``s0``).
        pdus: the PDUs just sent.
    """
    token = last if last is not None else StreamToken.at(0)
    for pdu in pdus:
        token = token.advance(pdu.instance_id, pdu.stream_ordering)
    return token


def clamp(token: StreamToken, ceiling: int) -> StreamToken:
    """``token`` with every writer's position lowered to at most ``ceiling``."""
    ceiling = max(ceiling, 0)
    minimum = min(token.minimum, ceiling)
    return StreamToken.from_positions({i: min(p, ceiling) for i, p in token.positions}, minimum)


def catch_up_position(
    after: StreamToken | None, upto: StreamToken, batch: Sequence[Pdu], limit: int = CATCH_UP_BATCH
) -> StreamToken:
    """How far a destination got once a catch-up batch was handled.

    ``batch`` is what the store returned for ``(after, upto, limit)``: the
    entries not covered by ``after`` but covered by ``upto``, ordered by
    ``(stream_ordering, instance_id)``, at most ``limit``.

    * A batch shorter than ``limit`` held every such entry, so the whole of
      ``upto`` is handled: the result is ``after`` merged with ``upto``.
    * A full batch whose last ``stream_ordering`` is ``S`` held every entry
      below ``S`` (and the ones at ``S`` it returned): the result is
      ``after`` merged with ``clamp(upto, S - 1)``, advanced to each returned
      entry. Entries beyond ``upto`` (not yet complete, or not yet recorded)
      are never covered, whichever writer they belong to.

    Args:
        after: the position before the batch (None means ``s0``).
        upto: the upper bound the batch was read with.
        batch: the entries returned, in the store's order.
        limit: the limit the batch was read with.
    """
    start = after if after is not None else StreamToken.at(0)
    if len(batch) < limit:
        return start.merge(upto)
    highest = max(p.stream_ordering for p in batch)
    token = start.merge(clamp(upto, highest - 1))
    for pdu in batch:
        token = token.advance(pdu.instance_id, pdu.stream_ordering)
    return token


def fold_positions(token: StreamToken | None, pdus: Iterable[Pdu]) -> StreamToken | None:
    """``token`` advanced to cover each of ``pdus`` (None stays None if there are none)."""
    for pdu in pdus:
        token = (token if token is not None else StreamToken.at(0)).advance(
            pdu.instance_id, pdu.stream_ordering
        )
    return token


def check_catch_up_batch(
    destination: str, after: StreamToken, upto: StreamToken, batch: Sequence[Pdu], limit: int = CATCH_UP_BATCH
) -> None:
    """Refuse a catch-up batch that breaks the store's contract (it could loop or skip).

    Raises:
        StorageError: more than ``limit`` entries, or an entry outside ``(after, upto]``.
    """
    if len(batch) > limit:
        raise StorageError(f"get_catch_up_pdus returned {len(batch)} entries for {destination}, over {limit}")
    for pdu in batch:
        if after.covers(pdu.instance_id, pdu.stream_ordering) or not upto.covers(
            pdu.instance_id, pdu.stream_ordering
        ):
            raise StorageError(
                f"get_catch_up_pdus returned {pdu.event_id} ({pdu.instance_id}/{pdu.stream_ordering}) "
                f"for {destination}, outside ({after}, {upto}]; check the store's SQL"
            )
