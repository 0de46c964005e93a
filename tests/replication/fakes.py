"""A real replication handler whose positions a test controls, over stand-in collaborators."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed

from synflow import registry
from synflow.replication.handler import ReplicationHandler
from synflow.storage.id_generators import MultiWriterIdGenerator
from synflow.streams import EVENTS


class NoUpdates:
    """A catch-up source with nothing to fetch (positions only)."""

    def get_updates(self, instance: str, from_token: int, to_token: int, limit: int = 100) -> Deferred[Any]:
        return succeed(([], to_token, False))


class DiscardingConn:
    """A replication connection that drops every command sent on it."""

    def send_command(self, cmd: Any) -> None:
        pass


def positions_view(
    name: str, clock: Any, *, own: int | None = None, known: dict[str, int] | None = None
) -> tuple[ReplicationHandler, DiscardingConn]:
    """A replication handler for ``name`` (writing ``events`` at ``own`` if given, knowing
    the ``events`` writers at ``known``) and the connection it is on."""
    generators = {"events": MultiWriterIdGenerator(EVENTS, name, own, clock)} if own is not None else {}
    handler = ReplicationHandler(name, clock, streams=registry.streams(), sources={"events": NoUpdates()},
                                 generators=generators, initial_positions={"events": dict(known or {})})
    conn = DiscardingConn()
    handler.new_connection(conn)
    return handler, conn
