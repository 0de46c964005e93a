"""The federation sender: the queues of the destinations this instance owns.

Destinations are sharded over ``federation_sender_instances`` with
:func:`~synflow.sharding.shard_for`; a :class:`FederationSender` keeps one
:class:`~synflow.federation.queue.PerDestinationQueue` per destination it
owns, created on first use, and ignores the others (their owner gets the
same notifications).

The lead process feeds it: :meth:`FederationSender.notify_new_pdu` for each
event to send (after writing its ``destination_rooms`` rows), and
:meth:`FederationSender.notify_remote_server_up` for ``REMOTE_SERVER_UP``.
At :meth:`FederationSender.start` it wakes every owned destination the store
says is behind, and from then on, every ``wakeup_interval_s``, it wakes them
again along with every queue, so due retries and unfinished catch-ups go out
without waiting for new traffic.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from synflow.config import FederationConfig
from synflow.errors import ShardingError
from synflow.federation import metrics
from synflow.federation.interfaces import DestinationStore, Edu, FederationTransport, Pdu
from synflow.federation.policy import TransactionIds
from synflow.federation.queue import PerDestinationQueue, SentTransaction
from synflow.sharding import shard_for

if TYPE_CHECKING:
    from synflow.events.shards import ShardFollower
from synflow.tokens import StreamToken

logger = logging.getLogger(__name__)


class FederationSender(Service):
    """Owns the per-destination queues of one federation sender instance.

    It is a Twisted service: ``startService``/``stopService`` call
    :meth:`start`/:meth:`stop`.

    Args:
        server_name: our server name (never a destination; the ``origin``).
        instance_name: this process's instance name.
        instances: the ordered ``federation_sender_instances``; empty means
            this process is the only sender and owns every destination.
        store: the destinations store.
        transport: sends transactions.
        clock: the reactor's time.
        rng: the backoff jitter.
        config: the ``federation`` config section.
        events_position: how far the events stream has been processed for
            federation (every event it covers has its ``destination_rooms``
            rows written).
        on_sent: called with each successful
            :class:`~synflow.federation.queue.SentTransaction` (for example to
            announce ``REMOTE_SERVER_UP`` when ``recovered`` is set).

    Raises:
        ShardingError: ``instances`` is not empty and does not list
            ``instance_name`` (unless ``follower`` is given: a sender may join by resharding).
        follower: the destinations' shard map (live resharding).
    """

    def __init__(
        self,
        *,
        server_name: str,
        instance_name: str,
        instances: Sequence[str],
        store: DestinationStore,
        transport: FederationTransport,
        clock: IReactorTime,
        rng: random.Random,
        config: FederationConfig,
        events_position: Callable[[], StreamToken],
        on_sent: Callable[[SentTransaction], object] | None = None,
        follower: ShardFollower | None = None,
    ) -> None:
        if instances and instance_name not in instances and follower is None:
            raise ShardingError(
                f"instance {instance_name!r} is not in federation_sender_instances {list(instances)}; "
                "add it there or do not run a federation sender in it"
            )
        self.server_name = server_name
        self.instance_name = instance_name
        self.instances = tuple(instances)
        self._store = store
        self._transport = transport
        self._clock = clock
        self._rng = rng
        self._config = config
        self._events_position = events_position
        self._on_sent = on_sent
        self._txn_ids = TransactionIds(int(clock.seconds() * 1000))
        self._queues: dict[str, PerDestinationQueue] = {}
        self._wakeup: LoopingCall | None = None
        self._stopping = False
        #: The destinations' shard map (live resharding); None: ``shard_for`` over ``instances``.
        self.follower = follower

    # -- ownership and queues ---------------------------------------------------------

    def owns(self, destination: str) -> bool:
        """Whether this instance sends to ``destination`` (never our own server)."""
        if destination == self.server_name:
            return False
        if self.follower is not None:
            # During a hand-over a moving destination has no sender: its old one has stopped
            # its queue, and its new one starts once the epoch commits, from the stored position.
            state = self.follower.state
            return not state.moving(destination) and state.current.owner(destination) == self.instance_name
        return not self.instances or shard_for(destination, self.instances) == self.instance_name

    def release_unowned(self) -> Deferred[None]:
        """Stop and drop the queues of destinations this instance no longer owns (a hand-over).

        Fires once their in-flight transactions have finished and their positions are stored,
        so the next owner starts from where this one stopped; then wakes the destinations
        this instance gained, which catch up from their stored positions.
        """
        gone = [d for d in self._queues if not self.owns(d)]
        stops = []
        for destination in gone:
            q = self._queues.pop(destination)
            logger.info("handing destination %s over to another federation sender", destination)
            stops.append(q.stop())
            _unregister_metrics(q)

        def wake(_: object) -> Deferred[None]:
            return self.wake_outstanding()

        return DeferredList(stops).addCallback(wake)

    @property
    def queues(self) -> Mapping[str, PerDestinationQueue]:
        """The queues created so far, by destination."""
        return self._queues

    def queue(self, destination: str) -> PerDestinationQueue:
        """The queue of an owned destination, created on first use.

        Raises:
            ShardingError: another instance owns ``destination`` (or it is us).
        """
        q = self._queues.get(destination)
        if q is not None:
            return q
        if not self.owns(destination):
            raise ShardingError(f"{self.instance_name} does not send to {destination!r}")
        q = self._queues[destination] = PerDestinationQueue(
            destination,
            store=self._store,
            transport=self._transport,
            clock=self._clock,
            rng=self._rng,
            config=self._config,
            origin=self.server_name,
            events_position=self._events_position,
            on_sent=self._on_sent,
            txn_ids=self._txn_ids,
        )
        _register_metrics(q)
        return q

    # -- input ------------------------------------------------------------------------

    def notify_new_pdu(self, pdu: Pdu, destinations: Iterable[str]) -> None:
        """Queue ``pdu`` for each destination this instance owns.

        Our own server and destinations owned by other instances are skipped.
        The caller must have written the PDU's ``destination_rooms`` rows
        first, and must notify each writer's PDUs in that writer's order.
        """
        if self._stopping:
            return
        for destination in dict.fromkeys(destinations):
            if self.owns(destination):
                self.queue(destination).send_pdu(pdu)

    def send_edu(self, destination: str, edu: Edu) -> None:
        """Queue an EDU for ``destination`` if this instance owns it."""
        if not self._stopping and self.owns(destination):
            self.queue(destination).send_edu(edu)

    def wake_destination(self, destination: str) -> None:
        """Start sending to ``destination`` now (if owned and not backing off)."""
        if not self._stopping and self.owns(destination):
            self.queue(destination).wake()

    def notify_remote_server_up(self, server: str) -> Deferred[None]:
        """``server`` is up again: clear its backoff (through the store) and send at once.

        Returns:
            A Deferred firing once the cleared state is stored and the queue
            woken (not once anything is sent).
        """
        if self._stopping or not self.owns(server):
            return succeed(None)
        return self.queue(server).reset_backoff()

    def wake_outstanding(self) -> Deferred[None]:
        """Wake every owned destination the store reports as behind ``events_position()`` now.

        :meth:`start` and the periodic wake-up do this too; the events
        follower calls it once it knows how far the events stream was
        processed, which may be after :meth:`start` ran.
        """
        if self._stopping:
            return succeed(None)
        return self._wake_outstanding()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Wake the owned destinations that are behind and start the periodic wake-up.

        Returns:
            A Deferred firing once the outstanding destinations are woken.
        """
        self._stopping = False
        self._wakeup = LoopingCall(self._periodic_wakeup)
        self._wakeup.clock = self._clock
        self._wakeup.start(self._config.wakeup_interval_s, now=False).addErrback(
            lambda f: logger.error("federation wake-up loop stopped: %s", f.getTraceback())
        )
        return self._wake_outstanding()

    def stop(self) -> Deferred[None]:
        """Stop sending: no new transactions; fire once those in flight have finished."""
        self._stopping = True
        if self._wakeup is not None and self._wakeup.running:
            self._wakeup.stop()
        self._wakeup = None
        stops = [q.stop() for q in self._queues.values()]

        def _done(_: object) -> None:
            # A later start() begins afresh, with queues that catch up first.
            for q in self._queues.values():
                _unregister_metrics(q)
            self._queues.clear()

        return DeferredList(stops).addCallback(_done)

    def startService(self) -> None:
        super().startService()
        self.start().addErrback(lambda f: logger.error("federation sender start-up: %s", f.getTraceback()))

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.stop()

    def _periodic_wakeup(self) -> Deferred[None]:
        for q in list(self._queues.values()):
            q.wake()
        return self._wake_outstanding().addErrback(
            lambda f: logger.warning("federation wake-up: %s", f.getErrorMessage())
        )

    def _wake_outstanding(self) -> Deferred[None]:
        d = maybeDeferred(lambda: self._store.outstanding_destinations(self._events_position()))

        def _wake(destinations: list[str]) -> None:
            for destination in destinations:
                if not self._stopping and self.owns(destination):
                    self.queue(destination).wake_outstanding()

        return d.addCallback(_wake)


def _register_metrics(q: PerDestinationQueue) -> None:
    d = q.destination
    metrics.PENDING_PDUS.labels(d).set_function(lambda: q.pending_pdus)
    metrics.PENDING_EDUS.labels(d).set_function(lambda: q.pending_edus)
    metrics.IN_FLIGHT.labels(d).set_function(lambda: int(q.in_flight))
    metrics.BACKING_OFF.labels(d).set_function(lambda: int(q.backing_off))
    metrics.BACKOFF_INTERVAL.labels(d).set_function(lambda: q.backoff_interval_s)
    metrics.CATCHING_UP.labels(d).set_function(lambda: int(q.catching_up))


def _unregister_metrics(q: PerDestinationQueue) -> None:
    for gauge in metrics.PER_DESTINATION:
        try:
            gauge.remove(q.destination)
        except KeyError:
            pass
