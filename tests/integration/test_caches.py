"""Caches across real processes: never stale past a position, and the invalidator restarts safely."""

from __future__ import annotations

import random
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tokens import StreamToken
from synflow.tools.client import Client, new_pool
from tests import services
from tests.cluster import Cluster, free_port, sleep

WRITERS = ("persister1", "persister2")


def membership_events(cluster: Cluster, room_id: str) -> list[tuple[str, int, str, str]]:
    """(writer, stream_ordering, user, membership) of a room's membership events, in order."""
    rows = cluster.query("SELECT instance_name, stream_ordering, state_key, membership FROM events "
                         "WHERE room_id = ? AND type = 'm.room.member' ORDER BY stream_ordering", (room_id,))
    return [(w, int(sid), u, m) for w, sid, u, m in rows]


def instance_ids(cluster: Cluster) -> dict[str, int]:
    return dict(cluster.query("SELECT instance_name, instance_id FROM instance_map"))


def allowed_members(events, token: StreamToken, ids: dict[str, int]) -> tuple[set[str], set[str]]:
    """Users who must be members / must not be members of a read at ``token``.

    A user's state at the token is that of their last membership event the
    token covers; a later (uncovered) change may or may not show yet.
    """
    state_at: dict[str, str] = {}
    later: dict[str, set[str]] = {}
    for writer, sid, user, membership in events:
        if sid <= token.get(ids[writer]):
            state_at[user] = membership
            later.pop(user, None)
        else:
            later.setdefault(user, set()).add(membership)
    must = {u for u, m in state_at.items() if m == "join" and "leave" not in later.get(u, set())}
    must_not = {u for u, m in state_at.items() if m != "join" and "join" not in later.get(u, set())}
    return must, must_not


class CacheMixin:
    engine = "sqlite"
    transport = "tcp"
    tier = False
    timeout = 300

    @inlineCallbacks
    def start(self):
        shared = {}
        if self.tier:
            services.require_redis()
            shared = {"caches": {"tier": {"host": services.REDIS_HOST, "port": services.REDIS_PORT,
                                          "channel_prefix": services.redis_prefix()}}}
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS,
                          extra_instances=("cache_invalidator1",), shared=shared)
        cluster.shared["caches"] = {**cluster.shared.get("caches", {}), "cache_invalidator_instances": ["cache_invalidator1"]}
        cluster.shared_path = cluster.write("shared.yaml", cluster.shared)
        self.ports = {"master": free_port(), "persister1": free_port()}
        self.metrics_port = free_port()
        yield cluster.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.ports['master']}:interface=127.0.0.1"},
            {"resources": ["metrics"], "endpoint": f"tcp:{self.metrics_port}:interface=127.0.0.1"},
        ])
        cluster.start_twistd("persister1", "event_persister",
                             listeners=[{"resources": ["client"], "endpoint": f"tcp:{self.ports['persister1']}:interface=127.0.0.1"}])
        cluster.start_twistd("persister2", "event_persister")
        cluster.start_twistd("cache_invalidator1", "cache_invalidator")
        for name in ("persister1", "persister2", "cache_invalidator1"):
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        yield cluster.wait_for_port(self.ports["persister1"], "persister1")
        self.pool = new_pool()
        self.addCleanup(self.pool.closeCachedConnections)
        return cluster

    async def _interleave(self, cluster: Cluster, rounds: int, kill_invalidator: bool = False) -> None:
        a_url = f"http://127.0.0.1:{self.ports['persister1']}"
        b_url = f"http://127.0.0.1:{self.ports['master']}"
        owner = await Client(a_url, self.pool).register("owner")
        room = await owner.create_room()
        users = [await Client(a_url, self.pool).register(f"m{i}") for i in range(6)]
        reader = owner.at(b_url)
        rng = random.Random(5)
        joined: set[int] = set()
        reads = []
        for step in range(rounds):
            i = rng.randrange(len(users))
            if i in joined:
                await users[i].leave(room)
                joined.discard(i)
            else:
                await users[i].join(room)
                joined.add(i)
            for _ in range(rng.randrange(1, 4)):
                reads.append(await reader.members(room))
            if kill_invalidator and step == rounds // 2:
                cluster.kill("cache_invalidator1")
            if kill_invalidator and step == rounds // 2 + 5:
                cluster.start_twistd("cache_invalidator1", "cache_invalidator")
        ids = instance_ids(cluster)
        events = membership_events(cluster, room)
        for read in reads:
            token = StreamToken.parse(read["token"])
            must, must_not = allowed_members(events, token, ids)
            members = set(read["members"])
            self.assertEqual(must - members, set(), f"stale read at {read['token']}: missing {must - members}")
            self.assertEqual(members & must_not, set(), f"stale read at {read['token']}: still has {members & must_not}")
        self.room = room
        self.expected_final = {u.user_id for i, u in enumerate(users) if i in joined} | {owner.user_id}

    @inlineCallbacks
    def test_membership_never_stale_past_position(self):
        """Reads on the master at token T reflect every join and leave made through a persister up to T."""
        cluster = yield self.start()
        yield ensureDeferred(self._interleave(cluster, 60))
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        hits = [s for s in families["synflow_cache_hits"].samples if s.labels.get("cache") == "get_users_in_room"]
        misses = [s for s in families["synflow_cache_misses"].samples if s.labels.get("cache") == "get_users_in_room"]
        self.assertTrue(hits and misses, "cache hit/miss metrics missing from /metrics")
        self.assertGreater(sum(s.value for s in misses), 0)


class SqliteCacheTest(CacheMixin, TestCase):
    pass


class PostgresRedisTierCacheTest(CacheMixin, TestCase):
    engine = "postgres"
    transport = "redis"
    tier = True

    @inlineCallbacks
    def test_invalidator_killed_and_restarted(self):
        """With the invalidator SIGKILLed and restarted mid-run, the tier never serves a stale membership."""
        cluster = yield self.start()
        yield ensureDeferred(self._interleave(cluster, 40, kill_invalidator=True))
        yield sleep(2.0)
        # A fresh master has nothing cached locally: it reads through the tier.
        yield cluster.stop("master")
        yield cluster.start_master(listeners=[
            {"resources": ["client"], "endpoint": f"tcp:{self.ports['master']}:interface=127.0.0.1"},
            {"resources": ["metrics"], "endpoint": f"tcp:{self.metrics_port}:interface=127.0.0.1"},
        ])
        yield cluster.wait_for_port(self.ports["master"], "master")
        reader = Client(f"http://127.0.0.1:{self.ports['master']}", self.pool)
        yield ensureDeferred(reader.register("late-reader"))
        result = yield ensureDeferred(reader.members(self.room))
        self.assertEqual(set(result["members"]), self.expected_final)
