"""Persistent small instance IDs (``instance_map``) on both engines."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from synflow.storage.engines import Database
from synflow.storage.instances import InstanceMap, get_or_create_instance_id_txn
from tests.dbutil import make_database
from tests.services import pg_connect

NAMES = ["master", "persister1", "persister2", "synchrotron1", "federation_sender1"]


class InstanceMapTestsMixin:
    """instance_map behaviour that must hold on every engine."""

    engine: str

    async def test_ids_are_small_distinct_and_idempotent(self) -> None:
        """New names get 1, 2, 3...; asking again returns the same ID and burns none."""
        db = await make_database(self, self.engine)
        first = {n: await db.run_interaction("id", get_or_create_instance_id_txn, n) for n in NAMES}
        self.assertEqual(sorted(first.values()), list(range(1, len(NAMES) + 1)))
        again = {n: await db.run_interaction("id", get_or_create_instance_id_txn, n) for n in reversed(NAMES)}
        self.assertEqual(again, first)
        new = await db.run_interaction("id", get_or_create_instance_id_txn, "event_creator1")
        self.assertEqual(new, len(NAMES) + 1)

    async def test_ids_survive_reopening(self) -> None:
        """A database closed and opened again gives every name the ID it had, and new names the next ones."""
        db = await make_database(self, self.engine)
        before = await InstanceMap(db).ids_for(NAMES)
        await db.close()
        reopened = Database(reactor, db.config)
        self.addCleanup(reopened.close)
        imap = InstanceMap(reopened)
        await imap.load()
        self.assertEqual(imap.by_name, before)
        self.assertEqual(imap.by_id, {i: n for n, i in before.items()})
        self.assertEqual(await imap.get_id("persister2"), before["persister2"])
        self.assertEqual(await imap.get_id("event_creator1"), len(NAMES) + 1)

    async def test_cached_names_need_no_query(self) -> None:
        """Once known, a name's ID is answered from the cache without a database interaction."""
        db = await make_database(self, self.engine)
        imap = InstanceMap(db)
        await imap.ids_for(NAMES)
        calls = db.stats()["get_instance_id"][0]
        self.assertEqual(calls, len(NAMES))
        await imap.ids_for(NAMES)
        await imap.get_id("master")
        self.assertEqual(db.stats()["get_instance_id"][0], calls)

    async def test_two_processes_creating_at_once_agree(self) -> None:
        """Two pools asking for the same new names at the same time get the same, distinct IDs."""
        db = await make_database(self, self.engine)
        other = Database(reactor, db.config)
        self.addCleanup(other.close)
        ours, theirs = await gatherResults([InstanceMap(db).ids_for(NAMES), InstanceMap(other).ids_for(NAMES)])
        self.assertEqual(ours, theirs)
        self.assertEqual(len(set(ours.values())), len(NAMES))


class SqliteInstanceMapTests(InstanceMapTestsMixin, TestCase):
    engine = "sqlite"


class PostgresInstanceMapTests(InstanceMapTestsMixin, TestCase):
    engine = "postgres"

    async def test_creation_racing_another_process_returns_its_id(self) -> None:
        """A name another session inserts between our SELECT and INSERT is returned, not a unique violation."""
        db = await make_database(self, self.engine)
        racer = pg_connect(db.config.dbname)
        self.addCleanup(racer.close)
        racer.autocommit = False
        cur = racer.cursor()
        cur.execute("INSERT INTO instance_map (instance_name) VALUES ('persister1') RETURNING instance_id")
        theirs = cur.fetchone()[0]
        d = db.run_interaction("id", get_or_create_instance_id_txn, "persister1")
        # Wait until our INSERT is blocked on their uncommitted row, then let theirs commit.
        watcher = pg_connect(db.config.dbname)
        self.addCleanup(watcher.close)
        for _ in range(1000):
            if _insert_blocked(watcher):
                break
            await deferLater(reactor, 0.01, lambda: None)
        else:
            self.fail("our INSERT never waited for the other session's row")
        racer.commit()
        self.assertEqual(await d, theirs)


def _insert_blocked(conn: Any) -> bool:
    """Whether a session of this database waits for a lock in an INSERT into instance_map."""
    cur = conn.cursor()
    cur.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO instance_map%'"
    )
    return int(cur.fetchone()[0]) > 0
