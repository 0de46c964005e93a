"""Assembles replication for one process: positions, generators, handler, transport.

:func:`setup_replication` loads every stream's state from the database
(checking and, where safe, repairing it), builds the ID generators of the
streams this instance writes, the handler with a database catch-up source
per stream, and the transport the config chooses: the TCP hub on the master
(every worker connects to it) or a reconnecting client on a worker, or Redis
pub/sub on every process.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString

from synflow import registry
from synflow.app.services import ListeningService
from synflow.audit import AuditLog
from synflow.config import SynflowConfig, Transport
from synflow.events.shards import load_state_txn
from synflow.framework import Capability
from synflow.listeners import hub_endpoint
from synflow.replication import metrics as replication_metrics
from synflow.replication.client import ReplicationClientService
from synflow.replication.core import ConnectionOptions
from synflow.replication.guard import PositionGuard
from synflow.replication.handler import ReplicationHandler
from synflow.replication.hub import ReplicationHub, ReplicationServerFactory
from synflow.storage.engines import Database
from synflow.storage.id_generators import (
    MultiWriterIdGenerator,
    StreamWriters,
    last_allocated_txn,
    load_stream_state_txn,
    persist_position_txn,
)
from synflow.storage.sources import DatabaseSource
from synflow.streams import StreamDef, Writers


def writes_stream(config: SynflowConfig, stream: StreamDef) -> bool:
    """Whether this instance writes ``stream``."""
    if stream.writers is Writers.ANY:
        return True
    if stream.writers is Writers.DECLARED:
        return registry.worker_type_for(config).declares_writer_of(stream)
    if stream.reshardable and registry.worker_type_for(config).declares_writer_of(stream):
        return True  # a writer that joins (or left) by resharding
    return config.instance_name in config.writers_of(stream)


@attrs.define
class Replication:
    """The replication parts of one process."""

    handler: ReplicationHandler
    writers: StreamWriters
    service: MultiService
    hub: ReplicationHub | None = None
    client: ReplicationClientService | None = None
    transport: Any = None
    #: Each stream's highest allocated ID when this process started (from its
    #: sequence): at or above every fact written before the start.
    allocated_at_start: dict[str, int] = attrs.Factory(dict)


def connection_options(config: SynflowConfig) -> ConnectionOptions:
    """The options of this process's TCP replication connections, from its config."""
    r = config.replication
    return ConnectionOptions(
        ping_interval_s=r.ping_interval_s,
        ping_timeout_s=r.ping_timeout_s,
        high_water=r.high_water,
        hard_limit=r.hard_limit,
        secret=config.replication_secret(),
    )


async def setup_replication(
    config: SynflowConfig,
    reactor: Any,
    db: Database,
    *,
    audit: AuditLog | None = None,
    rng: random.Random | None = None,
) -> Replication:
    """Load stream state and build the handler and transport (not started)."""
    me = config.instance_name
    streams = registry.streams()
    generators: dict[str, MultiWriterIdGenerator] = {}
    positions: dict[str, dict[str, int]] = {}
    allocated: dict[str, int] = {}
    reserved = registry.discover().reserved
    for name, stream in streams.items():
        state = await db.run_interaction(
            f"load_stream_{name}", load_stream_state_txn, stream, me, config.database.repair_positions,
            idempotent=True
        )
        view = dict(state.positions)
        allocated[name] = state.last_allocated
        if stream.writers is Writers.CONFIGURED:
            for writer in config.writers_of(stream):
                view.setdefault(writer, 1)
            if stream.reshardable:
                # Writers that joined by resharding (and those of a hand-over in progress).
                shards = await db.run_interaction(f"load_shard_map_{name}", load_state_txn,
                                                  config.writers_of(stream), name, idempotent=True)
                for writer in sorted(shards.writers()):
                    view.setdefault(writer, 1)
        elif stream.writers is Writers.ANY:
            # Every configured process may write: count them all from the
            # start, so the minimum stays below a writer not yet heard from.
            for instance in (*config.instance_map, *reserved):
                view.setdefault(instance, 1)
        if writes_stream(config, stream):
            if stream.recover_audit is not None and audit is not None:
                await stream.recover_audit(db, audit, me)
            # Start from what this writer is known to have completed, not from the
            # sequence: on PostgreSQL IDs a killed predecessor reserved but never
            # committed are spent, and no log or row shows they were ever
            # allocated. Claiming them would hand out a position beyond every
            # recorded reservation; the writer leaps past them once it hears
            # another writer's position (or completes a higher ID of its own).
            start = max(view.get(me, 1), state.own_max_row or 1)
            gen = MultiWriterIdGenerator(stream, me, start, reactor, audit)
            gen.persisted_position = state.positions.get(me, 0)
            generators[name] = gen
            view[me] = start
        positions[name] = view

    def persist(stream: str, position: int) -> Deferred[Any]:
        return db.run_interaction("persist_position", persist_position_txn, stream, me, position, idempotent=True)

    def fetch_allocated(stream: str) -> Deferred[int]:
        return db.run_interaction(f"stream_allocated_{stream}", last_allocated_txn, streams[stream],
                                  one_statement=True, idempotent=True)

    handler = ReplicationHandler(
        me,
        reactor,
        streams=streams,
        sources={name: DatabaseSource(db, s) for name, s in streams.items()},
        generators=generators,
        initial_positions=positions,
        audit=audit,
        tick_interval_s=config.replication.idle_announce_interval_s,
        persist=persist,
        guard=PositionGuard(fetch_allocated, allocated, reactor),
    )
    service = MultiService()
    repl = Replication(handler, StreamWriters(db, generators), service, allocated_at_start=allocated)
    service.addService(_HandlerService(handler))
    if config.replication.transport is Transport.REDIS:
        from synflow.replication.redis import RedisTransportService

        transport = RedisTransportService(config, handler, reactor, rng=rng)
        transport.setServiceParent(service)
        repl.transport = transport
    elif registry.worker_type_for(config).has(Capability.REPLICATION_HUB):
        hub = ReplicationHub(handler)
        factory = ReplicationServerFactory(hub, config.server_name, reactor, connection_options(config))
        listener = ListeningService(reactor, hub_endpoint(config), factory)
        listener.setName("replication-hub")
        listener.setServiceParent(service)
        _HubCloser(hub).setServiceParent(service)
        repl.hub = hub
        repl.transport = hub
    else:
        client = ReplicationClientService(
            clientFromString(reactor, config.replication.hub.client_endpoint()),
            server_name=config.server_name,
            instance_name=me,
            handler=handler,
            clock=reactor,
            rng=rng,
            options=connection_options(config),
        )
        client.setName("replication-client")
        client.setServiceParent(service)
        repl.client = client
        repl.transport = client
    handler.set_transport(repl.transport)
    replication_metrics.watch(handler, repl.transport)
    return repl


class _HubCloser(Service):
    """On shutdown, closes every worker connection with a reason."""

    def __init__(self, hub: ReplicationHub) -> None:
        self.hub = hub

    def stopService(self) -> None:
        super().stopService()
        self.hub.close_all("server stopping")


class _HandlerService(Service):
    def __init__(self, handler: ReplicationHandler) -> None:
        self.handler = handler

    def startService(self) -> None:
        super().startService()
        self.handler.start()

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        return self.handler.stop()
