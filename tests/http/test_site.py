"""How a site picks the resource for a request, and the headers every response gets."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest.mock import patch
from urllib.parse import quote, unquote

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import datetimeToString
from twisted.web.resource import Resource
from twisted.web.server import version as server_version
from twisted.web.test.requesthelper import DummyChannel

from synflow.errors import HttpApiError
from synflow.http import server
from synflow.http.server import JsonResource, JsonSite, LimitedRequest
from synflow.http.site import build_site


class _Leaf(Resource):
    isLeaf = True

    def __init__(self, name: bytes) -> None:
        super().__init__()
        self.name = name
        self.seen: list[list[bytes]] = []

    def render(self, request: Any) -> bytes:
        self.seen.append(list(request.postpath))
        return self.name


def _get(site: Any, uri: bytes, method: bytes = b"GET") -> tuple[LimitedRequest, bytes]:
    channel = DummyChannel()
    channel.site = site
    request = site.requestFactory(channel)
    request.gotLength(0)
    request.requestReceived(method, uri, b"HTTP/1.1")
    return request, channel.transport.written.getvalue()


class PrefixDispatchTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.leaf = _Leaf(b"leaf")
        self.branch = Resource()  # not a leaf: its children are walked along the rest of the path
        self.child = _Leaf(b"child")
        self.branch.putChild(b"kid", self.child)
        self.site = build_site({"/_x/leaf": self.leaf, "/_x/branch": self.branch}, max_body_bytes=1024)

    def test_mounted_leaf_sees_the_raw_rest_of_the_path(self) -> None:
        """The resource mounted at the longest prefix answers, with the path after it, still quoted, as postpath."""
        request, written = _get(self.site, b"/_x/leaf/a%2Fb/c?q=1")
        self.assertEqual(request.code, 200)
        self.assertTrue(written.endswith(b"leaf"))
        self.assertEqual(self.leaf.seen, [[b"a%2Fb", b"c"]])
        _get(self.site, b"/_x/leaf")
        self.assertEqual(self.leaf.seen[-1], [])

    def test_a_mounted_branch_is_walked_to_its_child(self) -> None:
        """A mounted resource that is not a leaf is walked as twisted.web walks it: ``/_x/branch/kid`` is its child."""
        request, written = _get(self.site, b"/_x/branch/kid/more")
        self.assertEqual(request.code, 200)
        self.assertTrue(written.endswith(b"child"))
        self.assertEqual(self.child.seen, [[b"more"]])

    def test_unmounted_paths_are_404(self) -> None:
        for uri in (b"/", b"/_x", b"/_x/leafy", b"/other/leaf"):
            request, written = _get(self.site, uri)
            self.assertEqual(request.code, 404, uri)
            self.assertIn(b'"errcode":"M_UNRECOGNIZED"', written, uri)
        self.assertEqual(self.leaf.seen, [])

    def test_server_and_date_headers(self) -> None:
        """Every response has twisted.web's ``Server`` header and a ``Date`` for the current second."""
        self.patch(time, "time", lambda: 1_800_000_000.25)
        request, _ = _get(self.site, b"/_x/leaf")
        self.assertEqual(request.responseHeaders.getRawHeaders(b"Server"), [server_version])
        self.assertEqual(request.responseHeaders.getRawHeaders(b"Date"), [datetimeToString(1_800_000_000)])
        self.patch(time, "time", lambda: 1_800_000_001.0)
        request, _ = _get(self.site, b"/_x/leaf")
        self.assertEqual(request.responseHeaders.getRawHeaders(b"Date"), [datetimeToString(1_800_000_001)])

    def test_date_is_formatted_once_a_second(self) -> None:
        formatted: list[int] = []
        self.patch(server, "datetimeToString", lambda t: formatted.append(t) or datetimeToString(t))
        self.patch(time, "time", lambda: 1_900_000_000.5)
        for _ in range(3):
            _get(self.site, b"/_x/leaf")
        self.assertEqual(formatted, [1_900_000_000])

    def test_options_star_is_twisted_webs(self) -> None:
        """``OPTIONS *`` is answered as twisted.web answers it, not routed."""
        request, _ = _get(self.site, b"*", b"OPTIONS")
        self.assertEqual(request.code, 200)
        self.assertEqual(self.leaf.seen, [])


class OtherRootTest(SynchronousTestCase):
    def test_a_root_without_resource_for_is_walked_by_twisted_web(self) -> None:
        """A :class:`JsonSite` over a plain ``Resource`` tree dispatches through twisted.web's own walk."""
        root = Resource()
        leaf = _Leaf(b"plain")
        root.putChild(b"a", leaf)
        site = JsonSite(root)
        request, written = _get(site, b"/a/b%20c")
        self.assertEqual(request.code, 200)
        self.assertTrue(written.endswith(b"plain"))
        self.assertEqual(leaf.seen, [[b"b c"]])  # twisted.web unquotes each segment
        self.assertIsNotNone(request.responseHeaders.getRawHeaders(b"Date"))


class _Routes(JsonResource):
    """Answers ``/x/ok`` with a body, ``/x/limited`` with a 429 and its Retry-After, ``/x/empty`` with ``{}``."""

    def __init__(self) -> None:
        super().__init__("/x")
        self.route("GET", r"/ok", self.ok)
        self.route("HEAD", r"/ok", self.ok)
        self.route("GET", r"/limited", self.limited)
        self.route("GET", r"/empty", self.empty)
        self.route("GET", r"/seg/(?P<name>[^/]+)/(?P<rest>[^/]+)", self.segments)
        self.route("GET", r"/slow", self.slow)
        #: The answers ``/x/slow`` is waiting to give.
        self.pending: list[Deferred[None]] = []

    async def ok(self, request: Any) -> tuple[int, Any]:
        return 200, {"events": ["é", 1], "next_batch": "s1"}

    async def limited(self, request: Any) -> tuple[int, Any]:
        raise HttpApiError(429, "M_LIMIT_EXCEEDED", "slow down", retry_after_ms=1500)

    async def empty(self, request: Any) -> tuple[int, Any]:
        return 201, {}

    async def segments(self, request: Any, name: str, rest: str) -> tuple[int, Any]:
        return 200, {"name": name, "rest": rest}

    async def slow(self, request: Any) -> tuple[int, Any]:
        d: Deferred[None] = Deferred()
        self.pending.append(d)
        await d
        return 200, {"late": True}


class _Transport(StringTransport):
    def __init__(self) -> None:
        super().__init__(hostAddress=IPv4Address("TCP", "127.0.0.1", 8008),
                         peerAddress=IPv4Address("TCP", "127.0.0.1", 50000))
        self.host_lookups = 0
        self.no_delay: bool | None = None
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        super().write(data)

    def writeSequence(self, seq: Any) -> None:
        self.writes += 1
        super().writeSequence(seq)

    def getHost(self) -> Any:
        self.host_lookups += 1
        return super().getHost()

    def setTcpNoDelay(self, enabled: bool) -> None:
        self.no_delay = enabled


def _serve(requests: bytes, *, whole: bool = True) -> tuple[bytes, _Transport]:
    """What a :class:`JsonSite` channel writes back for ``requests`` (the head writer on or off)."""
    site = build_site({"/x": _Routes()}, max_body_bytes=1024)
    channel = site.buildProtocol(None)
    channel.callLater = Clock().callLater  # its idle timeout: not on the global reactor
    transport = _Transport()
    with patch.object(LimitedRequest, "whole_response_ok", lambda self: whole and LIMITED_WHOLE_OK(self)):
        channel.makeConnection(transport)
        channel.dataReceived(requests)
    channel.connectionLost(Failure(ConnectionDone()))
    return transport.value(), transport


LIMITED_WHOLE_OK = LimitedRequest.whole_response_ok


class ChannelTest(SynchronousTestCase):
    """A JSON response's head and body written in one go are the bytes twisted.web's own writes send."""

    def setUp(self) -> None:
        self.patch(time, "time", lambda: 1_800_000_000.25)

    def test_whole_response_is_twisted_webs_bytes(self) -> None:
        """Status line, the headers set before (Server, Date, Retry-After), Content-Type and Content-Length, the
        body: byte for byte what twisted.web writes, for HTTP/1.1 and 1.0, a 200, a 201 and a refusal."""
        for version in (b"HTTP/1.1", b"HTTP/1.0"):
            for path in (b"/x/ok", b"/x/limited", b"/x/empty", b"/x/missing"):
                request = b"GET " + path + b" " + version + b"\r\nHost: h\r\n\r\n"
                fast, _ = _serve(request)
                slow, _ = _serve(request, whole=False)
                self.assertEqual(fast, slow, (version, path))
                self.assertTrue(fast.startswith(version + b" "), fast)
        fast, _ = _serve(b"GET /x/limited HTTP/1.1\r\nHost: h\r\n\r\n")
        self.assertIn(b"\r\nRetry-After: 2\r\n", fast)
        head, _, body = fast.partition(b"\r\n\r\n")
        self.assertIn(b"Content-Length: %d" % len(body), head)

    def test_kept_alive_connection_answers_each_request(self) -> None:
        """Pipelined requests on one HTTP/1.1 connection are each answered in turn, whole."""
        one = b"GET /x/ok HTTP/1.1\r\nHost: h\r\n\r\n"
        written, transport = _serve(one * 3)
        self.assertEqual(written.count(b"HTTP/1.1 200 OK\r\n"), 3)
        self.assertEqual(written, _serve(one)[0] * 3)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(transport.writes, 3)  # each response in one write
        self.assertEqual(_serve(one * 3, whole=False)[1].writes, 6)  # twisted.web's: the head, then the body

    def test_http_1_0_closes_after_the_response(self) -> None:
        written, transport = _serve(b"GET /x/ok HTTP/1.0\r\nHost: h\r\n\r\n")
        self.assertTrue(written.startswith(b"HTTP/1.0 200 OK\r\n"))
        self.assertTrue(transport.disconnecting)

    def test_head_is_answered_without_a_body(self) -> None:
        """A HEAD request is twisted.web's to answer (headers only): the whole-response writer is not used."""
        written, _ = _serve(b"HEAD /x/ok HTTP/1.1\r\nHost: h\r\n\r\n")
        self.assertTrue(written.startswith(b"HTTP/1.1 200 OK\r\n"), written)
        self.assertTrue(written.endswith(b"\r\n\r\n"), written)
        self.assertEqual(written, _serve(b"HEAD /x/ok HTTP/1.1\r\nHost: h\r\n\r\n", whole=False)[0])

    def test_addresses_looked_up_once_per_connection_and_nagle_off(self) -> None:
        one = b"GET /x/ok HTTP/1.1\r\nHost: h\r\n\r\n"
        _, transport = _serve(one * 4)
        self.assertEqual(transport.host_lookups, 1)
        self.assertIs(transport.no_delay, True)


class GoneClientTest(SynchronousTestCase):
    def test_an_answer_after_the_client_has_gone_is_dropped(self) -> None:
        """A handler that answers after its client disconnected writes nothing and raises nothing; the site
        serves the next connection."""
        routes = _Routes()
        site = build_site({"/x": routes}, max_body_bytes=1024)
        channel = site.buildProtocol(None)
        channel.callLater = Clock().callLater
        transport = _Transport()
        channel.makeConnection(transport)
        channel.dataReceived(b"GET /x/slow HTTP/1.1\r\nHost: h\r\n\r\n")
        self.assertEqual(len(routes.pending), 1)
        channel.connectionLost(Failure(ConnectionDone()))
        with self.assertNoLogs("synflow", level="WARNING"):
            routes.pending[0].callback(None)
        self.assertEqual(transport.value(), b"")
        self.assertEqual(self.flushLoggedErrors(), [])
        channel = site.buildProtocol(None)
        channel.callLater = Clock().callLater
        transport = _Transport()
        channel.makeConnection(transport)
        channel.dataReceived(b"GET /x/ok HTTP/1.1\r\nHost: h\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 OK\r\n"))


class PathSegmentTest(SynchronousTestCase):
    """Routes match the path's percent-decoded segments; an encoded "/" stays inside its segment."""

    def _get(self, path: bytes) -> tuple[bytes, Any]:
        written, _ = _serve(b"GET " + path + b" HTTP/1.1\r\nHost: h\r\n\r\n")
        head, _, body = written.partition(b"\r\n\r\n")
        return head.split(b"\r\n", 1)[0], json.loads(body)

    def test_segments_are_decoded(self) -> None:
        self.assertEqual(self._get(b"/x/seg/%21room%3Ahs/m.text"),
                         (b"HTTP/1.1 200 OK", {"name": "!room:hs", "rest": "m.text"}))
        self.assertEqual(self._get(b"/x/seg/plain/words"), (b"HTTP/1.1 200 OK", {"name": "plain", "rest": "words"}))

    def test_an_encoded_slash_does_not_split_a_segment(self) -> None:
        """``%2F`` and ``%2f`` are a "/" inside the argument; the route has two segments, not three."""
        self.assertEqual(self._get(b"/x/seg/a%2Fb/c%2fd"), (b"HTTP/1.1 200 OK", {"name": "a/b", "rest": "c/d"}))
        status, body = self._get(b"/x/seg/a/b/c")
        self.assertEqual((status, body["errcode"]), (b"HTTP/1.1 404 Not Found", "M_UNRECOGNIZED"))

    def test_a_path_that_does_not_decode_to_utf8_is_refused(self) -> None:
        status, body = self._get(b"/x/seg/%ff/x")
        self.assertEqual((status, body["errcode"]), (b"HTTP/1.1 400 Bad Request", "M_UNRECOGNIZED"))

    @given(st.lists(st.text(alphabet="/%2Ffa:!b3é", max_size=12).map(lambda t: quote(t, safe="/%:!")) |
                    st.text(alphabet="/%2Ff5Caz", max_size=12), max_size=6).map("/".join))
    def test_decoding_is_each_segments_own(self, path: str) -> None:
        """For any path, the whole-path decoding is each segment decoded with its "/" written ``%2F``, and the
        same paths are refused."""
        def by_segment() -> str:
            return "/".join(unquote(seg, errors="strict").replace("/", "%2F") for seg in path.split("/"))

        try:
            expected = by_segment()
        except UnicodeDecodeError:
            with self.assertRaises(HttpApiError):
                server._decoded_path(path)
        else:
            self.assertEqual(server._decoded_path(path), expected)
