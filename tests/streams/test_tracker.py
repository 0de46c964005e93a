"""The pure position tracker: out-of-order completion, fetches, idle leaps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.streams.tracker import PositionTracker, TrackerError


class StreamsDocTableTest(SynchronousTestCase):
    def test_out_of_order_table(self):
        """The reserve/complete table of the streams document, step by step."""
        t: PositionTracker[str] = PositionTracker(1)
        steps = [
            ("reserve", 2, 1), ("reserve", 3, 1), ("complete", 3, 1), ("complete", 2, 3),
            ("reserve", 4, 3), ("reserve", 5, 3), ("reserve", 6, 3), ("complete", 5, 3),
            ("complete", 4, 5), ("complete", 6, 6),
        ]
        announced = []
        for action, stream_id, expected in steps:
            if action == "reserve":
                t.reserve([stream_id])
            else:
                announced += [c.stream_id for c in t.complete(stream_id, True, f"row{stream_id}")]
            self.assertEqual(t.position, expected, f"after {action} {stream_id}")
        self.assertEqual(announced, [2, 3, 4, 5, 6])

    def test_rollback_counts_as_completion(self):
        """A rolled-back ID unblocks the position and is returned as not ok."""
        t: PositionTracker[str] = PositionTracker(10)
        t.reserve([11, 12])
        self.assertEqual(t.complete(12, True, "b"), [])
        done = t.complete(11, False)
        self.assertEqual([(c.stream_id, c.ok) for c in done], [(11, False), (12, True)])
        self.assertEqual(t.position, 12)

    def test_in_flight_fetch_caps_position(self):
        """While a reservation is being fetched, the position stays below IDs it may get."""
        t: PositionTracker[str] = PositionTracker(5)
        t.observe_allocated(8)
        handle = t.begin_fetch()
        self.assertIsNone(t.idle_advance())
        t.observe_allocated(20)
        self.assertIsNone(t.idle_advance())
        t.end_fetch(handle, [21])
        self.assertEqual(t.position, 5)
        t.complete(21)
        self.assertEqual(t.position, 21)

    def test_completion_waits_for_fetch(self):
        """A completion above an in-flight fetch's floor waits until the fetch resolves."""
        t: PositionTracker[str] = PositionTracker(5)
        t.reserve([6])
        handle = t.begin_fetch()  # floor 6: its IDs will be >= 7
        self.assertEqual([c.stream_id for c in t.complete(6)], [6])
        self.assertEqual(t.end_fetch(handle, [7]), [])
        self.assertEqual([c.stream_id for c in t.complete(7)], [7])

    def test_idle_leap(self):
        """An idle writer leaps to the highest ID seen allocated, never backwards."""
        t: PositionTracker[str] = PositionTracker(5)
        t.observe_allocated(3)
        self.assertIsNone(t.idle_advance())
        t.observe_allocated(40)
        self.assertEqual(t.idle_advance(), 40)
        self.assertEqual(t.position, 40)
        t.reserve([41])
        t.observe_allocated(60)
        self.assertIsNone(t.idle_advance())

    def test_errors(self):
        """Completing an unreserved ID, or reserving an old one, raises."""
        t: PositionTracker[str] = PositionTracker(5)
        with self.assertRaises(TrackerError):
            t.complete(6)
        with self.assertRaises(TrackerError):
            t.reserve([5])
        t.reserve([6])
        with self.assertRaises(TrackerError):
            t.reserve([6])


@st.composite
def histories(draw):
    """A random interleaving of reservations (ascending IDs) and completions."""
    n = draw(st.integers(min_value=1, max_value=25))
    gaps = draw(st.lists(st.integers(min_value=1, max_value=3), min_size=n, max_size=n))
    ids, cur = [], 1
    for g in gaps:
        cur += g
        ids.append(cur)
    ops, reserved, pending = [], 0, []
    while reserved < n or pending:
        if reserved < n and (not pending or draw(st.booleans())):
            batch = draw(st.integers(min_value=1, max_value=min(3, n - reserved)))
            chunk = ids[reserved:reserved + batch]
            ops.append(("reserve", chunk))
            pending += chunk
            reserved += batch
        else:
            i = draw(st.integers(min_value=0, max_value=len(pending) - 1))
            ops.append(("complete", pending.pop(i), draw(st.booleans())))
    return ops


class TrackerPropertyTest(SynchronousTestCase):
    @given(histories())
    def test_matches_brute_force(self, ops):
        """For any interleaving the position equals the definition and each fact is announced once, in order."""
        t: PositionTracker[int] = PositionTracker(1)
        reserved, completed = set(), set()
        announced = []
        for op in ops:
            if op[0] == "reserve":
                t.reserve(op[1])
                reserved.update(op[1])
            else:
                _, sid, ok = op
                completed.add(sid)
                announced += [c.stream_id for c in t.complete(sid, ok, sid)]
            expected = max([1] + [c for c in completed if all(r in completed for r in reserved if r <= c)])
            self.assertEqual(t.position, expected)
            self.assertEqual(announced, sorted(c for c in completed if c <= expected))
        self.assertEqual(announced, sorted(reserved))
        self.assertTrue(t.idle)

    @given(histories(), st.data())
    def test_completing_several_at_once_is_completing_each(self, ops, data):
        """complete_many of a run of completions returns and leaves exactly what completing each in turn does."""
        one: PositionTracker[int] = PositionTracker(1)
        many: PositionTracker[int] = PositionTracker(1)
        i = 0
        while i < len(ops):
            op = ops[i]
            if op[0] == "reserve":
                one.reserve(op[1])
                many.reserve(op[1])
                i += 1
                continue
            end = i  # the completions that follow with the same outcome; some of them go at once
            while end < len(ops) and ops[end][0] == "complete" and ops[end][2] == op[2]:
                end += 1
            size = data.draw(st.integers(min_value=1, max_value=end - i))
            run = [o[1] for o in ops[i:i + size]]
            i += size
            expected = [c for sid in run for c in one.complete(sid, op[2], sid * 10)]
            got = many.complete_many(run, op[2], {sid: sid * 10 for sid in run})
            self.assertEqual(got, expected)
            self.assertEqual((many.position, many.idle, many.in_flight), (one.position, one.idle, one.in_flight))
        self.assertEqual(many.position, one.position)

    def test_completing_several_refuses_all_if_one_is_not_reserved(self):
        """An unreserved or repeated ID in complete_many raises and marks none of the others."""
        t: PositionTracker[str] = PositionTracker(5)
        t.reserve([6, 7, 8])
        for bad in ([6, 9], [6, 6], [7, 8, 5]):
            with self.assertRaises(TrackerError):
                t.complete_many(bad)
            self.assertEqual(t.in_flight, 3)
        self.assertEqual([c.stream_id for c in t.complete_many([8, 6, 7], True, {6: "a"})], [6, 7, 8])
        self.assertEqual(t.position, 8)
