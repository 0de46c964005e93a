"""The two roles every replication transport plays, named once.

A :class:`Connection` is anything a command can be sent to: one TCP
connection (:class:`~synflow.replication.protocol.ReplicationProtocol`), one
Redis subscription, or a whole transport as the handler sends its own
commands through it (the hub, the worker's client service, the Redis
service).

A :class:`CommandReceiver` is told about connections coming and going and
the commands they deliver: the replication handler, and between a TCP
connection and the handler the hub (on the master) or the client service (on
a worker), which pass everything on. It is generic in the connection it
receives: the hub needs a :class:`ReplicationProtocol` (it closes them), the
handler takes any :class:`Connection`, so the handler can stand wherever a
receiver of TCP connections or of Redis subscriptions is expected.

Two optional methods carry the bulk of the traffic with fewer calls per row:
a connection's ``send_commands(cmds)`` sends a list in order (the writer's
announcements, the hub's relays), and a receiver's ``on_commands(conn,
cmds)`` takes the consecutive RDATA and POSITION of one read as one list
(:func:`deliver_commands`, which falls back to ``on_command`` for each).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeVar

from twisted.python.failure import Failure

from synflow.replication.commands import AnyCommand

__all__ = ["CommandReceiver", "Connection"]

logger = logging.getLogger(__name__)


class Connection(Protocol):
    """Where commands can be sent."""

    @property
    def peer_name(self) -> str | None:
        """Who is at the other end (its NAME or SERVER, the bus, the hub), for logs; None before the handshake."""

    def send_command(self, cmd: AnyCommand) -> None:
        """Send ``cmd`` (or queue it, or drop it while disconnected: the implementer decides)."""


C_contra = TypeVar("C_contra", bound=Connection, contravariant=True)


class CommandReceiver(Protocol[C_contra]):
    """Told about connections coming and going, and the commands they deliver."""

    def new_connection(self, conn: C_contra) -> None:
        """``conn`` is up (on a hub with a secret: authenticated)."""

    def lost_connection(self, conn: C_contra, reason: Failure | None = None) -> None:
        """``conn`` is gone, for ``reason`` when the transport knows it."""

    def on_command(self, conn: C_contra, cmd: AnyCommand) -> None:
        """``conn`` delivered ``cmd``."""


def _check_implementers() -> None:
    """Type checking only: each transport is a :class:`Connection`."""
    from synflow.replication.client import ReplicationClientService
    from synflow.replication.hub import ReplicationHub
    from synflow.replication.protocol import ReplicationProtocol
    from synflow.replication.redis import RedisConnection, RedisTransportService

    connections: list[type[Connection]] = [ReplicationProtocol, ReplicationHub, ReplicationClientService,
                                           RedisConnection, RedisTransportService]
    del connections


def deliver_commands(receiver: CommandReceiver[Any], conn: Any, cmds: list[AnyCommand]) -> None:
    """Consecutive stream commands of one read to ``receiver``: as one list if it takes one, else one by one.

    One by one, a command whose handling fails is logged and the next still
    gets handled.
    """
    many = getattr(receiver, "on_commands", None)
    if many is not None:
        many(conn, cmds)
        return
    for cmd in cmds:
        try:
            receiver.on_command(conn, cmd)
        except Exception:
            logger.exception("error handling %s from %s", cmd.NAME, conn.peer_name)
