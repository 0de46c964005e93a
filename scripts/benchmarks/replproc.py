"""Child processes of the replication benchmarks, running synflow's real replication code.

``python -m scripts.benchmarks.replproc ROLE ...`` where ROLE is:

* ``hub`` -- the master's :class:`~synflow.replication.hub.ReplicationHub`
  behind a :class:`~synflow.replication.hub.ReplicationServerFactory` on an
  ephemeral port; relay-only, or with ``--master-handler`` a master
  :class:`~synflow.replication.handler.ReplicationHandler` that reads every
  row as a real master does. Prints its connections' queue state every
  second (``stats`` events).
* ``writer`` -- an events-stream writer: a
  :class:`~synflow.storage.id_generators.MultiWriterIdGenerator` and its
  handler, fed as a persister's committed transactions feed it
  (``tracker.begin_fetch()`` then ``finish(handle, ids, payloads, ok)``) but
  without a database. Its transport is a
  :class:`~synflow.replication.client.ReplicationClientService` to a hub
  (``--hub PORT``), a hub of its own (``--serve``: the writer serves its
  readers directly), or Redis (``--redis-prefix``).
* ``reader`` -- a worker's handler that decodes every row and applies it to
  its view of the writer's position, over the hub or Redis.

Writers and readers coordinate through :mod:`scripts.benchmarks.flow`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.task import LoopingCall

from scripts.benchmarks.common import emit
from scripts.benchmarks.flow import AckReporter, WindowedProducer
from synflow import registry
from synflow.replication.client import ReplicationClientService
from synflow.replication.commands import PositionCommand
from synflow.replication.handler import ReplicationHandler
from synflow.replication.hub import ReplicationHub, ReplicationServerFactory
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import EVENTS, EventsRow

SERVER_NAME = "bench.local"
WRITER = "w1"
ROOMS = [f"!room{i}:bench.local" for i in range(64)]
SENDERS = [f"@user{i}:bench.local" for i in range(32)]


def events_row(n: int) -> EventsRow:
    """The row of fact ``n`` (the raw ceilings send exactly its encoding)."""
    return EventsRow(f"$e{n}:bench.local", ROOMS[n % 64], "m.room.message", None, SENDERS[n % 32], None)


def redis_config(prefix: str, instance: str, app: str) -> Any:
    from synflow.config import load_config

    fd, path = tempfile.mkstemp(suffix=".yaml", prefix=f"bench-{instance}-")
    with os.fdopen(fd, "w") as f:
        f.write(
            f"server_name: {SERVER_NAME}\napp: {app}\ninstance_name: {instance}\ndata_dir: {tempfile.gettempdir()}\n"
            f"instance_map: {{{WRITER}: {{port: 1}}, {instance}: {{port: 2}}}}\n"
            f"stream_writers: {{events: [{WRITER}]}}\n"
            f"replication: {{transport: redis, redis: {{channel_prefix: {prefix}}}}}\n"
        )
    try:
        return load_config([path])
    finally:
        os.unlink(path)


def start_redis(prefix: str, instance: str, app: str, handler: ReplicationHandler) -> Any:
    from synflow.replication.redis import RedisTransportService

    transport = RedisTransportService(redis_config(prefix, instance, app), handler, reactor)
    handler.set_transport(transport)
    transport.startService()
    return transport


def client(port: int, instance: str, handler: ReplicationHandler) -> ReplicationClientService:
    service = ReplicationClientService(
        TCP4ClientEndpoint(reactor, "127.0.0.1", port), server_name=SERVER_NAME, instance_name=instance,
        handler=handler, clock=reactor,
    )
    handler.set_transport(service)
    service.startService()
    return service


def serve_hub(handler: ReplicationHandler | None) -> tuple[ReplicationHub, Any]:
    hub = ReplicationHub(handler)
    if handler is not None:
        handler.set_transport(hub)
    factory = ReplicationServerFactory(hub, SERVER_NAME, reactor)
    d = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    return hub, d


def hub_stats(hub: ReplicationHub) -> None:
    conns = []
    for conn in hub.connections:
        core = conn.core
        conns.append({"peer": core.peer_name, "pending": core.pending_commands, "pending_bytes": core.pending_bytes,
                      "congested": core.congested, "folded": core.stats.rows_folded, "state": core.state.value})
    emit("stats", relayed=hub.relayed, connections=conns)


# -- roles ------------------------------------------------------------------------------------


def run_hub(args: argparse.Namespace) -> None:
    handler = None
    if args.master_handler:
        handler = ReplicationHandler("master", reactor, streams=registry.streams(), sources={},
                                     initial_positions={"events": {WRITER: 1}})
    hub, d = serve_hub(handler)
    d.addCallback(lambda port: emit("ready", port=port.getHost().port))
    LoopingCall(hub_stats, hub).start(1.0, now=False)


def run_writer(args: argparse.Namespace) -> None:
    gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, reactor)
    handler = ReplicationHandler(WRITER, reactor, streams=registry.streams(), sources={}, generators={"events": gen})
    state = {"next": 2}

    def produce(n: int) -> int:
        # One committed transaction of n facts, announced as a persister's would be.
        first = state["next"]
        ids = list(range(first, first + n))
        state["next"] = first + n
        handle = gen.tracker.begin_fetch()
        gen.finish(handle, ids, {i: FactPayload((events_row(i),), 0) for i in ids}, True)
        return ids[-1]

    producer = WindowedProducer(produce, facts=args.facts, readers=args.readers, window=args.window,
                                chunk=args.chunk, duration_s=args.duration)
    ready: dict[str, Any] = {}

    def listening(port: Any) -> None:
        ready["control_port"] = port.getHost().port
        if args.serve:
            hub, d = serve_hub(handler)
            LoopingCall(hub_stats, hub).start(1.0, now=False)
            d.addCallback(lambda p: emit("ready", hub_port=p.getHost().port, **ready))
            return
        if args.redis_prefix:
            start_redis(args.redis_prefix, WRITER, "event_persister", handler).when_ready().addCallback(
                lambda _: emit("ready", **ready))
        else:
            client(args.hub, WRITER, handler)
            emit("ready", **ready)

    producer.listen().addCallback(listening)


def run_reader(args: argparse.Namespace) -> None:
    handler = ReplicationHandler(args.name, reactor, streams=registry.streams(), sources={},
                                 initial_positions={"events": {WRITER: 1}})
    acks = AckReporter(args.name, args.control)
    handler.add_row_handler("events", lambda instance, token, rows: acks.applied(len(rows), token))

    def on_position(conn: Any, cmd: PositionCommand) -> None:
        if cmd.stream_name == "events" and cmd.instance_name == WRITER:
            acks.ready()  # the writer's rows are followed from here on

    handler.add_command_listener(PositionCommand, on_position)
    acks.connect()
    if args.redis_prefix:
        start_redis(args.redis_prefix, args.name, "cache_invalidator", handler)
    else:
        client(args.hub, args.name, handler)

    def report() -> None:
        s = handler.stats
        emit("reader_stats", name=args.name, rows=acks.rows, position=handler.position("events", WRITER),
             applied=s.rdata_applied, unconnected=s.rdata_unconnected, catch_ups=s.catch_ups)

    LoopingCall(report).start(1.0, now=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    h = sub.add_parser("hub")
    h.add_argument("--master-handler", action="store_true")
    w = sub.add_parser("writer")
    w.add_argument("--hub", type=int, default=0)
    w.add_argument("--serve", action="store_true")
    w.add_argument("--redis-prefix", default="")
    w.add_argument("--facts", type=int, default=100_000)
    w.add_argument("--readers", type=int, default=1)
    w.add_argument("--window", type=int, default=5000)
    w.add_argument("--chunk", type=int, default=100)
    w.add_argument("--duration", type=float, default=0.0)
    r = sub.add_parser("reader")
    r.add_argument("--name", required=True)
    r.add_argument("--hub", type=int, default=0)
    r.add_argument("--redis-prefix", default="")
    r.add_argument("--control", type=int, required=True)
    args = p.parse_args()
    {"hub": run_hub, "writer": run_writer, "reader": run_reader}[args.role](args)
    reactor.run()


if __name__ == "__main__":
    main()
