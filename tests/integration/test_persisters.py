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
from tests.cluster import Cluster, free_port, sleep

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
    def start(self):
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS)
        ports = {"master": free_port(), "persister1": free_port()}
        listeners = {name: [{"resources": ["client"], "endpoint": f"tcp:{p}:interface=127.0.0.1"}] for name, p in ports.items()}
        yield cluster.start_master(listeners=listeners["master"])
        cluster.start_twistd("persister1", "event_persister", listeners=listeners["persister1"])
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
    def test_read_your_writes_across_processes(self):
        """An event sent through one process is returned by a sync on another from the send's token."""
        yield self.start()
        pool_workload = Workload(self.urls, users=1, rooms=0)
        self.addCleanup(lambda: ensureDeferred(pool_workload.close()))
        a = Client(self.urls[1], pool_workload.pool)
        yield ensureDeferred(a.register("ryw"))
        b = a.at(self.urls[0])
        for i in range(20):
            room = yield ensureDeferred(a.create_room())
            sent = yield ensureDeferred(a.send(room, {"body": f"ryw {i}"}, f"t{i}"))
            result = yield ensureDeferred(b.sync(since=sent["token"], timeout_ms=10_000))
            self.assertEqual(result["events"][0]["event_id"], sent["event_id"])

    @inlineCallbacks
    def test_malformed_since_keeps_serving(self):
        """A malformed since gets 400 with an errcode on every process, which keeps serving."""
        yield self.start()
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
        cluster.kill("persister2")
        yield sleep(1.0)
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
        self.assertGreater(workload.send_errors + report.sent, 0)
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches), (0, 0, 0), report.as_dict())


class SqliteTcpPersisterTest(PersisterMixin, TestCase):
    engine = "sqlite"
    transport = "tcp"


class PostgresRedisPersisterTest(PersisterMixin, TestCase):
    engine = "postgres"
    transport = "redis"

