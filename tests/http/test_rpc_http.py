"""The internal RPC's HTTP client: the response parser (pure) and the pool over real loopback connections."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import ResponseFailed

from synflow.http.rpc_http import (
    MAX_HEAD_BYTES,
    Response,
    ResponseError,
    ResponseParser,
    RpcHttpPool,
)
from tests.cluster import wait_until

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
CLOSING = b"HTTP/1.1 401 Unauthorized\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
STREAM = OK + CONTINUE + OK + CLOSING


def feed_in_pieces(data: bytes, cuts: list[int]) -> list[Response]:
    parser = ResponseParser()
    out: list[Response] = []
    start = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        out += parser.feed(data[start:cut])
        start = cut
    return out


class ResponseParserTest(SynchronousTestCase):
    def test_responses_in_order(self) -> None:
        """A stream of responses gives each status, body and keep-alive in order, skipping 1xx answers."""
        self.assertEqual(ResponseParser().feed(STREAM), [
            Response(200, b'{"a":1}', True), Response(200, b'{"a":1}', True), Response(401, b"{}", False),
        ])

    @given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
    def test_any_split(self, cuts: list[int]) -> None:
        """The stream cut anywhere (down to one byte at a time) parses the same as fed whole."""
        self.assertEqual(feed_in_pieces(STREAM, cuts), ResponseParser().feed(STREAM))

    def test_one_byte_at_a_time(self) -> None:
        """Fed one byte at a time, the stream gives the same responses."""
        self.assertEqual(feed_in_pieces(STREAM, list(range(len(STREAM)))), ResponseParser().feed(STREAM))

    def test_body_until_close(self) -> None:
        """A response without Content-Length ends when the connection closes, and does not keep it open."""
        parser = ResponseParser()
        self.assertEqual(parser.feed(b"HTTP/1.1 400 Bad Request\r\n\r\npartial"), [])
        self.assertTrue(parser.started)
        self.assertEqual(parser.closed(), Response(400, b"partial", False))
        self.assertIsNone(ResponseParser().closed())

    def test_http_1_0_closes(self) -> None:
        """An HTTP/1.0 answer closes the connection unless it says keep-alive."""
        self.assertFalse(ResponseParser().feed(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")[0].keep_alive)
        self.assertTrue(ResponseParser().feed(
            b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n")[0].keep_alive)

    def test_malformed_heads_refused(self) -> None:
        """Bad status lines and headers, chunked bodies and conflicting or oversized lengths are refused."""
        for head in (b"HTTP/2 200 OK", b"HTTP/1.1 2000 OK", b"HTTP/1.1 abc OK", b"garbage",
                     b"HTTP/1.1 200 OK\r\nno colon", b"HTTP/1.1 200 OK\r\n : empty name",
                     b"HTTP/1.1 200 OK\r\nContent-Length: -1", b"HTTP/1.1 200 OK\r\nContent-Length: 1e3",
                     b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
                     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked"):
            with self.assertRaises(ResponseError, msg=head):
                ResponseParser().feed(head + b"\r\n\r\n")
        with self.assertRaises(ResponseError):
            ResponseParser(max_body_bytes=10).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n")

    def test_head_bounded(self) -> None:
        """A head longer than MAX_HEAD_BYTES is refused before its end arrives."""
        parser = ResponseParser()
        parser.feed(b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * (MAX_HEAD_BYTES - 30))
        with self.assertRaises(ResponseError):
            parser.feed(b"y" * 100)

    def test_body_till_close_bounded(self) -> None:
        """A body read until close may not grow past the body limit."""
        parser = ResponseParser(max_body_bytes=10)
        parser.feed(b"HTTP/1.1 200 OK\r\n\r\n0123456789")
        with self.assertRaises(ResponseError):
            parser.feed(b"x")


class _Server(Protocol):
    """Answers each request (one per write, as the pool sends them) with OK, and counts connections."""

    def __init__(self, factory: _ServerFactory) -> None:
        self.factory = factory

    def connectionMade(self) -> None:
        self.factory.connections.append(self)

    def connectionLost(self, reason: Any = None) -> None:
        self.factory.lost += 1

    def dataReceived(self, data: bytes) -> None:
        self.factory.requests.append(data)
        self.transport.write(self.factory.answer)  # type: ignore[union-attr]


class _ServerFactory(Factory):
    def __init__(self, answer: bytes = OK) -> None:
        self.answer = answer
        self.connections: list[_Server] = []
        self.lost = 0
        self.requests: list[bytes] = []

    def buildProtocol(self, addr: Any) -> _Server:
        return _Server(self)


def request(body: bytes = b"{}") -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class PoolOverTcpTest(TestCase):
    timeout = 10

    def setUp(self) -> None:
        self.factory = _ServerFactory()
        self.port = reactor.listenTCP(0, self.factory, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.pool = RpcHttpPool(reactor)
        self.addCleanup(self.pool.close)
        self.address = ("127.0.0.1", self.port.getHost().port)

    async def test_connection_kept_alive(self) -> None:
        """Sequential requests to one address share one connection."""
        for _ in range(3):
            response = await self.pool.request(*self.address, request())
            self.assertEqual((response.code, response.body), (200, b'{"a":1}'))
        self.assertEqual(len(self.factory.connections), 1)
        self.assertEqual(len(self.factory.requests), 3)

    async def test_concurrent_requests_use_their_own_connections(self) -> None:
        """Requests in flight together each get a connection; afterwards they are kept for reuse."""
        from twisted.internet.defer import gatherResults

        got = await gatherResults([Deferred.fromCoroutine(self.pool.request(*self.address, request()))
                                   for _ in range(3)])
        self.assertEqual([r.code for r in got], [200, 200, 200])
        self.assertEqual(len(self.factory.connections), 3)
        await self.pool.request(*self.address, request())
        self.assertEqual(len(self.factory.connections), 3)

    async def test_closing_answer_closes(self) -> None:
        """An answer with ``Connection: close`` is returned and the next request opens a new connection."""
        self.factory.answer = CLOSING
        self.assertEqual((await self.pool.request(*self.address, request())).code, 401)
        self.factory.answer = OK
        self.assertEqual((await self.pool.request(*self.address, request())).code, 200)
        self.assertEqual(len(self.factory.connections), 2)

    async def test_idle_connection_closed_by_server_is_replaced(self) -> None:
        """A kept-alive connection the server closed is not an error: the request goes on a new connection."""
        await self.pool.request(*self.address, request())
        (server,) = self.factory.connections
        closed: Deferred[None] = Deferred()
        server.connectionLost = lambda reason: closed.callback(None)  # type: ignore[method-assign]
        server.transport.loseConnection()  # type: ignore[union-attr]
        await closed
        self.assertEqual((await self.pool.request(*self.address, request())).code, 200)
        self.assertEqual(len(self.factory.connections), 2)

    async def test_malformed_answer_fails_the_request(self) -> None:
        """An answer that is not HTTP fails the request with ResponseFailed and drops the connection."""
        self.factory.answer = b"SSH-2.0-nope\r\n\r\n"
        with self.assertRaises(ResponseFailed):
            await self.pool.request(*self.address, request())

    async def test_close_closes_every_connection(self) -> None:
        """close() fires once every connection is closed."""
        await self.pool.request(*self.address, request())
        await self.pool.close()
        await Deferred.fromCoroutine(self.pool.request(*self.address, request()))  # a new one after close
        await self.pool.close()
        for _ in range(100):
            if self.factory.lost == 2:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.factory.lost, 2)

    async def test_cancel_drops_the_connection(self) -> None:
        """Cancelling a request in flight (the RPC client's timeout) fails it and closes its connection."""
        from twisted.internet.defer import CancelledError

        self.factory.answer = b""
        d = Deferred.fromCoroutine(self.pool.request(*self.address, request()))
        for _ in range(100):
            if self.factory.requests:
                break
            await deferLater(reactor, 0.01, lambda: None)
        d.cancel()
        with self.assertRaises(CancelledError):
            await d
        for _ in range(100):
            if self.factory.lost == 1:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.factory.lost, 1)

    async def test_request_within_times_out_and_drops_the_connection(self) -> None:
        """No answer within the bound: TimeoutError, and the connection is closed."""
        from twisted.internet.error import TimeoutError

        self.factory.answer = b""
        clock = Clock()
        d = Deferred.fromCoroutine(self.pool.request_within(*self.address, request(), 0.2, clock))
        await wait_until(lambda: self.factory.requests, 5, "the request at the server")
        clock.advance(0.2)
        with self.assertRaises(TimeoutError):
            await d
        await wait_until(lambda: self.factory.lost == 1, 5, "the connection to close")

    async def test_request_within_answered_in_time(self) -> None:
        clock = Clock()
        response = await self.pool.request_within(*self.address, request(), 5.0, clock)
        self.assertEqual((response.code, response.body), (200, b'{"a":1}'))
        self.assertEqual(clock.getDelayedCalls(), [])  # the bound's timer is gone

    async def test_request_within_cancelled_by_the_caller_is_no_timeout(self) -> None:
        """A caller's cancel stays a CancelledError: only the bound's own timer makes a TimeoutError."""
        from twisted.internet.defer import CancelledError

        self.factory.answer = b""
        clock = Clock()
        d = Deferred.fromCoroutine(self.pool.request_within(*self.address, request(), 30.0, clock))
        await wait_until(lambda: self.factory.requests, 5, "the request at the server")
        d.cancel()
        with self.assertRaises(CancelledError):
            await d
        self.assertEqual(clock.getDelayedCalls(), [])
