"""The TCP adapter: a ``LineOnlyReceiver`` shell around :class:`ConnectionCore`.

:class:`ReplicationProtocol` frames lines (``\\n``, at most 16 KiB), feeds
them to the core with the injected clock's ``now``, and carries out the
actions the core returns. It registers itself as a streaming push producer on
its transport, so a full socket buffer pauses it and the core starts queueing.
Everything protocol-shaped -- parsing, direction checks, keep-alive, the
congestion policy -- lives in the core; this file only moves bytes.

A :class:`~synflow.replication.interfaces.CommandReceiver` gets told about
connections and the commands they deliver: the TCP hub (``hub.py``) on the
master, the client service (``client.py``) on a worker. On a hub with a secret it hears of a connection
only once the peer has authenticated, so an unauthenticated peer is never
among those the streams are relayed to.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.protocols.basic import LineOnlyReceiver
from twisted.python.failure import Failure
from zope.interface import implementer

from synflow.replication.batch import write_batch
from synflow.replication.commands import MAX_LINE_LENGTH, AnyCommand, Side
from synflow.replication.core import (
    Action,
    Authenticated,
    Close,
    ConnectionCore,
    Deliver,
    HandshakeDone,
    SendLine,
    State,
)
from synflow.replication.interfaces import CommandReceiver
from synflow.tcp_write import write_now

logger = logging.getLogger(__name__)

#: How often the adapter gives the core a chance to ping or time out (seconds).
TICK_INTERVAL_S = 1.0
#: After deciding to close, abort the transport if it has not closed by then.
CLOSE_TIMEOUT_S = 15.0
#: Lines flushed per step while draining the queue, so a pause stops the drain.
_FLUSH_STEP = 64
#: Bytes a connection gathers while a write batch is open (``batch.py``)
#: before writing them out anyway (the transport's own buffer then decides
#: about pausing).
_BATCH_BYTES = 64 * 1024


@implementer(IPushProducer)
class ReplicationProtocol(LineOnlyReceiver):
    """One replication connection over a stream transport.

    Args:
        core: the connection's state machine (its side decides the handshake).
        receiver: gets the connection's lifecycle and delivered commands.
        clock: where ``now`` and timers come from.
        tick_interval_s: how often keep-alive decisions are taken.
    """

    delimiter = b"\n"
    MAX_LENGTH = MAX_LINE_LENGTH
    transport: Any  # a TCP transport (ITransport + IConsumer + abortConnection)

    def __init__(
        self,
        core: ConnectionCore,
        receiver: CommandReceiver[ReplicationProtocol],
        clock: IReactorTime,
        *,
        tick_interval_s: float = TICK_INTERVAL_S,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        self.core = core
        self.receiver = receiver
        #: The receiver's ``on_commands(conn, cmds)``, if it has one: consecutive
        #: stream commands of one read are delivered to it as one list.
        self._deliver_many: Callable[[ReplicationProtocol, list[AnyCommand]], None] | None = getattr(
            receiver, "on_commands", None)
        self.clock = clock
        self.tick_interval_s = tick_interval_s
        self.close_timeout_s = close_timeout_s
        self._tick_call: IDelayedCall | None = None
        self._abort_call: IDelayedCall | None = None
        self._handshake_waiters: list[Deferred[ReplicationProtocol]] = []
        self._connected = False
        #: Whether the receiver was told of this connection (on a hub with a
        #: secret, only once the peer authenticated: before that it is not
        #: among the connections that streams are relayed to).
        self._announced = False
        #: Lines gathered while a write batch is open (see batch.py), and their size.
        self._lines: list[bytes] = []
        self._lines_bytes = 0

    # -- what the handler uses ---------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        """The peer's NAME (server side) or SERVER name (client side), once known."""
        return self.core.peer_name

    @property
    def side(self) -> Side:
        return self.core.side

    def send_command(self, cmd: AnyCommand) -> None:
        """Send (or queue, while paused) one command.

        Raises:
            LocalProtocolError: the command cannot be sent (too long, a newline).
        """
        core = self.core
        if core.state is State.ESTABLISHED:  # the common case, without an action list
            self._write_line(core.send_now(cmd, self.clock.seconds()))
            return
        self._run(core.send(cmd, self.clock.seconds()))

    def send_commands(self, cmds: Sequence[AnyCommand]) -> None:
        """:meth:`send_command` for each of ``cmds`` in order, without a call per line on the common path.

        Raises:
            LocalProtocolError: as :meth:`send_command`; the commands before
                the one that failed were sent, none after it.
        """
        core = self.core
        if not write_batch.depth:
            for cmd in cmds:
                self.send_command(cmd)
            return
        now = self.clock.seconds()
        i, n = 0, len(cmds)
        while i < n:
            if core.state is not State.ESTABLISHED:  # paused (a full buffer) or closed: queue or drop the rest
                for cmd in cmds[i:]:
                    self.send_command(cmd)
                return
            lines = self._lines
            if not lines:
                write_batch.pending.append(self)
            try:
                i, size = core.send_now_into(cmds, i, now, lines, _BATCH_BYTES - self._lines_bytes)
            except Exception:
                self._lines_bytes = sum(len(line) + 1 for line in lines)  # what was encoded before still goes
                raise
            self._lines_bytes += size
            if self._lines_bytes >= _BATCH_BYTES:
                self.flush_gathered()  # a full socket buffer pauses us here, and the core queues the rest

    def close(self, reason: str) -> None:
        """Send ``ERROR <reason>`` and close."""
        self._run(self.core.close(reason, self.clock.seconds()))

    def when_handshake_done(self) -> Deferred[ReplicationProtocol]:
        """A Deferred that fires when the peer completes the handshake.

        It fails with ``ConnectionLost`` if the connection closes first.
        """
        d: Deferred[ReplicationProtocol] = Deferred()
        if self.core.handshake_complete:
            d.callback(self)
        elif self.core.state is State.CLOSED and self._connected:
            d.errback(Failure(ConnectionLost("replication connection closed before the handshake")))
        else:
            self._handshake_waiters.append(d)
        return d

    # -- Twisted protocol -----------------------------------------------------------

    def connectionMade(self) -> None:
        self._connected = True
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            try:
                set_no_delay(True)  # replication lines are small: never hold them back
            except OSError:
                pass
        self.transport.registerProducer(self, True)
        self._schedule_tick()
        actions = self.core.connection_made(self.clock.seconds())
        self._run(actions)
        if self.core.authenticated:
            self._announce()

    def dataReceived(self, data: bytes) -> None:
        with write_batch:  # what handling these lines sends goes out in one write per connection
            if self._deliver_many is None:
                super().dataReceived(data)
                return
            # LineOnlyReceiver's loop, with the stream commands between two
            # other outcomes handed to the receiver as one list.
            lines = (self._buffer + data).split(b"\n")
            self._buffer = lines.pop()
            receive = self.core.receive
            now = self.clock.seconds()
            run: list[AnyCommand] = []
            for line in lines:
                if self.transport.disconnecting:
                    break  # a line before this one closed the connection: the rest is not read
                if len(line) > MAX_LINE_LENGTH:
                    self._deliver_run(run)
                    self.lineLengthExceeded(line)
                    return
                result = receive(line, now)
                if type(result) is list:
                    if run:
                        self._deliver_run(run)
                        run = []
                    if result:
                        self._run(result)
                else:
                    run.append(result)  # type: ignore[arg-type]
            self._deliver_run(run)
            if len(self._buffer) > MAX_LINE_LENGTH:
                self.lineLengthExceeded(self._buffer)

    def lineReceived(self, line: bytes) -> None:
        result = self.core.receive(line, self.clock.seconds())
        if type(result) is list:
            self._run(result)
        else:
            self._deliver(result)  # type: ignore[arg-type]

    def lineLengthExceeded(self, line: bytes) -> None:
        self._run(self.core.line_length_exceeded(self.clock.seconds()))

    def connectionLost(self, reason: Failure = Failure(ConnectionLost())) -> None:  # noqa: B008
        self._lines.clear()
        self._lines_bytes = 0
        self.core.connection_lost()
        for call in (self._tick_call, self._abort_call):
            if call is not None and call.active():
                call.cancel()
        self._tick_call = self._abort_call = None
        try:
            self.transport.unregisterProducer()
        except Exception:  # the transport may already be torn down
            pass
        waiters, self._handshake_waiters = self._handshake_waiters, []
        for d in waiters:
            d.errback(Failure(ConnectionLost("replication connection closed before the handshake")))
        if self._announced:
            self.receiver.lost_connection(self, reason)

    # -- IPushProducer ----------------------------------------------------------------

    def pauseProducing(self) -> None:
        self.core.pause()

    def resumeProducing(self) -> None:
        now = self.clock.seconds()
        # Drain in steps: a write that fills the socket buffer pauses us again. The lines go out
        # gathered (one write per _BATCH_BYTES, and the rest when the batch closes), not one by one.
        with write_batch:
            self._run(self.core.resume(now, limit=_FLUSH_STEP))
            while self.core.state is State.ESTABLISHED and self.core.pending_commands:
                self._run(self.core.flush(now, limit=_FLUSH_STEP))

    def stopProducing(self) -> None:
        self._run(self.core.close("transport stopped", self.clock.seconds(), send_error=False))

    # -- internals ------------------------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            kind = type(action)
            if kind is Deliver:
                self._deliver(action.command)  # type: ignore[union-attr]
            elif kind is SendLine:
                self._write_line(action.data)  # type: ignore[union-attr]
            elif isinstance(action, Authenticated):
                self._announce()
            elif isinstance(action, HandshakeDone):
                waiters, self._handshake_waiters = self._handshake_waiters, []
                for d in waiters:
                    d.callback(self)
            elif isinstance(action, Close):
                self.flush_gathered()  # what was sent before the close goes first
                self.transport.loseConnection()
                if self._abort_call is None:
                    self._abort_call = self.clock.callLater(self.close_timeout_s, self._abort)

    def _deliver_run(self, cmds: list[AnyCommand]) -> None:
        """Consecutive stream commands to a receiver that takes them as a list (the hub)."""
        if not cmds:
            return
        assert self._deliver_many is not None
        try:
            self._deliver_many(self, cmds)
        except Exception:
            logger.exception("error handling %d commands from %s", len(cmds), self.peer_name)

    def _deliver(self, cmd: AnyCommand) -> None:
        try:
            self.receiver.on_command(self, cmd)
        except Exception:
            # A handler bug must not take the connection (or the process) down.
            logger.exception("error handling %s from %s", cmd.NAME, self.peer_name)

    def _write_line(self, data: bytes) -> None:
        """Write one line now, or gather it while a write batch is open."""
        if write_batch.depth:
            self._gather(data)
        else:
            write_now(self.transport, data + b"\n")

    def _gather(self, data: bytes) -> None:
        if not self._lines:
            write_batch.pending.append(self)
        self._lines.append(data)
        self._lines_bytes += len(data) + 1
        if self._lines_bytes >= _BATCH_BYTES:
            self.flush_gathered()  # a full socket buffer pauses us here, and the core queues

    def flush_gathered(self) -> None:
        """Write the lines gathered while the write batch was open, in one ``transport.write``."""
        if self._lines:
            lines, self._lines = self._lines, []
            self._lines_bytes = 0
            lines.append(b"")
            write_now(self.transport, b"\n".join(lines))

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            self.receiver.new_connection(self)

    def _schedule_tick(self) -> None:
        self._tick_call = self.clock.callLater(self.tick_interval_s, self._tick)

    def _tick(self) -> None:
        self._tick_call = None
        self._run(self.core.tick(self.clock.seconds()))
        if self.core.state is not State.CLOSED:
            self._schedule_tick()

    def _abort(self) -> None:
        self._abort_call = None
        abort: Any = getattr(self.transport, "abortConnection", None)
        if abort is not None:
            abort()
