"""SyncHandler catching up with a token from a faster process, over a real store and a controlled view."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, inlineCallbacks
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import TestCase

from synflow.events.sync import CATCH_UP_TIMEOUT_S, SyncHandler
from synflow.replication.commands import PositionCommand
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
