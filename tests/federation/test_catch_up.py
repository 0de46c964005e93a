"""Catch-up mode: every owed event oldest first (the latest per room past the cap), vector clocks, nothing lost or doubled."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.federation.interfaces import DestinationRecord, Pdu
from synflow.federation.policy import CatchUpMode, RetryState
from synflow.tokens import StreamToken
from tests.federation.fakes import EitherTransport, Harness, fast_config, release_all, unreachable

REMOTE = "remote.test"


def delivered(h: Harness, destination: str = REMOTE) -> list[str]:
    """Event IDs in transactions the destination accepted, in order."""
    return [p.event_id for t in h.sent_callbacks if t.destination == destination for p in t.pdus]


class CatchUpTests(EitherTransport):
    """Catch-up: every owed event oldest first, or the latest per room past the cap; vector clocks.

    Run twice: over FakeTransport, and over the real treq transport on StubTreq.
    """

    def test_every_owed_event_oldest_first_in_transactions_of_50(self):
        """Catch-up sends every event the destination owes, oldest first, 50 per transaction, then leaves."""
        h = self.harness()
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        owed = [h.events.persist(f"!r{i % 7}") for i in range(120)]
        for pdu in owed:
            h.store.record_pdu(pdu, [REMOTE])  # rows written before a restart; no notification
        h.position = h.events.position()
        self.successResultOf(h.sender.start())
        self.assertEqual([len(s.event_ids) for s in h.transport.sent], [50, 50, 20])
        self.assertEqual(h.transport.events_to(REMOTE), [p.event_id for p in owed])
        q = h.sender.queue(REMOTE)
        self.assertFalse(q.catching_up)
        self.assertIsNone(q.catch_up_mode)
        self.assertEqual(h.store.records[REMOTE].last_successful, h.position)

    def test_exactly_the_cap_is_still_every_event(self):
        """A destination owing exactly catch_up_max_events gets every one of them."""
        h = self.harness(config=fast_config(catch_up_max_events=30))
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        owed = [h.events.persist(f"!r{i % 3}") for i in range(30)]
        for pdu in owed:
            h.store.record_pdu(pdu, [REMOTE])
        h.position = h.events.position()
        h.transport.default = "hold"
        h.sender.start()
        self.assertIs(h.sender.queue(REMOTE).catch_up_mode, CatchUpMode.EVERY_EVENT)
        release_all(self, h)
        self.assertEqual(delivered(h), [p.event_id for p in owed])

    def test_fresh_queue_failing_twice_loses_nothing(self):
        """A new destination's first transactions fail twice (backoff under the threshold): all 120 events arrive, in order."""
        h = self.harness(config=fast_config(catch_up_after_s=3600))
        h.transport.script[REMOTE] = [unreachable(), unreachable()]
        sent = [h.send("!room", [REMOTE]) for _ in range(120)]
        for _ in range(10):
            h.clock.advance(60)
        self.assertEqual(delivered(h), [p.event_id for p in sent])
        self.assertFalse(h.sender.queue(REMOTE).catching_up)

    def test_latest_event_per_room_past_the_cap_oldest_rooms_first_then_exit(self):
        """Owing more than catch_up_max_events, catch-up sends the latest event of each room, 50 rooms at a time, oldest first."""
        h = self.harness(config=fast_config(catch_up_max_events=119))
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        first = {f"!r{i}": h.events.persist(f"!r{i}") for i in range(60)}
        latest = {f"!r{i}": h.events.persist(f"!r{i}") for i in reversed(range(60))}
        for pdu in [*first.values(), *latest.values()]:
            h.store.record_pdu(pdu, [REMOTE])  # rows written before a restart; no notification
        h.position = h.events.position()
        self.successResultOf(h.sender.start())
        sizes = [len(s.event_ids) for s in h.transport.sent]
        self.assertEqual(sizes, [50, 10])
        expected = [latest[f"!r{i}"].event_id for i in reversed(range(60))]
        self.assertEqual(h.transport.events_to(REMOTE), expected)
        q = h.sender.queue(REMOTE)
        self.assertFalse(q.catching_up)
        self.assertEqual(h.store.records[REMOTE].last_successful, h.position)
        # Back in normal mode: a new event goes out at once, on its own.
        new = h.send("!r0", [REMOTE])
        self.assertEqual(h.transport.sent[-1].event_ids, [new.event_id])

    def test_nothing_arriving_during_catch_up_is_lost_or_sent_twice(self):
        """Events notified while catch-up runs are sent exactly once, after the older owed events."""
        h = self.harness()
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        owed = [h.events.persist(f"!r{i}") for i in range(70)]
        for pdu in owed:
            h.store.record_pdu(pdu, [REMOTE])
        h.position = h.events.position()
        h.transport.default = "hold"
        h.sender.start()
        self.assertEqual(len(h.transport.sent[0].event_ids), 50)
        during = [h.send("!r3", [REMOTE]), h.send("!r60", [REMOTE]), h.send("!new", [REMOTE])]
        q = h.sender.queue(REMOTE)
        self.assertEqual(q.pending_pdus, 0)
        release_all(self, h)
        self.assertFalse(q.catching_up)
        self.assertEqual(delivered(h), [p.event_id for p in [*owed, *during]])
        h.transport.default = "ok"
        after = h.send("!r5", [REMOTE])
        self.assertEqual(delivered(h)[-1], after.event_id)
        self.assertEqual(len(delivered(h)), len(set(delivered(h))))

    def test_nothing_arriving_during_a_latest_per_room_catch_up_is_lost_or_sent_twice(self):
        """Past the cap, events notified while catch-up runs are sent exactly once, as the latest of their room."""
        h = self.harness(config=fast_config(catch_up_max_events=10))
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        for i in range(70):
            h.store.record_pdu(h.events.persist(f"!r{i}"), [REMOTE])
        h.position = h.events.position()
        h.transport.default = "hold"
        h.sender.start()
        self.assertEqual(len(h.transport.sent[0].event_ids), 50)
        during = [
            h.send("!r3", [REMOTE]),  # a room in the batch in flight
            h.send("!r60", [REMOTE]),  # a room the next batch will read
            h.send("!new", [REMOTE]),  # a room catch-up has not seen
        ]
        q = h.sender.queue(REMOTE)
        self.assertEqual(q.pending_pdus, 0)
        release_all(self, h)
        self.assertFalse(q.catching_up)
        sent = delivered(h)
        self.assertEqual(len(sent), len(set(sent)), "an event was sent twice")
        for pdu in during:
            self.assertIn(pdu.event_id, sent)
        self.assertEqual(len(sent), 70 + 3 - 1)  # !r60's first event is superseded
        h.transport.default = "ok"
        after = h.send("!r5", [REMOTE])
        self.assertEqual(delivered(h)[-1], after.event_id)
        self.assertEqual(len(delivered(h)), len(set(delivered(h))))

    def test_pdu_skipped_while_the_last_read_runs_is_not_lost(self):
        """A PDU notified while the final empty read is running makes catch-up read once more."""
        h = self.harness()
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        h.store.hold_reads = True
        h.sender.wake_destination(REMOTE)
        q = h.sender.queue(REMOTE)
        self.assertTrue(q.catching_up)
        # The follower notifies before advancing its position.
        pdu = h.events.persist("!late")
        h.store.record_pdu(pdu, [REMOTE])
        h.sender.notify_new_pdu(pdu, [REMOTE])
        h.store.hold_reads = False
        h.store.release_read()  # the read started before the PDU: empty
        self.assertEqual(delivered(h), [pdu.event_id])
        self.assertFalse(q.catching_up)
        self.assertEqual(len(h.store.event_reads), 3)
        h.position = h.events.position()
        h.sender.notify_new_pdu(pdu, [REMOTE])  # a late duplicate notification is dropped
        self.assertEqual(delivered(h), [pdu.event_id])

    def test_out_of_order_completion_across_writers_loses_nothing(self):
        """A slow writer's lower event completing after a faster writer's higher one is still sent."""
        h = self.harness(writers=(1, 2))
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(0))
        slow = h.events.persist("!b", writer=1, complete=False)  # stream id 1, still in flight
        fast = h.send("!a", [REMOTE], writer=2)  # stream id 2, completes first
        self.assertEqual(str(h.position), "m0~2.2")
        self.assertEqual(delivered(h), [fast.event_id])
        reached = h.store.records[REMOTE].last_successful
        assert reached is not None
        # A single integer would now say "2" and the slow event (1) would be skipped.
        self.assertEqual(str(reached), "m0~2.2")
        self.assertFalse(reached.covers(slow.instance_id, slow.stream_ordering))
        h.events.complete(slow)
        h.deliver(slow, [REMOTE])
        self.assertEqual(delivered(h), [fast.event_id, slow.event_id])
        self.assertEqual(str(h.store.records[REMOTE].last_successful), "m0~1.1~2.2")

    def test_out_of_order_completion_during_catch_up(self):
        """With a destination down, catch-up later finds the slow writer's lower event as well."""
        h = self.harness(writers=(1, 2), config=fast_config(catch_up_after_s=15))
        h.settle(REMOTE)
        h.transport.default = unreachable()
        h.send("!x", [REMOTE], writer=1)
        q = h.sender.queue(REMOTE)
        h.clock.advance(10)  # second failure: 20 s > 15 s, catch-up mode
        self.assertTrue(q.catching_up)
        slow = h.events.persist("!b", writer=1, complete=False)
        fast = h.send("!a", [REMOTE], writer=2)
        h.transport.default = "ok"
        h.clock.advance(q.backoff_interval_s)
        self.assertIn(fast.event_id, delivered(h))
        self.assertNotIn(slow.event_id, delivered(h))
        h.events.complete(slow)
        h.deliver(slow, [REMOTE])
        self.assertIn(slow.event_id, delivered(h))
        self.assertEqual(len(delivered(h)), 3)

    def test_store_breaking_the_contract_is_refused(self):
        """A store that returns an entry already covered is refused instead of looping."""
        h = self.harness()
        pdu = h.events.persist("!r")
        h.store.records[REMOTE] = DestinationRecord(REMOTE, RetryState(), StreamToken.at(5))
        h.store.owed_events = lambda d, after, upto: [pdu]  # type: ignore[method-assign]
        h.sender.wake_destination(REMOTE)
        self.assertEqual(h.transport.sent, [])
        self.assertTrue(h.sender.queue(REMOTE).catching_up)


class CatchUpTest(CatchUpTests, SynchronousTestCase):
    """Catch-up: every owed event, or the latest per room past the cap; vector clocks (FakeTransport)."""


class CatchUpTreqTest(CatchUpTests, SynchronousTestCase):
    """Catch-up: every owed event, or the latest per room past the cap; vector clocks (treq on StubTreq)."""

    treq = True


class Follower:
    """The lead's events follower: in each writer's order, rows first, then notify."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.persisted: dict[int, list[Pdu]] = {w: [] for w in h.events.writers}
        self.latest: dict[str, Pdu] = {}
        self.all: list[Pdu] = []

    def persist(self, room: str, writer: int, complete: bool) -> None:
        pdu = self.h.events.persist(room, writer, complete=complete)
        self.persisted[writer].append(pdu)
        self.latest[room] = pdu
        self.all.append(pdu)

    def complete_oldest(self) -> None:
        pending = [p for ps in self.persisted.values() for p in ps
                   if p.stream_ordering in self.h.events.pending[p.instance_id]]
        if pending:
            self.h.events.complete(min(pending, key=lambda p: p.stream_ordering))

    def process(self) -> None:
        position = self.h.events.position()
        for writer, pdus in self.persisted.items():
            while pdus and position.covers(writer, pdus[0].stream_ordering):
                pdu = pdus.pop(0)
                self.h.store.record_pdu(pdu, [REMOTE])
                self.h.sender.notify_new_pdu(pdu, [REMOTE])
        self.h.position = self.h.position.merge(position)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("persist"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("complete")),
        st.tuples(st.just("advance"), st.integers(1, 60)),
        st.tuples(st.just("outage"), st.booleans()),
        st.tuples(st.just("down_for"), st.integers(5, 120)),
    ),
    max_size=60,
)


def run_ops(testcase: SynchronousTestCase, ops: list, max_events: int) -> tuple[Harness, Follower]:
    """Drive a sender (catch-up cap ``max_events``) through ``ops``, then let everything settle."""
    h = Harness(writers=(1, 2), config=fast_config(catch_up_after_s=15, catch_up_max_events=max_events))
    h.sender.start()
    f = Follower(h)
    for op in ops:
        if op[0] == "persist":
            # One writer per room, as rooms are sharded over persisters.
            f.persist(f"!r{op[1]}", op[1] % 2 + 1, op[2])
        elif op[0] == "complete":
            f.complete_oldest()
        elif op[0] == "advance":
            h.clock.advance(op[1])
        elif op[0] == "down_for":
            h.transport.default = unreachable()
            f.persist("!r0", 1, True)
            f.process()
            h.clock.pump([5] * (op[1] // 5))
            h.transport.default = "ok"
        else:
            h.transport.default = unreachable() if op[1] else "ok"
        f.process()
    h.transport.default = "ok"
    for pdus in f.persisted.values():
        for p in pdus:
            h.events.complete(p)
    f.process()
    for _ in range(10):
        h.clock.advance(60)  # the periodic wake-up and the retry timers
    sent = delivered(h)
    testcase.assertEqual(len(sent), len(set(sent)), f"sent twice: {sent}")
    if f.latest:
        q = h.sender.queue(REMOTE)
        testcase.assertFalse(q.catching_up)
        testcase.assertEqual(q.pending_pdus, 0)
    return h, f


class CatchUpPropertyTest(SynchronousTestCase):
    @settings(max_examples=60)
    @given(steps)
    def test_every_event_arrives_once_in_room_order(self, ops):
        """Whatever the outages and completion order, under the cap every event arrives once, each room's in order."""
        h, f = run_ops(self, ops, max_events=10_000)
        by_room: dict[str, list[str]] = {}
        for t in h.sent_callbacks:
            for p in t.pdus:
                by_room.setdefault(p.room_id, []).append(p.event_id)
        expected: dict[str, list[str]] = {}
        for p in sorted(f.all, key=lambda p: p.stream_ordering):
            expected.setdefault(p.room_id, []).append(p.event_id)
        self.assertEqual(by_room, expected)

    @settings(max_examples=60)
    @given(steps, st.integers(0, 5))
    def test_past_the_cap_every_room_ends_with_its_latest_event_sent_once(self, ops, max_events):
        """With a small cap, whatever the outages and completion order, each room's latest event arrives, nothing twice."""
        h, f = run_ops(self, ops, max_events=max_events)
        last_in_room: dict[str, str] = {}
        for t in h.sent_callbacks:
            for p in t.pdus:
                last_in_room[p.room_id] = p.event_id
        self.assertEqual(last_in_room, {room: p.event_id for room, p in f.latest.items()})
