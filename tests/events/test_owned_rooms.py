"""A persister keeps the rooms its transactions committed (OwnedRooms) and reads only the others.

The kept state must always be what the database holds: after every
committed transaction each kept room equals a fresh read, a persister that
keeps rooms decides every event as one that reads them all, a failed
transaction leaves nothing of itself kept, and an entry of another shard-map
epoch is read again. Real SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow import registry
from synflow.events import persist
from synflow.events.auth import RoomView
from synflow.events.persist import (
    EventPersister,
    EventSpec,
    OwnedRooms,
    _load_rooms_txn,
    _RoomState,
)
from synflow.events.shards import ShardState
from synflow.sharding import ShardMap
from synflow.storage.engines import Database
from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriters
from synflow.storage.instances import InstanceMap
from tests.dbutil import make_database
from tests.events.test_persist_batches import ALICE, HS, P1, create, message

BOB, CAROL, REMOTE = f"@bob:{HS}", f"@carol:{HS}", "@dave:remote.test"
USERS = (ALICE, BOB, CAROL, REMOTE)


def _state(room: _RoomState) -> dict[str, Any]:
    """What a room's kept state says, in comparable form (the parsed rules by their fields)."""
    view = room.view
    levels = view.power_levels
    return {"exists": view.exists, "creator": view.creator, "members": dict(view.members),
            "join_rule": view.join_rule,
            "power_levels": None if levels is None else levels.to_content(),
            "created_ts": room.created_ts, "latest_event_id": room.latest_event_id, "depth": room.depth,
            "join_rules_text": room.join_rules, "power_levels_text": room.power_levels}


def _event(kind: str, room: str, user: str, n: int) -> EventSpec:
    """One event of the generated histories (some of them refused by the rules, on purpose)."""
    origin = HS if not user.endswith(":remote.test") else "remote.test"
    if kind == "message":
        return message(room, f"m{n}", sender=user, origin=origin, txn_id=f"t{n}" if origin == HS else None,
                       event_id=None if origin == HS else f"$r{n}:remote.test")
    if kind in ("join", "leave"):
        return EventSpec(room, "m.room.member", user, {"membership": kind}, user, origin, n,
                         event_id=None if origin == HS else f"$r{n}:remote.test")
    if kind == "invite":
        return EventSpec(room, "m.room.member", ALICE, {"membership": "invite"}, user, HS, n)
    if kind in ("public", "private"):
        return EventSpec(room, "m.room.join_rules", user, {"join_rule": "public" if kind == "public" else "invite"},
                         "", origin, n)
    levels = {"users": {ALICE: 100, user: 50}, "state_default": 50, "invite": 0 if kind == "levels_open" else 50}
    return EventSpec(room, "m.room.power_levels", user, levels, "", origin, n)


KINDS = ("message", "join", "leave", "invite", "public", "private", "levels_open", "levels_closed")
histories = st.lists(
    st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.sampled_from(USERS)), min_size=1, max_size=6),
    min_size=1, max_size=8,
)


class _Persisters:
    """Two persisters on two databases, one keeping rooms and one reading them every time."""

    def __init__(self, testcase: TestCase, engine: str) -> None:
        self.testcase = testcase
        self.engine = engine

    async def make(self, *, keep: bool) -> tuple[Database, EventPersister]:
        db = await make_database(self.testcase, self.engine)
        await InstanceMap(db).ids_for([P1])
        gens = {s: MultiWriterIdGenerator(registry.streams()[s], P1, 0, reactor) for s in ("events", "caches")}
        ids = itertools.count()
        persister = EventPersister(StreamWriters(db, gens), server_name=HS, instance_name=P1, event_writers=[P1],
                                   clock=_FixedClock(), new_event_id=lambda: f"$e{next(ids)}:{HS}")
        if not keep:
            persister.rooms = OwnedRooms(max_rooms=0)
        return db, persister


class _FixedClock:
    """The same timestamps for both persisters (``created_ts``)."""

    def seconds(self) -> float:
        return 1_700_000_000.0


async def _fresh(db: Database, room_ids: set[str]) -> dict[str, dict[str, Any]]:
    rooms: dict[str, _RoomState] = await db.run_interaction("read rooms", _load_rooms_txn, room_ids)
    return {r: _state(room) for r, room in rooms.items()}


class OwnedRoomsMixin:
    engine = "sqlite"

    async def _check_history(self, batches: list[list[tuple[str, int, str]]]) -> None:
        persisters = _Persisters(self, self.engine)  # type: ignore[arg-type]
        kept_db, kept = await persisters.make(keep=True)
        read_db, reading = await persisters.make(keep=False)
        rooms = [f"!h{i}:{HS}" for i in range(3)]
        n = itertools.count(100)
        setup = [spec for room in rooms for spec in create(room)]
        for p in (kept, reading):
            await p.persist(setup)
        for batch in batches:
            specs = [_event(kind, rooms[r], user, next(n)) for kind, r, user in batch]
            got = await kept.persist(specs)
            expected = await reading.persist(specs)
            # the same decisions, event by event
            self.assertEqual(  # type: ignore[attr-defined]
                [(r.event_id, r.stream_ordering, None if r.error is None else r.error.errcode, r.duplicate)
                 for r in got],
                [(r.event_id, r.stream_ordering, None if r.error is None else r.error.errcode, r.duplicate)
                 for r in expected])
            # and every kept room is what its database holds
            held = {r: _state(room) for r, (room, _) in kept.rooms.lookup(set(rooms)).items()}
            self.assertEqual(held, await _fresh(kept_db, set(held)))  # type: ignore[attr-defined]
        self.assertEqual(await _fresh(kept_db, set(rooms)), await _fresh(read_db, set(rooms)))  # type: ignore[attr-defined]
        self.assertEqual(len(kept.rooms), len(rooms))  # type: ignore[attr-defined]

    async def test_a_history_of_joins_rules_and_messages(self) -> None:
        """A fixed history through every rule: both persisters decide alike, and what is kept is what is stored."""
        await self._check_history([
            [("message", 0, BOB), ("public", 0, ALICE), ("join", 0, BOB), ("message", 0, BOB)],
            [("levels_open", 1, ALICE), ("invite", 1, CAROL), ("join", 1, CAROL), ("message", 1, CAROL)],
            [("join", 0, REMOTE), ("message", 0, REMOTE), ("leave", 0, BOB), ("message", 0, BOB)],
            [("private", 0, ALICE), ("join", 0, CAROL), ("levels_closed", 2, ALICE), ("invite", 2, BOB)],
            [("message", 0, ALICE), ("message", 0, ALICE), ("join", 2, BOB)],
        ])

    async def test_a_room_read_once_is_not_read_again(self) -> None:
        """The second batch of a room loads no room (its head, rules and members come from the kept state)."""
        _, p = await _Persisters(self, self.engine).make(keep=True)  # type: ignore[arg-type]
        room = f"!once:{HS}"
        await p.persist(create(room))
        loaded: list[set[str]] = []
        load = persist._load_rooms_txn

        def counting(txn: Any, room_ids: set[str]) -> dict[str, _RoomState]:
            loaded.append(set(room_ids))
            return load(txn, room_ids)

        self.patch(persist, "_load_rooms_txn", counting)  # type: ignore[attr-defined]
        other = f"!other:{HS}"
        results = await p.persist([message(room, "one"), *create(other)])
        self.assertEqual([r.error for r in results], [None] * 3)  # type: ignore[attr-defined]
        self.assertEqual(loaded, [{other}])  # type: ignore[attr-defined]
        await p.persist([message(room, "two"), message(other, "three")])
        self.assertEqual(loaded, [{other}])  # type: ignore[attr-defined]

    async def test_a_failed_transaction_leaves_nothing_kept(self) -> None:
        """A join whose transaction fails after the rules accepted it is not kept: the room is read again."""
        db, p = await _Persisters(self, self.engine).make(keep=True)  # type: ignore[arg-type]
        room = f"!fail:{HS}"
        await p.persist(create(room) + [EventSpec(room, "m.room.join_rules", ALICE, {"join_rule": "public"}, "",
                                                  HS, 1)])
        self.assertIn(room, p.rooms.lookup({room}))  # type: ignore[attr-defined]
        write = persist._write_txn

        def failing(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("the disk is full")

        self.patch(persist, "_write_txn", failing)  # type: ignore[attr-defined]
        with self.assertRaises(RuntimeError):  # type: ignore[attr-defined]
            await p.persist([EventSpec(room, "m.room.member", BOB, {"membership": "join"}, BOB, HS, 1)])
        # Forgotten (the transaction failed), or kept as the last commit left it (SQLite commits the rolled-back
        # savepoint's sequence bump): never with Bob.
        for kept_room, _ in p.rooms.lookup({room}).values():
            self.assertNotIn(BOB, kept_room.members)  # type: ignore[attr-defined]
        self.patch(persist, "_write_txn", write)  # type: ignore[attr-defined]
        (sent,) = await p.persist([message(room, "not a member", sender=BOB)])
        assert sent.error is not None
        self.assertEqual(sent.error.errcode, "M_FORBIDDEN")  # type: ignore[attr-defined]
        ((kept, _),) = p.rooms.lookup({room}).values()
        self.assertNotIn(BOB, kept.members)  # type: ignore[attr-defined]
        self.assertEqual({room: _state(kept)}, await _fresh(db, {room}))  # type: ignore[attr-defined]

    async def test_a_room_kept_under_another_epoch_is_read_again(self) -> None:
        """Kept under epoch 1, the room is taken again only under epoch 1; under epoch 2 it is read (and re-kept)."""
        db, p = await _Persisters(self, self.engine).make(keep=True)  # type: ignore[arg-type]
        fence = _Fence(1)
        p.fence = fence  # type: ignore[assignment]
        room = f"!epoch:{HS}"
        await p.persist(create(room))
        self.assertEqual(p.rooms.lookup({room})[room][1], 1)  # type: ignore[attr-defined]

        # Another persister owned the room in between and let Bob in (what the database now holds).
        def joined_elsewhere(txn: Any) -> None:
            txn.execute("INSERT INTO room_memberships (room_id, user_id, server_name, membership, event_id, "
                        "stream_ordering) VALUES (?, ?, ?, 'join', ?, 1000)", (room, BOB, HS, f"$x:{HS}"))

        await db.run_interaction("elsewhere", joined_elsewhere)
        (refused,) = await p.persist([message(room, "same epoch", sender=BOB)])
        self.assertIsNotNone(refused.error)  # type: ignore[attr-defined]  # the kept state, as the epoch allows
        fence.epoch = 2
        (sent,) = await p.persist([message(room, "new epoch", sender=BOB)])
        self.assertIsNone(sent.error)  # type: ignore[attr-defined]
        room_state, epoch = p.rooms.lookup({room})[room]
        self.assertEqual((room_state.members.get(BOB), epoch), ("join", 2))  # type: ignore[attr-defined]

    generated = 15

    async def test_generated_histories(self) -> None:
        """Generated histories (derandomized): both persisters decide alike, and what is kept is what is stored."""
        examples: list[list[list[tuple[str, int, str]]]] = []

        @settings(max_examples=self.generated, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(histories)
        def collect(batches: list[list[tuple[str, int, str]]]) -> None:
            examples.append(batches)

        collect()
        self.assertGreater(len(examples), 1)  # type: ignore[attr-defined]
        for batches in examples:
            await self._check_history(batches)


class _Fence:
    """A shard map fence of one writer whose epoch the test sets."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def read_txn(self, txn: Any) -> ShardState:
        return ShardState(ShardMap([P1], epoch=self.epoch))


class SqliteOwnedRoomsTests(OwnedRoomsMixin, TestCase):
    engine = "sqlite"


class PostgresOwnedRoomsTests(OwnedRoomsMixin, TestCase):
    engine = "postgres"
    generated = 4  # two databases an example


class OwnedRoomsBoundsTest(SynchronousTestCase):
    @staticmethod
    def _room(room_id: str, members: int) -> _RoomState:
        return _RoomState(RoomView(room_id, True, ALICE, {f"@u{i}:{HS}": "join" for i in range(members)}))

    def test_least_recently_used_rooms_go_first(self) -> None:
        rooms = OwnedRooms(max_rooms=2, max_members=100)
        rooms.publish({"!a": self._room("!a", 1), "!b": self._room("!b", 1)}, 1)
        rooms.lookup({"!a"})  # used: "!b" is now the oldest
        rooms.publish({"!c": self._room("!c", 1)}, 1)
        self.assertEqual(set(rooms.lookup({"!a", "!b", "!c"})), {"!a", "!c"})

    def test_the_members_budget_evicts_and_a_room_over_it_is_not_kept(self) -> None:
        rooms = OwnedRooms(max_rooms=10, max_members=5)
        rooms.publish({"!a": self._room("!a", 3), "!b": self._room("!b", 2)}, None)
        rooms.publish({"!c": self._room("!c", 2)}, None)  # 7 > 5: "!a" goes
        self.assertEqual(set(rooms.lookup({"!a", "!b", "!c"})), {"!b", "!c"})
        rooms.publish({"!big": self._room("!big", 6)}, None)
        self.assertEqual(rooms.lookup({"!big"}), {})
        rooms.publish({"!b": self._room("!b", 6)}, None)  # grew past the budget: forgotten, not kept stale
        self.assertEqual(set(rooms.lookup({"!b", "!c"})), {"!c"})

    def test_discard(self) -> None:
        rooms = OwnedRooms()
        rooms.publish({"!a": self._room("!a", 2), "!b": self._room("!b", 2)}, 3)
        rooms.discard(["!a", "!missing"])
        self.assertEqual(set(rooms.lookup({"!a", "!b"})), {"!b"})
        self.assertEqual(len(rooms), 1)
