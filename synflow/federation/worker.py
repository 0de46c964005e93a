"""Federation in the processes: the events follower of a sender, and inbound /send.

:class:`EventsFollower` runs on every federation sender. For each writer of
the events stream it reads, in stream order, the locally created events the
writer completed (with the remote servers that were in the room at each
event, recorded by the persister) and hands them to the
:class:`~synflow.federation.sender.FederationSender`, which keeps only the
destinations this sender owns. Its processed position is a vector clock,
persisted in ``federation_stream_position`` so a restart resumes where it
stopped; anything older is covered by each destination's catch-up.

:func:`inbound_handler` builds the master's ``PUT /_matrix/federation/v1/send``:
each PDU is persisted through its room's persister, the transaction is
deduplicated on (origin, txn_id), and an origin this server is backing off
has its backoff cleared and announced with ``REMOTE_SERVER_UP`` so its
sender wakes at once (an origin not backed off costs one read).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from synflow.events.router import EventRouter
from synflow.federation.gaps import GapFiller, SqlGapStore
from synflow.federation.inbound import InboundTransactionHandler
from synflow.federation.interfaces import MissingEventsTransport
from synflow.federation.metrics import edu_type_label
from synflow.federation.pdus import pdu_to_spec
from synflow.federation.policy import RetryState
from synflow.federation.sender import FederationSender
from synflow.federation.storage import SqlDedupeStore, SqlDestinationStore
from synflow.metrics import counter
from synflow.replication.commands import RemoteServerUpCommand
from synflow.replication.handler import ReplicationHandler
from synflow.storage.instances import InstanceMap
from synflow.tokens import StreamToken

logger = logging.getLogger(__name__)

EDUS_RECEIVED = counter("synflow_federation_edus_received_total", "EDUs received from remote servers", ["edu_type"])

BATCH = 500
PERSIST_INTERVAL_S = 1.0


class EventsFollower:
    """Feeds new local events to the federation sender, writer by writer, in order."""

    def __init__(self, store: SqlDestinationStore, handler: ReplicationHandler, instances: InstanceMap,
                 server_name: str, instance_name: str, clock: IReactorTime) -> None:
        self.store = store
        self.handler = handler
        self.instances = instances
        self.server_name = server_name
        self.instance_name = instance_name
        self.clock = clock
        self.sender: FederationSender | None = None
        self.processed: dict[str, int] = {}
        self.target: dict[str, int] = {}
        self._working: set[str] = set()
        #: Writers whose new positions are read at the end of this reactor turn, and the call that reads them.
        self._due: set[str] = set()
        self._due_call: IDelayedCall | None = None
        self._saved: str | None = None
        self._timer: IDelayedCall | None = None
        self.pdus_fed = 0

    async def start(self, sender: FederationSender) -> None:
        """Resume from the saved position (else from the stream's current one) and follow the stream.

        Once the position is known, the sender is asked to wake the
        destinations still behind it: the sender's own start-up wake-up may
        have run before, when the position was not known yet.
        """
        self.sender = sender
        saved = await self.store.get_stream_position("events", self.instance_name)
        current = self.handler.positions("events")
        await self.instances.load()
        await self.instances.ids_for(sorted(current))
        if saved is not None:
            token = StreamToken.parse(saved)
            for name in current:
                iid = self.instances.by_name.get(name)
                self.processed[name] = token.get(iid) if iid is not None else token.minimum
        else:
            self.processed = dict(current)
        self._saved = saved
        self.handler.add_position_listener("events", self._on_position)
        for name, pos in current.items():
            self._on_position(name, pos)
        self._timer = self.clock.callLater(PERSIST_INTERVAL_S, self._persist)
        sender.wake_outstanding().addErrback(
            lambda f: logger.warning("federation start-up wake-up: %s", f.getErrorMessage())
        )

    def stop(self) -> Deferred[Any]:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._due_call is not None and self._due_call.active():
            self._due_call.cancel()
        self._due_call = None
        return self._save()

    def events_position(self) -> StreamToken:
        """How far this follower has handed events to the sender (a vector clock)."""
        ids = self.instances.by_name
        known = {ids[n]: p for n, p in self.processed.items() if n in ids}
        return StreamToken.from_positions(known) if known else StreamToken.at(0)

    def _on_position(self, instance: str, token: int) -> None:
        self.target[instance] = max(token, self.target.get(instance, 0))
        self.processed.setdefault(instance, 0)
        if instance not in self._working and self.processed[instance] < self.target[instance]:
            # Read at the end of this reactor turn, not now: the rest of what arrived with this position (the
            # other events of the writer's transaction, each announced with its own ID, and the other writers'
            # rows of the same read) is applied first, so one read covers them all rather than one each.
            self._due.add(instance)
            if self._due_call is None:
                self._due_call = self.clock.callLater(0, self._read_due)

    def _read_due(self) -> None:
        self._due_call = None
        due, self._due = self._due, set()
        for instance in sorted(due):
            if instance not in self._working and self.processed[instance] < self.target[instance]:
                self._working.add(instance)
                d = Deferred.fromCoroutine(self._work(instance))
                d.addErrback(self._failed, instance)
                d.addBoth(self._done, instance)

    @staticmethod
    def _failed(failure: Failure, instance: str) -> None:
        logger.error("federation follower for %s failed: %s", instance, failure.getTraceback())

    def _done(self, _: object, instance: str) -> None:
        self._working.discard(instance)

    async def _work(self, instance: str) -> None:
        assert self.sender is not None
        await self.instances.ids_for([instance])
        while self.processed[instance] < self.target[instance]:
            upto = self.target[instance]
            events = await self.store.local_events_between(instance, self.processed[instance], upto,
                                                           self.server_name, BATCH)
            for pdu, destinations in events:
                self.sender.notify_new_pdu(pdu, destinations)
                self.pdus_fed += 1
            if len(events) == BATCH:
                self.processed[instance] = events[-1][0].stream_ordering
            else:
                self.processed[instance] = upto

    def _persist(self) -> None:
        self._timer = None
        d = self._save()
        d.addBoth(lambda _: setattr(self, "_timer", self.clock.callLater(PERSIST_INTERVAL_S, self._persist)))

    def _save(self) -> Deferred[Any]:
        token = str(self.events_position())
        if token == self._saved:
            return Deferred.fromCoroutine(_noop())
        self._saved = token
        return self.store.set_stream_position("events", self.instance_name, token)


async def _noop() -> None:
    return None


def inbound_handler(db: Any, router: EventRouter, handler: ReplicationHandler, *, allowed_origins: list[str] | None,
                    max_body_bytes: int, max_json_depth: int,
                    missing_events: MissingEventsTransport | None = None,
                    clock: IReactorTime | None = None) -> InboundTransactionHandler:
    """The master's inbound transaction handler (``clock`` ages its deduplication rows).

    With ``missing_events`` (the federation client), a PDU whose
    ``prev_events`` are unknown here has the missing events pulled from its
    origin and persisted first (:class:`~synflow.federation.gaps.GapFiller`).
    """
    destinations = SqlDestinationStore(db)

    async def persist_pdu(origin: str, pdu: dict[str, Any]) -> None:
        # The persister applies the room rules (synflow.events.auth) as ``origin``.
        (result,) = await router.persist([pdu_to_spec(origin, pdu)])
        result.raise_error()

    async def clear_backoff(origin: str) -> None:
        # Only a server this one is backing off has anything to clear: one read per
        # transaction, not a write here, a command to every process and a write in
        # the owning sender.
        record = await destinations.get_destination(origin)
        if record is None or record.retry == RetryState():
            return
        try:
            await destinations.set_retry(origin, RetryState())
        except Exception as e:  # the senders still clear it, in memory and in the store
            logger.warning("could not reset backoff of %s: %s", origin, e)
        handler.send_command(RemoteServerUpCommand(origin))

    def remote_server_up(origin: str) -> Deferred[None]:
        return Deferred.fromCoroutine(clear_backoff(origin))

    def persist(origin: str, pdu: dict[str, Any]) -> Deferred[None]:
        return Deferred.fromCoroutine(persist_pdu(origin, pdu))

    def received_edu(origin: str, edu: dict[str, Any]) -> None:
        EDUS_RECEIVED.labels(edu_type=edu_type_label(edu.get("edu_type"))).inc()

    if missing_events is not None:
        persist = GapFiller(SqlGapStore(db), missing_events, persist).persist_pdu

    return InboundTransactionHandler(
        SqlDedupeStore(db, clock), persist, remote_server_up, on_edu=received_edu, allowed_origins=allowed_origins,
        max_body_bytes=max_body_bytes, max_json_depth=max_json_depth,
    )
