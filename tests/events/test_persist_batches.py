"""A persist batch with a bad event: refused alone, the rest of the batch persisted (real SQLite and PostgreSQL)."""

from __future__ import annotations

import itertools
import os
import shutil
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase

from synflow import registry
from synflow.events.bounds import MAX_SAFE_INTEGER
from synflow.events.persist import EventPersister, EventSpec, PersistResult
from synflow.http.server import refusal_status
from synflow.storage.engines import Database
from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriters
from synflow.storage.instances import InstanceMap
from synflow.storage.prepare import SCHEMA_DIR, prepare_database, split_sql
from tests.dbutil import make_database

HS = "hs.test"
P1 = "persister1"
ALICE = f"@alice:{HS}"


def create(room: str) -> list[EventSpec]:
    return [EventSpec(room, "m.room.create", ALICE, {}, "", HS, 1),
            EventSpec(room, "m.room.member", ALICE, {"membership": "join"}, ALICE, HS, 1)]


def message(room: str, body: Any, **overrides: Any) -> EventSpec:
    fields: dict[str, Any] = {"room_id": room, "type": "m.room.message", "sender": ALICE, "content": {"body": body},
                              "origin": HS, "origin_server_ts": 1}
    fields.update(overrides)
    return EventSpec(**fields)


class PersistBatchMixin:
    engine = "sqlite"

    async def _persister(self) -> tuple[Database, EventPersister]:
        db = await make_database(self, self.engine)  # type: ignore[arg-type]
        await InstanceMap(db).ids_for([P1])
        gens = {s: MultiWriterIdGenerator(registry.streams()[s], P1, 0, reactor) for s in ("events", "caches")}
        ids = itertools.count()
        persister = EventPersister(StreamWriters(db, gens), server_name=HS, instance_name=P1, event_writers=[P1],
                                   clock=reactor, new_event_id=lambda: f"$e{next(ids)}:{HS}")
        return db, persister

    async def _bodies(self, db: Database) -> list[str]:
        def read(txn: Any) -> list[str]:
            txn.execute("SELECT content FROM events WHERE type = 'm.room.message' ORDER BY stream_ordering")
            return [r[0] for r in txn.fetchall()]

        rows: list[str] = await db.run_interaction("read", read)
        return rows

    async def test_out_of_bounds_events_are_refused_before_the_batch(self) -> None:
        """Events with out-of-range integers, NaN, lone surrogates or over-long IDs get their own 400; the others of the call persist."""
        db, persister = await self._persister()
        rooms = [f"!r{i}:{HS}" for i in range(3)]
        await persister.persist([spec for room in rooms for spec in create(room)])
        bad = [message(rooms[0], MAX_SAFE_INTEGER + 1), message(rooms[1], float("nan")),
               message(rooms[2], "x", origin_server_ts=2**63), message(rooms[0], "\ud800"),
               message(rooms[1], "x", type="t" * 256), message(rooms[2], "x", event_id="$" + "e" * 16_384)]
        batch: list[EventSpec] = []
        for i, spec in enumerate(bad):
            batch += [message(rooms[i % 3], f"good{i}"), spec]
        results: list[PersistResult] = await persister.persist(batch)
        for i, result in enumerate(results):
            if i % 2:
                assert result.error is not None, batch[i]
                self.assertEqual((refusal_status(result.error), result.error.errcode), (400, "M_BAD_JSON"), batch[i])
            else:
                self.assertIsNone(result.error, batch[i])
        self.assertEqual(await self._bodies(db), [f'{{"body":"good{i}"}}' for i in range(len(bad))])

    async def test_a_failing_event_does_not_roll_back_its_batch(self) -> None:
        """When a batch's transaction fails, each event is retried alone: only the failing one is refused, in order."""
        db, persister = await self._persister()
        rooms = [f"!r{i}:{HS}" for i in range(4)]
        await persister.persist([spec for room in rooms for spec in create(room)])
        # A real database error for one event: a trigger that aborts its insert.
        if self.engine == "sqlite":
            ddl = ["CREATE TRIGGER poison BEFORE INSERT ON events WHEN NEW.content LIKE '%poison%' "
                   "BEGIN SELECT RAISE(ABORT, 'poisoned event'); END"]
        else:
            ddl = ["CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN IF NEW.content LIKE '%poison%' THEN "
                   "RAISE EXCEPTION 'poisoned event'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
                   "CREATE TRIGGER poison BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION poison()"]

        def install(txn: Any) -> None:
            for statement in ddl:
                txn.execute(statement)

        await db.run_interaction("poison", install)
        batch = [message(rooms[i % 4], "poison" if i == 5 else f"m{i}") for i in range(12)]
        results = await persister.persist(batch)
        self.assertEqual([r.error is None for r in results], [i != 5 for i in range(12)])
        error = results[5].error
        assert error is not None
        self.assertEqual((refusal_status(error), error.errcode), (500, "M_UNKNOWN"))
        self.assertEqual(await self._bodies(db), [f'{{"body":"m{i}"}}' for i in range(12) if i != 5])
        # The persister keeps working.
        (after,) = await persister.persist([message(rooms[0], "after")])
        self.assertIsNone(after.error)

    async def test_retried_txn_ids_of_several_senders(self) -> None:
        """Sends retried with their (sender, txn_id) in a later batch get their first events back; new pairs persist."""
        db, persister = await self._persister()
        room = f"!pub:{HS}"
        await persister.persist(create(room) + [EventSpec(room, "m.room.join_rules", ALICE, {"join_rule": "public"},
                                                          "", HS, 1)])
        bob, carol = f"@bob:{HS}", f"@carol:{HS}"
        await persister.persist([EventSpec(room, "m.room.member", u, {"membership": "join"}, u, HS, 1)
                                 for u in (bob, carol)])
        first = await persister.persist([message(room, "a1", txn_id="t1"), message(room, "b1", sender=bob, txn_id="t1"),
                                         message(room, "a2", txn_id="t2")])
        again = await persister.persist([message(room, "b1", sender=bob, txn_id="t1"), message(room, "a1", txn_id="t1"),
                                         message(room, "c1", sender=carol, txn_id="t1"),
                                         message(room, "b2", sender=bob, txn_id="t2")])
        self.assertEqual([r.error for r in first + again], [None] * 7)
        self.assertEqual([(r.event_id, r.duplicate) for r in again[:2]],
                         [(first[1].event_id, True), (first[0].event_id, True)])
        self.assertEqual([r.duplicate for r in again[2:]], [False, False])
        self.assertFalse({r.event_id for r in again[2:]} & {r.event_id for r in first})
        self.assertEqual(await self._bodies(db), [f'{{"body":"{b}"}}' for b in ("a1", "b1", "a2", "c1", "b2")])

    async def test_unparsable_stored_state_counts_as_absent(self) -> None:
        """A join rule or power levels stored before the rules (not parsable now) is ignored, not a failure of every later batch."""
        db, persister = await self._persister()
        room = f"!old:{HS}"
        await persister.persist(create(room))

        def corrupt(txn: Any) -> None:
            for n, (event_type, content) in enumerate((("m.room.join_rules", '{"join_rule":"knock"}'),
                                                        ("m.room.power_levels", '{"kick":"high"}'))):
                event_id = f"$legacy{n}:{HS}"
                txn.execute("INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, "
                            "sender, content, origin_server_ts, origin, depth, received_ts) "
                            "VALUES (?, ?, ?, ?, ?, '', ?, ?, 1, ?, 1, 1)",
                            (-1 - n, P1, event_id, room, event_type, ALICE, content, HS))
                txn.execute("INSERT INTO current_state (room_id, type, state_key, event_id) VALUES (?, ?, '', ?)",
                            (room, event_type, event_id))
            txn.execute_raw(_migration_0005_backfill())  # what the migration makes of such a database

        await db.run_interaction("corrupt", corrupt)
        persister.rooms.discard([room])  # the stored state is read, as a process started on this database reads it
        (sent,) = await persister.persist([message(room, "still works")])
        self.assertIsNone(sent.error)
        (joined,) = await persister.persist([EventSpec(room, "m.room.member", f"@bob:{HS}", {"membership": "join"},
                                                       f"@bob:{HS}", HS, 1)])
        assert joined.error is not None
        self.assertEqual((refusal_status(joined.error), joined.error.errcode), (403, "M_FORBIDDEN"))  # the default rule: invite


    async def _rules_columns(self, db: Database, room: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The room's rules columns, and the content of the events current_state holds for them."""
        def read(txn: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            txn.execute("SELECT join_rules, power_levels FROM rooms WHERE room_id = ?", (room,))
            columns = tuple(txn.fetchone())
            state = []
            for event_type in ("m.room.join_rules", "m.room.power_levels"):
                txn.execute("SELECT e.content FROM current_state cs JOIN events e ON e.event_id = cs.event_id "
                            "WHERE cs.room_id = ? AND cs.type = ? AND cs.state_key = ''", (room, event_type))
                row = txn.fetchone()
                state.append(None if row is None else row[0])
            return columns, tuple(state)

        got: tuple[tuple[Any, ...], tuple[Any, ...]] = await db.run_interaction("rules", read)
        return got

    async def test_rules_are_read_with_the_room_and_follow_current_state(self) -> None:
        """The rooms row carries the content of the current join rules and power levels, changed with the state.

        The persist transaction reads a room's rules from its row: a join
        refused under the default rule (invite) is allowed once the rules say
        public, and refused again once they say invite, each in a later
        transaction; in every batch the columns equal current_state's
        events' content, and a state event with a state key leaves them be.
        """
        db, persister = await self._persister()
        room = f"!rules:{HS}"
        bob = f"@bob:{HS}"
        await persister.persist(create(room))
        self.assertEqual(await self._rules_columns(db, room), ((None, None), (None, None)))

        def join(user: str) -> EventSpec:
            return EventSpec(room, "m.room.member", user, {"membership": "join"}, user, HS, 1)

        def rules(rule: str, sender: str = ALICE) -> EventSpec:
            return EventSpec(room, "m.room.join_rules", sender, {"join_rule": rule}, "", HS, 1)

        (refused,) = await persister.persist([join(bob)])
        self.assertIsNotNone(refused.error)
        levels = EventSpec(room, "m.room.power_levels", ALICE, {"users": {ALICE: 100}, "state_default": 50}, "", HS, 1)
        results = await persister.persist([levels, rules("public")])
        self.assertEqual([r.error for r in results], [None, None])
        columns, state = await self._rules_columns(db, room)
        self.assertEqual(columns, ('{"join_rule":"public"}', '{"users":{"@alice:hs.test":100},"state_default":50}'))
        self.assertEqual(columns, state)

        (joined,) = await persister.persist([join(bob)])
        self.assertIsNone(joined.error)
        # A state event of the same type with a state key is not the room's rule.
        results = await persister.persist([EventSpec(room, "m.room.join_rules", ALICE, {"join_rule": "invite"},
                                                     "other", HS, 1), rules("invite")])
        self.assertEqual([r.error for r in results], [None, None])
        columns, state = await self._rules_columns(db, room)
        self.assertEqual(columns[0], '{"join_rule":"invite"}')
        self.assertEqual(columns, state)
        (refused,) = await persister.persist([join(f"@carol:{HS}")])
        assert refused.error is not None
        self.assertEqual((refusal_status(refused.error), refused.error.errcode), (403, "M_FORBIDDEN"))

    async def test_a_refused_rules_change_leaves_the_columns(self) -> None:
        """A join rules event the rules refuse (a sender without the power) changes neither the state nor the column."""
        db, persister = await self._persister()
        room = f"!refused:{HS}"
        bob = f"@bob:{HS}"
        await persister.persist(create(room))
        await persister.persist([EventSpec(room, "m.room.power_levels", ALICE, {"users": {ALICE: 100}, "state_default": 50},
                                           "", HS, 1),
                                 EventSpec(room, "m.room.join_rules", ALICE, {"join_rule": "public"}, "", HS, 1)])
        (joined,) = await persister.persist([EventSpec(room, "m.room.member", bob, {"membership": "join"}, bob, HS, 1)])
        self.assertIsNone(joined.error)
        (refused,) = await persister.persist([EventSpec(room, "m.room.join_rules", bob, {"join_rule": "invite"},
                                                        "", HS, 1)])
        self.assertIsNotNone(refused.error)
        columns, state = await self._rules_columns(db, room)
        self.assertEqual(columns[0], '{"join_rule":"public"}')
        self.assertEqual(columns, state)

    async def test_migration_fills_the_rules_columns_of_existing_rooms(self) -> None:
        """Migration 0005 gives the rooms of a database made before it the content of their current rules."""
        before = self.mktemp()  # type: ignore[attr-defined]
        os.makedirs(before)
        for path in SCHEMA_DIR.glob("000[1-4]_*.sql"):
            shutil.copy(path, before)
        db = await make_database(self, self.engine, schema_dir=before)  # type: ignore[arg-type]
        rows = {"!both:hs.test": ('{"join_rule":"public"}', '{"users":{}}'), "!none:hs.test": (None, None)}

        def old_rooms(txn: Any) -> None:
            n = 0
            for room, (join_rules, power_levels) in rows.items():
                txn.execute("INSERT INTO rooms (room_id, creator, created_ts) VALUES (?, ?, 1)", (room, ALICE))
                for event_type, state_key, content in (("m.room.join_rules", "", join_rules),
                                                       ("m.room.power_levels", "", power_levels),
                                                       ("m.room.join_rules", "other", '{"join_rule":"knock"}')):
                    if content is None:
                        continue
                    n += 1
                    txn.execute("INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, "
                                "state_key, sender, content, origin_server_ts, origin, depth, received_ts) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, 1, 1)",
                                (n, P1, f"$old{n}", room, event_type, state_key, ALICE, content, HS))
                    txn.execute("INSERT INTO current_state (room_id, type, state_key, event_id) VALUES (?, ?, ?, ?)",
                                (room, event_type, state_key, f"$old{n}"))

        await db.run_interaction("old rooms", old_rooms)
        await prepare_database(db, apply=True)  # synflow's own schema: 0005 and any later

        def columns(txn: Any) -> dict[str, tuple[Any, ...]]:
            txn.execute("SELECT room_id, join_rules, power_levels FROM rooms")
            return {r[0]: tuple(r[1:]) for r in txn.fetchall()}

        self.assertEqual(await db.run_interaction("columns", columns), rows)


def _migration_0005_backfill() -> str:
    """The backfill statement of migration 0005 (``rooms.join_rules`` and ``power_levels`` from current_state)."""
    statements = split_sql((SCHEMA_DIR / "0005_room_rules.sql").read_text(encoding="utf-8"), "sqlite")
    (update,) = [st for st in statements if st.lstrip().startswith("UPDATE rooms")]
    return update


class SqlitePersistBatchTests(PersistBatchMixin, TestCase):
    """On SQLite."""

    engine = "sqlite"


class PostgresPersistBatchTests(PersistBatchMixin, TestCase):
    """On PostgreSQL."""

    engine = "postgres"


class EventSpecJsonTest(SynchronousTestCase):
    def test_to_json_round_trips_every_field(self) -> None:
        """to_json names every field (as attrs.asdict would) and from_json rebuilds the same spec."""
        import attrs

        spec = EventSpec("!r:hs", "m.room.member", "@u:hs", {"membership": "join", "x": [1, {"y": 2}]}, "@u:hs",
                         "hs", 5, "t1", "$e")
        self.assertEqual(spec.to_json(), attrs.asdict(spec))
        self.assertEqual(EventSpec.from_json(spec.to_json()), spec)


class ParsedRulesTest(SynchronousTestCase):
    """The join rules and power levels a batch loads are parsed once per content, read-only and bounded."""

    def test_same_content_parsed_once(self) -> None:
        from types import MappingProxyType

        from synflow.events import persist as persist_module
        from synflow.events.auth import JoinRule, PowerLevels

        text = '{"users":{"@a:hs":100},"kick":75}'
        first = persist_module._parsed_rule("m.room.power_levels", text)
        assert isinstance(first, PowerLevels)
        self.assertIs(persist_module._parsed_rule("m.room.power_levels", text), first)
        self.assertEqual((first.level_of("@a:hs"), first.kick), (100, 75))
        self.assertIsInstance(first.users, MappingProxyType)  # shared between batches: nobody may change it
        with self.assertRaises(TypeError):
            first.users["@b:hs"] = 100  # type: ignore[index]
        changed = persist_module._parsed_rule("m.room.power_levels", '{"users":{"@a:hs":100},"kick":50}')
        self.assertEqual(changed.kick, 50)  # type: ignore[union-attr]
        self.assertIs(persist_module._parsed_rule("m.room.join_rules", '{"join_rule":"public"}'), JoinRule.PUBLIC)
        self.assertIsInstance(persist_module._parsed_rule("m.room.power_levels", '{"kick":"high"}'), Exception)

    def test_bounded(self) -> None:
        from synflow.events import persist as persist_module

        self.patch(persist_module, "_RULES_PARSED_MAX", 3)
        self.patch(persist_module, "_RULES_PARSED", {})
        for n in range(10):
            persist_module._parsed_rule("m.room.power_levels", f'{{"kick":{n}}}')
            self.assertLessEqual(len(persist_module._RULES_PARSED), 3)


class _HeldWrites:
    """Stream writers whose transactions finish when the test says: each call's specs, and its Deferred."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[EventSpec], Any]] = []

    def run_write(self, desc: str, streams: Any, func: Any, specs: list[EventSpec], ids: list[str],
                  **kwargs: Any) -> Any:
        from twisted.internet.defer import Deferred

        d: Deferred[list[PersistResult]] = Deferred()
        self.calls.append((list(specs), d))
        return d


class InFlightCapTest(SynchronousTestCase):
    def _persister(self, **kwargs: Any) -> tuple[_HeldWrites, EventPersister]:
        from twisted.internet.task import Clock

        writers = _HeldWrites()
        ids = itertools.count()
        persister = EventPersister(writers, server_name=HS, instance_name=P1, event_writers=[P1],  # type: ignore[arg-type]
                                   clock=Clock(), new_event_id=lambda: f"$e{next(ids)}:{HS}", **kwargs)
        return writers, persister

    def test_one_transaction_at_a_time_and_later_events_go_together(self) -> None:
        """By default one transaction runs; the events that arrive meanwhile share the next one, in order."""
        writers, persister = self._persister()
        rooms = [f"!r{i}:{HS}" for i in range(5)]
        results = [persister.persist([message(room, "x")]) for room in rooms]
        self.assertEqual([[s.room_id for s in specs] for specs, _ in writers.calls], [rooms[:1]])
        writers.calls[0][1].callback([PersistResult("$a", 1, P1)])
        self.assertEqual([[s.room_id for s in specs] for specs, _ in writers.calls], [rooms[:1], rooms[1:]])
        self.assertEqual(self.successResultOf(results[0])[0].event_id, "$a")
        writers.calls[1][1].callback([PersistResult(f"$e{r}", 2 + i, P1) for i, r in enumerate(rooms[1:])])
        self.assertEqual([self.successResultOf(r)[0].event_id for r in results[1:]], [f"$e{r}" for r in rooms[1:]])

    def test_a_higher_cap_runs_transactions_of_other_rooms_side_by_side(self) -> None:
        """With max_in_flight=2, a second room's event starts at once; the same room's waits for its first."""
        writers, persister = self._persister(max_in_flight=2)
        a, b = f"!a:{HS}", f"!b:{HS}"
        persister.persist([message(a, "1")])
        persister.persist([message(a, "2")])
        persister.persist([message(b, "1")])
        self.assertEqual([[(s.room_id, s.content["body"]) for s in specs] for specs, _ in writers.calls],
                         [[(a, "1")], [(b, "1")]])
        writers.calls[1][1].callback([PersistResult("$b1", 2, P1)])
        self.assertEqual(len(writers.calls), 2)  # a's second event waits for a's first: room order
        writers.calls[0][1].callback([PersistResult("$a1", 1, P1)])
        self.assertEqual([(s.room_id, s.content["body"]) for s in writers.calls[2][0]], [(a, "2")])

    def test_a_failed_batch_retried_alone_does_not_hold_up_other_rooms(self) -> None:
        """While a failed batch is retried an event at a time, other rooms' events are written; its rooms wait."""
        writers, persister = self._persister()
        a, b, c, d = (f"!{x}:{HS}" for x in "abcd")

        def rooms_of(call: int) -> list[str]:
            return [s.room_id for s in writers.calls[call][0]]

        first = persister.persist([message(a, "1")])
        pending = [persister.persist([message(b, "1")]), persister.persist([message(c, "1")])]
        writers.calls[0][1].callback([PersistResult("$a1", 1, P1)])
        self.assertEqual(rooms_of(1), [b, c])  # the two waiting events, in one transaction
        other = persister.persist([message(d, "1")])
        later_b = persister.persist([message(b, "2")])
        self.assertEqual(len(writers.calls), 2)  # the cap: one transaction at a time
        drained = persister.drain()
        writers.calls[1][1].errback(RuntimeError("the batch's transaction failed"))
        self.assertEqual([rooms_of(i) for i in range(2, len(writers.calls))], [[d], [b]])  # d goes on; b alone
        writers.calls[2][1].callback([PersistResult("$d1", 2, P1)])
        self.assertEqual(self.successResultOf(other)[0].event_id, "$d1")
        self.assertEqual(len(writers.calls), 4)  # b's later event waits for b's retry: room order
        writers.calls[3][1].callback([PersistResult("$b1", 3, P1)])
        self.assertEqual(rooms_of(4), [c])  # the retries go one after another
        self.assertNoResult(drained)
        writers.calls[4][1].callback([PersistResult("$c1", 4, P1)])
        self.assertEqual([self.successResultOf(p)[0].event_id for p in pending], ["$b1", "$c1"])
        self.assertEqual(rooms_of(5), [b])  # b's later event, after b's first
        self.assertNoResult(drained)
        writers.calls[5][1].callback([PersistResult("$b2", 5, P1)])
        self.assertEqual(self.successResultOf(later_b)[0].event_id, "$b2")
        self.assertIsNone(self.successResultOf(drained))
        self.assertEqual(self.successResultOf(first)[0].event_id, "$a1")
