"""The TCP hub over real loopback sockets, started through the plugin's service."""

from __future__ import annotations

import os
import random

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.trial.unittest import TestCase

from synflow.app.build import build_service
from synflow.backoff import Backoff
from synflow.config import load_config
from synflow.replication.client import ReplicationClientService
from synflow.replication.commands import RdataCommand
from synflow.testing import RecordingReceiver


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

    def _raw(self):
        proto = LineCollector()
        d = connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), proto)
        self.addCleanup(lambda: proto.transport.loseConnection() if proto.transport else None)
        return d.addCallback(lambda _: proto)

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
        for _ in range(100):
            if "POSITION events good 1 2" in other.lines:
                break
            yield _sleep(0.02)
        self.assertIn("POSITION events good 1 2", other.lines)
        self.assertFalse(good.closed.called)

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
            )
            svc.startService()
            self.addCleanup(svc.stopService)
            clients.append(svc)
        for _ in range(100):
            if all(c.connected and c.connection.core.handshake_complete for c in clients):
                break
            yield _sleep(0.05)
        clients[0].send_command(RdataCommand("events", "worker0", 5, ["$a:tcp.test"]))
        clients[1].send_command(RdataCommand("events", "worker1", 6, ["$b:tcp.test"]))
        for _ in range(100):
            if receivers[0].received(RdataCommand) and receivers[1].received(RdataCommand):
                break
            yield _sleep(0.05)
        self.assertEqual(receivers[1].received(RdataCommand), [RdataCommand("events", "worker0", 5, ["$a:tcp.test"])])
        self.assertEqual(receivers[0].received(RdataCommand), [RdataCommand("events", "worker1", 6, ["$b:tcp.test"])])


def _sleep(seconds):
    d = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


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
            secret="s3cret",
        )
        svc.startService()
        self.addCleanup(svc.stopService)
        for _ in range(100):
            if svc.connected and svc.connection.core.handshake_complete:
                break
            yield _sleep(0.05)
        self.assertTrue(svc.connection.core.handshake_complete)
        yield _sleep(0.2)
        self.assertTrue(svc.connected, "the hub closed an authenticated connection")
