"""Real databases for tests, on both engines, cleaned up after each test.

Test modules parameterise over :data:`ENGINES` (usually with a mixin and one
subclass per engine) and call :func:`make_database` from a test or ``setUp``::

    class EventsStoreTestsMixin:
        engine: str

        async def _db(self):
            return await make_database(self, self.engine)

SQLite databases are files under the test's ``mktemp()`` directory;
PostgreSQL ones are fresh, uniquely named databases on the test server
(skipped when it is unreachable, failed under ``CI=true``) dropped at cleanup.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from synflow.storage.engines import Database, DatabaseConfig
from synflow.storage.prepare import prepare_database
from tests.services import (
    PG_HOST,
    PG_PORT,
    PG_USER,
    create_pg_database,
    drop_pg_database,
    require_postgres,
)

ENGINES = ("sqlite", "postgres")


def database_config(testcase: SynchronousTestCase, engine: str, **overrides: Any) -> DatabaseConfig:
    """A config for a fresh, empty database that is removed after the test.

    Use it directly for tests that start separate processes against the same
    database.

    Args:
        testcase: the running test (for ``mktemp`` and ``addCleanup``).
        engine: ``"sqlite"`` or ``"postgres"``.
        overrides: other :class:`DatabaseConfig` fields (``cp_max`` ...).
    """
    if engine == "sqlite":
        directory = os.path.abspath(testcase.mktemp())
        os.makedirs(directory)
        return DatabaseConfig(engine="sqlite", path=os.path.join(directory, "synflow.db"), **overrides)
    if engine == "postgres":
        require_postgres()
        name = create_pg_database()
        testcase.addCleanup(drop_pg_database, name)
        return DatabaseConfig(
            engine="postgres", host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=name, **overrides
        )
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")


def make_database(testcase: SynchronousTestCase, engine: str, *, schema_dir: str | None = None,
                  apply: bool = True, clock: Any = None, **overrides: Any) -> Deferred[Database]:
    """A :class:`Database` on a fresh database, closed (and dropped) after the test.

    Args:
        testcase: the running test.
        engine: ``"sqlite"`` or ``"postgres"``.
        schema_dir: migrations to apply; None for synflow's own.
        apply: run :func:`prepare_database` first.
        clock: the ``Database`` clock (retry backoff); the reactor by default.
        overrides: other :class:`DatabaseConfig` fields.

    Returns:
        A Deferred firing with the database once its schema is ready.
    """
    config = database_config(testcase, engine, **overrides)
    db = Database(reactor, config, clock=clock)
    testcase.addCleanup(db.close)  # runs before the database is dropped
    if not apply:
        return succeed(db)
    d = prepare_database(db, apply=True, schema_dir=schema_dir)
    return d.addCallback(lambda _: db)
