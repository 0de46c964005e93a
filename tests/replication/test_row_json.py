"""Rows through the fast JSON libraries: the same text and the same values as the standard library's.

The codec encodes a row with orjson and decodes one with msgspec where their
result is the standard library's; everything else goes through ``json``.
These tests hold the two paths to one outcome: the same bytes (the wire is
Synapse's, byte for byte), the same values of the same types, the same
refusals.
"""

from __future__ import annotations

import enum
import json
import math
import uuid
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import LocalProtocolError, RemoteProtocolError
from synflow.replication import commands
from synflow.replication.commands import (
    RdataCommand,
    decode_json,
    encode_line,
    encode_line_bytes,
    parse_line,
)


class _Colour(enum.Enum):
    RED = "red"
    NUMBER = 7
    NAN = math.nan


class _Flag(enum.IntEnum):
    ON = 1


class _Text(str):
    pass


class _Number(int):
    pass


def _small_exponent_floats() -> st.SearchStrategy[float]:
    # the exponents orjson writes otherwise than repr does (-5 to -9), and their neighbours
    return st.builds(lambda m, e: m * 10.0**e, st.floats(1, 10, exclude_max=True), st.integers(-11, -3))


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    _small_exponent_floats(),
    st.text(),
    st.text(st.characters(codec="ascii")),
    st.sampled_from(["null", "-", "e-5", "0.0000", "@a-b:hs", "\ud800", "é", "\x00", "\u2028"]),
    st.sampled_from([_Colour.RED, _Colour.NUMBER, _Colour.NAN, _Flag.ON, _Text("x-y"), _Number(3),
                     uuid.UUID(int=12345), b"bytes", {1, 2}]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    | st.tuples(inner, inner),
    max_leaves=12,
)
_rows = st.lists(_values, max_size=8)


def _outcome_without(module: Any, name: str, fn: Any, *args: Any) -> Any:
    """:func:`_outcome` of ``fn(*args)`` with ``module.name`` (a fast library's entry) set to None meanwhile."""
    fast = getattr(module, name)
    setattr(module, name, None)
    try:
        return _outcome(fn, *args)
    finally:
        setattr(module, name, fast)


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", fn(*args))
    except Exception as e:
        return ("raised", type(e))


def _typed(value: Any) -> Any:
    """A value with the type of every part in it (True, 1 and 1.0 compare equal otherwise; -0.0 too)."""
    if isinstance(value, list):
        return ["list", [_typed(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[k, _typed(v)] for k, v in value.items()]]
    return [type(value).__name__, repr(value)]


class RowEncodingTests(SynchronousTestCase):
    def _standard(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with orjson out of the way: the standard library's encoder alone."""
        return _outcome_without(commands, "_orjson_dumps", fn, *args)

    @settings(max_examples=600, deadline=None)
    @given(_rows)
    @example([1e-7, None])
    @example([0.00001])
    @example([math.nan, None])
    @example([[math.inf]])
    @example([None, [None]])
    @example(["é", None])
    @example(["\ud800"])
    @example([2**64])
    def test_a_row_encodes_as_the_standard_encoder_writes_it(self, row: list[Any]) -> None:
        fast = _outcome(commands._row_json, row)
        self.assertEqual(fast, self._standard(commands._row_json, row))
        if fast[0] == "ok":
            self.assertTrue(fast[1].isascii())
            self.assertEqual(fast[1], json.dumps(row, separators=(",", ":"), allow_nan=False,
                                                 default=commands._row_default))

    @settings(max_examples=200, deadline=None)
    @given(_rows, st.one_of(st.none(), st.integers(0, 2**63 - 1)))
    def test_an_rdata_line_is_the_standard_encoders_line(self, row: list[Any], token: int | None) -> None:
        def line() -> bytes:
            return encode_line_bytes(RdataCommand("events", "w1", token, row))

        fast = _outcome(line)
        self.assertEqual(fast, self._standard(line))
        if fast[0] == "ok":
            self.assertEqual(fast[1], encode_line(RdataCommand("events", "w1", token, row)).encode())
        else:
            self.assertIs(fast[1], LocalProtocolError)

    def test_nan_and_infinity_are_refused_wherever_they_are(self) -> None:
        for row in ([math.nan], [None, math.inf], [[None], -math.inf], [{"a": math.nan}], [_Colour.NAN]):
            with self.assertRaises(LocalProtocolError, msg=repr(row)):
                encode_line_bytes(RdataCommand("events", "w1", 1, row))

    def test_enum_members_and_uuids_are_written_as_their_value_and_text(self) -> None:
        row = [_Colour.RED, _Colour.NUMBER, _Flag.ON, uuid.UUID(int=1)]
        expected = b'RDATA events w1 1 ["red",7,1,"00000000-0000-0000-0000-000000000001"]'
        self.assertEqual(encode_line_bytes(RdataCommand("events", "w1", 1, row)), expected)
        self.assertEqual(self._standard(lambda: encode_line_bytes(RdataCommand("events", "w1", 1, row))),
                         ("ok", expected))

    def test_a_plain_row_takes_orjson(self) -> None:
        calls = []

        def dumps(*args: Any) -> bytes:
            calls.append(args)
            return commands._orjson.dumps(*args)

        self.patch(commands, "_orjson_dumps", dumps)
        row = ["$ev1:hs", "!room:hs", "m.room.message", None, "@user:hs", None]
        self.assertEqual(commands._row_json(row), '["$ev1:hs","!room:hs","m.room.message",null,"@user:hs",null]')
        self.assertEqual(len(calls), 1)


def _json_texts() -> st.SearchStrategy[str]:
    plain = st.recursive(
        st.none() | st.booleans() | st.integers() | st.integers(-(10**40), 10**40)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
        max_leaves=10,
    )
    dumped = st.builds(lambda v, a: json.dumps(v, ensure_ascii=a), plain, st.booleans())
    edges = st.sampled_from([
        "[NaN]", "[Infinity]", "[-Infinity]", "[1e400]", "[-1e400]", "[1e-400]", '["\\ud800"]', '["\\udc00x"]',
        "[" + "9" * 20 + "]", "[-" + "9" * 19 + "]", "[" + "9" * 4300 + "]", "[" + "9" * 4301 + "]",
        "[" * 900 + "]" * 900, "[" * 5000 + "]" * 5000, " [1] ", "\t[1]\n", "[1] x", "[1][2]", "\ufeff[1]",
        "[01]", "[1.]", "[.5]", "[-0]", "[-0.0]", "[1E2]", '{"a":1,"a":2}', '["\x01"]', "[1,]", "", "[",
        '["\\u0000"]', '["\\ud83d\\ude00"]', "[true,false,null]", "[tru]", "{}", "1", '"x"', "[1]\x00",
    ])
    mutated = st.builds(lambda t, i, c: t[:i] + c + t[i:], dumped, st.integers(0, 40),
                        st.sampled_from(list(" ,:[]{}\"\\0-.eE+nx\x00\u00e9")))
    return st.one_of(dumped, edges, mutated)


class RowDecodingTests(SynchronousTestCase):
    def _standard(self, fn: Any, text: str) -> Any:
        """``fn(text)`` with msgspec out of the way: the standard library's decoder alone."""
        return _outcome_without(commands, "_fast_decode", fn, text)

    @settings(max_examples=800, deadline=None)
    @given(_json_texts())
    def test_a_text_decodes_as_the_standard_decoder_reads_it(self, text: str) -> None:
        for fn in (commands._decode_row, decode_json):
            fast = _outcome(fn, text)
            slow = self._standard(fn, text)
            if fast[0] == "ok":
                self.assertEqual(slow[0], "ok", (fn.__name__, text[:80]))
                self.assertEqual(_typed(fast[1]), _typed(slow[1]), (fn.__name__, text[:80]))
            else:
                self.assertEqual(fast, slow, (fn.__name__, text[:80]))
                self.assertIs(fast[1], RemoteProtocolError)

    def test_a_row_line_is_read_by_msgspec(self) -> None:
        calls = []

        def decode(text: str) -> Any:
            calls.append(text)
            return commands._msgspec_json.Decoder().decode(text)

        self.patch(commands, "_fast_decode", decode)
        cmd = parse_line(b'RDATA events w1 5 ["$ev1:hs",null,12345678901234567890123]')
        self.assertEqual(cmd.row, ["$ev1:hs", None, 12345678901234567890123])
        self.assertEqual(len(calls), 1)

    def test_refusals_keep_the_standard_decoders_message(self) -> None:
        for text, words in (("[NaN]", "NaN is not valid JSON"), ("[1e400]", "overflows to Infinity"),
                            ("[1] x", "Extra data")):
            with self.assertRaisesRegex(RemoteProtocolError, words):
                commands._decode_row(text)
