"""Sharded event persisters and sync chains, with real processes started by twistd.

A master and two event persisters (persister1 also serves the client API)
on SQLite over the TCP hub, and on PostgreSQL over Redis. Users in many
rooms send through both client APIs while every user's sync chain runs
against both; the checks are made from the clients' responses.
"""

from __future__ import annotations

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.sharding import shard_for
from synflow.tools.client import ApiError, Client
from synflow.tools.workload import Workload
from tests.cluster import Cluster, DroppingProxy, free_port, sleep, wait_until

WRITERS = ("persister1", "persister2")


def events_by_writer(cluster: Cluster) -> dict[str, list[tuple[str, str]]]:
    """(room_id, event_id) of every message, by the persister that wrote it."""
    out: dict[str, list[tuple[str, str]]] = {}
    rows = cluster.query("SELECT instance_name, room_id, event_id FROM events WHERE type = 'm.room.message' "
                         "ORDER BY stream_ordering")
    for instance, room, event in rows:
        out.setdefault(instance, []).append((room, event))
    return out


def message_numbers(cluster: Cluster) -> list[str]:
    """The workload's message numbers (content.n) of every message in the database."""
    import json

    return [json.loads(r[0]).get("n") for r in cluster.query("SELECT content FROM events WHERE type = 'm.room.message'")]


class PersisterMixin:
    engine = "sqlite"
    transport = "tcp"
    timeout = 400

    @inlineCallbacks
    def start(self, hub_proxy: bool = False):
        """Master, persister1 (with a client listener) and persister2; ``hub_proxy`` puts persister1's hub link behind a DroppingProxy."""
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS)
        ports = {"master": free_port(), "persister1": free_port()}
        listeners = {name: [{"resources": ["client"], "endpoint": f"tcp:{p}:interface=127.0.0.1"}] for name, p in ports.items()}
        yield cluster.start_master(listeners=listeners["master"])
        extra = {}
        if hub_proxy:
            self.proxy = DroppingProxy("127.0.0.1", cluster.hub_port)
            self.addCleanup(self.proxy.close)
            extra = {"replication": {"hub": {"host": "127.0.0.1", "port": self.proxy.listen()}}}
        cluster.start_twistd("persister1", "event_persister", listeners=listeners["persister1"], **extra)
        cluster.start_twistd("persister2", "event_persister")
        for name, port in (("persister1", ports["persister1"]), ("persister2", cluster.instance_ports["persister2"])):
            yield cluster.wait_for_port(port, name)
        self.urls = [f"http://127.0.0.1:{p}" for p in ports.values()]
        return cluster

    @inlineCallbacks
    def test_sync_chains_get_every_event_once(self):
        """Users in 200 rooms send through two processes; every sync chain gets each message once, in room order."""
        cluster = yield self.start()
        workload = Workload(self.urls, users=50, rooms=200, members_per_room=4, messages=2000, concurrency=24, seed=7,
                            room_shards=WRITERS)
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        yield ensureDeferred(workload.send_messages())
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        self.assertEqual(report.send_errors, 0)
        self.assertEqual(report.sent, 2000)
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches, report.foreign), (0, 0, 0, 0),
                         report.as_dict())
        self.assertGreater(report.sync_requests, 100)
        # Each room's events were written by its owner only, and with the rooms
        # spread evenly over the persisters, so is the load.
        by_writer = events_by_writer(cluster)
        for writer, events in by_writer.items():
            for room, _ in events:
                self.assertEqual(shard_for(room, list(WRITERS)), writer)
        counts = {w: len(by_writer.get(w, [])) for w in WRITERS}
        for w in WRITERS:
            share = counts[w] / sum(counts.values())
            self.assertTrue(0.4 <= share <= 0.6, f"{w} persisted {share:.0%} of events: {counts}")
        # Every sync response was recorded for the token validator.
        import glob
        import json
        import os

        token_files = glob.glob(os.path.join(cluster.shared["audit"]["dir"], "token_logs", "*", "*.jsonl"))
        records = [json.loads(line) for path in token_files for line in open(path)]
        self.assertGreaterEqual(len(records), report.sync_requests * 0.9)
        self.assertTrue(all({"reader", "stream", "since", "token", "issued_at", "issued_by", "delivered"} <= set(r)
                            for r in records))
        self.assertTrue(glob.glob(os.path.join(cluster.shared["audit"]["dir"], "instance_map", "*.jsonl")))
        # The same order in each room as the database's stream order.
        db_order: dict[str, list[str]] = {}
        for events in by_writer.values():
            for room, event in events:
                db_order.setdefault(room, []).append(event)
        for user in workload.users:
            for room in user.rooms:
                got = [e for r, e in user.delivered if r == room]
                self.assertEqual(got, [e for e in db_order.get(room, []) if e in set(got)])

    @inlineCallbacks
    def test_malformed_since_then_read_your_writes(self):
        """One deployment: a malformed since is refused while every process keeps serving, then reads follow writes.

        :meth:`check_malformed_since_keeps_serving` runs first, then
        :meth:`check_read_your_writes_across_processes` on the same processes
        (each registers its own user).
        """
        yield self.start()
        yield self.check_malformed_since_keeps_serving()
        yield self.check_read_your_writes_across_processes()

    @inlineCallbacks
    def check_read_your_writes_across_processes(self):
        """A sent event is returned at once by a sync from the send's token on the sending process, and on another."""
        pool_workload = Workload(self.urls, users=1, rooms=0)
        self.addCleanup(lambda: ensureDeferred(pool_workload.close()))
        a = Client(self.urls[1], pool_workload.pool)
        yield ensureDeferred(a.register("ryw"))
        b = a.at(self.urls[0])
        owners = set()
        for i in range(20):
            # Both directions: the reading process is sometimes the hub and sometimes behind it.
            sender, other = (a, b) if i % 2 == 0 else (b, a)
            room = yield ensureDeferred(sender.create_room())
            owners.add(shard_for(room, list(WRITERS)))
            sent = yield ensureDeferred(sender.send(room, {"body": f"ryw {i}"}, f"t{i}"))
            # The sending process waited (over internal RPC) until it had seen the
            # event before answering, so even a timeout=0 sync there returns it.
            here = yield ensureDeferred(sender.sync(since=sent["token"], timeout_ms=0))
            self.assertEqual([e["event_id"] for e in here["events"]][:1], [sent["event_id"]], f"send {i}")
            there = yield ensureDeferred(other.sync(since=sent["token"], timeout_ms=10_000))
            self.assertEqual(there["events"][0]["event_id"], sent["event_id"])
        self.assertEqual(owners, set(WRITERS))

    @inlineCallbacks
    def check_malformed_since_keeps_serving(self):
        """A malformed since gets 400 with an errcode on every process, which keeps serving."""
        w = Workload(self.urls, users=1, rooms=0)
        self.addCleanup(lambda: ensureDeferred(w.close()))
        c = Client(self.urls[0], w.pool)
        yield ensureDeferred(c.register("bad"))
        for url in self.urls:
            try:
                yield ensureDeferred(c.at(url).sync(since="m1~x.2"))
            except ApiError as e:
                self.assertEqual((e.code, e.errcode), (400, "M_INVALID_PARAM"))
            else:
                self.fail("malformed since accepted")
            yield ensureDeferred(c.at(url).sync())


    @inlineCallbacks
    def test_persister_killed_during_sends(self):
        """A persister SIGKILLed mid-load: no reported success is lost, retries do not duplicate, chains stay whole."""
        cluster = yield self.start()
        workload = Workload(self.urls, users=20, rooms=60, members_per_room=3, messages=900, concurrency=12, seed=3)
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        sending = ensureDeferred(workload.send_messages())
        while sum(len(v) for v in workload.sent.values()) < 300:
            yield sleep(0.1)
        # The kill lands while sends are in flight: the send phase is still running.
        self.assertFalse(sending.called, "the sends finished before the kill")
        sent_at_kill = sum(len(v) for v in workload.sent.values())
        self.assertLess(sent_at_kill, 900)
        cluster.kill("persister2")
        # Down for longer than an internal RPC call retries a refused connection
        # (about 3 s of backoff), so sends to persister2's rooms fail back to
        # their clients, which retry them with the same txn_id.
        yield sleep(5.0)
        cluster.start_twistd("persister2", "event_persister")
        yield cluster.wait_for_port(cluster.instance_ports["persister2"], "persister2")
        yield sending
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        # Every send the clients saw succeed is in the database, exactly once.
        in_db = [e for events in events_by_writer(cluster).values() for _, e in events]
        self.assertEqual(len(in_db), len(set(in_db)))
        succeeded = {e for events in workload.sent.values() for e in events}
        self.assertEqual(succeeded - set(in_db), set())
        # Retries with the same txn_id never made a second copy of a message.
        bodies = [b for b in message_numbers(cluster)]
        self.assertEqual(len(bodies), len(set(bodies)), "a retried send was persisted twice")
        # Clients saw errors for persister2's rooms and retried them with the same txn_id.
        self.assertGreater(workload.send_retries, 0)
        retried_owners = {shard_for(room, list(WRITERS)) for room in workload.retried.values()}
        self.assertIn("persister2", retried_owners)
        self.assertGreater(report.sent, sent_at_kill)
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches), (0, 0, 0), report.as_dict())


class SqliteTcpPersisterTest(PersisterMixin, TestCase):
    engine = "sqlite"
    transport = "tcp"

    @inlineCallbacks
    def test_read_your_writes_on_a_lagging_process(self):
        """With persister1 cut off from replication, read-your-writes holds for sends through it and syncs on it."""
        cluster = yield self.start(hub_proxy=True)
        w = Workload(self.urls, users=1, rooms=0)
        self.addCleanup(lambda: ensureDeferred(w.close()))
        master = Client(self.urls[0], w.pool)
        yield ensureDeferred(master.register("lag"))
        lagging = master.at(self.urls[1])
        for i in range(6):
            room = None
            while room is None or shard_for(room, list(WRITERS)) != "persister2":
                room = yield ensureDeferred(master.create_room())
            yield wait_until(lambda: self.proxy.live, 30, "persister1 to be connected to the hub")
            # persister1 loses the hub (it reconnects after ~0.1 s), and with it the event sent now.
            self.assertGreaterEqual(self.proxy.drop_all(), 1)
            if i % 2 == 0:
                # Sent through persister1: its RPC to persister2 returns only once persister1
                # has seen the event (after reconnecting), so a timeout=0 sync there has it.
                sent = yield ensureDeferred(lagging.send(room, {"body": f"lag {i}"}, f"t{i}"))
                result = yield ensureDeferred(lagging.sync(since=sent["token"], timeout_ms=0))
                got = [e["event_id"] for e in result["events"]]
            else:
                # Sent elsewhere: timeout=0 on persister1 cannot wait for an event it has not
                # received, but its next_batch must not pass it; the chain's next sync returns it.
                sent = yield ensureDeferred(master.send(room, {"body": f"lag {i}"}, f"t{i}"))
                first = yield ensureDeferred(lagging.sync(since=sent["token"], timeout_ms=0))
                got = [e["event_id"] for e in first["events"]]
                if not got:
                    later = yield ensureDeferred(lagging.sync(since=first["next_batch"], timeout_ms=10_000))
                    got = [e["event_id"] for e in later["events"]]
            self.assertEqual(got[:1], [sent["event_id"]], f"send {i}")
        cluster.check_alive("master", "persister1", "persister2")


class PostgresRedisPersisterTest(PersisterMixin, TestCase):
    engine = "postgres"
    transport = "redis"

