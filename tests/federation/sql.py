"""Real databases for the federation tests: events written by persist.py's own SQL.

:func:`persist` runs :func:`synflow.events.persist.persist_events_txn` -- the
transaction an event persister runs, which writes ``events`` (with the
remote servers in the room at each event) and ``destination_rooms`` -- on a
real SQLite or PostgreSQL database. The only stand-in is :class:`ChosenIds`,
which hands out the events-stream IDs the test chooses instead of taking
them from the stream's sequence, so a test decides which writer completes
which ID, and in which order the writers' transactions commit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater

from synflow.events.persist import MEMBER, EventSpec, PersistResult, persist_events_txn, server_of
from synflow.storage.engines import Database, Txn

SERVER = "local.test"

_cache_ids = itertools.count(10**9)


class ChosenIds:
    """A ``StreamWriteContext`` stand-in: events-stream IDs come from the test, in order."""

    def __init__(self, txn: Txn, ids: Sequence[int]) -> None:
        self.txn = txn
        self._ids = list(ids)

    def allocate(self, stream: str, n: int = 1) -> list[int]:
        if stream != "events":
            return [next(_cache_ids) for _ in range(n)]
        if len(self._ids) < n:
            raise AssertionError(f"the test gave {len(self._ids)} more IDs, persist needs {n}")
        out, self._ids = self._ids[:n], self._ids[n:]
        return out

    def add_rows(self, *args: Any, **kwargs: Any) -> None:
        pass  # replication is not under test here


async def persist(db: Database, writer: str, events: Sequence[tuple[int, EventSpec]]) -> list[PersistResult]:
    """Persist ``(stream_id, spec)`` pairs as ``writer`` in one transaction; every one must be accepted."""
    ids = [i for i, _ in events]
    specs = [s for _, s in events]
    local_ids = [s.event_id or f"$so{i}:{SERVER}" for i, s in events]

    def write_txn(txn: Txn) -> list[PersistResult]:
        return persist_events_txn(ChosenIds(txn, ids), specs, local_ids, server_name=SERVER,
                                  instance_name=writer, now_ms=1_000)

    results: list[PersistResult] = await db.run_interaction("test_persist", write_txn)
    for spec, result in zip(specs, results, strict=True):
        if result.error is not None or result.duplicate:
            raise AssertionError(f"{spec} was not persisted: {result}")
    return results


def create_room(room: str, creator: str) -> list[EventSpec]:
    """The local creation of ``room`` and its creator's join."""
    return [
        EventSpec(room, "m.room.create", creator, {"creator": creator}, state_key="", origin=SERVER),
        member(room, creator, "join"),
    ]


def member(room: str, user: str, membership: str, *, sender: str | None = None) -> EventSpec:
    """A membership event; a remote user's own is a PDU from its server (with an event ID)."""
    sender = sender or user
    origin = server_of(sender)
    event_id = None if origin == SERVER else f"${membership}-{user}-{room}"
    return EventSpec(room, MEMBER, sender, {"membership": membership}, state_key=user, origin=origin,
                     event_id=event_id)


def message(room: str, sender: str, body: str) -> EventSpec:
    """A local message."""
    return EventSpec(room, "m.room.message", sender, {"body": body}, origin=SERVER, origin_server_ts=5)


async def until(predicate: Callable[[], object], what: str, timeout: float = 15.0,
                show: Callable[[], object] | None = None) -> None:
    """Wait (on the real reactor: database work runs on threads) until ``predicate()`` is true.

    Raises:
        AssertionError: not true within ``timeout`` seconds (with ``show()``, if given).
    """
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await deferLater(reactor, 0.01, lambda: None)
    seen = f"; got {show()}" if show is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{seen}")

