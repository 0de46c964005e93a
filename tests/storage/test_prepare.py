"""Tests for synflow.storage.prepare: schema files, the splitter and migrations.

Migration tests use their own schema directories and run on both engines.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow.errors import SchemaVersionError, StorageError
from synflow.storage.engines import Database, Txn
from synflow.storage.prepare import (
    current_version,
    latest_version,
    prepare_database,
    prepare_plugin_schemas,
    schema_files,
    split_sql,
    wait_for_schema,
)
from tests.dbutil import database_config, make_database
from tests.storage.test_engines import drive

# Three migrations; 0002 has a dialect variant for each engine, and 0003
# depends on both earlier ones.
SCHEMA = {
    "0001_things.sql": """
        -- The first table; a ';' in a comment does not split;
        CREATE TABLE things (
            id INTEGER NOT NULL PRIMARY KEY,
            label TEXT NOT NULL DEFAULT 'a;b'
        );
        INSERT INTO things (id, label) VALUES (1, 'it''s; 50%?');
    """,
    "0002_dialect.sqlite.sql": """
        CREATE TABLE dialect (engine TEXT NOT NULL);
        INSERT INTO dialect VALUES ('sqlite');
    """,
    "0002_dialect.postgres.sql": """
        CREATE TABLE dialect (engine TEXT NOT NULL);
        CREATE FUNCTION dialect_name() RETURNS TEXT AS $$
            SELECT 'postgres';
        $$ LANGUAGE SQL;
        INSERT INTO dialect VALUES (dialect_name());
    """,
    "0002_dialect.sql": "this file is shadowed by both variants and never runs;\n",
    "0003_more.sql": """
        INSERT INTO things (id, label) SELECT 2, engine FROM dialect;
    """,
    "README.md": "not a migration",
}


def write_schema(testcase: SynchronousTestCase, files: dict[str, str]) -> str:
    """Write ``files`` into a fresh directory and return its path."""
    directory = testcase.mktemp()
    os.makedirs(directory)
    for name, text in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)
    return directory


def things_txn(txn: Txn) -> list[tuple[Any, ...]]:
    txn.execute("SELECT id, label FROM things ORDER BY id")
    return txn.fetchall()


def versions_txn(txn: Txn) -> list[int]:
    txn.execute("SELECT version FROM schema_version ORDER BY version")
    return [row[0] for row in txn.fetchall()]


def set_version_txn(txn: Txn, version: int) -> None:
    txn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, 0)", (version,))


class SplitSqlTests(SynchronousTestCase):
    """Migration files split into statements at a ``;`` that ends its line."""

    def test_splits_at_line_end(self) -> None:
        """Statements end at a line-ending ``;``; blank and comment-only pieces are dropped."""
        text = "-- header;\nCREATE TABLE a (x INT);\n\n  INSERT INTO a VALUES (1);  -- done\n-- trailer\n"
        self.assertEqual(
            split_sql(text, "sqlite"),
            ["-- header;\nCREATE TABLE a (x INT)", "INSERT INTO a VALUES (1)"],
        )

    def test_semicolons_inside_literals_and_comments(self) -> None:
        """A ``;`` at line end inside a string, identifier or block comment does not split."""
        text = "INSERT INTO a VALUES ('x;\ny');\nSELECT \"odd;\ncol\" /* c;\n */ FROM a;\n"
        self.assertEqual(
            split_sql(text, "sqlite"),
            ["INSERT INTO a VALUES ('x;\ny')", "SELECT \"odd;\ncol\" /* c;\n */ FROM a"],
        )

    def test_mid_line_semicolon_does_not_split(self) -> None:
        """A ``;`` followed by more code on its line stays inside the statement (trigger bodies)."""
        text = (
            "CREATE TRIGGER t AFTER INSERT ON a BEGIN\n"
            "  UPDATE b SET n = n + 1; END;\n"
            "SELECT 1"
        )
        self.assertEqual(
            split_sql(text, "sqlite"),
            ["CREATE TRIGGER t AFTER INSERT ON a BEGIN\n  UPDATE b SET n = n + 1; END", "SELECT 1"],
        )

    def test_postgres_dollar_quotes(self) -> None:
        """On PostgreSQL a dollar-quoted function body keeps its line-ending ``;``."""
        text = "CREATE FUNCTION f() RETURNS INT AS $body$\n  SELECT 1;\n$body$ LANGUAGE SQL;\n"
        self.assertEqual(
            split_sql(text, "postgres"),
            ["CREATE FUNCTION f() RETURNS INT AS $body$\n  SELECT 1;\n$body$ LANGUAGE SQL"],
        )


class SchemaFilesTests(SynchronousTestCase):
    """Schema directories list one file per version and engine."""

    def test_dialect_variant_chosen(self) -> None:
        """A dialect variant replaces the plain file of its version for its engine only."""
        directory = write_schema(self, {
            "0001_a.sql": "", "0002_b.sql": "", "0002_b.postgres.sql": "",
        })
        self.assertEqual(
            [(v, n, p.name) for v, n, p in schema_files(directory, "sqlite")],
            [(1, "a", "0001_a.sql"), (2, "b", "0002_b.sql")],
        )
        self.assertEqual(
            [p.name for _, _, p in schema_files(directory, "postgres")],
            ["0001_a.sql", "0002_b.postgres.sql"],
        )
        self.assertEqual(latest_version(directory), 2)

    def test_missing_directory_is_empty(self) -> None:
        """A schema directory that does not exist holds no migrations (version 0)."""
        self.assertEqual(schema_files(self.mktemp(), "sqlite"), [])
        self.assertEqual(latest_version(self.mktemp()), 0)

    def test_misnamed_file_refused(self) -> None:
        """A ``.sql`` file not named ``NNNN_name[.engine].sql`` is refused by name."""
        directory = write_schema(self, {"1_a.sql": ""})
        e = self.assertRaises(StorageError, schema_files, directory, "sqlite")
        self.assertIn("1_a.sql", str(e))

    def test_two_names_for_one_version_refused(self) -> None:
        """Two files with one version but different names are refused."""
        directory = write_schema(self, {"0001_a.sql": "", "0001_b.sql": ""})
        e = self.assertRaises(StorageError, schema_files, directory, "sqlite")
        self.assertIn("version 1 has two names", str(e))

    def test_variant_without_counterpart_refused(self) -> None:
        """A version with only one engine's variant is refused, naming the engine it lacks."""
        directory = write_schema(self, {"0001_a.sqlite.sql": ""})
        e = self.assertRaises(StorageError, schema_files, directory, "sqlite")
        self.assertIn("no file for postgres", str(e))

    def test_version_zero_refused(self) -> None:
        """Version 0 is refused: versions start at 1."""
        directory = write_schema(self, {"0000_a.sql": ""})
        self.assertRaises(StorageError, schema_files, directory, "postgres")

    def test_real_schema_dir_is_valid(self) -> None:
        """synflow's own schema directory lists cleanly for both engines."""
        versions = [v for v, _, _ in schema_files(None, "sqlite")]
        self.assertEqual(versions, [v for v, _, _ in schema_files(None, "postgres")])
        self.assertEqual(versions, sorted(set(versions)))


class PrepareTestsMixin:
    """Migrations and the wait for them, on every engine."""

    engine: str

    async def fresh_db(self, **kwargs: Any) -> tuple[Database, str]:
        schema = write_schema(self, SCHEMA)
        db = await make_database(self, self.engine, apply=False, **kwargs)
        return db, schema

    async def test_synflow_schema_applies(self) -> None:
        """synflow's own migrations apply cleanly and reach the code's version."""
        db = await make_database(self, self.engine)
        self.assertEqual(await current_version(db), latest_version())

    async def test_plugin_namespaces(self) -> None:
        """Plugin migrations keep their versions per namespace: the same numbers in two namespaces both apply,
        once, beside synflow's own schema, and a second start applies nothing."""
        db = await make_database(self, self.engine)
        notes = write_schema(self, {"0001_notes.sql": "CREATE TABLE notes (id BIGINT);\n",
                                    "0002_more.sql": "CREATE TABLE notes_more (id BIGINT);\n"})
        tags = write_schema(self, {"0001_tags.sql": "CREATE TABLE tags (id BIGINT);\n"})
        schemas = {"stream:notes": notes, "app:tagger": tags}
        self.assertEqual(await prepare_plugin_schemas(db, schemas), {"stream:notes": 2, "app:tagger": 1})
        self.assertEqual(await prepare_plugin_schemas(db, schemas), {"stream:notes": 2, "app:tagger": 1})

        def applied_txn(txn: Txn) -> list[tuple[str, int]]:
            txn.execute("SELECT namespace, version FROM plugin_schema_version ORDER BY namespace, version")
            return [(r[0], int(r[1])) for r in txn.fetchall()]

        self.assertEqual(await db.run_interaction("applied", applied_txn),
                         [("app:tagger", 1), ("stream:notes", 1), ("stream:notes", 2)])
        self.assertEqual(await current_version(db), latest_version())  # synflow's own version is untouched
        self.assertIsNone(await current_version(db, "app:unknown"))

    async def test_migrations_apply_in_order(self) -> None:
        """Every migration applies in version order and is recorded in schema_version."""
        db, schema = await self.fresh_db()
        self.assertIsNone(await current_version(db))
        self.assertEqual(await prepare_database(db, apply=True, schema_dir=schema), 3)
        self.assertEqual(await db.run_interaction("versions", versions_txn), [1, 2, 3])
        self.assertEqual(await current_version(db), 3)

    async def test_dialect_variant_and_literals(self) -> None:
        """The engine's dialect variant ran, and quoted ``;``, ``%`` and ``?`` survived."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema)
        self.assertEqual(
            await db.run_interaction("things", things_txn),
            [(1, "it's; 50%?"), (2, self.engine)],
        )

    async def test_rerun_is_noop(self) -> None:
        """Preparing an up-to-date database again changes nothing."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema)
        self.assertEqual(await prepare_database(db, apply=True, schema_dir=schema), 3)
        self.assertEqual(await db.run_interaction("versions", versions_txn), [1, 2, 3])
        self.assertEqual(len(await db.run_interaction("things", things_txn)), 2)

    async def test_target_then_rest(self) -> None:
        """With ``target`` only the versions up to it apply; a later run applies the rest."""
        db, schema = await self.fresh_db()
        self.assertEqual(await prepare_database(db, apply=True, schema_dir=schema, target=1), 1)
        self.assertEqual(await prepare_database(db, apply=True, schema_dir=schema), 3)
        self.assertEqual(await db.run_interaction("versions", versions_txn), [1, 2, 3])

    async def test_newer_database_refused(self) -> None:
        """A database newer than the code is refused, saying both versions and what to do."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema)
        await db.run_interaction("bump", set_version_txn, 7)
        e = await self.assertFailure(
            prepare_database(db, apply=True, schema_dir=schema), SchemaVersionError
        )
        self.assertEqual(
            str(e),
            "database version 7 is newer than this code's 3; upgrade synflow or restore a backup",
        )

    async def test_check_only(self) -> None:
        """With ``apply=False`` pending migrations are refused, not applied; an up-to-date schema passes."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema, target=2)
        e = await self.assertFailure(
            prepare_database(db, apply=False, schema_dir=schema), SchemaVersionError
        )
        self.assertIn("at version 2, this code needs 3", str(e))
        self.assertEqual(await current_version(db), 2)
        await prepare_database(db, apply=True, schema_dir=schema)
        self.assertEqual(await prepare_database(db, apply=False, schema_dir=schema), 3)

    async def test_failing_migration(self) -> None:
        """A failing migration rolls back alone, and the error names its file and statement."""
        schema = write_schema(self, {
            "0001_ok.sql": "CREATE TABLE a (x INTEGER);\n",
            "0002_bad.sql": "CREATE TABLE b (x INTEGER);\nINSERT INTO nowhere VALUES (1);\n",
        })
        db = await make_database(self, self.engine, apply=False)
        e = await self.assertFailure(
            prepare_database(db, apply=True, schema_dir=schema), StorageError
        )
        self.assertIn("0002_bad.sql failed at statement 2 ('INSERT INTO nowhere", str(e))
        self.assertEqual(await current_version(db), 1)

        def b_exists_txn(txn: Txn) -> bool:
            return txn.engine.table_exists_txn(txn, "b")

        self.assertFalse(await db.run_interaction("b", b_exists_txn))

    async def test_concurrent_prepare(self) -> None:
        """Two processes' pools migrating one database at once apply each migration once."""
        schema = write_schema(self, SCHEMA)
        config = database_config(self, self.engine)
        from twisted.internet import reactor

        dbs = [Database(reactor, config) for _ in range(2)]
        for db in dbs:
            self.addCleanup(db.close)
        results = [prepare_database(db, apply=True, schema_dir=schema) for db in dbs]
        self.assertEqual([await d for d in results], [3, 3])
        self.assertEqual(await dbs[0].run_interaction("versions", versions_txn), [1, 2, 3])
        self.assertEqual(len(await dbs[0].run_interaction("things", things_txn)), 2)

    async def test_wait_for_schema_succeeds_when_version_appears(self) -> None:
        """A worker waiting for the schema returns once the master has applied the last migration."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema, target=1)
        clock = Clock()
        d = wait_for_schema(db, clock, timeout_s=60, poll_s=0.5, schema_dir=schema)
        for _ in range(3):  # three polls find version 1
            while not clock.getDelayedCalls():
                await deferred_sleep(0.005)
            clock.advance(0.5)
        self.assertFalse(d.called)
        await prepare_database(db, apply=True, schema_dir=schema)
        await drive(clock, d, 0.5)
        self.assertEqual(await d, 3)
        self.assertLess(clock.seconds(), 60)

    async def test_wait_for_schema_times_out(self) -> None:
        """A worker gives up after the timeout, saying what it found, what it needs and what to do."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema, target=2)
        clock = Clock()
        d = wait_for_schema(db, clock, timeout_s=5, poll_s=0.5, schema_dir=schema)
        self.assertEqual(await drive(clock, d, 0.5), 10)
        e = await self.assertFailure(d, SchemaVersionError)
        self.assertEqual(
            str(e),
            "database schema is at version 2, this process needs version 3; gave up after 5s: "
            "start the master first (it applies migrations)",
        )

    async def test_wait_for_schema_on_empty_database(self) -> None:
        """Waiting on a never-prepared database times out saying there is no schema yet."""
        db, schema = await self.fresh_db()
        clock = Clock()
        d = wait_for_schema(db, clock, version=1, timeout_s=1, poll_s=0.5, schema_dir=schema)
        await drive(clock, d, 0.5)
        e = await self.assertFailure(d, SchemaVersionError)
        self.assertIn("at no schema yet, this process needs version 1", str(e))

    async def test_wait_for_schema_refuses_newer_database(self) -> None:
        """A worker refuses at once a database newer than its code."""
        db, schema = await self.fresh_db()
        await prepare_database(db, apply=True, schema_dir=schema)
        await db.run_interaction("bump", set_version_txn, 9)
        d = wait_for_schema(db, Clock(), schema_dir=schema)
        e = await self.assertFailure(d, SchemaVersionError)
        self.assertIn("database version 9 is newer than this code's 3", str(e))


async def deferred_sleep(seconds: float) -> None:
    """Let the real reactor run for ``seconds``."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    await deferLater(reactor, seconds, lambda: None)


class SqlitePrepareTests(PrepareTestsMixin, TestCase):
    """Migrations on SQLite."""

    engine = "sqlite"


class PostgresPrepareTests(PrepareTestsMixin, TestCase):
    """Migrations on PostgreSQL."""

    engine = "postgres"
