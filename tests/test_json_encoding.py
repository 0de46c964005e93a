"""The prebuilt compact JSON encoders give json.dumps's text, and its errors, for the settings they name."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.json_encoding import compact_encoder, compact_json, compact_json_unicode

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
