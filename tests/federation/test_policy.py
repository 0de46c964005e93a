"""The pure federation policy: bounds, retry state, vector-clock positions."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.backoff import Backoff
from synflow.federation.interfaces import Edu, Pdu
from synflow.federation.policy import (
    CATCH_UP_BATCH,
    MAX_EDUS_PER_TRANSACTION,
    MAX_PDUS_PER_TRANSACTION,
    CatchUpMode,
    RetryState,
    TransactionIds,
    advance_for_sent,
    catch_up_position,
    choose_catch_up_mode,
    clamp,
    compose_transaction,
    transaction_body,
)
from synflow.tokens import StreamToken

BACKOFF = Backoff(initial_s=10.0, multiplier=2.0, max_s=3600.0, jitter=0.2)


def pdu(so: int, writer: int = 1, room: str | None = None) -> Pdu:
    return Pdu(f"$e{so}.{writer}", room or f"!r{so}", writer, so, {"event_id": f"$e{so}.{writer}"})


tokens = st.builds(
    lambda m, extra: StreamToken.from_positions({i: m + d for i, d in extra.items()}, m),
    st.integers(0, 30),
    st.dictionaries(st.integers(1, 4), st.integers(0, 30), max_size=4),
)


class ComposeTest(SynchronousTestCase):
    def test_bounds_are_the_matrix_limits(self):
        """A transaction carries at most 50 PDUs and 100 EDUs; a catch-up transaction 50 entries."""
        self.assertEqual((MAX_PDUS_PER_TRANSACTION, MAX_EDUS_PER_TRANSACTION, CATCH_UP_BATCH), (50, 100, 50))

    def test_120_pdus_split_50_50_20(self):
        """Draining 120 queued PDUs takes transactions of 50, 50 and 20, in order."""
        queue = deque(pdu(i) for i in range(120))
        sizes, seen = [], []
        while queue:
            pdus, _ = compose_transaction(queue, [])
            sizes.append(len(pdus))
            seen += [p.stream_ordering for p in pdus]
            for _ in pdus:
                queue.popleft()
        self.assertEqual(sizes, [50, 50, 20])
        self.assertEqual(seen, list(range(120)))

    @given(st.integers(0, 300), st.integers(0, 300))
    def test_oldest_first_within_bounds(self, n_pdus, n_edus):
        """The composed transaction is the oldest prefix of each queue, within its bound."""
        pdus = [pdu(i) for i in range(n_pdus)]
        edus = [Edu("m.x", {"n": i}) for i in range(n_edus)]
        got_pdus, got_edus = compose_transaction(pdus, edus)
        self.assertEqual(got_pdus, pdus[: min(n_pdus, 50)])
        self.assertEqual(got_edus, edus[: min(n_edus, 100)])

    def test_body_leaves_out_empty_edus(self):
        """The /send body has origin, origin_server_ts and pdus; edus only when there are some."""
        body = transaction_body("hs", 5, [pdu(1)], [])
        self.assertEqual(body, {"origin": "hs", "origin_server_ts": 5, "pdus": [{"event_id": "$e1.1"}]})
        body = transaction_body("hs", 5, [], [Edu("m.typing", {"a": 1})])
        self.assertEqual(body["edus"], [{"edu_type": "m.typing", "content": {"a": 1}}])

    def test_transaction_ids_are_unique(self):
        """Transaction IDs never repeat within a generator or between generators of different ms."""
        a, b = TransactionIds(1000), TransactionIds(1001)
        ids = [a.next_id() for _ in range(500)] + [b.next_id() for _ in range(500)]
        self.assertEqual(len(set(ids)), 1000)

    def test_transaction_ids_are_unpredictable(self):
        """Two generators started in the same ms share no ID; each ID ends in 128 random bits."""
        a, b = TransactionIds(1000), TransactionIds(1000)
        first = [a.next_id() for _ in range(100)]
        second = [b.next_id() for _ in range(100)]
        self.assertEqual(set(first) & set(second), set())
        for txn_id in first:
            self.assertGreaterEqual(len(txn_id.rsplit(".", 1)[1]), 22)
        self.assertEqual(TransactionIds(7, token=lambda: "r").next_id(), "7.1.r")


class RetryStateTest(SynchronousTestCase):
    def test_first_failure_waits_the_initial_interval(self):
        """The first failure sets retry_last_ts=now, the initial interval and failure_ts."""
        s = RetryState().after_failure(5000, BACKOFF, random.Random(0))
        self.assertEqual(s, RetryState(retry_last_ts=5000, retry_interval=10_000, failure_ts=5000))
        self.assertFalse(s.is_due(14_999))
        self.assertTrue(s.is_due(15_000))

    def test_success_clears(self):
        """A success returns the cleared state, which is always due."""
        s = RetryState(1, 2, 3).after_success()
        self.assertEqual(s, RetryState())
        self.assertTrue(s.is_due(0))
        self.assertFalse(s.failing)

    def test_catch_up_threshold_is_strictly_exceeded(self):
        """Catch-up is needed only once the interval is strictly beyond the threshold."""
        self.assertFalse(RetryState(0, 3_600_000).needs_catch_up(3600))
        self.assertTrue(RetryState(0, 3_600_001).needs_catch_up(3600))

    @given(st.integers(1, 60), st.randoms(use_true_random=False))
    def test_intervals_grow_with_jitter_up_to_the_cap(self, failures, rng):
        """Each failure multiplies the interval by 2 x [0.8, 1.2], capped at max_s; failure_ts stays put."""
        s = RetryState()
        now = 1000
        for _ in range(failures):
            prev = s
            s = s.after_failure(now, BACKOFF, rng)
            self.assertEqual(s.failure_ts, 1000)
            self.assertEqual(s.retry_last_ts, now)
            self.assertLessEqual(s.retry_interval, 3_600_000)
            if prev.retry_interval:
                self.assertGreaterEqual(s.retry_interval, min(prev.retry_interval * 1.6 - 1, 3_600_000))
                self.assertLessEqual(s.retry_interval, prev.retry_interval * 2.4 + 1)
            now = s.due_at_ms
        if failures >= 14:  # 10 s x 1.6^13 > 3600 s
            self.assertEqual(s.retry_interval, 3_600_000)


class PositionTest(SynchronousTestCase):
    def test_advance_for_sent_moves_each_writer(self):
        """After a queued transaction each writer's component is its highest PDU sent."""
        token = advance_for_sent(StreamToken.at(3), [pdu(5, 1), pdu(9, 2), pdu(7, 1)])
        self.assertEqual(str(token), "m3~1.7~2.9")
        self.assertEqual(str(advance_for_sent(None, [pdu(4, 1)])), "m0~1.4")

    @given(tokens, st.integers(0, 70))
    def test_clamp(self, token, ceiling):
        """clamp lowers every writer to at most the ceiling and leaves lower ones alone."""
        c = clamp(token, ceiling)
        for i in range(0, 6):
            self.assertEqual(c.get(i), min(token.get(i), ceiling))

    def test_vector_clock_keeps_a_slow_writer_behind(self):
        """A short batch moves to upto, which keeps a slow writer behind a fast one's later event."""
        upto = StreamToken.from_positions({1: 9, 2: 11})
        token = catch_up_position(StreamToken.at(0), upto, [pdu(11, 2)])
        self.assertEqual(str(token), "m9~2.11")
        self.assertFalse(token.covers(1, 10))

    @given(
        st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), unique=True, max_size=60),
        tokens,
        tokens,
        st.integers(1, 8),
    )
    def test_catch_up_never_covers_an_unhandled_entry(self, entries, after, upto, limit):
        """After a batch, every entry the new position newly covers was in the batch, and progress is made."""
        needed = sorted(
            (so, w) for so, w in entries if not after.covers(w, so) and upto.covers(w, so)
        )
        batch = [pdu(so, w) for so, w in needed[:limit]]
        new = catch_up_position(after, upto, batch, limit)
        self.assertTrue(after.is_before_or_eq(new))
        in_batch = {(p.stream_ordering, p.instance_id) for p in batch}
        for so, w in entries:
            if new.covers(w, so) and not after.covers(w, so):
                self.assertIn((so, w), in_batch, f"{so}/{w} covered by {new} but not sent")
        for p in batch:
            self.assertTrue(new.covers(p.instance_id, p.stream_ordering))
        self.assertTrue(new.is_before_or_eq(after.merge(upto)))


class CatchUpModeTest(SynchronousTestCase):
    @given(st.integers(0, 20_000), st.integers(0, 20_000))
    def test_every_event_up_to_the_cap_latest_per_room_past_it(self, owed, cap):
        """A destination owing at most the cap gets every event; one owing more, the latest of each room."""
        mode = choose_catch_up_mode(owed, cap)
        self.assertIs(mode, CatchUpMode.EVERY_EVENT if owed <= cap else CatchUpMode.LATEST_PER_ROOM)

    def test_the_edges_of_the_default_cap(self):
        """10,000 owed events are all sent; 10,001 switch to the latest per room."""
        self.assertIs(choose_catch_up_mode(10_000, 10_000), CatchUpMode.EVERY_EVENT)
        self.assertIs(choose_catch_up_mode(10_001, 10_000), CatchUpMode.LATEST_PER_ROOM)
        self.assertIs(choose_catch_up_mode(0, 0), CatchUpMode.EVERY_EVENT)

    def test_negative_counts_are_refused(self):
        """A negative count or cap is a programming error, refused loudly."""
        self.assertRaises(ValueError, choose_catch_up_mode, -1, 5)
        self.assertRaises(ValueError, choose_catch_up_mode, 1, -5)
