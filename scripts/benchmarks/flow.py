"""The side channel between a benchmark's writer and its readers, and the windowed producer.

A throughput figure is only honest if the writer cannot run ahead of what the
readers apply: over the TCP hub, rows a slow reader cannot take are folded
into POSITION placeholders (the reader would catch them up from the database),
and over Redis they would pile up in the server. So every writer -- synflow's
and the raw ceilings alike -- listens on a small *control* port where each
reader reports ``ready <name>`` once it is connected and then ``ack <name>
<rows> <position>`` a few milliseconds after it applied rows; the
:class:`WindowedProducer` keeps at most ``window`` rows between what was
produced and what the slowest reader applied. The run ends when every reader
has acknowledged the last position.

Used inside the child processes of :mod:`scripts.benchmarks.replproc` and
:mod:`scripts.benchmarks.rawproc` (they run a reactor).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory
from twisted.protocols.basic import LineOnlyReceiver

from scripts.benchmarks.common import cpu_seconds, emit

#: How long a reader waits after applying rows before acknowledging (seconds).
ACK_DELAY_S = 0.002


class _ControlServer(LineOnlyReceiver):
    delimiter = b"\n"
    transport: Any

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)  # acks are tiny and must not wait for Nagle

    def lineReceived(self, line: bytes) -> None:
        parts = line.decode().split()
        producer: WindowedProducer = self.factory.producer
        if parts[0] == "ready":
            producer.reader_ready(parts[1])
        elif parts[0] == "ack":
            producer.reader_ack(parts[1], int(parts[2]), int(parts[3]))


class WindowedProducer:
    """Produces rows in chunks while fewer than ``window`` are unacknowledged.

    Args:
        produce: ``produce(n)`` emits the next ``n`` rows (one per fact) and
            returns the position of the last one.
        facts: how many rows to produce (ignored with ``duration_s``).
        readers: how many readers must say ``ready`` before producing starts.
        window: the most rows produced but not applied by every reader (0:
            unbounded, for the congestion benchmark).
        chunk: rows produced per step (one step per reactor turn at most).
        duration_s: produce for this long instead of ``facts`` rows.
    """

    def __init__(self, produce: Callable[[int], int], *, facts: int, readers: int, window: int,
                 chunk: int, duration_s: float = 0.0, progress_interval_s: float = 0.5) -> None:
        self.produce = produce
        self.facts = facts
        self.readers = readers
        self.window = window
        self.chunk = chunk
        self.duration_s = duration_s
        self.progress_interval_s = progress_interval_s
        self.ready: set[str] = set()
        self.acks: dict[str, tuple[int, int]] = {}
        self.produced = 0
        self.last_position = 0
        self.started_at = 0.0
        self.cpu_start = 0.0
        self._step_pending = False
        self._done = False
        self._last_progress = 0.0

    def listen(self) -> Any:
        """Listen for readers on an ephemeral loopback port; returns the listening Deferred."""
        factory = Factory.forProtocol(_ControlServer)
        factory.producer = self  # type: ignore[attr-defined]
        return TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)

    # -- readers --------------------------------------------------------------------------

    def reader_ready(self, name: str) -> None:
        self.ready.add(name)
        self.acks.setdefault(name, (0, 0))
        if len(self.ready) == self.readers and not self.started_at:
            emit("readers_ready", readers=sorted(self.ready))
            self.start()

    def reader_ack(self, name: str, rows: int, position: int) -> None:
        self.acks[name] = (rows, position)
        self._maybe_finish()
        self._schedule()

    # -- producing --------------------------------------------------------------------------

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.cpu_start = time.process_time()
        if self.duration_s:
            reactor.callLater(self.duration_s, self._finish)
        self._schedule()

    def _in_flight(self) -> int:
        if not self.acks:
            return self.produced
        return self.produced - min(rows for rows, _ in self.acks.values())

    def _schedule(self) -> None:
        if not self._step_pending and not self._done and self.started_at:
            self._step_pending = True
            reactor.callLater(0, self._step)

    def _step(self) -> None:
        self._step_pending = False
        if self._done:
            return
        n = self.chunk if self.duration_s else min(self.chunk, self.facts - self.produced)
        if self.window:
            n = min(n, self.window - self._in_flight())
        if n > 0:
            self.last_position = self.produce(n)
            self.produced += n
            self._schedule()
        now = time.monotonic()
        if now - self._last_progress >= self.progress_interval_s:
            self._last_progress = now
            emit("progress", produced=self.produced, acked=min((r for r, _ in self.acks.values()), default=0),
                 t=round(now - self.started_at, 3))

    def _maybe_finish(self) -> None:
        if self._done or self.duration_s or self.produced < self.facts:
            return
        if len(self.acks) >= self.readers and all(pos >= self.last_position for _, pos in self.acks.values()):
            self._finish()

    def _finish(self) -> None:
        self._done = True
        seconds = time.monotonic() - self.started_at
        emit("result", rows=self.produced, seconds=round(seconds, 4),
             rows_per_s=round(self.produced / seconds, 1) if seconds else 0.0,
             writer_cpu_s=round(time.process_time() - self.cpu_start, 3),
             readers={n: {"rows": r, "position": p} for n, (r, p) in sorted(self.acks.items())})


class _ControlClient(LineOnlyReceiver):
    delimiter = b"\n"
    transport: Any

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)


class AckReporter:
    """A reader's end of the side channel: ``ready`` once, then throttled ``ack`` lines."""

    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port
        self.rows = 0
        self.position = 0
        self._proto: Any = None
        self._pending = False
        self._ready_sent = False
        self._want_ready = False

    def connect(self) -> Any:
        d = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port).connect(Factory.forProtocol(_ControlClient))

        def connected(proto: Any) -> None:
            self._proto = proto
            if self._want_ready:
                self.ready()

        return d.addCallback(connected)

    def ready(self) -> None:
        """Tell the writer this reader is connected and follows its stream."""
        self._want_ready = True
        if self._proto is not None and not self._ready_sent:
            self._ready_sent = True
            self._proto.sendLine(f"ready {self.name}".encode())
            emit("reader_ready", name=self.name, cpu_s=cpu_seconds_self())

    def applied(self, rows: int, position: int) -> None:
        """Rows were applied up to ``position``; acknowledge soon."""
        self.rows += rows
        self.position = max(self.position, position)
        if not self._pending:
            self._pending = True
            reactor.callLater(ACK_DELAY_S, self._send)

    def _send(self) -> None:
        self._pending = False
        if self._proto is not None:
            self._proto.sendLine(f"ack {self.name} {self.rows} {self.position}".encode())


def cpu_seconds_self() -> float:
    return round(time.process_time(), 3)


__all__ = ["AckReporter", "WindowedProducer", "cpu_seconds"]
