"""Public test helpers: in-memory pumps and recorders over synflow's real code.

These helpers never replace protocol logic: a pumped connection runs the real
:class:`~synflow.replication.protocol.ReplicationProtocol` and core on both
ends; only the bytes move through memory instead of a socket, on a
deterministic clock. Downstream projects may use them to test their own
stream handlers.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IReactorTime
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from synflow.replication.commands import AnyCommand, Side, parse_line
from synflow.replication.core import ConnectionCore
from synflow.replication.protocol import ReplicationProtocol


class RecordingReceiver:
    """A command receiver/handler that remembers everything it is told.

    It implements both the adapter-level ``CommandReceiver`` interface
    (``connection_made``/``connection_lost``/``on_command``) and the
    handler-level one (``new_connection``/``lost_connection``/``on_command``).
    """

    def __init__(self) -> None:
        self.commands: list[tuple[Any, AnyCommand]] = []
        self.made: list[Any] = []
        self.lost: list[Any] = []

    def connection_made(self, conn: Any) -> None:
        self.made.append(conn)

    def connection_lost(self, conn: Any, reason: Failure | None = None) -> None:
        self.lost.append(conn)

    new_connection = connection_made

    def lost_connection(self, conn: Any) -> None:
        self.lost.append(conn)

    def on_command(self, conn: Any, cmd: AnyCommand) -> None:
        self.commands.append((conn, cmd))

    def received(self, kind: type | None = None) -> list[AnyCommand]:
        """The commands received so far, optionally only those of one class."""
        return [c for _, c in self.commands if kind is None or isinstance(c, kind)]


class PumpTransport(StringTransport):
    """A StringTransport that remembers whether it was asked to close."""

    def __init__(self, peer_port: int) -> None:
        super().__init__(
            hostAddress=IPv4Address("TCP", "127.0.0.1", 9092),
            peerAddress=IPv4Address("TCP", "127.0.0.1", peer_port),
        )
        self.aborted = False

    def abortConnection(self) -> None:
        self.aborted = True
        self.loseConnection()


def make_protocol(
    side: Side,
    receiver: Any,
    clock: IReactorTime,
    *,
    server_name: str = "test.server",
    instance_name: str = "worker1",
    **core_options: Any,
) -> ReplicationProtocol:
    """A real replication protocol with a fresh core, not yet connected."""
    core = ConnectionCore(
        side,
        server_name=server_name,
        instance_name=instance_name if side is Side.CLIENT else None,
        **core_options,
    )
    return ReplicationProtocol(core, receiver, clock)


def attach(proto: ReplicationProtocol, peer_port: int = 40000) -> PumpTransport:
    """Connect a protocol to a fresh in-memory transport and return the transport."""
    transport = PumpTransport(peer_port)
    proto.makeConnection(transport)
    return transport


def sent_lines(transport: StringTransport, *, clear: bool = True) -> list[str]:
    """The lines written to a transport (decoded, without newlines)."""
    data = transport.value()
    if clear:
        transport.clear()
    if not data:
        return []
    assert data.endswith(b"\n"), f"partial line written: {data[-80:]!r}"
    return [line.decode("utf-8") for line in data.split(b"\n")[:-1]]


def sent_commands(transport: StringTransport, *, clear: bool = True) -> list[AnyCommand]:
    """The commands written to a transport, parsed."""
    return [parse_line(line) for line in sent_lines(transport, clear=clear)]


class Pump:
    """Two real protocols joined back to back in memory.

    Call :meth:`flush` to move every written byte across until both sides are
    quiet. A closed side stops receiving, and the peer sees the loss.
    """

    def __init__(self, server: ReplicationProtocol, client: ReplicationProtocol) -> None:
        self.server = server
        self.client = client
        self.server_transport = attach(server, 40001)
        self.client_transport = attach(client, 40002)
        self.closed = False

    def flush(self, max_rounds: int = 10_000) -> None:
        """Deliver bytes both ways until neither side writes anything more."""
        for _ in range(max_rounds):
            moved = False
            for src, dst in (
                (self.server_transport, self.client),
                (self.client_transport, self.server),
            ):
                data = src.value()
                if data:
                    src.clear()
                    moved = True
                    if not self.closed:
                        dst.dataReceived(data)
            if self._check_closed():
                return
            if not moved:
                return
        raise AssertionError("pump did not settle: the two sides keep talking")

    def _check_closed(self) -> bool:
        if self.closed:
            return True
        if self.server_transport.disconnecting or self.client_transport.disconnecting:
            # Deliver what was written before the close, then tear both down.
            for src, dst in (
                (self.server_transport, self.client),
                (self.client_transport, self.server),
            ):
                data = src.value()
                if data:
                    src.clear()
                    dst.dataReceived(data)
            self.disconnect()
            return True
        return False

    def disconnect(self) -> None:
        """Drop the link: both sides see connectionLost."""
        if self.closed:
            return
        self.closed = True
        from twisted.internet.error import ConnectionDone

        for proto in (self.server, self.client):
            proto.connectionLost(Failure(ConnectionDone("pump disconnected")))
