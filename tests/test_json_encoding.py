"""The prebuilt compact JSON encoders give json.dumps's text, and its errors, for the settings they name."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.json_encoding import (
    compact_encoder,
    compact_json,
    compact_json_unicode,
    loads,
    nested_deeper_than,
    reject_constant,
)

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                       max_leaves=20)


class CompactEncoderTest(SynchronousTestCase):
    @given(_values)
    def test_same_text_as_json_dumps(self, value):
        """For any JSON-able value (NaN, Infinity and non-ASCII included) the text is json.dumps's."""
        self.assertEqual(compact_json(value), json.dumps(value, separators=(",", ":")))
        self.assertEqual(compact_json_unicode(value), json.dumps(value, separators=(",", ":"), ensure_ascii=False))

    def test_strict_encoder_refuses_nan_and_unencodable_values(self):
        """allow_nan=False raises ValueError on NaN and Infinity; a value JSON cannot hold raises TypeError."""
        strict = compact_encoder(allow_nan=False)
        self.assertEqual(strict({"a": [1.5, None]}), '{"a":[1.5,null]}')
        for bad in (float("nan"), [float("inf")], {"x": -float("inf")}):
            with self.assertRaises(ValueError):
                strict(bad)
        with self.assertRaises(TypeError):
            compact_json({"a": object()})


def _outcome(fn, data):
    try:
        value = fn(data)
    except ValueError as e:
        return type(e), str(e)
    return "value", json.dumps(value, sort_keys=True)  # NaN compares equal as text


class LoadsTest(SynchronousTestCase):
    @given(_values, st.sampled_from(["", " ", "\n", "\t "]), st.booleans(), st.booleans())
    def test_same_value_as_json_loads(self, value, space, as_bytes, ascii_only):
        """The value json.loads gives, from text or UTF-8 bytes, with or without whitespace around it."""
        text = space + json.dumps(value, ensure_ascii=ascii_only) + space
        data = text.encode("utf-8", "surrogatepass") if as_bytes else text
        self.assertEqual(_outcome(loads, data), _outcome(json.loads, data))

    @given(st.binary(max_size=24) | st.text(max_size=24))
    def test_same_error_as_json_loads_on_any_input(self, data):
        """Whatever the input, the same value or the same ValueError (its type and message) as json.loads."""
        self.assertEqual(_outcome(loads, data), _outcome(json.loads, data))

    def test_edge_cases(self):
        """Trailing data, a byte-order mark, a lone value, invalid UTF-8, NaN and a bytearray go as json.loads takes them."""
        for data in (b'[1,2] x', b'\xef\xbb\xbf{"a":1}', "\ufeff{}", b'"\xc3\xa9"', b"\xff", b"NaN", b"", b"{",
                     bytearray(b'{"a":1}'), bytearray(b"{")):
            self.assertEqual(_outcome(loads, data), _outcome(json.loads, data), data)


def _depth(value) -> int:
    """Arrays and objects nested in ``value`` (a scalar is no level), recursively: the reference."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


class StrictDecodingHelpersTest(SynchronousTestCase):
    @given(_values, st.integers(0, 8))
    def test_nested_deeper_than_is_the_depth(self, value, limit):
        """For any value and limit, "nested deeper" is exactly "its depth of arrays and objects is above it"."""
        self.assertEqual(nested_deeper_than(value, limit), _depth(value) > limit)

    def test_nested_deeper_than_without_recursion(self):
        """A nesting far past the interpreter's recursion limit is measured, not a RecursionError."""
        deep: list = []
        for _ in range(100_000):
            deep = [deep]
        self.assertTrue(nested_deeper_than(deep, 64))
        self.assertFalse(nested_deeper_than(deep, 100_001))

    def test_reject_constant(self):
        """As a decoder's parse_constant: NaN and the infinities are refused with a ValueError naming them."""
        for text, name in (("[NaN]", "NaN"), ('{"a": Infinity}', "Infinity"), ("-Infinity", "-Infinity")):
            with self.assertRaisesRegex(ValueError, f"^{name} is not valid JSON$"):
                json.loads(text, parse_constant=reject_constant)
