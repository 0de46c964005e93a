"""Replication over Redis pub/sub (txredisapi), for production deployments.

Every process subscribes to one channel -- the server name, or
``<channel_prefix>:<server_name>`` when a prefix is configured -- on one
connection, and publishes on a second one (a subscribed Redis connection
can issue no other command). Each message carries one or more replication
lines separated by ``\\n``; when several commands are sent in the same
reactor turn (a stream with a backlog) they share one PUBLISH. With
``replication.redis.one_line_per_message`` every line is its own message,
as Synapse publishes them.

The lines go through the same sans-IO core (in its bus mode: no sides, no
handshake, an unparseable message is logged and skipped rather than closing
anything) and the same handler as over TCP. On every (re)subscription the
order is: SUBSCRIBE and wait for the reply, publish REPLICATE, then announce
our own positions, so no answer is missed. The handler sees each
subscription as a new connection, so every stream goes through the
POSITION/catch-up path again after a reconnect: nothing published while a
process was disconnected is lost for good.

Our own publishes come back to us; they are recognised and dropped. While
disconnected, RDATA and POSITION are dropped quietly (catch-up covers them)
and other commands are dropped with a warning; both are counted in
``synflow_replication_dropped_commands_total{command}``. That includes the
lines still waiting to be published when a connection goes down.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import txredisapi
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IStreamClientEndpoint
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.python.failure import Failure

from synflow.config import SynflowConfig
from synflow.errors import ConfigError, SynflowError
from synflow.redis_connect import redis_endpoint, redis_password
from synflow.replication.commands import (
    AnyCommand,
    PositionCommand,
    RdataCommand,
    ReplicateCommand,
    Side,
)
from synflow.replication.core import ConnectionCore, ConnectionOptions, Deliver, SendLine, State
from synflow.replication.interfaces import CommandReceiver, deliver_commands
from synflow.replication.metrics import count_dropped

logger = logging.getLogger(__name__)

#: Largest PUBLISH payload built by coalescing lines (bytes).
MAX_MESSAGE_BYTES = 256 * 1024

#: The commands whose loss catch-up repairs (a later POSITION reveals the gap).
_STREAM_NAMES: Final = frozenset({RdataCommand.NAME, PositionCommand.NAME})

#: A pub/sub bus has no peer to ping: no keep-alive and no ping timeout.
BUS_OPTIONS: Final = ConnectionOptions(ping_interval_s=float("inf"), ping_timeout_s=None)


class RedisStartupError(SynflowError):
    """Redis refused us (bad password, bad database number, ...)."""


def channel_name(config: SynflowConfig) -> str:
    prefix = config.replication.redis.channel_prefix
    return f"{prefix}:{config.server_name}" if prefix else config.server_name


class _AfterTlsAccepted:
    """Over TLS, begin the Redis conversation once the server has answered a PING.

    Twisted hands a TLS connection to its protocol as soon as TCP is up.
    Left alone, txredisapi would send AUTH and call the connection usable
    before the handshake had succeeded: a server certificate our CA did not
    sign (or, with TLS 1.3, a client certificate the server rejects after the
    handshake) looked like a wrong password, failing start-up, or without a
    password like a SUBSCRIBE lost for no reason, retried every second
    because the connection had counted as usable. Here the only thing sent
    first is a PING (held back by the TLS layer until the handshake is done);
    any reply, even ``-NOAUTH``, shows the server accepted us. A connection
    lost before that is logged as a TLS failure and retried with
    txredisapi's growing backoff.
    """

    transport: Any
    factory: Any
    _tls_pending = False

    def connectionMade(self) -> Any:
        if not isinstance(self.transport, TLSMemoryBIOProtocol):
            return self._start()
        self._tls_pending = True
        self.execute_command("PING").addBoth(self._tls_answered)  # type: ignore[attr-defined]
        return None

    def _tls_answered(self, result: Any) -> None:
        if isinstance(result, Failure) and not result.check(txredisapi.ResponseError):
            return None  # the connection is going down; connectionLost reports it
        if self._tls_pending:
            self._tls_pending = False
            self._start()
        return None

    def connectionLost(self, why: Any) -> None:
        if self._tls_pending:
            self._tls_pending = False
            self.factory.service._tls_failed(self.factory.role, why)
        super().connectionLost(why)  # type: ignore[misc]

    def _start(self) -> Any:
        raise NotImplementedError


class _Subscriber(_AfterTlsAccepted, txredisapi.SubscriberProtocol):
    """The subscribing connection: SUBSCRIBE on every (re)connect, then hand messages on."""

    @defer.inlineCallbacks
    def _start(self) -> Any:
        yield txredisapi.SubscriberProtocol.connectionMade(self)  # AUTH and SELECT, if configured
        if not self.connected:
            return
        service: RedisTransportService = self.factory.service
        try:
            yield self.subscribe([service.channel])
        except Exception as e:
            logger.warning("SUBSCRIBE to %r failed: %s", service.channel, e)
            self.transport.loseConnection()
            return
        service._subscribed(self)

    def messageReceived(self, pattern: Any, channel: Any, message: Any) -> None:
        self.factory.service._message(message)

    def connectionLost(self, why: Any) -> None:
        super().connectionLost(why)
        self.factory.service._unsubscribed(self)


class _Publisher(_AfterTlsAccepted, txredisapi.RedisProtocol):
    """The publishing connection: tells the service when it is usable or gone."""

    @defer.inlineCallbacks
    def _start(self) -> Any:
        yield txredisapi.RedisProtocol.connectionMade(self)
        if self.connected:
            self.factory.service._publisher_up(self)

    def connectionLost(self, why: Any) -> None:
        super().connectionLost(why)
        self.factory.service._publisher_down(self)


class RedisConnection:
    """One subscription, as the handler sees it (a fresh one per reconnect)."""

    def __init__(self, service: RedisTransportService, generation: int) -> None:
        self.service = service
        self.generation = generation
        self.peer_name = "redis"

    def send_command(self, cmd: AnyCommand) -> None:
        self.service.send_command(cmd)


class RedisTransportService(Service):
    """Replication over Redis pub/sub for one process.

    Args:
        config: the process config (``replication.redis`` and the server name).
        handler: the replication handler.
        reactor: the reactor.
        rng: randomness (unused by txredisapi's own backoff; kept for symmetry).
        endpoint: connect here instead of the configured server (tests).
    """

    def __init__(self, config: SynflowConfig, handler: CommandReceiver[RedisConnection] | None, reactor: Any,
                 rng: random.Random | None = None, endpoint: IStreamClientEndpoint | None = None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.redis = config.replication.redis
        self.handler = handler
        self.reactor = reactor
        self.channel = channel_name(config)
        self.one_line_per_message = self.redis.one_line_per_message
        self.core = ConnectionCore(Side.BOTH, server_name=config.server_name,
                                   instance_name=config.instance_name, options=BUS_OPTIONS)
        self.connection: RedisConnection | None = None
        self._subscriber: Any = None
        self._publisher: Any = None
        self._generation = 0
        self._sub_factory: Any = None
        self._pub_factory: Any = None
        self._outbox: list[bytes] = []
        self._flush_call: IDelayedCall | None = None
        self._echoes: Counter[bytes] = Counter()
        self._ready_waiters: list[Deferred[None]] = []
        self._ready_fired = False
        self._ready_error: Exception | None = None
        self.subscriptions = 0
        self.dropped_commands = 0
        self.dropped_stream_commands = 0
        self.messages_published = 0
        self.messages_received = 0

    @property
    def connected(self) -> bool:
        return self.connection is not None

    def when_ready(self) -> Deferred[None]:
        """Fires when the first subscription is up; fails if Redis refuses us."""
        d: Deferred[None] = Deferred()
        if self._ready_error is not None:
            d.errback(self._ready_error)
        elif self._ready_fired:
            d.callback(None)
        else:
            self._ready_waiters.append(d)
        return d

    # -- Service ------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        try:
            password = redis_password(self.redis)
            endpoint = self.endpoint or redis_endpoint(self.reactor, self.redis)
        except OSError as e:
            raise ConfigError(f"cannot read a Redis TLS or password file: {e}", key="replication.redis") from None
        dbid = self.redis.dbid or None
        sub = txredisapi.RedisFactory(None, dbid, 1, isLazy=False, password=password, replyTimeout=None)
        sub.protocol = _Subscriber
        sub.maxDelay = 5
        sub.service = self
        sub.role = "subscribing"
        sub.deferred.addErrback(self._refused)
        self._sub_factory = sub
        pub = txredisapi.RedisFactory(None, dbid, 1, isLazy=True, password=password, replyTimeout=30)
        pub.protocol = _Publisher
        pub.service = self
        pub.role = "publishing"
        pub.maxDelay = 5
        pub.deferred.addErrback(self._refused)
        self._pub_factory = pub
        sub.startConnecting(endpoint)
        pub.startConnecting(endpoint)

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        self._flush()
        ds = []
        for factory in (self._sub_factory, self._pub_factory):
            if factory is None:
                continue
            try:
                ds.append(factory.disconnect())
            except RuntimeError:
                # txredisapi cannot stop a slot in the middle of a reconnect;
                # close what is open and let the process exit.
                for proto in list(factory.pool):
                    proto.transport.loseConnection()
        return defer.gatherResults(ds, consumeErrors=True).addErrback(lambda _: None)

    def _refused(self, failure: Any) -> None:
        reason = failure.getErrorMessage()
        where = self.redis.path or f"{self.redis.host}:{self.redis.port}"
        msg = f"Redis at {where} refused the connection: {reason} (check replication.redis.password and dbid)"
        logger.error(msg)
        if not self._ready_fired:
            self._ready_fired = True
            self._ready_error = RedisStartupError(msg)
            for d in self._ready_waiters:
                d.errback(self._ready_error)
            self._ready_waiters = []

    def _tls_failed(self, role: str, why: Any) -> None:
        """A TLS connection was lost before Redis answered on it (it will be retried)."""
        logger.warning(
            "TLS with Redis at %s:%s failed on the %s connection before Redis answered: %s "
            "(check replication.redis.tls and the certificates); retrying",
            self.redis.host, self.redis.port, role, why.getErrorMessage(),
        )

    # -- subscription events ---------------------------------------------------------------

    def _subscribed(self, proto: Any) -> None:
        self._subscriber = proto
        self._maybe_up()

    def _publisher_up(self, proto: Any) -> None:
        self._publisher = proto
        self._maybe_up()

    def _publisher_down(self, proto: Any) -> None:
        if self._publisher is proto:
            self._publisher = None
            self._down("publishing")

    def _maybe_up(self) -> None:
        """Both connections are usable: a new logical connection begins.

        The first things published on it are REPLICATE and our positions, so
        any row we dropped while half-connected is covered by a POSITION
        before any later row can be published.
        """
        if self.connection is not None or self._subscriber is None or self._publisher is None:
            return
        self._generation += 1
        self._echoes.clear()
        conn = self.connection = RedisConnection(self, self._generation)
        self.subscriptions += 1
        self.core.connection_made(self.reactor.seconds())
        logger.info("subscribed to Redis channel %r", self.channel)
        self.send_command(ReplicateCommand())
        if self.handler is not None:
            self.handler.new_connection(conn)
        if not self._ready_fired:
            self._ready_fired = True
            for d in self._ready_waiters:
                d.callback(None)
            self._ready_waiters = []

    def _unsubscribed(self, proto: Any) -> None:
        if self._subscriber is proto:
            self._subscriber = None
            self._down("subscribing")

    def _down(self, which: str) -> None:
        conn, self.connection = self.connection, None
        lines, self._outbox = self._outbox, []
        if conn is not None:
            logger.warning("lost the %s Redis connection (channel %r); reconnecting", which, self.channel)
        self._drop_lines(lines, f"the {which} Redis connection was lost")
        if conn is not None and self.handler is not None:
            self.handler.lost_connection(conn)

    def _drop_lines(self, lines: Iterable[bytes], why: str) -> None:
        """Count lines that will never be published; warn about those catch-up cannot replace."""
        dropped: Counter[str] = Counter(line.split(b" ", 1)[0].decode("utf-8", "replace") for line in lines)
        if not dropped:
            return
        others: dict[str, int] = {}
        for name, n in dropped.items():
            count_dropped(name, n)
            if name in _STREAM_NAMES:
                self.dropped_stream_commands += n
            else:
                others[name] = n
        if others:
            self.dropped_commands += sum(others.values())
            logger.warning(
                "%s: dropped %s (dropped so far: %d)",
                why, ", ".join(f"{n} {name}" for name, n in sorted(others.items())), self.dropped_commands,
            )

    def _message(self, message: Any) -> None:
        data = message.encode("utf-8") if isinstance(message, str) else bytes(message)
        if self._echoes.get(data):
            self._echoes[data] -= 1
            if not self._echoes[data]:
                del self._echoes[data]
            return
        conn = self.connection
        if conn is None:
            return
        self.messages_received += 1
        now = self.reactor.seconds()
        run: list[AnyCommand] = []  # consecutive stream commands, handed over as one list
        for line in data.split(b"\n"):
            result = self.core.receive(line, now)
            if type(result) is not list:
                run.append(result)  # type: ignore[arg-type]
                continue
            if run:
                self._deliver_run(conn, run)
                run = []
            for action in result:
                if isinstance(action, Deliver):
                    self._deliver(conn, action.command)
        if run:
            self._deliver_run(conn, run)

    def _deliver_run(self, conn: Any, cmds: list[AnyCommand]) -> None:
        if self.handler is not None:
            try:
                deliver_commands(self.handler, conn, cmds)
            except Exception:
                logger.exception("error handling %d commands from Redis", len(cmds))

    def _deliver(self, conn: Any, cmd: AnyCommand) -> None:
        if self.handler is not None:
            try:
                self.handler.on_command(conn, cmd)
            except Exception:
                logger.exception("error handling %s from Redis", cmd.NAME)

    # -- sending -------------------------------------------------------------------------------

    @property
    def peer_name(self) -> str | None:
        """The bus every process of the deployment publishes to."""
        return "redis"

    def send_command(self, cmd: AnyCommand) -> None:
        """Publish a command (coalesced with others sent in the same reactor turn)."""
        if self.connection is None:
            count_dropped(cmd.NAME)
            if isinstance(cmd, RdataCommand | PositionCommand):
                self.dropped_stream_commands += 1
            else:
                self.dropped_commands += 1
                logger.warning("not connected to Redis: dropped %s (dropped so far: %d)", cmd.NAME, self.dropped_commands)
            return
        if self.core.state is State.ESTABLISHED:  # always, on a bus: no action list per line
            self._outbox.append(self.core.send_now(cmd, self.reactor.seconds()))
        else:
            for action in self.core.send(cmd, self.reactor.seconds()):
                if isinstance(action, SendLine):
                    self._outbox.append(action.data)
        if self._flush_call is None:
            self._flush_call = self.reactor.callLater(0, self._flush)

    def _flush(self) -> None:
        self._flush_call = None
        if not self._outbox:
            return
        lines, self._outbox = self._outbox, []
        conn = self._publisher
        if conn is None or self.connection is None:
            self._drop_lines(lines, "not connected to Redis")
            return
        if self.one_line_per_message:
            for line in lines:
                self._publish(conn, line)
            return
        message: list[bytes] = []
        size = 0
        for line in lines:
            if message and size + len(line) + 1 > MAX_MESSAGE_BYTES:
                self._publish(conn, b"\n".join(message))
                message, size = [], 0
            message.append(line)
            size += len(line) + 1
        if message:
            self._publish(conn, b"\n".join(message))

    def _publish(self, conn: Any, payload: bytes) -> None:
        self._echoes[payload] += 1
        self.messages_published += 1
        d = conn.publish(self.channel, payload.decode("utf-8"))
        d.addErrback(self._publish_failed, payload)

    def _publish_failed(self, failure: Any, payload: bytes) -> None:
        if self._echoes.get(payload):
            self._echoes[payload] -= 1
            if not self._echoes[payload]:
                del self._echoes[payload]
        logger.warning("PUBLISH to Redis failed: %s", failure.getErrorMessage())
        self._drop_lines(payload.split(b"\n"), "a PUBLISH failed")
