"""Multi-writer stream IDs against real databases: positions, start-up checks, writes.

Every test runs on SQLite and on PostgreSQL (one subclass per engine).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from synflow import registry
from synflow.errors import InconsistentPositionsError
from synflow.replication.handler import ReplicationHandler
from synflow.storage.engines import Database, Txn
from synflow.storage.id_generators import (
    MultiWriterIdGenerator,
    StreamState,
    StreamWriteContext,
    StreamWriters,
    bump_sequence_txn,
    ensure_sequences_txn,
    last_allocated_txn,
    load_stream_state_txn,
    persist_position_txn,
)
from synflow.streams import EVENTS, EventsRow
from tests.dbutil import make_database

WRITER = "persister1"


def insert_event_txn(txn: Txn, stream_ordering: int, instance: str, event_id: str | None = None,
                     room_id: str = "!r:hs") -> None:
    """Insert one minimal ``events`` row (what a catch-up or a start-up check reads)."""
    txn.execute(
        "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, sender, content, "
        "origin_server_ts, origin, depth, received_ts) "
        "VALUES (?, ?, ?, ?, 'm.room.message', '@u:hs', '{}', 0, 'hs', 1, 0)",
        (stream_ordering, instance, event_id or f"$e{stream_ordering}:hs", room_id),
    )


def positions_txn(txn: Txn) -> dict[tuple[str, str], int]:
    txn.execute("SELECT stream_name, instance_name, stream_id FROM stream_positions")
    return {(s, i): int(p) for s, i, p in txn.fetchall()}


def write_events(ctx: StreamWriteContext, n: int, fail: bool = False) -> list[int]:
    """A writing ``_txn`` function: ``n`` events, then optionally an error (a rollback)."""
    ids = ctx.allocate("events", n)
    for sid in ids:
        insert_event_txn(ctx.txn, sid, WRITER)
        ctx.add_rows("events", sid, [EventsRow(f"$e{sid}:hs", "!r:hs", "m.room.message", None, "@u:hs", None)],
                     room_id="!r:hs", event_id=f"$e{sid}:hs")
    if fail:
        raise Boom("the write failed")
    return ids


class Boom(Exception):
    """Raised inside a write to roll it back."""


class IdGeneratorTestsMixin:
    """Behaviour of the ID generator's SQL that must hold on every engine."""

    engine: str

    async def _db(self) -> Database:
        return await make_database(self, self.engine)

    async def test_missing_sequences_created_once(self) -> None:
        """A plugin stream's sequence is created on first start (first ID 2, like synflow's own); existing ones,
        and a second start, create nothing."""
        import attrs

        db = await self._db()
        plugin = attrs.evolve(EVENTS, name="plugin_notes", sequence="plugin_notes_seq")
        streams = [EVENTS, plugin]
        self.assertEqual(await db.run_interaction("ensure", ensure_sequences_txn, streams), ["plugin_notes"])
        self.assertEqual(await db.run_interaction("ensure", ensure_sequences_txn, streams), [])
        self.assertEqual(await db.run_interaction("last", last_allocated_txn, plugin), 1)

    async def _load(self, db: Database, repair: bool = False, instance: str = WRITER) -> StreamState:
        return await db.run_interaction("load", load_stream_state_txn, EVENTS, instance, repair)

    async def _writer(self, db: Database, instance: str = WRITER) -> tuple[MultiWriterIdGenerator, StreamWriters]:
        """A generator started the way the application starts one, and its StreamWriters."""
        state = await self._load(db, instance=instance)
        start = max(state.last_allocated, state.positions.get(instance, 1), state.own_max_row or 1)
        gen = MultiWriterIdGenerator(EVENTS, instance, start, Clock())
        return gen, StreamWriters(db, {"events": gen})

    # -- stream_positions ------------------------------------------------------------------

    async def test_persist_position_only_moves_forward(self) -> None:
        """Persisting 10 then 5 leaves 10; a higher position replaces it; other rows are untouched."""
        db = await self._db()
        await db.run_interaction("p", persist_position_txn, "events", WRITER, 10)
        await db.run_interaction("p", persist_position_txn, "events", WRITER, 5)
        await db.run_interaction("p", persist_position_txn, "events", "persister2", 3)
        await db.run_interaction("p", persist_position_txn, "caches", WRITER, 7)
        self.assertEqual(await db.run_interaction("read", positions_txn), {
            ("events", WRITER): 10, ("events", "persister2"): 3, ("caches", WRITER): 7,
        })
        await db.run_interaction("p", persist_position_txn, "events", WRITER, 12)
        self.assertEqual((await db.run_interaction("read", positions_txn))[("events", WRITER)], 12)

    # -- start-up checks ------------------------------------------------------------------------

    async def test_consistent_state_loads_cleanly(self) -> None:
        """After real writes, start-up finds no problem even with repair off, and reports what it read."""
        db = await self._db()
        gen, writers = await self._writer(db)
        first = await writers.run_write("w", ["events"], write_events, 3)
        await db.run_interaction("p", persist_position_txn, "events", WRITER, gen.position)
        await db.run_interaction("p", persist_position_txn, "events", "persister2", first[0])
        state = await self._load(db, repair=False)
        self.assertEqual(state, StreamState(
            last_allocated=first[-1], positions={WRITER: first[-1], "persister2": first[0]},
            own_max_row=first[-1], repairs=(),
        ))
        self.assertEqual((await self._load(db, instance="persister2")).own_max_row, None)

    async def test_sequence_behind_rows_refused(self) -> None:
        """A table row above the sequence stops start-up (repair off) with what is wrong and how to fix it."""
        db = await self._db()
        await db.run_interaction("insert", insert_event_txn, 50, "persister2")
        e = await self.assertFailure(
            db.run_interaction("load", load_stream_state_txn, EVENTS, WRITER, False), InconsistentPositionsError
        )
        message = str(e)
        self.assertIn("stream 'events' is inconsistent", message)
        self.assertIn("the events table holds stream ID 50 but the sequence has only handed out up to 1", message)
        self.assertIn("set database.repair_positions: true", message)
        self.assertIn(self.hand_fix(50), message)
        # Nothing was changed: the sequence is still behind.
        self.assertEqual(await db.run_interaction("last", last_allocated_txn, EVENTS), 1)

    async def test_sequence_behind_rows_repaired(self) -> None:
        """With repair on, start-up reports the repair and the next ID allocated is above the row."""
        db = await self._db()
        await db.run_interaction("insert", insert_event_txn, 50, "persister2")
        state = await self._load(db, repair=True)
        self.assertEqual(state.last_allocated, 50)
        self.assertEqual(len(state.repairs), 1)
        self.assertIn("holds stream ID 50", state.repairs[0])
        self.assertEqual((await self._load(db, repair=False)).repairs, ())  # the repair was committed
        _, writers = await self._writer(db)
        self.assertEqual(await writers.run_write("w", ["events"], write_events, 2), [51, 52])

    async def test_bump_only_moves_the_sequence_forward(self) -> None:
        """Bumping to a value behind the sequence leaves it where it is; bumping past it moves it there."""
        db = await self._db()
        _, writers = await self._writer(db)
        taken = await writers.run_write("w", ["events"], write_events, 5)
        await db.run_interaction("bump", bump_sequence_txn, EVENTS, taken[0])
        self.assertEqual(await db.run_interaction("last", last_allocated_txn, EVENTS), taken[-1])
        await db.run_interaction("bump", bump_sequence_txn, EVENTS, taken[-1] + 10)
        self.assertEqual(await db.run_interaction("last", last_allocated_txn, EVENTS), taken[-1] + 10)

    async def test_sequence_behind_positions_refused(self) -> None:
        """A stream_positions row above the sequence stops start-up (repair off), naming the writer."""
        db = await self._db()
        await db.run_interaction("p", persist_position_txn, "events", "persister2", 80)
        e = await self.assertFailure(
            db.run_interaction("load", load_stream_state_txn, EVENTS, WRITER, False), InconsistentPositionsError
        )
        message = str(e)
        self.assertIn("stream_positions says 'persister2' reached 80 but the sequence has only handed out up to 1",
                      message)
        self.assertIn("set database.repair_positions: true", message)
        self.assertIn(self.hand_fix(80), message)

    async def test_sequence_behind_positions_repaired(self) -> None:
        """With repair on, a position above the sequence moves the sequence past it."""
        db = await self._db()
        await db.run_interaction("p", persist_position_txn, "events", "persister2", 80)
        await db.run_interaction("insert", insert_event_txn, 60, "persister2")
        state = await self._load(db, repair=True)
        self.assertEqual(len(state.repairs), 2)
        self.assertEqual(state.last_allocated, 80)
        _, writers = await self._writer(db)
        self.assertEqual(await writers.run_write("w", ["events"], write_events, 1), [81])

    # -- writing ---------------------------------------------------------------------------------

    async def test_rolled_back_write_burns_its_ids(self) -> None:
        """A write that raises completes its IDs as aborted; the position passes them and they are never reused."""
        db = await self._db()
        gen, writers = await self._writer(db)
        ok = await writers.run_write("w", ["events"], write_events, 2)
        await self.assertFailure(writers.run_write("w", ["events"], write_events, 2, fail=True), Boom)
        self.assertEqual(gen.position, ok[-1] + 2)
        self.assertEqual(gen.facts_aborted, 2)
        after = await writers.run_write("w", ["events"], write_events, 1)
        self.assertEqual(after, [ok[-1] + 3])
        state = await self._load(db)
        self.assertEqual((state.own_max_row, state.last_allocated), (after[0], after[0]))

    async def test_stop_persists_the_writer_position(self) -> None:
        """Stopping a writer's handler stores its position in stream_positions, for the next start-up."""
        db = await self._db()
        gen, writers = await self._writer(db)

        def persist(stream: str, position: int) -> Deferred[Any]:
            return db.run_interaction("persist_position", persist_position_txn, stream, WRITER, position)

        clock = Clock()
        handler = ReplicationHandler(WRITER, clock, streams=registry.streams(), sources={}, generators={"events": gen},
                                     persist=persist)
        handler.start()
        ids = await writers.run_write("w", ["events"], write_events, 3)
        self.assertEqual(await db.run_interaction("read", positions_txn), {})  # no tick has run yet
        await handler.stop()
        self.assertEqual(await db.run_interaction("read", positions_txn), {("events", WRITER): ids[-1]})
        self.assertEqual((await self._load(db)).positions, {WRITER: ids[-1]})

    def hand_fix(self, target: int) -> str:
        """The SQL the refusal message suggests for moving the sequence by hand."""
        raise NotImplementedError


    async def test_full_audit_disk_never_fails_a_committed_write(self) -> None:
        """With the audit disk full, a write over two streams succeeds and both streams' positions move."""
        import errno
        import os

        from synflow import audit_files
        from synflow.audit import AuditLog

        def full(fd: int, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        self.patch(audit_files, "os_write", full)  # type: ignore[attr-defined]
        db = await self._db()
        clock = Clock()
        audit = AuditLog(os.path.abspath(self.mktemp()), WRITER, clock)  # type: ignore[attr-defined]
        self.addCleanup(audit.close)  # type: ignore[attr-defined]
        state = await self._load(db)
        events = MultiWriterIdGenerator(EVENTS, WRITER, max(state.last_allocated, 1), clock, audit)
        caches_start = await db.run_interaction("last", last_allocated_txn, registry.streams()["caches"])
        caches = MultiWriterIdGenerator(registry.streams()["caches"], WRITER, caches_start, clock, audit)
        announced: dict[str, int] = {}
        events.add_listener(lambda facts, pos: announced.__setitem__("events", pos))
        caches.add_listener(lambda facts, pos: announced.__setitem__("caches", pos))
        writers = StreamWriters(db, {"events": events, "caches": caches})

        def both(ctx: StreamWriteContext) -> tuple[list[int], list[int]]:
            return write_events(ctx, 2), ctx.allocate("caches", 1)

        event_ids, cache_ids = await writers.run_write("w", ["events", "caches"], both)
        self.assertEqual((events.position, caches.position), (max(event_ids), max(cache_ids)))
        self.assertEqual(announced, {"events": max(event_ids), "caches": max(cache_ids)})
        self.assertIsNotNone(audit.problem)
        # The next write works as well: no fetch was left open.
        (more,) = [await writers.run_write("w", ["events"], write_events, 1)]
        self.assertEqual(events.position, max(more))


class SqliteIdGeneratorTests(IdGeneratorTestsMixin, TestCase):
    engine = "sqlite"

    def hand_fix(self, target: int) -> str:
        return f"UPDATE stream_sequences SET last_id = {target} WHERE stream_name = 'events'"

    async def test_failed_commit_gives_ids_back_without_breaking_the_tracker(self) -> None:
        """When the commit itself fails, the sequence bump rolls back too: the IDs are reused, once, without error."""
        db = await self._db()
        gen, writers = await self._writer(db)

        def deferred_fk_txn(txn: Txn) -> None:
            txn.execute_raw("CREATE TABLE fk_parent (id INTEGER PRIMARY KEY)")
            txn.execute_raw(
                "CREATE TABLE fk_child (parent INTEGER REFERENCES fk_parent (id) DEFERRABLE INITIALLY DEFERRED)"
            )

        await db.run_interaction("schema", deferred_fk_txn)

        def write_then_break_commit(ctx: StreamWriteContext) -> list[int]:
            ids = write_events(ctx, 2)
            # A deferred foreign key is only checked at COMMIT, after the
            # savepoint holding the sequence bump was released.
            ctx.txn.execute("INSERT INTO fk_child (parent) VALUES (?)", (999,))
            return ids

        import sqlite3

        await self.assertFailure(writers.run_write("w", ["events"], write_then_break_commit), sqlite3.IntegrityError)
        self.assertEqual(gen.position, 1)  # nothing was allocated: the transaction took its bump with it
        self.assertEqual(await db.run_interaction("last", last_allocated_txn, EVENTS), 1)
        self.assertEqual(await writers.run_write("w", ["events"], write_events, 2), [2, 3])
        self.assertEqual(gen.position, 3)


class _Interleaved:
    """A Txn whose every statement is preceded by ``before()`` (another connection's work)."""

    def __init__(self, txn: Txn, before: Any) -> None:
        self._txn = txn
        self._before = before

    def execute(self, sql: str, args: Any = ()) -> None:
        self._before()
        self._txn.execute(sql, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class PostgresIdGeneratorTests(IdGeneratorTestsMixin, TestCase):
    engine = "postgres"

    def hand_fix(self, target: int) -> str:
        return f"SELECT setval('events_stream_seq', {target})"

    async def test_a_writer_committing_during_start_up_is_no_inconsistency(self) -> None:
        """Another writer taking an ID, inserting its row and persisting its position before each statement of
        the start-up check is not taken for a sequence behind its rows: nothing is refused (repair off) or
        repaired (repair on), and the sequence never goes back under the writer."""
        import psycopg2

        db = await self._db()
        config = db.config
        other = psycopg2.connect(host=config.host, port=config.port, user=config.user, dbname=config.dbname)
        other.autocommit = True
        self.addCleanup(other.close)
        taken: list[int] = []

        def commit_one() -> None:
            with other.cursor() as cursor:
                txn = Txn(cursor, db.engine, "other writer")
                txn.execute("SELECT nextval('events_stream_seq')")
                sid = int(txn.fetchone()[0])  # type: ignore[index]
                insert_event_txn(txn, sid, "persister2")
                persist_position_txn(txn, "events", "persister2", sid)
            taken.append(sid)

        for repair in (False, True):
            state = await db.run_interaction(
                "load", lambda txn, r=repair: load_stream_state_txn(_Interleaved(txn, commit_one), EVENTS, WRITER, r))
            self.assertEqual(state.repairs, ())
            self.assertEqual(state.last_allocated, taken[-1])
            self.assertIn(state.positions["persister2"], taken[:-1])  # read before the sequence
        commit_one()
        self.assertEqual(taken, list(range(taken[0], taken[0] + len(taken))))  # each ID once, none reused
