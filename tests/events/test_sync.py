"""SyncHandler catching up with a token from a faster process, over a real store and a controlled view."""

from __future__ import annotations

from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, inlineCallbacks, succeed
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import TestCase

from synflow.events.sync import CATCH_UP_TIMEOUT_S, SyncHandler
from synflow.replication.commands import PositionCommand, RdataCommand
from synflow.storage.stores import SyncEvent
from synflow.streams import EventsRow
from synflow.tokens import StreamToken
from tests.cluster import single_master_with_user
from tests.replication.fakes import positions_view


def _real(seconds: float) -> Deferred[None]:
    return deferLater(reactor, seconds, lambda: None)


class CatchUpTest(TestCase):
    """A second SyncHandler over the master's store whose view of the writer lags, on a fake clock."""

    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, self.alice = yield single_master_with_user(self)
        room = yield ensureDeferred(self.alice.create_room())
        self.sent = yield ensureDeferred(self.alice.send(room, {"body": "x"}, "t1"))
        ids = yield self.master.instances.ids_for(["master"])
        token = StreamToken.parse(self.sent["token"])
        self.before = token.get(ids["master"])  # the send token: just before the event
        # This process has seen the writer only up to two events before the send.
        self.lag = self.before - 1
        self.clock = Clock()
        # Nothing to catch up from: the rows are read from the store by sync itself.
        self.view, self.conn = positions_view("lagging", self.clock, known={"master": self.lag})
        self.sync = SyncHandler(self.master.worker.store, self.view, self.master.instances, self.clock)

    def start(self, timeout_ms: int = 0) -> Deferred[Any]:
        return ensureDeferred(self.sync.sync(self.alice.user_id, self.alice.user_id, self.sent["token"], timeout_ms, 10))

    @inlineCallbacks
    def test_timeout_zero_waits_for_the_token(self):
        """A timeout=0 sync from a token this process has not reached waits for it, then returns the sent event."""
        d = self.start()
        yield _real(0.3)
        self.assertFalse(d.called)
        self.view.on_command(self.conn, PositionCommand("events", "master", self.lag, self.before + 1))
        result = yield d
        self.assertEqual([e.event_id for e in result.events], [self.sent["event_id"]])

    @inlineCallbacks
    def test_catch_up_is_bounded(self):
        """If this process never catches up, a timeout=0 sync answers after CATCH_UP_TIMEOUT_S with the token unchanged."""
        d = self.start()
        elapsed = 0.0
        while elapsed < CATCH_UP_TIMEOUT_S - 0.5:
            yield _real(0.05)
            self.clock.advance(0.5)
            elapsed += 0.5
            self.assertFalse(d.called, elapsed)
        for _ in range(20):
            yield _real(0.05)
            self.clock.advance(0.5)
        result = yield d
        self.assertEqual((result.events, result.next_batch), ([], self.sent["token"]))

    @inlineCallbacks
    def test_nothing_written_since_the_token_reads_nothing(self):
        """A sync from the token this process is at answers nothing new without reading events from the store."""
        self.view.on_command(self.conn, PositionCommand("events", "master", self.lag, self.before + 1))
        first = yield self.start()
        self.assertEqual([e.event_id for e in first.events], [self.sent["event_id"]])
        reads: list[Any] = []
        store = self.master.worker.store
        read = store.get_events_in_window
        self.patch(store, "get_events_in_window", lambda *a: reads.append(a) or read(*a))
        again = yield ensureDeferred(self.sync.sync(self.alice.user_id, self.alice.user_id, first.next_batch, 0, 10))
        self.assertEqual((again.events, again.next_batch, reads), ([], first.next_batch, []))


class OneTurnTest(TestCase):
    """Long-polls woken by RDATA on a fake clock: several transactions of one read answer once, with all of them,
    and news that arrives while the sync still reads is not missed."""

    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, self.alice = yield single_master_with_user(self)
        self.room = yield ensureDeferred(self.alice.create_room())
        self.first = yield ensureDeferred(self.alice.send(self.room, {"body": "1"}, "t1"))
        self.second = yield ensureDeferred(self.alice.send(self.room, {"body": "2"}, "t2"))
        self.store = self.master.worker.store
        everything = yield self.store.get_events_in_window(None, {}, 0, {}, 2**62, 1000)
        self.ordering = {e.event_id: e.stream_ordering for e in everything}

    @inlineCallbacks
    def reader(self, at: int):
        """A SyncHandler on a fake clock whose view has the writer at ``at`` (connected, nothing new), and its token."""
        self.clock = Clock()
        self.view, self.conn = positions_view("reader", self.clock, known={"master": at})
        self.view.on_command(self.conn, PositionCommand("events", "master", at, at))
        sync = SyncHandler(self.store, self.view, self.master.instances, self.clock)
        ids = yield self.master.instances.ids_for(["master"])
        return sync, str(StreamToken.from_positions({ids["master"]: at}))

    def arrive(self, sent: dict[str, Any]) -> None:
        """The RDATA of a sent event (its own transaction) arrives at the reader."""
        row = EventsRow(sent["event_id"], self.room, "m.room.message", None, self.alice.user_id, None)
        self.view.on_command(self.conn, RdataCommand("events", "master", self.ordering[sent["event_id"]], row.to_wire()))

    @inlineCallbacks
    def test_transactions_of_one_read_are_in_one_answer(self):
        sync, since = yield self.reader(self.ordering[self.first["event_id"]] - 1)
        polled = ensureDeferred(sync.sync(self.alice.user_id, self.alice.user_id, since, 10_000, 10))
        for _ in range(50):  # until the long-poll waits (its reads of the store run on the real reactor)
            if sync.waiting:
                break
            yield _real(0.02)
        self.assertEqual(sync.waiting, 1)
        for sent in (self.first, self.second):  # two transactions, one read: one RDATA each
            self.arrive(sent)
        self.clock.advance(0)
        result = yield polled
        self.assertEqual([e.event_id for e in result.events], [self.first["event_id"], self.second["event_id"]])

    @inlineCallbacks
    def test_news_that_arrives_while_the_sync_reads_is_not_missed(self):
        """An event whose position arrives while a long-poll is still reading answers it, with no wait for a wake-up."""
        sync, since = yield self.reader(self.ordering[self.first["event_id"]])  # the head: nothing new yet
        gate: Deferred[None] = Deferred()
        rooms_of = self.store.get_rooms_for_user
        gated: list[str] = []

        async def slow_rooms(user_id: str) -> Any:
            if not gated:  # the first read of the user's rooms is still out when the news arrives
                gated.append(user_id)
                await gate
            return await rooms_of(user_id)

        self.patch(self.store, "get_rooms_for_user", lambda user_id: ensureDeferred(slow_rooms(user_id)))
        user = self.alice.user_id
        polled = ensureDeferred(sync.sync(user, user, since, 10_000, 10))
        self.assertEqual(gated, [user])
        self.arrive(self.second)
        self.clock.advance(0)  # the wake-up of this position has gone by: nobody was waiting yet
        gate.callback(None)
        for _ in range(50):  # its reads of the store run on the real reactor; the fake clock never moves
            if polled.called:
                break
            yield _real(0.02)
        result = yield polled
        self.assertEqual([e.event_id for e in result.events], [self.second["event_id"]])
        self.assertEqual(sync.waiting, 0)

    def test_news_since_a_read(self) -> None:
        """Rows counted since a read began: only the sync's rooms or its user's membership count, and lost ones do."""
        from synflow.events import sync as sync_module

        handler = _Handler()
        sync = SyncHandler(None, handler, None, Clock())  # type: ignore[arg-type]
        rooms = frozenset({"!a:t"})
        self.assertFalse(sync._news_since(0, "@u:t", rooms))
        handler.rows("master", 1, [_row("!z:t", 1)])
        handler.position("master", 1)
        self.assertFalse(sync._news_since(0, "@u:t", rooms))  # another room
        handler.rows("master", 2, [_row("!new:t", 2, member="@u:t")])
        handler.position("master", 2)
        self.assertTrue(sync._news_since(0, "@u:t", rooms))  # the user joined a room
        self.assertFalse(sync._news_since(2, "@u:t", rooms))
        handler.rows("master", 3, [_row("!a:t", 3)])
        handler.position("master", 3)
        self.assertTrue(sync._news_since(2, "@u:t", rooms))
        self.patch(sync_module, "RECENT_NEWS", 2)
        sync = SyncHandler(None, handler, None, Clock())  # type: ignore[arg-type]
        for n in range(1, 5):
            handler.rows("master", n, [_row("!z:t", n)])
            handler.position("master", n)
        self.assertFalse(sync._news_since(2, "@u:t", rooms))  # rows 3 and 4 kept: neither is news
        self.assertTrue(sync._news_since(1, "@u:t", rooms))  # row 2 is gone: it may have been


class _Handler:
    """The two hooks SyncHandler takes from a replication handler."""

    def __init__(self) -> None:
        self.rows: Any = None
        self.position: Any = None

    def add_row_handler(self, stream: str, fn: Any) -> None:
        self.rows = fn

    def add_position_listener(self, stream: str, fn: Any) -> None:
        self.position = fn


def _row(room: str, n: int, member: str | None = None) -> EventsRow:
    if member is None:
        return EventsRow(f"$e{n}:t", room, "m.room.message", None, "@s:t", None)
    return EventsRow(f"$e{n}:t", room, "m.room.member", member, member, "join")


class WakeUpTest(TestCase):
    """Long-polling syncs are woken by rows of their rooms or their user's membership, and by nothing else."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.handler = _Handler()
        self.sync = SyncHandler(None, self.handler, None, self.clock)  # type: ignore[arg-type]

    def rows(self, *rows: EventsRow) -> None:
        """``rows`` at a position, then the end of the reactor turn."""
        self.handler.rows("master", 1, list(rows))
        self.handler.position("master", 1)
        self.clock.advance(0)

    def test_woken_only_by_its_rooms_or_its_user(self) -> None:
        ab = self.sync._wait_for_news("@a:t", frozenset({"!a:t", "!b:t"}), 30)
        c = self.sync._wait_for_news("@c:t", frozenset({"!c:t"}), 30)
        self.assertEqual(self.sync.waiting, 2)
        self.rows(_row("!z:t", 1))  # nobody's room
        self.assertNoResult(ab)
        self.assertNoResult(c)
        self.rows(_row("!b:t", 2))
        self.successResultOf(ab)
        self.assertNoResult(c)
        self.assertEqual(self.sync.waiting, 1)
        self.rows(_row("!new:t", 3, member="@c:t"))  # @c:t joined a room it did not wait on
        self.successResultOf(c)
        self.assertEqual(self.sync.waiting, 0)
        self.assertEqual((self.sync._waiting_on_room, self.sync._waiting_user), ({}, {}))

    def test_rows_wake_at_the_position_not_before(self) -> None:
        d = self.sync._wait_for_news("@a:t", frozenset({"!a:t"}), 30)
        self.handler.rows("master", 1, [_row("!a:t", 1)])
        self.assertNoResult(d)
        self.handler.position("master", 1)
        self.assertNoResult(d)  # answered at the end of the turn
        self.clock.advance(0)
        self.successResultOf(d)

    def test_positions_of_one_turn_wake_once_at_its_end(self) -> None:
        """Rows of several positions in one reactor turn wake each waiter once, after the last of them."""
        ab = self.sync._wait_for_news("@a:t", frozenset({"!a:t", "!b:t"}), 30)
        b = self.sync._wait_for_news("@b:t", frozenset({"!b:t"}), 30)
        calls: list[str] = []
        ab.addCallback(lambda _: calls.append("ab"))
        b.addCallback(lambda _: calls.append("b"))
        for n, room in enumerate(("!a:t", "!b:t", "!a:t"), start=1):
            self.handler.rows("master", n, [_row(room, n)])
            self.handler.position("master", n)
        self.assertEqual((calls, self.sync.waiting), ([], 0))
        self.assertEqual(len(self.clock.getDelayedCalls()), 3)  # the two waiters' timeouts, one wake-up
        self.clock.advance(0)
        self.assertEqual(sorted(calls), ["ab", "b"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_waiter_cancelled_before_the_wake_is_not_called(self) -> None:
        """A sync cancelled (its client went away) between its position and the wake-up is left alone."""
        kept = self.sync._wait_for_news("@a:t", frozenset({"!a:t"}), 30)
        cancelled = self.sync._wait_for_news("@b:t", frozenset({"!a:t"}), 30)
        self.handler.rows("master", 1, [_row("!a:t", 1)])
        self.handler.position("master", 1)
        cancelled.cancel()
        self.failureResultOf(cancelled)
        self.clock.advance(0)  # would raise AlreadyCalledError if the wake called it
        self.successResultOf(kept)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_expired_and_cancelled_waiters_are_forgotten(self) -> None:
        expired = self.sync._wait_for_news("@a:t", frozenset({"!a:t"}), 5)
        cancelled = self.sync._wait_for_news("@b:t", frozenset({"!a:t", "!b:t"}), 30)
        self.clock.advance(5)
        self.successResultOf(expired)
        self.assertEqual(self.sync.waiting, 1)
        cancelled.cancel()
        self.failureResultOf(cancelled)
        self.assertEqual((self.sync._waiting_on_room, self.sync._waiting_user), ({}, {}))
        self.rows(_row("!a:t", 1))  # nothing left to wake: no error
        self.assertEqual(self.clock.getDelayedCalls(), [])


class SharedWindowTest(TestCase):
    """Syncs woken by one position read the window once, for every room, and each gets its own rooms' events."""

    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, self.alice = yield single_master_with_user(self)
        self.bob = yield ensureDeferred(self.alice.__class__(self.alice.base_url, self.alice.pool).register("bob"))
        self.carol = yield ensureDeferred(self.alice.__class__(self.alice.base_url, self.alice.pool).register("carol"))
        self.shared = yield ensureDeferred(self.alice.create_room("public_chat"))
        yield ensureDeferred(self.bob.join(self.shared))
        self.carols = yield ensureDeferred(self.carol.create_room())  # a room only carol is in
        self.store = self.master.worker.store
        self.reads: list[Any] = []
        read = self.store.get_events_in_window
        self.patch(self.store, "get_events_in_window", lambda rooms, *a: self.reads.append(rooms) or read(rooms, *a))

    @inlineCallbacks
    def heads(self):
        """Each user's token at the head (a timeout=0 sync, then one more that returns nothing)."""
        tokens = []
        for user in (self.alice, self.bob, self.carol):
            first = yield ensureDeferred(user.sync())
            tokens.append(first["next_batch"])
        return tokens

    @inlineCallbacks
    def test_woken_syncs_share_one_read(self):
        """Three long-polls from the head, woken by one send, make one read of every room and get their rooms' events."""
        tokens = yield self.heads()
        self.assertEqual(len(set(tokens)), 1)  # all at this process's position
        polls = [ensureDeferred(user.sync(token, timeout_ms=10_000))
                 for user, token in zip((self.alice, self.bob, self.carol), tokens, strict=True)]
        yield _real(0.2)
        del self.reads[:]
        sent = yield ensureDeferred(self.alice.send(self.shared, {"body": "hi"}, "t1"))
        alice = yield polls[0]
        bob = yield polls[1]
        self.assertEqual([e["event_id"] for e in alice["events"]], [sent["event_id"]])
        self.assertEqual([e["event_id"] for e in bob["events"]], [sent["event_id"]])
        self.assertEqual(alice["next_batch"], bob["next_batch"])
        self.assertEqual(self.reads, [None])  # one read, of every room, for both
        self.assertFalse(polls[2].called)  # carol is in neither room: still waiting
        mine = yield ensureDeferred(self.carol.send(self.carols, {"body": "mine"}, "t2"))
        carol = yield polls[2]
        self.assertEqual([e["event_id"] for e in carol["events"]], [mine["event_id"]])

    @inlineCallbacks
    def test_syncs_woken_during_a_read_wait_for_it(self):
        """Long-polls woken together whose shared window read is still out (a read through the pool) make one read."""
        tokens = yield self.heads()
        gates: list[Deferred[None]] = []
        recording = self.store.get_events_in_window

        async def slow(rooms: Any, *a: Any) -> Any:
            if rooms is None:  # the shared window: back only when the test says so
                gate: Deferred[None] = Deferred()
                gates.append(gate)
                await gate
            return await recording(rooms, *a)

        self.patch(self.store, "get_events_in_window", lambda rooms, *a: ensureDeferred(slow(rooms, *a)))
        polls = [ensureDeferred(user.sync(token, timeout_ms=10_000))
                 for user, token in zip((self.alice, self.bob), tokens[:2], strict=True)]
        yield _real(0.2)
        del self.reads[:]
        sent = yield ensureDeferred(self.alice.send(self.shared, {"body": "hi"}, "t1"))
        for _ in range(50):
            if gates:
                break
            yield _real(0.02)
        yield _real(0.1)  # both long-polls are woken and reading by now
        self.assertEqual(len(gates), 1)
        gates[0].callback(None)
        alice = yield polls[0]
        bob = yield polls[1]
        self.assertEqual([e["event_id"] for e in alice["events"]], [sent["event_id"]])
        self.assertEqual([e["event_id"] for e in bob["events"]], [sent["event_id"]])
        self.assertEqual(self.reads, [None])  # one read, of every room, for both

    @inlineCallbacks
    def test_other_windows_are_read_per_sync(self):
        """A sync from the beginning (no since) reads its own rooms only: its window is not shared."""
        yield ensureDeferred(self.alice.send(self.shared, {"body": "hi"}, "t1"))
        del self.reads[:]
        result = yield ensureDeferred(self.bob.sync())
        self.assertIn("hi", [e["content"].get("body") for e in result["events"]])
        self.assertEqual(len(self.reads), 1)
        self.assertEqual(self.reads[0], sorted([self.shared]))

    @inlineCallbacks
    def test_large_stretch_read_per_sync(self):
        """New events past the bound of those kept are read per sync, for its rooms only, and a limit still cuts them."""
        from synflow.events import sync as sync_module

        tokens = yield self.heads()
        for n in range(4):
            yield ensureDeferred(self.alice.send(self.shared, {"body": str(n)}, f"n{n}"))
        self.patch(sync_module, "RECENT_EVENTS", 2)
        del self.reads[:]
        limited = yield ensureDeferred(self.bob.sync(tokens[1], limit=3))
        self.assertEqual([e["content"]["body"] for e in limited["events"]], ["0", "1", "2"])
        self.assertTrue(limited["limited"])
        self.assertEqual(self.reads, [None, [self.shared]])  # tried whole, too large: per sync

    @inlineCallbacks
    def test_limit_cuts_the_recent_events(self):
        """A limited sync and the next of its chain take their events from memory: one read between them."""
        tokens = yield self.heads()
        for n in range(4):
            yield ensureDeferred(self.alice.send(self.shared, {"body": str(n)}, f"n{n}"))
        del self.reads[:]
        whole = yield ensureDeferred(self.alice.sync(tokens[0], limit=3))
        rest = yield ensureDeferred(self.alice.sync(whole["next_batch"], limit=3))
        self.assertEqual([e["content"]["body"] for e in whole["events"] + rest["events"]], ["0", "1", "2", "3"])
        self.assertTrue(whole["limited"])
        self.assertFalse(rest["limited"])
        self.assertEqual(self.reads, [None])


class _Instances:
    """The instance map of three writers (SyncHandler reads ``by_id``)."""

    by_id = {1: "w1", 2: "w2", 3: "w3"}


class _WindowStore:
    """Events of three writers in memory, read as the store's window query reads them (and each read recorded)."""

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self.reads: list[list[str] | None] = []
        #: When a list: every read for every room (the one that extends the kept events) waits for a gate appended
        #: here, and is answered once the test fires it (or fails as the test fails it).
        self.held: list[Deferred[None]] | None = None

    def window(self, rooms: Any, since: dict[str, int], since_default: int, upto: dict[str, int],
               upto_default: int, limit: int) -> list[SyncEvent]:
        return [e for e in self.events
                if (rooms is None or e.room_id in rooms)
                and since.get(e.instance_name, since_default) < e.stream_ordering
                <= upto.get(e.instance_name, upto_default)][:limit]

    def get_events_in_window(self, rooms: Any, *args: Any) -> Deferred[list[SyncEvent]]:
        self.reads.append(rooms)
        if rooms is None and self.held is not None:
            gate: Deferred[None] = Deferred()
            self.held.append(gate)
            return gate.addCallback(lambda _: self.window(rooms, *args))
        return succeed(self.window(rooms, *args))


_ROOMS = ("!a:t", "!b:t", "!c:t")
_WRITERS = {"w1": 1, "w2": 2, "w3": 3}


class RecentEventsTest(TestCase):
    """The window a sync gets from the recent events in memory is the one the database would give."""

    @settings(max_examples=400, deadline=None)
    @given(steps=st.lists(st.tuples(st.sampled_from(sorted(_WRITERS)), st.integers(0, 4), st.booleans(),
                                    st.lists(st.sampled_from(_ROOMS), min_size=4, max_size=4),
                                    st.integers(0, 2**30), st.integers(1, 6)), min_size=1, max_size=40),
           bound=st.sampled_from([3, 8, 1024]), bound_bytes=st.sampled_from([20, 60, 2**30]),
           lookup_cost=st.sampled_from([0, 4, 10**9]))
    def test_windows_match_the_database(self, steps: list[Any], bound: int, bound_bytes: int,
                                        lookup_cost: int) -> None:
        """Writers allocate IDs from one sequence and complete them later, out of step with each other (a writer
        behind completes IDs below ones already visible), or only move on; syncs from tokens of any earlier moment,
        or mixes of them, read windows of some rooms: each gets the database's answer, in order, with the recent
        events kept within their bound (trimmed, or started afresh past it). Read room by room (a look-up cost of
        0), by a scan of the window (one too high to pay) or by either as the sizes say: the same; and the kept
        events by room are always the kept events, room by room, in order."""
        from synflow.events import sync as sync_module

        with mock.patch.object(sync_module, "RECENT_EVENTS", bound), \
                mock.patch.object(sync_module, "RECENT_BYTES", bound_bytes), \
                mock.patch.object(sync_module, "ROOM_LOOKUP_COST", lookup_cost):
            store = _WindowStore()
            sync = SyncHandler(store, _Handler(), _Instances(), Clock())  # type: ignore[arg-type]
            positions = dict.fromkeys(_WRITERS, 0)
            pending: dict[str, list[SyncEvent]] = {w: [] for w in _WRITERS}
            history = [dict(positions)]
            allocated = 0
            for writer, count, complete, rooms, pick, limit in steps:
                for n in range(count):
                    allocated += 1
                    content = '{"b":"' + "x" * (allocated % 13) + '"}'  # 8 to 20 bytes
                    pending[writer].append(SyncEvent(allocated, writer, f"$e{allocated}:t", rooms[n],
                                                     "m.room.message", None, "@s:t", content, 0))
                if complete:
                    # its transaction commits: its events become visible, and with nothing of its own left
                    # outstanding it moves on to the highest ID allocated by anyone (as an idle writer does)
                    store.events = sorted(store.events + pending[writer], key=lambda e: e.stream_ordering)
                    pending[writer] = []
                    positions[writer] = allocated
                history.append(dict(positions))
                # now: this moment's positions, or (a sync that took its "now" before another read on) an earlier
                # one's; since: any position of each writer up to now (a token of this process or another's)
                now_by_name = history[-1 - min(pick % 3, len(history) - 1)]
                now = StreamToken.from_positions({_WRITERS[w]: p for w, p in now_by_name.items()})
                # (the boundaries that matter most often: at an event, just before one, at a writer's position)
                marks = sorted({0, *(e.stream_ordering - d for e in store.events for d in (0, 1)),
                                *(v for moment in history for v in moment.values())})
                since_by_name = {}
                for i, w in enumerate(sorted(_WRITERS)):
                    candidates = [m for m in marks if m <= now_by_name[w]]
                    since_by_name[w] = candidates[(pick >> (8 * i)) % len(candidates)]
                since = StreamToken.from_positions({_WRITERS[w]: p for w, p in since_by_name.items()})
                if now.is_before_or_eq(since):
                    continue
                wanted = frozenset(rooms[: 1 + pick % 3])
                got = self.successResultOf(ensureDeferred(sync._read_window(wanted, since, now, dict(now_by_name), limit)))
                expected = store.window(sorted(wanted), since_by_name, since.minimum, now_by_name, now.minimum, limit)
                self.assertEqual([e.event_id for e in got], [e.event_id for e in expected])
                self.assertLessEqual(len(sync._recent), bound)
                self.assertLessEqual(sync._recent_bytes, bound_bytes)
                self.assertEqual(sync._recent_bytes, sum(len(e.content_json) for e in sync._recent))
                by_room: dict[str, list[SyncEvent]] = {}
                for e in sync._recent:
                    by_room.setdefault(e.room_id, []).append(e)
                self.assertEqual(sync._recent_by_room, by_room)

    def test_a_chain_from_another_process_reads_from_memory(self) -> None:
        """A sync whose token is not one this process gave out, but within what it keeps, makes no read."""
        store = _WindowStore()
        sync = SyncHandler(store, _Handler(), _Instances(), Clock())  # type: ignore[arg-type]
        store.events = [SyncEvent(n, "w1" if n % 2 else "w2", f"$e{n}:t", "!a:t", "m.room.message", None, "@s:t",
                                  "{}", 0) for n in range(1, 9)]

        def token(w1: int, w2: int) -> StreamToken:
            return StreamToken.from_positions({1: w1, 2: w2})

        def window(since: StreamToken, w1: int, w2: int) -> list[str]:
            got = ensureDeferred(sync._read_window(frozenset({"!a:t"}), since, token(w1, w2), {"w1": w1, "w2": w2}, 10))
            return [e.event_id for e in self.successResultOf(got)]

        self.assertEqual(window(token(0, 0), 2, 2), ["$e1:t", "$e2:t"])  # the first: read for its rooms
        self.assertEqual(window(token(2, 2), 8, 8), [f"$e{n}:t" for n in range(3, 9)])  # extends what is kept
        self.assertEqual(store.reads, [["!a:t"], None])
        # another process's token: w1 further than here at the time, w2 behind
        self.assertEqual(window(token(5, 4), 8, 8), ["$e6:t", "$e7:t", "$e8:t"])
        self.assertEqual(store.reads, [["!a:t"], None])  # from memory
        self.assertEqual(window(token(1, 1), 8, 8), [f"$e{n}:t" for n in range(2, 9)])  # older than kept: read
        self.assertEqual(store.reads, [["!a:t"], None, ["!a:t"]])

    def test_bounds_of_what_is_kept(self) -> None:
        """A sync with an older ``now`` than what is kept gets nothing after it; past the bound the oldest events are
        dropped, and a token just before the last one dropped reads from the database."""
        from synflow.events import sync as sync_module

        self.patch(sync_module, "RECENT_EVENTS", 4)
        store = _WindowStore()
        sync = SyncHandler(store, _Handler(), _Instances(), Clock())  # type: ignore[arg-type]
        store.events = [SyncEvent(n, "w1", f"$e{n}:t", "!a:t", "m.room.message", None, "@s:t", "{}", 0)
                        for n in range(1, 9)]

        def window(since: int, now: int) -> list[int]:
            got = ensureDeferred(sync._read_window(frozenset({"!a:t"}), StreamToken.at(since), StreamToken.at(now),
                                                   {"w1": now}, 10))
            return [e.stream_ordering for e in self.successResultOf(got)]

        self.assertEqual(window(0, 2), [1, 2])  # read for its rooms; kept from 2 on
        self.assertEqual(window(2, 4), [3, 4])
        self.assertEqual(window(2, 3), [3])  # an older now: from memory, up to it only
        self.assertEqual(window(4, 6), [5, 6])  # 4 kept: 3 to 6
        self.assertEqual(len(store.reads), 3)
        self.assertEqual(window(6, 7), [7])  # 5 kept: 3 and 4 dropped, kept from 4 on
        self.assertEqual(sync._recent_from, StreamToken.at(4))
        self.assertEqual(window(4, 7), [5, 6, 7])
        self.assertEqual(len(store.reads), 4)
        self.assertEqual(window(3, 7), [4, 5, 6, 7])  # just before the last one dropped: read
        self.assertEqual(store.reads[-1], ["!a:t"])

    def test_started_afresh_during_a_read(self) -> None:
        """A read that extends what is kept, answered after the kept events started afresh (a writer's position went
        back meanwhile), is not added to them: they stay every event after their new start."""
        store = _WindowStore()
        held: list[Deferred[None]] = []
        store.held = held
        sync = SyncHandler(store, _Handler(), _Instances(), Clock())  # type: ignore[arg-type]
        store.events = [SyncEvent(n, "w1" if n % 2 else "w2", f"$e{n}:t", "!a:t", "m.room.message", None, "@s:t",
                                  "{}", 0) for n in range(1, 9)]

        def read(since: tuple[int, int], now: tuple[int, int]) -> Deferred[list[SyncEvent]]:
            return ensureDeferred(sync._read_window(
                frozenset({"!a:t"}), StreamToken.from_positions({1: since[0], 2: since[1]}),
                StreamToken.from_positions({1: now[0], 2: now[1]}), {"w1": now[0], "w2": now[1]}, 10))

        self.successResultOf(read((0, 0), (3, 2)))  # kept from (3, 2) on
        extending = read((3, 2), (5, 6))
        self.assertEqual(len(held), 1)
        self.successResultOf(read((1, 0), (7, 0)))  # w2 back at 0: afresh from (7, 0), and read from the database
        held[0].callback(None)
        self.assertEqual([e.event_id for e in self.successResultOf(extending)], ["$e4:t", "$e5:t", "$e6:t"])
        self.assertEqual(sync._recent_from, sync._recent_to)  # nothing of that read kept
        got = read((5, 6), (7, 8))  # from the new start on: kept again
        self.assertEqual(len(held), 2)
        held[-1].callback(None)
        self.assertEqual([e.event_id for e in self.successResultOf(got)], ["$e7:t", "$e8:t"])
        self.assertEqual([e.event_id for e in sync._recent], ["$e7:t", "$e8:t"])

    def test_a_failed_read_adds_nothing_and_the_waiting_syncs_read_again(self) -> None:
        """The read that extends what is kept fails: its sync fails, nothing is added, and a sync that waited for
        that read makes the read itself and gets its window."""
        store = _WindowStore()
        held: list[Deferred[None]] = []
        store.held = held
        sync = SyncHandler(store, _Handler(), _Instances(), Clock())  # type: ignore[arg-type]
        store.events = [SyncEvent(n, "w1", f"$e{n}:t", "!a:t", "m.room.message", None, "@s:t", "{}", 0)
                        for n in range(1, 5)]

        def read(since: int, now: int) -> Deferred[list[SyncEvent]]:
            return ensureDeferred(sync._read_window(frozenset({"!a:t"}), StreamToken.at(since), StreamToken.at(now),
                                                    {"w1": now}, 10))

        self.successResultOf(read(0, 2))  # kept from 2 on
        leader, follower = read(2, 4), read(2, 4)
        self.assertEqual(len(held), 1)  # one read for both
        held[0].errback(RuntimeError("database gone"))
        self.failureResultOf(leader, RuntimeError)
        self.assertEqual((sync._recent, sync._recent_to), ([], StreamToken.at(2)))  # nothing added
        self.assertEqual(len(held), 2)  # the follower reads itself
        held[1].callback(None)
        self.assertEqual([e.event_id for e in self.successResultOf(follower)], ["$e3:t", "$e4:t"])
        self.assertEqual((sync._recent_to, sync._extending), (StreamToken.at(4), None))
