"""Protocol conformance: the real adapter on StringTransport with a Clock."""

from __future__ import annotations

import logging
import random
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import fail, succeed
from twisted.internet.error import ConnectionDone, ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from synflow.backoff import Backoff
from synflow.errors import LocalProtocolError
from synflow.replication.batch import write_batch
from synflow.replication.client import ReplicationClientService
from synflow.replication.commands import (
    MAX_LINE_LENGTH,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ServerCommand,
    Side,
    parse_line,
)
from synflow.replication.core import (
    Close,
    ConnectionCore,
    ConnectionOptions,
    Deliver,
    HandshakeDone,
    State,
)
from synflow.replication.protocol import _BATCH_BYTES
from synflow.testing import PumpTransport, RecordingReceiver, attach, make_protocol, sent_lines

T0 = 1490197665.618


def _dropped(command: str) -> float:
    """The exported count of commands of this name dropped while disconnected."""
    return REGISTRY.get_sample_value("synflow_replication_dropped_commands_total", {"command": command}) or 0.0


def _server(clock, **kw):
    receiver = RecordingReceiver()
    proto = make_protocol(Side.SERVER, receiver, clock, server_name="example.com", options=ConnectionOptions(**kw))
    return proto, attach(proto), receiver


def _client(clock, **kw):
    receiver = RecordingReceiver()
    proto = make_protocol(Side.CLIENT, receiver, clock, server_name="example.com", instance_name="persister1",
                          options=ConnectionOptions(**kw))
    return proto, attach(proto), receiver


def _clock(t=T0):
    clock = Clock()
    clock.advance(t)
    return clock


class HandshakeTest(SynchronousTestCase):
    def test_server_handshake_bytes(self):
        """On connect the server writes exactly SERVER then PING with ms since the epoch."""
        proto, transport, receiver = _server(_clock())
        self.assertEqual(transport.value(), b"SERVER example.com\nPING 1490197665618\n")
        self.assertEqual(receiver.made, [proto])

    def test_client_handshake_bytes(self):
        """On connect the client writes exactly NAME, PING and REPLICATE."""
        proto, transport, receiver = _client(_clock())
        self.assertEqual(
            transport.value(), b"NAME persister1\nPING 1490197665618\nREPLICATE \n"
        )

    def test_client_accepts_right_server(self):
        """A client that gets the expected SERVER completes its handshake."""
        proto, transport, receiver = _client(_clock())
        done = proto.when_handshake_done()
        proto.dataReceived(b"SERVER example.com\nPING 1\n")
        self.assertIs(self.successResultOf(done), proto)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(receiver.received(), [ServerCommand("example.com"), PingCommand("1")])

    def test_client_rejects_wrong_server(self):
        """A client that gets another server's name sends ERROR Wrong remote and closes."""
        proto, transport, receiver = _client(_clock())
        done = proto.when_handshake_done()
        transport.clear()
        proto.dataReceived(b"SERVER other.example.com\n")
        self.assertEqual(sent_lines(transport), ["ERROR Wrong remote"])
        self.assertTrue(transport.disconnecting)
        proto.connectionLost()
        self.failureResultOf(done)

    def test_server_learns_name(self):
        """The server records the client's NAME as the peer name."""
        proto, transport, receiver = _server(_clock())
        proto.dataReceived(b"NAME persister1\n")
        self.assertEqual(proto.peer_name, "persister1")
        self.assertEqual(receiver.received(), [NameCommand("persister1")])

    def test_blank_lines_ignored(self):
        """Blank and whitespace-only lines are ignored without error."""
        proto, transport, receiver = _server(_clock())
        transport.clear()
        proto.dataReceived(b"\n  \n\t\nPING 5\n")
        self.assertEqual(receiver.received(), [PingCommand("5")])
        self.assertEqual(transport.value(), b"")


class KeepAliveTest(SynchronousTestCase):
    def test_ping_after_five_idle_seconds(self):
        """After 5 s of sending nothing the side sends a PING, and not before."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        transport.clear()
        clock.advance(4)
        self.assertEqual(transport.value(), b"")
        clock.advance(1)
        self.assertEqual(sent_lines(transport), ["PING 1005000"])

    def test_any_command_defers_the_ping(self):
        """Any command sent counts as traffic, so no PING follows it within 5 s."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        clock.advance(3)
        proto.send_command(PositionCommand("events", "master", 1, 1))
        transport.clear()
        clock.advance(4)
        self.assertEqual(transport.value(), b"")
        clock.advance(1)
        self.assertEqual(sent_lines(transport), ["PING 1008000"])

    def test_no_timeout_before_peer_pings(self):
        """A peer that never pinged (a person on netcat) is never timed out."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        proto.dataReceived(b"NAME nc-user\n")
        for _ in range(120):
            clock.advance(1)
        self.assertFalse(transport.disconnecting)

    def test_timeout_after_peer_ping(self):
        """Once the peer has pinged, 15 s of silence sends ERROR ping timeout and closes."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        proto.dataReceived(b"PING 1\n")
        for _ in range(14):
            clock.advance(1)
        self.assertFalse(transport.disconnecting)
        transport.clear()
        clock.advance(1)
        self.assertEqual(sent_lines(transport), ["ERROR ping timeout"])
        self.assertTrue(transport.disconnecting)

    def test_timeout_is_configurable(self):
        """The ping timeout is a parameter of the connection."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock, ping_timeout_s=30)
        proto.dataReceived(b"PING 1\n")
        for _ in range(29):
            clock.advance(1)
        self.assertFalse(transport.disconnecting)
        clock.advance(1)
        self.assertTrue(transport.disconnecting)

    def test_traffic_resets_timeout(self):
        """Each received line restarts the silence timer."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        proto.dataReceived(b"PING 1\n")
        for _ in range(40):
            clock.advance(1)
            proto.dataReceived(b"PING 2\n")
        self.assertFalse(transport.disconnecting)

    def test_close_aborts_if_peer_never_drains(self):
        """A connection that does not finish closing is aborted after the close timeout."""
        clock = _clock(1000)
        proto, transport, _ = _server(clock)
        proto.dataReceived(b"BOGUS\n")
        self.assertTrue(transport.disconnecting)
        self.assertFalse(transport.aborted)
        clock.advance(15)
        self.assertTrue(transport.aborted)


class ErrorPathTest(SynchronousTestCase):
    def _check_one_error_then_close(self, side, data, fragment):
        clock = _clock()
        proto, transport, receiver = (_server if side is Side.SERVER else _client)(clock)
        transport.clear()
        proto.dataReceived(data + b"PING 1\n")
        lines = sent_lines(transport)
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("ERROR "), lines)
        self.assertIn(fragment, lines[0])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(receiver.received(PingCommand), [])

    def test_unknown_command(self):
        """An unknown command gets one ERROR and a close; nothing after it is handled."""
        self._check_one_error_then_close(Side.SERVER, b"HELLO there\n", "unknown command 'HELLO'")

    def test_malformed_line(self):
        """A malformed line gets one ERROR naming the problem and a close."""
        self._check_one_error_then_close(Side.SERVER, b"POSITION events w1 x 2\n", "not an integer")

    def test_bad_utf8(self):
        """A line that is not UTF-8 gets one ERROR and a close."""
        self._check_one_error_then_close(Side.SERVER, b"PING \xff\n", "UTF-8")

    def test_server_command_from_client(self):
        """A client that sends SERVER gets one ERROR (wrong side) and a close."""
        self._check_one_error_then_close(Side.SERVER, b"SERVER evil\n", "invalid command from client: SERVER")

    def test_client_command_from_server(self):
        """A server that sends NAME or USER_SYNC gets one ERROR (wrong side) and a close."""
        self._check_one_error_then_close(Side.CLIENT, b"NAME evil\n", "invalid command from server: NAME")
        self._check_one_error_then_close(
            Side.CLIENT, b"USER_SYNC a @u:hs None start 1\n", "invalid command from server: USER_SYNC"
        )

    def test_over_long_line_received(self):
        """A line over 16 KiB gets ERROR Line length exceeded and a close."""
        self._check_one_error_then_close(
            Side.SERVER, b"PING " + b"x" * MAX_LINE_LENGTH + b"\n", "Line length exceeded"
        )

    def test_over_long_partial_line_received(self):
        """Even without a newline, 16 KiB of unterminated data closes the connection."""
        clock = _clock()
        proto, transport, _ = _server(clock)
        transport.clear()
        for _ in range(20):
            proto.dataReceived(b"x" * 1024)
        self.assertEqual(sent_lines(transport), ["ERROR Line length exceeded"])
        self.assertTrue(transport.disconnecting)

    def test_line_at_limit_accepted(self):
        """A line of exactly 16 KiB is accepted."""
        clock = _clock()
        proto, transport, receiver = _server(clock)
        proto.dataReceived(b"PING " + b"x" * (MAX_LINE_LENGTH - 5) + b"\n")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(receiver.received(PingCommand)), 1)

    def test_over_long_send_refused(self):
        """Sending a line over 16 KiB raises locally and writes nothing."""
        clock = _clock()
        proto, transport, _ = _server(clock)
        transport.clear()
        with self.assertRaises(LocalProtocolError):
            proto.send_command(RdataCommand("events", "w1", 5, ["x" * MAX_LINE_LENGTH]))
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)

    def test_handler_exception_keeps_connection(self):
        """A bug in the command handler is logged; the connection stays open."""

        class Exploding(RecordingReceiver):
            def on_command(self, conn, cmd):
                raise RuntimeError("handler bug")

        clock = _clock()
        proto = make_protocol(Side.SERVER, Exploding(), clock)
        transport = attach(proto)
        proto.dataReceived(b"PING 1\n")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 0)


class CongestionTest(SynchronousTestCase):
    def test_pause_and_resume(self):
        """While paused, commands queue; on resume they are written in order."""
        clock = _clock()
        proto, transport, _ = _server(clock)
        transport.clear()
        proto.pauseProducing()
        for i in range(3):
            proto.send_command(PositionCommand("events", "master", i, i + 1))
        self.assertEqual(transport.value(), b"")
        self.assertEqual(proto.core.pending_commands, 3)
        proto.resumeProducing()
        self.assertEqual(
            sent_lines(transport),
            ["POSITION events master 0 1", "POSITION events master 1 2", "POSITION events master 2 3"],
        )
        self.assertEqual(proto.core.pending_commands, 0)

    def test_high_water_folds_rows_into_positions(self):
        """Past the high-water mark, rows of each writer fold into one POSITION placeholder."""
        clock = _clock()
        proto, transport, _ = _server(clock, high_water=5, hard_limit=10)
        transport.clear()
        proto.pauseProducing()
        for token in range(1, 6):
            proto.send_command(RdataCommand("events", "w1", token, [token]))
        self.assertFalse(proto.core.congested)
        for token in range(6, 1000):
            proto.send_command(RdataCommand("events", "w1", None, ["batch"]))
            proto.send_command(RdataCommand("events", "w1", token, [token]))
        proto.send_command(PositionCommand("events", "w1", 999, 1005))
        proto.send_command(RdataCommand("caches", "w2", 7, ["c", None, 1]))
        self.assertTrue(proto.core.congested)
        self.assertEqual(proto.core.pending_commands, 7)
        proto.resumeProducing()
        self.assertEqual(
            sent_lines(transport),
            [f"RDATA events w1 {t} [{t}]" for t in range(1, 6)]
            + ["POSITION events w1 999 1005", "POSITION caches w2 7 7"],
        )
        self.assertFalse(proto.core.congested)

    def test_queue_stays_bounded_under_rows(self):
        """However many rows arrive while paused, the queue stays at the high-water mark plus one per writer."""
        clock = _clock()
        proto, transport, _ = _server(clock, high_water=100, hard_limit=200)
        proto.pauseProducing()
        for token in range(100_000):
            proto.send_command(RdataCommand("events", f"w{token % 3}", token, [token]))
        self.assertEqual(proto.core.pending_commands, 103)
        self.assertFalse(transport.disconnecting)

    def test_hard_limit_closes(self):
        """Past the hard limit of non-row commands, ERROR Failed to keep up is sent and the connection closes."""
        clock = _clock()
        proto, transport, _ = _server(clock, high_water=5, hard_limit=10)
        transport.clear()
        proto.pauseProducing()
        for i in range(10):
            proto.send_command(PingCommand(str(i)))
        self.assertFalse(transport.disconnecting)
        proto.send_command(PingCommand("10"))
        self.assertEqual(sent_lines(transport), ["ERROR Failed to keep up"])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.core.pending_commands, 0)

    def _row(self, token: int) -> RdataCommand:
        return RdataCommand("events", "w1", token, [token])

    def test_high_water_bytes_edge(self):
        """Rows fold once the queued bytes reach the byte high-water mark, and not one line earlier."""
        line = len(b"RDATA events w1 10 [10]")
        for mark, queued_rows in ((3 * line, 3), (3 * line + 1, 4)):
            clock = _clock()
            proto, transport, _ = _server(clock, high_water=1000, hard_limit=2000, high_water_bytes=mark)
            transport.clear()
            proto.pauseProducing()
            for token in range(10, 10 + queued_rows):
                proto.send_command(self._row(token))
            self.assertFalse(proto.core.congested, f"mark {mark}")
            self.assertEqual(proto.core.pending_bytes, queued_rows * line)
            last = 10 + queued_rows
            proto.send_command(self._row(last))
            proto.send_command(self._row(last + 1))
            self.assertTrue(proto.core.congested, f"mark {mark}")
            self.assertEqual(proto.core.pending_commands, queued_rows + 1)
            self.assertEqual(proto.core.pending_bytes, queued_rows * line)
            proto.resumeProducing()
            self.assertEqual(
                sent_lines(transport),
                [f"RDATA events w1 {t} [{t}]" for t in range(10, last)] + [f"POSITION events w1 {last + 1} {last + 1}"],
            )
            self.assertFalse(transport.disconnecting)

    def test_hard_limit_bytes_edge(self):
        """Queued bytes may reach the byte hard limit exactly; one byte more sends ERROR Failed to keep up and closes."""
        clock = _clock()
        proto, transport, _ = _server(clock, high_water=1000, hard_limit=2000, hard_limit_bytes=30)
        transport.clear()
        proto.pauseProducing()
        for i in range(3):
            proto.send_command(PingCommand(f"{i}xxxx"))  # "PING 0xxxx": 10 bytes
        self.assertEqual(proto.core.pending_bytes, 30)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(transport.value(), b"")
        proto.send_command(PingCommand("3"))
        self.assertEqual(sent_lines(transport), ["ERROR Failed to keep up"])
        self.assertTrue(transport.disconnecting)
        self.assertEqual((proto.core.pending_commands, proto.core.pending_bytes), (0, 0))

    def test_resume_drains_in_steps(self):
        """A drain writes the queued lines gathered, not one by one; a write that pauses the producer
        stops the drain, every line taken from the queue is written, and the rest waits."""
        writes = []

        class TinyBufferTransport(PumpTransport):
            def write(self, data):
                writes.append(len(data))
                super().write(data)
                if len(self.io.getvalue()) > 200 and self.producer is not None:
                    self.producer.pauseProducing()

        clock = _clock()
        receiver = RecordingReceiver()
        proto = make_protocol(Side.SERVER, receiver, clock)
        transport = TinyBufferTransport(1)
        proto.makeConnection(transport)
        transport.clear()
        proto.pauseProducing()
        for i in range(5000):
            proto.send_command(PositionCommand("events", "master", i, i + 1))
        writes.clear()
        proto.resumeProducing()
        written = sent_lines(transport)
        # The first write (at the gathering limit) paused the drain; the lines already taken from the
        # queue went out in a second write as the batch closed.
        self.assertEqual(len(writes), 2, writes)
        self.assertGreaterEqual(writes[0], _BATCH_BYTES)
        self.assertLess(len(written), 5000)
        self.assertEqual(proto.core.pending_commands, 5000 - len(written))
        self.assertEqual(written, [f"POSITION events master {i} {i + 1}" for i in range(len(written))])
        transport.clear()
        proto.resumeProducing()  # the transport drained: the rest follows, in order
        self.assertEqual(sent_lines(transport)[0], f"POSITION events master {len(written)} {len(written) + 1}")


class _Endpoint:
    """A client endpoint that refuses a given number of attempts, then connects."""

    def __init__(self, clock, refusals):
        self.clock = clock
        self.refusals = refusals
        self.attempts = []
        self.protocols = []

    def connect(self, factory):
        self.attempts.append(self.clock.seconds())
        if self.refusals > 0:
            self.refusals -= 1
            return fail(ConnectionRefusedError())
        proto = factory.buildProtocol(None)
        transport = PumpTransport(5)
        proto.makeConnection(transport)
        self.protocols.append((proto, transport))
        return succeed(proto)


class BackoffTest(SynchronousTestCase):
    def test_backoff_values(self):
        """Backoff delays grow by the multiplier, stay within jitter, and cap."""
        backoff = Backoff(initial_s=0.1, multiplier=2.0, max_s=5.0, jitter=0.1)
        rng = random.Random(4)
        delays = [backoff.delay(n, rng) for n in range(1, 12)]
        for n, d in enumerate(delays, start=1):
            base = backoff.base_delay(n)
            self.assertGreaterEqual(d, base * 0.9)
            self.assertLessEqual(d, min(5.0, base * 1.1))
        self.assertEqual([backoff.base_delay(n) for n in range(1, 8)], [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0])
        self.assertEqual(backoff.base_delay(1000), 5.0)

    def _service(self, clock, endpoint, seed=7):
        return ReplicationClientService(
            endpoint,
            server_name="example.com",
            instance_name="persister1",
            handler=None,
            clock=clock,
            backoff=Backoff(initial_s=0.1, multiplier=2.0, max_s=5.0, jitter=0.1),
            rng=random.Random(seed),
        )

    def test_reconnect_delays_grow_cap_and_reset(self):
        """Reconnect delays grow and cap while refused, and reset after a handshake."""
        clock = MemoryReactorClock()
        endpoint = _Endpoint(clock, refusals=9)
        service = self._service(clock, endpoint)
        service.startService()
        for _ in range(9):
            (call,) = clock.getDelayedCalls()
            clock.advance(call.getTime() - clock.seconds())
        gaps = [b - a for a, b in zip(endpoint.attempts, endpoint.attempts[1:])]
        expected_rng = random.Random(7)
        backoff = Backoff(initial_s=0.1, multiplier=2.0, max_s=5.0, jitter=0.1)
        expected = [backoff.delay(n, expected_rng) for n in range(1, 10)]
        for gap, want in zip(gaps, expected, strict=True):
            self.assertAlmostEqual(gap, want, places=6)
        self.assertEqual(max(gaps), max(expected))
        self.assertLessEqual(max(gaps), 5.0)
        self.assertGreater(gaps[-1], 4.4)

        # Connected: complete the handshake, then lose the connection.
        proto, transport = endpoint.protocols[0]
        proto.dataReceived(b"SERVER example.com\n")
        self.assertTrue(service.connected)
        proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(service.failures, 1)
        delay = service.retry_call.getTime() - clock.seconds()
        self.assertLessEqual(delay, 0.11)
        service.stopService()

    def test_failed_handshake_does_not_reset(self):
        """A connection closed for a wrong server name keeps the backoff growing."""
        clock = MemoryReactorClock()
        endpoint = _Endpoint(clock, refusals=5)
        service = self._service(clock, endpoint)
        service.startService()
        for _ in range(5):
            (call,) = clock.getDelayedCalls()
            clock.advance(call.getTime() - clock.seconds())
        proto, transport = endpoint.protocols[0]
        proto.dataReceived(b"SERVER impostor\n")
        self.assertTrue(transport.disconnecting)
        proto.connectionLost(Failure(ConnectionDone()))
        retry = service.retry_call
        self.assertIsNotNone(retry)
        delay = retry.getTime() - clock.seconds()
        self.assertGreater(delay, 1.5)
        self.assertEqual(service.failures, 6)
        service.stopService()

    def test_send_while_disconnected_is_counted(self):
        """A command sent with no connection is dropped, counted per command on /metrics, and warned about unless a stream command."""
        clock = MemoryReactorClock()
        endpoint = _Endpoint(clock, refusals=100)
        service = self._service(clock, endpoint)
        service.startService()
        names = ("REMOTE_SERVER_UP", "POSITION")
        before = {n: _dropped(n) for n in names}
        with self.assertLogs("synflow.replication.client", "DEBUG") as logs:
            service.send_command(RemoteServerUpCommand("a.example.com"))
            service.send_command(PositionCommand("events", "persister1", 1, 2))
        self.assertEqual(service.dropped_commands, 2)
        self.assertEqual({n: _dropped(n) - before[n] for n in names}, {"REMOTE_SERVER_UP": 1, "POSITION": 1})
        warnings = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("dropped REMOTE_SERVER_UP", warnings[0])
        service.stopService()


class AuthTest(SynchronousTestCase):
    def test_client_sends_auth_first(self):
        """A client with a secret sends AUTH before NAME, PING and REPLICATE."""
        proto, transport, _ = _client(_clock(), secret="s3cret")
        self.assertEqual(sent_lines(transport), ["AUTH s3cret", "NAME persister1", "PING 1490197665618", "REPLICATE "])

    def test_hub_requires_auth(self):
        """A hub with a secret closes a connection whose first command is not AUTH."""
        proto, transport, receiver = _server(_clock(), secret="s3cret")
        transport.clear()
        proto.dataReceived(b"NAME sneaky\nREPLICATE\n")
        self.assertEqual(sent_lines(transport), ["ERROR authentication required: send AUTH <secret> first"])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(receiver.received(), [])

    def test_wrong_secret(self):
        """A wrong secret is refused without echoing it."""
        proto, transport, receiver = _server(_clock(), secret="s3cret")
        transport.clear()
        proto.dataReceived(b"AUTH guess\n")
        lines = sent_lines(transport)
        self.assertEqual(lines, ["ERROR authentication failed"])
        self.assertNotIn("guess", " ".join(lines))
        self.assertTrue(transport.disconnecting)

    def test_right_secret(self):
        """With the right secret the connection works normally and AUTH is not delivered."""
        proto, transport, receiver = _server(_clock(), secret="s3cret")
        proto.dataReceived(b"AUTH s3cret\nNAME persister1\nPING 1\n")
        self.assertFalse(transport.disconnecting)
        self.assertEqual(receiver.received(), [NameCommand("persister1"), PingCommand("1")])

    def test_secret_not_in_repr(self):
        """The secret never shows in a command's repr."""
        from synflow.replication.commands import AuthCommand

        self.assertNotIn("s3cret", repr(AuthCommand("s3cret")))


class FastPathTest(SynchronousTestCase):
    """The core's unwrapped paths (``receive``, ``send_now``) decide exactly as ``line_received`` and ``send``."""

    ROW = b'RDATA events persister1 7 ["$e:hs","!r:hs","m.room.message",null,"@u:hs",null]'

    def _core(self, **kw):
        core = ConnectionCore(Side.SERVER, server_name="example.com", options=ConnectionOptions(**kw))
        core.connection_made(T0)
        return core

    def test_stream_command_comes_back_unwrapped_and_counted(self):
        """An RDATA on an open connection comes back as the command itself, counted; line_received wraps it."""
        core = self._core()
        cmd = core.receive(self.ROW, T0)
        self.assertIs(type(cmd), RdataCommand)
        self.assertEqual((cmd.stream_name, cmd.instance_name, cmd.token), ("events", "persister1", 7))
        self.assertEqual(core.stats.commands_in, {"RDATA": 1})
        self.assertEqual(core.line_received(self.ROW, T0), [Deliver(parse_line(self.ROW))])
        self.assertEqual(core.stats.commands_in, {"RDATA": 2})

    def test_stream_command_before_auth_still_closes(self):
        """On a hub with a secret, a row before AUTH closes the connection: the fast path skips no check."""
        core = self._core(secret="s3cret")
        actions = core.receive(self.ROW, T0)
        self.assertIsInstance(actions, list)
        self.assertTrue(any(isinstance(a, Close) for a in actions), actions)
        self.assertIs(core.state, State.CLOSED)
        self.assertEqual(core.stats.commands_in, {})

    def test_connection_commands_still_come_as_actions(self):
        """A NAME completes the handshake: that needs actions, so it comes back as the list."""
        core = self._core()
        actions = core.receive(b"NAME persister1", T0)
        self.assertEqual(actions, [HandshakeDone("persister1"), Deliver(NameCommand("persister1"))])

    def test_send_now_counts_and_returns_the_line(self):
        """send_now returns the encoded line, counts it and moves last_sent, as send does."""
        core = self._core()
        data = core.send_now(PositionCommand("events", "master", 3, 5), T0 + 2)
        self.assertEqual(data, b"POSITION events master 3 5")
        self.assertEqual(core.stats.commands_out["POSITION"], 1)
        self.assertEqual(core.last_sent, T0 + 2)

    def test_protocol_writes_at_once_when_open_and_queues_when_paused(self):
        """The protocol's direct write is only taken while the connection is open; paused, commands queue."""
        proto, transport, _ = _server(_clock())
        transport.clear()
        proto.send_command(PositionCommand("events", "master", 3, 5))
        self.assertEqual(sent_lines(transport), ["POSITION events master 3 5"])
        transport.clear()
        proto.pauseProducing()
        proto.send_command(PositionCommand("events", "master", 5, 6))
        self.assertEqual(sent_lines(transport), [])
        self.assertEqual(proto.core.pending_commands, 1)
        proto.resumeProducing()
        self.assertEqual(sent_lines(transport), ["POSITION events master 5 6"])

    def test_rows_reach_the_receiver(self):
        """Rows read off the wire reach the receiver through the unwrapped path."""
        proto, transport, receiver = _server(_clock())
        proto.dataReceived(b"NAME persister1\n" + self.ROW + b"\n")
        self.assertEqual(receiver.received(), [NameCommand("persister1"), parse_line(self.ROW)])


class _RunReceiver(RecordingReceiver):
    """A receiver that takes runs of stream commands: remembers each delivery, one command or one list."""

    def __init__(self) -> None:
        super().__init__()
        self.deliveries: list[Any] = []

    def on_command(self, conn, cmd):
        super().on_command(conn, cmd)
        self.deliveries.append(cmd)

    def on_commands(self, conn, cmds):
        self.commands.extend((conn, cmd) for cmd in cmds)
        self.deliveries.append(list(cmds))


def _rdata(token):
    return f'RDATA events persister1 {token} ["$e{token}:hs","!r:hs","m.room.message",null,"@u:hs",null]'.encode()


class RunDeliveryTest(SynchronousTestCase):
    """The stream commands of one read reach a receiver with ``on_commands`` as lists, in order."""

    def _server(self):
        receiver = _RunReceiver()
        proto = make_protocol(Side.SERVER, receiver, _clock(), server_name="example.com")
        transport = attach(proto)
        proto.dataReceived(b"NAME persister1\n")
        receiver.deliveries.clear()
        return proto, transport, receiver

    def test_runs_between_other_commands_come_as_lists_in_order(self):
        """Rows and positions between two other commands come as one list each; the others one by one."""
        proto, transport, receiver = self._server()
        lines = [_rdata(2), _rdata(3), b"PING 1", b"POSITION events persister1 3 4", _rdata(5)]
        proto.dataReceived(b"\n".join(lines) + b"\n")
        expected = [parse_line(line) for line in lines]
        self.assertEqual(receiver.deliveries, [expected[:2], expected[2], expected[3:]])
        self.assertEqual(receiver.received()[-5:], expected)
        self.assertEqual(proto.core.stats.commands_in["RDATA"], 3)

    def test_a_line_split_across_reads_is_delivered_once_whole(self):
        """A row cut in two by the transport is held until its newline and then delivered once."""
        proto, transport, receiver = self._server()
        data = _rdata(2) + b"\n" + _rdata(3) + b"\n"
        proto.dataReceived(data[:50])
        self.assertEqual(receiver.deliveries, [])
        proto.dataReceived(data[50:90])
        self.assertEqual(receiver.deliveries, [[parse_line(_rdata(2))]])
        proto.dataReceived(data[90:])
        self.assertEqual(receiver.deliveries, [[parse_line(_rdata(2))], [parse_line(_rdata(3))]])

    def test_a_bad_line_delivers_what_came_before_and_nothing_after(self):
        """A line that closes the connection: the rows before it are delivered, the rows after it are not read."""
        proto, transport, receiver = self._server()
        proto.dataReceived(b"\n".join([_rdata(2), _rdata(3), b"RDATA events persister1 x4 []", _rdata(5)]) + b"\n")
        self.assertEqual(receiver.deliveries, [[parse_line(_rdata(2)), parse_line(_rdata(3))]])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(proto.core.stats.commands_in["RDATA"], 2)

    def test_an_over_long_line_delivers_what_came_before_and_closes(self):
        """A line longer than the limit closes the connection after the complete rows before it are delivered."""
        proto, transport, receiver = self._server()
        proto.dataReceived(_rdata(2) + b"\n" + b"RDATA " + b"x" * MAX_LINE_LENGTH + b"\n" + _rdata(3) + b"\n")
        self.assertEqual(receiver.deliveries, [[parse_line(_rdata(2))]])
        self.assertTrue(transport.disconnecting)
        self.assertIn(b"ERROR Line length exceeded", transport.value())

    def test_an_unfinished_over_long_line_closes(self):
        """Bytes past the limit with no newline yet close the connection, as LineOnlyReceiver does."""
        proto, transport, receiver = self._server()
        proto.dataReceived(_rdata(2) + b"\n" + b"RDATA " + b"x" * MAX_LINE_LENGTH)
        self.assertEqual(receiver.deliveries, [[parse_line(_rdata(2))]])
        self.assertTrue(transport.disconnecting)

    def test_a_failing_receiver_is_logged_and_the_connection_stays(self):
        """An exception from on_commands is logged; the connection stays open and the next read is delivered."""
        proto, transport, receiver = self._server()
        calls = []

        def failing(conn, cmds):
            calls.append(cmds)
            if len(calls) == 1:
                raise RuntimeError("handler bug")

        proto._deliver_many = failing
        with self.assertLogs("synflow.replication.protocol", "ERROR") as logs:
            proto.dataReceived(_rdata(2) + b"\n")
        self.assertIn("handler bug", "\n".join(logs.output))
        proto.dataReceived(_rdata(3) + b"\n")
        self.assertEqual(calls, [[parse_line(_rdata(2))], [parse_line(_rdata(3))]])
        self.assertFalse(transport.disconnecting)

    def test_a_receiver_without_on_commands_gets_each_command(self):
        """A receiver with only on_command (the conformance kit's) gets every command, one call each."""
        proto, transport, receiver = _server(_clock())
        proto.dataReceived(b"NAME persister1\n" + _rdata(2) + b"\n" + _rdata(3) + b"\n")
        self.assertEqual(receiver.received(), [NameCommand("persister1"), parse_line(_rdata(2)),
                                               parse_line(_rdata(3))])


class SendCommandsTest(SynchronousTestCase):
    """``send_commands``: the same lines, counts and queueing as ``send_command`` for each."""

    def _open(self):
        proto, transport, _ = _server(_clock())
        transport.clear()
        return proto, transport

    def test_lines_go_out_in_order_in_one_write_and_are_counted(self):
        """Inside a write batch the list goes out in one write, in order, each command counted."""
        proto, transport = self._open()
        writes = []
        real_write = transport.write
        self.patch(transport, "write", lambda data: (writes.append(data), real_write(data)))
        cmds = [RdataCommand("events", "master", None, ["a"]), RdataCommand("events", "master", 4, ["b"]),
                PositionCommand("events", "master", 4, 6)]
        with write_batch:
            proto.send_commands(cmds)
            self.assertEqual(writes, [])
        self.assertEqual(len(writes), 1)
        self.assertEqual(sent_lines(transport),
                         ['RDATA events master batch ["a"]', 'RDATA events master 4 ["b"]',
                          "POSITION events master 4 6"])
        self.assertEqual(proto.core.stats.commands_out["RDATA"], 2)
        self.assertEqual(proto.core.stats.commands_out["POSITION"], 1)

    def test_outside_a_batch_each_is_written_at_once(self):
        """Outside a write batch each command is written as send_command writes it."""
        proto, transport = self._open()
        proto.send_commands([PositionCommand("events", "master", 1, 2), PositionCommand("events", "master", 2, 3)])
        self.assertEqual(sent_lines(transport), ["POSITION events master 1 2", "POSITION events master 2 3"])

    def test_a_pause_mid_list_queues_the_rest_in_order(self):
        """A write that fills the socket buffer pauses the connection: the rest of the list queues, then follows."""
        proto, transport = self._open()
        real_write = transport.write

        def write_and_pause(data):
            real_write(data)
            proto.pauseProducing()

        self.patch(transport, "write", write_and_pause)
        row = ["x" * 1000]
        n = 3 * _BATCH_BYTES // 1000
        with write_batch:
            proto.send_commands([RdataCommand("events", "master", t, row) for t in range(1, n + 1)])
        written = sent_lines(transport)
        self.assertGreater(len(written), 0)
        self.assertLess(len(written), n)
        self.assertEqual(len(written) + proto.core.pending_commands, n)
        self.patch(transport, "write", real_write)
        proto.resumeProducing()
        lines = written + sent_lines(transport)
        self.assertEqual([parse_line(line).token for line in lines], list(range(1, n + 1)))

    def test_a_command_that_cannot_be_sent_stops_the_list_after_the_ones_before(self):
        """A row that cannot be encoded raises; the commands before it go out, none after it."""
        proto, transport = self._open()
        cmds = [RdataCommand("events", "master", 2, ["a"]), RdataCommand("events", "master", 3, [object()]),
                RdataCommand("events", "master", 4, ["c"])]
        with self.assertRaises(LocalProtocolError), write_batch:
            proto.send_commands(cmds)
        self.assertEqual(sent_lines(transport), ['RDATA events master 2 ["a"]'])
        self.assertEqual(proto.core.stats.commands_out.get("RDATA"), 1)
        proto.send_commands([cmds[2]])
        self.assertEqual(sent_lines(transport), ['RDATA events master 4 ["c"]'])

    def test_a_closed_connection_drops_the_list(self):
        """On a closed connection the list is dropped as send_command drops each."""
        proto, transport = self._open()
        proto.close("bye")
        transport.clear()
        with write_batch:
            proto.send_commands([PositionCommand("events", "master", 1, 2)])
        self.assertEqual(sent_lines(transport), [])
        self.assertEqual(proto.core.stats.dropped_closed, 1)
