"""Tests for synflow.storage.engines: config, SQL dialects and the Database pool.

The Database tests run against real SQLite files and real PostgreSQL
databases, once per engine.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.enterprise.adbapi import ConnectionLost
from twisted.internet import protocol, reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.logger import globalLogPublisher
from twisted.python import threadable
from twisted.trial.unittest import SynchronousTestCase, TestCase

import synflow
from synflow.errors import ConfigError, StorageError
from synflow.storage.engines import (
    MAX_RETRIES,
    Database,
    DatabaseConfig,
    Txn,
    create_database,
    get_engine,
    pg_literal,
    plain_pg_literals,
    scan_sql,
)
from tests.dbutil import database_config, make_database

PG = get_engine("postgres")
SQLITE = get_engine("sqlite")


async def drive(clock: Clock, d: Deferred[Any], step: float) -> int:
    """Advance ``clock`` by ``step`` whenever something waits on it, until ``d`` fires.

    Database work runs on real threads, so between advances the real reactor
    gets to run. Returns how many times the clock was advanced.
    """
    advances = 0
    while not d.called:
        if clock.getDelayedCalls():
            clock.advance(step)
            advances += 1
        else:
            await deferLater(reactor, 0.005, lambda: None)
    return advances


class PlaceholderTests(SynchronousTestCase):
    """SQL written with ``?`` placeholders becomes each driver's style."""

    def test_postgres_placeholders(self) -> None:
        """Each ``?`` in code becomes ``%s`` for psycopg2."""
        self.assertEqual(
            PG.convert_placeholders("SELECT a FROM t WHERE b = ? AND c IN (?, ?)"),
            "SELECT a FROM t WHERE b = %s AND c IN (%s, %s)",
        )

    def test_postgres_literal_percent_is_escaped(self) -> None:
        """A literal ``%`` anywhere (code, strings, comments) is doubled, as psycopg2 requires."""
        self.assertEqual(
            PG.convert_placeholders("SELECT 7 % 2, '50%' -- 100%\nFROM t WHERE a LIKE ?"),
            "SELECT 7 %% 2, '50%%' -- 100%%\nFROM t WHERE a LIKE %s",
        )

    def test_postgres_question_marks_in_literals_are_kept(self) -> None:
        """A ``?`` inside strings, quoted identifiers, comments or dollar quotes stays a ``?``."""
        sql = (
            "SELECT 'what?', \"col?\", E'it\\'s ?', $$ ? $$, $f$ ? $f$, ? /* ? */ -- ?\n"
            "FROM t WHERE x = ?"
        )
        self.assertEqual(
            PG.convert_placeholders(sql),
            "SELECT 'what?', \"col?\", E'it\\'s ?', $$ ? $$, $f$ ? $f$, %s /* ? */ -- ?\n"
            "FROM t WHERE x = %s",
        )

    def test_postgres_doubled_quote_in_string(self) -> None:
        """A doubled ``''`` inside a string does not end the literal early."""
        self.assertEqual(PG.convert_placeholders("SELECT 'it''s ?', ?"), "SELECT 'it''s ?', %s")

    def test_postgres_dollar_in_identifier_is_not_a_quote(self) -> None:
        """A ``$`` inside an identifier does not start a dollar quote."""
        self.assertEqual(PG.convert_placeholders("SELECT a$b$ FROM t WHERE c = ?"),
                         "SELECT a$b$ FROM t WHERE c = %s")

    def test_sqlite_unchanged(self) -> None:
        """SQLite takes ``?`` natively, so its SQL is passed through untouched."""
        sql = "SELECT '50%', ? WHERE a LIKE '%?'"
        self.assertEqual(SQLITE.convert_placeholders(sql), sql)

    @given(st.text(alphabet="ab'\"%$-/*\n ;?eE"))
    def test_postgres_conversion_round_trips(self, sql: str) -> None:
        """Interpolating the converted SQL with ``?`` values gives back the original text."""
        converted = PG.convert_placeholders(sql)
        count = converted.replace("%%", "").count("%s")
        self.assertEqual(converted % (("?",) * count), sql)

    @given(st.text(alphabet="ab'\"`%$-/*\n ;?eE"))
    def test_scan_pieces_join_to_input(self, sql: str) -> None:
        """Scanning splits SQL into pieces that join back to the input, on both dialects."""
        for engine in ("sqlite", "postgres"):
            self.assertEqual("".join(text for _, text in scan_sql(sql, engine)), sql)

    def test_greatest(self) -> None:
        """``greatest`` is ``MAX(a, b)`` on SQLite and ``GREATEST(a, b)`` on PostgreSQL."""
        self.assertEqual(SQLITE.greatest("a", "?"), "MAX(a, ?)")
        self.assertEqual(PG.greatest("a", "?"), "GREATEST(a, ?)")


class TransientErrorTests(SynchronousTestCase):
    """Each engine tells errors worth retrying from the rest."""

    def test_sqlite_locked_is_transient(self) -> None:
        """SQLite's "database is locked" is transient; a syntax error is not."""
        self.assertTrue(SQLITE.is_transient(sqlite3.OperationalError("database is locked")))
        self.assertFalse(SQLITE.is_transient(sqlite3.OperationalError('near "SELEC": syntax error')))
        self.assertFalse(SQLITE.is_transient(sqlite3.IntegrityError("UNIQUE constraint failed")))

    def test_postgres_lost_connection_is_transient(self) -> None:
        """A lost connection (OperationalError without SQLSTATE, InterfaceError) is transient."""
        import psycopg2
        import psycopg2.errors

        self.assertTrue(PG.is_transient(psycopg2.OperationalError("server closed the connection")))
        self.assertTrue(PG.is_transient(psycopg2.InterfaceError("connection already closed")))
        self.assertFalse(PG.is_transient(psycopg2.errors.UniqueViolation("duplicate key")))
        self.assertFalse(PG.is_transient(ValueError("not a database error")))

    def test_unknown_engine(self) -> None:
        """Asking for an engine synflow lacks is a StorageError naming it."""
        e = self.assertRaises(StorageError, get_engine, "oracle")
        self.assertIn("'oracle'", str(e))


class DatabaseConfigTests(SynchronousTestCase):
    """DatabaseConfig defaults, validation and loading from YAML mappings."""

    def test_pool_size_defaults_per_engine(self) -> None:
        """SQLite defaults to one connection, PostgreSQL to five."""
        self.assertEqual(DatabaseConfig().cp_max, 1)
        self.assertEqual(DatabaseConfig(engine="postgres").cp_max, 5)
        self.assertEqual(DatabaseConfig.from_dict({"engine": "postgres"}).cp_max, 5)

    def test_memory_database_needs_one_connection(self) -> None:
        """``:memory:`` is refused with more than one pool connection and allowed with one."""
        e = self.assertRaises(StorageError, DatabaseConfig, path=":memory:", cp_max=2)
        self.assertIn("cp_max: 1", str(e))
        self.assertEqual(DatabaseConfig(path=":memory:").cp_max, 1)

    def test_from_dict_reads_every_key(self) -> None:
        """Every documented key is read, and Synapse's engine names are accepted."""
        config = DatabaseConfig.from_dict({
            "engine": "psycopg2", "host": "db", "port": 5433, "user": "u", "password": "p",
            "dbname": "d", "cp_min": 2, "cp_max": 7, "connect_timeout_s": 3, "path": "x.db",
        })
        self.assertEqual(
            config,
            DatabaseConfig(engine="postgres", host="db", port=5433, user="u", password="p",
                           dbname="d", cp_min=2, cp_max=7, connect_timeout_s=3, path="x.db"),
        )
        self.assertNotIn("'p'", repr(config))

    def test_from_dict_unknown_key(self) -> None:
        """An unknown key is a ConfigError naming ``database.<key>``."""
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"hostname": "db"})
        self.assertEqual(e.key, "database.hostname")
        self.assertIn("known keys", str(e))

    def test_from_dict_wrong_type(self) -> None:
        """A value of the wrong type is a ConfigError naming the key and the value."""
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"port": "5432"})
        self.assertEqual(e.key, "database.port")
        self.assertIn("'5432'", str(e))
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"cp_max": True})
        self.assertEqual(e.key, "database.cp_max")

    def test_from_dict_bad_engine(self) -> None:
        """An unknown engine name is a ConfigError on ``database.engine``."""
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"engine": "mysql"})
        self.assertEqual(e.key, "database.engine")

    def test_from_dict_inconsistent_values(self) -> None:
        """Cross-field problems are ConfigErrors naming the key to change."""
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"path": ":memory:", "cp_max": 3})
        self.assertEqual(e.key, "database.path")
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"cp_min": 3})
        self.assertEqual(e.key, "database.cp_max")
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"port": 0})
        self.assertEqual(e.key, "database.port")

    def test_synchronous_is_validated(self) -> None:
        """``database.synchronous`` defaults to full, accepts normal, and refuses anything else by name."""
        self.assertEqual(DatabaseConfig.from_dict({}).synchronous, "full")
        self.assertEqual(DatabaseConfig.from_dict({"synchronous": "normal"}).synchronous, "normal")
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, {"synchronous": "off"})
        self.assertEqual(e.key, "database.synchronous")
        self.assertIn("'off'", str(e))

    def test_from_dict_not_a_mapping(self) -> None:
        """A ``database`` section that is not a mapping is a ConfigError on ``database``."""
        e = self.assertRaises(ConfigError, DatabaseConfig.from_dict, ["sqlite"])
        self.assertEqual(e.key, "database")

    def test_missing_sqlite_directory(self) -> None:
        """A SQLite path in a missing directory is refused when the Database is made."""
        config = DatabaseConfig(path=os.path.join(self.mktemp(), "synflow.db"))
        e = self.assertRaises(StorageError, create_database, reactor, config)
        self.assertIn("does not exist", str(e))


# ----------------------------------------------------------------- interactions


def create_items_txn(txn: Txn) -> None:
    txn.execute_raw("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT)")


def insert_item_txn(txn: Txn, item_id: int, name: str | None = None) -> None:
    txn.execute("INSERT INTO items (id, name) VALUES (?, ?)", (item_id, name))


def select_items_txn(txn: Txn) -> list[tuple[Any, ...]]:
    txn.execute("SELECT id, name FROM items ORDER BY id")
    return txn.fetchall()


def select_one_txn(txn: Txn) -> int:
    txn.execute("SELECT 1")
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


def record_statements(txn: Txn, sent: list[str]) -> None:
    """Append the text of every statement ``txn`` sends its cursor from now on to ``sent``."""
    cursor = txn._cursor

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(cursor, name)

        def execute(self, sql: Any, args: Any = None) -> None:
            sent.append(sql.decode() if isinstance(sql, bytes) else sql)
            cursor.execute(sql, args)

    txn._cursor = Recording()


class Boom(Exception):
    """Raised by test interactions to force a rollback."""


class DatabaseTestsMixin:
    """Database behaviour that must hold on every engine."""

    engine: str

    async def make_db(self, **kwargs: Any) -> Database:
        db = await make_database(self, self.engine, apply=False, **kwargs)
        await db.run_interaction("create_items", create_items_txn)
        return db

    async def test_placeholders_and_literals(self) -> None:
        """Parameters bind, while ``%`` and ``?`` inside literals and comments are left alone."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 1, "50% off?")

        def query_txn(txn: Txn) -> list[tuple[Any, ...]]:
            txn.execute(
                "SELECT '50%', ?, 'what?', name -- a comment with ? and %\n"
                "FROM items WHERE name LIKE '50%' AND id = ?",
                (7, 1),
            )
            return txn.fetchall()

        self.assertEqual(await db.run_interaction("query", query_txn), [("50%", 7, "what?", "50% off?")])

    async def test_commit_fires_after_callbacks_on_reactor_thread(self) -> None:
        """A committed interaction runs its after-callbacks, in the reactor thread, before its result."""
        db = await self.make_db()
        calls: list[tuple[str, int, bool]] = []

        def write_txn(txn: Txn) -> str:
            insert_item_txn(txn, 1, "one")
            txn.call_after(lambda n: calls.append(("after", n, threadable.isInIOThread())), 1)
            txn.call_on_exception(lambda n: calls.append(("exception", n, threadable.isInIOThread())), 1)
            return "done"

        d = db.run_interaction("write", write_txn)
        d.addCallback(lambda r: (r, list(calls)))
        self.assertEqual(await d, ("done", [("after", 1, True)]))
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "one")])

    async def test_rollback_fires_exception_callbacks(self) -> None:
        """An interaction that raises rolls back its writes and runs only its exception callbacks."""
        db = await self.make_db()
        calls: list[tuple[str, bool]] = []

        def failing_txn(txn: Txn) -> None:
            insert_item_txn(txn, 1, "one")
            txn.call_after(lambda: calls.append(("after", threadable.isInIOThread())))
            txn.call_on_exception(lambda: calls.append(("exception", threadable.isInIOThread())))
            raise Boom()

        await self.assertFailure(db.run_interaction("fail", failing_txn), Boom)
        self.assertEqual(calls, [("exception", True)])
        self.assertEqual(await db.run_interaction("read", select_items_txn), [])

    async def test_database_error_is_surfaced(self) -> None:
        """A constraint violation fails the Deferred with the driver's own error class."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 1)
        d = db.run_interaction("insert_again", insert_item_txn, 1)
        await self.assertFailure(d, self.integrity_error())

    async def test_bulk_writes_refuse_rows_of_the_wrong_length(self) -> None:
        """``insert_many`` and ``upsert_many`` refuse a row with more or fewer values than columns, before sending."""
        db = await self.make_db()
        for row in ((1,), (1, "one", "extra")):
            def insert_txn(txn: Txn, row: tuple[Any, ...] = row) -> None:
                txn.insert_many("items", ("id", "name"), [(2, "two"), row])

            def upsert_txn(txn: Txn, row: tuple[Any, ...] = row) -> None:
                txn.upsert_many("items", ("id",), ("name",), [(2, "two"), row])

            for fn in (insert_txn, upsert_txn):
                failure = await self.assertFailure(db.run_interaction("bad", fn), ValueError)
                self.assertIn(f"has {len(row)} values for 2 columns", str(failure))
        self.assertEqual(await db.run_interaction("read", select_items_txn), [])

    async def test_insert_many(self) -> None:
        """``insert_many`` writes every row, across several statements, with awkward values intact."""
        db = await self.make_db()
        rows = [(i, f"item {i}") for i in range(2500)] + [(2500, "50% 'quoted' ?"), (2501, None)]

        def insert_txn(txn: Txn) -> None:
            txn.insert_many("items", ("id", "name"), rows)

        await db.run_interaction("insert_many", insert_txn)
        self.assertEqual(await db.run_interaction("read", select_items_txn), rows)

    async def test_writes_run_in_order_within_the_transaction(self) -> None:
        """Rows from ``insert_many`` and ``upsert_many`` are seen by the transaction's next statements, in order,
        and ``rowcount`` after them counts the last one's rows."""
        db = await self.make_db()

        def write_txn(txn: Txn) -> tuple[list[tuple[Any, ...]], int, list[tuple[Any, ...]]]:
            txn.insert_many("items", ("id", "name"), [(1, "a"), (2, "b")])
            txn.upsert_many("items", ("id",), ("name",), [(2, "b2"), (3, "c")])
            seen = select_items_txn(txn)
            txn.upsert_many("items", ("id",), ("name",), [(1, "a2")])
            count = txn.rowcount
            txn.execute("UPDATE items SET name = name || '!' WHERE id = ?", (1,))
            return seen, count, select_items_txn(txn)

        seen, count, after = await db.run_interaction("write", write_txn)
        self.assertEqual(seen, [(1, "a"), (2, "b2"), (3, "c")])
        self.assertEqual(count, 1)
        self.assertEqual(after, [(1, "a2!"), (2, "b2"), (3, "c")])
        self.assertEqual(await db.run_interaction("read", select_items_txn), after)

    async def test_failing_last_write_rolls_back_the_transaction(self) -> None:
        """A bulk write that fails as the interaction's last statement fails it with the driver's error:
        nothing of it commits and only the exception callbacks run."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 5, "five")
        calls: list[str] = []

        def write_txn(txn: Txn) -> str:
            txn.call_after(calls.append, "after")
            txn.call_on_exception(calls.append, "exception")
            txn.insert_many("items", ("id", "name"), [(1, "one")])
            txn.insert_many("items", ("id", "name"), [(4, "four"), (5, "again")])
            return "returned"

        await self.assertFailure(db.run_interaction("write", write_txn), self.integrity_error())
        self.assertEqual(calls, ["exception"])
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(5, "five")])

    async def test_executemany_and_rowcount(self) -> None:
        """``executemany`` runs per row and ``rowcount`` reports an UPDATE's rows."""
        db = await self.make_db()

        def txn_func(txn: Txn) -> int:
            txn.executemany("INSERT INTO items (id, name) VALUES (?, ?)", [(1, "a"), (2, "b")])
            txn.execute("UPDATE items SET name = ? WHERE id >= ?", ("z", 1))
            return txn.rowcount

        self.assertEqual(await db.run_interaction("many", txn_func), 2)

    async def test_greatest_in_sql(self) -> None:
        """The engine's ``greatest`` snippet picks the larger value in real SQL."""
        db = await self.make_db()

        def txn_func(txn: Txn) -> Any:
            txn.execute(f"SELECT {txn.engine.greatest('?', '?')}", (3, 7))
            row = txn.fetchone()
            assert row is not None
            return row[0]

        self.assertEqual(await db.run_interaction("greatest", txn_func), 7)

    async def test_autocommit_keeps_writes_and_restores_transactions(self) -> None:
        """``run_autocommit`` keeps writes made before an error; later interactions are transactional again."""
        db = await self.make_db()
        calls: list[str] = []

        def autocommit_txn(txn: Txn) -> None:
            txn.call_on_exception(calls.append, "exception")
            insert_item_txn(txn, 1, "kept")
            raise Boom()

        await self.assertFailure(db.run_autocommit("auto", autocommit_txn), Boom)
        self.assertEqual(calls, ["exception"])

        def rolled_back_txn(txn: Txn) -> None:
            insert_item_txn(txn, 2, "discarded")
            raise Boom()

        await self.assertFailure(db.run_interaction("txn", rolled_back_txn), Boom)
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "kept")])

    async def test_one_statement_reads_and_refuses_a_second_statement(self) -> None:
        """A ``one_statement`` read returns what a transaction reads; a second statement, or a write, fails it."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 1, "a")
        self.assertEqual(await db.run_interaction("read", select_items_txn, one_statement=True), [(1, "a")])

        def two_txn(txn: Txn) -> None:
            txn.execute("SELECT 1")
            txn.execute("SELECT 2")

        failure = await self.assertFailure(db.run_interaction("two", two_txn, one_statement=True), StorageError)
        self.assertIn("two was declared to run one statement and ran a second", str(failure))
        for write in (lambda txn: txn.insert_many("items", ["id"], [(2,)]),
                      lambda txn: txn.upsert_many("items", ["id"], [], [(2,)]),
                      lambda txn: txn.executemany("INSERT INTO items (id) VALUES (?)", [(2,)])):
            await self.assertFailure(db.run_interaction("write", write, one_statement=True), StorageError)
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "a")])

    async def test_idempotent_retries_transient_errors(self) -> None:
        """An idempotent interaction is rerun after transient errors, each failed attempt firing its exception callbacks."""
        clock = Clock()
        db = await self.make_db(clock=clock)
        transient = self.transient_error()
        attempts: list[int] = []
        calls: list[str] = []

        def flaky_txn(txn: Txn) -> str:
            attempts.append(1)
            txn.call_after(calls.append, "after")
            txn.call_on_exception(calls.append, "exception")
            insert_item_txn(txn, len(attempts))
            if len(attempts) < 3:
                raise transient
            return "ok"

        d = db.run_interaction("flaky", flaky_txn, idempotent=True)
        self.assertEqual(await drive(clock, d, 1.0), 2)
        self.assertEqual(await d, "ok")
        self.assertEqual(calls, ["exception", "exception", "after"])
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(3, None)])

    def transient_error(self) -> Exception:
        """An error the engine treats as transient."""
        raise NotImplementedError

    def integrity_error(self) -> type[Exception]:
        """The driver's IntegrityError class."""
        raise NotImplementedError


class PoolBehaviourTests(TestCase):
    """Database behaviour that does not depend on the engine, checked on SQLite."""

    engine = "sqlite"
    make_db = DatabaseTestsMixin.make_db

    def transient_error(self) -> Exception:
        return sqlite3.OperationalError("database is locked")

    async def test_failing_callback_is_logged_not_raised(self) -> None:
        """An after-callback that raises is logged and the interaction still succeeds."""
        db = await self.make_db()

        def write_txn(txn: Txn) -> int:
            txn.call_after(lambda: 1 / 0)
            return 5

        self.assertEqual(await db.run_interaction("write", write_txn), 5)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    async def test_args_and_kwargs_are_passed(self) -> None:
        """Extra positional and keyword arguments reach the ``_txn`` function."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 3, name="three")
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(3, "three")])

    async def test_insert_many_refuses_bad_names(self) -> None:
        """``insert_many`` refuses a table or column that is not a plain identifier."""
        db = await self.make_db()

        def insert_txn(txn: Txn) -> None:
            txn.insert_many("items; DROP TABLE items", ("id",), [(1,)])

        await self.assertFailure(db.run_interaction("bad", insert_txn), ValueError)

    async def test_idempotent_gives_up(self) -> None:
        """An interaction that keeps failing transiently fails after the last retry with its error."""
        clock = Clock()
        db = await self.make_db(clock=clock)
        transient = self.transient_error()
        attempts: list[int] = []

        def failing_txn(txn: Txn) -> None:
            attempts.append(1)
            raise transient

        d = db.run_interaction("failing", failing_txn, idempotent=True)
        await drive(clock, d, 10.0)
        await self.assertFailure(d, type(transient))
        self.assertEqual(len(attempts), MAX_RETRIES + 1)

    async def test_non_transient_error_is_not_retried(self) -> None:
        """Even an idempotent interaction is not retried after a non-transient error."""
        db = await self.make_db()
        attempts: list[int] = []

        def failing_txn(txn: Txn) -> None:
            attempts.append(1)
            raise Boom()

        await self.assertFailure(db.run_interaction("f", failing_txn, idempotent=True), Boom)
        self.assertEqual(len(attempts), 1)

    async def test_stats_count_and_time_per_desc(self) -> None:
        """``stats`` counts calls and accumulates time per description."""
        db = await self.make_db()
        await db.run_interaction("a", select_one_txn)
        await db.run_interaction("a", select_one_txn)
        await db.run_interaction("b", select_one_txn)
        stats = db.stats()
        self.assertEqual((stats["a"][0], stats["b"][0], stats["create_items"][0]), (2, 1, 1))
        self.assertGreater(stats["a"][1], 0.0)

    async def test_close_waits_for_in_flight_work(self) -> None:
        """``close`` waits for running interactions, then refuses new ones."""
        db = await self.make_db()
        order: list[str] = []

        def slow_txn(txn: Txn) -> None:
            time.sleep(0.2)
            insert_item_txn(txn, 1)

        running = db.run_interaction("slow", slow_txn).addCallback(lambda _: order.append("slow"))
        await db.close().addCallback(lambda _: order.append("closed"))
        await running
        self.assertEqual(order, ["slow", "closed"])
        await self.assertFailure(db.run_interaction("late", select_one_txn), StorageError)

    async def test_txn_function_must_be_synchronous(self) -> None:
        """A ``_txn`` function returning a Deferred is refused with a TypeError."""
        db = await self.make_db()
        await self.assertFailure(db.run_interaction("bad", lambda txn: Deferred()), TypeError)


class SqliteDatabaseTests(DatabaseTestsMixin, TestCase):
    """The Database behaviours on SQLite."""

    engine = "sqlite"

    def transient_error(self) -> Exception:
        return sqlite3.OperationalError("database is locked")

    def integrity_error(self) -> type[Exception]:
        return sqlite3.IntegrityError

    async def test_connection_pragmas(self) -> None:
        """SQLite connections use WAL, synchronous=FULL (by default), foreign keys and a long busy timeout."""
        db = await self.make_db()

        def pragmas_txn(txn: Txn) -> list[Any]:
            values = []
            for pragma in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout"):
                txn.execute(f"PRAGMA {pragma}")
                row = txn.fetchone()
                assert row is not None
                values.append(row[0])
            return values

        self.assertEqual(await db.run_interaction("pragmas", pragmas_txn), ["wal", 2, 1, 30000])

    async def test_synchronous_normal_when_configured(self) -> None:
        """``database.synchronous: normal`` relaxes SQLite's sync to NORMAL (1)."""
        db = await self.make_db(synchronous="normal")

        def synchronous_txn(txn: Txn) -> Any:
            txn.execute("PRAGMA synchronous")
            row = txn.fetchone()
            assert row is not None
            return row[0]

        self.assertEqual(await db.run_interaction("synchronous", synchronous_txn), 1)

    async def test_read_only_runs_on_the_reactor_thread(self) -> None:
        """On a SQLite file a read-only interaction runs on the reactor thread, sees committed writes and fires at once."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 1, "one")
        where: list[bool] = []

        def read_txn(txn: Txn) -> list[tuple[Any, ...]]:
            where.append(threadable.isInIOThread())
            return select_items_txn(txn)

        d = db.run_interaction("read", read_txn, read_only=True)
        self.assertTrue(d.called)
        self.assertEqual(await d, [(1, "one")])
        self.assertEqual(where, [True])
        await db.run_interaction("insert", insert_item_txn, 2, "two")
        self.assertEqual(await db.run_interaction("read", read_txn, read_only=True), [(1, "one"), (2, "two")])

    async def test_read_only_meeting_a_lock_runs_on_the_pool(self) -> None:
        """A read-only interaction that meets a lock on the reactor thread is run again on a pool thread."""
        db = await self.make_db()
        await db.run_interaction("insert", insert_item_txn, 1, "one")
        where: list[bool] = []

        def read_txn(txn: Txn) -> list[tuple[Any, ...]]:
            where.append(threadable.isInIOThread())
            if len(where) == 1:
                raise sqlite3.OperationalError("database is locked")
            return select_items_txn(txn)

        self.assertEqual(await db.run_interaction("read", read_txn, read_only=True), [(1, "one")])
        self.assertEqual(where, [True, False])

    async def test_memory_database_with_one_connection(self) -> None:
        """An in-memory SQLite database works with its single connection."""
        db = Database(reactor, DatabaseConfig(path=":memory:"))
        self.addCleanup(db.close)
        await db.run_interaction("create", create_items_txn)
        await db.run_interaction("insert", insert_item_txn, 1, "x")
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "x")])


class PostgresDatabaseTests(DatabaseTestsMixin, TestCase):
    """The Database behaviours on PostgreSQL, and recovery from a killed backend."""

    engine = "postgres"

    def transient_error(self) -> Exception:
        import psycopg2

        return psycopg2.OperationalError("server closed the connection unexpectedly")

    def integrity_error(self) -> type[Exception]:
        import psycopg2

        return psycopg2.IntegrityError

    async def test_one_statement_runs_outside_a_transaction_block(self) -> None:
        """On PostgreSQL a ``one_statement`` read is sent alone (no BEGIN/COMMIT); a plain read opens a block."""
        import psycopg2.extensions as ext

        db = await self.make_db()

        def status_txn(txn: Txn) -> int:
            txn.execute("SELECT 1")
            return int(txn._cursor.connection.get_transaction_status())

        self.assertEqual(await db.run_interaction("alone", status_txn, one_statement=True),
                         ext.TRANSACTION_STATUS_IDLE)
        self.assertEqual(await db.run_interaction("block", status_txn, read_only=True),
                         ext.TRANSACTION_STATUS_INTRANS)
        # and the pool's connection is transactional again afterwards
        self.assertEqual(await db.run_interaction("block", status_txn), ext.TRANSACTION_STATUS_INTRANS)

    async def test_connections_stay_in_autocommit_mode(self) -> None:
        """A pool connection is in autocommit mode from its opening, and every kind of interaction leaves it so
        (each Txn opens its own transaction: no switch of the driver's session per interaction)."""
        db = await self.make_db()

        def autocommit_txn(txn: Txn) -> bool:
            return bool(txn._cursor.connection.autocommit)

        def failing_txn(txn: Txn) -> None:
            insert_item_txn(txn, 1, "discarded")
            raise Boom()

        for kind in ({}, {"read_only": True}, {"one_statement": True}):
            self.assertTrue(await db.run_interaction("mode", autocommit_txn, **kind))
        await self.assertFailure(db.run_interaction("fails", failing_txn), Boom)
        self.assertTrue(await db.run_autocommit("mode", autocommit_txn))
        self.assertEqual(await db._pool.runWithConnection(lambda conn: conn.autocommit), True)
        self.assertEqual(await db.run_interaction("read", select_items_txn), [])

    async def test_bulk_writes_go_out_in_one_round_trip(self) -> None:
        """On PostgreSQL the ``insert_many`` and ``upsert_many`` of a transaction reach the server as one
        statement text, sent before the next statement or the commit, not one round trip each."""
        db = await self.make_db()
        sent: list[str] = []

        def write_txn(txn: Txn) -> None:
            record_statements(txn, sent)
            txn.insert_many("items", ("id", "name"), [(1, "a"), (2, "b")])
            txn.upsert_many("items", ("id",), ("name",), [(2, "b2")])
            txn.insert_many("items", ("id", "name"), [(3, "50% 'c'")])
            self.assertEqual(sent, [])

        await db.run_interaction("write", write_txn)
        self.assertEqual(len(sent), 1)
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "a"), (2, "b2"), (3, "50% 'c'")])

    async def test_begin_and_commit_ride_on_the_first_and_last_statements(self) -> None:
        """On PostgreSQL a transaction is 2 round trips for a read and a write, not 4: ``BEGIN`` goes out with
        its first statement and ``COMMIT`` with its writes; a function that sends nothing sends nothing."""
        import psycopg2.extensions as ext

        db = await self.make_db(cp_min=1, cp_max=1)
        sent: list[str] = []
        status: list[int] = []

        def write_txn(txn: Txn) -> None:
            record_statements(txn, sent)
            txn.execute("SELECT count(*) FROM items")
            status.append(cursor_status(txn))
            txn.insert_many("items", ("id", "name"), [(1, "a")])

        def cursor_status(txn: Txn) -> int:
            return int(txn._cursor.connection.get_transaction_status())

        await db.run_interaction("write", write_txn)
        self.assertEqual(len(sent), 2, sent)
        self.assertTrue(sent[0].startswith("BEGIN;SELECT"), sent[0])
        self.assertTrue(sent[1].startswith("INSERT INTO items") and sent[1].endswith(";COMMIT"), sent[1])
        self.assertEqual(status, [ext.TRANSACTION_STATUS_INTRANS])
        sent.clear()
        await db.run_interaction("nothing", record_statements, sent)
        self.assertEqual(sent, [])
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "a")])

    async def test_failed_transaction_leaves_its_connection_usable(self) -> None:
        """A statement failing inside a transaction rolls it back on the pool's one connection, which then
        runs the next interactions (autocommit ones too) normally, and a failing function's reads and writes
        leave nothing."""
        db = await self.make_db(cp_min=1, cp_max=1)
        await db.run_interaction("insert", insert_item_txn, 1, "one")

        def failing_txn(txn: Txn) -> None:
            insert_item_txn(txn, 2, "two")
            insert_item_txn(txn, 1, "again")  # fails now: a statement, not a deferred write

        await self.assertFailure(db.run_interaction("fail", failing_txn), self.integrity_error())

        def raising_txn(txn: Txn) -> None:
            txn.insert_many("items", ("id", "name"), [(3, "three")])
            select_items_txn(txn)
            raise Boom()

        await self.assertFailure(db.run_interaction("raise", raising_txn), Boom)
        await db.run_interaction("insert", insert_item_txn, 4, "four")
        await db.run_autocommit("insert", insert_item_txn, 5, "five")
        self.assertEqual(await db.run_interaction("read", select_items_txn), [(1, "one"), (4, "four"), (5, "five")])

    async def kill_backend(self, db: Database) -> int:
        """Terminate the PostgreSQL backend serving the pool's only connection."""
        from tests.services import pg_connect

        def pid_txn(txn: Txn) -> int:
            txn.execute("SELECT pg_backend_pid()")
            row = txn.fetchone()
            assert row is not None
            return int(row[0])

        pid = await db.run_interaction("pid", pid_txn)
        conn = pg_connect()
        try:
            conn.cursor().execute("SELECT pg_terminate_backend(%s)", (pid,))
        finally:
            conn.close()
        return pid

    def flush_connection_errors(self) -> None:
        import psycopg2

        # adbapi logs the failed rollback on the dead connection.
        self.flushLoggedErrors(psycopg2.InterfaceError, psycopg2.OperationalError, ConnectionLost)

    async def test_idempotent_call_survives_terminated_backend(self) -> None:
        """After ``pg_terminate_backend``, an idempotent call is retried on the clock and succeeds."""
        clock = Clock()
        db = await self.make_db(clock=clock, cp_min=1, cp_max=1)
        await self.kill_backend(db)
        warnings: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_level") is not None and event["log_level"].name == "warn":
                warnings.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        d = db.run_interaction("after_kill", select_one_txn, idempotent=True)
        self.assertEqual(await drive(clock, d, 1.0), 1)
        self.assertEqual(await d, 1)
        self.assertEqual([w["desc"] for w in warnings], ["after_kill"])
        self.flush_connection_errors()

    async def test_non_idempotent_call_fails_after_terminated_backend(self) -> None:
        """After ``pg_terminate_backend``, a non-idempotent call fails with the driver's error and the pool recovers."""
        import psycopg2

        db = await self.make_db(cp_min=1, cp_max=1)
        await self.kill_backend(db)
        await self.assertFailure(db.run_interaction("after_kill", select_one_txn), psycopg2.OperationalError)
        self.assertEqual(await db.run_interaction("recovered", select_one_txn), 1)
        self.flush_connection_errors()


# ------------------------------------------------------------- two processes

CHILD_SCRIPT = textwrap.dedent("""
    import sys
    import time
    from twisted.internet import task
    from twisted.internet.defer import Deferred
    from synflow.storage.engines import Database, DatabaseConfig

    def write_txn(txn, writer):
        txn.execute("SELECT COALESCE(MAX(n), 0) FROM counter")
        (n,) = txn.fetchone()
        time.sleep(WINDOW_S)
        txn.execute("INSERT INTO counter (n, writer, at) VALUES (?, ?, ?)",
                    (n + 1, writer, time.time()))

    async def main(reactor):
        db = Database(reactor, DatabaseConfig(path=sys.argv[1]))
        await db.run_interaction("warm_up", lambda txn: None)
        print("ready", flush=True)
        for _ in range(int(sys.argv[2])):
            await db.run_interaction("write", write_txn, "child")
        await db.close()

    task.react(lambda reactor: Deferred.fromCoroutine(main(reactor)))
""").replace("WINDOW_S", "0.002")


class _Child(protocol.ProcessProtocol):
    def __init__(self) -> None:
        self.ready: Deferred[None] = Deferred()
        self.ended: Deferred[int] = Deferred()
        self.output = b""

    def outReceived(self, data: bytes) -> None:
        self.output += data
        if b"ready" in self.output and not self.ready.called:
            self.ready.callback(None)

    def errReceived(self, data: bytes) -> None:
        self.output += data

    def processEnded(self, reason: Any) -> None:
        if not self.ready.called:
            self.ready.errback(RuntimeError(f"child exited early: {self.output!r}"))
        self.ended.callback(reason.value.exitCode)


class SqliteTwoProcessTests(TestCase):
    """Two processes writing one SQLite file."""

    async def test_concurrent_read_modify_write_does_not_deadlock(self) -> None:
        """Two processes doing read-then-write transactions on one file all succeed, with no lost update."""
        config = database_config(self, "sqlite")
        db = Database(reactor, config)
        self.addCleanup(db.close)

        def schema_txn(txn: Txn) -> None:
            txn.execute_raw(
                "CREATE TABLE counter (n INTEGER NOT NULL UNIQUE, writer TEXT NOT NULL, at REAL)"
            )

        def write_txn(txn: Txn, writer: str) -> None:
            txn.execute("SELECT COALESCE(MAX(n), 0) FROM counter")
            row = txn.fetchone()
            assert row is not None
            time.sleep(0.002)  # widen the read-to-write window so the processes collide
            txn.execute("INSERT INTO counter (n, writer, at) VALUES (?, ?, ?)",
                        (row[0] + 1, writer, time.time()))

        await db.run_interaction("schema", schema_txn)
        writes = 150
        child = _Child()
        root = os.path.dirname(os.path.dirname(os.path.abspath(synflow.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        reactor.spawnProcess(
            child, sys.executable, [sys.executable, "-c", CHILD_SCRIPT, config.path, str(writes)],
            env=env,
        )
        await child.ready
        parent_started = time.time()
        for _ in range(writes):
            await db.run_interaction("write", write_txn, "parent")
        self.assertEqual(await child.ended, 0, child.output.decode(errors="replace"))

        def rows_txn(txn: Txn) -> list[tuple[Any, ...]]:
            txn.execute("SELECT n, writer, at FROM counter ORDER BY n")
            return txn.fetchall()

        rows = await db.run_interaction("rows", rows_txn)
        self.assertEqual([n for n, _, _ in rows], list(range(1, 2 * writes + 1)))
        writers = [w for _, w, _ in rows]
        self.assertEqual((writers.count("parent"), writers.count("child")), (writes, writes))
        # The parent was already trying to write while the child still wrote:
        # the two contended for the lock (whether or not their rows interleave).
        last_child_write = max(at for _, w, at in rows if w == "child")
        self.assertLess(parent_started, last_child_write, "the processes never overlapped")


#: Values of the kinds synflow writes, and the kinds pg_literal hands to psycopg2.
_SQL_VALUES = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(),  # any text: quotes, backslashes, NUL, lone surrogates, "--", "%s"
    st.text(alphabet="'\\\"%$-;\x00 aé\n", max_size=12),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.binary(max_size=8),
)


def _outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """What ``fn(*args)`` returns, or the type of the quoting error it raises."""
    try:
        return fn(*args)
    except (ValueError, UnicodeEncodeError) as e:
        return type(e)


class PostgresLiteralTests(SynchronousTestCase):
    """Bulk writes quote their values as psycopg2 does: the same bytes, the same errors, and the same
    rows read back; and they let psycopg2 quote everything where the server reads literals otherwise."""

    def setUp(self) -> None:
        import psycopg2

        config = database_config(self, "postgres")
        self.conn = psycopg2.connect(host=config.host, port=config.port, user=config.user, dbname=config.dbname)
        self.addCleanup(self.conn.close)
        self.conn.autocommit = True
        self.cursor = self.conn.cursor()

    @given(_SQL_VALUES)
    def test_literals_are_psycopg2s(self, value: Any) -> None:
        """Any value renders to exactly psycopg2's bytes, or fails with psycopg2's exception type."""
        self.assertTrue(plain_pg_literals(self.conn))
        self.assertEqual(_outcome(pg_literal, value, self.cursor.mogrify),
                         _outcome(self.cursor.mogrify, b"%s", (value,)))

    @given(st.lists(st.tuples(st.integers(min_value=-(2**63), max_value=2**63 - 1),
                              st.one_of(st.none(), st.text().filter(lambda t: "\x00" not in t)),
                              st.one_of(st.none(), st.binary(max_size=8))),
                    max_size=5, unique_by=lambda row: row[0]))
    def test_rendered_rows_read_back_as_written(self, rows: list[tuple[Any, ...]]) -> None:
        """Rows written through the rendered INSERT come back from PostgreSQL as they were, whatever the text."""
        rows = [(key, text.encode("utf-8", "surrogatepass").decode("utf-8", "replace") if text else text, blob)
                for key, text, blob in rows]
        self.cursor.execute("CREATE TABLE IF NOT EXISTS lit (k BIGINT PRIMARY KEY, t TEXT, b BYTEA)")
        self.cursor.execute("TRUNCATE lit")
        PG.insert_many_txn(self.cursor, "lit", ("k", "t", "b"), rows)
        self.cursor.execute("SELECT k, t, b FROM lit ORDER BY k")
        got = [(k, t, None if b is None else bytes(b)) for k, t, b in self.cursor.fetchall()]
        self.assertEqual(got, sorted(rows, key=lambda row: row[0]))

    @given(st.lists(_SQL_VALUES, max_size=4))
    def test_parameters_go_in_as_psycopg2_puts_them(self, values: list[Any]) -> None:
        """A statement's parameters make the statement psycopg2 would send, "%" in its text included."""
        sql = PG.convert_placeholders("SELECT '50%' " + "".join(", ?" for _ in values) + " WHERE 'a%' LIKE 'a%%'")
        expected = _outcome(self.cursor.mogrify, sql, values)
        failed = _outcome(PG.execute, self.cursor, sql, values)
        if failed is not None:
            self.assertEqual(failed, expected)
            return
        self.assertEqual(self.cursor.query, expected)
        self.assertEqual(self.cursor.fetchall()[0][0], "50%")

    def test_a_quote_in_a_value_cannot_end_the_literal(self) -> None:
        """Text built to close its literal and run a statement of its own is stored as text, in a bulk write and
        as a parameter, and the table survives it."""
        attack = "x'); DROP TABLE lit; --"
        self.cursor.execute("CREATE TABLE lit (k BIGINT PRIMARY KEY, t TEXT)")
        PG.insert_many_txn(self.cursor, "lit", ("k", "t"), [(1, attack)])
        PG.execute(self.cursor, PG.convert_placeholders("INSERT INTO lit (k, t) VALUES (?, ?)"), (2, attack))
        self.cursor.execute("SELECT k, t FROM lit ORDER BY k")
        self.assertEqual(self.cursor.fetchall(), [(1, attack), (2, attack)])

    def test_another_literal_syntax_leaves_the_quoting_to_psycopg2(self) -> None:
        """With ``standard_conforming_strings`` off, a backslash escapes: every value goes through psycopg2."""
        value = "a'b\\c"
        self.assertEqual(pg_literal(value, self.cursor.mogrify), b"'a''b\\c'")
        self.cursor.execute("SET standard_conforming_strings = off")
        self.assertFalse(plain_pg_literals(self.conn))
        statements = PG.render_insert_many(self.cursor, "lit", ("t",), [(value,)])
        self.assertEqual(statements, [b"INSERT INTO lit (t) VALUES (" + self.cursor.mogrify(b"%s", (value,)) + b")"])
        self.assertNotEqual(self.cursor.mogrify(b"%s", (value,)), b"'a''b\\c'")
        self.cursor.execute("CREATE TABLE lit (t TEXT)")
        self.cursor.execute(statements[0])
        self.cursor.execute("SELECT t FROM lit")
        self.assertEqual(self.cursor.fetchall(), [(value,)])
        self.cursor.execute("SET standard_conforming_strings = on")
        self.cursor.execute("SET client_encoding = 'LATIN1'")
        self.assertFalse(plain_pg_literals(self.conn))
