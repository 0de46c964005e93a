"""The replication handler in one reactor: batches, stale rows, gaps, reconnects, writing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from synflow import registry
from synflow.replication.commands import (
    COMMANDS,
    FederationAckCommand,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    Side,
    encode_line_bytes,
)
from synflow.replication.handler import ReplicationHandler
from synflow.replication.hub import ReplicationHub
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import CACHES, EVENTS, EventsRow
from synflow.testing import Pump, attach, make_protocol


def ev(n: int, room: str = "!r:hs") -> EventsRow:
    return EventsRow(f"$e{n}:hs", room, "m.room.message", None, "@u:hs", None)


class ListSource:
    """A catch-up source over an in-memory table (stands in for the database)."""

    def __init__(self, rows=()):
        self.rows = list(rows)  # (instance, token, row)
        self.calls = []

    def page(self, instance, from_token, to_token, limit=100):
        """One page of ``instance``'s rows in ``(from_token, to_token]``, as DatabaseSource returns it."""
        hits = sorted(((t, r) for i, t, r in self.rows if i == instance and from_token < t <= to_token),
                      key=lambda tr: tr[0])[:limit]
        if len(hits) == limit:
            return hits, hits[-1][0], True
        return hits, to_token, False

    def get_updates(self, instance, from_token, to_token, limit=100):
        self.calls.append((instance, from_token, to_token))
        return succeed(self.page(instance, from_token, to_token, limit))


class DeferredSource(ListSource):
    """A catch-up source whose pages arrive only when the test releases them."""

    def __init__(self, rows=()):
        super().__init__(rows)
        self.pending = []

    def get_updates(self, instance, from_token, to_token, limit=100):
        self.calls.append((instance, from_token, to_token))
        d = Deferred()
        self.pending.append((d, (instance, from_token, to_token, limit)))
        return d

    def release(self):
        """Answer the oldest outstanding page request."""
        d, args = self.pending.pop(0)
        d.callback(self.page(*args))


class FakeConn:
    def __init__(self):
        self.sent = []

    def send_command(self, cmd):
        self.sent.append(cmd)


def make_handler(name="reader", source=None, generators=None, clock=None, positions=None):
    clock = clock or Clock()
    handler = ReplicationHandler(
        name, clock, streams=registry.streams(),
        sources={"events": source or ListSource([])},
        generators=generators, initial_positions=positions or {"events": {"w1": 1, "w2": 1}},
    )
    applied = []
    handler.add_row_handler("events", lambda inst, tok, rows: applied.append((inst, tok, [r.event_id for r in rows])))
    return handler, applied, clock


class ReadingTest(SynchronousTestCase):
    def test_dispatch_table_complete(self):
        """Every command class has exactly one entry in the handler's dispatch table."""
        handler, _, _ = make_handler()
        self.assertEqual(set(handler.dispatch_table), set(COMMANDS.values()))

    def test_rdata_ignored_until_position(self):
        """RDATA of a writer is dropped until that writer's first POSITION on the connection."""
        handler, applied, _ = make_handler()
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, RdataCommand("events", "w1", 5, ev(5).to_wire()))
        self.assertEqual(applied, [])
        handler.on_command(conn, PositionCommand("events", "w1", 1, 5))
        handler.on_command(conn, RdataCommand("events", "w1", 6, ev(6).to_wire()))
        self.assertEqual(applied, [("w1", 6, ["$e6:hs"])])
        # Another writer on the same connection is still not connected.
        handler.on_command(conn, RdataCommand("events", "w2", 7, ev(7).to_wire()))
        self.assertEqual(len(applied), 1)

    def test_batch_buffered_until_numeric_token(self):
        """Rows with the token batch are buffered and applied with the numeric row, at its token."""
        handler, applied, _ = make_handler()
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 1))
        handler.on_command(conn, RdataCommand("events", "w1", None, ev(2).to_wire()))
        handler.on_command(conn, RdataCommand("events", "w1", None, ev(3).to_wire()))
        self.assertEqual(applied, [])
        self.assertEqual(handler.position("events", "w1"), 1)
        handler.on_command(conn, RdataCommand("events", "w1", 4, ev(4).to_wire()))
        self.assertEqual(applied, [("w1", 4, ["$e2:hs", "$e3:hs", "$e4:hs"])])
        self.assertEqual(handler.position("events", "w1"), 4)

    def test_position_discards_pending_batch(self):
        """A POSITION drops a half-received batch (the catch-up fetches it again)."""
        source = ListSource([("w1", 5, ev(5)), ("w1", 5, ev(6))])
        handler, applied, _ = make_handler(source=source)
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 1))
        handler.on_command(conn, RdataCommand("events", "w1", None, ev(5).to_wire()))
        handler.on_command(conn, PositionCommand("events", "w1", 5, 5))
        self.assertEqual(applied, [("w1", 5, ["$e5:hs", "$e6:hs"])])

    def test_stale_rdata_dropped(self):
        """RDATA at or below the current position is dropped and never applied twice."""
        handler, applied, _ = make_handler(positions={"events": {"w1": 10}})
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 10, 10))
        for token in (9, 10, 11, 11):
            handler.on_command(conn, RdataCommand("events", "w1", token, ev(token).to_wire()))
        self.assertEqual(applied, [("w1", 11, ["$e11:hs"])])
        self.assertEqual(handler.stats.rdata_stale, 3)

    def test_gap_catch_up_across_pages(self):
        """A POSITION gap fetches the missed rows in pages, applies them in order, then advances."""
        rows = [("w1", t, ev(t)) for t in range(2, 700, 2)] + [("w2", t, ev(t)) for t in range(3, 700, 2)]
        source = ListSource(rows)
        handler, applied, _ = make_handler(source=source)
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 698, 720))
        self.assertEqual([t for i, t, _ in applied if i == "w1"], list(range(2, 700, 2)) + [])
        self.assertEqual(handler.position("events", "w1"), 720)
        self.assertEqual(len(source.calls), 4)  # 349 rows in pages of 100
        self.assertEqual(handler.position("events", "w2"), 1)

    def test_commands_wait_for_a_catch_up_in_progress(self):
        """While a gap is being fetched, later commands of the stream wait; then everything applies once, in order."""
        source = DeferredSource([("w1", t, ev(t)) for t in range(2, 251)])
        handler, applied, _ = make_handler(source=source)
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 1))
        handler.on_command(conn, PositionCommand("events", "w2", 1, 1))
        handler.on_command(conn, PositionCommand("events", "w1", 240, 250))  # rows 2..250 were missed
        handler.on_command(conn, RdataCommand("events", "w1", 251, ev(251).to_wire()))
        handler.on_command(conn, RdataCommand("events", "w2", 252, ev(252).to_wire()))
        self.assertEqual(len(source.pending), 1)
        self.assertEqual(applied, [])
        self.assertEqual((handler.position("events", "w1"), handler.position("events", "w2")), (1, 1))
        source.release()
        self.assertEqual([t for _, t, _ in applied], list(range(2, 102)))  # one page, nothing after it
        self.assertEqual(handler.position("events", "w2"), 1)
        while source.pending:
            source.release()
        self.assertEqual(len(source.calls), 3)
        self.assertEqual([t for i, t, _ in applied if i == "w1"], list(range(2, 252)))
        self.assertEqual([rows for _, _, rows in applied], [[f"$e{t}:hs"] for t in range(2, 253)])
        self.assertEqual((handler.position("events", "w1"), handler.position("events", "w2")), (251, 252))

    def test_reconnect_goes_through_position_again(self):
        """After a reconnect, rows are dropped until a POSITION, whose gap is caught up."""
        source = ListSource([("w1", t, ev(t)) for t in range(2, 20)])
        handler, applied, _ = make_handler(source=source)
        first = FakeConn()
        handler.new_connection(first)
        handler.on_command(first, PositionCommand("events", "w1", 1, 1))
        for t in range(2, 6):
            handler.on_command(first, RdataCommand("events", "w1", t, ev(t).to_wire()))
        handler.lost_connection(first)
        second = FakeConn()
        handler.new_connection(second)
        handler.on_command(second, RdataCommand("events", "w1", 12, ev(12).to_wire()))
        self.assertEqual(handler.position("events", "w1"), 5)
        handler.on_command(second, PositionCommand("events", "w1", 12, 12))
        handler.on_command(second, RdataCommand("events", "w1", 13, ev(13).to_wire()))
        self.assertEqual([t for _, t, _ in applied], list(range(2, 14)))

    def test_unknown_stream_ignored(self):
        """Commands for a stream this process does not know are ignored and counted."""
        handler, applied, _ = make_handler()
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("typing", "w1", 1, 5))
        handler.on_command(conn, RdataCommand("typing", "w1", 6, ["!r:hs", []]))
        self.assertEqual(handler.stats.unknown_stream_commands, 2)
        self.assertEqual(applied, [])

    def test_bad_row_dropped(self):
        """A row of the wrong shape is dropped and counted; later rows still apply."""
        handler, applied, _ = make_handler()
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 1))
        handler.on_command(conn, RdataCommand("events", "w1", 2, ["too", "short"]))
        handler.on_command(conn, RdataCommand("events", "w1", 3, ev(3).to_wire()))
        self.assertEqual(handler.stats.bad_rows, 1)
        self.assertEqual(applied, [("w1", 3, ["$e3:hs"])])

    def test_own_echo_ignored(self):
        """RDATA and POSITION carrying this process's own name are ignored."""
        handler, applied, _ = make_handler(name="w1")
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 50))
        self.assertEqual(handler.position("events", "w1"), 1)

    def test_command_listener_failures_are_logged(self):
        """A command listener that raises, or returns a Deferred that fails, is logged; later listeners still run."""
        handler, _, _ = make_handler()
        seen = []
        failing = Deferred()

        def raising(conn, cmd):
            raise ValueError("listener bug")

        handler.add_command_listener(FederationAckCommand, raising)
        handler.add_command_listener(FederationAckCommand, lambda conn, cmd: failing)
        handler.add_command_listener(FederationAckCommand, lambda conn, cmd: seen.append(cmd.token))
        with self.assertLogs("synflow.replication.handler", level="ERROR") as logs:
            handler.on_command(FakeConn(), FederationAckCommand("fed1", 7))
            failing.errback(RuntimeError("trim failed"))
        self.assertEqual(seen, [7])
        self.assertEqual(len(logs.records), 2)
        self.assertIn("trim failed", logs.output[1])
        self.assertIsNone(self.successResultOf(failing))  # consumed, not left unhandled

    def test_wait_for_position(self):
        """wait_for_position fires True when the writer gets there, False after the timeout."""
        handler, _, clock = make_handler()
        conn = FakeConn()
        handler.new_connection(conn)
        reached = handler.wait_for_position("events", "w1", 5, timeout=5)
        never = handler.wait_for_position("events", "w2", 5, timeout=5)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 7))
        self.assertTrue(self.successResultOf(reached))
        self.assertNoResult(never)
        clock.advance(5)
        self.assertFalse(self.successResultOf(never))

    def test_apply_order(self):
        """Row handlers run before the position advances; listeners and waiters after."""
        handler, _, _ = make_handler()
        order = []
        handler.add_row_handler("events", lambda i, t, r: order.append(("rows", handler.position("events", i))))
        handler.add_position_listener("events", lambda i, t: order.append(("listener", handler.position("events", i))))
        handler.wait_for_position("events", "w1", 2).addCallback(lambda _: order.append(("waiter", 2)))
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w1", 1, 1))
        handler.on_command(conn, RdataCommand("events", "w1", 2, ev(2).to_wire()))
        self.assertEqual(order, [("rows", 1), ("listener", 2), ("waiter", 2)])


class WritingTest(SynchronousTestCase):
    def _writer(self, position=1, stream=EVENTS):
        clock = Clock()
        gen = MultiWriterIdGenerator(stream, "w1", position, clock)
        handler = ReplicationHandler(
            "w1", clock, streams=registry.streams(), sources={}, generators={stream.name: gen},
        )
        sent = FakeConn()
        handler.set_transport(sent)
        return handler, gen, sent

    def _write(self, gen, ids, ok=True, rows_per_id=1):
        handle = gen.tracker.begin_fetch()
        payloads = {i: FactPayload(tuple(ev(i * 10 + k) for k in range(rows_per_id)), 0) for i in ids}
        return lambda: gen.finish(handle, ids, payloads, ok)

    def test_completions_announced_in_order(self):
        """Out-of-order completions go out as RDATA in ID order, then a POSITION for the tail."""
        handler, gen, sent = self._writer(position=1)
        first = self._write(gen, [2])
        second = self._write(gen, [3])
        second()
        self.assertEqual(sent.sent, [])
        first()
        self.assertEqual(
            [type(c).__name__ + str(getattr(c, "token", "")) for c in sent.sent], ["RdataCommand2", "RdataCommand3"]
        )

    def test_batch_rows_share_an_id(self):
        """Several rows of one ID go out with the token batch on all but the last."""
        handler, gen, sent = self._writer()
        self._write(gen, [2], rows_per_id=3)()
        self.assertEqual([c.token for c in sent.sent], [None, None, 2])

    def test_announcement_goes_out_in_one_write(self):
        """The RDATA and POSITION lines of one announcement reach a TCP connection in one write, in order."""
        handler, gen, _ = self._writer()
        proto = make_protocol(Side.SERVER, ReplicationHub(), Clock())
        transport = attach(proto)
        transport.clear()
        handler.set_transport(proto)
        writes = []
        real_write = transport.write
        self.patch(transport, "write", lambda data: (writes.append(data), real_write(data)))
        self._write(gen, [2, 3], rows_per_id=2)()
        expected = [RdataCommand("events", "w1", token, ev(i * 10 + k).to_wire())
                    for i in (2, 3) for k, token in ((0, None), (1, i))]
        self.assertEqual(writes, [b"".join(encode_line_bytes(c) + b"\n" for c in expected)])

    def test_rollback_becomes_position(self):
        """A rolled-back ID sends no RDATA; the position still moves with a POSITION."""
        handler, gen, sent = self._writer()
        self._write(gen, [2, 3], ok=False)()
        self.assertEqual(sent.sent, [PositionCommand("events", "w1", 1, 3)])

    def test_replicate_answered(self):
        """REPLICATE is answered with POSITION for every stream this process writes."""
        handler, gen, sent = self._writer(position=42)
        handler.on_command(FakeConn(), ReplicateCommand())
        self.assertEqual(sent.sent, [PositionCommand("events", "w1", 42, 42)])

    def test_idle_writer_leaps(self):
        """An idle writer's tick leaps it to the highest position seen and announces it."""
        handler, gen, sent = self._writer(position=5)
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("events", "w2", 5, 90))
        handler.start()
        handler.clock.advance(1)
        self.assertEqual(gen.position, 90)
        self.assertIn(PositionCommand("events", "w1", 5, 90), sent.sent)
        handler.stop()

    def test_stop_waits_for_a_running_store_then_stores_the_final_position(self):
        """stop() during a tick's position store waits for it, then stores the position reached since."""
        stores = []

        def persist(stream, position):
            d = Deferred()
            stores.append((stream, position, d))
            return d

        clock = Clock()
        gen = MultiWriterIdGenerator(EVENTS, "w1", 1, clock)
        handler = ReplicationHandler("w1", clock, streams=registry.streams(), sources={}, generators={"events": gen},
                                     persist=persist)
        handler.set_transport(FakeConn())
        handler.start()
        self._write(gen, [2, 3])()
        clock.advance(1)  # the tick starts storing 3
        self.assertEqual([(s, p) for s, p, _ in stores], [("events", 3)])
        clock.advance(1)  # a tick while the store is slow starts no second one
        self.assertEqual(len(stores), 1)
        self._write(gen, [4, 5])()
        stopped = handler.stop()
        self.assertNoResult(stopped)
        self.assertEqual(len(stores), 1)
        stores[0][2].callback(None)
        self.assertEqual([(s, p) for s, p, _ in stores], [("events", 3), ("events", 5)])
        self.assertNoResult(stopped)
        stores[1][2].callback(None)
        self.successResultOf(stopped)
        self.assertEqual(gen.persisted_position, 5)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_streams_without_leaps_stay(self):
        """A stream defined without idle leaps keeps an idle writer where it is."""
        import attrs

        handler, gen, sent = self._writer(position=5, stream=attrs.evolve(CACHES, idle_leaps=False))
        conn = FakeConn()
        handler.new_connection(conn)
        handler.on_command(conn, PositionCommand("caches", "w2", 5, 90))
        handler.start()
        handler.clock.advance(1)
        self.assertEqual(gen.position, 5)
        handler.stop()


class _Worker:
    """Feeds a handler from one pumped replication connection, as the client service does."""

    def __init__(self, handler):
        self.handler = handler

    def new_connection(self, conn):
        self.handler.new_connection(conn)
        self.handler.set_transport(conn)

    def lost_connection(self, conn, reason=None):
        self.handler.lost_connection(conn, reason)

    def on_command(self, conn, cmd):
        self.handler.on_command(conn, cmd)


class _RunWorker(_Worker):
    """:class:`_Worker` passing the rows of one read on as one list, as the client service does."""

    def on_commands(self, conn, cmds):
        self.handler.on_commands(conn, cmds)


class ThroughTheHubTest(SynchronousTestCase):
    """A writer and a reader on two workers, joined by the real hub over in-memory pumps (layer 3)."""

    worker = _Worker

    def setUp(self):
        self.clock = MemoryReactorClock()
        self.gen = MultiWriterIdGenerator(EVENTS, "w1", 1, self.clock)
        self.writer = ReplicationHandler("w1", self.clock, streams=registry.streams(), sources={},
                                         generators={"events": self.gen})
        self.table = ListSource()  # what the writer committed; the reader catches up from it
        self.reader, self.applied, _ = make_handler(source=self.table, clock=self.clock,
                                                    positions={"events": {"w1": 1}})
        self.hub = ReplicationHub(None)
        self.pumps = {"w1": self._connect(self.writer, "w1"), "reader": self._connect(self.reader, "reader")}
        self._flush()
        self.next_id = 2

    def _connect(self, handler, name):
        server = make_protocol(Side.SERVER, self.hub, self.clock, server_name="hs")
        client = make_protocol(Side.CLIENT, self.worker(handler), self.clock, server_name="hs", instance_name=name)
        return Pump(server, client)

    def _flush(self):
        for _ in range(5):  # the hub relays from one pump to the other
            for pump in self.pumps.values():
                if not pump.closed:
                    pump.flush()

    def _commit(self, rows_per_fact, ok=True):
        """One writer transaction: facts of the given row counts, committed (or rolled back), then completed."""
        handle = self.gen.tracker.begin_fetch()
        ids = list(range(self.next_id, self.next_id + len(rows_per_fact)))
        self.next_id += len(ids)
        payloads = {}
        for sid, n in zip(ids, rows_per_fact, strict=True):
            rows = tuple(ev(sid * 10 + k) for k in range(n))
            payloads[sid] = FactPayload(rows, 0)
            if ok:
                self.table.rows.extend(("w1", sid, row) for row in rows)
        self.gen.finish(handle, ids, payloads, ok)
        return ids

    def _applied_w1(self):
        return [(t, rows) for i, t, rows in self.applied if i == "w1"]

    def test_writer_to_reader_over_pumped_protocols(self):
        """A writer on one worker reaches a reader on another through the real hub in memory."""
        self._commit([1, 1])
        self._flush()
        self.assertEqual(self.applied, [("w1", 2, ["$e20:hs"]), ("w1", 3, ["$e30:hs"])])
        self.assertEqual(self.reader.position("events", "w1"), 3)

    def test_malformed_row_relayed_through_the_hub_is_dropped_by_the_reader(self):
        """A row whose JSON is malformed passes the hub (which does not decode rows); the reader drops it with
        a warning naming the problem, keeps its connection, and applies the writer's next rows."""
        self.pumps["w1"].client_transport.write(b'RDATA events w1 2 ["$e:hs", oops]\n')
        with self.assertLogs("synflow.replication.handler", "WARNING") as logs:
            self._flush()
        self.assertEqual(self.reader.stats.bad_rows, 1)
        self.assertIn("dropping bad events row from w1: bad JSON", "\n".join(logs.output))
        self.assertFalse(any(p.closed for p in self.pumps.values()))
        self.assertEqual(self.applied, [])
        self._commit([1, 1])
        self._flush()
        self.assertEqual(self.applied, [("w1", 2, ["$e20:hs"]), ("w1", 3, ["$e30:hs"])])

    def test_batch_duplicate_disconnect_and_catch_up(self):
        """A batch applies whole, a duplicate is dropped, and after a reconnect a 250-fact gap is paged in, once each, in order."""
        (batch_id,) = self._commit([3])
        self._flush()
        self.assertEqual(self._applied_w1(), [(batch_id, ["$e20:hs", "$e21:hs", "$e22:hs"])])

        # The same row delivered twice (a retransmission) is stale the second time.
        (sid,) = self._commit([1])
        self.writer.send_command(RdataCommand("events", "w1", sid, ev(sid * 10).to_wire()))
        self._flush()
        self.assertEqual(self._applied_w1()[1:], [(sid, [f"$e{sid * 10}:hs"])])
        self.assertEqual(self.reader.stats.rdata_stale, 1)

        # The reader's link drops; the writer goes on (a rolled-back write among them).
        self.pumps["reader"].disconnect()
        missed = self._commit([1] * 120) + self._commit([1] * 5, ok=False) + self._commit([1] * 130)
        self._flush()
        self.assertEqual(self.reader.position("events", "w1"), sid)
        self.assertEqual(self.gen.position, missed[-1])

        # It reconnects: REPLICATE brings the writer's POSITION, whose gap is caught up in pages.
        self.pumps["reader"] = self._connect(self.reader, "reader")
        self._flush()
        self.assertEqual(self.reader.position("events", "w1"), missed[-1])
        pages = [c for c in self.table.calls if c[0] == "w1"]
        self.assertEqual(len(pages), 3)
        # Live rows flow again after the catch-up.
        after = self._commit([1, 2])
        self._flush()

        committed = [i for i in missed if i not in missed[120:125]] + after
        applied = self._applied_w1()
        self.assertEqual([t for t, _ in applied], [batch_id, sid, *committed])
        every_row = [e for _, rows in applied for e in rows]
        self.assertEqual(len(every_row), len(set(every_row)))
        self.assertEqual(applied[-1], (after[-1], [f"$e{after[-1] * 10}:hs", f"$e{after[-1] * 10 + 1}:hs"]))
        self.assertEqual(self.reader.position("events", "w1"), self.gen.position)


class ThroughTheHubRunsTest(ThroughTheHubTest):
    """The same, the reader's worker taking the rows of each read as one list (``on_commands``)."""

    worker = _RunWorker


_WRITERS = st.sampled_from(["w1", "w2", "reader"])  # "reader": the handler's own echo, ignored
_TOKENS = st.integers(min_value=1, max_value=12)
_STREAM_CMDS = st.one_of(
    st.builds(lambda w, t, n: RdataCommand("events", w, t, ev(n).to_wire()),
              _WRITERS, st.one_of(st.none(), _TOKENS), st.integers(0, 99)),
    st.builds(lambda w, a, b: PositionCommand("events", w, min(a, b), max(a, b)), _WRITERS, _TOKENS, _TOKENS),
    st.builds(lambda t: RdataCommand("no_such_stream", "w1", t, []), _TOKENS),
)


class RunsTest(SynchronousTestCase):
    """``on_commands`` decides exactly as ``on_command`` for each of its commands, in order."""

    def _reader(self, listener=None):
        table = ListSource([(w, t, ev(1000 + t)) for w in ("w1", "w2") for t in range(1, 13)])
        handler, applied, _ = make_handler(source=table)
        if listener is not None:
            handler.add_command_listener(RdataCommand, listener)
        conn = FakeConn()
        handler.new_connection(conn)
        return handler, applied, conn

    @settings(max_examples=200, deadline=None)
    @given(st.lists(_STREAM_CMDS, max_size=40), st.lists(st.integers(1, 8), min_size=1, max_size=10))
    def test_runs_apply_as_one_by_one(self, cmds, cuts):
        """Any commands, cut into runs anywhere: the same rows applied at the same tokens, the same positions
        and counts as delivering them one by one."""
        one, one_applied, one_conn = self._reader()
        for cmd in cmds:
            one.on_command(one_conn, cmd)
        runs, runs_applied, runs_conn = self._reader()
        i, k = 0, 0
        while i < len(cmds):
            n = cuts[k % len(cuts)]
            runs.on_commands(runs_conn, cmds[i:i + n])
            i, k = i + n, k + 1
        self.assertEqual(runs_applied, one_applied)
        self.assertEqual({w: runs.position("events", w) for w in ("w1", "w2")},
                         {w: one.position("events", w) for w in ("w1", "w2")})
        self.assertEqual(vars(runs.stats), vars(one.stats))

    def test_a_row_delivered_while_one_is_applied_waits_for_it(self):
        """A row handler that hands the handler another run (re-entrantly) sees that run's row applied after it
        returns, never inside its own call: the stream's rows stay in order."""
        handler, applied, conn = self._reader()
        order = []

        def handler_feeding(inst, tok, rows):
            order.append(("start", tok))
            if tok == 2:
                handler.on_commands(conn, [RdataCommand("events", "w1", 3, ev(3).to_wire())])
            order.append(("end", tok))

        handler.add_row_handler("events", handler_feeding)
        handler.on_commands(conn, [PositionCommand("events", "w1", 1, 1)])
        handler.on_commands(conn, [RdataCommand("events", "w1", 2, ev(2).to_wire())])
        self.assertEqual(order, [("start", 2), ("end", 2), ("start", 3), ("end", 3)])
        self.assertEqual(applied, [("w1", 2, ["$e2:hs"]), ("w1", 3, ["$e3:hs"])])
        self.assertEqual(handler.position("events", "w1"), 3)

    def test_a_failing_row_is_logged_and_the_next_one_applied(self):
        """A row whose processing raises is logged; the run's next row is still applied."""
        handler, applied, conn = self._reader()
        calls = []
        handler.add_row_handler("events", lambda inst, tok, rows: calls.append(tok))
        real = handler._process_rdata

        def process(view, c, cmd):
            if cmd.token == 2:
                raise RuntimeError("boom")
            real(view, c, cmd)

        handler._process_rdata = process
        handler.on_commands(conn, [PositionCommand("events", "w1", 1, 1)])
        with self.assertLogs("synflow.replication.handler", "ERROR") as logged:
            handler.on_commands(conn, [RdataCommand("events", "w1", 2, ev(2).to_wire()),
                                       RdataCommand("events", "w1", 3, ev(3).to_wire())])
        self.assertEqual(len(logged.records), 1)
        self.assertIn("error processing RDATA on events", logged.output[0])
        self.assertEqual(applied, [("w1", 3, ["$e3:hs"])])
        self.assertEqual(calls, [3])

    def test_command_listeners_still_see_every_row(self):
        """With a listener for RDATA, every row of a run reaches it, after the rows before it were applied."""
        seen = []
        handler, applied, conn = self._reader(lambda c, cmd: seen.append((cmd.token, len(applied))))
        handler.on_commands(conn, [PositionCommand("events", "w1", 1, 1),
                                   RdataCommand("events", "w1", 2, ev(2).to_wire()),
                                   RdataCommand("events", "w1", 3, ev(3).to_wire())])
        self.assertEqual(seen, [(2, 1), (3, 2)])
        self.assertEqual(applied, [("w1", 2, ["$e2:hs"]), ("w1", 3, ["$e3:hs"])])
