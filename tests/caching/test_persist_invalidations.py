"""Cache invalidations written by the event persister, and the room current-state cache they keep fresh.

A real persister writes to a real SQLite database; a reader process in the
same reactor receives its events and caches streams through a real
replication handler, in either order (see ``tests/caching/processes.py``).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from synflow.caching import CURRENT_STATE_CACHE_NAME, FakeCacheTier
from synflow.events.persist import persist_events_txn
from synflow.storage.id_generators import StreamWriteContext
from tests.caching.processes import SERVER, WRITER, Deployment, member, message, rdata, state
from tests.dbutil import make_database

ROOM = "!room:hs"
ALICE, BOB = "@alice:hs", "@bob:hs"
NOW_S = 1_700_000_000.25
NOW_MS = 1_700_000_000_250


class Boom(Exception):
    """Raised inside a persist transaction to roll it back."""


class PersistInvalidationsTest(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.db = await make_database(self, "sqlite")
        self.clock = Clock()
        self.clock.advance(NOW_S)
        self.deployment = await Deployment(self.db, self.clock).start()
        self.reader, self.relay = self.deployment.reader("reader")

    async def _rows_after(self, stream_id: int) -> list[tuple[Any, ...]]:
        rows = await self.db.run_interaction("read", _invalidations_txn, stream_id)
        return [(sid, inst, name, json.loads(keys) if keys is not None else None, ts)
                for sid, inst, name, keys, ts in rows]

    def _caches_position(self) -> int:
        return self.deployment.writers.generators["caches"].position

    async def test_join_writes_exactly_one_caches_row_with_the_event(self) -> None:
        """Persisting a join records one [cs_cache_fake, [room, user], ts] caches row, announced with the event."""
        await self.deployment.create_room(ROOM, ALICE, public=True)
        before = self._caches_position()
        self.relay.sent.clear()
        (result,) = await self.deployment.persist(member(ROOM, BOB, "join"))
        rows = await self._rows_after(before)
        self.assertEqual(len(rows), 1)
        stream_id, instance, name, keys, ts = rows[0]
        self.assertEqual((instance, name, keys, ts), (WRITER, CURRENT_STATE_CACHE_NAME, [ROOM, BOB], NOW_MS))
        received = await self.db.run_interaction("read", _received_ts_txn, result.event_id)
        self.assertEqual(received, NOW_MS)  # written by the same persist transaction
        self.assertEqual(rdata(self.relay.sent, "caches"), [[CURRENT_STATE_CACHE_NAME, [ROOM, BOB], NOW_MS]])
        self.assertEqual([c.token for c in self.relay.sent if c.NAME == "RDATA" and c.stream_name == "caches"],
                         [stream_id])
        self.assertEqual([r[0] for r in rdata(self.relay.sent, "events")], [result.event_id])

    async def test_rolled_back_persist_leaves_neither_event_nor_invalidation(self) -> None:
        """The invalidation is in the event's transaction: when it rolls back, neither is written."""
        await self.deployment.create_room(ROOM, ALICE, public=True)
        before = self._caches_position()

        def failing_txn(ctx: StreamWriteContext) -> None:
            persist_events_txn(ctx, [member(ROOM, BOB, "join")], ["$doomed:hs"], server_name=SERVER,
                               instance_name=WRITER, now_ms=NOW_MS)
            self.assertEqual(len(ctx.allocated.get("caches", [])), 1)  # the row was written...
            raise Boom("roll back")  # ...and goes with the event

        with self.assertRaises(Boom):
            await self.deployment.writers.run_write("persist_events", ["events", "caches"], failing_txn)
        self.assertEqual(await self._rows_after(before), [])
        self.assertIsNone(await self.db.run_interaction("read", _received_ts_txn, "$doomed:hs"))
        self.assertEqual(await self.deployment.writer.store.get_users_in_room(ROOM), [ALICE])

    async def test_every_state_event_invalidates_its_room(self) -> None:
        """A non-membership state event records [cs_cache_fake, [room]]; a message records nothing."""
        await self.deployment.create_room(ROOM, ALICE)
        before = self._caches_position()
        await self.deployment.persist(message(ROOM, ALICE, "hi"))
        self.assertEqual(await self._rows_after(before), [])
        await self.deployment.persist(state(ROOM, ALICE, "m.room.topic", {"topic": "t"}))
        rows = await self._rows_after(before)
        self.assertEqual([(r[2], r[3]) for r in rows], [(CURRENT_STATE_CACHE_NAME, [ROOM])])

    async def test_one_row_per_room_per_transaction(self) -> None:
        """A batch creating a room and joining its creator records one row naming the room and the creator."""
        before = self._caches_position()
        await self.deployment.create_room(ROOM, ALICE)
        rows = await self._rows_after(before)
        self.assertEqual([(r[2], r[3]) for r in rows], [(CURRENT_STATE_CACHE_NAME, [ROOM, ALICE])])


class CurrentStateCacheTest(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.db = await make_database(self, "sqlite")
        self.clock = Clock()
        self.deployment = await Deployment(self.db, self.clock).start()
        await self.deployment.create_room(ROOM, ALICE)

    async def _warm(self, reader: Any) -> dict[str, dict[str, str]]:
        current = await reader.store.get_current_state_ids(ROOM)
        self.assertIn((ROOM,), reader.store.get_current_state_ids.cache)
        self.assertEqual(set(current), {"m.room.create", "m.room.member"})
        return current

    async def test_state_read_is_cached(self) -> None:
        """The room's current state is read once and then answered from the cache."""
        reader, _relay = self.deployment.reader("reader")
        first = await self._warm(reader)
        self.assertEqual(first["m.room.member"], {ALICE: first["m.room.member"][ALICE]})
        await self.db.run_interaction("sneak", _sneak_state_txn)  # a change no invalidation announces
        self.assertEqual(await reader.store.get_current_state_ids(ROOM), first)

    async def test_state_change_seen_after_the_caches_row_alone(self) -> None:
        """A topic change's caches row, arriving before its event, drops the cached state; the next read sees it."""
        reader, relay = self.deployment.reader("reader")
        await self._warm(reader)
        relay.hold = {"events"}
        (result,) = await self.deployment.persist(state(ROOM, ALICE, "m.room.topic", {"topic": "t"}))
        self.assertNotIn((ROOM,), reader.store.get_current_state_ids.cache)
        fresh = await reader.store.get_current_state_ids(ROOM)
        self.assertEqual(fresh["m.room.topic"], {"": result.event_id})
        relay.release()

    async def test_state_change_never_stale_once_the_events_position_passes_it(self) -> None:
        """With the caches row still in flight, a read after the reader's events position passed the change is fresh."""
        reader, relay = self.deployment.reader("reader")
        await self._warm(reader)
        relay.hold = {"caches"}
        (result,) = await self.deployment.persist(state(ROOM, ALICE, "m.room.topic", {"topic": "t"}))
        assert result.stream_ordering is not None
        self.assertGreaterEqual(reader.handler.position("events", WRITER), result.stream_ordering)
        self.assertEqual((await reader.store.get_current_state_ids(ROOM)).get("m.room.topic"), {"": result.event_id})
        relay.release()
        (leave,) = await self.deployment.persist(member(ROOM, ALICE, "leave"))
        self.assertEqual((await reader.store.get_current_state_ids(ROOM))["m.room.member"], {ALICE: leave.event_id})

    async def test_tier_value_from_before_the_change_is_not_used(self) -> None:
        """A process that applied a state event but not yet its caches row does not take the old state from the tier."""
        tier = FakeCacheTier(60, invalidators=["inv1"], clock=self.clock)
        tier.raise_floor("inv1", 0)
        filler, _ = self.deployment.reader("filler", tier=tier)
        await self._warm(filler)
        self.assertIsNotNone(await tier.lookup("get_current_state_ids", (ROOM,)))  # filled
        late, relay = self.deployment.reader("late", tier=tier)
        relay.hold = {"caches"}  # neither it nor (here) any invalidator has the caches row yet
        (result,) = await self.deployment.persist(state(ROOM, ALICE, "m.room.name", {"name": "n"}))
        self.assertIsNotNone(await tier.lookup("get_current_state_ids", (ROOM,)))  # still the old value
        current = await late.store.get_current_state_ids(ROOM)
        self.assertEqual(current.get("m.room.name"), {"": result.event_id})


def _invalidations_txn(txn: Any, after: int) -> list[tuple[Any, ...]]:
    txn.execute("SELECT stream_id, instance_name, cache_name, keys, invalidation_ts FROM cache_invalidations "
                "WHERE stream_id > ? ORDER BY stream_id", (after,))
    return [tuple(r) for r in txn.fetchall()]


def _received_ts_txn(txn: Any, event_id: str) -> int | None:
    txn.execute("SELECT received_ts FROM events WHERE event_id = ?", (event_id,))
    row = txn.fetchone()
    return None if row is None else int(row[0])


def _sneak_state_txn(txn: Any) -> None:
    txn.execute("INSERT INTO current_state (room_id, type, state_key, event_id) VALUES (?, 'x.sneak', '', '$s')",
                (ROOM,))
