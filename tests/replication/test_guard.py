"""Positions checked against the stream's sequence: forged claims refused, legitimate ones (leaps included) applied."""

from __future__ import annotations

import logging

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow import registry
from synflow.replication.commands import PositionCommand, RdataCommand, Side
from synflow.replication.core import AUTH_TIMEOUT_S, ConnectionOptions
from synflow.replication.guard import REFUSAL_LOG_INTERVAL_S, PositionGuard
from synflow.replication.handler import ReplicationHandler
from synflow.replication.hub import ReplicationHub
from synflow.storage.id_generators import MultiWriterIdGenerator
from synflow.streams import EVENTS, EventsRow
from synflow.testing import attach, make_protocol
from tests.replication.test_handler import FakeConn, ListSource

FORGED = PositionCommand("events", "persister1", 100, 999_999_999)


class Sequence:
    """Stands in for the streams' sequences in the database: ``last`` per stream, reads counted."""

    def __init__(self, last: int, *, deferred: bool = False) -> None:
        self.last = {name: last for name in registry.streams()}
        self.reads = 0
        self.deferred = deferred
        self.pending: list[Deferred[int]] = []

    def fetch(self, stream: str) -> Deferred[int]:
        self.reads += 1
        if not self.deferred:
            return succeed(self.last[stream])
        d: Deferred[int] = Deferred()
        self.pending.append(d)
        return d

    def answer(self) -> None:
        """Answer every pending read with the sequence as it is now."""
        pending, self.pending = self.pending, []
        for d in pending:
            d.callback(self.last["events"])


def row(n: int) -> list:
    return EventsRow(f"$e{n}:hs", "!r:hs", "m.room.message", None, "@u:hs", None).to_wire()


class GuardTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sequence = Sequence(10)
        self.guard = PositionGuard(self.sequence.fetch, {"events": 10}, self.clock)

    def test_claim_within_known_bound_needs_no_read(self):
        """A claim at or below the highest ID known handed out is accepted without reading the database."""
        self.assertIs(self.guard.check("events", "p1", 10, "POSITION"), True)
        self.assertEqual(self.sequence.reads, 0)

    def test_claim_above_bound_reads_the_sequence(self):
        """A claim above the known bound is settled by reading the sequence, which then raises the bound."""
        self.sequence.last["events"] = 25  # another writer committed IDs up to 25 since the bound was learnt
        self.assertTrue(self.successResultOf(self.guard.check("events", "p1", 25, "POSITION")))
        self.assertEqual((self.sequence.reads, self.guard.allocated("events")), (1, 25))
        self.assertIs(self.guard.check("events", "p2", 20, "POSITION"), True)
        self.assertEqual(self.sequence.reads, 1)

    def test_claim_beyond_sequence_refused(self):
        """A claim beyond what the sequence handed out is refused and logged with the values."""
        with self.assertLogs("synflow.replication.guard", logging.WARNING) as logs:
            verdict = self.guard.check("events", "persister1", 999_999_999, "POSITION events persister1 100 999999999")
            self.assertFalse(self.successResultOf(verdict))
        self.assertEqual(self.guard.refused, 1)
        self.assertIn("persister1 claims events position 999999999", logs.output[0])
        self.assertIn("only up to 10", logs.output[0])

    def test_unreadable_sequence_refuses(self):
        """When the sequence cannot be read the claim is refused: an unverifiable position is not applied."""
        guard = PositionGuard(lambda stream: fail(OSError("database is locked")), {"events": 1}, self.clock)
        self.assertFalse(self.successResultOf(guard.check("events", "p1", 2, "POSITION")))
        self.assertEqual(guard.refused, 1)

    def test_refusal_logs_rate_limited(self):
        """A flood of forged claims logs once per interval per stream, then reports how many it left out."""
        with self.assertLogs("synflow.replication.guard", logging.WARNING) as logs:
            for _ in range(5):
                self.guard.check("events", "p1", 11, "POSITION")
            self.clock.advance(REFUSAL_LOG_INTERVAL_S)
            self.guard.check("events", "p1", 11, "POSITION")
        self.assertEqual(len(logs.records), 2)
        self.assertIn("(4 more refused since the last report)", logs.output[1])
        self.assertEqual(self.guard.refused, 6)


class HandlerGuardTest(SynchronousTestCase):
    """persister2's handler (it writes events) reading persister1, with the guard wired as in production."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.sequence = Sequence(10)
        self.gen = MultiWriterIdGenerator(EVENTS, "persister2", 10, self.clock)
        self.handler = ReplicationHandler(
            "persister2", self.clock, streams=registry.streams(), sources={"events": ListSource([])},
            generators={"events": self.gen}, initial_positions={"events": {"persister1": 10}},
            guard=PositionGuard(self.sequence.fetch, {name: 10 for name in registry.streams()}, self.clock),
        )
        self.conn = FakeConn()
        self.handler.new_connection(self.conn)
        self.handler.start()
        self.addCleanup(self.handler.stop)

    def test_forged_position_changes_nothing(self):
        """``POSITION events persister1 100 999999999`` moves no view, and no idle writer leaps to it."""
        before = self.handler.positions("events")
        self.handler.on_command(self.conn, FORGED)
        self.assertEqual(self.handler.positions("events"), before)
        self.assertEqual(self.handler.stats.positions_refused, 1)
        self.clock.advance(1.0)  # the tick: idle writers leap to the highest position seen
        self.assertEqual(self.gen.position, 10)
        self.assertEqual(self.gen.tracker.max_seen_allocated, 10)

    def test_forged_prev_token_refused(self):
        """A claim hidden in prev_token is refused too (a new writer's view starts at prev_token)."""
        self.handler.on_command(self.conn, PositionCommand("caches", "newcomer", 999_999_999, 999_999_999))
        self.assertNotIn("newcomer", self.handler.positions("caches"))
        self.assertEqual(self.handler.stats.positions_refused, 1)

    def test_forged_rdata_refused(self):
        """An RDATA at a token beyond the sequence is not applied either, nor are its batch rows."""
        self.handler.on_command(self.conn, PositionCommand("events", "persister1", 10, 10))
        seen = []
        self.handler.add_row_handler("events", lambda instance, token, rows: seen.append(token))
        self.handler.on_command(self.conn, RdataCommand("events", "persister1", None, row(1)))
        self.handler.on_command(self.conn, RdataCommand("events", "persister1", 999_999_999, row(2)))
        self.assertEqual(seen, [])
        self.assertEqual(self.handler.position("events", "persister1"), 10)
        self.sequence.last["events"] = 11
        self.handler.on_command(self.conn, RdataCommand("events", "persister1", 11, row(3)))
        self.assertEqual(seen, [11])

    def test_legitimate_positions_and_leaps_applied(self):
        """Positions the sequence covers -- a commit the reader learns of late, another writer's idle leap -- apply."""
        self.sequence.last["events"] = 20  # persister1 committed 11..20 after this process last read the sequence
        self.handler.on_command(self.conn, PositionCommand("events", "persister1", 10, 20))
        self.assertEqual(self.handler.position("events", "persister1"), 20)
        self.handler.on_command(self.conn, PositionCommand("events", "persister3", 20, 20))  # an idle leap
        self.assertEqual(self.handler.position("events", "persister3"), 20)
        self.assertEqual(self.sequence.reads, 1)
        self.clock.advance(1.0)
        self.assertEqual(self.gen.position, 20)  # persister2 leaps to a position it saw, which the sequence covers
        self.assertEqual(self.handler.stats.positions_refused, 0)

    def test_commands_wait_in_order_behind_a_read(self):
        """While the sequence is read for one claim, later commands of the stream wait and then apply in order."""
        self.sequence.deferred = True
        self.sequence.last["events"] = 12
        self.handler.on_command(self.conn, PositionCommand("events", "persister1", 10, 12))
        self.handler.on_command(self.conn, PositionCommand("events", "persister1", 12, 13))
        self.assertEqual(self.handler.position("events", "persister1"), 10)
        self.assertEqual(self.sequence.reads, 1)
        self.sequence.answer()  # 12: the first applies; the second (13) needs a read of its own
        self.assertEqual(self.handler.position("events", "persister1"), 12)
        self.assertEqual(self.sequence.reads, 2)
        self.sequence.answer()  # still 12: 13 was never handed out
        self.assertEqual(self.handler.position("events", "persister1"), 12)
        self.assertEqual(self.handler.stats.positions_refused, 1)


class HubGuardTest(SynchronousTestCase):
    """The master's hub on an in-memory transport: AUTH first, then forged positions refused by its handler."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.sequence = Sequence(10)
        self.guard = PositionGuard(self.sequence.fetch, {name: 10 for name in registry.streams()}, self.clock)
        self.handler = ReplicationHandler(
            "master", self.clock, streams=registry.streams(), sources={"events": ListSource([])},
            initial_positions={"events": {"persister1": 10, "persister2": 10}}, guard=self.guard,
        )
        self.hub = ReplicationHub(self.handler)
        self.reader = make_protocol(Side.SERVER, self.hub, self.clock, server_name="hs",
                                    options=ConnectionOptions(secret="s3cret"))
        attach(self.reader, 40010)
        self.reader.dataReceived(b"AUTH s3cret\nNAME persister2\n")

    def connect(self):
        proto = make_protocol(Side.SERVER, self.hub, self.clock, server_name="hs",
                              options=ConnectionOptions(secret="s3cret"))
        return proto, attach(proto, 40011)

    def test_forged_position_with_the_secret_refused(self):
        """An authenticated connection's forged POSITION is refused by the master and moves no position."""
        proto, transport = self.connect()
        proto.dataReceived(b"AUTH s3cret\nNAME intruder\nPOSITION events persister1 100 999999999\n")
        self.assertEqual(self.handler.positions("events"), {"persister1": 10, "persister2": 10})
        self.assertEqual(self.handler.stats.positions_refused, 1)
        self.assertFalse(transport.disconnecting)  # a reader that refuses does not hang up: the hub's peers stay

    def test_position_without_auth_never_reaches_the_handler(self):
        """Without AUTH first, the POSITION is answered with ERROR and a close; nothing is checked or relayed."""
        proto, transport = self.connect()
        reader_transport = self.reader.transport
        reader_transport.clear()
        transport.clear()
        proto.dataReceived(b"POSITION events persister1 100 999999999\n")
        self.assertEqual(transport.value(), b"ERROR authentication required: send AUTH <secret> first\n")
        self.assertTrue(transport.disconnecting)
        self.assertEqual((self.sequence.reads, self.handler.stats.positions_refused), (0, 0))
        self.assertEqual(reader_transport.value(), b"")
        self.assertEqual(self.handler.position("events", "persister1"), 10)

    def test_unauthenticated_connection_gets_no_stream(self):
        """Until its AUTH, a connection is not among the hub's connections: nothing the hub sends reaches it."""
        proto, transport = self.connect()
        transport.clear()
        self.hub.send_command(PositionCommand("caches", "master", 1, 2))
        self.assertEqual(transport.value(), b"")
        self.assertEqual(self.hub.connections, [self.reader])
        proto.dataReceived(b"AUTH s3cret\n")
        self.assertIn(proto, self.hub.connections)
        self.hub.send_command(PositionCommand("caches", "master", 2, 3))
        self.assertEqual(transport.value(), b"POSITION caches master 2 3\n")

    def test_silent_connection_closed_after_auth_timeout(self):
        """A connection that never sends AUTH is closed once the auth timeout passes (it cannot idle forever)."""
        proto, transport = self.connect()
        self.clock.advance(AUTH_TIMEOUT_S - 1)
        self.assertFalse(transport.disconnecting)
        for _ in range(2):
            self.clock.advance(1)
        self.assertTrue(transport.disconnecting)
        self.assertTrue(transport.value().endswith(b"ERROR authentication timeout\n"), transport.value())
        self.assertFalse(self.reader.transport.disconnecting)
