"""JSON in and out of the HTTP framework: the response encoder and the request body's nesting limit."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase
from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from synflow.errors import HttpApiError
from synflow.http.server import (
    EncodedJson,
    JsonResource,
    JsonSite,
    LimitedRequest,
    encode_json,
    parse_json_body,
    respond_json,
)
from synflow.json_encoding import compact_json, json_string
from synflow.storage.stores import SyncEvent

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=30,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 1


class EncodeJsonTest(SynchronousTestCase):
    @given(JSON_VALUES)
    def test_same_as_json_dumps(self, value: Any) -> None:
        """Any JSON value encodes exactly as compact ``json.dumps`` with ``allow_nan=False`` does."""
        self.assertEqual(encode_json(value), json.dumps(value, separators=(",", ":"), allow_nan=False).encode())

    def test_nan_and_infinity_refused(self) -> None:
        """NaN and Infinity are not JSON: refused with ValueError."""
        for bad in (math.nan, math.inf, -math.inf):
            with self.assertRaises(ValueError):
                encode_json({"x": [bad]})


class BodyDepthTest(SynchronousTestCase):
    @given(JSON_VALUES, st.integers(min_value=1, max_value=8))
    def test_depth_limit(self, value: Any, limit: int) -> None:
        """A body is refused exactly when its value is nested deeper than the limit (scalars count as a level)."""
        raw = json.dumps(value).encode()
        if _depth(value) > limit:
            with self.assertRaises(HttpApiError):
                parse_json_body(raw, max_depth=limit, want_object=False)
        else:
            self.assertEqual(parse_json_body(raw, max_depth=limit, want_object=False), value)


def _no_constants(name: str) -> Any:
    raise ValueError(name)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(text)
    return value


class BodyDecodeTest(SynchronousTestCase):
    @given(st.one_of(JSON_VALUES.map(json.dumps), st.text(alphabet='{}[]",:0123456789.eE-+ \ufeffaNInfity\\u',
                                                          max_size=30)))
    def test_a_body_decodes_as_json_loads_with_its_hooks(self, text: str) -> None:
        """Any body gives the value ``json.loads`` with synflow's hooks (no NaN or Infinity, no number overflowing
        to infinity) gives, and is refused where it raises -- a leading byte order mark included."""
        try:
            expected = json.loads(text, parse_constant=_no_constants, parse_float=_finite)
        except (ValueError, RecursionError):
            with self.assertRaises(HttpApiError):
                parse_json_body(text.encode(), want_object=False)
        else:
            self.assertEqual(json.dumps(parse_json_body(text.encode(), want_object=False)), json.dumps(expected))

    def test_a_byte_order_mark_is_refused(self) -> None:
        with self.assertRaises(HttpApiError) as raised:
            parse_json_body('\ufeff{"a":1}'.encode())
        self.assertIn("BOM", raised.exception.msg)


class NoFormParsingTest(SynchronousTestCase):
    def test_post_body_is_not_parsed_as_a_form(self) -> None:
        """A POST whose Content-Type names a form reaches the handler with its body unread: no form fields in
        ``args`` and twisted.web's Content-Type parser (the ``email`` package's) never runs."""
        def parse_content_type(line: bytes) -> bytes:
            raise AssertionError(f"Content-Type {line!r} parsed")

        self.patch(http, "_parseContentType", parse_content_type)
        for ctype in (b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"application/json"):
            channel = DummyChannel()
            channel.site = JsonSite(Resource())
            request = LimitedRequest(channel)
            processed: list[bool] = []
            request.process = functools.partial(processed.append, True)  # type: ignore[method-assign]
            request.requestHeaders.setRawHeaders(b"Content-Type", [ctype])
            request.gotLength(7)
            request.handleContentChunk(b"a=b&c=d")
            request.requestReceived(b"POST", b"/x?q=1", b"HTTP/1.1")
            self.assertEqual((processed, request.args), ([True], {b"q": [b"1"]}), ctype)
            assert request.content is not None
            self.assertEqual(request.content.read(), b"a=b&c=d")


SYNC_EVENTS = st.builds(
    lambda so, inst, eid, room, typ, sk, sender, content, ts: SyncEvent(
        so, inst, eid, room, typ, sk, sender, compact_json(content), ts),
    st.integers(1, 2**63 - 1), st.text(min_size=1), st.text(), st.text(), st.text(), st.none() | st.text(),
    st.text(), st.dictionaries(st.text(), JSON_VALUES, max_size=5), st.integers(0, 2**53),
)


class SyncEventJsonTest(SynchronousTestCase):
    @given(st.text())
    def test_json_string_is_compact_json_of_a_string(self, text: str) -> None:
        """The quoting sync's pieces use gives the text ``compact_json`` gives for the same string."""
        self.assertEqual(json_string(text), compact_json(text))

    @given(SYNC_EVENTS)
    def test_client_json_is_the_encoded_client_event(self, event: SyncEvent) -> None:
        """An event's client JSON, built from its stored content text without parsing it, is exactly the text
        ``encode_json`` gives for its client form (any strings: quotes, control characters, non-ASCII)."""
        self.assertEqual(event.client_json(), encode_json(event.to_client()).decode("ascii"))
        self.assertEqual(json.loads(event.client_json()), event.to_client())

    def test_client_json_built_once(self) -> None:
        """The client JSON is built once and kept: the syncs sharing a window deliver the same event object."""
        event = SyncEvent(1, "p1", "$e", "!r", "m.room.message", None, "@a:x", '{"body":"hi"}', 5)
        first = event.client_json()
        self.assertIs(event.client_json(), first)
        self.assertEqual(event, SyncEvent(1, "p1", "$e", "!r", "m.room.message", None, "@a:x", '{"body":"hi"}', 5))
        self.assertEqual(event.content, {"body": "hi"})

    def test_respond_json_sends_encoded_text_as_it_is(self) -> None:
        """A handler's already-encoded body goes out byte for byte, with its length."""
        request = DummyRequest([b"sync"])
        text = '{"events":[{"body":"caf\\u00e9 \\"x\\""}],"limited":false}'
        respond_json(request, 200, EncodedJson(text))
        self.assertEqual(b"".join(request.written), text.encode("ascii"))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"Content-Length"), [str(len(text)).encode()])
        self.assertEqual(request.responseCode, 200)
        self.assertEqual(request.finished, 1)


async def _handler(request: Any, **kwargs: Any) -> tuple[int, Any]:
    return 200, {}


#: Patterns as routes are written: literal first segments (shared by several routes), a pattern starting with a
#: group, one whose first segment is a regular expression, and the empty path.
ROUTE_PATTERNS = [r"/sync", r"/rooms", r"/rooms/(?P<room_id>[^/]+)/join", r"/(?P<any>[^/]+)/state",
                  r"/rooms/(?P<room_id>[^/]+)/send/(?P<t>[^/]+)", r"/sy.c", r"/v[12]/x", r"", r"/send/(?P<txn>[^/]*)",
                  r"/rooms/x"]
SEGMENTS = st.sampled_from(["sync", "rooms", "syncx", "synk", "v1", "v2", "x", "join", "state", "send", "", "!r:hs",
                            "s.nc"])


class RouteIndexTest(SynchronousTestCase):
    @given(order=st.permutations(ROUTE_PATTERNS), methods=st.lists(st.sampled_from(["GET", "PUT", "POST"]),
                                                                    min_size=len(ROUTE_PATTERNS),
                                                                    max_size=len(ROUTE_PATTERNS)),
           paths=st.lists(st.lists(SEGMENTS, max_size=5).map(lambda segs: "".join("/" + s for s in segs)),
                          min_size=1, max_size=20))
    def test_candidates_match_what_every_route_matches(self, order: list[str], methods: list[str],
                                                       paths: list[str]) -> None:
        """For any path, the routes looked at (by its first segment) match exactly as every route would, in the
        order the routes were added: the same handler answers and the same methods are allowed."""
        resource = JsonResource("/p")
        for pattern, method in zip(order, methods):
            resource.route(method, pattern, _handler)
        for path in paths:
            everything = [(m, p.pattern) for m, p, _ in resource._routes if p.match(path)]
            looked_at = [(m, p.pattern) for m, p, _ in resource._candidates(path) if p.match(path)]
            self.assertEqual(looked_at, everything, path)
