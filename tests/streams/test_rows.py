"""Stream row types: wire round trips, and every malformed row refused with a clear error."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.streams import CachesRow, EventsRow, StreamRowError

_s = st.text(max_size=20)
_events = st.builds(EventsRow, _s, _s, _s, st.none() | _s, _s, st.none() | _s)


class EventsRowTest(SynchronousTestCase):
    @given(_events)
    def test_round_trip(self, row: EventsRow) -> None:
        self.assertEqual(EventsRow.from_wire(row.to_wire()), row)

    def test_malformed_rows_refused(self) -> None:
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

    def test_caches_row_round_trip(self) -> None:
        row = CachesRow("get_user_by_id", ("@b:hs",), 1700000000000)
        self.assertEqual(CachesRow.from_wire(row.to_wire()), row)
