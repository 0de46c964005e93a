"""The TCP replication hub that the master runs.

Every worker connects to the master's replication port. The hub relays each
stream command it receives from one connection to every other connection,
and hands every command to the master's own handler, so writers on
different workers see each other exactly as they would over Redis.
``REPLICATE`` is relayed too, so every writer answers it with its POSITIONs.
Connection-level commands (SERVER, NAME, PING, ERROR) are never relayed, and
commands addressed to the master alone (USER_SYNC, CLEAR_USER_SYNC,
FEDERATION_ACK) are handled by the master and not relayed.

With a secret (every deployment has one by default), a connection joins the
hub only after its ``AUTH``: before that nothing is relayed to it, and the
only line it may send is ``AUTH`` (see ``core.py``). What an authenticated
peer claims about stream positions is still checked, by every process's
handler, against the database (``guard.py``).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.python.failure import Failure

from synflow.replication.commands import (
    AnyCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    Side,
)
from synflow.replication.core import DEFAULT_OPTIONS, ConnectionCore, ConnectionOptions
from synflow.replication.interfaces import CommandReceiver, deliver_commands
from synflow.replication.protocol import ReplicationProtocol

logger = logging.getLogger(__name__)

#: The commands the hub forwards from one connection to all the others.
RELAYED_COMMANDS: Final = (RdataCommand, PositionCommand, ReplicateCommand, RemoteServerUpCommand)


class ReplicationHub:
    """Relays commands between worker connections and feeds the master's handler.

    Args:
        handler: the master's command handler, or None for a relay-only hub.
    """

    def __init__(self, handler: CommandReceiver[ReplicationProtocol] | None = None) -> None:
        self.handler = handler
        self.connections: list[ReplicationProtocol] = []
        self.relayed = 0

    # -- CommandReceiver -----------------------------------------------------------

    def new_connection(self, conn: ReplicationProtocol) -> None:
        self.connections.append(conn)
        if self.handler is not None:
            self.handler.new_connection(conn)

    def lost_connection(self, conn: ReplicationProtocol, reason: Failure | None = None) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        logger.info("replication connection from %s closed: %s", conn.peer_name,
                    reason.getErrorMessage() if reason is not None else "no reason given")
        if self.handler is not None:
            self.handler.lost_connection(conn, reason)

    def on_command(self, conn: ReplicationProtocol, cmd: AnyCommand) -> None:
        if isinstance(cmd, RELAYED_COMMANDS):
            for other in self.connections:
                if other is not conn:
                    try:  # _send, inlined: once per line per connection
                        other.send_command(cmd)
                    except Exception:
                        logger.exception("failed to send %s to %s", cmd.NAME, other.peer_name)
                    self.relayed += 1
        if self.handler is not None:
            self.handler.on_command(conn, cmd)

    def on_commands(self, conn: ReplicationProtocol, cmds: list[AnyCommand]) -> None:
        """Consecutive stream commands (RDATA, POSITION) of one read: relayed as one list per connection."""
        relayed = [cmd for cmd in cmds if isinstance(cmd, RELAYED_COMMANDS)]
        if relayed:
            for other in self.connections:
                if other is not conn:
                    try:
                        other.send_commands(relayed)
                    except Exception:
                        logger.exception("failed to relay %d commands to %s", len(relayed), other.peer_name)
                    self.relayed += len(relayed)
        if self.handler is not None:
            deliver_commands(self.handler, conn, cmds)

    # -- the master's own sends ------------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        """Every connected worker (the hub relays to all of them)."""
        return "every worker"

    def send_command(self, cmd: AnyCommand) -> None:
        """Send a command of the master's to every connected worker."""
        for conn in list(self.connections):
            self._send(conn, cmd)

    def send_commands(self, cmds: Sequence[AnyCommand]) -> None:
        """:meth:`send_command` for each of ``cmds``: the list to each worker in one call."""
        for conn in list(self.connections):
            try:
                conn.send_commands(cmds)
            except Exception:
                logger.exception("failed to send %d commands to %s", len(cmds), conn.peer_name)

    def close_all(self, reason: str) -> None:
        """Tell every worker why and close its connection (on shutdown)."""
        for conn in list(self.connections):
            conn.close(reason)

    @property
    def connected(self) -> bool:
        """The hub is always "connected": the master is the centre of the star."""
        return True

    def _send(self, conn: ReplicationProtocol, cmd: AnyCommand) -> None:
        try:
            conn.send_command(cmd)
        except Exception:
            logger.exception("failed to send %s to %s", cmd.NAME, conn.peer_name)


class ReplicationServerFactory(ServerFactory):
    """Builds the server side of replication connections for the hub.

    Args:
        hub: where connections and commands go.
        server_name: sent in SERVER to every client.
        clock: the reactor's time.
        options: each connection's keep-alive, congestion limits and secret.
    """

    def __init__(
        self,
        hub: ReplicationHub,
        server_name: str,
        clock: IReactorTime,
        options: ConnectionOptions = DEFAULT_OPTIONS,
    ) -> None:
        self.hub = hub
        self.server_name = server_name
        self.clock = clock
        self.options = options

    def buildProtocol(self, addr: IAddress | None) -> ReplicationProtocol:
        core = ConnectionCore(Side.SERVER, server_name=self.server_name, options=self.options)
        proto = ReplicationProtocol(core, self.hub, self.clock)
        proto.factory = self
        return proto
