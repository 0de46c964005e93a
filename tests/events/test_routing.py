"""Event persisters on one real in-process master: ownership over internal RPC, event IDs and room chains."""

from __future__ import annotations

import json
import re
from io import BytesIO
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from synflow.config import HostPort
from synflow.errors import HttpApiError
from synflow.events.persist import CREATE, EventSpec
from synflow.http.rpc import PREFIX, PositionSource, RpcClient
from synflow.sharding import shard_for
from tests.cluster import single_master, single_master_with_user

SERVER = "api.test"
TWO_WRITERS = (
    "instance_map: {master: {host: 127.0.0.1, port: 0}, persister2: {host: 127.0.0.1, port: 9}}\n"
    "stream_writers: {events: [master, persister2]}\n"
)


def query(master: Any, sql: str, args: tuple = ()) -> Any:
    """Rows of a read on the master's database (a Deferred)."""

    def txn(t: Any) -> list[tuple]:
        t.execute(sql, args)
        return t.fetchall()

    return master.db.run_interaction("test_query", txn)


def rooms_owned_by(owner: str, writers: list[str], count: int) -> list[str]:
    """``count`` room IDs that shard to ``owner``."""
    found = [f"!r{i}:{SERVER}" for i in range(1000) if shard_for(f"!r{i}:{SERVER}", writers) == owner]
    return found[:count]


def create(room_id: str, sender: str = f"@a:{SERVER}") -> dict[str, Any]:
    return EventSpec(room_id, CREATE, sender, {"creator": sender}, "", SERVER, 1).to_json()


class MisroutedTest(TestCase):
    """The master persists events, alongside a second persister that owns half the rooms."""

    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, _ = yield single_master(self, TWO_WRITERS)
        self.port = self.master.listeners["internal"].bound_port
        self.writers = ["master", "persister2"]
        positions = PositionSource(self.master.replication.handler, 1.0)
        self.secret = self.master.config.replication_secret()  # the deployment's generated secret
        self.rpc = RpcClient(reactor, {"master": HostPort("127.0.0.1", self.port)}, positions, self.secret)
        self.addCleanup(self.rpc.close)
        self.mine = rooms_owned_by("master", self.writers, 3)
        self.theirs = rooms_owned_by("persister2", self.writers, 1)[0]

    async def rooms(self) -> set[str]:
        return {r[0] for r in await query(self.master, "SELECT room_id FROM rooms")}

    @inlineCallbacks
    def test_misrouted_event_gets_409_naming_the_owner(self):
        """persist_events for a room the persister does not own answers 409 M_WRONG_PERSISTER with the owner."""
        with self.assertRaises(HttpApiError) as cm:
            yield ensureDeferred(self.rpc.call("master", "persist_events", {"events": [create(self.theirs)]}))
        error = cm.exception
        self.assertEqual((error.code, error.errcode), (409, "M_WRONG_PERSISTER"))
        self.assertEqual(error.extra.get("owner"), "persister2")
        self.assertIn("'persister2'", error.msg)
        self.assertNotIn(self.theirs, (yield ensureDeferred(self.rooms())))
        # The raw HTTP answer carries the same status and body.
        pool = HTTPConnectionPool(reactor, persistent=False)
        body = json.dumps({"args": {"event": create(self.theirs)}}).encode()
        response = yield Agent(reactor, pool=pool).request(
            b"POST", f"http://127.0.0.1:{self.port}{PREFIX}/send_event/raw1".encode(),
            Headers({b"Content-Type": [b"application/json"], b"Authorization": [b"Bearer " + self.secret.encode()]}),
            FileBodyProducer(BytesIO(body)))
        data = json.loads((yield readBody(response)))
        self.assertEqual(response.code, 409)
        self.assertEqual((data["errcode"], data["owner"]), ("M_WRONG_PERSISTER", "persister2"))

    @inlineCallbacks
    def test_owned_room_is_persisted(self):
        """The same call for a room the persister owns persists it, by that persister."""
        result = yield ensureDeferred(self.rpc.call("master", "send_event", {"event": create(self.mine[0])}))
        self.assertIsNone(result["error"])
        self.assertEqual(result["instance_name"], "master")
        self.assertIn(self.mine[0], (yield ensureDeferred(self.rooms())))

    @inlineCallbacks
    def test_mixed_batch_refused_whole(self):
        """A batch with one misrouted event is refused whole: its other events are never persisted, even later."""
        with self.assertRaises(HttpApiError) as cm:
            yield ensureDeferred(self.rpc.call(
                "master", "persist_events", {"events": [create(self.mine[0]), create(self.theirs)]}))
        self.assertEqual((cm.exception.code, cm.exception.extra.get("owner")), (409, "persister2"))
        # A later batch is persisted on its own, without the refused batch's events.
        yield ensureDeferred(self.rpc.call("master", "persist_events", {"events": [create(self.mine[1])]}))
        rooms = yield ensureDeferred(self.rooms())
        self.assertIn(self.mine[1], rooms)
        self.assertNotIn(self.mine[0], rooms)


class EventIdsAndChainsTest(TestCase):
    """Events sent through the client API of a master that is the only persister."""

    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, self.alice = yield single_master_with_user(self)

    @inlineCallbacks
    def test_event_ids_and_room_chains(self):
        """Event IDs are $<opaque>:<server_name>, and each room's events link to the previous one in order."""
        rooms = []
        for _ in range(3):
            rooms.append((yield ensureDeferred(self.alice.create_room())))
        sent: dict[str, list[str]] = {room: [] for room in rooms}
        for i in range(12):  # interleave the rooms
            room = rooms[i % 3]
            result = yield ensureDeferred(self.alice.send(room, {"n": i}, f"t{i}"))
            sent[room].append(result["event_id"])
        rows = yield query(self.master, "SELECT room_id, event_id, prev_event_id, depth, type, instance_name "
                                        "FROM events ORDER BY stream_ordering")
        pattern = re.compile(r"^\$[^:]+:" + re.escape(SERVER) + r"$")
        self.assertEqual(len(rows), 3 * 4 + 12)  # create, join, power levels, join rules; the messages
        ids = [r[1] for r in rows]
        self.assertEqual(len(set(ids)), len(ids))
        for row in rows:
            self.assertRegex(row[1], pattern)
        for room in rooms:
            chain = [r for r in rows if r[0] == room]
            self.assertEqual(chain[0][4], CREATE)
            self.assertIsNone(chain[0][2])
            for before, after in zip(chain, chain[1:], strict=False):
                self.assertEqual(after[2], before[1], f"{after[1]} does not follow {before[1]}")
                self.assertEqual(after[3], before[3] + 1)
            self.assertEqual([r[1] for r in chain][4:], sent[room])
            self.assertEqual({r[5] for r in chain}, {"master"})
            head = yield query(self.master, "SELECT latest_event_id FROM rooms WHERE room_id = ?", (room,))
            self.assertEqual(head, [(chain[-1][1],)])
