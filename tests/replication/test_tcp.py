"""The TCP hub: which commands it relays, and the hub over real loopback sockets.

The relay list is pinned in memory (the real hub and adapters on
StringTransport); the rest runs the master started through the plugin's
service, with raw TCP clients and reconnecting workers.
"""

from __future__ import annotations

import os
import random
import re

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.app.build import build_service
from synflow.backoff import Backoff
from synflow.config import load_config
from synflow.replication import commands
from synflow.replication.client import ReplicationClientService
from synflow.replication.commands import (
    COMMANDS,
    AuthCommand,
    RdataCommand,
    Side,
    may_send,
    parse_line,
)
from synflow.replication.core import ConnectionCore, ConnectionOptions
from synflow.replication.hub import ReplicationHub
from synflow.replication.protocol import ReplicationProtocol
from synflow.testing import RecordingReceiver, attach, sent_lines
from tests.cluster import sleep, wait_until

PROTOCOL_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")

#: What the hub forwards to the other connections: the stream commands, so
#: writers on different workers see each other; REPLICATE, so every writer
#: answers it; REMOTE_SERVER_UP, which every federation sender needs. The rest
#: is per-connection (NAME, PING, ERROR, AUTH) or for the master alone
#: (USER_SYNC, CLEAR_USER_SYNC, FEDERATION_ACK), as in Synapse.
HUB_RELAYS = {"RDATA", "POSITION", "REPLICATE", "REMOTE_SERVER_UP"}


def _docstring_sample(name: str) -> str:
    match = re.search(r"Example: ``(.+?)``", COMMANDS[name].__doc__ or "")
    assert match is not None, name
    return match.group(1)


class HubRelayListTest(SynchronousTestCase):
    def _hub(self):
        handler = RecordingReceiver()
        hub = ReplicationHub(handler)
        clock = Clock()
        conns = []
        for _ in range(2):
            proto = ReplicationProtocol(ConnectionCore(Side.SERVER, server_name="tcp.test"), hub, clock)
            transport = attach(proto)
            transport.clear()
            conns.append((proto, transport))
        return hub, handler, conns

    def test_hub_relays_exactly_the_pinned_commands(self):
        """Of every command a client may send, the hub relays exactly RDATA, POSITION, REPLICATE and REMOTE_SERVER_UP, and hands all to the master."""
        relayed = set()
        for name, cls in COMMANDS.items():
            if not may_send(cls, Side.CLIENT):
                continue
            hub, handler, ((a, a_transport), (b, b_transport)) = self._hub()
            sample = _docstring_sample(name)
            b.dataReceived(sample.encode() + b"\n")
            self.assertFalse(b_transport.disconnecting, name)
            lines = sent_lines(a_transport)
            if lines:
                self.assertEqual([parse_line(line) for line in lines], [parse_line(sample)], name)
                relayed.add(name)
            self.assertEqual(sent_lines(b_transport), [], f"{name} was echoed to its sender")
            if cls is not AuthCommand:  # a hub without a secret accepts and drops AUTH
                self.assertEqual(handler.received(), [parse_line(sample)], f"{name} not handled by the master")
        self.assertEqual(relayed, HUB_RELAYS)

    def test_hub_relays_rows_without_decoding_their_json(self):
        """The hub forwards an RDATA's bytes without decoding its row: JSON is never decoded, and a row that
        is not JSON at all is relayed too (only the reader, which reads rows, can refuse it)."""
        decoded = []
        real_decode = commands.decode_json

        def counting_decode(text):
            decoded.append(text)
            return real_decode(text)

        self.patch(commands, "decode_json", counting_decode)
        hub, handler, ((a, a_transport), (b, b_transport)) = self._hub()
        lines = [b'RDATA events w1 5 ["$e:hs", "!r:hs",  "m.room.message",null,"@u:hs",null]',
                 b'RDATA events w1 6 ["$e:hs", not json at all',
                 b"RDATA caches w1 batch {}"]
        b.dataReceived(b"".join(line + b"\n" for line in lines))
        self.assertEqual(a_transport.value(), b"".join(line + b"\n" for line in lines))
        self.assertFalse(b_transport.disconnecting)
        self.assertEqual(decoded, [], "the hub decoded a row it only relays")
        self.assertEqual(hub.relayed, 3)
        # The header is still checked: a bad token closes the sender, and nothing is relayed.
        b.dataReceived(b'RDATA events w1 x7 ["$e:hs"]\n')
        self.assertTrue(b_transport.disconnecting)
        self.assertEqual(a_transport.value(), b"".join(line + b"\n" for line in lines))

    def test_lines_relayed_from_one_read_go_out_in_one_write(self):
        """The lines relayed from one read reach each other connection in one write, before the read returns."""
        hub, handler, ((a, a_transport), (b, b_transport)) = self._hub()
        writes = []
        real_write = a_transport.write
        self.patch(a_transport, "write", lambda data: (writes.append(data), real_write(data)))
        lines = b"".join(b"POSITION events w1 %d %d\n" % (i, i + 1) for i in range(5))
        b.dataReceived(lines)
        self.assertEqual(writes, [lines])

    def test_a_run_the_master_fails_on_is_still_relayed_and_handled_to_the_end(self):
        """The rows of one read are relayed to every other connection, and a master's handler that fails on
        one of them still gets the rest, the failure logged."""
        hub, handler, ((a, a_transport), (b, b_transport)) = self._hub()
        real = handler.on_command

        def fail_first(conn, cmd):
            real(conn, cmd)
            if len(handler.commands) == 1:
                raise RuntimeError("handler bug")

        self.patch(handler, "on_command", fail_first)
        lines = [b'RDATA events w1 %d ["$e%d:hs"]' % (t, t) for t in range(2, 5)]
        with self.assertLogs("synflow.replication.interfaces", "ERROR") as logs:
            b.dataReceived(b"".join(line + b"\n" for line in lines))
        self.assertIn("handler bug", "\n".join(logs.output))
        self.assertEqual(handler.received(), [parse_line(line) for line in lines])
        self.assertEqual(sent_lines(a_transport), [line.decode() for line in lines])
        self.assertEqual(sent_lines(b_transport), [])
        self.assertEqual(hub.relayed, 3)

    def test_protocol_doc_lists_the_relayed_commands(self):
        """The command table of docs/protocol.md marks exactly the commands the hub relays."""
        with open(PROTOCOL_DOC, encoding="utf-8") as f:
            rows = re.findall(r"^\| `([A-Z_]+)` \|.*\| (yes|no) \|$", f.read(), re.M)
        self.assertEqual({name for name, _ in rows}, set(COMMANDS))
        self.assertEqual({name for name, relayed in rows if relayed == "yes"}, HUB_RELAYS)


class LineCollector(Protocol):
    """A raw TCP client that collects lines and notices the close."""

    def __init__(self):
        self.buffer = b""
        self.lines: list[str] = []
        self.closed = Deferred()
        self._waiters: list[tuple[int, Deferred]] = []

    def dataReceived(self, data):
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.lines.append(line.decode())
        for want, d in list(self._waiters):
            if len(self.lines) >= want:
                self._waiters.remove((want, d))
                d.callback(self.lines[:want])

    def wait_lines(self, n):
        d = Deferred()
        if len(self.lines) >= n:
            d.callback(self.lines[:n])
        else:
            self._waiters.append((n, d))
        return d.addTimeout(10, reactor)

    def connectionLost(self, reason):
        self.closed.callback(None)


def _write_config(testcase, overrides=""):
    base = os.path.abspath(testcase.mktemp())
    os.makedirs(base)
    path = os.path.join(base, "master.yaml")
    with open(path, "w") as f:
        f.write(
            "server_name: tcp.test\n"
            "app: master\n"
            "instance_name: master\n"
            f"data_dir: {base}/var\n"
            f"audit: {{dir: {base}/var/audit}}\n"
            "replication:\n"
            "  hub: {host: 127.0.0.1, port: 0}\n" + overrides
        )
    return path


class HubOverTcpTest(TestCase):
    @inlineCallbacks
    def setUp(self):
        config = load_config([_write_config(self)])
        self.master = build_service(config, reactor, exit_on_failure=False)
        self.master.startService()
        self.addCleanup(self.master.stopService)
        yield self.master.ready
        listener = self.master.replication.service.getServiceNamed("replication-hub")
        yield listener.when_listening()
        self.port = listener.bound_port
        # The deployment's generated secret (the config names none): raw clients AUTH with it.
        self.secret = config.replication_secret()

    def _raw(self):
        proto = LineCollector()
        d = connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), proto)
        self.addCleanup(lambda: proto.transport.loseConnection() if proto.transport else None)

        def authenticate(_):
            proto.transport.write(b"AUTH " + self.secret.encode() + b"\n")
            return proto

        return d.addCallback(authenticate)

    @inlineCallbacks
    def test_silent_client_reads_server_then_ping(self):
        """A raw client that sends nothing reads SERVER <name> then PING <ms>."""
        proto = yield self._raw()
        first, second = yield proto.wait_lines(2)
        self.assertEqual(first, "SERVER tcp.test")
        self.assertRegex(second, r"^PING \d{13}$")

    @inlineCallbacks
    def test_garbage_closes_only_that_connection(self):
        """Garbage gets ERROR and a close on its connection while others keep working."""
        bad = yield self._raw()
        good = yield self._raw()
        other = yield self._raw()
        yield bad.wait_lines(2)
        yield good.wait_lines(2)
        yield other.wait_lines(2)
        bad.transport.write(b"\x00\x01 not a command\n")
        yield bad.closed
        self.assertTrue(bad.lines[-1].startswith("ERROR failed to parse line"), bad.lines)
        good.transport.write(b"NAME good\nPOSITION events good 1 2\n")
        yield wait_until(lambda: "POSITION events good 1 2" in other.lines, 5, "the relayed POSITION", 0.02)
        self.assertFalse(good.closed.called)

    @inlineCallbacks
    def test_replicate_is_relayed(self):
        """A REPLICATE sent by one raw client reaches another raw client through the hub."""
        a = yield self._raw()
        b = yield self._raw()
        yield a.wait_lines(2)
        yield b.wait_lines(2)
        a.transport.write(b"NAME a\n")
        b.transport.write(b"NAME b\nREPLICATE\n")
        yield wait_until(lambda: "REPLICATE " in a.lines, 5, "the relayed REPLICATE", 0.02)
        self.assertNotIn("REPLICATE ", b.lines, "the hub echoed REPLICATE to its sender")

    @inlineCallbacks
    def test_two_clients_see_each_others_rdata(self):
        """Two reconnecting clients see each other's RDATA relayed through the hub."""
        receivers = [RecordingReceiver(), RecordingReceiver()]
        clients = []
        for i, receiver in enumerate(receivers):
            svc = ReplicationClientService(
                TCP4ClientEndpoint(reactor, "127.0.0.1", self.port),
                server_name="tcp.test",
                instance_name=f"worker{i}",
                handler=receiver,
                clock=reactor,
                backoff=Backoff(initial_s=0.05, max_s=0.5),
                rng=random.Random(i),
                options=ConnectionOptions(secret=self.secret),
            )
            svc.startService()
            self.addCleanup(svc.stopService)
            clients.append(svc)
        yield wait_until(
            lambda: all(c.connected and c.connection.core.handshake_complete for c in clients), 5, "both handshakes"
        )
        clients[0].send_command(RdataCommand("events", "worker0", 5, ["$a:tcp.test"]))
        clients[1].send_command(RdataCommand("events", "worker1", 6, ["$b:tcp.test"]))
        yield wait_until(
            lambda: receivers[0].received(RdataCommand) and receivers[1].received(RdataCommand), 5, "the relayed RDATA"
        )
        self.assertEqual(receivers[1].received(RdataCommand), [RdataCommand("events", "worker0", 5, ["$a:tcp.test"])])
        self.assertEqual(receivers[0].received(RdataCommand), [RdataCommand("events", "worker1", 6, ["$b:tcp.test"])])




class HubWithSecretTest(TestCase):
    @inlineCallbacks
    def setUp(self):
        config = load_config([_write_config(self, "  secret: s3cret\n")])
        self.master = build_service(config, reactor, exit_on_failure=False)
        self.master.startService()
        self.addCleanup(self.master.stopService)
        yield self.master.ready
        listener = self.master.replication.service.getServiceNamed("replication-hub")
        yield listener.when_listening()
        self.port = listener.bound_port

    @inlineCallbacks
    def test_unauthenticated_client_refused(self):
        """Over real TCP, a client that does not send AUTH first is refused and closed."""
        proto = LineCollector()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), proto)
        proto.transport.write(b"NAME intruder\nREPLICATE\n")
        yield proto.closed
        self.assertIn("ERROR authentication required: send AUTH <secret> first", proto.lines)

    @inlineCallbacks
    def test_client_with_secret_works(self):
        """A worker configured with the secret authenticates and completes its handshake."""
        receiver = RecordingReceiver()
        svc = ReplicationClientService(
            TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), server_name="tcp.test", instance_name="w1",
            handler=receiver, clock=reactor, backoff=Backoff(initial_s=0.05, max_s=0.5), rng=random.Random(1),
            options=ConnectionOptions(secret="s3cret"),
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        yield wait_until(lambda: svc.connected and svc.connection.core.handshake_complete, 5, "the handshake")
        yield sleep(0.2)
        self.assertTrue(svc.connected, "the hub closed an authenticated connection")
