"""An event persister and a reader process in one reactor, over one real SQLite database.

Each "process" has the production parts that matter to caching: a
:class:`~synflow.replication.handler.ReplicationHandler`, a
:class:`~synflow.storage.stores.DataStore` whose caches are registered with a
:class:`~synflow.caching.CacheRegistry`, and the same row handlers as
``SynflowProcess.setup_caches`` (caches rows and events rows). The persister
also has the real ID generators and :class:`~synflow.events.persist.EventPersister`.
The writer's commands reach the reader through a :class:`Relay` that can hold
back one stream's commands, to deliver the two streams in either order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from twisted.internet.task import Clock

from synflow import registry
from synflow.caching import CacheRegistry, TierClient
from synflow.config import CacheConfig
from synflow.events.persist import CREATE, MEMBER, EventPersister, EventSpec, PersistResult
from synflow.replication.commands import AnyCommand, PositionCommand, RdataCommand
from synflow.replication.handler import ReplicationHandler
from synflow.storage.engines import Database
from synflow.storage.id_generators import (
    MultiWriterIdGenerator,
    StreamWriters,
    load_stream_state_txn,
)
from synflow.storage.sources import DatabaseSource
from synflow.storage.stores import DataStore
from synflow.streams import Writers

SERVER = "hs"
WRITER = "persister1"


class Relay:
    """A one-way connection from the writer's handler to a reader's handler.

    Commands whose stream ``hold`` names are kept until :meth:`release`.
    """

    def __init__(self, target: ReplicationHandler) -> None:
        self.target = target
        self.hold: set[str] = set()
        self.held: list[AnyCommand] = []
        self.sent: list[AnyCommand] = []
        target.new_connection(self)

    def send_command(self, cmd: AnyCommand) -> None:
        self.sent.append(cmd)
        if isinstance(cmd, RdataCommand | PositionCommand) and cmd.stream_name in self.hold:
            self.held.append(cmd)
            return
        self.target.on_command(self, cmd)

    def release(self) -> None:
        """Deliver what was held back, in order, and stop holding."""
        self.hold = set()
        held, self.held = self.held, []
        for cmd in held:
            self.target.on_command(self, cmd)


class Fanout:
    """The writer's transport: every command goes to every relay."""

    def __init__(self) -> None:
        self.relays: list[Relay] = []

    def send_command(self, cmd: AnyCommand) -> None:
        for relay in self.relays:
            relay.send_command(cmd)


class Process:
    """One process's handler, store and caches, wired like ``setup_caches``.

    Args:
        name: the instance name.
        db: the shared database.
        clock: the handler's clock.
        generators: the streams this process writes.
        tier: the shared tier, if any (the position source is the minimum
            caches position over writers, as in the application).
    """

    def __init__(self, name: str, db: Database, clock: Clock, *,
                 generators: dict[str, MultiWriterIdGenerator] | None = None,
                 positions: dict[str, dict[str, int]] | None = None,
                 tier: TierClient | None = None) -> None:
        self.name = name
        self.handler = ReplicationHandler(
            name, clock, streams=registry.streams(), sources={n: DatabaseSource(db, s) for n, s in registry.streams().items()},
            generators=generators, initial_positions=positions,
        )
        self.store = DataStore(db)
        self.caches = CacheRegistry(
            CacheConfig(), tier=tier, clock=clock,
            position_source=lambda: min(self.handler.positions("caches").values(), default=0),
        )
        self.caches.register(self.store)
        self.handler.add_row_handler("caches", self.caches.row_handler)
        self.handler.add_row_handler("events", self.caches.events_row_handler)


class Deployment:
    """A persister (``persister1``) and reader processes over one database."""

    def __init__(self, db: Database, clock: Clock) -> None:
        self.db = db
        self.clock = clock
        self.fanout = Fanout()
        self.writer: Process
        self.writers: StreamWriters
        self.persister: EventPersister
        self._ids = itertools.count(1)
        self._positions: dict[str, dict[str, int]] = {}

    async def start(self) -> Deployment:
        """Load stream state as the application does and build the persister."""
        generators = {}
        for name, stream in registry.streams().items():
            state = await self.db.run_interaction(f"load_{name}", load_stream_state_txn, stream, WRITER, False)
            if stream.writers is Writers.DECLARED:
                continue
            start = max(state.last_allocated, 1)
            generators[name] = MultiWriterIdGenerator(stream, WRITER, start, self.clock)
            self._positions[name] = {WRITER: start}
        self.writer = Process(WRITER, self.db, self.clock, generators=generators, positions=self._positions)
        self.writer.handler.set_transport(self.fanout)
        self.writers = StreamWriters(self.db, generators)
        self.persister = EventPersister(
            self.writers, server_name=SERVER, instance_name=WRITER, event_writers=[WRITER], clock=self.clock,
            new_event_id=lambda: f"$e{next(self._ids)}:{SERVER}",
        )
        return self

    def reader(self, name: str, tier: TierClient | None = None) -> tuple[Process, Relay]:
        """A new reader process, connected to the writer (it has heard the writer's positions)."""
        positions = {stream: self.writer.handler.positions(stream) for stream in self._positions}
        process = Process(name, self.db, self.clock, positions=positions, tier=tier)
        relay = Relay(process.handler)
        self.fanout.relays.append(relay)
        self.writer.handler.new_connection(relay)
        return process, relay

    async def persist(self, *specs: EventSpec) -> list[PersistResult]:
        """Persist events through the persister; fails the test on a refused event."""
        results = await self.persister.persist(list(specs))
        for result in results:
            result.raise_error()
        return results

    async def create_room(self, room_id: str, creator: str, *, public: bool = False) -> None:
        """Create a room; a ``public`` one (with its join rule) lets anyone join."""
        rule = [state(room_id, creator, "m.room.join_rules", {"join_rule": "public"})] if public else []
        await self.persist(create(room_id, creator), member(room_id, creator, "join"), *rule)


def create(room_id: str, creator: str) -> EventSpec:
    return EventSpec(room_id, CREATE, creator, {"creator": creator}, "", SERVER, 0)


def member(room_id: str, user_id: str, membership: str, sender: str | None = None) -> EventSpec:
    return EventSpec(room_id, MEMBER, sender or user_id, {"membership": membership}, user_id, SERVER, 0)


def state(room_id: str, sender: str, event_type: str, content: dict[str, Any], state_key: str = "") -> EventSpec:
    return EventSpec(room_id, event_type, sender, content, state_key, SERVER, 0)


def message(room_id: str, sender: str, body: str) -> EventSpec:
    return EventSpec(room_id, "m.room.message", sender, {"body": body}, None, SERVER, 0)


def rdata(commands: list[AnyCommand], stream: str, where: Callable[[Any], bool] = lambda c: True) -> list[Any]:
    """The wire rows of the RDATA commands of one stream that were sent."""
    return [c.row for c in commands if isinstance(c, RdataCommand) and c.stream_name == stream and where(c)]
