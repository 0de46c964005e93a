"""Stream row types: wire round trips, and every malformed row refused with a clear error."""

from __future__ import annotations

import copy
import json
import pickle

import attrs
from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import RemoteProtocolError
from synflow.streams import CachesRow, EventsRow, FederationRow, StreamRowError

_s = st.text(max_size=20)
_events = st.builds(EventsRow, _s, _s, _s, st.none() | _s, _s, st.none() | _s)


class EventsRowTest(SynchronousTestCase):
    @given(_events)
    def test_round_trip(self, row: EventsRow) -> None:
        """Any events row survives to_wire/from_wire unchanged."""
        self.assertEqual(EventsRow.from_wire(row.to_wire()), row)

    @given(_events)
    def test_rows_are_ordinary_frozen_values(self, row: EventsRow) -> None:
        """Rows built past attrs's __init__ (the constructor, from_wire) hash, copy, evolve and stay frozen."""
        read = EventsRow.from_wire(row.to_wire())
        self.assertIs(type(read), EventsRow)
        self.assertEqual(hash(read), hash(row))
        self.assertEqual(attrs.astuple(read), attrs.astuple(row))
        for value in (row, read):
            self.assertEqual(copy.deepcopy(value), row)
            self.assertEqual(pickle.loads(pickle.dumps(value)), row)
            self.assertEqual(attrs.evolve(value, sender="@x:hs").sender, "@x:hs")
            for field in attrs.fields(EventsRow):
                with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                    setattr(value, field.name, None)

    def test_subclass_from_wire_builds_the_subclass(self) -> None:
        """A row type derived from EventsRow gets instances of itself from from_wire."""

        class Mine(EventsRow):
            pass

        read = Mine.from_wire(["$e:hs", "!r:hs", "m.room.message", None, "@u:hs", None])
        built = Mine("$e:hs", "!r:hs", "m.room.message", None, "@u:hs", None)
        for row in (read, built, copy.copy(built), attrs.evolve(built)):
            self.assertIs(type(row), Mine)
            self.assertEqual(row, read)
            self.assertEqual(row.sender, "@u:hs")
            with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                row.sender = "@v:hs"  # type: ignore[misc]

    def test_malformed_rows_refused(self) -> None:
        """Every malformed events row is refused with a message naming what is wrong."""
        good = ["$e:hs", "!r:hs", "m.room.member", "@u:hs", "@u:hs", "join"]
        bad = [
            ("not a list", "must be a JSON array of 6 items"),
            (good[:5], "must be a JSON array of 6 items"),
            ([*good, "extra"], "must be a JSON array of 6 items"),
            ([5, *good[1:]], "event_id must be a string"),
            ([good[0], None, *good[2:]], "room_id must be a string"),
            ([*good[:2], ["m"], *good[3:]], "type must be a string"),
            ([*good[:3], 7, *good[4:]], "state_key must be a string"),
            ([*good[:4], None, good[5]], "sender must be a string"),
            ([*good[:5], True], "membership must be a string"),
        ]
        for row, message in bad:
            with self.assertRaises(StreamRowError, msg=repr(row)) as cm:
                EventsRow.from_wire(row)  # type: ignore[arg-type]
            self.assertIn(message, str(cm.exception))
        self.assertEqual(EventsRow.from_wire([*good[:3], None, good[4], None]).state_key, None)


def _refused(test: SynchronousTestCase, row_type: type, bad: list[tuple[object, str]]) -> None:
    for row, message in bad:
        with test.assertRaises(StreamRowError, msg=repr(row)) as cm:
            row_type.from_wire(row)  # type: ignore[attr-defined]
        test.assertIn(message, str(cm.exception), repr(row))
        test.assertIsInstance(cm.exception, RemoteProtocolError)  # the handler drops and counts it


_json_scalar = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _s
_caches = st.builds(CachesRow, _s, st.none() | st.lists(_json_scalar, max_size=4).map(tuple),
                    st.integers(0, 2**53))
_content = st.recursive(
    st.dictionaries(_s, _json_scalar, max_size=4),
    lambda inner: st.dictionaries(_s, inner | st.lists(inner, max_size=3), max_size=3),
    max_leaves=10,
)
_federation = st.builds(FederationRow, _s, _s, _content)


class CachesRowTest(SynchronousTestCase):
    @given(_caches)
    def test_round_trip(self, row: CachesRow) -> None:
        """Any caches row survives to_wire, JSON and from_wire unchanged."""
        self.assertEqual(CachesRow.from_wire(json.loads(json.dumps(row.to_wire()))), row)

    def test_typical_row_on_the_wire(self) -> None:
        """A typical caches row goes on the wire as [cache_name, keys, ts] and comes back."""
        row = CachesRow("get_user_by_id", ("@b:hs",), 1700000000000)
        self.assertEqual(row.to_wire(), ["get_user_by_id", ["@b:hs"], 1700000000000])
        self.assertEqual(CachesRow.from_wire(row.to_wire()), row)

    def test_malformed_rows_refused(self) -> None:
        """Every malformed caches row is refused with a message naming what is wrong."""
        _refused(self, CachesRow, [
            ("not a list", "caches row must be a JSON array of 3 items"),
            ({"cache_name": "c"}, "caches row must be a JSON array of 3 items"),
            (["get_user", None], "caches row must be a JSON array of 3 items"),
            (["get_user", None, 1, 2], "caches row must be a JSON array of 3 items"),
            ([5, None, 1], "cache_name must be a string"),
            ([None, ["k"], 1], "cache_name must be a string"),
            (["get_user", "@a:hs", 1], "caches keys must be a list or null"),
            (["get_user", {"k": 1}, 1], "caches keys must be a list or null"),
            (["get_user", None, "17"], "caches invalidation_ts must be an integer"),
            (["get_user", None, 1.5], "caches invalidation_ts must be an integer"),
            (["get_user", None, True], "caches invalidation_ts must be an integer"),
            (["get_user", None, None], "caches invalidation_ts must be an integer"),
        ])
        self.assertEqual(CachesRow.from_wire(["get_room", None, 0]), CachesRow("get_room", None, 0))


class FederationRowTest(SynchronousTestCase):
    @given(_federation)
    def test_round_trip(self, row: FederationRow) -> None:
        """Any federation row survives to_wire, JSON and from_wire unchanged."""
        self.assertEqual(FederationRow.from_wire(json.loads(json.dumps(row.to_wire()))), row)

    def test_malformed_rows_refused(self) -> None:
        """Every malformed federation row is refused with a message naming what is wrong."""
        _refused(self, FederationRow, [
            ("not a list", "federation row must be a JSON array of 3 items"),
            (None, "federation row must be a JSON array of 3 items"),
            (["remote.example", "m.typing"], "federation row must be a JSON array of 3 items"),
            (["remote.example", "m.typing", {}, {}], "federation row must be a JSON array of 3 items"),
            ([None, "m.typing", {}], "destination must be a string"),
            ([["remote.example"], "m.typing", {}], "destination must be a string"),
            (["remote.example", 7, {}], "edu_type must be a string"),
            (["remote.example", "m.typing", []], "federation content must be an object"),
            (["remote.example", "m.typing", None], "federation content must be an object"),
            (["remote.example", "m.typing", "{}"], "federation content must be an object"),
        ])
