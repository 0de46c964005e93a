"""The internal RPC's HTTP/1.1 client: kept-alive connections, one request at a time on each.

twisted.web's ``Agent`` builds a URI, a ``Headers``, a body producer, a
request and a response object for every call, and its pool and parser pass
each answer through several Deferreds: on the path of every event (the
process that took it calling the room's persister) that cost more CPU than
the call. The internal RPC needs far less: a POST with a JSON body to a
process of the same deployment, whose answers always carry a
``Content-Length`` (:func:`synflow.http.server.respond_json`).

* :class:`ResponseParser` is the sans-IO core: bytes in, complete responses
  out, every field of the head bounded.
* :class:`RpcConnection` is the thin protocol over it; :class:`RpcHttpPool`
  keeps up to :data:`MAX_IDLE_PER_ADDRESS` idle connections per address,
  with Nagle's algorithm off. A request that fails on a kept-alive
  connection before any byte of the answer arrived (the server had closed
  it) is sent once more on a new one: the RPC's ``txn_id`` makes that safe.

A connection that breaks, or an answer that is not HTTP as described here,
fails the request with :class:`twisted.web.client.ResponseFailed`, which the
RPC client retries.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any, Final, cast

import attrs
from twisted.internet.defer import CancelledError, Deferred, DeferredList
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionDone, TimeoutError
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from synflow.http.server import no_delay
from synflow.tcp_write import write_now

#: The longest response head (status line and headers) accepted.
MAX_HEAD_BYTES: Final = 16 * 1024
#: The largest response body accepted (a persist_events answer for 500 events is ≈100 kB).
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
#: Idle connections kept per address (as many as the RPC client's callers overlap, at most).
MAX_IDLE_PER_ADDRESS: Final = 8


class ResponseError(Exception):
    """An answer that is not an HTTP/1.1 response this client reads (the message says what was wrong)."""


@attrs.frozen
class Response:
    """One complete answer: its status, its body, and whether the connection stays open after it."""

    code: int
    body: bytes
    keep_alive: bool


class ResponseParser:
    """Splits a connection's bytes into responses (sans-IO: no transport, no reactor).

    Takes input from another process: every field of the head is checked
    and bounded (:data:`MAX_HEAD_BYTES`, :data:`MAX_BODY_BYTES`).
    """

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self._buffer = b""
        #: The head of the response whose body is being read: (code, length or None till close, keep-alive).
        self._head: tuple[int, int | None, bool] | None = None

    @property
    def started(self) -> bool:
        """Whether any byte of a response not yet complete has arrived."""
        return bool(self._buffer) or self._head is not None

    def feed(self, data: bytes) -> list[Response]:
        """The responses ``data`` completes, in order.

        Raises:
            ResponseError: the bytes are not a response this parser reads.
        """
        self._buffer += data
        done: list[Response] = []
        while True:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEAD_BYTES:
                        raise ResponseError(f"response head longer than {MAX_HEAD_BYTES} bytes")
                    return done
                if end > MAX_HEAD_BYTES:
                    raise ResponseError(f"response head longer than {MAX_HEAD_BYTES} bytes")
                self._head = parse_head(self._buffer[:end], self.max_body_bytes)
                self._buffer = self._buffer[end + 4:]
            code, length, keep_alive = self._head
            if length is None:
                if len(self._buffer) > self.max_body_bytes:
                    raise ResponseError(f"response body larger than {self.max_body_bytes} bytes")
                return done  # read until the connection closes
            if len(self._buffer) < length:
                return done
            body, self._buffer = self._buffer[:length], self._buffer[length:]
            self._head = None
            if code >= 200:  # a 1xx answer is followed by the real one
                done.append(Response(code, body, keep_alive))

    def closed(self) -> Response | None:
        """The response the connection's close completes (one whose body runs till close), or None."""
        if self._head is not None and self._head[1] is None:
            code = self._head[0]
            self._head, body, self._buffer = None, self._buffer, b""
            return Response(code, body, False)
        return None


def parse_head(head: bytes, max_body_bytes: int = MAX_BODY_BYTES) -> tuple[int, int | None, bool]:
    """A response head's status, body length (None: until the connection closes) and keep-alive.

    Raises:
        ResponseError: a malformed status line or header, a chunked body, a
            length over ``max_body_bytes`` or two different lengths.
    """
    status, *lines = head.split(b"\r\n")
    parts = status.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(parts[1]) != 3 or not parts[1].isdigit():
        raise ResponseError(f"bad status line {status[:80]!r}")
    code = int(parts[1])
    keep_alive = parts[0] == b"HTTP/1.1"
    length: int | None = None
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise ResponseError(f"bad header line {line[:80]!r}")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or len(value) > 12:
                raise ResponseError(f"bad Content-Length {value[:20]!r}")
            if length is not None and int(value) != length:
                raise ResponseError("two different Content-Length headers")
            length = int(value)
            if length > max_body_bytes:
                raise ResponseError(f"response body of {length} bytes is larger than {max_body_bytes}")
        elif name == b"transfer-encoding" and value.lower() != b"identity":
            raise ResponseError(f"unsupported Transfer-Encoding {value[:20]!r}")
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    if code < 200 or code in (204, 304):
        length = 0
    if length is None:
        keep_alive = False
    return code, length, keep_alive


class RpcConnection(Protocol):
    """One connection to a process's internal listener; one request at a time."""

    def __init__(self, pool: RpcHttpPool, address: tuple[str, int]) -> None:
        self.pool = pool
        self.address = address
        self.parser = ResponseParser()
        self.open = False
        self._waiting: Deferred[Response] | None = None
        self._lost: list[Deferred[None]] = []

    def connectionMade(self) -> None:
        self.open = True
        no_delay(self.transport)

    def request(self, data: bytes) -> Deferred[Response]:
        """Send one whole request; the Deferred fires with its response (cancelling it drops the connection)."""
        assert self._waiting is None, "one request at a time"

        def cancel(_: Deferred[Response]) -> None:
            self._waiting = None
            self._abort()

        d: Deferred[Response] = Deferred(cancel)
        self._waiting = d
        write_now(self.transport, data)
        return d

    def dataReceived(self, data: bytes) -> None:
        try:
            responses = self.parser.feed(data)
        except ResponseError as e:
            self._fail(Failure(e))
            self._abort()
            return
        for response in responses:
            d, self._waiting = self._waiting, None
            if d is None:  # an answer nobody asked for: the connection is out of step
                self._abort()
                return
            if response.keep_alive:
                self.pool.release(self)
            else:
                self.open = False
                self.transport.loseConnection()  # type: ignore[union-attr]
            d.callback(response)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:  # noqa: B008 - Twisted's default
        self.open = False
        self.pool.forget(self)
        last = self.parser.closed()
        d, self._waiting = self._waiting, None
        if d is not None:
            if last is not None:
                d.callback(last)
            else:
                d.errback(Failure(ResponseFailed([reason])))
        lost, self._lost = self._lost, []
        for w in lost:
            w.callback(None)

    def _abort(self) -> None:
        cast(ITCPTransport, self.transport).abortConnection()

    def _fail(self, failure: Failure) -> None:
        d, self._waiting = self._waiting, None
        if d is not None:
            d.errback(Failure(ResponseFailed([failure])))

    def when_lost(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self._lost.append(d)
        return d


class RpcHttpPool:
    """Kept-alive connections to the deployment's internal listeners.

    Args:
        reactor: connects (``IReactorTCP``).
        max_idle_per_address: idle connections kept per address.
    """

    def __init__(self, reactor: Any, max_idle_per_address: int = MAX_IDLE_PER_ADDRESS) -> None:
        self.reactor = reactor
        self.max_idle_per_address = max_idle_per_address
        self._idle: dict[tuple[str, int], list[RpcConnection]] = {}
        self._all: set[RpcConnection] = set()

    async def request(self, host: str, port: int, data: bytes) -> Response:
        """Send ``data`` (a whole HTTP/1.1 request) to ``host:port`` and return the response.

        Raises:
            ResponseFailed: the connection broke or the answer was malformed.
            ConnectError: no connection could be made.
        """
        address = (host, port)
        idle = self._idle.get(address)
        while idle:
            conn = idle.pop()
            if not conn.open:
                continue
            try:
                return await conn.request(data)
            except ResponseFailed:
                if conn.parser.started:
                    raise
                break  # closed by the server while idle: once more on a new connection
        conn = await self._connect(address)
        return await conn.request(data)

    async def request_within(self, host: str, port: int, data: bytes, timeout_s: float, clock: Any) -> Response:
        """:meth:`request`, bounded: the whole exchange, body included, within ``timeout_s`` on ``clock``.

        Raises:
            TimeoutError: no complete answer in time (the connection is dropped).
            CancelledError: the caller cancelled it before then.
        """
        d = Deferred.fromCoroutine(self.request(host, port, data))
        timer = clock.callLater(timeout_s, d.cancel)
        try:
            return await d
        except CancelledError:
            if not timer.active():
                raise TimeoutError(f"no answer within {timeout_s}s") from None
            raise
        finally:
            if timer.active():
                timer.cancel()

    async def _connect(self, address: tuple[str, int]) -> RpcConnection:
        endpoint = TCP4ClientEndpoint(self.reactor, address[0], address[1])
        conn = await endpoint.connect(Factory.forProtocol(lambda: RpcConnection(self, address)))
        assert isinstance(conn, RpcConnection)
        self._all.add(conn)
        return conn

    def release(self, conn: RpcConnection) -> None:
        """``conn`` answered and stays open: keep it for the next request, if there is room."""
        idle = self._idle.setdefault(conn.address, [])
        if len(idle) < self.max_idle_per_address:
            idle.append(conn)
        else:
            conn.open = False
            conn.transport.loseConnection()  # type: ignore[union-attr]

    def forget(self, conn: RpcConnection) -> None:
        """``conn`` closed."""
        self._all.discard(conn)
        idle = self._idle.get(conn.address)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> Deferred[None]:
        """Close every connection; fires once all are closed (an in-flight request fails)."""
        conns = list(self._all)
        self._idle.clear()
        waits = [conn.when_lost() for conn in conns]
        for conn in conns:
            conn.open = False
            conn.transport.loseConnection()  # type: ignore[union-attr]
        return DeferredList(waits).addCallback(lambda _: None)
