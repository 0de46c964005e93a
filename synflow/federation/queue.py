"""One destination's outbound queue: transactions, backoff and catch-up.

A :class:`PerDestinationQueue` holds the PDUs and EDUs waiting for one remote
server and runs at most one *transmission loop* at a time, so at most one
transaction is ever in flight to the destination. Each pass of the loop:

1. loads the destination's row on first use (retry state, how far it got);
2. stops if the destination is still backing off (a timer wakes it when the
   interval expires; the sender's periodic wake-up is the safety net);
3. in **catch-up mode**, reads the next 50 events the destination still
   needs and sends them as one transaction; an empty read leaves catch-up
   mode. What it reads is chosen once per catch-up
   (:func:`~synflow.federation.policy.choose_catch_up_mode`): every
   unacknowledged event, oldest first, while the destination owes at most
   ``catch_up_max_events``; past that, the latest event of each room (from
   ``destination_rooms``), and the remote pulls the gaps with
   ``get_missing_events``;
4. otherwise sends the oldest 50 PDUs and 100 EDUs as one transaction.

A failed transaction is retried, with the same transaction ID and content,
once the backoff expires; the retry state is written through the store so it
survives restarts. When the interval exceeds ``catch_up_after_s`` the
in-memory queues are dropped (bounding memory) and the queue enters
catch-up mode, which finds the dropped PDUs again through the database.

Every queue starts in catch-up mode, as Synapse's do: a fresh process does
not know what the destination missed before it started, and the queue's own
position only moves per writer once it has seen everything below. As
catch-up sends every event it owes (up to the cap), starting there loses
nothing.

How far the destination got is a vector clock
(:class:`~synflow.tokens.StreamToken`), so PDUs completed out of order by
sharded event persisters are never skipped; the rules are the pure
functions of :mod:`synflow.federation.policy`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from synflow.backoff import Backoff
from synflow.config import FederationConfig
from synflow.federation import metrics
from synflow.federation.interfaces import (
    DestinationStore,
    Edu,
    FederationTransport,
    Pdu,
    TransactionFailed,
)
from synflow.federation.policy import (
    CATCH_UP_BATCH,
    CatchUpMode,
    RetryState,
    TransactionIds,
    advance_for_sent,
    catch_up_position,
    check_catch_up_batch,
    choose_catch_up_mode,
    compose_transaction,
    fold_positions,
    transaction_body,
)
from synflow.metrics import series
from synflow.tokens import StreamToken

logger = logging.getLogger(__name__)
_pdus_sent = series(metrics.PDUS_SENT)


@attrs.frozen
class SentTransaction:
    """A transaction the destination accepted (passed to ``on_sent``).

    Attributes:
        destination: the remote server.
        txn_id: the transaction's ID.
        pdus: the PDUs it carried.
        edus: the EDUs it carried.
        catch_up: whether catch-up mode sent it.
        recovered: whether the destination had been failing before.
        response: the remote's reply.
    """

    destination: str
    txn_id: str
    pdus: tuple[Pdu, ...]
    edus: tuple[Edu, ...]
    catch_up: bool
    recovered: bool
    response: dict[str, Any] = attrs.field(eq=False, repr=False)


@attrs.frozen
class _Transaction:
    """A transaction being sent (and resent, unchanged, until it succeeds)."""

    txn_id: str
    body: dict[str, Any] = attrs.field(eq=False, repr=False)
    pdus: tuple[Pdu, ...]
    edus: tuple[Edu, ...]
    #: For catch-up transactions: the bounds the batch was read with.
    after: StreamToken | None = None
    upto: StreamToken | None = None

    @property
    def catch_up(self) -> bool:
        return self.upto is not None


def backoff_from_config(config: FederationConfig) -> Backoff:
    """The :class:`~synflow.backoff.Backoff` of ``federation.backoff``."""
    b = config.backoff
    return Backoff(initial_s=b.initial_s, multiplier=b.multiplier, max_s=b.max_s, jitter=b.jitter)


class PerDestinationQueue:
    """The outbound queue of one destination.

    Args:
        destination: the remote server name.
        store: the destinations store.
        transport: sends transactions.
        clock: schedules retries and stamps transactions.
        rng: the jitter of the backoff.
        config: the ``federation`` config section.
        origin: our server name (the transactions' ``origin``).
        events_position: how far the events stream has been processed for
            federation: every event it covers has its ``destination_rooms``
            rows written.
        on_sent: called with a :class:`SentTransaction` after each success.
        txn_ids: the transaction ID generator (shared by a sender's queues).
    """

    def __init__(
        self,
        destination: str,
        *,
        store: DestinationStore,
        transport: FederationTransport,
        clock: IReactorTime,
        rng: random.Random,
        config: FederationConfig,
        origin: str,
        events_position: Callable[[], StreamToken],
        on_sent: Callable[[SentTransaction], object] | None = None,
        txn_ids: TransactionIds | None = None,
    ) -> None:
        self.destination = destination
        self._store = store
        self._transport = transport
        self._clock = clock
        self._rng = rng
        self._config = config
        self._backoff = backoff_from_config(config)
        self._origin = origin
        self._events_position = events_position
        self._on_sent = on_sent
        self._txn_ids = txn_ids or TransactionIds(self._now_ms())

        self._pending_pdus: deque[Pdu] = deque()
        self._pending_edus: deque[Edu] = deque()
        self._txn: _Transaction | None = None
        self._retry = RetryState()
        self._retry_generation = 0
        self._last_successful: StreamToken | None = None
        self._loaded = False
        self._catching_up = True
        #: What the current catch-up sends (None: not chosen yet).
        self._catch_up_mode: CatchUpMode | None = None
        #: Positions of the PDUs not queued because catch-up will find them.
        self._skipped: StreamToken | None = None
        self._running = False
        self._loop_done: Deferred[None] | None = None
        self._in_flight = False
        self._retry_call: IDelayedCall | None = None
        self._stopping = False

    # -- state, for metrics and tests -------------------------------------------------

    @property
    def pending_pdus(self) -> int:
        """PDUs queued (including those of a transaction being retried)."""
        return len(self._pending_pdus)

    @property
    def pending_edus(self) -> int:
        """EDUs queued (including those of a transaction being retried)."""
        return len(self._pending_edus)

    @property
    def in_flight(self) -> bool:
        """Whether a transaction is in flight right now."""
        return self._in_flight

    @property
    def catching_up(self) -> bool:
        """Whether the queue is in catch-up mode."""
        return self._catching_up

    @property
    def catch_up_mode(self) -> CatchUpMode | None:
        """What the current catch-up sends (None before its first read, or outside catch-up)."""
        return self._catch_up_mode

    @property
    def retry(self) -> RetryState:
        """The current backoff state."""
        return self._retry

    @property
    def backing_off(self) -> bool:
        """Whether the destination is in backoff now."""
        return not self._retry.is_due(self._now_ms())

    @property
    def backoff_interval_s(self) -> float:
        """The current retry interval in seconds (0 when not failing)."""
        return self._retry.retry_interval / 1000

    @property
    def last_successful(self) -> StreamToken | None:
        """How far the destination got (None until known or if never)."""
        return self._last_successful

    # -- input ------------------------------------------------------------------------

    def send_pdu(self, pdu: Pdu) -> None:
        """Queue a PDU for the destination and start sending if idle.

        In catch-up mode the PDU is not queued (catch-up reads it back from
        ``destination_rooms``); only its position is remembered, so catch-up
        does not end before covering it. A PDU the destination's position
        already covers was handled by catch-up and is dropped.
        """
        if self._catching_up:
            self._skipped = fold_positions(self._skipped, [pdu])
        elif self._last_successful is not None and self._last_successful.covers(
            pdu.instance_id, pdu.stream_ordering
        ):
            logger.debug("%s: %s already handled by catch-up", self.destination, pdu.event_id)
            return
        else:
            self._pending_pdus.append(pdu)
        self.wake()

    def send_edu(self, edu: Edu) -> None:
        """Queue an EDU for the destination and start sending if idle."""
        self._pending_edus.append(edu)
        self.wake()

    def wake(self) -> None:
        """Start the transmission loop unless it is running (or stopping)."""
        if self._stopping or self._running:
            return
        self._running = True
        d = Deferred.fromCoroutine(self._run())
        if not d.called:
            self._loop_done = d

    def wake_outstanding(self) -> None:
        """The store reports work for this destination: if the queue is idle, catch up.

        An idle queue in normal mode has nothing in memory to send, so the
        work can only be found through ``destination_rooms`` (one read; it
        leaves catch-up mode again at once if the report was stale).
        """
        idle = not (self._running or self._txn or self._pending_pdus or self._pending_edus)
        if idle and self._loaded and not self._catching_up:
            self._catching_up = True
        self.wake()

    def reset_backoff(self) -> Deferred[None]:
        """Clear the backoff (in memory and through the store) and send at once.

        Used when the remote server is known to be up again (an inbound
        request from it, ``REMOTE_SERVER_UP``).
        """
        self._retry = RetryState()
        self._retry_generation += 1
        self._cancel_retry_call()
        d = self._store.set_retry(self.destination, RetryState())

        def _then(result: object) -> object:
            self.wake()  # even if the store failed: the in-memory state is cleared
            return result

        return d.addBoth(_then)

    def stop(self) -> Deferred[None]:
        """Start no new transaction; fire once the one in flight (if any) has finished."""
        self._stopping = True
        self._cancel_retry_call()
        if self._loop_done is None:
            return succeed(None)
        done: Deferred[None] = Deferred()
        self._loop_done.addBoth(lambda _: done.callback(None))
        return done

    # -- the transmission loop --------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception:
            # The periodic wake-up tries again; nothing is lost (the rows and
            # queues are intact), so log and stop this pass.
            logger.exception("federation queue for %s failed", self.destination)
        finally:
            self._running = False
            self._loop_done = None

    async def _loop(self) -> None:
        if not self._loaded:
            await self._load()
        while not self._stopping:
            if not (self._catching_up or self._txn or self._pending_pdus or self._pending_edus):
                return
            if not self._retry.is_due(self._now_ms()):
                self._schedule_retry()
                return
            if self._catching_up:
                await self._catch_up_step()
                continue
            txn = self._txn or self._next_transaction()
            await self._attempt(txn)

    async def _load(self) -> None:
        generation = self._retry_generation
        record = await self._store.get_destination(self.destination)
        if self._loaded:
            return
        self._loaded = True
        if record is None:
            return
        if generation == self._retry_generation:
            self._retry = record.retry
        if record.last_successful is not None:
            self._last_successful = record.last_successful

    def _next_transaction(self) -> _Transaction:
        pdus, edus = compose_transaction(self._pending_pdus, self._pending_edus)
        return self._new_transaction(pdus, edus)

    def _new_transaction(
        self,
        pdus: list[Pdu],
        edus: list[Edu],
        after: StreamToken | None = None,
        upto: StreamToken | None = None,
    ) -> _Transaction:
        body = transaction_body(self._origin, self._now_ms(), pdus, edus)
        return _Transaction(self._txn_ids.next_id(), body, tuple(pdus), tuple(edus), after, upto)

    async def _catch_up_step(self) -> None:
        """One step of catch-up: resend the pending batch, read the next, or leave."""
        if self._txn is not None:
            await self._attempt(self._txn)
            return
        after = self._last_successful if self._last_successful is not None else StreamToken.at(0)
        upto = self._events_position()
        if self._skipped is not None:
            # Every PDU handed to send_pdu has its rows written, and so has
            # everything of its writer before it: safe to read up to it.
            upto = upto.merge(self._skipped)
        if self._catch_up_mode is None:
            cap = self._config.catch_up_max_events
            owed = await self._store.count_catch_up_events(self.destination, after, upto, cap + 1)
            self._catch_up_mode = choose_catch_up_mode(owed, cap)
            metrics.CATCH_UPS.labels(mode=self._catch_up_mode.value).inc()
            if self._catch_up_mode is CatchUpMode.LATEST_PER_ROOM:
                logger.warning(
                    "%s: owes more than %d events (federation.catch_up_max_events); catching up with the "
                    "latest event of each room, the remote pulls the rest", self.destination, cap,
                )
        if self._catch_up_mode is CatchUpMode.EVERY_EVENT:
            pdus = await self._store.get_catch_up_events(self.destination, after, upto, CATCH_UP_BATCH)
        else:
            pdus = await self._store.get_catch_up_pdus(self.destination, after, upto, CATCH_UP_BATCH)
        check_catch_up_batch(self.destination, after, upto, pdus)
        if pdus:
            await self._attempt(self._new_transaction(list(pdus), [], after, upto))
            return
        # Nothing needed up to ``upto``: the destination has everything there.
        reached = after.merge(upto)
        await self._record_position(reached)
        if self._skipped is None or self._skipped.is_before_or_eq(reached):
            logger.info("%s: catch-up done at %s", self.destination, reached)
            self._catching_up = False
            self._catch_up_mode = None
            self._skipped = None
        # Otherwise a PDU was skipped while the read ran: read once more.

    async def _attempt(self, txn: _Transaction) -> None:
        self._txn = txn
        self._in_flight = True
        started = self._clock.seconds()
        try:
            response = await self._transport.send_transaction(self.destination, txn.txn_id, txn.body)
        except TransactionFailed as e:
            self._in_flight = False
            await self._failed(txn, e)
            return
        except Exception as e:
            self._in_flight = False
            logger.exception("%s: unexpected error sending %s", self.destination, txn.txn_id)
            await self._failed(txn, TransactionFailed(f"{type(e).__name__}: {e}"))
            return
        self._in_flight = False
        if not isinstance(response, dict):
            await self._failed(txn, TransactionFailed(f"reply is {type(response).__name__}, not an object"))
            return
        metrics.TRANSACTION_SECONDS.observe(self._clock.seconds() - started)
        await self._succeeded(txn, response)

    async def _succeeded(self, txn: _Transaction, response: dict[str, Any]) -> None:
        # In-memory state first, so a store error below cannot resend this.
        self._txn = None
        recovered = self._retry.failing
        if recovered:
            self._retry = RetryState()
            self._retry_generation += 1
        new: StreamToken | None = None
        if txn.catch_up:
            assert txn.upto is not None
            new = catch_up_position(txn.after, txn.upto, txn.pdus, CATCH_UP_BATCH)
        else:
            for _ in txn.pdus:
                self._pending_pdus.popleft()
            for _ in txn.edus:
                self._pending_edus.popleft()
            if txn.pdus:
                new = advance_for_sent(self._last_successful, txn.pdus)
        metrics.TRANSACTIONS_SENT.inc()
        _pdus_sent("catch_up" if txn.catch_up else "queue").inc(len(txn.pdus))
        metrics.EDUS_SENT.inc(len(txn.edus))
        self._log_pdu_errors(txn, response)
        if recovered:
            await self._store.set_retry(self.destination, RetryState())
        if new is not None:
            await self._record_position(new)
        if self._on_sent is not None:
            sent = SentTransaction(
                self.destination, txn.txn_id, txn.pdus, txn.edus, txn.catch_up, recovered, response
            )
            try:
                self._on_sent(sent)
            except Exception:
                logger.exception("on_sent failed for %s", txn.txn_id)

    async def _failed(self, txn: _Transaction, error: TransactionFailed) -> None:
        metrics.TRANSACTIONS_FAILED.labels(retriable=str(error.retriable).lower()).inc()
        metrics.PDUS_FAILED.inc(len(txn.pdus))
        metrics.EDUS_FAILED.inc(len(txn.edus))
        self._retry = self._retry.after_failure(self._now_ms(), self._backoff, self._rng)
        self._retry_generation += 1
        logger.info(
            "%s: transaction %s failed (%s); retrying in %.1fs",
            self.destination, txn.txn_id, error.reason, self._retry.retry_interval / 1000,
        )
        if self._retry.needs_catch_up(self._config.catch_up_after_s):
            self._enter_catch_up()
        await self._store.set_retry(self.destination, self._retry)

    def _enter_catch_up(self) -> None:
        """Drop the in-memory queues; catch-up finds the PDUs again through the store.

        EDUs are dropped for good, as in Synapse: they are ephemeral. Called
        again while catching up, it only drops the EDUs queued meanwhile.
        """
        if not self._catching_up:
            logger.info(
                "%s: backing off for more than %ss; dropping %d PDUs and %d EDUs and catching up",
                self.destination, self._config.catch_up_after_s,
                len(self._pending_pdus), len(self._pending_edus),
            )
            metrics.CATCH_UP_ENTERED.inc()
            self._catch_up_mode = None
        self._skipped = fold_positions(self._skipped, self._pending_pdus)
        if self._txn is not None and not self._txn.catch_up:
            self._txn = None
        self._pending_pdus.clear()
        self._pending_edus.clear()
        self._catching_up = True

    async def _record_position(self, token: StreamToken) -> None:
        new = token if self._last_successful is None else self._last_successful.merge(token)
        if new == self._last_successful:
            return
        self._last_successful = new
        await self._store.set_last_successful(self.destination, new)

    def _log_pdu_errors(self, txn: _Transaction, response: dict[str, Any]) -> None:
        results = response.get("pdus")
        if not isinstance(results, dict):
            return
        for event_id, result in results.items():
            if isinstance(result, dict) and result.get("error"):
                logger.info("%s rejected %s in %s: %s", self.destination, event_id, txn.txn_id, result["error"])

    # -- timers -----------------------------------------------------------------------

    def _schedule_retry(self) -> None:
        delay = max(0.0, (self._retry.due_at_ms - self._now_ms()) / 1000)
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.reset(delay)
            return
        self._retry_call = self._clock.callLater(delay, self._retry_due)

    def _retry_due(self) -> None:
        self._retry_call = None
        self.wake()

    def _cancel_retry_call(self) -> None:
        if self._retry_call is not None and self._retry_call.active():
            self._retry_call.cancel()
        self._retry_call = None

    def _now_ms(self) -> int:
        return int(self._clock.seconds() * 1000)
