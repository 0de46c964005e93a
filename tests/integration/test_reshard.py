"""Live resharding with real processes: 2 -> 3 -> 2 event persisters under continuous traffic.

A master and persister1 serve the client API; persister1 and persister2 own
the rooms at first, persister3 runs idle. While every user's sync chain runs
and messages are sent at a steady rate, the master adds persister3 (epoch 1)
and then removes persister2 (epoch 2). The checks come from the clients'
responses, the database and the Spark validator over the audit logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.config import load_config
from synflow.sharding import ShardMap, ShardStep
from synflow.tools.ctl import RpcCallError, call_rpc
from synflow.tools.workload import Workload, quantile
from tests.cluster import Cluster, free_port, sleep, wait_until

WRITERS = ("persister1", "persister2")
ALL = (*WRITERS, "persister3")
#: The maps the tests go through: the base, persister3 added, then persister2 removed.
M0 = ShardMap(list(WRITERS))
M1 = M0.then(ShardStep("add", "persister3"))
M2 = M1.then(ShardStep("remove", "persister2"))


class ReshardMixin:
    engine = "sqlite"
    transport = "tcp"
    timeout = 400

    @inlineCallbacks
    def start(self, third: bool = True, max_wait_s: float = 2.0):
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS,
                          extra_instances=("persister3",), shared={"limits": {"reshard_max_wait_s": max_wait_s}})
        ports = {"master": free_port(), "persister1": free_port()}
        listeners = {n: [{"resources": ["client"], "endpoint": f"tcp:{p}:interface=127.0.0.1"}] for n, p in ports.items()}
        yield cluster.start_master(listeners=listeners["master"])
        cluster.start_twistd("persister1", "event_persister", listeners=listeners["persister1"])
        started = ALL if third else WRITERS
        for name in started[1:]:
            cluster.start_twistd(name, "event_persister")
        for name in started:
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        self.urls = [f"http://127.0.0.1:{p}" for p in ports.values()]
        self.master_config = load_config([cluster.shared_path, cluster.process_config("master", "master")])
        return cluster

    def rpc(self, name: str, args: Any):
        return threads.deferToThread(call_rpc, self.master_config, "master", name, args)

    def room_writers(self, cluster: Cluster) -> dict[str, list[str]]:
        """Each room's writers in stream order, runs collapsed."""
        runs: dict[str, list[str]] = {}
        for room, writer in cluster.query("SELECT room_id, instance_name FROM events ORDER BY stream_ordering"):
            seq = runs.setdefault(room, [])
            if not seq or seq[-1] != writer:
                seq.append(writer)
        return runs

    @inlineCallbacks
    def test_two_to_three_to_two_under_load(self):
        """Add then remove a persister while sends and sync chains run: nothing lost, duplicated or reordered."""
        cluster = yield self.start()
        workload = Workload(self.urls, users=40, rooms=240, members_per_room=3, messages=1800, concurrency=16, seed=11)
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        prober = ReadYourWrites(self.urls)
        self.addCleanup(prober.close)
        yield ensureDeferred(prober.setup())
        probing = ensureDeferred(prober.run())
        sending = ensureDeferred(workload.send_messages(rate_per_s=150))

        yield sleep(3.0)
        changes = []
        for op, name in (("add", "persister3"), ("remove", "persister2")):
            started = time.monotonic()
            result = yield self.rpc("reshard", {"op": op, "writer": name})
            changes.append((started, time.monotonic(), result))
            yield sleep(3.0)
        self.assertFalse(sending.called, "the sends finished before the last change")
        yield sending
        prober.stop = True
        yield probing
        # Read-your-writes held throughout: a sync from a send's token, on the other process, returned it first.
        self.assertEqual(prober.failures, [])
        self.assertLess(min(t0 for t0, _ in prober.times), changes[0][0], "no probe before the first change")
        self.assertGreater(max(t1 for _, t1 in prober.times), changes[-1][1], "no probe after the last change")
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        self.assertEqual(report.send_errors, 0)
        self.assertEqual(report.sent, 1800)
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches, report.foreign), (0, 0, 0, 0),
                         report.as_dict())

        # The epochs: each change moved exactly the rooms whose owner changed, and about the ideal share.
        self.assertEqual([c[2]["epoch"] for c in changes], [1, 2])
        self.assertEqual(changes[1][2]["writers"], ["persister1", "persister3"])
        rooms = [r for (r,) in cluster.query("SELECT room_id FROM rooms")]
        for (_, _, result), (before, after) in zip(changes, ((M0, M1), (M1, M2)), strict=True):
            moved = sum(1 for r in rooms if before.owner(r) != after.owner(r))
            self.assertEqual(result["moved"], moved)
            self.assertEqual(result["total"], len(rooms))
        add_fraction = changes[0][2]["moved"] / len(rooms)
        self.assertLess(abs(add_fraction - 1 / 3), 0.1, f"adding moved {add_fraction:.1%} of the rooms")
        owned_by_2 = sum(1 for r in rooms if M1.owner(r) == "persister2")
        self.assertEqual(changes[1][2]["moved"], owned_by_2)  # removing moves only persister2's rooms

        # No room ever had two writers at once: its writers, in stream order, are its owners epoch by epoch.
        for room, writers in self.room_writers(cluster).items():
            owners = []
            for m in (M0, M1, M2):
                if not owners or owners[-1] != m.owner(room):
                    owners.append(m.owner(room))
            self.assertTrue(_is_subsequence(writers, owners), f"room {room}: writers {writers}, owners {owners}")
        moved_rooms_written = {r for r, w in self.room_writers(cluster).items() if len(w) > 1}
        self.assertTrue(moved_rooms_written, "no moved room was written before and after its move")

        # No send waited 2 s or more; p99 during the changes beside the steady state.
        during = [lat for t0, lat in workload.send_log if any(a - 0.5 <= t0 <= b + 0.5 for a, b, _ in changes)]
        steady = [lat for t0, lat in workload.send_log if not any(a - 0.5 <= t0 <= b + 0.5 for a, b, _ in changes)]
        self.assertTrue(during)
        # No send waited at a router longer than limits.reshard_max_wait_s (2 s here): one that had would
        # have been refused with 503 and retried by its client. (The sends' total latencies are measured by
        # scripts/bench --only reshard, not asserted.)
        self.assertEqual(workload.send_retries, 0)
        self.assertGreater(sum(cluster.metrics(n).get("synflow_shard_sends_held_total", 0)
                               for n in ("master", "persister1")), 0)
        self.report = {"p99_during_ms": quantile(during, 0.99), "p99_steady_ms": quantile(steady, 0.99)}

        # The shard map as the master describes it, and the metrics.
        info = yield self.rpc("shards", {})
        self.assertEqual((info["epoch"], info["writers"], info["pending"]), (2, ["persister1", "persister3"], None))
        self.assertEqual(sum(info["owned"].values()), len(rooms))
        self.assertEqual([h["state"] for h in info["history"]], ["current", "current", "current"])
        metrics = cluster.metrics("master")
        self.assertEqual(metrics['synflow_shard_rooms{writer="persister1"}'] + metrics['synflow_shard_rooms{writer="persister3"}'],
                         len(rooms))
        self.assertEqual(metrics["synflow_shard_handover_seconds_count"], 2)
        self.assertEqual(metrics['synflow_shard_epoch{group="events"}'], 2)

        # The validator over every writer's audit log: clean, sharding_violation included.
        from tests.spark._session import summary, validate, violations

        out = os.path.join(cluster.dir, "validation")
        validate(cluster.shared["audit"]["dir"], out)
        # The prober syncs from each send's token, not along a chain: the validator reports its syncs as
        # broken chains and its events as undelivered along one. Everything else is clean.
        found = violations(out)
        probing = {v["check"] for v in found if v.get("reader") == "@prober:test.local"}
        self.assertLessEqual(probing, {"broken_chain", "undelivered"})
        self.assertEqual([v for v in found if v.get("reader") != "@prober:test.local"], [])
        run = summary(out)
        self.assertIn("sharding_violation", run["parameters"]["checks"])
        self.assertEqual(run["checks"]["sharding_violation"]["count"], 0)
        self.assertEqual(run["inputs"]["writer_logs"]["writers"], 3)  # persister1, 2 and 3 wrote events

    @inlineCallbacks
    def test_failures_mid_handover(self):
        """Under load with every user syncing: a master restarted mid hand-over rolls it back; a later hand-over
        commits; a SIGKILLed old owner is removed; a hand-over to a dead new owner rolls back. Nothing is lost,
        duplicated or reordered, and the validator finds nothing the kills do not explain."""
        cluster = yield self.start(third=False, max_wait_s=60.0)  # the held send waits out a slow restart
        workload = Workload(self.urls[1:], users=12, rooms=60, members_per_room=2, messages=1500, concurrency=8,
                            seed=9)
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        moving = next(r for r in workload.rooms if M1.owner(r) == "persister3" and M0.owner(r) == "persister1")

        # 1. The master dies between proposing and committing: the pending epoch is what it leaves.
        cluster.kill("master")
        _propose_directly(cluster)
        chains = ensureDeferred(workload.sync_chains())
        # A send of a moving room is refused by persister1's fence and held at its router meanwhile.
        member = workload.rooms[moving][0]
        held = ensureDeferred(member.client.at(self.urls[1]).send(moving, {"body": "held"}, "held-1"))
        yield sleep(1.0)
        self.assertFalse(held.called, "a send of a moving room went through during the hand-over")
        sending = ensureDeferred(workload.send_messages(rate_per_s=100))
        yield cluster.start_master(listeners=[{"resources": ["client"],
                                               "endpoint": f"tcp:{free_port()}:interface=127.0.0.1"}])
        sent = yield held  # the roll-back released it to its old owner
        in_db = cluster.query("SELECT instance_name, room_id FROM events WHERE event_id = ?", (sent["event_id"],))
        self.assertEqual(in_db, [("persister1", moving)])
        self.assertGreater(cluster.metrics("persister1").get("synflow_shard_sends_held_total", 0), 0)
        info = yield self.rpc("shards", {})
        self.assertEqual((info["epoch"], info["pending"]), (0, None))
        self.assertEqual([h["state"] for h in info["history"]], ["current", "rolled_back"])

        # 2. A hand-over after the restart commits: synflowctl starts persister3 from its file, then reshards.
        cluster.process_config("persister3", "event_persister")
        self.addCleanup(lambda: _ctl("stop", cluster.dir))
        done = yield threads.deferToThread(_ctl, "reshard", cluster.dir, "--add", "persister3")
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("events epoch 2: add persister3", done.stdout)
        shown = yield threads.deferToThread(_ctl, "shards", cluster.dir)
        self.assertEqual(shown.returncode, 0, shown.stderr)
        self.assertIn("events: epoch 2, writers persister1, persister2, persister3", shown.stdout)
        self.assertIn("  hand-over in progress: none", shown.stdout)
        self.assertIn("epoch 1: add persister3 -> persister1, persister2, persister3 [rolled_back]", shown.stdout)

        # 3. An old owner dies under load; removing it moves its rooms to the others, and the sends go on there.
        cluster.kill("persister2")
        result = yield self.rpc("reshard", {"op": "remove", "writer": "persister2"})
        self.assertEqual((result["epoch"], result["writers"]), (3, ["persister1", "persister3"]))

        # 4. A new owner that is dead cannot follow the new epoch, which rolls back.
        try:
            yield self.rpc("reshard", {"op": "add", "writer": "persister2"})
        except RpcCallError as e:
            self.assertIn("M_HANDOVER_FAILED", str(e))
            self.assertIn("persister2", str(e))
        else:
            self.fail("a hand-over to a dead persister committed")
        info = yield self.rpc("shards", {})
        self.assertEqual((info["epoch"], info["pending"], info["history"][-1]["state"]), (3, None, "rolled_back"))

        yield sending
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        self.assertEqual((report.send_errors, report.sent), (0, 1500))
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches), (0, 0, 0), report.as_dict())
        # A rolled-back epoch is no step of the map: epochs 2 and 3 here map rooms as M1 and M2.
        for room, writers in self.room_writers(cluster).items():
            self.assertIn(writers[-1], {M0.owner(room), M1.owner(room), M2.owner(room)}, room)
        self.assertEqual({w for (w,) in cluster.query("SELECT DISTINCT instance_name FROM events")}, set(ALL))

        # The validator over the audit logs: nothing but what the kills themselves explain.
        from tests.integration.test_faults import lost_with_a_killed_issuer
        from tests.spark._session import validate, violations

        yield threads.deferToThread(_ctl, "stop", cluster.dir)
        for name in ("persister1", "master"):
            yield cluster.stop(name)
        out = os.path.join(cluster.dir, "validation")
        code = validate(cluster.shared["audit"]["dir"], out)
        found = violations(out)
        self.assertEqual([v for v in found if not lost_with_a_killed_issuer(v, cluster)], [])
        self.assertEqual(code, 1 if any(v.get("severity") == "error" for v in found) else 0)


class ReadYourWrites:
    """One user with its own rooms: send on one process, sync from the send's token on the other, in a loop."""

    def __init__(self, urls: list[str]) -> None:
        from synflow.tools.client import new_pool

        self.urls = urls
        self.pool = new_pool()
        self.rooms: list[str] = []
        self.stop = False
        self.probes = 0
        self.failures: list[str] = []
        #: (monotonic start, end) of each probe.
        self.times: list[tuple[float, float]] = []

    def close(self) -> Any:
        return self.pool.closeCachedConnections()

    async def setup(self) -> None:
        from synflow.tools.client import Client

        self.client = await Client(self.urls[0], self.pool).register("prober")
        # Rooms that move in one change or the other (server-made IDs: create until there are six).
        for _ in range(60):
            room = await self.client.create_room()
            if M0.owner(room) != M1.owner(room) or M1.owner(room) != M2.owner(room):
                self.rooms.append(room)
            if len(self.rooms) == 6:
                break

    async def run(self) -> None:
        while not self.stop:
            n = self.probes
            room = self.rooms[n % len(self.rooms)]
            started = time.monotonic()
            sender, reader = self.client.at(self.urls[n % 2]), self.client.at(self.urls[(n + 1) % 2])
            sent = await _obeying_rate_limits(sender.send, room, {"body": f"ryw {n}"}, f"ryw{n}")
            got = await _obeying_rate_limits(reader.sync, since=sent["token"], timeout_ms=10_000)
            first = got["events"][0]["event_id"] if got["events"] else None
            if first != sent["event_id"]:
                self.failures.append(f"probe {n} in {room}: sync from the send's token began with {first}")
            self.probes += 1
            self.times.append((started, time.monotonic()))


async def _obeying_rate_limits(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, made again after the wait a 429 asks for, as a client does (one user probing
    in a tight loop passes the sync rate limit on a fast machine)."""
    from synflow.tools.client import ApiError, retry_delay_s

    while True:
        try:
            return await call(*args, **kwargs)
        except ApiError as e:
            if e.code != 429:
                raise
            await sleep(retry_delay_s(e))


def _propose_directly(cluster: Cluster) -> None:
    """Write a pending epoch (add persister3) as a master does before it prepares the processes."""
    import json

    statements = [
        ("INSERT INTO shard_epochs (stream, epoch, op, writer, writers, address, state, floor_position, proposed_ts) "
         "VALUES ('events', 0, 'base', '', ?, NULL, 'current', 0, 0)", (json.dumps(list(WRITERS)),)),
        ("INSERT INTO shard_epochs (stream, epoch, op, writer, writers, address, state, floor_position, proposed_ts) "
         "VALUES ('events', 1, 'add', 'persister3', ?, NULL, 'pending', 0, 0)", (json.dumps(list(ALL)),)),
        ("UPDATE shard_state SET pending = 1 WHERE stream = 'events'", ()),
    ]
    if cluster.engine == "postgres":
        from tests import services

        conn = services.pg_connect(cluster.dbname)
        cur = conn.cursor()
        for sql, args in statements:
            cur.execute(sql.replace("?", "%s"), args)
    else:
        import sqlite3

        conn = sqlite3.connect(cluster.shared["database"]["path"])
        for sql, args in statements:
            conn.execute(sql, args)
    conn.commit()
    conn.close()


def _ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "synflowctl"), *args],
                          capture_output=True, text=True, timeout=120)


def _is_subsequence(items: list[str], of: list[str]) -> bool:
    it = iter(of)
    return all(any(x == y for y in it) for x in items)


class SqliteTcpReshardTest(ReshardMixin, TestCase):
    engine = "sqlite"
    transport = "tcp"


class PostgresRedisReshardTest(ReshardMixin, TestCase):
    engine = "postgres"
    transport = "redis"


class FederationSendersMixin:
    """1 -> 2 federation senders under continuous traffic to eight destinations (one recording receiver)."""

    engine = "sqlite"
    transport = "tcp"
    timeout = 400
    DESTINATIONS = [f"d{i}.test" for i in range(8)]

    @inlineCallbacks
    def test_one_to_two_senders_under_load(self):
        """sender2 joins while messages flow: each destination gets every message once, in room order."""
        from tests.integration.test_federation import (
            FederationPair,
            assert_same_rooms_in_order,
            messages,
            metric,
        )
        from tests.integration.test_federation_catch_up import RecordingReceiver

        receiver = RecordingReceiver(self)
        yield receiver.start()
        client_port = free_port()
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS, server_name="a.test",
                          extra_instances=("sender1", "sender2"),
                          shared={"federation_sender_instances": ["sender1"],
                                  "federation": {**FederationPair.federation,
                                                 "destinations": {d: f"http://127.0.0.1:{receiver.port}"
                                                                  for d in self.DESTINATIONS}}})
        yield cluster.start_master(listeners=[{"resources": ["client"],
                                               "endpoint": f"tcp:{client_port}:interface=127.0.0.1"}])
        for name in WRITERS:
            cluster.start_twistd(name, "event_persister")
        for name in ("sender1", "sender2"):
            cluster.start_twistd(name, "federation_sender")
        for name in (*WRITERS, "sender1", "sender2"):
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        config = load_config([cluster.shared_path, cluster.process_config("master", "master")])
        from synflow.tools.client import Client, new_pool

        pool = new_pool()
        self.addCleanup(pool.closeCachedConnections)
        alice = yield ensureDeferred(Client(f"http://127.0.0.1:{client_port}", pool).register("alice"))
        rooms = []
        for i in range(16):
            room = yield ensureDeferred(alice.create_room())
            yield ensureDeferred(alice.invite(room, f"@bob:{self.DESTINATIONS[i % 8]}"))
            rooms.append(room)
        m1 = ShardMap(["sender1"]).then(ShardStep("add", "sender2"))
        moving = [d for d in self.DESTINATIONS if m1.owner(d) == "sender2"]
        self.assertTrue(moving)

        sent: list[str] = []

        async def send_all(start: int, n: int) -> None:
            for i in range(start, start + n):
                result = await alice.send(rooms[i % len(rooms)], {"body": f"m{i}"}, f"t{i}")
                sent.append(result["event_id"])

        sending = ensureDeferred(send_all(0, 480))
        while len(sent) < 100:
            yield sleep(0.05)
        result = yield threads.deferToThread(call_rpc, config, "master", "reshard",
                                             {"op": "add", "writer": "sender2", "group": "federation"})
        self.assertEqual((result["epoch"], result["writers"], result["moved"]), (1, ["sender1", "sender2"], len(moving)))
        self.assertFalse(sending.called, "the sends finished before sender2 joined")
        yield sending
        yield wait_until(lambda: {e for _, e, _ in receiver.messages()} >= set(sent), 120,
                         "every message to reach its destination")
        yield sleep(1.0)  # anything sent twice would arrive by now
        assert_same_rooms_in_order(self, messages(cluster), receiver.messages(), "a.test")
        # sender2 sent the moved destinations' transactions after the hand-over; sender1 kept the others.
        self.assertGreater(metric(cluster, "sender2", "synflow_federation_transactions_sent_total"), 0)
        info = yield threads.deferToThread(call_rpc, config, "master", "shards", {"group": "federation"})
        self.assertEqual(info["owned"], {"sender1": 8 - len(moving), "sender2": len(moving)})
        # Each group's epoch is its own: the senders' changed, the rooms' did not.
        self.assertEqual((metric(cluster, "sender2", "synflow_shard_epoch", group="federation"),
                          metric(cluster, "sender2", "synflow_shard_epoch", group="events")), (1, 0))


class SqliteTcpFederationSendersTest(FederationSendersMixin, TestCase):
    engine = "sqlite"
    transport = "tcp"


class PostgresRedisFederationSendersTest(FederationSendersMixin, TestCase):
    engine = "postgres"
    transport = "redis"
