"""The tools' client (``synflow.tools.client``) and the workload's start, against a small loopback HTTP server."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import TimeoutError
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from synflow.tools import client
from synflow.tools.client import PREFIX, ApiError, Client, ClientPool, new_pool, retry_delay_s
from synflow.tools.workload import UserState, Workload


class _Echo(Resource):
    """Answers every request with what it received; ``/hang`` never answers, ``/fail`` answers 403,
    ``/sync`` answers a sync (users in ``hang_sync`` never get one)."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.hang_sync: set[bytes] = set()
        self.held: list[Any] = []

    def render(self, request: Any) -> Any:
        path = request.path.decode()
        auth = request.getHeader(b"authorization") or b""
        if path.endswith("/hang") or (path.endswith("/sync") and auth.split(b" ")[-1] in self.hang_sync):
            self.held.append(request)
            return NOT_DONE_YET
        request.setHeader(b"content-type", b"application/json")
        if path.endswith("/fail"):
            request.setResponseCode(403)
            return json.dumps({"errcode": "M_FORBIDDEN", "error": "no"}).encode()
        if path.endswith("/sync"):
            return json.dumps({"events": [], "next_batch": "s1"}).encode()
        return json.dumps({
            "method": request.method.decode(), "uri": request.uri.decode(), "body": request.content.read().decode(),
            "host": (request.getHeader(b"host") or b"").decode(), "auth": auth.decode(),
            "type": (request.getHeader(b"content-type") or b"").decode(),
            "x": (request.getHeader(b"x-test") or b"").decode(),
        }).encode()


class _CountingSite(Site):
    """Counts the connections made and can close every one still open."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource)
        self.connections = 0
        self.open: dict[Any, Deferred[None]] = {}

    def buildProtocol(self, addr: Any) -> Any:
        self.connections += 1
        protocol = super().buildProtocol(addr)
        lost: Deferred[None] = Deferred()
        self.open[protocol] = lost
        original = protocol.connectionLost

        def connection_lost(reason: Any) -> None:
            original(reason)
            self.open.pop(protocol, None)
            lost.callback(None)

        protocol.connectionLost = connection_lost
        return protocol

    async def close_all(self) -> None:
        for protocol, lost in list(self.open.items()):
            getattr(protocol, "_channel", protocol).transport.abortConnection()
            await lost


class _ServerTest(TestCase):
    def setUp(self) -> None:
        self.resource = _Echo()
        self.site = _CountingSite(self.resource)
        self.site.noisy = False
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = new_pool()

    async def tearDown(self) -> None:
        await self.pool.closeCachedConnections()
        await self.site.close_all()
        await self.port.stopListening()


class ClientTest(_ServerTest):
    async def test_request_carries_method_path_body_and_headers(self) -> None:
        client = Client(self.url, self.pool, token="tok")
        got = await client.request("PUT", "/rooms/%21r/send/m.x/1", {"body": "hi"}, headers={"X-Test": ["yes"]})
        self.assertEqual(got["method"], "PUT")
        self.assertEqual(got["uri"], PREFIX + "/rooms/%21r/send/m.x/1")
        self.assertEqual(json.loads(got["body"]), {"body": "hi"})
        self.assertEqual(got["host"], f"127.0.0.1:{self.port.getHost().port}")
        self.assertEqual(got["auth"], "Bearer tok")
        self.assertEqual(got["type"], "application/json")
        self.assertEqual(got["x"], "yes")

    async def test_sequential_requests_share_one_connection(self) -> None:
        client = Client(self.url, self.pool)
        for _ in range(20):
            await client.at(self.url).request("GET", "/x")
        self.assertEqual(self.site.connections, 1)

    async def test_error_status_raises_api_error_with_the_body(self) -> None:
        with self.assertRaises(ApiError) as e:
            await Client(self.url, self.pool).request("GET", "/fail")
        self.assertEqual((e.exception.code, e.exception.errcode), (403, "M_FORBIDDEN"))

    async def test_no_answer_times_out_and_the_pool_keeps_working(self) -> None:
        client = Client(self.url, self.pool)
        with self.assertRaises(TimeoutError):
            await client.request("GET", "/hang", timeout=0.3)
        self.assertEqual((await client.request("GET", "/after"))["uri"], PREFIX + "/after")

    async def test_line_breaks_in_path_or_header_are_refused_before_sending(self) -> None:
        client = Client(self.url, self.pool)
        for path in ("/a b", "/a\r\nX-Injected: 1", "/a\n"):
            with self.assertRaises(ValueError):
                await client.request("GET", path)
        with self.assertRaises(ValueError):
            await client.request("GET", "/a", headers={"X-Test": ["1\r\nX-Injected: 1"]})
        with self.assertRaises(ValueError):
            await client.request("GET /x HTTP/1.1\r\n", "/a")
        with self.assertRaises(ValueError):
            await Client(self.url, self.pool, token="t\r\nX-Injected: 1").request("GET", "/a")
        self.assertEqual(self.site.connections, 0)

    def test_every_byte_that_breaks_a_line_is_caught(self) -> None:
        """Space, each C0 control and DEL, anywhere in a word, are caught; every other byte is not."""
        from synflow.tools.client import _breaks_a_line

        for c in range(256):
            breaks = c <= 0x20 or c == 0x7F
            for word in (bytes([c]), b"/a" + bytes([c]), bytes([c]) + b"/a", b"/a" + bytes([c]) + b"b"):
                self.assertEqual(_breaks_a_line(word), breaks, (c, word))
        self.assertFalse(_breaks_a_line(b""))

    def test_needs_a_client_pool(self) -> None:
        self.assertIsInstance(self.pool, ClientPool)
        with self.assertRaises(TypeError):
            Client(self.url, HTTPConnectionPool(reactor))  # type: ignore[arg-type]

    async def test_treq_view_shares_the_pool(self) -> None:
        client = Client(self.url, self.pool, token="tok")
        response = await client.http.request("GET", self.url + "/t")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content())["uri"], "/t")

    async def test_close_closes_the_calls_connections(self) -> None:
        await Client(self.url, self.pool).request("GET", "/x")
        await self.pool.closeCachedConnections()
        self.assertEqual(self.pool.calls._all, set())
        await Client(self.url, self.pool).request("GET", "/again")  # a new connection after close
        self.assertEqual(self.site.connections, 2)


class WorkloadStartTest(_ServerTest):
    def _workload(self, tokens: list[str]) -> Workload:
        w = Workload([self.url], users=len(tokens), sync_timeout_ms=0)
        self.addCleanup(w.pool.closeCachedConnections)
        w.users = [UserState(Client(self.url, w.pool, token=t)) for t in tokens]
        return w

    async def test_syncing_waits_for_every_users_first_answer(self) -> None:
        w = self._workload(["a", "b", "c"])
        chains = Deferred.fromCoroutine(w.sync_chains())
        await w.syncing()
        self.assertEqual([u.since for u in w.users], ["s1", "s1", "s1"])
        await w.syncing()  # already online: at once
        w.stop_syncing()
        await chains

    async def test_syncing_names_the_users_still_waiting(self) -> None:
        self.resource.hang_sync.add(b"b")
        w = self._workload(["a", "b"])
        chains = Deferred.fromCoroutine(w.sync_chains())
        with self.assertRaises(RuntimeError) as e:
            await w.syncing(timeout_s=0.5)
        self.assertIn("1 of 2 users' first sync had no answer", str(e.exception))
        w.stop_syncing()
        await self.site.close_all()  # the held sync fails, and the chain stops
        await chains


class QuotingTest(SynchronousTestCase):
    @settings(max_examples=500)
    @given(st.text(), st.dictionaries(st.text(min_size=1), st.one_of(st.text(), st.integers())))
    def test_paths_and_queries_are_urllibs(self, text: str, params: dict[str, Any]) -> None:
        """The client's quoting of path segments and queries gives urllib's text for any input."""
        self.assertEqual(client._quote(text), quote(text))
        self.assertEqual(client._quote(text), quote(text))  # kept from the first call
        self.assertEqual(client._query(params), urlencode(params))

    def test_common_values_skip_escaping(self) -> None:
        self.assertEqual(client._query({"timeout": 2000, "since": "m12~1.5_3"}), "timeout=2000&since=m12~1.5_3")
        self.assertEqual(client._quote("!room:hs"), "%21room%3Ahs")


class RetryDelayTest(SynchronousTestCase):
    def test_a_429_waits_what_it_asks_up_to_a_minute(self) -> None:
        """``retry_after_ms`` of a 429 is the wait; a missing, non-numeric, non-positive or over-a-minute one,
        or another error, waits the default."""
        def limited(body: Any) -> ApiError:
            return ApiError(429, body)

        self.assertEqual(retry_delay_s(limited({"retry_after_ms": 1500})), 1.5)
        self.assertEqual(retry_delay_s(limited({"retry_after_ms": 60_000})), 60.0)
        for body in ({}, {"retry_after_ms": "7"}, {"retry_after_ms": 0}, {"retry_after_ms": -5},
                     {"retry_after_ms": 60_001}, "not an object"):
            self.assertEqual(retry_delay_s(limited(body)), 0.2, body)
        self.assertEqual(retry_delay_s(ConnectionError(), default=1.0), 1.0)
