"""Child processes of the replication *ceilings*: the same bytes without synflow.

``python -m scripts.benchmarks.rawproc ROLE ...`` where ROLE is:

* ``relay`` -- a bare Twisted ``LineOnlyReceiver`` server that forwards every
  line to every other connection (what the hub does, minus parsing, checks
  and re-encoding);
* ``writer`` -- sends exactly the RDATA lines synflow's writer sends (same
  bytes) with ``sendLine``, to the relay or, with ``--redis-prefix``, one
  line per Redis ``PUBLISH`` through txredisapi;
* ``reader`` -- counts lines from the relay, or messages on the Redis channel.

They use the same windowed flow control as synflow's children
(:mod:`scripts.benchmarks.flow`), so the ratio compares like with like.
"""

from __future__ import annotations

import argparse
from typing import Any

import txredisapi
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver

from scripts.benchmarks.common import REDIS_HOST, REDIS_PORT, emit
from scripts.benchmarks.flow import AckReporter, WindowedProducer
from synflow.replication.commands import RdataCommand, encode_line_bytes

CHANNEL_SUFFIX = "bench.local"


RAW_LINE = b'RDATA events w1 %d ["$e%d:bench.local","!room%d:bench.local","m.room.message",null,"@user%d:bench.local",null]'


def raw_line(n: int) -> bytes:
    """Byte for byte the line synflow's writer sends for fact ``n`` (checked at start-up)."""
    return RAW_LINE % (n, n, n % 64, n % 32)


def check_same_bytes() -> None:
    from scripts.benchmarks.replproc import events_row

    for n in (2, 77, 123456):
        expected = encode_line_bytes(RdataCommand("events", "w1", n, events_row(n).to_wire()))
        if raw_line(n) != expected:
            raise SystemExit(f"raw line differs from synflow's: {raw_line(n)!r} != {expected!r}")


class _Relay(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = 16 * 1024

    def connectionMade(self) -> None:
        self.factory.conns.append(self)

    def connectionLost(self, reason: Any = None) -> None:
        self.factory.conns.remove(self)

    def lineReceived(self, line: bytes) -> None:
        for other in self.factory.conns:
            if other is not self:
                other.sendLine(line)


class _Counter(LineOnlyReceiver):
    delimiter = b"\n"
    MAX_LENGTH = 16 * 1024
    acks: AckReporter

    def connectionMade(self) -> None:
        self.factory.acks.ready()

    def lineReceived(self, line: bytes) -> None:
        if line.startswith(b"RDATA "):
            self.factory.acks.applied(1, int(line.split(b" ", 4)[3]))


class _Sender(LineOnlyReceiver):
    delimiter = b"\n"

    def lineReceived(self, line: bytes) -> None:
        pass


def run_relay(args: argparse.Namespace) -> None:
    factory = Factory.forProtocol(_Relay)
    factory.conns = []  # type: ignore[attr-defined]
    TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory).addCallback(
        lambda port: emit("ready", port=port.getHost().port))


def run_writer(args: argparse.Namespace) -> None:
    check_same_bytes()
    state: dict[str, Any] = {"next": 2, "send": None}

    def produce(n: int) -> int:
        first = state["next"]
        send = state["send"]
        for i in range(first, first + n):
            send(raw_line(i))
        state["next"] = first + n
        return first + n - 1

    producer = WindowedProducer(produce, facts=args.facts, readers=args.readers, window=args.window,
                                chunk=args.chunk)

    def listening(port: Any) -> None:
        control = port.getHost().port
        if args.redis_prefix:
            channel = f"{args.redis_prefix}:{CHANNEL_SUFFIX}"
            factory = txredisapi.RedisFactory(None, None, 1, isLazy=False, replyTimeout=None)
            factory.startConnecting(TCP4ClientEndpoint(reactor, REDIS_HOST, REDIS_PORT))

            def up(conn: Any) -> None:
                # One message per PUBLISH, pipelined (no waiting for each reply).
                state["send"] = lambda line: conn.publish(channel, line.decode())
                emit("ready", control_port=control)

            factory.deferred.addCallback(up)
        else:
            d = TCP4ClientEndpoint(reactor, "127.0.0.1", args.relay).connect(Factory.forProtocol(_Sender))

            def connected(proto: Any) -> None:
                state["send"] = proto.sendLine
                emit("ready", control_port=control)

            d.addCallback(connected)

    producer.listen().addCallback(listening)


def run_reader(args: argparse.Namespace) -> None:
    acks = AckReporter(args.name, args.control)
    acks.connect()
    if args.redis_prefix:
        channel = f"{args.redis_prefix}:{CHANNEL_SUFFIX}"

        class Sub(txredisapi.SubscriberProtocol):
            def connectionMade(self) -> Any:
                d = super().connectionMade()
                self.subscribe([channel]).addCallback(lambda _: acks.ready())
                return d

            def messageReceived(self, pattern: Any, ch: Any, message: Any) -> None:
                acks.applied(1, int(message.split(" ", 4)[3]))

        factory = txredisapi.RedisFactory(None, None, 1, isLazy=False, replyTimeout=None)
        factory.protocol = Sub
        factory.startConnecting(TCP4ClientEndpoint(reactor, REDIS_HOST, REDIS_PORT))
    else:
        factory = Factory.forProtocol(_Counter)
        factory.acks = acks  # type: ignore[attr-defined]
        TCP4ClientEndpoint(reactor, "127.0.0.1", args.relay).connect(factory)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    sub.add_parser("relay")
    w = sub.add_parser("writer")
    w.add_argument("--relay", type=int, default=0)
    w.add_argument("--redis-prefix", default="")
    w.add_argument("--facts", type=int, default=100_000)
    w.add_argument("--readers", type=int, default=1)
    w.add_argument("--window", type=int, default=5000)
    w.add_argument("--chunk", type=int, default=100)
    r = sub.add_parser("reader")
    r.add_argument("--name", required=True)
    r.add_argument("--relay", type=int, default=0)
    r.add_argument("--redis-prefix", default="")
    r.add_argument("--control", type=int, required=True)
    args = p.parse_args()
    {"relay": run_relay, "writer": run_writer, "reader": run_reader}[args.role](args)
    reactor.run()


if __name__ == "__main__":
    main()
