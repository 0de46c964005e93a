"""Federation in the processes, on real databases: the sender's events follower and the master's inbound /send.

* :class:`~synflow.federation.worker.EventsFollower` turns events-stream
  positions (delivered to a real :class:`ReplicationHandler`) into
  per-destination sends, for the destinations this sender owns, to the
  servers that were in the room *at each event* (as the persister recorded
  them) -- not the servers in it when the follower gets there.
* :func:`~synflow.federation.worker.inbound_handler` clears a backed-off
  origin's row in ``destinations`` and announces ``REMOTE_SERVER_UP``, which
  wakes the owning sender at once (its periodic wake-up is an hour away here);
  an origin not backed off costs a read and nothing more.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from synflow import registry
from synflow.events.persist import EventPersister
from synflow.events.router import EventRouter
from synflow.federation.policy import RetryState
from synflow.federation.sender import FederationSender
from synflow.federation.storage import SqlDestinationStore
from synflow.federation.worker import EventsFollower, inbound_handler
from synflow.replication.commands import (
    AnyCommand,
    PositionCommand,
    RemoteServerUpCommand,
    encode_line,
    parse_line,
)
from synflow.replication.handler import ReplicationHandler
from synflow.sharding import shard_for
from synflow.storage.engines import Database
from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriters
from synflow.storage.instances import InstanceMap
from tests.dbutil import make_database
from tests.federation.fakes import FakeTransport, fast_config
from tests.federation.sql import SERVER, create_room, member, message, persist, until

P1, P2 = "persister1", "persister2"
ALICE = f"@alice:{SERVER}"
SENDERS = ["fs1", "fs2"]


class Conn:
    """The far end of a replication connection, recording what it is sent."""

    def __init__(self) -> None:
        self.sent: list[AnyCommand] = []

    def send_command(self, cmd: AnyCommand) -> None:
        self.sent.append(cmd)


class Relay:
    """A hub between two handlers: each command crosses as its wire line."""

    def __init__(self, to: ReplicationHandler) -> None:
        self.to = to
        self.conn = Conn()
        self.lines: list[str] = []

    def send_command(self, cmd: AnyCommand) -> None:
        line = encode_line(cmd)
        self.lines.append(line)
        self.to.on_command(self.conn, parse_line(line))


class SenderProcess:
    """A federation sender's parts as the app wires them: handler, follower, sender, over a real database."""

    def __init__(self, db: Database, positions: dict[str, int], *, instances: list[str], name: str = "fs1",
                 wakeup_interval_s: float = 3600.0) -> None:
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.handler = ReplicationHandler(name, self.clock, streams=registry.streams(), sources={},
                                          initial_positions={"events": dict(positions)})
        self.conn = Conn()
        self.handler.new_connection(self.conn)
        self.store = SqlDestinationStore(db)
        self.follower = EventsFollower(self.store, self.handler, InstanceMap(db), SERVER, name, self.clock)
        self.transport = FakeTransport(self.clock)
        self.sender = FederationSender(
            server_name=SERVER, instance_name=name, instances=instances, store=self.store,
            transport=self.transport, clock=self.clock, rng=random.Random(3),
            config=fast_config(wakeup_interval_s=wakeup_interval_s), events_position=self.follower.events_position,
        )
        self.handler.add_command_listener(
            RemoteServerUpCommand, lambda _conn, cmd: self.sender.notify_remote_server_up(cmd.server_name)
        )

    async def start(self, settle: Sequence[str] = ()) -> None:
        """Start the sender and the follower; let the queues of ``settle`` finish their start-up catch-up."""
        await self.sender.start()
        await self.follower.start(self.sender)
        self.clock.advance(0)  # the end of the reactor turn: the follower reads what it was told of
        for destination in settle:
            self.sender.wake_destination(destination)
            queue = self.sender.queue(destination)
            await until(lambda q=queue: not q.catching_up and not q.in_flight, f"{destination} to settle")

    async def stop(self) -> None:
        await self.sender.stop()
        await self.follower.stop()

    def position(self, writer: str, new: int) -> None:
        """The events stream says ``writer`` reached ``new`` (as its POSITION command would)."""
        self.handler.on_command(self.conn, PositionCommand("events", writer, self.handler.position("events", writer),
                                                           new))
        self.clock.advance(0)  # the end of the reactor turn: the follower reads up to it

    def events_to(self, destination: str) -> list[str]:
        return self.transport.events_to(destination)


def owned_and_foreign(n: int) -> tuple[list[str], list[str]]:
    """``n`` server names fs1 owns and ``n`` it does not."""
    owned, foreign = [], []
    for i in range(100):
        name = f"s{i}.test"
        (owned if shard_for(name, SENDERS) == "fs1" else foreign).append(name)
    return owned[:n], foreign[:n]


class WorkerTestsMixin:
    """The follower and the inbound handler on one engine."""

    engine: str

    async def _db(self) -> Database:
        db = await make_database(self, self.engine)
        await InstanceMap(db).ids_for([P1, P2])
        return db

    async def test_follower_sends_each_new_local_event_to_owned_destinations_only(self) -> None:
        """Events-stream positions from two writers become one send per event and owned destination, in writer order."""
        db = await self._db()
        owned, foreign = owned_and_foreign(3)
        big, small = "!big:local.test", "!small:local.test"
        setup_a = [*create_room(big, ALICE), *(member(big, f"@u:{s}", "invite", sender=ALICE) for s in owned + foreign)]
        setup_b = [*create_room(small, ALICE), member(small, f"@u:{owned[0]}", "invite", sender=ALICE),
                   member(small, f"@u:{foreign[0]}", "invite", sender=ALICE)]
        await persist(db, P1, list(enumerate(setup_a, start=1)))
        await persist(db, P2, list(enumerate(setup_b, start=100)))
        p = SenderProcess(db, {P1: 99, P2: 199}, instances=SENDERS)
        await p.start(settle=owned)
        p.transport.sent.clear()  # the start-up catch-up's invites: this test is about the new events
        # Stream IDs interleave the writers; persister2 completes (and is announced) first.
        await persist(db, P2, [(202, message(small, ALICE, "b1")), (204, message(small, ALICE, "b2"))])
        await persist(db, P1, [(201, message(big, ALICE, "a1")), (203, message(big, ALICE, "a2")),
                               (205, message(big, ALICE, "a3"))])
        a = [f"$so{i}:{SERVER}" for i in (201, 203, 205)]
        b = [f"$so{i}:{SERVER}" for i in (202, 204)]
        p.position(P2, 204)
        await until(lambda: p.events_to(owned[0]) == b, "persister2's events to reach their destination")
        p.position(P1, 205)
        await until(lambda: all(len(p.events_to(d)) == (5 if d == owned[0] else 3) for d in owned),
                    "persister1's events to reach every owned destination")
        self.assertEqual(p.events_to(owned[0]), b + a)
        for d in owned[1:]:
            self.assertEqual(p.events_to(d), a)
        self.assertEqual(set(p.sender.queues), set(owned))
        self.assertEqual([s for s in p.transport.sent if s.destination not in owned], [])
        self.assertEqual(p.transport.max_in_flight[owned[0]], 1)
        await p.stop()

    async def test_positions_of_one_turn_are_read_together(self) -> None:
        """Positions that arrive in one reactor turn (a writer's events, each announced with its own ID, and
        another writer's) are read once per writer at the turn's end: nothing is read before it, and every
        event is sent, in order."""
        db = await self._db()
        owned, _ = owned_and_foreign(1)
        room = "!r:local.test"
        await persist(db, P1, list(enumerate([*create_room(room, ALICE),
                                              member(room, f"@u:{owned[0]}", "invite", sender=ALICE)], start=1)))
        p = SenderProcess(db, {P1: 99, P2: 199}, instances=SENDERS)
        await p.start(settle=owned)
        p.transport.sent.clear()
        reads: list[tuple[str, int, int]] = []
        read = p.store.local_events_between

        def counted(instance: str, after: int, upto: int, *args: Any, **kwargs: Any) -> Any:
            reads.append((instance, after, upto))
            return read(instance, after, upto, *args, **kwargs)

        p.store.local_events_between = counted  # type: ignore[method-assign]
        await persist(db, P1, [(201, message(room, ALICE, "a1")), (203, message(room, ALICE, "a2")),
                               (205, message(room, ALICE, "a3"))])
        await persist(db, P2, [(202, message(room, ALICE, "b1"))])
        for writer, position in ((P1, 201), (P1, 203), (P2, 202), (P1, 205)):  # one turn: the clock stands still
            p.handler.on_command(p.conn, PositionCommand("events", writer, p.handler.position("events", writer),
                                                         position))
        self.assertEqual(reads, [])
        p.clock.advance(0)
        self.assertEqual(sorted(reads), [(P1, 99, 205), (P2, 199, 202)])
        expected = [f"$so{i}:{SERVER}" for i in (201, 203, 205)]
        await until(lambda: sorted(p.events_to(owned[0])) == sorted([*expected, f"$so202:{SERVER}"]),
                    "every event to reach the destination", show=lambda: p.events_to(owned[0]))
        self.assertEqual([e for e in p.events_to(owned[0]) if e != f"$so202:{SERVER}"], expected)
        await p.stop()

    async def test_destinations_are_the_servers_in_the_room_at_each_event(self) -> None:
        """Each event goes to the servers in the room when it was persisted: a leaver keeps what came before, a newcomer gets its invite, a server removed by an event gets that event."""
        db = await self._db()
        room = "!r:local.test"
        bob, dave, carol = "@bob:r1.test", "@dave:r2.test", "@carol:r3.test"
        events = [
            *create_room(room, ALICE), member(room, bob, "invite", sender=ALICE),
            member(room, dave, "invite", sender=ALICE), member(room, bob, "join"), member(room, dave, "join"),
            message(room, ALICE, "m1"),
            member(room, dave, "leave"),  # r2.test's last member leaves (its own PDU)
            message(room, ALICE, "m2"),
            member(room, carol, "invite", sender=ALICE),  # r3.test comes in with this event
            message(room, ALICE, "m3"),
            member(room, bob, "ban", sender=ALICE),  # this event removes r1.test
            message(room, ALICE, "m4"),
        ]
        await persist(db, P1, list(enumerate(events, start=1)))
        invite_bob, invite_dave, m1, m2, invite, m3, ban, m4 = (
            f"$so{i}:{SERVER}" for i in (3, 4, 7, 9, 10, 11, 12, 13))
        # The follower only gets there now, when r3.test is the only server left in the room.
        p = SenderProcess(db, {P1: 0}, instances=[])
        await p.start(settle=["r1.test", "r2.test", "r3.test"])
        p.position(P1, len(events))
        expected = {"r1.test": [invite_bob, invite_dave, m1, m2, invite, m3, ban], "r2.test": [invite_dave, m1],
                    "r3.test": [invite, m3, ban, m4]}
        await until(lambda: {d: p.events_to(d) for d in expected} == expected, f"the sends {expected}",
                    show=lambda: {d: p.events_to(d) for d in expected})
        self.assertNotIn(SERVER, p.sender.queues)
        await p.stop()

    async def test_follower_reads_in_batches_and_resumes_after_a_restart(self) -> None:
        """More events than one read holds all go out in order; a restarted follower resumes at its saved position."""
        db = await self._db()
        room = "!r:local.test"
        await persist(db, P1, list(enumerate([*create_room(room, ALICE), member(room, "@bob:r1.test", "invite", sender=ALICE)],
                                             start=1)))
        first = [(i, message(room, ALICE, f"m{i}")) for i in range(4, 4 + 510)]
        await persist(db, P1, first)
        p = SenderProcess(db, {P1: 3}, instances=[])
        await p.start(settle=["r1.test"])
        p.position(P1, 513)
        ids = [f"$so{i}:{SERVER}" for i, _ in first]
        # The start-up catch-up sends bob's invite (owed, below the follower's start), then the follower the rest.
        await until(lambda: p.events_to("r1.test") == [f"$so3:{SERVER}", *ids], "the invite and 510 events in order",
                    show=lambda: p.events_to("r1.test")[:5])
        self.assertEqual(p.follower.pdus_fed, 510)
        await p.stop()  # saves how far the follower got

        more = [(i, message(room, ALICE, f"m{i}")) for i in range(514, 520)]
        await persist(db, P1, more)
        # The restarted process's handler already knows persister1 is at 519.
        q = SenderProcess(db, {P1: 519}, instances=[])
        await q.start()
        await until(lambda: q.follower.processed.get(P1) == 519, "the follower to reach 519")
        self.assertEqual(q.follower.pdus_fed, len(more))  # from the saved 513: not from 0, not from 519
        # A fresh queue catches up first: the room's latest event certainly goes, nothing goes twice.
        await until(lambda: f"$so519:{SERVER}" in q.events_to("r1.test"), "the latest event to go out")
        sent = q.events_to("r1.test")
        self.assertEqual(len(sent), len(set(sent)))
        self.assertTrue(set(sent) <= {f"$so{i}:{SERVER}" for i, _ in more}, sent)
        await q.stop()

    async def test_start_up_catches_up_outstanding_destinations(self) -> None:
        """A sender started with rows its destination never got sends them at start-up, without new events or the wake-up."""
        db = await self._db()
        room = "!r:local.test"
        events = [*create_room(room, ALICE), member(room, "@bob:r1.test", "invite", sender=ALICE),
                  message(room, ALICE, "a"), message(room, ALICE, "b")]
        await persist(db, P1, list(enumerate(events, start=1)))
        await db.run_interaction("saved", lambda txn: txn.execute(
            "INSERT INTO federation_stream_position (type, instance_name, token) VALUES ('events', 'fs1', 's5')"))
        p = SenderProcess(db, {P1: 5}, instances=[], wakeup_interval_s=3600)
        await p.start()
        # Every local event r1.test was owed, oldest first: bob's invite and both messages after it.
        owed = [f"$so{i}:{SERVER}" for i in (3, 4, 5)]
        await until(lambda: p.events_to("r1.test") == owed, "every owed event at start-up",
                    show=lambda: p.events_to("r1.test"))
        self.assertEqual(p.follower.pdus_fed, 0)
        await p.stop()

    async def test_inbound_request_clears_the_backoff_and_announces_remote_server_up(self) -> None:
        """An accepted /send from a backed-off origin clears its row in destinations and sends REMOTE_SERVER_UP; a refused one does neither."""
        db = await self._db()
        store = SqlDestinationStore(db)
        backoff = RetryState(1_000_000, 7_200_000, 1_000_000)
        for origin in ("r1.test", "r2.test"):
            await store.set_retry(origin, backoff)
        master, persisted = self._master(db)
        sent = Conn()
        master.set_transport(sent)
        inbound = self._inbound(db, master)

        async def retry_of(origin: str) -> RetryState:
            record = await store.get_destination(origin)
            assert record is not None
            return record.retry

        code, reply = await inbound.on_send(None, "t1", b'{"origin": "r2.test", "pdus": "not a list"}')
        self.assertEqual(code, 400)
        code, reply = await inbound.on_send(None, "t1", _body("r1.test", "$e1:r1.test"))
        self.assertEqual((code, reply), (200, {"pdus": {"$e1:r1.test": {}}}))
        await until(lambda: sent.sent, "REMOTE_SERVER_UP r1.test")
        self.assertEqual(sent.sent, [RemoteServerUpCommand("r1.test")])
        self.assertEqual(await retry_of("r1.test"), RetryState())
        self.assertEqual(await retry_of("r2.test"), backoff)
        # The transaction again: answered from received_transactions, persisted once.
        self.assertEqual(await inbound.on_send(None, "t1", _body("r1.test", "$e1:r1.test")), (200, reply))
        self.assertEqual(await persisted(), ["$e1:r1.test"])

    async def test_inbound_request_from_a_server_not_backed_off_writes_and_announces_nothing(self) -> None:
        """An origin with a cleared row, or none, costs a read: no write to destinations, no REMOTE_SERVER_UP."""
        db = await self._db()
        store = SqlDestinationStore(db)
        await store.set_retry("r1.test", RetryState())
        master, _ = self._master(db)
        sent = Conn()
        master.set_transport(sent)
        inbound = self._inbound(db, master)
        for origin, txn in (("r1.test", "t1"), ("r3.test", "t2")):
            code, _ = await inbound.on_send(None, txn, _body(origin, f"$e1:{origin}"))
            self.assertEqual(code, 200)
            # What each accepted request starts, awaited here: the check of the origin's backoff.
            await inbound._on_remote_server_up(origin)
        self.assertEqual(sent.sent, [])
        self.assertIsNone(await store.get_destination("r3.test"))  # no row written for a server never backed off

    async def test_remote_server_up_wakes_the_owning_sender_at_once(self) -> None:
        """A backed-off destination is sent its outstanding events as soon as it sends us a transaction, without waiting for the wake-up."""
        db = await self._db()
        room = "!r:local.test"
        owned, _ = owned_and_foreign(1)
        dest = owned[0]
        events = [*create_room(room, ALICE), member(room, f"@u:{dest}", "invite", sender=ALICE), message(room, ALICE, "hello")]
        await persist(db, P1, list(enumerate(events, start=1)))
        store = SqlDestinationStore(db)
        await store.set_retry(dest, RetryState(1_000_000_000, 7_200_000, 1_000_000_000))  # two hours, from now
        p = SenderProcess(db, {P1: len(events)}, instances=SENDERS, wakeup_interval_s=3600)
        await p.start()
        await until(lambda: dest in p.sender.queues and p.sender.queues[dest].backing_off,
                    "the sender to find the outstanding destination in backoff")
        p.clock.advance(59)  # nothing is due for two hours (and the wake-up is an hour away)
        self.assertEqual(p.transport.sent, [])
        master, _ = self._master(db)
        relay = Relay(p.handler)
        master.set_transport(relay)
        code, _ = await self._inbound(db, master).on_send(None, "t1", _body(dest))
        self.assertEqual(code, 200)
        await until(lambda: relay.lines, "REMOTE_SERVER_UP")  # once the cleared backoff is stored
        self.assertEqual(relay.lines, [f"REMOTE_SERVER_UP {dest}"])
        await until(lambda: p.events_to(dest) == [f"$so3:{SERVER}", f"$so4:{SERVER}"],
                    "the outstanding invite and message to go out", show=lambda: p.events_to(dest))
        self.assertFalse(p.sender.queues[dest].backing_off)
        await p.stop()

    def _master(self, db: Database) -> tuple[ReplicationHandler, Any]:
        """The master's replication handler and a router to a real persister; returns a reader of its events."""
        gens = {s: MultiWriterIdGenerator(registry.streams()[s], P1, 0, reactor) for s in ("events", "caches")}
        persister = EventPersister(StreamWriters(db, gens), server_name=SERVER, instance_name=P1,
                                   event_writers=[P1], clock=reactor, new_event_id=lambda: "$unused")
        self.router = EventRouter(P1, [P1], persister, None)
        master = ReplicationHandler("master", Clock(), streams=registry.streams(), sources={})

        async def persisted() -> list[str]:
            def read(txn: Any) -> list[str]:
                txn.execute("SELECT event_id FROM events WHERE origin <> ? ORDER BY stream_ordering", (SERVER,))
                return [r[0] for r in txn.fetchall()]

            rows: list[str] = await db.run_interaction("read", read)
            return rows

        return master, persisted

    def _inbound(self, db: Database, master: ReplicationHandler) -> Any:
        return inbound_handler(db, self.router, master, allowed_origins=None, max_body_bytes=1 << 20,
                               max_json_depth=64)


def _body(origin: str, *events: str) -> bytes:
    """A transaction of invites of local users into rooms of ``origin`` (what a new remote room starts with here)."""
    pdus = [{"event_id": e, "room_id": f"!x{i}:{origin}", "type": "m.room.member", "sender": f"@u:{origin}",
             "state_key": f"@v{i}:{SERVER}", "content": {"membership": "invite"}, "origin_server_ts": 1}
            for i, e in enumerate(events)]
    return json.dumps({"origin": origin, "origin_server_ts": 1, "pdus": pdus}).encode()


class SqliteWorkerTests(WorkerTestsMixin, TestCase):
    """The follower and inbound wiring on SQLite."""

    engine = "sqlite"


class PostgresWorkerTests(WorkerTestsMixin, TestCase):
    """The follower and inbound wiring on PostgreSQL."""

    engine = "postgres"
