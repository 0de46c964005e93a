"""Replication metrics, computed when ``/metrics`` is scraped (nothing on the hot path).

One collector is registered per process; handlers and transports register
themselves with it (weakly, so test processes that build several do not
leak). It exports:

* ``synflow_replication_stream_position{stream, instance}`` -- every writer's
  position as this process sees it;
* ``synflow_replication_lag{stream, instance}`` -- how far a writer's position
  is behind the highest position known on that stream;
* ``synflow_replication_commands_total{direction, command}`` -- commands
  received and sent on this process's connections;
* ``synflow_replication_pending_commands`` and ``_connections`` -- queued
  outbound commands and live connections;
* ``synflow_replication_catch_ups_total`` and friends from the handler's counters;
* ``synflow_replication_dropped_commands_total{command}`` -- commands a
  transport could not send because it was disconnected (counted as they are
  dropped, which only happens while a transport is down).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from synflow.metrics import counter


class _ReplicationCollector:
    def __init__(self) -> None:
        self.handlers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.transports: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterator[Any]:
        position = GaugeMetricFamily("synflow_replication_stream_position",
                                     "Each writer's stream position as this process sees it", labels=["stream", "instance"])
        lag = GaugeMetricFamily("synflow_replication_lag",
                                "How far a writer's position is behind the highest known on its stream",
                                labels=["stream", "instance"])
        handler_counts: dict[str, float] = {}
        for handler in list(self.handlers):
            for stream, view in handler.views.items():
                top = max(view.positions.values(), default=0)
                for instance, pos in view.positions.items():
                    position.add_metric([stream, instance], pos)
                    lag.add_metric([stream, instance], top - pos)
            for key, value in vars(handler.stats).items():
                handler_counts[key] = handler_counts.get(key, 0) + value
        yield position
        yield lag
        for key, value in sorted(handler_counts.items()):
            family = CounterMetricFamily(f"synflow_replication_{key}", f"Replication handler counter: {key}")
            family.add_metric([], value)
            yield family
        commands = CounterMetricFamily("synflow_replication_commands", "Replication commands by direction",
                                       labels=["direction", "command"])
        pending = GaugeMetricFamily("synflow_replication_pending_commands", "Outbound commands waiting to be written")
        connections = GaugeMetricFamily("synflow_replication_connections", "Live replication connections")
        totals: dict[tuple[str, str], float] = {}
        queued = live = 0
        for transport in list(self.transports):
            for core in _cores(transport):
                live += 1
                queued += core.pending_commands
                for name, n in core.stats.commands_in.items():
                    totals[("in", name)] = totals.get(("in", name), 0) + n
                for name, n in core.stats.commands_out.items():
                    totals[("out", name)] = totals.get(("out", name), 0) + n
            for (direction, name), n in getattr(transport, "closed_totals", {}).items():
                totals[(direction, name)] = totals.get((direction, name), 0) + n
        for (direction, name), n in sorted(totals.items()):
            commands.add_metric([direction, name], n)
        pending.add_metric([], queued)
        connections.add_metric([], live)
        yield commands
        yield pending
        yield connections


def _cores(transport: Any) -> list[Any]:
    if hasattr(transport, "connections"):  # the hub
        return [c.core for c in transport.connections]
    if getattr(transport, "connection", None) is not None and hasattr(transport.connection, "core"):
        return [transport.connection.core]  # the TCP client
    core = getattr(transport, "core", None)  # Redis
    return [core] if core is not None and getattr(transport, "connected", False) else []


COLLECTOR = _ReplicationCollector()
REGISTRY.register(COLLECTOR)

#: Commands dropped because the transport was disconnected, by command name.
DROPPED_COMMANDS = counter(
    "synflow_replication_dropped_commands",
    "Replication commands dropped because the transport was disconnected",
    ["command"],
)


def count_dropped(command: str, n: int = 1) -> None:
    """Count ``n`` commands named ``command`` dropped while disconnected."""
    DROPPED_COMMANDS.labels(command=command).inc(n)


def watch(handler: Any, transport: Any) -> None:
    """Export this process's handler and transport on /metrics."""
    COLLECTOR.handlers.add(handler)
    if transport is not None:
        COLLECTOR.transports.add(transport)
