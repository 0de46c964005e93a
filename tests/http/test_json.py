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
from twisted.web.test.requesthelper import DummyChannel

from synflow.errors import HttpApiError
from synflow.http.server import JsonSite, LimitedRequest, encode_json, parse_json_body

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
