"""The Redis transport: the in-memory pub/sub fake, and the transport over it."""

from __future__ import annotations

import txredisapi
from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.config import load_config
from synflow.replication.handler import ReplicationHandler
from synflow.replication.redis import RedisTransportService
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import EVENTS, STREAMS, EventsRow
from synflow.testing import FakeRedisServer
from tests.cluster import sleep, wait_until
from tests.replication.test_handler import ListSource


def ev(n):
    return EventsRow(f"$e{n}:hs", "!r:hs", "m.test", None, "@u:hs", None)


class FakeRedisTest(TestCase):
    @inlineCallbacks
    def _client(self, server, subscriber=False, password=None):
        factory = txredisapi.RedisFactory(None, None, 1, isLazy=False, password=password)
        received = []
        if subscriber:
            class Sub(txredisapi.SubscriberProtocol):
                def messageReceived(self, pattern, channel, message):
                    received.append((channel, message))

            factory.protocol = Sub
        factory.startConnecting(server.endpoint())
        self.addCleanup(factory.disconnect)
        conn = yield factory.deferred
        return conn, received

    @inlineCallbacks
    def test_publish_reaches_subscribers(self):
        """A PUBLISH reaches every subscriber of the channel and counts them."""
        server = FakeRedisServer()
        sub1, got1 = yield self._client(server, subscriber=True)
        sub2, got2 = yield self._client(server, subscriber=True)
        yield sub1.subscribe(["chan"])
        yield sub2.subscribe(["other"])
        pub, _ = yield self._client(server)
        n = yield pub.publish("chan", "hello world")
        self.assertEqual(n, 1)
        yield wait_until(lambda: got1, 5, "the message")
        self.assertEqual(got1, [("chan", "hello world")])
        self.assertEqual(got2, [])

    @inlineCallbacks
    def test_password_required(self):
        """With a password set, the right one works and a wrong one is refused."""
        server = FakeRedisServer(password="s3cret")
        conn, _ = yield self._client(server, password="s3cret")
        pong = yield conn.ping()
        self.assertEqual(pong, "PONG")
        factory = txredisapi.RedisFactory(None, None, 1, isLazy=False, password="wrong")
        factory.startConnecting(server.endpoint())
        self.addCleanup(factory.disconnect)
        failure = yield self.assertFailure(factory.deferred, ValueError)
        self.assertIn("WRONGPASS", str(failure))

    @inlineCallbacks
    def test_kill_clients(self):
        """kill_clients drops every connection, as CLIENT KILL would."""
        server = FakeRedisServer()
        yield self._client(server)
        yield self._client(server)
        self.assertEqual(server.kill_clients(), 2)
        yield sleep(0.05)


def _config(tmp, name, prefix="t"):
    path = f"{tmp}-{name}.yaml"
    with open(path, "w") as f:
        f.write(
            f"server_name: hs\napp: {'event_persister' if name == 'w1' else 'cache_invalidator'}\n"
            f"instance_name: {name}\ndata_dir: {tmp}\n"
            f"instance_map: {{w1: {{port: 1}}, reader: {{port: 2}}}}\nstream_writers: {{events: [w1]}}\n"
            f"replication: {{transport: redis, redis: {{channel_prefix: {prefix}}}}}\n"
        )
    return load_config([path])


class RedisTransportOverFakeTest(TestCase):
    @inlineCallbacks
    def _pair(self, server, source=None):
        tmp = self.mktemp()
        gen = MultiWriterIdGenerator(EVENTS, "w1", 1, reactor)
        writer = ReplicationHandler("w1", reactor, streams=STREAMS, sources={}, generators={"events": gen})
        reader = ReplicationHandler("reader", reactor, streams=STREAMS, sources={"events": source or ListSource([])},
                                    initial_positions={"events": {"w1": 1}})
        applied = []
        reader.add_row_handler("events", lambda i, t, rows: applied.extend((t, r.event_id) for r in rows))
        transports = []
        for handler, name in ((writer, "w1"), (reader, "reader")):
            t = RedisTransportService(_config(tmp, name), handler, reactor, endpoint=server.endpoint())
            handler.set_transport(t)
            t.startService()
            self.addCleanup(t.stopService)
            transports.append(t)
        for t in transports:
            yield t.when_ready()
        return gen, writer, reader, transports, applied

    def _write(self, gen, ids, ok=True):
        handle = gen.tracker.begin_fetch()
        gen.finish(handle, ids, {i: FactPayload((ev(i),), 0) for i in ids}, ok)

    @inlineCallbacks
    def test_rows_reach_reader_and_echoes_are_dropped(self):
        """Rows published by a writer reach the reader once; the writer does not see its own echo."""
        server = FakeRedisServer()
        gen, writer, reader, (wt, rt), applied = yield self._pair(server)
        yield wait_until(lambda: reader.position("events", "w1") >= 1 and ("events", "w1") in
                         next(iter(reader._connected.values()), set()), 5, "the writer's POSITION")
        for i in range(2, 40):
            self._write(gen, [i])
        yield wait_until(lambda: reader.position("events", "w1") == 39, 5, "the rows")
        self.assertEqual(applied, [(i, f"$e{i}:hs") for i in range(2, 40)])
        self.assertLess(wt.messages_published, 38, "lines sent in one turn should share a PUBLISH")
        self.assertEqual(writer.stats.rdata_applied, 0)
        self.assertIn("SUBSCRIBE", server.commands)
        sub_index = server.commands.index("SUBSCRIBE")
        self.assertIn("PUBLISH", server.commands[sub_index:])

    @inlineCallbacks
    def test_reconnect_catches_up(self):
        """After every connection is killed, facts written meanwhile arrive through catch-up."""
        rows = [("w1", i, ev(i)) for i in range(2, 60)]
        server = FakeRedisServer()
        gen, writer, reader, (wt, rt), applied = yield self._pair(server, ListSource(rows))
        yield wait_until(lambda: rt.connected and wt.connected, 5, "both connected")
        yield sleep(0.1)
        for i in range(2, 20):
            self._write(gen, [i])
        yield wait_until(lambda: reader.position("events", "w1") == 19, 5, "the first rows")
        server.kill_clients()
        yield wait_until(lambda: not wt.connected, 5, "the writer to notice")
        for i in range(20, 40):
            self._write(gen, [i])  # dropped: nobody is connected
        self.assertGreater(wt.dropped_stream_commands, 0)
        yield wait_until(lambda: rt.connected and wt.connected, 20, "both to reconnect")
        for i in range(40, 60):
            self._write(gen, [i])
        yield wait_until(lambda: reader.position("events", "w1") == 59, 10, "every row")
        self.assertEqual([t for t, _ in applied], list(range(2, 60)))
        self.assertGreaterEqual(reader.stats.catch_ups, 1)

    @inlineCallbacks
    def test_garbage_and_unknown_streams_do_not_disconnect(self):
        """An unparseable message and an unknown stream are logged and ignored; the bus stays up."""
        server = FakeRedisServer()
        gen, writer, reader, (wt, rt), applied = yield self._pair(server)
        factory = txredisapi.RedisFactory(None, None, 1, isLazy=False)
        factory.startConnecting(server.endpoint())
        self.addCleanup(factory.disconnect)
        pub = yield factory.deferred
        yield pub.publish("t:hs", "GARBAGE \x00 line")
        yield pub.publish("t:hs", "POSITION typing w9 1 5")
        yield pub.publish("t:hs", "RDATA typing w9 6 [1]")
        yield sleep(0.2)
        self.assertEqual(rt.core.stats.bad_lines, 1)
        self.assertEqual(reader.stats.unknown_stream_commands, 2)
        self.assertTrue(rt.connected)
        self._write(gen, [2])
        yield wait_until(lambda: reader.position("events", "w1") == 2, 5, "a row after the garbage")
