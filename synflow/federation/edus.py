"""EDUs on the ``federation`` stream, and FEDERATION_ACK.

The master is the stream's only writer: :class:`EduQueue` records each EDU
for each destination in ``federation_outbox`` (a fact of the ``federation``
stream) and replication carries the rows to every federation sender.
:class:`EduFollower` runs on a sender: it hands the EDUs of the destinations
it owns to its queues and then acknowledges the stream position with
``FEDERATION_ACK <instance> <token>``. The master keeps each sender's last
acknowledgement and deletes outbox rows at or below the lowest one -- once
every configured sender has handled them.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from synflow.federation.interfaces import Edu
from synflow.federation.metrics import edu_type_label
from synflow.federation.sender import FederationSender
from synflow.metrics import counter, gauge
from synflow.replication.commands import FederationAckCommand
from synflow.replication.handler import ReplicationHandler
from synflow.storage.engines import Database, Txn
from synflow.storage.id_generators import StreamWriteContext, StreamWriters
from synflow.streams import FederationRow

logger = logging.getLogger(__name__)

EDUS_QUEUED = counter("synflow_federation_edus_queued_total", "EDUs the master queued for destinations", ["edu_type"])
OUTBOX_ROWS_TRIMMED = counter("synflow_federation_outbox_trimmed_total", "Outbox rows deleted after every sender acked")
ACKED = gauge("synflow_federation_acked_position", "Last federation stream position each sender acknowledged",
              ["instance"])

#: How often a sender acknowledges (seconds).
ACK_INTERVAL_S = 0.5


def queue_edus_txn(ctx: StreamWriteContext, instance_name: str, edus: Sequence[tuple[str, str, dict[str, Any]]]) -> list[int]:
    """Record (destination, edu_type, content) rows on the federation stream."""
    ids = ctx.allocate("federation", len(edus))
    ctx.txn.insert_many(
        "federation_outbox", ("stream_id", "instance_name", "destination", "edu_type", "content"),
        [(sid, instance_name, d, t, json.dumps(c)) for sid, (d, t, c) in zip(ids, edus, strict=True)],
    )
    for sid, (destination, edu_type, content) in zip(ids, edus, strict=True):
        ctx.add_rows("federation", sid, [FederationRow(destination, edu_type, content)])
    return ids


class EduQueue:
    """The master's side: queue EDUs and trim what every sender has acknowledged."""

    def __init__(self, db: Database, writers: StreamWriters, instance_name: str, senders: Sequence[str]) -> None:
        self.db = db
        self.writers = writers
        self.instance_name = instance_name
        self.senders = list(senders)
        self.acks: dict[str, int] = {}
        self._trimmed = 0

    def queue(self, edus: Sequence[tuple[str, str, dict[str, Any]]]) -> Deferred[list[int]]:
        for _, edu_type, _ in edus:
            EDUS_QUEUED.labels(edu_type=edu_type_label(edu_type)).inc()
        return self.writers.run_write("queue_edus", ["federation"], queue_edus_txn, self.instance_name, list(edus))

    def on_ack(self, conn: Any, cmd: FederationAckCommand) -> Deferred[int] | None:
        """A sender handled the federation stream up to ``cmd.token``.

        Once every configured sender has acknowledged, outbox rows at or
        below the lowest acknowledgement are deleted. An acknowledgement that
        does not move its sender forward, or an ack from an instance that is
        not a configured sender, never lowers that bound.

        Returns:
            A Deferred firing with the number of rows deleted when this ack
            raised the lowest acknowledgement (0 if the delete failed, which
            is logged; the next delete covers those rows too), else None.
        """
        if cmd.token <= self.acks.get(cmd.instance_name, 0):
            return None
        self.acks[cmd.instance_name] = cmd.token
        ACKED.labels(instance=cmd.instance_name).set(cmd.token)
        if not (self.senders and all(s in self.acks for s in self.senders)):
            return None
        low = min(self.acks[s] for s in self.senders)
        if low <= self._trimmed:
            return None
        self._trimmed = low
        d = self.db.run_interaction("trim_federation_outbox", _trim_txn, low, idempotent=True)

        def trimmed(n: int) -> int:
            OUTBOX_ROWS_TRIMMED.inc(n)
            return n

        def failed(f: Any) -> int:
            logger.warning("could not trim the federation outbox: %s", f.getErrorMessage())
            return 0

        return d.addCallbacks(trimmed, failed)


def _trim_txn(txn: Txn, upto: int) -> int:
    txn.execute("DELETE FROM federation_outbox WHERE stream_id <= ?", (upto,))
    return max(txn.rowcount, 0)


class EduFollower:
    """A sender's side: deliver EDUs to owned destinations, acknowledge positions."""

    def __init__(self, handler: ReplicationHandler, sender: FederationSender, instance_name: str,
                 clock: IReactorTime) -> None:
        self.handler = handler
        self.sender = sender
        self.instance_name = instance_name
        self.clock = clock
        self.position = 0
        self.acked = 0
        self._timer: IDelayedCall | None = None
        handler.add_row_handler("federation", self._on_rows)
        handler.add_position_listener("federation", self._on_position)

    def _on_rows(self, instance: str, token: int, rows: list[FederationRow]) -> None:
        for row in rows:
            if self.sender.owns(row.destination):
                self.sender.send_edu(row.destination, Edu(row.edu_type, row.content))

    def _on_position(self, instance: str, token: int) -> None:
        self.position = max(self.position, token)
        if self._timer is None and self.position > self.acked:
            self._timer = self.clock.callLater(ACK_INTERVAL_S, self._ack)

    def _ack(self) -> None:
        self._timer = None
        if self.position > self.acked:
            self.acked = self.position
            self.handler.send_command(FederationAckCommand(self.instance_name, self.acked))

    def stop(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
