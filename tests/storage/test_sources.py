"""Catch-up sources: one writer's rows in ``(from, to]``, paged, from a real database (both engines)."""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import TestCase

from synflow.storage.engines import Database, Txn
from synflow.storage.sources import PAGE_ROWS, DatabaseSource
from synflow.streams import CACHES, EVENTS, FEDERATION, CachesRow, EventsRow, FederationRow
from tests.dbutil import make_database

EVENT_COLUMNS = ("stream_ordering", "instance_name", "event_id", "room_id", "type", "state_key", "sender",
                 "membership", "content", "origin_server_ts", "origin", "depth", "received_ts")


def event_row(sid: int) -> EventsRow:
    """The row the events stream carries for stream ID ``sid`` in these tests."""
    if sid % 5 == 0:
        return EventsRow(f"$e{sid}:hs", f"!r{sid % 7}:hs", "m.room.member", f"@u{sid}:hs", f"@u{sid}:hs", "join")
    return EventsRow(f"$e{sid}:hs", f"!r{sid % 7}:hs", "m.room.message", None, f"@u{sid % 3}:hs", None)


def writer_of(sid: int) -> str:
    """Two writers, interleaved: w1 writes two IDs of every three, w2 the third."""
    return "w2" if sid % 3 == 0 else "w1"


def insert_events_txn(txn: Txn, ids: list[int]) -> None:
    rows = []
    for sid in ids:
        r = event_row(sid)
        rows.append((sid, writer_of(sid), r.event_id, r.room_id, r.type, r.state_key, r.sender, r.membership,
                     "{}", 0, "hs", 1, 0))
    txn.insert_many("events", EVENT_COLUMNS, rows)


#: Stream IDs 2..376: 250 of w1's rows and 125 of w2's.
IDS = list(range(2, 377))
W1 = [i for i in IDS if writer_of(i) == "w1"]


class DatabaseSourceTestsMixin:
    """Paging behaviour that must hold on every engine."""

    engine: str

    async def _source(self) -> tuple[Database, DatabaseSource]:
        db = await make_database(self, self.engine)
        await db.run_interaction("insert", insert_events_txn, IDS)
        return db, DatabaseSource(db, EVENTS)

    async def test_pages_of_one_writer(self) -> None:
        """Catching up one writer comes in pages of 100 (limited) and a last short page, with only its rows."""
        _, source = await self._source()
        self.assertEqual(len(W1), 250)
        to_token = IDS[-1] + 10
        pages = []
        cur = 1
        while True:
            updates, upto, limited = await source.get_updates("w1", cur, to_token)
            pages.append(updates)
            # A limited page reaches its last row; the last page reaches the requested token.
            self.assertEqual(upto, updates[-1][0] if limited else to_token)
            cur = upto
            if not limited:
                break
        self.assertEqual([len(p) for p in pages], [PAGE_ROWS, PAGE_ROWS, 50])
        self.assertEqual([u for p in pages for u in p], [(sid, event_row(sid)) for sid in W1])
        self.assertEqual(await self._collect(source, "w2", 1, to_token),
                         [(sid, event_row(sid)) for sid in IDS if writer_of(sid) == "w2"])

    async def test_bounds_are_exclusive_then_inclusive(self) -> None:
        """A page starts strictly after ``from`` and ends at ``to`` inclusive."""
        _, source = await self._source()
        updates, upto, limited = await source.get_updates("w1", 10, 20)
        self.assertEqual([sid for sid, _ in updates], [11, 13, 14, 16, 17, 19, 20])
        self.assertEqual((upto, limited), (20, False))
        updates, upto, limited = await source.get_updates("w1", 11, 11)
        self.assertEqual((updates, upto, limited), ([], 11, False))
        updates, _, _ = await source.get_updates("w2", 3, 9)
        self.assertEqual([sid for sid, _ in updates], [6, 9])

    async def test_limit_and_exact_page(self) -> None:
        """A page holding exactly ``limit`` rows says limited; the next one is empty and not limited."""
        _, source = await self._source()
        updates, upto, limited = await source.get_updates("w1", 1, W1[9], limit=10)
        self.assertEqual(([sid for sid, _ in updates], upto, limited), (W1[:10], W1[9], True))
        updates, upto, limited = await source.get_updates("w1", upto, W1[9], limit=10)
        self.assertEqual((updates, upto, limited), ([], W1[9], False))

    async def _collect(self, source: DatabaseSource, instance: str, cur: int, to_token: int) -> list[Any]:
        out: list[Any] = []
        while True:
            updates, cur, limited = await source.get_updates(instance, cur, to_token)
            out += updates
            if not limited:
                return out

    async def test_caches_and_federation_rows_rebuilt(self) -> None:
        """The caches and federation sources rebuild their rows from the stored columns."""
        db = await make_database(self, self.engine)

        def insert_txn(txn: Txn) -> None:
            txn.insert_many("cache_invalidations", ("stream_id", "instance_name", "cache_name", "keys",
                                                    "invalidation_ts"),
                            [(2, "w1", "get_user", json.dumps(["@a:hs", 3]), 17), (3, "w1", "get_room", None, 18),
                             (4, "w2", "get_user", json.dumps(["@b:hs"]), 19)])
            txn.insert_many("federation_outbox", ("stream_id", "instance_name", "destination", "edu_type", "content"),
                            [(2, "master", "remote.example", "m.typing", json.dumps({"room_id": "!r:hs", "n": [1]}))])

        await db.run_interaction("insert", insert_txn)
        caches, _, _ = await DatabaseSource(db, CACHES).get_updates("w1", 1, 10)
        self.assertEqual(caches, [(2, CachesRow("get_user", ("@a:hs", 3), 17)), (3, CachesRow("get_room", None, 18))])
        federation, _, _ = await DatabaseSource(db, FEDERATION).get_updates("master", 1, 10)
        self.assertEqual(federation, [(2, FederationRow("remote.example", "m.typing", {"room_id": "!r:hs", "n": [1]}))])


class SqliteDatabaseSourceTests(DatabaseSourceTestsMixin, TestCase):
    engine = "sqlite"


class PostgresDatabaseSourceTests(DatabaseSourceTestsMixin, TestCase):
    engine = "postgres"
