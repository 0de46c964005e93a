"""Public test helpers: in-memory pumps and recorders over synflow's real code.

These helpers never replace protocol logic: a pumped connection runs the real
:class:`~synflow.replication.protocol.ReplicationProtocol` and core on both
ends; only the bytes move through memory instead of a socket, on a
deterministic clock. Downstream projects may use them to test their own
stream handlers.

:mod:`synflow.testing.conformance` is the conformance kit: trial mixins
(``StreamConformance``, ``WorkerTypeConformance``) a plugin's tests
subclass to prove its stream or worker type honours the protocol.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from synflow.replication.commands import AnyCommand, Side, parse_line
from synflow.replication.core import DEFAULT_OPTIONS, ConnectionCore, ConnectionOptions
from synflow.replication.protocol import ReplicationProtocol


class RecordingReceiver:
    """A :class:`~synflow.replication.interfaces.CommandReceiver` (of any connection)
    that remembers everything it is told."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, AnyCommand]] = []
        self.made: list[Any] = []
        self.lost: list[Any] = []

    def new_connection(self, conn: Any) -> None:
        self.made.append(conn)

    def lost_connection(self, conn: Any, reason: Failure | None = None) -> None:
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
    options: ConnectionOptions = DEFAULT_OPTIONS,
) -> ReplicationProtocol:
    """A real replication protocol with a fresh core, not yet connected."""
    core = ConnectionCore(
        side,
        server_name=server_name,
        instance_name=instance_name if side is Side.CLIENT else None,
        options=options,
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


# -- an in-memory Redis pub/sub server ---------------------------------------------


class RedisEvent(NamedTuple):
    """One thing the fake Redis server saw or did, in the order it happened.

    ``kind`` is ``"command"`` (``args`` is the command a client sent),
    ``"subscribed"`` (the SUBSCRIBE reply went out: ``args`` is the channel;
    from here on the client receives the channel's messages) or ``"message"``
    (a published message was pushed to the client: ``args`` is the channel
    and the payload).
    """

    label: str | None
    client: int
    kind: str
    args: tuple[bytes, ...]


class FakeRedisProtocol(Protocol):
    """Speaks enough RESP for pub/sub replication: AUTH, SELECT, PING, SUBSCRIBE,
    UNSUBSCRIBE, PUBLISH, QUIT. Anything else gets an error reply.

    Args:
        server: the server this connection belongs to.
        label: names the process this client belongs to, in the event log.
    """

    transport: Any

    def __init__(self, server: FakeRedisServer, label: str | None = None) -> None:
        self.server = server
        self.label = label
        self.id = server.next_client_id()
        self.buffer = b""
        self.authed = server.password is None
        self.channels: set[bytes] = set()
        self._waiting = False

    def connectionMade(self) -> None:
        self.server.clients.add(self)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.server.clients.discard(self)

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        self._drain()

    def _drain(self) -> None:
        # Like Redis, one client's commands are answered in order: while a
        # (delayed) SUBSCRIBE is pending, the rest of the buffer waits.
        while not self._waiting:
            parsed = _parse_resp(self.buffer)
            if parsed is None:
                return
            command, self.buffer = parsed
            self._handle([c for c in command])

    def _reply(self, value: Any) -> None:
        self.transport.write(_encode_resp(value))

    def _record(self, kind: str, args: list[bytes]) -> None:
        self.server.events.append(RedisEvent(self.label, self.id, kind, tuple(args)))

    def _subscribe(self, channels: list[bytes]) -> None:
        self._waiting = False
        if self.transport.disconnecting or getattr(self.transport, "closed", False):
            return
        for channel in channels:
            self.channels.add(channel)
            self._record("subscribed", [channel])
            self._reply([b"subscribe", channel, len(self.channels)])
        self._drain()

    def _handle(self, args: list[bytes]) -> None:
        name = args[0].upper() if args else b""
        self.server.commands.append(name.decode())
        self._record("command", args)
        if name == b"AUTH":
            if self.server.password is not None and args[-1].decode() == self.server.password:
                self.authed = True
                self._reply(_Simple(b"OK"))
            else:
                self._reply(_Error(b"WRONGPASS invalid username-password pair or user is disabled."))
            return
        if not self.authed:
            self._reply(_Error(b"NOAUTH Authentication required."))
            return
        if name == b"SELECT" or name == b"CLIENT":
            self._reply(_Simple(b"OK"))
        elif name == b"PING":
            self._reply(_Simple(b"PONG"))
        elif name == b"SUBSCRIBE":
            if self.server.subscribe_delay_s:
                self._waiting = True
                self.transport.reactor.callLater(self.server.subscribe_delay_s, self._subscribe, args[1:])
            else:
                self._subscribe(args[1:])
        elif name == b"UNSUBSCRIBE":
            for channel in args[1:]:
                self.channels.discard(channel)
                self._reply([b"unsubscribe", channel, len(self.channels)])
        elif name == b"PUBLISH":
            channel, message = args[1], args[2]
            receivers = [c for c in list(self.server.clients) if channel in c.channels]
            for client in receivers:
                client._record("message", [channel, message])
                client._reply([b"message", channel, message])
            self._reply(len(receivers))
        elif name == b"QUIT":
            self._reply(_Simple(b"OK"))
            self.transport.loseConnection()
        else:
            self._reply(_Error(b"ERR unknown command '" + name + b"'"))


class _Simple(bytes):
    pass


class _Error(bytes):
    pass


def _encode_resp(value: Any) -> bytes:
    if isinstance(value, _Simple):
        return b"+" + value + b"\r\n"
    if isinstance(value, _Error):
        return b"-" + value + b"\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(_encode_resp(v) for v in value)
    raise TypeError(value)


def _parse_resp(data: bytes) -> tuple[list[bytes], bytes] | None:
    """One command (an array of bulk strings, or an inline command) off the buffer."""
    if not data:
        return None
    if not data.startswith(b"*"):
        line, sep, rest = data.partition(b"\r\n")
        return (line.split(), rest) if sep else None
    head, sep, rest = data.partition(b"\r\n")
    if not sep:
        return None
    count = int(head[1:])
    items = []
    for _ in range(count):
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return None
        size = int(size_line[1:])
        if len(rest) < size + 2:
            return None
        items.append(rest[:size])
        rest = rest[size + 2:]
    return items, rest


class FakeRedisServer(Factory):
    """An in-memory Redis pub/sub server for the in-process test layer.

    Connect to it with :meth:`endpoint`; :meth:`kill_clients` drops every
    connection, as ``CLIENT KILL`` would. Everything each client sends, every
    subscription confirmed and every message pushed is appended to
    :attr:`events`, in order, tagged with the endpoint's label.

    Args:
        password: require AUTH with this password.
        subscribe_delay_s: confirm (and apply) each SUBSCRIBE only after this
            long, as a busy server might; a client that publishes before the
            confirmation arrives is then visibly early in :attr:`events`.
    """

    def __init__(self, password: str | None = None, *, subscribe_delay_s: float = 0.0) -> None:
        self.password = password
        self.subscribe_delay_s = subscribe_delay_s
        self.clients: set[FakeRedisProtocol] = set()
        #: The name of every command received, in order (any client).
        self.commands: list[str] = []
        #: What every client did and was sent, in order.
        self.events: list[RedisEvent] = []
        self._client_ids = iter(range(1, 1_000_000))

    def next_client_id(self) -> int:
        """A fresh number for a new client connection."""
        return next(self._client_ids)

    def buildProtocol(self, addr: Any) -> FakeRedisProtocol:
        return FakeRedisProtocol(self)

    def endpoint(self, label: str | None = None) -> MemoryEndpoint:
        """A client endpoint to this server; its connections carry ``label`` in :attr:`events`."""
        return MemoryEndpoint(_LabelledClients(self, label))

    def events_of(self, label: str) -> list[RedisEvent]:
        """The events of the clients connected through ``endpoint(label)``."""
        return [e for e in self.events if e.label == label]

    def published(self, label: str) -> list[bytes]:
        """The payloads published by the clients of ``label``, in order."""
        return [e.args[2] for e in self.events_of(label) if e.kind == "command" and e.args[0].upper() == b"PUBLISH"]

    def kill_clients(self, *, immediately: bool = False) -> int:
        """Drop every client connection; returns how many.

        Args:
            immediately: close them now, before anything else queued on the
                reactor runs, rather than on the next reactor turn.
        """
        clients = list(self.clients)
        for client in clients:
            client.transport.loseConnection()
            if immediately:
                client.transport.close_now()
        return len(clients)


class _LabelledClients(Factory):
    """Builds server-side connections of a FakeRedisServer that carry a label."""

    def __init__(self, server: FakeRedisServer, label: str | None) -> None:
        self.server = server
        self.label = label

    def buildProtocol(self, addr: Any) -> FakeRedisProtocol:
        return FakeRedisProtocol(self.server, self.label)


class _MemoryTransport:
    """One end of an in-memory connection; writes reach the peer on the next reactor turn."""

    disconnecting = False

    def __init__(self, reactor: Any, protocol: Any, port: int) -> None:
        self.reactor = reactor
        self.protocol = protocol
        self.peer: _MemoryTransport | None = None
        self.port = port
        self._buffer: list[bytes] = []
        self._scheduled = False
        self.closed = False
        self.producer: Any = None

    def write(self, data: bytes) -> None:
        if self.closed or self.disconnecting or not data:
            return
        self._buffer.append(data)
        if not self._scheduled:
            self._scheduled = True
            self.reactor.callLater(0, self._deliver)

    def writeSequence(self, data: Any) -> None:
        for chunk in data:
            self.write(chunk)

    def _deliver(self) -> None:
        self._scheduled = False
        data, self._buffer = b"".join(self._buffer), []
        peer = self.peer
        if data and peer is not None and not peer.closed:
            peer.protocol.dataReceived(data)
        if self.disconnecting:
            self._close()

    def loseConnection(self) -> None:
        if self.closed or self.disconnecting:
            return
        self.disconnecting = True
        if not self._scheduled:
            self._scheduled = True
            self.reactor.callLater(0, self._deliver)

    abortConnection = loseConnection

    def close_now(self) -> None:
        """Close both ends at once, dropping anything not yet delivered."""
        self._buffer = []
        self._close()

    def _close(self) -> None:
        from twisted.internet.error import ConnectionDone

        for end in (self, self.peer):
            if end is not None and not end.closed:
                end.closed = True
                end.protocol.connectionLost(Failure(ConnectionDone("memory connection closed")))

    def getPeer(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", self.peer.port if self.peer else 0)

    def getHost(self) -> IPv4Address:
        return IPv4Address("TCP", "127.0.0.1", self.port)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        self.loseConnection()

    def setTcpNoDelay(self, enabled: bool) -> None:
        pass

    def setTcpKeepAlive(self, enabled: bool) -> None:
        pass


@implementer(IStreamClientEndpoint)
class MemoryEndpoint:
    """A client endpoint whose connections go to a server factory in memory.

    Both ends run their real protocol code; bytes cross on the next turn of
    the running reactor.
    """

    def __init__(self, server_factory: Factory, reactor: Any = None) -> None:
        self.server_factory = server_factory
        self.reactor = reactor
        self.refuse = False
        self._ports = iter(range(50000, 60000))

    def connect(self, factory: Any) -> Any:
        from twisted.internet.defer import fail, succeed
        from twisted.internet.error import ConnectionRefusedError

        if self.refuse:
            return fail(ConnectionRefusedError("memory endpoint refusing"))
        if self.reactor is None:
            from twisted.internet import reactor as global_reactor

            self.reactor = global_reactor
        addr = IPv4Address("TCP", "127.0.0.1", 6379)
        client = factory.buildProtocol(addr)
        server: Any = self.server_factory.buildProtocol(addr)
        ct = _MemoryTransport(self.reactor, client, next(self._ports))
        st = _MemoryTransport(self.reactor, server, 6379)
        ct.peer, st.peer = st, ct
        server.makeConnection(st)
        client.makeConnection(ct)
        return succeed(client)
