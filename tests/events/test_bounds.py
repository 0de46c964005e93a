"""Event field bounds (synflow.events.bounds): each bound driven to its edge, and hypothesis over JSON values."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.events.bounds import (
    MAX_CONTENT_DEPTH,
    MAX_ID_BYTES,
    MAX_PDU_BYTES,
    MAX_SAFE_INTEGER,
    PDU_RESERVE_BYTES,
    EventTooLarge,
    FieldError,
    _within_bounds,
    check_event_fields,
    check_json_value,
)
from synflow.federation.pdus import pdu_refusal


def event(**overrides: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"room_id": "!r:hs", "type": "m.room.message", "sender": "@a:hs", "content": {"body": "x"},
                         "state_key": None, "origin": "hs", "origin_server_ts": 1, "txn_id": None, "event_id": None}
    e.update(overrides)
    return e


def size_of(fields: dict[str, Any]) -> int:
    present = {k: v for k, v in fields.items() if v is not None and k != "txn_id"}
    return len(json.dumps(present, separators=(",", ":"), ensure_ascii=False).encode()) + PDU_RESERVE_BYTES


#: Values that break a bound wherever they are put.
BAD_VALUES = [float("inf"), float("-inf"), float("nan"), MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1, 2**64,
              "\ud800", "a\udfffb"]


class BoundsTest(SynchronousTestCase):
    def test_identifiers_up_to_255_bytes(self) -> None:
        """Each ID field takes 255 bytes (multi-byte characters counted in bytes) and refuses 256."""
        for name in ("room_id", "type", "sender", "state_key", "event_id"):
            check_event_fields(event(**{name: "!" + "x" * (MAX_ID_BYTES - 1)}))
            check_event_fields(event(**{name: "é" * (MAX_ID_BYTES // 2)}))  # 254 bytes
            for bad in ("x" * (MAX_ID_BYTES + 1), "é" * (MAX_ID_BYTES // 2 + 1), "a\ud800"):
                with self.assertRaises(FieldError, msg=name) as caught:
                    check_event_fields(event(**{name: bad}))
                self.assertIn(name, str(caught.exception))
        check_event_fields(event(state_key=""))
        self.assertRaises(FieldError, check_event_fields, event(room_id=""))
        self.assertRaises(FieldError, check_event_fields, event(sender=5))

    def test_integers_within_canonical_json_range(self) -> None:
        """Integers of +/-(2**53 - 1) pass; one more either way is refused, in content and in the timestamp."""
        for good in (MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, 0):
            check_event_fields(event(content={"n": [good]}, origin_server_ts=good))
        for bad in (MAX_SAFE_INTEGER + 1, -MAX_SAFE_INTEGER - 1):
            self.assertRaises(FieldError, check_event_fields, event(content={"n": bad}))
            self.assertRaises(FieldError, check_event_fields, event(origin_server_ts=bad))
        self.assertRaises(FieldError, check_event_fields, event(origin_server_ts=True))

    def test_no_nan_or_infinity(self) -> None:
        """NaN and both infinities are refused anywhere in the content; finite floats pass."""
        check_event_fields(event(content={"f": 1.5e300}))
        for bad in (float("inf"), float("-inf"), float("nan")):
            with self.assertRaises(FieldError) as caught:
                check_event_fields(event(content={"a": {"b": [1, bad]}}))
            self.assertIn("content.a.b[1]", str(caught.exception))

    def test_strict_utf8_in_content_values_and_keys(self) -> None:
        """A lone surrogate in a content string or key is refused."""
        self.assertRaises(FieldError, check_event_fields, event(content={"body": "ok\ud83d"}))
        self.assertRaises(FieldError, check_event_fields, event(content={"k\udc00": 1}))
        check_event_fields(event(content={"body": "\U0001f600 \u00e9"}))

    def test_whole_event_up_to_65536_bytes(self) -> None:
        """An event of exactly 65,536 bytes (with the PDU reserve) passes; one byte more is M_TOO_LARGE."""
        base = event(content={"body": ""})
        fill = MAX_PDU_BYTES - size_of(base)
        check_event_fields(event(content={"body": "x" * fill}))
        with self.assertRaises(EventTooLarge) as caught:
            check_event_fields(event(content={"body": "x" * (fill + 1)}))
        self.assertEqual(caught.exception.errcode, "M_TOO_LARGE")
        check_event_fields(event(content={"body": "x" * fill}, txn_id="t" * 10_000))  # the txn key is not sent

    def test_nesting_bound(self) -> None:
        """Content nested to the bound passes; one level more is refused."""
        def nested(levels: int) -> Any:
            value: Any = {}
            for _ in range(levels - 1):
                value = {"a": value}
            return value

        check_json_value(nested(MAX_CONTENT_DEPTH), "content")
        self.assertRaises(FieldError, check_json_value, nested(MAX_CONTENT_DEPTH + 1), "content")

    def test_pdu_refusal_names_the_problem(self) -> None:
        """A PDU's shape and every bound, including fields synflow does not read, give a reason; a good PDU none."""
        good = {"event_id": "$e", "room_id": "!r:x", "type": "t", "sender": "@u:x", "content": {},
                "origin_server_ts": 1, "prev_events": ["$p"], "depth": 3}
        self.assertIsNone(pdu_refusal(good))
        cases = {
            "room_id": {**good, "room_id": 5}, "content": {**good, "content": "hi"},
            "origin_server_ts": {**good, "origin_server_ts": "1"}, "state_key": {**good, "state_key": 3},
            "depth": {**good, "depth": 2**60}, "prev_events": {**good, "prev_events": [float("nan")]},
            "event_id": {**good, "event_id": "$" + "e" * 300},
            "bytes": {**good, "hashes": {"x": "y" * MAX_PDU_BYTES}},
        }
        for part, bad in cases.items():
            why = pdu_refusal(bad)
            self.assertIsNotNone(why, part)
            self.assertIn(part, str(why))

    @given(st.recursive(
        st.none() | st.booleans() | st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=20,
    ))
    def test_bounded_json_passes(self, value: Any) -> None:
        """Any JSON value of finite floats, in-range integers and valid strings passes."""
        check_json_value(value, "content")

    @given(st.recursive(
        st.none() | st.integers(-5, 5) | st.text(max_size=5),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
        max_leaves=10,
    ), st.sampled_from(BAD_VALUES), st.randoms(use_true_random=False))
    def test_one_bad_value_anywhere_is_refused(self, value: Any, bad: Any, rnd: Any) -> None:
        """A single non-finite, out-of-range or invalid-UTF-8 value, wherever it is put, is refused."""
        holder: Any = {"v": value}
        node = holder
        # Walk down to a random container, then put the bad value in it.
        while True:
            children = [c for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, (dict, list))]
            if not children or rnd.random() < 0.4:
                break
            node = rnd.choice(children)
        if isinstance(node, dict):
            node["bad"] = bad
        else:
            node.append(bad)
        self.assertRaises(FieldError, check_json_value, holder, "content")

    @given(st.recursive(
        st.none() | st.booleans() | st.integers(-2**54, 2**54) | st.floats() | st.text(max_size=5)
        | st.sampled_from(BAD_VALUES),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
        max_leaves=12,
    ))
    def test_fast_pass_agrees_with_the_named_walk(self, value: Any) -> None:
        """The pass without paths says a value is within bounds exactly when the walk that names paths finds
        nothing wrong (the walk runs only when it does not)."""
        try:
            check_json_value(value, "content")
        except FieldError:
            fine = False
        else:
            fine = True
        self.assertEqual(_within_bounds(value), fine)

    def test_fast_pass_leaves_other_types_to_the_walk(self) -> None:
        """Subclasses of the JSON types and nesting past the bound are not judged by the fast pass."""
        import enum

        class Level(enum.IntEnum):
            LOW = 1

        class Text(str):
            pass

        for value in ({"a": Level.LOW}, [Text("x")], {Text("k"): 1}, {1: 2}):
            self.assertFalse(_within_bounds(value), value)
        check_json_value({"a": Level.LOW}, "content")  # the walk decides: an int within range
        self.assertRaises(FieldError, check_json_value, {1: 2}, "content")
        deep: Any = []
        for _ in range(MAX_CONTENT_DEPTH):
            deep = [deep]
        self.assertFalse(_within_bounds(deep))
        self.assertRaises(FieldError, check_json_value, deep, "content")
