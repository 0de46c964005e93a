"""One destination's queue: single flight, batching, backoff, stable transaction IDs."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from synflow.config import BackoffSection
from synflow.federation.interfaces import DestinationRecord, TransactionFailed
from synflow.federation.policy import RetryState
from synflow.tokens import StreamToken
from tests.federation.fakes import EitherTransport, fast_config, release_all, unreachable

REMOTE = "remote.test"


class SingleFlightTests(EitherTransport):
    """One transaction in flight, batches of 50 PDUs and 100 EDUs, oldest first.

    Run twice: over FakeTransport, and over the real treq transport on StubTreq.
    """

    def test_never_two_transactions_in_flight(self):
        """While a transaction is in flight, new PDUs wait; the next goes only after the reply."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.default = "hold"
        for i in range(30):
            h.send(f"!r{i}", [REMOTE])
        self.assertEqual(len(h.transport.sent), 1)
        self.assertTrue(h.sender.queue(REMOTE).in_flight)
        release_all(self, h)
        self.assertEqual(h.transport.max_in_flight[REMOTE], 1)
        self.assertEqual([len(s.event_ids) for s in h.transport.sent], [1, 29])
        self.assertEqual(h.sender.queue(REMOTE).pending_pdus, 0)

    def test_120_pdus_go_out_as_50_50_20(self):
        """120 PDUs queued behind a transaction go out oldest first as 50, 50 and 20."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = ["hold"]
        h.edu(REMOTE)
        pdus = [h.send(f"!r{i}", [REMOTE]) for i in range(120)]
        self.assertEqual(h.sender.queue(REMOTE).pending_pdus, 120)
        h.transport.release()
        self.assertEqual([len(s.event_ids) for s in h.transport.sent], [0, 50, 50, 20])
        self.assertEqual(h.transport.events_to(REMOTE), [p.event_id for p in pdus])
        self.assertEqual(h.transport.max_in_flight[REMOTE], 1)

    def test_250_edus_go_out_as_100_100_50(self):
        """250 EDUs queued behind a transaction go out oldest first as 100, 100 and 50."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = ["hold"]
        h.send("!r", [REMOTE])
        for i in range(250):
            h.edu(REMOTE, i)
        h.transport.release()
        self.assertEqual([s.edu_count for s in h.transport.sent], [0, 100, 100, 50])
        sent = [e["content"]["n"] for s in h.transport.sent for e in s.body.get("edus", [])]
        self.assertEqual(sent, list(range(250)))
        self.assertNotIn("edus", h.transport.sent[0].body)

    def test_success_records_a_vector_clock(self):
        """After PDUs from two writers are sent, last_successful has each writer's highest."""
        h = self.harness(writers=(1, 2))
        h.settle(REMOTE)
        start = h.sender.queue(REMOTE).last_successful
        assert start is not None
        h.transport.script[REMOTE] = ["hold"]
        a = h.send("!a", [REMOTE], writer=1)
        b = h.send("!b", [REMOTE], writer=2, complete=False)
        h.transport.release()
        got = h.store.records[REMOTE].last_successful
        self.assertEqual(got, start.advance(1, a.stream_ordering).advance(2, b.stream_ordering))
        self.assertEqual(h.sender.queue(REMOTE).last_successful, got)


class SingleFlightTest(SingleFlightTests, SynchronousTestCase):
    """One transaction in flight, batches of 50 PDUs and 100 EDUs, oldest first (FakeTransport)."""


class SingleFlightTreqTest(SingleFlightTests, SynchronousTestCase):
    """One transaction in flight, batches of 50 PDUs and 100 EDUs, oldest first (treq on StubTreq)."""

    treq = True


class BackoffTests(EitherTransport):
    """Backoff, stable transaction IDs, and the catch-up threshold.

    Run twice: over FakeTransport, and over the real treq transport on StubTreq.
    """

    def test_retries_back_off_with_growing_intervals_up_to_the_cap(self):
        """A failing destination is retried after 10 s, then about twice as long each time, capped at 80 s."""
        h = self.harness(config=fast_config(catch_up_after_s=3600))
        h.settle(REMOTE)
        h.transport.default = unreachable()
        h.send("!r", [REMOTE])
        for _ in range(600):
            h.clock.advance(1)
        times = [s.at for s in h.transport.sent]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        self.assertEqual(gaps[0], 10)
        for prev, gap in zip(gaps, gaps[1:], strict=False):
            self.assertGreaterEqual(gap, min(prev * 1.6, 80) - 1)
            self.assertLessEqual(gap, 80)
        self.assertEqual(gaps[-3:], [80, 80, 80])
        retry = h.store.records[REMOTE].retry
        self.assertEqual(retry.retry_interval, 80_000)
        self.assertEqual(retry, h.sender.queue(REMOTE).retry)
        self.assertTrue(h.sender.queue(REMOTE).backing_off)

    def test_same_transaction_keeps_its_id_across_retries(self):
        """A transaction answered 500 then 200 is resent with the same ID and body; the next gets a new ID."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = [TransactionFailed("HTTP 500", retriable=True), "hold"]
        h.send("!a", [REMOTE])
        h.send("!b", [REMOTE])  # arrives during the backoff: must not join the retried transaction
        h.clock.advance(10)
        first, retry = h.transport.sent
        self.assertEqual(retry.txn_id, first.txn_id)
        self.assertEqual(retry.body, first.body)
        h.transport.release()
        third = h.transport.sent[2]
        self.assertNotEqual(third.txn_id, first.txn_id)
        self.assertEqual(third.event_ids, ["$e2"])

    def test_backoff_survives_a_restart(self):
        """A queue created after a restart honours the backoff stored for its destination."""
        h = self.harness()
        now = int(h.clock.seconds() * 1000)
        h.store.records[REMOTE] = DestinationRecord(
            REMOTE, RetryState(now, 30_000, now), StreamToken.at(0)
        )
        h.send("!r", [REMOTE])
        self.assertEqual(h.transport.sent, [])
        h.clock.advance(29)
        self.assertEqual(h.transport.sent, [])
        h.clock.advance(1)
        self.assertEqual(h.transport.events_to(REMOTE), ["$e1"])
        self.assertEqual(h.store.records[REMOTE].retry, RetryState())

    def test_recovery_clears_the_stored_backoff(self):
        """The first success after failures clears the retry state in the store and flags the recovery."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = [unreachable()]
        h.send("!r", [REMOTE])
        self.assertEqual(h.store.records[REMOTE].retry.retry_interval, 10_000)
        h.clock.advance(10)
        self.assertEqual(h.store.records[REMOTE].retry, RetryState())
        self.assertEqual([t.recovered for t in h.sent_callbacks], [True])

    def test_threshold_drops_the_queue_and_enters_catch_up(self):
        """Once the interval passes catch_up_after_s the in-memory PDUs and EDUs are dropped for catch-up."""
        h = self.harness(config=fast_config(catch_up_after_s=60))
        h.settle(REMOTE)
        h.transport.default = unreachable()
        for i in range(5):
            h.send(f"!r{i}", [REMOTE])
            h.edu(REMOTE, i)
        q = h.sender.queue(REMOTE)
        intervals = []
        for _ in range(20):  # bounded: a build that never enters catch-up fails instead of hanging
            if q.catching_up:
                break
            intervals.append(q.retry.retry_interval)
            h.clock.advance(q.backoff_interval_s)
        else:
            self.fail(f"no catch-up after intervals {intervals}")
        self.assertGreater(q.retry.retry_interval, 60_000)
        self.assertTrue(all(i <= 60_000 for i in intervals[1:]))
        self.assertEqual((q.pending_pdus, q.pending_edus), (0, 0))
        # Still unreachable: catch-up retries with backoff, and nothing is queued meanwhile.
        h.send("!late", [REMOTE])
        self.assertEqual(q.pending_pdus, 0)
        # The destination comes back: catch-up sends the latest event of each room.
        h.transport.default = "ok"
        h.clock.advance(q.backoff_interval_s)
        self.assertFalse(q.catching_up)
        last = h.transport.sent[-1]
        self.assertEqual(last.event_ids, ["$e1", "$e2", "$e3", "$e4", "$e5", "$e6"])
        self.assertEqual(last.edu_count, 0)

    def test_cap_and_jitter_come_from_config(self):
        """The backoff parameters are read from federation.backoff."""
        h = self.harness(config=fast_config(backoff=BackoffSection(initial_s=2, multiplier=3, max_s=5, jitter=0)))
        h.settle(REMOTE)
        h.transport.default = unreachable()
        h.send("!r", [REMOTE])
        q = h.sender.queue(REMOTE)
        seen = []
        for _ in range(4):
            seen.append(q.backoff_interval_s)
            h.clock.advance(q.backoff_interval_s)
        self.assertEqual(seen, [2, 5, 5, 5])


class BackoffTest(BackoffTests, SynchronousTestCase):
    """Backoff, stable transaction IDs, and the catch-up threshold (FakeTransport)."""


class BackoffTreqTest(BackoffTests, SynchronousTestCase):
    """Backoff, stable transaction IDs, and the catch-up threshold (treq on StubTreq)."""

    treq = True


class StopTests(EitherTransport):
    """Stopping waits for the transaction in flight.

    Run twice: over FakeTransport, and over the real treq transport on StubTreq.
    """

    def test_stop_waits_for_the_transaction_in_flight(self):
        """stop() fires only once the in-flight transaction has finished, and nothing new starts."""
        h = self.harness()
        h.settle(REMOTE)
        h.transport.script[REMOTE] = ["hold"]
        h.send("!a", [REMOTE])
        h.send("!b", [REMOTE])
        d = h.sender.stop()
        self.assertNoResult(d)
        h.transport.release()
        self.successResultOf(d)
        self.assertEqual(len(h.transport.sent), 1)


class StopTest(StopTests, SynchronousTestCase):
    """Stopping waits for the transaction in flight (FakeTransport)."""


class StopTreqTest(StopTests, SynchronousTestCase):
    """Stopping waits for the transaction in flight (treq on StubTreq)."""

    treq = True
