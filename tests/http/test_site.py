"""How a site picks the resource for a request, and the headers every response gets."""

from __future__ import annotations

import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http import datetimeToString
from twisted.web.resource import Resource
from twisted.web.server import version as server_version
from twisted.web.test.requesthelper import DummyChannel

from synflow.http import server
from synflow.http.server import JsonSite, LimitedRequest
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
