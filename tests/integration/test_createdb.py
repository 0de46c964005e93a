"""The production overlay on a server without the synflow database: the master creates it, or names the createdb command."""

from __future__ import annotations

import io
import os
import uuid

from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import StorageError
from synflow.storage.createdb import createdb_command, ensure_database_txn
from synflow.storage.engines import DatabaseConfig
from synflow.tools import ctl
from tests import services
from tests.cluster import free_port
from tests.test_ctl import small_deployment, write

WORKERS = os.path.join(os.path.dirname(__file__), "..", "..", "workers")


def _database_info(name: str) -> tuple[str, str, str] | None:
    conn = services.pg_connect()
    try:
        cur = conn.cursor()
        cur.execute("SELECT pg_encoding_to_char(encoding), datcollate, datctype FROM pg_database WHERE datname = %s",
                    (name,))
        row = cur.fetchone()
        return tuple(row) if row else None
    finally:
        conn.close()


class EnsureDatabaseTest(SynchronousTestCase):
    def setUp(self) -> None:
        services.require_postgres()
        self.dbname = f"synflow_test_{uuid.uuid4().hex[:12]}"
        self.addCleanup(services.drop_pg_database, self.dbname)

    def config(self, user: str = services.PG_USER) -> DatabaseConfig:
        return DatabaseConfig(engine="postgres", host=services.PG_HOST, port=services.PG_PORT, user=user,
                              dbname=self.dbname)

    def test_missing_database_created_utf8_c(self):
        """A missing database is created UTF-8 with the C collation, once; a second call finds it."""
        self.assertIsNone(_database_info(self.dbname))
        self.assertTrue(ensure_database_txn(self.config()))
        self.assertEqual(_database_info(self.dbname), ("UTF8", "C", "C"))
        self.assertFalse(ensure_database_txn(self.config()))

    def test_role_without_createdb_gets_the_command(self):
        """A role that may not create databases gets one line with the exact createdb command, and nothing is created."""
        role = f"synflow_test_role_{uuid.uuid4().hex[:8]}"
        conn = services.pg_connect()
        try:
            conn.cursor().execute(f'CREATE ROLE "{role}" LOGIN NOCREATEDB NOSUPERUSER')
        finally:
            conn.close()

        def drop_role() -> None:
            c = services.pg_connect()
            try:
                c.cursor().execute(f'DROP ROLE IF EXISTS "{role}"')
            finally:
                c.close()

        self.addCleanup(drop_role)
        with self.assertRaises(StorageError) as cm:
            ensure_database_txn(self.config(user=role))
        message = str(cm.exception)
        self.assertEqual(len(message.splitlines()), 1)
        self.assertIn(f"role {role!r} may not create it", message)
        self.assertTrue(message.endswith(createdb_command(self.config(user=role))), message)
        self.assertIn("--template template0 --encoding UTF8 --lc-collate C --lc-ctype C", message)
        self.assertIsNone(_database_info(self.dbname))


class ProductionOverlayStartTest(SynchronousTestCase):
    def test_start_creates_the_database(self):
        """synflowctl start with the production overlay on a server without the database starts every process healthy."""
        services.require_postgres()
        services.require_redis()
        dbname = f"synflow_test_{uuid.uuid4().hex[:12]}"
        self.addCleanup(services.drop_pg_database, dbname)
        directory = small_deployment(self, {"master": free_port(), "p1": free_port(), "p2": free_port()})
        with open(os.path.join(WORKERS, "production.yaml")) as f:
            production = f.read()
        overlay = write(os.path.dirname(directory), f"{os.path.basename(directory)}-production.yaml",
                        production.replace("dbname: synflow", f"dbname: {dbname}")
                        + f"\n# test isolation\nreplication:\n  redis: {{channel_prefix: {services.redis_prefix()}}}\n"
                        f"caches: {{tier: null}}\n")
        self.assertIn(dbname, open(overlay).read())
        procs = ctl.discover(directory, [overlay])
        self.assertEqual({p.config.database.dbname for p in procs}, {dbname})
        self.assertIsNone(_database_info(dbname))
        out = io.StringIO()
        self.addCleanup(ctl.stop, procs, io.StringIO())
        self.assertEqual(ctl.start(procs, out), 0, out.getvalue())
        self.assertEqual(_database_info(dbname), ("UTF8", "C", "C"))
