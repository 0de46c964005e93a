"""The Redis transport: the in-memory pub/sub fake, and the transport over it."""

from __future__ import annotations

import logging
import os

import txredisapi
from OpenSSL import crypto
from prometheus_client import REGISTRY
from twisted.internet import reactor, ssl
from twisted.internet.defer import inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow import registry
from synflow.config import RedisConfig, TlsConfig, load_config
from synflow.redis_connect import redis_endpoint
from synflow.replication.commands import (
    ClearUserSyncCommand,
    FederationAckCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    SyncState,
    UserSyncCommand,
)
from synflow.replication.handler import ReplicationHandler
from synflow.replication.redis import RedisTransportService
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import EVENTS, EventsRow
from synflow.testing import FakeRedisServer, RecordingReceiver
from tests.certs import certificate
from tests.cluster import sleep, wait_until
from tests.replication.test_handler import ListSource


class LogCapture(logging.Handler):
    """Collects the records one stdlib logger emits at WARNING and above."""

    def __init__(self, testcase: TestCase, name: str) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        logger = logging.getLogger(name)
        logger.addHandler(self)
        testcase.addCleanup(logger.removeHandler, self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def dropped(command: str) -> float:
    """The exported count of dropped commands of this name, so far."""
    value = REGISTRY.get_sample_value("synflow_replication_dropped_commands_total", {"command": command})
    return value or 0.0


def ev(n):
    return EventsRow(f"$e{n}:hs", "!r:hs", "m.test", None, "@u:hs", None)


@inlineCallbacks
def redis_client(testcase, server, label=None, *, password=None, on_message=None):
    """A plain txredisapi client on the fake through ``server.endpoint(label)``, disconnected at cleanup.

    With ``on_message``, a subscriber calling ``on_message(channel, message)`` for each message.
    """
    factory = txredisapi.RedisFactory(None, None, 1, isLazy=False, password=password)
    if on_message is not None:
        class Sub(txredisapi.SubscriberProtocol):
            def messageReceived(self, pattern, channel, message):
                on_message(channel, message)

        factory.protocol = Sub
    factory.startConnecting(server.endpoint(label))
    testcase.addCleanup(factory.disconnect)
    conn = yield factory.deferred
    return conn


class FakeRedisTest(TestCase):
    @inlineCallbacks
    def _client(self, server, subscriber=False, password=None):
        received = []
        on_message = (lambda channel, message: received.append((channel, message))) if subscriber else None
        conn = yield redis_client(self, server, password=password, on_message=on_message)
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
        failure = yield self.assertFailure(redis_client(self, server, password="wrong"), ValueError)
        self.assertIn("WRONGPASS", str(failure))

    @inlineCallbacks
    def test_event_log_and_delayed_subscribe(self):
        """The event log tags each client with its endpoint's label, and a delayed SUBSCRIBE is confirmed late and in order."""
        server = FakeRedisServer(subscribe_delay_s=0.1)
        received = []
        sub = yield redis_client(self, server, "a", on_message=lambda channel, message: received.append(message))
        pub = yield redis_client(self, server, "b")
        confirmed = []
        subscribed = sub.subscribe(["chan"]).addCallback(confirmed.append)
        yield sleep(0.02)
        n = yield pub.publish("chan", "too early")
        self.assertEqual(n, 0, "a delayed SUBSCRIBE took effect before its confirmation")
        self.assertEqual(confirmed, [])
        yield subscribed
        self.assertEqual(len(confirmed), 1)
        n = yield pub.publish("chan", "in time")
        self.assertEqual(n, 1)
        yield wait_until(lambda: received, 5, "the message")
        self.assertEqual(received, ["in time"])
        self.assertEqual(server.published("b"), [b"too early", b"in time"])
        kinds = [(e.kind, e.args[0]) for e in server.events_of("a")]
        self.assertEqual(kinds[-3:], [("command", b"SUBSCRIBE"), ("subscribed", b"chan"), ("message", b"chan")])
        self.assertEqual(server.events_of("a")[-1].args, (b"chan", b"in time"))

    @inlineCallbacks
    def test_kill_clients(self):
        """kill_clients drops every connection, as CLIENT KILL would."""
        server = FakeRedisServer()
        yield self._client(server)
        yield self._client(server)
        self.assertEqual(server.kill_clients(), 2)
        yield sleep(0.05)


def _config(tmp, name, prefix="t", one_line=False):
    path = f"{tmp}-{name}.yaml"
    with open(path, "w") as f:
        f.write(
            f"server_name: hs\napp: {'event_persister' if name == 'w1' else 'cache_invalidator'}\n"
            f"instance_name: {name}\ndata_dir: {tmp}\n"
            f"instance_map: {{w1: {{port: 1}}, reader: {{port: 2}}}}\nstream_writers: {{events: [w1]}}\n"
            f"replication: {{transport: redis, redis: {{channel_prefix: {prefix}, "
            f"one_line_per_message: {'true' if one_line else 'false'}}}}}\n"
        )
    return load_config([path])


def _lines(payloads):
    return [line for payload in payloads for line in payload.split(b"\n")]


class RedisTransportOverFakeTest(TestCase):
    one_line = False

    @inlineCallbacks
    def _pair(self, server, source=None):
        tmp = self.mktemp()
        gen = MultiWriterIdGenerator(EVENTS, "w1", 1, reactor)
        writer = ReplicationHandler("w1", reactor, streams=registry.streams(), sources={}, generators={"events": gen})
        reader = ReplicationHandler("reader", reactor, streams=registry.streams(), sources={"events": source or ListSource([])},
                                    initial_positions={"events": {"w1": 1}})
        applied = []
        reader.add_row_handler("events", lambda i, t, rows: applied.extend((t, r.event_id) for r in rows))
        transports = []
        for handler, name in ((writer, "w1"), (reader, "reader")):
            t = RedisTransportService(_config(tmp, name, one_line=self.one_line), handler, reactor,
                                      endpoint=server.endpoint(name))
            handler.set_transport(t)
            t.startService()
            self.addCleanup(t.stopService)
            transports.append(t)
        for t in transports:
            yield t.when_ready()
        return gen, writer, reader, transports, applied

    @inlineCallbacks
    def _single(self, server, handler, name="w1"):
        """One transport on its own, with ``handler``; returns it once subscribed."""
        t = RedisTransportService(_config(self.mktemp(), name, one_line=self.one_line), handler, reactor,
                                  endpoint=server.endpoint(name))
        t.startService()
        self.addCleanup(t.stopService)
        yield t.when_ready()
        return t

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
        if self.one_line:
            self.assertGreaterEqual(wt.messages_published, 38, "each line should be its own PUBLISH")
        else:
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
        pub = yield redis_client(self, server)
        yield pub.publish("t:hs", "GARBAGE \x00 line")
        yield pub.publish("t:hs", "POSITION typing w9 1 5")
        yield pub.publish("t:hs", "RDATA typing w9 6 [1]")
        yield sleep(0.2)
        self.assertEqual(rt.core.stats.bad_lines, 1)
        self.assertEqual(reader.stats.unknown_stream_commands, 2)
        self.assertTrue(rt.connected)
        self._write(gen, [2])
        yield wait_until(lambda: reader.position("events", "w1") == 2, 5, "a row after the garbage")

    @inlineCallbacks
    def test_subscribe_then_replicate_then_positions(self):
        """Each process publishes nothing before its SUBSCRIBE is confirmed, then REPLICATE, then its own POSITIONs."""
        server = FakeRedisServer(subscribe_delay_s=0.1)
        gen, writer, reader, transports, applied = yield self._pair(server)

        def settled():
            return all(server.published(n) and any(e.kind == "subscribed" for e in server.events_of(n))
                       for n in ("w1", "reader"))

        yield wait_until(settled, 5, "both processes to subscribe and publish")
        for name in ("w1", "reader"):
            events = server.events_of(name)
            confirmed = [i for i, e in enumerate(events) if e.kind == "subscribed"][0]
            publishes = [i for i, e in enumerate(events) if e.kind == "command" and e.args[0] == b"PUBLISH"]
            self.assertTrue(publishes, f"{name} published nothing")
            self.assertGreater(publishes[0], confirmed, f"{name} published before its subscription was confirmed")
            lines = _lines(server.published(name))
            self.assertEqual(lines[0], b"REPLICATE ", name)
        own = [i for i, line in enumerate(_lines(server.published("w1"))) if line.startswith(b"POSITION events w1 ")]
        self.assertTrue(own, "the writer announced no POSITION")
        self.assertGreater(own[0], 0)

    @inlineCallbacks
    def test_framing(self):
        """By default lines sent in one turn share a PUBLISH joined by newlines; one_line_per_message publishes each alone."""
        server = FakeRedisServer()
        gen, writer, reader, transports, applied = yield self._pair(server)
        yield wait_until(lambda: ("events", "w1") in next(iter(reader._connected.values()), set()), 5, "the writer's POSITION")
        before = len(server.published("w1"))
        for i in range(2, 12):
            self._write(gen, [i])
        yield wait_until(lambda: reader.position("events", "w1") == 11, 5, "the rows")
        self.assertEqual([t for t, _ in applied], list(range(2, 12)))
        payloads = server.published("w1")
        new = payloads[before:]
        rows = [line for line in _lines(new) if line.startswith(b"RDATA")]
        self.assertEqual(rows, [f'RDATA events w1 {i} ["$e{i}:hs","!r:hs","m.test",null,"@u:hs",null]'.encode()
                                for i in range(2, 12)])
        if self.one_line:
            self.assertTrue(all(b"\n" not in p for p in payloads), payloads)
            self.assertEqual(_lines(payloads[:2]), [b"REPLICATE ", b"POSITION events w1 1 1"])
        else:
            self.assertEqual(payloads[0], b"REPLICATE \nPOSITION events w1 1 1")
            self.assertLess(len(new), len(rows))

    @inlineCallbacks
    def test_own_echoes_never_reach_the_handler(self):
        """A process's own REPLICATE and other commands come back from Redis but never reach its handler; others' do."""
        server = FakeRedisServer()
        receiver = RecordingReceiver()
        t = yield self._single(server, receiver)
        own = [RemoteServerUpCommand("a.example.com"), UserSyncCommand("w1", "@u:hs", None, SyncState.START, 5),
               ClearUserSyncCommand("w1"), FederationAckCommand("w1", 3)]
        for cmd in own:
            t.send_command(cmd)

        def echoed():
            return [line for e in server.events_of("w1") if e.kind == "message" for line in e.args[1].split(b"\n")]

        yield wait_until(lambda: len(echoed()) >= 5, 5, "the echoes of our own publishes")
        self.assertEqual(echoed()[0], b"REPLICATE ")
        self.assertEqual(len(echoed()), 5)
        self.assertEqual(receiver.received(), [])
        pub = yield redis_client(self, server, "raw")
        yield pub.publish("t:hs", "REPLICATE ")
        yield pub.publish("t:hs", "REMOTE_SERVER_UP a.example.com")
        yield wait_until(lambda: len(receiver.received()) >= 2, 5, "another process's commands")
        self.assertEqual(receiver.received(), [ReplicateCommand(), RemoteServerUpCommand("a.example.com")])

    @inlineCallbacks
    def test_commands_dropped_at_disconnect_are_counted(self):
        """Lines still unpublished when Redis drops us, and commands sent while down, are counted per command; only non-stream ones warn."""
        server = FakeRedisServer()
        t = yield self._single(server, RecordingReceiver())
        yield sleep(0.05)
        log = LogCapture(self, "synflow.replication.redis")
        names = ("USER_SYNC", "REMOTE_SERVER_UP", "RDATA", "POSITION", "CLEAR_USER_SYNC")
        before = {n: dropped(n) for n in names}
        t.send_command(UserSyncCommand("w1", "@u:hs", "D", SyncState.START, 5))
        t.send_command(RemoteServerUpCommand("a.example.com"))
        t.send_command(RdataCommand("events", "w1", 7, [1]))
        server.kill_clients(immediately=True)  # before the outbox is flushed
        self.assertFalse(t.connected)
        self.assertEqual({n: dropped(n) - before[n] for n in names},
                         {"USER_SYNC": 1, "REMOTE_SERVER_UP": 1, "RDATA": 1, "POSITION": 0, "CLEAR_USER_SYNC": 0})
        self.assertEqual((t.dropped_commands, t.dropped_stream_commands), (2, 1))
        warnings = [m for m in log.messages() if "dropped" in m]
        self.assertEqual(len(warnings), 1, log.messages())
        self.assertIn("1 REMOTE_SERVER_UP, 1 USER_SYNC", warnings[0])
        self.assertNotIn("RDATA", warnings[0])
        t.send_command(PositionCommand("events", "w1", 7, 8))
        self.assertEqual([m for m in log.messages() if "dropped" in m], warnings, "a dropped POSITION warned")
        t.send_command(ClearUserSyncCommand("w1"))
        self.assertEqual(dropped("POSITION") - before["POSITION"], 1)
        self.assertEqual(dropped("CLEAR_USER_SYNC") - before["CLEAR_USER_SYNC"], 1)
        self.assertIn("dropped CLEAR_USER_SYNC", log.messages()[-1])
        self.assertEqual((t.dropped_commands, t.dropped_stream_commands), (3, 2))
        self.assertEqual(server.published("w1"), [b"REPLICATE "], "a dropped line was published after all")

    @inlineCallbacks
    def test_unknown_stream_logged_once(self):
        """Repeated POSITION and RDATA for a stream this process does not know warn once per stream and are ignored."""
        server = FakeRedisServer()
        reader = ReplicationHandler("reader", reactor, streams=registry.streams(), sources={"events": ListSource([])})
        rt = yield self._single(server, reader, "reader")
        reader.set_transport(rt)
        log = LogCapture(self, "synflow.replication.handler")
        pub = yield redis_client(self, server, "raw")
        for line in ("POSITION typing w9 1 5", "RDATA typing w9 6 [1]", "POSITION typing w9 6 9",
                     "RDATA typing w9 10 [2]", "POSITION receipts w9 1 2", "POSITION receipts w9 2 3"):
            yield pub.publish("t:hs", line)
        yield wait_until(lambda: reader.stats.unknown_stream_commands == 6, 5, "the unknown-stream commands")
        yield sleep(0.05)
        unknown = [m for m in log.messages() if "unknown stream" in m]
        self.assertEqual(len([m for m in unknown if "'typing'" in m]), 1, unknown)
        self.assertEqual(len([m for m in unknown if "'receipts'" in m]), 1, unknown)
        self.assertEqual(len(unknown), 2, unknown)
        self.assertTrue(rt.connected)


class RedisOneLinePerMessageTest(RedisTransportOverFakeTest):
    """The same transport tests with ``one_line_per_message: true``."""

    one_line = True


class RedisEndpointTest(SynchronousTestCase):
    def _connect(self, cfg: RedisConfig) -> tuple[object, MemoryReactor, Factory]:
        reactor = MemoryReactor()
        endpoint = redis_endpoint(reactor, cfg)
        factory = Factory.forProtocol(Protocol)
        endpoint.connect(factory)
        return endpoint, reactor, factory

    def test_unix_socket(self):
        """A configured path connects to that Unix socket with the connect timeout, not over TCP."""
        cfg = RedisConfig(host="ignored.example", path="/run/redis/redis.sock", connect_timeout_s=3.5)
        endpoint, reactor, factory = self._connect(cfg)
        self.assertIsInstance(endpoint, UNIXClientEndpoint)
        self.assertEqual(reactor.tcpClients, [])
        ((path, used_factory, timeout, _check_pid),) = reactor.unixClients
        self.assertEqual((path, timeout), ("/run/redis/redis.sock", 3.5))

    def test_plain_tcp(self):
        """Without a path or TLS, the endpoint is plain TCP to host and port with the connect timeout."""
        endpoint, reactor, factory = self._connect(RedisConfig(host="10.1.2.3", port=6380, connect_timeout_s=4))
        self.assertIsInstance(endpoint, TCP4ClientEndpoint)
        ((host, port, _factory, timeout, _bind),) = reactor.tcpClients
        self.assertEqual((host, port, timeout), ("10.1.2.3", 6380, 4))
        self.assertEqual(self._first_bytes(_factory), b"", "plain TCP wrote something (a TLS handshake?)")

    def _first_bytes(self, factory: Factory) -> bytes:
        """What a connection built by ``factory`` writes as soon as it connects."""
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return transport.value()

    def _tls(self, combined: bool) -> None:
        base = self.mktemp()
        os.makedirs(base)
        ca_pem, _, ca = certificate("test CA")
        cert_pem, key_pem, _ = certificate("synflow-client", issuer=ca)
        paths = {}
        for name, data in (("ca", ca_pem), ("cert", cert_pem + key_pem if combined else cert_pem), ("key", key_pem)):
            paths[name] = os.path.join(base, f"{name}.pem")
            with open(paths[name], "wb") as f:
                f.write(data)
        calls = []
        real = ssl.optionsForClientTLS

        def recording(hostname, **kwargs):
            calls.append((hostname, kwargs))
            return real(hostname, **kwargs)

        self.patch(ssl, "optionsForClientTLS", recording)
        tls = TlsConfig(ca_file=paths["ca"], cert_file=paths["cert"], key_file=None if combined else paths["key"])
        _, reactor, factory = self._connect(RedisConfig(host="redis.example", port=6390, tls=tls, connect_timeout_s=2))
        ((host, port, tls_factory, timeout, _bind),) = reactor.tcpClients
        self.assertEqual((host, port, timeout), ("redis.example", 6390, 2))
        hello = self._first_bytes(tls_factory)
        self.assertEqual(hello[:1], b"\x16", "the connection does not open with a TLS handshake record")
        self.assertIn(b"redis.example", hello, "the ClientHello does not name the server (SNI)")
        ((hostname, kwargs),) = calls
        self.assertEqual(hostname, "redis.example")
        self.assertEqual(set(kwargs), {"trustRoot", "clientCertificate"})
        self.assertEqual(kwargs["trustRoot"], ssl.Certificate.loadPEM(ca_pem))
        client = kwargs["clientCertificate"]
        self.assertEqual(client.getSubject().commonName, b"synflow-client")
        self.assertEqual(client.dump(), ssl.Certificate.loadPEM(cert_pem).dump())
        self.assertEqual(client.privateKey.dump(), ssl.KeyPair.load(key_pem, crypto.FILETYPE_PEM).dump())

    def test_tls_with_ca_cert_and_key(self):
        """With TLS, the TCP endpoint is wrapped in TLS that verifies the host against the CA and presents the client certificate and key."""
        self._tls(combined=False)

    def test_tls_with_combined_cert_and_key(self):
        """A cert_file holding both the certificate and its key works without key_file."""
        self._tls(combined=True)

    def test_tls_ca_only(self):
        """TLS with only a CA verifies the server and presents no client certificate."""
        base = self.mktemp()
        os.makedirs(base)
        ca_pem, _, _ = certificate("test CA")
        path = os.path.join(base, "ca.pem")
        with open(path, "wb") as f:
            f.write(ca_pem)
        calls = []
        self.patch(ssl, "optionsForClientTLS", lambda hostname, **kw: calls.append((hostname, kw)) or ssl.CertificateOptions())
        self._connect(RedisConfig(host="redis.example", tls=TlsConfig(ca_file=path)))
        ((hostname, kwargs),) = calls
        self.assertEqual((hostname, set(kwargs)), ("redis.example", {"trustRoot"}))
