"""``write_now``: bytes go to the socket at once when nothing is queued, in order and whole otherwise."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.tcp_write import write_now


class _Sink(Protocol):
    """Collects what arrives; ``done`` fires once ``expected`` bytes have."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.received = bytearray()
        self.done: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if len(self.received) >= self.expected and not self.done.called:
            self.done.callback(bytes(self.received))


class _Writer(Protocol):
    def __init__(self) -> None:
        self.connected_d: Deferred[None] = Deferred()
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.connected_d.callback(None)

    def connectionLost(self, reason: Any = None) -> None:
        self.lost.callback(None)


class WriteNowTest(TestCase):
    async def _pair(self, expected: int) -> tuple[_Writer, _Sink]:
        sink = _Sink(expected)
        port = reactor.listenTCP(0, Factory.forProtocol(lambda: sink), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        writer = _Writer()
        factory = ClientFactory.forProtocol(lambda: writer)
        connector = reactor.connectTCP("127.0.0.1", port.getHost().port, factory)
        self.addCleanup(connector.disconnect)
        await writer.connected_d
        return writer, sink

    async def test_nothing_queued_goes_to_the_socket_at_once(self) -> None:
        """With nothing unsent, the bytes leave in the call: the transport queues nothing and is not waiting
        to write. (This also reads the transport's buffer attributes ``write_now`` reads: a Twisted that
        renamed them, where ``write_now`` falls back to ``transport.write``, fails here.)"""
        writer, sink = await self._pair(5)
        transport: Any = writer.transport
        write_now(transport, b"hello")
        self.assertEqual((transport.dataBuffer[transport.offset:], transport._tempDataBuffer), (b"", []))
        self.assertNotIn(transport, reactor.getWriters())
        self.assertEqual(await sink.done, b"hello")

    async def test_behind_queued_bytes_it_queues_in_order(self) -> None:
        """Bytes written behind others still queued wait their turn: they arrive after them."""
        writer, sink = await self._pair(6)
        transport: Any = writer.transport
        transport.write(b"abc")  # queued until the reactor's next pass
        write_now(transport, b"def")
        self.assertEqual(transport._tempDataBuffer, [b"abc", b"def"])
        self.assertEqual(await sink.done, b"abcdef")

    async def test_what_the_socket_does_not_take_is_queued(self) -> None:
        """More than the socket's buffer takes: the rest is queued, and every byte arrives in order."""
        data = bytes(range(256)) * (16 * 1024)  # 4 MiB
        writer, sink = await self._pair(len(data))
        transport: Any = writer.transport
        write_now(transport, data)
        self.assertGreater(len(transport._tempDataBuffer), 0)
        self.assertLess(transport._tempDataLen, len(data))  # part of it went at once
        self.assertEqual(await sink.done, data)

    async def test_bytes_written_while_closing_arrive_before_the_close(self) -> None:
        """After ``loseConnection``, bytes written (nothing queued, or behind queued ones) still arrive, in order,
        and then the connection closes."""
        for queued in (b"", b"x"):
            writer, sink = await self._pair(len(queued) + 7)
            transport: Any = writer.transport
            transport.write(queued)
            transport.loseConnection()
            write_now(transport, b"closing")
            self.assertEqual(await sink.done, queued + b"closing")
            await writer.lost

    async def test_a_broken_connection_is_reported_by_the_transport(self) -> None:
        """Writing to a connection the peer reset raises nothing here: the transport reports it lost."""
        writer, sink = await self._pair(1)
        sink.transport.abortConnection()
        transport: Any = writer.transport
        for _ in range(50):  # until the reset is seen (the first send after an abort may still succeed)
            if writer.lost.called:
                break
            write_now(transport, b"after the reset")
            d: Deferred[None] = Deferred()
            reactor.callLater(0.01, d.callback, None)
            await d
        await writer.lost


class OtherTransportTest(SynchronousTestCase):
    def test_another_transport_gets_write(self) -> None:
        """A transport that is not plain TCP (a test transport, TLS) gets the bytes through its ``write``."""
        transport = StringTransport()
        write_now(transport, b"via write")
        self.assertEqual(transport.value(), b"via write")
