"""The worker side: a replication client that reconnects forever.

:class:`ReplicationClientService` keeps one connection to the master's hub
open. A refused connect, or a connection that closes before its handshake
completed, counts as a failure, and the next attempt waits a capped, jittered
exponential backoff (clock and randomness injected). A handshake that
completes (the expected ``SERVER`` arrived) resets the count, so the attempt
after a clean disconnect waits only the initial delay. After each reconnect
the handler sees a new connection and every stream goes through the
POSITION/catch-up path again. It retries until the service is stopped.

(Twisted's ``ClientService`` is not used: it does not survive a connection
lost while its ``prepareConnection`` Deferred is pending, which is exactly a
handshake failing.)

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure

from synflow.backoff import Backoff
from synflow.replication.commands import AnyCommand, PositionCommand, RdataCommand, Side
from synflow.replication.core import DEFAULT_OPTIONS, ConnectionCore, ConnectionOptions
from synflow.replication.interfaces import CommandReceiver, deliver_commands
from synflow.replication.metrics import count_dropped
from synflow.replication.protocol import ReplicationProtocol

logger = logging.getLogger(__name__)

#: Reconnect delays: 0.1 s doubling to 5 s, +/-10 % jitter.
DEFAULT_RECONNECT_BACKOFF = Backoff(initial_s=0.1, multiplier=2.0, max_s=5.0, jitter=0.1)


class _ClientFactory(Factory):
    def __init__(self, service: ReplicationClientService) -> None:
        self.service = service

    def buildProtocol(self, addr: IAddress | None) -> ReplicationProtocol:
        svc = self.service
        core = ConnectionCore(
            Side.CLIENT,
            server_name=svc.server_name,
            instance_name=svc.instance_name,
            options=svc.options,
        )
        proto = ReplicationProtocol(core, svc, svc.clock)
        proto.factory = self
        return proto


class ReplicationClientService(Service):
    """Keeps a worker connected to the master's replication hub.

    Args:
        endpoint: where the hub listens.
        server_name: the server name the hub must announce.
        instance_name: this worker's name, sent in NAME.
        handler: the replication handler (or None).
        clock: the reactor's time.
        backoff: reconnect delays.
        rng: randomness for the jitter.
        options: each connection's keep-alive, congestion limits and secret.
    """

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        *,
        server_name: str,
        instance_name: str,
        handler: CommandReceiver[ReplicationProtocol] | None,
        clock: IReactorTime,
        backoff: Backoff = DEFAULT_RECONNECT_BACKOFF,
        rng: random.Random | None = None,
        options: ConnectionOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.endpoint = endpoint
        self.server_name = server_name
        self.instance_name = instance_name
        self.handler = handler
        self.clock = clock
        self.backoff = backoff
        self.rng = rng or random.Random()
        self.options = options
        self.factory = _ClientFactory(self)
        self.connection: ReplicationProtocol | None = None
        self.failures = 0
        self.dropped_commands = 0
        self.connects = 0
        self._attempt: Deferred[Any] | None = None
        self._retry: IDelayedCall | None = None
        self._stopped: Deferred[None] | None = None

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def retry_call(self) -> IDelayedCall | None:
        """The scheduled next connection attempt, if one is waiting."""
        return self._retry

    # -- Service -------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        self._connect()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        self._retry = None
        if self._attempt is not None:
            self._attempt.cancel()
        if self.connection is None:
            return succeed(None)
        self._stopped = Deferred()
        self.connection.close("worker shutting down")
        return self._stopped

    # -- connecting ------------------------------------------------------------------

    def _connect(self) -> None:
        self._retry = None
        if not self.running:
            return
        d = self._attempt = self.endpoint.connect(self.factory)
        d.addCallbacks(self._connect_succeeded, self._connect_failed)

    def _connect_succeeded(self, proto: ReplicationProtocol) -> None:
        self._attempt = None
        proto.when_handshake_done().addCallbacks(self._handshake_done, lambda _f: None)

    def _connect_failed(self, failure: Failure) -> None:
        self._attempt = None
        if not self.running:
            return
        self.failures += 1
        logger.info(
            "could not connect to the replication hub (%s); attempt %d failed",
            failure.getErrorMessage(), self.failures,
        )
        self._schedule_retry()

    def _handshake_done(self, proto: ReplicationProtocol) -> None:
        self.failures = 0

    def _schedule_retry(self) -> None:
        delay = self.backoff.delay(max(1, self.failures), self.rng)
        self._retry = self.clock.callLater(delay, self._connect)

    # -- sending ---------------------------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        """The hub's server name once connected, else None."""
        return self.connection.peer_name if self.connection is not None else None

    def send_command(self, cmd: AnyCommand) -> None:
        """Send on the current connection; without one, drop it and count it.

        A dropped RDATA or POSITION is repaired by catch-up after the
        reconnect; any other dropped command is logged at warning.
        """
        if self.connection is None:
            self.dropped_commands += 1
            count_dropped(cmd.NAME)
            if isinstance(cmd, RdataCommand | PositionCommand):
                logger.debug("not connected to the replication hub; dropped %s", cmd.NAME)
            else:
                logger.warning("not connected to the replication hub: dropped %s (dropped so far: %d)",
                               cmd.NAME, self.dropped_commands)
            return
        self.connection.send_command(cmd)

    def send_commands(self, cmds: Sequence[AnyCommand]) -> None:
        """:meth:`send_command` for each of ``cmds``, in one call to the connection."""
        if self.connection is None:
            for cmd in cmds:
                self.send_command(cmd)  # dropped and counted, one by one
            return
        self.connection.send_commands(cmds)

    # -- CommandReceiver ---------------------------------------------------------------

    def new_connection(self, conn: ReplicationProtocol) -> None:
        self.connection = conn
        self.connects += 1
        if self.handler is not None:
            self.handler.new_connection(conn)

    def lost_connection(self, conn: ReplicationProtocol, reason: Failure | None = None) -> None:
        if self.connection is conn:
            self.connection = None
        if not conn.core.handshake_complete:
            self.failures += 1
        else:
            self.failures = max(self.failures, 1)
        logger.info("replication connection to %s lost: %s", self.server_name,
                    reason.getErrorMessage() if reason is not None else "no reason given")
        if self.handler is not None:
            self.handler.lost_connection(conn, reason)
        if self._stopped is not None:
            d, self._stopped = self._stopped, None
            d.callback(None)
        if self.running and self._retry is None and self._attempt is None:
            self._schedule_retry()

    def on_command(self, conn: ReplicationProtocol, cmd: AnyCommand) -> None:
        if self.handler is not None:
            self.handler.on_command(conn, cmd)

    def on_commands(self, conn: ReplicationProtocol, cmds: list[AnyCommand]) -> None:
        """Consecutive RDATA and POSITION of one read: to the handler as one list if it takes one."""
        if self.handler is not None:
            deliver_commands(self.handler, conn, cmds)
