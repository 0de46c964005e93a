"""synflow's own streams and worker types run the conformance kit, and the kit catches broken plugins.

Each built-in stream is written here the way synflow writes it (the
production writing functions for ``caches`` and ``federation``, every
NOT NULL column for ``events``); a plugin stream with its own migrations
and a plugin worker type with a config section (installed as a throwaway
distribution) take the default paths. The last tests hand the kit broken
definitions and expect its tests to fail.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow import registry
from synflow.events.persist import write_invalidations_txn
from synflow.federation.edus import queue_edus_txn
from synflow.framework import WorkerType
from synflow.storage.id_generators import StreamWriteContext
from synflow.streams import (
    CACHES,
    EVENTS,
    FEDERATION,
    CachesRow,
    EventsRow,
    FederationRow,
    StreamRowError,
)
from synflow.testing.conformance import StreamConformance, WorkerTypeConformance
from tests.plugins import install_fake_distribution

TS = 1_700_000_000_000


class _DroppingRow(EventsRow):
    """An events row whose wire form loses its membership (and reads back without one)."""

    def to_wire(self) -> list[Any]:
        return super().to_wire()[:-1]

    @classmethod
    def from_wire(cls, row: list[Any]) -> _DroppingRow:
        if not isinstance(row, list) or len(row) != 5:
            raise StreamRowError("need 5 items")
        return cls(*row, None)


class _LenientRow(EventsRow):
    """An events row that accepts any wire row at all."""

    @classmethod
    def from_wire(cls, row: Any) -> _LenientRow:
        return cls("$any:hs", "!any:hs", "m.room.message", None, "@any:hs", None)


class EventsConformanceTest(StreamConformance, TestCase):
    stream = EVENTS
    writer_names = ("persister1", "persister2")  # !a shards to persister1, !d and !f to persister2

    def sample_rows(self) -> list[Any]:
        return [
            EventsRow("$create:hs", "!a:hs", "m.room.create", "", "@alice:hs", None),
            EventsRow("$join:hs", "!a:hs", "m.room.member", "@alice:hs", "@alice:hs", "join"),
            EventsRow("$msg1:hs", "!d:hs", "m.room.message", None, "@bob:hs", None),
            EventsRow("$invite:hs", "!d:hs", "m.room.member", "@zoë:other", "@bob:hs", "invite"),
            EventsRow("$msg2:hs", "!f:hs", "m.room.message", None, "@carol:hs", None),
            EventsRow("$topic:hs", "!f:hs", "m.room.topic", "", "@carol:hs", None),
        ]

    def write_rows_txn(self, ctx: StreamWriteContext, instance_name: str, rows: Sequence[Any]) -> Sequence[int]:
        ids = ctx.allocate("events", len(rows))
        for sid, row in zip(ids, rows, strict=True):
            ctx.txn.execute(
                "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
                "membership, content, origin_server_ts, origin, depth, received_ts) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{}', ?, 'hs', ?, ?)",
                (sid, instance_name, row.event_id, row.room_id, row.type, row.state_key, row.sender,
                 row.membership, TS, sid, TS),
            )
            ctx.add_rows("events", sid, [row], room_id=row.room_id, event_id=row.event_id)
        return ids

    # The kit fails broken definitions of the stream (so passing it means something).

    def test_round_trip_fails_when_to_wire_drops_a_field(self) -> None:
        """A row type whose wire form loses a field fails the round-trip test."""
        self.stream = attrs.evolve(EVENTS, row_type=_DroppingRow)
        self.sample_rows = lambda: [_DroppingRow(*attrs.astuple(r)) for r in EventsConformanceTest.sample_rows(self)]
        self.assertRaises(self.failureException, self.test_conformance_rows_round_trip_the_wire)

    def test_malformed_fails_when_from_wire_accepts_anything(self) -> None:
        """A row type that accepts malformed rows fails the malformed-row test."""
        self.stream = attrs.evolve(EVENTS, row_type=_LenientRow)
        self.sample_rows = lambda: [_LenientRow(*attrs.astuple(r)) for r in EventsConformanceTest.sample_rows(self)]
        self.assertRaises(self.failureException, self.test_conformance_malformed_rows_are_refused)

    async def test_positions_fail_when_a_row_is_announced_but_never_written(self) -> None:
        """A writer that announces a row its transaction never inserted fails the after-commit test."""
        real = self.write_rows_txn

        def phantom(ctx: StreamWriteContext, instance_name: str, rows: Sequence[Any]) -> Sequence[int]:
            ids = real(ctx, instance_name, rows)
            (extra,) = ctx.allocate("events", 1)
            row = rows[0]
            ctx.add_rows("events", extra, [attrs.evolve(row, event_id=f"$phantom{extra}:hs")], room_id=row.room_id)
            return ids

        self.write_rows_txn = phantom
        await self.assertFailure(
            Deferred.fromCoroutine(self.test_conformance_positions_after_commit_and_monotonic()),
            self.failureException)

    async def test_catch_up_fails_when_row_from_db_is_wrong(self) -> None:
        """A stream whose row_from_db misreads its columns fails the catch-up test."""
        self.stream = attrs.evolve(EVENTS, row_from_db=lambda cols: EventsRow(*cols[:-1], None))
        await self.assertFailure(
            Deferred.fromCoroutine(self.test_conformance_reader_catches_up_after_missing_rows()),
            self.failureException)


class CachesConformanceTest(StreamConformance, TestCase):
    stream = CACHES
    writer_names = ("master", "persister1")

    def sample_rows(self) -> list[Any]:
        return [
            CachesRow("get_user_by_id", ("@alice:hs",), TS),
            CachesRow("get_rooms_for_user", None, TS + 1),
            CachesRow("cs_cache_fake", ("!a:hs", "@bob:hs", "@zoë:other"), TS + 2),
            CachesRow("get_users_in_room", ("!a:hs",), TS + 3),
        ]

    def write_rows_txn(self, ctx: StreamWriteContext, instance_name: str, rows: Sequence[Any]) -> Sequence[int]:
        write_invalidations_txn(ctx, instance_name, rows)
        return ctx.allocated["caches"]


class FederationConformanceTest(StreamConformance, TestCase):
    stream = FEDERATION
    writer_names = ("master",)

    def sample_rows(self) -> list[Any]:
        return [
            FederationRow("other.example", "m.typing", {"room_id": "!a:hs", "user_id": "@alice:hs", "typing": True}),
            FederationRow("third.example", "m.receipt", {"!a:hs": {"m.read": {"@bob:hs": {
                "event_ids": ["$msg1:hs"], "data": {"ts": TS}}}}}),
            FederationRow("other.example", "m.presence", {"push": [{"user_id": "@zoë:hs", "presence": "online",
                                                                   "last_active_ago": 1.5}]}),
            FederationRow("other.example", "m.direct_to_device", {}),
        ]

    def write_rows_txn(self, ctx: StreamWriteContext, instance_name: str, rows: Sequence[Any]) -> Sequence[int]:
        return queue_edus_txn(ctx, instance_name, [(r.destination, r.edu_type, r.content) for r in rows])


class MasterConformanceTest(WorkerTypeConformance, SynchronousTestCase):
    worker_type = registry.worker_type("master")


class EventPersisterConformanceTest(WorkerTypeConformance, SynchronousTestCase):
    worker_type = registry.worker_type("event_persister")


class FederationSenderConformanceTest(WorkerTypeConformance, SynchronousTestCase):
    worker_type = registry.worker_type("federation_sender")


class CacheInvalidatorConformanceTest(WorkerTypeConformance, SynchronousTestCase):
    worker_type = registry.worker_type("cache_invalidator")


# -- a plugin: its own stream table (migrations) and a worker type with a config section ---------

NOTES_MODULE = "conformance_notes_plugin"
NOTES_SOURCE = '''
import attrs
from synflow import api


@attrs.frozen
class NoteRow:
    room_id: str
    text: str

    def to_wire(self) -> list[str]:
        return [self.room_id, self.text]

    @classmethod
    def from_wire(cls, row: list[object]) -> "NoteRow":
        return cls(*api.strings(row, 2))


NOTES = api.Stream(
    name="conformance_notes", row_type=NoteRow, table="conformance_notes", id_column="stream_id",
    instance_column="instance_name", select=("room_id", "text"), sequence="conformance_notes_seq",
    writers=api.Writers.CONFIGURED, shard_key=lambda row: row.room_id, default_writers=("master",),
    schema=api.schema_dir(__name__, "conformance_notes_schema"),
)


@attrs.frozen
class NotesConfig:
    max_len: int = attrs.field(default=100, validator=api.positive)
    greeting: str = "hello"


class NoteWriter(api.WorkerType):
    name = "conformance_note_writer"
    summary = "writes notes, sharded by room"
    config = api.Section("conformance_notes", NotesConfig)
    writes = (NOTES,)
    follows = ("events",)
'''
NOTES_SCHEMA = """\
CREATE TABLE conformance_notes (
    stream_id BIGINT NOT NULL PRIMARY KEY,
    instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL,
    text TEXT NOT NULL
);
CREATE INDEX conformance_notes_writer ON conformance_notes (instance_name, stream_id);
"""


def install_notes_plugin(testcase: Any) -> None:
    """Install the notes plugin (its stream and worker type registered) until the test ends."""
    root = install_fake_distribution(
        testcase, "conformance-notes", {NOTES_MODULE: NOTES_SOURCE},
        apps={"conformance_note_writer": f"{NOTES_MODULE}:NoteWriter"},
        streams={"conformance_notes": f"{NOTES_MODULE}:NOTES"},
    )
    schema = os.path.join(root, "conformance_notes_schema")
    os.makedirs(schema)
    with open(os.path.join(schema, "0001_notes.sql"), "w", encoding="utf-8") as f:
        f.write(NOTES_SCHEMA)
    registry.discover(refresh=True)


class PluginStreamConformanceTest(StreamConformance, TestCase):
    """A plugin stream: its table from its own migrations, rows written by the default ``write_rows_txn``."""

    writer_names = ("notes1", "notes2", "notes3")  # the rooms below shard over all three

    def setUp(self) -> None:
        install_notes_plugin(self)
        self.stream = registry.streams()["conformance_notes"]

    def sample_rows(self) -> list[Any]:
        row_type: Any = self.stream.row_type
        return [row_type(f"!{room}:hs", text) for room, text in
                (("a", "first"), ("c", "second"), ("a", "third, with spaces"), ("e", "ünïcödé"), ("i", ""))]


class PluginWorkerTypeConformanceTest(WorkerTypeConformance, SynchronousTestCase):
    """A plugin worker type with a config section."""

    config_yaml = "conformance_notes:\n  max_len: 5\n  greeting: hi\n"

    def setUp(self) -> None:
        install_notes_plugin(self)
        self.worker_type = registry.worker_type("conformance_note_writer")


# -- the kit fails broken plugins ----------------------------------------------------------------------


class KitDetectsBrokenWorkerTypesTest(SynchronousTestCase):
    def _fails(self, worker_type: type[WorkerType], test: str) -> None:
        class Probe(WorkerTypeConformance, SynchronousTestCase):
            pass

        probe = Probe(test)
        probe.worker_type = worker_type
        self.assertRaises(probe.failureException, getattr(probe, test))

    def test_description_and_registration_are_checked(self) -> None:
        """A type without a summary, one not registered, or another class under a registered name fails the kit."""

        class Unsummarised(WorkerType):
            name = "unsummarised"

        class Follower(WorkerType):
            name = "conformance_unregistered"
            summary = "follows a stream nobody declared"
            follows = ("no_such_stream",)

        class Impostor(WorkerType):
            name = "master"
            summary = "not the registered master"

        self._fails(Unsummarised, "test_conformance_worker_type_is_described")
        self._fails(Follower, "test_conformance_worker_type_is_registered")
        self._fails(Impostor, "test_conformance_worker_type_is_registered")
