"""The SQL federation stores on real SQLite and PostgreSQL databases.

``destinations`` (retry state and how far each destination got),
``destination_rooms`` (catch-up: the latest event per room, oldest rooms
first, 50 at a time, against a vector-clock position), ``received_transactions``
(inbound dedupe) and the master's ``federation_outbox`` trim on
``FEDERATION_ACK``. Events are written by the persister's own SQL
(:mod:`tests.federation.sql`), with two writers whose transactions commit out
of stream-ID order.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import attrs
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from synflow.federation.edus import EduQueue
from synflow.federation.inbound import InboundTransactionHandler
from synflow.federation.interfaces import Pdu
from synflow.federation.policy import (
    CATCH_UP_BATCH,
    RetryState,
    catch_up_position,
    check_catch_up_batch,
)
from synflow.federation.storage import (
    RECEIVED_TRANSACTIONS_KEEP_S,
    RECEIVED_TRANSACTIONS_PRUNE_INTERVAL_S,
    SqlDedupeStore,
    SqlDestinationStore,
)
from synflow.replication.commands import FederationAckCommand
from synflow.storage.engines import Database, Txn
from synflow.storage.id_generators import StreamWriters
from synflow.storage.instances import InstanceMap
from synflow.storage.prepare import prepare_database
from synflow.tokens import StreamToken
from tests.dbutil import database_config, make_database
from tests.federation.sql import SERVER, create_room, member, message, persist

P1, P2 = "persister1", "persister2"
ALICE = f"@alice:{SERVER}"
R1, R2 = "r1.test", "r2.test"


@attrs.frozen
class Latest:
    """The latest event of a room, as the test wrote it."""

    room: str
    stream_ordering: int
    instance_id: int
    event_id: str


@attrs.define
class World:
    """Rooms, each written by one of two persisters, with remote members on r1 (all) and r2 (some)."""

    ids: dict[str, int]
    latest: dict[str, Latest] = attrs.Factory(dict)
    rooms_of: dict[str, list[str]] = attrs.Factory(dict)
    top: int = 0

    def needed(self, destination: str, after: StreamToken, upto: StreamToken) -> list[Latest]:
        """The contract: the destination's latest-per-room entries in (after, upto], by (ordering, writer)."""
        hits = [
            e for room, e in self.latest.items() if room in self.rooms_of[destination]
            and not after.covers(e.instance_id, e.stream_ordering) and upto.covers(e.instance_id, e.stream_ordering)
        ]
        return sorted(hits, key=lambda e: (e.stream_ordering, e.instance_id))


async def build_world(db: Database, n_rooms: int, messages_per_room: int = 3, seed: int = 7) -> World:
    """Persist ``n_rooms`` rooms and their messages; the writers commit out of stream-ID order.

    Room ``i`` belongs to persister1 if ``i`` is even, else persister2. Room IDs
    sort differently from their stream orderings. Message IDs interleave the
    rooms at random; each round of messages commits persister2 first, and
    within a transaction the highest IDs come first.
    """
    world = World(await InstanceMap(db).ids_for([P1, P2]))
    rooms = [f"!room{(i * 37) % n_rooms:03d}:{SERVER}" for i in range(n_rooms)]
    writer_of = {room: (P1 if i % 2 == 0 else P2) for i, room in enumerate(rooms)}
    world.rooms_of = {R1: list(rooms), R2: [r for i, r in enumerate(rooms) if i % 3 == 0]}
    next_id = itertools.count(1)
    for writer in (P1, P2):
        setup = []
        for i, room in enumerate(rooms):
            if writer_of[room] != writer:
                continue
            specs = [*create_room(room, ALICE), member(room, f"@bob:{R1}", "invite", sender=ALICE)]
            if i % 3 == 0:
                specs.append(member(room, f"@carol:{R2}", "invite", sender=ALICE))
            setup.extend((next(next_id), s) for s in specs)
        await persist(db, writer, setup)
    rng = random.Random(seed)
    left = {room: messages_per_room for room in rooms}
    ids: dict[tuple[str, int], int] = {}
    while left:
        room = rng.choice(sorted(left))
        ids[(room, messages_per_room - left[room])] = next(next_id)
        left[room] -= 1
        if not left[room]:
            del left[room]
    for k in range(messages_per_room):
        for writer in (P2, P1):
            batch = sorted(((ids[(room, k)], message(room, ALICE, f"{room} {k}")) for room in rooms
                            if writer_of[room] == writer), key=lambda pair: -pair[0])
            await persist(db, writer, batch)
    for room in rooms:
        so = ids[(room, messages_per_room - 1)]
        world.latest[room] = Latest(room, so, world.ids[writer_of[room]], f"$so{so}:{SERVER}")
    world.top = max(ids.values())
    return world


async def read_all(store: SqlDestinationStore, destination: str, after: StreamToken,
                   upto: StreamToken) -> list[list[Pdu]]:
    """Catch up as the queue does: read 50, advance the position with catch_up_position, until empty."""
    pages = []
    for _ in range(20):
        batch = await store.get_catch_up_pdus(destination, after, upto, CATCH_UP_BATCH)
        check_catch_up_batch(destination, after, upto, batch)
        if not batch:
            return pages
        pages.append(batch)
        after = catch_up_position(after, upto, batch)
    raise AssertionError(f"catch-up of {destination} never ended: {[len(p) for p in pages]} ...")


class DestinationStoreTestsMixin:
    """SqlDestinationStore, SqlDedupeStore and the outbox trim, on one engine."""

    engine: str

    async def test_retry_state_and_position_survive_reopening(self) -> None:
        """The backoff and the last-successful token written to ``destinations`` are read back after a reopen."""
        config = database_config(self, self.engine)
        first = Database(reactor, config)
        self.addCleanup(first.close)
        await prepare_database(first, apply=True)
        store = SqlDestinationStore(first)
        self.assertIsNone(await store.get_destination(R1))
        retry = RetryState(retry_last_ts=1_700_000_000_123, retry_interval=40_000, failure_ts=1_699_999_000_000)
        token = StreamToken.parse("m5~1.9~2.12")
        await store.set_retry(R1, retry)
        await store.set_last_successful(R1, token)
        await store.set_last_successful(R2, StreamToken.at(3))  # a row with the default retry state
        await first.close()

        second = Database(reactor, config)
        self.addCleanup(second.close)
        store = SqlDestinationStore(second)
        got = await store.get_destination(R1)
        assert got is not None
        self.assertEqual((got.destination, got.retry, got.last_successful), (R1, retry, token))
        other = await store.get_destination(R2)
        assert other is not None
        self.assertEqual((other.retry, other.last_successful), (RetryState(), StreamToken.at(3)))
        # Clearing the backoff keeps the position, and vice versa.
        await store.set_retry(R1, RetryState())
        got = await store.get_destination(R1)
        assert got is not None
        self.assertEqual((got.retry, got.last_successful), (RetryState(), token))

    async def test_catch_up_latest_per_room_oldest_first_50_at_a_time(self) -> None:
        """Catch-up reads each room's latest event, oldest rooms first, 50 a time, skipping nothing below the other writer.

        The destination's position has persister2 far ahead of persister1 (as
        after persister2's higher IDs were sent first); persister1's latest
        events between the two positions must still come back, exactly once.
        """
        db = await make_database(self, self.engine)
        world = await build_world(db, 130)
        store = SqlDestinationStore(db)
        id1, id2 = world.ids[P1], world.ids[P2]
        by_writer = {
            i: sorted(e.stream_ordering for e in world.latest.values() if e.instance_id == i) for i in (id1, id2)
        }
        after = StreamToken.from_positions({id1: by_writer[id1][3], id2: by_writer[id2][15]})
        upto = StreamToken.from_positions({id1: world.top, id2: world.top})
        expected = world.needed(R1, after, upto)
        below_other = [e for e in expected if e.instance_id == id1 and e.stream_ordering < after.get(id2)]
        self.assertGreaterEqual(len(below_other), 5, "the data must exercise the vector clock")
        self.assertEqual(len(expected), 130 - 4 - 16)

        pages = await read_all(store, R1, after, upto)
        self.assertEqual([len(p) for p in pages], [50, 50, 10])
        got = [p.event_id for page in pages for p in page]
        self.assertEqual(got, [e.event_id for e in expected])
        self.assertTrue({e.event_id for e in below_other} <= set(got))
        # The first page is exactly the 50 rooms whose latest event is oldest.
        self.assertEqual([p.room_id for p in pages[0]], [e.room for e in expected[:50]])
        # Each entry is the room's latest event, with its writer and ordering.
        for pdu in pages[0]:
            e = world.latest[pdu.room_id]
            self.assertEqual((pdu.event_id, pdu.instance_id, pdu.stream_ordering),
                             (e.event_id, e.instance_id, e.stream_ordering))
        # Only the rooms r2.test is in, for r2.test.
        got_r2 = [p.event_id for page in await read_all(store, R2, after, upto) for p in page]
        self.assertEqual(got_r2, [e.event_id for e in world.needed(R2, after, upto)])
        self.assertLess(len(got_r2), len(got))

    async def test_catch_up_every_owed_event_oldest_first_with_a_bounded_count(self) -> None:
        """Every local event listing the destination in (after, upto] comes back, oldest first, 50 a time; the count stops at its limit.

        The position has persister2 ahead of persister1: persister1's events
        between the two positions still come back, each exactly once, and
        events listing only the other destination (or none) never do.
        """
        db = await make_database(self, self.engine)
        world = await build_world(db, 30, messages_per_room=4)
        store = SqlDestinationStore(db)
        id1, id2 = world.ids[P1], world.ids[P2]
        rows = await db.run_interaction("read", lambda txn: _select(
            txn, "SELECT e.event_id, e.stream_ordering, im.instance_id, e.destinations FROM events e "
            "JOIN instance_map im ON im.instance_name = e.instance_name WHERE e.instance_name <> ? "
            "ORDER BY e.stream_ordering", ""))
        after = StreamToken.from_positions({id1: world.top // 3, id2: world.top // 2})
        upto = StreamToken.from_positions({id1: world.top, id2: world.top - 5})

        def owed(destination: str) -> list[str]:
            return [e for e, so, iid, dests in rows if dests and destination in json.loads(dests)
                    and not after.covers(iid, so) and upto.covers(iid, so)]

        expected = owed(R1)
        self.assertGreater(len(expected), 60)
        self.assertTrue(any(iid == id1 and after.get(id1) < so <= after.get(id2)
                            for e, so, iid, _ in rows if e in expected), "the data must exercise the vector clock")
        pages, position = [], after
        while True:
            batch = await store.get_catch_up_events(R1, position, upto, CATCH_UP_BATCH)
            check_catch_up_batch(R1, position, upto, batch)
            if not batch:
                break
            pages.append([p.event_id for p in batch])
            position = catch_up_position(position, upto, batch)
        self.assertEqual([len(p) for p in pages[:-1]], [50] * (len(pages) - 1))
        self.assertEqual([e for page in pages for e in page], expected)
        r2 = await store.get_catch_up_events(R2, after, upto, 1000)
        self.assertEqual([p.event_id for p in r2], owed(R2))
        self.assertLess(len(r2), len(expected))
        self.assertEqual(await store.count_catch_up_events(R1, after, upto, 10_001), len(expected))
        self.assertEqual(await store.count_catch_up_events(R1, after, upto, 11), 11)
        self.assertEqual(await store.count_catch_up_events("nobody.test", after, upto, 11), 0)

    async def test_catch_up_pdus_are_the_persisted_events(self) -> None:
        """A catch-up PDU carries the persisted event: IDs, sender, content, origin, prev event and depth."""
        db = await make_database(self, self.engine)
        world = await build_world(db, 2, messages_per_room=2)
        (pdu, _) = await SqlDestinationStore(db).get_catch_up_pdus(R1, StreamToken.at(0), StreamToken.at(world.top), 5)
        room = pdu.room_id
        events = await db.run_interaction(
            "read", lambda txn: _select(txn, "SELECT event_id FROM events WHERE room_id = ? ORDER BY depth", room))
        self.assertEqual(pdu.json, {
            "event_id": pdu.event_id, "room_id": room, "type": "m.room.message", "sender": ALICE,
            "content": {"body": f"{room} 1"}, "origin_server_ts": 5, "origin": SERVER,
            "prev_events": [events[-2][0]], "depth": len(events),
        })
        self.assertEqual(events[-1][0], pdu.event_id)

    async def test_catch_up_stops_at_upto_for_each_writer(self) -> None:
        """Entries beyond ``upto`` for their own writer are not returned, even below another writer's bound."""
        db = await make_database(self, self.engine)
        world = await build_world(db, 40)
        store = SqlDestinationStore(db)
        id1, id2 = world.ids[P1], world.ids[P2]
        middle = sorted(e.stream_ordering for e in world.latest.values())[20]
        upto = StreamToken.from_positions({id1: middle, id2: world.top})
        pages = await read_all(store, R1, StreamToken.at(0), upto)
        got = [p.event_id for page in pages for p in page]
        self.assertEqual(got, [e.event_id for e in world.needed(R1, StreamToken.at(0), upto)])
        self.assertTrue(all(p.stream_ordering <= middle for page in pages for p in page if p.instance_id == id1))
        self.assertTrue(any(p.stream_ordering > middle for page in pages for p in page if p.instance_id == id2))
        self.assertLess(len(got), 40)

    async def test_outstanding_destinations(self) -> None:
        """A destination is outstanding while an entry up to ``upto`` is not covered by its last success."""
        db = await make_database(self, self.engine)
        world = await build_world(db, 6)
        store = SqlDestinationStore(db)
        upto = StreamToken.at(world.top)
        self.assertEqual(await store.outstanding_destinations(upto), [R1, R2])  # no last success: from s0
        await store.set_last_successful(R1, upto)
        self.assertEqual(await store.outstanding_destinations(upto), [R2])
        newest = max(world.latest.values(), key=lambda e: e.stream_ordering)
        await store.set_last_successful(R1, StreamToken.at(world.top).clamp(newest.stream_ordering - 1))
        self.assertEqual(await store.outstanding_destinations(upto), [R1, R2])
        # An upto that does not reach the missing entry does not make it outstanding.
        lower = StreamToken.at(newest.stream_ordering - 1)
        self.assertNotIn(R1, await store.outstanding_destinations(lower))

    async def test_inbound_dedupe_on_origin_and_txn_id(self) -> None:
        """A transaction repeated with the same (origin, txn_id), even after a restart, persists once."""
        db = await make_database(self, self.engine)
        persisted: list[tuple[str, str]] = []

        def handler() -> InboundTransactionHandler:
            return InboundTransactionHandler(
                SqlDedupeStore(db), lambda origin, pdu: persisted.append((origin, pdu["event_id"])),
                lambda origin: None,
            )

        def body(origin: str, *events: str) -> bytes:
            return json.dumps({"origin": origin, "origin_server_ts": 1, "pdus": [
                {"event_id": e, "room_id": "!r:x", "type": "m.room.message", "sender": f"@u:{origin}",
                 "content": {}, "origin_server_ts": 1} for e in events]}).encode()

        first = await handler().on_send(None, "t1", body(R1, "$a", "$b"))
        self.assertEqual(first, (200, {"pdus": {"$a": {}, "$b": {}}}))
        again = await handler().on_send(None, "t1", body(R1, "$a", "$b"))  # a new handler: as after a restart
        self.assertEqual(again, first)
        self.assertEqual(persisted, [(R1, "$a"), (R1, "$b")])
        await handler().on_send(None, "t1", body(R2, "$c"))  # same ID, other origin: a new transaction
        await handler().on_send(None, "t2", body(R1, "$d"))  # same origin, other ID: a new transaction
        self.assertEqual(persisted, [(R1, "$a"), (R1, "$b"), (R2, "$c"), (R1, "$d")])
        dedupe = SqlDedupeStore(db)
        await dedupe.store_response(R1, "t1", 500, {"other": True})  # never replaces the first answer
        self.assertEqual(await dedupe.get_response(R1, "t1"), first)
        self.assertIsNone(await dedupe.get_response(R2, "t2"))

    async def test_received_transactions_pruned_by_age(self) -> None:
        """Inbound transactions older than RECEIVED_TRANSACTIONS_KEEP_S are deleted by a later store."""
        db = await make_database(self, self.engine)
        clock = Clock()
        clock.advance(1_700_000_000)
        dedupe = SqlDedupeStore(db, clock)
        await dedupe.store_response(R1, "old", 200, {"pdus": {}})
        clock.advance(RECEIVED_TRANSACTIONS_KEEP_S / 2)
        await dedupe.store_response(R1, "recent", 200, {"pdus": {}})  # within the prune interval: no prune
        self.assertIsNotNone(await dedupe.get_response(R1, "old"))
        clock.advance(RECEIVED_TRANSACTIONS_KEEP_S / 2 + RECEIVED_TRANSACTIONS_PRUNE_INTERVAL_S)
        await dedupe.store_response(R2, "new", 200, {"pdus": {}})
        self.assertIsNone(await dedupe.get_response(R1, "old"))
        self.assertIsNotNone(await dedupe.get_response(R1, "recent"))
        self.assertIsNotNone(await dedupe.get_response(R2, "new"))
        self.assertEqual(dedupe.pruned, 1)

    async def test_unknown_edu_types_are_counted_as_other(self) -> None:
        """A remote's made-up EDU type never becomes a metric label: it is counted as ``other``."""
        from prometheus_client import REGISTRY

        from synflow.federation.worker import inbound_handler

        db = await make_database(self, self.engine)
        handler = inbound_handler(db, None, None, allowed_origins=[R1], max_body_bytes=65536,  # type: ignore[arg-type]
                                  max_json_depth=16)

        def count(label: str) -> float:
            return REGISTRY.get_sample_value("synflow_federation_edus_received_total", {"edu_type": label}) or 0.0

        other, typing = count("other"), count("m.typing")
        made_up = f"x.attacker.{random.random()}"
        body = json.dumps({"origin": R1, "origin_server_ts": 1, "pdus": [], "edus": [
            {"edu_type": made_up, "content": {}}, {"edu_type": "m.typing", "content": {}}]}).encode()
        code, _ = await handler.on_send(R1, "edus1", body)
        self.assertEqual(code, 200)
        self.assertEqual((count("other") - other, count("m.typing") - typing), (1, 1))
        self.assertIsNone(REGISTRY.get_sample_value("synflow_federation_edus_received_total", {"edu_type": made_up}))

    async def test_outbox_trimmed_to_the_lowest_ack_of_all_senders(self) -> None:
        """FEDERATION_ACK trims federation_outbox only up to the lowest position every configured sender acked."""
        db = await make_database(self, self.engine)
        await db.run_interaction("fill", _fill_outbox, 10)
        queue = EduQueue(db, StreamWriters(db, {}), "master", ["s1", "s2"])

        async def ack(instance: str, token: int) -> int | None:
            d = queue.on_ack(None, FederationAckCommand(instance, token))
            return None if d is None else await d

        async def left() -> list[int]:
            rows = await db.run_interaction("left", _select, "SELECT stream_id FROM federation_outbox ORDER BY stream_id")
            return [r[0] for r in rows]

        self.assertIsNone(await ack("s1", 5))  # s2 has not acked: nothing may go
        self.assertEqual(await left(), list(range(1, 11)))
        self.assertEqual(await ack("s2", 3), 3)
        self.assertEqual(await left(), list(range(4, 11)))
        self.assertIsNone(await ack("s2", 2))  # stale: ignored
        self.assertIsNone(await ack("stranger", 100))  # not a configured sender: the bound stays 3
        self.assertEqual(await left(), list(range(4, 11)))
        self.assertEqual(await ack("s2", 8), 2)  # the lowest is now s1's 5
        self.assertEqual(await left(), list(range(6, 11)))
        self.assertEqual(await ack("s1", 9), 3)  # the lowest is now s2's 8
        self.assertEqual(await left(), [9, 10])
        self.assertEqual(queue.acks, {"s1": 9, "s2": 8, "stranger": 100})


def _select(txn: Txn, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    txn.execute(sql, args)
    return txn.fetchall()


def _fill_outbox(txn: Txn, n: int) -> None:
    txn.insert_many("federation_outbox", ("stream_id", "instance_name", "destination", "edu_type", "content"),
                    [(i, "master", R1, "m.typing", "{}") for i in range(1, n + 1)])


class SqliteDestinationStoreTests(DestinationStoreTestsMixin, TestCase):
    """The stores on SQLite."""

    engine = "sqlite"


class PostgresDestinationStoreTests(DestinationStoreTestsMixin, TestCase):
    """The stores on PostgreSQL."""

    engine = "postgres"
