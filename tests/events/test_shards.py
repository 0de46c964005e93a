"""Live resharding on one real in-process master: the write fence, held and re-routed sends, the coordinator.

The master persists events alongside ``persister2`` (configured, never
started); epochs are written to its database as a coordinator would, so each
test sets up exactly the state it names.
"""

from __future__ import annotations

import io
import json
from typing import Any
from urllib.parse import quote

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from synflow.errors import HttpApiError
from synflow.events.persist import CREATE, EventSpec
from synflow.events.shards import _finish_txn, _propose_txn, load_state_txn
from synflow.http.client_api import PREFIX as CLIENT_PREFIX
from synflow.sharding import ShardMap, ShardStep
from tests.cluster import single_master

SERVER = "api.test"
WRITERS = ["master", "persister2"]
CONFIG = (
    "instance_map: {master: {host: 127.0.0.1, port: 0}, persister2: {host: 127.0.0.1, port: 9}}\n"
    "stream_writers: {events: [master, persister2]}\n"
    "limits: {reshard_max_wait_s: 0.5}\n"
)
M0 = ShardMap(WRITERS)
M1 = M0.then(ShardStep("add", "persister3"))


def rooms(pred: Any, count: int) -> list[str]:
    return [r for r in (f"!s{i}:{SERVER}" for i in range(2000)) if pred(r)][:count]


def create(room_id: str, txn_id: str | None = None) -> EventSpec:
    sender = f"@a:{SERVER}"
    return EventSpec(room_id, CREATE, sender, {"creator": sender}, "", SERVER, 1, txn_id=txn_id)


class FenceTest(TestCase):
    timeout = 30

    @inlineCallbacks
    def setUp(self):
        self.master, self.url = yield single_master(self, CONFIG)
        self.worker = self.master.worker
        # Rooms the master keeps in epoch 1, and rooms it gives to persister3.
        self.staying = rooms(lambda r: M0.owner(r) == "master" and M1.owner(r) == "master", 2)
        self.moving = rooms(lambda r: M0.owner(r) == "master" and M1.owner(r) == "persister3", 2)

    def propose(self) -> Any:
        return self.master.db.run_interaction("t", _propose_txn, WRITERS, ShardStep("add", "persister3"),
                                              ["127.0.0.1", 9], 0)

    def finish(self, epoch: int, commit: bool) -> Any:
        return self.master.db.run_interaction("t", _finish_txn, epoch, commit, None, None, 0)

    @inlineCallbacks
    def test_fence_refuses_moving_rooms_while_pending(self):
        """With an epoch pending, a persist transaction refuses moving rooms (even with a stale map) and writes the rest."""
        yield self.propose()
        self.assertIsNone(self.worker.shards.state.pending)  # this process has not reloaded: its map is stale
        results = yield self.worker.persister.persist([create(self.moving[0]), create(self.staying[0])])
        self.assertEqual(results[0].error.errcode, "M_ROOM_MOVING")
        self.assertIsNone(results[1].error)
        self.assertIsNotNone(results[1].stream_ordering)

    @inlineCallbacks
    def test_fence_refuses_rooms_moved_away(self):
        """Once the epoch is current, the old owner's transaction refuses the moved rooms naming the new owner."""
        epoch, _, _ = yield self.propose()
        yield self.finish(epoch, True)
        results = yield self.worker.persister.persist([create(self.moving[0])])
        self.assertEqual(results[0].error.errcode, "M_WRONG_PERSISTER")
        self.assertIn("persister3", results[0].error.msg)
        state = yield self.master.db.run_interaction("t", load_state_txn, WRITERS)
        self.assertEqual((state.current.epoch, state.current.writers), (1, ("master", "persister2", "persister3")))
        self.assertEqual(dict(state.addresses), {"persister3": ("127.0.0.1", 9)})

    @inlineCallbacks
    def test_held_send_gets_503_with_retry_after(self):
        """A client's send to a moving room waits at the router, then gets 503 M_ROOM_MOVING and Retry-After."""
        from synflow.tools.client import Client, new_pool

        pool = new_pool()
        self.addCleanup(pool.closeCachedConnections)
        client = yield ensureDeferred(Client(self.url, pool).register("bob"))
        room = self.moving[1]
        user = f"@bob:{SERVER}"
        results = yield self.worker.persister.persist([
            EventSpec(room, CREATE, user, {"creator": user}, "", SERVER, 1),
            EventSpec(room, "m.room.member", user, {"membership": "join"}, user, SERVER, 1)])
        self.assertEqual([r.error for r in results], [None, None])
        yield self.propose()
        yield self.worker.shards.reload()
        agent = Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False))
        started = reactor.seconds()
        response = yield agent.request(
            b"PUT", f"{self.url}{CLIENT_PREFIX}/rooms/{quote(room)}/send/m.room.message/t1".encode(),
            Headers({b"Authorization": [f"Bearer {client.token}".encode()]}),
            FileBodyProducer(io.BytesIO(json.dumps({"body": "hi"}).encode())))
        body = json.loads((yield readBody(response)))
        self.assertEqual((response.code, body["errcode"]), (503, "M_ROOM_MOVING"))
        self.assertGreaterEqual(reactor.seconds() - started, 0.5)  # it waited for the hand-over first
        self.assertEqual(response.headers.getRawHeaders(b"Retry-After"), [b"1"])
        self.assertEqual(body["retry_after_ms"], 1000)

    @inlineCallbacks
    def test_held_send_goes_on_after_roll_back(self):
        """A send held during a hand-over is persisted at the old owner once the epoch rolls back; once only."""
        epoch, _, _ = yield self.propose()
        yield self.worker.shards.reload()
        self.worker.router.max_wait_s = 10.0
        spec = create(self.moving[0], txn_id="held-1")
        held = ensureDeferred(self.worker.router.persist([spec]))
        yield deferLater(reactor, 0.3, lambda: None)
        self.assertFalse(held.called)
        self.assertGreater(self.worker.router.held, 0)
        yield self.finish(epoch, False)  # no reload call: the router finds out by polling
        (result,) = yield held
        self.assertIsNone(result.error)
        self.assertEqual(result.instance_name, "master")
        (again,) = yield ensureDeferred(self.worker.router.persist([spec]))
        self.assertTrue(again.duplicate)

    @inlineCallbacks
    def test_stale_router_reroutes(self):
        """A router whose map is stale is refused by the fence and re-routes after reloading, never failing the send."""
        # persister2's rooms move to the master when persister2 is removed; the master's map is stale.
        gaining = rooms(lambda r: M0.owner(r) == "persister2", 1)[0]
        yield self.master.db.run_interaction("t", _propose_txn, WRITERS, ShardStep("remove", "persister2"), None, 0)
        yield self.finish(1, True)
        self.assertEqual(self.worker.router.owner_of(gaining), "persister2")  # stale: would send it to persister2
        yield self.worker.shards.reload()
        (result,) = yield ensureDeferred(self.worker.router.persist([create(gaining)]))
        self.assertIsNone(result.error)
        self.assertEqual(result.instance_name, "master")

    @inlineCallbacks
    def test_stale_persister_map_is_refreshed(self):
        """persist_events for a room this persister gained in an epoch it has not loaded yet is accepted after a reload."""
        gaining = rooms(lambda r: M0.owner(r) == "persister2", 1)[0]
        yield self.master.db.run_interaction("t", _propose_txn, WRITERS, ShardStep("remove", "persister2"), None, 0)
        yield self.finish(1, True)
        self.assertEqual(self.worker.persister.owner_of(gaining), "persister2")
        (result,) = yield self.worker.persister.persist([create(gaining)])
        self.assertIsNone(result.error)
        self.assertEqual(self.worker.shards.state.current.epoch, 1)

    @inlineCallbacks
    def test_coordinator_refuses_overlapping_and_impossible_changes(self):
        """A second proposal while one is pending, or removing an unknown writer, is refused; nothing is written."""
        yield self.propose()
        with self.assertRaises(HttpApiError) as cm:
            yield self.propose()
        self.assertEqual(cm.exception.errcode, "M_HANDOVER_IN_PROGRESS")
        yield self.finish(1, False)
        with self.assertRaises(HttpApiError) as cm:
            yield ensureDeferred(self.worker.resharder.reshard("remove", "persister9"))
        self.assertEqual(cm.exception.code, 409)
        state = yield self.master.db.run_interaction("t", load_state_txn, WRITERS)
        self.assertEqual((state.current.epoch, state.pending), (0, None))

    @inlineCallbacks
    def test_reshard_rolls_back_when_a_process_cannot_follow(self):
        """Adding a persister while persister2 does not answer rolls the epoch back, naming persister2."""
        with self.assertRaises(HttpApiError) as cm:
            yield ensureDeferred(self.worker.resharder.reshard("add", "persister3", ("127.0.0.1", 9)))
        self.assertEqual((cm.exception.code, cm.exception.errcode), (503, "M_HANDOVER_FAILED"))
        self.assertIn("persister2", cm.exception.msg)
        state = yield self.master.db.run_interaction("t", load_state_txn, WRITERS)
        self.assertEqual((state.current.epoch, state.pending), (0, None))
        # The held map is the old one again; sends of the rooms that were to move go to the master.
        (result,) = yield ensureDeferred(self.worker.router.persist([create(self.moving[1])]))
        self.assertIsNone(result.error)

    @inlineCallbacks
    def test_removing_a_dead_writer_records_its_unlogged_events(self):
        """Removing a persister that does not answer commits, and its committed events missing from its audit
        log are recorded there (as its own restart would), so the validator finds every event's writer."""
        import glob
        import os

        results = yield self.worker.persister.persist([create(self.staying[0], txn_id="dead-1")])
        sid = results[0].stream_ordering
        # An event persister2 committed and died before logging: its row, and its (empty) log directory.
        yield self.master.db.run_interaction(
            "t", lambda t: t.execute("UPDATE events SET instance_name = 'persister2' WHERE stream_ordering = ?",
                                     (sid,)))
        logs = os.path.join(self.master.config.audit_dir, "writer_logs", "persister2")
        os.makedirs(logs)
        result = yield ensureDeferred(self.worker.resharder.reshard("remove", "persister2"))
        self.assertEqual((result["epoch"], result["writers"]), (1, ["master"]))
        facts = [json.loads(line) for path in glob.glob(os.path.join(logs, "*.jsonl")) for line in open(path)]
        self.assertEqual([(f.get("stream"), f.get("stream_id")) for f in facts if f.get("stream_id") == sid],
                         [("events", sid)])

    @inlineCallbacks
    def test_reshard_rpc_refuses_malformed_arguments(self):
        """The master's reshard and shards RPCs answer 400 to a bad op, writer, address or group; nothing changes."""
        from synflow.config import HostPort
        from synflow.http.rpc import PositionSource, RpcClient

        port = self.master.listeners["internal"].bound_port
        rpc = RpcClient(reactor, {"master": HostPort("127.0.0.1", port)},
                        PositionSource(self.master.replication.handler, 1.0), self.master.config.replication_secret())
        self.addCleanup(rpc.close)
        bad = [
            ("reshard", {"op": "swap", "writer": "persister3"}),
            ("reshard", {"op": "add", "writer": "p 3\n"}),
            ("reshard", {"op": "add", "writer": "x" * 65}),
            ("reshard", {"op": "add", "writer": "persister3", "address": ["127.0.0.1", 70000]}),
            ("reshard", {"op": "add", "writer": "persister3", "address": "127.0.0.1:9"}),
            ("reshard", {"op": "remove", "writer": "persister2", "group": ["events"]}),
            ("shards", {"group": "caches"}),
        ]
        for name, args in bad:
            with self.assertRaises(HttpApiError) as cm:
                yield ensureDeferred(rpc.call("master", name, args))
            self.assertEqual(cm.exception.code, 400, (name, args))
        with self.assertRaises(HttpApiError) as cm:  # a group this deployment does not reshard (no senders)
            yield ensureDeferred(rpc.call("master", "reshard", {"op": "remove", "writer": "persister2",
                                                                "group": "federation"}))
        self.assertIn("federation_sender_instances is empty", cm.exception.msg)
        state = yield self.master.db.run_interaction("t", load_state_txn, WRITERS)
        self.assertEqual((state.current.epoch, state.pending), (0, None))
