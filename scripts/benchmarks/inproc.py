"""The ``tcp`` benchmark's three roles in one process, without system calls: CPU per row of each.

Over real processes on a shared two-core VM the CPU per RDATA moves by a
fifth from run to run, more than most changes to the Python on the path. This
measures only that Python: the same roles as :mod:`scripts.benchmarks.replproc`
and their ceilings as :mod:`scripts.benchmarks.rawproc`, each on transports
that drop what is written, fed the bytes the previous role would have written.

* writer: a committed transaction of 100 facts through the real
  ``MultiWriterIdGenerator`` and ``ReplicationHandler`` announcing them on a
  client ``ReplicationProtocol`` (the rows built as the process benchmark
  builds them); ceiling: ``sendLine`` of the same bytes from a bare
  ``LineOnlyReceiver``, the lines formatted as the raw writer formats them;
* hub: the lines of one such transaction arriving on one connection of a
  ``ReplicationHub`` and relayed to the other; ceiling: the raw relay;
* reader: the same bytes arriving at a worker's ``ReplicationProtocol`` and
  handler, every row decoded and applied; ceiling: the raw reader, which
  reads each line's token and acknowledges it (to a counter here).

Each figure is the best of several passes of ``thread_time`` (the least
disturbed by other load), divided by the rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.basic import LineOnlyReceiver

from scripts.benchmarks.rawproc import _Counter, _Relay, check_same_bytes, raw_line
from scripts.benchmarks.replproc import SERVER_NAME, WRITER, events_row
from synflow import registry
from synflow.replication.commands import PositionCommand, Side, encode_line_bytes
from synflow.replication.core import ConnectionCore
from synflow.replication.handler import ReplicationHandler
from synflow.replication.hub import ReplicationHub, ReplicationServerFactory
from synflow.replication.protocol import ReplicationProtocol
from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator
from synflow.streams import EVENTS

CHUNK = 100
ROLES = ("writer", "hub", "reader")


class _Dropping(StringTransport):
    """A transport that keeps nothing: the cost of the write call, not of buffering."""

    def write(self, data: bytes) -> None:
        pass


def _client(name: str, handler: ReplicationHandler, clock: Clock) -> ReplicationProtocol:
    proto = ReplicationProtocol(ConnectionCore(Side.CLIENT, server_name=SERVER_NAME, instance_name=name),
                                handler, clock)
    handler.set_transport(proto)
    proto.makeConnection(_Dropping())
    proto.dataReceived(f"SERVER {SERVER_NAME}\n".encode())
    return proto


def _best(step: Callable[[int], None], chunks: int, passes: int) -> float:
    """Seconds of CPU for ``chunks`` calls of ``step``, best of ``passes``; each call gets its own chunk index."""
    best, k = float("inf"), 0
    for _ in range(passes):
        t = time.thread_time()
        for _ in range(chunks):
            step(k)
            k += 1
        best = min(best, time.thread_time() - t)
    return best


def synflow_roles(chunks: int, passes: int) -> dict[str, float]:
    """µs of CPU per row of synflow's writer, hub and reader."""
    clock = Clock()
    total = chunks * passes * CHUNK
    out: dict[str, float] = {}

    gen = MultiWriterIdGenerator(EVENTS, WRITER, 1, clock)
    writer = ReplicationHandler(WRITER, clock, streams=registry.streams(), sources={}, generators={"events": gen})
    _client(WRITER, writer, clock)

    def write(k: int) -> None:
        ids = list(range(2 + k * CHUNK, 2 + (k + 1) * CHUNK))
        handle = gen.tracker.begin_fetch()
        gen.finish(handle, ids, {i: FactPayload((events_row(i),), 0) for i in ids}, True)

    out["writer"] = _best(write, chunks, passes)

    data = _chunks(chunks * passes)

    hub = ReplicationHub(None)
    factory = ReplicationServerFactory(hub, SERVER_NAME, clock)
    conns = []
    for name in (WRITER, "reader1"):
        proto = factory.buildProtocol(None)
        proto.makeConnection(_Dropping())
        proto.dataReceived(f"NAME {name}\n".encode())
        conns.append(proto)
    out["hub"] = _best(lambda k: conns[0].dataReceived(data[k]), chunks, passes)

    reader = ReplicationHandler("reader1", clock, streams=registry.streams(), sources={},
                                initial_positions={"events": {WRITER: 1}})
    applied = [0]
    reader.add_row_handler("events", lambda instance, token, rows: applied.__setitem__(0, applied[0] + len(rows)))
    proto = _client("reader1", reader, clock)
    proto.dataReceived(encode_line_bytes(PositionCommand("events", WRITER, 1, 1)) + b"\n")
    out["reader"] = _best(lambda k: proto.dataReceived(data[k]), chunks, passes)
    if applied[0] != total:
        raise RuntimeError(f"the in-process reader applied {applied[0]} of {total} rows")
    return {role: seconds * 1e6 / (chunks * CHUNK) for role, seconds in out.items()}


def _chunks(n: int) -> list[bytes]:
    """The bytes of ``n`` writer transactions of :data:`CHUNK` rows: synflow's writer's lines, byte for byte."""
    check_same_bytes()
    return [b"\n".join(raw_line(i) for i in range(2 + k * CHUNK, 2 + (k + 1) * CHUNK)) + b"\n"
            for k in range(n)]


class _Acks:
    """Stands for the raw reader's ack reporter: counts the rows it would acknowledge."""

    def __init__(self) -> None:
        self.rows = 0

    def ready(self) -> None:
        pass

    def applied(self, rows: int, token: int) -> None:
        self.rows += rows


def raw_roles(chunks: int, passes: int) -> dict[str, float]:
    """µs of CPU per row of the raw ceiling's writer, relay and reader."""
    total = chunks * passes * CHUNK
    out: dict[str, float] = {}

    sender = LineOnlyReceiver()
    sender.makeConnection(_Dropping())

    def write(k: int) -> None:
        send = sender.sendLine
        for i in range(2 + k * CHUNK, 2 + (k + 1) * CHUNK):
            send(raw_line(i))

    out["writer"] = _best(write, chunks, passes)

    data = _chunks(chunks * passes)
    factory = Factory.forProtocol(_Relay)
    factory.conns = []  # type: ignore[attr-defined]
    relays = []
    for _ in range(2):
        relay = factory.buildProtocol(None)
        assert relay is not None
        relay.makeConnection(_Dropping())
        relays.append(relay)
    out["hub"] = _best(lambda k: relays[0].dataReceived(data[k]), chunks, passes)

    acks = _Acks()
    counters = Factory.forProtocol(_Counter)
    counters.acks = acks  # type: ignore[attr-defined]
    counter = counters.buildProtocol(None)
    assert counter is not None
    counter.makeConnection(_Dropping())
    out["reader"] = _best(lambda k: counter.dataReceived(data[k]), chunks, passes)
    if acks.rows != total:
        raise RuntimeError(f"the in-process raw reader counted {acks.rows} of {total} rows")
    return {role: seconds * 1e6 / (chunks * CHUNK) for role, seconds in out.items()}


def measure(quick: bool) -> dict[str, dict[str, float]]:
    """``{"synflow": {role: µs}, "raw": {role: µs}}``, the two interleaved three times (best of each)."""
    chunks, passes = (100, 3) if quick else (500, 5)
    best: dict[str, dict[str, float]] = {"synflow": {}, "raw": {}}
    for _ in range(3):
        for name, fn in (("synflow", synflow_roles), ("raw", raw_roles)):
            got = fn(chunks, passes)
            for role, us in got.items():
                best[name][role] = min(best[name].get(role, float("inf")), us)
    return best
