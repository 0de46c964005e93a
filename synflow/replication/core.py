"""The sans-IO replication connection: a state machine with no sockets or clocks.

:class:`ConnectionCore` holds everything a replication connection decides --
the handshake, direction checks, keep-alive and ping timeout, the congestion
policy of the outbound queue -- and nothing it *does*. Callers feed it what
happened (a line arrived, time passed, the transport paused) together with
``now`` in seconds, and it answers with a list of :data:`Action` values:
lines to write, commands to deliver, and when to close. The TCP adapter
(``protocol.py``) and the Redis subscriber are thin shells around it, so the
rules exist exactly once.

Congestion: while the transport is paused, outbound commands queue. Once the
queue passes the high-water mark, stream rows are no longer queued: every
RDATA and POSITION for a ``(stream, writer)`` folds into one POSITION
placeholder, ``POSITION s w t t`` for the highest token ``t`` dropped, which
a reader's gap check turns into a catch-up from the database. The queue thus
stays bounded by the other commands; if those pass the hard limit, the core
sends ``ERROR Failed to keep up`` and closes.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections import deque
from collections.abc import Sequence
from typing import Final, TypeAlias

import attrs

from synflow.errors import ProtocolError, RemoteProtocolError
from synflow.replication.commands import (
    COMMANDS,
    MAX_LINE_LENGTH,
    AnyCommand,
    AuthCommand,
    ErrorCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    ServerCommand,
    Side,
    encode_line_bytes,
    may_send,
    parse_line,
)

logger = logging.getLogger(__name__)

#: The commands :meth:`ConnectionCore.receive` hands back unwrapped on an
#: authenticated connection; a transport delivers consecutive ones as a run.
STREAM_COMMANDS: Final = frozenset({RdataCommand, PositionCommand})

#: Send a PING when nothing was sent for this long (seconds).
PING_INTERVAL_S: Final = 5.0
#: Once the peer has pinged, close after this long without a line (seconds).
PING_TIMEOUT_S: Final = 15.0
#: Queued commands past which stream rows fold into POSITION placeholders.
HIGH_WATER_COMMANDS: Final = 10_000
#: Queued commands past which the connection is closed.
HARD_LIMIT_COMMANDS: Final = 20_000
#: Queued bytes past which stream rows fold into POSITION placeholders.
HIGH_WATER_BYTES: Final = 8 * 1024 * 1024
#: Queued bytes past which the connection is closed.
HARD_LIMIT_BYTES: Final = 32 * 1024 * 1024
#: A hub with a secret closes a connection that has not sent AUTH by then (seconds).
AUTH_TIMEOUT_S: Final = 10.0

KEEP_UP_ERROR: Final = "Failed to keep up"
WRONG_REMOTE_ERROR: Final = "Wrong remote"


class State(enum.Enum):
    """Where a connection is in its life."""

    CONNECTING = "connecting"
    ESTABLISHED = "established"
    PAUSED = "paused"
    CLOSED = "closed"


@attrs.frozen(init=False)
class SendLine:
    """Write this line (UTF-8, without the newline) to the transport."""

    data: bytes

    def __init__(self, data: bytes) -> None:
        _set_send_line_data(self, data)  # one per line sent: stored through its slot, still frozen


@attrs.frozen(init=False)
class Deliver:
    """Hand this received command to the command handler."""

    command: AnyCommand

    def __init__(self, command: AnyCommand) -> None:
        _set_deliver_command(self, command)  # one per line received: stored through its slot, still frozen


# The slots' own setters: object.__setattr__ finds and calls these, at twice the cost.
_set_send_line_data = SendLine.__dict__["data"].__set__
_set_deliver_command = Deliver.__dict__["command"].__set__


@attrs.frozen
class Close:
    """Close the connection for ``reason`` (any ERROR was already sent)."""

    reason: str


@attrs.frozen
class HandshakeDone:
    """The handshake completed: the client saw the right SERVER, or the server a NAME."""

    peer_name: str


@attrs.frozen
class Authenticated:
    """The peer proved it holds the secret: only now may it see and send the streams."""


Action: TypeAlias = SendLine | Deliver | Close | HandshakeDone | Authenticated


@attrs.define
class _Placeholder:
    """A queued POSITION standing for rows dropped while congested."""

    stream_name: str
    instance_name: str
    prev_token: int | None = None
    new_token: int | None = None

    def fold(self, cmd: RdataCommand | PositionCommand) -> None:
        if isinstance(cmd, RdataCommand):
            if cmd.token is None:
                return  # a batch row; the batch's numeric row follows at once
            prev = new = cmd.token
        else:
            prev, new = cmd.prev_token, cmd.new_token
        self.prev_token = prev if self.prev_token is None else max(self.prev_token, prev)
        self.new_token = new if self.new_token is None else max(self.new_token, new)

    def to_command(self) -> PositionCommand | None:
        if self.new_token is None or self.prev_token is None:
            return None
        return PositionCommand(self.stream_name, self.instance_name, self.prev_token, self.new_token)


_Queued: TypeAlias = bytes | _Placeholder


@attrs.define
class CoreStats:
    """Counters a metrics exporter reads."""

    commands_in: dict[str, int] = attrs.Factory(dict)
    commands_out: dict[str, int] = attrs.Factory(dict)
    rows_folded: int = 0
    dropped_closed: int = 0
    bad_lines: int = 0


@attrs.frozen
class ConnectionOptions:
    """The tunables of a replication connection (the ``replication:`` config section's).

    Attributes:
        ping_interval_s: send a PING after this long without sending.
        ping_timeout_s: once the peer has pinged, close after this long
            without receiving; ``None`` disables the timeout.
        high_water: queued commands past which rows fold into placeholders.
        hard_limit: queued commands past which the connection closes.
        high_water_bytes / hard_limit_bytes: the same bounds in bytes.
        secret: on the server, the secret a client's first line must carry
            (``AUTH <secret>``); on a client, the secret it sends first.
        auth_timeout_s: a server with a secret closes a connection that has
            not authenticated within this long.
    """

    ping_interval_s: float = PING_INTERVAL_S
    ping_timeout_s: float | None = PING_TIMEOUT_S
    high_water: int = HIGH_WATER_COMMANDS
    hard_limit: int = HARD_LIMIT_COMMANDS
    high_water_bytes: int = HIGH_WATER_BYTES
    hard_limit_bytes: int = HARD_LIMIT_BYTES
    secret: str | None = attrs.field(default=None, repr=False)
    auth_timeout_s: float = AUTH_TIMEOUT_S

    def __attrs_post_init__(self) -> None:
        if not 0 < self.high_water <= self.hard_limit:
            raise ValueError("need 0 < high_water <= hard_limit")


#: The options of a connection nobody configured (the ``replication:`` defaults).
DEFAULT_OPTIONS: Final = ConnectionOptions()


class ConnectionCore:
    """One replication connection's decisions, free of I/O.

    Args:
        side: which end this is (``Side.SERVER`` for the hub, ``Side.CLIENT``
            for a worker).
        server_name: the server's name; sent in SERVER by a server and
            expected in SERVER by a client.
        instance_name: this process's instance name, sent in NAME by a client.
        options: keep-alive, congestion limits and the secret.
    """

    def __init__(
        self,
        side: Side,
        *,
        server_name: str,
        instance_name: str | None = None,
        options: ConnectionOptions = DEFAULT_OPTIONS,
    ) -> None:
        if side not in (Side.SERVER, Side.CLIENT, Side.BOTH):
            raise ValueError("a connection core is the SERVER, the CLIENT, or BOTH (a pub/sub bus)")
        if side is Side.CLIENT and not instance_name:
            raise ValueError("a client core needs its instance_name for NAME")
        self.side = side
        #: The command classes the peer may send (checked on every line).
        self._peer_may_send = frozenset(c for c in COMMANDS.values() if may_send(c, side.peer))
        self.server_name = server_name
        self.instance_name = instance_name
        self.options = options
        #: Until a server with a secret sees the right AUTH, the peer gets no
        #: stream traffic and nothing it sends but AUTH is accepted.
        self.authenticated = side is not Side.SERVER or options.secret is None
        self.connected_at = 0.0
        self.state = State.CONNECTING
        self.peer_name: str | None = None
        self.handshake_complete = False
        self.received_ping = False
        self.last_sent = 0.0
        self.last_received = 0.0
        self.close_reason: str | None = None
        self.stats = CoreStats()
        self._queue: deque[_Queued] = deque()
        self._queued_bytes = 0
        self._placeholders: dict[tuple[str, str], _Placeholder] = {}

    # -- introspection ---------------------------------------------------------

    @property
    def pending_commands(self) -> int:
        """How many commands wait in the outbound queue."""
        return len(self._queue)

    @property
    def pending_bytes(self) -> int:
        """Bytes of encoded lines waiting in the outbound queue (placeholders excluded)."""
        return self._queued_bytes

    @property
    def congested(self) -> bool:
        """True while rows are folding into POSITION placeholders."""
        return bool(self._placeholders)

    # -- lifecycle ---------------------------------------------------------------

    def connection_made(self, now: float) -> list[Action]:
        """The transport connected: the opening lines of the handshake."""
        self.state = State.ESTABLISHED
        self.last_received = now
        self.connected_at = now
        actions: list[Action] = []
        if self.side is Side.BOTH:
            return actions  # a bus: the transport does its own handshake
        if self.side is Side.SERVER:
            actions += self._send_now(ServerCommand(self.server_name), now)
            actions += self._send_now(PingCommand(_ping_data(now)), now)
        else:
            assert self.instance_name is not None
            if self.options.secret is not None:
                actions += self._send_now(AuthCommand(self.options.secret), now)
            actions += self._send_now(NameCommand(self.instance_name), now)
            actions += self._send_now(PingCommand(_ping_data(now)), now)
            actions += self._send_now(ReplicateCommand(), now)
        return actions

    def connection_lost(self) -> None:
        """The transport is gone: drop everything queued."""
        self.state = State.CLOSED
        self._queue.clear()
        self._queued_bytes = 0
        self._placeholders.clear()

    def close(self, reason: str, now: float, *, send_error: bool = True) -> list[Action]:
        """Close deliberately, telling the peer why with one ERROR first."""
        if self.state is State.CLOSED:
            return []
        actions: list[Action] = []
        if send_error:
            actions += self._send_now(ErrorCommand(reason), now)
        self.close_reason = reason
        self.connection_lost()
        actions.append(Close(reason))
        return actions

    # -- inbound -------------------------------------------------------------------

    def line_received(self, line: bytes | str, now: float) -> list[Action]:
        """One line (without its newline) arrived."""
        result = self.receive(line, now)
        return result if type(result) is list else [Deliver(result)]  # type: ignore[arg-type]

    def receive(self, line: bytes | str, now: float) -> AnyCommand | list[Action]:
        """:meth:`line_received`, with the common outcome unwrapped.

        Returns the command itself when the only thing to do is to deliver it
        (a stream command on an authenticated connection: the bulk of the
        traffic), and otherwise the list of actions :meth:`line_received`
        returns. A transport that handles both saves a ``Deliver`` and a list
        per row.
        """
        if self.state is State.CLOSED:
            return []
        if not line or line.isspace():
            return []
        self.last_received = now
        try:
            # Rows stay undecoded until the handler reads them: a hub relays
            # the bytes of rows it never reads, and a row that turns out bad is
            # dropped by the reader that reads it (see RdataCommand.row).
            cmd = parse_line(line, decode_rows=False)
        except ProtocolError as e:
            if self.side is Side.BOTH:
                # A shared bus has no connection to close: report and go on.
                self.stats.bad_lines += 1
                logger.warning("ignoring unparseable message on the replication bus: %s", e)
                return []
            logger.warning("closing %s: failed to parse line: %s", self._describe(), e)
            return self.close(f"failed to parse line: {e}", now)
        kind = type(cmd)
        if kind in STREAM_COMMANDS and self.authenticated:
            # Either side may send them (SENDERS is BOTH), and there is nothing
            # for the connection itself to do: count and deliver.
            counts = self.stats.commands_in
            name = kind.NAME
            counts[name] = counts.get(name, 0) + 1
            return cmd
        if kind not in self._peer_may_send:
            peer = self.side.peer
            logger.warning("closing %s: %s may not be sent by a %s", self._describe(), cmd.NAME, peer.word)
            return self.close(f"invalid command from {peer.word}: {cmd.NAME}", now)
        if not self.authenticated:
            if not isinstance(cmd, AuthCommand):
                logger.warning("closing %s: %s before AUTH", self._describe(), cmd.NAME)
                return self.close("authentication required: send AUTH <secret> first", now)
            assert self.options.secret is not None
            if not hmac.compare_digest(cmd.secret.encode(), self.options.secret.encode()):
                logger.warning("closing %s: wrong replication secret", self._describe())
                return self.close("authentication failed", now)
            self.authenticated = True
            return [Authenticated()]
        if kind is AuthCommand:
            return []  # a hub without a secret ignores AUTH
        counts = self.stats.commands_in
        name = kind.NAME
        counts[name] = counts.get(name, 0) + 1
        actions: list[Action] = []
        if isinstance(cmd, PingCommand):
            self.received_ping = True
        elif isinstance(cmd, ServerCommand):
            if cmd.server_name != self.server_name:
                logger.warning(
                    "closing %s: expected server %r, got %r", self._describe(), self.server_name, cmd.server_name
                )
                return self.close(WRONG_REMOTE_ERROR, now)
            self.peer_name = cmd.server_name
            if not self.handshake_complete:
                self.handshake_complete = True
                actions.append(HandshakeDone(cmd.server_name))
        elif isinstance(cmd, NameCommand):
            self.peer_name = cmd.name
            if not self.handshake_complete:
                self.handshake_complete = True
                actions.append(HandshakeDone(cmd.name))
        elif isinstance(cmd, ErrorCommand):
            logger.warning("%s sent ERROR: %s", self._describe(), cmd.message)
        actions.append(Deliver(cmd))
        return actions

    def line_length_exceeded(self, now: float) -> list[Action]:
        """The peer sent a line longer than :data:`MAX_LINE_LENGTH`."""
        if self.state is State.CLOSED:
            return []
        logger.warning("closing %s: line longer than %d bytes", self._describe(), MAX_LINE_LENGTH)
        return self.close("Line length exceeded", now)

    # -- outbound -----------------------------------------------------------------

    def send(self, cmd: AnyCommand, now: float) -> list[Action]:
        """Send a command, or queue it while the transport is paused.

        Raises:
            LocalProtocolError: the command cannot be encoded (too long, a
                newline); nothing was sent or queued.
        """
        if self.state is State.ESTABLISHED:
            return [SendLine(self.send_now(cmd, now))]
        if self.state is State.CLOSED:
            self.stats.dropped_closed += 1
            return []
        return self._enqueue(cmd, now)

    def send_now(self, cmd: AnyCommand, now: float) -> bytes:
        """:meth:`send` while the state is ESTABLISHED: the line to write at once.

        A transport that checks the state first writes the bytes itself,
        without a ``SendLine`` and a list per line; in any other state it
        calls :meth:`send`.

        Raises:
            LocalProtocolError: the command cannot be encoded; nothing is counted.
        """
        data = encode_line_bytes(cmd)
        self.last_sent = now
        counts = self.stats.commands_out
        name = cmd.NAME
        counts[name] = counts.get(name, 0) + 1
        return data

    def send_now_into(
        self, cmds: Sequence[AnyCommand], start: int, now: float, out: list[bytes], budget: int,
    ) -> tuple[int, int]:
        """:meth:`send_now` for ``cmds[start:]``, appending each line to ``out``, until their bytes reach ``budget``.

        Returns the index after the last command encoded and the bytes
        appended, a newline counted per line.

        Raises:
            LocalProtocolError: a command cannot be encoded; the lines before
                it are in ``out`` and counted.
        """
        counts = self.stats.commands_out
        self.last_sent = now
        size = 0
        i, n = start, len(cmds)
        while i < n:
            cmd = cmds[i]
            data = encode_line_bytes(cmd)
            out.append(data)
            name = cmd.NAME
            counts[name] = counts.get(name, 0) + 1
            i += 1
            size += len(data) + 1
            if size >= budget:
                break
        return i, size

    def _send_now(self, cmd: AnyCommand, now: float) -> list[Action]:
        return [SendLine(self.send_now(cmd, now))]

    def _enqueue(self, cmd: AnyCommand, now: float) -> list[Action]:
        if isinstance(cmd, RdataCommand | PositionCommand):
            key = (cmd.stream_name, cmd.instance_name)
            placeholder = self._placeholders.get(key)
            if placeholder is None and self._over_high_water():
                placeholder = self._placeholders[key] = _Placeholder(*key)
                self._queue.append(placeholder)
            if placeholder is not None:
                placeholder.fold(cmd)
                self.stats.rows_folded += isinstance(cmd, RdataCommand)
                return []
        data = encode_line_bytes(cmd)
        if len(self._queue) >= self.options.hard_limit or self._queued_bytes + len(data) > self.options.hard_limit_bytes:
            logger.warning(
                "closing %s: %d commands (%d bytes) pending, peer is not reading",
                self._describe(), len(self._queue), self._queued_bytes,
            )
            self._queue.clear()
            self._queued_bytes = 0
            self._placeholders.clear()
            return self.close(KEEP_UP_ERROR, now)
        self._queue.append(data)
        self._queued_bytes += len(data)
        self.stats.commands_out[cmd.NAME] = self.stats.commands_out.get(cmd.NAME, 0) + 1
        return []

    def _over_high_water(self) -> bool:
        return len(self._queue) >= self.options.high_water or self._queued_bytes >= self.options.high_water_bytes

    def pause(self) -> None:
        """The transport's buffers are full: queue from now on."""
        if self.state is State.ESTABLISHED:
            self.state = State.PAUSED

    def resume(self, now: float, limit: int | None = None) -> list[Action]:
        """The transport drained: flush up to ``limit`` queued commands.

        Placeholders become POSITIONs as they are flushed. A caller that passes
        a limit keeps calling :meth:`flush` while the state stays ESTABLISHED.
        """
        if self.state is not State.PAUSED:
            return []
        self.state = State.ESTABLISHED
        return self.flush(now, limit)

    def flush(self, now: float, limit: int | None = None) -> list[Action]:
        """Turn up to ``limit`` queued commands into lines to write."""
        actions: list[Action] = []
        while self._queue and (limit is None or len(actions) < limit):
            item = self._queue.popleft()
            if isinstance(item, _Placeholder):
                del self._placeholders[(item.stream_name, item.instance_name)]
                cmd = item.to_command()
                if cmd is not None:
                    actions += self._send_now(cmd, now)
            else:
                self._queued_bytes -= len(item)
                self.last_sent = now
                actions.append(SendLine(item))
        return actions

    # -- time -----------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Time passed: keep-alive PING and ping-timeout decisions."""
        if self.state is State.CLOSED:
            return []
        if not self.authenticated and now - self.connected_at >= self.options.auth_timeout_s:
            logger.warning("closing %s: no AUTH within %.0fs", self._describe(), self.options.auth_timeout_s)
            return self.close("authentication timeout", now)
        if (
            self.received_ping
            and self.options.ping_timeout_s is not None
            and now - self.last_received >= self.options.ping_timeout_s
        ):
            logger.warning("closing %s: nothing received for %.1fs", self._describe(), now - self.last_received)
            return self.close("ping timeout", now)
        if now - self.last_sent >= self.options.ping_interval_s:
            return self.send(PingCommand(_ping_data(now)), now)
        return []

    def _describe(self) -> str:
        peer = self.peer_name or "?"
        if self.side is Side.BOTH:
            return "replication bus"
        return f"replication connection to {peer} ({self.side.peer.word})"


def _ping_data(now: float) -> str:
    return str(int(now * 1000))


__all__ = [
    "DEFAULT_OPTIONS",
    "HARD_LIMIT_COMMANDS",
    "HIGH_WATER_COMMANDS",
    "KEEP_UP_ERROR",
    "PING_INTERVAL_S",
    "PING_TIMEOUT_S",
    "STREAM_COMMANDS",
    "Action",
    "Authenticated",
    "Close",
    "ConnectionCore",
    "ConnectionOptions",
    "Deliver",
    "HandshakeDone",
    "RemoteProtocolError",
    "SendLine",
    "State",
]
